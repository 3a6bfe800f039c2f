"""Frozen, validated configuration objects: one per feature, composed into :class:`AccelConfig`.

Every dataclass validates itself on construction and names the bad field in its error message.
A feature set to ``None`` in :class:`AccelConfig` is off.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import IncompatibleOptionsError

__all__ = [
    "AccelConfig",
    "CompileConfig",
    "FusedMLPConfig",
    "Int8Config",
    "NativeConfig",
    "PagedConfig",
    "SpeculativeConfig",
    "parse_bytes",
]


def _fail(cls: type, name: str, rule: str, value: Any) -> None:
    raise IncompatibleOptionsError(f"{cls.__name__}.{name} {rule}, got {value!r}")


def _check_int(obj: Any, name: str, *, minimum: int, optional: bool = False) -> None:
    value = getattr(obj, name)
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        rule = f"must be an int >= {minimum}" + (" or None" if optional else "")
        _fail(type(obj), name, rule, value)


def _check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        _fail(type(obj), name, f"must be one of {', '.join(map(repr, choices))}", value)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(value: Any, what: str) -> int | None:
    """A memory size: ``None``, an int of bytes (>= 1), or a string such as ``"512MiB"``, ``"1.5GB"``, ``"2 GiB"``
    (kB/MB/GB/TB: powers of 1000; KiB/MiB/GiB/TiB: powers of 1024).

    Raises:
        IncompatibleOptionsError: anything else (floats, bools, negative sizes, unknown units), naming ``what``.
    """
    if value is None:
        return None
    rule = f"{what} must be None, an int of bytes >= 1 or a string such as '512MiB' or '2GB', got {value!r}"
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise IncompatibleOptionsError(rule)
        value = int(float(match.group(1)) * _UNITS[unit])
    elif isinstance(value, bool) or not isinstance(value, int):
        raise IncompatibleOptionsError(rule)
    if value < 1:
        raise IncompatibleOptionsError(rule)
    return value


def _check_bool(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, bool):
        _fail(type(obj), name, "must be a bool", value)


@dataclass(frozen=True)
class PagedConfig:
    """Paged KV cache options.

    Args:
        block_size: tokens per KV block.
        num_blocks: blocks in the pool; ``None`` sizes the pool from ``max_memory``.
        max_memory: bytes the pool may reserve: an int or a string such as ``"1GiB"`` (:func:`parse_bytes`; stored
            as an int); ``None`` picks a budget from free memory.
        prefix_cache: keep full prompt blocks across ``generate`` calls and reuse matching prefixes.
        attention: decode-path attention: ``"auto"`` (native kernel on CPU when it builds; on CUDA the Triton kernel,
            or without Triton, like other accelerators, the batched portable implementation; else ``"gather"``),
            ``"kernel"`` (error when none of these applies), ``"batched"`` (the portable implementation, on any
            device), ``"flex"`` (PyTorch's FlexAttention over the pool, compiled by Inductor: CUDA / XPU only) or
            ``"gather"`` (gather each row's context, then SDPA, row by row).
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | str | None = None
    prefix_cache: bool = False
    attention: str = "auto"

    ATTENTION_MODES: ClassVar[tuple[str, ...]] = ("auto", "kernel", "batched", "flex", "gather")

    def __post_init__(self) -> None:
        _check_int(self, "block_size", minimum=1)
        _check_int(self, "num_blocks", minimum=1, optional=True)
        object.__setattr__(self, "max_memory", parse_bytes(self.max_memory, "PagedConfig.max_memory"))
        _check_bool(self, "prefix_cache")
        _check_choice(self, "attention", self.ATTENTION_MODES)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative generation options.

    Args:
        strategy: ``"prompt_lookup"``, ``"draft"`` or ``"self"``.
        num_tokens: initial number of draft tokens proposed per step; ``None``: the strategy's default
            (10 for prompt lookup, 5 for a draft model, 6 for self-speculation).
        adaptive: grow/shrink the number of draft tokens per sequence from acceptance; ``None``: the strategy's
            default (off for prompt lookup, on for model drafts).
        max_ngram: longest n-gram matched by prompt lookup.
        auto: a strategy (``"self"`` or ``"prompt_lookup"``) that plain greedy ``generate`` calls use without a
            keyword: calls with ``do_sample=False``, one beam, input ids and no per-step outputs (scores, logits,
            attentions, hidden states); any other call decodes as usual. ``None``: only the keywords speculate. The
            default patch sets ``"self"`` on the CPU for the Llama family (``hf_accel.patch.default_config``).
    """

    strategy: str = "prompt_lookup"
    num_tokens: int | None = None
    adaptive: bool | None = None
    max_ngram: int = 3
    auto: str | None = None

    STRATEGIES: ClassVar[tuple[str, ...]] = ("prompt_lookup", "draft", "self")
    AUTO: ClassVar[tuple[str | None, ...]] = (None, "self", "prompt_lookup")

    def __post_init__(self) -> None:
        _check_choice(self, "strategy", self.STRATEGIES)
        _check_choice(self, "auto", self.AUTO)
        _check_int(self, "num_tokens", minimum=1, optional=True)
        _check_int(self, "max_ngram", minimum=1)
        if self.adaptive is not None:
            _check_bool(self, "adaptive")


@dataclass(frozen=True)
class FusedMLPConfig:
    """Fused gated-MLP options.

    Args:
        eager: run the fused MLP without ``torch.compile`` even when compilation is on.
    """

    eager: bool = False

    def __post_init__(self) -> None:
        _check_bool(self, "eager")


@dataclass(frozen=True)
class CompileConfig:
    """Compilation options: weight pre-packing and ``torch.compile`` (arguments mirror ``torch.compile``).

    Args:
        prepack: on CPU, hold every decoder linear (and the LM head) pre-packed in oneDNN's layout, as
            Inductor's freezing does, but per module and also for eager code (the largest win on CPU).
        mlp: ``torch.compile`` the fused MLPs for decode steps (``[B, 1, H]`` inputs; prefill and
            multi-token chunks stay eager). ``None``: on for accelerators, off on CPU, where the compiled call
            costs more than it saves once the weights are packed (decode 1.40x vs 1.62x of plain generate,
            measured in docs/compile.md).
        decode_step: compile the whole decode step where the cache allows it: over hf_accel's paged cache
            (``generate(paged=True)``; the model's ``forward`` is bound per instance and runs compiled for
            ``[B, 1]`` steps and chunks of up to 16 tokens that want every logit, such as speculative
            verification; eager otherwise), and, for a ``generate`` call with a static cache
            (``cache_implementation="static"``), by letting Transformers compile its step, on CPU too.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"`` or ``"max-autotune-no-cudagraphs"``.
        dynamic: ``True``: compile shape-generic graphs; ``False``: PyTorch's default (static first, then
            automatically dynamic for a dimension that changes).
        fullgraph: fail on graph breaks instead of splitting the graph.
        backend: ``torch.compile`` backend: ``"inductor"`` (generates kernels), ``"aot_eager"`` or ``"eager"``
            (trace only: quick, for tests).
        cuda_graphs: capture the paged decode step in CUDA graphs: each step is padded to bucketed shapes (batch
            and block-table width to powers of two, :mod:`hf_accel.compile.buckets`) and compiled with
            ``mode="reduce-overhead"`` (unless ``mode`` names another graph mode). ``None``: on for a model on CUDA
            with the inductor backend, off elsewhere. ``True`` elsewhere pads to the same buckets without graphs
            (the shapes the CUDA path runs, testable on the CPU).
        regional: compile the paged decode step by region: the model's ``forward`` runs eagerly (embedding, final
            norm, LM head) and its decoder layers through one compiled graph per kind of layer
            (:mod:`hf_accel.compile.regional`), so the first call compiles one layer instead of all of them (SmolLM2
            on a 2-core CPU: 17 s instead of 60-84 s with an empty Inductor cache), at a cost in decode speed (0.80x
            of the whole step there: each layer's compiled call has its own guards and wrappers). For short-lived
            processes and notebooks. No CUDA graphs (they capture the whole step): ``True`` with
            ``cuda_graphs=True`` is an error, and with ``cuda_graphs=None`` CUDA runs without graphs.
    """

    prepack: bool = True
    mlp: bool | None = None
    decode_step: bool = True
    mode: str = "default"
    dynamic: bool = False
    fullgraph: bool = False
    backend: str = "inductor"
    cuda_graphs: bool | None = None
    regional: bool = False

    MODES: ClassVar[tuple[str, ...]] = (
        "default",
        "reduce-overhead",
        "max-autotune",
        "max-autotune-no-cudagraphs",
    )
    BACKENDS: ClassVar[tuple[str, ...]] = ("inductor", "aot_eager", "eager")

    def __post_init__(self) -> None:
        _check_choice(self, "mode", self.MODES)
        _check_choice(self, "backend", self.BACKENDS)
        for name in ("prepack", "decode_step", "dynamic", "fullgraph", "regional"):
            _check_bool(self, name)
        for name in ("mlp", "cuda_graphs"):
            if getattr(self, name) is not None:
                _check_bool(self, name)
        if self.regional and self.cuda_graphs:
            _fail(type(self), "regional", "cannot be combined with cuda_graphs=True (CUDA graphs capture the whole "
                  "step; pass regional=False, or cuda_graphs=False to compile by region)", self.regional)  # fmt: skip
        if self.mode != "default" and self.backend != "inductor":
            _fail(type(self), "mode", f"needs backend='inductor' (backend is {self.backend!r})", self.mode)

    def compile_kwargs(self, graphs: bool = False) -> dict[str, Any]:
        """Keyword arguments for ``torch.compile`` (``graphs``: for a step captured in CUDA graphs)."""
        kwargs: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph}
        kwargs["dynamic"] = True if self.dynamic else None
        if self.backend == "inductor":
            kwargs["mode"] = "reduce-overhead" if graphs and self.mode == "default" else self.mode
        return kwargs

    def step_graphs(self, device_type: str) -> bool:
        """Whether the paged decode step on a device of this type pads to buckets (:attr:`cuda_graphs`, resolved)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return device_type == "cuda" and self.backend == "inductor" and not self.regional


@dataclass(frozen=True)
class Int8Config:
    """Weight-only int8 options (lossy: never enabled by default).

    Args:
        backend: ``"auto"`` (native on CPU and CUDA; on other devices optimum-quanto when installed; else
            native), ``"native"`` (hf_accel kernels), ``"bitsandbytes"`` (``Linear8bitLt``; needs ``pip install
            "hf_accel[bnb]"``) or ``"quanto"`` (optimum-quanto's ``QLinear`` with qint8 weights, per output row;
            needs ``pip install optimum-quanto``).
        group_size: quantize per group of this many input features; ``None`` = one scale per output row.
        skip_modules: glob patterns of module names left in float.
        keep_original: keep the float weights so ``unpatch_model`` restores them exactly.
        threshold: outlier threshold of the bitsandbytes backend (LLM.int8(): input features with larger
            magnitudes stay in float); 0 turns the decomposition off.
        activations: ``"float"`` (weight-only: activations stay float) or ``"int8"`` (native backend: W8A8,
            activations quantized per token in 16 interleaved feature groups on every call, integer dot products
            (AVX-512 VNNI, else AVX2); faster at batch > 1, slightly lossier, and its greedy output is sensitive to
            float-level differences such as the attention implementation; needs ``group_size=None``).
    """

    backend: str = "auto"
    group_size: int | None = None
    skip_modules: tuple[str, ...] = ()
    keep_original: bool = False
    threshold: float = 6.0
    activations: str = "float"

    BACKENDS: ClassVar[tuple[str, ...]] = ("auto", "native", "bitsandbytes", "quanto")
    ACTIVATIONS: ClassVar[tuple[str, ...]] = ("float", "int8")
    #: the name ``from_pretrained(quantization_config=Int8Config(...))`` dispatches on, once
    #: ``hf_accel.register_quantizer()`` has registered hf_accel's quantizer with Transformers
    quant_method: ClassVar[str] = "hf_accel_int8"

    def __post_init__(self) -> None:
        _check_choice(self, "backend", self.BACKENDS)
        _check_choice(self, "activations", self.ACTIVATIONS)
        if self.activations == "int8" and self.backend == "bitsandbytes":
            rule = "must be 'float' with backend='bitsandbytes' (it has its own outlier decomposition: threshold)"
            _fail(type(self), "activations", rule, self.activations)
        if self.activations == "int8" and self.group_size is not None:
            _fail(type(self), "group_size", "must be None with activations='int8' (row scales)", self.group_size)
        _check_int(self, "group_size", minimum=1, optional=True)
        _check_bool(self, "keep_original")
        if isinstance(self.skip_modules, str) or not all(isinstance(p, str) for p in self.skip_modules):
            _fail(type(self), "skip_modules", "must be a tuple of glob strings", self.skip_modules)
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            _fail(type(self), "threshold", "must be a number >= 0", self.threshold)
        if self.backend in ("bitsandbytes", "quanto") and self.group_size is not None:
            rule = f"must be None with backend={self.backend!r} (row scales only)"
            _fail(type(self), "group_size", rule, self.group_size)
        if self.activations == "int8" and self.backend == "quanto":
            _fail(type(self), "activations", "must be 'float' with backend='quanto' (weight-only)", self.activations)

    def to_dict(self) -> dict[str, Any]:
        """The options as a JSON-able dict with ``quant_method`` (what Transformers writes to config.json)."""
        out = dataclasses.asdict(self)
        out["skip_modules"] = list(self.skip_modules)
        return {"quant_method": self.quant_method, **out}


@dataclass(frozen=True)
class NativeConfig:
    """The native executor (``hf_accel.native``): every decoder layer of a step in one native call.

    Plain ``generate`` calls over Transformers' dynamic cache run their prompt and decode steps through it; so do a
    speculative target's verification chunks (they already did where the executor applies, with or without this
    feature). Opt-in: its logits equal the model's own forward up to float32 summation order (greedy outputs are
    tested equal at Transformers' default initializer range too, but a float tie could in principle flip).

    Args:
        prompts: run prompts through the executor too (wide chunks use PyTorch's fused attention inside the native
            call); ``False``: prompts run the model's own forward, decode steps the executor.
        half_precision: a bfloat16 / float16 model (or one cast to half precision later) runs through the executor
            with float32 activations, reading its weights in place (docs/native.md); its own forward rounds after every
            operator, so greedy tokens can part from it at near-ties. ``native=True`` asks for it; the default patch of
            a float32 model sets ``False`` (a later cast hands the forward back to the model).
        exact_codes: float32 weights that are exactly a de-quantized low-bit checkpoint's values (GGUF Q4_1 / Q8_0 /
            Q4_0 / Q5_0, e.g. the default SmolLM2 model) run decode steps and verification chunks from those codes:
            the same float32 weights bit for bit, 4-6x fewer bytes per step (docs/native.md). Costs the codes' memory
            (~a fifth of the float weights) and, at patching, ~1.5 s per 100M parameters to find them.
    """

    prompts: bool = True
    half_precision: bool = True
    exact_codes: bool = True

    def __post_init__(self) -> None:
        _check_bool(self, "prompts")
        _check_bool(self, "half_precision")
        _check_bool(self, "exact_codes")


#: feature name -> config class; the order is the order in which features are applied.
FEATURE_CONFIGS: dict[str, type] = {
    "int8": Int8Config,
    "fused_mlp": FusedMLPConfig,
    "paged": PagedConfig,
    "speculative": SpeculativeConfig,
    "compile": CompileConfig,
    "native": NativeConfig,
}


@dataclass(frozen=True)
class AccelConfig:
    """All hf_accel features of one patch. A field set to ``None`` turns that feature off.

    Args:
        paged: paged KV cache.
        speculative: speculative generation.
        fused_mlp: fused gated MLPs.
        compile: ``torch.compile`` of the fused MLPs / decode step.
        int8: weight-only int8 (lossy).
        native: the native executor for plain decoding (opt-in).
    """

    paged: PagedConfig | None = None
    speculative: SpeculativeConfig | None = None
    fused_mlp: FusedMLPConfig | None = None
    compile: CompileConfig | None = None
    int8: Int8Config | None = None
    native: NativeConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in FEATURE_CONFIGS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise IncompatibleOptionsError(
                    f"AccelConfig.{name} must be a {cls.__name__} or None, got {type(value).__name__}"
                )

    def enabled(self) -> list[str]:
        """Names of the features that are on, in application order."""
        return [name for name in FEATURE_CONFIGS if getattr(self, name) is not None]

    def with_overrides(self, **overrides: Any) -> AccelConfig:
        """Return a copy with feature switches replaced.

        Args:
            **overrides: feature name -> ``True`` (default config), ``False``/``None`` (off) or a config object.

        Raises:
            IncompatibleOptionsError: unknown feature name or a value of the wrong type.
        """
        changes: dict[str, Any] = {}
        for name, value in overrides.items():
            cls = FEATURE_CONFIGS.get(name)
            if cls is None:
                raise IncompatibleOptionsError(
                    f"unknown hf_accel feature {name!r}; known features: {', '.join(FEATURE_CONFIGS)}"
                )
            if value is True:
                value = cls()
            elif value is False:
                value = None
            elif value is not None and not isinstance(value, cls):
                raise IncompatibleOptionsError(
                    f"feature {name!r} takes a bool or a {cls.__name__}, got {type(value).__name__}"
                )
            changes[name] = value
        return dataclasses.replace(self, **changes)
