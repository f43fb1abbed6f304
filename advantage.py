"""advantage.py — Phase 3 of Algorithm DATPO: every block's advantage,
as pure functions over a tree.

A tree is two parallel lists (see tree.py): `parents[i]` is the block that block i continues
(None = it starts at the prompt) and `rewards[i]` is the 0/1 reward of a terminal block (None for
inner blocks).

DATPO (Sec. 4.2, App. E.1):
  mc_values          V_MC(s) = mean reward of all terminal blocks descending from s
                     (Eq. "Monte Carlo State Value"); V(after a terminal block) = 0;
                     V̂_MC(root) = mean over every terminal block (mc_root_value).
  base_advantages    Â_base(b) = r(b) + V(s_end) − V(s_start)  (Eq. 3)
  sibling_diversity  Div_sib(b) = 1 − mean cos(e_b, e_b') over b' with the same start state
                     (Eq. 10)
  diversity_bonus    Â(b) = Â_base(b) + 1[Â_base(b) > 0] · α · Div_sib(b)  (Eq. 4)
  alpha_at           α linearly annealed from start to end over the run (Table "alpha")
Baselines (Sec. 5.1, App. F.2):
  grpo_advantages    (r − mean) / std within a group (GRPO)
  drgrpo_advantages  r − mean (Dr.GRPO: no std division)
  treerl_advantages  TreeRL / AttnRL process advantage per segment ending at node s:
                     [(V(s) − V(root)) + (V(s) − V(parent(s)))] / √|L(s)|,
                     V = mean leaf reward below
Phase 3 of a training step (train.train_step), over tree.Tree objects:
  embed_blocks       the blocks' sentence embeddings, once per step for the whole batch
                     (Div_sib's e_b)
  score_tree         one BlockScore per block, in the paper's order: V(s_start), V(s_end) → Â_base
                     (Eq. 3) → Div_sib (Eq. 10) → the advantage the method trains (Eq. 4 for DATPO)
                     — the numbers the update uses and the tree log writes as they are.
                     block_values, embedding_texts and block_diversity take the paper's estimates,
                     or the authors' release's (release.py) where its row (--preset release) asks
                     for them.
Two values of the root (mc_root_value says which the paper uses where): V(root) of Sec. 4.1, the
mean of the N base responses (tree.Tree.v_root: it sets K̂ and B̂), and V̂_MC(root), the mean of
every leaf (Eq. 3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

import release
from tree import Tree, child_blocks


def _leaf_rewards(parents: list[int | None], rewards: list[float | None]) -> list[list[float]]:
    """For every block, the rewards of the terminal blocks in its subtree
    (itself included when terminal)."""
    if len(parents) != len(rewards):
        raise ValueError(f"parents ({len(parents)}) and rewards ({len(rewards)}) differ in length")
    children = child_blocks(parents)
    below: list[list[float] | None] = [None] * len(parents)

    def collect(i: int, depth: int = 0) -> list[float]:
        if depth > len(parents):
            raise ValueError("parents contain a cycle")
        if below[i] is None:
            if rewards[i] is not None:
                if children[i]:
                    raise ValueError(f"block {i} has a reward (terminal) but also children "
                                     f"{children[i]}")
                below[i] = [float(rewards[i])]
            else:
                if not children[i]:
                    raise ValueError(f"block {i} has no reward and no children: every path must "
                                     f"end in a terminal block")
                below[i] = [r for c in children[i] for r in collect(c, depth + 1)]
        return below[i]

    return [collect(i) for i in range(len(parents))]


def mc_root_value(rewards: list[float | None]) -> float:
    """V̂_MC(root): the mean reward of every terminal block of the tree (App. E.1) — the value of
    the state a block that starts at the prompt starts from, in Eq. 3 (and TreeRL's V(root)).

    Not the V(root) of Sec. 4.1 and Alg. DATPO, the mean reward of the N base responses
    (tree.Tree.v_root, rollout.plan_prompt), which sets K̂ and B̂ before any branch exists. The
    paper uses that one for the budget and this one for the advantages; they differ once branches
    are scored (N = 4 bases with one correct: V(root) = 0.25; if 4 of its 12 branches are correct
    too, V̂_MC(root) = 5/16)."""
    terminal = [r for r in rewards if r is not None]
    return float(np.mean(terminal)) if terminal else 0.0


def mc_values(parents: list[int | None],
              rewards: list[float | None]) -> tuple[list[float], list[float]]:
    """(V(s_start), V(s_end)) of every block, by Monte-Carlo averaging (App. E.1).

    The state at the end of an inner block is a forking point: its value averages every terminal
    block below it — the base response's own continuation as well as the new branches. The state
    after a terminal block has value 0. A block that starts at the prompt starts from the root:
    V̂_MC(root), the mean over all terminal blocks of the tree (mc_root_value).
    """
    below = _leaf_rewards(parents, rewards)
    v_mc_root = mc_root_value(rewards)
    v_end = [0.0 if rewards[i] is not None else float(np.mean(below[i]))
             for i in range(len(parents))]
    v_start = [v_mc_root if p is None else v_end[p] for p in parents]
    return v_start, v_end


def base_advantages(rewards: list[float | None], v_start: list[float],
                    v_end: list[float]) -> list[float]:
    """Â_base(b) = r(b) + V(s_end) − V(s_start), r(b) = 0 for an inner block (Sec. 4.2, Eq. 3)."""
    return [(r or 0.0) + e - s for r, s, e in zip(rewards, v_start, v_end)]


def sibling_diversity(parents: list[int | None], embeddings) -> list[float]:
    """Div_sib(b) = 1 − mean cosine similarity between b and each other block with the same parent,
    i.e. the same start state (App. E.1, Eq. 10); 0 when b has no sibling. Blocks starting at the
    prompt are siblings of each other. Embeddings need not be normalised."""
    emb = np.asarray(embeddings, dtype=float)
    if emb.ndim != 2 or emb.shape[0] != len(parents):
        raise ValueError(f"embeddings must be [{len(parents)}, dim], got shape {emb.shape}")
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    groups: dict = {}
    for i, p in enumerate(parents):
        groups.setdefault(p, []).append(i)
    div = [0.0] * len(parents)
    for members in groups.values():
        if len(members) < 2:
            continue
        sims = emb[members] @ emb[members].T
        for row, i in enumerate(members):
            others = np.delete(sims[row], row)
            div[i] = float(1.0 - others.mean())
    return div


def diversity_bonus(base: list[float], diversity: list[float] | None, alpha: float,
                    scope: str = "positive") -> list[float]:
    """Â(b) = Â_base(b) + 1[Â_base(b) > 0] · α · Div_sib(b) (Sec. 4.2, Eq. 4).

    scope "positive" rewards diversity only on blocks that are better than their start state (the
    paper's choice: never encourage exploring wrong paths); "all" drops the indicator (Table
    "alpha", ablation). With α = 0 the bonus vanishes and Div_sib is not needed (pass None).
    """
    if scope not in ("positive", "all"):
        raise ValueError(f"scope must be 'positive' or 'all', got {scope!r}")
    if alpha == 0:
        return base
    return [a + (alpha * d if (scope == "all" or a > 0) else 0.0) for a, d in zip(base, diversity)]


def alpha_at(step: int, total_steps: int, start: float, end: float) -> float:
    """α at `step` (0-based) of a run of `total_steps`: start at step 0, end at the last step,
    linear between."""
    progress = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)
    return start + (end - start) * progress


# --------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------
def grpo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: (r − mean) / (std + eps) within the group of G responses to one prompt (unbiased std,
    as torch.std; a group with equal rewards gets 0)."""
    r = np.asarray(rewards, dtype=float)
    std = float(r.std(ddof=1)) if len(r) > 1 else 0.0
    return ((r - r.mean()) / (std + eps)).tolist()


def drgrpo_advantages(rewards: list[float]) -> list[float]:
    """Dr.GRPO (Liu et al. 2025): r − mean, no division by the group std (which biases toward easy
    and hard prompts)."""
    r = np.asarray(rewards, dtype=float)
    return (r - r.mean()).tolist()


def treerl_advantages(parents: list[int | None], rewards: list[float | None]) -> list[float]:
    """TreeRL process advantage (Hou et al. 2025; also AttnRL), one value per segment (block).

    For the node s at the end of block b: V(s) = mean reward of the leaves below s (a leaf's own
    reward for a terminal block), V(parent(s)) = V at the start of b (V(root) for a block starting
    at the prompt), and A(b) = [(V(s) − V(root)) + (V(s) − V(parent(s)))] / √|L(s)| with |L(s)| the
    number of leaves below s — the down-weighting that TreeRL needs because its root-to-leaf
    training paths repeat shared prefixes.
    """
    below = _leaf_rewards(parents, rewards)
    v_node = [float(np.mean(b)) for b in below]
    v_mc_root = mc_root_value(rewards)
    out = []
    for i, p in enumerate(parents):
        v_parent = v_mc_root if p is None else v_node[p]
        out.append(((v_node[i] - v_mc_root) + (v_node[i] - v_parent)) / math.sqrt(len(below[i])))
    return out


# --------------------------------------------------------------------------------------------------
# Phase 3 of a training step: the numbers of every block of every tree (Alg. DATPO, App. E)
# --------------------------------------------------------------------------------------------------
@dataclass
class BlockScore:
    """Phase 3's numbers for one block (App. E.1):
    what the update trains and what the tree log shows."""
    v_start: float              # V(s_start): the value of the state the block starts from
                                # (V(root) at the prompt)
    v_end: float                # V(s_end): 0 after a terminal block
    base_advantage: float       # Â_base(b) = r(b) + V(s_end) − V(s_start)  (Eq. 3)
    div_sib: float | None       # Div_sib(b) (Eq. 10); None when this step embedded no blocks
    advantage: float | None     # Â(b) by the method's formula; None when the tree is not trained


def sibling_texts(tr: Tree) -> tuple[int, list[tuple[int, str]]]:
    """Eq. 10's texts: one row per block; only blocks that have a sibling are embedded (Div_sib of a
    lone block is 0 whatever its embedding; its row stays 0)."""
    counts: dict = {}
    for b in tr.blocks:
        counts[b.parent] = counts.get(b.parent, 0) + 1
    return len(tr.blocks), [(i, b.text) for i, b in enumerate(tr.blocks) if counts[b.parent] > 1]


# --------------------------------------------------------------------------------------------------
# The paper's estimates, or the authors' release's where its row asks (--preset release: release.py)
# --------------------------------------------------------------------------------------------------
def block_values(tr: Tree, value_estimate: str = "paper") -> tuple[list[float], list[float]]:
    """(V(s_start), V(s_end)) of the tree's blocks: V̂_MC (App. E.1, mc_values), or the release's
    estimate with value_estimate "release" (release.tree_values)."""
    if value_estimate == "release":
        return release.tree_values(tr)
    return mc_values(tr.parents, tr.rewards)


def embedding_texts(tr: Tree, sibling_groups: str = "paper") -> tuple[int, list[tuple[int, str]]]:
    """Which texts Div_sib embeds, in which rows: Eq. 10's (sibling_texts), or the release's with
    sibling_groups "release" (release.embedded_texts: every block, then each whole base
    response)."""
    if sibling_groups == "release":
        return release.embedded_texts(tr)
    return sibling_texts(tr)


def block_diversity(tr: Tree, embeddings, sibling_groups: str = "paper") -> list[float]:
    """Div_sib of the tree's blocks from their embedding rows: Eq. 10's siblings
    (sibling_diversity), or the release's groups with sibling_groups "release"
    (release.tree_diversity)."""
    if sibling_groups == "release":
        return release.tree_diversity(tr, embeddings)
    return sibling_diversity(tr.parents, embeddings)


def embed_blocks(embedder, trees: list[Tree], batch_size: int, sibling_groups: str = "paper"
                 ) -> list[np.ndarray | None]:
    """Each tree's embedding rows e_b for Div_sib (embedding_texts: which texts, in which rows), in
    one embedder call for the whole batch; None for a tree with nothing to embed."""
    wanted, texts, rows = [], [], []
    for t, tr in enumerate(trees):
        n_rows, items = embedding_texts(tr, sibling_groups)
        wanted += [(t, row) for row, _ in items]
        texts += [text for _, text in items]
        rows.append(n_rows)
    out: list[np.ndarray | None] = [None] * len(trees)
    if not wanted:
        return out
    vectors = embedder.encode(texts, batch_size=batch_size, convert_to_numpy=True,
                              show_progress_bar=False)
    for t, n in enumerate(rows):
        out[t] = np.zeros((n, vectors.shape[1]), dtype=np.float32)
    for (t, row), v in zip(wanted, vectors):
        out[t][row] = v
    return out


# --------------------------------------------------------------------------------------------------
# Phase 3 of a training step: the numbers of every block of one tree (Alg. DATPO, App. E)
# --------------------------------------------------------------------------------------------------
def score_tree(tr: Tree, method, alpha: float, embeddings, scope: str = "positive",
               value_estimate: str = "paper", sibling_groups: str = "paper") -> list[BlockScore]:
    """Phase 3 of one tree as Sec. 4.2 reads, one BlockScore per block: V at each block's start and
    end, Â_base (Eq. 3), Div_sib (Eq. 10, when the step embedded the blocks) and the advantage the
    method trains (`method`: its methods.py row; DATPO's is Eq. 4, diversity_bonus; None when the
    method does not train this tree, e.g. AttnRL's filter). value_estimate / sibling_groups
    "release": the authors' release's estimates where its row (--preset release) asks for them."""
    v_start, v_end = block_values(tr, value_estimate)                        # V(s): V̂_MC, App. E.1
    base = base_advantages(tr.rewards, v_start, v_end)                       # Â_base, Eq. 3
    div = None if embeddings is None else block_diversity(tr, embeddings, sibling_groups)   # Eq. 10
    adv = method.advantages(tr, base, div, alpha, scope) if method.trainable(tr) else None  # Eq. 4
    return [BlockScore(v_start[i], v_end[i], base[i], None if div is None else div[i],
                       None if adv is None else float(adv[i])) for i in range(len(tr.blocks))]
