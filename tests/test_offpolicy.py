"""offpolicy.py and --off_policy_steps 1: the in-flight batch's bookkeeping, the loss's old log-probs for
stale tokens (the behaviour policy's), and whole tiny runs: which weights sampled which tokens (checked
against the saved checkpoints), no stale data at the first step, no wasted batch at the last, resume
exactness."""
import json
import random

import pytest
import torch

import config as C
import methods
import models
import offpolicy
import packing as P
import train
import tree as T
from engine import Sample


# --------------------------------------------------------------------------------------------------------
# Bookkeeping
# --------------------------------------------------------------------------------------------------------
def _batch():
    bases = [[Sample([5, 6, 2], [0.5, 0.25, 0.0], [-0.7, -1.4, -0.01])] * 2, [Sample([7], [0.1], [-2.3])] * 2]
    return offpolicy.Batch(["p0", "p1"], ["1", "2"], [1, None], bases, sampled_at=3)


def test_batch_survives_a_checkpoint_and_shards_by_prompt(tmp_path):
    batch = _batch()
    torch.save({"ahead": batch.to_state()}, tmp_path / "state.pt")
    again = offpolicy.Batch.from_state(torch.load(tmp_path / "state.pt", weights_only=False)["ahead"])
    assert again == batch and json.loads(json.dumps(batch.to_state())) == batch.to_state()
    # the checkpoint holds plain lists, a base response as [tokens, entropies, logprobs], as before Samples
    assert batch.to_state()["bases"][0][0] == [[5, 6, 2], [0.5, 0.25, 0.0], [-0.7, -1.4, -0.01]]
    assert all(isinstance(s, Sample) for per in again.bases for s in per)
    assert offpolicy.Batch.from_state(None) is None
    second = batch.shard(1, 2)
    assert (second.prompts, second.answers, second.levels, second.bases, second.sampled_at) == \
        (["p1"], ["2"], [None], [batch.bases[1]], 3)
    assert batch.lag(4) == 1                                           # trained one update after sampling
    assert offpolicy.Batch(["p"], ["a"], [None]).lag(7) == 0            # sampled in its own step: on-policy


@pytest.mark.parametrize("off,step,steps,expected", [(0, 0, 3, False), (1, 0, 3, True), (1, 1, 3, True),
                                                      (1, 2, 3, False), (1, 0, 1, False)])
def test_the_next_batch_is_sampled_only_when_a_later_step_trains_it(off, step, steps, expected):
    assert offpolicy.wants_next_batch(off, step, steps) is expected


def test_stale_log_probs_are_those_of_base_blocks_only():
    is_base, logprobs = [True, True, False], [[-1.0, -2.0], [-0.5], [-0.3]]
    assert offpolicy.stale_logprobs(is_base, logprobs, 0) == [None, None, None]
    assert offpolicy.stale_logprobs(is_base, logprobs, 1) == [[-1.0, -2.0], [-0.5], None]
    with pytest.raises(ValueError, match=r"base blocks \[1\].*--rollout_engine engine"):
        offpolicy.stale_logprobs(is_base, [[-1.0, -2.0], None, None], 1)


def test_config_refuses_other_lags_and_the_generate_engine_and_presets_turn_it_on():
    with pytest.raises(ValueError, match="--off_policy_steps: got 2"):
        C.make_config("tiny", off_policy_steps=2)
    with pytest.raises(ValueError, match="--rollout_engine engine"):
        C.make_config("tiny", off_policy_steps=1, rollout_engine="generate")
    assert (C.make_config("attnrl").off_policy_steps == 1
            and C.make_config("datpo-off-policy").off_policy_steps == 1)
    assert (C.make_config("attnrl", "demo").off_policy_steps == 1
            and C.make_config("paper").off_policy_steps == 0)


