"""`set-lr` / `set-step`: learning-rate and counter surgery that knows which saved field drives the LR.

Which field matters after a resume depends on the scheduler (measured by resuming and stepping; docs/formats.md):

    LambdaLR & closed forms   base_lrs x f(last_epoch) from the next scheduler.step(); the optimizer's
                              param_groups lr only for the first resumed update; _last_lr, initial_lr cosmetic
    StepLR, Cosine... (chain) the optimizer's param_groups lr: the next LR is computed from it
    OneCycleLR                the optimizer's initial_lr / max_lr / min_lr
    DeepSpeed's own (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)
                              the launch config: the checkpoint holds only last_batch_iteration

So `--scale` edits every LR field the same way (inspect then tells one coherent story and whichever
field drives, it is right), and each FieldChange says what the field does. For DeepSpeed's own schedulers
no checkpoint edit can change the trajectory: the plan carries the exact launch-config change, derived
from the `ds_config` saved in the checkpoint (which is updated too, as the record of the run), and still
edits the optimizer `lr` so the first resumed update is right.

Every edit of a torch zip file is made IN PLACE, in O(changed bytes) (`lr_files._in_place` ->
`zip_patch.plan_in_place`): the inert tree the safe reader produced is edited and re-pickled by `pickle_writer`, and
the new pickle becomes a new data.pkl member appended after the file's last member, with a new central directory
(the old pickle stays as dead bytes; a 2 GB ZeRO optimizer file gets a few KB written, is never materialised,
deepspeed is never imported). A new Adam `step` value is new bytes for its 0-d storage (`storage_bytes=`),
overwritten in place with the member's CRC-32 updated from those bytes alone; when only such tensor values change,
the pickle is left as it is. `io.execute` journals the original bytes first, and falls back to the whole-file
rewrite (`pickle_writer.rewrite_torch_zip`, every tensor member copied byte for byte) where in place is refused
(hard links, read-only files, `--copy`). Plain pickles and legacy (pre-1.6) torch files are refused: re-save once in
zip format. DCP folders (FSDP2 / torchtitan) are one more target: the same state dict is assembled from their items
(`dcp_write.DcpFolder.state_tree`), edited by the same code, and each changed item becomes a new blob appended to
its `.distcp` file in place, with `.metadata` (the new offsets) replaced whole in the same WritePlan.
HF Trainer's trainer_state.json (the loop's global_step) is rewritten as JSON.

Which files to edit comes from the checkpoint's format module (`formats.training_state` -> `state.StateMap`);
what to edit inside them is found by shape (`state.locate`): this module has no branch per format. With
several optimizers (Accelerate's optimizer_1.bin, Lightning's lists) each is edited under its own
scheduler's rule; `optimizer=N` picks one. A request that finds none of its fields is an error (exit 2), never
a silent "nothing to do".

Order of use: `plan_set_lr(ck, scale=0.5)` / `plan_set_step(ck, optimizer_step=N)` (pure; reads metadata
and the pickles) -> `LrPlan.plan` to `io.execute` (journaled outside the checkpoint, changed in place or staged and
renamed,
re-verified with the reader, rolled back on any failure).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CkptError, CorruptCheckpoint, UnsupportedCheckpoint
from ..formats.megatron_lm import next_lr
from ..formats.torch_file import flattened_groups
from ..read.pickle_reader import TensorRef
from ..read.state import group_dicts, is_flattened
from ..read.tree import Checkpoint, as_int
from ..view.accounting import guard, left_behind
from ..view.checkpoint import open_checkpoint
from ..write import io
from .lr_files import _File, _collect, _groups, check_steps_shared, file_writes, read_back_check

# --- scheduler kinds ------------------------------------------------------------------------------------

CLOSED_FORM, CHAINABLE, ONE_CYCLE, DEEPSPEED, NO_SCHEDULER = (
    "closed-form",
    "chainable",
    "one-cycle",
    "deepspeed",
    "none",
)
MEGATRON = "megatron"  # Megatron-LM's OptimizerParamScheduler: the LR is recomputed every step from max_lr/min_lr
JOB_CONFIG = "job-config"  # torchtitan: lr_scheduler saved as {last_epoch}; schedule and base LR from the job config
REBUILT = "rebuilt"  # torchtune: no scheduler state; the recipe rebuilds it from initial_lr at the resumed step

#: state-dict keys that identify a torch scheduler class
_ONE_CYCLE_KEYS = {"total_steps", "_schedule_phases"}
_CLOSED_FORM_KEYS = {"lr_lambdas", "T_0"}  # LambdaLR, MultiplicativeLR (scaled alike), CosineAnnealingWarmRestarts

SCHEDULER_LABEL = {
    CLOSED_FORM: "torch closed-form scheduler (LambdaLR-style)",
    CHAINABLE: "torch chainable scheduler (StepLR/CosineAnnealingLR-style)",
    ONE_CYCLE: "torch OneCycleLR",
    DEEPSPEED: "DeepSpeed scheduler",
    NO_SCHEDULER: "no scheduler state",
    MEGATRON: "Megatron OptimizerParamScheduler (opt_param_scheduler)",
    JOB_CONFIG: "torchtitan LRSchedulersContainer (saves only last_epoch; rebuilds the schedule from the job config)",
    REBUILT: "torchtune recipe (no scheduler state saved; the recipe rebuilds its scheduler from each param group's "
    "initial_lr at the resumed step)",
}

DRIVER = {
    CLOSED_FORM: "scheduler base_lrs x f(last_epoch) from the next scheduler.step(); the optimizer lr drives "
    "only the first resumed update",
    CHAINABLE: "the optimizer param_groups lr (each step multiplies/derives from it)",
    ONE_CYCLE: "the optimizer param_groups initial_lr / max_lr / min_lr",
    DEEPSPEED: "the launch config (ds_config scheduler/optimizer params); the checkpoint keeps only "
    "last_batch_iteration; the optimizer lr drives only the first resumed update",
    NO_SCHEDULER: "the optimizer param_groups lr",
    MEGATRON: "each param group's max_lr / min_lr (restored from the optimizer state) on the schedule at num_steps; "
    "Megatron recomputes the saved lr every step",
    JOB_CONFIG: "the JOB CONFIG's LR x the schedule at last_epoch; the saved per-parameter lr drives only the first "
    "resumed update",
    REBUILT: "each param group's initial_lr x the schedule at the resumed step (the saved lr is replaced: editing it "
    "alone has no effect)",
}

_COSMETIC = "cosmetic (kept consistent)"
_FIRST_STEP = "drives the first resumed update only"

#: what each LR field does, per scheduler kind (a field missing here is described by `_note`'s default)
_NOTES = {
    CLOSED_FORM: {
        "base_lrs": "DRIVES the LR (x f(last_epoch))",
        "lr": _FIRST_STEP,
        "_last_lr": _COSMETIC,
        "initial_lr": _COSMETIC,
        "last_epoch": "DRIVES: position on the schedule",
        "_step_count": "bookkeeping",
    },
    CHAINABLE: {
        "lr": "DRIVES the LR (next LR derives from it)",
        "base_lrs": "kept consistent (CosineAnnealingLR also reads it)",
        "_last_lr": _COSMETIC,
        "initial_lr": _COSMETIC,
        "eta_min": "floor of the schedule",
        "last_epoch": "DRIVES: position on the schedule",
        "_step_count": "bookkeeping",
    },
    ONE_CYCLE: {
        "initial_lr": "DRIVES the LR",
        "max_lr": "DRIVES the LR",
        "min_lr": "DRIVES the LR",
        "lr": _FIRST_STEP,
        "base_lrs": _COSMETIC,
        "_last_lr": _COSMETIC,
        "last_epoch": "DRIVES: position on the schedule",
        "_step_count": "bookkeeping",
    },
    DEEPSPEED: {
        "lr": _FIRST_STEP + "; then the launch config",
        "initial_lr": _COSMETIC,
        "last_batch_iteration": "DRIVES: position on the launch config's schedule",
        "ds_config": "record of the run only: DeepSpeed never reads it back; change your launch config",
    },
    MEGATRON: {
        "lr": "recomputed by Megatron every step (kept consistent)",
        "max_lr": "DRIVES the LR (peak)",
        "min_lr": "DRIVES the LR (floor)",
        "initial_lr": _COSMETIC,
        "scheduler": "checked against --lr / --min-lr at relaunch (see the note)",
    },
    JOB_CONFIG: {
        "lr": _FIRST_STEP + "; then the job config's LR",
        "initial_lr": _COSMETIC + "; the job config's LR replaces it on resume",
    },
    NO_SCHEDULER: {"lr": "DRIVES the LR", "initial_lr": _COSMETIC},
    REBUILT: {
        "initial_lr": "DRIVES the LR (the recipe rebuilds its scheduler from it)",
        "lr": "replaced on resume by the rebuilt scheduler (kept consistent)",
    },
}

#: LR-valued fields, scaled together by --scale / --lr
SCHED_LR_LISTS = ("base_lrs", "_last_lr", "max_lrs", "min_lrs")  # per group (CyclicLR max_lrs, Plateau min_lrs)
SCHED_LR_SCALARS = ("eta_min",)  # one value for all groups
GROUP_LR_FIELDS = ("lr", "initial_lr", "max_lr", "min_lr")
#: DeepSpeed scheduler params that are LRs (scalars or per-group lists)
DS_SCHED_LR_PARAMS = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr")


def scheduler_kind(state: Any) -> str:
    """The scheduler kind a saved scheduler state dict belongs to (from its keys)."""
    if not isinstance(state, dict) or not state:
        return NO_SCHEDULER
    keys = set(map(str, state))
    if "last_batch_iteration" in keys and "base_lrs" not in keys:
        return DEEPSPEED
    if _ONE_CYCLE_KEYS <= keys:
        return ONE_CYCLE
    if keys & _CLOSED_FORM_KEYS:
        return CLOSED_FORM
    return CHAINABLE


def _note(kind: str, name: str, default: str = "") -> str:
    return _NOTES.get(kind, {}).get(name, default)


# --- the plan -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LrPlan:
    """An `io.WritePlan` plus what the dry run must say about it: the scheduler kind, which field drives the
    LR, and for DeepSpeed's own schedulers the launch-config change (None otherwise)."""

    plan: io.WritePlan
    scheduler: str  # the kind of the first optimizer edited (`schedulers` has one per optimizer)
    driver: str
    config_change: dict[str, Any] | None = None
    world_size: int = 1
    schedulers: dict[int, str] = field(default_factory=dict)  # optimizer number -> scheduler kind

    def to_json(self) -> dict[str, Any]:
        return {
            **self.plan.to_json(),
            "scheduler": SCHEDULER_LABEL[self.scheduler],
            "scheduler_kind": self.scheduler,
            "lr_driven_by": self.driver,
            "launch_config_change": self.config_change,
            "optimizers": [
                {"optimizer": i, "scheduler_kind": k, "lr_driven_by": DRIVER[k]}
                for i, k in sorted(self.schedulers.items())
            ],
        }


