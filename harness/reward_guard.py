"""harness/reward_guard.py — one model output never ends a run: every reward call in training and evaluation
is guarded, counted and recorded.

What is guarded (docs/grader.md, docs/faults.md):
  the grader      reward.compute_reward on each response a training step grades (its N base responses and
                  every leaf of its trees: `scorer`) and mcq.grade / reward.compute_reward on each sample an
                  evaluation grades (evaluate.evaluate_problems: evaluate.py and the held-out evaluation
                  during training)
  --reward        each call of each of your functions (harness/custom_reward.Rewards: one call per group of
                  completions of one prompt)

An Exception raised there does not end the run. The response scores 0 for the grader; for a --reward
function every completion of that call gets 0 from that function (the other functions' values are kept).
A response is never skipped: a tree's values V(s) are means over all the leaves below s (Sec. 4.2), so
dropping a leaf would move its siblings' advantages. Each failure is one line of reward_errors.jsonl in the
run folder (training, and its held-out evaluations) or the evaluation's output folder (evaluate.py): where
(step, or benchmark), the function, the response, the gold answer, the exception and its traceback; the
step's count is `reward_errors` in metrics.jsonl (an evaluation's in its results). Only when more than
--max_reward_error_share of a step's responses (of a benchmark's samples) fail in one function does the
run stop, with one line naming it (ShareExceeded, exit 2): a function that fails that often is broken, and
training on its zeros would train on noise.

What is not caught, on purpose: SystemExit and KeyboardInterrupt (custom_reward.RewardExit: one line, a
checkpoint), a second Ctrl-C (signals.QuitNow) and --stop_timeout (faults.StopTimeout), and the UserErrors
of --reward's contract (a list of the wrong length, a non-number, NaN, a value outside a tree method's
[0, 1], a wrong log_extra/log_metric call): those are the function's answer, not a failure of one input,
and stay one line naming the function and row.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Callable

from runtime import distributed as D
from runtime.faults import UserError, say

GRADER = "reward.compute_reward"     # the name the grader's failures are recorded under
FILE = "reward_errors.jsonl"


class ShareExceeded(UserError):
    """More than --max_reward_error_share of a step's responses (a benchmark's samples) failed in one reward
    function: one line naming it (exit 2)."""

    exit_code = 2


class RewardErrors:
    """The failures of reward calls: counted per function ({name: [failed, graded]}, graded = responses the
    function was asked for), each written as one line of `path` (None: counted only). `where`: what each
    line says it belongs to ({"step": 3} or {"bench": "math500"}), set by the caller."""

    def __init__(self, path: Path | None, share: float, names: list[str] = (GRADER,)):
        self.path, self.share = path, share
        self.names = list(names)
        self.counts = {name: [0, 0] for name in self.names}
        self.where: dict = {}
        self.unwritable = False

    def attempt(self, name: str, fn: Callable, args: tuple, responses: list[str], gold) -> tuple:
        """(fn(*args), None), or (None, "Type: message") when it raised an Exception — recorded once per
        response it was graded for. UserErrors (the contract's lines, a stop timeout) and what is not an
        Exception (SystemExit, KeyboardInterrupt) go on as they are."""
        count = self.counts.setdefault(name, [0, 0])
        count[1] += len(responses)
        try:
            return fn(*args), None
        except UserError:
            raise
        except Exception as err:
            count[0] += len(responses)
            failure = f"{type(err).__name__}: {err}"
            trace = traceback.format_exc()
            for response in responses:
                self.write({**self.where, "function": name, "error": failure, "response": response,
                            "gold": gold, "traceback": trace})
            return None, failure

    def write(self, line: dict) -> None:
        """One line appended to reward_errors.jsonl, whole (one write call, O_APPEND: ranks may share the
        file), at once. A disk that refuses it is said once; the failures are still counted."""
        if self.path is None or self.unwritable:
            return
        data = (json.dumps({"time": round(time.time(), 3), **line}, default=str) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as err:
            self.unwritable = True
            say(f"cannot write {self.path} ({err.strerror or err}); reward failures are still counted "
                f"(reward_errors in metrics.jsonl)")

    def take(self) -> dict[str, list[int]]:
        """{name: [failed, graded]} since the last take, summed over ranks (torchrun); the counts restart."""
        sums = D.all_reduce([x for name in self.names for x in self.counts.get(name, (0, 0))])
        taken = {name: [int(sums[2 * k]), int(sums[2 * k + 1])] for k, name in enumerate(self.names)}
        self.counts = {name: [0, 0] for name in self.names}
        return taken

    def check(self, counts: dict[str, list[int]], what: str, then: str) -> None:
        """ShareExceeded naming the first function whose failures are more than `share` of what it graded
        (`what`: "responses of step 3"; `then`: what happens next, in words)."""
        for name, (failed, graded) in counts.items():
            if graded and failed > self.share * graded:
                shown = f"--reward {name}" if name in self.names and name != GRADER else name
                grader = name in (GRADER, "mcq.grade")
                where = f"each with its traceback in {self.path}" if self.path is not None else \
                    "each scored 0"
                expected = "a grader that returns 0 or 1 for every response (this one has a bug: please " \
                    "report it with that file)" if grader else "a function that returns a value for every " \
                    "completion"
                raise ShareExceeded(
                    f"{shown} raised on {failed} of {graded} {what} ({100 * failed / graded:.1f}% > "
                    f"--max_reward_error_share {self.share:g}), {where}; {then}; expected {expected}")


# --------------------------------------------------------------------------------------------------------
# Training: the rollout's scorer
# --------------------------------------------------------------------------------------------------------
def run_errors(run_dir: Path, cfg) -> RewardErrors:
    """A training run's RewardErrors: RUN/reward_errors.jsonl, one count per function (the grader, or each
    --reward spec)."""
    return RewardErrors(run_dir / FILE, cfg.max_reward_error_share, list(cfg.reward) or [GRADER])


def scorer(rewards, tokenizer, cfg, errors: RewardErrors, batch, step: int):
    """rollout.rollout_trees's `score` for a step's batch (offpolicy.Batch) at `step` (0-based), guarded:
    --reward's functions (custom_reward.scorer; each call guarded in custom_reward.Rewards), or the grader
    on each response against its prompt's gold answer (rollout.compute_reward, looked up at each call)."""
    from harness import custom_reward

    errors.where = {"step": step + 1}         # metrics.jsonl's step: steps done after this one
    if rewards is not None:
        rewards.errors = errors
        return custom_reward.scorer(rewards, tokenizer, batch.indices, step)
    import rollout

    def score(p: int, token_lists: list[list[int]]) -> list[float]:
        texts = tokenizer.batch_decode(token_lists, skip_special_tokens=True)
        gold = batch.answers[p]
        graded = [errors.attempt(GRADER, rollout.compute_reward, (text, gold, cfg.answer_fallback), [text],
                                 gold) for text in texts]
        return [0.0 if failure else value for value, failure in graded]
    return score


