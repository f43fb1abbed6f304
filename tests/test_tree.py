"""tree.py: budgets, forking strategies on hand-made arrays, sentence/step spans, blocks."""
import random
import time

import numpy as np
import pytest

import atb
import tree as T
from studies import forks


# ---- adaptive budget (Sec. 4.1, Eq. 1-2) --------------------------------------------------------------
@pytest.mark.parametrize("v, expected", [
    (0.0, (3, 4)), (0.25, (3, 3)), (0.5, (2, 2)), (0.75, (1, 1)), (1.0, (0, 0)),
])
def test_adaptive_budget_paper_defaults(v, expected):
    # K̂ = ⌈3(1−V)⌉, B̂ = ⌈4(1−V)⌉ by hand: V=.25 → ⌈2.25⌉=3, ⌈3⌉=3
    assert T.adaptive_budget(v, 3, 4) == expected


def test_adaptive_budget_guards_float_ceiling():
    v = 6 / 7                      # N = 7, 6 correct: 7 * (1 - 6/7) = 1.0000000000000004 in floating point
    assert 7 * (1 - v) > 1.0
    assert T.adaptive_budget(v, 7, 7) == (1, 1)
    with pytest.raises(ValueError):
        T.adaptive_budget(1.5, 3, 4)


# ---- forking strategies (App. D) ----------------------------------------------------------------------
def test_fixed_seg_positions():
    assert T.select_forks("fixed-seg", 3, [0.0] * 20) == [5, 10, 15]     # ⌊i·20/4⌋
    assert T.select_forks("fixed-seg", 2, [0.0] * 10) == [3, 6]          # ⌊10/3⌋, ⌊20/3⌋


def test_random_positions_distinct_in_range_and_seeded():
    a = T.select_forks("random", 4, [0.0] * 30, rng=random.Random(7))
    b = T.select_forks("random", 4, [0.0] * 30, rng=random.Random(7))
    assert a == b and a == sorted(set(a)) and len(a) == 4
    assert all(1 <= f <= 29 for f in a)
    # small response: K capped at n−1 and every valid position used
    assert T.select_forks("random", 9, [0.0] * 4, rng=random.Random(0)) == [1, 2, 3]


# Fork placement (App. C Alg. "Tree Rollout": x_f = [q; τ_{1:f}], 1-indexed f = the chosen token). A
# hand-built response of n = 10 tokens, three sentences, the last token a stop token. A fork f keeps
# RESPONSE[:f] and the branch resamples RESPONSE[f] onward, so "kept" = RESPONSE[f-1],
# "resampled" = RESPONSE[f].
RESPONSE = ["A", "b", "c", ".", " D", "e", ".", " F", "g", "<eos>"]
ENT = [0.1, 0.2, 0.3, 0.1, 9.0, 0.2, 0.1, 0.5, 0.4, 8.0]   # " D" highest; the stop token second
SENTS = [(0, 4), (4, 7), (7, 10)]                          # means: 0.175, 3.1, 2.967
STEPS = [(0, 4), (4, 7), (7, 10)]


def kept_and_resampled(forks):
    return [(RESPONSE[f - 1], RESPONSE[f]) for f in forks]


@pytest.mark.parametrize("method, k, kwargs, keep, expected", [
    # tok-entropy: the highest-entropy token " D" stays in the prefix; the branch resamples "e" ...
    ("tok-entropy", 1, {}, True, [(" D", "e")]),
    # ... and the stop token (2nd highest) is never kept: nothing would be left to generate → next best " F"
    ("tok-entropy", 2, {}, True, [(" D", "e"), (" F", "g")]),
    # resampling placement (keep_token=False): " D" itself is resampled; the stop token is resampled too
    ("tok-entropy", 1, {}, False, [(".", " D")]),
    ("tok-entropy", 2, {}, False, [(".", " D"), ("g", "<eos>")]),
    # sent-entropy: the sentence " De." has the highest mean; its first token " D" is kept ...
    ("sent-entropy", 1, dict(spans=SENTS), True, [(" D", "e")]),
    # ... and the first sentence is a candidate: keeping "A" is not a new base response
    ("sent-entropy", 3, dict(spans=SENTS), True, [("A", "b"), (" D", "e"), (" F", "g")]),
    ("sent-entropy", 1, dict(spans=SENTS), False, [(".", " D")]),
    ("sent-entropy", 3, dict(spans=SENTS), False, [(".", " D"), (".", " F")]),     # first sentence excluded
    # ATB: the chosen step's first token is kept (f = ν_l, 1-indexed), like sentences
    ("atb", 1, dict(spans=STEPS, step_scores=[0.1, 5.0, 0.2]), True, [(" D", "e")]),
    ("atb", 3, dict(spans=STEPS, step_scores=[0.1, 5.0, 0.2]), True, [("A", "b"), (" D", "e"), (" F", "g")]),
    ("atb", 1, dict(spans=STEPS, step_scores=[0.1, 5.0, 0.2]), False, [(".", " D")]),
    # fixed-seg: prefix lengths ⌊10/3⌋ = 3 and ⌊20/3⌋ = 6 whatever the placement
    ("fixed-seg", 2, {}, True, [("c", "."), ("e", ".")]),
    ("fixed-seg", 2, {}, False, [("c", "."), ("e", ".")]),
])
def test_fork_keeps_and_resamples(method, k, kwargs, keep, expected):
    forks = T.select_forks(method, k, ENT, keep_token=keep, **kwargs)
    assert kept_and_resampled(forks) == expected


