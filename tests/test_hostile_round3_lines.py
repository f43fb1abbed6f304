"""Hostile input, round three (issue 36): the last tracebacks turned into lines. One test per class, the
issue's example and a variant; each asserts the exit code, the single line, and that the folders involved
are byte-identical where nothing should change. At 8560b75 each of these ended in a traceback (or in a blank
page with exit 0, or in 517 MiB converted into the working directory).

1 names matplotlib reads as math text (a run `${M}_${S}`, a problem `$x \\le 5$`, a token `$$`) are drawn as
  written: a finished run draws training.png, show-forks and evaluate's figures draw
2 a safetensors header of any JSON shape is a damaged checkpoint: skipped, or one line when named
3 a benchmark (or any flag's name) that is not UTF-8, or too long for its samples file, is one line
4 the tree viewer: a stray trees/step_final.jsonl is skipped with a line; NaN in a log is a named line
5 WORLD_SIZE= or WORLD_SIZE=2 outside torchrun is one line
6 DATPO_CACHE empty, a file, read-only, or a conversion interrupted: the right folder, or one line, nothing
  left behind"""
import contextlib
import errno
import io
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import evaluate as E
import models
from harness import faults, figures, loop, runs, viz

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_injection as FI  # noqa: E402
from fault_injection import folder_hash, run_cli  # noqa: E402
from test_hostile_eval import refused as evaluate_refused  # noqa: E402

TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]
FINISHED_STEPS = 2     # conftest's `finished` / `run`: a 2-step run, a checkpoint each step
MATH_TEXT = ["${M}_${S}", "$x \\le 5$", "$$", "$\\frac{$", "cost $5 and $6", "a\\$b$c$"]


@pytest.fixture(autouse=True)
def program_name(monkeypatch):
    """The program name the user sees in a line: `python train.py` runs these commands."""
    monkeypatch.setattr(sys, "argv", ["train.py"])


# ------------------------------------------------------------------------------------------------------
# 1. Math text in names and problems
# ------------------------------------------------------------------------------------------------------
FINISHED = {}   # the stderr of the module's finished run


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Overrides conftest's: the module's tiny run (TINY, FINISHED_STEPS) trained to its end as `python
    train.py` runs it, into a folder named like math text, `${M}_${S}` (the issue's case: a job script's
    unexpanded name, whose training.png title ended the finished run with a ParseException). Its stderr is
    kept in FINISHED; `run` (conftest) copies it."""
    import rollout
    import train

    run_dir = tmp_path_factory.mktemp("finished") / "${M}_${S}"
    patch, err = pytest.MonkeyPatch(), io.StringIO()
    patch.setattr(rollout, "compute_reward", FI.stand_in_reward)
    patch.setattr(sys, "argv", ["train.py"])
    try:
        with contextlib.redirect_stderr(err):
            faults.main_guard(train.main, TINY + ["--steps", str(FINISHED_STEPS), "--out_dir", str(run_dir)])
    finally:
        patch.undo()
    FINISHED["stderr"] = err.getvalue()
    return run_dir


def test_a_run_named_like_math_text_finishes_and_draws_its_curves(finished):
    lines = [line.strip() for line in FINISHED["stderr"].replace("\r", "\n").splitlines() if line.strip()]
    assert "Traceback" not in FINISHED["stderr"] and not [line for line in lines if "error" in line.lower()]
    assert lines[-1] == f"curves: {finished / 'training.png'}"         # its last line: it finished, exit 0
    assert (finished / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_held_out_set_named_like_math_text_is_drawn_as_written(run, tmp_path):
    named = tmp_path / "$x \\le 5$"
    run.rename(named)
    with open(named / "metrics.jsonl", "a") as f:   # a held-out evaluation of a file named like math text
        f.write(json.dumps({"step": 2, "eval": "after", "data": "$x \\le 5$.jsonl", "avg@2": 0.5}) + "\n")
    assert loop.plot_run(named).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_problem_texts_tokens_and_names_like_math_text_are_drawn_as_written(tmp_path):
    import matplotlib
    from matplotlib.text import Text

    from studies import forks

    for text in MATH_TEXT + ["caf\udce9"]:   # each drawn literally: no math text is parsed
        assert not matplotlib.cbook.is_math_text(figures.literal(text))
        shown = text.replace("\udce9", "\\xe9")
        assert Text(text=figures.literal(text), parse_math=True)._preprocess_math(figures.literal(text)) == (
            shown, False)
    pieces = ["Solve ", "$x", " \\le", " 5$", ": ", "$$", "\\frac{", "$", "\n", "done"]
    png = tmp_path / "forks.png"
    forks.render_forks_png(pieces, [0.5] * len(pieces), {"entropy": [2, 6]},
                           "Solve $x \\le 5$.  (gold $\\frac{$; 10 tokens; K = 2)", png)   # show-forks
    result = E.score_records([{"index": 0, "run": 0, "gold": "5", "answer": "5", "correct": True},
                              {"index": 0, "run": 0, "gold": "5", "answer": "$", "correct": False}], 2)
    by_model = {name: {"$x \\le 5$.jsonl": result, "$$.jsonl": result} for name in MATH_TEXT[:3]}
    E.plot_pass_curves(by_model, tmp_path / "pass_curves.png")
    E.plot_maj_vs_avg(by_model, tmp_path / "maj_vs_avg.png")
    for name in ("forks.png", "pass_curves.png", "maj_vs_avg.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------------
# 2. safetensors headers of any JSON shape
# ------------------------------------------------------------------------------------------------------
def replace_header(path: Path, header) -> None:
    """The file with its JSON header replaced, padded to the same length (JSON allows trailing spaces)."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    text = json.dumps(header).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text.ljust(n) + data[8 + n:])


