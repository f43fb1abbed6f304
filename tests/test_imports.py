"""The house's import directions, read from the code (ast), as README's file table draws them:

  runtime/   the floor: one-line errors, out-of-memory halving, torchrun's primitives, atomic files, the
             thread policy. It imports nothing of the project but itself.
  stage      the algorithm: the top-level files and engine/. It may import the stage and the floor, never
             the shell (harness/) and never a command.
  harness/   the shell around the two commands: it may import the shell, the stage and the floor, never a
             command.
  commands   train.py and evaluate.py: the roof. In train.py only `train` and `main` (the entry point) use
             the shell.
Every import counts, at the top of a file or inside a function; the test-side fault injection
(tests/inject.py) is imported by no file of the project; and no files import each other in a circle."""
import ast
import functools
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {"train", "evaluate"}
OUTSIDE = ("tests/", "bench/", "studies/", "docs/")   # users of the house, not rooms of its floors


def modules() -> dict[str, Path]:
    """module name -> file, for the tracked Python files of the project (tests, bench, studies, docs too)."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()
    return {f[:-3].replace("/", ".").removesuffix(".__init__"): ROOT / f for f in files}


def imports(path: Path, known: set[str]) -> list[tuple[str, int, str | None]]:
    """(module imported, line, the enclosing top-level function or None) for every import of a project
    module in the file; `from package import name` counts as package.name when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for top in tree.body:
        where = top.name if isinstance(top, (ast.FunctionDef, ast.ClassDef)) else None
        for node in ast.walk(top):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names]
            out += [(name, node.lineno, where) for name in names if name in known]
    return out


def layer(module: str) -> str:
    if module.split(".")[0] == "runtime":
        return "floor"
    if module.split(".")[0] == "harness":
        return "shell"
    return "command" if module in COMMANDS else "stage"


def graph() -> dict[str, list[tuple[str, int, str | None]]]:
    known = modules()
    return {m: imports(p, set(known)) for m, p in known.items()}


ALLOWED = {"floor": {"floor"}, "stage": {"stage", "floor"}, "shell": {"shell", "stage", "floor"},
           "command": {"command", "shell", "stage", "floor"}}


def against_the_floors(found: dict[str, list[tuple[str, int, str | None]]]) -> list[str]:
    """Every import of a module of the house against ALLOWED, or of the tests' fault injection."""
    return [f"{module}:{line} imports {target} ({layer(module)} -> {layer(target)})"
            for module, imported in found.items() for target, line, _ in imported
            if layer(target) not in ALLOWED[layer(module)] or target == "tests.inject"]


def circles(edges: dict[str, list[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_import_runs_down_the_floors():
    """floor → floor only; stage → stage or floor; shell → never a command; nothing → tests/inject.py."""
    known = modules()
    house = {m: found for m, found in graph().items()
             if not str(known[m].relative_to(ROOT)).startswith(OUTSIDE)}
    wrong = against_the_floors(house)
    assert not wrong, "imports against the floors:\n" + "\n".join(wrong)


def test_only_trains_entry_point_uses_the_shell():
    """train.py's shell imports (harness/) are used in `train` and `main` only: the step, the update and the
    Learner never touch the shell; what it hands the step is passed where `train` builds the Learner."""
    known = modules()
    tree = ast.parse(known["train"].read_text(encoding="utf-8"))
    shell_names = {(a.asname or a.name) for node in tree.body if isinstance(node, ast.ImportFrom)
                   and node.module and node.module.split(".")[0] == "harness" for a in node.names}
    shell_names |= {(a.asname or a.name.split(".")[0]) for node in tree.body if isinstance(node, ast.Import)
                    for a in node.names if a.name.split(".")[0] == "harness"}
    assert shell_names, "train.py imports no shell module: the entry point should (loop.Run, cli)"
    users = {top.name for top in tree.body if isinstance(top, (ast.FunctionDef, ast.ClassDef))
             for node in ast.walk(top) if isinstance(node, ast.Name) and node.id in shell_names}
    assert users == {"train", "main"}, f"train.py's shell names are used in {sorted(users)}"


def test_no_circle_of_imports():
    """No two files of the project (bench, studies, tests and docs included) import each other, directly or
    through others."""
    edges = {m: sorted({t for t, _, _ in found if t != m}) for m, found in graph().items()}
    assert not circles(edges), f"import circles: {circles(edges)}"


def test_the_checks_see_a_wrong_import_and_a_circle(tmp_path):
    """The rules are not vacuous: a stage → shell import inside a function, a floor → stage import, a shell →
    command import and a circle of three are each found; a stage → floor import and a chain are not."""
    stage = tmp_path / "stage.py"
    stage.write_text("import runtime.oom\n\n\ndef f():\n    from harness import loop\n")
    found = imports(stage, {"harness.loop", "runtime.oom", "harness"})
    assert [(t, where) for t, _, where in found] == [("runtime.oom", None), ("harness.loop", "f")]
    wrong = against_the_floors({"packing": found, "runtime.faults": [("models", 3, None)],
                                "harness.loop": [("evaluate", 7, None), ("packing", 8, None)]})
    assert wrong == ["packing:5 imports harness.loop (stage -> shell)",
                     "runtime.faults:3 imports models (floor -> stage)",
                     "harness.loop:7 imports evaluate (shell -> command)"]
    assert circles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert circles({"a": ["b"], "b": ["c"], "c": []}) == []



@functools.lru_cache(maxsize=None)
def defined_names(path: Path) -> frozenset[str]:
    """The names a module's top level binds: defs, classes, assignments, imports (under if/try too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name.split(".")[0]) for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return frozenset(names)


def unresolved(path: Path, known: dict[str, Path]) -> list[str]:
    """`from M import N` of a project module M where N is neither a module M.N nor a name M binds."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            bound = defined_names(known[node.module])
            out += [f"{path.name}:{node.lineno} from {node.module} import {a.name}"
                    for a in node.names if f"{node.module}.{a.name}" not in known and a.name not in bound]
    return out


def test_every_from_import_of_the_project_names_something_there(tmp_path):
    """A file moved (issue 45: harness/threads.py -> runtime/threads.py) leaves no `from harness import
    threads` behind in a script no test runs (bench/profile_rollout.py had one): every `from M import N` of a
    project module, in every file of the project, names a module M.N or a name M binds. The check sees a
    stale import and passes a good one."""
    known = modules()
    wrong = [line for path in known.values() for line in unresolved(path, known)]
    assert not wrong, "imports of names that are not there:\n" + "\n".join(wrong)
    script = tmp_path / "script.py"
    script.write_text("from harness import threads\nfrom runtime import threads as t\n"
                      "from reward import compute_reward, nothing_here\n")
    assert unresolved(script, known) == ["script.py:1 from harness import threads",
                                         "script.py:3 from reward import nothing_here"]
