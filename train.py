"""train.py — Algorithm DATPO (App. E): one training step, and the policy update it ends with.

    python train.py --model Qwen/Qwen2.5-3B          # the paper's run on one GPU (preset "paper")
    python train.py --preset demo                    # 2 CPU cores, offline, SmolLM2-135M on arithmetic
    python train.py --preset tiny --steps 2          # tests

One step (`train_step`, Algorithm DATPO):
  sample prompts q ~ Q
  Phase 1+2  tree rollouts: N base responses, V(root), K̂/B̂, forks, branches        (rollout.py, tree.py)
  Phase 3    block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b)            (advantage.py)
  Phase 4    old log-probs (no grad) → PPO epochs over mini-batches of blocks (whole trees, re-shuffled every
             epoch), micro-batches sized in tokens with gradient accumulation → clipped token-level objective
             (Eq. DATPO, separate clip low/high, no KL) → grad-norm clip → AdamW; then anneal α.
                                                                                       (`ppo_update`)
What differs between DATPO and the baselines is one row of methods.py (rollout shape, advantages, path
weighting, embeddings). The update forwards each tree once as a packed sequence under a tree attention mask
(packing.py): the prompt once, every block once, each token attending to its own root-to-leaf path, so every
token of the tree is trained exactly once. TreeRL/AttnRL's root-to-leaf flattening (App. E.4) is reproduced by
weighting each token by the number of trained paths through it. `--train_layout rows` forwards each leaf's new
tokens as a row with its whole prefix as context instead (the simple path, and the tests' oracle).

The harness around the step — set-up, evaluation, checkpoints, stop signals, the non-finite guards — is
harness/loop.py (`train` below hands it the step). Where the algorithm meets the harness, one line says so:
torchrun (`D.`, harness/distributed.py), out of memory (harness/oom.py), non-finite numbers
(harness/guards.py).
"""
from __future__ import annotations

import math
import os
import random
import sys
import time
from pathlib import Path

from harness import threads

# OpenMP reads its thread policy once, when torch loads: set it first (harness/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch
from tqdm import tqdm

import advantage as A
import attention
import config as C
import data
import methods as M
import models
import offpolicy
import packing as P
import rollout as R
import tree as T
from harness import checks, cli, custom_reward, faults, guards, loop, oom, tracking
from harness import distributed as D
from harness.loop import RunState, Setup


# --------------------------------------------------------------------------------------------------------
# One step of Algorithm DATPO
# --------------------------------------------------------------------------------------------------------
def train_step(s: Setup, run: RunState) -> dict:
    """One step of Algorithm DATPO (App. E), or of the method's baseline; returns its metrics record."""
    cfg, method, step, t_step = s.cfg, s.method, run.step, time.perf_counter()
    # q ~ Q (off-policy: drawn, bases sampled, last step)
    batch = run.ahead or sample_prompts(s, run)
    upcoming = sample_prompts(s, run) \
        if offpolicy.wants_next_batch(cfg.off_policy_steps, step, cfg.steps) else None   # step t+1's prompts

    # ---- Phase 1+2: tree rollouts (off-policy: step t+1's N base responses decode in the same batch) ----
    trees, rollout_stats, run.ahead = tree_rollouts(s, run, batch, upcoming)

    # ---- Phase 3: block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b) ----
    t0 = time.perf_counter()
    alpha = A.alpha_at(step, cfg.steps, cfg.alpha_start, cfg.alpha_end) if method.embeds else 0.0
    logged = tracking.trees_due(step + 1, cfg.log_trees_every)   # the tree log shows Div_sib even at α = 0
    embeddings = A.embed_blocks(s.embedder, trees, cfg.embed_batch_size, cfg.sibling_groups) \
        if s.embedder and (alpha != 0 or logged) else [None] * len(trees)
    t_embed = time.perf_counter() - t0
    # torchrun: every rank now holds the whole step (all ranks' trees in prompt order), so metrics stay
    # global and every rank forms the same mini-batches as one process would
    trees, embeddings, rank_stats = D.gather_lists(trees, embeddings, [rollout_stats])
    scores = [A.score_tree(tr, method, alpha, emb, cfg.alpha_scope, cfg.value_estimate, cfg.sibling_groups)
              for tr, emb in zip(trees, embeddings)]            # one BlockScore per block
    # AttnRL drops trees with no signal
    train_trees = [train_tree(tr, [b.advantage for b in sc], method.name)
                   for tr, sc in zip(trees, scores) if method.trainable(tr)]
    loop.log_trees(s, step + 1, trees, scores, alpha)           # RUN/trees/: the scores as they are

    # ---- Phase 4: policy update (PPO-clip, token level) ----
    t0 = time.perf_counter()
    s.model.train()
    s.guard.snapshot()   # harness/guards.py: weights and optimizer state before the update, restored if it
    update = ppo_update(s.policy, s.optimizer, train_trees, cfg, s.pad_id, s.device, run.rng, guard=s.guard)
    s.model.eval()
    s.guard.undo_if_broken(update, s.policy, trees[0].prompt_ids)   # made them or the logits non-finite
    t_update = time.perf_counter() - t0

    if method.dynamic_batch:   # AttnRL: aim the surviving leaves at the initial batch's
        kept_leaves = sum(tr.leaves for tr in trees if method.trainable(tr))
        target = cfg.prompts_per_step * cfg.n_base * (1 + cfg.k_max * cfg.b_max)
        run.batch_size = attnrl_batch_size(run.batch_size, kept_leaves, target, cfg.attnrl_lambda,
                                           cap=4 * cfg.prompts_per_step)
    run.step = step + 1
    t_gen = max(r.seconds_base + r.seconds_forks + r.seconds_branches for r in rank_stats)
    return tracking.step_record(run, trees, train_trees, update, alpha, rank_stats,
                                {"generation": t_gen, "embedding": t_embed, "update": t_update}, t_step)


