"""train.py — Algorithm DATPO (App. E.3): the training loop, one step,
and the policy update it ends with.

    python train.py --model Qwen/Qwen2.5-3B   # the paper's run on one GPU (preset "paper")
    python train.py --preset demo             # 2 CPU cores, offline, SmolLM2-135M on arithmetic
    python train.py --preset tiny --steps 2   # tests

  train        the loop: load the policy, build AdamW, then one train_step per step
  train_step   one step, top to bottom as Algorithm DATPO:
                 Phase 1+2  tree rollouts: N base responses, V(root), K̂/B̂, forks, branches
                            (rollout.py)
                 Phase 3    block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b)
                            (advantage.py)
                 Phase 4    PPO-clip token-level loss → AdamW (ppo_update)
  ppo_update   Phase 4 as one loop: PPO epochs over mini-batches of blocks (whole trees,
               re-shuffled every epoch); each mini-batch's gradient accumulated over micro-batches
               sized in tokens (packing.Forward.passes); the clipped token-level objective
               (Eq. DATPO, separate clip low/high, no KL); grad-norm clip; one AdamW step.

What differs between DATPO and the baselines is one row of methods.py (rollout shape, advantages,
path weighting, embeddings). The update forwards each tree once as a packed sequence under a tree
attention mask (packing.py, where a picture shows it): the prompt once, every block once, each token
attending to its own root-to-leaf path, so every token of the tree is trained exactly once.
TreeRL/AttnRL's root-to-leaf flattening (App. E.4) is reproduced by weighting each token by the
number of trained paths through it. `--train_layout rows` forwards each leaf's new tokens as a row
with its whole prefix as context instead (the simple path, and the tests' oracle).

What wraps the loop from outside — pre-flight checks, the run folder, resuming, evaluation,
checkpoints, stop signals, the non-finite guards, the metrics log — is harness/loop.py's Run (`run.`
below; never needs reading to follow the algorithm); what it hands the step is passed where `train`
builds the Learner. Which prompts a step gets is prompts.py. Where the algorithm meets torchrun, one
commented line says so (`distributed.`, runtime/distributed.py), as nanoGPT keeps DDP.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from runtime import threads

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch

import advantage
import config
import engine
import evaluate
import kl
import methods
import models
import offpolicy
import optim
import packing
import rollout
import tree
from harness import cli, loop
from runtime import distributed, faults


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------
def train(cfg: config.Config) -> Path:
    """Run (or resume) training: load the policy, build AdamW, then one train_step per step. Returns
    the run folder."""
    # checks, run folder, resume point, signals
    with loop.Run(cfg, evaluate.evaluate_problems) as run:
        # cfg.model, or the checkpoint resumed
        model, tokenizer = run.load_policy()
        # torchrun: FSDP2 or DDP; else model
        policy = distributed.wrap(model, cfg.parallel, cfg.precision)
        optimizer = optim.build_optimizer(model.parameters(), cfg)  # AdamW (App. F.2; optim.py)
        learner = Learner(cfg, model, tokenizer, optimizer, run.load_embedder(), policy,
                          weights_ok=run.weights_ok,     # the weight guard (harness/guards.py)
                          # the grader or --reward, each call guarded
                          reward=run.reward_scorer(tokenizer),
                          # π_ref for --kl_beta > 0 (kl.py); None
                          reference=run.load_reference())
        stream = run.prompt_stream(learner)                         # q ~ Q (prompts.py)
        run.start(learner)          # --resume: optimizer and trainer state; config.json;
                                    # the weight guard
        run.evaluate_before()       # held-out evaluation before training (evaluate.py)
        for step in run.steps():
            lr = optim.schedule_lr(optimizer, cfg, step)            # --lr_schedule, --warmup_ratio
            batch = stream.next_batch(step)
            result = train_step(learner, batch, step, run.rng)
            # AttnRL's batch size; off-policy
            stream.after_step(step, result.trees, result.ahead_bases)
            run.end_step(result, lr)    # metrics, tree log, weight guard, evaluation, checkpoint
    return run.run_dir


@dataclass
class Learner:
    """What every step uses: the config, the policy and its tokenizer, the optimizer,
    Div_sib's embedder."""
    cfg: config.Config
    model: torch.nn.Module              # the HF model: generation, evaluation, checkpoints
    tokenizer: object
    optimizer: torch.optim.Optimizer
    embedder: object | None             # a sentence embedder (None when α is 0 all run)
    policy: torch.nn.Module | None = None   # what the update runs: `model`,
                                            # or torchrun's FSDP2/DDP form
    # checked after every optimizer step; False ends the update
    # (the harness's weight guard restores it)
    weights_ok: Callable[[], bool] = lambda: True
    reward: Callable | None = None   # (batch, step) -> its scorer: the grader or --reward, each
                                     # call guarded (harness/reward_guard.py); None:
                                     # reward.compute_reward
    reference: torch.nn.Module | None = None   # --kl_beta > 0: π_ref, the frozen initial policy
                                               # (kl.py)
    # rollout sizes after running out of memory, kept from step to step
    backoff: engine.Backoff = field(default_factory=engine.Backoff)

    def __post_init__(self):
        self.policy = self.policy if self.policy is not None else self.model

    @property
    def method(self) -> methods.Method:
        return methods.method_of(self.cfg)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


