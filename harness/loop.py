"""harness/loop.py — the harness around Algorithm DATPO's step: set-up, the loop, evaluation, checkpoints.

train.py holds the algorithm (train_step, ppo_update); `train.train(cfg)` hands its step to `loop.train`,
which does everything a run needs that is not the algorithm:

  setup              pre-flight checks (each user mistake one line, before anything slow runs), the run folder
                     (locked) and its log, data, models, optimizer, the flex probe, fault injection
                     (harness/inject.py), and with --resume the checkpoint's weights and trainer state
  the loop           step after step: the metrics line, the non-finite guard, evaluation every --eval_every
                     steps, a checkpoint every --save_every steps, stop signals (harness/signals.py)
  RunState / Setup   what the loop carries from step to step (saved whole in checkpoints) / what every step
                     uses and none changes
  save_checkpoint    weights (safetensors), tokenizer, optimizer and trainer state, written atomically
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import attention
import config as C
import data
import engine as E
import evaluate
import methods as M
import models
import offpolicy
import optim as O
import tree as T
from advantage import BlockScore
from harness import custom_reward, faults, guards, inject, runs, signals, tracking
from harness import distributed as D
from harness.journal import Stopped
from harness.tracking import Log


@dataclass
class RunState:
    """What the loop carries from one step to the next; a checkpoint saves and restores it whole."""
    step: int = 0                   # steps done
    cursor: int = 0                 # position in the endless stream of shuffled problems (problem_index)
    skipped_prompts: int = 0        # prompts longer than --max_prompt_tokens, so far
    batch_size: int = 0             # prompts per step: cfg.prompts_per_step, or AttnRL's dynamic batch size
    bad_steps_in_a_row: int = 0     # steps with a non-finite loss or gradient (nonfinite_guard)
    rng: random.Random = field(default_factory=random.Random)   # fork choice, mini-batch order
    # problems skipped as longer than --max_prompt_tokens (named once)
    too_long: set = field(default_factory=set)
    ahead: offpolicy.Batch | None = None   # one-step off-policy: the next step's prompts, their bases sampled
    pending_eval: str | None = None   # "during"/"after": that evaluation a stop skipped; a resume runs it

    def trainer_state(self, rng: dict | None = None) -> dict:
        """The checkpoint's trainer_state.pt fields (besides the optimizer and the config). `rng`: the RNG
        states to save instead of the current ones (a skipped evaluation's: as it found them)."""
        return {"step": self.step, "cursor": self.cursor, "skipped_prompts": self.skipped_prompts,
                "batch_size": self.batch_size, "bad_steps_in_a_row": self.bad_steps_in_a_row,
                "rng": rng or rng_state(self.rng), "too_long": sorted(self.too_long),
                "ahead": self.ahead.to_state() if self.ahead else None,
                **({"pending_eval": self.pending_eval} if self.pending_eval else {})}

    def restore(self, state: dict) -> None:
        """Back to a checkpoint's trainer state (older checkpoints lack the later fields)."""
        self.step, self.cursor = state["step"], state["cursor"]
        self.skipped_prompts = state.get("skipped_prompts", 0)
        self.batch_size = state.get("batch_size", self.batch_size)
        self.bad_steps_in_a_row = state.get("bad_steps_in_a_row", 0)
        self.too_long = set(state.get("too_long", ()))
        self.ahead = offpolicy.Batch.from_state(state.get("ahead"))
        self.pending_eval = state.get("pending_eval")
        set_rng_state(self.rng, state["rng"])


@dataclass
class Setup:
    """What every step uses and none changes: the config and its method row, the models, the data, the run."""
    cfg: C.Config
    method: M.Method
    device: torch.device
    run_dir: Path
    log: Log
    model: torch.nn.Module          # the HF model (generation, evaluation, checkpoints)
    policy: torch.nn.Module         # what the update runs: `model`, or under torchrun its FSDP2/DDP form
    tokenizer: object
    optimizer: torch.optim.Optimizer
    guard: guards.WeightGuard       # undoes an update that breaks the weights (--guard_weights)
    embedder: object                # sentence embedder for Div_sib, or None when α is 0 all run
    problems: list[dict]
    eval_problems: list[dict]
    # the rollout engine's sizes after running out of memory
    backoff: E.Backoff = field(default_factory=E.Backoff)
    reward: custom_reward.Rewards | None = None   # --reward's functions; None: the grader

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------
def train(cfg: C.Config, step: Callable[[Setup, RunState], dict]) -> Path:
    """Run (or resume) training with `step` (train.train_step: one step of the algorithm, its metrics record
    returned); returns the run folder. The first SIGTERM/SIGINT stops it at the end of the
    step with a checkpoint (signals.GracefulStop; a second signal, or --stop_timeout seconds without reaching
    the end of the step, stops at once); --resume then continues exactly. `held`: the run lock (runs.RunLock),
    released on the way out whatever happens."""
    with signals.GracefulStop(timeout=cfg.stop_timeout) as stop, contextlib.ExitStack() as held:
        return _train(cfg, step, stop, held)


def _train(cfg: C.Config, step: Callable, stop: signals.GracefulStop, held: contextlib.ExitStack) -> Path:
    t_run = time.perf_counter()
    s, run = setup(cfg, held)
    if s is None:   # a resume with nothing left to run (setup said so)
        return Path(cfg.out_dir)
    start_step, log = run.step, s.log
    if cfg.eval_every and start_step == 0:   # a signal during set-up skips it (the loop then stops at once)
        run_eval(s, "before", 0, stop)
    pending = run.pending_eval
    if pending:   # a stop skipped it before the checkpoint: run it now, as an uninterrupted run did
        run_pending_eval(s, run, stop)
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc=cfg.method,
               dynamic_ncols=True, disable=not D.is_main())
    for _ in bar:
        if D.any_rank(stop.requested):   # the signal came before any step ran: nothing new to save
            log.say(f"stopped by {stop.requested} before step {run.step + 1}")
            return s.run_dir
        inject.crash_point("step")
        lr = O.schedule_lr(s.optimizer, cfg, run.step)   # --lr_schedule, --warmup_ratio (optim.lr_at)
        record = {**step(s, run), **lr, **custom_reward.step_means(s.reward)}
        run.bad_steps_in_a_row = record["bad_steps_in_a_row"] = (
            run.bad_steps_in_a_row + 1 if record["nonfinite_minibatches"] or record["nonfinite_updates"]
            else 0)
        log.write(record)
        nonfinite_guard(s, run, record)
        bar.set_postfix(reward=f"{record['reward']:.2f}", v_root=f"{record['v_root']:.2f}",
                        leaves=f"{record['leaves_per_prompt']:.1f}", loss=f"{record['loss']:.3f}")
        stopping = D.any_rank(stop.requested)   # torchrun: every rank stops at the same step
        if stopping:
            stop.cancel_timeout()   # the safe point is reached: --stop_timeout no longer applies
        saved, stopping = evaluate_and_save(s, run, stop, stopping)
        if stopping and run.step < cfg.steps:
            bar.close()
            log.say(f"stopped by {stop.requested} after step {run.step}: checkpoint {saved}; continue with "
                    f"the same command plus --resume {s.run_dir}")
            return s.run_dir
    bar.close()
    finish(s, start_step < cfg.steps or bool(pending), t_run)
    return s.run_dir


