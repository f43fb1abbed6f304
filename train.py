"""train.py — the training loop: Algorithm DATPO (App. F) on one device, and the paper's baselines.

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
What differs between DATPO and the baselines is one row of methods.py (rollout shape, advantages, path weighting,
embeddings). The update forwards each tree once as a packed sequence under a tree attention mask (packing.py): the
prompt once, every block once, each token attending to its own root-to-leaf path, so every token of the tree is
trained exactly once. TreeRL/AttnRL's root-to-leaf flattening (App. F.4) is reproduced by weighting each token
by the number of trained paths through it. `--train_layout rows` forwards each leaf's new tokens as a row with
its whole prefix as context instead (the simple path, and the tests' oracle).
The harness around the step — setup, the non-finite guard, evaluation, checkpoints, stop signals — is in `train`
below it; torchrun (several GPUs) is a handful of `D.` calls (distributed.py).
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

import numpy as np
import torch
from tqdm import tqdm

import advantage as A
import config as C
import data
import engine as E
from harness import distributed as D
import evaluate
from harness import faults
from harness import guards
from harness import inject
from harness import oom
from harness import signals
import methods as M
import models
import offpolicy
import optim as O
import packing as P
import rollout as R
from harness import runs
from harness import tracking
import tree as T
from harness.tracking import Log


# --------------------------------------------------------------------------------------------------------
# Phase 3: advantages per method (the method's row in methods.py)
# --------------------------------------------------------------------------------------------------------
def embed_blocks(embedder, trees: list[T.Tree], batch_size: int, sibling_groups: str = "paper"
                 ) -> list[np.ndarray | None]:
    """Block embeddings for the sibling-diversity term, once per step and batched over the whole batch.
    Paper (Eq. 10): only blocks that have a sibling are embedded (Div_sib of a lone block is 0 whatever its
    embedding). --sibling_groups release: every block, then one row per base response, its whole text (the
    release compares an unforked response with all N whole responses; methods.div_sib)."""
    wanted, texts, rows = [], [], []
    for t, tr in enumerate(trees):
        counts: dict = {}
        for b in tr.blocks:
            counts[b.parent] = counts.get(b.parent, 0) + 1
        keep = [i for i, b in enumerate(tr.blocks) if sibling_groups == "release" or counts[b.parent] > 1]
        whole = ["".join(b.text for b in tr.blocks if b.base == k and not b.branch)   # release: the N responses
                 for k in range(sum(b.parent is None for b in tr.blocks))] if sibling_groups == "release" else []
        wanted += [(t, i) for i in keep] + [(t, len(tr.blocks) + k) for k in range(len(whole))]
        texts += [tr.blocks[i].text for i in keep] + whole
        rows.append(len(tr.blocks) + len(whole))
    out: list[np.ndarray | None] = [None] * len(trees)
    if not wanted:
        return out
    vectors = embedder.encode(texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=False)
    for t, n in enumerate(rows):
        out[t] = np.zeros((n, vectors.shape[1]), dtype=np.float32)
    for (t, i), v in zip(wanted, vectors):
        out[t][i] = v
    return out


def tree_advantages(method: str, tr: T.Tree, alpha: float, scope: str, embeddings,
                    value_estimate: str = "paper", sibling_groups: str = "paper") -> list[float]:
    """One advantage per block of the tree, by the method's formula (methods.METHODS, advantage.py)."""
    if method not in M.METHODS:
        raise ValueError(f"unknown method {method!r}")
    return M.METHODS[method].advantages(tr, alpha, embeddings, scope, value_estimate, sibling_groups)


def train_tree(tr: T.Tree, adv: list[float], method: str) -> P.TrainTree:
    """The tree with one advantage per block. DATPO and the parallel baselines train every tree token once
    (weight 1). TreeRL/AttnRL train root-to-leaf paths (App. F.4): a block counts once per trained path
    through it — AttnRL's paths are the branched ones only; unbranched responses still count in V(root)."""
    paths_of = M.METHODS[method].paths
    paths = paths_of(tr) if paths_of else None
    weights = [float(m) for m in P.path_multiplicity(tr.parents, paths)] if paths_of else [1.0] * len(tr.blocks)
    behaviour = offpolicy.stale_logprobs([not b.branch for b in tr.blocks], [b.logprobs for b in tr.blocks],
                                         tr.policy_lag) if tr.policy_lag else None
    return P.TrainTree(tr.prompt_ids, tr.parents, [b.token_ids for b in tr.blocks], list(adv), weights, paths,
                       behaviour)


def trainable(tr: T.Tree, method: str) -> bool:
    """Whether the update trains this tree (AttnRL drops trees with no signal: methods.Method.trainable)."""
    return M.METHODS[method].trainable(tr)


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


def max_row_targets(cfg) -> int:
    """The most target tokens a trained sequence can hold (methods.Method.max_row_targets)."""
    return M.method_of(cfg).max_row_targets(cfg)


def attention_kernel(cfg, device, model=None) -> str:
    """flex (block-sparse, cost follows the tree) on CUDA when its start-up probe passes, else tree (SDPA
    segment by segment over each segment's ancestors: cost follows the tree too); dense (one L × L mask)
    only when asked. packing.resolve_kernel probes flex once and says why it falls back."""
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16   # what attention runs in
    return P.resolve_kernel(cfg.packed_attention, device, model, dtype)[0]


