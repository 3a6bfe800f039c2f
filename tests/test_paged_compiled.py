"""The compiled paged decode step: (a) its plan, exact; (b) the op against its reference; (c) generate."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import PAD, assert_close, chat_batch, random_batch, tiny_model
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_accel
from hf_accel import CompileConfig, IncompatibleOptionsError, PagedCache
from hf_accel.compile.paged_step import CompiledPagedDecode
from hf_accel.kernels.ops import choose
from hf_accel.kernels.reference import paged_attention as table_attention
from hf_accel.paged.step_op import define_paged_op
from hf_accel.speculative import PromptLookup

TRACE = CompileConfig(backend="eager", fullgraph=True)  # dynamo tracing without Inductor: quick, same graph
NO_EOS = dict(do_sample=False, eos_token_id=None)


def _step_graphs(model) -> int:
    """Graphs compiled for ``model``'s decode step (the fused MLPs' own graphs are not counted): the whole step's,
    or its layers' (regional)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return sum(len(_debug_get_cache_entry_list(code)) for code in model.forward.step_codes)


def _pair(arch: str = "llama", config: CompileConfig = TRACE, **overrides):
    plain = tiny_model(arch, **overrides)
    patched = hf_accel.patch_model(tiny_model(arch, **overrides), compile=config)
    return plain, patched


# ---------------------------------------------------------------- (a) the step's plan


def test_decode_plan_exact_slots_tables_and_positions():
    model = hf_accel.patch_model(tiny_model("llama"), compile=TRACE)
    cache = PagedCache(model, num_blocks=8, block_size=4, prefix_cache=False)
    ids, mask = random_batch(2, [3, 6], seed=0)
    cache.start(ids, mask)
    with torch.no_grad():  # prefill: row 0 takes block 0 (3 tokens), row 1 blocks 1-2 (6 tokens)
        model(input_ids=ids, attention_mask=mask, cache=cache)
    slots, tables, q_pos = cache.decode_plan(2, None)
    assert slots.tolist() == [3, 10]  # block 0 offset 3; block 2 offset 2
    assert tables.tolist() == [[0, 0], [1, 2]] and tables.dtype == torch.int32
    assert q_pos.tolist() == [[3], [6]] and q_pos.dtype == torch.int32
    cache.release(0)  # block 0 back on the free stack
    slots, tables, q_pos = cache.decode_plan(2, None)
    assert slots.tolist() == [-1, 11] and q_pos.tolist() == [[-1], [7]]  # a released row stores nothing
    slots, tables, q_pos = cache.decode_plan(2, None)
    assert slots.tolist() == [-1, 0]  # row 1's 9th token opens a block: the freed block 0 is reused
    assert tables.tolist() == [[0, 0, 0], [1, 2, 0]] and q_pos.tolist() == [[-1], [8]]
    assert cache.get_seq_length() == 9  # the logical length advanced by one per planned step
    assert cache._step is None  # an eager forward after a planned step plans its own


# ---------------------------------------------------------------- (b) the op


def _pools(num_blocks=12, block=4, kv_heads=2, dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks, block, kv_heads, dim, generator=gen)
    return k, v


def test_paged_decode_op_writes_then_attends_like_the_reference():
    op = define_paged_op()
    k_pool, v_pool = _pools()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 4, 1, 16, generator=gen)  # [B, H_q, 1, D]
    k, v = torch.randn(3, 2, 1, 16, generator=gen), torch.randn(3, 2, 1, 16, generator=gen)  # [B, H_kv, 1, D]
    tables = torch.tensor([[5, 2, 0], [7, 0, 0], [1, 3, 9]], dtype=torch.int32)  # scattered blocks
    q_pos = torch.tensor([[6], [-1], [10]], dtype=torch.int32)  # row 1 released
    slots = torch.tensor([2 * 4 + 2, -1, 9 * 4 + 2])  # each row's position q_pos in its table
    ref_k, ref_v = k_pool.clone(), v_pool.clone()
    out = op(q, k, v, ref_k, ref_v, slots, tables, q_pos, 0.25, 0, 0.0, "reference")
    assert torch.equal(ref_k[2, 2], k[0, :, 0]) and torch.equal(ref_v[9, 2], v[2, :, 0])
    assert torch.equal(ref_k[7], k_pool[7])  # the released row wrote nothing
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # and attends to nothing
    row0 = table_attention(q[:1], ref_k, ref_v, tables[:1], q_pos[:1], 0.25, 0, 0.0)
    assert torch.equal(out[:1], row0)
    port_k, port_v = k_pool.clone(), v_pool.clone()
    port = op(q, k, v, port_k, port_v, slots, tables, q_pos, 0.25, 0, 0.0, "portable")  # the accelerators' maths
    assert torch.equal(port_k, ref_k) and torch.equal(port_v, ref_v)
    assert_close(port, out, atol=1e-6, rtol=1e-5, name="portable vs reference")
    if not choose("paged_attention", "cpu").native:
        pytest.skip("no native paged attention here")
    ker_k, ker_v = k_pool.clone(), v_pool.clone()
    got = op(q, k, v, ker_k, ker_v, slots, tables, q_pos, 0.25, 0, 0.0, "native")
    assert torch.equal(ker_k, ref_k) and torch.equal(ker_v, ref_v)
    assert_close(got, out, atol=1e-5, rtol=1e-5, name="kernel vs reference")  # fp32, summation order only