@dataclass
class StepResult:
    """What one step returns for the log: the trees and their Phase 3 scores, what the update
    trained and its statistics, α, the rollout counters of each rank, seconds per phase; with
    one-step off-policy the next step's base responses sampled in this step's rollout
    (this rank's share)."""
    trees: list[tree.Tree]
    scores: list[list[advantage.BlockScore]]
    train_trees: list[packing.TrainTree]
    update: dict
    alpha: float
    rollout_stats: list[rollout.RolloutStats]
    seconds: dict
    ahead_bases: list | None = None


# --------------------------------------------------------------------------------------------------
# One step of Algorithm DATPO
# --------------------------------------------------------------------------------------------------
def train_step(learner: Learner, batch: offpolicy.Batch, step: int,
               rng: random.Random) -> StepResult:
    """One step of Algorithm DATPO (App. E.3) — or of the method's baseline (methods.py) — on
    `batch`, this process's prompts q ~ Q (prompts.py), at `step` (0-based)."""
    cfg, method = learner.cfg, learner.method

    # ---- Phase 1+2: tree rollouts: N base responses, V(root), K̂ and B̂, forks, B̂ branches
    #      per fork ----
    trees, rollout_stats, ahead_bases = tree_rollouts(learner, batch, step, rng)

    # ---- Phase 3: block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b) ----
    t1 = time.perf_counter()
    alpha = (advantage.alpha_at(step, cfg.steps, cfg.alpha_start, cfg.alpha_end) if method.embeds
             else 0.0)
    embeddings = [None] * len(trees)                       # Div_sib's e_b: when α ≠ 0
    if alpha != 0:
        embeddings = advantage.embed_blocks(learner.embedder, trees, cfg.embed_batch_size,
                                            cfg.sibling_groups)
    t_embed = time.perf_counter() - t1
    # torchrun: every rank now holds the whole step (all ranks' trees in prompt order), so metrics
    # stay global and every rank forms the same mini-batches as one process would
    trees, embeddings, rollout_stats = distributed.gather_lists(trees, embeddings, [rollout_stats])
    scores = [advantage.score_tree(tr, method, alpha, emb, cfg.alpha_scope, cfg.value_estimate,
                                   cfg.sibling_groups)
              for tr, emb in zip(trees, embeddings)]   # per block
    train_trees = [train_tree(tr, [b.advantage for b in sc], method)
                   for tr, sc in zip(trees, scores) if method.trainable(tr)]   # AttnRL drops some

    # ---- Phase 4: policy update: PPO-clip token-level loss → AdamW ----
    t2 = time.perf_counter()
    learner.model.train()
    update = ppo_update(learner.policy, learner.optimizer, train_trees, cfg,
                        learner.tokenizer.pad_token_id, learner.device, rng, learner.weights_ok,
                        learner.reference)
    learner.model.eval()
    t_gen = max(r.seconds_base + r.seconds_forks + r.seconds_branches for r in rollout_stats)
    seconds = {"generation": t_gen, "embedding": t_embed, "update": time.perf_counter() - t2}
    return StepResult(trees, scores, train_trees, update, alpha, rollout_stats, seconds,
                      ahead_bases)


def tree_rollouts(learner: Learner, batch: offpolicy.Batch, step: int, rng: random.Random):
    """Phase 1+2 on this rank's prompts (rollout.rollout_trees), in the rollout's precision: the
    batch's trees — growing given base responses when the batch was drawn a step early (one-step
    off-policy) — and, when it asks for them, the next step's N base responses per prompt, sampled
    in the same engine run with the current weights (offpolicy.py)."""
    cfg, model = learner.cfg, learner.model
    model.eval()
    # torchrun: FSDP's weights gathered for generation; a random stream per rank
    # (one process: `rng`)
    with models.autocast(learner.device, cfg.precision), distributed.full_params(learner.policy):
        trees, stats, *ahead = rollout.rollout_trees(
            model, learner.tokenizer, batch.prompts, batch.answers, cfg,
            distributed.rollout_rng(rng, cfg.seed, step),
            method=learner.method, levels=batch.levels, progress=distributed.is_main(),
            bases=batch.bases, ahead=batch.ahead_prompts, backoff=learner.backoff,
            score=learner.reward(batch, step) if learner.reward else None)
    for tr in trees:
        tr.policy_lag = batch.lag(step)
    return trees, stats, ahead[0] if ahead else None


