"""mcq.py — the paper's out-of-domain multiple-choice benchmarks
(App. F "Generalization to Out-Of-Domain Tasks").

    python evaluate.py --model runs/paper --bench gpqa mmlu-pro  # avg@8 on both, as Table "OOD results"

  gpqa       GPQA-Diamond: 198 questions, 4 options; the correct answer and the three incorrect ones are
             shuffled per question with a seeded RNG (the dataset always lists the correct answer first).
  mmlu-pro   MMLU-Pro stratified to 500 of its 12,032 test questions, up to 10 options: each category keeps
             its share (largest-remainder rounding), questions drawn within a category with a seeded RNG,
             kept in dataset order.
The paper reports avg@8 (evaluate.PAPER_K) at its sampling settings (temperature 1.0, up to 2048 new tokens).
The paper prints no prompt: the question and lettered options go through data.format_prompt like a math
problem, asking for the letter in \\boxed{}; a response is graded exactly — its letter is the content of the
last \\boxed{} ("B", "(B)", "\\text{B}", "B) ..."), else the last "answer is (B)" — correct iff it is the
gold letter.

Sources: a local file first — $DATPO_DATA_DIR or data/benchmarks/, `gpqa.jsonl` / `mmlu-pro.jsonl`, one row
a line in the HF dataset's own fields (GPQA: Question, Correct Answer, Incorrect Answer 1-3; MMLU-Pro:
question, options, answer, category), e.g. written by `load_dataset(...).to_json(path)` — else the HF hub:
`Idavidrein/gpqa` config `gpqa_diamond` (gated: accept its terms on the dataset page, then
`huggingface-cli login` or export HF_TOKEN) and `TIGER-Lab/MMLU-Pro` split test.
"""
from __future__ import annotations

import os
import random
import re

from reward import extract_answer, last_box_cut_off

LETTERS = "ABCDEFGHIJ"
GPQA_SIZE = 198
MMLU_PRO_SIZE = 500
SEED = 0
HUB = {  # name -> (HF dataset id, config, split)
    "gpqa": ("Idavidrein/gpqa", "gpqa_diamond", "train"),
    "mmlu-pro": ("TIGER-Lab/MMLU-Pro", None, "test"),
}
INSTRUCTION = "Answer with the letter of the correct option ({letters})."


# --------------------------------------------------------------------------------------------------------
# Prompt and grading
# --------------------------------------------------------------------------------------------------------
def format_question(question: str, options: list[str]) -> str:
    """The question, its options as "(A) ...", one a line, and which letters are valid."""
    if not 2 <= len(options) <= len(LETTERS):
        raise ValueError(f"expected 2 to {len(LETTERS)} options, got {len(options)}")
    lines = [f"({LETTERS[i]}) {option}" for i, option in enumerate(options)]
    letters = ", ".join(LETTERS[:len(options) - 1]) + f" or {LETTERS[len(options) - 1]}"
    return f"{question.strip()}\n\n" + "\n".join(lines) + "\n\n" + INSTRUCTION.format(letters=letters)


_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\{([^{}]*)\}")
_BOXED_LETTER = re.compile(r"^\(?([A-J])\)?(?:[.:)]?(?:\s.*)?)?$", re.DOTALL)
_ANSWER_IS = re.compile(r"(?i:answer is)\s*:?\s*\**\(?([A-J])\)?(?![A-Za-z0-9])")
# A second letter right after the first: "A or B", "(A), (C)", "A/B", "A and B" (in a box); "answer is (A) or
# (B)" (in prose, where only "or" and "/" join letters: "the answer is B, C is wrong" names one).
_ANOTHER_LETTER = r"\s*\**\(?[A-J]\)?\**(?![A-Za-z0-9])"
_BOXED_SECOND_LETTER = re.compile(r"\)?[.:]?\s*(?:[,;/&]|\\&|\bor\b|\band\b|\\q?quad|\\lor|\\vee)"
                                  + _ANOTHER_LETTER)
_PROSE_SECOND_LETTER = re.compile(r"\s*(?:/|\bor\b)" + _ANOTHER_LETTER)


def extract_choice(text: str, n_options: int = len(LETTERS)) -> str | None:
    """The chosen letter: the content of the final \\boxed{} when it is a letter ("B", "(B)", "\\text{B}",
    "B) 42"), else the last "answer is (B)" / "answer is B"; None when neither names one of the first
    n_options letters. An answer naming two letters ("\\boxed{A or B}", "\\boxed{A} or \\boxed{B}", "the
    answer is (A) or (B)") names none, and so does a response cut off inside its last \\boxed{ (an earlier
    "answer is" is not its answer)."""
    valid = LETTERS[:n_options]
    if last_box_cut_off(text):
        return None
    boxed = extract_answer(text)   # the final \\boxed{}, with boxes joined to it ("\\boxed{A} or \\boxed{B}")
    if boxed is not None:
        content = _WRAPPER.sub(r"\1", boxed).strip().strip("$").strip()
        match = _BOXED_LETTER.match(content)
        if match and _BOXED_SECOND_LETTER.match(content, match.end(1)):
            return None
        if match and match.group(1) in valid:
            return match.group(1)
    found = [m for m in _ANSWER_IS.finditer(text) if m.group(1) in valid]
    if not found or _PROSE_SECOND_LETTER.match(text, found[-1].end()):
        return None
    return found[-1].group(1)


