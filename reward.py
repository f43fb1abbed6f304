"""Binary verifiable reward for math answers.

The paper trains with a binary verifiable reward: 1 if the final answer is correct, 0 otherwise
(DATPO, Section 5.1 and Appendix F.1 "Training Hyperparameters"; the same r(b) in {0, 1} scores the
terminal blocks of a tree, Section 4). This module turns a model response into that number:

    extract_answer(text)         -> the final answer: the last brace-balanced \\boxed{...} (or \\fbox{...})
                                    with the boxes chained to it in the final phrase, joined; or None
    is_equivalent(pred, gold)    -> math-verify equivalence of two bare answer strings, strict
    compute_reward(text, gold)   -> 1.0 / 0.0

Grading is math-verify (the grader of TRL, open-r1 and lm-eval) with strict=True: \\frac12 = 0.5,
\\sqrt2/2 = 1/\\sqrt2, 1,000 = 1000, "x = 5" = 5, 30^\\circ = 30, "5 \\text{ cm}" = 5, sets are unordered,
tuples and interval endpoints are not; but "5 m" is wrong for "5 cm" (both name a unit: _units_differ), and a
response cut off inside its last \\boxed{ has no answer. Thousands are also written 11,\\! 111 (MATH), 1{,}000
and 1 000; a group never starts a number with 0 ("0,111" is 0.111, as math-verify reads it); any other comma
between digits separates a list ("1,22" is 1 and 22: MATH writes lists of answers so, never decimal commas).

Several boxes (the multi-box policy; README "The grader's multi-box policy"). An answer split over
boxes of one final phrase ("x = \\boxed{1} or x = \\boxed{-2}", "\\boxed{(1,2)}, \\boxed{(2,1)}") is read
whole, joined "1, -2", as math-verify does; only connectors may stand between the boxes (spacing, math
delimiters, "," ";" "and" "or", a label "x ="), so a boxed intermediate value earlier in the text is
never pulled in. The joined answer is compared as a whole: boxing several candidates gives a list that a
single gold answer never equals, so a response cannot win by boxing many candidates.

There is no numeric fallback that strips letters (the public reference code graded \\sqrt{2} as 2;
here it is wrong). LaTeX mangled by a non-raw Python string ("\\boxed" typed as "\\x08oxed") is repaired.
Answers never make these functions raise (tests/test_model_text.py drives them with generated text,
tests/test_corpus.py with real model outputs); the one error is a RuntimeError when a helper process (below)
cannot start at all, which is a broken environment.

Bounding the time. A model can write anything inside a box (9^{9^{9^{9}}}, 10,000 characters, garbage
LaTeX) and sympy may then work for minutes; a training step grades hundreds of responses, so every
check must end within TIMEOUT_SECONDS, return False rather than raise, and work from any thread or
worker process. Three layers:
  1. Cheap guards reject what no real answer looks like before sympy sees it: more than
     MAX_ANSWER_CHARS characters (MATH's longest gold answer has 159), braces that are unbalanced or,
     with brackets, nested deeper than MAX_NESTING, numeric exponent towers (a digit raised to a digit
     inside an exponent, 9^9^9) and exponents, factorials or binomials of 6+ digit integers. Identical
     strings are accepted before the guards (only the length bound comes first), so a gold answer is never
     guarded away from an identical prediction; two plain numbers are compared exactly without sympy
     (microseconds). A gold answer no response could match (longer than the bound, braces that no \\boxed{}
     can hold: unmatchable_gold) is refused or skipped when the data is loaded (data.py), so every gold
     answer that reaches training or evaluation scores 1 against a response that boxes it exactly.
  2. On the main thread, math-verify runs in-process under our own SIGALRM (call_with_alarm: setitimer,
     re-firing every 0.1 s in case some library swallows the first exception or it lands in a finaliser,
     which Python cannot raise from: dropped there). math-verify's own timeouts are off
     (parsing_timeout=None, timeout_seconds=None): they call signal.alarm, which raises ValueError off
     the main thread, and they would bound parsing and comparing separately rather than the whole check.
  3. Off the main thread (thread pools) signals cannot be used, so the check is sent to a persistent
     helper process (a pool of them, one per concurrent caller, at most MAX_HELPERS). The helper grades
     with layer 2 on its own main thread (alarm at 0.85 x the timeout, so it usually answers and lives
     on); if no answer comes back within TIMEOUT_SECONDS the helper is killed and the next call starts
     a fresh one (under a second). Helpers are started with subprocess, not multiprocessing, so daemonic
     workers (torch DataLoader, multiprocessing.Pool) may use them; a forked child forgets its parent's
     helpers and starts its own if it needs them.
Worker processes (ProcessPoolExecutor, DataLoader) run their tasks on their main thread: layer 2.
A (pred, gold) pair whose check ran out of time is remembered and graded False at once the next time.

Speed (2-core CPU): a plain-number check takes microseconds; a math-verify check of two MATH500 answers
averages 13 ms with both sides parsed cold, less in training, where a group shares its gold answer
(parses and whole (pred, gold) results are cached); a round trip to a warm helper adds about 0.1 ms.
The first math-verify call of a process pays about 1 s of imports, a helper's start about 0.7 s.
"""

