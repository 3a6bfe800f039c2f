"""The differential tier's cases: seeded random ``generate`` calls on a patched model, each with the outcome
docs/guarantees.md promises: the unpatched model's output, or the typed error named there.

A case is drawn from one seed (architecture, init scale, features, batch and padding, paged cache, speculation,
generate options); :func:`promise` says what the patched call must do; :func:`check` runs both models and compares.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from helpers import PAD, VOCAB, tiny_model

import hf_accel
from hf_accel import PagedConfig, SpeculativeConfig
from hf_accel.core.errors import HFAccelError, IncompatibleOptionsError

FEATURES = {"default": {}, "native": {"native": True}, "compile": {"compile": True}}
SPECULATION = ("none", "lookup", "draft", "self")
PAGED = ("off", "on", "prefix")


@dataclass(frozen=True)
class Case:
    """One drawn call (``options``: extra ``generate`` keywords; ``stop``: pass a stop string found in the
    unpatched output, with a tokenizer)."""

    seed: int
    arch: str
    init: float
    features: str
    lengths: tuple[int, ...]
    right_pad: bool
    paged: str
    speculation: str
    options: dict[str, Any] = field(default_factory=dict)
    stop: bool = False
    in_config: tuple[str, ...] = ()  # options set on model.generation_config instead of passed to the call

    def __str__(self) -> str:
        pad = "right" if self.right_pad else "left"
        return (
            f"seed={self.seed} {self.arch} init={self.init} features={self.features} lengths={self.lengths} "
            f"{pad}-padded paged={self.paged} speculation={self.speculation} stop={self.stop} {self.options}"
            + (f" in generation_config: {list(self.in_config)}" if self.in_config else "")
        )


def draw(seed: int, archs: list[str], features: tuple[str, ...] = ("default", "native")) -> Case:
    """The case of ``seed`` (the same seed always gives the same case)."""
    rng = random.Random(seed)
    batch = rng.choice([1, 1, 2, 3])
    speculation = rng.choice(SPECULATION)
    options: dict[str, Any] = {"max_new_tokens": rng.randint(1, 12)}
    if rng.random() < 0.3:
        options["do_sample"], options["top_k"] = True, rng.choice([0, 5, 50])
    else:
        options["do_sample"] = False
    if rng.random() < 0.3:
        options["eos_token_id"] = rng.randrange(3, VOCAB)  # often generated: rows finish early
    if rng.random() < 0.2:
        options["repetition_penalty"] = 1.3
    if rng.random() < 0.15:
        options["min_new_tokens"] = rng.randint(1, options["max_new_tokens"])
    if rng.random() < 0.25:
        options["return_dict_in_generate"] = True
        for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
            options[flag] = rng.random() < 0.4
    if rng.random() < 0.15:
        options["num_beams"] = 2
    if rng.random() < 0.1:
        options["num_return_sequences"] = 2
    if rng.random() < 0.05:
        options["guidance_scale"] = 1.5
    # a second stream, so the draws above stay what they were for every seed
    later = random.Random(seed * 7919 + 1)
    if later.random() < 0.05:
        options["cache_implementation"] = "static"
    settable = [k for k in options if k not in ("max_new_tokens", "eos_token_id")]
    in_config = tuple(k for k in settable if later.random() < 0.3) if later.random() < 0.3 else ()
    return Case(
        in_config=in_config,
        seed=seed,
        arch=rng.choice(archs),
        init=rng.choice([0.2, 0.02]),
        features=rng.choice(features),
        lengths=tuple(rng.randint(2, 20) for _ in range(batch)),
        right_pad=batch > 1 and rng.random() < 0.2,
        paged=rng.choice(PAGED),
        speculation=speculation,
        options=options,
        stop=rng.random() < 0.15,
    )


def promise(case: Case, stops: bool | None = None) -> tuple[str, type[Exception] | None, str]:
    """What the patched call must do: ``("equal", None, "")`` (the unpatched output), ``("valid", None, "")``
    (speculative sampling: another draw of the same distribution) or ``("error", type, pattern)``. ``stops``:
    whether the call got a stop string (default: the case asks for one)."""
    opts, speculative, paged = case.options, case.speculation != "none", case.paged != "off"
    stops = case.stop if stops is None else stops
    rows = len(case.lengths) * opts.get("num_return_sequences", 1)
    finishes = opts.get("eos_token_id") is not None or stops  # rows may finish at different steps
    scores = opts.get("return_dict_in_generate") and (opts.get("output_scores") or opts.get("output_logits"))
    ragged = case.right_pad and len(set(case.lengths)) > 1
    outputs = any(opts.get(f) for f in ("output_attentions", "output_hidden_states"))
    refusals = [  # any of them may come first
        (speculative and opts.get("num_beams", 1) > 1, "cannot be combined with beam search"),
        (speculative and outputs, "speculative generation does not return"),
        (paged and outputs and opts.get("return_dict_in_generate"), r"generate\(paged=...\) does not return"),
        ((paged or speculative) and ragged, "right padding|left-padded|left padding"),
        (speculative and scores and rows > 1 and finishes, "for a batch of .* rows that may finish"),
        (speculative and rows > 1 and stops and opts.get("eos_token_id") is None, "without an EOS token"),
        (speculative and opts.get("guidance_scale"), "classifier-free guidance"),
        ((paged or speculative) and opts.get("cache_implementation"), "cache_implementation"),
    ]
    patterns = [pattern for applies, pattern in refusals if applies]
    if patterns:
        return "error", IncompatibleOptionsError, "|".join(patterns)
    if speculative and opts.get("do_sample"):
        return "valid", None, ""
    return "equal", None, ""


def batch_of(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, L]`` of random tokens, padded on the case's side."""
    gen = torch.Generator().manual_seed(case.seed)
    width = max(case.lengths)
    ids = torch.full((len(case.lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(case.lengths):
        cols = slice(0, n) if case.right_pad else slice(width - n, width)
        ids[row, cols] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, cols] = 1
    return ids, mask


def _extra(case: Case) -> dict[str, Any]:
    """The hf_accel keywords of the call."""
    extra: dict[str, Any] = {}
    if case.paged == "on":
        extra["paged"] = True
    elif case.paged == "prefix":
        extra["paged"] = PagedConfig(block_size=4, prefix_cache=True)
    if case.speculation == "lookup":
        extra["prompt_lookup"] = True
    elif case.speculation == "draft":
        extra["draft_model"] = tiny_model(case.arch, seed=1, initializer_range=case.init)
    elif case.speculation == "self":
        extra["speculative"] = SpeculativeConfig(strategy="self")
    return extra


def _generate(model: Any, case: Case, kwargs: dict[str, Any]) -> Any:
    torch.manual_seed(case.seed)
    with torch.no_grad():
        return model.generate(**kwargs)


def _stop_string(out: Any, ids: torch.Tensor, tokenizer: Any) -> str | None:
    """A word the unpatched model generated in its first row (so the stop string is met), or ``None``."""
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    for token in sequences[0, ids.shape[1] :].tolist():
        text = tokenizer.decode([token]).strip()
        if len(text) >= 2 and text.isalnum():
            return text
    return None


def check(case: Case, tokenizer: Any = None) -> str:
    """Run ``case`` on the unpatched and the patched model and compare as :func:`promise` says; returns the
    outcome checked (``"equal"``, ``"valid"``, ``"error"``, ``"same error"``)."""
    plain = _configured(tiny_model(case.arch, initializer_range=case.init), case)
    ids, mask = batch_of(case)
    options = {k: v for k, v in case.options.items() if k not in case.in_config}
    kwargs = {"input_ids": ids, "attention_mask": mask, "pad_token_id": PAD, **options}
    if "eos_token_id" not in kwargs:
        kwargs["eos_token_id"] = None
    try:
        want = _generate(plain, case, kwargs)
    except (ValueError, TypeError) as err:  # Transformers refuses the options: so must the patched model
        want = err
    if case.stop and tokenizer is not None and not isinstance(want, Exception):
        stop = _stop_string(want, ids, tokenizer)
        if stop is not None:
            kwargs.update(stop_strings=[stop], tokenizer=tokenizer)
            want = _generate(plain, case, kwargs)
    model = _configured(tiny_model(case.arch, initializer_range=case.init), case)
    model = hf_accel.patch_model(model, **FEATURES[case.features])
    outcome, error, pattern = promise(case, "stop_strings" in kwargs)
    if isinstance(want, Exception):  # Transformers refuses the options: the patched model refuses them too
        try:
            _generate(model, case, {**kwargs, **_extra(case)})
        except (type(want), HFAccelError):
            return "same error"
        raise AssertionError(f"{case}: the unpatched model raised {want!r}, the patched one did not")
    if outcome == "error":
        with pytest.raises(error, match=pattern):
            _generate(model, case, {**kwargs, **_extra(case)})
        return outcome
    got = _generate(model, case, {**kwargs, **_extra(case)})
    compare(case, got, want, exact=outcome == "equal")
    if outcome == "equal" and not case.options.get("do_sample"):
        _next_turn(case, (plain, want), (model, got), mask)
    return outcome


def _configured(model: Any, case: Case) -> Any:
    """``model`` with the case's ``in_config`` options set on its generation config."""
    for key in case.in_config:
        setattr(model.generation_config, key, case.options[key])
    return model


def _next_turn(case: Case, plain: tuple[Any, Any], patched: tuple[Any, Any], mask: torch.Tensor) -> None:
    """A returned cache passed back with the sequences (the next turn of a chat): three more greedy tokens, equal.
    A paged call returns none (docs/guarantees.md); a speculative one the cache Transformers leaves, or an empty one."""
    cache_want, cache_got = (getattr(out, "past_key_values", None) for _, out in (plain, patched))
    expanded = case.options.get("num_return_sequences", 1) > 1 or case.options.get("num_beams", 1) > 1
    static = case.options.get("cache_implementation") is not None  # sized for the first call only
    if cache_want is None or cache_got is None or expanded or static:  # a beam search's cache holds every beam
        return
    (plain_model, want), (model, got) = plain, patched
    grown = torch.ones(mask.shape[0], want.sequences.shape[1] - mask.shape[1], dtype=mask.dtype)
    kwargs = {"attention_mask": torch.cat([mask, grown], 1), "max_new_tokens": 3, "do_sample": False}
    kwargs.update(pad_token_id=PAD, eos_token_id=None)
    after_want = _generate(plain_model, case, {"input_ids": want.sequences, "cache": cache_want, **kwargs})
    after_got = _generate(model, case, {"input_ids": got.sequences, "cache": cache_got, **kwargs})
    after_want, after_got = (a if isinstance(a, torch.Tensor) else a.sequences for a in (after_want, after_got))
    assert torch.equal(after_got, after_want), (
        f"{case}: next turn\n got {after_got.tolist()}\nwant {after_want.tolist()}"
    )


def compare(case: Case, got: Any, want: Any, exact: bool) -> None:
    """Sequences equal (``exact``) or of the same shape and vocabulary; per-step scores / logits close."""
    seq_got = got if isinstance(got, torch.Tensor) else got.sequences
    seq_want = want if isinstance(want, torch.Tensor) else want.sequences
    if not exact:
        assert seq_got.shape[0] == seq_want.shape[0], case
        assert seq_got.shape[1] <= max(case.lengths) + case.options["max_new_tokens"], case
        assert int(seq_got.max()) < VOCAB and int(seq_got.min()) >= 0, case
        return
    assert torch.equal(seq_got, seq_want), f"{case}\n got {seq_got.tolist()}\nwant {seq_want.tolist()}"
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), case
        return
    for name in ("scores", "logits"):
        a, b = getattr(got, name, None), getattr(want, name, None)
        assert (a is None) == (b is None), f"{case}: {name} returned by one side only"
        if a is not None:
            assert len(a) == len(b), f"{case}: {len(a)} vs {len(b)} steps of {name}"
            for step, (x, y) in enumerate(zip(a, b, strict=True)):
                where = f"{case} {name}[{step}]"
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=lambda m, w=where: f"{w}: {m}")
