"""attention.py: the tree mask's three kernels. The 4D mask transformers takes as-is; the tree kernel's
segments rebuild the dense mask row by row and give the dense kernel's gradients; flex's BlockMask has
create_block_mask's tiles, its length buckets are few static shapes, padding changes no log-prob, its CPU
forward equals dense, and its start-up probe falls back to the tree kernel with one line."""
import random

import pytest
import torch
from test_packing import EOS, _update, datpo_tree, deep_tree, grpo_group, tiny

import attention
import config as C
import packing as P


def test_transformers_takes_a_4d_mask_as_is():
    """transformers 5 returns a 4D mask untouched: SDPA reads a boolean (True = attend); eager adds the mask
    to the scores, so a boolean there would be wrong silently — tree_attention_mask gives eager a float."""
    ends = torch.tensor([4, 4, 3, 4])                    # token 3 cannot see token 2: a sibling
    for attn in ("sdpa", "eager"):
        model = tiny("llama", attn)
        mask = attention.tree_attention_mask(model, ends, "dense")
        assert mask.dtype == (torch.bool if attn == "sdpa" else torch.float32) and mask.shape == (1, 1, 4, 4)
    model = tiny("llama", "sdpa")
    ids, positions = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 1, 2, 2]])
    with torch.no_grad():
        tree = model(ids, attention_mask=attention.dense_mask(ends)[None, None],
                     position_ids=positions).logits
        alone = model(torch.tensor([[5, 6, 8]])).logits
    assert torch.allclose(tree[0, 3], alone[0, 2], atol=1e-5)


def test_tree_segments_are_the_dense_mask_row_by_row():
    """Segment + its context, causal inside the segment, is exactly the tree mask: rebuilt from the buckets
    (padding dropped) it equals dense_mask for packs with several trees, forks inside blocks and chains."""
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    offsets = P.token_offsets(trees)
    units = [(t, tuple(tr.trained)) for t, tr in enumerate(trees)]
    for budget in (1000, 12):
        for items in P.micro_batches(trees, units, budget):
            ends = P.pack(trees, items, offsets).subtree_end
            rebuilt = torch.zeros(len(ends), len(ends), dtype=torch.bool)
            for b in attention.tree_buckets(ends, "cpu"):
                for j in range(len(b.q_index)):
                    for i in range(len(b.q_index[j])):
                        if b.q_valid[j, i]:
                            rebuilt[b.q_index[j, i], b.k_index[j][b.mask[j, 0, i]]] = True
            assert torch.equal(rebuilt, attention.dense_mask(torch.tensor(ends))), budget
    # segments of the hand-packed datpo tree: prompt, then the blocks depth-first; a block's context is the
    # prompt and the blocks on its path (0 → 1 → 2 is one base response cut at its forks)
    (items,) = P.micro_batches([datpo_tree()], [(0, tuple(range(7)))], 1000)
    pk = P.pack([datpo_tree()], items, P.token_offsets([datpo_tree()]))
    segs = [(pk.input_ids[s:e], [pk.input_ids[k] for k in ctx])
            for s, e, ctx in attention.tree_segments(pk.subtree_end)]
    assert segs[:3] == [([5, 6, 7], []), ([10, 11, 12], [5, 6, 7]), ([13, 14], [5, 6, 7, 10, 11, 12])]
    assert ([30], [5, 6, 7, 10, 11, 12, 13, 14]) in segs and ([40, 41, 42, 43], [5, 6, 7]) in segs


