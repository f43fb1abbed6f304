"""atb.py — ATB, the forking strategy of the AttnRL baseline (App. D.1; Liu et al. 2025): how much the later
steps of a response attend to each step (Forward Context Influence), from one attention-returning forward.

  step_attention    token attention of one layer reduced to steps: α[h, j, k] = mean a[h, i ∈ j, m ∈ k]
  fci_step_scores   FCI of each step: y_k = max over (layer, head) of Σ_{j ≥ k+Δ} α[j, k]
  step_scores       the model run once with eager attention, each layer reduced as it is produced

tree.step_spans cuts a response into steps (blank lines); tree.atb_tokens forks at the steps with the top
FCI scores (rollout.choose_forks calls step_scores in between). DATPO itself forks by sentence entropy and
never runs this file.
"""
from __future__ import annotations

import numpy as np
import torch


def step_attention(attention, spans: list[tuple[int, int]]):
    """Step-to-step attention α[h, j, k] = mean over tokens i ∈ step j, m ∈ step k of a[h, i, m].

    attention: [heads, n, n] token attention (query i, key m) of one layer, a NumPy array or a torch tensor
    (reduced where it lives, in float64: on the GPU only [heads, S, S] ever leaves the device); returns
    [heads, S, S] of the same kind.
    """
    n = attention.shape[-1]
    if isinstance(attention, np.ndarray):
        average = np.zeros((len(spans), n))
    else:
        attention = attention.to(torch.float64)
        average = torch.zeros(len(spans), n, dtype=torch.float64, device=attention.device)
    for s, (a, b) in enumerate(spans):
        average[s, a:b] = 1.0 / (b - a)
    return average @ attention @ average.T


def fci_step_scores(step_attn: np.ndarray, gap: int = 4) -> list[float]:
    """Forward Context Influence of each step (ATB, App. D.1; AttnRL, Liu et al. 2025).

    step_attn: [layers·heads, S, S] step-level attention (step_attention of every layer, stacked).
    y_k = max over (layer, head) of Σ_{j ≥ k+gap} α[j, k]: how much the steps at least `gap` steps later
    attend to step k. AttnRL's released code uses gap Δ = 4 (which DATPO's App. F.2 lists as "Δ = 4").
    """
    steps = step_attn.shape[-1]
    later = np.tril(np.ones((steps, steps), dtype=bool), k=-gap)       # query j ≥ key k + gap
    return (step_attn * later).sum(axis=-2).max(axis=0).tolist() if steps else []


@torch.no_grad()
def step_scores(model, prompt_ids: list[int], response_ids: list[int], spans: list[tuple[int, int]],
                gap: int = 4) -> list[float]:
    """FCI of each step of one response (fci_step_scores) from one attention-returning forward pass.

    The model runs once with eager attention (the only kind that returns weights). Each layer's
    [heads, L, L] weights are reduced to step level [heads, S, S] on the device as they are produced
    (float64), so memory holds one layer's token attention at a time and only [layers·heads, S, S] reaches
    the CPU — not ~2.4 GB of fp32 maps per 1,024-token response.
    """
    per_layer: list[torch.Tensor] = []
    p = len(prompt_ids)

    def keep(module, args, output):
        weights = output[1]
        if weights is None:
            raise RuntimeError("attention weights unavailable: ATB needs eager attention")
        per_layer.append(step_attention(weights[0, :, p:, p:], spans))

    previous = model.config._attn_implementation
    handles = [m.register_forward_hook(keep) for name, m in model.named_modules()
               if name.endswith("self_attn")]
    try:
        model.set_attn_implementation("eager")
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([prompt_ids + response_ids], device=device), logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    return fci_step_scores(torch.cat(per_layer).cpu().numpy(), gap=gap)
