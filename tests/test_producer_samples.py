"""Samples written by producers as users run them: HF `transformers.Trainer` (DDP and DeepSpeed ZeRO-2) and
Lightning (OneCycleLR), each resumed by the real framework in its worker's resume mode.

`producer_resume(name, ckpt_path, tmp_path)` (conftest's, re-exported here) is the reusable part: it resumes a
(possibly edited) checkpoint with the framework that wrote it and returns one record per resumed update, {step, lr
(per group, the LR that update used), optimizer_step (Adam step after it), loss}. Compare a resume of an edited
checkpoint with one of an untouched copy to see what the edit does to a real run.

Measured with these resumes (transformers 5.23, deepspeed 0.19.8, lightning 2.6.6, torch 2.13):
- HF Trainer (DDP and ZeRO-2 alike: with no scheduler in the DS config the Trainer keeps its LambdaLR and writes
  scheduler.pt): the first resumed update runs at the optimizer's saved param-group `lr` (optimizer.pt, or
  `base_optimizer_state.param_groups[i].lr` in the bf16_zero_pp_rank_*_optim_states.pt files); later updates at
  scheduler.pt `base_lrs[i] * lambda(last_epoch + 1)`. `_step_count`, `_last_lr` and `initial_lr` change nothing.
- Lightning OneCycleLR: the first resumed update runs at `optimizer_states[0].param_groups[i].lr`; later ones from
  the scheduler's `last_epoch` and `_schedule_phases` with the param groups' `initial_lr`/`max_lr`/`min_lr`
  (`base_lrs`, `_last_lr`, `_step_count`, `total_steps` change nothing). The global step comes back from
  `loops.fit_loop['epoch_loop.automatic_optimization.optim_progress']`, not from the top-level `global_step`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

# producer_resume(name, ckpt_path, tmp_path, *, steps=None) -> list[dict] lives in conftest (shared with the other
# producer tests) and is re-exported here: it runs the sample worker's resume mode under torchrun
from conftest import LOSS_REL_TOL, manifest, producer_resume, resume_edit, sample


ROOT = Path(__file__).resolve().parent.parent

# name -> (group, sample path inside the group)
PRODUCERS = {
    "hf_trainer_ddp": ("hf_trainer", "hf_trainer_ddp"),
    "hf_trainer_zero2": ("hf_trainer", "hf_trainer_zero2"),
    "lightning_onecycle": ("lightning", "onecycle.ckpt"),
}
RESUMED_STEPS = [5, 6]

__all__ = ["producer_resume", "resume_point", "copy_resume_point", "assert_continues_history", "halve_lr_fields"]


def resume_point(name: str, path: Path) -> Path:
    """What a resume continues from: `<output_dir>/checkpoint-4` for the Trainer, the `.ckpt` file for Lightning."""
    if name.startswith("hf_trainer"):
        return path / manifest(*PRODUCERS[name])["extra"]["checkpoint"]
    return path


def copy_resume_point(name: str, dst_dir: Path) -> Path:
    """A copy of the committed sample's resume point in `dst_dir` (to resume or to edit)."""
    src = resume_point(name, sample(*PRODUCERS[name]))
    dst = dst_dir / src.name
    dst_dir.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
    return dst


def assert_continues_history(records: list[dict], man: dict, *, loss_rel_tol: float) -> None:
    """A resume from step 4 runs steps 5 and 6 at exactly the uninterrupted run's LRs, Adam step 5 and 6, and
    the recorded losses within `loss_rel_tol` (0: bitwise)."""
    hist = {h["step"]: h for h in man["extra"]["history"]}
    assert [r["step"] for r in records] == RESUMED_STEPS
    assert [r["optimizer_step"] for r in records] == RESUMED_STEPS
    for r in records:
        want = hist[r["step"]]
        assert r["lr"] == pytest.approx(want["lr"], rel=1e-12, abs=0), r["step"]
        assert r["loss"] == pytest.approx(want["loss"], rel=loss_rel_tol, abs=0), r["step"]


# --- the committed samples --------------------------------------------------------------------------------------


