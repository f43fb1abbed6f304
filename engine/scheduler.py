"""engine/scheduler.py — which rows decode this step: admission within a row and a KV budget, and what the
engine does when the device runs out of memory.

A row is one sequence being decoded (a base response or a branch). Work waits in two queues: rows created
but not decoding (`waiting`: branches, rows that took turns) go first, then prompts not yet admitted
(`waiting_prompts`). A row is admitted only when at most `max_rows` rows decode and the KV pool can hold every
running row's remaining budget plus its own, so the pool never runs out mid-step (App. F: no barrier between
a prompt's bases and its branches; ended rows make room at once).

Out of memory (the Backoff): a decode step of several rows halves the row budget and the rows beyond it wait
their turn; a prefill beside decoding rows waits until their number has halved, and a prefill alone is fed in
chunks of half its tokens. What fit is remembered in a Backoff kept by whoever outlives one engine (a
training run's Setup, a Sampler), so later engines of the same run start there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine.kv import KVPool, pages_needed
from engine.samples import Sample


@dataclass
class Backoff:
    """What running out of memory taught, per device (str(device)): the rows per decode step that fit, and
    the longest prefill forward (tokens) that fit with no row decoding."""
    rows: dict[str, int] = field(default_factory=dict)
    prefill_tokens: dict[str, int] = field(default_factory=dict)


@dataclass
class DecodeRow:
    """One sequence the engine decodes: a base response (fork None) or a branch at fork f of base j."""
    id: int
    prompt: int                  # index of its prompt
    base: int                    # j: the base response it is or descends from
    fork: int | None             # None for a base row; f for a branch (it continues base tokens[:f])
    slots: list[int]             # pool slots of its context: prompt + tokens so far, except the last one
    limit: int                   # budget of new tokens
    out: Sample = field(default_factory=Sample)
    hidden: list | None = None   # base rows that may branch: hidden[t] produced the distribution of token t

    def push(self, token: int, entropy: float, logprob: float, hidden, stop_ids: set[int]) -> bool:
        """Append a sampled token; True when the row has ended (stop id kept, or budget reached)."""
        self.out.tokens.append(token)
        self.out.entropies.append(entropy)
        self.out.logprobs.append(logprob)
        if self.hidden is not None:
            self.hidden.append(hidden)
        return token in stop_ids or len(self.out.tokens) >= self.limit


class Scheduler:
    """The queues of one engine (`start` resets them per run) and its budgets: `max_rows` rows decoded at once
    and the KV pool. `backoff` is read at creation and written when memory runs out."""

    def __init__(self, pool: KVPool, max_rows: int, backoff: Backoff):
        self.pool, self.backoff = pool, backoff
        self.device = str(pool.device)
        self.max_rows = min(max_rows, backoff.rows.get(self.device, max_rows))
        self.prefill_chunk = backoff.prefill_tokens.get(self.device)   # None: a prompt in one forward
        self.start(0)

    def start(self, prompts: int) -> None:
        self.waiting_prompts = deque(range(prompts))
        self.waiting: deque[DecodeRow] = deque()     # created rows not yet decoding (branches, preempted)
        self.active: list[DecodeRow] = []           # rows decoding
        self.prefill_wait: int | None = None         # after a prefill ran out of memory: admit prompts
                                                     # again once at most this many rows decode

    def busy(self) -> bool:
        return bool(self.waiting_prompts or self.waiting or self.active)

    def room(self, rows: list[DecodeRow], extra: int = 0, extra_rows: int = 0) -> bool:
        """Rows fit, and the pool can hold every running row's and these rows' remaining budget, plus
        `extra` tokens spread over `extra_rows` more rows (in pages: kv.pages_needed; one-token pages:
        tokens)."""
        page = self.pool.page
        growth = sum(pages_needed(r.limit - len(r.out.tokens), page, 1) for r in self.active + rows)
        return (len(self.active) + len(rows) <= self.max_rows
                and growth + pages_needed(extra, page, extra_rows) <= len(self.pool.free))

    def next_prompt(self) -> int | None:
        """Waiting rows join the decoding ones while room is left; then the prompt to admit next, or None:
        rows still wait for room (they go first), no prompt waits, or a prefill ran out of memory and more
        than prefill_wait rows decode."""
        while self.waiting and self.room([self.waiting[0]]):
            self.active.append(self.waiting.popleft())
        if self.waiting or not self.waiting_prompts:
            return None
        if self.prefill_wait is not None and len(self.active) > self.prefill_wait:
            return None
        return self.waiting_prompts[0]

    def admitted(self) -> None:
        """The prompt next_prompt named is in."""
        self.waiting_prompts.popleft()
        self.prefill_wait = None

    def place(self, row: DecodeRow) -> None:
        """A new row that has not ended: it decodes if there is room, else it waits."""
        (self.active if self.room([row]) else self.waiting).append(row)

    def fewer_rows(self) -> None:
        """A decode step of several rows ran out of memory: decode at most half of them from now on
        (remembered for this device); the rest wait their turn."""
        self.max_rows = self.backoff.rows[self.device] = max(1, len(self.active) // 2)
        self.waiting.extendleft(reversed(self.active[self.max_rows:]))
        del self.active[self.max_rows:]
        free_cached_memory()

    def prefill_failed(self, err: BaseException, tokens: int) -> None:
        """A prefill forward of `tokens` tokens (a prompt or a given response) ran out of memory; nothing of
        the prompt was kept. With rows decoding, the prompt waits until their number has halved (their
        activations are what filled the memory; as rows end, the next prompt takes their place). Alone, it is
        fed in chunks of half the tokens (remembered for this device), down to one token; only then the error
        is raised."""
        if not self.active and tokens <= 1:
            raise err
        if self.active:
            self.prefill_wait = len(self.active) // 2
        else:
            self.prefill_chunk = self.backoff.prefill_tokens[self.device] = tokens // 2
        free_cached_memory()


def free_cached_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
