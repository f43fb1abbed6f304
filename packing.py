"""packing.py — one forward pass per unique tree token: trees packed into sequences under a tree attention mask.

A tree (and a GRPO group: a tree of depth one) becomes one sequence: the prompt once, then every block's tokens
once in depth-first order. Each token keeps the position id it has in its own root-to-leaf sequence and attends
exactly to its ancestors (the prompt, the blocks on its path, the earlier tokens of its own block) and itself, so
its hidden state — hence its log-probability — is the one a separate forward of its root-to-leaf sequence gives.
A block's first token is predicted from the last token of its parent block (the prompt's last token at the root):
with DATPO's mid-response forks that is not the token before it in the packed order, so targets are gathered
through `pred_index`, never a plain shift.

Paper map:
  TrainTree, path_multiplicity   Sec. 4.2 / App. F (block advantages); App. F.4 (TreeRL/AttnRL flatten
                                 root-to-leaf paths: a token counts once per path through it)
  minibatches, loss_normaliser   App. E.2: mini-batches counted in contiguous blocks (64 in the paper),
                                 re-shuffled every PPO epoch; Eq. DATPO's 1/Σ|b| normaliser (Dr.GRPO: constant)
  split_items, micro_batches, pack, packed_logprobs
                                 the forward of Eq. DATPO's ratio π_θ(b_t | s, b_<t) for every block token

Depth-first order makes the mask an interval test: the tokens of the subtree of a block are contiguous, so key k
is visible from query q iff k ≤ q < subtree_end[k] (subtree_end = where the subtree of k's block ends; for a
prompt token, where its tree ends). One integer per token describes the whole mask, run by one of three kernels
(`--packed_attention`):
  tree   SDPA segment by segment: each block attends to its ancestors' keys gathered + itself causally, blocks of
         similar length batched (tree_buckets). Work Σ |block|·|path|, what the tree needs; the CPU default.
  flex   a flex_attention BlockMask (128×128 tiles nobody sees are skipped); the CUDA default.
  dense  one [L, L] boolean mask through SDPA: O(L²) work and memory; the reference path.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from harness import distributed as D
import rollout as R


# --------------------------------------------------------------------------------------------------------
# What the update trains
# --------------------------------------------------------------------------------------------------------
@dataclass
class TrainTree:
    """One prompt's tree as the update sees it: per block its parent, tokens, advantage Â(b) and weight.

    weight is the number of times the objective counts each token of the block: 1 for DATPO and the parallel
    baselines (every tree token trained once), the number of trained root-to-leaf paths through the block for
    TreeRL/AttnRL (their flattened objective), 0 for a block that is context only (never trained).
    `paths` lists the trained root-to-leaf paths of the flattened methods (block indices from the prompt
    down); the rows layout forwards exactly those sequences, as TreeRL/AttnRL do. `behaviour` (one-step
    off-policy): a stale block's generation-time log-probs, the loss's old log-probs for its tokens.
    """
    prompt_ids: list[int]
    parents: list[int | None]
    tokens: list[list[int]]
    advantages: list[float]
    weights: list[float]
    paths: list[list[int]] | None = None
    behaviour: list[list[float] | None] | None = None   # per block: the log-probs its tokens were sampled with
                                                        # when older than the weights updated (offpolicy.py)

    @property
    def trained(self) -> list[int]:
        return [b for b, w in enumerate(self.weights) if w > 0]

    @property
    def unique_tokens(self) -> int:
        """Prompt once + every generated token once."""
        return len(self.prompt_ids) + sum(len(t) for t in self.tokens)


def children_of(parents: list[int | None]) -> dict[int | None, list[int]]:
    """Children of each block (None = the prompt), in block order: a base response's own continuation comes
    before the branches at its end, as rollout.py appends them."""
    kids: dict[int | None, list[int]] = {None: []}
    for b, p in enumerate(parents):
        kids.setdefault(b, [])
        kids.setdefault(p, []).append(b)
    return kids


def ancestors(parents: list[int | None], block: int) -> list[int]:
    """Blocks above `block`, from the prompt down (excluding the block itself)."""
    out = []
    node = parents[block]
    while node is not None:
        out.append(node)
        node = parents[node]
    return out[::-1]


def path_multiplicity(parents: list[int | None], paths: list[list[int]]) -> list[int]:
    """Number of the given root-to-leaf paths that pass through each block (App. F.4: the flattened
    objective of TreeRL/AttnRL sums a shared token once per path; weighting it by this count reproduces that
    sum with one forward of the token)."""
    count = [0] * len(parents)
    for path in paths:
        for b in path:
            count[b] += 1
    return count


def token_offsets(trees: list[TrainTree]) -> list[list[int]]:
    """Index of each block's first token in one flat buffer over all generated tokens of all trees (the
    buffers of advantages, weights and old log-probs are indexed by it)."""
    out, at = [], 0
    for tr in trees:
        offs = []
        for toks in tr.tokens:
            offs.append(at)
            at += len(toks)
        out.append(offs)
    return out


# --------------------------------------------------------------------------------------------------------
# Mini-batches: counted in blocks (App. E.2), re-shuffled every epoch, normaliser per mini-batch
# --------------------------------------------------------------------------------------------------------
Unit = tuple[int, tuple[int, ...]]     # (tree index, trained blocks of that tree in this mini-batch)


def minibatches(trees: list[TrainTree], size: int, grouping: str, rng) -> list[list[Unit]]:
    """One epoch's mini-batches, freshly shuffled (App. E.2 counts mini-batches in blocks; the release
    re-shuffles every PPO epoch).

    trees:  whole trees, shuffled at the tree level, added to a mini-batch while that brings its block count
            closer to `size` — a tree's shared tokens are forwarded once per mini-batch.
    blocks: random trained blocks, `size` per mini-batch, as the release does — a block's ancestors are
            forwarded again as context in every mini-batch that holds one of its descendants.
    """
    if grouping == "blocks":
        units = [(t, b) for t, tr in enumerate(trees) for b in tr.trained]
        rng.shuffle(units)
        out = []
        for i in range(0, len(units), size):
            by_tree: dict[int, list[int]] = {}
            for t, b in units[i:i + size]:
                by_tree.setdefault(t, []).append(b)
            out.append([(t, tuple(sorted(bs))) for t, bs in sorted(by_tree.items())])
        return out
    if grouping != "trees":
        raise ValueError(f"mini_batch_grouping must be 'trees' or 'blocks', got {grouping!r}")
    order = [t for t, tr in enumerate(trees) if tr.trained]
    rng.shuffle(order)
    out, current, count = [], [], 0
    for t in order:
        n = len(trees[t].trained)
        if current and abs(count + n - size) > abs(count - size):
            out.append(current)
            current, count = [], 0
        current.append((t, tuple(trees[t].trained)))
        count += n
    if current:
        out.append(current)
    return out


def loss_normaliser(trees: list[TrainTree], units: list[Unit], loss_norm: str, max_new_tokens: int,
                    max_path_tokens: int | None = None) -> float:
    """The denominator of one mini-batch's loss, from its units alone (so a multi-device run can all-reduce it).

    token:    Σ over trained blocks of weight·|b| — Eq. DATPO's 1/Σ|b| (DAPO's token-level loss); with the
              path multiplicities of TreeRL/AttnRL it is the token count of their flattened paths.
    constant: Dr.GRPO's length-unbiased constant, sequences × the longest a sequence can be: blocks ×
              max_new_tokens (for the parallel baselines a block is a response: G·L_max per prompt); for the
              flattened methods, their trained paths ending in the mini-batch × max_path_tokens (a path can
              exceed max_new_tokens under the full branch budget).
    Zero-advantage blocks count (the loss equals the full computation) though they cost no forward.
    """
    if loss_norm == "constant":
        total = 0
        for t, bs in units:
            if trees[t].paths is None:
                total += len(bs) * max_new_tokens
            else:
                ends = set(bs)
                total += sum(p[-1] in ends for p in trees[t].paths) * (max_path_tokens or max_new_tokens)
        return float(total)
    if loss_norm != "token":
        raise ValueError(f"loss_norm must be 'token' or 'constant', got {loss_norm!r}")
    return float(sum(trees[t].weights[b] * len(trees[t].tokens[b]) for t, bs in units for b in bs))


# --------------------------------------------------------------------------------------------------------
# Splitting trees into micro-batches sized in tokens
# --------------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """Blocks of one tree that travel together: a whole subtree when it fits, else one block alone."""
    tree: int
    blocks: list[int]               # trained and context blocks of the item, depth-first order
    trained: list[int]


def live_blocks(tr: TrainTree, blocks) -> list[int]:
    """Blocks whose tokens move the loss: trained (weight > 0) with a non-zero advantage. The others still
    count in the normaliser but need no forward."""
    return [b for b in blocks if tr.weights[b] > 0 and tr.advantages[b] != 0]


def split_items(tr: TrainTree, tree_index: int, trained: list[int], max_tokens: int) -> list[Item]:
    """Cut the part of a tree that must be forwarded (the live trained blocks and their ancestors) at block
    boundaries into items of at most `max_tokens` tokens with their context: a subtree that fits with its
    ancestors is one item; one that does not becomes its root block alone plus its children's subtrees, each
    carrying the ancestors as context. A single block longer than the budget is an item of its own."""
    live = set(live_blocks(tr, trained))
    if not live:
        return []
    need = set(live)
    for b in live:
        need.update(ancestors(tr.parents, b))
    kids = {b: [c for c in cs if c in need] for b, cs in children_of(tr.parents).items()}
    size: dict[int, int] = {}

    def subtree_size(b: int) -> int:
        size[b] = len(tr.tokens[b]) + sum(subtree_size(c) for c in kids[b])
        return size[b]

    def subtree(b: int) -> list[int]:
        return [b] + [x for c in kids[b] for x in subtree(c)]

    items: list[Item] = []

    def visit(b: int, context: int) -> None:
        if context + size[b] <= max_tokens or not kids[b]:
            blocks = subtree(b)
            items.append(Item(tree_index, blocks, [x for x in blocks if x in live]))
            return
        if b in live:
            items.append(Item(tree_index, [b], [b]))
        for c in kids[b]:
            visit(c, context + len(tr.tokens[b]))

    for root in kids[None]:
        subtree_size(root)
        visit(root, len(tr.prompt_ids))
    return items


def needed_blocks(trees: list[TrainTree], items: list[Item]) -> dict[int, set[int]]:
    """Per tree, the blocks a packed sequence of these items forwards: the items' blocks and their ancestors."""
    per_tree: dict[int, set[int]] = {}
    for it in items:
        need = per_tree.setdefault(it.tree, set())
        for b in it.blocks:
            need.add(b)
            need.update(ancestors(trees[it.tree].parents, b))
    return per_tree


