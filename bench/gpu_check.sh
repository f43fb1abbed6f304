#!/usr/bin/env bash
# bench/gpu_check.sh — the device check (issues 37, 42): two calls of the run tool inside one 15-minute GPU
# loan, every part under its own `timeout -k`; rehearsed on the CPU first (bench/gpu_rehearsal.sh).
#
#   python bench/gpu_assets.py                # here, once: .cache/gpu_assets (tokenizers + site/, ~6 MiB)
#   bash bench/gpu_rehearsal.sh               # here: every part on the CPU in a venv of the device's versions
#   bash bench/gpu_check.sh call1             # device call 1: run tool, carry [".cache/gpu_assets"],
#                                             #   timeout_s 450
#   bash bench/gpu_check.sh call2             # device call 2, within the 30 s warm window: timeout_s 300
#   bash bench/gpu_check.sh env smoke-paper   # any parts, in this order; no argument: call1 then call2
#
# The loan: the machine's start (1-2 min) + call 1 (at most 425 s: its parts' limits, 5 s grace each) +
# call 2 (at most 300 s) ≈ 14.5 min of the 15 at worst. Call 1 alone answers the two headline targets
# (a paper-shape DATPO step <= 60 s; DATPO / GRPO step time <= 1.2); call 2 measures the kernels and the
# engine against its floors. If call 1 ran long, skip call 2 and give the machine back.
#
# No network there: the policy is a random model of Qwen2.5-3B's shape (bench/gpu_smoke.random_policy), the
# embedder random weights of all-mpnet-base-v2's shape, built in /tmp there (gpu_smoke.random_embedder),
# both over the carried tokenizers (DATPO_CACHE). The image lacks pysbd and math-verify: they travel in
# DATPO_CACHE/site, put on PYTHONPATH here; `python bench/needs.py` (env) says where each module came from,
# and every part checks its own modules first (one line naming what is missing). Each part writes
# $OUT/<part>.txt (stdout and stderr); $OUT/summary.txt lists its exit status and seconds (124 or 137: cut
# at its limit; every part prints each row as it ends, so what it printed so far is kept).
#
#   call 1
#   env          the GPU, Python, torch, CUDA, transformers, triton; every part's modules and their origin  20 s
#   engine       the paged step on CUDA (CUDA graphs per bucket) grows HF generate's greedy trees token for
#                token, tiny model (tests/test_paged.py -k cuda; pytest without xdist: pyproject's
#                addopts, -n auto, would start 16 workers before the first compile)                     75 s
#   smoke-paper  one DATPO step (--preset paper) at the paper's shape (16 prompts × 1,024 new tokens, PPO
#                epochs 2), phase by phase with each phase's FLOP estimate: rollout, embedding, update
#                (checkpoint skipped); tokens generated and trained; seconds per step (bench/gpu_smoke.py) 200 s
#   smoke-grpo   one GRPO step at the same shape (16 × 16); then DATPO / GRPO seconds per step          110 s
#   call 2
#   attention    decode attention candidates on one layer of Qwen2.5-3B's shape, 64 and 256 rows × 1,024
#                tokens: the reference (which SDPA backends take it), GQA packed with an additive mask,
#                paged FlexAttention (the engine's); varlen with a block table is unavailable on torch 2.11
#                (its row says why) (bench/bench_decode_attention.py)                                     60 s
#   update       the packed update's attention kernels on all 36 layers (bench/bench_attention.py)        80 s
#   rollout      the engine (paged, graphs) vs the eager floor vs the graph floor vs HF generate, GRPO-like
#                rows × 128 new tokens at 64 and 256 rows, bf16; graph floor / weight-read time
#                (bench/bench_rollout.py --shapes a --rows 64 256)                                      140 s
#
# DATPO_CHECK_DEVICE=cpu runs the same parts through the same entry points on the CPU at toy shapes (2-layer
# models; limits of 900 s): what bench/gpu_rehearsal.sh runs. PYTHON picks the interpreter (default python).
{   # read whole before it runs: an edit while it runs cannot change what it does
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
DEVICE="${DATPO_CHECK_DEVICE:-cuda}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
export DATPO_CACHE="${DATPO_CACHE:-$PWD/.cache/gpu_assets}"
export PYTHONPATH="$DATPO_CACHE/site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# pysbd 0.3.4's regexes are not raw strings: Python 3.12 warns at each compile of the carried copy
export PYTHONWARNINGS="ignore::SyntaxWarning"
case "$DEVICE" in
  cuda | cpu) ;;
  *) echo "gpu_check.sh: DATPO_CHECK_DEVICE=$DEVICE: expected cuda (the default) or cpu" >&2; exit 2 ;;
esac