def _indices(files: list[_File]) -> list[int]:
    return sorted({i for f in files for coll in (f.found.optimizers, f.found.schedulers) for _, _, i in coll})


def _kind(files: list[_File], index: int, rebuilt: bool = False) -> tuple[str, dict | None]:
    """The scheduler kind of optimizer `index`, and for DeepSpeed's own schedulers the saved ds_config.
    `rebuilt`: the format says its producer rebuilds the schedule on resume (`details["scheduler_rebuilt"]`)."""
    kinds = {scheduler_kind(s) for f in files for _, s, i in f.found.schedulers if i == index}
    cfg = next((f.found.ds_config[1] for f in files if f.found.ds_config), None)
    if len(kinds) > 1:
        raise UnsupportedCheckpoint(f"scheduler states of different kinds for optimizer {index}: {sorted(kinds)}")
    kind = kinds.pop() if kinds else NO_SCHEDULER
    if kind == NO_SCHEDULER and isinstance(cfg, dict) and isinstance(cfg.get("scheduler"), dict):
        kind = DEEPSPEED  # a config scheduler whose state was not saved: still the config's trajectory
    if kind == NO_SCHEDULER and any(_megatron_scheduler(f) is not None for f in files):
        kind = MEGATRON
    if kind == NO_SCHEDULER and any(
        isinstance(f.obj, dict)
        and isinstance(f.obj.get("lr_scheduler"), dict)
        and set(map(str, f.obj["lr_scheduler"])) == {"last_epoch"}
        for f in files
    ):
        kind = JOB_CONFIG  # torchtitan: only the position is saved; the LR comes back from the job config
    if kind == NO_SCHEDULER and rebuilt:
        kind = REBUILT  # torchtune's recipe_state.pt: the recipe rebuilds the scheduler from initial_lr
    return kind, cfg


