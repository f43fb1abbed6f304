"""engine/shared.py — the CPU decode step (--decode_step shared; what auto picks on a CPU): each shared prefix
is read once per step, and a token is drawn with one random number per row.

Where the reference step (engine/kv.py) spends a CPU decode step beyond the weight matmuls (issue 43's
profile, SmolLM2-135M, 36 rows × ~200 tokens of context, one thread): ~14 % drawing an exponential variate
for each of the 49,152 vocabulary entries of each row (torch.multinomial), ~4 % in torch.special.entr, and
~25 % gathering every row's whole context out of the pool in every layer and attending over it. Most of a
row's context is shared: its prompt (read by every row of the prompt) and, for a branch, its base
response's first f tokens (read by every branch of that base). This step:

  * attends in parts and merges them by their log-sum-exp (the softmax of a concatenation is the weighted
    mix of the softmaxes of its parts). Per layer: each distinct prompt's keys/values are gathered once and
    every row of that prompt attends to them in one call (the rows of a prompt are the query positions of
    one batch entry); each base prefix the same way for its branches, each reading its own first f tokens
    (a mask per query row); and each row's own tokens (its response so far and the new token) as in the
    reference. The slots read per step fall from rows × context to prompts × prompt + bases × fork prefix
    + rows × own tokens. The kernel is ATen's CPU flash attention, which returns the log-sum-exp. A call
    pads its groups to the widest, so each part is cut by width (by_width: up to 32 slots, then one bin
    per doubling): a fresh branch does not read a long row's width of masked slots.
  * draws each token by inverse transform sampling: one uniform u per row against the cumulative sum of
    the probabilities (in float64, so no token's share is lost to rounding), the first token whose
    cumulative probability exceeds u·total: a sample from the same distribution as torch.multinomial's
    (not the same random stream). H_t = −Σ p log p from the log-probabilities already computed.

Pages are one token (the reference pool), so sharing stays by reference and nothing is copied. Prefill,
given bases and the first tokens of new rows run as in the reference step (engine/kv.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import kv
from engine.kv import KVPool

SHARED_ATTENTION = "datpo_shared"


@dataclass
class Call:
    """One attention call: groups of rows reading the same slots. `read` [groups, S] the slots (padded),
    `rows` [groups, R] the rows of each group (padded with the index of a zero query), `mask`
    [groups, 1, R, S] additive (0 visible, −inf not) or None when every row of every group sees all S."""
    read: torch.Tensor
    rows: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class Part:
    """One part of every row's context for a decode step (the prompts, the base prefixes, or the rows' own
    tokens), in calls of groups of similar width (by_width). `back` [rows]: each row's place in the calls'
    outputs (groups × R each) one after the other; their total (an empty entry): the row has no slots in
    this part."""
    calls: list[Call]
    back: torch.Tensor


@dataclass
class SharedKV:
    """What one decode forward tells the attention: where each row's new token's keys/values go (`write`
    [rows]) and the parts of the rows' contexts (prompts, base prefixes, own tokens)."""
    pool: KVPool
    write: torch.Tensor
    parts: list[Part]


def part(groups: list[list[int]], members: list[list[tuple[int, int]]], rows: int, device,
         per_kv: int = 1) -> Part:
    """A Part from each group's slots and its members (row index, slots visible: a prefix of the group's),
    one Call per width bin; masks repeated for the per_kv query heads that share a key/value head
    (attend)."""
    calls, entries = [], 0
    back = torch.full((rows,), -1, dtype=torch.long)
    for groups, members in by_width(groups, members):
        width = max(map(len, groups))
        size = max(map(len, members))
        read = torch.zeros(len(groups), width, dtype=torch.long)
        index = torch.full((len(groups), size), rows, dtype=torch.long)
        visible = torch.full((len(groups), size), 1, dtype=torch.long)
        for g, (slots, rows_of) in enumerate(zip(groups, members)):
            read[g, :len(slots)] = torch.tensor(slots)
            for r, (row, seen) in enumerate(rows_of):
                index[g, r], visible[g, r] = row, seen
                back[row] = entries + g * size + r
        mask = None
        if (visible != width).any():
            hidden = torch.arange(width)[None, None, :] >= visible[:, :, None]
            mask = torch.zeros(len(groups), 1, size, width).masked_fill_(hidden[:, None], float("-inf"))
            mask = mask.repeat(1, 1, per_kv, 1).to(device)
        calls.append(Call(read.to(device), index.to(device), mask))
        entries += len(groups) * size
    back[back < 0] = entries
    return Part(calls, back.to(device))


