"""Tier (b): the native paged-attention kernel against the dense reference, over scattered block tables."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close, sink_logits

from hf_accel.kernels.ops import choose
from hf_accel.kernels.reference import dense_attention

KERNEL = choose("paged_attention", "cpu")
needs_kernel = pytest.mark.skipif(not KERNEL.native, reason=f"native paged attention: {KERNEL.rejected}")


def _scattered_pool(lengths: list[int], block_size: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int):
    """A pool holding each sequence's K/V in shuffled blocks, plus the contiguous K/V it represents."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    total = sum(blocks_per_seq) + 3  # a few blocks nobody owns: their garbage must never be read
    order = torch.randperm(total, generator=gen).tolist()
    k_pool = torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(total, block_size, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.zeros(len(lengths), max(blocks_per_seq), dtype=torch.int32)
    contiguous = []
    for row, n in enumerate(lengths):
        mine = [order.pop() for _ in range(blocks_per_seq[row])]
        tables[row, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        k = k_pool[mine].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)  # [H_kv, n, D]
        v = v_pool[mine].reshape(-1, kv_heads, dim)[:n].transpose(0, 1)
        contiguous.append((k, v))
    return k_pool, v_pool, tables, contiguous


@needs_kernel
@pytest.mark.parametrize(
    ("lengths", "q_len", "window", "softcap", "sinks"),
    [
        ([1, 16, 17, 70], 1, 0, 0.0, False),  # decode: shorter than, exactly, just past and many blocks
        ([5, 33, 100], 4, 0, 0.0, False),  # speculative verification: several queries per row
        ([40, 90], 3, 8, 0.0, False),  # sliding window crossing block edges
        ([20, 64], 1, 0, 30.0, False),  # Gemma-2 style logit softcapping
        ([1, 33, 200], 2, 0, 0.0, True),  # GPT-OSS's attention sinks, across the merge of context splits
        ([40, 90], 3, 8, 0.0, True),  # sinks on a sliding layer
    ],
)
def test_kernel_matches_dense_reference_fp32(lengths, q_len, window, softcap, sinks):
    heads, kv_heads, dim, bs = 6, 2, 24, 16
    k_pool, v_pool, tables, dense = _scattered_pool(lengths, bs, kv_heads, dim, torch.float32, seed=len(lengths))
    q = torch.randn(len(lengths), heads, q_len, dim, generator=torch.Generator().manual_seed(7))
    q_pos = torch.tensor([[n - q_len + j for j in range(q_len)] for n in lengths], dtype=torch.int32)
    scale = 1 / math.sqrt(dim)
    sink = sink_logits(heads) if sinks else None
    got = KERNEL.fn(q, k_pool, v_pool, tables, q_pos, scale, window, softcap, sink)  # [B, Q, H, D]
    for row, (k, v) in enumerate(dense):
        expected = dense_attention(q[row], k, v, q_pos[row].tolist(), scale, window, softcap, sink)  # [H, Q, D]
        # fp32, online softmax vs SDPA: only summation order differs
        assert_close(got[row].transpose(0, 1), expected, atol=2e-6, rtol=1e-5, name=f"row {row}")


@needs_kernel
def test_kernel_padding_queries_get_zeros_and_strided_queries_work():
    k_pool, v_pool, tables, dense = _scattered_pool([9, 30], 16, 1, 8, torch.float32, seed=3)
    q = torch.randn(2, 3, 2, 8).permute(0, 2, 1, 3)  # [2, H=2, Q=3, D=8], non-contiguous
    q_pos = torch.tensor([[-1, 7, 8], [27, 28, 29]], dtype=torch.int32)  # row 0 has a padding query first
    got = KERNEL.fn(q, k_pool, v_pool, tables, q_pos, 0.5, 0, 0.0)
    assert torch.equal(got[0, 0], torch.zeros(2, 8))  # a padding query attends to nothing
    expected = dense_attention(q[0][:, 1:], *dense[0], [7, 8], 0.5)
    assert_close(got[0, 1:].transpose(0, 1), expected, atol=2e-6, rtol=1e-5, name="strided q")  # fp32


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_precision_pools(dtype):
    k_pool, v_pool, tables, dense = _scattered_pool([25, 48], 16, 2, 16, dtype, seed=5)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    q_pos = torch.tensor([[24], [47]], dtype=torch.int32)
    got = KERNEL.fn(q, k_pool, v_pool, tables, q_pos, 0.25, 0, 0.0)
    for row, (k, v) in enumerate(dense):
        expected = dense_attention(q[row].float(), k.float(), v.float(), q_pos[row].tolist(), 0.25)
        # the kernel accumulates in fp32 and rounds once to the pool dtype: one rounding of that dtype
        eps = torch.finfo(dtype).eps
        assert_close(got[row].transpose(0, 1).float(), expected, atol=2 * eps, rtol=2 * eps, name=str(dtype))


def _qkv(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[4, 3, 8]`` (4 query heads, 3 queries) and k / v ``[2, 10, 8]`` (2 K/V heads, 10 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(4, 3, 8, generator=gen),
        torch.randn(2, 10, 8, generator=gen),
        torch.randn(2, 10, 8, generator=gen),
    )


def test_dense_reference_matches_explicit_softmax():
    q, k, v = _qkv(0)
    positions = [5, 6, 9]
    got = dense_attention(q, k, v, positions, 0.3, window=4)
    kk, vv = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    scores = (q @ kk.transpose(-1, -2)) * 0.3  # [4, 3, 10]
    t = torch.arange(10)
    for i, p in enumerate(positions):
        scores[:, i, (t > p) | (t <= p - 4)] = float("-inf")
    assert_close(got, scores.softmax(-1) @ vv, atol=1e-6, rtol=1e-5, name="reference")  # fp32


@pytest.mark.parametrize("window", [0, 4])
def test_dense_reference_with_sinks_matches_gpt_oss_eager_attention(window):
    """The reference's sinks are GPT-OSS's: Transformers' own eager attention of that model, on the same inputs."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = _qkv(1)
    positions = [5, 6, 9]
    module = torch.nn.Module().eval()
    module.num_key_value_groups, module.sinks = 2, sink_logits(4)
    t = torch.arange(10)
    pos = torch.tensor(positions)[:, None]
    visible = (t <= pos) & ((t > pos - window) if window else True)  # [3, 10]
    mask = torch.zeros(3, 10).masked_fill(~visible, float("-inf"))[None, None]  # additive, [1, 1, 3, 10]
    want, _ = eager_attention_forward(module, q[None], k[None], v[None], mask, scaling=0.3)  # [1, 3, 4, 8]
    got = dense_attention(q, k, v, positions, 0.3, window, sinks=module.sinks)  # [4, 3, 8]
    assert_close(got, want[0].transpose(0, 1), atol=1e-6, rtol=1e-5, name="sinks")  # fp32


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _gqa_inputs(batch: int, q_len: int, ctx: int, float_mask: bool):
    gen = torch.Generator().manual_seed(batch * 100 + q_len)
    q = torch.randn(batch, 6, q_len, 16, generator=gen)  # [B, H_q, Q, D]
    k = torch.randn(batch, 2, ctx, 16, generator=gen)  # [B, H_kv, T, D]
    v = torch.randn(batch, 2, ctx, 16, generator=gen)
    allowed = torch.ones(batch, 1, q_len, ctx, dtype=torch.bool)
    allowed[..., ctx - q_len :] = torch.ones(q_len, q_len, dtype=torch.bool).tril()  # causal chunk
    allowed[0, ..., :3] = False  # row 0: left padding
    if not float_mask:
        return q, k, v, allowed
    return q, k, v, torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


@pytest.mark.parametrize(("batch", "q_len", "float_mask"), [(1, 9, False), (2, 5, False), (3, 4, True)])
def test_gqa_sdpa_equals_transformers_sdpa_bitwise(batch, q_len, float_mask):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from hf_accel.paged.gqa import gqa_sdpa

    q, k, v, mask = _gqa_inputs(batch, q_len, 40, float_mask)
    module = _Attn(groups=3)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)  # repeat_kv copies K/V 3 times
    got = gqa_sdpa(module, q, k, v, mask, 0.25, 0.0, {})
    assert got is not None and got.shape == (batch, q_len, 6, 16) and got.is_contiguous()
    assert torch.equal(got, expected)  # same kernel, same per-head K/V: bitwise identical


def test_gqa_sdpa_leaves_other_calls_to_transformers():
    from hf_accel.paged.gqa import gqa_sdpa

    q, k, v, mask = _gqa_inputs(1, 4, 20, False)
    grouped = _Attn(groups=3)
    assert gqa_sdpa(grouped, q, k, v, mask, None, 0.0, {}) is not None
    assert gqa_sdpa(_Attn(groups=1), q[:, :2], k, v, mask, None, 0.0, {}) is None  # no grouped heads
    assert gqa_sdpa(grouped, q[:, :, :1], k, v, mask[:, :, :1], None, 0.0, {}) is None  # one query: no copy
    assert gqa_sdpa(grouped, q, k, v, None, None, 0.0, {}) is None  # no mask: Transformers already uses GQA
    assert gqa_sdpa(grouped, q, k, v, mask, None, 0.1, {}) is None  # dropout
    assert gqa_sdpa(grouped, q, k, v, mask, None, 0.0, {"softcap": 30.0}) is None  # Transformers raises
    assert gqa_sdpa(grouped, q, k, v, mask, None, 0.0, {"position_bias": torch.zeros(1)}) is None
    assert gqa_sdpa(grouped, q, k, v, mask, None, 0.0, {"output_attentions": False, "softcap": None}) is not None
