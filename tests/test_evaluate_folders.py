"""evaluate.py against hostile files and careless commands (issue 29, part C): one test per class. Each bad
command exits with its code (2 a mistake, 4 a full disk) and one line, and the folders involved are
byte-identical before and after; at b940752 each of these ran on, wrote into someone else's folder, replaced
saved samples or ended in a traceback."""
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import fault_injection as FI
import pytest
import torch

import evaluate as E
import models
from runtime import atomic, faults

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "4", "--k", "2",
        "--max_new_tokens", "6"]


def folder_hash(path) -> dict:
    """{relative path: bytes} of every file under `path` (a file: its bytes; missing: None)."""
    path = Path(path)
    if not path.exists():
        return None
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def refused(capsys, argv, code=2) -> str:
    """Run the command as `python evaluate.py` does; assert its exit code and a single error line, no
    traceback; return that line."""
    capsys.readouterr()
    program, sys.argv[0] = sys.argv[0], "evaluate.py"   # the program name the user sees in the line
    try:
        with pytest.raises(SystemExit) as exit_info:
            faults.main_guard(E.main, argv)
    finally:
        sys.argv[0] = program
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def args_with(**changes) -> list[str]:
    """TINY with some flags' values replaced or added (--k 4, --limit 3, ...)."""
    args = list(TINY)
    for flag, value in changes.items():
        values = value if isinstance(value, list) else [value]
        if f"--{flag}" in args:
            at = args.index(f"--{flag}")
            end = next((i for i in range(at + 1, len(args)) if args[i].startswith("--")), len(args))
            args[at + 1:end] = values
        else:
            args += [f"--{flag}", *values]
    return args


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A finished evaluation (TINY) and its result: tests copy the folder and evaluate into the copy."""
    out = tmp_path_factory.mktemp("evaluated") / "ev"
    result = E.main(TINY + ["--out_dir", str(out)])["tiny-random"]["arith-test"]
    return out, result


def copy_of(evaluated, tmp_path) -> Path:
    out = tmp_path / "ev"
    shutil.copytree(evaluated[0], out)
    return out


def metrics(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "seconds"}


# ------------------------------------------------------------------------------------------------------
# 1. One evaluation per folder: the run lock train.py takes
# ------------------------------------------------------------------------------------------------------
def test_a_locked_folder_is_refused_naming_its_holder(tmp_path, capsys):
    """b940752: no lock, the second evaluation wrote into the folder the first was writing."""
    out = tmp_path / "ev"
    out.mkdir()
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock = {"pid": holder.pid, "host": socket.gethostname(), "started": "2026-01-01T10:00:00"}
        (out / "run.lock").write_text(json.dumps(lock))   # as train.py writes it
        before = folder_hash(out)
        line = refused(capsys, TINY + ["--out_dir", str(out)])
    finally:
        holder.kill()
        holder.wait()
    command = "sleep 60" if Path("/proc/self/cmdline").exists() else "command unknown"
    assert line == (f"evaluate.py: error: --out_dir {out}: another process is writing there (pid "
                    f"{holder.pid}: {command}; since 2026-01-01T10:00:00; {out / 'run.lock'}); wait for it "
                    f"or stop it, or use another --out_dir")
    assert folder_hash(out) == before


def test_a_running_evaluation_holds_its_folder(tmp_path, capsys):
    """Two real evaluations into one folder: the second stops in one line naming the first's command."""
    out = tmp_path / "ev"
    argv = args_with(limit="64", max_new_tokens="48") + ["--out_dir", str(out)]
    log = open(tmp_path / "first.log", "w")   # a file, not a pipe: tqdm's bar would fill a pipe and block
    first = subprocess.Popen([sys.executable, str(ROOT / "evaluate.py"), *argv], cwd=tmp_path,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log)
    try:
        for _ in range(600):
            if (out / "run.lock").exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert first.poll() is None, (tmp_path / "first.log").read_text()
        before = folder_hash(out)
        before.pop("run.lock")
        line = refused(capsys, argv)
        now = folder_hash(out)
        for _ in range(1200):   # the first one samples on, undisturbed
            if (out / "samples_arith-test.jsonl.state").exists() or first.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        first.send_signal(signal.SIGTERM)   # it stops after the current batch of samples, saved
        first.wait(timeout=120)
        log.close()
    log = (tmp_path / "first.log").read_text()
    assert first.returncode == 0 and "stopped by SIGTERM in arith-test" in log, log
    holder = f"pid {first.pid}: evaluate.py {' '.join(argv)}; since "
    assert re.fullmatch(rf"evaluate\.py: error: --out_dir {re.escape(str(out))}: another process is writing "
                        rf"there \({re.escape(holder)}[0-9T:-]+; {re.escape(str(out / 'run.lock'))}\); wait "
                        rf"for it or stop it, or use another --out_dir", line), line
    journal = {"run.lock", "samples_arith-test.jsonl", "samples_arith-test.jsonl.state"}
    assert set(now) - set(before) <= journal   # the first one's files only
    assert not (out / "run.lock").exists()   # released by the first one on its way out


