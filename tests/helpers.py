"""Shared test helpers: seeded tiny models per architecture and a reporting ``assert_close``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PreTrainedModel

from hf_accel.core.config import SpeculativeConfig
from hf_accel.core.registry import ARCHITECTURES, supported_model_types

#: every registered architecture with mixtures of experts (tests/test_moe.py runs each through every feature) that
#: this Transformers knows (the newest ones came in 5.25)
MOE_ARCHS = [mt for mt in supported_model_types() if ARCHITECTURES[mt].experts is not None and mt in CONFIG_MAPPING]
#: the MoE architectures the whole per-architecture matrix also runs: plain experts; dense first layers and shared
#: experts; a router whose linear is read directly (Qwen2-MoE's gated shared expert: tests/test_moe.py)
MOE_MATRIX = ["mixtral", "glm4_moe", "hunyuan_v1_moe"]
#: the architectures the per-architecture tests run: every dense one and ``MOE_MATRIX``
ARCHS = [mt for mt in supported_model_types() if mt not in MOE_ARCHS or mt in MOE_MATRIX]
VOCAB = 256
PAD, BOS, EOS = 0, 1, 2

_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    # a wide init keeps logits well separated, so greedy choices are not decided by float noise
    initializer_range=0.2,
)


#: 4 experts of 64 (W8A8 takes multiples of 64), 2 per token, whatever the architecture calls the counts
_MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)

#: per-architecture settings that make two layers show what the architecture does
_TINY_ARCH = {
    **dict.fromkeys(MOE_ARCHS, _MOE),  # glm4_moe's, ernie4_5_moe's and exaone_moe's layer 0 stays dense
    # layers alternate sliding (a window shorter than the tests' contexts) and full, each with attention sinks
    "gpt_oss": dict(
        _MOE,
        sliding_window=6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
    # a dense layer 0 and a MoE layer 1; sliding and full attention; Laguna's query heads differ per layer
    "laguna": dict(_MOE, mlp_layer_types=["dense", "sparse"], num_attention_heads_per_layer=[4, 8], sliding_window=6),
    "mellum": dict(_MOE, mlp_layer_types=["dense", "sparse"], sliding_window=6),
    "granitemoe_swa": dict(_MOE, sliding_window=6, shared_intermediate_size=64),
    "granitemoeshared": dict(_MOE, shared_intermediate_size=64),  # the shared MLP beside the experts
    "smollm3": dict(no_rope_layer_interval=2),  # layer 1 is a NoPE layer (the default puts one in every 4th)
    # queries scaled by position from position 8 on (Llama 4's attention scaling; from 16,384 by default)
    "ministral3": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1e6,
            "factor": 2.0,
            "original_max_position_embeddings": 8,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale_all_dim": 1.0,
            "mscale": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    ),
}


#: architectures whose default layers would all be sliding at two layers: theirs alternate sliding and full here
#: (cohere2's and exaone4's full layers have no rotary embedding)
_ALTERNATING = ("ministral", "olmo3", "cohere2", "exaone4", "laguna", "mellum")


def tiny_config(model_type: str, **overrides):
    """A 2-layer, 64-wide config of ``model_type`` (GQA: 4 query heads, 2 KV heads)."""
    settings = {**_TINY, **_TINY_ARCH.get(model_type, {}), **overrides}
    if model_type in _ALTERNATING and "layer_types" not in settings:
        kinds = ("sliding_attention", "full_attention")
        settings["layer_types"] = [kinds[i % 2] for i in range(settings["num_hidden_layers"])]
    return AutoConfig.for_model(model_type, **settings)


def tiny_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A seeded random tiny ``*ForCausalLM`` of ``model_type`` in eval mode."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    return model.eval()


def sink_logits(heads: int) -> torch.Tensor:
    """Attention-sink logits ``[heads]`` (GPT-OSS's ``s_aux``) from well below to well above the test scores, so some
    heads' sinks take most of the softmax and others almost none."""
    return torch.linspace(-3.0, 6.0, heads)


def random_batch(batch: int, lengths: list[int] | None = None, seed: int = 0, max_len: int = 12):
    """Left-padded ``input_ids`` / ``attention_mask`` of random tokens with the given (or random) lengths."""
    gen = torch.Generator().manual_seed(seed)
    if lengths is None:
        lengths = torch.randint(3, max_len + 1, (batch,), generator=gen).tolist()
    width = max(lengths)
    ids = torch.full((batch, width), PAD, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


@torch.no_grad()
def logits_of(model, ids, mask=None) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask).logits


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, name: str = "") -> None:
    """Like ``torch.testing.assert_close`` but the message names the worst element and both values."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    a, e = actual.double(), expected.double()
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = err > bound
    if bad.any():
        excess = err - bound
        idx = tuple(int(i) for i in torch.unravel_index(excess.argmax(), excess.shape))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{err.numel()} elements out of tolerance (atol={atol}, rtol={rtol}); "
            f"worst at {idx}: actual={a[idx].item():.8g} expected={e[idx].item():.8g} "
            f"abs err={err[idx].item():.3g}; max abs err overall={err.max().item():.3g}"
        )


def chat_batch(tokenizer, prompts: list[str]):
    """Chat-formatted, left-padded ``input_ids`` / ``attention_mask`` of user ``prompts`` (real-model tests)."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    tokenizer.padding_side = "left"
    return tokenizer(texts, return_tensors="pt", padding=True)