def test_a_header_of_another_json_shape_falls_back_like_a_damaged_checkpoint(run, capsys):
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
def test_a_named_checkpoint_with_a_header_of_another_shape_is_one_line(run, capsys, header, why):
    named = run / "checkpoints" / "step_000002"
    replace_header(named / "model.safetensors", header)
    before = folder_hash(run)
    line = run_cli(capsys, TINY + ["--steps", "3", "--resume", str(named), "--out_dir", str(run)], code=2,
                   one_error_line=True)[-1]
    assert line == (f"train.py: error: --resume {named}: no usable checkpoint (step_000002: "
                    f"model.safetensors has a damaged header ({why})); expected a checkpoint whose "
                    f"model.safetensors and trainer_state.pt are whole")
    assert folder_hash(run) == before


def test_a_header_nested_deeper_than_json_can_read_is_damage(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(deep)) + deep)
    assert runs.safetensors_damage(path) == "model.safetensors unreadable (RecursionError)"


# ------------------------------------------------------------------------------------------------------
# 3. Names that are not UTF-8, or too long for the files named after them
# ------------------------------------------------------------------------------------------------------
EVAL = ["--preset", "tiny", "--model", "tiny-random", "--limit", "2", "--k", "2", "--max_new_tokens", "4"]
ROWS = '{"problem": "What is 2 + 3?", "answer": "5"}\n{"problem": "What is 1 + 1?", "answer": "2"}\n'


def test_a_benchmark_named_in_latin1_is_one_line(tmp_path, capsys):
    bench = tmp_path / os.fsdecode(b"caf\xe9.jsonl")       # the case: named on a Latin-1 system
    bench.write_text(ROWS)
    out = tmp_path / "ev"
    before = folder_hash(tmp_path)
    line = evaluate_refused(capsys, EVAL + ["--bench", str(bench), "--out_dir", str(out)])
    assert line == (f"evaluate.py: error: --bench {tmp_path}/caf\\xe9.jsonl: byte 0xe9 at character "
                    f"{len(str(tmp_path)) + 5} is not UTF-8; expected a UTF-8 name (rename the file): its "
                    f"samples file and results.json are UTF-8 files that record it (see --help)")
    assert folder_hash(tmp_path) == before and not out.exists()


