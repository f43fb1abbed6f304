"""harness/journal.py — an append-only record of finished work units, so a killed job resumes exactly."""
from __future__ import annotations

import os
from pathlib import Path

from harness import runs
from runtime import atomic, faults
from runtime.faults import UserError, WriteError, say


class Stopped(Exception):
    """Raised at a safe point after a GracefulStop signal, by loops that save as they go (evaluation)."""


class Journal:
    """An append-only jsonl of finished work units, so a rerun (after a kill or a SIGTERM) skips what is done
    and ends with exactly the records and numbers of an uninterrupted run.

    After each unit its records are appended (flushed, fsynced), then a small state file beside it is
    replaced atomically: {settings, units done, records written, torch RNG state}. `resume()` keeps the
    records the state file vouches for (a line torn by a kill, or a unit appended without its state, is
    dropped and redone), restores the torch RNG state so the next unit samples what it would have, and
    returns them. A journal written with other settings is started over. A journal's state is written when
    it starts (nothing done yet), so saved records without one were not written by a journal (torchrun
    writes its samples whole at the end) and are never resumed; records dropped for any reason are said in
    one line, never silently.

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

        if not self.state_path.exists():   # every journal has one from its start: these are not vouched for
            return self._start_over("no state file vouches for them")
        if not self.path.exists():
            return self._start_over()
        try:
            state = runs.load_plain(self.state_path)
        except runs.UnsafeFile as err:
            raise UserError(f"{runs.unsafe_line(self.state_path, err)}; expected the state evaluate.py "
                            f"writes beside {self.path.name}: delete both to start this evaluation over, or "
                            f"use another --out_dir") from None
        except Exception:  # a state file is replaced atomically; an unreadable one is not ours
            return self._start_over(f"its state file {self.state_path.name} is unreadable")
        if not _state_shape_ok(state):   # plain values of another shape: not ours either
            return self._start_over(f"its state file {self.state_path.name} is not evaluate.py's")
        if state.get("settings") != self.settings:
            return self._start_over("they were made with other settings")
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()[:state["n_records"]]
        if len(lines) < state["n_records"]:
            return self._start_over(f"fewer than the {state['n_records']} its state vouches for")
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
        atomic.write_text(self.path, "".join(line + "\n" for line in lines), encoding="utf-8")

    def _start_over(self, why: str | None = None) -> list[dict]:
        """An empty journal and its first state (nothing done, the RNG as found). Saved records dropped on
        the way are said in one line naming why (never silently): they are sampled again."""
        held = count_records(self.path)
        if held and why:
            say(f"{self.path}: its {held} saved record(s) are not reused ({why}); sampled again")
        self.units = self.n_records = 0
        try:
            self._rewrite([])
            self._write_state(0, 0)
        except Exception as err:
            self._write_failed(err)
        return []

    def _write_state(self, units: int, n_records: int) -> None:
        """The state that vouches for the first n_records records (`units` done): replaced atomically (a
        temporary file made exclusively, runtime/atomic.py)."""
        import torch

        state = {"settings": self.settings, "units": units, "n_records": n_records,
                 "rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        tmp = atomic.exclusive_temp(self.state_path)
        try:
            torch.save(state, tmp)
            os.replace(tmp, self.state_path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def append(self, records: list[dict]) -> None:
        """One finished unit: its records, then the state that vouches for them."""
        import json

        units, n_records = self.units + 1, self.n_records + len(records)
        try:
            with open(self.path, "a", encoding="utf-8", opener=atomic.no_follow) as f:   # not through a link
                f.write("".join(json.dumps({**self.extra, **r}, ensure_ascii=False) + "\n" for r in records))
                f.flush()
                os.fsync(f.fileno())
            self._write_state(units, n_records)
        except Exception as err:
            self._write_failed(err)
        self.units, self.n_records = units, n_records


    def _write_failed(self, err: Exception):
        """A full disk (or another write error) while writing the journal: a WriteError line, exit 4; the
        records the state vouches for are kept. Any other error goes on as it is."""
        cause = faults.write_failure(err)
        if cause is None:
            raise err
        raise WriteError(f"writing {self.path}: {cause}; its first {self.n_records} records are kept (a "
                         f"rerun of the same command continues from them); free space and rerun it") from err


def count_records(path: Path) -> int:
    """The non-blank lines of a jsonl file (0 when it is missing or unreadable)."""
    try:
        with open(path, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _state_shape_ok(state) -> bool:
    """What Journal.append writes: {settings: dict, units: int, n_records: int, rng: a tensor[, cuda]}."""
    import torch

    return (isinstance(state, dict) and isinstance(state.get("settings"), dict)
            and all(isinstance(state.get(k), int) and not isinstance(state.get(k), bool) and state[k] >= 0
                    for k in ("units", "n_records"))
            and isinstance(state.get("rng"), torch.Tensor) and state["rng"].dtype == torch.uint8)