def failures(counts: dict[str, list[int]]) -> int:
    """The failures in `counts` (RewardErrors.take): a step's `reward_errors` in metrics.jsonl."""
    return sum(failed for failed, _ in counts.values())


def check_step(errors: RewardErrors, counts: dict[str, list[int]], step: int, run_dir: Path,
               last_checkpoint: str) -> None:
    """After the step's metrics line: ShareExceeded when one function failed on more than the share of the
    step's responses. The step's update is not saved; the line names the checkpoint to resume from."""
    then = f"fix the function and continue with --resume {run_dir}" if last_checkpoint != "none" else \
        "fix the function and start the run again"
    errors.check(counts, f"responses of step {step}", f"the run stopped after step {step} without saving it "
                 f"(last checkpoint: {last_checkpoint}): {then}")


# --------------------------------------------------------------------------------------------------------
# Evaluation: each sample's grade
# --------------------------------------------------------------------------------------------------------
def check_samples(errors: RewardErrors, records: list[dict], bench: str, then: str) -> None:
    """After a benchmark's samples are graded: ShareExceeded when one grader failed on more than the share
    of them (counted from the records, so a rerun over saved samples says the same; `then`: what is kept)."""
    failed = [r["reward_error"]["function"] for r in records if r.get("reward_error")]
    counts = {name: [failed.count(name), len(records)] for name in dict.fromkeys(failed)}
    errors.check(counts, f"samples of {bench}", then)
