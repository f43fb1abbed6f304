"""studies/forks.py — Sec. 3.3 / App. D.2–D.5: where should a tree fork? Each forking strategy on the same
base rollouts: PassRate and SibDiv of the trees it grows, and how its fork points cluster.

    python -m studies forks      --scale demo   # App. D.5 fork table, App. D.2 localization table
    python -m studies forks      --scale demo --from_result true   # the tables and figures again
    python -m studies show-forks --scale demo   # App. D.2 figures "localization" / "case study"

forks: per problem and repeat ONE base rollout; every strategy of FORK_STRATEGIES picks K forks on it and
grows B branches per fork (growth.grow_from_forks); PassRate and SibDiv (sib_div) per tree, and the
localization metrics of the fork positions, paired against sent-entropy on the same rollouts.
show-forks: one response shaded by token entropy with each strategy's forks outlined (forks.png, forks.html).

The localization metrics (App. D.2) are pure: positions are fork prefix lengths (the branch keeps
response[:f]) in a response of `length` tokens.
"""
from __future__ import annotations

import dataclasses
import html
import itertools
import random
import time
from pathlib import Path

import numpy as np
import torch
from matplotlib.colors import to_hex
from tqdm import tqdm

import config as C
import models
import rollout as R
from runtime import atomic
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
    mean_of,
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

FORKS_SCALES = {   # App. D.5: AIME26, one base rollout, K = 4 forks, B = 4 branches (17 leaves), 5 repeats
    "paper": dict(config=dict(model=PAPER_MODEL), data="aime26", limit=0, levels=[], k=4, b=4, repeats=5),
    "demo": dict(config=DEMO_CONFIG, data="arith-test", limit=2, levels=[2, 3], k=4, b=4, repeats=1),
    "tiny": dict(config=TINY_CONFIG, data="arith-test", limit=2, levels=[], k=2, b=2, repeats=2),
}
SHOW_FORKS_SCALES = {   # App. D.2 figures: one response, K = 4 forks per strategy
    "paper": dict(config=dict(model=PAPER_MODEL), data="aime25", limit=1, levels=[], k=4, candidates=4,
                  strategies=["tok-entropy", "sent-entropy", "atb"]),
    "demo": dict(config=dict(DEMO_CONFIG, max_new_tokens=96), data="arith-test", limit=4, levels=[2, 3], k=4,
                 candidates=4, strategies=["tok-entropy", "sent-entropy", "atb"]),
    "tiny": dict(config=TINY_CONFIG, data="arith-test", limit=1, levels=[], k=2, candidates=2,
                 strategies=["tok-entropy", "fixed-seg"]),
}

# Forking strategies of the paper's fork table (App. D.5 table "distance-forced tok-entropy"): (label, method,
# minimum distance as a fraction of the response length).
FORK_STRATEGIES = [("random", "random", 0.0), ("fixed-seg", "fixed-seg", 0.0), ("atb", "atb", 0.0),
                   ("tok-entropy", "tok-entropy", 0.0), ("tok-entropy w/ 5% dist.", "tok-entropy", 0.05),
                   ("tok-entropy w/ 10% dist.", "tok-entropy", 0.10), ("sent-entropy", "sent-entropy", 0.0)]
LOCALIZATION_STRATEGIES = ("random", "sent-entropy", "tok-entropy")        # App. D.2 table


# --------------------------------------------------------------------------------------------------------
# Localization metrics (App. D.2): pure functions
# --------------------------------------------------------------------------------------------------------

def sib_div(parents: list[int | None], embeddings) -> float | None:
    """Tree-level SibDiv (App. D.3): 1 − mean over forking points of the mean pairwise cosine similarity of
    the blocks branching from that point. Only forking points count: states with ≥ 2 children other than
    the prompt itself (the N base responses are parallel samples, not a fork). None when there is none."""
    emb = np.asarray(embeddings, dtype=float)
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    groups: dict = {}
    for i, p in enumerate(parents):
        groups.setdefault(p, []).append(i)
    sims = []
    for parent, members in groups.items():
        if parent is None or len(members) < 2:
            continue
        g = emb[members] @ emb[members].T
        upper = g[np.triu_indices(len(members), k=1)]
        sims.append(float(upper.mean()))
    return 1.0 - float(np.mean(sims)) if sims else None

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


