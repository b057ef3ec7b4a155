"""`ckpt resume` of an Accelerate `save_state` folder, model-free: `accelerator.load_state` into replicas of the
saved models (DDP, or the DeepSpeed plugin with the saved ds_config) in `resume.workers.accelerate`; the LR each
resumed update must use from every saved scheduler (`torch_schedules`); the registered custom objects restored."""

from __future__ import annotations

import inspect
import re
from dataclasses import astuple
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError, UnsupportedCheckpoint
from ..formats import training_state
from ..read import pickle_reader
from ..read.tree import Checkpoint, GroupNode, node_to_python
from .common import (
    PlannerOptions,
    FrameworkPlan,
    plan_header,
    _check_pickles,
    _finite,
    _groups_of,
    _match_groups,
    _replica_model,
    _saved_scheduler,
    _saved_state,
    _scheduler_fn,
    _scheduler_gone,
    _state_shapes,
    _tensor_specs,
)
from .torch_schedules import torch_expected_lrs


def installed_accelerate_counts_loosely() -> bool:
    """Whether the installed Accelerate counts every file with `custom_checkpoint` in its name (older versions:
    a stray copy then makes `load_state` skip or refuse the custom objects) rather than `^custom_checkpoint_N.pkl$`."""
    try:
        from accelerate import Accelerator  # lazy: Accelerate only when a stray custom file is found

        src = inspect.getsource(Accelerator.load_state)
    except (ImportError, OSError, TypeError):
        return True
    return "custom_checkpoint_\\d+\\.pkl$" not in src


def plan_accelerate(
    ck: Checkpoint,
    path: Path,
    opts: PlannerOptions,
    counts_loosely: Callable[[], bool] = installed_accelerate_counts_loosely,
) -> FrameworkPlan:
    """Validate, read every saved model / optimizer / scheduler (`optimizer`, `optimizer_1`, ...) into a replica
    spec with its expected LRs, look at the custom-object files, choose the world size, build the plan.
    `counts_loosely`: how the installed Accelerate counts custom-object files."""
    steps, nproc, device, model, scheduler, trust_pickles = astuple(opts)
    if model not in ("auto", "model-free", "replica"):
        raise CkptError(f"--model {model!r}: Accelerate checkpoints resume model-free here", hint="drop --model")
    folder = Path(ck.path)
    if "fsdp" in str(ck.details.get("engine", "")):
        raise UnsupportedCheckpoint("Accelerate FSDP checkpoints: not resumable model-free yet", path=folder)
    _check_pickles(ck, path, trust_pickles, "Accelerate")
    kids = ck.tree.children
    world = int(ck.details.get("world_size") or ck.topology.dp or 1)
    notes: list[str] = []
    zero = ck.topology.zero_stage is not None
    ds_cfg = _finite(node_to_python(kids["config"])) if zero and "config" in kids else None
    per_update = training_state(ck).scheduler_steps_per_update
    models, expected_rows, lr_how, gone = _models(ck, folder, zero, steps, per_update, scheduler)
    strict, loose, stray_effect = _custom_files(folder, notes, counts_loosely)
    custom_saved = node_to_python(kids.get("client_state", GroupNode())) or {}
    n = _world(nproc, world, zero, notes)
    sched0 = node_to_python(kids.get("scheduler", GroupNode())) or {}
    saved = _saved_state(
        ck, sched0, global_step=ck.counters.global_step, optimizer_step=ck.counters.optimizer_step, dp=world
    )
    want = None if all(r is None for r in expected_rows) else expected_rows
    return FrameworkPlan(
        **plan_header("accelerate", path, saved, steps, device, n),
        model="model-free replica (synthetic loss)",
        load_dir=str(folder.resolve()),
        expected_lrs=tuple(None if r is None else tuple(r) for r in want) if want else None,
        lr_source="; ".join(lr_how),
        notes=tuple(notes),
        lr_missing=gone,
        worker={
            "models": models,
            "ds_config": ds_cfg,
            "custom_objects": len(strict),
            "custom_saved": {k: custom_saved.get(k) for k in sorted(custom_saved)},
            "stray_custom": loose,
            "stray_effect": stray_effect,
            "scheduler_fn": scheduler,
            "global_step": ck.counters.global_step
            if ck.counters.global_step is not None
            else ck.counters.optimizer_step,
            "opt_state_source": ", ".join(f for m in models for f in m["optimizer_files"]),
        },
        micro_batch=1,
        gas=1,
    )


