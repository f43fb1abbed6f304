"""engine/samples.py — what goes into an engine and what comes out of it.

  Sample         one generated response: its tokens, and for each token H_t of the distribution it was
                 sampled from (App. D.1) and log p(token) under it (the behaviour policy's, one-step
                 off-policy). The one response type of the project: the engines, rollout.py and offpolicy.py
                 pass Samples around; tree.Block cuts them into blocks.
  BranchRequest  B̂ branches from fork f of base response j (App. C, Sec. 4.1).
  BasesDone      the event an engine yields when a prompt's N base responses have all ended.
  PromptResult   one prompt's samples: its N bases, and its branches by (j, f).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One generated sequence: tokens, H_t of each token's sampling distribution, log p(token) under it
    (None when not recorded)."""
    tokens: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)


@dataclass
class BranchRequest:
    """`count` branches that keep base response `base`'s tokens[:fork] and sample from token `fork` on, each
    with a budget of `limit` new tokens (tree.branch_limit). `base`: j among the prompt's N base responses
    (the generate path: a row of its BaseBatch)."""
    base: int
    fork: int
    count: int
    limit: int


@dataclass
class BasesDone:
    """Prompt `prompt`'s N base responses have ended (in order j = 0..N−1). The engine waits for the caller's
    answer, engine.grow(prompt, requests), before it decodes on (no answer: no branches)."""
    prompt: int
    samples: list[Sample]


@dataclass
class PromptResult:
    bases: list[Sample]
    branches: dict = field(default_factory=dict)      # (j, f) -> list[Sample]
