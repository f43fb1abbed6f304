"""engine/kv.py — where the engine keeps keys and values, and the forward pass that reads and writes them.

Keys/values live in one pre-allocated pool per layer, [capacity, 2, H_kv, d], written in place. A row's
context is a list of pool slots (a block table with 1-token pages). A prompt is prefilled once and its N base
rows point at the same slots; a branch at fork f points at its base row's first P + f slots. So a prefix is
shared by reference: zero copies per fork or branch, and no prefix token is recomputed. Slots are
reference-counted and return to the free list when the last row reading them is done.

Attention runs through a registered HF attention function ("datpo_engine"): each layer writes the new tokens'
keys/values into their slots, gathers each row's context slots and calls SDPA with a [rows, 1, q, T] mask.
The gather reads the context once per step (as DynamicCache's torch.cat does); on a GPU, a paged kernel
(flash-attn's block_table) could read the pool directly — left for later.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

ATTENTION = "datpo_engine"


class KVPool:
    """Keys and values of up to `capacity` tokens for every layer, allocated once. A slot holds one token's
    keys and values; `refs[s]` counts the rows whose context reads slot s (a shared prefix is read by
    many)."""

    def __init__(self, model, capacity: int, device, dtype):
        cfg = model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = [torch.empty(capacity, 2, kv_heads, head_dim, device=device, dtype=dtype)
                       for _ in range(cfg.num_hidden_layers)]
        self.capacity, self.device = capacity, device
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
    (`write` [rows, q]), which slots each row reads (`read` [rows, T], padded) and the mask
    [rows, 1, q, T]."""
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
    """One forward of the model (the root, as in forward) → the final hidden state [rows, q, d]:
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


def step_kv(pool: KVPool, contexts: list[list[int]], q: int) -> tuple[StepKV, torch.Tensor]:
    """The StepKV of a forward that feeds each context its last q slots, and the new tokens' positions
    [rows, q]: query i of a row sees the row's context up to and including its own position (causal)."""
    width = max(len(c) for c in contexts)
    read = torch.zeros(len(contexts), width, dtype=torch.long)
    valid = torch.zeros(len(contexts), width, dtype=torch.bool)
    for i, context in enumerate(contexts):
        read[i, :len(context)] = torch.tensor(context)
        valid[i, :len(context)] = True
    lengths = torch.tensor([len(c) for c in contexts])
    positions = lengths[:, None] - q + torch.arange(q)[None, :]                       # [rows, q]
    mask = valid[:, None, :] & (torch.arange(width)[None, None, :] <= positions[:, :, None])
    kv = StepKV(pool, read.gather(1, positions).to(pool.device), read.to(pool.device),
                mask[:, None].to(pool.device))
    return kv, positions


class Forward:
    """The model's forward passes over rows whose contexts live in one pool: a decode step (each row's last
    token) and a prefill (one row's tokens, in one forward or in chunks). Each returns final hidden states;
    on an error (e.g. out of memory) the rows' contexts are as they were. Rows: engine.scheduler.DecodeRow."""

    def __init__(self, model, pool: KVPool, compile_decode: bool = False):
        self.model, self.pool, self.compile_decode = model, pool, compile_decode
        self.prefill_len = 0             # tokens of the last prefill forward (what ran out of memory)

    def decode(self, rows) -> torch.Tensor:
        """One decode forward: each row's last token → [rows, 1, d] (torch.compile under --compile_decode)."""
        return forward(self.model, self.pool, [r.slots for r in rows], [[r.out.tokens[-1]] for r in rows],
                       compiled=self.compile_decode)

    def prefill(self, row, tokens: list[int], chunk: int | None) -> torch.Tensor:
        """Feed one row `tokens` (a prompt, or a given response after its prompt), in one forward or in
        chunks of `chunk` tokens; the final hidden state of each, [len(tokens), d]."""
        start = len(row.slots)
        chunk = chunk or len(tokens)
        hidden = []
        try:
            for i in range(0, len(tokens), chunk):
                self.prefill_len = len(tokens[i:i + chunk])
                hidden.append(self.prefill_forward(row, tokens[i:i + chunk]))
        except BaseException:
            self.pool.release(row.slots[start:])
            del row.slots[start:]
            raise
        return torch.cat(hidden)

    def prefill_forward(self, row, tokens: list[int]) -> torch.Tensor:
        """One prefill forward of one row: [len(tokens), d]."""
        return forward(self.model, self.pool, [row.slots], [tokens])[0]

    def feed(self, rows, prompt: list[int], responses: list[list[int]], chunk: int | None) -> None:
        """Given responses (one per row) after one prompt: the prompt is prefilled once into rows[0], every
        row shares its slots and feeds its response's tokens[:-1] once, recording hidden[t] (the state that
        produced token t). Out of memory: nothing of this prompt is kept."""
        try:
            first = self.prefill(rows[0], prompt, chunk)[-1]
            prompt_slots = list(rows[0].slots)
            for row, tokens in zip(rows, responses):
                if row is not rows[0]:
                    row.slots = list(prompt_slots)
                    self.pool.retain(row.slots)
                row.hidden = [first]
                if len(tokens) > 1:
                    row.hidden += list(self.prefill(row, tokens[:-1], chunk))
        except BaseException:
            for row in rows:
                self.pool.release(row.slots)
            raise


def forward(model, pool: KVPool, contexts: list[list[int]], new_tokens: list[list[int]],
            compiled: bool = False) -> torch.Tensor:
    """Feed each row its new tokens (all rows the same count q), writing their keys/values into fresh slots
    appended to the row's context (`contexts`: each row's slot list, extended in place). Returns the final
    hidden state of every new token, [rows, q, d]: position i's state produced the distribution of the token
    after it. On an error (e.g. out of memory) the contexts are as they were."""
    q = len(new_tokens[0])
    for context in contexts:
        context += pool.alloc(q)
    kv, positions = step_kv(pool, contexts, q)
    # The model's own forward, as generate calls it (FSDP2's hooks under torchrun expect the root to run),
    # with no logits (an empty logits_to_keep: the engine projects only what it samples); the hidden state is
    # the final norm's output, caught by a hook.
    # A decode step (q = 1) of 2+ rows under --compile_decode runs the same forward through torch.compile
    # (decode_hidden: the hidden state from output_hidden_states, as a hook cannot be traced). One row stays
    # eager: dynamic shapes still specialise a size of 1, and that recompile cost 38 s on this CPU.
    inputs = (torch.tensor(new_tokens, device=pool.device), positions.to(pool.device), kv)
    hidden = []
    hook = None
    try:
        with attention_backend(model):
            if compiled and q == 1 and len(contexts) > 1:
                hidden.append(compiled_decode()(model, *inputs))
            else:
                hook = model.get_decoder().norm.register_forward_hook(
                    lambda module, args, out: hidden.append(out))
                model(input_ids=inputs[0], position_ids=inputs[1], attention_mask=kv.mask, use_cache=False,
                      engine_kv=kv, logits_to_keep=torch.empty(0, dtype=torch.long, device=pool.device))
    except BaseException:                     # e.g. out of memory: the rows are as they were before
        for context in contexts:
            pool.release(context[-q:])
            del context[-q:]
        raise
    finally:
        if hook is not None:
            hook.remove()
    return hidden[-1]
