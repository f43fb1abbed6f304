"""Hostile files and mistyped folders (issue 29, part A): one test per class of what failed on b940752.

1 a trainer_state.pt holding a pickle payload is refused; nothing in it runs
2 so is an evaluation journal's state file
3 --out_dir that is a checkpoint, a model or a run's own subfolder is refused (--overwrite or not)
4 a resume from an earlier checkpoint sets the later ones aside; pruning never deletes what it just wrote
  and `latest` never names a missing folder
5 a stop signal never waits for an evaluation: skipped, and run by the resume (exactly as it would have run)
6 a full disk (inside torch.save, at run start, in a journal) is exit 4, one line, no partial file
7 a torn config.json on resume is one line
8 the tree viewer: no text changes the page's structure; bad logs and outputs are one line; math text
Each refusal asserts its exit code, its one line and that the folders involved are byte-identical after."""
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import evaluate
import models
import offpolicy
import optim as O
import rollout as R
import train
from harness import faults, journal, loop, runs, viz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_injection as FI  # noqa: E402
from browser import Chromium, find_chromium  # noqa: E402

TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]
REFUSED = "not only tensors and plain values: refused unloaded, nothing in it ran"


def folder_hash(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


def run_cli(capsys, argv, code=None) -> list[str]:
    """train.main as a command; stderr's lines. `code`: the exit code expected, whose line must be the
    only error line and the last (None: the command returns)."""
    if code is None:
        faults.main_guard(train.main, argv)
    else:
        with pytest.raises(SystemExit) as exit_info:
            faults.main_guard(train.main, argv)
        assert exit_info.value.code == code, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]
    if code is not None:
        assert sum("error:" in x for x in lines) == 1 and "error:" in lines[-1], lines
    return lines


class Payload:
    """Unpickling it runs `touch marker` (what a planted trainer state or journal state would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(path: Path, marker: Path) -> None:
    """Add a Payload to the torch file at `path` (written by the project, loaded here as its author)."""
    state = torch.load(path, weights_only=False)
    state["note"] = Payload(marker)
    torch.save(state, path)
    assert not marker.exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step tiny run, a checkpoint at each step (copied per test)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    mp = pytest.MonkeyPatch()
    mp.setattr(R, "compute_reward", FI.stand_in_reward)
    try:
        train.main(TINY + ["--steps", "3", "--out_dir", str(run)])
    finally:
        mp.undo()
    return run


@pytest.fixture
def run(finished, tmp_path, monkeypatch):
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    return copy


# ------------------------------------------------------------------------------------------------------
# 1. trainer_state.pt: tensors and plain values only
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps", [4, 3])     # a resume with a step left; one with nothing left to run
def test_trainer_state_payload_never_runs_and_is_refused(run, tmp_path, capsys, steps):
    marker = tmp_path / "ran"
    state = run / "checkpoints" / "step_000003" / "trainer_state.pt"
    plant(state, marker)
    before = folder_hash(run)
    argv = TINY + ["--steps", str(steps), "--out_dir", str(run)]
    lines = run_cli(capsys, argv + ["--resume", str(run)], code=2)
    assert lines[-1].endswith(
        f"error: --resume {run}: {state} holds a Python object (posix.system), {REFUSED}; expected a "
        f"trainer state written by train.py (resume from a checkpoint you trust, or get the run from its "
        f"source again)")
    assert not marker.exists()
    assert folder_hash(run) == before
    # named explicitly: the same; an earlier checkpoint of the folder is never tried in its place
    run_cli(capsys, argv + ["--resume", str(state.parent)], code=2)
    assert not marker.exists() and folder_hash(run) == before


def test_trainer_state_of_every_kind_loads_with_weights_only(tmp_path):
    """What train.py saves — RNG states, AdamWFP32's fp32 masters, the off-policy batch, the config —
    comes back equal through runs.load_trainer_state (weights_only=True)."""
    model = torch.nn.Linear(3, 2).to(torch.bfloat16)
    optimizer = O.AdamWFP32(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3, dtype=torch.bfloat16)).float().sum().backward()
    optimizer.step()
    ahead = offpolicy.Batch(["p"], ["1"], [None], [[[[1, 2], [0.5, 0.25], [-1.0, -2.0]]]], 1)
    run_state = loop.RunState(step=2, cursor=5, batch_size=4, too_long={7, 3}, ahead=ahead)
    saved = {"optimizer": optimizer.state_dict(), **run_state.trainer_state(),
             "config": {"lr": 1e-3, "x": [1]}}
    torch.save(saved, tmp_path / "trainer_state.pt")
    state, why = runs.load_trainer_state(tmp_path)
    assert why is None
    master = state["optimizer"]["state"][0]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, saved["optimizer"]["state"][0]["master"])
    again = loop.RunState()
    again.restore(state)
    assert (again.step, again.cursor, again.too_long) == (2, 5, {3, 7})
    assert again.ahead == run_state.ahead and state["config"] == saved["config"]
    assert again.rng.getstate() == run_state.rng.getstate()
    # a state of another shape is damaged (skipped like a torn one), not a traceback
    torch.save({**saved, "step": "two"}, tmp_path / "trainer_state.pt")
    assert runs.load_trainer_state(tmp_path) == (
        None, "trainer_state.pt is not train.py's (field 'step' missing or not int)")


# ------------------------------------------------------------------------------------------------------
# 2. The evaluation journal's state file
# ------------------------------------------------------------------------------------------------------
def test_journal_state_payload_never_runs_and_is_refused(tmp_path):
    marker = tmp_path / "ran"
    settings = {"bench": "arith", "k": 2}
    first = journal.Journal(tmp_path / "samples_arith.jsonl", settings)
    first.append([{"index": 0, "response": "1"}])
    first.append([{"index": 1, "response": "2"}])
    plant(first.state_path, marker)
    before = folder_hash(tmp_path)
    with pytest.raises(faults.UserError) as err:
        journal.Journal(tmp_path / "samples_arith.jsonl", settings).resume()
    assert err.value.exit_code == 2
    assert str(err.value) == (
        f"{first.state_path} holds a Python object (posix.system), {REFUSED}; expected the state "
        f"evaluate.py writes beside samples_arith.jsonl: delete both to start this evaluation over, or use "
        f"another --out_dir")
    assert not marker.exists() and folder_hash(tmp_path) == before
    # plain values of another shape: not ours, started over (as a torn state file is)
    torch.save({"settings": settings, "units": "2", "n_records": 2, "rng": torch.get_rng_state()},
               first.state_path)
    assert journal.Journal(tmp_path / "samples_arith.jsonl", settings).resume() == []
    assert (tmp_path / "samples_arith.jsonl").read_text() == "" and not first.state_path.exists()


def test_journal_written_state_resumes(tmp_path):
    settings = {"bench": "arith", "k": 2}
    first = journal.Journal(tmp_path / "s.jsonl", settings, extra={"bench": "arith"})
    first.append([{"index": 0}])
    torch.rand(3)
    first.append([{"index": 1}, {"index": 2}])
    after = torch.get_rng_state()
    torch.rand(3)                                                      # moves on; resume() restores it
    again = journal.Journal(tmp_path / "s.jsonl", settings)
    assert [r["index"] for r in again.resume()] == [0, 1, 2] and (again.units, again.n_records) == (2, 3)
    assert torch.equal(torch.get_rng_state(), after)


# ------------------------------------------------------------------------------------------------------
# 3. --out_dir that belongs to something else
# ------------------------------------------------------------------------------------------------------
@pytest.fixture
def model_folder(finished, tmp_path):
    """A model folder: a checkpoint's weights, config and tokenizer, without its trainer state."""
    folder = tmp_path / "model"
    shutil.copytree(finished / "checkpoints" / "step_000001", folder,
                    ignore=shutil.ignore_patterns("trainer_*"))
    return folder


