"""engine/paged.py — the static-shape decode step: the engine's decode step as a GPU wants it.

The reference step (engine/kv.py) builds each step's slot tables on the host, gathers every row's whole
context out of the pool in every layer, and on CUDA its boolean mask with GQA sends SDPA to the math kernel
(issue 37: 0.16 of the bare forward on an H100 at 64 rows). This step instead:

  * keeps the decode state on the device, updated in place: per lane (a row's place in the batch) its
    block table (the pool pages it reads, in order, and each page's place in it), its length, the token it
    feeds next, how many tokens it has and may have. The host sends only what changed: rows that joined or
    left (their lanes are re-packed by one gather), and a row's new page every `page` tokens;
  * reads the pool through the block table: FlexAttention (torch.nn.attention.flex_attention, compiled) over
    the pool as one sequence of pages, with a block mask whose KV blocks are exactly the row's pages: all but
    the last as full blocks, and the last, partly written one through a mask_mod that cuts it at the row's
    length. Its decoding kernel
    packs the GQA group into the query, reads each row's keys and values once, and never gathers them;
  * samples on the device (after the same warpers; the exponential race, which is what torch.multinomial
    does for one sample) and brings back one [rows, 4] float tensor per step — token, H_t, log p, ended —
    through `to_host`, the one device → host transfer of a step;
  * pads the rows to a bucket size (DECODE_BUCKETS): padded lanes read and write one scratch page that is
    never handed out, so every bucket has fixed shapes and the KV pool a fixed address. On CUDA each bucket's
    step is captured as a CUDA graph the first time it runs (after one eager run that compiles it) and
    replayed after that; if capture fails the step stays eager and says so once.

Pages are PAGE = 64 tokens here (the flex decoding kernel reads a page per tile of up to 64 keys; 16 is its
smallest; bench/bench_decode_attention.py times both). engine/kv.py copies a shared prefix's last partial
page per row (at most 63 tokens), so sharing stays by reference for every full page. The compiled kernels
visit only the pages the block mask lists; its mask_mod is nonetheless complete on its own (a per-lane map
from pool page to place in the table), so the mask means the same to any implementation. An uncompiled flex
would materialise scores over the whole pool (gigabytes at the paper's shape): flex is called through
`compiled_flex`, and a recompile-limit hit raises instead of falling back to it.

On the CPU (tests) the same step runs eagerly with flex compiled, or whole under
torch.compile(fullgraph=True) (--compile_decode); torch's default recompile limit applies per bucket.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from engine import kv
from engine.kv import KVPool

PAGED_ATTENTION = "datpo_paged"
PAGE = 64
DISABLED: list[str] = []   # why the paged step failed in this process (engines then take the reference)
# Coarse: a GPU decode step at these sizes is bound by reading the weights, so padding 65 rows to 128 costs
# little, and every bucket is one more compiled kernel per pool size.
DECODE_BUCKETS = (16, 64, 128, 256, 384, 512)
TRANSFERS = [0]          # device → host transfers made through to_host (tests count them per step)


def to_host(values: torch.Tensor) -> list:
    """The engine's device → host transfer: one tensor to Python lists, counted in TRANSFERS."""
    TRANSFERS[0] += 1
    return values.tolist()


def buckets(max_rows: int) -> list[int]:
    """The padded batch sizes of an engine decoding at most max_rows rows: DECODE_BUCKETS below max_rows,
    then the first that holds it (max_rows itself beyond the last)."""
    return [b for b in DECODE_BUCKETS if b < max_rows] + [next((b for b in DECODE_BUCKETS if b >= max_rows),
                                                                max_rows)]


_FLEX = []


