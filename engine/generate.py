"""engine/generate.py — the reference path: HF `generate`, group by group (cfg.rollout_engine "generate").

It stays the reference and the test oracle: under greedy decoding it grows the same trees as the Engine, token
for token. Paper: App. C (Algorithm "Tree Rollout"), App. F.2 (branch rollouts generated in chunks).

  Phase 1  N base responses per prompt (generate_bases). Each prompt is prefilled once and its KV cache copied
           to its N samples. For every sampled token the entropy H_t of the distribution it was drawn from is
           recorded on the fly (a logits processor reduces each step's [batch, vocab] scores to [batch]
           entropies, so memory is O(batch × length), never × vocabulary), with the final hidden state that
           produced it.
  Phase 2  B̂ branches from each fork, batched across forks, responses and prompts, in chunks of
           `branch_chunk_size` (sample_branches). KV-cache prefix reuse: a branch at fork f needs the
           keys/values of prompt + response[:f]; they already sit in the cache that generating the base
           response filled, so they are sliced out of it (no prefix token is recomputed), and the
           distribution of the first branch token is the lm_head of the hidden state saved in Phase 1 — so the
           first forward pass of a branch already samples its second token. (Re-prefilling prompt +
           response[:f] for every branch, as the authors' release does, is the tests' oracle:
           tests/test_rollout.py.)

GenerateEngine runs the two phases behind the Engine's interface (run yields BasesDone, grow answers it),
group by group: a group's branches wait for all of its bases — the barrier engine/loop.py removes.
A `sampler` here is rollout.Sampler: model, stop_ids, pad_id, temperature, top_k, top_p.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import models
from engine.samples import BasesDone, BranchRequest, PromptResult, Sample
from runtime import oom


# --------------------------------------------------------------------------------------------------------
# Sampling pieces: HF's warpers, the entropy recorder, per-row budgets, the saved hidden states
# --------------------------------------------------------------------------------------------------------
def sampling_processors(temperature: float = 1.0, top_k: int = 0,
                        top_p: float = 1.0) -> list[LogitsProcessor]:
    """The warpers that turn logits into the sampling distribution, in HF's order (temperature, top-k, top-p).

    We pass them ourselves (and keep HF's own off) so that the entropy recorder runs after them and the
    first token of a cached branch is drawn from exactly the distribution `generate` would use.
    """
    warpers: list[LogitsProcessor] = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers


def entropy_of(scores: torch.Tensor) -> torch.Tensor:
    """H = −Σ_v p log p of softmax(scores) per row (App. D.1); −inf scores (top-k/p) have p = 0."""
    return torch.special.entr(torch.softmax(scores.float(), dim=-1)).sum(dim=-1)


class EntropyRecorder(LogitsProcessor):
    """Records the entropy of each step's sampling distribution and the log-probability of the token sampled
    from it: a [batch] vector per step each. The token of step t is known only at step t + 1 (the last column
    of input_ids), so one step's [batch, vocab] log-probs are held until then; `close(last)` gathers the
    final step's with the tokens generate returned."""

    def __init__(self):
        self.steps: list[torch.Tensor] = []
        self.logprob_steps: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids, scores):
        self.steps.append(entropy_of(scores))
        if self._pending is not None:
            self.logprob_steps.append(self._pending.gather(1, input_ids[:, -1:])[:, 0])
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def close(self, last_tokens: torch.Tensor) -> None:
        if self._pending is not None:
            self.logprob_steps.append(self._pending.gather(1, last_tokens[:, None])[:, 0])
            self._pending = None


class RowLimits(StoppingCriteria):
    """Per-row budget of new tokens (with --branch_length remaining a branch at fork f adds
    max_new_tokens − f)."""

    def __init__(self, start: int, limits: torch.Tensor):
        self.start, self.limits = start, limits

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.start) >= self.limits


class LastHidden:
    """Saves, for every decoding step of `generate`, the final hidden state of each row (lm_head's input).

    hidden[t] produced the distribution of generated token t, so lm_head(hidden[f]) is the distribution a
    branch at fork f samples its first token from. Memory: batch × length × hidden size.
    """

    def __init__(self, model):
        self.head = model.get_output_embeddings()
        self.steps: list[torch.Tensor] = []

    def __enter__(self):
        self.handle = self.head.register_forward_pre_hook(
            lambda module, args: self.steps.append(args[0][:, -1, :]))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def cache_bytes(cache) -> int:
    """Bytes of keys and values held by an HF cache."""
    if cache is None:
        return 0
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


# --------------------------------------------------------------------------------------------------------
# One generate call
# --------------------------------------------------------------------------------------------------------
def generation_config(stop_ids: list[int], pad_id: int, max_new_tokens: int) -> GenerationConfig:
    # A clean config: the model's own defaults (top_k=20, repetition penalty, ...) would make the samples
    # off-policy with respect to the log-probs we train on.
    return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                            use_cache=True, return_dict_in_generate=True)


