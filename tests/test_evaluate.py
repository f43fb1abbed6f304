"""evaluate.py: the metrics against exact combinatorics and hand computation, majority voting with equivalent
spellings, sampling in chunks, and the CLI end to end on a tiny random model (table, results.json, samples,
figures, --rescore reproducing results.json, seeding, run-folder settings, offline errors, the "eval"
out-of-memory site installed at start-up)."""
import itertools
import json
import math
import os
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import config
import data
import evaluate as E
import models
import rollout
from harness import eval_files
from runtime import faults

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------------------------
# pass@k
# ------------------------------------------------------------------------------------------------------
def exact_pass_at_k(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_known_values():
    assert E.pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)             # 1 − C(3,2)/C(5,2) = 1 − 3/10
    assert E.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252, abs=1e-12)   # 1 − C(7,5)/C(10,5)
    assert E.pass_at_k(10, 0, 5) == 0.0
    assert E.pass_at_k(10, 10, 5) == 1.0
    assert E.pass_at_k(8, 1, 8) == 1.0 and E.pass_at_k(8, 0, 8) == 0.0       # k = n: the paper's any-correct
    assert E.pass_at_k(8, 2, 1) == pytest.approx(2 / 8)                      # pass@1 = c/n


def test_pass_at_k_matches_exact_combinatorics_on_a_grid():
    for n in range(1, 13):
        for c, k in itertools.product(range(n + 1), range(1, n + 1)):
            exact = float(exact_pass_at_k(n, c, k))
            assert E.pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_large_n_is_exact_and_finite():
    for n, c, k in [(500, 3, 256), (500, 250, 100), (768, 1, 64), (192, 191, 64)]:
        value = E.pass_at_k(n, c, k)
        assert math.isfinite(value)
        assert value == pytest.approx(float(exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 1, 0), (4, -1, 2), (4, 5, 2)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        E.pass_at_k(n, c, k)


def test_pass_ladder():
    assert E.pass_ladder(8) == [1, 2, 4, 8]
    assert E.pass_ladder(64) == [1, 2, 4, 8, 16, 32, 64]
    assert E.pass_ladder(6) == [1, 2, 4, 6]
    assert E.pass_ladder(1) == [1]


# ------------------------------------------------------------------------------------------------------
# majority vote
# ------------------------------------------------------------------------------------------------------
def test_majority_vote_groups_equivalent_spellings():
    # three spellings of one half (3 votes) beat two identical "3"s; the group's first member is returned
    assert E.majority_vote(["3", "1/2", "3", "0.5", "\\frac12"]) == "1/2"
    assert E.majority_vote(["3", "3", "0.5", "1/2"]) == "3"       # 2 vs 2: "3" appeared first


def test_majority_vote_tie_goes_to_the_earliest_group():
    assert E.majority_vote(["7", "5", "5", "7"]) == "7"
    assert E.majority_vote(["5", "7", "7", "5"]) == "5"
    # a tie across spellings: the first member of the first group
    assert E.majority_vote(["0.5", "2", "2", "\\frac{1}{2}"]) == "0.5"
    assert E.majority_vote(["9", "4", "1"]) == "9"


def test_majority_vote_none_never_wins():
    assert E.majority_vote([None, None, None]) is None
    assert E.majority_vote([]) is None
    assert E.majority_vote([None, None, None, "4", None]) == "4"
    assert E.majority_vote([None, "4", None, "5", "5"]) == "5"


# ------------------------------------------------------------------------------------------------------
# score_records on hand-made records
# ------------------------------------------------------------------------------------------------------
def hand_records():
    """2 problems × 2 runs × k = 3 with (answer, correct) chosen so every metric is hand-computable."""
    table = {  # (problem, run): answers; gold 4 for problem 0, 10 for problem 1
        (0, 0): ["4", "5", "5"], (0, 1): ["4", "4", None],
        (1, 0): [None, "3", "3"], (1, 1): ["10", "2", "3"],
    }
    gold = {0: "4", 1: "10"}
    return [{"index": i, "run": r, "sample": s, "gold": gold[i], "answer": a, "correct": a == gold[i],
             "level": i + 1} for (i, r), answers in table.items() for s, a in enumerate(answers)]


def test_score_records_by_hand():
    res = E.score_records(hand_records(), k=3)
    # avg@k: 4 correct of 12; per run: run0 mean(1/3, 0) = 1/6, run1 mean(2/3, 1/3) = 1/2
    assert res["avg@k"] == pytest.approx(1 / 3)
    assert res["per_run"]["avg@k"] == pytest.approx([1 / 6, 1 / 2])
    # empirical pass@k: run0 problem 0 only → 0.5; run1 both → 1.0; averaged over runs → 0.75
    assert res["per_run"]["pass@k"] == [0.5, 1.0] and res["pass@k"] == pytest.approx(0.75)
    # maj@k: run0 votes "5" (wrong) and "3" (wrong) → 0; run1 "4" (right) and a 3-way tie → "10" (first,
    # right) → 1
    assert res["per_run"]["maj@k"] == [0.0, 1.0] and res["maj@k"] == pytest.approx(0.5)
    # unbiased, runs pooled (n = 6, c = 3 and 1): pass@3 = mean(1 − 1/20, 1 − 10/20);
    # pass@2 = mean(1 − 3/15, 1 − 10/15)
    assert res["pass@k_unbiased"] == pytest.approx(0.725)
    assert res["pass_curve"] == pytest.approx({1: 1 / 3, 2: 17 / 30, 3: 0.725})
    assert (res["n_problems"], res["n_samples"], res["runs"], res["k"]) == (2, 12, 2, 3)
    assert res["avg_by_level"] == pytest.approx({1: 0.5, 2: 1 / 6})


def test_score_records_ignores_file_order_and_checks_shape():
    records = hand_records()
    shuffled = records[:]
    random.Random(0).shuffle(shuffled)
    assert E.score_records(shuffled, 3) == E.score_records(records, 3)   # votes follow "sample", not lines
    with pytest.raises(ValueError, match="expected k=3"):
        E.score_records(records[1:], 3)
    with pytest.raises(ValueError, match="expected k=2"):
        E.score_records(records, 2)


def test_rescore_grades_handwritten_boxed_responses(tmp_path, capsys):
    """Nonzero correctness through the real grader: records carry only responses and gold answers."""
    rows = [
        (0, "\\frac{1}{2}", "So the answer is \\boxed{0.5}."),
        (0, "\\frac{1}{2}", "I think it is \\boxed{3}."),
        (0, "\\frac{1}{2}", "Therefore \\boxed{\\dfrac{1}{2}}"),
        (1, "12", "\\boxed{13}"),
        (1, "12", "Hence $\\boxed{12}$."),
        (1, "12", "The answer is 12."),                           # no box: wrong without the fallback
    ]
    path = tmp_path / "hand" / "samples_toy.jsonl"
    path.parent.mkdir()
    eval_files.write_jsonl(path, [{"index": i, "run": 0, "sample": s % 3, "gold": g, "response": t}
                         for s, (i, g, t) in enumerate(rows)])
    out = E.main(["--rescore", str(path)])
    res = out["hand"]["toy"]
    assert res["avg@k"] == pytest.approx(3 / 6) and res["pass@k"] == 1.0
    # problem 0: {0.5, \dfrac{1}{2}} beat 3 → right; problem 1: 13 vs 12 tie (None does not vote), 13 first
    # → wrong
    assert res["maj@k"] == pytest.approx(0.5)
    assert "toy (k=3)" in capsys.readouterr().out
    fallback = E.main(["--rescore", str(path), "--answer_fallback", "true"])["hand"]["toy"]
    assert fallback["avg@k"] == pytest.approx(4 / 6)              # "The answer is 12." now counts ...
    assert fallback["maj@k"] == 1.0                               # ... and outvotes 13


# ------------------------------------------------------------------------------------------------------
# evaluate_problems: chunks of about gen_batch_size rows, records complete and prompt-major
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, gen_batch_size, expected_rows", [(3, 2, [2, 1, 2, 1, 2, 1]), (2, 5, [4, 2])])
def test_evaluate_problems_chunks_and_records(tiny_policy, monkeypatch, k, gen_batch_size, expected_rows):
    model, tok = tiny_policy
    calls = []
    real = rollout.sample_base

    def spy(sampler, prompt_ids, n, max_new_tokens, **kw):
        calls.append(len(prompt_ids) * n)
        return real(sampler, prompt_ids, n, max_new_tokens, **kw)

    monkeypatch.setattr(rollout, "sample_base", spy)
    cfg = config.make_config("tiny", gen_batch_size=gen_batch_size)
    problems = data.load_problems("arith-test", 3)
    torch.manual_seed(0)
    res = E.evaluate_problems(model, tok, problems, cfg, k=k, max_new_tokens=4, runs=1, progress=False)
    assert calls == expected_rows and max(calls) <= max(gen_batch_size, 1)
    recs = res["records"]
    assert sorted((r["index"], r["run"], r["sample"]) for r in recs) == \
        [(i, 0, s) for i in range(3) for s in range(k)]
    for r in recs:
        assert r["problem"] == problems[r["index"]]["problem"] and r["gold"] == problems[r["index"]]["answer"]
        assert 1 <= r["tokens"] <= 4 and r["correct"] is False
    assert res["n_samples"] == 3 * k and res["n_problems"] == 3 and res["seconds"] > 0
    assert model.training is False


# ------------------------------------------------------------------------------------------------------
# The CLI end to end on the tiny random model
# ------------------------------------------------------------------------------------------------------
TINY = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "4", "--k", "2",
        "--runs", "2", "--max_new_tokens", "6"]


