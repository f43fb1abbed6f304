"""Run each method of the paper's main table for a few steps at one scale and tabulate its cost.

    python bench/compare_methods.py --scale tiny --steps 2
    python bench/compare_methods.py --scale demo --steps 2 --presets paper grpo treerl

Per method: generated tokens per prompt (the paper's fairness control, App. E.3), leaves per prompt,
trained blocks, and seconds per step (mean over the steps; the first step includes warm-up).
"""
import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="tiny", choices=["tiny", "demo", "paper"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--presets", nargs="+", default=["paper", "grpo", "drgrpo", "treerl", "attnrl"])
    parser.add_argument("--out_dir", default=None)
    args = parser.parse_args()
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="compare_methods_"))
    rows = []
    for preset in args.presets:
        run = train.main(["--preset", preset, "--scale", args.scale, "--steps", str(args.steps), "--eval_every", "0",
                          "--save_every", "0", "--out_dir", str(out / preset)])
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in steps if "eval" not in r]
        mean = lambda key: sum(r[key] for r in steps) / len(steps)  # noqa: E731
        rows.append((preset, mean("generated_tokens_per_prompt"), mean("leaves_per_prompt"), mean("blocks"),
                     mean("reward"), mean("seconds_generation"), mean("seconds_update"), mean("seconds_step")))
    print(f"scale {args.scale}, {args.steps} steps each (means over steps)")
    print(f"{'preset':10s}{'tokens/prompt':>15s}{'leaves/prompt':>15s}{'blocks':>7s}{'reward':>8s}"
          f"{'gen s':>8s}{'update s':>10s}{'s/step':>8s}")
    for name, tokens, leaves, n_rows, reward, gen, upd, total in rows:
        print(f"{name:10s}{tokens:15.1f}{leaves:15.1f}{n_rows:7.1f}{reward:8.3f}{gen:8.1f}{upd:10.1f}{total:8.1f}")


if __name__ == "__main__":
    main()
