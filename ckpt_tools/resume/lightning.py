"""`ckpt resume` of a Lightning .ckpt, model-free: `Trainer.fit(ckpt_path=)` in `resume.workers.lightning` with a
LightningModule built from the saved state_dict, optimizer and scheduler of the saved kinds; the LR each resumed
update must use from the saved scheduler (`torch_schedules`), stepped per step or per epoch."""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path
from typing import Any

from ..errors import CkptError
from ..read.tree import Checkpoint
from .common import (
    PlannerOptions,
    FrameworkPlan,
    plan_header,
    _expected_lrs,
    _match_groups,
    _replica_model,
    _saved_scheduler,
    _saved_state,
    _scheduler_fn,
    _scheduler_gone,
    _specs_and_groups,
    _state_shapes,
)
from .torch_schedules import torch_expected_lrs


def plan_lightning(
    ck: Checkpoint,
    path: Path,
    opts: PlannerOptions,
) -> FrameworkPlan:
    """Validate, match the optimizer groups to the saved weights, tell a per-step from a per-epoch scheduler,
    derive the expected LRs, build the plan (one process)."""
    steps, nproc, device, model, scheduler, trust_pickles = astuple(opts)
    if model not in ("auto", "model-free", "replica"):
        raise CkptError(f"--model {model!r}: Lightning checkpoints resume model-free here", hint="drop --model")
    if nproc not in (None, 1):
        raise CkptError(f"--nproc {nproc}: the Lightning resume runs one process", hint="drop --nproc")
    specs, groups = _specs_and_groups(
        ck,
        path,
        trust_pickles,
        "Lightning",
        path,
        weights="state_dict weights in the .ckpt",
        optimizer="optimizer_states in the .ckpt",
        hint="a checkpoint saved with save_weights_only=True has no training state",
    )
    names_by_group, how_groups = _group_names(ck, specs, groups)
    sched, kind = _saved_scheduler(
        ck.tree.children, "scheduler", path, "lr_schedulers[0] is not a torch scheduler state this resume can rebuild"
    )
    gstep = ck.counters.global_step
    notes = [f"optimizer groups from the saved {how_groups}"]
    interval, steps = _interval_and_steps(sched, kind, gstep, steps, path, notes)
    lr_fn = _scheduler_fn(scheduler)
    if interval == "epoch":
        rows = [[float(g["lr"]) for g in groups] for _ in range(steps)]
        how = "per-epoch scheduler: the saved param_groups lr for every update of this epoch"
    else:
        rows, how = torch_expected_lrs(sched or None, groups, steps, per_update=1, lr_fn=lr_fn, fn_name=scheduler)
    saved = _saved_state(ck, sched, global_step=gstep, optimizer_step=ck.counters.optimizer_step, dp=1)
    spec = _replica_model(specs, groups, names_by_group, sched, kind)
    return FrameworkPlan(
        **plan_header("lightning", path, saved, steps, device, 1),
        model="model-free LightningModule (synthetic loss)",
        load_dir=str(Path(ck.path).resolve()),
        expected_lrs=_expected_lrs(rows),
        lr_source=how,
        notes=tuple(notes),
        lr_missing=None if sched else _scheduler_gone(groups, "optimizer_states[0]"),
        worker={
            "models": [spec],
            "scheduler_fn": scheduler,
            "interval": interval,
            "global_step": gstep,
            "opt_state_source": "optimizer_states[0]",
        },
    )


def _group_names(ck: Checkpoint, specs: list, groups: list[dict[str, Any]]) -> tuple[list[list[str]], str]:
    """The parameter names of each optimizer group: the saved `param_names` where they name the weights, else
    matched by shape; and which of the two it was."""
    known = {n for n, _, _ in specs}
    if all(g.get("param_names") for g in groups) and all(n in known for g in groups for n in g["param_names"]):
        return [[str(n) for n in g["param_names"]] for g in groups], "param_names"
    return _match_groups(specs, groups, _state_shapes(ck.optimizer), "optimizer_states[0]"), "shapes"


def _interval_and_steps(
    sched: dict[str, Any], kind: str | None, gstep: int | None, steps: int, path: Path, notes: list[str]
) -> tuple[str, int]:
    """("step" or "epoch": how often the saved scheduler was stepped, `--steps` cut to what a OneCycleLR has left)."""
    interval = "step"
    if sched and gstep is not None and int(sched["last_epoch"]) != gstep:
        interval = "epoch"
        notes.append(
            f"scheduler last_epoch={sched['last_epoch']} != global_step={gstep}: stepped per epoch; the "
            "LRs of the resumed updates stay the saved ones until the epoch ends"
        )
    if kind == "OneCycleLR":
        left = int(sched["total_steps"]) - int(sched["last_epoch"]) - 1
        if steps > left:
            if left < 1:
                raise CkptError(
                    f"OneCycleLR is at its last step ({sched['last_epoch']} of total_steps "
                    f"{sched['total_steps']}): one more update would make it raise",
                    path=path,
                )
            notes.append(f"--steps {steps} cut to {left}: OneCycleLR raises past total_steps={sched['total_steps']}")
            steps = left
    return interval, steps
