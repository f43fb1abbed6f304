"""studies/: the Section 3 metrics against hand computations, the difficulty buckets, tracking.level_stats,
studies/growth.grow_from_forks, and every study end to end at --scale tiny."""
import json
import re
import shlex
import shutil
from pathlib import Path

import fault_injection as FI
import pytest
import torch

import config as C
import data
import evaluate
import rollout as R
import train
import tree as T
from harness import cli as flags
from harness import measured, tracking
from runtime import faults
from studies import __main__ as cli
from studies import common, difficulty, dynamics, forks, growth, main_table, tree_vs_parallel


# ---- localization metrics (App. D.2), by hand ------------------------------------------------------------
def test_nearest_neighbor_distance_by_hand():
    # forks 10, 20, 50 in 100 tokens: nearest distances 10, 10, 30 → 50/3 tokens → /100
    assert forks.nearest_neighbor_distance([10, 20, 50], 100) == pytest.approx(50 / 3 / 100)
    assert forks.nearest_neighbor_distance([50, 10, 20], 100) == pytest.approx(50 / 3 / 100)   # unsorted
    assert forks.nearest_neighbor_distance([5, 5, 30], 100) == pytest.approx(25 / 3 / 100)     # a tie: 0
    assert forks.nearest_neighbor_distance([10, 40], 60) == pytest.approx(0.5)                  # two forks
    assert forks.nearest_neighbor_distance([10], 60) is None
    assert forks.nearest_neighbor_distance([], 60) is None


def test_mean_pairwise_distance_by_hand():
    # pairs of 10, 20, 50: 10, 40, 30 → 80/3
    assert forks.mean_pairwise_distance([20, 50, 10], 100) == pytest.approx(80 / 3 / 100)
    assert forks.mean_pairwise_distance([7, 7], 10) == 0.0
    assert forks.mean_pairwise_distance([10, 40], 60) == pytest.approx(0.5)
    assert forks.mean_pairwise_distance([3], 10) is None


def test_window_clustering_ratio_by_hand():
    # pairs of 10, 20, 50 in 100 tokens: 10, 40, 30; within 10 % (10 tokens, inclusive): one of three
    assert forks.window_clustering_ratio([50, 20, 10], 100, 10) == pytest.approx(100 / 3)
    assert forks.window_clustering_ratio([10, 20, 50], 100, 5) == 0.0
    assert forks.window_clustering_ratio([10, 20, 50], 100, 40) == 100.0
    assert forks.window_clustering_ratio([4, 4, 9, 60], 100, 5) == pytest.approx(300 / 6)   # (4,4) (4,9)×2
    assert forks.window_clustering_ratio([1], 100, 5) is None


def test_pass_rate_and_mean_of():
    assert common.pass_rate([0.0, 0.0, 1.0]) == 1.0
    assert common.pass_rate([0.0, 0.0]) == 0.0 and common.pass_rate([]) == 0.0
    assert common.mean_of([None, 1.0, 3.0]) == 2.0 and common.mean_of([None]) is None


# ---- difficulty buckets (App. B) -------------------------------------------------------------------------
def test_difficulty_bucket_thresholds():
    got = [difficulty.difficulty_bucket(c) for c in range(13)]
    assert got == [None] + ["hard"] * 4 + ["medium"] * 4 + ["easy"] * 3 + [None]
    with pytest.raises(ValueError):
        difficulty.difficulty_bucket(13)


def test_difficulty_split_subsamples_with_a_seed():
    counts = [0, 12, 1, 2, 3, 5, 9, 10, 11, 6]
    full = difficulty.difficulty_split(counts, 12, size=100, seed=0)
    assert full == {"easy": [6, 7, 8], "medium": [5, 9], "hard": [2, 3, 4]}
    small = difficulty.difficulty_split(counts, 12, size=2, seed=3)
    assert all(len(v) == 2 and set(v) <= set(full[b]) for b, v in small.items())
    assert small == difficulty.difficulty_split(counts, 12, size=2, seed=3)


# ---- tracking.level_stats (each step record holds it) ------------------------------------------------------
def _leaf(reward):
    return T.Block(None, [1], [0.0], reward=reward)


def test_level_stats_by_hand():
    trees = [T.Tree("a", [], "1", [_leaf(0.0), _leaf(1.0)], 0.5, 1, 1, level=2),
             T.Tree("b", [], "1", [_leaf(0.0)] * 4, 0.0, 1, 1, level=2),
             T.Tree("c", [], "1", [_leaf(1.0)], 1.0, 0, 0, level=5)]
    assert tracking.level_stats(trees) == {"levels": {"2": {"prompts": 2, "leaves": 3.0, "pass_rate": 0.5},
                                               "5": {"prompts": 1, "leaves": 1.0, "pass_rate": 1.0}}}
    assert tracking.level_stats([T.Tree("a", [], "1", [_leaf(1.0)], 1.0, 0, 0)]) == {}


