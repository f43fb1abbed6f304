"""engine/ against independent paths: HF generate (greedy trees token for token), a fresh full forward
(entropies and log-probs), and its own event log (scheduling, no step on an ended row, KV returned)."""
import random

import pytest
import torch

import config
import engine as E
import methods as M
import rollout as R
import tree as T
from engine import generate as G
from engine import kv
from studies import growth

PROMPTS = ["What is 3 + 4?", "Add 10 and 25, then explain.", "Compute 12 * 3 step by step, please."]
ANSWERS = ["7", "35", "36"]


def _cfg(**overrides):
    base = dict(n_base=3, k_max=2, b_max=2, fork="tok-entropy", adaptive=False, max_new_tokens=10,
                gen_batch_size=6, branch_chunk_size=8)
    base.update(overrides)
    return config.make_config("tiny", **base)


def tiny_model(arch: str, vocab_size: int):
    """A 2-layer random model of that architecture built from a config (no download). Untied embeddings and
    a larger init: with tied ones a random model's greedy output repeats its last token forever, which
    would make "same tokens as generate" nearly vacuous."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    import models

    if arch == "llama":
        return models.tiny_random_model(vocab_size, seed=0, tie_word_embeddings=False,
                                        initializer_range=0.2).eval()
    sizes = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
                 pad_token_id=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if arch == "qwen2":
            return Qwen2ForCausalLM(Qwen2Config(**sizes)).eval()
        return Qwen3ForCausalLM(Qwen3Config(head_dim=32, **sizes)).eval()   # head_dim ≠ hidden / heads


def tree_tokens(trees):
    return [(t.v_root, t.k_hat, t.b_hat, t.forks,
             [(b.parent, b.token_ids, b.start, b.branch, b.base, b.reward) for b in t.blocks]) for t in trees]


def rollout(model, tok, cfg, engine, seed=0, **kw):
    cfg.rollout_engine = engine
    torch.manual_seed(seed)
    return R.rollout_trees(model, tok, PROMPTS, ANSWERS, cfg, random.Random(seed), **kw)


def engine_for(model, tok, cfg, max_rows=64, max_kv_tokens=4096, trace=True, backoff=None):
    sampler = R.Sampler.from_config(model, tok, cfg)
    return E.Engine(model, sampler.stop_ids, sampler.warp, max_rows, max_kv_tokens, trace=trace,
                    backoff=backoff)


def run_to_end(engine, prompts, n, max_new_tokens, branches=None, keep_hidden=None, **kwargs):
    """engine.run to the end, answering each BasesDone(p, bases) with engine.grow(p, branches(p, bases));
    keep_hidden defaults to whether branches are asked for. The results per prompt."""
    keep = branches is not None if keep_hidden is None else keep_hidden
    for done in engine.run(prompts, n, max_new_tokens, keep_hidden=keep, **kwargs):
        if branches is not None:
            engine.grow(done.prompt, branches(done.prompt, done.samples))
    return engine.results


# ---- greedy: the same trees as HF generate, token for token --------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("budget,decode", [("full", "auto"), ("remaining", "reference")])
def test_greedy_trees_equal_generate_trees(smollm_tokenizer, arch, budget, decode):
    """Both CPU decode steps (auto: engine/shared.py; the reference, engine/kv.py), each branch budget."""
    tok = smollm_tokenizer
    model = tiny_model(arch, len(tok))
    cfg = _cfg(top_k=1, branch_length=budget, decode_step=decode)
    ours, ours_stats = rollout(model, tok, cfg, "engine")
    ref, ref_stats = rollout(model, tok, cfg, "generate")
    assert tree_tokens(ours) == tree_tokens(ref)
    assert len({tok for t in ours for b in t.blocks for tok in b.token_ids}) > 20   # not one repeated token
    assert sum(len(f) for t in ours for f in t.forks) > 0 and any(b.branch for t in ours for b in t.blocks)
    assert ours_stats.recomputed_prefix_tokens == 0 and ours_stats.ended_row_steps == 0
    assert (ours_stats.base_tokens, ours_stats.branch_tokens) \
        == (ref_stats.base_tokens, ref_stats.branch_tokens)


@pytest.mark.slow
def test_greedy_trees_equal_generate_trees_on_smollm2(smollm_tokenizer):
    import data
    import models

    model, tok = models.load_policy("smollm2-135m")
    model.eval()
    cfg = _cfg(top_k=1, n_base=2, max_new_tokens=16, few_shot=True)
    problems = data.load_problems("arith-test", limit=2)
    prompts = [data.format_prompt(p["problem"], tok, cfg.prompt_style, cfg.few_shot) for p in problems]
    answers = [p["answer"] for p in problems]
    trees = {}
    for engine in ("engine", "generate"):
        cfg.rollout_engine = engine
        trees[engine], _ = R.rollout_trees(model, tok, prompts, answers, cfg, random.Random(0))
    assert tree_tokens(trees["engine"]) == tree_tokens(trees["generate"])
    assert any(b.branch for t in trees["engine"] for b in t.blocks)


def test_greedy_base_samples_equal_generate(tiny_policy):
    """sample_base (what evaluate.py calls) through the engine and through generate."""
    tok = tiny_policy[1]
    model = tiny_model("qwen3", len(tok))
    ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    out = {}
    for engine in ("engine", "generate"):
        sampler = R.Sampler.from_config(model, tok, _cfg(top_k=1, rollout_engine=engine))
        batch = R.sample_base(sampler, ids, 2, 9)
        out[engine] = (batch.prompt_ids, batch.tokens)
        for a, b in zip(batch.entropies, batch.tokens):
            assert len(a) == len(b)
    assert out["engine"] == out["generate"]


# ---- sampling: what is recorded equals a fresh full forward ----------------------------------------------
@pytest.mark.parametrize("warpers", [dict(), dict(temperature=0.7, top_k=40, top_p=0.9)])
def test_recorded_entropies_and_logprobs_match_a_full_forward(tiny_policy, warpers):
    model, tok = tiny_policy
    cfg = _cfg(**warpers)
    engine = engine_for(model, tok, cfg)
    sampler = R.Sampler.from_config(model, tok, cfg)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    requests = [E.BranchRequest(0, 2, 2, 6), E.BranchRequest(1, 5, 1, 6)]
    torch.manual_seed(4)
    results = run_to_end(engine, prompts, 2, 8, branches=lambda p, bases: requests)
    checked = 0
    for p, res in enumerate(results):
        paths = [([], s) for s in res.bases]
        paths += [(res.bases[j].tokens[:f], s) for (j, f), per in res.branches.items() for s in per]
        assert len(res.branches) == 2 and sum(map(len, res.branches.values())) == 3
        for prefix, s in paths:
            ids = prompts[p] + prefix + s.tokens
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            start = len(prompts[p]) + len(prefix) - 1
            scores = sampler.warp(logits[start:start + len(s.tokens)])
            logp = torch.log_softmax(scores, -1)
            assert torch.allclose(torch.tensor(s.entropies), G.entropy_of(scores), atol=1e-4)
            assert torch.allclose(torch.tensor(s.logprobs), logp[torch.arange(len(s.tokens)), s.tokens],
                                  atol=1e-4)
            assert all(lp > -float("inf") for lp in s.logprobs)   # every token came from the warped support
            checked += 1
    assert checked == 2 * (2 + 3)


def test_same_seed_same_trees_and_different_seed_different_trees(tiny_policy):
    model, tok = tiny_policy
    cfg = _cfg(fork="random")
    a, _ = rollout(model, tok, cfg, "engine", seed=7)
    b, _ = rollout(model, tok, cfg, "engine", seed=7)
    c, _ = rollout(model, tok, cfg, "engine", seed=8)
    assert tree_tokens(a) == tree_tokens(b) and tree_tokens(a) != tree_tokens(c)


# ---- scheduling, ended rows, KV storage ------------------------------------------------------------------
def test_branches_of_an_early_prompt_decode_while_another_prompts_bases_run(tiny_policy):
    """Greedy on the random model: stop prompt A's bases at their 3rd token (that token made a stop id);
    prompt B's bases never produce it and run their full 12. A's branches must be decoding before B's
    bases end."""
    tok = tiny_policy[1]
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    probe = run_to_end(engine_for(model, tok, cfg), prompts, 1, 12)
    a_tokens, b_tokens = probe[0].bases[0].tokens, probe[1].bases[0].tokens
    stop = next(t for t in a_tokens[2:] if t not in b_tokens and t not in a_tokens[:2])
    a_end = a_tokens.index(stop) + 1
    engine = engine_for(model, tok, cfg)
    engine.stop_ids.add(stop)
    requests = {0: [E.BranchRequest(0, 1, 2, 12)], 1: [E.BranchRequest(1, 4, 2, 12)]}
    results = run_to_end(engine, prompts, 2, 12, branches=lambda p, bases: requests[p])
    assert ([len(s.tokens) for s in results[0].bases] == [a_end, a_end]
            and len(results[1].bases[0].tokens) == 12)
    step_of = {(kind, ev[2]): ev[0] for ev in engine.events if (kind := ev[1]) in ("bases_done", "tree_done")}
    rows_of = {}
    for ev in engine.events:
        if ev[1] == "end":
            rows_of.setdefault(ev[3], set()).add(ev[2])
    a_rows_decoded = [ev[0] for ev in engine.events if ev[1] == "decode" and set(ev[2]) & rows_of[0] - {0, 1}]
    assert step_of[("bases_done", 0)] < min(a_rows_decoded) < step_of[("bases_done", 1)]
    # greedy from a shared prefix: a branch at f continues exactly as its base did (first token from the
    # saved fork distribution, the rest reading the base's slots)
    base_a, base_b = results[0].bases[0].tokens, results[1].bases[1].tokens
    assert [s.tokens for s in results[0].branches[(0, 1)]] == [base_a[1:]] * 2
    for s in results[1].branches[(1, 4)]:            # its own budget of 12 takes it past the base's end
        assert s.tokens[:8] == base_b[4:] and len(s.tokens) == 12
    assert step_of[("tree_done", 0)] < step_of[("bases_done", 1)] < step_of[("tree_done", 1)]


def test_no_decode_step_on_an_ended_row_and_kv_returned(tiny_policy):
    model, tok = tiny_policy
    cfg = _cfg()
    engine = engine_for(model, tok, cfg, max_rows=5, max_kv_tokens=400)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    requests = [E.BranchRequest(0, 1, 3, 7), E.BranchRequest(1, 3, 2, 4), E.BranchRequest(2, 2, 1, 9)]
    torch.manual_seed(2)
    results = run_to_end(engine, prompts, 3, 9, branches=lambda p, bases: [
        r for r in requests if r.fork < len(bases[r.base].tokens)])
    end_step = {ev[2]: ev[0] for ev in engine.events if ev[1] == "end"}
    decoded: dict[int, list[int]] = {}
    for ev in engine.events:
        if ev[1] == "decode":
            assert len(ev[2]) <= 5                                   # the row budget
            for row in ev[2]:
                decoded.setdefault(row, []).append(ev[0])
    assert all(max(steps) <= end_step[row] for row, steps in decoded.items())
    samples = [s for res in results for s in res.bases + [x for per in res.branches.values() for x in per]]
    # each token after a row's first takes exactly one decode step of that row: none is spent on ended rows
    assert (engine.stats["row_steps"] == sum(len(s.tokens) - 1 for s in samples)
            == sum(map(len, decoded.values())))
    assert len(end_step) == len(samples)
    # every slot is back; prefixes were shared, so fewer slots were ever held than the rows' contexts sum to
    assert engine.pool.used == 0 and set(engine.pool.refs) == {0}
    assert [ev[3] for ev in engine.events if ev[1] == "tree_done"][-1] == 0
    contexts = sum(len(prompts[p]) + len(s.tokens) - 1 for p, res in enumerate(results) for s in res.bases) \
        + sum(len(prompts[p]) + f + len(s.tokens) - 1 for p, res in enumerate(results)
              for (j, f), per in res.branches.items() for s in per)
    assert engine.pool.peak <= 400 and engine.pool.peak < contexts


def test_kv_pool_shares_and_frees_slots():
    model = type("M", (), {})()
    model.config = type("C", (), dict(num_key_value_heads=2, num_attention_heads=4, hidden_size=16,
                                      num_hidden_layers=3, head_dim=4))()
    pool = E.KVPool(model, 8, "cpu", torch.float32)
    assert pool.bytes_per_token == 3 * 2 * 2 * 4 * 4
    prefix = pool.alloc(3)
    pool.retain(prefix)                   # a second row reads the same three slots
    own = pool.alloc(2)
    assert pool.used == 5 and len(set(prefix + own)) == 5
    pool.release(prefix)                  # the first row ends: the prefix is still read by the second
    assert pool.used == 5
    pool.release(prefix + own)
    assert pool.used == 0 and pool.peak == 5
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.alloc(9)


def test_out_of_memory_halves_the_row_budget_and_remembers_it(tiny_policy, monkeypatch):
    tok = tiny_policy[1]
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    reference = run_to_end(engine_for(model, tok, cfg), prompts, 2, 8)
    real = kv.Forward.decode

    def small_gpu(self, rows):            # "CUDA" that decodes at most 2 rows at once
        if len(rows) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(self, rows)

    monkeypatch.setattr(kv.Forward, "decode", small_gpu)
    backoff = E.Backoff()                             # what the run remembers from one engine to the next
    engine = engine_for(model, tok, cfg, max_rows=6, backoff=backoff)
    results = run_to_end(engine, prompts, 2, 8)
    assert [[s.tokens for s in r.bases] for r in results] == [[s.tokens for s in r.bases] for r in reference]
    assert engine.stats["oom_retries"] == 2 and engine.scheduler.max_rows == 1    # 6 rows → 3 → 1 (3 // 2)
    assert engine.pool.used == 0 and backoff.rows == {"cpu": 1}
    assert engine_for(model, tok, cfg, max_rows=6, backoff=backoff).scheduler.max_rows == 1   # the next step
    assert engine_for(model, tok, cfg, max_rows=6).scheduler.max_rows == 6   # starts at what fit; no global


def test_prefill_oom_beside_decoding_rows_waits_for_them(smollm_tokenizer, monkeypatch):
    """A "GPU" that cannot prefill while 2 rows decode: each prompt after the first waits until the rows
    decoding have halved (here: none left), then prefills; nothing is lost and the samples are those of an
    unconstrained run (greedy), and no prompt needed smaller prefill chunks."""
    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]

    def requests(p, bases):
        return [E.BranchRequest(1, 3, 2, 6)]

    reference = run_to_end(engine_for(model, tok, cfg), prompts, 2, 8, branches=requests)
    real = kv.Forward.prefill_forward
    beside = []

    def small_gpu(self, row, tokens):
        if len(tokens) > 1:                              # a prefill
            if len(engine.scheduler.active) >= 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (injected)")
            beside.append(len(engine.scheduler.active))
        return real(self, row, tokens)

    monkeypatch.setattr(kv.Forward, "prefill_forward", small_gpu)
    engine = engine_for(model, tok, cfg)
    results = run_to_end(engine, prompts, 2, 8, branches=requests)
    assert ([([s.tokens for s in r.bases], {k: [s.tokens for s in v] for k, v in r.branches.items()})
             for r in results]
            == [([s.tokens for s in r.bases], {k: [s.tokens for s in v] for k, v in r.branches.items()})
                for r in reference])
    assert engine.stats["oom_retries"] >= 2 and beside == [0, 0, 0] and engine.scheduler.prefill_chunk is None
    assert engine.pool.used == 0 and engine.scheduler.max_rows == 64
    prefills = [ev[2] for ev in engine.events if ev[1] == "prefill"]
    assert prefills == [0, 1, 2] and engine.stats["prefill_tokens"] == sum(map(len, prompts))


def test_more_samples_per_prompt_than_rows_take_turns(smollm_tokenizer):
    """N = 5 samples per prompt with a budget of 2 rows (GRPO's G = 16 at a small max_batch_rows): the prompt
    is prefilled once, its rows take turns, and the samples are those of an unconstrained run (greedy)."""
    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    wide = run_to_end(engine_for(model, tok, cfg), prompts, 5, 6)
    narrow = engine_for(model, tok, cfg, max_rows=2, max_kv_tokens=60)
    results = run_to_end(narrow, prompts, 5, 6)
    assert [[s.tokens for s in r.bases] for r in results] == [[s.tokens for s in r.bases] for r in wide]
    assert max(len(ev[2]) for ev in narrow.events if ev[1] == "decode") == 2
    assert sum(1 for ev in narrow.events if ev[1] == "prefill") == 2 and narrow.pool.used == 0


def test_every_method_runs_on_the_engine(tiny_policy, monkeypatch):
    """GRPO (depth one), TreeRL-style fixed trees, AttnRL (ATB's attention pass + its expansion rule)."""
    model, tok = tiny_policy
    monkeypatch.setattr(R, "compute_reward", lambda text, answer, fallback=False: float(len(text) % 2))
    grpo, stats = rollout(model, tok, _cfg(group_size=4), "engine", method=M.METHODS["grpo"])
    assert all(t.leaves == 4 and not any(b.branch for b in t.blocks) for t in grpo)
    assert stats.branch_tokens == 0 and stats.ended_row_steps == 0
    attnrl, stats = rollout(model, tok, _cfg(fork="atb", max_new_tokens=16), "engine",
                            method=M.METHODS["attnrl"])
    assert stats.recomputed_prefix_tokens == 0 and len(attnrl) == 3
    for t in attnrl:
        for j, fs in enumerate(t.forks):
            assert sum(1 for b in t.blocks if b.branch and b.base == j) == len(fs) * t.b_hat


# ---- given base responses: fed once, never sampled; branches as if the engine had sampled them ----------
def test_branches_from_given_bases_equal_branches_on_its_own_bases(smollm_tokenizer):
    """Greedy: the engine samples bases and grows branches; a second engine given those bases (for prompts 0
    and 2 only; prompt 1 is sampled again) grows the same branches, returns the given Samples themselves,
    and spends no decode step and no sampling on the given rows."""
    import copy

    tok = smollm_tokenizer
    model = tiny_model("qwen2", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    requests = {0: [E.BranchRequest(0, 1, 2, 9), E.BranchRequest(1, 4, 1, 9)],
                1: [E.BranchRequest(1, 2, 2, 5)],
                2: [E.BranchRequest(0, 6, 1, 9), E.BranchRequest(1, 0, 1, 3)]}
    sampled = run_to_end(engine_for(model, tok, cfg), prompts, 2, 9, branches=lambda p, bases: requests[p])
    given = {p: sampled[p].bases for p in (0, 2)}
    saved = copy.deepcopy(given)
    seen = {}
    engine = engine_for(model, tok, cfg)
    results = run_to_end(engine, prompts, 2, 9, given_bases=given,
                         branches=lambda p, bases: seen.setdefault(p, bases) and requests[p])
    for p in range(3):
        assert [s.tokens for s in results[p].bases] == [s.tokens for s in sampled[p].bases]
        assert {k: [s.tokens for s in v] for k, v in results[p].branches.items()} == \
            {k: [s.tokens for s in v] for k, v in sampled[p].branches.items()}
        assert sum(map(len, results[p].branches.values())) == sum(r.count for r in requests[p])
    for p in (0, 2):
        assert all(a is b for a, b in zip(results[p].bases, given[p])) and seen[p] == given[p] == saved[p]
    assert len({t for res in results for per in res.branches.values() for s in per for t in s.tokens}) > 5
    branch_tokens = sum(len(s.tokens) - 1 for res in results for per in res.branches.values() for s in per)
    assert engine.stats["row_steps"] == branch_tokens + sum(len(s.tokens) - 1 for s in results[1].bases)
    assert engine.stats["given_tokens"] == sum(len(s.tokens) - 1 for p in (0, 2) for s in given[p])
    assert engine.pool.used == 0 and set(engine.pool.refs) == {0}


@pytest.mark.parametrize("warpers", [dict(), dict(temperature=0.7, top_k=40, top_p=0.9)])
def test_branches_on_given_bases_match_a_full_forward(tiny_policy, warpers):
    """Sampling: every branch token's H_t and log-prob (the first one from the hidden state the feed
    recorded at the fork) equals a fresh full forward of prompt + base[:f] + branch within 1e-4 (fp32)."""
    model, tok = tiny_policy
    cfg = _cfg(**warpers)
    sampler = R.Sampler.from_config(model, tok, cfg)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    torch.manual_seed(5)
    given = {p: res.bases for p, res in enumerate(run_to_end(engine_for(model, tok, cfg), prompts, 2, 10))}
    requests = [E.BranchRequest(0, 0, 1, 6), E.BranchRequest(0, 3, 2, 6), E.BranchRequest(1, 7, 2, 6)]
    results = run_to_end(engine_for(model, tok, cfg), prompts, 2, 10, given_bases=given,
                         branches=lambda p, b: [r for r in requests if r.fork < len(b[r.base].tokens)])
    checked = 0
    for p, res in enumerate(results):
        for (j, f), per in res.branches.items():
            for s in per:
                ids = prompts[p] + given[p][j].tokens[:f] + s.tokens
                with torch.no_grad():
                    logits = model(torch.tensor([ids])).logits[0].float()
                start = len(prompts[p]) + f - 1
                scores = sampler.warp(logits[start:start + len(s.tokens)])
                logp = torch.log_softmax(scores, -1)
                assert torch.allclose(torch.tensor(s.entropies), G.entropy_of(scores), atol=1e-4)
                assert torch.allclose(torch.tensor(s.logprobs), logp[torch.arange(len(s.tokens)), s.tokens],
                                      atol=1e-4)
                checked += 1
    assert checked >= 6


def test_given_bases_wait_for_kv_room(smollm_tokenizer):
    """Feeding a given prompt needs P + Σ(len − 1) slots on top of what running rows may still write: with a
    pool too small for prompt 1's feed beside prompt 0's branches, prompt 1 is prefilled only after prompt 0's
    tree is done, and the branches are those of a roomy pool (greedy)."""
    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    given = {p: res.bases for p, res in enumerate(run_to_end(engine_for(model, tok, cfg), prompts, 2, 8))}
    fork, count, limit = 2, 3, 6

    def grow_at(p, bases):
        return [E.BranchRequest(0, fork, count, limit)]

    roomy = engine_for(model, tok, cfg)
    wide = run_to_end(roomy, prompts, 2, 8, given_bases=given, branches=grow_at)
    need = [len(prompts[p]) + sum(len(s.tokens) - 1 for s in given[p]) for p in range(2)]
    # after prompt 0's bases: its branches hold P0 + f prefix slots and may still write count × (limit − 1)
    capacity = max(need[0], need[1] + len(prompts[0]) + fork + count * (limit - 1) - 1)
    assert capacity < need[1] + len(prompts[0]) + fork + count * (limit - 1)
    engine = engine_for(model, tok, cfg, max_kv_tokens=capacity)
    results = run_to_end(engine, prompts, 2, 8, given_bases=given, branches=grow_at)
    assert [r.branches for r in results] == [r.branches for r in wide]
    order = {e: [ev[1:3] for ev in e.events if ev[1] in ("prefill", "tree_done")] for e in (roomy, engine)}
    assert order[roomy] == [("prefill", 0), ("prefill", 1), ("tree_done", 0), ("tree_done", 1)]
    assert order[engine] == [("prefill", 0), ("tree_done", 0), ("prefill", 1), ("tree_done", 1)]
    assert engine.pool.peak <= capacity and engine.pool.used == 0
    with pytest.raises(ValueError, match="given_bases\\[1\\]"):
        run_to_end(engine_for(model, tok, cfg), prompts, 2, 8, given_bases={1: given[1][:1]})


def test_keep_hidden_as_a_set_of_prompts(smollm_tokenizer):
    """keep_hidden={0}: only prompt 0's base rows hold their slots until its bases are done; prompts 1 and 2
    give an ended base row's own slots back at once. One row at a time (max_rows=1) makes the peak exact:
    a kept prompt holds P + Σ_j (len_j − 1), another P + max_j (len_j − 1)."""
    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]

    def grow_at(p, bases):
        return [E.BranchRequest(0, 1, 1, 1)] if p == 0 else []

    peaks, out = {}, {}
    for keep in (True, frozenset({0})):
        engine = engine_for(model, tok, cfg, max_rows=1)
        out[keep] = run_to_end(engine, prompts, 2, 8, branches=grow_at, keep_hidden=keep)
        peaks[keep] = engine.pool.peak
        assert engine.pool.used == 0
        # prompt 0's one branch ends at its first token (budget 1), inside bases_done: its tree is done once
        assert [ev[2] for ev in engine.events if ev[1] == "tree_done"] == [0, 1, 2]
    tokens = {keep: [[s.tokens for s in r.bases] for r in res] for keep, res in out.items()}
    assert tokens[True] == tokens[frozenset({0})]
    lengths = [[len(s.tokens) - 1 for s in r.bases] for r in out[True]]
    assert peaks[True] == max(len(prompts[p]) + sum(lengths[p]) for p in range(3))
    assert peaks[frozenset({0})] == max([len(prompts[0]) + sum(lengths[0])] +
                                         [len(prompts[p]) + max(lengths[p]) for p in (1, 2)])
    assert peaks[frozenset({0})] < peaks[True]
    with pytest.raises(ValueError, match="prompt 1 without keep_hidden"):
        run_to_end(engine_for(model, tok, cfg), prompts, 2, 8, keep_hidden={0},
                   branches=lambda p, bases: [E.BranchRequest(0, 1, 1, 2)])


def test_grow_from_forks_engine_equals_generate(smollm_tokenizer, monkeypatch):
    """The Section 3 studies' branches on a fixed base rollout: the engine (given bases) and generate (slices
    of the base generation's cache) grow the same subtrees under greedy decoding."""
    tok = smollm_tokenizer
    model = tiny_model("qwen3", len(tok))
    monkeypatch.setattr(R, "compute_reward", lambda text, answer, fallback=False: float(len(text) % 2))
    ids = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    samplers = {e: R.Sampler.from_config(model, tok, _cfg(top_k=1, rollout_engine=e))
                for e in ("engine", "generate")}
    base = R.sample_base(samplers["generate"], ids, 2, 10, keep_cache=True)
    assert base.cache is not None
    forks = {0: [2, 5], 1: [1], 3: [4, 7, 8]}
    subtrees = {}
    for length in ("full", "remaining"):
        for name, sampler in samplers.items():
            subtrees[name] = growth.grow_from_forks(sampler, tok, base, forks, 2, ["7", "7", "35", "35"], 10,
                                               chunk_size=3, length=length)
        shape = {e: {r: [(b.parent, b.token_ids, b.start, b.branch, b.reward) for b in blocks]
                     for r, blocks in subtrees[e].items()} for e in subtrees}
        assert shape["engine"] == shape["generate"]
        assert sum(b.branch for blocks in subtrees["engine"].values() for b in blocks) == 2 * 6
        assert len({t for blocks in subtrees["engine"].values() for b in blocks if b.branch
                    for t in b.token_ids}) > 5
    again = R.sample_base(samplers["engine"], ids, 2, 10, keep_cache=True)
    assert again.tokens == base.tokens and again.cache is None and len(again.logprobs) == 4


# ---- per-token log-probs carried into the tree -----------------------------------------------------------
@pytest.mark.parametrize("engine", ["engine", "generate"])
def test_tree_blocks_carry_generation_time_logprobs(tiny_policy, engine):
    """Every block of every tree (base pieces and branches) carries the log p of each of its tokens under the
    distribution it was sampled from: equal to a fresh full forward of prompt + path within 1e-4 (fp32)."""
    model, tok = tiny_policy
    cfg = _cfg(temperature=0.8, top_k=50, top_p=0.95)
    trees, _ = rollout(model, tok, cfg, engine, seed=3)
    sampler = R.Sampler.from_config(model, tok, cfg)
    checked = 0
    for t in trees:
        for i, b in enumerate(t.blocks):
            path = T.path_token_ids(t.blocks, i)
            ids = t.prompt_ids + path
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            start = len(t.prompt_ids) + b.start - 1
            logp = torch.log_softmax(sampler.warp(logits[start:start + len(b.token_ids)]), -1)
            assert len(b.logprobs) == len(b.token_ids)
            assert torch.allclose(torch.tensor(b.logprobs), logp[torch.arange(len(b.token_ids)), b.token_ids],
                                  atol=1e-4)
            checked += b.branch
    assert checked >= 6


# ---- the progress bar ------------------------------------------------------------------------------------
class _Terminal:
    """A stderr that says it is a terminal (tqdm draws only on one unless told otherwise)."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


@pytest.mark.parametrize("tty,progress,drawn",
                         [(True, True, True), (True, False, False), (False, True, False)])
def test_progress_bar_counts_tokens_rows_and_trees(tiny_policy, monkeypatch, tty, progress, drawn):
    import sys

    model, tok = tiny_policy
    cfg = _cfg()
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    given = {1: run_to_end(engine_for(model, tok, cfg), prompts[1:2], 2, 6, progress=False)[0].bases}
    stderr = _Terminal(tty)
    monkeypatch.setattr(sys, "stderr", stderr)
    engine = engine_for(model, tok, cfg)
    results = run_to_end(engine, prompts, 2, 6, branches=lambda p, bases: [E.BranchRequest(0, 1, 2, 4)],
                         given_bases=given, progress=progress)
    assert any("rollout" in s for s in stderr.text) == drawn
    sampled = [s for p, r in enumerate(results) for s in (r.bases if p != 1 else [])] + \
        [s for r in results for per in r.branches.values() for s in per]
    state = engine.state
    assert state.sampled == sum(len(s.tokens) for s in sampled)        # given bases are not sampled
    assert (state.rows_done, state.rows_started, state.trees_done) == (3 * 2 + 3 * 2, 3 * 2 + 3 * 2, 3)
    if drawn:
        assert state.bar.n == state.sampled and state.bar.postfix == "rows=12/12, trees=3/3"


# ---- --compile_decode ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_decode_step_gives_the_eager_engine_results(smollm_tokenizer):
    """torch.compile of the decode step (writes the pool in place inside the graph): greedy trees equal the
    eager engine's token for token; sampled H_t and log-probs equal a fresh full forward within 1e-4 (fp32).
    Compiles once (tens of seconds on CPU)."""
    tok = smollm_tokenizer
    model = tiny_model("qwen2", len(tok))
    trees = {}
    for compiled in (False, True):     # the reference step (the shared one compiles to more graph variants)
        cfg = _cfg(top_k=1, compile_decode=compiled, decode_step="reference")
        trees[compiled], stats = rollout(model, tok, cfg, "engine")
    assert tree_tokens(trees[True]) == tree_tokens(trees[False]) and stats.row_steps > 0
    assert kv._COMPILED and torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1     # it did compile
    assert any(b.branch for t in trees[True] for b in t.blocks)
    cfg = _cfg(temperature=0.7, top_k=40, compile_decode=True, decode_step="reference")
    sampled, _ = rollout(model, tok, cfg, "engine", seed=2)
    assert_recorded_distributions(model, R.Sampler.from_config(model, tok, cfg), sampled)


def assert_recorded_distributions(model, sampler, trees) -> int:
    """Every block's recorded H_t and log p equal a fresh full forward of prompt + path under the sampler's
    warpers, within 1e-4 (fp32), and no recorded log p is -inf. Returns the number of branch blocks."""
    branches = 0
    for t in trees:
        for i, b in enumerate(t.blocks):
            with torch.no_grad():
                logits = model(torch.tensor([t.prompt_ids + T.path_token_ids(t.blocks, i)])).logits[0].float()
            start = len(t.prompt_ids) + b.start - 1
            scores = sampler.warp(logits[start:start + len(b.token_ids)])
            logp = torch.log_softmax(scores, -1)
            assert torch.allclose(torch.tensor(b.entropies), G.entropy_of(scores), atol=1e-4)
            assert torch.allclose(torch.tensor(b.logprobs), logp[torch.arange(len(b.token_ids)), b.token_ids],
                                  atol=1e-4)
            assert all(lp > -float("inf") for lp in b.logprobs)
            branches += b.branch
    return branches
