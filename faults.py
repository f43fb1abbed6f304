"""faults.py — bad input and faults: one clear line per user mistake, no lost work.

What each script uses (train.py, evaluate.py, analysis scripts):

    import faults
    if __name__ == "__main__":
        faults.main_guard(main)          # UserError -> "prog: error: <one line>", exit 2; --debug: traceback

  UserError        a mistake of the person running the script (flag, path, data file, model name, ...). Its
                   message is one line naming what was wrong and what is expected. Real bugs are not
                   UserErrors and keep their traceback.
  check_*          pre-flight checks that turn a bad path/name into a UserError before anything slow runs.
  load_data        data.load_problems with its messages as UserErrors, and an empty source refused.
  skip_nonfinite   the non-finite guard of an optimizer step (a mini-batch with a NaN/inf loss or gradient
                   norm is not applied: weights and optimizer state untouched).
  GracefulStop     SIGTERM/SIGINT: stop at the next safe point; a second Ctrl-C exits at once.
  halving_chunks   generate in chunks; on CUDA out-of-memory retry that chunk at half the size, down to 1.
  halving_retry    run a unit of work at a size (the update's micro-batch budget, evaluation's batch); on
                   out-of-memory (is_oom: torch's error or a cuBLAS/cuDNN allocation failure) halve and rerun.
  oom_point        fault injection for tests: DATPO_OOM_AT="base|branches|update|eval" raises
                   torch.OutOfMemoryError the first time the named point is reached.
  crash_point      fault injection for tests: DATPO_CRASH_AT="name:n[:SIGNAL]" signals this process the n-th
                   time the named point is reached (default SIGKILL).
"""
from __future__ import annotations

import math
import os
import shutil
import signal
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
    """Create `folder` if needed and prove it takes a file; a UserError naming the flag otherwise."""
    path = Path(folder)
    probe = path / f".write_test_{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
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

    return data._hub_blocked()


def check_model(name: str, flag: str = "--model", embedded: tuple[str, ...] = EMBEDDED_MODELS) -> None:
    """A model name given on the command line must be an embedded model, a model folder, a run folder with a
    checkpoint, or an HF hub id that is cached or reachable; otherwise one UserError line."""
    import models

    expected = (f"expected {' or '.join(embedded)}, a local model folder (config.json + weights), a run folder "
                f"with a checkpoint, or an HF hub name")
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
        raise UserError(f"{flag} {name}: not a local folder, not in the HF cache, and the HF hub is unreachable "
                        f"({blocked}); {expected} reachable online")


RUN_FILES = ("metrics.jsonl", "checkpoints", "trees", "tensorboard", "wandb", "training.png", "config.json",
             "git_commit.txt")   # what train.py writes into a run folder (--overwrite removes exactly these)


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
    raise UserError(f"--out_dir {run_dir}: already holds a run ({', '.join(held)}); --resume {run_dir} continues "
                    f"it, another --out_dir starts a new one, --overwrite true replaces it")


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
        raise UserError(f"--resume {resume}: a model folder, not a run or checkpoint folder; use --model for it")
    return None


def load_data(source: str, flag: str, limit: int | None = None) -> list[dict]:
    """data.load_problems with its errors (which name the file and row) as UserErrors; no problems is one."""
    import data

    if source.endswith((".jsonl", ".json", ".parquet")) and not os.path.exists(source):
        raise UserError(f"{flag} {source}: no such file; expected a .jsonl/.json/.parquet file or one of "
                        f"{', '.join(data.NAMED_SOURCES)}")
    try:
        problems = data.load_problems(source, limit)
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


def check_prompt_fits(n_prompt: int, max_new_tokens: int, context: int | None, where: str) -> None:
    """A prompt plus its generation budget must fit in the model's context."""
    if context and n_prompt + max_new_tokens > context:
        raise UserError(f"{where}: the prompt is {n_prompt} tokens and up to {max_new_tokens} new tokens "
                        f"follow, longer than the model's context of {context} tokens; expected a shorter "
                        f"problem or a smaller --max_new_tokens")


