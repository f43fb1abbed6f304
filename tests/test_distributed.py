"""runtime/distributed.py: sharding arithmetic in one process, and 2-process CPU runs under torchrun (gloo)
compared with one process: a PPO update with FSDP2 and with DDP, sharded evaluation, and a tiny run that
checkpoints and resumes on 2 ranks and on 1 (tests/dist_worker.py is the rank side)."""
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import models
import rollout as R
import train
from runtime import distributed as D

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_worker as W  # noqa: E402
from fault_injection import folder_hash, run_cli  # noqa: E402
from test_evaluate_folders import refused as evaluate_refused  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")


def torchrun(*args: str, timeout: int = 240) -> float:
    """Run the worker on 2 CPU processes; returns the wall seconds (shown with -s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           "2", str(WORKER), *args], capture_output=True, text=True, timeout=timeout, env=env)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, f"torchrun {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    print(f"2-process {args[0]}: {seconds:.1f} s wall")
    return seconds


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits): 2^(floor(log2 |x|) - 7)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7)


# --------------------------------------------------------------------------------------------------------
# One process: the arithmetic of shares, and the helpers are no-ops
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,world", [(0, 2), (1, 2), (5, 2), (16, 8), (7, 3), (3, 4)])
def test_shard_ranges_cover_the_items_once_in_order_and_differ_by_at_most_one(n, world):
    shards = [D.shard_range(n, r, world) for r in range(world)]
    assert [i for lo, hi in shards for i in range(lo, hi)] == list(range(n))
    sizes = [hi - lo for lo, hi in shards]
    assert max(sizes) - min(sizes) <= 1


def test_micro_batches_are_dealt_round_robin_and_padded_to_the_same_count():
    chunks = ["a", "b", "c", "d", "e"]
    shares = [D.my_share(chunks, r, 2) for r in range(2)]
    assert shares == [["a", "c", "e"], ["b", "d", None]]          # rank 1 runs one idle pass
    assert D.my_share(chunks[:1], 1, 2) == [None]                  # a rank with nothing still joins
    assert D.my_share([], 0, 2) == []


def test_single_process_helpers_change_nothing():
    assert not D.active() and D.rank() == 0 and D.world_size() == 1 and D.is_main()
    rng = random.Random(5)
    assert D.rollout_rng(rng, seed=0, step=3) is rng               # one process keeps the run's own stream
    assert D.gather_lists([1, 2]) == [1, 2] and D.gather_lists([1], [2]) == ([1], [2])
    assert D.all_reduce([1.5, 2.0], "max") == [1.5, 2.0] and D.grad_scale() == 1.0
    model = torch.nn.Linear(2, 2)
    assert D.wrap(model, "fsdp", "fp32") is model
    assert D.my_share([[0], [1]]) == [[0], [1]]
    # no idle passes, no sync flag
    assert list(D.deal(model, [[0], [1]], pad_id=0, device="cpu")) == [[0], [1]]
    assert D.mine([[0], [1]]) == [[0], [1]]


def test_bf16_ulp_is_the_gap_to_the_next_bfloat16():
    for x in (0.70703125, 0.97265625, 1.4765625, 3.0, 1e-3):
        b = torch.tensor(x, dtype=torch.bfloat16)
        up = torch.nextafter(b, torch.tensor(float("inf"), dtype=torch.bfloat16))
        assert (up - b).item() == bf16_ulp(b.item()), x


def test_rank_streams_differ_and_do_not_depend_on_the_world_size():
    seeds = {D.stream_seed(0, step, rank) for step in range(3) for rank in range(4)}
    assert len(seeds) == 12 and D.stream_seed(0, 1, 1) == D.stream_seed(0, 1, 1)
    assert D.stream_seed(1, 1, 1) != D.stream_seed(0, 1, 1)


def test_optimizer_state_is_keyed_by_parameter_names_and_reloads(tiny_policy):
    _, tok = tiny_policy
    model = models.tiny_random_model(len(tok), seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.tensor([[5, 6, 7, 8]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    state = D.optimizer_state_dict(model, optimizer)
    assert "model.layers.0.mlp.up_proj.weight" in state["state"]
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    D.load_optimizer_state(model, fresh, state)
    saved = optimizer.state_dict()["state"]
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], saved[0]["exp_avg"])
    legacy = torch.optim.AdamW(model.parameters(), lr=1e-3)       # checkpoints written before this format
    D.load_optimizer_state(model, legacy, optimizer.state_dict())
    assert torch.equal(legacy.state_dict()["state"][1]["exp_avg_sq"], saved[1]["exp_avg_sq"])


# --------------------------------------------------------------------------------------------------------
# Two processes (torchrun, gloo) against one
# --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_rank_update_equals_one_process_update_with_fsdp2_hsdp_and_ddp(tmp_path, tiny_policy):
    _, tok = tiny_policy
    torchrun("update", str(tmp_path / "update.pt"))
    ranks = torch.load(tmp_path / "update.pt", weights_only=False)
    start = models.tiny_random_model(len(tok), seed=1).state_dict()
    references = {}
    for name, _, precision, layout in W.UPDATE_CASES:               # the same updates in one process
        if (precision, layout) not in references:
            references[precision, layout] = W.run_update(models.tiny_random_model(len(tok), seed=1), tok,
                                                         precision=precision, layout=layout)
    for name, parallel, precision, layout in W.UPDATE_CASES:
        reference, ref_stats = references[precision, layout]
        weights, stats = ranks[name]["weights"], ranks[name]["stats"]
        assert set(weights) == set(reference) and ref_stats["optimizer_steps"] == 3
        moved = max((reference[n].float() - start[n]).abs().max().item() for n in reference)
        worst = max((weights[n].float() - reference[n].float()).abs().max().item() for n in reference)
        print(f"{name}: max |w_2rank - w_1proc| = {worst:.2e} (weights moved up to {moved:.2e}); grad norm "
              f"{stats['grad_norm']:.6f} vs {ref_stats['grad_norm']:.6f}, loss {stats['loss']:.3e} vs "
              f"{ref_stats['loss']:.3e}")
        assert moved > 1e-3, name                                   # the update did move the weights
        assert stats["optimizer_steps"] == ref_stats["optimizer_steps"], name
        assert stats["trained_blocks"] == ref_stats["trained_blocks"], name
        assert stats["forwarded_tokens"] == ref_stats["forwarded_tokens"], name
        if precision == "bf16-autocast":
            # FSDP2 computes with bf16 copies of the fp32 weights where one process autocasts op by op: they
            # agree to bf16 precision only (the near-cancelling loss and Adam's first steps are noise at that
            # precision), so compare the gradient norm
            assert weights["lm_head.weight"].dtype == torch.float32, name          # fp32 master weights
            assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=2e-2), name
            continue
        assert weights["lm_head.weight"].dtype == models.policy_dtype(precision), name
        if precision == "bf16":
            check_bf16_update(name, weights, reference, stats, ref_stats)
            continue
        if precision == "fp32":
            # SGD: |w_2rank − w_1proc| ≤ lr × steps × the largest gradient difference. The gradients agree
            # to float32 summation order (their norm to 1e-5 below); allowing each element 1e-5 at every step
            # bounds the weights at lr × 3 × 1e-5 = 1.5e-6, against weights that move by ~6e-3
            assert worst < W.update_config().lr * ref_stats["optimizer_steps"] * 1e-5, name
        assert stats["clip_frac"] == pytest.approx(ref_stats["clip_frac"], abs=1e-9), name
        # the loss is a near-cancelling sum of ±A terms (|A| ~ 0.5, |loss| ~ 1e-4): compare absolutely
        assert stats["loss"] == pytest.approx(ref_stats["loss"], rel=1e-5, abs=1e-7), name
        assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=1e-5), name


def check_bf16_update(name: str, weights: dict, reference: dict, stats: dict, ref_stats: dict) -> None:
    """The bf16-weights case (FSDP2 on 2 ranks against one process): weights to a bf16 ulp, mostly, and the
    first optimizer step's gradient norm to 2 bf16 ulps (why each bound, below)."""
    # bf16 weights: FSDP2 reduces gradients in fp32 where one process accumulates them in bf16, so
    # ~1 % of the weights land one bf16 ulp apart (or < 1e-5 apart near zero). Since the log-softmax
    # is taken over fp32 logits (packing.fp32_logits, both paths) the bf16-rounded gradients differ in
    # a few near-zero elements, which Adam's first steps turn into steps of ~lr: measured at most 8
    # elements of a tensor, ≤ 0.1 % of it; allowed 0.5 %. The gradients themselves agree (norm
    # below).
    for n in reference:
        outside = ((weights[n].float() - reference[n].float()).abs()
                   > 2 ** -7 * reference[n].float().abs() + 1e-5)
        assert outside.float().mean() <= 5e-3, (name, n, int(outside.sum()))
    # The gradient norm of the FIRST optimizer step, taken before any weight can differ: both sides
    # compute it from the same bf16 weights, and their gradients differ only in how micro-batches are
    # summed (fp32 reduce-scatter against bf16 accumulation), which moves the unrounded norm by far
    # less than a bf16 ulp (measured: equal). The norm itself is bf16, rounded in stages
    # (clip_grad_norm_: each tensor's norm, then the norm of those; FSDP2 also combines the shards'),
    # so that noise shows only where a rounding tips to the neighbouring value: the total's moves it
    # 1 ulp, a tensor's (or shard's) at most ~1 ulp of the total. Bound: 2 ulps, 0.8-1.6 % of the
    # norm. (The mean over all 3 steps, once compared at rel 1e-5, failed on a loaded machine: after
    # step 1 one weight of ~768 can land one ulp apart, a later step's norm with it: 0.97135 against
    # 0.97266, one ulp of one step / 3.) A real bug moves the norm far more: gradients averaged
    # instead of summed over the 2 ranks (D.grad_scale() = 1, tried once) halve it, 0.354 against
    # 0.707 (the weights above caught it too: 32 % of the embedding outside); a rank's micro-batches
    # lost or counted twice change it by tens of %.
    first, ref_first = stats["step_grad_norms"][0], ref_stats["step_grad_norms"][0]
    assert len(stats["step_grad_norms"]) == stats["optimizer_steps"], name   # recorded every step
    assert abs(first - ref_first) <= 2 * bf16_ulp(ref_first), (name, first, ref_first)
    # later steps inherit the weights' ulp differences: the mean only to bf16-autocast's 2 %
    assert stats["grad_norm"] == pytest.approx(ref_stats["grad_norm"], rel=2e-2), name
    assert stats["loss"] == pytest.approx(ref_stats["loss"], abs=1e-5), name   # terms of |A| ~ 0.5


