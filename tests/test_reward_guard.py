"""Issue 40, part 2: one output never ends a run. A grader or --reward function that raises scores 0, is
counted (reward_errors in metrics.jsonl, an evaluation's results) and recorded (reward_errors.jsonl: where,
function, response, gold, traceback); only more than --max_reward_error_share of a step's responses (a
benchmark's samples) failing in one function stops the run, with one line naming it. Faults are injected
from outside (tests/inject.py's DATPO_REWARD_RAISE_AT, a reward file of the test's own)."""
import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

import fault_injection as FI
import inject
import pytest

import config as C
import evaluate as E
import rollout
from harness import custom_reward, reward_guard
from runtime import faults

TINY = ["--preset", "tiny", "--threads", "1", "--seed", "11", "--steps", "2"]


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def records(run: Path) -> list[dict]:
    return lines_of(run / "metrics.jsonl")


@pytest.fixture
def forget_modules():
    """Reward modules a test loads leave sys.modules afterwards (test_reward_contract.py's)."""
    import sys

    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name in custom_reward.LOADED:
            del sys.modules[name]


# ------------------------------------------------------------------------------------------------------
# The guard itself: 0 for what raised, the real value for the rest
# ------------------------------------------------------------------------------------------------------
def test_the_grader_scorer_gives_0_to_what_raised_and_the_grader_s_value_to_the_rest(smollm_tokenizer,
                                                                                    tmp_path, monkeypatch):
    def grader(text, answer, fallback=False):
        if "7" in text:
            raise AttributeError("'NoneType' object has no attribute 'replace'")
        return float(answer in text)
    monkeypatch.setattr(rollout, "compute_reward", grader)
    cfg = C.make_config("tiny", max_reward_error_share=0.5)
    errors = reward_guard.run_errors(tmp_path, cfg)
    batch = SimpleNamespace(answers=["3", "5"], indices=[0, 1])
    score = reward_guard.scorer(None, smollm_tokenizer, cfg, errors, batch, step=4)
    texts = ["so 3", "so 7", "so 5", "so 37"]
    ids = [smollm_tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    assert score(0, ids) == [1.0, 0.0, 0.0, 0.0]       # "so 37" holds the gold 3, but its grading raised
    assert score(1, ids[2:3]) == [1.0]
    assert errors.take() == {reward_guard.GRADER: [2, 5]}
    lines = lines_of(tmp_path / "reward_errors.jsonl")
    assert [(x["step"], x["response"], x["gold"], x["function"]) for x in lines] == \
        [(5, "so 7", "3", "reward.compute_reward"), (5, "so 37", "3", "reward.compute_reward")]
    assert lines[0]["error"] == "AttributeError: 'NoneType' object has no attribute 'replace'"
    assert lines[0]["traceback"].startswith("Traceback") and "in grader" in lines[0]["traceback"]
    with pytest.raises(reward_guard.ShareExceeded, match=r"reward.compute_reward raised on 3 of 5 "):
        errors.check({reward_guard.GRADER: [3, 5]}, "responses of step 5", "stopped")
    errors.check({reward_guard.GRADER: [2, 4]}, "responses of step 5", "stopped")     # 50 % is not more


def test_a_reward_function_that_raises_gives_0_and_the_others_values_stand(tmp_path, forget_modules):
    path = tmp_path / "user" / "guarded_rewards.py"
    path.parent.mkdir()
    path.write_text(textwrap.dedent("""
        def broken(completions, **kwargs):
            if any("x" in c for c in completions):
                raise KeyError("no such key")
            return [1.0] * len(completions)

        def length(completions, **kwargs):
            return [len(c) / 10 for c in completions]

        def short(completions, **kwargs):
            return [1.0, 2.0]                         # the contract: still one line, never a 0
        """))
    problem = {"problem": "1 + 2?", "answer": "3", "level": None}
    cfg = C.make_config("tiny", method="grpo", reward=[f"{path}:broken", f"{path}:length"])
    rewards = custom_reward.load(cfg, [problem])
    rewards.errors = reward_guard.run_errors(tmp_path, cfg)
    assert rewards(problem, ["ab", "abc"], [[1], [2]], step=0) == [1.2, 1.3]
    assert rewards(problem, ["xy", "abc"], [[1], [2]], step=0) == [0.2, 0.3]   # broken's 0, length's kept
    assert rewards.errors.take() == {f"{path}:broken": [2, 4], f"{path}:length": [0, 4]}
    lines = lines_of(tmp_path / "reward_errors.jsonl")
    assert [(x["response"], x["gold"], x["function"], x["error"]) for x in lines] == \
        [(text, "3", f"{path}:broken", "KeyError: 'no such key'") for text in ("xy", "abc")]
    assert "guarded_rewards.py" in lines[0]["traceback"]
    short = custom_reward.load(C.make_config("tiny", method="grpo", reward=[f"{path}:short"]), [problem])
    short.errors = rewards.errors
    with pytest.raises(faults.UserError, match="returned 2 values for 3 completions"):
        short(problem, ["a", "b", "c"], [[1], [2], [3]], step=0)


@pytest.mark.parametrize("share, ok", [(-0.1, False), (0.0, True), (1.0, True), (1.5, False)])
def test_the_share_is_a_fraction(share, ok):
    if ok:
        assert C.make_config("tiny", max_reward_error_share=share).max_reward_error_share == share
    else:
        with pytest.raises(ValueError, match=r"--max_reward_error_share: got .*, expected a fraction in "
                                             r"\[0, 1\]"):
            C.make_config("tiny", max_reward_error_share=share)


# ------------------------------------------------------------------------------------------------------
# Injected into training and its held-out evaluations
# ------------------------------------------------------------------------------------------------------
def test_a_grader_that_raises_in_training_and_its_evaluations_ends_in_exit_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(rollout, "compute_reward", FI.stand_in_reward)
    inject.install_reward_raise("train:9,eval:3", monkeypatch.setattr)
    run = tmp_path / "run"
    FI.run_cli(capsys, TINY + ["--eval_every", "2", "--eval_limit", "4", "--eval_k", "2",
                               "--max_reward_error_share", "0.5", "--out_dir", str(run)])
    lines = lines_of(run / "reward_errors.jsonl")
    for line in lines:
        assert line["function"] == "reward.compute_reward" and line["response"] and line["gold"]
        assert line["error"].startswith("AttributeError: 'NoneType' object has no attribute 'replace'")
        assert line["traceback"].startswith("Traceback") and "inject.py" in line["traceback"]
    steps = [r for r in records(run) if "eval" not in r]
    evals = [r for r in records(run) if "eval" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["eval"] for r in evals] == ["before", "after"]
    for r in steps:   # each step's count is its lines (the training grader's)
        assert r["reward_errors"] == sum(x["step"] == r["step"] and "eval" not in x for x in lines)
    for r in evals:   # every 3rd evaluation sample raised: 8 samples each, 2 + 3 failed
        assert r["reward_errors"] == sum(x.get("eval") == r["eval"] for x in lines)
    assert [r["reward_errors"] for r in evals] == [2, 3] and sum(r["reward_errors"] for r in steps) > 0


def test_more_than_the_share_failing_stops_the_run_with_one_line(program_name, tmp_path, capsys,
                                                                monkeypatch):
    monkeypatch.setattr(rollout, "compute_reward", FI.stand_in_reward)
    inject.install_reward_raise("train:2", monkeypatch.setattr)     # half the responses
    run = tmp_path / "run"
    lines = FI.run_cli(capsys, TINY + ["--out_dir", str(run)], code=2, one_error_line=True)
    failed = records(run)[0]["reward_errors"]
    assert len(lines_of(run / "reward_errors.jsonl")) == failed > 0
    assert lines[-1].startswith(f"train.py: error: reward.compute_reward raised on {failed} of ")
    assert lines[-1].endswith(
        f"responses of step 1 (50.0% > --max_reward_error_share 0.05), each with its traceback in "
        f"{run}/reward_errors.jsonl; the run stopped after step 1 without saving it (last checkpoint: "
        f"none): fix the function and start the run again; expected a grader that returns 0 or 1 for "
        f"every response (this one has a bug: please report it with that file)")
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*"))


def test_a_reward_function_over_the_share_stops_naming_it(program_name, tmp_path, capsys, forget_modules):
    path = tmp_path / "user" / "flaky_rewards.py"
    path.parent.mkdir()
    path.write_text("def f(completions, **kwargs):\n    raise ZeroDivisionError('division by zero')\n")
    run = tmp_path / "run"
    lines = FI.run_cli(capsys, TINY + ["--reward", f"{path}:f", "--out_dir", str(run)], code=2,
                       one_error_line=True)
    count = records(run)[0]["reward_errors"]
    assert lines[-1].startswith(f"train.py: error: --reward {path}:f raised on {count} of {count} responses "
                                f"of step 1 (100.0% > --max_reward_error_share 0.05)")
    assert lines[-1].endswith("expected a function that returns a value for every completion")
    errors = {x["error"] for x in lines_of(run / "reward_errors.jsonl")}
    assert errors == {"ZeroDivisionError: division by zero"}


# ------------------------------------------------------------------------------------------------------
# Injected into evaluate.py
# ------------------------------------------------------------------------------------------------------
EVAL = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "4", "--k", "2",
        "--max_new_tokens", "6"]


