"""bench/profile_rollout.py's split of DATPO / GRPO seconds per decoded token into a tree step's premium at
equal rows × the rows in flight, against hand computations."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import profile_rollout as P  # noqa: E402


def test_step_cost_recovers_a_line_and_batch_sizes_count_the_steps():
    """GRPO's steps lie on 0.2 s + 0.01 s per row: least squares gives back (0.2, 0.01); batch_sizes is
    the count of steps per row number."""
    prof = P.Profile()
    prof.per_step = [(r, 0.2 + 0.01 * r) for r in (64, 64, 40, 10, 3)]
    a, b = P.step_cost(prof.per_step)
    assert (a, b) == (pytest.approx(0.2), pytest.approx(0.01))
    assert prof.batch_sizes == {64: 2, 40: 1, 10: 1, 3: 1}


def test_decompose_splits_the_ratio_into_premium_and_rows(capsys):
    """GRPO: 2 steps of 60 rows and 2 of 20 on 0.2 + 0.01 · rows (0.8 + 0.8 + 0.4 + 0.4 = 2.4 s for 160
    tokens: 15 ms a token). DATPO: 4 steps of 20 rows, each 1.5× GRPO's price at 20 rows (0.4 s → 0.6 s;
    2.4 s for 80 tokens: 30 ms a token, 2× GRPO's). Premium 1.5; rows: GRPO's price at DATPO's rows
    1.6 s / 80 = 20 ms over 15 ms = 4/3; their product 2.0 is the ratio per token."""
    tree, flat = P.Profile(), P.Profile()
    flat.per_step = [(60, 0.8), (60, 0.8), (20, 0.4), (20, 0.4)]
    tree.per_step = [(20, 0.6)] * 4
    P.decompose({"DATPO": {"prof": tree}, "GRPO": {"prof": flat}})
    out = capsys.readouterr().out
    assert "200 ms + 10.00 ms per row" in out
    assert "per decoded token 2.00 = a tree step's premium at equal rows 1.50 × rows in flight 1.33" in out
    assert "17-32" in out and "600 (4)" in out and "400 (2)" in out
