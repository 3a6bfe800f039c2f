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


def test_prompt_lookup_proposes_the_continuation_of_the_first_match():
    pl = PromptLookup(num_tokens=3, max_ngram=3, min_ngram=2)
    seq = torch.tensor([7, 1, 2, 3, 4, 5, 9, 1, 2])
    assert pl.propose([seq], [3])[0].tokens.tolist() == [3, 4, 5]
    assert pl.propose([seq], [0])[0].tokens.tolist() == []  # no budget
    assert pl.propose([torch.tensor([1, 2, 3, 4])], [3])[0].tokens.tolist() == []  # no earlier 2-gram
    one = PromptLookup(num_tokens=2, min_ngram=1)
    assert one.propose([torch.tensor([4, 8, 6, 8])], [2])[0].tokens.tolist() == [6, 8]
    # the longest n-gram wins over an earlier shorter one
    seq = torch.tensor([2, 3, 10, 1, 2, 3, 11, 1, 2, 3])
    assert pl.propose([seq], [1])[0].tokens.tolist() == [11]


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
    with pytest.raises(IncompatibleOptionsError, match="max_tokens must be an int >= 5, got 3"):
        AdaptiveK(num_tokens=5, max_tokens=3)


def test_governor_pauses_speculation_that_does_not_pay_and_probes_again():
    from hf_accel.speculative.loop import Governor

    g = Governor(margin=0.95, pause_steps=3, alpha=1.0)
    assert g.allow()  # first step: speculate
    g.record(True, tokens=3, seconds=0.3)  # 10 tok/s speculative; the plain rate is not known yet
    assert not g.allow()  # so the next step is a plain one, to measure it
    g.record(False, tokens=1, seconds=0.05)  # 20 tok/s plain: speculation loses
    assert [g.allow() for _ in range(4)] == [False, False, False, True] and g.pauses == 1
    g.record(True, tokens=6, seconds=0.2)  # 30 tok/s: now it pays, speculation goes on
    assert g.allow() and g.allow() and g.pauses == 1
