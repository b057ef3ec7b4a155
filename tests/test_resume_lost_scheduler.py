"""A lost scheduler fails the model-free `ckpt resume` (issue 44).

The checkpoint is made here, by real DeepSpeed (ZeRO-2, 2 CPU ranks, gloo): a model class `ckpt` has no recipe
for, defined in this module; a torch AdamW driven by a LambdaLR whose function is a lambda defined here (not
importable by anyone); trained 4 steps, then saved by `engine.save_checkpoint` with the scheduler taken off the
engine, as a training script that forgot to hand it to `deepspeed.initialize` saves it: `lr_scheduler` None,
while every param group still carries the `initial_lr` the LambdaLR wrote. The real run would restart its
schedule; `ckpt resume` must not pass the LR row unless the user says the run had no scheduler.

This file is also the worker: `python -m torch.distributed.run ... tests/test_resume_lost_scheduler.py --out DIR`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
STEPS_BEFORE_SAVE = 4
PEAK_LR = 2e-3


def warmup(step: int) -> float:  # referenced only through the lambda below: the saved state cannot name it
    return min(1.0, (step + 1) / 3) * 0.8 ** max(0, step - 2)


def make_checkpoint(out: Path) -> None:
    """The worker: runs on each rank under torchrun."""
    import torch

    from ckpt_tools.samples.workers import _common as c

    class ForkedRegressor(torch.nn.Module):  # names no recipe of ckpt knows
        def __init__(self) -> None:
            super().__init__()
            self.stem = torch.nn.Linear(6, 10)
            self.left = torch.nn.Linear(10, 4)
            self.right = torch.nn.Linear(10, 4, bias=False)
            self.scale = torch.nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.stem(x))
            return (self.left(h) + self.right(h)) * self.scale

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, dp = c.rank(), c.world_size()
    torch.manual_seed(0)
    model = ForkedRegressor()
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup(step))
    cfg = c.ds_config(2, dp, bf16={"enabled": True})
    engine = c.ds_initialize(model, cfg, optimizer=optimizer, scheduler=scheduler)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS_BEFORE_SAVE):
        x = torch.randn(2, 6, generator=g).to(torch.bfloat16)
        loss = (engine(x).float() - 1.0).pow(2).mean()
        engine.backward(loss)
        engine.step()
    engine.lr_scheduler = None  # the scheduler's state is lost: DeepSpeed saves lr_scheduler None
    engine.save_checkpoint(str(out))
    c.drop_deepspeed_scripts(out)
    c.shutdown()


def ckpt(*args, expect: int) -> subprocess.CompletedProcess:
    from conftest import run_cli  # this file is also the ranks' script: conftest only where tests run

    proc = run_cli(*args, timeout=600)
    assert proc.returncode == expect, f"exit {proc.returncode} (wanted {expect}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def lost(tmp_path_factory) -> Path:
    from ckpt_tools.samples import free_port, stop_process_tree, worker_env

    out = tmp_path_factory.mktemp("lost_scheduler") / "ckpt"
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
        str(HERE),
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            stop_process_tree(proc)
    assert proc.returncode == 0, log[-4000:]
    return out


def checks(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


def test_the_checkpoint_is_what_the_issue_describes(lost):
    """DeepSpeed's own save: ZeRO-2 over 2 ranks, `lr_scheduler` None, every group with `initial_lr`."""
    doc = json.loads(ckpt("inspect", lost, "--json", expect=0).stdout)
    assert doc["format"] == "deepspeed_zero" and doc["topology"]["zero_stage"] == 2 and doc["topology"]["dp"] == 2
    assert "scheduler-state-missing" in [w["code"] for w in doc["warnings"]]
    assert doc["counters"]["global_step"] == STEPS_BEFORE_SAVE and doc["lr"]["base_lrs"] is None
    groups = doc["tree"]["optimizer"]["param_groups"]
    assert all(g["initial_lr"] == PEAK_LR for g in groups.values())


def test_model_free_resume_fails_the_lr_row_and_says_why(lost):
    doc = json.loads(ckpt("resume", lost, "--steps", "2", "--json", expect=1).stdout)
    assert doc["plan"]["model"] == "replica"  # ckpt does not know the model: the model-free path
    c = checks(doc)
    assert (c["global step"]["status"], c["optimizer step"]["status"], c["optimizer state"]["status"]) == (
        "pass",
        "pass",
        "pass",
    )
    lr = c["learning rate"]
    assert lr["status"] == "fail"
    assert "initial_lr" in lr["detail"] and "no scheduler state" in lr["detail"] and "--no-scheduler" in lr["detail"]
    assert len(lr["rows"]) == 2 and not any(r["ok"] for r in lr["rows"])
    assert any("--no-scheduler" in n for n in doc["plan"]["notes"])  # said before the launch too


def test_no_scheduler_states_the_run_had_none(lost):
    doc = json.loads(ckpt("resume", lost, "--steps", "2", "--no-scheduler", "--json", expect=0).stdout)
    lr = checks(doc)["learning rate"]
    assert lr["status"] == "pass" and "no scheduler" in lr["detail"]
    saved_lr = doc["plan"]["saved"]["param_group_lrs"]
    assert [r["actual"] for r in lr["rows"]] == [saved_lr, saved_lr]


def test_no_scheduler_is_refused_where_a_scheduler_was_saved():
    from conftest import sample

    proc = ckpt("resume", sample("deepspeed", "zero2_lambdalr"), "--steps", "1", "--no-scheduler", expect=2)
    (line,) = proc.stderr.strip().splitlines()
    assert "--no-scheduler" in line and "holds scheduler state" in line


if __name__ == "__main__":
    make_checkpoint(Path(sys.argv[sys.argv.index("--out") + 1]))