def test_a_grader_that_raises_in_evaluation_ends_in_exit_0_and_rescore_regrades(tmp_path, capsys,
                                                                                monkeypatch):
    inject.install_reward_raise("eval:3", monkeypatch.setattr)
    out = tmp_path / "ev"
    result = faults.main_guard(E.main, EVAL + ["--max_reward_error_share", "0.5", "--out_dir", str(out)])
    assert result["tiny-random"]["arith-test"]["reward_errors"] == 2                  # of 8 samples
    assert json.loads((out / "results.json").read_text())["benchmarks"]["arith-test"]["reward_errors"] == 2
    lines = lines_of(out / "reward_errors.jsonl")
    samples = lines_of(out / "samples_arith-test.jsonl")
    failed = [s for s in samples if s.get("reward_error")]
    assert [(x["bench"], x["response"], x["gold"], x["function"]) for x in lines] == \
        [("arith-test", s["response"], s["gold"], "reward.compute_reward") for s in failed]
    assert all(not s["correct"] and s["answer"] is None for s in failed)
    assert "inject.py" in lines[0]["traceback"]
    monkeypatch.undo()   # the grader fixed: --rescore grades those samples again
    bench, rescored = E.rescore_file(out / "samples_arith-test.jsonl")
    assert rescored["reward_errors"] == 0 and rescored["n_samples"] == 8


def test_an_evaluation_over_the_share_stops_with_one_line(tmp_path, capsys, monkeypatch):
    inject.install_reward_raise("eval:1", monkeypatch.setattr)
    out = tmp_path / "ev"
    line = FI.refused_as(capsys, E.main, EVAL + ["--out_dir", str(out)], "evaluate.py")
    samples = out / "samples_arith-test.jsonl"
    assert line == (f"evaluate.py: error: reward.compute_reward raised on 8 of 8 samples of arith-test "
                    f"(100.0% > --max_reward_error_share 0.05), each with its traceback in "
                    f"{out}/reward_errors.jsonl; its samples are saved in {samples}; once the grader is "
                    f"fixed, evaluate.py --rescore {samples} regrades them; expected a grader that returns "
                    f"0 or 1 for every response (this one has a bug: please report it with that file)")
