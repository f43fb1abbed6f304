"""Hostile input, round three (issue 36), run folders, results and races: one test per class, each with the
issue's example and a variant. Every refusal asserts its exit code, its one line and that the folders
involved are byte-identical afterwards; at 8560b75 each of these deleted a run, wrote through a planted
link, reported numbers of something it had not measured, let two processes hold one lock, lost a stop's
deadline, or ended in a traceback.

1 deleted before checked: --overwrite true, --resume, pruning and the eval journal check everything first;
  a symlinked checkpoints/ works for resume, overwrite and pruning (a dangling one is one line)
2 writes that follow planted links: temporary files are created exclusively and renamed into place
3 results that know what they measured: evaluation files, study caches and a resume's data
4 races: a stale run.lock taken over by one process only; a stop's deadline survives the grader's alarm;
  an explosive gold answer is refused at load
5 lost or unsafe results: result.json written whole; no bench script unpickles
6 study flags and study files as one line
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import data
import evaluate as E
import reward
from harness import atomic, faults, measured, runs, signals
from studies import __main__ as studies_cli
from studies import common, main_table

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_injection as FI  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]
FINISHED_STEPS = 2   # the `finished` / `run` fixtures (tests/conftest.py): 2 steps, a checkpoint at each
EVAL = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "2", "--k", "2",
        "--max_new_tokens", "4", "--threads", "1"]
folder_hash = FI.folder_hash


def run_cli(capsys, argv, code=None) -> list[str]:
    """train.main as a command: its exit code is `code`, its error line the only one and the last."""
    return FI.run_cli(capsys, argv, code, one_error_line=code is not None)


def refused(capsys, main, argv, program: str, code: int = 2) -> str:
    """`main` run as the command `program`: exit `code`, one error line and no traceback; that line."""
    capsys.readouterr()
    saved, sys.argv[0] = sys.argv[0], program
    try:
        with pytest.raises(SystemExit) as exit_info:
            faults.main_guard(main, argv)
    finally:
        sys.argv[0] = saved
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------------------------------------------
# 1. Nothing deleted before the command is known valid
# ------------------------------------------------------------------------------------------------------
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
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--overwrite", "true", *flags],
                    code=2)
    assert line.format(**names) in lines[-1], lines[-1]
    assert folder_hash(run) == before


def test_a_symlinked_checkpoints_folder_works_for_resume_overwrite_and_pruning(run, tmp_path, capsys):
    scratch = tmp_path / "scratch" / "run_checkpoints"
    scratch.parent.mkdir()
    shutil.move(run / "checkpoints", scratch)
    (run / "checkpoints").symlink_to(scratch)
    # the example: a resume from an earlier checkpoint, named through the link, is this run's
    lines = run_cli(capsys, TINY + ["--steps", "2", "--out_dir", str(run), "--resume",
                                    str(run / "checkpoints" / "step_000001")])
    assert any("later checkpoints step_000002" in x and "moved to" in x for x in lines), lines
    assert (run / "checkpoints").is_symlink() and (scratch / "latest").read_text() == "step_000002"
    assert sorted(p.name for p in scratch.glob("step_*")) == ["step_000001", "step_000002"]
    # ... and the --overwrite true the old refusal advised replaces the run, the link kept; pruning works
    lines = run_cli(capsys, TINY + ["--steps", "2", "--out_dir", str(run), "--overwrite", "true",
                                    "--keep_checkpoints", "1"])
    assert any("--overwrite true: the earlier run in" in x for x in lines), lines
    assert (run / "checkpoints").is_symlink() and sorted(os.listdir(scratch)) == ["latest", "step_000002"]
    assert not (run / "abandoned").exists()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    # variant: the scratch disk is not mounted: one line, nothing changed (not a start over at step 0)
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(tmp_path / "unmounted" / "run_checkpoints")
    before = folder_hash(run)
    lines = run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)], code=2)
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
    assert faults.check_new_run(run_dir, overwrite=True) is True
    assert sorted(os.listdir(run_dir)) == [] and folder_hash(elsewhere) == before


@pytest.mark.parametrize("main", [True, False])
def test_torchrun_ranks_never_read_what_rank_0_is_deleting(tmp_path, monkeypatch, main):
    """Every rank has read the folder (the checks) before rank 0 deletes, and none goes on before it is
    done: the earlier run's files exist at the first barrier and are gone at the second; rank 1 deletes
    nothing."""
    from harness import distributed as D
    from harness import loop, tracking

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


def test_samples_without_their_state_are_never_dropped_silently(tmp_path, capsys):
    out = tmp_path / "ev"
    E.main(EVAL + ["--out_dir", str(out)])
    samples, state = out / "samples_arith-test.jsonl", out / "samples_arith-test.jsonl.state"
    held = len(samples.read_text().splitlines())
    state.unlink()
    # the example: results.json vouches for their settings; they are sampled again, said in a line
    E.main(EVAL + ["--out_dir", str(out)])
    assert (f"{samples}: its {held} saved record(s) are not reused (no state file vouches for them); sampled "
            f"again") in capsys.readouterr().err
    assert state.exists() and len(samples.read_text().splitlines()) == held
    # variant: nothing vouches for them (no results.json either): refused, the folder unchanged
    state.unlink()
    (out / "results.json").unlink()
    before = folder_hash(out)
    line = refused(capsys, E.main, EVAL + ["--out_dir", str(out)], "evaluate.py")
    assert line == (f"evaluate.py: error: --out_dir {out}: samples_arith-test.jsonl holds {held} samples of "
                    f"arith-test but no state file says what they measured (samples_arith-test.jsonl.state "
                    f"missing or unreadable), so they cannot be reused; --overwrite true samples them again, "
                    f"or use another --out_dir")
    assert folder_hash(out) == before


# ------------------------------------------------------------------------------------------------------
# 2. No write follows a link planted in a folder
# ------------------------------------------------------------------------------------------------------
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
    run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run),
                            "--log_trees_every", "1"])
    assert victim.read_text() == "precious\n" and os.listdir(victim_dir) == []
    assert not (run / "training.png").is_symlink() and (run / "training.png").stat().st_size > 0
    assert (run / "checkpoints" / "step_000003").is_dir() and (run / "trees" / "step_000003.jsonl").is_file()


def test_links_planted_in_an_evaluation_folder_never_redirect_a_write(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "ev"
    plant([out / n for n in ("samples_arith-test.jsonl.tmp", "samples_arith-test.jsonl.state.tmp",
                             ".results.json.tmp", ".pass_curves.png.tmp", ".maj_vs_avg.png.tmp",
                             "maj_vs_avg.png")], victim)
    E.main(EVAL + ["--out_dir", str(out)])
    assert victim.read_text() == "precious\n" and not (out / "maj_vs_avg.png").is_symlink()
    assert json.loads((out / "results.json").read_text())["benchmarks"]["arith-test"]["k"] == 2
    # the helpers alone: a temporary file is never a name that exists, and a rename replaces a link
    taken = atomic.exclusive_temp(out / "x")
    assert taken.is_file() and not taken.is_symlink() and taken.name.startswith(".x.")
    atomic.write_text(out / "results.json", "{}")
    assert victim.read_text() == "precious\n"


# ------------------------------------------------------------------------------------------------------
# 3. Results that know what they measured
# ------------------------------------------------------------------------------------------------------
def test_an_evaluation_is_never_reused_for_a_checkpoint_it_did_not_measure(run, tmp_path, capsys):
    out = tmp_path / "ev"
    flags = [f for f in EVAL if f not in ("--model", "tiny-random")]
    E.main(flags + ["--model", str(run), "--out_dir", str(out)])
    saved = json.loads((out / "results.json").read_text())["settings"]
    step2 = measured.weights_identity(str(run))
    assert (saved["step"], saved["weights"]) == (2, step2["weights"])
    run_cli(capsys, TINY + ["--steps", "3", "--out_dir", str(run), "--resume", str(run)])   # trained on
    step3 = measured.weights_identity(str(run))
    before = folder_hash(out)
    line = refused(capsys, E.main, flags + ["--model", str(run), "--out_dir", str(out)], "evaluate.py")
    assert line == (f"evaluate.py: error: --out_dir {out}: {out / 'results.json'} holds results made with "
                    f"other settings (step 2 -> 3, weights {measured.short(step2['weights'])} -> "
                    f"{measured.short(step3['weights'])}); a folder holds one evaluation (one model and its "
                    f"settings, benchmarks added with the same ones); use another --out_dir, or --overwrite "
                    f"true to replace that evaluation (results.json, samples, figures)")
    assert folder_hash(out) == before


def test_a_score_cache_is_recomputed_for_another_checkpoint(run, tmp_path, capsys):
    """main-table: a cell's cache written at step 1 is not its score once it trained to step 2."""
    study = studies_cli.make_study("main-table", ["--scale", "tiny", "--out_dir", str(tmp_path / "mt")])
    cfg = main_table.cell_config(study, "paper", 3, run)
    cache = study.out / "scores" / "paper_s3.json"
    first = main_table.evaluate_cell(study, cfg, run / "checkpoints" / "step_000001", cache)
    assert first["measured"]["step"] == 1
    capsys.readouterr()
    second = main_table.evaluate_cell(study, cfg, run / "checkpoints" / "step_000002", cache)
    weights = [measured.short(measured.weights_identity(str(run / "checkpoints" / s))["weights"])
               for s in ("step_000001", "step_000002")]
    assert second["measured"]["step"] == 2 and second["checkpoint"].endswith("step_000002")
    assert (f"{cache}: measured something else (step 1 -> 2, weights {weights[0]} -> {weights[1]}); "
            f"computed again") in capsys.readouterr().err
    assert main_table.evaluate_cell(study, cfg, run / "checkpoints" / "step_000002", cache) == second
    assert "computed again" not in capsys.readouterr().err                    # the same: reused


