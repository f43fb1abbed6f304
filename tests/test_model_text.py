"""Property tests (hypothesis) of every parser of text a model or a user wrote (issue 40): the grader
(reward.py), the multiple-choice letter (mcq.py), sentence and step spans (tree.py), data rows and `solution`
columns (data.py), the tree viewer (harness/viz.py). The text is generated from the pieces real responses are
made of (tests/model_text.py); each test asserts what must hold for ANY input: no exception, a result of the
right type, bounded time, and an invariant where there is one. Examples are derandomized (the same every run,
so the suite's time is fixed); bench/sweep_parsers.py runs the same strategies for 100k+ examples. A failure
found here gets a fix and a named regression test of its minimal example (in the module's own test file).
"""
import json
import os
import string
import time

import model_text as M
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import reward

# Fixed examples (derandomize), no example database written into the checkout, no per-example deadline (the
# machine is shared: time bounds are asserted below against the grader's own bound instead).
# DATPO_PROPERTY_SCALE=N runs N times the examples, random ones (a deeper look outside the suite).
SCALE = int(os.environ.get("DATPO_PROPERTY_SCALE", "1"))
PROPERTY = settings(derandomize=SCALE == 1, database=None, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


def examples(n: int) -> settings:
    """PROPERTY with n examples (n x DATPO_PROPERTY_SCALE)."""
    return settings(PROPERTY, max_examples=n * SCALE)


TIMEOUT = 0.5     # reward.TIMEOUT_SECONDS during these tests: an answer sympy chews on costs 0.5 s, not 3
SLACK = 1.5       # seconds on top of it (a loaded 2-core machine)


@pytest.fixture(autouse=True)
def _short_grading_bound(monkeypatch):
    monkeypatch.setattr(reward, "TIMEOUT_SECONDS", TIMEOUT)   # read at call time


def _bounded(function, *args, limit: float = TIMEOUT + SLACK):
    """function(*args), asserting that it ended within `limit` (the grader's bound). CPU seconds of this
    process, not wall seconds: a check that ran past its alarm burns CPU all the while (a loop, sympy, a
    regex), while a shared machine that descheduled the test must not fail it."""
    reward._timed_out.clear()   # every example pays its own bound
    start = time.process_time()
    result = function(*args)
    elapsed = time.process_time() - start
    assert elapsed < limit, f"{function.__name__} took {elapsed:.2f} CPU s on {args!r:.200}"
    return result


def _row_limit() -> float:
    """A data row's bound: math-verify reading a `solution` without a box (data.answer_in_solution), then two
    grader checks (unmatchable_gold, explosive_gold), each within the grader's bound."""
    return 3 * TIMEOUT + SLACK


# --------------------------------------------------------------------------------------------------------
# reward.py: the grader cannot raise, answers only 0.0 / 1.0, in bounded time
# --------------------------------------------------------------------------------------------------------
@examples(100)
@given(M.response(), st.booleans())
def test_extract_answer_of_any_response_is_a_string_or_none(text, fallback):
    answer = _bounded(reward.extract_answer, text, fallback)
    assert answer is None or isinstance(answer, str)
    assert isinstance(_bounded(reward.last_box_cut_off, text), bool)


@examples(80)
@given(M.answer(), M.gold())
def test_is_equivalent_of_any_pair_is_a_bool_in_bounded_time(pred, gold):
    assert type(_bounded(reward.is_equivalent, pred, gold)) is bool


@examples(100)
@given(M.response(), M.gold(), st.booleans())
def test_compute_reward_of_any_response_is_0_or_1_in_bounded_time(response, gold, fallback):
    verdict = _bounded(reward.compute_reward, response, gold, fallback)
    assert type(verdict) is float and verdict in (0.0, 1.0)
    # one reading of a response everywhere: the extracted answer is what gets graded (evaluate.py's maj@k)
    pred = reward.extract_answer(response, fallback_last_number=fallback)
    assert verdict == (1.0 if pred is not None and _bounded(reward.is_equivalent, pred, gold) else 0.0)


@examples(60)
@given(M.gold())
def test_unmatchable_gold_says_why_or_the_boxed_gold_scores_1(gold):
    why = _bounded(reward.unmatchable_gold, gold)
    assert why is None or isinstance(why, str) and why
    if why is None:   # data.py keeps this gold answer: a response that boxes it exactly must score 1
        assert reward.compute_reward("\\boxed{" + gold + "}", gold) == 1.0


# Properties with an independent answer: what the grader must say, computed another way.
_NO_BOX_TEXT = st.text(alphabet=string.ascii_letters + string.digits + " .,:;=+-()\n$", max_size=40)


@examples(80)
@given(_NO_BOX_TEXT, st.integers(-10 ** 15, 10 ** 15), _NO_BOX_TEXT, st.integers(-10 ** 15, 10 ** 15))
def test_a_boxed_integer_is_graded_as_an_integer(before, pred, after, gold):
    response = f"{before}\\boxed{{{pred}}}{after.replace('oxed', '')}"
    assert reward.compute_reward(response, str(gold)) == float(pred == gold)
    assert reward.compute_reward(response, f"{gold:,}") == float(pred == gold)   # thousands commas


# A box content that _match_braces reads as one balanced group: no box inside, no trailing backslash.
_BALANCED = M.answer(max_leaves=6).filter(lambda a: "box" not in reward._unmangle(a)
                                          and reward._braces_balance(a) and not a.rstrip().endswith("\\"))


@examples(80)
@given(_NO_BOX_TEXT, _BALANCED, _NO_BOX_TEXT.map(lambda t: "." + t))
def test_the_last_closed_box_is_the_answer(before, content, after):
    # "." + prose after the box: no connector, so no later box can join it; nothing after it is a box.
    text = f"{before.replace('oxed', '')} \\boxed{{{content}}}{after.replace('oxed', '')}"
    expected = reward._unmangle(content).strip()
    assert reward.extract_answer(text) == expected
    if expected:
        assert reward.extract_answer(text + " \\boxed{" + content) is None   # then cut off: no answer


_UNITS = st.sampled_from(sorted(reward._UNIT_OF))


@examples(80)
@given(st.integers(0, 10 ** 6), _UNITS, _UNITS, st.sampled_from(M.WRAPPERS[:7] + [" "]),
       st.sampled_from(["", " ", "  "]), st.booleans())
def test_two_units_agree_exactly_when_the_unit_table_says_so(n, unit1, unit2, wrapper, pad, empty):
    def spelled(unit):
        return f"{n} {unit}" if wrapper == " " else f"{n}{wrapper}{{{pad}{unit}}}"
    pred = f"{n}{wrapper}{{{pad}}}" if empty and wrapper != " " else spelled(unit1)   # \text{}: no unit
    named = not (empty and wrapper != " ")
    same = not named or reward._UNIT_OF[unit1] == reward._UNIT_OF[unit2]
    assert reward.is_equivalent(pred, spelled(unit2)) is same
    assert reward.is_equivalent(spelled(unit2), pred) is same


# --------------------------------------------------------------------------------------------------------
# mcq.py: the chosen letter
# --------------------------------------------------------------------------------------------------------
@examples(150)
@given(M.response(), st.integers(2, 10))
def test_extract_choice_of_any_response_is_a_valid_letter_or_none(text, n):
    import mcq

    letter = _bounded(mcq.extract_choice, text, n)
    assert letter is None or letter in mcq.LETTERS[:n]


@examples(60)
@given(_NO_BOX_TEXT, st.integers(0, 9), st.sampled_from(["{L}", "({L})", "\\text{{{L}}}", "\\textbf{{({L})}}",
                                                         "{L}) the option's text", "$ {L} $"]))
def test_a_boxed_valid_letter_is_the_choice(before, index, form):
    import mcq

    letter = mcq.LETTERS[index]
    text = f"{before.replace('oxed', '')} So \\boxed{{{form.format(L=letter)}}}."
    assert mcq.extract_choice(text, 10) == letter
    assert mcq.extract_choice(text, index) is None   # not one of the first `index` letters


@examples(80)
@given(st.sampled_from(["gpqa", "mmlu-pro"]), st.lists(M.mcq_row(), max_size=3))
def test_any_multiple_choice_rows_are_problems_or_one_value_error_naming_the_row(name, rows):
    import mcq

    where = [(f"{name}.jsonl line {n}", row) for n, row in enumerate(rows, 1)]
    try:
        problems = mcq.problems(name, where)
    except ValueError as err:
        assert str(err).startswith(f"{name}.jsonl line "), err
        return
    for p in problems:
        assert p["answer"] in mcq.LETTERS[:len(p["choices"])] and isinstance(p["problem"], str)


# --------------------------------------------------------------------------------------------------------
# tree.py: sentence and step spans partition the tokens, and rejoin to the text
# --------------------------------------------------------------------------------------------------------
@examples(100)
@given(M.response(), st.lists(st.integers(0, 4000), max_size=60))
def test_sentence_and_step_spans_partition_any_text(text, cuts):
    import tree

    offsets = M.offsets_of(text, cuts)
    for spans_of in (tree.sentence_spans, tree.step_spans):
        spans = _bounded(spans_of, text, offsets)
        assert M.partitions(spans, len(offsets)), (spans_of.__name__, spans)
        assert "".join(text[offsets[a][0]:offsets[b - 1][1]] for a, b in spans) == text
    masked = tree._MATH.sub(lambda m: "x" * len(m.group()), text)
    if masked.strip() and len(masked) < 2000:   # the sentences start where PySBD's own char_span says
        pysbd_starts = {span.start for span in tree._segmenter().segment(masked)}
        assert tree._sentence_starts(masked) == sorted(pysbd_starts | {0})


@examples(40)
@given(st.lists(st.integers(0, 49151), max_size=40))
def test_decode_with_offsets_covers_the_decoded_text(smollm_tokenizer, ids):
    import tree

    text, offsets = tree.decode_with_offsets(smollm_tokenizer, ids)
    assert text == smollm_tokenizer.decode(ids, skip_special_tokens=True) and len(offsets) == len(ids)
    assert all(0 <= a <= b <= len(text) for a, b in offsets)
    assert all(x[1] == y[0] for x, y in zip(offsets, offsets[1:]))
    assert not ids or offsets[-1][1] == len(text)
    for spans_of in (tree.sentence_spans, tree.step_spans):
        assert M.partitions(spans_of(text, offsets), len(ids))


# --------------------------------------------------------------------------------------------------------
# data.py: a row is a problem or one ValueError naming it
# --------------------------------------------------------------------------------------------------------
@examples(50)
@given(M.row())
def test_any_row_is_a_problem_or_a_value_error_naming_it(row):
    import data

    try:
        problem = _bounded(data.to_problem, row, "rows.jsonl line 7", limit=_row_limit())
    except ValueError as err:
        assert str(err).startswith("rows.jsonl line 7: ") and "\n" not in str(err).strip()
        return
    assert isinstance(problem["answer"], str) and problem["answer"].strip()
    assert problem["level"] is None or isinstance(problem["level"], int)
    assert reward.unmatchable_gold(problem["answer"]) is None   # every gold kept can score 1


def _file_text(kind: str, rows: list, junk: list[str]) -> str:
    """A data file of `kind` holding `rows`, with lines of junk mixed in."""
    if kind == ".json":
        return json.dumps(rows) if not junk else json.dumps(rows)[:-1] + junk[0]
    if kind == ".jsonl":
        lines = [json.dumps(r) for r in rows]
        for i, line in enumerate(junk):
            lines.insert(i % (len(lines) + 1), line)
        return "\n".join(lines)
    import csv
    import io

    out = io.StringIO()
    names = sorted({k for r in rows if isinstance(r, dict) for k in r}) or ["problem"]
    writer = csv.writer(out)
    writer.writerow(names)
    for r in rows:
        writer.writerow([str(r.get(k, "")) if isinstance(r, dict) else str(r) for k in names])
    return out.getvalue() + "\n".join(junk)


@examples(60)
@given(st.sampled_from([".jsonl", ".json", ".csv"]), st.lists(st.one_of(M.row(), M.value()), max_size=4),
       st.lists(st.one_of(M.response(), st.text(max_size=20), st.just('{"answer": ' + "9" * 5000 + "}")),
                max_size=2), st.booleans(),
       st.sampled_from([b"", b"\xff", b"\xc3", b"\x00", b"\r\n"]))
def test_any_data_file_gives_problems_or_one_value_error_naming_it(tmp_path_factory, kind, rows, junk, bom,
                                                                  tail):
    import data

    path = tmp_path_factory.mktemp("data") / f"rows{kind}"
    text = _file_text(kind, rows, junk).encode("utf-8", errors="surrogatepass")
    path.write_bytes(("\ufeff".encode() if bom else b"") + text + tail)
    try:
        problems = _bounded(data.read_file, str(path), limit=(len(rows) + len(junk) + 1) * _row_limit())
    except ValueError as err:
        assert f"{path.parent.name}/rows{kind}" in str(err), err   # names the file (and the rows)
        assert "\n" not in str(err).strip()
        return
    assert all(isinstance(p["answer"], str) and p["answer"].strip() for p in problems)


# --------------------------------------------------------------------------------------------------------
# harness/cli.py: the command line and a --config settings file give a Config or one line (exit 2)
# --------------------------------------------------------------------------------------------------------
def _field_names():
    import dataclasses

    import config

    return sorted(f.name for f in dataclasses.fields(config.Config))


_FLAG_VALUE = st.one_of(st.text(max_size=12), st.integers(-10 ** 12, 10 ** 12).map(str),
                        st.floats().map(repr),
                        st.sampled_from(["true", "false", "nan", "-inf", "1e999", "-1e-3", "", " ", "\udcff",
                                         "demo", "tiny", "cpu"]))
_SETTING = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 12, 10 ** 12), st.floats(),
                     st.text(max_size=12), st.lists(st.one_of(st.text(max_size=5), st.floats()), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=1))


