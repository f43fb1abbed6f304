"""studies/tree_vs_parallel.py — Sec. 3.2 / App. C.2: at the same number of generated tokens, do tree rollouts
reach a higher PassRate than parallel sampling, and which forking method does best?

    python -m studies tree-vs-parallel --scale demo
    python -m studies tree-vs-parallel --scale demo --from_result true   # the table and figure again

Per problem, max(M) parallel samples are drawn once; parallel M uses the first M of them, and the tree
(N, K, B) grows K forks × B branches (growth.grow_from_forks) on each of the first N, for each forking
method. The figure is App. C.2's PassRate against generated tokens per problem; the table pairs each tree
point with the parallel M nearest in tokens.
"""
from __future__ import annotations

import random
import time

import numpy as np
import torch
from tqdm import tqdm

import models
import rollout as R
from runtime import faults
from runtime.figures import literal
from studies import growth
from studies.common import (
    DEMO_CONFIG,
    PAPER_MODEL,
    STRATEGY_COLORS,
    TINY_CONFIG,
    Sampling,
    Study,
    base_rewards,
    markdown_table,
    pass_rate,
    pm,
    pyplot,
    read_result,
    sampling_setup,
    save_png,
    t_interval,
    verdict,
    write_outputs,
)

TREE_VS_PARALLEL_SCALES = {   # App. C.2: AIME25, parallel M ∈ {4,8,16,32}, trees (N, 2, 2), N ∈ {2,4,8}
    "paper": dict(config=dict(model=PAPER_MODEL), data="aime25", limit=0, levels=[],
                  parallel_m=[4, 8, 16, 32], tree_n=[2, 4, 8], k=2, b=2, methods=["fixed-seg", "random"],
                  repeats=1),
    "demo": dict(config=DEMO_CONFIG, data="arith-test", limit=4, levels=[2, 3], parallel_m=[4, 8, 16],
                 tree_n=[2, 4], k=2, b=2, methods=["fixed-seg", "random"], repeats=1),
    "tiny": dict(config=TINY_CONFIG, data="arith-test", limit=2, levels=[], parallel_m=[2, 4], tree_n=[1, 2],
                 k=2, b=2, methods=["fixed-seg", "random"], repeats=1),
}


