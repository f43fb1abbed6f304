"""Coming from TRL (issue 35): a reward file and a conversational JSONL written for TRL's GRPOTrainer run
unchanged; a reward out of range for a tree method is one line; --help explains its flags from config.py's
comments; TRL's and verl's names are understood or refused in one line; --resume RUN alone continues a run;
the learning-rate schedule; completions reach the tracker; TRL's data formats load."""
import json
import math
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch

import config as C
import data
import evaluate
import optim as O
import rollout as R
import train
from harness import aliases, cli, custom_reward, tracking
from runtime import faults

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_injection as FI  # noqa: E402

from harness import preflight

FIXTURES = Path(__file__).parent / "fixtures" / "trl"
TINY = ["--preset", "tiny", "--steps", "1", "--threads", "1", "--seed", "3"]


@pytest.fixture
def trl_files(tmp_path):
    """The TRL user's reward file and conversational JSONL, copied (record_call writes beside the file)."""
    folder = tmp_path / "user"
    shutil.copytree(FIXTURES, folder)
    return folder


def calls(folder: Path) -> list[dict]:
    path = folder / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------------------------------------------------
# --reward: TRL's reward functions, unchanged
# ------------------------------------------------------------------------------------------------------
def test_trl_reward_file_and_conversational_jsonl_run_unchanged(trl_files, tmp_path, smollm_tokenizer):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    rewards = str(trl_files / "rewards.py")
    train.main(TINY + ["--train_data", str(trl_files / "train.jsonl"), "--out_dir", str(run),
                       "--reward", f"{rewards}:format_reward", f"{rewards}:accuracy_reward",
                       "--reward", f"{rewards}:record_call", "--reward_weights", "0.5", "0.5", "0",
                       "--log_trees_every", "1", "--report_to", "tensorboard",
                       "--log_completions_every", "1"])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 1
    assert set(rows[-1]["reward_functions"]) == {"format_reward", "accuracy_reward", "record_call"}

    # what the functions were given: TRL's keywords, conversational prompts and completions, the other columns
    received = calls(trl_files)
    problems = {json.dumps(r["prompt"]): r for r in map(json.loads, (trl_files / "train.jsonl").open())}
    trees = [json.loads(line) for line in (run / "trees" / "step_000001.jsonl").read_text().splitlines()]
    leaves = sum(t["leaves"] for t in trees)
    assert sum(len(c["completions"]) for c in received) == leaves      # every leaf graded once
    for call in received:
        row = problems[json.dumps(call["prompts"][0])]                 # the row's prompt as it is: messages
        assert call["columns"] == ["level", "solution", "source"]
        assert call["kwargs"]["solution"] == [row["solution"]] * len(call["completions"])
        assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
                   for c in call["completions"])
        assert call["global_step"] == 0 and call["max_steps"] == 1
    # the chat template applied once to the user's messages, nothing of ours added
    for tr in trees:
        messages = next(r["prompt"] for r in problems.values() if r["prompt"][-1]["content"] in tr["prompt"])
        assert tr["prompt"] == smollm_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                    add_generation_prompt=True)
    # the step's completions as a table in TensorBoard: a header, a separator and a row per leaf
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"tensors": 0}).Reload()
    table = events.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    lines = table.splitlines()
    assert lines[0] == "| tree | leaf | prompt | completion | reward | advantage |"
    assert len(lines) == 2 + leaves


