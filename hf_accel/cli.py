"""The ``hf-accel`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .errors import HFAccelError

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
    sub.add_parser("archs", help="list the supported model types")
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
            from .registry import supported_model_types

            print("\n".join(supported_model_types()))
            return 0
        _positive(parser, "--max-new-tokens", args.max_new_tokens)
        from .demo import run_demo

        run_demo(list(args.prompt or DEMO_PROMPTS), args.max_new_tokens)
        return 0
    except HFAccelError as err:  # user errors: a message, no traceback
        print(f"hf-accel: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
