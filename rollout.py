"""rollout.py — sample base responses and grow difficulty-adaptive trees.

Paper: Sec. 3.2 and App. C (Algorithm "Tree Rollout"), Sec. 4.1 (difficulty-adaptive tree search),
App. D (forking strategies).

One call of `rollout_trees`, for a batch of prompts:
  Bases     N base responses per prompt; every token comes with H_t and log p(token) under the
            distribution it was sampled from (after temperature/top-k/top-p): an engine.Sample each.
  Budget    the moment a prompt's N bases have ended (the engine yields BasesDone): their rewards →
            V(root) = their mean → (K̂, B̂) (tree.adaptive_budget, or fixed (K, B)), and
            tree.select_forks on each response (plan_prompt → tree.ForkPlan).
  Branches  B̂ branches from each fork (engine.Engine.grow): they join the running batch.
  Blocks    tree.base_blocks + one terminal block per branch → a tree.Tree per prompt
            (response_blocks).
The blocks carry H_t and log p of their tokens (tree.Block.entropies / .logprobs), so a later update
can tell the behaviour policy's log-probs from its own (one-step off-policy).

Two engines behind one interface (cfg.rollout_engine; Sampler):
  engine    (default) engine/: one decode loop for all prompts; rows leave when they end, a
            prompt's branches start the moment its bases end; prefixes are shared in a slot pool.
  generate  engine/generate.py: HF `generate`, group by group; the reference path and the test
            oracle (greedy decoding gives the same trees token for token).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

import atb
import engine
import methods
import tree
from engine import generate
from engine.generate import BaseBatch
from reward import compute_reward

# --------------------------------------------------------------------------------------------------
# How to sample: the model's stop ids, the sampling distribution, the engine
# --------------------------------------------------------------------------------------------------
STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|end|>", "<|eot_id|>", "<|eot|>")


def stop_token_ids(tokenizer, model) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS and pad, the model's generation EOS ids,
    and the end-of-document / end-of-turn tokens the authors' release also stops on (STOP_TOKENS;
    the release has no stop strings). A base model given the release's plain-text prompt ends its
    answer with its document end (<|endoftext|> for Qwen2.5), an instruct model with <|im_end|>;
    both are stop ids whatever the prompt."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    gen_eos = model.generation_config.eos_token_id
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in STOP_TOKENS if t in vocab)
    return sorted(i for i in ids if i is not None)


@dataclass
class Sampler:
    """What every sampling call needs: the model, its stop ids and pad id, the sampling
    distribution, and which engine generates (cfg.rollout_engine) with its sizes."""
    model: torch.nn.Module
    stop_ids: list[int]
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    engine: str = "generate"             # "engine": engine/'s decode loop; "generate": HF generate
    max_rows: int = 64                   # engine: rows decoded at once
    max_kv_tokens: int = 0               # engine: KV pool tokens; 0 = the
                                         # prompts + max_rows × max_new_tokens
    compile_decode: bool = False         # engine: decode steps through torch.compile
    # engine: what running out of memory taught
    # (a lambda: in this class body `engine` is the field above)
    backoff: engine.Backoff = field(default_factory=lambda: engine.Backoff())
    decode: str = "reference"            # engine: its decode step (--decode_step; engine/paged.py)

    @classmethod
    def from_config(cls, model, tokenizer, cfg, backoff: engine.Backoff | None = None) -> "Sampler":
        return cls(model, stop_token_ids(tokenizer, model), tokenizer.pad_token_id,
                   cfg.temperature, cfg.top_k, cfg.top_p, cfg.rollout_engine,
                   cfg.max_batch_rows or max(cfg.gen_batch_size, cfg.branch_chunk_size),
                   cfg.max_kv_tokens,
                   compile_decode=cfg.compile_decode, backoff=backoff or engine.Backoff(),
                   decode=cfg.decode_step)

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """temperature, top-k, top-p applied to [rows, vocab] scores,
        exactly as generate applies them."""
        for warper in generate.sampling_processors(self.temperature, self.top_k, self.top_p):
            scores = warper(None, scores)
        return scores

    @property
    def device(self):
        return next(self.model.parameters()).device

    def make_engine(self, prompt_ids: list[list[int]], max_new_tokens: int, rows: int, n: int = 0,
                    trace: bool = False) -> engine.Engine:
        """An engine.Engine for at most `rows` rows in all. Its pool holds, unless max_kv_tokens
        says otherwise, every prompt once plus max_new_tokens for each of min(max_rows, rows) rows
        (prefixes are shared, so a row's own tokens are what it adds; rows that do not fit wait for
        room), plus one prompt's N ended base rows kept for its forks while more than max_rows of
        them take turns."""
        capacity = self.max_kv_tokens or \
            (min(self.max_rows, rows) + n) * max_new_tokens + sum(map(len, prompt_ids))
        return engine.Engine(self.model, self.stop_ids, self.warp, self.max_rows, capacity,
                             trace=trace, compile_decode=self.compile_decode, backoff=self.backoff,
                             decode=self.decode)


@torch.no_grad()
def sample_base(sampler: Sampler, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                keep_cache: bool = False) -> BaseBatch:
    """N samples per prompt, rows prompt-major (evaluation, the Section 3 studies). With
    sampler.engine == "engine" engine/ samples them and keep_cache keeps nothing (studies/growth.py
    feeds the bases to the engine again); with "generate", engine/generate.generate_bases
    (keep_cache: the KV cache and hidden states that branches reuse)."""
    if sampler.engine != "engine":
        return generate.generate_bases(sampler, prompt_ids, n, max_new_tokens, keep_cache)
    decoder = sampler.make_engine(prompt_ids, max_new_tokens, len(prompt_ids) * n, n)
    # callers draw their own bars
    for _ in decoder.run(prompt_ids, n, max_new_tokens, progress=False):
        pass                                                              # no branches
    samples = [s for res in decoder.results for s in res.bases]
    return BaseBatch([p for p in prompt_ids for _ in range(n)], [s.tokens for s in samples],
                     [s.entropies for s in samples], logprobs=[s.logprobs for s in samples])


# --------------------------------------------------------------------------------------------------
# The tree rollout (App. C Algorithm "Tree Rollout" + Sec. 4.1)
# --------------------------------------------------------------------------------------------------
@dataclass
class RolloutStats:
    base_tokens: int = 0
    branch_tokens: int = 0
    recomputed_prefix_tokens: int = 0
    oom_retries: int = 0                 # retries after running out of memory
                                         # (chunk, row budget or prefill)
    seconds_base: float = 0.0
    seconds_forks: float = 0.0
    seconds_branches: float = 0.0
    row_steps: int = 0                   # rows × decode steps run
    ended_row_steps: int = 0             # of those, steps on rows that had already ended
                                         # (generate only)
    peak_kv_bytes: int = 0               # most keys/values held at once
    decode_steps: int = 0                # engine: decode steps run
                                         # (row_steps / decode_steps = rows per step)
    ahead_row_steps: int = 0             # one-step off-policy: the next step's base rows' share of
                                         # row_steps
    seconds_ahead: float = 0.0           # decode seconds attributed to them
                                         # (their share of each step's rows)


def choose_forks(strategy: str, k: int, tokenizer, model, prompt_ids, tokens, entropies, rng,
                 cfg) -> list[int]:
    """Forks for one base response by the forking strategy (--fork), computing what it needs
    (sentences, steps, attention)."""
    if k <= 0 or len(tokens) < 2:
        return []
    spans = scores = None
    if strategy in ("sent-entropy", "atb"):
        text, offsets = tree.decode_with_offsets(tokenizer, tokens)
        if strategy == "sent-entropy":
            spans = tree.sentence_spans(text, offsets)
        else:
            spans = tree.step_spans(text, offsets)
            scores = atb.step_scores(model, prompt_ids, tokens, spans, gap=cfg.atb_gap)
    return tree.select_forks(strategy, k, entropies, spans=spans, rng=rng,
                             min_dist=cfg.fork_min_dist, step_scores=scores,
                             quantile=cfg.atb_quantile, keep_token=cfg.fork_keeps_token)


def plan_prompt(cfg, budget, expand, rng, tokenizer, model, prompt_ids: list[int],
                bases: list[engine.Sample], rewards: list[float]) -> tree.ForkPlan:
    """One prompt's tree plan once its N base responses are graded (Sec. 4.1): V(root) = their mean
    reward, (K̂, B̂) = budget(V(root)), and the forks of each response that the method expands."""
    n = len(bases)
    v_root = sum(rewards) / n
    k_hat, b_hat = budget(v_root)
    chosen = set(range(n)) if expand is None else set(expand(rewards, rng))
    forks = [choose_forks(cfg.fork, k_hat, tokenizer, model, prompt_ids, bases[j].tokens,
                          bases[j].entropies, rng, cfg) if b_hat > 0 and j in chosen else []
             for j in range(n)]
    return tree.ForkPlan(v_root, k_hat, b_hat, forks)


def rollout_trees(model, tokenizer, prompts: list[str], answers: list[str], cfg, rng: random.Random,
                  method: methods.Method | None = None, levels: list | None = None,
                  progress: bool = True, bases: list | None = None, ahead: list[str] | None = None,
                  backoff: engine.Backoff | None = None, score=None):
    """Trees for a batch of prompts (Algorithm "Tree Rollout", adaptive per Sec. 4.1).

    method: the methods.py row whose rollout this is (default: cfg.method's). Its `rollout_shape`
    gives the responses per prompt (GRPO: G parallel responses, no branches), the budget v_root ->
    (K, B) (DATPO's adaptive_budget(v, k_max, b_max), or fixed (k_max, b_max)), and which base
    responses get forks (all, or AttnRL's tree.attnrl_expansion).
    progress: one tqdm bar for the rollout (the engine's: tokens, rows and trees; generate's:
    trees), off when stderr is not a terminal. cfg.rollout_engine picks engine/ (default) or HF
    generate (the reference); both return the same trees under greedy decoding. Prompts are planned
    in the order their bases end, so a method that draws from `rng` (random forks, AttnRL's
    expansion) draws in that order. One-step off-policy (offpolicy.py; the engine only): `bases`
    gives each prompt's N base responses (engine.Samples), sampled last step — V(root), K̂, B̂ and
    forks come from them and only the branches are sampled now; `ahead` (the next step's prompts)
    get their N base responses sampled in the same running batch, returned as a third value (Samples
    per prompt). backoff: what running out of memory taught earlier steps' engines (kept by the
    caller). score: (prompt's index, token id lists of its completions) -> their rewards, in place
    of the binary grader (reward.compute_reward against answers[i]): training passes the harness's
    (harness/reward_guard.scorer: the grader or --reward's functions, a call that raises scores 0).
    Returns (trees, stats[, ahead_bases]).
    """
    n, budget, expand = (method or methods.method_of(cfg)).rollout_shape(cfg)
    sampler = Sampler.from_config(model, tokenizer, cfg, backoff)
    prompt_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    ahead_ids = [tokenizer(p, add_special_tokens=False).input_ids for p in ahead or []]
    if (bases is not None or ahead is not None) and sampler.engine != "engine":
        raise ValueError("one-step off-policy needs --rollout_engine engine "
                         "(it folds two steps into one run)")
    expandable = min(budget(0.0)) > 0                      # the hardest prompt gets the largest
                                                           # budget
    decoder = rollout_engine(sampler, cfg, prompt_ids, ahead_ids, n, expandable)

    rewards, plans = {}, {}
    clock = Clock()
    for done in decoder.run(prompt_ids + ahead_ids, n, cfg.max_new_tokens, progress=progress,
                           keep_hidden=set(range(len(prompt_ids))) if expandable else False,
                           given_bases=dict(enumerate(bases)) if bases else None):
        p = done.prompt
        if p >= len(prompt_ids):                           # the next step's: planned next step
            continue
        t0 = time.perf_counter()
        tokens = [s.tokens for s in done.samples]
        rewards[p] = score(p, tokens) if score else \
            grade_responses(tokenizer, tokens, [answers[p]] * n, cfg.answer_fallback)
        plans[p] = plan_prompt(cfg, budget, expand, rng, tokenizer, model, prompt_ids[p],
                               done.samples, rewards[p])
        clock.planned(t0)
        decoder.grow(p, branch_requests(plans[p], cfg))
    clock.end = time.perf_counter()
    stats = (engine_stats(decoder, len(prompt_ids), bool(bases), clock)
             if sampler.engine == "engine" else generate_stats(decoder, clock))

    t0 = time.perf_counter()
    trees = [tree_of(tokenizer, prompts[i], prompt_ids[i], answers[i], result, rewards[i], plans[i],
                     cfg, levels[i] if levels else None,
                     (lambda ids, i=i: score(i, [ids])[0]) if score else None)
             for i, result in enumerate(decoder.results[:len(prompt_ids)])]
    # grading the branches is part of growing them
    stats.seconds_branches += time.perf_counter() - t0
    ahead_bases = [result.bases for result in decoder.results[len(prompt_ids):]]
    return (trees, stats) if ahead is None else (trees, stats, ahead_bases)


def rollout_engine(sampler: Sampler, cfg, prompt_ids: list[list[int]], ahead_ids: list[list[int]],
                   n: int, expandable: bool) -> engine.Engine | generate.GenerateEngine:
    """The engine cfg.rollout_engine names, sized for every row the trees (and the next step's
    bases) can have: N(1 + K_max·B_max) per prompt when a prompt can branch, N per next-step
    prompt."""
    if sampler.engine != "engine":
        return generate.GenerateEngine(sampler, cfg.gen_batch_size, cfg.branch_chunk_size)
    branches_per_base = cfg.k_max * cfg.b_max if expandable else 0
    most_rows = len(prompt_ids) * n * (1 + branches_per_base) + len(ahead_ids) * n
    return sampler.make_engine(prompt_ids + ahead_ids, cfg.max_new_tokens, most_rows, n)


def branch_requests(plan: tree.ForkPlan, cfg) -> list[engine.BranchRequest]:
    """B̂ branches at each fork of the plan, each with its limit of new tokens
    (tree.branch_limit)."""
    return [engine.BranchRequest(j, f, plan.b_hat,
                                 tree.branch_limit(cfg.max_new_tokens, f, cfg.branch_length))
            for j, forks in enumerate(plan.forks) for f in forks]


def tree_of(tokenizer, prompt: str, prompt_ids: list[int], answer: str, result: engine.PromptResult,
            rewards: list[float], plan: tree.ForkPlan, cfg, level, grade=None) -> tree.Tree:
    """One prompt's tree: each base response cut at its forks, then its branches (response_blocks),
    each graded by `grade` (ids -> reward; default: the grader against `answer`)."""
    grade = grade or grader(tokenizer, answer, cfg.answer_fallback)
    blocks: list[tree.Block] = []
    for j, (base, forks) in enumerate(zip(result.bases, plan.forks)):
        blocks += response_blocks(tokenizer, j, base, rewards[j], forks,
                                  {f: result.branches[(j, f)] for f in forks}, grade, len(blocks))
    return tree.Tree(prompt=prompt, prompt_ids=prompt_ids, answer=answer, blocks=blocks,
                     v_root=plan.v_root, k_hat=plan.k_hat, b_hat=plan.b_hat, forks=plan.forks,
                     level=level)


@dataclass
class Clock:
    """Wall-clock of one rollout: when it started, the seconds spent planning (grading the bases,
    V(root), K̂, B̂, forks) and when the last prompt was planned."""
    start: float = field(default_factory=time.perf_counter)
    forks: float = 0.0
    last_planned: float = 0.0
    end: float = 0.0

    def __post_init__(self):
        self.last_planned = self.start

    def planned(self, since: float) -> None:
        self.last_planned = time.perf_counter()
        self.forks += self.last_planned - since


def engine_stats(decoder: engine.Engine, current: int, given: bool, clock: Clock) -> RolloutStats:
    """The engine's counts. No phase barrier: "base" is until the last prompt's bases ended,
    "branches" is what ran after. Prompts index ≥ current are the next step's (one-step off-policy):
    a row of L tokens is in L − 1 decode steps (its first token comes with the prefill, no step
    after it ends), so their share of the decode loop, and of its seconds by that share."""
    results, ahead_results = decoder.results[:current], decoder.results[current:]
    stats = RolloutStats(seconds_forks=clock.forks, seconds_branches=clock.end - clock.last_planned,
                         seconds_base=clock.last_planned - clock.start - clock.forks)
    stats.base_tokens = (0 if given else
                         sum(len(s.tokens) for res in results for s in res.bases))   # sampled
    stats.branch_tokens = sum(len(s.tokens) for res in results for per in res.branches.values()
                              for s in per)
    stats.oom_retries = decoder.stats["oom_retries"]
    stats.row_steps, stats.ended_row_steps = (decoder.stats["row_steps"],
                                              decoder.stats["ended_row_steps"])
    stats.peak_kv_bytes = decoder.pool.peak * decoder.pool.bytes_per_token
    stats.decode_steps = decoder.stats["decode_steps"]
    stats.ahead_row_steps = sum(len(s.tokens) - 1 for res in ahead_results for s in res.bases)
    decode_seconds = clock.end - clock.start - clock.forks
    stats.seconds_ahead = decode_seconds * stats.ahead_row_steps / max(stats.row_steps, 1)
    return stats


def generate_stats(decoder: generate.GenerateEngine, clock: Clock) -> RolloutStats:
    """The reference path's counts: its phases run one after the other, group by group."""
    c = decoder.counters
    return RolloutStats(base_tokens=c["base_tokens"], branch_tokens=c["branch_tokens"],
                        recomputed_prefix_tokens=c["recomputed_prefix_tokens"],
                        oom_retries=c["oom_retries"],
                        seconds_base=decoder.seconds["base"], seconds_forks=clock.forks,
                        seconds_branches=decoder.seconds["branches"], row_steps=c["row_steps"],
                        ended_row_steps=c["ended_row_steps"], peak_kv_bytes=c["peak_kv_bytes"])


def response_blocks(tokenizer, j: int, base: engine.Sample, reward: float, forks: list[int],
                    branches: dict[int, list[engine.Sample]], grade,
                    first_index: int) -> list[tree.Block]:
    """The blocks of one base response's subtree (App. C): the response cut at its forks
    (tree.base_blocks; the last block carries its reward) followed, fork by fork,
    by one terminal block per branch.

    branches: f -> the branches grown at f (continuations from token f on); grade(ids) -> reward of
    the whole root-to-leaf response ids = tokens[:f] + branch; first_index: where these blocks start
    in the tree's block list. The blocks carry the Samples' generation-time log-probs (None:
    unknown). rollout_trees and studies/growth.py both build blocks here.
    """
    blocks, ends_at = tree.base_blocks(j, base.tokens, base.entropies, reward, forks, first_index,
                                       base.logprobs)
    for block in blocks:
        block.text = tokenizer.decode(block.token_ids, skip_special_tokens=True)
    for f in forks:
        grown = branches.get(f, [])
        texts = tokenizer.batch_decode([s.tokens for s in grown], skip_special_tokens=True)
        for s, text in zip(grown, texts):
            blocks.append(tree.Block(parent=ends_at[f], token_ids=s.tokens, entropies=s.entropies,
                                     text=text, reward=grade(base.tokens[:f] + s.tokens), base=j,
                                     start=f, branch=True, logprobs=s.logprobs))
    return blocks


def grade_responses(tokenizer, token_lists: list[list[int]], answers: list[str],
                    fallback: bool) -> list[float]:
    """0/1 verifiable reward of each response (reward.compute_reward on its decoded text),
    answers[i] its gold."""
    texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
    return [compute_reward(text, answer, fallback) for text, answer in zip(texts, answers)]


def grader(tokenizer, answer: str, fallback: bool):
    """ids -> reward of the decoded response (reward.compute_reward)."""
    return lambda ids: compute_reward(tokenizer.decode(ids, skip_special_tokens=True), answer,
                                      fallback)
