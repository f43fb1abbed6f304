"""harness/preflight.py — pre-flight checks: a bad path, model name or data file is one UserError line
before anything slow runs (train.py's Run and evaluate.py's command call them).

  check_writable        a folder that takes a file (else UserError; a full disk WriteError)
  check_model           a model name is embedded, a folder, a run with a checkpoint, or a reachable hub id
  check_new_run         a fresh run never mixes its records with an earlier run's (--overwrite replaces it)
  resume_source         --resume: the checkpoint to continue from, or None (start at step 0)
  load_data             data.load_problems with its messages as UserErrors, and an empty source refused
  check_conversational  TRL's conversational prompts need a tokenizer with a chat template
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import data
import models
from harness import runs
from runtime import atomic
from runtime.faults import UserError, WriteError, say

EMBEDDED_MODELS = ("smollm2-135m", "tiny-random")


def check_writable(folder: str | Path, flag: str = "--out_dir") -> Path:
    """Create `folder` if needed and prove it takes a file; a UserError naming the flag otherwise (a full
    disk or quota: WriteError, exit 4, as for every other write)."""
    path, probe = Path(folder), None
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = atomic.exclusive_temp(path / "write_test", suffix=f".{os.getpid()}")   # never a planted link
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        if probe is not None:
            probe.unlink(missing_ok=True)   # a full disk may leave it empty
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise WriteError(f"{flag} {folder}: cannot write there ({err.strerror}); free space or choose "
                             f"another folder") from None
        raise UserError(f"{flag} {folder}: cannot write there ({err.strerror or err}); "
                        f"expected a folder you can create and write") from None
    return path


def _looks_like_path(name: str) -> bool:
    """A local path rather than an HF hub id ("owner/name" or "name")."""
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or "\\" in name
            or name.endswith("/") or name in (".", ".."))


def _hf_cached(repo: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json"), str)
    except Exception:  # an id the hub library rejects is not cached
        return False


def check_model(name: str, flag: str = "--model", embedded: tuple[str, ...] = EMBEDDED_MODELS) -> None:
    """A model name given on the command line must be an embedded model, a model folder, a run folder with a
    checkpoint, or an HF hub id that is cached or reachable; otherwise one UserError line."""
    expected = (f"expected {' or '.join(embedded)}, a local model folder (config.json + weights), "
                f"a run folder with a checkpoint, or an HF hub name")
    if name in embedded:
        return
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{flag} {name}: is a file, not a model folder; {expected}")
        if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").exists():
            if models.resolve_checkpoint(str(path)) == str(path):
                raise UserError(f"{flag} {name}: a run folder with no checkpoint yet; {expected}")
            return
        if not (path / "config.json").exists():
            raise UserError(f"{flag} {name}: folder has no config.json; {expected}")
        return
    if _looks_like_path(name):
        raise UserError(f"{flag} {name}: no such folder; {expected}")
    if _hf_cached(name):
        return
    blocked = data.hub_blocked()
    if blocked:
        raise UserError(f"{flag} {name}: not a local folder, not in the HF cache, and the HF hub is "
                        f"unreachable ({blocked}); {expected} reachable online")


def check_new_run(run_dir: Path, overwrite: bool, delete: bool = True) -> bool:
    """A fresh run (no --resume) must not mix its records with an earlier run's: a folder holding metrics or
    checkpoints is a UserError saying how to continue, move or replace it. With --overwrite true it returns
    True: the earlier run's files (RUN_FILES, and nothing else) are to be replaced — deleted here when
    `delete`, else by the caller once every other check has passed (train.py: the model, the data; torchrun:
    rank 0 only, after every rank has read the folder; runs.replace_run never follows a link)."""
    metrics = run_dir / "metrics.jsonl"
    records = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.is_file() else 0
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    if not records and not steps:
        return False
    if overwrite:
        if delete:
            runs.replace_run(run_dir)
        return True
    held = [f"metrics.jsonl with {records} record{'s' * (records != 1)}"] if records else []
    held += [f"checkpoints up to {steps[-1]}"] if steps else []
    raise UserError(f"--out_dir {run_dir}: already holds a run ({', '.join(held)}); --resume {run_dir} "
                    f"continues it, another --out_dir starts a new one, --overwrite true replaces it")


def resume_source(resume: str) -> str | None:
    """--resume: the checkpoint folder to continue from, or None when the run folder has no checkpoint yet
    (start at step 0). A path that does not exist is a UserError."""
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise UserError(f"--resume {resume}: no such folder; expected a run folder (its latest checkpoint is "
                        f"used) or one of its checkpoints/step_NNNNNN folders")
    if (path / "trainer_state.pt").exists():
        return str(path)
    source = models.resolve_checkpoint(str(path))
    if source != str(path) and (Path(source) / "trainer_state.pt").exists():
        return source
    if (path / "config.json").exists() and not (path / "metrics.jsonl").exists() and \
            not (path / "checkpoints").exists() and (path / "model.safetensors").exists():
        raise UserError(f"--resume {resume}: a model folder, not a run or checkpoint folder; "
                        f"use --model for it")
    return None


def load_data(source: str, flag: str, limit: int | None = None, **options) -> list[dict]:
    """data.load_problems with its errors (which name the file and row) as UserErrors; no problems is one.
    `options`: load_problems' dataset_config, prompt_column, answer_column, keep_columns (data.options)."""
    if source.endswith(data.DATA_FILES) and not os.path.exists(source):
        raise UserError(f"{flag} {source}: no such file; expected a {'/'.join(data.DATA_FILES)} file or one "
                        f"of {', '.join(data.NAMED_SOURCES)}")
    try:
        skip = (lambda line: say(f"{flag} {source}: {line}")) if flag == "--train_data" else None
        # unmatchable golds: skipped in training only
        problems = data.load_problems(source, limit, skip, **options)
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"{flag} {source}: {err}") from None
    except OSError as err:
        raise UserError(f"{flag} {source}: cannot read it ({err.strerror or err})") from None
    if not problems:
        raise UserError(f"{flag} {source}: no problems in it; expected at least one row with a problem and "
                        f"an answer")
    if flag == "--eval_data":
        problems = graded_rows(problems, source)
    return problems


def graded_rows(problems: list[dict], source: str) -> list[dict]:
    """The held-out rows the grader can evaluate: those with an answer. Rows without one load only under
    --reward (data.options); they are left out with one line, and a set with none is one UserError."""
    graded = [p for p in problems if p["answer"] is not None]
    if len(graded) == len(problems):
        return problems
    if not graded:
        raise UserError(f"--eval_data {source}: no row has an answer, and the held-out evaluation grades "
                        f"answers; expected --eval_every 0, or an --eval_data whose rows have answers "
                        f"(--answer_column names the column)")
    say(f"--eval_data {source}: {len(problems) - len(graded)} of {len(problems)} rows have no answer; the "
        f"held-out evaluation grades the {len(graded)} that have one")
    return graded


def check_conversational(tokenizer, model: str, data: dict[str, list[dict]]) -> None:
    """A conversational dataset (TRL's: prompts as lists of messages; data: {flag: its problems}) goes through
    the tokenizer's chat template (data.format_prompt): a tokenizer without one is refused at load, not at
    the first prompt."""
    if getattr(tokenizer, "chat_template", None):
        return
    for flag, problems in data.items():
        if any(isinstance(p["problem"], list) for p in problems):
            raise UserError(f"{flag}: its prompts are conversational (lists of messages), which need a chat "
                            f"template; the tokenizer of --model {model} has none: expected a model with "
                            f"one, or prompts as text")
