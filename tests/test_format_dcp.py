"""The torch.distributed.checkpoint reader against the real FSDP2 sample and torch's own DCP loader."""

from __future__ import annotations

import shutil

import pytest
import torch

import ckpt_tools
from ckpt_tools.read import pickle_reader
from ckpt_tools.errors import CorruptCheckpoint
from ckpt_tools.formats.dcp import Chunk, chunked_tensor

from conftest import run_cli, manifest, sample

GROUP, NAME = "fsdp", "fsdp2_dcp"


@pytest.fixture(scope="module")
def ck():
    return ckpt_tools.open_checkpoint(sample(GROUP, NAME))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """torch's own reading of the folder: DCP -> one torch.save file -> torch.load."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path_factory.mktemp("dcp_ref") / "full.pt"
    dcp_to_torch_save(sample(GROUP, NAME), out)
    return torch.load(out, weights_only=False)


def test_detected_as_dcp(ck):
    assert ck.format == manifest(GROUP, NAME)["format"] == "dcp"


def test_tensors_equal_torch_dcp_loader(ck, reference):
    model = ck.model.children
    assert set(model) == set(reference["model"])
    for name, want in reference["model"].items():
        assert torch.equal(model[name].read_torch(), want), name
    state = ck.get("optimizer.state").children
    assert set(state) == set(reference["optim"]["state"])
    for name, want in reference["optim"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            node = state[name].children[key]
            assert torch.equal(node.read_torch(), want[key]), f"{name}.{key}"
        assert state[name].children["step"].value == want["step"].item()  # shown without read_torch()


def test_values_equal_torch_dcp_loader(ck, reference):
    groups = ck.get("optimizer.param_groups").children
    for i, want in enumerate(reference["optim"]["param_groups"]):
        for field in ("lr", "initial_lr", "eps", "weight_decay"):
            assert groups[str(i)].children[field].value == pytest.approx(want[field])
        assert groups[str(i)].children["params"].value == want["params"]
    for field, want in reference["scheduler"].items():
        if field != "lr_lambdas":
            assert ck.get(f"scheduler.{field}").value == want
    assert ck.get("client_state.step").value == reference["step"] == manifest(GROUP, NAME)["steps"]


def test_pieces_point_into_the_rank_files(ck):
    pieces = ck.get("model.wte.weight").pieces
    assert [(p.file, p.rank, p.dst_offset, p.numel) for p in pieces] == [
        ("__0_0.distcp", {"dp": 0}, 0, 32 * 32),
        ("__1_0.distcp", {"dp": 1}, 32 * 32, 32 * 32),
    ]


def test_chunks_split_on_a_later_dim_read_back_correctly(tmp_path):
    """FSDP2 splits on dim 0; a DCP written by TP (or a reshard) splits on others. Such a chunk is not
    one run of the flattened tensor, so the reader must place it row by row."""
    full = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)
    blocks = {"a": ((0, 0, 0), full[:, :4]), "b": ((0, 4, 0), full[:2, 4:]), "c": ((2, 4, 0), full[2:, 4:])}
    torch.save({k: t.contiguous() for k, (_, t) in blocks.items()}, tmp_path / "blocks.pt")
    refs = pickle_reader.load(tmp_path / "blocks.pt").obj
    chunks = [
        Chunk(off, tuple(t.shape), refs[k], "blocks.pt", {"dp": i}) for i, (k, (off, t)) in enumerate(blocks.items())
    ]
    node = chunked_tensor("x", (4, 6, 2), "float32", chunks, tmp_path)
    assert torch.equal(node.read_torch(), full)
    with pytest.raises(CorruptCheckpoint, match="uncovered"):
        chunked_tensor("x", (4, 6, 2), "float32", chunks[:2], tmp_path)


def test_missing_distcp_file_exits_2_naming_it(copy_sample):
    path = copy_sample(GROUP, NAME)
    (path / "__0_0.distcp").unlink()
    proc = run_cli("inspect", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "__0_0.distcp is missing" in lines[0], proc.stderr


def test_stray_and_unreferenced_files_warn(copy_sample):
    path = copy_sample(GROUP, NAME)
    shutil.copy(path / "__1_0.distcp", path / "__1_0.distcp.orig")
    shutil.copy(path / "__1_0.distcp", path / "__2_0.distcp")
    ck = ckpt_tools.open_checkpoint(path)
    codes = {(w.code, w.path) for w in ck.warnings}
    assert ("stray-file", "__1_0.distcp.orig") in codes
    assert ("unreferenced-file", "__2_0.distcp") in codes
    assert ck.topology.dp == 2  # a left-over file is not a rank of this save
