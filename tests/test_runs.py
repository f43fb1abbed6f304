"""runs.py and its call sites in train.py: one run per folder, resume that checks what it resumes, damaged
checkpoints skipped, a full disk is one line, --keep_checkpoints, torn metrics lines named, oversized prompts
skipped before tokenizing, --stop_timeout. Each refusal asserts its exit code, its one line, and that no file
of the run was lost or changed (the run folder is hashed before and after)."""
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import data
import rollout as R
from harness import faults, guards, runs, signals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_injection as FI  # noqa: E402

TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]


folder_hash, run_cli = FI.folder_hash, FI.run_cli


# the `finished` and `run` fixtures (tests/conftest.py): a tiny run of 2 steps, copied per test
FINISHED_STEPS = 2


# ------------------------------------------------------------------------------------------------------
# One run per folder
# ------------------------------------------------------------------------------------------------------
def test_second_run_into_a_locked_folder_stops_naming_the_holder(run, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = run / "run.lock"
        lock.write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname(), "started": "then"}))
        before = folder_hash(run)
        lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=2)
        assert lines[-1].endswith(f"error: --out_dir {run}: another run is writing there (pid {holder.pid} "
                                  f"on {socket.gethostname()}, since then, {lock}); wait for it, stop it, or "
                                  f"use another --out_dir")
        assert sum("error:" in x for x in lines) == 1
        assert folder_hash(run) == before                                  # the holder's files untouched
        # --overwrite true does not get past a live holder either
        run_cli(capsys, TINY + ["--steps", "2", "--out_dir", str(run), "--overwrite", "true"], code=2)
        assert folder_hash(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_stale_lock_of_a_dead_run_is_taken_over(run, capsys):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)])
    assert f"{run / 'run.lock'}: stale lock taken over (pid {dead.pid} is not running; an earlier run was " \
           f"killed)" in lines
    assert not (run / "run.lock").exists()                                 # released at the end
    assert (run / "checkpoints" / "step_000003").exists()


def test_lock_is_exclusive_and_released(tmp_path):
    with runs.RunLock(tmp_path) as lock:
        assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
        with pytest.raises(faults.UserError, match=f"another run is writing there \\(pid {os.getpid()} on"):
            runs.RunLock(tmp_path).acquire()
        assert lock.held
    assert not (tmp_path / "run.lock").exists()
    # another host: never guessed
    (tmp_path / "run.lock").write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
    with pytest.raises(faults.UserError, match="pid 1 on host elsewhere.*if that run is gone, delete"):
        runs.RunLock(tmp_path).acquire()


# ------------------------------------------------------------------------------------------------------
# Resume checks what it resumes
# ------------------------------------------------------------------------------------------------------
def test_resume_with_another_experiment_is_refused_listing_the_fields(run, capsys):
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--method", "grpo", "--lr", "2e-3", "--out_dir", str(run),
                                    "--resume", str(run)], code=2)
    assert lines[-1].endswith("error: --resume: the command line changes the experiment of the run it "
                              "resumes (clip_high 0.2 -> 0.28, lr 0.001 -> 0.002, method 'datpo' -> 'grpo'); "
                              "expected the run's "
                              "own settings (its config.json), or --allow_config_change true to continue it "
                              "as a mix")
    assert folder_hash(run) == before


def test_allowed_and_forced_changes_are_recorded_in_config_history(run, capsys):
    run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)])
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["steps"] == 3 and cfg["history"] == [{"resumed_at_step": 2, "changed": {
        "steps": [2, 3], "resume": ["", str(run)],
        "out_dir": [cfg["history"][0]["changed"]["out_dir"][0], str(run)]}}]
    run_cli(capsys, TINY + ["--steps", "4", "--lr", "2e-3", "--allow_config_change", "true",
                            "--out_dir", str(run), "--resume", str(run)])
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["lr"] == 2e-3 and cfg["history"][1] == {
        "resumed_at_step": 3, "changed": {"allow_config_change": [False, True], "lr": [0.001, 0.002],
                                          "steps": [3, 4]}}


def test_check_resume_config_splits_allowed_from_experiment_fields():
    saved = {"method": "datpo", "steps": 10, "seed": 0, "report_to": ["none"], "added_later": 1}
    new = {"method": "datpo", "steps": 20, "seed": 0, "report_to": ["tensorboard"]}
    assert runs.check_resume_config(saved, new) == {"report_to": (["none"], ["tensorboard"]),
                                                    "steps": (10, 20)}
    with pytest.raises(faults.UserError, match=r"\(seed 0 -> 1\)"):
        runs.check_resume_config(saved, {**new, "seed": 1})
    assert runs.check_resume_config(saved, {**new, "seed": 1}, allow=True)["seed"] == (0, 1)
    # a field renamed since (runs.RENAMED_FIELDS) is compared under its new name
    with pytest.raises(faults.UserError, match=r"\(branch_length 'remaining' -> 'full'\)"):
        runs.check_resume_config({**saved, "branch_budget": "remaining"}, {**new, "branch_length": "full"})
    assert runs.check_resume_config({**saved, "branch_budget": "full"}, {**new, "branch_length": "full"}) \
        == {"report_to": (["none"], ["tensorboard"]), "steps": (10, 20)}


