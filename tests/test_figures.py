"""Names drawn as written (runtime/figures.py): text matplotlib would read as math (a run `${M}_${S}`, a
held-out set, a problem `$x \\le 5$`, a token `$$`) is drawn literally: a finished run draws training.png,
show-forks and evaluate's figures draw."""
import contextlib
import io
import json
import sys

import fault_injection as FI
import pytest

import evaluate as E
from harness import loop
from runtime import faults, figures

# ------------------------------------------------------------------------------------------------------
# Names drawn as written: math text in a run's name, a held-out set, problems and tokens
# ------------------------------------------------------------------------------------------------------
TINY = ["--preset", "tiny", "--save_every", "1", "--threads", "1", "--seed", "3"]


FINISHED_STEPS = 2     # conftest's `finished` / `run`: a 2-step run, a checkpoint each step


pytestmark = pytest.mark.usefixtures("program_name")   # `python train.py` runs these commands
MATH_TEXT = ["${M}_${S}", "$x \\le 5$", "$$", "$\\frac{$", "cost $5 and $6", "a\\$b$c$"]


FINISHED = {}   # the stderr of the module's finished run


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Overrides conftest's: the module's tiny run (TINY, FINISHED_STEPS) trained to its end as `python
    train.py` runs it, into a folder named like math text, `${M}_${S}` (the issue's case: a job script's
    unexpanded name, whose training.png title ended the finished run with a ParseException). Its stderr is
    kept in FINISHED; `run` (conftest) copies it."""
    import rollout
    import train

    run_dir = tmp_path_factory.mktemp("finished") / "${M}_${S}"
    patch, err = pytest.MonkeyPatch(), io.StringIO()
    patch.setattr(rollout, "compute_reward", FI.stand_in_reward)
    patch.setattr(sys, "argv", ["train.py"])
    try:
        with contextlib.redirect_stderr(err):
            faults.main_guard(train.main, TINY + ["--steps", str(FINISHED_STEPS), "--out_dir", str(run_dir)])
    finally:
        patch.undo()
    FINISHED["stderr"] = err.getvalue()
    return run_dir


def test_a_run_named_like_math_text_finishes_and_draws_its_curves(finished):
    lines = [line.strip() for line in FINISHED["stderr"].replace("\r", "\n").splitlines() if line.strip()]
    assert "Traceback" not in FINISHED["stderr"] and not [line for line in lines if "error" in line.lower()]
    assert lines[-1] == f"curves: {finished / 'training.png'}"         # its last line: it finished, exit 0
    assert (finished / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_held_out_set_named_like_math_text_is_drawn_as_written(run, tmp_path):
    named = tmp_path / "$x \\le 5$"
    run.rename(named)
    with open(named / "metrics.jsonl", "a") as f:   # a held-out evaluation of a file named like math text
        f.write(json.dumps({"step": 2, "eval": "after", "data": "$x \\le 5$.jsonl", "avg@2": 0.5}) + "\n")
    assert loop.plot_run(named).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_problem_texts_tokens_and_names_like_math_text_are_drawn_as_written(tmp_path):
    import matplotlib
    from matplotlib.text import Text

    from studies import forks

    for text in MATH_TEXT + ["caf\udce9"]:   # each drawn literally: no math text is parsed
        assert not matplotlib.cbook.is_math_text(figures.literal(text))
        shown = text.replace("\udce9", "\\xe9")
        assert Text(text=figures.literal(text), parse_math=True)._preprocess_math(figures.literal(text)) == (
            shown, False)
    pieces = ["Solve ", "$x", " \\le", " 5$", ": ", "$$", "\\frac{", "$", "\n", "done"]
    png = tmp_path / "forks.png"
    forks.render_forks_png(pieces, [0.5] * len(pieces), {"entropy": [2, 6]},
                           "Solve $x \\le 5$.  (gold $\\frac{$; 10 tokens; K = 2)", png)   # show-forks
    result = E.score_records([{"index": 0, "run": 0, "gold": "5", "answer": "5", "correct": True},
                              {"index": 0, "run": 0, "gold": "5", "answer": "$", "correct": False}], 2)
    by_model = {name: {"$x \\le 5$.jsonl": result, "$$.jsonl": result} for name in MATH_TEXT[:3]}
    E.plot_pass_curves(by_model, tmp_path / "pass_curves.png")
    E.plot_maj_vs_avg(by_model, tmp_path / "maj_vs_avg.png")
    for name in ("forks.png", "pass_curves.png", "maj_vs_avg.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
