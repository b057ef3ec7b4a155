"""DeepSpeed universal checkpoints (what `ds_to_universal` writes and `load_universal` reads).

Layout: `latest_universal` in the parent names the tag folder; inside it the copied
`mp_rank_*_model_states.pt` files and `zero/<param>/{fp32,<optimizer state>,step}.pt` (exp_avg/exp_avg_sq,
momentum_buffer, sum, ...), each holding
`{"param": full tensor, "cat_dim": int, ...}` (ZeRO-1/2 input) or a bare tensor (ZeRO-3 input), plus
`zero/optimizer_state.pt` with the param groups. Parameters are whole here: no TP or DP pieces; the parameter
set is the `zero/<param>/` folders (a pipeline source's model-states files each list one stage's parameters,
TP-sharded), and the topology shown is the source run's (`checkpoint_parallel_dimensions`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import NotACheckpoint
from ..read.pickle_reader import Opaque, TensorRef
from ..read.tree import (
    Checkpoint,
    GroupNode,
    LearningRates,
    TensorNode,
    Topology,
    ValueNode,
    Warning_,
    as_int,
    tensor_node,
    to_node,
)
from . import _common as C
from .deepspeed import DS_MODEL_KEYS, _shape_groups

FORMAT = "deepspeed_universal"
STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq", "step")


_EXPERT_ID = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")


def _natural(name: str) -> list:
    """'10.mlp.weight' after '2.mlp.weight': numbers compare as numbers."""
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", name)]


def _is_tag(path: Path) -> bool:
    return (path / "zero" / "optimizer_state.pt").is_file() or (
        (path / "zero").is_dir() and any((path / "zero").glob("*/fp32.pt"))
    )


def sniff(path: Path) -> bool:
    if not path.is_dir():
        return False
    if _is_tag(path):
        return True
    tag = C.read_latest(path, "latest_universal")
    if tag and not (path / tag).is_dir() and not (path / "latest").is_file():
        return True  # open() reports the missing tag instead of another format reading a stray folder
    return bool(tag) and _is_tag(path / tag)


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The universal tag folder at `path` (or the folder whose `latest_universal` names it). Reads (inert) every
    copied `mp_rank_*_model_states.pt` (parameter order, module weights, counters, scheduler, config), each
    `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt` (one whole tensor each, left lazy; a scalar step read) and
    `zero/optimizer_state.pt` (param groups). Training state: the module has no `training_state`, so the
    writing commands (set-lr / set-step) treat a universal checkpoint as read-only."""
    if _is_tag(path):
        root, tag_dir, tag = path, path, path.name
    else:
        root, tag_dir, tag = C.resolve_tag(path, "zero/optimizer_state.pt", "latest_universal")
    cache = C.LoadCache(root)
    zero = tag_dir / "zero"
    model_files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not model_files:
        raise NotACheckpoint(
            "universal tag folder without mp_rank_*_model_states.pt",
            path=tag_dir,
            hint="ds_to_universal copies them; re-run the conversion",
        )
    ms = cache.load(model_files[0]).obj
    ms = ms if isinstance(ms, dict) else {}
    names, listed, folders = _param_names(zero, model_files, ms, cache)
    warnings: list[Warning_] = []
    files = [C.file_info(p, root, "model") for p in model_files]
    for name in [n for n in listed if n not in folders]:
        warnings.append(
            Warning_(
                "missing-state",
                f"no zero/{name}/fp32.pt for a parameter the model states list",
                str(zero.relative_to(root)),
            )
        )
    state, steps = _param_state(zero, names, root, cache, files)
    osd, groups = _optimizer_state(zero, root, cache, files, ms, warnings)
    rel_ms = cache.rel(model_files[0])
    model = _model(names, ms, state, rel_ms)
    zs = osd.get("zero_stage")
    stage = as_int(zs.args[0]) if isinstance(zs, Opaque) and zs.args else as_int(zs)
    tree, sched_node = _tree(ms, model, state, osd, groups, rel_ms)
    sf = C.scheduler_fields(sched_node)
    base_lrs, last_lr = C.lr_from_scheduler(sf)
    counters = C.deepspeed_counters(ms, sf, steps)
    warnings += C.counter_warnings(counters, optimizer_steps_seen=steps)
    warnings += C.stray_file_warnings(tag_dir, root) + cache.warnings()
    lrs = C.param_group_lrs(tree["optimizer"].children["param_groups"])
    count = sum(t.numel for t in model.values() if isinstance(t, TensorNode))
    # the source run's topology: DeepSpeed records TP and PP degrees apart (mp_world_size is their product)
    dims = (
        ms.get("checkpoint_parallel_dimensions") if isinstance(ms.get("checkpoint_parallel_dimensions"), dict) else {}
    )
    tp, pp = as_int(dims.get("tp_degree")), as_int(dims.get("pp_degree"))
    if tp is None:
        tp, pp = as_int(ms.get("mp_world_size")), 1
    return Checkpoint(
        format=FORMAT,
        path=str(root),
        topology=Topology(dp=as_int(ms.get("dp_world_size")), tp=tp, pp=pp or 1, zero_stage=stage),
        tree=GroupNode(tree),
        counters=counters,
        lr=LearningRates(lrs, base_lrs, last_lr),
        parameter_count=count,
        parameter_tensors=len(names),
        files=tuple(files),
        warnings=tuple(warnings),
        dtypes=tuple(sorted({t.dtype for t in model.values() if isinstance(t, TensorNode)})),
        details={
            "tag": tag,
            "ds_version": ms.get("ds_version"),
            "note": "topology is the source run's; a universal checkpoint loads at any DP size",
        },
    )