def _megatron_scheduler(f: _File) -> dict | None:
    """Megatron-LM's saved OptimizerParamScheduler state ({max_lr, min_lr, num_steps, lr_warmup_steps, …})."""
    s = f.obj.get("opt_param_scheduler") if isinstance(f.obj, dict) else None
    return s if isinstance(s, dict) and "max_lr" in s and "num_steps" in s else None


def _megatron_relaunch(files: list[_File], idx: int, factors: list[float]) -> str:
    """What the relaunch needs after a Megatron LR edit, with the LR of the first resumed iteration before/after."""
    f = next(f for f in files if _megatron_scheduler(f) is not None)
    s = _megatron_scheduler(f)
    # the first file that holds them (distributed: another file's), every optimizer in it (a ChainedOptimizer's
    # inner ones: dense, expert)
    groups = next(
        (
            [kg for _p, g, _i in _groups(f2, idx) for kg in g]
            for f2 in files
            if any(g for _p, g, _i in _groups(f2, idx))
        ),
        [],
    )
    fac = factors[0] if factors and len(set(factors)) == 1 else None
    before = [next_lr(s, g) for _k, g in groups]
    lines = []
    if fac is not None:
        new_s = {**s, "max_lr": s["max_lr"] * fac, "min_lr": s["min_lr"] * fac}
        after = [
            next_lr(
                new_s, {**g, "max_lr": g.get("max_lr", s["max_lr"]) * fac, "min_lr": g.get("min_lr", s["min_lr"]) * fac}
            )
            for _k, g in groups
        ]
        lines.append(
            f"first resumed iteration's LR per param group: {', '.join(f'{x:.6g}' for x in before)} -> "
            f"{', '.join(f'{x:.6g}' for x in after)}"
        )
        lines.append(
            f"RELAUNCH: Megatron asserts the checkpoint's scheduler max_lr/min_lr equal the command line; "
            f"keep your command line and add --use-checkpoint-opt_param-scheduler, or relaunch with --lr "
            f"{s['max_lr'] * fac:.6g} --min-lr {s['min_lr'] * fac:.6g} (add --override-opt_param-scheduler "
            "when other schedule flags such as --train-iters change too): the edited param-group "
            "max_lr/min_lr then drive the LR (measured with Megatron-LM core_v0.16.1; newer Megatron-LM "
            "re-applies the command line's bounds to the param groups under --override-opt_param-scheduler)"
        )
    return "; ".join(lines)


def _n_groups(files: list[_File], index: int) -> tuple[int, bool]:
    """(number of param groups of optimizer `index`, whether its state is flattened per parameter). Flattened
    state keeps no group numbers: the scheduler's base_lrs tells how many groups there were."""
    flat = False
    for f in files:
        for _, osd, i in f.found.optimizers:
            if i == index:
                if not is_flattened(osd):
                    return len(group_dicts(osd)), False
                flat = True
    for f in files:
        for _, s, i in f.found.schedulers:
            if i == index and isinstance(s.get("base_lrs"), list):
                return len(s["base_lrs"]), flat
    return (1 if flat else 0), flat  # flattened without base_lrs: one factor for every parameter (--scale)


