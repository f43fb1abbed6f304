"""studies/main_table.py — Sec. 5.2 main table in miniature, with App. F.3's generated-tokens and wall-clock
tables: every method × seed trained (train.py) and its last checkpoint evaluated; means with 95 % t-intervals
over seeds, and the methods paired by held-out problem.

    python -m studies main-table --scale demo
    python -m studies main-table --scale demo --methods paper grpo treerl --seeds 0 1 2 --equal_tokens true

Resumable: rerun the same command after a kill; finished cells (trained and scored) are not rerun.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

import config as C
import evaluate
import models
import train
from harness import measured, runs, tracking
from runtime import atomic, faults
from runtime.figures import literal
from studies.common import (
    Study,
    correct_counts,
    legend_if_any,
    load_policy,
    load_study_problems,
    markdown_table,
    pm,
    pyplot,
    run_identity,
    save_png,
    t_interval,
    train_command,
    verdict,
    write_outputs,
)

MAIN_TABLE_SCALES = {   # Sec. 5.2 main table (MATH500 k = 8), App. F.3 token and wall-clock tables
    "paper": dict(config={}, methods=["paper", "grpo", "drgrpo", "treerl", "attnrl"], seeds=[0, 1, 2],
                  bench="math500", k=8, limit=0, equal_tokens=False),
    "demo": dict(config={}, methods=["paper", "grpo"], seeds=[0, 1, 2], bench="arith-test", k=8,
                 limit=100, equal_tokens=True),
    "tiny": dict(config={}, methods=["paper", "grpo"], seeds=[0, 1], bench="arith-test", k=2, limit=2,
                 equal_tokens=False),
}
PHASES = ("seconds_generation", "seconds_embedding", "seconds_update", "seconds_other")


# --------------------------------------------------------------------------------------------------------
# Pure pieces: pass@k curves, the equal-token G
# --------------------------------------------------------------------------------------------------------
def pass_curve(correct: list[int], n: int) -> dict[int, float]:
    """pass@j for j = 1…n: the unbiased estimator (evaluate.pass_at_k) averaged over problems, where
    correct[i] of the n samples of problem i are right."""
    return {j: sum(evaluate.pass_at_k(n, c, j) for c in correct) / len(correct) for j in range(1, n + 1)}


def equal_token_group_size(tokens_per_problem: float, tokens_per_response: float) -> int:
    """GRPO's G for the paper's equal-token control (App. F.3): the number of parallel responses whose tokens
    match a tree method's measured generated tokens per problem; at least 2 (a group needs a mean)."""
    if tokens_per_response <= 0:
        raise ValueError(f"tokens_per_response must be > 0, got {tokens_per_response}")
    return max(2, round(tokens_per_problem / tokens_per_response))


def step_records(run_dir: Path) -> list[dict]:
    """The training-step lines of a run's metrics.jsonl (eval lines left out); a torn line (a kill
    mid-write) is left out and named in one line (tracking.read_metrics)."""
    path = Path(run_dir) / "metrics.jsonl"
    records, torn = tracking.read_metrics(path)
    if torn:
        faults.say(f"{path}: line(s) {', '.join(map(str, torn))} torn (not a JSON record); left out")
    return [r for r in records if "eval" not in r]


# --------------------------------------------------------------------------------------------------------
# Cells: one method and seed, trained then evaluated
# --------------------------------------------------------------------------------------------------------
def cell_config(study: Study, preset: str, seed: int, run_dir: Path, **overrides) -> C.Config:
    """One cell's train.py config: the preset's row at the study's scale, the study's seed and steps, the
    flags the user gave (fields where study.cfg differs from the scale's defaults, --steps among them), no
    eval during training."""
    default = C.make_config("paper", study.scale, **MAIN_TABLE_SCALES[study.scale]["config"],
                            out_dir=str(study.out))
    given = {f.name: getattr(study.cfg, f.name) for f in dataclasses.fields(C.Config)
             if f.name not in ("out_dir", "seed") and getattr(study.cfg, f.name) != getattr(default, f.name)}
    return C.make_config(preset, study.scale, **{**given, "seed": seed, "out_dir": str(run_dir),
                                                 "eval_every": 0, **overrides})


