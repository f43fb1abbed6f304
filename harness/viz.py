"""viz.py — look at the trees a run logged (--log_trees_every): a self-contained HTML page and a PNG.

    python viz.py runs/demo --step 24            # every tree of step 24 →
                                                 # runs/demo/trees/step_000024.{html,png}
    python viz.py runs/demo --step 24 --tree 3   # one tree → step_000024_tree3.{html,png}
    python viz.py runs/demo                      # the last logged step

Each tree is laid out from the prompt (left) to its leaves (right), the x-axis in token positions of the
root-to-leaf response: a base response is a row of blocks cut at its forking points (Sec. 4.1), each branch a
row of its own starting at its fork, right below the response it grows from. Blocks are coloured by the
advantage the update used (red < 0 < green; Sec. 4.2), a strip under each block shades its tokens by entropy
(darker = higher H_t), triangles mark the forks, and each leaf ends in its reward (1 green, 0 red). In the
HTML page, hovering a block shows its numbers and clicking it shows its text token by token. The page needs no
network: data, script and styles are inline.
"""
from __future__ import annotations

import argparse
import errno
import html
import json
import math
import os
import sys
from pathlib import Path

from harness import tracking
from runtime import atomic, faults, figures

ROW_H, BAR_H, STRIP_H = 30, 13, 6       # pixels per row, advantage bar, entropy strip
PROMPT_W, PLOT_W, PAD = 70, 900, 10     # prompt box, width of the longest response, margin


# --------------------------------------------------------------------------------------------------------
# Layout and colours: pure functions shared by the HTML page and the PNG
# --------------------------------------------------------------------------------------------------------
def layout(tree: dict) -> dict:
    """Rows and token spans of a logged tree (tracking.tree_record).

    Returns {"rows": n, "length": longest root-to-leaf length in tokens, "blocks": {id: {"row", "x0", "x1"}}}.
    A block continues its parent's row when it is the parent's non-branch child (the base response goes on);
    every other child (a branch) opens a new row. Rows open depth-first, later forks first, so a branch row
    sits right below its response and no fork's connector crosses another branch.
    """
    blocks = tree["blocks"]
    children: dict = {}
    for b in blocks:
        children.setdefault(b["parent"], []).append(b["id"])
    by_id = {b["id"]: b for b in blocks}
    placed: dict = {}
    rows = [0]

    def place(i: int, row: int) -> None:
        b = by_id[i]
        placed[i] = {"row": row, "x0": b["start"], "x1": b["start"] + len(b["token_ids"])}
        kids = children.get(i, [])
        main = next((c for c in kids if not by_id[c]["branch"]), None)
        if main is not None:
            place(main, row)
        for c in sorted((c for c in kids if c != main), key=lambda c: (-by_id[c]["start"], c)):
            rows[0] += 1
            place(c, rows[0])

    for n, root in enumerate(children.get(None, [])):
        if n:
            rows[0] += 1
        place(root, rows[0])
    if len(placed) != len(blocks):
        raise ValueError(f"tree {tree.get('tree')}: {len(blocks) - len(placed)} block(s) not reachable from "
                         f"the prompt")
    return {"rows": rows[0] + 1, "length": max((p["x1"] for p in placed.values()), default=1),
            "blocks": placed}


def _hex(rgb) -> str:
    return "#" + "".join(f"{int(round(255 * c)):02x}" for c in rgb[:3])


def advantage_colour(a: float | None, scale: float) -> str:
    """Red (negative) – pale yellow (0) – green (positive), saturating at ±scale; grey when not trained."""
    if a is None:
        return "#c8c8c8"
    from matplotlib import colormaps

    return _hex(colormaps["RdYlGn"](0.5 + 0.5 * max(-1.0, min(1.0, a / scale))))


def entropy_colour(h: float, h_max: float) -> str:
    """White (H = 0) to dark purple (H = h_max)."""
    from matplotlib import colormaps

    return _hex(colormaps["Purples"](0.05 + 0.9 * min(h / h_max, 1.0) if h_max > 0 else 0.05))


def scales(trees: list[dict]) -> tuple[float, float]:
    """(advantage colour scale, entropy colour scale) shared by all trees drawn together."""
    adv = [abs(b["advantage"]) for t in trees for b in t["blocks"] if b["advantage"] is not None]
    ent = [h for t in trees for b in t["blocks"] for h in b["entropies"]]
    return max(adv + [0.25]), max(ent + [1e-6])


