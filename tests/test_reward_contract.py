"""Issue 44, --reward functions cannot touch the run: fresh copies per call, absent columns as None, numbers
of any scalar kind, SystemExit/KeyboardInterrupt ending the run as a line with a checkpoint, module names that
neither shadow nor are shadowed, the reward file's hash under --resume, --stop_timeout reaching a call
blocked in C; and TRL's parity: async functions awaited, log_extra/log_metric, the prompt the model saw,
weights whose sum can leave [0, 1] refused at start for tree methods."""
import copy
import json
import os
import signal
import sys
import textwrap
import time
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace

import fault_injection as FI
import numpy as np
import pytest
import torch

import config as C
import data
import rollout
import tree as T
from harness import custom_reward, runs, signals, tracking
from runtime import faults

TINY = ["--preset", "tiny", "--threads", "1", "--seed", "3"]


def reward_file(folder: Path, body: str, name: str = "my_rewards.py") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return path


@pytest.fixture
def forget_modules():
    """Reward modules a test loads leave sys.modules afterwards (a later test may load another file of the
    same name, as a later run of the same process may)."""
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name in custom_reward.LOADED:
            del sys.modules[name]


def rewards_of(tmp_path, body: str, problems: list[dict], **config) -> custom_reward.Rewards:
    path = reward_file(tmp_path / "user", body)
    cfg = C.make_config("tiny", method=config.pop("method", "grpo"), reward=[f"{path}:f"], **config)
    return custom_reward.load(cfg, problems)


# ------------------------------------------------------------------------------------------------------
# Copies and columns
# ------------------------------------------------------------------------------------------------------
def test_a_reward_function_gets_fresh_copies_never_the_datasets_objects(tmp_path, forget_modules):
    problem = {"problem": [{"role": "user", "content": "1 + 2?"}], "answer": "3", "level": None,
               "columns": {"tags": ["easy"]}}
    kept = copy.deepcopy(problem)
    # the issue's: a function that appends to prompts changed the training data of later steps
    rewards = rewards_of(tmp_path, """
        def f(prompts, completions, tags, **kwargs):
            prompts[0].append({"role": "user", "content": "and more"})
            tags[0].append("hard")
            completions[0][0]["content"] = "changed"
            return [len(p) for p in prompts]
        """, [problem])
    assert rewards(problem, ["a", "b"], [[1], [2]], step=0) == [2.0, 1.0]   # one copy per completion
    assert rewards(problem, ["a", "b"], [[1], [2]], step=1) == [2.0, 1.0]   # the next call: fresh again
    assert problem == kept


def test_a_column_a_row_lacks_comes_as_none(tmp_path, forget_modules):
    csv = tmp_path / "train.csv"
    csv.write_text("problem,answer,hint\n1 + 1?,2,think\n2 + 2?,4,\n")    # the issue's: an empty cell
    problems = data.load_problems(str(csv), keep_columns=True)
    assert "hint" not in problems[1]["columns"]
    rewards = rewards_of(tmp_path, """
        def f(completions, hint, **kwargs):
            return [0.0 if h is None else 1.0 for h in hint]
        """, problems)
    assert rewards.columns == ["answer", "hint"]
    assert rewards(problems[0], ["x"], [[1]], step=0) == [1.0]
    assert rewards(problems[1], ["x"], [[1]], step=0) == [0.0]    # was a TypeError mid-step


# ------------------------------------------------------------------------------------------------------
# What a function returns
# ------------------------------------------------------------------------------------------------------
def test_numbers_of_every_scalar_kind_are_rewards(tmp_path, forget_modules):
    kinds = [1, 0.5, True, np.float32(0.25), np.int64(1), np.array(0.75), torch.tensor(0.5),
             torch.tensor([1.0]), Fraction(1, 4), Decimal("0.5"), None]
    problem = {"problem": "p", "answer": "1"}
    rewards = rewards_of(tmp_path, "def f(completions, **kwargs):\n    return KINDS\n", [problem])
    sys.modules["my_rewards"].KINDS = kinds
    assert rewards(problem, ["x"] * len(kinds), [[1]] * len(kinds), step=0) == \
        [1.0, 0.5, 1.0, 0.25, 1.0, 0.75, 0.5, 1.0, 0.25, 0.5, 0.0]
    sys.modules["my_rewards"].KINDS = torch.tensor([0.5, 1.0])          # a tensor of n values: fine too
    assert rewards(problem, ["x", "y"], [[1], [2]], step=0) == [0.5, 1.0]