import atexit
import functools
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
from fractions import Fraction

TIMEOUT_SECONDS = 3.0          # wall-clock bound on one equivalence check (read at call time)
MAX_ANSWER_CHARS = 1000        # longer "answers" are graded wrong without parsing
MAX_NESTING = 16               # braces and brackets
MAX_HELPERS = 8                # helper processes for off-main-thread callers
HELPER_STARTUP_SECONDS = 120.0 # importing sympy on a busy 2-core box can take a while; not part of the bound


# ---------------------------------------------------------------------------------------------------
# Answer extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BARE_BOX_TOKEN_RE = re.compile(r"[ \t]*([^\s${}\\]+)")   # "\boxed 5" (LaTeX allows one bare token)
# Numbers for the optional fallback: 1,234.5 / 12.5 / .5 / 7; a minus only when it is not a binary minus.
_NUMBER_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\d.,])(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


# LaTeX typed into a non-raw Python string loses its backslash: "\boxed" -> "\x08oxed", "\frac" ->
# "\x0crac", "\text" -> TAB + "ext". Those control characters never occur in model output, so put the
# backslash back (only TAB/CR before a known command name, since plain tabs and CRs are real text).
_MANGLED_RE = re.compile(r"[\x07\x08\x0b\x0c]|\t(?=ext|imes|heta|frac|riangle)|\r(?=ight|angle|ho)")
_MANGLED = {"\x07": "\\a", "\x08": "\\b", "\x0b": "\\v", "\x0c": "\\f", "\t": "\\t", "\r": "\\r"}


def _unmangle(text: str) -> str:
    return _MANGLED_RE.sub(lambda m: _MANGLED[m.group()], text)


def _match_braces(text: str) -> dict[int, int]:
    """Map the index of each '{' to its matching '}' in one pass; escaped \\{ \\} are not braces."""
    pairs, stack, i = {}, [], 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character (\{, \}, \\)
            continue
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
        i += 1
    return pairs


# What may stand between two boxes of one answer split over several boxes ("\boxed{1}, \boxed{2}",
# "x = \boxed{1} or x = \boxed{-2}", "\boxed{-2} \quad \text{and} \quad \boxed{1}"): spacing, math
# delimiters, "," ";" "and" "or", and a label "x =" / "y_2 =" before the next box. Nothing else: no
# prose ("then", "so a + b ="), no full stop, so an intermediate boxed value is never pulled in.
MAX_CONNECTOR_CHARS = 80
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textrm|textnormal|textit|textbf|mbox|mathrm)\s*\{([^{}]*)\}")
_CONNECTOR_RE = re.compile(
    r"(?:\s|[,;~$]|\\[()\[\],;: ]|\\q?quad(?![A-Za-z])|\b(?:and|or)\b"
    r"|(?:[A-Za-z]|\\[A-Za-z]+)(?:_\{?[A-Za-z0-9]+\}?)?'*\s*=)*")
_SEPARATOR_RE = re.compile(r"[,;]|\b(?:and|or)\b|\\q?quad(?![A-Za-z])")


def _joins_boxes(between: str) -> bool:
    """True if `between` (the text from the end of one box to the next \\boxed) only links two parts of one
    answer."""
    if len(between) > MAX_CONNECTOR_CHARS:
        return False
    between = _TEXT_WRAPPER_RE.sub(r" \1 ", between)
    return bool(_SEPARATOR_RE.search(between)) and _CONNECTOR_RE.fullmatch(between) is not None


def _boxes_last_first(text: str):
    """(start, end, content) of every \\boxed{...} / \\fbox{...} / \\boxed TOKEN, the last one first.

    `end` is the index just after the closing brace (or token). A box that is never closed, or a \\boxed with
    nothing after it, comes as (start, None, None): what a response cut off inside its answer ends with.
    """
    pairs = None  # computed lazily: most texts have one box
    for m in reversed(list(_BOX_RE.finditer(text))):
        j = m.end()
        while j < len(text) and text[j] in " \t":
            j += 1
        if j < len(text) and text[j] == "{":
            if pairs is None:
                pairs = _match_braces(text)
            if j in pairs:
                yield m.start(), pairs[j] + 1, text[j + 1:pairs[j]].strip()
            else:
                yield m.start(), None, None
            continue
        bare = _BARE_BOX_TOKEN_RE.match(text, m.end())
        if bare and bare.group(1).rstrip(".,;:"):
            yield m.start(), bare.end(), bare.group(1).rstrip(".,;:")
        else:
            yield m.start(), None, None


