"""studies/common.py — what every Section 3 study shares: the Study it runs on, the statistics its tables
report, loading problems and the policy, writing result.json/table.md, and plotting.

Statistics (pure functions over plain lists):
  pass_rate         App. C.2 PassRate: 1 if any leaf's reward is 1
  mean_of           mean over the values that are not None
  correct_counts    correct samples per problem, from evaluate's per-sample records
  t_interval        mean and 95 % Student-t half-width (the independent units: seeds, problems or rollouts)
  pm, verdict       'mean ± half' cells, and what a paired difference's interval shows
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shlex
from pathlib import Path
from typing import NamedTuple

import torch
from scipy import stats

import config as C
import data
import models
import rollout as R
from harness import measured, preflight, runs
from runtime import atomic, faults

# --------------------------------------------------------------------------------------------------------
# Settings every study's scales share. A study's <STUDY>_SCALES give, per scale, `config` (Config fields)
# and the study's own flags (studies/__main__.py's STUDY_FLAGS), which the command line overrides.
# --------------------------------------------------------------------------------------------------------
PAPER_MODEL = "Qwen/Qwen2.5-3B-Instruct"     # App. B, C.2, D.5 analyse the instruct model
DEMO_CONFIG = dict(max_new_tokens=48, few_shot=True)
TINY_CONFIG = dict(max_new_tokens=10)
STRATEGY_COLORS = {"random": "tab:gray", "fixed-seg": "tab:green", "atb": "tab:blue",
                   "tok-entropy": "tab:red", "sent-entropy": "tab:purple", "parallel": "black"}


@dataclasses.dataclass
class Study:
    """One study's run: its name, the Config its models use, its own options, its output folder, its scale."""
    name: str
    cfg: C.Config
    opts: dict
    out: Path
    scale: str
    given: frozenset = frozenset()   # the flags given on the command line (config fields and study flags)


# --------------------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------------------
def pass_rate(rewards) -> float:
    """PassRate (App. C.2): 1.0 if any leaf's reward is 1, else 0.0."""
    return float(any(r == 1 for r in rewards))


def mean_of(values) -> float | None:
    """Mean of the values that are not None (aggregates over responses are means of per-response values)."""
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def correct_counts(records: list[dict], n_problems: int) -> list[int]:
    """Correct samples per problem (evaluate's records: one per sample, with its problem index)."""
    counts = [0] * n_problems
    for rec in records:
        counts[rec["index"]] += int(rec["correct"])
    return counts


def t_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width of the two-sided Student-t interval over the values); half-width None for one value.
    The values are independent units: seeds (each a whole training run, evaluated once), problems or base
    rollouts."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)


def pm(value: float, half: float | None, digits: int = 1, scale: float = 1.0) -> str:
    """'value ± half', both × scale (100: percentages); half None: one unit, no interval."""
    return f"{value * scale:.{digits}f}" + ("" if half is None else f" ± {half * scale:.{digits}f}")


def verdict(diff: float, half: float | None, first: str, second: str) -> str:
    """What a paired difference's 95 % interval says: one side higher, or no difference shown."""
    if half is None:
        return "one unit: no interval"
    if diff - half > 0:
        return f"{first} higher"
    if diff + half < 0:
        return f"{second} higher"
    return "no difference shown"


# --------------------------------------------------------------------------------------------------------
# Loading problems and the policy
# --------------------------------------------------------------------------------------------------------
def load_study_problems(source: str, limit: int, levels: list[int], flag: str = "--data") -> list[dict]:
    """Problems of `source`, only the given levels (if any), first `limit` of them (0 = all). A source that
    cannot be loaded, or levels none of its problems have, is one UserError line naming `flag`."""
    problems = preflight.load_data(source, flag)
    if levels:
        have = sorted({p.get("level") for p in problems if p.get("level") is not None}, key=str)
        problems = [p for p in problems if p.get("level") in levels]
        if not problems:
            has = f"its levels are {', '.join(map(str, have))}" if have else "its problems have no level"
            raise faults.UserError(f"--levels {' '.join(map(str, levels))}: no problem of {flag} {source} "
                                   f"has one of them; {has}")
    return problems[:limit] if limit else problems