def _select(n: int, group: int | None) -> list[int]:
    if group is None:
        return list(range(n))
    if not 0 <= group < n:
        raise CkptError(f"--group {group}: the optimizer has {n} param groups (0..{n - 1})")
    return [group]


# --- set-lr ---------------------------------------------------------------------------------------------


def _base_lrs(files: list[_File], kind: str, cfg: dict | None, n: int, index: int) -> list[float]:
    """The "base LR" of each group that `--lr` replaces: base_lrs, else the config's peak, else initial_lr/lr."""
    for f in files:
        for _, s, i in f.found.schedulers:
            if i == index and isinstance(s.get("base_lrs"), list) and len(s["base_lrs"]) == n:
                return [float(x) for x in s["base_lrs"]]
    if kind == MEGATRON:
        for f in files:
            for _, groups, _i in _groups(f, index):
                if len(groups) == n and all(isinstance(g.get("max_lr"), (int, float)) for _, g in groups):
                    return [float(g["max_lr"]) for _, g in groups]
    if kind == DEEPSPEED and cfg:
        params = (cfg.get("scheduler") or {}).get("params") or {}
        peak = params.get("warmup_max_lr", params.get("cycle_max_lr"))
        if peak is None:
            peak = ((cfg.get("optimizer") or {}).get("params") or {}).get("lr")
        if peak is not None:
            return [float(x) for x in peak] if isinstance(peak, list) else [float(peak)] * n
    for f in files:
        for _, groups, _i in _groups(f, index):
            if len(groups) == n:
                return [float(g.get("initial_lr", g.get("lr"))) for _, g in groups]
            if n == 1 and groups:  # flattened per parameter: one base LR for all, or --lr is ambiguous
                bases = sorted({float(g.get("initial_lr", g.get("lr"))) for _, g in groups})
                if len(bases) > 1:
                    raise CkptError(
                        f"--lr: the parameters of optimizer {index} are at different base LRs "
                        f"({', '.join(f'{b:.6g}' for b in bases)}) and their state is flattened per "
                        "parameter (no group numbers)",
                        hint="use --scale to scale every LR alike",
                    )
                return bases
    raise CkptError("no learning rate found in this checkpoint (no optimizer param_groups, no scheduler base_lrs)")


def _scaled(v: Any, factors: list[float]) -> Any:
    if isinstance(v, (list, tuple)) and len(v) == len(factors):
        return [x * f if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x, f in zip(v, factors)]
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if len(set(factors)) == 1:
            return v * factors[0]
        return [v * f for f in factors]  # DeepSpeed schedulers accept one value per param group
    return v


def config_change(cfg: dict | None, factors: list[float]) -> dict[str, Any] | None:
    """The launch-config keys to change (nested like ds_config, new values) for DeepSpeed's own schedulers."""
    if not cfg:
        return None
    change: dict[str, Any] = {}
    sched = cfg.get("scheduler") if isinstance(cfg.get("scheduler"), dict) else {}
    sparams = sched.get("params") or {}
    new_s = {k: _scaled(sparams[k], factors) for k in DS_SCHED_LR_PARAMS if sparams.get(k) is not None}
    new_s = {k: v for k, v in new_s.items() if v != sparams[k]}
    if new_s:
        change["scheduler"] = {"params": new_s}
    oparams = ((cfg.get("optimizer") or {}).get("params") or {}) if isinstance(cfg.get("optimizer"), dict) else {}
    if oparams.get("lr") is not None and isinstance(oparams["lr"], (int, float)):
        new_lr = _scaled(oparams["lr"], factors)
        if new_lr != oparams["lr"]:
            change["optimizer"] = {"params": {"lr": new_lr}}
    return change or None


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _pick(files: list[_File], optimizer: int | None) -> list[int]:
    """The optimizer numbers an edit applies to: all of them, or the one `--optimizer` names."""
    found = _indices(files)
    if optimizer is None:
        return found
    if optimizer not in found:
        raise CkptError(
            f"--optimizer {optimizer}: this checkpoint holds optimizer/scheduler state numbered "
            f"{', '.join(map(str, found)) or 'nowhere'}"
        )
    return [optimizer]


