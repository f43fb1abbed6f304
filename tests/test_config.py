"""config.py: preset values against the paper, CLI parsing, and errors that name the flag and the choices."""
import dataclasses

import pytest

import checks
import config as C
from harness import cli


def test_paper_preset_matches_the_paper():
    cfg = C.make_config("paper")
    # Sec. 4.1 / App. F.2 "Implementation Details": (N, K_max, B_max) = (4, 3, 4), sent-entropy, adaptive
    assert (cfg.method, cfg.n_base, cfg.k_max, cfg.b_max, cfg.adaptive) == ("datpo", 4, 3, 4, True)
    assert cfg.fork == "sent-entropy"
    # α linearly annealed 0.2 → 0 on positive blocks; App. F.5's all-mpnet-base-v2 embeddings instead of the
    # paper's gte-large-en-v1.5, which runs code from the hub (docs/decisions.md, issue 37)
    assert (cfg.alpha_start, cfg.alpha_end, cfg.alpha_scope) == (0.2, 0.0, "positive")
    assert cfg.embed_model == "sentence-transformers/all-mpnet-base-v2"
    # sampling: temperature 1.0, max 1024 new tokens; branch chunks of 384 for Qwen2.5-3B
    assert (cfg.temperature, cfg.max_new_tokens, cfg.branch_chunk_size) == (1.0, 1024, 384)
    # "Training Hyperparameters": AdamW (0.9, 0.999), constant lr 5e-6, clip 0.2, no KL,
    # 16 prompts per step, mini-batch 64, micro-batch 2
    assert (cfg.lr, cfg.beta1, cfg.beta2) == (5e-6, 0.9, 0.999)
    assert (cfg.clip_low, cfg.clip_high) == (0.2, 0.2)
    assert (cfg.prompts_per_step, cfg.mini_batch_size, cfg.micro_batch_size) == (16, 64, 2)
    assert cfg.kl_beta == 0 and all(C.make_config(p).kl_beta == 0 for p in C.PRESETS)   # no KL (kl.py: off)
    # GRPO baseline group size (App. F.2) and evaluation (App. F.1: MATH500, 2048 tokens)
    assert cfg.group_size == 16 and cfg.eval_data == "math500" and cfg.eval_max_new_tokens == 2048
    assert cfg.model == "Qwen/Qwen2.5-3B" and cfg.train_data == "math-train"


def test_paper_preset_runs_what_the_release_ran_where_the_paper_is_silent():
    cfg = C.make_config("paper")
    assert cfg.fork_keeps_token is True                    # App. C: x_f = [q; τ_{1:f}]
    assert cfg.branch_length == "full"                     # App. F.2: 1024 tokens per generation
    assert cfg.prompt_style == "release" and cfg.precision == "bf16"
    assert cfg.max_prompt_tokens == 0 and cfg.value_estimate == "paper"
    # the demo and tiny scales keep the prompt and precision their measured numbers were taken with
    # --preset release: the paper plus the release's non-bug behaviours
    release = C.make_config("release")
    assert release.value_estimate == "release" and release.mini_batch_grouping == "blocks"
    assert release.sibling_groups == "release" and cfg.sibling_groups == "paper"   # Eq. 10 is explicit
    assert dataclasses.replace(release, value_estimate="paper", sibling_groups="paper",
                               mini_batch_grouping="trees", out_dir=cfg.out_dir) == cfg
    for scale in ("demo", "tiny"):
        small = C.make_config("paper", scale)
        assert (small.prompt_style, small.precision) == ("chat", "fp32")


def test_demo_and_tiny_presets_are_offline_and_small():
    demo = C.make_config("demo")
    assert demo.model == "smollm2-135m" and demo.embed_model == "all-minilm-l6-v2"
    assert demo.train_data.startswith("arith") and demo.max_new_tokens <= 128
    tiny = C.make_config("tiny")
    assert tiny.model == "tiny-random" and tiny.device == "cpu" and tiny.steps == 2


def test_cli_sets_fields_and_types():
    cfg = cli.parse_args(["--preset", "demo", "--steps", "10", "--fork", "tok-entropy", "--out_dir", "runs/x",
                        "--adaptive", "false", "--lr", "2e-5", "--fork_min_dist", "0.05"])
    assert (cfg.steps, cfg.fork, cfg.out_dir) == (10, "tok-entropy", "runs/x")
    assert cfg.adaptive is False and cfg.lr == 2e-5 and cfg.fork_min_dist == 0.05
    assert cfg.compile_decode is False and cli.parse_args(["--compile_decode", "true"]).compile_decode is True
    assert cfg.model == "smollm2-135m"                       # untouched fields keep the preset's value
    assert cli.parse_args([]).model == "Qwen/Qwen2.5-3B"      # default preset is the paper's


