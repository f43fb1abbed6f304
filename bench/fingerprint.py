"""bench/fingerprint.py — does a change keep behaviour? Short runs of every method, fingerprinted.

    python bench/fingerprint.py --out /tmp/after.json                    # this checkout
    python bench/fingerprint.py --repo ../old --out /tmp/before.json     # another checkout of the project
    python bench/fingerprint.py --compare /tmp/before.json /tmp/after.json

Each case is a real `train.py` run in a child process (3 steps of the tiny random model per method and
option, the demo's first step on the embedded model). Its fingerprint: metrics.jsonl without wall-clock
fields (`seconds*`), the SHA-256 of the final weights (model.safetensors) and of every tree log. Two
checkouts that behave the same give equal fingerprints; --compare names each field that differs.

The tiny random model never writes a right answer, so its runs grade with a deterministic stand-in (a hash
of the text, as tests/fault_injection.py does) so that advantages are non-zero and the weights move; the
demo case grades for real.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["--steps", "3", "--threads", "1", "--log_trees_every", "1", "--seed", "5"]
CASES: dict[str, list[str]] = {
    "datpo": ["--preset", "tiny", *TINY],
    "datpo-sent-entropy": ["--preset", "tiny", "--fork", "sent-entropy", *TINY],
    "datpo-generate": ["--preset", "tiny", "--rollout_engine", "generate", *TINY],
    "datpo-rows": ["--preset", "tiny", "--train_layout", "rows", "--ppo_epochs", "2", *TINY],
    "release": ["--preset", "release", "--scale", "tiny", *TINY],
    "datpo-off-policy": ["--preset", "datpo-off-policy", "--scale", "tiny", *TINY],
    "grpo": ["--preset", "grpo", "--scale", "tiny", *TINY],
    "drgrpo": ["--preset", "drgrpo", "--scale", "tiny", *TINY],
    "treerl": ["--preset", "treerl", "--scale", "tiny", *TINY],
    "attnrl": ["--preset", "attnrl", "--scale", "tiny", *TINY],
    "demo-step-1": ["--preset", "demo", "--steps", "1", "--eval_limit", "4", "--eval_k", "2",
                    "--threads", "1", "--log_trees_every", "1"],
}
STAND_IN = {name for name in CASES if not name.startswith("demo")}

# The child: train.py's main with the stand-in grader patched in wherever the real one is bound.
CHILD = """
import hashlib, sys
sys.path.insert(0, sys.argv[1])
import reward, train
def stand_in(text, answer, fallback=False):
    return float(hashlib.sha256(text.encode()).digest()[0] % 2)
if sys.argv[2] == "stand-in":
    real = reward.compute_reward
    for module in list(sys.modules.values()):
        if getattr(module, "compute_reward", None) is real:
            module.compute_reward = stand_in
train.main(sys.argv[3:])
"""


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def fingerprint(run_dir: Path) -> dict:
    """metrics rows without wall-clock fields, final weights' and tree logs' hashes."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rows = [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in rows]
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    weights = sha(checkpoints[-1] / "model.safetensors") if checkpoints else None
    trees = {p.name: sha(p) for p in sorted((run_dir / "trees").glob("*.jsonl"))}
    return {"metrics": rows, "weights": weights, "trees": trees}


def run_case(repo: Path, name: str, out: Path) -> dict:
    run_dir = out / name
    grader = "stand-in" if name in STAND_IN else "real"
    cmd = [sys.executable, "-c", CHILD, str(repo), grader, *CASES[name], "--out_dir", str(run_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return fingerprint(run_dir)


def compare(a: dict, b: dict) -> list[str]:
    """One line per case and field that differs."""
    lines = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            lines.append(f"{name}: only in {'the second' if name not in a else 'the first'}")
            continue
        for key in ("weights", "trees"):
            if a[name][key] != b[name][key]:
                lines.append(f"{name}: {key} {a[name][key]} != {b[name][key]}")
        ra, rb = a[name]["metrics"], b[name]["metrics"]
        if len(ra) != len(rb):
            lines.append(f"{name}: {len(ra)} metrics rows != {len(rb)}")
        for i, (x, y) in enumerate(zip(ra, rb)):
            for k in sorted(set(x) | set(y)):
                if x.get(k) != y.get(k):
                    lines.append(f"{name}: row {i} {k}: {x.get(k)!r} != {y.get(k)!r}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(Path(__file__).resolve().parent.parent))
    parser.add_argument("--out", help="JSON file of fingerprints to write")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two fingerprint files")
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        lines = compare(a, b)
        print("\n".join(lines) or f"identical: {len(a)} cases")
        raise SystemExit(1 if lines else 0)
    with tempfile.TemporaryDirectory() as tmp:
        result = {name: run_case(Path(args.repo).resolve(), name, Path(tmp)) for name in args.cases}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
