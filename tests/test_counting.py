"""Parameter counting with weights that are tied or frozen, in files written by the real libraries."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ckpt_tools
from conftest import manifest, sample

TIED_GPT2 = """
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
torch.manual_seed(0)
m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4))
assert m.lm_head.weight is m.transformer.wte.weight
print(sum(p.numel() for p in m.parameters()), len(list(m.parameters())), len(m.state_dict()))
torch.save({"model": m.state_dict(), "step": 3}, sys.argv[1])
"""


def test_tied_weight_saved_under_two_names_counts_once(tmp_path):
    """`state_dict()` of a tied GPT-2 names the embedding twice (wte.weight, lm_head.weight): one parameter."""
    out = subprocess.run(
        [sys.executable, "-c", TIED_GPT2, str(tmp_path / "gpt2.pt")], check=True, capture_output=True, text=True
    ).stdout.split()
    count, tensors, names = map(int, out[-3:])
    assert names == tensors + 1
    ck = ckpt_tools.open_checkpoint(tmp_path / "gpt2.pt")
    assert (ck.parameter_count, ck.parameter_tensors) == (count, tensors)


def test_zero1_frozen_parameter_is_counted_and_listed():
    """ZeRO-1 writes no frozen_param_shapes: the frozen wpe.weight is only in `module`."""
    m = manifest("deepspeed", "zero1_frozen")
    ck = ckpt_tools.open_checkpoint(sample("deepspeed", "zero1_frozen"))
    assert m["extra"]["frozen"] == ["wpe.weight"]
    assert (ck.parameter_count, ck.parameter_tensors) == (m["parameters"]["count"], m["parameters"]["tensors"])
    assert "wpe.weight" in ck.tree.children["model"].children
    assert "wpe.weight" not in ck.tree.children["optimizer"].children["state"].children


@pytest.mark.slow
def test_excluded_frozen_parameters_are_named_in_a_warning(tmp_path):
    """ZeRO-2 `save_checkpoint(exclude_frozen_parameters=True)`: the frozen weight is not in the files, so it is
    not counted, and a warning says so (a checkpoint with nothing frozen has no such warning)."""
    from ckpt_tools.samples import run_torchrun

    run_torchrun("ckpt_tools.samples.workers.ds_zero", 2, ["--sample", "zero2_frozen_excluded", "--out", str(tmp_path)])
    ck = ckpt_tools.open_checkpoint(tmp_path / "zero2_frozen_excluded")
    m = manifest("deepspeed", "zero2_bf16")
    assert ck.parameter_count == m["parameters"]["count"] - 16 * 32  # wpe.weight (16 x 32) left out
    assert [w.code for w in ck.warnings] == ["frozen-excluded"]
    assert "exclude_frozen_parameters" in ck.warnings[0].message
    assert not ckpt_tools.open_checkpoint(sample("deepspeed", "zero2_bf16")).warnings
