"""harness/faults.py — the user's mistakes: one clear line each, before anything slow runs.

What each script uses (train.py, evaluate.py, the studies):

    from harness import faults
    if __name__ == "__main__":
        faults.main_guard(main)          # UserError -> "prog: error: <one line>", exit 2; --debug: traceback

  UserError        a mistake of the person running the script (flag, path, data file, model name, ...). Its
                   message is one line naming what was wrong and what is expected. Real bugs are not
                   UserErrors and keep their traceback. Exit codes: 2 a mistake, 3 NonFiniteStop (too many
                   bad steps, or sampling met non-finite probabilities), 4 WriteError (disk full or another
                   write error: the path and the cause, the previous checkpoint intact), 130 StopTimeout.
  check_*          pre-flight checks that turn a bad path/name into a UserError before anything slow runs.
  load_data        data.load_problems with its messages as UserErrors, and an empty source refused.

The rest of the harness: guards.py (non-finite losses, gradients and weights), signals.py (stop signals),
oom.py (out of memory), inject.py (fault injection for tests), journal.py (evaluation's resumable record),
runs.py (run folders and checkpoints), tracking.py, distributed.py, viz.py.
"""
from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path

EMBEDDED_MODELS = ("smollm2-135m", "tiny-random")


class UserError(ValueError):
    """A mistake in what the user asked for (a bad value): main_guard prints its one-line message and exits
    with 2."""

    exit_code = 2


class NonFiniteStop(UserError):
    """Training stopped because too many steps in a row had non-finite losses or gradients (exit code 3)."""

    exit_code = 3


class WriteError(UserError):
    """A file of the run could not be written (disk full, quota, read-only, I/O error): one line naming the
    path and the cause; the previous checkpoint is intact (exit code 4)."""

    exit_code = 4


class StopTimeout(UserError):
    """A stop signal was not honoured at a safe point within --stop_timeout seconds: the run exits mid-step,
    losing that step (exit code 130, as for an interrupt)."""

    exit_code = 130


def say(text: str) -> None:
    """A console line that does not break a tqdm bar."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def main_guard(main, argv: list[str] | None = None):
    """Run main(argv) as a command: a UserError prints `prog: error: message` on one line and exits with its
    exit code (2); a second Ctrl-C exits with 130 and a short line. `--debug` anywhere on the command line
    is removed before main sees it and lets every exception show its traceback. Any other exception is a bug
    and keeps its traceback."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    args = [a for a in args if a != "--debug"]
    prog = Path(sys.argv[0]).name or "python"
    try:
        return main(args)
    except UserError as err:
        if debug:
            raise
        message = " ".join(str(err).split("\n")).strip()
        print(f"{prog}: error: {message}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)


# --------------------------------------------------------------------------------------------------------
# Pre-flight checks: paths and names
# --------------------------------------------------------------------------------------------------------
def check_writable(folder: str | Path, flag: str = "--out_dir") -> Path:
    """Create `folder` if needed and prove it takes a file; a UserError naming the flag otherwise (a full
    disk or quota: WriteError, exit 4, as for every other write)."""
    path = Path(folder)
    probe = path / f".write_test_{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        if path.is_dir():
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


def hub_blocked() -> str | None:
    """Why the HF hub cannot be reached now (a short probe), or None."""
    import data

    return data.hub_blocked()


def check_model(name: str, flag: str = "--model", embedded: tuple[str, ...] = EMBEDDED_MODELS) -> None:
    """A model name given on the command line must be an embedded model, a model folder, a run folder with a
    checkpoint, or an HF hub id that is cached or reachable; otherwise one UserError line."""
    import models

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
    blocked = hub_blocked()
    if blocked:
        raise UserError(f"{flag} {name}: not a local folder, not in the HF cache, and the HF hub is "
                        f"unreachable ({blocked}); {expected} reachable online")


# What train.py writes into a run folder (--overwrite removes exactly these).
RUN_FILES = ("metrics.jsonl", "checkpoints", "trees", "tensorboard", "wandb", "training.png", "config.json",
             "git_commit.txt", "abandoned")


def check_new_run(run_dir: Path, overwrite: bool, delete: bool = True) -> None:
    """A fresh run (no --resume) must not mix its records with an earlier run's: a folder holding metrics or
    checkpoints is a UserError saying how to continue, move or replace it; --overwrite true deletes the
    earlier run's files (RUN_FILES) first and nothing else (`delete`: torchrun's rank 0 only; every rank
    checks, so all of them stop with the same error)."""
    metrics = run_dir / "metrics.jsonl"
    records = sum(1 for line in metrics.read_text().splitlines() if line.strip()) if metrics.exists() else 0
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    if not records and not steps:
        return
    if overwrite:
        for name in RUN_FILES if delete else ():
            path = run_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        return
    held = [f"metrics.jsonl with {records} record{'s' * (records != 1)}"] if records else []
    held += [f"checkpoints up to {steps[-1]}"] if steps else []
    raise UserError(f"--out_dir {run_dir}: already holds a run ({', '.join(held)}); --resume {run_dir} "
                    f"continues it, another --out_dir starts a new one, --overwrite true replaces it")


def resume_source(resume: str) -> str | None:
    """--resume: the checkpoint folder to continue from, or None when the run folder has no checkpoint yet
    (start at step 0). A path that does not exist is a UserError."""
    import models

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


def load_data(source: str, flag: str, limit: int | None = None) -> list[dict]:
    """data.load_problems with its errors (which name the file and row) as UserErrors; no problems is one."""
    import data

    if source.endswith((".jsonl", ".json", ".parquet")) and not os.path.exists(source):
        raise UserError(f"{flag} {source}: no such file; expected a .jsonl/.json/.parquet file or one of "
                        f"{', '.join(data.NAMED_SOURCES)}")
    try:
        skip = (lambda line: say(f"{flag} {source}: {line}")) if flag == "--train_data" else None
        problems = data.load_problems(source, limit, skip)   # unmatchable golds: skipped in training only
    except (FileNotFoundError, ValueError) as err:
        raise UserError(f"{flag} {source}: {err}") from None
    except OSError as err:
        raise UserError(f"{flag} {source}: cannot read it ({err.strerror or err})") from None
    if not problems:
        raise UserError(f"{flag} {source}: no problems in it; expected at least one row with a problem and "
                        f"an answer")
    return problems


def model_context(model) -> int | None:
    """The model's context length (max position embeddings), when its config says."""
    return getattr(model.config, "max_position_embeddings", None)


def check_prompt_fits(n_prompt: int, new_tokens: int, context: int | None, where: str, flags: str = "",
                      fix: str = "a shorter problem or a smaller --max_new_tokens") -> None:
    """A prompt plus the most tokens generated after it must fit in the model's context: one response when
    evaluating, a whole root-to-leaf path of a tree when training (prompts.check_fits). flags: the settings
    that set new_tokens, shown in parentheses; fix: what to do instead."""
    if context and n_prompt + new_tokens > context:
        raise UserError(f"{where}: the prompt is {n_prompt} tokens and up to {new_tokens} new tokens follow"
                        f"{flags}, which exceeds the model's context of {context} tokens; expected {fix}")