def test_a_benchmark_name_too_long_for_its_samples_file_is_one_line(tmp_path, capsys):
    bench = tmp_path / ("x" * 244 + ".jsonl")                  # 250 characters: a file this system holds
    bench.write_text(ROWS)
    out = tmp_path / "ev"
    before = folder_hash(tmp_path)
    line = evaluate_refused(capsys, EVAL + ["--bench", str(bench), "--out_dir", str(out)])
    assert line.startswith(f"evaluate.py: error: --bench {str(bench)[:28]}...{str(bench)[-28:]}: a name of "
                           f"250 bytes; its samples are saved as samples_<name>.jsonl, 294 bytes with")
    assert line.endswith("more than the 255 a file name may have; expected a name of at most 211 bytes "
                         "(rename the file, or link it under a shorter name) (see --help)")
    assert folder_hash(tmp_path) == before and not out.exists()


def test_a_run_folder_named_in_latin1_is_one_line_before_any_step(tmp_path, capsys):
    out = tmp_path / os.fsdecode(b"run\xe9")                  # failed at its first checkpoint, a step later
    line = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(out)], code=2, one_error_line=True)[-1]
    assert line == (f"train.py: error: --out_dir {tmp_path}/run\\xe9: byte 0xe9 at character "
                    f"{len(str(tmp_path)) + 5} is not UTF-8; expected a UTF-8 name (rename the file or "
                    f"folder): a run records its settings in UTF-8 files (config.json) (see --help)")
    assert folder_hash(tmp_path) == {}


