"""harness/loop.py — the harness around Algorithm DATPO's loop: set-up, resume, evaluation, checkpoints.

train.py holds the algorithm and its loop (`train`: load the policy, build AdamW and the Learner, `for step
in run.steps()`: train_step). `Run` wraps that loop from outside with everything a run needs that is not
the algorithm; what it hands the step (π_ref, --reward's scorer, the weight guard's check) train.py passes
to the Learner where it builds it, in sight:

  Run(cfg, evaluate) entered: pre-flight checks (each user mistake one line, before anything slow runs), the
                     run folder (locked) and its log, stop signals (harness/signals.py), the training data,
                     and with --resume the checkpoint to continue from
  load_policy        the policy (cfg.model, or the checkpoint resumed) and its tokenizer, checked
  load_embedder      Div_sib's sentence embedder, or None when α is 0 all run
  load_reference     π_ref for --kl_beta > 0 (kl.py), or None
  reward_scorer      the rollout's scorer: the grader or --reward's functions, each call guarded
                     (harness/reward_guard.py: an exception scores 0, RUN/reward_errors.jsonl)
  weights_ok         the weight guard's check after each optimizer step
  prompt_stream      the training prompts (prompts.PromptStream), each one checked to fit
  start              the checkpoint's optimizer and trainer state, the log, config.json, the weight guard
  evaluate_before    the held-out evaluation before training (`evaluate`, evaluate.evaluate_problems)
  steps              the step numbers still to run; between steps, the weight guard's snapshot and stop
                     signals
  end_step           after a step: the weight guard's verdict, the metrics line, the tree log, the non-finite
                     guard, evaluation every --eval_every steps, a checkpoint every --save_every steps
  RunState           what the loop carries from step to step (saved whole in checkpoints)
  save_checkpoint    weights (safetensors), tokenizer, optimizer and trainer state, written atomically
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

import advantage
import attention
import config as C
import data
import kl
import methods as M
import models
from harness import custom_reward, edits, guards, preflight, reward_guard, runs, signals, tracking
from harness.journal import Stopped
from harness.tracking import Log
from prompts import PromptStream
from runtime import atomic, faults, figures
from runtime import distributed as D


@dataclass
class RunState:
    """What the loop carries from one step to the next; a checkpoint saves and restores it whole, with the
    prompt stream's state (prompts.PromptStream.state: cursor, skipped prompts, batch size, the next
    off-policy batch)."""
    step: int = 0                   # steps done
    bad_steps_in_a_row: int = 0     # steps with a non-finite loss or gradient (nonfinite_guard)
    rng: random.Random = field(default_factory=random.Random)   # fork choice, mini-batch order
    pending_eval: str | None = None   # "during"/"after": that evaluation a stop skipped; a resume runs it
    prompts: PromptStream | None = None

    def trainer_state(self, rng: dict | None = None) -> dict:
        """The checkpoint's trainer_state.pt fields (besides the optimizer and the config). `rng`: the RNG
        states to save instead of the current ones (a skipped evaluation's: as it found them)."""
        return {"step": self.step, "bad_steps_in_a_row": self.bad_steps_in_a_row,
                "rng": rng or rng_state(self.rng), **(self.prompts.state() if self.prompts else {}),
                **({"pending_eval": self.pending_eval} if self.pending_eval else {})}

    def restore(self, state: dict) -> None:
        """Back to a checkpoint's trainer state (older checkpoints lack the later fields)."""
        self.step = state["step"]
        self.bad_steps_in_a_row = state.get("bad_steps_in_a_row", 0)
        self.pending_eval = state.get("pending_eval")
        if self.prompts is not None:
            self.prompts.restore(state)
        set_rng_state(self.rng, state["rng"])


class NothingLeft(Exception):
    """A resume that finds nothing left to run (Run.__enter__ said so): load_policy raises it so that the
    loop's body never runs, and Run.__exit__ ends the run quietly."""


class Run:
    """The harness around train.py's loop (see the module's docstring). `with Run(cfg, evaluate) as run:`
    (`evaluate`: the held-out evaluation, evaluate.evaluate_problems) — the attributes below are set as the
    loop reaches them; the helpers of this module read them."""

    def __init__(self, cfg: C.Config, evaluate: Callable):
        self.cfg, self.method, self.evaluate = cfg, M.method_of(cfg), evaluate
        self.model = self.policy = self.tokenizer = self.optimizer = self.embedder = self.guard = None
        self.learner = self.reward = None
        self.record: dict | None = None
        self.stopped_early = False
        self.replace, self.data, self.data_changes = False, {}, {}   # set by __enter__ (open_run, the data)
        self.identity: dict = {}      # saved with every checkpoint besides the data: reward files, π_ref
        self.resume_changes: dict = {}   # what this resume changed, for its first step's metrics record
        self.step_start: dict | None = None   # the trainer state as the step in progress found it
        self.saved_step = 0           # the step of the newest checkpoint (the one resumed, or written)
        self._stack = contextlib.ExitStack()

    # ---- before the first step ---------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        """Pre-flight checks (faults.UserError lines, before anything slow runs), the run folder (locked) and
        its log, stop signals, data; with --resume the checkpoint and its trainer state (read, not applied
        yet). A resume with nothing left to run is said here, before the model loads."""
        cfg = self.cfg
        self.t_run = time.perf_counter()
        self.stop = self._stack.enter_context(signals.GracefulStop(timeout=cfg.stop_timeout))
        try:
            self._open(cfg)
        except BaseException:
            self._stack.close()
            raise
        return self

    def _open(self, cfg: C.Config) -> None:
        D.init(cfg.device)         # torchrun: join the process group (this rank's GPU); one process: nothing
        self.device = models.pick_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.run_dir, self.log, self.checkpoint, self.state, self.replace = open_run(cfg, self._stack)
        self.reward_errors = reward_guard.run_errors(self.run_dir, cfg)   # RUN/reward_errors.jsonl
        for line in edits.notes(cfg):   # a default edited in config.py: in effect, or what set it instead
            self.log.say(line)
        self.run = RunState(rng=random.Random(cfg.seed))
        self.rng = self.run.rng
        state = self.state
        # the run that --overwrite true replaces has no record that counts
        due = state and (state.get("pending_eval") is not None if self.replace
                         else pending_eval_due(self.run_dir, state))
        self.nothing_left = bool(state and state["step"] >= cfg.steps and not due)
        if self.nothing_left:   # e.g. a finished run: nothing deleted either
            self.log.say(f"nothing left to run: {self.checkpoint} is at step {state['step']} of --steps "
                         f"{cfg.steps}; raise --steps to train further")
            return
        if cfg.resume and self.checkpoint is None:   # killed before its first checkpoint: safe in job scripts
            self.log.say(f"--resume {cfg.resume}: no checkpoint there yet; starting at step 0")
        if self.checkpoint is None:
            preflight.check_model(cfg.model)
        self.wants_embedder = self.method.embeds and (cfg.alpha_start != 0 or cfg.alpha_end != 0)
        models.check_loadable(self.checkpoint or cfg.model, self.wants_embedder and cfg.embed_model,
                              cfg.trust_remote_code)
        if self.wants_embedder:
            preflight.check_model(cfg.embed_model, "--embed_model", ("all-minilm-l6-v2",))
        self.problems = preflight.load_data(cfg.train_data, "--train_data", **data.options(cfg))
        self.eval_problems = (preflight.load_data(cfg.eval_data, "--eval_data", cfg.eval_limit or None,
                                               **data.options(cfg, training=False)) if cfg.eval_every else [])
        self.data = runs.data_hashes(self.problems, self.eval_problems)   # saved in every checkpoint
        self.data_changes = runs.check_resume_data(state, self.data, cfg.allow_config_change, {
            "train_data": cfg.train_data, "eval_data": cfg.eval_data}) if state else {}   # rows changed
        # the reward files and π_ref are part of what the run is: saved with every checkpoint, checked here
        sources = custom_reward.source_hashes(cfg)          # read before any of them runs
        self.data_changes.update(custom_reward.check_resume_source(state, sources, cfg.allow_config_change))
        reference = reference_identity(cfg)
        self.data_changes.update(check_resume_reference(state, reference, cfg.allow_config_change))
        self.identity = {"reward_sources": sources, "reference": reference}
        self.saved_step = state["step"] if state else 0
        self.reward = custom_reward.load(cfg, self.problems)   # --reward: the functions, loaded and checked
        torch.manual_seed(cfg.seed)

    def __exit__(self, kind, err, trace) -> bool:
        """Releases the run lock and the signal handlers whatever happened. Sampling that met non-finite
        probabilities becomes a NonFiniteStop line naming the run's last checkpoint (guards.sampling_stop).
        Reward code that tried to end the process (custom_reward.RewardExit) ends the run with a checkpoint
        at the last finished step (rescue_checkpoint), named in its line."""
        try:
            if isinstance(err, custom_reward.RewardExit):
                raise custom_reward.RewardExit(f"{err}; {rescue_checkpoint(self)}") from None
            if isinstance(err, RuntimeError):
                stop = guards.sampling_stop(err, self.run.step + 1, self.run_dir)
                if stop is not None:
                    raise stop from err
        finally:
            self._stack.close()
        return isinstance(err, NothingLeft)

    def load_policy(self):
        """The policy and its tokenizer: cfg.model, or the weights of the checkpoint resumed; checked (chat
        template, finite weights), gradient checkpointing on when asked (the update only)."""
        if self.nothing_left:
            raise NothingLeft
        cfg, source = self.cfg, self.checkpoint or self.cfg.model
        try:
            model, tokenizer = models.load_policy(source, self.device, models.policy_dtype(cfg.precision),
                                                  seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        except OSError as err:
            raise faults.UserError(f"--model {source}: cannot load it ({str(err).splitlines()[0]})") from err
        models.check_chat_template(tokenizer, cfg.prompt_style, source)   # --prompt_style chat: before any
        preflight.check_conversational(tokenizer, source, {"--train_data": self.problems,   # TRL's messages
                                                        "--eval_data": self.eval_problems})
        # an old checkpoint (before the weight guard) or a broken model
        if not guards.all_finite(model.parameters()):
            raise faults.UserError(f"{'--resume' if self.checkpoint else '--model'} {source}: its weights "
                                   f"hold non-finite values; expected an earlier checkpoint of the run "
                                   f"or a healthy model")
        if cfg.gradient_checkpointing:   # the update's forward/backward only; generation keeps its KV cache
            models.enable_gradient_checkpointing(model)
        self.model, self.tokenizer = model, tokenizer
        return model, tokenizer

    def load_reference(self):
        """π_ref for --kl_beta > 0 (kl.py): cfg.model loaded again (the weights the run started from, even
        when resuming), in the policy's dtype, frozen; None when β = 0 (the paper: no second model)."""
        cfg = self.cfg
        if not cfg.kl_beta:
            return None
        model, _ = models.load_policy(cfg.model, self.device, models.policy_dtype(cfg.precision),
                                      seed=cfg.seed, trust_remote_code=cfg.trust_remote_code)
        return kl.freeze(model)

    def reward_scorer(self, tokenizer):
        """The rollout's scorer, (batch, step) -> the batch's scorer (reward_guard.scorer): the grader,
        reward.compute_reward, or --reward's functions (custom_reward.scorer), every call guarded: an
        exception scores 0, is written to RUN/reward_errors.jsonl and counted (end_step)."""
        return functools.partial(reward_guard.scorer, self.reward, tokenizer, self.cfg, self.reward_errors)

    def weights_ok(self) -> bool:
        """The weight guard's check after each optimizer step: False (on every rank, when any rank finds a
        non-finite weight) ends the update; end_step then restores the weights."""
        return not D.any_rank(not self.guard.weights_finite())

    def load_embedder(self):
        """Div_sib's sentence embedder (cfg.embed_model), or None: never loaded when α is 0 all run."""
        if not self.wants_embedder:
            return None
        return models.load_embedder(self.cfg.embed_model, self.device, self.cfg.trust_remote_code)

    def prompt_stream(self, learner) -> PromptStream:
        """The training prompts (prompts.PromptStream), restored from the checkpoint by steps()."""
        self.run.prompts = PromptStream(self.problems, self.cfg, learner.tokenizer,
                                        faults.model_context(learner.model), say=self.log.say)
        return self.run.prompts

    def evaluate_before(self) -> None:
        """The held-out evaluation before training (at step 0), or the one a stop skipped at the checkpoint
        resumed (RunState.pending_eval). A signal during set-up skips it (the loop then stops at once)."""
        if self.cfg.eval_every and self.first_step == 0:
            run_eval(self, "before", 0, self.stop)
        if self.run.pending_eval:   # a stop skipped it before the checkpoint: now, as a run not stopped did
            run_pending_eval(self, self.run, self.stop)

    def steps(self):
        """The steps still to run, 0-based. Before each step: a stop signal ends the run (nothing new to
        save), the weight guard's snapshot. After the last: the before → after line and training.png."""
        cfg, run, start = self.cfg, self.run, self.first_step
        self.bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=cfg.method,
                        dynamic_ncols=True, disable=not D.is_main())
        for step in self.bar:
            if D.any_rank(self.stop.requested):   # the signal came before any step ran: nothing new to save
                self.log.say(f"stopped by {self.stop.requested} before step {run.step + 1}")
                return
            self.guard.snapshot()   # weights and optimizer state, restored if the update breaks them
            self.step_start = run.trainer_state()   # for rescue_checkpoint, should a reward end the step
            self.t_step = time.perf_counter()
            yield step
            if self.stopped_early:   # end_step said so
                return
        self.bar.close()
        finish(self, start < cfg.steps or bool(self.first_pending), self.t_run)

    def start(self, learner) -> None:
        """What the first step needs besides the models: the flex probe (one line if it falls back), the
        resumed optimizer and trainer state (the step to start at), the log made consistent with them,
        config.json, the weight guard."""
        cfg, run = self.cfg, self.run
        self.learner, self.policy = learner, learner.policy
        self.optimizer, self.embedder = learner.optimizer, learner.embedder
        if cfg.train_layout == "packed":   # flex: the start-up probe, not after a whole rollout
            attention.update_kernel(cfg, self.device, self.model)
        if self.checkpoint:
            load_trainer_state(self.state, self.model, self.optimizer, run)
            self.log.say(f"resumed from {self.checkpoint} at step {run.step}")
            # the checkpoint's optimizer came with its own lr, betas and weight decay: the run's are cfg's
            set_hyperparameters(self.optimizer, cfg)
            # what --allow_config_change let this resume change (experiment fields, data rows, reward
            # files, π_ref) goes into the first step's metrics record too
            changed = runs.config_changes(self.state.get("config", {}), json.loads(cfg.to_json()))
            self.resume_changes = {k: list(v) for k, v in {**changed, **self.data_changes}.items()
                                   if k not in runs.RESUME_MAY_CHANGE}
        if self.replace:   # every check passed and everything loaded: now the earlier run goes
            replace_earlier_run(self.run_dir, self.log)
        if self.checkpoint:
            set_aside_later(cfg, self.run_dir, self.checkpoint, run.step, self.log)
        # Lines logged after the checkpoint are redone (at step 0: all, the "before" eval included).
        with write_errors(self.log.path, "no step has run; the checkpoints are intact"):
            dropped = self.log.truncate_after(run.step if run.step else -1) if cfg.resume else 0
        if dropped:
            self.log.say(f"dropped {dropped} log lines of steps after {run.step} (they are redone)")
        if cfg.resume and D.is_main():   # torn lines anywhere are named; so are earlier steps with no record
            same_run = runs.same_run(cfg.resume, self.run_dir)
            for line in tracking.lost_records(self.log.path, run.step, self.log.torn_lines,
                                              same_run=same_run):
                self.log.say(line)
        record_config(cfg, self.run_dir, self.checkpoint, self.state, run.step, self.data_changes)
        self.guard = guards.WeightGuard(self.model, self.optimizer, cfg.guard_weights)
        self.first_step, self.first_pending = run.step, run.pending_eval

    # ---- after each step ---------------------------------------------------------------------------------
    def end_step(self, result, lr: dict) -> None:
        """After train_step: the weight guard's verdict (an update that broke the weights or the logits is
        undone), the metrics line (with `lr`, optim.schedule_lr's), the tree log, the non-finite guard,
        evaluation and checkpoint; a stop signal ends the run here with a checkpoint."""
        cfg, run, log = self.cfg, self.run, self.log
        self.guard.undo_if_broken(result.update, self.policy, result.trees[0].prompt_ids)
        run.step += 1
        failed = self.reward_errors.take()   # {function: [calls that raised, graded]} this step
        record = {**tracking.step_record(run.step, result, run.prompts, self.t_step), **lr,
                  **custom_reward.step_means(self.reward), "reward_errors": reward_guard.failures(failed)}
        if self.resume_changes:   # the first step after a resume that changed settings says which
            record["resumed_with_changes"], self.resume_changes = self.resume_changes, {}
        run.bad_steps_in_a_row = record["bad_steps_in_a_row"] = (
            run.bad_steps_in_a_row + 1 if record["nonfinite_minibatches"] or record["nonfinite_updates"]
            else 0)
        log_trees(self, run.step, result)
        log_completions(self, run.step, result)
        log.write(record)
        nonfinite_guard(self, run, record)
        # more than --max_reward_error_share of the step's responses failed in one function: one line
        # (the checkpoint folder is listed only for a step with failures)
        if record["reward_errors"]:
            reward_guard.check_step(self.reward_errors, failed, run.step, self.run_dir,
                                    last_checkpoint(self.run_dir))
        self.bar.set_postfix(reward=f"{record['reward']:.2f}", v_root=f"{record['v_root']:.2f}",
                             leaves=f"{record['leaves_per_prompt']:.1f}", loss=f"{record['loss']:.3f}")
        stopping = D.any_rank(self.stop.requested)   # torchrun: every rank stops at the same step
        if stopping:
            self.stop.cancel_timeout()   # the safe point is reached: --stop_timeout no longer applies
        saved, stopping = evaluate_and_save(self, run, self.stop, stopping)
        if stopping and run.step < cfg.steps:
            self.bar.close()
            log.say(f"stopped by {self.stop.requested} after step {run.step}: checkpoint {saved}; continue "
                    f"with the same command plus --resume {self.run_dir}")
            self.stopped_early = True