def cpu_build(isa: str | None = None):
    """The raw CPU extension module of build ``isa`` (``None``: the widest this CPU runs), or ``None`` where the CPU
    lacks it: for tests that hold one build's functions to their references."""
    from hf_accel.kernels.build import cpu_isas, extension

    isas = cpu_isas()
    if isa is None:
        isa = isas[0] if isas else None
    return extension(isa) if isa in isas else None


def build_or_skip(isa: str):
    """The raw CPU extension module of build ``isa`` (``"widest"``: the widest this CPU runs) for a kernel test
    parametrised over builds; skips the test where the CPU lacks that build."""
    import pytest

    module = cpu_build(None if isa == "widest" else isa)
    if module is None:
        pytest.skip(f"no {isa} build on this CPU")
    return module


#: ``patch_model`` keywords that keep greedy calls decoding one token per step (the default patch speculates them
#: automatically on the CPU for the Llama family): for tests that count or inspect plain decoding steps
NO_AUTO_SPECULATION = {"speculative": SpeculativeConfig()}


def run_threads(work: list[Callable[[], None]], timeout: float = 240) -> None:
    """Run each job of ``work`` in its own thread and join them all; the first job's exception is re-raised here,
    and a thread still running after ``timeout`` seconds fails the test."""
    errors: list[BaseException] = []

    def guarded(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(job,)) for job in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


def generate_in_threads(model: PreTrainedModel, batches: list, repeats: int = 1, **kwargs) -> list[torch.Tensor]:
    """``model.generate(input_ids=, attention_mask=, **kwargs)`` for each ``(ids, mask)`` of ``batches``, each batch in
    its own thread, all at once (``repeats`` calls per thread): each batch's last output, in order."""
    got: list = [None] * len(batches)

    def job(k: int) -> None:
        ids, mask = batches[k]
        for _ in range(repeats):
            got[k] = model.generate(input_ids=ids, attention_mask=mask, **kwargs)

    run_threads([lambda k=k: job(k) for k in range(len(batches))])
    return got


def gguf_like(weight: torch.Tensor, kind: str = "q4_1") -> torch.Tensor:
    """``weight`` [N, K] (K % 32 == 0) quantized and de-quantized as a GGUF file's blocks of 32 hold it, with the
    gguf package's float32 arithmetic: ``"q4_1"`` (``fl(fl(d * q) + m)``, q in [0, 15], d and m float16), ``"q8_0"``
    (``fl(d * q)``, q in [-127, 127]), ``"q4_0"`` (``fl(d * (q - 8))``, d = max / -8), or the K-quants ``"q4_k"`` /
    ``"q5_k"`` (:func:`k_quant_like`)."""
    if kind in ("q4_k", "q5_k"):
        return k_quant_like(weight, 15 if kind == "q4_k" else 31)
    g = weight.detach().float().reshape(-1, 32)
    if kind == "q4_1":
        lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
        d, m = ((hi - lo) / 15).half().float(), lo.half().float()
        q = torch.where(d > 0, (g - lo) / d, torch.zeros_like(g)).round().clamp(0, 15)
        return ((d * q) + m).view_as(weight)
    if kind == "q8_0":
        d = (g.abs().amax(1, keepdim=True) / 127).half().float()
        q = torch.where(d > 0, g / d, torch.zeros_like(g)).round().clamp(-127, 127)
        return (d * q).view_as(weight)
    top = g.gather(1, g.abs().argmax(1, keepdim=True))  # q4_0: the signed value of largest magnitude maps to -8
    d = (top / -8).half().float()
    q = torch.where(d != 0, g / d + 8, torch.full_like(g, 8)).round().clamp(0, 15)
    return (d * (q - 8)).view_as(weight)