def test_a_finished_cell_trained_with_other_settings_is_never_scored_as_this_one(tmp_path):
    """main-table: a cell folder whose run had another experiment (the study's flags changed since) or went
    past --steps is one line, not a checkpoint scored under this cell's name."""
    study = studies_cli.make_study("main-table", ["--scale", "tiny", "--out_dir", str(tmp_path / "mt")])
    run_dir = study.out / "runs" / "paper_s0"
    cfg = main_table.cell_config(study, "paper", 0, run_dir)
    (run_dir / "checkpoints" / "step_000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000003" / "trainer_state.pt").write_text("x")
    (run_dir / "config.json").write_text(cfg.to_json())
    before = folder_hash(run_dir)
    with pytest.raises(faults.UserError) as err:    # trained past --steps (2), no checkpoint at step 2
        main_table.train_cell(cfg)
    assert str(err.value) == (f"main-table: the cell {run_dir} trained to step_000003, past --steps 2, and "
                              f"keeps no checkpoint at step 2; expected the --steps it ran with, or another "
                              f"--out_dir")
    (run_dir / "config.json").write_text(json.dumps({**json.loads(cfg.to_json()), "lr": 0.5}))
    with pytest.raises(faults.UserError) as err:
        main_table.train_cell(cfg)
    assert str(err.value).startswith(f"main-table: the cell {run_dir} was trained with other settings (lr "
                                      f"0.5 -> {cfg.lr!r}); expected the flags the study ran with")
    assert {k: v for k, v in folder_hash(run_dir).items() if k != "config.json"} == \
        {k: v for k, v in before.items() if k != "config.json"}


