"""What the framework planners share (`resume.hf_trainer`, `accelerate`, `dcp`, `lightning`, `megatron`, and the
DeepSpeed planner for the options and the device): the options `ckpt resume` was given (`ResumeOptions`), the plan a
framework worker reads (`FrameworkPlan`), the saved state read without the framework, the pickle gate, the device,
and the pieces a model-free replica is built from (parameters, optimizer groups, the saved scheduler)."""

from __future__ import annotations

import glob
import importlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError
from ..read import gate
from ..read.tree import Checkpoint, GroupNode, TensorNode, node_to_python
from .torch_schedules import torch_scheduler_kind
from .verdict import SavedState


@dataclass(frozen=True)
class ResumeOptions:
    """The options of `ckpt resume` (`frameworks.plan_resume`'s keywords), handed to the chosen framework's planner.
    The DeepSpeed-only ones (universal, config, data, against) are refused by every other planner, naming the
    option."""

    steps: int
    nproc: int | None = None
    device: str = "auto"
    universal: bool = False
    tp: int | None = None
    pp: int | None = None
    model: str = "auto"
    config: dict[str, Any] | None = None
    data: str | None = None
    trust_pickles: bool = False
    scheduler: str | None = None
    against: str | os.PathLike | None = None
    n_kv_heads: int | None = None
    framework_args: str | None = None
    no_scheduler: bool = False


@dataclass(frozen=True)
class PlannerOptions:
    """What the HF Trainer, Accelerate, DCP and Lightning planners take from `ckpt resume`'s options, the device
    already resolved (`frameworks._planner_options`)."""

    steps: int
    nproc: int | None
    device: str
    model: str
    scheduler: str | None
    trust_pickles: bool


@dataclass(frozen=True)
class RunPlan:
    """What every resume plan holds first (DeepSpeed's `ResumePlan` and the other frameworks' `FrameworkPlan`; the
    CLI renders both): the checkpoint as given, what it saved, the run's length and device, the processes and
    the data-parallel size."""

    path: str
    saved: SavedState
    steps: int
    device: str
    nproc: int
    dp: int


@dataclass(frozen=True)
class FrameworkPlan(RunPlan):
    """Everything decided before any process starts. Field names follow `ResumePlan` where they mean the same;
    `frameworks.run_resume` hands it to `framework_run.run_framework`, which starts the worker `framework`
    names."""

    framework: str
    model: str  # "real (config.json)" or "model-free"
    load_dir: str
    expected_lrs: tuple[tuple[float, ...] | None, ...] | None  # per update (None: not determined)
    lr_source: str
    loss_reference: dict[int, float] = field(default_factory=dict)
    loss_reference_source: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    lr_missing: str | None = None  # why the schedule cannot continue (a scheduler was attached, its state is gone)
    tp: int = 1
    pp: int = 1
    universal: bool = False
    micro_batch: int = 1
    gas: int = 1

    def worker_plan(self) -> dict[str, Any]:
        return _finite(
            {
                "framework": self.framework,
                "load_dir": self.load_dir,
                "device": self.device,
                "steps": self.steps,
                "expected_lrs": [None if x is None else list(x) for x in self.expected_lrs]
                if self.expected_lrs
                else None,
                **self.worker,
            }
        )


def plan_header(
    framework: str, path: Path, saved: SavedState, steps: int, device: str, nproc: int, dp: int | None = None
) -> dict[str, Any]:
    """The FrameworkPlan fields every planner fills the same way: which framework, the checkpoint as given, what it
    saved, the run's length and device, the processes and the data-parallel size (default: every process)."""
    return {
        "framework": framework,
        "path": str(path),
        "saved": saved,
        "steps": steps,
        "device": device,
        "nproc": nproc,
        "dp": nproc if dp is None else dp,
    }


# --- reading what the checkpoint says -------------------------------------------------------------


