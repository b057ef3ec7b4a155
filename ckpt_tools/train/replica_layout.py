"""What a model-free replica is made of, read from a checkpoint without torch: the parameter specs in the model's
order, tied aliases, buffers and param groups of a DeepSpeed tree (`replica_layout`), and the torch scheduler class
a saved scheduler state belongs to (`infer_torch_scheduler`). The planners (`ckpt resume`, `ckpt convert`) use it
in the `ckpt` process, which stays torch-free; `train.replica` builds the torch module from it in the worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..read import pickle_reader
from ..read.pickle_reader import TensorRef
from ..read.tree import GroupNode, node_to_python


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name, e.g. "bfloat16"
    requires_grad: bool = True


@dataclass(frozen=True)
class GroupSpec:
    """One optimizer param group as the checkpoint saved it: its members (in flattening order) and its
    hyper-parameters (everything but `params`, as saved: lr, betas, eps, weight_decay, ...)."""

    names: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)


def _model_states(ck: Any) -> dict[str, Any]:
    """The first model-states pickle of a DeepSpeed tree (ZeRO, universal), read with ckpt's safe reader."""
    base = Path(ck.path)
    base = base if base.is_dir() else base.parent
    cands = [
        f.path
        for f in ck.files
        if f.role == "model"
        and f.path.endswith("model_states.pt")
        and "/layer_" not in f.path
        and not Path(f.path).name.startswith("layer_")
    ]
    if not cands:
        raise ValueError("no DeepSpeed model states file in this checkpoint")
    cands.sort(key=lambda p: (not Path(p).name.startswith("mp_rank_"), p))
    loaded = pickle_reader.load(base / cands[0])
    try:
        obj = loaded.obj
    finally:
        if loaded.source is not None:
            loaded.source.close()
    if not isinstance(obj, dict):
        raise ValueError(f"{cands[0]} does not hold a dict")
    return obj


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v)


def _param_shape_groups(ms: Mapping[str, Any]) -> list[dict[str, tuple[int, ...]]]:
    ps = ms.get("param_shapes")
    if isinstance(ps, dict):
        ps = [ps]
    return [{str(k): _shape(v) for k, v in g.items()} for g in (ps or []) if isinstance(g, dict)]


