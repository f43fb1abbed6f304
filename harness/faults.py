"""faults.py — bad input and faults: one clear line per user mistake, no lost work.

What each script uses (train.py, evaluate.py, analysis scripts):

    import faults
    if __name__ == "__main__":
        faults.main_guard(main)          # UserError -> "prog: error: <one line>", exit 2; --debug: traceback

  UserError        a mistake of the person running the script (flag, path, data file, model name, ...). Its
                   message is one line naming what was wrong and what is expected. Real bugs are not
                   UserErrors and keep their traceback. Exit codes: 2 a mistake, 3 NonFiniteStop (too many
                   bad steps, or sampling met non-finite probabilities), 4 WriteError (disk full or another
                   write error: the path and the cause, the previous checkpoint intact), 130 StopTimeout.
  check_*          pre-flight checks that turn a bad path/name into a UserError before anything slow runs.
  load_data        data.load_problems with its messages as UserErrors, and an empty source refused.
  skip_nonfinite   the non-finite guard of an optimizer step (a mini-batch with a NaN/inf loss or gradient
                   norm is not applied: weights and optimizer state untouched).
  WeightGuard      the guard of the weights: an update that makes a weight (or the next forward's logits)
                   non-finite is undone bit for bit (weights and optimizer state restored from before it);
                   all_finite / logits_finite are its cheap checks, sampling_guard turns "probability
                   tensor contains inf/nan" into a NonFiniteStop line.
  (runs.py)        the run folder: lock, resume checks, checkpoint fallback/atomic write/pruning.
  GracefulStop     SIGTERM/SIGINT: stop at the next safe point; a second signal (or --stop_timeout
                   seconds) exits at once.
  halving_chunks   generate in chunks; on CUDA out-of-memory retry that chunk at half the size, down to 1.
  halving_retry    run a unit of work at a size (the update's micro-batch budget, evaluation's batch); on
                   out-of-memory (is_oom: torch's error or a cuBLAS/cuDNN allocation failure) halve and rerun.
  oom_point        fault injection for tests: DATPO_OOM_AT="base|branches|update|eval|prefill" raises
                   torch.OutOfMemoryError the first time the named point is reached.
  crash_point      fault injection for tests: DATPO_CRASH_AT="name:n[:SIGNAL]" signals this process the n-th
                   time the named point is reached (default SIGKILL).
"""
from __future__ import annotations

import contextlib
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

    return data.hub_blocked()


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


def check_prompt_fits(n_prompt: int, new_tokens: int, context: int | None, where: str, flags: str = "",
                      fix: str = "a shorter problem or a smaller --max_new_tokens") -> None:
    """A prompt plus the most tokens generated after it must fit in the model's context: one response when
    evaluating, a whole root-to-leaf path of a tree when training (train.check_fits). flags: the settings
    that set new_tokens, shown in parentheses; fix: what to do instead."""
    if context and n_prompt + new_tokens > context:
        raise UserError(f"{where}: the prompt is {n_prompt} tokens and up to {new_tokens} new tokens follow"
                        f"{flags}, which exceeds the model's context of {context} tokens; expected {fix}")


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


