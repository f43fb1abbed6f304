"""train.py — the training loop: Algorithm DATPO (App. F) on one device, and the paper's baselines.

    python train.py --model Qwen/Qwen2.5-3B          # the paper's run on one GPU (preset "paper")
    python train.py --preset demo                    # 2 CPU cores, offline, SmolLM2-135M on arithmetic
    python train.py --preset tiny --steps 2          # tests

One step (Algorithm DATPO):
  sample prompts q ~ Q
  Phase 1+2  tree rollouts: N base responses, V(root), K̂/B̂, forks, branches        (rollout.py, tree.py)
  Phase 3    block advantages Â(b) = Â_base(b) + 1[Â_base > 0]·α·Div_sib(b)            (advantage.py)
  Phase 4    old log-probs (no grad) → PPO epochs over mini-batches of blocks (whole trees, re-shuffled every
             epoch), micro-batches sized in tokens with gradient accumulation → clipped token-level objective
             (Eq. DATPO, separate clip low/high, no KL) → grad-norm clip → AdamW; then anneal α.
The update forwards each tree once as a packed sequence under a tree attention mask (packing.py): the prompt
once, every block once, each token attending to its own root-to-leaf path, so every token of the tree is
trained exactly once. TreeRL/AttnRL's root-to-leaf flattening (App. F.4) is reproduced by weighting each token
by the number of trained paths through it. `--train_layout rows` forwards each leaf's new tokens as a row with
its whole prefix as context instead (the simple path, and the tests' oracle).
"""
from __future__ import annotations

import functools
import json
import math
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import advantage as A
import config as C
import data
import distributed as D
import evaluate
import faults
import models
import optim as O
import packing as P
import rollout as R
import tracking
import tree as T
from tracking import Log


# --------------------------------------------------------------------------------------------------------
# Phase 3: advantages per method
# --------------------------------------------------------------------------------------------------------
def embed_blocks(embedder, trees: list[T.Tree], batch_size: int) -> list[np.ndarray | None]:
    """Block embeddings for the sibling-diversity term, once per step and batched over the whole batch.
    Only blocks that have a sibling are embedded (Div_sib of a lone block is 0 whatever its embedding)."""
    wanted = []
    for t, tr in enumerate(trees):
        counts: dict = {}
        for b in tr.blocks:
            counts[b.parent] = counts.get(b.parent, 0) + 1
        wanted += [(t, i) for i, b in enumerate(tr.blocks) if counts[b.parent] > 1]
    out: list[np.ndarray | None] = [None] * len(trees)
    if not wanted:
        return out
    vectors = embedder.encode([trees[t].blocks[i].text for t, i in wanted], batch_size=batch_size,
                              convert_to_numpy=True, show_progress_bar=False)
    dim = vectors.shape[1]
    for t, tr in enumerate(trees):
        out[t] = np.zeros((len(tr.blocks), dim), dtype=np.float32)
    for (t, i), v in zip(wanted, vectors):
        out[t][i] = v
    return out


def tree_advantages(method: str, tr: T.Tree, alpha: float, scope: str, embeddings,
                    value_estimate: str = "paper") -> list[float]:
    """One advantage per block of the tree, by the method's formula (advantage.py)."""
    if method == "datpo":
        return A.datpo_advantages(tr.parents, tr.rewards, embeddings, alpha, scope, value_estimate,
                                  tr.branch_flags)
    if method == "grpo":
        return A.grpo_advantages(tr.rewards)
    if method == "drgrpo":
        return A.drgrpo_advantages(tr.rewards)
    if method in ("treerl", "attnrl"):
        return A.treerl_advantages(tr.parents, tr.rewards)
    raise ValueError(f"unknown method {method!r}")


