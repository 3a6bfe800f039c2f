"""Every feature on a CUDA device, greedy tokens against the unpatched model in float32 (the ``cuda`` parameter is
marked ``cuda``: skipped without a device; ``benchmarks/gpu/check.sh`` runs it). The ``cpu`` parameter runs the same
tests through the code paths a CUDA model takes (``attention="batched"``, bucketed compiled steps), so CI checks
them too."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import PAD, assert_close, generate_in_threads, random_batch, sink_logits, tiny_model

import hf_accel
from hf_accel import CompileConfig, Engine, Int8Config, PagedConfig, SpeculativeConfig
from hf_accel.kernels import portable

NO_EOS = dict(do_sample=False, eos_token_id=None, pad_token_id=PAD)
PLAIN_PATH = dict(compile=False, native=False, speculative=SpeculativeConfig(auto=None))


def _paged(device: torch.device, **kw) -> PagedConfig:
    """What ``auto`` picks on CUDA (the portable implementation), asked for explicitly on the CPU."""
    return PagedConfig(attention="auto" if device.type == "cuda" else "batched", **kw)


def _batch(device: torch.device, seed: int = 5):
    ids, mask = random_batch(3, [4, 17, 9], seed=seed)
    return ids.to(device), mask.to(device)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_paged_greedy_identical_and_reported(device, arch):
    plain = tiny_model(arch).to(device)
    patched = hf_accel.patch_model(tiny_model(arch).to(device), **PLAIN_PATH, paged=_paged(device, block_size=16))
    uses = hf_accel.patch_report(patched)["implementations"]["paged"]["paged_attention"]["uses"]
    triton = device.type == "cuda" and importlib.util.find_spec("triton") is not None
    assert uses == ("cuda/triton" if triton else f"{device.type}/portable")
    ids, mask = _batch(device)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, **NO_EOS)
    assert torch.equal(got, expected)
    lookup = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, prompt_lookup=True,
                              num_speculative_tokens=3, **NO_EOS)  # fmt: skip
    assert torch.equal(lookup, expected)


def test_compiled_step_greedy_identical(device):
    torch._dynamo.reset()
    config = _compile_config(device)
    plain = tiny_model("llama").to(device)
    patched = hf_accel.patch_model(tiny_model("llama").to(device), **dict(PLAIN_PATH, compile=config),
                                   paged=_paged(device, block_size=4))  # fmt: skip
    assert patched.forward.static_shapes and patched.forward.graphs == (device.type == "cuda")
    for seed in (1, 2):  # a second call replays the captured graphs
        ids, mask = _batch(device, seed)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, paged=True, **NO_EOS)
        assert torch.equal(got, expected)
    assert patched.forward.steps == 18


def test_int8_matches_its_dequantized_weights(device):
    base = tiny_model("llama")
    dequantized = hf_accel.patch_model(tiny_model("llama"), int8=Int8Config(backend="native"), **PLAIN_PATH)
    hf_accel.unpatch_model(dequantized)  # the float model holding exactly the int8 weights' values
    dequantized = dequantized.to(device)
    patched = hf_accel.patch_model(base, int8=Int8Config(backend="native"), **PLAIN_PATH).to(device)
    ids, mask = _batch(device)
    with torch.no_grad():
        want = dequantized(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask).logits
    assert_close(got, want, atol=1e-4, rtol=1e-4, name="int8 logits")  # fp32: order of the sums, scale placement
    expected = dequantized.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS), expected)


def test_int8_compiled_step_matches_eager_int8(device):
    """The int8 linears inside the compiled (on CUDA: graph-captured) step give the eager int8 model's tokens."""
    torch._dynamo.reset()
    int8 = Int8Config(backend="native")
    eager = hf_accel.patch_model(tiny_model("llama"), int8=int8, **PLAIN_PATH).to(device)
    compiled = hf_accel.patch_model(tiny_model("llama"), int8=int8, **dict(PLAIN_PATH, compile=_compile_config(device)),
                                    paged=_paged(device, block_size=4)).to(device)  # fmt: skip
    ids, mask = _batch(device, seed=3)
    expected = eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    got = compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, paged=True, **NO_EOS)
    assert torch.equal(got, expected) and compiled.forward.steps == 9


def _compile_config(device: torch.device) -> CompileConfig:
    """Inductor with CUDA graphs on CUDA; on the CPU the same bucketed shapes, traced only (quick)."""
    return CompileConfig(prepack=False) if device.type == "cuda" else CompileConfig(backend="eager", cuda_graphs=True)