def localization(positions, length: int) -> dict:
    """NND, MPD, WCR@5, WCR@10 of one response's forks (App. D.2 table)."""
    return {"NND": nearest_neighbor_distance(positions, length),
            "MPD": mean_pairwise_distance(positions, length),
            "WCR@5": window_clustering_ratio(positions, length, 5),
            "WCR@10": window_clustering_ratio(positions, length, 10)}


# --------------------------------------------------------------------------------------------------------
# forks: the fork table and the localization table
# --------------------------------------------------------------------------------------------------------
def fork_cfg(cfg: C.Config, min_dist: float) -> C.Config:
    return dataclasses.replace(cfg, fork_min_dist=min_dist)


def run_forks(study: Study) -> None:
    """Per problem and repeat ONE base rollout; every strategy picks K forks on it and grows B branches per
    fork (1 + K·B leaves); PassRate and SibDiv (App. D.3) per tree, averaged over problems and repeats;
    localization metrics of the same fork positions. A repeat draws a new base rollout (the paper repeats the
    whole procedure five times)."""
    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    records = read_result(study)["records"] if o.get("from_result") else None   # its options too
    strategies = FORK_STRATEGIES
    if o.get("strategies"):
        strategies = [s for s in FORK_STRATEGIES if s[0] in o["strategies"]]
    if records is not None:   # the tables, intervals and figures again from a finished run's records
        strategies = [s for s in strategies if any(r["strategy"] == s[0] for r in records)]
        summary, table = summarise_forks(records, strategies, o, len({r["problem"] for r in records}),
                                         cfg.embed_model)
        return forks_figures(study, strategies, summary, table, time.perf_counter() - t0, records)
    setup = sampling_setup(study)
    embedder = models.load_embedder(cfg.embed_model, setup.device, cfg.trust_remote_code)
    rng = random.Random(cfg.seed)
    records = []
    per_call = max(1, cfg.gen_batch_size)
    n_problems = len(setup.problems)
    bar = tqdm(total=o["repeats"] * n_problems * len(strategies), desc="forks", unit="tree",
               dynamic_ncols=True)
    for repeat in range(o["repeats"]):
        for first in range(0, n_problems, per_call):
            group = list(range(first, min(first + per_call, n_problems)))
            with torch.no_grad(), models.autocast(setup.device, cfg.precision):
                base = R.sample_base(setup.sampler, [setup.prompt_ids[i] for i in group], 1,
                                     cfg.max_new_tokens, keep_cache=True)
            answers = [setup.problems[i]["answer"] for i in group]
            rewards = base_rewards(setup.tokenizer, base, answers, cfg)
            for strategy in strategies:
                records += strategy_records(study, setup, embedder, strategy, base, group, answers, rewards,
                                            repeat, rng)
                bar.update(len(group))
            del base
    bar.close()

    summary, table = summarise_forks(records, strategies, o, n_problems, cfg.embed_model)
    forks_figures(study, strategies, summary, table, time.perf_counter() - t0, records)


