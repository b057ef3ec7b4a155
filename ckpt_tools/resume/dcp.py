"""`ckpt resume` of a torch DCP checkpoint (FSDP2, torchtitan, torchtune's DCP recipes), model-free: `dcp.load` into
a `fully_shard` replica under the layout's key names + `set_state_dict` in `resume.workers.dcp`; the LR each
resumed update must use from the saved scheduler (`torch_schedules`)."""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path
from typing import Any

from ..errors import CkptError
from ..read.tree import Checkpoint, GroupNode, node_to_python
from .common import (
    PlannerOptions,
    FrameworkPlan,
    plan_header,
    _expected_lrs,
    _replica_model,
    _saved_scheduler,
    _saved_state,
    _scheduler_fn,
    _scheduler_gone,
    _specs_and_groups,
)
from .torch_schedules import torch_expected_lrs


def plan_dcp(
    ck: Checkpoint,
    path: Path,
    opts: PlannerOptions,
) -> FrameworkPlan:
    """Validate, build the replica's parameters and optimizer groups, derive the expected LRs from the saved
    scheduler, build the plan."""
    steps, nproc, device, model, scheduler, trust_pickles = astuple(opts)
    if model not in ("auto", "model-free", "replica"):
        raise CkptError(f"--model {model!r}: DCP checkpoints resume model-free here", hint="drop --model")
    folder = Path(ck.path)
    if not folder.is_dir() or not (folder / ".metadata").is_file():
        raise CkptError("not a DCP folder with .metadata", path=folder)
    specs, groups = _specs_and_groups(
        ck,
        path,
        trust_pickles,
        "torch DCP",
        folder,
        weights="model weights in the DCP checkpoint",
        optimizer="optimizer param_groups in the DCP checkpoint",
    )
    specs, fused = _fused_specs(specs, ck)
    names_by_group = _group_names(groups, {n for n, _, _ in specs}, folder)
    sched, kind, position_only, rows, how = _schedule(ck, groups, steps, scheduler, folder)
    world = ck.topology.dp or 1
    n = nproc or world
    notes = []
    if n != world:
        notes.append(f"resharded by dcp.load: saved by {world} ranks, resumed on {n}")
    if fused:
        notes.append(
            f"{len(fused)} fused parameter(s) ({next(iter(fused))}, …) loaded from their split weights in "
            "the row order --n-kv-heads gives (as torchtitan's FusedQKVLinear merges them)"
        )
    saved = _saved_state(
        ck,
        sched or position_only,
        global_step=ck.counters.global_step,
        optimizer_step=ck.counters.optimizer_step,
        dp=world,
    )
    spec = _replica_model(
        specs, groups, names_by_group, sched, kind, fused=fused, scheduler_position_only=bool(position_only)
    )
    return FrameworkPlan(
        **plan_header("dcp", path, saved, steps, device, n),
        model="model-free FSDP2 replica (synthetic loss)",
        load_dir=str(folder.resolve()),
        expected_lrs=_expected_lrs(rows),
        lr_source=how,
        notes=tuple(notes),
        lr_missing=None if sched or position_only else _scheduler_gone(groups, "optim"),
        worker={
            "models": [spec],
            "scheduler_fn": scheduler,
            "opt_state_source": "the DCP optimizer state (ckpt's reader)",
        },
    )


def _group_names(groups: list[dict[str, Any]], known: set[str], folder: Path) -> list[list[str]]:
    """The parameter names of each optimizer group (DCP keeps names, not ids), all of them in the model."""
    names_by_group = []
    for i, g in enumerate(groups):
        names = [str(n) for n in g.get("params") or []]
        missing = [n for n in names if n not in known]
        if not names or missing:
            raise CkptError(
                f"optimizer param group {i} lists {missing[:3] or 'no'} parameters the model does not have",
                path=folder,
                hint="the checkpoint's model and optimizer disagree",
            )
        names_by_group.append(names)
    return names_by_group


def _schedule(
    ck: Checkpoint, groups: list[dict[str, Any]], steps: int, scheduler: str | None, folder: Path
) -> tuple[dict[str, Any], str | None, dict[str, Any], list, str]:
    """(the saved torch scheduler state, its kind, a position-only state (torchtitan), the expected LR rows, how)."""
    position_only = node_to_python(ck.tree.children.get("scheduler", GroupNode())) or {}
    if set(map(str, position_only)) == {"last_epoch"}:
        # torchtitan's LRSchedulersContainer: only the position is saved; the schedule comes back from the job
        # config, while the saved per-parameter lr drives the first resumed update (measured,
        # docs/torchtitan-torchtune.md)
        rows: list = [[float(g["lr"]) for g in groups]] + [None] * (steps - 1)
        how = (
            "the saved param groups' lr for the first update (the scheduler state holds only last_epoch = "
            f"{position_only['last_epoch']}: the producer, torchtitan, rebuilds the schedule from its job config, "
            "which the checkpoint does not hold)"
        )
        return {}, None, position_only, rows, how
    sched, kind = _saved_scheduler(
        ck.tree.children,
        "scheduler",
        folder,
        "the scheduler state is not a torch scheduler this resume can rebuild",
    )
    lr_fn = _scheduler_fn(scheduler)
    rows, how = torch_expected_lrs(sched or None, groups, steps, per_update=1, lr_fn=lr_fn, fn_name=scheduler)
    return sched, kind, {}, rows, how


def _fused_specs(specs: list, ck: Checkpoint) -> tuple[list, dict[str, dict[str, list[int]]]]:
    """The replica's parameters where the checkpoint holds a fused parameter saved split (`logical.with_kv_heads`
    gave its row order): one fused parameter in place of its split weights, which the worker loads and puts at
    their fused rows, as the producer's load hook does; {fused: {split name: its rows in the fused one}}."""
    by = {n: (shape, dtype) for n, shape, dtype in specs}
    out = list(specs)
    fused: dict[str, dict[str, list[int]]] = {}
    for name, parts in ck.state_split.items():
        first = next(iter(parts))
        at = next(i for i, (n, _, _) in enumerate(out) if n == first)
        out = [x for x in out if x[0] not in parts]
        out.insert(at, (name, [sum(len(r) for r in parts.values()), *by[first][0][1:]], by[first][1]))
        fused[name] = {part: list(rows) for part, rows in parts.items()}
    return out, fused
