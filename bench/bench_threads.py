"""bench/bench_threads.py — CPU threads under load (issue 30): the demo's first evaluation (a slice of it) and
one demo training step, alone and beside two busy processes, under torch's default threads and under the
thread policy of runtime/threads.py (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT=1000, threads from the usable
cores). One run, one table of seconds and of loaded / alone ratios.

    python bench/bench_threads.py              # 16 eval problems × 4 samples, one demo step of 8 prompts
    python bench/bench_threads.py --quick      # 4 problems, a step of 2 prompts: a rough answer in minutes
    python bench/bench_threads.py --load matmul   # the busy neighbours are 1-thread torch matmul loops

Why: OpenMP's spinning threads starve each other when the CPU is shared (runtime/threads.py). Target: beside
two busy processes, at most 4× the time alone (three busy processes on two cores: a fair share is 3×).
Each measurement runs in a fresh process, since OpenMP reads its wait policy when torch loads. The machine
should be otherwise quiet: the load average before each measurement is printed with it.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BUSY = {   # the neighbours: a pure-Python spin, or a 1-thread torch matmul loop (an OpenMP-free CPU hog each)
    "spin": "while True: pass",
    "matmul": "import torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\nwhile True: a @ a",
}


# --------------------------------------------------------------------------------------------------------
# One measurement (a fresh process): set the policy or not, then import torch, then time the two workloads
# --------------------------------------------------------------------------------------------------------
def measure(threads: str, eval_problems: int, prompts: int) -> dict:
    """Seconds of the demo's evaluation on `eval_problems` problems and of one demo training step of
    `prompts` prompts, in this process, after applying the thread policy when `threads` is "policy"."""
    if threads == "policy":
        from runtime import threads as policy

        os.environ.update(policy.policy_env([], os.environ))

    import torch

    import config as C
    import evaluate
    import optim
    import train
    from harness import loop

    with tempfile.TemporaryDirectory() as out:
        cfg = C.make_config("demo", threads=0, eval_every=1, eval_limit=eval_problems,
                            prompts_per_step=prompts, steps=1, save_every=0, out_dir=str(Path(out) / "run"))
        # train.train's set-up, then one evaluation and one step
        with loop.Run(cfg, evaluate.evaluate_problems) as run:
            model, tokenizer = run.load_policy()
            learner = train.Learner(cfg, model, tokenizer, optim.build_optimizer(model.parameters(), cfg),
                                    run.load_embedder())
            stream = run.prompt_stream(learner)
            run.start(learner)
            t0 = time.perf_counter()
            evaluate.evaluate_problems(model, tokenizer, run.eval_problems, cfg, k=cfg.eval_k,
                                       max_new_tokens=cfg.eval_max_new_tokens, progress=False)
            t_eval = time.perf_counter() - t0
            t0 = time.perf_counter()
            train.train_step(learner, stream.next_batch(0), 0, run.rng)
            t_step = time.perf_counter() - t0
            run.log.close()
    return {"eval_s": t_eval, "step_s": t_step, "torch_threads": torch.get_num_threads(),
            "wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (libgomp spins a while, then sleeps)"),
            "spin_count": os.environ.get("GOMP_SPINCOUNT", "unset")}


# --------------------------------------------------------------------------------------------------------
# The driver: every (threads, load) pair in its own process, busy neighbours started and stopped around it
# --------------------------------------------------------------------------------------------------------
def run_child(threads: str, args, timeout: float) -> dict | None:
    openmp = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")   # the caller's settings, left out
    env = {k: v for k, v in os.environ.items() if k not in openmp}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", threads, "--eval_problems",
           str(args.eval_problems), "--prompts", str(args.prompts)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode != 0:
        raise SystemExit(f"measurement {threads} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_pair(threads: str, loaded: bool, args) -> dict | None:
    """One measurement, beside two busy processes when `loaded` (started here, stopped here)."""
    busy = [subprocess.Popen([sys.executable, "-c", BUSY[args.load]], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL) for _ in range(2 if loaded else 0)]
    try:
        load = os.getloadavg()[0]
        result = run_child(threads, args, args.timeout)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
    label = f"{threads:7s} {'loaded' if loaded else 'alone':6s}"
    said = (f"eval {result['eval_s']:6.1f} s, step {result['step_s']:6.1f} s "
            f"({result['torch_threads']} threads)" if result else f"timed out after {args.timeout:.0f} s")
    print(f"  {label} load {load:4.1f}: {said}", flush=True)
    time.sleep(2)   # let the neighbours' exit settle before the next measurement
    return result


def seconds(result: dict | None, key: str, timeout: float) -> str:
    return f"{result[key]:8.1f}" if result else f"> {timeout:6.0f}"


def ratio(alone: dict | None, loaded: dict | None, key: str, timeout: float) -> str:
    if not alone:
        return "     n/a"
    if not loaded:
        return f"> {timeout / alone[key]:5.1f}×"
    return f"{loaded[key] / alone[key]:7.1f}×"


def print_table(results: dict, args) -> None:
    print(f"\nCPU threads under load: eval = {args.eval_problems} demo problems × 4 samples, step = one demo "
          f"step of {args.prompts} prompts; busy neighbours: 2 × {args.load}; {os.cpu_count()} CPUs")
    print(f"{'workload':8s} {'threads':8s} {'alone s':>9s} {'loaded s':>9s} {'loaded/alone':>13s}")
    for key, name in (("eval_s", "eval"), ("step_s", "step")):
        for threads in ("default", "policy"):
            alone, loaded = results[threads, False], results[threads, True]
            print(f"{name:8s} {threads:8s} {seconds(alone, key, args.timeout):>9s} "
                  f"{seconds(loaded, key, args.timeout):>9s} {ratio(alone, loaded, key, args.timeout):>13s}")
    print("target: loaded/alone ≤ 4× (a fair share of 2 cores among 3 busy processes is 3×)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 eval problems, a step of 2 prompts")
    ap.add_argument("--eval_problems", type=int, default=None,
                    help="demo eval problems (default 16; quick 4)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts in the demo step (default 8; quick 2)")
    ap.add_argument("--load", choices=sorted(BUSY), default="spin", help="what the two busy neighbours run")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per measurement (default 1800; "
                    "quick 600): a collapse is reported as '> timeout'")
    ap.add_argument("--child", choices=("default", "policy"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.eval_problems = args.eval_problems or (4 if args.quick else 16)
    args.prompts = args.prompts or (2 if args.quick else 8)
    args.timeout = args.timeout or (600.0 if args.quick else 1800.0)
    if args.child:
        print(json.dumps(measure(args.child, args.eval_problems, args.prompts)))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))   # a stopped bench still stops its neighbours
    results = {}
    for threads in ("default", "policy"):
        for loaded in (False, True):
            results[threads, loaded] = measure_pair(threads, loaded, args)
    print_table(results, args)


if __name__ == "__main__":
    main()
