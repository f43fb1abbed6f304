"""Hypothesis strategies for text a model (or a user's data file) writes: the pieces real responses are made
of (issue 40). tests/test_model_text.py drives every parser of model or user text with them (reward.py,
mcq.py, tree.py, data.py, harness/viz.py); bench/sweep_parsers.py runs the same strategies for 100k+ examples.

The grammar: numbers in every spelling MATH and models use (1,000 / 11,\\! 111 / 1{,}000 / .5 / -3), LaTeX
commands with and without their arguments (\\frac12, \\sqrt[3]{x}, \\dfrac, \\left( \\right), matrices, sets,
intervals), units as \\text{}/\\mathrm{}/\\mbox{} (empty and full), words, degrees, percent, dollars and
powers, boxes (nested, cut off, repeated, bare-token, \\fbox), connectors between boxes, maths delimiters,
prose, and noise: unbalanced braces, lone backslashes, unicode, control characters, and very long or very
deeply nested pieces.
"""
from __future__ import annotations

from hypothesis import strategies as st

# --------------------------------------------------------------------------------------------------------
# Atoms
# --------------------------------------------------------------------------------------------------------
UNITS = ["cm", "m", "mm", "km", "in", "inches", "ft", "feet", "foot", "yd", "mi", "miles", "g", "kg", "lb",
         "lbs", "oz", "s", "sec", "seconds", "min", "minutes", "h", "hr", "hours", "days", "week", "years",
         "mL", "L", "liters", "gal", "cups", "acres", "dollars", "cents", "USD", "euro", "€", "¢", "°",
         "degrees", "deg", "radians", "rad", "mph", "kph", "square cm", "sq ft", "cubic meters", "cu in",
         "square units", "units", "apples", "students", "miles per hour", "", " ", ".", "..", "m.", "s s"]
WRAPPERS = ["\\text", "\\textrm", "\\textnormal", "\\textit", "\\textbf", "\\mathrm", "\\mbox", "\\rm",
            "\\mathbf", "\\operatorname"]
COMMANDS = ["\\pi", "\\infty", "-\\infty", "\\cdot", "\\times", "\\div", "\\pm", "\\circ", "^\\circ",
            "^{\\circ}", "\\%", "%", "\\$", "$", "\\,", "\\!", "\\;", "\\:", "\\ ", "~", "\\quad",
            "\\qquad", "\\cup", "\\cap", "\\in", "\\le", "\\leq", "\\ge", "\\neq", "\\approx", "\\sqrt2",
            "\\frac12", "\\dfrac34", "\\tfrac", "\\frac", "\\sqrt", "\\binom", "\\left(", "\\right)",
            "\\left[", "\\right]", "\\left\\{", "\\right\\}", "\\{", "\\}", "\\\\", "&", "\\alpha",
            "\\theta", "\\sin", "\\cos", "\\log", "\\ln", "!", "'", "\\prime", "\\ldots", "\\dots", "\\lor",
            "\\vee", "\\&", "\\mathbb{R}", "\\emptyset", "\\varnothing", "\\overline", "\\hat", "\\vec",
            "\\begin{pmatrix}", "\\end{pmatrix}", "\\begin{bmatrix}", "\\end{bmatrix}", "\\begin{cases}",
            "\\end{cases}", "\\begin{align*}", "\\end{align*}"]
NOISE = ["{", "}", "{{", "}}", "\\", "\\\\", "$", "$$", "\\[", "\\]", "\\(", "\\)", "^", "_", "^^", "__",
         "(", ")", "[", "]", ",", ";", ":", ".", "...", "=", "==", "\n", "\n\n", "\t", "\r", "\r\n", " ",
         "  ", "\x00", "\x07", "\x08", "\x0b", "\x0c", "\x1b", "\x7f", "\u200b", "\u2028", "\u00a0",
         "\ufeff", "−", "×", "÷", "²", "³", "√", "π", "∞", "½", "≤", "é", "中文", "🙂",
         "\ud800", "\udfff"]   # lone surrogates too
