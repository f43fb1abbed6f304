"""rollout.py — sample base responses and grow difficulty-adaptive trees.

Two engines behind one interface (`rollout_trees`, `sample_base`; cfg.rollout_engine):
  engine    (default) engine.py: one decode loop for all prompts; rows leave when they end, a prompt's
            V(root)/K̂/B̂/forks are computed (plan_prompt) the moment its N bases end and its branches join the
            running batch; prefixes are shared in a slot pool (rollout_with_engine).
  generate  HF `generate`, group by group, in the phases below (rollout_with_generate): the reference path and
            the test oracle (greedy decoding gives the same trees token for token).

Paper: Sec. 3.2 and App. C (Algorithm "Tree Rollout"), Sec. 4.1 (difficulty-adaptive tree search), App. D
(forking strategies), App. E.2 (branch rollouts generated in chunks).

With `generate`, one call of `rollout_trees` does, for a batch of prompts:
  Phase 1  N base responses per prompt. Each prompt is prefilled once and its KV cache copied to its N samples.
           For every sampled token we record the entropy H_t of the distribution it was drawn from, on the fly
           (a logits processor reduces each step's [batch, vocab] scores to [batch] entropies, so memory is
           O(batch × length), never × vocabulary), and the final hidden state that produced it.
  Budget   V(root) = mean reward of the N responses → (K̂, B̂) (tree.adaptive_budget), or fixed (K, B).
  Forks    tree.select_forks on each base response.
  Phase 2  B̂ branches from each fork, batched across forks, responses and prompts, in chunks of
           `branch_chunk_size`. KV-cache prefix reuse: a branch at fork f needs the keys/values of
           prompt + response[:f]; they already sit in the cache that generating the base response filled, so
           they are sliced out of it (no prefix token is recomputed), and the distribution of the first branch
           token is the lm_head of the hidden state saved in Phase 1 — so the first forward pass of a branch
           already samples its second token. `naive_prefill=True` instead re-prefills prompt + response[:f]
           for every branch (the simple path, kept for comparison and as the test oracle).
  Blocks   tree.base_blocks + one terminal block per branch → a `tree.Tree` per prompt.

Both engines record, for every generated token, H_t and log p(token) under the distribution it was sampled
from (after temperature/top-k/top-p); the blocks carry both (tree.Block.entropies / .logprobs), so a later
update can tell the behaviour policy's log-probs from its own (one-step off-policy).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import (DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

import engine as E
from harness import inject
from harness import oom
import methods as M
import tree as T
from reward import compute_reward


# --------------------------------------------------------------------------------------------------------
# Sampling pieces shared by the cached and the naive path
# --------------------------------------------------------------------------------------------------------
def sampling_processors(temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[LogitsProcessor]:
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
    """Per-row budget of new tokens (with --branch_budget remaining a branch at fork f adds max_new_tokens − f)."""

    def __init__(self, start: int, limits: torch.Tensor):
        self.start, self.limits = start, limits

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids.shape[1] - self.start) >= self.limits


class LastHidden:
    """Saves, for every decoding step of `generate`, the final hidden state of each row (the input of lm_head).

    hidden[t] produced the distribution of generated token t, so lm_head(hidden[f]) is the distribution a
    branch at fork f samples its first token from. Memory: batch × length × hidden size.
    """

    def __init__(self, model):
        self.head = model.get_output_embeddings()
        self.steps: list[torch.Tensor] = []

    def __enter__(self):
        self.handle = self.head.register_forward_pre_hook(lambda module, args: self.steps.append(args[0][:, -1, :]))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|end|>", "<|eot_id|>", "<|eot|>")


def stop_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and pad, the model's generation EOS ids, and the
    end-of-document / end-of-turn tokens the authors' release also stops on (STOP_TOKENS; the release has no
    stop strings). A base model given the release's plain-text prompt ends its answer with its document end
    (<|endoftext|> for Qwen2.5), an instruct model with <|im_end|>; both are stop ids whatever the prompt."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    gen_eos = model.generation_config.eos_token_id
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
    return sorted(i for i in ids if i is not None)


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


@dataclass
class Sampler:
    """What every generate call needs: the model, its stop ids, pad id and sampling settings."""
    model: torch.nn.Module
    stop_ids: list[int]
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    engine: str = "generate"             # "engine": engine.py's decode loop; "generate": HF generate
    max_rows: int = 64                   # engine: rows decoded at once
    max_kv_tokens: int = 0               # engine: KV pool size in tokens; 0 = the prompts + max_rows × max_new_tokens
    compile_decode: bool = False         # engine: decode steps through torch.compile
    counts: dict = field(default_factory=dict)   # generate: row_steps, ended_row_steps, peak_call_kv_bytes

    @classmethod
    def from_config(cls, model, tokenizer, cfg) -> "Sampler":
        engine = "generate" if cfg.naive_prefill else cfg.rollout_engine   # naive re-prefill is generate's
        return cls(model, stop_token_ids(tokenizer, model), tokenizer.pad_token_id,
                   cfg.temperature, cfg.top_k, cfg.top_p, engine,
                   cfg.max_batch_rows or max(cfg.gen_batch_size, cfg.branch_chunk_size), cfg.max_kv_tokens,
                   compile_decode=cfg.compile_decode)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """temperature, top-k, top-p applied to [rows, vocab] scores, exactly as generate applies them."""
        for warper in sampling_processors(self.temperature, self.top_k, self.top_p):
            scores = warper(None, scores)
        return scores

    def make_engine(self, prompt_ids: list[list[int]], max_new_tokens: int, rows: int, n: int = 0,
                    trace: bool = False) -> E.Engine:
        """An engine.Engine for at most `rows` rows in all. Its pool holds, unless max_kv_tokens says otherwise,
        every prompt once plus max_new_tokens for each of min(max_rows, rows) rows (prefixes are shared, so a
        row's own tokens are what it adds; rows that do not fit wait for room), plus one prompt's N ended base
        rows kept for its forks while more than max_rows of them take turns."""
        capacity = self.max_kv_tokens or \
            (min(self.max_rows, rows) + n) * max_new_tokens + sum(map(len, prompt_ids))
        return E.Engine(self.model, self.stop_ids, self.warp, self.max_rows, capacity, trace=trace,
                        compile_decode=self.compile_decode)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def generation_config(self, max_new_tokens: int) -> GenerationConfig:
        # A clean config: the model's own defaults (top_k=20, repetition penalty, ...) would make the samples
        # off-policy with respect to the log-probs we train on.
        return GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                eos_token_id=self.stop_ids, pad_token_id=self.pad_id, use_cache=True,
                                return_dict_in_generate=True)

    def trim(self, new_tokens: torch.Tensor, entropies: torch.Tensor, limits: list[int]):
        """Cut each row after its first stop token (kept: EOS is trained) or at its budget."""
        stops = torch.isin(new_tokens, torch.tensor(self.stop_ids, device=new_tokens.device))
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
    def generate(self, input_ids, attention_mask, limits: list[int], cache=None, record_hidden=False):
        """HF generate with per-row budgets; returns (tokens, entropies, log-probs of the sampled tokens,
        hf_output, hidden steps or None)."""
        recorder = EntropyRecorder()
        processors = LogitsProcessorList([*sampling_processors(self.temperature, self.top_k, self.top_p), recorder])
        limit_t = torch.tensor(limits, device=input_ids.device)
        stopping = StoppingCriteriaList([RowLimits(input_ids.shape[1], limit_t)])
        hidden = LastHidden(self.model) if record_hidden else None
        if hidden:
            hidden.__enter__()
        try:
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                                      generation_config=self.generation_config(max(limits)),
                                      logits_processor=processors, stopping_criteria=stopping,
                                      synced_gpus=False)  # ranks generate alone (distributed.full_params)
        finally:
            if hidden:
                hidden.__exit__()
        new = out.sequences[:, input_ids.shape[1]:]
        if new.shape[1]:
            recorder.close(new[:, -1])
        ents = torch.stack(recorder.steps, dim=1) if recorder.steps else new.new_zeros(new.shape, dtype=torch.float)
        tokens, entropies = self.trim(new, ents, limits)
        logps = torch.stack(recorder.logprob_steps, dim=1).tolist() if recorder.logprob_steps else [[]] * len(tokens)
        logprobs = [row[:len(t)] for row, t in zip(logps, tokens)]
        # generate decodes every row until the batch ends: the row-steps past a row's end are wasted work
        steps = len(recorder.steps)
        self.counts["row_steps"] = self.counts.get("row_steps", 0) + steps * len(limits)
        self.counts["ended_row_steps"] = self.counts.get("ended_row_steps", 0) + steps * len(limits) - sum(map(len, tokens))
        self.counts["peak_call_kv_bytes"] = max(self.counts.get("peak_call_kv_bytes", 0), cache_bytes(out.past_key_values))
        return tokens, entropies, logprobs, out, (hidden.steps if hidden else None)

    @torch.no_grad()
    def sample_first(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample one token per row from lm_head(hidden) exactly as generate's sampling step does; its H_t and
        log-probability."""
        scores = self.warp(self.model.get_output_embeddings()(hidden).float())
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


@torch.no_grad()
def sample_base(sampler: Sampler, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                keep_cache: bool = False) -> BaseBatch:
    """N samples per prompt. The prompts are prefilled once (all but their last token) and the cache is
    repeated N times, so the prompt is not recomputed per sample (outputs identical under greedy decoding).
    With sampler.engine == "engine" engine.py samples them instead (and records their log-probs); keep_cache
    (keep what grow_from_forks needs) then keeps nothing: the engine's grow_from_forks feeds the bases again."""
    if sampler.engine == "engine":
        engine = sampler.make_engine(prompt_ids, max_new_tokens, len(prompt_ids) * n, n)
        results = engine.run(prompt_ids, n, max_new_tokens, progress=False)   # callers draw their own bars
        samples = [s for res in results for s in res.bases]
        return BaseBatch([p for p in prompt_ids for _ in range(n)], [s.tokens for s in samples],
                         [s.entropies for s in samples], logprobs=[s.logprobs for s in samples])
    ids, mask = left_pad(prompt_ids, sampler.pad_id, sampler.device)
    cache = None
    if ids.shape[1] > 1:
        cache = DynamicCache(config=sampler.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift the rotary positions
        sampler.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                      past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache.batch_repeat_interleave(n)
    ids, mask = ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0)
    tokens, ents, logps, out, hidden = sampler.generate(ids, mask, [max_new_tokens] * ids.shape[0], cache=cache,
                                                        record_hidden=keep_cache)
    rows_prompt = [p for p in prompt_ids for _ in range(n)]
    batch = BaseBatch(rows_prompt, tokens, ents, width=ids.shape[1], logprobs=logps)
    if keep_cache:
        batch.cache, batch.hidden = out.past_key_values, hidden
    return batch


# --------------------------------------------------------------------------------------------------------
# Phase 2: branches
# --------------------------------------------------------------------------------------------------------
@dataclass
class BranchRequest:
    row: int          # base row in the BaseBatch
    fork: int         # f: keep response[:f], resample from token f
    count: int        # B̂


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
def sample_branches(sampler: Sampler, base: BaseBatch, requests: list[BranchRequest], max_new_tokens: int,
                    chunk_size: int, naive_prefill: bool = False, counters: dict | None = None,
                    budget: str = "full"):
    """All branches of all requests, in chunks. Returns, per request, `count` (tokens, entropies, log-probs)
    triples of the branch continuation (from token f on), each at most tree.branch_limit(max_new_tokens, f,
    budget) long. counters['recomputed_prefix_tokens'] counts prefix tokens whose keys/values were computed
    again (0 on the cached path)."""
    counters = counters if counters is not None else {}
    counters.setdefault("recomputed_prefix_tokens", 0)
    jobs = [(i, req) for i, req in enumerate(requests) for _ in range(req.count)]
    results: list[list] = [[] for _ in requests]

    def run(chunk):
        inject.oom_point("branches")     # DATPO_OOM_AT=branches (tests)
        rows = [req.row for _, req in chunk]
        forks = [req.fork for _, req in chunk]
        limits = [T.branch_limit(max_new_tokens, f, budget) for f in forks]
        prefixes = [base.prompt_ids[r] + base.tokens[r][:f] for r, f in zip(rows, forks)]
        if naive_prefill:
            ids, mask = left_pad(prefixes, sampler.pad_id, sampler.device)
            tokens, ents, logps, _, _ = sampler.generate(ids, mask, limits)
            counters["recomputed_prefix_tokens"] += sum(map(len, prefixes))
        else:
            hidden = torch.stack([base.hidden[f][r] for r, f in zip(rows, forks)])
            first, first_ent, first_logp = sampler.sample_first(hidden)
            cache, width = slice_prefix_cache(sampler.model, base, rows, forks)
            ids, mask = left_pad([p + [t] for p, t in zip(prefixes, first.tolist())], sampler.pad_id, sampler.device)
            # A branch whose first token already ends it, or whose budget is one token, must not continue:
            # it stays in the batch (same batch shape as the naive path) with a budget of 1 extra step.
            ended = [t in sampler.stop_ids or lim <= 1 for t, lim in zip(first.tolist(), limits)]
            rest_limits = [1 if e else lim - 1 for e, lim in zip(ended, limits)]
            rest, rest_ents, rest_logps, _, _ = sampler.generate(ids, mask, rest_limits, cache=cache)
            tokens = [[t] + ([] if e else r) for t, e, r in zip(first.tolist(), ended, rest)]
            ents = [[h] + ([] if e else r) for h, e, r in zip(first_ent.tolist(), ended, rest_ents)]
            logps = [[lp] + ([] if e else r) for lp, e, r in zip(first_logp.tolist(), ended, rest_logps)]
            del cache
        return list(zip(tokens, ents, logps))

    # A chunk that runs out of GPU memory is retried at half the size, down to one branch (faults.py).
    outputs = oom.halving_chunks(jobs, chunk_size, run, what="branches", counters=counters)
    for (i, _), out in zip(jobs, outputs):
        results[i].append(out)
    return results


def response_blocks(tokenizer, j: int, tokens: list[int], entropies: list[float], reward: float, forks: list[int],
                    branches: dict, grade, first_index: int, logprobs: list[float] | None = None) -> list[T.Block]:
    """The blocks of one base response's subtree (App. C): the response cut at its forks (tree.base_blocks; the
    last block carries its reward) followed, fork by fork, by one terminal block per branch.

    branches: f -> [(tokens, entropies, log-probs)] of the branches grown at f (continuations from token f on;
    log-probs may be None); grade(ids) -> reward of the whole root-to-leaf response ids = tokens[:f] + branch;
    first_index: where these blocks start in the tree's block list; logprobs: the base response's
    generation-time log-probs (None: unknown). rollout_trees and grow_from_forks both build blocks here.
    """
    blocks, ends_at = T.base_blocks(j, tokens, entropies, reward, forks, first_index, logprobs)
    for block in blocks:
        block.text = tokenizer.decode(block.token_ids, skip_special_tokens=True)
    for f in forks:
        grown = branches.get(f, [])
        texts = tokenizer.batch_decode([tok for tok, *_ in grown], skip_special_tokens=True)
        for (tok, ent, logp), text in zip(grown, texts):
            blocks.append(T.Block(parent=ends_at[f], token_ids=tok, entropies=ent, text=text,
                                  reward=grade(tokens[:f] + tok), base=j, start=f, branch=True, logprobs=logp))
    return blocks


def grade_responses(tokenizer, token_lists: list[list[int]], answers: list[str], fallback: bool) -> list[float]:
    """0/1 verifiable reward of each response (reward.compute_reward on its decoded text), answers[i] its gold."""
    texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
    return [compute_reward(text, answer, fallback) for text, answer in zip(texts, answers)]


def grader(tokenizer, answer: str, fallback: bool):
    """ids -> reward of the decoded response (reward.compute_reward)."""
    return lambda ids: compute_reward(tokenizer.decode(ids, skip_special_tokens=True), answer, fallback)


@torch.no_grad()
def grow_from_forks(sampler: Sampler, tokenizer, base: BaseBatch, forks: dict[int, list[int]], count: int,
                    answers: list[str], max_new_tokens: int, chunk_size: int, answer_fallback: bool = False,
                    base_rewards: list[float] | None = None, budget: str = "full") -> dict[int, list[T.Block]]:
    """Branches from GIVEN forks on GIVEN base responses: the Section 3 analyses (App. C.2, D.5) grow several
    strategies' branches from one fixed base rollout (`base` from sample_base(..., keep_cache=True)).
    With sampler.engine == "engine" the engine grows them from the given bases (branches_on_given_bases;
    chunk_size is then unused: the engine's row and KV budget decide); with "generate", sample_branches slices
    the base generation's cache (the reference path; both give the same subtrees under greedy decoding).

    forks: base row → fork prefix lengths (each branch keeps response[:f]); count: B branches per fork;
    answers: the gold answer of each base row; budget: tree.branch_limit's (cfg.branch_budget). Returns, per row in `forks`, its subtree as blocks: the base
    response cut at its forks (tree.base_blocks; the last block carries the base reward) followed by `count`
    branch blocks per fork, each rewarded on prefix + continuation as in rollout_trees. The base is never
    modified, so it can be branched again with other forks.
    """
    if sampler.engine == "engine":
        by_fork = branches_on_given_bases(sampler, base, forks, count, max_new_tokens, budget)
    else:
        requests = [BranchRequest(r, f, count) for r, fs in forks.items() for f in sorted(fs)]
        grown = sample_branches(sampler, base, requests, max_new_tokens, chunk_size, budget=budget) \
            if requests and count else []
        by_fork = {(req.row, req.fork): out for req, out in zip(requests, grown)}
    subtrees = {}
    for r, fs in forks.items():
        grade = grader(tokenizer, answers[r], answer_fallback)
        reward = base_rewards[r] if base_rewards is not None else grade(base.tokens[r])
        subtrees[r] = response_blocks(tokenizer, 0, base.tokens[r], base.entropies[r], reward, sorted(fs),
                                      {f: by_fork.get((r, f), []) for f in fs}, grade, 0,
                                      base.logprobs[r] if base.logprobs else None)
    return subtrees


def branches_on_given_bases(sampler: Sampler, base: BaseBatch, forks: dict[int, list[int]], count: int,
                            max_new_tokens: int, budget: str = "full") -> dict[tuple[int, int], list]:
    """`count` branches at each fork of the given base rows, through engine.Engine.run(given_bases=...):
    {(row, f): [(tokens, entropies, log-probs)]}. Each base row with forks is one engine prompt (N = 1) whose response is
    fed once (prompt + tokens[:-1]: keys/values and the hidden states at the forks) and never resampled; its
    branches join the running batch as in a training rollout. The prompt is prefilled once per row, and a
    base branched by several strategies is fed once per call (the price of leaving the base untouched)."""
    rows = [r for r in sorted(forks) if forks[r] and count]
    if not rows:
        return {}
    limits = {f: T.branch_limit(max_new_tokens, f, budget) for r in rows for f in forks[r]}
    prompt_ids = [base.prompt_ids[r] for r in rows]
    given = {i: [E.Sample(base.tokens[r], base.entropies[r], base.logprobs[r] if base.logprobs else [])]
             for i, r in enumerate(rows)}
    most_rows = len(rows) * (1 + count * max(len(forks[r]) for r in rows))
    engine = sampler.make_engine(prompt_ids, max_new_tokens, most_rows, 1)
    results = engine.run(prompt_ids, 1, max_new_tokens, given_bases=given, keep_hidden=True, progress=False,
                         on_bases_done=lambda i, _: [E.BranchRequest(0, f, count, limits[f])
                                                     for f in sorted(set(forks[rows[i]]))])
    return {(r, f): [(s.tokens, s.entropies, s.logprobs) for s in per]
            for i, r in enumerate(rows) for (_, f), per in results[i].branches.items()}


# --------------------------------------------------------------------------------------------------------
# Attention-based forking (ATB) needs one attention-returning forward pass per base response
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def atb_step_scores(model, prompt_ids: list[int], response_ids: list[int], spans: list[tuple[int, int]],
                    gap: int = 4) -> list[float]:
    """FCI of each step of one response (tree.fci_step_scores) from one attention-returning forward pass.

    The model runs once with eager attention (the only kind that returns weights). Each layer's
    [heads, L, L] weights are reduced to step level [heads, S, S] on the device as they are produced (float64),
    so memory holds one layer's token attention at a time and only [layers·heads, S, S] reaches the CPU — not
    ~2.4 GB of fp32 maps per 1,024-token response.
    """
    per_layer: list[torch.Tensor] = []
    p = len(prompt_ids)

    def keep(module, args, output):
        weights = output[1]
        if weights is None:
            raise RuntimeError("attention weights unavailable: ATB needs eager attention")
        per_layer.append(T.step_attention(weights[0, :, p:, p:], spans))

    previous = model.config._attn_implementation
    handles = [m.register_forward_hook(keep) for name, m in model.named_modules() if name.endswith("self_attn")]
    try:
        model.set_attn_implementation("eager")
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([prompt_ids + response_ids], device=device), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    return T.fci_step_scores(torch.cat(per_layer).cpu().numpy(), gap=gap)


# --------------------------------------------------------------------------------------------------------
# The tree rollout (App. C Algorithm "Tree Rollout" + Sec. 4.1)
# --------------------------------------------------------------------------------------------------------
@dataclass
class RolloutStats:
    base_tokens: int = 0
    branch_tokens: int = 0
    recomputed_prefix_tokens: int = 0
    oom_retries: int = 0                 # retries after running out of memory (smaller chunk, row budget or prefill)
    seconds_base: float = 0.0
    seconds_forks: float = 0.0
    seconds_branches: float = 0.0
    row_steps: int = 0                   # rows × decode steps run
    ended_row_steps: int = 0             # of those, steps on rows that had already ended (generate only)
    peak_kv_bytes: int = 0               # most keys/values held at once
    decode_steps: int = 0                # engine: decode steps run (row_steps / decode_steps = rows per step)
    ahead_row_steps: int = 0             # one-step off-policy: the next step's base rows' share of row_steps
    seconds_ahead: float = 0.0           # decode seconds attributed to them (by their share of each step's rows)


def choose_forks(method: str, k: int, tokenizer, model, prompt_ids, tokens, entropies, rng, cfg) -> list[int]:
    """Forks for one base response, computing what the method needs (sentences, steps, attention)."""
    if k <= 0 or len(tokens) < 2:
        return []
    spans = scores = None
    if method in ("sent-entropy", "atb"):
        text, offsets = T.decode_with_offsets(tokenizer, tokens)
        if method == "sent-entropy":
            spans = T.sentence_spans(text, offsets)
        else:
            spans = T.step_spans(text, offsets)
            scores = atb_step_scores(model, prompt_ids, tokens, spans, gap=cfg.atb_gap)
    return T.select_forks(method, k, entropies, spans=spans, rng=rng, min_dist=cfg.fork_min_dist,
                          step_scores=scores, quantile=cfg.atb_quantile, keep_token=cfg.fork_keeps_token)


def plan_prompt(cfg, budget, expand, rng, tokenizer, model, prompt_ids: list[int], tokens: list[list[int]],
                entropies: list[list[float]], rewards: list[float]):
    """One prompt's tree plan once its N base responses are graded (Sec. 4.1): V(root) = their mean reward,
    (K̂, B̂) = budget(V(root)), and the forks of each response that the method expands."""
    n = len(tokens)
    v_root = sum(rewards) / n
    k_hat, b_hat = budget(v_root)
    chosen = set(range(n)) if expand is None else set(expand(rewards, rng))
    forks = [choose_forks(cfg.fork, k_hat, tokenizer, model, prompt_ids, tokens[j], entropies[j], rng, cfg)
             if b_hat > 0 and j in chosen else [] for j in range(n)]
    return v_root, k_hat, b_hat, forks


def rollout_trees(model, tokenizer, prompts: list[str], answers: list[str], cfg, rng: random.Random,
                  method: M.Method | None = None, levels: list | None = None, progress: bool = True,
                  bases: list | None = None, ahead: list[str] | None = None):
    """Trees for a batch of prompts (Algorithm "Tree Rollout", adaptive per Sec. 4.1).

    method: the methods.py row whose rollout this is (default: cfg.method's). Its `rollout_shape` gives the
    responses per prompt (GRPO: G parallel responses, no branches), the budget v_root -> (K, B) (DATPO's
    adaptive_budget(v, k_max, b_max), or fixed (k_max, b_max)), and which base responses get forks (all, or
    AttnRL's tree.attnrl_expansion).
    progress: one tqdm bar for the rollout (the engine's: tokens, rows and trees; generate's: trees), off when
    stderr is not a terminal. cfg.rollout_engine picks engine.py (default) or HF generate (the
    reference); both return the same trees under greedy decoding. With the engine, prompts are planned in the
    order their bases end, so a method that draws from `rng` (random forks, AttnRL's expansion) draws in that
    order.
    One-step off-policy (offpolicy.py; the engine only): `bases` gives each prompt's N base responses,
    sampled last step, as [tokens, entropies, logprobs] — V(root), K̂, B̂ and forks come from them and only the
    branches are sampled now; `ahead` (the next step's prompts) get their N base responses sampled in the same
    running batch, returned as a third value in the same form. Returns (trees, stats[, ahead_bases]).
    """
    n, budget, expand = (method or M.method_of(cfg)).rollout_shape(cfg)
    sampler = Sampler.from_config(model, tokenizer, cfg)
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    if (bases is not None or ahead is not None) and sampler.engine != "engine":
        raise ValueError("one-step off-policy needs --rollout_engine engine (it folds two steps into one run)")
    if sampler.engine == "engine":
        ahead_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in ahead or []]
        grown, stats, ahead_bases = rollout_with_engine(sampler, tokenizer, prompt_ids, answers, cfg, rng, budget,
                                                        n, expand, progress, bases, ahead_ids)
    else:
        grown, stats = rollout_with_generate(sampler, tokenizer, prompt_ids, answers, cfg, rng, budget, n, expand,
                                             progress)
    t0 = time.perf_counter()
    trees = []
    for i, (samples, rewards, (v_root, k_hat, b_hat, forks), branches) in enumerate(grown):
        grade = grader(tokenizer, answers[i], cfg.answer_fallback)
        blocks: list[T.Block] = []
        for j, ((tokens, entropies, logprobs), fs) in enumerate(zip(samples, forks)):
            blocks += response_blocks(tokenizer, j, tokens, entropies, rewards[j], fs,
                                      {f: branches[(j, f)] for f in fs}, grade, len(blocks), logprobs)
        trees.append(T.Tree(prompt=prompts[i], prompt_ids=prompt_ids[i], answer=answers[i], blocks=blocks,
                            v_root=v_root, k_hat=k_hat, b_hat=b_hat, forks=forks,
                            level=levels[i] if levels else None))
    stats.seconds_branches += time.perf_counter() - t0    # grading the branches is part of growing them
    return (trees, stats) if ahead is None else (trees, stats, ahead_bases)


