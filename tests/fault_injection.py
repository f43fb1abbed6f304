"""Fault injection for train.py: real processes killed at chosen moments and resumed until they finish.

    python tests/fault_injection.py                        # tiny random model (what CI runs,
                                                           # via test_faults.py)
    python tests/fault_injection.py --model smollm2-135m   # the embedded model with the real grader

Three chains of the same short run (same seed, a checkpoint every step) run side by side:
  clean    uninterrupted
  killed   SIGKILLed (DATPO_CRASH_AT, tests/inject.py) at several moments — while writing its first
           checkpoint (before any checkpoint exists), while writing a later one, at the start of a step — and
           restarted each time with the same command, which always carries `--resume RUN` as a job script does
  stopped  sent SIGTERM during a step: must finish the step, checkpoint, exit 0; then resumed
Each must end with the clean run's metrics.jsonl rows (wall-clock fields excluded) and bit-identical weights.
  poisoned the last step's update runs with lr = inf (finite loss and gradients, non-finite weights after
           the step): the weight guard must refuse it, so the run's final weights are bit for bit the clean
           run's weights before that step (its previous checkpoint), and the step is counted

The tiny random model never writes a right answer, so for it the children grade with a deterministic
stand-in (a hash of the text, as tests/test_train.py does) purely so that advantages are non-zero and the
weights move; with --model smollm2-135m the real grader runs on arithmetic.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Moments each restart of the "killed" chain dies at (None: runs to the end). Steps: 3, checkpoint every step.
KILLS = ["checkpoint-write:1",   # half-written first checkpoint: nothing to resume from, starts at 0
         "checkpoint-write:2",   # resumed at 0; dies writing step 2's checkpoint: resumes at 1
         "step:2",               # resumed at 1; does step 2, dies as step 3 starts: resumes at 2
         "checkpoint-write:1",   # resumed at 2; does step 3 and the final eval, dies writing its checkpoint
         None]
STOPS = ["step:2:SIGTERM", None]  # SIGTERM as step 2 starts: finish it, checkpoint, exit 0; then resume
POISONS = ["poison-update:3"]  # step 3's update with lr = inf: refused by the weight guard, run exits 0

TINY_ARGS = ["--preset", "tiny", "--steps", "3", "--save_every", "1", "--eval_every", "2",
             "--eval_limit", "2", "--threads", "1", "--seed", "3"]
SMOLLM_ARGS = ["--preset", "tiny", "--model", "smollm2-135m", "--steps", "3", "--save_every", "1",
               "--n_base", "4", "--k_max", "1", "--b_max", "2", "--max_new_tokens", "16",
               "--prompts_per_step", "2", "--few_shot", "true", "--answer_fallback", "true", "--lr", "1e-5",
               "--eval_every", "2", "--eval_limit", "1", "--eval_k", "2", "--eval_max_new_tokens", "8",
               "--threads", "1", "--mini_batch_size", "16", "--micro_batch_size", "8"]


def stand_in_reward(text, answer, fallback=False):
    """Half of all texts score 1, by a hash of the text (the tiny random model's text is noise)."""
    return float(hashlib.sha256(text.encode()).digest()[0] % 2)


def folder_hash(path) -> dict | None:
    """{relative path: SHA-256} of every file under `path` (a file: {".": its hash}; missing: None), to
    show that a refused command left a folder byte-identical."""
    path = Path(path)
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {("." if p == path else str(p.relative_to(path))): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files}


def run_cli(capsys, argv, code=None, one_error_line=False) -> list[str]:
    """train.main as a command (faults.main_guard, as `python train.py` runs it); stderr's lines, never a
    traceback. `code`: the exit code expected (None: the command returns); with `one_error_line`, that
    code's line must be the only error line and the last."""
    import pytest

    import train
    from runtime import faults

    if code is None:
        faults.main_guard(train.main, argv)
    else:
        with pytest.raises(SystemExit) as exit_info:
            faults.main_guard(train.main, argv)
        assert exit_info.value.code == code, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]
    if code is not None and one_error_line:
        assert sum("error:" in x for x in lines) == 1 and "error:" in lines[-1], lines
    return lines


def refused_as(capsys, main, argv, program: str, code: int = 2) -> str:
    """`main` run as the command `program` (faults.main_guard): exit `code`, one error line and no traceback;
    that line."""
    import pytest

    from runtime import faults

    capsys.readouterr()
    saved, sys.argv[0] = sys.argv[0], program
    try:
        with pytest.raises(SystemExit) as exit_info:
            faults.main_guard(main, argv)
    finally:
        sys.argv[0] = saved
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert exit_info.value.code == code, err
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def finished_run(run_dir: Path, argv: list[str]) -> Path:
    """A tiny run trained to its end in this process with the stand-in grader (tests share one, copied)."""
    import pytest

    import rollout
    import train

    patch = pytest.MonkeyPatch()
    patch.setattr(rollout, "compute_reward", stand_in_reward)
    try:
        train.main(argv + ["--out_dir", str(run_dir)])
    finally:
        patch.undo()
    return run_dir


