"""harness/oom.py — out of device memory: recognise it, and redo the work in smaller pieces.

  is_oom          torch's OutOfMemoryError, or a cuBLAS/cuDNN allocation failure (the same condition).
  halving_retry   run(size); on out-of-memory halve `size` and run again, down to 1.
  halving_chunks  run over jobs in chunks; a chunk that runs out of memory is retried at half the size.
"""
from __future__ import annotations

from harness.faults import say


def is_oom(err: BaseException) -> bool:
    """Out of device memory: torch's OutOfMemoryError, or an allocation failure that reaches Python as a plain
    RuntimeError — cuBLAS/cuDNN failing to allocate their workspace (CUBLAS_STATUS_ALLOC_FAILED) is the same
    condition seen from a library."""
    import torch

    text = str(err)
    return (isinstance(err, torch.OutOfMemoryError) or "out of memory" in text.lower()
            or "CUBLAS_STATUS_ALLOC_FAILED" in text or "CUDNN_STATUS_ALLOC_FAILED" in text)


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
