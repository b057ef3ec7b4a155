"""DeepSpeed universal checkpoints (what `ds_to_universal` writes and `load_universal` reads).

Layout: `latest_universal` in the parent names the tag folder; inside it the copied
`mp_rank_*_model_states.pt` files and `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`, each holding
`{"param": full tensor, "cat_dim": int, ...}` (ZeRO-1/2 input) or a bare tensor (ZeRO-3 input), plus
`zero/optimizer_state.pt` with the param groups. Parameters are whole here: no TP or DP pieces.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..errors import NotACheckpoint
from ..pickle_reader import Opaque, TensorRef
from ..tree import (Checkpoint, Counters, GroupNode, LearningRates, TensorNode, Topology, ValueNode, Warning_,
                    as_int, tensor_node, to_node)
from . import _common as C
from .deepspeed import DS_MODEL_KEYS, _shape_groups

FORMAT = "deepspeed_universal"
STATE_FILES = ("fp32", "exp_avg", "exp_avg_sq", "step")


def _is_tag(path: Path) -> bool:
    return (path / "zero" / "optimizer_state.pt").is_file() or \
        ((path / "zero").is_dir() and any((path / "zero").glob("*/fp32.pt")))


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
    if _is_tag(path):
        root, tag_dir, tag = path, path, path.name
    else:
        root, tag_dir, tag = C.resolve_tag(path, "zero/optimizer_state.pt", "latest_universal")
    cache = C.LoadCache(root)
    zero = tag_dir / "zero"
    model_files = sorted(tag_dir.glob("mp_rank_*_model_states.pt"))
    if not model_files:
        raise NotACheckpoint("universal tag folder without mp_rank_*_model_states.pt", path=tag_dir,
                             hint="ds_to_universal copies them; re-run the conversion")
    ms = cache.load(model_files[0]).obj
    ms = ms if isinstance(ms, dict) else {}
    shape_groups = _shape_groups(ms.get("param_shapes"))
    names = [n for g in shape_groups for n in g] or sorted(p.name for p in zero.iterdir() if p.is_dir())
    warnings: list[Warning_] = []
    state: dict[str, Any] = {}
    steps: list[int] = []
    files = [C.file_info(p, root, "model") for p in model_files]
    for name in names:
        pdir = zero / name
        entry: dict[str, Any] = {}
        for key in STATE_FILES:
            f = pdir / f"{key}.pt"
            if not f.is_file():
                continue
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
        if "fp32" not in entry:
            warnings.append(Warning_("missing-state", f"no fp32.pt for parameter {name}", str(pdir.relative_to(root))))
        state[name] = GroupNode(entry)
    opt_path = zero / "optimizer_state.pt"
    osd = cache.load(opt_path).obj if opt_path.is_file() else {}
    osd = osd if isinstance(osd, dict) else {}
    if opt_path.is_file():
        files.append(C.file_info(opt_path, root, "optimizer"))
    groups = osd.get("param_groups") if isinstance(osd.get("param_groups"), list) else []
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    model: dict[str, Any] = {}
    rel_ms = cache.rel(model_files[0])
    for name in names:
        ref = module.get(name)
        if isinstance(ref, TensorRef) and ref.numel > 0:
            model[name] = tensor_node(ref, rel_ms)
        elif isinstance(state.get(name), GroupNode) and "fp32" in state[name].children:
            model[name] = state[name].children["fp32"]
    zs = osd.get("zero_stage")
    stage = as_int(zs.args[0]) if isinstance(zs, Opaque) and zs.args else as_int(zs)
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
    sf = C.scheduler_fields(sched_node)
    base_lrs, last_lr = C.lr_from_scheduler(sf)
    last_epoch, step_count = C.scheduler_counters(sf)
    counters = Counters(global_step=as_int(ms.get("global_steps")),
                        optimizer_step=max(set(steps), key=steps.count) if steps else None,
                        scheduler_last_epoch=last_epoch, scheduler_step_count=step_count,
                        skipped_steps=as_int(ms.get("skipped_steps")))
    warnings += C.counter_warnings(counters, optimizer_steps_seen=steps)
    warnings += C.stray_file_warnings(tag_dir, root) + cache.warnings()
    lrs = C.param_group_lrs(tree["optimizer"].children["param_groups"])
    count = sum(math.prod(s) for g in shape_groups for s in g.values()) if shape_groups else \
        sum(t.numel for t in model.values() if isinstance(t, TensorNode))
    return Checkpoint(
        format=FORMAT, path=str(root),
        topology=Topology(dp=as_int(ms.get("dp_world_size")), tp=as_int(ms.get("mp_world_size")), pp=1,
                          zero_stage=stage),
        tree=GroupNode(tree), counters=counters, lr=LearningRates(lrs, base_lrs, last_lr),
        parameter_count=count, parameter_tensors=len(names), files=tuple(files), warnings=tuple(warnings),
        dtypes=tuple(sorted({t.dtype for t in model.values() if isinstance(t, TensorNode)})),
        details={"tag": tag, "ds_version": ms.get("ds_version"),
                 "note": "topology is the source run's; a universal checkpoint loads at any DP size"})