# --------------------------------------------------------------------------------------------------------
# The loss: π_θold of a stale token is the policy that sampled it
# --------------------------------------------------------------------------------------------------------
def _update(tok, trees, seed=1):
    model = models.tiny_random_model(len(tok), seed=seed)
    cfg = C.make_config("tiny", mini_batch_size=4, micro_batch_size=4, ppo_epochs=1, clip_low=0.2,
                        clip_high=0.28)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train.ppo_update(model, opt, trees, cfg, tok.pad_token_id, "cpu", random.Random(0))
    return model, stats


def _logprobs(tok, prompt, tokens, seed=1):
    model = models.tiny_random_model(len(tok), seed=seed).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_stale_tokens_ratio_is_against_the_behaviour_log_probs(smollm_tokenizer):
    tok = smollm_tokenizer
    prompt = tok("What is 3 + 4?", add_special_tokens=False).input_ids
    stale, fresh = [101, 202, 303, 404], [505, 606, 707]

    def tree(adv_stale, behaviour):
        return [P.TrainTree(prompt, [None, None], [stale, fresh], [adv_stale, 1.0], [1.0, 1.0],
                            behaviour=[behaviour, None] if behaviour is not None else None)]

    exact = _logprobs(tok, prompt, stale)
    plain, s_plain = _update(tok, tree(1.0, None))
    same, s_same = _update(tok, tree(1.0, exact))          # behaviour = θ itself: ratio 1, the same update
    assert s_plain["clip_frac"] == s_same["clip_frac"] == 0.0
    for a, b in zip(plain.parameters(), same.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)

    # the sampler gave the stale tokens 1 nat less: ratio e > 1 + 0.28 with A > 0, so the clip cuts
    # their gradient
    older, s_older = _update(tok, tree(1.0, [lp - 1.0 for lp in exact]))
    assert s_older["clip_frac"] == pytest.approx(len(stale) / (len(stale) + len(fresh)))
    no_signal, _ = _update(tok, tree(0.0, None))            # the same gradient: only the fresh block's
    for a, b in zip(older.parameters(), no_signal.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert any(not torch.allclose(a, b) for a, b in zip(older.parameters(), plain.parameters()))


def test_train_tree_carries_behaviour_log_probs_of_stale_base_blocks():
    blocks = [T.Block(None, [10, 11], [0.1, 0.2], base=0, start=0),
              T.Block(0, [12], [0.3], reward=1.0, base=0, start=2),
              T.Block(0, [20, 21], [0.4, 0.5], reward=0.0, base=0, start=2, branch=True)]
    for b, lp in zip(blocks, ([-0.1, -0.2], [-0.3], [-0.4, -0.5])):
        b.logprobs = lp
    tr = T.Tree("p", [1, 2], "a", blocks, v_root=1.0, k_hat=1, b_hat=1, forks=[[2]])
    datpo = methods.METHODS["datpo"]
    assert train.train_tree(tr, [0.0, 0.0, 0.0], datpo).behaviour is None          # on-policy
    tr.policy_lag = 1
    assert train.train_tree(tr, [0.0, 0.0, 0.0], datpo).behaviour == [[-0.1, -0.2], [-0.3], None]


# --------------------------------------------------------------------------------------------------------
# Whole tiny runs with --off_policy_steps 1
# --------------------------------------------------------------------------------------------------------
def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(tmp_path, monkeypatch, name, *flags):
    """A 3-step tiny run, one-step off-policy, a checkpoint every step; returns its folder and, per step, the
    trees it trained (captured from train.tree_rollouts)."""
    from test_train import stand_in_reward

    import rollout as R

    monkeypatch.setattr(R, "compute_reward", stand_in_reward)
    grown, real = [], train.tree_rollouts

    def keep(*args, **kwargs):
        out = real(*args, **kwargs)
        grown.append(out[0])
        return out

    monkeypatch.setattr(train, "tree_rollouts", keep)
    run = train.main(["--preset", "tiny", "--out_dir", str(tmp_path / name), "--steps", "3",
                      "--save_every", "1", "--off_policy_steps", "1", "--lr", "3e-2", "--alpha_start", "0",
                      *flags])
    return run, grown


def _path_logprobs(model, prompt, tokens):
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def _recorded_vs(tree, checkpoint):
    """Largest |recorded − recomputed| log-prob over the tree's base tokens and over its branch tokens, the
    recomputation a full forward of prompt + path under the checkpoint's weights."""
    model = models.load_policy(str(checkpoint), "cpu", torch.float32)[0].eval()
    base_gap = branch_gap = 0.0
    responses: dict[int, list[int]] = {}
    for b in tree.blocks:      # base blocks come in order, each response's pieces before its branches
        if not b.branch:
            responses.setdefault(b.base, []).extend(b.token_ids)
    for b in tree.blocks:
        prefix = responses[b.base][:b.start]      # the tokens before the block on its path
        got = _path_logprobs(model, tree.prompt_ids, prefix + b.token_ids)[len(prefix):]
        gap = max(abs(x - y) for x, y in zip(got, b.logprobs))
        if b.branch:
            branch_gap = max(branch_gap, gap)
        else:
            base_gap = max(base_gap, gap)
    return base_gap, branch_gap


def test_base_tokens_come_from_the_weights_one_update_back_and_branches_from_the_current(
        tmp_path, monkeypatch):
    run, grown = _run(tmp_path, monkeypatch, "a")
    records = [r for r in _read(run / "metrics.jsonl") if "eval" not in r]
    # the first step samples its own bases (nothing stale); later steps train bases sampled one update back
    assert [r["policy_lag"] for r in records] == [0, 1, 1]
    assert records[0]["stale_tokens"] == 0 and all(r["stale_tokens"] > 0 for r in records[1:])
    # the last step samples no batch it would never train; the others sample exactly the next step's
    assert [r["ahead_prompts"] for r in records] == [2, 2, 0]
    state = torch.load(run / "checkpoints" / "step_000003" / "trainer_state.pt", weights_only=False)
    assert state["ahead"] is None and state["cursor"] == 3 * 2
    assert torch.load(run / "checkpoints" / "step_000002" / "trainer_state.pt",
                      weights_only=False)["ahead"]["sampled_at"] == 1

    # step 3's base tokens were sampled by the weights saved after step 1, its branches by those after step 2
    trees = grown[2]
    assert any(b.branch for tr in trees for b in tr.blocks)
    for tr in trees:
        base_then, branch_then = _recorded_vs(tr, run / "checkpoints" / "step_000001")
        base_now, branch_now = _recorded_vs(tr, run / "checkpoints" / "step_000002")
        assert base_then < 1e-4 and branch_now < 1e-4
        assert base_now > 1e-3                  # not vacuous: the update moved those log-probs


def test_resume_with_a_batch_in_flight_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    run, _ = _run(tmp_path, monkeypatch, "full")
    records = [r for r in _read(run / "metrics.jsonl") if "eval" not in r]
    resumed = train.main(["--preset", "tiny", "--out_dir", str(tmp_path / "resumed"), "--steps", "3",
                          "--save_every", "1", "--off_policy_steps", "1", "--lr", "3e-2",
                          "--alpha_start", "0", "--resume", str(run / "checkpoints" / "step_000001")])
    again = [r for r in _read(resumed / "metrics.jsonl") if "eval" not in r]
    assert [r["step"] for r in again] == [2, 3]
    for mine, theirs in zip(again, records[1:]):
        for key in ("loss", "reward", "generated_tokens_per_prompt", "grad_norm", "policy_lag",
                    "stale_tokens"):
            assert mine[key] == theirs[key], key
    a = models.load_policy(str(run / "checkpoints" / "step_000003"), "cpu", torch.float32)[0]
    b = models.load_policy(str(resumed / "checkpoints" / "step_000003"), "cpu", torch.float32)[0]
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
