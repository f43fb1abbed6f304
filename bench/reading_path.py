"""bench/reading_path.py — what a student meets following one training step, measured from the code itself.

    python bench/reading_path.py                    # this checkout
    python bench/reading_path.py --repo ../old      # another checkout, to compare

Starting at `train.train_step`, it follows every name the code uses that resolves to a definition of the
project (a function, a class — and with a class, its methods — in the same module or through `import X` /
`from X import Y`), the way a reader jumps to a definition, and counts the definitions and files reached.
It also prints the longest functions and classes of those files, lines over 100 and 110 characters, the
size of the README's reading order, and the files at the top level. Static: a call through an object
whose type it cannot see (e.g. `s.guard.snapshot()`) is not followed, so the counts are a floor. Harness:
harness/, and the files it was split from (faults, runs, tracking, distributed, viz at the top level).
"""
from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

SKIP = ("tests/", "bench/", "docs/")
# README, "Read in this order": the files that hold one step
READ_ORDER = ("config.py", "methods.py", "train.py", "rollout.py", "tree.py", "advantage.py", "packing.py")


def project_modules(repo: Path) -> dict[str, Path]:
    """module name -> file, for the tracked .py files outside tests/bench/docs."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=repo, capture_output=True,
                           text=True).stdout.split()
    out = {}
    for f in files:
        if f.startswith(SKIP):
            continue
        name = f[:-3].replace("/", ".")
        out[name[:-9] if name.endswith(".__init__") else name] = repo / f
    return out


class Module:
    """One file's top-level definitions (name -> node) and its imports (local name -> module or
    (module, name))."""

    def __init__(self, name: str, path: Path, modules: dict):
        self.name, self.path = name, path
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.defs = {n.name: n for n in self.tree.body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        self.imports: dict[str, object] = {}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in modules:
                        self.imports[a.asname or a.name.split(".")[0]] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    if full in modules:
                        self.imports[a.asname or a.name] = full
                    elif node.module in modules:
                        self.imports[a.asname or a.name] = (node.module, a.name)


def walk(repo: Path, start: tuple[str, str]) -> set[tuple[str, str]]:
    modules = project_modules(repo)
    parsed = {m: Module(m, p, modules) for m, p in modules.items()}
    seen: set[tuple[str, str]] = set()
    todo = [start]
    while todo:
        mod, name = todo.pop()
        if (mod, name) in seen or mod not in parsed or name not in parsed[mod].defs:
            continue
        seen.add((mod, name))
        node = parsed[mod].defs[name]
        if isinstance(node, ast.ClassDef):
            seen.update((mod, f"{name}.{f.name}") for f in node.body if isinstance(f, ast.FunctionDef))
        for sub in ast.walk(node):
            todo += resolve(sub, parsed[mod])
    return seen


def resolve(node, module: Module) -> list[tuple[str, str]]:
    """The project definitions a Name or `alias.attr` node refers to."""
    if isinstance(node, ast.Name):
        if node.id in module.defs:
            return [(module.name, node.id)]
        target = module.imports.get(node.id)
        if isinstance(target, tuple):
            return [target]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        target = module.imports.get(node.value.id)
        if isinstance(target, str):
            return [(target, node.attr)]
    return []


def lengths(path: Path) -> list[tuple[int, str]]:
    """(lines, name) of every function and class of a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def is_harness(module: str) -> bool:
    return module.startswith("harness.") or module in ("faults", "runs", "tracking", "distributed", "viz")


def report(repo: Path) -> None:
    reached = walk(repo, ("train", "train_step"))
    modules = project_modules(repo)
    files = sorted({m for m, _ in reached})
    print(f"{repo}: from train.train_step, {len(reached)} definitions in {len(files)} files")
    harness = [m for m in files if is_harness(m)]
    stage = sum(1 for m, _ in reached if not is_harness(m))
    print(f"  outside the harness: {stage} definitions in {len(files) - len(harness)} files "
          f"(harness: {len(reached) - stage} in {len(harness)})")
    for m in files:
        n = sum(1 for x, _ in reached if x == m)
        print(f"  {modules[m].relative_to(repo)}: {n} definitions, "
              f"{len(modules[m].read_text(encoding='utf-8').splitlines())} lines")
    funcs = sorted((length, f"{modules[m].relative_to(repo)}:{name}") for m in files
                   for length, name in lengths(modules[m]))[::-1][:8]
    print("  longest on that path: " + ", ".join(f"{name} {length}" for length, name in funcs))
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=repo, capture_output=True,
                             text=True).stdout.split()
    lines = [line for f in tracked for line in (repo / f).read_text(encoding="utf-8").splitlines()]
    for width in (100, 110):
        over = sum(len(x) > width for x in lines)
        print(f"  lines over {width} characters: {over} of {len(lines)} ({100 * over / len(lines):.1f} %)")
    order = [f for f in READ_ORDER if (repo / f).exists()]
    sizes = [len((repo / f).read_text(encoding="utf-8").splitlines()) for f in order]
    print(f"  README's reading order, {len(order)} files, {sum(sizes)} lines: "
          + ", ".join(f"{f} {n}" for f, n in zip(order, sizes)))
    top = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True).stdout.split()
    print("  top-level .py files: " + " ".join(sorted(f for f in top if "/" not in f and f.endswith(".py"))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", nargs="+", default=[str(Path(__file__).resolve().parent.parent)])
    for repo in parser.parse_args().repo:
        report(Path(repo).resolve())


if __name__ == "__main__":
    main()