def _models(
    ck: Checkpoint, folder: Path, zero: bool, steps: int, per_update: int, scheduler: str | None
) -> tuple[list[dict[str, Any]], list[list[float | None] | None], list[str], str | None]:
    """Every saved (model, optimizer, scheduler) triple as a replica spec: (specs, the expected LRs of each update
    over all their groups, how each was derived, why the schedule is lost or None)."""
    kids = ck.tree.children
    lr_fn = _scheduler_fn(scheduler)
    models: list[dict[str, Any]] = []
    expected_rows: list[list[float | None] | None] = [[] for _ in range(steps)]
    lr_how: list[str] = []
    gone: str | None = None
    i = 0
    while True:
        suffix = "" if i == 0 else f"_{i}"
        if f"optimizer{suffix}" not in kids and not (i == 0 and zero):
            break
        opt_node = kids.get(f"optimizer{suffix}")
        groups = _groups_of(opt_node)
        if not groups:
            raise CkptError(f"optimizer{suffix}: no param_groups", path=folder)
        specs = _tensor_specs(kids.get(f"model{suffix}"))
        if not specs:
            raise CkptError(f"model{suffix}: no weights to build the replica from", path=folder)
        if zero:
            specs, names_by_group, opt_files = _zero_layout(folder, specs)
        else:
            names_by_group = _match_groups(specs, groups, _state_shapes(opt_node), f"optimizer{suffix}")
            opt_files = [f"optimizer{suffix}.bin"]
        if len(names_by_group) != len(groups):
            raise CkptError(
                f"optimizer{suffix}: {len(groups)} param groups but the model layout has {len(names_by_group)}",
                path=folder,
            )
        sched, kind = _saved_scheduler(
            kids,
            f"scheduler{suffix}",
            folder,
            f"scheduler{suffix}: not a torch scheduler state this resume can rebuild",
        )
        if not sched:
            gone = gone or _scheduler_gone(groups, f"optimizer{suffix}")
        rows, how = torch_expected_lrs(
            sched or None, groups, steps, per_update=per_update, lr_fn=lr_fn, fn_name=scheduler
        )
        for k in range(steps):
            row = expected_rows[k]
            expected_rows[k] = None if rows[k] is None or row is None else row + list(rows[k])
        lr_how.append(f"optimizer{suffix}: {how}")
        models.append(_replica_model(specs, groups, names_by_group, sched, kind, optimizer_files=opt_files))
        i += 1
    if not models:
        raise CkptError("no optimizer state: nothing to resume", path=folder)
    return models, expected_rows, lr_how, gone


def _zero_layout(folder: Path, specs: list) -> tuple[list, list[list[str]], list[str]]:
    """The DeepSpeed plugin's layout: (the replica's fp32 specs, the parameter names of each group from the model
    states' param_shapes, the ZeRO optimizer files by rank)."""
    tag = (folder / "latest").read_text().strip() if (folder / "latest").is_file() else "pytorch_model"
    ms_file = next(iter(sorted((folder / tag).glob("*mp_rank_00_model_states.pt"))), None)
    loaded = pickle_reader.load(ms_file)
    shapes = loaded.obj.get("param_shapes") if isinstance(loaded.obj, dict) else None
    if loaded.source is not None:
        loaded.source.close()
    shapes = [shapes] if isinstance(shapes, dict) else (shapes or [])
    names_by_group = [[str(n) for n in g] for g in shapes]
    by_rank = {}
    for f in (folder / tag).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"):
        by_rank[int(f.name.split("zero_pp_rank_")[1].split("_")[0])] = str(f.relative_to(folder))
    opt_files = [by_rank[r] for r in sorted(by_rank)]
    # DeepSpeed's engine converts the module to bf16 itself; the replica starts in fp32 as the user's did
    return [(n, s, "float32") for n, s, _ in specs], names_by_group, opt_files


def _custom_files(
    folder: Path, notes: list[str], counts_loosely: Callable[[], bool]
) -> tuple[list[str], list[str], str | None]:
    """(the custom-object files Accelerate restores, stray files that merely contain `custom_checkpoint`, what a
    stray one does to this Accelerate's `load_state`: "fail", "warn" or None)."""
    strict = [f.name for f in folder.iterdir() if re.match(r"^custom_checkpoint_\d+\.pkl$", f.name)]
    loose = [f.name for f in folder.iterdir() if "custom_checkpoint" in f.name and f.name not in strict]
    stray_effect = None
    if loose:
        if counts_loosely():
            stray_effect = "fail"
            notes.append(
                f"stray {', '.join(loose)}: the installed Accelerate counts it as a custom checkpoint, so "
                "load_state will not restore the registered objects; move it out of the folder"
            )
        else:
            stray_effect = "warn"
            notes.append(
                f"stray {', '.join(loose)} in the checkpoint folder: this Accelerate ignores it, but "
                "versions that count any 'custom_checkpoint' file would skip the custom state; move it out"
            )
    return strict, loose, stray_effect


def _world(nproc: int | None, world: int, zero: bool, notes: list[str]) -> int:
    """The processes to resume on; a ZeRO checkpoint only on its saved ranks. Accelerate steps the scheduler once
    per process, so another world size changes the schedule (said in a note)."""
    n = nproc or world
    if zero and n != world:
        raise CkptError(
            f"--nproc {n}: the ZeRO checkpoint was saved by {world} ranks and DeepSpeed refuses to repartition it",
            hint=f"use --nproc {world}",
        )
    if n != world:
        notes.append(
            f"resumed on {n} processes, saved by {world}: Accelerate steps the scheduler once per "
            f"process, so the schedule advances {n} (not {world}) epochs per update"
        )
    return n
