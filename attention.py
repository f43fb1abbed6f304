"""attention.py — the packed update's attention kernels, and which one runs (the update is a third of a
DATPO step: App. F.3, Table "runtime breakdown", 102 of 300 s).

packing.py packs a tree into one sequence whose mask is one integer per token: depth-first order keeps a
subtree's tokens contiguous, so key k is visible from query q iff k ≤ q < subtree_end[k]. This file runs that
mask inside an HF model, by one of three kernels (`--packed_attention auto|tree|flex|dense`):

  tree   SDPA segment by segment: a segment (tokens that see the same earlier tokens: a prompt, a block, a
         chain of single children) attends to its ancestors' keys, gathered, plus itself causally; segments
         of similar length share one padded SDPA call (tree_buckets). Work Σ |segment|·(|context| +
         |segment|), what the tree needs. The default without CUDA, and wherever flex cannot run.
  flex   flex_attention over a BlockMask built tile by tile: 128 × 128 tiles nobody sees are skipped, memory
         O(L + (L/128)²). Compiled once per packed-length bucket (static shapes) and probed once at start-up
         (resolve_kernel: it falls back to tree, saying why). The default on CUDA.
  dense  one boolean [L, L] mask through the model's own SDPA (an additive float mask for eager attention):
         O(L²) work and memory. The reference the other two are tested against; only when asked.

packing.packed_logprobs uses tree_attention_mask, tree_buckets, flex_bucket and kernel_backend;
train.ppo_update resolves the kernel once per update and keeps its backend set until the last backward.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


# --------------------------------------------------------------------------------------------------------
# The tree mask as the model takes it
# --------------------------------------------------------------------------------------------------------
def dense_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """[L, L] boolean tree mask, True = attend: key k is visible from query q iff k ≤ q < subtree_end[k]."""
    idx = torch.arange(len(subtree_end), device=subtree_end.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])


def tree_attention_mask(model, subtree_end: torch.Tensor, kernel: str):
    """The 4D mask the HF model takes as-is (transformers 5 returns a 4D mask untouched from its mask
    creation): a BlockMask for flex; a boolean [1, 1, L, L] for SDPA (True = attend); an additive float mask
    for eager attention, which adds the mask to the scores (a boolean there would be added as 0/1)."""
    if kernel == "flex":
        return flex_block_mask(subtree_end)
    if kernel == "tree":     # the tree travels as tree_buckets; a 4D tensor makes HF skip its mask creation
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=subtree_end.device)
    mask = dense_mask(subtree_end)[None, None]
    if model.config._attn_implementation == "eager":
        dtype = next(model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min)
    return mask


# --------------------------------------------------------------------------------------------------------
# "tree" kernel: SDPA per segment over that segment's ancestors (the CPU default)
# --------------------------------------------------------------------------------------------------------
@dataclass
class SegmentBucket:
    """Segments of similar length attended in one SDPA call: queries [n, q_len], keys [n, k_len] (indices into
    the packed sequence, padded with 0) and the boolean mask [n, 1, q_len, k_len] (True = attend)."""
    q_index: torch.Tensor
    q_valid: torch.Tensor
    k_index: torch.Tensor
    mask: torch.Tensor


def tree_segments(subtree_end: list[int]) -> list[tuple[int, int, list[int]]]:
    """The packed sequence as segments [start, end) of tokens that see the same earlier tokens: a maximal run
    with one subtree_end (a block — with a chain of single children — or a prompt). Each comes with its
    context: the earlier keys it sees, those k < start whose subtree is still open (subtree_end[k] > start).
    Within a segment attention is causal, so segment + context is exactly the tree mask, row by row."""
    segments, start = [], 0
    length = len(subtree_end)
    open_ranges: list[tuple[int, int, int]] = []      # (start, end, subtree_end) of the segments on the path
    for i in range(1, length + 1):
        if i == length or subtree_end[i] != subtree_end[start]:
            open_ranges = [r for r in open_ranges if r[2] > start]
            context = [k for a, b, _ in open_ranges for k in range(a, b)]
            segments.append((start, i, context))
            open_ranges.append((start, i, subtree_end[start]))
            start = i
    return segments


def tree_buckets(subtree_end: list[int], device) -> list[SegmentBucket]:
    """Segments grouped by their length rounded up to a power of two (padding at most doubles a bucket's
    queries), each group one padded SDPA call: the attention work is Σ segment × (context + segment) — what
    the tree needs — instead of L² for the dense mask."""
    groups: dict[int, list] = {}
    for seg in tree_segments(subtree_end):
        groups.setdefault(1 << max(seg[1] - seg[0] - 1, 0).bit_length(), []).append(seg)
    buckets = []
    for segs in groups.values():
        q_len = max(e - s for s, e, _ in segs)
        k_len = max(len(c) + e - s for s, e, c in segs)
        q_index = torch.zeros(len(segs), q_len, dtype=torch.long)
        q_valid = torch.zeros(len(segs), q_len, dtype=torch.bool)
        k_index = torch.zeros(len(segs), k_len, dtype=torch.long)
        mask = torch.zeros(len(segs), 1, q_len, k_len, dtype=torch.bool)
        for j, (s, e, context) in enumerate(segs):
            n, c = e - s, len(context)
            q_index[j, :n] = torch.arange(s, e)
            q_valid[j, :n] = True
            k_index[j, :c + n] = torch.tensor(context + list(range(s, e)), dtype=torch.long)
            mask[j, 0, :n, :c] = True
            mask[j, 0, :n, c:c + n] = torch.ones(n, n, dtype=torch.bool).tril()
            mask[j, 0, n:, 0] = True      # padded queries see one key (no all-masked row); output dropped
        buckets.append(SegmentBucket(q_index.to(device), q_valid.to(device), k_index.to(device),
                                     mask.to(device)))
    return buckets


def tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, tree_buckets=None,
                   **kwargs):
    """An HF attention function (registered as "datpo_tree"): exact tree attention, bucket by bucket. query
    [1, H, L, d], key/value [1, H_kv, L, d] → output [1, L, H, d] as HF's attention functions return it. The
    tree comes as `tree_buckets` (a forward kwarg that HF passes down to every attention call, so activation
    checkpointing's recomputation gets it too); `attention_mask` is then a placeholder. Without tree_buckets
    (any other forward while the backend is set, e.g. torchrun's zero-gradient pass) it is plain SDPA."""
    if tree_buckets is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    groups = query.shape[1] // key.shape[1]
    q, k, v = query[0], key[0], value[0]                           # [H, L, d], [H_kv, L, d]
    outputs, positions = [], []
    for b in tree_buckets:
        n, q_len = b.q_index.shape
        qs = q[:, b.q_index.reshape(-1)].unflatten(1, (n, q_len)).transpose(0, 1)       # [n, H, q_len, d]
        ks = k[:, b.k_index.reshape(-1)].unflatten(1, (n, -1)).transpose(0, 1)          # [n, H_kv, k_len, d]
        vs = v[:, b.k_index.reshape(-1)].unflatten(1, (n, -1)).transpose(0, 1)
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=1), vs.repeat_interleave(groups, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=b.mask, scale=scaling,
                                                             dropout_p=dropout)       # [n, H, q_len, d]
        outputs.append(o.transpose(1, 2)[b.q_valid])                                    # [tokens, H, d]
        positions.append(b.q_index[b.q_valid])
    # the segments cover every token once, so the bucket outputs are the sequence in another order
    return torch.cat(outputs)[torch.argsort(torch.cat(positions))][None], None


def register_tree_attention() -> str:
    """Make "datpo_tree" an attention implementation HF models can run (idempotent); masks for forwards
    without tree_buckets are built as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("datpo_tree", tree_attention)
    AttentionMaskInterface.register("datpo_tree", sdpa_mask)
    return "datpo_tree"


# --------------------------------------------------------------------------------------------------------
# "flex" kernel: flex_attention over a BlockMask, compiled once per packed-length bucket (CUDA)
# --------------------------------------------------------------------------------------------------------
FLEX_TILE = 128       # flex_attention's block size: the mask is described per 128 × 128 tile


def flex_bucket(length: int, max_tokens: int | None = None) -> int:
    """The length a packed sequence of `length` tokens is padded to before flex_attention, so that the
    compiled kernel sees a few static shapes (a new shape is a new compile; torch.compile's dynamic-shape
    recompile of flex fails on CPU and is unproven on CUDA): multiples of max_tokens/8 rounded up to whole
    128-token tiles — 8 buckets up to the budget (padding ≤ 1/8 of the budget); without a budget, the next
    power of two."""
    if max_tokens:
        step = -(-max(-(-max_tokens // 8), 1) // FLEX_TILE) * FLEX_TILE
        return -(-length // step) * step
    return max(FLEX_TILE, 1 << max(length - 1, 0).bit_length())


def flex_block_mask(subtree_end: torch.Tensor):
    """The tree mask as a flex_attention BlockMask, built tile by tile without the [L, L] mask that
    create_block_mask evaluates: key k is seen by the queries [k, subtree_end[k]), an interval of query tiles
    per key, so a difference array over [key tiles, query tiles] marks every tile someone sees. A tile is
    full (no mask_mod call inside it) when all its keys precede its first query and every key's subtree
    outlives its last query (and both tiles are whole). Memory O(L + (L/128)²); the same tiles as
    create_block_mask. Needs torch ≥ 2.5 (flex_attention)."""
    from torch.nn.attention.flex_attention import BlockMask

    def tree_mask(b, h, q, k):
        return (k <= q) & (q < subtree_end[k])

    length, tile, device = len(subtree_end), FLEX_TILE, subtree_end.device
    n = -(-length // tile)
    keys = torch.arange(length, device=device)
    k_tile = keys // tile
    seen = torch.zeros(n, n + 1, dtype=torch.int32, device=device)          # [key tile, query tile]
    ones = torch.ones(length, dtype=torch.int32, device=device)
    seen.index_put_((k_tile, k_tile), ones, accumulate=True)                # a key sees its own query tile
    last_q_tile = (subtree_end.clamp(min=1) - 1).clamp(min=0) // tile
    seen.index_put_((k_tile, last_q_tile + 1), -ones, accumulate=True)
    partial = (seen.cumsum(1)[:, :n] > 0).T                                  # [query tile, key tile]
    q_first = torch.arange(n, device=device) * tile
    q_last = (q_first + tile).clamp(max=length)                              # one past the tile's last query
    k_last = (q_first + tile).clamp(max=length) - 1                          # each key tile's last key
    min_end = torch.full((n,), length + 1, dtype=subtree_end.dtype, device=device).scatter_reduce(
        0, k_tile, subtree_end, reduce="amin")
    whole = q_first + tile <= length                                     # a ragged last tile stays partial
    full = partial & (k_last[None, :] <= q_first[:, None]) & (min_end[None, :] >= q_last[:, None]) \
        & whole[:, None] & whole[None, :]
    partial = partial & ~full

    def as_indices(tiles: torch.Tensor):
        count = tiles.sum(-1, dtype=torch.int32)
        order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        # contiguous: the compiled kernel indexes them as contiguous (a transposed view gave wrong results)
        return count[None, None].contiguous(), order[None, None].contiguous()

    kv_num, kv_idx = as_indices(partial)
    full_num, full_idx = as_indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=tree_mask,
                                    seq_lengths=(length, length))


_compiled_flex = None


def compiled_flex():
    """flex_attention compiled with static shapes (dynamic=False), once per process: one compile per packed
    length bucket and grad mode. HF's own flex integration compiles with dynamic=None, which recompiles
    with symbolic shapes at the second length — the compile that fails on CPU — hence our own backend."""
    global _compiled_flex
    if _compiled_flex is None:
        import torch._dynamo.config as dynamo_config
        from torch.nn.attention.flex_attention import flex_attention

        # 8 buckets up to the budget × (no-grad old log-probs, training) + the probe; the default limit is 8
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def flex_tree_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An HF attention function (registered as "datpo_flex"): compiled flex_attention over the BlockMask of
    flex_block_mask. query [1, H, L, d], key/value [1, H_kv, L, d] → [1, L, H, d]. Any other mask (a forward
    without the tree, e.g. torchrun's zero-gradient pass) runs plain SDPA."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("the flex kernel runs without attention dropout; the update runs the model in eval "
                         "mode")
    groups = query.shape[1] // key.shape[1]
    gqa = groups > 1
    if gqa and query.shape[1] & (query.shape[1] - 1):      # flex's GQA wants a power-of-two head count
        key, value, gqa = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), False
    out = compiled_flex()(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def register_flex_attention() -> str:
    """Make "datpo_flex" an attention implementation HF models can run (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("datpo_flex", flex_tree_attention)
    AttentionMaskInterface.register("datpo_flex", sdpa_mask)
    return "datpo_flex"


def flex_available(device) -> bool:
    """flex_attention is importable and the device is CUDA (on CPU, flex has no backward)."""
    if torch.device(device).type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import create_block_mask  # noqa: F401
    except ImportError:
        return False
    return True


def probe_flex(device, dtype=torch.float32, heads: int = 2, kv_heads: int = 1,
               head_dim: int = 64) -> str | None:
    """One tiny compiled flex forward + backward under a tree mask on `device` (2 tiles, the model's head
    shape and dtype): None when it runs and matches SDPA, else why not, in one line. Compile, Triton or
    backward failures show here, at start-up, not at the first update after a whole rollout."""
    try:
        length = 2 * FLEX_TILE
        ends = torch.full((length,), length, device=device)
        ends[FLEX_TILE // 2:FLEX_TILE] = FLEX_TILE              # a block whose subtree closes mid-sequence
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, h, length, head_dim, generator=gen).to(device, dtype).requires_grad_()
                   for h in (heads, kv_heads, kv_heads))
        out, _ = flex_tree_attention(None, q, k, v, flex_block_mask(ends))
        out.float().sum().backward()
        groups = heads // kv_heads
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(groups, 1), v.float().repeat_interleave(groups, 1),
            attn_mask=dense_mask(ends)).transpose(1, 2)
        error = (out.float() - ref).abs().max().item()
        if not error < (1e-2 if dtype != torch.float32 else 1e-4) or q.grad is None:
            return f"wrong result (max |flex − sdpa| = {error:.2e})"
    except Exception as err:  # any failure of compile/Triton/backward means: do not use flex here
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"[:200]
    return None


