"""train.py: what each method trains, the clipped objective by hand, an update on a tiny model, skipping
zero-advantage rows, checkpoints and resume equivalence, metrics."""
import hashlib
import json
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

import config as C
import methods as M
import models
import packing as P
import prompts
import rollout as R
import train
import tree as T


def _tree():
    """Prompt [1, 2]; base response 0 = [10..15] forked at 2 and 4, one branch at each fork; base 1
    unforked."""
    blocks = [
        T.Block(None, [10, 11], [0, 0], base=0, start=0),                    # 0
        T.Block(0, [12, 13], [0, 0], base=0, start=2),                       # 1
        T.Block(1, [14, 15], [0, 0], reward=0.0, base=0, start=4),           # 2
        T.Block(0, [20, 21, 22], [0] * 3, reward=1.0, base=0, start=2, branch=True),   # 3
        T.Block(1, [30], [0], reward=1.0, base=0, start=4, branch=True),     # 4
        T.Block(None, [40, 41, 42], [0] * 3, reward=0.0, base=1, start=0),   # 5
    ]
    return T.Tree("p", [1, 2], "a", blocks, v_root=0.0, k_hat=2, b_hat=1, forks=[[2, 4], []])


def test_datpo_rows_train_every_token_once_with_its_block_advantage():
    tr = _tree()
    adv = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    tt = train.train_tree(tr, adv, M.METHODS["datpo"])
    assert tt.weights == [1.0] * 6 and tt.paths is None
    offsets = P.token_offsets([tt])[0]
    rows = P.unit_rows(tt, tt.trained, offsets)
    assert [(r.ids, r.n_context) for r in rows] == [
        ([1, 2, 10, 11, 12, 13, 14, 15], 2),       # base response 0: all its base blocks
        ([1, 2, 10, 11, 20, 21, 22], 4),           # branch at 2: prefix is context only
        ([1, 2, 10, 11, 12, 13, 30], 6),           # branch at 4
        ([1, 2, 40, 41, 42], 2),                   # base response 1
    ]
    flat_adv = [a for a, b in zip(adv, tr.blocks) for _ in b.token_ids]
    assert [flat_adv[g] for g in rows[0].gidx] == [0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    assert [flat_adv[g] for g in rows[1].gidx] == [0.4] * 3 and [flat_adv[g] for g in rows[2].gidx] == [0.5]
    assert sorted(g for r in rows for g in r.gidx) == list(range(tr.generated_tokens))   # each token once


def test_treerl_rows_are_root_to_leaf_paths_with_repeated_prefixes():
    tr = _tree()
    tt = train.train_tree(tr, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], M.METHODS["treerl"])
    assert tt.paths == [[0, 1, 2], [0, 3], [0, 1, 4], [5]]
    assert tt.weights == [3.0, 2.0, 1.0, 1.0, 1.0, 1.0]                  # paths through each block
    rows = P.unit_rows(tt, tt.trained, P.token_offsets([tt])[0])
    assert len(rows) == tr.leaves == 4
    assert rows[1].ids == [1, 2, 10, 11, 20, 21, 22] and rows[1].weights == [1.0] * 5
    assert sum(r.n_targets for r in rows) > tr.generated_tokens          # shared prefixes counted again
    assert sum(r.n_targets for r in rows) == sum(w * len(b.token_ids) for w, b in zip(tt.weights, tr.blocks))


def test_rows_and_constant_normaliser_hold_paths_longer_than_max_new_tokens():
    # max_new_tokens = 4: base [10, 11, 12, 13] forked at f = 3 (keeps 10, 11, 12) and, with the full branch
    # budget, a branch of 4 new tokens: its root-to-leaf path has 7 > 4 tokens (tree.max_path_tokens = 7)
    blocks = [T.Block(None, [10, 11, 12], [0] * 3, base=0, start=0),
              T.Block(0, [13], [0], reward=0.0, base=0, start=3),
              T.Block(0, [20, 21, 22, 23], [0] * 4, reward=1.0, base=0, start=3, branch=True)]
    tr = T.Tree("p", [1, 2], "a", blocks, v_root=0.0, k_hat=1, b_hat=1, forks=[[3]])
    tt = train.train_tree(tr, [0.1, 0.2, 0.3], M.METHODS["datpo"])
    rows = P.unit_rows(tt, tt.trained, P.token_offsets([tt])[0])
    assert [(r.ids, r.n_context) for r in rows] == [([1, 2, 10, 11, 12, 13], 2),
                                                    ([1, 2, 10, 11, 12, 20, 21, 22, 23], 5)]
    flat = train.train_tree(tr, [0.1, 0.2, 0.3], M.METHODS["treerl"])
    paths = P.unit_rows(flat, flat.trained, P.token_offsets([flat])[0])
    assert max(r.n_targets for r in paths) == 7 and paths[1].gidx == [0, 1, 2, 4, 5, 6, 7]
    cfg = C.make_config("tiny", max_new_tokens=4, loss_norm="constant")
    assert cfg.branch_length == "full"
    # DATPO: 3 blocks of ≤ max_new_tokens each; TreeRL: 2 paths of up to 2·4 − 1 tokens
    assert P.loss_normaliser([tt], [(0, (0, 1, 2))], cfg.loss_norm, 4,
                             M.method_of(cfg).max_row_targets(cfg)) == 3 * 4
    cfg.method = "treerl"
    assert P.loss_normaliser([flat], [(0, (0, 1, 2))], cfg.loss_norm, 4,
                             M.method_of(cfg).max_row_targets(cfg)) == 2 * 7
    assert all(r.n_targets <= M.method_of(cfg).max_row_targets(cfg) for r in paths)
    cfg.branch_length = "remaining"
    assert M.method_of(cfg).max_row_targets(cfg) == 4