@pytest.mark.parametrize("value, line", [
    # the issue's: a 0-d tensor was a traceback
    (torch.tensor(0.5), "--reward {path}:f: returned Tensor (0-d) 'tensor(0.5000)'; expected a list of 2 "
                        "numbers, one per completion (TRL's signature)"),
    (np.array(1.0), "--reward {path}:f: returned ndarray (0-d) '1.0'; expected a list of 2 numbers, one per "
                    "completion (TRL's signature)"),
    ([1.0, 1j], "--reward {path}:f: returned complex '1j' for a completion of the prompt 'p'; expected a "
                "number (or None)"),
])
def test_a_single_number_or_a_non_real_is_one_line(tmp_path, forget_modules, value, line):
    problem = {"problem": "p", "answer": "1"}
    rewards = rewards_of(tmp_path, "def f(completions, **kwargs):\n    return VALUE\n", [problem])
    sys.modules["my_rewards"].VALUE = value
    with pytest.raises(faults.UserError) as err:
        rewards(problem, ["x", "y"], [[1], [2]], step=0)
    assert str(err.value) == line.format(path=tmp_path / "user" / "my_rewards.py")


# ------------------------------------------------------------------------------------------------------
# Reward code cannot end the run
# ------------------------------------------------------------------------------------------------------
EXITS = """
    import os, sys
    def f(completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1 and os.path.exists(os.path.join(os.path.dirname(__file__), "EXIT")):
            sys.exit(0)
        return [float(len(c) % 2) for c in completions]
    """


def test_sys_exit_in_a_reward_ends_the_run_with_one_line_and_a_checkpoint(program_name, tmp_path, capsys,
                                                                           forget_modules):
    user = tmp_path / "user"
    path = reward_file(user, EXITS)
    argv = TINY + ["--steps", "2", "--save_every", "5", "--reward", f"{path}:f"]
    # the uninterrupted run, a checkpoint at each step
    FI.run_cli(capsys, argv + ["--save_every", "1", "--out_dir", str(tmp_path / "whole")])
    (user / "EXIT").write_text("")
    run = tmp_path / "run"
    lines = FI.run_cli(capsys, argv + ["--out_dir", str(run)], code=2, one_error_line=True)
    assert lines[-1] == (f"train.py: error: --reward {path}:f: raised SystemExit(0) (sys.exit, exit() or an "
                         f"argparse error) while rewarding; a reward function returns one value per "
                         f"completion and cannot end the run; the run stopped in step 2 with a checkpoint of "
                         f"step 1, {run}/checkpoints/step_000001; fix the function and continue with "
                         f"--resume {run}")
    # was: exit 0, no line, no checkpoint. The rescued checkpoint is the uninterrupted run's step 1: the same
    # weights and the same trainer state (RNG, the data's cursor), so --resume redoes step 2 exactly
    rescued, whole = run / "checkpoints" / "step_000001", tmp_path / "whole" / "checkpoints" / "step_000001"
    assert FI.folder_hash(rescued)["model.safetensors"] == FI.folder_hash(whole)["model.safetensors"]
    states = [runs.load_plain(folder / "trainer_state.pt") for folder in (rescued, whole)]
    assert [(s["step"], s["cursor"], s["rng"]["python"]) for s in states] == \
        [(1, 2, states[1]["rng"]["python"])] * 2
    assert torch.equal(states[0]["rng"]["torch"], states[1]["rng"]["torch"])


