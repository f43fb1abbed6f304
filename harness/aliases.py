"""harness/aliases.py — TRL's and verl's names for our flags (docs/trl.md has the table).

Where a name means what one of our flags means, it is accepted as that flag (`--learning_rate 1e-6` is
`--lr 1e-6`); where the meaning differs (TRL's per_device_train_batch_size counts completions, ours count
prompts, blocks and tokens), the name is refused with one line that says what to use. verl's dotted names
are accepted as flags (`--actor_rollout_ref.actor.optim.lr 1e-6`) and in its own KEY=VALUE form
(`actor_rollout_ref.actor.optim.lr=1e-6`, hydra_pairs).

Each entry: the foreign name, whose it is, our field (None: refused), a note (the --help line or the
refusal), and, where the value must be read or mapped, the foreign value's type and a mapping. Two names
depend on the run (resolve): TRL's num_generations / verl's rollout.n are --group_size for GRPO and Dr.GRPO
and refused for tree methods; TRL's epsilon / verl's clip_ratio set both clip bounds unless the upper one is
given (TRL: epsilon_high defaults to epsilon; verl: clip_ratio_high to clip_ratio).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Alias:
    name: str                          # as written after -- (verl's: the dotted path)
    source: str                        # "TRL" | "verl" | "DATPO" (a flag's earlier name here)
    field: str | None                  # our Config field; None: the name is refused with `note`
    note: str = ""                     # what it means here (shown by --help) or, refused, what to use
    kind: type | None = None           # the foreign value's type when it is not our field's (bool, str)
    convert: Callable | None = None    # foreign value -> ours; raises ValueError with a reason
    hint: str = ""                     # a refused name's --help line (what to use), shorter than `note`


def mapped(table: dict, flag: str) -> Callable:
    """A value mapping: foreign value -> ours, anything else refused naming what is accepted."""
    def convert(value):
        key = value.lower() if isinstance(value, str) else value
        if key not in table:
            raise ValueError(f"--{flag}: got {value!r}; accepted here: "
                             f"{', '.join(str(k) for k in table if table[k] is not None)}"
                             + "".join(f"; {k}: {why}" for k, why in REFUSED_VALUES.get(flag, {}).items()))
        return table[key]
    return convert


def dotted_reward(value: list[str]) -> list[str]:
    """TRL's --reward_funcs takes import paths (my_lib.rewards.fn): ours take module:function."""
    out = []
    for spec in value:
        if ":" not in spec and "." not in spec:
            raise ValueError(f"--reward_funcs: got {spec!r}; TRL's built-in reward names are not available "
                             f"here: give your function as FILE.py:FUNCTION or module.function")
        out.append(spec if ":" in spec else ":".join(spec.rsplit(".", 1)))
    return out


STEPS = ("TRL counts optimizer steps (global_step); here a step is one rollout and its update "
         "(--ppo_epochs x mini-batches optimizer steps)")
REFUSED_VALUES = {
    "loss_type": {"grpo/bnpo": "per-sequence or per-device means are not offered; token (DAPO's, Eq. DATPO) "
                               "or constant (Dr.GRPO's) via --loss_norm"},
    "actor_rollout_ref.actor.loss_agg_mode": {"seq-mean-*": "only token-mean is offered as a verl mode; "
                                                            "Dr.GRPO's constant normaliser is --loss_norm "
                                                            "constant"},
}
LR_SCHEDULES = {"constant": "constant", "constant_with_warmup": "constant", "linear": "linear",
                "cosine": "cosine"}

