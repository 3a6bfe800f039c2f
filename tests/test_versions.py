"""The version floor: pyproject's ranges, the check every entry point makes, and its error."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from packaging.version import Version

import hf_accel
from hf_accel.core.versions import MINIMUM, require_supported_versions, unsupported_versions


def test_floors_name_each_old_package_and_why():
    old = unsupported_versions({"transformers": "5.17.0", "torch": "2.6.0+cu124"})
    assert old == [
        "transformers 5.17.0 (needs >= 5.24.0: its models take the KV cache as `cache=` from 5.24 on)",
        "torch 2.6.0+cu124 (needs >= 2.9.0: compiled steps and bitwise-equal paths need it; the suite fails on 2.6)",
    ]


@pytest.mark.parametrize(
    "versions",
    [
        {"transformers": "5.24.0", "torch": "2.9.0"},  # the floors themselves
        {"transformers": "5.25.0.dev0", "torch": "2.11.0+cu130"},  # a dev build and a local tag: release part only
        {"transformers": "6.0.0", "torch": "3.0.0a0"},
        {"transformers": "not-a-version", "torch": None},  # an unparsable local build; torch absent (never here)
    ],
)
def test_supported_or_unreadable_versions_pass(versions):
    assert unsupported_versions(versions) == []


def test_pyproject_declares_the_same_floors():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    for dist, (floor, _) in MINIMUM.items():
        declared = re.search(rf'^    "{dist}>=([0-9.]+)[,"]', text, re.MULTILINE)
        assert declared is not None and Version(declared[1]) == Version(floor), dist


def test_this_environment_passes():
    require_supported_versions()


def test_patch_model_refuses_an_old_transformers_and_leaves_the_model_alone(monkeypatch):
    model = tiny_model("llama")
    before = {name: p.clone() for name, p in model.named_parameters()}
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "5.17.0" if d == "transformers" else real(d))
    with pytest.raises(hf_accel.UnsupportedVersionError) as err:
        hf_accel.patch_model(model)
    assert str(err.value) == (
        "hf_accel does not run on transformers 5.17.0 (needs >= 5.24.0: its models take the KV cache as `cache=` "
        "from 5.24 on). Upgrade with: pip install --upgrade 'transformers>=5.24.0'"
    )
    assert isinstance(err.value, ImportError) and isinstance(err.value, hf_accel.HFAccelError)
    assert not hf_accel.is_patched(model) and "generate" not in vars(model)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    monkeypatch.setattr(importlib.metadata, "version", real)
    assert hf_accel.is_patched(hf_accel.patch_model(model))  # the same model patches once the versions are right