def plan_set_lr(
    ck: Checkpoint,
    *,
    scale: float | None = None,
    lr: float | None = None,
    group: int | None = None,
    last_lr: float | None = None,
    last_epoch: int | None = None,
    step_count: int | None = None,
    optimizer: int | None = None,
    allow_unread: bool = False,
    trust_pickles: bool = False,
) -> LrPlan:
    """The write that changes the LR trajectory (and/or the scheduler position) of `ck`.

    `scale`: multiply every LR field (base_lrs, _last_lr, lr, initial_lr, max_lr/min_lr, eta_min, and the
    DeepSpeed config's LRs) by it. `lr`: the same with factor lr / base LR per group (base_lrs, else the
    DeepSpeed config's peak, else initial_lr/lr). `last_lr`: the LR in effect now (_last_lr and the optimizer
    lr). `last_epoch` / `step_count`: the scheduler's position (DeepSpeed: last_batch_iteration). `group`
    limits LR edits to one param group, `optimizer` to one optimizer and its scheduler (a checkpoint with
    several: Accelerate's optimizer_1.bin, Lightning's list). Every file of every rank that holds these fields
    is rewritten; a request that finds no field to change is an error, never a silent success.
    """
    _check_lr_request(scale, lr, last_lr, last_epoch, step_count)
    ck = guard(ck, ck.path, "set-lr", allow_unread=allow_unread, trust_pickles=trust_pickles)
    root, files, world = _collect(ck)
    notes: list[str] = left_behind(ck)
    kinds: dict[int, str] = {}
    change = None
    picked = _pick(files, optimizer)
    for idx in picked:
        kind, cfg = _kind(files, idx, bool(ck.details.get("scheduler_rebuilt")))
        kinds[idx] = kind
        sel, factors, flat = _factors(files, idx, kind, cfg, scale, lr, group)
        idx_change = config_change(cfg, factors) if kind == DEEPSPEED and any(f != 1.0 for f in factors) else None
        change = change or idx_change
        job_lrs, job_flags = (
            _job_config_lrs(files, idx, factors[0] if factors else 1.0) if kind == JOB_CONFIG else ("", {})
        )
        if job_flags and (scale is not None or lr is not None):
            change = change or {"job_config": job_flags}
        relaunch = _megatron_relaunch(files, idx, factors) if kind == MEGATRON else ""
        _apply_lr(files, idx, kind, factors, sel, flat, last_lr, last_epoch, step_count, idx_change)
        who = f"optimizer {idx}: " if len(picked) > 1 or idx else ""
        retrajectory = scale is not None or lr is not None
        notes += _optimizer_notes(who, kind, factors, flat, lr, last_lr, idx_change, retrajectory, relaunch, job_lrs)
    if scale is not None:
        notes.append(
            f"--scale {scale:g}: every LR field scaled alike" + (f" (param group {group})" if group is not None else "")
        )
    if world > 1 and DEEPSPEED not in kinds.values() and last_epoch is not None:
        notes.append(
            f"Accelerate steps the scheduler {world}x per optimizer step: last_epoch should be {world} x optimizer step"
        )
    return _finish(ck, root, files, "set-lr", notes, kinds, change, world)


def _check_lr_request(
    scale: float | None, lr: float | None, last_lr: float | None, last_epoch: int | None, step_count: int | None
) -> None:
    """Refuse a set-lr request that gives two trajectories, a non-positive LR, or nothing to change."""
    if scale is not None and lr is not None:
        raise CkptError("--scale and --lr both set the trajectory: give one")
    for name, v in (("--scale", scale), ("--lr", lr), ("--last-lr", last_lr)):
        if v is not None and not (math.isfinite(v) and v > 0):
            raise CkptError(f"{name} {v}: must be a positive finite number")
    if all(v is None for v in (scale, lr, last_lr, last_epoch, step_count)):
        raise CkptError("nothing to change: give --scale, --lr, --last-lr, --last-epoch or --step-count")


def _factors(
    files: list[_File],
    idx: int,
    kind: str,
    cfg: dict | None,
    scale: float | None,
    lr: float | None,
    group: int | None,
) -> tuple[list[int], list[float], bool]:
    """(the param groups edited, the factor per group, whether the state is flattened per parameter) for
    optimizer `idx`: `scale` for the selected groups, or `lr` / the group's base LR; 1.0 elsewhere."""
    n, flat = _n_groups(files, idx)
    if flat and group is not None:
        raise CkptError(
            f"--group {group}: optimizer {idx}'s state is flattened per parameter "
            "(flatten_optimizer_state_dict=True) and keeps no group numbers; use --scale for all "
            "groups"
        )
    sel = _select(n, group)
    factors = [1.0] * n
    if scale is not None:
        factors = [scale if g in sel else 1.0 for g in range(n)]
    elif lr is not None:
        base = _base_lrs(files, kind, cfg, n, idx)
        factors = [lr / base[g] if g in sel else 1.0 for g in range(n)]
    if flat and len(set(factors)) > 1:
        raise CkptError(
            f"--lr gives the groups of optimizer {idx} different factors "
            f"({', '.join(f'{x:.6g}' for x in factors)}), but its state is flattened per parameter: "
            "use --scale"
        )
    return sel, factors, flat


def _optimizer_notes(
    who: str,
    kind: str,
    factors: list[float],
    flat: bool,
    lr: float | None,
    last_lr: float | None,
    idx_change: dict | None,
    retrajectory: bool,
    relaunch: str,
    job_lrs: str,
) -> list[str]:
    """What the plan says about one optimizer's edit: which field drives its LR after resume, and what else the
    relaunch needs (DeepSpeed's launch config, Megatron's command line, torchtitan's job config).
    `retrajectory`: the request changes the trajectory (--scale or --lr)."""
    notes = [f"{who}scheduler: {SCHEDULER_LABEL[kind]}; the LR after resume comes from {DRIVER[kind]}"]
    if lr is not None:
        notes.append(
            f"{who}--lr {lr:g}: base LR set; factor per group {', '.join(f'{x:.6g}' for x in factors)} "
            "applied to every LR field"
        )
    if last_lr is not None:
        notes.append(
            f"{who}--last-lr {last_lr:g}: the LR in effect now (_last_lr and the optimizer lr)"
            + ("; the trajectory is unchanged from the next scheduler.step()" if kind == CLOSED_FORM else "")
        )
    if kind == DEEPSPEED:
        if idx_change:
            notes.append(
                "DeepSpeed's scheduler takes its LRs from the LAUNCH config: editing the checkpoint "
                "cannot change the trajectory. Apply this change to the ds_config you launch with: " + _json(idx_change)
            )
        elif retrajectory:
            notes.append(
                "DeepSpeed's scheduler takes its LRs from the launch config, and the saved ds_config "
                "names no LR to change: set the scheduler's LRs in your launch config"
            )
    if flat:
        notes.append(
            f"{who}param groups saved per parameter (flatten_optimizer_state_dict): every parameter's "
            "lr / initial_lr edited"
        )
    if kind == MEGATRON and relaunch and retrajectory:
        notes.append(relaunch)
    if kind == JOB_CONFIG and retrajectory:
        notes.append(
            "SET THE LR IN YOUR JOB CONFIG TOO: torchtitan rebuilds the schedule from the job config on "
            "resume, so this edit alone changes only the first resumed update. " + job_lrs
        )
    return notes