# ------------------------------------------------------------------------------------------------------
# 2. Other settings into an evaluated folder: refused, unless --overwrite true replaces them
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, interrupted, expected", [
    ({"k": "4"}, False, "samples_arith-test.jsonl holds 8 samples of arith-test made with other settings "
                        "(k 2 -> 4); rerun with those to reuse them"),
    ({"limit": "3"}, False, "samples_arith-test.jsonl holds 8 samples of arith-test made with other settings "
                            "(problems: other rows (another --limit or --bench file, or one edited)); "
                            "rerun with those to reuse them"),
    ({"k": "4"}, True, "samples_arith-test.jsonl holds 8 samples of arith-test made with other settings "
                       "(k 2 -> 4); rerun with those to reuse them"),
    ({"temperature": "0.5", "bench": "arith-train"}, False,
     "{out}/results.json holds results made with other settings (temperature 1.0 -> 0.5); a folder holds one "
     "evaluation"),
    ({"temperature": "0.5"}, True, "{out}/samples_arith-test.jsonl holds samples made with other settings "
                                   "(temperature 1.0 -> 0.5); a folder holds one evaluation"),
], ids=["k", "limit", "k-interrupted", "temperature-second-bench", "temperature-interrupted"])
def test_other_settings_never_replace_saved_samples(evaluated, tmp_path, capsys, changes, interrupted,
                                                    expected):
    """b940752: the journal saw other settings, said "starting it over" and replaced the samples."""
    out = copy_of(evaluated, tmp_path)
    if interrupted:   # stopped in its first benchmark: no results.json yet, only the samples and their state
        for name in ("results.json", "pass_curves.png", "maj_vs_avg.png"):
            (out / name).unlink()
    before = folder_hash(out)
    line = refused(capsys, args_with(**changes) + ["--out_dir", str(out)])
    assert line.startswith(f"evaluate.py: error: --out_dir {out}: " + expected.format(out=out)), line
    assert line.endswith("use another --out_dir, or --overwrite true to replace them") or \
        line.endswith("or --overwrite true to replace that evaluation (results.json, samples, figures)"), line
    assert folder_hash(out) == before


def test_overwrite_true_replaces_the_earlier_evaluation(evaluated, tmp_path, capsys):
    out = copy_of(evaluated, tmp_path)
    fresh = E.main(args_with(k="4") + ["--out_dir", str(tmp_path / "fresh")])["tiny-random"]["arith-test"]
    replaced = E.main(args_with(k="4") + ["--out_dir", str(out), "--overwrite", "true"])
    assert metrics(replaced["tiny-random"]["arith-test"]) == metrics(fresh)
    assert (out / "samples_arith-test.jsonl").read_bytes() == \
        (tmp_path / "fresh" / "samples_arith-test.jsonl").read_bytes()
    err = capsys.readouterr().err
    assert "--overwrite true: replaced the earlier evaluation's samples_arith-test.jsonl" in err


# ------------------------------------------------------------------------------------------------------
# 3. More benchmarks into one folder accumulate in its results.json
# ------------------------------------------------------------------------------------------------------
def test_a_second_benchmark_adds_to_results_json(evaluated, tmp_path, capsys):
    """b940752: results.json held only the last command's benchmarks."""
    out = copy_of(evaluated, tmp_path)
    first = folder_hash(out)
    alone = E.main(args_with(bench="arith-train") + ["--out_dir", str(tmp_path / "alone")])
    capsys.readouterr()
    both = E.main(args_with(bench="arith-train") + ["--out_dir", str(out)])["tiny-random"]
    table = capsys.readouterr().out
    saved = json.loads((out / "results.json").read_text())["benchmarks"]
    assert list(saved) == list(both) == ["arith-test", "arith-train"]
    assert saved["arith-test"] == json.loads(first["results.json"])["benchmarks"]["arith-test"]
    assert metrics(both["arith-train"]) == metrics(alone["tiny-random"]["arith-train"])   # seeded on its own
    assert "arith-test (k=2)" in table and "arith-train (k=2)" in table
    for name in ("samples_arith-test.jsonl", "samples_arith-test.jsonl.state"):
        assert (out / name).read_bytes() == first[name]
    # the same command again: nothing sampled, the same results
    again = E.main(args_with(bench="arith-train") + ["--out_dir", str(out)])["tiny-random"]
    assert {b: metrics(r) for b, r in again.items()} == {b: metrics(r) for b, r in both.items()}