def run_pending_eval(s: Setup, run: RunState, stop: signals.GracefulStop) -> None:
    """The evaluation a stop skipped at the checkpoint's step (RunState.pending_eval), from the RNG state it
    would have found (saved in the checkpoint): the same samples and numbers as an uninterrupted run, and the
    RNG after it the same for the steps that follow. A resume from that checkpoint always runs it (the RNG
    needs it); its record is written once (an earlier resume may have written it before being killed)."""
    logged = any(r.get("eval") == run.pending_eval and r.get("step") == run.step for r in s.log.read())
    if run_eval(s, run.pending_eval, run.step, stop, write=not logged) is not None:
        run.pending_eval = None


# --------------------------------------------------------------------------------------------------------
# Before the first step
# --------------------------------------------------------------------------------------------------------
def setup(cfg: C.Config, held: contextlib.ExitStack) -> tuple[Setup | None, RunState]:
    """Everything before the first step: pre-flight checks (each user mistake is one line, faults.UserError,
    before anything slow runs), the run folder (locked into `held`) and its log, data, models, optimizer,
    and — with --resume — the checkpoint's weights and trainer state. (None, run) when a resume finds
    nothing left to run: said before loading the model."""
    D.init(cfg.device)         # torchrun: join the process group (this rank's GPU); one process: nothing
    # tests: DATPO_OOM_AT=site,... makes those stage functions run out of memory once
    inject.install()
    device = models.pick_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir, log, checkpoint, state = open_run(cfg, held)
    run = RunState(batch_size=cfg.prompts_per_step, rng=random.Random(cfg.seed))
    if state and state["step"] >= cfg.steps and not pending_eval_due(run_dir, state):   # e.g. a finished run
        log.say(f"nothing left to run: {checkpoint} is at step {state['step']} of --steps {cfg.steps}; "
                f"raise --steps to train further")
        return None, run
    if cfg.resume and checkpoint is None:   # killed before its first checkpoint: safe in every job script
        log.say(f"--resume {cfg.resume}: no checkpoint there yet; starting at step 0")
    if checkpoint is None:
        faults.check_model(cfg.model)
    method = M.method_of(cfg)
    wants_embedder = method.embeds and (cfg.alpha_start != 0 or cfg.alpha_end != 0)
    models.check_loadable(checkpoint or cfg.model, wants_embedder and cfg.embed_model, cfg.trust_remote_code)
    if wants_embedder:
        faults.check_model(cfg.embed_model, "--embed_model", ("all-minilm-l6-v2",))
    problems = faults.load_data(cfg.train_data, "--train_data", **data.options(cfg))
    eval_problems = (faults.load_data(cfg.eval_data, "--eval_data", cfg.eval_limit or None,
                                      **data.options(cfg, training=False)) if cfg.eval_every else [])
    reward = custom_reward.load(cfg, problems)   # --reward: the functions, loaded and checked now
    torch.manual_seed(cfg.seed)

    source = checkpoint or cfg.model
    try:
        model, tokenizer = models.load_policy(source, device, models.policy_dtype(cfg.precision),
                                              seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
    except OSError as err:
        raise faults.UserError(f"--model {source}: cannot load it ({str(err).splitlines()[0]})") from err
    models.check_chat_template(tokenizer, cfg.prompt_style, source)   # --prompt_style chat: before any prompt
    faults.check_conversational(tokenizer, source, {"--train_data": problems, "--eval_data": eval_problems})
    # an old checkpoint (before the weight guard) or a broken model
    if not guards.all_finite(model.parameters()):
        raise faults.UserError(f"{'--resume' if checkpoint else '--model'} {source}: its weights hold "
                               f"non-finite values; expected an earlier checkpoint of the run "
                               f"or a healthy model")
    if cfg.gradient_checkpointing:   # the update's forward/backward only; generation keeps its KV cache
        models.enable_gradient_checkpointing(model)
    policy = D.wrap(model, cfg.parallel, cfg.precision)   # torchrun: FSDP2-sharded or DDP; else `model`
    # flex: the start-up probe, not after a whole rollout (one line if it falls back)
    if cfg.train_layout == "packed":
        attention.update_kernel(cfg, device, model)
    optimizer = O.build_optimizer(model.parameters(), cfg)   # --optimizer_dtype param | fp32 (optim.py)
    if checkpoint:
        load_trainer_state(state, model, optimizer, run)
        log.say(f"resumed from {checkpoint} at step {run.step}")
        set_aside_later(cfg, run_dir, checkpoint, run.step, log)
    # Lines logged after the checkpoint are about to be redone (at step 0: all, the "before" eval included).
    with write_errors(log.path, "no step has run; the checkpoints are intact"):
        dropped = log.truncate_after(run.step if run.step else -1) if cfg.resume else 0
    if dropped:
        log.say(f"dropped {dropped} log lines of steps after {run.step} (they are redone)")
    if cfg.resume and D.is_main():   # torn lines anywhere are named; so are earlier steps left with no record
        for line in tracking.lost_records(log.path, run.step, log.torn_lines,
                                          same_run=runs.run_folder_of(cfg.resume) == run_dir.resolve()):
            log.say(line)
    record_config(cfg, run_dir, checkpoint, state, run.step)
    # never loaded when α is 0 for the whole run
    embedder = models.load_embedder(cfg.embed_model, device, cfg.trust_remote_code) if wants_embedder \
        else None
    guard = guards.WeightGuard(model, optimizer, cfg.guard_weights)
    return Setup(cfg, method, device, run_dir, log, model, policy, tokenizer, optimizer, guard, embedder,
                 problems, eval_problems, reward=reward), run


def pending_eval_due(run_dir: Path, state: dict) -> bool:
    """A checkpoint whose evaluation a stop skipped (its "after" one: at --steps) and whose record is not in
    the run's metrics yet: the resume is not a no-op."""
    label = state.get("pending_eval")
    if not label:
        return False
    records = tracking.read_metrics(run_dir / "metrics.jsonl")[0]
    return not any(r.get("eval") == label and r.get("step") == state["step"] for r in records)


def open_run(cfg: C.Config, held: contextlib.ExitStack) -> tuple[Path, Log, str | None, dict | None]:
    """The run folder, locked (one run per folder: a second train.py into it stops naming the holder,
    runs.RunLock), checked (never two runs' records in one folder; --resume A --out_dir B refused when B holds
    another run) and its log; with --resume, the newest usable checkpoint and its trainer state (a damaged
    one is skipped with a warning, runs.pick_checkpoint) — whose experiment must be the one asked for
    (runs.check_resume_config: exit 2 listing the changed fields, unless --allow_config_change). A folder
    that belongs to something else (a checkpoint, a model: runs.check_out_dir) is refused before anything is
    created there, and a torn config.json of the run resumed before anything loads (runs.check_run_config)."""
    runs.check_out_dir(cfg.out_dir)
    run_dir = faults.check_writable(cfg.out_dir)
    if D.is_main():
        held.enter_context(runs.RunLock(run_dir))
    if cfg.resume and runs.check_resume_target(cfg.resume, run_dir, cfg.overwrite):
        faults.check_new_run(run_dir, True, delete=D.is_main())   # --overwrite true: B's other run replaced
    if not cfg.resume:   # never mix two runs' records in one folder (faults.check_new_run)
        faults.check_new_run(run_dir, cfg.overwrite, delete=D.is_main())
        D.barrier()
    # torchrun: rank 0 writes
    log = Log(run_dir, cfg.report_to, json.loads(cfg.to_json()), enabled=D.is_main())
    source = faults.resume_source(cfg.resume) if cfg.resume else None
    if source:
        runs.check_run_config(run_dir)   # read (history kept) once the checkpoint loads
    checkpoint, state = runs.pick_checkpoint(cfg.resume, source) if cfg.resume else (None, None)
    if state:
        runs.check_resume_config(state.get("config", {}), json.loads(cfg.to_json()), cfg.allow_config_change)
    return run_dir, log, checkpoint, state


def set_aside_later(cfg: C.Config, run_dir: Path, checkpoint: str, step: int, log: Log) -> None:
    """A resume from an earlier checkpoint of this run folder abandons the later ones (their metrics lines
    are dropped and redone): moved out of checkpoints/ (runs.set_aside_later), said in one line."""
    if not D.is_main() or runs.run_folder_of(checkpoint) != run_dir.resolve():
        return
    with write_errors(run_dir / "abandoned", "the checkpoints are intact"):
        moved, dest = runs.set_aside_later(run_dir, step)
    if moved:
        log.say(f"--resume {cfg.resume}: the later checkpoints {', '.join(moved)} (the continuation "
                f"this resume abandons) moved to {dest}; no resume picks them again, delete that folder "
                f"when you no longer need them")


@contextlib.contextmanager
def write_errors(path: Path, kept: str, then: str = "free space and run the same command again"):
    """A full disk (or another write error) while writing `path` is a WriteError line: exit 4."""
    try:
        yield
    except OSError as err:
        raise faults.WriteError(f"writing {path}: {runs.write_failure(err)}; {kept}; {then}") from err


def record_config(cfg: C.Config, run_dir: Path, checkpoint, state: dict | None, step: int) -> None:
    """config.json and git_commit.txt of a new run; on a resume that changed allowed (or forced) settings,
    the change is added to config.json's history (runs.with_history). Each written whole or not at all
    (runs.write_text); a full disk is a WriteError line."""
    if not D.is_main():
        return
    config = run_dir / "config.json"
    kept = "no step has run; the checkpoints are intact" if checkpoint else "no step has run"
    if not checkpoint or not config.exists():
        with write_errors(config, kept):
            runs.write_text(config, cfg.to_json())
        with write_errors(run_dir / "git_commit.txt", kept):
            runs.write_text(run_dir / "git_commit.txt", git_commit() + "\n")
        return
    changes = runs.config_changes(state.get("config", {}), json.loads(cfg.to_json())) if state else {}
    if changes:
        with write_errors(config, kept):
            saved = json.loads(config.read_text())
            runs.write_json(config, runs.with_history(saved, json.loads(cfg.to_json()), changes, step))


def load_trainer_state(state: dict, model, optimizer, run: RunState) -> None:
    """A checkpoint's optimizer state (any number of ranks) and trainer state (RunState), as read by
    runs.pick_checkpoint — its weights were loaded with the model."""
    D.load_optimizer_state(model, optimizer, state["optimizer"])
    run.restore(state)


# --------------------------------------------------------------------------------------------------------
# After each step
# --------------------------------------------------------------------------------------------------------
def nonfinite_guard(s: Setup, run: RunState, record: dict) -> None:
    """After a step whose update skipped mini-batches with a non-finite loss or gradient norm
    (guards.skip_nonfinite) or was undone by the weight guard (undo_broken_update): say so, and stop the run
    after --max_bad_steps such steps in a row."""
    if record["nonfinite_minibatches"]:
        s.log.say(f"step {run.step}: {record['nonfinite_minibatches']} mini-batch(es) with a non-finite loss "
                  f"or gradient norm not applied ({run.bad_steps_in_a_row} step(s) in a row)")
    if record["nonfinite_updates"]:
        s.log.say(f"step {run.step}: the update made a weight or the policy's logits non-finite; weights and "
                  f"optimizer state restored to before it ({run.bad_steps_in_a_row} step(s) in a row)")
    if run.bad_steps_in_a_row >= s.cfg.max_bad_steps:
        last = models.resolve_checkpoint(str(s.run_dir))
        raise faults.NonFiniteStop(
            f"stopped at step {run.step}: {run.bad_steps_in_a_row} steps in a row had non-finite losses, "
            f"gradient norms or weights (--max_bad_steps {s.cfg.max_bad_steps}); last good checkpoint: "
            f"{last if last != str(s.run_dir) else 'none'}; expected a lower --lr or a check of the data")


def log_trees(s: Setup, step: int, trees: list[T.Tree], scores: list[list[BlockScore]], alpha: float) -> None:
    """RUN/trees/step_XXXXXX.jsonl at step 1 and every --log_trees_every steps: each tree with its Phase 3
    records as the step computed them (tracking.write_trees; train_step embeds the blocks on these steps even
    once α has annealed to 0, so Div_sib is always there to see). At step 1 and every --log_completions_every
    steps, every leaf's completion as a table in the trackers (tracking.completion_rows, Log.completions)."""
    cfg = s.cfg
    if D.is_main() and tracking.trees_due(step, cfg.log_trees_every):
        tracking.write_trees(s.run_dir, step, trees, s.tokenizer, scores, alpha, cfg.method,
                             cfg.value_estimate, cfg.sibling_groups)
    if D.is_main() and tracking.trees_due(step, cfg.log_completions_every):   # TRL's log_completions
        s.log.completions(step, tracking.completion_rows(trees, scores, s.tokenizer))


def evaluate_and_save(s: Setup, run: RunState, stop: signals.GracefulStop, stopping: bool
                      ) -> tuple[Path | None, bool]:
    """Held-out evaluation every --eval_every steps and at the end; a checkpoint every --save_every steps, at
    the end, and when a stop signal came — before or during that evaluation, which is then skipped
    (run_eval) so that the checkpoint does not wait for it. Returns (the checkpoint written, if any;
    whether to stop)."""
    cfg, done, saved, found = s.cfg, run.step, None, None
    if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
        label = "after" if done == cfg.steps else "during"
        found = rng_state(run.rng)   # a skipped evaluation's checkpoint saves the RNG as it found it
        record = run_eval(s, label, done, stop)
        run.pending_eval = label if record is None else None
        # skipped by a signal, or one came while it ran to its end (torchrun): the checkpoint is due now
        stopping = stopping or record is None or D.any_rank(stop.requested)
        if stopping:
            stop.cancel_timeout()
    if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps or stopping:
        saved = save_checkpoint(s.run_dir, done, s.model, s.tokenizer, s.optimizer,
                                {**run.trainer_state(found if run.pending_eval else None),
                                 "config": json.loads(cfg.to_json())}, keep=cfg.keep_checkpoints)
    return saved, stopping


def finish(s: Setup, wrote: bool, t_run: float) -> None:
    """The before → after held-out line, training.png (when this process `wrote` records), and closing the
    log and the process group."""
    cfg, log = s.cfg, s.log
    if D.is_main():
        evals = tracking.read_metrics(s.run_dir / "metrics.jsonl")[0]   # torn lines left out
        evals = [r for r in evals if r.get("eval") in ("before", "after")]
        if len(evals) >= 2:
            key = f"avg@{cfg.eval_k}"
            log.say(f"held-out {cfg.eval_data} {key}: before {evals[0][key]:.3f} → after "
                    f"{evals[-1][key]:.3f} ({evals[-1]['n_samples']} samples each); "
                    f"{(time.perf_counter() - t_run) / 60:.1f} min")
        if wrote:
            with write_errors(s.run_dir / "training.png", "the run finished, its checkpoints and metrics are "
                              "intact", "free space (only this figure is missing)"):
                log.say(f"curves: {plot_run(s.run_dir)}")
    log.close()
    D.shutdown()


def run_eval(s: Setup, label: str, step: int, stop: signals.GracefulStop, write: bool = True) -> dict | None:
    """The held-out evaluation `label` ("before", "during", "after") at `step`: its metrics record, written
    (unless not `write`) and said. A stop signal skips it — one that came before (set-up, the step) skips it
    whole; one during it stops it after the current generate call (evaluate_problems' `stop`) — and None is
    returned, one line saying how it runs later. Under torchrun it runs to its end (its ranks' generate calls
    are collective)."""
    cfg, model, log = s.cfg, s.model, s.log
    stopped = D.any_rank(stop.requested)
    if not stopped:
        model.eval()
        try:
            with D.full_params(model):     # sharded over ranks and gathered under torchrun
                result = evaluate.evaluate_problems(
                    model, s.tokenizer, s.eval_problems, cfg, k=cfg.eval_k,
                    max_new_tokens=cfg.eval_max_new_tokens, desc=f"eval {label}",
                    stop=None if D.active() else stop)
        except Stopped:   # at a safe point: the samples of its finished generate calls are dropped
            stopped = True
    if stopped:
        weights = cfg.model if label == "before" else s.run_dir / "checkpoints" / f"step_{step:06d}"
        later = "the run starts with it again" if label == "before" else "--resume runs it first"
        log.say(f"[eval {label} @ step {step}] skipped: stopped by {stop.requested or 'a signal'}; {later}, "
                f"or run it alone: python evaluate.py --model {weights} --bench {cfg.eval_data} --k "
                f"{cfg.eval_k} --limit {cfg.eval_limit} --max_new_tokens {cfg.eval_max_new_tokens}")
        return None
    record = {"step": step, "eval": label, "data": cfg.eval_data, f"avg@{cfg.eval_k}": result["avg@k"],
              f"pass@{cfg.eval_k}": result["pass@k"], "n_problems": result["n_problems"],
              "n_samples": result["n_samples"], "seconds": result["seconds"]}
    if write:
        log.write(record)
    se = math.sqrt(max(result["avg@k"] * (1 - result["avg@k"]), 1e-12) / max(result["n_samples"], 1))
    log.say(f"[eval {label} @ step {step}] {cfg.eval_data}: avg@{cfg.eval_k} {result['avg@k']:.3f} "
            f"(± {se:.3f}, {result['n_samples']} samples of {result['n_problems']} problems), "
            f"pass@{cfg.eval_k} {result['pass@k']:.3f}, {result['seconds']:.0f}s")
    return record


# --------------------------------------------------------------------------------------------------------
# Checkpoints and the run folder
# --------------------------------------------------------------------------------------------------------
def rng_state(rng: random.Random) -> dict:
    state = {"python": rng.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(rng: random.Random, state: dict) -> None:
    rng.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, trainer: dict,
                    keep: int = 0) -> Path:
    """Weights (safetensors, loadable with from_pretrained), tokenizer, optimizer, step and RNG states.
    Written under a temporary name and renamed, so a crash never leaves half a checkpoint; then the
    `latest` pointer is replaced atomically (runs.checkpoint_folder: a full disk is one WriteError line with
    the previous checkpoint intact; `keep` > 0 deletes all but the newest `keep`). Weights with a non-finite
    value are never written (NonFiniteStop). Under torchrun every rank calls it (gathering FSDP shards is
    collective) and rank 0 writes the full state."""
    weights, optimizer_state = D.model_state_dict(model), D.optimizer_state_dict(model, optimizer)
    if not D.is_main():
        D.barrier()
        return None
    if not guards.all_finite(weights.values()):   # the WeightGuard should make this unreachable
        last = models.resolve_checkpoint(str(run_dir))
        raise faults.NonFiniteStop(f"step {step}: the weights hold a non-finite value; "
                                   f"checkpoint not written; "
                                   f"last good checkpoint: {last if last != str(run_dir) else 'none'}")
    with runs.checkpoint_folder(run_dir, step, keep) as tmp:
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        inject.crash_point("checkpoint-write")   # fault-injection tests kill the run here, half written
        tokenizer.save_pretrained(tmp)
        torch.save({"optimizer": optimizer_state, **trainer}, tmp / "trainer_state.pt")
    D.barrier()   # no rank reads or resumes from a checkpoint before it is complete
    return run_dir / "checkpoints" / f"step_{step:06d}"


def git_commit() -> str:
    try:
        here = Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return (sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0
                else "unknown")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def plot_run(run_dir: Path) -> Path:
    """training.png: reward, V(root) and held-out avg@k per step; leaves and generated tokens per prompt."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = tracking.read_metrics(run_dir / "metrics.jsonl")[0]   # torn lines left out
    steps = [r for r in records if "eval" not in r]
    evals = [r for r in records if "eval" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="reward (all leaves)",
              alpha=0.7)
    left.plot([r["step"] for r in steps], [r["v_root"] for r in steps], label="V(root) (base responses)",
              alpha=0.7)
    if evals:
        key = next(k for k in evals[0] if k.startswith("avg@"))
        left.plot([r["step"] for r in evals], [r[key] for r in evals], "o-", color="black",
                  label=f"held-out {key} ({evals[0]['data']})")
    left.set_xlabel("step")
    left.set_ylim(0, 1)
    left.legend()
    right.plot([r["step"] for r in steps], [r["leaves_per_prompt"] for r in steps], label="leaves / prompt")
    right.set_xlabel("step")
    right.set_ylabel("leaves / prompt")
    twin = right.twinx()
    twin.plot([r["step"] for r in steps], [r["generated_tokens_per_prompt"] for r in steps], color="tab:red",
              label="generated tokens / prompt")
    twin.set_ylabel("generated tokens / prompt", color="tab:red")
    right.legend(loc="upper left")
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path, tmp = run_dir / "training.png", run_dir / ".training.png.tmp"
    try:   # whole or not at all: a full disk leaves the previous figure
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        plt.close(fig)
    return path
