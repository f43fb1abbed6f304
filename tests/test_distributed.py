"""distributed.py: sharding arithmetic in one process, and 2-process CPU runs under torchrun (gloo) compared with
one process: sharded evaluation (tests/dist_worker.py is the rank side)."""
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distributed as D
import models

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dist_worker as W  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")


def torchrun(*args: str, timeout: int = 240) -> float:
    """Run the worker on 2 CPU processes; returns the wall seconds (shown with -s)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), *args], capture_output=True, text=True, timeout=timeout, env=env)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, f"torchrun {args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    print(f"2-process {args[0]}: {seconds:.1f} s wall")
    return seconds


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
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    legacy = torch.optim.AdamW(model.parameters(), lr=1e-3)       # checkpoints written before this format
    D.load_optimizer_state(model, legacy, optimizer.state_dict())
    assert torch.equal(legacy.state_dict()["state"][1]["exp_avg_sq"], optimizer.state_dict()["state"][1]["exp_avg_sq"])


# --------------------------------------------------------------------------------------------------------
# Two processes (torchrun, gloo) against one
# --------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sharded_evaluation_equals_one_process_on_fixed_samples(tmp_path, tiny_policy):
    _, tok = tiny_policy
    torchrun("eval", str(tmp_path / "eval.pt"))
    sharded = torch.load(tmp_path / "eval.pt", weights_only=False)
    single = W.run_eval(models.tiny_random_model(len(tok), seed=1), tok)
    assert 0 < single["avg@k"] < 1 and single["n_problems"] == 5 and single["n_samples"] == 5 * 3 * 2
    assert sharded["records"] == single["records"]                  # same samples, same order, same grades
    for key in ("avg@k", "pass@k", "maj@k", "pass@k_unbiased", "pass_curve", "per_run", "n_problems", "n_samples"):
        assert sharded[key] == single[key], key