def run_pending_eval(s: Run, run: RunState, stop: signals.GracefulStop) -> None:
    """The evaluation a stop skipped at the checkpoint's step (RunState.pending_eval), from the RNG state it
    would have found (saved in the checkpoint): the same samples and numbers as an uninterrupted run, and the
    RNG after it the same for the steps that follow. A resume from that checkpoint always runs it (the RNG
    needs it); its record is written once (an earlier resume may have written it before being killed)."""
    logged = any(r.get("eval") == run.pending_eval and r.get("step") == run.step for r in s.log.read())
    if run_eval(s, run.pending_eval, run.step, stop, write=not logged) is not None:
        run.pending_eval = None


def pending_eval_due(run_dir: Path, state: dict) -> bool:
    """A checkpoint whose evaluation a stop skipped (its "after" one: at --steps) and whose record is not in
    the run's metrics yet: the resume is not a no-op."""
    label = state.get("pending_eval")
    if not label:
        return False
    records = tracking.read_metrics(run_dir / "metrics.jsonl")[0]
    return not any(r.get("eval") == label and r.get("step") == state["step"] for r in records)


def open_run(cfg: C.Config, held: contextlib.ExitStack) -> tuple[Path, Log, str | None, dict | None, bool]:
    """The run folder, locked (one run per folder: a second train.py into it stops naming the holder,
    runs.RunLock), checked (never two runs' records in one folder; --resume A --out_dir B refused when B holds
    another run) and its log; with --resume, the newest usable checkpoint and its trainer state (a damaged
    one is skipped with a warning, runs.pick_checkpoint) — whose experiment must be the one asked for
    (runs.check_resume_config: exit 2 listing the changed fields, unless --allow_config_change). A folder
    that belongs to something else (a checkpoint, a model: runs.check_out_dir) is refused before anything is
    created there, and a torn config.json of the run resumed before anything loads (runs.check_run_config).
    Nothing is deleted here: every check comes first, and the earlier run that --overwrite true replaces
    (the last value returned: True) is deleted by Run.start once the data, the model, the optimizer and the
    checkpoint's state have loaded too (replace_earlier_run), so a typo in any flag never costs the run it
    was aimed at."""
    runs.check_out_dir(cfg.out_dir)
    run_dir = preflight.check_writable(cfg.out_dir)
    if D.is_main():
        held.enter_context(runs.RunLock(run_dir))
    for flag, folder in [("--out_dir", run_dir)] + ([("--resume", runs.run_folder_of(cfg.resume))]
                                                    if cfg.resume else []):
        why = runs.checkpoints_link_problem(folder)   # else read as "no checkpoint yet": a start over
        if why:
            raise faults.UserError(f"{flag} {cfg.out_dir if flag == '--out_dir' else cfg.resume}: {why}; "
                                   f"expected the disk it points at mounted, or the link removed")
    source = preflight.resume_source(cfg.resume) if cfg.resume else None   # a mistyped --resume: one line
    if cfg.resume:   # --resume A --out_dir B, B another run: refused, or replaced with --overwrite true
        replace = runs.check_resume_target(cfg.resume, run_dir, cfg.overwrite)
    else:            # never mix two runs' records in one folder (preflight.check_new_run)
        replace = preflight.check_new_run(run_dir, cfg.overwrite, delete=False)
    if source and not replace:
        runs.check_run_config(run_dir)   # read (history kept) once the checkpoint loads
    checkpoint, state = runs.pick_checkpoint(cfg.resume, source) if cfg.resume else (None, None)
    if state:
        runs.check_resume_config(state.get("config", {}), json.loads(cfg.to_json()), cfg.allow_config_change)
    # torchrun: rank 0 writes
    log = Log(run_dir, cfg.report_to, json.loads(cfg.to_json()), enabled=D.is_main())
    return run_dir, log, checkpoint, state, replace


