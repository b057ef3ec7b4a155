"""DeepSpeed Mixture-of-Experts checkpoints written by DeepSpeed's own save_checkpoint (sample_ckpts/moe, made by
ckpt_tools/samples/workers/ds_moe.py: `deepspeed.moe.layer.MoE`, 4 experts per layer, ep_size 2, 2 ranks): every
expert read under its global name with its optimizer state, exported equal to what DeepSpeed itself holds after
load_checkpoint; set-lr / set-step proven by DeepSpeed resumes of edited copies; to-universal carrying every expert,
and the expert-parallel re-shape (ep_size 2 -> 1, 2 -> 1 ranks) it gives proven by DeepSpeed resumes; convert to DCP
refused until a resume proves it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

import ckpt_tools
from ckpt_tools.samples import free_port, worker_env

from conftest import ROOT, producer_resumes, run_cli, sample

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
    experts = [
        EXPERT.format(layer=L, e=e, p=p)
        for L in (0, 1)
        for e in range(4)
        for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    ]
    assert set(experts) <= set(model) and set(model) == set(state)
    assert all({"exp_avg", "exp_avg_sq", "step"} <= set(state[n].children) for n in model)
    pc = m["extra"]["parameter_counts"]
    assert (
        ck.details["expert_parameters"] == f"{pc['per_expert_count']:,} per expert, {pc['expert_count']:,} in 8 experts"
    )
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
        "-m",
        "ckpt_tools.samples.workers.ds_moe",
        "--check",
        str(ckpt),
        "--dump-fp32",
        str(dump),
    ]
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
    ref, half, step = producer_resumes(name, [untouched, halved, stepped], tmp_path)  # one launch, three runs
    assert [r["step"] for r in ref] == [r["step"] for r in half] == [5, 6]
    for r, u in zip(half, ref):
        assert len(r["lr_by_rank"]) == 2 and all(len(x) == 4 for x in r["lr_by_rank"])
        for mine, theirs in zip(r["lr_by_rank"], u["lr_by_rank"]):
            assert mine == pytest.approx([x / 2 for x in theirs], rel=1e-12)
    assert [r["optimizer_step"] for r in step] == [11, 12] and [r["optimizer_step"] for r in ref] == [5, 6]
    assert [r["lr_by_rank"] for r in step] == [r["lr_by_rank"] for r in ref]


@pytest.mark.parametrize("name", SAMPLES)
def test_to_universal_carries_every_expert_and_dcp_is_refused(tmp_path, name):
    """to-universal of every MoE sample (ZeRO-2 from DeepSpeed 0.19.8 and 0.16.9; no ZeRO: the expp_rank files'
    optimizer, the fp32 weights as master) writes every expert of both layers under its global id with its fp32
    master, moments and step, equal to the source by `ckpt diff --logical` (run by --verify, and again here), the
    MoE groups without the saved `ep_size_2` name. convert to DCP stays refused (no resume proves it). The source
    is untouched."""
    from ckpt_tools.read import pickle_reader as pr

    run = tmp_path / name
    shutil.copytree(sample("moe", name), run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    proc = run_cli("convert", run, tmp_path / "c", "--to", "dcp")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "to-universal" in proc.stderr and not (tmp_path / "c").exists()
    proc = run_cli("to-universal", run, tmp_path / "u", "--yes", "--verify")
    assert proc.returncode == 0 and "verified" in proc.stdout and "expert-parallel size 1" in proc.stdout, proc
    zero = tmp_path / "u" / "global_step4_universal" / "zero"
    experts = {
        EXPERT.format(layer=L, e=e, p=p)
        for L in (0, 1)
        for e in range(4)
        for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
    }
    assert experts <= {d.name for d in zero.iterdir()}
    assert all(
        {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"} <= {f.name for f in (zero / n).iterdir()} for n in experts
    )
    marks = pr.load(zero / EXPERT.format(layer=1, e=3, p="fc1.weight") / "fp32.pt").obj
    assert (marks["is_expert_param"], marks["ep_num_experts"]) == (True, 4)  # DeepSpeed stops at ep_size > 1
    groups = pr.load(zero / "optimizer_state.pt").obj["param_groups"]
    assert [g.get("moe", False) for g in groups] == [False, False, True, True]
    assert [g.get("name") for g in groups] == ["decay", "no_decay", None, None]
    diff = run_cli("diff", "--logical", run, tmp_path / "u")
    assert diff.returncode == 0 and "153 tensors compared" in diff.stdout, diff.stdout
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def _moe_worker(nproc: int, *argv, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "ckpt_tools.samples.workers.ds_moe",
        *map(str, argv),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=600)
    assert (proc.returncode == 0) == ok, " ".join(cmd) + "\n" + proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("source", ["moe_zero2_fp32", "moe_stage0"])
def test_expert_parallel_reshape_2_to_1_resumes_in_deepspeed(tmp_path, source):
    """The expert-parallel re-shape: a run saved at ep_size 2 on 2 ranks by DeepSpeed's save_checkpoint (ZeRO-2 fp32,
    made here so the sizes can be compared at fp32 rounding; and the stored no-ZeRO sample, whose expp_rank files
    hold the optimizer) goes through `ckpt to-universal`, and DeepSpeed resumes it at ep_size 1 with ZeRO-2 on 2
    ranks (and, for the ZeRO-2 run, on 1 rank accumulating the 2 ranks' micro-batches). Every parameter's fp32
    master and Adam moments right after the load equal, bit for bit, what the saved run's own resume (ep_size 2,
    2 ranks) holds; the two updates after it use the same Adam step and per-group LRs and give the same losses,
    and after the first one every state agrees to fp32 rounding (rel 1e-5: the experts' GEMMs see other token
    batches at another expert-parallel size). Loaded at ep_size 2, where DeepSpeed's loader would take every
    rank's experts from the folders of experts 0-1, it stops (the files are marked as experts)."""
    import torch

    if source == "moe_stage0":
        src = tmp_path / source
        shutil.copytree(sample("moe", source), src)
    else:
        _moe_worker(2, "--sample", source, "--out", tmp_path)
        src = tmp_path / source
    proc = run_cli("to-universal", src, tmp_path / "u", "--yes", "--verify")
    assert proc.returncode == 0 and "verified" in proc.stdout, proc.stderr
    ep1 = ["--sample", "moe_zero2_fp32", "--resume", tmp_path / "u", "--universal", "--ep", "1"]
    runs = {"ep2_dp2": (2, ["--sample", source, "--resume", src]), "ep1_dp2": (2, ep1)}
    if source == "moe_zero2_fp32":
        runs["ep1_dp1"] = (1, [*ep1, "--run-dp", "2"])
        stopped = _moe_worker(2, *ep1[:-2], "--steps", "1", ok=False)
        assert "ep_num_experts" in stopped.stderr, stopped.stderr[-2000:]
    got = {}
    # one launch per run: DeepSpeed keeps its expert-parallel groups per process, so runs at two EP sizes cannot
    # share one (`--then` fails: "Expert param dim 0 (32) != ep_num_experts (4)")
    for key, (nproc, argv) in runs.items():
        (tmp_path / key).mkdir()
        _moe_worker(nproc, *argv, "--steps", "2", "--record", tmp_path / key / "rec.json", "--dump", tmp_path / key)
        got[key] = (
            json.loads((tmp_path / key / "rec.json").read_text()),
            {s: torch.load(tmp_path / key / f"state_{s}.pt") for s in ("loaded", "step1")},
        )
    ref_rec, ref = got.pop("ep2_dp2")
    assert [r["step"] for r in ref_rec] == [5, 6] and [r["optimizer_step"] for r in ref_rec] == [5, 6]
    assert len(ref["loaded"]) == 51  # 19 non-expert tensors + 2 layers x 4 experts x 4
    for key, (rec, state) in got.items():
        assert [(r["step"], r["optimizer_step"], r["lr"]) for r in rec] == [
            (r["step"], r["optimizer_step"], r["lr"]) for r in ref_rec
        ], key
        assert all(x == r["lr"] for r in rec for x in r["lr_by_rank"]), key
        assert [r["loss"] for r in rec] == pytest.approx([r["loss"] for r in ref_rec], rel=1e-6, abs=0), key
        assert set(state["loaded"]) == set(ref["loaded"]), key
        for n, want in ref["loaded"].items():
            for k in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state["loaded"][n][k], want[k]), (key, n, k)
                after, ref_after = state["step1"][n][k], ref["step1"][n][k]
                assert torch.allclose(after, ref_after, rtol=1e-5, atol=1e-5 * ref_after.abs().max().item()), (
                    key,
                    n,
                    k,
                    (after - ref_after).abs().max(),
                )