CONNECTORS = [", ", " or ", " and ", "; ", " \\quad ", " \\text{ or } ", "$ or $", " x = ", ", y = ",
              "$, $x_2 = ", " or $x = ", "\\quad\\text{and}\\quad ", " ", ". ", " then ", "\n"]
WORDS = ["The", "answer", "is", "so", "Therefore", "we", "get", "final", "Wait", "that", "wrong", "x", "y",
         "n", "A", "B", "(C)", "D)", "option", "Step", "1:", "First,", "Mr.", "e.g.", "i.e.", "No.", "U.S.",
         "3.14", "Dr", "etc.", "?", "!", "####", "Level", "Answer:", "Final Answer:", "hence", "thus"]


def number() -> st.SearchStrategy[str]:
    """A number as models and MATH write it."""
    plain = st.integers(-10 ** 12, 10 ** 12).map(str)
    decimal = st.builds(lambda a, b: f"{a}.{b}", st.integers(-999, 999), st.integers(0, 10 ** 6))
    grouped = st.integers(1000, 10 ** 9).map(lambda n: f"{n:,}")
    marked = st.integers(1000, 10 ** 9).map(lambda n: f"{n:,}".replace(",", ",\\! "))   # MATH's 11,\! 111
    odd = st.sampled_from([".5", "-.5", "0,111", "1,22", "1 000", "1\\,000\\,000", "1{,}000", "11,\\! 111",
                           "007", "1e5", "1E-3", "0.000", "-0", "+5", "٣", "１２"])
    return st.one_of(plain, decimal, grouped, marked, odd, st.integers(0, 20).map(str))


def unit_text() -> st.SearchStrategy[str]:
    """A unit after a number: \\text{ cm} (empty and full), a bare word, a degree sign, a power."""
    wrapped = st.builds(lambda w, sp, u: f"{w}{sp}{{{u}}}", st.sampled_from(WRAPPERS),
                        st.sampled_from(["", " "]), st.sampled_from(UNITS + [" " + u for u in UNITS]))
    bare = st.builds(lambda sp, u: sp + u, st.sampled_from([" ", "~", "\\,", ""]), st.sampled_from(UNITS))
    power = st.sampled_from(["", "", "^2", "^{2}", "^3", "^{ 3 }", "²", "³", "^\\circ", "^{\\circ}", "^ {2"])
    return st.builds(lambda u, p: u + p, st.one_of(wrapped, bare), power)