@pytest.mark.parametrize("compiled", [False, True])
def test_engine_equals_single_requests(device, compiled):
    torch._dynamo.reset()
    patch = dict(PLAIN_PATH, compile=_compile_config(device)) if compiled else PLAIN_PATH
    model = hf_accel.patch_model(tiny_model("llama").to(device), **patch)
    prompts = [[5 + i] * (3 + 7 * i) for i in range(5)]
    refs = [
        model.generate(torch.tensor([p], device=device), max_new_tokens=8, **NO_EOS)[0, len(p) :].tolist()
        for p in prompts
    ]
    engine = Engine(model, max_batch_tokens=32, max_running=3, paged=_paged(device, num_blocks=48, block_size=4))
    ids = [engine.add_request(p, max_new_tokens=8, eos_token_id=None) for p in prompts]
    ids.append(engine.add_request(prompts[2], max_new_tokens=8, eos_token_id=None, prompt_lookup=True))
    outputs = engine.run_until_done()
    assert [outputs[i].tokens for i in ids] == [*refs, refs[2]]
    if compiled:  # steps where every request fed one token ran the compiled (bucketed) step
        assert model.forward.steps > 0 and model.forward.static_shapes


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])  # gpt_oss: attention sinks, biased transposed experts
def test_moe_int8_experts_and_paged_on_the_device(device, arch):
    """A mixture of experts with int8 experts (on CUDA the Triton kernel reads each pair's expert on the device) gives
    the tokens of the float model holding its de-quantized weights, paged and with prompt lookup."""
    twin = hf_accel.unpatch_model(hf_accel.patch_model(tiny_model(arch), int8=True, **PLAIN_PATH)).to(device)
    patched = hf_accel.patch_model(tiny_model(arch), int8=True, **PLAIN_PATH, paged=_paged(device)).to(device)
    ids, mask = _batch(device)
    expected = twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    for extra in ({}, {"paged": True}, {"paged": True, "prompt_lookup": True, "num_speculative_tokens": 3}):
        got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **extra, **NO_EOS)
        assert torch.equal(got, expected), extra


def test_threads_on_one_model(device):
    plain = tiny_model("llama").to(device)
    patched = hf_accel.patch_model(tiny_model("llama").to(device), **PLAIN_PATH, paged=_paged(device))
    batches = [_batch(device, seed) for seed in range(3)]
    expected = [plain.generate(input_ids=i, attention_mask=m, max_new_tokens=8, **NO_EOS) for i, m in batches]
    got = generate_in_threads(patched, batches, max_new_tokens=8, paged=True, **NO_EOS)
    assert all(torch.equal(got[k], expected[k]) for k in range(3))


@pytest.mark.cuda
def test_portable_kernels_never_wait_for_the_device():
    """CUDA's sync debug mode raises on any host synchronisation inside these calls."""
    dev = torch.device("cuda")
    k_pool, v_pool = torch.randn(2, 9, 16, 2, 64, device=dev).unbind(0)  # [NB, BS, H_kv, D] each
    tables = torch.tensor([[3, 1, -1], [0, 2, 5]], dtype=torch.int32, device=dev)
    q_pos = torch.tensor([[20], [-1]], dtype=torch.int32, device=dev)
    query, new = torch.randn(2, 8, 1, 64, device=dev), torch.randn(2, 2, 1, 64, device=dev)
    slots = torch.tensor([3 * 16 + 4, -1], device=dev)
    x, q = torch.randn(2, 128, device=dev, dtype=torch.bfloat16), torch.randint(-127, 128, (64, 128), device=dev)
    q, s = q.to(torch.int8), torch.rand(64, 1, device=dev) / 50
    experts_q = torch.randint(-127, 128, (4, 64, 128), device=dev).to(torch.int8)  # [E, N, K]
    experts_s, ids = torch.rand(4, 64, 1, device=dev) / 50, torch.tensor([[0, 3], [3, -1]], device=dev)
    torch.cuda.synchronize()
    from hf_accel.kernels import triton_experts, triton_int8, triton_paged

    triton_paged.paged_attention(query, k_pool, v_pool, tables, q_pos, 0.125, 0, 0.0)  # compile the kernels first
    triton_int8.int8_linear(x, q, s)
    triton_experts.int8_experts_linear(x, ids, experts_q, experts_s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        portable.pool_write(k_pool, new, slots)
        out = portable.paged_attention(query, k_pool, v_pool, tables, q_pos, 0.125, 0, 0.0)
        y = portable.int8_linear(x, q, s)
        out2 = triton_paged.paged_attention(query, k_pool, v_pool, tables, q_pos, 0.125, 0, 0.0)
        y2 = triton_int8.int8_linear(x, q, s)
        z = triton_experts.int8_experts_linear(x, ids, experts_q, experts_s)  # the layout is built on the device
        z2 = portable.int8_experts_linear(x, ids, experts_q, experts_s)  # decode-sized: gathered per pair
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == out2.shape == (2, 1, 8, 64) and y.shape == y2.shape == (2, 64)
    assert_close(z.float(), z2.float(), atol=0.1, rtol=1e-2, name="experts")  # bf16 sums in another order


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,atol,rtol", [(torch.float32, 1e-4, 1e-5), (torch.bfloat16, 0.25, 1e-2),
                                             (torch.float16, 0.05, 2e-3)])  # fmt: skip