def trim(stop_ids: list[int], new_tokens: torch.Tensor, entropies: torch.Tensor, limits: list[int]):
    """Cut each row after its first stop token (kept: EOS is trained) or at its budget."""
    stops = torch.isin(new_tokens, torch.tensor(stop_ids, device=new_tokens.device))
    tokens, ents = [], []
    toks_cpu, ents_cpu, stops_cpu = new_tokens.tolist(), entropies.tolist(), stops.tolist()
    for row, limit in enumerate(limits):
        n = min(limit, len(toks_cpu[row]))
        for t in range(n):
            if stops_cpu[row][t]:
                n = t + 1
                break
        tokens.append(toks_cpu[row][:n])
        ents.append(ents_cpu[row][:n])
    return tokens, ents


@torch.no_grad()
def hf_generate(sampler, input_ids, attention_mask, limits: list[int], cache=None, record_hidden=False,
                counters: dict | None = None) -> tuple[list[Sample], object, list | None]:
    """HF generate with per-row budgets; returns (one Sample per row, hf_output, hidden steps or None).
    counters (optional): row_steps, ended_row_steps, peak_call_kv_bytes."""
    recorder = EntropyRecorder()
    processors = LogitsProcessorList([*sampling_processors(sampler.temperature, sampler.top_k, sampler.top_p),
                                      recorder])
    limit_t = torch.tensor(limits, device=input_ids.device)
    stopping = StoppingCriteriaList([RowLimits(input_ids.shape[1], limit_t)])
    hidden = LastHidden(sampler.model) if record_hidden else None
    if hidden:
        hidden.__enter__()
    try:
        out = sampler.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     **{models.cache_arg(sampler.model): cache},
                                     generation_config=generation_config(sampler.stop_ids, sampler.pad_id,
                                                                         max(limits)),
                                     logits_processor=processors, stopping_criteria=stopping,
                                     synced_gpus=False)  # ranks generate alone (distributed.full_params)
    finally:
        if hidden:
            hidden.__exit__()
    new = out.sequences[:, input_ids.shape[1]:]
    if new.shape[1]:
        recorder.close(new[:, -1])
    ents = torch.stack(recorder.steps, dim=1) if recorder.steps \
        else new.new_zeros(new.shape, dtype=torch.float)
    tokens, entropies = trim(sampler.stop_ids, new, ents, limits)
    logps = torch.stack(recorder.logprob_steps, dim=1).tolist() if recorder.logprob_steps \
        else [[]] * len(tokens)
    samples = [Sample(t, e, row[:len(t)]) for t, e, row in zip(tokens, entropies, logps)]
    if counters is not None:
        # generate decodes every row until the batch ends: the row-steps past a row's end are wasted work
        row_steps = len(recorder.steps) * len(limits)
        counters["row_steps"] = counters.get("row_steps", 0) + row_steps
        counters["ended_row_steps"] = counters.get("ended_row_steps", 0) + row_steps - sum(map(len, tokens))
        counters["peak_call_kv_bytes"] = max(counters.get("peak_call_kv_bytes", 0),
                                             cache_bytes(getattr(out, models.cache_arg(sampler.model))))
    return samples, out, (hidden.steps if hidden else None)


