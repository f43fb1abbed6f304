"""Issue 44: a resumed run is the run it says (π_ref's identity, the optimizer's hyperparameters), results
know what they measured (a journal without its state said aloud), and the grader's bound holds on a busy
machine. (The studies' caches keyed by the run's identity: tests/test_studies.py.)"""
import json
import shutil
import subprocess
import sys
import time

import fault_injection as FI
import pytest

import models
import optim
import reward
import rollout
from harness import journal, runs

TINY = ["--preset", "tiny", "--threads", "1", "--seed", "3", "--save_every", "1"]


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(rollout, "compute_reward", FI.stand_in_reward)


def save_model(folder, tokenizer, seed: int):
    models.tiny_random_model(len(tokenizer), seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def without_lock(folder) -> dict:
    return {k: v for k, v in FI.folder_hash(folder).items() if k != runs.RunLock.NAME}


# ------------------------------------------------------------------------------------------------------
# π_ref: saved with the run, checked at resume
# ------------------------------------------------------------------------------------------------------
def test_a_changed_or_missing_reference_policy_is_refused_or_recorded(program_name, tmp_path, capsys,
                                                                      stand_in, smollm_tokenizer):
    model, run, other = tmp_path / "model", tmp_path / "run", tmp_path / "other"
    save_model(model, smollm_tokenizer, seed=0)
    argv = TINY + ["--model", str(model), "--kl_beta", "0.1", "--out_dir", str(run)]
    FI.run_cli(capsys, argv + ["--steps", "1"])
    saved = runs.load_plain(run / "checkpoints" / "step_000001" / "trainer_state.pt")["reference"]
    assert saved["model"] == str(model) and saved["weights"].startswith("sha256:")
    # the issue's: other weights under --model were used as π_ref without a word
    save_model(model, smollm_tokenizer, seed=1)
    before = without_lock(run)
    lines = FI.run_cli(capsys, argv + ["--steps", "2", "--resume", str(run)], code=2, one_error_line=True)
    assert lines[-1].startswith(f"train.py: error: --resume: π_ref (--model {model}, the reference of "
                                f"--kl_beta) is not the one the run trained against: {model} "
                                f"({saved['weights'][:15]}…) -> {model} (sha256:")
    assert lines[-1].endswith("expected the model the run started from, or --allow_config_change true to "
                              "continue against this one (recorded in config.json's history)")
    assert without_lock(run) == before
    FI.run_cli(capsys, argv + ["--steps", "2", "--resume", str(run), "--allow_config_change", "true"])
    history = json.loads((run / "config.json").read_text())["history"]
    assert "reference policy" in history[-1]["changed"]
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert list(record["resumed_with_changes"]) == ["reference policy"]
    # variant, the issue's: a deleted --model was found only after --overwrite true had replaced the target
    shutil.copytree(run, other)             # another run, which --overwrite true would replace
    shutil.rmtree(model)
    before = without_lock(tmp_path)
    lines = FI.run_cli(capsys, argv + ["--steps", "3", "--resume", str(run), "--out_dir", str(other),
                                       "--overwrite", "true"], code=2, one_error_line=True)
    assert lines[-1].startswith(f"train.py: error: --model (π_ref of --kl_beta) {model}: no such folder; "
                                f"expected smollm2-135m or tiny-random, a local model folder")
    assert without_lock(tmp_path) == before


# ------------------------------------------------------------------------------------------------------
# A change allowed under --allow_config_change takes effect in the optimizer
# ------------------------------------------------------------------------------------------------------
def test_an_allowed_change_of_lr_betas_weight_decay_and_schedule_reaches_the_optimizer(tmp_path, capsys,
                                                                                       stand_in):
    run = tmp_path / "run"
    argv = TINY + ["--out_dir", str(run), "--steps", "2"]
    # step 1 of a warmup over the first half: the checkpoint's optimizer holds lr / 2
    FI.run_cli(capsys, TINY + ["--out_dir", str(run), "--steps", "1", "--warmup_ratio", "0.5"])
    first = runs.load_plain(run / "checkpoints" / "step_000001" / "trainer_state.pt")["optimizer"]
    assert first["param_groups"][0]["lr"] == optim.lr_at(0, 1e-3, 1, "constant", 0.5) == 5e-4
    # the issue's: the resumed optimizer kept the checkpoint's lr (and betas, weight decay, a schedule's lr)
    FI.run_cli(capsys, argv + ["--resume", str(run), "--lr", "2e-3", "--beta1", "0.8", "--weight_decay",
                               "0.01", "--allow_config_change", "true"])
    groups = runs.load_plain(run / "checkpoints" / "step_000002" / "trainer_state.pt")["optimizer"][
        "param_groups"]
    assert all((g["lr"], tuple(g["betas"]), g["weight_decay"]) == (2e-3, (0.8, 0.999), 0.01) for g in groups)
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["resumed_with_changes"] == {
        "lr": [1e-3, 2e-3], "beta1": [0.9, 0.8], "weight_decay": [0.0, 0.01], "warmup_ratio": [0.5, 0.0]}


# ------------------------------------------------------------------------------------------------------
# Saved samples without their state are said aloud
# ------------------------------------------------------------------------------------------------------
def test_a_journal_without_its_state_says_it_starts_over(tmp_path, capsys):
    samples = tmp_path / "samples_x.jsonl"
    samples.write_text('{"a": 1}\n{"a": 2}\n')
    assert journal.Journal(samples, settings={"k": 2}).resume() == []
    assert capsys.readouterr().err.strip() == (f"{samples}: its 2 saved record(s) are not reused (no state "
                                               f"file vouches for them); sampled again")
    assert samples.read_text() == "" and samples.with_name(samples.name + ".state").exists()
    # its state now vouches for nothing: kept (and nothing said) the next time
    assert journal.Journal(samples, settings={"k": 2}).resume() == [] and capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------------------------
# The grader's bound beside two busy processes
# ------------------------------------------------------------------------------------------------------
TOWERS = ["(1+8)^{(1+8)^{(1+8)}}",                                   # the parenthesised tower
          "\\left(9\\right)^{\\left(9\\right)^{\\left(9\\right)}}", "9^{(1+8)^{9}}", "{(9)}^{{(9)}^{(9)}}"]


def test_the_graders_bound_holds_beside_two_busy_processes():
    reward.load_grader()      # a run's first step pays the import once; the bound is a check's
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(0.5)
        for answer in TOWERS:   # refused by the guards unread: microseconds, not the bound
            t0 = time.perf_counter()
            assert reward.compute_reward(f"so $\\boxed{{{answer}}}$", "5") == 0.0
            assert time.perf_counter() - t0 < 0.5, answer
        t0 = time.perf_counter()   # one the guards let through: the alarm cuts it
        assert reward.compute_reward("so $\\boxed{(10^{9})!}$", "7") == 0.0
        assert time.perf_counter() - t0 < reward.TIMEOUT_SECONDS + 1.5
    finally:
        for process in busy:
            process.kill()
            process.wait()
