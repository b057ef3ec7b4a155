"""`ckpt resume` for HF Trainer, Accelerate, torch DCP / FSDP2 and Lightning checkpoints, in their own frameworks.

Every resume here is real: the framework's own loader under torchrun on CPU/gloo (2 ranks where the sample was
sharded) loading the committed samples or copies of them edited with torch in tmp_path. Negative copies are ones
a framework really resumes wrongly or incompletely (HF Trainer skips optimizer AND scheduler when scheduler.pt is
missing; an emptied optimizer state restarts Adam; a dropped scheduler state restarts the schedule).
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from conftest import manifest, run_cli, sample

from ckpt_tools import open_checkpoint
from ckpt_tools.errors import CkptError
from ckpt_tools.resume import frameworks as rf
from ckpt_tools.resume.framework_run import _custom_state
from ckpt_tools.resume.hf_trainer import hf_lambda
from ckpt_tools.resume.torch_schedules import torch_expected_lrs, torch_scheduler_kind

ROWS = ("global step", "optimizer step", "learning rate", "optimizer state", "loss")


def resume(path, steps=2, **kw):
    ck = open_checkpoint(path)
    plan = rf.plan_resume(ck, path, steps=steps, device="cpu", **kw)
    return plan, rf.run_resume(plan)


def by_name(result) -> dict:
    return {c.name: c for c in result.checks}


def assert_all_pass(result, *, na=()):
    checks = by_name(result)
    for name in ROWS:
        assert name in checks, name
    for c in result.checks:
        want = "n/a" if c.name in na else "pass"
        assert c.status == want, (c.name, c.status, c.detail)
    assert result.ok


def cli_json(*args) -> tuple[int, dict]:
    proc = run_cli("resume", *args, "--device", "cpu", "--json")
    assert proc.returncode in (0, 1, 2), proc.stderr[-2000:]

    def strict(name):  # --json output must be strict JSON (no Infinity / NaN)
        raise AssertionError(f"non-JSON constant {name} in --json output")

    doc = json.loads(proc.stdout, parse_constant=strict) if proc.returncode in (0, 1) else {"stderr": proc.stderr}
    return proc.returncode, doc


# --- the schedules computed without the frameworks ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts"])
def test_hf_schedule_formula_matches_transformers(kind):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(kind, opt, num_warmup_steps=3, num_training_steps=11)
    for step in range(12):
        want = opt.param_groups[0]["lr"]
        got = hf_lambda(kind, step, warmup=3, total=11, kwargs={})
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (kind, step)
        opt.step()
        sched.step()


def test_torch_schedules_chained_from_saved_state():
    """Each formula against the real torch scheduler, continued from a state dict saved mid-run."""
    S = torch.optim.lr_scheduler
    makers = {
        "StepLR": lambda o: S.StepLR(o, step_size=3, gamma=0.5),
        "MultiStepLR": lambda o: S.MultiStepLR(o, milestones=[2, 5, 5, 7], gamma=0.3),
        "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.9),
        "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=4, eta_min=1e-4),
        "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=[3e-3, 1e-3], total_steps=12, pct_start=0.3),
    }
    for name, make in makers.items():
        opt = torch.optim.AdamW(
            [
                {"params": [torch.nn.Parameter(torch.zeros(1))]},
                {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 5e-4},
            ],
            lr=1e-3,
        )
        sched = make(opt)
        for _ in range(4):
            opt.step()
            sched.step()
        state = json.loads(json.dumps(sched.state_dict(), default=list))
        groups = [dict(g, params=[]) for g in opt.state_dict()["param_groups"]]
        assert torch_scheduler_kind(state) == name
        rows, _ = torch_expected_lrs(state, groups, 6)
        for k in range(6):
            assert rows[k] == pytest.approx([g["lr"] for g in opt.param_groups], rel=1e-9), (name, k)
            opt.step()
            sched.step()


# --- HF Trainer --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["hf_trainer_ddp", "hf_trainer_zero2"])
def test_hf_trainer_resume_continues(name):
    """checkpoint-2 resumed by trainer.train(resume_from_checkpoint=...) with the model from config.json: every
    row passes, the loss against checkpoint-4's log_history of the same run."""
    plan, result = resume(sample("hf_trainer", name) / "checkpoint-2")
    assert plan.nproc == 2 and "config.json" in plan.model
    assert sorted(plan.loss_reference) == [3, 4]
    assert_all_pass(result)
    assert [r.step for r in result.records] == [3, 4]
    # the resumed LRs are the uninterrupted run's (manifest history, recorded live when the sample was made)
    hist = {h["step"]: h["lr"] for h in manifest("hf_trainer", name)["extra"]["history"]}
    for r in result.records:
        assert list(r.lr) == pytest.approx(hist[r.step], rel=1e-9)


