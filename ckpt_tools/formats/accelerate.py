"""HF Accelerate `save_state` folders, with plain (DDP/CPU), DeepSpeed or FSDP state inside.

Accelerate writes: `model.safetensors` (or `pytorch_model.bin`; `model_1.*` for a second model),
`optimizer.bin`, `scheduler.bin` (`optimizer_1.bin`, ... for more), `random_states_{rank}.pkl` (one per
process: their count is the world size), `custom_checkpoint_{i}.pkl`. With DeepSpeed the model and
optimizer live in a DeepSpeed tag folder (`pytorch_model/` + `latest`); with FSDP in DCP folders
(`pytorch_model_fsdp_0/`, `optimizer_0/`). The scheduler always stays in `scheduler.bin`, and Accelerate
steps it once per process per optimizer step (after 4 steps on 2 ranks `last_epoch` is 8).
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..read.pickle_reader import TensorRef
from ..read.tree import (
    Checkpoint,
    Counters,
    GroupNode,
    LearningRates,
    Topology,
    Warning_,
    iter_tensors,
    tensor_node,
    to_node,
)
from ..read.state import StateMap, StateSource
from . import _common as C
from . import dcp, deepspeed, deepspeed_moe
from ._protocol import UniversalSource
from .deepspeed import tag_state_sources
from .safetensors_file import read_header
from .torch_file import optimizer_tree

FORMAT = "accelerate"
_RNG_RE = re.compile(r"^random_states_(\d+)\.pkl$")
_CUSTOM_RE = re.compile(r"^custom_checkpoint_(\d+)\.pkl$")
_MARKERS = ("random_states_*.pkl", "scheduler*.bin", "optimizer*.bin", "custom_checkpoint_*.pkl")


def sniff(path: Path) -> bool:
    return path.is_dir() and any(any(path.glob(m)) for m in _MARKERS)


def _model_files(path: Path) -> list[Path]:
    out = []
    for pat in ("model*.safetensors", "pytorch_model*.bin"):
        out += [p for p in sorted(path.glob(pat)) if p.is_file()]
    return out


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The `accelerator.save_state` folder at `path`. Reads (inert) `model*.safetensors` headers or
    `pytorch_model*.bin`, every `optimizer*.bin`, `scheduler*.bin`, `random_states_*.pkl` and
    `custom_checkpoint_*.pkl`; a DeepSpeed tag folder inside (`latest`, `*mp_rank_*_model_states.pt`) is read by
    `deepspeed_moe.open_any`, an FSDP `pytorch_model_fsdp_*` / `optimizer_*` DCP folder by `dcp.open` (metadata
    only). Tensors stay lazy. Training state: the optimizer and scheduler `.bin` files, or the inner DeepSpeed tag
    folder's files (`training_state`; FSDP folders are read-only)."""
    cache = C.LoadCache(path)
    tree: dict[str, Any] = {}
    files = []
    warnings: list[Warning_] = []
    details: dict[str, Any] = {}
    inner = _inner(path, tree, files, warnings, details)  # a DeepSpeed or DCP checkpoint inside the folder
    model_names, model_shapes = _read_models(path, cache, tree, files)
    steps_seen = _read_optimizers(path, cache, tree, files, details, model_names, model_shapes)
    for sf in sorted(path.glob("scheduler*.bin")):
        key = "scheduler" if sf.stem == "scheduler" else sf.stem
        tree[key] = to_node(cache.load(sf).obj, sf.name)
        files.append(C.file_info(sf, path, "scheduler"))
    rng_files = sorted(
        (p for p in path.iterdir() if _RNG_RE.match(p.name)), key=lambda p: int(_RNG_RE.match(p.name)[1])
    )
    if rng_files:
        tree["rng"] = GroupNode({p.stem: to_node(cache.load(p).obj, p.name) for p in rng_files})
        files += [C.file_info(p, path, "rng", {"rank": int(_RNG_RE.match(p.name)[1])}) for p in rng_files]
    customs = [p for p in sorted(path.iterdir()) if _CUSTOM_RE.match(p.name)]
    if customs:
        client = dict(tree["client_state"].children) if isinstance(tree.get("client_state"), GroupNode) else {}
        client.update({p.stem: to_node(cache.load(p).obj, p.name) for p in customs})
        tree["client_state"] = GroupNode(client)
        files += [C.file_info(p, path, "other") for p in customs]
    # several models / optimizers / schedulers (model_1.safetensors, optimizer_1.bin, scheduler_1.bin): the
    # header lists every optimizer's groups in order; the loop step is the script's own state (not read)
    header, lrs, _ = C.training_header({k: v for k, v in tree.items() if k != "client_state"})
    if inner is not None:
        steps_seen = steps_seen or (
            [inner.counters.optimizer_step] if inner.counters.optimizer_step is not None else []
        )
    counters, world = _counters_and_world(path, inner, header, steps_seen, rng_files, warnings)
    warnings += C.counter_warnings(counters, accelerate_world_size=world, optimizer_steps_seen=steps_seen)
    warnings += C.stray_file_warnings(path, path) + cache.warnings()
    if inner is not None and Path(inner.path) != path:
        warnings += C.stray_file_warnings(Path(inner.path), path)
    if not lrs.param_groups and inner is not None:
        lrs = LearningRates(inner.lr.param_groups, lrs.base_lrs, lrs.last_lr)
    model_keys = [k for k in tree if k == "model" or re.fullmatch(r"(model|pytorch_model)_\d+", k)]
    model_tensors = [t for k in model_keys for _, t in iter_tensors(tree[k])]
    if inner is not None:
        totals = inner.parameter_count, inner.parameter_tensors, inner.dtypes
    else:
        totals = C.tensor_totals(model_tensors)
    if len(model_keys) > 1:
        details["models"] = len(model_keys)
    topo = Topology(dp=world, tp=1, pp=1, zero_stage=inner.topology.zero_stage if inner is not None else None)
    details["world_size"] = world
    order = ("model", "optimizer", "scheduler", "counters", "rng", "client_state", "config")
    tree = C.in_order(tree, order)
    return C.checkpoint_of(FORMAT, path, topo, tree, counters, lrs, totals, files, warnings, details)


