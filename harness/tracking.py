"""harness/tracking.py — what a run writes for people to watch it: metrics.jsonl, TensorBoard,
Weights & Biases, tree logs.

    python train.py --preset demo --report_to tensorboard          # then: tensorboard --logdir runs/demo
    python train.py --preset demo --report_to tensorboard wandb    # W&B offline unless WANDB_MODE=online

One writer (`Log`) feeds every sink, so metrics.jsonl and the trackers always hold the same numbers under
stable names (`tag`):
  train/<key>            every numeric field of a step record of metrics.jsonl (train/reward, train/v_root,
                         ...; nested ones by path: train/levels/3/leaves)
  eval/<data>/<key>      every numeric field of an evaluation record (eval/arith-test/avg@4,
                         eval/math500/pass@8)
  config                 the run's Config (TensorBoard: a JSON text; W&B: the run config)
  completions            with --log_completions_every N (step 1 and every N-th step), every leaf of the step:
                         prompt, completion (the root-to-leaf text), reward and the advantages of its blocks
                         (TensorBoard: a markdown table under the text tab; W&B: a wandb.Table), as TRL's
                         log_completions
The x-axis is the record's "step". `Log(..., enabled=False)` writes nothing (non-zero ranks of a
multi-process run).

Tree logs (`--log_trees_every N`: step 1 and every N-th step; 0 = never): RUN/trees/step_XXXXXX.jsonl, one
tree a line with its prompt, gold answer, V(root), K̂/B̂ and forks, and for each block its parent, text, token
ids and pieces, token entropies, reward, V(s_start)/V(s_end), Â_base, Div_sib and the advantage the update
used (Sec. 4.1-4.2, App. E: Phase 3's records, advantage.score_tree, written as they are).
`python -m harness.viz RUN --step N` draws them.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

import advantage as A
import checks
import data
import tree as T
from runtime import atomic, faults


def tags(record: dict) -> dict[str, float]:
    """The tracker names of a metrics.jsonl record's numeric fields (see the module docstring)."""
    if "eval" in record:
        prefix = f"eval/{record.get('data', record['eval'])}/"
    else:
        prefix = "train/"
    out: dict[str, float] = {}

    def add(name: str, value) -> None:
        # nested fields, e.g. "levels": {"3": {"leaves": ...}} → levels/3/leaves
        if isinstance(value, dict):
            for key, inner in value.items():
                add(f"{name}/{key}", inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)

    for key, value in record.items():
        if key != "step":
            add(prefix + key, value)
    return out