@pytest.mark.parametrize("argv, expected", [
    (["--bogus", "1"], "unrecognized arguments: --bogus"),
    (["--fork", "entropy"], "tok-entropy"),                  # lists the valid choices
    (["--method", "ppo"], "drgrpo"),
    (["--steps", "ten"], "--steps"),
    (["--adaptive", "maybe"], "true/false"),
    (["--preset", "huge"], "paper"),
    (["--micro_batch_size", "128"], "--micro_batch_size"),
    (["--top_p", "1.5"], "--top_p"),
    (["--n_base", "0"], "--n_base"),
    (["--compile_decode", "true", "--rollout_engine", "generate"], "--compile_decode compiles the engine's"),
    (["--naive_prefill", "true"], "unrecognized arguments: --naive_prefill"),   # gone: the tests' oracle
])
def test_cli_errors_name_the_flag_and_valid_values(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_scales_and_rows_compose():
    cfg = cli.parse_args(["--preset", "treerl", "--scale", "tiny"])
    assert (cfg.method, cfg.n_base, cfg.k_max, cfg.b_max, cfg.adaptive, cfg.fork) == \
        ("treerl", 6, 2, 2, False, "tok-entropy")                    # the row: TreeRL's (6, 2, 2)
    assert cfg.model == "tiny-random" and cfg.max_new_tokens == 12   # the scale
    assert cfg.out_dir == "runs/treerl-tiny"
    assert C.make_config("demo").out_dir == "runs/demo" and C.make_config("grpo").out_dir == "runs/grpo"
    grpo = C.make_config("grpo")
    assert (grpo.group_size, grpo.clip_low, grpo.clip_high) == (16, 0.2, 0.28)   # clip-higher, App. F.2
    assert C.make_config("drgrpo").loss_norm == "constant"
    assert C.make_config("datpo-alpha-0.2-neg0.2").alpha_end == -0.2
    assert C.make_config("datpo-nonadaptive").adaptive is False
    with pytest.raises(SystemExit):
        cli.parse_args(["--scale", "huge"])


def test_make_config_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown config field"):
        C.make_config("paper", n_bases=4)
    with pytest.raises(ValueError, match="--alpha_scope"):
        C.make_config("paper", alpha_scope="negative")


def test_every_field_has_a_flag():
    parser = cli.build_parser()
    flags = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(C.Config)} <= flags


def test_negative_numbers_in_any_notation_are_values():
    """argparse's own pattern reads -1e-3 as an unknown flag ("expected one argument")."""
    assert cli.parse_args(["--alpha_end", "-1e-3"]).alpha_end == -1e-3
    assert cli.parse_args(["--alpha_end", "-.5E+1", "--alpha_start", "-2"]).alpha_end == -5.0
    with pytest.raises(SystemExit):
        cli.parse_args(["--alpha_start", "-inf"])                      # a value, refused as not finite


def test_every_numeric_field_has_a_bounded_range():
    """A value far outside any run, either sign, is refused naming its flag: ints by INT_RANGES (a knob
    without an entry by DEFAULT_INT_RANGE), floats by checks.FLOAT_BOUND and their own checks. The one float
    left open above is --max_grad_norm: a huge norm means no clipping, a legitimate choice. A new knob needs
    no entry here."""
    numeric = [f for f in dataclasses.fields(C.Config) if f.type in ("int", "float", int, float)]
    assert len(numeric) > 40
    for f in numeric:
        for value in ([2**70, -2**70] if f.type in ("int", int) else [1e30, -1e30]):
            if f.name == "max_grad_norm" and value > 0:
                continue
            with pytest.raises(ValueError, match=f"^--{f.name}: got"):
                C.make_config("tiny", **{f.name: value})


def test_kv_pool_needs_one_prompts_responses():
    tree = C.make_config("tiny", max_kv_tokens=36)                   # (N + 1) × max_new_tokens = 3 × 12
    assert checks.kv_pool_shortfall(tree) is None
    assert checks.kv_pool_shortfall(tree, 5, "p") == (
        "--max_kv_tokens: got 36, expected 0 (sized automatically) or at least 41 tokens: p's 5 prompt "
        "tokens + --n_base 2 base responses kept for their forks plus one branch, each up to "
        "--max_new_tokens 12")
    grpo = C.make_config("tiny", method="grpo", max_kv_tokens=48)    # G rows at once: 4 × 12
    assert checks.kv_pool_shortfall(grpo) is None and "4 responses" in checks.kv_pool_shortfall(grpo, 1, "p")
    # evaluation: k samples at once, at most --max_batch_rows (tiny: 8) of them
    with pytest.raises(ValueError, match="least 96 tokens: 8 evaluation samples of --eval_max_new_tokens 12"):
        C.make_config("tiny", max_kv_tokens=50, eval_every=1, eval_k=20)
    assert checks.kv_pool_shortfall(dataclasses.replace(tree, rollout_engine="generate"), 10**6, "p") is None
