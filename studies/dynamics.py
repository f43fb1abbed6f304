"""studies/dynamics.py — Sec. 5.2 / App. F.5: how training went, read from train.py run folders: the runs step
by step side by side (reward, V(root), K̂ and B̂, leaves, clip fraction, the diversity bonus, fork positions:
steps.png and a per-step table), the learning curve (Sec. 5.2 "learning curve": held-out avg@k, else the
training reward), leaves and PassRate per difficulty level ("leaf count"), and pass@k of each saved checkpoint
(App. F.5 "pass@64 across checkpoints").

    python -m studies dynamics --runs runs/paper runs/treerl runs/attnrl
    python -m studies dynamics --runs runs/teach runs/teach-fixed --checkpoints false   # no model loaded

Checkpoint scores are cached in OUT/scores/<run>_<its config's fingerprint>/, so a rerun evaluates only new
checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import evaluate
from harness import measured, tracking
from runtime import atomic, faults
from runtime.figures import literal
from studies.common import (
    DEMO_CONFIG,
    TINY_CONFIG,
    Study,
    legend_if_any,
    load_policy,
    load_study_problems,
    markdown_table,
    pyplot,
    run_identity,
    save_png,
    write_outputs,
)

DYNAMICS_SCALES = {   # Sec. 5.2 / App. F.5: MATH500 curves, leaf count per MATH level, pass@64 on AIME26
    "paper": dict(config=dict(max_new_tokens=2048), bench="aime26", k=64, limit=0, checkpoints=True),
    "demo": dict(config=DEMO_CONFIG, bench="arith-test", k=4, limit=6, checkpoints=True),
    "tiny": dict(config=TINY_CONFIG, bench="arith-test", k=2, limit=2, checkpoints=True),
}


def level_summary(step_records: list[dict]) -> dict[str, dict]:
    """Per level, over a run's logged steps: leaves per prompt and PassRate weighted by the prompts logged
    (each step record holds tracking.level_stats)."""
    totals: dict[str, list[float]] = {}
    for rec in step_records:
        for level, s in rec.get("levels", {}).items():
            t = totals.setdefault(level, [0.0, 0.0, 0.0])
            t[0] += s["prompts"]
            t[1] += s["leaves"] * s["prompts"]
            t[2] += s["pass_rate"] * s["prompts"]
    return {lv: {"prompts": int(t[0]), "leaves": t[1] / t[0], "pass_rate": t[2] / t[0]}
            for lv, t in sorted(totals.items(), key=lambda kv: level_key(kv[0]))}


def level_key(level: str) -> tuple:
    """A logged level (a JSON key: "3", "hard") in order: numbers first, by value, then names."""
    return (not level.isdigit(), int(level) if level.isdigit() else 0, level)


def read_run(study: Study, folder: Path, name: str | None = None) -> tuple[str, dict]:
    """(label, what the figures need) of one train.py run folder: its eval curve, its per-level train-time
    summary and, with --checkpoints true, each saved checkpoint's scores. `name`: the folder's name in the
    tables (evaluate.folder_labels tells runs/a/demo and runs/b/demo apart)."""
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise faults.UserError(f"--runs {folder}: {metrics} not found; expected a train.py run folder")
    records, torn = tracking.read_metrics(metrics)
    if torn:
        faults.say(f"dynamics: {metrics}: line(s) {', '.join(map(str, torn))} torn (not a JSON record); "
                   f"left out")
    run_cfg = read_config(folder / "config.json")
    label = f"{name or folder.name} ({run_cfg.get('method', '?')})"
    evals = [r for r in records if "eval" in r]
    key = next((k for r in evals for k in r if k.startswith("avg@")), None)
    steps = [r for r in records if "eval" not in r]
    run = {"folder": str(folder), "config": run_cfg,
           "curve": [(r["step"], r[key]) for r in evals] if key else [], "curve_metric": key,
           "levels": level_summary(steps), "steps": step_rows(steps, tree_summary(folder)),
           "checkpoints": {}}
    if study.opts["checkpoints"]:
        for ckpt in sorted((folder / "checkpoints").glob("step_*")):
            run["checkpoints"][int(ckpt.name.split("_")[1])] = score_checkpoint(study, folder, ckpt, run_cfg)
    return label, run


# The per-step quantities compared across runs (steps.png, the table): metrics.jsonl's, then the tree logs'.
STEP_KEYS = {"reward": "reward (all leaves)", "v_root": "V(root) (base responses)", "k_hat": "K̂ (mean)",
             "b_hat": "B̂ (mean)", "leaves_per_prompt": "leaves / prompt", "clip_frac": "clip fraction",
             "bonus": "Â − Â_base where Â_base > 0", "fork_position": "fork position f (tokens)"}


def tree_summary(folder: Path) -> dict[int, dict]:
    """{step: {"bonus", "fork_position"}} from RUN/trees (--log_trees_every): the mean diversity bonus Eq. 4
    added (Â − Â_base over the trained blocks with Â_base > 0; 0 without one) and the mean fork position."""
    out = {}
    for step in tracking.tree_logs(folder)[0]:
        try:
            trees = tracking.read_trees(folder, step)
        except (FileNotFoundError, ValueError):   # an empty or torn log: that step has no tree numbers
            continue
        blocks = [b for t in trees for b in t["blocks"] if b.get("advantage") is not None
                  and (b.get("base_advantage") or 0) > 0]
        forks = [f for t in trees for response in t.get("forks") or [] for f in response]
        out[step] = {"bonus": sum(b["advantage"] - b["base_advantage"] for b in blocks) / len(blocks)
                     if blocks else 0.0, "fork_position": sum(forks) / len(forks) if forks else None}
    return out


def step_rows(records: list[dict], trees: dict[int, dict]) -> list[dict]:
    """One row per logged step: STEP_KEYS from its metrics record and its tree log (None where absent)."""
    return [{"step": r["step"], **{k: r.get(k, trees.get(r["step"], {}).get(k)) for k in STEP_KEYS}}
            for r in records]


def read_config(path: Path) -> dict:
    """A run's config.json ({} when there is none); a torn one is one line naming it."""
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise faults.UserError(f"dynamics: {path}: not JSON ({err}); expected the config.json train.py "
                               f"writes (torn by a kill or an edit? leave the run out of --runs)") from None
    if not isinstance(config, dict):
        raise faults.UserError(f"dynamics: {path}: a JSON {type(config).__name__}, expected an object")
    return config