def test_dynamics_never_takes_one_runs_scores_for_another_of_the_same_name(run, tmp_path, capsys):
    a, b = tmp_path / "a" / "demo", tmp_path / "b" / "demo"
    shutil.copytree(run, a)
    run_cli(capsys, TINY + ["--steps", "1", "--seed", "4", "--out_dir", str(b)])   # another step 1
    out = tmp_path / "dyn"
    studies_cli.main(["dynamics", "--scale", "tiny", "--out_dir", str(out), "--runs", str(a), str(b)])
    runs_ = json.loads((out / "result.json").read_text())["runs"]
    assert set(runs_) == {"a/demo (datpo)", "b/demo (datpo)"}
    for label, folder in (("a/demo (datpo)", a), ("b/demo (datpo)", b)):
        for step, scores in runs_[label]["checkpoints"].items():
            checkpoint = folder / "checkpoints" / f"step_{int(step):06d}"
            assert scores["measured"]["weights"] == measured.files_hash(checkpoint)
    assert runs_["a/demo (datpo)"]["checkpoints"]["1"]["measured"]["weights"] != \
        runs_["b/demo (datpo)"]["checkpoints"]["1"]["measured"]["weights"]
    assert len(list((out / "scores" / "demo").glob("step_000001_*.json"))) == 2   # one cache each