def test_fork_never_after_the_final_token():
    # a sentence that is only the stop token, the most uncertain one: keeping its first token would leave
    # nothing to generate, so it is not a candidate; resampling it is allowed (a branch from before EOS)
    spans = [(0, 4), (4, 9), (9, 10)]
    ent = [0.1] * 9 + [9.0]
    assert T.select_forks("sent-entropy", 3, ent, spans=spans, keep_token=True) == [1, 5]
    assert T.select_forks("sent-entropy", 3, ent, spans=spans, keep_token=False) == [4, 9]
    # tok-entropy at the edge: two tokens → the only fork keeps token 0 and resamples token 1
    assert T.select_forks("tok-entropy", 3, [5.0, 9.0], keep_token=True) == [1]
    assert T.select_forks("tok-entropy", 3, [5.0, 9.0], keep_token=False) == [1]
    for keep in (True, False):
        for method, kw in [("tok-entropy", {}), ("sent-entropy", dict(spans=SENTS)), ("fixed-seg", {}),
                           ("random", dict(rng=random.Random(3))),
                           ("atb", dict(spans=STEPS, step_scores=[1.0, 1.0, 1.0]))]:
            forks = T.select_forks(method, 9, ENT, keep_token=keep, **kw)
            assert forks and all(1 <= f <= len(ENT) - 1 for f in forks), (method, keep, forks)


def test_random_is_a_prefix_length_whatever_the_placement():
    a = T.select_forks("random", 4, [0.0] * 30, rng=random.Random(7), keep_token=True)
    b = T.select_forks("random", 4, [0.0] * 30, rng=random.Random(7), keep_token=False)
    assert a == b


def test_tok_entropy_resampling_placement_excludes_position_zero():
    ent = [9.0, 0.1, 5.0, 0.2, 7.0, 0.3, 6.0]
    # resampled placement: position 0 has the highest entropy but a fork there would repeat a base response
    assert T.select_forks("tok-entropy", 3, ent, keep_token=False) == [2, 4, 6]
    # kept placement: token 0 is a candidate (kept, token 1 resampled); token 6 is last, never kept
    assert T.select_forks("tok-entropy", 3, ent, keep_token=True) == [1, 3, 5]


def test_tok_entropy_min_dist_spreads_clustered_forks():
    ent = np.zeros(100)
    ent[[40, 41, 42, 43]] = [9.0, 8.0, 7.0, 6.0]    # the top tokens cluster (localization, App. D.2)
    ent[[10, 80]] = [5.0, 4.0]
    assert T.select_forks("tok-entropy", 3, ent, keep_token=False) == [40, 41, 42]
    # min_dist 0.05 → candidates closer than 5 tokens to a chosen fork are skipped
    assert T.select_forks("tok-entropy", 3, ent, min_dist=0.05, keep_token=False) == [10, 40, 80]
    assert T.select_forks("tok-entropy", 3, ent, min_dist=0.05, keep_token=True) == [11, 41, 81]


def test_sent_entropy_uses_mean_and_sentence_starts():
    ent = [1.0, 1.0, 1.0,  5.0, 0.0,  2.0, 2.0, 2.0,  0.5, 0.5]
    spans = [(0, 3), (3, 5), (5, 8), (8, 10)]
    # sentence means: 1.0, 2.5, 2.0, 0.5 → a token-level max (5.0) does not decide alone
    assert T.select_forks("sent-entropy", 1, ent, spans=spans, keep_token=False) == [3]
    assert T.select_forks("sent-entropy", 2, ent, spans=spans, keep_token=False) == [3, 5]
    assert T.select_forks("sent-entropy", 2, ent, spans=spans) == [4, 6]          # default: first token kept
    # resampled placement: the first sentence starts at token 0 and is never a candidate
    ent0 = [9.0, 9.0, 9.0, 1.0, 1.0, 2.0, 2.0, 2.0, 0.5, 0.5]
    assert T.select_forks("sent-entropy", 4, ent0, spans=spans, keep_token=False) == [3, 5, 8]
    assert T.select_forks("sent-entropy", 1, ent0, spans=spans, keep_token=True) == [1]


