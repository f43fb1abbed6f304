r"""Tree-packed update vs rows, one run: tokens forwarded per unique tree token and update seconds.

    python bench/bench_update.py                         # both parts below (~15 min on 2 idle CPU cores)
    python bench/bench_update.py --part demo --methods paper grpo treerl --time paper grpo treerl \
        --demo_tokens 2048 4096
    python bench/bench_update.py --part paper --methods paper grpo --time_paper paper grpo \
        --cpu_tokens 8192 --timed_trees 4

Run it alone on the machine: two PyTorch processes sharing 2 cores slow each other unevenly (the load
average at the start is printed).

demo:  the project's own rollouts (SmolLM2-135M, demo scale: 8 prompts, 64 new tokens) for each method's
       preset; forwarded / unique tokens for packed (trees and blocks grouping, at several token budgets) and
       rows, then one ppo_update per layout, budget and attention kernel (tree, dense) on copies of the
       model, same trees and seed (update seconds, loss).
paper: synthetic trees of paper-like lengths (prompt ≈ 150, responses ≈ 600, DATPO (N, K, B) = (4, 3, 4);
       GRPO G = 16; TreeRL/AttnRL (6, 2, 2)), token counts at the paper's micro-batch budget, update seconds
       with a small random model, and the computed peak memory of the paper's run on one 80 GB GPU.
Forwarded tokens count every token fed to the model in one pass over the batch (padding excluded); "unique"
is prompt once + every generated token once. For the counts every block is treated as trainable (a
zero-advantage block is skipped by both layouts in training).
"""
import argparse
import copy
import dataclasses
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

import advantage as A  # noqa: E402
import config as C  # noqa: E402
import data  # noqa: E402
import methods as M  # noqa: E402
import models  # noqa: E402
import packing as P  # noqa: E402
import rollout as R  # noqa: E402
import train  # noqa: E402
import tree as T  # noqa: E402
from runtime import atomic  # noqa: E402


def trees_from_json(path: Path) -> list[T.Tree]:
    """The rollout trees a --cache file holds (JSON written by demo_part), rebuilt; a file that is not such
    a list is one line (exit 2) naming it."""
    try:
        return [T.Tree(**{**tr, "blocks": [T.Block(**b) for b in tr["blocks"]]})
                for tr in json.loads(path.read_text(encoding="utf-8"))]
    except (OSError, ValueError, TypeError, KeyError) as err:
        print(f"bench_update.py: error: --cache {path}: not a tree cache this script wrote ({err}); delete "
              f"it to sample the rollouts again", file=sys.stderr)
        sys.exit(2)


def advantages(tr: T.Tree, cfg) -> list[float]:
    """The method's advantage of every block at α = 0 (advantage.score_tree)."""
    return [b.advantage for b in A.score_tree(tr, M.METHODS[cfg.method], 0.0, None, cfg.alpha_scope)]

def forwarded_per_unique(trees: list[P.TrainTree], cfg, layout: str, grouping: str) -> float:
    """Tokens forwarded in one pass over the batch per unique tree token, every block live."""
    live = [P.TrainTree(t.prompt_ids, t.parents, t.tokens, [1.0] * len(t.tokens), t.weights, t.paths)
            for t in trees]
    offsets = P.token_offsets(live)
    forwarded = 0
    for units in P.minibatches(live, cfg.mini_batch_size, grouping, random.Random(0)):
        for micro in P.layout_micro_batches(live, units, offsets, layout, cfg.max_tokens_per_micro_batch,
                                            cfg.micro_batch_size):
            forwarded += micro.forwarded
    return forwarded / sum(t.unique_tokens for t in live if t.trained)