def scene(trees: list[dict]) -> dict:
    """Everything the page draws: the trees with their layout and colours (what the browser test checks)."""
    a_scale, h_scale = scales(trees)
    out = []
    for t in trees:
        lay = layout(t)
        blocks = []
        for b in t["blocks"]:
            blocks.append({**b, **lay["blocks"][b["id"]], "fill": advantage_colour(b["advantage"], a_scale),
                           "token_fill": [entropy_colour(h, h_scale) for h in b["entropies"]]})
        out.append({k: v for k, v in t.items() if k != "blocks"}
                   | {"rows": lay["rows"], "length": lay["length"], "blocks": blocks})
    return {"advantage_scale": a_scale, "entropy_scale": h_scale, "trees": out}


# --------------------------------------------------------------------------------------------------------
# What a tree log line must be (tracking.tree_record): checked before drawing, one line when it is not
# --------------------------------------------------------------------------------------------------------
NUM, OPT_NUM = (int, float), (int, float, type(None))
TREE_FIELDS = {"tree": int, "method": str, "alpha": NUM, "prompt": str, "answer": (str, int, float),
               "v_root": NUM, "k_hat": int, "b_hat": int, "leaves": int, "forks": list, "blocks": list}
BLOCK_FIELDS = {"id": int, "parent": (int, type(None)), "base": int, "start": int, "branch": bool,
                "terminal": bool, "text": str, "tokens": list, "token_ids": list, "entropies": list,
                "reward": OPT_NUM, "advantage": OPT_NUM}


def _wrong_fields(record: dict, fields: dict) -> list[str]:
    return [name for name, kind in fields.items() if not isinstance(record.get(name), kind)]


