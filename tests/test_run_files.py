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

import config as C
import evaluate
import models
import offpolicy
import optim as O
import prompts
import rollout as R
from engine import Sample
from harness import journal, loop, runs
from runtime import faults

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import os
import sys

import fault_injection as FI  # noqa: E402

TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]
REFUSED = "not only tensors and plain values: refused unloaded, nothing in it ran"


def run_cli(capsys, argv, code=None) -> list[str]:
    """train.main as a command: its exit code is `code`, its error line the only one and the last."""
    return FI.run_cli(capsys, argv, code, one_error_line=True)


folder_hash = FI.folder_hash


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


# the `finished` and `run` fixtures (tests/conftest.py): a tiny run of 3 steps, copied per test
FINISHED_STEPS = 3


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
    ahead = offpolicy.Batch(["p"], ["1"], [None], [[Sample([1, 2], [0.5, 0.25], [-1.0, -2.0])]], 1)
    cfg = C.make_config("tiny")
    stream = prompts.PromptStream([], cfg, None, None)
    stream.cursor, stream.batch_size, stream.too_long, stream.ahead = 5, 4, {7, 3}, ahead
    run_state = loop.RunState(step=2, prompts=stream)
    saved = {"optimizer": optimizer.state_dict(), **run_state.trainer_state(),
             "config": {"lr": 1e-3, "x": [1]}}
    torch.save(saved, tmp_path / "trainer_state.pt")
    state, why = runs.load_trainer_state(tmp_path)
    assert why is None
    master = state["optimizer"]["state"][0]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, saved["optimizer"]["state"][0]["master"])
    again = loop.RunState(prompts=prompts.PromptStream([], cfg, None, None))
    again.restore(state)
    assert (again.step, again.prompts.cursor, again.prompts.too_long) == (2, 5, {3, 7})
    assert again.prompts.ahead == run_state.prompts.ahead and state["config"] == saved["config"]
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
    assert (tmp_path / "samples_arith.jsonl").read_text() == ""
    assert runs.load_plain(first.state_path)["n_records"] == 0           # a new state: nothing done yet


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
# 4. Resume from an earlier checkpoint, pruning and `latest`
# ------------------------------------------------------------------------------------------------------
def test_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(run, capsys):
    checkpoints = run / "checkpoints"
    later = {name: folder_hash(checkpoints / name) for name in ("step_000002", "step_000003")}
    lines = run_cli(capsys, TINY + ["--steps", "2", "--keep_checkpoints", "1", "--out_dir", str(run),
                                    "--resume", str(checkpoints / "step_000001")])
    aside = run / "abandoned" / "after_step_000001"
    assert (f"--resume {checkpoints / 'step_000001'}: the later checkpoints step_000002, step_000003 (the "
            f"continuation this resume abandons) moved to {aside}; no resume picks them again, delete that "
            f"folder when you no longer need them") in lines
    assert {name: folder_hash(aside / name) for name in later} == later       # moved whole, not deleted
    # what it just wrote survives --keep_checkpoints 1; `latest` names it; step 1 pruned
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002"]
    assert (checkpoints / "latest").read_text() == "step_000002"
    assert runs.checkpoint_damage(checkpoints / "step_000002")[1] is None
    assert models.resolve_checkpoint(str(run)) == str(checkpoints / "step_000002")
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3, 1_000_000):
        (folder / f"step_{step:06d}").mkdir(parents=True)
        (folder / f"step_{step:06d}" / "trainer_state.pt").write_text("x")
    assert runs.checkpoint_steps(tmp_path)[-1].name == "step_1000000"          # by number, not by name
    written = folder / "step_000002"
    assert runs.prune_checkpoints(tmp_path, 1, written=written) == [folder / "step_000001"]
    assert sorted(p.name for p in folder.iterdir()) == ["step_000002", "step_000003", "step_1000000"]


# ------------------------------------------------------------------------------------------------------
# 5. Stop signals never wait for an evaluation
# ------------------------------------------------------------------------------------------------------
EVAL = ["--eval_every", "1", "--eval_limit", "4", "--eval_k", "2", "--gen_batch_size", "2"]  # 4 calls each
LATER = "--bench arith-test --k 2 --limit 4 --max_new_tokens 12"


def stand_in_grade(text, problem, fallback=False):
    """Right for half of all texts, by a hash (the tiny model never is): numbers that depend on samples."""
    return None, bool(hashlib.sha256(text.encode()).digest()[0] % 2)