def test_resume_into_a_folder_holding_another_run_is_refused(run, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    (other / "metrics.jsonl").write_text((other / "metrics.jsonl").read_text() + '{"step": 9, "mine": 1}\n')
    before = folder_hash(other)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(other), "--resume", str(run)], code=2)
    assert lines[-1].endswith(f"error: --resume {run} --out_dir {other}: {other} holds another run; "
                              f"continuing run there would overwrite its records; use --out_dir {run} "
                              f"(or a new folder), or --overwrite true to replace it")
    assert folder_hash(other) == before


def test_resume_of_a_finished_run_into_a_new_folder_has_nothing_to_run(run, tmp_path, capsys):
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "2", "--out_dir", str(tmp_path / "new"), "--resume", str(run)])
    assert lines[-1] == (f"nothing left to run: {run / 'checkpoints' / 'step_000002'} is at step 2 of "
                         f"--steps 2; raise --steps to train further")
    assert folder_hash(run) == before


# ------------------------------------------------------------------------------------------------------
# Damaged checkpoints, full disk, --keep_checkpoints
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["model.safetensors", "trainer_state.pt"])
def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(run, capsys, damage):
    latest = run / "checkpoints" / "step_000002" / damage
    # truncated, as a full disk leaves it
    latest.write_bytes(latest.read_bytes()[: latest.stat().st_size // 2])
    lines = run_cli(capsys, TINY + ["--steps", "2", "--out_dir", str(run), "--resume", str(run)])
    warning = [x for x in lines if x.startswith("checkpoint ")]
    assert len(warning) == 1 and warning[0].startswith(f"checkpoint {run / 'checkpoints' / 'step_000002'} is "
                                                       f"damaged ({damage} ")
    assert warning[0].endswith(f"resuming from the previous complete checkpoint "
                               f"{run / 'checkpoints' / 'step_000001'}")
    assert f"resumed from {run / 'checkpoints' / 'step_000001'} at step 1" in lines
    # step 2 redone and rewritten
    assert runs.checkpoint_damage(run / "checkpoints" / "step_000002")[1] is None


def test_no_usable_checkpoint_is_one_line_naming_them(run, capsys):
    for step in (1, 2):
        path = run / "checkpoints" / f"step_00000{step}" / "model.safetensors"
        path.write_bytes(path.read_bytes()[:100])
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=2)
    assert ("error: --resume" in lines[-1]
            and "no usable checkpoint (step_000002: model.safetensors truncated" in lines[-1]
            and "step_000001: model.safetensors truncated" in lines[-1])
    assert folder_hash(run) == before


def test_disk_full_while_checkpointing_is_one_line_and_keeps_the_previous_checkpoint(
        run, capsys, monkeypatch):
    real = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if str(f).endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *args, **kwargs)

    previous = folder_hash(run / "checkpoints" / "step_000002")
    monkeypatch.setattr(torch, "save", full_disk)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=4)
    tmp = run / "checkpoints" / ".tmp_step_000003" / "trainer_state.pt"
    assert lines[-1].endswith(f"error: writing checkpoint {run / 'checkpoints' / 'step_000003'}: disk full "
                              f"(No space left on device) ({tmp}); previous checkpoint "
                              f"{run / 'checkpoints' / 'step_000002'} intact; free space and resume with "
                              f"--resume {run}")
    assert sum("error:" in x for x in lines) == 1
    assert folder_hash(run / "checkpoints" / "step_000002") == previous
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"


def test_disk_full_while_logging_is_one_line(run, capsys, monkeypatch):
    from harness import tracking

    def full_disk(path, *args, **kwargs):   # what open() of metrics.jsonl raises on a full disk
        if str(path).endswith("metrics.jsonl") and args and args[0] == "a":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(tracking, "open", full_disk, raising=False)
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=4)
    assert lines[-1].endswith(f"error: writing {run / 'metrics.jsonl'}: disk full (No space left on "
                              f"device); the step's record is lost, checkpoints are intact; free space and "
                              f"--resume {run}")
    assert sum("error:" in x for x in lines) == 1
    changed = {k for k in set(before) | set(folder_hash(run)) if before.get(k) != folder_hash(run).get(k)}
    assert changed == {"config.json"}                                      # --steps 3 recorded in its history


def test_keep_checkpoints_keeps_the_newest(run, capsys):
    run_cli(capsys, TINY + ["--steps", "4", "--keep_checkpoints", "2", "--out_dir", str(run),
                            "--resume", str(run)])
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000003", "step_000004"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000004"


