"""rollout.py on a tiny random model: entropies, tree shape, block/path invariants, and the generate path's
KV-cache reuse (engine/generate.py) checked against an independent re-prefilled path."""
import random
import types
import warnings

import pytest
import torch

import config
import data
import engine as E
import models
import rollout as R
import tree as T
from engine import generate as G


def _cfg(**overrides):
    base = dict(n_base=4, k_max=3, b_max=4, fork="tok-entropy", max_new_tokens=12, gen_batch_size=8,
                branch_chunk_size=16)
    base.update(overrides)
    return config.make_config("tiny", **base)


class RecordingReward:
    """Replaces reward.compute_reward: the first `correct` calls per answer return 1 (so the N base responses
    — graded first — set V(root) = correct / N), and every graded text is recorded."""

    def __init__(self, correct: dict):
        self.correct, self.calls, self.texts = correct, {}, []

    def __call__(self, text, answer, fallback=False):
        self.texts.append((answer, text))
        k = self.calls.get(answer, 0)
        self.calls[answer] = k + 1
        return 1.0 if k < self.correct.get(answer, 0) else 0.0


@pytest.mark.parametrize("correct", [0, 1, 2, 3, 4])
def test_leaf_count_follows_difficulty(tiny_policy, monkeypatch, correct):
    model, tok = tiny_policy
    grader = RecordingReward({"7": correct})
    monkeypatch.setattr(R, "compute_reward", grader)
    torch.manual_seed(correct)
    trees, stats = R.rollout_trees(model, tok, ["What is 3 + 4?"], ["7"], _cfg(), random.Random(0))
    (t,) = trees
    k_hat, b_hat = T.adaptive_budget(correct / 4, 3, 4)
    assert t.v_root == correct / 4 and (t.k_hat, t.b_hat) == (k_hat, b_hat)
    for j in range(4):
        base_response = [x for b in t.blocks if b.base == j and not b.branch for x in b.token_ids]
        assert len(base_response) >= 4             # long enough for K̂ forks (random 2-layer model, seeded)
        assert len(t.forks[j]) == k_hat
    assert t.leaves == 4 * (1 + k_hat * b_hat)      # N(1 + K̂B̂): 52, 40, 20, 8, 4
    assert t.generated_tokens == stats.base_tokens + stats.branch_tokens
    assert t.pass_rate == float(correct > 0)


def test_blocks_partition_tokens_and_paths_rebuild_responses(tiny_policy, monkeypatch):
    model, tok = tiny_policy
    grader = RecordingReward({"7": 1, "12": 0})
    monkeypatch.setattr(R, "compute_reward", grader)
    torch.manual_seed(1)
    prompts = ["What is 3 + 4?", "What is 5 + 7? Think."]
    trees, stats = R.rollout_trees(model, tok, prompts, ["7", "12"], _cfg(k_max=2, b_max=2), random.Random(1))
    for prompt, t in zip(prompts, trees):
        assert t.prompt_ids == tok(prompt, add_special_tokens=False).input_ids
        children = {i: [c for c, b in enumerate(t.blocks) if b.parent == i] for i in range(len(t.blocks))}
        for i, b in enumerate(t.blocks):
            assert b.terminal == (not children[i])          # leaves carry the reward, inner blocks do not
            assert len(b.entropies) == len(b.token_ids) > 0
            if b.parent is not None:                        # a child starts where its parent ends
                parent = t.blocks[b.parent]
                assert b.start == parent.start + len(parent.token_ids)
        # each base response's chain of base blocks is cut at exactly its forks; each branch hangs off the
        # base block that ends at its fork
        for j, forks in enumerate(t.forks):
            chain = [b for b in t.blocks if b.base == j and not b.branch]
            assert [b.start for b in chain] == [0] + forks
            for b in t.blocks:
                if b.base == j and b.branch:
                    assert b.start in forks and (t.blocks[b.parent].start
                                                 + len(t.blocks[b.parent].token_ids) == b.start)
    # every graded text is the decoding of exactly one root-to-leaf path rebuilt from the blocks, and back
    decoded = sorted((t.answer, tok.decode(T.path_token_ids(t.blocks, leaf), skip_special_tokens=True))
                     for t in trees for leaf, b in enumerate(t.blocks) if b.terminal)
    assert decoded == sorted(grader.texts)