def test_level_summary_weights_by_prompts():
    steps = [{"levels": {"1": {"prompts": 1, "leaves": 4.0, "pass_rate": 1.0}}},
             {"levels": {"1": {"prompts": 3, "leaves": 8.0, "pass_rate": 0.0},
                         "2": {"prompts": 1, "leaves": 2.0, "pass_rate": 0.0}}}]
    assert dynamics.level_summary(steps) == {"1": {"prompts": 4, "leaves": 7.0, "pass_rate": 0.25},
                                             "2": {"prompts": 1, "leaves": 2.0, "pass_rate": 0.0}}


# ---- studies/growth.grow_from_forks ----------------------------------------------------------------------
def test_grow_from_forks_builds_subtrees_on_an_untouched_base(tiny_policy, monkeypatch):
    model, tok = tiny_policy
    graded = []
    monkeypatch.setattr(R, "compute_reward", lambda text, answer, fallback=False: graded.append(text) or 0.0)
    cfg = C.make_config("tiny", max_new_tokens=12)
    sampler = R.Sampler.from_config(model, tok, cfg)
    torch.manual_seed(0)
    base = R.sample_base(sampler, [tok("What is 3 + 4?", add_special_tokens=False).input_ids], 2, 12,
                         keep_cache=True)
    saved = [list(t) for t in base.tokens]
    forks = {0: [3, 7], 1: [5]}
    subtrees = growth.grow_from_forks(sampler, tok, base, forks, 3, ["7", "7"], 12, chunk_size=4,
                                      base_rewards=[1.0, 0.0])
    for r, fs in forks.items():
        blocks = subtrees[r]
        chain = [b for b in blocks if not b.branch]
        assert [b.start for b in chain] == [0] + fs and [t for b in chain for t in b.token_ids] == saved[r]
        assert chain[-1].reward == [1.0, 0.0][r]
        branches = [b for b in blocks if b.branch]
        assert len(branches) == 3 * len(fs) and sorted({b.start for b in branches}) == fs
        for b in branches:   # hangs off the base block that ends at its fork; the default budget is "full"
            parent = blocks[b.parent]
            assert parent.start + len(parent.token_ids) == b.start and len(b.token_ids) <= 12
            assert tok.decode(saved[r][:b.start] + b.token_ids, skip_special_tokens=True) in graded
    again = growth.grow_from_forks(sampler, tok, base, {0: [2]}, 2, ["7", "7"], 12, chunk_size=4,
                                   length="remaining")
    assert base.tokens == saved and len(again[0]) == 2 + 2      # the base can be branched again
    assert all(2 + len(b.token_ids) <= 12 for b in again[0] if b.branch)   # "remaining": the path fits in 12


# ---- every study at --scale tiny -------------------------------------------------------------------------
class FakeGrader:
    """Marks the first `correct[gold]` graded samples of each gold answer correct (so the 12 samples of a
    problem give it a known difficulty bucket)."""

    def __init__(self, correct):
        self.correct, self.calls = correct, {}

    def __call__(self, text, gold, fallback=False):
        n = self.calls.get(gold, 0)
        self.calls[gold] = n + 1
        return 1.0 if n < self.correct.get(gold, 0) else 0.0


def test_train_command_rebuilds_the_config():
    cfg = C.make_config("grpo-g8", "demo", steps=3, few_shot=False, max_new_tokens=40, out_dir="runs/x y",
                        report_to=["tensorboard"])
    command = common.train_command("grpo-g8", "demo", cfg)
    assert "--steps 3" in command and "--few_shot false" in command and "'runs/x y'" in command
    assert "--report_to tensorboard" in command  # a list field: its items, not "['tensorboard']"
    assert flags.parse_args(shlex.split(command)[2:]) == cfg  # train.py's own parser gives the same Config


