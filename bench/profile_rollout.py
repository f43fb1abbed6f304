"""Profile: one tree rollout (DATPO) against one parallel rollout (GRPO) of the same prompts, phase by phase.

    python bench/profile_rollout.py                      # the demo (64 new tokens) and its 256-token variant
    python bench/profile_rollout.py --shapes 64 --threads 1
    python bench/profile_rollout.py --shapes 256 --threads 1 --clock cpu    # on a shared machine
    python bench/profile_rollout.py --decode_step reference     # the reference decode step (engine/kv.py)

Both rollouts are rollout.rollout_trees as train.py calls it: the demo preset's DATPO (8 prompts, N = 4,
K_max = B_max = 2, adaptive, sent-entropy forks) and `--method grpo` at the demo scale (the same 8 prompts ×
G = 16 parallel responses, no forks), the same max_new_tokens and seed, one warm-up rollout first (a prompt,
both methods: the first forward's set-up, and under a compiled decode step its compile or cache load, timed
and printed apart). The engine is timed from outside (its methods wrapped; nothing in engine/ knows):

  prompt prefill   the prompts' forwards (once per prompt; its N rows share the slots)
  base decode      decode steps' seconds and tokens of base rows (each step split by its rows' share)
  hand-over        Engine.grow: the branch rows made (prefix shared by reference; on the paged step a
                   partial page copied per row) and their first tokens sampled from the base's hidden state
  fork planning    what the caller does between BasesDone and grow: grading the N bases, the sentence split
                   (decode with offsets + PySBD), the entropies (select_forks)
  branch decode    decode steps' share of branch rows
  tail             decode steps once no row can join any more (nothing waits, no base that may branch is
                   still decoding): rows in flight only fall
  trees            after the loop: blocks, texts, grading every branch (rollout.tree_of)

Per phase: seconds, tokens, mean rows in flight per decode step; for the whole rollout: wall seconds, seconds
per generated token and DATPO / GRPO of it, decode steps, prefill tokens, host transfers
(engine/paged.to_host, the engine's one device → host copy per step), the seconds inside the model's
forward (decode and prefill; the paged step's compiled call holds its sampling too) and outside it. The
host's CPU, load average and threads are printed with the table.

Then the decode steps alone, split in two factors (decompose): DATPO / GRPO seconds per decoded token =
(DATPO's steps over what GRPO's steps cost at the same rows in flight: a tree step's premium) × (GRPO's
price at DATPO's rows over its own: the rows in flight), with a table of milliseconds per step by rows.
"""
import argparse
import collections
import contextlib
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import threads  # noqa: E402

os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

import config as C  # noqa: E402
import data  # noqa: E402
import engine as E  # noqa: E402
import methods as M  # noqa: E402
import models  # noqa: E402
import rollout as R  # noqa: E402
import tree as T  # noqa: E402
from engine import paged  # noqa: E402

CLOCK = [time.perf_counter]    # --clock: time.perf_counter (wall) or time.process_time (this process's CPU)
PHASES = ("prompt prefill", "base decode", "hand-over", "fork planning", "branch decode", "tail", "trees")


