"""harness/eval_files.py — an evaluation's folder: one evaluation per folder, its files safe to read
and write.

evaluate.py's commands keep their samples, state, results.json and figures here:
  writes        every write atomic (a temporary name, then a rename); a full disk is one line, exit 4
  reads         every file read is checked: saved samples (--rescore), results.json (--plot_models), a run's
                config.json; a bad one is one line naming the file, line and field
  the folder    one evaluation per output folder, locked while it runs (runs.RunLock, as train.py); never a
                training run, a checkpoint or a model folder; other settings need --overwrite true
"""
from __future__ import annotations

import json
import shlex
from contextlib import contextmanager
from pathlib import Path

from harness import measured, runs
from harness.journal import count_records
from runtime import atomic, faults
from runtime import distributed as D

RUN_PROMPT_KEYS = ("prompt_style", "few_shot", "answer_fallback")   # taken from a run folder's config.json


def save_figure(fig, path) -> None:
    """The figure as a PNG, written atomically (replace_file): a full disk is one WriteError line."""
    import matplotlib.pyplot as plt

    try:
        with write_errors(path, "the figure there before, if any, is intact (results.json and samples too)"):
            replace_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# Files: every write atomic (a full disk is one line, exit 4), every read checked (one line naming the file)
# --------------------------------------------------------------------------------------------------------
@contextmanager
def write_errors(path, kept: str):
    """A write error inside (faults.write_failure: disk full, quota, read-only, I/O, torch.save cut short)
    becomes a WriteError (exit 4): one line naming `path`, the cause and what is kept (`kept`); any other
    exception goes on as it is."""
    try:
        yield
    except faults.UserError:
        raise
    except Exception as err:
        cause = faults.write_failure(err)
        if cause is None:
            raise
        raise faults.WriteError(f"writing {path}: {cause}; {kept}; free space and rerun the same command") \
            from None


def replace_file(path, write) -> None:
    """write(tmp), then rename tmp over `path`: a kill or a full disk leaves the old file or the new one,
    never half of one (the partial temporary file is removed before the error goes on); tmp is created
    exclusively, never a link planted in the folder (runtime/atomic.py)."""
    atomic.replace_file(path, write)


def write_jsonl(path, records: list[dict]) -> None:
    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    replace_file(path, write)


def write_results(out: Path, summary: dict) -> None:
    """results.json, replaced atomically (a full disk: one WriteError line, the previous one intact)."""
    path = out / "results.json"
    with write_errors(path, "the samples are saved and the previous results.json is intact"):
        replace_file(path, lambda tmp: tmp.write_text(json.dumps(summary, indent=2)))


def read_jsonl(path, numbered: bool = False) -> list:
    """The records of a jsonl file; a line that is not UTF-8 text or not a JSON object is a ValueError naming
    its line. `numbered`: (line number, record) pairs."""
    out = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"line {n}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column "
                                 f"{err.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"line {n}: not JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"line {n}: expected a JSON object, got {type(record).__name__}")
            out.append((n, record) if numbered else record)
    return out


SAMPLE_FIELDS = ("index", "run", "response", "gold")   # what rescoring needs of each saved sample


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What each field of a saved sample must be when present (the first four always are): a wrong type would be
# scored silently (a number as a response is never correct) or fail deep inside the metrics.
SAMPLE_TYPES = {
    "index": (_count, "a problem number (an integer >= 0)"),
    "run": (_count, "a run number (an integer >= 0)"),
    "response": (lambda v: isinstance(v, str), "the response text (a string)"),
    "gold": (lambda v: isinstance(v, str), "the gold answer (a string)"),
    "sample": (_count, "a sample number (an integer >= 0)"),
    "answer": (lambda v: v is None or isinstance(v, str), "the extracted answer (a string or null)"),
    "correct": (lambda v: isinstance(v, bool), "true or false"),
    "level": (lambda v: v is None or isinstance(v, (int, str)) and not isinstance(v, bool),
              "a level (an integer, a string or null)"),
    "tokens": (_count, "a token count (an integer >= 0)"),
    "stopped": (lambda v: isinstance(v, bool), "true or false"),
    "bench": (lambda v: isinstance(v, str), "a benchmark name (a string)"),
}