def replace_earlier_run(run_dir: Path, log: Log) -> None:
    """--overwrite true, once every check has passed: the earlier run's files are deleted (runs.replace_run:
    its own files only, never through a link). Torchrun: every rank has read what it needs of the folder
    before rank 0 deletes, and none reads it again until rank 0 is done."""
    D.barrier()
    if D.is_main():
        with write_errors(run_dir, "the earlier run is partly deleted; the new one has not started"):
            removed = runs.replace_run(run_dir)
        if removed:
            log.say(f"--overwrite true: the earlier run in {run_dir} replaced ({', '.join(removed)} deleted)")
    D.barrier()


def set_aside_later(cfg: C.Config, run_dir: Path, checkpoint: str, step: int, log: Log) -> None:
    """A resume from an earlier checkpoint of this run folder abandons the later ones (their metrics lines
    are dropped and redone): moved out of checkpoints/ (runs.set_aside_later), said in one line."""
    if not D.is_main() or not runs.same_run(checkpoint, run_dir):
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
        raise faults.WriteError(f"writing {path}: {faults.write_failure(err)}; {kept}; {then}") from err


def record_config(cfg: C.Config, run_dir: Path, checkpoint, state: dict | None, step: int,
                  data_changes: dict | None = None) -> None:
    """config.json and git_commit.txt of a new run; on a resume that changed allowed (or forced) settings,
    or forced a change of the data's rows (`data_changes`), the change is added to config.json's history
    (runs.with_history). Each written whole or not at all (runs.write_text); a full disk is a WriteError
    line."""
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
    changes = {**changes, **(data_changes or {})}
    if changes:
        with write_errors(config, kept):
            saved = json.loads(config.read_text())
            runs.write_json(config, runs.with_history(saved, json.loads(cfg.to_json()), changes, step))