def test_recorded_entropy_matches_an_independent_forward(tiny_policy):
    model, tok = tiny_policy
    sampler = R.Sampler.from_config(model, tok, _cfg())
    prompt = tok("Compute 12 * 3.", add_special_tokens=False).input_ids
    torch.manual_seed(3)
    base = R.sample_base(sampler, [prompt, prompt[:3]], n=2, max_new_tokens=8)
    for row in range(4):
        ids = base.prompt_ids[row] + base.tokens[row]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        p = len(base.prompt_ids[row])
        expected = G.entropy_of(logits[p - 1:p - 1 + len(base.tokens[row])])
        assert torch.allclose(torch.tensor(base.entropies[row]), expected, atol=1e-4)
        logp = torch.log_softmax(logits[p - 1:p - 1 + len(base.tokens[row])], -1)
        assert torch.allclose(torch.tensor(base.logprobs[row]),
                              logp[torch.arange(len(base.tokens[row])), base.tokens[row]], atol=1e-4)


def test_cached_branch_logits_match_reprefilled_prefix(tiny_policy):
    model, tok = tiny_policy
    sampler = R.Sampler.from_config(model, tok, _cfg(rollout_engine="generate"))
    prompts = [tok("What is 3 + 4?", add_special_tokens=False).input_ids,
               tok("Add 10 and 25, then explain.", add_special_tokens=False).input_ids]
    torch.manual_seed(5)
    base = R.sample_base(sampler, prompts, n=2, max_new_tokens=10, keep_cache=True)
    rows, forks = [0, 1, 2, 3, 3], [1, 4, 7, 2, 9]            # different prompt and prefix lengths → padding
    for r, f in zip(rows, forks):
        prefix = base.prompt_ids[r] + base.tokens[r][:f]
        with torch.no_grad():
            reference = model(torch.tensor([prefix])).logits[0, -1]
            reused = model.get_output_embeddings()(base.hidden[f][r])
        assert (reference - reused).abs().max().item() < 1e-4
    # the sliced cache continues each prefix exactly like a fresh prefill of prefix + next token
    cache, width = G.slice_prefix_cache(model, base, rows, forks)
    nxt = [base.tokens[r][f] for r, f in zip(rows, forks)]
    prefixes = [base.prompt_ids[r] + base.tokens[r][:f] for r, f in zip(rows, forks)]
    ids, mask = G.left_pad([p + [t] for p, t in zip(prefixes, nxt)], tok.pad_token_id, "cpu")
    assert ids.shape[1] == width + 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cached = model(input_ids=ids[:, -1:], attention_mask=mask, position_ids=positions[:, -1:],
                       **{models.cache_arg(model): cache}).logits[:, -1]
        for j, (p, t) in enumerate(zip(prefixes, nxt)):
            fresh = model(torch.tensor([p + [t]])).logits[0, -1]
            assert (fresh - cached[j]).abs().max().item() < 1e-4


@pytest.mark.parametrize("budget", ["full", "remaining"])
def test_cached_and_naive_branches_sample_the_same_tokens(tiny_policy, budget):
    """Branches from the base response's sliced KV cache and saved hidden state sample what HF generate from
    the whole prefix samples (re-prefilling prompt + response[:f] for every branch, as the authors' release
    does: the oracle, here in the test)."""
    model, tok = tiny_policy
    sampler = R.Sampler.from_config(model, tok, _cfg(rollout_engine="generate"))
    prompts = [tok("What is 3 + 4?", add_special_tokens=False).input_ids,
               tok("Add 10 and 25.", add_special_tokens=False).input_ids]
    torch.manual_seed(11)
    base = R.sample_base(sampler, prompts, n=2, max_new_tokens=10, keep_cache=True)
    requests = [E.BranchRequest(row, f, count, T.branch_limit(10, f, budget))
                for row, f, count in [(0, 3, 2), (1, 1, 1), (3, 8, 3)]]
    counters = {}
    torch.manual_seed(123)
    cached = G.sample_branches(sampler, base, requests, chunk_size=4, counters=counters)
    torch.manual_seed(123)
    jobs = [q for q in requests for _ in range(q.count)]    # one branch per job, chunks of 4 as above
    flat = []
    for i in range(0, len(jobs), 4):
        chunk = jobs[i:i + 4]
        prefixes = [base.prompt_ids[q.base] + base.tokens[q.base][:q.fork] for q in chunk]
        ids, mask = G.left_pad(prefixes, sampler.pad_id, sampler.device)
        flat += G.hf_generate(sampler, ids, mask, [q.limit for q in chunk])[0]
    naive = [[flat.pop(0) for _ in range(q.count)] for q in requests]
    assert counters["recomputed_prefix_tokens"] == 0
    path_lengths = []
    for per_c, per_n, q in zip(cached, naive, requests):
        assert len(per_c) == len(per_n) == q.count
        for c, nv in zip(per_c, per_n):
            assert c.tokens == nv.tokens
            # the cached path's first token comes from the saved hidden state, the naive one's from generate
            assert len(c.logprobs) == len(c.tokens) and c.logprobs == pytest.approx(nv.logprobs, abs=1e-4)
            # full: every branch may add 10 new tokens (App. F.2); remaining: the path stays within 10
            assert len(c.tokens) <= (10 if budget == "full" else 10 - q.fork)
            assert c.entropies == pytest.approx(nv.entropies, abs=1e-4)
            path_lengths.append(q.fork + len(c.tokens))
    # the random model rarely stops, so with the full budget some root-to-leaf path outgrows max_new_tokens
    # (the cached path then extends the sliced cache past the base response's length)
    assert max(path_lengths) <= T.max_path_tokens(10, budget)
    assert (max(path_lengths) > 10) == (budget == "full")
    # branches of one fork are different samples, not copies
    assert len({tuple(s.tokens) for s in cached[2]}) > 1


