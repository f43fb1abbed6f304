#!/usr/bin/env bash
# bench/gpu_check.sh — issue 37's device check: one script, at most 8 minutes of a 15-minute GPU loan
# (room to run it twice), every part under its own `timeout -k`.
#
#   python bench/gpu_assets.py       # here, once: the tokenizers the device needs (.cache/gpu_assets, 4 MiB)
#   bash bench/gpu_check.sh          # on the device (run tool: carry [".cache/gpu_assets"]); tables in $OUT
#
# No network there: the policy is a random model of Qwen2.5-3B's shape (bench/gpu_smoke.random_policy), the
# embedder random weights of all-mpnet-base-v2's shape (gpu_smoke.random_embedder), both over the carried
# tokenizers (DATPO_CACHE). Each part writes $OUT/<part>.txt (stdout and stderr); $OUT/summary.txt lists its
# exit status and seconds (124 or 137: cut at its limit; what it printed so far is kept, and gpu_smoke prints
# every phase as it ends).
#
#   env        the GPU, torch, transformers, triton                                                     15 s
#   engine     the paged step on CUDA (CUDA graphs per bucket) grows HF generate's greedy trees token for
#              token, tiny model (tests/test_paged.py -k cuda)                                          55 s
#   attention  decode attention candidates on one layer of Qwen2.5-3B's shape, 64 and 256 rows × 1,024
#              tokens: the reference (which SDPA backends take it), GQA packed with an additive mask,
#              paged FlexAttention (the engine's), varlen with a block table; ms per call, |Δ| vs the
#              reference (bench/bench_decode_attention.py)                                              55 s
#   rollout    the engine (paged, graphs) vs the eager floor vs the graph floor vs HF generate, GRPO-like
#              rows × 128 new tokens at 64 and 256 rows, bf16; graph floor / weight-read time
#              (bench/bench_rollout.py --shapes a --rows 64 256)                                       130 s
#   smoke      one DATPO step (--preset paper) and one GRPO step at the paper's shapes (16 prompts × 1,024
#              new tokens, PPO epochs 2), phase by phase: rollout, embedding, update (checkpoints skipped
#              to fit); tokens generated and trained; seconds per step, DATPO / GRPO (bench/gpu_smoke.py) 150 s
#   update     the packed update's attention kernels on all 36 layers (bench/bench_attention.py)        40 s
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
export DATPO_CACHE="${DATPO_CACHE:-$PWD/.cache/gpu_assets}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
: > "$OUT/summary.txt"

part() {   # part NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/$name.txt" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - start ))s (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
  grep -v -e "it/s\]" -e "^Loading weights" "$OUT/$name.txt" | tail -n 25
}

part env 15 sh -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "
import torch, transformers, sys
print(sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"transformers\",
      transformers.__version__)
import triton; print(\"triton\", triton.__version__)
from torch.nn.attention import varlen; import inspect
print(\"varlen_attn block_table:\", \"block_table\" in inspect.signature(varlen.varlen_attn).parameters)"'
part engine 55 python -m pytest -q -p no:cacheprovider tests/test_paged.py -k cuda
part attention 55 python bench/bench_decode_attention.py --rows 64 256 --context 1024 --repeats 10
part rollout 130 python bench/bench_rollout.py --model random-qwen2.5-3b --device cuda --precision bf16 \
  --shapes a --rows 64 256 --max_new_tokens 128
part smoke 150 python bench/gpu_smoke.py --presets paper grpo --steps 1 --skip_checkpoint
part update 40 python bench/bench_attention.py --layers 36 --repeats 2
echo "tables in $OUT; summary:"
cat "$OUT/summary.txt"