def ppo_update(model, optimizer, trees: list[P.TrainTree], cfg, pad_id: int, device, rng: random.Random,
               guard: guards.WeightGuard | None = None) -> dict:
    """PPO epochs over mini-batches of blocks with micro-batch gradient accumulation (App. E.2, Alg. DATPO).

    Each epoch re-shuffles the mini-batches (whole trees, or random blocks: cfg.mini_batch_grouping); each
    mini-batch's loss is −Σ w·min(ρA, clip(ρ)A) / normaliser, the normaliser computed from its units alone.
    Blocks whose advantage is zero count in the normaliser but cost no forward or backward.
    Under torchrun `D.deal` gives this rank its share of each mini-batch's micro-batches (and the passes and
    gradient syncs that keep ranks in step) and `D.backward` scales the loss for DDP/FSDP's gradient mean.
    Out of memory (one process): the mini-batch is redone in micro-batches of half the budget, the same loss
    (oom.halving_retry; counted in oom_retries). `guard` (guards.WeightGuard, snapshot taken by the
    caller): after each optimizer step the weights are checked; a non-finite one ends the update at once with
    stats["nonfinite_updates"] = 1 (the caller restores the snapshot: undo_broken_update).
    """
    kernel = attention_kernel(cfg, device, D.unwrap(model))
    offsets = P.token_offsets(trees)
    adv = torch.tensor([a for tr in trees for a, toks in zip(tr.advantages, tr.tokens) for _ in toks],
                       dtype=torch.float32, device=device)
    packed = cfg.train_layout == "packed"
    budget = cfg.max_tokens_per_micro_batch if packed else cfg.micro_batch_size   # halved on out-of-memory

    def micro_batches(units, size=budget):   # size: tokens (packed) or rows per micro-batch
        return P.layout_micro_batches(trees, units, offsets, cfg.train_layout,
                                      size if packed else cfg.max_tokens_per_micro_batch,
                                      cfg.micro_batch_size if packed else size)

    def logprobs(micro):   # flex: packed lengths padded to buckets of the budget (static shapes)
        return P.micro_logprobs(model, micro, pad_id, device, kernel, bucket_tokens=cfg.max_tokens_per_micro_batch)

    stats = UpdateStats(trees)
    # packed: the tree kernel's attention backend stays set through every backward (activation checkpointing
    # recomputes the forward there); the rows layout runs the model as it is
    with P.kernel_backend(D.unwrap(model), kernel if packed else "dense"):
        minibatches = P.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
        old, have_old = old_logprobs(model, minibatches, micro_batches, logprobs, len(adv), cfg, device, stats.oom)
        behaviour_logprobs(trees, offsets, old, have_old)   # one-step off-policy: stale tokens' π_θold
        bar = tqdm(total=cfg.ppo_epochs * len(minibatches), desc="update", unit="mini-batch", leave=False,
                   dynamic_ncols=True, disable=not D.is_main() or cfg.ppo_epochs * len(minibatches) < 2)
        for epoch in range(cfg.ppo_epochs):
            if stats.nonfinite_updates:   # the weight guard ended the update
                break
            if epoch > 0:
                minibatches = P.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
            for units in minibatches:
                bar.update(1)
                norm = P.loss_normaliser(trees, units, cfg.loss_norm, cfg.max_new_tokens, max_row_targets(cfg))

                def accumulate(size, units=units, norm=norm):   # this mini-batch's gradients; None: nothing to train
                    micros = micro_batches(units, size)
                    optimizer.zero_grad(set_to_none=True)
                    return minibatch_gradients(model, micros, logprobs, old, have_old, adv, norm, cfg, pad_id,
                                               device) if micros else None

                sums = oom.halving_retry(accumulate, budget, "the update's micro-batches", stats.oom,
                                            reset=lambda: optimizer.zero_grad(set_to_none=True), retry=not D.active())
                if sums is None:
                    continue
                mb_loss = stats.add_minibatch(*sums)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                if guards.skip_nonfinite(mb_loss, grad_norm, optimizer):   # not applied, counted (faults.py)
                    stats.nonfinite_minibatches += 1
                    continue
                optimizer.step()
                if guard is not None and D.any_rank(not guard.weights_finite()):   # the caller restores
                    stats.nonfinite_updates = 1
                    break
                stats.add_optimizer_step(mb_loss, grad_norm)
        bar.close()
    optimizer.zero_grad(set_to_none=True)
    return {**stats.result(cfg.ppo_epochs), "attention_kernel": kernel if packed else "rows"}