def test_hf_trainer_without_scheduler_pt_fails(tmp_path):
    """Without scheduler.pt the Trainer silently loads neither scheduler nor optimizer: the LR restarts its
    warm-up and Adam restarts, while the loop counter continues. Exit 1 through the CLI."""
    out = tmp_path / "hf_trainer_ddp"
    shutil.copytree(sample("hf_trainer", "hf_trainer_ddp"), out)
    (out / "checkpoint-4" / "scheduler.pt").unlink()
    rc, doc = cli_json(out / "checkpoint-4", "--steps", "2")
    assert rc == 1, doc
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["global step"] == "pass"
    assert status["learning rate"] == "fail"
    assert status["optimizer step"] == "fail"
    assert status["optimizer state"] == "fail"
    assert any("no scheduler state" in n for n in doc["plan"]["notes"])


# --- Accelerate --------------------------------------------------------------------------------------------------


def test_accelerate_ddp_resume_with_scheduler_function():
    """load_state into a model-free replica; with the LambdaLR's function named (--scheduler) every resumed LR is
    checked, 2 scheduler steps per update (Accelerate steps it once per process). Through the CLI."""
    rc, doc = cli_json(
        sample("accelerate", "accelerate_ddp"),
        "--steps",
        "2",
        "--scheduler",
        "ckpt_tools.samples.workers._common:lr_factor",
    )
    assert rc == 0, doc
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["learning rate"]["status"] == "pass" and len(checks["learning rate"]["rows"]) == 2
    assert checks["optimizer state"]["status"] == "pass"
    assert checks["custom state"]["status"] == "pass"
    assert checks["global step"]["status"] == "n/a"  # Accelerate DDP keeps no loop counter
    hist = {h["step"]: h["lr"] for h in manifest("accelerate", "accelerate_ddp")["extra"]["history"]}
    assert [r["lr"] for r in doc["records"]] == [pytest.approx(hist[5]), pytest.approx(hist[6])]


@pytest.mark.parametrize("name", ["accelerate_deepspeed", "accelerate_two_models"])
def test_accelerate_resume_continues(name):
    plan, result = resume(sample("accelerate", name))
    na = ("loss",) + (("global step",) if name == "accelerate_two_models" else ())
    assert_all_pass(result, na=na)
    checks = by_name(result)
    assert checks["scheduler state"].status == "pass" and checks["custom state"].status == "pass"
    if name == "accelerate_two_models":
        assert len(plan.worker["models"]) == 2 and len(result.records[0].lr) == 4


def test_accelerate_stray_custom_checkpoint_orig(tmp_path, monkeypatch):
    """A stray custom_checkpoint_0.pkl.orig: this Accelerate matches ^custom_checkpoint_N.pkl$ and restores the
    object (pass, with the warning in the note and the row); an Accelerate that counts any such file would not
    restore it, and the verdict fails the custom-state row."""
    ck = tmp_path / "accelerate_ddp"
    shutil.copytree(sample("accelerate", "accelerate_ddp"), ck)
    shutil.copy2(ck / "custom_checkpoint_0.pkl", ck / "custom_checkpoint_0.pkl.orig")
    plan, result = resume(ck)
    assert any("custom_checkpoint_0.pkl.orig" in n for n in plan.notes)
    custom = by_name(result)["custom state"]
    assert custom.status == "pass" and "WARNING stray custom_checkpoint_0.pkl.orig" in custom.detail
    assert result.ok
    # the same folder judged for an Accelerate whose load_state counts loosely (older versions)
    monkeypatch.setattr(rf, "_installed_accelerate_counts_loosely", lambda: True)
    loose = rf.plan_resume(open_checkpoint(ck), ck, steps=2, device="cpu")
    assert loose.worker["stray_effect"] == "fail"
    row = _custom_state(loose, result.loaded)
    assert row.status == "fail" and "does not restore" in row.detail


