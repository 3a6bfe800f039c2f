"""The paged decode step compiled by region (``CompileConfig(regional=...)``): (a) the option and its resolution,
(b) one graph per kind of decoder layer, greedy identical, logits close under Inductor, (c) patch hygiene: unpatch,
copies, threads."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from helpers import ARCHS, PAD, assert_close, generate_in_threads, random_batch, run_threads, tiny_model

import hf_accel
from hf_accel import CompileConfig, IncompatibleOptionsError, PagedCache
from hf_accel.compile.regional import RegionalLayer

TRACE = CompileConfig(backend="eager", fullgraph=True, regional=True)  # dynamo tracing without Inductor: quick
WHOLE = CompileConfig(backend="eager", fullgraph=True)
NO_EOS = dict(do_sample=False, eos_token_id=None)
NOTE = "paged decode step compiled by region: {} decoder layers share {} (embedding, final norm and LM head eager)"


def _graphs(model) -> list[int]:
    """Graphs per compiled code object of ``model``'s step (one per kind of layer when regional)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return [len(_debug_get_cache_entry_list(code)) for code in model.forward.step_codes]


def _count_layer_calls(model) -> list[int]:
    """Wrap the CPU step's compiled layer functions to count their calls (one per layer per compiled step)."""
    calls = [0]
    layers = model.forward.variant("cpu").layers
    for kind, fn in list(layers.items()):

        def counted(*args, _fn=fn, **kwargs):
            calls[0] += 1
            return _fn(*args, **kwargs)

        layers[kind] = counted
    return calls


# ---------------------------------------------------------------- (a) the option


def test_regional_is_opt_in_and_refuses_cuda_graphs():
    assert not CompileConfig().regional and CompileConfig().step_graphs("cuda")
    forced = CompileConfig(regional=True)
    assert not forced.step_graphs("cuda") and not forced.step_graphs("cpu")  # graphs would take the whole step
    assert not CompileConfig(regional=True, cuda_graphs=False).step_graphs("cuda")
    with pytest.raises(IncompatibleOptionsError, match=r"regional cannot be combined with cuda_graphs=True"):
        CompileConfig(regional=True, cuda_graphs=True)
    with pytest.raises(IncompatibleOptionsError, match=r"CompileConfig\.regional"):
        CompileConfig(regional=None)


# ---------------------------------------------------------------- (b) graphs and outputs


@pytest.mark.parametrize("lengths", [[6], [4, 9, 12]])
def test_one_graph_serves_every_layer_and_greedy_is_identical(lengths):
    torch._dynamo.reset()
    plain = tiny_model("llama", num_hidden_layers=5)
    patched = hf_accel.patch_model(tiny_model("llama", num_hidden_layers=5), compile=TRACE)
    notes = hf_accel.patch_report(patched)["changes"]["compile"]
    assert notes[NOTE.format(5, "1 compiled layer step")] == 1
    assert patched.forward.regional and len(patched.forward.step_codes) == 1
    calls = _count_layer_calls(patched)
    ids, mask = random_batch(len(lengths), lengths, seed=len(lengths))
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, paged=True, **NO_EOS)
    assert torch.equal(got, expected)
    assert patched.forward.steps == 9 and calls[0] == 9 * 5  # every layer of every decode step ran compiled
    assert _graphs(patched) == [1]  # five layers, nine steps, one graph


@pytest.mark.parametrize("config", [TRACE, WHOLE], ids=["regional", "whole"])
def test_both_forms_keep_their_graphs_across_calls(config):
    torch._dynamo.reset()
    plain, patched = tiny_model("llama"), hf_accel.patch_model(tiny_model("llama"), compile=config)
    assert patched.forward.regional == (config is TRACE)
    cache = PagedCache(patched, block_size=4)
    for lengths, new in (([5, 8], 6), ([3, 11], 9), ([30, 2], 25), ([12, 2, 7], 12)):  # tables 1 to 14 wide
        ids, mask = random_batch(len(lengths), lengths, seed=len(lengths) + new)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, **NO_EOS)
        got = patched.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new, **NO_EOS)
        assert torch.equal(got, expected)
    assert _graphs(patched) == [1] and patched.forward.steps == 5 + 8 + 24 + 11


