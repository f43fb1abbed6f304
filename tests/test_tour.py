"""docs/tour.py: the guided tour regenerated at tiny scale, every section there and every number it prints
agreeing with the paper's formulas and with the project's functions recomputed from the page's own tables;
and the committed docs/tour.md regenerated at demo scale and compared, byte for byte."""
import ast
import math
import re
import sys
from pathlib import Path

import pytest
from test_train import stand_in_reward

import advantage as A
import rollout as R
import tree as T

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docs"))
import tour  # noqa: E402

SECTIONS = ["## 1. Sample prompts q ~ Q — `prompts.PromptStream.next_batch`",
            "## 2. Phase 1: N base responses — `rollout.rollout_trees`",
            "## 3. Difficulty: V(root), K̂ and B̂ — `rollout.plan_prompt`, `tree.adaptive_budget`",
            "## 4. Forks at the starts of the highest-entropy sentences — `tree.select_forks`",
            "## 5. Phase 2: branches, and the tree cut into blocks — `rollout.rollout_trees`",
            "## 6. Phase 3: values, advantages and sibling diversity — `advantage.score_tree`",
            "## 7. Phase 4's forward: a tree packed under its attention mask — `packing.pack`",
            "## 8. Phase 4: the clipped token-level loss — `train.ppo_update`"]


def tables(text: str) -> list[list[dict]]:
    """Every markdown table of `text` as a list of rows (header -> cell)."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") and i > 0:
            headers = [h.strip() for h in lines[i - 1].strip("|").split("|")]
            rows = []
            for row in lines[i + 1:]:
                if not row.startswith("| "):
                    break
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", row.strip()[1:-1])]
                rows.append(dict(zip(headers, cells)))
            out.append(rows)
    return out


def section(page: str, n: int) -> str:
    start = page.index(f"## {n}.")
    end = page.find(f"## {n + 1}.", start)
    return page[start:end if end > 0 else len(page)]


def value(text: str) -> float | None:
    return None if text in ("—", "") else float(text)


@pytest.fixture(scope="module")
def tour_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tour")


@pytest.fixture(scope="module")
def page(tour_dir):
    out = tour_dir / "tour.md"
    real = R.compute_reward
    R.compute_reward = stand_in_reward     # the tiny random model never answers right: a hash grades it
    try:
        tour.main(["--scale", "tiny", "--out", str(out)])
    finally:
        R.compute_reward = real
    return out.read_text(encoding="utf-8")


def test_every_python_block_in_the_docs_parses():
    """A student copies the code of the pages: every ```python block of docs/*.md and README.md parses."""
    root = Path(__file__).resolve().parent.parent
    blocks = 0
    for path in sorted((root / "docs").glob("*.md")) + [root / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            try:
                ast.parse(match.group(1))
            except SyntaxError as err:
                pytest.fail(f"{path.name} line {line}: {err.msg}")
            blocks += 1
    assert blocks >= 8     # the tour's excerpts at least


def test_excerpts_are_whole_statements():
    """An excerpt cut inside a statement (a comprehension's first line, a for without its body) is
    widened to whole statements; a function's docstring leaves no stray indentation."""
    import train

    text = tour.excerpt(train.train_step, "# ---- Phase 3", "train_trees = ").split("```python\n")[1]
    assert text.rstrip("`\n").endswith("# AttnRL drops some")      # the comprehension's last line
    loop = tour.excerpt(train.ppo_update, "for micro, new in forward.passes", "micro.loss = ")
    assert "sums += torch.stack" in loop                           # the for's whole body
    whole = tour.excerpt(T.adaptive_budget).split("```python\n")[1]
    assert whole.splitlines()[1].startswith("    if not 0.0 <= v_root") and '"""' not in whole


def test_the_tour_takes_train_py_flags(tmp_path):
    """The tour's settings are train.py's flags over the tour's own (TOUR, SIZES), which set no algorithm
    knob but the tiny scale's forks: an edit of config.py's defaults reaches the page."""
    cfg, out = tour.tour_config(["--scale", "tiny", "--alpha_start", "0.4", "--b_max", "3", "--out",
                                 str(tmp_path / "x.md")], str(tmp_path / "run"))
    assert (cfg.alpha_start, cfg.b_max, cfg.n_base, cfg.fork, cfg.model) == (0.4, 3, 4, "sent-entropy",
                                                                              "tiny-random")
    assert out == tmp_path / "x.md" and cfg.set_by["b_max"] == "the command line"
    assert tour.tour_config(["--fork", "random"], str(tmp_path))[0].fork == "random"
    demo = tour.tour_config([], str(tmp_path))[0]
    assert demo.model == "smollm2-135m" and demo.ppo_epochs == 2 and demo.prompts_per_step == 2
    assert not {"fork", "adaptive", "alpha_start", "alpha_end", "alpha_scope"} & (set(tour.TOUR) |
                                                                                 set(tour.SIZES["demo"]))