def run_tree_vs_parallel(study: Study) -> None:
    """PassRate against generated tokens per problem. Per problem, max(M) parallel samples are drawn once;
    parallel M uses the first M of them, and the tree (N, K, B) grows K forks × B branches on each of the
    first N (the base responses of a tree are parallel samples too), for each forking method. Nested subsets
    of i.i.d. samples give the same expectations as separate draws and pair the comparison."""
    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    if o.get("from_result"):   # the table, intervals and figure again from a finished run's records
        records = read_result(study)["records"]   # one line when missing, torn or of other settings
        summary, table = summarise_tree_vs_parallel(records, o, len({r["problem"] for r in records}))
        return tree_vs_parallel_figure(study, summary, table, time.perf_counter() - t0, records)
    m_max, n_max = max(o["parallel_m"]), max(o["tree_n"])
    if n_max > m_max:
        raise faults.UserError(f"--tree_n {n_max} > max --parallel_m {m_max}: trees take their bases from "
                               "the parallel samples; expected each --tree_n at most the largest M")
    setup = sampling_setup(study)
    rng = random.Random(cfg.seed)
    per_call = max(1, cfg.gen_batch_size // m_max)
    n_problems = len(setup.problems)
    records = []   # one per (repeat, problem)
    bar = tqdm(total=o["repeats"] * n_problems, desc="tree-vs-parallel", unit="problem", dynamic_ncols=True)
    for repeat in range(o["repeats"]):
        for first in range(0, n_problems, per_call):
            group = list(range(first, min(first + per_call, n_problems)))
            records += group_records(study, setup, group, repeat, rng)
            bar.update(len(group))
    bar.close()

    summary, table = summarise_tree_vs_parallel(records, o, n_problems)
    tree_vs_parallel_figure(study, summary, table, time.perf_counter() - t0, records)


def group_records(study: Study, setup: Sampling, group: list[int], repeat: int,
                  rng: random.Random) -> list[dict]:
    """One batch of problems: max(M) parallel samples each, and on the first N of them every forking method's
    subtrees; per problem, the tokens, PassRate and leaves of each parallel M and each tree N."""
    cfg, o = study.cfg, study.opts
    tokenizer, model = setup.tokenizer, setup.model
    m_max, n_max = max(o["parallel_m"]), max(o["tree_n"])
    with torch.no_grad(), models.autocast(setup.device, cfg.precision):
        base = R.sample_base(setup.sampler, [setup.prompt_ids[i] for i in group], m_max, cfg.max_new_tokens,
                             keep_cache=True)
    answers = [setup.problems[group[r // m_max]]["answer"] for r in range(len(base.tokens))]
    rewards = base_rewards(tokenizer, base, answers, cfg)
    subtrees = {}
    tree_rows = [g * m_max + j for g in range(len(group)) for j in range(n_max)]   # the first N per problem
    for method in o["methods"]:
        forks = {r: R.choose_forks(method, o["k"], tokenizer, model, base.prompt_ids[r], base.tokens[r],
                                   base.entropies[r], rng, cfg) for r in tree_rows}
        with models.autocast(setup.device, cfg.precision):
            subtrees[method] = growth.grow_from_forks(setup.sampler, tokenizer, base, forks, o["b"], answers,
                                                      cfg.max_new_tokens, cfg.branch_chunk_size,
                                                      cfg.answer_fallback, rewards, cfg.branch_length)
    records = []
    for g, index in enumerate(group):
        rows = range(g * m_max, (g + 1) * m_max)
        rec = {"repeat": repeat, "problem": index, "level": setup.problems[index].get("level")}
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
    return records


def summarise_tree_vs_parallel(records: list[dict], o: dict, n_problems: int) -> tuple[dict, str]:
    """Per curve point: means over (repeat, problem) units with 95 % t-intervals on PassRate; then each tree
    point against the parallel M nearest in mean tokens, paired by unit (the tree's bases are those parallel
    samples): ΔPassRate with its interval, and what it says about Sec. 3.2's claim."""
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
            diff, half = t_interval([r[point["key"]]["pass_rate"] - r[near["key"]]["pass_rate"]
                                     for r in records])
            pairs.append([f"{name} N = {point['size']}", f"M = {near['size']}",
                          point["tokens"] / near["tokens"], pm(diff, half, scale=100),
                          verdict(diff, half, "tree", "parallel")])
    table += ("\nPaired (same problems and samples): tree − parallel at the nearest token count\n\n"
              + markdown_table(["tree", "parallel", "token ratio", "ΔPassRate (pp) ± 95 % CI", "shows"],
                               pairs))
    table += (f"\n{n_problems} problems ({o['data']}, levels {o['levels'] or 'all'}) × {o['repeats']} "
              "repeat(s).\n")
    summary["paired"] = pairs
    return summary, table


def tree_vs_parallel_figure(study, summary: dict, table: str, seconds: float, records: list) -> None:
    """App. C.2's figure (PassRate against generated tokens, one curve per method), then the study's
    outputs."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in ((k, v) for k, v in summary.items() if k != "paired"):
        color = STRATEGY_COLORS.get(name.replace("tree ", ""), None)
        ax.errorbar([p["tokens"] for p in points], [100 * p["pass_rate"] for p in points],
                    yerr=[100 * (p["pass_rate_ci"] or 0) for p in points],
                    fmt="o-" if name == "parallel" else "s--", color=color, label=name, capsize=3)
        for p in points:
            ax.annotate(str(p["size"]), (p["tokens"], 100 * p["pass_rate"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("generated tokens per problem")
    ax.set_ylabel("PassRate (%)")
    ax.set_title(f"tree vs parallel ({literal(study.opts['data'])}; labels: M or N; bars: 95 % CI)")
    ax.legend()
    fig.tight_layout()
    figure = study.out / "tree_vs_parallel.png"
    save_png(fig, figure, dpi=110)
    write_outputs(study, {"summary": summary, "records": records, "figures": [str(figure)]}, table, seconds)