def last_box_cut_off(text: str) -> bool:
    """True when the text's last \\boxed (or \\fbox) is never closed or holds nothing: the response was cut
    off inside its final answer, so it has none (an earlier box it went on from is not its answer)."""
    if not isinstance(text, str):
        return False
    last = next(_boxes_last_first(_unmangle(text)), None)
    return last is not None and last[1] is None


def extract_answer(text: str, fallback_last_number: bool = False, join_boxes: bool = True) -> str | None:
    """The final answer of a response: the content of its last usable \\boxed{...} / \\fbox{...}
    (or \\boxed TOKEN).

    An answer split over several boxes of one final phrase ("x = \\boxed{1} or x = \\boxed{-2}",
    "\\boxed{(1,2)}, \\boxed{(2,1)}") is returned joined, "1, -2": the boxes chained to the last one by
    connectors only (see _joins_boxes; math-verify also joins such boxes), identical parts once. The joined
    answer is then compared as a whole, so boxing several candidates makes a list that a single gold
    answer never equals: a response cannot win by boxing many candidates. A last box that is never closed
    (a response cut off inside its answer) means no answer, never the earlier box it went on from (as the
    MATH grader's last_boxed_only_string reads it); an unclosed box before the last one ends the chain.
    join_boxes=False returns the last box alone (how MATH reference solutions mark their gold answer: their
    "\\boxed{x+11} or \\boxed{11+x}" offers two spellings of one answer, and MATH500's curated answers are
    the last box). With fallback_last_number=True and no usable box (none, or a cut-off last one), the last
    number in the text is returned instead (a switch for easy demo data; off for MATH-style training).
    """
    if not isinstance(text, str):
        return None
    text = _unmangle(text)
    chain, cut_off_at = [], 0  # (start, end, content) of the final answer's boxes, last first
    for start, end, content in _boxes_last_first(text):
        if end is None:   # never closed: the last box (cut off inside the answer: no answer) or one before it
            cut_off_at = start   # (ends the chain)
            break
        if chain and not (join_boxes and end <= chain[-1][0] and _joins_boxes(text[end:chain[-1][0]])):
            break  # an outer box around the chain (\boxed{\boxed{4}}) or real text in between
        chain.append((start, end, content))
    if chain:
        return _join_parts([content for _, _, content in reversed(chain)])
    if fallback_last_number:   # after a cut-off box, only what it holds: never a number it went on from
        numbers = _NUMBER_RE.findall(text[cut_off_at:])
        if numbers:
            return numbers[-1]
    return None


def unmatchable_gold(gold: str) -> str | None:
    """Why no response can ever score 1 against this gold answer (its problem would only ever score 0), or
    None. The test is the grader itself: a response that boxes the gold answer exactly as written,
    "\\boxed{gold}", must score 1 (compute_reward). The usual reasons are named: more than MAX_ANSWER_CHARS
    characters (is_equivalent refuses longer answers unread), braces that do not balance ("\\frac{1}{2": no
    \\boxed{} can hold them), an empty \\boxed{} ("\\boxed{\\boxed{}}"), nothing left once spacing and
    punctuation are cleaned off. data.py checks every gold answer when it loads a source."""
    if len(gold) > MAX_ANSWER_CHARS:
        return f"more than the grader reads ({MAX_ANSWER_CHARS} characters)"
    if not _braces_balance(gold):
        return "braces { } that do not balance, which no \\boxed{} can hold"
    inner = gold
    for _ in range(8):   # boxes inside boxes, unwrapped one at a time
        boxed = extract_answer(inner, join_boxes=False)
        if boxed is None or boxed == inner:
            break
        if not boxed.strip():
            return "an empty \\boxed{} that no response can match"
        inner = boxed
    if not _clean(_unmangle(gold)):
        return "nothing left once spacing and punctuation are cleaned off"
    if compute_reward("\\boxed{" + gold + "}", gold) != 1.0:
        return "a response that boxes it exactly scores 0 (the grader cannot read it back)"
    return None


