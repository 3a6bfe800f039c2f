"""The exact codes (:mod:`hf_accel.quant.codes`) of a model's float32 projection weights, for the native executor.

A model whose float32 weights are a de-quantized low-bit checkpoint's values (GGUF Q4_1 / Q8_0 / Q4_0 / Q5_0: the
default SmolLM2 model, or any GGUF loaded through Transformers' ``gguf_file=``) runs its decode steps and
verification chunks from those codes (``coded_linear``): the same float32 weights, bit for bit, from 4-6x fewer bytes.
The model's own weights stay as they are (its forward, ``save_pretrained``, prompts and wide chunks use them).

:class:`CodeBook` finds each weight's codes once and keeps them while the weight is unchanged: an in-place update
(``copy_``, ``load_state_dict``, an optimizer step) bumps its version counter, and a write through ``.data``, which
does not, changes one of the values sampled when the codes were found (:meth:`CodeBook.stale`); either way the next
build finds the codes again (or runs the float weight where the new values are not codes).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..core.fingerprint import sampled_values, tensor_version
from ..quant.codes import Codes, find_codes

__all__ = ["CODED_MAX_ROWS", "CodeBook"]

#: chunks of up to this many activation rows run coded projections; wider ones (prompts) the float weights, where
#: the products, not the weight bytes, set the pace (``coded_linear`` takes at most 32)
CODED_MAX_ROWS = 16


@dataclass
class _Entry:
    weight: torch.Tensor  # the (detached) weight the codes were found in: held, so its storage is not reused
    version: int
    values: torch.Tensor  # its sampled values when the codes were found (core.fingerprint.sampled_values)
    codes: Codes | None
    why: str  # why there are no codes ("" when there are)

    def current(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` (the same storage: entries are keyed by it) still holds the values the codes were found
        in."""
        return self.version == tensor_version(weight) and torch.equal(sampled_values(weight), self.values)


def _key(weight: torch.Tensor) -> tuple[Any, ...]:
    return weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device


class CodeBook:
    """Codes of float32 weights, found on first use and kept while each weight is unchanged (thread-safe).

    Entries are keyed by storage (a model's parameters, or the detached views the executor holds, share them) and
    hold the weight they were found in; :meth:`keep_only` drops those a rebuilt executor no longer reads.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[Any, ...], _Entry] = {}
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor) -> Codes | None:
        """``weight``'s exact codes, or ``None`` where it has none (:meth:`summary` says why)."""
        return self._entry(weight).codes

    def _entry(self, weight: torch.Tensor) -> _Entry:
        with self._lock:
            entry = self._entries.get(_key(weight))
            if entry is not None and entry.current(weight):
                return entry
            found = find_codes(weight.detach())
            codes, why = (found, "") if isinstance(found, Codes) else (None, found)
            entry = _Entry(weight.detach(), tensor_version(weight), sampled_values(weight), codes, why)
            self._entries[_key(weight)] = entry
            return entry

    def keep_only(self, weights: list[torch.Tensor]) -> None:
        """Forget every entry but those of ``weights`` (the weights a rebuilt executor reads)."""
        keep = {_key(w) for w in weights}
        with self._lock:
            self._entries = {k: e for k, e in self._entries.items() if k in keep}

    def stale(self, weights: list[torch.Tensor]) -> bool:
        """Whether any of ``weights`` changed since its codes were found (or was never looked at)."""
        with self._lock:
            for weight in weights:
                entry = self._entries.get(_key(weight))
                if entry is None or not entry.current(weight):
                    return True
        return False

    def summary(self, weights: list[torch.Tensor]) -> dict[str, Any]:
        """How many of ``weights`` run as codes, their bytes against the float weights', and why the others do not."""
        entries = [self._entry(w) for w in weights]
        coded = [e.codes for e in entries if e.codes is not None]
        return {
            "coded": len(coded),
            "of": len(entries),
            "bits": sorted({c.bits for c in coded}),
            "code_bytes": sum(c.nbytes for c in coded),
            "float_bytes": sum(
                w.numel() * w.element_size() for w, e in zip(weights, entries, strict=True) if e.codes is not None
            ),
            "not": sorted({e.why for e in entries if e.codes is None}),
        }
