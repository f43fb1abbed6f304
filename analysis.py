"""analysis.py — the paper's Section 3 findings and its training-dynamics figures, one subcommand per study.

    python analysis.py difficulty        --scale demo   # Sec. 3.1, App. B: Easy/Medium/Hard split + G sweep runs
    python analysis.py difficulty-report --scale demo   # App. B: avg/pass vs G per subset, 3×3 pass@k curves
    python analysis.py tree-vs-parallel  --scale demo   # Sec. 3.2, App. C.2: PassRate vs generated tokens
    python analysis.py forks             --scale demo   # Sec. 3.3, App. D.2–D.5: PassRate/SibDiv + localization
    python analysis.py show-forks        --scale demo   # App. D.2 figures "localization" / "case study"
    python analysis.py dynamics --runs runs/a runs/b    # Sec. 5.2 "learning curve", "leaf count"; App. E.5 pass@k
    python analysis.py main-table        --scale demo   # Sec. 5.2 main table, App. E.3 tokens/wall clock, ±95 %

Every study writes runs/analysis/<study>/ (or --out_dir): result.json, table.md and PNG figure(s). `--scale`
picks the paper's settings (`paper`: Qwen2.5-3B-Instruct on MATH/AIME, a GPU), the 2-core CPU miniature
(`demo`: the embedded SmolLM2-135M on synthetic arithmetic) or the test size (`tiny`); every Config field is a
flag as in train.py (`--model`, `--max_new_tokens`, ...), and each study's own flags override its scale's
settings (STUDY_SCALES).

The metric functions (nearest_neighbor_distance, mean_pairwise_distance, window_clustering_ratio, pass_rate,
difficulty_bucket) are pure and import nothing heavy; positions are fork prefix lengths (the branch keeps
response[:f]) in a response of `length` tokens.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import random
import sys
import time
from pathlib import Path

import config as C
from harness import faults

# --------------------------------------------------------------------------------------------------------
# Metrics: pure functions (App. C.2 PassRate, App. D.2 localization, App. B difficulty buckets)
# --------------------------------------------------------------------------------------------------------


def nearest_neighbor_distance(positions, length: int) -> float | None:
    """NND (App. D.2): mean over forks of the distance to the nearest other fork, as a fraction of `length`.
    Fewer than two forks → None. Lower = stronger localization."""
    positions = list(positions)
    if len(positions) < 2:
        return None
    nearest = [min(abs(p - q) for j, q in enumerate(positions) if j != i) for i, p in enumerate(positions)]
    return sum(nearest) / len(nearest) / length


def mean_pairwise_distance(positions, length: int) -> float | None:
    """MPD (App. D.2): mean |p_i − p_j| over all pairs i < j, as a fraction of `length`. < 2 forks → None."""
    pairs = list(itertools.combinations(list(positions), 2))
    if not pairs:
        return None
    return sum(abs(p - q) for p, q in pairs) / len(pairs) / length


def window_clustering_ratio(positions, length: int, percent: float) -> float | None:
    """WCR@P (App. D.2): percentage (0–100) of fork pairs with |p_i − p_j| ≤ P/100 · length. < 2 forks → None.
    Higher = stronger localization."""
    pairs = list(itertools.combinations(list(positions), 2))
    if not pairs:
        return None
    window = percent / 100.0 * length
    return 100.0 * sum(abs(p - q) <= window for p, q in pairs) / len(pairs)


def pass_rate(rewards) -> float:
    """PassRate (App. C.2): 1.0 if any leaf's reward is 1, else 0.0."""
    return float(any(r == 1 for r in rewards))


