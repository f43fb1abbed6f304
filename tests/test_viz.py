"""viz.py: the layout by hand, the page and PNG from a logged run, and the page rendered in headless Chromium
(what is drawn: every block, forks where the tree says, colours, rewards, clicks; no console errors, no
network)."""
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from browser import Chromium, find_chromium
from fault_injection import folder_hash
from test_tracking import scores_of

import tree as T
from harness import tracking, viz


def _trees(tokenizer):
    """Tree 0: base 0 = b0 b1 b2 forked at 2 and 4 (branch b3 at 2, b4 at 4), base 1 = b5 unforked.
    Tree 1: two unforked base responses, not trained (advantages None)."""
    ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    base0 = ids("We add the numbers: 23 + 4 = 27. The answer is 27.")
    f1, f2 = 2, 4
    blocks = [
        T.Block(None, base0[:f1], [0.5, 2.5], base=0, start=0),
        T.Block(0, base0[f1:f2], [3.0, 0.2], base=0, start=f1, logprobs=[-0.5, -1.25]),
        T.Block(1, base0[f2:], [0.1] * len(base0[f2:]), reward=0.0, base=0, start=f2),
        T.Block(0, ids(" subtract: 23 - 4 = 19 </script>"),
                [1.0] * len(ids(" subtract: 23 - 4 = 19 </script>")),
                reward=1.0, base=0, start=f1, branch=True),
        T.Block(1, ids(" 27"), [0.4] * len(ids(" 27")), reward=1.0, base=0, start=f2, branch=True),
        T.Block(None, ids("It is 5."), [0.3] * len(ids("It is 5.")), reward=0.0, base=1, start=0),
    ]
    one = T.Tree("prompt <b>&", [1], "27", blocks, v_root=0.0, k_hat=2, b_hat=1, forks=[[f1, f2], []])
    emb = np.eye(6)
    rec0 = tracking.tree_record(one, tokenizer, scores_of(one, [0.4, -0.3, -0.5, 0.6, 0.5, -0.5], emb))
    two = T.Tree("q", [1], "5", [T.Block(None, ids("5"), [0.2], reward=1.0, base=0),
                                 T.Block(None, ids("6"), [0.9], reward=0.0, base=1)], 0.5, 1, 1,
                 forks=[[], []])
    rec1 = tracking.tree_record(two, tokenizer, scores_of(two))
    for b in rec1["blocks"]:            # a tree log written before blocks carried log-probs
        del b["logprobs"]
    return [{"step": 7, "tree": i, "method": "datpo", "alpha": 0.1, **r} for i, r in enumerate([rec0, rec1])]


@pytest.fixture()
def logged_run(tmp_path, smollm_tokenizer):
    (tmp_path / "trees").mkdir()
    with open(tmp_path / "trees" / "step_000007.jsonl", "w") as f:
        for t in _trees(smollm_tokenizer):
            f.write(json.dumps(t) + "\n")
    return tmp_path


def test_layout_by_hand(smollm_tokenizer):
    tree = _trees(smollm_tokenizer)[0]
    lay = viz.layout(tree)
    n0 = len(tree["blocks"][2]["token_ids"]) + 4
    # row 0: base 0 (b0 b1 b2); row 1: the branch at the later fork (b4); row 2: the branch at 2 (b3);
    # row 3: base 1
    assert {i: p["row"] for i, p in lay["blocks"].items()} == {0: 0, 1: 0, 2: 0, 4: 1, 3: 2, 5: 3}
    assert lay["rows"] == 4
    n4 = 4 + len(tree["blocks"][4]["token_ids"])
    assert [(lay["blocks"][i]["x0"], lay["blocks"][i]["x1"]) for i in (0, 1, 2, 4)] \
        == [(0, 2), (2, 4), (4, n0), (4, n4)]
    assert lay["blocks"][3]["x0"] == 2
    assert lay["length"] == max(n0, 2 + len(tree["blocks"][3]["token_ids"]))
    broken = {**tree, "blocks": [{**b, "parent": 9} if b["id"] == 5 else b for b in tree["blocks"]]}
    with pytest.raises(ValueError, match="not reachable"):
        viz.layout(broken)