@examples(60)
@given(st.lists(st.tuples(st.sampled_from(_field_names() + ["preset", "scale", "num_generations",
                                                           "data.train_batch_size", "epsilon"]),
                          st.lists(_FLAG_VALUE, max_size=2), st.booleans()), max_size=4),
       st.one_of(st.none(), st.dictionaries(st.sampled_from(_field_names() + ["history", "x"]), _SETTING,
                                            max_size=5)),
       st.sampled_from(["demo", "tiny", None]))
def test_any_command_line_and_settings_file_is_a_config_or_one_line(tmp_path_factory, flags, settings_file,
                                                                     preset):
    import contextlib
    import io

    from harness import cli

    argv = [] if preset is None or settings_file is not None else ["--preset", preset]
    for name, values, hydra in flags:   # --name v..., or verl's name=value
        argv += [f"{name}={values[0]}"] if hydra and values and "." in name else [f"--{name}", *values]
    if settings_file is not None:
        path = tmp_path_factory.mktemp("run") / "config.json"
        path.write_text(json.dumps(settings_file))
        argv += ["--config", str(path)]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            cfg = cli.parse_args(argv)
    except SystemExit as stop:   # --help: 0; a bad flag or setting: one line, exit 2
        err = stderr.getvalue()
        assert stop.code in (0, 2) and (stop.code == 0 or len(err.strip().splitlines()) == 1), (argv, err)
        return
    cfg.validate()   # what parse_args returns is a valid Config