def evaluates(answer: str) -> bool:
    """Whether the grader compares this answer with sympy at all: once normalised as is_equivalent normalises
    it, it passes the cheap guards (at most MAX_ANSWER_CHARS characters, bounded nesting, no numeric
    exponent tower, no power, factorial or binomial of a huge integer). An answer that fails them matches
    only a response spelling it identically (data.explosive_gold refuses such a gold answer)."""
    return _is_safe(_clean(_unmangle(answer)))


def _braces_balance(text: str) -> bool:
    """Every unescaped { closed by a later }, and no } before its {."""
    depth = 0
    for ch in re.sub(r"\\.", "", text):   # \{ and \} are literal braces
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _join_parts(parts: list[str]) -> str:
    """One answer from the contents of several boxes: "1, -2". A single box is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    distinct = {}  # insertion-ordered set
    for part in parts:
        part = _clean(part)
        if _plain_number(part) is not None:
            part = part.replace(",", "")  # "1,000" must not become two items of the list
        if part:
            distinct[part] = None
    distinct = list(distinct)
    if len(distinct) <= 1:
        return distinct[0] if distinct else parts[-1]
    return ", ".join(distinct)


# ---------------------------------------------------------------------------------------------------
# Cheap checks that need no sympy

# 1,234.5 / 12 / .5; thousands grouping starts with 1-9: "0,111" is not 111.
_PLAIN_NUMBER_RE = re.compile(r"-?(?:[1-9]\d{0,2}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_DIGITS = r"\d(?:,?\d){5,}"  # 6+ digits (thousands commas allowed)
_EXPLOSIVE_RES = [
    re.compile(r"\^\s*\{?\s*\(?\s*-?" + _DIGITS),                  # 2^{1000000}
    re.compile(_DIGITS + r"\s*\)?\s*!"),                            # 1000000!
    re.compile(r"\\[dt]?binom\s*\{?\s*" + _DIGITS),                 # \binom{1000000}{500000}
    re.compile(r"\^\s*\{?\s*\(?\s*\d+\s*\)?\s*\}?\s*\^"),          # 9^9^9, 9^{9}^{9}
]


_TRAILING_RE = re.compile(r"(?:\\[,;:]|\\q?quad|[\s.,;:])+$")  # "30^\circ." does not parse


# Thousands separators that are never list commas: MATH's "11,\! 111,\! 100" (a space may follow the
# \!) and LaTeX's "1{,}000", before a group of exactly 3 digits.
_MARKED_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,\s*\\!|\{,\})\s*(?=\d{3}(?!\d))")
# A whole answer grouped by (thin) spaces, "1 000" or "1\,000\,000" (only a whole answer: inside an
# expression a space is no separator).
_SPACE_SEPARATOR = r"(?:\s|\\,|\\ |~)"
_SPACED_NUMBER_RE = re.compile(r"-?[1-9]\d{0,2}(?:" + _SPACE_SEPARATOR + r"\d{3})+(?:\.\d+)?")


def _clean(answer: str) -> str:
    """Normalise what math-verify trips on: surrounding $, trailing punctuation/spacing, thousands written
    29,\\!322 / 11,\\! 111 / 1{,}000 / 1 000, other \\! spacing."""
    answer = _MARKED_THOUSANDS_RE.sub("", answer)
    answer = answer.replace("\\!", "").strip()
    while len(answer) >= 2 and answer.startswith("$") and answer.endswith("$"):
        answer = answer[1:-1].strip()
    answer = _TRAILING_RE.sub("", answer)
    if _SPACED_NUMBER_RE.fullmatch(answer):
        answer = re.sub(_SPACE_SEPARATOR, "", answer)
    return answer


# Sizing commands around brackets (\left( ... \right), \big( ...): dropped before reading exponents.
_SIZING_RE = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])")
# Commands that keep an expression numeric (a tower of them is still a number to compute).
_NUMERIC_COMMANDS_RE = re.compile(r"\\(?:[dt]?frac|cdot|times|sqrt|div)(?![A-Za-z])")


def _exponent_args(answer: str) -> list[str]:
    """The argument of every ^ : a balanced group opened by {, ( or [ (any of them closing it: \\left and
    \\right dropped first), or a single token."""
    answer = _SIZING_RE.sub("", answer)
    args = []
    for m in re.finditer(r"\^\s*", answer):
        j = m.end()
        if j < len(answer) and answer[j] in "{([":
            depth, k = 0, j
            while k < len(answer):
                depth += 1 if answer[k] in "{([" else -1 if answer[k] in "})]" else 0
                if depth == 0:
                    break
                k += 1
            args.append(answer[j + 1:k])
        else:
            args.append(answer[j:j + 1])
    return args


def _numeric_tower(arg: str) -> bool:
    """An exponent that is itself a power of numbers: a digit raised to a digit (9^{9^9}), or any power with
    no letter in it ((1+8)^{(1+8)^{(1+8)}}, \\left(9\\right)^{...}): sympy evaluates those exactly, and
    9^(9^9) has 370 million digits. e^{x^2} and 2^{2^n} stay symbolic."""
    if re.search(r"\d\s*[})\]]?\s*\^\s*[{(\[]?\s*\(?\s*\d", arg):
        return True
    return "^" in arg and not re.search(r"[A-Za-z]", _NUMERIC_COMMANDS_RE.sub("", _SIZING_RE.sub("", arg)))


def _is_safe(answer: str) -> bool:
    """False for inputs no real answer looks like and that can make sympy run for a long time."""
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    unescaped = re.sub(r"\\.", "", answer)  # escaped \{ \} are literal braces
    braces = nesting = 0
    for ch in unescaped:
        braces += {"{": 1, "}": -1}.get(ch, 0)
        # Brackets need not balance ("[1,2)"), but their nesting is bounded like that of braces.
        nesting += 1 if ch in "{([" else -1 if ch in "})]" else 0
        if braces < 0 or max(braces, nesting) > MAX_NESTING:
            return False
    if braces != 0:
        return False
    if any(r.search(answer) for r in _EXPLOSIVE_RES):
        return False
    # Numeric towers like 9^{9^{9}} or (1+8)^{(1+8)^{(1+8)}}: a power of numbers inside an exponent.
    # e^{x^2} and 2^{2^n} stay allowed (sympy keeps them symbolic).
    return not any(_numeric_tower(arg) for arg in _exponent_args(answer))


# Units. math-verify drops a unit from each side before comparing (so "5 m" = "5 cm"), as the MATH grader
# drops a "\text{ unit}". Where both sides name a unit this table knows and the units differ (or their
# powers: cm for cm^2), the answer is wrong; a unit on one side only stays accepted ("5 \text{ cm}" = 5), and
# so does a word the table does not know ("5 \text{ apples}", "\text{ square units}", "miles per hour").
# Units are compared, never converted: "1 \text{ foot}" is wrong for "12 \text{ inches}", as for the peers.
_UNIT_SPELLINGS = {   # canonical name: spellings (a plural s / es is read too; words of 4+ letters any case)
    "mm": ("mm", "millimeter", "millimetre"), "cm": ("cm", "centimeter", "centimetre"),
    "m": ("m", "meter", "metre"), "km": ("km", "kilometer", "kilometre"), "in": ("in", "inch"),
    "ft": ("ft", "foot", "feet"), "yd": ("yd", "yard"), "mi": ("mi", "mile"),
    "mg": ("mg", "milligram"), "g": ("g", "gram", "gramme"), "kg": ("kg", "kilogram"),
    "lb": ("lb", "lbs", "pound"), "oz": ("oz", "ounce"), "ton": ("ton",), "tonne": ("tonne",),
    "s": ("s", "sec", "second"), "min": ("min", "minute"), "h": ("h", "hr", "hour"), "day": ("day",),
    "week": ("week", "wk"), "month": ("month",), "year": ("year", "yr"),
    "ml": ("ml", "mL", "milliliter", "millilitre"), "l": ("l", "L", "liter", "litre"),
    "gal": ("gal", "gallon"), "cup": ("cup",), "pint": ("pint",), "quart": ("quart", "qt"),
    "acre": ("acre",), "hectare": ("hectare",),
    "dollar": ("dollar", "USD"), "cent": ("cent", "¢"), "euro": ("euro", "€"),
    "degree": ("degree", "deg", "°"), "radian": ("radian", "rad"), "mph": ("mph",), "kph": ("kph",),
}
_UNIT_OF = {spelling: name for name, spellings in _UNIT_SPELLINGS.items() for spelling in spellings}
# The unit at the end of an answer: \text{...} (\mathrm, \mbox, \textbf, ...: a text-mode wrapper; not
# \mathbf or \mathit, which hold a variable), words after a space, or a degree sign;
# then a power ^2, ^{3}, ².
_UNIT_TAIL_RE = re.compile(
    r"(?:\\(?:text|textrm|textnormal|textit|textbf|textsf|mathrm|mbox|rm)\s*\{(?P<text>[^{}]*)\}"
    r"|(?<=[\s,~])(?P<words>[A-Za-z]+(?:\.?[ \t]+[A-Za-z]+)?\.?|[°¢€])"
    r"|(?P<degree>\^\s*\{?\s*\\circ\s*\}?|°))"
    r"\s*(?:\^\s*\{?\s*(?P<power>[23])\s*\}?|(?P<sup>[²³]))?$")
# What may come before a unit: a number ("5", "1,000", "2.5", "\frac{1}{2}", "36\pi", "5\sqrt{2}", "10^3"),
# spacing, and a dollar sign in front.
_UNIT_VALUE_RE = re.compile(r"(?P<dollar>\\\$|\$)?\s*(?:[-+\d.,{}()/*^\s~]|\\(?:pi|sqrt|[dt]?frac|cdot|times)"
                            r"(?![A-Za-z])|\\[,;:! ])*")


def _unit_name(word: str) -> str | None:
    for spelling in (word, word[:-1] if word.endswith("s") else "", word[:-2] if word.endswith("es") else ""):
        name = _UNIT_OF.get(spelling) or (_UNIT_OF.get(spelling.lower()) if len(spelling) >= 4 else None)
        if name:
            return name
    return None


def _unit(answer: str) -> tuple[str, int] | None:
    """(unit, power) that a number answer names ("5 \\text{ cm}^2" -> ("cm", 2), "\\$5" -> ("dollar", 1),
    "30^\\circ" -> ("degree", 1)), or None: no unit, a word the table does not know, or not a number with a
    unit ("5m" may be 5 times m; only a space, \\text{} or \\mathrm{} set a unit apart)."""
    tail = _UNIT_TAIL_RE.search(answer)
    value = _UNIT_VALUE_RE.fullmatch(answer[:tail.start()] if tail else answer)
    if value is None or not re.search(r"\d|\\pi", value.group()):
        return None
    if tail is None:
        return ("dollar", 1) if value.group("dollar") else None
    power = int(tail.group("power") or {"²": "2", "³": "3"}.get(tail.group("sup"), "1"))
    if tail.group("degree"):
        return "degree", power
    # an empty \text{} matches with group "text" == "": no unit, not the "words" branch (which is None then)
    text = tail.group("text") if tail.group("text") is not None else tail.group("words")
    words = text.replace(".", " ").split()
    if words and words[0].lower() in ("square", "sq", "cubic", "cu"):
        power *= 2 if words[0].lower() in ("square", "sq") else 3
        words = words[1:]
    name = _unit_name(words[0]) if len(words) == 1 else None
    return (name, power) if name else None


def _units_differ(pred: str, gold: str) -> bool:
    """Both answers name a unit (_unit) and not the same one: "5 m" for "5 cm", "5 \\text{ cm}" for "5 \\text{
    cm}^2", "3 \\text{ hours}" for "3 \\text{ days}"."""
    pred_unit = _unit(pred)
    if pred_unit is None:
        return False
    gold_unit = _unit(gold)
    return gold_unit is not None and gold_unit != pred_unit


def _plain_number(answer: str) -> Fraction | None:
    # the length first: Python refuses to convert more than 4,300 digits (ValueError), and _join_parts reads
    # box contents of any length (the sweep found "\boxed{1}, \boxed{111...1}" raising, issue 40)
    if len(answer) <= MAX_ANSWER_CHARS and _PLAIN_NUMBER_RE.fullmatch(answer):
        return Fraction(answer.replace(",", ""))
    return None


# ---------------------------------------------------------------------------------------------------
# math-verify, in this process

_mv = None  # (parse, verify) once imported


def load_grader() -> None:
    """Load math-verify now (about a second; 5-6 s beside two busy processes on 2 cores). TIMEOUT_SECONDS
    bounds a check, not this one-time import: the first check of a process that did not call it pays the
    import first (a run's first step does, once)."""
    _load_math_verify()


def _load_math_verify():
    """Import math-verify and warm it up outside any alarm: an interrupted import would leave it broken."""
    global _mv
    if _mv is None:
        import math_verify
        import math_verify.grader
        import math_verify.parser
        # We bound the time ourselves; silence its once-per-process "timeout is disabled" warning.
        math_verify.grader.TIMEOUT_WARNING_SHOWN = True
        math_verify.parser.TIMEOUT_WARNING_SHOWN = True
        math_verify.verify(math_verify.parse("\\boxed{1}", parsing_timeout=None),
                           math_verify.parse("\\boxed{\\frac{2}{2}}", parsing_timeout=None),
                           timeout_seconds=None)
        _mv = (math_verify.parse, math_verify.verify)
    return _mv


# A comma-grouped integer inside an expression ("\frac{1}{29,322}"); a group never starts with 0.
_THOUSANDS_GROUPED_RE = re.compile(r"(?<![\d.,])[1-9]\d{0,2}(?:,\d{3})+(?!\d|,\d)")


@functools.lru_cache(maxsize=4096)
def _parse(answer: str):
    """math-verify's parse (a sympy object plus the string) of a bare answer, wrapped as it expects.

    \\boxed{} parses every MATH gold answer; $...$ rescues e.g. '43_5'; thousands commas inside a
    fraction ('\\frac{1}{29,322}') only parse once removed, which is tried last so that a pair like
    (1,234) keeps its meaning.
    """
    parse, _ = _mv
    first = parse("\\boxed{" + answer + "}", parsing_timeout=None)
    retries = ["$" + answer + "$"]
    if "," in answer:
        retries.append("\\boxed{" + _THOUSANDS_GROUPED_RE.sub(lambda m: m.group().replace(",", ""), answer)
                       + "}")
    parsed = first
    for wrapped in retries:
        if any(not isinstance(p, str) for p in parsed):
            return parsed
        parsed = parse(wrapped, parsing_timeout=None)
    return parsed if any(not isinstance(p, str) for p in parsed) else first


@functools.lru_cache(maxsize=8192)
def _math_verify_equal(pred: str, gold: str) -> bool:
    _, verify = _mv
    gold_parsed, pred_parsed = _parse(gold), _parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    # verify(gold, target) is not symmetric: gold first.
    return bool(verify(gold_parsed, pred_parsed, strict=True, timeout_seconds=None))


class _Timeout(BaseException):
    """BaseException so that math-verify's and sympy's `except Exception` do not swallow it."""


def _raise_timeout(signum, frame):
    raise _Timeout()


def _drop_timeouts(hook):
    """sys.unraisablehook while the alarm is armed: an alarm that lands in a finaliser (__del__, a weakref
    callback: sympy and antlr objects freed mid-check) cannot stop the check there, and Python would print it
    as "Exception ignored in ..." (under pytest: an error of the test). Drop it: the timer re-fires 0.1 s
    later and stops the check itself. Any other unraisable exception goes to the hook as before."""
    def drop(unraisable):
        if not (isinstance(unraisable.exc_type, type) and issubclass(unraisable.exc_type, _Timeout)):
            hook(unraisable)
    return drop


TIMED_OUT = object()   # what call_with_alarm returns when the bound stopped the call


def call_with_alarm(function, timeout: float):
    """function() with a hard wall-clock bound of `timeout` seconds: its value, or TIMED_OUT. Main thread
    only (SIGALRM). The alarm re-fires every 0.1 s until disarmed and raises a BaseException, so neither an
    `except Exception` in a library nor an alarm landing in a finaliser (dropped: _drop_timeouts) lets the
    call run on; math-verify's own timeout (signal.alarm, once, an Exception) can be lost either way."""
    old_handler = signal.signal(signal.SIGALRM, _raise_timeout)
    old_hook, sys.unraisablehook = sys.unraisablehook, _drop_timeouts(sys.unraisablehook)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, max(timeout, 0.01), 0.1)  # re-fires until disarmed
            return function()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:  # also catches an alarm that lands inside the inner finally
        return TIMED_OUT
    finally:
        signal.signal(signal.SIGALRM, old_handler)
        sys.unraisablehook = old_hook


def _verify_with_alarm(pred: str, gold: str, timeout: float) -> bool | None:
    """math-verify under SIGALRM, None on timeout; main thread only."""
    _load_math_verify()
    try:
        verdict = call_with_alarm(lambda: _math_verify_equal(pred, gold), timeout)
    except Exception:  # a bug in a parser must cost one reward, not the training run
        return False
    return None if verdict is TIMED_OUT else verdict


# ---------------------------------------------------------------------------------------------------
# math-verify, in a helper process (for callers off the main thread)

# Load this file by path (the helper must not depend on the caller's sys.path or package name) and
# drop the current directory from sys.path so a project file cannot shadow a library module.
_HELPER_CODE = (
    "import sys, importlib.util\n"
    "sys.path = [p for p in sys.path if p not in ('', '.')]\n"
    "spec = importlib.util.spec_from_file_location('_reward_helper', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._serve()\n"
)


def _serve():
    """Helper process loop: one JSON [pred, gold, seconds] per line in, '1', '0' or 't' (timeout) out."""
    _load_math_verify()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        pred, gold, seconds = json.loads(line)
        verdict = _verify_with_alarm(pred, gold, seconds)
        sys.stdout.write("t\n" if verdict is None else "1\n" if verdict else "0\n")
        sys.stdout.flush()


class _Helper:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HELPER_CODE, os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        self.poller = select.poll()  # not select.select: that fails on fd numbers above 1024
        self.poller.register(self.proc.stdout, select.POLLIN)
        if self._readline(HELPER_STARTUP_SECONDS) != b"ready":
            self.kill()
            raise RuntimeError("reward.py: the grading helper process did not start")

    def _readline(self, seconds: float) -> bytes | None:
        # Unbuffered pipe and one outstanding request: poll() sees exactly the reply we wait for.
        if not self.poller.poll(seconds * 1000):
            return None
        return self.proc.stdout.readline().strip()  # b"" if the helper died (POLLHUP)

    def ask(self, pred: str, gold: str, timeout: float) -> bool | str | None:
        """The helper's verdict, "timeout" if its own alarm fired, None if it did not answer in time
        (or died)."""
        try:
            # The helper's own alarm fires a little earlier, so that usually it answers and survives.
            self.proc.stdin.write((json.dumps([pred, gold, 0.85 * timeout]) + "\n").encode())
            reply = self._readline(timeout)
        except (OSError, ValueError):
            return None
        return {b"1": True, b"0": False, b"t": "timeout"}.get(reply)

    def kill(self):
        try:
            self.proc.kill()
            self.proc.wait(timeout=5)
        except Exception:
            pass


_helpers_lock = threading.Lock()
_helpers_free = threading.BoundedSemaphore(MAX_HELPERS)
_idle_helpers: list[_Helper] = []


def _verify_in_helper(pred: str, gold: str, timeout: float) -> bool | None:
    """The verdict of an idle (or new) helper process; None if the helper's own alarm fired."""
    with _helpers_free:
        with _helpers_lock:
            helper = _idle_helpers.pop() if _idle_helpers else None
        if helper is None or helper.proc.poll() is not None:
            helper = _Helper()
        verdict = helper.ask(pred, gold, timeout)
        if verdict is None:  # no answer in time, or dead: kill it, the next caller starts a fresh one
            helper.kill()
            return False  # not remembered as a timeout: a stuck helper says nothing about the answer
        with _helpers_lock:
            _idle_helpers.append(helper)
        return None if verdict == "timeout" else verdict


def _forget_helpers_after_fork():
    # A forked child shares its parent's pipes: never talk to (or kill) the parent's helpers.
    global _helpers_lock, _helpers_free, _idle_helpers
    _helpers_lock = threading.Lock()
    _helpers_free = threading.BoundedSemaphore(MAX_HELPERS)
    _idle_helpers = []


def _close_helpers():
    for helper in _idle_helpers:
        helper.kill()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_helpers_after_fork)
