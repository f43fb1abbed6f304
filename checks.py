"""checks.py — what Config.validate checks: every choice in its list, every number in its range,
no combination of flags that cannot run. A bad value is one ValueError line naming the flag and what is
valid (harness/cli.py shows it as `prog: error: ...`; config.make_config raises it). A stage file:
config.py and prompts.py call it, and the choice lists come from the stages that own them."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

import methods as M
import optim as O
import release
import tree as T
from runtime import figures

# The stages own their choice lists (one source each): methods.py's table, tree.py's forking strategies and
# branch lengths, release.py's value estimates and sibling groups, optim.py's optimizer state dtypes.
METHODS = M.METHODS                         # datpo, grpo, drgrpo, treerl, attnrl: a row each in methods.py
FORKS = T.FORK_STRATEGIES
ALPHA_SCOPES = ("positive", "all")
PRECISIONS = ("bf16-autocast", "bf16", "fp32")
PROMPT_STYLES = ("release", "chat", "plain", "verbatim")
LOSS_NORMS = ("token", "constant")
BRANCH_LENGTHS = T.BRANCH_LENGTHS
VALUE_ESTIMATES = release.VALUES          # paper | release (release.py)
SIBLING_GROUPS = release.SIBLING_GROUPS
TRAIN_LAYOUTS = ("packed", "rows")
GROUPINGS = ("trees", "blocks")
ATTENTION_KERNELS = ("auto", "tree", "dense", "flex")
PARALLELS = ("fsdp", "hsdp", "ddp")
OPTIMIZER_DTYPES = O.OPTIMIZER_DTYPES      # AdamW states in the weights' dtype (the release) | fp32
REPORTERS = ("none", "tensorboard", "wandb")   # --report_to: experiment trackers (tracking.py)

# Field name -> allowed values, checked by validate() and shown by the command line (harness/cli.py).
CHOICES = {
    "method": METHODS,
    "fork": FORKS,
    "alpha_scope": ALPHA_SCOPES,
    "precision": PRECISIONS,
    "prompt_style": PROMPT_STYLES,
    "loss_norm": LOSS_NORMS,
    "branch_length": BRANCH_LENGTHS,
    "value_estimate": VALUE_ESTIMATES,
    "sibling_groups": SIBLING_GROUPS,
    "train_layout": TRAIN_LAYOUTS,
    "mini_batch_grouping": GROUPINGS,
    "packed_attention": ATTENTION_KERNELS,
    "parallel": PARALLELS,
    "rollout_engine": ("engine", "generate"),
    "decode_step": ("auto", "reference", "shared", "paged", "paged-eager"),
    "optimizer_dtype": OPTIMIZER_DTYPES,
    "lr_schedule": O.LR_SCHEDULES,
}
LIST_CHOICES = {"report_to": REPORTERS}   # list-valued fields: every item must be one of these


# ---------------------------------------------------------------------------------------------------------
# Every numeric field has a bounded range, so a typo (--threads 100000,
# --alpha_start 1e30, --seed 2**64) is one line naming the flag, never a segfault, an overflow deep in torch
# or a later error that blames another flag. The bounds are far beyond any real run.
# ---------------------------------------------------------------------------------------------------------
_MANY = 10**9          # steps and step counts
_TOKENS = 2**20        # a length in tokens: beyond every model's context
_ROWS = 2**16          # rows, prompts or texts handled at once
INT_RANGES: dict[str, tuple[int, int]] = {
    # the tree and the group (the paper: N, K_max, B_max = 4, 3, 4; G = 16; avg@k with k = 8)
    "n_base": (1, 1024), "group_size": (1, 1024), "k_max": (0, 1024), "b_max": (0, 1024), "eval_k": (1, 1024),
    # lengths in tokens
    "max_new_tokens": (1, _TOKENS), "eval_max_new_tokens": (1, _TOKENS), "max_prompt_tokens": (0, _TOKENS),
    "atb_gap": (0, _TOKENS), "top_k": (0, 2**24), "max_tokens_per_micro_batch": (1, 2**24),
    "max_kv_tokens": (0, 2**31 - 1),
    # batch sizes
    "gen_batch_size": (1, _ROWS), "branch_chunk_size": (1, _ROWS), "max_batch_rows": (0, _ROWS),
    "prompts_per_step": (1, _ROWS), "embed_batch_size": (1, _ROWS), "mini_batch_size": (1, _TOKENS),
    "micro_batch_size": (1, _TOKENS), "ppo_epochs": (1, 1000),
    # schedules and bookkeeping
    "steps": (1, _MANY), "eval_every": (0, _MANY), "eval_limit": (0, _MANY), "save_every": (0, _MANY),
    "keep_checkpoints": (0, _MANY), "log_trees_every": (0, _MANY), "max_bad_steps": (1, _MANY),
    "log_completions_every": (0, _MANY),
    "seed": (0, 2**32 - 1),    # NumPy's range; derived seeds (seed + rank, seed + epoch) stay within torch's
}
DEFAULT_INT_RANGE = (0, _MANY)  # an integer knob with no entry above
FLOAT_BOUND = 1e12              # every float knob, before its own check below (a new knob is bounded too)
UNBOUNDED_FLOATS = ("max_grad_norm",)   # a huge norm means no clipping: a legitimate choice
MAX_ALPHA = 10.0               # |α|: Eq. 4 adds α·Div_sib(b) to Â_base(b); see check_ranges
TEMPERATURE_RANGE = (1e-3, 100.0)
MAX_STOP_TIMEOUT = 86400.0     # s: one day; setitimer overflows past ~1e11 s
THREADS_PER_CORE = 4           # --threads above this many per usable core only oversubscribes them
DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?|mps")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, e.g. a job's cgroup), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # macOS, Windows
        return os.cpu_count() or 1


# --------------------------------------------------------------------------------------------------------
# Every field's kind, whatever set it: the command line (argparse parses by these), a settings file
# (--config FILE, a run's config.json under --resume: harness/cli.py reads them with kind_problem), a preset
# or a Config built in code (validate). A bool is never an int, an int never a float ("steps": 2.0 is
# refused, not truncated), a string is never a bool ("false" is truthy: it let a model folder's own code run).
# --------------------------------------------------------------------------------------------------------
KIND_NAMES = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


def kind_problem(kind: str, value) -> str | None:
    """What a value of the field kind `kind` (a Config annotation as written in config.py: bool, int, float,
    str, list[str], list[float]) is, when `value` is not one; None when it is. A float field takes an
    integer (1 is 1.0)."""
    if kind.startswith("list[") and kind.endswith("]"):
        item = kind[5:-1]
        if isinstance(value, list) and all(kind_problem(item, v) is None for v in value):
            return None
        return f"a list of {KIND_NAMES.get(item, item).replace('an ', '').replace('a ', '')}s"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {"bool": isinstance(value, bool), "int": number and isinstance(value, int), "float": number,
          "str": isinstance(value, str)}.get(kind, True)
    return None if ok else KIND_NAMES[kind]


def shown(value) -> str:
    """A settings value as a message shows it, its kind in view: the string "false", 2.0, true, null."""
    import json

    text = json.dumps(value, ensure_ascii=False, default=repr)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"the string {text}" if isinstance(value, str) else text


def check_types(cfg) -> None:
    """Every field's value of its kind (kind_problem); a preset or a Config built in code meets the same
    rule as the command line and a settings file."""
    for f in dataclasses.fields(cfg):
        why = kind_problem(str(f.type), getattr(cfg, f.name))
        if why:
            raise ValueError(f"--{f.name}: got {shown(getattr(cfg, f.name))}, expected {why}")


def check_choices(cfg) -> None:
    """Fields with a fixed set of values (CHOICES, LIST_CHOICES, --device) and the trackers' packages."""
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name}: got {getattr(cfg, name)!r}, expected one of {', '.join(allowed)}")
    for name, allowed in LIST_CHOICES.items():
        values = getattr(cfg, name)
        if isinstance(values, str) or not values or any(v not in allowed for v in values):
            raise ValueError(f"--{name}: got {values!r}, expected one or more of {', '.join(allowed)}")
    if "none" in cfg.report_to and len(cfg.report_to) > 1:
        raise ValueError(f"--report_to: got {cfg.report_to}; 'none' cannot be combined with a tracker")
    missing = missing_tracker(cfg.report_to)
    if missing:
        raise ValueError(missing)
    if not isinstance(cfg.device, str) or not DEVICE_PATTERN.fullmatch(cfg.device):
        raise ValueError(f"--device: got {cfg.device!r}, expected auto, cpu, cuda, cuda:N (a GPU) or mps")