def _record_step(line: str) -> float:
    """A metrics line's step; a line torn by a kill mid-write counts as after every step (dropped)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


class Log:
    """metrics.jsonl (one JSON object per line), the trackers of --report_to, and console lines that do not
    break the tqdm bar. Trackers open on the first write, so a resumed run first drops the steps it redoes."""

    def __init__(self, run_dir, report_to=("none",), config: dict | None = None, enabled: bool = True,
                 jsonl: bool = True):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.report_to = [name for name in report_to if name != "none"]
        self.config = config or {}
        self.enabled = enabled
        self.jsonl = jsonl
        self.purge_step: int | None = None
        self.torn_lines: list[int] = []   # 1-based lines of metrics.jsonl that truncate_after found torn
        self._tb = None
        self._wandb = None
        if enabled:
            why = checks.missing_tracker(self.report_to)
            if why:
                raise RuntimeError(why)

    # ---- trackers ----
    def _open(self) -> None:
        if self._tb is None and "tensorboard" in self.report_to:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: a resumed run discards the events of the steps it is about to redo
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=self.purge_step)
            self._tb.add_text("config",
                              "```\n" + json.dumps(self.config, indent=2, sort_keys=True) + "\n```", 0)
        if self._wandb is None and "wandb" in self.report_to:
            import wandb

            # Offline unless the user asks for online (WANDB_MODE=online): nothing leaves the machine by
            # default.
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "datpo"), name=self.run_dir.name,
                                     dir=str(self.run_dir), config=self.config,
                                     mode=os.environ.get("WANDB_MODE", "offline"), reinit="finish_previous")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.jsonl:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                with open(self.path, "a", opener=atomic.no_follow) as f:   # never through a link
                    f.write(json.dumps(record) + "\n")
            except OSError as err:   # disk full, quota, read-only: one line, the checkpoints are untouched
                raise faults.WriteError(f"writing {self.path}: {faults.write_failure(err)}; the step's "
                                        f"record is lost, checkpoints are intact; free space and --resume "
                                        f"{self.run_dir}") from err
        if not self.report_to:
            return
        self._open()
        values = tags(record)
        if self._tb is not None:
            for tag, value in values.items():
                self._tb.add_scalar(tag, value, record["step"])
            self._tb.flush()   # a step takes seconds to minutes: flushing each record costs nothing
        if self._wandb is not None:
            self._wandb.log(values, step=record["step"])

    def completions(self, step: int, rows: list[dict]) -> None:
        """The step's completions (completion_rows) as a table in the trackers: TensorBoard text
        "completions" (markdown), W&B table "completions"; with no tracker, on the console, one line each
        (TRL prints them too). metrics.jsonl keeps numbers only."""
        if not self.enabled or not rows:
            return
        if not self.report_to:
            self.say(console_table(step, rows))
            return
        self._open()
        columns = list(rows[0])
        if self._tb is not None:
            self._tb.add_text("completions", markdown_table(columns, rows), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log({"completions": wandb.Table(columns=columns,
                                                         data=[[r[c] for c in columns] for r in rows])},
                            step=step)

    def truncate_after(self, step: int) -> int:
        """Drop records of steps after `step` (a resumed run repeats them); returns how many were dropped."""
        self.purge_step = step + 1
        if not self.enabled or not self.path.exists():
            return 0
        lines = self.path.read_text().splitlines()
        self.torn_lines = [n for n, line in enumerate(lines, 1)
                           if line.strip() and _record_step(line) == math.inf]
        kept = [line for line in lines if _record_step(line) <= step]
        atomic.write_text(self.path, "".join(line + "\n" for line in kept))
        return len(lines) - len(kept)

    def read(self) -> list[dict]:
        """metrics.jsonl's records, torn lines left out (read_metrics)."""
        return read_metrics(self.path)[0]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def say(self, text: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(text, file=sys.stderr)


def read_metrics(path) -> tuple[list[dict], list[int]]:
    """(records, 1-based numbers of torn lines) of a metrics.jsonl; a torn line (a kill mid-write, or any
    line that is not a JSON object with a step) is left out and named, never a traceback."""
    records, torn = [], []
    if not Path(path).exists():
        return records, torn
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        if _record_step(line) == math.inf:
            torn.append(n)
        else:
            records.append(json.loads(line))
    return records, torn


def lost_records(path, upto: int, torn: list[int], same_run: bool = True) -> list[str]:
    """Console lines for a resume at step `upto`: each torn line of metrics.jsonl by number (it was dropped),
    and the steps ≤ upto left with no record — they are not redone (the checkpoint is past them), so they
    are named. `same_run` False (a resume into a new --out_dir) names only the torn lines."""
    out = [f"{path} line {n}: torn (not a JSON record); dropped" for n in torn]
    if same_run and upto > 0:
        records, _ = read_metrics(path)
        logged = {r["step"] for r in records if "eval" not in r}
        missing = [s for s in range(1, upto + 1) if s not in logged]
        if missing:
            shown = ", ".join(map(str, missing[:20])) + (" ..." if len(missing) > 20 else "")
            out.append(f"{path}: no record of step(s) {shown} (lost before the checkpoint at step {upto}; "
                       f"those steps are not redone)")
    return out


# --------------------------------------------------------------------------------------------------------
# The step's line of metrics.jsonl
# --------------------------------------------------------------------------------------------------------
def step_record(step: int, result, prompts, t_step: float) -> dict:
    """The step's line of metrics.jsonl (`step`: steps done; `result`: train.StepResult; `prompts`:
    prompts.PromptStream): rollouts (reward, V(root), tree sizes), the update's statistics, rollout counters
    summed over ranks, and where the time went."""
    trees, train_trees, update, alpha = result.trees, result.train_trees, result.update, result.alpha
    rank_stats, seconds = result.rollout_stats, result.seconds
    rewards = [b.reward for tr in trees for b in tr.blocks if b.terminal]
    record = {
        "step": step,
        "reward": float(np.mean(rewards)),
        "v_root": float(np.mean([tr.v_root for tr in trees])),
        "pass_rate": float(np.mean([tr.pass_rate for tr in trees])),
        "leaves_per_prompt": float(np.mean([tr.leaves for tr in trees])),
        "generated_tokens_per_prompt": float(np.mean([tr.generated_tokens for tr in trees])),
        "k_hat": float(np.mean([tr.k_hat for tr in trees])),
        "b_hat": float(np.mean([tr.b_hat for tr in trees])),
        "prompts": len(trees),
        "blocks": sum(len(t.trained) for t in train_trees),
        "alpha": alpha,
        "policy_entropy": float(np.mean([h for tr in trees for b in tr.blocks for h in b.entropies])),
        **level_stats(trees),       # leaves and PassRate per difficulty level (Fig. "leaf count")
        **update,
        "recomputed_prefix_tokens": sum(r.recomputed_prefix_tokens for r in rank_stats),
        # one-step off-policy (offpolicy.py): updates between the weights that sampled a token and θ; the
        # stale (base) tokens trained; the next step's prompts and share of the decode loop's row-steps
        "policy_lag": max(tr.policy_lag for tr in trees),
        "stale_tokens": sum(len(b.token_ids) for tr in trees if tr.policy_lag
                            for b in tr.blocks if not b.branch),
        "ahead_prompts": len(prompts.ahead.prompts) if prompts.ahead else 0,
        "row_steps": sum(r.row_steps for r in rank_stats),
        "ahead_row_steps": sum(r.ahead_row_steps for r in rank_stats),
        # the engine's rows per decode step (0: generate)
        "mean_batch_rows": sum(r.row_steps for r in rank_stats) / sum(r.decode_steps for r in rank_stats)
        if any(r.decode_steps for r in rank_stats) else 0.0,
        "seconds_generation_ahead": max(r.seconds_ahead for r in rank_stats),   # part of seconds_generation
        "oom_retries": sum(r.oom_retries for r in rank_stats) + update["oom_retries"],   # rollout + update
        "skipped_prompts": prompts.skipped,
        **{f"seconds_{name}": value for name, value in seconds.items()},
        "seconds_step": time.perf_counter() - t_step,
    }
    record["seconds_other"] = record["seconds_step"] - sum(seconds.values())
    return record


def level_stats(trees: list[T.Tree]) -> dict:
    """Per difficulty level (MATH levels 1–5, arithmetic levels in the demo): prompts, mean leaves per prompt
    and mean PassRate of the step's trees (Sec. 5.2, Fig. "leaf count"). {} when no tree has a level, else
    {"levels": {"3": {"prompts": 2, "leaves": 20.0, "pass_rate": 0.5}, ...}}
    (string keys: a JSON log line)."""
    by_level: dict = {}
    for tr in trees:
        if tr.level is not None:
            by_level.setdefault(tr.level, []).append(tr)
    if not by_level:
        return {}
    return {"levels": {str(lv): {"prompts": len(group),
                                 "leaves": float(np.mean([tr.leaves for tr in group])),
                                 "pass_rate": float(np.mean([tr.pass_rate for tr in group]))}
                       for lv, group in sorted(by_level.items(), key=lambda kv: data.level_order(kv[0]))}}


# --------------------------------------------------------------------------------------------------------
# Tree logs
# --------------------------------------------------------------------------------------------------------
def trees_due(step: int, every: int) -> bool:
    """Log the trees of 1-based `step`? Step 1 (the untrained policy) and every `every`-th; never for 0."""
    return every > 0 and (step == 1 or step % every == 0)


def tree_record(tr: T.Tree, tokenizer, scores: list[A.BlockScore], value_estimate: str = "paper",
                sibling_groups: str = "paper") -> dict:
    """One tree as a JSON-able dict: the quantities of Sec. 4.1-4.2 / App. E for every block, as Phase 3
    computed them (advantage.score_tree: nothing is recomputed here).

    v_start/v_end: V at the block's start and end state (V_MC, or the release's with value_estimate
    "release"); base_advantage: Â_base(b) = r(b) + V(s_end) − V(s_start) (Eq. 3); div_sib: Div_sib(b)
    (Eq. 10, or the release's groups; None when no embeddings were computed); advantage: the value the update
    used, by the run's method (None when the tree was not trained, e.g. AttnRL's filtered trees). Token
    pieces join to the block's decoded text; entropies are rounded to 1e-3, logprobs (generation-time log p
    of each token; None when not recorded) to 1e-4.
    """
    blocks = []
    for i, (b, score) in enumerate(zip(tr.blocks, scores)):
        text, spans = T.decode_with_offsets(tokenizer, b.token_ids)
        blocks.append({
            "id": i, "parent": b.parent, "base": b.base, "start": b.start, "branch": b.branch,
            "terminal": b.terminal, "text": text, "tokens": [text[s:e] for s, e in spans],
            "token_ids": list(b.token_ids), "entropies": [round(float(h), 3) for h in b.entropies],
            "logprobs": None if b.logprobs is None else [round(float(lp), 4) for lp in b.logprobs],
            "reward": b.reward, "v_start": score.v_start, "v_end": score.v_end,
            "base_advantage": score.base_advantage, "div_sib": score.div_sib, "advantage": score.advantage,
        })
    return {"prompt": tr.prompt, "answer": tr.answer, "level": tr.level, "v_root": tr.v_root,
            "value_estimate": value_estimate, "sibling_groups": sibling_groups,
            "k_hat": tr.k_hat, "b_hat": tr.b_hat, "forks": tr.forks, "leaves": tr.leaves,
            "trained": bool(scores) and scores[0].advantage is not None, "blocks": blocks}


def write_trees(run_dir, step: int, trees: list[T.Tree], tokenizer, scores: list[list[A.BlockScore]],
                alpha: float, method: str, value_estimate: str = "paper",
                sibling_groups: str = "paper") -> Path:
    """RUN/trees/step_XXXXXX.jsonl: one tree a line (tree_record plus step, index, method and α); rewritten
    whole, so a resumed run that redoes a step replaces its file."""
    folder = Path(run_dir) / "trees"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step_{step:06d}.jsonl"
    tmp = None
    try:
        tmp = atomic.exclusive_temp(path)   # never a link planted in the folder
        with open(tmp, "w", encoding="utf-8") as f:
            for index, (tr, tree_scores) in enumerate(zip(trees, scores)):
                record = {"step": step, "tree": index, "method": method, "alpha": alpha,
                          **tree_record(tr, tokenizer, tree_scores, value_estimate, sibling_groups)}
                f.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        os.replace(tmp, path)
    except OSError as err:   # disk full: one line; the earlier tree logs and the checkpoints are untouched
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise faults.WriteError(f"writing {path}: {faults.write_failure(err)}; checkpoints are intact; "
                                f"free space and --resume {run_dir}") from err
    return path


def tree_logs(run_dir) -> tuple[dict[int, Path], list[Path]]:
    """({step: RUN/trees/step_XXXXXX.jsonl} as write_trees names them, [any other step_*.jsonl there]): a
    stray file (step_final.jsonl, step_1.jsonl, a copy) is never read as a step's log."""
    folder = Path(run_dir) / "trees"
    logs, stray = {}, []
    for path in sorted(folder.glob("step_*.jsonl")) if folder.is_dir() else []:
        number = path.name[len("step_"):-len(".jsonl")]
        if number.isascii() and number.isdigit() and path.name == f"step_{int(number):06d}.jsonl":
            logs[int(number)] = path
        else:
            stray.append(path)
    return dict(sorted(logs.items())), stray


_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(value):
    """A JSON value with each lone surrogate ("\\ud800" escaped in the file: not a character) replaced by
    U+FFFD, as a byte that is not UTF-8 is when the file is read."""
    if isinstance(value, str):
        return value if value.isascii() else _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_valid_unicode(v) for v in value]
    if isinstance(value, dict):
        return {_valid_unicode(k): _valid_unicode(v) for k, v in value.items()}
    return value