def test_accelerate_emptied_optimizer_state_fails(tmp_path):
    """optimizer.bin with its per-parameter state removed (torch, in tmp_path): Accelerate loads it, Adam restarts at
    step 1; the optimizer rows fail, the LR still passes. Exit 1."""
    ck = tmp_path / "accelerate_ddp"
    shutil.copytree(sample("accelerate", "accelerate_ddp"), ck)
    osd = torch.load(ck / "optimizer.bin", weights_only=True)
    osd["state"] = {}
    torch.save(osd, ck / "optimizer.bin")
    rc, doc = cli_json(ck, "--steps", "2")
    assert rc == 1, doc
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["optimizer state"] == "fail" and status["learning rate"] == "pass"
    assert status["scheduler state"] == "pass"


# --- torch DCP / FSDP2 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group,name", [("fsdp", "fsdp2_dcp"), ("dcp", "dcp_recipe_fsdp2")])
def test_dcp_resume_continues(group, name):
    """dcp.load into a fully_shard replica on 2 gloo ranks, in each layout's key names."""
    plan, result = resume(sample(group, name))
    assert plan.nproc == 2
    assert_all_pass(result, na=("loss",))
    assert by_name(result)["scheduler state"].status == "pass"
    hist = {h["step"]: h["lr"] for h in manifest(group, name)["extra"]["history"]}
    checked = [row for row in by_name(result)["learning rate"].rows]
    assert checked and all(row.actual == pytest.approx(hist[row.step], rel=1e-9) for row in checked)


def test_real_torchtitan_resume_passes_with_n_kv_heads():
    """torchtitan 0.3.0's own full save (flat model keys, flattened optimizer, lr_scheduler {last_epoch}, a fused
    wqkv whose weights are saved split): without --n-kv-heads exit 2 naming it; with it, the replica loads the split
    weights into the fused parameter, and every check passes: the step and the Adam step continue, the scheduler
    position is the saved one, the first update's LR is the saved lr (what torchtitan resumes with: the later ones
    come from its job config, not determined by the checkpoint), the Adam state continues in closed form."""
    path = sample("dcp", "torchtitan_real") / "step-3"
    rc, doc = cli_json(path, "--steps", "2")
    assert rc == 2 and "--n-kv-heads" in doc["stderr"], doc
    rc, doc = cli_json(path, "--steps", "2", "--n-kv-heads", "3")
    assert rc == 2 and "--n-kv-heads 3" in doc["stderr"], doc
    rc, doc = cli_json(path, "--steps", "2", "--n-kv-heads", "4")
    assert rc == 0, doc
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status == {
        "global step": "pass",
        "optimizer step": "pass",
        "learning rate": "pass",
        "scheduler state": "pass",
        "optimizer state": "pass",
        "loss": "n/a",
    }, doc["checks"]
    history = {
        h["step"]: h["lr"]
        for h in json.loads((path.parent.parent / "torchtitan_real.manifest.json").read_text())["extra"]["history"]
    }
    lr = next(c for c in doc["checks"] if c["name"] == "learning rate")
    assert [r["step"] for r in lr["rows"]] == [4] and lr["rows"][0]["actual"] == pytest.approx(history[4], rel=1e-12)
    assert "job config" in lr["detail"] and "1 later update(s) not determined" in lr["detail"]


def test_n_kv_heads_on_a_checkpoint_without_a_fused_parameter_is_refused():
    """--n-kv-heads orders a fused state saved beside split weights; given for a checkpoint without one it is an
    error naming the option, not silently ignored."""
    rc, doc = cli_json(sample("dcp", "dcp_recipe_fsdp2"), "--steps", "1", "--n-kv-heads", "4")
    assert rc == 2 and "drop --n-kv-heads" in doc["stderr"], doc


def test_dcp_without_scheduler_state_fails(tmp_path):
    """The recipe sample re-saved without its scheduler (torch's own dcp_to_torch_save / torch_save_to_dcp): the
    param groups still carry initial_lr, so the LR row fails. Exit 1."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    flat = tmp_path / "full.pt"
    dcp_to_torch_save(sample("dcp", "dcp_recipe_fsdp2"), flat)
    state = torch.load(flat, weights_only=False)
    del state["app"]["scheduler"]
    torch.save(state, flat)
    out = tmp_path / "no_sched"
    torch_save_to_dcp(flat, out)
    rc, doc = cli_json(out, "--steps", "2")
    assert rc == 1, doc
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["learning rate"] == "fail" and status["optimizer state"] == "pass"


# --- Lightning ---------------------------------------------------------------------------------------------------


def test_lightning_resume_continues():
    """Trainer.fit(ckpt_path=...) with a LightningModule built from the checkpoint: AdamW and OneCycleLR rebuilt
    out of the saved state; the OneCycleLR LRs match the uninterrupted run's."""
    path = sample("lightning", "onecycle.ckpt")
    plan, result = resume(path)
    assert plan.worker["models"][0]["optimizer_kind"] == "adamw"
    assert plan.worker["models"][0]["scheduler_kind"] == "OneCycleLR"
    assert_all_pass(result, na=("loss",))
    hist = {h["step"]: h["lr"] for h in manifest("lightning", "onecycle.ckpt")["extra"]["history"]}
    for r in result.records:
        assert list(r.lr) == pytest.approx(hist[r.step], rel=1e-9)


