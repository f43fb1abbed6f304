"""harness/custom_reward.py — `--reward FILE.py:FUNCTION` (or `module:function`): your reward functions,
called as TRL's GRPOTrainer calls them, in place of the binary grader.

    python train.py --preset grpo --reward my_rewards.py:format_reward my_rewards.py:accuracy_reward \
        --reward_weights 0.5 1.0 --train_data train.jsonl

A function written for GRPOTrainer runs unchanged: it is called with keywords only,

    fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=state, **columns) -> list

one call per group of completions of one prompt (a prompt's N base responses, then each branch of its tree):
  prompts          the dataset's prompt as it is, once per completion (a string, or TRL's conversational list
                   of {"role", "content"} messages)
  completions      the decoded completions (special tokens skipped); for a conversational prompt each is
                   [{"role": "assistant", "content": text}], as TRL passes them. In a tree a completion is the
                   whole root-to-leaf response: the base response up to the fork, then the branch
  completion_ids   their token ids
  trainer_state    a transformers.TrainerState: global_step = training steps done, max_steps = --steps
  **columns        every other column of the dataset's row, by name, one value per completion (a `solution`
                   column as it is in the file, before data.py reads the gold answer out of it)
It returns one value per completion: a number, or None (no reward from this function for that completion,
TRL's rule: it adds nothing to the sum). Several functions are summed with --reward_weights (1 each when not
given), as TRL's reward_weights.

Ranges. GRPO and Dr.GRPO take any finite reward. A tree method needs each summed reward in [0, 1]: V(root),
the mean reward of a prompt's base responses, is a success rate from which K̂ = ⌈K_max(1 − V)⌉ and
B̂ = ⌈B_max(1 − V)⌉ are computed (Sec. 4.1), and the block advantages of Eq. 3 are differences of such
values. A value outside, a non-finite value, a value that is not a number or a list of the wrong length is a
UserError naming the function and the value (exit 2). Held-out evaluation always grades correctness with
reward.compute_reward.

The rollout receives the reward as a value (rollout.rollout_trees's `score`): nothing is patched.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import methods as M
from runtime import distributed as D
from runtime.faults import UserError, say

TOLERANCE = 1e-9     # a sum of weighted rewards may miss [0, 1] by rounding (0.1 + 0.2 + 0.7): clamped


@dataclass
class RewardFunction:
    """One --reward: its spelling, the function, its weight, and the step's running sum (step_means)."""
    spec: str
    fn: Callable
    weight: float = 1.0
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
    warned: set = field(default_factory=set)

    def __call__(self, problem: dict, texts: list[str], token_lists: list[list[int]],
                 step: int) -> list[float]:
        """The summed, weighted reward of each completion of one prompt (see the module docstring)."""
        prompt = problem["problem"]
        n = len(texts)
        completions = [[{"role": "assistant", "content": t}] for t in texts] if isinstance(prompt, list) \
            else list(texts)
        columns = problem.get("columns", {"answer": problem["answer"]})
        kwargs = {name: [value] * n for name, value in columns.items()}
        state = trainer_state(step, self.steps)
        totals: list[float] = [0.0] * n
        given = [False] * n
        parts: list[list[str]] = [[] for _ in range(n)]
        for f in self.functions:
            values = f.fn(prompts=[prompt] * n, completions=completions,
                          completion_ids=[list(ids) for ids in token_lists], trainer_state=state, **kwargs)
            values = checked_values(f, values, n, prompt)
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
        """{"reward_functions": {name: mean value this step}} over every rank (TRL logs rewards/<name>/mean);
        the sums start again."""
        sums = D.all_reduce([x for f in self.functions for x in (f.total, f.count)])
        means = {}
        for k, f in enumerate(self.functions):
            total, count = sums[2 * k], sums[2 * k + 1]
            means[f.name if f.name not in means else f.spec] = total / count if count else None
            f.total, f.count = 0.0, 0
        return {"reward_functions": means}