# ---------------------------------------------------------------- (c) generate


@pytest.mark.parametrize("lengths", [[6], [4, 9, 12], [1, 7, 15, 16, 17, 31, 33, 40]])
def test_greedy_identical_and_every_decode_step_compiled(lengths):
    plain, patched = _pair()
    ids, mask = random_batch(len(lengths), lengths, seed=len(lengths))
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, paged=True, **NO_EOS)
    assert torch.equal(got, expected)
    assert patched.forward.steps == 9  # the prompt runs eagerly; the 9 one-token steps after it compiled
    eager = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)  # DynamicCache
    assert torch.equal(eager, expected) and patched.forward.steps == 9


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "mistral", "gpt_oss"])  # gpt_oss: attention sinks too
def test_other_architectures_long_contexts_and_sliding_windows(arch):
    plain, patched = _pair(arch, sliding_window=8)  # windows shorter than the context
    ids, mask = random_batch(2, [30, 5], seed=3)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, **NO_EOS)
    cache = PagedCache(patched, block_size=4)  # the block table widens as rows grow
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, cache=cache, **NO_EOS)
    assert torch.equal(got, expected) and patched.forward.steps == 19


def test_rows_released_on_eos_stay_exact():
    plain, patched = _pair()
    ids, mask = random_batch(3, [5, 30, 12], seed=6)
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    eos = int(probe[0, ids.shape[1] + 2])  # row 0 emits this token at its 3rd step: make it the EOS
    kwargs = dict(max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    cache = PagedCache(patched, num_blocks=32, prefix_cache=False)
    released = []

    class Watch(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            released.append(cache.released(0))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    watch = StoppingCriteriaList([Watch()])
    got = patched.generate(input_ids=ids, attention_mask=mask, cache=cache, stopping_criteria=watch, **kwargs)
    assert torch.equal(got, expected)
    assert released[4] is True and patched.forward.steps >= 5  # compiled steps ran with row 0 released


def test_beam_search_forks_and_copy_on_write():
    plain, patched = _pair()
    ids, mask = random_batch(2, [6, 11], seed=7)
    kwargs = dict(max_new_tokens=8, num_beams=3, do_sample=False, eos_token_id=None)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    got = patched.generate(input_ids=ids, attention_mask=mask, paged=True, **kwargs)
    assert torch.equal(got, expected)  # beams share and copy partial blocks
    assert patched.forward.steps == 8  # the prompt but its last token is stored once per row; 1 + 7 beam steps


def test_sampling_matches_the_eager_paged_step():
    _, compiled = _pair()
    eager = hf_accel.patch_model(tiny_model("llama"), compile=CompileConfig(decode_step=False))
    assert not isinstance(eager.__dict__.get("forward"), CompiledPagedDecode)
    ids, mask = random_batch(2, [20, 35], seed=3)
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=20, temperature=0.9, num_return_sequences=3, paged=True)
    outs = []
    for model in (eager, compiled):
        torch.manual_seed(11)
        outs.append(model.generate(input_ids=ids, attention_mask=mask, **kwargs))
    assert torch.equal(outs[0], outs[1])
    assert compiled.forward.steps == 10  # the prompt's last token runs once per returned sequence: 1 + 9 steps


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_no_recompilation_across_steps_and_calls(backend):
    torch._dynamo.reset()
    _, patched = _pair(config=CompileConfig(backend=backend))
    cache = PagedCache(patched, block_size=4)
    ids, mask = random_batch(2, [5, 8], seed=1)
    patched.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=6, **NO_EOS)
    assert _step_graphs(patched) == 1  # one graph for all steps while the block table widened
    for lengths, new in (([3, 11], 9), ([30, 2], 25), ([12, 2, 7], 12)):  # other prompts and batch sizes,
        ids, mask = random_batch(len(lengths), lengths, seed=2)  # block tables 1 to 14 wide
        patched.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new, **NO_EOS)
    assert _step_graphs(patched) == 1 and patched.forward.steps == 5 + 8 + 24 + 11


