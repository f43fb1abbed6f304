"""engine/ — a small tree rollout engine: our own decode loop over the HF model's forward.

Paper: App. C (Algorithm "Tree Rollout"), Sec. 4.1 (difficulty-adaptive budget), App. F (the runtime table:
"branch rollouts cannot commence until the base rollouts are fully generated" is what this engine removes).

    import engine as E
    engine = E.Engine(model, stop_ids, warp, max_rows, max_kv_tokens)     # rollout.Sampler.make_engine
    for done in engine.run(prompts, n, max_new_tokens, keep_hidden=True):
        requests = [E.BranchRequest(j, f, count, limit), ...]            # rollout.plan_prompt's forks
        engine.grow(done.prompt, requests)
    engine.results[p].bases, engine.results[p].branches[(j, f)]         # Samples

What it does differently from HF `generate` (engine/generate.py keeps that path as the reference):
  * Rows leave the batch the step they end (stop id or budget): no decode step is ever spent on an ended row.
  * No barrier per group: the moment a prompt's N base responses have ended, run() yields BasesDone and the
    caller (rollout.py: rewards → V(root) → K̂, B̂ → forks) answers with grow(); the branches join the running
    batch while other prompts' base responses are still decoding. Waiting work (branches first, then new
    prompts) fills the room freed by ended rows, within a budget of rows and KV tokens (scheduler.py).
  * Prefixes are shared by reference in a slot pool (kv.py): zero copies per fork or branch, and no prefix
    token is recomputed.
  * For every sampled token it records H_t of the sampling distribution (after temperature/top-k/top-p), the
    log-probability of the sampled token under that distribution, and (base rows) the final hidden state, so a
    branch's first token is sampled from the distribution at its fork without running the prefix again.
  * Base responses can also be given (`run(given_bases=...)`): the Section 3 studies grow several fork
    strategies' branches on one fixed base rollout (Sec. 3.2–3.3, App. C.2, D.5), and one-step off-policy
    samples a step's bases with the previous weights. Such a prompt's bases are not sampled: when it is
    admitted (within the row and KV budget like any prompt), its prompt is prefilled once and each response's
    tokens[:-1] is fed once, writing their keys/values and recording the hidden states its branches start
    from; BasesDone comes at once. The given Samples come back unchanged (the same objects) in
    PromptResult.bases: their entropies and log-probs are the ones recorded when they were generated, not
    recomputed under the current weights. A given prompt that keeps no hidden states (keep_hidden) can have
    no branches, so nothing of it is run.

The parts:
  samples.py    Sample (the project's one response type), BranchRequest, BasesDone, PromptResult
  kv.py         the reference-counted KV pool (pages of 1 token, or 64 for the paged step), the reference
                attention function that reads it, the forward passes
  shared.py     the CPU decode step (--decode_step shared, the default on CPU): each shared prefix (a
                prompt, a base's first f tokens) read once per step, parts mixed by their log-sum-exp;
                tokens drawn by inverse transform sampling (one random number per row)
  paged.py      the static-shape decode step (--decode_step paged, the default on CUDA): decode state on the
                device, FlexAttention over the pool's pages through the block table, sampling on the device,
                one host transfer per step, rows padded to buckets, one CUDA graph per bucket
  scheduler.py  admission within the row and KV budgets; Backoff: what running out of memory taught
  loop.py       Engine: the decode loop, and EngineRun: one run's tree bookkeeping
  generate.py   the reference path on HF `generate`, group by group: the test oracle (greedy trees equal
                the engine's token for token)
"""
from engine.kv import KVPool
from engine.loop import Engine, EngineRun
from engine.samples import BasesDone, BranchRequest, PromptResult, Sample
from engine.scheduler import Backoff, DecodeRow

__all__ = ["Backoff", "BasesDone", "BranchRequest", "DecodeRow", "Engine", "EngineRun", "KVPool",
           "PromptResult", "Sample"]