# --------------------------------------------------------------------------------------------------------
# What the update trains: one TrainTree per prompt
# --------------------------------------------------------------------------------------------------------
def train_tree(tr: T.Tree, adv: list[float], method: str) -> P.TrainTree:
    """The tree with one advantage per block. DATPO and the parallel baselines train every tree token once
    (weight 1). TreeRL/AttnRL train root-to-leaf paths (App. F.4): a block counts once per trained path
    through it — AttnRL's paths are the branched ones only; unbranched responses still count in V(root)."""
    paths = None
    weights = [1.0] * len(tr.blocks)
    if method in ("treerl", "attnrl"):
        paths = [T.path_to(tr.blocks, leaf) for leaf, b in enumerate(tr.blocks) if b.terminal]
        if method == "attnrl":
            paths = [p for p in paths if len(p) > 1]
        weights = [float(m) for m in P.path_multiplicity(tr.parents, paths)]
    return P.TrainTree(tr.prompt_ids, tr.parents, [b.token_ids for b in tr.blocks], list(adv), weights, paths)


def check_fits(n_prompt: int, cfg, context: int | None, where: str) -> None:
    """A prompt is never skipped by default (the release defines max_prompt_len but never applies it), but
    one whose longest root-to-leaf sequence cannot fit the model's context is an error naming it."""
    generated = cfg.max_new_tokens if cfg.method in ("grpo", "drgrpo") else \
        T.max_path_tokens(cfg.max_new_tokens, cfg.branch_budget)
    if context and n_prompt + generated > context:
        raise faults.UserError(f"{where}: a prompt of {n_prompt} tokens + up to {generated} generated tokens "
                         f"(--max_new_tokens {cfg.max_new_tokens}, --branch_budget {cfg.branch_budget}) exceeds "
                         f"the model's context of {context} tokens; skip long prompts with --max_prompt_tokens N, "
                         f"or lower --max_new_tokens / use --branch_budget remaining")


def rollout_shape(cfg) -> dict:
    """rollout_trees arguments per method: GRPO/Dr.GRPO sample G parallel responses (no branches); AttnRL
    branches (K, B) on the responses its adaptive sampling picks; DATPO/TreeRL use adaptive_budget, or fixed
    (K, B) when cfg.adaptive is False."""
    if cfg.method in ("grpo", "drgrpo"):
        return dict(n_base=cfg.group_size, budget=lambda v: (0, 0))
    if cfg.method == "attnrl":
        return dict(budget=lambda v: (cfg.k_max, cfg.b_max), expand=T.attnrl_expansion)
    return {}


def trainable(tr: T.Tree, method: str) -> bool:
    """AttnRL drops trees whose leaves all have the same reward (no signal: all-correct or all-wrong
    prompts) before the update, so they do not count in the loss normaliser or the batch. The other methods
    keep every tree: a zero-advantage row costs no compute but counts in Eq. DATPO's normaliser."""
    if method != "attnrl":
        return True
    return len({b.reward for b in tr.blocks if b.terminal}) > 1


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
    """The most target tokens a trained sequence can hold: a block (≤ max_new_tokens, tree.branch_limit),
    or for TreeRL/AttnRL a whole root-to-leaf path, which with --branch_budget full can reach
    tree.max_path_tokens = 2·max_new_tokens − 1. Dr.GRPO's constant normaliser is this per sequence."""
    if cfg.method in ("treerl", "attnrl"):
        return T.max_path_tokens(cfg.max_new_tokens, cfg.branch_budget)
    return cfg.max_new_tokens


def attention_kernel(cfg, device, model=None) -> str:
    """flex (block-sparse, cost follows the tree) on CUDA when its start-up probe passes, else tree (SDPA
    segment by segment over each segment's ancestors: cost follows the tree too); dense (one L × L mask)
    only when asked. packing.resolve_kernel probes flex once and says why it falls back."""
    dtype = torch.float32 if cfg.precision == "fp32" else torch.bfloat16   # what attention runs in
    return P.resolve_kernel(cfg.packed_attention, device, model, dtype)[0]


