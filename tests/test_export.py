"""`ckpt export`: equal to DeepSpeed's zero_to_fp32, tensor for tensor; sharded output with an index."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from safetensors.torch import load_file

from ckpt_tools.ops import export as E

from conftest import run_cli, sample

ZERO_SAMPLES = ["zero1_bf16", "zero2_bf16", "zero2_fp32", "zero2_lambdalr", "zero3_bf16"]


def zero_to_fp32(path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(path))


@pytest.mark.parametrize("name", ZERO_SAMPLES)
def test_export_equals_zero_to_fp32(name, tmp_path):
    src = sample("deepspeed", name)
    E.execute(E.plan_export(src, tmp_path / "m.safetensors"))
    got, ref = load_file(tmp_path / "m.safetensors"), zero_to_fp32(src)
    assert set(got) == set(ref) and len(ref) == 29
    for k in ref:
        assert got[k].dtype == ref[k].dtype == torch.float32 and torch.equal(got[k], ref[k]), k


def test_export_accelerate_and_module_weights(tmp_path):
    src = sample("accelerate", "accelerate_deepspeed")
    E.execute(E.plan_export(src, tmp_path / "a.safetensors"))
    ref = zero_to_fp32(src / "pytorch_model" if (src / "pytorch_model" / "latest").exists() else src)
    got = load_file(tmp_path / "a.safetensors")
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    # the module weights: bf16, and the fp32 master rounded to bf16 (bf16 training keeps them so)
    E.execute(E.plan_export(sample("deepspeed", "zero2_bf16"), tmp_path / "b.safetensors", source_weights="module"))
    mod = load_file(tmp_path / "b.safetensors")
    ref = zero_to_fp32(sample("deepspeed", "zero2_bf16"))
    assert all(mod[k].dtype == torch.bfloat16 and torch.equal(mod[k], ref[k].bfloat16()) for k in ref)


def test_export_sharded_with_index_via_cli(tmp_path):
    src = sample("deepspeed", "zero2_bf16")
    r = run_cli("export", src, tmp_path / "model.safetensors", "--max-shard-size", "40KB", "--dtype", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(doc["files"]) > 1 and set(index["weight_map"].values()) == {p.split("/")[-1] for p in doc["files"]}
    merged = {}
    for f in doc["files"]:
        merged.update(load_file(f))
    ref = zero_to_fp32(src)
    assert set(merged) == set(index["weight_map"]) == set(ref)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in merged.values())
    assert all(merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], ref[k].bfloat16()) for k in ref)
    assert not list(tmp_path.glob(".ckpt-staging-*"))
    again = run_cli("export", src, tmp_path / "model.safetensors", "--max-shard-size", "40KB", "--dtype", "bf16")
    assert again.returncode == 2 and "already exists" in again.stderr


def test_export_pipeline_merges_tp(tmp_path):
    E.execute(E.plan_export(sample("megatron", "gpt_tp2_pp2"), tmp_path / "p.safetensors"))
    got = load_file(tmp_path / "p.safetensors")
    assert got["2.self_attention.dense.weight"].shape == (16, 16)
    assert got["2.self_attention.query_key_value.weight"].shape == (48, 16)
    assert got["2.input_layernorm.weight"].shape == (16,)


def test_zero_export_copies_without_torch(tmp_path, monkeypatch):
    """A ZeRO checkpoint's fp32 masters are copied file to file (no torch import in that process), and the file
    is byte for byte the one the read-through-torch path writes."""
    import subprocess
    import sys

    from conftest import ROOT

    src = sample("deepspeed", "zero3_bf16")
    code = (
        "import sys; from ckpt_tools.ops import export as E; "
        f"E.execute(E.plan_export({str(src)!r}, {str(tmp_path / 'a.safetensors')!r})); "
        "print('torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False"]
    monkeypatch.setattr(E, "_ranges", lambda t, fds: None)  # the read-and-convert path for every tensor
    E.execute(E.plan_export(src, tmp_path / "b.safetensors"))
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    got, ref = load_file(tmp_path / "a.safetensors"), zero_to_fp32(src)
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