def test_rewards_are_called_as_trl_calls_them_and_summed_by_hand():
    """A conversational problem, three completions: format [1, 1, 0]; accuracy (gold "$3$") [1, 0, 0]
    (an unboxed 3 is not read: TRL's extraction needs the box)."""
    cfg = C.make_config("tiny", method="grpo", reward=[f"{FIXTURES / 'rewards.py'}:format_reward",
                                                        f"{FIXTURES / 'rewards.py'}:accuracy_reward"],
                        reward_weights=[0.5, 2.0])
    problem = {"problem": [{"role": "user", "content": "1 + 2?"}], "answer": "3", "level": None,
               "columns": {"solution": "It is $3$."}}
    rewards = custom_reward.load(cfg, [problem])
    texts = ["so \\boxed{3}", "so \\boxed{4}", "3"]
    assert rewards(problem, texts, [[1], [2], [3]], step=0) == [0.5 * 1 + 2.0 * 1, 0.5 * 1 + 2.0 * 0, 0.0]
    assert custom_reward.step_means(rewards) == {"reward_functions": {"format_reward": 2 / 3,
                                                                      "accuracy_reward": 1 / 3}}
    # a tree method: weights whose sum can leave [0, 1] (1 + 1) are one line at load (issue 44); weights that
    # keep it inside are fine
    with pytest.raises(faults.UserError, match=r"^--reward: --reward_weights 1 1: a weighted sum of values "
                                               r"in \[0, 1\] can reach 2; datpo is a tree method"):
        custom_reward.load(C.make_config("tiny", reward=cfg.reward, reward_weights=[1.0, 1.0]), [problem])
    half = custom_reward.load(C.make_config("tiny", reward=cfg.reward, reward_weights=[0.5, 0.5]), [problem])
    assert half(problem, texts, [[1], [2], [3]], step=0) == [1.0, 0.5, 0.0]


@pytest.mark.parametrize("preset, function, code, expected", [
    ("tiny", "always_two", 2, "always_two gave 2 for a completion of the prompt 'What is"),
    ("grpo", "not_a_number", 2, "not_a_number: returned nan for a completion of the prompt"),
])
def test_a_reward_a_method_cannot_take_is_one_line(trl_files, tmp_path, capsys, preset, function, code,
                                                    expected):
    argv = ["--preset", preset, "--scale", "tiny", "--steps", "1", "--threads", "1", "--train_data",
            str(trl_files / "train.jsonl"), "--out_dir", str(tmp_path / "run"),
            "--reward", f"{trl_files / 'rewards.py'}:{function}"]
    lines = FI.run_cli(capsys, argv, code=code, one_error_line=True)
    assert expected in lines[-1]


def test_grpo_takes_any_finite_reward(trl_files, tmp_path):
    run = tmp_path / "run"
    train.main(["--preset", "grpo", "--scale", "tiny", "--steps", "1", "--threads", "1", "--train_data",
                str(trl_files / "train.jsonl"), "--out_dir", str(run),
                "--reward", f"{trl_files / 'rewards.py'}:always_two"])
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["reward"] == 2.0 and row["v_root"] == 2.0


@pytest.mark.parametrize("spec, expected", [
    ("nowhere.py:f", "--reward nowhere.py:f: no such file nowhere.py"),
    ("{rewards}:missing", "has no function 'missing'; its functions: accuracy_reward, always_two, "
                          "format_reward, not_a_number, record_call"),
    ("no_such_module_35:f", "cannot import no_such_module_35"),
])
def test_reward_specs_that_cannot_load_are_one_line(spec, expected):
    with pytest.raises(faults.UserError, match=expected.replace("(", r"\(")):
        custom_reward.load_function(spec.format(rewards=FIXTURES / "rewards.py"))


def test_a_function_that_cannot_take_trls_arguments_is_refused(tmp_path):
    (tmp_path / "narrow.py").write_text("def narrow(completions):\n    return [0.0] * len(completions)\n")
    cfg = C.make_config("tiny", reward=[f"{tmp_path / 'narrow.py'}:narrow"])
    with pytest.raises(faults.UserError, match=r"cannot take TRL's arguments .*expected narrow\(prompts, "
                                               r"completions, \*\*kwargs\)"):
        custom_reward.load(cfg, [{"problem": "p", "answer": "1", "columns": {"solution": "1"}}])


def test_without_reward_the_rollout_grades_with_the_grader():
    """No --reward: no scorer, rollout_trees grades with reward.compute_reward (its default)."""
    assert custom_reward.scorer(None, None, None, 0) is None
    assert custom_reward.load(C.make_config("tiny"), []) is None
    assert custom_reward.step_means(None) == {}


