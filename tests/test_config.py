"""Tier (a): config validation, exact messages."""

import dataclasses

import pytest

from hf_accel import (
    AccelConfig,
    CompileConfig,
    FusedMLPConfig,
    IncompatibleOptionsError,
    Int8Config,
    NativeConfig,
    PagedConfig,
    SpeculativeConfig,
)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: PagedConfig(block_size=0), "PagedConfig.block_size must be an int >= 1, got 0"),
        (lambda: PagedConfig(block_size=True), "PagedConfig.block_size must be an int >= 1, got True"),
        (lambda: PagedConfig(num_blocks=-1), "PagedConfig.num_blocks must be an int >= 1 or None, got -1"),
        (lambda: PagedConfig(prefix_cache=1), "PagedConfig.prefix_cache must be a bool, got 1"),
        (
            lambda: PagedConfig(attention="flash"),
            "PagedConfig.attention must be one of 'auto', 'kernel', 'batched', 'flex', 'gather', got 'flash'",
        ),
        (
            lambda: SpeculativeConfig(strategy="magic"),
            "SpeculativeConfig.strategy must be one of 'prompt_lookup', 'draft', 'self', got 'magic'",
        ),
        (lambda: SpeculativeConfig(num_tokens=0), "SpeculativeConfig.num_tokens must be an int >= 1 or None, got 0"),
        (
            lambda: CompileConfig(mode="fast"),
            "CompileConfig.mode must be one of 'default', 'reduce-overhead', "
            "'max-autotune', 'max-autotune-no-cudagraphs', got 'fast'",
        ),
        (lambda: FusedMLPConfig(eager="yes"), "FusedMLPConfig.eager must be a bool, got 'yes'"),
        (lambda: NativeConfig(prompts="no"), "NativeConfig.prompts must be a bool, got 'no'"),
        (lambda: Int8Config(group_size=0), "Int8Config.group_size must be an int >= 1 or None, got 0"),
        (
            lambda: Int8Config(skip_modules="lm_head"),
            "Int8Config.skip_modules must be a tuple of glob strings, got 'lm_head'",
        ),
        (lambda: Int8Config(threshold=-1.0), "Int8Config.threshold must be a number >= 0, got -1.0"),
        (lambda: AccelConfig(paged=True), "AccelConfig.paged must be a PagedConfig or None, got bool"),
    ],
)
def test_invalid_fields_name_the_field(make, message):
    with pytest.raises(IncompatibleOptionsError) as info:
        make()
    assert str(info.value) == message


def test_configs_are_frozen():
    cfg = PagedConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32  # type: ignore[misc]


def test_overrides():
    base = AccelConfig(fused_mlp=FusedMLPConfig())
    assert base.enabled() == ["fused_mlp"]
    cfg = base.with_overrides(fused_mlp=False, paged=PagedConfig(block_size=8), int8=True)
    assert cfg.fused_mlp is None
    assert cfg.paged == PagedConfig(block_size=8)
    assert cfg.int8 == Int8Config()
    assert cfg.enabled() == ["int8", "paged"]
    assert base.enabled() == ["fused_mlp"]  # the original is untouched


def test_override_errors():
    with pytest.raises(IncompatibleOptionsError) as info:
        AccelConfig().with_overrides(pagd=True)
    assert str(info.value) == (
        "unknown hf_accel feature 'pagd'; known features: int8, fused_mlp, paged, speculative, compile, native"
    )
    with pytest.raises(IncompatibleOptionsError) as info:
        AccelConfig().with_overrides(paged=Int8Config())
    assert str(info.value) == "feature 'paged' takes a bool or a PagedConfig, got Int8Config"
