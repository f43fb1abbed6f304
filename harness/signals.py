"""harness/signals.py — SIGTERM/SIGINT: stop at the next safe point with a checkpoint, never mid-write."""
from __future__ import annotations

import _thread
import signal
import threading

from runtime.faults import StopTimeout, say


class QuitNow(KeyboardInterrupt):
    """A second stop signal: quit at once (exit 130). A KeyboardInterrupt of its own kind, so that code which
    turns a KeyboardInterrupt raised by user code into a line (harness/custom_reward.py) lets this one go."""


class GracefulStop:
    """SIGTERM / SIGINT handling for a loop with safe points.

    The first signal only sets `requested` (the loop checks it at its next safe point, writes a checkpoint
    and exits 0); a second one raises KeyboardInterrupt at once (main_guard exits with 130). With
    `timeout` > 0 (--stop_timeout) a safe point not reached within that many seconds of the first signal
    raises StopTimeout (exit 130; the step in progress is lost, the last checkpoint is where --resume
    continues), so a stop is honoured in bounded time even inside a step that never ends. Handlers are
    restored on exit. Outside the main thread (where signals cannot be caught) it does nothing.

    The deadline is kept by a watchdog thread, not by SIGALRM: the grader bounds each answer check with its
    own SIGALRM (reward.py) and restores the alarm it found when the check ends, so an alarm of ours armed
    while a check ran would be disarmed (and its StopTimeout swallowed by the check's `except Exception`).
    At the deadline the watchdog makes the main thread run the stop handler (_thread.interrupt_main, which
    does nothing once the handlers are restored), and again every RETRY seconds until the stop is over, so a
    StopTimeout that lands inside some library's `except Exception` is raised again a moment later. The call
    is a real signal sent to the main thread (signal.pthread_kill), not only a flag (interrupt_main): a main
    thread blocked in C — a sleep, a socket read, a wait for a subprocess — is woken (EINTR) and the handler's
    StopTimeout ends that call, within --stop_timeout (plus RETRY) of the first signal. __exit__ sets the
    stop over and waits for the watchdog before it restores the handlers, so no signal of the watchdog
    arrives after them."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    RETRY = 0.1

    def __init__(self, what: str = "after this step, with a checkpoint", timeout: float = 0):
        self.what = what
        self.timeout = timeout
        self.requested: str | None = None
        self._previous: dict = {}
        self._over = threading.Event()        # the safe point came (cancel_timeout) or the stop is over
        self._lock = threading.RLock()
        self._calls = 0                       # handler calls the watchdog asked for and not yet run
        self._watchdog: threading.Thread | None = None

    def _handle(self, signum, frame):
        with self._lock:   # re-entrant: this runs on the main thread, maybe inside cancel_timeout
            watchdog, self._calls = self._calls > 0, max(self._calls - 1, 0)
            over = self._over.is_set()
        if watchdog and over:   # a late call of a watchdog that the safe point beat: not a second signal
            return
        if watchdog:
            raise StopTimeout(f"stopped mid-step by {self.requested}: no safe point within --stop_timeout "
                              f"{self.timeout:g}s; the step in progress is lost, --resume continues from the "
                              f"last checkpoint")
        name = signal.Signals(signum).name
        if self.requested:
            raise QuitNow
        self.requested = name
        later = f", or in {self.timeout:g}s mid-step (--stop_timeout)" if self.timeout > 0 else ""
        say(f"{name} received: stopping {self.what}{later}; send it again to quit at once")
        if self.timeout > 0 and self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, args=(signum,), daemon=True,
                                              name="stop-timeout")
            self._watchdog.start()

    def _watch(self, signum: int) -> None:
        """At the deadline, and every RETRY seconds after it until the stop is over: the handler runs on the
        main thread and raises StopTimeout."""
        if self._over.wait(self.timeout):
            return
        while True:
            with self._lock:
                if self._over.is_set():
                    return
                self._calls += 1
                wake_main(signum)   # the handler is installed: __exit__ sets _over under this lock first
            if self._over.wait(self.RETRY):
                return

    def cancel_timeout(self) -> None:
        """The safe point was reached: the --stop_timeout deadline no longer applies (a checkpoint is
        written)."""
        with self._lock:
            self._over.set()

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._over.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join()   # after this, nothing of the watchdog is on its way to the main thread
        with self._lock:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()


def wake_main(signum: int) -> None:
    """Run the handler of `signum` on the main thread: a real signal to that thread (which interrupts a
    blocking system call there), else (no pthread_kill: Windows) the flag interrupt_main sets, which the main
    thread sees at its next Python instruction."""
    if hasattr(signal, "pthread_kill"):
        signal.pthread_kill(threading.main_thread().ident, signum)
    else:
        _thread.interrupt_main(signum)