def ppo_update(model, optimizer, trees: list[P.TrainTree], cfg, pad_id: int, device, rng: random.Random) -> dict:
    """PPO epochs over mini-batches of blocks with micro-batch gradient accumulation (App. E.2, Alg. DATPO).

    Each epoch re-shuffles the mini-batches (whole trees, or random blocks: cfg.mini_batch_grouping); each
    mini-batch's loss is −Σ w·min(ρA, clip(ρ)A) / normaliser, the normaliser computed from its units alone.
    Blocks whose advantage is zero count in the normaliser but cost no forward or backward.
    Old log-probs: θ_old = θ until the first optimizer step, so the first mini-batch of the first epoch
    uses its own detached log-probs; every other block gets a no-grad forward with the same packing first.
    """
    kernel = attention_kernel(cfg, device, D.unwrap(model))
    # packed: the tree kernel's attention backend stays set through every backward (activation checkpointing
    # recomputes the forward there); the rows layout runs the model as it is
    with P.kernel_backend(D.unwrap(model), kernel if cfg.train_layout == "packed" else "dense"):
        return _ppo_epochs(model, optimizer, trees, cfg, pad_id, device, rng, kernel)


def _ppo_epochs(model, optimizer, trees, cfg, pad_id, device, rng, kernel) -> dict:
    """ppo_update's epochs (see its docstring), inside the packed kernel's attention backend."""
    offsets = P.token_offsets(trees)
    adv = torch.tensor([a for tr in trees for a, toks in zip(tr.advantages, tr.tokens) for _ in toks],
                       dtype=torch.float32, device=device)
    old = torch.zeros_like(adv)
    have_old = torch.zeros(len(adv), dtype=torch.bool, device=device)

    def micro_batches(units, size=None):   # size: tokens (packed) or rows per micro-batch; halved on OOM
        packed = cfg.train_layout == "packed"
        return P.layout_micro_batches(trees, units, offsets, cfg.train_layout,
                                      size if packed and size else cfg.max_tokens_per_micro_batch,
                                      size if not packed and size else cfg.micro_batch_size)

    def logprobs(micro):   # flex: packed lengths padded to buckets of the configured budget (static shapes)
        return P.micro_logprobs(model, micro, pad_id, device, kernel, bucket_tokens=cfg.max_tokens_per_micro_batch)

    first_epoch = P.minibatches(trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
    budget = cfg.max_tokens_per_micro_batch if cfg.train_layout == "packed" else cfg.micro_batch_size
    oom = {"oom_retries": 0}   # micro-batch budgets halved after running out of memory (faults.halving_retry)
    model.eval()  # no dropout: old and new log-probs must come from the same function
    with torch.no_grad(), models.autocast(device, cfg.precision), D.full_params(model):
        for k, units in enumerate(first_epoch):
            if k > 0 or cfg.ppo_epochs > 1:
                def fill_old(size, units=units):   # a retry after OOM rewrites the same entries
                    for micro in D.my_share(micro_batches(units, size)):   # torchrun: this rank's micro-batches
                        if micro is None:
                            continue
                        faults.oom_point("update")     # DATPO_OOM_AT=update (tests)
                        gidx = torch.tensor(micro.gidx, device=device)
                        old[gidx] = logprobs(micro).float()
                        have_old[gidx] = True

                faults.halving_retry(fill_old, budget, "the update's old log-probs", oom, retry=not D.active())
    old, have_old = D.merge_shares(old, have_old)   # torchrun: epochs re-shuffle, so every rank needs them all

    stats = {"loss": 0.0, "clip_frac": 0.0, "grad_norm": 0.0, "optimizer_steps": 0,
             "trained_blocks": sum(len(P.live_blocks(tr, tr.trained)) for tr in trees), "nonfinite_minibatches": 0,
             "forwarded_tokens": 0, "unique_tokens": sum(tr.unique_tokens for tr in trees if tr.trained),
             "oom_retries": oom["oom_retries"]}
    clip_tokens = total_tokens = forwarded = 0
    for epoch in range(cfg.ppo_epochs):
        epoch_minibatches = first_epoch if epoch == 0 else P.minibatches(
            trees, cfg.mini_batch_size, cfg.mini_batch_grouping, rng)
        for units in epoch_minibatches:
            norm = P.loss_normaliser(trees, units, cfg.loss_norm, cfg.max_new_tokens, max_row_targets(cfg))

            def accumulate(size):   # this mini-batch's gradients in micro-batches of `size` (halved on OOM)
                micros = micro_batches(units, size)
                optimizer.zero_grad(set_to_none=True)
                sums = torch.zeros(3, dtype=torch.float64, device=device)   # loss, clipped, tokens: one sync
                mine = D.my_share(micros)          # one process: all of them; torchrun: this rank's, padded
                for j, micro in enumerate(mine):
                    D.sync_gradients(model, now=j == len(mine) - 1)   # DDP: one all-reduce per optimizer step
                    if micro is None:              # no units left here: a zero-gradient pass joins the collectives
                        D.idle_pass(model, pad_id, device)
                        continue
                    faults.oom_point("update")     # DATPO_OOM_AT=update (tests)
                    with models.autocast(device, cfg.precision):
                        new = logprobs(micro).float()
                    gidx = torch.tensor(micro.gidx, device=device)
                    old_lp = torch.where(have_old[gidx], old[gidx], new.detach())
                    objective, active = clipped_objective(new, old_lp, adv[gidx], cfg.clip_low, cfg.clip_high)
                    weights = torch.tensor(micro.weights, dtype=objective.dtype, device=device)
                    loss = -(weights * objective).sum() / norm
                    (loss * D.grad_scale()).backward()   # × world size: DDP/FSDP average gradients over ranks
                    sums += torch.stack([loss.detach().double(), active.sum().double(),
                                         torch.tensor(float(active.numel()), dtype=torch.float64, device=device)])
                return len(micros), sums.tolist(), sum(m.forwarded for m in mine if m is not None)

            n_micro, (mb_loss, clipped, counted), fed = faults.halving_retry(   # OOM: smaller micro-batches
                accumulate, budget, "the update's micro-batches", stats,
                reset=lambda: optimizer.zero_grad(set_to_none=True), retry=not D.active())
            if not n_micro:
                continue
            clip_tokens, total_tokens, forwarded = clip_tokens + int(clipped), total_tokens + int(counted), forwarded + fed
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            if faults.skip_nonfinite(mb_loss, grad_norm, optimizer):   # not applied, counted (faults.py)
                stats["nonfinite_minibatches"] += 1
                continue
            optimizer.step()
            stats["loss"] += mb_loss
            stats["grad_norm"] += float(grad_norm)
            stats["optimizer_steps"] += 1
    stats["loss"], clip_tokens, total_tokens, forwarded = D.all_reduce([stats["loss"], clip_tokens, total_tokens,
                                                                        forwarded])   # torchrun: over ranks
    steps = max(stats["optimizer_steps"], 1)
    stats["loss"] /= steps
    stats["grad_norm"] /= steps
    stats["clip_frac"] = clip_tokens / max(total_tokens, 1)
    stats["forwarded_tokens"] = forwarded / cfg.ppo_epochs      # per pass over the batch
    stats["attention_kernel"] = kernel if cfg.train_layout == "packed" else "rows"   # in metrics.jsonl
    optimizer.zero_grad(set_to_none=True)
    return stats


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


def save_checkpoint(run_dir: Path, step: int, model, tokenizer, optimizer, trainer: dict) -> Path:
    """Weights (safetensors, loadable with from_pretrained), tokenizer, optimizer, step and RNG states.
    Written under a temporary name and renamed, so a crash never leaves half a checkpoint; then the
    `latest` pointer is replaced atomically. Under torchrun every rank calls it (gathering FSDP shards is
    collective) and rank 0 writes the full state."""
    weights, optimizer_state = D.model_state_dict(model), D.optimizer_state_dict(model, optimizer)
    if not D.is_main():
        D.barrier()
        return None
    folder = run_dir / "checkpoints"
    final = folder / f"step_{step:06d}"
    tmp = folder / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
    faults.crash_point("checkpoint-write")   # fault-injection tests kill the run here, half written
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": optimizer_state, **trainer}, tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    pointer = folder / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, folder / "latest")
    D.barrier()   # no rank reads or resumes from a checkpoint before it is complete
    return final


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

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
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


# --------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------
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


def train(cfg: C.Config) -> Path:
    """Run (or resume) training; returns the run folder. The first SIGTERM/SIGINT stops it at the end of the
    step with a checkpoint (faults.GracefulStop); --resume then continues exactly."""
    with faults.GracefulStop() as stop:
        return _train(cfg, stop)


def _train(cfg: C.Config, stop: faults.GracefulStop) -> Path:
    t_run = time.perf_counter()
    D.init(cfg.device)         # torchrun: join the process group (this rank's GPU); one process: nothing
    device = models.pick_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # ---- pre-flight: every user mistake is one line (faults.UserError) before anything slow runs ----
    run_dir = faults.check_writable(cfg.out_dir)
    if not cfg.resume:   # never mix two runs' records in one folder (faults.check_new_run)
        faults.check_new_run(run_dir, cfg.overwrite, delete=D.is_main())
        D.barrier()
    log = Log(run_dir, cfg.report_to, json.loads(cfg.to_json()), enabled=D.is_main())   # torchrun: rank 0 writes
    checkpoint = faults.resume_source(cfg.resume) if cfg.resume else None
    if cfg.resume and checkpoint is None:   # killed before its first checkpoint: safe in every job script
        log.say(f"--resume {cfg.resume}: no checkpoint there yet; starting at step 0")
    if checkpoint is None:
        faults.check_model(cfg.model)
    wants_embedder = cfg.method == "datpo" and (cfg.alpha_start != 0 or cfg.alpha_end != 0)
    if wants_embedder:
        faults.check_model(cfg.embed_model, "--embed_model", ("all-minilm-l6-v2",))
    problems = faults.load_data(cfg.train_data, "--train_data")
    eval_problems = faults.load_data(cfg.eval_data, "--eval_data", cfg.eval_limit or None) if cfg.eval_every else []
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)

    source = checkpoint or cfg.model
    try:
        model, tokenizer = models.load_policy(source, device, models.policy_dtype(cfg.precision), seed=cfg.seed)
    except OSError as err:
        raise faults.UserError(f"--model {source}: cannot load it ({str(err).splitlines()[0]})") from err
    if cfg.gradient_checkpointing:   # the update's forward/backward only; generation keeps its KV cache
        models.enable_gradient_checkpointing(model)
    policy = D.wrap(model, cfg.parallel, cfg.precision)   # torchrun: FSDP2-sharded or DDP; else `model`
    if cfg.train_layout == "packed":   # flex: the start-up probe, not after a whole rollout (one line if it falls back)
        attention_kernel(cfg, device, model)
    optimizer = O.build_optimizer(model.parameters(), cfg)   # --optimizer_dtype param | fp32 (optim.py)
    start_step, cursor, skipped, batch_size, bad_in_a_row = 0, 0, 0, cfg.prompts_per_step, 0
    if checkpoint:
        state = torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=False, mmap=True)
        D.load_optimizer_state(model, optimizer, state["optimizer"])
        start_step, cursor, skipped = state["step"], state["cursor"], state.get("skipped_prompts", 0)
        batch_size = state.get("batch_size", batch_size)
        bad_in_a_row = state.get("bad_steps_in_a_row", 0)
        set_rng_state(rng, state["rng"])
        log.say(f"resumed from {checkpoint} at step {start_step}")
    # Lines logged after the checkpoint are about to be redone (at step 0: all, the "before" eval included).
    dropped = log.truncate_after(start_step if start_step else -1) if cfg.resume else 0
    if dropped:
        log.say(f"dropped {dropped} log lines of steps after {start_step} (they are redone)")
    if D.is_main() and (not checkpoint or not (run_dir / "config.json").exists()):
        (run_dir / "config.json").write_text(cfg.to_json())
        (run_dir / "git_commit.txt").write_text(git_commit() + "\n")

    embedder = None
    if wants_embedder:
        embedder = models.load_embedder(cfg.embed_model, device)   # never loaded when α is 0 for the whole run
    pad_id = tokenizer.pad_token_id
    context = getattr(model.config, "max_position_embeddings", None)

    if cfg.eval_every and start_step == 0:
        run_eval(model, tokenizer, eval_problems, cfg, device, "before", log, 0)

    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps, desc=cfg.method, dynamic_ncols=True,
               disable=not D.is_main())
    for step in bar:
        t_step = time.perf_counter()
        if D.any_rank(stop.requested):   # the signal came before any step ran: nothing new to save
            log.say(f"stopped by {stop.requested} before step {step + 1}")
            return run_dir
        faults.crash_point("step")
        # ---- sample prompts q ~ Q (with --max_prompt_tokens > 0, longer ones are skipped and counted) ----
        prompts, answers, levels = [], [], []
        misses = 0
        while len(prompts) < batch_size:
            index = problem_index(len(problems), cursor, cfg.seed)
            problem = problems[index]
            cursor += 1
            prompt = data.format_prompt(problem["problem"], tokenizer, cfg.prompt_style, cfg.few_shot)
            n_prompt = len(tokenizer(prompt, add_special_tokens=False).input_ids)
            if cfg.max_prompt_tokens and n_prompt > cfg.max_prompt_tokens:
                skipped += 1
                misses += 1
                if misses > len(problems):
                    raise faults.UserError(
                        f"--train_data {cfg.train_data}: every prompt is longer than --max_prompt_tokens "
                        f"{cfg.max_prompt_tokens}; expected problems that fit, or a larger --max_prompt_tokens")
                continue
            check_fits(n_prompt, cfg, context, f"{cfg.train_data} problem #{index}")
            prompts.append(prompt)
            answers.append(problem["answer"])
            levels.append(problem.get("level"))

        # ---- Phase 1+2: tree rollouts ----
        model.eval()
        lo, hi = D.shard_range(len(prompts))   # torchrun: this rank's prompts, its own RNG stream
        with models.autocast(device, cfg.precision), D.full_params(policy):
            trees, rstats = R.rollout_trees(model, tokenizer, prompts[lo:hi], answers[lo:hi], cfg,
                                            D.rollout_rng(rng, cfg.seed, step), levels=levels[lo:hi],
                                            **rollout_shape(cfg))

        # ---- Phase 3: block advantages ----
        t0 = time.perf_counter()
        alpha = A.alpha_at(step, cfg.steps, cfg.alpha_start, cfg.alpha_end) if cfg.method == "datpo" else 0.0
        embeddings = embed_blocks(embedder, trees, cfg.embed_batch_size) if (embedder and alpha != 0) else [None] * len(trees)
        t_embed = time.perf_counter() - t0
        # torchrun: every rank now holds the whole step (all ranks' trees in prompt order), so metrics stay
        # global and every rank forms the same mini-batches as one process would
        trees, embeddings, rank_stats = D.gather_lists(trees, embeddings, [rstats])
        t_gen = max(s.seconds_base + s.seconds_forks + s.seconds_branches for s in rank_stats)
        train_trees, kept_leaves, advantages = [], 0, [None] * len(trees)
        for t, (tr, emb) in enumerate(zip(trees, embeddings)):
            if trainable(tr, cfg.method):
                advantages[t] = tree_advantages(cfg.method, tr, alpha, cfg.alpha_scope, emb, cfg.value_estimate)
                train_trees.append(train_tree(tr, advantages[t], cfg.method))
                kept_leaves += tr.leaves
        if D.is_main() and tracking.trees_due(step + 1, cfg.log_trees_every):
            if embedder and alpha == 0:   # Div_sib is worth seeing even once α has annealed to 0
                embeddings = embed_blocks(embedder, trees, cfg.embed_batch_size)
            tracking.write_trees(run_dir, step + 1, trees, tokenizer, advantages, embeddings, alpha, cfg.method,
                                 cfg.value_estimate)

        # ---- Phase 4: policy update ----
        t0 = time.perf_counter()
        model.train()
        update = ppo_update(policy, optimizer, train_trees, cfg, pad_id, device, rng)
        t_update = time.perf_counter() - t0

        leaves = [tr.leaves for tr in trees]
        if cfg.method == "attnrl":
            target = cfg.prompts_per_step * cfg.n_base * (1 + cfg.k_max * cfg.b_max)
            batch_size = attnrl_batch_size(batch_size, kept_leaves, target, cfg.attnrl_lambda,
                                           cap=4 * cfg.prompts_per_step)
        rewards = [b.reward for tr in trees for b in tr.blocks if b.terminal]
        record = {
            "step": step + 1,
            "reward": float(np.mean(rewards)),
            "v_root": float(np.mean([tr.v_root for tr in trees])),
            "pass_rate": float(np.mean([tr.pass_rate for tr in trees])),
            "leaves_per_prompt": float(np.mean(leaves)),
            "generated_tokens_per_prompt": float(np.mean([tr.generated_tokens for tr in trees])),
            "k_hat": float(np.mean([tr.k_hat for tr in trees])),
            "b_hat": float(np.mean([tr.b_hat for tr in trees])),
            "prompts": len(trees),
            "blocks": sum(len(t.trained) for t in train_trees),
            "alpha": alpha,
            "policy_entropy": float(np.mean([h for tr in trees for b in tr.blocks for h in b.entropies])),
            **T.level_stats(trees),     # leaves and PassRate per difficulty level (Fig. "leaf count")
            **update,
            "recomputed_prefix_tokens": sum(s.recomputed_prefix_tokens for s in rank_stats),
            "oom_retries": sum(s.oom_retries for s in rank_stats) + update["oom_retries"],   # rollout + update
            "skipped_prompts": skipped,
            "seconds_generation": t_gen,
            "seconds_embedding": t_embed,
            "seconds_update": t_update,
            "seconds_step": time.perf_counter() - t_step,
        }
        record["seconds_other"] = record["seconds_step"] - t_gen - t_embed - t_update
        bad_in_a_row = bad_in_a_row + 1 if update["nonfinite_minibatches"] else 0
        record["bad_steps_in_a_row"] = bad_in_a_row
        log.write(record)
        if update["nonfinite_minibatches"]:
            log.say(f"step {step + 1}: {update['nonfinite_minibatches']} mini-batch(es) with a non-finite loss or "
                    f"gradient norm not applied ({bad_in_a_row} step(s) in a row)")
        if bad_in_a_row >= cfg.max_bad_steps:
            last = models.resolve_checkpoint(str(run_dir))
            raise faults.NonFiniteStop(
                f"stopped at step {step + 1}: {bad_in_a_row} steps in a row had non-finite losses or gradient "
                f"norms (--max_bad_steps {cfg.max_bad_steps}); last good checkpoint: "
                f"{last if last != str(run_dir) else 'none'}; expected a lower --lr or a check of the data")
        bar.set_postfix(reward=f"{record['reward']:.2f}", v_root=f"{record['v_root']:.2f}",
                        leaves=f"{record['leaves_per_prompt']:.1f}", loss=f"{update['loss']:.3f}")

        done = step + 1
        stopping = D.any_rank(stop.requested)   # torchrun: every rank stops at the same step
        if cfg.eval_every and (done % cfg.eval_every == 0 or done == cfg.steps):
            run_eval(model, tokenizer, eval_problems, cfg, device, "after" if done == cfg.steps else "during", log, done)
        if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps or stopping:
            saved = save_checkpoint(run_dir, done, model, tokenizer, optimizer,
                                    {"step": done, "cursor": cursor, "skipped_prompts": skipped,
                                     "batch_size": batch_size, "bad_steps_in_a_row": bad_in_a_row,
                                     "rng": rng_state(rng), "config": json.loads(cfg.to_json())})
        if stopping and done < cfg.steps:
            bar.close()
            log.say(f"stopped by {stop.requested} after step {done}: checkpoint {saved}; continue with the same "
                    f"command plus --resume {run_dir}")
            return run_dir
    bar.close()
    if D.is_main():
        evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in evals if r.get("eval") in ("before", "after")]
        if len(evals) >= 2:
            key = f"avg@{cfg.eval_k}"
            log.say(f"held-out {cfg.eval_data} {key}: before {evals[0][key]:.3f} → after {evals[-1][key]:.3f} "
                    f"({evals[-1]['n_samples']} samples each); {(time.perf_counter() - t_run) / 60:.1f} min")
        if start_step < cfg.steps:
            log.say(f"curves: {plot_run(run_dir)}")
    log.close()
    D.shutdown()
    return run_dir


def main(argv: list[str] | None = None) -> Path:
    cfg = C.parse_args(argv, description=__doc__.splitlines()[0])
    return train(cfg)


if __name__ == "__main__":
    faults.main_guard(main)
