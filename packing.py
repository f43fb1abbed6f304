"""packing.py — one forward pass per unique tree token:
trees packed into sequences under a tree mask.

A tree (and a GRPO group: a tree of depth one) becomes one sequence: the prompt once, then every
block's tokens once in depth-first order. Each token keeps the position id it has in its own
root-to-leaf sequence and attends exactly to its ancestors (the prompt, the blocks on its path, the
earlier tokens of its own block) and itself, so its hidden state — hence its log-probability — is
the one a separate forward of its root-to-leaf sequence gives. A block's first token is predicted
from the last token of its parent block (the prompt's last token at the root): with DATPO's
mid-response forks that is not the token before it in the packed order, so targets are gathered
through `pred_index`, never a plain shift.

Paper map:
  TrainTree, path_multiplicity   Sec. 4.2 / App. E (block advantages); App. E.4
                                 (TreeRL/AttnRL flatten root-to-leaf paths: a token counts once
                                 per path through it)
  minibatches, loss_normaliser   App. F.2: mini-batches counted in contiguous blocks (64 in the
                                 paper), re-shuffled every PPO epoch; Eq. DATPO's 1/Σ|b| normaliser
                                 (Dr.GRPO: constant)
  split_items, micro_batches, pack, packed_logprobs
                                 the forward of Eq. DATPO's ratio π_θ(b_t | s, b_<t) for every
                                 block token
  target_logprobs, gather_logprobs
                                 the lm_head projection (fp32) and the update's one log-softmax
  unit_rows, row_logprobs        the same log-probs from one left-padded row per trained chain of
                                 blocks (the simple layout, and the oracle the packed one is tested
                                 against)
  Forward.passes, logprobs_no_grad
                                 the update's micro-batches with their log-probs under autograd
                                 (out-of-memory halving, torchrun's share, each backward), and
                                 θ_old's / π_ref's without

Depth-first order makes the mask an interval test: the tokens of the subtree of a block are
contiguous, so key k is visible from query q iff k ≤ q < subtree_end[k] (subtree_end = where the
subtree of k's block ends; for a prompt token, where its tree ends). One integer per token describes
the whole mask; attention.py runs it by one of three kernels
(`--packed_attention`: tree, flex, dense) and says what each costs.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import attention
import models
from engine.generate import left_pad
from runtime import distributed, oom


# --------------------------------------------------------------------------------------------------
# What the update trains
# --------------------------------------------------------------------------------------------------
@dataclass
class TrainTree:
    """One prompt's tree as the update sees it: per block its parent, tokens,
    advantage Â(b) and weight.

    weight is the number of times the objective counts each token of the block: 1 for DATPO and the
    parallel baselines (every tree token trained once), the number of trained root-to-leaf paths
    through the block for TreeRL/AttnRL (their flattened objective), 0 for a block that is context
    only (never trained). `paths` lists the trained root-to-leaf paths of the flattened methods
    (block indices from the prompt down); the rows layout forwards exactly those sequences, as
    TreeRL/AttnRL do. `behaviour` (one-step off-policy): a stale block's generation-time log-probs,
    the loss's old log-probs for its tokens.
    """
    prompt_ids: list[int]
    parents: list[int | None]
    tokens: list[list[int]]
    advantages: list[float]
    weights: list[float]
    paths: list[list[int]] | None = None
    behaviour: list[list[float] | None] | None = None   # per block: the log-probs its tokens were
                                                        # sampled with when older than the weights
                                                        # updated (offpolicy.py)

    @property
    def trained(self) -> list[int]:
        return [b for b, w in enumerate(self.weights) if w > 0]

    @property
    def unique_tokens(self) -> int:
        """Prompt once + every generated token once."""
        return len(self.prompt_ids) + sum(len(t) for t in self.tokens)


def children_of(parents: list[int | None]) -> dict[int | None, list[int]]:
    """Children of each block (None = the prompt), in block order: a base response's own
    continuation comes before the branches at its end, as rollout.py appends them."""
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
    """Number of the given root-to-leaf paths that pass through each block (App. E.4: the flattened
    objective of TreeRL/AttnRL sums a shared token once per path; weighting it by this count
    reproduces that sum with one forward of the token)."""
    count = [0] * len(parents)
    for path in paths:
        for b in path:
            count[b] += 1
    return count


def token_offsets(trees: list[TrainTree]) -> list[list[int]]:
    """Index of each block's first token in one flat buffer over all generated tokens of all trees
    (the buffers of advantages, weights and old log-probs are indexed by it)."""
    out, at = [], 0
    for tr in trees:
        offs = []
        for toks in tr.tokens:
            offs.append(at)
            at += len(toks)
        out.append(offs)
    return out


def token_advantages(trees: list[TrainTree], device) -> torch.Tensor:
    """Â(b) of each token of every block b, in the flat token order of token_offsets."""
    return torch.tensor([a for tr in trees for a, toks in zip(tr.advantages, tr.tokens)
                         for _ in toks],
                        dtype=torch.float32, device=device)


# --------------------------------------------------------------------------------------------------
# Mini-batches: counted in blocks (App. F.2), re-shuffled every epoch, normaliser per mini-batch
# --------------------------------------------------------------------------------------------------
Unit = tuple[int, tuple[int, ...]]     # (tree index, trained blocks of that tree in this
                                       # mini-batch)


def minibatches(trees: list[TrainTree], size: int, grouping: str, rng) -> list[list[Unit]]:
    """One epoch's mini-batches, freshly shuffled (App. F.2 counts mini-batches in blocks; the
    release re-shuffles every PPO epoch).

    trees:  whole trees, shuffled at the tree level, added to a mini-batch while that brings its
            block count closer to `size` — a tree's shared tokens are forwarded once per mini-batch.
    blocks: random trained blocks, `size` per mini-batch, as the release does — a block's ancestors
            are forwarded again as context in every mini-batch that holds one of its descendants.
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
    """The denominator of one mini-batch's loss, from its units alone (so a multi-device run can
    all-reduce it).

    token:    Σ over trained blocks of weight·|b| — Eq. DATPO's 1/Σ|b| (DAPO's token-level loss);
              with the path multiplicities of TreeRL/AttnRL it is the token count of their
              flattened paths.
    constant: Dr.GRPO's length-unbiased constant, sequences × the longest a sequence can be:
              blocks × max_new_tokens (for the parallel baselines a block is a response: G·L_max per
              prompt); for the flattened methods, their trained paths ending in the
              mini-batch × max_path_tokens (a path can exceed max_new_tokens under the full branch
              budget).
    Zero-advantage blocks count (the loss equals the full computation) though they cost no forward.
    """
    if loss_norm == "constant":
        total = 0
        for t, bs in units:
            if trees[t].paths is None:
                total += len(bs) * max_new_tokens
            else:
                ends = set(bs)
                total += (sum(p[-1] in ends for p in trees[t].paths)
                          * (max_path_tokens or max_new_tokens))
        return float(total)
    if loss_norm != "token":
        raise ValueError(f"loss_norm must be 'token' or 'constant', got {loss_norm!r}")
    return float(sum(trees[t].weights[b] * len(trees[t].tokens[b]) for t, bs in units for b in bs))