def test_layers_of_two_kinds_get_a_graph_each():
    """Gemma 2 alternates sliding-window and full-attention layers (``config.layer_types``): one compiled copy per
    kind, so neither kind's graph guards on the other's window."""
    torch._dynamo.reset()
    overrides = dict(sliding_window=8, num_hidden_layers=4)
    plain, patched = tiny_model("gemma2", **overrides), hf_accel.patch_model(tiny_model("gemma2", **overrides),
                                                                              compile=TRACE)  # fmt: skip
    kinds = set(patched.config.layer_types)
    assert len(kinds) == 2
    assert hf_accel.patch_report(patched)["changes"]["compile"][NOTE.format(4, "2 compiled layer steps")] == 1
    calls = _count_layer_calls(patched)
    ids, mask = random_batch(2, [30, 5], seed=3)  # windows shorter than the context
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, paged=True, **NO_EOS)
    assert torch.equal(got, expected) and calls[0] == 11 * 4
    assert _graphs(patched) == [1, 1]


def test_inductor_regional_logits_match_the_unpatched_model_at_the_default_init():
    """Inductor-generated layers at Transformers' default ``initializer_range`` (0.02, logits close together): every
    decode step's logits within fp32 tolerance of the unpatched model's, fed the same tokens."""
    torch._dynamo.reset()
    plain = tiny_model("qwen3", initializer_range=0.02, num_hidden_layers=3)
    config = CompileConfig(regional=True)  # Inductor
    patched = hf_accel.patch_model(tiny_model("qwen3", initializer_range=0.02, num_hidden_layers=3), compile=config)
    assert patched.forward.regional
    ids, mask = random_batch(3, [7, 2, 11], seed=5)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, output_scores=True, return_dict_in_generate=True, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, paged=True, **kwargs)
    assert patched.forward.steps == 7
    fed = torch.cat([mask, torch.ones_like(got.sequences[:, ids.shape[1] :])], 1)
    with torch.no_grad():  # the unpatched model over the patched model's tokens: a teacher-forced reference
        full = plain(input_ids=got.sequences, attention_mask=fed).logits  # [B, S, V]
    for step, scores in enumerate(got.scores):
        expected = full[:, ids.shape[1] - 1 + step]
        assert_close(scores, expected, atol=1e-4, rtol=1e-4, name=f"step {step}")


# ---------------------------------------------------------------- (c) hygiene


def test_unpatch_and_copies_restore_plain_layers():
    model = tiny_model("llama")
    ids, mask = random_batch(2, [4, 9], seed=2)
    before = model(input_ids=ids, attention_mask=mask).logits
    hf_accel.patch_model(model, compile=TRACE)
    layers = list(model.model.layers)
    assert all(isinstance(layer.forward, RegionalLayer) for layer in layers)
    counts = hf_accel.patch_report(model)["changes"]["compile"]
    assert counts["decoder layer: compiled by region inside paged decode steps"] == len(layers)
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)  # outside a step: the class's
    twin = copy.deepcopy(model)
    for layer in twin.model.layers:
        assert isinstance(layer.forward, types.MethodType) and layer.forward.__self__ is layer
        assert layer.forward.__func__ is type(layer).forward
    hf_accel.unpatch_model(model)
    assert all("forward" not in layer.__dict__ for layer in layers)
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


@pytest.mark.parametrize("config", [TRACE, WHOLE], ids=["regional", "whole"])
def test_threads_share_the_compiled_step(config):
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"), compile=config)
    batches = [random_batch(len(lengths), lengths, seed=i) for i, lengths in enumerate(([5], [3, 8], [6, 2, 9]))]
    kwargs = dict(max_new_tokens=8, pad_token_id=PAD, **NO_EOS)
    expected = [plain.generate(input_ids=ids, attention_mask=mask, **kwargs) for ids, mask in batches]
    got = generate_in_threads(patched, batches, repeats=2, paged=True, **kwargs)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert patched.forward.steps == 2 * 3 * 7


MLPS = CompileConfig(backend="eager", fullgraph=True, mlp=True)  # compiled MLPs: they compile inside eager calls


@pytest.mark.parametrize(("config", "paged"), [(TRACE, True), (WHOLE, True), (MLPS, False)],
                         ids=["regional", "whole", "compiled-mlps"])  # fmt: skip
