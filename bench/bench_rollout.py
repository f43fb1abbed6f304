"""Benchmark: the tree rollout engine (engine/) vs HF generate (--rollout_engine generate), in one run.

    python bench/bench_rollout.py                          # (a), (b), (c) below; SmolLM2-135M, fp32, CPU
    python bench/bench_rollout.py --shapes c --threads 1   # one shape, one thread
    python bench/bench_rollout.py --model Qwen/Qwen2.5-3B --device cuda --precision bf16 --shapes a,b
    python bench/bench_rollout.py --shapes c --compile_decode   # the engine eager vs --compile_decode instead
    python bench/bench_rollout.py --model random-qwen2.5-3b --device cuda --precision bf16 --shapes a
        # Qwen2.5-3B's shape with random weights (bench/gpu_smoke.py; no hub): it never samples EOS, so
        # every row runs to max_new_tokens; the embedded SmolLM2 tokenizer
    python bench/bench_rollout.py --model random-qwen2.5-3b --device cuda --precision bf16 --shapes a \
        --rows 256 --max_new_tokens 128      # shape (a) at 256 rows (64 prompts × 4), all decoding at once
    python bench/bench_rollout.py --model random-qwen2.5-tiny --device cpu --shapes a --rows 8 \
        --max_new_tokens 8                   # the same code, a 2-layer model of that family (the rehearsal)
    python bench/bench_rollout.py --shapes c --decode_step paged-eager   # the paged step on the CPU

Shapes, both engines on the same prompts (arith-train, the demo's chat prompt with its worked example):
  (a) 16 prompts × 4 base responses × 256 new tokens, no branches (parallel sampling, GRPO-like)
  (b) the DATPO demo preset (8 prompts, N = 4, K_max = B_max = 2, adaptive, sent-entropy) at 256 new tokens
  (c) the demo preset as shipped (64 new tokens)
Per engine: wall seconds, generated tokens, tokens/s, row-steps on rows that had already ended, peak KV bytes;
then the ratio engine/generate, and DATPO's rollout seconds per generated token over GRPO's ((b) over (a)).
Sampling draws different tokens in the two engines (their random streams are consumed in another order), so
token counts differ a little; tokens/s is the fair comparison. Last, the peak KV at the paper's shape
(Qwen2.5-3B, 16 prompts, (N, K, B) = (4, 3, 4), 1,024 new tokens, 256-token prompts), computed.
With --compile_decode: the engine eager vs the engine with --compile_decode (torch.compile of the decode
step), same prompts and seed; the compile (a one-prompt warm-up run) is timed apart, then tokens/s and the
ratio.

The floor: after each shape, the model's own bare forward at the engine's mean batch (rows per decode step)
and mean context (KV tokens a row reads), timed alone — one decode token per row through HF's forward with a
DynamicCache, logits of the last position, no sampling, no scheduling, no grading — and the engine's tokens/s
as a share of it: how far the engine is from the limit its model sets on this machine. On CUDA also the
graph floor: the same forward over a StaticCache, captured once as a CUDA graph and replayed (launches
removed), its milliseconds per step against the weight-read time (the weights' bytes over the memory
bandwidth measured by a 2 GiB device copy).
--decode_step picks the engine's decode step (config.decode_step: auto is the paged step on CUDA);
--rows N makes shape (a) N rows (N/4 prompts × 4) decoded at once by both engines, --max_new_tokens its
length.
"""
import argparse
import dataclasses
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":   # a device part: one line naming what is missing, before anything loads
    from bench import needs
    needs.check("rollout")
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import config as C  # noqa: E402
import data  # noqa: E402
import methods as M  # noqa: E402
import models  # noqa: E402
import rollout as R  # noqa: E402
from bench import profile_rollout  # noqa: E402
from bench.profile_rollout import Profile, profiled  # noqa: E402
from engine.loop import decode_mode  # noqa: E402


def clock() -> float:
    """--clock: wall seconds (time.perf_counter) or this process's CPU seconds (time.process_time), for
    the rollouts, the floor and the matmul limit alike."""
    return profile_rollout.CLOCK[0]()


