"""bench/sweep_parsers.py — a big random sweep of every parser of model or user text (issue 40), outside the
suite.

    python bench/sweep_parsers.py                      # 100,000 examples per target
    python bench/sweep_parsers.py --examples 2000      # a quick look
    python bench/sweep_parsers.py --targets compute_reward:60000 extract_answer

The same generated text as tests/test_model_text.py (tests/model_text.py: boxes nested, cut off and repeated,
\\text{}/\\mathrm{}/\\mbox{} empty and full, units, degrees, percent, dollars, powers, fractions, roots,
matrices, unbalanced braces, unicode, control characters, very long and very deep inputs), many more examples,
and nothing stops at the first failure: every exception, wrong-typed verdict and slow call is counted, and
the shortest input of each kind printed. The suite's tests shrink a failure to its minimal example; this
finds them.

Targets and what each must do for any input:
  extract_answer, last_box_cut_off   str or None / bool, no exception
  is_equivalent (pred, gold)         bool, no exception, within reward.TIMEOUT_SECONDS (+ slack)
  compute_reward (response, gold)    exactly 0.0 or 1.0, no exception, within the bound
  unmatchable_gold (gold)            str or None
  extract_choice (mcq.py)            one of the valid letters or None
  mcq_rows (mcq.py)                  GPQA / MMLU-Pro problems, or a ValueError naming the row
  spans (tree.py)                    sentence_spans / step_spans partition the tokens in order
  to_problem (data.py)               a problem, or ValueError naming the row (a `solution` column too)
Prints one table: examples, failures by kind, slowest call (wall seconds: on a loaded machine a call can
pass the bound by the time it was descheduled), and the seconds per 1,000 examples.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import model_text as M  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import data  # noqa: E402
import mcq  # noqa: E402
import reward  # noqa: E402
import tree  # noqa: E402

SLOW = reward.TIMEOUT_SECONDS + 1.5   # a call slower than this breaks the bound


def _spans_ok(text: str, cuts: list[int]) -> bool:
    offsets = M.offsets_of(text, cuts)
    for spans in (tree.sentence_spans(text, offsets), tree.step_spans(text, offsets)):
        if not M.partitions(spans, len(offsets)):
            return False
    return True


def _mcq_rows(name: str, rows: list):
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # its note on a GPQA short of 198 questions
            return mcq.problems(name, [(f"{name}.jsonl line {n}", row) for n, row in enumerate(rows, 1)])
    except ValueError as err:
        return "ValueError" if str(err).startswith(f"{name}.jsonl line ") else f"unnamed: {err}"


def _to_problem(row: dict):
    try:
        return data.to_problem(row, "row 1")
    except ValueError:
        return "ValueError"


# name -> (strategy of argument tuples, function, check of the result)
TARGETS = {
    "extract_answer": (st.tuples(M.response(), st.booleans()),
                       lambda t, f: reward.extract_answer(t, fallback_last_number=f),
                       lambda r: r is None or isinstance(r, str)),
    "last_box_cut_off": (st.tuples(M.response()), reward.last_box_cut_off, lambda r: isinstance(r, bool)),
    "is_equivalent": (st.tuples(M.answer(), M.gold()), reward.is_equivalent, lambda r: type(r) is bool),
    "compute_reward": (st.tuples(M.response(), M.gold(), st.booleans()), reward.compute_reward,
                       lambda r: type(r) is float and r in (0.0, 1.0)),
    "unmatchable_gold": (st.tuples(M.gold()), reward.unmatchable_gold,
                         lambda r: r is None or isinstance(r, str)),
    "extract_choice": (st.tuples(M.response(), st.integers(2, 10)), mcq.extract_choice,
                       lambda r: r is None or r in mcq.LETTERS),
    "mcq_rows": (st.tuples(st.sampled_from(["gpqa", "mmlu-pro"]), st.lists(M.mcq_row(), max_size=3)),
                 _mcq_rows, lambda r: r == "ValueError" or isinstance(r, list)),
    "spans": (st.tuples(M.response(), st.lists(st.integers(0, 4000), max_size=40)), _spans_ok, bool),
    "to_problem": (st.tuples(M.row()), _to_problem,
                   lambda r: r == "ValueError" or isinstance(r, dict) and isinstance(r["answer"], str)
                   and r["answer"].strip() != ""),
}


CHUNK = 5000   # examples per hypothesis run: one run's bookkeeping grows with its examples


def sweep(name: str, examples: int) -> dict:
    strategy, function, check = TARGETS[name]
    found = collections.defaultdict(list)   # kind -> inputs
    stats = {"examples": 0, "slowest": 0.0, "slowest_input": None}

    @settings(max_examples=min(examples, CHUNK), database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(args):
        stats["examples"] += 1
        reward._timed_out.clear()   # each example pays its own bound
        start, cpu = time.perf_counter(), time.process_time()
        try:
            result = function(*args)
            kind = None if check(result) else f"wrong result {type(result).__name__}: {result!r:.60}"
        except Exception as err:   # noqa: BLE001 — counting them is the point
            tb = err.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            kind = f"{type(err).__name__} at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}"
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if seconds > stats["slowest"]:
            stats["slowest"], stats["slowest_input"] = seconds, args
        if seconds > SLOW:   # wall seconds; the CPU seconds say whether the machine's load made it so
            found[f"slower than {SLOW:.1f} s"].append((f"{seconds:.1f} s, {cpu:.1f} CPU s", *args))
        if kind:
            found[kind].append(args)

    start = time.perf_counter()
    while stats["examples"] < examples:
        run()
    stats["seconds"] = time.perf_counter() - start
    stats["found"] = found
    return stats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=100_000, help="per target")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS),
                        help=f"of {', '.join(TARGETS)}; NAME:N sweeps N examples of that one")
    args = parser.parse_args(argv)
    plan = [(t.partition(":")[0], int(t.partition(":")[2] or args.examples)) for t in args.targets]
    unknown = [name for name, _ in plan if name not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {', '.join(unknown)}; expected {', '.join(TARGETS)}")
    reward._load_math_verify()   # its imports (a second or two, once a process) are not a call's time
    print(f"{'target':<18}{'examples':>10}{'failures':>10}{'slowest s':>11}{'s / 1k':>9}")
    for name, examples in plan:
        stats = sweep(name, examples)
        failures = sum(len(v) for v in stats["found"].values())
        print(f"{name:<18}{stats['examples']:>10}{failures:>10}{stats['slowest']:>11.2f}"
              f"{1000 * stats['seconds'] / max(stats['examples'], 1):>9.1f}", flush=True)
        for kind, inputs in sorted(stats["found"].items()):
            shortest = min(inputs, key=lambda a: len(repr(a)))
            print(f"    {len(inputs):>6} x {kind}; shortest: {shortest!r:.300}", flush=True)
        if stats["slowest"] > 1.0:
            print(f"    slowest input: {stats['slowest_input']!r:.300}", flush=True)


if __name__ == "__main__":
    main()