def _param_names(zero: Path, model_files: list[Path], ms: dict, cache: C.LoadCache) -> tuple[list, list, set]:
    """(the parameters in model order, the names the model states list, the zero/<param> folders). The parameters
    are the zero/<param>/ folders (whole tensors, every pipeline stage and TP rank merged); the copied model-states
    files give their order: each mp rank's file lists only its own stage's params."""
    folders = {p.name for p in zero.iterdir() if p.is_dir() and (p / "fp32.pt").is_file()} if zero.is_dir() else set()
    listed: list[str] = []
    for f in model_files:
        obj = ms if f == model_files[0] else cache.load(f).obj
        for g in _shape_groups(obj.get("param_shapes") if isinstance(obj, dict) else None):
            listed += [n for n in g if n not in listed]
    names = [n for n in listed if n in folders] + sorted(folders - set(listed), key=_natural)
    return names, listed, folders


def _param_state(zero: Path, names: list[str], root: Path, cache: C.LoadCache, files: list) -> tuple[dict, list]:
    """({param: its zero/<param>/*.pt state as a group}, the steps seen); every state file listed in `files`."""
    state: dict[str, Any] = {}
    steps: list[int] = []
    for name in names:
        pdir = zero / name
        entry: dict[str, Any] = {}
        keys = sorted(f.name[:-3] for f in pdir.iterdir() if f.name.endswith(".pt") and f.is_file())
        for key in sorted(keys, key=lambda k: (STATE_FILES.index(k) if k in STATE_FILES else len(STATE_FILES), k)):
            f = pdir / f"{key}.pt"
            files.append(C.file_info(f, root, "optimizer"))
            obj = cache.load(f).obj
            ref = obj.get("param") if isinstance(obj, dict) else obj
            if not isinstance(ref, TensorRef):
                continue
            node = tensor_node(ref, cache.rel(f))
            if key == "step":
                v = as_int(node.value)
                if v is not None:
                    steps.append(v)
                entry["step"] = ValueNode(node.value)
            else:
                entry[key] = node
            if isinstance(obj, dict) and "cat_dim" in obj and key == "fp32":
                entry["cat_dim"] = ValueNode(obj["cat_dim"])
        state[name] = GroupNode(entry)
    return state, steps


def _optimizer_state(zero, root, cache, files, ms, warnings) -> tuple[dict, list]:
    """(zero/optimizer_state.pt's dict, its param groups); groups fewer or more than declared warned about."""
    opt_path = zero / "optimizer_state.pt"
    osd = cache.load(opt_path).obj if opt_path.is_file() else {}
    osd = osd if isinstance(osd, dict) else {}
    if opt_path.is_file():
        files.append(C.file_info(opt_path, root, "optimizer"))
    groups = osd.get("param_groups") if isinstance(osd.get("param_groups"), list) else []
    declared = {"the model states' param_shapes": len(_shape_groups(ms.get("param_shapes")))}
    if isinstance(osd.get("partition_count"), list):
        declared["partition_count"] = len(osd["partition_count"])
    for what, n in declared.items():
        if opt_path.is_file() and n and len(groups) != n:
            warnings.append(
                Warning_(
                    "declared-mismatch",
                    f"zero/optimizer_state.pt holds {len(groups)} param groups "
                    f"where {what} declare(s) {n}: a param group was lost (DeepSpeed's universal "
                    "loader pairs them by position)",
                    "zero/optimizer_state.pt",
                )
            )
            break
    return osd, groups


