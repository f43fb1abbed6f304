"""What each part of bench/gpu_check.sh imports, checked before it loads anything else: one line naming every
missing module and where it comes from, instead of a traceback minutes into a GPU loan.

    python bench/needs.py            # every part's modules imported: version and origin (image or
                                     # carried), exit 1 if any is missing (gpu_check.sh's env part)
    python bench/needs.py engine     # one part's, found on the path: silent, else one line and exit 2

The device image lacks some pure-Python packages the project imports (bench/device_image.txt);
bench/gpu_assets.py copies them into DATPO_CACHE/site, which gpu_check.sh puts on PYTHONPATH.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

# import name -> the distribution bench/gpu_assets.py carries for it (the image has none of these)
CARRIED = {"pysbd": "pysbd", "math_verify": "math-verify", "latex2sympy2_extended": "latex2sympy2_extended",
           "antlr4": "antlr4-python3-runtime"}

# What each entry point imports, its own lazy imports included: pysbd for the sent-entropy forks of the
# paper and demo presets (tree.py), math_verify wherever responses are graded (reward.py imports it for a
# boxed answer that is not a plain number; the smoke's rollout flips a coin, its data checks and evaluation
# grade), sentence_transformers for the block embeddings (Div_sib).
COMMON = ("torch", "transformers", "numpy", "tqdm")
GRADED = ("math_verify", "latex2sympy2_extended", "antlr4")
NEEDS = {
    "engine": COMMON + ("pytest",) + GRADED,
    "attention": COMMON,
    "rollout": COMMON + ("pysbd",) + GRADED,
    "smoke": COMMON + ("sentence_transformers", "pysbd") + GRADED,
    "update": COMMON,
}


def missing(modules, load: bool = False) -> list[str]:
    """The modules of `modules` that are not there, each as 'name (why)': found on the path (milliseconds:
    what a part checks before it starts), or with `load` imported (seconds: the env part's report, which
    also catches a broken install)."""
    gone = []
    for name in modules:
        try:
            if load:
                importlib.import_module(name)
            elif importlib.util.find_spec(name) is None:
                raise ModuleNotFoundError(f"No module named '{name}'")
        except Exception as err:   # ImportError, or a broken install raising anything at import
            gone.append(f"{name} ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
    return gone


def remedy(names: list[str]) -> str:
    carried = sorted({CARRIED[n.split()[0]] for n in names if n.split()[0] in CARRIED})
    site = Path(os.environ.get("DATPO_CACHE") or "DATPO_CACHE") / "site"
    return (f"; carried ones ({', '.join(carried)}) belong in {site} (python bench/gpu_assets.py, then carry "
            ".cache/gpu_assets; gpu_check.sh puts site/ on PYTHONPATH)" if carried else
            "; these come with the image (bench/device_image.txt)")


def check(part: str) -> None:
    """Exit 2 with one line on stderr when a module `part` needs does not import."""
    gone = missing(NEEDS[part])
    if gone:
        print(f"{part}: cannot start, missing {', '.join(gone)}{remedy(gone)}", file=sys.stderr, flush=True)
        raise SystemExit(2)


def origin(name: str) -> str:
    """'carried' when the module was imported from DATPO_CACHE/site, else 'image'."""
    module = sys.modules[name]
    site = Path(os.environ.get("DATPO_CACHE") or "/nonexistent") / "site"
    where = Path(getattr(module, "__file__", None) or "/").resolve()
    return "carried" if site.resolve() in where.parents else "image"


def version(name: str) -> str:
    module = sys.modules[name]
    found = getattr(module, "__version__", None)
    if found:
        return str(found)
    try:
        return importlib.metadata.version(CARRIED.get(name, name))
    except importlib.metadata.PackageNotFoundError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    parts = (argv if argv is not None else sys.argv[1:]) or list(NEEDS)
    unknown = [p for p in parts if p not in NEEDS]
    if unknown:
        print(f"needs.py: unknown part {', '.join(unknown)}; expected one of {', '.join(NEEDS)}",
              file=sys.stderr)
        return 2
    if len(parts) == 1:
        check(parts[0])
        return 0
    modules = list(dict.fromkeys(m for p in parts for m in NEEDS[p]))
    gone = missing(modules, load=True)
    for name in modules:
        if name in sys.modules:
            print(f"  {name:<24} {version(name):<14} {origin(name)}")
    if gone:
        print(f"missing: {', '.join(gone)}{remedy(gone)}", flush=True)
        return 1
    print(f"every part's modules import ({len(modules)})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