def k_quant_like(weight: torch.Tensor, levels: int) -> torch.Tensor:
    """``weight`` [N, K] as GGUF's Q4_K (``levels=15``) / Q5_K (31) de-quantize it: per group of 32,
    ``fl(fl(d1 * q) - m1)`` with ``d1 = fl(d * sc)``, ``m1 = fl(dmin * m)``, float16 ``d`` / ``dmin`` per row (a
    super-block's, in the file) and 6-bit ``sc`` / ``m``. The rounded 6-bit scales leave some groups without code 0
    or the top code, as a K-quant's fitted scales do."""
    g = weight.detach().float().reshape(weight.shape[0], -1, 32)  # [N, G, 32]
    lo, hi = g.amin(2, keepdim=True).clamp(max=0), g.amax(2, keepdim=True)
    d = (((hi - lo) / levels).amax(1, keepdim=True) / 63).half().float()  # [N, 1, 1]
    dmin = ((-lo).amax(1, keepdim=True) / 63).half().float()
    sc = torch.where(d > 0, (hi - lo) / levels / d, 0).round().clamp(1, 63)  # [N, G, 1]
    m = torch.where(dmin > 0, -lo / dmin, 0).round().clamp(0, 63)
    d1, m1 = d * sc, dmin * m
    q = torch.where(d1 > 0, (g + m1) / d1, 0).round().clamp(0, levels)
    return ((d1 * q) - m1).view_as(weight)


@torch.no_grad()
def as_gguf(model: PreTrainedModel, linears: str = "q4_1") -> PreTrainedModel:
    """``model`` (in place) with every linear weight as a de-quantized ``linears`` GGUF tensor and the embedding (the
    tied head) as Q8_0: what Transformers' ``gguf_file=`` loading (or the default model) gives."""
    for name, param in model.named_parameters():
        if param.dim() == 2:
            param.copy_(gguf_like(param, "q8_0" if "embed" in name or "lm_head" in name else linears))
    return model


#: new tokens of each greedy answer in the lossy features' real-model agreement tests
REFERENCE_NEW_TOKENS = 48


def greedy_answer(model, tokenizer, prompt: str) -> torch.Tensor:
    """``model``'s greedy answer to one chat prompt (prompt + :data:`REFERENCE_NEW_TOKENS` new tokens)."""
    return model.generate(**chat_batch(tokenizer, [prompt]), max_new_tokens=REFERENCE_NEW_TOKENS, do_sample=False)


def identical_prefixes(reference: list[torch.Tensor], got: list[torch.Tensor]) -> list[int]:
    """Per answer, how many tokens (prompt included) are identical before the first divergence."""
    return [
        int((a[0, : b.shape[1]] == b[0, : a.shape[1]]).int().cumprod(0).sum())
        for a, b in zip(reference, got, strict=True)
    ]


def router_linears(model: PreTrainedModel) -> list[torch.nn.Linear]:
    """The ``nn.Linear`` modules inside a MoE model's routers (HunYuan's ``mlp.gate.wg``): every feature leaves them
    as they are (the router's scores pick the experts)."""
    spec = ARCHITECTURES[model.config.model_type]
    if spec.experts is None:
        return []
    found = []
    for layer in model.model.layers:
        router = getattr(getattr(layer, spec.mlp), spec.router, None)
        if router is not None:
            found += [m for m in router.modules() if type(m) is torch.nn.Linear]
    return found