def test_calls_beside_a_compilation_wait_for_it(config, paged):
    """torch's compile flag is process-wide: while one thread compiles, ``is_compiling()`` is true in all, and an eager
    forward beside it took compile-time branches (Transformers' ``kernels`` context variable was left corrupted:
    later calls failed). A call that may compile (the step's, or an eager call's first of its shape class) now runs
    alone; calls beside it wait, and every output is exact."""
    torch._dynamo.reset()
    plain = tiny_model("llama", num_hidden_layers=4)
    patched = hf_accel.patch_model(tiny_model("llama", num_hidden_layers=4), compile=config)
    ids, mask = random_batch(2, [5, 9], seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, pad_token_id=PAD, **NO_EOS)
    expected = plain.generate(**kwargs)
    done, eager = [], []

    def compiling() -> None:
        done.append(patched.generate(paged=paged, **kwargs))  # its first steps compile

    def beside() -> None:
        while not done and len(eager) < 200:
            eager.append(patched.generate(**kwargs))  # DynamicCache: eager forwards

    run_threads([compiling, beside])
    assert torch.equal(done[0], expected) and eager
    assert all(torch.equal(e, expected) for e in eager)
    assert torch.equal(patched.generate(**kwargs), expected)  # nothing left corrupted


def test_the_first_call_of_a_shape_class_runs_alone():
    """Deterministic: the first forward of a shape class (it may compile) holds the gate alone; a call arriving
    meanwhile starts only after it, and once the class is known, calls overlap."""
    import threading
    import time

    patched = hf_accel.patch_model(tiny_model("llama"), compile=WHOLE)
    step = patched.forward
    spans: list[tuple[str, float, float]] = []
    entered = threading.Event()
    original = step.original

    together = threading.Barrier(2, timeout=5)  # later calls meet here: only calls that overlap can pass it
    later = []

    def slow(*args, **kwargs):  # the first call stands in for a long compilation
        start = time.perf_counter()
        first = not entered.is_set()
        entered.set()
        if first:
            time.sleep(0.3)
        if later:
            together.wait()
        out = original(*args, **kwargs)
        spans.append(("first" if first else "later", start, time.perf_counter()))
        return out

    step.original = slow
    ids, mask = random_batch(2, [4, 6], seed=1)

    def call() -> None:
        step(input_ids=ids, attention_mask=mask)

    first = threading.Thread(target=call)
    first.start()
    entered.wait(5)
    run_threads([call])  # arrives while the first holds the gate
    first.join(5)
    (_, _, first_end), (_, second_start, _) = sorted(spans, key=lambda s: s[0] != "first")
    assert second_start >= first_end  # waited for the first call of its class
    assert ("eager", "cpu", True, True) in step._ready
    later.append(True)
    run_threads([call, call], timeout=10)  # the class is known: both share the gate (else the barrier breaks)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_shares_one_graph_per_kind(arch):
    """Every registry architecture: its layers of one kind share one graph (no per-layer attribute in the graph), and
    greedy tokens equal the unpatched model's."""
    torch._dynamo.reset()
    plain, patched = tiny_model(arch, num_hidden_layers=4), hf_accel.patch_model(tiny_model(arch, num_hidden_layers=4),
                                                                                  compile=TRACE)  # fmt: skip
    ids, mask = random_batch(2, [7, 4], seed=6)
    expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **NO_EOS)
    got = patched.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, paged=True, **NO_EOS)
    assert torch.equal(got, expected) and patched.forward.steps == 3
    assert _graphs(patched) == [1] * len(patched.forward.step_codes)


def test_a_draft_models_calls_wait_while_the_target_compiles():
    """A draft model is another model: its eager forward beside the target's compilation would take compile-time
    branches too. Its calls share the target's gate, so they start only after a call holding it alone (as a compiling
    one does) ends; a target drafting for itself is gated by its own forward only (the gate is not re-entrant)."""
    import threading

    from hf_accel.core.gate import model_gate
    from hf_accel.speculative import DraftModel

    target = hf_accel.patch_model(tiny_model("llama"), compile=WHOLE)
    draft = tiny_model("llama", num_hidden_layers=1)
    calls: list[int] = []
    draft.register_forward_pre_hook(lambda module, args: calls.append(1))  # a hook: the draft's own forward runs
    gate = model_gate(target)
    assert gate is target.forward.gate and model_gate(draft) is None
    strategy = DraftModel(draft, num_tokens=3)
    strategy.start(target, 1, False)
    sequence = torch.randint(3, 200, (6,), generator=torch.Generator().manual_seed(0))
    proposals: list = []
    worker = threading.Thread(target=lambda: proposals.append(strategy.propose([sequence], [3])))
    with gate.exclusive():
        worker.start()
        worker.join(0.5)
        assert worker.is_alive() and not calls  # waiting for the gate
    worker.join(10)
    assert calls and proposals[0][0].tokens.shape == (3,)
    strategy.finish()
    itself = DraftModel(target, num_tokens=3)
    itself.start(target, 1, False)
    assert itself._gate is None and itself.propose([sequence], [3])[0].tokens.shape == (3,)
    hf_accel.unpatch_model(target)
    assert model_gate(target) is None
