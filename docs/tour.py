"""\
docs/tour.py — a guided tour of one real DATPO step: docs/tour.md, written from what each function returned.

    python docs/tour.py                          # docs/tour.md: the embedded SmolLM2-135M, 2 prompts (~1 min)
    python docs/tour.py --scale tiny --out X.md  # the same at test size (a tiny random model)
    python docs/tour.py --alpha_start 0.4 --out X.md   # any train.py flag (or an edit of config.py's
                                                        # defaults: the exercise at the page's end)

It runs `train.train_step` once — the real step, not a copy of it — with the stage functions it calls wrapped
so that each records what it was given and what it gave back (`Trace`). The page then follows Algorithm DATPO
(App. E.3) phase by phase with those numbers, each phase beside the code that computed them (excerpts read
from the source by this script, so they cannot drift): the prompts, the N base responses with their token
entropies and sentences, V(root), K̂ and B̂, the forks, the tree's blocks, the Monte-Carlo values, Â_base,
Div_sib and α, the final advantages, a packed tree and its attention mask, and the clipped loss of the update
in both of its epochs — the second one's ratios moved by the first epoch's AdamW step, some of them clipped;
the viewer's picture of the step's trees (harness/viz.py) is written beside the page (<page>_tree.png).

So that the clip is seen acting, the tour's step runs two PPO epochs (the demo: one).
It runs in float64, so that any CPU writes the same page to the last printed digit (fp32 sums round
differently on other matrix kernels): the committed docs/tour.md is exactly what this script writes, and
tests/test_tour.py regenerates it and compares.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from runtime import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (runtime/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import ast  # noqa: E402

import torch  # noqa: E402

import advantage  # noqa: E402
import config  # noqa: E402
import evaluate  # noqa: E402
import optim  # noqa: E402
import packing  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
import tree  # noqa: E402
from harness import cli, loop, tracking, viz  # noqa: E402

# What the tour runs: the demo's model and settings, 2 prompts, the first step of a 24-step run (α = 0.2),
# two PPO epochs so that the second epoch's ratios move and the clip acts. No algorithm knob is set here:
# an edit of Config's defaults in config.py reaches the page, and so does any train.py flag (which wins).
TOUR = dict(prompts_per_step=2, log_trees_every=0, eval_every=0, save_every=0, seed=6, ppo_epochs=2)
# Per scale, lengths; at tiny scale also the demo's tree (N, K_max, B_max) = (4, 2, 2) and sent-entropy forks
# (the tiny scale's own are tok-entropy: a random model writes no sentences worth the name)
SIZES = {"demo": dict(max_new_tokens=48), "tiny": dict(max_new_tokens=16, n_base=4, fork="sent-entropy")}
# The functions the tour watches: (owner, name). Each call's arguments and result are recorded in order.
WATCHED = [(rollout, "plan_prompt"), (tree, "sentence_spans"), (tree, "select_forks"),
           (rollout, "rollout_trees"), (advantage, "alpha_at"), (advantage, "score_tree"),
           (packing, "minibatches"), (packing, "loss_normaliser"), (packing, "pack"),
           (train, "clipped_objective"), (train, "ppo_update")]


@dataclass
class Trace:
    """Every watched call of one step, in order: (function name, args, kwargs, result)."""
    calls: list = field(default_factory=list)

    def of(self, name: str) -> list:
        return [c for c in self.calls if c[0] == name]

    @contextlib.contextmanager
    def watching(self):
        """Wrap the WATCHED functions while the step runs; put the originals back after."""
        originals = [(owner, name, getattr(owner, name)) for owner, name in WATCHED]
        for owner, name, real in originals:
            setattr(owner, name, self._recorder(name, real))
        try:
            yield self
        finally:
            for owner, name, real in originals:
                setattr(owner, name, real)

    def _recorder(self, name: str, real):
        @functools.wraps(real)
        def record(*args, **kwargs):
            result = real(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result
        return record


def tour_config(argv: list[str], out_dir: str) -> tuple[config.Config, Path]:
    """The tour's Config from train.py's flags (its --preset/--scale: the demo's by default; TOUR and SIZES
    under the flags given) and the page to write (--out)."""
    parser = cli.build_parser("docs/tour.py: one real DATPO step, written up (docs/tour.md); every flag "
                              "is train.py's", own=lambda p: p.add_argument(
                                  "--out", default=str(ROOT / "docs" / "tour.md"), help="the page to write"))
    args = parser.parse_args(argv)
    preset = cli.scanned(argv, "--preset")
    scale = args.scale or (config.PRESETS[preset][0] if preset in config.PRESETS else "demo")
    if scale not in SIZES:
        parser.error(f"--scale {scale}: the tour runs at {' or '.join(SIZES)} scale")
    try:
        given = cli.given_flags(args, exclude=("out_dir", "threads"), preset=preset or "paper", scale=scale)
        ours = {**TOUR, **SIZES[scale]}
        cfg = config.make_config(preset or "paper", scale, **{**ours, **given}, out_dir=out_dir, threads=1)
    except ValueError as err:
        parser.error(str(err))
    cfg.set_by.update({**dict.fromkeys(ours, "docs/tour.py"), **dict.fromkeys(given, "the command line")})
    return cfg, Path(args.out)


def run_step(cfg: config.Config):
    """Set up a run as train.train does (harness/loop.py's Run), in float64, and trace its first step."""
    with loop.Run(cfg, evaluate.evaluate_problems) as run:
        model, tokenizer = run.load_policy()
        model.double()                                     # float64: the same page on any CPU
        embedder = run.load_embedder()
        if embedder is not None:
            embedder.double()
        optimizer = optim.build_optimizer(model.parameters(), cfg)
        learner = train.Learner(cfg, model, tokenizer, optimizer, embedder, weights_ok=run.weights_ok,
                                reward=run.reward_scorer(tokenizer), reference=run.load_reference())
        stream = run.prompt_stream(learner)
        run.start(learner)
        batch = stream.next_batch(0)
        with Trace().watching() as trace:
            result = train.train_step(learner, batch, 0, run.rng)
        run.log.close()
    return trace, tokenizer, batch, result


# --------------------------------------------------------------------------------------------------------
# Code excerpts, read from the source
# --------------------------------------------------------------------------------------------------------
def excerpt(function, start: str | None = None, stop: str | None = None) -> str:
    """The source of `function` (its docstring and blank lines left out), or its lines from the first
    containing `start` through the first after it containing `stop`, widened to whole statements
    (whole_statements), as a fenced block headed by where it is. The block parses as Python (a test reads
    every block of docs/*.md)."""
    source = inspect.getsource(inspect.unwrap(function))
    path = Path(inspect.getsourcefile(inspect.unwrap(function))).relative_to(ROOT)
    lines = source.splitlines()
    definition = ast.parse(textwrap_dedent(source)).body[0]
    if start is None:
        doc = definition.body[0] if ast.get_docstring(definition) else None
        skipped = set(range(doc.lineno - 1, doc.end_lineno)) if doc else set()
        text = "\n".join(line for i, line in enumerate(lines) if i not in skipped and line.strip())
    else:
        begin = next(i for i, line in enumerate(lines) if start in line)
        end = next(i for i, line in enumerate(lines) if i >= begin and stop in line) if stop else begin
        begin, end = whole_statements(definition, begin, end)
        text = "\n".join(lines[begin:end + 1])
    text = textwrap_dedent(text).rstrip()
    ast.parse(text)   # an excerpt that does not parse is this script's bug: stop here, not on the page
    return f"`{path}`, `{function.__qualname__}`:\n\n```python\n{text}\n```\n"


def textwrap_dedent(text: str) -> str:
    """`text` with the indentation its lines share removed."""
    indent = min(len(line) - len(line.lstrip()) for line in text.splitlines() if line.strip())
    return "\n".join(line[indent:] for line in text.splitlines())


def whole_statements(definition: ast.AST, begin: int, end: int) -> tuple[int, int]:
    """Source lines begin..end (0-based, in the function's source) widened so that no statement is cut: a
    statement the range starts inside begins it, and one it ends inside, or whose first line it holds,
    ends it whole (a `for` header brings its body)."""
    changed = True
    while changed:
        changed = False
        for node in ast.walk(definition):
            if not isinstance(node, ast.stmt) or node is definition:
                continue
            first, last = node.lineno - 1, node.end_lineno - 1
            own_last = node.body[0].lineno - 2 if hasattr(node, "body") and node.body else last
            if first < begin <= own_last:                  # begins inside a statement's own lines
                begin, changed = first, True
            if begin <= first <= end < last:               # holds a statement's start, not its end
                end, changed = last, True
    return begin, end


# --------------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------------
def cell(text: str, width: int = 70) -> str:
    """Text for a table cell: one line, `|` escaped, cut to `width` characters."""
    one = " ".join(str(text).split()).replace("|", "\\|")
    return one if len(one) <= width else one[:width - 1] + "…"


def table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def num(x, digits: int = 4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def render(trace: Trace, tok, batch, result, cfg: config.Config, picture: str) -> str:
    trees = result.trees
    plans = planned(trace, trees)
    return "\n".join([intro(cfg), section_prompts(batch), section_bases(plans, tok),
                      section_budget(plans, cfg), section_forks(plans, tok, cfg), section_blocks(trees),
                      section_advantages(trace, trees, picture), section_packed(trace, result),
                      section_update(trace, result.update, cfg), section_exercise(trace, cfg)])


def draw_trees(result, tok, cfg: config.Config, path: Path) -> str:
    """The viewer's picture of the step's trees (harness/viz.py's PNG, from the records the run's tree log
    would hold: tracking.tree_record) at `path`; returns its file name, for the page."""
    records = [{"step": 1, "tree": i, "method": cfg.method, "alpha": result.alpha,
                **tracking.tree_record(tr, tok, scores, cfg.value_estimate, cfg.sibling_groups)}
               for i, (tr, scores) in enumerate(zip(result.trees, result.scores))]
    records = json.loads(json.dumps(records))   # as the log holds them (tracking.write_trees)
    viz.render_png(records, f"docs/tour.py: step 1, {cfg.method}, α = {result.alpha:.3f}", path)
    return path.name


def intro(cfg: config.Config) -> str:
    return f"""# A guided tour of one DATPO step

Algorithm DATPO (paper App. E.3) with real numbers: one training step of `{cfg.model}` on `{cfg.train_data}`,
{cfg.prompts_per_step} prompts, N = {cfg.n_base} base responses each, K_max = {cfg.k_max}, \
B_max = {cfg.b_max},
{cfg.fork} forks, α from {cfg.alpha_start} to {cfg.alpha_end} over {cfg.steps} steps, seed {cfg.seed}, lr \
{cfg.lr:g}; {cfg.ppo_epochs} PPO epochs (the demo runs one: the second shows the clip at work), in float64
(so that every CPU writes this page to the last digit).
Written by `python docs/tour.py`, which runs `train.train_step` once and records what each function below
was given and returned; nothing on this page is computed by the page itself, and the code shown is read from
the source as it is. tests/test_tour.py writes the page again and compares.
Read it beside the code: `train.train` is the loop, `train.train_step` the step, top to bottom.

{excerpt(train.train, "for step in run.steps", "run.end_step")}"""


def section_prompts(batch) -> str:
    rows = [[i, cell(p[-160:], 90), cell(a, 20)]
            for i, (p, a) in enumerate(zip(batch.prompts, batch.answers))]
    return ("## 1. Sample prompts q ~ Q — `prompts.PromptStream.next_batch`\n\n"
            "The data stream (`data.problem_index`: shuffled epochs) gives the step's problems; "
            "`data.format_prompt` turns each into the prompt the model sees (its end shown).\n\n"
            + table(["prompt", "prompt text (end)", "gold answer"], rows))


@dataclass
class Planned:
    """One prompt as rollout.plan_prompt saw it: its N base responses and, per response, the sentences
    (tree.sentence_spans) and forks (tree.select_forks) computed for it."""
    prompt: int
    tokens: list
    entropies: list
    rewards: list
    plan: tree.ForkPlan                                  # V(root), K̂, B̂, forks per response
    sentences: dict = field(default_factory=dict)        # response j -> (text, token spans)
    forks: dict = field(default_factory=dict)            # response j -> chosen prefix lengths f


def planned(trace: Trace, trees: list[tree.Tree]) -> list[Planned]:
    """Group the calls by prompt. A call is recorded when it returns, so a prompt's sentence_spans and
    select_forks calls come just before its plan_prompt; a response is recognised by its entropy list."""
    out, pending = [], []
    for name, args, kwargs, result in trace.calls:
        if name in ("sentence_spans", "select_forks"):
            pending.append((name, args, kwargs, result))
        elif name == "plan_prompt":
            bases, rewards = args[7], args[8]                      # engine.Samples, their rewards
            tokens, entropies = [b.tokens for b in bases], [b.entropies for b in bases]
            prompt = next(i for i, tr in enumerate(trees) if tr.prompt_ids == args[6])
            item = Planned(prompt, tokens, entropies, rewards, result)
            text = None
            for call in pending:
                if call[0] == "sentence_spans":
                    text = (call[1][0], call[3])
                else:
                    j = next(j for j, h in enumerate(entropies) if h is call[1][2])
                    item.forks[j] = call[3]
                    if text is not None:
                        item.sentences[j], text = text, None
            out.append(item)
            pending = []
    return sorted(out, key=lambda x: x.prompt)


def section_bases(plans: list[Planned], tok) -> str:
    out = ["## 2. Phase 1: N base responses — `rollout.rollout_trees` (Sec. 3.2, App. C)\n\n",
           excerpt(train.train_step, "# ---- Phase 1+2", "tree_rollouts(") + "\n",
           "Each prompt is prefilled once and its N responses are sampled from it (`engine/`). For every "
           "token the engine records H_t, the entropy of the distribution it was sampled from (App. D.1); "
           "`reward.compute_reward` grades each response 0/1 against the gold answer (math-verify).\n"]
    for item in plans:
        rows = [[j, num(r, 0), len(t), num(sum(h) / max(len(h), 1), 3),
                 cell(tok.decode(t, skip_special_tokens=True))]
                for j, (t, h, r) in enumerate(zip(item.tokens, item.entropies, item.rewards))]
        out.append(f"\n**Prompt {item.prompt}**\n\n"
                   + table(["response j", "reward r", "tokens", "mean H_t", "text"], rows))
        pieces = [tok.decode([t], skip_special_tokens=True) for t in item.tokens[0]]
        shown = [cell(x.replace(" ", "␣").replace("\n", "⏎"), 20) or "∅" for x in pieces]   # ∅: EOS
        out.append("\nResponse 0 token by token, `piece`·H_t: "
                   + " ".join(f"`{x}`·{h:.2f}" for x, h in zip(shown, item.entropies[0])) + "\n")
    return "".join(out)


def section_budget(plans: list[Planned], cfg: config.Config) -> str:
    rows = [[item.prompt, " ".join(num(r, 0) for r in item.rewards), num(item.plan.v_root, 4),
             item.plan.k_hat, item.plan.b_hat] for item in plans]
    return ("\n## 3. Difficulty: V(root), K̂ and B̂ — `rollout.plan_prompt`, `tree.adaptive_budget` "
            "(Sec. 4.1, Eq. 1–2)\n\n"
            "V(root) is the mean reward of the N base responses; the budget grows with difficulty: "
            f"K̂ = ⌈K_max(1−V)⌉ forks per response (K_max = {cfg.k_max}) and B̂ = ⌈B_max(1−V)⌉ branches per "
            f"fork (B_max = {cfg.b_max}). A prompt every response solves (V = 1) grows no tree.\n\n"
            + excerpt(tree.adaptive_budget) + "\n"
            + table(["prompt", "base rewards", "V(root)", "K̂", "B̂"], rows))


def section_forks(plans: list[Planned], tok, cfg: config.Config) -> str:
    if cfg.fork != "sent-entropy":   # another strategy (--fork, or an edit of config.py): its forks
        rows = [[item.prompt, j, len(item.tokens[j]), " ".join(map(str, item.forks.get(j, []))) or "—"]
                for item in plans for j in range(len(item.tokens))]
        return (f"\n## 4. Forks: {cfg.fork} — `tree.select_forks` (App. D)\n\n"
                "A fork f is a prefix length: a branch keeps the response's first f tokens and samples token "
                "f on. Each response's forks:\n\n"
                + table(["prompt", "response j", "tokens", "forks f"], rows))
    out = ["\n## 4. Forks at the starts of the highest-entropy sentences — `tree.select_forks` "
           "(App. D, sent-entropy)\n\n",
           "Each response is split into sentences (`tree.sentence_spans`: PySBD, maths masked); a sentence's "
           "entropy H^S is the mean H_t of its tokens; the K̂ sentences with the highest H^S give the forks. "
           "A fork f is a prefix length: a branch keeps the response's first f tokens — the chosen "
           "sentence's first token included (Alg. \"Tree Rollout\": x_f = [q; τ_1:f]) — and samples "
           "token f on.\n\n", excerpt(tree.sent_entropy_tokens)]
    at_one = total = 0
    for item in plans:
        for j, (text, spans) in sorted(item.sentences.items()):
            h = item.entropies[j]
            forks = set(item.forks.get(j, []))
            at_one, total = at_one + (1 in forks), total + 1
            rows = [[m, f"[{a}, {b})", num(sum(h[a:b]) / (b - a), 3),
                     "fork f = " + str(a + 1) if a + 1 in forks else "",
                     cell(tok.decode(item.tokens[j][a:b], skip_special_tokens=True), 60)]
                    for m, (a, b) in enumerate(spans) if b > a]
            out.append(f"\n**Prompt {item.prompt}, response {j}** (K̂ = {item.plan.k_hat}): forks "
                       f"{sorted(forks)}\n\n" + table(["sentence", "tokens", "H^S", "chosen", "text"], rows))
    out.append(f"\n**Forks at f = 1** ({at_one} of the {total} responses above). The first sentence is a "
               "candidate like any other, and a short answer's first sentence — the model deciding how to "
               "begin — is often its most uncertain. A branch at f = 1 keeps only the response's first token "
               "and samples the rest: nearly a fresh response from the prompt, but one that counts as a "
               "sibling of the base response's continuation under the same fork (Eq. 10), not as another "
               "base response in V(root).\n")
    return "".join(out)


def section_blocks(trees: list[tree.Tree]) -> str:
    out = ["\n## 5. Phase 2: branches, and the tree cut into blocks — `rollout.rollout_trees` (App. C)\n\n",
           "B̂ branches grow from each fork, all prompts' rows in one running batch (`engine/`: a branch "
           "starts the moment its prompt's N bases end, its prefix read from the base's cached keys and "
           "values). Each base response is cut at its forks, and each branch is one more block: every "
           "generated token is in exactly one block. A terminal block carries the 0/1 reward of its whole "
           "root-to-leaf response.\n\n", excerpt(tree.split_at_forks)]
    for p, tr in enumerate(trees):
        rows = [[i, "prompt" if b.parent is None else b.parent, b.base, b.start,
                 "branch" if b.branch else "base", len(b.token_ids), num(b.reward, 0), cell(b.text, 60)]
                for i, b in enumerate(tr.blocks)]
        out.append(f"\n**Prompt {p}**: {len(tr.blocks)} blocks, {tr.leaves} leaves, {tr.generated_tokens} "
                   "generated tokens\n\n"
                   + table(["block", "parent", "response", "start", "kind", "tokens", "reward", "text"],
                           rows))
    return "".join(out)


def section_advantages(trace: Trace, trees: list[tree.Tree], picture: str) -> str:
    (_, args, _, alpha), = trace.of("alpha_at")
    out = ["\n## 6. Phase 3: values, advantages and sibling diversity — `advantage.score_tree` "
           "(Sec. 4.2, App. E.1)\n\n",
           excerpt(train.train_step, "# ---- Phase 3", "train_trees = ") + "\n",
           f"α = `advantage.alpha_at`({args[0]}, {args[1]}, {args[2]}, {args[3]}) = {num(alpha, 4)} "
           "(annealed linearly over the run). For each block b from state s_start to s_end: V_MC(s) is the "
           "mean reward of every terminal block below s (V after a terminal block is 0; V(root) averages "
           "every leaf of the tree); Â_base(b) = r(b) + V(s_end) − V(s_start) (Eq. 3); Div_sib(b) = 1 − mean "
           "cosine similarity to the blocks with the same start state (Eq. 10, `advantage.embed_blocks` "
           "embeds them); Â(b) = Â_base(b) + 1[Â_base(b) > 0]·α·Div_sib(b) (Eq. 4).\n\n",
           excerpt(advantage.score_tree)]
    for (_, args, _, scores), p in zip(trace.of("score_tree"), range(len(trees))):
        tr = args[0]
        rows = [[i, num(b.reward, 0) if b.terminal else "—", num(sc.v_start), num(sc.v_end),
                 num(sc.base_advantage), num(sc.div_sib), num(sc.advantage)]
                for i, (b, sc) in enumerate(zip(tr.blocks, scores))]
        out.append(f"\n**Prompt {p}**\n\n"
                   + table(["block", "r", "V(s_start)", "V(s_end)", "Â_base", "Div_sib", "Â"], rows))
    rows = [[p, num(tr.v_root), num(advantage.mc_root_value(tr.rewards)), tr.leaves]
            for p, tr in enumerate(trees)]
    out.append("\n**Two values of the root.** The V(s_start) of a root block above is V̂_MC(root), the "
               "mean reward of every leaf of the finished tree (`advantage.mc_root_value`, Eq. 3's value). "
               "Section 3's V(root) is the mean of the N base responses alone (`tree.Tree.v_root`, "
               "Sec. 4.1): it is known before any branch exists and sets K̂ and B̂. The branches then add "
               "leaves, so the two differ:\n\n"
               + table(["prompt", "V(root): N bases (Tree.v_root)", "V̂_MC(root): all leaves "
                        "(advantage.mc_root_value)", "leaves"], rows))
    out.append("\nThe viewer's picture of these trees (`python -m harness.viz RUN` draws a run's logged "
               "trees so; harness/viz.py): each prompt from left to right, one row per response and branch, "
               "blocks coloured by Â (red < 0 < green), a strip of token entropies under each, ▼ at the "
               f"forks, each leaf's reward in its circle.\n\n![the step's trees]({picture})\n")
    return "".join(out)


def section_exercise(trace: Trace, cfg: config.Config) -> str:
    """An exercise: an edit of config.py's defaults, and what it changes on this page, computed from the
    page's own numbers (Eq. 4 with α doubled)."""
    doubled = 2 * trace.of("alpha_at")[0][3]
    expected = []
    for p, (*_, scores) in enumerate(trace.of("score_tree")):
        for i, sc in enumerate(scores):
            if sc.base_advantage > 0 and sc.div_sib is not None and len(expected) < 3:
                after = sc.base_advantage + doubled * sc.div_sib
                expected.append(f"prompt {p} block {i}: Â {num(sc.advantage)} → {num(after)} "
                                f"(= {num(sc.base_advantage)} + {doubled:g} × {num(sc.div_sib)})")
    shown = "; ".join(expected) or "no block of this step has Â_base > 0, so none changes"
    return (f"\n## 9. Exercise: change α or the forking strategy in config.py, rerun, see Â change\n\n"
            "The tour's settings leave the algorithm's knobs to config.py, so an edit of a default of "
            f"`Config` reaches this step (the run says so at start: `alpha_start = {doubled:g} in config.py: "
            "in effect`). Edit one, run `python docs/tour.py --out /tmp/tour.md`, and compare with this page "
            f"(a flag does the same: `python docs/tour.py --alpha_start {doubled:g} --out /tmp/tour.md`).\n\n"
            f"- `alpha_start: float = {doubled:g}` (now {cfg.alpha_start:g}). α enters Phase 3 only, so "
            "the step samples the same responses (same seed): sections 1–5 do not change. In section 6, "
            f"α = {doubled:g}, twice the bonus: every block with Â_base > 0 gets Â = Â_base + "
            f"{doubled:g}·Div_sib, the others keep Â = Â_base (Eq. 4). Expected: {shown}. Section 8's "
            "ratios and loss move with them.\n"
            "- `fork: str = \"random\"`: forks at random prefix lengths, not at the starts of the "
            "highest-entropy sentences. The N base responses and V(root) come before any fork (sections 1–3 "
            "stay); section 4 lists the new forks, section 5's branches grow from them, so the trees, their "
            "values and every Â of section 6 change.\n\n"
            "Over whole runs: `python train.py --preset teach` before and after the edit (into another "
            "`--out_dir`), then `python -m studies dynamics --runs A B --checkpoints false` draws both runs "
            "step by step: reward, V(root), K̂/B̂, leaves, clip fraction, Â − Â_base, fork positions "
            "(README \"Ablations\").\n")


def depth_first(tr: packing.TrainTree) -> list[int]:
    """The tree's blocks in the order packing.pack lays them out (a block, then its children's subtrees)."""
    kids = packing.children_of(tr.parents)

    def visit(b: int) -> list[int]:
        return [b] + [x for c in kids[b] for x in visit(c)]
    return [x for root in kids[None] for x in visit(root)]


def section_packed(trace: Trace, result) -> str:
    """The first packed micro-batch's first tree, block by block: who attends to whom."""
    calls = trace.of("pack")
    if not calls:
        return ""
    (_, (trees, items, _), _, packed) = calls[0]
    t = min(it.tree for it in items)                                   # pack lays trees out in order
    tr = trees[t]
    needed = set(packing.needed_blocks(trees, [it for it in items if it.tree == t])[t])
    order = [b for b in depth_first(tr) if b in needed]
    assert packed.input_ids[:len(tr.prompt_ids) + sum(len(tr.tokens[b]) for b in order)] == \
        tr.prompt_ids + [x for b in order for x in tr.tokens[b]]        # the layout pack wrote
    labels = ["q"] + [f"b{b}" for b in order]
    lines = ["query \\ key  " + " ".join(f"{x:>3}" for x in labels)]
    for row, name in enumerate(labels):
        block = order[row - 1] if row else None
        path = {None, block} | set(packing.ancestors(tr.parents, block) if row else ())
        marks = ["■" if (order[col - 1] if col else None) in path else "·" for col in range(row + 1)]
        lines.append(f"{name:>11}  " + " ".join(m.rjust(3) for m in marks))
    sizes = ", ".join(f"b{b} {len(tr.tokens[b])}" for b in order)
    return ("\n## 7. Phase 4's forward: a tree packed under its attention mask — `packing.pack`\n\n"
            "The update forwards each tree once: the prompt q, then every block once, depth-first. A token "
            "attends to the prompt, to the blocks on its own root-to-leaf path and to the earlier tokens of "
            "its own block — so its log-probability is the one a separate forward of its root-to-leaf "
            "sequence gives, and a token shared by many paths is computed once. The first micro-batch of "
            f"this update packs prompt {t}'s tree ({len(packed)} tokens with the other trees packed beside "
            f"it; its blocks, in tokens: q {len(tr.prompt_ids)}, {sizes}). Block by block (■ attends, · does "
            "not; within a block, causal):\n\n```\n" + "\n".join(lines) + "\n```\n\n"
            "`packing.pack`'s docstring draws the same mask token by token on a 3-block tree "
            "(tests/test_packing.py checks that picture against pack itself). The rows layout "
            "(`--train_layout rows`: every leaf's path as its own row) computes the same log-probabilities "
            "and is the oracle the tests hold the packed layout to.\n")


def micro_rows(call, limit: int = 12) -> tuple[list[list], int, int]:
    """The first `limit` tokens of one clipped_objective call as table rows, and its clipped / all tokens."""
    (_, args, _, (objective, active)) = call
    new, old, adv = args[0].detach(), args[1].detach(), args[2].detach()
    ratio, objective = (new - old).exp(), objective.detach()
    order = sorted(range(len(adv)), key=lambda i: (not bool(active[i]), i))[:limit]   # clipped ones first
    rows = [[i, num(float(adv[i]), 4), num(float(ratio[i]), 4), num(float(objective[i]), 4),
             "yes" if active[i] else ""] for i in order]
    return rows, int(active.sum()), len(adv)


def section_update(trace: Trace, record: dict, cfg: config.Config) -> str:
    head = ("\n## 8. Phase 4: the clipped token-level loss — `train.ppo_update` (Eq. DATPO, App. F.2)\n\n"
            + excerpt(train.ppo_update, "for micro, new in forward.passes", "micro.loss = "))
    calls = trace.calls
    if not trace.of("clipped_objective"):
        return (head + "\nEvery advantage of this step is 0 (each prompt's responses all scored alike and no "
                "block earned a diversity bonus): no token has a gradient, so nothing was forwarded.\n")
    epoch_starts = [i for i, c in enumerate(calls) if c[0] == "minibatches"]
    first = next(c for c in calls[epoch_starts[0]:] if c[0] == "clipped_objective")
    second = [c for c in calls[epoch_starts[-1]:] if c[0] == "clipped_objective"]
    second = max(second, key=lambda c: int(c[3][1].sum())) if len(epoch_starts) > 1 else None
    norm = trace.of("loss_normaliser")[0][3]
    headers = ["token", "Â", "ρ", "min(ρÂ, clip(ρ)Â)", "clipped"]
    rows, clipped, n = micro_rows(first)
    objective = first[3][0].detach()
    out = [head, "\nEvery block's tokens carry its Â. For each micro-batch the update takes ρ = π_θ/π_θold "
           "per token and adds −Σ min(ρÂ, clip(ρ, 1−ε_low, 1+ε_high)Â) / (tokens of the mini-batch) to the "
           "loss; "
           f"after the mini-batch it clips the gradient norm to {cfg.max_grad_norm} and takes one AdamW "
           f"step (ε_low = {cfg.clip_low}, ε_high = {cfg.clip_high}).\n\n"
           f"**Epoch 1.** θ_old = θ: ρ = 1 and no token is clipped. Its first micro-batch "
           f"(`train.clipped_objective`, {len(rows)} of its {n} tokens; normaliser "
           f"`packing.loss_normaliser` = {norm}):\n\n" + table(headers, rows)
           + f"\nOver all {n} tokens Σ min(ρÂ, clip(ρ)Â) = {num(float(objective.sum()), 6)}, so its share of "
             f"the loss is −Σ / {norm} = {num(-float(objective.sum()) / norm, 6)}.\n"]
    if second is not None:
        rows, clipped, n = micro_rows(second)
        out.append("\n**Epoch 2.** The tokens again, after epoch 1's AdamW steps: ρ ≠ 1 now. In this "
                   f"epoch's micro-batch with the most clipped tokens, {clipped} of its {n} tokens are "
                   "clipped — ρ above 1 + ε_high where Â > 0, or below 1 − ε_low where Â < 0 — and their "
                   "gradient is cut: the objective no longer rewards moving them further (clipped tokens "
                   "first):\n\n" + table(headers, rows))
    out.append("\nThe update's record (`train.ppo_update` → metrics.jsonl):\n\n"
               + table(["loss", "clip_frac", "grad_norm", "optimizer_steps", "trained_blocks",
                        "unique_tokens"],
                       [[num(record["loss"], 6), num(record["clip_frac"], 4), num(record["grad_norm"], 4),
                         record["optimizer_steps"], record["trained_blocks"], record["unique_tokens"]]]))
    return "".join(out)


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else list(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg, out = tour_config(argv, run_dir)
        trace, tok, batch, result = run_step(cfg)
        picture = draw_trees(result, tok, cfg, out.with_name(out.stem + "_tree.png"))
        page = render(trace, tok, batch, result, cfg, picture)
    out.write_text(page, encoding="utf-8")
    print(f"wrote {out} and {out.with_name(picture)}")
    return out


if __name__ == "__main__":
    main()
