"""ATB's attention reduced to step level where it is computed (atb.step_scores, atb.step_attention):
the FCI scores equal the former path, which copied each layer's token attention to NumPy and reduced it
there."""
import numpy as np
import pytest
import torch

import atb


def test_step_attention_torch_equals_numpy():
    gen = torch.Generator().manual_seed(0)
    att = torch.rand(3, 9, 9, generator=gen)
    spans = [(0, 2), (2, 3), (3, 7), (7, 9)]
    got = atb.step_attention(att, spans)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64 and got.shape == (3, 4, 4)
    assert np.allclose(got.numpy(), atb.step_attention(att.numpy().astype(np.float64), spans),
                       rtol=1e-12, atol=0)
    assert got[1, 2, 0].item() == pytest.approx(att[1, 3:7, 0:2].double().mean().item())   # by hand


def numpy_atb_scores(model, prompt_ids, response_ids, spans, gap):
    """The former path: every layer's [heads, R, R] fp32 weights copied to NumPy, reduced there."""
    per_layer, p = [], len(prompt_ids)

    def keep(module, args, output):
        per_layer.append(atb.step_attention(output[1][0, :, p:, p:].float().cpu().numpy().astype(np.float64),
                                          spans))

    handles = [m.register_forward_hook(keep) for n, m in model.named_modules() if n.endswith("self_attn")]
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation("eager")
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt_ids + response_ids]), logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(previous)
    return atb.fci_step_scores(np.concatenate(per_layer, axis=0), gap=gap)


def test_atb_scores_equal_the_former_cpu_reduction(tiny_policy):
    model, tok = tiny_policy
    prompt = tok("What is 3 + 4?", add_special_tokens=False).input_ids
    gen = torch.Generator().manual_seed(1)
    response = torch.randint(10, 1000, (40,), generator=gen).tolist()
    spans = [(0, 5), (5, 12), (12, 13), (13, 25), (25, 31), (31, 40)]
    with torch.no_grad():
        ours = atb.step_scores(model, prompt, response, spans, gap=2)
    ref = numpy_atb_scores(model, prompt, response, spans, gap=2)
    assert len(ours) == len(spans) and any(s > 0 for s in ours)
    assert np.allclose(ours, ref, rtol=1e-12, atol=1e-15)
    assert model.config._attn_implementation == "sdpa"
