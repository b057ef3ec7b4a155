"""The torchrun jobs on more of the bundled producers: `--nproc 2` (a one-node torchrun job of two processes)
writes the same files, byte for byte, as one process into the same OUT path (DCP's `.metadata` names its path, so
both runs write to one path, one after the other). The two-node and failure cases are in
test_to_universal_torchrun.py / test_convert_torchrun.py / test_export_torchrun.py; this file widens the sources:
ZeRO-1, ZeRO-3, DeepSpeed MoE (expert-parallel files), Megatron-LM legacy TP 2 and Megatron-core MoE torch_dist."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import run_cli, sample

CASES = {
    "zero1": (("deepspeed", "zero1_bf16"), ("to-universal",)),
    "zero3": (("deepspeed", "zero3_bf16"), ("to-universal",)),
    "ds_moe": (("moe", "moe_zero2_bf16"), ("to-universal",)),
    "megatron_tp2": (("megatron_lm", "megatron_tp2_legacy"), ("convert", "--to", "dcp")),
    "megatron_moe": (("megatron_lm", "megatron_moe_ep2_torch_dist"), ("convert", "--to", "dcp")),
}


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("key", list(CASES))
def test_two_processes_write_what_one_process_writes(tmp_path, key):
    where, (command, *options) = CASES[key]
    src, out = sample(*where), tmp_path / "out"
    one = run_cli(command, src, out, *options, "--yes", "--json")
    assert one.returncode == 0, one.stderr[-3000:]
    want = _digest(out)
    shutil.rmtree(out)
    two = run_cli(command, src, out, *options, "--yes", "--json", "--nproc", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    doc = json.loads(two.stdout)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and all(r["bytes"] > 0 for r in doc["ranks"])
    assert _digest(out) == want and len(want) > 1
    assert not list(tmp_path.glob(".ckpt-staging-*"))
