"""The committed samples are reproducible: regenerating one with the real framework gives the same run."""
from __future__ import annotations

import json

import pytest

import ckpt_tools
from ckpt_tools.samples import make_sample
from conftest import manifest

CASES = [("deepspeed", "zero2_bf16"), ("accelerate", "accelerate_ddp")]


@pytest.mark.slow
@pytest.mark.parametrize("group,name", CASES)
def test_regenerated_sample_matches_the_committed_one(tmp_path, group, name):
    path = make_sample(tmp_path, name)
    new = json.loads(path.with_name(path.name + ".manifest.json").read_text())
    old = manifest(group, name)
    for key in ("format", "world_size", "topology", "steps", "counters", "lr", "parameters"):
        assert new[key] == old[key], key
    # the same training run, bit for bit: losses and LRs of all six steps
    assert new["extra"]["history"] == old["extra"]["history"]
    ck = ckpt_tools.open_checkpoint(path)
    assert ck.parameter_count == old["parameters"]["count"]