def _job_config_lrs(files: list[_File], idx: int, factor: float) -> tuple[str, dict[str, float]]:
    """The job-config LRs that give the edited trajectory, as the torchtitan flags to relaunch with: each saved
    group's initial_lr (the config LR of the run that saved it) times `factor`. Groups are the parameters that
    share every saved hyperparameter, in saved order (torchtitan saves its groups in its config's pattern order)."""
    groups: list[dict] = []
    for f in files:
        for _path, found, _i in _groups(f, idx):
            groups += [fields for fields, _ in flattened_groups(dict(found)) if fields not in groups]
    flags: dict[str, float] = {}
    pairs = []
    for n, g in enumerate(groups):
        v = g.get("initial_lr", g.get("lr"))
        if isinstance(v, (int, float)):
            flags[f"--optimizer.param-groups.{n}.optimizer-kwargs.lr"] = float(v) * factor
            pairs.append(f"{float(v):.6g} -> {float(v) * factor:.6g}")
    text = (
        f"Config LR per param group ({', '.join(pairs)}): relaunch torchtitan with "
        + " ".join(f"{k} {v:.6g}" for k, v in flags.items())
        + " (torchtitan 0.3.0's option; N is the group's place in your config's optimizer.param_groups, "
        "groups whose pattern matched no parameter are not saved)"
    )
    return text, flags


def _apply_lr(
    files: list[_File],
    idx: int,
    kind: str,
    factors: list[float],
    sel: list[int],
    flat: bool,
    last_lr: float | None,
    last_epoch: int | None,
    step_count: int | None,
    change: dict | None,
) -> None:
    """Edit every LR field of optimizer `idx` and its scheduler in every file (every rank)."""
    n = len(factors)
    for f in files:
        for path, s, i in f.found.schedulers:
            if i != idx:
                continue
            for key in SCHED_LR_LISTS:
                v = s.get(key)
                if isinstance(v, list) and len(v) == n:
                    new = _scaled(v, factors)
                    if last_lr is not None and key == "_last_lr":
                        new = [last_lr if g in sel else x for g, x in enumerate(new)]
                    f.set(s, path, key, new, _note(kind, key, _COSMETIC))
            for key in SCHED_LR_SCALARS:
                if isinstance(s.get(key), (int, float)) and len(set(factors)) == 1:
                    f.set(s, path, key, s[key] * factors[0], _note(kind, key, _COSMETIC))
            _set_position(f, path, s, kind, last_epoch, step_count)
        for path, groups, _i in _groups(f, idx):
            for pos, (g, pg) in enumerate(groups):
                gi = 0 if flat else pos
                if not flat and gi not in sel:
                    continue
                factor = factors[gi] if factors else 1.0
                for key in GROUP_LR_FIELDS:
                    v = pg.get(key)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        new = v * factor
                        if last_lr is not None and key == "lr":
                            new = last_lr
                        f.set(pg, path + (g,), key, new, _note(kind, key, _COSMETIC))
        ms = _megatron_scheduler(f) if kind == MEGATRON else None
        if ms is not None and len(set(factors)) == 1:
            for key in ("max_lr", "min_lr"):
                if isinstance(ms.get(key), (int, float)):
                    f.set(ms, ("opt_param_scheduler",), key, ms[key] * factors[0], _note(kind, "scheduler"))
        elif ms is not None and any(x != 1.0 for x in factors):
            raise CkptError(
                "Megatron's scheduler holds one max_lr/min_lr for every param group: --group or an --lr "
                "that gives the groups different factors cannot be made consistent with it",
                hint="use --scale (or --lr when every group has the same max_lr)",
            )
        if f.found.ds_config and change:
            cpath, c = f.found.ds_config
            for section, sub in change.items():
                if not isinstance(c.get(section), dict) or not isinstance(c[section].get("params"), dict):
                    raise CorruptCheckpoint(
                        f"ds_config in {f.rel} has no {section}.params while another file's "
                        "ds_config has them: the files of this checkpoint disagree",
                        path=f.path,
                        hint="copy the file back from where the checkpoint was saved",
                    )
                params = c[section]["params"]
                for key, new in sub["params"].items():
                    f.set(params, cpath + (section, "params"), key, new, _note(DEEPSPEED, "ds_config"))


def _set_position(f: _File, path: tuple, s: dict, kind: str, last_epoch: int | None, step_count: int | None) -> None:
    if last_epoch is not None:
        key = "last_batch_iteration" if kind == DEEPSPEED else "last_epoch"
        if key in s:
            f.set(s, path, key, int(last_epoch), _note(kind, key, "position on the schedule"))
    if step_count is not None and "_step_count" in s:
        f.set(s, path, "_step_count", int(step_count), _note(kind, "_step_count", "bookkeeping"))