def non_finite(value, where: str = "") -> str | None:
    """The first field of a JSON value that holds NaN or ±Infinity (Python's json reads them; train.py never
    writes one, and the page's JSON.parse refuses them: the page would stay blank), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{where or 'the value'} is {value}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        why = non_finite(item, f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]")
        if why:
            return why
    return None


def tree_problem(tree) -> str | None:
    """Why a logged record cannot be drawn (not a tree of tracking.tree_record's shape), or None. Numbers
    must be numbers (finite ones) and texts texts, so that what the page shows is only ever text."""
    if not isinstance(tree, dict):
        return f"a JSON {type(tree).__name__}, not an object"
    infinite = non_finite(tree)
    if infinite:
        return f"a number that is not finite: {infinite.lstrip('.')}"
    wrong = _wrong_fields(tree, TREE_FIELDS)
    if wrong:
        return f"field(s) {', '.join(wrong)} missing or of the wrong type"
    if not all(isinstance(f, list) and all(isinstance(x, int) for x in f) for f in tree["forks"]):
        return "forks is not a list of lists of token positions"
    if not tree["blocks"]:
        return "no blocks"
    for b in tree["blocks"]:
        wrong = _wrong_fields(b, BLOCK_FIELDS) if isinstance(b, dict) else ["(the block itself)"]
        if wrong:
            return f"a block's field(s) {', '.join(wrong)} missing or of the wrong type"
        n = len(b["token_ids"])
        logprobs = b.get("logprobs") or [0.0] * n
        if not (len(b["tokens"]) == len(b["entropies"]) == len(logprobs) == n
                and all(isinstance(x, str) for x in b["tokens"])
                and all(isinstance(x, int) for x in b["token_ids"])
                and all(isinstance(x, NUM) for x in b["entropies"] + list(logprobs))):
            return f"block {b['id']}: tokens, token_ids, entropies and logprobs are not one entry per token"
    try:
        layout(tree)
    except (ValueError, KeyError, RecursionError) as err:
        return f"its blocks do not form a tree ({err})"
    return None


def drawable(trees: list[dict], path: Path) -> list[dict]:
    """The trees of a log that can be drawn; each other line is named and left out (as a torn line is), and
    none left is a ValueError naming the first."""
    lines = [n for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if line.strip() and _parses(line)]   # the line of each record read_trees returned
    good, bad = [], []
    for n, tree in zip(lines, trees):
        why = tree_problem(tree)
        if why is None:
            good.append(tree)
        else:
            bad.append(f"line {n}: not a tree ({why})")
    if not good:
        raise ValueError(f"{path}: holds no tree to draw ({bad[0]}); expected one JSON tree a line, as "
                         f"train.py --log_trees_every writes")
    for line in bad:
        print(f"{path} {line}; that line is left out", file=sys.stderr)
    return good


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


# --------------------------------------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------------------------------------
PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 12px 16px; color: #222; }
h1 { font-size: 17px; margin: 0 0 4px; } h2 { font-size: 14px; margin: 18px 0 2px; }
.meta { color: #555; }
.legend span { display: inline-block; width: 14px; height: 10px; vertical-align: middle; }
details pre, #detail pre { white-space: pre-wrap; background: #f6f6f6; padding: 6px; margin: 4px 0; }
svg .block { cursor: pointer; stroke: #555; stroke-width: 0.6; }
svg .block.sel { stroke: #000; stroke-width: 2.2; }
svg text { font: 10px sans-serif; }
#detail { position: sticky; bottom: 0; background: #fff; border-top: 2px solid #888; padding: 6px 0;
          max-height: 42vh; overflow: auto; }
.tok { border-radius: 2px; } .tok.fork { outline: 2px solid #d62728; }
</style></head><body>
<h1>__TITLE__</h1>
<div class="legend">advantage <span style="background:#a50026"></span> &minus;__ASCALE__
&nbsp;<span style="background:#fefebd"></span> 0
&nbsp;<span style="background:#006837"></span> +__ASCALE__ &nbsp;&nbsp; token entropy
<span style="background:#fcfbfd;border:1px solid #ccc"></span> 0
<span style="background:#3f007d"></span> __HSCALE__ nats &nbsp;&nbsp; &#9660; fork &nbsp;&nbsp; leaf reward:
<b style="color:#1a9850">1</b> / <b style="color:#d73027">0</b> &nbsp;&nbsp; hover a block for its numbers,
click it for its tokens</div>
<div id="trees"></div>
<div id="detail"><i>click a block</i></div>
<script id="scene" type="application/json">__SCENE__</script>
<script>
"use strict";
const S = JSON.parse(document.getElementById("scene").textContent);
const NS = "http://www.w3.org/2000/svg", ROW = __ROW__, BAR = __BAR__, STRIP = __STRIP__, PW = __PW__,
      PLOT = __PLOT__, PAD = __PAD__;
const fmt = v => v === null || v === undefined ? "\\u2014" : (Math.round(v * 1000) / 1000).toString();
function el(tag, attrs, parent) {
  const e = document.createElementNS(NS, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
function esc(s) {
  return s.replace(/[&<>"]/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
}
let selected = null;
function show(t, b, rect) {
  if (selected) selected.classList.remove("sel");
  selected = rect; rect.classList.add("sel");
  const forks = new Set((t.forks[b.base] || []).map(f => f - b.start));
  const toks = b.tokens.map((s, k) => `<span class="tok${forks.has(k) && !b.branch ? " fork" : ""}" ` +
    `style="background:${b.token_fill[k]};` +
    `color:${b.entropies[k] > 0.6 * S.entropy_scale ? "#fff" : "#000"}" ` +
    `title="H=${b.entropies[k]}${b.logprobs ? " log p=" + b.logprobs[k] : ""} id=${b.token_ids[k]}">` +
    `${esc(s)}</span>`).join("");
  document.getElementById("detail").innerHTML =
    `<b>tree ${t.tree}, block ${b.id}</b> (${b.branch ? "branch" : "base response " + b.base}, ` +
    `parent ${b.parent === null ? "prompt" : b.parent}, ` +
    `tokens ${b.start}\\u2013${b.start + b.token_ids.length}) &nbsp; reward ${fmt(b.reward)} ` +
    `&nbsp; V(start) ${fmt(b.v_start)} &nbsp; V(end) ${fmt(b.v_end)} ` +
    `&nbsp; \\u00c2_base ${fmt(b.base_advantage)} &nbsp; Div_sib ${fmt(b.div_sib)} ` +
    `&nbsp; \\u00c2 ${fmt(b.advantage)}<pre>${toks}</pre>`;
}
function drawTree(t, host) {
  const sec = document.createElement("section");
  sec.className = "tree"; sec.dataset.tree = t.tree;
  sec.innerHTML = `<h2>tree ${t.tree} &mdash; gold answer ${esc(String(t.answer))}</h2>` +
    `<div class="meta">V(root) ${fmt(t.v_root)} &nbsp; K\\u0302 = ${t.k_hat}, B\\u0302 = ${t.b_hat} ` +
    `&nbsp; forks ${esc(JSON.stringify(t.forks))} &nbsp; ${t.leaves} leaves ` +
    `&nbsp; ${t.trained ? "" : "(not trained) "}` +
    `${t.level === null || t.level === undefined ? "" : "level " + esc(String(t.level))}</div>` +
    `<details><summary>prompt</summary><pre>${esc(t.prompt)}</pre></details>`;
  host.appendChild(sec);
  const unit = PLOT / Math.max(t.length, 1), H = t.rows * ROW + 2 * PAD;
  const X = x => PAD + PW + 16 + x * unit, Y = r => PAD + r * ROW + 8;
  const svg = el("svg", {width: PAD * 2 + PW + 16 + PLOT + 40, height: H, "data-tree": t.tree}, sec);
  const pr = el("rect", {x: PAD, y: PAD, width: PW, height: t.rows * ROW - 8, fill: "#e8eef7", stroke: "#789",
                         class: "prompt"}, svg);
  el("text", {x: PAD + 6, y: PAD + 14}, svg).textContent = "prompt";
  const byId = {};
  for (const b of t.blocks) byId[b.id] = b;
  for (const b of t.blocks) {               // connectors: prompt → first blocks, fork → branch
    const y = Y(b.row) + BAR / 2;
    if (b.parent === null)
      el("path", {d: `M${PAD + PW},${y} L${X(0)},${y}`, stroke: "#789", fill: "none"}, svg);
    else if (byId[b.parent].row !== b.row) {
      const p = byId[b.parent];
      el("path", {d: `M${X(b.x0)},${Y(p.row) + BAR + STRIP} L${X(b.x0)},${y} L${X(b.x0) + 3},${y}`,
                  stroke: "#999", fill: "none", class: "edge"}, svg);
    }
  }
  for (const b of t.blocks) {
    const g = el("g", {}, svg);
    const r = el("rect", {x: X(b.x0), y: Y(b.row), width: Math.max((b.x1 - b.x0) * unit, 1), height: BAR,
                          fill: b.fill, class: "block", "data-tree": t.tree, "data-id": b.id,
                          "data-row": b.row, "data-x0": b.x0, "data-x1": b.x1}, g);
    el("title", {}, r).textContent =
      `block ${b.id}: ${b.branch ? "branch" : "base " + b.base}, tokens ${b.x0}-${b.x1}\\n` +
      `reward ${fmt(b.reward)}  V(start) ${fmt(b.v_start)}  V(end) ${fmt(b.v_end)}\\n` +
      `A_base ${fmt(b.base_advantage)}  Div_sib ${fmt(b.div_sib)}  A ${fmt(b.advantage)}\\n` +
      `${b.text.slice(0, 300)}`;
    r.addEventListener("click", () => show(t, b, r));
    b.token_fill.forEach((c, k) => el("rect", {x: X(b.x0 + k), y: Y(b.row) + BAR, width: Math.max(unit, 0.5),
                                               height: STRIP, fill: c, class: "tok-cell"}, g));
    if (b.terminal) {
      const ok = b.reward > 0;
      el("circle", {cx: X(b.x1) + 9, cy: Y(b.row) + BAR / 2, r: 7, fill: ok ? "#1a9850" : "#d73027",
                    class: "reward", "data-id": b.id, "data-reward": b.reward}, svg);
      el("text", {x: X(b.x1) + 6, y: Y(b.row) + BAR / 2 + 4, fill: "#fff"}, svg).textContent = ok ? "1" : "0";
    }
  }
  t.forks.forEach((positions, base) => {   // fork markers on the row of each base response
    const first = t.blocks.find(b => b.parent === null && b.base === base && !b.branch);
    if (!first) return;
    for (const f of positions) {
      const x = X(f), y = Y(first.row);
      el("path", {d: `M${x - 5},${y - 6} L${x + 5},${y - 6} L${x},${y + 1} Z`, fill: "#d62728", class: "fork",
                  "data-tree": t.tree, "data-base": base, "data-pos": f, "data-x": x}, svg);
    }
  });
}
const host = document.getElementById("trees");
for (const t of S.trees) drawTree(t, host);
document.body.dataset.rendered = "yes";
</script></body></html>
"""


# Characters that could end or re-open markup inside the <script> block the data sits in (`</script>`,
# `<!--<script>`: the HTML parser then swallows the page's own script), or end a JS line: written as JSON
# \u escapes, which JSON.parse turns back into the same characters.
SCRIPT_SAFE = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                             "\u2029": "\\u2029"})