# --------------------------------------------------------------------------------------------------------
# harness/viz.py: whatever the texts of a logged tree, the page holds them as data and the PNG draws
# --------------------------------------------------------------------------------------------------------
def _tree_record(prompt, answer, texts):
    blocks = [{"id": i, "parent": i - 1 if i else None, "base": 0, "start": 2 * i, "branch": False,
               "terminal": i == len(texts) - 1, "text": t, "tokens": [t[:3], t[3:]], "token_ids": [1, 2],
               "entropies": [0.5, 1.5], "reward": 1.0 if i == len(texts) - 1 else None, "advantage": 0.25}
              for i, t in enumerate(texts)]
    return {"step": 3, "tree": 0, "method": "datpo", "alpha": 0.2, "prompt": prompt, "answer": answer,
            "v_root": 0.5, "k_hat": 1, "b_hat": 1, "leaves": 1, "forks": [[2]], "blocks": blocks}


_ANY_TEXT = st.one_of(M.response(), st.text(max_size=30), st.sampled_from(["</script>", "<!--<script>",
                                                                          "$\\frac{$", "\u2028", "]]>"]))


@examples(40)
@given(_ANY_TEXT, _ANY_TEXT, st.lists(_ANY_TEXT, min_size=1, max_size=3))
def test_the_page_holds_any_text_as_data(tmp_path_factory, prompt, answer, texts):
    from harness import tracking, viz

    run = tmp_path_factory.mktemp("run")
    (run / "trees").mkdir()
    (run / "trees" / "step_000003.jsonl").write_text(json.dumps(_tree_record(prompt, answer, texts)) + "\n")
    trees = viz.drawable(tracking.read_trees(run, 3), run / "trees" / "step_000003.jsonl")
    page = viz.render_html(trees, "title </script>")
    opening = '<script id="scene" type="application/json">'
    data = page.split(opening, 1)[1].split("</script>", 1)[0]
    # the texts cannot end the data's <script> or open markup; JSON.parse gives back the scene as read
    assert page.count("</script>") == 2 and "<!--" not in page and "<" not in data
    assert json.loads(data) == viz.scene(trees)


@pytest.mark.slow
@examples(2)
@given(_ANY_TEXT, st.lists(_ANY_TEXT, min_size=1, max_size=2))
@example("$\\frac{$ \x00\x07 $$ \ud800 中文 🙂", ["</script> \\boxed{5 \\text{}} $x^{$"])
def test_the_png_draws_any_gold_answer(tmp_path_factory, answer, texts):
    from harness import tracking, viz

    run = tmp_path_factory.mktemp("run")
    (run / "trees").mkdir()
    (run / "trees" / "step_000003.jsonl").write_text(json.dumps(_tree_record("q", answer, texts)) + "\n")
    trees = tracking.read_trees(run, 3)
    png = run / "tree.png"
    viz.render_png(trees, "run: step 3", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
