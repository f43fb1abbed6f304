"""runs.py and its call sites in train.py: one run per folder, resume that checks what it resumes, damaged
checkpoints skipped, a full disk is one line, --keep_checkpoints, torn metrics lines named, oversized prompts
skipped before tokenizing, --stop_timeout. Each refusal asserts its exit code, its one line, and that no file
of the run was lost or changed (the run folder is hashed before and after)."""
import errno
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import fault_injection as FI
import pytest
import torch

import data
import evaluate as E
import rollout as R
from harness import guards, loop, measured, preflight, runs, signals
from runtime import faults

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


# ------------------------------------------------------------------------------------------------------
# Damaged safetensors headers, a run folder's name that is not UTF-8
# ------------------------------------------------------------------------------------------------------
def replace_header(path: Path, header) -> None:
    """The file with its JSON header replaced, padded to the same length (JSON allows trailing spaces)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    text = json.dumps(header).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])


def test_a_header_of_another_json_shape_falls_back_like_a_damaged_checkpoint(program_name, run, capsys):
    newest = run / "checkpoints" / "step_000002"
    replace_header(newest / "model.safetensors", [1, 2])     # a JSON array: was AttributeError .items()
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "1", "--resume", str(run), "--out_dir", str(run)])
    assert lines == [
        f"checkpoint {newest} is damaged (model.safetensors has a damaged header (a JSON array, not an "
        f"object)); resuming from the previous complete checkpoint {run / 'checkpoints' / 'step_000001'}",
        f"nothing left to run: {run / 'checkpoints' / 'step_000001'} is at step 1 of --steps 1; raise "
        f"--steps to train further"]
    assert folder_hash(run) == before


@pytest.mark.parametrize("header, why", [
    ({"weight": 3}, "'weight' is a JSON number, not an object"),
    ({"weight": {"dtype": "F32", "shape": [2]}}, "'weight' has no data_offsets [begin, end]"),
    ({"weight": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "'weight' has no shape of whole "
                                                                          "numbers"),
    ({"weight": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, "'weight' has no data_offsets "
                                                                         "[begin, end]"),
    ({"__metadata__": ["format", "pt"]}, "__metadata__ is not an object of strings"),
    ("pt", "a JSON string, not an object"),
    (None, "a JSON null, not an object"),
])
def test_a_named_checkpoint_with_a_header_of_another_shape_is_one_line(program_name, run, capsys, header,
                                                                       why):
    named = run / "checkpoints" / "step_000002"
    replace_header(named / "model.safetensors", header)
    before = folder_hash(run)
    line = run_cli(capsys, TINY + ["--steps", "3", "--resume", str(named), "--out_dir", str(run)], code=2,
                   one_error_line=True)[-1]
    assert line == (f"train.py: error: --resume {named}: no usable checkpoint (step_000002: "
                    f"model.safetensors has a damaged header ({why})); expected a checkpoint whose "
                    f"model.safetensors and trainer_state.pt are whole")
    assert folder_hash(run) == before


def test_a_header_nested_deeper_than_json_can_read_is_damage(program_name, tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(deep)) + deep)
    assert runs.safetensors_damage(path) == "model.safetensors unreadable (RecursionError)"


def test_a_run_folder_named_in_latin1_is_one_line_before_any_step(program_name, tmp_path, capsys):
    out = tmp_path / os.fsdecode(b"run\xe9")                  # failed at its first checkpoint, a step later
    line = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(out)], code=2, one_error_line=True)[-1]
    assert line == (f"train.py: error: --out_dir {tmp_path}/run\\xe9: byte 0xe9 at character "
                    f"{len(str(tmp_path)) + 5} is not UTF-8; expected a UTF-8 name (rename the file or "
                    f"folder): a run records its settings in UTF-8 files (config.json) (see --help)")
    assert folder_hash(tmp_path) == {}


# ------------------------------------------------------------------------------------------------------
# Checked before deleted, never through a link, one lock holder, the data a resume trains on
# ------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


EVAL = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "2", "--k", "2",
        "--max_new_tokens", "4", "--threads", "1"]



def run_one(capsys, argv, code=None) -> list[str]:
    """train.main as a command: its exit code is `code`, its error line the only one and the last."""
    return FI.run_cli(capsys, argv, code, one_error_line=code is not None)


@pytest.mark.parametrize("flags, line", [
    (["--resume", "{typo}"], "--resume {typo}: no such folder; expected a run folder"),        # the issue's
    (["--train_data", "{typo}.jsonl"], "--train_data {typo}.jsonl: no such file; expected"),   # a fresh run
    (["--resume", "{other}", "--lr", "0.5"], "--resume: the command line changes the experiment of the run "
                                             "it resumes (lr 0.001 -> 0.5)"),
])
def test_overwrite_true_with_a_typo_never_costs_the_run(run, tmp_path, capsys, flags, line):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    names = {"typo": str(tmp_path / "runn"), "other": str(other)}
    flags = [flag.format(**names) for flag in flags]
    before = folder_hash(run)
    lines = run_one(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--overwrite", "true", *flags],
                    code=2)
    assert line.format(**names) in lines[-1], lines[-1]
    assert folder_hash(run) == before


def test_a_symlinked_checkpoints_folder_works_for_resume_overwrite_and_pruning(run, tmp_path, capsys):
    scratch = tmp_path / "scratch" / "run_checkpoints"
    scratch.parent.mkdir()
    shutil.move(run / "checkpoints", scratch)
    (run / "checkpoints").symlink_to(scratch)
    # the example: a resume from an earlier checkpoint, named through the link, is this run's
    lines = run_one(capsys, TINY + ["--steps", "2", "--out_dir", str(run), "--resume",
                                    str(run / "checkpoints" / "step_000001")])
    assert any("later checkpoints step_000002" in x and "moved to" in x for x in lines), lines
    assert (run / "checkpoints").is_symlink() and (scratch / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in scratch.glob("step_*")) == ["step_000001", "step_000002"]
    # ... and the --overwrite true the old refusal advised replaces the run, the link kept; pruning works
    lines = run_one(capsys, TINY + ["--steps", "2", "--out_dir", str(run), "--overwrite", "true",
                                    "--keep_checkpoints", "1"])
    assert any("--overwrite true: the earlier run in" in x for x in lines), lines
    assert (run / "checkpoints").is_symlink() and sorted(os.listdir(scratch)) == ["latest", "step_000002"]
    assert not (run / "abandoned").exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # variant: the scratch disk is not mounted: one line, nothing changed (not a start over at step 0)
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(tmp_path / "unmounted" / "run_checkpoints")
    before = folder_hash(run)
    lines = run_one(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=2)
    assert lines[-1].endswith(f"error: --out_dir {run}: {run / 'checkpoints'} is a link to "
                              f"{tmp_path / 'unmounted' / 'run_checkpoints'}, which is not a folder here (a "
                              f"scratch disk not mounted?); expected the disk it points at mounted, or the "
                              f"link removed")
    assert folder_hash(run) == before


def test_pruning_and_overwrite_never_follow_a_link(tmp_path):
    """A step_* entry that is a link (to someone's folder) is unlinked by pruning, never emptied; --overwrite
    never deletes through a link among the run's files."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "keep").mkdir(parents=True)
    (elsewhere / "keep" / "trainer_state.pt").write_text("precious")
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints"
    for step in (2, 3):
        (folder / f"step_{step:06d}").mkdir(parents=True)
        (folder / f"step_{step:06d}" / "trainer_state.pt").write_text("x")
    (folder / "step_000001").symlink_to(elsewhere / "keep")
    before = folder_hash(elsewhere)
    assert runs.prune_checkpoints(run_dir, 1, written=folder / "step_000003") == [
        folder / "step_000001", folder / "step_000002"]
    assert sorted(os.listdir(folder)) == ["step_000003"] and folder_hash(elsewhere) == before
    (run_dir / "trees").symlink_to(elsewhere)
    (run_dir / "metrics.jsonl").write_text('{"step": 3}\n')
    assert preflight.check_new_run(run_dir, overwrite=True) is True
    assert sorted(os.listdir(run_dir)) == [] and folder_hash(elsewhere) == before


@pytest.mark.parametrize("main", [True, False])
def test_torchrun_ranks_never_read_what_rank_0_is_deleting(tmp_path, monkeypatch, main):
    """Every rank has read the folder (the checks) before rank 0 deletes, and none goes on before it is
    done: the earlier run's files exist at the first barrier and are gone at the second; rank 1 deletes
    nothing."""
    from harness import tracking
    from runtime import distributed as D

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_000001").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    seen = []
    monkeypatch.setattr(D, "is_main", lambda: main)
    monkeypatch.setattr(D, "barrier", lambda: seen.append((run_dir / "metrics.jsonl").exists()))
    loop.replace_earlier_run(run_dir, tracking.Log(run_dir, enabled=main))
    assert seen == ([True, False] if main else [True, True])


def test_a_resume_sets_checkpoints_aside_on_the_scratch_disk_they_are_on(tmp_path):
    """No rename crosses disks: with checkpoints/ linked to another disk, the checkpoints a resume abandons
    move to checkpoints/abandoned/ there (on the same disk: RUN/abandoned/, as the test above shows)."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another device than the temporary folder")
    scratch = Path(tempfile.mkdtemp(dir=shm, prefix="datpo_test_"))
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "checkpoints").symlink_to(scratch)
        for step in (1, 2, 3):
            (scratch / f"step_{step:06d}").mkdir()
            (scratch / f"step_{step:06d}" / "trainer_state.pt").write_text(str(step))
        moved, dest = runs.set_aside_later(run_dir, 1)
        assert moved == ["step_000002", "step_000003"]
        assert dest == run_dir / "checkpoints" / "abandoned" / "after_step_000001"
        assert sorted(os.listdir(scratch / "abandoned" / "after_step_000001")) == moved
        assert (scratch / "latest").read_text() == "step_000001" and not (run_dir / "abandoned").exists()
        assert [p.name for p in runs.checkpoint_steps(run_dir)] == ["step_000001"]
    finally:
        shutil.rmtree(scratch)


def plant(links: list[Path], victim: Path) -> None:
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(victim)


def test_links_planted_in_a_run_folder_never_redirect_a_write(run, tmp_path, capsys):
    victim, victim_dir = tmp_path / "victim.txt", tmp_path / "victim_dir"
    victim.write_text("precious\n")
    victim_dir.mkdir()
    pid = os.getpid()
    # the temporary names writers used (and the final name of the figure): a downloaded run can carry any
    plant([run / n for n in ("metrics.tmp", "config.json.tmp", "git_commit.txt.tmp", ".training.png.tmp",
                             f".run.lock.{pid}", f".write_test_{pid}", "training.png")]
          + [run / "checkpoints" / ".latest.tmp", run / "trees" / "step_000003.tmp"], victim)
    plant([run / "checkpoints" / ".tmp_step_000003"], victim_dir)
    run_one(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run),
                            "--log_trees_every", "1"])
    assert victim.read_text() == "precious\n" and os.listdir(victim_dir) == []
    assert not (run / "training.png").is_symlink() and (run / "training.png").stat().st_size > 0
    assert (run / "checkpoints" / "step_000003").is_dir() and (run / "trees" / "step_000003.jsonl").is_file()


def test_an_evaluation_is_never_reused_for_a_checkpoint_it_did_not_measure(run, tmp_path, capsys):
    out = tmp_path / "ev"
    flags = [f for f in EVAL if f not in ("--model", "tiny-random")]
    E.main(flags + ["--model", str(run), "--out_dir", str(out)])
    saved = json.loads((out / "results.json").read_text())["settings"]
    step2 = measured.weights_identity(str(run))
    assert (saved["step"], saved["weights"]) == (2, step2["weights"])
    run_one(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)])   # trained on
    step3 = measured.weights_identity(str(run))
    before = folder_hash(out)
    line = FI.refused_as(capsys, E.main, flags + ["--model", str(run), "--out_dir", str(out)], "evaluate.py")
    assert line == (f"evaluate.py: error: --out_dir {out}: {out / 'results.json'} holds results made with "
                    f"other settings (step 2 -> 3, weights {measured.short(step2['weights'])} -> "
                    f"{measured.short(step3['weights'])}); a folder holds one evaluation (one model and its "
                    f"settings, benchmarks added with the same ones); use another --out_dir, or --overwrite "
                    f"true to replace that evaluation (results.json, samples, figures)")
    assert folder_hash(out) == before


def test_a_resume_over_changed_data_rows_is_one_line(tmp_path, capsys):
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 9)]
    path, run_dir = tmp_path / "train.jsonl", tmp_path / "run"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = TINY + ["--train_data", str(path), "--out_dir", str(run_dir)]
    run_one(capsys, argv + ["--steps", "1"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))     # the same name, other rows
    before = folder_hash(run_dir)
    lines = run_one(capsys, argv + ["--steps", "2", "--resume", str(run_dir)], code=2)
    assert re.search(rf"error: --resume: the data's rows changed since the checkpoint was written "
                     rf"\(--train_data {re.escape(str(path))}: sha256:\w{{8}}… -> sha256:\w{{8}}…: a file "
                     rf"edited or replaced under the same name\); expected the rows the run trained on, or "
                     rf"--allow_config_change true to continue on these \(recorded in config.json's "
                     rf"history\)$", lines[-1]), lines[-1]
    assert folder_hash(run_dir) == before
    # variant: a deliberate change, recorded in config.json's history
    run_one(capsys, argv + ["--steps", "2", "--resume", str(run_dir), "--allow_config_change", "true"])
    (history,) = json.loads((run_dir / "config.json").read_text())["history"]
    old, new = history["changed"]["train_data rows"]
    assert old != new and new == measured.problems_hash(data.load_problems(str(path)))


TAKE_OVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from harness import runs
from runtime import faults
say = runs.say
def slow_say(text):   # the moment between judging the lock stale and replacing it, made long
    say(text)
    time.sleep(0.5)
runs.say = slow_say
while time.time() < float(sys.argv[3]):
    time.sleep(0.001)
try:
    runs.RunLock(sys.argv[2]).acquire()
    print("won", flush=True)
    time.sleep(1.5)   # holding it while the other one tries
except faults.UserError as err:
    print("lost", err, flush=True)
"""


def stale_lock(folder: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (folder / "run.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                                 "started": "2020-01-01T00:00:00"}))


def test_two_processes_taking_over_a_stale_lock_cannot_both_win(tmp_path):
    stale_lock(tmp_path)
    start = time.time() + 3
    children = [subprocess.Popen([sys.executable, "-c", TAKE_OVER, str(ROOT), str(tmp_path), str(start)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [child.communicate(timeout=60)[0].strip() for child in children]
    assert sorted(r.split()[0] for r in results) == ["lost", "won"], results
    loser = next(r for r in results if r.startswith("lost"))
    assert "another run is writing there (pid" in loser


def test_threads_taking_over_a_stale_lock_cannot_both_win(tmp_path, monkeypatch):
    stale_lock(tmp_path)
    monkeypatch.setattr(runs, "say", lambda text: time.sleep(0.3))
    gate, outcomes = threading.Barrier(4), []

    def take():
        gate.wait()
        try:
            runs.RunLock(tmp_path).acquire()
            outcomes.append("won")
        except faults.UserError:
            outcomes.append("lost")

    workers = [threading.Thread(target=take) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert sorted(outcomes) == ["lost", "lost", "lost", "won"]
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
