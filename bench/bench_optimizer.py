"""What pure-bf16 AdamW (the release, --optimizer_dtype param) does to the second moment and to small updates,
against fp32 moments (with and without an fp32 master copy, --optimizer_dtype fp32) — README "Decisions".

    python bench/bench_optimizer.py                       # 2,000 steps, lr 5e-6 (App. F.2)
    python bench/bench_optimizer.py --steps 500 --numel 65536

One synthetic tensor per kind of weight, bf16, trained by AdamW from the same start with the same gradients
in every variant: "linear" weights ~ N(0, 0.02²) (a 3B model's matrices), "norm" gains = 1.0 (RMSNorm). The
gradients are Gaussian whose scale changes from step to step (log-normal, σ = 1: RL gradients are far from
stationary), the regime where a second moment that cannot decay matters. The reference is AdamW on fp32
copies of the weights (fp32 everything). Printed per variant and kind, after the given steps:
  v / v_ref        mean second moment relative to the reference (1.00 = right)
  v·β₂ == v        share of elements whose second moment does not change when multiplied by β₂ (one step)
  moved            share of bf16 weights (what the model computes with) that differ from their start
  Δw error         |Δw − Δw_ref| / |Δw_ref| over the tensor, Δw = the optimizer's weight (the fp32 master
                   copy where there is one, else the bf16 weight) now − at the start
Everything is measured in one run; the numbers do not depend on the machine (no timings).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

import optim as O  # noqa: E402

VARIANTS = {
    "pure bf16 (release, param)": lambda p, a: torch.optim.AdamW(p, **a),
    "fp32 moments, bf16 weights": lambda p, a: O.AdamWFP32(p, master_weights=False, **a),
    "fp32 moments + master (fp32)": lambda p, a: O.AdamWFP32(p, master_weights=True, **a),
}


def start_weights(numel: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"linear": (torch.randn(numel, generator=gen) * 0.02).to(torch.bfloat16).float(),
            "norm": torch.ones(numel)}


def measure(steps: int, numel: int, lr: float, weight_decay: float, seed: int) -> list[dict]:
    start = start_weights(numel, seed)
    args = dict(lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay)
    ref = {k: torch.nn.Parameter(w.clone()) for k, w in start.items()}
    runs = {name: {k: torch.nn.Parameter(w.to(torch.bfloat16)) for k, w in start.items()}
            for name in VARIANTS}
    opts = {"ref": torch.optim.AdamW(list(ref.values()), **args)}
    opts.update({name: make(list(runs[name].values()), args) for name, make in VARIANTS.items()})
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        scale = float(torch.exp(torch.randn(1, generator=gen))) * 1e-3
        g = {k: torch.randn(numel, generator=gen) * scale for k in start}
        for k in start:
            ref[k].grad = g[k].clone()
            for name in VARIANTS:
                runs[name][k].grad = g[k].to(torch.bfloat16)
        for opt in opts.values():
            opt.step()
    rows = []
    for name in VARIANTS:
        for k in start:
            p, r = runs[name][k], ref[k]
            v = opts[name].state[p]["exp_avg_sq"]
            v_ref = opts["ref"].state[r]["exp_avg_sq"]
            kept = opts[name].state[p].get("master", p).detach().float()   # the weight the optimizer keeps
            dw, dw_ref = kept - start[k], r.detach() - start[k]
            rows.append({"variant": name, "kind": k,
                         "v_ratio": float(v.float().mean() / v_ref.mean()),
                         "no_decay": float((v * 0.999 == v).float().mean()),
                         "moved": float((p.detach().float() != start[k]).float().mean()),
                         "dw_error": float((dw - dw_ref).norm() / dw_ref.norm())})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 2000])
    parser.add_argument("--numel", type=int, default=1 << 16)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"AdamW lr {args.lr}, betas (0.9, 0.999), weight decay {args.weight_decay}, {args.numel} elements "
          f"per kind; reference: fp32 weights and moments")
    print(f"{'steps':>6} {'variant':<30} {'kind':<7} {'v/v_ref':>8} {'v·β₂==v':>8} {'moved':>7} "
          f"{'Δw error':>9}")
    for steps in args.steps:
        for r in measure(steps, args.numel, args.lr, args.weight_decay, args.seed):
            print(f"{steps:>6} {r['variant']:<30} {r['kind']:<7} {r['v_ratio']:>8.3f} {r['no_decay']:>8.1%} "
                  f"{r['moved']:>7.1%} {r['dw_error']:>9.3f}")


if __name__ == "__main__":
    main()
