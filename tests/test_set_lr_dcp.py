"""`ckpt set-lr` / `set-step` on a torch distributed checkpoint (FSDP2 + DCP), proven by a real FSDP2 resume.

The edited folder is loaded by `torch.distributed.checkpoint` itself (`dcp.load` under torchrun with 2 gloo
ranks, the sample's own model / AdamW / LambdaLR from `ckpt_tools.samples.workers.fsdp`), trained for two
steps, and the LR each update used is compared with the uninterrupted run's (manifest `extra.history`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import fail_at, ROOT, manifest
from test_set_lr import cli, halved, snapshot

from ckpt_tools.write import io
from ckpt_tools import open_checkpoint
from ckpt_tools.ops import lr as ops

GROUP, NAME = "fsdp", "fsdp2_dcp"

FSDP2_RESUME = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from ckpt_tools.train.procgroup import leave
    from ckpt_tools.samples.workers import _common as c, fsdp

    ckpt, out, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = c.rank()
    model, optimizer, scheduler, _ = fsdp.fsdp2_dcp(c.build_model(), ckpt)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": -1}
    dcp.load(state, checkpoint_id=ckpt)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    records = []
    for step in range(state["step"], state["step"] + steps):
        lrs = c.current_lrs(optimizer)
        loss = c.lm_loss(model, c.tokens_for_step(step, rank))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        records.append({"step": step + 1, "lr": lrs, "optimizer_step": c.adam_step(optimizer),
                        "last_epoch": scheduler.last_epoch})
    if rank == 0:
        Path(out).write_text(json.dumps(records))
    leave(0)
""")


