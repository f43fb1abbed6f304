"""The paper's baselines and ablations: method-specific pieces by hand, and every preset runs a step."""
import json
import math
import random

import pytest
import torch
from test_train import stand_in_reward

import config as C
import methods as M
import packing as P
import prompts
import rollout as R
import train
import tree as T


# ---- AttnRL's adaptive sampling and batch size ----------------------------------------------------------
def test_attnrl_expansion_by_hand():
    rng = random.Random(0)
    # acc = 0 → ⌈6·e^0⌉ = 6: every response; acc = 1/6 → ⌈6·e^(−1/6)⌉ = ⌈5.08⌉ = 6
    assert T.attnrl_expansion([0.0] * 6, rng) == [0, 1, 2, 3, 4, 5]
    assert T.attnrl_expansion([1.0, 0, 0, 0, 0, 0], rng) == [0, 1, 2, 3, 4, 5]
    # acc = 1/2 → ⌈6·e^(−1/2)⌉ = ⌈3.64⌉ = 4: the three correct ones (minority on a tie) + one wrong one
    chosen = T.attnrl_expansion([1.0, 1.0, 1.0, 0.0, 0.0, 0.0], rng)
    assert len(chosen) == 4 and {0, 1, 2} <= set(chosen)
    # acc = 5/6 → ⌈6·e^(−5/6)⌉ = ⌈2.61⌉ = 3: the one wrong response first, then two correct ones
    chosen = T.attnrl_expansion([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], rng)
    assert len(chosen) == 3 and 2 in chosen
    assert T.attnrl_expansion([1.0] * 6, rng) == []                    # all correct: filtered, not expanded


def test_attnrl_batch_size_by_hand():
    # kept half the target leaves → the raw target doubles the batch; EMA with λ = 0.9
    assert prompts.attnrl_batch_size(16, 240, 480, 0.9, cap=64) == math.ceil(0.1 * 32 + 0.9 * 16)   # 18
    assert prompts.attnrl_batch_size(16, 480, 480, 0.9, cap=64) == 16
    assert prompts.attnrl_batch_size(16, 0, 480, 0.9, cap=64) == 64                              # capped


def test_attnrl_filters_uniform_trees_and_trains_branched_paths_only():
    blocks = [T.Block(None, [5, 6], [0, 0], base=0),
              T.Block(0, [7], [0], reward=1.0, base=0, start=2),
              T.Block(0, [8, 9], [0, 0], reward=0.0, base=0, start=2, branch=True),
              T.Block(None, [3], [0], reward=0.0, base=1)]                     # an unbranched response
    tr = T.Tree("p", [1], "a", blocks, v_root=0.5, k_hat=1, b_hat=1)
    assert M.METHODS["attnrl"].trainable(tr) and M.METHODS["datpo"].trainable(tr)
    tt = train.train_tree(tr, [0.1, 0.2, 0.3, 0.4], M.METHODS["attnrl"])
    rows = P.unit_rows(tt, tt.trained, P.token_offsets([tt])[0])
    assert [r.ids for r in rows] == [[1, 5, 6, 7], [1, 5, 6, 8, 9]]
    assert tt.weights == [2.0, 1.0, 1.0, 0.0]                                # the unbranched response: 0
    # TreeRL keeps it
    assert train.train_tree(tr, [0.1, 0.2, 0.3, 0.4], M.METHODS["treerl"]).weights == [2.0, 1.0, 1.0, 1.0]
    uniform = T.Tree("p", [1], "a", [T.Block(None, [3], [0], reward=1.0),
                                     T.Block(None, [4], [0], reward=1.0)],
                     v_root=1.0, k_hat=0, b_hat=0)
    assert not M.METHODS["attnrl"].trainable(uniform) and M.METHODS["treerl"].trainable(uniform)


def test_grpo_clip_is_asymmetric():
    cfg = C.make_config("grpo")
    assert cfg.clip_high > cfg.clip_low
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.25, 0.75]))                # +25 % and −25 %
    adv = torch.tensor([1.0, -1.0])
    _, active = train.clipped_objective(new, old, adv, cfg.clip_low, cfg.clip_high)
    assert active.tolist() == [False, True]                    # 1.25 < 1 + 0.28 passes; 0.75 < 1 − 0.2 clips
    _, symmetric = train.clipped_objective(new, old, adv, 0.2, 0.2)
    assert symmetric.tolist() == [True, True]


# ---- every method and every preset runs one step at tiny scale -----------------------------------------
@pytest.mark.parametrize("preset", sorted(C.PRESETS))
def test_every_preset_runs_a_step_at_tiny_scale(preset, tmp_path, monkeypatch):
    monkeypatch.setattr(R, "compute_reward", stand_in_reward)
    run = train.main(["--preset", preset, "--scale", "tiny", "--steps", "1", "--out_dir", str(tmp_path),
                      "--embed_model", "all-minilm-l6-v2"])  # the embedding ablations' models need the hub
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    cfg = C.make_config(preset, "tiny")
    assert json.loads((run / "config.json").read_text())["method"] == cfg.method
    assert record["step"] == 1 and math.isfinite(record["loss"]) and record["generated_tokens_per_prompt"] > 0
    n = cfg.group_size if cfg.method in ("grpo", "drgrpo") else cfg.n_base
    assert record["leaves_per_prompt"] >= n
    if cfg.method in ("grpo", "drgrpo"):
        assert record["leaves_per_prompt"] == n                 # parallel sampling: no branches
    # fixed tree: N(1 + KB) leaves when long enough
    if cfg.method == "treerl":
        assert record["leaves_per_prompt"] == cfg.n_base * (1 + cfg.k_max * cfg.b_max)
