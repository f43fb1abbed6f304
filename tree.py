"""tree.py — the tree of one prompt: where to fork, how much to branch,
and how it is cut into blocks.

Paper map:
  adaptive_budget      Sec. 4.1, Eq. (1)-(2): K̂ = ⌈K_max(1−V(root))⌉, B̂ = ⌈B_max(1−V(root))⌉
  ForkPlan             Sec. 4.1: one prompt's V(root), K̂, B̂ and forks (rollout.plan_prompt)
  attnrl_expansion     the AttnRL baseline's adaptive sampling (which base responses get branches)
  select_forks         App. D, Algorithm "Forking Points Selection" (random, fixed-seg, ATB,
                       tok-entropy, sent-entropy) and App. D.4 (distance-forced tok-entropy); one
                       function each: random_forks, fixed_segment_forks, tok_entropy_tokens,
                       sent_entropy_tokens, atb_tokens
  sentence_spans       App. D.1: PySBD sentences aligned to tokens through the offset mapping
  step_spans           App. D.1 (ATB): steps delimited by blank lines (their FCI scores: atb.py)
  branch_limit, max_path_tokens
                       App. F.2: how many new tokens a branch may add
                       (the 1024-token limit per generation)
  split_at_forks, Block, Tree
                       Sec. 4.2 and App. C.2: contiguous blocks bounded by forking points or the end
                       of a trajectory; every generated token is in exactly one block

Conventions (used by rollout.py and advantage.py):
  * A response is a list of generated token ids (EOS included when the model stopped).
  * A fork at position f (1 ≤ f ≤ n−1) is the prefix length a branch keeps: it continues
    [q; response[:f]] and samples token f on (0-indexed). By default (the paper's
    x_f = [q; τ_{1:f}]) the chosen token — the high-entropy token, the first token of the chosen
    sentence or step — is response[f−1] and stays in the prefix; select_forks(keep_token=False)
    resamples it instead (f = its index). f = 0 would only be another base response, and f = n
    would leave nothing of the base response after the fork: neither is a fork.
  * A tree is a flat list of Blocks; `parent` is the index of the block whose end state this block
    starts from (None = the prompt). Blocks with a reward are terminal (they end a root-to-leaf
    path).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

FORK_STRATEGIES = ("random", "fixed-seg", "atb", "tok-entropy", "sent-entropy")


# --------------------------------------------------------------------------------------------------
# Difficulty-adaptive budget (Sec. 4.1)
# --------------------------------------------------------------------------------------------------
def adaptive_budget(v_root: float, k_max: int, b_max: int) -> tuple[int, int]:
    """(K̂, B̂) = (⌈K_max(1−V)⌉, ⌈B_max(1−V)⌉), Eq. (1)-(2). V = 1 expands nothing.

    The product is rounded to 9 decimals before the ceiling: with N = 7 and 6 correct, 7·(1 − 6/7) =
    1.0000000000000004 in floating point, which a bare ceil would turn into 2.
    """
    if not 0.0 <= v_root <= 1.0:
        raise ValueError(f"v_root must be in [0, 1], got {v_root}")
    k_hat = math.ceil(round(k_max * (1.0 - v_root), 9))
    b_hat = math.ceil(round(b_max * (1.0 - v_root), 9))
    return int(k_hat), int(b_hat)


@dataclass
class ForkPlan:
    """One prompt's tree plan once its N base responses are graded (Sec. 4.1): V(root) = their mean
    reward, (K̂, B̂) = the budget at V(root), and for each base response j the forks it is expanded
    at (fork prefix lengths, as below); each fork gets B̂ branches."""
    v_root: float
    k_hat: int
    b_hat: int
    forks: list[list[int]]


def attnrl_expansion(rewards: list[float], rng) -> list[int]:
    """AttnRL's difficulty-adaptive sampling (Liu et al. 2025, used by the `attnrl` baseline,
    App. F.2): of the N base responses, ⌈N·exp(−acc)⌉ are expanded (acc = mean reward) — responses
    of the minority class (correct or wrong, correct on a tie) first, then random ones of the other
    class. An all-correct prompt expands nothing (AttnRL filters it out; the rare exception its code
    makes for prompts with high attention scores is not reproduced). Returns the indices of the
    responses to expand, sorted."""
    n = len(rewards)
    acc = sum(rewards) / n
    if acc >= 1.0:
        return []
    count = min(n, math.ceil(round(n * math.exp(-acc), 9)))
    correct = [i for i, r in enumerate(rewards) if r > 0]
    wrong = [i for i, r in enumerate(rewards) if r <= 0]
    minority, majority = (correct, wrong) if len(correct) <= len(wrong) else (wrong, correct)
    chosen = minority[:count]
    chosen += rng.sample(majority, count - len(chosen)) if count > len(chosen) else []
    return sorted(chosen)


# --------------------------------------------------------------------------------------------------
# Token offsets, sentences and steps
# --------------------------------------------------------------------------------------------------
def decode_with_offsets(tokenizer, token_ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decode generated ids to text and give each token its
    (start, end) character span in that text.

    Re-tokenising the decoded text could give different ids than the ones sampled, so offsets are
    taken from the sampled ids themselves: each token decoded alone, lengths accumulated. When a
    character is split across tokens (byte-level BPE on non-ASCII text) the pieces do not rejoin to
    the text; then the prefix lengths are measured by decoding growing prefixes (slower, exact).
    Special tokens (EOS) decode to nothing and get an empty span.
    """
    text = tokenizer.decode(token_ids, skip_special_tokens=True)
    pieces = tokenizer.batch_decode([[t] for t in token_ids], skip_special_tokens=True)
    if "".join(pieces) == text:
        ends = np.cumsum([len(p) for p in pieces]).tolist()
    else:
        ends = [len(tokenizer.decode(token_ids[: i + 1], skip_special_tokens=True))
                for i in range(len(token_ids))]
        ends = np.maximum.accumulate(np.minimum(ends, len(text))).tolist() if ends else []
    starts = [0] + ends[:-1]
    return text, list(zip(starts, ends))