def width_bin(width: int) -> int:
    """The bin of a group of `width` slots: 0 up to 32 slots, then one per doubling (33-64, 65-128, ...)."""
    return max(0, (width - 1).bit_length() - 5)


def by_width(groups: list[list[int]], members: list[list[tuple[int, int]]]) -> list[tuple[list, list]]:
    """The groups (and their members) split by width_bin, narrowest first: one Call each. A Call pads every
    group to its widest, so in one call a long row made every fresh row read its width, mostly masked
    (bench/bench_width_bins.py, docs/measurements.md). Within a bin a group is padded to at most twice its
    width (or 32 slots)."""
    bins: dict[int, tuple[list, list]] = {}
    for slots, rows_of in zip(groups, members):
        into = bins.setdefault(width_bin(len(slots)), ([], []))
        into[0].append(slots)
        into[1].append(rows_of)
    return [bins[b] for b in sorted(bins)]


def step_kv(pool: KVPool, rows, prompt_lengths: list[int], per_kv: int = 1) -> SharedKV:
    """The SharedKV of one decode step of `rows` (DecodeRows, each context just extended by the slot of the
    token fed now). A row's context is its prompt's P slots, then (a branch at fork f) its base's first f
    response slots, then its own. per_kv: query heads per key/value head (the model's)."""
    prompts: dict[int, int] = {}
    bases: dict[tuple[int, int], int] = {}
    prompt_groups, prompt_members, base_groups, base_members, own = [], [], [], [], []
    for i, row in enumerate(rows):
        p, length = row.prompt, prompt_lengths[row.prompt]
        if p not in prompts:
            prompts[p] = len(prompt_groups)
            prompt_groups.append(row.slots[:length])
            prompt_members.append([])
        prompt_members[prompts[p]].append((i, length))
        fork = row.fork or 0
        if fork:
            key = (p, row.base)
            if key not in bases:
                bases[key] = len(base_groups)
                base_groups.append(row.slots[length:length + fork])
                base_members.append([])
            g = bases[key]
            if fork > len(base_groups[g]):                 # the group reads its longest member's prefix
                base_groups[g] = row.slots[length:length + fork]
            base_members[g].append((i, fork))
        own.append(row.slots[length + fork:])
    device = pool.device
    parts = [part(prompt_groups, prompt_members, len(rows), device, per_kv)]
    if base_groups:
        parts.append(part(base_groups, base_members, len(rows), device, per_kv))
    parts.append(part(own, [[(i, len(slots))] for i, slots in enumerate(own)], len(rows), device, per_kv))
    write = torch.tensor([row.slots[-1] for row in rows], device=device)
    return SharedKV(pool, write, parts)


