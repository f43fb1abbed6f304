"""harness/custom_reward.py — `--reward FILE.py:FUNCTION` (or `module:function`): your reward functions,
called as TRL's GRPOTrainer calls them, in place of the binary grader.

    python train.py --preset grpo --reward my_rewards.py:format_reward my_rewards.py:accuracy_reward \
        --reward_weights 0.5 1.0 --train_data train.jsonl

A function written for GRPOTrainer runs unchanged: it is called with keywords only,

    fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=state, **columns) -> list

one call per group of completions of one prompt (a prompt's N base responses, then each branch of its tree):
  prompts          the prompt the model saw, once per completion, in TRL's shape: the text it was given
                   (--prompt_style's template applied, data.format_prompt), or, for a conversational prompt
                   (TRL's list of {"role", "content"} messages), the messages the chat template rendered
  completions      the decoded completions (special tokens skipped); for a conversational prompt each is
                   [{"role": "assistant", "content": text}], as TRL passes them (a prompt ending in an
                   assistant message that the model continued: that message leaves `prompts` and its content
                   starts each completion, TRL's rule). In a tree a completion is the whole root-to-leaf
                   response: the base response up to the fork, then the branch
  completion_ids   their token ids
  trainer_state    a transformers.TrainerState: global_step = training steps done, max_steps = --steps
  log_extra        TRL's log_extra(column, values): one value per completion, a column of the completions
                   table (--log_completions_every); passed to a function that names both parameters (TRL's
                   example does; a **kwargs function written before TRL added them sees only columns)
  log_metric       TRL's log_metric(name, value): a number, averaged over the step's calls (and ranks) into
                   the step's metrics record ("reward_metrics") and the trackers (train/reward_metrics/NAME)
  **columns        every other column of the training data, by name, one value per completion: a row's own
                   value as it is in the file (a `solution` before data.py reads the gold answer out of it),
                   None where that row has none (an empty CSV cell, a JSONL row without the key)
Every argument is a fresh copy for each call (a function that changes `prompts` changes nothing else), as
TRL's are. An `async def` function is awaited. It returns one value per completion: a number of any scalar
kind (int, float, bool, a NumPy scalar, a 0-d tensor or array), or None (no reward from this function for
that completion, TRL's rule: it adds nothing to the sum). Several functions are summed with
--reward_weights (1 each when not given), as TRL's reward_weights.

Ranges. GRPO and Dr.GRPO take any finite reward. A tree method needs each summed reward in [0, 1]: V(root),
the mean reward of a prompt's base responses, is a success rate from which K̂ = ⌈K_max(1 − V)⌉ and
B̂ = ⌈B_max(1 − V)⌉ are computed (Sec. 4.1), and the block advantages of Eq. 3 are differences of such
values. So for a tree method the weights must be >= 0 and sum to at most 1 (functions giving values in
[0, 1] then keep the sum there): other weights are one line at start, before the model loads. A value outside,
a non-finite value, a value that is not a number or a list of the wrong length is a UserError naming the
function and the value (exit 2). Held-out evaluation always grades correctness with reward.compute_reward.

A function that raises an Exception does not end the run either (harness/reward_guard.py): each completion
of that call gets 0 from it (the other functions' values stand; none is skipped, since a tree's V(s) is a mean
over all its leaves, Sec. 4.2), written with its traceback to RUN/reward_errors.jsonl and counted in
metrics.jsonl (reward_errors); more than --max_reward_error_share of a step's responses failing in one
function stops the run with one line naming it.

Reward code cannot end the run by itself: SystemExit or KeyboardInterrupt raised in it (a sys.exit, an
argparse at import) is a RewardExit line naming the function (exit 2), and a run that had finished steps
since its last checkpoint writes one at the last finished step first (harness/loop.py). A stop signal's
--stop_timeout reaches a call blocked in C (sleep, a socket, a subprocess) through a real signal
(harness/signals.py). Modules load under their own name, never replacing or replaced by a module of this
project or one already imported (one line when a name clashes); each reward file's SHA-256 is saved with
every checkpoint and a resume over an edited one is refused, or recorded with --allow_config_change true.

The rollout receives the reward as a value (rollout.rollout_trees's `score`): nothing is patched.
"""
from __future__ import annotations

