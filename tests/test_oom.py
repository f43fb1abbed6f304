"""Out of memory everywhere it can happen, proven on CPU with the DATPO_OOM_AT fault injection (faults.py):
the update reruns a mini-batch in smaller micro-batches with the same loss, evaluation and branch generation
in smaller batches with a valid result; cuBLAS allocation failures count as out of memory."""
import copy
import random

import inject
import pytest
import torch
from test_packing import EOS, datpo_tree, deep_tree, grpo_group, tiny

import config
import data
import engine
import evaluate as E
import packing as P
import rollout as R
import train
from runtime import faults, oom


@pytest.fixture
def oom_at(monkeypatch):
    """DATPO_OOM_AT for one test: the tests' sites (tests/inject.py) wrapped with monkeypatch, so they
    are undone after it. (What the engine learns from running out of memory stays in its Sampler's
    engine.Backoff: nothing global.)"""
    def set_sites(spec: str):
        monkeypatch.setenv("DATPO_OOM_AT", spec)
        inject.install(spec, monkeypatch.setattr)
    yield set_sites


def test_is_oom_knows_cuda_and_cublas_allocation_failures():
    assert oom.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert oom.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling "
                                   "`cublasCreate(handle)`"))
    assert not oom.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling "
                                       "`cublasGemmEx`"))
    assert not oom.is_oom(RuntimeError("shape '[2, 3]' is invalid for input of size 7"))


def test_an_injected_site_raises_the_cuda_error_once_and_names_unknown_sites(monkeypatch):
    """tests/inject.py wraps a stage function from outside: its first call raises the error CUDA raises,
    later calls run it; `when` picks which call; an unknown site is one line naming the known ones."""
    calls = []

    class Stage:
        @staticmethod
        def forward(rows):
            calls.append(rows)
            return rows

    inject.raise_once(Stage, "forward", "test", monkeypatch.setattr, when=lambda rows: rows > 1)
    assert Stage.forward(1) == 1                     # `when` does not hold: runs
    with pytest.raises(torch.OutOfMemoryError, match="DATPO_OOM_AT at 'test'"):
        Stage.forward(2)
    assert Stage.forward(3) == 3 and calls == [1, 3]  # once
    real = P.micro_logprobs
    assert inject.install("update", monkeypatch.setattr) == ["update"]
    assert P.micro_logprobs is not real and P.micro_logprobs.__wrapped__ is real   # the update's site
    with pytest.raises(faults.UserError,
                       match="DATPO_OOM_AT=updates: unknown site.*expected some of .*update"):
        inject.install("updates")


def test_halving_retry_halves_to_one_then_reraises_and_passes_other_errors():
    sizes, reset = [], []

    def run(size):
        sizes.append(size)
        if size > 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return size

    counters = {}
    assert oom.halving_retry(run, 16, "x", counters, reset=lambda: reset.append(1)) == 2
    assert sizes == [16, 8, 4, 2] and counters["oom_retries"] == 3 == len(reset)
    with pytest.raises(torch.OutOfMemoryError):
        oom.halving_retry(lambda s: run(99), 1, "x")
    with pytest.raises(torch.OutOfMemoryError):
        oom.halving_retry(run, 16, "x", retry=False)
    with pytest.raises(ValueError):
        oom.halving_retry(lambda s: (_ for _ in ()).throw(ValueError("bug")), 16, "x")


@pytest.mark.parametrize("layout,epochs,mini", [("packed", 2, 6), ("rows", 2, 6), ("packed", 1, 64),
                                                ("rows", 1, 64)])
def test_update_oom_reruns_the_minibatch_smaller_with_the_same_loss(oom_at, layout, epochs, mini):
    """DATPO_OOM_AT=update: the first micro-batch's forward runs out of memory — in the no-grad old log-prob
    pass (2 epochs, several mini-batches) or in the gradient pass (1 epoch, one mini-batch: no old pass) — and
    that mini-batch is redone at half the micro-batch budget (packed: tokens, rows: rows). Same loss (the
    normaliser is the mini-batch's), same weights after the step, one retry counted."""
    cfg = config.make_config("tiny", mini_batch_size=mini, micro_batch_size=4, ppo_epochs=epochs,
                             max_grad_norm=1e9, max_tokens_per_micro_batch=40, train_layout=layout,
                             packed_attention="tree")
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    base = tiny("qwen3")
    out = {}
    for spec in ("", "update"):
        oom_at(spec)
        model = copy.deepcopy(base)
        stats = train.ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.05), trees, cfg, EOS, "cpu",
                                 random.Random(3))
        out[spec] = stats, [p.detach().clone() for p in model.parameters()]
    (clean, w_clean), (hit, w_hit) = out[""], out["update"]
    assert clean["oom_retries"] == 0 and hit["oom_retries"] == 1
    assert hit["optimizer_steps"] == clean["optimizer_steps"] >= epochs
    assert hit["loss"] == pytest.approx(clean["loss"], abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(w_clean, w_hit))


def test_eval_oom_generates_in_smaller_batches_with_a_valid_result(tiny_policy, monkeypatch):
    model, tok = tiny_policy
    calls = []
    real = R.sample_base
    monkeypatch.setattr(R, "sample_base",
                        lambda s, p, n, m, **kw: calls.append(len(p) * n) or real(s, p, n, m, **kw))
    cfg = config.make_config("tiny", gen_batch_size=4)
    problems = data.load_problems("arith-test", 3)
    inject.install("eval", monkeypatch.setattr)
    torch.manual_seed(0)
    res = E.evaluate_problems(model, tok, problems, cfg, k=2, max_new_tokens=4, runs=1, progress=False)
    assert res["oom_retries"] == 1
    assert calls[0] == 2 and max(calls) <= 2              # 4 rows per call ran out: 2 per call, kept after
    assert sorted((r["index"], r["sample"]) for r in res["records"]) \
        == [(i, s) for i in range(3) for s in range(2)]
    assert all(1 <= r["tokens"] <= 4 for r in res["records"]) and res["n_samples"] == 6