def test_config_has_the_g_sweep_rows():
    for g, prompts in ((4, 64), (8, 32), (16, 16)):
        cfg = C.make_config(f"grpo-g{g}")
        assert (cfg.method, cfg.group_size, cfg.prompts_per_step, cfg.mini_batch_size, cfg.ppo_epochs) == \
            ("grpo", g, prompts, 256, 1)
        assert cfg.steps == -(-5 * 1400 // prompts)     # 5 epochs over 1,400 problems


@pytest.mark.slow
def test_difficulty_split_trains_and_reports(tmp_path, monkeypatch):
    problems = common.load_study_problems("arith-train", 6, [])
    golds = [p["answer"] for p in problems]
    assert len(set(golds)) == 6
    monkeypatch.setattr(evaluate, "compute_reward", FakeGrader(dict(zip(golds, [0, 2, 6, 10, 12, 3]))))
    out = tmp_path / "difficulty"
    cli.main(["difficulty", "--scale", "tiny", "--out_dir", str(out), "--g", "4"])
    kept = {b: data.load_problems(str(out / f"{b}.jsonl")) for b in difficulty.DIFFICULTY_BUCKETS}
    assert [p["answer"] for p in kept["easy"]] == [golds[3]]
    assert sorted(p["answer"] for p in kept["hard"]) == sorted([golds[1], golds[5]])
    assert [p["answer"] for p in kept["medium"]] == [golds[2]]
    result = json.loads((out / "result.json").read_text())
    assert result["excluded"] == {"all_wrong": 1, "all_correct": 1}
    assert len(result["commands"]) == 3 and (out / "correct_histogram.png").exists()
    for name, g in (("easy_g4", 4), ("medium_g4", 4), ("hard_g4", 4)):
        run = out / "runs" / name
        cfg = json.loads((run / "config.json").read_text())
        # tiny: 8 samples per step (G = 16 still needs one whole prompt); on-policy, one mini-batch per step
        assert (cfg["method"], cfg["group_size"], cfg["prompts_per_step"]) == ("grpo", g, max(1, 8 // g))
        assert (cfg["mini_batch_size"] == cfg["group_size"] * cfg["prompts_per_step"]
                and cfg["ppo_epochs"] == 1)
        lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        assert all("levels" in x for x in lines)          # arithmetic problems carry levels
    report = tmp_path / "report"
    cli.main(["difficulty-report", "--scale", "tiny", "--out_dir", str(report), "--from_dir", str(out)])
    scores = json.loads((report / "result.json").read_text())["scores"]
    trained = sorted(f"{b}_g{g}" for b in difficulty.DIFFICULTY_BUCKETS for g in (4,))
    assert sorted(scores) == trained                                    # the trained runs only
    for per_bench in scores.values():       # per-problem counts behind the intervals agree with the means
        r = per_bench["arith-test"]
        k, counts = r["k"], r["correct_per_problem"]
        assert len(counts) == r["n_problems"] and sum(counts) / (k * len(counts)) == pytest.approx(r["avg@k"])
        assert sum(c > 0 for c in counts) / len(counts) == pytest.approx(r["pass@k"])
    assert (report / "avg_pass_vs_g.png").exists() and (report / "passk_curves.png").exists()


def test_tree_vs_parallel_tiny(tmp_path):
    out = tmp_path / "tvp"
    cli.main(["tree-vs-parallel", "--scale", "tiny", "--out_dir", str(out), "--limit", "1"])
    result = json.loads((out / "result.json").read_text())
    (rec,) = result["records"]
    assert rec["parallel/2"]["tokens"] <= rec["parallel/4"]["tokens"]          # nested samples
    for method in ("fixed-seg", "random"):
        assert (rec[f"{method}/1"]["leaves"] <= 5
                and rec[f"{method}/2"]["tokens"] >= rec[f"{method}/1"]["tokens"])
    assert set(result["summary"]) == {"parallel", "tree fixed-seg", "tree random", "paired"}
    assert (out / "tree_vs_parallel.png").exists() and "PassRate" in (out / "table.md").read_text()
    table = (out / "table.md").read_text()
    (out / "table.md").unlink()                                              # rebuilt from result.json alone
    cli.main(["tree-vs-parallel", "--scale", "tiny", "--out_dir", str(out), "--from_result", "true"])
    assert (out / "table.md").read_text() == table


def _tvp_records(parallel, tree):
    return [{"repeat": 0, "problem": i, "parallel/2": {"tokens": 10, "pass_rate": p, "leaves": 2},
             "random/1": {"tokens": 8, "pass_rate": t, "leaves": 3}}
            for i, (p, t) in enumerate(zip(parallel, tree))]


def test_difficulty_report_intervals_over_problems_by_hand():
    # 4 problems, k = 2: shares (1, 0.5, 0, 0.5) mean 0.5, sd √(1/6);
    # any-correct (1, 1, 0, 1) mean 0.75, sd 0.5
    scores = {"avg@k": 0.5, "pass@k": 0.75, "correct_per_problem": [2, 1, 0, 1]}
    cell = difficulty.problem_intervals(scores, 2)
    t3 = 3.182446
    assert cell == f"0.500 ± {t3 * (1 / 6) ** 0.5 / 2:.3f} / 0.750 ± {t3 * 0.5 / 2:.3f}"
    # older cached scores, without per-problem counts: the means alone
    assert difficulty.problem_intervals({"avg@k": 0.5, "pass@k": 0.75}, 2) == "0.500 / 0.750"


def test_tree_vs_parallel_intervals_and_paired_verdicts_by_hand():
    o = {"parallel_m": [2], "tree_n": [1], "methods": ["random"], "k": 1, "b": 1, "data": "x", "levels": [],
         "repeats": 1}
    records = _tvp_records([0, 0, 1, 0], [1, 1, 1, 0])
    summary, table = tree_vs_parallel.summarise_tree_vs_parallel(records, o, 4)
    (point,) = summary["tree random"]
    # PassRate 3/4; sd of (1,1,1,0) = 0.5, t(0.975, 3) = 3.1824 → half-width 3.1824 · 0.5 / 2
    assert point["pass_rate"] == 0.75 and point["pass_rate_ci"] == pytest.approx(3.182446 * 0.5 / 2, rel=1e-5)
    # paired differences (1, 1, 0, 0): mean 0.5, sd √(1/3), half-width 3.1824 · 0.57735 / 2 = 0.9187
    # → not shown
    (pair,) = summary["paired"]
    assert pair[:3] == ["tree random N = 1", "M = 2", 0.8] and pair[3] == "50.0 ± 91.9"
    assert pair[4] == "no difference shown" and "no difference shown" in table
    summary, _ = tree_vs_parallel.summarise_tree_vs_parallel(_tvp_records([0, 0, 0, 0], [1, 1, 1, 1]), o, 4)
    assert summary["paired"][0][4] == "tree higher"             # every unit +1: a zero-width interval above 0
    summary, _ = tree_vs_parallel.summarise_tree_vs_parallel(_tvp_records([1, 1, 0, 1], [0, 0, 0, 0]), o, 4)
    assert summary["paired"][0][4] == "no difference shown"     # (−1, −1, 0, −1): −0.75 ± 0.80 straddles 0
    summary, _ = tree_vs_parallel.summarise_tree_vs_parallel(_tvp_records([1, 1, 1, 1], [0, 0, 0, 0]), o, 4)
    assert summary["paired"][0][4] == "parallel higher"


def test_forks_share_one_base_rollout_per_repeat(tmp_path):
    out = tmp_path / "forks"
    cli.main(["forks", "--scale", "tiny", "--out_dir", str(out), "--limit", "1",
              "--strategies", "random", "fixed-seg", "tok-entropy"])
    records = json.loads((out / "result.json").read_text())["records"]
    assert len(records) == 2 * 3
    for repeat in (0, 1):
        mine = [r for r in records if r["repeat"] == repeat]
        assert len({json.dumps(r["base"]) for r in mine}) == 1                # every strategy, the same base
        for r in mine:
            assert r["leaves"] == 1 + 2 * len(r["forks"])
            assert r["NND"] == forks.nearest_neighbor_distance(r["forks"], r["length"])
    assert (out / "fork_table.png").exists() and (out / "localization.png").exists()
    table = (out / "table.md").read_text()
    cli.main(["forks", "--scale", "tiny", "--out_dir", str(out), "--from_result", "true"])
    assert (out / "table.md").read_text() == table                       # rebuilt from result.json alone


def test_fork_table_pairs_every_strategy_with_sent_entropy_on_the_same_rollouts():
    def rec(problem, strategy, passed, sib):
        return {"repeat": 0, "problem": problem, "strategy": strategy, "forks": [1, 2], "length": 10,
                "leaves": 3, "pass_rate": passed, "sib_div": sib, "branch_tokens": 5, "NND": 0.1, "MPD": 0.1,
                "WCR@5": 0.0, "WCR@10": 0.0}
    records = [rec(i, "sent-entropy", 1.0, 0.5 + 0.1 * i) for i in range(3)] + \
        [rec(i, "tok-entropy", float(i == 0), 0.7 + 0.1 * i) for i in range(3)]
    strategies = [s for s in forks.FORK_STRATEGIES if s[0] in ("tok-entropy", "sent-entropy")]
    o = {"k": 2, "b": 1, "data": "x", "levels": [], "repeats": 1}
    summary, table = forks.summarise_forks(records, strategies, o, 3, "m")
    (pair,) = summary["paired"]
    # PassRate differences (0, 1, 1): mean 2/3, sd 0.57735, t(0.975, 2) = 4.3027 → ± 1.434: not shown;
    # SibDiv differences −0.2 each: a zero-width interval below 0 → tok-entropy's SibDiv higher
    assert pair[0] == "tok-entropy" and pair[1] == "66.7 ± 143.4" and pair[2] == "no difference shown"
    assert pair[3] == "-0.200 ± 0.000" and pair[4] == "tok-entropy higher"
    assert summary["sent-entropy"]["pass_rate_ci"] == 0.0 and "Paired on the same base rollouts" in table


def test_show_forks_tiny(tmp_path):
    out = tmp_path / "show"
    cli.main(["show-forks", "--scale", "tiny", "--out_dir", str(out)])
    result = json.loads((out / "result.json").read_text())
    assert set(result["forks"]) == {"tok-entropy", "fixed-seg"}
    page = (out / "forks.html").read_text()
    assert page.count("<span") >= len(result["tokens"]) and "http" not in page    # self-contained
    assert (out / "forks.png").stat().st_size > 0


def test_token_lines_wraps_and_breaks():
    lines = forks.token_lines(["ab", "cd\ne", "fgh", ""], width=4)
    # "cd" fills line 0 to the width; the newline starts line 1; EOS (empty) shows as a dot
    assert lines == [[(0, 0, "ab"), (1, 2, "cd")], [(1, 0, "e"), (2, 1, "fgh"), (3, 4, "·")]]
    assert forks.token_lines(["abc", "de"], width=4) == [[(0, 0, "abc")], [(1, 0, "de")]]      # wraps


@pytest.mark.slow
def test_dynamics_reads_levels_and_scores_checkpoints(tmp_path):
    run = tmp_path / "run"
    train.train(C.make_config("tiny", out_dir=str(run), steps=2, save_every=1))
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(set(x["levels"]) <= {"1", "2", "3", "4", "5"} and x["levels"] for x in lines)
    out = tmp_path / "dyn"
    cli.main(["dynamics", "--scale", "tiny", "--out_dir", str(out), "--runs", str(run)])
    result = json.loads((out / "result.json").read_text())
    (info,) = result["runs"].values()
    assert sorted(info["checkpoints"]) == ["1", "2"]
    assert sum(s["prompts"] for s in info["levels"].values()) == 2 * 2          # 2 prompts × 2 steps
    for name in ("learning_curve.png", "leaf_count.png", "passk_checkpoints.png"):
        assert (out / name).exists()
    (folder,) = (out / "scores").glob("run_*")      # named by the run and its config's fingerprint
    cached = sorted(folder.iterdir())
    cli.main(["dynamics", "--scale", "tiny", "--out_dir", str(out), "--runs", str(run)])   # nothing re-scored
    assert sorted(folder.iterdir()) == cached


def test_dynamics_and_main_table_name_a_torn_metrics_line_and_refuse_a_torn_config(tmp_path, capsys):
    """A run killed mid-write leaves a torn last line: it is left out and named; a torn config.json is one
    line (exit 2) naming it, not a traceback; the run folder is not written to."""
    run = tmp_path / "run"
    run.mkdir()
    good = {"step": 1, "reward": 0.5, "levels": {"1": {"prompts": 2, "leaves": 3.0, "pass_rate": 0.5}}}
    (run / "metrics.jsonl").write_text(json.dumps(good) + "\n" + '{"step": 2, "rew')
    (run / "config.json").write_text('{"method": "datpo"}')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    assert main_table.step_records(run) == [good]
    assert capsys.readouterr().err.strip().endswith("metrics.jsonl: line(s) 2 torn (not a JSON record); "
                                                    "left out")
    out = tmp_path / "dyn"
    cli.main(["dynamics", "--scale", "tiny", "--out_dir", str(out), "--runs", str(run)])
    assert json.loads((out / "result.json").read_text())["runs"]["run (datpo)"]["levels"]["1"]["prompts"] == 2
    assert "line(s) 2 torn" in capsys.readouterr().err
    (run / "config.json").write_text('{"method": "da')
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(cli.main, ["dynamics", "--scale", "tiny", "--out_dir", str(out),
                                     "--runs", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and "Traceback" not in "".join(err)
    assert [line for line in err if "error:" in line] == [err[-1]]  # the torn metrics line is named first
    assert re.search(r"error: dynamics: .*config.json: not JSON \(.*\); "
                     r"expected the config.json train.py writes", err[-1])
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != "config.json"} == \
        {k: v for k, v in before.items() if k != "config.json"}


def test_cli_rejects_unknown_study_and_bad_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["nope"])
    with pytest.raises(SystemExit):
        cli.main(["forks", "--scale", "tiny", "--k", "x"])
    with pytest.raises(SystemExit):
        cli.main(["difficulty", "--scale", "tiny", "--g", "5"])


# ---- main-table (Sec. 5.2 in miniature) --------------------------------------------------------------------
def test_t_interval_and_pass_curve_by_hand():
    mean, half = common.t_interval([1.0, 2.0, 3.0])
    # sd = 1, n = 3, t(0.975, df 2) = 4.302653 → half-width 4.302653 / √3
    assert mean == pytest.approx(2.0) and half == pytest.approx(4.302653 / 3 ** 0.5, rel=1e-6)
    assert common.t_interval([0.5]) == (0.5, None)
    # two problems, n = 4 samples: 1 and 0 correct. pass@1 = (1/4 + 0)/2;
    # pass@2 = (1 − C(3,2)/C(4,2))/2 = (1/2)/2
    curve = main_table.pass_curve([1, 0], 4)
    assert curve == pytest.approx({1: 0.125, 2: 0.25, 3: 0.375, 4: 0.5})


def test_equal_token_group_size():
    assert main_table.equal_token_group_size(639.0, 40.0) == 16      # 15.98 → 16
    assert main_table.equal_token_group_size(50.0, 40.0) == 2        # never below 2
    with pytest.raises(ValueError):
        main_table.equal_token_group_size(100.0, 0.0)


@pytest.mark.slow
def test_main_table_tiny_trains_evaluates_and_resumes(tmp_path):
    out = tmp_path / "mt"
    cli.main(["main-table", "--scale", "tiny", "--out_dir", str(out), "--seeds", "0", "1",
              "--equal_tokens", "true"])
    result = json.loads((out / "result.json").read_text())
    assert set(result["cells"]) == {"paper_s0", "paper_s1", "grpo_s0", "grpo_s1"}
    g = result["equal_tokens_group_size"]
    assert result["cells"]["grpo_s0"]["group_size"] == g
    pilot = [json.loads(x) for x in (out / "runs" / "pilot_grpo" / "metrics.jsonl").read_text().splitlines()]
    datpo = [result["cells"][f"paper_s{s}"]["tokens_per_problem"] for s in (0, 1)]
    assert g == main_table.equal_token_group_size(sum(datpo) / 2, pilot[0]["generated_tokens_per_prompt"] / 4)
    for name, cell in result["cells"].items():   # every cell trained to its last step and was evaluated
        assert (out / "runs" / name / "checkpoints" / "step_000002").is_dir()
        assert len(cell["pass_curve"]) == 2 and 0 <= cell["avg@k"] <= 1
    paper = result["summary"]["paper"]
    assert paper["seeds"] == 2
    assert paper["avg@k"][0] == pytest.approx(
        sum(result["cells"][f"paper_s{s}"]["avg@k"] for s in (0, 1)) / 2)
    assert (out / "pass_curves.png").stat().st_size > 0 and "± " in (out / "table.md").read_text()
    # a killed study resumes: a cell with only its first checkpoint trains one more step; finished cells and
    # their scores are left alone
    finished = (out / "runs" / "paper_s0" / "metrics.jsonl").read_text()
    cell = out / "runs" / "grpo_s1"
    shutil.rmtree(cell / "checkpoints" / "step_000002")
    (out / "scores" / "grpo_s1.json").unlink()
    cli.main(["main-table", "--scale", "tiny", "--out_dir", str(out), "--seeds", "0", "1",
              "--equal_tokens", "true"])
    assert (out / "runs" / "paper_s0" / "metrics.jsonl").read_text() == finished
    assert (cell / "checkpoints" / "step_000002").is_dir() and (out / "scores" / "grpo_s1.json").exists()
    steps = [json.loads(x)["step"] for x in (cell / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_cli_unknown_or_missing_study_ends_with_an_error_line(capsys):
    for argv, what in ((["bogus"], "unknown study 'bogus'"), ([], "a STUDY is required")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2
        assert err[0].startswith("usage: python -m studies STUDY")
        assert err[-1] == f"python -m studies: error: {what}; expected one of {', '.join(cli.STUDIES)}"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0 and "error:" not in capsys.readouterr().err


def test_main_table_pairs_methods_by_problem_by_hand():
    cells = {"paper_s0": {"preset": "paper", "correct": [2, 0]},
             "paper_s1": {"preset": "paper", "correct": [1, 0]},
             "grpo_s0": {"preset": "grpo", "correct": [0, 0]},
             "grpo_s1": {"preset": "grpo", "correct": [1, 1]}}
    text = main_table.paired_by_problem(cells, ["paper", "grpo"], 2)
    # avg shares per problem: paper (0.75, 0), grpo (0.25, 0.25) → differences (0.5, −0.25): mean 0.125,
    # sd 0.375·√2, t(0.975, 1) = 12.7062 → half-width 12.7062 · 0.53033 / √2 = 4.7648
    # any-correct per seed: paper (1, 0), grpo (0.5, 0.5) → differences (0.5, −0.5): mean 0, half 6.3531
    assert ("| paper − grpo | 2 | 12.5 ± 476.5 | no difference shown | 0.0 ± 635.3 | no difference shown |"
            in text)
    cells["grpo_s0"]["correct"] = cells["grpo_s1"]["correct"] = [0, 0]
    cells["paper_s0"]["correct"] = cells["paper_s1"]["correct"] = [2, 2]
    assert "| paper − grpo | 2 | 100.0 ± 0.0 | paper higher | 100.0 ± 0.0 | paper higher |" in \
        main_table.paired_by_problem(cells, ["paper", "grpo"], 2)


# ------------------------------------------------------------------------------------------------------
# Study caches that know what they measured; a torn result.json; study flags and files
# ------------------------------------------------------------------------------------------------------
TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]
FINISHED_STEPS = 2   # the `finished` / `run` fixtures (tests/conftest.py): 2 steps, a checkpoint at each


folder_hash = FI.folder_hash


def run_cli(capsys, argv, code=None) -> list[str]:
    """train.main as a command: its exit code is `code`, its error line the only one and the last."""
    return FI.run_cli(capsys, argv, code, one_error_line=code is not None)


def test_a_score_cache_is_recomputed_for_another_checkpoint(run, tmp_path, capsys):
    """main-table: a cell's cache written at step 1 is not its score once it trained to step 2."""
    study = cli.make_study("main-table", ["--scale", "tiny", "--out_dir", str(tmp_path / "mt")])
    cfg = main_table.cell_config(study, "paper", 3, run)
    cache = study.out / "scores" / "paper_s3.json"
    first = main_table.evaluate_cell(study, cfg, run / "checkpoints" / "step_000001", cache)
    assert first["measured"]["step"] == 1
    capsys.readouterr()
    second = main_table.evaluate_cell(study, cfg, run / "checkpoints" / "step_000002", cache)
    weights = [measured.short(measured.weights_identity(str(run / "checkpoints" / s))["weights"])
               for s in ("step_000001", "step_000002")]
    assert second["measured"]["step"] == 2 and second["checkpoint"].endswith("step_000002")
    assert (f"{cache}: measured something else (step 1 -> 2, weights {weights[0]} -> {weights[1]}, "
            f"checkpoint ") in capsys.readouterr().err
    assert main_table.evaluate_cell(study, cfg, run / "checkpoints" / "step_000002", cache) == second
    assert "computed again" not in capsys.readouterr().err                    # the same: reused


def test_a_finished_cell_trained_with_other_settings_is_never_scored_as_this_one(tmp_path):
    """main-table: a cell folder whose run had another experiment (the study's flags changed since) or went
    past --steps is one line, not a checkpoint scored under this cell's name."""
    study = cli.make_study("main-table", ["--scale", "tiny", "--out_dir", str(tmp_path / "mt")])
    run_dir = study.out / "runs" / "paper_s0"
    cfg = main_table.cell_config(study, "paper", 0, run_dir)
    (run_dir / "checkpoints" / "step_000003").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_000003" / "trainer_state.pt").write_text("x")
    (run_dir / "config.json").write_text(cfg.to_json())
    before = folder_hash(run_dir)
    with pytest.raises(faults.UserError) as err:    # trained past --steps (2), no checkpoint at step 2
        main_table.train_cell(cfg)
    assert str(err.value) == (f"main-table: the cell {run_dir} trained to step_000003, past --steps 2, and "
                              f"keeps no checkpoint at step 2; expected the --steps it ran with, or another "
                              f"--out_dir")
    (run_dir / "config.json").write_text(json.dumps({**json.loads(cfg.to_json()), "lr": 0.5}))
    with pytest.raises(faults.UserError) as err:
        main_table.train_cell(cfg)
    assert str(err.value).startswith(f"main-table: the cell {run_dir} was trained with other settings (lr "
                                      f"0.5 -> {cfg.lr!r}); expected the flags the study ran with")
    assert {k: v for k, v in folder_hash(run_dir).items() if k != "config.json"} == \
        {k: v for k, v in before.items() if k != "config.json"}


def test_dynamics_never_takes_one_runs_scores_for_another_of_the_same_name(run, tmp_path, capsys,
                                                                          monkeypatch):
    a, b = tmp_path / "a" / "demo", tmp_path / "b" / "demo"
    shutil.copytree(run, a)
    run_cli(capsys, TINY + ["--steps", "1", "--seed", "4", "--out_dir", str(b)])   # another step 1
    out = tmp_path / "dyn"
    cli.main(["dynamics", "--scale", "tiny", "--out_dir", str(out), "--runs", str(a), str(b)])
    runs_ = json.loads((out / "result.json").read_text())["runs"]
    assert set(runs_) == {"a/demo (datpo)", "b/demo (datpo)"}
    for label, folder in (("a/demo (datpo)", a), ("b/demo (datpo)", b)):
        for step, scores in runs_[label]["checkpoints"].items():
            checkpoint = folder / "checkpoints" / f"step_{int(step):06d}"
            assert scores["measured"]["weights"] == measured.files_hash(checkpoint)
    assert runs_["a/demo (datpo)"]["checkpoints"]["1"]["measured"]["weights"] != \
        runs_["b/demo (datpo)"]["checkpoints"]["1"]["measured"]["weights"]
    assert len(list((out / "scores").glob("demo_*/step_000001_*.json"))) == 2   # one cache each
    # issue 44: b/demo made a copy of a/demo (the same weights) whose run had other settings: its own score,
    # never a/demo's cached one (the cache is keyed by the run's identity, not its folder's name)
    shutil.rmtree(b)
    shutil.copytree(a, b)
    config = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps({**config, "alpha_start": 0.4}))
    scored, original = [], evaluate.evaluate_problems
    monkeypatch.setattr(evaluate, "evaluate_problems",
                        lambda *args, **kwargs: scored.append(kwargs["desc"]) or original(*args, **kwargs))
    cli.main(["dynamics", "--scale", "tiny", "--out_dir", str(out), "--runs", str(a), str(b)])
    assert scored == ["demo/step_000001", "demo/step_000002"]   # b's checkpoints; a's came from the cache
    runs_ = json.loads((out / "result.json").read_text())["runs"]
    measured_b = runs_["b/demo (datpo)"]["checkpoints"]["1"]["measured"]
    assert measured_b["weights"] == runs_["a/demo (datpo)"]["checkpoints"]["1"]["measured"]["weights"]
    assert measured_b["run_config"] != runs_["a/demo (datpo)"]["checkpoints"]["1"]["measured"]["run_config"]


def test_a_torn_result_json_write_keeps_the_sampled_records(tmp_path, monkeypatch):
    study = cli.make_study("tree-vs-parallel", ["--scale", "tiny", "--out_dir", str(tmp_path / "t")])
    records = [{"repeat": 0, "problem": 0, "parallel/2": {"tokens": 10, "pass_rate": 1.0, "leaves": 2}}]
    common.write_outputs(study, {"records": records}, "table\n", 1.0)
    before = folder_hash(study.out)
    real = Path.write_text

    def killed_halfway(self, text, *args, **kwargs):   # the write dies after half of the new result.json
        real(self, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        common.write_outputs(study, {"records": []}, "other table\n", 2.0)
    monkeypatch.undo()
    assert folder_hash(study.out) == before                                  # no torn file, no temporary
    assert json.loads((study.out / "result.json").read_text())["records"] == records


@pytest.mark.parametrize("argv, line", [
    (["tree-vs-parallel", "--data", "{tmp}/missing.jsonl"],
     "--data {tmp}/missing.jsonl: no such file; expected a .jsonl/.json/.parquet/.csv file or one of"),
    (["forks", "--from_result", "true"],
     "--from_result true: {out}/result.json: not found; expected the result.json a finished `forks` run "
     "wrote into --out_dir {out} (run it once without --from_result)"),
    (["tree-vs-parallel", "--levels", "9"],
     "--levels 9: no problem of --data arith-test has one of them; its levels are 1, 2, 3, 4, 5"),
    (["tree-vs-parallel", "--from_result", "true", "--torn"],
     "--from_result true: {out}/result.json: unreadable or torn ("),
    (["tree-vs-parallel", "--from_result", "true", "--parallel_m", "2", "8", "--earlier"],
     "--from_result true: {out}/result.json: made with other settings than this command's (--parallel_m "
     "[2, 4] -> [2, 8])"),
    (["dynamics", "--runs", "{tmp}/nothing"],
     "--runs {tmp}/nothing: {tmp}/nothing/metrics.jsonl not found; expected a train.py run folder"),
    (["difficulty-report", "--from_dir", "{tmp}"],
     "--from_dir {tmp}: no trained runs under {tmp}/runs; expected the folder of `python -m studies "
     "difficulty`"),
    (["forks", "--k", "0"], "--k: got 0, expected an integer >= 1 and <= 65536"),
])
def test_study_flags_and_files_are_one_line(tmp_path, capsys, argv, line):
    out = tmp_path / "out"
    out.mkdir()
    if "--torn" in argv or "--earlier" in argv:
        result = {"study": "tree-vs-parallel", "records": [{"problem": 0}], "config": {},
                  "options": {"parallel_m": [2, 4]}}
        (out / "result.json").write_text(json.dumps(result)[:40] if "--torn" in argv else json.dumps(result))
        argv = [a for a in argv if a not in ("--torn", "--earlier")]
    names = {"tmp": tmp_path, "out": out}
    before = folder_hash(out)
    got = FI.refused_as(capsys, cli.main, [a.format(**names) for a in argv]
                  + ["--scale", "tiny", "--out_dir", str(out)], "python -m studies")
    assert got.startswith("python -m studies: error: " + line.format(**names)), got
    assert folder_hash(out) == before


def test_dynamics_compares_runs_step_by_step_without_held_out_evaluations(tmp_path, capsys):
    """Two run folders with no held-out evaluation (a class's --preset teach runs before and after an
    edit): the per-step table holds each run's metrics and its tree logs' diversity bonus and fork
    positions, steps.png draws them, and learning_curve.png falls back to the training reward."""
    def write_run(folder, rows, trees):
        (folder / "trees").mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"method": "datpo"}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for step, logged in trees.items():
            (folder / "trees" / f"step_{step:06d}.jsonl").write_text(
                "".join(json.dumps(t) + "\n" for t in logged))

    def step(n, reward, k_hat):
        return {"step": n, "reward": reward, "v_root": reward / 2, "k_hat": k_hat, "b_hat": k_hat,
                "leaves_per_prompt": 1 + 4 * k_hat, "clip_frac": 0.01 * n, "levels": {"hard": {
                    "prompts": 2, "leaves": 3.0, "pass_rate": reward}}}
    blocks = [{"advantage": 0.7, "base_advantage": 0.5}, {"advantage": -0.2, "base_advantage": -0.2},
              {"advantage": 0.3, "base_advantage": 0.1}, {"advantage": None, "base_advantage": 0.4}]
    adaptive, fixed = tmp_path / "teach", tmp_path / "teach-fixed"
    write_run(adaptive, [step(1, 0.25, 1.5), step(2, 0.5, 1.0)],
              {1: [{"blocks": blocks, "forks": [[1, 9], [4]]}, {"blocks": blocks[:2], "forks": [[]]}]})
    write_run(fixed, [step(1, 0.25, 2.0), step(2, 0.5, 2.0)], {})
    out = tmp_path / "dyn"
    cli.main(["dynamics", "--runs", str(adaptive), str(fixed), "--checkpoints", "false", "--out_dir",
              str(out)])
    runs_ = json.loads((out / "result.json").read_text())["runs"]
    first = runs_["teach (datpo)"]["steps"]
    assert [r["k_hat"] for r in first] == [1.5, 1.0] and [r["clip_frac"] for r in first] == [0.01, 0.02]
    assert first[0]["bonus"] == pytest.approx(((0.7 - 0.5) + (0.3 - 0.1) + (0.7 - 0.5)) / 3)   # Â_base > 0
    assert first[0]["fork_position"] == pytest.approx((1 + 9 + 4) / 3)
    assert first[1]["bonus"] is None and runs_["teach-fixed (datpo)"]["steps"][0]["k_hat"] == 2.0
    table = (out / "table.md").read_text()
    assert "| teach (datpo) | 1 | 0.250 | 0.125 | 1.5 | 1.5 | 7.0 | 0.010 | 0.200 | 4.7 |" in table
    assert "Checkpoints on" not in table and "level hard" in table
    for name in ("steps.png", "learning_curve.png"):
        assert (out / name).stat().st_size > 10_000
