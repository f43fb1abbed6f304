"""packing.py: trees as packed sequences under a tree mask. Log-probs against separate forwards of every
root-to-leaf sequence (Llama, Qwen2, Qwen3), the packed update against the rows update, the flattened-path
objective of TreeRL/AttnRL against explicitly flattened paths, mini-batches in blocks, normalisers by hand.
The attention kernels themselves: tests/test_attention.py (it builds on this file's trees and tiny models)."""
import copy
import dataclasses
import math
import random

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import advantage as A
import attention
import config as C
import methods as M
import packing as P
import train
import tree as T

EOS = 2
SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=EOS,
             pad_token_id=EOS)
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def tiny(family: str, attn: str = "sdpa", seed: int = 0):
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**SIZES, attn_implementation=attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config).eval()


def datpo_tree() -> P.TrainTree:
    """Base response 0 = [10 11 12 | 13 14 | 15 16 EOS] forked at 3 and 5. Fork 3 has two branches: one
    EOS-terminated, one cut by the token budget (no EOS). Fork 5 has a single branch. Base response 1 is
    unforked. The branches come after the base blocks, as rollout.py builds them."""
    parents = [None, 0, 1, None, 0, 0, 1]
    tokens = [[10, 11, 12], [13, 14], [15, 16, EOS], [40, 41, 42, 43], [20, 21, EOS], [22, 23, 24, 25], [30]]
    return P.TrainTree([5, 6, 7], parents, tokens, [0.5, -0.25, 1.0, -1.0, 0.75, -0.5, 2.0], [1.0] * 7)


def grpo_group() -> P.TrainTree:
    """A GRPO group: a tree of depth one."""
    return P.TrainTree([8, 9], [None] * 3, [[50, 51], [52, 53, 54, EOS], [55]], [1.0, -1.0, 0.5], [1.0] * 3)


def deep_tree() -> P.TrainTree:
    """Forks at two depths: a branch off a block that is itself below a fork."""
    parents = [None, 0, 1, 1, 0]
    tokens = [[60, 61], [62], [63, 64, EOS], [65, 66], [67]]
    return P.TrainTree([3], parents, tokens, [0.3, -0.6, 0.9, -0.2, 0.4], [1.0] * 5)


def path_logprobs(model, tr: P.TrainTree, offsets: list[int]) -> dict[int, float]:
    """log π of every generated token from a separate plain forward of its own root-to-leaf sequence."""
    out = {}
    kids = P.children_of(tr.parents)
    for leaf in [b for b in range(len(tr.tokens)) if not kids[b]]:
        path = P.ancestors(tr.parents, leaf) + [leaf]
        ids = tr.prompt_ids + [t for b in path for t in tr.tokens[b]]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        at = len(tr.prompt_ids)
        for b in path:
            for i, t in enumerate(tr.tokens[b]):
                out[offsets[b] + i] = float(logp[at - 1, t])
                at += 1
    return out


def test_pack_by_hand():
    tr = datpo_tree()
    offsets = P.token_offsets([tr])
    (micro,) = P.micro_batches([tr], [(0, tuple(tr.trained))], max_tokens=100)
    pk = P.pack([tr], micro, offsets)
    # prompt, then depth-first: block 0, its children 1 (→ 2, 6), 4, 5; then base response 1 (block 3)
    assert pk.input_ids == [5, 6, 7, 10, 11, 12, 13, 14, 15, 16, EOS, 30, 20, 21, EOS, 22, 23, 24, 25,
                            40, 41, 42, 43]
    assert pk.position_ids == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 8, 6, 7, 8, 6, 7, 8, 9, 3, 4, 5, 6]
    # where each block's tokens are predicted from: a block's first token from its parent's last token
    by_target = dict(zip(pk.target_gidx, pk.pred_index))
    assert by_target[offsets[0][0]] == 2                # block 0 ← last prompt token
    assert by_target[offsets[0][3]] == 2                # base response 1 ← last prompt token, not 43's left
    assert by_target[offsets[0][4]] == 5                # branch at fork 3 ← token 12 (block 0's last)
    assert by_target[offsets[0][6]] == 7                # branch at fork 5 ← token 14 (block 1's last)
    assert by_target[offsets[0][2] + 1] == 8            # inside a block: the token before
    assert sorted(pk.target_gidx) == list(range(sum(len(t) for t in tr.tokens)))
    mask = attention.dense_mask(torch.tensor(pk.subtree_end))
    visible = lambda q: [pk.input_ids[k] for k in range(len(pk)) if mask[q, k]]  # noqa: E731
    assert visible(pk.input_ids.index(30)) == [5, 6, 7, 10, 11, 12, 13, 14, 30]
    assert visible(pk.input_ids.index(22)) == [5, 6, 7, 10, 11, 12, 22]
    assert visible(pk.input_ids.index(41)) == [5, 6, 7, 40, 41]


