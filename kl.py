"""A KL penalty to a reference policy (TRL's `beta`), off by default: the paper trains without one.

DATPO's objective (Eq. DATPO, Sec. 4.3) has no KL term, as DAPO and Dr.GRPO drop it. GRPO as first
written (DeepSeekMath, Eq. 3) subtracts β·D_KL[π_θ || π_ref] per token, estimated with Schulman's k3,
    k3 = π_ref/π_θ − log(π_ref/π_θ) − 1  (≥ 0, unbiased for KL(π_θ || π_ref) on samples of π_θ),
and TRL's GRPOTrainer keeps it behind `beta`. With --kl_beta β > 0 the harness loads the initial policy
again as π_ref (frozen), ppo_update takes its log-probs once per step (no grad, the update's packing:
train.fixed_logprobs), and each token's objective is min(ρA, clip(ρ)A) − β·k3 (penalty); the step's
mean k3 over the tokens the loss saw is logged as `kl`, as TRL logs it. With β = 0 no second model is
loaded and no `kl` is logged. One difference from TRL: a block whose advantage is 0 is not forwarded
in the update (it would add nothing to the clipped objective), so its tokens carry no KL term either.
"""
from __future__ import annotations

import torch


def k3(new_logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(π_θ || π_ref): exp(r) − r − 1 with r = log π_ref − log π_θ."""
    r = ref_logp - new_logp
    return torch.exp(r) - r - 1.0


def penalty(objective: torch.Tensor, new_logp: torch.Tensor, ref_logp: torch.Tensor | None, at,
            beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The objective less β·k3 per token against π_ref's log-probs (`ref_logp[at]`), and the sum of k3
    over these tokens (float64, for the logged mean `kl`); with no reference (β = 0): the objective as it
    is, and 0."""
    if ref_logp is None:
        return objective, new_logp.new_zeros((), dtype=torch.float64)
    k = k3(new_logp, ref_logp[at])
    return objective - beta * k, k.detach().sum().double()


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """π_ref: eval mode (no dropout), no gradients."""
    model.eval()
    model.requires_grad_(False)
    return model
