"""tests/inject.py — fault injection for tests, from outside the code: no file of the project imports it.

  DATPO_OOM_AT="base,update,..."   the first call of each named site raises torch.OutOfMemoryError (the error
                                   CUDA raises), so every out-of-memory path runs on a CPU: install(spec,
                                   patch) wraps the stage functions the sites name.
  DATPO_CRASH_AT="name:n[:SIGNAL]" the n-th time the named point is reached the process signals itself
                                   (default SIGKILL: a preemption or a power loss): install_crash_points(spec,
                                   patch) wraps the functions the points name.
  DATPO_REWARD_RAISE_AT="site:n"   every n-th call of the grader at `site` (train: the rollout's, eval:
                                   evaluation's) raises AttributeError, as the grader of issue 40 did
                                   on an empty \\text{}: install_reward_raise(spec, patch). (A --reward
                                   function that raises is a reward file of the test's own.)

    python tests/inject.py evaluate.py ARGS   # the command with the three variables' faults installed

A site or a point wraps one function from outside (raise_once, crash_after), so neither the algorithm's files
nor the harness carry a test hook. `patch` is setattr, or pytest's monkeypatch.setattr so the test undoes it.
"""
from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from runtime.faults import UserError  # noqa: E402


def raise_once(owner, name: str, site: str, patch: Callable = setattr,
               when: Callable | None = None, fired: list | None = None) -> None:
    """Wrap owner.name: its first call for which when(*args, **kwargs) holds (default: any) raises
    torch.OutOfMemoryError; later calls run the real function. patch(owner, name, wrapper) installs it
    (setattr, or pytest's monkeypatch.setattr so the test undoes it). `fired`: a list shared by several
    wrappers of one site, so the site raises once whichever of them runs first."""
    import torch

    real = getattr(owner, name)
    fired = [] if fired is None else fired

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        if not fired and (when is None or when(*args, **kwargs)):
            fired.append(site)
            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by DATPO_OOM_AT at '{site}')")
        return real(*args, **kwargs)

    patch(owner, name, wrapper)


def raise_once_in_decode(site: str, patch: Callable, when: Callable) -> None:
    """The engine's decode forward, whichever step runs it: the reference step's (kv.Forward) and the CPU's
    shared step (engine/shared.Forward, its own decode), one OOM between them."""
    from engine import kv, shared

    fired: list = []
    for forward in (kv.Forward, shared.Forward):
        raise_once(forward, "decode", site, patch, when=when, fired=fired)


# site -> the installer of its wrapper: (patch) -> None. Each wraps the stage function the site names and
# imports it only when installed, so the harness loads no stage module it does not inject into.
OOM_SITES: dict[str, Callable] = {}


def site(name: str):
    """Register an installer for DATPO_OOM_AT=name."""
    def register(install_site: Callable) -> Callable:
        OOM_SITES[name] = install_site
        return install_site
    return register


@site("update")
def _update_forward(patch: Callable) -> None:
    """The update's first micro-batch forward (old log-probs' pass or the gradient pass): packing's
    micro_logprobs, which both call."""
    import packing

    raise_once(packing, "micro_logprobs", "update", patch)


@site("eval")
def eval_site(patch: Callable) -> None:
    """Evaluation's generation: the first call of evaluate.generate_rows (the rows of one generate batch)
    runs out of memory, so evaluate.sample_rows reruns those rows in smaller generate calls."""
    import evaluate

    raise_once(evaluate, "generate_rows", "eval", patch)


def _decode_with(branches: bool) -> Callable:
    """when: an engine decode step of more than one row, with (or without) branch rows in it."""
    return lambda forward, rows: len(rows) > 1 and any(r.fork is not None for r in rows) == branches


@site("base")
def _oom_at_base(patch: Callable) -> None:
    """The engine's decode forward of several base rows (its row budget halves); the generate path's base
    call of a group (the base phase's degradation is the engine's: the error goes up)."""
    from engine import generate

    raise_once_in_decode("base", patch, when=_decode_with(branches=False))
    raise_once(generate.GenerateEngine, "bases", "base", patch)


@site("branches")
def _oom_at_branches(patch: Callable) -> None:
    """The engine's decode forward of several rows some of which are branches (its row budget halves); the
    generate path's branch chunk (it is retried at half the size)."""
    from engine import generate

    raise_once_in_decode("branches", patch, when=_decode_with(branches=True))
    raise_once(generate, "branch_chunk", "branches", patch)


@site("prefill")
def _oom_at_prefill(patch: Callable) -> None:
    """The engine's prefill forward (a prompt, or a given response): the prompt waits, or is fed in halves."""
    from engine import kv

    raise_once(kv.Forward, "prefill_forward", "prefill", patch)


def install(spec: str | None = None, patch: Callable = setattr) -> list[str]:
    """Install the sites of `spec` (comma-separated; default $DATPO_OOM_AT); returns their names. An unknown
    site is one UserError line listing the known ones."""
    spec = os.environ.get("DATPO_OOM_AT", "") if spec is None else spec
    sites = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in sites if s not in OOM_SITES]
    if unknown:
        raise UserError(f"DATPO_OOM_AT={spec}: unknown site(s) {', '.join(unknown)}; expected some of "
                        f"{', '.join(OOM_SITES)}")
    for name in sites:
        OOM_SITES[name](patch)
    return sites