@pytest.mark.parametrize("overwrite", ["false", "true"])
def test_out_dir_of_a_checkpoint_a_model_or_a_runs_subfolder_is_refused(run, model_folder, capsys,
                                                                        overwrite):
    step1 = run / "checkpoints" / "step_000001"
    weights = "config.json + model.safetensors"
    cases = {
        step1: f"is the checkpoint step_000001 of the run {run}",
        step1 / "sub": f"is inside the checkpoint step_000001 of the run {run}",
        run / "checkpoints": f"is the checkpoints/ folder of the run {run}",
        run / "trees" / "x": f"is inside the trees/ folder of the run {run}",
        model_folder: f"is a model folder ({weights}): the run's config.json would replace the model's",
        model_folder / "run": f"is inside the model folder {model_folder} ({weights})",
    }
    before = {folder: folder_hash(folder) for folder in (run, model_folder)}
    for out_dir, owner in cases.items():
        lines = run_cli(capsys, TINY + ["--steps", "1", "--model", str(model_folder), "--out_dir",
                                        str(out_dir), "--overwrite", overwrite], code=2)
        assert lines[-1].endswith(
            f"error: --out_dir {out_dir}: {owner}; a run writes only into a new folder or a run folder of "
            f"its own (--overwrite true does not change that); expected another --out_dir, e.g. runs/NAME"), \
            (out_dir, lines[-1])
        assert not out_dir.exists() or out_dir in (step1, run / "checkpoints", model_folder)
    assert {folder: folder_hash(folder) for folder in (run, model_folder)} == before


# ------------------------------------------------------------------------------------------------------
# 7. A torn config.json on resume
# ------------------------------------------------------------------------------------------------------
def test_torn_config_json_on_resume_is_one_line(run, capsys):
    config = run / "config.json"
    config.write_text(config.read_text()[:300])
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "4", "--out_dir", str(run), "--resume", str(run)], code=2)
    assert re.search(rf"error: --resume: {re.escape(str(config))}: torn or not JSON \(.* line \d+ column "
                     r"\d+ .*\); expected the run's settings as train.py wrote them: restore it, or delete "
                     r"it and the resume writes it anew \(its resume history is lost\)$", lines[-1])
    assert not any(x.startswith("resumed from") for x in lines)     # refused before the model loads
    assert folder_hash(run) == before