def _local(t):
    """The tensor this process holds (an FSDP2 DTensor's local shard, else the tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def all_finite(tensors) -> bool:
    """True when every tensor's sum is finite: a NaN or ±inf anywhere makes the sum non-finite (so does a
    tensor whose values are so huge that the sum overflows — about 1e38 / numel — weights that are broken
    all the same). One read of each tensor, no temporary the size of the weights, one host sync: 20x faster
    than an elementwise isfinite (135M fp32 weights on one CPU core: 0.025 s against 0.44 s)."""
    import torch

    sums = [_local(t).detach().sum(dtype=torch.float32) for t in tensors if _local(t).numel()]
    return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True


class WeightGuard:
    """Protects the weights, not only the loss (skip_nonfinite covers a non-finite loss or gradient): an
    update whose result is a non-finite weight — a huge learning rate, an overflow in AdamW's moments — is
    undone bit for bit.

        guard = WeightGuard(model, optimizer)
        guard.snapshot()                  # before the step's first optimizer.step()
        ... optimizer.step(); if not guard.weights_finite(): stop the update
        if bad: guard.restore()           # weights and optimizer state exactly as at snapshot()

    Cost, bounded: the snapshot copies the parameters and the optimizer state once per training step (not
    per optimizer step) into buffers allocated once and reused — in host memory (pinned on CUDA), so it
    costs no accelerator memory: one device-to-host copy of ~3x the weights per step (Qwen2.5-3B in bf16
    with AdamW: ~18 GB, about a second over PCIe, against minutes of generation per step; the 135M demo:
    ~1.6 GB of RAM; measured 0.12 s a snapshot, 0.14 s a restore on one core). The check after each
    optimizer step is one sum per parameter and one sync (all_finite: 0.025 s for the 135M model). Under FSDP each rank snapshots and checks its own shards (callers combine the verdict over ranks).
    """

    def __init__(self, model, optimizer, enabled: bool = True):
        self.params = [p for p in model.parameters()]
        self.optimizer = optimizer
        self.enabled = enabled
        self._weights: list | None = None
        self._state: dict = {}
        self.taken = False

    @staticmethod
    def _buffer(t):
        import torch

        pin = t.is_cuda and torch.cuda.is_available()
        return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)

    def _copy_out(self, buffers: list | None, tensors: list):
        if buffers is None or len(buffers) != len(tensors) or any(
                b.shape != _local(t).shape or b.dtype != t.dtype for b, t in zip(buffers, tensors)):
            buffers = [self._buffer(_local(t)) for t in tensors]
        for b, t in zip(buffers, tensors):
            b.copy_(_local(t).detach(), non_blocking=True)
        return buffers

    def snapshot(self) -> None:
        """Copy the weights and the optimizer state (every tensor of it, and its scalars) aside."""
        import torch

        if not self.enabled:
            return
        self._weights = self._copy_out(self._weights, self.params)
        state = {}
        for i, p in enumerate(self.params):
            held = self.optimizer.state.get(p)
            if not held:
                state[i] = None     # no state yet (before the first step): restore removes what the step made
                continue
            tensors = {k: v for k, v in held.items() if torch.is_tensor(v)}
            old = self._state.get(i)
            old_tensors = old[0] if old else {}
            names = sorted(tensors)
            bufs = self._copy_out([old_tensors.get(k) for k in names] if old_tensors and
                                  sorted(old_tensors) == names else None, [tensors[k] for k in names])
            state[i] = (dict(zip(names, bufs)), {k: v for k, v in held.items() if not torch.is_tensor(v)})
        self._state = state
        if any(p.is_cuda for p in self.params[:1]):
            torch.cuda.synchronize()    # the non-blocking copies are complete before anything changes
        self.taken = True

    def weights_finite(self) -> bool:
        """Every weight finite? (after an optimizer step; always True when the guard is off)"""
        return not self.enabled or all_finite(self.params)

    def restore(self) -> None:
        """Weights and optimizer state exactly as at the last snapshot()."""
        import torch

        if not (self.enabled and self.taken):
            raise RuntimeError("WeightGuard.restore() without a snapshot")
        with torch.no_grad():
            for b, p in zip(self._weights, self.params):
                _local(p).copy_(b)
            for i, p in enumerate(self.params):
                saved = self._state.get(i)
                if saved is None:
                    self.optimizer.state.pop(p, None)
                    continue
                tensors, scalars = saved
                held = self.optimizer.state[p]
                for k, b in tensors.items():
                    _local(held[k]).copy_(b)
                for k, v in scalars.items():
                    held[k] = v
        self.optimizer.zero_grad(set_to_none=True)


def logits_finite(model, input_ids) -> bool:
    """One forward of a short sequence (a prompt of this step): are the policy's logits finite? Catches
    weights that are finite but so large that sampling would meet inf/NaN probabilities (cost: one forward
    of a few dozen tokens per step)."""
    import torch

    with torch.no_grad():
        ids = torch.as_tensor([list(input_ids)[-64:]], device=next(model.parameters()).device)
        return bool(torch.isfinite(model(input_ids=ids).logits.float()).all())


@contextlib.contextmanager
def sampling_guard(step: int, run_dir):
    """Sampling that meets non-finite probabilities (torch.multinomial: "probability tensor contains either
    inf, nan or element < 0") — weights the finiteness checks let through, e.g. logits that overflow only on
    some prompts — is a NonFiniteStop line naming the run's last checkpoint, not a traceback."""
    try:
        yield
    except RuntimeError as err:
        if "probability tensor contains" not in str(err):
            raise
        import models

        last = models.resolve_checkpoint(str(run_dir))
        raise NonFiniteStop(f"step {step}: sampling met non-finite probabilities (the policy's logits); the "
                            f"latest checkpoint {last if last != str(run_dir) else '(none)'} holds the weights "
                            f"that produced them; expected a resume from an earlier checkpoint with a lower "
                            f"--lr") from err


class GracefulStop:
    """SIGTERM / SIGINT handling for a loop with safe points.

    The first signal only sets `requested` (the loop checks it at its next safe point, writes a checkpoint
    and exits 0); a second one raises KeyboardInterrupt at once (main_guard exits with 130). With
    `timeout` > 0 (--stop_timeout) a safe point not reached within that many seconds of the first signal
    raises StopTimeout (exit 130; the step in progress is lost, the last checkpoint is where --resume
    continues), so a stop is honoured in bounded time even inside a step that never ends. Handlers (and the
    alarm) are restored on exit. Outside the main thread (where signals cannot be caught) it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, what: str = "after this step, with a checkpoint", timeout: float = 0):
        self.what = what
        self.timeout = timeout
        self.requested: str | None = None
        self._previous: dict = {}

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt
        self.requested = name
        later = f", or in {self.timeout:g}s mid-step (--stop_timeout)" if self.timeout > 0 else ""
        say(f"{name} received: stopping {self.what}{later}; send it again to quit at once")
        if self.timeout > 0 and hasattr(signal, "SIGALRM"):
            self._previous.setdefault(signal.SIGALRM, signal.signal(signal.SIGALRM, self._expired))
            signal.setitimer(signal.ITIMER_REAL, self.timeout)

    def _expired(self, signum, frame):
        raise StopTimeout(f"stopped mid-step by {self.requested}: no safe point within --stop_timeout "
                          f"{self.timeout:g}s; the step in progress is lost, --resume continues from the last "
                          f"checkpoint")

    def cancel_timeout(self) -> None:
        """The safe point was reached: the --stop_timeout alarm no longer applies (a checkpoint is written)."""
        if self.timeout > 0 and hasattr(signal, "SIGALRM") and signal.SIGALRM in self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)

    def __enter__(self) -> "GracefulStop":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if getattr(signal, "SIGALRM", None) in self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
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


OOM_SITES = ("base", "branches", "update", "eval", "prefill")
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
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[:state["n_records"]]
        if len(lines) < state["n_records"]:
            return self._start_over()
        records = []
        for n, line in enumerate(lines, 1):
            try:
                records.append(json.loads(line))
            except ValueError:   # corrupted after it was written (a disk, an editor): never trusted
                say(f"{self.path} line {n}: corrupted (not JSON); its samples are not reused, starting it over")
                return self._start_over()
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