def _inner(path: Path, tree: dict, files: list, warnings: list, details: dict) -> Checkpoint | None:
    """The DeepSpeed (`latest` / a tag folder) or FSDP (a DCP folder) checkpoint inside the folder, or None; its
    model, optimizer, counters, config and client state go into `tree`, its files into `files`."""
    inner = None
    tag = C.read_latest(path)
    ds_dirs = [d for d in sorted(path.iterdir()) if d.is_dir() and any(d.glob("*mp_rank_*_model_states.pt"))]
    fsdp_model = sorted(d for d in path.glob("pytorch_model_fsdp_*") if d.is_dir())
    if tag or ds_dirs:
        inner = deepspeed_moe.open_any(path)
        details["engine"] = f"deepspeed (tag {inner.details.get('tag')})"
    elif fsdp_model:
        inner = dcp.open(fsdp_model[0])
        details["engine"] = f"fsdp ({fsdp_model[0].name})"
        opt_dirs = sorted(d for d in path.glob("optimizer_*") if d.is_dir())
        if opt_dirs:
            opt_ck = dcp.open(opt_dirs[0])
            if "optimizer" in opt_ck.tree.children:
                tree["optimizer"] = opt_ck.tree.children["optimizer"]
            files += list(opt_ck.files)
    if inner is not None:
        for key in ("model", "optimizer", "counters", "config", "client_state"):
            if key in inner.tree.children and key not in tree:
                tree[key] = inner.tree.children[key]
        prefix = Path(inner.path).relative_to(path)
        files += [replace(f, path=str(prefix / f.path)) for f in inner.files]
        warnings += [w for w in inner.warnings if w.code != "stray-file"]
    return inner


def _read_models(path: Path, cache: C.LoadCache, tree: dict, files: list) -> tuple[list[str], dict | None]:
    """Each `model*.safetensors` (its header) / `pytorch_model*.bin` (inert) into `tree`; (the torch state dict's
    parameter names in module order, their shapes) for naming the optimizer's param ids."""
    model_names: list[str] = []
    model_shapes: dict[str, Any] | None = None
    for mf in _model_files(path):
        key = "model" if mf.stem in ("model", "pytorch_model") else mf.stem
        if mf.suffix == ".safetensors":
            refs, _ = read_header(mf)
            tree[key] = GroupNode({n: tensor_node(r, mf.name) for n, r in refs.items()})
        else:
            obj = cache.load(mf).obj
            tree[key] = to_node(obj, mf.name)
            # torch.save of a state dict keeps module order, the order torch numbers optimizer params in
            if key == "model" and isinstance(obj, dict):
                model_names = [k for k, v in obj.items() if isinstance(v, TensorRef)]
                model_shapes = {k: tuple(v.shape) for k, v in obj.items() if isinstance(v, TensorRef)}
        files.append(C.file_info(mf, path, "model"))
    return model_names, model_shapes


def _read_optimizers(path, cache, tree, files, details, model_names, model_shapes) -> list[int]:
    """Each `optimizer*.bin` into `tree`, its param ids named where they can be; the Adam steps seen."""
    steps_seen: list[int] = []
    for of in sorted(path.glob("optimizer*.bin")):
        osd = cache.load(of).obj
        if not isinstance(osd, dict):
            continue
        key = "optimizer" if of.stem == "optimizer" else of.stem
        # safetensors stores tensors sorted by name, not in parameter order, so optimizer ids can only
        # be named from a torch state dict or from param_names saved in the param groups
        from_groups = _param_names_from_groups(osd)
        named = from_groups or model_names
        tree[key] = optimizer_tree(osd, named, of.name, None if from_groups else model_shapes)
        steps_seen += C.optimizer_steps(tree[key].children.get("state"))
        files.append(C.file_info(of, path, "optimizer"))
        if not named:
            details["optimizer_state_keys"] = "param ids (torch optimizer state dicts do not record names)"
    return steps_seen