def test_prompts_are_kept_unless_they_cannot_fit_the_context():
    cfg = C.make_config("tiny", max_new_tokens=100)
    assert cfg.max_prompt_tokens == 512                                  # the tiny scale's filter, unchanged
    assert C.make_config("paper").max_prompt_tokens == 0                 # paper scale: nothing skipped
    prompts.check_fits(1849, cfg, 2048, "x")                               # 1849 + (2·100 − 1) = 2048 fits
    with pytest.raises(ValueError,
                       match=r"arith problem #7: the prompt is 1850 tokens and up to 199 new tokens"):
        prompts.check_fits(1850, cfg, 2048, "arith problem #7")
    cfg.branch_length = "remaining"
    prompts.check_fits(1948, cfg, 2048, "x")                               # paths stay within 100
    prompts.check_fits(10 ** 6, cfg, None, "x")                            # no known context: no check


def test_clipped_objective_by_hand():
    old = torch.log(torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5]))
    ratio = torch.tensor([1.1, 1.5, 0.7, 0.5, 1.5])
    new = old + torch.log(ratio)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0, -2.0])
    obj, active = train.clipped_objective(new, old, adv, clip_low=0.2, clip_high=0.28)
    expected = [
        1.1 * 1.0,                   # inside the range
        min(1.5, 1.28) * 1.0,        # above 1+ε_high with A > 0 → clipped to 1.28
        min(-0.7, -0.8),             # below 1−ε_low with A < 0 → min(ρA, clip(ρ)A) = −0.8
        min(0.5, 0.8) * 1.0,         # below the range with A > 0 → unclipped ρA = 0.5 is the min
        min(-3.0, -2.56),            # above the range with A < 0 → −3.0 (no clip, pessimistic)
    ]
    assert obj.tolist() == pytest.approx(expected)
    assert active.tolist() == [False, True, True, False, False]


def _group(tokenizer, adv_sign=(1.0, -1.0, 0.0)):
    """A GRPO group — a tree of depth one: one prompt, one response per advantage."""
    prompt = tokenizer("What is 3 + 4?", add_special_tokens=False).input_ids
    gen = torch.Generator().manual_seed(0)
    responses = [torch.randint(100, 1000, (5 + i,), generator=gen).tolist() for i in range(len(adv_sign))]
    return P.TrainTree(prompt, [None] * len(responses), responses, list(adv_sign), [1.0] * len(responses))


def _rows(tt):
    return P.unit_rows(tt, tt.trained, P.token_offsets([tt])[0])


