"""The kernels alone. Paged decode attention: the reference's per-row loop, the portable whole-batch implementation
and (on CUDA) the Triton kernel and FlexAttention over the pool, on one batch of mixed context lengths. Weight-only
int8 linear at decode sizes: the float matmul of the same shape, the portable de-quantize form and (on CUDA) the
Triton W8A16 kernel. A mixture of experts' experts (Qwen3-30B-A3B's: 128 experts, hidden 2048, 768 per expert, 8 per
token) for one token and for ``--batch`` tokens: Transformers' experts module in the model dtype (its default
``grouped_mm`` implementation) against hf_accel's ``Int8Experts`` (on CUDA the Triton experts kernel). Prints
milliseconds per call (median of 20 after a warm-up).

    python benchmarks/gpu/kernels_micro.py --device cuda --dtype bfloat16 --batch 32 --max-context 2048
    python benchmarks/gpu/kernels_micro.py --device cpu   # docs/log/2026-12-06-cuda-cpu-side.md
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from hf_accel.kernels import flex_paged, portable, reference, triton_int8, triton_paged


def case(args: argparse.Namespace) -> tuple[torch.Tensor, ...]:
    """Rows with random contexts in [16, max_context], each owning consecutive blocks; one decode query per row."""
    torch.manual_seed(0)
    rng = random.Random(0)
    lengths = [rng.randint(16, args.max_context) for _ in range(args.batch)]
    width = max((n + args.block - 1) // args.block for n in lengths)
    dtype = getattr(torch, args.dtype)
    pools = torch.randn(2, args.batch * width + 1, args.block, args.kv_heads, args.head_dim, dtype=dtype)
    tables = torch.arange(args.batch * width, dtype=torch.int32).view(args.batch, width)
    q_pos = torch.tensor([[n - 1] for n in lengths], dtype=torch.int32)
    query = torch.randn(args.batch, args.heads, 1, args.head_dim, dtype=dtype)
    return tuple(t.to(args.device) for t in (query, pools[0], pools[1], tables, q_pos))


def timed_ms(call, device: str) -> float | str:
    """Median milliseconds of ``call`` (its error, as text, when it fails: the other rows still run)."""
    try:
        return _timed_ms(call, device)
    except Exception as err:
        return f"failed: {type(err).__name__}: {err}"[:200]


def _timed_ms(call, device: str) -> float:
    call()
    times = []
    for _ in range(20):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def int8_rows(args: argparse.Namespace) -> None:
    """Decode-sized int8 linears of the model's shapes (q/o, up, down), against the float matmul."""
    dtype, cuda = getattr(torch, args.dtype), args.device.startswith("cuda")
    hidden, inter = args.heads * args.head_dim, args.intermediate
    for n, k in ((hidden, hidden), (inter, hidden), (hidden, inter)):
        x = torch.randn(args.rows, k, dtype=dtype, device=args.device)
        weight = torch.randn(n, k, dtype=dtype, device=args.device)
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=args.device)
        s = torch.rand(n, 1, device=args.device) / 100
        rows = {"float F.linear": lambda x=x, w=weight: torch.nn.functional.linear(x, w),
                "portable (de-quantize + matmul)": lambda x=x, q=q, s=s: portable.int8_linear(x, q, s)}  # fmt: skip
        if cuda and triton_int8.load()[0] is not None:
            rows["triton W8A16"] = lambda x=x, q=q, s=s: triton_int8.int8_linear(x, q, s)
        for name, call in rows.items():
            print(f"int8 linear {args.rows}x{k} -> {n}, {name}: {_ms(timed_ms(call, args.device))}")


def experts_rows(args: argparse.Namespace) -> None:
    """One MoE layer's experts at decode sizes: float (Transformers) against int8 (hf_accel)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from hf_accel.quant.experts import Int8Experts

    dtype = getattr(torch, args.dtype)
    config = Qwen3MoeConfig(hidden_size=args.experts_hidden, moe_intermediate_size=768, num_experts=128,
                            num_experts_per_tok=8)  # fmt: skip
    config._experts_implementation = "grouped_mm"  # what a model loaded by from_pretrained runs by default
    torch.manual_seed(0)
    experts = Qwen3MoeExperts(config).to(args.device, dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    int8 = Int8Experts.from_module(experts)
    print(f"experts: int8 via {int8.choices['down_proj'].impl}")
    for tokens in (1, args.batch):
        hidden = torch.randn(tokens, config.hidden_size, dtype=dtype, device=args.device)
        index = torch.rand(tokens, 128, device=args.device).topk(8, dim=-1).indices  # [T, 8]
        weights = torch.full((tokens, 8), 1 / 8, dtype=dtype, device=args.device)
        for name, module in (("float (Transformers grouped_mm)", experts), ("int8 (Int8Experts)", int8)):
            ms = timed_ms(lambda m=module, h=hidden, i=index, w=weights: m(h, i, w), args.device)
            print(f"experts {tokens} tokens x 8 of 128, {name}: {_ms(ms)}")


def _ms(value: float | str) -> str:
    return f"{value:.3f} ms" if isinstance(value, float) else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=2048, help="int8 rows: the MLP width")
    parser.add_argument("--rows", type=int, default=1, help="int8 rows: activation rows (decode batch)")
    parser.add_argument("--experts-hidden", type=int, default=2048, help="experts rows: the hidden size")
    args = parser.parse_args()
    tensors = case(args)
    paths = {"reference (per-row loop)": reference.paged_attention, "portable (whole batch)": portable.paged_attention}
    if args.device.startswith("cuda") and triton_paged.load()[0] is not None:
        paths["triton (one launch)"] = triton_paged.paged_attention
    scale = args.head_dim**-0.5
    for name, fn in paths.items():
        ms = timed_ms(lambda fn=fn: fn(*tensors, scale, 0, 0.0), args.device)
        print(f"paged attention, {name}: {_ms(ms)}")
    int8_rows(args)
    experts_rows(args)
    flex_rows(args, tensors, scale)  # last: each compiles (tens of seconds), so a timeout loses only these


def flex_rows(args: argparse.Namespace, tensors: tuple[torch.Tensor, ...], scale: float) -> None:
    """FlexAttention over the pool, compiled with dynamic shapes (what ``attention="flex"`` runs) and with static
    shapes (Inductor's flex-decoding kernel, where grouped heads share K/V reads, needs a static batch: would
    per-bucket compiles pay?)."""
    if flex_paged.why_not(torch.device(args.device)) is not None:
        return
    static = flex_paged.make_paged_attention(flex_paged.compile_flex(dynamic=False))
    for name, fn in (("dynamic shapes", flex_paged.paged_attention), ("static shapes", static)):
        ms = timed_ms(lambda fn=fn: fn(*tensors, scale, 0, 0.0), args.device)
        print(f"paged attention, FlexAttention (compiled, {name}): {_ms(ms)}")


if __name__ == "__main__":
    main()