def compiled_flex():
    """flex_attention through torch.compile, built once per process (static shapes: one kernel per bucket
    and pool size)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        kv.compile_cache()

        def paged_flex(*args, **kwargs):
            # a frame of its own: torch.compile caches per code object, and the update's compiled flex
            # (attention.compiled_flex, other settings) compiles flex_attention's own frame; sharing it made
            # this compile fail after that one had run ("Attempt to trace generator")
            return flex_attention(*args, **kwargs)

        _FLEX.append(torch.compile(paged_flex, fullgraph=True, dynamic=False))
    return _FLEX[0]


@contextlib.contextmanager
def no_eager_fallback():
    """Compiled code must not fall back to eager flex (scores over the whole pool): a recompile-limit hit
    raises, and the limit covers every bucket × pool size of a run (where this torch has the settings)."""
    known = torch._dynamo.config._config if hasattr(torch._dynamo.config, "_config") else {}
    wanted = (("recompile_limit", 64), ("fail_on_recompile_limit_hit", True))
    settings = {k: v for k, v in wanted if k in known}
    with torch._dynamo.config.patch(**settings):
        yield


@dataclass
class PagedKV:
    """What one paged decode forward tells the attention function: the slot each row's new token's keys and
    values go to (`write` [rows]) and the block mask over the pool's pages."""
    pool: KVPool
    write: torch.Tensor
    block_mask: object


