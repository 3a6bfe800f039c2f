"""Fixtures: tiny models per architecture, the real default model, and devices."""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHS, tiny_model

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