def timed_updates(model, trees, cfg, pad_id, budgets=(), kernels=("tree", "dense")) -> dict:
    """One ppo_update per layout on copies of the model: same trees, same seed → (seconds, loss, steps).
    The packed layout at the config's token budget and at each of `budgets`, under each attention kernel
    (tree: SDPA per segment over its ancestors; dense: one [L, L] mask)."""
    out = {}
    with torch.no_grad():      # warm-up, so the first timed layout does not pay for one-off allocations
        model(input_ids=torch.tensor([trees[0].prompt_ids[:32]]))
    runs = [("rows", None, None)] + [("packed", b, k) for k in kernels
                                     for b in sorted({cfg.max_tokens_per_micro_batch, *budgets})]
    for layout, budget, kernel in runs:
        cfg.train_layout = layout
        if budget:
            cfg.max_tokens_per_micro_batch = budget
            cfg.packed_attention = kernel
        copy_ = copy.deepcopy(model).train()
        optimizer = torch.optim.AdamW(copy_.parameters(), lr=cfg.lr)
        t0 = time.perf_counter()
        stats = train.ppo_update(copy_, optimizer, trees, cfg, pad_id, "cpu", random.Random(0))
        out[layout if budget is None else f"packed {budget} {kernel}"] = (
            time.perf_counter() - t0, stats["loss"], stats["optimizer_steps"])
        del copy_, optimizer
    return out


def count_table(label: str, trees, cfg, budgets=()) -> None:
    """forwarded / unique for rows, packed at the config's token budget (and at each of `budgets`: a smaller
    budget cuts more trees, whose ancestors are forwarded again), and packed with random-block
    mini-batches."""
    rows = forwarded_per_unique(trees, cfg, "rows", "trees")
    own = cfg.max_tokens_per_micro_batch
    packed = {}
    for budget in sorted({own, *budgets}):
        cfg.max_tokens_per_micro_batch = budget
        packed[budget] = forwarded_per_unique(trees, cfg, "packed", "trees")
    cfg.max_tokens_per_micro_batch = own
    blocks = forwarded_per_unique(trees, cfg, "packed", "blocks")
    unique = sum(t.unique_tokens for t in trees if t.trained)
    per_budget = "  ".join(f"{b}{'*' if b == own else ''}: {v:5.3f}" for b, v in packed.items())
    print(f"  {label:10s} unique {unique:8d}   forwarded/unique: rows {rows:5.2f}   packed ({per_budget})   "
          f"packed+random blocks {blocks:5.2f}   (* = the preset's budget)", flush=True)


# --------------------------------------------------------------------------------------------------------
def demo_part(args) -> None:
    torch.set_num_threads(args.threads)
    model, tokenizer = models.load_policy("smollm2-135m", "cpu")
    print(f"demo shape: SmolLM2-135M, {args.prompts} prompts, 64 new tokens, fp32, {args.threads} threads, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start (ratios come from one run)",
          flush=True)
    for preset in args.methods:
        cfg = C.make_config(preset, "demo", threads=args.threads, prompts_per_step=args.prompts)
        problems = data.load_problems(cfg.train_data)
        picked = [problems[data.problem_index(len(problems), i, cfg.seed)] for i in range(args.prompts)]
        prompts = [data.format_prompt(p["problem"], tokenizer, cfg.prompt_style, cfg.few_shot)
                   for p in picked]
        cache = Path(args.cache) / f"{preset}-{args.prompts}.json" if args.cache else None
        t0 = time.perf_counter()
        if cache and cache.exists():          # the same rollouts again (the update is what is measured)
            trees = trees_from_json(cache)    # JSON only: a planted cache file runs no code
        else:
            rng = random.Random(cfg.seed)
            torch.manual_seed(cfg.seed)
            trees, _ = R.rollout_trees(model.eval(), tokenizer, prompts,
                                       [p["answer"] for p in picked], cfg, rng,
                                       levels=[p.get("level") for p in picked])   # cfg.method's rollout
            if cache:
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic.write_text(cache, json.dumps([dataclasses.asdict(tr) for tr in trees]))
        t_gen = time.perf_counter() - t0
        kept = [tr for tr in trees if M.METHODS[cfg.method].trainable(tr)]
        tts = [train.train_tree(tr, advantages(tr, cfg), M.METHODS[cfg.method]) for tr in kept]
        print(f"[{preset}] {len(kept)} trees, {sum(len(t.tokens) for t in tts)} blocks, "
              f"generation {t_gen:.0f} s", flush=True)
        count_table(preset, tts, cfg, args.demo_tokens)
        if preset in args.time:
            res = timed_updates(model, tts, cfg, tokenizer.pad_token_id, args.demo_tokens, args.kernels)
            rows_s, rows_loss, steps = res.pop("rows")
            print(f"  update seconds: rows {rows_s:.1f} (loss {rows_loss:.6f}, {steps} optimizer steps)",
                  flush=True)
            for name, (sec, loss, _) in res.items():
                print(f"                  {name:18s} {sec:.1f}   rows/packed {rows_s / sec:.2f}   "
                      f"(loss {loss:.6f})", flush=True)