def completion_rows(trees: list[T.Tree], scores: list[list[A.BlockScore]], tokenizer) -> list[dict]:
    """Every leaf of the step's trees as a row: tree, leaf (its block), prompt (the text the model was given),
    completion (the root-to-leaf response, decoded whole), reward, and the advantage of each block on its path
    (root first, "→" between; one value for a parallel method's response; "-" where a block was not trained).
    What TRL's log_completions shows (prompt, completion, reward, advantage), for trees."""
    rows = []
    for t, (tr, tree_scores) in enumerate(zip(trees, scores)):
        for leaf, block in enumerate(tr.blocks):
            if not block.terminal:
                continue
            advantages = [tree_scores[b].advantage for b in T.path_to(tr.blocks, leaf)]
            text = tokenizer.decode(T.path_token_ids(tr.blocks, leaf), skip_special_tokens=True)
            rows.append({"tree": t, "leaf": leaf, "prompt": tr.prompt, "completion": text,
                         "reward": block.reward,
                         "advantage": " → ".join("-" if a is None else f"{a:+.3f}" for a in advantages)})
    return rows


def console_table(step: int, rows: list[dict], width: int = 72) -> str:
    """completion_rows for a terminal: a heading, then one line per leaf (its prompt's end and its
    completion on one line each, cut to `width` characters)."""
    def cut(text: str, most: int, end: bool = False) -> str:
        one = " ".join(str(text).split())
        if len(one) <= most:
            return one
        return "…" + one[-(most - 1):] if end else one[:most - 1] + "…"
    lines = [f"completions of step {step} (tree, leaf: reward, advantages root first; prompt end | "
             f"completion):"]
    lines += [f"  {r['tree']}, {r['leaf']}: {r['reward']:g}, {r['advantage']}\n"
              f"    {cut(r['prompt'], width // 3, end=True)} | {cut(r['completion'], width)}" for r in rows]
    return "\n".join(lines)


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    """A markdown table (TensorBoard renders its text tab as markdown); | and line breaks escaped."""
    def cell(value) -> str:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\r", "").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def read_trees(run_dir, step: int) -> list[dict]:
    """The trees logged at `step`; a clear error listing the logged steps when there is none. A torn line
    is left out with a line naming it; a log with no readable tree is a ValueError."""
    folder = Path(run_dir) / "trees"
    path = folder / f"step_{step:06d}.jsonl"
    if not path.exists():
        logged = list(tree_logs(run_dir)[0])
        raise FileNotFoundError(f"{path}: no tree log for step {step}; logged steps: "
                                f"{', '.join(map(str, logged)) or 'none (train with --log_trees_every N)'}")
    trees = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                trees.append(_valid_unicode(json.loads(line)))
            except ValueError:   # torn or corrupted: the other trees are still worth drawing
                print(f"{path} line {n}: torn (not JSON); that tree is left out", file=sys.stderr)
    if not trees:
        raise ValueError(f"{path}: holds no readable tree (empty or torn); expected one JSON tree a line, "
                         f"as train.py --log_trees_every writes")
    return trees