def load_policy(cfg: C.Config):
    """(model in eval mode, tokenizer, device) for cfg.model, with cfg's threads and seed set first."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    device = models.pick_device(cfg.device)
    model, tokenizer = models.load_policy(cfg.model, device, models.policy_dtype(cfg.precision),
                                          seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    return model.eval(), tokenizer, device


class Sampling(NamedTuple):
    """What the sampling studies (tree-vs-parallel, forks, show-forks) share."""
    problems: list[dict]
    model: object
    tokenizer: object
    device: torch.device
    sampler: R.Sampler
    prompt_ids: list[list[int]]   # one per problem


def sampling_setup(study: Study) -> Sampling:
    """The study's problems, the policy, a rollout.Sampler and each problem's prompt ids."""
    cfg, o = study.cfg, study.opts
    problems = load_study_problems(o["data"], o["limit"], o["levels"])
    model, tokenizer, device = load_policy(cfg)
    return Sampling(problems, model, tokenizer, device, R.Sampler.from_config(model, tokenizer, cfg),
                    prompt_ids_of(problems, tokenizer, cfg))


def prompt_ids_of(problems, tokenizer, cfg) -> list[list[int]]:
    return [tokenizer(data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot),
                      add_special_tokens=False).input_ids for p in problems]


def base_rewards(tokenizer, base, answers: list[str], cfg) -> list[float]:
    """The reward of each base response (rollout.sample_base's rows) against its gold answer."""
    return R.grade_responses(tokenizer, base.tokens, answers, cfg.answer_fallback)


# --------------------------------------------------------------------------------------------------------
# Outputs: result.json, table.md, train.py command lines
# --------------------------------------------------------------------------------------------------------
def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "–"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1 else f"{v:.1f}"
        return str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_outputs(study: Study, result: dict, table: str, seconds: float) -> None:
    result = {"study": study.name, "scale": study.scale, "seconds": seconds,
              "config": json.loads(study.cfg.to_json()), "options": study.opts, **result}
    # whole or not at all, never through a planted link: a torn result.json would lose the sampled records
    atomic.write_text(study.out / "result.json", json.dumps(result, indent=2, default=str))
    atomic.write_text(study.out / "table.md", table)
    print(table)
    print(f"[{study.name}] {seconds:.0f}s; wrote {study.out}/result.json, table.md and figures", flush=True)


# What --from_result takes from the result.json it rebuilds from, besides the study's own options: the
# settings its records were sampled with.
RESULT_CONFIG_KEYS = ("model", "max_new_tokens", *measured.SAMPLING_KEYS)


def read_result(study: Study) -> dict:
    """OUT/result.json of an earlier run of this study, for --from_result true. The tables and figures are
    rebuilt with the options and sampling settings it was made with (study.opts and study.cfg take them);
    a flag given on this command line that says otherwise, or a result.json that is missing, torn, another
    study's or without sampled records, is one UserError line (its records would be tabled under the wrong
    labels, or not at all)."""
    path = study.out / "result.json"
    expected = (f"expected the result.json a finished `{study.name}` run wrote into --out_dir {study.out} "
                f"(run it once without --from_result)")
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
        why = None if isinstance(result, dict) else f"a JSON {type(result).__name__}, not an object"
    except FileNotFoundError:
        why = "not found"
    except (OSError, ValueError) as err:
        why = f"unreadable or torn ({str(err).splitlines()[0][:80]})"
    if why is None and (result.get("study") != study.name or not isinstance(result.get("records"), list)
                        or not result["records"] or not isinstance(result.get("options"), dict)
                        or not isinstance(result.get("config"), dict)):
        why = f"not a `{study.name}` result with its sampled records, options and config"
    if why is None:
        options = {k: v for k, v in result["options"].items() if k in study.opts and k != "from_result"}
        config = {k: result["config"][k] for k in RESULT_CONFIG_KEYS if k in result["config"]}
        saved = {f"--{k}": v for k, v in {**options, **config}.items() if k in study.given}
        wanted = {f"--{k}": study.opts.get(k, getattr(study.cfg, k, None)) for k in {**options, **config}
                  if k in study.given}
        changed = measured.differences(saved, wanted)
        why = f"made with other settings than this command's ({changed})" if changed else None
    if why:
        raise faults.UserError(f"--from_result true: {path}: {why}; {expected}")
    study.opts.update(options)
    study.cfg = dataclasses.replace(study.cfg, **config)
    return result


def run_identity(model: str) -> dict:
    """{"run_config", "checkpoint"}: what a study's score of a train.py run (or one of its checkpoints) is a
    score of — the run's experiment (SHA-256 of its config.json less what a resume may change and its
    history: two runs with one folder name, or one folder trained anew with other settings, differ) and the
    checkpoint (measured.checkpoint_hash: weights, model config, tokenizer). Both None for a model that is
    not a run's. The studies' score caches record it and are reused only for the same."""
    resolved = Path(models.resolve_checkpoint(model))
    if not (resolved / "trainer_state.pt").is_file():
        return {"run_config": None, "checkpoint": None}
    try:
        saved = json.loads((runs.run_folder_of(resolved) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = None
    run_config = None
    if isinstance(saved, dict):
        kept = {k: v for k, v in runs.upgrade(saved).items()
                if k not in runs.RESUME_MAY_CHANGE and k != "history"}
        run_config = "sha256:" + hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()
    return {"run_config": run_config, "checkpoint": measured.checkpoint_hash(resolved)}


STUDY_COUNTS = {   # study flag -> (least, most): a typo is one line, not a traceback deep inside a study
    "k": (1, 1 << 16), "b": (1, 1 << 10), "n_samples": (1, 1 << 16), "subset": (1, 1 << 30),
    "samples_per_step": (1, 1 << 20), "repeats": (1, 1000), "candidates": (1, 1 << 10), "limit": (0, 1 << 30),
    "parallel_m": (1, 1 << 16), "tree_n": (1, 1 << 16), "g": (1, 1 << 10), "seeds": (0, 2 ** 32 - 1),
    "levels": (0, 1 << 10),
}


def check_study_options(opts: dict) -> None:
    """Every count the study's flags give within its range, and --epochs a positive number: one UserError
    line naming the flag otherwise."""
    for name, (least, most) in STUDY_COUNTS.items():
        values = opts.get(name)
        for value in values if isinstance(values, list) else [] if values is None else [values]:
            if not least <= value <= most:
                raise faults.UserError(f"--{name}: got {value}, expected an integer >= {least} and <= {most}")
    epochs = opts.get("epochs")
    if epochs is not None and not (math.isfinite(epochs) and 0 < epochs <= 1e6):
        raise faults.UserError(f"--epochs: got {epochs}, expected a number of passes > 0 and <= 1e6")


def train_command(preset: str, scale: str, cfg: C.Config) -> str:
    """The train.py command line that rebuilds `cfg`: the preset and scale plus every field that differs."""
    def flag_value(value) -> str:   # as train.py's parser reads it: true/false, list items space-separated
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, list):
            return " ".join(shlex.quote(str(v)) for v in value)
        return shlex.quote(str(value))

    default = C.make_config(preset, scale)
    flags = [f"--{f.name} {flag_value(getattr(cfg, f.name))}"
             for f in dataclasses.fields(C.Config) if getattr(cfg, f.name) != getattr(default, f.name)]
    return " ".join(["python train.py --preset", preset, "--scale", scale, *flags])


# --------------------------------------------------------------------------------------------------------
# Plotting
# --------------------------------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the file-only Agg backend. Imported here, when a study first draws, so that
    importing a study's pure functions (the tests do) neither loads pyplot nor picks a backend for the
    caller."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path, dpi: int = 110) -> None:
    """The figure as a PNG at `path`, written whole (runtime/atomic.py: never through a planted link), and
    closed."""
    try:
        atomic.replace_file(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    finally:
        pyplot().close(fig)


def legend_if_any(ax) -> None:
    """A legend only where something was labelled (matplotlib warns on an empty one)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