def minibatch_gradients(model, micros, logprobs, old, have_old, adv, norm: float, cfg, pad_id: int,
                        device) -> tuple[float, int, int, int]:
    """One mini-batch's gradients, accumulated over its micro-batches (under torchrun this rank's share:
    D.deal). Returns its loss, clipped tokens, tokens and forwarded tokens; the sums stay on the device until
    the end (one sync per mini-batch, not per micro-batch)."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)   # loss, clipped tokens, tokens
    forwarded = 0
    for micro in D.deal(model, micros, pad_id, device):   # one process: every micro-batch
        inject.oom_point("update")     # DATPO_OOM_AT=update (tests)
        with models.autocast(device, cfg.precision):
            new = logprobs(micro).float()
        gidx = torch.tensor(micro.gidx, device=device)
        old_lp = torch.where(have_old[gidx], old[gidx], new.detach())
        objective, active = clipped_objective(new, old_lp, adv[gidx], cfg.clip_low, cfg.clip_high)
        weights = torch.tensor(micro.weights, dtype=objective.dtype, device=device)
        loss = -(weights * objective).sum() / norm
        D.backward(loss)                                   # torchrun: × world size
        sums += torch.stack([loss.detach().double(), active.sum().double(),
                             torch.tensor(float(active.numel()), dtype=torch.float64, device=device)])
        forwarded += micro.forwarded
    loss, clipped, counted = sums.tolist()
    return loss, int(clipped), int(counted), forwarded


def old_logprobs(model, first_epoch, micro_batches, logprobs, n_tokens: int, cfg, device, oom_counts: dict):
    """θ_old's log-prob of every token (no grad) and a mask of the ones computed. θ_old = θ until the first
    optimizer step, so the first mini-batch of a one-epoch update needs none: it uses its own detached
    log-probs; every other block gets a no-grad forward with the same packing first. Out of memory (one
    process): that mini-batch's pass is redone at half the micro-batch budget (counted in oom_counts)."""
    old = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    have_old = torch.zeros(n_tokens, dtype=torch.bool, device=device)
    budget = cfg.max_tokens_per_micro_batch if cfg.train_layout == "packed" else cfg.micro_batch_size
    model.eval()  # no dropout: old and new log-probs must come from the same function
    with torch.no_grad(), models.autocast(device, cfg.precision), D.full_params(model):
        for k, units in enumerate(first_epoch):
            if k > 0 or cfg.ppo_epochs > 1:
                def fill_old(size, units=units):   # a retry after out-of-memory rewrites the same entries
                    for micro in D.mine(micro_batches(units, size)):   # torchrun: only this rank's micro-batches
                        inject.oom_point("update")     # DATPO_OOM_AT=update (tests)
                        gidx = torch.tensor(micro.gidx, device=device)
                        old[gidx] = logprobs(micro).float()
                        have_old[gidx] = True

                oom.halving_retry(fill_old, budget, "the update's old log-probs", oom_counts, retry=not D.active())
    return D.merge_shares(old, have_old)   # torchrun: epochs re-shuffle, so every rank needs them all


def behaviour_logprobs(trees: list[P.TrainTree], offsets, old: torch.Tensor, have_old: torch.Tensor) -> None:
    """Stale blocks (one-step off-policy, offpolicy.py): their old log-probs are the ones recorded when they
    were sampled — π_θold of Eq. DATPO is the policy that sampled them, one update before θ."""
    for tr, offs in zip(trees, offsets):
        for lp, at in zip(tr.behaviour or (), offs):
            if lp is not None:
                old[at:at + len(lp)] = torch.tensor(lp, dtype=old.dtype, device=old.device)
                have_old[at:at + len(lp)] = True


class UpdateStats:
    """What ppo_update reports: mean loss and gradient norm per optimizer step, the clipped fraction of tokens,
    tokens forwarded per pass over the batch (packing overhead) against the unique tokens trained, and the
    out-of-memory retries (`oom`, oom.halving_retry's counters)."""

    def __init__(self, trees: list[P.TrainTree]):
        self.loss = self.grad_norm = 0.0
        self.optimizer_steps = self.nonfinite_minibatches = self.nonfinite_updates = 0
        self.clip_tokens = self.total_tokens = self.forwarded = 0
        self.trained_blocks = sum(len(P.live_blocks(tr, tr.trained)) for tr in trees)
        self.unique_tokens = sum(tr.unique_tokens for tr in trees if tr.trained)
        self.oom = {"oom_retries": 0}

    def add_minibatch(self, loss: float, clipped: int, tokens: int, forwarded: int) -> float:
        """A mini-batch's token counts (minibatch_gradients); returns its loss."""
        self.clip_tokens += clipped
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
# One step of Algorithm DATPO
# --------------------------------------------------------------------------------------------------------
@dataclass
class RunState:
    """What the loop carries from one step to the next; a checkpoint saves and restores it whole."""
    step: int = 0                   # steps done
    cursor: int = 0                 # position in the endless stream of shuffled problems (problem_index)
    skipped_prompts: int = 0        # prompts longer than --max_prompt_tokens, so far
    batch_size: int = 0             # prompts per step: cfg.prompts_per_step, or AttnRL's dynamic batch size
    bad_steps_in_a_row: int = 0     # steps with a non-finite loss or gradient (nonfinite_guard)
    rng: random.Random = field(default_factory=random.Random)   # fork choice, mini-batch order
    too_long: set = field(default_factory=set)   # problems skipped as longer than --max_prompt_tokens (named once)
    ahead: offpolicy.Batch | None = None   # one-step off-policy: the next step's prompts, their bases sampled

    def trainer_state(self) -> dict:
        """The checkpoint's trainer_state.pt fields (besides the optimizer and the config)."""
        return {"step": self.step, "cursor": self.cursor, "skipped_prompts": self.skipped_prompts,
                "batch_size": self.batch_size, "bad_steps_in_a_row": self.bad_steps_in_a_row,
                "rng": rng_state(self.rng), "too_long": sorted(self.too_long),
                "ahead": self.ahead.to_state() if self.ahead else None}

    def restore(self, state: dict) -> None:
        """Back to a checkpoint's trainer state (older checkpoints lack the later fields)."""
        self.step, self.cursor = state["step"], state["cursor"]
        self.skipped_prompts = state.get("skipped_prompts", 0)
        self.batch_size = state.get("batch_size", self.batch_size)
        self.bad_steps_in_a_row = state.get("bad_steps_in_a_row", 0)
        self.too_long = set(state.get("too_long", ()))
        self.ahead = offpolicy.Batch.from_state(state.get("ahead"))
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
    backoff: E.Backoff = field(default_factory=E.Backoff)   # the rollout engine's sizes after running out of memory

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id


