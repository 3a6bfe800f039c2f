"""Tier (a): verification rules, prompt lookup and adaptive k — pure tensor code, exact state."""

from __future__ import annotations

import pytest
import torch

from hf_accel import IncompatibleOptionsError
from hf_accel.speculative import AdaptiveK, PromptLookup, verify_greedy, verify_sampling


def test_greedy_verdicts():
    t = torch.tensor
    assert verify_greedy(t([5, 6, 7]), t([5, 6, 7, 8])).__dict__ == {"accepted": 3, "tokens": [5, 6, 7, 8]}
    assert verify_greedy(t([5, 6, 7]), t([5, 9, 7, 8])).__dict__ == {"accepted": 1, "tokens": [5, 9]}
    assert verify_greedy(t([5, 6, 7]), t([4, 6, 7, 8])).__dict__ == {"accepted": 0, "tokens": [4]}
    assert verify_greedy(t([], dtype=torch.long), t([3])).__dict__ == {"accepted": 0, "tokens": [3]}
    with pytest.raises(ValueError, match="target_tokens must have k \\+ 1 = 3 entries, got 2"):
        verify_greedy(t([1, 2]), t([1, 2]))


def _emitted_first_tokens(target, q, n: int, vocab: int) -> torch.Tensor:
    """Empirical distribution of the first emitted token over ``n`` verification steps."""
    gen = torch.Generator().manual_seed(2)
    fixed = torch.tensor([3, 1])  # a deterministic proposer always proposes the same tokens
    counts = torch.zeros(vocab)
    for _ in range(n):
        drafts = fixed if q is None else torch.stack([torch.multinomial(row, 1, generator=gen)[0] for row in q])
        counts[verify_sampling(drafts, target, q, gen).tokens[0]] += 1
    return counts / n


def test_rejection_sampling_preserves_the_target_distribution():
    gen = torch.Generator().manual_seed(1)
    vocab, k, n = 6, 2, 20000
    target = torch.rand(k + 1, vocab, generator=gen).softmax(-1)
    draft = (torch.rand(k, vocab, generator=gen) * 3).softmax(-1)  # deliberately unlike the target
    for q in (draft, None):  # a sampling draft model, and a deterministic proposer (prompt lookup)
        empirical = _emitted_first_tokens(target, q, n, vocab)
        tv = 0.5 * (empirical - target[0]).abs().sum()
        # total variation of 20000 samples over 6 outcomes: noise ~0.008; a broken rule is off by > 0.05
        assert tv < 0.02, (q is None, tv, empirical, target[0])


def test_sampling_verdict_accepts_everything_when_draft_equals_target():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    v = verify_sampling(torch.tensor([1, 2]), probs, probs[:2].clone())
    assert v.accepted == 2 and v.tokens == [1, 2, 0]


def test_prompt_lookup_proposes_the_continuation_of_the_most_recent_match():
    pl = PromptLookup(num_tokens=3, max_ngram=3, min_ngram=2)
    seq = torch.tensor([7, 1, 2, 3, 4, 5, 9, 1, 2])
    assert pl.propose([seq], [3])[0].tokens.tolist() == [3, 4, 5]
    assert pl.propose([seq], [0])[0].tokens.tolist() == []  # no budget
    assert pl.propose([torch.tensor([1, 2, 3, 4])], [3])[0].tokens.tolist() == []  # no earlier 2-gram
    one = PromptLookup(num_tokens=2, min_ngram=1)
    assert one.propose([torch.tensor([4, 8, 6, 8])], [2])[0].tokens.tolist() == [6, 8]
    # the longest n-gram wins over a more recent shorter one
    seq = torch.tensor([2, 3, 10, 1, 2, 3, 11, 5, 2, 3, 12, 1, 2, 3])
    assert pl.propose([seq], [1])[0].tokens.tolist() == [11]
    # of two occurrences of the same n-gram, the most recent one wins
    seq = torch.tensor([1, 2, 3, 4, 1, 2, 5, 6, 0, 1, 2])
    assert pl.propose([seq], [3])[0].tokens.tolist() == [5, 6, 0]
    # a continuation that reaches the end repeats as the loop it is
    seq = torch.tensor([9, 4, 5, 6, 4, 5])
    assert pl.propose([seq], [3])[0].tokens.tolist() == [6, 4, 5]
    assert pl.propose([torch.tensor([8, 8, 8])], [3])[0].tokens.tolist() == [8, 8, 8]