def mean_of(values) -> float | None:
    """Mean of the values that are not None (aggregates over responses are means of per-response values)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def correct_counts(records: list[dict], n_problems: int) -> list[int]:
    """Correct samples per problem (evaluate's records: one per sample, with its problem index)."""
    counts = [0] * n_problems
    for rec in records:
        counts[rec["index"]] += int(rec["correct"])
    return counts


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
# Settings per study and scale. `config` entries are Config fields; the rest are the study's own flags.
# --------------------------------------------------------------------------------------------------------
PAPER_MODEL = "Qwen/Qwen2.5-3B-Instruct"     # App. B, C.2, D.5 analyse the instruct model
_DEMO = dict(max_new_tokens=48, few_shot=True)
_TINY = dict(max_new_tokens=10)
STUDY_SCALES: dict[str, dict[str, dict]] = {
    "difficulty": {   # App. B: MATH, n = 12, subsets of 1,400, G ∈ {4, 8, 16} at 256 samples/step, 5 epochs
        "paper": dict(config=dict(model=PAPER_MODEL), data="math-train", limit=0, levels=[], n_samples=12,
                      subset=1400, samples_per_step=256, epochs=5.0, train=False, g=[4, 8, 16]),
        "demo": dict(config=_DEMO, data="arith-train", limit=16, levels=[1, 2, 4], n_samples=12, subset=2,
                     samples_per_step=8, epochs=1.0, train=True, g=[4, 8, 16]),
        "tiny": dict(config=_TINY, data="arith-train", limit=6, levels=[], n_samples=12, subset=2,
                     samples_per_step=8, epochs=1.0, train=True, g=[4, 8, 16]),
    },
    "difficulty-report": {   # App. B: MATH500, AIME25, AIME24, 256 samples per problem
        "paper": dict(config=dict(model=PAPER_MODEL, max_new_tokens=2048), bench=["math500", "aime25", "aime24"],
                      k=256, limit=0),
        "demo": dict(config=_DEMO, bench=["arith-test"], k=4, limit=6),
        "tiny": dict(config=_TINY, bench=["arith-test"], k=2, limit=2),
    },
    "tree-vs-parallel": {   # App. C.2: AIME25, parallel M ∈ {4,8,16,32}, trees (N, 2, 2), N ∈ {2,4,8}
        "paper": dict(config=dict(model=PAPER_MODEL), data="aime25", limit=0, levels=[], parallel_m=[4, 8, 16, 32],
                      tree_n=[2, 4, 8], k=2, b=2, methods=["fixed-seg", "random"], repeats=1),
        "demo": dict(config=_DEMO, data="arith-test", limit=4, levels=[2, 3], parallel_m=[4, 8, 16],
                     tree_n=[2, 4], k=2, b=2, methods=["fixed-seg", "random"], repeats=1),
        "tiny": dict(config=_TINY, data="arith-test", limit=2, levels=[], parallel_m=[2, 4], tree_n=[1, 2], k=2, b=2,
                     methods=["fixed-seg", "random"], repeats=1),
    },
    "forks": {   # App. D.5: AIME26, one base rollout, K = 4 forks, B = 4 branches (17 leaves), 5 repeats
        "paper": dict(config=dict(model=PAPER_MODEL), data="aime26", limit=0, levels=[], k=4, b=4, repeats=5),
        "demo": dict(config=_DEMO, data="arith-test", limit=2, levels=[2, 3], k=4, b=4, repeats=1),
        "tiny": dict(config=_TINY, data="arith-test", limit=2, levels=[], k=2, b=2, repeats=2),
    },
    "show-forks": {   # App. D.2 figures: one response, K = 4 forks per strategy
        "paper": dict(config=dict(model=PAPER_MODEL), data="aime25", limit=1, levels=[], k=4, candidates=4,
                      strategies=["tok-entropy", "sent-entropy", "atb"]),
        "demo": dict(config=dict(_DEMO, max_new_tokens=96), data="arith-test", limit=4, levels=[2, 3], k=4,
                     candidates=4, strategies=["tok-entropy", "sent-entropy", "atb"]),
        "tiny": dict(config=_TINY, data="arith-test", limit=1, levels=[], k=2, candidates=2,
                     strategies=["tok-entropy", "fixed-seg"]),
    },
    "main-table": {   # Sec. 5.2 main table (MATH500 k = 8), App. E.3 token and wall-clock tables
        "paper": dict(config={}, methods=["paper", "grpo", "drgrpo", "treerl", "attnrl"], seeds=[0, 1, 2],
                      bench="math500", k=8, limit=0, equal_tokens=False),
        "demo": dict(config={}, methods=["paper", "grpo"], seeds=[0, 1, 2], bench="arith-test", k=8,
                     limit=100, equal_tokens=True),
        "tiny": dict(config={}, methods=["paper", "grpo"], seeds=[0, 1], bench="arith-test", k=2, limit=2,
                     equal_tokens=False),
    },
    "dynamics": {   # Sec. 5.2 / App. E.5: MATH500 curves, leaf count per MATH level, pass@64 on AIME26
        "paper": dict(config=dict(max_new_tokens=2048), bench="aime26", k=64, limit=0, checkpoints=True),
        "demo": dict(config=_DEMO, bench="arith-test", k=4, limit=6, checkpoints=True),
        "tiny": dict(config=_TINY, bench="arith-test", k=2, limit=2, checkpoints=True),
    },
}

# Forking strategies of the paper's fork table (App. D.5 table "distance-forced tok-entropy"): (label, method,
# minimum distance as a fraction of the response length).
FORK_STRATEGIES = [("random", "random", 0.0), ("fixed-seg", "fixed-seg", 0.0), ("atb", "atb", 0.0),
                   ("tok-entropy", "tok-entropy", 0.0), ("tok-entropy w/ 5% dist.", "tok-entropy", 0.05),
                   ("tok-entropy w/ 10% dist.", "tok-entropy", 0.10), ("sent-entropy", "sent-entropy", 0.0)]
LOCALIZATION_STRATEGIES = ("random", "sent-entropy", "tok-entropy")        # App. D.2 table
STRATEGY_COLORS = {"random": "tab:gray", "fixed-seg": "tab:green", "atb": "tab:blue", "tok-entropy": "tab:red",
                   "sent-entropy": "tab:purple", "parallel": "black"}


# --------------------------------------------------------------------------------------------------------
# Shared plumbing
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Study:
    name: str
    cfg: C.Config
    opts: dict
    out: Path
    scale: str


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1 else f"{v:.1f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(study: Study, result: dict, table: str, seconds: float) -> None:
    result = {"study": study.name, "scale": study.scale, "seconds": seconds,
              "config": json.loads(study.cfg.to_json()), "options": study.opts, **result}
    (study.out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    (study.out / "table.md").write_text(table)
    print(table)
    print(f"[{study.name}] {seconds:.0f}s; wrote {study.out}/result.json, table.md and figures", flush=True)


def load_study_problems(source: str, limit: int, levels: list[int]) -> list[dict]:
    """Problems of `source`, only the given levels (if any), first `limit` of them (0 = all)."""
    import data

    problems = data.load_problems(source)
    if levels:
        problems = [p for p in problems if p.get("level") in levels]
    problems = problems[:limit] if limit else problems
    if not problems:
        raise ValueError(f"no problems in {source!r} with levels {levels or 'any'}")
    return problems


def load_policy(cfg: C.Config):
    import torch

    import models

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = models.pick_device(cfg.device)
    model, tokenizer = models.load_policy(cfg.model, device, models.policy_dtype(cfg.precision), seed=cfg.seed)
    return model.eval(), tokenizer, device


def sampling_setup(study):
    """What the sampling studies share: the study's problems, the policy, a rollout.Sampler and prompt ids."""
    import rollout as R

    cfg, o = study.cfg, study.opts
    problems = load_study_problems(o["data"], o["limit"], o["levels"])
    model, tokenizer, device = load_policy(cfg)
    return problems, model, tokenizer, device, R.Sampler.from_config(model, tokenizer, cfg), \
        prompt_ids_of(problems, tokenizer, cfg)


def prompt_ids_of(problems, tokenizer, cfg) -> list[list[int]]:
    import data

    return [tokenizer(data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot),
                      add_special_tokens=False).input_ids for p in problems]


def base_rewards(tokenizer, base, answers: list[str], cfg) -> list[float]:
    import rollout as R

    return R.grade_responses(tokenizer, base.tokens, answers, cfg.answer_fallback)


def fork_cfg(cfg: C.Config, min_dist: float) -> C.Config:
    return dataclasses.replace(cfg, fork_min_dist=min_dist)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plt_module():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


# --------------------------------------------------------------------------------------------------------
# 1. difficulty (Sec. 3.1, App. B)
# --------------------------------------------------------------------------------------------------------
def g_sweep_config(bucket_file: Path, g: int, study: Study, run_dir: Path, subset_size: int) -> C.Config:
    """The App. B run for one subset and group size G: preset grpo-g{G} at this scale, samples_per_step fixed,
    steps = ⌈epochs · |subset| / prompts_per_step⌉."""
    prompts = max(1, study.opts["samples_per_step"] // g)
    steps = max(1, math.ceil(study.opts["epochs"] * subset_size / prompts))
    overrides = {f.name: getattr(study.cfg, f.name) for f in dataclasses.fields(C.Config)
                 if f.name in ("model", "max_new_tokens", "few_shot", "prompt_style", "answer_fallback", "seed",
                               "threads", "device", "precision")}
    return C.make_config(f"grpo-g{g}", study.scale, **overrides, train_data=str(bucket_file), out_dir=str(run_dir),
                         group_size=g, prompts_per_step=prompts, mini_batch_size=prompts * g,
                         micro_batch_size=min(prompts * g, C.make_config("paper", study.scale).micro_batch_size),
                         steps=steps, save_every=0, eval_every=0)


def train_command(preset: str, scale: str, cfg: C.Config) -> str:
    """The train.py command line that rebuilds `cfg`: the preset and scale plus every field that differs."""
    import shlex

    def flag_value(value) -> str:   # as train.py's parser reads it: true/false, list items space-separated
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, list):
            return " ".join(shlex.quote(str(v)) for v in value)
        return shlex.quote(str(value))

    default = C.make_config(preset, scale)
    flags = [f"--{f.name} {flag_value(getattr(cfg, f.name))}"
             for f in dataclasses.fields(C.Config) if getattr(cfg, f.name) != getattr(default, f.name)]
    return " ".join(["python train.py --preset", preset, "--scale", scale, *flags])


def run_difficulty(study: Study) -> None:
    """Sample n = 12 responses per training problem with the base model, bucket them (difficulty_bucket),
    subsample each bucket, write easy/medium/hard.jsonl (loadable with --train_data) and the 9 G-sweep commands;
    with --train true, run them (GRPO, G ∈ {4, 8, 16}, fixed samples per step)."""
    import evaluate

    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    problems = load_study_problems(o["data"], o["limit"], o["levels"])
    model, tokenizer, _ = load_policy(cfg)
    sampled = evaluate.evaluate_problems(model, tokenizer, problems, cfg, k=o["n_samples"],
                                         max_new_tokens=cfg.max_new_tokens, desc="difficulty: base samples")
    correct = correct_counts(sampled["records"], len(problems))
    split = difficulty_split(correct, o["n_samples"], o["subset"], cfg.seed)
    files, rows = {}, []
    for bucket in DIFFICULTY_BUCKETS:
        files[bucket] = study.out / f"{bucket}.jsonl"
        with open(files[bucket], "w") as f:
            for i in split[bucket]:
                f.write(json.dumps({**problems[i], "correct": correct[i], "n": o["n_samples"]}) + "\n")
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
    (study.out / "commands.sh").write_text("\n".join(commands) + "\n")

    plt = plt_module()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist(correct, bins=[x - 0.5 for x in range(o["n_samples"] + 2)], color="tab:blue")
    for edge in (0.5, 4.5, 8.5, o["n_samples"] - 0.5):
        ax.axvline(edge, color="gray", ls="--", lw=0.8)
    ax.set_xlabel(f"correct of {o['n_samples']} base samples")
    ax.set_ylabel("problems")
    ax.set_title("difficulty buckets: hard 1–4, medium 5–8, easy 9–11")
    fig.tight_layout()
    fig.savefig(study.out / "correct_histogram.png", dpi=110)
    plt.close(fig)

    for bucket in DIFFICULTY_BUCKETS:
        rows.append([bucket, counts[bucket], len(split[bucket]), str(files[bucket])])
    table = markdown_table(["subset", "problems", "kept (subsampled)", "file"], rows)
    table += (f"\nExcluded: {excluded['all_wrong']} all-wrong, {excluded['all_correct']} all-correct of "
              f"{len(problems)} problems; base avg@{o['n_samples']} {sampled['avg@k']:.3f}.\n"
              f"G sweep ({'training next' if o['train'] else 'commands only'}): {study.out / 'commands.sh'}\n")
    write_outputs(study, {"correct": correct, "counts": counts, "excluded": excluded, "kept": split,
                          "base_avg": sampled["avg@k"], "runs": runs, "commands": commands,
                          "figures": [str(study.out / "correct_histogram.png")]}, table, time.perf_counter() - t0)
    if o["train"]:   # the split is written first: a long sweep interrupted later keeps it
        import train

        for run_cfg in to_train:
            train.train(run_cfg)
        print(f"[difficulty] G sweep trained in {time.perf_counter() - t0:.0f}s: {', '.join(runs)}", flush=True)


def problem_intervals(result: dict, k: int) -> str:
    """'avg ± h / pass ± h': 95 % t-intervals over problems (a problem's share of its k samples correct; whether
    any was). Scores cached before per-problem counts were kept show the means alone."""
    counts = result.get("correct_per_problem")
    if not counts:
        return f"{result['avg@k']:.3f} / {result['pass@k']:.3f}"
    avg, h_avg = t_interval([c / k for c in counts])
    pas, h_pas = t_interval([float(c > 0) for c in counts])
    return f"{pm(avg, h_avg, 3)} / {pm(pas, h_pas, 3)}"


def run_difficulty_report(study: Study) -> None:
    """Evaluate the 9 G-sweep models (avg@k, pass@k; k = 256 in the paper) on each benchmark, scoring only
    models not yet scored, and draw App. B's two figures."""
    import evaluate

    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    source = Path(o["from_dir"])
    cache = study.out / "eval"
    scores: dict[str, dict[str, dict]] = {}
    for bucket, g in itertools.product(DIFFICULTY_BUCKETS, (4, 8, 16)):
        run_dir = source / "runs" / f"{bucket}_g{g}"
        if not (run_dir / "checkpoints" / "latest").exists():
            print(f"[difficulty-report] skip {run_dir}: no checkpoint", flush=True)
            continue
        label = f"{bucket}_g{g}"
        scores[label] = {}
        policy = None
        for bench in o["bench"]:
            path = cache / label / f"{bench}.json"
            if not path.exists():
                if policy is None:   # loaded once per model, only when a benchmark is not yet scored
                    run_cfg = evaluate.run_folder_config(str(run_dir)) or {}
                    eval_cfg = dataclasses.replace(cfg, model=str(run_dir), **{
                        key: run_cfg[key] for key in ("prompt_style", "few_shot", "answer_fallback") if key in run_cfg})
                    policy = load_policy(eval_cfg)[:2]
                result = evaluate.evaluate_problems(*policy, load_study_problems(bench, o["limit"], []), eval_cfg,
                                                    k=o["k"], max_new_tokens=cfg.max_new_tokens, desc=f"{label} {bench}")
                result["correct_per_problem"] = correct_counts(result.pop("records"), result["n_problems"])
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(result, indent=2))
            scores[label][bench] = json.loads(path.read_text())
        del policy
    if not scores:
        raise SystemExit(f"difficulty-report: no trained runs under {source / 'runs'}; run `analysis.py difficulty` "
                         "with --train true, or the commands in its commands.sh")
    rows = []
    k = o["k"]
    for label, per_bench in scores.items():
        avg = mean_of(r["avg@k"] for r in per_bench.values())
        pas = mean_of(r["pass@k"] for r in per_bench.values())
        rows.append([label] + [problem_intervals(per_bench[b], k) for b in o["bench"]] + [avg, pas])
    table = markdown_table(["model"] + [f"{b} avg@{k} / pass@{k} (± 95 % CI over problems)" for b in o["bench"]]
                           + [f"mean avg@{k}", f"mean pass@{k}"], rows)

    plt = plt_module()
    figures = [study.out / "avg_pass_vs_g.png", study.out / "passk_curves.png"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, bucket in zip(axes, DIFFICULTY_BUCKETS):
        gs = [g for g in (4, 8, 16) if f"{bucket}_g{g}" in scores]
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
    fig.savefig(figures[0], dpi=110)
    plt.close(fig)
    benches = o["bench"]
    fig, axes = plt.subplots(3, len(benches), figsize=(4.2 * len(benches), 9), squeeze=False)
    for i, bucket in enumerate(DIFFICULTY_BUCKETS):
        for j, bench in enumerate(benches):
            ax = axes[i][j]
            for g in (4, 8, 16):
                result = scores.get(f"{bucket}_g{g}", {}).get(bench)
                if result:
                    xs = [int(x) for x in result["pass_curve"]]
                    ax.plot(xs, list(result["pass_curve"].values()), "o-", ms=3, label=f"{bucket}_{g}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{bucket.capitalize()} / {bench}")
            ax.set_xlabel("k")
            ax.set_ylabel("pass@k")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(figures[1], dpi=110)
    plt.close(fig)
    write_outputs(study, {"scores": scores, "figures": [str(f) for f in figures]}, table, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------------
# 2. tree-vs-parallel (Sec. 3.2, App. C.2)
# --------------------------------------------------------------------------------------------------------
def run_tree_vs_parallel(study: Study) -> None:
    """PassRate against generated tokens per problem. Per problem, max(M) parallel samples are drawn once;
    parallel M uses the first M of them, and the tree (N, K, B) grows K forks × B branches on each of the
    first N (the base responses of a tree are parallel samples too), for each forking method. Nested subsets
    of i.i.d. samples give the same expectations as separate draws and pair the comparison."""
    import torch
    from tqdm import tqdm

    import rollout as R

    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    if o.get("from_result"):   # the table, intervals and figure again from a finished run's records
        records, problems = json.loads((study.out / "result.json").read_text())["records"], range(0)
        summary, table = summarise_tree_vs_parallel(records, o, len({r["problem"] for r in records}))
        return tree_vs_parallel_figure(study, summary, table, time.perf_counter() - t0, records)
    problems, model, tokenizer, device, sampler, ids = sampling_setup(study)
    import models
    m_max, n_max = max(o["parallel_m"]), max(o["tree_n"])
    if n_max > m_max:
        raise ValueError(f"--tree_n {n_max} > max --parallel_m {m_max}: trees take their bases from the parallel samples")
    rng = random.Random(cfg.seed)
    per_call = max(1, cfg.gen_batch_size // m_max)
    records = []   # one per (repeat, problem)
    bar = tqdm(total=o["repeats"] * len(problems), desc="tree-vs-parallel", unit="problem", dynamic_ncols=True)
    for repeat in range(o["repeats"]):
        for first in range(0, len(problems), per_call):
            group = list(range(first, min(first + per_call, len(problems))))
            with torch.no_grad(), models.autocast(device, cfg.precision):
                base = R.sample_base(sampler, [ids[i] for i in group], m_max, cfg.max_new_tokens, keep_cache=True)
            answers = [problems[group[r // m_max]]["answer"] for r in range(len(base.tokens))]
            rewards = base_rewards(tokenizer, base, answers, cfg)
            subtrees = {}
            for method in o["methods"]:
                forks = {g * m_max + j: R.choose_forks(method, o["k"], tokenizer, model, base.prompt_ids[g * m_max + j],
                                                       base.tokens[g * m_max + j], base.entropies[g * m_max + j], rng, cfg)
                         for g in range(len(group)) for j in range(n_max)}
                with models.autocast(device, cfg.precision):
                    subtrees[method] = R.grow_from_forks(sampler, tokenizer, base, forks, o["b"], answers,
                                                         cfg.max_new_tokens, cfg.branch_chunk_size,
                                                         cfg.answer_fallback, rewards, cfg.branch_budget)
            for g, index in enumerate(group):
                rows = range(g * m_max, (g + 1) * m_max)
                rec = {"repeat": repeat, "problem": index, "level": problems[index].get("level")}
                for m in o["parallel_m"]:
                    rec[f"parallel/{m}"] = {"tokens": sum(len(base.tokens[r]) for r in rows[:m]),
                                            "pass_rate": pass_rate([rewards[r] for r in rows[:m]]), "leaves": m}
                for method in o["methods"]:
                    for n in o["tree_n"]:
                        blocks = [b for r in rows[:n] for b in subtrees[method][r]]
                        rec[f"{method}/{n}"] = {"tokens": sum(len(b.token_ids) for b in blocks),
                                                "pass_rate": pass_rate([b.reward for b in blocks if b.terminal]),
                                                "leaves": sum(b.terminal for b in blocks)}
                records.append(rec)
            bar.update(len(group))
            del base
    bar.close()

    summary, table = summarise_tree_vs_parallel(records, o, len(problems))
    tree_vs_parallel_figure(study, summary, table, time.perf_counter() - t0, records)


def summarise_tree_vs_parallel(records: list[dict], o: dict, n_problems: int) -> tuple[dict, str]:
    """Per curve point: means over (repeat, problem) units with 95 % t-intervals on PassRate; then each tree
    point against the parallel M nearest in mean tokens, paired by unit (the tree's bases are those parallel
    samples): ΔPassRate with its interval, and what it says about Sec. 3.2's claim."""
    import numpy as np

    curves = {"parallel": [(m, f"parallel/{m}") for m in o["parallel_m"]]}
    for method in o["methods"]:
        curves[f"tree {method}"] = [(n, f"{method}/{n}") for n in o["tree_n"]]
    summary, rows = {}, []
    for name, points in curves.items():
        summary[name] = []
        for size, key in points:
            rate, half = t_interval([r[key]["pass_rate"] for r in records])
            point = {"size": size, "key": key, "tokens": float(np.mean([r[key]["tokens"] for r in records])),
                     "pass_rate": rate, "pass_rate_ci": half,
                     "leaves": float(np.mean([r[key]["leaves"] for r in records]))}
            summary[name].append(point)
            label = f"M = {size}" if name == "parallel" else f"(N, K, B) = ({size}, {o['k']}, {o['b']})"
            rows.append([name, label, point["leaves"], point["tokens"], pm(rate, half, scale=100)])
    table = markdown_table(["method", "size", "leaves / problem", "generated tokens / problem",
                            "PassRate (%) ± 95 % CI"], rows)
    pairs = []
    for name, points in summary.items():
        if name == "parallel":
            continue
        for point in points:
            near = min(summary["parallel"], key=lambda q: abs(q["tokens"] - point["tokens"]))
            diff, half = t_interval([r[point["key"]]["pass_rate"] - r[near["key"]]["pass_rate"] for r in records])
            pairs.append([f"{name} N = {point['size']}", f"M = {near['size']}", point["tokens"] / near["tokens"],
                          pm(diff, half, scale=100), verdict(diff, half, "tree", "parallel")])
    table += "\nPaired (same problems and samples): tree − parallel at the nearest token count\n\n" + markdown_table(
        ["tree", "parallel", "token ratio", "ΔPassRate (pp) ± 95 % CI", "shows"], pairs)
    table += f"\n{n_problems} problems ({o['data']}, levels {o['levels'] or 'all'}) × {o['repeats']} repeat(s).\n"
    summary["paired"] = pairs
    return summary, table


def pm(value: float, half: float | None, digits: int = 1, scale: float = 1.0) -> str:
    """'value ± half', both × scale (100: percentages); half None: one unit, no interval."""
    return f"{value * scale:.{digits}f}" + ("" if half is None else f" ± {half * scale:.{digits}f}")


def verdict(diff: float, half: float | None, first: str, second: str) -> str:
    """What a paired difference's 95 % interval says: one side higher, or no difference shown."""
    if half is None:
        return "one unit: no interval"
    if diff - half > 0:
        return f"{first} higher"
    if diff + half < 0:
        return f"{second} higher"
    return "no difference shown"


def tree_vs_parallel_figure(study, summary: dict, table: str, seconds: float, records: list) -> None:
    plt = plt_module()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in ((k, v) for k, v in summary.items() if k != "paired"):
        color = STRATEGY_COLORS.get(name.replace("tree ", ""), None)
        ax.errorbar([p["tokens"] for p in points], [100 * p["pass_rate"] for p in points],
                    yerr=[100 * (p["pass_rate_ci"] or 0) for p in points], fmt="o-" if name == "parallel" else "s--",
                    color=color, label=name, capsize=3)
        for p in points:
            ax.annotate(str(p["size"]), (p["tokens"], 100 * p["pass_rate"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("PassRate (%)")
    ax.set_title(f"tree vs parallel ({study.opts['data']}; labels: M or N; bars: 95 % CI)")
    ax.legend()
    fig.tight_layout()
    figure = study.out / "tree_vs_parallel.png"
    fig.savefig(figure, dpi=110)
    plt.close(fig)
    write_outputs(study, {"summary": summary, "records": records, "figures": [str(figure)]}, table, seconds)


# --------------------------------------------------------------------------------------------------------
# 3. forks (Sec. 3.3, App. D.2–D.5)
# --------------------------------------------------------------------------------------------------------
def localization(positions, length: int) -> dict:
    """NND, MPD, WCR@5, WCR@10 of one response's forks (App. D.2 table)."""
    return {"NND": nearest_neighbor_distance(positions, length), "MPD": mean_pairwise_distance(positions, length),
            "WCR@5": window_clustering_ratio(positions, length, 5), "WCR@10": window_clustering_ratio(positions, length, 10)}


def run_forks(study: Study) -> None:
    """Per problem and repeat ONE base rollout; every strategy picks K forks on it and grows B branches per fork
    (1 + K·B leaves); PassRate and SibDiv (App. D.3) per tree, averaged over problems and repeats; localization
    metrics of the same fork positions. A repeat draws a new base rollout (the paper repeats the whole
    procedure five times)."""
    import torch
    from tqdm import tqdm

    import models
    import rollout as R
    import tree as T

    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    strategies = [s for s in FORK_STRATEGIES if s[0] in o["strategies"]] if o.get("strategies") else FORK_STRATEGIES
    if o.get("from_result"):   # the tables, intervals and figures again from a finished run's records
        records = json.loads((study.out / "result.json").read_text())["records"]
        strategies = [s for s in strategies if any(r["strategy"] == s[0] for r in records)]
        summary, table = summarise_forks(records, strategies, o, len({r["problem"] for r in records}),
                                         cfg.embed_model)
        return forks_figures(study, strategies, summary, table, time.perf_counter() - t0, records)
    problems, model, tokenizer, device, sampler, ids = sampling_setup(study)
    embedder = models.load_embedder(cfg.embed_model, device)
    rng = random.Random(cfg.seed)
    records = []
    per_call = max(1, cfg.gen_batch_size)
    bar = tqdm(total=o["repeats"] * len(problems) * len(strategies), desc="forks", unit="tree", dynamic_ncols=True)
    for repeat in range(o["repeats"]):
        for first in range(0, len(problems), per_call):
            group = list(range(first, min(first + per_call, len(problems))))
            with torch.no_grad(), models.autocast(device, cfg.precision):
                base = R.sample_base(sampler, [ids[i] for i in group], 1, cfg.max_new_tokens, keep_cache=True)
            answers = [problems[i]["answer"] for i in group]
            rewards = base_rewards(tokenizer, base, answers, cfg)
            for label, method, min_dist in strategies:
                scfg = fork_cfg(cfg, min_dist)
                forks = {r: R.choose_forks(method, o["k"], tokenizer, model, base.prompt_ids[r], base.tokens[r],
                                           base.entropies[r], rng, scfg) for r in range(len(group))}
                with models.autocast(device, cfg.precision):
                    subtrees = R.grow_from_forks(sampler, tokenizer, base, forks, o["b"], answers, cfg.max_new_tokens,
                                                 cfg.branch_chunk_size, cfg.answer_fallback, rewards, cfg.branch_budget)
                texts = [b.text for r in range(len(group)) for b in subtrees[r]]
                vectors = embedder.encode(texts, batch_size=cfg.embed_batch_size, convert_to_numpy=True,
                                          show_progress_bar=False) if texts else []
                at = 0
                for r, index in enumerate(group):
                    blocks = subtrees[r]
                    emb = vectors[at:at + len(blocks)]
                    at += len(blocks)
                    length = len(base.tokens[r])
                    records.append({
                        "repeat": repeat, "problem": index, "strategy": label, "forks": forks[r], "length": length,
                        "leaves": sum(b.terminal for b in blocks),
                        "pass_rate": pass_rate([b.reward for b in blocks if b.terminal]),
                        "sib_div": T.sib_div([b.parent for b in blocks], emb),
                        "branch_tokens": sum(len(b.token_ids) for b in blocks if b.branch),
                        "base": [t for b in blocks if not b.branch for t in b.token_ids],
                        **localization(forks[r], length)})
                    bar.update(1)
            del base
    bar.close()

    summary, table = summarise_forks(records, strategies, o, len(problems), cfg.embed_model)
    forks_figures(study, strategies, summary, table, time.perf_counter() - t0, records)


def summarise_forks(records: list[dict], strategies: list, o: dict, n_problems: int, embed_model: str):
    """Fork table and localization table: means over (repeat, problem) units (each one base rollout shared by
    every strategy) with 95 % t-intervals on PassRate and SibDiv, and each strategy paired against
    sent-entropy on the same rollouts (Sec. 3.3's claims: sent-entropy's PassRate highest, tok-entropy's SibDiv)."""
    import numpy as np

    summary, rows = {}, []
    by_unit = {(r["repeat"], r["problem"], r["strategy"]): r for r in records}
    units = sorted({(r["repeat"], r["problem"]) for r in records})
    for label, _, _ in strategies:
        mine = [r for r in records if r["strategy"] == label]
        summary[label] = {key: mean_of(r[key] for r in mine) for key in
                          ("pass_rate", "sib_div", "leaves", "branch_tokens", "NND", "MPD", "WCR@5", "WCR@10")}
        summary[label]["forks"] = float(np.mean([len(r["forks"]) for r in mine]))
        summary[label]["pass_rate_ci"] = t_interval([r["pass_rate"] for r in mine])[1]
        sib = [r["sib_div"] for r in mine if r["sib_div"] is not None]
        summary[label]["sib_div_ci"] = t_interval(sib)[1] if sib else None
        x = summary[label]
        rows.append([label, pm(x["pass_rate"], x["pass_rate_ci"], scale=100),
                     None if x["sib_div"] is None else pm(x["sib_div"], x["sib_div_ci"], 3),
                     x["forks"], x["leaves"], x["branch_tokens"]])
    table = "Fork table (App. D.5; paper: AIME26, Qwen2.5-3B-Instruct)\n\n" + markdown_table(
        ["strategy", "PassRate (%) ± 95 % CI", "SibDiv ± 95 % CI", "forks / response", "leaves", "branch tokens"], rows)
    pairs = []
    if any(s[0] == "sent-entropy" for s in strategies):
        for label, _, _ in strategies:
            if label == "sent-entropy":
                continue
            both = [u for u in units if (*u, label) in by_unit and (*u, "sent-entropy") in by_unit]
            d_pass, h_pass = t_interval([by_unit[(*u, "sent-entropy")]["pass_rate"] - by_unit[(*u, label)]["pass_rate"]
                                         for u in both])
            sib = [(by_unit[(*u, "sent-entropy")]["sib_div"], by_unit[(*u, label)]["sib_div"]) for u in both]
            sib = [a - b for a, b in sib if a is not None and b is not None]
            d_sib, h_sib = t_interval(sib) if sib else (None, None)
            pairs.append([label, pm(d_pass, h_pass, scale=100),
                          verdict(d_pass, h_pass, "sent-entropy", label),
                          None if d_sib is None else pm(d_sib, h_sib, 3),
                          None if d_sib is None else verdict(d_sib, h_sib, "sent-entropy", label)])
        table += ("\nPaired on the same base rollouts: sent-entropy − strategy\n\n" + markdown_table(
            ["strategy", "ΔPassRate (pp) ± 95 % CI", "PassRate shows", "ΔSibDiv ± 95 % CI", "SibDiv shows"], pairs))
    summary["paired"] = pairs
    loc = [x for x in LOCALIZATION_STRATEGIES if x in summary]
    table += "\nLocalization (App. D.2; lower NND/MPD, higher WCR = stronger localization)\n\n" + markdown_table(
        ["metric"] + loc, [[m] + [summary[x][m] for x in loc] for m in ("NND", "MPD", "WCR@5", "WCR@10")])
    table += (f"\n{n_problems} problems ({o['data']}, levels {o['levels'] or 'all'}) × {o['repeats']} repeats = "
              f"{len(units)} base rollouts; K = {o['k']}, B = {o['b']}; embedder {embed_model}.\n")
    return summary, table


def forks_figures(study, strategies: list, summary: dict, table: str, seconds: float, records: list) -> None:
    o = study.opts
    loc = [x for x in LOCALIZATION_STRATEGIES if x in summary]
    plt = plt_module()
    labels = [s[0] for s in strategies]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    colors = [STRATEGY_COLORS.get(s[1]) for s in strategies]
    left.bar(range(len(labels)), [100 * summary[x]["pass_rate"] for x in labels], color=colors,
             yerr=[100 * (summary[x]["pass_rate_ci"] or 0) for x in labels], capsize=3)
    left.set_ylabel("PassRate (%) ± 95 % CI")
    right.bar(range(len(labels)), [summary[x]["sib_div"] or 0.0 for x in labels], color=colors,
              yerr=[summary[x]["sib_div_ci"] or 0 for x in labels], capsize=3)
    right.set_ylabel("SibDiv ± 95 % CI")
    for ax in (left, right):
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    fig.suptitle(f"forking strategies on one fixed base rollout (K = {o['k']}, B = {o['b']})")
    fig.tight_layout()
    figures = [study.out / "fork_table.png", study.out / "localization.png"]
    fig.savefig(figures[0], dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
    for ax, metric in zip(axes, ("NND", "MPD", "WCR@5", "WCR@10")):
        ax.bar(range(len(loc)), [summary[s][metric] or 0.0 for s in loc], color=[STRATEGY_COLORS[s] for s in loc])
        ax.set_xticks(range(len(loc)), loc, rotation=20, fontsize=8)
        ax.set_title(metric + (" ↓" if metric in ("NND", "MPD") else " ↑"))
    fig.tight_layout()
    fig.savefig(figures[1], dpi=110)
    plt.close(fig)
    write_outputs(study, {"summary": summary, "records": records, "figures": [str(f) for f in figures]}, table,
                  seconds)


# --------------------------------------------------------------------------------------------------------
# 4. show-forks (App. D.2 figures "localization" and "case study")
# --------------------------------------------------------------------------------------------------------
def token_lines(pieces: list[str], width: int) -> list[list[tuple[int, int, str]]]:
    """Lay tokens out in a monospace grid: per line, (token index, column, text) with newlines breaking lines
    and long lines wrapped at `width` characters."""
    lines: list[list[tuple[int, int, str]]] = [[]]
    col = 0
    for i, piece in enumerate(pieces):
        parts = piece.split("\n")
        for n, part in enumerate(parts):
            if n > 0:
                lines.append([])
                col = 0
            shown = part if part or n == len(parts) - 1 else ""
            if col + len(shown) > width and col > 0:
                lines.append([])
                col = 0
            if shown or (n == 0 and not piece):
                lines[-1].append((i, col, shown or "·"))   # an empty piece (EOS) shows as a dot
                col += max(len(shown), 1)
    return lines


def render_forks_html(pieces, entropies, forks_by: dict[str, list[int]], title: str) -> str:
    """A self-contained page: tokens shaded by entropy (white → red), each strategy's fork tokens outlined in its
    colour (nested rings where strategies agree). The boxed token is the last one a branch keeps (f − 1)."""
    import html

    top = max(entropies) if entropies else 1.0
    colors = {name: _css_color(STRATEGY_COLORS.get(name, "tab:orange")) for name in forks_by}
    spans = []
    for i, (piece, h) in enumerate(zip(pieces, entropies)):
        shade = int(255 - 200 * (h / top if top else 0))
        rings = [colors[name] for name, forks in forks_by.items() if i + 1 in forks]
        shadow = ", ".join(f"0 0 0 {2 * (j + 1)}px {c}" for j, c in enumerate(rings))
        style = f"background: rgb(255,{shade},{shade});" + (f" box-shadow: {shadow}; margin: 0 {2 * len(rings)}px;"
                                                          if rings else "")
        tip = f"token {i}, H = {h:.2f}" + (f"; fork of {', '.join(n for n in forks_by if i + 1 in forks_by[n])}"
                                          if rings else "")
        spans.append(f'<span style="{style}" title="{html.escape(tip)}">{html.escape(piece) or "·"}</span>')
    legend = " ".join(f'<span style="border: 3px solid {colors[n]}; padding: 0 4px">{html.escape(n)}: '
                      f'{forks_by[n]}</span>' for n in forks_by)
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>forks</title></head>"
            "<body style='font-family: sans-serif; max-width: 60em; margin: 2em auto'>"
            f"<h3>{html.escape(title)}</h3><p>Shading: token entropy H (white = 0, red = {top:.2f}). Boxes: the "
            "last token each strategy's branches keep (fork prefix length f → token f − 1). Fork lists are prefix "
            f"lengths.</p><p>{legend}</p>"
            f"<pre style='white-space: pre-wrap; line-height: 2.2; font-size: 14px'>{''.join(spans)}</pre>"
            "</body></html>\n")


def _css_color(name: str) -> str:
    from matplotlib.colors import to_hex
    return to_hex(name)


def render_forks_png(pieces, entropies, forks_by: dict[str, list[int]], title: str, path: Path, width: int = 90):
    plt = plt_module()
    from matplotlib.patches import Rectangle

    lines = token_lines(pieces, width)
    top = max(entropies) if entropies else 1.0
    char_w, line_h = 0.6 * 9 / 72, 2.0 * 9 / 72          # inches per character / line at 9 pt monospace
    fig_w, fig_h = width * char_w + 0.6, len(lines) * line_h + 1.0      # 0.8 in on top for title and legend
    fig = plt.figure(figsize=(fig_w, fig_h))
    ax = fig.add_axes([0.3 / fig_w, 0.2 / fig_h, width * char_w / fig_w, len(lines) * line_h / fig_h])
    ax.set_xlim(0, width)
    ax.set_ylim(len(lines), 0)
    ax.axis("off")
    cmap = plt.get_cmap("Reds")
    names = list(forks_by)
    for y, line in enumerate(lines):
        for i, x, text in line:
            ax.add_patch(Rectangle((x, y + 0.1), len(text), 0.8, color=cmap(0.8 * entropies[i] / top if top else 0),
                                   lw=0, zorder=1))
            ax.text(x, y + 0.5, text, family="monospace", fontsize=9, va="center", ha="left", zorder=2)
            for j, name in enumerate(names):
                if i + 1 in forks_by[name]:
                    pad = 0.08 * (j + 1)
                    ax.add_patch(Rectangle((x - pad, y + 0.1 - pad), len(text) + 2 * pad, 0.8 + 2 * pad, fill=False,
                                           lw=1.6, edgecolor=STRATEGY_COLORS.get(name, "tab:orange"), zorder=3))
    handles = [Rectangle((0, 0), 1, 1, fill=False, lw=2, edgecolor=STRATEGY_COLORS.get(n, "tab:orange"),
                         label=f"{n} {forks_by[n]}") for n in names]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.28 / fig_h), ncol=len(names),
               fontsize=8, frameon=False)
    fig.suptitle(title, y=0.995, fontsize=9)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_show_forks(study: Study) -> None:
    """One response (the longest of `candidates` samples of the first problems) with each strategy's K forks."""
    import torch

    import models
    import rollout as R

    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    problems, model, tokenizer, device, sampler, ids = sampling_setup(study)
    with torch.no_grad(), models.autocast(device, cfg.precision):
        base = R.sample_base(sampler, ids, o["candidates"], cfg.max_new_tokens)
    row = max(range(len(base.tokens)), key=lambda r: len(base.tokens[r]))
    problem = problems[row // o["candidates"]]
    tokens, entropies = base.tokens[row], base.entropies[row]
    rng = random.Random(cfg.seed)
    forks_by = {name: R.choose_forks(name, o["k"], tokenizer, model, base.prompt_ids[row], tokens, entropies, rng, cfg)
                for name in o["strategies"]}
    pieces = tokenizer.batch_decode([[t] for t in tokens], skip_special_tokens=True)
    title = f"{problem['problem']}  (gold {problem['answer']}; {len(tokens)} tokens; K = {o['k']})"
    figures = [study.out / "forks.png", study.out / "forks.html"]
    render_forks_png(pieces, entropies, forks_by, title, figures[0])
    figures[1].write_text(render_forks_html(pieces, entropies, forks_by, title))
    rows = [[name, str(forks), *(localization(forks, len(tokens)).values())] for name, forks in forks_by.items()]
    table = markdown_table(["strategy", "forks (prefix lengths)", "NND", "MPD", "WCR@5", "WCR@10"], rows)
    write_outputs(study, {"problem": problem, "tokens": tokens, "pieces": pieces, "entropies": entropies,
                          "forks": forks_by, "figures": [str(f) for f in figures]}, table, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------------
# 5. dynamics (Sec. 5.2 "learning curve", "leaf count"; App. E.5 "pass@64 across checkpoints")
# --------------------------------------------------------------------------------------------------------
def level_summary(step_records: list[dict]) -> dict[str, dict]:
    """Per level, over a run's logged steps: leaves per prompt and PassRate weighted by the prompts logged
    (train.py writes tree.level_stats into each step record)."""
    totals: dict[str, list[float]] = {}
    for rec in step_records:
        for level, s in rec.get("levels", {}).items():
            t = totals.setdefault(level, [0.0, 0.0, 0.0])
            t[0] += s["prompts"]
            t[1] += s["leaves"] * s["prompts"]
            t[2] += s["pass_rate"] * s["prompts"]
    return {lv: {"prompts": int(t[0]), "leaves": t[1] / t[0], "pass_rate": t[2] / t[0]}
            for lv, t in sorted(totals.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else kv[0])}


def run_dynamics(study: Study) -> None:
    import evaluate

    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    if not o["runs"]:
        raise SystemExit("dynamics: give one or more run folders with --runs")
    runs = {}
    for folder in map(Path, o["runs"]):
        metrics = folder / "metrics.jsonl"
        if not metrics.exists():
            raise SystemExit(f"dynamics: {metrics} not found (expected a train.py run folder)")
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        run_cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
        label = f"{folder.name} ({run_cfg.get('method', '?')})"
        evals = [r for r in records if "eval" in r]
        key = next((k for r in evals for k in r if k.startswith("avg@")), None)
        runs[label] = {"folder": str(folder), "config": run_cfg,
                       "curve": [(r["step"], r[key]) for r in evals] if key else [], "curve_metric": key,
                       "levels": level_summary([r for r in records if "eval" not in r]), "checkpoints": {}}
        if o["checkpoints"]:
            for ckpt in sorted((folder / "checkpoints").glob("step_*")):
                cache = study.out / "scores" / folder.name / f"{ckpt.name}_{o['bench']}_k{o['k']}.json"
                if not cache.exists():
                    eval_cfg = dataclasses.replace(cfg, model=str(ckpt), **{
                        k: run_cfg[k] for k in ("prompt_style", "few_shot", "answer_fallback") if k in run_cfg})
                    model, tokenizer, _ = load_policy(eval_cfg)
                    result = evaluate.evaluate_problems(model, tokenizer, load_study_problems(o["bench"], o["limit"], []),
                                                        eval_cfg, k=o["k"], max_new_tokens=cfg.max_new_tokens,
                                                        desc=f"{folder.name}/{ckpt.name}")
                    result.pop("records")
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    cache.write_text(json.dumps(result, indent=2))
                    del model
                runs[label]["checkpoints"][int(ckpt.name.split("_")[1])] = json.loads(cache.read_text())

    plt = plt_module()
    figures = [study.out / "learning_curve.png", study.out / "leaf_count.png", study.out / "passk_checkpoints.png"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, run in runs.items():
        if run["curve"]:
            ax.plot(*zip(*run["curve"]), "o-", label=f"{label} {run['curve_metric']}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (train.py eval)")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(figures[0], dpi=110)
    plt.close(fig)
    levels = sorted({lv for run in runs.values() for lv in run["levels"]}, key=lambda x: (len(x), x))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(runs), 1)
    for j, (label, run) in enumerate(runs.items()):
        xs = [i + j * width for i in range(len(levels))]
        left.bar(xs, [run["levels"].get(lv, {}).get("leaves", 0) for lv in levels], width, label=label)
        right.bar(xs, [run["levels"].get(lv, {}).get("pass_rate", 0) for lv in levels], width, label=label)
    for ax, name in ((left, "leaves per prompt (train-time)"), (right, "PassRate (train-time)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], [f"level {lv}" for lv in levels])
        ax.set_ylabel(name)
        _legend(ax)
    fig.tight_layout()
    fig.savefig(figures[1], dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, run in runs.items():
        if run["checkpoints"]:
            steps = sorted(run["checkpoints"])
            ax.plot(steps, [run["checkpoints"][s]["pass@k"] for s in steps], "o-", label=label)
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel(f"pass@{o['k']} on {o['bench']}")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(figures[2], dpi=110)
    plt.close(fig)

    rows = [[label, f"level {lv}", s["prompts"], s["leaves"], 100 * s["pass_rate"]]
            for label, run in runs.items() for lv, s in run["levels"].items()]
    table = "Train-time leaves and PassRate per level (Fig. \"leaf count\")\n\n" + markdown_table(
        ["run", "level", "prompts", "leaves / prompt", "PassRate (%)"], rows)
    rows = [[label, step, r["avg@k"], r["pass@k"]] for label, run in runs.items()
            for step, r in sorted(run["checkpoints"].items())]
    table += f"\nCheckpoints on {o['bench']} (k = {o['k']})\n\n" + markdown_table(
        ["run", "step", f"avg@{o['k']}", f"pass@{o['k']}"], rows)
    write_outputs(study, {"runs": runs, "figures": [str(f) for f in figures]}, table, time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------------------
# Sec. 5.2 main table in miniature: methods × seeds, trained then evaluated, with 95 % intervals over seeds
# --------------------------------------------------------------------------------------------------------
def t_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width of the two-sided Student-t interval over the values); half-width None for one value.
    Seeds are the independent units: each seed is a whole training run, evaluated once."""
    from scipy import stats

    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)


def pass_curve(correct: list[int], n: int) -> dict[int, float]:
    """pass@j for j = 1…n: the unbiased estimator (evaluate.pass_at_k) averaged over problems, where
    correct[i] of the n samples of problem i are right."""
    import evaluate

    return {j: sum(evaluate.pass_at_k(n, c, j) for c in correct) / len(correct) for j in range(1, n + 1)}


def equal_token_group_size(tokens_per_problem: float, tokens_per_response: float) -> int:
    """GRPO's G for the paper's equal-token control (App. E.3): the number of parallel responses whose tokens
    match a tree method's measured generated tokens per problem; at least 2 (a group needs a mean)."""
    if tokens_per_response <= 0:
        raise ValueError(f"tokens_per_response must be > 0, got {tokens_per_response}")
    return max(2, round(tokens_per_problem / tokens_per_response))


def step_records(run_dir: Path) -> list[dict]:
    """The training-step lines of a run's metrics.jsonl (eval lines left out)."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(x) for x in lines if x.strip()) if "eval" not in r]


PHASES = ("seconds_generation", "seconds_embedding", "seconds_update", "seconds_other")


def cell_config(study: Study, preset: str, seed: int, run_dir: Path, **overrides) -> C.Config:
    """One cell's train.py config: the preset's row at the study's scale, the study's seed and steps, the
    flags the user gave (fields where study.cfg differs from the scale's defaults, --steps among them), no eval
    during training."""
    default = C.make_config("paper", study.scale, **STUDY_SCALES[study.name][study.scale]["config"],
                            out_dir=str(study.out))
    given = {f.name: getattr(study.cfg, f.name) for f in dataclasses.fields(C.Config)
             if f.name not in ("out_dir", "seed") and getattr(study.cfg, f.name) != getattr(default, f.name)}
    return C.make_config(preset, study.scale, **{**given, "seed": seed, "out_dir": str(run_dir),
                                                 "eval_every": 0, **overrides})


def train_cell(cfg: C.Config) -> Path:
    """Train one cell unless its last checkpoint is there; a cell killed part-way resumes from its latest
    checkpoint (train.py --resume), one killed before any checkpoint starts again."""
    import models
    import train

    run_dir = Path(cfg.out_dir)
    latest = models.resolve_checkpoint(str(run_dir))
    if latest != str(run_dir) and Path(latest).name == f"step_{cfg.steps:06d}":
        return Path(latest)
    resume = latest != str(run_dir)
    train.train(dataclasses.replace(cfg, resume=str(run_dir) if resume else "", overwrite=not resume))
    return Path(models.resolve_checkpoint(str(run_dir)))


def evaluate_cell(study: Study, cfg: C.Config, checkpoint: Path, cache: Path) -> dict:
    """avg@k and pass@1…k of a trained cell on the study's held-out problems; cached in `cache` (a finished
    cell is never evaluated again)."""
    import torch

    import evaluate

    if cache.exists():
        return json.loads(cache.read_text())
    o = study.opts
    eval_cfg = dataclasses.replace(cfg, model=str(checkpoint))
    model, tokenizer, _ = load_policy(eval_cfg)
    torch.manual_seed(cfg.seed)
    result = evaluate.evaluate_problems(model, tokenizer, load_study_problems(o["bench"], o["limit"], []), eval_cfg,
                                        k=o["k"], max_new_tokens=cfg.eval_max_new_tokens,
                                        desc=f"{checkpoint.parent.parent.name}: eval")
    correct = correct_counts(result.pop("records"), result["n_problems"])
    out = {"avg@k": result["avg@k"], "pass_curve": pass_curve(correct, o["k"]), "correct": correct,
           "seconds": result["seconds"], "checkpoint": str(checkpoint)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(cache)
    return json.loads(cache.read_text())   # the same types as a later, cached read (pass_curve keys as strings)


def run_main_table(study: Study) -> None:
    """Sec. 5.2 main table, avg-tokens and wall-clock tables (App. E.3), pass@k figure, in miniature: every
    method × seed is trained (train.py) and its last checkpoint evaluated; means with 95 % t-intervals over
    seeds. With --equal_tokens, GRPO/Dr.GRPO's G is set from DATPO's measured tokens per problem and a
    one-step GRPO pilot's tokens per response (the paper's equal-token comparison). Resumable: rerun the
    same command after a kill; finished cells are not rerun."""
    t0 = time.perf_counter()
    o = study.opts
    methods, seeds = list(o["methods"]), list(o["seeds"])
    unknown = [m for m in methods if m not in C.PRESETS or m in ("demo", "tiny")]
    if unknown:
        raise faults.UserError(f"--methods: {unknown} are not presets; expected names of config.ROWS "
                               f"(paper, grpo, drgrpo, treerl, attnrl, datpo-...)")
    order = sorted(methods, key=lambda m: C.ROWS[m].get("method", "datpo") in ("grpo", "drgrpo"))
    cells, group_size = {}, None
    for preset in order:
        overrides = {}
        if o["equal_tokens"] and C.ROWS[preset].get("method") in ("grpo", "drgrpo"):
            if group_size is None:
                group_size = equal_tokens_g(study, cells)
            overrides = dict(group_size=group_size)
        for seed in seeds:
            name = f"{preset}_s{seed}"
            cfg = cell_config(study, preset, seed, study.out / "runs" / name, **overrides)
            print(f"[main-table] {name}: {train_command(preset, study.scale, cfg)}", flush=True)
            checkpoint = train_cell(cfg)
            score = evaluate_cell(study, cfg, checkpoint, study.out / "scores" / f"{name}.json")
            steps = step_records(Path(cfg.out_dir))
            cells[name] = {"preset": preset, "seed": seed, "run": cfg.out_dir, "group_size": cfg.group_size,
                           "avg@k": score["avg@k"], "pass_curve": {int(j): v for j, v in score["pass_curve"].items()},
                           "correct": score["correct"],
                           "tokens_per_problem": sum(r["generated_tokens_per_prompt"] for r in steps) / len(steps),
                           **{p: sum(r[p] for r in steps) / len(steps) for p in PHASES + ("seconds_step",)}}
    summary = {m: summarise_method([c for c in cells.values() if c["preset"] == m], o["k"]) for m in methods}
    figure = study.out / "pass_curves.png"
    plot_main_table(summary, o, figure)
    table = main_table_markdown(summary, o, group_size) + paired_by_problem(cells, methods, o["k"])
    write_outputs(study, {"cells": cells, "summary": summary, "equal_tokens_group_size": group_size,
                          "figures": [str(figure)]}, table, time.perf_counter() - t0)


def equal_tokens_g(study: Study, cells: dict) -> int:
    """G for the equal-token control: DATPO cells' mean tokens per problem ÷ a GRPO pilot's tokens per response
    (one step of --preset grpo at this scale, seed of the first cell, its run kept under runs/pilot_grpo)."""
    datpo = [c["tokens_per_problem"] for c in cells.values() if C.ROWS[c["preset"]].get("method", "datpo") == "datpo"]
    if not datpo:
        raise faults.UserError("--equal_tokens true needs a DATPO preset (e.g. paper) in --methods")
    pilot = cell_config(study, "grpo", study.opts["seeds"][0], study.out / "runs" / "pilot_grpo", steps=1,
                        save_every=1)
    train_cell(pilot)
    per_response = step_records(Path(pilot.out_dir))[0]["generated_tokens_per_prompt"] / pilot.group_size
    g = equal_token_group_size(sum(datpo) / len(datpo), per_response)
    print(f"[main-table] equal tokens: DATPO {sum(datpo) / len(datpo):.0f} tokens/problem, GRPO "
          f"{per_response:.1f} tokens/response → G = {g}", flush=True)
    return g


def summarise_method(cells: list[dict], k: int) -> dict:
    """Mean and 95 % half-width over seeds of avg@k, pass@1…k, tokens per problem and seconds per phase."""
    out = {"seeds": len(cells), "avg@k": t_interval([c["avg@k"] for c in cells]),
           "pass": {j: t_interval([c["pass_curve"][j] for c in cells]) for j in range(1, k + 1)}}
    for key in ("tokens_per_problem", *PHASES, "seconds_step"):
        out[key] = t_interval([c[key] for c in cells])
    return out


def main_table_markdown(summary: dict, o: dict, group_size: int | None) -> str:
    k = o["k"]
    ks = sorted({1, 2, 4, k} & set(range(1, k + 1)))
    rows = [[m, s["seeds"], pm(*s["avg@k"], scale=100), *[pm(*s["pass"][j], scale=100) for j in ks]] for m, s in summary.items()]
    table = (f"Held-out {o['bench']} ({o['limit'] or 'all'} problems × {k} samples), % with 95 % t-intervals over "
             f"seeds\n\n" + markdown_table(["method", "seeds", f"avg@{k}", *[f"pass@{j}" for j in ks]], rows))
    rows = [[m, pm(*s["tokens_per_problem"], digits=0), pm(*s["seconds_step"]), *[pm(*s[p]) for p in PHASES]]
            for m, s in summary.items()]
    table += ("\nGenerated tokens per problem per step (App. E.3) and seconds per step by phase\n\n"
              + markdown_table(["method", "tokens / problem", "s / step", "generation", "embedding", "update",
                                "other"], rows))
    if group_size is not None:
        table += f"\nEqual-token control: GRPO/Dr.GRPO ran with G = {group_size}.\n"
    return table


def paired_by_problem(cells: dict, methods: list[str], k: int) -> str:
    """The first method against each other one, paired by held-out problem: each problem's share of correct
    samples (avg@k) and whether any of a seed's k was correct (pass@k), averaged over the method's seeds,
    then the per-problem differences' mean with a 95 % t-interval over problems. This asks whether the method
    does better on these problems; it says nothing of seed-to-seed variation (the table above does), so it
    narrows when seeds are few."""
    def per_problem(preset):
        mine = [c["correct"] for c in cells.values() if c["preset"] == preset and c.get("correct")]
        if not mine:
            return None
        return ([sum(c[i] for c in mine) / (k * len(mine)) for i in range(len(mine[0]))],
                [sum(c[i] > 0 for c in mine) / len(mine) for i in range(len(mine[0]))])
    first = per_problem(methods[0])
    rows = []
    for other in methods[1:]:
        theirs = per_problem(other)
        if first is None or theirs is None:
            continue
        d_avg = t_interval([a - b for a, b in zip(first[0], theirs[0])])
        d_pass = t_interval([a - b for a, b in zip(first[1], theirs[1])])
        rows.append([f"{methods[0]} − {other}", len(first[0]), pm(*d_avg, scale=100), verdict(*d_avg, methods[0], other),
                     pm(*d_pass, scale=100), verdict(*d_pass, methods[0], other)])
    if not rows:
        return ""
    return ("\nPaired by problem (seeds averaged per problem), percentage points, 95 % t-intervals over problems\n\n"
            + markdown_table(["difference", "problems", f"Δavg@{k}", "shows", f"Δpass@{k}", "shows"], rows))


def plot_main_table(summary: dict, o: dict, path: Path) -> None:
    plt = plt_module()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ks = list(range(1, o["k"] + 1))
    for m, s in summary.items():
        means = [s["pass"][j][0] for j in ks]
        line, = ax.plot(ks, means, "o-", label=f"{m} ({s['seeds']} seeds)")
        halves = [s["pass"][j][1] for j in ks]
        if all(h is not None for h in halves):
            ax.fill_between(ks, [a - h for a, h in zip(means, halves)], [a + h for a, h in zip(means, halves)],
                            color=line.get_color(), alpha=0.15)
    ax.set_xlabel("k")
    ax.set_ylabel(f"pass@k on {o['bench']} (95 % interval over seeds)")
    _legend(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------
STUDIES = {
    "difficulty": (run_difficulty, "Sec. 3.1 / App. B: Easy/Medium/Hard subsets from 12 base samples, G sweep runs"),
    "difficulty-report": (run_difficulty_report, "App. B: evaluate the 9 G-sweep models; avg/pass vs G, pass@k curves"),
    "tree-vs-parallel": (run_tree_vs_parallel, "Sec. 3.2 / App. C.2: PassRate vs generated tokens, tree vs parallel"),
    "forks": (run_forks, "Sec. 3.3 / App. D.2-D.5: fork table (PassRate, SibDiv) and localization metrics"),
    "show-forks": (run_show_forks, "App. D.2 figures: one response, entropy shading, each strategy's forks"),
    "dynamics": (run_dynamics, "Sec. 5.2 / App. E.5: learning curves, leaves and PassRate per level, checkpoints"),
    "main-table": (run_main_table, "Sec. 5.2 / App. E.3: methods × seeds trained and evaluated, 95 % intervals"),
}

# Study flag → (type, nargs, help). Defaults come from STUDY_SCALES[study][scale].
STUDY_FLAGS = {
    "data": (str, None, "problems (a data.load_problems source)"),
    "limit": (int, None, "first N problems (0 = all)"),
    "levels": (int, "*", "keep only these levels (none = all)"),
    "n_samples": (int, None, "base samples per problem for the difficulty buckets (paper 12)"),
    "subset": (int, None, "problems kept per bucket (paper 1,400)"),
    "samples_per_step": (int, None, "G sweep: responses per step, G · prompts (paper 256)"),
    "epochs": (float, None, "G sweep: passes over the subset (paper 5)"),
    "train": (C.parse_bool, None, "G sweep: run the 9 trainings now (else write commands.sh)"),
    "g": (int, "+", "G sweep: group sizes to run, of 4 8 16 (presets grpo-g4/8/16)"),
    "bench": (str, "+", "benchmarks to evaluate on"),
    "k": (int, None, "samples per problem (report/dynamics) or forks per response (trees)"),
    "b": (int, None, "branches per fork"),
    "parallel_m": (int, "+", "parallel sample counts M (--parallel is the torchrun sharding mode)"),
    "tree_n": (int, "+", "tree base counts N"),
    "methods": (str, "+", "forking methods of the trees (tree-vs-parallel), presets to train (main-table)"),
    "repeats": (int, None, "independent repeats (paper 5 for forks)"),
    "strategies": (str, "+", "strategies to draw (show-forks) or to run (forks: labels of FORK_STRATEGIES)"),
    "candidates": (int, None, "samples per problem to pick the longest response from"),
    "checkpoints": (C.parse_bool, None, "evaluate saved checkpoints (pass@k across checkpoints)"),
    "runs": (str, "+", "train.py run folders"),
    "from_dir": (str, None, "folder of the difficulty study (its runs/)"),
    "seeds": (int, "+", "main-table: training seeds per method (intervals are over seeds)"),
    "equal_tokens": (C.parse_bool, None, "main-table: set GRPO/Dr.GRPO's G to DATPO's measured tokens per problem"),
    "from_result": (C.parse_bool, None, "rebuild the table, intervals and figures from OUT/result.json (no sampling)"),
}


def build_parser(study: str) -> argparse.ArgumentParser:
    parser = C.build_parser(f"analysis.py {study}: {STUDIES[study][1]}. Every config field is a flag.")
    parser.prog = f"analysis.py {study}"
    group = parser.add_argument_group(study)
    names = set(STUDY_SCALES[study]["demo"]) - {"config"} | ({"runs"} if study == "dynamics" else set()) \
        | ({"from_dir"} if study == "difficulty-report" else set()) | ({"strategies"} if study == "forks" else set()) \
        | ({"from_result"} if study in ("tree-vs-parallel", "forks") else set())
    for name in sorted(names):
        kind, nargs, text = STUDY_FLAGS[name]
        group.add_argument(f"--{name}", type=kind, nargs=nargs, default=None, help=text)
    return parser


def make_study(name: str, argv: list[str]) -> Study:
    parser = build_parser(name)
    args = parser.parse_args(argv)
    scale = args.scale or "paper"
    settings = STUDY_SCALES[name][scale]
    study_keys = set(STUDY_FLAGS)
    given = {k: v for k, v in vars(args).items() if k not in ("preset", "scale", *study_keys) and v is not None}
    out = Path(given.pop("out_dir", "") or Path("runs") / "analysis" / name)
    try:
        cfg = C.make_config(args.preset, scale, **{**settings["config"], **given}, out_dir=str(out))
    except ValueError as err:
        parser.error(str(err))
    opts = {k: v for k, v in settings.items() if k != "config"}
    opts.update({k: getattr(args, k) for k in study_keys if getattr(args, k, None) is not None})
    if not set(opts.get("g", [])) <= {4, 8, 16}:
        parser.error(f"--g: got {opts['g']}, expected group sizes of 4 8 16 (the presets grpo-g4/8/16)")
    if name == "difficulty-report":
        opts.setdefault("from_dir", str(out.parent / "difficulty"))
    if name == "dynamics":
        opts.setdefault("runs", [])
    faults.check_writable(out)          # a UserError naming --out_dir, not a traceback
    return Study(name, cfg, opts, out, scale)


def main(argv: list[str] | None = None) -> Study:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in STUDIES:
        usage = "\n".join(f"  {name:18s} {text}" for name, (_, text) in STUDIES.items())
        print(f"usage: python analysis.py STUDY [--scale paper|demo|tiny] [flags]\nstudies:\n{usage}",
              file=sys.stderr)
        if argv and argv[0] in ("-h", "--help"):
            raise SystemExit(0)
        # the last line says what was wrong, as every other bad command line does
        what = f"unknown study {argv[0]!r}" if argv else "a STUDY is required"
        print(f"analysis.py: error: {what}; expected one of {', '.join(STUDIES)}", file=sys.stderr)
        raise SystemExit(2)
    study = make_study(argv[0], argv[1:])
    STUDIES[argv[0]][0](study)
    return study


if __name__ == "__main__":
    faults.main_guard(main)   # user mistakes: one line, exit 2 (--debug: traceback)