# ------------------------------------------------------------------------------------------------------
# metrics.jsonl: torn lines named, lost steps named
# ------------------------------------------------------------------------------------------------------
def test_torn_middle_metrics_line_is_named_with_its_step(run, capsys):
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    (run / "metrics.jsonl").write_text(lines[0][:30] + "\n" + lines[1] + "\n")   # line 1 torn
    out = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)])
    assert f"{run / 'metrics.jsonl'} line 1: torn (not a JSON record); dropped" in out
    assert f"{run / 'metrics.jsonl'}: no record of step(s) 1 (lost before the checkpoint at step 2; those " \
           f"steps are not redone)" in out
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [2, 3]


def test_read_metrics_names_torn_lines(tmp_path):
    from harness import tracking

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "re\n\n{"step": 3}\nnot json\n')
    records, torn = tracking.read_metrics(path)
    assert [r["step"] for r in records] == [1, 3] and torn == [2, 5]


# ------------------------------------------------------------------------------------------------------
# Oversized prompts: judged by their characters before tokenizing
# ------------------------------------------------------------------------------------------------------
def test_oversized_prompt_is_skipped_before_tokenizing_with_one_line(tmp_path, capsys, monkeypatch,
                                                                    smollm_tokenizer):
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(2)]
    rows.insert(1, {"problem": "1 + " * 2_000_000 + "1 = ?", "answer": "2000001"})   # 8 MB of text
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert data.surely_too_long(rows[1]["problem"], 512, smollm_tokenizer) > 512
    assert data.surely_too_long(rows[0]["problem"], 512, smollm_tokenizer) == 0
    t0 = time.perf_counter()
    lines = run_cli(capsys, TINY + ["--steps", "3", "--max_prompt_tokens", "512", "--train_data", str(path),
                                    "--out_dir", str(tmp_path / "run")])
    skipped = [x for x in lines if "characters, more than --max_prompt_tokens" in x]
    # once, though it comes round
    assert skipped == [f"{path} problem #1: {len(rows[1]['problem'])} characters, more than "
                       f"--max_prompt_tokens 512 tokens; skipped (each time it comes round)"]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["skipped_prompts"] >= 2                                  # 3 steps of 2: it came round twice
    assert time.perf_counter() - t0 < 60                                  # tokenizing 8 MB alone takes longer


# ------------------------------------------------------------------------------------------------------
# A stop is honoured in bounded time
# ------------------------------------------------------------------------------------------------------
def test_stop_timeout_ends_a_step_that_never_reaches_a_safe_point(capsys):
    def endless():
        with signals.GracefulStop(timeout=0.3) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested == "SIGTERM"
            while True:            # a step that never ends
                time.sleep(0.01)

    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(lambda argv: endless(), [])
    assert exit_info.value.code == 130 and time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: stopped mid-step by SIGTERM: no safe point within --stop_timeout 0.3s; "
                            "the step in progress is lost, --resume continues from the last checkpoint")
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0                    # alarm and handlers restored
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_stop_timeout_is_cancelled_at_the_safe_point():
    with signals.GracefulStop(timeout=0.2) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        stop.cancel_timeout()      # the step ended: the checkpoint is written without a deadline
        time.sleep(0.4)
    assert stop.requested == "SIGTERM"


# ------------------------------------------------------------------------------------------------------
# Non-finite weights that got past the checks
# ------------------------------------------------------------------------------------------------------
def test_sampling_that_meets_nonfinite_probabilities_is_one_line(tmp_path):
    with pytest.raises(faults.NonFiniteStop) as err:
        with guards.sampling_guard(5, tmp_path):
            torch.multinomial(torch.tensor([[float("nan"), 1.0]]), 1)
    assert err.value.exit_code == 3
    assert str(err.value) == ("step 5: sampling met non-finite probabilities (the policy's logits); the "
                              "latest checkpoint (none) holds the weights that produced them; expected a "
                              "resume from an earlier checkpoint with a lower --lr")
    # any other error keeps its traceback
    with pytest.raises(RuntimeError, match="shape"):
        with guards.sampling_guard(5, tmp_path):
            raise RuntimeError("shape mismatch")


def test_resume_from_a_checkpoint_with_nonfinite_weights_is_refused(run, capsys):
    from safetensors.torch import load_file, save_file

    path = run / "checkpoints" / "step_000002" / "model.safetensors"
    weights = load_file(str(path))
    name = sorted(weights)[0]
    # written before the weight guard existed
    weights[name].view(-1)[0] = float("inf")
    save_file(weights, str(path), metadata={"format": "pt"})
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=2)
    assert lines[-1].endswith(f"error: --resume {run / 'checkpoints' / 'step_000002'}: its weights hold "
                              f"non-finite values; expected an earlier checkpoint of the run or a healthy "
                              f"model")
    assert folder_hash(run) == before