def _model(names: list[str], ms: dict, state: dict, rel_ms: str) -> dict[str, Any]:
    """Each parameter's weight: the module's own (e.g. bf16) when whole, else its fp32 master."""
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    model: dict[str, Any] = {}
    for name in names:
        ref = module.get(name)
        fp32 = state[name].children.get("fp32") if isinstance(state.get(name), GroupNode) else None
        if isinstance(ref, TensorRef) and ref.numel > 0 and (fp32 is None or tuple(ref.shape) == tuple(fp32.shape)):
            model[name] = tensor_node(ref, rel_ms)  # the module's own (e.g. bf16) weight, when whole
        elif isinstance(fp32, TensorNode):
            model[name] = fp32
    return model


def _tree(ms: dict, model: dict, state: dict, osd: dict, groups: list, rel_ms: str) -> tuple[dict[str, Any], Any]:
    """(the tree: model, optimizer, scheduler, counters, client state, config; the scheduler node or None)."""
    tree: dict[str, Any] = {"model": GroupNode(model)}
    opt_extras = {k: to_node(v, "zero/optimizer_state.pt") for k, v in osd.items() if k != "param_groups"}
    tree["optimizer"] = GroupNode({"state": GroupNode(state), "param_groups": to_node(groups, ""), **opt_extras})
    sched_node = to_node(ms["lr_scheduler"], rel_ms) if isinstance(ms.get("lr_scheduler"), dict) else None
    if sched_node is not None:
        tree["scheduler"] = sched_node
    tree["counters"] = GroupNode({k: ValueNode(ms.get(k)) for k in ("global_steps", "global_samples", "skipped_steps")})
    client = {k: v for k, v in ms.items() if k not in DS_MODEL_KEYS}
    if client:
        tree["client_state"] = to_node(client, rel_ms)
    if isinstance(ms.get("ds_config"), dict):
        tree["config"] = to_node(ms["ds_config"], rel_ms)
    return tree, sched_node


def logical_layout(ck: Checkpoint) -> dict[str, Any]:
    """What `ckpt_tools.view.logical` asks a format for: the parameter order (the zero/<param> folders in model
    order), each param group's members (the union of every copied model-states file's `param_shapes` group:
    each mp rank lists its own stage's parameters), frozen parameters (`frozen_param_shapes`, and folders
    that hold only fp32.pt: DeepSpeed writes one for every module weight without optimizer state) and tied
    ones (`shared_params`). Reads the model-states pickles again (metadata only)."""
    root = Path(ck.path)
    tag = ck.details.get("tag")
    tag_dir = root / tag if tag and (root / str(tag)).is_dir() else root
    cache = C.LoadCache(root)
    state = ck.optimizer.children.get("state")
    names = list(state.children) if isinstance(state, GroupNode) else []
    groups: list[list[str]] = []
    frozen: list[str] = []
    tied: dict[str, str] = {}
    for f in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        obj = cache.load(f).obj
        if not isinstance(obj, dict):
            continue
        for gi, g in enumerate(_shape_groups(obj.get("param_shapes"))):
            while len(groups) <= gi:
                groups.append([])
            groups[gi] += [n for n in g if n not in groups[gi] and n in names]
        fz = obj.get("frozen_param_shapes")
        if isinstance(fz, dict):
            frozen += [str(n) for n in fz if str(n) not in frozen]
        sp = obj.get("shared_params")
        if isinstance(sp, dict):
            tied.update({str(k): str(v) for k, v in sp.items()})
    grouped = {n for g in groups for n in g}
    # DeepSpeed MoE: `param_shapes` lists an MoE group's experts under the saving rank's LOCAL ids; the
    # folders hold every expert under its global id, in the group of the listed expert of the same shape role
    role = {_EXPERT_ID.sub(r"\1*\3", n): gi for gi, g in enumerate(groups) for n in g if _EXPERT_ID.search(n)}
    for n in names:
        gi = role.get(_EXPERT_ID.sub(r"\1*\3", n)) if n not in grouped and _EXPERT_ID.search(n) else None
        if gi is not None:
            groups[gi].append(n)
            grouped.add(n)
    for n in names:
        kids = state.children[n].children if isinstance(state.children.get(n), GroupNode) else {}
        if n not in grouped and n not in frozen and set(kids) <= {"fp32", "cat_dim"}:
            frozen.append(n)
    return {"order": names, "groups": groups, "frozen": frozen, "tied": tied}
