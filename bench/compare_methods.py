"""Run each method of the paper's main table for a few steps at one scale and tabulate its cost.

    python bench/compare_methods.py --scale tiny --steps 2
    python bench/compare_methods.py --scale demo --steps 2 --presets paper grpo treerl
    python bench/compare_methods.py --scale demo --steps 6 --presets paper attnrl --off_policy both

--off_policy both runs each preset twice, on-policy (--off_policy_steps 0) and one-step off-policy
(1, offpolicy.py), same seed, and prints generation and total seconds per step on/off with their ratio, and
the decode loop's mean rows per step (occupancy: row-steps / decode steps, of --max_batch_rows) with the next
step's share of them. Runs already finished in --out_dir (all --steps in their metrics.jsonl) are read, not
redone.

Per method: generated tokens per prompt (the paper's fairness control, App. F.3), leaves per prompt,
trained blocks, and seconds per step (mean over the steps; the first step includes warm-up).
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402  (sets the thread policy before torch loads)
from harness import tracking  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="tiny", choices=["tiny", "demo", "paper"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--presets", nargs="+", default=["paper", "grpo", "drgrpo", "treerl", "attnrl"])
    parser.add_argument("--out_dir", default=None)
    parser.add_argument("--off_policy", default="preset", choices=["preset", "both"],
                        help="preset: each preset's own --off_policy_steps; both: 0 and 1, compared")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the scale's)")
    args = parser.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="compare_methods_"))
    if args.off_policy == "both":
        return compare_off_policy(args, out)
    rows = []
    for preset in args.presets:
        steps = train_run(args, preset, out / preset)
        mean = lambda key: sum(r[key] for r in steps) / len(steps)  # noqa: E731
        rows.append((preset, mean("generated_tokens_per_prompt"), mean("leaves_per_prompt"), mean("blocks"),
                     mean("reward"), mean("seconds_generation"), mean("seconds_update"),
                     mean("seconds_step")))
    print(f"scale {args.scale}, {args.steps} steps each (means over steps)")
    print(f"{'preset':10s}{'tokens/prompt':>15s}{'leaves/prompt':>15s}{'blocks':>7s}{'reward':>8s}"
          f"{'gen s':>8s}{'update s':>10s}{'s/step':>8s}")
    for name, tokens, leaves, n_rows, reward, gen, upd, total in rows:
        print(f"{name:10s}{tokens:15.1f}{leaves:15.1f}{n_rows:7.1f}{reward:8.3f}{gen:8.1f}{upd:10.1f}{total:8.1f}")


def train_run(args, preset: str, run: Path, *flags: str) -> list[dict]:
    """Train `preset` for --steps steps into `run` (no evaluation, no checkpoints); its step records."""
    train.main(["--preset", preset, "--scale", args.scale, "--steps", str(args.steps), "--eval_every", "0",
                "--save_every", "0", "--out_dir", str(run), *flags,
                *(["--threads", str(args.threads)] if args.threads else [])])
    return step_records(run)


def step_records(run: Path) -> list[dict]:
    """A run folder's step records (evaluation lines left out; tracking.read_metrics skips torn lines)."""
    return [r for r in tracking.read_metrics(run / "metrics.jsonl")[0] if "eval" not in r]


def compare_off_policy(args, out: Path) -> None:
    """Each preset on-policy and one-step off-policy, one run each, same seed: seconds per step of generation
    and in total (means over all steps: the off-policy run's first step samples two batches of bases and its
    last none, so the work over a run is the same), and the decode loop's occupancy."""
    table = []
    for preset in args.presets:
        per = {}
        for off in (0, 1):
            run = out / f"{preset}_off{off}"
            steps = step_records(run)
            if len(steps) < args.steps:   # a run finished by an earlier call into the same --out_dir is read
                steps = train_run(args, preset, run, "--off_policy_steps", str(off), "--overwrite", "true")
            mean = lambda key: sum(r.get(key, 0) for r in steps) / len(steps)  # noqa: E731
            per[off] = dict(gen=mean("seconds_generation"), total=mean("seconds_step"),
                            rows=mean("mean_batch_rows"),
                            ahead=(sum(r["ahead_row_steps"] for r in steps)
                                   / max(1, sum(r["row_steps"] for r in steps))),
                            lag=max(r["policy_lag"] for r in steps),
                            tokens=mean("generated_tokens_per_prompt"), reward=mean("reward"))
        table.append((preset, per))
    print(f"scale {args.scale}, {args.steps} steps each, one run per setting (means over steps)")
    print(f"{'preset':10s}{'off':>4s}{'gen s/step':>12s}{'total s/step':>14s}{'rows/decode':>13s}"
          f"{'next-step rows':>16s}{'lag':>5s}{'tokens/prompt':>15s}{'reward':>8s}")
    for preset, per in table:
        for off in (0, 1):
            r = per[off]
            print(f"{preset:10s}{off:4d}{r['gen']:12.2f}{r['total']:14.2f}{r['rows']:13.1f}{r['ahead']:16.1%}{r['lag']:5d}"
                  f"{r['tokens']:15.1f}{r['reward']:8.3f}")
        print(f"{preset:10s} off/on: generation {per[1]['gen'] / per[0]['gen']:.3f}×, "
              f"step {per[1]['total'] / per[0]['total']:.3f}×, rows per decode step "
              f"{per[1]['rows'] / max(per[0]['rows'], 1e-9):.2f}×")


if __name__ == "__main__":
    main()
