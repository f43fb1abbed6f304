"""reward.py against the labelled cases of public graders' test suites (Math-Verify, MARIO_EVAL,
hendrycks/math).

The cases live outside the repository, beside it: ../shared/data/grader_peer_cases.json relative to the repo
root (each: pred, gold, expect, source, mode "bare" = two bare answers / "response" = a full response and a
gold answer, the strings math-verify alone is given (mv_pred, mv_gold), and a `skip` reason where the case is
out of the project's scope). The bar: every graded case that math-verify alone gets right, reward.py gets
right too, except the policy differences listed below with their reasons. math-verify alone is run here, live,
as the independent path (its own parse + verify with its default settings and timeouts).
"""
import json
import os
import warnings

import pytest

import reward

CASES_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.pardir,
                          "shared", "data", "grader_peer_cases.json")

# (mode, pred, gold) -> why reward.py deliberately disagrees with math-verify alone (which gets these right).
POLICY_DIFFERENCES = {
    ("bare", "1000,99", "1000.99"):
        "a comma that is not thousands grouping separates a list: '1000,99' is the list 1000, 99 "
        "(math-verify reads it so too inside \\boxed{}; only its free-text number reader takes a decimal "
        "comma). MATH writes lists of answers as '2,3': a decimal-comma reading would grade 2.3 right "
        "against them",
    ("bare", "1.22", "1,22"):
        "same: the gold '1,22' is the list 1, 22, not 1.22",
    ("response", "$$\\boxed{(3, 3)} \\text{ for part (a) and } \\boxed{(1, 1)}$$", "(3, 3), (1, 1)"):
        "boxes are joined only across connectors (spacing, ',', ';', 'and', 'or', a label 'x ='): prose "
        "between them ('for part (a)') ends the answer, else an intermediate boxed value "
        "('a = \\boxed{3}, so a + b = \\boxed{7}') would be pulled into the final one. Only the last box, "
        "(1, 1), is read",
}


def _load_cases():
    if not os.path.exists(CASES_PATH):
        return None
    with open(CASES_PATH) as f:
        return json.load(f)


CASES = _load_cases()
GRADED = [c for c in CASES or [] if "skip" not in c]


def _ours(case) -> bool:
    if case["mode"] == "bare":
        return reward.is_equivalent(case["pred"], case["gold"])
    return reward.compute_reward(case["pred"], case["gold"]) == 1.0


def _math_verify_alone(case) -> bool:
    from math_verify import parse, verify
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return bool(verify(parse(case["mv_gold"]), parse(case["mv_pred"])))
        except Exception:
            return False


def _key(case):
    return case["mode"], case["pred"], case["gold"]


@pytest.fixture(scope="module")
def verdicts():
    if CASES is None:
        pytest.skip(f"peer cases not found at {os.path.normpath(CASES_PATH)} "
                    "(shared data beside the repository)")
    reward._timed_out.clear()
    return [(case, _ours(case) == case["expect"], _math_verify_alone(case) == case["expect"])
            for case in GRADED]


def test_every_case_math_verify_gets_right_is_right_but_documented_policy(verdicts):
    lost = [_key(case) for case, ours, mv in verdicts if mv and not ours]
    undocumented = [k for k in lost if k not in POLICY_DIFFERENCES]
    assert not undocumented, f"math-verify alone gets these right, reward.py does not: {undocumented}"
    # The list stays true: each documented difference is a case math-verify gets right and we do not.
    assert sorted(lost) == sorted(POLICY_DIFFERENCES), set(POLICY_DIFFERENCES) - set(lost)
    ours_right = sum(ours for _, ours, _ in verdicts)
    mv_right = sum(mv for _, _, mv in verdicts)
    print(f"\npeer cases: {len(verdicts)} graded of {len(CASES)}; reward.py right on {ours_right}, "
          f"math-verify alone on {mv_right}, documented policy differences {len(POLICY_DIFFERENCES)}")
    assert ours_right >= mv_right - len(POLICY_DIFFERENCES)


def test_the_file_is_the_one_described(verdicts):
    # A different file would make the figures in README/issue 12 meaningless: say so rather than pass quietly.
    assert len(CASES) == 345 and len(GRADED) == 258
    assert {c["mode"] for c in GRADED} == {"bare", "response"}
