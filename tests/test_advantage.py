"""advantage.py against hand computations from the paper's formulas (Sec. 4.2, App. E) and the baselines';
release.py's estimates (--preset release) against the release's."""
import math

import numpy as np
import pytest

import advantage as A
import config as C
import release as R


def paper_base(parents, rewards):
    """Eq. 3 with V_MC (App. E.1): the composition score_tree runs."""
    return A.base_advantages(rewards, *A.mc_values(parents, rewards))


def release_base(parents, rewards, branch):
    """Eq. 3 with the release's estimates."""
    return A.base_advantages(rewards, *R.release_values(parents, rewards, branch))

# A base response (reward 0) with two forks p1 < p2 and two branches at each:
#   block 0: base [0, p1)            parent None
#   block 1: base [p1, p2)           parent 0
#   block 2: base [p2, n)  r = 0     parent 1   (terminal: the base response's own tail)
#   block 3: branch at p1  r = 1     parent 0
#   block 4: branch at p1  r = 0     parent 0
#   block 5: branch at p2  r = 1     parent 1
#   block 6: branch at p2  r = 1     parent 1
TWO_FORKS_PARENTS = [None, 0, 1, 0, 0, 1, 1]
TWO_FORKS_REWARDS = [None, None, 0.0, 1.0, 0.0, 1.0, 1.0]


def test_mc_values_two_forks_by_hand():
    v_start, v_end = A.mc_values(TWO_FORKS_PARENTS, TWO_FORKS_REWARDS)
    v_root = (0 + 1 + 0 + 1 + 1) / 5            # every terminal block of the tree
    v_p1 = (0 + 1 + 0 + 1 + 1) / 5              # end of block 0: all terminals below it (tail included)
    v_p2 = (0 + 1 + 1) / 3                      # end of block 1: base tail + the two branches at p2
    assert v_start == pytest.approx([v_root, v_p1, v_p2, v_p1, v_p1, v_p2, v_p2])
    assert v_end == pytest.approx([v_p1, v_p2, 0, 0, 0, 0, 0])


def test_base_advantages_two_forks_by_hand():
    adv = paper_base(TWO_FORKS_PARENTS, TWO_FORKS_REWARDS)
    v_root, v_p1, v_p2 = 0.6, 0.6, 2 / 3
    expected = [
        0 + v_p1 - v_root,       # block 0
        0 + v_p2 - v_p1,         # block 1: moving from p1 to p2 raised the value
        0 + 0 - v_p2,            # block 2: the base tail failed
        1 + 0 - v_p1,            # block 3
        0 + 0 - v_p1,            # block 4
        1 + 0 - v_p2,            # block 5
        1 + 0 - v_p2,            # block 6
    ]
    assert adv == pytest.approx(expected)


def test_single_branch_fork_is_not_forced_to_zero():
    # base response (r = 0) with one fork and ONE branch (r = 1): the fork's value counts the base tail too,
    # so the branch is credited (the released code scored forks with new branches only → always 0 here)
    parents = [None, 0, 0]
    rewards = [None, 0.0, 1.0]
    adv = paper_base(parents, rewards)
    assert adv == pytest.approx([0.0, 0 - 0.5, 1 - 0.5])
    assert adv[2] != 0


# ---- the release's value estimates (--value_estimate release, an ablation) ---------------------------------
TWO_FORKS_BRANCH = [False, False, False, True, True, True, True]