# ------------------------------------------------------------------------------------------------------
# 4. Never into a training run, a checkpoint or a model folder
# ------------------------------------------------------------------------------------------------------
@pytest.fixture
def run_and_model(tmp_path, smollm_tokenizer):
    """RUN: a training run folder (config.json, metrics.jsonl, checkpoints/step_000001); MODEL: a model."""
    run, model = tmp_path / "RUN", tmp_path / "MODEL"
    ckpt = run / "checkpoints" / "step_000001"
    weights = models.tiny_random_model(len(smollm_tokenizer), seed=3)
    for folder in (ckpt, model):
        weights.save_pretrained(folder)
        smollm_tokenizer.save_pretrained(folder)
    (ckpt / "trainer_state.pt").write_bytes(b"state")
    (run / "checkpoints" / "latest").write_text("step_000001")
    (run / "config.json").write_text(json.dumps({"prompt_style": "chat", "few_shot": True,
                                                 "answer_fallback": False}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run, model


NEVER = ("; an evaluation never writes into a training run, a checkpoint or a model folder (--overwrite true "
         "does not change that); expected its own folder, e.g. runs/eval/{label} (the default)")


@pytest.mark.parametrize("flags, expected", [
    (["--resume", "{run}"], "--resume {run}: is the training run {run}; --resume names the output folder of "
                            "an earlier evaluation: to evaluate a run or a checkpoint give it as --model "
                            "(its evaluation goes to runs/eval/RUN)"),
    (["--out_dir", "{run}"], "--out_dir {run}: is the training run {run}" + NEVER),
    (["--out_dir", "{run}/eval"], "--out_dir {run}/eval: is inside the training run {run}" + NEVER),
    (["--out_dir", "{run}/checkpoints/step_000001"],
     "--out_dir {run}/checkpoints/step_000001: is the checkpoint {run}/checkpoints/step_000001" + NEVER),
    (["--model", "{model}", "--out_dir", "{model}"],
     "--out_dir {model}: is the model folder {model} (config.json + model.safetensors)" + NEVER),
], ids=["resume-run", "out-run", "out-inside-run", "out-checkpoint", "out-model"])
def test_someone_elses_folder_is_never_an_output(run_and_model, capsys, flags, expected):
    """b940752: results.json, samples and figures were written into the run, the checkpoint or the model."""
    run, model = run_and_model
    before = folder_hash(run.parent)
    line = refused(capsys, TINY + [f.format(run=run, model=model) for f in flags])
    label = "MODEL" if "--model" in flags else "tiny-random"
    assert line == "evaluate.py: error: " + expected.format(run=run, model=model, label=label)
    assert folder_hash(run.parent) == before


# ------------------------------------------------------------------------------------------------------
# 5. --rescore: a record of the wrong type is refused naming the file, line and field
# ------------------------------------------------------------------------------------------------------
def _samples(mutate=None, raw=None):
    rows = [{"bench": "toy", "index": i, "run": 0, "sample": s, "gold": "1", "response": "\\boxed{1}",
             "level": 1} for i in range(3) for s in range(2)]
    if mutate:
        mutate(rows)
    text = "".join(json.dumps(r) + "\n" for r in rows).encode()
    return raw(text) if raw else text


@pytest.mark.parametrize("mutate, raw, expected", [
    (lambda rows: rows[3].update(response=5), None,
     "line 4: field 'response' is 5; expected the response text (a string)"),
    (lambda rows: rows[3].update(gold=None), None,
     "line 4: field 'gold' is null; expected the gold answer (a string)"),
    (lambda rows: rows[3].update(index="x"), None,
     "line 4: field 'index' is \"x\"; expected a problem number (an integer >= 0)"),
    (lambda rows: rows[3].update(sample=True), None,
     "line 4: field 'sample' is true; expected a sample number (an integer >= 0)"),
    (lambda rows: rows[3].update(correct="no"), None,
     "line 4: field 'correct' is \"no\"; expected true or false"),
    (lambda rows: rows[3].update(tokens=5), None,
     "line 4: has one of the fields 'tokens' and 'stopped' without the other; expected both or neither"),
    (lambda rows: rows[3].update(level="Level 2"), None,
     "line 4: level 'Level 2', but line 1 has 1; expected levels of one type in a file"),
    (lambda rows: rows.extend(rows[:1]), None,
     "line 7: repeats line 1 (index 0, run 0, sample 0); expected each sample once"),
    (lambda rows: [r.update(bench="other") for r in rows[4:]], None,
     "line 5: bench 'other', but line 1 has 'toy'; expected the samples of one benchmark per file"),
    (None, lambda text: b"\n".join(line.replace(b'"gold": "1"', b'"gold": "\xff"') if n == 2 else line
                                    for n, line in enumerate(text.split(b"\n"))),
     "line 3: not UTF-8 text (byte 0xff at column 62)"),
], ids=["response-int", "gold-null", "index-str", "sample-bool", "correct-str", "tokens-alone",
    "level-types", "duplicate", "two-benches", "non-utf8"])
def test_rescore_refuses_records_of_the_wrong_type(tmp_path, capsys, mutate, raw, expected):
    """b940752: scored as 0 % (a number as a response, a null gold, "no" counted as correct), a sample
    counted twice, or a TypeError traceback; a non-UTF-8 byte was a buffer offset."""
    path = tmp_path / "ev" / "samples_toy.jsonl"
    path.parent.mkdir()
    path.write_bytes(_samples(mutate, raw))
    before = folder_hash(tmp_path)
    line = refused(capsys, ["--rescore", str(path)])
    assert line == f"evaluate.py: error: cannot rescore {path}: {expected}"
    assert folder_hash(tmp_path) == before


def test_rescore_of_good_records_is_unchanged(tmp_path, capsys):
    path = tmp_path / "ev" / "samples_toy.jsonl"
    path.parent.mkdir()
    path.write_bytes(_samples())
    result = E.main(["--rescore", str(path)])["ev"]["toy"]
    assert result["avg@k"] == 1.0 and result["n_samples"] == 6 and result["avg_by_level"] == {1: 1.0}


# ------------------------------------------------------------------------------------------------------
# 6. --plot_models: a partial results.json is one line naming it, and nothing is drawn
# ------------------------------------------------------------------------------------------------------
GOOD = {"model": "m", "settings": {}, "benchmarks": {"math500": {
    "k": 8, "avg@k": 0.1, "pass@k": 0.2, "maj@k": 0.15,
    "pass_curve": {"1": 0.1, "2": 0.15, "4": 0.18, "8": 0.2}}}}


def _without_curve():
    value = json.loads(json.dumps(GOOD))
    del value["benchmarks"]["math500"]["pass_curve"]
    return json.dumps(value)


def _nan_avg():
    value = json.loads(json.dumps(GOOD))
    value["benchmarks"]["math500"]["avg@k"] = float("nan")
    return json.dumps(value)


@pytest.mark.parametrize("text, expected", [
    (json.dumps(GOOD, indent=2)[:120], "{part}/results.json line 8: torn or not JSON (Expecting value)"),
    (_without_curve(), "{part}/results.json: benchmark 'math500' lacks pass_curve; expected k, avg@k, "
                       "pass@k, maj@k, pass_curve"),
    ('{"benchmarks": ["math500"]}', '{part}/results.json: no "benchmarks" object; expected {{"model", '
                                    '"settings", "benchmarks": {{bench: metrics}}}}'),
    (_nan_avg(), "{part}/results.json: benchmark 'math500': avg@k is nan; expected a number in [0, 1]"),
    ('{"model": "m", "benchmarks": {}}', "{part}/results.json holds no finished benchmark yet"),
    ("[1, 2]", "{part}/results.json: a JSON list, expected an object"),
], ids=["torn", "no-pass-curve", "benchmarks-list", "nan", "no-benchmarks", "list"])
def test_plot_models_names_a_partial_results_file(tmp_path, capsys, text, expected):
    """b940752: KeyError / TypeError / ZeroDivisionError tracebacks, or a JSON message naming no file."""
    good, part = tmp_path / "good", tmp_path / "part"
    for folder, content in ((good, json.dumps(GOOD)), (part, text)):
        folder.mkdir()
        (folder / "results.json").write_text(content)
    before = folder_hash(tmp_path)
    line = refused(capsys, ["--plot_models", str(good), str(part), "--out_dir", str(tmp_path / "cmp")])
    assert line.startswith(f"evaluate.py: error: --plot_models {part}: " + expected.format(part=part)), line
    assert line.endswith("; finish that evaluation (rerun its command) or leave it out"), line
    assert folder_hash(tmp_path) == before        # nothing drawn: --out_dir not even created


@pytest.mark.parametrize("target, expected", [
    ("other", "holds an evaluation (results.json): the comparison would replace its figures"),
    ("{model}", "is the model folder {model} (config.json + model.safetensors)"),
], ids=["evaluation", "model"])
def test_plot_models_never_draws_into_an_evaluation_or_a_model(run_and_model, tmp_path, capsys, target,
                                                                expected):
    """b940752: the comparison's figures replaced the evaluation's own pass_curves.png."""
    _, model = run_and_model
    for name in ("good", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(GOOD))
    (tmp_path / "other" / "pass_curves.png").write_bytes(b"its own figure")
    out = target.format(model=model) if "{" in target else str(tmp_path / target)
    before = folder_hash(tmp_path)
    folders = [str(tmp_path / "good"), str(tmp_path / "other")]
    line = refused(capsys, ["--plot_models", *folders, "--out_dir", out])
    assert line == (f"evaluate.py: error: --out_dir {out}: {expected.format(model=model)}; expected a folder "
                    f"for the comparison's figures, e.g. runs/eval/compare (the default)")
    assert folder_hash(tmp_path) == before


def test_plot_models_tells_folders_of_one_name_apart(tmp_path, capsys):
    """b940752: runs/a/demo and runs/b/demo were both "demo": one of them silently left out."""
    for parent, avg in (("a", 0.1), ("b", 0.3)):
        folder = tmp_path / parent / "demo"
        folder.mkdir(parents=True)
        value = json.loads(json.dumps(GOOD))
        value["benchmarks"]["math500"]["avg@k"] = avg
        (folder / "results.json").write_text(json.dumps(value))
    by_model = E.main(["--plot_models", str(tmp_path / "a" / "demo"), str(tmp_path / "b" / "demo"),
                       "--out_dir", str(tmp_path / "cmp")])
    assert {name: r["math500"]["avg@k"] for name, r in by_model.items()} == {"a/demo": 0.1, "b/demo": 0.3}


# ------------------------------------------------------------------------------------------------------
# 7. A full disk: one line, exit 4, nothing half-written, what was saved intact and resumable
# ------------------------------------------------------------------------------------------------------
def _cut_short(real, error):
    """`real` writing half of what it writes, then failing with `error` (how a full disk ends a write)."""
    def write(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        size = os.path.getsize(f)
        with open(f, "r+b") as handle:
            handle.truncate(size // 2)
        raise error
    return write


TORCH_FULL = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1216 vs 1110")


def test_a_full_disk_in_the_journal_keeps_the_saved_samples(evaluated, tmp_path, capsys, monkeypatch):
    """b940752: torch.save's RuntimeError traceback (exit 1), samples_<bench>.jsonl.state.tmp left behind."""
    out = copy_of(evaluated, tmp_path)
    before = folder_hash(out)
    monkeypatch.setattr(torch, "save", _cut_short(torch.save, TORCH_FULL))   # as journal.py calls it
    line = refused(capsys, args_with(bench="arith-train") + ["--out_dir", str(out)], code=4)
    samples = out / "samples_arith-train.jsonl"
    assert line == (f"evaluate.py: error: writing {samples}: disk full or over quota (torch.save's write was "
                    f"cut short: unexpected pos 1216 vs 1110); its first 0 records are kept (a rerun of the "
                    f"same command continues from them); free space and rerun it")   # harness/journal.py's
    after = folder_hash(out)
    assert {name: after[name] for name in before} == before          # the earlier benchmark untouched
    assert not [name for name in after if name.endswith(".tmp")]     # nothing half-written left
    monkeypatch.undo()
    resumed = E.main(args_with(bench="arith-train") + ["--out_dir", str(out)])["tiny-random"]
    alone = E.main(args_with(bench="arith-train") + ["--out_dir", str(tmp_path / "alone")])["tiny-random"]
    assert metrics(resumed["arith-train"]) == metrics(alone["arith-train"])


def _full_write_text(path_name):
    real = Path.write_text

    def write_text(self, text, *args, **kwargs):
        if self.name.startswith(path_name):   # .NAME.<random>.tmp: runtime/atomic.py's temporary file
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *args, **kwargs)
    return write_text


def test_a_full_disk_at_results_json_keeps_the_previous_one(evaluated, tmp_path, capsys, monkeypatch):
    """b940752: an OSError traceback and a results.json cut in half."""
    out = copy_of(evaluated, tmp_path)
    before = folder_hash(out)
    monkeypatch.setattr(Path, "write_text", _full_write_text(".results.json."))   # its temporary file
    line = refused(capsys, TINY + ["--out_dir", str(out)], code=4)
    assert line == (f"evaluate.py: error: writing {out / 'results.json'}: disk full (No space left on "
                    f"device); the samples are saved and the previous results.json is intact; free space and "
                    f"rerun the same command")
    assert folder_hash(out) == before


def test_a_full_disk_at_a_figure_keeps_the_previous_one(evaluated, tmp_path, capsys, monkeypatch):
    from matplotlib.figure import Figure

    out = copy_of(evaluated, tmp_path)
    before = folder_hash(out)
    real = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        real(self, fname, *args, **kwargs)
        with open(fname, "r+b") as f:
            f.truncate(100)
        raise OSError(errno.ENOSPC, "No space left on device", str(fname))

    monkeypatch.setattr(Figure, "savefig", savefig)
    line = refused(capsys, TINY + ["--out_dir", str(out)], code=4)
    assert line == (f"evaluate.py: error: writing {out / 'pass_curves.png'}: disk full (No space left on "
                    f"device); the figure there before, if any, is intact (results.json and samples too); "
                    f"free space and rerun the same command")
    after = folder_hash(out)
    results = [{b: metrics(r) for b, r in json.loads(files.pop("results.json"))["benchmarks"].items()}
               for files in (before, after)]   # rewritten by the rerun: the same but for its "seconds"
    assert after == before and results[0] == results[1]


# ------------------------------------------------------------------------------------------------------
# 8. A torn config.json of a run folder given as --model
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, expected", [
    (b'{"prompt_style": "chat", "few',
     "config.json line 1: torn or not JSON (Unterminated string starting at)"),
    (b"[]", "config.json: a JSON list, expected an object"),
    (b'{"prompt_style": "ch\xffat"}', "config.json line 1: not UTF-8 text (byte 0xff)"),
    (b'{"prompt_style": "bogus"}', "config.json sets prompt_style 'bogus' (--prompt_style: got 'bogus', "
                                   "expected one of release, chat, plain, verbatim)"),
    (b'{"few_shot": "false"}', "config.json sets few_shot 'false' (few_shot must be a bool)"),
], ids=["torn", "list", "non-utf8", "bad-value", "wrong-kind"])
def test_a_torn_run_config_is_one_line_naming_it(run_and_model, capsys, content, expected):
    """b940752: a JSONDecodeError traceback; a list or the string "false" was used as it came."""
    run, _ = run_and_model
    (run / "config.json").write_bytes(content)
    before = folder_hash(run)
    line = refused(capsys, args_with(model=str(run)) + ["--out_dir", str(run.parent / "ev")])
    assert line.startswith(f"evaluate.py: error: --model {run}: {run}/{expected}"), line
    reads = " (evaluate.py reads its prompt_style, few_shot, answer_fallback)" if "JSON" in expected \
        or "UTF-8" in expected else ""
    assert line.endswith(f"expected the run's settings as train.py wrote them{reads}: restore it, or give "
                         f"those flags on the command line"), line
    assert folder_hash(run) == before


def test_a_torn_run_config_is_not_needed_when_the_flags_are_given(run_and_model, capsys):
    run, _ = run_and_model
    (run / "config.json").write_bytes(b'{"prompt_style": "chat", "few')
    flags = ["--prompt_style", "chat", "--few_shot", "true", "--answer_fallback", "false"]
    result = E.main(args_with(model=str(run)) + flags + ["--out_dir", str(run.parent / "ev")])
    assert result["RUN"]["arith-test"]["n_samples"] == 8


# ------------------------------------------------------------------------------------------------------
# 9. Found on the way: a --bench file in a folder, a benchmark twice, flags out of range, two output
#    folders, a results.json or state file that is not evaluate.py's
# ------------------------------------------------------------------------------------------------------
def test_a_bench_file_in_another_folder_is_saved_by_its_name(tmp_path):
    """b940752: FileNotFoundError traceback (samples_<path>.jsonl named a folder that does not exist)."""
    data_file = tmp_path / "mydata" / "probs.jsonl"
    data_file.parent.mkdir()
    data_file.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)}) + "\n"
                                 for i in range(3)))
    out = tmp_path / "ev"
    result = E.main(args_with(bench=str(data_file)) + ["--out_dir", str(out)])["tiny-random"]
    assert result[str(data_file)]["n_samples"] == 6
    assert len((out / "samples_probs.jsonl.jsonl").read_text().splitlines()) == 6
    assert not (tmp_path / "mydata" / "probs.jsonl.jsonl").exists()


