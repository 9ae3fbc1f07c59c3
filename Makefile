# minillm — the book and its engine. Run `make help` for the targets.
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
NBVAL_TIMEOUT ?= 600
export PYTHONHASHSEED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

.PHONY: help install export clean-notebooks test unit nbval book book-strict model bench clean setup-cells figures

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt -e ".[book,test]"
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install minillm with the book and test extras

export: $(STAMP)  ## notebooks -> minillm/ (nbdev export)
	$(PY) tools/export.py

clean-notebooks: $(STAMP)  ## strip outputs and execution counts from chapters/*.ipynb
	$(PY) tools/clean_notebooks.py

unit: $(STAMP)  ## pytest: unit tests, export-in-sync and clean-notebook checks
	$(PY) -m pytest -q tests

nbval: $(STAMP)  ## run every chapter notebook top to bottom (nbval, lax)
	$(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=$(NBVAL_TIMEOUT) -p no:randomly chapters

book-strict: $(STAMP)  ## strict website build (-W -n), notebooks not executed again
	@mkdir -p _build
	sed -e 's/execute_notebooks: *force/execute_notebooks: "off"/' _config.yml > _build/_config_noexec.yml
	$(VENV)/bin/jupyter-book build . --config _build/_config_noexec.yml --path-output _build/strict -W -n --keep-going --all -q

test: unit nbval book-strict  ## the whole suite (what CI runs)
	@echo "make test: all green"

book: export  ## build the website with every chapter executed
	$(VENV)/bin/jupyter-book build . --all
	@ls _build/html/_images/*.png >/dev/null 2>&1 || { echo "no figures in the book: is MPLBACKEND set to a non-inline backend?"; exit 1; }
	@echo "The book is at: $(CURDIR)/_build/html/index.html"

model: $(STAMP)  ## re-train the bundled tiny Shakespeare model into data/tiny-shakespeare
	$(PY) data/make_tiny_model.py

bench: $(STAMP)  ## KV-cache benchmark on both model shapes; writes data/benchmarks/*.csv
	$(PY) -m minillm.bench kv --model bundled --new-tokens 100 --prompt-tokens 256 --repeats 5 --threads 1
	$(PY) -m minillm.bench kv --model smollm2-135m --new-tokens 100 --prompt-tokens 256 --repeats 3 --threads 1

clean:  ## remove build output (keeps .venv)
	rm -rf _build .pytest_cache

setup-cells: $(STAMP)  ## write the repository URL from _config.yml into every chapter's setup cell
	$(PY) tools/setup_cell.py

figures: $(STAMP)  ## redraw the "you are here" maps book/figures/engine_map_0N.svg
	$(PY) tools/engine_map.py
