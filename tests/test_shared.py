"""engine/shared.py (the CPU decode step) against independent paths: its attention against the reference
attention (gather + SDPA) on the same pool, its sampling against the distribution it samples from (counted
frequencies, hand-made edge cases). Its greedy trees against HF generate and its recorded H_t and log p
against a full forward: tests/test_engine.py (the CPU default)."""
import types

import torch

from engine import kv, shared
from engine.loop import decode_mode
from engine.scheduler import DecodeRow


def fake_model(layers=1, heads=4, kv_heads=2, head_dim=16):
    cfg = types.SimpleNamespace(num_key_value_heads=kv_heads, num_attention_heads=heads,
                                hidden_size=heads * head_dim, num_hidden_layers=layers, head_dim=head_dim)
    return types.SimpleNamespace(config=cfg)


def test_shared_attention_equals_the_reference_attention():
    """Two prompts (21 and 9 tokens); prompt A's base rows run on (one ended at 12 tokens, its branches at
    forks 3, 3 and 7 read its first f tokens), prompt B's rows and a branch of B; every row has just been
    extended by the slot of the token fed now. The output equals the reference attention's on the same pool
    within float32 rounding, and the new keys/values land in each row's slot."""
    torch.manual_seed(0)
    pool = kv.KVPool(fake_model(), 400, "cpu", torch.float32)
    pool.layers[0].normal_()
    prompt_a, prompt_b = [], []
    pool.extend(prompt_a, 21)
    pool.extend(prompt_b, 9)
    ended = pool.share([(prompt_a, 21)])[0]
    pool.extend(ended, 12)
    base_b = pool.share([(prompt_b, 9)])[0]
    pool.extend(base_b, 6)
    rows = [DecodeRow(0, 0, 0, None, pool.share([(prompt_a, 21)])[0], 99),          # a base row, own: 5
            DecodeRow(1, 1, 1, None, pool.share([(prompt_b, 9)])[0], 99),           # a base row of B
            DecodeRow(2, 0, 1, 3, pool.share([(ended, 24)])[0], 99),                # branches of A's base 1
            DecodeRow(3, 0, 1, 7, pool.share([(ended, 28)])[0], 99),
            DecodeRow(4, 0, 1, 3, pool.share([(ended, 24)])[0], 99),
            DecodeRow(5, 1, 0, 4, pool.share([(base_b, 13)])[0], 99),               # a branch of B's base 0
            DecodeRow(6, 0, 2, None, pool.share([(prompt_a, 21)])[0], 99)]          # A, none of its own yet
    for row, n in zip(rows, [5, 2, 6, 0, 3, 1, 0]):
        pool.extend(row.slots, n)
    for row in rows:
        pool.extend(row.slots, 1)
    step = shared.step_kv(pool, rows, [21, 9], per_kv=2)
    assert len(step.parts) == 3                                     # prompts, base prefixes, own tokens
    assert [len(p.calls) for p in step.parts] == [1, 1, 1]           # every width within 32 slots
    assert step.parts[0].calls[0].read.shape[0] == 2 and step.parts[1].calls[0].read.shape == (2, 7)
    query, key, value = torch.randn(len(rows), 4, 1, 16), torch.randn(len(rows), 2, 1, 16), \
        torch.randn(len(rows), 2, 1, 16)
    layer = types.SimpleNamespace(layer_idx=0)
    before = pool.layers[0].clone()
    out, _ = shared.shared_attention(layer, query, key, value, None, scaling=0.25, engine_kv=step)
    written = pool.layers[0].clone()
    slots = [row.slots[-1] for row in rows]
    assert torch.equal(written[slots], torch.stack((key[:, :, 0], value[:, :, 0]), 1))
    changed = (written != before).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert sorted(changed) == sorted(slots)
    pool.layers[0].copy_(before)
    ref, _ = kv.engine_attention(layer, query, key, value, None, scaling=0.25,
                                 engine_kv=kv.step_kv(pool, [row.slots for row in rows], 1)[0])
    assert out.shape == ref.shape == (len(rows), 1, 4, 16)
    assert torch.allclose(out, ref, atol=1e-5)


