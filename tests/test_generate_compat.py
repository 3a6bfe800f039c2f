"""A patched model keeps every generate habit: GenerationConfig, streamers, stopping criteria, pipelines."""

import pytest
import torch
from helpers import random_batch, tiny_model
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

import hf_accel
from hf_accel import IncompatibleOptionsError
from hf_accel.core.call import GenerateKwarg


class _Collect:
    """A minimal streamer: records every chunk ``generate`` puts."""

    def __init__(self):
        self.chunks = []
        self.ended = False

    def put(self, value):
        self.chunks.append(value.clone())

    def end(self):
        self.ended = True


class _StopAfter(StoppingCriteria):
    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


@pytest.fixture
def pair():
    return tiny_model("llama"), hf_accel.patch_model(tiny_model("llama"))


def test_generation_config_and_return_dict(pair):
    plain, patched = pair
    ids, mask = random_batch(2, [5, 8])
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
    a = plain.generate(
        input_ids=ids, attention_mask=mask, generation_config=gc, return_dict_in_generate=True, output_scores=True
    )
    b = patched.generate(
        input_ids=ids, attention_mask=mask, generation_config=gc, return_dict_in_generate=True, output_scores=True
    )
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) == 6


def test_streamer_sees_the_same_tokens(pair):
    plain, patched = pair
    ids, _ = random_batch(1, [7])
    s1, s2 = _Collect(), _Collect()
    plain.generate(input_ids=ids, max_new_tokens=5, do_sample=False, streamer=s1)
    patched.generate(input_ids=ids, max_new_tokens=5, do_sample=False, streamer=s2)
    assert s2.ended and len(s1.chunks) == 6  # the prompt, then one chunk per token
    # the default patch speculates greedy calls on the CPU: accepted tokens arrive together, as with Transformers'
    # assisted generation (prompt first, then 1-D chunks of one or more tokens)
    assert torch.equal(s2.chunks[0], s1.chunks[0]) and all(c.dim() == 1 for c in s2.chunks[1:])
    assert torch.equal(torch.cat(s2.chunks[1:]), torch.cat(s1.chunks[1:]))


def test_stopping_criteria_and_sampling(pair):
    plain, patched = pair
    ids, _ = random_batch(1, [4])
    stop = StoppingCriteriaList([_StopAfter(7)])
    out = patched.generate(input_ids=ids, max_new_tokens=20, do_sample=False, stopping_criteria=stop)
    assert out.shape[1] == 7
    torch.manual_seed(5)
    a = plain.generate(input_ids=ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8)
    torch.manual_seed(5)
    b = patched.generate(input_ids=ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.8)
    assert torch.equal(a, b)


def test_typo_gets_transformers_own_error(pair):
    plain, patched = pair
    ids, _ = random_batch(1, [4])
    with pytest.raises(ValueError) as plain_err:
        plain.generate(input_ids=ids, max_new_tokens=2, max_new_tokenz=3)
    with pytest.raises(ValueError) as patched_err:
        patched.generate(input_ids=ids, max_new_tokens=2, max_new_tokenz=3)
    assert str(patched_err.value) == str(plain_err.value)
    assert "max_new_tokenz" in str(patched_err.value)


def test_plugin_kwarg_of_a_feature_switched_off_is_a_clear_error():
    patched = hf_accel.patch_model(tiny_model("llama"), speculative=False)
    ids, _ = random_batch(1, [4])
    with pytest.raises(IncompatibleOptionsError) as info:
        patched.generate(input_ids=ids, max_new_tokens=2, prompt_lookup=True)
    assert str(info.value) == (
        "generate(prompt_lookup=...) needs hf_accel's 'speculative' feature, which is off for this model; "
        "patch it with hf_accel.patch_model(model, speculative=True)"
    )


def test_plugin_kwargs_are_translated_and_the_rest_passes_through(pair):
    _, patched = pair
    ids, _ = random_batch(1, [4])
    seen = {}

    def apply(model, value, call):
        seen["value"] = value
        seen["kwargs"] = dict(call.kwargs)
        call.kwargs["max_new_tokens"] = value  # a handler rewrites Transformers' kwargs

    state = patched.__dict__["_hf_accel_state"]
    state.generate_kwargs["demo_tokens"] = GenerateKwarg("demo_tokens", "test", apply)
    out = patched.generate(input_ids=ids, max_new_tokens=2, do_sample=False, demo_tokens=5)
    assert seen["value"] == 5
    assert seen["kwargs"]["max_new_tokens"] == 2 and "demo_tokens" not in seen["kwargs"]
    assert out.shape[1] == 4 + 5
    assert hf_accel.patch_report(patched)["generate_kwargs"] == [
        "demo_tokens",
        "draft_model",
        "num_speculative_tokens",
        "paged",
        "prompt_lookup",
        "speculative",
    ]


def test_pipeline_text_generation_on_a_patched_model(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, pipeline

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    plain = tiny_model("llama")
    patched = hf_accel.patch_model(tiny_model("llama"))
    prompt = "w5 w17 w99 w3"
    kwargs = dict(max_new_tokens=6, do_sample=False)
    expected = pipeline("text-generation", model=plain, tokenizer=tokenizer)(prompt, **kwargs)
    got = pipeline("text-generation", model=patched, tokenizer=tokenizer)(prompt, **kwargs)
    assert got == expected
    assert got[0]["generated_text"].startswith(prompt)