def tree_rollouts(s: Setup, run: RunState, batch: offpolicy.Batch, upcoming: offpolicy.Batch | None):
    """Phase 1+2 on this rank's share of the prompts (torchrun), with its own RNG stream: the batch's trees —
    growing given base responses when the batch was sampled last step — and, when `upcoming` is given, its N
    base responses per prompt sampled in the same engine run with the current weights (offpolicy.py), returned
    whole on every rank (the next step's batch). Running out of memory shrinks the engine's row budget and
    prefill chunk for the rest of the run (s.backoff)."""
    cfg, step = s.cfg, run.step
    s.model.eval()
    mine, theirs = batch.shard(*D.shard_range(len(batch.prompts))), None
    if upcoming:
        theirs = upcoming.shard(*D.shard_range(len(upcoming.prompts)))
    with (models.autocast(s.device, cfg.precision), D.full_params(s.policy),
          guards.sampling_guard(step + 1, s.run_dir)):
        trees, stats, *ahead = R.rollout_trees(s.model, s.tokenizer, mine.prompts, mine.answers, cfg,
                                               D.rollout_rng(run.rng, cfg.seed, step), method=s.method,
                                               levels=mine.levels, progress=D.is_main(), bases=mine.bases,
                                               ahead=theirs.prompts if theirs else None, backoff=s.backoff,
                                               score=custom_reward.scorer(s.reward, s.tokenizer, s.problems,
                                                                          mine.indices, step))
    for tr in trees:
        tr.policy_lag = batch.lag(step)
    if upcoming:   # every rank keeps the whole next batch (a checkpoint saves it; ranks take their share)
        upcoming.bases, upcoming.sampled_at = D.gather_lists(ahead[0]), step
    return trees, stats, upcoming


def sample_prompts(s: Setup, run: RunState) -> offpolicy.Batch:
    """The step's prompts, answers, difficulty levels and problem indices (an offpolicy.Batch), drawn from the
    data stream at run.cursor. With --max_prompt_tokens > 0 longer prompts are skipped and counted (each
    named once); a prompt that cannot fit the model's context is an error (check_fits). A problem whose
    characters alone exceed what the bound can hold in tokens is judged before tokenizing it: a 50 MB
    problem costs no minutes (data.surely_too_long)."""
    cfg, tokenizer = s.cfg, s.tokenizer
    context = faults.model_context(s.model)
    prompts, answers, levels, indices = [], [], [], []
    misses = 0
    while len(prompts) < run.batch_size:
        index = data.problem_index(len(s.problems), run.cursor, cfg.seed)
        problem = s.problems[index]
        run.cursor += 1
        n_prompt = at_least = data.surely_too_long(problem["problem"], cfg.max_prompt_tokens or context,
                                                   tokenizer)
        if not n_prompt:
            prompt = data.format_prompt(problem["problem"], tokenizer, cfg.prompt_style, cfg.few_shot)
            n_prompt = len(tokenizer(prompt, add_special_tokens=False).input_ids)
        if cfg.max_prompt_tokens and n_prompt > cfg.max_prompt_tokens:
            if index not in run.too_long:   # one line per problem skipped; its later turns are counted only
                run.too_long.add(index)
                size = f"{len(problem['problem'])} characters" if at_least else f"{n_prompt} tokens"
                s.log.say(f"{cfg.train_data} problem #{index}: {size}, more than --max_prompt_tokens "
                          f"{cfg.max_prompt_tokens} tokens; skipped (each time it comes round)")
            run.skipped_prompts += 1
            misses += 1
            if misses > len(s.problems):
                raise faults.UserError(
                    f"--train_data {cfg.train_data}: every prompt is longer than --max_prompt_tokens "
                    f"{cfg.max_prompt_tokens}; expected problems that fit, or a larger --max_prompt_tokens")
            continue
        check_fits(n_prompt, cfg, context, f"{cfg.train_data} problem #{index}")
        prompts.append(prompt)
        answers.append(problem["answer"])
        levels.append(problem.get("level"))
        indices.append(index)
    return offpolicy.Batch(prompts, answers, levels, indices=indices)


