"""What one engine step does with the model: the packed forward, then each request's next tokens.

:func:`packed_forward` lays the scheduled work out as one ``[1, N]`` chunk over the paged pool (the cache's packed
plan) and returns each sampling request's logits. :func:`next_tokens` turns a request's logits (one row per fed
draft, plus one) into its verdict: greedy or sampled, through its logits processors, with speculative drafts verified
as plain decoding would have chosen. Per-token work reads each request's :class:`~hf_accel.core.tokens.TokenBuffer`
(its ids so far, as a view), never a tensor rebuilt from its whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compile.paged_step import CompiledPagedDecode
from ..paged.attention import DECODE_MAX_QUERY
from ..paged.cache import PagedCache
from ..speculative.verify import Verdict, verify_greedy, verify_sampling
from .request import FinishReason, TokenLogprob, Tracked
from .scheduler import Work

__all__ = ["choose", "next_tokens", "packed_forward", "stop_reason", "token_logprobs"]


def packed_forward(
    model: nn.Module, cache: PagedCache, works: list[Work], device: torch.device
) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """One forward over the packed chunk of ``works``; returns each sampling request's logits ``[1 + drafts, V]``
    float32 and their argmax (read back once for the whole step: the picks of plain greedy requests), by request
    id. A step where every request feeds one token runs the model's compiled decode step when it has one (the
    compile feature: on CUDA, CUDA graphs)."""
    step = model.__dict__.get("forward")
    if isinstance(step, CompiledPagedDecode) and all(w.sample and len(w.tokens) + len(w.drafts) == 1 for w in works):
        return _compiled_decode(step, cache, works, device)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    copies = []
    keep: list[int] = []
    for w in works:
        fed = w.tokens + w.drafts
        if w.sample:
            keep.extend(range(len(ids) + len(fed) - 1 - len(w.drafts), len(ids) + len(fed)))
        ids.extend(fed)
        pos.extend(range(w.start, w.start + len(fed)))
        slots.extend(w.slots)
        copies.extend(w.copies)
    seqs, starts = [w.state.seq for w in works], [w.start for w in works]
    cache.pin_packed(seqs, starts, slots, copies, short_max=DECODE_MAX_QUERY)
    try:
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor([ids], device=device),
                position_ids=torch.tensor([pos], device=device),
                cache=cache,
                use_cache=True,
                logits_to_keep=torch.tensor(keep or [0], device=device),
            )
    finally:
        cache.unpin()
    return _by_request(out.logits[0], works)


def _by_request(logits: torch.Tensor, works: list[Work]) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """Split the kept rows ``[K, V]`` (each sampling request's ``1 + drafts``, in order) by request id, with their
    argmax read back once for the whole step."""
    logits = logits.float()
    picks = logits.argmax(-1).tolist()  # [K]: the step's one read of the device
    result, at = {}, 0
    for w in works:
        if w.sample:
            n = 1 + len(w.drafts)
            result[w.state.rid] = (logits[at : at + n], picks[at : at + n])
            at += n
    return result


def _compiled_decode(
    step: CompiledPagedDecode, cache: PagedCache, works: list[Work], device: torch.device
) -> dict[int, tuple[torch.Tensor, list[int]]]:
    """A decode step of ``B`` requests as a ``[B, 1]`` batch through the compiled step (same pools, same slots)."""
    fed = [(w.tokens + w.drafts)[0] for w in works]
    copies = [c for w in works for c in w.copies]
    slots, tables, q_pos = cache.rows_plan([w.state.seq for w in works], [w.start for w in works],
                                           [w.slots[0] for w in works], copies)  # fmt: skip
    with torch.no_grad():
        logits = step.run_rows(cache, torch.tensor(fed, device=device)[:, None], q_pos.to(torch.long), slots,
                               tables, q_pos)  # fmt: skip
    return _by_request(logits[:, 0], works)  # [B, V]: one row per request (every one samples, none drafts)


def _scores(tracked: Tracked, drafts: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The processed scores ``[1, V]`` after the request's ids so far plus ``drafts`` (a view when there are none)."""
    ids = tracked.ids.view()
    if drafts:
        ids = torch.cat([ids, torch.tensor(drafts, dtype=torch.long, device=ids.device)])
    return tracked.spec.processors(ids[None].to(logits.device), logits[None])


def next_tokens(tracked: Tracked, drafts: list[int], logits: torch.Tensor, picks: list[int]) -> Verdict:
    """The request's next token(s) from ``logits`` ``[1 + drafts, V]`` (``picks``: their argmax, on the host): the
    drafts it keeps plus one of its own."""
    if tracked.spec.plain_stop is not None:  # plain greedy: the argmax is the choice
        return verify_greedy(torch.tensor(drafts, dtype=torch.long), torch.tensor(picks))
    if tracked.spec.sample:
        rows = [_scores(tracked, drafts[:j], logits[j])[0] for j in range(len(drafts) + 1)]
        probs = torch.stack(rows).softmax(-1)  # [1 + drafts, V]
        drafted = torch.tensor(drafts, dtype=torch.long, device=probs.device)
        return verify_sampling(drafted, probs, None, tracked.spec.generator)
    picks = []
    for j in range(len(drafts) + 1):  # stop scoring at the first mismatch
        picks.append(int(_scores(tracked, drafts[:j], logits[j]).argmax(-1)))
        if j == len(drafts) or picks[-1] != drafts[j]:
            break
    picks += [-1] * (len(drafts) + 1 - len(picks))
    return verify_greedy(torch.tensor(drafts, dtype=torch.long), torch.tensor(picks))


def choose(
    tracked: Tracked, drafts: list[int], logits: torch.Tensor, picks: list[int]
) -> tuple[Verdict, list[TokenLogprob | None]]:
    """:func:`next_tokens`, and each kept token's :class:`TokenLogprob` where the request asked for them (token ``i``
    of the verdict was chosen from ``logits[i]``; one read of the device for all of them)."""
    verdict = next_tokens(tracked, drafts, logits, picks)
    k = tracked.spec.logprobs
    if k is None:
        return verdict, [None] * len(verdict.tokens)
    return verdict, list(token_logprobs(logits[: len(verdict.tokens)], verdict.tokens, k))


def token_logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each of ``tokens``' log-probability under ``logits`` ``[T, V]`` (row ``i`` the distribution ``tokens[i]`` was
    chosen from) and the ``k`` likeliest tokens of that row (one read of the device for all of them)."""
    rows = torch.log_softmax(logits.float(), -1)  # [T, V]
    chosen = rows.gather(1, torch.tensor(tokens, device=rows.device)[:, None])[:, 0]  # [T]
    top = rows.topk(min(k, rows.shape[-1]), -1)  # [T, k]
    values, ids, top_values = chosen.tolist(), top.indices.tolist(), top.values.tolist()
    return [TokenLogprob(t, v, tuple(zip(i, tv, strict=True)))
            for t, v, i, tv in zip(tokens, values, ids, top_values, strict=True)]  # fmt: skip


def stop_reason(tracked: Tracked, token: int, generated: int, max_new_tokens: int) -> FinishReason | None:
    """Why the request stops after ``token`` (already appended to its ids), or ``None``."""
    spec = tracked.spec
    if spec.plain_stop is not None:  # what the max-length and EOS criteria would say, on the host
        max_length, eos = spec.plain_stop
        if token not in eos and len(tracked.ids) < max_length:
            return None
    elif not bool(spec.stopping(tracked.ids.view()[None], None).any()):
        return None
    if token in spec.eos:
        return FinishReason.EOS
    if generated >= max_new_tokens:
        return FinishReason.LENGTH
    return FinishReason.STOP
