"""runs.py — a run folder that cannot be corrupted: one run per folder, resume that checks what it resumes,
checkpoints written atomically (a full disk is one line, the previous checkpoint intact), damaged ones
skipped.

    runs.check_out_dir(cfg.out_dir)             # never into a checkpoint, a model or a run's own subfolders
    lock = runs.RunLock(run_dir).acquire()      # a second train.py into the folder: one line naming holder
    runs.check_resume_target(cfg.resume, run_dir, cfg.overwrite)  # --resume A --out_dir B, B another run
    runs.replace_run(run_dir)                   # --overwrite true, once every check passed: never via a link
    checkpoint, state = runs.pick_checkpoint(cfg.resume)          # the newest usable one (fallback + warning)
    changed = runs.check_resume_config(state["config"], new, allow)  # experiment-changing fields: exit 2
    runs.set_aside_later(run_dir, step)         # resumed from an earlier checkpoint: later ones moved aside
    with runs.checkpoint_folder(run_dir, step, keep) as tmp: ...  # atomic write, one-line WriteError, pruning
    runs.load_plain(path)                       # torch.load(weights_only=True): nothing in a file runs code

Everything here is plain functions over paths and dicts, so a training loop of any shape can call them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import struct
import time
from contextlib import contextmanager
from pathlib import Path

from runtime import atomic
from runtime.faults import UserError, WriteError, say, write_failure

# What train.py writes into a run folder (--overwrite removes exactly these).
RUN_FILES = ("metrics.jsonl", "checkpoints", "trees", "tensorboard", "wandb", "training.png", "config.json",
             "git_commit.txt", "abandoned")


# --------------------------------------------------------------------------------------------------------
# One run per folder
# --------------------------------------------------------------------------------------------------------
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:    # alive, someone else's
        return True
    return True


@contextmanager
def folder_flock(folder: Path):
    """An exclusive flock(2) on `folder` itself, for a few milliseconds of check-then-replace (RunLock): the
    kernel drops it when the holder dies, so it is never stale. Where the file system has no flock for
    folders (some network mounts) it is skipped: the lock's hard link still keeps fresh starts apart."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        fd = None
    try:
        if fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)   # closing the last descriptor releases the flock


