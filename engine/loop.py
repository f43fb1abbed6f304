"""engine.py — a small tree rollout engine: our own decode loop over the HF model's forward.

Paper: App. C (Algorithm "Tree Rollout"), Sec. 4.1 (difficulty-adaptive budget), App. E (the runtime table:
"branch rollouts cannot commence until the base rollouts are fully generated" is what this engine removes).

What it does differently from HF `generate` (rollout.py keeps that path as the reference):
  * Rows leave the batch the step they end (stop id or budget): no decode step is ever spent on an ended row.
  * No barrier per group: the moment a prompt's N base responses have ended, `on_bases_done` (rollout.py:
    rewards → V(root) → K̂, B̂ → forks) returns its branch requests and the branches join the running batch
    while other prompts' base responses are still decoding. Waiting work (branches first, then new prompts)
    fills the room freed by ended rows, within a budget of rows (`max_rows`) and KV tokens (`max_kv_tokens`).
  * Keys/values live in one pre-allocated pool per layer, [capacity, 2, H_kv, d], written in place. A row's
    context is a list of pool slots (a block table with 1-token pages). A prompt is prefilled once and its N
    base rows point at the same slots; a branch at fork f points at its base row's first P + f slots. So a
    prefix is shared by reference: zero copies per fork or branch, and no prefix token is recomputed.
    Slots are reference-counted and return to the free list when the last row reading them is done.
  * For every sampled token it records H_t of the sampling distribution (after temperature/top-k/top-p), the
    log-probability of the sampled token under that distribution, and (base rows) the final hidden state, so a
    branch's first token is sampled from the distribution at its fork without running the prefix again.
  * Base responses can also be given (`run(given_bases=...)`): the Section 3 studies grow several fork
    strategies' branches on one fixed base rollout (Sec. 3.2–3.3, App. C.2, D.5), and one-step off-policy
    samples a step's bases with the previous weights. Their tokens are fed once (prefill, no sampling) to
    write the prefix keys/values and hidden states the branches need.

Attention runs through a registered HF attention function ("datpo_engine"): each layer writes the new tokens'
keys/values into their slots, gathers each row's context slots and calls SDPA with a [rows, 1, q, T] mask.
The gather reads the context once per step (as DynamicCache's torch.cat does); on a GPU, a paged kernel
(flash-attn's block_table) could read the pool directly — left for later.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from harness import inject

from harness import oom
ATTENTION = "datpo_engine"
# Rows per step that fit after running out of memory, per device: later engines (next steps) start there.
ROWS_AFTER_OOM: dict[str, int] = {}
# Longest prefill forward (tokens) that fit after a prefill ran out of memory with no row decoding, per device.
PREFILL_AFTER_OOM: dict[str, int] = {}


# --------------------------------------------------------------------------------------------------------
# KV storage: one pool of slots per layer, reference-counted
# --------------------------------------------------------------------------------------------------------
class KVPool:
    """Keys and values of up to `capacity` tokens for every layer, allocated once. A slot holds one token's
    keys and values; `refs[s]` counts the rows whose context reads slot s (a shared prefix is read by many)."""

    def __init__(self, model, capacity: int, device, dtype):
        cfg = model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = [torch.empty(capacity, 2, kv_heads, head_dim, device=device, dtype=dtype)
                       for _ in range(cfg.num_hidden_layers)]
        self.capacity = capacity
        self.bytes_per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self.refs = [0] * capacity
        self.free = list(range(capacity - 1, -1, -1))   # a stack: low slots first
        self.peak = 0

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"engine KV pool exhausted: {n} slots wanted, {len(self.free)} free "
                               f"(a scheduling bug: admission reserves every row's budget)")
        slots = [self.free.pop() for _ in range(n)]
        for s in slots:
            self.refs[s] = 1
        self.peak = max(self.peak, self.used)
        return slots

    def retain(self, slots: list[int]) -> None:
        for s in slots:
            self.refs[s] += 1

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                self.free.append(s)


@dataclass
class StepKV:
    """What one forward pass tells the attention function: where the new tokens' keys/values go
    (`write` [rows, q]), which slots each row reads (`read` [rows, T], padded) and the mask [rows, 1, q, T]."""
    pool: KVPool
    write: torch.Tensor
    read: torch.Tensor
    mask: torch.Tensor


def engine_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, engine_kv=None,
                     **kwargs):
    """HF attention function: query [rows, H, q, d], key/value [rows, H_kv, q, d] of the new tokens →
    output [rows, q, H, d]. Writes the new keys/values into their pool slots, then attends over each row's
    context slots (prefix, shared or not, + the new tokens)."""
    pool = engine_kv.pool.layers[module.layer_idx]
    pool[engine_kv.write] = torch.stack((key, value), dim=1).permute(0, 3, 1, 2, 4).to(pool.dtype)
    context = pool[engine_kv.read].to(query.dtype)                    # [rows, T, 2, H_kv, d]
    keys, values = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=engine_kv.mask,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, engine_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


@contextlib.contextmanager
def attention_backend(model):
    """The attention layers read config._attn_implementation at every forward."""
    old = model.config._attn_implementation
    model.config._attn_implementation = register_attention()
    try:
        yield
    finally:
        model.config._attn_implementation = old


def decode_hidden(model, input_ids, position_ids, kv: StepKV) -> torch.Tensor:
    """One forward of the model (the root, as in Engine._forward) → the final hidden state [rows, q, d]:
    output_hidden_states' last entry is the final norm's output; no logits (an empty logits_to_keep)."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=kv.mask, use_cache=False,
                engine_kv=kv, logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
                output_hidden_states=True)
    return out.hidden_states[-1]


