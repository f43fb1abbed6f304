"""mcq.py: GPQA-Diamond / MMLU-Pro from local fixture files (the hub's own fields), seeded option shuffling,
stratified sampling by hand, exact letter extraction, and `evaluate.py --bench gpqa mmlu-pro` end to end."""
import collections
import json

import pytest

import data
import evaluate as E
import mcq


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _gpqa_rows(n):
    return [{"Question": f"Which value is right in case {i}?", "Correct Answer": f"right {i}",
             "Incorrect Answer 1": f"wrong a{i}", "Incorrect Answer 2": f"wrong b{i}",
             "Incorrect Answer 3": f"wrong c{i}",
             "High-level domain": ["Physics", "Chemistry", "Biology"][i % 3]} for i in range(n)]


CATEGORIES = {"math": 30, "law": 15, "physics": 9, "other": 6}     # 60 questions


def _mmlu_rows(scale=1):
    rows = []
    for cat, count in CATEGORIES.items():
        for j in range(count * scale):
            options = [f"{cat} option {k}" for k in range(10 if j % 2 else 7)]
            rows.append({"question_id": len(rows), "question": f"{cat} question {j}?", "options": options,
                         "answer": "ABCDEFG"[j % 7], "answer_index": j % 7, "category": cat})
    return rows


@pytest.mark.parametrize("text, n, letter", [
    (r"so the answer is \boxed{B}", 4, "B"),
    (r"\boxed{(C)}", 4, "C"),
    (r"\boxed{\text{D}}", 4, "D"),
    (r"\boxed{\textbf{(A)}}", 4, "A"),
    (r"\boxed{B) 42 kelvin}", 4, "B"),
    (r"$\boxed{A}$ then later \boxed{C}", 4, "C"),                  # the last box counts
    ("The answer is (D).", 4, "D"),
    ("the answer is B", 4, "B"),
    ("Answer is: (A) but wait, the answer is (C)", 4, "C"),         # the last statement counts
    (r"\boxed{42}. So the answer is (B)", 4, "B"),                  # a box without a letter: fall back
    (r"\boxed{E}", 4, None),                                       # only A-D exist in GPQA
    (r"\boxed{E}", 10, "E"),
    ("the answer is (b)", 4, None),                                # letters are exact: capitals only
    ("The answer is Avogadro's number", 4, None),                  # a word, not a letter
    (r"\boxed{AB}", 4, None),
    ("I think B is right", 4, None),                               # no box, no "answer is": nothing to grade
])
def test_extract_choice(text, n, letter):
    assert mcq.extract_choice(text, n) == letter


def test_format_question_lists_lettered_options():
    text = mcq.format_question(" Q? ", ["x", "y", "z", "w"])
    assert text == ("Q?\n\n(A) x\n(B) y\n(C) z\n(D) w\n\n"
                    "Answer with the letter of the correct option (A, B, C or D).")
    with pytest.raises(ValueError, match="2 to 10 options"):
        mcq.format_question("Q", ["only"])


def test_gpqa_shuffles_options_with_a_seed_and_keeps_the_gold_letter_on_the_right_answer():
    rows = [(f"gpqa.jsonl line {i + 1}", r) for i, r in enumerate(_gpqa_rows(198))]
    problems = mcq.gpqa_problems(rows, seed=0)
    assert len(problems) == 198
    for i, p in enumerate(problems):
        assert p["choices"][mcq.LETTERS.index(p["answer"])] == f"right {i}"
        assert sorted(p["choices"]) == sorted([f"right {i}", f"wrong a{i}", f"wrong b{i}", f"wrong c{i}"])
        assert f"({p['answer']}) right {i}" in p["problem"]
    letters = collections.Counter(p["answer"] for p in problems)
    assert set(letters) == set("ABCD") and min(letters.values()) >= 30      # shuffled, not always (A)
    assert mcq.gpqa_problems(rows, seed=0) == problems
    assert [p["answer"] for p in mcq.gpqa_problems(rows, seed=1)] != [p["answer"] for p in problems]


def test_stratified_indices_by_hand():
    cats = ["a"] * 50 + ["b"] * 30 + ["c"] * 20
    picked = mcq.stratified_indices(cats, 10, seed=0)
    assert collections.Counter(cats[i] for i in picked) == {"a": 5, "b": 3, "c": 2}
    # n = 7: exact quotas 3.5, 2.1, 1.4 → floors 3, 2, 1 (6); the largest remainder (a: .5) gets the 7th
    assert collections.Counter(cats[i] for i in mcq.stratified_indices(cats, 7, seed=0)) \
        == {"a": 4, "b": 2, "c": 1}
    assert picked == sorted(picked) and len(set(picked)) == 10
    assert (mcq.stratified_indices(cats, 10, seed=0) == picked
            and mcq.stratified_indices(cats, 10, seed=1) != picked)
    with pytest.raises(ValueError):
        mcq.stratified_indices(cats, 101)