def test_triton_int8_on_the_gpu(dtype, atol, rtol):
    from hf_accel.kernels import reference, triton_int8

    gen = torch.Generator(device="cuda").manual_seed(0)
    for m, n, k in [(1, 4096, 4096), (4, 14336, 4096), (16, 4096, 14336), (3, 1000, 200)]:  # 8B-shaped and a tail
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device="cuda", generator=gen)
        s = torch.rand(n, 1, device="cuda", generator=gen) / 500
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        want = reference.int8_linear(x, q, s)  # float32 sums of the same values
        assert_close(triton_int8.int8_linear(x, q, s).float(), want, atol=atol, rtol=rtol, name=f"{m}x{n}x{k} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_triton_and_portable_attention_on_the_gpu(dtype, atol):
    from test_portable import _case

    from hf_accel.kernels import reference, triton_paged

    args = [t.cuda() for t in _case(5, 8, 2, 3, 128, 16, dtype)]  # poisoned pools, stale table entries
    sinks = sink_logits(8).cuda()  # GPT-OSS's attention sinks
    for name, fn in (("triton", triton_paged.paged_attention), ("portable", portable.paged_attention)):
        for window, softcap, sink in ((0, 0.0, None), (7, 0.0, None), (0, 30.0, None), (7, 0.0, sinks)):
            want = reference.paged_attention(*args, 0.1, window, softcap, sink)
            assert_close(fn(*args, 0.1, window, softcap, sink).float(), want.float(), atol=atol, rtol=1e-3,
                         name=f"{name} {dtype} window={window} softcap={softcap} sinks={sink is not None}")  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_flex_attention_on_the_gpu(dtype, atol):
    """FlexAttention over the pool, compiled with dynamic shapes: right for several batch / chunk shapes (one
    compile), and no host synchronisation once compiled."""
    from test_flex import _case

    from hf_accel.kernels import flex_paged, reference

    torch._dynamo.reset()  # one dtype's variants (soft-capping, sinks) per test: within the recompile limit
    for shape in ((5, 8, 2, 3, 128, 16), (1, 8, 2, 1, 128, 16), (8, 32, 8, 4, 64, 16)):
        args = [t.cuda() for t in _case(*shape, dtype)]  # stale table entries, a released row, a padding hole
        sinks = sink_logits(shape[1]).cuda()  # through the log-sum-exp (Inductor's CPU lowering has none)
        for window, softcap, sink in ((0, 0.0, None), (7, 0.0, None), (0, 30.0, None), (7, 0.0, sinks)):
            want = reference.paged_attention(*args, 0.1, window, softcap, sink)
            assert_close(
                flex_paged.paged_attention(*args, 0.1, window, softcap, sink).float(),
                want.float(),
                atol=atol,
                rtol=1e-3,
                name=f"flex {shape} {dtype} window={window} sinks={sink is not None}",
            )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flex_paged.paged_attention(*args, 0.1, 0, 0.0)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_flex_greedy_identical_on_the_gpu(arch):
    """``attention="flex"`` in float32 on CUDA: eager paged decode, verification chunks and the graph-captured step
    give the unpatched model's tokens."""
    torch._dynamo.reset()
    dev = torch.device("cuda")
    plain = tiny_model(arch).to(dev)
    flex = PagedConfig(block_size=16, attention="flex")
    patched = hf_accel.patch_model(tiny_model(arch).to(dev), **PLAIN_PATH, paged=flex)
    assert hf_accel.patch_report(patched)["implementations"]["paged"]["paged_attention"]["uses"] == "cuda/flex"
    ids, mask = _batch(dev)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    assert torch.equal(patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, **NO_EOS),
                       expected)  # fmt: skip
    lookup = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, prompt_lookup=True,
                              num_speculative_tokens=3, **NO_EOS)  # fmt: skip
    assert torch.equal(lookup, expected)
    compiled = hf_accel.patch_model(tiny_model(arch).to(dev), **dict(PLAIN_PATH, compile=_compile_config(dev)),
                                    paged=flex)  # fmt: skip
    for _ in range(2):  # the second call replays the captured graphs
        got = compiled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, **NO_EOS)
        assert torch.equal(got, expected)


@pytest.mark.cuda
def test_int8_device_kernel_switch_on_the_gpu():
    """``use_device_kernel(False)`` runs the portable forms (exactly :func:`portable.int8_linear`), ``True`` the
    Triton kernel; both in a compiled step too."""
    from torch import nn

    from hf_accel.kernels import triton_int8
    from hf_accel.quant import Int8Linear

    layer = Int8Linear.from_module(nn.Linear(256, 128)).cuda()
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    bias = layer.bias.to(x.dtype)
    assert torch.equal(layer(x), triton_int8.int8_linear(x, layer.qweight, layer.scale) + bias)
    layer.use_device_kernel(False)
    assert torch.equal(layer(x), portable.int8_linear(x, layer.qweight, layer.scale) + bias)
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    assert_close(compiled(x).float(), layer(x).float(), atol=0.05, rtol=1e-2, name="fused de-quantize form")
