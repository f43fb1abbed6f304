"""engine/kv.py — where the engine keeps keys and values, and the forward pass that reads and writes them.

Keys/values live in one pre-allocated pool per layer, [pages × page, 2, H_kv, d], written in place. A row's
context is a list of pool slots (slot = page × page_size + offset; a block table). A prompt is prefilled once
and its N base rows read the same pages; a branch at fork f reads its base row's first P + f slots. So a
prefix is shared by reference, and no prefix token is recomputed. Pages are reference-counted and return to
the free list when the last row reading them is done.

Page size 1 (the reference, and the CPU default) makes a page one token: sharing copies nothing. A larger
page (the paged decode step, engine/paged.py; 16 on a GPU, which its attention kernel needs) keeps every
row's slots page-aligned — logical position t at offset t mod page — so a shared prefix that ends inside a
page has that page's first tokens copied into a fresh page of the new row (copy on write, at most page − 1
tokens per row; shared full pages are never written again).

The reference attention is a registered HF attention function ("datpo_engine"): each layer writes the new
tokens' keys/values into their slots, gathers each row's context slots and calls SDPA with a [rows, 1, q, T]
mask. The gather reads the context once per step (as DynamicCache's torch.cat does); on CUDA a boolean mask
with GQA sends SDPA to its math kernel, which is why a GPU decodes through engine/paged.py instead (a paged
kernel reading the pool through the block table, no gather).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

ATTENTION = "datpo_engine"


def pages_needed(tokens: int, page: int, rows: int = 0) -> int:
    """Pages that `tokens` more KV tokens may take, spread over `rows` rows: the tokens themselves when a page
    is one token; else ⌈tokens / page⌉ plus one per row (a row's first page may start mid-page, holding its
    copied prefix tail)."""
    return tokens if page == 1 else -(-tokens // page) + rows


class KVPool:
    """Keys and values of up to `capacity` tokens (rounded up to whole pages of `page` tokens) for every
    layer, allocated once. `refs[p]` counts the rows whose context reads page p (a shared prefix is read by
    many). With `scratch`, one more page (`scratch_page`) that is never handed out: padded rows of the paged
    decode step write there."""

    def __init__(self, model, capacity: int, device, dtype, page: int = 1, scratch: bool = False):
        cfg = model.config
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        pages = -(-capacity // page)
        self.page, self.pages = page, pages
        self.scratch_page = pages if scratch else None
        slots = (pages + scratch) * page
        # Paged: zeros, since a kernel reading a partly written page multiplies its unwritten (masked) values
        # by a zero weight, and uninitialised memory may hold NaN.
        make = torch.zeros if page > 1 or scratch else torch.empty
        self.layers = [make(slots, 2, kv_heads, head_dim, device=device, dtype=dtype)
                       for _ in range(cfg.num_hidden_layers)]
        self.capacity, self.device = pages * page, device
        self.bytes_per_token = cfg.num_hidden_layers * 2 * kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self.refs = [0] * pages
        self.free = list(range(pages - 1, -1, -1))   # a stack: low pages first
        self.peak = 0                                # tokens held at most (whole pages)

    @property
    def used(self) -> int:
        """Tokens held (whole pages)."""
        return (self.pages - len(self.free)) * self.page

    def alloc(self, n: int) -> list[int]:
        """n fresh pages (slots, when a page is one token), each read by one row."""
        if n > len(self.free):
            raise RuntimeError(f"engine KV pool exhausted: {n} pages wanted, {len(self.free)} free "
                               f"(a scheduling bug: admission reserves every row's budget)")
        pages = [self.free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        self.peak = max(self.peak, self.used)
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free.append(p)

    def pages_of(self, context: list[int]) -> list[int]:
        """The pages a (page-aligned) context reads, in order."""
        return list(context) if self.page == 1 else [s // self.page for s in context[::self.page]]

    def extend(self, context: list[int], n: int) -> None:
        """Append n slots to a row's context (in place): the rest of its own last page, then fresh pages."""
        if self.page == 1:
            context += self.alloc(n)
            return
        size = self.page
        own = min(n, -len(context) % size)
        fresh = self.alloc(-(-(n - own) // size))
        if own:
            context += range(context[-1] + 1, context[-1] + 1 + own)
        left = n - own
        for p in fresh:
            context += range(p * size, p * size + min(size, left))
            left -= size

    def shrink(self, context: list[int], n: int) -> None:
        """Undo the last n slots of extend (in place): pages that held only those slots go back."""
        if n <= 0:
            return
        dropped = context[len(context) - n:]
        del context[len(context) - n:]
        self.release(dropped if self.page == 1 else [s // self.page for s in dropped if s % self.page == 0])

    def release_context(self, context: list[int]) -> None:
        """A row is done with its context: each page it reads once."""
        self.release(self.pages_of(context))

    def share(self, sources: list[tuple[list[int], int]]) -> list[list[int]]:
        """New contexts, one per (context, length): each reads context[:length] by reference. With pages of
        more than one token, a length that ends inside a page gets that page's first tokens copied into a
        fresh page of its own (one gather per layer for all of them), where the new row writes on."""
        size = self.page
        tails = sum(1 for _, length in sources if length % size)
        fresh = self.alloc(tails) if tails else []
        out, src, dst = [], [], []
        for context, length in sources:
            full = length - length % size
            shared = list(context[:full])
            self.retain(self.pages_of(shared))
            if length % size:
                page = fresh.pop()
                src += context[full:length]
                dst += range(page * size, page * size + length % size)
                shared += range(page * size, page * size + length % size)
            out.append(shared)
        if src:
            index = torch.tensor(src, device=self.device)
            where = torch.tensor(dst, device=self.device)
            for layer in self.layers:
                layer.index_copy_(0, where, layer.index_select(0, index))
        return out


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
    rows, width = engine_kv.read.shape
    new = torch.stack((key, value), dim=1).permute(0, 3, 1, 2, 4).to(pool.dtype)   # [rows, q, 2, H_kv, d]
    pool.index_copy_(0, engine_kv.write.flatten(), new.flatten(0, 1))
    # index_select: the same copy as pool[read], 2-4x faster on this CPU (docs/measurements.md, issue 37)
    context = pool.index_select(0, engine_kv.read.flatten()).view(rows, width, *pool.shape[1:])
    context = context.to(query.dtype)                                  # [rows, T, 2, H_kv, d]
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
def attention_backend(model, name: str | None = None):
    """The attention layers read config._attn_implementation at every forward: `name` (registered), by
    default the reference attention."""
    old = model.config._attn_implementation
    model.config._attn_implementation = name or register_attention()
    try:
        yield
    finally:
        model.config._attn_implementation = old


def decode_hidden(model, input_ids, position_ids, kv: StepKV) -> torch.Tensor:
    """One forward of the model (the root, as in forward) → the final hidden state [rows, q, d]:
    output_hidden_states' last entry is the final norm's output; no logits (an empty logits_to_keep)."""
    out = model(input_ids=input_ids, position_ids=position_ids, attention_mask=getattr(kv, "mask", None),
                use_cache=False,
                engine_kv=kv, logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
                output_hidden_states=True)
    return out.hidden_states[-1]


_COMPILED = []


def compile_cache() -> str:
    """Where torch.compile keeps what it built (inductor's kernels and graphs), so that the next process
    loads them instead of compiling again: $TORCHINDUCTOR_CACHE_DIR when set, else the project's cache
    (models.cache_dir(): $DATPO_CACHE or ~/.cache/datpo) / inductor. Set before the process's first
    compile (inductor fixes its default, a folder under /tmp, at its first use)."""
    import os

    import models

    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(models.cache_dir() / "inductor"))


def compiled_decode():
    """decode_hidden through torch.compile(dynamic=True), built once per process: rows, context width and
    pool size change every step, so they are symbolic rather than a recompile each. The pool is written in
    place inside the graph (index_put on a graph input); masks and slot tables are inputs, so one graph
    serves every step. Inductor needs a C++ compiler on CPU and Triton on CUDA. Measured on CPU only (no GPU
    here; docs/measurements.md), not tried under torchrun."""
    if not _COMPILED:
        compile_cache()
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
            self.pool.shrink(row.slots, len(row.slots) - start)
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
            shared = self.pool.share([(rows[0].slots, len(prompt))] * (len(rows) - 1))
            for row in rows[1:]:
                row.slots = shared.pop(0)
            for row, tokens in zip(rows, responses):
                row.hidden = [first]
                if len(tokens) > 1:
                    row.hidden += list(self.prefill(row, tokens[:-1], chunk))
        except BaseException:
            for row in rows:
                self.pool.release_context(row.slots)
                row.slots = []
            raise


def forward(model, pool: KVPool, contexts: list[list[int]], new_tokens: list[list[int]],
            compiled: bool = False) -> torch.Tensor:
    """Feed each row its new tokens (all rows the same count q), writing their keys/values into fresh slots
    appended to the row's context (`contexts`: each row's slot list, extended in place). Returns the final
    hidden state of every new token, [rows, q, d]: position i's state produced the distribution of the token
    after it. On an error (e.g. out of memory) the contexts are as they were."""
    q = len(new_tokens[0])
    done = []
    try:
        for context in contexts:
            pool.extend(context, q)
            done.append(context)
    except BaseException:
        for context in done:
            pool.shrink(context, q)
        raise
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
            pool.shrink(context, q)
        raise
    finally:
        if hook is not None:
            hook.remove()
    return hidden[-1]
