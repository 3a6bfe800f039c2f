"""FlexAttention paged decode (``PagedConfig(attention="flex")``, hf_accel.kernels.flex_paged): its block mask's exact
state, the attention against the torch reference on the CPU (uncompiled FlexAttention, and one static-shape Inductor
compile that reads only each row's blocks), the choice and its refusal on the CPU, and the model paths end to end on
the CPU with the uncompiled function standing in for the compiled one (CUDA itself: tests/test_cuda.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import PAD, assert_close, generate_in_threads, random_batch, sink_logits, tiny_model
from torch.nn.attention.flex_attention import flex_attention

import hf_accel
from hf_accel import (
    CompileConfig,
    Engine,
    FeatureNotAvailableError,
    IncompatibleOptionsError,
    PagedCache,
    PagedConfig,
    SpeculativeConfig,
)
from hf_accel.kernels import flex_paged, reference
from hf_accel.paged.attention import attention_choice

NO_EOS = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)
PLAIN_PATH = dict(compile=False, native=False, speculative=SpeculativeConfig(auto=None))
EAGER = flex_paged.make_paged_attention()  # the uncompiled flex_attention


@pytest.fixture(autouse=True)
def _quiet(recwarn):
    """The uncompiled FlexAttention warns at every call that it is not compiled: that is the point here."""
    return recwarn


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """Let ``attention="flex"`` run on the CPU through the uncompiled FlexAttention (counted)."""
    calls = [0]

    def counted(*args):
        calls[0] += 1
        return EAGER(*args)

    monkeypatch.setattr(flex_paged, "DEVICES", (*flex_paged.DEVICES, "cpu"))
    monkeypatch.setitem(flex_paged.COMPILED, "cpu", counted)
    return calls


def _case(batch, heads, kv_heads, q_len, dim, block, dtype=torch.float32, seed=0):
    """Scattered tables with stale entries past each row's blocks (-1, an id past the pool, another row's block), a
    released row and a padding hole; a zero-filled pool whose unowned blocks hold finite stale values."""
    num_blocks, width = 4 * batch + 3, 4
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    v_pool = torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
    q_pos = torch.full((batch, q_len), -1, dtype=torch.int32)
    for row in range(batch):
        if row % 3 == 1:
            continue  # a released row: all padding, zeros out
        last = int(torch.randint(q_len - 1, width * block, (1,), generator=gen))
        q_pos[row] = torch.arange(last - q_len + 1, last + 1, dtype=torch.int32)
        used = last // block + 1
        stale = (-1, num_blocks + 5, int(tables[(row + 1) % batch, 0]))[row % 3]
        tables[row, used:] = stale
    if batch > 2:
        q_pos[2, 0] = -1  # a padding hole inside a row
    query = torch.randn(batch, heads, q_len, dim, generator=gen).to(dtype)
    return query, k_pool, v_pool, tables, q_pos


def test_block_mask_lists_each_rows_live_blocks():
    tables = torch.tensor([[3, 7, 1, -1], [5, 2, 9, 8], [6, 0, 0, 0]], dtype=torch.int32)
    q_pos = torch.tensor([[20, 21], [-1, 60], [-1, -1]], dtype=torch.int32)  # blocks of 16: 2, 4 and 0 used
    mask = flex_paged.block_mask(tables, q_pos, num_blocks=10, block_size=16, window=0)
    assert mask.kv_num_blocks.view(-1).tolist() == [2, 4, 0]
    assert mask.kv_indices.shape == (3, 1, 1, 10)  # padded to the pool's blocks: the mask covers the pool
    assert mask.kv_indices[:, 0, 0, :4].tolist() == [[3, 7, 0, 0], [5, 2, 9, 8], [0, 0, 0, 0]]
    assert mask.BLOCK_SIZE == (128, 16) and mask.shape[-2:] == (2, 160)
    b, h = torch.tensor(0), torch.tensor(0)
    seen = [bool(mask.mask_mod(b, h, torch.tensor(1), torch.tensor(kv))) for kv in (7 * 16 + 5, 7 * 16 + 6, 3 * 16)]
    assert seen == [True, False, True]  # slot 5 of block 7 is position 21; slot 6 would be 22
    assert not bool(mask.mask_mod(b, h, torch.tensor(0), torch.tensor(9 * 16)))  # another row's block
    assert not bool(mask.mask_mod(torch.tensor(1), h, torch.tensor(0), torch.tensor(5 * 16)))  # a padding query
    window = flex_paged.block_mask(tables, q_pos, num_blocks=10, block_size=16, window=4)
    assert [bool(window.mask_mod(b, h, torch.tensor(1), torch.tensor(7 * 16 + s))) for s in (1, 2, 5)] == [
        False, True, True]  # fmt: skip


@pytest.mark.parametrize(
    "batch,heads,kv_heads,q_len,dim,block",
    [(1, 4, 4, 1, 16, 16), (4, 8, 2, 1, 32, 16), (5, 8, 2, 3, 32, 16), (3, 6, 1, 4, 16, 32), (2, 4, 2, 16, 64, 16)],
)
@pytest.mark.parametrize("window,softcap,sinks", [(0, 0.0, False), (5, 0.0, False), (0, 20.0, False), (5, 0.0, True)])
def test_flex_paged_attention_matches_the_reference(batch, heads, kv_heads, q_len, dim, block, window, softcap, sinks):
    args = _case(batch, heads, kv_heads, q_len, dim, block)
    sink = sink_logits(heads) if sinks else None  # through the log-sum-exp FlexAttention returns
    expected = reference.paged_attention(*args, 0.3, window, softcap, sink)
    got = EAGER(*args, 0.3, window, softcap, sink)
    assert_close(got, expected, atol=2e-6, rtol=1e-5, name="flex paged attention")  # fp32: summation order
    padding = args[4] < 0
    assert torch.equal(got[padding], torch.zeros_like(got[padding]))


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_flex_paged_attention_half_pools(dtype, atol):
    args = _case(4, 8, 2, 2, 32, 16, dtype)
    got = EAGER(*args, 0.2, 0, 0.0)
    assert got.dtype == dtype
    assert_close(got, reference.paged_attention(*args, 0.2, 0, 0.0), atol=atol, rtol=0, name=f"{dtype} flex")


def test_compiled_flex_reads_only_each_rows_blocks():
    """Inductor's fused FlexAttention (static shapes, the CPU lowering) equals the reference, and a NaN in a block no
    row owns stays out of every result (the uncompiled function would read it: it scores the whole pool)."""
    compiled = flex_paged.make_paged_attention(flex_paged.compile_flex(dynamic=False))
    query, k_pool, v_pool, tables, q_pos = _case(3, 4, 2, 2, 16, 16)
    last = q_pos.amax(1).tolist()
    owned = {int(t) for row in range(3) if last[row] >= 0 for t in tables[row, : last[row] // 16 + 1]}
    spare = next(b for b in range(k_pool.shape[0]) if b not in owned)
    k_pool[spare], v_pool[spare] = float("nan"), float("inf")
    for window in (0, 3):
        got = compiled(query, k_pool, v_pool, tables, q_pos, 0.25, window, 0.0)
        assert torch.isfinite(got).all()
        assert_close(got, reference.paged_attention(query, k_pool, v_pool, tables, q_pos, 0.25, window, 0.0),
                     atol=2e-6, rtol=1e-5, name="compiled flex")  # fmt: skip
    # the compile cache is our wrapper's: a user's own torch.compile(flex_attention) keeps its whole recompile budget
    assert not torch._dynamo.eval_frame._debug_get_cache_entry_list(flex_attention.__code__)


def test_flex_choice_on_cuda_and_refusal_on_the_cpu():
    with pytest.raises(IncompatibleOptionsError, match=r"attention='flex'.*cannot run on cpu.*attention='auto'"):
        attention_choice("flex", torch.device("cpu"), torch.float32, 16, 64)
    patched = hf_accel.patch_model(tiny_model("llama"), **PLAIN_PATH, paged=PagedConfig(attention="flex"))
    report = hf_accel.patch_report(patched)["implementations"]["paged"]["paged_attention"]
    assert report["uses"] == "refused" and "FlexAttention" in report["why"]
    with pytest.raises(IncompatibleOptionsError, match="attention='flex'"):
        patched.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, paged=True, **NO_EOS)
    if importlib.util.find_spec("triton") is None:
        return
    cuda = attention_choice("flex", torch.device("cuda"), torch.bfloat16, 16, 128)
    assert cuda.impl == "cuda/flex" and cuda.fn is flex_paged.paged_attention and cuda.native
    assert cuda.rejected["cuda/triton"] == "not asked for"


def test_recompile_limit_is_an_error_that_says_what_to_do(monkeypatch):
    from torch._dynamo.exc import FailOnRecompileLimitHit

    def over_the_limit(*args):
        raise FailOnRecompileLimitHit("Hard failure due to fullgraph=True")

    monkeypatch.setitem(flex_paged.COMPILED, "cpu", over_the_limit)
    with pytest.raises(FeatureNotAvailableError, match=r"recompile limit.*use attention='auto'"):
        flex_paged.paged_attention(*_case(1, 4, 2, 1, 16, 16), 0.25, 0, 0.0)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding windows and soft-capping
@pytest.mark.parametrize("init", [0.2, 0.02])
def test_greedy_identical_with_flex_attention(arch, init, flex_on_cpu):
    plain, base = tiny_model(arch, initializer_range=init), tiny_model(arch, initializer_range=init)
    patched = hf_accel.patch_model(base, **PLAIN_PATH, paged=PagedConfig(block_size=4, attention="flex"))
    ids, mask = random_batch(3, [4, 17, 9], seed=5)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    cache = PagedCache(patched, block_size=4, attention="flex")
    assert all(layer.zeroed and not layer.keys.any() for layer in cache.layers)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, cache=cache, **NO_EOS)
    assert torch.equal(got, expected)
    assert flex_on_cpu[0] == 11 * patched.config.num_hidden_layers  # every decode step of every layer
    grown = cache.layers[0].keys.shape[0]
    assert grown > 1 and torch.isfinite(cache.layers[0].keys).all()  # grown pools are zero-filled too
    spec = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, prompt_lookup=True,
                            num_speculative_tokens=3, **NO_EOS)  # fmt: skip
    assert torch.equal(spec, expected)  # verification chunks (Q > 1)


def test_engine_and_compiled_step_with_flex_attention(flex_on_cpu):
    torch._dynamo.reset()
    model = hf_accel.patch_model(tiny_model("llama"), **PLAIN_PATH)
    prompts = [[5 + i] * (3 + 5 * i) for i in range(5)]
    refs = [model.generate(torch.tensor([p]), max_new_tokens=8, **NO_EOS)[0, len(p) :].tolist() for p in prompts]
    engine = Engine(model, max_batch_tokens=32, max_running=3,
                    paged=PagedConfig(num_blocks=40, block_size=4, attention="flex"))  # fmt: skip
    ids = [engine.add_request(p, max_new_tokens=8, eos_token_id=None) for p in prompts]
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == refs and flex_on_cpu[0] > 0
    compiled = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(backend="eager", cuda_graphs=True),
                                    paged=PagedConfig(block_size=4, attention="flex"))  # fmt: skip
    before = flex_on_cpu[0]
    ids, mask = random_batch(3, [4, 9, 12], seed=3)
    expected = hf_accel.unpatch_model(compiled).generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                                         **NO_EOS)  # fmt: skip
    compiled = hf_accel.patch_model(compiled, compile=CompileConfig(backend="eager", cuda_graphs=True),
                                    paged=PagedConfig(block_size=4, attention="flex"))  # fmt: skip
    got = compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, paged=True, **NO_EOS)
    assert torch.equal(got, expected) and compiled.forward.steps == 7 and flex_on_cpu[0] > before


def test_threads_share_a_flex_model(flex_on_cpu):
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"), **PLAIN_PATH, paged=PagedConfig(block_size=4, attention="flex"))
    batches = [random_batch(2, [3 + seed, 9], seed=seed) for seed in range(3)]
    expected = [plain.generate(input_ids=i, attention_mask=m, max_new_tokens=8, **NO_EOS) for i, m in batches]
    got = generate_in_threads(patched, batches, max_new_tokens=8, paged=True, **NO_EOS)
    assert all(torch.equal(got[k], expected[k]) for k in range(3)) and flex_on_cpu[0] > 0
