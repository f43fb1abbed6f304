"""advantage.py — Phase 3 of Algorithm DATPO: every block's advantage, as pure functions over a tree.

A tree is two parallel lists (see tree.py): `parents[i]` is the block that block i continues (None = it
starts at the prompt) and `rewards[i]` is the 0/1 reward of a terminal block (None for inner blocks).

DATPO (Sec. 4.2, App. E):
  mc_values          V_MC(s) = mean reward of all terminal blocks descending from s (Eq. "Monte Carlo State
                     Value"); V(after a terminal block) = 0; V(root) = mean over every terminal block.
  release_values     the authors' release's estimates (an ablation, --value_estimate release): a fork's value
                     averages only its B̂ branches, V(root) = mean of the N base responses
  base_advantages    Â_base(b) = r(b) + V(s_end) − V(s_start), V = V_MC or the release's      (Eq. 3)
  sibling_diversity  Div_sib(b) = 1 − mean cos(e_b, e_b') over b' with the same start state  (Eq. 10)
  release_sibling_diversity  the release's sibling groups for Div_sib (an option, --sibling_groups release)
  diversity_bonus    Â(b) = Â_base(b) + 1[Â_base(b) > 0] · α · Div_sib(b)                     (Eq. 4)
  datpo_advantages   the same from the tree's lists in one call
  alpha_at           α linearly annealed from start to end over the run (Table "alpha")
Baselines (Sec. 5.1, App. F.2):
  grpo_advantages    (r − mean) / std within a group (GRPO)
  drgrpo_advantages  r − mean (Dr.GRPO: no std division)
  treerl_advantages  TreeRL / AttnRL process advantage per segment ending at node s:
                     [(V(s) − V(root)) + (V(s) − V(parent(s)))] / √|L(s)|, V = mean leaf reward below
Phase 3 of a training step (train.train_step), over tree.Tree objects:
  embed_blocks       the blocks' sentence embeddings, once per step for the whole batch (Div_sib's e_b)
  score_tree         one BlockScore per block: V(s_start), V(s_end), Â_base, Div_sib and the advantage the
                     method trains — the numbers the update uses and the tree log writes as they are
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:   # types only: tree.py and methods.py need nothing from here at import time
    from methods import Method
    from tree import Tree


def _children(parents: list[int | None]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p is not None:
            if not 0 <= p < len(parents) or p == i:
                raise ValueError(f"block {i}: parent {p} is not another block index")
            children[p].append(i)
    return children


def _leaf_rewards(parents: list[int | None], rewards: list[float | None]) -> list[list[float]]:
    """For every block, the rewards of the terminal blocks in its subtree (itself included when terminal)."""
    if len(parents) != len(rewards):
        raise ValueError(f"parents ({len(parents)}) and rewards ({len(rewards)}) differ in length")
    children = _children(parents)
    below: list[list[float] | None] = [None] * len(parents)

    def collect(i: int, depth: int = 0) -> list[float]:
        if depth > len(parents):
            raise ValueError("parents contain a cycle")
        if below[i] is None:
            if rewards[i] is not None:
                if children[i]:
                    raise ValueError(f"block {i} has a reward (terminal) but also children {children[i]}")
                below[i] = [float(rewards[i])]
            else:
                if not children[i]:
                    raise ValueError(f"block {i} has no reward and no children: every path must end in a "
                                     f"terminal block")
                below[i] = [r for c in children[i] for r in collect(c, depth + 1)]
        return below[i]

    return [collect(i) for i in range(len(parents))]


def mc_values(parents: list[int | None], rewards: list[float | None]) -> tuple[list[float], list[float]]:
    """(V(s_start), V(s_end)) of every block, by Monte-Carlo averaging (App. E.1).

    The state at the end of an inner block is a forking point: its value averages every terminal block
    below it — the base response's own continuation as well as the new branches. The state after a terminal
    block has value 0. A block that starts at the prompt starts from the root, whose value is the mean over
    all terminal blocks of the tree.
    """
    below = _leaf_rewards(parents, rewards)
    terminal = [r for r in rewards if r is not None]
    v_root = float(np.mean(terminal)) if terminal else 0.0
    v_end = [0.0 if rewards[i] is not None else float(np.mean(below[i])) for i in range(len(parents))]
    v_start = [v_root if p is None else v_end[p] for p in parents]
    return v_start, v_end


def release_values(parents: list[int | None], rewards: list[float | None],
                   branch: list[bool]) -> tuple[list[float], list[float]]:
    """(V(s_start), V(s_end)) of every block as the authors' release estimates them (an ablation; the paper's
    V_MC is mc_values). Release: datpo_zero.search_batch sets a fork node's value to the mean reward of the
    B̂ branch rollouts generated there, and tree_search._assign_advantages uses the mean of the N base
    responses as V(root). So, unlike V_MC(s):
      * V(fork) ignores the base response's own continuation below the fork (and every deeper fork's
        branches): it is not counted as a sibling of the branches;
      * V(root) averages the N base responses only, not every leaf of the tree;
      * with B̂ = 1 a fork's value is its one branch's reward, so that branch's advantage is always 0.
    branch[i] marks the blocks that are branch rollouts (tree.Block.branch); the other terminal blocks end
    base responses. V after a terminal block is 0, as in mc_values.
    """
    if not len(parents) == len(rewards) == len(branch):
        raise ValueError(f"parents ({len(parents)}), rewards ({len(rewards)}) and branch ({len(branch)}) "
                         f"differ in length")
    _children(parents)                                           # validates the parent indices
    base_rewards = [float(r) for r, b in zip(rewards, branch) if r is not None and not b]
    v_root = float(np.mean(base_rewards)) if base_rewards else 0.0
    at_fork: dict[int, list[float]] = {}
    for i, p in enumerate(parents):
        if branch[i]:
            if p is None or rewards[i] is None:
                raise ValueError(f"block {i} is a branch, so it must be terminal and start at a fork")
            at_fork.setdefault(p, []).append(float(rewards[i]))
    v_end = []
    for i, r in enumerate(rewards):
        if r is not None:
            v_end.append(0.0)
        elif i in at_fork:
            v_end.append(float(np.mean(at_fork[i])))
        else:
            raise ValueError(f"block {i} ends at a fork with no branch: the release's V(fork) is undefined")
    v_start = [v_root if p is None else v_end[p] for p in parents]
    return v_start, v_end


VALUE_ESTIMATES = ("paper", "release")


def block_values(parents: list[int | None], rewards: list[float | None], value_estimate: str = "paper",
                 branch: list[bool] | None = None) -> tuple[list[float], list[float]]:
    """(V(s_start), V(s_end)) of every block by --value_estimate: "paper" = V_MC (mc_values, App. E.1);
    "release" = the authors' code's estimates (release_values, needs the branch flags)."""
    if value_estimate == "paper":
        return mc_values(parents, rewards)
    if value_estimate == "release":
        if branch is None:
            raise ValueError("value_estimate 'release' needs the branch flags of the blocks")
        return release_values(parents, rewards, branch)
    raise ValueError(f"value_estimate must be one of {', '.join(VALUE_ESTIMATES)}, got {value_estimate!r}")


def base_advantages(parents: list[int | None], rewards: list[float | None], value_estimate: str = "paper",
                    branch: list[bool] | None = None) -> list[float]:
    """Â_base(b) = r(b) + V(s_end) − V(s_start), r(b) = 0 for inner blocks (Sec. 4.2, Eq. 3), V by
    block_values."""
    v_start, v_end = block_values(parents, rewards, value_estimate, branch)
    return [(r or 0.0) + e - s for r, s, e in zip(rewards, v_start, v_end)]


def sibling_diversity(parents: list[int | None], embeddings) -> list[float]:
    """Div_sib(b) = 1 − mean cosine similarity between b and each other block with the same parent, i.e. the
    same start state (App. E.1, Eq. 10); 0 when b has no sibling. Blocks starting at the prompt are siblings
    of each other. Embeddings need not be normalised."""
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


SIBLING_GROUPS = ("paper", "release")


def _mean_other_cos(emb: np.ndarray, row: int, members: list[int]) -> float:
    """1 − mean cosine between emb[row] and emb[m] for the other members m (rows already unit-norm)."""
    others = [m for m in members if m != row]
    return float(1.0 - (emb[others] @ emb[row]).mean()) if others else 0.0


def release_sibling_diversity(parents: list[int | None], rewards: list[float | None], branch: list[bool],
                              base: list[int], embeddings, response_embeddings,
                              valid: list[bool] | None = None, response_valid: list[bool] | None = None
                              ) -> list[float]:
    """Div_sib as the authors' release groups siblings (an option, --sibling_groups release; the paper's
    Eq. 10 is sibling_diversity). The release (tree_search._compute_sibling_divergence, per fork node)
    compares:
      * at the root, the first blocks of the base responses that were forked, among themselves only;
      * an unforked base response (one terminal block at the root) as its whole text against the whole texts
        of all N base responses (forked ones included): response_embeddings[k] embeds base response k;
      * at a fork, its branches among themselves: the base response's own continuation is not their sibling;
      * every other block (a base response's blocks after its first fork, the base tail) gets 0.
    `valid[i]` / `response_valid[k]` False drop block i / base response k from every group, as the release
    drops empty texts; base[i] = the base response block i grows from (tree.Block.base)."""
    n = len(parents)
    if not len(rewards) == len(branch) == len(base) == n:
        raise ValueError(f"parents ({n}), rewards ({len(rewards)}), branch ({len(branch)}) and base "
                         f"({len(base)}) differ in length")
    valid = [True] * n if valid is None else list(valid)

    def unit(x) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    emb = unit(embeddings)
    if emb.shape[0] != n:
        raise ValueError(f"embeddings must be [{n}, dim], got shape {emb.shape}")
    responses = unit(response_embeddings)
    div = [0.0] * n
    forked_firsts = [i for i in range(n) if parents[i] is None and rewards[i] is None and valid[i]]
    for i in forked_firsts:
        div[i] = _mean_other_cos(emb, i, forked_firsts)
    response_ok = [True] * len(responses) if response_valid is None else list(response_valid)
    all_responses = [k for k in range(len(responses)) if response_ok[k]]
    for i in range(n):
        if parents[i] is None and rewards[i] is not None and response_ok[base[i]]:
            div[i] = _mean_other_cos(responses, base[i], all_responses)
    at_fork: dict[int, list[int]] = {}
    for i in range(n):
        if branch[i] and valid[i]:
            at_fork.setdefault(parents[i], []).append(i)
    for members in at_fork.values():
        for i in members:
            div[i] = _mean_other_cos(emb, i, members)
    return div


def block_diversity(parents: list[int | None], rewards: list[float | None], branch: list[bool],
                    base: list[int], embeddings, sibling_groups: str = "paper",
                    valid: list[bool] | None = None) -> list[float]:
    """Div_sib of every block by --sibling_groups: "paper" = Eq. 10 (sibling_diversity) over the block rows of
    `embeddings`; "release" = release_sibling_diversity, which also needs the N whole base responses: then
    `embeddings` holds len(parents) block rows followed by one row per base response (train.embed_blocks)."""
    n = len(parents)
    if sibling_groups == "paper":
        return sibling_diversity(parents, np.asarray(embeddings)[:n])
    if sibling_groups == "release":
        emb = np.asarray(embeddings)
        return release_sibling_diversity(parents, rewards, branch, base, emb[:n], emb[n:], valid)
    raise ValueError(f"sibling_groups must be one of {', '.join(SIBLING_GROUPS)}, got {sibling_groups!r}")


def diversity_bonus(base: list[float], diversity: list[float] | None, alpha: float,
                    scope: str = "positive") -> list[float]:
    """Â(b) = Â_base(b) + 1[Â_base(b) > 0] · α · Div_sib(b) (Sec. 4.2, Eq. 4).

    scope "positive" rewards diversity only on blocks that are better than their start state (the paper's
    choice: never encourage exploring wrong paths); "all" drops the indicator (Table "alpha", ablation).
    With α = 0 the bonus vanishes and Div_sib is not needed (pass None).
    """
    if scope not in ("positive", "all"):
        raise ValueError(f"scope must be 'positive' or 'all', got {scope!r}")
    if alpha == 0:
        return base
    return [a + (alpha * d if (scope == "all" or a > 0) else 0.0) for a, d in zip(base, diversity)]


def datpo_advantages(parents: list[int | None], rewards: list[float | None], embeddings, alpha: float,
                     scope: str = "positive", value_estimate: str = "paper",
                     branch: list[bool] | None = None, diversity: list[float] | None = None) -> list[float]:
    """Eq. 4 from the tree's lists: base_advantages, then diversity_bonus with Div_sib = Eq. 10 over
    `embeddings` (or `diversity` when computed otherwise: release_sibling_diversity). With α = 0 the
    embeddings are not needed (pass None). value_estimate/branch: see base_advantages."""
    if scope not in ("positive", "all"):
        raise ValueError(f"scope must be 'positive' or 'all', got {scope!r}")
    base = base_advantages(parents, rewards, value_estimate, branch)
    if alpha == 0:
        return base
    div = sibling_diversity(parents, embeddings) if diversity is None else diversity
    return diversity_bonus(base, div, alpha, scope)


def alpha_at(step: int, total_steps: int, start: float, end: float) -> float:
    """α at `step` (0-based) of a run of `total_steps`: start at step 0, end at the last step, linear
    between."""
    progress = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)
    return start + (end - start) * progress


# --------------------------------------------------------------------------------------------------------
# Baselines
# --------------------------------------------------------------------------------------------------------
def grpo_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: (r − mean) / (std + eps) within the group of G responses to one prompt (unbiased std, as
    torch.std; a group with equal rewards gets 0)."""
    r = np.asarray(rewards, dtype=float)
    std = float(r.std(ddof=1)) if len(r) > 1 else 0.0
    return ((r - r.mean()) / (std + eps)).tolist()


def drgrpo_advantages(rewards: list[float]) -> list[float]:
    """Dr.GRPO (Liu et al. 2025): r − mean, no division by the group std (which biases toward easy and
    hard prompts)."""
    r = np.asarray(rewards, dtype=float)
    return (r - r.mean()).tolist()


def treerl_advantages(parents: list[int | None], rewards: list[float | None]) -> list[float]:
    """TreeRL process advantage (Hou et al. 2025; also AttnRL), one value per segment (block).

    For the node s at the end of block b: V(s) = mean reward of the leaves below s (a leaf's own reward for a
    terminal block), V(parent(s)) = V at the start of b (V(root) for a block starting at the prompt), and
    A(b) = [(V(s) − V(root)) + (V(s) − V(parent(s)))] / √|L(s)| with |L(s)| the number of leaves below s —
    the down-weighting that TreeRL needs because its root-to-leaf training paths repeat shared prefixes.
    """
    below = _leaf_rewards(parents, rewards)
    v_node = [float(np.mean(b)) for b in below]
    terminal = [r for r in rewards if r is not None]
    v_root = float(np.mean(terminal)) if terminal else 0.0
    out = []
    for i, p in enumerate(parents):
        v_parent = v_root if p is None else v_node[p]
        out.append(((v_node[i] - v_root) + (v_node[i] - v_parent)) / math.sqrt(len(below[i])))
    return out


# --------------------------------------------------------------------------------------------------------
# Phase 3 of a training step: the numbers of every block of every tree (Alg. DATPO, App. E)
# --------------------------------------------------------------------------------------------------------
@dataclass
class BlockScore:
    """Phase 3's numbers for one block (App. E.1): what the update trains and what the tree log shows."""
    v_start: float              # V(s_start): the value of the state the block starts from
                                # (V(root) at the prompt)
    v_end: float                # V(s_end): 0 after a terminal block
    base_advantage: float       # Â_base(b) = r(b) + V(s_end) − V(s_start)                         (Eq. 3)
    div_sib: float | None       # Div_sib(b) (Eq. 10); None when this step embedded no blocks
    advantage: float | None     # Â(b) by the method's formula; None when the tree is not trained


def embed_blocks(embedder, trees: list[Tree], batch_size: int, sibling_groups: str = "paper"
                 ) -> list[np.ndarray | None]:
    """Block embeddings e_b for Div_sib, once per step and batched over the whole batch (a row per block).
    Paper (Eq. 10): only blocks that have a sibling are embedded (Div_sib of a lone block is 0 whatever its
    embedding; the others' rows stay 0). --sibling_groups release: every block, then one row per base
    response, its whole text (the release compares an unforked response with all N whole responses)."""
    wanted, texts, rows = [], [], []
    for t, tr in enumerate(trees):
        counts: dict = {}
        for b in tr.blocks:
            counts[b.parent] = counts.get(b.parent, 0) + 1
        keep = [i for i, b in enumerate(tr.blocks) if sibling_groups == "release" or counts[b.parent] > 1]
        whole = [_response_text(tr, k) for k in range(sum(b.parent is None for b in tr.blocks))] \
            if sibling_groups == "release" else []
        wanted += [(t, i) for i in keep] + [(t, len(tr.blocks) + k) for k in range(len(whole))]
        texts += [tr.blocks[i].text for i in keep] + whole
        rows.append(len(tr.blocks) + len(whole))
    out: list[np.ndarray | None] = [None] * len(trees)
    if not wanted:
        return out
    vectors = embedder.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
    for t, n in enumerate(rows):
        out[t] = np.zeros((n, vectors.shape[1]), dtype=np.float32)
    for (t, i), v in zip(wanted, vectors):
        out[t][i] = v
    return out


def _response_text(tr: Tree, k: int) -> str:
    """Base response k's whole text: its blocks that are not branches, in order."""
    return "".join(b.text for b in tr.blocks if b.base == k and not b.branch)


def tree_diversity(tr: Tree, embeddings, sibling_groups: str = "paper") -> list[float]:
    """Div_sib of every block of the tree (block_diversity): Eq. 10's siblings, or the release's (then
    `embeddings` also holds the N whole base responses after the block rows; empty texts drop out)."""
    return block_diversity(tr.parents, tr.rewards, tr.branch_flags, [b.base for b in tr.blocks], embeddings,
                           sibling_groups, valid=[bool(b.text.strip()) for b in tr.blocks])


def score_tree(tr: Tree, method: Method, alpha: float, embeddings, scope: str = "positive",
               value_estimate: str = "paper", sibling_groups: str = "paper") -> list[BlockScore]:
    """One BlockScore per block: V at its start and end (block_values), Â_base (Eq. 3), Div_sib (Eq. 10;
    when the step embedded the blocks) and the advantage the method trains (methods.py's row: DATPO's is
    Eq. 4, diversity_bonus; None when the method does not train this tree, e.g. AttnRL's filter)."""
    parents, rewards = tr.parents, tr.rewards
    v_start, v_end = block_values(parents, rewards, value_estimate, tr.branch_flags)
    base = [(r or 0.0) + e - s for r, s, e in zip(rewards, v_start, v_end)]                    # Eq. 3
    div = tree_diversity(tr, embeddings, sibling_groups) if embeddings is not None else None
    adv = method.advantages(tr, base, div, alpha, scope) if method.trainable(tr) else None
    return [BlockScore(v_start[i], v_end[i], base[i], None if div is None else div[i],
                       None if adv is None else float(adv[i])) for i in range(len(parents))]
