"""`set-lr` / `set-step` on checkpoints written the way users write them (HF Trainer, Lightning, the DCP recipe
layout, Accelerate with two models), proven by a real resume in the framework that wrote each one (torchtitan's
own Trainer: tests/test_torchtitan_resume.py).

For every sample: an untouched copy and an edited copy are both resumed by the producer's own loader (the sample
worker's resume mode: `trainer.train(resume_from_checkpoint=)`, `Trainer.fit(ckpt_path=)`, `dcp.load` +
`set_state_dict`, `accelerator.load_state`) in one launch of that worker per sample (conftest.producer_runs: each
run seeded and loaded as in a launch of its own), and every resumed update of the edited copy must use exactly half
the LR of the untouched one; after `set-step --optimizer-step 10`, Adam's step continues from 10 and
the LRs are untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import resume_edit, run_cli, sample

#: (sample, LR keys in the resume records: one per optimizer, what the loader is given inside the sample)
PRODUCERS = [
    ("hf_trainer_ddp", ("lr",), "checkpoint-4"),  # ckpt is given the output_dir and edits its newest checkpoint
    ("hf_trainer_zero2", ("lr",), "checkpoint-4"),
    ("lightning_onecycle", ("lr",), ""),
    ("dcp_recipe_fsdp2", ("lr",), ""),
    ("accelerate_two_models", ("lr", "lr_1"), ""),
]
IDS = [p[0] for p in PRODUCERS]


def where(name: str) -> tuple[str, str]:
    from ckpt_tools.samples import get_spec

    spec = get_spec(name)
    return spec.group, spec.path


def cli(*args, expect=0):
    proc = run_cli(*args)
    assert proc.returncode == expect, f"exit {proc.returncode} (wanted {expect}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def listing(ck: Path) -> list[str]:
    return sorted(p.relative_to(ck).as_posix() for p in ck.rglob("*")) if ck.is_dir() else []


# The edits below are resumed with the untouched copy in one launch of each sample's worker (conftest.producer_runs).


@resume_edit(IDS, "set_lr_half")
def _scale_half(ck: Path) -> dict:
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    return {}


@resume_edit(IDS, "set_optimizer_step_10")
def _optimizer_step_10(ck: Path) -> dict:
    cli("set-step", ck, "--optimizer-step", "10", "--yes")
    return {}


@resume_edit(["lightning_onecycle", "hf_trainer_ddp"], "set_global_step_2")
def _global_step_2(ck: Path) -> dict:
    return {"plan": json.loads(cli("set-step", ck, "--global-step", "2", "--yes", "--json").stdout)["plan"]}


def _halved(recs: list[dict], ref: list[dict], keys: tuple[str, ...]) -> None:
    assert [r["step"] for r in recs] == [r["step"] for r in ref]
    for r, u in zip(recs, ref):
        for k in keys:
            assert r[k] == pytest.approx([x / 2 for x in u[k]], rel=1e-12), (k, r["step"], r[k], u[k])


@pytest.mark.slow
@pytest.mark.parametrize("name,keys,inner", PRODUCERS, ids=IDS)
def test_scale_half_every_resumed_step_runs_at_half_the_lr(producer_runs, name, keys, inner):
    runs = producer_runs(name)
    untouched, ck = runs["untouched"]["records"], Path(runs["set_lr_half"]["ckpt"])
    # no stray file inside the checkpoint (backups and the journal live outside it)
    assert listing(ck) == listing(sample(*where(name)))
    _halved(runs["set_lr_half"]["records"], untouched, keys)
    # inspect agrees with what the resumed run used for its first step
    lr = json.loads(cli("inspect", ck, "--json").stdout)["lr"]
    first = [x for k in keys for x in untouched[0][k]]
    assert lr["param_groups"] == pytest.approx([x / 2 for x in first], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name,keys,inner", PRODUCERS, ids=IDS)
def test_set_optimizer_step_continues_adam_from_it(producer_runs, name, keys, inner):
    runs = producer_runs(name)
    untouched, run = runs["untouched"]["records"], runs["set_optimizer_step_10"]
    assert json.loads(cli("inspect", run["ckpt"], "--json").stdout)["counters"]["optimizer_step"] == 10
    recs = run["records"]
    assert [r["optimizer_step"] for r in recs] == [11, 12]
    for r, u in zip(recs, untouched):
        for k in keys:
            assert r[k] == u[k]  # the counters only: the LRs are the untouched run's


def test_two_optimizers_pick_one(copy_sample):
    """--optimizer 1 edits optimizer_1.bin / scheduler_1.bin only (StepLR: its lr drives); without it both."""
    ck = copy_sample("accelerate", "accelerate_two_models")
    doc = json.loads(cli("set-lr", ck, "--scale", "0.5", "--optimizer", "1", "--dry-run", "--json").stdout)
    files = {w["path"] for w in doc["plan"]["files"]}
    assert files == {"optimizer_1.bin", "scheduler_1.bin"}
    assert [o["scheduler_kind"] for o in doc["plan"]["optimizers"]] == ["chainable"]
    doc = json.loads(cli("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)
    assert [o["scheduler_kind"] for o in doc["plan"]["optimizers"]] == ["closed-form", "chainable"]
    assert {w["path"] for w in doc["plan"]["files"]} == {
        "optimizer.bin",
        "scheduler.bin",
        "optimizer_1.bin",
        "scheduler_1.bin",
    }
    proc = cli("set-lr", ck, "--scale", "0.5", "--optimizer", "2", "--yes", expect=2)
    assert "--optimizer 2" in proc.stderr and "0, 1" in proc.stderr


def test_torchtitan_flattened_groups_all_edited(tmp_path):
    """Every parameter's `optimizer.param_groups.<fqn>.lr` item is edited (torch reads each group's first one),
    in the checkpoint torchtitan 0.3.0's Trainer wrote; --group cannot pick a group that was not saved."""
    import shutil

    src = sample("dcp", "torchtitan_real")
    m = json.loads((src.parent / "torchtitan_real.manifest.json").read_text())
    ck = tmp_path / "step-3"
    shutil.copytree(src / m["extra"]["full_save"], ck)
    doc = json.loads(cli("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)
    fields = [c["field"] for w in doc["plan"]["files"] for c in w["changes"]]
    lr_items = [f for f in fields if f.startswith("optimizer.param_groups.") and f.endswith(".lr")]
    assert len(lr_items) == m["parameters"]["tensors"] == 17  # one per live parameter (wqkv fused)
    assert not any(f.startswith("lr_scheduler.") for f in fields)  # it holds only last_epoch
    proc = cli("set-lr", ck, "--scale", "0.5", "--group", "1", "--yes", expect=2)
    assert "flatten" in proc.stderr


@pytest.mark.parametrize("args", [("set-lr", "--scale", "0.5"), ("set-step", "--optimizer-step", "3")])
def test_nothing_to_edit_is_an_error_not_a_silent_success(tmp_path, args):
    """A file with weights only: the request finds no field, exits 2 naming what was searched, writes nothing."""
    import shutil
    import subprocess
    import sys

    ck = tmp_path / "weights.pt"
    code = "import torch, sys; torch.save({'model': {'w': torch.zeros(3)}, 'note': 'x'}, sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(ck)], check=True)
    before = ck.read_bytes()
    proc = cli(args[0], ck, *args[1:], "--yes", expect=2)
    assert "weights.pt" in proc.stderr and "nothing was changed" in proc.stderr
    assert ck.read_bytes() == before and not (tmp_path / ".ckpt-backups").exists()
    st = tmp_path / "st"
    shutil.copytree(sample("safetensors", "sharded"), st)
    proc = cli(args[0], st, *args[1:], "--yes", expect=2)
    assert "safetensors" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,edited",
    [("lightning_onecycle", "loops.fit_loop."), ("hf_trainer_ddp", "trainer_state.json")],
    ids=["lightning_onecycle", "hf_trainer_ddp"],
)
def test_set_global_step_moves_the_loop(producer_runs, name, edited):
    """`--global-step 2` edits the counter the loop really restores (Lightning's fit-loop progress, not the
    top-level `global_step`; HF's trainer_state.json): the resumed run continues at step 3 up to max_steps 6."""
    run = producer_runs(name)["set_global_step_2"]
    plan = run["info"]["plan"]
    assert any(edited in f"{w['path']}:{c['field']}" for w in plan["files"] for c in w["changes"])
    assert json.loads(cli("inspect", run["ckpt"], "--json").stdout)["counters"]["global_step"] == 2
    recs = run["records"]
    assert [r["step"] for r in recs] == [3, 4, 5, 6]
    assert [r["optimizer_step"] for r in recs] == [5, 6, 7, 8]  # Adam's own count was not touched