def train_step(s: Setup, run: RunState) -> dict:
    """One step of Algorithm DATPO (App. F), or of the method's baseline; returns its metrics record."""
    cfg, method, step, t_step = s.cfg, s.method, run.step, time.perf_counter()
    batch = run.ahead or offpolicy.Batch(*sample_prompts(s, run))    # q ~ Q (off-policy: drawn, bases sampled, last step)
    upcoming = offpolicy.Batch(*sample_prompts(s, run)) \
        if offpolicy.wants_next_batch(cfg.off_policy_steps, step, cfg.steps) else None   # step t+1's prompts

    # ---- Phase 1+2: tree rollouts (off-policy: step t+1's N base responses decode in the same batch) ----
    trees, rollout_stats, run.ahead = tree_rollouts(s, run, batch, upcoming)

    # ---- Phase 3: block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b) ----
    t0 = time.perf_counter()
    alpha = A.alpha_at(step, cfg.steps, cfg.alpha_start, cfg.alpha_end) if method.embeds else 0.0
    embeddings = embed_blocks(s.embedder, trees, cfg.embed_batch_size, cfg.sibling_groups) \
        if (s.embedder and alpha != 0) else [None] * len(trees)
    t_embed = time.perf_counter() - t0
    # torchrun: every rank now holds the whole step (all ranks' trees in prompt order), so metrics stay
    # global and every rank forms the same mini-batches as one process would
    trees, embeddings, rank_stats = D.gather_lists(trees, embeddings, [rollout_stats])
    advantages = [method.advantages(tr, alpha, emb, cfg.alpha_scope, cfg.value_estimate, cfg.sibling_groups)
                  if method.trainable(tr) else None for tr, emb in zip(trees, embeddings)]
    train_trees = [train_tree(tr, adv, method.name) for tr, adv in zip(trees, advantages) if adv is not None]
    log_trees(s, step + 1, trees, advantages, embeddings, alpha)

    # ---- Phase 4: policy update (PPO-clip, token level) ----
    t0 = time.perf_counter()
    s.model.train()
    s.guard.snapshot()   # guards.WeightGuard: weights and optimizer state as they are before this update
    update = ppo_update(s.policy, s.optimizer, train_trees, cfg, s.pad_id, s.device, run.rng, guard=s.guard)
    undo_broken_update(s, update, trees[0].prompt_ids)
    t_update = time.perf_counter() - t0

    if method.dynamic_batch:   # AttnRL: aim the surviving leaves at the initial batch's
        kept_leaves = sum(tr.leaves for tr, adv in zip(trees, advantages) if adv is not None)
        target = cfg.prompts_per_step * cfg.n_base * (1 + cfg.k_max * cfg.b_max)
        run.batch_size = attnrl_batch_size(run.batch_size, kept_leaves, target, cfg.attnrl_lambda,
                                           cap=4 * cfg.prompts_per_step)
    run.step = step + 1
    t_gen = max(r.seconds_base + r.seconds_forks + r.seconds_branches for r in rank_stats)
    return step_record(run, trees, train_trees, update, alpha, rank_stats,
                       {"generation": t_gen, "embedding": t_embed, "update": t_update}, t_step)


def tree_rollouts(s: Setup, run: RunState, batch: offpolicy.Batch, upcoming: offpolicy.Batch | None):
    """Phase 1+2 on this rank's share of the prompts (torchrun), with its own RNG stream: the batch's trees —
    growing given base responses when the batch was sampled last step — and, when `upcoming` is given, its
    N base responses per prompt sampled in the same engine run with the current weights (offpolicy.py),
    returned whole on every rank (the next step's batch). Running out of memory shrinks the engine's row budget
    and prefill chunk for the rest of the run (s.backoff)."""
    cfg, step = s.cfg, run.step
    s.model.eval()
    mine, theirs = batch.shard(*D.shard_range(len(batch.prompts))), None
    if upcoming:
        theirs = upcoming.shard(*D.shard_range(len(upcoming.prompts)))
    with models.autocast(s.device, cfg.precision), D.full_params(s.policy), guards.sampling_guard(step + 1, s.run_dir):
        trees, stats, *ahead = R.rollout_trees(s.model, s.tokenizer, mine.prompts, mine.answers, cfg,
                                               D.rollout_rng(run.rng, cfg.seed, step), method=s.method,
                                               levels=mine.levels, progress=D.is_main(), bases=mine.bases,
                                               ahead=theirs.prompts if theirs else None, backoff=s.backoff)
    for tr in trees:
        tr.policy_lag = batch.lag(step)
    if upcoming:   # every rank keeps the whole next batch (a checkpoint saves it; ranks take their share)
        upcoming.bases, upcoming.sampled_at = D.gather_lists(ahead[0]), step
    return trees, stats, upcoming


