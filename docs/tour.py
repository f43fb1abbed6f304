"""\
docs/tour.py — a guided tour of one real DATPO step: docs/tour.md, written from what each function returned.

    python docs/tour.py                          # docs/tour.md: the embedded SmolLM2-135M, 2 prompts (~1 min)
    python docs/tour.py --scale tiny --out X.md  # the same at test size (a tiny random model)

It runs `train.train_step` once — the real step, not a copy of it — with the stage functions it calls wrapped
so that each records what it was given and what it gave back (`Trace`). The page then follows Algorithm DATPO
(App. E) phase by phase with those numbers, naming the function that produced each one: the prompts, the N
base responses with their token entropies and sentences, V(root), K̂ and B̂, the forks, the tree's blocks,
the Monte-Carlo values, Â_base, Div_sib and α, the final advantages, and the clipped loss of the update.
tests/test_tour.py regenerates it at tiny scale and checks every number it prints against the formulas.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness import threads  # noqa: E402

# OpenMP reads its thread policy once, when torch loads: set it first (harness/threads.py says why)
os.environ.update(threads.policy_env(sys.argv[1:], os.environ))
import advantage as A  # noqa: E402
import config as C  # noqa: E402
import packing as P  # noqa: E402
import rollout as R  # noqa: E402
import train  # noqa: E402
import tree as T  # noqa: E402
from harness import loop  # noqa: E402

# What the tour runs: the demo's model and settings, 2 prompts, the first step of a 24-step run (α = 0.2).
TOUR = dict(prompts_per_step=2, n_base=4, k_max=2, b_max=2, fork="sent-entropy", log_trees_every=0,
            eval_every=0, save_every=0, seed=6)
SCALES = {"demo": dict(preset="demo", max_new_tokens=48),
          "tiny": dict(preset="tiny", max_new_tokens=16, alpha_start=0.2)}
# The functions the tour watches: (module, name). Each call's arguments and result are recorded in order.
WATCHED = [(train, "sample_prompts"), (R, "plan_prompt"), (T, "sentence_spans"), (T, "select_forks"),
           (R, "rollout_trees"), (A, "alpha_at"), (A, "score_tree"), (P, "loss_normaliser"),
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
        originals = [(module, name, getattr(module, name)) for module, name in WATCHED]
        for module, name, real in originals:
            setattr(module, name, self._recorder(name, real))
        try:
            yield self
        finally:
            for module, name, real in originals:
                setattr(module, name, real)

    def _recorder(self, name: str, real):
        @functools.wraps(real)
        def record(*args, **kwargs):
            result = real(*args, **kwargs)
            self.calls.append((name, args, kwargs, result))
            return result
        return record


def tour_config(scale: str, out_dir: str) -> C.Config:
    values = dict(SCALES[scale])
    preset = values.pop("preset")
    return C.make_config(preset, **TOUR, **values, out_dir=out_dir, threads=1)


def run_step(cfg: C.Config) -> tuple[Trace, loop.Setup, dict]:
    """Set up a run as train.py does (harness/loop.py) and trace its first step."""
    with contextlib.ExitStack() as held:
        s, run = loop.setup(cfg, held)
        with Trace().watching() as trace:
            record = train.train_step(s, run)
    return trace, s, record


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


def intro(cfg: C.Config, commit: str) -> str:
    return f"""# A guided tour of one DATPO step

Algorithm DATPO (paper App. E) with real numbers: one training step of `{cfg.model}` on `{cfg.train_data}`,
{cfg.prompts_per_step} prompts, N = {cfg.n_base} base responses each, K_max = {cfg.k_max}, \
B_max = {cfg.b_max},
{cfg.fork} forks, α from {cfg.alpha_start} to {cfg.alpha_end} over {cfg.steps} steps, seed {cfg.seed}.
Written by `python docs/tour.py` (commit {commit}): it runs `train.train_step` once and records what each
function below was given and returned; nothing on this page is computed by the page itself.
Read it beside the code: `train.train_step` is the step, top to bottom.