def strategy_records(study: Study, setup: Sampling, embedder, strategy: tuple, base, group: list[int],
                     answers: list[str], rewards: list[float], repeat: int, rng: random.Random) -> list[dict]:
    """One strategy on one batch of base rollouts (one per problem of `group`): its K forks on each, B
    branches per fork, and per tree its PassRate, SibDiv and the localization of its forks."""
    cfg, o = study.cfg, study.opts
    label, method, min_dist = strategy
    scfg = fork_cfg(cfg, min_dist)
    forks = {r: R.choose_forks(method, o["k"], setup.tokenizer, setup.model, base.prompt_ids[r],
                               base.tokens[r], base.entropies[r], rng, scfg) for r in range(len(group))}
    with models.autocast(setup.device, cfg.precision):
        subtrees = growth.grow_from_forks(setup.sampler, setup.tokenizer, base, forks, o["b"], answers,
                                          cfg.max_new_tokens, cfg.branch_chunk_size, cfg.answer_fallback,
                                          rewards, cfg.branch_length)
    texts = [b.text for r in range(len(group)) for b in subtrees[r]]
    vectors = embedder.encode(texts, batch_size=cfg.embed_batch_size, convert_to_numpy=True,
                              show_progress_bar=False) if texts else []
    records, at = [], 0
    for r, index in enumerate(group):
        blocks = subtrees[r]
        emb = vectors[at:at + len(blocks)]
        at += len(blocks)
        length = len(base.tokens[r])
        records.append({
            "repeat": repeat, "problem": index, "strategy": label, "forks": forks[r], "length": length,
            "leaves": sum(b.terminal for b in blocks),
            "pass_rate": pass_rate([b.reward for b in blocks if b.terminal]),
            "sib_div": sib_div([b.parent for b in blocks], emb),
            "branch_tokens": sum(len(b.token_ids) for b in blocks if b.branch),
            "base": [t for b in blocks if not b.branch for t in b.token_ids],
            **localization(forks[r], length)})
    return records


def summarise_forks(records: list[dict], strategies: list, o: dict, n_problems: int, embed_model: str):
    """Fork table and localization table: means over (repeat, problem) units (each one base rollout shared by
    every strategy) with 95 % t-intervals on PassRate and SibDiv, and each strategy paired against
    sent-entropy on the same rollouts (Sec. 3.3's claims: sent-entropy's PassRate highest, tok-entropy's
    SibDiv)."""
    summary, rows = {}, []
    units = sorted({(r["repeat"], r["problem"]) for r in records})
    for label, _, _ in strategies:
        mine = [r for r in records if r["strategy"] == label]
        summary[label] = {key: mean_of(r[key] for r in mine) for key in
                          ("pass_rate", "sib_div", "leaves", "branch_tokens",
                           "NND", "MPD", "WCR@5", "WCR@10")}
        summary[label]["forks"] = float(np.mean([len(r["forks"]) for r in mine]))
        summary[label]["pass_rate_ci"] = t_interval([r["pass_rate"] for r in mine])[1]
        sib = [r["sib_div"] for r in mine if r["sib_div"] is not None]
        summary[label]["sib_div_ci"] = t_interval(sib)[1] if sib else None
        x = summary[label]
        rows.append([label, pm(x["pass_rate"], x["pass_rate_ci"], scale=100),
                     None if x["sib_div"] is None else pm(x["sib_div"], x["sib_div_ci"], 3),
                     x["forks"], x["leaves"], x["branch_tokens"]])
    table = "Fork table (App. D.5; paper: AIME26, Qwen2.5-3B-Instruct)\n\n" + markdown_table(
        ["strategy", "PassRate (%) ± 95 % CI", "SibDiv ± 95 % CI", "forks / response", "leaves",
         "branch tokens"], rows)
    pairs = paired_with_sent_entropy(records, strategies, units)
    if any(s[0] == "sent-entropy" for s in strategies):
        table += ("\nPaired on the same base rollouts: sent-entropy − strategy\n\n" + markdown_table(
            ["strategy", "ΔPassRate (pp) ± 95 % CI", "PassRate shows", "ΔSibDiv ± 95 % CI", "SibDiv shows"],
            pairs))
    summary["paired"] = pairs
    loc = [x for x in LOCALIZATION_STRATEGIES if x in summary]
    table += ("\nLocalization (App. D.2; lower NND/MPD, higher WCR = stronger localization)\n\n"
              + markdown_table(["metric"] + loc, [[m] + [summary[x][m] for x in loc]
                                                  for m in ("NND", "MPD", "WCR@5", "WCR@10")]))
    table += (f"\n{n_problems} problems ({o['data']}, levels {o['levels'] or 'all'}) × {o['repeats']} "
              f"repeats = {len(units)} base rollouts; K = {o['k']}, B = {o['b']}; embedder {embed_model}.\n")
    return summary, table