def child(argv: list[str]) -> None:
    """The process that is killed: train.py's command line, optionally with the stand-in grader."""
    sys.path.insert(0, str(ROOT))
    import inject

    import rollout
    import train
    from runtime import faults

    inject.install_crash_points()   # DATPO_CRASH_AT: this process is killed at the points it names

    if argv and argv[0] == "--stand-in-reward":
        rollout.compute_reward = stand_in_reward
        argv = argv[1:]
    if argv and argv[0] == "--poison-update":   # the n-th update runs with lr = inf (the weight guard's case)
        poison_at, real = int(argv[1]), train.ppo_update
        argv = argv[2:]

        def poisoned(model, optimizer, *args, **kwargs):
            poisoned.calls += 1
            if poisoned.calls != poison_at:
                return real(model, optimizer, *args, **kwargs)
            lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = float("inf")
            try:
                return real(model, optimizer, *args, **kwargs)
            finally:
                for group, lr in zip(optimizer.param_groups, lrs):
                    group["lr"] = lr

        poisoned.calls = 0
        train.ppo_update = poisoned
    faults.main_guard(train.main, argv)


def run_once(args: list[str], crash: str | None, stand_in: bool,
             timeout: float = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DATPO_CRASH_AT"}
    poison = []
    if crash and crash.startswith("poison-update:"):
        poison, crash = ["--poison-update", crash.split(":")[1]], None
    if crash:
        env["DATPO_CRASH_AT"] = crash
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"] \
        + (["--stand-in-reward"] if stand_in else []) + poison
    return subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_chain(args: list[str], run_dir: Path, crashes: list, stand_in: bool) -> list[dict]:
    """The same command (with --out_dir RUN --resume RUN) restarted after each fault; one dict per process."""
    history = []
    for crash in crashes:
        t0 = time.perf_counter()
        proc = run_once(args + ["--out_dir", str(run_dir), "--resume", str(run_dir)], crash, stand_in)
        metrics = run_dir / "metrics.jsonl"
        logged = ([json.loads(line)["step"] for line in metrics.read_text().splitlines()]
                  if metrics.exists() else [0])
        history.append({"crash": crash, "returncode": proc.returncode, "seconds": time.perf_counter() - t0,
                        "resumed_at": _resumed_at(proc.stderr), "logged_to": max(logged, default=0),
                        "stderr": proc.stderr[-3000:]})
    return history


def metric_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl without wall-clock fields."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]


def final_weights(run_dir: Path, step: int | None = None) -> dict:
    """The weights of a run's latest checkpoint (or of its checkpoint at `step`)."""
    from safetensors.torch import load_file

    import models

    folder = Path(models.resolve_checkpoint(str(run_dir))) if step is None else \
        Path(run_dir) / "checkpoints" / f"step_{step:06d}"
    return load_file(str(folder / "model.safetensors"))


def _same(wa: dict, wb: dict) -> bool:
    import torch

    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def identical_weights(a: Path, b: Path) -> bool:
    return _same(final_weights(a), final_weights(b))


def scenario(out: Path, args: list[str], stand_in: bool) -> dict:
    """Run the three chains side by side; return what the README reports."""
    sys.path.insert(0, str(ROOT))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        clean = pool.submit(run_chain, args, out / "clean", [None], stand_in)
        killed = pool.submit(run_chain, args, out / "killed", KILLS, stand_in)
        stopped = pool.submit(run_chain, args, out / "stopped", STOPS, stand_in)
        poisoned = pool.submit(run_chain, args, out / "poisoned", POISONS, stand_in)
        chains = {"clean": clean.result(), "killed": killed.result(), "stopped": stopped.result(),
                  "poisoned": poisoned.result()}
    report = {"seconds": time.perf_counter() - t0, "chains": chains}
    reference = metric_rows(out / "clean")
    for name in ("killed", "stopped"):
        report[name] = {
            "returncodes": [h["returncode"] for h in chains[name]],
            "same_metrics": metric_rows(out / name) == reference,
            "identical_weights": identical_weights(out / "clean", out / name),
            "resumed_at": [h["resumed_at"] for h in chains[name]],
            "steps_computed": sum(h["logged_to"] - (h["resumed_at"] or 0) for h in chains[name]),
            "kills_survived": sum(h["crash"] is not None for h in chains[name]),
        }
    steps = len(reference) and max(r["step"] for r in reference if "eval" not in r)
    rows = [r for r in metric_rows(out / "poisoned") if "eval" not in r]
    report["poisoned"] = {
        "returncodes": [h["returncode"] for h in chains["poisoned"]],
        "nonfinite_updates": [r["nonfinite_updates"] for r in rows],
        # the refused last update leaves the weights exactly as the clean run had them before that step
        "weights_equal_before_refused_update": _same(final_weights(out / "poisoned"),
                                                     final_weights(out / "clean", steps - 1)),
        "earlier_steps_same": [r for r in rows if r["step"] < steps] ==
                              [r for r in reference if "eval" not in r and r["step"] < steps],
    }
    return report


def _resumed_at(stderr: str) -> int | None:
    for line in stderr.splitlines():
        if line.startswith("resumed from"):
            return int(line.rsplit(" ", 1)[1])
        if "no checkpoint there yet" in line:
            return 0
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-random", choices=["tiny-random", "smollm2-135m"])
    parser.add_argument("--out", default="runs/fault_injection")
    args = parser.parse_args()
    out = Path(args.out) / args.model
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    report = scenario(out, TINY_ARGS if args.model == "tiny-random" else SMOLLM_ARGS,
                      stand_in=args.model == "tiny-random")
    for name in ("killed", "stopped", "poisoned"):
        print(name, json.dumps(report[name]))
    for name, history in report["chains"].items():
        print(name, [(h["crash"], h["returncode"], round(h["seconds"], 1)) for h in history])
    print(f"wall {report['seconds']:.0f}s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2:])
    else:
        main()
