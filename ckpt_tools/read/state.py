"""Where a checkpoint's training state lives: the map every writing operation reads.

Each format module answers one question, `training_state(ck) -> StateMap`: which files (or DCP folders) hold
training state, and how many scheduler steps one optimizer update makes. What is *inside* those files is then
found by shape, the same way for every format (`locate`):

    optimizer state dict   a dict with `param_groups` (a list of dicts with `lr`, or, when saved with
                           `flatten_optimizer_state_dict=True`, a dict of per-parameter dicts with `lr`)
    scheduler state dict   a dict with `last_epoch` and `base_lrs`/`_step_count`/`min_lrs` (torch), or
                           only `last_batch_iteration` (DeepSpeed's own schedulers)
    loop counters          `global_step(s)`, `global_samples`, `iteration`, `step(s)` as ints, at the top of a
                           file or one level down (`train_state.step`, `app.step`)
    ds_config              DeepSpeed's saved launch config (top level of model states)

so a Lightning `.ckpt` (`optimizer_states` / `lr_schedulers` lists), an HF Trainer `optimizer.pt`, a DeepSpeed
optim_states file and a DCP folder nested under `app` all need no code of their own in `ops/`. Several
optimizers are numbered (`index`): by the format (Accelerate's `optimizer_1.bin`) or by their position in a
list (Lightning); the scheduler with the same number belongs to that optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .pickle_reader import TensorRef
from .tree import GroupNode, OpaqueNode, Warning_

#: loop-counter key names (ints): training loops, DeepSpeed, Megatron, torchtitan
COUNTER_KEYS = ("global_step", "global_steps", "global_samples", "iteration", "step", "steps")
_MAX_DEPTH = 8


@dataclass(frozen=True)
class StateSource:
    """One file, or one DCP folder (`kind="dcp"`), that holds training state."""

    path: Path
    rel: str  # as shown to the user, relative to the map's root
    kind: str = "torch"  # "torch": a torch.save zip file; "dcp": a DCP folder read as one state dict
    counters: bool = True  # search it for loop counters (False for a script's own custom state)
    index: int | None = None  # the optimizer/scheduler number the format gives this file (optimizer_1.bin -> 1)
    #: loop counters that shape alone does not find (Lightning's loop progress), as key paths into the file
    counter_paths: tuple[tuple, ...] = ()


@dataclass(frozen=True)
class StateMap:
    """What a format module says about where `ck`'s training state lives."""

    root: Path  # the folder writes are planned against (backups and the journal are kept outside it)
    sources: tuple[StateSource, ...]
    scheduler_steps_per_update: int = 1  # Accelerate steps the scheduler once per process per update
    read_only: str | None = None  # why this checkpoint cannot be edited (None: it can)
    hint: str | None = None


@dataclass
class Found:
    """What `locate` found inside one loaded object: key paths to each piece of state."""

    optimizers: list[tuple[tuple, dict, int]] = field(default_factory=list)  # (path, state dict, index)
    schedulers: list[tuple[tuple, dict, int]] = field(default_factory=list)
    counters: list[tuple[tuple, dict, str]] = field(default_factory=list)  # (owner path, owner, key)
    ds_config: tuple[tuple, dict] | None = None

    def __bool__(self) -> bool:
        return bool(self.optimizers or self.schedulers or self.counters)


def is_optimizer_state(obj: Any) -> bool:
    if not isinstance(obj, Mapping):
        return False
    groups = obj.get("param_groups")
    if isinstance(groups, list):
        return bool(groups) and all(isinstance(g, Mapping) and "lr" in g for g in groups)
    if isinstance(groups, Mapping):  # DCP: keyed "0", "1", ...; flattened: one group dict per parameter FQN
        return bool(groups) and all(isinstance(g, Mapping) and "lr" in g for g in groups.values())
    return False


def is_scheduler_state(obj: Any) -> bool:
    if not isinstance(obj, Mapping) or not obj:
        return False
    keys = set(map(str, obj))
    if "last_epoch" in keys and keys & {"base_lrs", "_step_count", "min_lrs", "_last_lr"}:
        return True
    return "last_batch_iteration" in keys and len(keys) <= 3


def group_dicts(osd: dict) -> list[dict]:
    """The param-group dicts of an optimizer state dict, in order (per parameter when flattened)."""
    groups = osd.get("param_groups")
    if isinstance(groups, Mapping):
        return [g for g in groups.values() if isinstance(g, Mapping)]
    return [g for g in (groups or []) if isinstance(g, dict)]


def is_flattened(osd: Mapping) -> bool:
    """Param groups saved once per parameter FQN (`flatten_optimizer_state_dict=True`), not numbered."""
    groups = osd.get("param_groups")
    return isinstance(groups, Mapping) and not all(str(k).isdigit() for k in groups)