def test_page_and_png_are_self_contained(logged_run):
    page, png = viz.main([str(logged_run), "--step", "7"])
    assert page.name == "step_000007.html" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    # nothing to fetch: no src/href attributes, no URL other than the SVG namespace name
    assert not re.search(r"""(src|href)\s*=""", text)
    assert set(re.findall(r"https?://[^\s\"'`]+", text)) == {"http://www.w3.org/2000/svg"}
    # the block text cannot close the script
    assert "</script> </" not in text and text.count("</script>") == 2
    page1, _ = viz.main([str(logged_run), "--tree", "1"])                # latest step by default
    assert page1.name == "step_000007_tree1.html"
    with pytest.raises(SystemExit):
        viz.main([str(logged_run), "--step", "8"])


def _hex_rgb(colour):
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])


def test_viewer_in_headless_chromium(logged_run, tmp_path):
    """Renders the page in a real browser and checks what is drawn against the tree log."""
    if not find_chromium():
        pytest.skip("Chromium not found: `apt-get install chromium` (.ci/run installs it) or set $CHROMIUM")
    import matplotlib.image

    page_path, _ = viz.main([str(logged_run), "--step", "7"])
    trees = tracking.read_trees(logged_run, 7)
    scene = viz.scene(trees)
    shot = tmp_path / "viewer.png"
    with Chromium(width=1100, height=700) as browser:
        page = browser.open(page_path.resolve().as_uri())
        drawn = page.evaluate("""(() => {
          const box = e => { const r = e.getBoundingClientRect();
                             return {x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height}; };
          return {
            rendered: document.body.dataset.rendered,
            blocks: [...document.querySelectorAll('rect.block')].map(e => ({tree: +e.dataset.tree,
                      id: +e.dataset.id, ...box(e)})),
            forks: [...document.querySelectorAll('path.fork')].map(e => ({tree: +e.dataset.tree,
                      base: +e.dataset.base, pos: +e.dataset.pos, ...box(e)})),
            rewards: [...document.querySelectorAll('circle.reward')].map(e => ({id: +e.dataset.id,
                      reward: +e.dataset.reward})),
          }; })()""")
        page.screenshot(shot)
        # clicking a block shows its tokens, the fork tokens of a base block marked
        detail = page.evaluate("""(() => { document.querySelector('rect.block[data-tree="0"][data-id="1"]')
                                   .dispatchEvent(new MouseEvent('click', {bubbles: true}));
                                   const d = document.getElementById('detail');
                                   return {text: d.textContent, toks: d.querySelectorAll('.tok').length,
                                           forks: d.querySelectorAll('.tok.fork').length,
                                           titles: [...d.querySelectorAll('.tok')].map(e => e.title)};
                                 })()""")
        old = page.evaluate("""(() => { document.querySelector('rect.block[data-tree="1"][data-id="0"]')
                                .dispatchEvent(new MouseEvent('click', {bubbles: true}));
                                return [...document.querySelectorAll('#detail .tok')].map(e => e.title);
                              })()""")
        errors, requests = page.errors, page.requests
    assert drawn["rendered"] == "yes"
    assert errors == []
    assert requests == [page_path.resolve().as_uri()]            # the page fetched nothing but itself
    # every block of every tree, drawn with a size
    assert sorted((b["tree"], b["id"]) for b in drawn["blocks"]) == \
        sorted((t["tree"], b["id"]) for t in trees for b in t["blocks"])
    assert all(b["w"] > 0 and b["h"] > 0 for b in drawn["blocks"])
    rect = {(b["tree"], b["id"]): b for b in drawn["blocks"]}
    # forks where the tree says: one marker per (base, position), on its response's row, and each branch
    # starts at its fork's x
    assert sorted((f["tree"], f["base"], f["pos"]) for f in drawn["forks"]) == \
        sorted((t["tree"], base, pos) for t in trees for base, ps in enumerate(t["forks"]) for pos in ps)
    for f in drawn["forks"]:
        tree = trees[f["tree"]]
        root = next(b for b in tree["blocks"] if b["parent"] is None and b["base"] == f["base"])
        assert f["y"] < rect[(f["tree"], root["id"])]["y"] + 2                  # on top of its response's row
        for b in tree["blocks"]:
            if b["branch"] and b["base"] == f["base"] and b["start"] == f["pos"]:
                assert abs(rect[(f["tree"], b["id"])]["x"] - (f["x"] + f["w"] / 2)) < 1.0
    # the base response goes on in one row; branches below it
    t0 = {b["id"]: rect[(0, b["id"])] for b in trees[0]["blocks"]}
    assert t0[0]["y"] == t0[1]["y"] == t0[2]["y"] < t0[4]["y"] < t0[3]["y"] < t0[5]["y"]
    assert sorted((r["id"], r["reward"]) for r in drawn["rewards"]) == \
        sorted((b["id"], b["reward"]) for t in trees for b in t["blocks"] if b["terminal"])
    # the screenshot shows each block in its advantage colour (the middle of its bar)
    image = (matplotlib.image.imread(shot)[..., :3] * 255).round()
    for t in scene["trees"]:
        for b in t["blocks"]:
            r = rect[(t["tree"], b["id"])]
            if r["w"] >= 6:
                pixel = image[int(r["y"] + r["h"] / 2), int(r["x"] + r["w"] / 2)]
                assert np.abs(pixel - _hex_rgb(b["fill"])).max() <= 3, (t["tree"], b["id"], pixel, b["fill"])
    # fork at 2 = token 0
    assert detail["toks"] == len(trees[0]["blocks"][1]["token_ids"]) and detail["forks"] == 1
    assert "Div_sib" in detail["text"] and "block 1" in detail["text"]
    # a token's tooltip: its entropy, its generation-time log-prob when the log has them, its id
    ids1 = trees[0]["blocks"][1]["token_ids"]
    assert detail["titles"] == [f"H=3 log p=-0.5 id={ids1[0]}", f"H=0.2 log p=-1.25 id={ids1[1]}"]
    assert old == [f"H=0.2 id={trees[1]['blocks'][0]['token_ids'][0]}"]
    print(f"viewer screenshot: {shot}")