@pytest.mark.parametrize("engine", ["engine", "generate"])
def test_a_rollout_on_either_engine_warns_nothing_from_transformers(tiny_policy, monkeypatch, engine):
    """Both engines pass the KV cache under the name the installed transformers takes (models.cache_arg),
    so a rollout raises no FutureWarning: transformers' deprecations are FutureWarnings (on 5.24 every
    forward given `past_key_values` warned that 5.40 removes it) — nor any other warning from inside it."""
    model, tok = tiny_policy
    monkeypatch.setattr(R, "compute_reward", RecordingReward({"7": 1}))
    cfg = _cfg(rollout_engine=engine, n_base=2, k_max=1, b_max=2, max_new_tokens=6)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (tree,), _ = R.rollout_trees(model, tok, ["What is 3 + 4?"], ["7"], cfg, random.Random(0),
                                     progress=False)
    assert tree.leaves > 2                                     # the branches ran too, not just the bases
    noisy = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught
             if issubclass(w.category, FutureWarning) or "transformers" in w.filename]
    assert not noisy, noisy


def test_branch_limits_and_longest_path():
    assert [T.branch_limit(1024, f, "full") for f in (1, 500, 1023)] == [1024, 1024, 1024]
    assert [T.branch_limit(1024, f, "remaining") for f in (1, 500, 1023)] == [1023, 524, 1]
    assert T.max_path_tokens(1024, "full") == 2047 and T.max_path_tokens(1024, "remaining") == 1024
    with pytest.raises(ValueError, match="remaining"):
        T.branch_limit(10, 1, "half")


def test_stop_ids_end_a_base_model_prompted_with_the_release_prompt(smollm_tokenizer):
    # The release stops on EOS, pad and <|im_end|> <|endoftext|> <|end|> <|eot_id|> <|eot|> (no stop strings).
    # A base model given its plain-text prompt ends with its end-of-document token: SmolLM2's is
    # <|endoftext|> (id 0), which is neither its EOS nor its pad (<|im_end|>, id 2) — it must still stop.
    model = types.SimpleNamespace(generation_config=types.SimpleNamespace(eos_token_id=2))
    stops = R.stop_token_ids(smollm_tokenizer, model)
    vocab = smollm_tokenizer.get_vocab()
    assert vocab["<|endoftext|>"] in stops and vocab["<|im_end|>"] in stops
    prompt = data.format_prompt("What is 2 + 3?", style="release")
    assert "Problem:\nWhat is 2 + 3?" in prompt and prompt.endswith("Reasoning:\n")
    answer = smollm_tokenizer(" 2 + 3 = 5, so \\boxed{5}.", add_special_tokens=False).input_ids
    rambling = smollm_tokenizer("\n\nProblem:\nWhat is", add_special_tokens=False).input_ids
    row = answer + [vocab["<|endoftext|>"]] + rambling
    tokens, _ = G.trim(stops, torch.tensor([row]), torch.zeros(1, len(row)), limits=[len(row)])
    assert tokens == [answer + [vocab["<|endoftext|>"]]]


def test_trim_keeps_the_stop_token_and_cuts_at_the_budget():
    # pad = EOS = 2 (as in SmolLM2): generate pads a finished row with EOS; only the first one is
    # the response's
    new = torch.tensor([[5, 6, 2, 2, 2], [5, 7, 9, 9, 9], [5, 6, 8, 9, 4]])
    ents = torch.arange(15, dtype=torch.float).reshape(3, 5)
    tokens, entropies = G.trim([2, 7], new, ents, limits=[5, 5, 3])
    assert tokens == [[5, 6, 2], [5, 7], [5, 6, 8]]          # EOS kept (it is trained); budget of 3 respected
    assert entropies == [[0.0, 1.0, 2.0], [5.0, 6.0], [10.0, 11.0, 12.0]]
