"""tracking.py: metrics.jsonl and TensorBoard hold the same numbers, W&B offline, tree logs against the
paper's formulas by hand, --report_to on the command line; models.enable_gradient_checkpointing gives the same
gradients in the update."""
import copy
import dataclasses
import importlib.util
import json
import math
import random
import re
import time

import pytest
import torch

import advantage as A
import config as C
import methods as M
import models
import train
import tree as T
from harness import cli, tracking


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- --report_to on the command line --------------------------------------------------------------------
def test_report_to_takes_several_trackers_and_rejects_bad_ones(monkeypatch):
    assert C.make_config("tiny").report_to == ["none"]
    cfg = cli.parse_args(["--preset", "tiny", "--report_to", "tensorboard", "wandb"]
                         if importlib.util.find_spec("wandb")
                         else ["--preset", "tiny", "--report_to", "tensorboard"])
    assert cfg.report_to[0] == "tensorboard"
    with pytest.raises(SystemExit):
        cli.parse_args(["--preset", "tiny", "--report_to", "mlflow"])
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        C.make_config("tiny", report_to=["none", "tensorboard"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"--report_to wandb: the Python package 'wandb' \(an optional "
                                         r"dependency\) is not installed; run `pip install wandb`"):
        C.make_config("tiny", report_to=["wandb"])


def test_tags_are_stable_names_of_numeric_fields():
    assert tracking.tags({"step": 3, "reward": 0.5, "prompts": 8, "note": "x", "flag": True,
                          "levels": {"2": {"leaves": 12.5, "prompts": 3}}}) == \
        {"train/reward": 0.5, "train/prompts": 8.0, "train/levels/2/leaves": 12.5,
         "train/levels/2/prompts": 3.0}
    assert tracking.tags({"step": 0, "eval": "before", "data": "arith-test", "avg@4": 0.25}) == \
        {"eval/arith-test/avg@4": 0.25}


def test_disabled_log_writes_nothing(tmp_path):
    log = tracking.Log(tmp_path / "run", ["tensorboard"], enabled=False)
    log.write({"step": 1, "reward": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


# ---- a tiny run: TensorBoard read back against metrics.jsonl, tree logs written ---------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("run") / "tiny"
    train.main(["--preset", "tiny", "--out_dir", str(out), "--report_to", "tensorboard",
                "--log_trees_every", "2", "--steps", "3", "--eval_every", "3", "--eval_limit", "2",
                "--save_every", "0"])
    return out


def test_tensorboard_holds_every_metrics_jsonl_number(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tiny_run / "tensorboard"),
                              size_guidance={"scalars": 0, "tensors": 0}).Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    records = _records(tiny_run / "metrics.jsonl")
    assert [r["step"] for r in records if "eval" not in r] == [1, 2, 3]
    assert [(r["eval"], r["step"]) for r in records if "eval" in r] == [("before", 0), ("after", 3)]
    expected = {}
    for record in records:
        for tag, value in tracking.tags(record).items():
            expected.setdefault(tag, {})[record["step"]] = value
    assert "train/reward" in expected and "eval/arith-test/avg@2" in expected and "train/k_hat" in expected
    assert any(tag.startswith("train/levels/") for tag in expected)          # nested per-level fields too
    assert set(scalars) == set(expected)
    for tag, by_step in expected.items():
        assert set(scalars[tag]) == set(by_step), tag
        for step, value in by_step.items():
            # float32 in events
            assert scalars[tag][step] == pytest.approx(value, rel=1e-6, abs=1e-6), (tag, step)
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config_text.strip("`\n")) == json.loads((tiny_run / "config.json").read_text())


def test_tree_logs_at_step_one_and_every_n_hold_every_block(tiny_run):
    assert sorted(p.name for p in (tiny_run / "trees").iterdir()) \
        == ["step_000001.jsonl", "step_000002.jsonl"]
    assert [tracking.trees_due(s, 2) for s in range(1, 6)] == [True, True, False, True, False]
    assert not any(tracking.trees_due(s, 0) for s in range(1, 6))
    trees = tracking.read_trees(tiny_run, 2)
    cfg = C.make_config("tiny")
    assert [t["tree"] for t in trees] == list(range(cfg.prompts_per_step))
    for t in trees:
        assert t["step"] == 2 and t["method"] == "datpo" and t["trained"]
        assert len(t["forks"]) == cfg.n_base and t["leaves"] == sum(b["terminal"] for b in t["blocks"])
        for b in t["blocks"]:
            assert ("".join(b["tokens"]) == b["text"]
                    and len(b["token_ids"]) == len(b["entropies"]) == len(b["tokens"]))
            # log p, generation time
            assert len(b["logprobs"]) == len(b["token_ids"]) and max(b["logprobs"]) <= 0
            assert (b["reward"] is not None) == b["terminal"]
            assert b["base_advantage"] == pytest.approx((b["reward"] or 0) + b["v_end"] - b["v_start"])
            assert b["div_sib"] is not None   # α ≠ 0 at step 2 of 3: embeddings were computed
            bonus = 0.0 if b["base_advantage"] <= 0 else t["alpha"] * b["div_sib"]
            assert b["advantage"] == pytest.approx(b["base_advantage"] + bonus)
        # forks: every base response's branch blocks start at one of its fork positions
        for b in t["blocks"]:
            if b["branch"]:
                assert b["start"] in t["forks"][b["base"]]
    with pytest.raises(FileNotFoundError, match="logged steps: 1, 2"):
        tracking.read_trees(tiny_run, 3)


def scores_of(tr, advantages=None, embeddings=None, value_estimate="paper"):
    """Phase 3's records for a tree (advantage.score_tree) with the given advantages as the method's (None:
    the tree was not trained)."""
    given = M.Method("given", lambda tr, base, div, alpha, scope: advantages or [0.0] * len(tr.blocks))
    scores = A.score_tree(tr, given, 0.0, embeddings, value_estimate=value_estimate)
    return scores if advantages is not None else [dataclasses.replace(b, advantage=None) for b in scores]


def test_tree_record_by_hand(smollm_tokenizer):
    """The tree of test_train: prompt → base 0 = b0 b1 b2 (forks at 2 and 4), branches b3 (at 2) and b4
    (at 4); base 1 = b5. Rewards b2 0, b3 1, b4 1, b5 0."""
    blocks = [
        T.Block(None, [504, 505], [0.5, 1.5], base=0, start=0),
        T.Block(0, [506, 507], [0.1, 0.2], base=0, start=2),
        T.Block(1, [508, 509], [0.3, 0.4], reward=0.0, base=0, start=4),
        T.Block(0, [510, 511, 512], [2.0] * 3, reward=1.0, base=0, start=2, branch=True,
                logprobs=[-0.123456, -2.0, -0.00001]),
        T.Block(1, [513], [0.7], reward=1.0, base=0, start=4, branch=True),
        T.Block(None, [514, 515, 516], [0.0] * 3, reward=0.0, base=1, start=0),
    ]
    tr = T.Tree("p", [1, 2], "a", blocks, v_root=0.0, k_hat=2, b_hat=1, forks=[[2, 4], []])
    # siblings: (b0, b5) at the prompt: 60° apart → Div 1 − cos 60° = 0.5; (b1, b3) orthogonal → 1;
    # (b2, b4) identical → 0
    emb = [[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0], [0, 0, 2], [0.5, math.sqrt(3) / 2, 0]]
    rec = tracking.tree_record(tr, smollm_tokenizer, scores_of(tr, [9, 8, 7, 6, 5, 4], emb))
    by = {k: [b[k] for b in rec["blocks"]] for k in rec["blocks"][0]}
    assert by["parent"] == [None, 0, 1, 0, 1, None]
    # V(root) = mean of the 4 leaves = 1/2; V(end b0) = mean(b2, b3, b4) = 2/3; V(end b1) = mean(b2, b4) = 1/2
    assert by["v_start"] == pytest.approx([1 / 2, 2 / 3, 1 / 2, 2 / 3, 1 / 2, 1 / 2])
    assert by["v_end"] == pytest.approx([2 / 3, 1 / 2, 0, 0, 0, 0])
    # Â_base = r + V(end) − V(start)
    assert by["base_advantage"] == pytest.approx([1 / 6, -1 / 6, -1 / 2, 1 / 3, 1 / 2, -1 / 2])
    assert by["div_sib"] == pytest.approx([0.5, 1.0, 0.0, 1.0, 0.0, 0.5])
    assert by["advantage"] == [9, 8, 7, 6, 5, 4]           # what the update used, as given
    assert by["entropies"][0] == [0.5, 1.5] and by["token_ids"][3] == [510, 511, 512]
    assert by["logprobs"] == [None, None, None, [-0.1235, -2.0, -0.0], None, None]   # rounded to 1e-4
    assert rec["forks"] == [[2, 4], []] and rec["leaves"] == 4 and rec["trained"]
    assert tracking.tree_record(tr, smollm_tokenizer, scores_of(tr))["blocks"][0]["div_sib"] is None
    # --value_estimate release: V(root) = mean of the base responses (b2, b5: 0), V(fork) = mean of its
    # branches only (end of b0: b3 = 1; end of b1: b4 = 1)
    rel = tracking.tree_record(tr, smollm_tokenizer, scores_of(tr, value_estimate="release"), "release")
    assert rel["value_estimate"] == "release"
    # (flat: pytest 9.2's approx takes no nested sequences)
    got = [x for b in rel["blocks"] for x in (b["v_start"], b["v_end"], b["base_advantage"])]
    assert got == pytest.approx([0, 1, 1, 1, 1, 0, 1, 0, -1, 1, 0, 0, 1, 0, 0, 0, 0, 0])


def test_evaluate_results_reach_tensorboard_at_the_checkpoint_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    (run / "checkpoints" / "step_000024").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000024")
    assert tracking.checkpoint_step(str(run)) == 24
    assert tracking.checkpoint_step(str(run / "checkpoints" / "step_000008")) == 8
    assert tracking.checkpoint_step("Qwen/Qwen2.5-3B") == 0
    result = {"k": 8, "avg@k": 0.25, "pass@k": 0.5, "maj@k": 0.375, "pass@k_unbiased": 0.5, "n_problems": 2,
              "n_samples": 16, "seconds": 3.0}
    tracking.report_eval(tmp_path / "ev", ["tensorboard"], {"model": "m"}, {"gpqa": result}, step=24)
    assert not (tmp_path / "ev" / "metrics.jsonl").exists()          # results.json stays the file of record
    events = EventAccumulator(str(tmp_path / "ev" / "tensorboard")).Reload()
    got = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert got["eval/gpqa/avg@8"] == [(24, 0.25)] and got["eval/gpqa/maj@8"] == [(24, 0.375)]
    assert got["eval/gpqa/pass@8"] == [(24, 0.5)]


# ---- W&B offline ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_wandb_offline_run_holds_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = tracking.Log(tmp_path / "run", ["wandb"], config={"lr": 1e-5})
    log.write({"step": 1, "reward": 0.25})
    log.write({"step": 2, "reward": 0.75})
    log.write({"step": 2, "eval": "after", "data": "arith-test", "avg@4": 0.5})
    log.close()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    # the offline run file is a log of protobuf records: each key is stored next to its JSON value
    # wandb's service process writes the file: under load it can still be flushing after finish() returns
    deadline = time.monotonic() + 120
    while b"eval/arith-test/avg@4" not in runs[0].read_bytes() and time.monotonic() < deadline:
        time.sleep(0.5)
    raw = runs[0].read_bytes()
    assert (re.search(rb"train/reward.{1,6}0\.25", raw, re.S)
            and re.search(rb"train/reward.{1,6}0\.75", raw, re.S))
    assert re.search(rb"eval/arith-test/avg@4.{1,6}0\.5", raw, re.S)
    assert re.search(rb"lr.{1,6}0\.00001", raw, re.S)                     # the config
    assert len(_records(tmp_path / "run" / "metrics.jsonl")) == 3


# ---- gradient checkpointing --------------------------------------------------------------------------------
class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it is asked to apply."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


@pytest.mark.parametrize("layout,kernel", [("packed", "tree"), ("packed", "dense"), ("rows", "auto")])
def test_gradient_checkpointing_gives_the_same_gradients_in_the_update(tiny_policy, layout, kernel):
    """The recomputation in backward runs the same attention as the forward (the tree kernel's backend stays
    set until the backward is done)."""
    model, tok = tiny_policy
    cfg = C.make_config("tiny", mini_batch_size=8, micro_batch_size=2, max_tokens_per_micro_batch=24,
                        ppo_epochs=2, train_layout=layout, packed_attention=kernel)
    gen = random.Random(1)
    ids = lambda n: [gen.randrange(5, 2000) for _ in range(n)]  # noqa: E731
    blocks = [T.Block(None, ids(4), [0.0] * 4, base=0, start=0),
              T.Block(0, ids(5), [0.0] * 5, reward=0.0, base=0, start=4),
              T.Block(0, ids(3), [0.0] * 3, reward=1.0, base=0, start=4, branch=True),
              T.Block(None, ids(7), [0.0] * 7, reward=1.0, base=1, start=0)]
    tr = T.Tree("p", ids(3), "a", blocks, v_root=0.5, k_hat=1, b_hat=1, forks=[[4], []])
    trees = [train.train_tree(tr, [0.3, -0.6, 0.4, 0.5], M.METHODS["datpo"])]
    grads, calls = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        m = copy.deepcopy(model)
        if checkpointing:
            assert models.enable_gradient_checkpointing(m) == m.config.num_hidden_layers
        count = [0]
        m.model.layers[0].mlp.register_forward_pre_hook(lambda *a: count.__setitem__(0, count[0] + 1))
        opt = RecordingSGD(m.parameters(), lr=1e-2)
        train.ppo_update(m, opt, trees, cfg, tok.pad_token_id, "cpu", random.Random(0))
        grads.append(opt.seen)
        calls.append(count[0])
    assert len(grads[0]) == len(grads[1]) >= 2          # 2 epochs
    for plain, ckpt in zip(*grads):
        assert any(g.abs().sum() > 0 for g in plain)
        for a, b in zip(plain, ckpt):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    assert calls[1] > calls[0]  # the checkpointed layers ran again in the backward passes


def test_gradient_checkpointing_leaves_generation_alone(tiny_policy):
    model, tok = tiny_policy
    m = copy.deepcopy(model)
    models.enable_gradient_checkpointing(m)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.manual_seed(0)
        a = model.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
        b = m.generate(ids, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id)
    assert torch.equal(a, b)