def paired_with_sent_entropy(records: list[dict], strategies: list, units: list[tuple]) -> list[list]:
    """Per strategy, sent-entropy − strategy on the units both ran: ΔPassRate and ΔSibDiv with 95 %
    t-intervals and what each shows. No rows when sent-entropy did not run."""
    if not any(s[0] == "sent-entropy" for s in strategies):
        return []
    by_unit = {(r["repeat"], r["problem"], r["strategy"]): r for r in records}
    pairs = []
    for label, _, _ in strategies:
        if label == "sent-entropy":
            continue
        both = [u for u in units if (*u, label) in by_unit and (*u, "sent-entropy") in by_unit]
        d_pass, h_pass = t_interval([by_unit[(*u, "sent-entropy")]["pass_rate"]
                                     - by_unit[(*u, label)]["pass_rate"] for u in both])
        sib = [(by_unit[(*u, "sent-entropy")]["sib_div"], by_unit[(*u, label)]["sib_div"]) for u in both]
        sib = [a - b for a, b in sib if a is not None and b is not None]
        d_sib, h_sib = t_interval(sib) if sib else (None, None)
        pairs.append([label, pm(d_pass, h_pass, scale=100),
                      verdict(d_pass, h_pass, "sent-entropy", label),
                      None if d_sib is None else pm(d_sib, h_sib, 3),
                      None if d_sib is None else verdict(d_sib, h_sib, "sent-entropy", label)])
    return pairs


def forks_figures(study, strategies: list, summary: dict, table: str, seconds: float, records: list) -> None:
    """The fork table's bars (PassRate, SibDiv per strategy) and the localization metrics' bars, then the
    study's outputs."""
    o = study.opts
    loc = [x for x in LOCALIZATION_STRATEGIES if x in summary]
    plt = pyplot()
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
    save_png(fig, figures[0], dpi=110)
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.4))
    for ax, metric in zip(axes, ("NND", "MPD", "WCR@5", "WCR@10")):
        ax.bar(range(len(loc)), [summary[s][metric] or 0.0 for s in loc],
               color=[STRATEGY_COLORS[s] for s in loc])
        ax.set_xticks(range(len(loc)), loc, rotation=20, fontsize=8)
        ax.set_title(metric + (" ↓" if metric in ("NND", "MPD") else " ↑"))
    fig.tight_layout()
    save_png(fig, figures[1], dpi=110)
    write_outputs(study, {"summary": summary, "records": records, "figures": [str(f) for f in figures]},
                  table, seconds)


# --------------------------------------------------------------------------------------------------------
# show-forks (App. D.2 figures "localization" and "case study")
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
    """A self-contained page: tokens shaded by entropy (white → red), each strategy's fork tokens outlined in
    its colour (nested rings where strategies agree). The boxed token is the last one a branch keeps
    (f − 1)."""
    top = max(entropies) if entropies else 1.0
    colors = {name: to_hex(STRATEGY_COLORS.get(name, "tab:orange")) for name in forks_by}
    spans = []
    for i, (piece, h) in enumerate(zip(pieces, entropies)):
        shade = int(255 - 200 * (h / top if top else 0))
        rings = [colors[name] for name, forks in forks_by.items() if i + 1 in forks]
        shadow = ", ".join(f"0 0 0 {2 * (j + 1)}px {c}" for j, c in enumerate(rings))
        style = f"background: rgb(255,{shade},{shade});"
        tip = f"token {i}, H = {h:.2f}"
        if rings:
            style += f" box-shadow: {shadow}; margin: 0 {2 * len(rings)}px;"
            tip += f"; fork of {', '.join(n for n in forks_by if i + 1 in forks_by[n])}"
        spans.append(f'<span style="{style}" title="{html.escape(tip)}">{html.escape(piece) or "·"}</span>')
    legend = " ".join(f'<span style="border: 3px solid {colors[n]}; padding: 0 4px">{html.escape(n)}: '
                      f'{forks_by[n]}</span>' for n in forks_by)
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>forks</title></head>"
            "<body style='font-family: sans-serif; max-width: 60em; margin: 2em auto'>"
            f"<h3>{html.escape(title)}</h3><p>Shading: token entropy H (white = 0, red = {top:.2f}). "
            "Boxes: the last token each strategy's branches keep (fork prefix length f → token f − 1). "
            f"Fork lists are prefix lengths.</p><p>{legend}</p>"
            f"<pre style='white-space: pre-wrap; line-height: 2.2; font-size: 14px'>{''.join(spans)}</pre>"
            "</body></html>\n")