# --------------------------------------------------------------------------------------------------
# Splitting trees into micro-batches sized in tokens
# --------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """Blocks of one tree that travel together: a whole subtree when it fits,
    else one block alone."""
    tree: int
    blocks: list[int]               # trained and context blocks of the item, depth-first order
    trained: list[int]


def live_blocks(tr: TrainTree, blocks) -> list[int]:
    """Blocks whose tokens move the loss: trained (weight > 0) with a non-zero advantage. The others
    still count in the normaliser but need no forward."""
    return [b for b in blocks if tr.weights[b] > 0 and tr.advantages[b] != 0]


def split_items(tr: TrainTree, tree_index: int, trained: list[int], max_tokens: int) -> list[Item]:
    """Cut the part of a tree that must be forwarded (the live trained blocks and their ancestors)
    at block boundaries into items of at most `max_tokens` tokens with their context: a subtree that
    fits with its ancestors is one item; one that does not becomes its root block alone plus its
    children's subtrees, each carrying the ancestors as context. A single block longer than the
    budget is an item of its own."""
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
    """Per tree, the blocks a packed sequence of these items forwards: the items' blocks and their
    ancestors."""
    per_tree: dict[int, set[int]] = {}
    for it in items:
        need = per_tree.setdefault(it.tree, set())
        for b in it.blocks:
            need.add(b)
            need.update(ancestors(trees[it.tree].parents, b))
    return per_tree


def item_cost(trees: list[TrainTree], items: list[Item]) -> int:
    """Tokens a packed sequence of these items forwards: per tree its prompt once and each needed
    block once."""
    return sum(len(trees[t].prompt_ids) + sum(len(trees[t].tokens[b]) for b in need)
               for t, need in needed_blocks(trees, items).items())


def micro_batches(trees: list[TrainTree], units: list[Unit], max_tokens: int) -> list[list[Item]]:
    """A mini-batch's units as micro-batches of at most `max_tokens` forwarded tokens: first fit,
    items in tree and depth-first order, so a tree's items land in few micro-batches and share their
    prompt and ancestors there (sorting items by size would scatter each tree and forward its prompt
    many times)."""
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


# --------------------------------------------------------------------------------------------------
# Packing: tokens, position ids, the tree mask as subtree ends, targets
# --------------------------------------------------------------------------------------------------
@dataclass
class Packed:
    """One packed sequence and its targets. Target j is token `target_ids[j]`, predicted by the
    hidden state at packed position `pred_index[j]`; `target_gidx[j]` is its index in the step's
    flat token buffers."""
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
    """Pack items (from one or several trees) into one sequence. Per tree: the prompt, then the
    needed blocks (the items' blocks and their ancestors) depth-first; targets are the tokens of the
    items' trained blocks. Trees follow each other block-diagonally
    (a prompt's subtree ends where its tree ends).

    A prompt p0 p1, a base response a0 a1 | c0 forked after a1, one branch b0 b1 there (3 blocks):

        key →        p0 p1 a0 a1 c0 b0 b1    query q sees key k iff k ≤ q < subtree_end[k]
        query p0     ■                       (the branch never sees the base's c0: not its ancestor)
              p1     ■  ■
              a0     ■  ■  ■
              a1     ■  ■  ■  ■
              c0     ■  ■  ■  ■  ■
              b0     ■  ■  ■  ■  ·  ■
              b1     ■  ■  ■  ■  ·  ■  ■
        position_ids 0  1  2  3  4  4  5     b0 is the 5th token of its own root-to-leaf sequence
        subtree_end  7  7  7  7  5  7  7
        pred_index   targets a0 a1 c0 b0 b1 are predicted at p1 a0 a1 a1 b0
                     (b0 from a1, not from c0)
    """
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
            """Emit block b whose path so far ends at packed index `last`,
            next position id `position`."""
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


def pad_packed(packed: Packed, length: int, pad_id: int = 0) -> Packed:
    """`packed` with padding tokens up to `length` (the flex kernel's static lengths:
    attention.flex_bucket): each sees only itself (subtree_end = its index + 1), so no real token
    sees it and its output is never a target; position id 0 keeps it inside the rotary tables."""
    n = length - len(packed)
    if n <= 0:
        return packed
    return Packed(packed.input_ids + [pad_id] * n, packed.position_ids + [0] * n,
                  packed.subtree_end + list(range(len(packed) + 1, length + 1)), packed.pred_index,
                  packed.target_ids, packed.target_gidx, packed.target_weights)


# --------------------------------------------------------------------------------------------------
# Log-probs of a packed sequence: one forward under the tree mask (its kernels: attention.py), fp32
# logits
# --------------------------------------------------------------------------------------------------
def fp32_logits(lm_head, hidden: torch.Tensor) -> torch.Tensor:
    """Logits computed in fp32 at least (autocast off; a float64 model keeps float64): bf16 logits
    are rounded to 8 bits before any upcast (|Δ log p| up to ~0.1 at logits of a few tens), which
    would put that noise into the PPO ratio. A bf16 model's hidden states and head multiply as they
    are into an fp32 result (HalfLogits: the products are exact in fp32, so this equals upcasting
    both, up to the order of the fp32 sums, at tensor-core speed with no fp32 copy of the head);
    anything else (fp32 runs: the CPU demo, the tests; fp16, whose gradients of ~1e-9 per logit
    would underflow) is upcast as before."""
    bias, weight = getattr(lm_head, "bias", None), lm_head.weight
    if bias is None and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            flat = HalfLogits.apply(hidden.reshape(-1, hidden.shape[-1]), weight)
        return flat.reshape(*hidden.shape[:-1], weight.shape[0])
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype),
                                          None if bias is None else bias.to(dtype))


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target) = logit(target) − logsumexp(logits) over the last dimension (targets: the
    logits' shape without it): the one log-softmax of the update (the packed layout through
    target_logprobs, the rows layout and torchrun's forward on the logits the model returns)."""
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
@functools.cache
def fp32_out_matmul(device_type: str) -> bool:
    """Whether this torch multiplies bf16 matrices into an fp32 result on `device_type` (torch.mm's
    out_dtype: CUDA, torch >= 2.8); elsewhere HalfLogits upcasts its operands for the product."""
    try:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        return torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


class HalfLogits(torch.autograd.Function):
    """logits = hidden @ weight.T in fp32 from bf16 hidden [n, h] and weight [vocab, h].

    Forward: the bf16 operands' products are exact in fp32, summed in fp32 (a bf16 GEMM with an fp32
    result where the device has one, else both upcast: the same numbers up to the order of the
    sums). Backward: the fp32 gradient of the logits is rounded to bf16 and multiplied in bf16,
    as every other layer of a pure-bf16 model takes its gradient (the result is rounded to bf16
    either way: measured, 2.4e-3 relative L2 from the exact gradient against 1.7e-3 for an fp32
    product rounded once, tests/test_packing.py)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        if fp32_out_matmul(hidden.device.type):
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return torch.mm(hidden.float(), weight.float().t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype)
        return (grad @ weight if ctx.needs_input_grad[0] else None,
                grad.t() @ hidden if ctx.needs_input_grad[1] else None)


def target_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log π(target | its path) from the hidden states that predict the targets: the lm_head
    projection in fp32 (fp32_logits), then the log-softmax
    (gather_logprobs). The update's log-probs are made here."""
    return gather_logprobs(fp32_logits(lm_head, hidden), targets)


def packed_logprobs(model, packed: Packed, device, kernel: str = "dense", chunk: int = 2048,
                    bucket_tokens: int | None = None) -> torch.Tensor:
    """One model call over a packed sequence (4D tree mask + explicit position ids) → the log-prob
    of every target, in `packed.target_ids` order.

    Under torchrun the model's own forward runs instead (torchrun_logprobs).
    The tree mask goes in as the kernel wants it (attention.tree_attention_mask; the tree kernel's
    segments as the forward kwarg tree_buckets). flex: the sequence is padded to its length bucket
    (attention.flex_bucket of `bucket_tokens`, the micro-batch budget) so the compiled kernel sees a
    few static shapes."""
    if kernel == "flex":
        packed = pad_packed(packed, attention.flex_bucket(len(packed), bucket_tokens))
    ids = torch.tensor([packed.input_ids], device=device)
    positions = torch.tensor([packed.position_ids], device=device)
    ends = torch.tensor(packed.subtree_end, device=device)
    pred_index = torch.tensor(packed.pred_index, device=device)
    targets = torch.tensor(packed.target_ids, device=device)
    inner = distributed.unwrap(model)
    mask = attention.tree_attention_mask(inner, ends, kernel)
    extra = ({"tree_buckets": attention.tree_buckets(packed.subtree_end, device)}
             if kernel == "tree" else {})
    with attention.kernel_backend(inner, kernel):
        if distributed.active():   # torchrun: the model's own forward,
                                   # where DDP's and FSDP2's hooks are
            return torchrun_logprobs(model, ids, mask, positions, pred_index, targets, chunk, extra)
        hidden = inner.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions,
                                     use_cache=False, **extra).last_hidden_state[0]
    # lm_head + fp32 log-softmax `chunk` targets at a time: [chunk, vocab] fp32 logits, never the
    # whole sequence's (plus, per chunk, an fp32 copy of the lm_head weight: ≈ 1.2 GB for
    # Qwen2.5-3B, transient); under autograd each chunk is recomputed in the backward (activation
    # checkpointing), so only the hidden states stay alive
    head, grad, parts = (inner.get_output_embeddings(),
                         torch.is_grad_enabled() and hidden.requires_grad, [])
    for s in range(0, len(targets), chunk):
        args = (head, hidden.index_select(0, pred_index[s:s + chunk]), targets[s:s + chunk])
        parts.append(checkpoint(target_logprobs, *args, use_reentrant=False) if grad
                     else target_logprobs(*args))
    return torch.cat(parts) if parts else hidden.new_zeros(0)


@contextlib.contextmanager
def fp32_head(model):
    """The model's own lm_head computing fp32 logits (fp32_logits) while inside: under torchrun the
    model's forward must compute the logits (DDP's and FSDP2's hooks live there), and they must be
    the same fp32 logits one process takes its log-softmax of."""
    head = model.get_output_embeddings()
    head.forward = functools.partial(fp32_logits, head)
    try:
        yield
    finally:
        del head.forward     # the class's forward again


def fp32_gather(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """gather_logprobs of logits the model's own head computed (fp32_head), in fp32."""
    return gather_logprobs(logits.float(), targets)


def torchrun_logprobs(model, ids, mask, positions, pred_index, targets, chunk: int, extra: dict
                      ) -> torch.Tensor:
    """packed_logprobs's forward under torchrun: the wrapped model's own forward, returning logits
    at the targets only (logits_to_keep = their positions), a [targets, vocab] tensor per
    micro-batch rather than `chunk` rows of it; the fp32 log-softmax is still taken `chunk` rows at
    a time, recomputed in the backward."""
    with fp32_head(distributed.unwrap(model)):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
                       logits_to_keep=pred_index, **extra).logits[0]
    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = [checkpoint(fp32_gather, logits[s:s + chunk], targets[s:s + chunk], use_reentrant=False)
             if grad else fp32_gather(logits[s:s + chunk], targets[s:s + chunk])
             for s in range(0, len(targets), chunk)]
    return torch.cat(parts) if parts else logits.new_zeros(0)


# --------------------------------------------------------------------------------------------------
# The rows layout: every trained chain of blocks as its own left-padded row with its whole context
# (the simple path, and the oracle the packed layout is tested against)
# --------------------------------------------------------------------------------------------------
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
    """Rows of one unit. The flattened methods' whole trees: their root-to-leaf paths, shared
    prefixes trained again in every path (TreeRL/AttnRL's own objective, App. E.4). Otherwise each
    live block once: a row trains a chain of blocks (a base response's blocks, one after the other)
    with its ancestors as context — a branch is its one block after the shared prefix."""
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
        while True:       # follow the first live child: a base response continues in its own next
                          # block
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

    Rows end at the same column, so only the last max(targets) positions need logits
    (logits_to_keep), and position ids follow the attention mask so padding does not shift the
    rotary phases.
    """
    ids, mask = left_pad([r.ids for r in rows], pad_id, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = max(r.n_targets for r in rows)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                   logits_to_keep=keep + 1).logits[:, :-1].float()   # predicts the last `keep`
                                                                     # tokens
    logp = gather_logprobs(logits, ids[:, -keep:])
    return [logp[i, keep - r.n_targets:] for i, r in enumerate(rows)]


# --------------------------------------------------------------------------------------------------
# One interface for both layouts
# --------------------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """One forward/backward: a packed sequence or a list of rows, and per target its flat token
    index and weight (the loss of the micro-batch is −Σ weight·objective / the mini-batch's
    normaliser)."""
    gidx: list[int]
    weights: list[float]
    forwarded: int                  # tokens the model is fed (padding excluded)
    packed: Packed | None = None
    rows: list[Row] | None = None
    at: torch.Tensor | None = None          # gidx on the device (Forward.micro_batches)
    weight: torch.Tensor | None = None      # weights on the device, fp32 (Forward.micro_batches)
    loss: torch.Tensor | None = None        # set by the update's loop;
                                            # Forward.passes runs its backward


def layout_micro_batches(trees: list[TrainTree], units: list[Unit], offsets: list[list[int]],
                         layout: str, max_tokens: int, rows_per_micro: int) -> list[MicroBatch]:
    """A mini-batch's micro-batches: packed sequences of at most `max_tokens` tokens, or rows
    (sorted by length, less padding) `rows_per_micro` at a time."""
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
        out.append(MicroBatch([g for r in chunk for g in r.gidx],
                              [w for r in chunk for w in r.weights],
                              sum(len(r.ids) for r in chunk), rows=chunk))
    return out


def trains(trees: list[TrainTree], units: list[Unit]) -> bool:
    """Whether a mini-batch has a token that moves the loss (live_blocks): one whose advantages are
    all 0 forwards nothing and takes no optimizer step."""
    return any(live_blocks(trees[t], blocks) for t, blocks in units)


def epochs(first: list[list[Unit]], trees: list[TrainTree], cfg, rng):
    """The mini-batches of every PPO epoch, one at a time on one progress bar for the whole update:
    the first epoch's are `first`, each later epoch's freshly shuffled (minibatches)."""
    total = cfg.ppo_epochs * len(first)
    bar = tqdm(total=total, desc="update", unit="mini-batch", leave=False, dynamic_ncols=True,
               disable=not distributed.is_main() or total < 2)
    try:
        for epoch in range(cfg.ppo_epochs):
            units_list = first if epoch == 0 else minibatches(trees, cfg.mini_batch_size,
                                                               cfg.mini_batch_grouping, rng)
            for units in units_list:
                bar.update(1)
                yield units
    finally:
        bar.close()


class Forward:
    """The update's forward (Phase 4) over the step's trees: which layout and attention kernel it
    runs, the micro-batch size (`size`: tokens per packed micro-batch, or rows per micro-batch in
    the rows layout; halved on out of memory) and the model. While the context is open the packed
    kernel is the model's attention backend — through every backward too, since activation
    checkpointing recomputes the forward there."""

    def __init__(self, policy, cfg, pad_id: int, device, trees: list[TrainTree]):
        self.policy, self.pad_id, self.device, self.precision = (policy, pad_id, device,
                                                                 cfg.precision)
        self.trees, self.offsets = trees, token_offsets(trees)
        self.model = distributed.unwrap(policy)             # the HF model inside a DDP wrapper
        self.packed = cfg.train_layout == "packed"
        self.kernel = attention.update_kernel(cfg, device, self.model) if self.packed else "rows"
        self.size = cfg.max_tokens_per_micro_batch if self.packed else cfg.micro_batch_size
        self.max_tokens, self.rows_per_micro = cfg.max_tokens_per_micro_batch, cfg.micro_batch_size
        self._backend = contextlib.nullcontext()

    def __enter__(self) -> "Forward":
        self._backend = attention.kernel_backend(self.model,
                                                 self.kernel if self.packed else "dense")
        self._backend.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        return bool(self._backend.__exit__(*exc))

    def micro_batches(self, units: list[Unit], size: int) -> list[MicroBatch]:
        """A mini-batch's micro-batches: `size` tokens each (packed layout) or `size` rows (rows
        layout), their token indices and weights on the device."""
        if self.packed:
            micros = layout_micro_batches(self.trees, units, self.offsets, "packed", size,
                                          self.rows_per_micro)
        else:
            micros = layout_micro_batches(self.trees, units, self.offsets, "rows", self.max_tokens,
                                          size)
        for micro in micros:
            micro.at = torch.tensor(micro.gidx, device=self.device)
            micro.weight = torch.tensor(micro.weights, dtype=torch.float32, device=self.device)
        return micros

    def passes(self, units: list[Unit], optimizer, sums: torch.Tensor, counts: dict):
        """The update's loop over one mini-batch: (micro-batch, log π_θ of its targets under
        autograd), one micro-batch at a time. The loop sets each one's `loss`; its backward runs
        here, when the next is asked for (× world size under torchrun: distributed.backward), so
        gradients accumulate over the mini-batch. Out of memory, in a forward or a backward
        (runtime/oom.py): the gradients and `sums` are zeroed and the mini-batch runs again in
        micro-batches half the size (one process only: under torchrun every rank must run the same
        collectives). torchrun: this rank's share (distributed.deal). Once the mini-batch is
        through, its trained and forwarded tokens are added to `counts`."""
        for attempt in oom.Halving(self.size, "the update's micro-batches", counts,
                                   reset=optimizer.zero_grad, retry=not distributed.active()):
            with attempt:
                optimizer.zero_grad(set_to_none=True)
                sums.zero_()
                tokens = forwarded = 0
                micros = self.micro_batches(units, attempt.size)
                for micro in distributed.deal(self.policy, micros, self.pad_id, self.device):
                    yield micro, micro_logprobs(self, micro)
                    distributed.backward(micro.loss)
                    tokens, forwarded = tokens + len(micro.gidx), forwarded + micro.forwarded
        counts["total_tokens"] += tokens
        counts["forwarded"] += forwarded


def micro_logprobs(forward: Forward, micro: MicroBatch) -> torch.Tensor:
    """fp32 log-probs of a micro-batch's targets, in `micro.gidx` order, in the run's precision: one
    packed sequence under the tree mask (flex: lengths padded to buckets of the micro-batch budget,
    static shapes), or the rows layout's left-padded rows."""
    with models.autocast(forward.device, forward.precision):
        if micro.packed is not None:
            return packed_logprobs(forward.policy, micro.packed, forward.device, forward.kernel,
                                   bucket_tokens=forward.max_tokens).float()
        return torch.cat(row_logprobs(forward.policy, micro.rows, forward.pad_id,
                                      forward.device)).float()