# --------------------------------------------------------------------------------------------------------
# Crash points: DATPO_CRASH_AT
# --------------------------------------------------------------------------------------------------------
def crash_before(owner, name: str, fire: Callable, patch: Callable = setattr) -> None:
    """owner.name calls fire() first, then runs."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        fire()
        return real(*args, **kwargs)

    patch(owner, name, wrapper)


def crash_after(owner, name: str, fire: Callable, patch: Callable = setattr) -> None:
    """owner.name runs, then calls fire()."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        fire()
        return out

    patch(owner, name, wrapper)


def _points():
    """point -> (owner, function name, before or after): where each crash point is reached."""
    import transformers

    from harness import guards, journal

    return {"step": (guards.WeightGuard, "snapshot", crash_before),          # a step starts (its snapshot)
            # the checkpoint's weights are written, its tokenizer and trainer state not yet: half written
            "checkpoint-write": (transformers.PreTrainedModel, "save_pretrained", crash_after),
            "journal-append": (journal.Journal, "append", crash_after)}     # an evaluation saved a unit


def install_crash_points(spec: str | None = None, patch: Callable = setattr) -> list[str]:
    """DATPO_CRASH_AT="name:n" (or "name:n:SIGTERM"; several comma-separated; default $DATPO_CRASH_AT): the
    n-th time point `name` is reached the process sends itself that signal (SIGKILL by default: no cleanup at
    all, as a preemption or a power loss). Returns the points installed."""
    spec = os.environ.get("DATPO_CRASH_AT", "") if spec is None else spec
    items = [item.strip().split(":") for item in spec.split(",") if item.strip()]
    points = _points()
    unknown = [parts[0] for parts in items if parts[0] not in points]
    if unknown:
        raise UserError(f"DATPO_CRASH_AT={spec}: unknown point(s) {', '.join(unknown)}; expected some of "
                        f"{', '.join(points)}")
    hits: dict[str, int] = {}

    def reached(name: str) -> None:
        hits[name] = hits.get(name, 0) + 1
        for parts in items:
            if parts[0] == name and int(parts[1]) == hits[name]:
                os.kill(os.getpid(), getattr(signal, parts[2]) if len(parts) > 2 else signal.SIGKILL)

    names = list(dict.fromkeys(parts[0] for parts in items))
    for name in names:
        owner, function, wrap = points[name]
        wrap(owner, function, functools.partial(reached, name), patch)
    return names


# --------------------------------------------------------------------------------------------------------
# A grader that raises: DATPO_REWARD_RAISE_AT
# --------------------------------------------------------------------------------------------------------
def raise_every(owner, name: str, n: int, patch: Callable = setattr) -> None:
    """Wrap owner.name: its n-th, 2n-th, ... call raises AttributeError (the grader's crash of issue 40:
    `'NoneType' object has no attribute 'replace'`); the others run the real function."""
    real = getattr(owner, name)
    calls = []

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) % n == 0:
            raise AttributeError("'NoneType' object has no attribute 'replace' (injected by "
                                 "DATPO_REWARD_RAISE_AT)")
        return real(*args, **kwargs)

    patch(owner, name, wrapper)


REWARD_SITES = {"train": ("rollout", "compute_reward"), "eval": ("evaluate", "compute_reward")}


def install_reward_raise(spec: str | None = None, patch: Callable = setattr) -> list[str]:
    """DATPO_REWARD_RAISE_AT="train:n,eval:m" (default $DATPO_REWARD_RAISE_AT): every n-th call of that
    site's grader raises (raise_every). Returns the sites installed; an unknown one is one UserError line."""
    spec = os.environ.get("DATPO_REWARD_RAISE_AT", "") if spec is None else spec
    items = [item.strip().split(":") for item in spec.split(",") if item.strip()]
    unknown = [parts[0] for parts in items if parts[0] not in REWARD_SITES or len(parts) != 2
               or not parts[1].isdigit() or int(parts[1]) < 1]
    if unknown:
        raise UserError(f"DATPO_REWARD_RAISE_AT={spec}: unknown site(s) {', '.join(unknown)}; expected "
                        f"SITE:N with SITE one of {', '.join(REWARD_SITES)} and N >= 1")
    for site_name, every in items:
        module, function = REWARD_SITES[site_name]
        raise_every(importlib.import_module(module), function, int(every), patch)
    return [parts[0] for parts in items]


if __name__ == "__main__":   # python tests/inject.py train.py|evaluate.py ARGS
    script, argv = sys.argv[1], sys.argv[2:]
    sys.argv = [script, *argv]   # the command's own name in its lines; its thread policy reads argv
    command = importlib.import_module(Path(script).stem)
    install()
    install_crash_points()
    install_reward_raise()
    from runtime import faults

    faults.main_guard(command.main, argv)