def check_fits(n_prompt: int, cfg, context: int | None, where: str) -> None:
    """A prompt is never skipped by default (the release defines max_prompt_len but never applies it), but
    one whose longest root-to-leaf sequence cannot fit the model's context, or whose tree cannot fit the
    engine's KV pool (--max_kv_tokens, config.kv_pool_shortfall), is an error naming it."""
    faults.check_prompt_fits(
        n_prompt, M.method_of(cfg).longest_response(cfg), context, where,
        flags=f" (--max_new_tokens {cfg.max_new_tokens}, --branch_budget {cfg.branch_budget})",
        fix="problems that fit: skip long prompts with --max_prompt_tokens N, or lower --max_new_tokens / "
            "use --branch_budget remaining")
    short = checks.kv_pool_shortfall(cfg, n_prompt, where)
    if short:
        raise faults.UserError(short)


# --------------------------------------------------------------------------------------------------------
# Phase 3 → 4: what the update trains
# --------------------------------------------------------------------------------------------------------
def train_tree(tr: T.Tree, adv: list[float], method: str) -> P.TrainTree:
    """The tree with one advantage per block. DATPO and the parallel baselines train every tree token once
    (weight 1). TreeRL/AttnRL train root-to-leaf paths (App. E.4): a block counts once per trained path
    through it — AttnRL's paths are the branched ones only; unbranched responses still count in V(root)."""
    paths_of = M.METHODS[method].paths
    paths = paths_of(tr) if paths_of else None
    weights = ([float(m) for m in P.path_multiplicity(tr.parents, paths)] if paths_of
               else [1.0] * len(tr.blocks))
    behaviour = offpolicy.stale_logprobs([not b.branch for b in tr.blocks], [b.logprobs for b in tr.blocks],
                                         tr.policy_lag) if tr.policy_lag else None
    return P.TrainTree(tr.prompt_ids, tr.parents, [b.token_ids for b in tr.blocks], list(adv), weights, paths,
                       behaviour)


def attnrl_batch_size(batch: int, kept_leaves: int, target_leaves: int, lam: float, cap: int) -> int:
    """AttnRL's dynamic batch size: aim the number of leaves that survive filtering at the target
    (initial prompts × N × (1 + K·B)) with an EMA, B_t = ⌈(1−λ)·B_{t−1}·target/kept + λ·B_{t−1}⌉.
    Clamped to [1, cap] (our guard: with nothing kept the raw target is unbounded)."""
    wanted = batch * target_leaves / max(kept_leaves, 1)
    return int(min(cap, max(1, math.ceil((1 - lam) * wanted + lam * batch))))


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