def render_forks_png(pieces, entropies, forks_by: dict[str, list[int]], title: str, path: Path,
                     width: int = 90) -> None:
    """The same drawing as render_forks_html with matplotlib: a monospace grid of tokens (token_lines), each
    on its entropy's shade, each strategy's fork tokens framed in its colour."""
    plt = pyplot()
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
            ax.add_patch(plt.Rectangle((x, y + 0.1), len(text), 0.8,
                                       color=cmap(0.8 * entropies[i] / top if top else 0), lw=0, zorder=1))
            ax.text(x, y + 0.5, literal(text), family="monospace", fontsize=9, va="center", ha="left",
                    zorder=2)   # a token "$$" is drawn as written, never as math text
            for j, name in enumerate(names):
                if i + 1 in forks_by[name]:
                    pad = 0.08 * (j + 1)
                    ax.add_patch(plt.Rectangle((x - pad, y + 0.1 - pad), len(text) + 2 * pad, 0.8 + 2 * pad,
                                               fill=False, lw=1.6, zorder=3,
                                               edgecolor=STRATEGY_COLORS.get(name, "tab:orange")))
    handles = [plt.Rectangle((0, 0), 1, 1, fill=False, lw=2, edgecolor=STRATEGY_COLORS.get(n, "tab:orange"),
                             label=f"{n} {forks_by[n]}") for n in names]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.28 / fig_h), ncol=len(names),
               fontsize=8, frameon=False)
    fig.suptitle(literal(title), y=0.995, fontsize=9)   # the problem's text, as written
    save_png(fig, path, dpi=120)


def run_show_forks(study: Study) -> None:
    """One response (the longest of `candidates` samples of the first problems) with each strategy's K
    forks."""
    t0 = time.perf_counter()
    cfg, o = study.cfg, study.opts
    problems, model, tokenizer, device, sampler, ids = sampling_setup(study)
    with torch.no_grad(), models.autocast(device, cfg.precision):
        base = R.sample_base(sampler, ids, o["candidates"], cfg.max_new_tokens)
    row = max(range(len(base.tokens)), key=lambda r: len(base.tokens[r]))
    problem = problems[row // o["candidates"]]
    tokens, entropies = base.tokens[row], base.entropies[row]
    rng = random.Random(cfg.seed)
    forks_by = {name: R.choose_forks(name, o["k"], tokenizer, model, base.prompt_ids[row], tokens, entropies,
                                     rng, cfg) for name in o["strategies"]}
    pieces = tokenizer.batch_decode([[t] for t in tokens], skip_special_tokens=True)
    title = f"{problem['problem']}  (gold {problem['answer']}; {len(tokens)} tokens; K = {o['k']})"
    figures = [study.out / "forks.png", study.out / "forks.html"]
    render_forks_png(pieces, entropies, forks_by, title, figures[0])
    atomic.write_text(figures[1], render_forks_html(pieces, entropies, forks_by, title))
    rows = [[name, str(forks), *(localization(forks, len(tokens)).values())]
            for name, forks in forks_by.items()]
    table = markdown_table(["strategy", "forks (prefix lengths)", "NND", "MPD", "WCR@5", "WCR@10"], rows)
    write_outputs(study, {"problem": problem, "tokens": tokens, "pieces": pieces, "entropies": entropies,
                          "forks": forks_by, "figures": [str(f) for f in figures]}, table,
                  time.perf_counter() - t0)