def trainer_state(step: int, steps: int):
    """What TRL passes as trainer_state: a transformers.TrainerState, here counting training steps."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=steps)


def shown(prompt, most: int = 60) -> str:
    """A prompt quoted for a message: its text (a conversational prompt's last message), cut."""
    text = prompt[-1].get("content", "") if isinstance(prompt, list) and prompt else str(prompt)
    text = " ".join(text.split())
    return f"the prompt {text[:most]!r}" + ("..." if len(text) > most else "")


def checked_values(f: RewardFunction, values, n: int, prompt) -> list[float | None]:
    """One finite float (or None) per completion, else a UserError naming the function and what it gave."""
    where = f"--reward {f.spec}"
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
        raise UserError(f"{where}: returned {type(values).__name__} {str(values)[:40]!r}; expected a list of "
                        f"{n} numbers, one per completion (TRL's signature)")
    values = list(values.tolist() if hasattr(values, "tolist") else values)   # a tensor or an array
    if len(values) != n:
        raise UserError(f"{where}: returned {len(values)} values for {n} completions of {shown(prompt)}; "
                        f"expected one per completion")
    out: list[float | None] = []
    for value in values:
        if value is None:
            out.append(None)
            continue
        try:
            number = float(value)
            if isinstance(value, (str, bytes)):
                raise TypeError
        except (TypeError, ValueError):
            raise UserError(f"{where}: returned {type(value).__name__} {str(value)[:40]!r} for a completion "
                            f"of {shown(prompt)}; expected a number (or None)") from None
        if not math.isfinite(number):
            raise UserError(f"{where}: returned {number} for a completion of {shown(prompt)}; expected a "
                            f"finite number (or None: no reward from this function, as in TRL)")
        out.append(number)
    return out


# --------------------------------------------------------------------------------------------------------
# Loading: before anything slow runs, each mistake one line
# --------------------------------------------------------------------------------------------------------
def load_function(spec: str) -> Callable:
    """The function `spec` names: FILE.py:FUNCTION (the file's folder importable while it loads, so it may
    import its neighbours) or module:function (the current folder importable). A UserError otherwise."""
    target, _, name = spec.rpartition(":")
    where = f"--reward {spec}"
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise UserError(f"{where}: no such file {target}; expected FILE.py:FUNCTION naming an existing "
                            f"file")
        module_name = f"datpo_reward_{abs(hash(str(path.resolve())))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        folder = str(path.resolve().parent)
        with importable(folder):
            try:
                sys.modules[module_name] = module
                loader.loader.exec_module(module)
            except Exception as err:
                sys.modules.pop(module_name, None)
                raise UserError(f"{where}: importing {target} raised {type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}") from err
    else:
        with importable(os.getcwd()):
            try:
                module = importlib.import_module(target)
            except Exception as err:
                raise UserError(f"{where}: cannot import {target} ({type(err).__name__}: {err}); expected a "
                                f"module on the Python path, or FILE.py:FUNCTION") from err
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise UserError(f"{where}: {target} has no function {name!r}; its functions: "
                        f"{', '.join(found) or 'none'}")
    return fn


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


def check_signature(f: RewardFunction, columns: list[str]) -> None:
    """The function takes what TRL passes (prompts, completions, completion_ids, trainer_state and the
    dataset's other columns by name), else one line saying what it lacks."""
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


def load(cfg, problems: list[dict]) -> Rewards | None:
    """The run's Rewards, or None: the grader (no --reward). Each function is loaded and its signature checked
    against the training data's columns (`problems`, loaded with data.options' keep_columns)."""
    if not cfg.reward:
        return None
    weights = cfg.reward_weights or [1.0] * len(cfg.reward)
    functions = [RewardFunction(spec, load_function(spec), float(w)) for spec, w in zip(cfg.reward, weights)]
    columns = sorted(set().union(*(p.get("columns", {"answer": None}) for p in problems[:1000])))
    for f in functions:
        check_signature(f, columns)
    method = M.method_of(cfg)
    return Rewards(functions, cfg.method, bounded=method.rollout == "tree", steps=cfg.steps,
                   problems=problems)


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

    def score(p: int, token_lists: list[list[int]]) -> list[float]:
        texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
        return rewards(batch[p], texts, token_lists, step)
    return score


def step_means(rewards: Rewards | None) -> dict:
    """The step's mean value of each reward function, for its metrics record ({} without --reward)."""
    return rewards.step_means() if rewards is not None else {}