def test_groups_of_unequal_widths_are_split_so_none_reads_more_than_twice_its_slots():
    """One prompt (10 tokens); base rows with 3, 40, 70 and 200 tokens of their own (+ the new one) and two
    branches of one ended base at forks 5 and 50 (one group: they share its first 50 slots). A call pads
    its groups to its widest, so the own tokens fall into four calls (widths 4 and the branches' 3 and 10;
    41; 71; 201): no group reads more than max(32, twice its own) slots. The output still equals the
    reference attention's."""
    assert [shared.width_bin(w) for w in (1, 32, 33, 64, 65, 128, 129)] == [0, 0, 1, 1, 2, 2, 3]
    groups = [[0] * w for w in (201, 4, 41, 3, 71, 10)]
    split = shared.by_width(groups, [[(i, len(g))] for i, g in enumerate(groups)])
    assert [[len(g) for g in gs] for gs, _ in split] == [[4, 3, 10], [41], [71], [201]]
    assert [[m[0][0] for m in ms] for _, ms in split] == [[1, 3, 5], [2], [4], [0]]   # members go along
    torch.manual_seed(1)
    pool = kv.KVPool(fake_model(), 1200, "cpu", torch.float32)
    pool.layers[0].normal_()
    prompt = []
    pool.extend(prompt, 10)
    ended = pool.share([(prompt, 10)])[0]
    pool.extend(ended, 60)
    rows = [DecodeRow(i, 0, i, None, pool.share([(prompt, 10)])[0], 999) for i in range(4)]
    rows += [DecodeRow(4, 0, 9, 5, pool.share([(ended, 15)])[0], 999),
             DecodeRow(5, 0, 9, 50, pool.share([(ended, 60)])[0], 999)]
    for row, n in zip(rows, [3, 40, 70, 200, 2, 9]):
        pool.extend(row.slots, n + 1)                      # its own tokens, then the slot of the one fed now
    step = shared.step_kv(pool, rows, [10], per_kv=2)
    # the prompt; the base prefix (50); the own tokens: 4, 3, 10 padded to 10; 41; 71; 201
    assert [[c.read.shape[1] for c in p.calls] for p in step.parts] == [[10], [50], [10, 41, 71, 201]]
    # each row's entry in the own calls' outputs one after the other: the first call holds rows 0, 4, 5
    # (entries 0-2), then row 1 (3), row 2 (4), row 3 (5)
    assert step.parts[2].back.tolist() == [0, 3, 4, 5, 1, 2]
    query, key, value = torch.randn(6, 4, 1, 16), torch.randn(6, 2, 1, 16), torch.randn(6, 2, 1, 16)
    layer = types.SimpleNamespace(layer_idx=0)
    before = pool.layers[0].clone()
    out, _ = shared.shared_attention(layer, query, key, value, None, scaling=0.25, engine_kv=step)
    pool.layers[0].copy_(before)
    ref, _ = kv.engine_attention(layer, query, key, value, None, scaling=0.25,
                                 engine_kv=kv.step_kv(pool, [row.slots for row in rows], 1)[0])
    assert torch.allclose(out, ref, atol=1e-5)


def test_bench_width_bins_runs_every_layout_and_both_ways_agree(capsys):
    """bench/bench_width_bins.py's own code on one layer: a line per layout, the DATPO layouts cut into
    more than one call, and the one-call and by-width outputs equal within float32 rounding."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_width_bins

    bench_width_bins.main(["--layers", "1", "--repeats", "1", "--rounds", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if "max |Δ|" in line]
    assert len(lines) == 4
    assert all(float(line.rsplit(" ", 1)[1]) < 1e-5 for line in lines)
    assert "base prefixes 1," not in lines[2] and "own tokens 1;" not in lines[2]   # DATPO at 256


def sampler_model():
    """lm_head is the identity: the hidden state is the row's scores."""
    return types.SimpleNamespace(get_output_embeddings=lambda: torch.nn.Identity())


def test_draw_samples_the_distribution_and_records_its_entropy_and_log_probs():
    """20,000 draws of each of two rows: frequencies within 4.5 standard errors of softmax(scores); a token
    of score −inf (masked by a warper) never drawn; H_t = −Σ p log p and log p of the drawn token as computed
    by hand; a greedy (one-hot) row always gives its token; one transfer to the host."""
    scores = torch.tensor([[2.0, 0.5, -1.0, float("-inf"), 0.0, 1.5],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    n = 20000
    torch.manual_seed(0)
    tokens, entropies, logprobs = shared.draw(sampler_model(), lambda s: s, scores.repeat_interleave(n, 0))
    probs = torch.softmax(scores, -1)
    drawn = torch.tensor(tokens).view(2, n)
    for r in range(2):
        freq = torch.bincount(drawn[r], minlength=6).double() / n
        se = (probs[r].double() * (1 - probs[r].double()) / n).sqrt()
        assert ((freq - probs[r]).abs() <= 4.5 * se + 1e-12).all(), (r, freq, probs[r])
    assert (drawn[0] != 3).all()
    entropy = [-(p[p > 0] * p[p > 0].log()).sum().item() for p in probs]
    assert torch.allclose(torch.tensor(entropies).view(2, n), torch.tensor(entropy)[:, None].expand(2, n),
                          atol=1e-5)
    logp = torch.log_softmax(scores, -1)
    assert torch.allclose(torch.tensor(logprobs), logp.repeat_interleave(n, 0)[torch.arange(2 * n), tokens],
                          atol=1e-5)
    one_hot = torch.full((3, 6), float("-inf"))
    one_hot[torch.arange(3), torch.tensor([4, 0, 5])] = 0.0
    assert shared.draw(sampler_model(), lambda s: s, one_hot)[0] == [4, 0, 5]


def test_inverse_cdf_never_picks_a_token_of_probability_zero():
    """u at 0 and just below 1: the first and the last token of nonzero probability, with zeros before,
    between and after them; u in the middle: the token whose interval holds it."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0]] * 4)
    u = torch.tensor([[0.0], [1 - 2**-53], [0.3], [0.75]], dtype=torch.float64)
    assert shared.inverse_cdf(probs, u)[:, 0].tolist() == [1, 4, 3, 4]
    assert shared.inverse_cdf(probs, torch.tensor([[0.2499]] * 4, dtype=torch.float64))[0, 0].item() == 1


def test_the_cpu_default_is_the_shared_step():
    assert decode_mode("auto", torch.device("cpu")) == "shared"
    assert decode_mode("reference", torch.device("cpu")) == "reference"
