"""`ckpt set-lr` / `set-step` / `restore` on the real samples, checked by resuming in the real framework.

After the surgery each checkpoint is loaded by the library that wrote it (DeepSpeed through `ckpt resume`,
Accelerate through `accelerator.load_state` under torchrun, plain torch through `load_state_dict`), trained
for two steps, and the LR each update used is compared with the new trajectory: the uninterrupted run's LR
(manifest `extra.history`) times the scale.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from conftest import fail_at, ROOT, manifest, run_cli, sample
from ckpt_tools.write import io
from ckpt_tools import open_checkpoint
from ckpt_tools.errors import CkptError
from ckpt_tools.ops import lr as ops


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` (or the file itself) -> sha256: byte-identical means equal snapshots."""
    files = [folder] if folder.is_file() else sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def history(group: str, name: str) -> dict[int, list[float]]:
    return {h["step"]: h["lr"] for h in manifest(group, name)["extra"]["history"]}


def cli(*args, expect=0):
    proc = run_cli(*args)
    assert proc.returncode == expect, f"exit {proc.returncode} (wanted {expect}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def ds_resume(path: Path, *extra) -> dict:
    return json.loads(cli("resume", path, "--steps", "2", "--json", *extra).stdout)


# --- resume scripts for Accelerate and plain torch (the samples' own recipe, loaded by the real library) -----

ACCEL_RESUME = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from ckpt_tools.samples.workers import _common as c, accel

    sample, ckpt, out, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    accelerator = accel.make_accelerator(sample)
    model = c.build_model()
    optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
    progress = accel.TrainProgress()
    accelerator.register_for_checkpointing(progress)
    wrapped, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.load_state(ckpt)
    records = []
    for _ in range(steps):
        step = progress.steps
        lrs = c.current_lrs(optimizer)
        loss = c.lm_loss(wrapped, c.tokens_for_step(step, accelerator.process_index))
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(wrapped.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.update(c.MICRO_BATCH * accelerator.num_processes)
        records.append({"step": step + 1, "lr": lrs, "optimizer_step": c.adam_step(optimizer),
                        "last_epoch": scheduler.scheduler.last_epoch})
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps(records))
    c.shutdown()
""")


def accel_resume(tmp_path: Path, name: str, ckpt: Path, steps: int = 2) -> list[dict]:
    from ckpt_tools.samples import free_port, worker_env

    script, out = tmp_path / "accel_resume.py", tmp_path / "records.json"
    script.write_text(ACCEL_RESUME)
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
        name,
        str(ckpt),
        str(out),
        str(steps),
    ]
    proc = subprocess.run(cmd, env=worker_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def plain_resume(path: Path, steps: int = 2) -> list[dict]:
    """torch.load + load_state_dict into the sample's own model / AdamW / LambdaLR, then train `steps` updates."""
    import argparse

    import torch

    from ckpt_tools.samples.workers import _common as c

    with torch.serialization.safe_globals([argparse.Namespace]):
        sd = torch.load(path, weights_only=True)
    model = c.build_model()
    optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
    model.load_state_dict(sd["model"])
    optimizer.load_state_dict(sd["optimizer"])
    scheduler.load_state_dict(sd["scheduler"])
    records = []
    for step in range(sd["step"], sd["step"] + steps):
        lrs = c.current_lrs(optimizer)
        model.loss(c.tokens_for_step(step, 0)).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        records.append({"step": step + 1, "lr": lrs, "optimizer_step": c.adam_step(optimizer)})
    return records


def halved(group: str, name: str, steps=(5, 6)) -> list:
    hist = history(group, name)
    return [pytest.approx([x / 2 for x in hist[s]], rel=1e-12) for s in steps]


# --- set-lr: the new trajectory, in the real frameworks ------------------------------------------------------


def test_deepspeed_lambdalr_base_lr_resumes_on_the_new_trajectory(copy_sample):
    """`--lr 1.5e-3` on a 3e-3 LambdaLR run halves the trajectory (`--scale 0.5` is tests/test_resume.py's)."""
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    cli("set-lr", ck, "--lr", "1.5e-3", "--yes")
    doc = ds_resume(ck)
    assert [r["lr"] for r in doc["records"]] == halved("deepspeed", "zero2_lambdalr")
    assert [r["optimizer_step"] for r in doc["records"]] == [5, 6]
    assert {c["name"]: c["status"] for c in doc["checks"]}["learning rate"] == "pass"