class RunLock:
    """RUN/run.lock holds {"pid", "host", "started"} of the run writing into the folder.

    acquire(): the lock file is written whole under a private name (created exclusively: a link planted in
    the folder cannot redirect it) and hard-linked into place (a link fails if the name exists, atomically),
    so two runs started together cannot both get it and nobody reads a half written lock. A lock held by a
    live process (or by any process on another host: its pid cannot be checked from here) is a UserError
    naming the holder. A lock of this host whose pid is dead (a killed run) is stale: taken over with a
    message. Judging a lock stale and replacing it happen under an exclusive flock of the folder (released
    by the kernel when its holder dies, so it never goes stale itself): two processes taking over one stale
    lock cannot both win — the second finds the first one's live lock. release() removes it only while it
    is still ours."""

    NAME = "run.lock"

    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / self.NAME
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.held = False

    def holder(self) -> dict | None:
        """The lock's content; {} when unreadable (torn by a kill before this scheme, or not ours);
        None if absent."""
        try:
            held = json.loads(self.path.read_text())
            return held if isinstance(held, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def acquire(self) -> "RunLock":
        tmp = None
        try:
            tmp = atomic.exclusive_temp(self.path, suffix=f".{os.getpid()}")
            tmp.write_text(json.dumps(self.mine))
        except OSError as err:   # a full disk: the folder took check_writable's probe, not this
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise WriteError(f"writing {self.path}: {write_failure(err)}; nothing of the run was written; "
                             f"free space and run the same command again") from None
        try:
            with folder_flock(self.path.parent):
                return self._take(tmp)
        finally:
            tmp.unlink(missing_ok=True)

    def _take(self, tmp: Path) -> "RunLock":
        for _ in range(3):
            try:
                os.link(tmp, self.path)
                self.held = True
                return self
            except FileExistsError:
                pass
            holder = self.holder()
            if holder is None:
                continue                                         # released meanwhile: try again
            pid, host = holder.get("pid"), holder.get("host")
            if isinstance(pid, int) and host == self.mine["host"] and _pid_alive(pid):
                raise UserError(f"--out_dir {self.path.parent}: another run is writing there (pid {pid} "
                                f"on {host}, since {holder.get('started', '?')}, {self.path}); wait for "
                                f"it, stop it, or use another --out_dir")
            if isinstance(pid, int) and host != self.mine["host"]:
                raise UserError(f"--out_dir {self.path.parent}: another run holds it (pid {pid} on host "
                                f"{host}, since {holder.get('started', '?')}); if that run is gone, "
                                f"delete {self.path}")
            what = f"pid {pid} is not running" if isinstance(pid, int) else "unreadable lock file"
            say(f"{self.path}: stale lock taken over ({what}; an earlier run was killed)")
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
        raise UserError(f"--out_dir {self.path.parent}: could not take {self.path} "
                        f"(other runs keep taking it)")

    def release(self) -> None:
        if self.held and (self.holder() or {}).get("pid") == self.mine["pid"]:
            self.path.unlink(missing_ok=True)
        self.held = False

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------------
# Resume checks what it resumes
# --------------------------------------------------------------------------------------------------------
# Fields a resumed run may change: how long it runs, how often it evaluates/saves/logs, where it writes, how
# it reports, guards and threads, and activation checkpointing (memory and time, the same gradients: a run
# that ran out of memory may resume with it on). Everything else (method, the preset's algorithm fields,
# model, data, seeds, shapes, optimisation) changes the experiment: a resumed run that changes one is a mix
# of two experiments.
RESUME_MAY_CHANGE = frozenset({
    "steps", "eval_every", "save_every", "log_trees_every", "report_to", "threads", "out_dir", "resume",
    "overwrite", "max_bad_steps", "allow_config_change", "keep_checkpoints", "stop_timeout", "guard_weights",
    "gradient_checkpointing", "max_reward_error_share",
})


def run_folder_of(checkpoint_or_run: str | Path) -> Path:
    """The run folder of a run folder or of one of its checkpoints/step_NNNNNN folders. The path is read as
    given before links are followed, so RUN/checkpoints/step_N belongs to RUN also when checkpoints/ is a
    link to a scratch disk."""
    given = Path(os.path.abspath(Path(checkpoint_or_run).expanduser()))
    for path in (given, given.resolve()):
        if path.name.startswith("step_") and path.parent.name == "checkpoints":
            return path.parent.parent.resolve()
    return given.resolve()


def same_run(checkpoint_or_run: str | Path, run_dir: str | Path) -> bool:
    """Whether a run folder or checkpoint (--resume) belongs to the run folder `run_dir`: its run folder is
    `run_dir`, or it is one of the folders in `run_dir`/checkpoints (also named by a link's target: a
    checkpoint on a scratch disk named by its own path)."""
    run_dir = Path(run_dir).expanduser().resolve()
    if run_folder_of(checkpoint_or_run) == run_dir:
        return True
    here = Path(checkpoint_or_run).expanduser().resolve()
    return (run_dir / "checkpoints").is_dir() and here.parent == (run_dir / "checkpoints").resolve()


def checkpoints_link_problem(run_dir: str | Path) -> str | None:
    """Why RUN/checkpoints, a link (a scratch disk), cannot be used, or None: a link to nothing (the disk
    not mounted) would read as "no checkpoint yet" and a resume would start over, dropping the metrics."""
    folder = Path(run_dir) / "checkpoints"
    if folder.is_symlink() and not folder.is_dir():
        return (f"{folder} is a link to {os.readlink(folder)}, which is not a folder here (a scratch disk "
                f"not mounted?)")
    return None


def holds_run(folder: Path) -> bool:
    """A folder with metrics records or checkpoints (what check_new_run protects)."""
    metrics = folder / "metrics.jsonl"
    return (metrics.exists() and metrics.stat().st_size > 0) or any((folder / "checkpoints").glob("step_*"))


# A run's own subfolders (RUN_FILES): a run is never started inside another run's.
RUN_SUBFOLDERS = ("checkpoints", "trees", "tensorboard", "wandb", "abandoned")
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin", "*.gguf")


def is_model_folder(folder: Path) -> str | None:
    """'config.json + WEIGHTS' when `folder` is a model (an HF/sentence-transformers folder, a checkpoint
    copied out of a run), else None. A run folder's config.json is the run's settings, no weights beside."""
    if not (folder / "config.json").is_file():
        return None
    weights = next((w for pattern in WEIGHT_FILES for w in sorted(folder.glob(pattern))), None)
    return f"config.json + {weights.name}" if weights else None


def owner_of(folder: str | Path) -> str | None:
    """What `folder` belongs to when a run must not write there, whatever --overwrite says: it is (or is
    inside) a checkpoint, a model folder, or a run's own subfolder (checkpoints/, trees/, ...). None for a
    new folder, an empty one, or a run folder (those are check_new_run's and check_resume_target's)."""
    path = Path(folder).expanduser().resolve()
    for above in (path, *path.parents):
        inside = "is" if above == path else "is inside"
        if (above / "trainer_state.pt").is_file() or (above.is_dir() and above.parent.name == "checkpoints"
                                                      and above.name.startswith(("step_", ".tmp_step_"))):
            return f"{inside} the checkpoint {above.name} of the run {above.parent.parent}"
        model = is_model_folder(above)
        if model and above == path:
            return f"is a model folder ({model}): the run's config.json would replace the model's"
        if model:
            return f"is inside the model folder {above} ({model})"
        if above != path and path.relative_to(above).parts[0] in RUN_SUBFOLDERS and holds_run(above):
            part = path.relative_to(above).parts
            return f"{'is' if len(part) == 1 else 'is inside'} the {part[0]}/ folder of the run {above}"
    return None


def check_out_dir(out_dir: str | Path) -> None:
    """--out_dir that belongs to something else (owner_of) is a UserError before anything is created there:
    --overwrite true replaces a run's records, never a checkpoint or a model."""
    owner = owner_of(out_dir)
    if owner:
        raise UserError(f"--out_dir {out_dir}: {owner}; a run writes only into a new folder or a run "
                        f"folder of its own (--overwrite true does not change that); expected another "
                        f"--out_dir, e.g. runs/NAME")


def check_resume_target(resume: str, out_dir: str | Path, overwrite: bool) -> bool:
    """--resume A --out_dir B where B is not A's run folder and already holds another run: resuming would
    delete B's later metrics rows and overwrite its checkpoints, so it is refused unless --overwrite true.
    Returns True when B holds another run that --overwrite true replaces (the caller deletes it, once
    everything else is checked). Read-only: a checkpoint to resume that lies inside what replacing B would
    delete is refused here, before anything is deleted."""
    source, target = run_folder_of(resume), Path(out_dir).expanduser().resolve()
    if same_run(resume, target) or not holds_run(target):
        return False
    if not overwrite:
        raise UserError(f"--resume {resume} --out_dir {out_dir}: {out_dir} holds another run; continuing "
                        f"{source.name} there would overwrite its records; use --out_dir {source} (or a new "
                        f"folder), or --overwrite true to replace it")
    here = Path(resume).expanduser().resolve()
    for doomed in replaced_paths(target):
        if here == doomed or doomed in here.parents:
            raise UserError(f"--resume {resume} --out_dir {out_dir} --overwrite true: the checkpoint to "
                            f"resume is inside {doomed}, which replacing {out_dir}'s run would delete; "
                            f"expected a checkpoint outside {out_dir}, or resume {out_dir} itself")
    return True


def replaced_paths(run_dir: Path) -> list[Path]:
    """What replace_run deletes in `run_dir`, links followed (to compare a checkpoint against)."""
    return [(Path(run_dir) / name).resolve() for name in RUN_FILES if os.path.lexists(Path(run_dir) / name)]


# What train.py writes inside checkpoints/ (a linked checkpoints/ keeps everything else, and the link).
CHECKPOINT_ENTRIES = ("step_*", ".tmp_step_*", "latest", ".latest.*", "abandoned")


def replace_run(run_dir: Path) -> list[str]:
    """--overwrite true: delete the earlier run's own files (RUN_FILES) and nothing else; returns
    their names. Called only once every other check passed. A link is never followed into a deletion:
    checkpoints/ as a link (a scratch disk) keeps the link and loses only the checkpoints train.py wrote
    there (CHECKPOINT_ENTRIES); any other link among the run's files is removed, its target untouched."""
    run_dir, removed = Path(run_dir), []
    for name in RUN_FILES:
        path = run_dir / name
        if not os.path.lexists(path):
            continue
        if name == "checkpoints" and path.is_symlink() and path.is_dir():
            for pattern in CHECKPOINT_ENTRIES:
                for entry in path.glob(pattern):
                    atomic.remove_tree(entry)
        else:
            atomic.remove_tree(path)
        removed.append(name)
    return removed


# Config fields renamed since a run was saved: its config.json is read with the new names.
RENAMED_FIELDS = {"branch_budget": "branch_length"}
# Fields earlier versions wrote into config.json and this one no longer has: a saved run's settings are read
# without them (their defaults were today's behaviour), anything else unknown is refused (cli.saved_config).
REMOVED_FIELDS = ("log_every", "naive_prefill")


def upgrade(saved: dict) -> dict:
    """A saved config (config.json, a checkpoint's) with today's field names (RENAMED_FIELDS)."""
    return {RENAMED_FIELDS.get(k, k): v for k, v in saved.items()}


def resolved_paths(values: dict) -> dict:
    """The settings with each relative path that names a file or folder here made absolute, so that a run's
    config.json works from any working folder (`--resume RUN` elsewhere): a data file (--train_data,
    --eval_data), a model or embedder folder, a reward FILE.py, a --resume path. Names (arith-train,
    smollm2-135m, Qwen/Qwen2.5-3B, a module:function) stay as written."""
    import data
    import models

    def here(path: str, kind) -> str:
        absolute = Path(path).expanduser()
        return str(absolute.resolve()) if not absolute.is_absolute() and kind(absolute) else path

    out = dict(values)
    for name in ("train_data", "eval_data"):
        if isinstance(out.get(name), str) and out[name].endswith(data.DATA_FILES):
            out[name] = here(out[name], Path.is_file)
    for name in ("model", "embed_model"):
        if isinstance(out.get(name), str) and out[name] not in models.EMBEDDED:
            out[name] = here(out[name], Path.is_dir)
    if isinstance(out.get("resume"), str) and out["resume"]:
        out["resume"] = here(out["resume"], Path.exists)
    if isinstance(out.get("reward"), list):
        out["reward"] = [here(spec.rpartition(":")[0], Path.is_file) + ":" + spec.rpartition(":")[2]
                         if isinstance(spec, str) and spec.rpartition(":")[0].endswith(".py") else spec
                         for spec in out["reward"]]
    return out


def resolve_paths(cfg):
    """cfg with resolved_paths applied in place (its other attributes kept); returns it."""
    for name, value in resolved_paths(dataclasses.asdict(cfg)).items():
        if value != getattr(cfg, name):
            setattr(cfg, name, value)
    return cfg


def config_changes(saved: dict, new: dict) -> dict[str, tuple]:
    """{field: (saved value, new value)} for every field both configs have that differs (a field one side
    lacks is a knob added or removed since: its default reproduces the old behaviour; a renamed field is
    read by its new name, upgrade). A relative path saved by an older version counts as the same file when
    it names it from here (resolved_paths)."""
    saved = resolved_paths(upgrade(saved))
    keys = sorted(set(saved) & set(new))
    return {k: (saved.get(k), new.get(k)) for k in keys if k != "history" and saved.get(k) != new.get(k)}


def check_resume_config(saved: dict, new: dict, allow: bool = False) -> dict[str, tuple]:
    """Compare the checkpoint's config with the command line's. Experiment-changing fields that differ are a
    UserError listing them (unless `allow`: --allow_config_change true); returns every change (allowed or
    forced) for the history in config.json."""
    changes = config_changes(saved, new)
    fixed = {k: v for k, v in changes.items() if k not in RESUME_MAY_CHANGE}
    if fixed and not allow:
        listed = ", ".join(f"{k} {old!r} -> {now!r}" for k, (old, now) in fixed.items())
        raise UserError(f"--resume: the command line changes the experiment of the run it resumes "
                        f"({listed}); expected the run's own settings (its config.json), or "
                        f"--allow_config_change true to continue it as a mix")
    return changes


def data_hashes(problems: list[dict], eval_problems: list[dict]) -> dict:
    """What a checkpoint records of the data it trained on: the SHA-256 of the training rows and of the
    held-out rows (after --eval_limit; None without evaluation), as loaded."""
    from harness import measured

    return {"train_data": measured.problems_hash(problems),
            "eval_data": measured.problems_hash(eval_problems) if eval_problems else None}


def check_resume_data(state: dict, data: dict, allow: bool = False,
                      sources: dict | None = None) -> dict[str, tuple]:
    """A resume whose data files hold other rows than when the checkpoint was written (a file edited or
    replaced under the same name) continues another experiment: a UserError naming the flag, unless
    `allow` (--allow_config_change true); returns {"<flag> rows": (old, new)} for config.json's history.
    `sources`: each flag's value, to name the file.
    A checkpoint of an older version records no hashes: nothing to compare."""
    from harness import measured

    saved = state.get("data") if isinstance(state.get("data"), dict) else {}
    changes = {f"{key} rows": (saved[key], now) for key, now in data.items()
               if saved.get(key) is not None and now is not None and saved[key] != now}
    if changes and not allow:
        flags = {key: key.split()[0] for key in changes}
        listed = ", ".join(f"--{flags[key]} {(sources or {}).get(flags[key], '')}: {measured.short(old)} -> "
                           f"{measured.short(now)}" for key, (old, now) in changes.items())
        raise UserError(f"--resume: the data's rows changed since the checkpoint was written ({listed}: "
                        f"a file edited or replaced under the same name); expected the rows the run "
                        f"trained on, or --allow_config_change true to continue on these (recorded in "
                        f"config.json's history)")
    return changes


def with_history(saved_json: dict, new: dict, changes: dict, step: int) -> dict:
    """config.json after a resume: the new config plus the saved history and this resume's changes."""
    history = list(saved_json.get("history", []))
    if changes:
        history.append({"resumed_at_step": step, "changed": {k: list(v) for k, v in changes.items()}})
    return {**new, **({"history": history} if history else {})}


def write_text(path: Path, text: str) -> None:
    """Replace a file atomically: a kill or a full disk leaves the old file or the new one, never half of one
    (the partial temporary file is removed before the error goes on); the temporary file is created
    exclusively, so a link planted in the folder cannot redirect the write (runtime/atomic.py)."""
    atomic.write_text(path, text)


def write_json(path: Path, value) -> None:
    """Replace a JSON file atomically (write_text)."""
    write_text(path, json.dumps(value, indent=2, sort_keys=True))


# --------------------------------------------------------------------------------------------------------
# Checkpoints: written atomically, pruned, and checked before a resume trusts them
# --------------------------------------------------------------------------------------------------------
def step_of(checkpoint: Path) -> int:
    """The step of a checkpoints/step_NNNNNN folder (by number: step_1000000 comes after step_999999)."""
    return int(Path(checkpoint).name.rsplit("_", 1)[1])


def checkpoint_steps(run_dir: Path) -> list[Path]:
    """Complete checkpoints (step_* folders with a trainer state), oldest first."""
    folder = Path(run_dir) / "checkpoints"
    complete = [p for p in folder.glob("step_*")
                if p.name[5:].isdigit() and (p / "trainer_state.pt").exists()]
    return sorted(complete, key=step_of)


@contextmanager
def checkpoint_folder(run_dir: Path, step: int, keep: int = 0):
    """Yields a temporary folder to write checkpoint `step` into; on success it is renamed to
    checkpoints/step_NNNNNN, the `latest` pointer replaced, and (keep > 0) the oldest checkpoints deleted
    until `keep` remain — never this one (prune_checkpoints). A write error (disk full, ...) raises
    WriteError, one line naming the path and the cause; any failure removes the partial folder (partial
    ones of earlier kills go first), and earlier checkpoints are never touched by a failed write."""
    folder = Path(run_dir) / "checkpoints"
    final, tmp = folder / f"step_{step:06d}", None
    try:
        for partial in folder.glob(".tmp_step_*"):   # a kill mid-write left it: nothing refers to it
            with contextlib.suppress(OSError):
                atomic.remove_tree(partial)           # a link planted there: the link only
        folder.mkdir(parents=True, exist_ok=True)
        # made new by this call (mkdir fails on any existing name): never a planted folder or a link
        (folder / f".tmp_step_{step:06d}").mkdir()
        tmp = folder / f".tmp_step_{step:06d}"
        yield tmp
        atomic.remove_tree(final)
        os.rename(tmp, final)
        write_pointer(folder, final.name)
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = write_failure(err) if isinstance(err, Exception) else None
        if cause is None:
            raise
        previous = checkpoint_steps(run_dir)
        kept = f"previous checkpoint {previous[-1]} intact" if previous else "no earlier checkpoint"
        raise WriteError(f"writing checkpoint {final}: {cause} ({getattr(err, 'filename', None) or tmp}); "
                         f"{kept}; free space and resume with --resume {run_dir}") from err
    if keep > 0:
        prune_checkpoints(run_dir, keep, written=final)


def write_pointer(folder: Path, name: str) -> None:
    """checkpoints/latest := `name`, replaced atomically (through an exclusive temporary file)."""
    atomic.write_text(folder / "latest", name)


def prune_checkpoints(run_dir: Path, keep: int, written: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints until `keep` remain (--keep_checkpoints); returns what was
    deleted. `written` (the checkpoint just written, which `latest` names) is never deleted, nor any later
    one: those belong to a future a resume abandoned (set_aside_later moves them out first)."""
    complete = checkpoint_steps(run_dir)
    if written is not None:
        if not any(p.name == Path(written).name for p in complete):   # nothing usable written: keep all
            return []
        complete = [p for p in complete if step_of(p) <= step_of(written)]
    doomed = complete[:-keep] if keep > 0 else []
    for path in doomed:
        atomic.remove_tree(path)   # a step_* link: the link only, never what it points at
    return doomed


def set_aside_later(run_dir: Path, step: int) -> tuple[list[str], Path | None]:
    """A resume from checkpoint `step` of this run abandons the continuation its later checkpoints hold
    (their metrics lines are dropped, they would be redone): they are moved, not deleted, to
    RUN/abandoned/after_step_NNNNNN[_n]/ so that no resume, --model RUN or pruning picks them again, and
    `latest` names the resumed checkpoint. Returns (the moved folders' names, where they went)."""
    folder = Path(run_dir) / "checkpoints"
    later = [p for p in folder.glob("step_*") if p.name[5:].isdigit() and step_of(p) > step] \
        if folder.is_dir() else []
    if not later:
        return [], None
    # beside checkpoints/ on the same disk: RUN/abandoned, or inside a checkpoints/ that links to another
    # disk (a rename cannot cross disks, and copying checkpoints would double them there)
    root = Path(run_dir) / "abandoned"
    if folder.is_symlink() and os.stat(folder).st_dev != os.stat(run_dir).st_dev:
        root = folder / "abandoned"
    dest = root / f"after_step_{step:06d}"
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"after_step_{step:06d}_{n}")
    dest.mkdir(parents=True)
    for path in sorted(later, key=step_of):
        os.rename(path, dest / path.name)
    write_pointer(folder, f"step_{step:06d}")
    return [p.name for p in sorted(later, key=step_of)], dest


def safetensors_damage(path: Path) -> str | None:
    """Why a .safetensors file is unusable (missing, truncated, bad header), checked from its header and size
    without reading the tensors; None when it looks whole."""
    if not path.exists():
        return f"{path.name} missing"
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} truncated ({size} bytes)"
            n = struct.unpack("<Q", head)[0]
            if n > size - 8:
                return f"{path.name} truncated (header of {n} bytes, file of {size})"
            header = json.loads(f.read(n))
    except (OSError, ValueError, RecursionError) as err:   # RecursionError: JSON nested 100,000 deep
        return f"{path.name} unreadable ({type(err).__name__ if isinstance(err, RecursionError) else err})"
    why = safetensors_header_problem(header)
    if why:
        return f"{path.name} has a damaged header ({why})"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        return f"{path.name} truncated ({size} bytes, expected {8 + n + end})"
    return None


def safetensors_header_problem(header) -> str | None:
    """Why a safetensors header (its JSON) is not one: an object of tensor name -> {"dtype": str, "shape":
    [int >= 0, ...], "data_offsets": [begin, end], 0 <= begin <= end} plus an optional "__metadata__" object
    of strings; None when it is. Any other JSON shape (a list, a number, a field missing) is damage, so the
    checkpoint is skipped like a truncated one, never a KeyError."""
    def count(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(header, dict):
        return f"a JSON {_json_kind(header)}, not an object"
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                return "__metadata__ is not an object of strings"
            continue
        if not isinstance(entry, dict):
            return f"{name[:60]!r} is a JSON {_json_kind(entry)}, not an object"
        offsets, shape = entry.get("data_offsets"), entry.get("shape")
        if not isinstance(entry.get("dtype"), str):
            return f"{name[:60]!r} has no dtype"
        if not (isinstance(shape, list) and all(count(d) for d in shape)):
            return f"{name[:60]!r} has no shape of whole numbers"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(count(o) for o in offsets)
                and offsets[0] <= offsets[1]):
            return f"{name[:60]!r} has no data_offsets [begin, end]"
    return None


def _json_kind(value) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


class UnsafeFile(Exception):
    """A torch file whose pickle names a Python object (a class, a function): how a payload runs code on
    load. load_plain refuses it before anything in it runs; args[0] names the object."""


def load_plain(path: Path, mmap: bool = False):
    """torch.load(weights_only=True): tensors and plain values (dicts, lists, tuples, numbers, strings) only,
    so nothing in a file someone else wrote (a shared run folder, a downloaded checkpoint) can run code.
    A pickle naming any other object raises UnsafeFile; other errors (a torn file) propagate."""
    import pickle

    import torch

    try:
        return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        named = re.search(r"GLOBAL ([\w.]+)", str(err))
        if named:
            raise UnsafeFile(named.group(1)) from None
        raise


def unsafe_line(path: Path, err: UnsafeFile) -> str:
    """The one line naming a refused file: nothing in it ran."""
    return (f"{path} holds a Python object ({err.args[0]}), not only tensors and plain values: refused "
            f"unloaded, nothing in it ran")


# What train.py's trainer state holds (loop.RunState.trainer_state plus optimizer and config): anything else
# is a damaged (or foreign) state, skipped like a torn one.
TRAINER_FIELDS = {"step": int, "cursor": int, "rng": dict, "optimizer": dict}


def trainer_state_problem(state) -> str | None:
    if not isinstance(state, dict):
        return f"not a dict but {type(state).__name__}"
    for name, kind in TRAINER_FIELDS.items():
        if not isinstance(state.get(name), kind) or isinstance(state.get(name), bool):
            return f"field {name!r} missing or not {kind.__name__}"
    if state["step"] < 0 or state["cursor"] < 0:
        return f"negative step {state['step']} or cursor {state['cursor']}"
    rng = state["rng"]
    if not isinstance(rng.get("python"), (tuple, list)) or not hasattr(rng.get("torch"), "dtype"):
        return "field 'rng' lacks its python or torch state"
    if not isinstance(state.get("config", {}), dict):
        return "field 'config' is not a dict"
    if state.get("pending_eval") not in (None, "during", "after"):
        return f"field 'pending_eval' is {state['pending_eval']!r}"
    return None


def load_trainer_state(checkpoint: Path):
    """(trainer state, None) or (None, why it is unusable). Loaded with weights_only (load_plain): a state
    holding any other Python object raises UnsafeFile (refused by pick_checkpoint, never skipped past)."""
    try:
        state = load_plain(Path(checkpoint) / "trainer_state.pt", mmap=True)
    except UnsafeFile:
        raise
    except Exception as err:   # a torn zip, a truncated pickle, ...: all mean "damaged"
        return None, f"trainer_state.pt unreadable ({str(err).splitlines()[0][:120]})"
    why = trainer_state_problem(state)
    return (None, f"trainer_state.pt is not train.py's ({why})") if why else (state, None)


def checkpoint_damage(checkpoint: Path):
    """(trainer state, None) for a usable checkpoint, else (None, the reason)."""
    for name in ("model.safetensors",):
        why = safetensors_damage(Path(checkpoint) / name)
        if why:
            return None, why
    return load_trainer_state(checkpoint)


def pick_checkpoint(resume: str, source: str | None):
    """The checkpoint a resume continues from and its trainer state, falling back past damaged ones.

    `source`: preflight.resume_source's answer (None: nothing to resume, start at step 0). When --resume names
    a run folder, its complete checkpoints are tried newest first; a damaged one (unreadable weights or
    trainer state) is skipped with a one-line warning. A checkpoint named explicitly is not replaced by
    another one: damaged, it is a UserError. None usable: a UserError naming them all. A trainer state that
    holds a Python object (UnsafeFile) is a UserError at once: it was put there, not torn by a crash, so the
    folder is not trusted for an earlier checkpoint either."""
    if source is None:
        return None, None
    named = Path(resume).expanduser()
    explicit = (named / "trainer_state.pt").exists()
    candidates = [Path(source)] if explicit else sorted(checkpoint_steps(run_folder_of(source)), reverse=True)
    if not candidates:
        candidates = [Path(source)]
    damaged = []
    for checkpoint in candidates:
        try:
            state, why = checkpoint_damage(checkpoint)
        except UnsafeFile as err:
            refused = unsafe_line(checkpoint / "trainer_state.pt", err)
            raise UserError(f"--resume {resume}: {refused}; expected a trainer state written by train.py "
                            f"(resume from a checkpoint you trust, or get the run from its source "
                            f"again)") from None
        if state is not None:
            if damaged:
                say(f"checkpoint {damaged[-1][0]} is damaged ({damaged[-1][1]}); resuming from the previous "
                    f"complete checkpoint {checkpoint}")
            return str(checkpoint), state
        damaged.append((checkpoint, why))
    listed = "; ".join(f"{c.name}: {why}" for c, why in damaged)
    raise UserError(f"--resume {resume}: no usable checkpoint ({listed}); expected a checkpoint whose "
                    f"model.safetensors and trainer_state.pt are whole")


def check_run_config(run_dir: Path) -> None:
    """RUN/config.json, read on a resume (its history is carried on), must be a JSON object: a torn or
    edited one is a UserError before anything loads (rewriting it would lose its resume history: the user's
    call)."""
    path = Path(run_dir) / "config.json"
    if not path.exists():
        return
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        why = None if isinstance(value, dict) else f"a JSON {type(value).__name__}, not an object"
    except UnicodeDecodeError as err:
        why = f"not UTF-8 text (byte {err.start})"
    except ValueError as err:
        why = f"torn or not JSON ({err})"
    except OSError as err:
        why = f"unreadable ({err.strerror or err})"
    if why:
        raise UserError(f"--resume: {path}: {why}; expected the run's settings as train.py wrote them: "
                        f"restore it, or delete it and the resume writes it anew (its resume history is "
                        f"lost)")
