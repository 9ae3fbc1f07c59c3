# minillm — the book and its engine. Run `make help` for the targets.
PYTHON  ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
NBVAL_TIMEOUT ?= 600
# A CPU-only machine can skip PyTorch's CUDA download (several GB) with PyTorch's CPU index:
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
export PYTHONHASHSEED := 0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
# The website shows no progress bars (Jupyter still does): tqdm reads TQDM_DISABLE.
BOOK_ENV := TQDM_DISABLE=1
JB      := $(BOOK_ENV) $(VENV)/bin/jupyter-book

.PHONY: help install lock sandbox export clean-notebooks test unit nbval site site-from-nbval browser colab book \
	book-strict lab figures model bench gpu-check gpu-wheels clean setup-cells nbval-loaded

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

# The environment is requirements.lock, exactly (every distribution, transitive ones
# included): `make lock` re-resolves it from constraints.txt and pyproject.toml's extras;
# tests/test_lock.py fails when what is installed differs from it.
$(STAMP): pyproject.toml requirements.lock requirements-nodeps.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$$(grep -m1 '^pip==' requirements.lock)"
	$(if $(TORCH_INDEX),$(PIP) install -q -c requirements.lock torch --index-url $(TORCH_INDEX))
	$(PIP) install -q -r requirements.lock
	$(PIP) install -q --no-deps -e .
	$(PIP) install -q --no-deps -r requirements-nodeps.txt
	$(PY) tools/lock.py --sync
	$(PY) tools/lock.py --check
	$(PY) -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

install: $(STAMP)  ## create .venv and install exactly requirements.lock, and minillm itself

lock:  ## re-resolve requirements.lock from constraints.txt and pyproject.toml (then make install)
	$(PYTHON) tools/lock.py $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX))

lab: $(STAMP)  ## open the chapter notebooks in JupyterLab
	$(VENV)/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/chapters \
	    $(if $(filter 0,$(shell id -u)),--allow-root)

export: $(STAMP)  ## notebooks -> minillm/ (nbdev export)
	$(PY) tools/export.py

clean-notebooks: $(STAMP)  ## strip outputs and execution counts from chapters/*.ipynb
	$(PY) tools/clean_notebooks.py

unit: $(STAMP)  ## pytest: unit tests, package-in-sync, lint and repository checks
	$(PY) -m pytest -q tests

# `make nbval` keeps each chapter it executed, with its outputs, in $(EXECUTED) (tools/nbval_executed.py);
# `make site-from-nbval` builds the website from those outputs: `make test` runs every chapter once.
# nbval runs in the website's environment ($(BOOK_ENV)), so the outputs are the ones `make site` shows.
EXECUTED := _build/executed
STAGED  := _build/staged

