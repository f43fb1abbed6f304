"""Benchmark: tree rollouts with KV-cache prefix reuse vs the naive re-prefill path, in one run.

    python bench/bench_rollout.py                      # embedded SmolLM2-135M, demo-sized trees, CPU
    python bench/bench_rollout.py --model Qwen/Qwen2.5-3B --max_new_tokens 1024 --prompts 16 --device cuda

Both paths get the same prompts, the same base responses (same seed) and the same forks; only Phase 2
(branches) differs. Prints, per path: prefix tokens recomputed per branch, generated tokens per second,
wall time per tree, and the ratios (naive / cached).
"""
import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config as C  # noqa: E402
import data  # noqa: E402
import models  # noqa: E402
import rollout as R  # noqa: E402


def run(model, tokenizer, prompts, answers, cfg, seed):
    torch.manual_seed(seed)
    start = time.perf_counter()
    with models.autocast(next(model.parameters()).device, cfg.precision):
        trees, stats = R.rollout_trees(model, tokenizer, prompts, answers, cfg, random.Random(seed))
    wall = time.perf_counter() - start
    branches = sum(1 for t in trees for b in t.blocks if b.branch)
    return dict(trees=len(trees), branches=branches, branch_tokens=stats.branch_tokens,
                base_tokens=stats.base_tokens, wall_per_tree=wall / len(trees),
                branch_seconds=stats.seconds_branches, base_seconds=stats.seconds_base,
                recomputed_per_branch=stats.recomputed_prefix_tokens / max(branches, 1),
                branch_tok_per_s=stats.branch_tokens / max(stats.seconds_branches, 1e-9),
                gen_tok_per_s=(stats.base_tokens + stats.branch_tokens) / wall)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="arith-test")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=2, help="fixed forks per base response")
    parser.add_argument("--b", type=int, default=4, help="fixed branches per fork")
    parser.add_argument("--n_base", type=int, default=4)
    parser.add_argument("--fork", default="sent-entropy")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="bf16-autocast")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = models.pick_device(args.device)
    cfg = C.make_config("demo", model=args.model, n_base=args.n_base, k_max=args.k, b_max=args.b, adaptive=False,
                        fork=args.fork, max_new_tokens=args.max_new_tokens, precision=args.precision,
                        gen_batch_size=args.prompts * args.n_base, branch_chunk_size=args.prompts * args.n_base * args.k * args.b)
    model, tokenizer = models.load_policy(args.model, device, models.policy_dtype(args.precision))
    model.eval()
    problems = data.load_problems(args.data, limit=args.prompts)
    prompts = [data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot) for p in problems]
    answers = [p["answer"] for p in problems]
    run(model, tokenizer, prompts[:1], answers[:1], cfg, args.seed)   # warm-up
    results = {}
    for naive in (False, True):
        cfg.naive_prefill = naive
        results[naive] = run(model, tokenizer, prompts, answers, cfg, args.seed)
    ours, naive = results[False], results[True]
    print(f"model {args.model}, {args.prompts} prompts, (N, K, B) = ({args.n_base}, {args.k}, {args.b}), "
          f"max_new_tokens {args.max_new_tokens}, fork {args.fork}, device {device}, {args.threads} threads, "
          f"precision {args.precision}")
    print(f"{'':34s}{'cached (ours)':>16s}{'naive re-prefill':>18s}{'naive/ours':>12s}")
    rows = [("branches", "branches", "{:.0f}"),
            ("prefix tokens recomputed / branch", "recomputed_per_branch", "{:.1f}"),
            ("branch phase seconds", "branch_seconds", "{:.2f}"),
            ("branch tokens / s", "branch_tok_per_s", "{:.1f}"),
            ("generated tokens / s (whole tree)", "gen_tok_per_s", "{:.1f}"),
            ("wall seconds / tree", "wall_per_tree", "{:.2f}")]
    for label, key, fmt in rows:
        ratio = naive[key] / ours[key] if ours[key] else float("nan")
        print(f"{label:34s}{fmt.format(ours[key]):>16s}{fmt.format(naive[key]):>18s}{ratio:>12.2f}")
    same = ours["branch_tokens"] == naive["branch_tokens"]
    print(f"same base responses and forks in both runs; branch tokens {ours['branch_tokens']} vs "
          f"{naive['branch_tokens']}{' (identical count)' if same else ''}")


if __name__ == "__main__":
    main()
