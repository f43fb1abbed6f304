"""engine/paged.py and the paged KV pool against independent paths: the reference attention (gather + SDPA) on
the same pool, HF generate (greedy trees token for token), a fresh full forward (H_t and log-probs), a count
of the device → host transfers of a decode step, and torch.compile(fullgraph=True) of the static step."""
import collections
import random
import types

import pytest
import torch
from test_engine import ANSWERS, PROMPTS, assert_recorded_distributions, run_to_end, tiny_model, tree_tokens
from torch.overrides import TorchFunctionMode

import config
import engine as E
import rollout as R
from engine import kv, paged


def _cfg(**overrides):
    base = dict(n_base=3, k_max=2, b_max=2, fork="tok-entropy", adaptive=False, max_new_tokens=10,
                gen_batch_size=6, branch_chunk_size=8)
    base.update(overrides)
    return config.make_config("tiny", **base)


def rollout(model, tok, cfg, engine, decode="reference", seed=0):
    cfg.rollout_engine, cfg.decode_step = engine, decode
    torch.manual_seed(seed)
    return R.rollout_trees(model, tok, PROMPTS, ANSWERS, cfg, random.Random(seed))


def fake_model(layers=1, heads=4, kv_heads=2, head_dim=16):
    cfg = types.SimpleNamespace(num_key_value_heads=kv_heads, num_attention_heads=heads,
                                hidden_size=heads * head_dim, num_hidden_layers=layers, head_dim=head_dim)
    return types.SimpleNamespace(config=cfg)