# --------------------------------------------------------------------------------------------------------
# Answers (what goes inside a box): a small recursive grammar of LaTeX maths
# --------------------------------------------------------------------------------------------------------
def _wrap(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    two = st.tuples(inner, inner)
    return st.one_of(
        st.builds(lambda ab, c: f"\\{c}{{{ab[0]}}}{{{ab[1]}}}", two,
                  st.sampled_from(["frac", "dfrac", "tfrac", "binom"])),
        st.builds(lambda a: f"\\sqrt{{{a}}}", inner),
        st.builds(lambda n, a: f"\\sqrt[{n}]{{{a}}}", st.integers(2, 5), inner),
        st.builds(lambda a, b: f"{a}^{{{b}}}", inner, inner),
        st.builds(lambda a, b: f"{a}_{{{b}}}", inner, inner),
        st.builds(lambda a: f"({a})", inner),
        st.builds(lambda a: f"\\left( {a} \\right)", inner),
        st.builds(lambda ab, o: f"{o[0]}{ab[0]}, {ab[1]}{o[1]}", two,
                  st.sampled_from(["()", "[]", "[)", "(]", ["\\{", "\\}"]])),
        st.builds(lambda ab, op: f"{ab[0]} {op} {ab[1]}", two,
                  st.sampled_from(["+", "-", "\\cdot", "\\times", "/", "=", "\\cup", ",", "\\pm", "&",
                                   "\\\\"])),
        st.builds(lambda rows, env: f"\\begin{{{env}}}" + " \\\\ ".join(rows) + f"\\end{{{env}}}",
                  st.lists(inner, min_size=1, max_size=3), st.sampled_from(["pmatrix", "bmatrix", "matrix"])),
        st.builds(lambda w, a: f"{w}{{{a}}}", st.sampled_from(WRAPPERS), inner),
        st.builds(lambda a, u: a + u, inner, unit_text()),
        st.builds(lambda a: f"\\boxed{{{a}}}", inner),
        st.builds(lambda a: "{" + a + "}", inner),
    )


def answer(max_leaves: int = 12) -> st.SearchStrategy[str]:
    """An answer as a model boxes it: numbers, LaTeX, units, words, noise, nested up to a few levels; plus
    the extremes (very long, very deep)."""
    atom = st.one_of(number(), number().map(lambda n: n + "\\%"), number().map(lambda n: "\\$" + n),
                     st.builds(lambda n, u: n + u, number(), unit_text()), st.sampled_from(COMMANDS),
                     st.sampled_from(["x", "y", "n", "a+b", "2x", "x^2", "e^{x^2}", "i", "\\pi/2", "(A)",
                                      "B"]),
                     st.sampled_from(NOISE), st.text(max_size=4))
    grammar = st.recursive(atom, _wrap, max_leaves=max_leaves)
    sequence = st.lists(grammar, min_size=1, max_size=4).map(" ".join)
    return st.one_of(grammar, grammar, grammar, grammar, sequence, sequence, extreme())


def extreme() -> st.SearchStrategy[str]:
    """Very long and very deep inputs: a piece repeated thousands of times, or nested hundreds deep."""
    piece = st.sampled_from(["1", "{", "}", "\\frac{", "x+", "(", "\\sqrt{", "^{", "9^", "\\boxed{", ",",
                             "\\", "\\text{}", "$", "\\left(", "10", "\\!", "\\,", "{,}", " "])
    repeated = st.builds(lambda p, n: p * n, piece, st.integers(50, 6000))   # > 4,300 digits: int() refuses
    nested = st.builds(lambda o, c, mid, n: o * n + mid + c * n,
                       st.sampled_from(["{", "(", "\\frac{1}{", "\\sqrt{", "x^{", "\\boxed{", "\\text{",
                                        "["]),
                       st.sampled_from(["}", ")", "}", "]", ""]), st.sampled_from(["1", "x", "", "9^9"]),
                       st.integers(10, 600))
    return st.one_of(repeated, nested)


# --------------------------------------------------------------------------------------------------------
# Responses: prose and maths around boxes
# --------------------------------------------------------------------------------------------------------
def prose() -> st.SearchStrategy[str]:
    word = st.one_of(st.sampled_from(WORDS), number(), st.sampled_from(NOISE), st.sampled_from(COMMANDS))
    return st.lists(word, max_size=12).map(" ".join)


def boxed(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """A box as models write it: closed, bare-token, \\fbox, nested, cut off, with or without $."""
    return st.one_of(
        st.builds(lambda a: f"\\boxed{{{a}}}", inner),
        st.builds(lambda a: f"$\\boxed{{{a}}}$", inner),
        st.builds(lambda a: f"\\[ \\boxed{{{a}}} \\]", inner),
        st.builds(lambda a: f"\\boxed {{{a}}}", inner),
        st.builds(lambda a: f"\\fbox{{{a}}}", inner),
        st.builds(lambda a: f"\\boxed{{\\boxed{{{a}}}}}", inner),
        st.builds(lambda a: f"\\boxed {a}", inner),              # bare token (or garbage after \boxed)
        st.builds(lambda a: f"\\boxed{{{a}", inner),             # cut off
        st.just("\\boxed"), st.just("\\boxed{"), st.just("\\boxed{}"), st.just("\\boxedx{3}"),
        st.builds(lambda a: f"\x08oxed{{{a}}}", inner),          # typed in a non-raw Python string
    )


def response() -> st.SearchStrategy[str]:
    """A whole response: prose, maths and boxes, repeated boxes joined by connectors, cut anywhere."""
    part = st.one_of(prose(), boxed(answer()), st.builds(lambda a: f"${a}$", answer()),
                     st.builds(lambda a: f"$${a}$$", answer()), st.sampled_from(CONNECTORS), answer())
    whole = st.lists(part, min_size=1, max_size=8).map("".join)
    cut = st.builds(lambda t, f: t[:int(len(t) * f)], whole, st.floats(0, 1))   # a token limit ends it
    return st.one_of(whole, whole, whole, cut, cut, extreme(), st.text(max_size=200))


def gold() -> st.SearchStrategy[str]:
    """A gold answer (a data file's answer column): mostly well formed, sometimes not."""
    return st.one_of(number(), answer(max_leaves=6), st.text(max_size=20))


# --------------------------------------------------------------------------------------------------------
# Data rows (a user's .jsonl / .csv / .parquet file) and token offsets (tree.py's spans)
# --------------------------------------------------------------------------------------------------------
def value() -> st.SearchStrategy:
    """What a data file's field may hold: text, numbers, nothing, or structures."""
    scalar = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 20, 10 ** 20), st.floats(allow_nan=True),
                       st.text(max_size=30), gold())
    return st.one_of(scalar, st.lists(scalar, max_size=3),
                     st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", 3]),
                                                     "content": st.one_of(st.text(max_size=20), st.none())}),
                              max_size=3),
                     st.dictionaries(st.text(max_size=5), scalar, max_size=2))