# --------------------------------------------------------------------------------------------------------
# Training-time faults
# --------------------------------------------------------------------------------------------------------
def skip_nonfinite(loss: float, grad_norm, optimizer) -> bool:
    """Non-finite guard of one optimizer step (a mini-batch): True when its loss or gradient norm is NaN/inf.
    Then its gradients are dropped so the caller skips optimizer.step(): weights and optimizer state
    (moments, step count) are untouched, as if the mini-batch had not been drawn."""
    if math.isfinite(float(loss)) and math.isfinite(float(grad_norm)):
        return False
    optimizer.zero_grad(set_to_none=True)
    return True


class GracefulStop:
    """SIGTERM / SIGINT handling for a loop with safe points.

    The first signal only sets `requested` (the loop checks it at its next safe point, writes a checkpoint
    and exits 0); a second one raises KeyboardInterrupt at once (main_guard exits with 130). Handlers are
    restored on exit. Outside the main thread (where signals cannot be caught) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, what: str = "after this step, with a checkpoint"):
        self.what = what
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt
        self.requested = name
        say(f"{name} received: stopping {self.what}; Ctrl-C again to quit at once")

    def __enter__(self) -> "GracefulStop":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def is_oom(err: BaseException) -> bool:
    """Out of device memory: torch's OutOfMemoryError, or an allocation failure that reaches Python as a plain
    RuntimeError — cuBLAS/cuDNN failing to allocate their workspace (CUBLAS_STATUS_ALLOC_FAILED) is the same
    condition seen from a library."""
    import torch

    text = str(err)
    return (isinstance(err, torch.OutOfMemoryError) or "out of memory" in text.lower()
            or "CUBLAS_STATUS_ALLOC_FAILED" in text or "CUDNN_STATUS_ALLOC_FAILED" in text)


OOM_SITES = ("base", "branches", "update", "eval")
_oom_fired: set[str] = set()


def oom_point(name: str) -> None:
    """Fault injection: with DATPO_OOM_AT="update" (several: comma-separated, from OOM_SITES) the first time
    this point is reached the process raises torch.OutOfMemoryError, the error CUDA raises, so each
    out-of-memory degradation path runs on CPU in tests. Once per site and process. Costs one environment
    lookup otherwise."""
    spec = os.environ.get("DATPO_OOM_AT")
    if not spec or name in _oom_fired:
        return
    sites = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in sites if s not in OOM_SITES]
    if unknown:
        raise UserError(f"DATPO_OOM_AT={spec}: unknown site(s) {', '.join(unknown)}; expected some of "
                        f"{', '.join(OOM_SITES)}")
    if name in sites:
        import torch

        _oom_fired.add(name)
        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by DATPO_OOM_AT at '{name}')")


def halving_retry(run, size: int, what: str, counters: dict | None = None, reset=None, retry: bool = True):
    """run(size) → its result; when it runs out of memory, reset() (drop its partial work, e.g. gradients),
    halve `size` and run it again, down to 1 — each retry logged and counted in counters['oom_retries'].
    Out of memory at size 1, or with retry=False (torchrun: ranks must run the same collectives), re-raises.
    The update passes its micro-batch budget: the same mini-batch in smaller micro-batches, the same loss."""
    import torch

    while True:
        try:
            return run(size)
        except RuntimeError as err:   # torch.OutOfMemoryError is one
            if not is_oom(err) or size <= 1 or not retry:
                raise
        # outside the except block: the failed attempt's tensors are released by now
        if reset is not None:
            reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        new = max(1, size // 2)
        if counters is not None:
            counters["oom_retries"] = counters.get("oom_retries", 0) + 1
        say(f"out of memory in {what} at {size}: retrying at {new}")
        size = new


def halving_chunks(jobs: list, chunk_size: int, run, what: str = "chunk", counters: dict | None = None) -> list:
    """run(chunk) -> list of one result per job, over `jobs` in chunks of `chunk_size`, in order. When a chunk
    runs out of (CUDA) memory it is retried at half the size, down to 1, and the smaller size is kept for the
    rest of the jobs; each retry is logged and counted in counters['oom_retries']. Out of memory at size 1
    re-raises."""
    import torch

    results: list = []
    size, begin = max(1, chunk_size), 0
    while begin < len(jobs):
        chunk = jobs[begin:begin + size]
        try:
            out = run(chunk)
        except RuntimeError as err:   # torch.OutOfMemoryError is one
            if not is_oom(err) or len(chunk) == 1:
                raise
            out = None
        if out is None:   # outside the except block: the failed chunk's tensors are released by now
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            size = max(1, len(chunk) // 2)
            if counters is not None:
                counters["oom_retries"] = counters.get("oom_retries", 0) + 1
            say(f"out of memory generating {what} ({len(chunk)} at once): retrying at {size}")
            continue
        results += out
        begin += len(chunk)
    return results


_crash_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Fault injection: with DATPO_CRASH_AT="name:n" (or "name:n:SIGTERM"), the n-th time this point is
    reached the process sends itself that signal (SIGKILL by default: no cleanup at all, as a preemption or
    a power loss). Several points: comma-separated. Costs one environment lookup otherwise."""
    spec = os.environ.get("DATPO_CRASH_AT")
    if not spec:
        return
    _crash_hits[name] = _crash_hits.get(name, 0) + 1
    for item in spec.split(","):
        parts = item.strip().split(":")
        if parts[0] == name and int(parts[1]) == _crash_hits[name]:
            sig = getattr(signal, parts[2]) if len(parts) > 2 else signal.SIGKILL
            os.kill(os.getpid(), sig)