@pytest.mark.slow
def test_sharded_evaluation_equals_one_process_on_fixed_samples(tmp_path, tiny_policy):
    _, tok = tiny_policy
    torchrun("eval", str(tmp_path / "eval.pt"))
    sharded = torch.load(tmp_path / "eval.pt", weights_only=False)
    single = W.run_eval(models.tiny_random_model(len(tok), seed=1), tok)
    assert 0 < single["avg@k"] < 1 and single["n_problems"] == 5 and single["n_samples"] == 5 * 3 * 2
    assert sharded["records"] == single["records"]                  # same samples, same order, same grades
    for key in ("avg@k", "pass@k", "maj@k", "pass@k_unbiased", "pass_curve", "per_run", "n_problems",
                "n_samples"):
        assert sharded[key] == single[key], key


def _read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_two_rank_tiny_run_writes_one_log_and_checkpoint_and_resumes_on_two_ranks_and_one(tmp_path,
                                                                                          monkeypatch):
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    torchrun("train", str(tmp_path), str(run_a), str(run_b))
    records = _read(run_a / "metrics.jsonl")                        # rank 0 alone wrote it: no duplicates
    assert [(r["step"], r.get("eval")) for r in records] == [(0, "before"), (1, None), (2, None),
                                                             (2, "after")]
    steps = [r for r in records if "eval" not in r]
    assert all(r["prompts"] == 2 for r in steps)                    # global: both ranks' prompts
    assert records[0]["n_problems"] == 3 and records[0]["n_samples"] == 6   # eval shards 2 + 1, gathered
    saved = sorted(p.name for p in (run_a / "checkpoints").iterdir())
    assert saved == ["latest", "step_000001", "step_000002"]
    assert not list(tmp_path.rglob("metrics.jsonl.*")) and len(list(tmp_path.rglob("metrics.jsonl"))) == 2
    reloaded = AutoModelForCausalLM.from_pretrained(run_a / "checkpoints" / "step_000002")
    assert torch.equal(reloaded.lm_head.weight, reloaded.model.embed_tokens.weight)   # tied, full size
    assert reloaded.lm_head.weight.shape[0] > 1000

    (again,) = [r for r in _read(run_b / "metrics.jsonl") if "eval" not in r]   # resumed on 2 ranks at step 1
    for key in ("loss", "reward", "grad_norm", "generated_tokens_per_prompt", "optimizer_steps"):
        assert again[key] == steps[1][key], key

    monkeypatch.setattr(R, "compute_reward", W.stand_in_reward)     # the same checkpoint, 1 process
    run_c = train.main(["--preset", "tiny", "--out_dir", str(tmp_path / "c"), "--eval_limit", "3",
                        "--alpha_start", "0",   # the run's own settings (a resume refuses others)
                        "--eval_every", "0",    # no eval
                        "--resume", str(run_a / "checkpoints" / "step_000001")])
    (one,) = _read(run_c / "metrics.jsonl")
    assert one["step"] == 2 and one["optimizer_steps"] >= 1