import ast
import asyncio
import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import data
import methods as M
from harness import measured, signals
from runtime import distributed as D
from runtime.faults import UserError, say

TOLERANCE = 1e-9     # a sum of weighted rewards may miss [0, 1] by rounding (0.1 + 0.2 + 0.7): clamped
PROJECT = Path(__file__).resolve().parents[1]   # this project's folder: its modules are not a reward's names
LOGGING = ("log_extra", "log_metric")           # TRL's logging callables, passed to functions that take them


class RewardExit(UserError):
    """Reward code raised SystemExit or KeyboardInterrupt (a sys.exit, an argparse at import): the run ends
    with one line naming the function (exit 2), never with the exit code the function chose."""

    exit_code = 2


@dataclass
class RewardFunction:
    """One --reward: its spelling, the function, its weight, the file it came from (its content is saved
    with every checkpoint: source_hashes), whether it takes TRL's logging callables, and the step's running
    sum (step_means)."""
    spec: str
    fn: Callable
    weight: float = 1.0
    source: Path | None = None
    takes_logging: bool = False
    total: float = 0.0
    count: int = 0

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", self.spec.rpartition(":")[2])


@dataclass
class Rewards:
    """The run's reward functions and what their sum must satisfy: `bounded` for tree methods ([0, 1])."""
    functions: list[RewardFunction]
    method: str
    bounded: bool
    steps: int
    problems: list[dict] = field(default_factory=list)   # the training data (with their rows' columns)
    columns: list[str] = field(default_factory=list)     # every column any row has (absent: None)
    prompt_style: str = "chat"
    few_shot: bool = False
    warned: set = field(default_factory=set)
    metrics: dict = field(default_factory=dict)          # log_metric: name -> [sum, count] this step
    extras: dict = field(default_factory=dict)           # log_extra: (prompt, ids) -> {column: value}
    errors: object = None   # harness/reward_guard.RewardErrors: a call that raises gives 0 (None: it raises)

    def __call__(self, problem: dict, texts: list[str], token_lists: list[list[int]], step: int,
                 seen=None) -> list[float]:
        """The summed, weighted reward of each completion of one prompt (see the module docstring). `seen`:
        the prompt as the model saw it (model_prompt; None: the problem's own prompt)."""
        n = len(texts)
        seen = problem["problem"] if seen is None else seen
        prompt, bootstrap = trl_prompt(problem["problem"], seen)
        completions = [[{"role": "assistant", "content": bootstrap + t}] for t in texts] \
            if isinstance(prompt, list) else list(texts)
        row = problem.get("columns", {"answer": problem["answer"]})
        state = trainer_state(step, self.steps)
        keys = [(seen if isinstance(seen, str) else repr(seen), tuple(ids)) for ids in token_lists]
        totals: list[float] = [0.0] * n
        given = [False] * n
        parts: list[list[str]] = [[] for _ in range(n)]
        for f in self.functions:
            kwargs = {"prompts": [copy.deepcopy(prompt) for _ in range(n)],
                      "completions": copy.deepcopy(completions),
                      "completion_ids": [list(ids) for ids in token_lists], "trainer_state": state,
                      **{name: [copy.deepcopy(row.get(name)) for _ in range(n)] for name in self.columns}}
            if f.takes_logging:
                kwargs.update(log_extra=self.log_extra(f, keys), log_metric=self.log_metric(f))
            values = checked_values(f, self.call(f, kwargs, texts, problem["answer"]), n, prompt)
            for i, value in enumerate(values):
                if value is None:
                    continue
                totals[i] += f.weight * value
                given[i] = True
                parts[i].append(f"{f.spec} gave {value:g}" + (f" x {f.weight:g}" if f.weight != 1 else ""))
                f.total, f.count = f.total + value, f.count + 1
        if not all(given) and "none" not in self.warned:   # TRL warns too; the sum is then 0
            self.warned.add("none")
            say(f"--reward: every function returned None for a completion of {shown(prompt)}; its reward "
                f"is 0 (said once)")
        return [self.bounded_value(total, part, prompt) for total, part in zip(totals, parts)]

    def call(self, f: RewardFunction, kwargs: dict, texts: list[str], gold):
        """f's values for one call (call_reward). Under the run's guard (harness/reward_guard.py) an Exception
        it raises gives each completion 0 from f, recorded and counted, and the other functions' values
        stand: no completion is skipped, since a tree's V(s) needs every leaf's reward (Sec. 4.2)."""
        if self.errors is None:
            return call_reward(f, kwargs)
        values, failure = self.errors.attempt(f.spec, call_reward, (f, kwargs), texts, gold)
        return [0.0] * len(texts) if failure else values

    def log_extra(self, f: RewardFunction, keys: list[tuple]) -> Callable:
        """TRL's log_extra(column, values) for one call: a value per completion, kept for the step's
        completions table (extra_columns)."""
        def log_extra(column: str, values: list) -> None:
            if not isinstance(column, str) or isinstance(values, (str, bytes)) \
                    or not hasattr(values, "__len__") or len(values) != len(keys):
                count = len(values) if hasattr(values, "__len__") else "?"
                raise UserError(f"--reward {f.spec}: log_extra({column!r}, ...) got {type(values).__name__} "
                                f"of {count} values for {len(keys)} completions; expected log_extra(column: "
                                f"str, values: list), one value per completion (TRL's)")
            for key, value in zip(keys, list(values)):
                self.extras.setdefault(key, {})[column] = value
        return log_extra

    def log_metric(self, f: RewardFunction) -> Callable:
        """TRL's log_metric(name, value) for one call: a number, averaged over the step's calls into its
        metrics record (step_means)."""
        def log_metric(name: str, value) -> None:
            number = scalar(value)
            if not isinstance(name, str) or number is None or not math.isfinite(number):
                raise UserError(f"--reward {f.spec}: log_metric({name!r}, {str(value)[:40]}); expected "
                                f"log_metric(name: str, value: a finite number) (TRL's)")
            total = self.metrics.setdefault(name, [0.0, 0])
            total[0], total[1] = total[0] + number, total[1] + 1
        return log_metric

    def bounded_value(self, total: float, parts: list[str], prompt) -> float:
        """A tree method's reward within [0, 1] (rounding clamped), else one line naming what gave it."""
        if not self.bounded:
            return total
        if -TOLERANCE <= total <= 1 + TOLERANCE:
            return min(max(total, 0.0), 1.0)
        summed = " + ".join(parts) + (f" = {total:g}" if len(parts) > 1 else "")
        raise UserError(f"--reward: {summed} for a completion of {shown(prompt)}; {self.method} is a tree "
                        f"method and needs each reward in [0, 1] (V(root), the base responses' mean reward, "
                        f"is a success rate that sets K̂ and B̂, Sec. 4.1): rescale it or set --reward_weights "
                        f"so the sum stays in [0, 1], or train with --method grpo or drgrpo (any finite "
                        f"reward)")

    def step_means(self) -> dict:
        """{"reward_functions": {name: mean value this step}} over every rank (TRL logs rewards/<name>/mean),
        and {"reward_metrics": {name: mean}} of log_metric when a function logged any; the sums start
        again."""
        sums = D.all_reduce([x for f in self.functions for x in (f.total, f.count)])
        means = {}
        for k, f in enumerate(self.functions):
            total, count = sums[2 * k], sums[2 * k + 1]
            means[f.name if f.name not in means else f.spec] = total / count if count else None
            f.total, f.count = 0.0, 0
        metrics: dict[str, list] = {}
        for part in D.all_gather_objects(self.metrics):   # every rank's (names may differ between ranks)
            for name, (total, count) in part.items():
                into = metrics.setdefault(name, [0.0, 0])
                into[0], into[1] = into[0] + total, into[1] + count
        self.metrics = {}
        return {"reward_functions": means,
                **({"reward_metrics": {k: s / c for k, (s, c) in metrics.items()}} if metrics else {})}

    def extra_columns(self, rows: list[dict], trees: list) -> list[dict]:
        """The step's completions table (tracking.completion_rows) with log_extra's columns (empty where a
        completion got none); the step's extras are dropped."""
        import tree as T

        extras, self.extras = self.extras, {}
        columns = sorted({c for values in extras.values() for c in values})
        if not columns:
            return rows
        out = []
        for row in rows:
            tr = trees[row["tree"]]
            key = (tr.prompt, tuple(T.path_token_ids(tr.blocks, row["leaf"])))
            out.append({**row, **{c: extras.get(key, {}).get(c, "") for c in columns}})
        return out