def block_mask(table: torch.Tensor, lengths: torch.Tensor, logical: torch.Tensor, page: int,
               pool_tokens: int):
    """The block mask of one decode step: row b (query length 1) reads the first ⌈lengths[b] / page⌉ pages of
    its table [rows, pages] (int32), all but the last as full blocks, the last as a partial one. The mask_mod
    is the whole truth on its own (an uncompiled flex evaluates it over the whole pool): `logical`
    [rows, pool pages] holds, per row, each of its pages' place in its table (−1: not its page), so key slot
    s is visible to row b when its page is b's and its position, logical × page + s mod page, is below the
    row's length."""
    from torch.nn.attention.flex_attention import BlockMask

    rows = table.shape[0]
    last = (lengths - 1) // page
    partial = torch.zeros_like(table)
    partial[:, :1] = table.gather(1, last[:, None].to(torch.int64))

    def mask_mod(b, h, q_idx, kv_idx):
        place = logical[b, kv_idx // page]
        return (place >= 0) & (place * page + kv_idx % page < lengths[b])

    return BlockMask.from_kv_blocks(torch.ones(rows, 1, 1, dtype=torch.int32, device=table.device),
                                    partial.view(rows, 1, 1, -1), last.to(torch.int32).view(rows, 1, 1),
                                    table.view(rows, 1, 1, -1), BLOCK_SIZE=(128, page), mask_mod=mask_mod,
                                    seq_lengths=(1, pool_tokens), compute_q_blocks=False)


def lane_tables(pool: KVPool, contexts: list[list[int]], size: int, device=None):
    """Block table, page places and lengths [size] of `contexts` (each including the slot of the token fed
    now) in lanes 0.., the lanes beyond them padding (one token on the scratch page), as the static step
    keeps them: for tests and benchmarks that call paged_attention directly."""
    table = torch.full((size, pool.pages + 1), pool.scratch_page, dtype=torch.int32)
    logical = torch.full((size, pool.pages + 1), -1, dtype=torch.int32)
    logical[:, pool.scratch_page] = 0
    lengths = torch.ones(size, dtype=torch.int64)
    for i, context in enumerate(contexts):
        pages = pool.pages_of(context)
        table[i, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
        logical[i, pool.scratch_page] = -1
        logical[i, pages] = torch.arange(len(pages), dtype=torch.int32)
        lengths[i] = len(context)
    return table.to(device), logical.to(device), lengths.to(device)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, engine_kv=None,
                    **kwargs):
    """HF attention function for one decode token per row: query [rows, H, 1, d], key/value [rows, H_kv, 1, d]
    → output [rows, 1, H, d]. Writes the new keys/values into their slots, then attends over the row's pages
    of the pool in place (FlexAttention with the step's block mask; GQA in the kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    layer = engine_kv.pool.layers[module.layer_idx]                   # [slots, 2, H_kv, d]
    new = torch.stack((key[:, :, -1], value[:, :, -1]), dim=1)           # [rows, 2, H_kv, d]
    layer.index_copy_(0, engine_kv.write, new.to(layer.dtype))
    keys, values = (layer[:, i].permute(1, 0, 2).unsqueeze(0) for i in (0, 1))   # [1, H_kv, slots, d] views
    flex = flex_attention if torch.compiler.is_compiling() else compiled_flex()
    out = flex(query.to(layer.dtype), keys, values, block_mask=engine_kv.block_mask, scale=scaling,
               enable_gqa=True)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register_attention() -> str:
    """Registered as an attention function only, with no mask function: for such an attention transformers'
    mask creation returns None at once ("other custom attention without equivalent mask creation"). A
    registered mask function would instead run its mask preprocessing, which makes host round trips
    (tests/test_paged.py counts them)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    return PAGED_ATTENTION


def sample(model, warp, hidden: torch.Tensor):
    """One token per row from lm_head(hidden) after the warpers, on the device: the exponential race
    argmax(p / E), E ~ Exp(1) i.i.d. (a sample from p, as torch.multinomial draws one); its H_t and log p."""
    scores = warp(model.get_output_embeddings()(hidden).float())
    logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    tokens = (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    return tokens, torch.special.entr(probs).sum(-1), logp.gather(1, tokens[:, None])[:, 0]


def decode_step(model, warp, state: "StaticDecoder", size: int) -> None:
    """The static step for the first `size` lanes (a bucket): feed each lane's token, sample the next, and
    update the lanes in place (padded lanes, at or beyond state.n_active, keep their state). Results in
    state.out[:size] (token, H_t, log p, ended) and state.hidden[:size]."""
    tokens, lengths, table = state.tokens[:size], state.lengths[:size], state.table[:size]
    active = state.lane[:size] < state.n_active
    page = state.pool.page
    pos = lengths - 1
    write = table.gather(1, (pos // page)[:, None].to(torch.int64))[:, 0].to(torch.int64) * page + pos % page
    step_kv = PagedKV(state.pool, write, block_mask(table, lengths, state.logical[:size], page,
                                                    state.pool_tokens))
    hidden = kv.decode_hidden(model, tokens[:, None], pos[:, None], step_kv)[:, -1]
    picked, entropy, logprob = sample(model, warp, hidden)
    ended = torch.isin(picked, state.stop) | (state.n_out[:size] + 1 >= state.limit[:size])
    state.tokens[:size] = torch.where(active, picked, tokens)
    state.lengths[:size] += active.to(lengths.dtype)
    state.n_out[:size] += active.to(lengths.dtype)
    state.out[:size] = torch.stack((picked.to(torch.float32), entropy, logprob, ended.to(torch.float32)), 1)
    state.hidden[:size] = hidden.to(state.hidden.dtype)


class StaticDecoder:
    """The decode state of one engine on the device and the step that advances it (module docstring).
    mode: "eager" (flex compiled), "compile" (the whole step under torch.compile(fullgraph=True)) or "graph"
    (CUDA: one captured graph per bucket; eager where capture fails). The first step runs eagerly in every
    mode: it does what a model does on its first call (transformers installs its output hooks under a lock,
    which would break the graph)."""

    def __init__(self, model, pool: KVPool, warp, stop_ids, max_rows: int, mode: str = "eager"):
        if pool.scratch_page is None:
            raise ValueError("the static decode step needs a pool with a scratch page")
        self.model, self.pool, self.warp, self.mode = model, pool, warp, mode
        self.buckets = buckets(max_rows)
        lanes, device = self.buckets[-1], pool.device
        hidden_size = model.get_output_embeddings().in_features
        self.pool_tokens = pool.layers[0].shape[0]
        self.table = torch.full((lanes, pool.pages + 1), pool.scratch_page, dtype=torch.int32, device=device)
        # per lane, each pool page's place in its table (−1: not the lane's): the block mask's mask_mod
        self.logical = torch.full((lanes, pool.pages + 1), -1, dtype=torch.int32, device=device)
        self.logical[:, pool.scratch_page] = 0
        self.lengths = torch.ones(lanes, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(lanes, dtype=torch.int64, device=device)
        self.n_out = torch.zeros(lanes, dtype=torch.int64, device=device)
        self.limit = torch.full((lanes,), 2**31, dtype=torch.int64, device=device)
        self.lane = torch.arange(lanes, device=device)
        self.n_active = torch.zeros((), dtype=torch.int64, device=device)
        self.stop = torch.tensor(sorted(stop_ids) or [-1], dtype=torch.int64, device=device)
        self.out = torch.zeros(lanes, 4, dtype=torch.float32, device=device)
        hidden_dtype = model.get_output_embeddings().weight.dtype          # the final norm's, as in forward
        self.hidden = torch.zeros(lanes, hidden_size, dtype=hidden_dtype, device=device)
        self.lane_ids: list[int] | None = []      # row id per lane; None: the device state must be rebuilt
        self.used_lanes = lanes                   # lanes that may hold a row's state (all before a sync)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        self.capture_failed: str | None = None
        if mode == "compile":
            kv.compile_cache()
        self.compiled = torch.compile(decode_step, fullgraph=True, dynamic=False) \
            if mode == "compile" else None
        self.steps = dict(eager=0, compiled=0, replayed=0, captured=0)

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    # ---- the host side: what changed since the last step ---------------------------------------------------
    def sync(self, rows) -> None:
        """Bring the lanes in line with `rows` (scheduler.active, in order), each of whose contexts has just
        been extended by the slot its last token goes to: re-pack kept rows' lanes (one gather), write new
        rows' tables and state, reset the lanes beyond them, and send kept rows' new pages."""
        page = self.pool.page
        ids = [r.id for r in rows]
        fresh = list(range(len(rows)))
        if self.lane_ids is not None and ids != self.lane_ids:
            where = {rid: i for i, rid in enumerate(self.lane_ids)}
            kept = [(i, where[r.id]) for i, r in enumerate(rows) if r.id in where]
            fresh = [i for i, r in enumerate(rows) if r.id not in where]
            if kept and any(i != j for i, j in kept):
                dst = torch.tensor([i for i, _ in kept], device=self.pool.device)
                src = torch.tensor([j for _, j in kept], device=self.pool.device)
                for t in (self.table, self.logical, self.lengths, self.tokens, self.n_out, self.limit):
                    t.index_copy_(0, dst, t.index_select(0, src))
        elif ids == self.lane_ids:
            fresh = []
        if ids != self.lane_ids:
            self.write_rows(rows, fresh)
            self.lane_ids = ids
        skip = set(fresh)
        new_pages = [(i, (len(r.slots) - 1) // page, r.slots[-1] // page) for i, r in enumerate(rows)
                     if (len(r.slots) - 1) % page == 0 and i not in skip]
        if new_pages:
            at = torch.tensor(new_pages, dtype=torch.int64).to(self.pool.device, non_blocking=True)
            self.table[at[:, 0], at[:, 1]] = at[:, 2].to(torch.int32)
            self.logical[at[:, 0], at[:, 2]] = at[:, 1].to(torch.int32)

    def write_rows(self, rows, fresh: list[int]) -> None:
        """New rows' lanes from the host (tables padded with the scratch page), then every lane beyond the
        rows back to the padding state: one token, on the scratch page."""
        n, device = len(rows), self.pool.device
        if fresh:
            tables = [self.pool.pages_of(rows[i].slots) for i in fresh]
            width = max(map(len, tables))
            block = torch.full((len(fresh), width), self.pool.scratch_page, dtype=torch.int32)
            for k, pages in enumerate(tables):
                block[k, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            state = torch.tensor([[len(rows[i].slots), rows[i].out.tokens[-1], len(rows[i].out.tokens),
                                   rows[i].limit] for i in fresh], dtype=torch.int64)
            places = torch.tensor([[fresh[k], page, place] for k, pages in enumerate(tables)
                                   for place, page in enumerate(pages)], dtype=torch.int64).to(device)
            lanes = torch.tensor(fresh, device=device)
            self.table[lanes, :width] = block.to(device)
            self.logical[lanes] = -1
            self.logical[places[:, 0], places[:, 1]] = places[:, 2].to(torch.int32)
            state = state.to(device)
            for col, t in enumerate((self.lengths, self.tokens, self.n_out, self.limit)):
                t.index_copy_(0, lanes, state[:, col])
        if self.used_lanes > n:                   # lanes that held rows go back to the padding state
            self.logical[n:self.used_lanes] = -1
            self.logical[n:self.used_lanes, self.pool.scratch_page] = 0
        self.used_lanes = n
        self.table[n:, 0] = self.pool.scratch_page
        self.lengths[n:] = 1
        self.tokens[n:] = 0
        self.n_out[n:] = 0
        self.n_active.fill_(n)

    # ---- one step ------------------------------------------------------------------------------------------
    def step(self, rows) -> tuple[list, torch.Tensor | None]:
        """One decode step of `rows`: each row's last token is fed (its slot appended to row.slots here) and
        the next sampled. Returns [token, H_t, log p, ended] per row (one transfer) and, when any row keeps
        hidden states, the rows' final hidden states [rows, d] (a copy, on the device). On an error (e.g. out
        of memory) the rows' contexts are as they were and the device state is rebuilt at the next step."""
        done = []
        try:
            for row in rows:
                self.pool.extend(row.slots, 1)
                done.append(row)
            self.sync(rows)
            self.run(self.bucket(len(rows)))
        except BaseException:
            for row in done:
                self.pool.shrink(row.slots, 1)
            self.lane_ids = None
            raise
        hidden = self.hidden[:len(rows)].clone() if any(r.hidden is not None for r in rows) else None
        return to_host(self.out[:len(rows)]), hidden

    def run(self, size: int) -> None:
        with kv.attention_backend(self.model, register_attention()), no_eager_fallback():
            if self.mode == "graph" and not self.capture_failed:
                graph = self.graphs.get(size)
                if graph is not None:
                    graph.replay()
                    self.steps["replayed"] += 1
                    return
                decode_step(self.model, self.warp, self, size)   # a real step; compiles flex for this bucket
                self.steps["eager"] += 1
                self.capture(size)
                return
            if self.compiled is not None and self.steps["eager"]:
                self.compiled(self.model, self.warp, self, size)
                self.steps["compiled"] += 1
            else:
                decode_step(self.model, self.warp, self, size)
                self.steps["eager"] += 1

    def capture(self, size: int) -> None:
        """Record this bucket's step as a CUDA graph (nothing runs while recording); on failure the engine
        decodes eagerly from now on and says why, once."""
        try:
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                decode_step(self.model, self.warp, self, size)
            self.graphs[size] = graph
            self.steps["captured"] += 1
        except Exception as err:        # e.g. an op that syncs, or a kernel that cannot be captured
            first = str(err).splitlines()[0][:200] if str(err) else ""
            self.capture_failed = f"{type(err).__name__}: {first}"
            print(f"engine: CUDA graph capture failed ({self.capture_failed}); decoding eagerly", flush=True)

    def check(self, rows) -> None:
        """Tests, between steps: the device lanes hold what the host says — each row's table, its length (its
        context and the token it feeds next), that token, and its count of tokens."""
        n = len(rows)
        lengths, tokens, n_out = (t[:n].tolist() for t in (self.lengths, self.tokens, self.n_out))
        for i, row in enumerate(rows):
            pages = self.pool.pages_of(row.slots)
            assert self.table[i, :len(pages)].tolist() == pages, (i, pages)
            assert (lengths[i], tokens[i], n_out[i]) == (len(row.slots) + 1, row.out.tokens[-1],
                                                         len(row.out.tokens)), i
