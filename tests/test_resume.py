"""`ckpt resume` on the real samples: DeepSpeed loads them, trains, and the records are compared with what the
uninterrupted sample run did (its manifest's `extra.history`, steps 5 and 6 after the save at step 4).

Everything runs on CPU with gloo and OMP_NUM_THREADS=1 (`samples.worker_env`, for the sample maker and for
resume alike). Bitwise claims are made only between two runs of the same test on this machine: the sample is
regenerated here (`fresh_sample`, the uninterrupted run) and resumed, and the resumed losses must equal its
history bit for bit. Against the committed manifests (recorded on another CPU model) losses get the dtype's
tolerance from `conftest.LOSS_REL_TOL`; counters and LRs stay exact.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LOSS_REL_TOL, ROOT, loss_tol, manifest, manifest_of, run_cli, sample
from ckpt_tools.resume import frameworks as ops
from ckpt_tools.schedules.deepspeed import lr_at as ds_lr_at


# Re-topology tolerance on the loss (absolute, loss ~4.1), against a run made on this machine. The resumed run
# sees the uninterrupted run's global batch and the same fp32 master weights, so what differs is only the order
# of bf16/fp32 sums (TP-split matmuls and all-reduces, gradient accumulation instead of a DP all-reduce):
# measured 0 for DP 2 -> 1 and 1.3e-5 / 1.7e-5 for TP 2 x PP 2 -> 1 x 1. A wrongly merged tensor or a lost
# optimizer state moves the loss by 1e-3 or more.
RETOPOLOGY_LOSS_TOL = 1e-4


def ckpt(*args, expect=0, env=None):
    proc = run_cli(*args, env=env)
    assert proc.returncode == expect, f"exit {proc.returncode} (wanted {expect}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def history(group: str, name: str) -> dict[int, dict]:
    return by_step(manifest(group, name))


def by_step(m: dict) -> dict[int, dict]:
    return {h["step"]: h for h in m["extra"]["history"]}


def checks(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


@pytest.mark.parametrize("name", ["zero2_bf16", "zero2_lambdalr", "zero2_warmuplr"])
def test_same_topology_resume_is_bitwise_continuous(name, fresh_sample, tmp_path):
    """The uninterrupted run (the sample, regenerated now on this machine) and the resume from its step-4
    checkpoint: the same losses bit for bit (same weights, Adam state, LR and batches)."""
    src = fresh_sample(name)
    ref_out = tmp_path / "ref.json"
    doc = json.loads(
        ckpt(
            "resume",
            src,
            "--steps",
            "2",
            "--reference",
            f"{src}.manifest.json",
            "--loss-tol",
            "0",
            "--record-reference",
            ref_out,
            "--json",
        ).stdout
    )
    m = manifest_of(src)
    hist = by_step(m)
    assert m["counters"] == manifest("deepspeed", name)["counters"]  # the same recipe as the committed sample
    assert [r["step"] for r in doc["records"]] == [5, 6]
    for r in doc["records"]:
        assert r["loss"] == hist[r["step"]]["loss"]  # bitwise: two runs on this machine
        assert r["lr"] == pytest.approx(hist[r["step"]]["lr"], rel=1e-12)
        assert r["optimizer_step"] == m["counters"]["optimizer_step"] + r["step"] - 4
    c = checks(doc)
    assert {k: v["status"] for k, v in c.items()} == {
        "global step": "pass",
        "optimizer step": "pass",
        "learning rate": "pass",
        "loss": "pass",
    }
    assert "bitwise equal" in c["loss"]["detail"]
    # the recorded reference reads back as the same step -> loss map
    assert ops.load_reference(ref_out) == {r["step"]: r["loss"] for r in doc["records"]}


#: one sample of every resume planner; the DeepSpeed ones cover both `--model auto` answers
_TORCH_FREE_PLANS = {
    "deepspeed/zero2_lambdalr": "tiny-gpt",
    "deepspeed/zero2_tied_frozen": "replica",
    "universal/zero2_bf16_universal": "tiny-gpt",
    "megatron/gpt_tp2_pp2": "megatron-gpt",
    "fsdp/fsdp2_dcp": "model-free FSDP2 replica (synthetic loss)",
    "accelerate/accelerate_ddp": "model-free replica (synthetic loss)",
    "lightning/onecycle.ckpt": "model-free LightningModule (synthetic loss)",
}


def test_resume_is_planned_in_a_torch_free_ckpt_process():
    """Planning a resume (the model `--model auto` picks, the model-free replica's layout, the device) imports
    no torch in the `ckpt` process: only the launched workers pay for it. torch is made unimportable here."""
    code = (
        "import json, sys; sys.modules['torch'] = None\n"
        "from ckpt_tools.resume.frameworks import plan_resume\n"
        "print(json.dumps({s: plan_resume(f'sample_ckpts/{s}', steps=2, device='cpu').model for s in sys.argv[1:]}))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *_TORCH_FREE_PLANS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == _TORCH_FREE_PLANS


def test_the_torch_free_tiny_gpt_shapes_are_the_models():
    """`--model auto` tells the bundled tiny GPT by `tiny_gpt_shapes`, without torch: the same names, shapes and
    order as `TinyGPT(cfg).named_parameters()`, for the samples' config and another one."""
    from ckpt_tools.train.gpt_config import tiny_gpt_shapes
    from ckpt_tools.train.models import GPTConfig, TinyGPT

    for cfg in (GPTConfig(), GPTConfig(vocab_size=100, seq_len=8, hidden=48, n_layers=3, n_heads=6, ffn_mult=2)):
        want = [(n, tuple(p.shape)) for n, p in TinyGPT(cfg).named_parameters()]
        assert list(tiny_gpt_shapes(cfg).items()) == want


def test_committed_sample_resumes_within_tolerance():
    """The committed sample against its committed manifest (another machine): counters and LR exact, the loss
    within the bf16 tolerance."""
    src = sample("deepspeed", "zero2_lambdalr")
    hist = history("deepspeed", "zero2_lambdalr")
    tol = loss_tol("bfloat16", [h["loss"] for h in hist.values()])
    doc = json.loads(
        ckpt("resume", src, "--steps", "2", "--reference", f"{src}.manifest.json", "--loss-tol", tol, "--json").stdout
    )
    assert all(c["status"] == "pass" for c in doc["checks"]), doc["checks"]
    for r in doc["records"]:
        assert r["lr"] == pytest.approx(hist[r["step"]]["lr"], rel=1e-12)
        assert abs(r["loss"] - hist[r["step"]]["loss"]) <= tol


def _rewrite_model_states(folder: Path, edit) -> None:
    """Apply `edit(model_states_dict)` to every mp_rank_*_model_states.pt of the tag folder (test-only surgery)."""
    for f in sorted(folder.glob("global_step*/mp_rank_*_model_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        edit(sd)
        torch.save(sd, f)


@pytest.mark.slow
def test_dropped_scheduler_state_fails_the_lr_check(copy_sample, capsys):
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    _rewrite_model_states(ck, lambda sd: sd.__setitem__("lr_scheduler", None))
    # one resume, as `ckpt resume CK --steps 2` runs it: its --json document and its human output (the CLI's own
    # renderer, exit 1) both come from this one result
    result = ops.run_resume(ops.plan_resume(ck, steps=2, device="cpu"))
    assert not result.ok  # the CLI's exit 1
    c = checks(json.loads(json.dumps(result.to_dict())))
    assert c["global step"]["status"] == "pass" and c["optimizer step"]["status"] == "pass"
    lr = c["learning rate"]
    assert lr["status"] == "fail" and "NO saved scheduler state" in lr["detail"]
    # Step 5 still runs at the saved param_groups lr; then the fresh LambdaLR restarts its warm-up:
    # lambda(1) = 2/3 of the peak instead of lambda(5) = 0.8**3.
    rows = {r["step"]: r for r in lr["rows"]}
    assert rows[5]["ok"] and not rows[6]["ok"]
    assert rows[6]["expected"] == pytest.approx([0.003 * 0.8**3] * 2)
    assert rows[6]["actual"] == pytest.approx([0.003 * 2 / 3] * 2)
    # and the human output says so
    from ckpt_cli.resume import _render

    _render(result, quiet=False)
    out = capsys.readouterr().out
    assert "FAIL" in out and "learning rate" in out and "NO saved scheduler state" in " ".join(out.split())


@pytest.mark.slow
def test_halved_lr_is_reported_as_expected(copy_sample):
    """After `ckpt set-lr --scale 0.5` on a LambdaLR run (base_lrs, _last_lr, lr and initial_lr halved in the
    scheduler and in every rank's optimizer state): the resumed run uses half the LR and the check agrees.
    Compared with the committed run at the bf16 tolerance, the loss check fails at step 6 (the first loss
    after a halved update): the tolerance catches a real regression, not only a hand-perturbed number."""
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    ckpt("set-lr", ck, "--scale", "0.5", "--yes")
    hist = history("deepspeed", "zero2_lambdalr")
    tol = loss_tol("bfloat16", [h["loss"] for h in hist.values()])
    ref = sample("deepspeed", "zero2_lambdalr").with_name("zero2_lambdalr.manifest.json")
    proc = ckpt("resume", ck, "--steps", "2", "--reference", ref, "--loss-tol", tol, "--json", expect=1)
    doc = json.loads(proc.stdout)
    assert [r["lr"] for r in doc["records"]] == [pytest.approx([x / 2 for x in hist[s]["lr"]]) for s in (5, 6)]
    c = checks(doc)
    assert c["learning rate"]["status"] == "pass"
    assert c["loss"]["status"] == "fail"
    rows = {r["step"]: r for r in c["loss"]["rows"]}
    assert rows[5]["ok"] and not rows[6]["ok"]  # step 5's loss is computed before the first halved update
    moved = abs(rows[6]["actual"] - rows[6]["expected"]) / abs(rows[6]["expected"])
    assert moved > 10 * LOSS_REL_TOL["bfloat16"], moved


@pytest.mark.slow
def test_pipeline_tp2_pp2_resumes_bitwise(fresh_sample):
    src = fresh_sample("gpt_tp2_pp2")
    doc = json.loads(
        ckpt("resume", src, "--steps", "2", "--reference", f"{src}.manifest.json", "--loss-tol", "0", "--json").stdout
    )
    assert doc["plan"]["nproc"] == 4 and doc["setup"]["pipeline"] is True
    hist = by_step(manifest_of(src))
    assert [r["loss"] for r in doc["records"]] == [hist[5]["loss"], hist[6]["loss"]]  # same machine, bitwise
    assert [r["lr"] for r in doc["records"]] == [hist[5]["lr"], hist[6]["lr"]]  # WarmupLR at iterations 3, 4
    assert all(c["status"] == "pass" for c in doc["checks"])


@pytest.mark.slow
def test_dp2_to_dp1_via_universal(fresh_sample, tmp_path):
    """`ckpt to-universal` makes the universal checkpoint; one process then accumulates both original DP
    ranks' micro-batches, so the global batch and the averaged gradient are the uninterrupted run's (made
    on this machine)."""
    src = fresh_sample("zero2_bf16")
    uni = tmp_path / "zero2_universal"
    ckpt("to-universal", src, uni)
    assert (uni / "latest_universal").read_text().strip() == "global_step4_universal"
    doc = json.loads(
        ckpt(
            "resume",
            uni,
            "--steps",
            "2",
            "--nproc",
            "1",
            "--universal",
            "--reference",
            f"{src}.manifest.json",
            "--loss-tol",
            RETOPOLOGY_LOSS_TOL,
            "--json",
        ).stdout
    )
    assert doc["plan"]["dp"] == 1 and doc["plan"]["gas"] == 2
    hist = by_step(manifest_of(src))
    for r in doc["records"]:
        assert abs(r["loss"] - hist[r["step"]]["loss"]) <= RETOPOLOGY_LOSS_TOL
    assert all(c["status"] == "pass" for c in doc["checks"]), doc["checks"]


@pytest.mark.slow
def test_tp2_pp2_to_tp1_pp1_via_universal(fresh_sample):
    """`--tp 1 --pp 1` converts with `ckpt to-universal` (merges driven by the sample's
    universal_checkpoint_info) into a scratch folder and resumes the TP=1 x PP=1 pipeline model."""
    src = fresh_sample("gpt_tp2_pp2")
    doc = json.loads(
        ckpt(
            "resume",
            src,
            "--steps",
            "2",
            "--tp",
            "1",
            "--pp",
            "1",
            "--reference",
            f"{src}.manifest.json",
            "--loss-tol",
            RETOPOLOGY_LOSS_TOL,
            "--json",
        ).stdout
    )
    p = doc["plan"]
    assert (p["nproc"], p["tp"], p["pp"], p["universal"]) == (1, 1, 1, True)
    hist = by_step(manifest_of(src))
    diffs = [abs(r["loss"] - hist[r["step"]]["loss"]) for r in doc["records"]]
    assert max(diffs) <= RETOPOLOGY_LOSS_TOL
    assert all(c["status"] == "pass" for c in doc["checks"]), doc["checks"]


def test_user_factory_and_token_file(tmp_path):
    """`--model module:function` and `--data tokens.npy`: the factory's model trains on the file's tokens
    (so the losses leave the synthetic history), and counters and LR still continue."""
    import os

    import numpy as np

    (tmp_path / "userfac.py").write_text(
        "from ckpt_tools.resume.workers.deepspeed import tiny_gpt\n"
        "def build(ctx):\n"
        "    assert ctx.dp == 2 and ctx.tp == 1\n"
        "    return tiny_gpt(ctx)\n"
    )
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, (np.arange(5000) * 7 % 64).astype(np.uint16))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    doc = json.loads(
        ckpt(
            "resume",
            sample("deepspeed", "zero2_lambdalr"),
            "--steps",
            "1",
            "--model",
            "userfac:build",
            "--data",
            tokens,
            "--json",
            env=env,
        ).stdout
    )
    assert doc["plan"]["model"] == "userfac:build"
    (rec,) = doc["records"]
    assert math.isfinite(rec["loss"]) and rec["loss"] != history("deepspeed", "zero2_lambdalr")[5]["loss"]
    c = checks(doc)
    assert (c["global step"]["status"], c["learning rate"]["status"], c["loss"]["status"]) == ("pass", "pass", "n/a")


def test_unusable_options_exit_2():
    proc = ckpt("resume", sample("deepspeed", "zero2_bf16"), "--nproc", "1", expect=2)
    assert "needs a universal checkpoint" in proc.stderr and "--universal" in proc.stderr
    proc = ckpt("resume", sample("torch", "plain.pt"), expect=2)  # a format no framework resumer takes
    assert "torch_file" in proc.stderr and "Traceback" not in proc.stderr
    proc = ckpt("resume", sample("megatron", "gpt_tp2_pp2_noinfo"), "--tp", "1", expect=2)
    assert "universal_checkpoint_info" in proc.stderr


class _Opt(torch.optim.SGD):
    def __init__(self, lrs):
        super().__init__([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs])


@pytest.mark.parametrize(
    "kind,params",
    [
        ("WarmupLR", {"warmup_min_lr": 3e-4, "warmup_max_lr": 3e-3, "warmup_num_steps": 3, "warmup_type": "linear"}),
        ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}),
        (
            "WarmupDecayLR",
            {
                "total_num_steps": 20,
                "warmup_min_lr": 1e-4,
                "warmup_max_lr": 1e-3,
                "warmup_num_steps": 5,
                "warmup_type": "linear",
            },
        ),
        (
            "WarmupCosineLR",
            {"total_num_steps": 20, "warmup_min_ratio": 0.1, "warmup_num_steps": 5, "cos_min_ratio": 0.05},
        ),
        ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_type": "linear"}),
    ],
)
def test_ds_scheduler_formulas_match_deepspeed(kind, params):
    """Our independent formulas against DeepSpeed's scheduler objects, at every position incl. past the end."""
    from deepspeed.runtime import lr_schedules

    lrs = [2e-3, 1e-3]
    sched = getattr(lr_schedules, kind)(_Opt(lrs), **params)
    for position in range(-1, 25):
        if position >= 0:
            sched.step(position)
        want = [g["lr"] for g in sched.optimizer.param_groups]
        got = ds_lr_at({"type": kind, "params": params}, position, lrs)
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15) for a, b in zip(got, want)), (position, got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the NCCL path needs a GPU")
def test_resume_on_cuda_with_nccl(tmp_path):
    """The same resume on GPUs (NCCL). CUDA kernels differ from the CPU ones the samples were made with, so
    the loss is compared loosely; counters and LR must still be exact."""
    src = sample("deepspeed", "zero2_lambdalr")
    gpus = torch.cuda.device_count()
    args = ["--nproc", "2"] if gpus >= 2 else ["--nproc", "1", "--universal"]
    doc = json.loads(
        ckpt(
            "resume",
            src,
            "--steps",
            "2",
            "--device",
            "cuda",
            *args,
            "--reference",
            f"{src}.manifest.json",
            "--loss-tol",
            "0.02",
            "--json",
        ).stdout
    )
    assert doc["plan"]["device"] == "cuda"
    assert all(c["status"] == "pass" for c in doc["checks"]), doc["checks"]
