"""Tier (c): hf_accel on models dispatched by accelerate and sharded by Transformers' tensor parallelism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import dispatch_model
from helpers import random_batch, tiny_model

import hf_accel
from hf_accel.core.dispatch import execution_device, tp_style, transfer_hook
from hf_accel.core.errors import IncompatibleOptionsError
from hf_accel.quant.core import quantize
from hf_accel.speculative import SelfSpeculative

WORKER = Path(__file__).parent / "workers" / "tp_worker.py"
OFFLOAD_ARCHS = ["llama", "gemma2", "phi3", "qwen3"]


def offloaded(arch: str, tmp_path: Path):
    """A tiny model with layer 0 on the CPU and layer 1 offloaded to disk (weights on meta, loaded per call)."""
    model = tiny_model(arch)
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        "lm_head": "cpu",
    }
    return dispatch_model(model, device_map=device_map, offload_dir=str(tmp_path))


@pytest.mark.parametrize("arch", OFFLOAD_ARCHS)
def test_disk_offload_greedy_equals_undispatched_patched_model(arch, tmp_path, caplog):
    reference = hf_accel.patch_model(tiny_model(arch))
    model = offloaded(arch, tmp_path)
    with torch.no_grad():
        before = model(torch.tensor([[5, 6, 7]])).logits
    hf_accel.patch_model(model)
    changes = hf_accel.patch_report(model)["changes"]["fused_mlp"]
    assert changes["MLP left unfused (weights offloaded by accelerate)"] == 1
    assert "layer 1's MLP weights are offloaded by accelerate; left unfused" in caplog.text
    assert type(model.model.layers[0].mlp).__name__ == "FusedGatedMLP" and hasattr(
        model.model.layers[0].mlp, "_hf_hook"
    )
    ids, mask = random_batch(3, seed=2)
    for kwargs in ({}, {"paged": True}, {"prompt_lookup": True}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kwargs)
        ref = reference.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, **kwargs)
        assert torch.equal(out, ref), kwargs
    prompt = ids[0][mask[0].bool()].tolist()
    seqs = model.generate_many([prompt], max_new_tokens=10, eos_token_id=None)
    want = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert seqs[0].tolist() == want[0].tolist()
    hf_accel.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([[5, 6, 7]])).logits, before)  # bitwise


def test_paged_pool_lives_on_each_layers_execution_device(tmp_path):
    model = hf_accel.patch_model(offloaded("llama", tmp_path))
    cache = hf_accel.PagedCache(model, num_blocks=8, block_size=4)
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "cpu"]  # not "meta" for the offloaded one


def test_offloaded_weights_give_typed_errors_naming_the_module(tmp_path):
    model = offloaded("llama", tmp_path)
    with pytest.raises(IncompatibleOptionsError, match=r"int8 cannot rewrite model\.layers\.1\.self_attn\.q_proj: "):
        hf_accel.patch_model(model, int8=True)
    assert not hf_accel.is_patched(model)
    with pytest.raises(
        IncompatibleOptionsError, match=r"compile \(weight pre-packing\) cannot rewrite model\.layers\.1"
    ):
        hf_accel.patch_model(model, compile=True)
    hf_accel.patch_model(model)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(IncompatibleOptionsError, match="self-speculation copies the model's weights"):
        model.generate(ids, max_new_tokens=4, speculative=SelfSpeculative())


def test_int8_on_a_dispatched_model_with_offloaded_layers_skipped(tmp_path):
    """The resident layers are quantized in place (their accelerate hooks move to the int8 modules)."""
    int8 = hf_accel.Int8Config(skip_modules=("model.layers.1.*",))
    reference = hf_accel.patch_model(tiny_model("qwen3"), int8=int8)
    model = hf_accel.patch_model(offloaded("qwen3", tmp_path), int8=int8)
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Int8Linear" and hasattr(q_proj, "_hf_hook")
    ids, mask = random_batch(2, seed=3)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, reference.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False))


def _gloo_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.mark.skipif(not _gloo_available(), reason="needs torch.distributed with gloo")
def test_tensor_parallel_two_cpu_processes(tmp_path):
    """torchrun --nproc-per-node 2 on CPU (gloo): each feature against the same model in one process."""
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    out = tmp_path / "out"
    out.mkdir()
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}  # keeps a PYTHONPATH the run relies on
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517"]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(folder), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        res = json.loads((out / f"rank{rank}.json").read_text())
        # fused MLP: each rank fused its own column-wise gate/up shards (views, no copy)
        assert res["report"]["fused_mlp"] == {"gate/up shards shared": 2, "MLP fused": 2}, res["report"]
        for check in ("plain", "paged", "prompt_lookup", "engine", "unpatch_bitwise", "int8_greedy"):
            assert res[check] is True, (rank, check, res[check])
        # int8 per rank quantizes exactly like one process (row-wise shards share the row's scale via all-reduce);
        # only the all-reduce's summation order differs
        assert res["int8_logits_max_abs_diff"] < 1e-4, res["int8_logits_max_abs_diff"]
        assert res["int8_report"]["colwise shard -> int8"] == 10 and res["int8_report"]["rowwise shard -> int8"] == 4
        assert "self-speculation copies the model's weights" in res["self_spec"]["error"]
        assert res["compile"]["error"].startswith("FeatureNotAvailableError: compile cannot pre-pack the tensor")
        assert res["gathered_plan"]["error"].startswith(
            "IncompatibleOptionsError: fused_mlp cannot honour the tensor-parallel plan of model.layers.0.mlp: "
        ), res["gathered_plan"]
        assert res["gathered_plan_unfused"] is True


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_cuda_devices_greedy_equals_single_device():
    reference = hf_accel.patch_model(tiny_model("llama").to("cuda:0"))
    model = tiny_model("llama")
    device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "model.rotary_emb": 0,
        "lm_head": 1,
    }
    model = hf_accel.patch_model(dispatch_model(model, device_map=device_map))
    assert model.model.layers[1].mlp.gate_up_proj.weight.device == torch.device("cuda:1")
    cache = hf_accel.PagedCache(model, num_blocks=8, block_size=4)
    assert [str(layer.keys.device) for layer in cache.layers] == ["cuda:0", "cuda:1"]
    ids, mask = random_batch(3, seed=4)
    for kwargs in ({}, {"paged": True}):
        out = model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False, **kwargs)
        ref = reference.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8, do_sample=False, **kwargs)
        assert torch.equal(out.cpu(), ref.cpu()), kwargs


def test_tp_style_matches_plan_patterns():
    model = tiny_model("llama")
    model._tp_plan = {"model.layers.*.mlp.gate_proj": "colwise", "lm_head": "colwise_gather_output"}
    assert tp_style(model, "model.layers.11.mlp.gate_proj") == "colwise"
    assert tp_style(model, "lm_head") == "colwise_gather_output"
    assert tp_style(model, "model.layers.0.mlp.down_proj") is None


def test_offloading_hooks_are_not_shared(tmp_path):
    model = offloaded("llama", tmp_path)
    old = model.model.layers[1].mlp.gate_proj  # its hook loads "gate_proj.weight" from the offload folder
    with pytest.raises(IncompatibleOptionsError, match="its accelerate hook offloads weights by name"):
        transfer_hook(old, torch.nn.Linear(4, 4))
    assert execution_device(model.model.layers[1]) == torch.device("cpu")


def test_row_shards_quantized_with_the_rows_absmax_equal_the_whole_row():
    """What a row-wise tensor-parallel rank does (absmax all-reduced) equals one process quantizing the row."""
    torch.manual_seed(0)
    weight = torch.randn(16, 64)
    whole = quantize(weight)
    absmax = weight.abs().amax(dim=1, keepdim=True)  # what the all-reduce (MAX) of the shards' maxima yields
    for shard in weight.split(32, dim=1):
        part = quantize(shard, absmax=absmax)
        assert torch.equal(part.scale, whole.scale)
    assert torch.equal(torch.cat([quantize(s, absmax=absmax).qweight for s in weight.split(32, 1)], 1), whole.qweight)
    with pytest.raises(ValueError, match=r"absmax must be \[16, 1\], got \(16, 2\)"):
        quantize(weight, absmax=torch.ones(16, 2))