def inert_to_json(v: Any) -> Any:
    """A value the inert pickle reader produced (what `node_to_python` gives for a pickled object such as HF's
    TrainingArguments or Megatron's args namespace), as JSON: an enum, which the reader keeps as `{'value': x}`,
    becomes x; tuples become lists; any other object its str. Unlike `read.tree.jsonable` it unwraps enums and
    keeps non-finite floats (`_finite` maps those)."""
    if isinstance(v, dict):
        if set(v) == {"value"}:
            return inert_to_json(v["value"])
        return {str(k): inert_to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [inert_to_json(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _saved_state(
    ck: Checkpoint, sched: dict[str, Any], *, global_step: int | None, optimizer_step: int | None, dp: int
) -> SavedState:
    groups = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) or {}
    initial = (
        [g.get("initial_lr") for _, g in sorted(groups.items(), key=lambda kv: int(kv[0])) if isinstance(g, dict)]
        if all(str(k).isdigit() for k in groups)
        else []
    )
    if "last_epoch" in sched:
        kind, pos = "torch", sched["last_epoch"]
    else:
        kind, pos = "none", None
    return SavedState(
        format=ck.format,
        global_step=global_step,
        optimizer_step=optimizer_step,
        skipped_steps=ck.counters.skipped_steps,
        param_group_lrs=tuple(ck.lr.param_groups),
        initial_lrs=tuple(initial) if initial and all(x is not None for x in initial) else None,
        scheduler_state=kind,
        scheduler_position=pos,
        base_lrs=tuple(float(x) for x in sched["base_lrs"]) if sched.get("base_lrs") else None,
        loss=None,
        loss_key=None,
        ds_config={},
        has_universal_info=False,
        dp=dp,
        tp=1,
        pp=1,
    )


def _scheduler_gone(groups: list[dict[str, Any]], where: str) -> str | None:
    """A torch scheduler sets `initial_lr` in every param group when it is constructed: groups that carry it
    with no scheduler state saved beside them belonged to a run whose schedule cannot be continued."""
    if any("initial_lr" in g for g in groups):
        extra = " and max_lr/min_lr (a OneCycleLR)" if any("max_lr" in g for g in groups) else ""
        return (
            f"{where}: the param groups carry initial_lr{extra}, so a scheduler drove this run, but the "
            "checkpoint holds no scheduler state: a resumed run restarts the schedule (or runs without it)"
        )
    return None


def _optimizer_kind(groups: list[dict[str, Any]]) -> str:
    g = groups[0] if groups else {}
    if "betas" in g:
        return "adamw" if g.get("decoupled_weight_decay") else "adam"
    if "momentum" in g or "nesterov" in g:
        return "sgd"
    raise CkptError(
        f"the saved optimizer has param_group fields {sorted(g)}: not Adam, AdamW or SGD",
        hint="model-free resume knows torch Adam, AdamW and SGD",
    )


#: the optimizer-group hyper-parameters a replica's groups take from the saved ones (the DeepSpeed worker's
#: optimizer takes all but `maximize`)
GROUP_HYPERPARAMS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "momentum",
    "dampening",
    "nesterov",
    "initial_lr",
    "max_lr",
    "min_lr",
)


def _hyper(g: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in GROUP_HYPERPARAMS}


def _match_groups(
    tensors: list[tuple[str, list[int], str]],
    groups: list[dict[str, Any]],
    state_shapes: dict[int, tuple[int, ...]],
    where: str,
) -> list[list[str]]:
    """Assign the model's parameters to the saved optimizer's groups by position and shape: torch optimizer state
    dicts record ids, not names, so id i gets the first unassigned parameter (in the model file's order) of
    the saved moment's shape. Same-shaped parameters may swap; the load and the closed-form check are the
    same either way."""
    free = list(tensors)
    out: list[list[str]] = []
    for g in groups:
        names = []
        for pid in g.get("params", []):
            shape = state_shapes.get(int(pid))
            pick = next((t for t in free if shape is None or tuple(t[1]) == tuple(shape)), None)
            if pick is None:
                raise CkptError(
                    f"{where}: the saved optimizer's parameter {pid} (shape {shape}) has no parameter "
                    "of that shape in the model file",
                    hint="the model and optimizer files disagree",
                )
            free.remove(pick)
            names.append(pick[0])
        out.append(names)
    return out


def _device(device: str) -> str:
    if device not in ("cpu", "cuda", "auto"):
        raise CkptError(f"--device {device!r}: use cpu, cuda or auto")
    if device == "cpu":
        return device
    gpus = _gpus()
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if not gpus:
        raise CkptError("--device cuda: no CUDA device is visible", hint="use --device cpu")
    return device


#: the device files a GPU driver makes (NVIDIA's, ROCm's, WSL's): where none exists, no process on this machine
#: sees a CUDA device, so the count is 0 without importing torch (1-2 CPU s the `ckpt` process need not spend)
GPU_DEVICE_FILES = ("/dev/nvidia*", "/dev/kfd", "/dev/dxg")


def _gpus() -> int:
    """The CUDA devices this process sees (0 without CUDA); the DeepSpeed planner asks the same. torch is asked
    only on a machine with a GPU driver's device file (`GPU_DEVICE_FILES`)."""
    if not any(glob.glob(pattern) for pattern in GPU_DEVICE_FILES):
        return 0
    import torch  # lazy: torch only to count the GPUs of a machine with a GPU driver; planning stays torch-free

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _tensor_specs(node: Any) -> list[tuple[str, list[int], str]]:
    out = []
    for name, t in node.children.items() if isinstance(node, GroupNode) else []:
        if isinstance(t, TensorNode):
            out.append((str(name), list(t.shape), str(t.dtype)))
    return out


def _state_shapes(opt_node: Any) -> dict[int, tuple[int, ...]]:
    shapes: dict[int, tuple[int, ...]] = {}
    state = opt_node.children.get("state") if isinstance(opt_node, GroupNode) else None
    for pid, st in state.children.items() if isinstance(state, GroupNode) else []:
        for key in ("exp_avg", "momentum_buffer", "exp_avg_sq"):
            t = st.children.get(key) if isinstance(st, GroupNode) else None
            if isinstance(t, TensorNode) and str(pid).isdigit():
                shapes[int(pid)] = tuple(t.shape)
                break
    return shapes


def _groups_of(opt_node: Any) -> list[dict[str, Any]]:
    groups = (
        node_to_python(opt_node.children.get("param_groups", GroupNode())) if isinstance(opt_node, GroupNode) else None
    )
    if isinstance(groups, dict):
        return [g for _, g in sorted(groups.items(), key=lambda kv: int(kv[0])) if isinstance(g, dict)]
    return [g for g in (groups or []) if isinstance(g, dict)]


def _check_pickles(
    ck: Checkpoint, path: Path, trust_pickles: bool, who: str, never_loaded: tuple[str, ...] = ()
) -> None:
    """Refuse (unless trusted) a checkpoint whose pickles name globals outside the frameworks' classes, over the
    files the framework's loader will unpickle (`never_loaded`: file names it does not read on resume)."""
    if trust_pickles:
        return
    found = [f for f in gate.scan_checkpoint(ck) if Path(f.file).name not in never_loaded]
    gate.refuse(found, path, action=f"resuming runs {who}'s loader, which would execute it")


def _finite(v: Any) -> Any:
    """JSON-safe copy: DeepSpeed saves `steps_per_print: inf` ("never"); strict JSON has no Infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (2**31 - 1 if v > 0 else -(2**31 - 1))
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _specs_and_groups(
    ck: Checkpoint,
    path: Path,
    trust_pickles: bool,
    who: str,
    at: Path,
    *,
    weights: str,
    optimizer: str,
    hint: str | None = None,
) -> tuple[list, list[dict[str, Any]]]:
    """What a model-free replica is built from, after the pickle check: the saved weights' (name, shape,
    dtype) and the optimizer's param groups; a CkptError naming `at` when either is missing."""
    _check_pickles(ck, path, trust_pickles, who)
    specs = _tensor_specs(ck.tree.children.get("model"))
    if not specs:
        raise CkptError(f"no {weights}: the replica needs the parameter shapes", path=at)
    groups = _groups_of(ck.optimizer)
    if not groups:
        raise CkptError(f"no {optimizer}: nothing to resume", path=at, hint=hint)
    return specs, groups