def expected_files(name: str) -> set[str]:
    if name == "lightning_onecycle":
        return {"onecycle.ckpt"}
    common = {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "scheduler.pt",
        "trainer_state.json",
        "training_args.bin",
    }
    files = set()
    for n in (2, 4):
        if name == "hf_trainer_ddp":
            names = common | {"optimizer.pt"}
        else:
            names = common | {
                "latest",
                f"global_step{n}/mp_rank_00_model_states.pt",
                *(f"global_step{n}/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)),
            }
        files |= {f"checkpoint-{n}/{x}" for x in names}
    return files


@pytest.mark.parametrize("name", list(PRODUCERS))
def test_committed_sample_layout_and_manifest(name):
    group, rel = PRODUCERS[name]
    path = sample(group, rel)
    man = manifest(group, rel)
    if path.is_dir():
        found = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    else:
        found = {path.name}
    assert found == expected_files(name)
    # nothing else in the group folder but samples and manifests (no lightning_logs/, runs/, *.py copies)
    for p in (ROOT / "sample_ckpts" / group).rglob("*"):
        assert p.suffix != ".py" and p.name not in ("lightning_logs", "runs"), p
    size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    assert size < 2_000_000, size

    ex = man["extra"]
    assert man["format"] == ("lightning" if name == "lightning_onecycle" else "hf_trainer")
    assert [h["step"] for h in ex["history"]] == [1, 2, 3, 4, 5, 6]
    assert man["steps"] == man["counters"]["global_step"] == man["counters"]["optimizer_step"] == 4
    assert man["counters"]["scheduler_last_epoch"] == 4
    # the LR saved for the next update is the one the uninterrupted step 5 used
    assert ex["next_lr"] == ex["history"][4]["lr"] == man["lr"]["param_groups"] == man["lr"]["last_lr"]
    assert len(ex["next_lr"]) == 2
    # steps 3..6 each have their own LR, so a resume that is a step off shows (with the HF cosine schedule,
    # warmup 2 of 6 steps, step 2's LR equals step 5's: half the peak on the way up and on the way down)
    assert len({tuple(h["lr"]) for h in ex["history"][2:]}) == 4

    if name.startswith("hf_trainer"):
        from ckpt_tools.samples.workers.hf_trainer import build_model

        model = build_model()
        assert model.lm_head.weight is model.transformer.wte.weight
        uniq = {id(p): p for p in model.parameters()}
        assert man["parameters"] == {"count": sum(p.numel() for p in uniq.values()), "tensors": len(uniq)}
        assert ex["checkpoint"] == "checkpoint-4" and ex["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
        state = json.loads((path / "checkpoint-4" / "trainer_state.json").read_text())
        assert state["global_step"] == 4 and state["max_steps"] == 6
        sched = torch.load(path / "checkpoint-4" / "scheduler.pt", weights_only=True)
        assert sched["last_epoch"] == 4 and sched["_last_lr"] == ex["next_lr"]
    else:
        ck = torch.load(path, map_location="cpu", weights_only=False)  # committed sample: trusted
        assert ck["global_step"] == 4 and ck["epoch"] == 0
        assert ck["lr_schedulers"][0]["last_epoch"] == 4
        assert [g["lr"] for g in ck["optimizer_states"][0]["param_groups"]] == ex["next_lr"]


@pytest.mark.parametrize("name", list(PRODUCERS))
def test_untouched_resume_of_committed_sample_continues_the_history(name, untouched_resume):
    """The committed checkpoint (recorded on another machine): LRs and Adam steps exact, losses within the
    dtype's cross-machine tolerance (conftest.LOSS_REL_TOL). The resume (made once per run, conftest) wrote nothing
    into the checkpoint it resumed."""
    man = manifest(*PRODUCERS[name])
    run = untouched_resume(name)
    assert_continues_history(run["records"], man, loss_rel_tol=LOSS_REL_TOL[man["extra"]["dtype"]])
    assert run["files_changed"] == [], "the resume wrote to the checkpoint"


# --- regenerated on this machine ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRODUCERS))
def test_regenerated_sample_matches_and_resumes_bitwise(name, tmp_path, fresh_sample):
    """Regenerate the sample here: the same run as the committed one (counters, LRs exact; losses within the dtype
    tolerance), and a resume of the fresh checkpoint reproduces the fresh run's steps 5 and 6 bitwise."""
    group, rel = PRODUCERS[name]
    path = fresh_sample(name)
    new = json.loads(path.with_name(path.name + ".manifest.json").read_text())
    old = manifest(group, rel)
    for key in ("format", "world_size", "topology", "steps", "counters", "lr", "parameters"):
        assert new[key] == old[key], key
    for n, o in zip(new["extra"]["history"], old["extra"]["history"], strict=True):
        assert n["step"] == o["step"] and n["lr"] == o["lr"]
        assert n["loss"] == pytest.approx(o["loss"], rel=LOSS_REL_TOL[old["extra"]["dtype"]], abs=0)
    if path.is_dir():
        assert {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} == expected_files(name)
    records = producer_resume(name, resume_point(name, path), tmp_path)
    assert_continues_history(records, new, loss_rel_tol=0)


# --- an edit of the LR fields is seen by the real resume ---------------------------------------------------------


def _halve(groups: list[dict], key: str) -> None:
    for g in groups:
        g[key] *= 0.5


def halve_lr_fields(name: str, ckpt: Path) -> None:
    """Halve the fields measured to drive the resumed LR: the first resumed update's (the optimizer's saved
    param-group lr) and the schedule's (HF: scheduler.pt base_lrs; OneCycleLR: the groups' initial_lr, max_lr and
    min_lr, between which it interpolates)."""
    if name == "lightning_onecycle":
        ck = torch.load(ckpt, map_location="cpu", weights_only=False)  # committed sample: trusted
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):
            _halve(ck["optimizer_states"][0]["param_groups"], key)
        torch.save(ck, ckpt)
        return
    if name == "hf_trainer_ddp":
        opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
        _halve(opt["param_groups"], "lr")
        torch.save(opt, ckpt / "optimizer.pt")
    else:
        for f in sorted(ckpt.glob("global_step*/*_optim_states.pt")):
            osd = torch.load(f, weights_only=False)  # committed sample: trusted
            _halve(osd["optimizer_state_dict"]["base_optimizer_state"]["param_groups"], "lr")
            torch.save(osd, f)
    sched = torch.load(ckpt / "scheduler.pt", weights_only=True)
    sched["base_lrs"] = [x * 0.5 for x in sched["base_lrs"]]
    torch.save(sched, ckpt / "scheduler.pt")


def _register_edits() -> None:
    """The torch edit and the short resume below, resumed with the untouched copy in one launch of each producer's
    worker (conftest.producer_runs)."""
    for name in PRODUCERS:
        resume_edit(name, "halved_lr_fields")(lambda ck, name=name: halve_lr_fields(name, resume_point(name, ck)) or {})
        resume_edit(name, "steps_1", steps=1)(lambda ck: {})


_register_edits()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRODUCERS))
def test_halved_lr_fields_halve_the_resumed_lrs(name, producer_runs):
    runs = producer_runs(name)
    untouched, edited = runs["untouched"]["records"], runs["halved_lr_fields"]["records"]
    assert [r["step"] for r in edited] == [r["step"] for r in untouched] == RESUMED_STEPS
    for e, u in zip(edited, untouched):
        assert e["lr"] == pytest.approx([x * 0.5 for x in u["lr"]], rel=1e-12, abs=0), e["step"]
        assert e["optimizer_step"] == u["optimizer_step"]
    assert edited[0]["loss"] == untouched[0]["loss"]  # same weights before the first resumed update
    assert edited[1]["loss"] != untouched[1]["loss"]  # the halved update moved them differently


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PRODUCERS))
def test_steps_option_stops_the_resume_early(name, producer_runs):
    man = manifest(*PRODUCERS[name])
    records = producer_runs(name)["steps_1"]["records"]
    assert [(r["step"], r["optimizer_step"]) for r in records] == [(5, 5)]
    assert records[0]["lr"] == pytest.approx(man["extra"]["history"][4]["lr"], rel=1e-12, abs=0)