@pytest.mark.parametrize("body, ended", [
    ("import sys\nsys.exit(3)\n", "raised SystemExit(3) (sys.exit, exit() or an argparse error)"),
    # argparse at its import saw train.py's flags and blamed them; now it sees none of them ...
    ("import argparse\np = argparse.ArgumentParser()\np.add_argument('data')\np.parse_args()\n",
     "raised SystemExit(2) (sys.exit, exit() or an argparse error)"),
    ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt"),
])
def test_a_reward_module_that_ends_the_process_at_import_is_one_line(tmp_path, capsys, body, ended,
                                                                     forget_modules):
    path = reward_file(tmp_path, body + "def f(completions, **kwargs):\n    return [0.0]\n")
    with pytest.raises(custom_reward.RewardExit) as err:
        custom_reward.load_function(f"{path}:f")
    assert str(err.value) == (f"--reward {path}:f: importing {path} {ended}; a reward module is imported, "
                              f"not run (it gets no command-line arguments of its own): expected it to "
                              f"define its functions without ending the process")
    assert err.value.exit_code == 2 and "train.py" not in capsys.readouterr().err


def test_an_argparse_at_import_without_required_arguments_loads(tmp_path, monkeypatch, forget_modules):
    monkeypatch.setattr(sys, "argv", ["train.py", "--preset", "tiny", "--steps", "3"])
    path = reward_file(tmp_path, "import argparse\nARGS = argparse.ArgumentParser().parse_args()\n"
                                 "def f(completions, **kwargs):\n    return [0.0] * len(completions)\n")
    fn, source = custom_reward.load_function(f"{path}:f")
    assert source == path.resolve() and fn.__module__ == "my_rewards"
    assert sys.argv == ["train.py", "--preset", "tiny", "--steps", "3"]     # given back


def test_a_second_ctrl_c_during_a_reward_still_quits_at_once():
    def stuck(**kwargs):
        raise signals.QuitNow                 # what GracefulStop raises on the second signal
    with pytest.raises(signals.QuitNow):
        custom_reward.call_reward(custom_reward.RewardFunction("x.py:stuck", stuck), {})


# ------------------------------------------------------------------------------------------------------
# Module names: never shadowing, never shadowed
# ------------------------------------------------------------------------------------------------------
def test_a_neighbour_named_like_a_project_module_is_one_line(tmp_path, forget_modules):
    # the issue's: reward.py beside the reward file was silently replaced by the project's reward.py
    reward_file(tmp_path, "def score(text):\n    return 1.0\n", name="reward.py")
    path = reward_file(tmp_path, "import reward\ndef f(completions, **kwargs):\n"
                                 "    return [reward.score(c) for c in completions]\n")
    with pytest.raises(faults.UserError) as err:
        custom_reward.load_function(f"{path}:f")
    project = Path(__file__).resolve().parents[1]
    assert str(err.value) == (f"--reward {path}:f: it imports 'reward', which names both "
                              f"{(tmp_path / 'reward.py').resolve()} beside it and {project / 'reward.py'} "
                              f"(this project's or an imported module's), and Python would give it the "
                              f"latter; expected that neighbour renamed (and its import)")
    # a file named like a project module would replace it for the rest of the run
    named = reward_file(tmp_path / "other", "def f(completions, **kwargs):\n    return [1.0]\n", "config.py")
    with pytest.raises(faults.UserError, match=r"its module name 'config' is already .*config\.py \(this "
                                               r"project's or an imported module's\); expected a reward file "
                                               r"named otherwise \(rename config\.py\)"):
        custom_reward.load_function(f"{named}:f")


def test_a_reward_module_loads_under_its_own_name_with_its_neighbours(tmp_path, forget_modules):
    reward_file(tmp_path, "BONUS = 0.5\n", name="helpers_for_rewards.py")
    path = reward_file(tmp_path, "import helpers_for_rewards\ndef f(completions, **kwargs):\n"
                                 "    return [helpers_for_rewards.BONUS] * len(completions)\n")
    loaded = {}
    fn, _ = custom_reward.load_function(f"{path}:f", loaded)
    assert fn.__module__ == "my_rewards" and sys.modules["my_rewards"].f is fn
    assert fn(completions=["a"]) == [0.5]
    assert custom_reward.load_function(f"{path}:f", loaded)[0] is fn    # two functions of one file in one
    assert custom_reward.load_function(f"{path}:f")[0] is not fn        # run: loaded once; a later run: anew