def test_atb_quantile_then_earliest():
    spans = [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    scores = [9.0, 1.0, 8.0, 0.5, 7.0, 6.0]
    # 0.8 quantile (linear, sorted 0.5 1 6 7 8 9 → index 4) = 8.0 → candidates: steps scoring 9.0 (start 0)
    # and 8.0 (start 4). Resampled placement: start 0 is excluded, too few for K = 2, so the earliest other
    # step (start 2) fills in. Kept placement: step 0 is a candidate (its first token kept).
    assert np.quantile(scores, 0.8) == pytest.approx(8.0)
    kw = dict(spans=spans, step_scores=scores, keep_token=False)
    assert T.select_forks("atb", 1, [0.0] * 12, **kw) == [4]
    assert T.select_forks("atb", 2, [0.0] * 12, **kw) == [2, 4]
    # with quantile 0.5 (threshold 6.5): candidates start 4 and 8 → the 2 earliest
    assert T.select_forks("atb", 2, [0.0] * 12, quantile=0.5, **kw) == [4, 8]
    assert T.select_forks("atb", 2, [0.0] * 12, spans=spans, step_scores=scores) == [1, 5]


def test_unknown_method_and_missing_inputs_are_errors():
    with pytest.raises(ValueError, match="tok-entropy"):
        T.select_forks("bogus", 2, [0.0] * 5)
    with pytest.raises(ValueError):
        T.select_forks("sent-entropy", 2, [0.0] * 5)
    with pytest.raises(ValueError):
        T.select_forks("random", 2, [0.0] * 5)
    assert T.select_forks("tok-entropy", 2, [1.0]) == []          # nothing to fork in one token


def test_fci_scores_count_only_steps_far_enough_later():
    # 5 steps, one head: α[j, k] = attention of step j to step k
    alpha = np.zeros((1, 5, 5))
    alpha[0, 4, 0] = 0.5      # 4 steps later → counts for step 0 with gap 4
    alpha[0, 3, 0] = 0.25     # 3 steps later → not counted with gap 4
    alpha[0, 4, 1] = 0.125
    assert atb.fci_step_scores(alpha, gap=4) == [0.5, 0.0, 0.0, 0.0, 0.0]
    assert atb.fci_step_scores(alpha, gap=3) == [0.75, 0.125, 0.0, 0.0, 0.0]
    # max over (layer, head): a second head with a larger value wins
    two = np.concatenate([alpha, alpha * 2], axis=0)
    assert atb.fci_step_scores(two, gap=3) == [1.5, 0.25, 0.0, 0.0, 0.0]


def test_step_attention_averages_token_pairs():
    att = np.arange(16, dtype=float).reshape(1, 4, 4)
    spans = [(0, 1), (1, 4)]
    got = atb.step_attention(att, spans)
    assert got.shape == (1, 2, 2)
    assert got[0, 1, 0] == pytest.approx(np.mean([4, 8, 12]))       # queries 1..3 → key 0
    assert got[0, 1, 1] == pytest.approx(att[0, 1:, 1:].mean())


# ---- sentence and step spans (App. D.1) -----------------------------------------------------------------
def _offsets_of(text, pieces):
    offsets, pos = [], 0
    for p in pieces:
        offsets.append((pos, pos + len(p)))
        pos += len(p)
    assert pos == len(text)
    return offsets


def _check_cover(spans, n):
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a < b for a, b in spans)
    assert all(b == c for (_, b), (c, _) in zip(spans, spans[1:]))


def test_sentence_spans_keep_display_maths_whole():
    pieces = ["First", " we", " add", ".", " Then", " $$", "x", " =", " \\frac{n(n+1)}{2}", ".", "$$",
              " Next", ",", " the", " answer", " is", " $3.5$", ".", "\n\n", "Done", "!", ""]
    text = "".join(pieces)
    spans = T.sentence_spans(text, _offsets_of(text, pieces))
    _check_cover(spans, len(pieces))
    starts = [pieces[a].strip() for a, _ in spans]
    # PySBD alone splits before the closing $$; with maths masked the display equation stays in one sentence
    assert starts == ["First", "Then", "Done"]


