"""The default patch (issue 33, item 5): on the CPU, for the models the native executor serves, ``patch_model(model)``
runs the executor and speculates greedy calls with an int8 copy of the model automatically; the output stays the
unpatched model's. Calls speculation cannot reproduce exactly, or does not support, decode as usual and say why."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import generate_in_threads, random_batch, tiny_model
from transformers import LogitsProcessorList

import hf_accel
from hf_accel.core.errors import IncompatibleOptionsError, UnsupportedModelError
from hf_accel.core.metrics import TimingStreamer
from hf_accel.patch import default_config
from hf_accel.speculative import auto

LEAN = ["llama", "mistral", "qwen2", "qwen3", "smollm3", "exaone"]
KW = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)


def _model(arch: str = "llama", init: float = 0.2):
    overrides = {"initializer_range": init} | ({"sliding_window": None} if arch == "mistral" else {})
    return tiny_model(arch, **overrides)


def test_default_config_depends_on_the_model_and_device():
    assert default_config().native is None and default_config().speculative.auto is None
    cpu = default_config(_model("qwen3"))
    assert cpu.native == hf_accel.NativeConfig(half_precision=False) and cpu.speculative.auto == "self"
    other = default_config(tiny_model("gemma"))  # not an executor architecture: the keyword-only default
    assert other.native is None and other.speculative.auto is None and other.fused_mlp is not None
    report = hf_accel.patch_report(hf_accel.patch_model(tiny_model("gemma")))
    assert (
        "native executor + automatic self-speculation" in report["implementations"]["default"]["configuration"]["not"]
    )
    with pytest.raises(IncompatibleOptionsError, match=r"SpeculativeConfig\.auto must be one of"):
        hf_accel.SpeculativeConfig(auto="draft")
    with pytest.raises(UnsupportedModelError):
        hf_accel.patch_model(None)


@pytest.mark.parametrize("init", [0.2, 0.02])
@pytest.mark.parametrize("lengths", [[9], [3, 14, 7]])
@pytest.mark.parametrize("arch", LEAN)
def test_greedy_calls_speculate_and_equal_the_unpatched_model(arch, lengths, init):
    plain, patched = _model(arch, init), hf_accel.patch_model(_model(arch, init))
    ids, mask = random_batch(len(lengths), lengths, seed=len(lengths))
    for paged in (False, True):
        got = patched.generate(input_ids=ids, attention_mask=mask, paged=paged, **KW)
        assert torch.equal(got, plain.generate(input_ids=ids, attention_mask=mask, **KW)), paged
        stats = hf_accel.last_stats(patched)
        assert stats.speculative["strategy"] == "self" and stats.speculation_skipped is None


def _skipped(patched, paged=None, **kwargs):
    plain = _model()
    ids, mask = kwargs.pop("ids", None), kwargs.pop("mask", None)
    if ids is None:
        ids, mask = random_batch(2, [5, 8], seed=3)
    torch.manual_seed(7)
    expected = plain.generate(input_ids=ids, attention_mask=mask, **{**KW, **kwargs})
    torch.manual_seed(7)
    got = patched.generate(input_ids=ids, attention_mask=mask, paged=paged, **{**KW, **kwargs})
    stats = hf_accel.last_stats(patched)
    same = (
        torch.equal(got, expected) if isinstance(got, torch.Tensor) else torch.equal(got.sequences, expected.sequences)
    )
    assert same and stats.speculative is None
    return stats.speculation_skipped


def test_calls_speculation_cannot_reproduce_decode_as_usual_and_say_why():
    patched = hf_accel.patch_model(_model())
    assert "sampling" in _skipped(patched, do_sample=True, top_k=20)  # seeded sampling: the unpatched tokens
    assert "beam search" in _skipped(patched, num_beams=2)
    assert "output_scores" in _skipped(patched, output_scores=True, return_dict_in_generate=True)
    right = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    ids = random_batch(2, [6, 6], seed=4)[0]
    assert "left-padded" in _skipped(patched, ids=ids, mask=right)
    holed = ids.clone()
    holed[0, 2] = 0  # the pad token inside a row, no mask: Transformers infers a hole there (pad is not an end token)
    assert "left-padded" in _skipped(patched, ids=holed, mask=None)
    prefixed = hf_accel.PagedConfig(prefix_cache=True)
    assert "prefix caching" in _skipped(patched, paged=prefixed)
    # a caller's processor may keep state across calls: speculation would call it at every drafted position
    ids, mask = random_batch(2, [5, 8], seed=3)
    runs = []
    for model in (_model(), patched):
        calls = []

        def counting(ids, scores, calls=calls):  # a function of how often it was called: bans 7 from the 4th call
            calls.append(1)
            return scores.index_fill(-1, torch.tensor([7]), -float("inf")) if len(calls) > 3 else scores

        processors = LogitsProcessorList([counting])
        runs.append(model.generate(input_ids=ids, attention_mask=mask, logits_processor=processors, **KW))
    assert torch.equal(runs[0], runs[1]) and hf_accel.last_stats(patched).speculative is None
    assert "logits processor of the caller's" in hf_accel.last_stats(patched).speculation_skipped
    # a static cache set on the model's generation config (as for Transformers' compile): plain decoding as asked;
    # cache_implementation=None in the call lifts it, and the call speculates again
    static = _model()
    static.generation_config.cache_implementation = "static"
    patched_static = hf_accel.patch_model(static)
    plain_static = _model()
    plain_static.generation_config.cache_implementation = "static"
    expected = plain_static.generate(input_ids=ids, attention_mask=mask, **KW)
    assert torch.equal(patched_static.generate(input_ids=ids, attention_mask=mask, **KW), expected)
    assert hf_accel.last_stats(patched_static).speculation_skipped == "a cache chosen by the caller"
    lifted = patched_static.generate(input_ids=ids, attention_mask=mask, cache_implementation=None, **KW)
    assert torch.equal(lifted, expected) and hf_accel.last_stats(patched_static).speculative is not None
    # classifier-free guidance: its processor runs the model once per token, in order (also under paged=True)
    for paged in (None, True):
        assert "classifier-free guidance (guidance_scale=1.5)" in _skipped(patched, paged=paged, guidance_scale=1.5)


def test_the_draft_is_announced_once_and_memory_is_checked_first(monkeypatch, caplog):
    patched = hf_accel.patch_model(_model())
    monkeypatch.setattr(auto, "_available_bytes", lambda: 1 << 10)
    reason = _skipped(patched)
    assert reason.startswith("the int8 draft's build needs ~") and reason.endswith(" MiB free, 0 MiB available")
    monkeypatch.undo()
    ids, mask = random_batch(2, [5, 8], seed=3)
    with caplog.at_level(logging.WARNING, logger="hf_accel"):
        for _ in range(3):
            patched.generate(input_ids=ids, attention_mask=mask, **KW)
    announced = [r for r in caplog.records if "speculate with an int8 copy" in r.getMessage()]
    assert len(announced) == 1 and "SpeculativeConfig(auto=None)" in announced[0].getMessage()


@pytest.mark.parametrize(
    ("overrides", "native", "auto_strategy"),
    [
        ({"speculative": hf_accel.SpeculativeConfig()}, True, None),
        ({"native": False}, False, "self"),
        ({"int8": True}, True, None),
        ({"compile": hf_accel.CompileConfig(backend="eager")}, False, None),
        ({"compile": True, "native": True}, True, None),
    ],
    ids=["speculative", "no-native", "int8", "compile", "compile+native"],
)
def test_overrides_adjust_the_default(overrides, native, auto_strategy):
    report = hf_accel.patch_report(hf_accel.patch_model(_model(), **overrides))
    assert ("native" in report["features"]) == native
    assert report["features"]["speculative"]["auto"] == auto_strategy


def test_concurrent_default_calls_share_one_draft_and_equal_the_unpatched_model():
    plain, patched = _model(), hf_accel.patch_model(_model())
    batches = [random_batch(2, [4 + i, 9], seed=i) for i in range(4)]
    expected = [plain.generate(input_ids=ids, attention_mask=mask, **KW) for ids, mask in batches]
    got = generate_in_threads(patched, batches, repeats=3, **KW)
    assert all(torch.equal(got[i], expected[i]) for i in range(4))


def test_timing_streamer_counts_every_token_of_a_speculative_step():
    patched = hf_accel.patch_model(_model())
    ids = random_batch(1, [6], seed=2)[0]
    streamer = TimingStreamer()
    out = patched.generate(input_ids=ids, streamer=streamer, **KW)
    timing = streamer.timing()
    assert timing.new_tokens == out.shape[1] - ids.shape[1] == 12
    assert timing.first_tokens >= 1 and len(streamer.stamps) - 1 < 12  # tokens arrived several at a time


@pytest.mark.parametrize("keyword", [{}, {"prompt_lookup": True}])
def test_speculation_after_a_cast_leaves_the_executor_and_stays_exact(keyword):
    """A speculative target verified through the executor's step read before ``model.to(bfloat16)``: it now asks
    the native feature for the step of the weights as they are (none for bfloat16: the model's own forward)."""
    plain = _model().to(torch.bfloat16)
    patched = hf_accel.patch_model(_model())
    patched.to(torch.bfloat16)
    ids, mask = random_batch(2, [4, 7], seed=9)
    got = patched.generate(input_ids=ids, attention_mask=mask, **keyword, **KW)
    assert torch.equal(got, plain.generate(input_ids=ids, attention_mask=mask, **KW))


def test_beam_search_from_the_generation_config_is_not_speculated():
    """A model whose generation_config asks for beams: plain generate beam-searches, so no automatic speculation."""
    plain, patched = _model(), hf_accel.patch_model(_model())
    for m in (plain, patched):
        m.generation_config.num_beams = 2
    ids, mask = random_batch(2, [5, 8], seed=3)
    got = patched.generate(input_ids=ids, attention_mask=mask, **KW)
    assert torch.equal(got, plain.generate(input_ids=ids, attention_mask=mask, **KW))
    assert "beam search" in hf_accel.last_stats(patched).speculation_skipped


def test_the_draft_follows_the_targets_weights(caplog):
    """The automatic int8 draft is built once and reused while the target's parameters stay as they were; after
    ``resize_token_embeddings`` or ``load_state_dict`` it is built again (a copy of the old weights crashed on token
    ids past its vocabulary), and the output stays the unpatched model's."""
    plain, patched = _model(), hf_accel.patch_model(_model())
    ids, mask = random_batch(2, [5, 8], seed=3)

    def builds(call) -> int:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_accel.speculative"):
            call()
        return len([r for r in caplog.records if "built a self-speculative draft" in r.getMessage()])

    assert builds(lambda: [patched.generate(input_ids=ids, attention_mask=mask, **KW) for _ in range(3)]) == 1
    for model in (plain, patched):
        torch.manual_seed(0)
        model.resize_token_embeddings(300)
        with torch.no_grad():  # new tokens the model picks, so the draft sees ids past its old vocabulary
            model.get_input_embeddings().weight[256:].normal_(0, 2.0)
            model.get_output_embeddings().weight[256:].normal_(0, 2.0)
    plain.load_state_dict(patched.state_dict())
    expected = plain.generate(input_ids=ids, attention_mask=mask, **KW)
    assert int(expected.max()) >= 256
    got = []
    assert builds(lambda: got.append(patched.generate(input_ids=ids, attention_mask=mask, **KW))) == 1
    assert torch.equal(got[0], expected) and hf_accel.last_stats(patched).speculative is not None
    state = {k: v * 1.1 if v.is_floating_point() else v for k, v in plain.state_dict().items()}
    plain.load_state_dict(state)
    patched.load_state_dict(state)
    assert builds(lambda: got.append(patched.generate(input_ids=ids, attention_mask=mask, **KW))) == 1
    assert torch.equal(got[1], plain.generate(input_ids=ids, attention_mask=mask, **KW))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_on_a_half_model_runs_through_the_executor(dtype, tmp_path):
    """int8 weights already part from a half model's rounding, and the executor runs them 2.7x faster than int8
    alone (SmolLM2 bf16): ``int8=`` on a half CPU model, or a model loaded quantized, gets the executor."""
    from transformers import AutoModelForCausalLM

    ids, mask = random_batch(2, [4, 7], seed=5)
    model = hf_accel.patch_model(tiny_model("qwen3", dtype=dtype), int8=True)
    report = hf_accel.patch_report(model)
    assert "native" in report["features"] and report["features"]["speculative"]["auto"] is None
    assert report["implementations"]["native"]["decoder_layers"]["uses"].startswith("cpu/")
    assert "int8 weights on a half-precision model" in str(report["implementations"]["default"])
    explicit = hf_accel.patch_model(tiny_model("qwen3", dtype=dtype), int8=True, native=True)
    got, want = (m.generate(ids, attention_mask=mask, **KW) for m in (model, explicit))
    assert torch.equal(got, want)
    hf_accel.unpatch_model(model)
    assert "forward" not in model.__dict__
    tiny_model("llama").save_pretrained(tmp_path)
    hf_accel.register_quantizer()
    try:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype, quantization_config=hf_accel.Int8Config())
    finally:
        hf_accel.unregister_quantizer()
    assert "native" in hf_accel.patch_report(hf_accel.patch_model(loaded.eval()))["features"]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("gemma2", {"int8": True}),  # not an executor architecture
        ("qwen3", {"int8": True, "native": False}),
        ("qwen3", {"int8": True, "compile": hf_accel.CompileConfig(backend="eager")}),  # packed weights
        ("qwen3", {}),  # lossless default of a half model: keyword-only
    ],
    ids=["gemma2", "native-off", "compile", "no-int8"],
)
def test_int8_on_a_half_model_keeps_its_forward_where_the_executor_takes_no_part(arch, overrides):
    report = hf_accel.patch_report(hf_accel.patch_model(tiny_model(arch, dtype=torch.bfloat16), **overrides))
    assert "native" not in report["features"]
