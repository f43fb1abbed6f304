"""bench/reading_path.py — what a student meets following one training step, measured from the code itself.

    python bench/reading_path.py                    # this checkout
    python bench/reading_path.py --repo ../old      # another checkout, to compare

Starting at `train.train_step`, it follows every name the code uses that resolves to a definition of the
project (a function, a class — and with a class, its methods — in the same module or through `import X` /
`from X import Y`), the way a reader jumps to a definition, and counts the definitions and files reached.
It also prints the longest functions and classes of those files, lines over 100 and 110 characters, the
size of the README's reading order, and the files at the top level. Static: a call through an object
whose type it cannot see (e.g. `s.guard.snapshot()`) is not followed, so the counts are a floor. Harness:
the shell harness/ and the floor runtime/ (and in older checkouts the files they were split from: faults,
runs, tracking, distributed, viz at the top level).

Issue 34's and 45's measures, each from the code of the checkout given:
  harness lines    the harness files (shell and floor) that the reading order's files import, with their
                   lines: what a reader of the top two functions, train and train_step, is sent to
  nesting          the deepest nesting of compound statements (if/for/while/with/try) in a function on the
                   path, in the reading-order files (a nested function counts on its own)
  loss → log-prob  run, not read: one ppo_update on a tiny random model under a profiler; the calls from the
                   function that forms the loss (the caller of clipped_objective) down to the project
                   function that takes the log-softmax (calls torch.logsumexp) and to the one that computes
                   the logits (fp32_logits)
  method/preset    for each method with a preset of its name, the config fields where `--method X` and
                   `--preset X` differ (out_dir aside)
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
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
    return (module.startswith(("harness.", "runtime.")) or module in ("harness", "runtime")
            or module in ("faults", "runs", "tracking", "distributed", "viz"))


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
    measures(repo, reached)


def harness_imports(repo: Path) -> dict[str, int]:
    """{harness module: its lines} for every harness module (shell or floor) a file of the README's reading
    order imports, at its top or inside a function."""
    modules = project_modules(repo)
    parsed = {m: Module(m, p, modules) for m, p in modules.items()}
    out = {}
    for f in READ_ORDER:
        module = parsed.get(f[:-3])
        if module is None:
            continue
        for target in module.imports.values():
            name = target if isinstance(target, str) else target[0]
            if is_harness(name) and name in modules:
                out[name] = len(modules[name].read_text(encoding="utf-8").splitlines())
    return dict(sorted(out.items()))


def nesting(node, depth: int = 0) -> int:
    """Deepest nesting of compound statements below `node` (nested functions and classes not counted)."""
    compound = (ast.If, ast.For, ast.While, ast.With, ast.Try, ast.AsyncFor, ast.AsyncWith)
    deepest = depth
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        deepest = max(deepest, nesting(child, depth + 1 if isinstance(child, compound) else depth))
    return deepest


def deepest_nesting(repo: Path, reached) -> list[tuple[int, str]]:
    """(nesting, file:function) of every function on the path in the reading-order files, deepest first."""
    modules = project_modules(repo)
    out = []
    for mod, name in reached:
        path = modules.get(mod)
        if path is None or str(path.relative_to(repo)) not in READ_ORDER:
            continue
        body = ast.parse(path.read_text(encoding="utf-8")).body
        for part in name.split("."):   # a function, or Class.method
            node = next((n for n in body if getattr(n, "name", None) == part), None)
            body = getattr(node, "body", [])
        if isinstance(node, ast.FunctionDef):
            out.append((nesting(node), f"{path.relative_to(repo)}:{name}"))
    return sorted(set(out), reverse=True)


# Run in a child process inside the checkout measured: one ppo_update of a tiny random model, profiled.
CALLS_CHILD = """
import json, random, sys
sys.path.insert(0, sys.argv[1])
import torch
import config as C, models, packing as P, train
repo = sys.argv[1]
tok = models.load_tokenizer("smollm2-135m") if hasattr(models, "load_tokenizer") else None
model = models.tiny_random_model(512, seed=0)
cfg = C.make_config("tiny", ppo_epochs=2, mini_batch_size=4)
tree = P.TrainTree([1, 2, 3], [None, 0, 0], [[4, 5], [6, 7, 8], [9, 10]], [0.5, -0.5, 1.0], [1.0, 1.0, 1.0])
stack, found = [], {"loss": set(), "logsumexp": [], "logits": []}
def profile(frame, event, arg):
    if event == "call" and frame.f_code.co_name.startswith("<"):   # comprehensions: not a call one reads
        return
    if event == "call" and frame.f_code.co_filename.startswith(repo):
        stack.append(frame.f_code.co_name)
        if frame.f_code.co_name == "clipped_objective":
            found["loss"].add(stack[-2])
        if frame.f_code.co_name == "fp32_logits":
            found["logits"].append(list(stack))
    elif event == "return" and frame.f_code.co_filename.startswith(repo) and stack \
            and not frame.f_code.co_name.startswith("<"):
        stack.pop()
    elif event == "c_call" and getattr(arg, "__name__", "") == "logsumexp":
        found["logsumexp"].append(list(stack))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