def check_ranges(cfg) -> None:
    """Every numeric field within its range: integers (INT_RANGES, --threads), then floats."""
    for f in dataclasses.fields(cfg):   # nan/inf pass every comparison below: refused first
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"--{f.name}: got {value}, expected a finite number")
    for f in dataclasses.fields(cfg):   # ints by INT_RANGES; a knob without an entry gets DEFAULT_INT_RANGE
        value = getattr(cfg, f.name)
        if f.type in ("int", int):
            low, high = INT_RANGES.get(f.name, DEFAULT_INT_RANGE)
            if not low <= value <= high:
                raise ValueError(f"--{f.name}: got {value}, expected an integer >= {low} and <= {high}")
    cores = usable_cores()
    if not 0 <= cfg.threads <= THREADS_PER_CORE * cores:
        raise ValueError(f"--threads: got {cfg.threads}, expected an integer >= 0 (0: torch's default) and "
                         f"<= {THREADS_PER_CORE * cores} ({THREADS_PER_CORE} x the {cores} cores this "
                         f"process may use)")
    low, high = TEMPERATURE_RANGE
    if not low <= cfg.temperature <= high:
        raise ValueError(f"--temperature: got {cfg.temperature}, expected {low:g} <= temperature <= {high:g} "
                         f"(below: greedy in all but name; above: uniform noise)")
    # Eq. 4: Â(b) = Â_base(b) + 1[Â_base(b) > 0]·α·Div_sib(b), with Â_base in [-1, 1] (binary reward minus a
    # value) and Div_sib = 1 - cosine in [0, 2]. At |α| = 10 the bonus can already outweigh the verifiable
    # reward 20 to 1 (the paper's α: 0.2, 0.4, -0.2); far beyond, the loss overflows (blamed on --lr).
    for name in ["alpha_start", "alpha_end"]:
        if not abs(getattr(cfg, name)) <= MAX_ALPHA:
            raise ValueError(f"--{name}: got {getattr(cfg, name)}, expected -{MAX_ALPHA:g} <= alpha <= "
                             f"{MAX_ALPHA:g} (Eq. 4 adds alpha x Div_sib, at most 2, to an advantage in "
                             f"[-1, 1])")
    check_fractions(cfg)
    if not cfg.weight_decay >= 0 or cfg.lr * cfg.weight_decay > 1:
        raise ValueError(f"--weight_decay: got {cfg.weight_decay}, expected >= 0 and --lr x --weight_decay "
                         f"<= 1 (AdamW scales every weight by 1 - lr x weight_decay each step)")
    if not 0 <= cfg.stop_timeout <= MAX_STOP_TIMEOUT:
        raise ValueError(f"--stop_timeout: got {cfg.stop_timeout}, expected >= 0 and <= {MAX_STOP_TIMEOUT:g} "
                         f"seconds (a day; 0: wait for the end of the step)")
    if not cfg.max_grad_norm > 0:
        raise ValueError(f"--max_grad_norm: got {cfg.max_grad_norm}, expected > 0")
    check_rewards(cfg)
    for f in dataclasses.fields(cfg):   # last: a float knob without a check of its own is bounded too
        value = getattr(cfg, f.name)
        if f.type in ("float", float) and abs(value) > FLOAT_BOUND and f.name not in UNBOUNDED_FLOATS:
            raise ValueError(f"--{f.name}: got {value}, expected a magnitude <= {FLOAT_BOUND:g}")


