"""The committed samples are reproducible: regenerating one with the real framework gives the same run.

The regenerated run is made on this machine, the committed one on another: structure, counters, LRs and
parameter counts must be exact; losses (float results of training kernels) within the dtype's tolerance
(`conftest.LOSS_REL_TOL`, where the figures behind it are)."""

from __future__ import annotations

import copy
import math

import pytest

import ckpt_tools
from conftest import LOSS_REL_TOL, assert_history_matches, manifest, manifest_of

CASES = [("deepspeed", "zero2_bf16", "bfloat16"), ("accelerate", "accelerate_ddp", "float32")]


@pytest.mark.slow
@pytest.mark.parametrize("group,name,dtype", CASES)
def test_regenerated_sample_matches_the_committed_one(fresh_sample, group, name, dtype):
    path = fresh_sample(name)
    new = manifest_of(path)
    old = manifest(group, name)
    for key in ("format", "world_size", "topology", "steps", "counters", "lr", "parameters"):
        assert new[key] == old[key], key
    assert new["extra"].get("dtype", dtype) == dtype
    # the same training run: steps and LRs exact, losses within the dtype's cross-machine tolerance
    assert_history_matches(new["extra"]["history"], old["extra"]["history"], dtype)
    ck = ckpt_tools.open_checkpoint(path)
    assert ck.parameter_count == old["parameters"]["count"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_history_check_fails_on_a_perturbed_step(dtype):
    """The tolerance is not a blanket: one step's loss moved by twice the tolerance, or one LR by one ulp, fails."""
    old = manifest("deepspeed", "zero2_bf16")["extra"]["history"]
    assert_history_matches(copy.deepcopy(old), old, dtype)  # identical passes
    for step in (0, 5):
        moved = copy.deepcopy(old)
        moved[step]["loss"] *= 1 + 2 * LOSS_REL_TOL[dtype]
        with pytest.raises(AssertionError, match=f"step {old[step]['step']}: loss"):
            assert_history_matches(moved, old, dtype)
        within = copy.deepcopy(old)
        within[step]["loss"] *= 1 + LOSS_REL_TOL[dtype] / 2
        assert_history_matches(within, old, dtype)
    bumped = copy.deepcopy(old)
    bumped[3]["lr"] = [math.nextafter(x, 1.0) for x in bumped[3]["lr"]]
    with pytest.raises(AssertionError, match="LRs are exact"):
        assert_history_matches(bumped, old, dtype)