def item_cost(trees: list[TrainTree], items: list[Item]) -> int:
    """Tokens a packed sequence of these items forwards: per tree its prompt once and each needed block once."""
    return sum(len(trees[t].prompt_ids) + sum(len(trees[t].tokens[b]) for b in need)
               for t, need in needed_blocks(trees, items).items())


def micro_batches(trees: list[TrainTree], units: list[Unit], max_tokens: int) -> list[list[Item]]:
    """A mini-batch's units as micro-batches of at most `max_tokens` forwarded tokens: first fit, items in
    tree and depth-first order, so a tree's items land in few micro-batches and share their prompt and
    ancestors there (sorting items by size would scatter each tree and forward its prompt many times)."""
    bins: list[list[Item]] = []
    for t, blocks in units:
        for it in split_items(trees[t], t, list(blocks), max_tokens):
            for members in bins:
                if item_cost(trees, members + [it]) <= max_tokens:
                    members.append(it)
                    break
            else:
                bins.append([it])
    return bins


# --------------------------------------------------------------------------------------------------------
# Packing: tokens, position ids, the tree mask as subtree ends, targets
# --------------------------------------------------------------------------------------------------------
@dataclass
class Packed:
    """One packed sequence and its targets. Target j is token `target_ids[j]`, predicted by the hidden state
    at packed position `pred_index[j]`; `target_gidx[j]` is its index in the step's flat token buffers."""
    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    subtree_end: list[int] = field(default_factory=list)
    pred_index: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    target_gidx: list[int] = field(default_factory=list)
    target_weights: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.input_ids)


