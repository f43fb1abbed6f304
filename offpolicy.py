"""offpolicy.py — one-step off-policy: the next step's base responses are sampled inside this step's rollout.

Paper: Sec. 5.1 and App. F define AttnRL with "a one-step off-policy" pipeline, and App. F.3's wall-clock
table has a row "DATPO w/ one-step off-policy" (60.0 h against 60.3 h): "branch rollouts cannot commence until
the base rollouts are fully generated", so the base phase of step t+1 is moved into step t, where it fills the
decode batch while step t's branches are sparse. The paper says no more; the authors' release
(`search_batch_with_next_roots`, flag `one_step_off_policy`) and AttnRL's code (`generate_sequences_mixed`)
sample batch t+1's roots in the same generation call as batch t's first branching round, with the weights of
step t before its update. Here (`--off_policy_steps 1`):

  step t:  draw step t+1's prompts  →  ONE engine run: step t's branches (current weights θ_t) + step t+1's
           N base responses per prompt (θ_t, before update t)  →  update t  →  θ_{t+1}
  step t+1: V(root), K̂, B̂ and forks from those base responses (their generation-time entropies, as the
           release), the bases prefilled once with θ_{t+1} so branches start from the fork's distribution
           under the current weights  →  branches (θ_{t+1}) + step t+2's bases  →  update t+1

So a step's base tokens are one update old (policy_lag 1) and its branch tokens are fresh (policy_lag 0).
The loss's old log-probs (Eq. DATPO's π_θold) for the stale base tokens are the behaviour policy's: the
per-token log-probabilities recorded when they were sampled (the paper's B ~ π_θold is the policy the blocks
were sampled from; the release uses generation-time log-probs for every token; fresh tokens keep ours,
recomputed under θ_t, which equal them up to rounding). The first step has nothing stale (its bases are
sampled on-policy in its own rollout) and the last step samples no next batch. What is in flight (the next
step's prompts and sampled bases) is part of the run's state: checkpoints save it and --resume restores it, so
a stopped and resumed run equals an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.samples import Sample


@dataclass
class Batch:
    """A step's prompts (prompts.PromptStream draws them). `bases` (one-step off-policy): per prompt, its N
    base responses already sampled by the engine (Samples: tokens, H_t and log p of each token under the
    sampling distribution), by the weights of step `sampled_at` (0-based: the weights after that many
    updates); `ahead_prompts`: the next step's prompts, whose N base responses this step's rollout samples
    in the same running batch (not saved: a checkpoint holds the next batch itself)."""
    prompts: list[str]
    answers: list[str]
    levels: list
    bases: list[list[Sample]] | None = None     # [prompt][j]
    sampled_at: int | None = None
    ahead_prompts: list[str] | None = None      # the next step's prompts, whose bases this step samples

    def to_state(self) -> dict:
        """For trainer_state.pt: plain lists and numbers, a base response as [tokens, entropies, logprobs]."""
        bases = None if self.bases is None else [[[s.tokens, s.entropies, s.logprobs] for s in per]
                                                 for per in self.bases]
        return {"prompts": self.prompts, "answers": self.answers, "levels": self.levels,
                "bases": bases, "sampled_at": self.sampled_at}

    @classmethod
    def from_state(cls, state: dict | None) -> "Batch | None":
        if not state:
            return None
        bases = None if state["bases"] is None else [[Sample(*response) for response in per]
                                                     for per in state["bases"]]
        return cls(state["prompts"], state["answers"], state["levels"], bases, state["sampled_at"])

    def lag(self, step: int) -> int:
        """policy_lag of its base tokens when trained at step `step` (0-based): updates since they were
        sampled."""
        return 0 if self.bases is None else step - self.sampled_at

    def shard(self, lo: int, hi: int) -> "Batch":
        """Prompts [lo, hi): this rank's share under torchrun."""
        return Batch(self.prompts[lo:hi], self.answers[lo:hi], self.levels[lo:hi],
                     None if self.bases is None else self.bases[lo:hi], self.sampled_at)


def wants_next_batch(off_policy_steps: int, step: int, steps: int) -> bool:
    """Whether step `step` (0-based) samples the next step's base responses: off-policy on and a next step to
    train them on (the last step generates nothing it would never train)."""
    return off_policy_steps > 0 and step + 1 < steps


def stale_logprobs(block_is_base: list[bool], block_logprobs: list, lag: int) -> list:
    """Per block: the behaviour log-probs the loss uses as old log-probs (a stale base block, lag > 0), or
    None (fresh: old log-probs are recomputed under the weights before the update)."""
    if lag <= 0:
        return [None] * len(block_is_base)
    missing = [i for i, (base, lp) in enumerate(zip(block_is_base, block_logprobs)) if base and lp is None]
    if missing:
        raise ValueError(f"off-policy: base blocks {missing} carry no generation-time log-probs; the engine "
                         f"records them (expected --rollout_engine engine)")
    return [list(lp) if base else None for base, lp in zip(block_is_base, block_logprobs)]