def test_sliced_inputs_share_the_step_graph():
    """A caller's own loop passes slices (a column of a wider tensor: strides ``(W, 1)`` at batch 1); the step copies
    them to plain strides instead of compiling a graph per stride."""
    torch._dynamo.reset()
    plain, patched = _pair()
    ids, mask = random_batch(1, [9], seed=4)
    cache = PagedCache(patched, block_size=4)
    tokens = torch.randint(3, plain.config.vocab_size, (1, 40))
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=mask, use_cache=True)  # the unpatched model, its own cache
        past = want.cache
        patched(input_ids=ids, attention_mask=mask, cache=cache, logits_to_keep=1)  # a prompt: eager
        for i, width in enumerate((1, 2, 7, 40, 5, 11, 40)):  # a plain tensor, then slices of wider ones
            step = tokens[:, :width][:, i : i + 1] if i else tokens[:, :1].clone()  # [1, 1], strides (width, 1)
            positions = torch.arange(64)[None, 9 + i : 10 + i] if i else torch.tensor([[9]])  # strides (64, 1)
            mask = torch.cat([mask, torch.ones_like(step)], 1)
            got = patched(input_ids=step, position_ids=positions, attention_mask=mask, cache=cache).logits
            want = plain(input_ids=step, position_ids=positions, attention_mask=mask, cache=past)
            past = want.cache
            assert_close(got, want.logits, atol=1e-5, rtol=1e-5)
    assert _step_graphs(patched) == 1 and patched.forward.steps == 7


def test_unpatch_restores_the_class_forward_and_copies_stay_plain():
    model = tiny_model("llama")
    ids, mask = random_batch(2, [4, 9], seed=2)
    before = model(input_ids=ids, attention_mask=mask).logits
    hf_accel.patch_model(model, compile=TRACE)
    assert isinstance(model.forward, CompiledPagedDecode)
    counts = hf_accel.patch_report(model)["changes"]["compile"]
    assert counts["paged decode step compiled (one-token steps and verification chunks)"] == 1
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin and twin.forward.__func__ is type(model).forward
    hf_accel.unpatch_model(model)
    assert "forward" not in model.__dict__
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_not_compiled_without_paged_attention():
    model = hf_accel.patch_model(tiny_model("llama"), compile=TRACE, paged=False)
    assert "forward" not in model.__dict__
    counts = hf_accel.patch_report(model)["changes"]["compile"]
    assert counts["paged decode step not compiled (paged attention is off)"] == 1


def test_which_calls_run_compiled():
    plain, patched = _pair()
    ids, mask = random_batch(2, [20, 9], seed=2)
    cache = PagedCache(patched)
    cache.start(ids, mask)
    with torch.no_grad():
        expected = plain(input_ids=ids, attention_mask=mask).logits
        got = patched(input_ids=ids, attention_mask=mask, cache=cache, logits_to_keep=1).logits  # 20 > 16 tokens
        assert patched.forward.steps == 0  # a long prompt: eager
        assert_close(got[:, -1], expected[:, -1], atol=1e-5, rtol=1e-4, name="prompt")  # fp32, packed linears
        chunk = torch.tensor([[5, 7, 9], [6, 8, 10]])  # a short chunk wanting every logit: compiled
        mask = torch.cat([mask, torch.ones_like(chunk)], 1)
        got = patched(input_ids=chunk, attention_mask=mask, cache=cache).logits
        assert patched.forward.steps == 1 and got.shape == (2, 3, 256)
        full = torch.cat([ids, chunk], 1)
        expected = plain(input_ids=full, attention_mask=mask).logits[:, -3:]
        assert_close(got, expected, atol=1e-5, rtol=1e-4, name="chunk")  # fp32, packed linears
        nxt = torch.tensor([[5], [6]])
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = patched(input_ids=nxt, attention_mask=mask, cache=cache, output_hidden_states=True)
    assert patched.forward.steps == 1 and out.hidden_states is not None  # an option the step lacks: eager