# ------------------------------------------------------------------------------------------------------
# 4. The tree viewer: stray files and non-finite numbers
# ------------------------------------------------------------------------------------------------------
@pytest.fixture
def tree_run(tmp_path, smollm_tokenizer):
    """A run folder holding trees/step_000007.jsonl (test_viz's two trees), and the trees."""
    from test_viz import _trees

    trees = _trees(smollm_tokenizer)
    (tmp_path / "trees").mkdir()
    (tmp_path / "trees" / "step_000007.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trees))
    return tmp_path, trees


def viz_lines(capsys, argv, code=None) -> list[str]:
    """`python -m harness.viz ARGS`: its stderr lines; `code` the exit code (None: it draws and returns)."""
    if code is None:
        viz.main(argv)
    else:
        with pytest.raises(SystemExit) as exit_info:
            viz.main(argv)
        assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("stray", ["step_final.jsonl", "step_7.jsonl", "step_000007 (copy).jsonl"])
def test_a_stray_file_in_trees_is_skipped_with_one_line(tree_run, capsys, stray):
    run, _ = tree_run
    log = run / "trees" / "step_000007.jsonl"
    shutil.copy(log, run / "trees" / stray)                   # the case: step_final.jsonl
    before = folder_hash(run / "trees")
    assert viz_lines(capsys, [str(run)]) == [
        f"viz.py: {run / 'trees' / stray}: not a tree log of train.py (expected step_NNNNNN.jsonl, a step's "
        f"number in six or more digits); skipped"]
    assert (run / "trees" / "step_000007.html").exists()      # the real log, drawn
    after = folder_hash(run / "trees")
    assert {name: after[name] for name in before} == before   # the logs untouched; the page and PNG added


def test_nan_in_a_tree_log_is_a_named_line_never_a_blank_page(tree_run, capsys):
    run, trees = tree_run
    log = run / "trees" / "step_000007.jsonl"
    trees[0]["v_root"] = float("nan")                         # the case
    trees[1]["blocks"][0]["tokens"][0] = "5\ud800"             # a lone surrogate (a "\ud800" escape): U+FFFD
    log.write_text("".join(json.dumps(t) + "\n" for t in trees))
    assert viz_lines(capsys, [str(run)]) == [
        f"{log} line 1: not a tree (a number that is not finite: v_root is nan); that line is left out"]
    page = (run / "trees" / "step_000007.html").read_text(encoding="utf-8")
    scene = page.split('<script id="scene" type="application/json">')[1].split("</script>")[0]
    drawn = json.loads(scene, parse_constant=lambda name: pytest.fail(f"{name} in the page's JSON"))
    assert [t["tree"] for t in drawn["trees"]] == [1]
    assert drawn["trees"][0]["blocks"][0]["tokens"][0] == "5\ufffd"


def test_a_log_of_non_finite_trees_only_is_one_line(tree_run, capsys):
    run, trees = tree_run
    log = run / "trees" / "step_000007.jsonl"
    trees[0]["blocks"][2]["entropies"][1] = float("inf")
    trees[1]["alpha"] = float("-inf")
    log.write_text("".join(json.dumps(t) + "\n" for t in trees))
    before = folder_hash(run)
    assert viz_lines(capsys, [str(run)], code=2) == [
        f"viz.py: error: {log}: holds no tree to draw (line 1: not a tree (a number that is not finite: "
        f"blocks[2].entropies[1] is inf)); expected one JSON tree a line, as train.py --log_trees_every "
        f"writes"]
    assert folder_hash(run) == before


# ------------------------------------------------------------------------------------------------------
# 5. Launcher variables outside torchrun
# ------------------------------------------------------------------------------------------------------
TORCHRUN = ("expected a command started by torchrun (`torchrun --nproc_per_node N {script} ...` sets "
            "WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT), or WORLD_SIZE unset (or 1) for one process")


@pytest.mark.parametrize("env, why", [
    ({"WORLD_SIZE": ""}, "WORLD_SIZE='' in the environment: not a number of processes >= 1"),    # the issue's
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 in the environment but RANK, MASTER_ADDR, MASTER_PORT not set: this "
                          "process was not started by torchrun"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' in the environment: not a number of processes >= 1"),
])
def test_launcher_variables_outside_torchrun_are_one_line(tmp_path, capsys, monkeypatch, no_rendezvous, env,
                                                         why):
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


def test_a_rank_outside_the_world_is_one_line(tmp_path, capsys, monkeypatch, no_rendezvous):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in {"RANK": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    line = run_cli(capsys, TINY + ["--out_dir", str(tmp_path / "run")], code=2, one_error_line=True)[-1]
    assert line.endswith("error: RANK='2' in the environment: expected a number 0 to 1 (WORLD_SIZE=2), as "
                         "torchrun sets it")
    assert folder_hash(tmp_path) == {}


# ------------------------------------------------------------------------------------------------------
# 6. DATPO_CACHE: empty, a file, read-only; an interrupted conversion
# ------------------------------------------------------------------------------------------------------
def test_an_empty_datpo_cache_is_the_default_never_the_working_directory(tmp_path, monkeypatch,
                                                                       smollm_tokenizer):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DATPO_CACHE", "")                     # the case: converted 517 MiB here
    assert models.cache_dir() == Path.home() / ".cache" / "datpo"
    assert models.smollm2_folder() == Path.home() / ".cache" / "datpo" / "smollm2-135m-instruct"
    assert folder_hash(tmp_path) == {}
    monkeypatch.setenv("DATPO_CACHE", "~/elsewhere")
    assert models.cache_dir() == Path.home() / "elsewhere"


CACHE_LINE = ("expected a folder you can create and write for the embedded model's converted copy (517 MiB), "
              "or DATPO_CACHE pointing at one")


@pytest.mark.parametrize("kind", ["a file", "under a file"])
def test_a_datpo_cache_that_is_a_file_is_one_line(tmp_path, capsys, monkeypatch, kind):
    file = tmp_path / "cache"
    file.write_text("not a folder")
    cache = file if kind == "a file" else file / "sub"        # the case, then a variant
    monkeypatch.setenv("DATPO_CACHE", str(cache))
    before = folder_hash(tmp_path)
    line = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(tmp_path / "run")], code=2,
                   one_error_line=True)[-1]
    assert line == ({"a file": f"train.py: error: DATPO_CACHE={cache}: is a file, not a folder; expected a "
                               f"folder for the embedded model's converted copy (517 MiB), or DATPO_CACHE "
                               f"unset (~/.cache/datpo)",
                     "under a file": f"train.py: error: DATPO_CACHE={cache}: cannot write there (Not a "
                                     f"directory); {CACHE_LINE}"}[kind])
    assert folder_hash(tmp_path) == before                    # the file as it was; no file in --out_dir