@pytest.mark.parametrize("changes, expected", [
    ({"bench": ["arith-test", "arith-test"], "k": ["2", "4"]},
     "--bench: arith-test is given twice (or two files share its name: both would be saved in "
     "samples_arith-test.jsonl); expected each benchmark once"),
    ({"limit": "-1"}, "--limit: got -1, expected a number of problems >= 0 (0 = all)"),
    ({"k": "100000000000"},
     "--k: got 100000000000, expected at most 65536 samples per problem (the paper uses 64)"),
    ({"runs": "5000"}, "--runs: got 5000, expected at most 1000 (the paper uses 3)"),
], ids=["bench-twice", "limit-negative", "k-huge", "runs-huge"])
def test_flags_out_of_range_are_one_line(tmp_path, capsys, changes, expected):
    """b940752: a benchmark twice replaced its own samples; --limit -1 was blamed on --bench; a huge --k
    or --runs started sampling for ever."""
    line = refused(capsys, args_with(**changes) + ["--out_dir", str(tmp_path / "ev")])
    assert line == f"evaluate.py: error: {expected} (see --help)"
    assert not (tmp_path / "ev").exists()


def test_resume_and_another_out_dir_are_refused(evaluated, tmp_path, capsys):
    """b940752: --out_dir was silently ignored."""
    out = copy_of(evaluated, tmp_path)
    before = folder_hash(tmp_path)
    line = refused(capsys, TINY + ["--resume", str(out), "--out_dir", str(tmp_path / "other")])
    assert line == (f"evaluate.py: error: --resume {out} --out_dir {tmp_path / 'other'}: two output folders; "
                    f"--resume continues the evaluation in its own folder: give one of them")
    assert folder_hash(tmp_path) == before