_COMPILED = []


def compiled_decode():
    """decode_hidden through torch.compile(dynamic=True), built once per process: rows, context width and
    pool size change every step, so they are symbolic rather than a recompile each. The pool is written in
    place inside the graph (index_put on a graph input); masks and slot tables are inputs, so one graph
    serves every step. Inductor needs a C++ compiler on CPU and Triton on CUDA. Measured on CPU only (no GPU
    here; docs/measurements.md), not tried under torchrun."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(decode_hidden, dynamic=True))
    return _COMPILED[0]


# --------------------------------------------------------------------------------------------------------
# Rows and results
# --------------------------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One generated sequence: tokens, H_t of each token's sampling distribution, log p(token) under it."""
    tokens: list[int] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Row:
    id: int
    prompt: int                  # index of its prompt
    base: int                    # j: the base response it is or descends from
    fork: int | None             # None for a base row; f for a branch (it continues base tokens[:f])
    slots: list[int]             # pool slots of its context: prompt + tokens so far, except the last one
    limit: int                   # budget of new tokens
    out: Sample = field(default_factory=Sample)
    hidden: list | None = None   # base rows with forks to come: hidden[t] produced the distribution of token t


@dataclass
class BranchRequest:
    base: int     # j: which of the prompt's base responses
    fork: int     # f: keep response[:f], sample from token f on
    count: int    # B̂ branches
    limit: int    # each one's budget of new tokens (tree.branch_limit)


@dataclass
class PromptResult:
    bases: list[Sample]
    branches: dict = field(default_factory=dict)      # (j, f) -> list[Sample]