def test_sentence_spans_with_real_tokenizer(smollm_tokenizer):
    text = "We know $a = 2.5$ and \\[b = 3.5.\\] So a + b = 6. Therefore the answer is \\boxed{6}."
    ids = smollm_tokenizer(text, add_special_tokens=False).input_ids + [smollm_tokenizer.eos_token_id]
    decoded, offsets = T.decode_with_offsets(smollm_tokenizer, ids)
    assert decoded == text
    assert offsets[-1][0] == offsets[-1][1]           # EOS decodes to nothing
    spans = T.sentence_spans(decoded, offsets)
    _check_cover(spans, len(ids))
    sentences = [decoded[offsets[a][0]:offsets[b - 1][1]].strip() for a, b in spans]
    # full stops inside $...$ and \[...\] end no sentence, so the first sentence runs to "= 6."
    assert sentences == ["We know $a = 2.5$ and \\[b = 3.5.\\] So a + b = 6.",
                         "Therefore the answer is \\boxed{6}."]


def test_sentence_spans_are_linear_in_the_number_of_sentences():
    """The sweep of tests/test_model_text.py's strategies found (issue 40): PySBD's char_span looks each
    sentence up from the start of the text, quadratic in the sentences: a degenerate "1. 1. 1. ..." of 12,000
    characters took 3 s. 10x the sentences must cost about 10x the time (a ratio in one run, so a loaded
    machine does not fail it; quadratic work is ~100x), and the starts are PySBD's own."""
    def seconds(n: int) -> float:
        text = "Yes. " * n
        start = time.process_time()
        spans = T.sentence_spans(text, [(i, i + 5) for i in range(0, len(text), 5)])
        elapsed = time.process_time() - start
        assert spans == [(i, i + 1) for i in range(n)]   # one sentence a "Yes. "
        return elapsed

    small = min(seconds(400) for _ in range(3))
    large = min(seconds(4000) for _ in range(2))
    assert large < 30 * small + 0.05, (small, large)
    for text in ["1. " * 50, "We add. Then $x = 1.5$ and so on! Mr. Smith agrees?\n\nDone"]:
        assert T._sentence_starts(text) == sorted({s.start for s in T._segmenter().segment(text)} | {0})


def test_step_spans_split_at_blank_lines():
    pieces = ["Step", " one", ".\n\n", "Step", " two", ".\n", "more", "\n\n", "End"]
    text = "".join(pieces)
    spans = T.step_spans(text, _offsets_of(text, pieces))
    assert spans == [(0, 3), (3, 8), (8, 9)]


# ---- blocks (Sec. 4.2) -----------------------------------------------------------------------------------
def test_base_blocks_cut_at_forks_and_carry_the_reward_on_the_last():
    ids = list(range(100, 110))
    blocks, ends_at = T.base_blocks(0, ids, [0.0] * 10, 1.0, [3, 7], first_index=5)
    assert [b.token_ids for b in blocks] == [ids[0:3], ids[3:7], ids[7:10]]
    assert [b.parent for b in blocks] == [None, 5, 6]
    assert [b.reward for b in blocks] == [None, None, 1.0]
    assert ends_at == {3: 5, 7: 6, 10: 7}
    assert all(b.logprobs is None for b in blocks)                 # not recorded: unknown, not zeros
    logprobs = [-0.1 * t for t in range(10)]
    cut, _ = T.base_blocks(0, ids, [0.0] * 10, 1.0, [3, 7], first_index=5, logprobs=logprobs)
    assert [b.logprobs for b in cut] == [logprobs[0:3], logprobs[3:7], logprobs[7:10]]
    with pytest.raises(ValueError, match="9 log-probs for 10 tokens"):
        T.base_blocks(0, ids, [0.0] * 10, 1.0, [3, 7], first_index=5, logprobs=logprobs[:9])
    with pytest.raises(ValueError):
        T.split_at_forks(10, [7, 3])


def test_sib_div_metric_by_hand():
    parents = [None, 0, 0, 0]                 # one fork (end of block 0) with 3 children
    emb = [[1, 0], [1, 0], [0, 1], [1, 1]]
    # pairwise cos among children: (1,2)=0, (1,3)=1/√2, (2,3)=1/√2
    expected = 1 - (0 + 2 / np.sqrt(2)) / 3
    assert forks.sib_div(parents, emb) == pytest.approx(expected)
    assert forks.sib_div([None, None], [[1, 0], [0, 1]]) is None     # the prompt is not a forking point
