"""Verification rules of speculative decoding: pure tensor code, no Transformers.

For one sequence, a strategy proposed draft tokens ``d[0..k)``; the target scored the chunk
``[last, d[0], ..., d[k-1]]`` in one forward, giving ``k + 1`` next-token distributions: position ``j``
predicts the token after ``d[j-1]`` (after ``last`` for ``j = 0``).

* Greedy: accept the longest prefix of drafts equal to the target's argmax; the token after it is the
  target's argmax at the first mismatch (or after the last draft: the bonus token). The output is exactly
  what greedy decoding of the target alone produces.
* Sampling (Leviathan et al. / Chen et al.): accept ``d[j]`` with probability ``min(1, p_j(d) / q_j(d))``;
  at the first rejection sample from ``normalise(max(0, p_j - q_j))``; if all are accepted, sample the bonus
  token from ``p_k``. The emitted tokens are distributed exactly as sampling from the target. A
  deterministic proposer (prompt lookup) has ``q = one_hot(d)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Verdict", "verify_greedy", "verify_sampling"]


@dataclass(frozen=True)
class Verdict:
    """What one sequence keeps from one verification step.

    Args:
        accepted: how many draft tokens were accepted (``0..k``).
        tokens: the tokens to append: the accepted drafts, then one token from the target.
    """

    accepted: int
    tokens: list[int]


def verify_greedy(drafts: torch.Tensor, target_tokens: torch.Tensor) -> Verdict:
    """Greedy verification of one sequence.

    Args:
        drafts: ``[k]`` proposed tokens.
        target_tokens: ``[k + 1]`` the target's argmax at each chunk position.

    Returns:
        The :class:`Verdict`.
    """
    k = drafts.shape[0]
    if target_tokens.shape[0] != k + 1:
        raise ValueError(f"target_tokens must have k + 1 = {k + 1} entries, got {target_tokens.shape[0]}")
    matches = (drafts == target_tokens[:k]).to(torch.int64)
    accepted = int(matches.cumprod(0).sum()) if k else 0
    return Verdict(accepted, [*drafts[:accepted].tolist(), int(target_tokens[accepted])])


def verify_sampling(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Rejection-sampling verification of one sequence.

    Args:
        drafts: ``[k]`` proposed tokens.
        target_probs: ``[k + 1, V]`` target probabilities at each chunk position (after logits processing).
        draft_probs: ``[k, V]`` the proposer's probabilities for each draft position, or ``None`` for a
            deterministic proposer (``q = one_hot(draft)``).
        generator: random source (``None``: torch's global one, so ``torch.manual_seed`` reproduces runs).

    Returns:
        The :class:`Verdict`.
    """
    k = drafts.shape[0]
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"target_probs must have k + 1 = {k + 1} rows, got {target_probs.shape[0]}")
    device = target_probs.device
    # p, q: [k] probabilities of each draft token under the target and the proposer
    p = target_probs[torch.arange(k, device=device), drafts] if k else target_probs.new_zeros(0)
    q = draft_probs[torch.arange(k, device=device), drafts] if draft_probs is not None else torch.ones_like(p)
    u = torch.rand(k, generator=generator, device=device, dtype=p.dtype) if k else p
    accept = (u * q <= p).tolist() if k else []  # u < p / q without dividing by q
    accepted = next((j for j, ok in enumerate(accept) if not ok), k)
    if accepted < k:
        j = accepted
        residual = target_probs[j].clone()
        if draft_probs is not None:
            residual = (residual - draft_probs[j]).clamp_min(0)
        else:
            residual[drafts[j]] = 0
        total = residual.sum()
        # p == q on every token: rejection has probability 0, so only float noise lands here; fall back to p
        residual = residual / total if total > 0 else target_probs[j]
        token = int(torch.multinomial(residual, 1, generator=generator))
    else:
        token = int(torch.multinomial(target_probs[k], 1, generator=generator))
    return Verdict(accepted, [*drafts[:accepted].tolist(), token])