@pytest.mark.parametrize("content, expected", [
    ('{"my": "notes"}\n', 'results.json: no "benchmarks" object'),
    ('{"model": "tiny-random", "benchmarks": {"arith-te', "results.json line 1: torn or not JSON"),
], ids=["foreign", "torn"])
def test_a_results_json_that_is_not_ours_is_never_replaced(tmp_path, capsys, content, expected):
    """b940752: replaced without a word (a torn one: a JSONDecodeError only in --plot_models later)."""
    out = tmp_path / "ev"
    out.mkdir()
    (out / "results.json").write_text(content)
    before = folder_hash(out)
    line = refused(capsys, TINY + ["--out_dir", str(out)])
    assert line.startswith(f"evaluate.py: error: --out_dir {out}: {out}/{expected}"), line
    assert line.endswith("--overwrite true to replace that evaluation (results.json, samples, figures)"), line
    assert folder_hash(out) == before


def test_a_state_file_holding_code_is_refused_unloaded(evaluated, tmp_path, capsys):
    """b940752: torch.load(weights_only=False) ran the payload on the rerun."""
    out = copy_of(evaluated, tmp_path)
    marker = tmp_path / "PWNED"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    state = out / "samples_arith-test.jsonl.state"
    torch.save({"settings": {}, "units": 1, "n_records": 8, "rng": torch.get_rng_state(), "x": Payload()},
               state)
    before = folder_hash(out)
    line = refused(capsys, TINY + ["--out_dir", str(out)])
    assert line == (f"evaluate.py: error: {state} holds a Python object (posix.system), not only tensors and "
                    f"plain values: refused unloaded, nothing in it ran; delete it and "
                    f"samples_arith-test.jsonl to start that benchmark over, or use another --out_dir")
    assert not marker.exists() and folder_hash(out) == before