def check_fractions(cfg) -> None:
    """The float fields that are fractions or rates."""
    if not 0 < cfg.top_p <= 1:
        raise ValueError(f"--top_p: got {cfg.top_p}, expected 0 < top_p <= 1")
    if not 0 <= cfg.fork_min_dist < 1:
        raise ValueError(f"--fork_min_dist: got {cfg.fork_min_dist}, expected a fraction in [0, 1)")
    if not 0 <= cfg.atb_quantile <= 1:
        raise ValueError(f"--atb_quantile: got {cfg.atb_quantile}, expected a fraction in [0, 1]")
    for name in ["clip_low", "clip_high"]:
        if not 0 <= getattr(cfg, name) < 1:
            raise ValueError(f"--{name}: got {getattr(cfg, name)}, expected 0 <= eps < 1")
    if not 0 < cfg.lr <= 1:   # AdamW moves every weight by ~lr per step: lr > 1 destroys any model
        raise ValueError(f"--lr: got {cfg.lr}, expected 0 < lr <= 1 (fine-tuning uses ~1e-6 to 1e-4)")
    for name in ["beta1", "beta2"]:
        if not 0 <= getattr(cfg, name) < 1:
            raise ValueError(f"--{name}: got {getattr(cfg, name)}, expected 0 <= beta < 1")
    if not 0 <= cfg.attnrl_lambda <= 1:
        raise ValueError(f"--attnrl_lambda: got {cfg.attnrl_lambda}, expected a fraction in [0, 1]")
    if not 0 <= cfg.kl_beta <= 100:
        raise ValueError(f"--kl_beta: got {cfg.kl_beta}, expected 0 <= beta <= 100 (0: no KL penalty; TRL's "
                         f"GRPO used 0.04)")
    if not 0 <= cfg.max_reward_error_share <= 1:
        raise ValueError(f"--max_reward_error_share: got {cfg.max_reward_error_share}, expected a fraction "
                         f"in [0, 1] (0: stop at the first reward call that raises; 1: never stop)")
    if not 0 <= cfg.warmup_ratio < 1:
        raise ValueError(f"--warmup_ratio: got {cfg.warmup_ratio}, expected a fraction of --steps in [0, 1)")


