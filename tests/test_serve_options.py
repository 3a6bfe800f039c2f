"""``hf-accel serve``'s reading of OpenAI request fields: every field honoured, inert or refused with a 400 that
names it (never silently ignored): ``seed``, ``presence_penalty`` / ``frequency_penalty``, ``logit_bias``,
``stream_options.include_usage``, text-part message content, token-id prompts, the vLLM-style extensions."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_serve import WORDS, _http, _want, server  # noqa: F401  (the module's server fixture)
from transformers import LogitsProcessorList

from hf_accel.serve_options import LogitBias, OpenAIPenalties, RequestError, message_text, request_options

openai = pytest.importorskip("openai")


def test_penalties_count_only_generated_tokens_as_openai_defines_them():
    ids = torch.tensor([[3, 3, 5, 5, 5, 6]])  # a prompt of 3 tokens, then 5, 5, 6
    scores = torch.zeros(1, 8)
    out = OpenAIPenalties(prompt_len=3, presence=0.5, frequency=1.0)(ids, scores)
    want = torch.zeros(1, 8)
    want[0, 5] = -(2 * 1.0 + 0.5)  # generated twice (the prompt's 5 does not count)
    want[0, 6] = -(1 * 1.0 + 0.5)
    assert torch.equal(out, want)  # token 3 occurs only in the prompt: untouched
    biased = LogitBias({1: -100.0, 4: 2.5})(ids, scores)
    assert biased[0].tolist() == [0, -100, 0, 0, 2.5, 0, 0, 0] and torch.equal(scores, torch.zeros(1, 8))


def test_request_fields_are_honoured_inert_or_refused_by_name():
    base = {"model": "tiny", "prompt": "the sea"}
    opts = request_options({**base, "seed": 3, "top_k": 5, "min_p": 0.1, "temperature": 0.5, "user": "u1"}, 256)
    assert opts.kwargs == {"max_new_tokens": 256, "do_sample": True, "temperature": 0.5, "top_k": 5, "min_p": 0.1,
                           "seed": 3}  # fmt: skip
    opts = request_options({**base, "presence_penalty": 1, "logit_bias": {"7": -100}, "temperature": 0}, 256)
    processors = opts.kwargs_for(prompt_len=2)["logits_processor"]
    assert [type(p) for p in processors] == [OpenAIPenalties, LogitBias] and processors[0].prompt_len == 2
    assert "logits_processor" not in request_options(base, 256).kwargs_for(2)  # nothing asked: no processors
    refused = [
        ({"response_format": {"type": "json_object"}}, "response_format", "only response_format"),
        ({"frequency_penalty": 2.5}, "frequency_penalty", r"number in \[-2, 2\]"),
        ({"logit_bias": {"300": 1}}, "logit_bias", r"not a token id of this model \(0..255\)"),
        ({"logit_bias": {"7": 101}}, "logit_bias", r"\[-100, 100\]"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only with stream=true"),
        ({"tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"best_of": 3}, "best_of", "not supported"),
        ({"top_p": 0}, "top_p", "must be > 0"),
        ({"top_p": "high"}, "top_p", r"number in \[0, 1\]"),
        ({"seed": 1.5}, "seed", "must be an integer"),
        ({"temperatur": 0.5}, "temperatur", "unrecognized request field 'temperatur'"),
    ]
    for extra, param, message in refused:
        with pytest.raises(RequestError, match=message) as info:
            request_options({**base, **extra}, 256)
        assert info.value.param == param and info.value.status == 400
    accepted = {"best_of": 1, "logprobs": False, "tool_choice": "none", "n": 1, "response_format": {"type": "text"}}
    request_options({**base, **accepted}, 256)


def test_message_content_as_text_parts_is_joined_and_other_parts_refused():
    parts = {"role": "user", "content": [{"type": "text", "text": "the sea"}, {"type": "text", "text": "is blue"}]}
    assert message_text(parts, 0)["content"] == "the sea\nis blue"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(RequestError, match=r"messages\[1\]\.content: only text parts"):
        message_text(image, 1)
    with pytest.raises(RequestError, match=r"messages\[0\] must be an object with a string 'role'"):
        message_text("hello", 0)


def test_a_seed_gives_the_same_sample_alone_or_beside_other_requests(server):  # noqa: F811
    client = server[0]

    def ask(seed: int | None, prompt: str = "the sun is") -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.0, seed=seed)
        return out.choices[0].text

    alone = ask(11)
    with ThreadPoolExecutor(8) as pool:
        crowd = [pool.submit(ask, None, " ".join(WORDS[i : i + 4])) for i in range(6)]
        beside = pool.submit(ask, 11)
        assert beside.result() == alone and all(f.result() for f in crowd)
    assert len({ask(s) for s in (1, 2, 3)} | {alone}) > 1  # the seed is what decides


def test_logit_bias_and_penalties_change_greedy_answers_as_generate_with_them(server):  # noqa: F811
    client, model, tokenizer, _, _ = server
    prompt = "the sun is"
    ids = tokenizer(prompt)["input_ids"]
    sea = tokenizer.convert_tokens_to_ids("sea")

    def ask(**extra) -> str:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, **extra)
        return out.choices[0].text

    assert ask(logit_bias={str(sea): 100}) == " ".join(["sea"] * 10)
    greedy = tokenizer(_want(model, tokenizer, ids, 10))["input_ids"]
    banned = ask(logit_bias={str(greedy[0]): -100})
    assert tokenizer(banned)["input_ids"][0] != greedy[0]
    penalised = ask(frequency_penalty=2.0, presence_penalty=0.5)
    processors = LogitsProcessorList([OpenAIPenalties(len(ids), 0.5, 2.0)])
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=2, pad_token_id=0,
                         logits_processor=processors)  # fmt: skip
    assert penalised == tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert penalised != _want(model, tokenizer, ids, 10)  # the penalty changed this answer


def test_usage_chunk_text_parts_and_token_id_prompts(server):  # noqa: F811
    client, model, tokenizer, _, port = server
    chunks = list(client.completions.create(model="tiny", prompt="the sea", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(tokenizer("the sea")["input_ids"])
    as_text = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "is the sky blue"}])  # fmt: skip
    as_parts = client.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "is the sky blue"}]}])  # fmt: skip
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    ids = tokenizer("the sea is")["input_ids"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0).choices[0].text
    assert by_ids == _want(model, tokenizer, ids, 8)
    code, text = _http(port, "/v1/completions", {"model": "tiny", "prompt": "the sea", "presence_penalty": 9})
    assert code == 400 and json.loads(text)["error"]["param"] == "presence_penalty"


def test_a_request_past_the_models_context_is_refused_and_the_default_length_is_cut_to_it(server):  # noqa: F811
    client, model, _, _, port = server
    context = model.config.max_position_embeddings  # 4096, no rotary scaling
    ids = [7 + i % 20 for i in range(context - 4)]
    for body, param in [({"prompt": ids, "max_tokens": 10}, "max_tokens"), ({"prompt": ids + [7] * 4}, "prompt")]:
        code, text = _http(port, "/v1/completions", {"model": "tiny", **body})
        error = json.loads(text)["error"]
        assert code == 400 and error["param"] == param and error["code"] == "context_length_exceeded", error
    out = client.completions.create(model="tiny", prompt=ids, temperature=0)  # no max_tokens: what fits
    assert out.usage.completion_tokens <= 4 and out.choices[0].finish_reason in ("length", "stop")


def test_the_context_length_is_known_only_without_rotary_scaling():
    from helpers import tiny_config

    from hf_accel.serve_options import context_length

    assert context_length(tiny_config("llama")) == 512
    scaled = tiny_config("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    assert context_length(scaled) is None


def _streamed(tokenizer, ids: list[int], stops: list[str]) -> str:
    from hf_accel.serve import TextTail

    tail = TextTail(tokenizer, stops)
    pieces = [tail.feed([t]) for t in ids]
    return "".join(pieces) + tail.finish()


def test_incremental_text_equals_the_full_decode_on_the_real_tokenizer(default_model):
    """Byte-level BPE (SmolLM2): multi-byte characters split across tokens, special tokens, random ids, stops;
    the streamed pieces join to the full decode cut at the first stop."""
    import random

    tokenizer = default_model[1]
    texts = ["Hello, world! Ça va? 你好，世界 🙂🚀 naïve café", "def f(x):\n    return x ** 2  # ok\n\n\nend"]
    rng = random.Random(0)
    cases = [tokenizer(t)["input_ids"] for t in texts]
    cases += [[rng.randrange(len(tokenizer)) for _ in range(300)] for _ in range(5)]  # arbitrary bytes
    cases.append(tokenizer("<|im_start|>user\nhi<|im_end|>\n")["input_ids"] + cases[0])
    for ids in cases:
        full = tokenizer.decode(ids, skip_special_tokens=True)
        assert _streamed(tokenizer, ids, []) == full
        for stop in (full[len(full) // 2 : len(full) // 2 + 3], "\n\n", "never there"):
            cut = full.find(stop) if stop and stop in full else len(full)
            assert _streamed(tokenizer, ids, [stop]) == full[:cut], (stop, ids[:10])


def test_streaming_detokenization_is_linear_in_the_completion():
    """Each token decodes a window of recent tokens: 4,000 tokens make ~4,000 small decodes, not ~8 million
    decoded tokens (which blocked the server's event loop for seconds on long answers)."""
    from test_serve import _tokenizer

    from hf_accel.serve import TextTail

    tokenizer = _tokenizer()
    decoded = []
    original = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: decoded.append(len(ids)) or original(ids, **kw)
    tail = TextTail(tokenizer, ["never"])
    for i in range(4000):
        tail.feed([7 + i % 20])
    assert sum(decoded) < 4000 * 8, sum(decoded)


def test_n_choices_are_separate_engine_requests_streamed_or_not(server):  # noqa: F811
    client, model, tokenizer, _, port = server
    prompt, ids = "the moon is", tokenizer("the moon is")["input_ids"]
    greedy = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert {c.text for c in greedy.choices} == {_want(model, tokenizer, ids, 8)}
    assert greedy.usage.prompt_tokens == len(ids)  # the prompt once, every choice's tokens
    one = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens

    def sampled(**extra):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "is the sea red"}],
                                              max_tokens=10, temperature=1.0, seed=5, n=3, **extra)  # fmt: skip

    def hits() -> int:
        text = _http(port, "/metrics")[1]
        return int(next(line for line in text.splitlines() if line.startswith("hf_accel_prefix_hit_tokens")).split()[1])

    before = hits()
    client.completions.create(model="tiny", prompt=[7 + i % 20 for i in range(40)], max_tokens=2, temperature=0, n=3)
    assert hits() - before >= 2 * 16  # the twins adopted the first choice's prompt blocks (counted by /metrics)
    whole = [c.message.content for c in sampled().choices]
    assert whole == [c.message.content for c in sampled().choices] and len(set(whole)) > 1  # seed + i per choice
    texts, finishes, roles = ["", "", ""], [None] * 3, set()
    for chunk in sampled(stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
            roles |= {c.index} if c.delta.role == "assistant" else set()
    assert texts == whole and None not in finishes and roles == {0, 1, 2}


def test_a_client_that_disconnects_cancels_every_choice(server):  # noqa: F811
    client, _, _, app, _ = server
    engine = app.state.server.engine
    stream = client.completions.create(model="tiny", prompt="the sky", max_tokens=3000, temperature=0, n=2, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    stream.close()
    rids = [engine._next_id - 2, engine._next_id - 1]
    for _ in range(200):
        if all(engine.result(r).finished for r in rids):
            break
        time.sleep(0.05)
    assert all(engine.result(r).finish_reason == "cancelled" for r in rids)


def test_logprobs_of_completions_and_chat_streamed_or_not(server):  # noqa: F811
    client, model, tokenizer, _, port = server
    ids = tokenizer("the sun is")["input_ids"]
    out = client.completions.create(model="tiny", prompt="the sun is", max_tokens=6, temperature=0, logprobs=2)
    lp, n = out.choices[0].logprobs, out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    sequence = ids + tokenizer.convert_tokens_to_ids([t.strip() for t in lp.tokens])
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([sequence])).logits[0, len(ids) - 1 : -1].float(), -1)
    chosen = want.gather(1, torch.tensor(sequence[len(ids) :])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), chosen, atol=1e-4, rtol=0)
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(v)
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )  # fmt: skip  (greedy: the chosen token is the likeliest)
    messages = [{"role": "user", "content": "is the sun red"}]
    kw = dict(model="tiny", messages=messages, max_tokens=8, temperature=0.9, seed=2, logprobs=True, top_logprobs=3)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(stream=True, **kw) for ch in c.choices
                for e in (ch.logprobs.content if ch.logprobs else [])]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole] and len(whole) > 0
    assert all(len(e.top_logprobs) == 3 and e.bytes == list(e.token.encode()) for e in whole)
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices[0].logprobs is None
    for body, param in [({"messages": messages, "logprobs": "yes"}, "logprobs"),
                        ({"messages": messages, "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": messages, "logprobs": True, "top_logprobs": 21}, "top_logprobs")]:  # fmt: skip
        code, text = _http(port, "/v1/chat/completions", {"model": "tiny", **body})
        assert code == 400 and json.loads(text)["error"]["param"] == param, text