def set_hyperparameters(optimizer, cfg: C.Config) -> None:
    """The run's lr, betas and weight decay in every parameter group of a resumed optimizer, whose state
    dict brought the checkpoint's: a change allowed under --allow_config_change takes effect (the schedule
    then sets each step's lr from cfg.lr, optim.schedule_lr); an unchanged run gets the values it had."""
    for group in optimizer.param_groups:
        group["lr"], group["betas"], group["weight_decay"] = cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay


def reference_identity(cfg: C.Config) -> dict | None:
    """π_ref's identity for --kl_beta > 0 (None otherwise): --model as given, the folder it loads (a run
    folder: its latest checkpoint) and a fingerprint of its weights (measured.weights_identity). A --model
    that is not there is one line here, before anything loads or is replaced."""
    if not cfg.kl_beta:
        return None
    from harness import measured

    preflight.check_model(cfg.model, "--model (π_ref of --kl_beta)")
    identity = measured.weights_identity(cfg.model, cfg.seed)
    return {"model": cfg.model, "path": models.resolve_checkpoint(cfg.model), "weights": identity["weights"]}


def check_resume_reference(state: dict | None, now: dict | None, allow: bool) -> dict[str, tuple]:
    """A resume whose π_ref is not the one the run trained against (other weights under --model: a folder
    retrained, a run folder that checkpointed since) would pull the policy toward another model: one
    UserError line, unless `allow` (--allow_config_change true); returns {"reference policy": (old, new)}
    for config.json's history. Weights are compared where both are known, else the folders; checkpoints of
    earlier versions record none."""
    saved = (state or {}).get("reference")
    if not isinstance(saved, dict) or now is None:
        return {}
    key = "weights" if saved.get("weights") and now.get("weights") else "path"
    if saved.get(key) == now.get(key):
        return {}
    from harness import measured

    old = f"{saved.get('path')} ({measured.short(saved.get('weights'))})"
    new = f"{now.get('path')} ({measured.short(now.get('weights'))})"
    if not allow:
        raise faults.UserError(f"--resume: π_ref (--model {now['model']}, the reference of --kl_beta) is not "
                               f"the one the run trained against: {old} -> {new}; expected the model the run "
                               f"started from, or --allow_config_change true to continue against this one "
                               f"(recorded in config.json's history)")
    return {"reference policy": (old, new)}


