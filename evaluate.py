"""evaluate.py — avg@k, pass@k and maj@k of a policy on math benchmarks (Sec. 5.1, 5.3, App. A, App. F.1).

Protocol of the paper (App. F.1 "Evaluation"): temperature 1.0, at most 2048 new tokens, k = 8 samples per
problem for MATH500 and k = 64 for AIME24/25/26 and AMC23; pass@k and maj@k are averaged over three
independent evaluation runs (`--runs 3`; the default here is 1 because a CPU pays for every sample).

    python evaluate.py --model runs/demo --bench arith-test --k 8
    python evaluate.py --model Qwen/Qwen2.5-3B --bench math500 aime24 --k 8 64 --runs 3   # release prompt
    python evaluate.py --rescore runs/eval/demo/samples_arith-test.jsonl       # same numbers, no model
    python evaluate.py --plot_models runs/eval/smollm2-135m runs/eval/demo --out_dir runs/eval/compare

Metrics (App. A notation; r(y) ∈ {0, 1} is the binary verifiable reward of reward.compute_reward):
  avg@k            mean of r over all samples (= (1/k) Σ_j r(y_j), averaged over problems and runs)
  pass@k           the paper's empirical pass@k: 1[Σ_j r(y_j) ≥ 1] for the k samples of one run, averaged
                   over problems, then over runs
  pass@k_unbiased  Chen et al. (2021): 1 − C(n−c, k)/C(n, k) with all n = runs·k samples of a problem pooled
  pass_curve       the same estimator for j = 1, 2, 4, …, k (the pass@k curves of App. B, Fig. "pass@k")
  maj@k            the majority-voted answer of the k samples is correct (Sec. 5.3, Wang et al. 2022),
                   averaged over problems, then over runs
Every sample is saved to samples_<bench>.jsonl; `score_records` computes all numbers from those records
alone, so `--rescore` reproduces results.json exactly.

The output folder (runs/eval/<model label>, --out_dir, or --resume) holds one evaluation: one model and one
set of sampling settings, locked while it runs (harness/runs.RunLock, as train.py's run folder). Further
benchmarks with the same settings accumulate in its results.json; other settings are refused unless
--overwrite true replaces them. It is never a training run, a checkpoint or a model folder: those belong to
train.py and to the model, and a run folder is replaced by train.py's --overwrite. Every file read is checked
(a bad one is one line naming the file, line and field); every write is atomic, a full disk one line (exit 4).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

from runtime import threads

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import checks
import config as C
import data
import mcq
import models
from harness import cli, eval_files, guards, measured, preflight, reward_guard, signals, tracking
from harness.journal import Journal, Stopped
from reward import compute_reward, extract_answer, is_equivalent
from runtime import distributed as D
from runtime import faults, oom
from runtime.figures import literal, printable

# App. F.1: k = 8 for MATH500 (App. F: avg@8 out of domain) ...
PAPER_K = {"math500": 8, "gpqa": 8, "mmlu-pro": 8}
DEFAULT_K = 64             # ... and 64 for the other benchmarks


# --------------------------------------------------------------------------------------------------------
# Metrics: pure functions
# --------------------------------------------------------------------------------------------------------
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 − C(n−c, k)/C(n, k) (Chen et al. 2021).

    Product form C(n−c, k)/C(n, k) = Π_{i=n−c+1}^{n} (1 − k/i): no huge binomials, stable for n in the
    thousands. The paper's pass@k (App. A) is the k = n case of this: 1 if any of the k samples is correct.
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if n - c < k:  # every draw of k samples contains a correct one
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def majority_vote(answers: list[str | None]) -> str | None:
    """The most common answer, equivalent spellings counted together (Sec. 5.3, maj@k).

    Answers join the first group whose representative (its first member) `reward.is_equivalent` accepts,
    so "1/2", "0.5" and "\\frac12" form one group. The largest group wins; on a tie the group whose first
    member appears earliest in `answers` wins. None (no extractable answer) is never a candidate: all None
    → None. Returns the representative of the winning group.
    """
    counts: dict[str, int] = {}            # identical strings first: one equivalence check per string
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    groups: list[list] = []                # [representative, size], in order of first appearance
    for answer, count in counts.items():
        for group in groups:
            if is_equivalent(answer, group[0]):
                group[1] += count
                break
        else:
            groups.append([answer, count])
    if not groups:
        return None
    return max(groups, key=lambda g: g[1])[0]  # max keeps the first of equal sizes: the earliest group


def pass_ladder(k: int) -> list[int]:
    """1, 2, 4, … below k, then k (the x-axis of the paper's pass@k curves)."""
    return [2 ** e for e in range(k.bit_length()) if 2 ** e < k] + [k]


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def score_records(records: list[dict], k: int) -> dict:
    """All metrics from the per-sample records alone (the rows of samples_<bench>.jsonl).

    A record needs "index" (problem), "run", "gold", "answer" (extracted, or None) and "correct"; every
    (index, run) must hold exactly k records and every problem every run.
    """
    if not records:
        raise ValueError("score_records: no records")
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for position, record in enumerate(records):
        cells[(record["index"], record["run"])].append((record.get("sample", position), record))
    problems = sorted({i for i, _ in cells})
    runs = sorted({r for _, r in cells})
    for i in problems:
        for r in runs:
            size = len(cells.get((i, r), []))
            if size != k:
                raise ValueError(f"score_records: problem {i} run {r} has {size} samples, expected k={k}")
    cell = {key: [rec for _, rec in sorted(rows, key=lambda x: x[0])] for key, rows in cells.items()}

    per_run = {"avg@k": [], "pass@k": [], "maj@k": []}
    for r in runs:
        hits = [[bool(rec["correct"]) for rec in cell[(i, r)]] for i in problems]
        per_run["avg@k"].append(_mean(_mean(h) for h in hits))
        per_run["pass@k"].append(_mean(float(any(h)) for h in hits))
        votes = []
        for i in problems:
            voted = majority_vote([rec["answer"] for rec in cell[(i, r)]])
            votes.append(float(voted is not None and is_equivalent(voted, cell[(i, r)][0]["gold"])))
        per_run["maj@k"].append(_mean(votes))

    n = k * len(runs)  # the unbiased estimator pools every run's samples of a problem
    correct = [sum(bool(rec["correct"]) for r in runs for rec in cell[(i, r)]) for i in problems]
    curve = {j: _mean(pass_at_k(n, c, j) for c in correct) for j in pass_ladder(k)}
    result = {
        "k": k, "runs": len(runs), "n_problems": len(problems), "n_samples": len(records),
        "avg@k": _mean(per_run["avg@k"]), "pass@k": _mean(per_run["pass@k"]),
        "maj@k": _mean(per_run["maj@k"]),
        "pass@k_unbiased": curve[k], "pass_curve": curve, "per_run": per_run,
    }
    levels = defaultdict(list)  # MATH level / arithmetic level, when the problems carry one
    for record in records:
        if record.get("level") is not None:
            levels[record["level"]].append(bool(record["correct"]))
    if levels:
        result["avg_by_level"] = {lv: _mean(levels[lv]) for lv in sorted(levels, key=data.level_order)}
    # samples whose grading raised (harness/reward_guard.py): scored 0, counted
    result["reward_errors"] = sum(bool(rec.get("reward_error")) for rec in records)
    if all("tokens" in rec for rec in records):
        result["mean_tokens"] = _mean(rec["tokens"] for rec in records)
        result["truncated"] = _mean(float(not rec["stopped"]) for rec in records)  # hit max_new_tokens
    return result


# --------------------------------------------------------------------------------------------------------
# Sampling and grading
# --------------------------------------------------------------------------------------------------------
def grade(response: str, problem: dict, answer_fallback: bool = False) -> tuple[str | None, bool]:
    """(extracted answer, correct): the exact letter of a multiple-choice problem (mcq.py), else the math
    grader (reward.py)."""
    if mcq.is_multiple_choice(problem):
        return mcq.grade(response, problem)
    return (extract_answer(response, answer_fallback),
            compute_reward(response, problem["answer"], answer_fallback) == 1.0)


def guarded_grade(errors: reward_guard.RewardErrors, response: str, problem: dict,
                  answer_fallback: bool) -> dict:
    """grade's answer and verdict as a record's fields; a grader that raises makes it (None, False) and adds
    "reward_error" (the function and the exception; its traceback goes to reward_errors.jsonl)."""
    name = "mcq.grade" if mcq.is_multiple_choice(problem) else reward_guard.GRADER
    graded, failure = errors.attempt(name, grade, (response, problem, answer_fallback), [response],
                                     problem.get("answer"))
    if failure is None:
        return {"answer": graded[0], "correct": graded[1]}
    return {"answer": None, "correct": False, "reward_error": {"function": name, "error": failure}}


def evaluate_problems(model, tokenizer, problems, cfg, k: int, max_new_tokens: int | None = None,
                      runs: int = 1, progress: bool = True, desc: str = "eval",
                      journal: Journal | None = None, stop: signals.GracefulStop | None = None,
                      errors: reward_guard.RewardErrors | None = None) -> dict:
    """Sample k responses per problem in each of `runs` runs, grade them, score them (score_records).

    Sampling follows cfg (temperature, top_k, top_p, precision, gen_batch_size; prompts from cfg.prompt_style
    and cfg.few_shot); max_new_tokens defaults to cfg.eval_max_new_tokens (App. F.1: 2048). Returns the
    metrics plus "seconds", "oom_retries" (sample_rows) and "records" (one dict per sample). The caller
    seeds torch.
    journal: samples are appended to it as each generate call finishes, and the calls it already holds are
    skipped (its RNG state restored), so an interrupted evaluation rerun ends with an uninterrupted one's
    records. stop: after a signal, Stopped is raised once the current call's samples are saved.
    errors: where a grader's exception is recorded (harness/reward_guard.py; default: counted only); such a
    sample scores 0 and its record says so ("reward_error"); more than cfg.max_reward_error_share of the
    samples failing ends the evaluation with one line (reward_guard.ShareExceeded).
    """
    import torch
    from tqdm import tqdm

    from rollout import Sampler

    if not problems:
        raise ValueError("evaluate_problems: no problems")
    if k < 1 or runs < 1:
        raise ValueError(f"evaluate_problems: need k >= 1 and runs >= 1, got k={k}, runs={runs}")
    max_new_tokens = max_new_tokens or cfg.eval_max_new_tokens
    errors = errors or reward_guard.RewardErrors(None, cfg.max_reward_error_share)
    sampler = Sampler.from_config(model, tokenizer, cfg)
    prompts = [data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot) for p in problems]
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]  # as rollout.py does
    context = faults.model_context(model)
    for i, ids in enumerate(prompt_ids):
        faults.check_prompt_fits(len(ids), max_new_tokens, context, f"{desc} problem {i + 1}")
    # About gen_batch_size rows per generate call: whole problems of k samples, or a problem's k in pieces.
    n_per_call = min(k, cfg.gen_batch_size)
    problems_per_call = max(1, cfg.gen_batch_size // k)

    lo, hi = D.shard_range(len(problems))   # under torchrun this rank's problems; in one process all of them
    was_training = model.training
    model.eval()
    records, start = (journal.resume() if journal else []), time.perf_counter()
    bar = tqdm(total=(hi - lo) * k * runs, desc=desc, unit="sample", disable=not progress or not D.is_main(),
               dynamic_ncols=True)
    bar.update(len(records))
    unit, saved_units = 0, (journal.units if journal else 0)
    oom_counts = {"oom_retries": 0}     # generation batches halved after running out of memory (sample_rows)
    try:
        for run in range(runs):
            for first in range(lo, hi, problems_per_call):
                group = list(range(first, min(first + problems_per_call, hi)))
                for done in range(0, k, n_per_call):
                    unit += 1
                    if unit <= saved_units:
                        continue   # saved by an earlier, interrupted run
                    n = min(n_per_call, k - done)
                    with torch.no_grad(), models.autocast(sampler.device, cfg.precision):
                        rows = sample_rows(sampler, [prompt_ids[i] for i in group], n, max_new_tokens,
                                           oom_counts)
                    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
                    new = []
                    for row, (tokens, text) in enumerate(zip(rows, texts)):
                        problem = problems[group[row // n]]  # rows are prompt-major, n per prompt
                        new.append({
                            "index": group[row // n], "run": run, "sample": done + row % n,
                            "problem": problem["problem"], "gold": problem["answer"],
                            "level": problem.get("level"), "response": text,
                            **guarded_grade(errors, text, problem, cfg.answer_fallback),   # answer, correct
                            "tokens": len(tokens), "stopped": bool(tokens) and tokens[-1] in sampler.stop_ids,
                        })
                    records += new
                    if journal:
                        journal.append(new)
                    bar.update(len(rows))
                    if stop is not None and stop.requested:
                        raise Stopped(f"{len(records)} of {len(problems) * k * runs} samples saved")
    finally:
        bar.close()
        model.train(was_training)
    # in the order one process writes them
    records = sorted(D.gather_lists(records), key=lambda r: (r["run"], r["index"], r["sample"]))
    seconds = time.perf_counter() - start
    reward_guard.check_samples(errors, records, desc, f"its samples are saved in {journal.path}; once the "
                               f"grader is fixed, evaluate.py --rescore {journal.path} regrades them"
                               if journal else "evaluation stopped")
    result = score_records(records, k)
    result.update(seconds=seconds, max_new_tokens=max_new_tokens, records=records,
                  oom_retries=oom_counts["oom_retries"])
    return result


def sample_rows(sampler, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                counts: dict) -> list[list[int]]:
    """rollout.sample_base's tokens for these prompts × n samples, prompt-major. Out of memory: the same rows
    in smaller generate calls (whole prompts, then a prompt's samples in pieces), the rows per call halved
    until they fit (oom.halving_retry); the size that fit is kept in counts["rows"] for the next calls."""
    def run(size: int) -> list[list[int]]:
        out = generate_rows(sampler, prompt_ids, n, max_new_tokens, size)
        if size < rows:                # fitted only after halving: later calls start there
            counts["rows"] = size
        return out

    rows = len(prompt_ids) * n
    return oom.halving_retry(run, min(rows, counts.get("rows", rows)), "evaluation's generation", counts)


def generate_rows(sampler, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                  size: int) -> list[list[int]]:
    """The n samples of each prompt, prompt-major, in generate calls of at most `size` rows. (The tests'
    DATPO_OOM_AT=eval makes its first call run out of memory: tests/inject.py.)"""
    from rollout import sample_base

    out: list[list[int]] = []
    if size >= n:                  # whole prompts, size // n of them per call
        per_call = size // n
        for i in range(0, len(prompt_ids), per_call):
            out += sample_base(sampler, prompt_ids[i:i + per_call], n, max_new_tokens).tokens
    else:                          # one prompt per call, `size` of its samples at a time
        for ids in prompt_ids:
            for done in range(0, n, size):
                out += sample_base(sampler, [ids], min(size, n - done), max_new_tokens).tokens
    return out


# --------------------------------------------------------------------------------------------------------
# Table and plots
# --------------------------------------------------------------------------------------------------------
def format_table(results_by_model: dict[str, dict[str, dict]]) -> str:
    """The paper's main table (Table "main results"): a row per model, avg@k / pass@k / maj@k per benchmark
    (in %) and their average over benchmarks."""
    benches = list(dict.fromkeys(b for res in results_by_model.values() for b in res))
    metrics = ("avg@k", "pass@k", "maj@k")
    name_w = max([5] + [len(m) for m in results_by_model])
    cols = [f"{b} (k={next(r[b]['k'] for r in results_by_model.values() if b in r)})" for b in benches]
    cols.append("Average")
    col_w = max(22, *(len(c) + 2 for c in cols))
    lines = [" " * name_w + "  " + "".join(c.ljust(col_w) for c in cols),
             "model".ljust(name_w) + "  "
             + "".join(" ".join(m.split("@")[0].rjust(6) for m in metrics).ljust(col_w) for _ in cols)]
    for name, res in results_by_model.items():
        cells = []
        for b in benches:
            cells.append(" ".join(f"{100 * res[b][m]:6.1f}" for m in metrics) if b in res else "     -" * 3)
        cells.append(" ".join(f"{100 * _mean(res[b][m] for b in res):6.1f}" for m in metrics))
        lines.append(name.ljust(name_w) + "  " + "".join(c.ljust(col_w) for c in cells))
    return "\n".join(lines)


def _curve(result: dict) -> tuple[list[int], list[float]]:
    points = sorted((int(j), v) for j, v in result["pass_curve"].items())  # keys are strings after JSON
    return [j for j, _ in points], [100 * v for _, v in points]


def plot_pass_curves(results_by_model: dict[str, dict[str, dict]], path) -> None:
    """pass@k against k = 1, 2, 4, …, k (log2 axis), one panel per benchmark, one line per model
    (App. B, Fig. "pass@k performance on evaluation benchmarks")."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(b for res in results_by_model.values() for b in res))
    cols = min(len(benches), 3)
    rows = math.ceil(len(benches) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, bench in zip(axes.flat, benches):
        ax.set_xscale("log", base=2)
        ticks = set()
        for name, res in results_by_model.items():
            if bench in res:
                xs, ys = _curve(res[bench])
                ax.plot(xs, ys, marker="o", label=literal(name))
                ticks.update(xs)
        ax.set_xticks(sorted(ticks), [str(x) for x in sorted(ticks)])  # 1, 2, 4, … rather than 2^0, 2^1, …
        ax.minorticks_off()
        ax.set_title(literal(bench))   # names are drawn as written, never as math text
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(benches):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    eval_files.save_figure(fig, path)


def plot_maj_vs_avg(results_by_model: dict[str, dict[str, dict]], path) -> None:
    """Grouped bars of avg@k and maj@k per model, averaged over each model's benchmarks, with a green arrow
    from avg@k to maj@k (Sec. 5.3, Fig. "Test-time scaling performance using majority voting")."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results_by_model)
    avg = [100 * _mean(r["avg@k"] for r in results_by_model[m].values()) for m in names]
    maj = [100 * _mean(r["maj@k"] for r in results_by_model[m].values()) for m in names]
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(names) + 1.5), 3.8))
    ax.bar([i - width / 2 for i in range(len(names))], avg, width, label="avg@k", color="#9bb7d4")
    ax.bar([i + width / 2 for i in range(len(names))], maj, width, label="maj@k", color="#1f4e79")
    for i, (a, m) in enumerate(zip(avg, maj)):
        ax.annotate("", xy=(i + width / 2, m), xytext=(i - width / 2, a),
                    arrowprops=dict(arrowstyle="->", color="green", lw=1.5))
        ax.text(i, max(a, m) + 1, f"{m - a:+.1f}", ha="center", va="bottom", color="green", fontsize=9)
    benches = sorted({b for r in results_by_model.values() for b in r})
    ax.set_xticks(range(len(names)), [literal(n) for n in names], rotation=15 if len(names) > 3 else 0)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, max(avg + maj + [1.0]) * 1.2 + 2)
    ax.set_title("avg@k vs maj@k, mean over " + ", ".join(map(literal, benches)), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    eval_files.save_figure(fig, path)


def rescore_file(path, answer_fallback: bool = False) -> tuple[str, dict]:
    """(benchmark name, metrics) from a samples jsonl. Records without "answer"/"correct" (e.g. written by
    hand or by another tool) are graded here with reward.py; k = the samples per (problem, run). A bad
    line (not JSON, a missing field, a field of the wrong type, a sample twice) is a ValueError naming it."""
    numbered = eval_files.read_jsonl(path, numbered=True)
    if not numbered:
        raise ValueError("no records")
    for n, record in numbered:
        why = eval_files.sample_problem(record)
        if why:
            raise ValueError(f"line {n}: {why}")
    why = eval_files.samples_conflict(numbered)
    if why:
        raise ValueError(why)
    records = [record for _, record in numbered]
    errors = reward_guard.RewardErrors(None, 1.0)   # counted: result["reward_errors"]
    for record in records:
        if record.pop("reward_error", None):   # its grader raised when it was sampled: graded again
            record.pop("answer", None), record.pop("correct", None)
        if "answer" not in record or "correct" not in record:
            graded = guarded_grade(errors, record["response"], {"answer": record["gold"]}, answer_fallback)
            record.setdefault("answer", graded["answer"])
            record["correct"] = record.get("correct", graded["correct"])
            if "reward_error" in graded:
                record["reward_error"] = graded["reward_error"]
    sizes = defaultdict(int)
    for record in records:
        sizes[(record["index"], record["run"])] += 1
    k = max(sizes.values())
    stem = Path(path).stem
    bench = records[0].get("bench") or (stem[len("samples_"):] if stem.startswith("samples_") else stem)
    return bench, score_records(records, k)


def model_label(model: str) -> str:
    """A folder-friendly name: Qwen/Qwen2.5-3B → Qwen2.5-3B, runs/demo → demo, runs/demo/checkpoints/step_40 →
    demo-step_40."""
    path = Path(model.rstrip("/"))
    if path.parent.name == "checkpoints":
        return f"{path.parent.parent.name}-{path.name}"
    return path.name or model


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------
MAX_K = 1 << 16       # samples per problem (the paper's largest is 64)
MAX_RUNS = 1000       # independent runs (the paper's is 3)
MAX_FILE_NAME_BYTES = 255   # NAME_MAX of ext4, xfs, btrfs, tmpfs: samples_<bench>.jsonl must fit in it
TEMPORARY_NAME_ROOM = 24    # ... with room for a temporary name's prefix and suffix (".NAME.XXXXXXXX.tmp")
SETTING_KEYS = ("model", "prompt_style", "few_shot", "answer_fallback", "temperature", "top_p", "top_k",
                "precision", "seed")   # with max_new_tokens and runs: results.json's "settings"


def build_parser() -> argparse.ArgumentParser:
    """evaluate.py's own flags first, then train.py's (every config field; --reward does not apply here:
    evaluation grades correctness with reward.compute_reward)."""
    return cli.build_parser("DATPO evaluation: avg@k, pass@k and maj@k (paper Sec. 5.1, App. F.1), graded "
                            "with the math grader (reward.compute_reward). Every config field is a flag; "
                            "--max_new_tokens sets the evaluation length "
                            "(else --eval_max_new_tokens, paper 2048). Output: runs/eval/<model label> (or "
                            "--out_dir): one evaluation per folder, locked while it runs; more benchmarks "
                            "with the same settings accumulate in its results.json, other settings need "
                            "--overwrite true. A training run, a checkpoint or a model folder is never an "
                            "output folder: evaluate a run with --model RUN (into runs/eval/RUN), so that "
                            "train.py's folder holds only what train.py wrote.", own=evaluation_flags)


def evaluation_flags(parser: argparse.ArgumentParser) -> None:
    """evaluate.py's own flags (shown first by --help)."""
    group = parser.add_argument_group("evaluation (evaluate.py's own flags)")
    group.add_argument("--bench", nargs="+", default=None,
                       help=f"benchmarks ({', '.join(data.NAMED_SOURCES)}, or a file); default: the preset's "
                            "eval_data")
    group.add_argument("--k", nargs="+", type=int, default=None,
                       help=f"samples per problem, 1 to {MAX_K}: one for all benchmarks or one per --bench "
                            "(default: the paper's, 8 for math500 and 64 otherwise)")
    group.add_argument("--runs", type=int, default=1,
                       help=f"independent runs pass@k/maj@k average over, 1 to {MAX_RUNS} (paper: 3)")
    group.add_argument("--limit", type=int, default=None,
                       help="first N problems per benchmark (default: preset's eval_limit, 0 = all)")
    group.add_argument("--rescore", nargs="+", default=None, metavar="FILE",
                       help="recompute and print the metrics of samples_<bench>.jsonl files; no model is "
                            "loaded")
    group.add_argument("--plot_models", nargs="+", default=None, metavar="DIR",
                       help="folders holding results.json: print one table and draw both figures for all of "
                            "them into --out_dir (default runs/eval/compare, never an evaluation's folder)")


def main(argv: list[str] | None = None) -> dict:
    """Run the CLI — one of three commands: --rescore FILE... (rescore_command), --plot_models DIR...
    (plot_models_command), else evaluate a model on benchmarks (evaluate_command). Returns {model label:
    {bench: metrics}} (records left out)."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:   # the config fields given, TRL's and verl's names as ours
        given = cli.given_flags(args, preset=args.preset, scale=args.scale)
    except ValueError as err:
        parser.error(str(err))
    if given.get("reward"):
        parser.error("--reward: evaluation grades correctness with the math grader (reward.compute_reward); "
                     "your reward functions apply to training (train.py)")
    if args.rescore:
        return rescore_command(parser, args.rescore, bool(given.get("answer_fallback", False)))
    if args.plot_models:
        return plot_models_command(args.plot_models, given.get("out_dir"))
    return evaluate_command(parser, args, given, shlex.join(["evaluate.py", *argv]))


def folder_labels(paths: list[str]) -> list[str]:
    """Each folder's name for the table; folders that share a name are told apart by their parent's
    (runs/a/demo, runs/b/demo -> a/demo, b/demo), then by their whole path."""
    resolved = [Path(p).resolve() for p in paths]
    labels = [p.name for p in resolved]
    labels = [f"{p.parent.name}/{p.name}" if labels.count(p.name) > 1 else p.name for p in resolved]
    return [str(p) if labels.count(label) > 1 else label for p, label in zip(resolved, labels)]


def rescore_command(parser, paths: list[str], answer_fallback: bool) -> dict:
    """--rescore: the metrics of saved samples_<bench>.jsonl files, from the records alone (no model), as a
    table; {folder name: {bench: metrics}}. An unreadable or malformed file exits 2 naming it."""
    by_file = {}
    for path, label in zip(paths, folder_labels([str(Path(p).resolve().parent) for p in paths])):
        try:
            bench, result = rescore_file(path, answer_fallback)
        except (OSError, ValueError) as err:
            why = f"{err.strerror}; expected a samples_<bench>.jsonl written by evaluate.py" \
                if isinstance(err, OSError) and err.strerror else str(err)
            parser.exit(2, f"evaluate.py: error: cannot rescore {path}: {why}\n")
        by_file.setdefault(label, {})[bench] = result
    print(format_table(by_file))
    return by_file


def plot_models_command(folders: list[str], out_dir: str | None) -> dict:
    """--plot_models: one table and both figures (pass@k curves, maj@k vs avg@k) for the results.json of
    several folders, written to --out_dir (default runs/eval/compare); {folder name: {bench: metrics}}.
    A folder whose results.json is missing, torn or incomplete is one line naming it and nothing is drawn
    (a comparison silently missing a model would look complete); so is an --out_dir that is an
    evaluation's folder (its own figures would be replaced), a run, a checkpoint or a model."""
    by_model = {}
    for folder, label in zip(folders, folder_labels(folders)):
        try:
            results = eval_files.load_results(folder)
        except (OSError, ValueError) as err:
            why = f"{Path(folder) / 'results.json'}: {err.strerror}" if isinstance(err, OSError) else err
            raise faults.UserError(f"--plot_models {folder}: {why}; finish that evaluation (rerun its "
                                   f"command) or leave it out") from None
        if not results:
            raise faults.UserError(f"--plot_models {folder}: {Path(folder) / 'results.json'} holds no "
                                   f"finished benchmark yet; finish that evaluation (rerun its command) or "
                                   f"leave it out")
        by_model[label] = results
    out = Path("runs/eval/compare" if out_dir is None else out_dir)
    replaces = ("holds an evaluation (results.json): the comparison would replace its figures"
                if (out / "results.json").exists() else None)
    owner = eval_files.folder_owner(out) or replaces
    if owner:
        raise faults.UserError(f"--out_dir {out}: {owner}; expected a folder for the comparison's figures, "
                               f"e.g. runs/eval/compare (the default)")
    preflight.check_writable(out, "--out_dir")
    plot_pass_curves(by_model, out / "pass_curves.png")
    plot_maj_vs_avg(by_model, out / "maj_vs_avg.png")
    print(format_table(by_model))
    print(f"figures: {out / 'pass_curves.png'}, {out / 'maj_vs_avg.png'}")
    return by_model


def evaluate_command(parser, args, given: dict, command: str = "evaluate.py") -> dict:
    """Evaluate one model on benchmarks (App. F.1): k samples per problem in --runs runs, into the output
    folder (runs/eval/<model label>, --out_dir, or the --resume folder): samples_<bench>.jsonl, results.json
    after each benchmark, the two figures and the table at the end. Every benchmark, the model name and the
    folder (whose it is, its lock, its earlier evaluation's settings) are checked before the model loads,
    so mistakes fail in seconds and change nothing."""
    import torch

    cfg = evaluation_config(parser, args, given)
    D.launched()   # WORLD_SIZE= or WORLD_SIZE=2 outside torchrun: one line before any folder is made
    benches, ks = benchmarks_and_ks(parser, args, cfg)
    limit = (args.limit if args.limit is not None else cfg.eval_limit) or None  # 0 = all, as in config.py
    max_new_tokens = given.get("max_new_tokens", cfg.eval_max_new_tokens)
    label = model_label(cfg.model)
    out, where = output_folder(cfg, label, "out_dir" in given)
    problems = {b: preflight.load_data(b, "--bench", limit) for b in benches}
    preflight.check_model(cfg.model)
    models.check_loadable(cfg.model, None, cfg.trust_remote_code)   # its own code, a tokenizer: refused here
    preflight.check_writable(out, "--out_dir")
    # the checkpoint itself (a run folder's latest moves on as it trains): its step and weights' SHA-256
    settings = {**{key: getattr(cfg, key) for key in SETTING_KEYS}, "max_new_tokens": max_new_tokens,
                "runs": args.runs, **measured.weights_identity(cfg.model, cfg.seed)}
    planned = {b: {**settings, "bench": b, "k": k, "gen_batch_size": cfg.gen_batch_size,   # the journal's
                   "problems": hashlib.sha256(json.dumps(problems[b], sort_keys=True).encode()).hexdigest()}
               for b, k in zip(benches, ks)}

    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    D.init(cfg.device)   # torchrun: problems are sharded over ranks and gathered (evaluate_problems)
    with eval_files.folder_lock(out, where, command):
        earlier, redo = ({}, [])
        if D.is_main():
            earlier, redo = eval_files.check_output_folder(out, where, settings, planned, cfg.overwrite)
        device = models.pick_device(cfg.device)
        t0 = time.perf_counter()
        model, tokenizer = load_finite_policy(cfg, device)
        print(f"loaded {cfg.model} on {device} in {time.perf_counter() - t0:.1f}s; "
              f"prompt_style={cfg.prompt_style} few_shot={cfg.few_shot} "
              f"answer_fallback={cfg.answer_fallback} T={cfg.temperature} "
              f"max_new_tokens={max_new_tokens} runs={args.runs}", flush=True)
        if redo is None or redo:   # --overwrite true over other settings
            eval_files.replace_earlier(out, settings, redo, earlier)
        summary = {"model": cfg.model, "settings": settings, "benchmarks": dict(earlier)}
        new = run_benchmarks(model, tokenizer, problems, cfg, planned, out, summary)
        if new is None:   # stopped by a signal; its samples so far are saved
            return {label: summary["benchmarks"]}
        writer = D.is_main()
        D.shutdown()
        if not writer:
            return {}
        tracking.report_eval(out, cfg.report_to, settings, new, tracking.checkpoint_step(cfg.model))
        by_model = {label: summary["benchmarks"]}   # every benchmark of the folder, earlier ones too
        plot_pass_curves(by_model, out / "pass_curves.png")
        plot_maj_vs_avg(by_model, out / "maj_vs_avg.png")
    print(format_table(by_model))
    print(f"wrote {out / 'results.json'}, samples_<bench>.jsonl, pass_curves.png, maj_vs_avg.png")
    return by_model


def run_benchmarks(model, tokenizer, problems: dict[str, list[dict]], cfg, planned: dict[str, dict],
                   out: Path, summary: dict) -> dict | None:
    """Each planned benchmark in turn, seeded on its own; rank 0 adds each result to summary["benchmarks"]
    and results.json as it ends (a partial run keeps what is done). The new results, or None when a signal
    stopped one (its samples so far saved)."""
    import torch

    new = {}
    for bench, journal_settings in planned.items():
        torch.manual_seed(cfg.seed + D.rank())  # each benchmark reproducible on its own, whatever else runs
        result = evaluate_benchmark(model, tokenizer, problems[bench], cfg, out, journal_settings)
        if result is None:
            return None
        if not D.is_main():   # every rank holds the gathered result; rank 0 writes it
            continue
        new[bench] = summary["benchmarks"][bench] = result
        eval_files.write_results(out, summary)
        tokens = result["mean_tokens"] * result["n_samples"]
        print(f"{bench}: {result['n_problems']} problems x {journal_settings['k']} samples x "
              f"{journal_settings['runs']} run(s) in {result['seconds']:.0f}s "
              f"({tokens / result['seconds']:.0f} tok/s, mean {result['mean_tokens']:.0f} tokens, "
              f"{100 * result['truncated']:.0f}% hit max_new_tokens)", flush=True)
    return new


def evaluation_config(parser, args, given: dict) -> C.Config:
    """The evaluation's Config. A run folder (--model with checkpoints/latest): evaluate with the prompt it
    was trained with (prompt_style, few_shot, answer_fallback), unless the command line says otherwise. The
    command line's mistakes are named first; a run config.json that is torn, or sets one of those to a
    value of the wrong kind, is one line naming it."""
    try:
        plain = C.make_config(args.preset, args.scale, **given)
    except ValueError as err:
        parser.error(str(err))
    needed = [key for key in eval_files.RUN_PROMPT_KEYS if key not in given]
    trained = (eval_files.run_folder_config(plain.model) if needed else None) or {}
    taken = {key: trained[key] for key in needed if key in trained}
    sets = ", ".join(f"{key} {value!r}" for key, value in taken.items())
    kinds = [key for key, value in taken.items() if type(value) is not type(getattr(plain, key))]
    try:
        if kinds:   # a string "false" would be truthy: the wrong kind is refused, not guessed
            raise ValueError(f"{kinds[0]} must be a {type(getattr(plain, kinds[0])).__name__}")
        cfg = C.make_config(args.preset, args.scale, **given, **taken)
    except ValueError as err:
        raise faults.UserError(f"--model {plain.model}: {Path(plain.model) / 'config.json'} sets {sets} "
                               f"({err}); expected the run's settings as train.py wrote them: restore it, or "
                               f"give those flags on the command line") from None
    given.update(taken)
    return cfg


def benchmarks_and_ks(parser, args, cfg) -> tuple[list[str], list[int]]:
    """--bench (default: the preset's eval_data; each once) and one k per benchmark (--k: one for all or one
    each; default the paper's, PAPER_K or DEFAULT_K), k, --runs and --limit within their ranges."""
    benches = args.bench or [cfg.eval_data]
    ks = args.k or [PAPER_K.get(b, DEFAULT_K) for b in benches]
    if len(ks) == 1:
        ks = ks * len(benches)
    if len(ks) != len(benches) or min(ks) < 1 or args.runs < 1:
        parser.error(f"--k: give one k >= 1 or one per --bench ({len(benches)}), got {ks}; --runs >= 1")
    if max(ks) > MAX_K:
        parser.error(f"--k: got {max(ks)}, expected at most {MAX_K} samples per problem (the paper uses 64)")
    if args.runs > MAX_RUNS:
        parser.error(f"--runs: got {args.runs}, expected at most {MAX_RUNS} (the paper uses 3)")
    if args.limit is not None and args.limit < 0:
        parser.error(f"--limit: got {args.limit}, expected a number of problems >= 0 (0 = all)")
    names = [eval_files.samples_path(Path(), b).name for b in benches]
    for bench, name in zip(benches, names):
        why = checks.not_utf8(bench)
        if why:
            parser.error(f"--bench {printable(bench)}: {why}; expected a UTF-8 name (rename the file): its "
                         f"samples file and results.json are UTF-8 files that record it")
        longest = len(os.fsencode(name + ".state")) + TEMPORARY_NAME_ROOM
        if longest > MAX_FILE_NAME_BYTES:
            file = os.fsencode(Path(bench).name)
            shown = bench if len(bench) <= 60 else f"{bench[:28]}...{bench[-28:]}"
            parser.error(f"--bench {shown}: a name of {len(file)} bytes; its samples are saved as "
                         f"samples_<name>.jsonl, {longest} bytes with the journal's .state and a temporary "
                         f"name's room, more than the {MAX_FILE_NAME_BYTES} a file name may have; expected a "
                         f"name of at most {len(file) - longest + MAX_FILE_NAME_BYTES} bytes (rename the "
                         f"file, or link it under a shorter name)")
    twice = next((b for i, b in enumerate(benches) if names[i] in names[:i]), None)
    if twice:
        parser.error(f"--bench: {twice} is given twice (or two files share its name: both would be saved in "
                     f"{names[benches.index(twice)]}); expected each benchmark once")
    return benches, ks


def output_folder(cfg, label: str, out_dir_given: bool) -> tuple[Path, str]:
    """(folder, how a message names it): runs/eval/<model label>, or --out_dir; --resume names the folder of
    an earlier evaluation, and rerunning into it is the same as rerunning the command that wrote it (what
    is saved is skipped). A training run, a checkpoint or a model folder is refused
    (eval_files.folder_owner)."""
    out = Path(cfg.out_dir) if out_dir_given else Path("runs") / "eval" / label
    where = f"--out_dir {out}" if out_dir_given else f"{out} (the default --out_dir)"
    if cfg.resume:
        if not Path(cfg.resume).is_dir():
            raise faults.UserError(f"--resume {cfg.resume}: no such folder; expected the output folder of an "
                                   f"earlier evaluation (it holds samples_<bench>.jsonl)")
        owner = eval_files.folder_owner(Path(cfg.resume))
        if owner:
            raise faults.UserError(f"--resume {cfg.resume}: {owner}; --resume names the output folder of "
                                   f"an earlier evaluation: to evaluate a run or a checkpoint give it as "
                                   f"--model (its evaluation goes to runs/eval/{model_label(cfg.resume)})")
        if out_dir_given and Path(cfg.out_dir).resolve() != Path(cfg.resume).resolve():
            raise faults.UserError(f"--resume {cfg.resume} --out_dir {cfg.out_dir}: two output folders; "
                                   f"--resume continues the evaluation in its own folder: give one of them")
        out, where = Path(cfg.resume), f"--resume {cfg.resume}"
    owner = eval_files.folder_owner(out)
    if owner:
        raise faults.UserError(f"{where}: {owner}; an evaluation never writes into a training run, a "
                               f"checkpoint or a model folder (--overwrite true does not change that); "
                               f"expected its own folder, e.g. runs/eval/{label} (the default)")
    return out, where


def load_finite_policy(cfg, device):
    """(model, tokenizer) of --model (its own Python code only with --trust_remote_code true), refused in one
    line when it cannot load, its tokenizer has no chat template under --prompt_style chat, or it holds a
    non-finite weight (sampling would stop on inf/NaN probabilities: say so before any benchmark runs)."""
    try:
        model, tokenizer = models.load_policy(cfg.model, device, models.policy_dtype(cfg.precision),
                                              seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        models.check_chat_template(tokenizer, cfg.prompt_style, cfg.model)
    except faults.UserError:
        raise
    except (OSError, ValueError) as err:   # transformers: a missing file (OSError) or tokenizer (ValueError)
        why = str(err).strip().splitlines()[0].strip()
        raise faults.UserError(f"--model {cfg.model}: cannot load it ({why}); expected a model folder with "
                               f"its weights and tokenizer files, or a run folder with a checkpoint") from err
    bad = [name for name, p in model.named_parameters() if not guards.all_finite([p])]
    if bad:
        raise faults.UserError(f"--model {cfg.model}: {len(bad)} weight tensor(s) hold non-finite values "
                               f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); expected a model "
                               f"or checkpoint with finite weights (an earlier checkpoint of the run)")
    return model, tokenizer


def evaluate_benchmark(model, tokenizer, problems: list[dict], cfg, out: Path, planned: dict) -> dict | None:
    """One benchmark (planned: the journal's settings, bench and k among them), its samples saved. One
    process: appended to samples_<bench>.jsonl as they come (a rerun of the same command, or --resume,
    skips what is saved); under torchrun every rank samples its shard and rank 0 writes them all at the
    end. The metrics (records left out on rank 0), or None when a signal stopped it after saving the
    current batch of samples. A full disk is one WriteError line: the samples saved before are kept."""
    bench, samples = planned["bench"], eval_files.samples_path(out, planned["bench"])
    journal = None if D.active() else Journal(samples, extra={"bench": bench}, settings=planned)
    kept = f"the samples saved before in {samples.name} are kept; a rerun continues from them"
    errors = reward_guard.RewardErrors(out / reward_guard.FILE, cfg.max_reward_error_share)
    errors.where = {"bench": bench}   # a grader's failures: OUT/reward_errors.jsonl
    try:
        stop_after = "after the current batch of samples"
        with eval_files.write_errors(samples, kept), signals.GracefulStop(stop_after) as stop:
            result = evaluate_problems(model, tokenizer, problems, cfg, planned["k"],
                                       planned["max_new_tokens"], planned["runs"], desc=bench,
                                       journal=journal, stop=stop if journal else None, errors=errors)
            if D.is_main() and journal is None:
                eval_files.write_jsonl(samples, [{"bench": bench, **r} for r in result["records"]])
    except Stopped as saved:
        print(f"stopped by {stop.requested} in {bench}: {saved}; rerun the same command to continue",
              flush=True)
        return None
    if D.is_main():
        result.pop("records")
        if journal is not None and journal.resumed:
            print(f"{bench}: reused the samples of an earlier run saved in {journal.path}", flush=True)
    return result


if __name__ == "__main__":
    faults.main_guard(main)