def test_kernel_mode_refuses_what_the_kernel_cannot_take(pretend_cpu_lacks):
    _, patched = _pair()
    pretend_cpu_lacks("avx512vnni", "avx512", "avx2")
    with pytest.raises(IncompatibleOptionsError, match=r"PagedCache\(attention='kernel'\) needs") as info:
        PagedCache(patched, attention="kernel")
    assert "cpu/avx2: (test) this CPU pretends to lack AVX2" in str(info.value)
    cache = PagedCache(patched)  # 'auto' gathers, and says why
    assert cache.layers[0].attention.impl == "gather"


def test_speculative_steps_and_chunks_compiled_exact_and_without_recompiling(monkeypatch):
    torch._dynamo.reset()
    plain, patched = _pair()
    ids, mask = random_batch(4, [6, 14, 9, 3], seed=8)
    ids[:, -4:] = ids[:, -8:-4]  # every row ends by repeating 4 tokens: prompt lookup finds matches to verify
    probe = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, **NO_EOS)
    eos = [int(probe[0, ids.shape[1] + 2]), int(probe[1, ids.shape[1] + 4])]  # rows 0 and 1 stop early
    kwargs = dict(max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **kwargs)
    batches = []
    step = patched.forward
    route = step._paged_cache

    def spy(args, kw):
        cache = route(args, kw)
        batches.append((*kw["input_ids"].shape, cache is not None))
        return cache

    monkeypatch.setattr(step, "_paged_cache", spy)
    lookup = PromptLookup(num_tokens=4, fallback=False)  # always verify what it finds
    got = patched.generate(input_ids=ids, attention_mask=mask, speculative=lookup, paged=True, **kwargs)
    assert torch.equal(got, expected)
    assert {(4, 5, True), (2, 1, True), (1, 1, True)} <= set(batches)  # chunks of 1 + 4 drafts, then rows leave
    assert all(compiled for _, w, compiled in batches if w <= 16 and w != ids.shape[1])  # all but the prompt
    graphs = _step_graphs(patched)
    assert graphs == 3  # one-token steps at batch >= 2 and at batch 1 (size 1 is always specialised), chunks
    lookup = PromptLookup(num_tokens=6, fallback=False)  # chunks 7 wide now
    got = patched.generate(input_ids=ids, attention_mask=mask, speculative=lookup, paged=True, **kwargs)
    assert torch.equal(got, expected) and (4, 7, True) in batches
    assert _step_graphs(patched) == graphs  # chunk width and batch are dynamic: no recompilation


def test_each_model_compiles_its_own_step():
    """Graphs are kept per patched model: more differently shaped models than dynamo's recompile limit in one
    process all run compiled (with one shared step, the graph past the limit would fail or fall back to eager).
    The limit (8 by default) is lowered to 2 here to keep the test short."""
    models = [hf_accel.patch_model(tiny_model("llama", num_hidden_layers=n), compile=TRACE) for n in (1, 2, 3)]
    ids, mask = random_batch(2, [3, 5], seed=9)
    with torch._dynamo.config.patch(recompile_limit=2):
        for model in models:  # fullgraph: a model over the limit would raise instead of falling back
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, paged=True, **NO_EOS)
            assert model.forward.steps == 2 and _step_graphs(model) == 1


def test_real_model_greedy_identical_compiled(default_model):
    model, tokenizer = default_model
    inputs = chat_batch(tokenizer, ["What is the capital of France?", "Write a haiku about autumn leaves."])
    with torch.inference_mode():
        expected = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        hf_accel.patch_model(model, compile=True)  # Inductor, the default backend
        try:
            got = model.generate(**inputs, max_new_tokens=24, do_sample=False, paged=True)
            steps = model.forward.steps
        finally:
            hf_accel.unpatch_model(model)
    assert torch.equal(got, expected) and steps == 23