# --reward FILE.py:FUNCTION or module:function (harness/custom_reward.py loads them at set-up)
REWARD_SPEC = re.compile(r"(?:.+\.py|[A-Za-z_][\w.]*):[A-Za-z_]\w*")
MAX_REWARD_WEIGHT = 1e6


def check_rewards(cfg) -> None:
    """--reward's spellings and --reward_weights: one finite weight per function (or none: 1 each)."""
    for spec in cfg.reward:
        if not isinstance(spec, str) or not REWARD_SPEC.fullmatch(spec):
            raise ValueError(f"--reward: got {spec!r}, expected FILE.py:FUNCTION or module:function "
                             f"(a function with TRL's signature fn(prompts, completions, **columns))")
    if cfg.reward_weights and len(cfg.reward_weights) != len(cfg.reward):
        raise ValueError(f"--reward_weights: got {len(cfg.reward_weights)} weight(s) for {len(cfg.reward)} "
                         f"--reward function(s); expected one weight per function, in the same order")
    for weight in cfg.reward_weights:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
                or not abs(weight) <= MAX_REWARD_WEIGHT:
            raise ValueError(f"--reward_weights: got {weight!r}, expected finite numbers within "
                             f"±{MAX_REWARD_WEIGHT:g}")


def check_combinations(cfg) -> None:
    """Fields that are valid alone but not together."""
    if cfg.micro_batch_size > cfg.mini_batch_size:
        raise ValueError(f"--micro_batch_size ({cfg.micro_batch_size}) must be <= "
                         f"--mini_batch_size ({cfg.mini_batch_size})")
    if cfg.few_shot and cfg.prompt_style == "verbatim":
        raise ValueError("--few_shot adds a worked example to each prompt; --prompt_style verbatim uses each "
                         "prompt as it is: expected one of them")
    if cfg.off_policy_steps not in (0, 1):
        raise ValueError(f"--off_policy_steps: got {cfg.off_policy_steps}, expected 0 (on-policy) or 1 "
                         f"(one-step off-policy)")
    if cfg.compile_decode and cfg.rollout_engine != "engine":
        raise ValueError("--compile_decode compiles the engine's decode step: expected --rollout_engine "
                         "engine (HF generate has its own compile options)")
    if cfg.off_policy_steps and cfg.rollout_engine != "engine":
        raise ValueError("--off_policy_steps 1 folds the next step's base responses into this step's running "
                         "batch, which only the engine does: expected --rollout_engine engine")
    if cfg.loss_norm == "constant" and M.METHODS[cfg.method].paths and cfg.mini_batch_grouping == "blocks":
        raise ValueError("--loss_norm constant counts TreeRL/AttnRL's root-to-leaf paths per mini-batch; a "
                         "mini-batch of random blocks may hold none: expected --mini_batch_grouping trees")
    short = kv_pool_shortfall(cfg)
    if short:
        raise ValueError(short)


