"""`ckpt convert --to torch` and `--to megatron` (torch_dist and `--ckpt-format torch`) as torchrun jobs on
127.0.0.1: the same bytes as one process (`--to torch`: one torch.save file, each rank writing its parameters'
storages at the offsets torch gives them, rank 0 the records and headers around them; megatron legacy: one rank
folder per unit; torch_dist: each parameter's DCP items at the offsets one process writes them at), the per-rank
`--json` figures, and a rank killed with SIGKILL mid-way, then the rerun: the same bytes. Sources: DeepSpeed ZeRO-2,
DCP (FSDP2 recipe; torchtitan, the way in to Megatron), Megatron-LM legacy and torch_dist, Megatron-DeepSpeed. No
Megatron-LM is needed (only ckpt's writers run)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

from ckpt_tools.write import torch_zip

from conftest import run_cli, sample
from test_export_formats import _titan_hf_config
from test_to_universal_torchrun import _job, _launch, _rank_1_lost, _wait

#: (source, convert options): a DeepSpeed ZeRO-2 run and a DCP (FSDP2 recipe) run as one torch file, a Megatron-LM
#: torch_dist run at TP 2 as Megatron's legacy rank files (two rank folders)
CASES = {
    "zero2_torch": (("deepspeed", "zero2_lambdalr"), "t.pt", ("--to", "torch")),
    "dcp_torch": (("dcp", "dcp_recipe_fsdp2"), "t.pt", ("--to", "torch")),
    "megatron_legacy": (
        ("megatron_lm", "megatron_tp2_torch_dist"),
        "m",
        ("--to", "megatron", "--ckpt-format", "torch"),
    ),
    # torch_dist: a Megatron-LM legacy run with the distributed optimizer (its buffers' chunks are units), and a
    # Megatron-DeepSpeed pipeline run at TP 2 x PP 2 (`write.megatron_from_view`)
    "megatron_distopt": (("megatron_lm", "megatron_dp2_distopt_legacy"), "m", ("--to", "megatron")),
    "pipeline_megatron": (("megatron", "gpt_tp2_pp2"), "m", ("--to", "megatron")),
    # a torchtitan DCP run the way in to Megatron (`view.torchtitan`, with its model's HF config)
    "titan_megatron": (("dcp", "torchtitan_real/step-3"), "m", ("--to", "megatron", "--hf-config", "HF_CONFIG")),
}


@functools.cache
def _titan_config() -> Path:
    """The torchtitan sample's LlamaConfig as transformers writes it (test_export_formats), once per process."""
    return _titan_hf_config(Path(tempfile.mkdtemp(prefix="titan_cfg_")))


def _digest(path: Path) -> dict[str, str]:
    """file -> sha256; DCP's `.metadata` with its StorageMeta left out (checkpoint_id: the OUT path, and the save_id
    made from that path and the plan), since the reference is written to another path."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return {str(p.relative_to(path) if path.is_dir() else p.name): hashlib.sha256(_bytes(p)).hexdigest() for p in files}


def _bytes(p: Path) -> bytes:
    data = p.read_bytes()
    if p.name != ".metadata":
        return data
    md = pickle.loads(data)  # our own test output
    assert md.storage_meta.checkpoint_id == str(p.parent) and md.storage_meta.save_id
    md.storage_meta = None
    return pickle.dumps(md)


def _args(key: str, out_dir: Path) -> list:
    where, name, options = CASES[key]
    return [sample(*where), out_dir / name, *(_titan_config() if o == "HF_CONFIG" else o for o in options)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each case's one-process output, converted once for the module: file -> sha256."""
    made: dict[str, dict[str, str]] = {}

    def get(key: str) -> dict[str, str]:
        if key not in made:
            out = tmp_path_factory.mktemp("ref")
            r = run_cli("convert", *_args(key, out), "--json")
            assert r.returncode == 0, r.stderr[-3000:]
            made[key] = _digest(out / CASES[key][1])
        return made[key]

    return get


