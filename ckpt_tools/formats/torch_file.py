"""A single `torch.save` file (zip or legacy) or pickle: a training dict, a bare state dict, anything.

Recognises the common training-dict conventions to fill the header: `model`/`state_dict`/`module`
for weights, `optimizer`/`optim` for a torch optimizer state dict, `scheduler`/`lr_scheduler` for a
scheduler state dict, and `step`/`global_step`/`iteration` for the loop counter. A bare state dict
(name -> tensor) is the model.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..pickle_reader import TensorRef
from ..tree import (Checkpoint, Counters, GroupNode, LearningRates, TensorNode, Topology, as_int, iter_tensors,
                    to_node)
from . import _common as C

FORMAT = "torch_file"
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state")
OPTIM_KEYS = ("optimizer", "optim", "optimizer_state_dict", "optimizer_state")
SCHED_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")
STEP_KEYS = ("global_step", "step", "iteration", "steps")


def sniff(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fh:
            head = fh.read(2)
    except OSError:
        return False
    return head in (b"PK", ) or head[:1] == b"\x80"


def split_training_dict(obj: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model state dict, optimizer state dict, scheduler state dict, everything else) of a saved dict."""
    if not isinstance(obj, dict):
        return None, None, None, {"object": obj}
    if obj and all(isinstance(v, TensorRef) for v in obj.values()):
        return obj, None, None, {}
    pick = lambda keys: next((k for k in keys if isinstance(obj.get(k), dict)), None)  # noqa: E731
    mk, ok, sk = pick(MODEL_KEYS), pick(OPTIM_KEYS), pick(SCHED_KEYS)
    rest = {k: v for k, v in obj.items() if k not in (mk, ok, sk)}
    return (obj.get(mk) if mk else None), (obj.get(ok) if ok else None), (obj.get(sk) if sk else None), rest


def optimizer_tree(osd: dict, param_names: list[str], rel: str) -> GroupNode:
    """A torch optimizer state dict with integer param ids mapped to parameter names where possible.

    torch numbers parameters in param_groups order; a model state dict lists parameters in the same
    order as `model.parameters()` when it holds no buffers, which is the common case. When the counts
    disagree the ids are kept.
    """
    groups = osd.get("param_groups") if isinstance(osd.get("param_groups"), list) else []
    ids = [i for g in groups if isinstance(g, dict) for i in (g.get("params") or [])]
    names = param_names if len(param_names) == len(ids) else None
    id_to_name = {i: names[k] for k, i in enumerate(ids)} if names else {}
    state = osd.get("state") if isinstance(osd.get("state"), dict) else {}
    state_node = GroupNode({id_to_name.get(k, str(k)): to_node(v, rel) for k, v in state.items()})
    kids = {"state": state_node, "param_groups": to_node(groups, rel)}
    kids.update({k: to_node(v, rel) for k, v in osd.items() if k not in ("state", "param_groups")})
    return GroupNode(kids)


def open(path: Path) -> Checkpoint:  # noqa: A001
    cache = C.LoadCache(path.parent)
    loaded = cache.load(path)
    rel = path.name
    model, optim, sched, rest = split_training_dict(loaded.obj)
    tree: dict[str, Any] = {}
    names: list[str] = []
    if isinstance(model, dict):
        tree["model"] = to_node(model, rel)
        names = [k for k, v in model.items() if isinstance(v, TensorRef)]
    if isinstance(optim, dict):
        tree["optimizer"] = optimizer_tree(optim, names, rel)
    if isinstance(sched, dict):
        tree["scheduler"] = to_node(sched, rel)
    if rest:
        tree["client_state"] = to_node(rest, rel)
    root = GroupNode(tree)
    sf = C.scheduler_fields(tree.get("scheduler"))
    base_lrs, last_lr = C.lr_from_scheduler(sf)
    last_epoch, step_count = C.scheduler_counters(sf)
    steps = C.optimizer_steps(tree["optimizer"].children.get("state")) if "optimizer" in tree else []
    gstep = next((as_int(_value(rest.get(k))) for k in STEP_KEYS if as_int(_value(rest.get(k))) is not None), None)
    counters = Counters(global_step=gstep, optimizer_step=max(set(steps), key=steps.count) if steps else None,
                        scheduler_last_epoch=last_epoch, scheduler_step_count=step_count)
    lrs = C.param_group_lrs(tree["optimizer"].children.get("param_groups")) if "optimizer" in tree else ()
    model_tensors = [t for _, t in iter_tensors(tree["model"])] if "model" in tree else []
    warnings = C.counter_warnings(counters, optimizer_steps_seen=steps) + cache.warnings()
    return Checkpoint(
        format=FORMAT, path=str(path), topology=Topology(dp=None, tp=None, pp=None, zero_stage=None),
        tree=root, counters=counters, lr=LearningRates(lrs, base_lrs, last_lr),
        parameter_count=sum(math.prod(t.shape) for t in model_tensors), parameter_tensors=len(model_tensors),
        files=(C.file_info(path, path.parent, "checkpoint"),), warnings=tuple(warnings),
        dtypes=tuple(sorted({t.dtype for t in model_tensors})), details={"container": loaded.kind})


def _value(v: Any) -> Any:
    if isinstance(v, TensorRef) and v.numel == 1:
        try:
            return v.item()
        except Exception:
            return None
    return v


__all__ = ["sniff", "open", "split_training_dict", "optimizer_tree", "TensorNode"]