def score_checkpoint(study: Study, folder: Path, ckpt: Path, run_cfg: dict) -> dict:
    """avg@k and pass@k of one checkpoint on --bench, from OUT/scores/<run>/ or evaluated now and cached.
    The cache records what it measured (the checkpoint's step and weights, the run's identity — its
    config's and its checkpoint's fingerprints, common.run_identity —, the problems, k, the sampling
    settings: harness/measured.py) and is named by it, in a folder named by the run's config fingerprint,
    so two runs of one folder name (runs/a/demo, runs/b/demo) or a checkpoint trained anew never take each
    other's scores."""
    cfg, o = study.cfg, study.opts
    eval_cfg = dataclasses.replace(cfg, model=str(ckpt), **{
        k: run_cfg[k] for k in ("prompt_style", "few_shot", "answer_fallback") if k in run_cfg})
    problems = load_study_problems(o["bench"], o["limit"], [], "--bench")
    run = run_identity(str(ckpt))
    wanted = measured.of_evaluation(eval_cfg, str(ckpt), problems, o["k"], cfg.max_new_tokens,
                                    bench=o["bench"], **run)
    key = measured.problems_hash([wanted])[7:19]
    # a folder per run experiment (its config's fingerprint), never per folder name
    runs_dir = f"{folder.name}_{(run['run_config'] or 'sha256:none')[7:19]}"
    cache = study.out / "scores" / runs_dir / f"{ckpt.name}_{Path(o['bench']).name}_k{o['k']}_{key}.json"
    cached = measured.read_cache(cache, wanted, faults.say)
    if cached is not None:
        return cached
    model, tokenizer, _ = load_policy(eval_cfg)
    result = evaluate.evaluate_problems(model, tokenizer, problems, eval_cfg, k=o["k"],
                                        max_new_tokens=cfg.max_new_tokens, desc=f"{folder.name}/{ckpt.name}")
    result.pop("records")
    result["measured"] = wanted
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(cache, result, indent=2)
    del model
    return json.loads(cache.read_text())