def _json(d: Any) -> str:
    return json.dumps(d, sort_keys=True)


# --- set-step -------------------------------------------------------------------------------------------


def plan_set_step(
    ck: Checkpoint,
    *,
    step: int | None = None,
    optimizer_step: int | None = None,
    global_step: int | None = None,
    last_epoch: int | None = None,
    step_count: int | None = None,
    optimizer: int | None = None,
    allow_unread: bool = False,
    trust_pickles: bool = False,
) -> LrPlan:
    """The write that sets step counters in every file, rank and param group.

    `optimizer_step`: Adam's `step` (every state entry; FusedAdam-style group `step` too). `global_step`:
    DeepSpeed `global_steps` (+ `global_samples` when it was global_steps x train_batch_size) or a plain
    training dict's `step`/`global_step`/`iteration`. `last_epoch` / `step_count`: the scheduler (DeepSpeed:
    last_batch_iteration). `step`: all of them coherently for N optimizer updates: Adam step N - skipped,
    global step N, last_epoch = world_size x (N - skipped) (Accelerate steps the scheduler once per process),
    _step_count = last_epoch + 1, DeepSpeed last_batch_iteration = N - skipped - 1.
    """
    values = (step, optimizer_step, global_step, last_epoch, step_count)
    if all(v is None for v in values):
        raise CkptError("nothing to change: give --step, --optimizer-step, --global-step, --last-epoch or --step-count")
    ck = guard(ck, ck.path, "set-step", allow_unread=allow_unread, trust_pickles=trust_pickles)
    if any(v is not None and v < 0 for v in values[:3]):
        raise CkptError("step counters must be >= 0")
    root, files, world = _collect(ck)
    picked = _pick(files, optimizer)
    kinds = {idx: _kind(files, idx, bool(ck.details.get("scheduler_rebuilt")))[0] for idx in picked}
    updates = None
    if step is not None:
        skipped = ck.counters.skipped_steps or 0
        updates = step - skipped
        optimizer_step = updates if optimizer_step is None else optimizer_step
        global_step = step if global_step is None else global_step
    for f in files:
        _set_scheduler_positions(f, kinds, updates, last_epoch, step_count, world)
        if optimizer_step is not None:
            _set_optimizer_steps(f, kinds, optimizer_step)
        if global_step is not None:
            _set_loop_counters(f, global_step)
    units = _megatron_position(files, kinds, last_epoch, updates, ck.counters.global_step)
    check_steps_shared(files)
    notes = _step_notes(kinds, units, optimizer_step, world)
    return _finish(ck, root, files, "set-step", left_behind(ck) + notes, kinds, None, world)


def _set_scheduler_positions(
    f: _File, kinds: dict[int, str], updates: int | None, last_epoch: int | None, step_count: int | None, world: int
) -> None:
    """Each picked scheduler's position in `f`: as given, or (`updates`: --step N) N updates' worth."""
    for path, s, idx in f.found.schedulers:
        if idx not in kinds:
            continue
        le, sc = last_epoch, step_count
        if updates is not None and le is None:
            le = updates - 1 if kinds[idx] == DEEPSPEED else world * updates
        if updates is not None and sc is None and kinds[idx] != DEEPSPEED:
            sc = le + 1
        _set_position(f, path, s, kinds[idx], le, sc)


def _set_optimizer_steps(f: _File, kinds: dict[int, str], optimizer_step: int) -> None:
    """Adam's `step` of each picked optimizer in `f`: every state entry, Megatron's common_step, a group's step."""
    for path, osd, idx in f.found.optimizers:
        if idx not in kinds:
            continue
        state = osd.get("state")
        for pid, entry in state.items() if isinstance(state, dict) else ():
            if isinstance(entry, dict) and "step" in entry:
                _set_step(f, entry, path + ("state", pid), optimizer_step)
            elif pid == "common_step" and isinstance(entry, TensorRef) and entry.numel == 1:
                # Megatron's torch_dist common.pt: one 0-d step per optimizer (each inner one of a
                # ChainedOptimizer), restored into every parameter's `step` at load
                _set_step(f, state, path + ("state",), optimizer_step, key="common_step")
    for path, groups, idx in _groups(f):
        for g, pg in groups:
            if idx in kinds and as_int(pg.get("step")) is not None:  # FusedAdam/CPUAdam keep it here
                f.set(pg, path + (g,), "step", type(pg["step"])(optimizer_step), "Adam step (bias correction)")


def _set_loop_counters(f: _File, global_step: int) -> None:
    """The training loop's step counters in `f` (DeepSpeed's global_samples too, when it was steps x batch)."""
    tbs = as_int(((f.found.ds_config or ((), {}))[1]).get("train_batch_size"))
    old_steps = next((o.get(k) for _, o, k in f.found.counters if k == "global_steps"), None)
    for path, owner, key in f.found.counters:
        if key == "global_samples":
            if tbs and old_steps is not None and owner[key] == old_steps * tbs:
                f.set(owner, path, key, global_step * tbs, "samples seen (global_steps x train_batch_size)")
            continue
        if isinstance(owner[key], TensorRef):
            f.set_tensor_value(owner, path, key, global_step, "training-loop step counter")
        else:
            f.set(owner, path, key, global_step, "training-loop step counter")


