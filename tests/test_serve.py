"""``hf-accel serve`` on loopback, driven by the ``openai`` Python client: completions and chat completions,
streaming and not, 16 concurrent requests, a disconnect that cancels its request, 4xx JSON errors, models, health
and metrics; every answer compared with ``generate`` (issue 33, item 3)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import tiny_model

import hf_accel
from hf_accel.serve import TextTail, create_app

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

WORDS = [
    "the",
    "a",
    "sun",
    "moon",
    "sea",
    "sky",
    "is",
    "was",
    "blue",
    "red",
    "big",
    "small",
    "and",
    "or",
    "not",
    "very",
    "cold",
    "warm",
    "day",
    "night",
]
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }} </s>{% endfor %}<s>assistant:"


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "user:": 4, "assistant:": 5, "system:": 6}
    vocab.update({w: i + 7 for i, w in enumerate(WORDS)})
    vocab.update({f"w{i}": i for i in range(len(vocab), 256)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def server():
    tokenizer = _tokenizer()
    model = hf_accel.patch_model(tiny_model("llama", max_position_embeddings=4096))
    app = create_app(model, tokenizer, name="tiny")
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    port = srv.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    yield client, model, tokenizer, app, port
    srv.should_exit = True
    thread.join(30)


def _http(port: int, path: str, body: dict | None = None) -> tuple[int, str]:
    """A plain HTTP call (status, body text) without the openai client's own checks."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _want(model, tokenizer, ids: list[int], max_new: int) -> str:
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=2, pad_token_id=0)
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)


def test_completions_and_chat_equal_generate_streaming_or_not(server):
    client, model, tokenizer, _, _ = server
    prompt = "the sun is blue and the sea"
    want = _want(model, tokenizer, tokenizer(prompt)["input_ids"], 12)
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want and got.usage.completion_tokens <= 12
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True))  # fmt: skip
    assert streamed == want
    messages = [{"role": "user", "content": "is the sky blue"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = _want(model, tokenizer, ids, 10)
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_sixteen_concurrent_requests_are_batched_and_each_equals_generate(server):
    client, model, tokenizer, app, _ = server
    prompts = [" ".join(WORDS[i % 7 : i % 7 + 3 + i % 5]) for i in range(16)]
    steps_before = app.state.server.engine.steps

    def ask(p: str) -> str:
        return client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    for p, a in zip(prompts, answers, strict=True):
        assert a == _want(model, tokenizer, tokenizer(p)["input_ids"], 16), p
    # batched: far fewer engine steps than 16 requests x 16 tokens run one by one
    assert app.state.server.engine.steps - steps_before < 16 * 16 / 2


def test_a_client_that_disconnects_cancels_its_request(server):
    client, _, _, app, _ = server
    engine = app.state.server.engine
    stream = client.completions.create(model="tiny", prompt="the sea", max_tokens=3000, temperature=0, stream=True)
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()
    rid = engine._next_id - 1
    for _ in range(200):
        if engine.result(rid).finished:
            break
        time.sleep(0.05)
    out = engine.result(rid)
    assert out.finish_reason == hf_accel.engine.FinishReason.CANCELLED and len(out.tokens) < 3000


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
        ({"model": "other", "prompt": "the sea"}, 404, "model"),
        ({"model": "tiny", "prompt": "the sea", "n": 17}, 400, "n"),
        ({"model": "tiny", "prompt": "the sea", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "the sea", "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "prompt": "the sea", "logprobs": 21}, 400, "logprobs"),
        ({"model": "tiny", "prompt": "the sea", "echo": "yes"}, 400, "echo"),
        ({"model": "tiny", "prompt": "the sea", "stop": [3]}, 400, "stop"),
        ({"model": "tiny", "prompt": ["the sea", "the sky"]}, 400, "prompt"),  # one prompt per request
    ],
)
def test_bad_requests_get_openai_style_json_errors(server, body, status, param):
    _, _, _, _, port = server
    code, text = _http(port, "/v1/completions", body)
    assert code == status
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_models_health_and_metrics(server):
    client, _, _, _, port = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert json.loads(_http(port, "/health")[1]) == {"status": "ok"}
    metrics = _http(port, "/metrics")[1]
    assert 'hf_accel_requests_total{status="completed"}' in metrics and "hf_accel_kv_blocks_total" in metrics


def test_text_tail_holds_back_stop_string_prefixes_and_cuts_at_the_stop():
    tok = _tokenizer()
    ids = tok("the sun is blue and the sea")["input_ids"]
    tail = TextTail(tok, ["blue and"])
    pieces = [tail.feed([i]) for i in ids]
    pieces.append(tail.finish())
    assert "".join(pieces) == "the sun is "


def test_chat_errors_and_a_body_that_is_not_json(server):
    _, _, _, _, port = server
    code, text = _http(port, "/v1/chat/completions", {"model": "tiny"})
    assert code == 400 and json.loads(text)["error"]["param"] == "messages"
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", b"{not json", {})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 400 and "not valid JSON" in info.value.read().decode()


def test_the_cli_has_a_serve_command(capsys):
    from hf_accel.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--port" in capsys.readouterr().out