def trl_prompt(problem, seen) -> tuple[object, str]:
    """(the prompt in TRL's shape, the text a continued assistant message starts each completion with). A
    conversational prompt is its messages; one that ends in an assistant message the model continued (the
    templated text ends with that message's content, not a new turn) leaves that message out, and its content
    starts each completion (TRL's rule). A text prompt is the text the model saw."""
    if not isinstance(problem, list):
        return seen, ""
    last = problem[-1] if problem and isinstance(problem[-1], dict) else {}
    content = last.get("content")
    if last.get("role") == "assistant" and isinstance(content, str) and content.strip() \
            and isinstance(seen, str) and seen.rstrip().endswith(content.rstrip()):
        return problem[:-1], content
    return problem, ""


def model_prompt(problem: dict, tokenizer, style: str, few_shot: bool):
    """The prompt the model saw: its text (data.format_prompt, as prompts.PromptStream formats it)."""
    return data.format_prompt(problem["problem"], tokenizer, style, few_shot)


def trainer_state(step: int, steps: int):
    """What TRL passes as trainer_state: a transformers.TrainerState, here counting training steps."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=steps)


def shown(prompt, most: int = 60) -> str:
    """A prompt quoted for a message: its text (a conversational prompt's last message), cut."""
    text = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt else str(prompt)
    text = " ".join(text.split())
    return f"the prompt {text[:most]!r}" + ("..." if len(text) > most else "")


# --------------------------------------------------------------------------------------------------------
# One call, and what it returns
# --------------------------------------------------------------------------------------------------------
def call_reward(f: RewardFunction, kwargs: dict):
    """One call of one reward function with TRL's keywords: its return value (a coroutine awaited). What the
    function's own code raises as SystemExit or KeyboardInterrupt becomes a RewardExit line naming it;
    a second Ctrl-C (signals.QuitNow) and a --stop_timeout (faults.StopTimeout) go on as they are."""
    try:
        values = f.fn(**kwargs)
        if inspect.isawaitable(values):
            values = awaited(values)
    except signals.QuitNow:
        raise
    except (SystemExit, KeyboardInterrupt) as err:
        raise RewardExit(f"--reward {f.spec}: {ended(err)} while rewarding; a reward function returns one "
                         f"value per completion and cannot end the run") from None
    return values


def ended(err: BaseException) -> str:
    """How reward code tried to end the process, in words: 'raised SystemExit(0) (sys.exit)'."""
    if isinstance(err, SystemExit):
        return f"raised SystemExit({err.code!r}) (sys.exit, exit() or an argparse error)"
    return "raised KeyboardInterrupt"


_loop: asyncio.AbstractEventLoop | None = None


def awaited(coroutine):
    """The result of an async reward function's coroutine: run on this thread's own event loop (one for the
    run), or, when a loop is already running here (a notebook), on a loop of its own thread."""
    global _loop
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
        return _loop.run_until_complete(coroutine)
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as err:   # handed back to the caller's thread as it is
            box["error"] = err
    thread = threading.Thread(target=run, name="async-reward")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def scalar(value) -> float | None:
    """A number of any scalar kind as a float — int, float, bool, Fraction, Decimal, NumPy scalars, 0-d (or
    one-element) tensors and arrays — else None (strings, bytes, complex numbers, lists)."""
    if isinstance(value, (str, bytes, complex)):
        return None
    if isinstance(value, numbers.Number):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    item = getattr(value, "item", None)
    size = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
    if callable(item) and size == 1:
        try:
            inner = item()
        except (TypeError, ValueError, RuntimeError):
            return None
        return None if inner is value else scalar(inner)
    return None


def one_number(values) -> bool:
    """Whether a reward function returned a single number (a 0-d tensor or array, a scalar) for its list."""
    return getattr(values, "ndim", None) == 0 or isinstance(values, numbers.Number)


def checked_values(f: RewardFunction, values, n: int, prompt) -> list[float | None]:
    """One finite float (or None) per completion, else a UserError naming the function and what it gave."""
    where = f"--reward {f.spec}"
    if one_number(values) or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        kind = type(values).__name__ + (" (0-d)" if getattr(values, "ndim", None) == 0 else "")
        raise UserError(f"{where}: returned {kind} {str(values)[:40]!r}; expected a list of {n} numbers, "
                        f"one per completion (TRL's signature)")
    values = list(values.tolist() if hasattr(values, "tolist") else values)   # a tensor or an array
    if len(values) != n:
        raise UserError(f"{where}: returned {len(values)} values for {n} completions of {shown(prompt)}; "
                        f"expected one per completion")
    out: list[float | None] = []
    for value in values:
        if value is None:
            out.append(None)
            continue
        number = scalar(value)
        if number is None:
            raise UserError(f"{where}: returned {type(value).__name__} {str(value)[:40]!r} for a completion "
                            f"of {shown(prompt)}; expected a number (or None)")
        if not math.isfinite(number):
            raise UserError(f"{where}: returned {number} for a completion of {shown(prompt)}; expected a "
                            f"finite number (or None: no reward from this function, as in TRL)")
        out.append(number)
    return out


# --------------------------------------------------------------------------------------------------------
# Loading: before anything slow runs, each mistake one line
# --------------------------------------------------------------------------------------------------------
def project_modules() -> dict[str, Path]:
    """This project's importable names (its top-level .py files and packages) -> their files."""
    found = {p.stem: p for p in PROJECT.glob("*.py")}
    found.update({p.parent.name: p for p in PROJECT.glob("*/__init__.py")})
    return found


def module_file(name: str) -> Path | None:
    """The file an imported module `name` was loaded from (None: not imported, or no file)."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None) if module is not None else None
    return Path(path).resolve() if path else None


def neighbour(folder: Path, name: str) -> Path | None:
    """`folder`'s own module `name`: name.py or the package name/__init__.py."""
    for path in (folder / f"{name}.py", folder / name / "__init__.py"):
        if path.is_file():
            return path.resolve()
    return None


LOADED: dict[str, Path] = {}   # reward modules this process loaded: name -> file (a later run may reload)


def taken_by(name: str, mine: Path | None) -> Path | None:
    """The other file that module name `name` means here — this project's module, or a module already
    imported that is not an earlier run's reward module (LOADED) — when it is not `mine`; None when the name
    is free or means `mine`."""
    imported = module_file(name) if LOADED.get(name) != module_file(name) else None
    for other in (project_modules().get(name), imported):
        if other is not None and other.resolve() != mine:
            return other.resolve()
    return None


def imported_names(path: Path) -> set[str]:
    """The top-level module names a Python file imports by absolute import (its AST; {} when it does not
    parse: importing it will say why)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def check_names(where: str, path: Path, name: str) -> None:
    """A reward file loads as module `name` beside its neighbours: one UserError line when its name or a
    neighbour it imports (imported_names) is also this project's module or one already imported — Python
    would hand it the other file, or it would replace that module for the rest of the run."""
    other = taken_by(name, path.resolve())
    if other is not None:
        raise UserError(f"{where}: its module name {name!r} is already {other} (this project's or an "
                        f"imported module's); expected a reward file named otherwise (rename {path.name})")
    for imported in sorted(imported_names(path)):
        mine = neighbour(path.resolve().parent, imported)
        other = taken_by(imported, mine) if mine is not None else None
        if other is not None:
            raise UserError(f"{where}: it imports {imported!r}, which names both {mine} beside it and "
                            f"{other} (this project's or an imported module's), and Python would give it the "
                            f"latter; expected that neighbour renamed (and its import)")


def clashes_after(before: set[str], where: str) -> None:
    """Modules a reward file's import brought in under a name of this project's modules from elsewhere (a
    neighbour's neighbour): one UserError line, as check_names."""
    ours = project_modules()
    for name in sorted(set(sys.modules) - before):
        if name in ours and module_file(name) not in (None, ours[name].resolve()):
            raise UserError(f"{where}: importing it loaded {module_file(name)} as {name!r}, the name of this "
                            f"project's {ours[name].name}; expected that file renamed")


def load_function(spec: str, loaded: dict | None = None) -> tuple[Callable, Path | None]:
    """The function `spec` names and the file it is defined in: FILE.py:FUNCTION (loaded as the module named
    by the file, its folder importable while it loads, so it may import its neighbours) or module:function
    (the current folder importable). Names that clash with this project's or imported modules, a module
    that fails to import or ends the process at import, and a missing function are one UserError line.
    `loaded`: {file: module} of this run's reward files so far (two functions of one file: loaded once)."""
    target, _, name = spec.rpartition(":")
    where = f"--reward {spec}"
    before = set(sys.modules)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"{where}: no such file {target}; expected FILE.py:FUNCTION naming an existing "
                            f"file")
        module_name = path.stem
        if not module_name.isidentifier():   # not importable by name anyway: a name nothing else has
            module_name = "datpo_reward_" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        check_names(where, path, module_name)
        if loaded is not None and path.resolve() in loaded:   # two functions of one file: loaded once
            module = loaded[path.resolve()]
        else:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            with importable(str(path.resolve().parent)), own_argv(path):
                try:
                    sys.modules[module_name] = module
                    loader.loader.exec_module(module)
                except BaseException as err:
                    sys.modules.pop(module_name, None)
                    raise import_error(where, target, err) from err
            LOADED[module_name] = path.resolve()
            if loaded is not None:
                loaded[path.resolve()] = module
    else:
        top = target.split(".")[0]
        mine = neighbour(Path.cwd(), top)
        other = taken_by(top, mine) if mine is not None else None
        if other is not None:
            raise UserError(f"{where}: {top!r} names both {mine} here and {other} (this project's or an "
                            f"imported module's), and Python would give the latter; expected your module "
                            f"renamed")
        with importable(os.getcwd()), own_argv(Path(target)):
            try:
                module = importlib.import_module(target)
            except BaseException as err:
                raise import_error(where, target, err, module_form=True) from err
    clashes_after(before, where)
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserError(f"{where}: {target} has no function {name!r}; its functions: "
                        f"{', '.join(found) or 'none'}")
    source = getattr(module, "__file__", None)
    return fn, Path(source).resolve() if source else None


def import_error(where: str, target: str, err: BaseException, module_form: bool = False) -> UserError:
    """The one line for a reward module that failed to import: what it raised (SystemExit and
    KeyboardInterrupt: a RewardExit, the run does not end with the module's exit code). A second Ctrl-C
    goes on as it is."""
    if isinstance(err, signals.QuitNow):
        raise err
    if isinstance(err, (SystemExit, KeyboardInterrupt)):
        return RewardExit(f"{where}: importing {target} {ended(err)}; a reward module is imported, not run "
                          f"(it gets no command-line arguments of its own): expected it to define its "
                          f"functions without ending the process")
    if not isinstance(err, Exception):
        raise err
    first = str(err).splitlines()[0] if str(err) else ""
    if module_form:
        return UserError(f"{where}: cannot import {target} ({type(err).__name__}: {first}); expected a "
                         f"module on the Python path, or FILE.py:FUNCTION")
    return UserError(f"{where}: importing {target} raised {type(err).__name__}: {first}")


class importable:
    """`folder` at the front of sys.path for a while (left there when it already was)."""

    def __init__(self, folder: str):
        self.folder, self.added = folder, folder not in sys.path

    def __enter__(self):
        if self.added:
            sys.path.insert(0, self.folder)

    def __exit__(self, *exc):
        if self.added and self.folder in sys.path:
            sys.path.remove(self.folder)


class own_argv:
    """sys.argv as if `path` were started alone while its module imports: an argparse at its import parses
    no train.py flags (and never blames them)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __enter__(self):
        self.saved, sys.argv = sys.argv, [self.path]

    def __exit__(self, *exc):
        sys.argv = self.saved


def check_signature(f: RewardFunction, columns: list[str]) -> None:
    """The function takes what TRL passes (prompts, completions, completion_ids, trainer_state and the
    dataset's other columns by name), else one line saying what it lacks. A function that names log_extra
    and log_metric gets them."""
    if inspect.isasyncgenfunction(f.fn):
        raise UserError(f"--reward {f.spec}: an async generator (it yields); expected a function returning "
                        f"(or an async function awaiting to) a list of numbers, one per completion")
    try:
        signature = inspect.signature(f.fn)
    except (TypeError, ValueError):   # a builtin or C function: the first call will tell
        return
    names = ["prompts", "completions", "completion_ids", "trainer_state", *columns]
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as err:
        raise UserError(f"--reward {f.spec}: cannot take TRL's arguments ({err}); expected "
                        f"{f.name}(prompts, completions, **kwargs): the dataset's columns "
                        f"({', '.join(columns) or 'none'}) come by name") from None
    f.takes_logging = all(name in signature.parameters for name in LOGGING)


def check_weights(cfg, weights: list[float]) -> None:
    """A tree method's summed reward must stay in [0, 1] (module docstring): weights >= 0 summing to at
    most 1, so that functions giving values in [0, 1] cannot leave it. One line at start otherwise."""
    if M.method_of(cfg).rollout != "tree":
        return
    if any(w < 0 for w in weights) or sum(weights) > 1 + TOLERANCE:
        given = "--reward_weights " + " ".join(f"{w:g}" for w in weights) if cfg.reward_weights else \
            f"{len(weights)} functions weighted 1 each (no --reward_weights)"
        below = " and go below 0" if min(weights) < 0 else ""
        raise UserError(f"--reward: {given}: a weighted sum of values in [0, 1] can reach "
                        f"{sum(w for w in weights if w > 0):g}{below}"
                        f"; {cfg.method} is a tree method and needs each reward in [0, 1] (V(root) sets K̂ "
                        f"and B̂, Sec. 4.1): expected weights >= 0 summing to at most 1 (e.g. "
                        f"{' '.join(f'{1 / len(weights):.3g}' for _ in weights)}), or --method grpo or "
                        f"drgrpo (any finite reward)")


def load(cfg, problems: list[dict]) -> Rewards | None:
    """The run's Rewards, or None: the grader (no --reward). Weights first (check_weights), then each
    function is loaded and its signature checked against the training data's columns (`problems`, loaded
    with data.options' keep_columns: every column any row has; a row without one passes None)."""
    if not cfg.reward:
        return None
    weights = [float(w) for w in (cfg.reward_weights or [1.0] * len(cfg.reward))]
    check_weights(cfg, weights)
    functions, names, loaded = [], {}, {}
    for spec, weight in zip(cfg.reward, weights):
        target = spec.rpartition(":")[0]
        if target.endswith(".py"):   # two files of one name in one run: one module name for both
            path, name = Path(target).expanduser().resolve(), Path(target).stem
            if names.setdefault(name, path) != path:
                raise UserError(f"--reward {spec}: its module name {name!r} is also {names[name]}'s (another "
                                f"--reward); expected reward files with different names")
        fn, source = load_function(spec, loaded)
        functions.append(RewardFunction(spec, fn, weight, source))
    columns = sorted(set().union(*(p.get("columns", {"answer": None}) for p in problems)))
    for f in functions:
        check_signature(f, columns)
    method = M.method_of(cfg)
    return Rewards(functions, cfg.method, bounded=method.rollout == "tree", steps=cfg.steps,
                   problems=problems, columns=columns, prompt_style=cfg.prompt_style, few_shot=cfg.few_shot)


# --------------------------------------------------------------------------------------------------------
# The reward files' contents, saved with every checkpoint
# --------------------------------------------------------------------------------------------------------
def source_hashes(cfg) -> dict[str, str] | None:
    """{--reward spec: SHA-256 of the file that defines it} (None without --reward): FILE.py read before it
    runs; a module:function's file as found on the path (without importing it)."""
    if not cfg.reward:
        return None
    out = {}
    for spec in cfg.reward:
        target = spec.rpartition(":")[0]
        if target.endswith(".py"):
            path = Path(target).expanduser()
        else:
            with importable(os.getcwd()):
                try:
                    found = importlib.util.find_spec(target)
                except (ImportError, ValueError):
                    found = None
            path = Path(found.origin) if found is not None and found.origin else None
        out[spec] = "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() \
            if path is not None and path.is_file() else None
    return out


def check_resume_source(state: dict | None, hashes: dict | None, allow: bool) -> dict[str, tuple]:
    """A resume whose reward file changed since the checkpoint (edited in place) trains another objective:
    one UserError line naming the file, unless `allow` (--allow_config_change true); returns {"reward file
    SPEC": (old, new)} for config.json's history. Checkpoints of earlier versions record none."""
    saved = (state or {}).get("reward_sources")
    if not isinstance(saved, dict) or not hashes:
        return {}
    changes = {f"reward file {spec}": (saved[spec], now) for spec, now in hashes.items()
               if saved.get(spec) is not None and now is not None and saved[spec] != now}
    if changes and not allow:
        listed = ", ".join(f"{key[12:]}: {measured.short(old)} -> {measured.short(now)}"
                           for key, (old, now) in changes.items())
        raise UserError(f"--resume: a reward file changed since the checkpoint was written ({listed}); the "
                        f"run would continue with another objective; expected the file the run trained with, "
                        f"or --allow_config_change true to continue with this one (recorded in config.json's "
                        f"history)")
    return changes


Score = Callable[[int, list[list[int]]], list[float]]   # (prompt's index in the batch, token ids) -> rewards


def scorer(rewards: Rewards | None, tokenizer, indices: list[int] | None, step: int) -> Score | None:
    """rollout.rollout_trees's `score` for a batch whose prompts are the training problems at `indices`
    (offpolicy.Batch's): their completions' token ids -> the summed rewards. None without --reward: the
    rollout grades with reward.compute_reward."""
    if rewards is None:
        return None
    if indices is None:
        raise UserError("--reward: this batch was drawn before its problems were recorded (a checkpoint of "
                        "an older version in the middle of a one-step off-policy run); resume it without "
                        "--reward")
    batch = [rewards.problems[i] for i in indices]
    seen = [model_prompt(p, tokenizer, rewards.prompt_style, rewards.few_shot) for p in batch]

    def score(p: int, token_lists: list[list[int]]) -> list[float]:
        texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
        return rewards(batch[p], texts, token_lists, step, seen[p])
    return score


def step_means(rewards: Rewards | None) -> dict:
    """The step's mean value of each reward function (and of what they logged with log_metric), for its
    metrics record ({} without --reward)."""
    return rewards.step_means() if rewards is not None else {}