def sample_problem(record: dict) -> str | None:
    """Why one saved sample cannot be scored (a missing field, or one of the wrong type), else None."""
    missing = [key for key in SAMPLE_FIELDS if key not in record]
    if missing:
        return (f"missing {', '.join(missing)}; expected the fields {', '.join(SAMPLE_FIELDS)} of a sample "
                f"written by evaluate.py")
    for key, (ok, expected) in SAMPLE_TYPES.items():
        if key in record and not ok(record[key]):
            return f"field {key!r} is {json.dumps(record[key])[:40]}; expected {expected}"
    if ("tokens" in record) != ("stopped" in record):
        return "has one of the fields 'tokens' and 'stopped' without the other; expected both or neither"
    return None


def samples_conflict(numbered: list[tuple[int, dict]]) -> str | None:
    """Why the samples of one file do not belong together (two benchmarks, a sample twice, levels of two
    types), naming the line; else None."""
    seen, first, level_line = {}, numbered[0][1], None
    for n, record in numbered:
        if record.get("bench") != first.get("bench"):
            return (f"line {n}: bench {record.get('bench')!r}, but line {numbered[0][0]} has "
                    f"{first.get('bench')!r}; expected the samples of one benchmark per file")
        level = record.get("level")
        if level is not None and level_line is None:
            level_line = (n, level)
        elif level is not None and type(level) is not type(level_line[1]):
            return (f"line {n}: level {level!r}, but line {level_line[0]} has {level_line[1]!r}; expected "
                    f"levels of one type in a file")
        if "sample" in record:
            key = (record["index"], record["run"], record["sample"])
            if key in seen:
                return (f"line {n}: repeats line {seen[key]} (index {key[0]}, run {key[1]}, sample "
                        f"{key[2]}); expected each sample once")
            seen[key] = n
    return None


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`; a ValueError naming the file, the line and what is wrong (not UTF-8 text,
    torn or not JSON, not an object). OSError goes on."""
    raw = Path(path).read_bytes()
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ValueError(f"{path} line {line}: not UTF-8 text (byte 0x{raw[err.start]:02x})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} line {err.lineno}: torn or not JSON ({err.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, expected an object")
    return value


def run_folder_config(model: str) -> dict | None:
    """The training Config (train.py's config.json) when --model is a run folder (it has
    checkpoints/latest); a torn or foreign one is a UserError naming it."""
    folder = Path(model)
    if not ((folder / "checkpoints" / "latest").exists() and (folder / "config.json").exists()):
        return None
    try:
        return read_json_object(folder / "config.json")
    except (OSError, ValueError) as err:
        why = f"{folder / 'config.json'}: unreadable ({err.strerror})" if isinstance(err, OSError) else err
        raise faults.UserError(f"--model {model}: {why}; expected the run's settings as train.py wrote them "
                               f"(evaluate.py reads its {', '.join(RUN_PROMPT_KEYS)}): restore it, or give "
                               f"those flags on the command line") from None


RESULT_FIELDS = ("k", "avg@k", "pass@k", "maj@k", "pass_curve")   # what the table and the figures read


def _fraction(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1


def results_problem(value: dict) -> str | None:
    """Why a results.json object is not one evaluate.py wrote (what the table and figures need), or None."""
    benchmarks = value.get("benchmarks")
    if not isinstance(benchmarks, dict):
        return 'no "benchmarks" object; expected {"model", "settings", "benchmarks": {bench: metrics}}'
    for bench, metrics in benchmarks.items():
        if not isinstance(metrics, dict):
            return f"benchmark {bench!r} is a {type(metrics).__name__}; expected an object of metrics"
        missing = [key for key in RESULT_FIELDS if key not in metrics]
        if missing:
            return f"benchmark {bench!r} lacks {', '.join(missing)}; expected {', '.join(RESULT_FIELDS)}"
        curve = metrics["pass_curve"]
        if not (_count(metrics["k"]) and metrics["k"] >= 1):
            return f"benchmark {bench!r}: k is {metrics['k']!r}; expected an integer >= 1"
        if not isinstance(curve, dict) or not curve or not all(str(j).isdigit() for j in curve):
            return f"benchmark {bench!r}: pass_curve is {json.dumps(curve)[:40]}; expected {{j: pass@j}}"
        values = {**{key: metrics[key] for key in RESULT_FIELDS[1:4]},
                  **{f"pass_curve[{j}]": v for j, v in curve.items()}}
        for name, v in values.items():
            if not _fraction(v):
                return f"benchmark {bench!r}: {name} is {v!r}; expected a number in [0, 1]"
    if not isinstance(value.get("settings", {}), dict):
        return '"settings" is not an object'
    return None


def read_results(folder) -> dict:
    """A folder's results.json, checked (results_problem); a ValueError naming the file otherwise."""
    path = Path(folder) / "results.json"
    value = read_json_object(path)
    why = results_problem(value)
    if why:
        raise ValueError(f"{path}: {why}")
    return value


def load_results(folder) -> dict[str, dict]:
    """{bench: metrics} from a folder's results.json, checked (read_results)."""
    return read_results(folder)["benchmarks"]


# --------------------------------------------------------------------------------------------------------
# The output folder: one evaluation per folder, locked while it runs, never someone else's folder
# --------------------------------------------------------------------------------------------------------
FIGURES = ("pass_curves.png", "maj_vs_avg.png")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "*.gguf")


def samples_path(out: Path, bench: str) -> Path:
    """out/samples_<bench>.jsonl; a --bench file path counts by its file name (its folders are not ours)."""
    return Path(out) / f"samples_{Path(bench).name}.jsonl"


def state_path(samples: Path) -> Path:
    """The journal's state file beside a samples file (harness/journal.py)."""
    return samples.with_name(samples.name + ".state")


def folder_owner(folder: Path) -> str | None:
    """What `folder` is or is inside of when it belongs to something else: a training run (metrics.jsonl, or
    checkpoints/ with a step_* or latest), a checkpoint (trainer_state.pt, checkpoints/step_*), a model
    (config.json + weights). None for a new folder or one of evaluate.py's."""
    path = Path(folder).expanduser().resolve()
    for above in (path, *path.parents):
        where = "is" if above == path else "is inside"
        if (above / "trainer_state.pt").is_file() or (above.parent.name == "checkpoints"
                                                      and above.name.startswith("step_")):
            return f"{where} the checkpoint {above}"
        checkpoints = above / "checkpoints"
        if (above / "metrics.jsonl").is_file() or (checkpoints / "latest").exists() or \
                any(checkpoints.glob("step_*")):
            return f"{where} the training run {above}"
        weights = [w for pattern in WEIGHT_FILES for w in sorted(above.glob(pattern))]
        if (above / "config.json").is_file() and weights:
            return f"{where} the model folder {above} (config.json + {weights[0].name})"
    return None


def sample_settings(samples: Path) -> dict | None:
    """The settings the journal saved beside samples_<bench>.jsonl (its .state file), read with torch's
    weights_only loader (runs.load_plain); None when there is none or it is unreadable (the journal starts
    that benchmark over, as after a torn write). A state holding a Python object is refused: nothing in it
    runs."""
    path = state_path(samples)
    if not path.is_file():
        return None
    try:
        state = runs.load_plain(path)
    except runs.UnsafeFile as err:
        raise faults.UserError(f"{runs.unsafe_line(path, err)}; delete it and {samples.name} to start that "
                               f"benchmark over, or use another --out_dir") from None
    except Exception:  # torn: the journal starts it over
        return None
    settings = state.get("settings") if isinstance(state, dict) else None
    return settings if isinstance(settings, dict) else None


def setting_changes(saved: dict, wanted: dict) -> str:
    """The settings that differ, as "k 2 -> 4, temperature 1.0 -> 0.5" ("" when none)."""
    rows = "problems: other rows (another --limit or --bench file, or one edited)"
    changes = [(rows if key == "problems" else
                f"{key} {measured.short(saved.get(key))} -> {measured.short(wanted[key])}")
               for key in wanted if saved.get(key) != wanted[key]]
    return ", ".join(changes[:4]) + (", ..." if len(changes) > 4 else "")


def earlier_evaluation(out: Path, settings: dict) -> tuple[dict, str | None]:
    """({bench: metrics} of results.json, None) when the folder's earlier evaluation (results.json, the
    samples' states) has these settings (or there is none); ({}, why not) otherwise."""
    earlier = {}
    if (out / "results.json").exists():
        try:
            saved = read_results(out)
        except (OSError, ValueError) as err:
            return {}, f"{err if isinstance(err, ValueError) else err.strerror}"
        if not isinstance(saved.get("settings"), dict):
            return {}, f"{out / 'results.json'} records no settings"
        changes = setting_changes(saved["settings"], settings)
        if changes:
            return {}, f"{out / 'results.json'} holds results made with other settings ({changes})"
        earlier = saved["benchmarks"]
    for samples in sorted(out.glob("samples_*.jsonl")):
        saved = sample_settings(samples)
        changes = setting_changes(saved, settings) if saved is not None else ""
        if changes:
            return {}, f"{samples} holds samples made with other settings ({changes})"
    return earlier, None


def check_output_folder(out: Path, where: str, settings: dict, planned: dict[str, dict],
                        overwrite: bool) -> tuple[dict, list[str] | None]:
    """What an evaluation into `out` keeps of the folder's earlier one: (its results to accumulate, the
    benchmarks to start over; None = replace everything). Other settings (the model, sampling, k, the
    problems) would replace saved samples: a UserError without --overwrite true, the folder unchanged."""
    earlier, why = earlier_evaluation(out, settings)
    if why and not overwrite:
        raise faults.UserError(f"{where}: {why}; a folder holds one evaluation (one model and its settings, "
                               f"benchmarks added with the same ones); use another --out_dir, or --overwrite "
                               f"true to replace that evaluation (results.json, samples, figures)")
    if why:
        return {}, None
    redo = []
    for bench, wanted in planned.items():
        samples = samples_path(out, bench)
        saved = sample_settings(samples) if samples.exists() else None
        held = count_records(samples)
        if held and saved is None and bench not in earlier:   # nothing says what these samples measured
            if not overwrite:
                raise faults.UserError(f"{where}: {samples.name} holds {held} samples of {bench} but no "
                                       f"state file says what they measured ({state_path(samples).name} "
                                       f"missing or unreadable), so they cannot be reused; --overwrite true "
                                       f"samples them again, or use another --out_dir")
            redo.append(bench)
            continue
        if saved is None and bench in earlier:   # no state (torchrun writes none): results.json's k
            saved = {**wanted, "k": earlier[bench]["k"]}
        changes = setting_changes(saved, wanted) if saved is not None else ""
        if changes and not overwrite:
            raise faults.UserError(f"{where}: {samples.name} holds {held} samples of {bench} made with other "
                                   f"settings ({changes}); rerun with those to reuse them, use another "
                                   f"--out_dir, or --overwrite true to replace them")
        if changes:
            redo.append(bench)
    return {b: m for b, m in earlier.items() if b not in redo}, redo


def replace_earlier(out: Path, settings: dict, benches: list[str] | None, earlier: dict) -> None:
    """--overwrite true: delete the earlier evaluation's files (benches None: all of them; else those
    benchmarks' samples, and results.json rewritten without them) before sampling starts."""
    doomed = [out / "results.json", *(out / f for f in FIGURES), *out.glob("samples_*.jsonl"),
              *out.glob("samples_*.jsonl.state"), out / "reward_errors.jsonl"] if benches is None else \
        [p for b in benches for p in (samples_path(out, b), state_path(samples_path(out, b)))]
    doomed = [p for p in doomed if p.exists()]
    with write_errors(out, "the earlier evaluation is partly deleted"):
        for path in doomed:
            path.unlink()
        if benches and (out / "results.json").exists():
            write_results(out, {"model": settings["model"], "settings": settings, "benchmarks": earlier})
    if doomed:
        faults.say(f"--overwrite true: replaced the earlier evaluation's {', '.join(p.name for p in doomed)} "
                   f"in {out}")


def process_command(pid: int) -> str | None:
    """The command line of a live process (Linux /proc), for naming a lock's holder; None elsewhere."""
    try:
        return shlex.join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1])
    except OSError:
        return None


@contextmanager
def folder_lock(out: Path, where: str, command: str):
    """The run lock train.py takes (runs.RunLock), on the output folder (rank 0 under torchrun): a second
    evaluation or training into a locked folder is one line naming the holder (pid, command, since), and
    nothing of the folder changes."""
    if not D.is_main():
        yield
        return
    lock = runs.RunLock(out)
    lock.mine["command"] = command
    try:
        with write_errors(out / runs.RunLock.NAME, "nothing was written"):
            lock.acquire()
    except faults.UserError as err:
        holder = lock.holder() or {}
        pid = holder.get("pid")
        ours = isinstance(pid, int) and holder.get("host") == lock.mine["host"]
        if not ours or isinstance(err, faults.WriteError):   # another host's or a full disk: said already
            raise
        command = holder.get("command") or process_command(pid) or "command unknown"
        raise faults.UserError(f"{where}: another process is writing there (pid {pid}: {command}; since "
                               f"{holder.get('started', '?')}; {lock.path}); wait for it or stop it, or use "
                               f"another --out_dir") from None
    try:
        yield
    finally:
        lock.release()