def rescue_checkpoint(s: Run) -> str:
    """After reward code tried to end the process mid-step (custom_reward.RewardExit): a checkpoint at the
    last finished step when none was written since — the weights and the optimizer are that step's (reward
    code runs in the rollout, before the update) and the trainer state is the one the step in progress
    started from (Run.steps), so --resume redoes that step exactly —; what --resume continues from, in
    words. Under torchrun nothing is written (a checkpoint is collective)."""
    run = s.run
    done = run.step
    if s.learner is not None and done > s.saved_step and s.step_start is not None and not D.active():
        path = save_checkpoint(s.run_dir, done, s.model, s.tokenizer, s.optimizer,
                               {**s.step_start, "config": json.loads(s.cfg.to_json()), "data": s.data,
                                **s.identity}, keep=s.cfg.keep_checkpoints)
        s.saved_step = done
        return (f"the run stopped in step {done + 1} with a checkpoint of step {done}, {path}; fix the "
                f"function and continue with --resume {s.run_dir}")
    if s.saved_step:
        return (f"the run stopped in step {done + 1}; its last checkpoint is step {s.saved_step}: fix the "
                f"function and continue with --resume {s.run_dir}")
    return f"the run stopped in step {done + 1}, before any checkpoint: fix the function and start it again"


def load_trainer_state(state: dict, model, optimizer, run: RunState) -> None:
    """A checkpoint's optimizer state (any number of ranks) and trainer state (RunState), as read by
    runs.pick_checkpoint — its weights were loaded with the model."""
    D.load_optimizer_state(model, optimizer, state["optimizer"])
    run.restore(state)