def metrics_only(result):
    return {key: v for key, v in result.items() if key not in ("seconds", "max_new_tokens", "oom_retries")}


def test_cli_end_to_end_and_rescore(tmp_path, capsys):
    out = tmp_path / "ev"
    returned = E.main(TINY + ["--out_dir", str(out)])
    printed = capsys.readouterr().out
    assert "arith-test (k=2)" in printed and "tiny-random" in printed and "Average" in printed

    summary = json.loads((out / "results.json").read_text())
    res = summary["benchmarks"]["arith-test"]
    assert summary["settings"]["max_new_tokens"] == 6 and summary["settings"]["runs"] == 2
    assert (res["k"], res["runs"], res["n_problems"], res["n_samples"]) == (2, 2, 4, 16)
    assert set(res["pass_curve"]) == {"1", "2"} and 0 <= res["avg@k"] <= res["pass@k"] <= 1
    assert json.loads(json.dumps(returned["tiny-random"])) == summary["benchmarks"]

    lines = (out / "samples_arith-test.jsonl").read_text().splitlines()
    assert len(lines) == 16
    rec = json.loads(lines[0])
    assert {"bench", "index", "run", "sample", "problem", "gold", "response", "answer", "correct"} <= set(rec)
    assert rec["problem"] == data.load_problems("arith-test", 4)[0]["problem"]
    for name in ("pass_curves.png", "maj_vs_avg.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rescored = E.main(["--rescore", str(out / "samples_arith-test.jsonl")])
    printed_again = capsys.readouterr().out
    assert json.loads(json.dumps(rescored["ev"]["arith-test"])) == metrics_only(res)
    assert printed_again.splitlines()[-1].split()[1:] == printed.splitlines()[-2].split()[1:]  # same numbers

    # Seeded: a second evaluation samples exactly the same responses.
    E.main(TINY + ["--out_dir", str(tmp_path / "again")])
    again = (tmp_path / "again" / "samples_arith-test.jsonl").read_text().splitlines()
    assert [json.loads(x)["response"] for x in again] == [json.loads(x)["response"] for x in lines]


def test_cli_installs_the_eval_oom_site_at_start_up(tmp_path):
    """`DATPO_OOM_AT=eval python tests/inject.py evaluate.py ...`: the tests' launcher installs the "eval"
    site on the module the command runs, so the first generate call runs out of memory and its rows are
    rerun in smaller calls: one retry, said in one line, every sample."""
    env = {**os.environ, "DATPO_OOM_AT": "eval", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "tests" / "inject.py"), "evaluate.py", *TINY,
               "--out_dir", str(tmp_path / "ev")]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "out of memory in evaluation's generation at 8: retrying at 4" in done.stderr, done.stderr
    res = json.loads((tmp_path / "ev" / "results.json").read_text())["benchmarks"]["arith-test"]
    assert res["oom_retries"] == 1 and res["n_samples"] == 16


