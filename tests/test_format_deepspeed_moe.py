"""DeepSpeed Mixture-of-Experts checkpoints written by DeepSpeed's own save_checkpoint (sample_ckpts/moe, made by
ckpt_tools/train/workers/ds_moe.py: `deepspeed.moe.layer.MoE`, 4 experts per layer, ep_size 2, 2 ranks): every
expert read under its global name with its optimizer state, exported equal to what DeepSpeed itself holds after
load_checkpoint; set-lr / set-step proven by DeepSpeed resumes of edited copies; conversions refused until a resume
proves them."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_tools
from ckpt_tools.samples import free_port, worker_env

from conftest import ROOT, producer_resume, run_cli, sample

SAMPLES = ["moe_stage0", "moe_zero2_bf16", "moe_zero2_bf16_ds0169"]
EXPERT = "blocks.{layer}.moe.deepspeed_moe.experts.deepspeed_experts.{e}.{p}"


def _manifest(name: str) -> dict:
    return json.loads((sample("moe", name).parent / f"{name}.manifest.json").read_text())


@pytest.mark.parametrize("name", SAMPLES)
def test_every_expert_is_read_with_its_optimizer_state(name):
    """The parameter count DeepSpeed's live model had (manifest), every expert of both MoE layers under its global
    id, Adam state for every parameter, the expert-parallel size from the MoE param groups, nothing unread."""
    m = _manifest(name)
    ck = ckpt_tools.open_checkpoint(sample("moe", name))
    assert ck.format == "deepspeed_moe" and not ck.warnings, ck.warnings
    assert (ck.parameter_count, ck.parameter_tensors) == (m["parameters"]["count"], m["parameters"]["tensors"])
    assert (ck.topology.dp, ck.topology.ep, ck.topology.zero_stage) == (2, 2, m["topology"]["zero_stage"])
    assert ck.details["accounting"]["unread"] == []
    model, state = ck.get("model").children, ck.get("optimizer.state").children
    experts = [EXPERT.format(layer=L, e=e, p=p) for L in (0, 1) for e in range(4)
               for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    assert set(experts) <= set(model) and set(model) == set(state)
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(state[n].children) for n in model)
    pc = m["extra"]["parameter_counts"]
    assert ck.details["expert_parameters"] == f"{pc['per_expert_count']:,} per expert, {pc['expert_count']:,} in 8 experts"
    assert ck.counters.optimizer_step == m["counters"]["optimizer_step"]
    assert list(ck.lr.param_groups) == pytest.approx(m["lr"]["param_groups"])


@pytest.mark.parametrize("name", ["moe_zero2_bf16", "moe_stage0"])
def test_export_equals_what_deepspeed_holds_after_load_checkpoint(tmp_path, name):
    """DeepSpeed reloads the sample (engine.load_checkpoint on 2 gloo ranks) and dumps safe_get_full_fp32_param of
    every parameter (each rank its own experts, renamed to global ids): `ckpt export` writes exactly those values,
    every expert included (ZeRO-2: the fp32 master; no ZeRO: the fp32 weights)."""
    from safetensors.torch import load_file
    import torch

    dump = tmp_path / "dump"
    dump.mkdir()
    ckpt = tmp_path / name
    shutil.copytree(sample("moe", name), ckpt)
    shutil.copy(sample("moe", name).parent / f"{name}.manifest.json", tmp_path / f"{name}.manifest.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "ckpt_tools.train.workers.ds_moe", "--check", str(ckpt),
           "--dump-fp32", str(dump)]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    want: dict = {}
    for r in (0, 1):
        want.update(torch.load(dump / f"fp32_rank{r}.pt"))
    proc = run_cli("export", sample("moe", name), tmp_path / "o.safetensors")
    assert proc.returncode == 0, proc.stderr
    got = load_file(tmp_path / "o.safetensors")
    assert set(got) == set(want) and len(got) == 51
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


@pytest.mark.parametrize("name", ["moe_zero2_bf16", "moe_stage0"])
def test_set_lr_and_set_step_resume_in_deepspeed_on_every_rank(tmp_path, name):
    """The proof of the edits: DeepSpeed's engine.load_checkpoint resumes an untouched and an edited copy on 2 ranks
    (expert-parallel ranks 0 and 1) in the same test. After `set-lr --scale 0.5` every update of every rank runs
    every param group (the MoE groups too) at exactly half the LR; after `set-step --optimizer-step 10`, Adam's step
    continues from 10 and the LRs are the untouched run's. No stray file inside the checkpoint."""
    untouched, halved, stepped = (tmp_path / x / name for x in ("a", "b", "c"))
    for d in (untouched, halved, stepped):
        shutil.copytree(sample("moe", name), d)
    listing = sorted(p.relative_to(halved) for p in halved.rglob("*"))
    assert run_cli("set-lr", halved, "--scale", "0.5", "--yes").returncode == 0
    assert sorted(p.relative_to(halved) for p in halved.rglob("*")) == listing
    assert run_cli("set-step", stepped, "--optimizer-step", "10", "--yes").returncode == 0
    ref = producer_resume(name, untouched, tmp_path)
    half = producer_resume(name, halved, tmp_path)
    assert [r["step"] for r in ref] == [r["step"] for r in half] == [5, 6]
    for r, u in zip(half, ref):
        assert len(r["lr_by_rank"]) == 2 and all(len(x) == 4 for x in r["lr_by_rank"])
        for mine, theirs in zip(r["lr_by_rank"], u["lr_by_rank"]):
            assert mine == pytest.approx([x / 2 for x in theirs], rel=1e-12)
    step = producer_resume(name, stepped, tmp_path)
    assert [r["optimizer_step"] for r in step] == [11, 12] and [r["optimizer_step"] for r in ref] == [5, 6]
    assert [r["lr_by_rank"] for r in step] == [r["lr_by_rank"] for r in ref]


@pytest.mark.parametrize("name", SAMPLES)
def test_conversions_refuse_until_a_resume_proves_them(tmp_path, name):
    run = tmp_path / name
    shutil.copytree(sample("moe", name), run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    for argv in (["to-universal", run, tmp_path / "u"], ["convert", run, tmp_path / "c", "--to", "dcp"]):
        proc = run_cli(*argv)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (argv, proc.stderr)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "u").exists() and not (tmp_path / "c").exists()


@pytest.mark.parametrize("edit,words", [
    (lambda ms: ms.__setitem__("ds_autoep_layers", [0]), "AutoEP"),
    (lambda ms: ms["ds_config"].__setitem__("use_data_before_expert_parallelism", True),
     "use_data_before_expert_parallelism"),
    (lambda ms: ms["frozen_param_shapes"].__setitem__(EXPERT.format(layer=0, e=0, p="fc1.weight"), (32, 32)),
     "frozen experts"),
])
def test_layouts_not_placed_yet_are_refused_by_name(tmp_path, edit, words):
    """Expert layouts this reader does not place (DeepSpeed AutoEP, data-before-expert parallel groups, frozen
    experts) are one line naming them, exit 2, never a mis-read or a 'corrupt file' verdict."""
    from ckpt_tools import pickle_reader as pr
    from ckpt_tools import pickle_writer as pw

    run = tmp_path / "moe"
    shutil.copytree(sample("moe", "moe_zero2_bf16"), run)
    f = run / "global_step4" / "mp_rank_00_model_states.pt"
    obj = pr.load(f).obj
    edit(obj)
    pw.rewrite_torch_zip(f, f.with_name("new.pt"), obj)
    f.with_name("new.pt").replace(f)
    proc = run_cli("inspect", run)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