def test_prompt_lookup_realigns_after_an_edit():
    """The copy of 1 2 3 4 5 6 7 8 broke: the model skipped 3 and wrote 4 (no n-gram ends in ``2 4``)."""
    source = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0]
    seq = torch.tensor([*source, 1, 2, 4])
    pl = PromptLookup(num_tokens=3)
    assert pl.propose([seq], [3])[0].tokens.tolist() == [5, 6, 7]  # resumes after the 4 of the source
    # a rewritten token (11 is not within 4 tokens of the copy position): nothing to resume from
    assert pl.propose([torch.tensor([*source, 1, 2, 11])], [3])[0].tokens.tolist() == []
    # 7 is 4 tokens past the copy position (3 4 5 6 7): outside realign=4, inside realign=5
    seq = torch.tensor([*source, 1, 2, 7])
    assert pl.propose([seq], [3])[0].tokens.tolist() == []
    assert PromptLookup(num_tokens=3, realign=5).propose([seq], [3])[0].tokens.tolist() == [8, 0, 1]
    assert (
        PromptLookup(num_tokens=3, realign=0).propose([torch.tensor([*source, 1, 2, 4])], [3])[0].tokens.tolist() == []
    )
    # an n-gram match of the whole tail still wins over realigning
    seq = torch.tensor([5, 2, 4, 7, 9, 1, 2, 3, 4, 5, 0, 1, 2, 4])
    assert pl.propose([seq], [2])[0].tokens.tolist() == [7, 9]


def test_adaptive_k_grows_keeps_halves_and_pauses():
    k = AdaptiveK(num_tokens=4, max_tokens=7, pause_after=2, pause_steps=3)
    k.reset(2)
    assert k.budgets() == [4, 4]
    k.observe(0, 4, 4)  # all accepted: +2
    k.observe(1, 4, 2)  # partly: unchanged
    assert k.budgets() == [6, 4]
    k.observe(0, 6, 6)
    assert k.budgets() == [7, 4]  # capped at max_tokens
    k.observe(1, 4, 0)  # nothing accepted: halve
    assert k.budgets() == [7, 2]
    k.observe(1, 2, 0)  # second outright rejection in a row: pause 3 steps
    assert [k.budgets()[1] for _ in range(4)] == [0, 0, 0, 1]
    k.select([1])
    assert k.budgets() == [1]
    fixed = AdaptiveK(num_tokens=3, adaptive=False)
    fixed.reset(1)
    fixed.observe(0, 3, 0)
    assert fixed.budgets() == [3]


def test_bad_strategy_options():
    with pytest.raises(IncompatibleOptionsError, match="num_speculative_tokens must be an int >= 1, got 0"):
        PromptLookup(num_tokens=0)
    with pytest.raises(IncompatibleOptionsError, match=r"min_ngram \(3\) must be <= max_ngram \(2\)"):
        PromptLookup(max_ngram=2, min_ngram=3)
    with pytest.raises(IncompatibleOptionsError, match="realign must be an int >= 0, got -1"):
        PromptLookup(realign=-1)
    with pytest.raises(IncompatibleOptionsError, match="max_tokens must be an int >= 5, got 3"):
        AdaptiveK(num_tokens=5, max_tokens=3)


def test_step_cost_fits_the_line_and_falls_back_to_its_prior():
    from hf_accel.speculative.policy import StepCost

    cost = StepCost(decay=1.0, prior_tokens=16.0, prior_weight=4.0)
    assert cost.line() == (0.0, 0.0)
    for _ in range(3):
        cost.record(4, 0.020)  # plain steps only: all the same size
    fixed, per_token = cost.line()
    # slope from the prior: 0.020 / (16 + 4) per token, fixed part the rest of the mean
    assert per_token == pytest.approx(0.001, rel=1e-12) and fixed == pytest.approx(0.016, rel=1e-12)
    cost = StepCost(decay=1.0, prior_tokens=16.0, prior_weight=4.0)
    for _ in range(30):  # exact samples of t = 0.015 + 0.0007 * N at N = 4 and 44
        cost.record(4, 0.015 + 0.0007 * 4)
        cost.record(44, 0.015 + 0.0007 * 44)
    fixed, per_token = cost.line()
    # ridge fit: (cov + lam * prior) / (var + lam) with var = 60 * 20^2, cov = 0.0007 var, lam = 4 * 60 and
    # prior = mean t / (16 + mean N): the prior's pull moves the slope by 0.13%
    prior = (0.015 + 0.0007 * 24) / (16 + 24)
    assert per_token == pytest.approx((0.0007 * 24000 + 240 * prior) / (24000 + 240), rel=1e-9)
    assert per_token == pytest.approx(0.0007, rel=2e-3)
    assert cost.predict(24) == pytest.approx(0.015 + 0.0007 * 24, rel=1e-9)  # the line passes through the mean


