"""`ckpt diff` across formats: by logical parameter, optimizer state, param group and counter.

Every pair is a real checkpoint and a real conversion of it: our `to-universal` output, DeepSpeed's own
`ds_to_universal` output (the committed universal sample), `ckpt export`, and torch's `dcp_to_torch_save`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ckpt_tools.ops import diff as D
from ckpt_tools.ops import to_universal as U

from conftest import run_cli, sample


@pytest.fixture(scope="module")
def zero2_universal(tmp_path_factory):
    out = tmp_path_factory.mktemp("u") / "zero2_bf16_u"
    U.execute(U.plan_to_universal(sample("deepspeed", "zero2_bf16"), out))
    return out


def test_checkpoint_and_its_universal_output_are_the_same(zero2_universal):
    """The issue's case: file by file it was '124 differences: 0 tensors compared'."""
    src = sample("deepspeed", "zero2_bf16")
    r = run_cli("diff", src, zero2_universal)
    said = " ".join(r.stdout.split())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "same: by logical name: 87 tensors compared (87 read)" in said  # 29 fp32 masters + 2 x 29 moments
    rep = D.diff(src, zero2_universal)
    assert rep.mode == "logical" and rep.same and rep.tensors_read == 87
    # DeepSpeed's own converter output of the same checkpoint: the same logical content
    assert D.diff(src, sample("universal", "zero2_bf16_universal")).same
    # forced file by file, the old report
    files = D.diff(src, zero2_universal, mode="files")
    assert files.mode == "files" and not files.same and files.tensors_compared == 0
    r = run_cli("diff", src, zero2_universal, "--files")
    assert r.returncode == 1 and "differences" in r.stdout
    assert run_cli("diff", src, zero2_universal, "--files", "--logical").returncode == 2


def test_pipeline_tp2_pp2_and_its_universal_output(tmp_path):
    src = sample("megatron", "gpt_tp2_pp2")
    U.execute(U.plan_to_universal(src, tmp_path / "u"))
    rep = D.diff(src, tmp_path / "u")
    # 53 merged fp32 masters (TP shards cat'ed, vocabulary padding stripped) + 2 x 53 moments
    assert rep.mode == "logical" and rep.same and rep.tensors_compared == 159


def test_export_compares_the_model_and_says_what_it_could_not(tmp_path):
    src = sample("deepspeed", "zero2_bf16")
    out = tmp_path / "m.safetensors"
    r = run_cli("export", src, out, "--yes")
    assert r.returncode == 0, r.stderr
    rep = D.diff(src, out)
    assert rep.same and rep.tensors_compared == 29
    assert any("no per-parameter optimizer state" in n for n in rep.notes)
    doc = json.loads(run_cli("diff", src, out, "--json").stdout)
    assert doc["mode"] == "logical" and doc["same"] and doc["notes"]
    # a module-weight (bf16) export is not the fp32 master: every tensor is reported, with its dtype
    r = run_cli("export", src, tmp_path / "b.safetensors", "--source", "module", "--yes")
    assert r.returncode == 0, r.stderr
    rep = D.diff(src, tmp_path / "b.safetensors")
    assert len(rep.differences) == 29 and {d.kind for d in rep.differences} == {"type"}
    assert {(d.old.split()[0], d.new.split()[0]) for d in rep.differences} == {("float32", "bfloat16")}


def _dcp_copy(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "fsdp2.pt"
    dcp_to_torch_save(sample("fsdp", "fsdp2_dcp"), out)
    return out


def test_dcp_and_its_torch_save_copy(tmp_path):
    src = sample("fsdp", "fsdp2_dcp")
    copy = _dcp_copy(tmp_path)
    rep = D.diff(src, copy)
    assert rep.mode == "logical" and rep.same and rep.tensors_compared == 87


def test_differences_found_by_name_group_and_counter(tmp_path):
    """Change one optimizer tensor by 1e-3, one parameter's step, one group's LR and the saved global step in
    the torch copy of a DCP checkpoint: exactly those are reported, tolerances apply, exit 1."""
    src = sample("fsdp", "fsdp2_dcp")
    copy = _dcp_copy(tmp_path)
    sd = torch.load(copy, weights_only=False)
    pid = next(iter(sd["optim"]["state"]))
    sd["optim"]["state"][pid]["exp_avg"].view(-1)[0] += 1e-3
    sd["optim"]["state"][pid]["step"] += 1
    sd["optim"]["param_groups"][1]["lr"] *= 10
    sd["step"] += 1
    torch.save(sd, copy)
    rep = D.diff(src, copy)
    got = {(d.file, d.field): d for d in rep.differences}
    assert set(got) == {
        ("optimizer", f"{pid}.exp_avg"),
        ("optimizer", f"{pid}.step"),
        ("param_groups", "1.lr"),
        ("counters", "global_step"),
    }, set(got)
    assert got[("optimizer", f"{pid}.exp_avg")].max_abs_diff == pytest.approx(1e-3, rel=1e-2)
    assert (got[("optimizer", f"{pid}.step")].old, got[("optimizer", f"{pid}.step")].new) == (4, 5)
    assert (got[("counters", "global_step")].old, got[("counters", "global_step")].new) == (4, 5)
    loose = D.diff(src, copy, atol=2e-3)
    assert ("optimizer", f"{pid}.exp_avg") not in {(d.file, d.field) for d in loose.differences}
    assert len(loose.differences) == 3 and loose.within_tolerance == 1
    r = run_cli("diff", src, copy)
    said = " ".join(r.stdout.split())
    assert r.returncode == 1 and "4 differences: by logical name" in said and "1.lr" in said


def test_same_format_different_topology_is_logical(tmp_path):
    """ZeRO-2 and ZeRO-3 runs of the same recipe: compared by name (files have nothing in common); bf16
    training on two ZeRO stages rounds differently, so the values differ, and only the values."""
    rep = D.diff(sample("deepspeed", "zero2_bf16"), sample("deepspeed", "zero3_bf16"))
    assert rep.mode == "logical" and rep.tensors_compared == 87
    assert {d.kind for d in rep.differences} == {"changed"} and {d.file for d in rep.differences} <= {
        "model",
        "optimizer",
    }
    # and the same checkpoint twice, forced logical
    copy = tmp_path / "c"
    shutil.copytree(sample("deepspeed", "zero2_bf16"), copy)
    assert D.diff(sample("deepspeed", "zero2_bf16"), copy, mode="logical").same
    assert D.diff(sample("deepspeed", "zero2_bf16"), copy).mode == "files"


def test_same_format_under_other_file_names_is_compared_logically():
    """zero2_bf16 and zero2_fp32: one format and topology, but the optimizer files have other names
    (bf16_zero_pp_rank_* vs zero_pp_rank_*): "auto" compares them by logical parameter (the file by file
    comparison would only say that files were added and removed)."""
    from conftest import sample

    a, b = sample("deepspeed", "zero2_bf16"), sample("deepspeed", "zero2_fp32")
    assert D.choose_mode(a, b) == "logical" and D.choose_mode(a, a) == "files"
    rep = D.diff(a, b)
    assert rep.mode == "logical" and not rep.same and rep.tensors_compared == 29 * 3
