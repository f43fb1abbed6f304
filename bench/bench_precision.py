"""How far does one AdamW step at the paper's lr move the weights, under each precision? (README "Decisions")

    python bench/bench_precision.py                 # tiny random model and the demo model (SmolLM2-135M)
    python bench/bench_precision.py --models tiny-random --lr 5e-6

The authors' release trains pure bf16 weights with plain AdamW (bf16 optimizer states) at lr 5e-6
(App. F.2). Adam's first step moves every weight with a non-zero gradient by about lr, but a bf16 weight w
only changes when the update reaches half a unit in its last place, |w|·2^-9: at lr 5e-6 that needs
|w| < ~2.6e-3, so most updates round to zero. With fp32 master weights (--precision bf16-autocast / fp32)
every such weight moves. This script runs one identical training step (same batch: a prompt and one sampled
response trained with advantage +1, the token-level loss of train.py) from the same initial weights under
each precision and prints, per model, the fraction of parameters that changed and the size of the change.
Everything is measured in one run, so the ratios hold on a contended machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

import data  # noqa: E402
import models  # noqa: E402

PRECISIONS = ("bf16", "bf16-autocast", "fp32")


def batch_for(tokenizer, n_problems: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt + a fixed worked answer per problem (a stand-in for a sampled response with advantage +1):
    ids [n, L] right-padded, and a mask of the target tokens."""
    problems = data.make_arithmetic(n_problems, seed=0)
    seqs, targets = [], []
    for p in problems:
        prompt = tokenizer(data.format_prompt(p["problem"], style="release"),
                           add_special_tokens=False).input_ids
        answer = tokenizer(f"We compute {p['problem']} The answer is \\boxed{{{p['answer']}}}.",
                           add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        targets.append([0] * len(prompt) + [1] * len(answer))
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(seqs), width))
    for i, (s, t) in enumerate(zip(seqs, targets)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(t)] = torch.tensor(t, dtype=torch.float)
    return ids, mask


def one_step(model, ids, mask, precision: str, lr: float) -> dict:
    """One forward/backward/AdamW step as train.py does it under `precision`; returns what changed."""
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    model.train()
    with models.autocast(ids.device, precision):
        logits = model(input_ids=ids).logits[:, :-1].float()       # right padding: masked out of the loss
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    target = mask[:, 1:]
    loss = -(logp * target).sum() / target.sum()          # token-level policy-gradient loss, advantage +1
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with_grad = sum(int((p.grad != 0).sum()) for p in model.parameters() if p.grad is not None)
    optimizer.step()
    total = changed = 0
    sq_change = 0.0
    for p, old in zip(model.parameters(), before):
        diff = p.detach().float() - old.float()
        total += diff.numel()
        changed += int((diff != 0).sum())
        sq_change += float((diff ** 2).sum())
    return {"params": total, "with_grad": with_grad, "changed": changed, "l2_change": sq_change ** 0.5}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m"])
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = {}
    for name in args.models:
        t0 = time.perf_counter()
        reference, tokenizer = models.load_policy(name, "cpu", torch.float32, seed=0)
        ids, mask = batch_for(tokenizer)
        state = {k: v.clone() for k, v in reference.state_dict().items()}
        print(f"{name}: {sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M parameters, one step at "
              f"lr {args.lr:g} on {ids.shape[0]} sequences of ≤ {ids.shape[1]} tokens", flush=True)
        for precision in PRECISIONS:
            model = reference
            model.load_state_dict(state)
            model = model.to(models.policy_dtype(precision))
            torch.manual_seed(0)
            r = one_step(model, ids, mask, precision, args.lr)
            results[(name, precision)] = r
            print(f"  {precision:14s} changed {r['changed'] / r['params']:7.2%} of all parameters "
                  f"({r['changed'] / max(r['with_grad'], 1):7.2%} of those with a non-zero gradient); "
                  f"‖Δθ‖₂ = {r['l2_change']:.3e}", flush=True)
            model.to(torch.float32)
        bf16, fp32 = results[(name, "bf16")], results[(name, "bf16-autocast")]
        print(f"  fp32 master weights (bf16-autocast) vs pure bf16: "
              f"{fp32['changed'] / max(bf16['changed'], 1):.0f}× as many parameters changed, "
              f"‖Δθ‖ {fp32['l2_change'] / max(bf16['l2_change'], 1e-30):.1f}× larger "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return results


if __name__ == "__main__":
    main()