def fsdp2_resume(tmp_path: Path, ckpt: Path, steps: int = 2) -> list[dict]:
    from ckpt_tools.samples import free_port, worker_env

    script, out = tmp_path / "fsdp2_resume.py", tmp_path / "records.json"
    script.write_text(FSDP2_RESUME)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        str(script),
        str(ckpt),
        str(out),
        str(steps),
    ]
    proc = subprocess.run(cmd, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def torch_save_view(ckpt: Path, tmp_path: Path) -> dict:
    """The folder through torch's own converter: dcp_to_torch_save, then torch.load."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "converted.pt"
    dcp_to_torch_save(ckpt, out)
    return torch.load(out, weights_only=False)


def test_dry_run_writes_nothing_and_says_base_lrs_drives(copy_sample):
    ck = copy_sample(GROUP, NAME)
    before = snapshot(ck)
    out = cli("set-lr", ck, "--scale", "0.5", "--dry-run").stdout
    assert "scheduler.base_lrs" in out and "DRIVES the LR" in out and "dry run: nothing written" in out
    assert "LambdaLR" in out and "optim.param_groups.0.lr" in out
    doc = json.loads(cli("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)["plan"]
    notes = {c["field"]: c["note"] for f in doc["files"] for c in f["changes"]}
    assert (
        notes["scheduler.base_lrs"].startswith("DRIVES") and "first resumed update" in notes["optim.param_groups.1.lr"]
    )
    # the file that holds those items (new blobs appended in place) and .metadata (their new offsets)
    assert {f["path"] for f in doc["files"]} == {"__1_0.distcp", ".metadata"}
    assert not [c for f in doc["files"] if f["path"] == ".metadata" for c in f["changes"]]
    assert snapshot(ck) == before and not (ck.parent / ".ckpt-backups").exists()


def test_scale_half_inspect_convert_and_real_fsdp2_resume(copy_sample, tmp_path):
    ck = copy_sample(GROUP, NAME)
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    man = manifest(GROUP, NAME)["lr"]
    lr = json.loads(cli("inspect", ck, "--json").stdout)["lr"]
    assert lr["base_lrs"] == pytest.approx([x / 2 for x in man["base_lrs"]], rel=1e-12)
    assert lr["last_lr"] == pytest.approx([x / 2 for x in man["last_lr"]], rel=1e-12)
    assert lr["param_groups"] == pytest.approx([x / 2 for x in man["param_groups"]], rel=1e-12)
    sd = torch_save_view(ck, tmp_path)
    assert sd["scheduler"]["base_lrs"] == pytest.approx([x / 2 for x in man["base_lrs"]], rel=1e-12)
    assert [sd["optim"]["param_groups"][g]["lr"] for g in (0, 1)] == pytest.approx(
        [x / 2 for x in man["param_groups"]], rel=1e-12
    )
    recs = fsdp2_resume(tmp_path, ck)
    assert [r["lr"] for r in recs] == halved(GROUP, NAME)
    assert [r["optimizer_step"] for r in recs] == [5, 6]
    assert [r["step"] for r in recs] == [5, 6]


def test_set_optimizer_step_resumes_from_it(copy_sample, tmp_path):
    ck = copy_sample(GROUP, NAME)
    cli("set-step", ck, "--optimizer-step", "10", "--yes")
    assert open_checkpoint(ck).counters.optimizer_step == 10
    recs = fsdp2_resume(tmp_path, ck)
    assert [r["optimizer_step"] for r in recs] == [11, 12]


@pytest.mark.parametrize("stage,nth", [("produce", 1), ("replace", 1), ("verify", 1)])
def test_failed_write_leaves_folder_byte_identical(copy_sample, stage, nth):
    ck = copy_sample(GROUP, NAME)
    before = snapshot(ck)
    with pytest.raises(io.WriteFailed, match="injected failure"):
        ops.set_lr(ck, scale=0.5, on_stage=fail_at(stage, nth))
    assert snapshot(ck) == before
    assert all(t.status == "rolled-back" for t in io.transactions(ck))


def test_moved_items_rewrite_metadata_and_torch_still_loads(copy_sample, tmp_path):
    """A new blob of another length moves every later item of its file: .metadata is re-pickled with the new
    offsets (protocol 2, by pickle_writer), and torch's own reader then finds every item, unchanged ones
    byte-identical. Failure midway (after .distcp replaced, before .metadata) rolls both back."""
    import torch

    from ckpt_tools.write.dcp_write import DcpFolder, value_blob

    ck = copy_sample(GROUP, NAME)
    before_sd = torch_save_view(ck, tmp_path)
    before = snapshot(ck)
    big = list(range(1000))  # not a real edit: a value whose blob is longer than the old one
    writes = DcpFolder(ck).rewrite({"step": value_blob(big)})
    assert [w[0] for w in writes] == ["__1_0.distcp", ".metadata"]
    plan = io.WritePlan(ck, "test", tuple(io.FileWrite(rel, (), n, produce) for rel, n, produce in writes))

    def boom(s, f):
        if s == "replace" and f == ".metadata":
            raise RuntimeError("injected failure at .metadata")

    with pytest.raises(io.WriteFailed):
        io.execute(plan, on_stage=boom)
    assert snapshot(ck) == before
    io.execute(plan)
    after = torch_save_view(ck, tmp_path)
    assert after["step"] == big
    assert after["scheduler"] == before_sd["scheduler"]
    for k, v in before_sd["model"].items():
        assert torch.equal(after["model"][k], v), k
    for fqn, st in before_sd["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(after["optim"]["state"][fqn][k], v), (fqn, k)
    open_checkpoint(ck)


def test_restore_brings_back_the_original_bytes(copy_sample, tmp_path):
    ck = copy_sample(GROUP, NAME)
    before = snapshot(ck)
    cli("set-step", ck, "--optimizer-step", "10", "--yes", "--backup-dir", tmp_path / "bk")
    cli("set-lr", ck, "--scale", "0.5", "--yes", "--backup-dir", tmp_path / "bk")
    assert snapshot(ck) != before and set(snapshot(ck)) == set(before)
    cli("restore", ck, "--yes")
    cli("restore", ck, "--yes")
    assert snapshot(ck) == before


def test_metadata_round_trips_through_pickle_writer():
    import pickle

    from ckpt_tools.read import pickle_reader
    from ckpt_tools.write.pickle_writer import dumps

    meta = ROOT / "sample_ckpts" / GROUP / NAME / ".metadata"
    again = pickle.loads(dumps(pickle_reader.load(meta).obj))
    orig = pickle.loads(meta.read_bytes())
    assert again == orig and again.storage_data == orig.storage_data and again.planner_data == orig.planner_data