# --------------------------------------------------------------------------------------------------
# Phase 3 → 4: what the update trains
# --------------------------------------------------------------------------------------------------
def train_tree(tr: tree.Tree, adv: list[float], method: methods.Method) -> packing.TrainTree:
    """The tree with one advantage per block. DATPO and the parallel baselines train every tree
    token once (weight 1). TreeRL/AttnRL train root-to-leaf paths (App. E.4; the row's `paths`): a
    block counts once per trained path through it — AttnRL's paths are the branched ones only;
    unbranched responses still count in V(root)."""
    paths_of = method.paths
    paths = paths_of(tr) if paths_of else None
    weights = ([float(m) for m in packing.path_multiplicity(tr.parents, paths)] if paths_of
               else [1.0] * len(tr.blocks))
    behaviour = offpolicy.stale_logprobs([not b.branch for b in tr.blocks],
                                         [b.logprobs for b in tr.blocks],
                                         tr.policy_lag) if tr.policy_lag else None
    return packing.TrainTree(tr.prompt_ids, tr.parents, [b.token_ids for b in tr.blocks],
                             list(adv), weights, paths, behaviour)


# --------------------------------------------------------------------------------------------------
# Phase 4: the clipped token-level objective over packed trees (packing.py)
# --------------------------------------------------------------------------------------------------
def clipped_objective(new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) (Eq. DATPO; DAPO's decoupled clip) and a mask
    of the tokens where the clip is active (their gradient is cut)."""
    ratio = torch.exp(new_logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    active = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    return torch.minimum(unclipped, clipped), active


def ppo_update(policy, optimizer, trees: list[packing.TrainTree], cfg, pad_id: int, device,
               rng: random.Random, weights_ok: Callable[[], bool] | None = None,
               reference=None) -> dict:
    """Phase 4 (Alg. DATPO; App. F.2): PPO epochs over mini-batches of blocks, re-shuffled every
    epoch; each mini-batch's gradient accumulated over micro-batches whose loss is Eq. DATPO's, then
    grad-norm clip and one AdamW step. `weights_ok`: the weight guard (False ends the update; the
    caller restores the weights). `reference` (--kl_beta > 0; not in the paper): π_ref, whose
    log-probs enter a KL penalty (kl.py)."""
    # Â(b) of every token; counters
    adv, counts = packing.token_advantages(trees, device), update_counts()
    most_targets = methods.method_of(cfg).max_row_targets(cfg)
    with packing.Forward(policy, cfg, pad_id, device, trees) as forward:   # the tree-mask kernel
        first = packing.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
        # θ_old, π_ref: no grad
        old, has_old, ref = fixed_logprobs(forward, first, cfg, reference, counts)
        for units in packing.epochs(first, trees, cfg, rng):
            norm = packing.loss_normaliser(trees, units, cfg.loss_norm, cfg.max_new_tokens,
                                           most_targets)
            if not packing.trains(trees, units):   # every advantage 0: no forward,
                                                   # no optimizer step
                continue
            # Σ loss, Σ clipped tokens, Σ k3
            sums = torch.zeros(3, dtype=torch.float64, device=device)
            # log π_θ of a micro-batch's tokens; the iterator back-propagates `micro.loss`
            # (Forward.passes)
            for micro, new in forward.passes(units, optimizer, sums, counts):
                at = micro.at                                      # its tokens in the flat buffers
                # θ_old = θ (fixed_logprobs)
                old_lp = torch.where(has_old[at], old[at], new.detach())
                objective, clipped = clipped_objective(new, old_lp, adv[at], cfg.clip_low,
                                                       cfg.clip_high)
                # --kl_beta > 0
                objective, k3_sum = kl.penalty(objective, new, ref, at, cfg.kl_beta)
                micro.loss = -(micro.weight * objective).sum() / norm   # Eq. DATPO
                sums += torch.stack([micro.loss.detach().double(), clipped.sum().double(), k3_sum])
            loss, clip_tokens, k3_total = sums.tolist()               # one sync per mini-batch
            counts["clip_tokens"] += int(clip_tokens)
            counts["kl"] += k3_total
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(),
                                                             cfg.max_grad_norm))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):   # NaN/inf: not applied
                optimizer.zero_grad(set_to_none=True)
                counts["nonfinite_minibatches"] += 1
                continue
            optimizer.step()
            # a non-finite weight: the caller restores
            if weights_ok is not None and not weights_ok():
                counts["nonfinite_updates"] = 1
                break
            counts["loss"], counts["grad_norm"] = (counts["loss"] + loss,
                                                   counts["grad_norm"] + grad_norm)
            counts["optimizer_steps"] += 1
    optimizer.zero_grad(set_to_none=True)
    return update_record(counts, trees, cfg.ppo_epochs, forward.kernel, kl_logged=ref is not None)


def fixed_logprobs(forward: packing.Forward, first: list, cfg, reference, counts: dict):
    """The log-probs the update holds fixed, no grad: θ_old's of every token (Eq. DATPO's ratio)
    with a mask of those computed, and π_ref's (--kl_beta > 0, else None), both by
    packing.logprobs_no_grad. θ_old = θ until the first optimizer step, so the first mini-batch of a
    one-epoch update needs none: it uses its own log-probs, detached. Stale tokens (one-step
    off-policy) take the log-probs recorded when they were sampled (behaviour_logprobs)."""
    skip = 1 if cfg.ppo_epochs == 1 else 0
    old, has_old = packing.logprobs_no_grad(forward, first[skip:], "the update's old log-probs",
                                            counts)
    behaviour_logprobs(forward.trees, forward.offsets, old, has_old)   # one-step off-policy: π_θold
    if reference is None:
        return old, has_old, None
    with packing.Forward(reference, cfg, forward.pad_id, forward.device,
                         forward.trees) as ref_forward:
        ref, _ = packing.logprobs_no_grad(ref_forward, first, "the KL's reference log-probs",
                                          counts)
    return old, has_old, ref


def behaviour_logprobs(trees: list[packing.TrainTree], offsets, old: torch.Tensor,
                       have_old: torch.Tensor) -> None:
    """Stale blocks (one-step off-policy, offpolicy.py): their old log-probs are the ones recorded
    when they were sampled — π_θold of Eq. DATPO is the policy that sampled them,
    one update before θ."""
    for tr, offs in zip(trees, offsets):
        for lp, at in zip(tr.behaviour or (), offs):
            if lp is not None:
                old[at:at + len(lp)] = torch.tensor(lp, dtype=old.dtype, device=old.device)
                have_old[at:at + len(lp)] = True


def update_counts() -> dict:
    """The update's counters: summed loss and gradient norm over optimizer steps, clipped / trained
    / forwarded tokens, non-finite mini-batches and updates, out-of-memory retries
    (runtime/oom.py)."""
    return {"loss": 0.0, "grad_norm": 0.0, "optimizer_steps": 0, "clip_tokens": 0,
            "total_tokens": 0, "forwarded": 0, "nonfinite_minibatches": 0, "nonfinite_updates": 0,
            "oom_retries": 0, "kl": 0.0}


def update_record(counts: dict, trees: list[packing.TrainTree], ppo_epochs: int, kernel: str,
                  kl_logged: bool = False) -> dict:
    """What ppo_update reports: mean loss and gradient norm per optimizer step, the clipped fraction
    of tokens, tokens forwarded per pass over the batch (packing overhead) against the unique tokens
    trained, the out-of-memory retries and the attention kernel; with `kl_logged` (--kl_beta > 0)
    the mean k3 to π_ref over the tokens the loss saw (TRL's logged `kl`)."""
    loss, clip_tokens, total_tokens, forwarded, k3_total = distributed.all_reduce(
        [counts["loss"], counts["clip_tokens"], counts["total_tokens"], counts["forwarded"],
         counts["kl"]])   # torchrun
    steps = max(counts["optimizer_steps"], 1)
    return {"loss": loss / steps, "clip_frac": clip_tokens / max(total_tokens, 1),
            **({"kl": k3_total / max(total_tokens, 1)} if kl_logged else {}),
            "grad_norm": counts["grad_norm"] / steps, "optimizer_steps": counts["optimizer_steps"],
            "trained_blocks": sum(len(packing.live_blocks(tr, tr.trained)) for tr in trees),
            "nonfinite_minibatches": counts["nonfinite_minibatches"],
            "forwarded_tokens": forwarded / ppo_epochs,      # per pass over the batch
            "unique_tokens": sum(tr.unique_tokens for tr in trees if tr.trained),
            "nonfinite_updates": counts["nonfinite_updates"], "oom_retries": counts["oom_retries"],
            "attention_kernel": kernel}


def main(argv: list[str] | None = None) -> Path:
    # --help's description: the docstring's first paragraph, as one line
    cfg = cli.parse_args(argv, description=" ".join(__doc__.split("\n\n")[0].split()))
    return train(cfg)


if __name__ == "__main__":
    faults.main_guard(main)