class Profile:
    """Seconds, tokens and rows-in-flight per phase of one rollout, filled by the wrappers below."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.tokens = collections.Counter()
        self.rows = collections.Counter()        # Σ rows in flight over a phase's decode steps
        self.steps = collections.Counter()       # decode steps that had rows of the phase
        self.forward = 0.0                       # seconds inside the model's forward (decode + prefill)
        self.decode_forward = 0.0                # of which in decode steps
        self.decode_seconds = 0.0                # decode steps (forward, sampling, the rows' bookkeeping)
        self.planning = collections.Counter()    # fork planning's parts
        self.per_step = []                       # (rows, seconds) of each decode step
        self.engine = None                       # the rollout's engine
        self._rows, self._tail = [], False       # the decode step in progress: its rows, whether in the tail

    def step(self, engine, seconds: float, forward: float) -> None:
        """One decode step of `engine.scheduler.active` rows (read before the step) took `seconds`."""
        rows = self._rows
        self.forward += forward
        self.decode_forward += forward
        self.decode_seconds += seconds
        self.per_step.append((len(rows), seconds))
        if self._tail:
            self._add("tail", seconds, len(rows), len(rows))
            return
        branch = sum(1 for r in rows if r.fork is not None)
        for phase, count in (("base decode", len(rows) - branch), ("branch decode", branch)):
            if count:
                self._add(phase, seconds * count / len(rows), count, len(rows))

    @property
    def batch_sizes(self) -> collections.Counter:
        """Rows of each decode step -> steps."""
        return collections.Counter(rows for rows, _ in self.per_step)

    def _add(self, phase, seconds, tokens, rows):
        self.seconds[phase] += seconds
        self.tokens[phase] += tokens
        self.rows[phase] += rows
        self.steps[phase] += 1


def is_tail(engine) -> bool:
    """No row can join the batch any more: no prompt or row waits, and no base row that may branch (its
    prompt keeps hidden states) still decodes or waits to be grown."""
    s, run = engine.scheduler, engine.state
    if s.waiting_prompts or s.waiting or run.ended or run.ungrown:
        return False
    return not any(r.fork is None and run.keeps(r.prompt) for r in s.active)


def instrument(engine, prof: Profile) -> None:
    """Wrap one engine's decode step, forward passes, sampling and grow, recording into prof."""
    clock = CLOCK[0]
    inner = {"forward": 0.0}

    def timed_forward(fn):
        def wrapper(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                inner["forward"] += clock() - t0
        return wrapper

    engine.forward.decode = timed_forward(engine.forward.decode)
    if engine.static is not None:
        engine.static.run = timed_forward(engine.static.run)
    prefill = engine.forward.prefill

    def timed_prefill(*args, **kwargs):
        t0 = clock()
        try:
            return prefill(*args, **kwargs)
        finally:
            dt = clock() - t0
            prof.seconds["prompt prefill"] += dt
            prof.forward += dt
    engine.forward.prefill = timed_prefill
    grow = engine.grow

    def timed_grow(*args, **kwargs):
        t0 = clock()
        try:
            return grow(*args, **kwargs)
        finally:
            prof.seconds["hand-over"] += clock() - t0
    engine.grow = timed_grow
    decode_step = engine._decode_step

    def timed_step():
        prof._rows, prof._tail = list(engine.scheduler.active), is_tail(engine)
        inner["forward"] = 0.0
        steps = engine.stats["decode_steps"]
        t0 = clock()
        recorded = False
        for event in decode_step():
            if not recorded:                        # the step is done before its first BasesDone
                recorded = True
                prof.step(engine, clock() - t0, inner["forward"])
            yield event
        if not recorded and engine.stats["decode_steps"] > steps:
            prof.step(engine, clock() - t0, inner["forward"])
    engine._decode_step = timed_step


@contextlib.contextmanager
def profiled(prof: Profile):
    """rollout.rollout_trees with its engine instrumented and the caller's planning parts timed."""
    saved = {}

    def patch(module, name, key):
        fn = saved[(module, name)] = getattr(module, name)

        def wrapper(*args, **kwargs):
            t0 = CLOCK[0]()
            try:
                return fn(*args, **kwargs)
            finally:
                prof.planning[key] += CLOCK[0]() - t0
        setattr(module, name, wrapper)

    make = saved[(R, "rollout_engine")] = R.rollout_engine

    def rollout_engine(*args, **kwargs):
        engine = prof.engine = make(*args, **kwargs)
        if isinstance(engine, E.Engine):                 # not the reference path (HF generate)
            instrument(engine, prof)
        return engine
    R.rollout_engine = rollout_engine
    patch(R, "grade_responses", "grading")
    patch(R, "plan_prompt", "planning")
    patch(T, "decode_with_offsets", "sentence split")
    patch(T, "sentence_spans", "sentence split")
    patch(T, "select_forks", "entropies")
    patch(R, "tree_of", "trees")
    try:
        yield
    finally:
        for (module, name), fn in saved.items():
            setattr(module, name, fn)


def rollout(model, tokenizer, prompts, answers, cfg, method, seed) -> dict:
    prof = Profile()
    transfers = paged.TRANSFERS[0]
    torch.manual_seed(seed)
    with profiled(prof), models.autocast(next(model.parameters()).device, cfg.precision):
        start, cpu = time.perf_counter(), time.process_time()
        trees, stats = R.rollout_trees(model, tokenizer, prompts, answers, cfg, random.Random(seed),
                                       method=M.METHODS[method], progress=False)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    prof.seconds["fork planning"] = prof.planning["grading"] + prof.planning["planning"]
    prof.seconds["trees"] = prof.planning["trees"]
    return dict(wall=wall, cpu=cpu, seconds=cpu if CLOCK[0] is time.process_time else wall,
                tokens=stats.base_tokens + stats.branch_tokens, steps=stats.decode_steps,
                rows=stats.row_steps / max(stats.decode_steps, 1), transfers=paged.TRANSFERS[0] - transfers,
                prof=prof, prefill=prof.engine.stats["prefill_tokens"])


def table(results: dict, new_tokens: int, clock: str) -> None:
    names = list(results)
    print(f"\n{new_tokens} new tokens, {clock} seconds: seconds (tokens) [mean rows in flight per decode "
          f"step]")
    print(f"{'phase':16s}" + "".join(f"{n:>30s}" for n in names))
    for phase in PHASES:
        cells = []
        for n in names:
            p = results[n]["prof"]
            rows = f" [{p.rows[phase] / p.steps[phase]:.1f}]" if p.steps[phase] else ""
            tokens = f" ({p.tokens[phase]})" if p.tokens[phase] else ""
            cells.append(f"{p.seconds[phase]:.2f}{tokens}{rows}")
        print(f"{phase:16s}" + "".join(f"{c:>30s}" for c in cells))
    for label, fn in [
        ("  grading", lambda r: f"{r['prof'].planning['grading']:.2f}"),
        ("  sentence split", lambda r: f"{r['prof'].planning['sentence split']:.2f}"),
        ("  entropies", lambda r: f"{r['prof'].planning['entropies']:.3f}"),
        ("seconds", lambda r: f"{r['seconds']:.2f}"),
        ("wall / CPU s", lambda r: f"{r['wall']:.1f} / {r['cpu']:.1f}"),
        ("generated tokens", lambda r: f"{r['tokens']}"),
        ("ms / token", lambda r: f"{r['seconds'] * 1e3 / r['tokens']:.2f}"),
        ("decode steps", lambda r: f"{r['steps']}"),
        ("rows / step", lambda r: f"{r['rows']:.1f}"),
        ("prefill tokens", lambda r: f"{r['prefill']}"),
        ("host transfers", lambda r: f"{r['transfers']}"),
        ("in forward s", lambda r: f"{r['prof'].forward:.2f}"),
        ("outside fwd s", lambda r: f"{r['seconds'] - r['prof'].forward:.2f}")]:
        print(f"{label:16s}" + "".join(f"{fn(results[n]):>30s}" for n in names))
    a, b = (results[n] for n in names[:2])
    print(f"DATPO / GRPO {clock} seconds per generated token at {new_tokens} new tokens: "
          f"{(a['seconds'] / a['tokens']) / (b['seconds'] / b['tokens']):.2f} (wall: "
          f"{(a['wall'] / a['tokens']) / (b['wall'] / b['tokens']):.2f})", flush=True)


def step_cost(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """(a, b) of the least-squares line seconds = a + b · rows over decode steps (rows, seconds): a
    step's fixed cost (the weights read once, whatever the rows) and each row's."""
    n = len(steps)
    mr = sum(r for r, _ in steps) / n
    ms = sum(s for _, s in steps) / n
    var = sum((r - mr) ** 2 for r, _ in steps)
    b = sum((r - mr) * (s - ms) for r, s in steps) / var if var else 0.0
    return ms - b * mr, b


def decompose(results: dict) -> None:
    """Decode steps only (one token per row per step): DATPO / GRPO seconds per token = (what DATPO's steps
    cost over what GRPO's steps cost at the same rows: a tree step's premium) × (GRPO's step price at
    DATPO's rows over GRPO's own: the rows in flight). The price is GRPO's fitted line (step_cost); a
    table of mean milliseconds per step by rows in flight shows both."""
    tree, flat = (results[n]["prof"].per_step for n in list(results)[:2])
    a, b = step_cost(flat)
    priced = sum(a + b * r for r, _ in tree)                    # DATPO's steps at GRPO's prices
    premium = sum(s for _, s in tree) / priced
    rows = (priced / sum(r for r, _ in tree)) / (sum(s for _, s in flat) / sum(r for r, _ in flat))
    print(f"\nDecode steps alone: GRPO's step costs {a * 1e3:.0f} ms + {b * 1e3:.2f} ms per row (least "
          f"squares over its {len(flat)} steps)")
    edges = [1, 9, 17, 33, 49, 65, 10 ** 9]
    print(f"{'rows in flight':16s}{'DATPO ms/step (steps)':>30s}{'GRPO ms/step (steps)':>30s}")
    for lo, hi in zip(edges, edges[1:]):
        cells = []
        for steps in (tree, flat):
            inside = [s for r, s in steps if lo <= r < hi]
            cells.append(f"{sum(inside) / len(inside) * 1e3:.0f} ({len(inside)})" if inside else "-")
        label = f"{lo}-{hi - 1}" if hi < 10 ** 9 else f"{lo}+"
        if cells != ["-", "-"]:
            print(f"{label:16s}" + "".join(f"{c:>30s}" for c in cells))
    print(f"DATPO / GRPO seconds per decoded token {premium * rows:.2f} = a tree step's premium at equal "
          f"rows {premium:.2f} × rows in flight {rows:.2f}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="64,256", help="max_new_tokens of each shape, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                        help="phases in wall seconds, or in this process's CPU seconds (with --threads 1 on "
                             "a shared machine: other processes' load counts less)")
    parser.add_argument("--decode_step", default=None, help="config.decode_step (default: the config's)")
    parser.add_argument("--compile_decode", default=None, choices=["true", "false"],
                        help="config.compile_decode (default: the config's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    CLOCK[0] = time.process_time if args.clock == "cpu" else time.perf_counter
    overrides = {k: v for k, v in (("decode_step", args.decode_step),
                                   ("compile_decode", None if args.compile_decode is None
                                    else args.compile_decode == "true")) if v is not None}
    base = C.make_config("demo", **overrides)
    model, tokenizer = models.load_policy(base.model, models.pick_device("cpu"),
                                          models.policy_dtype(base.precision))
    model.eval()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if
                line.startswith("model name")), "?") if os.path.exists("/proc/cpuinfo") else "?"
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    kind = "+".join(f for f in ("avx512f", "amx_tile") if f in flags.split()) or "no AVX-512"
    print(f"{cpu} ({kind}), {args.threads} threads, torch {torch.__version__}, decode step "
          f"{base.decode_step}, compile_decode {base.compile_decode}, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    problems = data.load_problems(base.train_data, limit=base.prompts_per_step)
    prompts = [data.format_prompt(p["problem"], tokenizer, base.prompt_style, base.few_shot)
               for p in problems]
    answers = [p["answer"] for p in problems]
    for new_tokens in map(int, args.shapes.split(",")):
        cfgs = {"DATPO": (C.make_config("demo", max_new_tokens=new_tokens, **overrides), "datpo"),
                "GRPO": (C.make_config("grpo", "demo", max_new_tokens=new_tokens, **overrides), "grpo")}
        for name, (cfg, method) in cfgs.items():                                        # warm-up
            t0 = time.perf_counter()
            rollout(model, tokenizer, prompts[:1], answers[:1], cfg, method, args.seed)
            print(f"warm-up {name} (1 prompt; compiles or loads the decode step): "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        results = {}
        for name, (cfg, method) in cfgs.items():
            results[name] = rollout(model, tokenizer, prompts, answers, cfg, method, args.seed)
            print(f"{name}: {results[name]['wall']:.1f} s, {results[name]['tokens']} tokens, load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
        table(results, new_tokens, args.clock)
        decompose(results)


if __name__ == "__main__":
    main()