# ------------------------------------------------------------------------------------------------------
# TRL's data formats
# ------------------------------------------------------------------------------------------------------
def test_conversational_prompts_are_templated_once(smollm_tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    once = data.format_prompt(messages, smollm_tokenizer, "release", few_shot=True)
    assert once == smollm_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert data.format_prompt(once, smollm_tokenizer, "chat") == once      # already templated: as it is
    assert data.format_prompt(once, smollm_tokenizer, "release") == once
    plain = data.format_prompt("What is 2 + 3?", smollm_tokenizer, "release")
    assert not data.carries_template(plain, smollm_tokenizer) and plain.startswith(data.RELEASE_SYSTEM)


def test_conversational_data_needs_a_chat_template():
    class NoTemplate:
        chat_template = None
    rows = data.load_problems(str(FIXTURES / "train.jsonl"))
    with pytest.raises(faults.UserError, match=r"^--train_data: its prompts are conversational .*--model m "
                                               r"has none"):
        preflight.check_conversational(NoTemplate(), "m", {"--train_data": rows, "--eval_data": []})
    preflight.check_conversational(NoTemplate(), "m", {"--train_data": data.load_problems("arith-test", 2)})


def test_trl_rows_load(tmp_path):
    problems = data.load_problems(str(FIXTURES / "train.jsonl"), keep_columns=True)
    assert problems[0]["problem"][-1] == {"role": "user", "content": "What is 2 + 3?"}
    assert [p["answer"] for p in problems] == ["5", "9", "19", "14"]     # math-verify read the solutions
    assert problems[0]["columns"] == {"solution": "We add: 2 + 3 = $5$.", "level": 1, "source": "hand"}
    assert "columns" not in data.load_problems(str(FIXTURES / "train.jsonl"))[0]
    # a solution without \boxed: math-verify's reading; none at all: the one-line skip of training data
    rows = tmp_path / "sol.jsonl"
    rows.write_text('{"problem": "a", "solution": "It is 2."}\n'
                    '{"problem": "b", "solution": "We cannot tell."}\n')
    said = []
    assert [p["answer"] for p in data.load_problems(str(rows), skip_unmatchable=said.append)] == ["2"]
    assert "sol.jsonl line 2: field 'solution' has no \\boxed{...} final answer and math-verify reads none" \
        in said[0]
    # chosen columns; CSV (strings as written, an empty cell absent); JSON Lines in a .json file
    csv = tmp_path / "set.csv"
    csv.write_text("question_text,gold,level\nWhat is 1/2 + 0?,0.5,\n")
    assert data.load_problems(str(csv), prompt_column="question_text", answer_column="gold") == [
        {"problem": "What is 1/2 + 0?", "answer": "0.5", "level": None}]
    lines = tmp_path / "set.json"
    lines.write_text('{"prompt": "p1", "answer": "1"}\n{"prompt": "p2", "answer": "2"}\n')
    assert [p["problem"] for p in data.load_problems(str(lines))] == ["p1", "p2"]
    with pytest.raises(ValueError, match=r"set\.csv line 2: no column 'nope' \(--prompt_column\)"):
        data.load_problems(str(csv), prompt_column="nope")


# ------------------------------------------------------------------------------------------------------
# --help
# ------------------------------------------------------------------------------------------------------
def flag_helps(text: str) -> dict[str, str]:
    """{--flag: its help text} from argparse's --help output (the text after the flag, and the indented
    lines below it)."""
    helps, current = {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if line.startswith("  -"):
            current = stripped.split()[0].rstrip(",")
            helps[current] = stripped[len(stripped.split("  ")[0]):].strip() if "  " in stripped else ""
        elif current and line.startswith(" " * 10) and stripped:
            helps[current] += " " + stripped
        else:
            current = None
    return helps


def explained(help_text: str) -> bool:
    """A help text says something beyond its default and choices: at least three words of its own."""
    words = help_text.split("(default")[0].split("[")[0].split()
    return len(words) >= 3


@pytest.mark.parametrize("parser", [cli.build_parser(), evaluate.build_parser()], ids=["train", "evaluate"])
def test_help_describes_nine_flags_in_ten(parser):
    text = parser.format_help()
    helps = {flag: h for flag, h in flag_helps(text).items() if flag not in ("-h",)}
    assert len(helps) > 80
    described = [flag for flag, h in helps.items() if explained(h)]
    assert len(described) >= 0.9 * len(helps), sorted(set(helps) - set(described))
    assert "(default: None)" not in text and "before the preset" not in text


def test_help_lines_come_from_config_comments_grouped_by_section():
    docs = cli.field_docs()
    assert docs["lr"] == ("update (App. F.2 \"Training Hyperparameters\")",
                          "AdamW learning rate (App. F.2: 5e-6, constant)")
    assert docs["fork_keeps_token"][1].endswith("False: the chosen token is resampled")   # continued lines
    assert docs["method"][0] == "model and data" and docs["seed"][0] == "run"
    assert set(docs) == {f for f in C.Config.__dataclass_fields__}
    text = cli.build_parser().format_help()
    # the preset, the paper's sections (App. F.2's knobs), TRL's names, then the rest in config.py's order
    titles = ["preset:", "rollout and tree", "advantage", "update", "TRL's names", "model and data:",
              "sampling:", "evaluation", "run:"]
    assert [text.index("\n" + t) for t in titles] == sorted(text.index("\n" + t) for t in titles)
    assert "--fork_min_dist FLOAT" in text and "[positive | all]" in text      # choices not in the comment


def test_help_shows_the_presets_defaults_and_evaluate_shows_its_own_flags_first():
    demo = cli.build_parser(defaults=cli.help_defaults(["--preset", "demo", "--help"])).format_help()
    assert "(App. F.2: 5e-6, constant) (default 1e-05)" in " ".join(demo.split())
    text = evaluate.build_parser().format_help()
    assert text.index("\n  --bench") < text.index("\n  --preset") < text.index("\n  --lr ")


# ------------------------------------------------------------------------------------------------------
# TRL's and verl's names, bare booleans
# ------------------------------------------------------------------------------------------------------
def test_trl_and_verl_names_are_our_flags():
    cfg = cli.parse_args(["--preset", "grpo", "--learning_rate", "1e-6", "--num_generations", "8",
                          "--max_completion_length", "256", "--output_dir", "runs/t", "--num_iterations", "3",
                          "--epsilon", "0.1", "--bf16", "--gradient_checkpointing", "--lr_scheduler_type",
                          "cosine", "--warmup_ratio", "0.1"])
    assert (cfg.lr, cfg.group_size, cfg.max_new_tokens, cfg.out_dir, cfg.ppo_epochs) == \
        (1e-6, 8, 256, "runs/t", 3)
    assert (cfg.clip_low, cfg.clip_high) == (0.1, 0.1)      # TRL: epsilon_high defaults to epsilon
    assert cfg.precision == "bf16-autocast" and cfg.gradient_checkpointing is True
    assert (cfg.lr_schedule, cfg.warmup_ratio) == ("cosine", 0.1)
    assert cli.parse_args(["--preset", "grpo", "--epsilon", "0.2", "--epsilon_high", "0.3"]).clip_high == 0.3
    assert cli.parse_args(["--bf16", "false"]).precision == "fp32"
    verl = cli.parse_args(["--preset", "grpo", "actor_rollout_ref.actor.optim.lr=2e-6",
                           "actor_rollout_ref.rollout.n=4", "--data.train_batch_size", "8",
                           "actor_rollout_ref.actor.clip_ratio_high=0.3"])
    assert (verl.lr, verl.group_size, verl.prompts_per_step, verl.clip_high) == (2e-6, 4, 8, 0.3)
    assert cli.parse_args(["--few_shot", "--steps", "3"]).few_shot is True    # a boolean flag alone


@pytest.mark.parametrize("argv, expected", [
    (["--per_device_train_batch_size", "8"], "--per_device_train_batch_size (TRL): TRL counts completions"),
    (["--num_generations", "8"], "--num_generations (TRL's completions per prompt) sets --group_size, which "
                                 "only grpo and drgrpo sample"),
    (["--learning_rate", "1e-6", "--lr", "2e-6"], "--learning_rate (TRL's name) and --lr both set lr"),
    (["--max_steps", "10"], "use --steps"),
    (["data.max_prompt_length=512"], "--data.max_prompt_length (verl): verl truncates"),
    (["--loss_type", "grpo"], "--loss_type: got 'grpo'; accepted here: dapo, dr_grpo"),
])
def test_names_that_mean_something_else_are_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and expected in err and len(err.strip().splitlines()) == 1


def test_every_alias_names_a_field_or_says_what_to_use():
    fields = set(C.Config.__dataclass_fields__)
    for alias in aliases.ALIASES:
        assert (alias.field in fields) if alias.field else len(alias.note.split()) >= 4, alias.name


# ------------------------------------------------------------------------------------------------------
# --resume RUN alone, --config FILE
# ------------------------------------------------------------------------------------------------------
GRPO = ["--preset", "grpo", "--scale", "tiny", "--steps", "2", "--save_every", "1", "--threads", "1",
        "--seed", "4"]


def test_resume_alone_continues_a_grpo_run(tmp_path, monkeypatch, capsys):
    """A GRPO run stopped by SIGTERM after step 1 continues with `--resume RUN` alone (its config.json) and
    ends where the same run uninterrupted ends: same metrics, same weights."""
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    train.main(GRPO + ["--out_dir", str(whole)])
    real = train.ppo_update

    def stop_after_first(*args, **kwargs):
        out = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)     # the loop stops at the end of this step, with a checkpoint
        return out
    monkeypatch.setattr(train, "ppo_update", stop_after_first)
    train.main(GRPO + ["--out_dir", str(stopped)])
    assert len(FI.metric_rows(stopped)) == 1
    monkeypatch.setattr(train, "ppo_update", real)
    capsys.readouterr()
    train.main(["--resume", str(stopped)])
    assert "resumed from" in capsys.readouterr().err
    assert FI.metric_rows(stopped) == FI.metric_rows(whole)
    assert FI.identical_weights(stopped, whole)
    # --config FILE: a new run with those settings (never a resume), flags on top
    cfg = cli.parse_args(["--config", str(stopped / "config.json"), "--out_dir", str(tmp_path / "again")])
    saved = json.loads((whole / "config.json").read_text())
    assert {**saved, "out_dir": str(tmp_path / "again")} == json.loads(cfg.to_json())


def test_resume_alone_needs_the_runs_config(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["--resume", str(tmp_path)])
    assert f"--resume {tmp_path}: no config.json in {tmp_path}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.parse_args(["--config", str(tmp_path / "x.json"), "--preset", "grpo"])
    assert "--config FILE holds every setting" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------
# The learning-rate schedule
# ------------------------------------------------------------------------------------------------------
def test_lr_sequence_by_hand():
    """10 steps, warmup 0.2: W = 2 steps at lr/3, 2lr/3; then p = (t − 2)/8."""
    lr = 3e-6
    linear = [O.lr_at(t, lr, 10, "linear", 0.2) for t in range(10)]
    assert linear == pytest.approx([lr / 3, 2 * lr / 3] + [lr * (1 - k / 8) for k in range(8)], rel=1e-12)
    cosine = [O.lr_at(t, lr, 10, "cosine", 0.2) for t in range(10)]
    assert cosine[2] == lr and cosine[6] == pytest.approx(lr / 2) and cosine[9] == \
        pytest.approx(lr * (1 + math.cos(math.pi * 7 / 8)) / 2)
    assert [O.lr_at(t, lr, 10) for t in range(10)] == [lr] * 10                        # the paper: constant
    assert O.lr_at(0, lr, 10, "constant", 0.25) == lr / 4                               # W = ⌈2.5⌉ = 3


def test_schedule_lr_sets_the_optimizer_and_the_record():
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight], lr=1.0)
    paper = C.make_config("tiny", lr=1e-3)
    assert O.schedule_lr(optimizer, paper, 1) == {} and optimizer.param_groups[0]["lr"] == 1.0   # untouched
    warm = C.make_config("tiny", lr=1e-3, steps=4, warmup_ratio=0.5, lr_schedule="linear")
    assert O.schedule_lr(optimizer, warm, 0) == {"lr": 1e-3 / 3} == {"lr": optimizer.param_groups[0]["lr"]}


