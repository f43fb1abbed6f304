"""harness/signals.py — SIGTERM/SIGINT: stop at the next safe point with a checkpoint, never mid-write."""
from __future__ import annotations

import signal

from harness.faults import StopTimeout, say


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
                          f"{self.timeout:g}s; the step in progress is lost, --resume continues from the "
                          f"last checkpoint")

    def cancel_timeout(self) -> None:
        """The safe point was reached: the --stop_timeout alarm no longer applies
        (a checkpoint is written)."""
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
