"""studies/difficulty.py — Sec. 3.1 / App. B: does the best group size G depend on how hard the problems are?

    python -m studies difficulty        --scale demo   # Easy/Medium/Hard from 12 base samples + G sweep
    python -m studies difficulty-report --scale demo   # App. B figures: avg/pass vs G, 3×3 pass@k curves

difficulty: the base model samples n = 12 responses per training problem; a problem's count of correct ones
puts it in a bucket (difficulty_bucket: 9–11 easy, 5–8 medium, 1–4 hard); each bucket is subsampled
(difficulty_split) and written as easy/medium/hard.jsonl, with the 9 G-sweep train.py commands (GRPO,
G ∈ {4, 8, 16}, the same samples per step) in commands.sh; `--train true` runs them.
difficulty-report: each trained G-sweep model's avg@k and pass@k on the benchmarks (App. B figures "avg/pass
vs G" and "pass@k curves"), with 95 % intervals over problems.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import time
from pathlib import Path

import config as C
import evaluate
import train
from harness import eval_files, measured
from runtime import atomic, faults
from runtime.figures import literal
from studies.common import (
    DEMO_CONFIG,
    PAPER_MODEL,
    TINY_CONFIG,
    Study,
    correct_counts,
    load_policy,
    load_study_problems,
    markdown_table,
    mean_of,
    pm,
    pyplot,
    run_identity,
    save_png,
    t_interval,
    train_command,
    write_outputs,
)

G_SWEEP = (4, 8, 16)    # App. B's group sizes: the presets grpo-g4, grpo-g8, grpo-g16

DIFFICULTY_SCALES = {   # App. B: MATH, n = 12, subsets of 1,400, G ∈ {4, 8, 16} at 256 samples/step, 5 epochs
    "paper": dict(config=dict(model=PAPER_MODEL), data="math-train", limit=0, levels=[], n_samples=12,
                  subset=1400, samples_per_step=256, epochs=5.0, train=False, g=[4, 8, 16]),
    "demo": dict(config=DEMO_CONFIG, data="arith-train", limit=16, levels=[1, 2, 4], n_samples=12, subset=2,
                 samples_per_step=8, epochs=1.0, train=True, g=[4, 8, 16]),
    "tiny": dict(config=TINY_CONFIG, data="arith-train", limit=6, levels=[], n_samples=12, subset=2,
                 samples_per_step=8, epochs=1.0, train=True, g=[4, 8, 16]),
}
REPORT_SCALES = {   # App. B: MATH500, AIME25, AIME24, 256 samples per problem
    "paper": dict(config=dict(model=PAPER_MODEL, max_new_tokens=2048), bench=["math500", "aime25", "aime24"],
                  k=256, limit=0),
    "demo": dict(config=DEMO_CONFIG, bench=["arith-test"], k=4, limit=6),
    "tiny": dict(config=TINY_CONFIG, bench=["arith-test"], k=2, limit=2),
}

# --------------------------------------------------------------------------------------------------------
# Difficulty buckets: pure functions
# --------------------------------------------------------------------------------------------------------
DIFFICULTY_BUCKETS = ("easy", "medium", "hard")


def difficulty_bucket(correct: int, n: int = 12) -> str | None:
    """App. B: of n = 12 base-model samples, 9–11 correct = easy, 5–8 = medium, 1–4 = hard; all correct or all
    wrong → None (excluded: no signal about difficulty). Other n: the same thresholds as fractions of 12."""
    if not 0 <= correct <= n:
        raise ValueError(f"difficulty_bucket: correct must be in [0, {n}], got {correct}")
    if correct in (0, n):
        return None
    twelfths = correct * 12 / n
    return "easy" if twelfths >= 9 else "medium" if twelfths >= 5 else "hard"


def difficulty_split(correct: list[int], n: int, size: int, seed: int) -> dict[str, list[int]]:
    """Problem indices per bucket, each subsampled to at most `size` with random.Random(seed) (App. B: 1,400),
    kept in their original order."""
    buckets: dict[str, list[int]] = {b: [] for b in DIFFICULTY_BUCKETS}
    for i, c in enumerate(correct):
        bucket = difficulty_bucket(c, n)
        if bucket:
            buckets[bucket].append(i)
    rng = random.Random(seed)
    return {b: sorted(rng.sample(idx, size)) if len(idx) > size else idx for b, idx in buckets.items()}


# --------------------------------------------------------------------------------------------------------
# difficulty: the split and the G sweep
# --------------------------------------------------------------------------------------------------------
def g_sweep_config(bucket_file: Path, g: int, study: Study, run_dir: Path, subset_size: int) -> C.Config:
    """The App. B run for one subset and group size G: preset grpo-g{G} at this scale, samples_per_step fixed,
    steps = ⌈epochs · |subset| / prompts_per_step⌉."""
    prompts = max(1, study.opts["samples_per_step"] // g)
    steps = max(1, math.ceil(study.opts["epochs"] * subset_size / prompts))
    overrides = {f.name: getattr(study.cfg, f.name) for f in dataclasses.fields(C.Config)
                 if f.name in ("model", "max_new_tokens", "few_shot", "prompt_style", "answer_fallback",
                               "seed", "threads", "device", "precision")}
    micro_batch = min(prompts * g, C.make_config("paper", study.scale).micro_batch_size)
    return C.make_config(f"grpo-g{g}", study.scale, **overrides, train_data=str(bucket_file),
                         out_dir=str(run_dir), group_size=g, prompts_per_step=prompts,
                         mini_batch_size=prompts * g, micro_batch_size=micro_batch,
                         steps=steps, save_every=0, eval_every=0)


def write_buckets(study: Study, problems: list[dict], correct: list[int], split: dict) -> dict[str, Path]:
    """OUT/easy.jsonl, medium.jsonl, hard.jsonl: the kept problems, each with its count of correct base
    samples."""
    n, files = study.opts["n_samples"], {}
    for bucket in DIFFICULTY_BUCKETS:
        files[bucket] = study.out / f"{bucket}.jsonl"
        atomic.write_text(files[bucket], "".join(json.dumps({**problems[i], "correct": correct[i], "n": n})
                                                 + "\n" for i in split[bucket]))
    return files


def correct_histogram(study: Study, correct: list[int]) -> Path:
    """Problems per count of correct base samples, the bucket edges dashed."""
    n = study.opts["n_samples"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(correct, bins=[x - 0.5 for x in range(n + 2)], color="tab:blue")
    for edge in (0.5, 4.5, 8.5, n - 0.5):
        ax.axvline(edge, color="gray", ls="--", lw=0.8)
    ax.set_xlabel(f"correct of {n} base samples")
    ax.set_ylabel("problems")
    ax.set_title("difficulty buckets: hard 1–4, medium 5–8, easy 9–11")
    fig.tight_layout()
    path = study.out / "correct_histogram.png"
    save_png(fig, path, dpi=110)
    return path


def run_difficulty(study: Study) -> None:
    """Sample n = 12 responses per training problem with the base model, bucket them (difficulty_bucket),
    subsample each bucket, write easy/medium/hard.jsonl (loadable with --train_data) and the 9 G-sweep
    commands; with --train true, run them (GRPO, G ∈ {4, 8, 16}, fixed samples per step)."""
    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    problems = load_study_problems(o["data"], o["limit"], o["levels"])
    model, tokenizer, _ = load_policy(cfg)
    sampled = evaluate.evaluate_problems(model, tokenizer, problems, cfg, k=o["n_samples"],
                                         max_new_tokens=cfg.max_new_tokens, desc="difficulty: base samples")
    correct = correct_counts(sampled["records"], len(problems))
    split = difficulty_split(correct, o["n_samples"], o["subset"], cfg.seed)
    files = write_buckets(study, problems, correct, split)
    counts = {b: sum(difficulty_bucket(c, o["n_samples"]) == b for c in correct) for b in DIFFICULTY_BUCKETS}
    excluded = {"all_wrong": correct.count(0), "all_correct": correct.count(o["n_samples"])}
    del model
    runs, commands, to_train = {}, [], []
    for bucket, g in itertools.product(DIFFICULTY_BUCKETS, o["g"]):
        run_dir = study.out / "runs" / f"{bucket}_g{g}"
        run_cfg = g_sweep_config(files[bucket], g, study, run_dir, len(split[bucket]))
        runs[f"{bucket}_g{g}"] = str(run_dir)
        commands.append(train_command(f"grpo-g{g}", study.scale, run_cfg))
        if split[bucket]:
            to_train.append(run_cfg)
    atomic.write_text(study.out / "commands.sh", "\n".join(commands) + "\n")
    histogram = correct_histogram(study, correct)

    rows = [[bucket, counts[bucket], len(split[bucket]), str(files[bucket])] for bucket in DIFFICULTY_BUCKETS]
    table = markdown_table(["subset", "problems", "kept (subsampled)", "file"], rows)
    table += (f"\nExcluded: {excluded['all_wrong']} all-wrong, {excluded['all_correct']} all-correct of "
              f"{len(problems)} problems; base avg@{o['n_samples']} {sampled['avg@k']:.3f}.\n"
              f"G sweep ({'training next' if o['train'] else 'commands only'}): "
              f"{study.out / 'commands.sh'}\n")
    write_outputs(study, {"correct": correct, "counts": counts, "excluded": excluded, "kept": split,
                          "base_avg": sampled["avg@k"], "runs": runs, "commands": commands,
                          "figures": [str(histogram)]}, table, time.perf_counter() - t0)
    if o["train"]:   # the split is written first: a long sweep interrupted later keeps it
        for run_cfg in to_train:
            train.train(run_cfg)
        print(f"[difficulty] G sweep trained in {time.perf_counter() - t0:.0f}s: {', '.join(runs)}",
              flush=True)


# --------------------------------------------------------------------------------------------------------
# difficulty-report: the G-sweep models evaluated
# --------------------------------------------------------------------------------------------------------
def problem_intervals(result: dict, k: int) -> str:
    """'avg ± h / pass ± h': 95 % t-intervals over problems (a problem's share of its k samples correct;
    whether any was). Scores cached before per-problem counts were kept show the means alone."""
    counts = result.get("correct_per_problem")
    if not counts:
        return f"{result['avg@k']:.3f} / {result['pass@k']:.3f}"
    avg, h_avg = t_interval([c / k for c in counts])
    pas, h_pas = t_interval([float(c > 0) for c in counts])
    return f"{pm(avg, h_avg, 3)} / {pm(pas, h_pas, 3)}"


def score_model(study: Study, run_dir: Path, label: str) -> dict[str, dict]:
    """One G-sweep model's scores per benchmark: read from OUT/eval/<label>/<bench>.json when they measured
    exactly this (the run's latest checkpoint and its weights, the problems, k, the sampling settings:
    harness/measured.py), or evaluated now (the model loaded once, only if a benchmark needs it) and cached
    there."""
    cfg, o = study.cfg, study.opts
    run_cfg = eval_files.run_folder_config(str(run_dir)) or {}
    eval_cfg = dataclasses.replace(cfg, model=str(run_dir), **{
        key: run_cfg[key] for key in ("prompt_style", "few_shot", "answer_fallback") if key in run_cfg})
    per_bench, policy = {}, None
    for bench in o["bench"]:
        path = study.out / "eval" / label / f"{Path(bench).name}.json"
        problems = load_study_problems(bench, o["limit"], [], "--bench")
        wanted = measured.of_evaluation(eval_cfg, str(run_dir), problems, o["k"], cfg.max_new_tokens,
                                        bench=bench, **run_identity(str(run_dir)))
        cached = measured.read_cache(path, wanted, faults.say)
        if cached is None:
            if policy is None:
                policy = load_policy(eval_cfg)[:2]
            result = evaluate.evaluate_problems(*policy, problems, eval_cfg, k=o["k"],
                                                max_new_tokens=cfg.max_new_tokens, desc=f"{label} {bench}")
            result["correct_per_problem"] = correct_counts(result.pop("records"), result["n_problems"])
            result["measured"] = wanted
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_json(path, result, indent=2)
            cached = json.loads(path.read_text())
        per_bench[bench] = cached
    return per_bench


def g_sweep_figures(study: Study, scores: dict[str, dict[str, dict]]) -> list[Path]:
    """App. B's two figures: avg@k and pass@k against G per training subset; pass@k curves per subset and
    benchmark."""
    k, benches = study.opts["k"], study.opts["bench"]
    plt = pyplot()
    figures = [study.out / "avg_pass_vs_g.png", study.out / "passk_curves.png"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, bucket in zip(axes, DIFFICULTY_BUCKETS):
        gs = [g for g in G_SWEEP if f"{bucket}_g{g}" in scores]
        avg = [mean_of(r["avg@k"] for r in scores[f"{bucket}_g{g}"].values()) for g in gs]
        pas = [mean_of(r["pass@k"] for r in scores[f"{bucket}_g{g}"].values()) for g in gs]
        ax.plot(gs, avg, "o-", color="tab:blue", label=f"avg@{k}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 8, 16], ["4", "8", "16"])
        ax.set_xlabel("G (group size)")
        ax.set_ylabel(f"avg@{k}", color="tab:blue")
        twin = ax.twinx()
        twin.plot(gs, pas, "s--", color="tab:red", label=f"pass@{k}")
        twin.set_ylabel(f"pass@{k}", color="tab:red")
        ax.set_title(f"trained on {bucket.capitalize()}")
    fig.tight_layout()
    save_png(fig, figures[0], dpi=110)
    fig, axes = plt.subplots(3, len(benches), figsize=(4.2 * len(benches), 9), squeeze=False)
    for i, bucket in enumerate(DIFFICULTY_BUCKETS):
        for j, bench in enumerate(benches):
            ax = axes[i][j]
            for g in G_SWEEP:
                result = scores.get(f"{bucket}_g{g}", {}).get(bench)
                if result:
                    xs = [int(x) for x in result["pass_curve"]]
                    ax.plot(xs, list(result["pass_curve"].values()), "o-", ms=3, label=f"{bucket}_{g}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{bucket.capitalize()} / {literal(bench)}")
            ax.set_xlabel("k")
            ax.set_ylabel("pass@k")
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, figures[1], dpi=110)
    return figures


def run_difficulty_report(study: Study) -> None:
    """Evaluate the 9 G-sweep models (avg@k, pass@k; k = 256 in the paper) on each benchmark, scoring only
    models not yet scored, and draw App. B's two figures."""
    t0 = time.perf_counter()
    o = study.opts
    source = Path(o["from_dir"])
    scores: dict[str, dict[str, dict]] = {}
    for bucket, g in itertools.product(DIFFICULTY_BUCKETS, G_SWEEP):
        run_dir = source / "runs" / f"{bucket}_g{g}"
        if not (run_dir / "checkpoints" / "latest").exists():
            print(f"[difficulty-report] skip {run_dir}: no checkpoint", flush=True)
            continue
        scores[f"{bucket}_g{g}"] = score_model(study, run_dir, f"{bucket}_g{g}")
    if not scores:
        raise faults.UserError(f"--from_dir {source}: no trained runs under {source / 'runs'}; expected "
                               "the folder of `python -m studies difficulty` run with --train true, or of "
                               "the commands in its commands.sh")
    rows = []
    k = o["k"]
    for label, per_bench in scores.items():
        avg = mean_of(r["avg@k"] for r in per_bench.values())
        pas = mean_of(r["pass@k"] for r in per_bench.values())
        rows.append([label] + [problem_intervals(per_bench[b], k) for b in o["bench"]] + [avg, pas])
    headers = [f"{b} avg@{k} / pass@{k} (± 95 % CI over problems)" for b in o["bench"]]
    table = markdown_table(["model"] + headers + [f"mean avg@{k}", f"mean pass@{k}"], rows)
    figures = g_sweep_figures(study, scores)
    write_outputs(study, {"scores": scores, "figures": [str(f) for f in figures]}, table,
                  time.perf_counter() - t0)