# ------------------------------------------------------------------------------------------------------
# The reward file is part of what a run is
# ------------------------------------------------------------------------------------------------------
def test_an_edited_reward_file_under_resume_is_refused_or_recorded(program_name, tmp_path, capsys,
                                                                   monkeypatch, forget_modules):
    monkeypatch.setattr(rollout, "compute_reward", FI.stand_in_reward)
    body = "def f(completions, **kwargs):\n    return [0.5] * len(completions)\n"
    path = reward_file(tmp_path / "user", body, "resumed_rewards.py")
    run = tmp_path / "run"
    argv = TINY + ["--save_every", "1", "--reward", f"{path}:f", "--out_dir", str(run)]
    FI.run_cli(capsys, argv + ["--steps", "1"])
    old = custom_reward.source_hashes(C.make_config("tiny", reward=[f"{path}:f"]))[f"{path}:f"]
    path.write_text(path.read_text().replace("0.5", "1.0"))              # edited in place
    new = custom_reward.source_hashes(C.make_config("tiny", reward=[f"{path}:f"]))[f"{path}:f"]
    before = FI.folder_hash(run)
    lines = FI.run_cli(capsys, argv + ["--steps", "2", "--resume", str(run)], code=2, one_error_line=True)
    assert lines[-1] == (f"train.py: error: --resume: a reward file changed since the checkpoint was written "
                         f"({path}:f: {old[:15]}… -> {new[:15]}…); the run would continue with another "
                         f"objective; expected the file the run trained with, or --allow_config_change true "
                         f"to continue with this one (recorded in config.json's history)")
    assert {k: v for k, v in FI.folder_hash(run).items() if k != "run.lock"} == before
    # allowed: recorded in config.json's history and in the first resumed step's metrics record
    FI.run_cli(capsys, argv + ["--steps", "2", "--resume", str(run), "--allow_config_change", "true"])
    history = json.loads((run / "config.json").read_text())["history"]
    assert history[-1]["changed"][f"reward file {path}:f"] == [old, new]
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["resumed_with_changes"] == {f"reward file {path}:f": [old, new]}


# ------------------------------------------------------------------------------------------------------
# --stop_timeout reaches a call blocked in C
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    "import time\ndef f(completions, **kwargs):\n    time.sleep(60)\n",        # the issue's: 49 s for 3 s
    "import subprocess\ndef f(completions, **kwargs):\n    subprocess.run(['sleep', '60'])\n",
])
def test_the_stop_deadline_interrupts_a_reward_blocked_in_c(tmp_path, body, forget_modules):
    path = reward_file(tmp_path, body)
    fn, _ = custom_reward.load_function(f"{path}:f")
    t0 = time.perf_counter()
    with pytest.raises(faults.StopTimeout):
        with signals.GracefulStop(timeout=0.3):
            os.kill(os.getpid(), signal.SIGTERM)
            custom_reward.call_reward(custom_reward.RewardFunction(f"{path}:f", fn), {"completions": ["x"]})
    assert time.perf_counter() - t0 < 3      # 0.3 s and the watchdog's retry, on a busy machine
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# ------------------------------------------------------------------------------------------------------
# TRL's parity
# ------------------------------------------------------------------------------------------------------
def test_async_reward_functions_are_awaited(tmp_path, forget_modules):
    problem = {"problem": "p", "answer": "1"}
    rewards = rewards_of(tmp_path, """
        import asyncio
        async def f(completions, **kwargs):
            await asyncio.sleep(0)
            return [1.0] * len(completions)
        """, [problem])
    assert rewards(problem, ["a", "b"], [[1], [2]], step=0) == [1.0, 1.0]
    with pytest.raises(faults.UserError, match=r"an async generator \(it yields\); expected a function"):
        rewards_of(tmp_path, "async def f(completions, **kwargs):\n    yield [1.0]\n", [problem])