def replica_layout(ck: Any) -> dict[str, Any]:
    """Everything a DeepSpeed replica needs, from the model states file (no tensor bytes read):
    {"specs": [ParamSpec], "tied": {alias: owner}, "buffers": {name: (shape, dtype)}, "groups": [[names]]}.

    Order: the saved `module` state dict's order (the model's own `named_parameters()` order, frozen
    parameters in place), falling back to `param_shapes` order then frozen ones. Group membership and the
    order inside each group: `param_shapes` (DeepSpeed flattens each group in that order)."""
    ms = _model_states(ck)
    shape_groups = _param_shape_groups(ms)
    if not shape_groups:
        raise ValueError("the model states hold no param_shapes")
    trainable = {n: s for g in shape_groups for n, s in g.items()}
    frozen_raw = ms.get("frozen_param_shapes")
    frozen = {str(k): _shape(v) for k, v in frozen_raw.items()} if isinstance(frozen_raw, dict) else {}
    shared = (
        {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
        if isinstance(ms.get("shared_params"), dict)
        else {}
    )
    buffer_names = [str(b) for b in ms.get("buffer_names") or []]
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    default_dtype = _run_dtype(ms.get("ds_config"))
    if not frozen and module:
        # ZeRO-1 records no frozen_param_shapes: a frozen weight is only in `module`
        known = set(trainable) | set(buffer_names) | set(shared)
        frozen = {
            str(n): _shape(r.shape)
            for n, r in module.items()
            if isinstance(r, TensorRef) and r.numel > 0 and str(n) not in known
        }
    shapes = {**trainable, **frozen}
    order = [str(n) for n in module if str(n) in shapes] if module else []
    order += [n for n in list(trainable) + list(frozen) if n not in set(order)]

    def dtype_of(name: str) -> str:
        r = module.get(name)
        if isinstance(r, TensorRef) and str(r.dtype) in ("float32", "bfloat16", "float16", "float64"):
            return str(r.dtype)
        return default_dtype

    specs = [ParamSpec(n, shapes[n], dtype_of(n), n in trainable) for n in order]
    buffers = {}
    for b in buffer_names:
        r = module.get(b)
        if isinstance(r, TensorRef):
            buffers[b] = (_shape(r.shape), str(r.dtype))
    return {"specs": specs, "tied": shared, "buffers": buffers, "groups": [list(g) for g in shape_groups]}


def _run_dtype(cfg: Any) -> str:
    cfg = cfg if isinstance(cfg, dict) else {}
    if (cfg.get("bf16") or {}).get("enabled"):
        return "bfloat16"
    if (cfg.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


def specs_from_checkpoint(ck: Any) -> tuple[list[ParamSpec], dict[str, str]]:
    """(parameter specs in the model's order, tied {alias: owner}) of a DeepSpeed tree (ZeRO 1/2/3 or
    universal): names and shapes from `param_shapes` / `frozen_param_shapes`, order from the saved module,
    dtypes from the saved module tensors (else the run's precision), `shared_params` as tied aliases."""
    lay = replica_layout(ck)
    return lay["specs"], lay["tied"]


def groups_from_checkpoint(ck: Any) -> list[GroupSpec]:
    """The optimizer param groups as saved: membership and order from `param_shapes`, hyper-parameters
    (lr, betas, eps, weight_decay, ...) from the saved optimizer's param_groups."""
    lay = replica_layout(ck)
    saved = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) or {}
    opts = [saved[k] for k in sorted(saved, key=int)] if saved else []
    out = []
    for i, names in enumerate(lay["groups"]):
        o = {k: v for k, v in (opts[i] if i < len(opts) else {}).items() if k != "params"}
        out.append(GroupSpec(tuple(names), o))
    return out


# --- torch schedulers from their state dict ---------------------------------------------------------

#: state-dict keys that identify each torch scheduler, and the constructor arguments read back from them
_TORCH_SCHEDULERS: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    ("OneCycleLR", frozenset({"total_steps", "_schedule_phases"}), ()),
    ("CyclicLR", frozenset({"max_lrs", "total_size", "step_ratio"}), ()),
    ("CosineAnnealingWarmRestarts", frozenset({"T_0", "T_i", "T_mult", "T_cur"}), ("T_0", "T_mult", "eta_min")),
    ("CosineAnnealingLR", frozenset({"T_max", "eta_min"}), ("T_max", "eta_min")),
    ("MultiStepLR", frozenset({"milestones", "gamma"}), ("milestones", "gamma")),
    ("StepLR", frozenset({"step_size", "gamma"}), ("step_size", "gamma")),
    (
        "LinearLR",
        frozenset({"start_factor", "end_factor", "total_iters"}),
        ("start_factor", "end_factor", "total_iters"),
    ),
    ("PolynomialLR", frozenset({"total_iters", "power"}), ("total_iters", "power")),
    ("ConstantLR", frozenset({"factor", "total_iters"}), ("factor", "total_iters")),
    ("ExponentialLR", frozenset({"gamma"}), ("gamma",)),
    ("LambdaLR", frozenset({"lr_lambdas"}), ()),
)
#: param-group fields torch schedulers keep in the optimizer (restored from the saved groups)
_SCHED_GROUP_KEYS = ("initial_lr", "max_lr", "min_lr", "betas", "momentum", "max_momentum", "base_momentum")
#: schedulers whose LR comes from user code the checkpoint does not hold
LAMBDA_SCHEDULERS = ("LambdaLR", "MultiplicativeLR")


def infer_torch_scheduler(state: Mapping[str, Any], class_name: str | None = None) -> str | None:
    """The torch scheduler class a saved `state_dict()` belongs to: `class_name` when a pickle global named it,
    else from the keys only that class saves (a DeepSpeed checkpoint stores the bare dict)."""
    if class_name:
        return class_name.rsplit(".", 1)[-1]
    keys = set(state)
    for name, needed, _ in _TORCH_SCHEDULERS:
        if needed <= keys:
            return name
    return None