@pytest.fixture
def eval_calls(monkeypatch):
    """Counts evaluation generate calls; signal_at[n]: the signal sent as call n starts ("load": while the
    model loads)."""
    calls = {"n": 0, "signal_at": {}}
    real_rows, real_load = evaluate.sample_rows, models.load_policy

    def rows(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in calls["signal_at"]:
            os.kill(os.getpid(), calls["signal_at"][calls["n"]])
        return real_rows(*args, **kwargs)

    def load(*args, **kwargs):
        if "load" in calls["signal_at"]:
            os.kill(os.getpid(), calls["signal_at"].pop("load"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(evaluate, "sample_rows", rows)
    monkeypatch.setattr(evaluate, "grade", stand_in_grade)
    monkeypatch.setattr(models, "load_policy", load)
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    return calls


def test_signal_while_loading_never_starts_the_before_evaluation(tmp_path, capsys, eval_calls):
    eval_calls["signal_at"]["load"] = signal.SIGINT
    lines = run_cli(capsys, TINY + EVAL + ["--steps", "2", "--out_dir", str(tmp_path / "run")])
    assert eval_calls["n"] == 0
    assert (f"[eval before @ step 0] skipped: stopped by SIGINT; the run starts with it again, or run it "
            f"alone: python evaluate.py --model tiny-random {LATER}") in lines
    assert "stopped by SIGINT before step 1" in lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_signal_during_an_evaluation_reaches_the_checkpoint_and_resume_runs_it(tmp_path, capsys,
                                                                              eval_calls):
    clean, stopped = tmp_path / "clean", tmp_path / "stopped"
    run_cli(capsys, TINY + EVAL + ["--steps", "3", "--out_dir", str(clean)])
    assert eval_calls["n"] == 16                                    # before, during @ 1 and 2, after @ 3
    eval_calls["n"], eval_calls["signal_at"] = 0, {6: signal.SIGTERM}   # the eval at step 1, its 2nd call
    lines = run_cli(capsys, TINY + EVAL + ["--steps", "3", "--out_dir", str(stopped)])
    assert eval_calls["n"] == 6                                     # calls 7 and 8 never ran
    checkpoint = stopped / "checkpoints" / "step_000001"
    assert (f"[eval during @ step 1] skipped: stopped by SIGTERM; --resume runs it first, or run it alone: "
            f"python evaluate.py --model {checkpoint} {LATER}") in lines
    assert lines[-1] == (f"stopped by SIGTERM after step 1: checkpoint {checkpoint}; continue with the same "
                         f"command plus --resume {stopped}")
    assert runs.load_plain(checkpoint / "trainer_state.pt")["pending_eval"] == "during"
    assert [r.get("eval") for r in FI.metric_rows(stopped)] == ["before", None]
    run_cli(capsys, TINY + EVAL + ["--steps", "3", "--out_dir", str(stopped), "--resume", str(stopped)])
    assert FI.metric_rows(stopped) == FI.metric_rows(clean)    # the skipped evaluation's samples included
    assert FI.identical_weights(clean, stopped)
    assert len({r["avg@2"] for r in FI.metric_rows(clean) if "eval" in r}) > 1   # they depend on samples


def test_signal_during_an_evaluation_of_a_step_with_no_checkpoint_due_still_saves_it(tmp_path, capsys,
                                                                                      eval_calls):
    """On b940752 the evaluation ran to its end, no checkpoint was due (--save_every 10) and the next step's
    check stopped the run: step 1 was lost."""
    eval_calls["signal_at"] = {6: signal.SIGTERM}
    out = tmp_path / "run"
    lines = run_cli(capsys, TINY + EVAL + ["--steps", "3", "--save_every", "10", "--out_dir", str(out)])
    assert eval_calls["n"] == 6
    assert lines[-1].startswith(f"stopped by SIGTERM after step 1: checkpoint {out / 'checkpoints'}")
    assert runs.checkpoint_damage(out / "checkpoints" / "step_000001")[1] is None


# ------------------------------------------------------------------------------------------------------
# 6. A full disk: exit 4, one line, no partial folder
# ------------------------------------------------------------------------------------------------------
TORCH_FULL = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
CUT_SHORT = "disk full or over quota (torch.save's write was cut short: unexpected pos 576 vs 534)"


def test_disk_full_inside_torch_save_is_one_line_and_leaves_no_partial_folder(run, capsys, monkeypatch):
    real = torch.save

    def cut_short(obj, f, *args, **kwargs):   # what torch.save does when the disk fills: part of a file
        if str(f).endswith("trainer_state.pt"):
            Path(f).write_bytes(b"PK\x03\x04 partial")
            raise RuntimeError(TORCH_FULL)
        return real(obj, f, *args, **kwargs)

    checkpoints = run / "checkpoints"
    before = folder_hash(checkpoints)
    monkeypatch.setattr(torch, "save", cut_short)
    lines = run_cli(capsys, TINY + ["--steps", "4", "--out_dir", str(run), "--resume", str(run)], code=4)
    assert lines[-1].endswith(
        f"error: writing checkpoint {checkpoints / 'step_000004'}: {CUT_SHORT} "
        f"({checkpoints / '.tmp_step_000004'}); previous checkpoint {checkpoints / 'step_000003'} intact; "
        f"free space and resume with --resume {run}")
    assert folder_hash(checkpoints) == before                       # no .tmp_step_000004 left
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000001", "step_000002",
                                                             "step_000003"]


def test_disk_full_in_a_journal_state_is_one_line(tmp_path, monkeypatch):
    first = journal.Journal(tmp_path / "s.jsonl", {"k": 1})
    first.append([{"index": 0}])
    before = folder_hash(tmp_path)

    def cut_short(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"PK\x03\x04 partial")
        raise RuntimeError(TORCH_FULL)

    monkeypatch.setattr(torch, "save", cut_short)
    with pytest.raises(faults.WriteError) as err:
        first.append([{"index": 1}])
    assert err.value.exit_code == 4 and str(err.value) == (
        f"writing {tmp_path / 's.jsonl'}: {CUT_SHORT}; its first 1 records are kept (a rerun of the same "
        f"command continues from them); free space and rerun it")
    after = folder_hash(tmp_path)
    assert after.keys() == before.keys()                            # no .tmp left
    assert after["s.jsonl.state"] == before["s.jsonl.state"]
    monkeypatch.undo()
    assert [r["index"] for r in journal.Journal(tmp_path / "s.jsonl", {"k": 1}).resume()] == [0]


@pytest.mark.parametrize("full_at", ["run.lock", "config.json", "git_commit.txt"])
def test_disk_full_at_run_start_is_one_line_and_leaves_no_partial_file(tmp_path, capsys, monkeypatch,
                                                                      full_at):
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):   # a full disk: the file is created, part of it written
        if self.name.startswith(f".{full_at}."):   # its temporary file (runtime/atomic.py)
            real(self, text[:7], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "run"
    lines = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(out)], code=4)
    kept = "nothing of the run was written" if full_at == "run.lock" else "no step has run"
    assert lines[-1].endswith(f"error: writing {out / full_at}: disk full (No space left on device); {kept}; "
                              f"free space and run the same command again")
    whole = {"config.json"} if full_at == "git_commit.txt" else set()
    assert set(folder_hash(out)) == whole                           # nothing partial, the lock released
    if whole:
        assert json.loads((out / "config.json").read_text())["steps"] == 1