def shape_config(shape: str, args, rows: int = 0) -> tuple[C.Config, int, dict]:
    """(config, number of prompts, rollout_trees keyword arguments) of a benchmark shape; shape (a) at `rows`
    rows (rows / 4 prompts × 4, all decoded at once) when rows > 0."""
    common = dict(model=args.model, precision=args.precision, decode_step=args.decode_step)
    if shape == "a":
        sizes = dict(gen_batch_size=rows, max_batch_rows=rows) if rows else {}
        cfg = C.make_config("grpo", "demo", max_new_tokens=args.max_new_tokens or 256, group_size=4, **sizes,
                            **common)
        return cfg, rows // 4 if rows else 16, dict(method=M.METHODS["grpo"])
    cfg = C.make_config("demo", max_new_tokens=args.max_new_tokens or (256 if shape == "b" else 64), **common)
    return cfg, cfg.prompts_per_step, {}


def run(model, tokenizer, prompts, answers, cfg, engine, seed, kwargs):
    """engine: "engine", "generate", or "compiled" (the engine with --compile_decode). The engine's decode
    steps are timed from outside (bench/profile_rollout.py's wrappers): `step_s` the seconds of its decode
    steps (forward, sampling, the rows' bookkeeping; no admission, prefill, planning or grading),
    `forward_s` the decode forwards' alone."""
    cfg = dataclasses.replace(cfg)
    cfg.rollout_engine, cfg.compile_decode = ("engine", True) if engine == "compiled" else (engine, False)
    if engine.startswith("engine@"):                 # --baseline: the engine with another decode step
        cfg.rollout_engine, cfg.decode_step = "engine", engine.split("@")[1]
    torch.manual_seed(seed)
    prof = Profile()
    start = clock()
    with models.autocast(next(model.parameters()).device, cfg.precision), profiled(prof):
        trees, stats = R.rollout_trees(model, tokenizer, prompts, answers, cfg, random.Random(seed), **kwargs)
    wall = clock() - start
    tokens = stats.base_tokens + stats.branch_tokens
    return dict(wall=wall, tokens=tokens, tok_s=tokens / wall, ended=stats.ended_row_steps,
                ms_step=wall * 1e3 / stats.decode_steps if stats.decode_steps else None,   # engine only
                row_steps=stats.row_steps, kv=stats.peak_kv_bytes, recomputed=stats.recomputed_prefix_tokens,
                branches=sum(1 for t in trees for b in t.blocks if b.branch),
                shape=engine_shape(trees, stats), step_s=prof.decode_seconds, forward_s=prof.decode_forward,
                batch_sizes=prof.batch_sizes)


def engine_shape(trees, stats) -> tuple[float, float, int]:
    """(mean rows per decode step, mean context a row reads, row-steps counted) of an engine run. A row of L
    tokens is in L − 1 decode steps (its first token comes with its prefill), reading prompt + fork + t KV
    slots at its t-th; a base response is one row, a branch at fork f another."""
    total = steps = 0
    for tr in trees:
        rows = [(0, sum(len(b.token_ids) for b in tr.blocks if b.base == j and not b.branch))
                for j in sorted({b.base for b in tr.blocks})]
        rows += [(b.start, len(b.token_ids)) for b in tr.blocks if b.branch]
        for start, length in rows:
            base = len(tr.prompt_ids) + start
            total += (length - 1) * base + (length - 1) * length // 2
            steps += max(length - 1, 0)
    return stats.row_steps / max(stats.decode_steps, 1), total / max(steps, 1), steps


@torch.no_grad()
def bare_forward_tokens_per_s(model, rows: int, context: int, repeats: int = 8) -> float:
    """Decode tokens per second of the model's own forward for `rows` rows reading `context` cached tokens
    each: one prefill fills a DynamicCache, then rounds of `repeats` timed one-token forwards (each cropped
    back); the median round."""
    device = next(model.parameters()).device
    ids = torch.randint(100, model.config.vocab_size - 1, (rows, context + 1), device=device)
    cache = DynamicCache(config=model.config)
    name = models.cache_arg(model)
    model(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1, **{name: cache})
    model(input_ids=ids[:, -1:], use_cache=True, logits_to_keep=1, **{name: cache})   # warm-up
    cache.crop(-1)
    rates = []
    for _ in range(5):   # the median of 5 rounds: one round of 8 steps moved by ±2x on a shared CPU
        start = clock()
        for _ in range(repeats):
            model(input_ids=ids[:, -1:], use_cache=True, logits_to_keep=1, **{name: cache})
            cache.crop(-1)
        rates.append(rows * repeats / (clock() - start))
    return sorted(rates)[2]