def dynamics_figures(study: Study, runs: dict) -> list[Path]:
    """Learning curves, leaves and PassRate per level (bars per run), pass@k per checkpoint."""
    o = study.opts
    plt = pyplot()
    figures = [study.out / "learning_curve.png", study.out / "leaf_count.png",
               study.out / "passk_checkpoints.png", study.out / "steps.png"]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, run in runs.items():   # held-out accuracy where evaluated, else the training reward
        if run["curve"]:
            ax.plot(*zip(*run["curve"]), "o-", label=f"{literal(label)} held-out {run['curve_metric']}")
        elif run["steps"]:
            ax.plot([r["step"] for r in run["steps"]], [r["reward"] for r in run["steps"]], ".--",
                    label=f"{literal(label)} training reward (no held-out evaluation)")
    ax.set_xlabel("step")
    ax.set_ylabel("accuracy")
    legend_if_any(ax)
    fig.tight_layout()
    save_png(fig, figures[0], dpi=110)
    steps_figure(plt, runs, figures[3])
    levels = sorted({lv for run in runs.values() for lv in run["levels"]}, key=level_key)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(runs), 1)
    for j, (label, run) in enumerate(runs.items()):
        xs = [i + j * width for i in range(len(levels))]
        left.bar(xs, [run["levels"].get(lv, {}).get("leaves", 0) for lv in levels], width,
                 label=literal(label))
        right.bar(xs, [run["levels"].get(lv, {}).get("pass_rate", 0) for lv in levels], width,
                  label=literal(label))
    for ax, name in ((left, "leaves per prompt (train-time)"), (right, "PassRate (train-time)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(levels))], [f"level {lv}" for lv in levels])
        ax.set_ylabel(name)
        legend_if_any(ax)
    fig.tight_layout()
    save_png(fig, figures[1], dpi=110)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for label, run in runs.items():
        if run["checkpoints"]:
            steps = sorted(run["checkpoints"])
            ax.plot(steps, [run["checkpoints"][s]["pass@k"] for s in steps], "o-", label=literal(label))
    ax.set_xlabel("checkpoint step")
    ax.set_ylabel(f"pass@{o['k']} on {literal(o['bench'])}")
    legend_if_any(ax)
    fig.tight_layout()
    save_png(fig, figures[2], dpi=110)
    return figures


def steps_figure(plt, runs: dict, path: Path) -> None:
    """steps.png: one panel per STEP_KEYS quantity, one line per run (K̂ and B̂ share a panel)."""
    panels = [["reward"], ["v_root"], ["k_hat", "b_hat"], ["leaves_per_prompt"], ["clip_frac"], ["bonus"],
              ["fork_position"]]
    fig, axes = plt.subplots(2, 4, figsize=(15, 6.5))
    for ax, keys in zip(axes.flat, panels):
        for n, (label, run) in enumerate(runs.items()):
            for key, style in zip(keys, ("o-", "s--")):
                points = [(r["step"], r[key]) for r in run["steps"] if r[key] is not None]
                if points:
                    ax.plot(*zip(*points), style, color=f"C{n}", ms=3,
                            label=literal(label) + (f" {STEP_KEYS[key]}" if len(keys) > 1 else ""))
        ax.set_title(", ".join(STEP_KEYS[k] for k in keys), fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.tick_params(labelsize=7)
        legend_if_any(ax)
    axes.flat[-1].axis("off")
    fig.tight_layout()
    save_png(fig, path, dpi=100)


def steps_table(runs: dict) -> str:
    """The runs step by step, one row per run and step (STEP_KEYS)."""
    keys = list(STEP_KEYS)
    rows = [[label, r["step"], *(r[k] for k in keys)] for label, run in runs.items() for r in run["steps"]]
    return "Per step (metrics.jsonl; Â bonus and fork position from the tree logs)\n\n" + markdown_table(
        ["run", "step", "reward", "V(root)", "K̂", "B̂", "leaves", "clip", "Â bonus", "fork f"], rows)


def run_dynamics(study: Study) -> None:
    t0 = time.perf_counter()
    o = study.opts
    if not o["runs"]:
        raise faults.UserError("dynamics: no run folder given; expected one or more with --runs")
    runs = dict(read_run(study, Path(folder), name)
                for folder, name in zip(o["runs"], evaluate.folder_labels(o["runs"])))
    figures = dynamics_figures(study, runs)
    rows = [[label, f"level {lv}", s["prompts"], s["leaves"], 100 * s["pass_rate"]]
            for label, run in runs.items() for lv, s in run["levels"].items()]
    table = steps_table(runs) + "\nTrain-time leaves and PassRate per level (Fig. \"leaf count\")\n\n"
    table += markdown_table(["run", "level", "prompts", "leaves / prompt", "PassRate (%)"], rows)
    rows = [[label, step, r["avg@k"], r["pass@k"]] for label, run in runs.items()
            for step, r in sorted(run["checkpoints"].items())]
    if o["checkpoints"]:
        table += f"\nCheckpoints on {o['bench']} (k = {o['k']})\n\n" + markdown_table(
            ["run", "step", f"avg@{o['k']}", f"pass@{o['k']}"], rows)
    write_outputs(study, {"runs": runs, "figures": [str(f) for f in figures]}, table,
                  time.perf_counter() - t0)
