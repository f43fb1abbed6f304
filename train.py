"""train.py — Algorithm DATPO (App. E.3): the training loop, one step, and the policy update it ends with.

    python train.py --model Qwen/Qwen2.5-3B          # the paper's run on one GPU (preset "paper")
    python train.py --preset demo                    # 2 CPU cores, offline, SmolLM2-135M on arithmetic
    python train.py --preset tiny --steps 2          # tests

  train        the loop: load the policy, build AdamW, then one train_step per step
  train_step   one step, top to bottom as Algorithm DATPO:
                 Phase 1+2  tree rollouts: N base responses, V(root), K̂/B̂, forks, branches (rollout.py)
                 Phase 3    block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b)      (advantage.py)
                 Phase 4    PPO-clip token-level loss → AdamW                                    (ppo_update)
  ppo_update   Phase 4 as one loop: PPO epochs over mini-batches of blocks (whole trees, re-shuffled every
               epoch); each mini-batch's gradient accumulated over micro-batches sized in tokens
               (minibatch_gradient); the clipped token-level objective (Eq. DATPO, separate clip low/high,
               no KL); grad-norm clip; one AdamW step.

What differs between DATPO and the baselines is one row of methods.py (rollout shape, advantages, path
weighting, embeddings). The update forwards each tree once as a packed sequence under a tree attention mask
(packing.py, where a picture shows it): the prompt once, every block once, each token attending to its own
root-to-leaf path, so every token of the tree is trained exactly once. TreeRL/AttnRL's root-to-leaf
flattening (App. E.4) is reproduced by weighting each token by the number of trained paths through it.
`--train_layout rows` forwards each leaf's new tokens as a row with its whole prefix as context instead (the
simple path, and the tests' oracle).

What wraps the loop from outside — pre-flight checks, the run folder, resuming, evaluation, checkpoints, stop
signals, the non-finite guards, the metrics log — is harness/loop.py's Run (`run.` below; never needs reading
to follow the algorithm). Which prompts a step gets is prompts.py. Where the algorithm meets torchrun, one
commented line says so (`distributed.`, harness/distributed.py), as nanoGPT keeps DDP.
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

from harness import threads

# OpenMP reads its thread policy once, when torch loads: set it first (harness/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch
from tqdm import tqdm

import advantage
import config
import engine
import kl
import methods
import models
import offpolicy
import optim
import packing
import release
import rollout
import tree
from harness import cli, distributed, faults, loop, oom


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------
def train(cfg: config.Config) -> Path:
    """Run (or resume) training: load the policy, build AdamW, then one train_step per step. Returns the
    run folder."""
    with loop.Run(cfg) as run:          # checks, run folder, resume point; evaluation, checkpoints, signals
        model, tokenizer = run.load_policy()                        # cfg.model, or the checkpoint resumed
        policy = distributed.wrap(model, cfg.parallel, cfg.precision)   # torchrun: FSDP2 or DDP; else model
        optimizer = optim.build_optimizer(model.parameters(), cfg)  # AdamW (App. F.2; optim.py)
        learner = Learner(cfg, model, tokenizer, optimizer, run.load_embedder(), policy)
        stream = run.prompt_stream(learner)                         # q ~ Q (prompts.py)
        for step in run.steps(learner, stream):
            batch = stream.next_batch(step)
            result = train_step(learner, batch, step, run.rng)
            stream.after_step(step, result.trees, result.ahead_bases)   # AttnRL's batch size; off-policy
            run.end_step(result)        # metrics, tree log, weight guard, evaluation, checkpoint
    return run.run_dir


@dataclass
class Learner:
    """What every step uses: the config, the policy and its tokenizer, the optimizer, Div_sib's embedder."""
    cfg: config.Config
    model: torch.nn.Module              # the HF model: generation, evaluation, checkpoints
    tokenizer: object
    optimizer: torch.optim.Optimizer
    embedder: object | None             # a sentence embedder (None when α is 0 all run)
    policy: torch.nn.Module | None = None   # what the update runs: `model`, or torchrun's FSDP2/DDP form
    # checked after every optimizer step; False ends the update (the harness's weight guard restores it)
    weights_ok: Callable[[], bool] = lambda: True
    backoff: engine.Backoff = field(default_factory=engine.Backoff)   # rollout sizes after running out of
                                                                      # memory, kept from step to step
    reward: Callable | None = None   # --reward: (problem indices, step) -> a batch's scorer (the harness
                                     # sets it); None: the grader, reward.compute_reward
    reference: torch.nn.Module | None = None   # --kl_beta > 0: π_ref, the frozen initial policy (kl.py)

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
    """What one step returns for the log: the trees and their Phase 3 scores, what the update trained and
    its statistics, α, the rollout counters of each rank, seconds per phase; with one-step off-policy the
    next step's base responses sampled in this step's rollout (this rank's share)."""
    trees: list[tree.Tree]
    scores: list[list[advantage.BlockScore]]
    train_trees: list[packing.TrainTree]
    update: dict
    alpha: float
    rollout_stats: list[rollout.RolloutStats]
    seconds: dict
    ahead_bases: list | None = None


