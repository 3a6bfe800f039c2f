"""Static shapes for captured decode steps: pad a step's tensors to bucketed sizes (no Transformers import).

A CUDA graph replays fixed shapes, so a compiled decode step captured in graphs (``CompileConfig(cuda_graphs=...)``)
sees only a few distinct shapes: the batch is padded to the next power of two and the block-table width to the next
power of two (at least 2). Padding rows feed token 0 at position 0, store nothing (slot ``-1``) and attend to nothing
(``q_pos == -1``, zeros out); padding table columns point at block 0, past every real query's position, so they are
masked. The caller keeps the first ``B`` rows of the result.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = ["Padded", "bucket", "pad_step"]


def bucket(n: int, least: int = 1) -> int:
    """The bucket ``n`` is padded to: the next power of two, at least ``least``."""
    if n < 1:
        raise ValueError(f"a step has at least one row and one table column, got {n}")
    return max(least, 1 << (n - 1).bit_length())


class Padded(NamedTuple):
    """One step's tensors padded to their buckets (``Bb`` rows, ``W`` tokens per row, ``MBb`` table columns)."""

    input_ids: torch.Tensor  # [Bb, W]
    position_ids: torch.Tensor  # [Bb, W]
    slots: torch.Tensor  # [Bb*W]
    block_tables: torch.Tensor  # [Bb, MBb]
    q_pos: torch.Tensor  # [Bb, W]
    rows: int  # B: the real rows, first


def pad_step(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    q_pos: torch.Tensor,
) -> Padded:
    """Pad one step (``input_ids`` ``[B, W]``, ``position_ids`` ``[1 or B, W]``, ``slots`` ``[B*W]``,
    ``block_tables`` ``[B, MB]``, ``q_pos`` ``[B, W]``) to its buckets, on the tensors' own devices."""
    rows, width = input_ids.shape
    extra = bucket(rows) - rows
    columns = bucket(block_tables.shape[1], least=2) - block_tables.shape[1]
    position_ids = position_ids.expand(rows, width)  # [B, W]
    return Padded(
        input_ids=F.pad(input_ids, (0, 0, 0, extra)),
        position_ids=F.pad(position_ids, (0, 0, 0, extra)),
        slots=F.pad(slots, (0, extra * width), value=-1),
        block_tables=F.pad(block_tables, (0, columns, 0, extra)),
        q_pos=F.pad(q_pos, (0, 0, 0, extra), value=-1),
        rows=rows,
    )