def _saved_scheduler(kids: dict[str, Any], key: str, at: Path, not_torch: str) -> tuple[dict[str, Any], str | None]:
    """The saved scheduler state under `key` ({} when there is none) and its torch scheduler kind; a
    CkptError (`not_torch`) when it is not a torch scheduler this resume can rebuild."""
    sched = node_to_python(kids.get(key, GroupNode())) or {}
    kind = torch_scheduler_kind(sched) if sched else None
    if sched and kind is None and set(map(str, sched)) == {"last_epoch"}:
        raise CkptError(
            "the scheduler state holds only last_epoch (torchtitan's LRSchedulersContainer): the "
            "schedule itself is in the job config, which the checkpoint does not hold",
            path=at,
            hint="resume it in torchtitan with its job config (--checkpoint.load-step)",
        )
    if sched and kind is None:
        raise CkptError(not_torch, path=at)
    return sched, kind


def _replica_model(
    specs: list,
    groups: list[dict[str, Any]],
    names_by_group: list[list[str]],
    sched: dict[str, Any],
    kind: str | None,
    **more: Any,
) -> dict[str, Any]:
    """One model of the replica worker's plan: parameters, optimizer groups by name, saved scheduler."""
    return {
        "params": specs,
        "optimizer_kind": _optimizer_kind(groups),
        "groups": [{"names": nm, "hyper": _hyper(g)} for nm, g in zip(names_by_group, groups)],
        "scheduler_kind": kind,
        "scheduler_state": sched or None,
        **more,
    }


def _expected_lrs(rows: list) -> tuple[tuple[float, ...] | None, ...] | None:
    """Per-update expected LRs as the plan keeps them: None when no update's LRs are determined."""
    return tuple(None if r is None else tuple(r) for r in rows) if any(r is not None for r in rows) else None


def _scheduler_fn(spec: str | None) -> Callable[[int], float] | None:
    if not spec:
        return None
    module, _, func = spec.partition(":")
    if not module or not func:
        raise CkptError(f"--scheduler {spec!r}: use module:function (the LambdaLR's lr_lambda)")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise CkptError(f"--scheduler {spec!r}: {e}") from None