# --------------------------------------------------------------------------------------------------------
# After each step
# --------------------------------------------------------------------------------------------------------
def nonfinite_guard(s: Run, run: RunState, record: dict) -> None:
    """After a step whose update skipped mini-batches with a non-finite loss or gradient norm
    (train.ppo_update) or was undone by the weight guard (WeightGuard.undo_if_broken): say so, and stop the
    run after --max_bad_steps such steps in a row."""
    if record["nonfinite_minibatches"]:
        s.log.say(f"step {run.step}: {record['nonfinite_minibatches']} mini-batch(es) with a non-finite loss "
                  f"or gradient norm not applied ({run.bad_steps_in_a_row} step(s) in a row)")
    if record["nonfinite_updates"]:
        s.log.say(f"step {run.step}: the update made a weight or the policy's logits non-finite; weights and "
                  f"optimizer state restored to before it ({run.bad_steps_in_a_row} step(s) in a row)")
    if run.bad_steps_in_a_row >= s.cfg.max_bad_steps:
        raise faults.NonFiniteStop(
            f"stopped at step {run.step}: {run.bad_steps_in_a_row} steps in a row had non-finite losses, "
            f"gradient norms or weights (--max_bad_steps {s.cfg.max_bad_steps}); last good checkpoint: "
            f"{last_checkpoint(s.run_dir)}; expected a lower --lr or a check of the data")