def pack(trees: list[TrainTree], items: list[Item], offsets: list[list[int]]) -> Packed:
    """Pack items (from one or several trees) into one sequence. Per tree: the prompt, then the needed blocks
    (the items' blocks and their ancestors) depth-first; targets are the tokens of the items' trained blocks.
    Trees follow each other block-diagonally (a prompt's subtree ends where its tree ends)."""
    out = Packed()
    needed = needed_blocks(trees, items)
    trained_in: dict[int, set[int]] = {}
    for it in items:
        trained_in.setdefault(it.tree, set()).update(it.trained)
    for t in sorted(needed):
        need, trained = needed[t], trained_in[t]
        tr = trees[t]
        kids = children_of(tr.parents)
        start = len(out)
        out.input_ids += tr.prompt_ids
        out.position_ids += range(len(tr.prompt_ids))
        out.subtree_end += [0] * len(tr.prompt_ids)

        def emit(b: int, last: int, position: int) -> None:
            """Emit block b whose path so far ends at packed index `last`, next position id `position`."""
            toks = tr.tokens[b]
            first = len(out)
            out.input_ids += toks
            out.position_ids += range(position, position + len(toks))
            out.subtree_end += [0] * len(toks)
            if b in trained:
                out.pred_index += [last] + list(range(first, first + len(toks) - 1))
                out.target_ids += toks
                out.target_gidx += range(offsets[t][b], offsets[t][b] + len(toks))
                out.target_weights += [tr.weights[b]] * len(toks)
            block_last = first + len(toks) - 1 if toks else last
            for c in kids[b]:
                if c in need:
                    emit(c, block_last, position + len(toks))
            out.subtree_end[first:first + len(toks)] = [len(out)] * len(toks)

        for root in kids[None]:
            if root in need:
                emit(root, start + len(tr.prompt_ids) - 1, len(tr.prompt_ids))
        out.subtree_end[start:start + len(tr.prompt_ids)] = [len(out)] * len(tr.prompt_ids)
    return out


