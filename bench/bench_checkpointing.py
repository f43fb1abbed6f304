"""bench_checkpointing.py — what --gradient_checkpointing saves and costs in the update, one run, both ways.

    python bench/bench_checkpointing.py --model smollm2-135m --rows 8 --tokens 512 --targets 256

One micro-batch of training rows (random token ids: memory and time do not depend on the text) goes through
packing.row_logprobs and backward, without and with models.enable_gradient_checkpointing, each in a fresh
process so one's allocations cannot hide the other's. Prints the extra memory the forward+backward needed
(CUDA: torch.cuda.max_memory_allocated; CPU: peak resident set sampled every 2 ms, minus the set before) and
the seconds, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(args) -> dict:
    import torch

    import models
    import packing as P

    torch.set_num_threads(args.threads)
    device = models.pick_device(args.device)
    model, tokenizer = models.load_policy(args.model, device, torch.float32)
    if args.checkpointing:
        models.enable_gradient_checkpointing(model)
    gen = random.Random(0)
    rows = [P.Row([gen.randrange(100, len(tokenizer)) for _ in range(args.tokens)],
                  args.tokens - args.targets, [gen.uniform(-1, 1)] * args.targets)
            for _ in range(args.rows)]

    def step() -> None:
        logps = P.row_logprobs(model, rows, tokenizer.pad_token_id, device)
        adv = torch.tensor([a for r in rows for a in r.advantages], device=device)
        (-(torch.cat(logps) * adv).sum() / adv.numel()).backward()
        model.zero_grad(set_to_none=False)     # keep the gradient buffers: measure activations, not grads

    step()                                     # warm-up: allocates the gradient buffers
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    before_rss, peak, done = _rss(), [0], [False]

    def sample() -> None:
        while not done[0]:
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    done[0] = True
    sampler.join()
    extra = (torch.cuda.max_memory_allocated() - before) if device.type == "cuda" else peak[0] - before_rss
    return {"checkpointing": args.checkpointing, "extra_mb": extra / 2**20, "seconds": seconds,
            "device": str(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per row (context + targets)")
    parser.add_argument("--targets", type=int, default=256, help="trained tokens per row")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results = []
    for flag in ([], ["--checkpointing"]):
        cmd = [sys.executable, __file__, "--child", *flag] + [
            f"--{k}={getattr(args, k)}" for k in ("model", "rows", "tokens", "targets", "threads", "device")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        results.append(json.loads(out))
    plain, ckpt = results
    print(f"{args.model}, {args.rows} rows x {args.tokens} tokens ({args.targets} trained), "
          f"{plain['device']}, fp32, one forward+backward")
    print(f"{'':24}{'extra memory (MB)':>20}{'seconds':>10}")
    for name, r in (("plain", plain), ("gradient checkpointing", ckpt)):
        print(f"{name:24}{r['extra_mb']:>20.0f}{r['seconds']:>10.1f}")
    print(f"{'checkpointing / plain':24}{ckpt['extra_mb'] / max(plain['extra_mb'], 1e-9):>20.2f}"
          f"{ckpt['seconds'] / plain['seconds']:>10.2f}")


if __name__ == "__main__":
    main()