@pytest.mark.slow
def test_two_rank_off_policy_run_resumes_on_two_ranks_and_one_with_the_batch_in_flight(tmp_path, monkeypatch):
    """--off_policy_steps 1 under torchrun: each rank samples its share of the next step's bases, the whole
    batch is gathered into the checkpoint, and a resume on 2 ranks repeats the run; on 1 process the same
    stale base responses are trained (its prompts and bases come from the checkpoint, not from sampling)."""
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    torchrun("offpolicy", str(tmp_path), str(run_a), str(run_b))
    steps = _read(run_a / "metrics.jsonl")
    lags = [(r["step"], r["policy_lag"], r["ahead_prompts"]) for r in steps]
    assert lags == [(1, 0, 2), (2, 1, 2), (3, 1, 0)]
    state = torch.load(run_a / "checkpoints" / "step_000001" / "trainer_state.pt", weights_only=False)
    assert len(state["ahead"]["prompts"]) == 2 and len(state["ahead"]["bases"]) == 2   # both ranks' shares
    again = _read(run_b / "metrics.jsonl")
    assert [r["step"] for r in again] == [2, 3]
    for mine, theirs in zip(again, steps[1:]):
        for key in ("loss", "reward", "grad_norm", "stale_tokens", "generated_tokens_per_prompt"):
            assert mine[key] == theirs[key], key

    monkeypatch.setattr(R, "compute_reward", W.stand_in_reward)     # the same checkpoint, 1 process
    run_c = train.main(["--preset", "tiny", "--steps", "3", "--eval_every", "0", "--alpha_start", "0",
                        "--off_policy_steps", "1", "--lr", "3e-2", "--out_dir", str(tmp_path / "c"),
                        "--resume", str(run_a / "checkpoints" / "step_000001")])
    one = _read(run_c / "metrics.jsonl")
    assert [(r["step"], r["policy_lag"]) for r in one] == [(2, 1), (3, 1)]
    assert one[0]["stale_tokens"] == steps[1]["stale_tokens"]     # the same stale bases, trained on 1 process