def render_html(trees: list[dict], title: str) -> str:
    """The page: PAGE with the scene embedded as JSON that no string in it (a generated token, a prompt, a
    gold answer) can break out of (SCRIPT_SAFE); the page's script escapes text before showing it."""
    data = json.dumps(scene(trees), ensure_ascii=False, allow_nan=False).translate(SCRIPT_SAFE)
    a_scale, h_scale = scales(trees)
    fills = {"__TITLE__": html.escape(title), "__ASCALE__": f"{a_scale:.2f}", "__HSCALE__": f"{h_scale:.1f}",
             "__ROW__": str(ROW_H), "__BAR__": str(BAR_H), "__STRIP__": str(STRIP_H), "__PW__": str(PROMPT_W),
             "__PLOT__": str(PLOT_W), "__PAD__": str(PAD)}
    page = PAGE
    for key, value in fills.items():
        page = page.replace(key, value)
    return page.replace("__SCENE__", data)


# --------------------------------------------------------------------------------------------------------
# PNG
# --------------------------------------------------------------------------------------------------------
def render_png(trees: list[dict], title: str, path) -> list[str]:
    """The same drawing with matplotlib: one panel per tree. Returns the titles drawn as plain text
    (plain_where_math_fails)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    drawn = scene(trees)
    heights = [t["rows"] for t in drawn["trees"]]
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, 0.9 + 0.32 * sum(heights) + 0.5 * len(heights)),
                             gridspec_kw={"height_ratios": [h + 1.2 for h in heights]}, squeeze=False)
    for ax, t in zip(axes[:, 0], drawn["trees"]):
        length, prompt_w = t["length"], max(t["length"] * 0.08, 2)
        ax.add_patch(Rectangle((-prompt_w - 1, -0.4), prompt_w, t["rows"] - 0.2, color="#e8eef7",
                               ec="#778899"))
        ax.text(-prompt_w / 2 - 1, -0.1, "prompt", ha="center", va="center", fontsize=7)
        rows = {b["id"]: b["row"] for b in t["blocks"]}
        for b in t["blocks"]:
            y = b["row"]
            if b["parent"] is None:
                ax.plot([-1, b["x0"]], [y, y], color="#778899", lw=0.8, zorder=0)
            elif rows[b["parent"]] != y:
                ax.plot([b["x0"], b["x0"]], [rows[b["parent"]] + 0.35, y], color="#999999", lw=0.8, zorder=0)
            ax.add_patch(Rectangle((b["x0"], y - 0.3), max(b["x1"] - b["x0"], 0.3), 0.42, facecolor=b["fill"],
                                   edgecolor="#555555", lw=0.4))
            for k, c in enumerate(b["token_fill"]):
                ax.add_patch(Rectangle((b["x0"] + k, y + 0.12), 1, 0.2, facecolor=c, edgecolor="none"))
            if b["terminal"]:
                ok = (b["reward"] or 0) > 0
                ax.plot(b["x1"] + 0.9, y - 0.09, "o", ms=8, color="#1a9850" if ok else "#d73027")
                ax.text(b["x1"] + 0.9, y - 0.09, "1" if ok else "0", color="white", fontsize=6, ha="center",
                        va="center")
        for base, positions in enumerate(t["forks"]):
            first = next((b for b in t["blocks"]
                          if b["parent"] is None and b["base"] == base and not b["branch"]), None)
            for f in positions if first else []:
                ax.plot(f, first["row"] - 0.42, "v", color="#d62728", ms=5)
        ax.set_xlim(-prompt_w - 1.5, length + 3)
        ax.set_ylim(t["rows"] - 0.4, -0.8)
        ax.set_yticks([])
        ax.set_xlabel("token position", fontsize=7)
        ax.tick_params(labelsize=7)
        for side in ("top", "right", "left"):
            ax.spines[side].set_visible(False)
        ax.set_title(f"tree {t['tree']}: V(root) {t['v_root']:.2f}, K̂={t['k_hat']}, B̂={t['b_hat']}, "
                     f"{t['leaves']} leaves, gold {t['answer']}", fontsize=8, loc="left")
    fig.suptitle(figures.literal(title) + f"  (colour: advantage, ±{drawn['advantage_scale']:.2f}; "
                         f"strip: token entropy; ▼ fork)", fontsize=8)
    plain = plain_where_math_fails(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return plain


def plain_where_math_fails(fig) -> list[str]:
    """A text with $...$ is drawn as math text; one matplotlib cannot parse (a gold answer like $\\frac{$)
    would stop the whole figure, so it is drawn as it is written instead. Returns those texts."""
    from matplotlib.text import Text

    renderer, plain = fig.canvas.get_renderer(), []
    for text in fig.findobj(Text):
        try:
            text.get_window_extent(renderer)
        except ValueError:
            text.set_parse_math(False)
            plain.append(text.get_text())
    return plain


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------
def logged_steps(run_dir, say_stray: bool = False) -> list[int]:
    """The steps RUN/trees holds a log of (tracking.tree_logs); with say_stray, one line for each other
    step_*.jsonl there (skipped)."""
    logs, stray = tracking.tree_logs(run_dir)
    for path in stray if say_stray else []:
        print(f"viz.py: {figures.printable(path)}: not a tree log of train.py (expected step_NNNNNN.jsonl, a "
              f"step's number in six or more digits); skipped", file=sys.stderr)
    return list(logs)


def main(argv: list[str] | None = None) -> tuple[Path, Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="a run folder written with --log_trees_every N")
    parser.add_argument("--step", type=int, default=None, help="a logged step (default: the last one)")
    parser.add_argument("--tree", type=int, default=None, help="one tree of that step (default: all)")
    parser.add_argument("--out", default=None,
                        help="output path without suffix (default: RUN/trees/step_XXXXXX[_treeN])")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    steps = logged_steps(args.run, say_stray=True)
    if not steps:
        parser.exit(2, f"viz.py: error: {Path(args.run) / 'trees'} holds no tree logs; "
                       f"train with --log_trees_every N\n")
    step = steps[-1] if args.step is None else args.step
    try:
        log = Path(args.run) / "trees" / f"step_{step:06d}.jsonl"
        trees = drawable(tracking.read_trees(args.run, step), log)
    except (FileNotFoundError, ValueError) as err:   # no log for that step; an empty / torn one; not trees
        parser.exit(2, f"viz.py: error: {err}\n")
    if args.tree is not None:
        chosen = [t for t in trees if t["tree"] == args.tree]
        if not chosen:
            parser.exit(2, f"viz.py: error: --tree {args.tree}: step {step} logged trees "
                           f"0..{len(trees) - 1}\n")
        trees = chosen
    stem = Path(args.out) if args.out else Path(args.run) / "trees" / (
        f"step_{step:06d}" + ("" if args.tree is None else f"_tree{args.tree}"))
    first = trees[0]
    title = figures.printable(f"{Path(args.run).resolve().name}: step {step}, {first['method']}, α = "
                              f"{first['alpha']:.3f}" + ("" if args.tree is None else f", tree {args.tree}"))
    page, png = stem.with_suffix(".html"), stem.with_suffix(".png")
    try:
        write_outputs(trees, title, page, png)
    except OSError as err:

        full = err.errno in (errno.ENOSPC, errno.EDQUOT)
        flag = f"--out {args.out}" if args.out else f"{page.parent} (the default output folder, or --out)"
        target = str(err.filename or page).removesuffix(".tmp")
        parser.exit(4 if full else 2, f"viz.py: error: {flag}: cannot write {target} "
                                      f"({faults.write_failure(err)}); expected a folder you can write"
                                      f"{' with free space' if full else ''}\n")
    print(f"wrote {page} and {png}")
    return page, png


def write_outputs(trees: list[dict], title: str, page: Path, png: Path) -> None:
    """The page and the PNG, each written whole under a temporary name and renamed (an error leaves no
    half-written file)."""
    page.parent.mkdir(parents=True, exist_ok=True)
    tmp_page = tmp_png = None
    try:   # temporary files created exclusively: never a link planted in the folder (runtime/atomic.py)
        tmp_page, tmp_png = atomic.exclusive_temp(page), atomic.exclusive_temp(png)
        tmp_page.write_text(render_html(trees, title), encoding="utf-8")
        plain = render_png(trees, title, tmp_png)
        if plain:
            print(f"{png}: {len(plain)} title(s) drawn as plain text, not valid matplotlib math text (e.g. "
                  f"{plain[0]!r})", file=sys.stderr)
        os.replace(tmp_page, page)
        os.replace(tmp_png, png)
    except OSError as err:   # named by the file being written, not by its temporary name
        final = png if tmp_png is not None and str(err.filename) == str(tmp_png) else page
        raise OSError(err.errno, err.strerror, str(final)) from err
    finally:
        for tmp in (tmp_page, tmp_png):
            if tmp is not None:
                tmp.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
