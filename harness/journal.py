"""harness/journal.py — an append-only record of finished work units, so a killed job resumes exactly."""
from __future__ import annotations

import os
from pathlib import Path

from harness import runs
from harness.faults import UserError, WriteError, say
from harness.inject import crash_point


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

    The state file is read with torch's weights_only loader (runs.load_plain): one holding a Python object
    (evaluate.py never writes one: someone put it there) is refused in one line, nothing in it run and
    nothing of the folder changed; one unreadable or of another shape is started over like a torn one. A
    full disk while appending is a WriteError line (exit 4): the records the state vouches for are kept.
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
            state = runs.load_plain(self.state_path)
        except runs.UnsafeFile as err:
            raise UserError(f"{runs.unsafe_line(self.state_path, err)}; expected the state evaluate.py "
                            f"writes beside {self.path.name}: delete both to start this evaluation over, or "
                            f"use another --out_dir") from None
        except Exception:  # a state file is replaced atomically; an unreadable one is not ours
            return self._start_over()
        if not _state_shape_ok(state):   # plain values of another shape: not ours either
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
                say(f"{self.path} line {n}: corrupted (not JSON); its samples are not reused, "
                    f"starting it over")
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

        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write("".join(json.dumps({**self.extra, **r}, ensure_ascii=False) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
            state = {"settings": self.settings, "units": self.units + 1,
                     "n_records": self.n_records + len(records), "rng": torch.get_rng_state()}
            if torch.cuda.is_available():
                state["cuda"] = torch.cuda.get_rng_state_all()
            torch.save(state, tmp)
            os.replace(tmp, self.state_path)
        except Exception as err:
            tmp.unlink(missing_ok=True)
            cause = runs.write_failure(err)
            if cause is None:
                raise
            raise WriteError(f"writing {self.path}: {cause}; its first {self.n_records} records are kept "
                             f"(a rerun of the same command continues from them); free space and rerun "
                             f"it") from err
        self.units += 1
        self.n_records += len(records)
        crash_point("journal-append")


def _state_shape_ok(state) -> bool:
    """What Journal.append writes: {settings: dict, units: int, n_records: int, rng: a tensor[, cuda]}."""
    import torch

    return (isinstance(state, dict) and isinstance(state.get("settings"), dict)
            and all(isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and state[k] >= 0
                    for k in ("units", "n_records"))
            and isinstance(state.get("rng"), torch.Tensor) and state["rng"].dtype == torch.uint8)
