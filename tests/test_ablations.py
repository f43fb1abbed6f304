"""Ablations by editing config.py (issue 41): one precedence of the rows over Config's defaults, an edited
default that a row overrides named at start, and the README's three recipes, each changing what a student
sees on the teaching preset (K̂/B̂, forks, Â)."""
import dataclasses
import importlib.util
import json
import random
import re
import sys
from pathlib import Path

import pytest

import advantage as A
import config as C
import data
import methods as M
import rollout as R
import train
from harness import cli, edits

ROOT = Path(__file__).resolve().parent.parent
# The README's recipes ("Ablations"): the edit of Config's default, as a field and its new value
RECIPES = {"adaptive": False, "fork": "random", "alpha_start": 0.4}


def edited_config(tmp_path, edits_: dict[str, str]):
    """config.py copied with some default lines edited (`name: type = old` -> new), loaded as a module of
    its own: what a teacher's edited file gives."""
    source = (ROOT / "config.py").read_text(encoding="utf-8")
    for name, new in edits_.items():
        source, count = re.subn(rf"^(    {name}: \w+ = )\S+", rf"\g<1>{new}", source, count=1, flags=re.M)
        assert count == 1, name
    path = tmp_path / "config.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("edited_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["edited_config"] = module   # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("edited_config", None)
    return module


def test_an_edited_default_reaches_a_tiny_run_or_is_named_at_start(tmp_path, capsys, monkeypatch):
    """b_max = 3 in a copy of config.py: --preset tiny's scale sets b_max 2, and the run says so; clip_high
    = 0.25, which no row of tiny sets, reaches the run (its config.json)."""
    edited = edited_config(tmp_path, {"b_max": "3", "clip_high": "0.25"})
    cfg = edited.make_config("tiny", out_dir=str(tmp_path / "run"), steps=1)
    assert (cfg.b_max, cfg.clip_high) == (2, 0.25)
    monkeypatch.setattr(R, "compute_reward", lambda text, answer, fallback=False: float(len(text) % 2))
    train.train(cfg)
    err = capsys.readouterr().err
    assert "b_max = 3 in config.py → 2 from scale tiny" in err
    assert "clip_high = 0.25 in config.py: in effect (shipped 0.2)" in err
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["b_max"], saved["clip_high"]) == (2, 0.25)
    # the same edit under each source of settings names that source
    assert edits.notes(edited.make_config("demo"), edits.shipped()) == [
        "b_max = 3 in config.py → 2 from scale demo",
        "clip_high = 0.25 in config.py: in effect (shipped 0.2)"]
    assert "b_max = 3 in config.py → 2 from method treerl (methods.py)" in edits.notes(
        edited.make_config("treerl"))
    assert edits.notes(C.make_config("demo")) == []              # config.py as shipped: nothing to say


def test_the_shipped_record_is_config_py_s_defaults():
    """harness/shipped_defaults.json is what config.py ships: after changing a default on purpose, run
    `python -m harness.edits --write`."""
    assert edits.shipped() == json.loads(json.dumps(edits.defaults())), "run python -m harness.edits --write"


def test_one_precedence_default_scale_method_preset_config_command_line(tmp_path):
    """config.py's header: Config's default < scale < method (methods.py) < preset row < --config <
    command line, and set_by names the winner."""
    treerl = C.make_config("treerl", "demo")
    assert (treerl.n_base, treerl.max_new_tokens, treerl.fork) == (6, 64, "tok-entropy")   # method > scale
    assert treerl.set_by["n_base"] == "method treerl (methods.py)"
    assert treerl.set_by["max_new_tokens"] == "scale demo" and "clip_low" not in treerl.set_by  # default
    wider = C.make_config("treerl-434", "demo")
    assert wider.n_base == 4 and wider.set_by["n_base"] == "preset treerl-434"              # preset > method
    flags = cli.parse_args(["--preset", "treerl-434", "--scale", "demo", "--n_base", "5"])
    assert flags.n_base == 5 and flags.set_by["n_base"] == "the command line"               # flags > preset
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps({**dataclasses.asdict(wider), "n_base": 3}))
    again = cli.parse_args(["--config", str(saved), "--k_max", "1"])
    assert (again.n_base, again.k_max) == (3, 1)
    assert again.set_by["n_base"] == f"--config {saved}" and again.set_by["k_max"] == "the command line"