ALIASES: list[Alias] = [
    # ---- TRL (GRPOConfig and its script arguments) ----
    Alias("learning_rate", "TRL", "lr", "TRL's name for --lr"),
    Alias("num_generations", "TRL", "group_size",
          "TRL's G completions per prompt: --group_size for grpo/drgrpo; a tree method's count follows "
          "V(root) (--n_base N base responses, each with up to K_max x B_max branches), so it is refused "
          "there"),
    Alias("max_completion_length", "TRL", "max_new_tokens",
          "TRL's name for --max_new_tokens (a tree's branch may add as many again: --branch_length)"),
    Alias("output_dir", "TRL", "out_dir", "TRL's name for --out_dir"),
    Alias("num_iterations", "TRL", "ppo_epochs", "TRL's μ, updates per batch of completions: --ppo_epochs"),
    Alias("epsilon", "TRL", "clip_low",
          "TRL's clip ε: --clip_low, and --clip_high too unless --epsilon_high / --clip_high is given"),
    Alias("epsilon_high", "TRL", "clip_high", "TRL's name for --clip_high"),
    Alias("bf16", "TRL", "precision", "TRL's bf16: true = --precision bf16-autocast (fp32 weights, bf16 "
          "autocast), false = fp32", kind=bool,
          convert=lambda on: "bf16-autocast" if on else "fp32"),
    Alias("log_completions", "TRL", "log_completions_every",
          "TRL's log_completions: true = --log_completions_every 1", kind=bool, convert=lambda on: int(on)),
    Alias("lr_scheduler_type", "TRL", "lr_schedule", "TRL's name for --lr_schedule (constant_with_warmup: "
          "constant, the warmup is --warmup_ratio)", kind=str,
          convert=mapped(LR_SCHEDULES, "lr_scheduler_type")),
    Alias("beta", "TRL", "kl_beta", "TRL's KL coefficient: --kl_beta (k3 to the initial policy, kl.py)"),
    Alias("adam_beta1", "TRL", "beta1", "TRL's name for --beta1"),
    Alias("adam_beta2", "TRL", "beta2", "TRL's name for --beta2"),
    Alias("model_name_or_path", "TRL", "model", "TRL's name for --model"),
    Alias("dataset_name", "TRL", "train_data", "TRL's name for --train_data (an HF dataset, owner/name)"),
    Alias("reward_funcs", "TRL", "reward", "TRL's reward_funcs: --reward (import paths a.b.fn accepted)",
          convert=dotted_reward),
    Alias("loss_type", "TRL", "loss_norm", "TRL's loss_type: dapo = --loss_norm token, dr_grpo = constant",
          kind=str, convert=mapped({"dapo": "token", "dr_grpo": "constant"}, "loss_type")),
    Alias("per_device_train_batch_size", "TRL", None,
          "TRL counts completions per device per optimizer step; here --prompts_per_step counts the prompts "
          "of a step, --mini_batch_size the blocks of an optimizer step and --max_tokens_per_micro_batch the "
          "tokens of one forward (gradient accumulation follows)",
          hint="counts completions per device: use --prompts_per_step, --mini_batch_size (blocks)"),
    Alias("gradient_accumulation_steps", "TRL", None,
          "accumulation follows from --mini_batch_size (blocks per optimizer step) and "
          "--max_tokens_per_micro_batch (tokens per forward/backward)",
          hint="follows from --mini_batch_size and --max_tokens_per_micro_batch"),
    Alias("num_train_epochs", "TRL", None, "use --steps: one step is --prompts_per_step prompts, so one pass "
          "over P problems is P / prompts_per_step steps",
          hint="use --steps (one pass = problems / --prompts_per_step)"),
    Alias("max_steps", "TRL", None, f"{STEPS}: use --steps",
          hint="counts optimizer steps: use --steps (rollout + update)"),
    Alias("save_steps", "TRL", None, f"{STEPS}: use --save_every (steps)",
          hint="counts optimizer steps: use --save_every (steps)"),
    Alias("eval_steps", "TRL", None, f"{STEPS}: use --eval_every (steps)",
          hint="counts optimizer steps: use --eval_every (steps)"),
    Alias("logging_steps", "TRL", None, "every step is logged (metrics.jsonl and --report_to)",
          hint="every step is logged"),
    Alias("warmup_steps", "TRL", None, f"{STEPS}: use --warmup_ratio F, the warmup's share of --steps",
          hint="counts optimizer steps: use --warmup_ratio"),
    Alias("max_prompt_length", "TRL", None, "TRL truncates longer prompts from the left; here "
          "--max_prompt_tokens N skips them (counted: a cut math problem is another problem)",
          hint="truncates prompts: --max_prompt_tokens skips them"),
    Alias("scale_rewards", "TRL", None, "the advantage is the method's: --method grpo ((r − mean)/std) or "
          "drgrpo (r − mean)",
          hint="the advantage is the method's: --method grpo or drgrpo"),
    Alias("fp16", "TRL", None, "fp16 is not offered: --precision bf16, bf16-autocast or fp32",
          hint="use --precision bf16, bf16-autocast or fp32"),
    # ---- verl (its hydra config's paths) ----
    Alias("data.train_files", "verl", "train_data", "verl's name for --train_data"),
    Alias("data.val_files", "verl", "eval_data", "verl's name for --eval_data"),
    Alias("data.train_batch_size", "verl", "prompts_per_step", "verl's prompts per step: --prompts_per_step"),
    Alias("data.max_response_length", "verl", "max_new_tokens", "verl's name for --max_new_tokens"),
    Alias("data.prompt_key", "verl", "prompt_column", "verl's name for --prompt_column"),
    Alias("data.max_prompt_length", "verl", None, "verl truncates or refuses longer prompts "
          "(data.truncation); here --max_prompt_tokens N skips them (counted)"),
    Alias("actor_rollout_ref.model.path", "verl", "model", "verl's name for --model"),
    Alias("actor_rollout_ref.model.enable_gradient_checkpointing", "verl", "gradient_checkpointing",
          "verl's name for --gradient_checkpointing"),
    Alias("actor_rollout_ref.actor.optim.lr", "verl", "lr", "verl's name for --lr"),
    Alias("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "verl", "warmup_ratio",
          "verl's name for --warmup_ratio"),
    Alias("actor_rollout_ref.actor.optim.warmup_style", "verl", "lr_schedule",
          "verl's name for --lr_schedule", kind=str,
          convert=mapped(LR_SCHEDULES, "actor_rollout_ref.actor.optim.warmup_style")),
    Alias("actor_rollout_ref.actor.optim.weight_decay", "verl", "weight_decay",
          "verl's name for --weight_decay"),
    Alias("actor_rollout_ref.actor.clip_ratio", "verl", "clip_low",
          "verl's clip ratio: --clip_low, and --clip_high too unless clip_ratio_high / --clip_high is given"),
    Alias("actor_rollout_ref.actor.clip_ratio_low", "verl", "clip_low", "verl's name for --clip_low"),
    Alias("actor_rollout_ref.actor.clip_ratio_high", "verl", "clip_high", "verl's name for --clip_high"),
    Alias("actor_rollout_ref.actor.ppo_epochs", "verl", "ppo_epochs", "verl's name for --ppo_epochs"),
    Alias("actor_rollout_ref.actor.grad_clip", "verl", "max_grad_norm", "verl's name for --max_grad_norm"),
    Alias("actor_rollout_ref.actor.kl_loss_coef", "verl", "kl_beta",
          "verl's KL loss coefficient (its low_var_kl is k3): --kl_beta"),
    Alias("branch_budget", "DATPO", "branch_length", "this project's earlier name for --branch_length"),
    Alias("actor_rollout_ref.actor.loss_agg_mode", "verl", "loss_norm",
          "verl's token-mean = --loss_norm token", kind=str,
          convert=mapped({"token-mean": "token"}, "actor_rollout_ref.actor.loss_agg_mode")),
    Alias("actor_rollout_ref.actor.ppo_mini_batch_size", "verl", None,
          "verl counts prompts per mini-batch; here --mini_batch_size counts blocks per optimizer step"),
    Alias("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "verl", None,
          "here a micro-batch is sized in tokens: --max_tokens_per_micro_batch (rows layout: "
          "--micro_batch_size)"),
    Alias("actor_rollout_ref.rollout.n", "verl", "group_size",
          "verl's responses per prompt: --group_size for grpo/drgrpo; refused for tree methods (--n_base)"),
    Alias("actor_rollout_ref.rollout.temperature", "verl", "temperature", "verl's name for --temperature"),
    Alias("actor_rollout_ref.rollout.top_p", "verl", "top_p", "verl's name for --top_p"),
    Alias("actor_rollout_ref.rollout.top_k", "verl", "top_k", "verl's name for --top_k (-1 = off: 0 here)",
          kind=int, convert=lambda k: 0 if k == -1 else k),
    Alias("algorithm.adv_estimator", "verl", "method", "verl's grpo = --method grpo", kind=str,
          convert=mapped({"grpo": "grpo"}, "algorithm.adv_estimator")),
    Alias("trainer.total_training_steps", "verl", "steps", "verl's name for --steps (a step: one rollout "
          "batch and its update, as verl's)"),
    Alias("trainer.total_epochs", "verl", None, "use --steps: one step is --prompts_per_step prompts"),
    Alias("trainer.save_freq", "verl", "save_every", "verl's name for --save_every"),
    Alias("trainer.test_freq", "verl", "eval_every", "verl's name for --eval_every"),
    Alias("trainer.default_local_dir", "verl", "out_dir", "verl's name for --out_dir"),
]
BY_NAME = {a.name: a for a in ALIASES}
BOTH_CLIPS = {"epsilon": "epsilon_high",      # sets clip_high too unless this one is given
              "actor_rollout_ref.actor.clip_ratio": "actor_rollout_ref.actor.clip_ratio_high"}