def dense_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """[L, L] boolean tree mask, True = attend: key k is visible from query q iff k ≤ q < subtree_end[k]."""
    idx = torch.arange(len(subtree_end), device=subtree_end.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end[None, :])


# ---- "flex" kernel: flex_attention over a BlockMask, compiled once per packed-length bucket ----------------
FLEX_TILE = 128       # flex_attention's block size: the mask is described per 128 × 128 tile


def flex_bucket(length: int, max_tokens: int | None = None) -> int:
    """The length a packed sequence of `length` tokens is padded to before flex_attention, so that the compiled
    kernel sees a few static shapes (a new shape is a new compile; torch.compile's dynamic-shape recompile
    of flex fails on CPU and is unproven on CUDA): multiples of max_tokens/8 rounded up to whole 128-token
    tiles — 8 buckets up to the budget (padding ≤ 1/8 of the budget); without a budget, the next power of two."""
    if max_tokens:
        step = -(-max(-(-max_tokens // 8), 1) // FLEX_TILE) * FLEX_TILE
        return -(-length // step) * step
    return max(FLEX_TILE, 1 << max(length - 1, 0).bit_length())


def pad_packed(packed: Packed, length: int, pad_id: int = 0) -> Packed:
    """`packed` with padding tokens up to `length`: each sees only itself (subtree_end = its index + 1), so no
    real token sees it and its output is never a target; position id 0 keeps it inside the rotary tables."""
    n = length - len(packed)
    if n <= 0:
        return packed
    return Packed(packed.input_ids + [pad_id] * n, packed.position_ids + [0] * n,
                  packed.subtree_end + list(range(len(packed) + 1, length + 1)), packed.pred_index,
                  packed.target_ids, packed.target_gidx, packed.target_weights)


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
    whole = q_first + tile <= length                                          # a ragged last tile stays partial
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

        # 8 buckets up to the budget × (no-grad old log-probs, training) + the probe, under the default limit 8
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

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout:
        raise ValueError("the flex kernel runs without attention dropout; the update runs the model in eval mode")
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


def probe_flex(device, dtype=torch.float32, heads: int = 2, kv_heads: int = 1, head_dim: int = 64) -> str | None:
    """One tiny compiled flex forward + backward under a tree mask on `device` (2 tiles, the model's head
    shape and dtype): None when it runs and matches SDPA, else why not, in one line. Compile, Triton or
    backward failures show here, at start-up, not at the first update after a whole rollout."""
    try:
        length = 2 * FLEX_TILE
        ends = torch.full((length,), length, device=device)
        ends[FLEX_TILE // 2:FLEX_TILE] = FLEX_TILE                   # a block whose subtree closes mid-sequence
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


_kernel_choice: dict = {}


def resolve_kernel(requested: str, device, model=None, dtype: torch.dtype | None = None) -> tuple[str, str | None]:
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
    if key not in _kernel_choice:
        why = probe_flex(device, dtype, heads, kv_heads, head_dim)
        _kernel_choice[key] = why
        if why:
            from harness import faults

            faults.say(f"packed attention: flex_attention cannot run here ({why}); using the tree kernel")
    why = _kernel_choice[key]
    return ("tree", why) if why else ("flex", None)


# ---- "tree" kernel: SDPA per segment over that segment's ancestors (the CPU default) ----------------------
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
            mask[j, 0, n:, 0] = True      # padded queries see one key (no all-masked row); their output is dropped
        buckets.append(SegmentBucket(q_index.to(device), q_valid.to(device), k_index.to(device), mask.to(device)))
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

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
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
    """Make "datpo_tree" an attention implementation HF models can run (idempotent); masks for forwards without
    tree_buckets are built as for SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("datpo_tree", tree_attention)
    AttentionMaskInterface.register("datpo_tree", sdpa_mask)
    return "datpo_tree"


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
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def fp32_logits(lm_head, hidden: torch.Tensor) -> torch.Tensor:
    """Logits computed in fp32 (hidden states and lm_head weight upcast, autocast off): bf16 logits are
    rounded to 8 bits before any upcast (|Δ log p| up to ~0.1 at logits of a few tens), which would put that
    noise into the PPO ratio."""
    bias = getattr(lm_head, "bias", None)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.float(), lm_head.weight.float(),
                                          None if bias is None else bias.float())


@contextlib.contextmanager
def fp32_head(model):
    """The model's own lm_head computing fp32 logits (fp32_logits) while inside: under torchrun the model's
    forward must compute the logits (DDP's and FSDP2's hooks live there), and they must be the same fp32
    logits one process takes its log-softmax of."""
    head = model.get_output_embeddings()
    head.forward = functools.partial(fp32_logits, head)
    try:
        yield
    finally:
        del head.forward     # the class's forward again


def _target_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = fp32_logits(lm_head, hidden)
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_logprobs(lm_head, hidden: torch.Tensor, pred_index: torch.Tensor, targets: torch.Tensor,
                     chunk: int) -> torch.Tensor:
    """log π(target | its path) for every target, `chunk` targets at a time: lm_head + log-softmax in fp32
    (from fp32 hidden states and weights, _target_logprobs) never materialise for the whole sequence, and
    under autograd each chunk is recomputed in the backward (activation checkpointing) so only the hidden
    states stay alive — [chunk, vocab] fp32 at a time (plus, per chunk, an fp32 copy of the lm_head weight:
    151,936 × 2,048 × 4 B ≈ 1.2 GB for Qwen2.5-3B, transient)."""
    out = []
    for s in range(0, len(targets), chunk):
        h = hidden.index_select(0, pred_index[s:s + chunk])
        t = targets[s:s + chunk]
        if torch.is_grad_enabled() and h.requires_grad:
            out.append(checkpoint(_target_logprobs, lm_head, h, t, use_reentrant=False))
        else:
            out.append(_target_logprobs(lm_head, h, t))
    return torch.cat(out) if out else hidden.new_zeros(0)


def _logits_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.float()
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def packed_logprobs(model, packed: Packed, device, kernel: str = "dense", chunk: int = 2048,
                    bucket_tokens: int | None = None) -> torch.Tensor:
    """One model call over a packed sequence (4D tree mask + explicit position ids) → the log-prob of every
    target, in `packed.target_ids` order.

    Under torchrun (distributed.py) the model's own forward must run, since DDP's and FSDP2's hooks live there:
    it returns logits at the targets only (logits_to_keep = their positions), a [targets, vocab] tensor per
    micro-batch rather than `chunk` rows of it; the fp32 log-softmax is still taken `chunk` rows at a time.
    flex: the sequence is padded to its length bucket (flex_bucket of `bucket_tokens`, the micro-batch budget)
    so the compiled kernel sees a few static shapes."""
    if kernel == "flex":
        packed = pad_packed(packed, flex_bucket(len(packed), bucket_tokens))
    ids = torch.tensor([packed.input_ids], device=device)
    positions = torch.tensor([packed.position_ids], device=device)
    ends = torch.tensor(packed.subtree_end, device=device)
    pred_index = torch.tensor(packed.pred_index, device=device)
    targets = torch.tensor(packed.target_ids, device=device)
    inner = D.unwrap(model)
    mask = tree_attention_mask(inner, ends, kernel)
    extra = {"tree_buckets": tree_buckets(packed.subtree_end, device)} if kernel == "tree" else {}
    with kernel_backend(inner, kernel):
        if D.active():
            with fp32_head(inner):
                logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                               logits_to_keep=pred_index, **extra).logits[0]
            parts = [checkpoint(_logits_logprobs, logits[s:s + chunk], targets[s:s + chunk], use_reentrant=False)
                     if torch.is_grad_enabled() and logits.requires_grad
                     else _logits_logprobs(logits[s:s + chunk], targets[s:s + chunk])
                     for s in range(0, len(targets), chunk)]
            return torch.cat(parts) if parts else logits.new_zeros(0)
        hidden = inner.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions,
                                     use_cache=False, **extra).last_hidden_state[0]
    return chunked_logprobs(inner.get_output_embeddings(), hidden, pred_index, targets, chunk)


# --------------------------------------------------------------------------------------------------------
# The rows layout: every trained chain of blocks as its own left-padded row with its whole context
# (the simple path, and the oracle the packed layout is tested against)
# --------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One training sequence: context + targets; `gidx`/`weights` per target token."""
    ids: list[int]
    n_context: int
    gidx: list[int]
    weights: list[float]

    @property
    def n_targets(self) -> int:
        return len(self.ids) - self.n_context


def unit_rows(tr: TrainTree, blocks, offsets: list[int]) -> list[Row]:
    """Rows of one unit. The flattened methods' whole trees: their root-to-leaf paths, shared prefixes
    trained again in every path (TreeRL/AttnRL's own objective, App. F.4). Otherwise each live block once: a
    row trains a chain of blocks (a base response's blocks, one after the other) with its ancestors as
    context — a branch is its one block after the shared prefix."""
    live = set(live_blocks(tr, blocks))
    if not live:
        return []

    def tokens_of(bs):
        return [x for b in bs for x in tr.tokens[b]]

    def gidx_of(bs):
        return [offsets[b] + i for b in bs for i in range(len(tr.tokens[b]))]

    if tr.paths is not None and set(blocks) == set(tr.trained):
        rows = []
        for path in tr.paths:
            if live & set(path):
                rows.append(Row(tr.prompt_ids + tokens_of(path), len(tr.prompt_ids), gidx_of(path),
                                [1.0] * sum(len(tr.tokens[b]) for b in path)))
        return rows
    kids = children_of(tr.parents)
    rows, done = [], set()
    for b in sorted(live):
        if b in done:
            continue
        chain = [b]
        while True:       # follow the first live child: a base response continues in its own next block
            nxt = [c for c in kids[chain[-1]] if c in live and c not in done]
            if not nxt:
                break
            chain.append(nxt[0])
        done.update(chain)
        context = tr.prompt_ids + tokens_of(ancestors(tr.parents, b))
        rows.append(Row(context + tokens_of(chain), len(context), gidx_of(chain),
                        [tr.weights[c] for c in chain for _ in tr.tokens[c]]))
    return rows


def row_logprobs(model, rows: list[Row], pad_id: int, device) -> list[torch.Tensor]:
    """log π(target token | context) for each row, one forward over a left-padded micro-batch.

    Rows end at the same column, so only the last max(targets) positions need logits (logits_to_keep), and
    position ids follow the attention mask so padding does not shift the rotary phases.
    """
    ids, mask = R.left_pad([r.ids for r in rows], pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = max(r.n_targets for r in rows)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=keep + 1).logits[:, :-1].float()          # predicts the last `keep` tokens
    targets = ids[:, -keep:]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return [logp[i, keep - r.n_targets:] for i, r in enumerate(rows)]


# --------------------------------------------------------------------------------------------------------
# One interface for both layouts
# --------------------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """One forward/backward: a packed sequence or a list of rows, and per target its flat token index and
    weight (the loss of the micro-batch is −Σ weight·objective / the mini-batch's normaliser)."""
    gidx: list[int]
    weights: list[float]
    forwarded: int                  # tokens the model is fed (padding excluded)
    packed: Packed | None = None
    rows: list[Row] | None = None


def layout_micro_batches(trees: list[TrainTree], units: list[Unit], offsets: list[list[int]], layout: str,
                         max_tokens: int, rows_per_micro: int) -> list[MicroBatch]:
    """A mini-batch's micro-batches: packed sequences of at most `max_tokens` tokens, or rows (sorted by
    length, less padding) `rows_per_micro` at a time."""
    if layout == "packed":
        out = []
        for items in micro_batches(trees, units, max_tokens):
            pk = pack(trees, items, offsets)
            out.append(MicroBatch(pk.target_gidx, pk.target_weights, len(pk), packed=pk))
        return out
    if layout != "rows":
        raise ValueError(f"train_layout must be 'packed' or 'rows', got {layout!r}")
    rows = [r for t, blocks in units for r in unit_rows(trees[t], blocks, offsets[t])]
    rows.sort(key=lambda r: len(r.ids))
    out = []
    for i in range(0, len(rows), rows_per_micro):
        chunk = rows[i:i + rows_per_micro]
        out.append(MicroBatch([g for r in chunk for g in r.gidx], [w for r in chunk for w in r.weights],
                              sum(len(r.ids) for r in chunk), rows=chunk))
    return out


def micro_logprobs(model, micro: MicroBatch, pad_id: int, device, kernel: str = "dense",
                   bucket_tokens: int | None = None) -> torch.Tensor:
    """Log-probs of a micro-batch's targets, in `micro.gidx` order (bucket_tokens: packed_logprobs)."""
    if micro.packed is not None:
        return packed_logprobs(model, micro.packed, device, kernel, bucket_tokens=bucket_tokens)
    return torch.cat(row_logprobs(model, micro.rows, pad_id, device))