def attend(query, layer, call: Call, scale):
    """One call: each group's rows attend to its slots → (out [groups × R, H, d], lse [groups × R, H]).
    The G query heads that read one key/value head go in as G × R query positions of that head (each key
    is read once per head, not G times; call.mask is laid out so)."""
    groups, width = call.read.shape
    size = call.rows.shape[1]
    heads, dim = query.shape[1:]
    kv_heads = layer.shape[2]
    context = layer.index_select(0, call.read.flatten()).view(groups, width, *layer.shape[1:])
    keys, values = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)   # [g, H_kv, S, d]
    q = query[call.rows].view(groups, size, kv_heads, heads // kv_heads, dim)        # [g, R, H_kv, G, d]
    q = q.permute(0, 2, 3, 1, 4).reshape(groups, kv_heads, heads // kv_heads * size, dim)
    mask = None if call.mask is None else call.mask.to(q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, 0.0, False, attn_mask=mask, scale=scale)[:2]
    out = out.view(groups, kv_heads, heads // kv_heads, size, dim).permute(0, 3, 1, 2, 4)
    lse = lse.view(groups, kv_heads, heads // kv_heads, size).permute(0, 3, 1, 2)
    return out.reshape(groups * size, heads, dim), lse.reshape(groups * size, heads)


def attend_part(query, layer, part: Part, scale):
    """Every call of a part, their outputs one after the other and then an empty entry (out 0, lse −inf)
    for rows outside the part → each row's (out [rows, H, d], lse [rows, H]) by part.back."""
    outs, lses = zip(*[attend(query, layer, call, scale) for call in part.calls])
    heads, dim = query.shape[1:]
    out = torch.cat(outs + (outs[0].new_zeros(1, heads, dim),))
    lse = torch.cat(lses + (lses[0].new_full((1, heads), -torch.inf),))
    return out[part.back], lse[part.back]


def shared_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, engine_kv=None,
                     **kwargs):
    """HF attention function for one decode token per row: query [rows, H, 1, d], key/value [rows, H_kv, 1, d]
    → output [rows, 1, H, d]. Writes the new keys/values into their slots, attends to each part of the rows'
    contexts and mixes the parts by their log-sum-exp."""
    layer = engine_kv.pool.layers[module.layer_idx]                       # [slots, 2, H_kv, d]
    new = torch.stack((key[:, :, -1], value[:, :, -1]), dim=1)            # [rows, 2, H_kv, d]
    layer.index_copy_(0, engine_kv.write, new.to(layer.dtype))
    rows, heads, _, dim = query.shape
    q = torch.cat((query[:, :, -1].to(layer.dtype), query.new_zeros(1, heads, dim, dtype=layer.dtype)))
    scale = scaling if scaling is not None else dim ** -0.5
    outs, lses = zip(*[attend_part(q, layer, p, scale) for p in engine_kv.parts])
    lse = torch.stack(lses)                                                # [parts, rows, H]
    weights = (lse - torch.logsumexp(lse, dim=0)).exp()
    out = (torch.stack(outs) * weights[..., None]).sum(0)                 # [rows, H, d]
    return out.to(query.dtype)[:, None], None


def register_attention() -> str:
    """Registered as an attention function only (no mask function: transformers then builds no mask)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SHARED_ATTENTION, shared_attention)
    return SHARED_ATTENTION


class Forward(kv.Forward):
    """The reference step's forward passes (prefill, given bases) with this step's decode forward; the
    engine sets `prompt_lengths` (its run's) before it decodes."""

    def __init__(self, model, pool: KVPool, compile_decode: bool = False):
        super().__init__(model, pool, compile_decode)
        self.prompt_lengths: list[int] = []

    def decode(self, rows) -> torch.Tensor:
        """One decode forward: each row's last token → the final hidden states [rows, 1, d]. On an error
        (e.g. out of memory) the rows' contexts are as they were."""
        pool, done = self.pool, []
        try:
            for row in rows:
                pool.extend(row.slots, 1)
                done.append(row)
            cfg = self.model.config
            step = step_kv(pool, rows, self.prompt_lengths,
                           cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None)
                                                       or cfg.num_attention_heads))
            tokens = torch.tensor([[row.out.tokens[-1]] for row in rows], device=pool.device)
            positions = torch.tensor([[len(row.slots) - 1] for row in rows], device=pool.device)
            # --compile_decode: through torch.compile (kv.compiled_decode; one row stays eager, as there)
            forward = kv.compiled_decode() if self.compile_decode and len(rows) > 1 else kv.decode_hidden
            with kv.attention_backend(self.model, register_attention()):
                return forward(self.model, tokens, positions, step)
        except BaseException:
            for row in done:
                pool.shrink(row.slots, 1)
            raise


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs [rows, V] (summing to about 1), the first token whose cumulative probability
    (float64) exceeds u · total, u [rows, 1] in [0, 1): token i with probability p_i / total. A token of
    probability 0 is never chosen, even when u · total rounds up to the total (then: the last token of
    nonzero probability)."""
    cdf = probs.double().cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    return torch.minimum(torch.searchsorted(cdf, u * total, right=True), torch.searchsorted(cdf, total))


def draw(model, warp, hidden: torch.Tensor):
    """One token per row from lm_head(hidden) after the warpers (rollout.Sampler.warp), by inverse transform
    sampling (module docstring); with its H_t and log-probability, in one transfer to the host."""
    from engine import paged

    scores = warp(model.get_output_embeddings()(hidden).float())
    logp = torch.log_softmax(scores, dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)   # 0 · log 0 = 0
    tokens = inverse_cdf(probs, torch.rand(len(probs), 1, dtype=torch.float64, device=probs.device))
    values = torch.stack((tokens[:, 0].double(), entropy.double(), logp.gather(1, tokens)[:, 0].double()))
    token_list, entropies, logprobs = paged.to_host(values)
    return [int(t) for t in token_list], entropies, logprobs