def _counters_and_world(path, inner, header, steps_seen, rng_files, warnings) -> tuple[Counters, int | None]:
    """(the counters, the world size): from the random_states files, or from how many times the scheduler stepped
    per update (Accelerate steps it once per process); missing rank files and optimizers warned about."""
    world = len(rng_files) or None
    ranks_seen = sorted(int(_RNG_RE.match(p.name)[1]) for p in rng_files)
    if ranks_seen and ranks_seen != list(range(len(ranks_seen))):
        gone = [f"random_states_{r}.pkl" for r in range(max(ranks_seen) + 1) if r not in ranks_seen]
        warnings.append(
            Warning_(
                "missing-rank-file", f"random_states files for ranks {ranks_seen}: {', '.join(gone)} missing", gone[0]
            )
        )
    opt_step = max(set(steps_seen), key=steps_seen.count) if steps_seen else None
    counters = Counters(
        global_step=inner.counters.global_step if inner is not None else None,
        optimizer_step=opt_step,
        scheduler_last_epoch=header.scheduler_last_epoch,
        scheduler_step_count=header.scheduler_step_count,
        skipped_steps=inner.counters.skipped_steps if inner is not None else None,
    )
    if (
        world
        and opt_step
        and header.scheduler_last_epoch
        and header.scheduler_last_epoch % opt_step == 0
        and header.scheduler_last_epoch // opt_step > world
        and inner is None
    ):
        # Accelerate steps the scheduler once per process per update: the saved position says how many
        # processes ran, and each saved its own random_states file
        want = header.scheduler_last_epoch // opt_step
        missing = [f"random_states_{r}.pkl" for r in range(want) if r not in ranks_seen]
        warnings.append(
            Warning_(
                "missing-rank-file",
                f"the scheduler stepped {want}x per update ({want} processes) "
                f"but random_states files exist for {world}: {', '.join(missing)} missing",
                missing[0],
            )
        )
        world = want
    schedulers = {p.stem.replace("scheduler", "") for p in path.glob("scheduler*.bin")}
    optimizers = {p.stem.replace("optimizer", "") for p in path.glob("optimizer*.bin")}
    if inner is None:
        for suffix in sorted(schedulers - optimizers):
            warnings.append(
                Warning_(
                    "missing-state",
                    f"scheduler{suffix}.bin is saved but optimizer{suffix}.bin is "
                    "not: the optimizer state (Adam moments, step) of this run is missing",
                    f"optimizer{suffix}.bin",
                )
            )
    return counters, world


def _param_names_from_groups(osd: dict) -> list[str]:
    groups = osd.get("param_groups") if isinstance(osd.get("param_groups"), list) else []
    names = [n for g in groups if isinstance(g, dict) for n in (g.get("param_names") or [])]
    return [str(n) for n in names]


def _object_index(stem: str) -> int:
    """optimizer.bin / scheduler.bin -> 0, optimizer_1.bin -> 1: Accelerate numbers objects in prepare order."""
    m = re.search(r"_(\d+)$", stem)
    return int(m[1]) if m else 0


def training_state(ck: Checkpoint):
    root = Path(ck.path)
    if "fsdp" in str(ck.details.get("engine", "")):
        return StateMap(
            root,
            (),
            read_only="Accelerate FSDP checkpoints are read-only for set-lr/set-step: their "
            "optimizer is a DCP folder beside scheduler.bin",
            hint="load it, then call scheduler.load_state_dict / set group['lr'] in your training script",
        )
    sources = []
    tag = C.read_latest(root)
    if tag and (root / tag).is_dir():
        sources += tag_state_sources(root, root / tag)
    for p in sorted(root.glob("scheduler*.bin")) + sorted(root.glob("optimizer*.bin")):
        sources.append(StateSource(p, p.name, index=_object_index(p.stem)))
    return StateMap(root, tuple(sources), scheduler_steps_per_update=int(ck.details.get("world_size") or 1))


def logical_layout(ck: Checkpoint) -> dict[str, Any]:
    """Under DeepSpeed, the tag folder's `shared_params` / frozen / buffer names (`ckpt_tools.view.logical`)."""
    root = Path(ck.path)
    tag = C.read_latest(root)
    tag_dir = root / tag if tag and (root / tag).is_dir() else None
    if tag_dir is None:
        dirs = [d for d in sorted(root.iterdir()) if d.is_dir() and any(d.glob("*mp_rank_*_model_states.pt"))]
        tag_dir = dirs[0] if len(dirs) == 1 else None
    return deepspeed.model_layout(tag_dir) if tag_dir is not None else {}


def universal_source(path: Path, tp_patterns: tuple[str, ...] = ()) -> UniversalSource:
    """For `ckpt to-universal`: the DeepSpeed tag folder this checkpoint holds (a refusal naming the fix where it
    holds none)."""
    return deepspeed_moe.zero_tag_source(path)