def test_a_model_folder_without_tokenizer_files_is_one_line(run_and_model, tmp_path, capsys):
    """b940752: transformers' ValueError traceback ("Couldn't instantiate the backend tokenizer ..."). Now
    models.check_loadable's pre-flight line, before the output folder is made."""
    _, model = run_and_model
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink(missing_ok=True)
    before = folder_hash(model)
    line = refused(capsys, args_with(model=str(model)) + ["--out_dir", str(tmp_path / "ev")])
    assert line.startswith(f"evaluate.py: error: --model {model}: no tokenizer files beside the weights; "
                           f"expected one of tokenizer.json, "), line
    assert folder_hash(model) == before and not (tmp_path / "ev").exists()


def test_a_model_that_ships_its_own_code_is_refused_without_the_flag(run_and_model, tmp_path, capsys):
    """b940752: evaluated it (transformers ignored the auto_map and loaded a plain Llama). Now evaluate.py
    runs models.check_loadable's pre-flight like train.py: a model declaring its own code needs
    --trust_remote_code true, and nothing of it runs or is written before."""
    _, model = run_and_model
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    (model / "modeling_evil.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w').close()\n")
    before = folder_hash(model)
    line = refused(capsys, args_with(model=str(model)) + ["--out_dir", str(tmp_path / "ev")])
    assert line == (f"evaluate.py: error: --model {model}: loading it runs Python code shipped with the "
                    f"model (config.json's auto_map (modeling_evil.py)); pass --trust_remote_code true only "
                    f"for a model you trust, or choose a model transformers supports itself")
    assert folder_hash(model) == before and not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "ev").exists()