def test_cli_run_folder_settings_and_checkpoint(tmp_path, smollm_tokenizer):
    """A run folder: its latest checkpoint is loaded and its prompt settings apply unless overridden."""
    run = tmp_path / "myrun"
    ckpt = run / "checkpoints" / "step_1"
    models.tiny_random_model(len(smollm_tokenizer), seed=3).save_pretrained(ckpt)
    smollm_tokenizer.save_pretrained(ckpt)
    (run / "checkpoints" / "latest").write_text("step_1\n")
    trained = config.make_config("tiny", prompt_style="plain", few_shot=True, answer_fallback=True)
    (run / "config.json").write_text(trained.to_json())
    out = tmp_path / "ev"
    E.main(["--preset", "tiny", "--model", str(run), "--bench", "arith-test", "--limit", "2", "--k", "1",
            "--max_new_tokens", "3", "--few_shot", "false", "--out_dir", str(out)])
    settings = json.loads((out / "results.json").read_text())["settings"]
    assert settings["prompt_style"] == "plain" and settings["answer_fallback"] is True   # from the run
    assert settings["few_shot"] is False                                        # the command line wins
    assert E.model_label(str(run)) == "myrun" and E.model_label(str(ckpt)) == "myrun-step_1"
    assert E.model_label("Qwen/Qwen2.5-3B") == "Qwen2.5-3B"