def test_the_tour_draws_its_trees_and_names_both_root_values(page, tour_dir):
    """The viewer's picture is written beside the page and shown in it; the two V(root)s are the N bases'
    mean (section 3) and the mean of every leaf (section 5's rewards)."""
    assert "![the step's trees](tour_tree.png)" in page
    assert (tour_dir / "tour_tree.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = section(page, 6)
    both = tables(text[text.index("**Two values of the root.**"):])[0]
    budget = tables(section(page, 3))[0]
    blocks = tables(section(page, 5))
    for row, plan, tree_blocks in zip(both, budget, blocks):
        assert row["V(root): N bases (Tree.v_root)"] == plan["V(root)"]
        leaves = [float(b["reward"]) for b in tree_blocks if b["reward"] != "—"]
        assert float(row["V̂_MC(root): all leaves (advantage.mc_root_value)"]) == pytest.approx(
            sum(leaves) / len(leaves), abs=1e-4)
        assert int(row["leaves"]) == len(leaves)


def test_the_exercise_expects_eq_4_with_alpha_doubled(page):
    """The exercise's expected Â with alpha_start doubled, from section 6's own Â_base and Div_sib (a rerun
    with the flag gives exactly these: the rollout does not depend on α)."""
    alpha = float(re.search(r"= (\d\.\d+) \(annealed", section(page, 6)).group(1))
    scores = tables(section(page, 6))
    expected = re.findall(r"prompt (\d+) block (\d+): Â (-?[\d.]+) → (-?[\d.]+) \(= (-?[\d.]+) \+ "
                          r"([\d.]+) × ([\d.]+)\)", section(page, 9))
    assert expected
    for prompt, block, now, after, base, doubled, div in expected:
        row = scores[int(prompt)][int(block)]
        assert (row["Â"], row["Â_base"], row["Div_sib"]) == (now, base, div) and float(base) > 0
        assert float(doubled) == pytest.approx(2 * alpha)
        assert float(after) == pytest.approx(float(base) + 2 * alpha * float(div), abs=2e-4)


def test_every_phase_of_algorithm_datpo_has_its_section(page):
    for title in SECTIONS:
        assert title in page, title
    assert [page.index(title) for title in SECTIONS] == sorted(page.index(title) for title in SECTIONS)


def test_v_root_is_the_mean_base_reward_and_the_budget_is_eq_1_2(page):
    rows = tables(section(page, 3))[0]
    assert len(rows) == 2
    for row in rows:
        rewards = [float(r) for r in row["base rewards"].split()]
        v = float(row["V(root)"])
        assert v == pytest.approx(sum(rewards) / len(rewards), abs=1e-4)
        k_hat, b_hat = int(row["K̂"]), int(row["B̂"])
        assert (k_hat, b_hat) == (math.ceil(round(2 * (1 - v), 9)), math.ceil(round(2 * (1 - v), 9)))
        assert (k_hat, b_hat) == T.adaptive_budget(v, 2, 2)


def test_forks_start_the_highest_entropy_sentences(page):
    budgets = {int(r["prompt"]): int(r["K̂"]) for r in tables(section(page, 3))[0]}
    text = section(page, 4)
    heads = re.findall(r"\*\*Prompt (\d+), response (\d+)\*\* \(K̂ = (\d+)\): forks \[([\d, ]*)\]", text)
    assert heads
    for (prompt, _, k_hat, forks), rows in zip(heads, tables(text)):
        assert int(k_hat) == budgets[int(prompt)]
        forks = [int(f) for f in forks.split(",") if f.strip()]
        entropy = {int(re.match(r"\[(\d+),", r["tokens"]).group(1)): float(r["H^S"]) for r in rows}
        chosen = {f - 1 for f in forks}                       # the chosen sentence's first token is kept
        assert len(forks) == min(int(k_hat), len(rows)) and chosen <= set(entropy)
        assert min(entropy[a] for a in chosen) >= max([entropy[a] for a in entropy if a not in chosen],
                                                      default=-1)


def test_blocks_cover_every_generated_token_once_and_values_match_the_functions(page):
    """The block tables (section 5) give each tree's parents and rewards; advantage.mc_values and Eq. 3/4
    recomputed from them must equal section 6, row by row."""
    blocks_text, adv_text = section(page, 5), section(page, 6)
    alpha = float(re.search(r"= (\d\.\d+) \(annealed", adv_text).group(1))
    heads = re.findall(r"\*\*Prompt \d+\*\*: (\d+) blocks, (\d+) leaves, (\d+) generated tokens", blocks_text)
    for (n_blocks, leaves, generated), blocks, scores in zip(heads, tables(blocks_text), tables(adv_text)):
        assert len(blocks) == len(scores) == int(n_blocks)
        assert sum(int(b["tokens"]) for b in blocks) == int(generated)
        parents = [None if b["parent"] == "prompt" else int(b["parent"]) for b in blocks]
        rewards = [value(b["reward"]) for b in blocks]
        assert sum(r is not None for r in rewards) == int(leaves)
        v_start, v_end = A.mc_values(parents, rewards)
        for i, s in enumerate(scores):
            assert float(s["V(s_start)"]) == pytest.approx(v_start[i], abs=1e-4)
            assert float(s["V(s_end)"]) == pytest.approx(v_end[i], abs=1e-4)
            base = float(s["Â_base"])
            assert base == pytest.approx((rewards[i] or 0.0) + v_end[i] - v_start[i], abs=1e-4)      # Eq. 3
            bonus = alpha * float(s["Div_sib"]) if base > 0 else 0.0
            assert float(s["Â"]) == pytest.approx(base + bonus, abs=2e-4)                            # Eq. 4
        root = [float(s["V(s_start)"]) for s, p in zip(scores, parents) if p is None]
        assert root and all(v == pytest.approx(sum(r for r in rewards if r is not None) / int(leaves),
                                               abs=1e-4)
                            for v in root)                  # V(root) averages every leaf of the tree


def test_the_first_minibatch_loss_is_minus_the_advantage_sum_over_the_normaliser(page):
    text = section(page, 8)
    first, second, record = tables(text)
    assert first and all(float(r["ρ"]) == 1.0 and not r["clipped"] for r in first)   # θ_old = θ: ρ = 1
    assert all(float(r["min(ρÂ, clip(ρ)Â)"]) == float(r["Â"]) for r in first)
    total, norm, loss = re.search(r"Σ min\(ρÂ, clip\(ρ\)Â\) = (-?[\d.]+), so its share of the loss is "
                                  r"−Σ / ([\d.]+) = (-?[\d.]*\d)", text).groups()
    assert float(loss) == pytest.approx(-float(total) / float(norm), abs=1e-6)
    assert int(record[0]["optimizer_steps"]) >= 2 and float(record[0]["clip_frac"]) >= 0


def test_the_second_epoch_clips_by_the_rule(page):
    """Epoch 2's ratios moved; a token is clipped exactly when ρ leaves [1 − ε, 1 + ε] on its advantage's
    side, and its objective is then the clipped one (Eq. DATPO)."""
    rows = tables(section(page, 8))[1]
    assert any(float(r["ρ"]) != 1.0 for r in rows)
    for r in rows:
        adv, rho, objective = float(r["Â"]), float(r["ρ"]), float(r["min(ρÂ, clip(ρ)Â)"])
        assert bool(r["clipped"]) == ((rho > 1.2 and adv > 0) or (rho < 0.8 and adv < 0))
        assert objective == pytest.approx(min(rho * adv, min(max(rho, 0.8), 1.2) * adv), abs=2e-4)


def test_the_packed_tree_mask_is_its_ancestry(page):
    """Section 7's block-level mask: each block sees the prompt, its ancestors and itself (section 5's
    parents), nothing else."""
    text = section(page, 7)
    tree_index = int(re.search(r"packs prompt (\d+)'s tree", text).group(1))
    blocks = tables(section(page, 5))[tree_index]
    parents = {int(b["block"]): None if b["parent"] == "prompt" else int(b["parent"]) for b in blocks}
    grid = text.split("```")[1].strip().splitlines()
    labels = grid[0].split()[3:]
    assert labels[0] == "q"
    for line in grid[1:]:
        name, *marks = line.split()
        seen = {labels[i] for i, m in enumerate(marks) if m == "■"}
        if name == "q":
            assert seen == {"q"}
            continue
        block, path = int(name[1:]), {"q", name}
        node = parents[block]
        while node is not None:
            path.add(f"b{node}")
            node = parents[node]
        assert seen == path


@pytest.mark.slow
def test_the_committed_tour_is_what_the_script_writes(tmp_path):
    """docs/tour.md is exactly what `python docs/tour.py` writes today (it runs in float64, so every CPU
    writes the same digits): no hand edit, no stale number, no code excerpt the source no longer has."""
    out = tmp_path / "tour.md"
    tour.main(["--out", str(out)])
    committed = (Path(__file__).resolve().parent.parent / "docs" / "tour.md").read_text(encoding="utf-8")
    assert out.read_text(encoding="utf-8") == committed, "docs/tour.md is stale: run python docs/tour.py"