# --------------------------------------------------------------------------------------------------------
# One step of Algorithm DATPO
# --------------------------------------------------------------------------------------------------------
def train_step(learner: Learner, batch: offpolicy.Batch, step: int, rng: random.Random) -> StepResult:
    """One step of Algorithm DATPO (App. E.3) — or of the method's baseline (methods.py) — on `batch`, this
    process's prompts q ~ Q (prompts.py), at `step` (0-based)."""
    cfg, method = learner.cfg, learner.method

    # ---- Phase 1+2: tree rollouts: N base responses, V(root), K̂ and B̂, forks, B̂ branches per fork ----
    trees, rollout_stats, ahead_bases = tree_rollouts(learner, batch, step, rng)

    # ---- Phase 3: block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b) ----
    t1 = time.perf_counter()
    alpha = advantage.alpha_at(step, cfg.steps, cfg.alpha_start, cfg.alpha_end) if method.embeds else 0.0
    estimators = release.estimators(cfg.value_estimate, cfg.sibling_groups)   # the paper's V_MC, Eq. 10
    embeddings = [None] * len(trees)                                          # Div_sib's e_b: when α ≠ 0
    if alpha != 0:
        embeddings = advantage.embed_blocks(learner.embedder, trees, cfg.embed_batch_size, estimators)
    t_embed = time.perf_counter() - t1
    # torchrun: every rank now holds the whole step (all ranks' trees in prompt order), so metrics stay
    # global and every rank forms the same mini-batches as one process would
    trees, embeddings, rollout_stats = distributed.gather_lists(trees, embeddings, [rollout_stats])
    scores = [advantage.score_tree(tr, method, alpha, emb, cfg.alpha_scope, estimators)
              for tr, emb in zip(trees, embeddings)]            # one BlockScore per block
    train_trees = [train_tree(tr, [b.advantage for b in sc], method.name)
                   for tr, sc in zip(trees, scores) if method.trainable(tr)]   # AttnRL drops some

    # ---- Phase 4: policy update: PPO-clip token-level loss → AdamW ----
    t2 = time.perf_counter()
    learner.model.train()
    update = ppo_update(learner.policy, learner.optimizer, train_trees, cfg, learner.tokenizer.pad_token_id,
                        learner.device, rng, learner.weights_ok, learner.reference)
    learner.model.eval()
    t_gen = max(r.seconds_base + r.seconds_forks + r.seconds_branches for r in rollout_stats)
    seconds = {"generation": t_gen, "embedding": t_embed, "update": time.perf_counter() - t2}
    return StepResult(trees, scores, train_trees, update, alpha, rollout_stats, seconds, ahead_bases)


def tree_rollouts(learner: Learner, batch: offpolicy.Batch, step: int, rng: random.Random):
    """Phase 1+2 on this rank's prompts (rollout.rollout_trees), in the rollout's precision: the batch's
    trees — growing given base responses when the batch was drawn a step early (one-step off-policy) — and,
    when it asks for them, the next step's N base responses per prompt, sampled in the same engine run with
    the current weights (offpolicy.py)."""
    cfg, model = learner.cfg, learner.model
    model.eval()
    # torchrun: FSDP's weights gathered for generation; a random stream per rank (one process: `rng`)
    with models.autocast(learner.device, cfg.precision), distributed.full_params(learner.policy):
        trees, stats, *ahead = rollout.rollout_trees(
            model, learner.tokenizer, batch.prompts, batch.answers, cfg,
            distributed.rollout_rng(rng, cfg.seed, step),
            method=learner.method, levels=batch.levels, progress=distributed.is_main(), bases=batch.bases,
            ahead=batch.ahead_prompts, backoff=learner.backoff,
            score=learner.reward(batch.indices, step) if learner.reward else None)
    for tr in trees:
        tr.policy_lag = batch.lag(step)
    return trees, stats, ahead[0] if ahead else None