# --------------------------------------------------------------------------------------------------------
def synthetic_tree(rng: random.Random, prompt_len: int, response_len: int, n: int, k: int, b: int,
                   vocab: int) -> T.Tree:
    """A tree with paper-like lengths: N base responses of ≈ response_len tokens, K random forks each with
    B branches that complete the response to ≈ response_len tokens; random 0/1 rewards."""
    tok = lambda m: [rng.randrange(3, vocab) for _ in range(m)]  # noqa: E731
    length = lambda m: max(1, int(m * rng.uniform(0.5, 1.5)))  # noqa: E731
    blocks = []
    for j in range(n):
        ids = tok(length(response_len))
        forks = sorted(rng.sample(range(1, len(ids)), min(k, len(ids) - 1)))
        base, ends_at = T.base_blocks(j, ids, [0.0] * len(ids), float(rng.random() < 0.5), forks, len(blocks))
        blocks += base
        for f in forks:
            for _ in range(b):
                blocks.append(T.Block(ends_at[f], tok(length(max(response_len - f, 1))), [], base=j, start=f,
                                      reward=float(rng.random() < 0.5), branch=True))
    return T.Tree("", tok(prompt_len), "", blocks, v_root=0.5, k_hat=k, b_hat=b)


def paper_part(args) -> None:
    torch.set_num_threads(args.threads)
    shapes = {"paper": (4, 3, 4), "grpo": (16, 0, 0), "drgrpo": (16, 0, 0), "treerl": (6, 2, 2),
              "attnrl": (6, 2, 2)}
    print(f"paper shape: synthetic trees, prompt {args.prompt_len}, responses ~{args.response_len} tokens "
          f"(uniform ×0.5–1.5), {args.paper_prompts} prompts per step", flush=True)
    small = None
    for preset in args.methods:
        cfg = C.make_config(preset, **({"max_tokens_per_micro_batch": args.paper_tokens}
                                       if args.paper_tokens else {}))
        rng = random.Random(0)
        n, k, b = shapes[preset]
        trees = [synthetic_tree(rng, args.prompt_len, args.response_len, n, k, b, args.vocab)
                 for _ in range(args.paper_prompts)]
        tts = [train.train_tree(tr, advantages(tr, cfg), M.METHODS[cfg.method])
               for tr in trees if M.METHODS[cfg.method].trainable(tr)]
        print(f"[{preset}] (N, K, B) = {(n, k, b)}, {len(tts)} trees, "
              f"{sum(len(t.tokens) for t in tts)} blocks, "
              f"max_tokens_per_micro_batch {cfg.max_tokens_per_micro_batch}", flush=True)
        count_table(preset, tts, cfg, args.paper_budgets)
        if preset in args.time_paper:
            small = small or models.tiny_random_model(args.vocab, seed=0, hidden_size=64,
                                                      intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      max_position_embeddings=8192)
            cfg = C.make_config(preset, precision="fp32", max_tokens_per_micro_batch=args.cpu_tokens,
                                micro_batch_size=args.rows_per_micro, ppo_epochs=1)
            few = tts[:args.timed_trees]
            res = timed_updates(small, few, cfg, pad_id=0, kernels=args.kernels)
            rows_s = res.pop("rows")[0]
            print(f"  update seconds, small model (64 wide, 2 layers, vocab {args.vocab}), {len(few)} trees, "
                  f"rows {args.rows_per_micro} per micro-batch: rows {rows_s:.1f}", flush=True)
            for name, (sec, _, _) in res.items():
                print(f"                  {name:18s} {sec:.1f}   rows/packed {rows_s / sec:.2f}", flush=True)
    memory_table()


