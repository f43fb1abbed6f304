"""docs/tour.py: the guided tour regenerated at tiny scale, every section there and every number it prints
agreeing with the paper's formulas and with the project's functions recomputed from the page's own tables;
and the committed docs/tour.md regenerated at demo scale and compared, byte for byte."""
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
def page(tmp_path_factory):
    out = tmp_path_factory.mktemp("tour") / "tour.md"
    real = R.compute_reward
    R.compute_reward = stand_in_reward     # the tiny random model never answers right: a hash grades it
    try:
        tour.main(["--scale", "tiny", "--out", str(out)])
    finally:
        R.compute_reward = real
    return out.read_text(encoding="utf-8")


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