@dataclass
class RunState:
    """What one Engine.run call tracks (a fresh one per call): its arguments, the results so far, and the
    work in each state — prompts not yet admitted, rows waiting for room, rows decoding."""
    prompts: list[list[int]]
    n: int
    max_new_tokens: int
    on_bases_done: object
    keep_hidden: bool | set[int]
    on_tree_done: object
    given_bases: dict[int, list[Sample]]
    results: list[PromptResult] = field(default_factory=list)
    bases_left: list[int] = field(default_factory=list)   # per prompt: base rows not yet ended
    rows_left: list[int] = field(default_factory=list)    # per prompt: rows of its tree not yet ended
    base_rows: dict[int, list[Row]] = field(default_factory=dict)   # ended base rows, until their bases are done
    waiting_prompts: deque = field(default_factory=deque)
    waiting: deque = field(default_factory=deque)        # created rows not yet decoding (branches, preempted)
    active: list[Row] = field(default_factory=list)
    bar: object = None                                    # the tqdm bar, and what it shows:
    sampled: int = 0                                      # tokens sampled (given bases are not)
    rows_started: int = 0
    rows_done: int = 0
    trees_done: int = 0
    prefill_wait: int | None = None                       # after a prefill ran out of memory: admit prompts
                                                          # again once at most this many rows decode

    def __post_init__(self):
        count = len(self.prompts)
        self.results = [PromptResult([None] * self.n) for _ in range(count)]
        self.bases_left, self.rows_left = [self.n] * count, [self.n] * count
        self.base_rows = {p: [] for p in range(count)}
        self.waiting_prompts = deque(range(count))


