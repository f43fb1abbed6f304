"""config.py — every knob of a run in one dataclass, and named presets:
the rows of the paper's tables.

Defaults are the paper's DATPO run on Qwen2.5-3B-Base (Appendix F.2 "Implementation Details" and
"Training Hyperparameters"). Where the paper is silent we take the authors' released config
(colin31472/DATPO, config.yaml) and say so next to the field.

    python train.py --preset demo --steps 10 --fork tok-entropy --out_dir runs/x

Every field can be set as `--<field_name> VALUE` (harness/cli.py); values are checked (checks.py),
and an unknown flag or a bad value is one line that says what is valid.

Where a value comes from, lowest to highest (a later one wins the field):

    Config's default  <  the scale's row (SCALES)  <  the method's settings (methods.py)
      <  the preset's row (ROWS)
      <  --config FILE or --resume RUN (a run's config.json: every field)
      <  the command line

The method sits above the scale so that TreeRL stays (6, 2, 2) with tok-entropy forks at any scale.
Ablations: edit a default in `Config` below; it reaches every run whose rows leave that field alone
(the paper's, and --preset teach for the algorithm's knobs). A row that sets it wins, and the run
says so at start, one line per field ("b_max = 3 in config.py → 2 from scale demo";
harness/edits.py). Three recipes on `--preset teach`, what each shows in minutes (README
"Ablations"):

    adaptive: bool = False    K̂, B̂ stay (K_max, B_max): easy prompts grow full trees (Sec. 4.1)
    fork: str = "random"      forks anywhere, not at the starts of high-entropy sentences (App. D)
    alpha_start: float = 0.4  twice the diversity bonus on every block with Â_base > 0 (Eq. 4)
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import checks
import methods


@dataclass
class Config:
    # ---- model and data --------------------------------------------------------------------------
    method: str = "datpo"                   # datpo | grpo | drgrpo | treerl | attnrl (Sec. 5.1
                                            # "Baselines"): a methods.py row, which brings the
                                            # settings that define it
    model: str = "Qwen/Qwen2.5-3B"          # HF name, local folder, or "smollm2-135m"
                                            # (embedded, offline)
    train_data: str = "math-train"          # a named set, a .jsonl/.json/.parquet/.csv file or an
                                            # HF dataset owner/name[:split] (data.load_problems);
                                            # the paper: math-train, 12,000 MATH problems (App. F.1)
    prompt_style: str = "release"           # release: the authors' plain-text prompt, what their
                                            # runs used; chat: the tokenizer's chat template; plain:
                                            # Q/A; verbatim: the text as it is (TRL's rule).
                                            # Conversational rows: their template
    few_shot: bool = False                  # prepend one worked example (the 135M demo needs it)
    answer_fallback: bool = False           # grade the last number when there is no \boxed{}
                                            # (demo only)
    reward: list[str] = field(default_factory=list)  # FILE.py:FUNCTION or module:function with
                                            # TRL's signature (harness/custom_reward.py); empty: the
                                            # math grader (Sec. 5.1), which evaluation always uses
    reward_weights: list[float] = field(default_factory=list)  # one weight per --reward (TRL's
                                            # reward_weights); empty: 1 each
    dataset_config: str = ""                # an HF hub --train_data / --eval_data's config name
                                            # ("" = its default)
    prompt_column: str = ""                 # the prompt's column; "" = problem, question or prompt
                                            # (a conversational prompt, TRL's format, first)
    answer_column: str = ""                 # the gold answer's column; "" = answer, final_answer or
                                            # solution (its last \boxed{}, else the answer
                                            # math-verify finds in it)

    # ---- rollout and tree (Sec. 4.1, App. C/D) ---------------------------------------------------
    n_base: int = 4                         # N base responses per prompt
    k_max: int = 3                          # K_max forking points per base response
    b_max: int = 4                          # B_max branches per forking point
    adaptive: bool = True                   # K̂ = ⌈K_max(1−V)⌉, B̂ = ⌈B_max(1−V)⌉;
                                            # False: (K_max, B_max)
    fork: str = "sent-entropy"              # forking strategy (App. D, Alg. "Forking Points
                                            # Selection")
    fork_keeps_token: bool = True           # x_f = [q; τ_{1:f}]: the branch samples after the
                                            # chosen token (App. C); False:
                                            # the chosen token is resampled
    fork_min_dist: float = 0.0              # tok-entropy distance forcing, of length
                                            # (App. D.4: .05, .10)
    atb_quantile: float = 0.8               # ATB candidates: FCI at or above this quantile
                                            # (App. D.1)
    atb_gap: int = 4                        # FCI counts attention from steps ≥ this many later
                                            # (AttnRL Δ)
    group_size: int = 16                    # G for grpo / drgrpo (parallel sampling, App. F.2)
    attnrl_lambda: float = 0.9              # AttnRL dynamic batch size EMA weight λ (App. F.2)

    # ---- sampling --------------------------------------------------------------------------------
    temperature: float = 1.0                # of rollouts and evaluation (App. F.1: 1.0)
    top_p: float = 1.0                      # 1.0 = off (paper samples from the full distribution)
    top_k: int = 0                          # 0 = off
    max_new_tokens: int = 1024              # per generation, base or branch (App. F.2)
    branch_length: str = "full"             # full: a branch may add max_new_tokens (App. F.2, the
                                            # release; a path can reach f + max_new_tokens);
                                            # remaining: max − f
    max_prompt_tokens: int = 0              # >0: longer prompts are skipped and counted; 0 = keep
                                            # all (the release defines max_prompt_len 256 but never
                                            # reads it)
    gen_batch_size: int = 64                # base responses generated per generate() call
    branch_chunk_size: int = 384            # branch rollouts per generate() call
                                            # (App. F.2: 384 for 3B)
    rollout_engine: str = "engine"          # engine: engine/'s decode loop (prefixes shared, rows
                                            # leave when they end); generate: HF generate (the
                                            # reference path)
    max_batch_rows: int = 0                 # engine: rows at once; 0 = max(gen_batch_size,
                                            # branch_chunk_size)
    max_kv_tokens: int = 0                  # engine: KV pool tokens; 0 = the step's
                                            # prompts + max_batch_rows × max_new_tokens (prefixes
                                            # shared; rows that don't fit wait)
    compile_decode: bool = False            # engine: reference decode steps through torch.compile
    decode_step: str = "auto"               # engine: auto (paged on CUDA, shared on CPU) |
                                            # reference | shared | paged | paged-eager
    off_policy_steps: int = 0               # 1: AttnRL's one-step off-policy (offpolicy.py): step
                                            # t+1's base responses decode in step t's rollout; 0:
                                            # on-policy

    # ---- advantage (Sec. 4.2, App. E) ------------------------------------------------------------
    alpha_start: float = 0.2                # α of Eq. 4 (the sibling-diversity bonus) at the first
                                            # step, annealed linearly to --alpha_end
    alpha_end: float = 0.0                  # α at the last step (Table "alpha")
    alpha_scope: str = "positive"           # bonus only where A_base > 0 ("all" = the ablation)
    value_estimate: str = "paper"           # paper: V_MC(s) over every terminal block below s
                                            # (App. E.1); release: a fork's B̂ branches only,
                                            # V(root) = mean of N base
    sibling_groups: str = "paper"           # Div_sib's siblings: paper = same start state (Eq. 10);
                                            # release = the authors' code's (release.py)
    embed_model: str = "sentence-transformers/all-mpnet-base-v2"  # sentence embedder of Div_sib:
                                            # App. F.5's all-mpnet-base-v2 (no remote code);
                                            # "all-minilm-l6-v2" (embedded, offline); the paper's
                                            # gte-large-en-v1.5 (F.2) runs hub code:
                                            # needs --trust_remote_code true
    embed_batch_size: int = 64              # texts per embedder call
    trust_remote_code: bool = False         # let --model / --embed_model folders run their own
                                            # Python code (HF auto_map); off: a model that needs it
                                            # is refused in one line

    # ---- update (App. F.2 "Training Hyperparameters") --------------------------------------------
    lr: float = 5e-6                        # AdamW learning rate (App. F.2: 5e-6, constant)
    lr_schedule: str = "constant"           # after the warmup: constant (the paper) | linear |
                                            # cosine decay towards 0 at --steps; set per training
                                            # step (optim.lr_at)
    warmup_ratio: float = 0.0               # fraction of --steps over which the lr rises linearly
                                            # to --lr (0 = none, the paper)
    beta1: float = 0.9                      # AdamW β1
    beta2: float = 0.999                    # AdamW β2
    weight_decay: float = 0.0               # AdamW weight decay; paper silent,
                                            # authors' release uses 0.0
    optimizer_dtype: str = "param"          # AdamW states: param = the weights' dtype (the
                                            # release's); fp32 = fp32 moments + master copy
                                            # (optim.py; for new work)
    clip_low: float = 0.2                   # PPO clip ε for ratio < 1
    clip_high: float = 0.2                  # PPO clip ε for ratio > 1 (GRPO clip-higher: 0.28)
    max_grad_norm: float = 1.0              # gradient-norm clip; paper silent,
                                            # authors' release uses 1.0
    kl_beta: float = 0.0                    # β of a per-token KL penalty to the initial policy
                                            # (TRL's beta, k3; kl.py); 0 = none and no reference
                                            # model (the paper)
    loss_norm: str = "token"                # token: / total tokens (DAPO, Eq. DATPO); constant:
                                            # Dr.GRPO
    ppo_epochs: int = 2                     # passes over a step's blocks; paper silent,
                                            # authors' release: 2
    prompts_per_step: int = 16              # prompts sampled per step (App. F.2: 16)
    mini_batch_size: int = 64               # blocks per optimizer step (App. F.2 counts blocks: 64)
    mini_batch_grouping: str = "trees"      # trees: whole trees shuffled per epoch,
                                            # ~mini_batch_size blocks; blocks: random blocks
                                            # (the release; re-forwards shared context)
    train_layout: str = "packed"            # packed: each tree once under a tree mask; rows:
                                            # a row per leaf
    max_tokens_per_micro_batch: int = 8192  # packed layout: tokens per forward/backward
                                            # (accumulated)
    micro_batch_size: int = 2               # rows layout: rows per forward/backward (App. F.2: 2)
    packed_attention: str = "auto"          # auto: flex_attention on CUDA, else tree (SDPA per
                                            # segment over its ancestors); dense: one [L, L] mask
                                            # (the reference path)
    precision: str = "bf16"                 # bf16: pure bf16 weights and AdamW (the release's) |
                                            # bf16-autocast: fp32 weights (TRL's bf16=True) | fp32
    gradient_checkpointing: bool = True     # recompute activations in backward: at paper scale the
                                            # update peaks at 32 GB, not 68 GB
                                            # (bench_update.memory_table)
    steps: int = 750                        # one pass over 12,000 problems at 16 per step

    # ---- evaluation (Sec. 5.1) -------------------------------------------------------------------
    eval_data: str = "math500"              # held-out set, a --train_data source
                                            # (App. F.1: MATH500)
    eval_every: int = 40                    # steps; 0 = never (authors' release: 40)
    eval_limit: int = 0                     # problems; 0 = all
    eval_k: int = 8                         # samples per problem for avg@k during training
    eval_max_new_tokens: int = 2048         # new tokens per evaluation sample (App. F.1: 2048)

    # ---- run -------------------------------------------------------------------------------------
    seed: int = 0                           # data order, sampling, forks, mini-batches:
                                            # a run repeats
    device: str = "auto"                    # where the model runs: auto | cpu | cuda | cuda:N
    threads: int = 0                        # torch CPU threads; 0 = torch default
    out_dir: str = ""                       # the run folder; "" = runs/<preset>[-<scale>]
    save_every: int = 100                   # steps; 0 = only at the end
    keep_checkpoints: int = 0               # keep the newest N checkpoints, delete older ones;
                                            # 0 = keep all
    resume: str = ""                        # run folder (its latest checkpoint) or checkpoint;
                                            # alone, the run continues with its config.json
                                            # (other flags: changes)
    overwrite: bool = False                 # a new run into a folder holding a run replaces it
                                            # (else: error)
    allow_config_change: bool = False       # --resume with experiment-changing fields changed
                                            # (else an error)
    max_bad_steps: int = 5                  # stop after this many steps in a row with a non-finite
                                            # loss/grad
    guard_weights: bool = True              # undo an update that makes a weight or the logits
                                            # non-finite (guards.WeightGuard: a host copy of the
                                            # state per step)
    max_reward_error_share: float = 0.05    # a reward call that raises scores 0
                                            # (RUN/reward_errors.jsonl); stop when one function
                                            # fails on more than this share of a step's responses
                                            # (a benchmark's samples) (reward_guard.py)
    stop_timeout: float = 0.0               # s after SIGTERM/SIGINT to give up the step in
                                            # progress; 0 = wait
    parallel: str = "fsdp"                  # under torchrun: fsdp | hsdp (FSDP2 fully_shard) | ddp
                                            # (distributed.py)
    report_to: list[str] = field(default_factory=lambda: ["none"])  # experiment trackers: none |
                                            # tensorboard | wandb (several: a list)
    log_trees_every: int = 0                # steps; RUN/trees/step_XXXXXX.jsonl at step 1 and every
                                            # N; 0 = never
    log_completions_every: int = 0          # steps; every leaf's completion as a table in the
                                            # trackers (the console without one) at step 1 and every
                                            # N (TRL's log_completions); 0 = never

    def validate(self) -> "Config":
        """Raise ValueError naming the field and what is valid (checks.py: every choice in its list,
        every number in its range, no combination that cannot run); return self for chaining."""
        checks.validate(self)
        return self

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


# --------------------------------------------------------------------------------------------------
# Presets. Two independent axes:
#   --scale   how big a run is (model, data, lengths, batch sizes, steps):
#             paper | demo | teach | tiny
#   --preset  which row of the paper's tables to run (method, tree shape, forks, alpha, clip, ...)
# `--preset demo`, `teach` and `tiny` are DATPO at that scale; `--preset treerl --scale demo` is
# TreeRL on the CPU demo, `--preset treerl` (paper scale) is the paper's TreeRL row. Later flags
# override both.
# --------------------------------------------------------------------------------------------------
SCALES: dict[str, dict] = {
    # The paper's runs on one A100: the dataclass defaults.
    "paper": {},
    # Two CPU cores, offline: the embedded SmolLM2-135M-Instruct and MiniLM embedder on synthetic
    # arithmetic it can learn (measured: one worked example gives it a reward signal; with a plain
    # GRPO loop lr 1e-5 was steady, 3e-5 peaked early then drifted).
    "demo": dict(
        model="smollm2-135m", train_data="arith-train", eval_data="arith-test", few_shot=True,
        prompt_style="chat", embed_model="all-minilm-l6-v2", n_base=4, k_max=2, b_max=2,
        max_new_tokens=64, max_prompt_tokens=512, prompts_per_step=8, mini_batch_size=64,
        micro_batch_size=16,
        max_tokens_per_micro_batch=2048,   # ~2.5 demo trees: forwarded/unique ≤ 1.05
                                           # (bench/bench_update.py)
        gen_batch_size=64, branch_chunk_size=64, ppo_epochs=1, lr=1e-5, steps=24, eval_every=24,
        eval_limit=64, eval_k=4, eval_max_new_tokens=64, save_every=8, threads=2, log_trees_every=4,
        precision="fp32",   # this CPU has no AMX: bf16 matmuls run slower than fp32 here (measured)
        gradient_checkpointing=False,      # a 135M model's activations fit; no recompute on 2 cores
    ),
    # Tests: a tiny random model, a handful of tokens. Token-entropy forks: a random model's text
    # has no sentences to speak of.
    "tiny": dict(
        model="tiny-random", train_data="arith-train", eval_data="arith-test",
        embed_model="all-minilm-l6-v2", prompt_style="chat",
        n_base=2, k_max=2, b_max=2, fork="tok-entropy", group_size=4, max_new_tokens=12,
        max_prompt_tokens=512, prompts_per_step=2, mini_batch_size=8, micro_batch_size=4,
        max_tokens_per_micro_batch=256, gen_batch_size=8, branch_chunk_size=8,
        ppo_epochs=1, lr=1e-3, steps=2, eval_every=0, eval_limit=4, eval_k=2,
        eval_max_new_tokens=12, save_every=1, precision="fp32", device="cpu",
        gradient_checkpointing=False,
    ),
}
# A class: the demo made small enough to see an ablation in minutes on 2 cores (README "Ablations"):
# 4 prompts a step, 4 steps, every tree logged (python -m harness.viz), 16 held-out problems before
# and after; mini-batches of 16 blocks, so a step takes a few AdamW steps and the clip acts. It sets
# no algorithm knob (fork, adaptive, alpha_*, ...): edits of Config's defaults take effect on it.
SCALES["teach"] = dict(SCALES["demo"], max_new_tokens=48, prompts_per_step=4, mini_batch_size=16,
                       steps=4, eval_every=4, eval_limit=16, eval_k=2, eval_max_new_tokens=48,
                       save_every=0, log_trees_every=1)

# Rows of the paper's tables: algorithm settings only (the scale comes from SCALES). A row that
# names a method gets that method's own settings first (methods.py: TreeRL's forks and (6, 2, 2),
# GRPO's clip-higher, ...), so `--preset treerl` and `--method treerl` are the same run.
ROWS: dict[str, dict] = {
    # Table "main results" (Sec. 5.2)
    "paper": {},                        # DATPO (4,3,4), sent-entropy, α 0.2→0
    # "The paper as run": the paper plus every behaviour of the authors' release that is not a bug
    # (docs/decisions.md, release.py). Where the paper is silent the defaults already follow the
    # release (prompt, bf16, branch length).
    "release": dict(value_estimate="release", sibling_groups="release",
                    mini_batch_grouping="blocks"),
    "grpo": dict(method="grpo"),
    "drgrpo": dict(method="drgrpo"),
    "treerl": dict(method="treerl"),
    "attnrl": dict(method="attnrl"),
    # Table "wall clock" (App. F.3): "DATPO w/ one-step off-policy", AttnRL's pipeline
    # (offpolicy.py)
    "datpo-off-policy": dict(off_policy_steps=1),
    # Table "forking strategies" (Sec. 5.4) and App. D.4 (distance-forced token entropy)
    "datpo-fork-random": dict(fork="random"),
    "datpo-fork-fixed-seg": dict(fork="fixed-seg"),
    "datpo-fork-atb": dict(fork="atb"),
    "datpo-fork-tok-entropy": dict(fork="tok-entropy"),
    "datpo-fork-tok-entropy-dist05": dict(fork="tok-entropy", fork_min_dist=0.05),
    "datpo-fork-tok-entropy-dist10": dict(fork="tok-entropy", fork_min_dist=0.10),
    # Table "alpha" (Sec. 5.4)
    "datpo-alpha-0-0": dict(alpha_start=0.0, alpha_end=0.0),
    "datpo-alpha-0.4-0": dict(alpha_start=0.4, alpha_end=0.0),
    "datpo-alpha-0.2-0-all": dict(alpha_scope="all"),
    "datpo-alpha-0.2-0.2": dict(alpha_start=0.2, alpha_end=0.2),
    "datpo-alpha-0.2-neg0.2": dict(alpha_start=0.2, alpha_end=-0.2),
    # Table "difficulty-adaptive" (App. F.5): fixed (N, K, B) = (6, 2, 2)
    "datpo-nonadaptive": dict(adaptive=False, **methods.TREE_BASELINE),
    # Table "wider topology" (App. F.6): the baselines with DATPO's (4, 3, 4)
    "treerl-434": dict(method="treerl", n_base=4, k_max=3, b_max=4),
    "attnrl-434": dict(method="attnrl", n_base=4, k_max=3, b_max=4),
    # Sec. 3.1 / App. B: the difficulty study's G sweep (python -m studies difficulty). GRPO-Zero
    # style: 256 samples per step = one on-policy mini-batch, so θ_old = θ, the ratio is 1 and the
    # clip never acts (a plain token-level policy gradient, no KL); 5 epochs over a 1,400-problem
    # subset; evaluated afterwards (difficulty-report). The clip stays symmetric (0.2), as these
    # rows were measured with: at paper scale it never acts; at smaller scales a row keeps the
    # numbers it gave. The batch sizes apply at paper scale only (`at_paper_scale`);
    # smaller scales keep their own.
    **{f"grpo-g{g}": dict(method="grpo", group_size=g, ppo_epochs=1, eval_every=0, clip_high=0.2,
                          at_paper_scale=dict(
        prompts_per_step=256 // g, mini_batch_size=256, steps=math.ceil(5 * 1400 / (256 // g))))
       for g in (4, 8, 16)},
    # Table "embedding models" (App. F.5)
    "datpo-embed-mpnet": dict(embed_model="sentence-transformers/all-mpnet-base-v2"),
    "datpo-embed-bge-m3": dict(embed_model="BAAI/bge-m3"),
    "datpo-embed-gte-base": dict(embed_model="Alibaba-NLP/gte-base-en-v1.5"),
}

# --preset NAME → (scale, row). The scale names are also presets: DATPO at that scale.
PRESETS: dict[str, tuple[str, str]] = {name: ("paper", name) for name in ROWS}
PRESETS.update({"demo": ("demo", "paper"), "tiny": ("tiny", "paper"), "teach": ("teach", "paper")})


def layers(preset: str = "paper", scale: str | None = None, method: str | None = None
           ) -> list[tuple[str, dict]]:
    """The rows a preset lays over Config's defaults, in order, each named: the scale's, the
    method's own settings (methods.py), the preset's row (and its paper-scale sizes). A later row
    wins a field; `method` (a --method given) picks the method's settings instead of the row's."""
    if preset not in PRESETS:
        raise ValueError(f"--preset: got {preset!r}, expected one of {', '.join(PRESETS)}")
    default_scale, row = PRESETS[preset]
    scale = scale or default_scale
    if scale not in SCALES:
        raise ValueError(f"--scale: got {scale!r}, expected one of {', '.join(SCALES)}")
    row_values = dict(ROWS[row])
    at_paper = row_values.pop("at_paper_scale", {})     # a row's sizes that only make sense at
                                                        # paper scale
    method = method or row_values.get("method", Config.method)
    defining = (methods.METHODS[method].settings if method in methods.METHODS
                else {})   # else: validate says
    return [(f"scale {scale}", SCALES[scale]), (f"method {method} (methods.py)", defining),
            (f"preset {row}", row_values),
            (f"preset {row} at paper scale", at_paper if scale == "paper" else {})]


def make_config(preset: str = "paper", scale: str | None = None, **overrides) -> Config:
    """A validated Config: Config's defaults, then the rows of `layers` (scale, method, preset),
    then field overrides. Which row set each field is kept as `cfg.set_by` (harness/edits.py names
    an edited default a row overrode)."""
    stack = layers(preset, scale, overrides.get("method"))
    values = {name: value for _, row in stack for name, value in row.items()}
    values.update(overrides)
    if not values.get("out_dir"):
        scale = stack[0][0].removeprefix("scale ")
        values["out_dir"] = f"runs/{preset}" + ("" if scale == PRESETS[preset][0] else f"-{scale}")
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ValueError(f"unknown config field(s) {unknown}; valid fields: "
                         f"{', '.join(f.name for f in dataclasses.fields(Config))}")
    cfg = Config(**values).validate()
    cfg.set_by = {name: where for where, row in stack for name in row}
    cfg.set_by.update(dict.fromkeys(overrides, "make_config's overrides"))
    return cfg
