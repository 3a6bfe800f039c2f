"""The accelerators' implementations (hf_accel.kernels.portable) held to the torch reference on the CPU, the paths
that use them run end to end with ``attention="batched"`` (what a CUDA model runs), and the bucketed static-shape
decode step (what CUDA graphs replay). CUDA itself: tests/test_cuda.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import PAD, assert_close, random_batch, sink_logits, tiny_model

import hf_accel
from hf_accel import CompileConfig, Engine, PagedCache, PagedConfig, SpeculativeConfig
from hf_accel.compile.buckets import bucket, pad_step
from hf_accel.kernels import portable, reference, triton_paged
from hf_accel.paged.attention import attention_choice

NO_EOS = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)
#: the modules' own forward (no native executor, no automatic self-speculation): every attention call is paged
PLAIN_PATH = dict(compile=False, native=False, speculative=SpeculativeConfig(auto=None))


@pytest.fixture
def batched_calls(monkeypatch):
    """Counts calls of the portable paged attention and of the batched prefill (looked up at each use)."""
    calls = [0, 0]
    real = portable.paged_attention

    def counted(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(portable, "paged_attention", counted)
    real_chunk = portable.chunk_attention

    def counted_chunk(*args):
        calls[1] += 1
        return real_chunk(*args)

    monkeypatch.setattr(portable, "chunk_attention", counted_chunk)
    return calls


# ------------------------------------------------------------------------------------------ paged attention


def _pools(num_blocks, block, kv_heads, dim, dtype, poison):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    if poison:  # never-written slots of a torch.empty pool may hold NaN / inf: they must not leak into results
        k[-1], v[-1] = float("nan"), float("inf")
    return k, v


def _case(batch, heads, kv_heads, q_len, dim, block, dtype=torch.float32, poison=True):
    num_blocks = (3 if block > 1 else 8) * batch + 2
    k_pool, v_pool = _pools(num_blocks, block, kv_heads, dim, dtype, poison)
    gen = torch.Generator().manual_seed(1)
    perm = torch.randperm(num_blocks - 1, generator=gen)  # scattered blocks; the poisoned last one is never owned
    width = 3 if block > 1 else 8  # enough slots for the chunk
    tables = perm[: batch * width].view(batch, width).to(torch.int32)
    q_pos = torch.full((batch, q_len), -1, dtype=torch.int32)
    for row in range(batch):
        if row % 3 == 1:
            continue  # a released row (all padding)
        last = int(torch.randint(q_len - 1, width * block, (1,), generator=gen))
        q_pos[row] = torch.arange(last - q_len + 1, last + 1, dtype=torch.int32)
        used = last // block + 1
        tables[row, used:] = num_blocks - 1 if row % 2 else -1  # past the row's blocks: the poisoned one, or -1
    if batch > 2:
        q_pos[2, 0] = -1  # a padding hole inside a row
    query = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    return query, k_pool, v_pool, tables, q_pos


@pytest.mark.parametrize(
    "batch,heads,kv_heads,q_len,dim,block",
    [(1, 4, 4, 1, 16, 4), (4, 4, 2, 1, 16, 4), (5, 8, 2, 3, 32, 16), (3, 6, 1, 4, 8, 1), (2, 4, 2, 2, 64, 128)],
)
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (5, 0.0, False), (0, 20.0, False), (5, 0.0, True)])
def test_paged_attention_matches_the_reference(batch, heads, kv_heads, q_len, dim, block, window, softcap, sinks):
    args = _case(batch, heads, kv_heads, q_len, dim, block)
    sink = sink_logits(heads) if sinks else None
    expected = reference.paged_attention(*args, 0.3, window, softcap, sink)
    got = portable.paged_attention(*args, 0.3, window, softcap, sink)
    assert torch.isfinite(got).all()
    assert_close(got, expected, atol=2e-6, rtol=1e-5, name="portable paged attention")  # fp32: summation order
    released = args[4][:, 0] < 0
    assert torch.equal(got[released & (args[4] < 0).all(1)], torch.zeros_like(got[released & (args[4] < 0).all(1)]))


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_paged_attention_half_pools(dtype, atol):
    args = _case(4, 8, 2, 2, 32, 16, dtype)
    expected = reference.paged_attention(*args, 0.2, 0, 0.0)
    got = portable.paged_attention(*args, 0.2, 0, 0.0)
    assert got.dtype == dtype
    assert_close(got, expected, atol=atol, rtol=0, name=f"{dtype} portable paged attention")  # half rounding


def test_portable_ops_trace_without_graph_breaks_or_host_reads():
    """fullgraph tracing fails on .item(), .tolist(), nonzero or a boolean index: none may be in a step."""
    args = _case(4, 4, 2, 1, 16, 4, poison=False)
    compiled = torch.compile(portable.paged_attention, backend="eager", fullgraph=True, dynamic=True)
    assert_close(compiled(*args, 0.3, 0, 0.0), portable.paged_attention(*args, 0.3, 0, 0.0), atol=0, rtol=0)
    k_pool = args[1].clone()
    write = torch.compile(portable.pool_write, backend="eager", fullgraph=True)
    write(k_pool, torch.randn(2, 2, 1, 16), torch.tensor([5, -1]))
    linear = torch.compile(portable.int8_linear_compiled, backend="eager", fullgraph=True)
    q, s = torch.randint(-127, 128, (32, 64), dtype=torch.int8), torch.rand(32, 1) / 50
    x = torch.randn(3, 64)  # |y| ~ 10: float32 sums in another order
    assert_close(linear(x, q, s), reference.int8_linear(x, q, s), atol=2e-5, rtol=1e-5)


EXPERTS_CASES = [(1, 2, 1, torch.float32, 2e-5), (7, 3, 4, torch.float32, 2e-5), (30, 4, 1, torch.bfloat16, 0.1)]


@pytest.mark.parametrize("pairs", ["gathered", "grouped"])
@pytest.mark.parametrize(("rows", "j", "groups", "dtype", "atol"), EXPERTS_CASES)
def test_int8_experts_forms_match_the_reference(monkeypatch, pairs, rows, j, groups, dtype, atol):
    """Both forms of the portable experts linear: each pair's weights gathered (decode, no host read) and the pairs
    grouped by expert (prefill); ids outside [0, E) give zeros."""
    monkeypatch.setattr(portable, "EXPERTS_GATHER_PAIRS", 10_000 if pairs == "gathered" else 0)
    gen = torch.Generator().manual_seed(rows)
    q = torch.randint(-127, 128, (5, 24, 64), dtype=torch.int8, generator=gen)
    s = torch.rand(5, 24, groups, generator=gen) / 50
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    ids = torch.randint(-1, 6, (rows, j), generator=gen)
    got = portable.int8_experts_linear(x, ids, q, s)
    assert got.dtype == dtype and got.shape == (rows, j, 24)
    assert_close(got.float(), reference.int8_experts_linear(x.float(), ids, q, s), atol=atol, rtol=1e-2)
    if pairs == "gathered":  # no host read: it traces whole
        compiled = torch.compile(portable.int8_experts_linear, backend="eager", fullgraph=True)
        assert_close(compiled(x, ids, q, s).float(), got.float(), atol=0, rtol=0)


@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (4, 0.0, False), (0, 20.0, False), (4, 0.0, True)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_chunk_attention_matches_per_row_attention(window, softcap, sinks, heads, kv_heads):
    gen = torch.Generator().manual_seed(4)
    lengths, width = [9, 3, 0, 6], 9  # left padding; an empty (released) row
    q_pos = torch.full((4, width), -1, dtype=torch.int32)
    for row, n in enumerate(lengths):
        q_pos[row, width - n :] = torch.arange(n, dtype=torch.int32)
    query = torch.randn(4, heads, width, 16, generator=gen)
    key, value = torch.randn(2, 4, kv_heads, width, 16, generator=gen).unbind(0)
    sink = sink_logits(heads) if sinks else None
    got = portable.chunk_attention(query, key, value, q_pos, 0.25, window, softcap, sink)  # [B, Q, H_q, D]
    for row, n in enumerate(lengths):
        real = slice(width - n, width)
        if n:
            want = reference.dense_attention(query[row][:, real], key[row][:, real], value[row][:, real],
                                             list(range(n)), 0.25, window, softcap, sink)  # fmt: skip
            assert_close(got[row, real], want.transpose(0, 1), atol=2e-6, rtol=1e-5, name=f"row {row}")
        assert torch.equal(got[row, : width - n], torch.zeros_like(got[row, : width - n]))  # padding: zeros


@pytest.mark.parametrize("slots", [[9, -1, 2, -1, 30, 31], [-1, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 5], [-1, 7]])
def test_pool_write_stores_exactly_the_kept_tokens(slots):
    pool = torch.randn(8, 4, 2, 16)
    pool[0, 0] = float("nan")  # an unwritten slot 0 stays what it was, NaN included
    before = pool.clone()
    slots = torch.tensor(slots)
    q_len = 2 if len(slots) == 2 else 3
    new = torch.randn(len(slots) // q_len, 2, q_len, 16)  # [B, H_kv, Q, D]
    portable.pool_write(pool, new, slots)
    rows = new.transpose(1, 2).reshape(-1, 2, 16)  # [B*Q, H_kv, D], row-major like slots
    expected = before.clone().view(-1, 2, 16)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[slot] = rows[i]
    assert torch.equal(pool.view(-1, 2, 16).nan_to_num(7.0), expected.nan_to_num(7.0))


@pytest.mark.parametrize(
    "dtype,atol,rtol", [(torch.float32, 1e-5, 2e-6), (torch.bfloat16, 0.1, 8e-3), (torch.float16, 2e-2, 1e-3)]
)
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("rows", [5, 40])  # the fused W8A16 matmul (decode) and the de-quantized GEMM (prefill)
def test_int8_linear_forms_match_the_reference(dtype, atol, rtol, groups, rows):
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (48, 128), dtype=torch.int8, generator=gen)
    s = torch.rand(48, groups, generator=gen) / 50
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    expected = reference.int8_linear(x, q, s)
    for form in (portable.int8_linear, portable.int8_linear_compiled):
        got = form(x, q, s)
        assert got.dtype == dtype
        assert_close(got.float(), expected, atol=atol, rtol=rtol, name=f"{form.__name__} {dtype}")  # |y| <= ~40


# ------------------------------------------------------------------------------------------ buckets


def test_buckets_and_padding():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket(1, least=2) == 2
    with pytest.raises(ValueError, match="at least one row"):
        bucket(0)
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    tables = torch.tensor([[3, 4, 5], [6, 0, 0], [7, 8, 0]], dtype=torch.int32)
    q_pos = torch.tensor([[8, 9], [0, 1], [4, 5]], dtype=torch.int32)
    padded = pad_step(ids, torch.tensor([[8, 9]]), torch.arange(6), tables, q_pos)
    assert padded.rows == 3 and padded.input_ids.shape == (4, 2) and padded.block_tables.shape == (4, 4)
    assert padded.slots.tolist() == [0, 1, 2, 3, 4, 5, -1, -1]
    assert padded.q_pos[3].tolist() == [-1, -1] and padded.position_ids.shape == (4, 2)
    assert torch.equal(padded.block_tables[:3, :3], tables) and padded.block_tables[:, 3].tolist() == [0, 0, 0, 0]


# ------------------------------------------------------------------------------------------ models


def test_batched_choice_is_reported():
    choice = attention_choice("batched", torch.device("cpu"), torch.float32, 16, 64)
    assert choice.impl == "cpu/portable" and choice.native and choice.fn is portable.paged_attention
    cuda = attention_choice("auto", torch.device("cuda"), torch.bfloat16, 256, 128)  # no block-size limit there
    if importlib.util.find_spec("triton") is None:
        assert cuda.impl == "cuda/portable" and cuda.fn is portable.paged_attention
        assert cuda.rejected["cuda/triton"] == "triton is not installed"
    else:
        assert cuda.impl == "cuda/triton" and cuda.fn is triton_paged.paged_attention
        assert cuda.rejected["cuda/portable"] == "gathers each row's context into a copy first"
    forced = attention_choice("batched", torch.device("cuda"), torch.bfloat16, 16, 128)
    assert forced.impl == "cuda/portable" and forced.rejected[cuda.impl] == "not asked for"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("init", [0.2, 0.02])
def test_greedy_identical_with_batched_attention(arch, init, batched_calls):
    plain, base = tiny_model(arch, initializer_range=init), tiny_model(arch, initializer_range=init)
    patched = hf_accel.patch_model(base, **PLAIN_PATH, paged=PagedConfig(block_size=4, attention="batched"))
    ids, mask = random_batch(3, [4, 17, 9], seed=5)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, **NO_EOS),
                       expected)  # fmt: skip
    decode_calls = batched_calls[0]
    assert decode_calls == 11 * patched.config.num_hidden_layers  # every decode step of every layer
    assert batched_calls[1] == patched.config.num_hidden_layers  # the padded prompts: one call per layer
    spec = patched.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        paged=True,
        prompt_lookup=True,
        num_speculative_tokens=3,
        **NO_EOS,
    )
    assert torch.equal(spec, expected)  # verification chunks (Q > 1) through the batched kernel
    assert batched_calls[0] > decode_calls


def test_engine_with_batched_attention(batched_calls):
    model = hf_accel.patch_model(tiny_model("llama"), **PLAIN_PATH)
    prompts = [[5 + i] * (3 + 5 * i) for i in range(6)]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=10, **NO_EOS)[0, len(p) :].tolist() for p in prompts]
    engine = Engine(model, max_batch_tokens=32, max_running=4,
                    paged=PagedConfig(num_blocks=40, block_size=4, attention="batched"))  # fmt: skip
    ids = [engine.add_request(p, max_new_tokens=10, eos_token_id=None) for p in prompts]
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == refs and batched_calls[0] > 0
    assert batched_calls[1] > 0  # prompt chunks that start their sequences: one call per layer and step


@pytest.mark.parametrize("attention", ["auto", "batched"])
def test_bucketed_compiled_step_is_exact_and_keeps_one_graph(attention, batched_calls):
    torch._dynamo.reset()
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(backend="eager", cuda_graphs=True))
    notes = hf_accel.patch_report(patched)["changes"]["compile"]
    assert "paged decode step padded to bucketed shapes (no CUDA graphs here, mode None)" in notes
    assert patched.forward.static_shapes and not patched.forward.graphs
    cache = PagedCache(patched, block_size=4, attention=attention)
    steps = 0
    for lengths in ([6], [4, 9, 12], [1, 7, 15, 16, 17]):  # batches 1, 3 -> 4, 5 -> 8; tables 2 to 8 wide
        ids, mask = random_batch(len(lengths), lengths, seed=len(lengths))
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, cache=cache, **NO_EOS)
        assert torch.equal(got, expected)
        steps += 9
        assert patched.forward.steps == steps
    (code,) = patched.forward.step_codes  # the whole step: bucketed shapes are compiled whole
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code)) <= 2  # 1 and >1 rows
    assert (batched_calls[0] > 0) == (attention == "batched")


def test_compiled_step_is_chosen_per_device_type():
    """A model patched on the CPU and moved to CUDA gets the CUDA step (buckets, CUDA graphs): one variant per device
    type, each with its own code object, built on first use."""
    patched = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(prepack=False))
    step = patched.forward
    cpu, cuda = step.variant("cpu"), step.variant("cuda")  # compiling is lazy: nothing runs on CUDA here
    assert not cpu.static_shapes and not cpu.graphs and not step.static_shapes
    assert cuda.static_shapes and cuda.graphs and cuda.codes[0] is not cpu.codes[0]
    assert step.variant("cuda") is cuda and step.step_codes is cpu.codes and not cpu.layers and not cuda.layers
    no_graphs = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(prepack=False, cuda_graphs=False))
    assert not no_graphs.forward.variant("cuda").static_shapes
    regional = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(prepack=False, regional=True))
    cuda = regional.forward.variant("cuda")  # by region on CUDA too, without graphs (they take the whole step)
    assert not cuda.static_shapes and not cuda.graphs and cuda.layers