def test_the_torch_file_layout_is_torch_saves(tmp_path):
    """`torch_zip.plan_save` of a skeleton (torch.empty tensors) and `write_frame` around bytes written at the
    planned offsets give the file torch.save writes, byte for byte: a bf16 tensor, an empty one, a 0-d step."""
    torch.manual_seed(0)
    real = {
        "model": {"w": torch.randn(300, 40), "b": torch.randn(7).bfloat16(), "e": torch.empty(0, 3)},
        "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(3, 4)}}, "param_groups": []},
        "step": 4,
    }
    leaves = [real["model"]["w"], real["model"]["b"], real["model"]["e"], *real["optimizer"]["state"][0].values()]
    (tmp_path / "ref").mkdir()
    torch.save(real, tmp_path / "ref" / "t.pt")
    skeleton = {
        **real,
        "model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in real["model"].items()},
        "optimizer": {
            "state": {0: {k: torch.empty(v.shape, dtype=v.dtype) for k, v in real["optimizer"]["state"][0].items()}},
            "param_groups": [],
        },
    }
    layout = torch_zip.plan_save(skeleton, tmp_path / "t.pt")
    assert layout.sizes == tuple(t.numel() * t.element_size() for t in leaves)
    assert all(o % 64 == 0 for o in layout.offsets)
    fd = os.open(tmp_path / "t.pt", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        crcs = []
        for t, at in zip(leaves, layout.offsets):
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            os.pwrite(fd, data, at)
            crcs.append(zlib.crc32(data))
        assert torch_zip.write_frame(fd, layout, crcs) == layout.size
    finally:
        os.close(fd)
    assert (tmp_path / "t.pt").read_bytes() == (tmp_path / "ref" / "t.pt").read_bytes()


@pytest.mark.parametrize(
    "key", ["zero2_torch", "megatron_legacy", "megatron_distopt", "pipeline_megatron", "titan_megatron"]
)
def test_nproc_2_writes_the_bytes_of_one_process_with_each_ranks_figures(tmp_path, reference, key):
    r = run_cli("convert", *_args(key, tmp_path), "--nproc", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _digest(tmp_path / CASES[key][1]) == reference(key)
    doc = json.loads(r.stdout)
    ranks = doc["ranks"]
    assert [x["rank"] for x in ranks] == [0, 1] and all(x["params"] > 0 and x["bytes"] > 0 for x in ranks)
    assert doc["resumed"] == 0 and doc["verified"] is True and doc["bytes_written"] == sum(x["bytes"] for x in ranks)
    assert doc["converted"] == sum(x["params"] for x in ranks)  # units: parameters, rank folders, buffer chunks
    verified = [n for x in ranks for n in x["verified"]]  # every parameter compared with the source by one rank
    assert len(verified) == len(set(verified)) == doc["params"] and all(x["verified_bytes"] > 0 for x in ranks)
    if key == "zero2_torch":  # a unit per parameter
        assert doc["converted"] == doc["params"] and sum(x["verified_bytes"] for x in ranks) == doc["bytes_written"]
    if key == "megatron_legacy":  # a unit per rank folder
        assert doc["converted"] == 2 and all(x["params"] == 1 for x in ranks)
    assert sorted(p.name for p in tmp_path.iterdir()) == [CASES[key][1]]  # no staging left


def test_two_nodes_torch_from_dcp_byte_identical(tmp_path, reference):
    doc, _ = _job(2, 1, _args("dcp_torch", tmp_path), command=("convert",))
    assert _digest(tmp_path / "t.pt") == reference("dcp_torch")
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["converted"] == doc["params"]
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert len(loaded["model"]) == doc["params"] and loaded["optimizer"]["state"]


@pytest.mark.parametrize("key", ["zero2_torch", "megatron_distopt"])
def test_a_rank_killed_mid_way_then_the_rerun_gives_the_same_bytes(tmp_path, reference, key):
    """Node 1's rank is killed (SIGKILL) after it journaled 2 units (a parameter's storages in the torch file; a
    parameter's or a buffer chunk's DCP items): rank 0 names it in one line, exit 2, nothing in place; the same
    command in one process writes only the rest, byte-identical."""
    name = CASES[key][1]
    out = tmp_path / name
    env = {"CKPT_TEST_KILL_AFTER": "1:2", "CKPT_DIST_LOST_S": "4"}
    done = _wait(_launch(2, 1, _args(key, tmp_path), env=env, command=("convert",)))
    _rank_1_lost(done, out, tmp_path / f".ckpt-staging-{name}-job")

    r = run_cli("convert", *_args(key, tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["resumed"] >= 2 and doc["converted"] + doc["resumed"] > 2 and len(doc["ranks"]) == 1
    assert _digest(out) == reference(key)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