def rollout_with_engine(sampler, tokenizer, prompt_ids, answers, cfg, rng, budget, n, expand, progress,
                        given=None, ahead_ids=()):
    """All prompts through one engine.Engine: a prompt is planned (plan_prompt) the moment its N bases end, and
    its branches join the running batch. Returns, per prompt, (base samples as (tokens, entropies, log-probs),
    base rewards, plan, {(j, f): [(tokens, entropies, log-probs)]}), the RolloutStats, and the `ahead_ids`
    prompts' N base samples each as [tokens, entropies, logprobs] (one-step off-policy: their rows join the
    same batch, are never branched, and fill the room the branches leave). `given`: the prompts' base
    responses sampled earlier ([tokens, entropies, logprobs] each): prefilled once, not sampled
    (engine.Engine.run)."""
    stats = RolloutStats()
    expandable = min(budget(0.0)) > 0                      # the hardest prompt gets the largest budget
    current = len(prompt_ids)                              # prompts index ≥ current are the next step's
    most_rows = current * n * (1 + (cfg.k_max * cfg.b_max if expandable else 0)) + len(ahead_ids) * n
    engine = sampler.make_engine(prompt_ids + list(ahead_ids), cfg.max_new_tokens, most_rows, n)
    graded, plans = {}, {}
    start = time.perf_counter()
    last_bases_done = start

    def on_bases_done(p: int, samples: list[E.Sample]) -> list[E.BranchRequest]:
        nonlocal last_bases_done
        if p >= current:                                   # the next step's: planned next step
            return []
        t0 = time.perf_counter()
        graded[p] = grade_responses(tokenizer, [s.tokens for s in samples], [answers[p]] * len(samples),
                                    cfg.answer_fallback)
        plans[p] = plan_prompt(cfg, budget, expand, rng, tokenizer, sampler.model, prompt_ids[p],
                               [s.tokens for s in samples], [s.entropies for s in samples], graded[p])
        _, _, b_hat, forks = plans[p]
        last_bases_done = time.perf_counter()
        stats.seconds_forks += last_bases_done - t0
        return [E.BranchRequest(j, f, b_hat, T.branch_limit(cfg.max_new_tokens, f, cfg.branch_budget))
                for j, fs in enumerate(forks) for f in fs]

    given_bases = {p: [E.Sample(*map(list, b)) for b in per] for p, per in enumerate(given)} if given else None
    results = engine.run(prompt_ids + list(ahead_ids), n, cfg.max_new_tokens, on_bases_done,
                         keep_hidden=set(range(current)) if expandable else False, given_bases=given_bases,
                         progress=progress)
    end = time.perf_counter()
    results, ahead_results = results[:current], results[current:]
    # no phase barrier: "base" is until the last prompt's bases ended, "branches" is what ran after
    stats.seconds_base = last_bases_done - start - stats.seconds_forks
    stats.seconds_branches = end - last_bases_done
    stats.base_tokens = 0 if given else sum(len(s.tokens) for res in results for s in res.bases)   # sampled now
    stats.branch_tokens = sum(len(s.tokens) for res in results for per in res.branches.values() for s in per)
    stats.oom_retries = engine.stats["oom_retries"]
    stats.row_steps, stats.ended_row_steps = engine.stats["row_steps"], engine.stats["ended_row_steps"]
    stats.peak_kv_bytes = engine.pool.peak * engine.pool.bytes_per_token
    stats.decode_steps = engine.stats["decode_steps"]
    # A row of L tokens is in L − 1 decode steps (its first token comes with the prefill, no step after it ends):
    # the next step's rows' share of the decode loop, and of its seconds by that share
    stats.ahead_row_steps = sum(len(s.tokens) - 1 for res in ahead_results for s in res.bases)
    stats.seconds_ahead = (end - start - stats.seconds_forks) * stats.ahead_row_steps / max(stats.row_steps, 1)
    ahead_bases = [[[s.tokens, s.entropies, s.logprobs] for s in res.bases] for res in ahead_results]
    grown = [([(s.tokens, s.entropies, s.logprobs) for s in res.bases], graded[p], plans[p],
              {key: [(s.tokens, s.entropies, s.logprobs) for s in per] for key, per in res.branches.items()})
             for p, res in enumerate(results)]
    return grown, stats, ahead_bases