def sample_prompts(s: Setup, run: RunState) -> tuple[list[str], list[str], list]:
    """The step's prompts, answers and difficulty levels, drawn from the data stream at run.cursor. With
    --max_prompt_tokens > 0 longer prompts are skipped and counted (each named once); a prompt that cannot fit
    the model's context is an error (check_fits). A problem whose characters alone exceed what the bound can
    hold in tokens is judged before tokenizing it: a 50 MB problem costs no minutes (data.surely_too_long)."""
    cfg, tokenizer = s.cfg, s.tokenizer
    context = faults.model_context(s.model)
    prompts, answers, levels = [], [], []
    misses = 0
    while len(prompts) < run.batch_size:
        index = problem_index(len(s.problems), run.cursor, cfg.seed)
        problem = s.problems[index]
        run.cursor += 1
        n_prompt = at_least = data.surely_too_long(problem["problem"], cfg.max_prompt_tokens or context, tokenizer)
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
    return prompts, answers, levels


def check_fits(n_prompt: int, cfg, context: int | None, where: str) -> None:
    """A prompt is never skipped by default (the release defines max_prompt_len but never applies it), but
    one whose longest root-to-leaf sequence cannot fit the model's context is an error naming it."""
    faults.check_prompt_fits(
        n_prompt, M.method_of(cfg).longest_response(cfg), context, where,
        flags=f" (--max_new_tokens {cfg.max_new_tokens}, --branch_budget {cfg.branch_budget})",
        fix="problems that fit: skip long prompts with --max_prompt_tokens N, or lower --max_new_tokens / use "
            "--branch_budget remaining")


def log_trees(s: Setup, step: int, trees: list[T.Tree], advantages: list, embeddings: list, alpha: float) -> None:
    """RUN/trees/step_XXXXXX.jsonl at step 1 and every --log_trees_every steps (tracking.write_trees)."""
    cfg = s.cfg
    if D.is_main() and tracking.trees_due(step, cfg.log_trees_every):
        if s.embedder and alpha == 0:   # Div_sib is worth seeing even once α has annealed to 0
            embeddings = embed_blocks(s.embedder, trees, cfg.embed_batch_size, cfg.sibling_groups)
        tracking.write_trees(s.run_dir, step, trees, s.tokenizer, advantages, embeddings, alpha, cfg.method,
                             cfg.value_estimate, cfg.sibling_groups)


def step_record(run: RunState, trees: list[T.Tree], train_trees: list[P.TrainTree], update: dict, alpha: float,
                rank_stats: list, seconds: dict, t_step: float) -> dict:
    """The step's line of metrics.jsonl: rollouts (reward, V(root), tree sizes), the update's statistics,
    rollout counters summed over ranks, and where the time went."""
    rewards = [b.reward for tr in trees for b in tr.blocks if b.terminal]
    record = {
        "step": run.step,
        "reward": float(np.mean(rewards)),
        "v_root": float(np.mean([tr.v_root for tr in trees])),
        "pass_rate": float(np.mean([tr.pass_rate for tr in trees])),
        "leaves_per_prompt": float(np.mean([tr.leaves for tr in trees])),
        "generated_tokens_per_prompt": float(np.mean([tr.generated_tokens for tr in trees])),
        "k_hat": float(np.mean([tr.k_hat for tr in trees])),
        "b_hat": float(np.mean([tr.b_hat for tr in trees])),
        "prompts": len(trees),
        "blocks": sum(len(t.trained) for t in train_trees),
        "alpha": alpha,
        "policy_entropy": float(np.mean([h for tr in trees for b in tr.blocks for h in b.entropies])),
        **T.level_stats(trees),     # leaves and PassRate per difficulty level (Fig. "leaf count")
        **update,
        "recomputed_prefix_tokens": sum(r.recomputed_prefix_tokens for r in rank_stats),
        # one-step off-policy (offpolicy.py): updates between the weights that sampled a token and θ; the stale
        # (base) tokens trained; the next step's prompts and share of the decode loop's row-steps
        "policy_lag": max(tr.policy_lag for tr in trees),
        "stale_tokens": sum(len(b.token_ids) for tr in trees if tr.policy_lag for b in tr.blocks if not b.branch),
        "ahead_prompts": len(run.ahead.prompts) if run.ahead else 0,
        "row_steps": sum(r.row_steps for r in rank_stats),
        "ahead_row_steps": sum(r.ahead_row_steps for r in rank_stats),
        "mean_batch_rows": sum(r.row_steps for r in rank_stats) / sum(r.decode_steps for r in rank_stats)
        if any(r.decode_steps for r in rank_stats) else 0.0,   # the engine's rows per decode step (0: generate)
        "seconds_generation_ahead": max(r.seconds_ahead for r in rank_stats),   # part of seconds_generation
        "oom_retries": sum(r.oom_retries for r in rank_stats) + update["oom_retries"],   # rollout + update
        "skipped_prompts": run.skipped_prompts,
        **{f"seconds_{name}": value for name, value in seconds.items()},
        "seconds_step": time.perf_counter() - t_step,
    }
    record["seconds_other"] = record["seconds_step"] - sum(seconds.values())
    return record


