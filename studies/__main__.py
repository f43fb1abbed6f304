"""python -m studies STUDY [--scale paper|demo|tiny] [flags] — run one Section 3 study (studies/__init__.py
lists them).

`--scale` picks the study's settings (<STUDY>_SCALES in its file: `config` entries are Config fields, the rest
the study's own flags). Every Config field is a flag as in train.py (`--model`, `--max_new_tokens`, ...), and
the study's own flags (STUDY_FLAGS) override its scale's settings. `python -m studies STUDY -h` lists them.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from runtime import threads

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import config as C
from harness import cli, preflight
from runtime import faults
from studies import difficulty, dynamics, forks, main_table, tree_vs_parallel
from studies.common import Study, check_study_options

PROG = "python -m studies"

STUDIES = {
    "difficulty": (difficulty.run_difficulty,
                   "Sec. 3.1 / App. B: Easy/Medium/Hard subsets from 12 base samples, G sweep runs"),
    "difficulty-report": (difficulty.run_difficulty_report,
                          "App. B: evaluate the 9 G-sweep models; avg/pass vs G, pass@k curves"),
    "tree-vs-parallel": (tree_vs_parallel.run_tree_vs_parallel,
                         "Sec. 3.2 / App. C.2: PassRate vs generated tokens, tree vs parallel"),
    "forks": (forks.run_forks,
              "Sec. 3.3 / App. D.2-D.5: fork table (PassRate, SibDiv) and localization metrics"),
    "show-forks": (forks.run_show_forks,
                   "App. D.2 figures: one response, entropy shading, each strategy's forks"),
    "dynamics": (dynamics.run_dynamics,
                 "Sec. 5.2 / App. F.5: learning curves, leaves and PassRate per level, checkpoints"),
    "main-table": (main_table.run_main_table,
                   "Sec. 5.2 / App. F.3: methods × seeds trained and evaluated, 95 % intervals"),
}
STUDY_SCALES: dict[str, dict[str, dict]] = {
    "difficulty": difficulty.DIFFICULTY_SCALES,
    "difficulty-report": difficulty.REPORT_SCALES,
    "tree-vs-parallel": tree_vs_parallel.TREE_VS_PARALLEL_SCALES,
    "forks": forks.FORKS_SCALES,
    "show-forks": forks.SHOW_FORKS_SCALES,
    "main-table": main_table.MAIN_TABLE_SCALES,
    "dynamics": dynamics.DYNAMICS_SCALES,
}

# Study flag → (type, nargs, help). Defaults come from STUDY_SCALES[study][scale].
STUDY_FLAGS = {
    "data": (str, None, "problems (a data.load_problems source)"),
    "limit": (int, None, "first N problems (0 = all)"),
    "levels": (int, "*", "keep only these levels (none = all)"),
    "n_samples": (int, None, "base samples per problem for the difficulty buckets (paper 12)"),
    "subset": (int, None, "problems kept per bucket (paper 1,400)"),
    "samples_per_step": (int, None, "G sweep: responses per step, G · prompts (paper 256)"),
    "epochs": (float, None, "G sweep: passes over the subset (paper 5)"),
    "train": (cli.parse_bool, None, "G sweep: run the 9 trainings now (else write commands.sh)"),
    "g": (int, "+", "G sweep: group sizes to run, of 4 8 16 (presets grpo-g4/8/16)"),
    "bench": (str, "+", "benchmarks to evaluate on"),
    "k": (int, None, "samples per problem (report/dynamics) or forks per response (trees)"),
    "b": (int, None, "branches per fork"),
    "parallel_m": (int, "+", "parallel sample counts M (--parallel is the torchrun sharding mode)"),
    "tree_n": (int, "+", "tree base counts N"),
    "methods": (str, "+", "forking methods of the trees (tree-vs-parallel), presets to train (main-table)"),
    "repeats": (int, None, "independent repeats (paper 5 for forks)"),
    "strategies": (str, "+", "strategies to draw (show-forks) or to run (forks: labels of FORK_STRATEGIES)"),
    "candidates": (int, None, "samples per problem to pick the longest response from"),
    "checkpoints": (cli.parse_bool, None, "evaluate saved checkpoints (pass@k across checkpoints)"),
    "runs": (str, "+", "train.py run folders"),
    "from_dir": (str, None, "folder of the difficulty study (its runs/)"),
    "seeds": (int, "+", "main-table: training seeds per method (intervals are over seeds)"),
    "equal_tokens": (cli.parse_bool, None,
                     "main-table: set GRPO/Dr.GRPO's G to DATPO's measured tokens per problem"),
    "from_result": (cli.parse_bool, None,
                    "rebuild the table, intervals and figures from OUT/result.json (no sampling)"),
}


def build_parser(study: str) -> argparse.ArgumentParser:
    """train.py's parser (every Config field) plus the study's own flags: those its scales set, and the few
    that have no per-scale default."""
    parser = cli.build_parser(f"{PROG} {study}: {STUDIES[study][1]}. Every config field is a flag.")
    parser.prog = f"{PROG} {study}"
    group = parser.add_argument_group(study)
    names = set(STUDY_SCALES[study]["demo"]) - {"config"} | ({"runs"} if study == "dynamics" else set()) \
        | ({"from_dir"} if study == "difficulty-report" else set()) \
        | ({"strategies"} if study == "forks" else set()) \
        | ({"from_result"} if study in ("tree-vs-parallel", "forks") else set())
    for name in sorted(names):
        kind, nargs, text = STUDY_FLAGS[name]
        group.add_argument(f"--{name}", type=kind, nargs=nargs, default=None, help=text)
    return parser


def make_study(name: str, argv: list[str]) -> Study:
    """The Study of a command line: its scale's settings overridden by the flags given; the output folder
    checked writable before anything slow runs."""
    parser = build_parser(name)
    args = parser.parse_args(argv)
    scale = args.scale or "paper"
    settings = STUDY_SCALES[name][scale]
    study_keys = set(STUDY_FLAGS)
    given = {k: v for k, v in vars(args).items()
             if k not in ("preset", "scale", *study_keys) and v is not None}
    out = Path(given.pop("out_dir", "") or Path("runs") / "analysis" / name)
    try:
        cfg = C.make_config(args.preset, scale, **{**settings["config"], **given}, out_dir=str(out))
    except ValueError as err:
        parser.error(str(err))
    opts = {k: v for k, v in settings.items() if k != "config"}
    opts.update({k: getattr(args, k) for k in study_keys if getattr(args, k, None) is not None})
    if not set(opts.get("g", [])) <= set(difficulty.G_SWEEP):
        parser.error(f"--g: got {opts['g']}, expected group sizes of 4 8 16 (the presets grpo-g4/8/16)")
    check_study_options(opts)   # counts in range: one line naming the flag
    if name == "difficulty-report":
        opts.setdefault("from_dir", str(out.parent / "difficulty"))
    if name == "dynamics":
        opts.setdefault("runs", [])
    preflight.check_writable(out)          # a UserError naming --out_dir, not a traceback
    named = {k for k in given} | {k for k in study_keys if getattr(args, k, None) is not None}
    return Study(name, cfg, opts, out, scale, frozenset(named))


def main(argv: list[str] | None = None) -> Study:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in STUDIES:
        usage = "\n".join(f"  {name:18s} {text}" for name, (_, text) in STUDIES.items())
        print(f"usage: {PROG} STUDY [--scale paper|demo|tiny] [flags]\nstudies:\n{usage}", file=sys.stderr)
        if argv and argv[0] in ("-h", "--help"):
            raise SystemExit(0)
        # the last line says what was wrong, as every other bad command line does
        what = f"unknown study {argv[0]!r}" if argv else "a STUDY is required"
        print(f"{PROG}: error: {what}; expected one of {', '.join(STUDIES)}", file=sys.stderr)
        raise SystemExit(2)
    study = make_study(argv[0], argv[1:])
    STUDIES[argv[0]][0](study)
    return study


if __name__ == "__main__":
    sys.argv[0] = PROG        # main_guard names the program after argv[0], which -m sets to this file's path
    faults.main_guard(main)   # user mistakes: one line, exit 2 (--debug: traceback)
