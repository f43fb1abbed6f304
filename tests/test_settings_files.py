"""Issue 44, settings: one checker for every source of settings — the command line, --config FILE, a run's
config.json under --resume, the presets and Configs built in code — with the same kinds, names and
defaults; and the test command's workers from the cores this process may use."""
import json
import os
import shutil
import subprocess
import sys

import conftest
import fault_injection as FI
import pytest

import config as C
import train
from harness import cli
from runtime import threads


def settings(tmp_path, name: str, changes: dict, drop=()) -> str:
    """The tiny preset's settings as a file, with `changes` and without the keys `drop`."""
    values = {**json.loads(C.make_config("tiny").to_json()), **changes}
    for key in drop:
        values.pop(key)
    path = tmp_path / name
    path.write_text(json.dumps(values))
    return str(path)


def a_run_folder(tmp_path, changes: dict) -> str:
    """A run folder as train.py leaves one (its config.json), edited by hand."""
    run = tmp_path / "run"
    run.mkdir()
    settings(run, "config.json", {"out_dir": str(run), **changes})
    return str(run)


@pytest.mark.parametrize("source, changes, expected", [
    # the example: a string is truthy, so "false" ran a model folder's own code
    ("config", {"trust_remote_code": "false"},
     '"trust_remote_code": got the string "false", expected true or false (a JSON boolean: no quotes)'),
    # a run's own config.json, edited: steps with a fraction were a traceback after the model loaded
    ("resume", {"steps": 2.0}, '"steps": got 2.0, expected an integer'),
    ("config", {"eval_every": True}, '"eval_every": got true, expected an integer'),
    ("config", {"report_to": "wandb"}, '"report_to": got the string "wandb", expected a list of strings'),
    # unknown keys are one line; TRL's names are read as on the command line, or refused with what to use
    ("config", {"learnin_rate": 1e-6}, 'unknown setting "learnin_rate" (did you mean "learning_rate"?); '
                                       "expected the fields of config.py (train.py --help lists them) or "
                                       "TRL's or verl's names for them (see --help)"),
    ("resume", {"per_device_train_batch_size": 4}, "--per_device_train_batch_size (TRL): TRL counts "
                                                   "completions per device"),
])
def test_a_settings_file_is_checked_like_the_command_line(program_name, tmp_path, capsys, source, changes,
                                                         expected):
    if source == "config":
        path = settings(tmp_path, "mine.json", changes)
        argv = ["--config", path]
    else:
        run = a_run_folder(tmp_path, changes)
        path, argv = f"{run}/config.json", ["--resume", run]
    before = FI.folder_hash(tmp_path)
    line = FI.refused_as(capsys, train.main, argv, "train.py")
    assert line.startswith(f"train.py: error: --{source} {path}: {expected}")
    assert line.endswith("(see --help)")
    assert FI.folder_hash(tmp_path) == before              # nothing loaded, nothing written


def test_names_in_a_settings_file_mean_what_they_mean_on_the_command_line(tmp_path):
    trl = {"learning_rate": 1e-4, "bf16": False, "lr_scheduler_type": "cosine",
           "history": [{"resumed_at_step": 1}]}
    path = settings(tmp_path, "trl.json", trl, drop=("lr", "precision", "lr_schedule"))
    cfg = cli.parse_args(["--config", path])
    flags = cli.parse_args(["--preset", "tiny", "--learning_rate", "1e-4", "--bf16", "false",
                            "--lr_scheduler_type", "cosine"])
    assert (cfg.lr, cfg.precision, cfg.lr_schedule) == (flags.lr, flags.precision, flags.lr_schedule) == \
        (1e-4, "fp32", "cosine")
    # a float field given an integer holds a float; an old run's removed field is read without a word
    cfg = cli.parse_args(["--config", settings(tmp_path, "one.json", {"lr": 1, "naive_prefill": False})])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    # ours and TRL's name for one field in one file: one line, as on the command line
    with pytest.raises(SystemExit):
        cli.parse_args(["--config", settings(tmp_path, "both.json", {"learning_rate": 1e-4})])


def test_a_settings_file_without_out_dir_never_writes_into_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = cli.parse_args(["--config", settings(tmp_path, "exp.json", {}, drop=("out_dir",))])
    assert cfg.out_dir == "runs/exp"          # the issue's: "" trained into ./ and replaced ./config.json
    cfg = cli.parse_args(["--config", settings(tmp_path, "blank.json", {"out_dir": ""})])
    assert cfg.out_dir == "runs/blank"
    assert cli.parse_args(["--config", settings(tmp_path, "x.json", {}), "--out_dir", "r"]).out_dir == "r"


def test_presets_and_configs_built_in_code_meet_the_same_checks():
    with pytest.raises(ValueError, match=r"^--steps: got 2\.0, expected an integer$"):
        C.make_config("tiny", steps=2.0)
    with pytest.raises(ValueError, match=r'^--trust_remote_code: got the string "false", expected true or '
                                         r'false$'):
        C.make_config("tiny", trust_remote_code="false")
    with pytest.raises(ValueError, match=r"^--reward_weights: got \[1, \"a\"\], expected a list of numbers$"):
        C.make_config("tiny", reward=["a.py:f", "a.py:g"], reward_weights=[1, "a"])
    for preset in C.PRESETS:                 # every shipped preset at every scale passes them
        for scale in C.SCALES:
            C.make_config(preset, scale)


# ------------------------------------------------------------------------------------------------------
# The test command's workers: the cores this process may use
# ------------------------------------------------------------------------------------------------------
def test_the_test_command_starts_a_worker_per_usable_core(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    for cores, workers in [(1, 0), (2, 2), (8, 8)]:   # one core: in this process, no worker at all
        monkeypatch.setattr(threads, "usable_cores", lambda cores=cores: cores)
        assert conftest.pytest_xdist_auto_num_workers(None) == workers
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")   # xdist's own override still wins
    assert conftest.pytest_xdist_auto_num_workers(None) == 3


def test_a_cgroup_quota_caps_the_workers(tmp_path):
    (tmp_path / "cpu.max").write_text("200000 100000\n")     # a 2-CPU container, whatever the host has
    assert threads.cgroup_cpu_limit(tmp_path) == 2
    assert conftest.auto_workers(min(64, threads.cgroup_cpu_limit(tmp_path))) == 2


@pytest.mark.skipif(shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and two cores")
def test_one_usable_core_runs_the_suite_in_process():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-m", "pytest",
                          "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_style.py"],
                         cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTEST_XDIST_AUTO_NUM_WORKERS": ""})
    assert out.returncode == 0, out.stderr
    assert "workers" not in out.stdout and "test_style.py::" in out.stdout
