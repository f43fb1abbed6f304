"""release.py — Phase 3 as the authors' release computes it: `--preset release` (or `--value_estimate
release`, `--sibling_groups release`), an option beside the paper's equations in advantage.py.

The paper's text is explicit about V_MC (App. E.1: a state's value averages every terminal block below it) and
about Div_sib's siblings (Eq. 10: the blocks with the same start state). The authors' code (GitHub
colin31472/DATPO) computes both differently; those differences are not bugs, so they stay runnable here, in
their own file, and the paper's run never reads it (docs/decisions.md):

  release_values             a fork's value averages only its B̂ branches; V(root) = mean of the N base
                             responses (datpo_zero.search_batch, tree_search._assign_advantages)
  release_sibling_diversity  the release's sibling groups (tree_search._compute_sibling_divergence)
  tree_values, embedded_texts, tree_diversity
                             the same over a tree.Tree: what advantage.score_tree reads where the row asks
"""
from __future__ import annotations

import numpy as np

from tree import Tree, child_blocks


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
    child_blocks(parents)                                       # validates the parent indices
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


# --------------------------------------------------------------------------------------------------------
# The release's estimates over tree.Tree objects (advantage.block_values, embedding_texts, block_diversity)
# --------------------------------------------------------------------------------------------------------
def tree_values(tr: Tree) -> tuple[list[float], list[float]]:
    """(V(s_start), V(s_end)) of the tree's blocks as the release estimates them (release_values)."""
    return release_values(tr.parents, tr.rewards, tr.branch_flags)


def embedded_texts(tr: Tree) -> tuple[int, list[tuple[int, str]]]:
    """Every block, then one row per base response, its whole text (the release compares an unforked
    response with all N whole responses): (rows, [(row, text)])."""
    n = len(tr.blocks)
    bases = sum(b.parent is None for b in tr.blocks)
    whole = [(n + k, "".join(b.text for b in tr.blocks if b.base == k and not b.branch))
             for k in range(bases)]
    return n + bases, [(i, b.text) for i, b in enumerate(tr.blocks)] + whole


def tree_diversity(tr: Tree, embeddings) -> list[float]:
    """Div_sib of the tree's blocks by the release's groups: `embeddings` holds the block rows, then the N
    whole base responses (embedded_texts); empty texts drop out, as the release drops them."""
    emb, n = np.asarray(embeddings), len(tr.blocks)
    return release_sibling_diversity(tr.parents, tr.rewards, tr.branch_flags, [b.base for b in tr.blocks],
                                     emb[:n], emb[n:], valid=[bool(b.text.strip()) for b in tr.blocks])


VALUES = ("paper", "release")              # --value_estimate (checks.py)
SIBLING_GROUPS = ("paper", "release")      # --sibling_groups