def logprobs_no_grad(forward: Forward, minibatches: list[list[Unit]], what: str, counts: dict
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-prob of every token of these mini-batches under `forward`'s model, no grad, in eval
    mode (no dropout: the same function as the update's): θ_old's, or π_ref's (kl.py). Returns
    (log-probs in the flat token order of token_offsets, a mask of those computed). Out of memory:
    the mini-batch again in micro-batches half the size (`what` names it in the line). torchrun:
    each rank its share, on FSDP's gathered weights, then merged
    (every rank needs them all: epochs re-shuffle)."""
    n_tokens = sum(len(t) for tr in forward.trees for t in tr.tokens)
    out = torch.zeros(n_tokens, dtype=torch.float32, device=forward.device)
    have = torch.zeros(n_tokens, dtype=torch.bool, device=forward.device)
    forward.policy.eval()
    with torch.no_grad(), distributed.full_params(forward.policy):
        for units in minibatches:
            oom.halving_retry(lambda size: fill_logprobs(forward, units, size, out, have),
                              forward.size, what, counts, retry=not distributed.active())
    return distributed.merge_shares(out, have)


def fill_logprobs(forward: Forward, units: list[Unit], size: int, out: torch.Tensor,
                  have: torch.Tensor) -> None:
    """One mini-batch's log-probs (no grad) written into `out` at their token offsets, in
    micro-batches of `size`, this rank's share under torchrun; `have` marks them."""
    for micro in distributed.mine(forward.micro_batches(units, size)):
        out[micro.at] = micro_logprobs(forward, micro)
        have[micro.at] = True