def test_policy_picks_the_width_with_the_most_expected_tokens_per_second():
    from hf_accel.speculative.policy import SpeculationPolicy, StepCost

    cost = StepCost(decay=1.0, prior_weight=0.0)
    for n in (4, 44, 1, 11):  # t = 0.02 + 0.001 * N exactly
        cost.record(n, 0.02 + 0.001 * n)
    policy = SpeculationPolicy(cost, window=4)
    policy.reset(4)
    assert policy.choose([0, 0, 0, 0]) == 0 and policy.plain_steps == 0  # nothing to verify: not counted
    for row in range(4):  # chat-like rows: proposals almost never accepted
        for _ in range(4):
            policy.observe(row, 0, 10)
    assert policy.choose([10, 10, 10, 10]) == 0 and policy.plain_steps == 1
    for _ in range(4):  # row 0 copies: 10 of 10 accepted each time
        policy.observe(0, 10, 10)
    # k=10: (4 + 10) / (0.02 + 0.044) = 218.75 tok/s beats plain 4 / 0.024 = 166.7; each k < 10 gains k for
    # (0.024 + 0.004 k) seconds, less
    assert policy.choose([10, 10, 10, 10]) == 10
    assert policy.expected_gain(0, 3) == 3.0 and policy.expected_gain(1, 3) == 0.0
    # row 0 has only 4 tokens to copy: k=4 gives (4 + 4) / 0.04 = 200 tok/s; wider chunks gain nothing more
    assert policy.choose([4, 10, 10, 10]) == 4
    assert policy.choose([0, 10, 10, 10]) == 0 and policy.plain_steps == 2  # only rows that never copy
    policy.select([1, 2])
    assert policy.choose([10, 10]) == 0


def test_policy_scores_shadow_proposals_and_forgets_stale_rows():
    from hf_accel.speculative.policy import SpeculationPolicy, StepCost

    policy = SpeculationPolicy(StepCost(), window=4, prior=[(1, 1)], forget_after=2, optimism=2)
    policy.reset(2)
    # no samples anywhere: the prior, (1 of 1) accepted in full, so 1 + optimism 2
    assert policy.expected_gain(0, 5) == 3.0 and policy.expected_gain(0, 2) == 2.0
    policy.shadow(0, [5, 6, 7])
    policy.shadow(0, [9])  # one pending shadow per row: ignored
    policy.produced(0, [5])
    policy.produced(0, [6, 8])  # 5, 6 matched, then 8 != 7: 2 of 3 would have been accepted
    assert list(policy.rows[0]) == [(2, 3)] and policy.shadows[0] is None
    assert policy.expected_gain(1, 5) == 2.0  # row 1 has no samples: the pooled ones of the call
    policy.shadow(1, [4])
    policy.produced(1, [4])
    policy.produced(1, [3])  # all of a 1-token proposal matched: finalised on the next token
    assert list(policy.rows[1]) == [(1, 1)]
    assert policy.expected_gain(1, 5) == 3.0  # accepted in full: at least 1, credited 1 + 2
    policy.tick()
    policy.tick()
    assert list(policy.rows[0]) == [(2, 3)]
    policy.observe(1, 0, 4)
    policy.tick()  # row 0: three steps without a sample > forget_after: forgotten, row 1 was just observed
    assert list(policy.rows[0]) == [] and list(policy.rows[1]) == [(1, 1), (0, 4)]


def test_budgets_widen_to_the_widest_drafting_row_within_each_rows_room():
    """At batch > 1 the verification chunk is as wide as its widest row (the narrower rows' padding is computed
    anyway) and a model draft feeds the whole batch until its widest row is done: every drafting row gets the widest
    budget, capped by what ``max_length`` leaves it; rows not drafting (0: paused or finished) stay at 0."""
    from hf_accel.speculative.rows import widen

    assert widen([3, 8, 0, 5], [20, 20, 20, 2]) == [8, 8, 0, 2]
    assert widen([4], [2]) == [2]  # one row: its own budget, within its room
    assert widen([0, 0], [5, 5]) == [0, 0]
    assert widen([], []) == []
