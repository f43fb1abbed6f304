"""methods.py: each row's rollout shape, trained paths and filter by hand; harness.loop.RunState saves and
restores whole."""
import dataclasses
import math
import random

import pytest
import torch

import advantage as A
import checks
import config as C
import methods as M
import release as release_py
import train
import tree as T
from harness import loop


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
    assert checks.METHODS is M.METHODS and {"datpo", "grpo", "drgrpo", "treerl", "attnrl"} <= set(M.METHODS)
    assert checks.FORKS is T.FORK_STRATEGIES and checks.BRANCH_LENGTHS is T.BRANCH_LENGTHS
    with pytest.raises(ValueError, match="--method"):
        M.method_of(C.Config(method="ppo"))


@pytest.mark.parametrize("name", [n for n in M.METHODS if n in C.PRESETS])
def test_method_flag_and_preset_are_the_same_run(name):
    """--method X brings the row's own settings (methods.py), so it equals --preset X but for the folder."""
    by_flag, by_preset = C.make_config("paper", method=name), C.make_config(name)
    assert dataclasses.replace(by_flag, out_dir=by_preset.out_dir) == by_preset
    assert {k: getattr(by_preset, k) for k in M.METHODS[name].settings} == M.METHODS[name].settings


def test_a_new_row_needs_no_other_edit(monkeypatch):
    """One more row is a method the command line, the checks and the presets accept, with its settings."""
    row = M.Method("treerl-wide", M.treerl_rule, paths=M.leaf_paths,
                   settings=dict(fork="tok-entropy", adaptive=False, n_base=4, k_max=3, b_max=4))
    monkeypatch.setitem(M.METHODS, row.name, row)
    cfg = C.make_config("tiny", method="treerl-wide")
    assert (cfg.fork, cfg.adaptive, cfg.n_base, cfg.k_max, cfg.b_max) == ("tok-entropy", False, 4, 3, 4)
    assert M.method_of(cfg) is row


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
    # AttnRL's row: fixed (K_max, B_max) (settings adaptive=False), picks the responses it expands
    attnrl = C.make_config("tiny", method="attnrl", k_max=3, b_max=4, n_base=5)
    n, budget, expand = M.METHODS["attnrl"].rollout_shape(attnrl)
    assert (n, budget(1.0), expand) == (5, (3, 4), T.attnrl_expansion)


def test_paths_weights_and_filter_by_hand():
    tr = _tree()
    assert M.METHODS["datpo"].paths is None and M.METHODS["grpo"].paths is None
    assert M.leaf_paths(tr) == [[0, 1], [0, 2], [3]]
    # not the unbranched response
    assert M.branched_paths(tr) == [[0, 1], [0, 2]]
    assert train.train_tree(tr, [0.0] * 4, M.METHODS["treerl"]).weights == [2.0, 1.0, 1.0, 1.0]
    assert train.train_tree(tr, [0.0] * 4, M.METHODS["attnrl"]).weights == [2.0, 1.0, 1.0, 0.0]
    assert M.METHODS["attnrl"].trainable(tr) and M.METHODS["treerl"].trainable(tr)
    flat = T.Tree("p", [1], "a", [T.Block(None, [1], [0], reward=1.0, base=0, start=0),
                                  T.Block(None, [2], [0], reward=1.0, base=1, start=0)], 1.0, 0, 0, [[], []])
    assert not M.METHODS["attnrl"].trainable(flat) and M.METHODS["datpo"].trainable(flat)
    cfg = C.make_config("tiny", max_new_tokens=10)
    # 2·10 − 1
    assert M.METHODS["treerl"].max_row_targets(cfg) == M.METHODS["datpo"].longest_response(cfg) == 19
    assert M.METHODS["datpo"].max_row_targets(cfg) == M.METHODS["grpo"].longest_response(cfg) == 10


def test_run_state_saves_and_restores_whole():
    import offpolicy
    import prompts
    from engine import Sample

    cfg = C.make_config("tiny")
    ahead = offpolicy.Batch(["q"], ["4"], [2], [[Sample([5, 6], [0.5, 0.1], [-0.7, -2.0])]], sampled_at=2)
    stream = prompts.PromptStream([], cfg, None, None)
    stream.cursor, stream.skipped, stream.batch_size, stream.too_long, stream.ahead = 17, 2, 5, {9, 2}, ahead
    run = loop.RunState(step=3, bad_steps_in_a_row=1, rng=random.Random(4), prompts=stream)
    run.rng.random()
    saved = run.trainer_state()
    # the checkpoint's fields, as before the prompt stream had its own file (old checkpoints resume)
    assert set(saved) == {"step", "cursor", "skipped_prompts", "batch_size", "bad_steps_in_a_row", "rng",
                          "too_long", "ahead"}
    expected = [run.rng.random() for _ in range(3)], torch.rand(2)
    back = loop.RunState(rng=random.Random(0), prompts=prompts.PromptStream([], cfg, None, None))
    back.restore(saved)
    assert (back.step, back.bad_steps_in_a_row) == (3, 1)
    assert (back.prompts.cursor, back.prompts.skipped, back.prompts.batch_size) == (17, 2, 5)
    assert back.prompts.too_long == {2, 9}          # a skipped problem is not named again after a resume
    # the next step's batch, its bases sampled (one-step off-policy)
    assert back.prompts.ahead == ahead
    got = [back.rng.random() for _ in range(3)], torch.rand(2)
    assert got[0] == expected[0] and torch.equal(got[1], expected[1])            # the same streams continue


def test_release_sibling_groups_embed_whole_responses_and_match_the_release_formula():
    """--sibling_groups release: embed_blocks adds one row per base response (its whole text) after the block
    rows, and release.tree_diversity reads them as release.release_sibling_diversity does (real MiniLM
    embedder)."""
    import numpy as np

    import models

    def block(parent, text, base, reward=None, branch=False):
        return T.Block(parent=parent, token_ids=[1], entropies=[0.0], text=text, reward=reward, base=base,
                       branch=branch)

    blocks = [block(None, "We add 3 and 4.", 0), block(0, " So the answer is 7.", 0, 1.0),
              block(0, " Then we multiply instead.", 0, 0.0, branch=True),
              block(0, " Adding gives seven.", 0, 1.0, branch=True),
              block(None, "The sum of 3 and 4 is 8.", 1, 0.0)]
    tr = T.Tree(prompt="p", prompt_ids=[1], answer="7", blocks=blocks, v_root=0.5, k_hat=1, b_hat=2)
    embedder = models.load_embedder("all-minilm-l6-v2")
    paper = A.embed_blocks(embedder, [tr], 8)[0]
    release = A.embed_blocks(embedder, [tr], 8, "release")[0]
    assert paper.shape[0] == 5 and release.shape[0] == 5 + 2
    whole = embedder.encode(["We add 3 and 4. So the answer is 7.", "The sum of 3 and 4 is 8."])
    assert np.allclose(release[5:], whole, atol=1e-5)
    assert np.allclose(release[:5], embedder.encode([b.text for b in blocks]), atol=1e-5)
    div = A.block_diversity(tr, release, "release")
    assert div == pytest.approx(release_py.release_sibling_diversity(
        tr.parents, tr.rewards, tr.branch_flags, [0, 0, 0, 0, 1], release[:5], release[5:]))
    assert div[1] == 0.0 and div[2] > 0 and div[3] > 0  # the base continuation is no sibling; branches are
    assert A.block_diversity(tr, paper) == pytest.approx(A.sibling_diversity(tr.parents, paper))
