"""`ckpt diff`: exactly the changed fields and tensors, with tolerances, exit 1 when they differ."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import run_cli, sample
from ckpt_tools.write import io
from ckpt_tools.ops import diff as ops
from ckpt_tools.ops import lr


def test_diff_reports_exactly_what_set_lr_planned(tmp_path):
    before = tmp_path / "before"
    shutil.copytree(sample("deepspeed", "zero2_lambdalr"), before)
    after = tmp_path / "after"
    shutil.copytree(before, after)
    from ckpt_tools import open_checkpoint

    plan = lr.plan_set_lr(open_checkpoint(after), scale=0.5).plan
    io.execute(plan)
    report = ops.diff(before, after)
    assert {(d.file, d.field) for d in report.differences} == {(c.file, c.field) for c in plan.changes}
    got = {(d.file, d.field): (d.old, d.new) for d in report.differences}
    assert got[("global_step4/mp_rank_00_model_states.pt", "lr_scheduler.base_lrs")] == (
        [0.003, 0.003],
        [0.0015, 0.0015],
    )
    proc = run_cli("diff", before, after)
    assert proc.returncode == 1 and "lr_scheduler.base_lrs" in proc.stdout and "10 differences" in proc.stdout
    doc = json.loads(run_cli("diff", before, after, "--json").stdout)
    assert doc["same"] is False and len(doc["differences"]) == 10
    # 0.00192 -> 0.00096 is far outside rtol=0.1; both sides equal within rtol=1 (|a-b| <= |b|)
    assert run_cli("diff", before, after, "--rtol", "1").returncode == 0


def test_set_step_shows_as_step_tensor_changes(tmp_path):
    before = sample("torch", "plain.pt")
    after = tmp_path / "plain.pt"
    shutil.copy2(before, after)
    lr.set_step(after, optimizer_step=1497)
    report = ops.diff(before, after)
    assert len(report.differences) == 29  # one 0-d step tensor per parameter
    assert {(d.old, d.new) for d in report.differences} == {(4.0, 1497.0)}
    assert all(d.field.startswith("optimizer.state.") and d.field.endswith(".step") for d in report.differences)


def test_identical_checkpoints_and_hard_links(tmp_path):
    src = sample("accelerate", "accelerate_ddp")
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    proc = run_cli("diff", src, copy)
    assert proc.returncode == 0 and "same" in proc.stdout
    links = tmp_path / "links"
    links.mkdir()
    for f in copy.iterdir():
        (links / f.name).hardlink_to(f)
    report = ops.diff(copy, links)
    assert report.same and report.tensors_read == 0  # same inodes: nothing read


def test_tensor_tolerances_and_metadata_only_decisions(tmp_path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    x = torch.linspace(-1, 1, 1000)
    torch.save({"w": x, "v": torch.zeros(3), "n": 1, "gone": 2}, a)
    torch.save({"w": x + 1e-6, "v": torch.zeros(4), "n": 1, "new": 3}, b)
    r = ops.diff(a, b)
    by = {d.field: d for d in r.differences}
    assert set(by) == {"w", "v", "gone", "new"}
    assert by["v"].old == "float32 [3]" and by["v"].new == "float32 [4]"
    assert by["gone"].kind == "removed" and by["new"].kind == "added"
    assert by["w"].max_abs_diff == pytest.approx(1e-6, rel=0.2)
    assert r.tensors_read == 1  # the shape change was decided from metadata
    r = ops.diff(a, b, atol=1e-5)
    assert {d.field for d in r.differences} == {"v", "gone", "new"} and r.within_tolerance == 1
    assert run_cli("diff", a, b, "--atol", "1e-5").returncode == 1
    torch.save({"w": x + 1e-6}, b)
    torch.save({"w": x}, a)
    assert run_cli("diff", a, b, "--atol", "1e-5").returncode == 0
    assert run_cli("diff", a, b).returncode == 1


def test_added_and_removed_files(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(sample("deepspeed", "zero2_lambdalr"), a)
    shutil.copytree(a, b)
    (b / "latest").unlink()
    (b / "global_step4" / "extra.pt.bak").write_bytes(b"x")
    r = ops.diff(a, b)
    assert {(d.file, d.kind) for d in r.differences} == {("latest", "removed"), ("global_step4/extra.pt.bak", "added")}
