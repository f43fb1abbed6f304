"""methods.py: each row's rollout shape, trained paths and filter by hand; train.RunState saves and restores whole."""
import math
import random

import pytest
import torch

import config as C
import methods as M
import train
import tree as T


def _tree():
    """Base response 0 forked once with two branches (rewards 1, 0), base response 1 unforked (reward 0)."""
    blocks = [
        T.Block(None, [10, 11], [0, 0], base=0, start=0),                                  # 0
        T.Block(0, [12], [0], reward=0.0, base=0, start=2),                                 # 1
        T.Block(0, [20], [0], reward=1.0, base=0, start=2, branch=True),                    # 2
        T.Block(None, [30, 31], [0, 0], reward=0.0, base=1, start=0),                      # 3
    ]
    return T.Tree("p", [1], "a", blocks, v_root=0.0, k_hat=1, b_hat=1, forks=[[2], []])


def test_every_method_is_one_row_and_config_accepts_exactly_those():
    assert C.METHODS == tuple(M.METHODS) == ("datpo", "grpo", "drgrpo", "treerl", "attnrl")
    assert C.FORKS is T.FORK_METHODS and C.BRANCH_BUDGETS is T.BRANCH_BUDGETS
    with pytest.raises(ValueError, match="--method"):
        M.method_of(C.Config(method="ppo"))


def test_rollout_shapes_by_hand():
    cfg = C.make_config("tiny", k_max=3, b_max=4, n_base=5, group_size=7)
    n, budget, expand = M.METHODS["datpo"].rollout_shape(cfg)
    assert (n, expand) == (5, None)
    assert budget(0.25) == (math.ceil(3 * 0.75), math.ceil(4 * 0.75)) == (3, 3)   # K̂, B̂ = ⌈K(1−V)⌉, ⌈B(1−V)⌉
    assert budget(1.0) == (0, 0)
    cfg.adaptive = False
    assert M.METHODS["datpo"].rollout_shape(cfg)[1](1.0) == (3, 4)                 # fixed (K_max, B_max)
    cfg.adaptive = True
    for name in ("grpo", "drgrpo"):                                               # G parallel responses
        n, budget, expand = M.METHODS[name].rollout_shape(cfg)
        assert (n, budget(0.0), expand) == (7, (0, 0), None)
    n, budget, expand = M.METHODS["attnrl"].rollout_shape(cfg)                    # always fixed, picks responses
    assert (n, budget(1.0), expand) == (5, (3, 4), T.attnrl_expansion)


def test_paths_weights_and_filter_by_hand():
    tr = _tree()
    assert M.METHODS["datpo"].paths is None and M.METHODS["grpo"].paths is None
    assert M.leaf_paths(tr) == [[0, 1], [0, 2], [3]]
    assert M.branched_paths(tr) == [[0, 1], [0, 2]]                               # not the unbranched response
    assert train.train_tree(tr, [0.0] * 4, "treerl").weights == [2.0, 1.0, 1.0, 1.0]
    assert train.train_tree(tr, [0.0] * 4, "attnrl").weights == [2.0, 1.0, 1.0, 0.0]
    assert M.METHODS["attnrl"].trainable(tr) and M.METHODS["treerl"].trainable(tr)
    flat = T.Tree("p", [1], "a", [T.Block(None, [1], [0], reward=1.0, base=0, start=0),
                                  T.Block(None, [2], [0], reward=1.0, base=1, start=0)], 1.0, 0, 0, [[], []])
    assert not M.METHODS["attnrl"].trainable(flat) and M.METHODS["datpo"].trainable(flat)
    cfg = C.make_config("tiny", max_new_tokens=10)
    assert M.METHODS["treerl"].max_row_targets(cfg) == M.METHODS["datpo"].longest_response(cfg) == 19   # 2·10 − 1
    assert M.METHODS["datpo"].max_row_targets(cfg) == M.METHODS["grpo"].longest_response(cfg) == 10


def test_run_state_saves_and_restores_whole():
    run = train.RunState(step=3, cursor=17, skipped_prompts=2, batch_size=5, bad_steps_in_a_row=1,
                         rng=random.Random(4), too_long={9, 2})
    run.rng.random()
    saved = run.trainer_state()
    assert set(saved) == {"step", "cursor", "skipped_prompts", "batch_size", "bad_steps_in_a_row", "rng",
                          "too_long"}
    expected = [run.rng.random() for _ in range(3)], torch.rand(2)
    back = train.RunState(rng=random.Random(0))
    back.restore(saved)
    assert (back.step, back.cursor, back.skipped_prompts, back.batch_size, back.bad_steps_in_a_row) == (3, 17, 2, 5, 1)
    assert back.too_long == {2, 9}                  # a skipped problem is not named again after a resume
    got = [back.rng.random() for _ in range(3)], torch.rand(2)
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])            # the same streams continue