@pytest.mark.parametrize("family,attn,kernel", [("llama", "sdpa", "dense"), ("qwen2", "sdpa", "dense"),
                                                ("qwen3", "sdpa", "dense"), ("llama", "eager", "dense"),
                                                ("llama", "sdpa", "tree"), ("qwen2", "sdpa", "tree"),
                                                ("qwen3", "sdpa", "tree")])
def test_packed_logprobs_equal_separate_root_to_leaf_forwards(family, attn, kernel):
    model = tiny(family, attn)
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    offsets = P.token_offsets(trees)
    reference = {}
    for tr, offs in zip(trees, offsets):
        reference.update(path_logprobs(model, tr, offs))
    units = [(t, tuple(tr.trained)) for t, tr in enumerate(trees)]
    for budget in (1000, 12):          # all trees in one sequence; trees cut at blocks, ancestors as context
        seen = []
        micros = P.micro_batches(trees, units, budget)
        if budget == 1000:
            assert len(micros) == 1
        else:
            assert len(micros) > 3
        for items in micros:
            pk = P.pack(trees, items, offsets)
            assert len(pk) <= budget or len(items) == 1
            with torch.no_grad():
                got = P.packed_logprobs(model, pk, "cpu", kernel=kernel, chunk=5)
            want = torch.tensor([reference[g] for g in pk.target_gidx])
            assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()
            seen += pk.target_gidx
        assert sorted(seen) == list(range(len(reference)))          # every tree token trained exactly once


def chunked_logprobs(head, hidden, pred, targets, chunk):
    """packed_logprobs's last lines: target_logprobs `chunk` targets at a time, recomputed in the backward."""
    return torch.cat([checkpoint(P.target_logprobs, head, hidden.index_select(0, pred[s:s + chunk]),
                                 targets[s:s + chunk], use_reentrant=False)
                      for s in range(0, len(targets), chunk)])


def test_chunked_logprobs_values_and_gradients_match_one_chunk():
    model = tiny("qwen2")
    hidden = torch.randn(7, SIZES["hidden_size"], requires_grad=True)
    pred = torch.tensor([0, 1, 1, 3, 4, 6, 2])
    targets = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    grads = []
    for chunk in (2, 100):
        hidden.grad = None
        lp = chunked_logprobs(model.get_output_embeddings(), hidden, pred, targets, chunk)
        (lp * torch.arange(7.0)).sum().backward()
        grads.append((lp.detach(), hidden.grad.clone()))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