def rollout_with_generate(sampler, tokenizer, prompt_ids, answers, cfg, rng, budget, n, expand, progress):
    """The reference path: HF generate per group of gen_batch_size rows (Phase 1), plan every prompt of the
    group, then its branches in chunks (Phase 2) before the next group starts. Same return as
    rollout_with_engine."""
    stats = RolloutStats()
    grown = []
    per_call = max(1, cfg.gen_batch_size // n)           # whole prompt groups per generate call
    expandable = min(budget(0.0)) > 0                      # the hardest prompt gets the largest budget
    bar = tqdm(total=len(prompt_ids), desc="rollout", unit="tree", leave=False, dynamic_ncols=True,
               disable=None if progress else True)
    for first in range(0, len(prompt_ids), per_call):
        group = list(range(first, min(first + per_call, len(prompt_ids))))
        t0 = time.perf_counter()
        inject.oom_point("base")         # DATPO_OOM_AT=base (tests; the base phase's degradation is the engine's)
        base = sample_base(sampler, [prompt_ids[i] for i in group], n, cfg.max_new_tokens,
                           keep_cache=expandable and not cfg.naive_prefill)
        rewards = grade_responses(tokenizer, base.tokens, [answers[i] for i in group for _ in range(n)],
                                  cfg.answer_fallback)
        stats.base_tokens += sum(map(len, base.tokens))
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, sampler.counts["peak_call_kv_bytes"])
        stats.seconds_base += time.perf_counter() - t0

        t0 = time.perf_counter()
        requests, plans = [], []
        for g, prompt_index in enumerate(group):
            rows = range(g * n, (g + 1) * n)
            plan = plan_prompt(cfg, budget, expand, rng, tokenizer, sampler.model, prompt_ids[prompt_index],
                               [base.tokens[r] for r in rows], [base.entropies[r] for r in rows],
                               [rewards[r] for r in rows])
            _, _, b_hat, forks = plan
            requests += [BranchRequest(r, f, b_hat) for r, fs in zip(rows, forks) for f in fs]
            plans.append(plan)
        stats.seconds_forks += time.perf_counter() - t0

        t0 = time.perf_counter()
        counters: dict = {}
        base_kv = cache_bytes(base.cache)
        sampler.counts["peak_call_kv_bytes"] = 0
        branches = sample_branches(sampler, base, requests, cfg.max_new_tokens, cfg.branch_chunk_size,
                                   cfg.naive_prefill, counters, cfg.branch_budget) if requests else []
        # while branches generate, the base cache stays alive beside each chunk's cache
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, base_kv + sampler.counts["peak_call_kv_bytes"])
        stats.recomputed_prefix_tokens += counters.get("recomputed_prefix_tokens", 0)
        stats.oom_retries += counters.get("oom_retries", 0)
        stats.branch_tokens += sum(len(tok) for per in branches for tok, *_ in per)
        base.cache = base.hidden = None  # free the KV cache before the next group
        by_request = {(req.row, req.fork): out for req, out in zip(requests, branches)}
        for g, plan in enumerate(plans):
            rows = range(g * n, (g + 1) * n)
            grown.append(([(base.tokens[r], base.entropies[r], base.logprobs[r] if base.logprobs else None)
                           for r in rows],
                          [rewards[r] for r in rows], plan,
                          {(j, f): by_request[(r, f)] for j, r in enumerate(rows) for f in plan[3][j]}))
        stats.seconds_branches += time.perf_counter() - t0
        bar.update(len(group))
    bar.close()
    stats.row_steps = sampler.counts.get("row_steps", 0)
    stats.ended_row_steps = sampler.counts.get("ended_row_steps", 0)
    return grown, stats