def test_a_resume_over_changed_data_rows_is_one_line(tmp_path, capsys):
    rows = [{"problem": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 9)]
    path, run_dir = tmp_path / "train.jsonl", tmp_path / "run"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = TINY + ["--train_data", str(path), "--out_dir", str(run_dir)]
    run_cli(capsys, argv + ["--steps", "1"])
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[::-1]))     # the same name, other rows
    before = folder_hash(run_dir)
    lines = run_cli(capsys, argv + ["--steps", "2", "--resume", str(run_dir)], code=2)
    assert re.search(rf"error: --resume: the data's rows changed since the checkpoint was written "
                     rf"\(--train_data {re.escape(str(path))}: sha256:\w{{8}}… -> sha256:\w{{8}}…: a file "
                     rf"edited or replaced under the same name\); expected the rows the run trained on, or "
                     rf"--allow_config_change true to continue on these \(recorded in config.json's "
                     rf"history\)$", lines[-1]), lines[-1]
    assert folder_hash(run_dir) == before
    # variant: a deliberate change, recorded in config.json's history
    run_cli(capsys, argv + ["--steps", "2", "--resume", str(run_dir), "--allow_config_change", "true"])
    (history,) = json.loads((run_dir / "config.json").read_text())["history"]
    old, new = history["changed"]["train_data rows"]
    assert old != new and new == measured.problems_hash(data.load_problems(str(path)))


# ------------------------------------------------------------------------------------------------------
# 4. Races: one lock holder; a stop's deadline and the grader's alarm compose; explosive golds
# ------------------------------------------------------------------------------------------------------
TAKE_OVER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from harness import faults, runs
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


def test_a_stop_during_grading_keeps_its_deadline(monkeypatch, capsys):
    reward._load_math_verify()

    def slow_check(pred, gold):   # the stop signal lands while the grader holds SIGALRM
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            pass
        return True

    monkeypatch.setattr(reward, "_math_verify_equal", slow_check)

    def step(argv):
        with signals.GracefulStop(timeout=0.5):
            reward._verify_with_alarm("x", "y", 3.0)
            while True:   # the rest of a step that never reaches its safe point
                time.sleep(0.01)

    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(step, [])
    assert exit_info.value.code == 130 and time.perf_counter() - t0 < 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: stopped mid-step by SIGTERM: no safe point within --stop_timeout 0.5s; "
                            "the step in progress is lost, --resume continues from the last checkpoint")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_pending_stop_leaves_the_grader_its_own_bound(monkeypatch):
    """The other way round: with a stop (and its deadline) pending, a check that would never end is still
    cut at the grader's own bound, in process; the stop is still pending, and reaching the safe point
    before the deadline ends it cleanly (a late watchdog call is not a second signal)."""
    reward._load_math_verify()

    def endless(pred, gold):
        while True:
            pass

    monkeypatch.setattr(reward, "_math_verify_equal", endless)
    with signals.GracefulStop(timeout=1.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.perf_counter()
        assert reward._verify_with_alarm("x", "y", 0.3) is None      # its own alarm fired
        assert time.perf_counter() - t0 < 0.9 and stop.requested == "SIGTERM"
        stop.cancel_timeout()                                       # the safe point
        time.sleep(1.3)                                             # past the deadline: nothing raised
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0


@pytest.mark.parametrize("gold", ["9^{9^{9^{9}}}", "10^{10^{10}}"])
def test_an_explosive_gold_answer_is_refused_at_load(tmp_path, capsys, gold):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"problem": "Tower?", "answer": gold}) + "\n"
                    + json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    out = tmp_path / "ev"
    line = refused(capsys, E.main, EVAL + ["--bench", str(path), "--out_dir", str(out)], "evaluate.py")
    assert line == (f"evaluate.py: error: --bench {path}: {path.parent.name}/{path.name} line 1: field "
                    f"'answer' gives the answer {gold!r}, a form the grader never evaluates (an exponent "
                    f"tower such as 9^{{9^{{9}}}}, a power, factorial or binomial of a huge number, or "
                    f"braces nested too deep), so no equivalent answer could match it; expected the answer "
                    f"itself")
    assert not out.exists()
    # training data skips it out loud, as for every gold answer no response can match
    skipped = []
    problems = data.load_problems(str(path), None, skipped.append)
    assert [p["answer"] for p in problems] == ["2"] and "problem skipped" in skipped[0]