def ppo_update(policy, optimizer, trees: list[P.TrainTree], cfg, pad_id: int, device, rng: random.Random,
               guard: guards.WeightGuard | None = None) -> dict:
    """Phase 4 (Alg. DATPO; App. F.2): PPO epochs over mini-batches of blocks, each mini-batch's gradient
    accumulated over micro-batches, its loss −Σ w·min(ρA, clip(ρ)A) / normaliser (Eq. DATPO) with the
    normaliser from its own units, then grad-norm clip and one AdamW step. Each epoch re-shuffles the
    mini-batches (whole trees, or random blocks: cfg.mini_batch_grouping). Blocks whose advantage is zero
    count in the normaliser but cost no forward or backward. `guard` (harness/guards.WeightGuard): a
    non-finite weight after a step ends the update (the caller restores the snapshot it took)."""
    kernel = attention.update_kernel(cfg, device, D.unwrap(policy))
    packed = cfg.train_layout == "packed"
    budget = cfg.max_tokens_per_micro_batch if packed else cfg.micro_batch_size   # halved on out-of-memory
    offsets = P.token_offsets(trees)
    adv = torch.tensor([a for tr in trees for a, toks in zip(tr.advantages, tr.tokens) for _ in toks],
                       dtype=torch.float32, device=device)
    most_targets = M.method_of(cfg).max_row_targets(cfg)
    stats = UpdateStats(trees)
    # packed: the tree kernel's attention backend stays set through every backward (activation checkpointing
    # recomputes the forward there); the rows layout runs the model as it is
    with attention.kernel_backend(D.unwrap(policy), kernel if packed else "dense"):
        minibatches = P.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
        old = old_logprobs(policy, trees, minibatches, offsets, budget, cfg, pad_id, device, kernel,
                           stats.oom)
        bar = tqdm(total=cfg.ppo_epochs * len(minibatches), desc="update", unit="mini-batch", leave=False,
                   dynamic_ncols=True, disable=not D.is_main() or cfg.ppo_epochs * len(minibatches) < 2)
        for epoch in range(cfg.ppo_epochs):
            if epoch > 0:
                minibatches = P.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
            for units in minibatches:
                bar.update(1)
                norm = P.loss_normaliser(trees, units, cfg.loss_norm, cfg.max_new_tokens, most_targets)
                for attempt in oom.Halving(budget, "the update's micro-batches", stats.oom,
                                           reset=optimizer.zero_grad, retry=not D.active()):
                    with attempt:   # out of memory: this mini-batch again, in micro-batches half the size
                        optimizer.zero_grad(set_to_none=True)
                        micros = micro_batches(trees, units, offsets, attempt.size, cfg)
                        sums = torch.zeros(2, dtype=torch.float64, device=device)   # loss, clipped tokens
                        tokens = forwarded = 0
                        for micro in D.deal(policy, micros, pad_id, device):   # torchrun: this rank's share
                            loss, active = micro_loss(policy, micro, old, adv, norm, cfg, pad_id, device,
                                                      kernel)
                            D.backward(loss)                                    # torchrun: × world size
                            sums += torch.stack([loss.detach().double(), active.sum().double()])
                            tokens, forwarded = tokens + active.numel(), forwarded + micro.forwarded
                if not micros:   # nothing of this mini-batch trains
                    continue
                mb_loss = stats.add_minibatch(sums, tokens, forwarded)   # one sync per mini-batch
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
                # a NaN/inf loss or gradient: not applied
                if guards.skip_nonfinite(mb_loss, grad_norm, optimizer):
                    stats.nonfinite_minibatches += 1
                    continue
                optimizer.step()
                if guard is not None and D.any_rank(not guard.weights_finite()):   # the caller restores
                    stats.nonfinite_updates = 1
                    break
                stats.add_optimizer_step(mb_loss, grad_norm)
            if stats.nonfinite_updates:   # the weight guard ended the update
                break
        bar.close()
    optimizer.zero_grad(set_to_none=True)
    return {**stats.result(cfg.ppo_epochs), "attention_kernel": kernel if packed else "rows"}