def _hash(folder):
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_torn_or_empty_tree_log_is_one_line(logged_run, capsys):
    log = logged_run / "trees" / "step_000007.jsonl"
    lines = log.read_text().splitlines()
    log.write_text(lines[0] + "\n" + lines[1][:200] + "\n")                  # the second tree torn
    page, _ = viz.main([str(logged_run), "--step", "7"])                    # the first is still drawn
    assert f"{log} line 2: torn (not JSON); that tree is left out" in capsys.readouterr().err
    assert page.exists()
    for text in ("", lines[1][:200] + "\n"):                                 # empty; nothing readable
        log.write_text(text)
        before = _hash(logged_run)
        with pytest.raises(SystemExit) as exit_info:
            viz.main([str(logged_run), "--step", "7"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and "Traceback" not in "\n".join(err)
        assert err[-1] == (f"viz.py: error: {log}: holds no readable tree (empty or torn); expected one JSON "
                           f"tree a line, as train.py --log_trees_every writes")
        assert _hash(logged_run) == before


# ------------------------------------------------------------------------------------------------------
# The viewer against hostile text and bad outputs: one line each, the page's structure intact
# ------------------------------------------------------------------------------------------------------

@pytest.fixture
def tree_log(tmp_path, smollm_tokenizer):
    def write(trees) -> Path:
        (tmp_path / "trees").mkdir(exist_ok=True)
        (tmp_path / "trees" / "step_000007.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trees))
        return tmp_path

    return write, _trees(smollm_tokenizer)


def viz_cli(capsys, argv, code) -> str:
    with pytest.raises(SystemExit) as exit_info:
        viz.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == code and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


PAGE_STATE = """(() => {
  document.querySelector('rect.block[data-tree="0"][data-id="0"]')
    .dispatchEvent(new MouseEvent('click', {bubbles: true}));
  return {rendered: document.body.dataset.rendered, blocks: document.querySelectorAll('rect.block').length,
          scripts: document.scripts.length, imgs: document.images.length,
          first: document.querySelector('#detail .tok').textContent,
          h2: document.querySelector('h2').textContent, meta: document.querySelector('.meta').textContent};
})()"""


def test_no_generated_text_changes_the_pages_structure(tree_log, capsys):
    write, trees = tree_log
    payloads = ["<!--<script>", "</script><script>alert(1)</script>", "<img src=x onerror=alert(1)>",
                "\u2028&amp;"]
    for block, text in zip(trees[0]["blocks"], payloads):
        block["tokens"][0] = text
        block["text"] = text + block["text"]
    trees[0]["answer"] = "<!--"
    trees[0]["level"] = "<b>5</b>"
    page, _ = viz.main([str(write(trees)), "--step", "7"])
    scene = page.read_text().split('<script id="scene" type="application/json">')[1].split("</script>")[0]
    assert not set("<>&\u2028") & set(scene)                        # nothing the HTML parser could read
    assert json.loads(scene) == json.loads(json.dumps(viz.scene(trees)))
    if not find_chromium():
        pytest.skip("Chromium not found: `apt-get install chromium` or set $CHROMIUM")
    with Chromium(width=1100, height=700) as browser:
        shown = browser.open(page.resolve().as_uri())
        drawn = shown.evaluate(PAGE_STATE)
        errors = shown.errors
    assert errors == [] and drawn["rendered"] == "yes" and drawn["scripts"] == 2 and drawn["imgs"] == 0
    assert drawn["blocks"] == sum(len(t["blocks"]) for t in trees)
    assert drawn["first"] == "<!--<script>" and drawn["h2"].endswith("gold answer <!--")
    assert drawn["meta"].endswith("level <b>5</b>")


def test_viewer_bad_logs_and_outputs_are_one_line(tree_log, tmp_path, capsys):
    write, trees = tree_log
    run = write([{"step": 7, "hello": [1, 2]}])
    log = run / "trees" / "step_000007.jsonl"
    before = folder_hash(run)
    assert viz_cli(capsys, [str(run), "--step", "7"], 2) == (
        f"viz.py: error: {log}: holds no tree to draw (line 1: not a tree (field(s) tree, method, alpha, "
        f"prompt, answer, v_root, k_hat, b_hat, leaves, forks, blocks missing or of the wrong type)); "
        f"expected one JSON tree a line, as train.py --log_trees_every writes")
    assert folder_hash(run) == before
    log.write_text("[1, 2, 3]\n" + json.dumps(trees[1]) + "\n")      # one bad line beside a tree: left out
    page, _ = viz.main([str(run), "--step", "7"])
    assert capsys.readouterr().err.strip().splitlines()[0] == (
        f"{log} line 1: not a tree (a JSON list, not an object); that line is left out")
    assert page.exists()
    write(trees)
    assert viz_cli(capsys, [str(run), "--step", "7", "--out", "/proc/viewer"], 2) == (
        "viz.py: error: --out /proc/viewer: cannot write /proc/viewer.html (No such file or directory); "
        "expected a folder you can write")


def test_gold_answer_matplotlib_cannot_parse_is_drawn_as_plain_text(tree_log, capsys):
    write, trees = tree_log
    trees[0]["answer"] = "$\\frac{$"
    page, png = viz.main([str(write(trees)), "--step", "7"])
    err = capsys.readouterr().err.strip().splitlines()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and page.exists()
    assert len(err) == 1 and err[0].startswith(
        f"{png}: 1 title(s) drawn as plain text, not valid matplotlib math text (e.g. 'tree 0: ")
    assert not list(png.parent.glob("*.tmp"))


# ------------------------------------------------------------------------------------------------------
# The viewer: stray files in trees/ and non-finite logs are one line
# ------------------------------------------------------------------------------------------------------
@pytest.fixture
def tree_run(tmp_path, smollm_tokenizer):
    """A run folder holding trees/step_000007.jsonl (test_viz's two trees), and the trees."""
    trees = _trees(smollm_tokenizer)
    (tmp_path / "trees").mkdir()
    (tmp_path / "trees" / "step_000007.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trees))
    return tmp_path, trees


def viz_lines(capsys, argv, code=None) -> list[str]:
    """`python -m harness.viz ARGS`: its stderr lines; `code` the exit code (None: it draws and returns)."""
    if code is None:
        viz.main(argv)
    else:
        with pytest.raises(SystemExit) as exit_info:
            viz.main(argv)
        assert exit_info.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("stray", ["step_final.jsonl", "step_7.jsonl", "step_000007 (copy).jsonl"])
def test_a_stray_file_in_trees_is_skipped_with_one_line(program_name, tree_run, capsys, stray):
    run, _ = tree_run
    log = run / "trees" / "step_000007.jsonl"
    shutil.copy(log, run / "trees" / stray)                   # the case: step_final.jsonl
    before = folder_hash(run / "trees")
    assert viz_lines(capsys, [str(run)]) == [
        f"viz.py: {run / 'trees' / stray}: not a tree log of train.py (expected step_NNNNNN.jsonl, a step's "
        f"number in six or more digits); skipped"]
    assert (run / "trees" / "step_000007.html").exists()      # the real log, drawn
    after = folder_hash(run / "trees")
    assert {name: after[name] for name in before} == before   # the logs untouched; the page and PNG added


def test_nan_in_a_tree_log_is_a_named_line_never_a_blank_page(program_name, tree_run, capsys):
    run, trees = tree_run
    log = run / "trees" / "step_000007.jsonl"
    trees[0]["v_root"] = float("nan")                         # the case
    trees[1]["blocks"][0]["tokens"][0] = "5\ud800"             # a lone surrogate (a "\ud800" escape): U+FFFD
    log.write_text("".join(json.dumps(t) + "\n" for t in trees))
    assert viz_lines(capsys, [str(run)]) == [
        f"{log} line 1: not a tree (a number that is not finite: v_root is nan); that line is left out"]
    page = (run / "trees" / "step_000007.html").read_text(encoding="utf-8")
    scene = page.split('<script id="scene" type="application/json">')[1].split("</script>")[0]
    drawn = json.loads(scene, parse_constant=lambda name: pytest.fail(f"{name} in the page's JSON"))
    assert [t["tree"] for t in drawn["trees"]] == [1]
    assert drawn["trees"][0]["blocks"][0]["tokens"][0] == "5\ufffd"


def test_a_log_of_non_finite_trees_only_is_one_line(program_name, tree_run, capsys):
    run, trees = tree_run
    log = run / "trees" / "step_000007.jsonl"
    trees[0]["blocks"][2]["entropies"][1] = float("inf")
    trees[1]["alpha"] = float("-inf")
    log.write_text("".join(json.dumps(t) + "\n" for t in trees))
    before = folder_hash(run)
    assert viz_lines(capsys, [str(run)], code=2) == [
        f"viz.py: error: {log}: holds no tree to draw (line 1: not a tree (a number that is not finite: "
        f"blocks[2].entropies[1] is inf)); expected one JSON tree a line, as train.py --log_trees_every "
        f"writes"]
    assert folder_hash(run) == before
