"""prompts.py — q ~ Q: the prompts of every step (Algorithm DATPO, App. E.3, "sample a batch of prompts").

train.py's loop asks `stream.next_batch(step)` for a step's prompts and tells `stream.after_step(...)` how the
step went. In between the algorithm sees one offpolicy.Batch. What changes the batch from step to step lives
here, outside the algorithm:

  order            the training problems in an endless, seeded stream of shuffled epochs (data.problem_index);
                   the cursor is all a checkpoint needs to continue it
  long prompts     a prompt longer than --max_prompt_tokens is skipped and counted (each named once); one
                   that cannot fit the model's context or the engine's KV pool is an error (check_fits)
  AttnRL           its dynamic batch size (attnrl_batch_size; methods.py's `dynamic_batch`)
  off-policy       --off_policy_steps 1 (offpolicy.py): the next step's prompts are drawn a step early; their
                   N base responses decode inside this step's rollout and come back in after_step
  torchrun         each rank rolls out its own share of the prompts (runtime/distributed.py)

state() / restore() are the stream's part of a checkpoint (trainer_state.pt), so a resumed run draws exactly
the prompts an uninterrupted one would.
"""
from __future__ import annotations

import math

import checks
import data
import methods
import offpolicy
from runtime import distributed, faults


class PromptStream:
    """The training prompts, step after step (see the module's docstring)."""

    def __init__(self, problems: list[dict], cfg, tokenizer, context: int | None, say=print):
        self.problems, self.cfg, self.tokenizer = problems, cfg, tokenizer
        self.context, self.say = context, say
        self.cursor = 0                     # position in the endless stream of shuffled problems
        self.skipped = 0                    # prompts skipped as longer than --max_prompt_tokens, so far
        self.batch_size = cfg.prompts_per_step   # prompts per step (AttnRL: its dynamic batch size)
        self.too_long: set[int] = set()     # problems skipped as too long (named once)
        self.ahead: offpolicy.Batch | None = None   # one-step off-policy: the next step's batch, sampled
        self.upcoming: offpolicy.Batch | None = None   # the batch whose bases this step samples

    def next_batch(self, step: int) -> offpolicy.Batch:
        """Step `step`'s prompts (0-based), this rank's share under torchrun: the batch drawn last step (its
        base responses already sampled) or a fresh one. With one-step off-policy the next step's prompts are
        drawn now too: `ahead_prompts` asks the rollout to sample their base responses."""
        batch = self.ahead or self.draw()
        self.upcoming = None
        if offpolicy.wants_next_batch(self.cfg.off_policy_steps, step, self.cfg.steps):
            self.upcoming = self.draw()
        mine = batch.shard(*distributed.shard_range(len(batch.prompts)))   # torchrun: this rank's prompts
        if self.upcoming:
            lo, hi = distributed.shard_range(len(self.upcoming.prompts))
            mine.ahead_prompts = self.upcoming.prompts[lo:hi]
        return mine

    def after_step(self, step: int, trees: list, ahead_bases: list | None) -> None:
        """After step `step`: keep the next step's batch with the base responses this step sampled for it
        (every rank keeps all of them: a checkpoint saves them, ranks take their share), and — AttnRL — aim
        the number of leaves that survive its filter at the initial batch's (attnrl_batch_size)."""
        if self.upcoming:
            self.upcoming.bases, self.upcoming.sampled_at = distributed.gather_lists(ahead_bases), step
        self.ahead, self.upcoming = self.upcoming, None
        method, cfg = methods.method_of(self.cfg), self.cfg
        if method.dynamic_batch:
            kept_leaves = sum(tr.leaves for tr in trees if method.trainable(tr))
            target = cfg.prompts_per_step * cfg.n_base * (1 + cfg.k_max * cfg.b_max)
            self.batch_size = attnrl_batch_size(self.batch_size, kept_leaves, target, cfg.attnrl_lambda,
                                                cap=4 * cfg.prompts_per_step)

    def draw(self) -> offpolicy.Batch:
        """The next `batch_size` prompts, answers, difficulty levels and problem indices (--reward functions
        receive their rows' columns), from the stream at the cursor. With
        --max_prompt_tokens > 0 longer prompts are skipped and counted (each named once); a problem whose
        characters alone exceed what the bound can hold in tokens is judged before tokenizing it: a 50 MB
        problem costs no minutes (data.surely_too_long)."""
        cfg, tokenizer = self.cfg, self.tokenizer
        prompts, answers, levels, indices = [], [], [], []
        misses = 0
        while len(prompts) < self.batch_size:
            index = data.problem_index(len(self.problems), self.cursor, cfg.seed)
            problem = self.problems[index]
            self.cursor += 1
            n_prompt = at_least = data.surely_too_long(problem["problem"],
                                                       cfg.max_prompt_tokens or self.context, tokenizer)
            if not n_prompt:
                prompt = data.format_prompt(problem["problem"], tokenizer, cfg.prompt_style, cfg.few_shot)
                n_prompt = len(tokenizer(prompt, add_special_tokens=False).input_ids)
            if cfg.max_prompt_tokens and n_prompt > cfg.max_prompt_tokens:
                self.skip(index, f"{len(problem['problem'])} characters" if at_least
                          else f"{n_prompt} tokens")
                misses += 1
                if misses > len(self.problems):
                    raise faults.UserError(
                        f"--train_data {cfg.train_data}: every prompt is longer than --max_prompt_tokens "
                        f"{cfg.max_prompt_tokens}; expected problems that fit, or a larger "
                        f"--max_prompt_tokens")
                continue
            check_fits(n_prompt, cfg, self.context, f"{cfg.train_data} problem #{index}")
            prompts.append(prompt)
            answers.append(problem["answer"])
            levels.append(problem.get("level"))
            indices.append(index)
        return offpolicy.Batch(prompts, answers, levels, indices=indices)

    def skip(self, index: int, size: str) -> None:
        """A prompt longer than --max_prompt_tokens: one line per problem; later turns are counted only."""
        if index not in self.too_long:
            self.too_long.add(index)
            self.say(f"{self.cfg.train_data} problem #{index}: {size}, more than --max_prompt_tokens "
                     f"{self.cfg.max_prompt_tokens} tokens; skipped (each time it comes round)")
        self.skipped += 1

    def state(self) -> dict:
        """The stream's fields of a checkpoint's trainer state."""
        return {"cursor": self.cursor, "skipped_prompts": self.skipped, "batch_size": self.batch_size,
                "too_long": sorted(self.too_long), "ahead": self.ahead.to_state() if self.ahead else None}

    def restore(self, state: dict) -> None:
        """Back to a checkpoint's stream (older checkpoints lack the later fields)."""
        self.cursor = state["cursor"]
        self.skipped = state.get("skipped_prompts", 0)
        self.batch_size = state.get("batch_size", self.batch_size)
        self.too_long = set(state.get("too_long", ()))
        self.ahead = offpolicy.Batch.from_state(state.get("ahead"))