def test_lightning_dropped_scheduler_fails(tmp_path):
    """lr_schedulers emptied (torch, in tmp_path): Lightning restores nothing for the schedule; the LR row fails."""
    ck = tmp_path / "onecycle.ckpt"
    state = torch.load(sample("lightning", "onecycle.ckpt"), weights_only=False)
    state["lr_schedulers"] = []
    torch.save(state, ck)
    rc, doc = cli_json(ck, "--steps", "2")
    assert rc == 1, doc
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert status["learning rate"] == "fail" and "OneCycleLR" in next(
        c["detail"] for c in doc["checks"] if c["name"] == "learning rate"
    )
    assert status["optimizer state"] == "pass" and status["global step"] == "pass"


# --- errors ------------------------------------------------------------------------------------------------------


def test_bad_options_are_one_line_errors():
    ck = open_checkpoint(sample("hf_trainer", "hf_trainer_zero2"))
    with pytest.raises(CkptError, match="--nproc 1"):
        rf.plan_resume(ck, sample("hf_trainer", "hf_trainer_zero2"), steps=2, nproc=1, device="cpu")
    ck = open_checkpoint(sample("accelerate", "accelerate_ddp"))
    with pytest.raises(CkptError, match="--scheduler"):
        rf.plan_resume(ck, sample("accelerate", "accelerate_ddp"), steps=2, device="cpu", scheduler="nocolon")


def test_hf_model_not_matching_is_refused_before_launch(tmp_path):
    """A config.json that does not describe the saved weights: one line, exit 2, before any process starts."""
    out = tmp_path / "hf_trainer_ddp"
    shutil.copytree(sample("hf_trainer", "hf_trainer_ddp"), out)
    cfg = out / "checkpoint-4" / "config.json"
    doc = json.loads(cfg.read_text())
    doc["n_layer"] += 1
    cfg.write_text(json.dumps(doc))
    proc = run_cli("resume", out / "checkpoint-4", "--steps", "2", "--device", "cpu")
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    assert "missing transformer.h.2." in lines[0] and "Traceback" not in proc.stderr


def test_failing_worker_shows_its_own_error_line(tmp_path):
    """A user's LambdaLR function (--scheduler) that raises inside the training processes: the user sees that
    exception's line, exit 2, not torchrun's ChildFailedError traceback."""
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "user_sched.py").write_text(
        "def factor(epoch):\n"
        "    if epoch == 0:\n"
        "        raise ValueError('factor() is undefined at epoch 0')\n"
        "    return 0.5\n"
    )
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{ROOT}")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from ckpt_cli.main import main; main()",
            "resume",
            str(sample("accelerate", "accelerate_ddp")),
            "--steps",
            "1",
            "--device",
            "cpu",
            "--scheduler",
            "user_sched:factor",
            "-q",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip() and "%|" not in x]
    assert re.fullmatch(
        r"ckpt: error: rank \d: ValueError: factor\(\) is undefined at epoch 0 "
        r"\(the full output is in \S+ckpt-resume-\w+\.log\)",
        lines[-1],
    ), proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr


class Progress:
    """A user's custom checkpoint object: torch.save pickles it by its class name, which ckpt does not know."""

    def __init__(self) -> None:
        self.steps = 4


def test_untrusted_custom_pickle_is_refused(tmp_path):
    """Accelerate's load_state unpickles custom_checkpoint_N.pkl with the full loader: a pickle naming an unknown
    class is refused before launch (exit 2) unless --trust-pickles."""
    ck = tmp_path / "accelerate_ddp"
    shutil.copytree(sample("accelerate", "accelerate_ddp"), ck)
    torch.save(Progress(), ck / "custom_checkpoint_0.pkl")
    proc = run_cli("resume", ck, "--steps", "1", "--device", "cpu")
    assert proc.returncode == 2
    assert "custom_checkpoint_0.pkl: test_resume_frameworks.Progress" in proc.stderr, proc.stderr
    assert "not a class real checkpoints carry" in proc.stderr
    assert "--trust-pickles" in proc.stderr
