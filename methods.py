"""methods.py — the table of methods: DATPO and the paper's baselines (Sec. 5.1 "Baselines",
App. F.2), one row each.

A row says everything that differs between methods; train.py, rollout.py and config.py read the row
and never test a method's name. `--method NAME` and `--preset NAME` give the same run:
config.make_config applies the row's `settings` (the config values that define the method) under the
preset's row and your flags. A new method or ablation is one more row.

  advantages  one advantage per block (advantage.py), from the tree and Phase 3's shared numbers
  rollout     "tree": N base responses, then forks and branches (Algorithm "Tree Rollout");
              "parallel": G independent responses per prompt (cfg.group_size), no forks (GRPO)
  expand      which base responses get forks: None = all; AttnRL picks them (tree.attnrl_expansion)
  paths       how the loss weighs tokens: None = every tree token once (Eq. DATPO); a function
              giving the trained root-to-leaf paths = TreeRL/AttnRL's flattening (App. E.4):
              a token counts once per path through it
  embeds      DATPO's sibling-diversity bonus α·Div_sib: α is annealed and blocks are embedded
              (Sec. 4.2)
  filters     drop trees whose leaves all share one reward before the update (AttnRL)
  dynamic_batch  AttnRL's dynamic prompt batch size (prompts.attnrl_batch_size)
  settings    the config values that define the method: forking strategy, (N, K, B), adaptive
              or fixed (K̂, B̂), clip, loss normaliser, off-policy. DATPO's are config.py's
              defaults (App. F.2).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import advantage
import tree


# --------------------------------------------------------------------------------------------------
# Advantages and training paths, per method (the formulas live in advantage.py and tree.py). An
# advantage function gets the tree and Phase 3's shared numbers (advantage.score_tree): Â_base per
# block (Eq. 3) and Div_sib per block (Eq. 10; None when the step embedded nothing), α and
# --alpha_scope.
# --------------------------------------------------------------------------------------------------
def datpo_rule(tr: tree.Tree, base: list[float], diversity, alpha: float,
               scope: str) -> list[float]:
    """Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b) (Sec. 4.2, Eq. 4)."""
    return advantage.diversity_bonus(base, diversity, alpha, scope)


def grpo_rule(tr: tree.Tree, base: list[float], diversity, alpha: float,
              scope: str) -> list[float]:
    """(r − mean) / std over the G parallel responses (GRPO)."""
    return advantage.grpo_advantages(tr.rewards)


def drgrpo_rule(tr: tree.Tree, base: list[float], diversity, alpha: float,
                scope: str) -> list[float]:
    """r − mean over the G parallel responses (Dr.GRPO)."""
    return advantage.drgrpo_advantages(tr.rewards)


def treerl_rule(tr: tree.Tree, base: list[float], diversity, alpha: float,
                scope: str) -> list[float]:
    """TreeRL's process advantage per segment (also AttnRL's)."""
    return advantage.treerl_advantages(tr.parents, tr.rewards)


def leaf_paths(tr: tree.Tree) -> list[list[int]]:
    """Every root-to-leaf path of the tree (TreeRL's training sequences, App. E.4)."""
    return [tree.path_to(tr.blocks, leaf) for leaf, b in enumerate(tr.blocks) if b.terminal]


def branched_paths(tr: tree.Tree) -> list[list[int]]:
    """AttnRL's training paths: the branched ones only (a path of more than one block); unbranched
    responses still count in V(root)."""
    return [p for p in leaf_paths(tr) if len(p) > 1]


# --------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------
TREE_BASELINE = dict(n_base=6, k_max=2, b_max=2)        # App. F.2: TreeRL's and AttnRL's papers'
                                                        # (6, 2, 2)


@dataclass(frozen=True)
class Method:
    name: str
    advantages: Callable                        # (tree, Â_base, Div_sib or None, α, scope)
                                                #  -> one advantage per block
    rollout: str = "tree"                       # tree | parallel
    expand: Callable | None = None              # (rewards of the N base responses, rng) -> indices
                                                # to fork
    paths: Callable | None = None               # tree -> trained root-to-leaf paths; None:
                                                # every token once
    embeds: bool = False
    filters: bool = False
    dynamic_batch: bool = False
    settings: dict = field(default_factory=dict)   # config values that define it
                                                   # (config.make_config)

    def rollout_shape(self, cfg) -> tuple[int, Callable, Callable | None]:
        """(responses per prompt, budget: V(root) -> (K̂, B̂), expand) for rollout.rollout_trees.
        The budget is Sec. 4.1's adaptive one (tree.adaptive_budget) unless --adaptive false:
        (K_max, B_max)."""
        if self.rollout == "parallel":
            return cfg.group_size, (lambda v: (0, 0)), None
        if cfg.adaptive:
            return (cfg.n_base, (lambda v: tree.adaptive_budget(v, cfg.k_max, cfg.b_max)),
                    self.expand)
        return cfg.n_base, (lambda v: (cfg.k_max, cfg.b_max)), self.expand

    def longest_response(self, cfg) -> int:
        """The most tokens generated after a prompt: one response, or a root-to-leaf path of a tree,
        which with --branch_length full reaches tree.max_path_tokens = 2·max_new_tokens − 1."""
        if self.rollout == "parallel":
            return cfg.max_new_tokens
        return tree.max_path_tokens(cfg.max_new_tokens, cfg.branch_length)

    def max_row_targets(self, cfg) -> int:
        """The most target tokens one trained sequence can hold: a block (≤ max_new_tokens,
        tree.branch_limit), or for path-trained methods a whole root-to-leaf path. Dr.GRPO's
        constant normaliser is this per sequence."""
        if self.paths is not None:
            return tree.max_path_tokens(cfg.max_new_tokens, cfg.branch_length)
        return cfg.max_new_tokens

    def trainable(self, tr: tree.Tree) -> bool:
        """AttnRL drops trees whose leaves all have the same reward (no signal: all-correct or
        all-wrong prompts) before the update, so they do not count in the loss normaliser or the
        batch. The other methods keep every tree: a zero-advantage row costs no compute but counts
        in Eq. DATPO's normaliser."""
        return not self.filters or len({b.reward for b in tr.blocks if b.terminal}) > 1


METHODS: dict[str, Method] = {m.name: m for m in [
    #      name       advantages    how it rolls out and trains; settings: what defines it
    #                               (App. F.2)
    Method("datpo",   datpo_rule,   embeds=True),           # settings: config.py's defaults,
                                                            # (4, 3, 4) etc.
    Method("grpo",    grpo_rule,    rollout="parallel",
           settings=dict(clip_high=0.28)),                  # clip-higher
    Method("drgrpo",  drgrpo_rule,  rollout="parallel", settings=dict(loss_norm="constant")),
    Method("treerl",  treerl_rule,  paths=leaf_paths,
           settings=dict(fork="tok-entropy", adaptive=False, **TREE_BASELINE)),
    Method("attnrl",  treerl_rule,  paths=branched_paths, expand=tree.attnrl_expansion,
           filters=True, dynamic_batch=True,
           settings=dict(fork="atb", adaptive=False, off_policy_steps=1, **TREE_BASELINE)),
]}


def method_of(cfg) -> Method:
    """The row of cfg.method."""
    if cfg.method not in METHODS:
        raise ValueError(f"--method: got {cfg.method!r}, expected one of {', '.join(METHODS)}")
    return METHODS[cfg.method]