# ------------------------------------------------------------------------------------------------------
# 5. Lost or unsafe results
# ------------------------------------------------------------------------------------------------------
def test_a_torn_result_json_write_keeps_the_sampled_records(tmp_path, monkeypatch):
    study = studies_cli.make_study("tree-vs-parallel", ["--scale", "tiny", "--out_dir", str(tmp_path / "t")])
    records = [{"repeat": 0, "problem": 0, "parallel/2": {"tokens": 10, "pass_rate": 1.0, "leaves": 2}}]
    common.write_outputs(study, {"records": records}, "table\n", 1.0)
    before = folder_hash(study.out)
    real = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):   # the write dies after half of the new result.json
        real(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        common.write_outputs(study, {"records": []}, "other table\n", 2.0)
    monkeypatch.undo()
    assert folder_hash(study.out) == before                                  # no torn file, no temporary
    assert json.loads((study.out / "result.json").read_text())["records"] == records


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


# ------------------------------------------------------------------------------------------------------
# 6. Study flags and study files: one line each
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, line", [
    (["tree-vs-parallel", "--data", "{tmp}/missing.jsonl"],
     "--data {tmp}/missing.jsonl: no such file; expected a .jsonl/.json/.parquet/.csv file or one of"),
    (["forks", "--from_result", "true"],
     "--from_result true: {out}/result.json: not found; expected the result.json a finished `forks` run "
     "wrote into --out_dir {out} (run it once without --from_result)"),
    (["tree-vs-parallel", "--levels", "9"],
     "--levels 9: no problem of --data arith-test has one of them; its levels are 1, 2, 3, 4, 5"),
    (["tree-vs-parallel", "--from_result", "true", "--torn"],
     "--from_result true: {out}/result.json: unreadable or torn ("),
    (["tree-vs-parallel", "--from_result", "true", "--parallel_m", "2", "8", "--earlier"],
     "--from_result true: {out}/result.json: made with other settings than this command's (--parallel_m "
     "[2, 4] -> [2, 8])"),
    (["dynamics", "--runs", "{tmp}/nothing"],
     "--runs {tmp}/nothing: {tmp}/nothing/metrics.jsonl not found; expected a train.py run folder"),
    (["difficulty-report", "--from_dir", "{tmp}"],
     "--from_dir {tmp}: no trained runs under {tmp}/runs; expected the folder of `python -m studies "
     "difficulty`"),
    (["forks", "--k", "0"], "--k: got 0, expected an integer >= 1 and <= 65536"),
])
def test_study_flags_and_files_are_one_line(tmp_path, capsys, argv, line):
    out = tmp_path / "out"
    out.mkdir()
    if "--torn" in argv or "--earlier" in argv:
        result = {"study": "tree-vs-parallel", "records": [{"problem": 0}], "config": {},
                  "options": {"parallel_m": [2, 4]}}
        (out / "result.json").write_text(json.dumps(result)[:40] if "--torn" in argv else json.dumps(result))
        argv = [a for a in argv if a not in ("--torn", "--earlier")]
    names = {"tmp": tmp_path, "out": out}
    before = folder_hash(out)
    got = refused(capsys, studies_cli.main, [a.format(**names) for a in argv]
                  + ["--scale", "tiny", "--out_dir", str(out)], "python -m studies")
    assert got.startswith("python -m studies: error: " + line.format(**names)), got
    assert folder_hash(out) == before
