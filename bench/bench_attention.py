"""The packed update's three attention kernels on one packed micro-batch of paper-shaped trees, one run.

    python bench/bench_attention.py                     # CUDA: Qwen2.5-3B's width, 4 of its 36 layers, bf16
    python bench/bench_attention.py --layers 36 --budget 16384
    python bench/bench_attention.py --device cpu        # this script's own code, tiny model, CPU (no flex)

Synthetic DATPO trees of the paper's shape (bench/bench_update.synthetic_tree: prompt 150, responses ≈ 600
tokens, (N, K, B) = (4, 3, 4)) are packed into one micro-batch of at most --budget tokens (packing.pack,
depth-first, one integer per token for the tree mask). Per kernel (attention.py: flex, tree, dense): the
forward + backward of the sum of the packed log-probs through a random model of Qwen2.5-3B's shape
(bench/gpu_smoke.random_qwen25_3b, fewer layers; no hub), timed after a warm-up that compiles (median of
--repeats), its peak memory, and its difference from the dense kernel — the reference, one [L, L] boolean
mask through the model's own SDPA: the largest |Δ log-prob| and the relative L2 difference of the gradient
of layer 0's q_proj and of the embedding. Ratios dense/kernel are of one run on one machine. The reference
runs first, and each kernel's row is printed as soon as it is measured. First, one line on the update's
log-prob head (head_line): a bf16 head's forward + backward over one 2,048-target chunk through
packing.fp32_logits (a bf16 GEMM with an fp32 result) against the former path (both operands upcast, one
IEEE fp32 product), ms each and their largest |Δ log-prob|.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":   # a device part: one line naming what is missing, before anything loads
    from bench import needs
    needs.check("update")
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

import methods  # noqa: E402
import packing as P  # noqa: E402
import train  # noqa: E402
from bench.bench_update import synthetic_tree  # noqa: E402
from bench.gpu_smoke import QWEN25_3B, TINY, random_qwen25_3b  # noqa: E402


def packed_batch(budget: int, vocab: int, seed: int = 0) -> P.Packed:
    """The first micro-batch of --budget tokens over 16 paper-shaped DATPO trees, random ±1 advantages."""
    rng = random.Random(seed)
    trees = [synthetic_tree(rng, 150, 600, 4, 3, 4, vocab) for _ in range(16)]
    datpo = methods.METHODS["datpo"]
    tts = [train.train_tree(tr, [rng.choice((-1.0, 1.0)) for _ in tr.blocks], datpo) for tr in trees]
    units = [(t, tuple(range(len(tt.tokens)))) for t, tt in enumerate(tts)]
    items = P.micro_batches(tts, units, budget)[0]
    return P.pack(tts, items, P.token_offsets(tts))


def forward_backward(model, packed: P.Packed, device, kernel: str, budget: int):
    """(log-probs, gradients of the watched weights) of one forward + backward under `kernel`."""
    model.zero_grad(set_to_none=True)
    logprobs = P.packed_logprobs(model, packed, device, kernel=kernel, bucket_tokens=budget)
    logprobs.float().sum().backward()
    watched = (model.model.layers[0].self_attn.q_proj.weight, model.model.embed_tokens.weight)
    return logprobs.detach().float(), [w.grad.detach().float().clone() for w in watched]


def head_line(model, device, tokens: int, repeats: int) -> str:
    """The update's log-prob head, packing.target_logprobs, on `tokens` random bf16 hidden states and the
    model's lm_head in bf16: forward + backward through packing.fp32_logits (HalfLogits) against the former
    arithmetic (both operands upcast to fp32, one IEEE product), median ms of each, max |Δ log-prob|."""
    import types

    cuda = device.type == "cuda"
    weight = model.get_output_embeddings().weight.detach().to(torch.bfloat16).requires_grad_()
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, weight.shape[1], generator=gen).to(device, torch.bfloat16).requires_grad_()
    targets = torch.randint(0, weight.shape[0], (tokens,), generator=gen).to(device)
    head = types.SimpleNamespace(weight=weight, bias=None)
    former = types.SimpleNamespace(weight=weight.float(), bias=None)    # fp32_logits' upcast path
    results = {}
    for name, module in (("bf16", head), ("former", former)):
        seconds = []
        for _ in range(repeats + 1):                                    # the first is a warm-up
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            logprobs = P.target_logprobs(module, hidden, targets)
            logprobs.sum().backward()
            if cuda:
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        results[name] = (statistics.median(seconds[1:]) * 1e3, logprobs.detach())
    diff = (results["bf16"][1] - results["former"][1]).abs().max().item()
    kernel = "bf16 GEMM, fp32 result" if P.fp32_out_matmul(device.type) else "upcast (no bf16→fp32 GEMM here)"
    return (f"  log-prob head, {tokens} targets × vocab {weight.shape[0]}, forward + backward: bf16 "
            f"({kernel}) {results['bf16'][0]:.1f} ms, former fp32 upcast {results['former'][0]:.1f} ms "
            f"(former/bf16 {results['former'][0] / results['bf16'][0]:.1f}); max |Δ log p| {diff:.1e}")


def measure(model, packed, device, kernel: str, budget: int, repeats: int) -> dict:
    cuda = device.type == "cuda"
    forward_backward(model, packed, device, kernel, budget)                       # warm-up (compiles flex)
    seconds = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        logprobs, grads = forward_backward(model, packed, device, kernel, budget)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0
    return dict(seconds=statistics.median(seconds), peak=peak, logprobs=logprobs, grads=grads)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="of Qwen2.5-3B's 36")
    parser.add_argument("--budget", type=int, default=8192, help="tokens per packed micro-batch")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--kernels", nargs="+", default=["flex", "tree", "dense"],
                        choices=["flex", "tree", "dense"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (runtime/threads.py)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: a 2-layer model of the same family on CPU, tree and dense only (tests)")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        device, shape, kernels = torch.device("cpu"), TINY, [k for k in args.kernels if k != "flex"]
        dtype = torch.float32
    elif not torch.cuda.is_available():
        print("bench/bench_attention.py needs a CUDA GPU (or --device cpu); nothing was run.")
        return
    else:
        device, kernels = torch.device("cuda"), args.kernels
        shape = dict(QWEN25_3B, num_hidden_layers=args.layers)
        dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = random_qwen25_3b(dtype, device, shape=shape).train()
    packed = packed_batch(args.budget, shape["vocab_size"])
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}; random Qwen2.5-3B-shaped model, {shape['num_hidden_layers']} "
          f"layers, {dtype}; one packed micro-batch of {len(packed)} tokens (budget {args.budget}), "
          f"{len(packed.target_ids)} targets", flush=True)
    cuda = device.type == "cuda"
    print(head_line(model, device, 2048 if cuda else 16, 3 if cuda else 1), flush=True)
    print(f"  {'kernel':<7}{'fwd+bwd s':>11}{'dense/kernel':>14}{'peak GB':>9}{'max |Δ logp|':>14}"
          f"{'Δ grad q_proj':>15}{'Δ grad embed':>14}", flush=True)
    ref = None
    # the reference first, flex (whose first call compiles) last
    for kernel in sorted(kernels, key=lambda k: ("dense", "tree", "flex").index(k)):
        r = measure(model, packed, device, kernel, args.budget, args.repeats)
        ref = r if kernel == "dense" else ref
        if ref is None:
            diffs = ["-", "-", "-"]
        else:
            diffs = [f"{(r['logprobs'] - ref['logprobs']).abs().max().item():.2e}"]
            diffs += [f"{((g - h).norm() / h.norm().clamp_min(1e-30)).item():.2e}"
                      for g, h in zip(r["grads"], ref["grads"])]
        speed = f"{ref['seconds'] / r['seconds']:.2f}" if ref else "-"
        print(f"  {kernel:<7}{r['seconds']:>11.3f}{speed:>14}{r['peak']:>9.1f}{diffs[0]:>14}{diffs[1]:>15}"
              f"{diffs[2]:>14}", flush=True)

if __name__ == "__main__":
    main()