def test_local_files_load_and_mmlu_pro_is_stratified_to_500(tmp_path, monkeypatch):
    monkeypatch.setenv("DATPO_DATA_DIR", str(tmp_path))
    _write(tmp_path / "gpqa.jsonl", _gpqa_rows(5))
    _write(tmp_path / "mmlu-pro.jsonl", _mmlu_rows(scale=20))             # 1,200 questions
    gpqa = data.load_problems("gpqa")
    assert len(gpqa) == 5 and all(len(p["choices"]) == 4 and p["answer"] in "ABCD" for p in gpqa)
    mmlu = data.load_problems("mmlu-pro")
    assert len(mmlu) == 500
    shares = collections.Counter(p["category"] for p in mmlu)
    for cat, count in CATEGORIES.items():
        assert abs(shares[cat] - 500 * count / 60) <= 1                  # each category keeps its share
    for p in mmlu:          # MMLU-Pro's options keep their order: the gold letter is the file's
        j = int(p["problem"].split(" question ")[1].split("?")[0])
        assert p["answer"] == "ABCDEFG"[j % 7]
    ten = next(p for p in mmlu if len(p["choices"]) == 10)
    assert "(J) " in ten["problem"] and "(A, B, C, D, E, F, G, H, I or J)" in ten["problem"]
    assert data.load_problems("mmlu-pro", limit=3) == mmlu[:3]


def test_bad_rows_and_missing_hub_are_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("DATPO_DATA_DIR", str(tmp_path))
    rows = _gpqa_rows(3)
    del rows[1]["Incorrect Answer 2"]
    _write(tmp_path / "gpqa.jsonl", rows)
    with pytest.raises(ValueError, match=r"gpqa.jsonl line 2: missing or empty field 'Incorrect Answer 2'"):
        data.load_problems("gpqa")
    bad = _mmlu_rows()[:2]
    bad[0]["answer"] = "H"          # 7 options: A-G
    _write(tmp_path / "mmlu-pro.jsonl", bad)
    with pytest.raises(ValueError,
                       match=r"mmlu-pro.jsonl line 1: answer 'H' is not one of the 7 option letters"):
        data.load_problems("mmlu-pro")
    (tmp_path / "gpqa.jsonl").unlink()
    monkeypatch.setattr(data, "hub_blocked", lambda *a, **k: "offline (test)")
    with pytest.raises(FileNotFoundError,
                       match=r"(?s)Idavidrein/gpqa.*gpqa_diamond.*gpqa.jsonl.*huggingface-cli login"):
        data.load_problems("gpqa")


# Rows the property test found (tests/test_model_text.py, issue 40): `options` not a list of 2 to 10 texts
# raised TypeError ('bool' object is not iterable) or an error naming no row, and a string was read as its
# letters; a row that is not an object, or a field that is a list, is one line naming the row too.
BAD_ROWS = [
    ("mmlu-pro", {"options": False}, "field 'options' must be a list of 2 to 10 options, got bool"),
    ("mmlu-pro", {"question": "q", "options": ["x"], "answer": "A", "category": "c"},
     "field 'options' must be a list of 2 to 10 options, got a list of 1"),
    ("mmlu-pro", {"question": "q", "options": "abcd", "answer": "A", "category": "c"},
     "field 'options' must be a list of 2 to 10 options, got str"),
    ("mmlu-pro", {"question": "q", "options": ["x", ["y"]], "answer": "A", "category": "c"},
     "option B must be text, got list"),
    ("mmlu-pro", [1, 2], "expected an object with question, options, answer and category, got list"),
    ("gpqa", {"Question": "q", "Correct Answer": "a", "Incorrect Answer 1": "b", "Incorrect Answer 2": "c",
              "Incorrect Answer 3": {"x": 1}}, "field 'Incorrect Answer 3' must be text, got dict"),
]


@pytest.mark.parametrize("name,row,why", BAD_ROWS)
def test_a_malformed_row_is_one_line_naming_it(name, row, why):
    with pytest.raises(ValueError) as err:
        mcq.problems(name, [(f"{name}.jsonl line 3", row)])
    assert str(err.value) == f"{name}.jsonl line 3: {why}"


def test_grading_and_majority_vote_on_letters():
    problem = mcq.gpqa_problems([("row 1", _gpqa_rows(1)[0])], seed=0)[0]
    gold = problem["answer"]
    other = next(x for x in "ABCD" if x != gold)
    assert E.grade(rf"\boxed{{{gold}}}", problem) == (gold, True)
    assert E.grade(f"the answer is ({other})", problem) == (other, False)
    assert E.grade("no idea", problem) == (None, False)
    records = [{"index": 0, "run": 0, "gold": gold, "answer": a, "correct": a == gold}
               for a in [other, gold, gold, None]]
    result = E.score_records(records, 4)
    assert (result["avg@k"], result["pass@k"], result["maj@k"]) == (0.5, 1.0, 1.0)


def test_cli_bench_gpqa_mmlu_pro(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DATPO_DATA_DIR", str(tmp_path))
    _write(tmp_path / "gpqa.jsonl", _gpqa_rows(3))
    _write(tmp_path / "mmlu-pro.jsonl", _mmlu_rows())
    out = tmp_path / "ev"
    E.main(["--preset", "tiny", "--bench", "gpqa", "mmlu-pro", "--limit", "2", "--k", "2",
            "--max_new_tokens", "4", "--out_dir", str(out)])
    summary = json.loads((out / "results.json").read_text())["benchmarks"]
    assert set(summary) == {"gpqa", "mmlu-pro"} and summary["gpqa"]["n_samples"] == 4
    records = [json.loads(x) for x in (out / "samples_gpqa.jsonl").read_text().splitlines()]
    for r in records:
        assert r["gold"] in "ABCD" and r["answer"] in (None, *"ABCD")
        assert r["correct"] == (r["answer"] == r["gold"])
    assert E.PAPER_K["gpqa"] == E.PAPER_K["mmlu-pro"] == 8  # avg@8 (App. F) when --k is not given