def _step_notes(kinds: dict[int, str], units: str, optimizer_step: int | None, world: int) -> list[str]:
    """What the set-step plan says: each optimizer's LR driver, Megatron's units, Adam's step, the world size."""
    notes = [
        f"{f'optimizer {i}: ' if len(kinds) > 1 else ''}scheduler: {SCHEDULER_LABEL[k]}; the LR after resume "
        f"comes from {DRIVER[k]}"
        for i, k in kinds.items()
    ]
    if units:
        notes.append(units)
    if optimizer_step is not None:
        notes.append(f"Adam step -> {optimizer_step} in every rank and param group: bias correction resumes from it")
    if world > 1 and DEEPSPEED not in kinds.values():
        notes.append(
            f"{world} processes step the scheduler once each per optimizer step, so last_epoch "
            f"= {world} x optimizer step"
        )
    return notes


def _megatron_position(
    files: list[_File], kinds: dict[int, str], num_steps: int | None, updates: int | None, iteration: int | None
) -> str:
    """Megatron's scheduler position (`num_steps`, in its own units: samples, i.e. iterations x global batch, when
    the run's schedule was given in iterations or samples): `--last-epoch` sets it as given; `--step N` sets it to N
    iterations' worth, the units read off the saved file (num_steps / iteration). Returns the plan note."""
    if MEGATRON not in kinds.values() or (num_steps is None and updates is None):
        return ""
    note = ""
    for f in files:
        ms = _megatron_scheduler(f)
        if ms is None:
            continue
        n = num_steps
        if n is None:
            it, saved = iteration, as_int(ms.get("num_steps"))  # as opened (the loop above may have set it)
            if not it or saved is None or saved % it:
                raise UnsupportedCheckpoint(
                    f"{f.rel}: num_steps {saved} is not a whole number of iterations "
                    f"({it}): the per-iteration batch changed (batch-size ramp-up?)",
                    path=f.path,
                    hint="give the position in samples with --last-epoch",
                )
            n = updates * (saved // it)
            note = (
                f"Megatron scheduler num_steps -> {n} ({updates} iterations x {saved // it} samples each, as "
                "saved); args.consumed_train_samples (the data position) is not changed"
            )
        f.set(
            ms,
            ("opt_param_scheduler",),
            "num_steps",
            int(n),
            "DRIVES: position on the schedule (samples: iterations x global batch)",
        )
    return note or f"Megatron scheduler num_steps -> {num_steps} (its own units: samples)"


def _set_step(f: _File, entry: dict, path: tuple, value: int, key: str = "step") -> None:
    v = entry[key]
    note = "Adam step (bias correction)"
    if isinstance(v, TensorRef):
        f.set_tensor_value(entry, path, key, float(value) if v.dtype.startswith("float") else value, note)
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        f.set(entry, path, key, type(v)(value), note)


def _finish(
    ck: Checkpoint,
    root: Path,
    files: list[_File],
    command: str,
    notes: list[str],
    kinds: dict[int, str],
    change: dict | None,
    world: int,
) -> LrPlan:
    """The LrPlan of the edits made to `files`: refused when the request matched no field, or changed none."""
    if not any(f.matched for f in files):
        raise CkptError(
            f"{command}: none of the requested fields exists in this checkpoint (searched "
            f"{', '.join(f.rel for f in files)}: optimizer param_groups, scheduler state, Adam step, "
            "loop counters); nothing was changed",
            path=ck.path,
            hint="`ckpt inspect` shows which LR and counter fields it holds",
        )
    writes = file_writes(files)
    verify = read_back_check(ck.path, files)
    if not writes:
        # a no-op is an error: a script that asked for a change must not read exit 0 as "done"
        raise CkptError(
            f"{command}: nothing to change: no field that this request edits differs from the requested "
            f"value (searched {', '.join(f.rel for f in files)}); nothing was written",
            path=ck.path,
            hint="`ckpt inspect --grep 'lr|step'` shows the fields and their values",
        )
    plan = io.WritePlan(
        root, command, tuple(writes), tuple(notes), verify, trust_pickles=bool(ck.details.get("carried_pickles"))
    )
    kind = kinds[min(kinds)] if kinds else NO_SCHEDULER
    return LrPlan(plan, kind, DRIVER[kind], change, world, dict(kinds))


def set_lr(
    path: str | Path, *, backup_dir: Path | None = None, on_stage=None, copy: bool = False, **kw
) -> tuple[LrPlan, io.Transaction | None]:
    """Open, plan and execute `set-lr` in one call (the library's `ckpt set-lr --yes`)."""
    p = plan_set_lr(open_checkpoint(path), **kw)
    return p, (io.execute(p.plan, backup_dir=backup_dir, on_stage=on_stage, copy=copy) if p.plan.writes else None)


def set_step(
    path: str | Path, *, backup_dir: Path | None = None, on_stage=None, copy: bool = False, **kw
) -> tuple[LrPlan, io.Transaction | None]:
    """Open, plan and execute `set-step` in one call (the library's `ckpt set-step --yes`)."""
    p = plan_set_step(open_checkpoint(path), **kw)
    return p, (io.execute(p.plan, backup_dir=backup_dir, on_stage=on_stage, copy=copy) if p.plan.writes else None)


__all__ = [
    "LrPlan",
    "plan_set_lr",
    "plan_set_step",
    "set_lr",
    "set_step",
    "scheduler_kind",
    "config_change",
    "CLOSED_FORM",
    "CHAINABLE",
    "ONE_CYCLE",
    "DEEPSPEED",
    "NO_SCHEDULER",
]