atexit.register(_close_helpers)


# ---------------------------------------------------------------------------------------------------
# Public API

# (pred, gold) pairs that ran out of time. A collapsing policy repeats the same degenerate answer
# across a whole group; paying the timeout once per pair, not once per response, keeps a step bounded.
_timed_out: set[tuple[str, str]] = set()


def _verify_bounded(pred: str, gold: str, timeout: float) -> bool:
    """math-verify with a hard wall-clock bound, from any thread."""
    if (pred, gold) in _timed_out:
        return False
    on_main_thread = threading.current_thread() is threading.main_thread()
    # Do not fight another user of SIGALRM (a pending timer of the caller): use a helper then.
    if on_main_thread and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
        verdict = _verify_with_alarm(pred, gold, timeout)
    else:
        verdict = _verify_in_helper(pred, gold, timeout)
    if verdict is None:
        if len(_timed_out) > 10000:
            _timed_out.clear()
        _timed_out.add((pred, gold))
        return False
    return verdict


def is_equivalent(pred: str, gold: str) -> bool:
    """True iff the bare answer `pred` equals the bare answer `gold` (strict math-verify)."""
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False  # checked first: everything below is at least linear in the length
    pred, gold = _clean(_unmangle(pred)), _clean(_unmangle(gold))
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    if not (_is_safe(pred) and _is_safe(gold)) or _units_differ(pred, gold):
        return False   # _units_differ: "5 m" for "5 cm" (math-verify drops both units)
    pred_number, gold_number = _plain_number(pred), _plain_number(gold)
    if pred_number is not None and gold_number is not None:
        return pred_number == gold_number  # exact: 12 != 12.0000001
    return _verify_bounded(pred, gold, TIMEOUT_SECONDS)


def compute_reward(response: str, gold: str, fallback_last_number: bool = False) -> float:
    """The paper's binary verifiable reward: 1.0 if the final (last boxed) answer is correct, else 0.0."""
    pred = extract_answer(response, fallback_last_number=fallback_last_number)
    return 1.0 if pred is not None and is_equivalent(pred, gold) else 0.0
