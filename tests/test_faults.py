"""faults.py and its hooks: one line per user mistake (exit 2, no traceback), resume from nothing, the
non-finite guard, SIGTERM/SIGINT, out-of-memory halving, resumable evaluation, and the fault-injection run
(real processes SIGKILLed / SIGTERMed and resumed end with the same metrics and bit-identical weights)."""
import json
import os
import random
import signal
import sys

import pytest
import torch

import config as C
import data
import evaluate as E
import models
import packing as P
import rollout as R
import train
from harness import guards, signals
from runtime import faults, oom

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_injection as FI  # noqa: E402
import inject  # noqa: E402

from harness import loop, preflight, tracking


# ------------------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, no traceback
# ------------------------------------------------------------------------------------------------------
def one_line_error(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(main, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    # one error line, last; what comes before it is progress bars (loading weights), never a traceback
    assert "Traceback" not in err and sum("error:" in line for line in err.splitlines()) == 1, err
    assert "error:" in err.splitlines()[-1], err
    return err.splitlines()[-1]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"problem": "1 + 1", "answer": "2"}\n{"problem": "2 + 2"\n')
    (tmp_path / "a_file").write_text("x")
    return tmp_path


def test_train_bad_inputs_are_one_line(files, capsys, monkeypatch):
    monkeypatch.setattr(data, "hub_blocked", lambda *a, **k: "cannot reach huggingface.co (test)")
    out = ["--preset", "tiny", "--out_dir", str(files / "run")]
    cases = {
        ("--train_data", str(files / "empty.jsonl")): "empty.jsonl: no problems in it; "
                                                      "expected at least one row",
        ("--train_data", str(files / "bad.jsonl")): "bad.jsonl line 2: invalid JSON",
        ("--train_data", str(files / "none.jsonl")): "none.jsonl: no such file; expected",
        ("--model", "/no/such/folder"): "--model /no/such/folder: no such folder; expected",
        ("--model", "Qwen/Qwen2.5-3B"): "not in the HF cache, and the HF hub is unreachable",
        ("--resume", "/no/such/run"): "--resume /no/such/run: no such folder; expected a run folder",
        ("--out_dir", str(files / "a_file" / "run")): "cannot write there",
        ("--bogus", "1"): "unrecognized arguments: --bogus 1",
        ("--lr", "-1"): "--lr: got -1.0, expected 0 < lr <= 1",
        ("--max_new_tokens", "4096"): "exceeds the model's context of 2048 tokens",
        ("--max_prompt_tokens", "10"): "every prompt is longer than --max_prompt_tokens 10",
    }
    for args, expected in cases.items():
        assert expected in one_line_error(capsys, train.main, out + list(args)), args
    # a run folder with no checkpoint is not a model
    (files / "run0").mkdir()
    (files / "run0" / "metrics.jsonl").write_text("")
    assert "a run folder with no checkpoint yet" in one_line_error(
        capsys, train.main, out + ["--model", str(files / "run0")])
    # a fresh run into a folder that already holds one
    (files / "run1").mkdir()
    (files / "run1" / "metrics.jsonl").write_text('{"step": 0}\n')
    assert "already holds a run (metrics.jsonl with 1 record); --resume" in one_line_error(
        capsys, train.main, ["--preset", "tiny", "--out_dir", str(files / "run1")])


def test_nonfinite_and_absurd_numeric_flags_are_refused_up_front(tmp_path, capsys):
    """--lr inf once trained a NaN model to exit 0: every float flag must be finite, lr in (0, 1], before
    anything is created or loaded."""
    out = ["--preset", "tiny", "--out_dir", str(tmp_path / "run")]
    cases = {
        ("--lr", "inf"): "--lr: got inf, expected a finite number",
        ("--lr", "nan"): "--lr: got nan, expected a finite number",
        ("--lr", "1e10"): "--lr: got 10000000000.0, expected 0 < lr <= 1",
        ("--lr", "0"): "--lr: got 0.0, expected 0 < lr <= 1",
        ("--temperature", "nan"): "--temperature: got nan, expected a finite number",
        ("--alpha_start=-inf",): "--alpha_start: got -inf, expected a finite number",
        ("--beta2", "1"): "--beta2: got 1.0, expected 0 <= beta < 1",
        ("--weight_decay", "-0.1"): "--weight_decay: got -0.1, expected >= 0",
        ("--max_grad_norm", "0"): "--max_grad_norm: got 0.0, expected > 0",
        ("--stop_timeout", "-1"): "--stop_timeout: got -1.0, expected >= 0",
        ("--keep_checkpoints", "-2"): "--keep_checkpoints: got -2, expected an integer >= 0",
    }
    for args, expected in cases.items():
        assert expected in one_line_error(capsys, train.main, out + list(args)), args
    assert not (tmp_path / "run").exists()                               # refused before anything was written


def test_evaluate_bad_inputs_are_one_line(files, capsys):
    base = ["--preset", "tiny", "--model", "tiny-random", "--k", "1", "--limit", "1", "--out_dir",
            str(files / "ev")]
    assert "--bench" in one_line_error(capsys, E.main, base + ["--bench", str(files / "empty.jsonl")])
    assert "no such folder" in one_line_error(capsys, E.main, ["--model", "/no/such/folder", "--bench",
                                                               "arith-test", "--limit", "1", "--k", "1"])
    err = one_line_error(capsys, E.main, base + ["--bench", "arith-test", "--max_new_tokens", "2100"])
    assert "arith-test problem 1: the prompt is" in err and "context of 2048 tokens" in err


def test_studies_bad_inputs_are_one_line(files, capsys):
    from studies import __main__ as studies_cli

    assert "cannot write there" in one_line_error(
        capsys, studies_cli.main, ["forks", "--scale", "tiny", "--out_dir", str(files / "a_file" / "x")])
    assert "unrecognized arguments: --bogus 1" in one_line_error(
        capsys, studies_cli.main, ["forks", "--scale", "tiny", "--bogus", "1"])


def test_debug_shows_the_traceback(files):
    with pytest.raises(faults.UserError):
        faults.main_guard(train.main, ["--preset", "tiny", "--train_data", str(files / "empty.jsonl"),
                                       "--out_dir", str(files / "run"), "--debug"])


def test_resume_source(tmp_path):
    with pytest.raises(faults.UserError, match="no such folder"):
        preflight.resume_source(str(tmp_path / "nope"))
    (tmp_path / "run").mkdir()
    assert preflight.resume_source(str(tmp_path / "run")) is None          # nothing yet: start at step 0
    ckpt = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        (ckpt / f"step_00000{step}").mkdir(parents=True)
        (ckpt / f"step_00000{step}" / "trainer_state.pt").write_text("x")
    (ckpt / ".tmp_step_000003").mkdir()                                  # a half-written one never counts
    (ckpt / "latest").write_text("step_000001")                          # killed before the pointer moved
    assert preflight.resume_source(str(tmp_path / "run")) == str(ckpt / "step_000002")


def test_fresh_run_into_a_folder_holding_a_run_is_refused_or_replaced(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")                               # not a run file: never touched
    preflight.check_new_run(run, overwrite=False)                           # no records yet: fine
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "trees").mkdir()
    with pytest.raises(faults.UserError) as err:
        preflight.check_new_run(run, overwrite=False)
    assert str(err.value) == (f"--out_dir {run}: already holds a run (metrics.jsonl with 2 records, "
                              f"checkpoints up to step_000001); --resume {run} continues it, another "
                              f"--out_dir starts a new one, --overwrite true replaces it")
    assert (run / "metrics.jsonl").exists()                              # the refusal deletes nothing
    # torchrun: ranks > 0 leave it to rank 0
    preflight.check_new_run(run, overwrite=True, delete=False)
    assert (run / "checkpoints").exists()
    preflight.check_new_run(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_torn_metrics_line_is_dropped_on_resume(tmp_path):
    log = tracking.Log(tmp_path)
    log.write({"step": 1})
    log.write({"step": 2})
    with open(log.path, "a") as f:
        f.write('{"step": 3, "rew')                                       # killed mid-write
    assert log.truncate_after(1) == 2
    assert [json.loads(x)["step"] for x in log.path.read_text().splitlines()] == [1]


# ------------------------------------------------------------------------------------------------------
# Non-finite guard
# ------------------------------------------------------------------------------------------------------
def _rows(tokenizer):
    """Two GRPO groups (trees of depth one) of two 6-token responses: two mini-batches of 2 blocks."""
    prompt = tokenizer("What is 3 + 4?", add_special_tokens=False).input_ids
    gen = torch.Generator().manual_seed(0)
    return [P.TrainTree(prompt, [None, None],
                        [torch.randint(100, 1000, (6,), generator=gen).tolist() for _ in adv],
                        list(adv), [1.0, 1.0]) for adv in ((1.0, -1.0), (0.5, -0.5))]


def test_nonfinite_minibatch_leaves_weights_and_optimizer_untouched(smollm_tokenizer, monkeypatch):
    tok = smollm_tokenizer
    model = models.tiny_random_model(len(tok), seed=1)
    cfg = C.make_config("tiny", mini_batch_size=2, micro_batch_size=2, ppo_epochs=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rows = _rows(tok)
    real = P.micro_logprobs
    calls = []

    def poisoned(*args, **kwargs):   # the second forward (the first trained mini-batch) returns NaN log-probs
        out = real(*args, **kwargs)
        calls.append(1)
        if torch.is_grad_enabled() and len(calls) == 2:
            out = out * float("nan")
        return out

    monkeypatch.setattr(P, "micro_logprobs", poisoned)
    stats = train.ppo_update(model, opt, rows, cfg, tok.pad_token_id, "cpu", random.Random(0))
    assert stats["nonfinite_minibatches"] == 1 and stats["optimizer_steps"] == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.state_dict()["state"][0]["step"] == 1                    # the bad mini-batch never stepped

    # all bad: not one weight or optimizer moment changes
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    monkeypatch.setattr(P, "micro_logprobs", lambda *a, **k: real(*a, **k) * float("inf"))
    stats = train.ppo_update(model, opt, rows, cfg, tok.pad_token_id, "cpu", random.Random(0))
    assert stats["nonfinite_minibatches"] == 2 and stats["optimizer_steps"] == 0
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, model.parameters()))
    assert opt.state_dict()["state"][0]["step"] == 1


def _optimizer_state(opt):
    return {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()}
            for i, st in enumerate(opt.state.get(p, {}) for g in opt.param_groups for p in g["params"])}


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) if torch.is_tensor(a[i][k])
                                           else a[i][k] == b[i][k] for k in a[i]) for i in a)