def test_the_recipes_are_the_readme_s_and_the_teaching_preset_leaves_them_to_config_py():
    """Each README recipe edits a default no row of --preset teach sets: the edit takes effect (a flag
    stands for the edit here: the same field, above the rows)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Ablations"):]
    section = section[:section.index("\n## ", 1)]
    shown = dict(re.findall(r"`(\w+): \w+ = ([^`]+)`", section))
    assert {k: json.loads(v.lower()) for k, v in shown.items()} == RECIPES
    layered = {name for _, row in C.layers("teach") for name in row}
    assert not set(RECIPES) & layered
    for name, value in RECIPES.items():
        assert getattr(C.make_config("teach", **{name: value}), name) == value


@pytest.fixture(scope="module")
def teaching_rollout():
    """One Phase 1 + 2 of --preset teach on the embedded model (2 prompts, 16 new tokens), each prompt's
    base responses graded 1, 0, 1, 0 (V(root) = 0.5: where K̂ = ⌈K_max(1 − V)⌉ differs from K_max), and
    every plan_prompt call recorded: (its arguments, its plan)."""
    import models

    cfg = C.make_config("teach", prompts_per_step=2, max_new_tokens=16, threads=0)
    model, tok = models.load_policy(cfg.model, "cpu", models.policy_dtype(cfg.precision), seed=0)
    problems = data.load_problems(cfg.train_data, limit=cfg.prompts_per_step)
    prompts = [data.format_prompt(p["problem"], tok, cfg.prompt_style, cfg.few_shot) for p in problems]
    calls, plan = [], R.plan_prompt

    def recorded(*args):
        calls.append((args, plan(*args)))
        return calls[-1][1]
    real_grade = R.grade_responses
    R.plan_prompt = recorded
    R.grade_responses = lambda tokenizer, tokens, answers, fallback: [float(j % 2 == 0)
                                                                     for j in range(len(tokens))]
    try:
        trees, _ = R.rollout_trees(model, tok, prompts, [p["answer"] for p in problems], cfg,
                                   random.Random(0), progress=False)
    finally:
        R.plan_prompt, R.grade_responses = plan, real_grade
    return cfg, model, tok, trees, calls


@pytest.mark.slow
def test_each_recipe_changes_what_the_teaching_preset_shows(teaching_rollout):
    """On the same base responses: adaptive = False keeps K̂, B̂ at (K_max, B_max) where the adaptive
    budget gave less; fork = "random" moves the forks off the sentence starts; alpha_start = 0.4 doubles
    the bonus on every block with Â_base > 0 (Eq. 4)."""
    import models

    cfg, model, tok, trees, calls = teaching_rollout
    assert len(calls) == cfg.prompts_per_step

    def replanned(recipe: dict) -> list:
        other = dataclasses.replace(cfg, **recipe)
        _, budget, expand = M.method_of(other).rollout_shape(other)
        return [R.plan_prompt(other, budget, expand, random.Random(1), *args[4:]) for args, _ in calls]
    # adaptive = False: K̂ = B̂ = 2 at V(root) = 0.5, where the adaptive budget gives ⌈2 · 0.5⌉ = 1
    assert {(p.v_root, p.k_hat, p.b_hat) for _, p in calls} == {(0.5, 1, 1)}
    assert {(p.k_hat, p.b_hat) for p in replanned({"adaptive": False})} == {(2, 2)}
    # fork = "random": other forks on the same responses
    sentence = [p.forks for _, p in calls]
    random_ = [p.forks for p in replanned({"fork": "random"})]
    assert sentence != random_ and all(len(a) == len(b) for a, b in zip(sentence, random_))
    # alpha_start = 0.4: Â = Â_base + α·Div_sib where Â_base > 0, with α doubled
    embedder = models.load_embedder(cfg.embed_model)
    method = M.method_of(cfg)
    changed = 0
    for tr, emb in zip(trees, A.embed_blocks(embedder, trees, cfg.embed_batch_size)):
        now = A.score_tree(tr, method, A.alpha_at(0, cfg.steps, cfg.alpha_start, 0.0), emb)
        doubled = A.score_tree(tr, method, A.alpha_at(0, cfg.steps, RECIPES["alpha_start"], 0.0), emb)
        for a, b in zip(now, doubled):
            bonus = a.advantage - a.base_advantage
            assert b.advantage - b.base_advantage == pytest.approx(2 * bonus, abs=1e-9)
            changed += bonus > 0
    assert changed > 0