def test_a_request_that_fails_while_generating_gets_a_500_or_an_error_event(server, monkeypatch):  # noqa: F811
    """A failure inside the engine fails that request alone: a 500 body, or (the status line sent) an error event
    in the stream of a request with two choices; the server keeps serving."""
    from hf_accel.engine import engine as engine_module

    client, _, tokenizer, _, port = server
    real, night = engine_module.choose, tokenizer.convert_tokens_to_ids("night")

    def failing(tracked, *args):
        if tracked.output.prompt[-1] == night:  # this prompt's requests only
            raise RuntimeError("boom")
        return real(tracked, *args)

    monkeypatch.setattr(engine_module, "choose", failing)
    code, text = _http(port, "/v1/completions", {"model": "tiny", "prompt": "the day and night", "max_tokens": 4})
    assert code == 500 and "boom" in json.loads(text)["error"]["message"]
    body = {"model": "tiny", "prompt": "the day and night", "max_tokens": 4, "stream": True, "n": 2}
    code, text = _http(port, "/v1/completions", body)
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert code == 200 and events[-1]["error"]["type"] == "server_error" and "boom" in events[-1]["error"]["message"]
    assert client.completions.create(model="tiny", prompt="the sea", max_tokens=3, temperature=0).choices[0].text


def test_echo_puts_the_prompt_and_its_log_probabilities_first(server):  # noqa: F811
    """Completions' ``echo`` (how evaluation harnesses score a text: ``echo=True, logprobs=1, max_tokens=1``): the
    prompt's text, then the completion; each prompt token's log-probability given the ones before (the first: null)."""
    client, model, tokenizer, _, port = server
    prompt, ids = "the sun is blue and", tokenizer("the sun is blue and")["input_ids"]
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0).choices[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == prompt + plain.text and len(lp.tokens) == len(ids) + out.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset == sorted(lp.text_offset)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    chosen = want.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1 : len(ids)]), chosen, atol=1e-4, rtol=0)
    streamed = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                              stream=True))  # fmt: skip
    assert streamed[0].choices[0].text == prompt and "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    no_lp = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert no_lp.choices[0].text == out.choices[0].text and no_lp.choices[0].logprobs is None
    code, text = _http(port, "/v1/chat/completions", {"model": "tiny", "echo": True,
                                                      "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert code == 400 and json.loads(text)["error"]["param"] == "echo"