@pytest.mark.parametrize("history", [0, 1])   # before any optimizer step (no AdamW state yet), and after one
def test_update_that_makes_weights_nonfinite_is_undone_bit_for_bit(smollm_tokenizer, history):
    """The loss and gradients are finite but the step is not (lr inf): the guard restores weights and
    optimizer state exactly as they were before the update."""
    tok = smollm_tokenizer
    model = models.tiny_random_model(len(tok), seed=1)
    cfg = C.make_config("tiny", mini_batch_size=2, micro_batch_size=2, ppo_epochs=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = guards.WeightGuard(model, opt)
    for _ in range(history):
        train.ppo_update(model, opt, _rows(tok), cfg, tok.pad_token_id, "cpu", random.Random(0))
    weights = [p.detach().clone() for p in model.parameters()]
    state = _optimizer_state(opt)
    guard.snapshot()
    for group in opt.param_groups:
        group["lr"] = float("inf")
    stats = train.ppo_update(model, opt, _rows(tok), cfg, tok.pad_token_id, "cpu", random.Random(0),
                             weights_ok=guard.weights_finite)
    assert stats["nonfinite_updates"] == 1 and stats["nonfinite_minibatches"] == 0
    assert stats["optimizer_steps"] == 0                                 # the first bad step ends the update
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the step did break them ...
    guard.restore()                                                      # ... and the guard undoes it
    assert all(torch.equal(w, p) for w, p in zip(weights, model.parameters()))
    assert _same_state(state, _optimizer_state(opt))
    assert sum(bool(st) for st in opt.state.values()) == (len(weights) if history else 0)


def test_logits_probe_and_checkpoint_refuse_nonfinite_weights(smollm_tokenizer, tmp_path):
    tok = smollm_tokenizer
    model = models.tiny_random_model(len(tok), seed=1)
    ids = tok("What is 3 + 4?").input_ids
    assert guards.logits_finite(model, ids)
    with torch.no_grad():
        model.model.norm.weight.fill_(3e38)                              # finite weights, overflowing logits
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not guards.logits_finite(model, ids)
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(faults.NonFiniteStop, match="non-finite value; checkpoint not written; last good "
                                                   "checkpoint: none"):
        loop.save_checkpoint(tmp_path, 1, model, tok, opt, {"step": 1})
    assert not (tmp_path / "checkpoints").exists()


def test_run_whose_updates_break_the_weights_stops_with_finite_checkpoints(tmp_path, monkeypatch, capsys):
    """lr inf slipped past the flags (here: forced into the optimizer): no update is kept, every step is
    counted, the run stops with exit 3 naming its last good checkpoint, whose weights are the initial ones."""
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW",
                        lambda params, **kw: adamw(params, **{**kw, "lr": float("inf")}))
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(train.main, ["--preset", "tiny", "--steps", "4", "--max_bad_steps", "2",
                                       "--out_dir", str(run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 3, err
    assert "step 1: the update made a weight or the policy's logits non-finite; weights and optimizer " \
           "state restored to before it (1 step(s) in a row)" in err
    assert err.strip().splitlines()[-1].endswith(
        f"stopped at step 2: 2 steps in a row had non-finite losses, gradient norms or weights "
        f"(--max_bad_steps 2); last good checkpoint: {run / 'checkpoints' / 'step_000001'}; expected a lower "
        f"--lr or a check of the data")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_updates"] for r in rows] == [1, 1]
    initial = models.tiny_random_model(len(models.load_tokenizer("smollm2-135m")), seed=0).state_dict()
    saved = FI.final_weights(run)
    assert all(torch.equal(saved[k], initial[k]) for k in saved)  # nothing of the bad updates was kept
    assert not (run / "checkpoints" / "step_000002").exists()


def test_run_stops_after_max_bad_steps_with_its_last_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    real = train.ppo_update

    def update(model, optimizer, rows, cfg, *args, **kwargs):   # from step 2 on every loss is NaN
        if update.calls >= 1:
            monkeypatch.setattr(P, "micro_logprobs", lambda *a, **k: real_logprobs(*a, **k) * float("nan"))
        update.calls += 1
        return real(model, optimizer, rows, cfg, *args, **kwargs)

    update.calls = 0
    real_logprobs = P.micro_logprobs
    monkeypatch.setattr(train, "ppo_update", update)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(train.main, ["--preset", "tiny", "--steps", "5", "--max_bad_steps", "2",
                                       "--out_dir", str(run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 3
    assert "stopped at step 3: 2 steps in a row had non-finite losses" in err
    # step 2's checkpoint is good (its bad mini-batches were never applied); step 3 writes none
    assert "last good checkpoint: " + str(run / "checkpoints" / "step_000002") in err
    assert not (run / "checkpoints" / "step_000003").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_minibatches"] > 0 for r in rows] == [False, True, True]
    assert [r["bad_steps_in_a_row"] for r in rows] == [0, 1, 2]
    weights = FI.final_weights(run)
    assert all(torch.isfinite(w).all() for w in weights.values())


# ------------------------------------------------------------------------------------------------------
# Out of memory while generating branches: halve the chunk, down to 1
# ------------------------------------------------------------------------------------------------------
def test_branch_chunk_halves_on_out_of_memory(tiny_policy, monkeypatch, capsys):
    from engine import BranchRequest
    from engine import generate as G

    model, tok = tiny_policy
    sampler = R.Sampler(model, R.stop_token_ids(tok, model), tok.pad_token_id)
    torch.manual_seed(0)
    base = R.sample_base(sampler, [tok("What is 1 + 1?").input_ids], 2, 6, keep_cache=True)
    requests = [BranchRequest(0, 2, 3, 6), BranchRequest(1, 3, 3, 6)]
    real = G.hf_generate
    sizes = []

    def small_gpu(self, input_ids, *args, **kwargs):   # "CUDA" that fits at most 2 rows
        sizes.append(input_ids.shape[0])
        if input_ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(G, "hf_generate", small_gpu)
    counters = {}
    out = G.sample_branches(sampler, base, requests, chunk_size=6, counters=counters)
    assert [len(per) for per in out] == [3, 3] and all(s.tokens for per in out for s in per)
    # 6 → 3 → 1 (3 // 2), then every branch once at the size that fits
    assert sizes == [6, 3, 1, 1, 1, 1, 1, 1]
    assert counters["oom_retries"] == 2
    assert "out of memory generating branches (6 at once): retrying at 3" in capsys.readouterr().err

    def no_gpu(self, input_ids, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(G, "hf_generate", no_gpu)
    with pytest.raises(torch.OutOfMemoryError):                 # gives up only at size 1
        G.sample_branches(sampler, base, requests, chunk_size=4, counters={})


def test_halving_chunks_keeps_order_and_reraises_other_errors():
    seen = []

    def run(chunk):
        seen.append(len(chunk))
        if len(chunk) > 3:
            raise RuntimeError("CUDA error: out of memory")
        return [x * 10 for x in chunk]

    assert oom.halving_chunks(list(range(10)), 8, run) == [x * 10 for x in range(10)]
    assert seen == [8, 4, 2, 2, 2, 2, 2]
    with pytest.raises(RuntimeError, match="shape"):
        oom.halving_chunks([1, 2], 2, lambda c: (_ for _ in ()).throw(RuntimeError("shape mismatch")))


# ------------------------------------------------------------------------------------------------------
# Signals
# ------------------------------------------------------------------------------------------------------
def test_first_signal_asks_to_stop_second_interrupts_at_once():
    # what SIGINT did before: Python's handler, or SIG_IGN when pytest was started in the background
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with signals.GracefulStop() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before   # restored


# ------------------------------------------------------------------------------------------------------
# Evaluation saves as it goes; a rerun skips what is saved and ends with the same numbers
# ------------------------------------------------------------------------------------------------------
def test_interrupted_evaluation_resumes_to_the_same_numbers(tmp_path, monkeypatch, capsys):
    args = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "3", "--k", "2",
            "--runs", "2", "--max_new_tokens", "5", "--gen_batch_size", "2"]
    clean = E.main(args + ["--out_dir", str(tmp_path / "clean")])["tiny-random"]["arith-test"]
    out = tmp_path / "cut"
    inject.install_crash_points("journal-append:2:SIGINT", monkeypatch.setattr)   # Ctrl-C after 2 of 6 calls
    partial = E.main(args + ["--out_dir", str(out)])
    assert partial == {"tiny-random": {}}
    assert "stopped by SIGINT in arith-test: 4 of 12 samples saved" in capsys.readouterr().out
    assert len((out / "samples_arith-test.jsonl").read_text().splitlines()) == 4
    with open(out / "samples_arith-test.jsonl", "a") as f:
        f.write('{"index": 2, "run"')                                    # and a line torn by a kill
    monkeypatch.undo()
    resumed = E.main(args + ["--resume", str(out)])["tiny-random"]["arith-test"]
    assert "reused the samples of an earlier run" in capsys.readouterr().out
    drop = ("seconds",)
    assert {k: v for k, v in resumed.items() if k not in drop} \
        == {k: v for k, v in clean.items() if k not in drop}
    assert (out / "samples_arith-test.jsonl").read_text() \
        == (tmp_path / "clean" / "samples_arith-test.jsonl").read_text()
    # the same command once more: nothing to sample, same numbers
    again = E.main(args + ["--out_dir", str(out)])["tiny-random"]["arith-test"]
    assert again["avg@k"] == clean["avg@k"] and again["pass@k"] == clean["pass@k"]


# ------------------------------------------------------------------------------------------------------
# Fault injection: real processes, SIGKILL at several moments (one mid-checkpoint-write), SIGTERM
# ------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_killed_and_stopped_runs_end_identical_to_an_uninterrupted_one(tmp_path):
    report = FI.scenario(tmp_path, FI.TINY_ARGS, stand_in=True)
    logs = {name: [(h["crash"], h["returncode"], h["stderr"][-400:]) for h in hist]
            for name, hist in report["chains"].items()}
    assert report["chains"]["clean"][0]["returncode"] == 0, logs
    killed, stopped = report["killed"], report["stopped"]
    assert killed["returncodes"] == [-signal.SIGKILL] * 4 + [0], logs
    # no checkpoint, none complete, 1, 2, the 3rd half-written
    assert killed["resumed_at"] == [0, 0, 1, 2, 2], logs
    assert killed["same_metrics"] and killed["identical_weights"], logs
    assert stopped["returncodes"] == [0, 0] and stopped["resumed_at"] == [0, 2], logs
    assert stopped["same_metrics"] and stopped["identical_weights"], logs
    assert stopped["steps_computed"] == 3                     # SIGTERM loses no step
    # step 3's update with lr = inf: refused, bit for bit
    poisoned = report["poisoned"]
    assert poisoned["returncodes"] == [0], logs
    assert poisoned["nonfinite_updates"] == [0, 0, 1], logs
    assert poisoned["earlier_steps_same"] and poisoned["weights_equal_before_refused_update"], logs