# ------------------------------------------------------------------------------------------------------
# Launcher variables outside torchrun are one line
# ------------------------------------------------------------------------------------------------------
TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]


EVAL = ["--preset", "tiny", "--model", "tiny-random", "--limit", "2", "--k", "2", "--max_new_tokens", "4"]


TORCHRUN = ("expected a command started by torchrun (`torchrun --nproc_per_node N {script} ...` sets "
            "WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT), or WORLD_SIZE unset (or 1) for one process")


@pytest.mark.parametrize("env, why", [
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='' in the environment: not a number of processes >= 1"),    # the issue's
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 in the environment but RANK, MASTER_ADDR, MASTER_PORT not set: this "
                          "process was not started by torchrun"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' in the environment: not a number of processes >= 1"),
])
def test_launcher_variables_outside_torchrun_are_one_line(program_name, tmp_path, capsys, monkeypatch,
                                                          no_rendezvous, env, why):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    line = run_cli(capsys, TINY + ["--out_dir", str(tmp_path / "run")], code=2, one_error_line=True)[-1]
    assert line == f"train.py: error: {why}; {TORCHRUN.format(script='train.py')}"
    monkeypatch.setattr(sys, "argv", ["evaluate.py"])
    line = evaluate_refused(capsys, EVAL + ["--out_dir", str(tmp_path / "ev")])
    assert line == f"evaluate.py: error: {why}; {TORCHRUN.format(script='evaluate.py')}"
    assert folder_hash(tmp_path) == {}


@pytest.fixture
def no_rendezvous(monkeypatch):
    """torch's env:// rendezvous would wait 30 minutes for ranks that never come: fail at once instead."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("init_process_group was reached: the variables were not checked first")

    monkeypatch.setattr(dist, "init_process_group", refuse)


def test_a_rank_outside_the_world_is_one_line(program_name, tmp_path, capsys, monkeypatch, no_rendezvous):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in {"RANK": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    line = run_cli(capsys, TINY + ["--out_dir", str(tmp_path / "run")], code=2, one_error_line=True)[-1]
    assert line.endswith("error: RANK='2' in the environment: expected a number 0 to 1 (WORLD_SIZE=2), as "
                         "torchrun sets it")
    assert folder_hash(tmp_path) == {}