# ---- the pool's pages --------------------------------------------------------------------------------------
def test_pages_are_shared_by_reference_and_a_partial_page_is_copied():
    """Pages of 4 tokens: a 10-token prompt holds 3 pages; two rows sharing it read its 2 full pages by
    reference and get their own copy of the last 2 tokens (the same keys/values, another page) and write on
    there; every page goes back once the last row reading it is done."""
    pool = kv.KVPool(fake_model(layers=2), 40, "cpu", torch.float32, page=4)
    for layer in pool.layers:
        layer.copy_(torch.randn_like(layer))
    prompt = []
    pool.extend(prompt, 10)
    assert prompt == list(range(prompt[0], prompt[0] + 4)) + prompt[4:] and len(prompt) == 10
    assert pool.pages_of(prompt) == [0, 1, 2] and pool.used == 12
    a, b = pool.share([(prompt, 10), (prompt, 8)])
    assert a[:8] == prompt[:8] and a[8:] != prompt[8:] and b == prompt[:8]           # 8 = two full pages
    assert a[8] % 4 == 0 and a[9] == a[8] + 1                                       # offsets 0, 1 of its page
    for layer in pool.layers:
        assert torch.equal(layer[a], layer[prompt])                                 # the copy holds the same
    assert pool.refs[0] == pool.refs[1] == 3 and pool.refs[2] == 1 and pool.refs[a[8] // 4] == 1
    pool.extend(a, 3)                                                               # fills a's own page, then
    assert a[10] == a[9] + 1 and a[11] == a[10] + 1 and a[12] % 4 == 0              # one more page
    pool.extend(b, 1)
    assert b[8] % 4 == 0 and pool.refs[b[8] // 4] == 1                              # a page of its own
    pool.shrink(a, 2)                                                               # undo: a's last page goes
    assert len(a) == 11 and pool.refs[a[8] // 4] == 1 and pool.used == 5 * 4
    for context in (prompt, a, b):
        pool.release_context(context)
    assert pool.used == 0 and set(pool.refs) == {0} and pool.peak == 6 * 4
    with pytest.raises(RuntimeError, match="exhausted: 11 pages wanted, 10 free"):
        pool.extend([], 41)


def test_pages_needed_counts_a_partial_page_per_row():
    assert kv.pages_needed(37, 1, 5) == 37                         # one-token pages: tokens (the reference)
    assert kv.pages_needed(37, 16, 2) == 3 + 2 and kv.pages_needed(0, 16) == 0


def test_buckets():
    assert paged.buckets(5) == [16] and paged.buckets(64) == [16, 64]
    assert paged.buckets(100) == [16, 64, 128] and paged.buckets(600)[-2:] == [512, 600]


# ---- paged attention against the reference -----------------------------------------------------------------
@pytest.mark.parametrize("page", [16, 1])
def test_paged_attention_equals_the_reference_attention(page):
    """One decode token for rows whose contexts share a prompt (its full pages by reference, its last partial
    page copied), run on, or start from nothing; padded lanes read and write the scratch page only. The
    output equals the reference (gather + SDPA with the mask) on the same pool within float32 rounding, and
    the new keys/values land in each row's slot."""
    torch.manual_seed(0)
    pool = kv.KVPool(fake_model(), 64 * 16, "cpu", torch.float32, page=page, scratch=True)
    pool.layers[0].normal_()
    prompt = []
    pool.extend(prompt, 21)
    rows = pool.share([(prompt, 21)] * 3) + [[]]
    for row, n in zip(rows, [0, 10, 30, 5]):
        pool.extend(row, n)
    for row in rows:
        pool.extend(row, 1)                                          # the slot of the token fed now
    size = 8
    table, logical, lengths = paged.lane_tables(pool, rows, size)
    query, key, value = torch.randn(size, 4, 1, 16), torch.randn(size, 2, 1, 16), torch.randn(size, 2, 1, 16)
    pos = lengths - 1
    write = table.gather(1, (pos // page)[:, None])[:, 0].long() * page + pos % page
    assert write[:4].tolist() == [row[-1] for row in rows]
    assert set(write[4:].tolist()) == {pool.scratch_page * page}
    layer = types.SimpleNamespace(layer_idx=0)
    before = pool.layers[0].clone()
    mask = paged.block_mask(table, lengths, logical, page, pool.layers[0].shape[0])
    step = paged.PagedKV(pool, write, mask)
    out, _ = paged.paged_attention(layer, query, key, value, None, scaling=0.25, engine_kv=step)
    written = pool.layers[0].clone()
    assert torch.equal(written[write[:4]], torch.stack((key[:4, :, 0], value[:4, :, 0]), 1))
    changed = (written != before).flatten(1).any(1).nonzero()[:, 0].tolist()
    assert set(changed) <= set(write.tolist())                       # nothing else of the pool was written
    pool.layers[0].copy_(before)
    ref, _ = kv.engine_attention(layer, query[:4], key[:4], value[:4], None, scaling=0.25,
                                 engine_kv=kv.step_kv(pool, rows, 1)[0])
    assert out.shape == (size, 1, 4, 16) and torch.isfinite(out).all()
    assert torch.allclose(out[:4], ref, atol=1e-5)
    # the mask_mod alone says the same: uncompiled flex (scores over the whole pool, masked) agrees
    from torch.nn.attention.flex_attention import flex_attention

    keys, values = (written[:, i].permute(1, 0, 2)[None] for i in (0, 1))
    alone = flex_attention(query, keys, values, block_mask=mask, scale=0.25, enable_gqa=True).transpose(1, 2)
    assert torch.allclose(alone, out, atol=1e-5)


# ---- the engine on the paged step ------------------------------------------------------------------------
def checked_steps(monkeypatch):
    """Wrap StaticDecoder.step: before each step whose rows hold the same lanes as the last one, the device
    lanes must hold what the host holds (StaticDecoder.check)."""
    real, counts = paged.StaticDecoder.step, collections.Counter()

    def step(self, rows):
        if self.lane_ids == [r.id for r in rows]:
            self.check(rows)
            counts["checked"] += 1
        counts["steps"] += 1
        counts["rows"] += len(rows)
        return real(self, rows)

    monkeypatch.setattr(paged.StaticDecoder, "step", step)
    return counts


@pytest.mark.parametrize("arch,page", [("llama", paged.PAGE), ("qwen3", 4)])
def test_paged_greedy_trees_equal_generate_trees(smollm_tokenizer, arch, page, monkeypatch):
    """The static step (eagerly, flex compiled; every row copies its prompt's or fork's partial page; pages
    of 4 tokens cross a page every few steps) grows HF generate's trees token for token; rows leave, branches
    join and lanes are re-packed on the way, and the device lanes agree with the host before every step."""
    tok = smollm_tokenizer
    model = tiny_model(arch, len(tok))
    monkeypatch.setattr(paged, "PAGE", page)
    counts = checked_steps(monkeypatch)
    cfg = _cfg(top_k=1)
    ours, stats = rollout(model, tok, cfg, "engine", "paged-eager")
    ref, ref_stats = rollout(model, tok, cfg, "generate")
    assert tree_tokens(ours) == tree_tokens(ref)
    assert any(b.branch for t in ours for b in t.blocks) and counts["checked"] > 5
    assert stats.ended_row_steps == 0 and stats.row_steps == counts["rows"]
    assert (stats.base_tokens, stats.branch_tokens) == (ref_stats.base_tokens, ref_stats.branch_tokens)


@pytest.mark.parametrize("warpers", [dict(temperature=0.8), dict(temperature=0.7, top_k=40, top_p=0.9)])
def test_paged_sampling_records_the_distribution_of_a_full_forward(tiny_policy, warpers):
    """Sampling on the device: every block's H_t and log p equal a fresh full forward of prompt + path within
    1e-4 (fp32), every token is inside the warped support, and two seeds give different trees."""
    model, tok = tiny_policy
    cfg = _cfg(**warpers)
    trees, _ = rollout(model, tok, cfg, "engine", "paged-eager", seed=3)
    assert assert_recorded_distributions(model, R.Sampler.from_config(model, tok, cfg), trees) >= 6
    again, _ = rollout(model, tok, cfg, "engine", "paged-eager", seed=4)
    assert tree_tokens(again) != tree_tokens(trees)


SYNCING = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero"}


FACTORIES = {"tensor", "full", "zeros", "ones", "arange", "empty"}


class HostCalls(TorchFunctionMode):
    """Counts every call that brings a tensor's values to the host (on CUDA, a sync): SYNCING, except on
    tensors the host built in the step (factories called without a device, and what is computed from them
    alone). The CPU plays the device here, so `.to(device)` cannot be told from a copy to the host and is
    not counted (the engine brings values to the host only through paged.to_host)."""

    def __init__(self):
        super().__init__()
        self.calls, self.host = collections.Counter(), {}
        self.paused, self.grown = False, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        out = func(*args, **kwargs)
        if self.paused:
            return out
        inputs = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        on_host = bool(inputs) and all(id(a) in self.host for a in inputs)
        if name in SYNCING and not on_host:
            self.calls[name] += 1
        elif (name in FACTORIES and "device" not in kwargs or on_host) and isinstance(out, torch.Tensor):
            self.host[id(out)] = out                           # kept alive: ids are not reused meanwhile
        return out


@pytest.mark.parametrize("decode", ["reference", "shared", "paged-eager"])
def test_one_host_transfer_per_decode_step(smollm_tokenizer, decode, monkeypatch):
    """Every decode step brings its results to the host in one transfer (paged.to_host: the reference step's
    tokens, H_t and log p; the paged step's [token, H_t, log p, ended]) and makes no other call that would
    wait for the device; the paged step sends the host nothing per step but new pages and joining rows."""
    tok = smollm_tokenizer
    model = tiny_model("qwen2", len(tok))
    sampler = R.Sampler.from_config(model, tok, _cfg(top_k=1))
    engine = E.Engine(model, sampler.stop_ids, sampler.warp, 8, 512, decode=decode)
    real, per_step, mode = engine._decode_step, [], HostCalls()
    real_grow = engine.grow

    def counted():
        mode.calls.clear()
        before = paged.TRANSFERS[0]
        with mode:
            yield from real()
        per_step.append((paged.TRANSFERS[0] - before - mode.grown, sum(mode.calls.values()) - 1))
        mode.grown = 0

    def grow(prompt, requests):             # a grow answering BasesDone is not part of the step
        before, mode.paused = paged.TRANSFERS[0], True
        try:
            real_grow(prompt, requests)
        finally:
            mode.paused, mode.grown = False, mode.grown + paged.TRANSFERS[0] - before

    monkeypatch.setattr(engine, "_decode_step", counted)
    monkeypatch.setattr(engine, "grow", grow)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    run_to_end(engine, prompts, 3, 9, branches=lambda p, bases: [E.BranchRequest(0, 2, 2, 5)])
    assert len(per_step) >= 8 and set(per_step) == {(1, 0)}
    assert (engine.static is None) == (decode != "paged-eager")


# ---- out of memory, and the compiled step ----------------------------------------------------------------
def test_paged_step_out_of_memory_halves_the_rows_and_gives_the_same_samples(smollm_tokenizer, monkeypatch):
    """A "GPU" whose paged step fits 2 rows: the step fails with no trace on the rows (their new slots go
    back, the device lanes are rebuilt), the row budget halves, and the samples are an unconstrained run's."""
    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    cfg = _cfg(top_k=1)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS]
    sampler = R.Sampler.from_config(model, tok, cfg)

    def make():
        return E.Engine(model, sampler.stop_ids, sampler.warp, 6, 2048, decode="paged-eager")

    reference = run_to_end(make(), prompts, 2, 8)
    real = paged.StaticDecoder.run

    def small_gpu(self, size):
        if self.n_active.item() > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(self, size)

    monkeypatch.setattr(paged.StaticDecoder, "run", small_gpu)
    engine = make()
    results = run_to_end(engine, prompts, 2, 8)
    assert [[s.tokens for s in r.bases] for r in results] == [[s.tokens for s in r.bases] for r in reference]
    assert engine.stats["oom_retries"] == 2 and engine.scheduler.max_rows == 1 and engine.pool.used == 0


def test_a_paged_step_failing_at_once_under_auto_hands_over_to_the_reference(smollm_tokenizer, monkeypatch):
    """--decode_step auto on a GPU whose torch lacks what the paged step uses: its first step fails, the
    engine says so once and decodes on with the reference step over the same pool (the samples are those of
    a reference run), and later engines of the process start with the reference step."""
    tok = smollm_tokenizer
    model = tiny_model("llama", len(tok))
    sampler = R.Sampler.from_config(model, tok, _cfg(top_k=1))
    prompts = [tok(p, add_special_tokens=False).input_ids for p in PROMPTS[:2]]
    reference = run_to_end(E.Engine(model, sampler.stop_ids, sampler.warp, 8, 512), prompts, 2, 7)
    monkeypatch.setattr(paged, "DISABLED", [])

    def unsupported(*args, **kwargs):
        raise RuntimeError("flex_attention: something this torch does not have (injected)")

    monkeypatch.setattr(paged, "decode_step", unsupported)
    engine = E.Engine(model, sampler.stop_ids, sampler.warp, 8, 512, decode="paged")
    engine.decode_auto = True                         # as --decode_step auto resolves on CUDA
    results = run_to_end(engine, prompts, 2, 7)
    assert [[s.tokens for s in r.bases] for r in results] == [[s.tokens for s in r.bases] for r in reference]
    assert engine.static is None and engine.pool.used == 0 and engine.pool.page == paged.PAGE
    assert paged.DISABLED == ["RuntimeError: flex_attention: something this torch does not have (injected)"]
    from engine.loop import decode_mode

    assert decode_mode("auto", torch.device("cuda")) == "reference"


@pytest.mark.slow
def test_static_step_compiles_whole_without_graph_breaks_and_grows_generate_trees(smollm_tokenizer):
    """--compile_decode on the paged step: the whole static step (model forward, paged attention, sampling,
    the lanes' in-place updates) compiles under torch.compile(fullgraph=True) — a graph break would raise —
    and its greedy trees equal HF generate's token for token."""
    tok = smollm_tokenizer
    model = tiny_model("qwen2", len(tok))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()   # graph breaks of earlier tests in this process are not this step's
    cfg = _cfg(top_k=1, compile_decode=True)
    ours, stats = rollout(model, tok, cfg, "engine", "paged-eager")
    ref, _ = rollout(model, tok, _cfg(top_k=1), "generate")
    assert tree_tokens(ours) == tree_tokens(ref) and stats.row_steps > 0
    assert not torch._dynamo.utils.counters["graph_break"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the paged step's CUDA graphs need a CUDA GPU")
def test_paged_step_on_cuda_with_graphs_grows_generate_trees(smollm_tokenizer, monkeypatch):
    """On CUDA (bench/gpu_check.sh runs this): --decode_step paged captures one CUDA graph per bucket and
    replays it; its greedy trees equal HF generate's on the same GPU token for token (tiny model, fp32)."""
    tok = smollm_tokenizer
    model = tiny_model("qwen2", len(tok)).cuda()
    decoders, real = [], paged.StaticDecoder.__init__

    def collect(self, *args, **kwargs):
        real(self, *args, **kwargs)
        decoders.append(self)

    monkeypatch.setattr(paged.StaticDecoder, "__init__", collect)
    ours, _ = rollout(model, tok, _cfg(top_k=1), "engine", "auto")
    ref, _ = rollout(model, tok, _cfg(top_k=1), "generate")
    assert tree_tokens(ours) == tree_tokens(ref) and any(b.branch for t in ours for b in t.blocks)
    assert decoders and all(d.mode == "graph" and not d.capture_failed for d in decoders)
    assert sum(d.steps["replayed"] for d in decoders) > sum(d.steps["eager"] for d in decoders) > 0


@pytest.mark.slow
def test_bench_decode_attention_on_cpu_prints_every_candidate_equal_to_the_reference(capsys):
    """bench/bench_decode_attention.py's own code on CPU (varlen is CUDA's): each candidate's row, the
    reference eligible for SDPA's math backend, and every candidate within float32 rounding of it."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_decode_attention

    bench_decode_attention.main(["--device", "cpu"])
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ") and line.split()[0] in ("reference", "packed-gqa", "paged-flex@16",
                                                             "paged-flex@64")}
    assert set(rows) == {"reference", "packed-gqa", "paged-flex@16", "paged-flex@64"}
    assert "math" in rows["reference"][1] and float(rows["reference"][-1]) == 0
    assert all(float(r[-1]) < 1e-5 and float(r[-3]) > 0 for r in rows.values())