def test_deepspeed_warmuplr_needs_the_printed_launch_config_change(copy_sample, tmp_path):
    """WarmupLR's LRs come from the launch config: the plan prints the change; the edited optimizer lr makes
    the first resumed update right, the config change every later one."""
    ck = copy_sample("deepspeed", "zero2_warmuplr")
    plan = json.loads(cli("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)["plan"]
    change = plan["launch_config_change"]
    assert change == {
        "scheduler": {"params": {"warmup_min_lr": pytest.approx(1.5e-4), "warmup_max_lr": 0.0015}},
        "optimizer": {"params": {"lr": 0.0015}},
    }
    assert plan["scheduler_kind"] == "deepspeed" and "launch config" in plan["lr_driven_by"]
    assert any("LAUNCH config" in n and "warmup_max_lr" in n for n in plan["notes"])
    notes = {c["field"]: c["note"] for f in plan["files"] for c in f["changes"]}
    assert "first resumed update" in notes["optimizer_state_dict.base_optimizer_state.param_groups.0.lr"]
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    (tmp_path / "launch_change.json").write_text(json.dumps(change))
    doc = ds_resume(ck, "--config", tmp_path / "launch_change.json")
    assert [r["lr"] for r in doc["records"]] == halved("deepspeed", "zero2_warmuplr")
    assert {c["name"]: c["status"] for c in doc["checks"]}["learning rate"] == "pass"


def test_accelerate_ddp_scale_half(copy_sample, tmp_path):
    ck = copy_sample("accelerate", "accelerate_ddp")
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    recs = accel_resume(tmp_path, "accelerate_ddp", ck)
    assert [r["lr"] for r in recs] == halved("accelerate", "accelerate_ddp")
    assert [r["optimizer_step"] for r in recs] == [5, 6]
    assert [r["last_epoch"] for r in recs] == [10, 12]  # Accelerate: 2 processes step the scheduler twice


def test_accelerate_deepspeed_scale_half(copy_sample, tmp_path):
    ck = copy_sample("accelerate", "accelerate_deepspeed")
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    recs = accel_resume(tmp_path, "accelerate_deepspeed", ck)
    assert [r["lr"] for r in recs] == halved("accelerate", "accelerate_deepspeed")
    assert [r["optimizer_step"] for r in recs] == [5, 6]


def test_plain_torch_scale_half_and_lr(copy_sample):
    ck = copy_sample("torch", "plain.pt")
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    assert [r["lr"] for r in plain_resume(ck)] == halved("torch", "plain.pt")
    # --lr sets the base LR: 0.003 -> 0.0006 is another factor 0.2 on top of the halving
    cli("set-lr", ck, "--lr", "6e-4", "--yes")
    hist = history("torch", "plain.pt")
    assert [r["lr"] for r in plain_resume(ck)] == [pytest.approx([x * 0.2 for x in hist[s]], rel=1e-12) for s in (5, 6)]
    ckpt = open_checkpoint(ck)
    assert ckpt.lr.base_lrs == pytest.approx((6e-4, 6e-4)) and ckpt.lr.param_groups == pytest.approx(
        (hist[5][0] * 0.2,) * 2
    )


def test_group_and_last_lr_and_position(copy_sample):
    ck = copy_sample("torch", "plain.pt")
    cli("set-lr", ck, "--scale", "0.5", "--group", "1", "--yes")
    c = open_checkpoint(ck)
    assert c.lr.base_lrs == pytest.approx((0.003, 0.0015))
    # --last-epoch moves the position on the LambdaLR: last_epoch 2 -> the next updates use f(2), f(3)
    cli("set-lr", ck, "--last-epoch", "2", "--step-count", "3", "--last-lr", "1e-3", "--yes")
    recs = plain_resume(ck)
    from ckpt_tools.samples.workers._common import lr_factor

    assert recs[0]["lr"] == pytest.approx([1e-3, 1e-3])  # the optimizer lr: used once
    assert recs[1]["lr"] == pytest.approx([0.003 * lr_factor(3), 0.0015 * lr_factor(3)])
    cli("set-lr", ck, "--group", "2", "--scale", "2", expect=2)


# --- set-step ---------------------------------------------------------------------------------------------


def test_deepspeed_set_optimizer_step_resumes_from_it(copy_sample):
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    cli("set-step", ck, "--optimizer-step", "1497", "--global-step", "1497", "--yes")
    c = open_checkpoint(ck)
    assert c.counters.optimizer_step == 1497 and c.counters.global_step == 1497
    doc = ds_resume(ck)
    assert [r["optimizer_step"] for r in doc["records"]] == [1498, 1499]  # Adam's live step, in DeepSpeed
    assert {c["name"]: c["status"] for c in doc["checks"]}["optimizer step"] == "pass"


def test_plain_set_step_and_coherent_step(copy_sample):
    ck = copy_sample("torch", "plain.pt")
    cli("set-step", ck, "--optimizer-step", "10", "--yes")
    assert [r["optimizer_step"] for r in plain_resume(ck)] == [11, 12]
    cli("set-step", ck, "--step", "7", "--yes")
    c = open_checkpoint(ck)
    assert (
        c.counters.global_step,
        c.counters.optimizer_step,
        c.counters.scheduler_last_epoch,
        c.counters.scheduler_step_count,
    ) == (7, 7, 7, 8)
    assert not [w for w in c.warnings if w.code in ("step-mismatch", "scheduler-mismatch")]


def test_accelerate_step_keeps_world_size_relation():
    lp = ops.plan_set_step(open_checkpoint(sample("accelerate", "accelerate_ddp")), step=6)
    got = {(c.file, c.field): c.new for c in lp.plan.changes}
    assert got[("scheduler.bin", "last_epoch")] == 12 and got[("scheduler.bin", "_step_count")] == 13
    assert got[("optimizer.bin", "state.0.step")] == 6.0
    assert any("2 x optimizer step" in n for n in lp.plan.notes)


# --- the write path: atomic, verified, undoable -----------------------------------------------------------


@pytest.mark.parametrize("stage,nth", [("produce", 2), ("replace", 2), ("verify", 1)])
def test_failed_write_leaves_checkpoint_byte_identical(copy_sample, stage, nth):
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    before = snapshot(ck)
    with pytest.raises(io.WriteFailed, match="injected failure"):
        ops.set_lr(ck, scale=0.5, on_stage=fail_at(stage, nth))
    assert snapshot(ck) == before  # same files, same bytes: nothing added, nothing left behind
    assert all(t.status == "rolled-back" for t in io.transactions(ck))


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
def test_restore_brings_back_the_original_byte_for_byte(copy_sample, tmp_path, copy):
    """In place (default) the journal's undo records are the backup; with --copy each original is kept whole
    (a hard link) in the backup folder. Either way restore gives back the original bytes."""
    ck = copy_sample("accelerate", "accelerate_deepspeed")
    before = snapshot(ck)
    cli("set-lr", ck, "--scale", "0.25", "--yes", "--backup-dir", tmp_path / "bk", *(["--copy"] if copy else []))
    assert snapshot(ck) != before and set(snapshot(ck)) == set(before)
    (journal,) = (tmp_path / "bk").rglob("journal.json")
    entry = {e["path"]: e for e in json.loads(journal.read_text())["files"]}["scheduler.bin"]
    if copy:
        assert entry["mode"] == "replace" and any((tmp_path / "bk").rglob("scheduler.bin"))
    else:
        assert entry["mode"] == "in-place" and (journal.parent / entry["undo"]).is_file()
        assert not any((tmp_path / "bk").rglob("scheduler.bin"))  # no whole copy: only the changed ranges
        assert entry["written_bytes"] < entry["size"] and entry["undo_bytes"] < entry["size"]
    out = cli("restore", ck, "--yes").stdout
    assert "restored 3 files" in out
    assert snapshot(ck) == before
    cli("restore", ck, "--yes", expect=2)  # nothing left to undo


def test_restore_walks_back_one_write_at_a_time_and_lists_them(copy_sample):
    """Two writes (set-lr, then set-step): `restore --list` names both, newest first, and which one the next
    `restore` undoes; two restores give back the original bytes; `--list` itself changes nothing."""
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    before = snapshot(ck)

    def writes() -> list[dict]:
        return json.loads(cli("restore", ck, "--list", "--json").stdout)["writes"]

    assert writes() == []
    cli("set-lr", ck, "--scale", "0.5", "--yes")
    after_lr = snapshot(ck)
    cli("set-step", ck, "--optimizer-step", "100", "--yes")
    listed = writes()
    assert [(w["command"], w["status"], w["next_to_undo"]) for w in listed] == [
        ("set-step", "done", True),
        ("set-lr", "done", False),
    ]
    assert len(listed[0]["files"]) == 2 and len(listed[1]["files"]) == 3
    human = cli("restore", ck, "--list").stdout
    assert "set-step" in human and "<- next `ckpt restore`" in human and human.index("set-step") < human.index("set-lr")
    assert snapshot(ck) != after_lr  # the set-step write is still there: --list restored nothing

    cli("restore", ck, "--yes")
    assert snapshot(ck) == after_lr
    assert [(w["status"], w["next_to_undo"]) for w in writes()] == [("restored", False), ("done", True)]
    cli("restore", ck, "--yes")
    assert snapshot(ck) == before
    assert not any(w["next_to_undo"] for w in writes())
    cli("restore", ck, "--yes", expect=2)


def test_optimizer_files_are_pickle_only_rewrites(copy_sample):
    """Every tensor member of the rewritten ZeRO files is the original's, byte for byte; only data.pkl differs
    (and, for set-step, the 4-byte step storages). Runs without importing deepspeed."""
    ck = copy_sample("deepspeed", "zero2_bf16")
    files = sorted(ck.glob("global_step*/*optim_states.pt"))
    orig = {f: {i.filename: zipfile.ZipFile(f).read(i) for i in zipfile.ZipFile(f).infolist()} for f in files}
    code = (
        "import sys; from ckpt_tools.ops import lr; lr.set_lr(sys.argv[1], scale=0.5); "
        "lr.set_step(sys.argv[1], optimizer_step=9); print('deepspeed' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(ck)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
    for f in files:
        new = {i.filename: zipfile.ZipFile(f).read(i) for i in zipfile.ZipFile(f).infolist()}
        assert list(new) == list(orig[f])
        changed = [n for n in new if new[n] != orig[f][n]]
        pkl = [n for n in changed if n.endswith("data.pkl")]
        assert len(pkl) == 1
        assert sorted(len(new[n]) for n in changed if n not in pkl) == [4, 4]  # the 2 float32 step storages only
    c = open_checkpoint(ck)
    assert c.counters.optimizer_step == 9 and c.lr.param_groups == pytest.approx((0.0015, 0.0015))


def test_dry_run_writes_nothing_and_json_plan(copy_sample):
    ck = copy_sample("deepspeed", "zero2_lambdalr")
    before = snapshot(ck)
    out = cli("set-lr", ck, "--scale", "0.5", "--dry-run").stdout
    assert "DRIVES the LR" in out and "dry run: nothing written" in out and "base_lrs" in out
    doc = json.loads(cli("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)
    fields = {(f["path"], c["field"]) for f in doc["plan"]["files"] for c in f["changes"]}
    assert ("global_step4/mp_rank_00_model_states.pt", "lr_scheduler.base_lrs") in fields
    assert len([x for x in fields if x[1].endswith(".lr")]) == 4  # 2 ranks x 2 groups
    assert snapshot(ck) == before and not (ck.parent / ".ckpt-backups").exists()
    cli("set-lr", ck, "--scale", "0.5", "--json", expect=2)  # --json cannot prompt


def test_unsupported_inputs_exit_2(tmp_path):
    import torch

    legacy = tmp_path / "legacy.pt"
    torch.save(
        {"scheduler": {"base_lrs": [1.0], "last_epoch": 1, "lr_lambdas": [None]}},
        legacy,
        _use_new_zipfile_serialization=False,
    )
    proc = cli("set-lr", legacy, "--scale", "0.5", "--dry-run", expect=2)
    assert "only torch zip files" in proc.stderr
    cli("set-lr", sample("torch", "plain.pt"), "--scale", "0.5", "--lr", "1e-3", "--dry-run", expect=2)
    cli("set-lr", sample("torch", "plain.pt"), "--dry-run", expect=2)
    with pytest.raises(CkptError):
        ops.plan_set_lr(open_checkpoint(sample("torch", "plain.pt")), scale=-1.0)
