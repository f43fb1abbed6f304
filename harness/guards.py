"""harness/guards.py — the update's guards against non-finite numbers: no broken step is ever applied.

  WeightGuard      an update that makes a weight (or the next forward's logits) non-finite is undone bit for
                   bit; all_finite / logits_finite are its cheap checks. (A mini-batch whose loss or gradient
                   norm is NaN/inf is never applied: train.ppo_update skips it, one line.)
  sampling_stop    "probability tensor contains inf/nan" while sampling becomes a NonFiniteStop line
                   (loop.Run; sampling_guard around a block).
"""
from __future__ import annotations

import contextlib

from runtime import distributed as D
from runtime.faults import NonFiniteStop


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
    """Protects the weights, not only the loss (ppo_update skips a non-finite loss or gradient): an
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
    optimizer step is one sum per parameter and one sync (all_finite: 0.025 s for the 135M model). Under
    FSDP each rank snapshots and checks its own shards (callers combine the verdict over ranks).
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

    def undo_if_broken(self, update: dict, policy, probe_ids) -> None:
        """The verdict after an update (snapshot() was taken before it): one that made a weight non-finite
        (ppo_update stopped at it: update["nonfinite_updates"]) or the policy's logits on a prompt of the step
        non-finite is undone bit for bit and counted in update["nonfinite_updates"] (a bad step for the
        loop's --max_bad_steps). Under torchrun every rank takes the same verdict."""
        if self.enabled and (update["nonfinite_updates"] or D.any_rank(not logits_finite(policy, probe_ids))):
            self.restore()
            update["nonfinite_updates"] = 1


def logits_finite(model, input_ids) -> bool:
    """One forward of a short sequence (a prompt of this step): are the policy's logits finite? Catches
    weights that are finite but so large that sampling would meet inf/NaN probabilities (cost: one forward
    of a few dozen tokens per step)."""
    import torch

    with torch.no_grad():
        ids = torch.as_tensor([list(input_ids)[-64:]], device=next(model.parameters()).device)
        return bool(torch.isfinite(model(input_ids=ids).logits.float()).all())


def sampling_stop(err: RuntimeError, step: int, run_dir) -> NonFiniteStop | None:
    """Sampling that met non-finite probabilities (torch.multinomial: "probability tensor contains either
    inf, nan or element < 0") — weights the finiteness checks let through, e.g. logits that overflow only on
    some prompts — as a NonFiniteStop line naming the run's last checkpoint, not a traceback (loop.Run raises
    it); None for any other error."""
    if "probability tensor contains" not in str(err):
        return None
    import models

    last = models.resolve_checkpoint(str(run_dir))
    return NonFiniteStop(f"step {step}: sampling met non-finite probabilities (the policy's logits); the "
                         f"latest checkpoint {last if last != str(run_dir) else '(none)'} holds the "
                         f"weights that produced them; expected a resume from an earlier checkpoint with "
                         f"a lower --lr")


@contextlib.contextmanager
def sampling_guard(step: int, run_dir):
    """sampling_stop around a block."""
    try:
        yield
    except RuntimeError as err:
        stop = sampling_stop(err, step, run_dir)
        if stop is None:
            raise
        raise stop from err