GROUP_SIZE = ("num_generations", "actor_rollout_ref.rollout.n")
HYDRA_PAIR = re.compile(r"\+?([A-Za-z_][\w]*(?:\.[\w]+)+)=(.*)", re.DOTALL)


def dest(alias: Alias) -> str:
    """The argparse destination of a foreign flag (never a field's name)."""
    return "alias:" + alias.name


def hydra_pairs(argv: list[str]) -> list[str]:
    """verl's KEY=VALUE overrides written as flags (`data.train_batch_size=16` becomes
    `--data.train_batch_size 16`); other words are left as they are (argparse names them)."""
    out = []
    for word in argv:
        match = HYDRA_PAIR.fullmatch(word)
        if match and match.group(1) in BY_NAME:
            out += ["--" + match.group(1), match.group(2)]
        else:
            out.append(word)
    return out


def resolve(foreign: dict[str, object], given: dict, parallel: bool) -> dict:
    """Our fields from the foreign flags given ({name: value as parsed}). `given`: our own flags (a foreign
    name and ours for one field, both given, are refused); `parallel`: whether the run's method samples
    parallel groups (GRPO, Dr.GRPO). Raises ValueError, one line, for a refused name or value."""
    out: dict = {}
    for name, value in foreign.items():
        alias = BY_NAME[name]
        if alias.field is None:
            raise ValueError(f"--{name} ({alias.source}): {alias.note}")
        if name in GROUP_SIZE and not parallel:
            raise ValueError(f"--{name} ({alias.source}'s completions per prompt) sets --group_size, which "
                             f"only grpo and drgrpo sample; a tree method's completions per prompt follow "
                             f"V(root): --n_base N base responses, each with up to --k_max x --b_max "
                             f"branches (the paper: 4, 3, 4)")
        value = alias.convert(value) if alias.convert else value
        fields = [alias.field]
        if name in BOTH_CLIPS and BOTH_CLIPS[name] not in foreign and "clip_high" not in given:
            fields.append("clip_high")   # TRL's epsilon_high / verl's clip_ratio_high default to it
        for field_name in fields:
            if field_name in given:
                raise ValueError(f"--{name} ({alias.source}'s name) and --{field_name} both set "
                                 f"{field_name}; expected one of them")
            if field_name in out and out[field_name] != value:
                raise ValueError(f"--{name} and another name for --{field_name} disagree; expected one of "
                                 f"them")
            out[field_name] = value
    return out