# CHAPTERS=03 (or "03 07", or chapters/03_kv_cache.ipynb) runs a subset; the default is every chapter.
CHAPTERS ?=
NBVAL_PATHS = $(if $(CHAPTERS),$(or $(strip $(foreach c,$(CHAPTERS),$(or $(wildcard $(c)),$(wildcard chapters/$(c)*.ipynb)))),$(error CHAPTERS=$(CHAPTERS): no notebook in chapters/ matches)),chapters)
NBVAL   = $(BOOK_ENV) $(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=$(NBVAL_TIMEOUT) -p no:randomly

nbval: $(STAMP)  ## run every chapter notebook top to bottom (nbval, lax); keeps the outputs in _build/executed
	$(NBVAL) -p tools.nbval_executed --nbval-executed-dir=$(EXECUTED) $(NBVAL_PATHS)

# A timing claim a chapter asserts must hold on a busy machine (a CI runner shares its cores):
# `make nbval-loaded` runs nbval as `make nbval` does (keeping no outputs) while tools/cpu_hog.py
# keeps HOG_PROCS cores spinning (default: all of them); the hog is stopped whatever the result.
HOG_PROCS ?= $(shell nproc 2>/dev/null || echo 2)

nbval-loaded: $(STAMP)  ## nbval with every core kept busy by tools/cpu_hog.py (CHAPTERS=03 07: a subset)
	@$(PY) tools/cpu_hog.py $(HOG_PROCS) & hog=$$!; \
	trap 'kill $$hog 2>/dev/null; wait $$hog 2>/dev/null' EXIT INT TERM; \
	$(NBVAL) $(NBVAL_PATHS)

site: $(STAMP)  ## strict website build (-W -n) with every chapter executed, into _build/html
	$(JB) build . --all -W -n --keep-going -q
	@ls _build/html/_images/*.png >/dev/null 2>&1 || { echo "no figures in the book: is MPLBACKEND set to a non-inline backend?"; exit 1; }

site-from-nbval: $(STAMP)  ## strict website build (-W -n) from the outputs of `make nbval` (executes nothing), into _build/html
	$(PY) tools/stage_executed_book.py --executed $(EXECUTED) --out $(STAGED)
	$(JB) build $(STAGED) --path-output . --all -W -n --keep-going -q
	cp chapters/*.ipynb _build/html/_sources/chapters/  # the download button: the clean notebooks, as in `make site`
	@ls _build/html/_images/*.png >/dev/null 2>&1 || { echo "no figures in the book: did nbval run with MPLBACKEND set to a non-inline backend?"; exit 1; }

browser: $(STAMP)  ## open every page of the built site (make site or site-from-nbval) in headless Chromium
	$(PY) -m pytest -q -m browser -p no:randomly tests/browser

colab: $(STAMP)  ## the Colab path: fresh venv with torch only, the setup cell's install, chapter 0
	$(PY) -m pytest -q -m colab -p no:randomly tests/test_colab.py

# `make test` runs in a sandbox of its own, emptied first: its temp folder, home and every
# cache it writes to (Hugging Face, matplotlib, torch.compile, Jupyter, pip) live in
# $(SANDBOX), so nothing an earlier run left behind can hide a broken path.
# SANDBOX_PIP_CACHE=shared keeps pip's download cache (content-addressed, so it cannot go
# stale) for the Colab test's install; the default is empty, like everything else.
SANDBOX := $(CURDIR)/_build/sandbox
SANDBOX_DIRS := home tmp cache config data hf mpl inductor triton torch ipython pip
SANDBOX_PIP_CACHE ?= empty
SANDBOX_ENV = MINILLM_SANDBOX=$(SANDBOX) HOME=$(SANDBOX)/home TMPDIR=$(SANDBOX)/tmp \
	XDG_CACHE_HOME=$(SANDBOX)/cache XDG_CONFIG_HOME=$(SANDBOX)/config \
	XDG_DATA_HOME=$(SANDBOX)/data HF_HOME=$(SANDBOX)/hf MPLCONFIGDIR=$(SANDBOX)/mpl \
	TORCHINDUCTOR_CACHE_DIR=$(SANDBOX)/inductor TRITON_CACHE_DIR=$(SANDBOX)/triton \
	TORCH_HOME=$(SANDBOX)/torch IPYTHONDIR=$(SANDBOX)/ipython \
	JUPYTER_CONFIG_DIR=$(SANDBOX)/config/jupyter JUPYTER_DATA_DIR=$(SANDBOX)/data/jupyter \
	PIP_CACHE_DIR=$(if $(filter shared,$(SANDBOX_PIP_CACHE)),$$($(PIP) cache dir),$(SANDBOX)/pip)

sandbox:
	rm -rf $(SANDBOX)
	mkdir -p $(addprefix $(SANDBOX)/,$(SANDBOX_DIRS))

test: $(STAMP) sandbox  ## the whole suite (what CI runs), in an emptied sandbox; executes each chapter once
	$(SANDBOX_ENV) $(MAKE) --no-print-directory unit nbval site-from-nbval browser colab
	@echo "make test: all green"

book: export  ## build the website with every chapter executed
	$(JB) build . --all
	@ls _build/html/_images/*.png >/dev/null 2>&1 || { echo "no figures in the book: is MPLBACKEND set to a non-inline backend?"; exit 1; }
	@echo "The book is at: $(CURDIR)/_build/html/index.html"

book-strict: $(STAMP)  ## quick strict website build (-W -n) without executing the notebooks
	@mkdir -p _build
	sed -e 's/execute_notebooks: *force/execute_notebooks: "off"/' \
	    -e 's|minillm_sphinx: book/_ext|minillm_sphinx: $(CURDIR)/book/_ext|' _config.yml > _build/_config_noexec.yml
	$(JB) build . --config _build/_config_noexec.yml --path-output _build/strict -W -n --keep-going --all -q

figures: $(STAMP)  ## redraw the "you are here" maps book/figures/engine_map_0N.svg
	$(PY) tools/engine_map.py

model: $(STAMP)  ## re-train the bundled tiny Shakespeare model into data/tiny-shakespeare
	$(PY) data/make_tiny_model.py

bench: $(STAMP)  ## KV-cache (ch. 3), serving (ch. 4), INT8 (ch. 5), paged-KV (ch. 6), decode (ch. 7), speculative (ch. 10) and structured-output (ch. 11) benchmarks; writes data/benchmarks/*.csv
	$(PY) -m minillm.bench kv --model bundled --new-tokens 100 --prompt-tokens 256 --repeats 5 --threads 1 --out data/benchmarks
	$(PY) -m minillm.bench kv --model smollm2-135m --new-tokens 100 --prompt-tokens 256 --repeats 3 --threads 1 --out data/benchmarks
	$(PY) -m minillm.bench serving --model bundled --requests 64 --max-num-seqs 32 --threads 2 --out data/benchmarks
	$(PY) -m minillm.bench serving --model bundled --requests 64 --max-num-seqs 32 --rate 4 --threads 2 --out data/benchmarks
	$(PY) -m minillm.bench quant --model bundled --new-tokens 32 --repeats 3 --threads 2 --out data/benchmarks
	$(PY) -m minillm.bench quant --model SmolLM2-135M --modes float32 w8a16 w8a8 fbgemm bnb-int8 --new-tokens 32 --prompt-tokens 64 --repeats 5 --threads 2 --out data/benchmarks
	$(PY) -m minillm.bench paged --model bundled --requests 48 --kv-positions 3072 --max-model-len 512 --prompt-tokens 32 160 --output-tokens 128 320 --threads 1 --out data/benchmarks
	$(PY) -m minillm.bench paged --model bundled --requests 48 --kv-positions 3072 --max-model-len 512 --shared-prefix 256 --prompt-tokens 8 32 --output-tokens 32 96 --rate 2 --threads 1 --out data/benchmarks
	$(PY) -m minillm.bench decode --model bundled --batch 1 16 --threads 2 --out data/benchmarks
	$(PY) -m minillm.bench decode --model SmolLM2-135M --batch 1 16 --repeats 2 --threads 2 --out data/benchmarks
	$(PY) -m minillm.bench spec --model smollm2-135m-instruct --threads 1 --out data/benchmarks
	$(PY) -m minillm.bench structured --model smollm2-135m-instruct --threads 1 --out data/benchmarks

gpu-check:  ## the GPU checks, sized for 10 minutes (tools/gpu_check.sh; results in $$OUT); GPU_CHECK_DRY=1: a dry run here
	tools/gpu_check.sh

gpu-wheels:  ## the wheels an offline GPU machine lacks, into .whl/ (tools/gpu_wheels.sh; gpu-check installs them)
	tools/gpu_wheels.sh

clean:  ## remove build output (keeps .venv)
	rm -rf _build .pytest_cache

setup-cells: $(STAMP)  ## write the repository URL from _config.yml into every chapter's setup cell
	$(PY) tools/setup_cell.py