_MATH = re.compile(r"\$\$.+?\$\$|\\\[.+?\\\]|\\\(.+?\\\)|\$[^$]+?\$", re.DOTALL)
_SEGMENTER = None


def _segmenter():
    global _SEGMENTER
    if _SEGMENTER is None:
        import pysbd  # imported lazily: only sent-entropy needs it

        _SEGMENTER = pysbd.Segmenter(language="en", clean=False, char_span=True)
    return _SEGMENTER


def _char_spans_to_token_spans(starts: list[int], offsets: list[tuple[int, int]],
                               text: str) -> list[tuple[int, int]]:
    """Map sentence start characters to token spans covering every token once, in order.

    A token belongs to the sentence holding its first non-space character (a leading space belongs
    to the word after it); a token with no such character (EOS, pure whitespace) joins the sentence
    of the token before it.
    """
    if not offsets:
        return []
    starts = np.asarray(starts)   # once: searchsorted on a list would convert it for every token
                                  # (quadratic)
    sentence_of = []
    current = 0
    for begin, end in offsets:
        chunk = text[begin:end]
        stripped = len(chunk) - len(chunk.lstrip())
        if end > begin and stripped < end - begin:
            anchor = begin + stripped
            current = max(current, int(np.searchsorted(starts, anchor, side="right")) - 1)
        sentence_of.append(current)
    spans, first = [], 0
    for i in range(1, len(sentence_of) + 1):
        if i == len(sentence_of) or sentence_of[i] != sentence_of[first]:
            spans.append((first, i))
            first = i
    return spans


def _sentence_starts(text: str) -> list[int]:
    """Where PySBD's sentences start in `text` (0 first). PySBD's own char_span=True looks each
    sentence up from the start of the text, quadratic in the number of sentences (a degenerate "1.
    1. 1. ..." of 12,000 characters took 3 s, the splitting itself 0.1 s); here each is found from
    where the one before it ended. A sentence PySBD changed (not found as written) starts nothing,
    as in its char_span."""
    starts, position = [0], 0
    for sentence in _segmenter().processor(text).process():
        sentence = sentence.strip()
        found = text.find(sentence, position) if sentence else -1
        if found >= 0:
            starts.append(found)
            position = found + len(sentence)
    return sorted(set(starts))


