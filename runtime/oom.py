"""runtime/oom.py — out of device memory: recognise it, and redo the work in smaller pieces.

  is_oom          torch's OutOfMemoryError, or a cuBLAS/cuDNN allocation failure (the same condition).
  Halving         a retry loop the caller writes itself: `for attempt in Halving(size, ...): with attempt:`
                  runs the block at attempt.size, and again at half the size after running out of memory.
  halving_retry   run(size); on out-of-memory halve `size` and run again, down to 1.
  halving_chunks  run over jobs in chunks; a chunk that runs out of memory is retried at half the size.
"""
from __future__ import annotations

from runtime.faults import say


def is_oom(err: BaseException) -> bool:
    """Out of device memory: torch's OutOfMemoryError, or an allocation failure that reaches Python as a plain
    RuntimeError — cuBLAS/cuDNN failing to allocate their workspace (CUBLAS_STATUS_ALLOC_FAILED) is the same
    condition seen from a library."""
    import torch

    text = str(err)
    return (isinstance(err, torch.OutOfMemoryError) or "out of memory" in text.lower()
            or "CUBLAS_STATUS_ALLOC_FAILED" in text or "CUDNN_STATUS_ALLOC_FAILED" in text)


class Halving:
    """The same work again at half the size after running out of memory, down to 1 — as a loop in the
    caller's own code (the update's mini-batch, the old log-probs' pass), with no closure:

        for attempt in oom.Halving(budget, "the update's micro-batches", counters):
            with attempt:        # out of memory in here: the block runs again at attempt.size // 2
                ...work at attempt.size...

    Each retry is said in one line and counted in counters["oom_retries"]; out of memory at size 1, or with
    retry=False (torchrun: every rank must run the same collectives), is raised. Before a retry, reset() drops
    the failed attempt's partial work (e.g. optimizer.zero_grad) and CUDA's cache is emptied — outside the
    `except`, once the failed attempt's tensors are released."""

    def __init__(self, size: int, what: str, counters: dict | None = None, reset=None, retry: bool = True):
        self.size, self.what, self.counters, self.reset, self.retry = size, what, counters, reset, retry
        self.state = "first"    # first | failed | done

    def __iter__(self):
        import torch

        while self.state != "done":
            if self.state == "failed":
                if self.reset is not None:
                    self.reset()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                new = max(1, self.size // 2)
                if self.counters is not None:
                    self.counters["oom_retries"] = self.counters.get("oom_retries", 0) + 1
                say(f"out of memory in {self.what} at {self.size}: retrying at {new}")
                self.size = new
            yield self

    def __enter__(self) -> "Halving":
        return self

    def __exit__(self, kind, err, trace) -> bool:
        if err is None:
            self.state = "done"
            return False
        if isinstance(err, RuntimeError) and is_oom(err) and self.size > 1 and self.retry:
            self.state = "failed"    # swallowed: the loop runs the block again, smaller
            return True
        return False


def halving_retry(run, size: int, what: str, counters: dict | None = None, reset=None, retry: bool = True):
    """run(size) → its result, through Halving: on out-of-memory reset(), halve `size` and run it again, down
    to 1 (evaluation's generation batch)."""
    for attempt in Halving(size, what, counters, reset, retry):
        with attempt:
            return run(attempt.size)


def halving_chunks(jobs: list, chunk_size: int, run, what: str = "chunk",
                   counters: dict | None = None) -> list:
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