def row() -> st.SearchStrategy[dict]:
    """A row of a user's data file: the field names data.to_problem looks for, with any values; a `solution`
    is a model-like response (a MATH solution: prose and boxes)."""
    names = st.sampled_from(["problem", "question", "prompt", "answer", "final_answer", "level", "id", ""])
    fields = st.dictionaries(names, value(), max_size=4)
    solution = st.one_of(response(), st.builds(lambda a, b: f"{a} {b}", response(), gold().map(
        lambda g: f"#### {g}")))
    level = st.one_of(st.none(), st.integers(-2, 7), st.sampled_from(["Level 3", "Level ?", "level 10", "3",
                                                                       " 5 ", "Level", "L3", "", "３",
                                                                       "Level " + "9" * 5000]))
    with_solution = st.builds(lambda f, s, q, lv: {**f, "problem": q, "solution": s, "level": lv}, fields,
                              solution, st.text(min_size=1, max_size=30), level)
    with_answer = st.builds(lambda f, a, q, lv: {**f, "question": q, "answer": a, "level": lv}, fields,
                            st.one_of(gold(), gold().map(lambda g: f"steps... #### {g}"), value()),
                            st.text(max_size=30), level)
    return st.one_of(fields, with_solution, with_answer, with_solution, with_answer)


def mcq_row() -> st.SearchStrategy[dict]:
    """A GPQA or MMLU-Pro row of a user's file (mcq.py): the fields it reads, each there or not, any value."""
    return st.fixed_dictionaries(
        {}, optional={"question": value(), "options": st.one_of(st.lists(value(), max_size=12), value()),
                      "answer": st.one_of(st.sampled_from(list("ABCDEFGHIJK") + ["a", " B ", ""]), value()),
                      "category": value(), "Question": value(), "Correct Answer": value(),
                      "Incorrect Answer 1": value(), "Incorrect Answer 2": value(),
                      "Incorrect Answer 3": value()})


def offsets_of(text: str, cuts: list[int]) -> list[tuple[int, int]]:
    """Token (start, end) spans of `text` cut at `cuts` (positions, any order, clipped), then one empty span
    for an EOS token: what tree.decode_with_offsets gives for sampled ids."""
    points = sorted({c for c in cuts if 0 < c < len(text)} | {0, len(text)})
    spans = list(zip(points, points[1:]))
    return spans + [(len(text), len(text))]


def partitions(spans: list[tuple[int, int]], n: int) -> bool:
    """True when token spans (start inclusive, end exclusive) cover tokens 0..n-1 once each, in order, none
    empty."""
    if n == 0:
        return spans == []
    return (bool(spans) and spans[0][0] == 0 and spans[-1][1] == n
            and all(a < b for a, b in spans) and all(x[1] == y[0] for x, y in zip(spans, spans[1:])))
