"""optim.py — the optimizer: AdamW with its states in the weights' dtype (the release) or in fp32.

App. F.2 trains with AdamW at a constant lr 5e-6. The authors' release keeps pure bf16 weights and runs
torch's AdamW on them, so its moments are bf16 too (`--optimizer_dtype param`, what the paper's presets run).
bench/bench_optimizer.py measures what that does (README "Decisions"): in bf16, v·β₂ = v·0.999 rounds back to
v (bf16 keeps 8 significant bits, 0.999 is within half a unit of 1), so the second moment never decays and
only grows; an update smaller than half a unit in the last place of a weight (|w|·2⁻⁹) rounds away, so at
lr 5e-6 weights near 1 (RMSNorm gains) never move and weight decay does nothing.

`--optimizer_dtype fp32` keeps, for every low-precision weight, fp32 moments and an fp32 master copy the
update is applied to (the bf16 weight is the master rounded once per step, so small updates accumulate instead
of rounding away): 14 bytes per parameter instead of 6 (bf16 weight + two bf16 moments). fp32 weights need no
master copy and then both options are torch's AdamW, to rounding.
"""
from __future__ import annotations

import math
from itertools import chain

import torch

OPTIMIZER_DTYPES = ("param", "fp32")   # AdamW states in the weights' dtype (the release) | fp32 (AdamWFP32)
LR_SCHEDULES = ("constant", "linear", "cosine")   # --lr_schedule after the warmup (lr_at)


class AdamWFP32(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, Loshchilov & Hutter; torch.optim.AdamW's update, no amsgrad) whose
    moments are fp32 whatever the weights' dtype, with an fp32 master copy of each non-fp32 weight when
    `master_weights` (the update is applied there, then the weight is set to it, rounded).

    The per-parameter state (step, exp_avg, exp_avg_sq, master) is ordinary optimizer state, so
    state_dict / load_state_dict (and distributed.optimizer_state_dict) save and restore it; loading keeps it
    fp32 (torch's Optimizer.load_state_dict would cast it to the weights' dtype)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, master_weights: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      master_weights=master_weights))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    if group["master_weights"] and p.dtype != torch.float32:
                        state["master"] = p.detach().to(torch.float32, copy=True)
                weight = state.get("master", p)
                grad = p.grad.to(torch.float32)
                # not in place: a loaded state_dict may share the tensor
                state["step"] = state["step"] + 1
                step = float(state["step"])
                weight.mul_(1 - lr * wd)
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** step, 1 - beta2 ** step
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias2)).add_(eps)
                if weight is p and p.dtype != torch.float32:      # fp32 moments, no master: round once
                    p.copy_(p.float().addcdiv_(state["exp_avg"], denom, value=-lr / bias1))
                else:
                    weight.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)
                    if weight is not p:
                        p.copy_(weight)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        saved = state_dict["state"]
        ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        keep = {i: {k: v for k, v in saved[i].items() if k != "step" and torch.is_tensor(v)}
                for i in ids if i in saved}
        super().load_state_dict(state_dict)
        for i, p in zip(ids, params):
            for key, value in keep.get(i, {}).items():
                self.state[p][key] = value.to(device=value.device if p.is_meta else p.device,
                                              dtype=torch.float32, copy=True)


def build_optimizer(params, cfg) -> torch.optim.Optimizer:
    """The run's AdamW (App. F.2: lr, betas, weight decay from cfg): `cfg.optimizer_dtype` param = torch's
    AdamW, states in the weights' dtype (the release: bf16 states for bf16 weights); fp32 = AdamWFP32 with
    fp32 states and fp32 master copies of low-precision weights."""
    if cfg.optimizer_dtype == "param":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                                 weight_decay=cfg.weight_decay)
    if cfg.optimizer_dtype != "fp32":
        raise ValueError(f"--optimizer_dtype: got {cfg.optimizer_dtype!r}, expected one of "
                         f"{', '.join(OPTIMIZER_DTYPES)}")
    return AdamWFP32(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def state_dtypes(optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    """The dtypes of the optimizer's moment tensors (exp_avg, exp_avg_sq)."""
    return {v.dtype for st in optimizer.state.values() for k, v in st.items()
            if k in ("exp_avg", "exp_avg_sq")}


# --------------------------------------------------------------------------------------------------------
# The learning-rate schedule (--lr_schedule, --warmup_ratio). App. F.2 trains at a constant lr, the default.
# The schedule is a function of the training step (one rollout and its update), as verl steps its scheduler
# once per training step; the harness sets it before each step (schedule_lr), so every optimizer step of a
# step's PPO epochs uses the same lr and a resumed run needs no scheduler state (run.step is enough).
# --------------------------------------------------------------------------------------------------------
def lr_at(step: int, lr: float, steps: int, schedule: str = "constant", warmup_ratio: float = 0.0) -> float:
    """The lr of training step `step` (0-based) of a run of `steps` steps: a linear warmup over the first
    W = ⌈warmup_ratio·steps⌉ steps, step t < W training at lr·(t+1)/(W+1) (HF's ramp lr·t/W would spend the
    first rollout at lr 0), then with p = (t − W)/(steps − W) in [0, 1): constant lr, linear lr·(1 − p), or
    cosine lr·(1 + cos πp)/2 (HF's get_cosine_schedule_with_warmup, one half-cycle)."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr_schedule: got {schedule!r}, expected one of {', '.join(LR_SCHEDULES)}")
    warmup = math.ceil(warmup_ratio * steps)
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, steps - warmup)
    if schedule == "linear":
        return lr * (1.0 - progress)
    if schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr


def schedule_lr(optimizer: torch.optim.Optimizer, cfg, step: int) -> dict:
    """When the lr varies over the run (--lr_schedule other than constant, or a warmup): set every parameter
    group's lr to lr_at(step) before training step `step` (0-based) and return {"lr": value} for the step's
    metrics record. At a constant lr (the paper) the optimizer is left as it was built and {} is returned:
    its records and updates stay exactly as they were."""
    if cfg.lr_schedule == "constant" and not cfg.warmup_ratio:
        return {}
    lr = lr_at(step, cfg.lr, cfg.steps, cfg.lr_schedule, cfg.warmup_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return {"lr": lr}