# --------------------------------------------------------------------------------------------------------
# The harness: setup, the loop, the guard, evaluation and checkpoints around the step
# --------------------------------------------------------------------------------------------------------
def train(cfg: C.Config) -> Path:
    """Run (or resume) training; returns the run folder. The first SIGTERM/SIGINT stops it at the end of the
    step with a checkpoint (signals.GracefulStop; a second signal, or --stop_timeout seconds without reaching
    the end of the step, stops at once); --resume then continues exactly. `held`: the run lock (runs.RunLock),
    released on the way out whatever happens."""
    with signals.GracefulStop(timeout=cfg.stop_timeout) as stop, contextlib.ExitStack() as held:
        return _train(cfg, stop, held)


def _train(cfg: C.Config, stop: signals.GracefulStop, held: contextlib.ExitStack) -> Path:
    t_run = time.perf_counter()
    s, run = setup(cfg, held)
    if s is None:   # a resume with nothing left to run (setup said so)
        return Path(cfg.out_dir)
    start_step, log = run.step, s.log
    if cfg.eval_every and start_step == 0:
        run_eval(s.model, s.tokenizer, s.eval_problems, cfg, s.device, "before", log, 0)
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc=cfg.method,
               dynamic_ncols=True, disable=not D.is_main())
    for _ in bar:
        if D.any_rank(stop.requested):   # the signal came before any step ran: nothing new to save
            log.say(f"stopped by {stop.requested} before step {run.step + 1}")
            return s.run_dir
        inject.crash_point("step")
        record = train_step(s, run)
        run.bad_steps_in_a_row = record["bad_steps_in_a_row"] = \
            run.bad_steps_in_a_row + 1 if record["nonfinite_minibatches"] or record["nonfinite_updates"] else 0
        log.write(record)
        nonfinite_guard(s, run, record)
        bar.set_postfix(reward=f"{record['reward']:.2f}", v_root=f"{record['v_root']:.2f}",
                        leaves=f"{record['leaves_per_prompt']:.1f}", loss=f"{record['loss']:.3f}")
        stopping = D.any_rank(stop.requested)   # torchrun: every rank stops at the same step
        if stopping:
            stop.cancel_timeout()   # the safe point is reached: --stop_timeout no longer applies
        saved = evaluate_and_save(s, run, stopping)
        if stopping and run.step < cfg.steps:
            bar.close()
            log.say(f"stopped by {stop.requested} after step {run.step}: checkpoint {saved}; continue with the "
                    f"same command plus --resume {s.run_dir}")
            return s.run_dir
    bar.close()
    finish(s, start_step, t_run)
    return s.run_dir


def setup(cfg: C.Config, held: contextlib.ExitStack) -> tuple[Setup | None, RunState]:
    """Everything before the first step: pre-flight checks (each user mistake is one line, faults.UserError,
    before anything slow runs), the run folder (locked into `held`) and its log, data, models, optimizer,
    and — with --resume — the checkpoint's weights and trainer state. (None, run) when a resume finds
    nothing left to run: said before loading the model."""
    D.init(cfg.device)         # torchrun: join the process group (this rank's GPU); one process: nothing
    device = models.pick_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir, log, checkpoint, state = open_run(cfg, held)
    run = RunState(batch_size=cfg.prompts_per_step, rng=random.Random(cfg.seed))
    if state and state["step"] >= cfg.steps:   # e.g. --resume of a finished run into a new --out_dir
        log.say(f"nothing left to run: {checkpoint} is at step {state['step']} of --steps {cfg.steps}; "
                f"raise --steps to train further")
        return None, run
    if cfg.resume and checkpoint is None:   # killed before its first checkpoint: safe in every job script
        log.say(f"--resume {cfg.resume}: no checkpoint there yet; starting at step 0")
    if checkpoint is None:
        faults.check_model(cfg.model)
    method = M.method_of(cfg)
    wants_embedder = method.embeds and (cfg.alpha_start != 0 or cfg.alpha_end != 0)
    if wants_embedder:
        faults.check_model(cfg.embed_model, "--embed_model", ("all-minilm-l6-v2",))
    problems = faults.load_data(cfg.train_data, "--train_data")
    eval_problems = faults.load_data(cfg.eval_data, "--eval_data", cfg.eval_limit or None) if cfg.eval_every else []
    torch.manual_seed(cfg.seed)

    source = checkpoint or cfg.model
    try:
        model, tokenizer = models.load_policy(source, device, models.policy_dtype(cfg.precision), seed=cfg.seed)
    except OSError as err:
        raise faults.UserError(f"--model {source}: cannot load it ({str(err).splitlines()[0]})") from err
    if not guards.all_finite(model.parameters()):   # an old checkpoint (before the weight guard) or a broken model
        raise faults.UserError(f"{'--resume' if checkpoint else '--model'} {source}: its weights hold non-finite "
                               f"values; expected an earlier checkpoint of the run or a healthy model")
    if cfg.gradient_checkpointing:   # the update's forward/backward only; generation keeps its KV cache
        models.enable_gradient_checkpointing(model)
    policy = D.wrap(model, cfg.parallel, cfg.precision)   # torchrun: FSDP2-sharded or DDP; else `model`
    if cfg.train_layout == "packed":   # flex: the start-up probe, not after a whole rollout (one line if it falls back)
        attention_kernel(cfg, device, model)
    optimizer = O.build_optimizer(model.parameters(), cfg)   # --optimizer_dtype param | fp32 (optim.py)
    if checkpoint:
        load_trainer_state(state, model, optimizer, run)
        log.say(f"resumed from {checkpoint} at step {run.step}")
    # Lines logged after the checkpoint are about to be redone (at step 0: all, the "before" eval included).
    dropped = log.truncate_after(run.step if run.step else -1) if cfg.resume else 0
    if dropped:
        log.say(f"dropped {dropped} log lines of steps after {run.step} (they are redone)")
    if cfg.resume and D.is_main():   # torn lines anywhere are named; so are earlier steps left with no record
        for line in tracking.lost_records(log.path, run.step, log.torn_lines,
                                          same_run=runs.run_folder_of(cfg.resume) == run_dir.resolve()):
            log.say(line)
    record_config(cfg, run_dir, checkpoint, state, run.step)
    # never loaded when α is 0 for the whole run
    embedder = models.load_embedder(cfg.embed_model, device) if wants_embedder else None
    guard = guards.WeightGuard(model, optimizer, cfg.guard_weights)
    return Setup(cfg, method, device, run_dir, log, model, policy, tokenizer, optimizer, guard, embedder,
                 problems, eval_problems), run