def test_log_extra_and_log_metric_reach_the_metrics_and_the_completions_table(tmp_path, smollm_tokenizer,
                                                                              forget_modules):
    problem = {"problem": "p", "answer": "1"}
    rewards = rewards_of(tmp_path, """
        def f(completions, log_extra=None, log_metric=None, **kwargs):
            log_extra("length", [len(c) for c in completions])
            log_metric("completions", len(completions))
            return [0.0] * len(completions)
        """, [problem])
    ids = smollm_tokenizer("ab c", add_special_tokens=False).input_ids
    blocks = [T.Block(parent=None, token_ids=ids[:1], entropies=[0.0], reward=1.0, base=0),
              T.Block(parent=None, token_ids=ids, entropies=[0.0] * len(ids), reward=0.0, base=1)]
    tr = T.Tree(prompt="p", prompt_ids=[1], answer="1", blocks=blocks, v_root=0.5, k_hat=0, b_hat=0)
    texts = [smollm_tokenizer.decode(b.token_ids) for b in blocks]
    rewards(problem, texts, [b.token_ids for b in blocks], step=0)
    rewards(problem, texts[:1], [blocks[0].token_ids], step=0)
    # log_metric: averaged over the step's calls into the record, and a tracker scalar
    means = custom_reward.step_means(rewards)
    assert means["reward_metrics"] == {"completions": (2 + 1) / 2}
    assert tracking.tags({"step": 1, **means})["train/reward_metrics/completions"] == 1.5
    # log_extra: a column of the completions table, each value on its completion's row
    rows = tracking.completion_rows([tr], [[SimpleNamespace(advantage=0.5)] * 2], smollm_tokenizer)
    table = rewards.extra_columns(rows, [tr])
    assert list(table[0]) == ["tree", "leaf", "prompt", "completion", "reward", "advantage", "length"]
    assert [r["length"] for r in table] == [len(t) for t in texts]


def test_the_reward_sees_the_prompt_the_model_saw(tmp_path, smollm_tokenizer, forget_modules):
    problem = {"problem": "What is 2 + 3?", "answer": "5"}
    rewards = rewards_of(tmp_path, """
        SEEN = []
        def f(prompts, completions, **kwargs):
            SEEN.append((prompts, completions))
            return [0.0] * len(completions)
        """, [problem], prompt_style="release", few_shot=True)
    score = custom_reward.scorer(rewards, smollm_tokenizer, [0], step=0)
    score(0, [smollm_tokenizer("so 5", add_special_tokens=False).input_ids])
    prompts, completions = sys.modules["my_rewards"].SEEN[-1]
    assert prompts == [data.format_prompt(problem["problem"], smollm_tokenizer, "release", True)]   # was: the
    assert completions == ["so 5"]                                                # bare problem text
    # a conversational prompt: TRL's messages; one ending in an assistant message the model continued
    # leaves that message out and starts each completion with it (TRL's rule)
    messages = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "It is"}]
    assert custom_reward.trl_prompt(messages, "<|user|>2 + 3?<|assistant|>It is") == (messages[:1], "It is")
    assert custom_reward.trl_prompt(messages, "<|user|>2 + 3?<|assistant|>It is<|end|><|assistant|>") == \
        (messages, "")


@pytest.mark.parametrize("weights, reach", [
    ([], "2 functions weighted 1 each (no --reward_weights): a weighted sum of values in [0, 1] can reach 2"),
    ([1.5, -0.5], "--reward_weights 1.5 -0.5: a weighted sum of values in [0, 1] can reach 1.5 and go "
                  "below 0"),
])
def test_weights_whose_sum_can_leave_0_1_are_refused_at_start_for_tree_methods(tmp_path, weights, reach,
                                                                               forget_modules):
    path = reward_file(tmp_path, "def f(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    specs = [f"{path}:f", f"{path}:f"]
    with pytest.raises(faults.UserError) as err:
        custom_reward.load(C.make_config("tiny", reward=specs, reward_weights=weights), [])
    assert str(err.value) == (f"--reward: {reach}; datpo is a tree method and needs each reward in [0, 1] "
                              f"(V(root) sets K̂ and B̂, Sec. 4.1): expected weights >= 0 summing to at most 1 "
                              f"(e.g. 0.5 0.5), or --method grpo or drgrpo (any finite reward)")
    assert custom_reward.load(C.make_config("tiny", method="grpo", reward=specs, reward_weights=weights), [])
    assert custom_reward.load(C.make_config("tiny", reward=specs, reward_weights=[0.5, 0.5]), [])
