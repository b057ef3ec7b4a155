"""A single `torch.save` file (zip or legacy) or pickle: a training dict, a bare state dict, anything.

Recognises the common training-dict conventions to fill the header: `model`/`state_dict`/`module`
for weights; optimizer and scheduler state dicts by shape (`state.is_optimizer_state` /
`is_scheduler_state`), one or a list of them (Lightning); the loop counter by `state.COUNTER_KEYS`. A bare
state dict (name -> tensor) is the model.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

from ..read.pickle_reader import TensorRef
from ..read.state import StateMap, StateSource, is_flattened, is_optimizer_state, is_scheduler_state
from ..read.tree import Checkpoint, GroupNode, TensorNode, Topology, iter_tensors, to_node
from . import _common as C

FORMAT = "torch_file"
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state")
SCHED_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")


def sniff(path: Path) -> bool:
    if not path.is_file():
        return False
    try:
        with path.open("rb") as fh:
            head = fh.read(2)
    except OSError:
        return False
    return head in (b"PK",) or head[:1] == b"\x80"


def split_training_dict(obj: Any) -> tuple[Any, list, list, dict[str, Any]]:
    """(model state dict, [optimizer state dicts], [scheduler state dicts], everything else) of a saved dict.

    Optimizer and scheduler states are recognised by shape (`state.is_optimizer_state` / `is_scheduler_state`)
    under the usual keys or as lists (Lightning's `optimizer_states` / `lr_schedulers`); one wrapper level
    around a whole training dict (the DCP recipe's `{"app": {model, optim, scheduler}}`) is looked through."""
    if not isinstance(obj, dict):
        return None, [], [], {"object": obj}
    if obj and all(isinstance(v, TensorRef) for v in obj.values()):
        return obj, [], [], {}
    if len(obj) == 1:
        (inner,) = obj.values()
        if isinstance(inner, dict) and not all(isinstance(v, TensorRef) for v in inner.values()):
            model, optims, scheds, rest = split_training_dict(inner)
            if model is not None or optims or scheds:
                return model, optims, scheds, rest
    mk = next((k for k in MODEL_KEYS if isinstance(obj.get(k), dict)), None)
    optims: list = []
    scheds: list = []
    rest: dict[str, Any] = {}
    for k, v in obj.items():
        if k == mk:
            continue
        vals = v if isinstance(v, list) and v else [v]
        if all(is_optimizer_state(x) for x in vals):
            optims += vals
        elif (all(is_scheduler_state(x) for x in vals) and (k in SCHED_KEYS or isinstance(v, list))) or (
            k in SCHED_KEYS and isinstance(v, dict) and set(map(str, v)) == {"last_epoch"}
        ):
            # torchtitan's lr_scheduler keeps only {last_epoch} (it rebuilds the rest from its job config)
            scheds += vals
        else:
            rest[k] = v
    return (obj.get(mk) if mk else None), optims, scheds, rest


def match_param_ids(
    group_ids: list[list[Any]], id_shapes: Mapping[Any, Any], names: list[str], name_shapes: Mapping[str, Any]
) -> dict[Any, str] | None:
    """Param id -> name for a torch optimizer state dict, or None when it cannot be told for sure.

    torch numbers parameters in param_groups order (group 0's, then group 1's, ...), not in model order: with
    a weight-decay split the ids of group 1 start where group 0's end. Each group's parameters are taken to
    be in model order (`[p for p in model.parameters() if ...]`); every id then goes to the next unused name
    of its group whose shape is the shape of its state tensors (`id_shapes`; None: no state, any shape). The
    answer is kept only when it does not depend on the order the groups are matched in (forward and
    backward give the same names) and every shape fits."""
    if sum(len(g) for g in group_ids) != len(names):
        return None

    def run(order: list[int]) -> dict[Any, str] | None:
        used: set[str] = set()
        out: dict[Any, str] = {}
        for gi in order:
            pos = 0
            for i in group_ids[gi]:
                want = id_shapes.get(i)
                while pos < len(names) and (
                    names[pos] in used or (want is not None and tuple(name_shapes.get(names[pos], ())) != tuple(want))
                ):
                    pos += 1
                if pos >= len(names):
                    return None
                out[i] = names[pos]
                used.add(names[pos])
                pos += 1
        return out

    fwd = run(list(range(len(group_ids))))
    if fwd is None or len(group_ids) == 1:
        return fwd
    return fwd if run(list(reversed(range(len(group_ids))))) == fwd else None


def _state_shapes(state: Mapping) -> dict[Any, Any]:
    """id -> the shape of its per-element state tensors (the first tensor of more than one element)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            for x in v.values():
                if isinstance(x, TensorRef) and x.numel > 1:
                    out[k] = tuple(x.shape)
                    break
    return out


def optimizer_tree(
    osd: dict, param_names: list[str], rel: str, param_shapes: Mapping[str, Any] | None = None
) -> GroupNode:
    """A torch optimizer state dict with integer param ids mapped to parameter names where possible.

    torch numbers parameters in param_groups order. With `param_shapes` (name -> shape of the model's
    parameters, in model order) ids are matched by `match_param_ids` (and kept when that cannot tell);
    without, a model state dict's order is taken as the ids' order (right for one param group).
    When the counts disagree the ids are kept.
    """
    if is_flattened(osd):
        return flattened_optimizer_tree(osd, rel)
    groups = osd.get("param_groups") if isinstance(osd.get("param_groups"), list) else []
    ids = [i for g in groups if isinstance(g, dict) for i in (g.get("params") or [])]
    state = osd.get("state") if isinstance(osd.get("state"), dict) else {}
    if param_shapes is not None:
        group_ids = [list(g.get("params") or []) for g in groups if isinstance(g, dict)]
        id_to_name = match_param_ids(group_ids, _state_shapes(state), list(param_names), param_shapes) or {}
    else:
        names = param_names if len(param_names) == len(ids) else None
        id_to_name = {i: names[k] for k, i in enumerate(ids)} if names else {}
    state_node = GroupNode({id_to_name.get(k, str(k)): to_node(v, rel) for k, v in state.items()})
    if id_to_name and all(i in id_to_name for i in ids):
        # the names the ids were matched to, beside the ids, as torch saves them for named parameters
        groups = [
            {**g, "param_names": [id_to_name[i] for i in g.get("params") or []]}
            if isinstance(g, dict) and "param_names" not in g
            else g
            for g in groups
        ]
    kids = {"state": state_node, "param_groups": to_node(groups, rel)}
    kids.update({k: to_node(v, rel) for k, v in osd.items() if k not in ("state", "param_groups")})
    return GroupNode(kids)


def flattened_groups(per_param: Mapping) -> list[tuple[dict, list[str]]]:
    """Param groups saved once per parameter FQN (`flatten_optimizer_state_dict=True`, torchtitan) as the groups
    they were: [(the group's fields, its parameters)], parameters with the same fields together, in saved order."""
    groups: list[tuple[dict, list[str]]] = []
    for fqn, g in per_param.items():
        fields = {k: v for k, v in g.items() if k != "params"} if isinstance(g, Mapping) else {}
        hit = next((grp for grp in groups if grp[0] == fields), None)
        if hit is None:
            groups.append((fields, [str(fqn)]))
        else:
            hit[1].append(str(fqn))
    return groups


def flattened_optimizer_tree(osd: Mapping, rel: str, conv: Callable[[Any, str], Any] = to_node) -> GroupNode:
    """An optimizer state dict saved with `flatten_optimizer_state_dict=True` (torchtitan): param groups are
    stored once per parameter FQN. Shown as the groups they were (`flattened_groups`), each listing its
    parameters (in saved order)."""
    groups = flattened_groups(osd.get("param_groups") or {})
    shown = GroupNode(
        {
            str(i): GroupNode({**{k: conv(v, rel) for k, v in f.items()}, "params": to_node(names, rel)})
            for i, (f, names) in enumerate(groups)
        }
    )
    state = osd.get("state") if isinstance(osd.get("state"), Mapping) else {}
    return GroupNode({"state": GroupNode({str(k): conv(v, rel) for k, v in state.items()}), "param_groups": shown})


def state_nodes(
    optims: list, scheds: list, tree: dict, rel: str, names: list[str], shapes: Mapping[str, Any] | None = None
) -> None:
    """Put optimizer and scheduler states into `tree` as optimizer, optimizer_1, ..., scheduler, ..."""
    for i, osd in enumerate(optims):
        tree[C._numbered("optimizer", i)] = optimizer_tree(osd, names, rel, shapes)
    for i, sd in enumerate(scheds):
        tree[C._numbered("scheduler", i)] = to_node(sd, rel)


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The `torch.save` file (zip or legacy) or pickle at `path`, read by the inert unpickler (never `torch.load`):
    tensors stay lazy references to their storage records; the training dict is taken apart into model,
    optimizer(s), scheduler(s) and client state by shape. Training state: the file itself (`training_state`)."""
    cache = C.LoadCache(path.parent)
    loaded = cache.load(path)
    rel = path.name
    model, optims, scheds, rest = split_training_dict(loaded.obj)
    tree: dict[str, Any] = {}
    names: list[str] = []
    if isinstance(model, dict):
        tree["model"] = to_node(model, rel)
        names = [k for k, v in model.items() if isinstance(v, TensorRef)]
    state_nodes(
        optims,
        scheds,
        tree,
        rel,
        names,
        {k: tuple(v.shape) for k, v in model.items() if isinstance(v, TensorRef)} if names else None,
    )
    if rest:
        tree["client_state"] = to_node(rest, rel)
    root = GroupNode(tree)
    counters, lrs, steps = C.training_header(tree)
    model_tensors = _distinct([t for _, t in iter_tensors(tree["model"])] if "model" in tree else [])
    warnings = C.counter_warnings(counters, optimizer_steps_seen=steps) + cache.warnings()
    return Checkpoint(
        format=FORMAT,
        path=str(path),
        topology=Topology(dp=None, tp=None, pp=None, zero_stage=None),
        tree=root,
        counters=counters,
        lr=lrs,
        parameter_count=sum(math.prod(t.shape) for t in model_tensors),
        parameter_tensors=len(model_tensors),
        files=(C.file_info(path, path.parent, "checkpoint"),),
        warnings=tuple(warnings),
        dtypes=tuple(sorted({t.dtype for t in model_tensors})),
        details={"container": loaded.kind},
    )


def training_state(ck: Checkpoint):
    """One file: a training dict, a Lightning `.ckpt` (lists of optimizer and scheduler states), an HF
    `optimizer.pt`: its state is found by shape."""
    p = Path(ck.path)
    return StateMap(p.parent, (StateSource(p, p.name),))


def _distinct(tensors: list[TensorNode]) -> list[TensorNode]:
    """Tensors counted once when several names point at the same bytes: a tied weight (GPT-2's lm_head.weight
    and wte.weight) is one storage, saved under both names by `state_dict()`."""
    seen: set[tuple] = set()
    out = []
    for t in tensors:
        ref = t.pieces[0].ref if len(t.pieces) == 1 else None
        key = (
            (t.pieces[0].file, ref.storage.key, ref.storage_offset, ref.shape, ref.stride)
            if ref is not None and ref.storage is not None
            else (id(t),)
        )
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _value(v: Any) -> Any:
    if isinstance(v, TensorRef) and v.numel == 1:
        try:
            return v.item()
        except Exception:
            return None
    return v


__all__ = ["sniff", "open", "split_training_dict", "optimizer_tree", "TensorNode"]