def open_run(cfg: C.Config, held: contextlib.ExitStack) -> tuple[Path, Log, str | None, dict | None]:
    """The run folder, locked (one run per folder: a second train.py into it stops naming the holder,
    runs.RunLock), checked (never two runs' records in one folder; --resume A --out_dir B refused when B holds
    another run) and its log; with --resume, the newest usable checkpoint and its trainer state (a damaged
    one is skipped with a warning, runs.pick_checkpoint) — whose experiment must be the one asked for
    (runs.check_resume_config: exit 2 listing the changed fields, unless --allow_config_change)."""
    run_dir = faults.check_writable(cfg.out_dir)
    if D.is_main():
        held.enter_context(runs.RunLock(run_dir))
    if cfg.resume and runs.check_resume_target(cfg.resume, run_dir, cfg.overwrite):
        faults.check_new_run(run_dir, True, delete=D.is_main())   # --overwrite true: B's other run replaced
    if not cfg.resume:   # never mix two runs' records in one folder (faults.check_new_run)
        faults.check_new_run(run_dir, cfg.overwrite, delete=D.is_main())
        D.barrier()
    log = Log(run_dir, cfg.report_to, json.loads(cfg.to_json()), enabled=D.is_main())   # torchrun: rank 0 writes
    checkpoint, state = runs.pick_checkpoint(cfg.resume, faults.resume_source(cfg.resume)) if cfg.resume \
        else (None, None)
    if state:
        runs.check_resume_config(state.get("config", {}), json.loads(cfg.to_json()), cfg.allow_config_change)
    return run_dir, log, checkpoint, state


def record_config(cfg: C.Config, run_dir: Path, checkpoint, state: dict | None, step: int) -> None:
    """config.json and git_commit.txt of a new run; on a resume that changed allowed (or forced) settings,
    the change is added to config.json's history (runs.with_history)."""
    if not D.is_main():
        return
    if not checkpoint or not (run_dir / "config.json").exists():
        (run_dir / "config.json").write_text(cfg.to_json())
        (run_dir / "git_commit.txt").write_text(git_commit() + "\n")
        return
    changes = runs.config_changes(state.get("config", {}), json.loads(cfg.to_json())) if state else {}
    if changes:
        saved = json.loads((run_dir / "config.json").read_text())
        runs.write_json(run_dir / "config.json", runs.with_history(saved, json.loads(cfg.to_json()), changes, step))


def load_trainer_state(state: dict, model, optimizer, run: RunState) -> None:
    """A checkpoint's optimizer state (any number of ranks) and trainer state (RunState), as read by
    runs.pick_checkpoint — its weights were loaded with the model."""
    D.load_optimizer_state(model, optimizer, state["optimizer"])
    run.restore(state)


def undo_broken_update(s: Setup, update: dict, probe_ids) -> None:
    """The weight guard's verdict after the update (guards.WeightGuard): an update that made a weight
    non-finite (ppo_update stopped at it) or the policy's logits on a prompt of the step non-finite is undone
    bit for bit and counted in update["nonfinite_updates"] (a bad step for nonfinite_guard)."""
    s.model.eval()
    if s.cfg.guard_weights and (update["nonfinite_updates"] or D.any_rank(
            not guards.logits_finite(s.policy, probe_ids))):
        s.guard.restore()
        update["nonfinite_updates"] = 1