def test_release_values_two_forks_by_hand():
    # V(root) = mean of the N = 1 base responses = 0; V(p1) = branches 3, 4 only = 0.5; V(p2) = branches
    # 5, 6 only = 1 (the base tail, r = 0, is not counted: it is not a sibling of the branches)
    v_start, v_end = R.release_values(TWO_FORKS_PARENTS, TWO_FORKS_REWARDS, TWO_FORKS_BRANCH)
    assert v_start == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.5, 1.0, 1.0])
    assert v_end == pytest.approx([0.5, 1.0, 0, 0, 0, 0, 0])
    adv = release_base(TWO_FORKS_PARENTS, TWO_FORKS_REWARDS, TWO_FORKS_BRANCH)
    assert adv == pytest.approx([0.5 - 0, 1 - 0.5, 0 - 1, 1 - 0.5, 0 - 0.5, 1 - 1, 1 - 1])
    # the paper's V_MC on the same tree gives other numbers (test_base_advantages_two_forks_by_hand)
    assert adv != pytest.approx(paper_base(TWO_FORKS_PARENTS, TWO_FORKS_REWARDS))


def test_release_values_single_branch_fork_gives_the_branch_zero():
    parents, rewards, branch = [None, 0, 0], [None, 0.0, 1.0], [False, False, True]
    # release: V(fork) = the one branch's reward (1), V(root) = the base response's (0)
    assert release_base(parents, rewards, branch) == pytest.approx([1 - 0, 0 - 1, 1 - 1])
    # paper: V(fork) = mean(base tail 0, branch 1) = 0.5, V(root) = mean of both leaves = 0.5
    assert paper_base(parents, rewards) == pytest.approx([0.5 - 0.5, 0 - 0.5, 1 - 0.5])


def test_release_and_paper_values_two_bases_by_hand():
    #   0: base 0 [0, p1)   1: base 0 [p1, p2)   2: base 0 tail r=1   3, 4: branches at p1 r=0, 1
    #   5: one branch at p2 r=0                  6: base 1, unforked, r=0
    parents = [None, 0, 1, 0, 0, 1, None]
    rewards = [None, None, 1.0, 0.0, 1.0, 0.0, 0.0]
    branch = [False, False, False, True, True, True, False]
    # paper: V(root) = 2/5 (every leaf), V(p1) = (1+0+1+0)/4, V(p2) = (1+0)/2
    assert paper_base(parents, rewards) == pytest.approx(
        [0.5 - 0.4, 0.5 - 0.5, 1 - 0.5, 0 - 0.5, 1 - 0.5, 0 - 0.5, 0 - 0.4])
    # release: V(root) = mean(base 0: 1, base 1: 0) = 0.5, V(p1) = (0+1)/2, V(p2) = 0 (one branch)
    release = release_base(parents, rewards, branch)
    assert release == pytest.approx(
        [0.5 - 0.5, 0 - 0.5, 1 - 0, 0 - 0.5, 1 - 0.5, 0 - 0, 0 - 0.5])
    # the diversity bonus composes the same way: only blocks with A_base > 0 get α·Div
    emb = np.eye(7)
    emb[3] = emb[4]                             # branches 3, 4 identical: Div = 0 between them
    got = A.diversity_bonus(release, A.sibling_diversity(parents, emb), 0.2)
    div = A.sibling_diversity(parents, emb)
    assert got == pytest.approx([0.0, -0.5, 1 + 0.2 * div[2], -0.5, 0.5 + 0.2 * div[4], 0.0, -0.5])


def test_release_values_bad_input():
    with pytest.raises(ValueError, match="differ in length"):
        R.release_values([None], [1.0], [])
    with pytest.raises(ValueError, match="no branch"):
        R.release_values([None, 0], [None, 1.0], [False, False])
    with pytest.raises(ValueError, match="--value_estimate: got .mine., expected one of paper, release"):
        C.make_config("tiny", value_estimate="mine")


def test_v_root_one_gives_all_zero():
    parents = [None, None, None, None]          # V = 1: no expansion, 4 correct base responses
    base = paper_base(parents, [1.0] * 4)
    assert base == [0.0] * 4
    assert A.diversity_bonus(base, A.sibling_diversity(parents, np.eye(4)), alpha=0.2) == [0.0] * 4


