"""The kernel layer: every op's native builds against its pure-torch reference (tier b), the one place that chooses
implementations (exact choices and reasons, tier a), and the torch ops (CPU dispatch, other devices, fakes).

Tolerances: float32 products and attention differ from the reference only by summation order (stated per test);
integer-dot kernels are exact up to the final float32 scaling; packing is bitwise.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close, sink_logits

from hf_accel.kernels import portable, reference, triton_experts
from hf_accel.kernels.build import cpu_isas
from hf_accel.kernels.ops import OPS, choose, native_builds, op
from hf_accel.quant.core import quantize

ISAS = ["avx512vnni", "avx512", "avx2"]


def _builds(name: str) -> list[tuple[str, object]]:
    return [(isa, fn) for isa, fn in native_builds(name).items() if fn is not None]


def _params(name: str):
    """One pytest param per build of op ``name`` on this machine (a skip where there is none)."""
    return [pytest.param(fn, id=isa) for isa, fn in _builds(name)] or [
        pytest.param(None, marks=pytest.mark.skip(reason=f"no native build of {name} on this CPU"))
    ]


# ---------------------------------------------------------------------------------------------- (b) ops
@pytest.mark.parametrize("fn", _params("int8_linear"))
@pytest.mark.parametrize(("rows", "group"), [(1, None), (3, 16), (16, 64), (40, None)])
def test_int8_linear_against_reference(fn, rows, group):
    torch.manual_seed(rows)
    qw = quantize(torch.randn(200, 256), group)  # 200 rows: a partial tile
    x = torch.randn(rows, 256)
    expected = reference.int8_linear(x, qw.qweight, qw.scale)
    # fp32 sums over 256 products in another order: a few ulps of the largest partial sums
    assert_close(fn(x, qw.qweight, qw.scale), expected, atol=2e-4, rtol=1e-5, name="int8_linear")


def _experts_case(rows: int, j: int, group: int | None, seed: int = 0):
    """int8 experts ``[E=6, N=40, K=128]``, ``x [rows, K]`` and ids ``[rows, j]`` that include -1 and E (no expert)."""
    gen = torch.Generator().manual_seed(seed)
    qw = quantize(torch.randn(6 * 40, 128, generator=gen), group)
    q, s = qw.qweight.view(6, 40, 128), qw.scale.view(6, 40, -1)
    return torch.randn(rows, 128, generator=gen), torch.randint(-1, 7, (rows, j), generator=gen), q, s


@pytest.mark.parametrize("fn", _params("int8_experts_linear"))
@pytest.mark.parametrize(("rows", "j", "group"), [(1, 2, None), (5, 3, 32), (9, 1, None), (40, 8, 64), (0, 2, None)])
def test_int8_experts_linear_against_reference(fn, rows, j, group):
    x, ids, q, s = _experts_case(rows, j, group, seed=rows)
    expected = reference.int8_experts_linear(x, ids, q, s)
    got = fn(x, ids, q, s)
    assert got.shape == (rows, j, 40)
    assert_close(got, expected, atol=2e-4, rtol=1e-5, name="int8_experts_linear")  # fp32 sums, another order
    assert bool((got[(ids < 0) | (ids > 5)] == 0).all())  # an id outside [0, E): nothing


def test_int8_experts_linear_reference_is_each_pair_on_its_own():
    x, ids, q, s = _experts_case(4, 3, None)
    got = reference.int8_experts_linear(x, ids, q, s)
    for r in range(4):
        for j in range(3):
            e = int(ids[r, j])
            want = reference.int8_linear(x[r : r + 1], q[e], s[e])[0] if 0 <= e < 6 else torch.zeros(40)
            assert_close(got[r, j], want, atol=1e-5, rtol=1e-6, name=f"pair {r}, {j}")  # another matmul shape


@pytest.mark.parametrize(("pairs", "experts", "block"), [(8, 128, 16), (37, 5, 16), (0, 4, 16), (300, 6, 64)])
def test_experts_align_groups_every_valid_pair_by_expert_on_the_device(pairs, experts, block):
    """The Triton experts kernel's layout (built with tensor ops, no host read): each block of slots holds pairs of
    one expert, every valid pair exactly once, padding -1, nothing past the blocks in use."""
    flat = torch.randint(-1, experts + 1, (pairs,), generator=torch.Generator().manual_seed(pairs))
    slots, owners, used = triton_experts.align(flat, experts, block)
    assert slots.numel() == owners.numel() * block and owners.numel() == -(pairs // -block) + min(experts, pairs)
    assert sorted(p for p in slots.tolist() if p >= 0) == [i for i in range(pairs) if 0 <= flat[i] < experts]
    for b in range(int(used)):
        assert all(int(flat[p]) == int(owners[b]) for p in slots[b * block : (b + 1) * block].tolist() if p >= 0)
    assert bool((slots[int(used) * block :] == -1).all())
    traced = torch.compile(triton_experts.align, backend="eager", fullgraph=True)  # no host read: traces whole
    assert all(torch.equal(a, b) for a, b in zip(traced(flat, experts, block), (slots, owners, used), strict=True))


@pytest.mark.parametrize("name", ["w8a8_linear", "w8a16_linear"])
@pytest.mark.parametrize(("rows", "k", "n"), [(1, 64, 4), (5, 192, 203), (16, 576, 64)])
def test_integer_dot_linears_against_reference(name, rows, k, n):
    builds = _builds(name)
    if not builds:
        pytest.skip(f"no native build of {name} on this CPU")
    torch.manual_seed(k + rows)
    x, qw = torch.randn(rows, k) * 3, quantize(torch.randn(n, k))
    expected = getattr(reference, name)(x, qw.qweight, qw.scale)
    for _, fn in builds:  # exact integer dots; one float32 sum of 16 scaled groups rounds
        got = fn(x, qw.qweight, qw.scale)
        assert_close(got, expected, atol=2e-6 * float(expected.abs().max()), rtol=0, name=name)


def test_quantize_activations_bitwise_like_reference():
    builds = _builds("quantize_activations")
    if not builds:
        pytest.skip("no AVX-512 VNNI build on this CPU")
    torch.manual_seed(3)
    x = torch.randn(5, 128) * torch.logspace(-2, 2, 5).unsqueeze(1)
    for _, fn in builds:
        for got, expected in zip(fn(x), reference.vnni_activations(x), strict=True):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("fn", _params("paged_attention"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sinks", [False, True])
def test_paged_attention_against_reference(fn, dtype, sinks):
    torch.manual_seed(0)
    pools = torch.randn(2, 12, 8, 2, 16).to(dtype)  # K and V: [NB, BS, H_kv, D]
    query = torch.randn(3, 4, 2, 16).to(dtype)  # [B, H_q, Q, D]
    tables = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 3, 9]], dtype=torch.int32)
    q_pos = torch.tensor([[5, 6], [-1, -1], [20, 21]], dtype=torch.int32)  # row 1: padding only
    sink = sink_logits(4).to(dtype) if sinks else None  # GPT-OSS's sinks, in the model's dtype
    args = (query, pools[0], pools[1], tables, q_pos, 0.25, 0, 0.0, sink)
    expected = reference.paged_attention(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # online softmax in fp32, output rounded to the pool's dtype
    assert_close(fn(*args).float(), expected.float(), atol=tol, rtol=tol, name=f"paged attention {dtype}")


@pytest.mark.parametrize("isa", ISAS)
def test_panel_pack_and_linear_against_reference(isa):
    pack, linear = native_builds("panel_pack").get(isa), native_builds("panel_linear").get(isa)
    if pack is None:
        pytest.skip(f"no {isa} build on this CPU")
    torch.manual_seed(1)
    w, x, b = torch.randn(48, 40), torch.randn(3, 40), torch.randn(48)
    packed = pack(w)
    assert torch.equal(packed, reference.panel_pack(w))  # a layout change: bitwise
    assert_close(linear(x, packed, b), reference.panel_linear(x, packed, b), atol=1e-5, rtol=1e-5, name="panel")


@pytest.mark.parametrize("fn", _params("float_linear"))
def test_float_linear_against_reference(fn):
    torch.manual_seed(2)
    x, w = torch.randn(13, 64), torch.randn(37, 64)
    assert_close(fn(x, w), reference.float_linear(x, w), atol=1e-5, rtol=1e-5, name="float_linear")


def _decoder_args(int8: bool, width: int, used: int, kv_dtype: torch.dtype, half: torch.dtype | None = None):
    """Random weights for 2 Llama-style layers (E 64, 4 heads of 16, 2 K/V heads), a chunk and filled buffers;
    ``half``: float weights, norms and biases in that dtype (a half-precision model's)."""
    torch.manual_seed(width + used)
    hidden, inter, heads, kv_heads, dim, batch = 64, 96, 4, 2, 16, 2

    def proj(n: int, k: int) -> list[torch.Tensor]:
        w = torch.randn(n, k) / k**0.5
        if not int8:
            return [w, torch.empty(0), torch.randn(n) * 0.1]
        qw = quantize(w)
        return [qw.qweight, qw.scale, torch.randn(n) * 0.1]

    flat: list[torch.Tensor] = []
    for _ in range(2):
        ln = [1 + 0.1 * torch.randn(hidden), 1 + 0.1 * torch.randn(hidden)]
        attn = proj(heads * dim, hidden) + proj(kv_heads * dim, hidden) + proj(kv_heads * dim, hidden)
        attn += proj(hidden, heads * dim)
        mlp = proj(2 * inter, hidden) + [torch.empty(0)] * 3 + proj(hidden, inter)  # fused gate/up
        flat += [*ln, *attn, *mlp, torch.empty(0), torch.empty(0)]
    if half is not None:
        flat = [t.to(half) if t.is_floating_point() else t for t in flat]
    total = used + width
    keys = [torch.randn(batch, kv_heads, total + 8, dim).to(kv_dtype) for _ in range(2)]
    values = [torch.randn(batch, kv_heads, total + 8, dim).to(kv_dtype) for _ in range(2)]
    allowed = torch.ones(batch, width, total, dtype=torch.bool).tril(used)  # causal over the chunk
    allowed[1, :, :3] = False  # row 1's first columns are padding
    angles = torch.randn(batch * width, dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    h = torch.randn(batch * width, hidden)
    return [h, flat, keys, values, used, allowed, cos, sin, heads, kv_heads, 1e-5, dim**-0.5, 0]


@pytest.mark.parametrize("fn", _params("decoder_layers"))
@pytest.mark.parametrize(("int8", "width", "used"), [(False, 1, 9), (True, 3, 9), (False, 70, 0), (True, 4, 0)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_decoder_layers_against_reference(fn, int8, width, used, kv_dtype):
    """Every real query's hidden state and every written K/V column; float32 maths in another order (float16 K/V
    rounded the same way on both sides)."""
    args = _decoder_args(int8, width, used, kv_dtype)
    ref = list(args)
    ref[2], ref[3] = [t.clone() for t in args[2]], [t.clone() for t in args[3]]
    expected = reference.decoder_layers(*ref)
    got = fn(*args)
    sees = args[5].any(-1).flatten()  # [B*C] queries with something to see (a padding query's output is unused)
    assert_close(got[sees], expected[sees], atol=5e-4, rtol=5e-4, name="hidden")
    width = args[5].shape[1]
    written = slice(used, used + width)
    rows = args[5].any(-1)  # [B, C]
    for a, b in zip(args[2] + args[3], ref[2] + ref[3], strict=True):
        mask = rows[:, None, :, None].expand(-1, a.shape[1], -1, a.shape[3])
        assert_close(a[:, :, written][mask].float(), b[:, :, written][mask].float(), atol=5e-3, rtol=5e-3, name="kv")
        assert torch.equal(a[:, :, :used], b[:, :, :used])  # the columns before the chunk are untouched


@pytest.mark.parametrize("fn", _params("decoder_layers"))
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("width", "used", "tol"), [(1, 9, 5e-4), (5, 3, 5e-4), (70, 0, 3e-2)])
def test_decoder_layers_half_weights_against_reference(fn, half, width, used, tol):
    """A half-precision model's weights, norms and biases read in place: float32 activations and sums for up to 16
    rows (tight); wider chunks round the activations to ``half`` for the half GEMM, on both sides, so a float-order
    difference can move one rounding (a few half-precision ulps)."""
    args = _decoder_args(False, width, used, torch.float32, half)
    ref = list(args)
    ref[2], ref[3] = [t.clone() for t in args[2]], [t.clone() for t in args[3]]
    expected = reference.decoder_layers(*ref)
    got = fn(*args)
    sees = args[5].any(-1).flatten()
    assert got.dtype == torch.float32
    assert_close(got[sees], expected[sees], atol=tol, rtol=tol, name="hidden")


@pytest.mark.parametrize("fn", _params("decoder_layers_paged"))
@pytest.mark.parametrize(("int8", "width"), [(False, 1), (True, 3), (False, 16)])
def test_paged_decoder_layers_against_reference(fn, int8, width):
    """Over a pool: scattered blocks, a released row (no slots, q_pos -1), a row with a padding query."""
    args = _decoder_args(int8, width, 9, torch.float32)
    h, flat, cos, sin = args[0], args[1], args[6], args[7]
    batch, block, kv_heads, dim = 2, 4, 2, 16
    pools = [torch.randn(16, block, kv_heads, dim) for _ in range(4)]  # K and V of 2 layers
    tables = torch.tensor([[7, 2, 9, 0, 5, 11, 13, 15], [1, 3, 4, 6, 8, 10, 12, 14]], dtype=torch.int32)
    q_pos = (torch.arange(width)[None] + torch.tensor([[9], [5]])).to(torch.int32)  # [B, C]
    q_pos[1, 0] = -1  # a padding query of row 1
    slot = lambda row, t: int(tables[row, t // block]) * block + t % block  # noqa: E731
    slots = torch.tensor([slot(r, int(t)) if t >= 0 else -1 for r in range(batch) for t in q_pos[r]])
    ref_pools = [p.clone() for p in pools]
    expected = reference.decoder_layers_paged(
        h, flat, ref_pools[:2], ref_pools[2:], slots, tables, q_pos, cos, sin, 4, kv_heads, 1e-5, dim**-0.5, 0
    )
    got = fn(h, flat, pools[:2], pools[2:], slots, tables, q_pos, cos, sin, 4, kv_heads, 1e-5, dim**-0.5, 0)
    real = (q_pos >= 0).flatten()
    assert_close(got[real], expected[real], atol=5e-4, rtol=5e-4, name="paged hidden")
    for a, b in zip(pools, ref_pools, strict=True):
        assert_close(a, b, atol=5e-4, rtol=5e-4, name="pools")  # the written slots; every other one untouched


# -------------------------------------------------------------------------------------------- (a) choose
def test_every_op_has_a_reference_and_a_fake():
    for spec in OPS.values():
        assert callable(spec.reference) and spec.fake is not None, spec.name


def test_choice_takes_the_widest_build_that_fits_and_says_why_not_the_others():
    isas = cpu_isas()
    if "avx2" not in isas:
        pytest.skip("no AVX2 on this CPU")
    eight = choose("int8_linear", "cpu", group_size=8)  # 8 lanes only: the AVX-512 builds refuse it
    assert eight.impl == "cpu/avx2" and eight.native
    for isa in ("avx512vnni", "avx512"):
        reason = eight.rejected[f"cpu/{isa}"]
        expected = "int8 groups of 8 are not a multiple of its 16 lanes" if isa in isas else "lacks"
        assert expected in reason
    assert eight.rejected["reference"] == "a native build runs here"
    assert eight.describe()["uses"] == "cpu/avx2"
    odd = choose("int8_linear", "cpu", group_size=4)
    assert odd.impl == "reference" and odd.fn is reference.int8_linear
    assert odd.rejected["cpu/avx2"] == "int8 groups of 4 are not a multiple of its 8 lanes"


def test_other_devices_run_the_portable_implementation_or_the_reference_and_say_so():
    choice = choose("paged_attention", "meta")
    assert choice.impl == "meta/portable" and choice.native and choice.fn is portable.paged_attention
    assert choice.why == portable.WHY["paged_attention"]
    assert choice.rejected == {
        "cpu/*": "native builds are CPU code; this call is on meta",
        "cuda/triton": "a CUDA kernel; this call is on meta",
        "reference": "written to be plainly right, not fast",
    }
    assert choose("int8_linear", "meta", group_size=64).fn is portable.int8_linear
    plain = choose("float_linear", "meta")  # no portable form: the reference, said so
    assert plain.impl == "reference" and not plain.native
    assert plain.rejected == {"cpu/*": "native builds are CPU code; this call is on meta"}


def test_pretended_cpu_changes_the_choice(pretend_cpu_lacks):
    pretend_cpu_lacks(*ISAS)
    choice = choose("float_linear", "cpu")
    assert choice.impl == "reference"
    assert choice.rejected["cpu/avx2"] == "(test) this CPU pretends to lack AVX2"


def test_torch_op_dispatches_to_the_chosen_build_and_traces_with_its_fake():
    if not choose("float_linear", "cpu").native:
        pytest.skip("no native float_linear here")
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    float_linear = op("float_linear")
    assert float_linear is op("float_linear")  # defined once per process
    assert_close(float_linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5, name="op")
    meta = float_linear(x.to("meta"), w.to("meta"))  # the fake: shapes only
    assert meta.shape == (2, 8) and meta.device.type == "meta"
    compiled = torch.compile(lambda a, b: float_linear(a, b) + 1, backend="eager", fullgraph=True)
    assert_close(compiled(x, w), x @ w.T + 1, atol=1e-5, rtol=1e-5, name="compiled op")