def _can_mount_tmpfs(folder: Path) -> bool:
    folder.mkdir()
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=22m", "tmpfs", str(folder)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def test_a_really_full_disk_while_checkpointing(tmp_path, capsys, monkeypatch):
    """The same on a 22 MB tmpfs (root only): the first checkpoint does not fit."""
    disk = tmp_path / "disk"
    if not _can_mount_tmpfs(disk):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
        lines = run_cli(capsys, TINY + ["--steps", "2", "--out_dir", str(disk / "run")], code=4)
        assert re.search(r"error: writing checkpoint .*step_000001: disk full or over quota \(torch.save's "
                         r"write was cut short: unexpected pos \d+ vs \d+\) .*no earlier checkpoint; free "
                         r"space", lines[-1])
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == []
    finally:   # lazy: a file the failed write left open (held by the error) must not keep it mounted
        subprocess.run(["umount", "-l", str(disk)], check=True)


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


# ------------------------------------------------------------------------------------------------------
# 8. The tree viewer
# ------------------------------------------------------------------------------------------------------




PAGE_STATE = """(() => {
  document.querySelector('rect.block[data-tree="0"][data-id="0"]')
    .dispatchEvent(new MouseEvent('click', {bubbles: true}));
  return {rendered: document.body.dataset.rendered, blocks: document.querySelectorAll('rect.block').length,
          scripts: document.scripts.length, imgs: document.images.length,
          first: document.querySelector('#detail .tok').textContent,
          h2: document.querySelector('h2').textContent, meta: document.querySelector('.meta').textContent};
})()"""


# ------------------------------------------------------------------------------------------------------
# Bench scripts load nothing that runs code
# ------------------------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parent.parent


def test_no_bench_script_unpickles_anything(tmp_path, capsys):
    for path in sorted((ROOT / "bench").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|joblib|cloudpickle)\b|pickle\.loads?\(",
                             text, re.M), path
        for call in re.findall(r"torch\.load\([^)]*\)", text):
            assert "weights_only=True" in call, (path, call)
    # bench_update's rollout cache is JSON: a planted cache is one line and runs nothing
    saved_argv, saved_env, sys.argv = sys.argv, dict(os.environ), ["bench_update.py"]
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_update  # it sets the thread policy's variables on import: put back below
    finally:
        sys.argv = saved_argv
        sys.path.remove(str(ROOT / "bench"))
        os.environ.clear()
        os.environ.update(saved_env)
    marker, cache = tmp_path / "ran", tmp_path / "paper-8.json"
    torch.save({"x": FI_payload(marker)}, cache)
    with pytest.raises(SystemExit) as exit_info:
        bench_update.trees_from_json(cache)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and not marker.exists()
    assert err.startswith(f"bench_update.py: error: --cache {cache}: not a tree cache this script wrote")


class FI_payload:
    """Unpickling it would run `touch marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)
