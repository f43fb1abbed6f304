"""The engine's decode attention, candidate by candidate, on one layer of Qwen2.5-3B's shape: which kernel
each takes, its time per call, and its difference from the reference.

    python bench/bench_decode_attention.py                        # CUDA: 64 and 256 rows, bf16
    python bench/bench_decode_attention.py --rows 64 --context 1280
    python bench/bench_decode_attention.py --device cpu           # this script's own code, small, CPU

One decode token per row (query [rows, 16, 1, 128], keys/values of 2 KV heads) attending over `--context`
tokens per row that live in a KV pool in 1-token slots (the reference) or 16-token pages (the paged step),
the rows' slots shuffled through the pool as a long run leaves them. Candidates (issue 37):
  reference     engine/kv.engine_attention: gather each row's slots (pool[read]), SDPA with a boolean mask
                and enable_gqa — and which SDPA backends accept that call (on CUDA: only math)
  packed-gqa    the same gather, the GQA group packed into the query ([rows, H_kv, G, d]) and an additive
                float mask: SDPA's memory-efficient kernel is eligible (no enable_gqa)
  paged-flex@P  engine/paged.paged_attention: FlexAttention (compiled) over the pool's pages of P tokens
                (--pages) through the block table, no gather — what --decode_step paged runs (P = 64)
  varlen-paged  torch.nn.attention.varlen.varlen_attn with block_table / seqused_k (flash; CUDA only) over
                pages of --varlen_page tokens, where this torch has it (its flash kernel may refuse small
                pages: the error is printed); where it has not (torch 2.11's takes none of block_table,
                seqused_k, enable_gqa) its row says which are missing
Per candidate: the SDPA backends it is eligible for (reference, packed-gqa), milliseconds per call (median of
--repeats after a warm-up that compiles), the KV bytes a call must read at least (the rows' contexts once)
over that time, and the largest |Δ| from the reference output.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":   # a device part: one line naming what is missing, before anything loads
    from bench import needs
    needs.check("attention")
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

from engine import kv, paged  # noqa: E402


def setup(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, dtype, device, pages=(64,),
          seed: int = 0):
    """Query, the new token's key/value, and the same contexts laid out in a 1-token-slot pool (the
    reference's) and in a pool of each page size (the paged step's), all with shuffled placement."""
    gen = torch.Generator().manual_seed(seed)
    cfg = types.SimpleNamespace(num_key_value_heads=kv_heads, num_attention_heads=heads,
                                hidden_size=heads * head_dim, num_hidden_layers=1, head_dim=head_dim)
    model = types.SimpleNamespace(config=cfg)
    pools = [kv.KVPool(model, rows * (context + 1), device, dtype)]
    pools += [kv.KVPool(model, rows * (context + page), device, dtype, page=page, scratch=True)
              for page in pages]
    values = torch.randn(rows, context, 2, kv_heads, head_dim, generator=gen).to(device, dtype)
    contexts = []
    for pool in pools:
        pool.free = torch.randperm(pool.pages, generator=gen).tolist()   # rows scattered over the pool
        contexts.append([])
        for r in range(rows):
            row = []
            pool.extend(row, context)
            pool.layers[0][torch.tensor(row, device=device)] = values[r]
            pool.extend(row, 1)                                        # the new token's slot
            contexts[-1].append(row)
    query = torch.randn(rows, heads, 1, head_dim, generator=gen).to(device, dtype)
    key, value = (torch.randn(rows, kv_heads, 1, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    return pools, contexts, query, key, value


def reference(slot_pool, slot_rows, query, key, value, scale):
    step, _ = kv.step_kv(slot_pool, slot_rows, 1)
    return lambda: kv.engine_attention(types.SimpleNamespace(layer_idx=0), query, key, value, None, scale,
                                       engine_kv=step)[0], step


def packed_gqa(slot_pool, step, query, key, value, scale):
    """The gather, then SDPA with the GQA group in the query and an additive mask (no enable_gqa)."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    bias = torch.zeros(step.mask.shape, dtype=query.dtype, device=query.device)
    bias = bias.masked_fill(~step.mask, float("-inf"))
    packed = query.view(rows, kv_heads, heads // kv_heads, dim)        # head k × G + g: HF's repeat_kv order

    def call():
        pool = slot_pool.layers[0]
        pool[step.write] = torch.stack((key, value), dim=1).permute(0, 3, 1, 2, 4).to(pool.dtype)
        context = pool[step.read]                                      # [rows, T, 2, H_kv, d]
        keys, values = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=bias,
                                                               scale=scale)
        return out.reshape(rows, heads, 1, dim).transpose(1, 2)
    return call, bias, packed


