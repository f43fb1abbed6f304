"""studies/growth.py — branches from GIVEN forks on a GIVEN base rollout: the Section 3 studies (Sec. 3.2–3.3,
App. C.2, D.5) grow several fork strategies' branches from one fixed base rollout and compare them.

  base = rollout.sample_base(sampler, prompt_ids, n, max_new_tokens, keep_cache=True)
  subtrees = grow_from_forks(sampler, tokenizer, base, {row: forks}, count, answers, max_new_tokens, chunk)

With sampler.engine == "engine" the engine grows them from the given bases (branches_on_given_bases); with
"generate", engine/generate.sample_branches slices the base generation's cache (the reference path; both give
the same subtrees under greedy decoding).
"""
from __future__ import annotations

import torch

import engine as E
import rollout as R
import tree as T
from engine import generate as G


@torch.no_grad()
def grow_from_forks(sampler: R.Sampler, tokenizer, base: G.BaseBatch, forks: dict[int, list[int]],
                    count: int, answers: list[str], max_new_tokens: int, chunk_size: int,
                    answer_fallback: bool = False, base_rewards: list[float] | None = None,
                    length: str = "full") -> dict[int, list[T.Block]]:
    """forks: base row → fork prefix lengths (each branch keeps response[:f]); count: B branches per fork;
    answers: the gold answer of each base row; length: tree.branch_limit's (cfg.branch_length); chunk_size:
    branches per generate call (the engine's row and KV budget decide instead). Returns, per row in `forks`,
    its subtree as blocks: the base response cut at its forks (tree.base_blocks; the last block carries the
    base reward) followed by `count` branch blocks per fork, each rewarded on prefix + continuation as in
    rollout_trees. The base is never modified, so it can be branched again with other forks."""
    if sampler.engine == "engine":
        by_fork = branches_on_given_bases(sampler, base, forks, count, max_new_tokens, length)
    else:
        requests = [E.BranchRequest(r, f, count, T.branch_limit(max_new_tokens, f, length))
                    for r, fs in forks.items() for f in sorted(fs)]
        grown = G.sample_branches(sampler, base, requests, chunk_size) if requests and count else []
        by_fork = {(req.base, req.fork): out for req, out in zip(requests, grown)}
    subtrees = {}
    for r, fs in forks.items():
        grade = R.grader(tokenizer, answers[r], answer_fallback)
        reward = base_rewards[r] if base_rewards is not None else grade(base.tokens[r])
        subtrees[r] = R.response_blocks(tokenizer, 0, base.sample(r), reward, sorted(fs),
                                        {f: by_fork.get((r, f), []) for f in fs}, grade, 0)
    return subtrees


def branches_on_given_bases(sampler: R.Sampler, base: G.BaseBatch, forks: dict[int, list[int]], count: int,
                            max_new_tokens: int, length: str = "full") -> dict[tuple[int, int], list]:
    """`count` branches at each fork of the given base rows, through engine.Engine.run(given_bases=...):
    {(row, f): [Sample]}. Each base row with forks is one engine prompt (N = 1) whose response is fed once
    (prompt + tokens[:-1]: keys/values and the hidden states at the forks) and never resampled; its branches
    join the running batch as in a training rollout. The prompt is prefilled once per row, and a base
    branched by several strategies is fed once per call (the price of leaving the base untouched)."""
    rows = [r for r in sorted(forks) if forks[r] and count]
    if not rows:
        return {}
    limits = {f: T.branch_limit(max_new_tokens, f, length) for r in rows for f in forks[r]}
    prompt_ids = [base.prompt_ids[r] for r in rows]
    given = {i: [base.sample(r)] for i, r in enumerate(rows)}
    most_rows = len(rows) * (1 + count * max(len(forks[r]) for r in rows))
    engine = sampler.make_engine(prompt_ids, max_new_tokens, most_rows, 1)
    for done in engine.run(prompt_ids, 1, max_new_tokens, given_bases=given, keep_hidden=True,
                           progress=False):
        engine.grow(done.prompt, [E.BranchRequest(0, f, count, limits[f])
                                  for f in sorted(set(forks[rows[done.prompt]]))])
    return {(r, f): per for i, r in enumerate(rows) for (_, f), per in engine.results[i].branches.items()}