def grade(response: str, problem: dict) -> tuple[str | None, bool]:
    """(extracted letter, correct) of a response to a multiple-choice problem: exact letter match."""
    letter = extract_choice(response, len(problem["choices"]))
    return letter, letter is not None and letter == problem["answer"]


def is_multiple_choice(problem: dict) -> bool:
    return "choices" in problem


# --------------------------------------------------------------------------------------------------------
# Rows → problems
# --------------------------------------------------------------------------------------------------------
def _field(row: dict, name: str, where: str):
    value = row.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{where}: missing or empty field {name!r}; fields present: {sorted(row)}")
    return value


def _as_text(value, what: str, where: str) -> str:
    """A text (a number is written as text), stripped; anything else is one line naming the row."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: {what} must be text, got {type(value).__name__}")
    return str(value).strip()


def _text(row: dict, name: str, where: str) -> str:
    return _as_text(_field(row, name, where), f"field {name!r}", where)


def _options(row: dict, where: str) -> list[str]:
    """MMLU-Pro's `options`: a list of 2 to 10 texts."""
    options = _field(row, "options", where)
    if not isinstance(options, (list, tuple)) or not 2 <= len(options) <= len(LETTERS):
        shown = f"a list of {len(options)}" if isinstance(options, (list, tuple)) else type(options).__name__
        raise ValueError(f"{where}: field 'options' must be a list of 2 to {len(LETTERS)} options, got "
                         f"{shown}")
    return [_as_text(o, f"option {LETTERS[i]}", where) for i, o in enumerate(options)]


def _object(row, where: str, fields: str) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with {fields}, got {type(row).__name__}")
    return row


def _problem(question: str, options: list[str], gold: int, **extra) -> dict:
    return {"problem": format_question(question, options), "answer": LETTERS[gold], "level": None,
            "choices": options, **extra}


def gpqa_problems(rows, seed: int = SEED) -> list[dict]:
    """GPQA rows (where, row) → problems, options shuffled per question by one Random(seed) in row order."""
    rng = random.Random(seed)
    out = []
    for where, row in rows:
        row = _object(row, where, "Question, Correct Answer and Incorrect Answer 1-3")
        options = [_text(row, name, where) for name in
                   ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")]
        order = list(range(4))
        rng.shuffle(order)
        out.append(_problem(_text(row, "Question", where), [options[i] for i in order], order.index(0),
                            category=row.get("High-level domain")))
    return out


def mmlu_pro_problem(where: str, row: dict) -> dict:
    row = _object(row, where, "question, options, answer and category")
    options = _options(row, where)
    answer = _text(row, "answer", where)
    if answer not in LETTERS[:len(options)]:
        raise ValueError(f"{where}: answer {answer!r} is not one of the {len(options)} option letters "
                         f"{LETTERS[:len(options)]}")
    return _problem(_text(row, "question", where), options, LETTERS.index(answer),
                    category=_text(row, "category", where))


def stratified_indices(categories: list[str], n: int, seed: int = SEED) -> list[int]:
    """n indices keeping each category's share of `categories` (App. F, Fig. "MMLU-Pro distribution").

    Quotas n·share are rounded by largest remainder (ties: the larger category, then its name), so they sum to
    n; each category's quota is drawn with Random(seed) from its indices; the result is in index order."""
    if not 0 <= n <= len(categories):
        raise ValueError(f"cannot draw {n} of {len(categories)} questions")
    by_cat: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        by_cat.setdefault(c, []).append(i)
    exact = {c: n * len(ix) / len(categories) for c, ix in by_cat.items()}
    quota = {c: int(q) for c, q in exact.items()}
    for c in sorted(by_cat,
                    key=lambda c: (-(exact[c] - quota[c]), -len(by_cat[c]), c))[:n - sum(quota.values())]:
        quota[c] += 1
    rng = random.Random(seed)
    chosen = [i for c in sorted(by_cat) for i in rng.sample(by_cat[c], quota[c])]
    return sorted(chosen)


# --------------------------------------------------------------------------------------------------------
# From the dataset's rows to problems (data.load_multiple_choice reads them: a local file or the hub)
# --------------------------------------------------------------------------------------------------------
def hub_hint(name: str, path: str) -> str:
    """What to do when the hub cannot serve `name` (data.load_multiple_choice reads the rows)."""
    hint = (f" Offline, supply {path} (one JSON object a line with the HF dataset's fields), or point "
            f"DATPO_DATA_DIR at a folder holding {os.path.basename(path)}.")
    if name == "gpqa":
        hint += (" Idavidrein/gpqa is gated: accept its terms at "
                 "https://huggingface.co/datasets/Idavidrein/gpqa, then run `huggingface-cli login` "
                 "(or export HF_TOKEN=hf_...).")
    return hint


def problems(name: str, rows: list, seed: int = SEED) -> list[dict]:
    """The problems of "gpqa" (198) or "mmlu-pro" (500 stratified) from the dataset's (where, row) pairs; see
    the module docstring."""
    if name == "gpqa":
        picked = gpqa_problems(rows, seed)
        if len(picked) != GPQA_SIZE:
            print(f"note: gpqa: {len(picked)} questions, GPQA-Diamond has {GPQA_SIZE}")
        return picked
    picked = [mmlu_pro_problem(where, row) for where, row in rows]
    if len(picked) <= MMLU_PRO_SIZE:
        return picked      # already a subset (e.g. a local file of the 500)
    return [picked[i] for i in stratified_indices([p["category"] for p in picked], MMLU_PRO_SIZE, seed)]