def memory_table() -> None:
    """Peak memory of the paper's update on one 80 GB GPU, computed (no GPU here): Qwen2.5-3B (36 layers,
    hidden 2048, 2 KV heads of 128, MLP 11008, vocab 151936, 3.09 B parameters), flash/flex attention (no L²
    scores). Saved for backward per token and layer, in bf16: the two norm inputs and outputs (4h), q and the
    attention output (2h), k and v (2·256), the o_proj input (h), gate, up, silu(gate) and their product
    (4·11008) → 7h + 512 + 4·11008 ≈ 58.9 k values ≈ 118 KB; ×36 layers ≈ 4.2 MB per token, +10 % for fp32
    norm intermediates ≈ 4.7 MB. With activation checkpointing (--gradient_checkpointing) each layer keeps
    only its input (h bf16 = 4 KB, ×36 = 147 KB per token) and one layer's activations live at a time during
    the backward (+130 KB per token). Log-probs: one [2048, vocab] fp32 chunk and its gradient ≈ 2.5 GB, and
    the fp32 copy of the lm_head weight and its gradient (fp32 logits, packing.target_logprobs) ≈ 2.5 GB.
    Weights + gradients + AdamW state per parameter: 2 + 2 + 4 B (bf16, --optimizer_dtype param: the release),
    2 + 2 + 4 + 8 B (bf16 with fp32 master + moments, --optimizer_dtype fp32), 4 + 4 + 8 B (bf16-autocast)."""
    print("peak memory, paper's update on one 80 GB GPU (computed, not measured):", flush=True)
    for name, per_param in (("bf16, --optimizer_dtype param (release)", 8),
                            ("bf16, --optimizer_dtype fp32", 16), ("bf16-autocast", 16)):
        for checkpointing in (False, True):
            cells = [f"{update_memory_gb(per_param, tokens, checkpointing):5.1f}"
                     for tokens in (4096, 8192, 16384)]
            print(f"  {name:40s} checkpointing {'on ' if checkpointing else 'off'}  states "
                  f"{QWEN25_3B_PARAMS * per_param / 1e9:4.1f} GB; "
                  f"4,096 / 8,192 / 16,384 tokens per micro-batch: {' / '.join(cells)} GB", flush=True)


QWEN25_3B_PARAMS = 3.09e9


def update_memory_gb(bytes_per_param: float, tokens: int, checkpointing: bool) -> float:
    """memory_table's estimate (see there) of the paper's update peak in GB: weights + gradients + optimizer
    state, saved activations of `tokens` tokens, log-prob chunk and fp32 lm_head copy with their gradients."""
    layer = (7 * 2048 + 2 * 256 + 4 * 11008) * 2 * 1.1
    per_token = 2048 * 2 * 36 + layer if checkpointing else layer * 36
    logprobs = 2 * 2048 * 151936 * 4 + 2 * 151936 * 2048 * 4
    return (QWEN25_3B_PARAMS * bytes_per_param + tokens * per_token + logprobs) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["demo", "paper", "both"], default="both")
    parser.add_argument("--methods", nargs="+", default=["paper", "grpo", "drgrpo", "treerl", "attnrl"])
    parser.add_argument("--time", nargs="*", default=["paper", "grpo"],
                        help="demo presets whose update is timed")
    parser.add_argument("--time_paper", nargs="*", default=["paper"], help="paper-shape presets timed")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--demo_tokens", type=int, nargs="*", default=[],
                        help="packed budgets timed (and counted) at the demo shape, "
                             "besides the demo preset's")
    parser.add_argument("--kernels", nargs="+", default=["tree", "dense"], choices=["tree", "dense"],
                        help="packed attention kernels timed (flex needs CUDA)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache", default="runs/bench_update",
                        help="rollouts are saved here and reused ('' = off)")
    parser.add_argument("--prompt_len", type=int, default=150)
    parser.add_argument("--response_len", type=int, default=600)
    parser.add_argument("--paper_prompts", type=int, default=16)
    parser.add_argument("--paper_tokens", type=int, default=0,
                        help="packed budget for the paper-shape counts "
                             "(0 = the preset's max_tokens_per_micro_batch)")
    parser.add_argument("--paper_budgets", type=int, nargs="*", default=[2048, 4096],
                        help="more packed budgets whose forwarded/unique is printed at the paper shape")
    parser.add_argument("--timed_trees", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--cpu_tokens", type=int, default=2048,
                        help="packed micro-batch budget for CPU timing")
    parser.add_argument("--rows_per_micro", type=int, default=8)
    args = parser.parse_args()
    if args.part in ("demo", "both"):
        demo_part(args)
    if args.part in ("paper", "both"):
        paper_part(args)


if __name__ == "__main__":
    main()
