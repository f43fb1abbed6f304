"""Real model outputs through the grader (issue 40): every response of tests/fixtures/corpus_smollm2.jsonl.gz,
what the embedded SmolLM2-135M wrote for the demo's problems and MATH500 at the demo's sampling settings with
several seeds (made by bench/sample_corpus.py: its header says how), graded as training and evaluation grade
it. No response may raise or score anything but 0.0 / 1.0, and where an independent reading exists the grade
must agree with it."""
import gzip
import json
import re
from pathlib import Path

import pytest

import mcq
import reward

CORPUS = Path(__file__).parent / "fixtures" / "corpus_smollm2.jsonl.gz"
INTEGER = re.compile(r"-?\d+")
ONE_SIMPLE_BOX = re.compile(r"\\boxed\{([^{}\\]*)\}")   # a box holding no braces and no command


@pytest.fixture(scope="module")
def corpus():
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        header, *rows = [json.loads(line) for line in f]
    assert header["responses"] == len(rows) and len(header["seeds"]) >= 2
    return rows


def test_every_real_response_grades_to_0_or_1_and_agrees_with_an_independent_reading(corpus):
    checked = {"integer": 0, "no box": 0, "one simple box": 0}
    for row in corpus:
        response, gold = row["response"], row["gold"]
        where = f"{row['source']} problem {row['index']} seed {row['seed']} sample {row['sample']}"
        answer = reward.extract_answer(response)
        assert answer is None or isinstance(answer, str), where
        verdict = reward.compute_reward(response, gold)
        assert type(verdict) is float and verdict in (0.0, 1.0), where
        letter = mcq.extract_choice(response, 4)
        assert letter is None or letter in "ABCD", where
        # Independent readings, each for the responses where it is unambiguous:
        if "box" not in response and "oxed" not in response:   # no box: no answer (no fallback in the demo)
            checked["no box"] += 1
            assert answer is None and verdict == 0.0, where
        boxes = ONE_SIMPLE_BOX.findall(response)
        if response.count("box") == 1 and len(boxes) == 1:   # one box with plain content: that content
            checked["one simple box"] += 1
            assert answer == boxes[0].strip(), where
            if INTEGER.fullmatch(answer) and INTEGER.fullmatch(gold):   # integers compared as integers
                checked["integer"] += 1
                assert verdict == float(int(answer) == int(gold)), where
    # each reading covered a real share of the corpus (else the test checks nothing)
    assert min(checked.values()) >= len(corpus) // 20, checked