def test_base_only_tree_is_reward_minus_mean():
    rewards = [1.0, 0.0, 0.0, 1.0]
    assert paper_base([None] * 4, rewards) == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_sibling_diversity_by_hand_with_unnormalised_embeddings():
    parents = [None, 0, 0, 0, None]
    # blocks 1,2,3 are siblings (same start state: end of block 0); blocks 0 and 4 both start at the prompt
    emb = [[3, 0], [2, 0], [0, 5], [4, 4], [0, 7]]        # deliberately not unit length
    div = A.sibling_diversity(parents, emb)
    c = 1 / math.sqrt(2)
    assert div[1] == pytest.approx(1 - (0 + c) / 2)
    assert div[2] == pytest.approx(1 - (0 + c) / 2)
    assert div[3] == pytest.approx(1 - (c + c) / 2)
    assert div[0] == pytest.approx(1 - 0) and div[4] == pytest.approx(1 - 0)   # orthogonal prompt siblings
    assert A.sibling_diversity([None, 0], [[1, 0], [0, 1]]) == [0.0, 0.0]     # no sibling → 0


def test_datpo_advantage_positive_scope_vs_all():
    parents = [None, 0, 0, 0]
    rewards = [None, 1.0, 0.0, 1.0]
    emb = [[1, 0], [1, 0], [0, 1], [1, 1]]
    base = paper_base(parents, rewards)                     # [0, 1/3, -2/3, 1/3]
    div = A.sibling_diversity(parents, emb)
    alpha = 0.2
    positive = A.diversity_bonus(base, div, alpha, scope="positive")
    everything = A.diversity_bonus(base, div, alpha, scope="all")
    assert base == pytest.approx([0, 1 / 3, -2 / 3, 1 / 3])
    assert positive == pytest.approx([0, 1 / 3 + alpha * div[1], -2 / 3, 1 / 3 + alpha * div[3]])
    assert everything == pytest.approx([b + alpha * d for b, d in zip(base, div)])
    assert everything[2] > positive[2]                      # "all" also rewards the wrong branch's diversity
    assert A.diversity_bonus(base, None, 0.0) == pytest.approx(base)  # α = 0 needs no embeddings
    with pytest.raises(ValueError):
        A.diversity_bonus(base, div, alpha, scope="some")


def test_alpha_linear_annealing():
    assert A.alpha_at(0, 11, 0.2, 0.0) == pytest.approx(0.2)
    assert A.alpha_at(5, 11, 0.2, 0.0) == pytest.approx(0.1)
    assert A.alpha_at(10, 11, 0.2, 0.0) == pytest.approx(0.0)
    assert A.alpha_at(5, 11, 0.2, -0.2) == pytest.approx(0.0)
    assert A.alpha_at(3, 11, 0.2, 0.2) == pytest.approx(0.2)


def test_malformed_trees_are_errors():
    with pytest.raises(ValueError, match="no reward and no children"):
        A.mc_values([None, 0], [None, None])
    with pytest.raises(ValueError, match="terminal"):
        A.mc_values([None, 0], [1.0, 0.0])
    with pytest.raises(ValueError):
        A.mc_values([None], [1.0, 0.0])


# ---- baselines ----------------------------------------------------------------------------------------
def test_grpo_advantage_by_hand():
    rewards = [1.0, 0.0, 0.0, 0.0]
    mean, std = 0.25, math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)     # unbiased std
    assert A.grpo_advantages(rewards) == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])
    assert A.grpo_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]