def test_cli_unavailable_benchmark_is_a_clean_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DATPO_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(data, "hub_blocked", lambda *a, **k: "offline (test)")
    loaded = []
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(E.main, ["--preset", "tiny", "--bench", "arith-test", "aime25", "--k", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "aime25.jsonl" in err and "Traceback" not in err
    assert loaded == []   # benchmarks are checked before the model is loaded


def test_cli_k_must_pair_with_bench(capsys):
    with pytest.raises(SystemExit) as exit_info:
        E.main(["--preset", "tiny", "--bench", "arith-test", "math500", "--k", "2", "4", "8"])
    assert exit_info.value.code == 2 and "--k" in capsys.readouterr().err


def fake_result(avg, maj, k=8):
    return {"k": k, "avg@k": avg, "pass@k": min(1.0, 2 * avg), "maj@k": maj,
            "pass_curve": {str(j): min(1.0, avg * j) for j in E.pass_ladder(k)}}


def test_plot_models_compares_folders(tmp_path, capsys):
    for name, avg in (("base", 0.1), ("trained", 0.3)):
        (tmp_path / name).mkdir()
        bench = {"math500": fake_result(avg, avg + 0.1), "aime24": fake_result(avg / 2, avg, k=64)}
        (tmp_path / name / "results.json").write_text(json.dumps({"model": name, "benchmarks": bench}))
    out = tmp_path / "cmp"
    by_model = E.main(["--plot_models", str(tmp_path / "base"), str(tmp_path / "trained"),
                       "--out_dir", str(out)])
    assert list(by_model) == ["base", "trained"]
    for name in ("pass_curves.png", "maj_vs_avg.png"):
        assert (out / name).stat().st_size > 5000
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.split()}
    # columns: math500 avg pass maj | aime24 avg pass maj | Average avg pass maj
    assert rows["trained"][1:4] == ["30.0", "60.0", "40.0"] and rows["trained"][7] == "22.5"  # (30 + 15) / 2
    assert rows["base"][9] == "15.0"                                              # maj: (20 + 10) / 2


# ------------------------------------------------------------------------------------------------------
# Damaged inputs: the bad line named, a corrupted saved sample not trusted, non-finite weights refused
# ------------------------------------------------------------------------------------------------------
def _folder_hash(path):
    import hashlib
    from pathlib import Path

    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file()}