@pytest.mark.parametrize(
    "edit,words",
    [
        (lambda ms: ms.__setitem__("ds_autoep_layers", [0]), "AutoEP"),
        (
            lambda ms: ms["ds_config"].__setitem__("use_data_before_expert_parallelism", True),
            "use_data_before_expert_parallelism",
        ),
        (
            lambda ms: ms["frozen_param_shapes"].__setitem__(EXPERT.format(layer=0, e=0, p="fc1.weight"), (32, 32)),
            "frozen experts",
        ),
    ],
)
def test_layouts_not_placed_yet_are_refused_by_name(tmp_path, edit, words):
    """Expert layouts this reader does not place (DeepSpeed AutoEP, data-before-expert parallel groups, frozen
    experts) are one line naming them, exit 2, never a mis-read or a 'corrupt file' verdict."""
    from ckpt_tools.read import pickle_reader as pr
    from ckpt_tools.write import pickle_writer as pw

    run = tmp_path / "moe"
    shutil.copytree(sample("moe", "moe_zero2_bf16"), run)
    f = run / "global_step4" / "mp_rank_00_model_states.pt"
    obj = pr.load(f).obj
    edit(obj)
    pw.rewrite_torch_zip(f, f.with_name("new.pt"), obj)
    f.with_name("new.pt").replace(f)
    proc = run_cli("inspect", run)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