def nonfinite_guard(s: Setup, run: RunState, record: dict) -> None:
    """After a step whose update skipped mini-batches with a non-finite loss or gradient norm
    (guards.skip_nonfinite) or was undone by the weight guard (undo_broken_update): say so, and stop the run
    after --max_bad_steps such steps in a row."""
    if record["nonfinite_minibatches"]:
        s.log.say(f"step {run.step}: {record['nonfinite_minibatches']} mini-batch(es) with a non-finite loss or "
                  f"gradient norm not applied ({run.bad_steps_in_a_row} step(s) in a row)")
    if record["nonfinite_updates"]:
        s.log.say(f"step {run.step}: the update made a weight or the policy's logits non-finite; weights and "
                  f"optimizer state restored to before it ({run.bad_steps_in_a_row} step(s) in a row)")
    if run.bad_steps_in_a_row >= s.cfg.max_bad_steps:
        last = models.resolve_checkpoint(str(s.run_dir))
        raise faults.NonFiniteStop(
            f"stopped at step {run.step}: {run.bad_steps_in_a_row} steps in a row had non-finite losses, "
            f"gradient norms or weights (--max_bad_steps {s.cfg.max_bad_steps}); last good checkpoint: "
            f"{last if last != str(s.run_dir) else 'none'}; expected a lower --lr or a check of the data")


def evaluate_and_save(s: Setup, run: RunState, stopping: bool) -> Path | None:
    """Held-out evaluation every --eval_every steps and at the end; a checkpoint every --save_every steps, at
    the end, and when a stop signal came. Returns the checkpoint written, if any."""
    cfg, done, saved = s.cfg, run.step, None
    if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
        run_eval(s.model, s.tokenizer, s.eval_problems, cfg, s.device, "after" if done == cfg.steps else "during",
                 s.log, done)
    if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps or stopping:
        saved = save_checkpoint(s.run_dir, done, s.model, s.tokenizer, s.optimizer,
                                {**run.trainer_state(), "config": json.loads(cfg.to_json())},
                                keep=cfg.keep_checkpoints)
    return saved


def finish(s: Setup, start_step: int, t_run: float) -> None:
    """The before → after held-out line, training.png, and closing the log and the process group."""
    cfg, log = s.cfg, s.log
    if D.is_main():
        evals = tracking.read_metrics(s.run_dir / "metrics.jsonl")[0]   # torn lines left out
        evals = [r for r in evals if r.get("eval") in ("before", "after")]
        if len(evals) >= 2:
            key = f"avg@{cfg.eval_k}"
            log.say(f"held-out {cfg.eval_data} {key}: before {evals[0][key]:.3f} → after {evals[-1][key]:.3f} "
                    f"({evals[-1]['n_samples']} samples each); {(time.perf_counter() - t_run) / 60:.1f} min")
        if start_step < cfg.steps:
            log.say(f"curves: {plot_run(s.run_dir)}")
    log.close()
    D.shutdown()


def run_eval(model, tokenizer, problems, cfg, device, label: str, log: Log, step: int) -> dict:
    model.eval()
    with D.full_params(model):     # sharded over ranks and gathered under torchrun
        result = evaluate.evaluate_problems(model, tokenizer, problems, cfg, k=cfg.eval_k,
                                            max_new_tokens=cfg.eval_max_new_tokens, desc=f"eval {label}")
    record = {"step": step, "eval": label, "data": cfg.eval_data, f"avg@{cfg.eval_k}": result["avg@k"],
              f"pass@{cfg.eval_k}": result["pass@k"], "n_problems": result["n_problems"],
              "n_samples": result["n_samples"], "seconds": result["seconds"]}
    log.write(record)
    se = math.sqrt(max(result["avg@k"] * (1 - result["avg@k"]), 1e-12) / max(result["n_samples"], 1))
    log.say(f"[eval {label} @ step {step}] {cfg.eval_data}: avg@{cfg.eval_k} {result['avg@k']:.3f} "
            f"(± {se:.3f}, {result['n_samples']} samples of {result['n_problems']} problems), "
            f"pass@{cfg.eval_k} {result['pass@k']:.3f}, {result['seconds']:.0f}s")
    return record


# --------------------------------------------------------------------------------------------------------
# Bookkeeping: data order, checkpoints, run folder
# --------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def epoch_order(n_problems: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n_problems))
    random.Random(seed + epoch).shuffle(order)
    return tuple(order)


def problem_index(n_problems: int, position: int, seed: int) -> int:
    """Problem at `position` of an endless stream of shuffled epochs (epoch e shuffled with seed + e); the
    position (a cursor) is all a checkpoint needs to continue the stream."""
    epoch, offset = divmod(position, n_problems)
    return epoch_order(n_problems, seed, epoch)[offset]


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


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, trainer: dict, keep: int = 0) -> Path:
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
        raise faults.NonFiniteStop(f"step {step}: the weights hold a non-finite value; checkpoint not written; "
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
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if sha.returncode == 0 else "unknown"
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
    left.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="reward (all leaves)", alpha=0.7)
    left.plot([r["step"] for r in steps], [r["v_root"] for r in steps], label="V(root) (base responses)", alpha=0.7)
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
    path = run_dir / "training.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> Path:
    cfg = C.parse_args(argv, description=__doc__.splitlines()[0])
    return train(cfg)


if __name__ == "__main__":
    faults.main_guard(main)