# --------------------------------------------------------------------------------------------------------
# evaluate.py's results
# --------------------------------------------------------------------------------------------------------
def eval_record(bench: str, result: dict, step: int) -> dict:
    """An evaluate.py result as a metrics record: tags eval/<bench>/avg@k, pass@k, maj@k
    with k spelled out."""
    k = result["k"]
    return {"step": step, "eval": "evaluate", "data": bench, f"avg@{k}": result["avg@k"],
            f"pass@{k}": result["pass@k"], f"maj@{k}": result["maj@k"],
            f"pass@{k}_unbiased": result["pass@k_unbiased"], "n_problems": result["n_problems"],
            "n_samples": result["n_samples"], "seconds": result.get("seconds", 0.0)}


def report_eval(out_dir, report_to, settings: dict, results: dict[str, dict], step: int = 0) -> None:
    """Send evaluate.py's results ({bench: metrics}) to the trackers of --report_to, written under out_dir
    (results.json stays the file of record). `step`: the checkpoint's training step (0 for a base model)."""
    if not [name for name in report_to if name != "none"]:
        return
    log = Log(out_dir, report_to, settings, jsonl=False)
    for bench, result in results.items():
        log.write(eval_record(bench, result, step))
    log.close()


def checkpoint_step(model: str) -> int:
    """The training step of a checkpoint folder (…/step_000024) or of a run folder's latest checkpoint;
    else 0."""
    path = Path(model)
    if (path / "checkpoints" / "latest").exists():
        path = path / "checkpoints" / (path / "checkpoints" / "latest").read_text().strip()
    name = path.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else 0