# --------------------------------------------------------------------------------------------------------
# Phase 3 → 4: what the update trains
# --------------------------------------------------------------------------------------------------------
def train_tree(tr: tree.Tree, adv: list[float], method: str) -> packing.TrainTree:
    """The tree with one advantage per block. DATPO and the parallel baselines train every tree token once
    (weight 1). TreeRL/AttnRL train root-to-leaf paths (App. E.4): a block counts once per trained path
    through it — AttnRL's paths are the branched ones only; unbranched responses still count in V(root)."""
    paths_of = methods.METHODS[method].paths
    paths = paths_of(tr) if paths_of else None
    weights = ([float(m) for m in packing.path_multiplicity(tr.parents, paths)] if paths_of
               else [1.0] * len(tr.blocks))
    behaviour = offpolicy.stale_logprobs([not b.branch for b in tr.blocks], [b.logprobs for b in tr.blocks],
                                         tr.policy_lag) if tr.policy_lag else None
    return packing.TrainTree(tr.prompt_ids, tr.parents, [b.token_ids for b in tr.blocks], list(adv), weights,
                             paths, behaviour)


# --------------------------------------------------------------------------------------------------------
# Phase 4: the clipped token-level objective over packed trees (packing.py)
# --------------------------------------------------------------------------------------------------------
def clipped_objective(new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A) (Eq. DATPO; DAPO's decoupled clip) and a mask of the
    tokens where the clip is active (their gradient is cut)."""
    ratio = torch.exp(new_logp - old_logp)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    active = ((ratio < 1.0 - clip_low) & (adv < 0)) | ((ratio > 1.0 + clip_high) & (adv > 0))
    return torch.minimum(unclipped, clipped), active


def ppo_update(policy, optimizer, trees: list[packing.TrainTree], cfg, pad_id: int, device,
               rng: random.Random, weights_ok: Callable[[], bool] | None = None, reference=None) -> dict:
    """Phase 4 (Alg. DATPO; App. F.2): PPO epochs over mini-batches of blocks, each mini-batch's gradient
    accumulated over micro-batches (minibatch_gradient), then grad-norm clip and one AdamW step. Each epoch
    re-shuffles the mini-batches (whole trees, or random blocks: cfg.mini_batch_grouping). Blocks whose
    advantage is zero count in the normaliser but cost no forward or backward. `weights_ok` (the harness's
    weight guard): False after an optimizer step ends the update (the caller restores the weights).
    `reference` (--kl_beta > 0 only; not in the paper): π_ref, whose log-probs enter a KL penalty (kl.py)."""
    offsets = packing.token_offsets(trees)
    adv = packing.token_advantages(trees, device)                 # Â(b) for every token of every block b
    most_targets = methods.method_of(cfg).max_row_targets(cfg)
    stats = UpdateStats(trees)
    with packing.Forward(policy, cfg, pad_id, device) as forward:   # the tree-mask kernel, forward + backward
        minibatches = packing.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
        old = old_logprobs(forward, trees, minibatches, offsets, cfg, stats.oom)      # θ_old, no grad
        ref = None if reference is None else kl.reference_logprobs(
            reference, trees, minibatches, offsets, cfg, pad_id, device, stats.oom)   # --kl_beta
        for epoch in range(cfg.ppo_epochs):
            if epoch > 0:
                minibatches = packing.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
            for units in stats.progress(minibatches, cfg.ppo_epochs):
                norm = packing.loss_normaliser(trees, units, cfg.loss_norm, cfg.max_new_tokens, most_targets)
                loss = minibatch_gradient(forward, optimizer, trees, units, offsets, old, adv, norm, cfg,
                                          stats, ref)
                if loss is None:   # nothing of this mini-batch trains
                    continue
                grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):   # NaN/inf: not applied
                    optimizer.zero_grad(set_to_none=True)
                    stats.nonfinite_minibatches += 1
                    continue
                optimizer.step()
                if weights_ok is not None and not weights_ok():   # a non-finite weight: the caller restores
                    stats.nonfinite_updates = 1
                    break
                stats.add_optimizer_step(loss, grad_norm)
            if stats.nonfinite_updates:   # the weight guard ended the update
                break
    stats.close()
    optimizer.zero_grad(set_to_none=True)
    return {**stats.result(cfg.ppo_epochs), "attention_kernel": forward.kernel}


def minibatch_gradient(forward: packing.Forward, optimizer, trees: list[packing.TrainTree], units, offsets,
                       old, adv: torch.Tensor, norm: float, cfg, stats: UpdateStats, ref=None
                       ) -> float | None:
    """One mini-batch's gradient: per micro-batch the loss −Σ w·min(ρA, clip(ρ)A) / normaliser (Eq. DATPO)
    and its backward, accumulated. Returns the mini-batch's loss, or None when none of its tokens trains.
    `old` = (θ_old's log-probs, which are known): a token without one (the first mini-batch of a one-epoch
    update, where θ_old = θ) uses its own log-prob, detached. `ref`: π_ref's log-probs under --kl_beta > 0
    (kl.py; off in the paper). Out of memory: the mini-batch again in micro-batches half the size
    (harness/oom.py)."""
    old_logp, have_old = old
    for attempt in oom.Halving(forward.size, "the update's micro-batches", stats.oom,
                               reset=optimizer.zero_grad, retry=not distributed.active()):
        with attempt:
            optimizer.zero_grad(set_to_none=True)
            micros = forward.micro_batches(trees, units, offsets, attempt.size)
            sums = torch.zeros(2, dtype=torch.float64, device=forward.device)   # loss, clipped tokens
            tokens = forwarded = 0
            # torchrun: this rank's share of the micro-batches
            for micro in distributed.deal(forward.policy, micros, forward.pad_id, forward.device):
                new = packing.micro_logprobs(forward, micro)            # log π_θ of its target tokens
                gidx = torch.tensor(micro.gidx, device=forward.device)
                old_lp = torch.where(have_old[gidx], old_logp[gidx], new.detach())
                objective, clipped = clipped_objective(new, old_lp, adv[gidx], cfg.clip_low, cfg.clip_high)
                if ref is not None:   # --kl_beta: − β·KL(π_θ || π_ref) per token (TRL's beta; not the paper)
                    objective = objective - cfg.kl_beta * kl.k3(new, ref[gidx])
                weights = torch.tensor(micro.weights, dtype=objective.dtype, device=forward.device)
                loss = -(weights * objective).sum() / norm                                  # Eq. DATPO
                distributed.backward(loss)                              # torchrun: × world size
                sums += torch.stack([loss.detach().double(), clipped.sum().double()])
                tokens, forwarded = tokens + clipped.numel(), forwarded + micro.forwarded
    if not micros:
        return None
    return stats.add_minibatch(sums, tokens, forwarded)   # one sync per mini-batch


def old_logprobs(forward: packing.Forward, trees: list[packing.TrainTree], minibatches, offsets, cfg,
                 oom_counts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """θ_old's log-prob of every token (no grad) and a mask of the ones computed. θ_old = θ until the first
    optimizer step, so the first mini-batch of a one-epoch update needs none: it uses its own detached
    log-probs; every other block gets a no-grad forward with the same packing first. Stale tokens (one-step
    off-policy) then take the log-probs recorded when they were sampled (behaviour_logprobs)."""
    n_tokens = sum(len(t) for tr in trees for t in tr.tokens)
    old = torch.zeros(n_tokens, dtype=torch.float32, device=forward.device)
    have_old = torch.zeros(n_tokens, dtype=torch.bool, device=forward.device)
    forward.policy.eval()  # no dropout: old and new log-probs must come from the same function
    skip = 1 if cfg.ppo_epochs == 1 else 0
    with torch.no_grad(), distributed.full_params(forward.policy):   # torchrun: FSDP's weights gathered
        for units in minibatches[skip:]:   # out of memory: the mini-batch again, micro-batches half the size
            oom.halving_retry(lambda size: packing.fill_logprobs(forward, trees, units, offsets, size, old,
                                                                 have_old),
                              forward.size, "the update's old log-probs", oom_counts,
                              retry=not distributed.active())
    # torchrun: epochs re-shuffle, so every rank needs them all
    old, have_old = distributed.merge_shares(old, have_old)
    behaviour_logprobs(trees, offsets, old, have_old)   # one-step off-policy: stale tokens' π_θold
    return old, have_old


def behaviour_logprobs(trees: list[packing.TrainTree], offsets, old: torch.Tensor, have_old: torch.Tensor
                       ) -> None:
    """Stale blocks (one-step off-policy, offpolicy.py): their old log-probs are the ones recorded when they
    were sampled — π_θold of Eq. DATPO is the policy that sampled them, one update before θ."""
    for tr, offs in zip(trees, offsets):
        for lp, at in zip(tr.behaviour or (), offs):
            if lp is not None:
                old[at:at + len(lp)] = torch.tensor(lp, dtype=old.dtype, device=old.device)
                have_old[at:at + len(lp)] = True


class UpdateStats:
    """What ppo_update reports: mean loss and gradient norm per optimizer step, the clipped fraction of
    tokens, tokens forwarded per pass over the batch (packing overhead) against the unique tokens trained, and
    the out-of-memory retries (`oom`: oom.Halving's counters); and the update's progress bar."""

    def __init__(self, trees: list[packing.TrainTree]):
        self.loss = self.grad_norm = 0.0
        self.optimizer_steps = self.nonfinite_minibatches = self.nonfinite_updates = 0
        self.clip_tokens = self.total_tokens = self.forwarded = 0
        self.trained_blocks = sum(len(packing.live_blocks(tr, tr.trained)) for tr in trees)
        self.unique_tokens = sum(tr.unique_tokens for tr in trees if tr.trained)
        self.oom = {"oom_retries": 0}
        self.bar = None

    def progress(self, minibatches: list, epochs: int):
        """The mini-batches of an epoch, each counted on one bar for the whole update."""
        if self.bar is None:
            total = epochs * len(minibatches)
            self.bar = tqdm(total=total, desc="update", unit="mini-batch", leave=False, dynamic_ncols=True,
                            disable=not distributed.is_main() or total < 2)
        for units in minibatches:
            self.bar.update(1)
            yield units

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def add_minibatch(self, sums: torch.Tensor, tokens: int, forwarded: int) -> float:
        """A mini-batch's loss and clipped tokens (`sums`, still on the device: read once here), tokens and
        forwarded tokens; returns its loss."""
        loss, clipped = sums.tolist()
        self.clip_tokens += int(clipped)
        self.total_tokens += tokens
        self.forwarded += forwarded
        return loss

    def add_optimizer_step(self, loss: float, grad_norm: float) -> None:
        self.loss += loss
        self.grad_norm += float(grad_norm)
        self.optimizer_steps += 1

    def result(self, ppo_epochs: int) -> dict:
        loss, clip_tokens, total_tokens, forwarded = distributed.all_reduce(
            [self.loss, self.clip_tokens, self.total_tokens, self.forwarded])   # torchrun: over ranks
        steps = max(self.optimizer_steps, 1)
        return {"loss": loss / steps, "clip_frac": clip_tokens / max(total_tokens, 1),
                "grad_norm": self.grad_norm / steps, "optimizer_steps": self.optimizer_steps,
                "trained_blocks": self.trained_blocks, "nonfinite_minibatches": self.nonfinite_minibatches,
                "forwarded_tokens": forwarded / ppo_epochs,      # per pass over the batch
                "unique_tokens": self.unique_tokens, "nonfinite_updates": self.nonfinite_updates,
                "oom_retries": self.oom["oom_retries"]}


def main(argv: list[str] | None = None) -> Path:
    cfg = cli.parse_args(argv, description=__doc__.splitlines()[0])
    return train(cfg)


if __name__ == "__main__":
    faults.main_guard(main)