# ------------------------------------------------------------------------------------------------------
# Completions in the tracker
# ------------------------------------------------------------------------------------------------------
def test_completion_rows_and_their_table(smollm_tokenizer):
    import advantage as A
    import tree as T

    ids = smollm_tokenizer("The answer is \\boxed{5}", add_special_tokens=False).input_ids
    blocks = [T.Block(parent=None, token_ids=ids[:3], entropies=[0.0] * 3, reward=None, base=0),
              T.Block(parent=0, token_ids=ids[3:], entropies=[0.0] * (len(ids) - 3), reward=1.0, base=0),
              T.Block(parent=0, token_ids=ids[3:4], entropies=[0.0], reward=0.0, base=0, branch=True)]
    tr = T.Tree(prompt="Q|1", prompt_ids=[1], answer="5", blocks=blocks, v_root=1.0, k_hat=1, b_hat=1)
    scores = [A.BlockScore(0.5, 0.0, 0.0, None, a) for a in (0.25, 0.5, None)]
    rows = tracking.completion_rows([tr], [scores], smollm_tokenizer)
    assert [(r["leaf"], r["reward"], r["advantage"]) for r in rows] == [(1, 1.0, "+0.250 → +0.500"),
                                                                         (2, 0.0, "+0.250 → -")]
    assert rows[0]["completion"] == "The answer is \\boxed{5}"
    table = tracking.markdown_table(list(rows[0]), rows).splitlines()
    assert table[2].startswith("| 0 | 1 | Q\\|1 | The answer is \\boxed{5} | 1.000 |")