def test_logprobs_of_a_bf16_model_come_from_fp32_logits():
    """bf16 hidden states and lm_head: the log-probs equal a float64 computation from the same (bf16) values
    to fp32 rounding, where bf16 logits (the former lm_head(hidden).float()) are off by up to half a bf16 unit
    of a logit of ~30 (2^-4 = 0.0625); under bf16 autocast too. The weight still gets its gradient."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 500, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(500, 64, generator=gen) * 0.5)
    hidden = (torch.randn(40, 64, generator=gen) * 2).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 500, (40,), generator=gen)
    pred = torch.arange(40)
    logits64 = hidden.detach().double() @ head.weight.detach().double().T
    assert logits64.abs().max() > 20                                    # large logits: where bf16 hurts
    exact = logits64.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits64, -1)
    bf16_logits = head(hidden).detach().float()
    former = bf16_logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(bf16_logits, -1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked_logprobs(head, hidden, pred, targets, chunk=16)
    assert ours.dtype == torch.float32
    assert (ours.double() - exact).abs().max() < 1e-4 < (former.double() - exact).abs().max()
    ours.sum().backward()
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.bfloat16


def test_bf16_head_log_probs_equal_the_fp32_upcast_and_gradients_stay_within_bf16_rounding(monkeypatch):
    """packing.HalfLogits, the bf16 head of the update (issue 42): its log-probs equal the former path's (both
    operands upcast, one IEEE fp32 product) within 1e-5 at logits of ~20 — on CPU the forward is that same
    product (no bf16 GEMM with an fp32 result there); on CUDA only the order of its fp32 sums differs. Its
    gradients, from a bf16-rounded logit gradient as every other bf16 layer takes its own, are within one
    bf16 unit (2^-8, relative L2) of float64 from the same values, and at most twice as far as the former
    fp32 product rounded once. An fp32 head never takes it: those runs compute what they computed."""
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 2000, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(torch.randn(2000, 64, generator=gen) * 0.6)
    hidden0 = (torch.randn(48, 64, generator=gen) * 0.6).to(torch.bfloat16)
    targets = torch.randint(0, 2000, (48,), generator=gen)
    adv = torch.randn(48, generator=gen)

    def run(logits_of, weight, dtype=torch.bfloat16):
        weight.grad = None
        hidden = hidden0.to(dtype, copy=True).requires_grad_()
        logits = logits_of(hidden)
        logp = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        (logp * adv).sum().backward()
        return logp.detach().double(), hidden.grad.double(), weight.grad.double(), logits.detach()

    ours = run(lambda h: P.fp32_logits(head, h), head.weight)
    former = run(lambda h: torch.nn.functional.linear(h.float(), head.weight.float()), head.weight)
    w64 = head.weight.detach().double().requires_grad_()
    exact = run(lambda h: torch.nn.functional.linear(h, w64), w64, torch.float64)   # the same values
    assert 10 < exact[3].abs().max() < 40 and ours[3].dtype == torch.float32
    assert (ours[0] - former[0]).abs().max() <= 1e-5
    for i in (1, 2):                                                        # hidden, then weight
        ours_error = ((ours[i] - exact[i]).norm() / exact[i].norm()).item()
        former_error = ((former[i] - exact[i]).norm() / exact[i].norm()).item()
        assert ours_error <= 2 ** -8 and ours_error <= 2 * former_error and ours[i].abs().max() > 0
    # fp32 runs never take the bf16 path
    monkeypatch.setattr(P.HalfLogits, "apply", lambda *a: pytest.fail("an fp32 head took the bf16 path"))
    head32 = torch.nn.Linear(64, 2000, bias=False)
    hidden32 = torch.randn(5, 64, generator=gen)
    assert torch.equal(P.fp32_logits(head32, hidden32), torch.nn.functional.linear(hidden32, head32.weight))


def test_split_items_keep_ancestors_as_context_and_train_each_block_once():
    tr = datpo_tree()
    items = P.split_items(tr, 0, tr.trained, max_tokens=12)
    assert sorted(b for it in items for b in it.trained) == tr.trained
    for it in items:
        assert P.item_cost([tr], [it]) <= 12 or it.blocks == [it.blocks[0]]
    # zero-advantage blocks are not trained, and a zero leaf is not forwarded at all
    tr.advantages[3] = 0.0
    items = P.split_items(tr, 0, tr.trained, max_tokens=100)
    assert 3 not in {b for it in items for b in it.blocks}


def test_minibatches_count_blocks_and_reshuffle_every_epoch():
    trees = [P.TrainTree([1], [None] * n, [[9]] * n, [1.0] * n, [1.0] * n) for n in (5, 3, 7, 2, 4)]
    trees[2].weights[0] = 0.0                                   # a context-only block is not a unit
    rng = random.Random(0)
    epochs = [P.minibatches(trees, 8, "trees", rng) for _ in range(4)]
    for mbs in epochs:
        units = [u for mb in mbs for u in mb]
        assert sorted(t for t, _ in units) == [0, 1, 2, 3, 4]          # whole trees, each once
        assert all(bs == tuple(trees[t].trained) for t, bs in units)
        assert all(abs(sum(len(bs) for _, bs in mb) - 8) <= 4 for mb in mbs[:-1])
    assert len({tuple(tuple(t for t, _ in mb) for mb in mbs) for mbs in epochs}) > 1   # re-shuffled
    mbs = P.minibatches(trees, 8, "blocks", rng)
    assert [sum(len(bs) for _, bs in mb) for mb in mbs] == [8, 8, 4]                  # 20 trained blocks
    assert sorted((t, b) for mb in mbs for t, bs in mb for b in bs) == \
        sorted((t, b) for t, tr in enumerate(trees) for b in tr.trained)


def test_loss_normaliser_by_hand():
    tr = datpo_tree()
    tr.weights = [3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    units = [(0, (0, 1, 4))]
    # token: Σ weight·|b| = 3·3 + 2·2 + 1·3; constant: 3 blocks × max_new_tokens
    assert P.loss_normaliser([tr], units, "token", 64) == 16.0
    assert P.loss_normaliser([tr], units, "constant", 64) == 3 * 64


def _update(model, trees, cfg, opt_lr=0.05):
    optimizer = torch.optim.SGD(model.parameters(), lr=opt_lr)
    return train.ppo_update(model, optimizer, trees, cfg, EOS, "cpu", random.Random(3))


@pytest.mark.parametrize("grouping,kernel", [("trees", "dense"), ("blocks", "dense"), ("trees", "tree")])
def test_one_update_packed_equals_rows(grouping, kernel):
    """Same trees, same mini-batch partition (same seed): same loss and same weights after the step.
    SGD, because Adam's first step is ±lr wherever a gradient is non-zero, so float noise in a gradient
    that should be exactly zero would show as a full-size difference."""
    cfg = C.make_config("tiny", mini_batch_size=6, micro_batch_size=2, ppo_epochs=2, max_grad_norm=1e9,
                        max_tokens_per_micro_batch=20, mini_batch_grouping=grouping, packed_attention=kernel)
    trees = [datpo_tree(), grpo_group(), deep_tree()]
    trees[0].advantages[5] = 0.0
    base = tiny("qwen3")
    results = {}
    for layout in ("packed", "rows"):
        model = copy.deepcopy(base)
        cfg.train_layout = layout
        stats = _update(model, trees, cfg)
        results[layout] = (stats, [p.detach().clone() for p in model.parameters()])
    (sp, wp), (sr, wr) = results["packed"], results["rows"]
    assert sp["optimizer_steps"] == sr["optimizer_steps"] >= 4
    assert sp["loss"] == pytest.approx(sr["loss"], abs=1e-5)
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(wp, wr))
    assert any(not torch.equal(a, b) for a, b in zip(wp, base.parameters()))
    if grouping == "trees":
        assert sp["forwarded_tokens"] < sr["forwarded_tokens"]


def _flattened_tree():
    """Base 0 forked twice (one branch at each fork), base 1 unbranched; rewards mixed."""
    blocks = [T.Block(None, [10, 11], [0, 0], base=0, start=0),
              T.Block(0, [12, 13], [0, 0], base=0, start=2),
              T.Block(1, [14, EOS], [0, 0], reward=0.0, base=0, start=4),
              T.Block(0, [20, 21, 22], [0] * 3, reward=1.0, base=0, start=2, branch=True),
              T.Block(1, [30], [0], reward=1.0, base=0, start=4, branch=True),
              T.Block(None, [40, 41, 42], [0] * 3, reward=0.0, base=1, start=0)]
    return T.Tree("p", [5, 6], "a", blocks, v_root=0.0, k_hat=2, b_hat=1, forks=[[2, 4], []])


@pytest.mark.parametrize("method", ["treerl", "attnrl"])
def test_multiplicity_weighting_reproduces_the_flattened_path_loss(method):
    """TreeRL/AttnRL train root-to-leaf paths (App. E.4). One packed forward per token, weighted by the number
    of trained paths through it, gives the loss and the gradient of explicitly flattened paths."""
    tree = _flattened_tree()
    adv = [b.advantage for b in A.score_tree(tree, M.METHODS[method], 0.0, None)]
    tt = train.train_tree(tree, adv, M.METHODS[method])
    cfg = C.make_config("tiny", mini_batch_size=100, ppo_epochs=1, max_grad_norm=1e9,
                        max_tokens_per_micro_batch=1000)
    base = tiny("llama")
    packed = copy.deepcopy(base)
    stats = _update(packed, [tt], cfg)

    flat = copy.deepcopy(base)
    paths = [T.path_to(tree.blocks, i) for i, b in enumerate(tree.blocks) if b.terminal]
    if method == "attnrl":
        paths = [p for p in paths if len(p) > 1]                # AttnRL: branched paths only
    flat.eval()
    total, n_tokens = 0.0, 0
    for path in paths:
        ids = tree.prompt_ids + [t for i in path for t in tree.blocks[i].token_ids]
        logp = torch.log_softmax(flat(torch.tensor([ids])).logits[0].float(), dim=-1)
        targets = torch.tensor(ids[len(tree.prompt_ids):])
        lp = logp[len(tree.prompt_ids) - 1:-1].gather(-1, targets[:, None]).squeeze(-1)
        a = torch.tensor([adv[i] for i in path for _ in tree.blocks[i].token_ids])
        total = total - (torch.exp(lp - lp.detach()) * a).sum()
        n_tokens += len(targets)
    loss = total / n_tokens
    loss.backward()
    torch.optim.SGD(flat.parameters(), lr=0.05).step()
    assert stats["loss"] == pytest.approx(loss.item(), abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=0)
               for a, b in zip(packed.parameters(), flat.parameters()))
    assert stats["forwarded_tokens"] == len(tree.prompt_ids) + tree.generated_tokens - (
        3 if method == "attnrl" else 0)                     # each token once (AttnRL: not the unbranched one)


def test_the_picture_in_pack_is_what_pack_does():
    """packing.pack's docstring draws a 3-block tree packed with its mask; its numbers are pack's own."""
    tr = P.TrainTree([100, 101], [None, 0, 0], [[1, 2], [3], [4, 5]], [1.0] * 3, [1.0] * 3)
    pk = P.pack([tr], P.split_items(tr, 0, [0, 1, 2], 100), P.token_offsets([tr]))
    lines = {line.split()[0]: line.split()[1:] for line in P.pack.__doc__.splitlines() if line.strip()}
    assert [int(x) for x in lines["position_ids"][:7]] == pk.position_ids
    assert [int(x) for x in lines["subtree_end"][:7]] == pk.subtree_end
    names = lines["key"][1:8]                                  # p0 p1 a0 a1 c0 b0 b1
    rows = [line for line in P.pack.__doc__.splitlines() if "■" in line]
    assert len(rows) == len(names)
    for q, row in enumerate(rows):                             # ■ where k ≤ q < subtree_end[k], else ·
        marks = [c for c in row.split() if c in ("■", "·")]
        assert marks == ["■" if q < pk.subtree_end[k] else "·" for k in range(q + 1)]
    predicted_at = lines["pred_index"][lines["pred_index"].index("at") + 1:][:5]
    assert [names.index(x) for x in predicted_at] == pk.pred_index


def test_kl_penalty_adds_beta_times_k3_by_hand():
    """--kl_beta (kl.py; not in the paper): with one mini-batch, one epoch, the loss grows by
    β·Σ_t w_t·k3_t / normaliser, k3_t = π_ref/π_θ − log(π_ref/π_θ) − 1 from separate root-to-leaf forwards of
    the policy and of a different reference model."""
    import kl

    trees = [datpo_tree(), grpo_group()]
    beta = 0.7
    cfg = C.make_config("tiny", mini_batch_size=64, ppo_epochs=1, max_grad_norm=1e9, loss_norm="token")
    policy, reference = tiny("qwen3"), tiny("qwen3", seed=1)
    plain = _update(copy.deepcopy(policy), trees, cfg)["loss"]
    model = copy.deepcopy(policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with_kl = train.ppo_update(model, optimizer, trees, dataclasses.replace(cfg, kl_beta=beta), EOS, "cpu",
                               random.Random(3), reference=reference)["loss"]
    penalty = weight = 0.0
    for tr, offsets in zip(trees, P.token_offsets(trees)):
        new, ref = path_logprobs(policy, tr, offsets), path_logprobs(reference, tr, offsets)
        for b, tokens in enumerate(tr.tokens):
            for i in range(len(tokens)):
                ratio = math.exp(ref[offsets[b] + i] - new[offsets[b] + i])       # π_ref / π_θ
                penalty += tr.weights[b] * (ratio - math.log(ratio) - 1)
                weight += tr.weights[b]
    assert penalty > 0.1
    assert with_kl - plain == pytest.approx(beta * penalty / weight, rel=1e-4, abs=1e-6)
    assert all(not p.requires_grad or p.grad is None for p in reference.parameters())   # π_ref untouched
    assert float(kl.k3(torch.tensor([-0.5]), torch.tensor([-0.5]))) == 0.0            # KL(π || π) = 0