def last_checkpoint(run_dir: Path) -> str:
    """The run's newest checkpoint, or 'none'."""
    last = models.resolve_checkpoint(str(run_dir))
    return last if last != str(run_dir) else "none"


def log_trees(s: Run, step: int, result) -> None:
    """RUN/trees/step_XXXXXX.jsonl at step 1 and every --log_trees_every steps: each tree with its Phase 3
    records as the step computed them (tracking.write_trees). A step that embedded nothing because α is 0
    (annealed to 0 by the end of the run) gets its blocks embedded here, for the log only, so Div_sib is
    always there to see."""
    cfg = s.cfg
    if not (D.is_main() and tracking.trees_due(step, cfg.log_trees_every)):
        return
    scores = result.scores
    if s.embedder is not None and result.alpha == 0:
        embeddings = advantage.embed_blocks(s.embedder, result.trees, cfg.embed_batch_size,
                                            cfg.sibling_groups)
        for tr, tree_scores, emb in zip(result.trees, scores, embeddings):
            if emb is not None:
                for score, div in zip(tree_scores, advantage.block_diversity(tr, emb, cfg.sibling_groups)):
                    score.div_sib = div
    tracking.write_trees(s.run_dir, step, result.trees, s.tokenizer, scores, result.alpha, cfg.method,
                         cfg.value_estimate, cfg.sibling_groups)


