"""Benchmark: the CPU decode step's attention (engine/shared.py) with each part cut into calls by width
(by_width, the engine's) against one call per part (every group padded to the part's widest), in one run.

    python bench/bench_width_bins.py                  # SmolLM2-135M's attention shape, 30 layers, 1 thread
    python bench/bench_width_bins.py --threads 2 --repeats 9

One decode step's attention, all layers, on a pool of random keys/values: 8 prompts of 170 tokens and the
layouts a rollout passes through (rows' own tokens and branches' forks below). Per layout: the parts and
their calls, milliseconds per step for each way (the median of --repeats, the two ways interleaved over
--rounds so that a noisy host moves both alike), one call / by width, and the largest |Δ| between the two
outputs (the same softmax: float rounding only).
"""
import argparse
import os
import random
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

from engine import kv, shared  # noqa: E402
from engine.scheduler import DecodeRow  # noqa: E402

PROMPTS, PROMPT_TOKENS = 8, 170


def layouts(rng: random.Random) -> dict[str, tuple[list[int], list[tuple[int, int]]]]:
    """name -> (base rows' own tokens, branches as (fork, own tokens)); prompts taken in turn."""
    return {
        "64 rows alike, 100 own tokens each": ([100] * 64, []),
        "GRPO's second wave: 32 rows at 200 own tokens, 32 at 20": ([200] * 32 + [20] * 32, []),
        "DATPO at 256 tokens: 16 bases at 200, 32 branches (forks 60-200, own 5-150)":
            ([200] * 16, [(rng.randint(60, 200), rng.randint(5, 150)) for _ in range(32)]),
        "DATPO's tail: 8 bases at 250, 24 fresh branches (forks 20-240, own 1-10)":
            ([250] * 8, [(rng.randint(20, 240), rng.randint(1, 10)) for _ in range(24)]),
    }


def make_rows(pool: kv.KVPool, own: list[int], branches: list[tuple[int, int]]) -> list[DecodeRow]:
    """The rows of a layout, each context just extended by the slot of the token fed now."""
    prompts = []
    for _ in range(PROMPTS):
        prompts.append([])
        pool.extend(prompts[-1], PROMPT_TOKENS)
    rows = []
    for i, n in enumerate(own):
        slots = pool.share([(prompts[i % PROMPTS], PROMPT_TOKENS)])[0]
        pool.extend(slots, n + 1)
        rows.append(DecodeRow(len(rows), i % PROMPTS, i, None, slots, 10 ** 6))
    for i, (fork, n) in enumerate(branches):
        base = pool.share([(prompts[i % PROMPTS], PROMPT_TOKENS)])[0]
        pool.extend(base, fork)
        slots = pool.share([(base, PROMPT_TOKENS + fork)])[0]
        pool.extend(slots, n + 1)
        rows.append(DecodeRow(len(rows), i % PROMPTS, 1000 + i, fork, slots, 10 ** 6))
    return rows


def one_step(pool, rows, query, key, layers: int, binned: bool):
    """(seconds, output of the last layer) of one step's attention over `layers` layers; binned=False pads
    every part into one call (width_bin made constant for the build)."""
    width_bin = shared.width_bin
    if not binned:
        shared.width_bin = lambda width: 0
    try:
        start = time.perf_counter()
        step = shared.step_kv(pool, rows, [PROMPT_TOKENS] * PROMPTS, per_kv=query.shape[1] // key.shape[1])
        for layer in range(layers):
            out, _ = shared.shared_attention(types.SimpleNamespace(layer_idx=layer), query, key, key, None,
                                             engine_kv=step)
        return time.perf_counter() - start, out, step
    finally:
        shared.width_bin = width_bin


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=30, help="SmolLM2-135M's 30")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64                                      # SmolLM2-135M's attention
    config = types.SimpleNamespace(num_key_value_heads=kv_heads, num_attention_heads=heads,
                                   hidden_size=heads * dim, num_hidden_layers=args.layers, head_dim=dim)
    print(f"{args.layers} layers × {heads} heads ({kv_heads} key/value) × {dim}, {args.threads} threads, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}")
    for name, (own, branches) in layouts(random.Random(0)).items():
        pool = kv.KVPool(types.SimpleNamespace(config=config), 64 * 1024, "cpu", torch.float32)
        for layer in pool.layers:
            layer.normal_()
        rows = make_rows(pool, own, branches)
        query, key = torch.randn(len(rows), heads, 1, dim), torch.randn(len(rows), kv_heads, 1, dim)
        times = {False: [], True: []}
        for binned in (False, True):                                      # warm-up, not timed
            one_step(pool, rows, query, key, args.layers, binned)
        for _ in range(args.rounds):
            for binned in (False, True):
                for _ in range(args.repeats):
                    seconds, out, step = one_step(pool, rows, query, key, args.layers, binned)
                    times[binned].append(seconds)
                if binned:
                    kinds = ["prompts"] + ["base prefixes"] * (len(step.parts) == 3) + ["own tokens"]
                    calls = ", ".join(f"{k} {len(p.calls)}" for k, p in zip(kinds, step.parts))
                    binned_out = out
                else:
                    one_out = out
        one, cut = (statistics.median(times[b]) * 1e3 for b in (False, True))
        print(f"{name}: {len(rows)} rows; calls by width: {calls}; one call "
              f"{one:.1f} ms, by width {cut:.1f} ms a step: one / by width {one / cut:.2f}; max |Δ| "
              f"{(one_out - binned_out).abs().max().item():.1e}", flush=True)


if __name__ == "__main__":
    main()