def test_completions_go_to_the_console_without_a_tracker(smollm_tokenizer, tmp_path, capsys):
    """TRL's --log_completions with no --report_to: every leaf on the console, one heading and two lines
    each (TRL prints its table too); a tracker gets the table instead."""
    assert C.make_config("tiny", log_completions_every=2).report_to == ["none"]
    rows = [{"tree": 0, "leaf": 2, "prompt": "x" * 100 + "What is 2 + 3?", "completion": "It is \\boxed{5}",
             "reward": 1.0, "advantage": "+0.250 → +0.500"},
            {"tree": 1, "leaf": 4, "prompt": "Q", "completion": "word " * 40, "reward": 0.0,
             "advantage": "-"}]
    tracking.Log(tmp_path).completions(3, rows)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("completions of step 3") and len(lines) == 1 + 2 * len(rows)
    assert lines[1] == "  0, 2: 1, +0.250 → +0.500"
    assert lines[2].endswith("What is 2 + 3? | It is \\boxed{5}") and lines[2].startswith("    …x")
    assert lines[4].endswith("…") and len(lines[4]) == len("    Q | ") + 72


def test_kl_beta_trains_against_the_frozen_initial_policy(tmp_path, monkeypatch):
    """TRL's --beta is --kl_beta: the run loads π_ref (the initial weights, frozen) and hands it to every
    update; β = 0 (the paper) loads none."""
    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    seen = []
    real = train.ppo_update

    def spy(policy, *args, **kwargs):
        reference = kwargs.get("reference", args[7] if len(args) > 7 else None)
        before = {k: v.clone() for k, v in policy.state_dict().items()}
        out = real(policy, *args, **kwargs)
        seen.append((reference, before, {k: v.clone() for k, v in policy.state_dict().items()}))
        return out
    monkeypatch.setattr(train, "ppo_update", spy)
    train.main(TINY + ["--steps", "3", "--beta", "0.5", "--out_dir", str(tmp_path / "kl")])
    reference = seen[0][0]
    assert reference is not None and reference is seen[1][0] and reference is seen[2][0]
    assert not any(p.requires_grad for p in reference.parameters())
    ref = reference.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in seen[0][1].items())          # the initial weights
    assert any(not torch.equal(ref[k], v) for k, v in seen[2][2].items())      # the policy moved, π_ref not
    assert json.loads((tmp_path / "kl" / "config.json").read_text())["kl_beta"] == 0.5
    # TRL logs `kl` when β > 0: the mean k3 over the tokens the loss saw; 0 while θ = π_ref, > 0 once moved
    steps = [json.loads(line) for line in (tmp_path / "kl" / "metrics.jsonl").read_text().splitlines()]
    # (a step where every response got the same reward trains nothing, and θ stays π_ref for the next)
    moved = [i for i, r in enumerate(steps) if r["trained_blocks"] > 0]
    assert moved and moved[0] + 1 < len(steps), "no step trained before the last: nothing to measure"
    assert all(r["kl"] >= 0 for r in steps)
    assert all(r["kl"] > 0 for r in steps[moved[0] + 1:])
    seen.clear()
    train.main(TINY + ["--out_dir", str(tmp_path / "plain")])
    assert seen[0][0] is None
    assert "kl" not in json.loads((tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()[0])


# ------------------------------------------------------------------------------------------------------
# Round 2 (issue 41): TRL's Example 4 (prompt + task, no answer), verbatim prompts, level names, the
# assistant's turn continued, a run resumed from another folder, TRL's names near the top of --help
# ------------------------------------------------------------------------------------------------------
TASK_REWARD = '''
def task_reward(prompts, completions, task, **kwargs):
    """TRL's multi-task example: each row says which task it is; a length score per task."""
    scale = {"math": 10, "code": 20}
    return [min(len(c), scale[t]) / scale[t] for c, t in zip(completions, task)]
'''


def test_example_4_rows_without_an_answer_train_under_reward_with_verbatim_prompts(tmp_path, capsys):
    """TRL's multi-task dataset (`prompt` + `task`, no answer) trains under --reward; the held-out
    evaluation of the same file grades the one row with an answer, and says so; --prompt_style verbatim
    gives the model each prompt as written; level names ("hard") are levels; --log_completions without a
    tracker prints the completions."""
    rows = [{"prompt": "Solve 2 + 2, then stop.", "task": "math", "level": "hard"},
            {"prompt": "Write a Python function that adds two numbers.", "task": "code", "level": "easy"},
            {"prompt": "What is 3 + 4?", "answer": "7", "task": "math", "level": "hard"}]
    data_file = tmp_path / "tasks.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "task_rewards.py").write_text(TASK_REWARD)
    run = tmp_path / "run"
    reward = f"{tmp_path / 'task_rewards.py'}:task_reward"
    train.main(TINY + ["--train_data", str(data_file), "--eval_data", str(data_file), "--eval_every", "1",
                       "--reward", reward, "--prompt_style", "verbatim", "--log_completions",
                       "--log_trees_every", "1", "--prompts_per_step", "3",
                       "--out_dir", str(run)])
    err = capsys.readouterr().err
    assert f"--eval_data {data_file}: 2 of 3 rows have no answer; the held-out evaluation grades the 1 " \
           f"that have one" in err
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval" in r]
    assert evals and all(r["n_problems"] == 1 for r in evals)
    (step,) = [r for r in records if "eval" not in r]
    assert set(step["levels"]) == {"hard", "easy"} and step["reward_functions"]["task_reward"] > 0
    trees = tracking.read_trees(run, 1)
    assert sorted(t["prompt"] for t in trees) == sorted(r["prompt"] for r in rows)    # as written
    assert sum(t["answer"] is None for t in trees) == 2
    assert "completions of step 1" in err and err.count("\n    ") >= sum(t["leaves"] for t in trees)
    # without --reward the same file is one line naming the row and --answer_column
    with pytest.raises(ValueError, match=r"tasks\.jsonl line 1: missing answer field \(expected 'answer', "
                                         r"'final_answer', or 'solution' with \\boxed\{\}, or name yours "
                                         r"with --answer_column; rows without one train only under "
                                         r"--reward\)"):
        data.load_problems(str(data_file))


def test_level_names_are_levels_in_order():
    assert [data._parse_level(v, "f") for v in ("Level 3", "hard", " easy ", "?", "", 2, 4.0)] == \
        [3, "hard", "easy", None, None, 2, 4]
    problems = [{"level": lv} for lv in ("hard", 2, None, "easy", 1, 2)]
    assert list(data.summarize(problems)["by_level"]) == [1, 2, "easy", "hard", None]
    with pytest.raises(ValueError, match=r"f: level must be an int, 'Level N' or a name, got \[3\]"):
        data._parse_level([3], "f")


def test_an_assistant_last_prompt_is_continued_and_a_system_last_one_is_one_line(smollm_tokenizer, tmp_path):
    """TRL's rule (trl.data_utils.apply_chat_template): a user message last gets the generation prompt, an
    assistant message last is continued (its turn left open), any other last role is refused."""
    tok = smollm_tokenizer
    asked = [{"role": "user", "content": "What is 2 + 3?"}]
    started = asked + [{"role": "assistant", "content": "Let me think. 2 + 3 ="}]
    prompt = data.format_prompt(started, tok)
    assert prompt == tok.apply_chat_template(started, tokenize=False, continue_final_message=True)
    assert prompt.endswith("2 + 3 =") and prompt.startswith(data.format_prompt(asked, tok)[:-1].rsplit(
        "<|im_start|>assistant", 1)[0])
    assert data.format_prompt(asked, tok) == tok.apply_chat_template(asked, tokenize=False,
                                                                     add_generation_prompt=True)
    last_system = tmp_path / "system.jsonl"
    last_system.write_text(json.dumps({"prompt": asked + [{"role": "system", "content": "Be brief."}],
                                       "answer": "5"}) + "\n")
    with pytest.raises(ValueError, match=r"system\.jsonl line 1: field 'prompt' ends with a 'system' "
                                         r"message; expected the last message to be the user's "
                                         r"\(answered\) or the assistant's \(continued\), as TRL requires"):
        data.load_problems(str(last_system))
    assert data.format_prompt("  Plain text, as written.\n", tok, style="verbatim") == \
        "  Plain text, as written.\n"
    with pytest.raises(ValueError, match="--few_shot adds a worked example"):
        C.make_config("tiny", prompt_style="verbatim", few_shot=True)


def test_a_run_resumes_from_another_working_folder(tmp_path, monkeypatch):
    """Relative paths are stored resolved in config.json, so `--resume RUN` alone continues from anywhere;
    a relative path an older run saved is the same file when it names it from here."""
    from harness import runs

    monkeypatch.setattr(R, "compute_reward", FI.stand_in_reward)
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    (home / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (home / "data" / "train.jsonl").write_text("".join(
        json.dumps({"problem": f"What is {a} + 2?", "answer": str(a + 2)}) + "\n" for a in range(6)))
    monkeypatch.chdir(home)
    train.main(TINY + ["--train_data", "data/train.jsonl", "--out_dir", "runs/mine"])
    saved = json.loads((home / "runs" / "mine" / "config.json").read_text())
    assert saved["train_data"] == str(home / "data" / "train.jsonl")
    assert runs.config_changes({"train_data": "data/train.jsonl"}, {"train_data": saved["train_data"]}) == {}
    monkeypatch.chdir(elsewhere)
    train.main(["--resume", str(home / "runs" / "mine"), "--steps", "2"])
    steps = [json.loads(line)["step"] for line in (home / "runs" / "mine" / "metrics.jsonl").open()]
    assert steps == [1, 2] and not (elsewhere / "runs").exists()


def test_help_lists_every_trl_name_near_the_top_with_its_translation_or_refusal():
    text = cli.build_parser().format_help()
    top = text[:text.index("\nmodel and data:")]
    helps = flag_helps(top)
    for alias in aliases.ALIASES:
        if alias.source != "TRL":
            assert f"--{alias.name} " not in text      # verl's names: docs/trl.md
            continue
        shown = helps[f"--{alias.name}"].strip()
        if alias.field is None:
            assert shown.startswith("refused: ") and ("use" in shown or "logged" in shown), alias.name
        else:
            assert f"--{alias.field}" in shown or alias.note in shown, alias.name