# ------------------------------------------------------------------------------------------------------
# Benchmark names that are not UTF-8 or too long for a file name
# ------------------------------------------------------------------------------------------------------
EVAL = ["--preset", "tiny", "--model", "tiny-random", "--limit", "2", "--k", "2", "--max_new_tokens", "4"]


ROWS = '{"problem": "What is 2 + 3?", "answer": "5"}\n{"problem": "What is 1 + 1?", "answer": "2"}\n'


def test_a_benchmark_named_in_latin1_is_one_line(program_name, tmp_path, capsys):
    bench = tmp_path / os.fsdecode(b"caf\xe9.jsonl")       # the case: named on a Latin-1 system
    bench.write_text(ROWS)
    out = tmp_path / "ev"
    before = folder_hash(tmp_path)
    line = refused(capsys, EVAL + ["--bench", str(bench), "--out_dir", str(out)])
    assert line == (f"evaluate.py: error: --bench {tmp_path}/caf\\xe9.jsonl: byte 0xe9 at character "
                    f"{len(str(tmp_path)) + 5} is not UTF-8; expected a UTF-8 name (rename the file): its "
                    f"samples file and results.json are UTF-8 files that record it (see --help)")
    assert folder_hash(tmp_path) == before and not out.exists()


def test_a_benchmark_name_too_long_for_its_samples_file_is_one_line(program_name, tmp_path, capsys):
    bench = tmp_path / ("x" * 244 + ".jsonl")                  # 250 characters: a file this system holds
    bench.write_text(ROWS)
    out = tmp_path / "ev"
    before = folder_hash(tmp_path)
    line = refused(capsys, EVAL + ["--bench", str(bench), "--out_dir", str(out)])
    assert line.startswith(f"evaluate.py: error: --bench {str(bench)[:28]}...{str(bench)[-28:]}: a name of "
                           f"250 bytes; its samples are saved as samples_<name>.jsonl, 294 bytes with")
    assert line.endswith("more than the 255 a file name may have; expected a name of at most 211 bytes "
                         "(rename the file, or link it under a shorter name) (see --help)")
    assert folder_hash(tmp_path) == before and not out.exists()