def test_drgrpo_advantage_has_no_std():
    assert A.drgrpo_advantages([1.0, 0.0, 0.0, 0.0]) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_treerl_advantage_by_hand():
    # two-fork tree above: node values V(s) = mean leaf reward below the end of each block
    adv = A.treerl_advantages(TWO_FORKS_PARENTS, TWO_FORKS_REWARDS)
    v_root = 0.6
    v0, v1 = 0.6, 2 / 3                       # ends of blocks 0 and 1
    expected = [
        ((v0 - v_root) + (v0 - v_root)) / math.sqrt(5),
        ((v1 - v_root) + (v1 - v0)) / math.sqrt(3),
        ((0 - v_root) + (0 - v1)) / 1,
        ((1 - v_root) + (1 - v0)) / 1,
        ((0 - v_root) + (0 - v0)) / 1,
        ((1 - v_root) + (1 - v1)) / 1,
        ((1 - v_root) + (1 - v1)) / 1,
    ]
    assert adv == pytest.approx(expected)


# ---- the release's sibling groups for Div_sib (--sibling_groups release, an option) ------------------------
def test_release_sibling_groups_by_hand():
    # Three base responses. Base 0 is forked once (blocks 0 → 1 tail r=0; branches 3, 4 at its fork), base 1
    # is forked once (block 2 first block → 5 tail r=1; branch 6), base 2 is unforked (block 7, r=1).
    #   idx:    0     1    2     3    4    5    6     7
    parents = [None, 0, None, 0, 0, 2, 2, None]
    rewards = [None, 0.0, None, 1.0, 0.0, 1.0, 1.0, 1.0]
    branch = [False, False, False, True, True, False, True, False]
    base = [0, 0, 1, 0, 0, 1, 1, 2]
    e = np.eye(4)
    emb = [e[0], e[1], (e[0] + e[1]) / np.sqrt(2), e[2], (e[2] + e[3]) / np.sqrt(2), e[3], e[0], e[1]]
    whole = [e[0], (e[0] + e[1]) / np.sqrt(2), e[1]]           # the three base responses' whole texts
    div = R.release_sibling_diversity(parents, rewards, branch, base, emb, whole)
    c = 1 / np.sqrt(2)
    expected = [
        1 - c,                     # 0: forked first block vs block 2 only: cos(e0, (e0+e1)/√2) = 1/√2
        0.0,                       # 1: base 0's continuation: no sibling in the release
        1 - c,                     # 2: vs block 0
        1 - c,                     # 3: branch vs branch 4: cos(e2, (e2+e3)/√2)
        1 - c,                     # 4
        0.0,                       # 5: base 1's continuation
        0.0,                       # 6: the fork's only branch
        1 - (0 + c) / 2,           # 7: whole response 2 (e1) vs whole responses 0 (e0) and 1 ((e0+e1)/√2)
    ]
    assert div == pytest.approx(expected)
    # the paper's Eq. 10 groups by start state instead: block 7 is compared with blocks 0 and 2 (not whole
    # texts), and the base continuation 1 (e1) is a sibling of branches 3 (e2) and 4 ((e2+e3)/√2): cos 0 and 0
    paper = A.sibling_diversity(parents, emb)
    assert paper[1] == pytest.approx(1.0) and div[1] == 0.0
    # block 0 (e0) vs blocks 2 and 7 (e1), not block 2 alone
    assert paper[0] == pytest.approx(1 - (c + 0) / 2)
    # Eq. 4 takes the release's Div_sib as it takes Eq. 10's
    base_adv = paper_base(parents, rewards)
    adv = A.diversity_bonus(base_adv, div, 0.2)
    assert adv == pytest.approx([a + (0.2 * d if a > 0 else 0.0) for a, d in zip(base_adv, div)])


def test_release_sibling_groups_drop_empty_texts():
    # two unforked responses and one whose text is empty (valid False): the empty one gets 0
    # and is not counted
    parents, rewards, branch, base = [None, None, None], [1.0, 0.0, 1.0], [False] * 3, [0, 1, 2]
    e = np.eye(3)
    div = R.release_sibling_diversity(parents, rewards, branch, base, e, e,
                                      response_valid=[True, True, False])
    assert div == pytest.approx([1.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="differ in length"):
        R.release_sibling_diversity(parents, rewards, branch, [0, 1], e, e)
