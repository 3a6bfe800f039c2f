"""The ``hf-accel`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from .core.errors import HFAccelError

__all__ = ["main"]

DEMO_PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-accel", description="Fast inference for Hugging Face causal LMs.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="answer chat prompts with the default model, unpatched vs patched")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    demo.add_argument("--prompt", action="append", help="a chat prompt (repeatable; default: two built-in ones)")
    demo.add_argument("--repeats", type=int, default=3, help="timed, interleaved runs per configuration (default 3)")
    sub.add_parser("archs", help="list the supported model types")
    bench = sub.add_parser("bench", help="technique-comparison table on your model (speed, memory, quality)")
    bench.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    bench.add_argument(
        "--techniques",
        default="baseline,default,fused,paged,int8,prompt-lookup,self-spec",
        help="comma-separated: baseline, default (what patch_model(model) runs here), fused, paged, compile, native, "
        "int8, w8a8, bnb, quanto, prompt-lookup, draft, self-spec, self-spec+native, all",
    )
    bench.add_argument("--batch", default="1,8", help="comma-separated batch sizes (default 1,8)")
    bench.add_argument("--prompts", default="chat", help='chat, grounded, or a .jsonl file of {"prompt": ...}')
    bench.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is shown")
    bench.add_argument("--draft-model", help="local folder of a draft model (the 'draft' technique)")
    bench.add_argument("--json", help="also write the results as JSON to this path")
    bench.add_argument("--markdown", help="also write the table as Markdown to this path")
    bench.add_argument("--plot", help="also write a PNG chart (speed-up and KV memory per technique)")
    bench.add_argument("--profile", help="profile the baseline first; write a Chrome trace to this path")
    bench.add_argument("--no-progress", action="store_true", help="no progress bars")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching) over your model")
    serve.add_argument("--model", default="default", help="local model folder, or 'default' (SmolLM2-135M)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--name", help="the model id clients send (default: the model's folder name)")
    serve.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    for flag in ("native", "int8", "compile"):
        serve.add_argument(f"--{flag}", action="store_true", help=f"patch with {flag}=True too")
    return parser


def _positive(parser: argparse.ArgumentParser, name: str, value: int) -> None:
    if value < 1:
        parser.error(f"{name} must be >= 1, got {value}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hf-accel`` console script. Returns the process exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if args.command == "archs":
            from .core.registry import supported_model_types

            print("\n".join(supported_model_types()))
            return 0
        if args.command == "serve":
            return _serve(args)
        _positive(parser, "--max-new-tokens", args.max_new_tokens)
        if args.command == "bench":
            return _bench(parser, args)
        from .demo import run_demo

        _positive(parser, "--repeats", args.repeats)
        run_demo(list(args.prompt or DEMO_PROMPTS), args.max_new_tokens, args.repeats)
        return 0
    except HFAccelError as err:  # user errors: a message, no traceback
        print(f"hf-accel: error: {err}", file=sys.stderr)
        return 2


def _serve(args: argparse.Namespace) -> int:
    import torch

    from .models import load_model
    from .patch import patch_model
    from .serve import serve

    model, tokenizer = load_model(args.model, getattr(torch, args.dtype))
    patch_model(model, **{f: True for f in ("native", "int8", "compile") if getattr(args, f)})
    name = args.name or ("SmolLM2-135M-Instruct" if args.model == "default" else args.model.rstrip("/").split("/")[-1])
    serve(model, tokenizer, args.host, args.port, name)
    return 0


def _batches(parser: argparse.ArgumentParser, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--batch takes comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"--batch sizes must be >= 1, got {text!r}")
    return values


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json

    import torch

    from . import bench
    from .models import load_model

    _positive(parser, "--repeats", args.repeats)
    batches = _batches(parser, args.batch)
    techniques, notes = bench.parse_techniques(args.techniques, has_draft=args.draft_model is not None)
    outputs = {name: bench.check_writable(getattr(args, name), f"--{name}") for name in ("json", "markdown", "plot")}
    trace = bench.check_writable(args.profile, "--profile")
    if args.prompts not in ("chat", "grounded") and not Path(args.prompts).is_file():  # before the model loads
        parser.error(f"--prompts takes chat, grounded or a .jsonl file; {args.prompts!r} is neither")
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, dtype)
    draft = load_model(args.draft_model, dtype)[0] if args.draft_model else None
    if args.profile:
        print(bench.profile(model, tokenizer, trace))
        print(f"Chrome trace: {trace}\n")
    results = bench.run_bench(
        model, tokenizer, techniques, batches, args.prompts, args.max_new_tokens, args.repeats, draft,
        progress=not args.no_progress,
    )  # fmt: skip
    table = bench.markdown_table(results)
    setup = f"{args.max_new_tokens} new tokens, median of {args.repeats}, {torch.get_num_threads()} threads"
    headline = f"model: {args.model} ({model.config.model_type}, {args.dtype}); prompts: {args.prompts}; {setup}"
    print(f"\n{headline}")
    print(table)
    for note in notes:
        print(note)
    if outputs["json"]:
        outputs["json"].write_text(json.dumps([r.as_dict() for r in results], indent=2))
    if outputs["markdown"]:
        outputs["markdown"].write_text(table)
    if outputs["plot"]:
        bench.plot(results, outputs["plot"], headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