def sentence_spans(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """PySBD sentences as token spans (start inclusive, end exclusive), covering every token once
    (App. D.1).

    Maths is masked before splitting so that a full stop inside $...$, $$...$$, \\[...\\] or
    \\(...\\) does not end a sentence (PySBD otherwise splits display maths before its closing $$).
    """
    if not offsets:
        return []
    masked = _MATH.sub(lambda m: "x" * len(m.group()), text)
    char_starts = _sentence_starts(masked) if masked.strip() else [0]
    return _char_spans_to_token_spans(char_starts, offsets, text)


def step_spans(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Reasoning steps as token spans: a new step starts after each blank line (ATB, App. D.1)."""
    if not offsets:
        return []
    char_starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n", text) if m.end() < len(text)]
    return _char_spans_to_token_spans(sorted(set(char_starts)), offsets, text)


# --------------------------------------------------------------------------------------------------
# Forking-point selection (App. D, Algorithm "Forking Points Selection")
# --------------------------------------------------------------------------------------------------
def _top_positions(scores: list[float], positions: list[int], k: int) -> list[int]:
    """The k positions with the highest score; ties go to the earlier position (stable)."""
    order = sorted(range(len(positions)), key=lambda i: (-scores[i], positions[i]))
    return [positions[i] for i in order[:k]]


def select_forks(strategy: str, k: int, entropies, spans=None, rng=None, min_dist: float = 0.0,
                 step_scores=None, quantile: float = 0.8, keep_token: bool = True) -> list[int]:
    """K forking positions f (sorted, distinct, 1 ≤ f ≤ n−1) in a response of n = len(entropies)
    tokens.

    f is always the prefix length a branch keeps: it continues [q; response[:f]] and samples token f
    on (0-indexed). The token-choosing strategies pick a token t — the high-entropy token, the first
    token of a sentence or of a step — and with keep_token=True (the paper: Alg. "Tree Rollout"
    x_f = [q; τ_{1:f}] with 1-indexed f = that token; the release's `+ 1`) return f = t + 1, so t
    stays in the prefix and the branch resamples from the token after it. keep_token=False returns
    f = t: the chosen token itself is resampled (this code's earlier placement, kept as an option).
    Every fork must leave at least one token of the base response after it (its continuation block
    is not empty, and a branch never starts after the final stop token), so the candidate tokens are
    0 ≤ t ≤ n−2 when kept and 1 ≤ t ≤ n−1 when resampled (t = 0 resampled would only be another base
    response, which N already samples).
    One function per strategy below (App. D.1, Algorithm "Forking Points Selection"); random and
    fixed-seg choose prefix lengths directly, so keep_token does not change them. Fewer than K
    positions come back when the response is too short or has too few sentences/steps.
    """
    n = len(entropies)
    if k <= 0 or n < 2:
        return []
    k = min(k, n - 1)
    shift = 1 if keep_token else 0                   # f = t + shift
    lo, hi = 1 - shift, n - 1 - shift                # candidate tokens t: lo ≤ t ≤ hi
                                                     # ⇔  1 ≤ f ≤ n−1
    if strategy == "random":
        return random_forks(n, k, rng)
    if strategy == "fixed-seg":
        return fixed_segment_forks(n, k)
    if strategy == "tok-entropy":
        tokens = tok_entropy_tokens(entropies, k, lo, hi, min_dist)
    elif strategy == "sent-entropy":
        tokens = sent_entropy_tokens(entropies, k, lo, hi, spans)
    elif strategy == "atb":
        tokens = atb_tokens(k, lo, hi, spans, step_scores, quantile)
    else:
        raise ValueError(f"unknown forking strategy {strategy!r}; expected one of "
                         f"{', '.join(FORK_STRATEGIES)}")
    return sorted(t + shift for t in tokens)


def random_forks(n: int, k: int, rng) -> list[int]:
    """random (App. D.1): K prefix lengths uniformly from 1..n−1, without replacement
    (rng: random.Random)."""
    if rng is None:
        raise ValueError("select_forks('random') needs rng (a random.Random)")
    return sorted(rng.sample(range(1, n), k))


def fixed_segment_forks(n: int, k: int) -> list[int]:
    """fixed-seg (App. D.1): prefix lengths ⌊i·n/(K+1)⌋ for i = 1..K (K+1 equal segments)."""
    return sorted({max(1, (i * n) // (k + 1)) for i in range(1, k + 1)})


def tok_entropy_tokens(entropies, k: int, lo: int, hi: int, min_dist: float = 0.0) -> list[int]:
    """tok-entropy (App. D.1): the K candidate tokens lo ≤ t ≤ hi with the highest entropy H_t. With
    min_dist > 0 (App. D.4: 0.05, 0.10) candidates are taken greedily in entropy order and one
    closer than min_dist·n tokens to an already chosen token is skipped."""
    n = len(entropies)
    tokens = list(range(lo, hi + 1))
    chosen: list[int] = []
    for t in _top_positions([float(entropies[t]) for t in tokens], tokens, len(tokens)):
        if min_dist > 0 and any(abs(t - q) < min_dist * n for q in chosen):
            continue
        chosen.append(t)
        if len(chosen) == k:
            break
    return chosen


def sent_entropy_tokens(entropies, k: int, lo: int, hi: int, spans) -> list[int]:
    """sent-entropy (Sec. 4.1, App. D.1): `spans` are sentences (token spans); H^S_m = the mean
    token entropy of sentence m; the first tokens μ_m of the K highest sentences (with the token
    kept, the first sentence is a candidate too:
    keeping its first token is not a new base response)."""
    if spans is None:
        raise ValueError("select_forks('sent-entropy') needs spans (sentence token spans)")
    usable = [(a, b) for a, b in spans if lo <= a <= hi and b > a]
    scores = [float(np.mean([float(entropies[t]) for t in range(a, b)])) for a, b in usable]
    return _top_positions(scores, [a for a, _ in usable], k)


def atb_tokens(k: int, lo: int, hi: int, spans, step_scores, quantile: float = 0.8) -> list[int]:
    """atb (AttnRL; App. D.1): `spans` are steps and `step_scores` their FCI; candidates are steps
    scoring at or above the `quantile` (0.8) quantile of all steps, and the K earliest candidates
    give the chosen tokens (each step's first token);
    too few candidates → the earliest other steps."""
    if spans is None or step_scores is None or len(spans) != len(step_scores):
        raise ValueError("select_forks('atb') needs spans (steps) and one step_scores value "
                         "per step")
    if not spans:
        return []
    scores = np.asarray(step_scores, dtype=float)
    threshold = float(np.quantile(scores, quantile))
    if threshold <= 0 and (scores > 0).any():   # AttnRL: a zero quantile falls back to the least
                                                # positive
        threshold = float(scores[scores > 0].min())
    starts = [a for a, _ in spans if lo <= a <= hi]
    candidates = [a for (a, _), s in zip(spans, scores) if s >= threshold and lo <= a <= hi]
    # Fewer than K candidates: the earliest remaining steps fill the gap (AttnRL's code does the
    # same), so ATB spends the same budget as the other strategies.
    chosen = sorted(candidates)[:k]
    return chosen + [a for a in starts if a not in chosen][: k - len(chosen)]


# --------------------------------------------------------------------------------------------------
# Branch length (App. F.2 "maximum generation length of 1024 tokens")
# --------------------------------------------------------------------------------------------------
BRANCH_LENGTHS = ("full", "remaining")


def branch_limit(max_new_tokens: int, fork: int, length: str = "full") -> int:
    """New tokens a branch at fork f may generate. "full": max_new_tokens — App. F.2's limit applies
    to every generation, and the release generates each branch with max_gen_len new tokens;
    "remaining": max_new_tokens − f, so that every root-to-leaf response stays within
    max_new_tokens."""
    if length == "full":
        return max_new_tokens
    if length == "remaining":
        return max_new_tokens - fork
    raise ValueError(f"branch length must be one of {', '.join(BRANCH_LENGTHS)}, got {length!r}")


def max_path_tokens(max_new_tokens: int, length: str = "full") -> int:
    """The longest root-to-leaf response a tree can hold: a base response has ≤ max_new_tokens
    tokens and a fork keeps f ≤ max_new_tokens − 1 of them (select_forks), so a "full" branch path
    reaches 2·max_new_tokens − 1; with "remaining" every path stays within max_new_tokens."""
    return max_new_tokens - 1 + branch_limit(max_new_tokens, max_new_tokens - 1, length)


# --------------------------------------------------------------------------------------------------
# Blocks (Sec. 4.2, App. C.2)
# --------------------------------------------------------------------------------------------------
@dataclass
class Block:
    """A contiguous run of generated tokens between two forks
    (or a fork and the end of a trajectory)."""
    parent: int | None              # block whose end state this block starts from;
                                    # None = the prompt
    token_ids: list[int]
    entropies: list[float]          # H_t of the distribution each token was sampled from
    text: str = ""
    reward: float | None = None     # terminal blocks only (0/1 verifiable reward of the whole path)
    base: int = 0                   # which base response (0..N−1) the block grows from
    start: int = 0                  # position of its first token within its root-to-leaf response
    branch: bool = False            # a branch rollout (one terminal block)
                                    # rather than a piece of a base response
    logprobs: list[float] | None = None  # log p of each token under the distribution it was sampled
                                         # from, at generation time (the behaviour policy's; None
                                         # when not recorded)

    @property
    def terminal(self) -> bool:
        return self.reward is not None


@dataclass
class Tree:
    """One prompt's rollout tree and the per-tree statistics the paper reports
    (Fig. leaf count, PassRate)."""
    prompt: str
    prompt_ids: list[int]
    answer: str
    blocks: list[Block]
    v_root: float                   # mean reward of the N base responses (difficulty, Sec. 4.1)
    k_hat: int
    b_hat: int
    forks: list[list[int]] = field(default_factory=list)   # fork positions per base response
    level: int | None = None
    policy_lag: int = 0             # updates between the weights that sampled the base responses
                                    # and the weights being updated (1: one-step off-policy,
                                    # offpolicy.py); branches: 0

    @property
    def leaves(self) -> int:
        return sum(b.terminal for b in self.blocks)

    @property
    def generated_tokens(self) -> int:
        return sum(len(b.token_ids) for b in self.blocks)

    @property
    def pass_rate(self) -> float:
        """PassRate (App. C.2): 1 when any leaf is correct."""
        return float(any(b.reward == 1.0 for b in self.blocks))

    @property
    def parents(self) -> list[int | None]:
        return [b.parent for b in self.blocks]

    @property
    def rewards(self) -> list[float | None]:
        return [b.reward for b in self.blocks]

    @property
    def branch_flags(self) -> list[bool]:
        return [b.branch for b in self.blocks]


def split_at_forks(n: int, forks: list[int]) -> list[tuple[int, int]]:
    """A base response of n tokens with forks p1 < … < pk → [0,p1), [p1,p2), …, [pk,n)."""
    bounds = [0] + list(forks) + [n]
    if any(b >= c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"forks must be strictly increasing within (0, {n}): {forks}")
    return list(zip(bounds, bounds[1:]))


def base_blocks(base: int, token_ids: list[int], entropies: list[float], reward: float,
                forks: list[int], first_index: int, logprobs: list[float] | None = None
                ) -> tuple[list[Block], dict[int, int]]:
    """Cut one base response at its forks. Returns its blocks (the last is terminal, carrying the
    response's reward) and, for each fork f, the index of the block that ends at f — the parent of
    f's branches. logprobs (optional): the response's per-token generation-time log-probs,
    cut like its entropies."""
    if logprobs is not None and len(logprobs) != len(token_ids):
        raise ValueError(f"base_blocks: {len(logprobs)} log-probs for {len(token_ids)} tokens of "
                         f"base {base}")
    blocks, ends_at = [], {}
    for j, (a, b) in enumerate(split_at_forks(len(token_ids), forks)):
        parent = None if j == 0 else first_index + j - 1
        last = b == len(token_ids)
        blocks.append(Block(parent=parent, token_ids=list(token_ids[a:b]),
                            entropies=list(entropies[a:b]), reward=reward if last else None,
                            base=base, start=a,
                            logprobs=None if logprobs is None else list(logprobs[a:b])))
        ends_at[b] = first_index + j
    return blocks, ends_at


def path_to(blocks: list[Block], leaf: int) -> list[int]:
    """Block indices from the prompt down to `leaf`."""
    path = []
    node: int | None = leaf
    while node is not None:
        path.append(node)
        node = blocks[node].parent
    return path[::-1]


def path_token_ids(blocks: list[Block], leaf: int) -> list[int]:
    """The generated ids of the root-to-leaf response that ends in block `leaf`."""
    return [t for i in path_to(blocks, leaf) for t in blocks[i].token_ids]


def child_blocks(parents: list[int | None]) -> list[list[int]]:
    """The children of each block, in block order;
    a ValueError for a parent that is not another block."""
    children: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents):
        if p is not None:
            if not 0 <= p < len(parents) or p == i:
                raise ValueError(f"block {i}: parent {p} is not another block index")
            children[p].append(i)
    return children