# --------------------------------------------------------------------------------------------------------
# Choosing the kernel and setting it on the model
# --------------------------------------------------------------------------------------------------------
flex_probes: dict = {}     # (device, dtype, heads, kv_heads, head_dim) -> why flex cannot run, or None


def resolve_kernel(requested: str, device, model=None,
                   dtype: torch.dtype | None = None) -> tuple[str, str | None]:
    """The packed attention kernel to use and, when flex was wanted but cannot run, why (a one-line message
    is printed once per process): auto = flex on CUDA when its probe passes, else tree; flex = flex if the
    probe passes, else tree; tree and dense as asked. The probe uses the model's head shape and `dtype` (the
    dtype attention runs in: bf16 under autocast; default the weights')."""
    if requested in ("tree", "dense"):
        return requested, None
    if requested == "auto" and not flex_available(device):
        return "tree", None
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", 2)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or getattr(cfg, "hidden_size", 128 * heads) // heads
    dtype = dtype or (next(model.parameters()).dtype if model is not None else torch.float32)
    key = (str(device), dtype, heads, kv_heads, head_dim)
    if key not in flex_probes:
        why = probe_flex(device, dtype, heads, kv_heads, head_dim)
        flex_probes[key] = why
        if why:
            from runtime import faults

            faults.say(f"packed attention: flex_attention cannot run here ({why}); using the tree kernel")
    why = flex_probes[key]
    return ("tree", why) if why else ("flex", None)


def update_kernel(cfg, device, model=None) -> str:
    """The kernel the update runs with cfg.packed_attention: flex (block-sparse, cost follows the tree) on
    CUDA when its start-up probe passes, else tree (SDPA segment by segment over each segment's ancestors:
    cost follows the tree too); dense (one L × L mask) only when asked. Probed in the dtype attention runs in
    (fp32, or bf16 for both bf16 precisions)."""
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16
    return resolve_kernel(cfg.packed_attention, device, model, dtype)[0]


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run the model with another attention backend for a while (the rollout keeps SDPA for generation).
    The attention layers read config._attn_implementation at every forward."""
    old = model.config._attn_implementation
    if old == name:
        yield
        return
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = old


def kernel_backend(model, kernel: str):
    """The model's attention backend for a packed kernel, for as long as the context lasts: flex_attention,
    datpo_tree (registered here), or the model's own (dense). With activation checkpointing the forward is
    recomputed during backward, so the caller of backward keeps it open until then (train.ppo_update does)."""
    if kernel == "tree":
        return attention_implementation(model, register_tree_attention())
    if kernel == "flex":
        return attention_implementation(model, register_flex_attention())
    return contextlib.nullcontext()