def test_update_changes_weights_and_lowers_the_surrogate_loss(tiny_policy):
    _, tok = tiny_policy
    model = models.tiny_random_model(len(tok), seed=1)
    cfg = C.make_config("tiny", lr=1e-2, mini_batch_size=8, micro_batch_size=2)
    tt = _group(tok)
    rows = _rows(tt)
    n_tokens = sum(len(t) for t in tt.tokens)
    with torch.no_grad():
        old = P.row_logprobs(model, rows, tok.pad_token_id, "cpu")

    def surrogate():
        with torch.no_grad():
            new = P.row_logprobs(model, rows, tok.pad_token_id, "cpu")
        adv = torch.tensor([tt.advantages[b] for b in tt.trained if tt.advantages[b] for _ in tt.tokens[b]])
        obj, _ = train.clipped_objective(torch.cat(new), torch.cat(old), adv, cfg.clip_low, cfg.clip_high)
        return float(-obj.sum() / n_tokens)

    before = surrogate()
    weights = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    stats = train.ppo_update(model, opt, [tt], cfg, tok.pad_token_id, "cpu", random.Random(0))
    assert stats["optimizer_steps"] == 1 and stats["trained_blocks"] == 2
    assert stats["loss"] == pytest.approx(before, abs=1e-6)     # first step: ratio 1, loss = −mean(A)
    assert stats["unique_tokens"] == len(tt.prompt_ids) + n_tokens
    assert stats["forwarded_tokens"] == len(tt.prompt_ids) + 5 + 6  # the zero-advantage response is skipped
    assert any(not torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert surrogate() < before - 1e-3


def test_zero_advantage_blocks_cost_no_forward(tiny_policy, monkeypatch):
    _, tok = tiny_policy
    model = models.tiny_random_model(len(tok), seed=1)
    cfg = C.make_config("tiny", mini_batch_size=8, micro_batch_size=8)
    seen = []
    real = P.packed_logprobs

    def counting(model, packed, *args, **kwargs):
        seen.append(list(packed.input_ids))
        return real(model, packed, *args, **kwargs)

    monkeypatch.setattr(P, "packed_logprobs", counting)
    tt = _group(tok, adv_sign=(1.0, 0.0, 0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train.ppo_update(model, opt, [tt], cfg, tok.pad_token_id, "cpu", random.Random(0))
    assert seen == [tt.prompt_ids + tt.tokens[0]] and stats["trained_blocks"] == 1
    # the zero blocks still count in the token normaliser: loss = −A·n0 / (n0 + n1 + n2)
    assert stats["loss"] == pytest.approx(-len(tt.tokens[0]) / sum(len(t) for t in tt.tokens), abs=1e-6)
    seen.clear()
    weights = [p.detach().clone() for p in model.parameters()]
    stats = train.ppo_update(model, opt, [_group(tok, adv_sign=(0.0, 0.0, 0.0))], cfg, tok.pad_token_id,
                             "cpu", random.Random(0))
    assert seen == [] and stats["optimizer_steps"] == 0
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))


def stand_in_reward(text, answer, fallback=False):
    """A deterministic stand-in grader for the random tiny model (which never writes a right answer):
    half of all texts score 1, decided by a hash of the text, so trees get mixed rewards and non-zero
    advantages. Used only to exercise the training loop's mechanics."""
    return float(hashlib.sha256(text.encode()).digest()[0] % 2)


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tiny_run_writes_metrics_and_a_loadable_checkpoint_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "compute_reward", stand_in_reward)
    run = train.main(["--preset", "tiny", "--out_dir", str(tmp_path / "full"), "--save_every", "1"])
    records = _read(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward", "v_root", "leaves_per_prompt", "generated_tokens_per_prompt", "loss", "clip_frac",
                "policy_entropy", "grad_norm", "alpha", "seconds_generation", "seconds_embedding",
                "seconds_update"):
        assert all(math.isfinite(r[key]) for r in records), key
    assert records[0]["optimizer_steps"] >= 1 and records[0]["loss"] != 0.0
    assert json.loads((run / "config.json").read_text())["model"] == "tiny-random"
    assert (run / "git_commit.txt").read_text().strip()
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    assert latest.name == "step_000002" and not list((run / "checkpoints").glob(".tmp*"))
    reloaded = AutoModelForCausalLM.from_pretrained(latest)
    assert sum(p.numel() for p in reloaded.parameters()) > 0

    # resume from the step-1 checkpoint: the next step repeats the uninterrupted run's step 2 exactly
    resumed = train.main(["--preset", "tiny", "--out_dir", str(tmp_path / "resumed"),
                          "--resume", str(run / "checkpoints" / "step_000001")])
    (again,) = _read(resumed / "metrics.jsonl")
    assert again["step"] == 2
    for key in ("loss", "reward", "generated_tokens_per_prompt", "grad_norm"):
        assert again[key] == records[1][key], key
    assert json.loads((resumed / "config.json").read_text())["resume"].endswith("step_000001")

    # resuming in the run's own folder after a crash past the checkpoint: the redone step replaces its line
    train.main(["--preset", "tiny", "--out_dir", str(run), "--resume",
                str(run / "checkpoints" / "step_000001")])
    redone = _read(run / "metrics.jsonl")
    assert [r["step"] for r in redone] == [1, 2] and redone[1]["loss"] == records[1]["loss"]


def test_same_seed_same_first_step_and_no_embedder_without_alpha(tmp_path, monkeypatch):
    monkeypatch.setattr(R, "compute_reward", stand_in_reward)

    def no_embedder(*args, **kwargs):
        raise AssertionError("the embedding model must not load when alpha is 0 for the whole run")

    monkeypatch.setattr(models, "load_embedder", no_embedder)
    firsts = []
    for name in ("a", "b"):
        run = train.main(["--preset", "tiny", "--steps", "1", "--alpha_start", "0", "--out_dir",
                          str(tmp_path / name)])
        firsts.append(_read(run / "metrics.jsonl")[0])
    for key in ("loss", "reward", "generated_tokens_per_prompt", "leaves_per_prompt", "grad_norm"):
        assert firsts[0][key] == firsts[1][key], key