def log_completions(s: Run, step: int, result) -> None:
    """At step 1 and every --log_completions_every steps: every leaf's completion as a table in the trackers
    (tracking.completion_rows, Log.completions), as TRL's log_completions."""
    if D.is_main() and tracking.trees_due(step, s.cfg.log_completions_every):
        rows = tracking.completion_rows(result.trees, result.scores, s.tokenizer)
        s.log.completions(step, s.reward.extra_columns(rows, result.trees) if s.reward else rows)


def evaluate_and_save(s: Run, run: RunState, stop: signals.GracefulStop, stopping: bool
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
                                 "config": json.loads(cfg.to_json()), "data": s.data, **s.identity},
                                keep=cfg.keep_checkpoints)
        s.saved_step = done if saved is not None else s.saved_step
    return saved, stopping


def finish(s: Run, wrote: bool, t_run: float) -> None:
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


def run_eval(s: Run, label: str, step: int, stop: signals.GracefulStop, write: bool = True) -> dict | None:
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
            errors = reward_guard.RewardErrors(s.run_dir / reward_guard.FILE, cfg.max_reward_error_share)
            errors.where = {"step": step, "eval": label}   # the grader's failures, beside the training's
            with D.full_params(model):     # sharded over ranks and gathered under torchrun
                result = s.evaluate(
                    model, s.tokenizer, s.eval_problems, cfg, k=cfg.eval_k,
                    max_new_tokens=cfg.eval_max_new_tokens, desc=f"eval {label}",
                    stop=None if D.active() else stop, errors=errors)
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
              "n_samples": result["n_samples"], "reward_errors": result["reward_errors"],
              "seconds": result["seconds"]}
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
                  label=f"held-out {key} ({figures.literal(evals[0]['data'])})")
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
    fig.suptitle(figures.literal(run_dir.name))   # a run name is drawn as written, never as math text
    fig.tight_layout()
    path = run_dir / "training.png"
    try:   # whole or not at all (a full disk leaves the previous figure), never through a planted link
        atomic.replace_file(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    finally:
        plt.close(fig)
    return path