CALL1=(env engine smoke-paper smoke-grpo)
CALL2=(attention update rollout)
parts=()
for arg in "${@:-call1 call2}"; do
  for word in $arg; do
    case "$word" in
      call1) parts+=("${CALL1[@]}") ;;
      call2) parts+=("${CALL2[@]}") ;;
      env | engine | smoke-paper | smoke-grpo | attention | update | rollout) parts+=("$word") ;;
      *) echo "gpu_check.sh: unknown part '$word'; expected call1, call2, ${CALL1[*]} ${CALL2[*]}" >&2
         exit 2 ;;
    esac
  done
done

limit() {   # limit SECONDS: the part's limit on the device; 900 s on the CPU (a toy shape, a shared machine)
  if [ "$DEVICE" = cuda ]; then echo "$1"; else echo 900; fi
}

part() {   # part NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  [ "$rc" = 0 ] || failed=1
  local command="$*"
  command="${command%%$'\n'*}"
  echo "$name rc=$rc $(( $(date +%s) - start ))s (limit ${limit}s): ${command:0:150}" | tee -a "$OUT/summary.txt"
  # progress bars redraw with \r: one line per redraw, then dropped
  tr '\r' '\n' < "$OUT/$name.txt" | grep -v -e "it/s\]" -e "^Loading weights" -e "s/it\]" -e "^ *$" | tail -n 25
}

step_seconds() {   # step_seconds PRESET: gpu_smoke's mean seconds per step of that preset's part
  sed -n "s/^  mean seconds per step of $1: //p" "$OUT/smoke-$1.txt" 2>/dev/null | tail -n 1
}

run_part() {
  local pytest_k smoke_shape
  if [ "$DEVICE" = cuda ]; then
    pytest_k="cuda"
    smoke_shape=(--steps 1 --skip_checkpoint)
  else   # the CUDA test skips here: the paged step's CPU test of the same file stands in for it
    pytest_k="cuda or (paged_greedy_trees_equal_generate_trees and llama)"
    smoke_shape=(--device cpu --steps 1 --skip_checkpoint --prompts 2 --max_new_tokens 6 --ppo_epochs 1
                 --extra --group_size 4 --gen_batch_size 8 --max_tokens_per_micro_batch 256)
  fi
  case "$1" in
    env)
      part env "$(limit 20)" sh -c '
        if [ "$0" = cuda ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
        "$1" -c "
import sys, torch, transformers, triton, inspect
print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\",
      transformers.__version__, \"triton\", triton.__version__)
from torch.nn.attention import varlen
print(\"varlen_attn:\", inspect.signature(varlen.varlen_attn))" && "$1" bench/needs.py' "$DEVICE" "$PY" ;;
    engine)
      part engine "$(limit 75)" sh -c '"$0" bench/needs.py engine && "$0" -m pytest -q -p no:cacheprovider \
        -p no:xdist -o addopts="" tests/test_paged.py -k "$1"' "$PY" "$pytest_k" ;;
    smoke-paper)
      part smoke-paper "$(limit 200)" "$PY" bench/gpu_smoke.py --presets paper "${smoke_shape[@]}" ;;
    smoke-grpo)
      part smoke-grpo "$(limit 110)" "$PY" bench/gpu_smoke.py --presets grpo "${smoke_shape[@]}"
      local a b
      a=$(step_seconds paper) b=$(step_seconds grpo)
      if [ -n "$a" ] && [ -n "$b" ]; then
        awk -v a="$a" -v b="$b" 'BEGIN { printf "seconds per step paper / grpo: %.1f / %.1f = %.2f\n",
                                          a, b, a / b }' | tee -a "$OUT/summary.txt"
      fi ;;
    attention)
      if [ "$DEVICE" = cuda ]; then
        part attention "$(limit 60)" "$PY" bench/bench_decode_attention.py --rows 64 256 --context 1024 \
          --repeats 10
      else
        part attention "$(limit 60)" "$PY" bench/bench_decode_attention.py --device cpu
      fi ;;
    update)
      if [ "$DEVICE" = cuda ]; then
        part update "$(limit 80)" "$PY" bench/bench_attention.py --layers 36 --repeats 2
      else
        part update "$(limit 80)" "$PY" bench/bench_attention.py --device cpu --budget 512 --repeats 1
      fi ;;
    rollout)
      if [ "$DEVICE" = cuda ]; then
        part rollout "$(limit 140)" "$PY" bench/bench_rollout.py --model random-qwen2.5-3b --device cuda \
          --precision bf16 --shapes a --rows 64 256 --max_new_tokens 128
      else
        part rollout "$(limit 140)" "$PY" bench/bench_rollout.py --model random-qwen2.5-tiny --device cpu \
          --precision fp32 --shapes a --rows 8 --max_new_tokens 8
      fi ;;
  esac
}

failed=0
: > "$OUT/summary.txt"
echo "device $DEVICE; parts: ${parts[*]}" | tee -a "$OUT/summary.txt"
for name in "${parts[@]}"; do
  run_part "$name"
done
echo "tables in $OUT; summary:"
cat "$OUT/summary.txt"
exit "$failed"   # 1 when any part did not exit 0
}