@torch.no_grad()
def first_tokens(sampler, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row from lm_head(hidden) exactly as generate's sampling step does; its H_t and
    log-probability."""
    scores = sampler.warp(sampler.model.get_output_embeddings()(hidden).float())
    probs = torch.softmax(scores, dim=-1)
    tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
    logprobs = torch.log_softmax(scores, dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, entropy_of(scores), logprobs


# --------------------------------------------------------------------------------------------------------
# Phase 1: base responses (shared prompt prefill)
# --------------------------------------------------------------------------------------------------------
@dataclass
class BaseBatch:
    """N responses for each of P prompts, rows ordered prompt-major; plus what branches reuse."""
    prompt_ids: list[list[int]]          # per row
    tokens: list[list[int]]
    entropies: list[list[float]]
    width: int = 0                       # padded prompt width of the generate call
    cache: object = None                 # KV cache of [pad + prompt + response[:-1]] per row
    hidden: list[torch.Tensor] | None = None  # per step [rows, d]: hidden[t] → distribution of token t
    logprobs: list[list[float]] | None = None  # per row, log p of each token under its sampling distribution

    def sample(self, row: int) -> Sample:
        return Sample(self.tokens[row], self.entropies[row], self.logprobs[row] if self.logprobs else None)


@torch.no_grad()
def generate_bases(sampler, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                   keep_cache: bool = False, counters: dict | None = None) -> BaseBatch:
    """N samples per prompt. The prompts are prefilled once (all but their last token) and the cache is
    repeated N times, so the prompt is not recomputed per sample (outputs identical under greedy decoding).
    keep_cache: keep the KV cache and hidden states that branches reuse (sample_branches)."""
    ids, mask = left_pad(prompt_ids, sampler.pad_id, sampler.device)
    cache = None
    if ids.shape[1] > 1:
        cache = DynamicCache(config=sampler.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift the rotary positions
        sampler.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                      use_cache=True, logits_to_keep=1, **{models.cache_arg(sampler.model): cache})
        cache.batch_repeat_interleave(n)
    ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
    samples, out, hidden = hf_generate(sampler, ids, mask, [max_new_tokens] * ids.shape[0], cache=cache,
                                       record_hidden=keep_cache, counters=counters)
    rows_prompt = [p for p in prompt_ids for _ in range(n)]
    batch = BaseBatch(rows_prompt, [s.tokens for s in samples], [s.entropies for s in samples],
                      width=ids.shape[1], logprobs=[s.logprobs for s in samples])
    if keep_cache:
        batch.cache, batch.hidden = getattr(out, models.cache_arg(sampler.model)), hidden
    return batch


# --------------------------------------------------------------------------------------------------------
# Phase 2: branches
# --------------------------------------------------------------------------------------------------------
def slice_prefix_cache(model, base: BaseBatch, rows: list[int], forks: list[int]) -> tuple[DynamicCache, int]:
    """A cache holding, right-aligned and left-padded, the keys/values of prompt + response[:f] of each
    (row, f), gathered from the base generation's cache. Positions keep their rotary phases: generate derives
    position ids from the attention mask, which counts only real tokens, exactly as in Phase 1."""
    device = base.cache.layers[0].keys.device
    lengths = torch.tensor([len(base.prompt_ids[r]) + f for r, f in zip(rows, forks)], device=device)
    starts = base.width - torch.tensor([len(base.prompt_ids[r]) for r in rows], device=device)
    width = int(lengths.max())
    offset = torch.arange(width, device=device)[None, :] - (width - lengths[:, None])   # <0 on the padding
    source = (starts[:, None] + offset.clamp(min=0))                                       # [n, width]
    valid = (offset >= 0)[:, None, :, None]
    row_index = torch.tensor(rows, device=device)[:, None]
    cache = DynamicCache(config=model.config)
    for layer_idx, layer in enumerate(base.cache.layers):
        keys = layer.keys[row_index, :, source].transpose(1, 2) * valid       # [n, kv_heads, width, d]
        values = layer.values[row_index, :, source].transpose(1, 2) * valid
        cache.update(keys.contiguous(), values.contiguous(), layer_idx)
    return cache, width


@torch.no_grad()
def branch_chunk(sampler, base: BaseBatch, requests: list[BranchRequest], counters: dict) -> list[Sample]:
    """One generate call for one branch per request (request.base: the base row; request.limit: its
    budget): the continuation from token f on of each."""
    rows = [req.base for req in requests]
    forks = [req.fork for req in requests]
    limits = [req.limit for req in requests]
    prefixes = [base.prompt_ids[r] + base.tokens[r][:f] for r, f in zip(rows, forks)]
    hidden = torch.stack([base.hidden[f][r] for r, f in zip(rows, forks)])
    first, first_ent, first_logp = first_tokens(sampler, hidden)
    cache, width = slice_prefix_cache(sampler.model, base, rows, forks)
    ids, mask = left_pad([p + [t] for p, t in zip(prefixes, first.tolist())], sampler.pad_id, sampler.device)
    # A branch whose first token already ends it, or whose budget is one token, must not continue:
    # it stays in the batch (the batch shape of a generate call from the whole prefix) with a budget of 1
    # extra step.
    ended = [t in sampler.stop_ids or lim <= 1 for t, lim in zip(first.tolist(), limits)]
    rest_limits = [1 if e else lim - 1 for e, lim in zip(ended, limits)]
    rest = hf_generate(sampler, ids, mask, rest_limits, cache=cache, counters=counters)[0]
    return [Sample([t] + ([] if e else r.tokens), [h] + ([] if e else r.entropies),
                   [lp] + ([] if e else r.logprobs))
            for t, h, lp, e, r in zip(first.tolist(), first_ent.tolist(), first_logp.tolist(), ended, rest)]


def sample_branches(sampler, base: BaseBatch, requests: list[BranchRequest], chunk_size: int,
                    counters: dict | None = None) -> list[list[Sample]]:
    """All branches of all requests (request.base: a row of `base`), in chunks of chunk_size branches.
    Returns, per request, its `count` Samples of the branch continuation (from token f on), each at most
    request.limit long. counters['recomputed_prefix_tokens'] counts prefix tokens whose keys/values were
    computed again (0 on the cached path); a chunk that runs out of memory is retried at half the size, down
    to one branch (oom.halving_chunks, counted in counters['oom_retries'])."""
    counters = counters if counters is not None else {}
    counters.setdefault("recomputed_prefix_tokens", 0)
    jobs = [(i, req) for i, req in enumerate(requests) for _ in range(req.count)]
    results: list[list[Sample]] = [[] for _ in requests]
    def run(chunk):
        return branch_chunk(sampler, base, [req for _, req in chunk], counters)

    outputs = oom.halving_chunks(jobs, chunk_size, run, what="branches", counters=counters)
    for (i, _), out in zip(jobs, outputs):
        results[i].append(out)
    return results


# --------------------------------------------------------------------------------------------------------
# The two phases behind the Engine's interface
# --------------------------------------------------------------------------------------------------------
class GenerateEngine:
    """HF generate per group of gen_batch_size rows (whole prompts): Phase 1 for the group, BasesDone for each
    of its prompts (the caller answers with grow), then the group's branches in chunks of chunk_size before
    the next group starts. `results` per prompt as the Engine's; `counters` and `seconds` for RolloutStats."""

    def __init__(self, sampler, gen_batch_size: int, chunk_size: int):
        self.sampler, self.gen_batch_size, self.chunk_size = sampler, gen_batch_size, chunk_size
        self.counters = dict(row_steps=0, ended_row_steps=0, recomputed_prefix_tokens=0, oom_retries=0,
                             base_tokens=0, branch_tokens=0, peak_kv_bytes=0, peak_call_kv_bytes=0)
        self.seconds = dict(base=0.0, branches=0.0)
        self.results: list[PromptResult] = []
        self._requests: dict[int, list[BranchRequest]] = {}

    def run(self, prompts: list[list[int]], n: int, max_new_tokens: int, keep_hidden: bool | set[int] = False,
            given_bases: None = None, progress: bool = True):
        """Yields BasesDone per prompt, group by group; keep_hidden: branches may follow (keep the cache).
        Given base responses are the Engine's alone."""
        if given_bases:
            raise ValueError("given base responses need --rollout_engine engine")
        self.results = [PromptResult([]) for _ in prompts]
        per_call = max(1, self.gen_batch_size // n)           # whole prompt groups per generate call
        bar = tqdm(total=len(prompts), desc="rollout", unit="tree", leave=False, dynamic_ncols=True,
                   disable=None if progress else True)
        try:
            for first in range(0, len(prompts), per_call):
                group = list(range(first, min(first + per_call, len(prompts))))
                base = self.bases([prompts[p] for p in group], n, max_new_tokens, bool(keep_hidden))
                for g, p in enumerate(group):
                    self.results[p].bases = [base.sample(r) for r in range(g * n, (g + 1) * n)]
                    yield BasesDone(p, self.results[p].bases)
                self.branches(base, group, n)
                bar.update(len(group))
        finally:
            bar.close()

    def grow(self, prompt: int, requests: list[BranchRequest]) -> None:
        """The answer to BasesDone(prompt): its branches, generated with the rest of its group's."""
        self._requests[prompt] = requests

    def bases(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int, keep_cache: bool) -> BaseBatch:
        """Phase 1 for one group."""
        t0 = time.perf_counter()
        base = generate_bases(self.sampler, prompt_ids, n, max_new_tokens, keep_cache, self.counters)
        self.counters["base_tokens"] += sum(map(len, base.tokens))
        self.counters["peak_kv_bytes"] = max(self.counters["peak_kv_bytes"],
                                             self.counters["peak_call_kv_bytes"])
        self.seconds["base"] += time.perf_counter() - t0
        return base

    def branches(self, base: BaseBatch, group: list[int], n: int) -> None:
        """Phase 2 for one group: every request of its prompts, by base row, in chunks; then the base cache
        is freed before the next group."""
        t0 = time.perf_counter()
        requests = [(p, req.base, BranchRequest(g * n + req.base, req.fork, req.count, req.limit))
                    for g, p in enumerate(group) for req in self._requests.pop(p, [])]
        base_kv = cache_bytes(base.cache)
        self.counters["peak_call_kv_bytes"] = 0
        grown = sample_branches(self.sampler, base, [r for *_, r in requests], self.chunk_size,
                                self.counters) if requests else []
        # while branches generate, the base cache stays alive beside each chunk's cache
        self.counters["peak_kv_bytes"] = max(self.counters["peak_kv_bytes"],
                                             base_kv + self.counters["peak_call_kv_bytes"])
        self.counters["branch_tokens"] += sum(len(s.tokens) for per in grown for s in per)
        base.cache = base.hidden = None
        for (p, j, req), samples in zip(requests, grown):
            self.results[p].branches[(j, req.fork)] = samples
        self.seconds["branches"] += time.perf_counter() - t0