def _exit_line(capsys, argv):
    from runtime import faults

    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(E.main, argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "\n".join(err), err
    assert sum("error:" in line for line in err) == 1
    return err[-1]


def test_rescore_names_the_bad_line(tmp_path, capsys):
    good = [{"index": i, "run": 0, "sample": 0, "gold": "1", "response": "\\boxed{1}"} for i in range(5)]
    path = tmp_path / "samples_toy.jsonl"
    for line6, expected in [({"index": 5, "run": 0, "response": "x"},
                             "line 6: missing gold; expected the fields "
                             "index, run, response, gold of a sample written by evaluate.py"),
                            ('{"index": 5, "ru', "line 6: not JSON (")]:
        eval_files.write_jsonl(path, good)
        with open(path, "a") as f:
            f.write((json.dumps(line6) if isinstance(line6, dict) else line6) + "\n")
        before = _folder_hash(tmp_path)
        line = _exit_line(capsys, ["--rescore", str(path)])
        assert line.startswith(f"evaluate.py: error: cannot rescore {path}: {expected}"), line
        assert _folder_hash(tmp_path) == before


def test_rerun_over_a_corrupted_saved_sample_line_starts_that_benchmark_over(tmp_path, capsys):
    args = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "2", "--k", "2",
            "--max_new_tokens", "4", "--gen_batch_size", "2", "--out_dir", str(tmp_path / "ev")]
    clean = E.main(args)["tiny-random"]["arith-test"]
    samples = tmp_path / "ev" / "samples_arith-test.jsonl"
    lines = samples.read_text().splitlines()
    samples.write_text("\n".join([lines[0], lines[1][:-7] + "\x00garbage"] + lines[2:]) + "\n")
    capsys.readouterr()
    again = E.main(args)["tiny-random"]["arith-test"]
    err = capsys.readouterr().err
    assert f"{samples} line 2: corrupted (not JSON); its samples are not reused, starting it over" in err
    assert ({k: v for k, v in again.items() if k != "seconds"}
            == {k: v for k, v in clean.items() if k != "seconds"})
    assert samples.read_text().splitlines() == lines


def test_checkpoint_with_nonfinite_weights_is_refused_before_sampling(tmp_path, capsys, smollm_tokenizer):
    model = models.tiny_random_model(len(smollm_tokenizer), seed=0)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[0, 0] = float("nan")
    folder = tmp_path / "bad"
    model.save_pretrained(folder)
    smollm_tokenizer.save_pretrained(folder)
    before = _folder_hash(folder)
    line = _exit_line(capsys, ["--preset", "tiny", "--model", str(folder), "--bench", "arith-test",
                               "--limit", "1", "--k", "1", "--out_dir", str(tmp_path / "ev")])
    assert line.endswith(f"error: --model {folder}: 1 weight tensor(s) hold non-finite values "
                         f"(model.layers.1.mlp.up_proj.weight); expected a model or checkpoint with finite "
                         f"weights (an earlier checkpoint of the run)")
    assert _folder_hash(folder) == before