sys.setprofile(profile)
train.ppo_update(model, optimizer, [tree], cfg, 0, "cpu", random.Random(0))
sys.setprofile(None)
def distance(stacks):
    best = None
    for st in stacks:
        if "backward" in st:   # checkpointing recomputes it in the backward: not the forward's path
            continue
        for loss in found["loss"]:
            if loss in st:
                chain = st[st.index(loss):]
                best = chain if best is None or len(chain) < len(best) else best
    return best
print(json.dumps({"log-softmax": distance(found["logsumexp"]), "logits": distance(found["logits"])}))
"""


def loss_to_logprob(repo: Path) -> dict:
    """{"log-softmax": [loss function, ..., the function calling logsumexp], "logits": [...]} (run)."""
    proc = subprocess.run([sys.executable, "-c", CALLS_CHILD, str(repo)], cwd=repo, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


METHOD_CHILD = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
import config as C, methods as M
out = {}
for name in M.METHODS:
    if name in C.PRESETS:
        a, b = C.make_config("paper", method=name), C.make_config(name)
        out[name] = {f.name: [getattr(a, f.name), getattr(b, f.name)] for f in dataclasses.fields(a)
                     if f.name != "out_dir" and getattr(a, f.name) != getattr(b, f.name)}
print(json.dumps(out))
"""


def method_vs_preset(repo: Path) -> dict:
    """{method: {field: [--method X's value, --preset X's value]}} where they differ."""
    proc = subprocess.run([sys.executable, "-c", METHOD_CHILD, str(repo)], cwd=repo, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode:
        return {"error": proc.stderr}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measures(repo: Path, reached) -> None:
    """The measures of issues 34 and 45 (see the module docstring)."""
    found = harness_imports(repo)
    print(f"  harness lines imported by the reading order: {sum(found.values())} in {len(found)} files ("
          + ", ".join(f"{m} {n}" for m, n in found.items()) + ")")
    deepest = deepest_nesting(repo, reached)
    print("  deepest nesting on the path: " + ", ".join(f"{where} {n}" for n, where in deepest[:4]))
    chains = loss_to_logprob(repo)
    for what, chain in chains.items():
        shown = " → ".join(chain) if isinstance(chain, list) else chain
        print(f"  loss → {what}: {len(chain) - 1 if isinstance(chain, list) else '?'} calls ({shown})")
    for name, fields in method_vs_preset(repo).items():
        print(f"  --method {name} vs --preset {name}: "
              + (", ".join(f"{k} {v[0]!r} vs {v[1]!r}" for k, v in fields.items()) or "the same run"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", nargs="+", default=[str(Path(__file__).resolve().parent.parent)])
    for repo in parser.parse_args().repo:
        report(Path(repo).resolve())


if __name__ == "__main__":
    main()