"""


def section_prompts(prompts: list[str], answers: list[str]) -> str:
    rows = [[i, cell(p[-160:], 90), cell(a, 20)] for i, (p, a) in enumerate(zip(prompts, answers))]
    return ("## 1. Sample prompts q ~ Q — `train.sample_prompts`\n\n"
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
    plan: T.ForkPlan                                     # V(root), K̂, B̂, forks per response
    sentences: dict = field(default_factory=dict)        # response j -> (text, token spans)
    forks: dict = field(default_factory=dict)            # response j -> chosen prefix lengths f


def planned(trace: Trace, trees: list[T.Tree]) -> list[Planned]:
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


def render(trace: Trace, s: loop.Setup, record: dict, commit: str) -> str:
    cfg, tok = s.cfg, s.tokenizer
    drawn = trace.of("sample_prompts")[0][3]            # an offpolicy.Batch
    prompts, answers = drawn.prompts, drawn.answers
    trees = trace.of("rollout_trees")[0][3][0]
    plans = planned(trace, trees)
    return "\n".join([intro(cfg, commit), section_prompts(prompts, answers), section_bases(plans, tok),
                      section_budget(plans, cfg), section_forks(plans, tok, cfg), section_blocks(trees),
                      section_advantages(trace, trees), section_update(trace, record, cfg)])


def section_bases(plans: list[Planned], tok) -> str:
    out = ["## 2. Phase 1: N base responses — `rollout.rollout_trees` (Sec. 3.2, App. C)\n\n",
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


def section_budget(plans: list[Planned], cfg: C.Config) -> str:
    rows = [[item.prompt, " ".join(num(r, 0) for r in item.rewards), num(item.plan.v_root, 4),
             item.plan.k_hat, item.plan.b_hat] for item in plans]
    return ("\n## 3. Difficulty: V(root), K̂ and B̂ — `rollout.plan_prompt`, `tree.adaptive_budget` "
            "(Sec. 4.1, Eq. 1–2)\n\n"
            "V(root) is the mean reward of the N base responses; the budget grows with difficulty: "
            f"K̂ = ⌈K_max(1−V)⌉ forks per response (K_max = {cfg.k_max}) and B̂ = ⌈B_max(1−V)⌉ branches per "
            f"fork (B_max = {cfg.b_max}). A prompt every response solves (V = 1) grows no tree.\n\n"
            + table(["prompt", "base rewards", "V(root)", "K̂", "B̂"], rows))


def section_forks(plans: list[Planned], tok, cfg: C.Config) -> str:
    out = ["\n## 4. Forks at the starts of the highest-entropy sentences — `tree.select_forks` "
           "(App. D, sent-entropy)\n\n",
           "Each response is split into sentences (`tree.sentence_spans`: PySBD, maths masked); a sentence's "
           "entropy H^S is the mean H_t of its tokens; the K̂ sentences with the highest H^S give the forks. "
           "A fork f is a prefix length: a branch keeps the response's first f tokens — the chosen "
           "sentence's first token included (Alg. \"Tree Rollout\": x_f = [q; τ_1:f]) — and samples "
           "token f on.\n"]
    for item in plans:
        for j, (text, spans) in sorted(item.sentences.items()):
            h = item.entropies[j]
            forks = set(item.forks.get(j, []))
            rows = [[m, f"[{a}, {b})", num(sum(h[a:b]) / (b - a), 3),
                     "fork f = " + str(a + 1) if a + 1 in forks else "",
                     cell(tok.decode(item.tokens[j][a:b], skip_special_tokens=True), 60)]
                    for m, (a, b) in enumerate(spans) if b > a]
            out.append(f"\n**Prompt {item.prompt}, response {j}** (K̂ = {item.plan.k_hat}): forks "
                       f"{sorted(forks)}\n\n" + table(["sentence", "tokens", "H^S", "chosen", "text"], rows))
    return "".join(out)


def section_blocks(trees: list[T.Tree]) -> str:
    out = ["\n## 5. Phase 2: branches, and the tree cut into blocks — `rollout.rollout_trees` (App. C)\n\n",
           "B̂ branches grow from each fork, all prompts' rows in one running batch (`engine/`: a branch "
           "starts the moment its prompt's N bases end, its prefix read from the base's cached keys and "
           "values). Each base response is cut at its forks, and each branch is one more block: every "
           "generated token is in exactly one block. A terminal block carries the 0/1 reward of its whole "
           "root-to-leaf response.\n"]
    for p, tr in enumerate(trees):
        rows = [[i, "prompt" if b.parent is None else b.parent, b.base, b.start,
                 "branch" if b.branch else "base", len(b.token_ids), num(b.reward, 0), cell(b.text, 60)]
                for i, b in enumerate(tr.blocks)]
        out.append(f"\n**Prompt {p}**: {len(tr.blocks)} blocks, {tr.leaves} leaves, {tr.generated_tokens} "
                   "generated tokens\n\n"
                   + table(["block", "parent", "response", "start", "kind", "tokens", "reward", "text"],
                           rows))
    return "".join(out)


def section_advantages(trace: Trace, trees: list[T.Tree]) -> str:
    (_, args, _, alpha), = trace.of("alpha_at")
    out = ["\n## 6. Phase 3: values, advantages and sibling diversity — `advantage.score_tree` "
           "(Sec. 4.2, App. E.1)\n\n",
           f"α = `advantage.alpha_at`({args[0]}, {args[1]}, {args[2]}, {args[3]}) = {num(alpha, 4)} "
           "(annealed linearly over the run). For each block b from state s_start to s_end: V_MC(s) is the "
           "mean reward of every terminal block below s (V after a terminal block is 0; V(root) averages "
           "every leaf of the tree); Â_base(b) = r(b) + V(s_end) − V(s_start) (Eq. 3); Div_sib(b) = 1 − mean "
           "cosine similarity to the blocks with the same start state (Eq. 10, `advantage.embed_blocks` "
           "embeds them); Â(b) = Â_base(b) + 1[Â_base(b) > 0]·α·Div_sib(b) (Eq. 4).\n"]
    for (_, args, _, scores), p in zip(trace.of("score_tree"), range(len(trees))):
        tr = args[0]
        rows = [[i, num(b.reward, 0) if b.terminal else "—", num(sc.v_start), num(sc.v_end),
                 num(sc.base_advantage), num(sc.div_sib), num(sc.advantage)]
                for i, (b, sc) in enumerate(zip(tr.blocks, scores))]
        out.append(f"\n**Prompt {p}**\n\n"
                   + table(["block", "r", "V(s_start)", "V(s_end)", "Â_base", "Div_sib", "Â"], rows))
    return "".join(out)


def section_update(trace: Trace, record: dict, cfg: C.Config) -> str:
    if not trace.of("clipped_objective"):
        return ("\n## 7. Phase 4: the clipped token-level loss — `train.ppo_update` (Eq. DATPO)\n\n"
                "Every advantage of this step is 0 (each prompt's responses all scored alike and no block "
                "earned a diversity bonus): no token has a gradient, so nothing was forwarded.\n")
    (_, args, _, (objective, active)) = trace.of("clipped_objective")[0]
    new, old, adv = args[0], args[1], args[2]
    new, old, adv, objective = new.detach(), old.detach(), adv.detach(), objective.detach()
    ratio = (new - old).exp()
    norm = trace.of("loss_normaliser")[0][3]
    rows = [[t, num(float(a), 4), num(float(r), 4), num(float(o), 4), "yes" if c else ""]
            for t, (a, r, o, c) in enumerate(zip(adv, ratio, objective, active)) if t < 12]
    return ("\n## 7. Phase 4: the clipped token-level loss — `train.ppo_update` (Eq. DATPO, App. F.2)\n\n"
            "Every block's tokens carry its Â. The update forwards each tree once under a tree attention "
            "mask (`packing.py`), takes ρ = π_θ/π_θold per token and minimises "
            "−Σ min(ρÂ, clip(ρ, 1−ε_low, 1+ε_high)Â) / (tokens of the mini-batch), then clips the gradient "
            f"norm to {cfg.max_grad_norm} and takes one AdamW step per mini-batch. In the first mini-batch "
            "of a one-epoch update θ_old = θ, so ρ = 1 and no token is clipped. First micro-batch "
            f"(`train.clipped_objective`, its first {min(12, len(adv))} of {len(adv)} tokens; normaliser "
            f"`packing.loss_normaliser` = {norm}):\n\n"
            + table(["token", "Â", "ρ", "min(ρÂ, clip(ρ)Â)", "clipped"], rows)
            + f"\nOver all {len(adv)} tokens of the micro-batch Σ min(ρÂ, clip(ρ)Â) = "
              f"{num(float(objective.sum()), 6)}, so its share of the loss is −Σ / {norm} = "
              f"{num(-float(objective.sum()) / norm, 6)}.\n\n"
            + "The update's record (`train.ppo_update` → metrics.jsonl):\n\n"
            + table(["loss", "clip_frac", "grad_norm", "optimizer_steps", "trained_blocks", "unique_tokens"],
                    [[num(record["loss"], 6), num(record["clip_frac"], 4), num(record["grad_norm"], 4),
                      record["optimizer_steps"], record["trained_blocks"], record["unique_tokens"]]]))


def git_commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return sha.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=list(SCALES), default="demo")
    parser.add_argument("--out", default=str(ROOT / "docs" / "tour.md"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as run_dir:
        trace, s, record = run_step(tour_config(args.scale, run_dir))
        page = render(trace, s, record, git_commit())
    Path(args.out).write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