def _is_weights(d: dict) -> bool:
    return bool(d) and all(isinstance(v, TensorRef) for v in d.values())


def locate(
    obj: Any, *, index: int | None = None, counters: bool = True, counter_paths: tuple[tuple, ...] = ()
) -> Found:
    """Find optimizer and scheduler state dicts, loop counters and ds_config inside one loaded object
    (plus the counters at `counter_paths`, which the format names)."""
    found = Found()
    if isinstance(obj, dict) and isinstance(obj.get("ds_config"), dict):
        found.ds_config = (("ds_config",), obj["ds_config"])
    if counters:
        _counters(obj, (), found, depth=0)
    for path in counter_paths:
        owner = obj
        for k in path[:-1]:
            owner = owner.get(k) if isinstance(owner, dict) else None
        if isinstance(owner, dict) and _is_int(owner.get(path[-1])):
            found.counters.append((tuple(path[:-1]), owner, path[-1]))

    def walk(node: Any, path: tuple, depth: int, pos: int | None) -> None:
        if depth > _MAX_DEPTH:
            return
        if isinstance(node, dict):
            if is_optimizer_state(node):
                found.optimizers.append((path, node, index if index is not None else (pos or 0)))
                return
            if is_scheduler_state(node):
                found.schedulers.append((path, node, index if index is not None else (pos or 0)))
                return
            if _is_weights(node) or (path and path[-1] == "ds_config"):
                return
            for k, v in node.items():
                if isinstance(v, (dict, list)):
                    walk(v, path + (k,), depth + 1, pos)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, (dict, list)):
                    walk(v, path + (i,), depth + 1, i if pos is None else pos)

    walk(obj, (), 0, None)
    return found


def _counters(obj: Any, path: tuple, found: Found, depth: int) -> None:
    """Integer loop counters at the top of a file or one dict below it (torchtitan `train_state`, recipe `app`)."""
    if not isinstance(obj, dict) or is_optimizer_state(obj) or is_scheduler_state(obj) or _is_weights(obj):
        return
    for k, v in obj.items():
        if k in COUNTER_KEYS and _is_int(v):
            found.counters.append((path, obj, k))
        elif depth == 0 and isinstance(v, dict) and k != "ds_config":
            _counters(v, path + (k,), found, depth + 1)


def _is_int(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    return isinstance(v, TensorRef) and v.numel == 1 and v.shape == () and v.dtype.startswith("int")


__all__ = [
    "StateSource",
    "StateMap",
    "Found",
    "locate",
    "is_optimizer_state",
    "is_scheduler_state",
    "group_dicts",
    "is_flattened",
    "COUNTER_KEYS",
]


#: param-group fields a torch LR scheduler adds to the optimizer it drives (`initial_lr` by every LRScheduler,
#: `max_lr` / `min_lr` by OneCycleLR): their presence means a scheduler ran when the checkpoint was saved
SCHEDULER_TRACES = ("initial_lr", "max_lr")


def lost_scheduler_warnings(ck):
    """`ck` with a `scheduler-state-missing` warning when an optimizer's param groups carry a scheduler's traces
    (`initial_lr`, OneCycleLR's `max_lr`) while the checkpoint holds no scheduler state: the run that saved it had
    a scheduler, and a resume from it restarts the schedule from its first step. Megatron's param groups carry
    `max_lr` natively, and its scheduler is `opt_param_scheduler`: any saved scheduler section counts."""
    if ck.details.get("scheduler_rebuilt"):  # the format's word: its producer rebuilds the schedule on resume
        return ck
    top = ck.tree.children
    if any(
        k.startswith(("scheduler", "lr_scheduler", "opt_param_scheduler"))
        and v is not None
        and not (isinstance(v, (GroupNode, OpaqueNode)) and not v.children)
        for k, v in top.items()
    ):
        return ck
    client = top.get("client_state")
    if isinstance(client, GroupNode) and any(
        isinstance(client.children.get(k), (GroupNode, OpaqueNode)) and client.children[k].children
        for k in ("opt_param_scheduler", "lr_scheduler", "lr_schedulers", "scheduler")
    ):
        return ck
    traces = set()
    for name, opt in top.items():
        if not name.startswith("optimizer") or not isinstance(opt, GroupNode):
            continue
        groups = opt.children.get("param_groups")
        for g in groups.children.values() if isinstance(groups, GroupNode) else ():
            if isinstance(g, GroupNode):
                traces |= {t for t in SCHEDULER_TRACES if t in g.children}
    if not traces:
        return ck
    w = Warning_(
        "scheduler-state-missing",
        f"the optimizer's param groups carry {', '.join(sorted(traces))} (a learning-rate scheduler drove "
        "this run) but the checkpoint holds no scheduler state: a resume restarts the schedule from its "
        "first step (warm-up again) unless the run rebuilds it from the step count",
    )
    return replace(ck, warnings=(w, *ck.warnings))
