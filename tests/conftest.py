"""Fixtures: tiny models per architecture, the real default model, and devices."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ARCHS, greedy_answer, tiny_model

from hf_accel.models import find_default_gguf, load_default

#: CPU, and CUDA marked ``cuda`` (skipped without a device; ``pytest -m cuda`` selects it on a GPU machine)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--diff-cases", type=int, default=150, help="differential tier: random cases to run")
    parser.addoption(
        "--diff-features", default="default,native", help="differential tier: patch_model features to draw from"
    )


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    """Every registry model_type, one test each."""
    return request.param


@pytest.fixture
def tiny(arch: str):
    """A fresh seeded tiny model of ``arch``."""
    return tiny_model(arch)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """CPU, and CUDA (skipped where there is none)."""
    return torch.device(request.param)


@pytest.fixture(scope="session")
def default_model():
    """The real SmolLM2-135M-Instruct ``(model, tokenizer)``, fp32, loaded once per session.

    Tests that use it are marked ``real_model`` (deselect with ``-m 'not real_model'``); CI runs them.
    """
    find_default_gguf()  # a clear DefaultModelNotInstalledError instead of a skip: CI must have it
    return load_default(torch.float32)


@pytest.fixture(scope="session")
def real_model_reference(default_model):
    """What the lossy features' real-model tests compare against, computed once: the unpatched fp32 model's
    perplexity on the first 512 tokens of real English text (``bench.LICENSE``, else Python's licence) and
    its greedy answers to five chat prompts (:data:`REFERENCE_NEW_TOKENS` new tokens each)."""
    import sys
    from pathlib import Path

    from hf_accel.bench import CHAT_PROMPTS, LICENSE

    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    texts = [path for path in (LICENSE, Path(sys.base_prefix) / "lib" / version / "LICENSE.txt") if path.is_file()]
    if not texts:  # Debian's GPL-3, else Python's own licence
        pytest.skip("no English text shipped with the OS or Python was found")
    model, tokenizer = default_model
    ids = tokenizer(texts[0].read_text(), return_tensors="pt")["input_ids"][:, :512]
    prompts = CHAT_PROMPTS[:5]
    with torch.inference_mode():
        perplexity = math.exp(float(model(input_ids=ids, labels=ids).loss))
        answers = [greedy_answer(model, tokenizer, p) for p in prompts]
    return {"ids": ids, "prompts": prompts, "perplexity": perplexity, "answers": answers}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "default_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def pretend_cpu_lacks(monkeypatch):
    """``pretend_cpu_lacks("avx512vnni", ...)``: the kernel layer chooses as on a CPU without those builds (choices
    made before and after the test are forgotten)."""
    from hf_accel.kernels import build, ops

    real = build.cpu_lacks

    def pretend(*isas: str) -> None:
        fake = lambda isa: f"(test) this CPU pretends to lack {isa.upper()}" if isa in isas else real(isa)  # noqa: E731
        monkeypatch.setattr(build, "cpu_lacks", fake)
        ops.reset_choices()

    yield pretend
    ops.reset_choices()