class Stopped(Exception):
    """Raised at a safe point after a GracefulStop signal, by loops that save as they go (evaluation)."""


class Journal:
    """An append-only jsonl of finished work units, so a rerun (after a kill or a SIGTERM) skips what is done
    and ends with exactly the records and numbers of an uninterrupted run.

    After each unit its records are appended (flushed, fsynced), then a small state file beside it is
    replaced atomically: {settings, units done, records written, torch RNG state}. `resume()` keeps the
    records the state file vouches for (a line torn by a kill, or a unit appended without its state, is
    dropped and redone), restores the torch RNG state so the next unit samples what it would have, and
    returns them. A journal written with other settings is started over.
    """

    def __init__(self, path: str | Path, settings: dict, extra: dict | None = None):
        self.path = Path(path)
        self.extra = extra or {}
        self.state_path = self.path.with_name(self.path.name + ".state")
        self.settings = settings
        self.units = 0
        self.n_records = 0
        self.resumed = 0      # units found done by resume()

    def resume(self) -> list[dict]:
        """Records of the units already done (and the torch RNG restored after them); [] if none or stale."""
        import json

        import torch

        if not (self.path.exists() and self.state_path.exists()):
            return self._start_over()
        try:
            state = torch.load(self.state_path, weights_only=False)
        except Exception:  # a state file is replaced atomically; an unreadable one is not ours
            return self._start_over()
        if state.get("settings") != self.settings:
            say(f"{self.path}: written with other settings; starting it over")
            return self._start_over()
        with open(self.path, encoding="utf-8") as f:
            lines = f.read().splitlines()[:state["n_records"]]
        if len(lines) < state["n_records"]:
            return self._start_over()
        records = [json.loads(line) for line in lines]
        self._rewrite(lines)   # drop anything after the last vouched-for unit
        self.units, self.n_records = state["units"], state["n_records"]
        self.resumed = self.units
        torch.set_rng_state(state["rng"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        return records

    def _rewrite(self, lines: list[str]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, self.path)

    def _start_over(self) -> list[dict]:
        self._rewrite([])
        self.state_path.unlink(missing_ok=True)
        self.units = self.n_records = 0
        return []

    def append(self, records: list[dict]) -> None:
        """One finished unit: its records, then the state that vouches for them."""
        import json

        import torch

        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps({**self.extra, **r}, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        self.units += 1
        self.n_records += len(records)
        state = {"settings": self.settings, "units": self.units, "n_records": self.n_records,
                 "rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.state_path)
        crash_point("journal-append")
