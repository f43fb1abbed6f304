"""optim.py: AdamW with fp32 states (and fp32 master weights) against torch's AdamW; what pure-bf16 AdamW
does to the second moment and to small updates, computed by hand from bf16's 8 significant bits."""
import pytest
import torch

import config as C
import optim as O


def params(dtype, seed=0, n=64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(n, generator=gen) * 0.02).to(dtype)),
            torch.nn.Parameter(torch.ones(n, dtype=dtype))]


def grads(step, n=64):
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-3]


def run(optimizer, ps, steps, start=0):
    for s in range(start, start + steps):
        for p, g in zip(ps, grads(s)):
            p.grad = g.to(p.dtype)
        optimizer.step()


def test_fp32_weights_same_steps_as_torch_adamw():
    a, b = params(torch.float32), params(torch.float32)
    run(torch.optim.AdamW(a, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1), a, 20)
    run(O.AdamWFP32(b, lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1), b, 20)
    for x, y, x0 in zip(a, b, params(torch.float32)):
        assert torch.allclose(x, y, atol=1e-6, rtol=0)
        assert not torch.equal(x, x0)


@pytest.mark.parametrize("flag,expected", [("param", torch.bfloat16), ("fp32", torch.float32)])
def test_state_dtype_follows_the_flag(flag, expected):
    ps = params(torch.bfloat16)
    cfg = C.make_config("tiny", optimizer_dtype=flag)
    opt = O.build_optimizer(ps, cfg)
    run(opt, ps, 1)
    assert O.state_dtypes(opt) == {expected}
    assert ("master" in opt.state[ps[0]]) == (flag == "fp32")
    assert all(p.dtype == torch.bfloat16 for p in ps)      # the weights stay bf16 either way


def test_bad_optimizer_dtype_is_named():
    with pytest.raises(ValueError, match="--optimizer_dtype"):
        C.make_config("tiny", optimizer_dtype="fp16")


def test_small_updates_accumulate_only_with_fp32_master_weights():
    """A weight of 1.0 in bf16 moves only by a step of at least half its unit in the last place, 2^-8 (bf16
    has 8 significant bits): Adam moves it by ≈ lr = 1e-4 per step, so pure bf16 never moves it, while the
    fp32 master copy accumulates 100 steps ≈ 1e-2 and the bf16 weight follows (rounded)."""
    ones = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16)) for _ in range(2)]
    pure = torch.optim.AdamW([ones[0]], lr=1e-4, weight_decay=0.0)
    mixed = O.AdamWFP32([ones[1]], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        for p, opt in zip(ones, (pure, mixed)):
            p.grad = torch.full((8,), 0.5, dtype=torch.bfloat16)
            opt.step()
    assert torch.equal(ones[0], torch.ones(8, dtype=torch.bfloat16))
    master = mixed.state[ones[1]]["master"]
    assert master[0].item() == pytest.approx(1 - 100 * 1e-4, abs=1e-5)   # fp32 rounding near 1
    assert torch.equal(ones[1], master.to(torch.bfloat16)) and ones[1][0].item() < 1.0


def test_bf16_second_moment_never_decays():
    """v·0.999 in bf16 rounds back to v (0.999 is within half a unit of 1.0 at 8 bits, 2^-9 ≈ 0.00195), so
    after the gradients vanish pure-bf16 AdamW keeps v where it was; fp32 states decay it by 0.999 a step."""
    assert torch.equal(torch.tensor(0.37, dtype=torch.bfloat16) * 0.999,
                       torch.tensor(0.37, dtype=torch.bfloat16))
    ws = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)) for _ in range(2)]
    opts = [torch.optim.AdamW([ws[0]], lr=1e-6), O.AdamWFP32([ws[1]], lr=1e-6)]
    for step in range(51):
        for w, opt in zip(ws, opts):
            w.grad = torch.full((4,), 1.0 if step == 0 else 0.0, dtype=torch.bfloat16)
            opt.step()
    v_bf16, v_fp32 = (opt.state[w]["exp_avg_sq"][0].item() for w, opt in zip(ws, opts))
    assert v_bf16 == pytest.approx(0.001, rel=1e-2)                  # (1 − β₂)·1², never decayed
    assert v_fp32 == pytest.approx(0.001 * 0.999 ** 50, rel=1e-5)


def test_fp32_state_survives_a_checkpoint_round_trip():
    """state_dict → load_state_dict keeps the moments and master copy fp32 (torch's loader would cast them to
    bf16), and the resumed optimizer continues exactly as the uninterrupted one."""
    a, b = params(torch.bfloat16), params(torch.bfloat16)
    opt_a = O.AdamWFP32(a, lr=1e-3, weight_decay=0.01)
    run(opt_a, a, 5)
    saved = opt_a.state_dict()
    for x, y in zip(a, b):
        y.data.copy_(x.data)
    opt_b = O.AdamWFP32(b, lr=1e-3, weight_decay=0.01)
    opt_b.load_state_dict(saved)
    assert O.state_dtypes(opt_b) == {torch.float32} and opt_b.state[b[0]]["master"].dtype == torch.float32
    run(opt_a, a, 5, start=5)
    run(opt_b, b, 5, start=5)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(opt_a.state[x]["master"], opt_b.state[y]["master"])


def test_tiny_run_bf16_with_fp32_states_flex_fallback_and_injected_ooms(tmp_path, monkeypatch, capsys):
    """One tiny pure-bf16 run through train.main with --optimizer_dtype fp32, --packed_attention flex and
    DATPO_OOM_AT=branches,update: the flex probe falls back at start-up (one line) and metrics.jsonl says
    'tree'; both injected out-of-memory errors are absorbed and counted; the checkpoint holds fp32 moments
    and master copies for bf16 weights, and a resume loads them as fp32."""
    import json

    import inject
    from test_train import stand_in_reward

    import attention
    import rollout as R
    import train

    monkeypatch.setattr(R, "compute_reward", stand_in_reward)
    monkeypatch.setattr(attention, "flex_probes", {})
    flags = ["--preset", "tiny", "--precision", "bf16", "--optimizer_dtype", "fp32",
             "--packed_attention", "flex", "--steps", "1", "--out_dir", str(tmp_path / "run")]
    inject.install("branches,update", monkeypatch.setattr)   # undone after the first run
    run = train.main(flags)
    (record,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert (record["attention_kernel"] == "tree" and record["oom_retries"] == 2
            and record["optimizer_steps"] >= 1)
    assert capsys.readouterr().err.count("flex_attention cannot run here") == 1
    state = torch.load(run / "checkpoints" / "step_000001" / "trainer_state.pt",
                       weights_only=False)["optimizer"]
    moments = [v for st in state["state"].values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    masters = [st["master"] for st in state["state"].values() if "master" in st]
    assert moments and all(v.dtype == torch.float32 for v in moments) and masters
    monkeypatch.undo()
    monkeypatch.setattr(R, "compute_reward", stand_in_reward)
    monkeypatch.setattr(attention, "flex_probes", {})
    captured = {}
    real = O.build_optimizer

    def keep(params, cfg):
        captured["opt"] = real(params, cfg)
        return captured["opt"]

    monkeypatch.setattr(O, "build_optimizer", keep)
    train.main(flags[:-4] + ["--steps", "2", "--out_dir", str(tmp_path / "run"), "--resume", str(run)])
    assert O.state_dtypes(captured["opt"]) == {torch.float32}
