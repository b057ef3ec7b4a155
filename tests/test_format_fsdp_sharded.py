"""The FSDP1 SHARDED_STATE_DICT reader (per-rank torch.save files of ShardedTensor) against the real sample,
against torch itself (a real 2-process gloo group gathering the shards) and against the FSDP2 DCP sample."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import ckpt_tools
from conftest import run_cli, ROOT, manifest, sample

GROUP, NAME = "fsdp", "fsdp1_sharded"

#: torch needs a process group of the saving world size to unpickle ShardedTensor (it checks the rank
#: and world size recorded in the file), so the reference runs two gloo processes, each loading its own
#: rank file, and gathers every ShardedTensor to rank 0 with ShardedTensor.gather.
_GATHER = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from ckpt_tools.train.procgroup import leave

    def gathered(obj):
        from torch.distributed._shard.sharded_tensor import ShardedTensor
        if isinstance(obj, ShardedTensor):
            full = torch.empty(obj.size(), dtype=obj.dtype) if dist.get_rank() == 0 else None
            obj.gather(dst=0, out=full)
            return full
        if isinstance(obj, dict):
            return {k: gathered(v) for k, v in obj.items()}
        return obj

    def worker(rank, folder, out, init):
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        sd = torch.load(f"{folder}/rank{rank}.pt", weights_only=False)
        full = {"model": gathered(sd["model"]), "optimizer": {"state": gathered(sd["optimizer"]["state"])}}
        if rank == 0:
            torch.save(full, out)
        leave(0)  # barrier, destroy, os._exit: a plain return lets gloo abort a finished process at exit

    if __name__ == "__main__":
        mp.spawn(worker, args=tuple(sys.argv[1:4]), nprocs=2)
""")


@pytest.fixture(scope="module")
def ck():
    return ckpt_tools.open_checkpoint(sample(GROUP, NAME))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp1_ref")
    (tmp / "gather.py").write_text(_GATHER)
    out = tmp / "full.pt"
    proc = subprocess.run(
        [sys.executable, str(tmp / "gather.py"), str(sample(GROUP, NAME)), str(out), f"file://{tmp / 'store'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_detected_as_fsdp_sharded(ck):
    assert ck.format == manifest(GROUP, NAME)["format"] == "fsdp_sharded_torch"


def test_saved_loop_step_is_client_state(ck):
    # the rest of the header (format, counts, counters, LRs, topology) is checked against the manifest
    # for every sample in tests/test_inspect_samples.py
    assert ck.get("client_state.step").value == manifest(GROUP, NAME)["steps"]


def test_tensors_equal_torch_gather(ck, reference):
    model = ck.model.children
    assert set(model) == set(reference["model"])
    for name, want in reference["model"].items():
        assert torch.equal(model[name].read_torch(), want), name
    state = ck.get("optimizer.state").children
    assert set(state) == set(reference["optimizer"]["state"])
    for name, want in reference["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[name].children[key].read_torch(), want[key]), f"{name}.{key}"
        assert state[name].children["step"].value == want["step"].item()


def test_weights_equal_the_fsdp2_dcp_sample(ck):
    """The two samples trained the same model on the same data; their step-4 weights are bit-identical."""
    other = ckpt_tools.open_checkpoint(sample("fsdp", "fsdp2_dcp"))
    assert set(ck.model.children) == set(other.model.children)
    for name, node in ck.model.children.items():
        assert torch.equal(node.read_torch(), other.model.children[name].read_torch()), name


def test_one_piece_per_rank_placed_by_shard_offsets(ck):
    pieces = ck.get("optimizer.state.blocks.0.mlp_fc.weight.exp_avg").pieces
    assert [(p.file, p.rank, p.dst_offset, p.numel) for p in pieces] == [
        ("rank0.pt", {"dp": 0}, 0, 64 * 32),
        ("rank1.pt", {"dp": 1}, 64 * 32, 64 * 32),
    ]


def test_missing_rank_file_exits_2_naming_it(copy_sample):
    path = copy_sample(GROUP, NAME)
    (path / "rank1.pt").unlink()
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rank1.pt is missing" in lines[0], proc.stderr


def test_stray_copy_warns_and_is_not_a_rank(copy_sample):
    path = copy_sample(GROUP, NAME)
    shutil.copy(path / "rank0.pt", path / "rank0.pt.orig")
    ck = ckpt_tools.open_checkpoint(path)
    assert ("stray-file", "rank0.pt.orig") in {(w.code, w.path) for w in ck.warnings}
    assert [f.path for f in ck.files] == ["rank0.pt", "rank1.pt"]


def test_folders_of_other_formats_are_not_claimed():
    from ckpt_tools.formats import fsdp_sharded

    others = [p for p in sorted((ROOT / "sample_ckpts").rglob("*")) if p.is_dir() and p.name != NAME]
    assert any(p.name == "accelerate_ddp" for p in others) and any(p.name.startswith("zero") for p in others)
    assert not [p for p in others if fsdp_sharded.sniff(p)]