@torch.no_grad()
def weight_matmul_tokens_per_s(model, rows: int, repeats: int = 3) -> float:
    """Decode tokens per second that the model's weight matmuls alone allow at `rows` rows: every Linear
    of the model (the lm_head included: sampling needs its logits) applied to a [rows, in] input, in the
    weights' dtype, one pass per step; nothing else (no norms, rotary, attention, sampling). The median of 5
    rounds of `repeats` passes. This is the limit of any decode step that computes the whole model."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    if head not in linears:
        linears.append(head)
    device, dtype = head.weight.device, head.weight.dtype
    inputs = {w: torch.randn(rows, w, device=device, dtype=dtype) for w in {m.in_features for m in linears}}

    def one_pass():
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight)

    one_pass()                                                                           # warm-up
    rates = []
    for _ in range(5):
        start = clock()
        for _ in range(repeats):
            one_pass()
        rates.append(rows * repeats / (clock() - start))
    return sorted(rates)[2]


def matmul_seconds_of_steps(model, batch_sizes: dict) -> float:
    """The weight matmuls' seconds for a run's decode steps (batch_sizes: rows -> steps): each step's
    rows at the limit weight_matmul_tokens_per_s measures, interpolated linearly between powers of two
    (measured at 1, 2, 4, ..., up to the largest batch). What no decode step of that run could go below."""
    top = max(batch_sizes)
    points = sorted({min(2 ** i, top) for i in range(top.bit_length() + 1)})
    per_step = {r: r / weight_matmul_tokens_per_s(model, r) for r in points}
    total = 0.0
    for rows, steps in batch_sizes.items():
        hi = next(p for p in points if p >= rows)
        lo = max([p for p in points if p <= rows], default=hi)
        frac = 0.0 if hi == lo else (rows - lo) / (hi - lo)
        total += steps * (per_step[lo] + frac * (per_step[hi] - per_step[lo]))
    return total


@torch.no_grad()
def graph_floor_ms(model, rows: int, context: int, repeats: int = 20) -> float:
    """CUDA: milliseconds per decode step of the model's own forward for `rows` rows over a StaticCache of
    context + a few tokens, captured once as a CUDA graph and replayed `repeats` times (each replay writes
    the next position; the attention reads the whole static cache under its mask)."""
    from transformers import StaticCache

    device = next(model.parameters()).device
    ids = torch.randint(100, model.config.vocab_size - 1, (rows, context + 1), device=device)
    cache = StaticCache(config=model.config, max_cache_len=context + repeats + 8)
    name = models.cache_arg(model)
    model(input_ids=ids[:, :-1], use_cache=True, logits_to_keep=1, **{name: cache})
    step = ids[:, -1:].clone()
    position = torch.full((rows, 1), context, device=device)

    def forward():
        return model(input_ids=step, position_ids=position, use_cache=True, logits_to_keep=1,
                     **{name: cache}).logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()                                                     # warm-up, off the default stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def weight_read_ms(model) -> float:
    """Milliseconds to read the model's weights once at the bandwidth a 2 GiB device-to-device copy reaches
    (which reads and writes every byte)."""
    device = next(model.parameters()).device
    src = torch.empty(2**30, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    bandwidth = 2 * src.numel() * src.element_size() * 5 / (time.perf_counter() - start)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del src, dst
    return weights / bandwidth * 1e3


def paper_shape_kv(prompt: int = 256, new: int = 1024, prompts: int = 16, n: int = 4, k: int = 3, b: int = 4,
                   gen_batch: int = 64, chunk: int = 384) -> tuple[float, float]:
    """Peak KV bytes at the paper's shape, Qwen2.5-3B in bf16 (36 layers × 2 KV heads × 128 × 2 (K, V) × 2 B).
    generate: the base cache of a gen_batch_size call (rows × (prompt + new)) stays alive while a chunk of
    branches holds its own copy of each prefix, left-padded to the longest (prompt + new − 1), plus up to
    `new` tokens. engine: its default pool (every prompt once + (max_batch_rows + N) × new; prefixes
    shared)."""
    per_token = 36 * 2 * 128 * 2 * 2
    generate = gen_batch * (prompt + new) + chunk * (prompt + new - 1 + new)
    engine = prompts * prompt + (max(gen_batch, chunk) + n) * new
    return generate * per_token, engine * per_token


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shapes", default="a,b,c", help="comma-separated: a, b, c")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="time in wall seconds, or in this process's CPU seconds (with --threads 1 on a "
                             "shared machine, what other processes take does not count)")
    parser.add_argument("--baseline", default="generate",
                        choices=["generate", "reference", "shared", "paged", "paged-eager"],
                        help="what the engine is compared with: HF generate, or the engine with this "
                             "--decode_step (same prompts and seed)")
    parser.add_argument("--compile_decode", action="store_true",
                        help="compare the engine eager and with --compile_decode instead of "
                             "engine vs generate")
    parser.add_argument("--decode_step", default="auto",
                        choices=["auto", "reference", "paged", "paged-eager"],
                        help="the engine's decode step (config.decode_step)")
    parser.add_argument("--rows", type=int, nargs="+", default=[0],
                        help="shape (a): this many rows (rows / 4 prompts × 4), one run per value")
    parser.add_argument("--max_new_tokens", type=int, default=0, help="override every shape's new tokens")
    parser.add_argument("--engine_only", action="store_true",
                        help="the engine alone (no generate run): its floor and DATPO/GRPO ratio in half the "
                             "time")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    profile_rollout.CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    device = models.pick_device(args.device)
    if args.model in ("random-qwen2.5-3b", "random-qwen2.5-tiny"):
        from bench.gpu_smoke import QWEN25_3B, TINY, random_policy

        shape = QWEN25_3B if args.model == "random-qwen2.5-3b" else TINY
        model, tokenizer = random_policy(models.policy_dtype(args.precision), device, shape=shape)
    else:
        model, tokenizer = models.load_policy(args.model, device, models.policy_dtype(args.precision))
    model.eval()
    gpu = f" ({torch.cuda.get_device_name(device)}, torch {torch.__version__})" \
        if device.type == "cuda" else ""
    print(f"model {args.model}, device {device}{gpu}, {args.threads} threads, precision {args.precision}, "
          f"decode step {args.decode_step}, {args.clock} clock, load average {os.getloadavg()[0]:.2f}",
          flush=True)
    seconds_per_token = {}
    jobs = [(s, rows) for s in args.shapes.split(",") for rows in (args.rows if s == "a" else [0])]
    for shape, rows in jobs:
        cfg, n_prompts, kwargs = shape_config(shape, args, rows)
        shape = f"{shape}@{rows}" if rows else shape
        problems = data.load_problems(cfg.train_data, limit=n_prompts)
        prompts = [data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot)
                   for p in problems]
        answers = [p["answer"] for p in problems]
        engines = ("compiled", "engine") if args.compile_decode else ("engine", "generate") \
            if args.baseline == "generate" else ("engine", f"engine@{args.baseline}")
        engines = engines[:1] if args.engine_only else engines
        paged = decode_mode(cfg.decode_step, device) != "reference"
        if paged:
            # the paged step's kernels are compiled per bucket and pool size: warm up on every prompt (the
            # buckets the run decodes at) with the run's pool size, a few tokens each
            rows_at_once = n_prompts * cfg.group_size if kwargs else \
                (cfg.max_batch_rows or max(cfg.gen_batch_size, cfg.branch_chunk_size)) + cfg.n_base
            cfg.max_kv_tokens = rows_at_once * cfg.max_new_tokens + sum(len(tokenizer(p).input_ids)
                                                                        for p in prompts)
            warm_cfg = dataclasses.replace(cfg, max_new_tokens=8)
        for e in engines[:1]:                                                                   # warm-up
            warm = run(model, tokenizer, prompts if paged else prompts[:1], answers if paged else answers[:1],
                       warm_cfg if paged else cfg, e, args.seed, kwargs)
            print(f"({shape}) warm-up {e} (compiles the decode step under --compile_decode or --decode_step "
                  f"paged): {warm['wall']:.1f} s", flush=True)
        result = {}
        for e in engines:
            result[e] = run(model, tokenizer, prompts, answers, cfg, e, args.seed, kwargs)
            print(f"({shape}) {e}: {result[e]}, load average {os.getloadavg()[0]:.2f}", flush=True)
        ours, ref = result[engines[0]], result[engines[-1]]
        print(f"\n({shape}) {n_prompts} prompts, N = {kwargs.get('n_base', cfg.n_base)}, "
              f"{'no branches' if kwargs else f'K_max = {cfg.k_max}, B_max = {cfg.b_max}, {cfg.fork}'}, "
              f"max_new_tokens {cfg.max_new_tokens}; load average {os.getloadavg()[0]:.2f}", flush=True)
        print(f"{'':34s}{engines[0]:>14s}{engines[-1]:>14s}{engines[0] + '/' + engines[-1]:>17s}",
              flush=True)
        for label, key, fmt in [("wall seconds", "wall", "{:.1f}"), ("generated tokens", "tokens", "{:.0f}"),
                                ("tokens / s", "tok_s", "{:.1f}"), ("branches", "branches", "{:.0f}"),
                                ("row-steps run", "row_steps", "{:.0f}"),
                                ("row-steps on ended rows", "ended", "{:.0f}"),
                                ("peak KV MB", "kv", "{:.1f}"),
                                ("prefix tokens recomputed", "recomputed", "{:.0f}")]:
            a, b = ours[key], ref[key]
            if key == "kv":
                a, b = a / 2**20, b / 2**20
            ratio = f"{a / b:.2f}" if b else "-"
            print(f"{label:34s}{fmt.format(a):>14s}{fmt.format(b):>14s}{ratio:>17s}", flush=True)
        seconds_per_token[shape] = {e: r["wall"] / r["tokens"] for e, r in result.items()}
        rows, context, counted = ours["shape"]
        floor = bare_forward_tokens_per_s(model, max(1, round(rows)), round(context))
        print(f"({shape}) floor: the bare forward at the engine's mean batch {rows:.1f} rows × context "
              f"{context:.0f} tokens: {floor:.1f} tokens/s; {engines[0]} {ours['tok_s']:.1f} tokens/s = "
              f"{ours['tok_s'] / floor:.2f} of it (row-steps counted from the trees {counted}, the engine's "
              f"{ours['row_steps']}); load average {os.getloadavg()[0]:.2f}", flush=True)
        if ours["step_s"]:
            limit = weight_matmul_tokens_per_s(model, max(1, round(rows)))
            step, forward = ours["row_steps"] / ours["step_s"], ours["row_steps"] / ours["forward_s"]
            steps_limit = ours["row_steps"] / matmul_seconds_of_steps(model, ours["batch_sizes"])
            print(f"({shape}) the weight-matmul limit: {limit:.1f} tokens/s at the mean {rows:.1f} rows, "
                  f"{steps_limit:.1f} over the run's own decode steps (each at its rows). {engines[0]}: "
                  f"rollout {ours['tok_s']:.1f}, its decode steps {step:.1f}, their forwards {forward:.1f} "
                  f"tokens/s. Ratios: rollout / eager floor {ours['tok_s'] / floor:.2f}; decode steps / "
                  f"eager floor {step / floor:.2f}; eager floor / matmul limit {floor / limit:.2f}; decode "
                  f"steps / matmul limit {step / limit:.2f} at the mean rows, {step / steps_limit:.2f} over "
                  f"its steps; "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
        if device.type == "cuda":
            step_rows = max(1, round(rows))
            try:
                graph_ms = graph_floor_ms(model, step_rows, round(context))
            except Exception as err:   # report, do not stop the table
                print(f"({shape}) graph floor: capture failed ({type(err).__name__}: "
                      f"{str(err).splitlines()[0][:200] if str(err) else ''})", flush=True)
                continue
            graph = step_rows * 1e3 / graph_ms
            read = weight_read_ms(model)
            print(f"({shape}) graph floor: {graph_ms:.1f} ms per step = {graph:.1f} tokens/s "
                  f"({graph / floor:.2f}× the eager floor); {engines[0]} = "
                  f"{ours['tok_s'] / graph:.2f} of it; "
                  f"weights read in {read:.1f} ms: graph floor step / weight read = {graph_ms / read:.2f}; "
                  f"{engines[0]} ms per decode step (wall incl. prefill / decode steps) "
                  f"{ours['ms_step']:.1f}", flush=True)
    if "a" in seconds_per_token and "b" in seconds_per_token and not args.compile_decode:
        for e in engines:
            print(f"DATPO (b) / GRPO-like (a) rollout seconds per generated token, {e}: "
                  f"{seconds_per_token['b'][e] / seconds_per_token['a'][e]:.2f}", flush=True)
    today, ours = paper_shape_kv()
    print(f"\npaper shape (Qwen2.5-3B bf16, 16 prompts, (4, 3, 4), 1,024 new tokens, 256-token prompts), "
          f"computed peak KV: generate {today / 2**30:.1f} GiB, engine {ours / 2**30:.1f} GiB, "
          f"engine/generate {ours / today:.2f}")


if __name__ == "__main__":
    main()