def train_cell(cfg: C.Config) -> Path:
    """Train one cell unless its checkpoint at --steps is there; a cell killed part-way resumes from its
    latest checkpoint (train.py --resume), one killed before any checkpoint starts again. A cell folder
    trained with another experiment (the study's flags changed since) or past --steps without a checkpoint at
    --steps is one UserError line: its checkpoint would be scored as this cell's."""
    run_dir = Path(cfg.out_dir)
    saved = run_dir / "config.json"
    if saved.is_file():
        try:
            trained = json.loads(saved.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            trained = None   # torn: train.py's resume names it
        changes = {k: v for k, v in runs.config_changes(trained or {}, json.loads(cfg.to_json())).items()
                   if k not in runs.RESUME_MAY_CHANGE}
        if changes and models.resolve_checkpoint(str(run_dir)) != str(run_dir):
            listed = ", ".join(f"{k} {old!r} -> {now!r}" for k, (old, now) in list(changes.items())[:4])
            raise faults.UserError(f"main-table: the cell {run_dir} was trained with other settings "
                                   f"({listed}); expected the flags the study ran with, another --out_dir, "
                                   f"or that cell's folder deleted to train it again")
    final = run_dir / "checkpoints" / f"step_{cfg.steps:06d}"
    if (final / "trainer_state.pt").exists():
        return final
    latest = models.resolve_checkpoint(str(run_dir))
    if latest != str(run_dir) and runs.step_of(Path(latest)) > cfg.steps:
        raise faults.UserError(f"main-table: the cell {run_dir} trained to {Path(latest).name}, past "
                               f"--steps {cfg.steps}, and keeps no checkpoint at step {cfg.steps}; expected "
                               f"the --steps it ran with, or another --out_dir")
    resume = latest != str(run_dir)
    train.train(dataclasses.replace(cfg, resume=str(run_dir) if resume else "", overwrite=not resume))
    return Path(models.resolve_checkpoint(str(run_dir)))


def evaluate_cell(study: Study, cfg: C.Config, checkpoint: Path, cache: Path) -> dict:
    """avg@k and pass@1…k of a trained cell on the study's held-out problems; cached in `cache` with what it
    measured (the checkpoint's step and weights, the problems, k, the sampling settings: harness/measured.py)
    and reused only for exactly that — a cell trained on since is evaluated again, never reported with its
    earlier checkpoint's scores."""
    o = study.opts
    eval_cfg = dataclasses.replace(cfg, model=str(checkpoint))
    problems = load_study_problems(o["bench"], o["limit"], [], "--bench")
    wanted = measured.of_evaluation(eval_cfg, str(checkpoint), problems, o["k"], cfg.eval_max_new_tokens,
                                    bench=o["bench"], **run_identity(str(checkpoint)))
    cached = measured.read_cache(cache, wanted, faults.say)
    if cached is not None:
        return cached
    model, tokenizer, _ = load_policy(eval_cfg)
    torch.manual_seed(cfg.seed)
    result = evaluate.evaluate_problems(model, tokenizer, problems, eval_cfg, k=o["k"],
                                        max_new_tokens=cfg.eval_max_new_tokens,
                                        desc=f"{checkpoint.parent.parent.name}: eval")
    correct = correct_counts(result.pop("records"), result["n_problems"])
    out = {"avg@k": result["avg@k"], "pass_curve": pass_curve(correct, o["k"]), "correct": correct,
           "seconds": result["seconds"], "checkpoint": str(checkpoint), "measured": wanted}
    cache.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_json(cache, out, indent=2)
    return json.loads(cache.read_text())   # the types of a later, cached read (pass_curve keys as strings)


def run_cell(study: Study, preset: str, seed: int, overrides: dict) -> tuple[str, dict]:
    """Train and score one cell (or read what a previous run finished); (name, its numbers for the tables)."""
    name = f"{preset}_s{seed}"
    cfg = cell_config(study, preset, seed, study.out / "runs" / name, **overrides)
    print(f"[main-table] {name}: {train_command(preset, study.scale, cfg)}", flush=True)
    checkpoint = train_cell(cfg)
    score = evaluate_cell(study, cfg, checkpoint, study.out / "scores" / f"{name}.json")
    steps = step_records(Path(cfg.out_dir))
    return name, {"preset": preset, "seed": seed, "run": cfg.out_dir, "group_size": cfg.group_size,
                  "avg@k": score["avg@k"], "pass_curve": {int(j): v for j, v in score["pass_curve"].items()},
                  "correct": score["correct"], "measured": score["measured"],
                  "tokens_per_problem": sum(r["generated_tokens_per_prompt"] for r in steps) / len(steps),
                  **{p: sum(r[p] for r in steps) / len(steps) for p in PHASES + ("seconds_step",)}}


def run_main_table(study: Study) -> None:
    """Sec. 5.2 main table, avg-tokens and wall-clock tables (App. F.3), pass@k figure, in miniature: every
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
    for preset in order:   # tree methods first: the equal-token G needs their measured tokens
        overrides = {}
        if o["equal_tokens"] and C.ROWS[preset].get("method") in ("grpo", "drgrpo"):
            if group_size is None:
                group_size = equal_tokens_g(study, cells)
            overrides = dict(group_size=group_size)
        for seed in seeds:
            name, cell = run_cell(study, preset, seed, overrides)
            cells[name] = cell
    summary = {m: summarise_method([c for c in cells.values() if c["preset"] == m], o["k"]) for m in methods}
    figure = study.out / "pass_curves.png"
    plot_main_table(summary, o, figure)
    table = main_table_markdown(summary, o, group_size) + paired_by_problem(cells, methods, o["k"])
    write_outputs(study, {"cells": cells, "summary": summary, "equal_tokens_group_size": group_size,
                          "figures": [str(figure)]}, table, time.perf_counter() - t0)


def equal_tokens_g(study: Study, cells: dict) -> int:
    """G for the equal-token control: DATPO cells' mean tokens per problem ÷ a GRPO pilot's tokens per
    response (one step of --preset grpo at this scale, seed of the first cell, its run kept under
    runs/pilot_grpo)."""
    datpo = [c["tokens_per_problem"] for c in cells.values()
             if C.ROWS[c["preset"]].get("method", "datpo") == "datpo"]
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


# --------------------------------------------------------------------------------------------------------
# Tables and figure
# --------------------------------------------------------------------------------------------------------
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
    rows = [[m, s["seeds"], pm(*s["avg@k"], scale=100), *[pm(*s["pass"][j], scale=100) for j in ks]]
            for m, s in summary.items()]
    table = (f"Held-out {o['bench']} ({o['limit'] or 'all'} problems × {k} samples), % with 95 % t-intervals "
             f"over seeds\n\n"
             + markdown_table(["method", "seeds", f"avg@{k}", *[f"pass@{j}" for j in ks]], rows))
    rows = [[m, pm(*s["tokens_per_problem"], digits=0), pm(*s["seconds_step"]), *[pm(*s[p]) for p in PHASES]]
            for m, s in summary.items()]
    table += ("\nGenerated tokens per problem per step (App. F.3) and seconds per step by phase\n\n"
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
        rows.append([f"{methods[0]} − {other}", len(first[0]), pm(*d_avg, scale=100),
                     verdict(*d_avg, methods[0], other), pm(*d_pass, scale=100),
                     verdict(*d_pass, methods[0], other)])
    if not rows:
        return ""
    return ("\nPaired by problem (seeds averaged per problem), percentage points, 95 % t-intervals over "
            "problems\n\n"
            + markdown_table(["difference", "problems", f"Δavg@{k}", "shows", f"Δpass@{k}", "shows"], rows))


def plot_main_table(summary: dict, o: dict, path: Path) -> None:
    """pass@k against k per method, shaded by its 95 % interval over seeds."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ks = list(range(1, o["k"] + 1))
    for m, s in summary.items():
        means = [s["pass"][j][0] for j in ks]
        line, = ax.plot(ks, means, "o-", label=f"{m} ({s['seeds']} seeds)")
        halves = [s["pass"][j][1] for j in ks]
        if all(h is not None for h in halves):
            ax.fill_between(ks, [a - h for a, h in zip(means, halves)],
                            [a + h for a, h in zip(means, halves)], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("k")
    ax.set_ylabel(f"pass@k on {literal(o['bench'])} (95 % interval over seeds)")
    legend_if_any(ax)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