def test_branch_oom_halves_the_chunk_and_builds_the_same_shape_of_tree(tiny_policy, oom_at, monkeypatch):
    model, tok = tiny_policy
    monkeypatch.setattr(R, "compute_reward", lambda text, answer, fallback=False: 0.0)    # V = 0: full budget
    cfg = config.make_config("tiny", n_base=2, k_max=2, b_max=2, max_new_tokens=12, gen_batch_size=8,
                             branch_chunk_size=8)
    oom_at("branches")
    torch.manual_seed(0)
    (tree,), stats = R.rollout_trees(model, tok, ["What is 3 + 4?"], ["7"], cfg, random.Random(0))
    assert stats.oom_retries == 1
    assert tree.leaves == 2 * (1 + 2 * 2)                 # N(1 + K̂B̂) with K̂ = B̂ = 2 at V = 0
    assert all(len(b.token_ids) > 0 for b in tree.blocks)


def test_prefill_oom_alone_feeds_the_prompt_in_halves_with_the_same_result(smollm_tokenizer, oom_at):
    """DATPO_OOM_AT=prefill: the first prompt's prefill runs out of memory with no row decoding; it is fed
    again in chunks of half its tokens (and so is every later prompt and given response), and the samples are
    those of a run without the fault: same tokens, H_t and log-probs within 1e-4."""
    from test_engine import PROMPTS, run_to_end, tiny_model

    tok = smollm_tokenizer
    model = tiny_model("qwen2", len(tok))
    sampler = R.Sampler.from_config(model, tok, config.make_config("tiny", temperature=0.8))
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    torch.manual_seed(0)
    given = {1: run_to_end(sampler.make_engine(prompts, 8, 6, 2), prompts[1:2], 2, 8,
                           progress=False)[0].bases}

    def requests(p, bases):
        return [engine.BranchRequest(j, 2, 2, 6) for j in range(2)]

    out = {}
    for spec in ("", "prefill"):
        oom_at(spec)
        torch.manual_seed(1)
        run = sampler.make_engine(prompts, 8, 18, 2)
        res = run_to_end(run, prompts, 2, 8, branches=requests, given_bases=given, progress=False)
        out[spec] = run, [s for r in res for s in r.bases + [x for per in r.branches.values() for x in per]]
    (clean, a), (hit, b) = out[""], out["prefill"]
    assert clean.stats["oom_retries"] == 0 and hit.stats["oom_retries"] == 1
    assert hit.scheduler.prefill_chunk == len(prompts[0]) // 2 == sampler.backoff.prefill_tokens["cpu"]
    assert [s.tokens for s in a] == [s.tokens for s in b] and len(a) == 3 * 2 + 3 * 4
    for x, y in zip(a, b):
        assert (x.entropies == pytest.approx(y.entropies, abs=1e-4)
                and x.logprobs == pytest.approx(y.logprobs, abs=1e-4))
    assert hit.stats["prefill_tokens"] == clean.stats["prefill_tokens"] == sum(map(len, prompts))
    assert hit.pool.used == 0 and \
        sampler.make_engine(prompts, 8, 6, 2).scheduler.prefill_chunk == hit.scheduler.prefill_chunk


def test_prefill_oom_in_a_rollout_never_kills_the_step(tiny_policy, oom_at, monkeypatch):
    model, tok = tiny_policy
    monkeypatch.setattr(R, "compute_reward", lambda text, answer, fallback=False: 0.0)    # V = 0: full budget
    cfg = config.make_config("tiny", n_base=2, k_max=2, b_max=2, max_new_tokens=12)
    oom_at("prefill")
    torch.manual_seed(0)
    trees, stats = R.rollout_trees(model, tok, ["What is 3 + 4?", "What is 5 + 6?"], ["7", "11"], cfg,
                                   random.Random(0))
    assert stats.oom_retries == 1
    assert [t.leaves for t in trees] == [2 * (1 + 2 * 2)] * 2   # N(1 + K̂B̂) with K̂ = B̂ = 2 at V = 0


def test_base_oom_halves_the_engine_rows_and_reaches_the_generate_caller(smollm_tokenizer, oom_at):
    """DATPO_OOM_AT=base: the engine's first decode step of several base rows runs out of memory once; its row
    budget halves (kept in the sampler's Backoff) and the greedy samples are those of a run without the
    fault. On the generate path a group's base call raises it (the base phase's degradation is
    the engine's)."""
    from test_engine import PROMPTS, run_to_end, tiny_model

    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    out = {}
    for spec in ("", "base"):
        oom_at(spec)
        sampler = R.Sampler.from_config(model, tok, config.make_config("tiny", top_k=1, max_batch_rows=8))
        run = sampler.make_engine(prompts, 6, 6, 2)
        out[spec] = run, sampler, [[s.tokens for s in r.bases] for r in run_to_end(run, prompts, 2, 6)]
    (clean, _, a), (hit, sampler, b) = out[""], out["base"]
    assert a == b and clean.stats["oom_retries"] == 0 and hit.stats["oom_retries"] == 1
    # 6 // 2
    assert clean.scheduler.max_rows == 8 and hit.scheduler.max_rows == 3 == sampler.backoff.rows["cpu"]
    cfg = config.make_config("tiny", rollout_engine="generate")
    with pytest.raises(torch.OutOfMemoryError, match="DATPO_OOM_AT"):
        R.rollout_trees(model, tok, PROMPTS[:1], ["7"], cfg, random.Random(0))