def test_tree_kernel_gradients_equal_dense():
    model = tiny("qwen2")
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    (items,) = P.micro_batches(trees, [(t, tuple(tr.trained)) for t, tr in enumerate(trees)], 1000)
    pk = P.pack(trees, items, P.token_offsets(trees))
    grads = {}
    for kernel in ("dense", "tree"):
        model.zero_grad()
        logp = P.packed_logprobs(model, pk, "cpu", kernel=kernel)
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
        grads[kernel] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(grads["dense"], grads["tree"]))
    assert model.config._attn_implementation == "sdpa"            # restored for the rollout
    # a plain forward (left padding, no tree) while the backend is set is the model's own SDPA forward
    ids = torch.tensor([[EOS, EOS, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with attention.kernel_backend(model, "tree"):
            assert model.config._attn_implementation == "datpo_tree"
            same = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(plain[:, 2:], same[:, 2:], atol=1e-6)
    assert torch.allclose(plain[1], same[1], atol=1e-6)


def test_flex_mask_is_the_dense_mask():
    from torch.nn.attention.flex_attention import create_mask

    trees = [datpo_tree(), grpo_group(), deep_tree()]
    (items,) = P.micro_batches(trees, [(t, tuple(tr.trained)) for t, tr in enumerate(trees)], 1000)
    ends = torch.tensor(P.pack(trees, items, P.token_offsets(trees)).subtree_end)
    mask = create_mask(lambda b, h, q, k: (k <= q) & (q < ends[k]), None, None, len(ends), len(ends),
                       device="cpu")
    assert torch.equal(mask[0, 0], attention.dense_mask(ends))
    assert attention.flex_block_mask(ends).shape[-1] == len(ends)


@pytest.mark.slow
def test_flex_forward_equals_dense_on_cpu():
    """The flex_attention path through the HF model (compiled on CPU: about a minute). On CUDA, forward and
    backward: bench/bench_attention.py (docs/measurements.md, "First figures on a GPU")."""
    model = tiny("qwen3")
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    (items,) = P.micro_batches(trees, [(t, tuple(tr.trained)) for t, tr in enumerate(trees)], 1000)
    pk = P.pack(trees, items, P.token_offsets(trees))
    with torch.no_grad():
        dense = P.packed_logprobs(model, pk, "cpu", kernel="dense")
        flex = P.packed_logprobs(model, pk, "cpu", kernel="flex")
    assert torch.allclose(dense, flex, atol=1e-5)
    assert model.config._attn_implementation == "sdpa"            # restored for the rollout


# ---- flex: static shapes (length buckets), a BlockMask without the L × L mask, the start-up probe ----------
def random_group(n_responses: int, length: int, seed: int) -> P.TrainTree:
    """A GRPO-like group of `n_responses` random responses of `length` tokens (vocab of SIZES)."""
    gen = random.Random(seed)
    tokens = [[gen.randrange(3, 128) for _ in range(length)] for _ in range(n_responses)]
    return P.TrainTree([5, 6, 7], [None] * n_responses, tokens, [gen.uniform(-1, 1) for _ in tokens],
                       [1.0] * n_responses)


def packed_alone(tr: P.TrainTree) -> P.Packed:
    (items,) = P.micro_batches([tr], [(0, tuple(tr.trained))], 10_000)
    return P.pack([tr], items, P.token_offsets([tr]))


def block_tiles(mask, full: bool) -> set:
    num = mask.full_kv_num_blocks if full else mask.kv_num_blocks
    idx = mask.full_kv_indices if full else mask.kv_indices
    return {(q, int(idx[0, 0, q, j])) for q in range(num.shape[-1]) for j in range(int(num[0, 0, q]))}


@pytest.mark.parametrize("length", [83, 256, 300, 700])
def test_flex_block_mask_has_create_block_masks_tiles(length):
    """flex_block_mask (no L × L mask) marks the same partial and full 128×128 tiles as create_block_mask
    (which evaluates the mask at every [q, k]) for a packed tree padded or not, and its element mask is the
    dense tree mask."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    trees = [datpo_tree(), grpo_group(), deep_tree(), random_group(3, 60, 1), random_group(2, 150, 2)]
    (items,) = P.micro_batches(trees, [(t, tuple(tr.trained)) for t, tr in enumerate(trees)], 10_000)
    packed = P.pack(trees, items, P.token_offsets(trees))
    if length >= len(packed):
        packed = P.pad_packed(packed, length)
    else:
        packed = packed_alone(random_group(7, length // 7, 3))
    ends = torch.tensor(packed.subtree_end)
    ours = attention.flex_block_mask(ends)
    ref = create_block_mask(lambda b, h, q, k: (k <= q) & (q < ends[k]), None, None, len(ends), len(ends),
                            device="cpu")
    assert block_tiles(ours, True) == block_tiles(ref, True)
    assert block_tiles(ours, False) == block_tiles(ref, False)
    assert len(block_tiles(ours, True)) + len(block_tiles(ours, False)) > 0
    dense = create_mask(ours.mask_mod, None, None, len(ends), len(ends), device="cpu")[0, 0]
    assert torch.equal(dense, attention.dense_mask(ends))


def test_flex_buckets_are_few_static_tile_multiples():
    budget = 8192
    buckets = {attention.flex_bucket(n, budget) for n in range(1, budget + 1)}
    assert buckets == {1024 * i for i in range(1, 9)}                     # 8 shapes up to the budget
    assert all(attention.flex_bucket(n, budget) - n < 1024 for n in range(1, budget + 1))
    # budget/8 rounds up to a tile
    assert {attention.flex_bucket(n, 300) for n in range(1, 301)} == {128, 256, 384}
    assert [attention.flex_bucket(n) for n in (1, 128, 129, 1000)] == [128, 128, 256, 1024]


def test_padding_changes_no_logprob():
    """Padding tokens see only themselves and nothing sees them: the targets' log-probs are unchanged."""
    model = tiny("qwen2")
    packed = packed_alone(random_group(3, 20, 4))
    padded = P.pad_packed(packed, 128)
    assert len(padded) == 128 and padded.target_ids == packed.target_ids
    with torch.no_grad():
        a = P.packed_logprobs(model, packed, "cpu", kernel="dense")
        b = P.packed_logprobs(model, padded, "cpu", kernel="dense")
    assert torch.allclose(a, b, atol=1e-6)
    rows = attention.dense_mask(torch.tensor(padded.subtree_end))[len(packed):]
    assert torch.equal(rows.sum(-1), torch.ones(128 - len(packed), dtype=torch.long))


@pytest.mark.slow
def test_flex_over_three_packed_lengths_equals_dense_on_cpu():
    """Three packed lengths in three buckets (128, 256, 384 for a 300-token budget) through the compiled
    flex kernel: each equals the dense kernel, and a fourth sequence in a known bucket compiles nothing new.
    Forward only: flex_attention has no backward on CPU (torch raises NotImplementedError), so the backward
    is the CUDA probe's and gpu_smoke's business; here the probe's fallback is tested below."""
    import torch._dynamo.utils as dynamo_utils

    model = tiny("qwen2")
    lengths = set()
    for seed, (n, length) in enumerate([(2, 40), (3, 60), (5, 58), (4, 50)]):
        packed = packed_alone(random_group(n, length, seed))
        lengths.add(attention.flex_bucket(len(packed), 300))
        with torch.no_grad():
            dense = P.packed_logprobs(model, packed, "cpu", kernel="dense")
            if seed == 3:
                frames = dict(dynamo_utils.counters["stats"])
            flex = P.packed_logprobs(model, packed, "cpu", kernel="flex", bucket_tokens=300)
        assert torch.allclose(dense, flex, atol=1e-5)
    assert lengths == {128, 256, 384}
    assert dict(dynamo_utils.counters["stats"]) == frames          # the 4th (bucket 256 again): no compile
    assert model.config._attn_implementation == "sdpa"


def test_flex_probe_falls_back_to_tree_with_one_line(monkeypatch, capsys):
    """On this CPU the real probe fails (flex has no backward here): flex — asked for or auto — falls back to
    the tree kernel with one message, printed once; a passing probe keeps flex."""
    monkeypatch.setattr(attention, "flex_probes", {})
    model = tiny("qwen2")
    kernel, why = attention.resolve_kernel("flex", "cpu", model)
    assert kernel == "tree" and "backward" in why
    assert attention.resolve_kernel("flex", "cpu", model) == (kernel, why)
    err = capsys.readouterr().err
    assert err.count("using the tree kernel") == 1 and len(err.strip().splitlines()) == 1
    assert attention.resolve_kernel("auto", "cpu", model) == ("tree", None)       # auto: flex only on CUDA
    assert attention.resolve_kernel("dense", "cpu", model) == ("dense", None)
    monkeypatch.setattr(attention, "flex_probes", {})
    monkeypatch.setattr(attention, "probe_flex", lambda *a, **k: None)
    assert attention.resolve_kernel("flex", "cpu", model) == ("flex", None)


def test_update_with_flex_on_cpu_runs_the_tree_kernel_and_says_so(monkeypatch):
    """train.ppo_update with --packed_attention flex on CPU: the probe falls back, the update equals the tree
    kernel's, and the kernel in use is in the update's stats (→ metrics.jsonl)."""
    monkeypatch.setattr(attention, "flex_probes", {})
    cfg = C.make_config("tiny", mini_batch_size=6, ppo_epochs=1, max_tokens_per_micro_batch=20)
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    out = {}
    for kernel in ("flex", "tree"):
        cfg.packed_attention = kernel
        out[kernel] = _update(tiny("qwen3"), trees, cfg)
    assert out["flex"]["attention_kernel"] == "tree" == out["tree"]["attention_kernel"]
    assert out["flex"]["loss"] == pytest.approx(out["tree"]["loss"], abs=1e-6)
