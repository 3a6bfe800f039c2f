"""Thresholds tuned on the CPU, in one place: where a native path starts or stops paying.

Each was chosen by a measurement on SmolLM2-135M (2 cores; the notes say which). They decide *which path* a call
takes, never its result beyond float summation order. A device with other costs (a GPU) gets a tuning of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CPU", "CpuTuning"]


@dataclass(frozen=True)
class CpuTuning:
    """Path thresholds of the CPU implementations.

    Args:
        paged_kernel_max_query: chunks of up to this many queries per row attend through the native paged kernel
            (decode, speculative verification); longer ones gather and run dense attention, which is faster there.
        int8_kernel_max_rows: an ``Int8Linear`` runs its weight-only kernel up to this many activation rows; above,
            the weight is de-quantized once per call and MKL's GEMM does the (compute-bound) work.
        lean_max_width: the widest chunk a lean step runs (a draft's steps, catch-ups and guess checks).
        w8a8_min_width: from this chunk width a native int8 chunk runs W8A8 where it can (a fully W8A8 draft accepted
            measurably less; guess checks are tens of rows, where W8A8 halves W8A16's integer work).
        w8a16_min_rows: from this many activation rows the int8 projections run W8A16 where they can (one row
            streams the weights at memory speed either way; ms at 1 / 2 / 4 rows over SmolLM2's layers: weight-only
            4.4 / 6.8 / 7.4, W8A16 4.8 / 4.9 / 6.4).
        int8_head_kernel_rows: up to this many rows an int8 LM head runs the kernel (~0.45 ms a row on SmolLM2's
            49152 x 576 head, against ~80 ms to de-quantize the weight for a GEMM).
        prompt_mask_cells: the largest boolean mask (rows x prompt tokens x columns) the native layers take for a
            prompt (64 MiB: four prompts of 4096 tokens); a larger prompt runs the model's forward.
    """

    paged_kernel_max_query: int = 16
    int8_kernel_max_rows: int = 16
    lean_max_width: int = 32
    w8a8_min_width: int = 6
    w8a16_min_rows: int = 2
    int8_head_kernel_rows: int = 128
    prompt_mask_cells: int = 1 << 26


#: the thresholds every CPU path reads
CPU = CpuTuning()