def micro_loss(policy, micro: P.MicroBatch, old, adv: torch.Tensor, norm: float, cfg, pad_id: int, device,
               kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's share of its mini-batch's loss, −Σ w·min(ρA, clip(ρ)A) / normaliser (Eq. DATPO),
    and the mask of its clipped tokens. `old` = (θ_old's log-probs, which are known): a token without one
    (the first mini-batch of a one-epoch update, where θ_old = θ) uses its own log-prob, detached."""
    with models.autocast(device, cfg.precision):   # flex: lengths padded to buckets (static shapes)
        new = P.micro_logprobs(policy, micro, pad_id, device, kernel,
                               bucket_tokens=cfg.max_tokens_per_micro_batch).float()
    gidx = torch.tensor(micro.gidx, device=device)
    old_logp, have_old = old
    old_lp = torch.where(have_old[gidx], old_logp[gidx], new.detach())
    objective, active = clipped_objective(new, old_lp, adv[gidx], cfg.clip_low, cfg.clip_high)
    weights = torch.tensor(micro.weights, dtype=objective.dtype, device=device)
    return -(weights * objective).sum() / norm, active


def micro_batches(trees: list[P.TrainTree], units, offsets, size: int, cfg) -> list[P.MicroBatch]:
    """A mini-batch's micro-batches: `size` tokens each (packed layout) or `size` rows (rows layout)."""
    packed = cfg.train_layout == "packed"
    return P.layout_micro_batches(trees, units, offsets, cfg.train_layout,
                                  size if packed else cfg.max_tokens_per_micro_batch,
                                  cfg.micro_batch_size if packed else size)


def old_logprobs(policy, trees: list[P.TrainTree], minibatches, offsets, budget: int, cfg, pad_id: int,
                 device, kernel: str, oom_counts: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """θ_old's log-prob of every token (no grad) and a mask of the ones computed. θ_old = θ until the first
    optimizer step, so the first mini-batch of a one-epoch update needs none: it uses its own detached
    log-probs; every other block gets a no-grad forward with the same packing first. Stale tokens (one-step
    off-policy) then take the log-probs recorded when they were sampled (behaviour_logprobs)."""
    n_tokens = sum(len(t) for tr in trees for t in tr.tokens)
    old = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    have_old = torch.zeros(n_tokens, dtype=torch.bool, device=device)
    policy.eval()  # no dropout: old and new log-probs must come from the same function
    with torch.no_grad(), models.autocast(device, cfg.precision), D.full_params(policy):
        for k, units in enumerate(minibatches):
            if k == 0 and cfg.ppo_epochs == 1:
                continue
            for attempt in oom.Halving(budget, "the update's old log-probs", oom_counts,
                                       retry=not D.active()):
                with attempt:   # out of memory: the same entries again, in micro-batches half the size
                    for micro in D.mine(micro_batches(trees, units, offsets, attempt.size, cfg)):   # torchrun
                        gidx = torch.tensor(micro.gidx, device=device)
                        old[gidx] = P.micro_logprobs(policy, micro, pad_id, device, kernel,
                                                     bucket_tokens=cfg.max_tokens_per_micro_batch).float()
                        have_old[gidx] = True
    # torchrun: epochs re-shuffle, so every rank needs them all
    old, have_old = D.merge_shares(old, have_old)
    behaviour_logprobs(trees, offsets, old, have_old)   # one-step off-policy: stale tokens' π_θold
    return old, have_old


def behaviour_logprobs(trees: list[P.TrainTree], offsets, old: torch.Tensor, have_old: torch.Tensor) -> None:
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
    the out-of-memory retries (`oom`: oom.Halving's counters)."""

    def __init__(self, trees: list[P.TrainTree]):
        self.loss = self.grad_norm = 0.0
        self.optimizer_steps = self.nonfinite_minibatches = self.nonfinite_updates = 0
        self.clip_tokens = self.total_tokens = self.forwarded = 0
        self.trained_blocks = sum(len(P.live_blocks(tr, tr.trained)) for tr in trees)
        self.unique_tokens = sum(tr.unique_tokens for tr in trees if tr.trained)
        self.oom = {"oom_retries": 0}

    def add_minibatch(self, sums: torch.Tensor, tokens: int, forwarded: int) -> float:
        """A mini-batch's loss and clipped tokens (`sums`, still on the device: read once here), tokens and
        forwarded tokens; returns its loss."""
        loss, clipped = sums.tolist()
        self.clip_tokens += int(clipped)
        self.total_tokens += tokens
        self.forwarded += forwarded
        return loss

    def add_optimizer_step(self, loss: float, grad_norm) -> None:
        self.loss += loss
        self.grad_norm += float(grad_norm)
        self.optimizer_steps += 1

    def result(self, ppo_epochs: int) -> dict:
        loss, clip_tokens, total_tokens, forwarded = D.all_reduce(
            [self.loss, self.clip_tokens, self.total_tokens, self.forwarded])   # torchrun: over ranks
        steps = max(self.optimizer_steps, 1)
        return {"loss": loss / steps, "clip_frac": clip_tokens / max(total_tokens, 1),
                "grad_norm": self.grad_norm / steps, "optimizer_steps": self.optimizer_steps,
                "trained_blocks": self.trained_blocks, "nonfinite_minibatches": self.nonfinite_minibatches,
                "forwarded_tokens": forwarded / ppo_epochs,      # per pass over the batch
                "unique_tokens": self.unique_tokens, "nonfinite_updates": self.nonfinite_updates,
                "oom_retries": self.oom["oom_retries"]}


# --------------------------------------------------------------------------------------------------------
# The run: the harness around the step (harness/loop.py)
# --------------------------------------------------------------------------------------------------------
def train(cfg: C.Config) -> Path:
    """Run (or resume) training: harness/loop.py's set-up, loop, evaluation and checkpoints around
    train_step. Returns the run folder."""
    return loop.train(cfg, train_step)


def main(argv: list[str] | None = None) -> Path:
    cfg = cli.parse_args(argv, description=__doc__.splitlines()[0])
    return train(cfg)


if __name__ == "__main__":
    faults.main_guard(main)