def paged_flex(page_pool, page_rows, query, key, value, scale):
    table, logical, lengths = paged.lane_tables(page_pool, page_rows, query.shape[0], query.device)
    pos = lengths - 1
    write = table.gather(1, (pos // page_pool.page)[:, None].long())[:, 0].long() * page_pool.page \
        + pos % page_pool.page
    step = paged.PagedKV(page_pool, write, paged.block_mask(table, lengths, logical, page_pool.page,
                                                            page_pool.layers[0].shape[0]))
    return lambda: paged.paged_attention(types.SimpleNamespace(layer_idx=0), query, key, value, None, scale,
                                         engine_kv=step)[0]


VARLEN_NEEDS = ("block_table", "seqused_k", "enable_gqa")


def varlen_missing() -> str:
    """Why varlen-paged cannot run on this torch ('' when it can): no varlen_attn, or the parameters of
    VARLEN_NEEDS it lacks."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn"
    import inspect

    params = inspect.signature(varlen_attn).parameters
    lacking = [name for name in VARLEN_NEEDS if name not in params]
    return f"torch {torch.__version__}'s varlen_attn has no {', '.join(lacking)}" if lacking else ""


def varlen_paged(rows_context: list[list[int]], values_of, query, key, value, scale, page: int):
    """varlen_attn over pages of `page` tokens (CUDA flash); only where varlen_missing() is ''."""
    from torch.nn.attention.varlen import varlen_attn

    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    lengths = [len(c) + 1 for c in rows_context]
    per_row = max(-(-n // page) for n in lengths)
    k_pages = torch.zeros(rows * per_row, page, kv_heads, dim, dtype=query.dtype, device=query.device)
    v_pages = torch.zeros_like(k_pages)
    table = torch.arange(rows * per_row, dtype=torch.int32, device=query.device).view(rows, per_row)
    for r, n in enumerate(lengths):
        k_flat, v_flat = k_pages[r * per_row:(r + 1) * per_row].flatten(0, 1), \
            v_pages[r * per_row:(r + 1) * per_row].flatten(0, 1)
        context = values_of(r)                                           # [n - 1, 2, H_kv, d]
        k_flat[:n - 1], v_flat[:n - 1] = context[:, 0], context[:, 1]
        k_flat[n - 1], v_flat[n - 1] = key[r, :, 0], value[r, :, 0]
    cu_q = torch.arange(rows + 1, dtype=torch.int32, device=query.device)
    used = torch.tensor(lengths, dtype=torch.int32, device=query.device)
    q = query[:, :, 0]                                                   # [rows, H, d]: one token per row

    def call():
        out = varlen_attn(q, k_pages, v_pages, cu_q, None, 1, max(lengths), scale=scale, enable_gqa=True,
                          seqused_k=used, block_table=table)
        return out[:, None]                                              # [rows, 1, H, d]
    return call


def eligible(call_with_backend) -> str:
    """The SDPA backends that accept the call (sdpa_kernel with one backend raises where it cannot run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                call_with_backend()
            names.append(backend.name.lower().replace("_attention", ""))
        except RuntimeError:
            pass
    return ",".join(names) or "none"


def timed(call, repeats: int, device) -> float:
    call()                                                               # warm-up (compiles flex)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(rows: int, context: int, args, device, dtype) -> None:
    """Prints the table of one shape, each candidate's row as soon as it is measured."""
    heads, kv_heads, dim = args.heads, args.kv_heads, args.head_dim
    pools, contexts, query, key, value = setup(rows, context, heads, kv_heads, dim, dtype, device, args.pages)
    slot_pool, slot_rows = pools[0], contexts[0]
    scale = dim ** -0.5
    ref_call, step = reference(slot_pool, slot_rows, query, key, value, scale)
    kv_bytes = rows * (context + 1) * 2 * kv_heads * dim * torch.finfo(dtype).bits // 8
    print(f"rows {rows}, context {context}, heads {heads}/{kv_heads}, head_dim {dim}, {dtype}; "
          f"KV read at least {kv_bytes / 1e6:.1f} MB per call", flush=True)
    print(f"  {'candidate':<15} {'SDPA backends':<26} {'ms/call':>9} {'GB/s':>8} {'max |Δ|':>10}", flush=True)
    with torch.no_grad():
        expected = ref_call()
        packed_call, _, _ = packed_gqa(slot_pool, step, query, key, value, scale)
        calls = {"reference": lambda: (ref_call, eligible(ref_call)),
                 "packed-gqa": lambda: (packed_call, eligible(packed_call))}
        for page, pool, page_rows in zip(args.pages, pools[1:], contexts[1:]):
            calls[f"paged-flex@{page}"] = (lambda pool=pool, page_rows=page_rows:
                                           (paged_flex(pool, page_rows, query, key, value, scale), "-"))
        why_not = varlen_missing() or ("" if device.type == "cuda" else "flash varlen is CUDA's")
        if not why_not:
            layer = slot_pool.layers[0]
            calls["varlen-paged"] = lambda: (varlen_paged(
                [r[:-1] for r in slot_rows], lambda r: layer[torch.tensor(slot_rows[r][:-1], device=device)],
                query, key, value, scale, args.varlen_page), "-")
        for name, make in calls.items():
            try:
                call, backends = make()
                ms = timed(call, args.repeats, device)
                diff = (call().float() - expected.float()).abs().max().item()
                line = f"  {name:<15} {backends:<26} {ms:>9.3f} {kv_bytes / ms / 1e6:>8.1f} {diff:>10.2e}"
            except Exception as err:   # e.g. a page size the kernel refuses: say so, go on
                line = (f"  {name:<15} {'-':<26} failed: {type(err).__name__}: "
                        f"{str(err).splitlines()[0][:150] if str(err) else ''}")
            print(line, flush=True)
        if why_not:
            print(f"  {'varlen-paged':<15} {'-':<26} unavailable: {why_not}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1280],
                        help="tokens each row reads (the paper: prompt ≤ 256 + up to 1,024 new)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv_heads", type=int, default=2)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--pages", type=int, nargs="+", default=[16, 64], help="paged-flex's page sizes")
    parser.add_argument("--varlen_page", type=int, default=256, help="varlen-paged's page size")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (runtime/threads.py)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: this script's own code on CPU, small (4 rows, 40 tokens, 4/2 heads of 16)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.rows, args.context, args.repeats = [4], [40], 2
        args.heads, args.kv_heads, args.head_dim = 4, 2, 16
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("bench/bench_decode_attention.py times CUDA kernels and there is no CUDA GPU here; "
              "--device cpu runs its own code on the CPU")
        return
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    for rows in args.rows:
        for context in args.context:
            run(rows, context, args, device, dtype)


if __name__ == "__main__":
    main()