# --------------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------------
class Engine:
    """Decode loop + scheduler over one KV pool. `max_rows`: rows decoded at once; `max_kv_tokens`: pool
    capacity in tokens. A row is admitted only when the pool can hold its whole remaining budget on top of
    what the running rows may still write, so the pool never runs out mid-step. `warp(scores)` applies
    temperature/top-k/top-p (rollout.py passes HF's warpers, so the distribution is `generate`'s)."""

    def __init__(self, model, stop_ids, warp, max_rows: int, max_kv_tokens: int, trace: bool = False,
                 compile_decode: bool = False):
        param = next(model.parameters())
        self.compile_decode = compile_decode     # decode steps through torch.compile (--compile_decode)
        self.model, self.warp = model, warp
        self.max_rows = min(max_rows, ROWS_AFTER_OOM.get(str(param.device), max_rows))
        self.prefill_chunk = PREFILL_AFTER_OOM.get(str(param.device))   # None: a prompt in one forward
        self._prefill_len = 0                                           # tokens of the last prefill forward
        self.stop_ids = set(stop_ids)
        self.pool = KVPool(model, max_kv_tokens, param.device, param.dtype)
        self.device = param.device
        self.trace = trace
        self.events: list[tuple] = []     # (step, kind, ...): prefill, bases_done, branches, end, tree_done[, decode]
        # given_tokens: tokens of given base responses fed to the model (run's given_bases)
        self.stats = dict(decode_steps=0, row_steps=0, ended_row_steps=0, prefill_tokens=0, given_tokens=0,
                          recomputed_prefix_tokens=0, oom_retries=0)
        self.step = 0
        self._next_id = 0

    # ---- one forward pass -------------------------------------------------------------------------------
    def _forward(self, rows: list[Row], new_tokens: list[list[int]]) -> torch.Tensor:
        """Feed each row its new tokens (all rows the same count q), writing their keys/values into fresh
        slots appended to the row's context. Returns the final hidden state of every new token, [rows, q, d]:
        position i's state produced the distribution of the token after it."""
        q = len(new_tokens[0])
        for row in rows:
            row.slots += self.pool.alloc(q)
        width = max(len(r.slots) for r in rows)
        read = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, row in enumerate(rows):
            read[i, :len(row.slots)] = torch.tensor(row.slots)
            valid[i, :len(row.slots)] = True
        lengths = torch.tensor([len(r.slots) for r in rows])
        positions = lengths[:, None] - q + torch.arange(q)[None, :]                       # [rows, q]
        # query i of a row sees the row's context up to and including its own position (causal)
        mask = valid[:, None, :] & (torch.arange(width)[None, None, :] <= positions[:, :, None])
        kv = StepKV(self.pool, read.gather(1, positions).to(self.device), read.to(self.device),
                    mask[:, None].to(self.device))
        # The model's own forward, as generate calls it (FSDP2's hooks under torchrun expect the root to run), with
        # no logits (an empty logits_to_keep: _sample projects only the last position); the hidden state is the
        # final norm's output, caught by a hook.
        # A decode step (q = 1) of 2+ rows under --compile_decode runs the same forward through torch.compile
        # (decode_hidden: the hidden state from output_hidden_states, as a hook cannot be traced). One row stays
        # eager: dynamic shapes still specialise a size of 1, and that recompile cost 38 s on this CPU.
        inputs = (torch.tensor(new_tokens, device=self.device), positions.to(self.device), kv)
        hidden = []
        hook = None
        try:
            with attention_backend(self.model):
                if self.compile_decode and q == 1 and len(rows) > 1:
                    hidden.append(compiled_decode()(self.model, *inputs))
                else:
                    hook = self.model.get_decoder().norm.register_forward_hook(
                        lambda module, args, out: hidden.append(out))
                    self.model(input_ids=inputs[0], position_ids=inputs[1], attention_mask=kv.mask, use_cache=False,
                               engine_kv=kv, logits_to_keep=torch.empty(0, dtype=torch.long, device=self.device))
        except BaseException:                     # e.g. out of memory: the rows are as they were before
            for row in rows:
                self.pool.release(row.slots[-q:])
                del row.slots[-q:]
            raise
        finally:
            if hook is not None:
                hook.remove()
        return hidden[-1]

    def _sample(self, hidden: torch.Tensor) -> tuple[list[int], list[float], list[float]]:
        """Sample one token per row from lm_head(hidden) after the warpers; its H_t and log-probability."""
        scores = self.warp(self.model.get_output_embeddings()(hidden).float())
        logp = torch.log_softmax(scores, dim=-1)
        tokens = torch.multinomial(logp.exp(), num_samples=1)
        entropy = torch.special.entr(logp.exp()).sum(-1)
        return tokens[:, 0].tolist(), entropy.tolist(), logp.gather(1, tokens)[:, 0].tolist()

    def _new_row(self, prompt, base, fork, slots, limit, keep_hidden) -> Row:
        self._next_id += 1
        return Row(self._next_id - 1, prompt, base, fork, slots, limit, hidden=[] if keep_hidden else None)

    def _push(self, row: Row, token: int, entropy: float, logprob: float, hidden) -> bool:
        """Append a sampled token; True when the row has ended (stop id kept, or budget reached)."""
        row.out.tokens.append(token)
        row.out.entropies.append(entropy)
        row.out.logprobs.append(logprob)
        self.state.sampled += 1
        if row.hidden is not None:
            row.hidden.append(hidden)
        return token in self.stop_ids or len(row.out.tokens) >= row.limit

    # ---- the loop ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, prompts: list[list[int]], n: int, max_new_tokens: int, on_bases_done=None,
            keep_hidden: bool | set[int] | None = None, on_tree_done=None,
            given_bases: dict[int, list[Sample]] | None = None, progress: bool = True) -> list[PromptResult]:
        """N samples per prompt; with `on_bases_done(prompt index, [N base Samples]) -> [BranchRequest]`,
        each prompt's branches too, started the moment its N base rows have ended (App. C, Sec. 4.1).

        keep_hidden: which prompts' base rows keep their hidden states and slots until their bases are done,
        which branches need: True / False for all prompts, or a set of prompt indices (the others' base rows
        give their slots back the step they end); default: all when on_bases_done is given.
        on_tree_done(p) is called when the last row of prompt p's tree has ended.

        given_bases: prompt index -> its N base Samples, already generated (a Section 3 study's fixed base
        rollout, or the previous step's bases under one-step off-policy). Such a prompt's bases are not
        sampled: when it is admitted (within the row and KV budget like any prompt), its prompt is prefilled
        once and each response's tokens[:-1] is fed once, writing their keys/values into the pool and
        recording the hidden states its branches start from; on_bases_done fires at once and its branches
        join the running batch. The given Samples come back unchanged (the same objects) in
        PromptResult.bases: their entropies and log-probs are the ones recorded when they were generated,
        not recomputed under the current weights. A given prompt that keeps no hidden states (keep_hidden)
        can have no branches, so nothing of it is run.

        progress: a tqdm bar of generated tokens, finished rows and trees (off when stderr is not a terminal).

        Each step: admit waiting work (_admit: branches first, then new or given prompts while the row and KV
        budget allow), then one decode step of every active row (_decode_step); a row that ends leaves at
        once (_finish), and the last base of a prompt starts its branches (_bases_done)."""
        given_bases = given_bases or {}
        for p, samples in given_bases.items():
            if not 0 <= p < len(prompts) or len(samples) != n or not all(s.tokens for s in samples):
                raise ValueError(f"engine.run: given_bases[{p}] must be {n} non-empty Samples of one of the "
                                 f"{len(prompts)} prompts; got {len(samples)} "
                                 f"(lengths {[len(s.tokens) for s in samples]})")
        s = self.state = RunState(prompts, n, max_new_tokens, on_bases_done,
                                  on_bases_done is not None if keep_hidden is None else keep_hidden,
                                  on_tree_done, given_bases)
        s.bar = tqdm(desc="rollout", unit="tok", leave=False, dynamic_ncols=True, disable=None if progress else True)
        try:
            while s.waiting_prompts or s.waiting or s.active:
                self._admit()
                if not s.active:
                    if s.waiting_prompts or s.waiting:
                        raise ValueError(f"--max_kv_tokens {self.pool.capacity} / --max_batch_rows "
                                         f"{self.max_rows}: too small for one prompt and its responses; "
                                         f"expected more")
                    break
                self._decode_step()
        finally:
            self._show()
            s.bar.close()
        return s.results

    def _keeps(self, p: int) -> bool:
        """Whether prompt p's base rows keep hidden states and slots for branches (run's keep_hidden)."""
        keep = self.state.keep_hidden
        return p in keep if isinstance(keep, (set, frozenset)) else bool(keep)

    def _room(self, rows: list[Row], extra: int) -> bool:
        """Rows fit, and the pool can hold every running row's and these rows' remaining budget + extra."""
        active = self.state.active
        growth = sum(r.limit - len(r.out.tokens) for r in active + rows)
        return len(active) + len(rows) <= self.max_rows and growth + extra <= len(self.pool.free)

    # ---- admission --------------------------------------------------------------------------------------
    def _admit(self):
        """Waiting rows first (branches, rows that took turns), then new prompts while room is left."""
        s = self.state
        while True:
            while s.waiting and self._room([s.waiting[0]], 0):
                s.active.append(s.waiting.popleft())
            if s.waiting or not s.waiting_prompts:
                return
            if s.prefill_wait is not None and len(s.active) > s.prefill_wait:
                return                        # a prefill ran out of memory: fewer rows decode first
            p = s.waiting_prompts[0]
            try:
                if not (self._admit_given if p in s.given_bases else self._admit_new)(p):
                    return
            except RuntimeError as err:       # torch.OutOfMemoryError is one
                if not oom.is_oom(err):
                    raise
                self._prefill_oom(err)
                continue
            s.waiting_prompts.popleft()
            s.prefill_wait = None

    def _prefill_oom(self, err: RuntimeError):
        """A prefill (prompt or given response) ran out of memory; nothing of the prompt was kept. With rows
        decoding, the prompt waits until their number has halved (their activations are what filled the
        memory; as rows end, the next prompt takes their place). Alone, it is fed in chunks of half the
        tokens (remembered for this device), down to one token; only then the error is raised."""
        s = self.state
        if not s.active and self._prefill_len <= 1:
            raise err
        self.stats["oom_retries"] += 1
        if s.active:
            s.prefill_wait = len(s.active) // 2
        else:
            self.prefill_chunk = PREFILL_AFTER_OOM[str(self.device)] = self._prefill_len // 2
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _prefill(self, row: Row, tokens: list[int]) -> torch.Tensor:
        """Feed one row `tokens` (a prompt, or a given response after its prompt), in one forward or in
        chunks of self.prefill_chunk tokens; the final hidden state of each, [len(tokens), d]. On an error
        the row's slots are as they were."""
        start = len(row.slots)
        chunk = self.prefill_chunk or len(tokens)
        hidden = []
        try:
            for i in range(0, len(tokens), chunk):
                self._prefill_len = len(tokens[i:i + chunk])
                inject.oom_point("prefill")   # DATPO_OOM_AT=prefill: the error CUDA raises, once (tests)
                hidden.append(self._forward([row], [tokens[i:i + chunk]])[0])
        except BaseException:
            self.pool.release(row.slots[start:])
            del row.slots[start:]
            raise
        return torch.cat(hidden)

    def _admit_new(self, p: int) -> bool:
        """Prefill prompt p once; its N rows share its slots and sample their first token."""
        s = self.state
        rows = [self._new_row(p, j, None, [], s.max_new_tokens, self._keeps(p)) for j in range(s.n)]
        if not self._room(rows[:self.max_rows], len(s.prompts[p])):   # N > max_rows: the rest wait for room
            return False
        hidden = self._prefill(rows[0], s.prompts[p])[-1:]           # the prompt once, for all N rows
        self.events.append((self.step, "prefill", p))
        self.stats["prefill_tokens"] += len(s.prompts[p])
        s.rows_started += len(rows)
        for row in rows[1:]:
            row.slots = list(rows[0].slots)
            self.pool.retain(row.slots)
        sampled = self._sample(hidden.expand(s.n, -1))
        for row, token, ent, lp in zip(rows, *sampled):
            if self._push(row, token, ent, lp, hidden[0]):
                self._finish(row)
            else:
                (s.active if self._room([row], 0) else s.waiting).append(row)
        return True

    def _admit_given(self, p: int) -> bool:
        """Prompt p's given bases: prefill the prompt once, feed each response's tokens[:-1] once (its
        keys/values and hidden[t], the state that produced token t), then they end at once."""
        s = self.state
        samples, keep = s.given_bases[p], self._keeps(p)
        need = len(s.prompts[p]) + sum(len(x.tokens) - 1 for x in samples) if keep else 0
        if not self._room([], need):
            return False
        rows = [self._new_row(p, j, None, [], len(x.tokens), keep) for j, x in enumerate(samples)]
        if keep:
            try:
                first = self._prefill(rows[0], s.prompts[p])[-1]
                prompt_slots = list(rows[0].slots)
                for row, sample in zip(rows, samples):
                    if row is not rows[0]:
                        row.slots = list(prompt_slots)
                        self.pool.retain(row.slots)
                    row.hidden = [first]
                    if len(sample.tokens) > 1:
                        row.hidden += list(self._prefill(row, sample.tokens[:-1]))
            except BaseException:             # e.g. out of memory: nothing of this prompt is kept
                for row in rows:
                    self.pool.release(row.slots)
                raise
            self.events.append((self.step, "prefill", p))
            self.stats["prefill_tokens"] += len(s.prompts[p])
            self.stats["given_tokens"] += sum(len(x.tokens) - 1 for x in samples)
        s.rows_started += len(rows)
        for row, sample in zip(rows, samples):
            row.out = sample                  # returned as given: nothing is appended to it
            self._finish(row)
        return True

    # ---- one decode step of every active row ------------------------------------------------------------
    def _decode_step(self):
        """One token for every active row. Out of memory (more than one row): halve the row budget, the rows
        beyond it wait their turn, and the step is retried by the next loop iteration."""
        s = self.state
        try:
            if len(s.active) > 1:   # DATPO_OOM_AT=base|branches: the error CUDA raises, once (tests)
                inject.oom_point("branches" if any(r.fork is not None for r in s.active) else "base")
            hidden = self._forward(s.active, [[r.out.tokens[-1]] for r in s.active])[:, -1]
        except RuntimeError as err:                    # torch.OutOfMemoryError is one
            if not oom.is_oom(err) or len(s.active) == 1:
                raise
            self._fewer_rows(len(s.active) // 2)
            return
        if self.trace:
            self.events.append((self.step, "decode", [r.id for r in s.active]))
        self.stats["decode_steps"] += 1
        self.stats["row_steps"] += len(s.active)
        sampled = self._sample(hidden)
        still = []
        for row, h, token, ent, lp in zip(s.active, hidden, *sampled):
            if self._push(row, token, ent, lp, h):
                self._finish(row)           # it leaves the batch now: never decoded again
            else:
                still.append(row)
        s.active = still
        self.step += 1
        self._show()

    def _show(self):
        """The bar: tokens sampled so far; rows ended / created, trees done / prompts."""
        s = self.state
        s.bar.update(s.sampled - s.bar.n)
        s.bar.set_postfix(rows=f"{s.rows_done}/{s.rows_started}", trees=f"{s.trees_done}/{len(s.prompts)}",
                          refresh=False)

    def _fewer_rows(self, rows: int):
        """Decode at most `rows` rows from now on (remembered for this device); the rest wait their turn."""
        s = self.state
        self.max_rows = ROWS_AFTER_OOM[str(self.device)] = max(1, rows)
        self.stats["oom_retries"] += 1
        s.waiting.extendleft(reversed(s.active[self.max_rows:]))
        del s.active[self.max_rows:]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ---- rows that end ----------------------------------------------------------------------------------
    def _finish(self, row: Row):
        """Row has ended: record it; a base row gives its slots back unless branches will read them, and the
        last base of its prompt starts the branches; the tree is done when its last row ends."""
        s = self.state
        p = row.prompt
        self.events.append((self.step, "end", row.id, p))
        s.rows_done += 1
        if row.fork is None:
            s.results[p].bases[row.base] = row.out
            s.bases_left[p] -= 1
            s.base_rows[p].append(row)
            if not self._keeps(p):                # no branch will read it: its slots go back now
                self.pool.release(row.slots)
                row.slots = []
            if s.bases_left[p] == 0:
                self._bases_done(p)
        else:
            s.results[p].branches.setdefault((row.base, row.fork), []).append(row.out)
            self.pool.release(row.slots)
        s.rows_left[p] -= 1                       # after _bases_done: its branches count before this row leaves
        if s.rows_left[p] == 0:
            self.events.append((self.step, "tree_done", p, self.pool.used))
            s.trees_done += 1
            if s.on_tree_done:
                s.on_tree_done(p)

    def _bases_done(self, p: int):
        """V(root), K̂, B̂ and forks (the caller's on_bases_done), then B̂ branch rows per fork, each reading its
        base row's first P + f slots by reference and sampling its first token from the base's hidden state
        at f; then the base rows let go of their slots."""
        s = self.state
        self.events.append((self.step, "bases_done", p))
        by_base = sorted(s.base_rows.pop(p), key=lambda r: r.base)
        requests = s.on_bases_done(p, [r.out for r in by_base]) if s.on_bases_done else []
        branch_rows = []
        if requests and not self._keeps(p):
            raise ValueError(f"engine: branches requested for prompt {p} without keep_hidden "
                             f"(their first token needs the base rows' hidden states)")
        for req in requests:
            parent = by_base[req.base]
            if not 0 <= req.fork < len(parent.out.tokens):
                raise ValueError(f"engine: fork {req.fork} of prompt {p}'s base {req.base} is outside its "
                                 f"{len(parent.out.tokens)} tokens (expected 0 <= f < length)")
            prefix = parent.slots[:len(s.prompts[p]) + req.fork]
            for _ in range(req.count):
                self.pool.retain(prefix)
                branch_rows.append((self._new_row(p, req.base, req.fork, list(prefix), req.limit, False),
                                    parent.hidden[req.fork]))
        if branch_rows:
            self.events.append((self.step, "branches", p, len(branch_rows)))
            s.rows_left[p] += len(branch_rows)
            s.rows_started += len(branch_rows)
            sampled = self._sample(torch.stack([h for _, h in branch_rows]))
            for (row, _), token, ent, lp in zip(branch_rows, *sampled):
                if self._push(row, token, ent, lp, None):
                    self._finish(row)
                else:
                    s.waiting.append(row)
        for row in by_base:
            self.pool.release(row.slots)
            row.hidden = None