def kv_pool_responses(cfg, evaluation: bool = True) -> list[tuple[int, str]]:
    """The KV tokens the engine's pool must hold besides one prompt (--max_kv_tokens > 0), each with what
    needs them: a training tree, N base responses kept for their forks plus one branch, or a GRPO group's
    rows decoded at once; with `evaluation`, a held-out evaluation's k samples. Responses are taken at their
    full length, as a random or looping model writes them. Empty when the engine does not run."""
    if not cfg.max_kv_tokens or cfg.rollout_engine != "engine":
        return []
    rows = cfg.max_batch_rows or max(cfg.gen_batch_size, cfg.branch_chunk_size)
    if M.METHODS[cfg.method].rollout == "parallel":
        n = min(cfg.group_size, rows)
        needs = [(n * cfg.max_new_tokens, f"{n} responses of --max_new_tokens {cfg.max_new_tokens} at once")]
    else:
        branches = 1 if cfg.k_max and cfg.b_max else 0
        needs = [((cfg.n_base + branches) * cfg.max_new_tokens,
                  f"--n_base {cfg.n_base} base responses kept for their forks" + " plus one branch" * branches
                  + f", each up to --max_new_tokens {cfg.max_new_tokens}")]
    if cfg.eval_every and evaluation:
        k = min(cfg.eval_k, rows)
        needs.append((k * cfg.eval_max_new_tokens,
                      f"{k} evaluation samples of --eval_max_new_tokens {cfg.eval_max_new_tokens} at once"))
    return needs


def kv_pool_shortfall(cfg, n_prompt: int = 0, where: str = "") -> str | None:
    """Why --max_kv_tokens cannot hold one prompt and its responses (kv_pool_responses), or None. Checked at
    start (n_prompt 0: before any prompt is known) and for each training prompt `where` of n_prompt tokens
    (prompts.check_fits), so a pool that is too small is one line, not an error inside the engine mid-step."""
    for tokens, what in kv_pool_responses(cfg, evaluation=not n_prompt):
        if cfg.max_kv_tokens < n_prompt + tokens:
            prompt = f"{where}'s {n_prompt} prompt tokens + " if n_prompt else ""
            return (f"--max_kv_tokens: got {cfg.max_kv_tokens}, expected 0 (sized automatically) or at least "
                    f"{n_prompt + tokens} tokens: {prompt}{what}")
    return None


def missing_tracker(report_to) -> str | None:
    """A one-line reason when a tracker named in --report_to has no installed package (tracking.py), else
    None."""
    for name in report_to:
        if name in ("tensorboard", "wandb") and importlib.util.find_spec(name) is None:
            optional = " (an optional dependency)" if name == "wandb" else ""
            return (f"--report_to {name}: the Python package {name!r}{optional} is not installed; "
                    f"run `pip install {name}` or leave {name} out of --report_to")
    return None


def not_utf8(text: str) -> str | None:
    """Why a name from the command line cannot be written into a UTF-8 file (config.json, metrics.jsonl,
    results.json, a checkpoint's tokenizer files), or None: a byte that is not UTF-8 (Python keeps it as a
    lone surrogate, os.fsdecode), e.g. a folder named on a Latin-1 system."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"character U+{code:04X}"
        return f"{what} at character {err.start + 1} is not UTF-8"


def check_texts(cfg) -> None:
    """Every name (a path, a model, a data source) UTF-8, so the run can record it: a run folder named with a
    Latin-1 byte failed at its first checkpoint, after a step had run (the tokenizer's files are UTF-8)."""
    for f in dataclasses.fields(cfg):
        values = getattr(cfg, f.name)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            why = not_utf8(value) if isinstance(value, str) else None
            if why:
                raise ValueError(f"--{f.name} {figures.printable(value)}: {why}; expected a UTF-8 name "
                                 f"(rename the file or folder): a run records its settings in UTF-8 files "
                                 f"(config.json)")


def validate(cfg) -> None:
    """Config.validate: every value of its field's kind, names in UTF-8, choices, ranges, then
    combinations; the first problem raises ValueError."""
    check_types(cfg)
    check_texts(cfg)
    check_choices(cfg)
    check_ranges(cfg)
    check_combinations(cfg)