def check_fits(n_prompt: int, cfg, context: int | None, where: str) -> None:
    """A prompt is never skipped by default (the release defines max_prompt_len but never applies it), but
    one whose longest root-to-leaf sequence cannot fit the model's context, or whose tree cannot fit the
    engine's KV pool (--max_kv_tokens, checks.kv_pool_shortfall), is an error naming it."""
    faults.check_prompt_fits(
        n_prompt, methods.method_of(cfg).longest_response(cfg), context, where,
        flags=f" (--max_new_tokens {cfg.max_new_tokens}, --branch_length {cfg.branch_length})",
        fix="problems that fit: skip long prompts with --max_prompt_tokens N, or lower --max_new_tokens / "
            "use --branch_length remaining")
    short = checks.kv_pool_shortfall(cfg, n_prompt, where)
    if short:
        raise faults.UserError(short)


def attnrl_batch_size(batch: int, kept_leaves: int, target_leaves: int, lam: float, cap: int) -> int:
    """AttnRL's dynamic batch size: aim the number of leaves that survive filtering at the target
    (initial prompts × N × (1 + K·B)) with an EMA, B_t = ⌈(1−λ)·B_{t−1}·target/kept + λ·B_{t−1}⌉.
    Clamped to [1, cap] (our guard: with nothing kept the raw target is unbounded)."""
    wanted = batch * target_leaves / max(kept_leaves, 1)
    return int(min(cap, max(1, math.ceil((1 - lam) * wanted + lam * batch))))