def _mount_tmpfs(folder: Path, options: str) -> bool:
    folder.mkdir(exist_ok=True)
    try:
        return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                              capture_output=True).returncode == 0
    except OSError:
        return False


def test_a_read_only_cache_is_read_or_one_line(tmp_path, capsys, monkeypatch, smollm_tokenizer):
    cache = tmp_path / "cache"
    if not _mount_tmpfs(cache, "size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        (cache / "smollm2-135m-instruct").symlink_to(models.smollm2_folder())
        leftover = cache / f".smollm2-{socket.gethostname().replace('-', '_')}-{_dead_pid()}-abcd1234"
        leftover.mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(cache)], check=True)
        monkeypatch.setenv("DATPO_CACHE", str(cache))
        assert models.smollm2_folder() == cache / "smollm2-135m-instruct"      # a shared cache, read only
        assert leftover.exists() and capsys.readouterr().err == ""             # cannot be removed: no line
    finally:
        subprocess.run(["umount", str(cache)], capture_output=True)
    empty = tmp_path / "empty"
    if not _mount_tmpfs(empty, "ro,size=1m"):
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        monkeypatch.setenv("DATPO_CACHE", str(empty))
        line = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(tmp_path / "run")], code=2,
                       one_error_line=True)[-1]
        assert line == (f"train.py: error: DATPO_CACHE={empty}: cannot write there (Read-only file system); "
                        f"{CACHE_LINE}")
    finally:
        subprocess.run(["umount", str(empty)], capture_output=True)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def partial_conversion(error: BaseException):
    """A conversion that writes part of the model, then stops with `error` (Ctrl-C, a full disk)."""
    def convert(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"\0" * 4096)
        raise error
    return convert


@pytest.mark.parametrize("error, code, line", [
    (KeyboardInterrupt(), 130, "train.py: interrupted"),
    (OSError(errno.ENOSPC, "No space left on device"), 4,
     "train.py: error: DATPO_CACHE={cache}: converting the embedded model into it failed (disk full (No "
     "space left on device)); nothing of it is kept; free space (it takes 517 MiB) or point DATPO_CACHE at "
     "another folder"),
])
def test_an_interrupted_first_conversion_leaves_nothing(tmp_path, capsys, monkeypatch, error, code, line):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DATPO_CACHE", str(cache))
    monkeypatch.setattr(models, "_convert_smollm2", partial_conversion(error))
    lines = run_cli(capsys, TINY + ["--steps", "1", "--out_dir", str(tmp_path / "run")], code=code)
    assert lines[-1] == line.format(cache=cache) and len(lines) == 1
    assert folder_hash(cache) == {}                           # the partial folder removed, nothing cached


def test_a_conversion_killed_outright_is_cleared_by_the_next_run(tmp_path, capsys, monkeypatch,
                                                                smollm_tokenizer):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "smollm2-135m-instruct").symlink_to(models.smollm2_folder())
    host = socket.gethostname().replace("-", "_")
    killed = cache / f".smollm2-{host}-{_dead_pid()}-k1ll3d00"
    running = cache / f".smollm2-{host}-{os.getpid()}-l1v3l1v3"   # a conversion still running: kept
    other = cache / f".smollm2-otherhost-{_dead_pid()}-0th3r000"   # another host's: its pid tells nothing
    for folder in (killed, running, other):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    monkeypatch.setenv("DATPO_CACHE", str(cache))
    assert models.smollm2_folder() == cache / "smollm2-135m-instruct"
    assert capsys.readouterr().err.strip().splitlines() == [
        f"DATPO_CACHE={cache}: removed {killed.name}, left by a conversion of the embedded model that was "
        f"interrupted (process {killed.name.split('-')[2]} is gone)"]
    assert not killed.exists() and running.exists() and other.exists()
