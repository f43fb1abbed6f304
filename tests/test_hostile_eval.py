"""evaluate.py against hostile files and careless commands (issue 29, part C): one test per class. Each bad
command exits with its code (2 a mistake, 4 a full disk) and one line, and the folders involved are
byte-identical before and after; at b940752 each of these ran on, wrote into someone else's folder, replaced
saved samples or ended in a traceback."""
import errno
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import evaluate as E
import models
from harness import faults

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
# Fixtures: a training run folder and a model folder
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
                    f"cut short); the samples saved before in {samples.name} are kept; a rerun continues "
                    f"from them; free space and rerun the same command")
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
        if self.name == path_name:
            real(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, text, *args, **kwargs)
    return write_text


def test_a_full_disk_at_results_json_keeps_the_previous_one(evaluated, tmp_path, capsys, monkeypatch):
    """b940752: an OSError traceback and a results.json cut in half."""
    out = copy_of(evaluated, tmp_path)
    before = folder_hash(out)
    monkeypatch.setattr(Path, "write_text", _full_write_text(".results.json.tmp"))
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
                                   "expected one of release, chat, plain)"),
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