# ------------------------------------------------------------------------------------------------------
# Saved samples never dropped silently; links in an evaluation folder never followed
# ------------------------------------------------------------------------------------------------------
EVAL_ARITH = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "2", "--k",
              "2", "--max_new_tokens", "4", "--threads", "1"]



def test_samples_without_their_state_are_never_dropped_silently(tmp_path, capsys):
    out = tmp_path / "ev"
    E.main(EVAL_ARITH + ["--out_dir", str(out)])
    samples, state = out / "samples_arith-test.jsonl", out / "samples_arith-test.jsonl.state"
    held = len(samples.read_text().splitlines())
    state.unlink()
    # the example: results.json vouches for their settings; they are sampled again, said in a line
    E.main(EVAL_ARITH + ["--out_dir", str(out)])
    assert (f"{samples}: its {held} saved record(s) are not reused (no state file vouches for them); sampled "
            f"again") in capsys.readouterr().err
    assert state.exists() and len(samples.read_text().splitlines()) == held
    # variant: nothing vouches for them (no results.json either): refused, the folder unchanged
    state.unlink()
    (out / "results.json").unlink()
    before = folder_hash(out)
    line = FI.refused_as(capsys, E.main, EVAL_ARITH + ["--out_dir", str(out)], "evaluate.py")
    assert line == (f"evaluate.py: error: --out_dir {out}: samples_arith-test.jsonl holds {held} samples of "
                    f"arith-test but no state file says what they measured (samples_arith-test.jsonl.state "
                    f"missing or unreadable), so they cannot be reused; --overwrite true samples them again, "
                    f"or use another --out_dir")
    assert folder_hash(out) == before


def plant(links: list[Path], victim: Path) -> None:
    for link in links:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(victim)


def test_links_planted_in_an_evaluation_folder_never_redirect_a_write(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "ev"
    plant([out / n for n in ("samples_arith-test.jsonl.tmp", "samples_arith-test.jsonl.state.tmp",
                             ".results.json.tmp", ".pass_curves.png.tmp", ".maj_vs_avg.png.tmp",
                             "maj_vs_avg.png")], victim)
    E.main(EVAL_ARITH + ["--out_dir", str(out)])
    assert victim.read_text() == "precious\n" and not (out / "maj_vs_avg.png").is_symlink()
    assert json.loads((out / "results.json").read_text())["benchmarks"]["arith-test"]["k"] == 2
    # the helpers alone: a temporary file is never a name that exists, and a rename replaces a link
    taken = atomic.exclusive_temp(out / "x")
    assert taken.is_file() and not taken.is_symlink() and taken.name.startswith(".x.")
    atomic.write_text(out / "results.json", "{}")
    assert victim.read_text() == "precious\n"
