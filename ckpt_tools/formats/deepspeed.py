"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3; bf16, fp16 and fp32), the tag folder or its parent.

Layout (docs/formats.md): `mp_rank_TT_model_states.pt` (stage 1/2; stage 3 adds
`zero_pp_rank_D_mp_rank_TT_model_states.pt` per DP rank) and `[bf16_]zero_pp_rank_D_mp_rank_TT_optim_states.pt`
per DP rank. The optimizer state is flattened: one flat fp32 master / exp_avg / exp_avg_sq tensor per
param group and DP rank. This module un-flattens it per parameter name without reading tensor bytes:

- stage 1/2: `param_slice_mappings[g][name] = fragment_address(numel, start)` says where each parameter's
  piece lies inside the rank's flat partition; a parameter's pieces across ranks follow in rank order.
- stage 3: every parameter is split across all DP ranks, `ceil(numel / dp)` elements each (the last rank
  padded), laid out in `param_shapes` order inside each rank's flat group.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError, UnsupportedCheckpoint, CorruptCheckpoint, MissingFile, NotACheckpoint
from ..read.pickle_reader import Opaque, TensorRef
from ..read.state import StateMap, StateSource
from ..read.tree import (
    Checkpoint,
    Counters,
    GroupNode,
    LearningRates,
    Piece,
    TensorNode,
    Topology,
    ValueNode,
    Warning_,
    as_int,
    group_node,
    pieces_node,
    tensor_node,
    to_node,
)
from ..read.tree import piece as make_piece
from . import _common as C
from ._protocol import UniversalSource

FORMAT = "deepspeed_zero"
_MODEL_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_Z3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM_RE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")

#: top-level model_states keys DeepSpeed itself writes; everything else is client state
DS_MODEL_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
}


#: any DeepSpeed ZeRO state file (model states or an optimizer rank file): a tag folder whose model states
#: file is missing is still claimed, so that open() names the missing file
_STATE_GLOB = "*mp_rank_*_states.pt"


def sniff(path: Path) -> bool:
    if not path.is_dir():
        return False
    if any(path.glob("layer_*-model_*-model_states.pt")):
        return False
    if any(path.glob(_STATE_GLOB)):
        return True
    # a parent folder: claim it when it has `latest` or a tag folder with DeepSpeed files, even when
    # `latest` names a missing tag, so that open() can say exactly that
    tags = [d for d in path.iterdir() if d.is_dir() and any(d.glob(_STATE_GLOB))]
    return bool(tags) and not any(any(d.glob("layer_*-model_*-model_states.pt")) for d in tags)


@dataclass
class RankFiles:
    """The files of one model-parallel rank (`mp_rank` TT) in a tag folder."""

    mp_rank: int
    model_states: Path | None
    optim: dict[int, Path]  # dp rank -> optim file
    z3_model: dict[int, Path]


def list_rank_files(tag_dir: Path) -> dict[int, RankFiles]:
    """Group the tag folder's state files by model-parallel rank."""
    ranks: dict[int, RankFiles] = {}
    for p in sorted(tag_dir.iterdir()):
        m = _MODEL_RE.match(p.name)
        if m:
            ranks.setdefault(int(m[1]), RankFiles(int(m[1]), None, {}, {})).model_states = p
            continue
        m = _OPTIM_RE.match(p.name)
        if m:
            ranks.setdefault(int(m[3]), RankFiles(int(m[3]), None, {}, {})).optim[int(m[2])] = p
            continue
        m = _Z3_MODEL_RE.match(p.name)
        if m:
            ranks.setdefault(int(m[2]), RankFiles(int(m[2]), None, {}, {})).z3_model[int(m[1])] = p
    return ranks


def _dig(obj: Any, *keys):
    for k in keys:
        if isinstance(obj, dict) and k in obj:
            obj = obj[k]
        else:
            return None
    return obj


def _zero_stage(osd: dict) -> int | None:
    z = osd.get("zero_stage")
    if isinstance(z, Opaque) and z.args:
        return as_int(z.args[0])
    return as_int(z)


def _shape_groups(param_shapes: Any) -> list[dict[str, tuple[int, ...]]]:
    if isinstance(param_shapes, dict):
        param_shapes = [param_shapes]
    if not isinstance(param_shapes, list):
        return []
    return [{str(k): tuple(v) for k, v in g.items()} for g in param_shapes if isinstance(g, dict)]


@dataclass
class ZeroOptimizer:
    """Per-parameter optimizer state recovered from one mp rank's flat ZeRO partitions."""

    stage: int | None
    state: dict[str, dict[str, Any]]  # param -> {"fp32": TensorNode, "exp_avg": ..., "exp_avg_sq": ..., "step": v}
    param_groups: list[dict[str, Any]]  # rank 0's param groups (raw objects)
    steps_seen: list[int]
    lrs_by_rank: dict[int, tuple[float, ...]]
    extras: dict[str, Any]  # loss_scaler, clip_grad, ... from rank 0
    dtype: str | None = None
    warnings: list[Warning_] = field(default_factory=list)  # rank files that disagree with the others


@dataclass
class _Flat:
    """What the DP rank files' flat partitions hold, gathered rank file by rank file (`_gather_rank`)."""

    pieces: dict[str, dict[str, list[Piece]]] = field(default_factory=dict)  # param -> state kind -> its pieces
    steps_seen: list[int] = field(default_factory=list)
    lrs_by_rank: dict[int, tuple[float, ...]] = field(default_factory=dict)
    step_value: dict[int, Any] = field(default_factory=dict)  # group -> the first Adam step seen
    master_dtype: str | None = None
    state_keys: dict[tuple[int, int], frozenset[str]] = field(default_factory=dict)  # (dp rank, group) -> saved


def read_zero_optimizer(
    cache: C.LoadCache,
    optim_files: dict[int, Path],
    shape_groups: list[dict[str, tuple[int, ...]]],
    mp_coords: dict[str, int],
    ds_config: tuple[str, Any] | None = None,
    *,
    group_layout: Callable[[int, int], tuple[int, Callable[[str], str] | None]] | None = None,
    out_groups: list[dict[str, tuple[int, ...]]] | None = None,
) -> ZeroOptimizer:
    """Un-flatten the optimizer state of one model-parallel rank from all its DP rank files. `ds_config`:
    (file, the ds_config the model-states file saved), which every rank file's copy must equal.
    `group_layout(group, dp rank)` -> (the rank's index in the group's partitioning, a rename of the names its
    file uses, or None): for groups partitioned over a sub-group of the DP ranks (MoE experts over the
    expert-data-parallel group, each expert-parallel rank holding its own experts under local names); then
    `out_groups` holds every group's parameters under their global names."""
    dp = len(optim_files)
    loaded = {r: cache.load(p) for r, p in sorted(optim_files.items())}
    first = loaded[min(loaded)].obj
    osd0 = first.get("optimizer_state_dict") if isinstance(first, dict) else None
    if not isinstance(osd0, dict):
        raise CorruptCheckpoint(
            "no optimizer_state_dict", path=optim_files[min(loaded)], hint="this is not a DeepSpeed ZeRO optimizer file"
        )
    stage = _zero_stage(osd0)
    flat = _Flat()
    configs: dict[str, Any] = dict([ds_config]) if ds_config and isinstance(ds_config[1], dict) else {}
    warnings: list[Warning_] = []
    for r, L in loaded.items():
        rel = cache.rel(optim_files[r])
        groups = _gather_rank(flat, r, L.obj, rel, optim_files[r], stage, shape_groups, dp, mp_coords, group_layout)
        if isinstance(L.obj.get("ds_config"), dict):
            configs.setdefault(rel, L.obj["ds_config"])
        if shape_groups and isinstance(groups, list) and len(groups) != len(shape_groups):
            warnings.append(
                Warning_(
                    "declared-mismatch",
                    f"{len(groups)} optimizer param groups where the "
                    f"model states' param_shapes declare {len(shape_groups)}: a param group was "
                    "lost or the files are from different runs",
                    rel,
                )
            )
    warnings += _agreement_warnings(flat.state_keys, configs, cache, optim_files)
    state_out = _state_per_param(flat, out_groups if out_groups is not None else shape_groups, optim_files)
    extras = {
        k: v
        for k, v in osd0.items()
        if k in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "partition_count", "ds_version")
    }
    if stage is not None:
        extras["zero_stage"] = stage
    groups0 = (
        _dig(osd0, "optimizer_state_dict", "param_groups")
        if stage == 3
        else _dig(osd0, "base_optimizer_state", "param_groups")
    ) or []
    return ZeroOptimizer(
        stage,
        state_out,
        [g for g in groups0 if isinstance(g, dict)],
        flat.steps_seen,
        flat.lrs_by_rank,
        extras,
        flat.master_dtype,
        warnings,
    )


def _gather_rank(flat: _Flat, r, obj, rel, path, stage, shape_groups, dp, mp_coords, group_layout) -> Any:
    """Into `flat`: DP rank `r`'s file (`obj`, loaded) — each parameter's pieces of each flat state partition,
    the Adam steps, the param group LRs, the master dtype, which state tensors each group saved. Returns the
    file's param groups (as saved)."""
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if not isinstance(osd, dict):
        raise CorruptCheckpoint("no optimizer_state_dict", path=path, hint="re-copy this rank's file")
    if stage == 3:
        base = osd.get("optimizer_state_dict") or {}
        flats = osd.get("fp32_flat_groups") or []
    else:
        base = osd.get("base_optimizer_state") or {}
        flats = osd.get("single_partition_of_fp32_groups") or []
    state = base.get("state") or {}
    groups = base.get("param_groups") or []
    flat.lrs_by_rank[r] = tuple(
        float(g.get("lr")) for g in groups if isinstance(g, dict) and isinstance(g.get("lr"), (int, float))
    )
    pieces = flat.pieces
    rank = dict(mp_coords, dp=r)
    for gi, shapes in enumerate(shape_groups):
        gstate = state.get(gi, state.get(str(gi), {})) if isinstance(state, dict) else {}
        parts = {
            "fp32": flats[gi] if gi < len(flats) else None,
            "exp_avg": gstate.get("exp_avg") if isinstance(gstate, dict) else None,
            "exp_avg_sq": gstate.get("exp_avg_sq") if isinstance(gstate, dict) else None,
        }
        parts.update(_other_flat_states(gstate, parts["fp32"]))
        if isinstance(parts["fp32"], TensorRef) and parts["fp32"].numel:
            flat.state_keys[(r, gi)] = frozenset(
                k for k, v in parts.items() if k != "fp32" and isinstance(v, TensorRef)
            )
        if isinstance(parts["fp32"], TensorRef):
            flat.master_dtype = parts["fp32"].dtype
        stepv = gstate.get("step") if isinstance(gstate, dict) else None
        if isinstance(stepv, TensorRef):
            stepv = stepv.item() if stepv.numel == 1 else None
        if as_int(stepv) is not None:
            flat.steps_seen.append(as_int(stepv))
            flat.step_value.setdefault(gi, as_int(stepv))
        refs = [(key, ref, ref.numel) for key, ref in parts.items() if isinstance(ref, TensorRef)]
        grank, rename = group_layout(gi, r) if group_layout else (r, None)
        for name, (src, cnt, dst) in _fragments(stage, osd, gi, shapes, grank, dp).items():
            if rename:
                name = rename(name)
            slot = pieces.get(name)
            if slot is None:
                slot = pieces[name] = {}
            end = src + cnt
            for key, ref, size in refs:
                if end > size:
                    raise CorruptCheckpoint(
                        f"param {name} lies outside the flat {key} partition of group {gi}",
                        path=path,
                        hint="the rank files are from different runs",
                    )
                plist = slot.get(key)
                if plist is None:
                    slot[key] = [make_piece(rel, ref, src, cnt, dst, rank)]
                else:
                    plist.append(make_piece(rel, ref, src, cnt, dst, rank))
    return groups


def _agreement_warnings(state_keys, configs, cache, optim_files) -> list[Warning_]:
    """A rank file missing state tensors the others saved, and ds_configs that differ between the files."""
    warnings = []
    saved = frozenset().union(*state_keys.values()) if state_keys else frozenset()
    for (r, gi), keys in sorted(state_keys.items()):
        if keys != saved:
            warnings.append(
                Warning_(
                    "declared-mismatch",
                    f"param group {gi} has no {', '.join(sorted(saved - keys))} "
                    "in this rank's file while the other ranks' files have it: this rank's optimizer "
                    "state was lost (a resume restarts those moments at zero)",
                    cache.rel(optim_files[r]),
                )
            )
    if len({repr(c) for c in configs.values()}) > 1:
        ref = next(iter(configs))
        odd = [f for f, c in configs.items() if repr(c) != repr(configs[ref])]
        # a record only (DeepSpeed never reads it back), so a warning, not a refusal: but files of one save
        # carry one config, so a difference says they come from different launches
        warnings.append(
            Warning_(
                "ds-config-mismatch",
                f"the ds_config saved in {', '.join(odd)} differs from "
                f"{ref}'s: the files were written by different launches (a rank file from another "
                "run?)",
                odd[0],
            )
        )
    return warnings


def _state_per_param(flat: _Flat, groups: list[dict[str, tuple[int, ...]]], optim_files) -> dict[str, dict[str, Any]]:
    """{param: {state kind: TensorNode over its pieces, step, param_group}} for every parameter of `groups`, each
    kind's pieces checked to cover the parameter exactly."""
    pieces, step_value = flat.pieces, flat.step_value
    state_out: dict[str, dict[str, Any]] = {}
    no_pieces: dict[str, list[Piece]] = {}
    for gi, shapes in enumerate(groups):
        has_step, step = gi in step_value, step_value.get(gi)
        for name, shape in shapes.items():
            entry: dict[str, Any] = {}
            numel = math.prod(shape)
            for key, plist in pieces.get(name, no_pieces).items():
                if len(plist) == 1:
                    if plist[0].numel != numel:
                        _short(name, key, plist, shape, optim_files)
                else:
                    if sum(p.numel for p in plist) != numel:
                        _short(name, key, plist, shape, optim_files)
                    plist.sort(key=_dst_offset)
                entry[key] = pieces_node(shape, plist[0].ref.dtype, tuple(plist))
            if has_step:
                entry["step"] = step
            entry["param_group"] = gi
            state_out[name] = entry
    return state_out


def _short(name: str, key: str, plist: list[Piece], shape: tuple[int, ...], optim_files: dict[int, Path]):
    covered = sum(p.numel for p in plist)
    raise CorruptCheckpoint(
        f"param {name}: the {key} pieces cover {covered} of {math.prod(shape)} elements",
        path=optim_files[min(optim_files)],
        hint="a rank file is missing or from another run",
    )


def _dst_offset(p: Piece) -> int:
    return p.dst_offset


def _other_flat_states(gstate: Any, fp32: Any) -> dict[str, TensorRef]:
    """Per-element optimizer state other than Adam's moments, flat like the fp32 partition (SGD's
    `momentum_buffer`, Adagrad's `sum`, a client optimizer's own buffers): every tensor of the group's
    state with at least as many elements as the partition (the last DP rank saves its fp32 partition without
    the group's padding, while the optimizer's state tensors keep it; the bounds check in the caller guards
    every read). `step` and other small tensors are not per element."""
    if not isinstance(gstate, dict) or not isinstance(fp32, TensorRef):
        return {}
    return {
        str(k): v
        for k, v in gstate.items()
        if k not in ("exp_avg", "exp_avg_sq", "step", "fp32")
        and isinstance(v, TensorRef)
        and v.numel >= fp32.numel
        and v.numel > 1
    }


def _fragments(stage, osd, gi, shapes, rank, dp) -> dict[str, tuple[int, int, int]]:
    """name -> (offset in this rank's flat group, count, offset inside the parameter) for one group."""
    out: dict[str, tuple[int, int, int]] = {}
    if stage == 3:
        off = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / dp) if numel else 0
            start = rank * part
            cnt = max(0, min(part, numel - start))
            if cnt:
                out[name] = (off, cnt, start)
            off += part
        return out
    mappings = osd.get("param_slice_mappings")
    if not isinstance(mappings, list) or gi >= len(mappings):
        raise CorruptCheckpoint(
            "optimizer file has no param_slice_mappings (DeepSpeed < 0.9?)",
            hint="re-save with a newer DeepSpeed or use zero_to_fp32",
        )
    # the logical offset of a fragment is where the partition starts in the group's flat buffer
    # minus where the parameter starts in it; both follow from param order and partition sizes
    flat_sizes = osd.get("single_partition_of_fp32_groups") or []
    part_size = flat_sizes[gi].numel if gi < len(flat_sizes) and isinstance(flat_sizes[gi], TensorRef) else 0
    # every rank's partition has the same size in the flat buffer; the last rank saves its partition without
    # the alignment padding at the end of the group (`group_paddings`), so its saved tensor is shorter
    paddings = osd.get("group_paddings")
    if isinstance(paddings, list) and gi < len(paddings) and as_int(paddings[gi]):
        part_size += as_int(paddings[gi])
    part_begin = rank * part_size
    param_begin = 0
    begins: dict[str, int] = {}
    for name, shape in shapes.items():
        begins[name] = param_begin
        param_begin += math.prod(shape)
    for name, frag in mappings[gi].items():
        if not isinstance(frag, Opaque):
            continue
        st = frag.state  # fragment_address(numel, start): plain ints in every real file
        numel, start = (st.get("numel"), st.get("start")) if type(st) is dict else (None, None)
        if type(numel) is not int or type(start) is not int:
            numel, start = as_int(frag.field("numel")), as_int(frag.field("start"))
        if numel is None or start is None or name not in begins:
            continue
        out[str(name)] = (start, numel, part_begin + start - begins[name])
    return out


def open(path: Path) -> Checkpoint:  # noqa: A001  (the format-module interface)
    """The DeepSpeed ZeRO checkpoint at `path` (the run folder with `latest`, or a tag folder). Reads (inert) the
    first model-parallel rank's `mp_rank_XX_model_states.pt` (names, shapes, module weights, counters, scheduler,
    ds_config) and all its DP ranks' `*zero_pp_rank_*_optim_states.pt` (the flat fp32 / Adam partitions, cut into
    per-parameter pieces); the other ranks' files are only listed and their zip directories checked. Tensors
    stay lazy. A tag folder with expert files is refused here (`deepspeed_moe` reads it). Training state: the
    tag folder's model-states and optim-states files (`training_state`)."""
    root, tag_dir, tag = C.resolve_tag(path, _STATE_GLOB)
    cache = C.LoadCache(root)
    ranks = list_rank_files(tag_dir)
    if not ranks:
        raise NotACheckpoint("no mp_rank_*_model_states.pt files", path=tag_dir)
    if any(_EXPERT_FILE.match(p.name) for p in tag_dir.iterdir()):
        # a Mixture-of-Experts tag folder: its experts are partitioned over the expert-data-parallel group and kept
        # in their own files, which this module's plain ZeRO reading would mis-assemble or leave unread.
        # `detect` gives it to `deepspeed_moe`; callers that hold a DeepSpeed folder use `deepspeed_moe.open_any`.
        raise UnsupportedCheckpoint(
            "a DeepSpeed Mixture-of-Experts tag folder: read it with formats.deepspeed_moe",
            path=tag_dir,
            hint="open it with ckpt_tools.open_checkpoint, which detects MoE",
        )
    return build(root, tag_dir, tag, cache, ranks)


_EXPERT_FILE = re.compile(r"^layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt$")


_EXPP_FILE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_GATE = "deepspeed_moe.gate.wg.weight"


def _moe_declared(tag_dir: Path, root: Path, cache: C.LoadCache, module: dict, mp: int) -> list[Warning_]:
    """Declared vs found for the files of a DeepSpeed MoE layer: each gate `…deepspeed_moe.gate.wg.weight`
    [num_experts, hidden] in the model states is one MoE layer, whose experts are saved one file per
    (layer, global expert id, mp rank); without ZeRO the optimizer is in one `expp_rank_R` file per expert-parallel
    rank, and the MoE param groups are named `ep_size_<N>`. Names the missing and damaged pieces."""
    gates = [r for n, r in module.items() if str(n).endswith(_GATE) and isinstance(r, TensorRef) and r.shape]
    present = {p.name: p for p in tag_dir.iterdir() if _EXPERT_FILE.match(p.name) or _EXPP_FILE.match(p.name)}
    if not gates and not present:
        return []
    want = [
        f"layer_{i}_expert_{e}_mp_rank_{m:02d}_model_states.pt"
        for i, g in enumerate(gates)
        for e in range(g.shape[0])
        for m in range(mp)
    ]
    expp = sorted((p for n, p in present.items() if _EXPP_FILE.match(n)), key=lambda p: p.name)
    if expp:
        ep = None
        if not C.zip_damage(expp[0]):
            obj = cache.load(expp[0]).obj
            groups = _dig(obj, "optimizer", "param_groups") or []
            names = {g.get("name") for g in groups if isinstance(g, dict) and g.get("moe")}
            sizes = {int(n[8:]) for n in names if isinstance(n, str) and re.fullmatch(r"ep_size_\d+", n)}
            ep = max(sizes) if sizes else None
        top = max(int(_EXPP_FILE.match(p.name)[1]) for p in expp) + 1
        want += [f"expp_rank_{r}_mp_rank_{m:02d}_optim_states.pt" for r in range(max(ep or 0, top)) for m in range(mp)]
    out = []
    gone = [n for n in want if n not in present]
    if gone:
        out.append(
            Warning_(
                "declared-mismatch",
                f"{len(gone)} Mixture-of-Experts file(s) missing: "
                f"{', '.join(gone[:4])}{' …' if len(gone) > 4 else ''} (the model states declare "
                f"{len(gates)} MoE layer(s) of {', '.join(str(g.shape[0]) for g in gates)} experts"
                f"{'; the param groups ep_size' if expp else ''}); copy them back from where the "
                "checkpoint was saved",
                str((tag_dir / gone[0]).relative_to(root)),
            )
        )
    for n in sorted(present):
        damage = C.zip_damage(present[n])
        if damage:
            out.append(
                Warning_(
                    "corrupt-file",
                    f"{n}: {damage} (re-copy it from where the checkpoint was saved)",
                    str(present[n].relative_to(root)),
                )
            )
    return out


@dataclass
class Extension:
    """What a format built on this one adds (DeepSpeed MoE): parameter groups under their global names
    (`groups`), how each DP rank's file maps onto them (`group_layout`, see read_zero_optimizer), an optimizer
    read elsewhere, weights kept in other files, those files, and the expert-parallel size."""

    groups: list[dict[str, tuple[int, ...]]] | None = None
    file_groups: list[dict[str, tuple[int, ...]]] | None = None  # the groups under the names the rank files use
    group_layout: Callable[[int, int], tuple[int, Callable[[str], str] | None]] | None = None
    optimizer: ZeroOptimizer | None = None
    model: dict[str, TensorNode] = field(default_factory=dict)
    files: list = field(default_factory=list)
    ep: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


def build(
    root: Path,
    tag_dir: Path,
    tag: str | None,
    cache: C.LoadCache,
    ranks: dict[int, RankFiles],
    *,
    fmt: str = FORMAT,
    ext: Extension | None = None,
) -> Checkpoint:
    """The Checkpoint of a DeepSpeed tag folder (`ext`: what a format built on this one adds, e.g. MoE): the first
    rank's model states (names, shapes, counters, scheduler, config), the optimizer un-flattened from its DP rank
    files, the weights, and the rank files listed (the others' zip directories checked, not loaded)."""
    warnings: list[Warning_] = []
    first_rank = ranks[min(ranks)]
    ms_path, ms = _first_model_states(cache, tag_dir, first_rank)
    dp_size = as_int(ms.get("dp_world_size")) or max(len(first_rank.optim), 1)
    mp_size = as_int(ms.get("mp_world_size")) or len(ranks)
    _check_rank_files(tag_dir, ranks, dp_size, mp_size, warnings)
    shape_groups = ext.file_groups if ext and ext.file_groups is not None else _shape_groups(ms.get("param_shapes"))
    warnings += _moe_declared(
        tag_dir, root, cache, ms.get("module") if isinstance(ms.get("module"), dict) else {}, mp_size
    )

    opt = _zero_optimizer(ext, first_rank, dp_size, cache, shape_groups, ms_path, ms)
    if opt is not None:
        warnings += opt.warnings
    if ext and ext.groups is not None:
        shape_groups = ext.groups
    stage = opt.stage if opt else None
    if stage is None:
        stage = as_int(_dig(ms, "ds_config", "zero_optimization", "stage"))
    rel_ms = cache.rel(ms_path)
    model, frozen, weight_source = _weights(ms, shape_groups, stage, opt, ext, cache, first_rank, dp_size, rel_ms)
    names = [n for g in shape_groups for n in g]
    param_count = sum(math.prod(s) for g in shape_groups for s in g.values()) + sum(
        math.prod(tuple(s)) for s in frozen.values()
    )
    param_tensors = len(names) + len(frozen)
    tree, sched_node = _tree(ms, model, opt, rel_ms)
    sched = C.scheduler_fields(sched_node)
    counters, lrs = _counters_and_lrs(ms, sched, opt)
    opt_steps = opt.steps_seen if opt else []
    warnings += _state_warnings(ms, opt, counters, opt_steps, sched_node, stage, rel_ms)
    files = _rank_file_infos(ranks, root, ms_path, warnings)
    if ext:
        files += ext.files
    warnings += C.stray_file_warnings(tag_dir, root)
    if tag_dir != root:
        warnings += C.stray_file_warnings(root, root)
    warnings += cache.warnings()
    dtypes = sorted({n.dtype for n in model.values()} | ({opt.dtype} if opt and opt.dtype else set()))
    details = {
        "tag": tag,
        "ds_version": ms.get("ds_version"),
        "weights": weight_source,
        "optimizer_dtype": opt.dtype if opt else None,
    }
    if "scheduler" in tree and "last_batch_iteration" in sched and "base_lrs" not in sched:
        details["scheduler_kind"] = "deepspeed (LR comes from the launch config)"
    details.update(ext.details if ext else {})
    topo = Topology(dp=dp_size, tp=mp_size, pp=1, zero_stage=stage, ep=ext.ep if ext else None)
    totals = param_count, param_tensors, tuple(dtypes)
    return C.checkpoint_of(fmt, root, topo, tree, counters, lrs, totals, files, warnings, details)


def _counters_and_lrs(ms: dict, sched: dict, opt: ZeroOptimizer | None) -> tuple[Counters, LearningRates]:
    """The counters (model states, the scheduler, the most common Adam step) and the LRs (the first DP rank's
    param groups; the scheduler's, else the one ds_config's scheduler gives at the saved step)."""
    base_lrs, last_lr = C.lr_from_scheduler(sched)
    counters = C.deepspeed_counters(ms, sched, opt.steps_seen if opt else [])
    lrs = opt.lrs_by_rank[min(opt.lrs_by_rank)] if opt and opt.lrs_by_rank else ()
    last_lr = last_lr or C.ds_last_lr(sched, ms.get("ds_config"), lrs)
    return counters, LearningRates(param_groups=lrs, base_lrs=base_lrs, last_lr=last_lr)


def _zero_optimizer(ext, first_rank, dp_size, cache, shape_groups, ms_path, ms) -> ZeroOptimizer | None:
    """The optimizer: the extension's own, else un-flattened from the first model-parallel rank's DP rank files
    (those within dp_world_size), or None when there are none."""
    opt = ext.optimizer if ext else None
    if opt is None and first_rank.optim:
        in_world = {d: p for d, p in first_rank.optim.items() if d < dp_size}
        opt = read_zero_optimizer(
            cache,
            in_world,
            shape_groups,
            {"tp": first_rank.mp_rank},
            (cache.rel(ms_path), ms.get("ds_config")),
            group_layout=ext.group_layout if ext else None,
            out_groups=ext.groups if ext else None,
        )
    return opt


def _first_model_states(cache: C.LoadCache, tag_dir: Path, first_rank: RankFiles) -> tuple[Path, dict]:
    """(path, loaded dict) of the first rank's model states file (ZeRO-3 at mp > 1: its first zero_pp file)."""
    ms_path = first_rank.model_states or (first_rank.z3_model and first_rank.z3_model[min(first_rank.z3_model)])
    if not ms_path:
        raise MissingFile(
            f"mp_rank_{first_rank.mp_rank:02d}_model_states.pt is missing (the model states file: "
            "parameter names and shapes, counters, scheduler)",
            path=tag_dir,
            hint="copy it back from where the checkpoint was saved",
        )
    ms = cache.load(ms_path).obj
    if not isinstance(ms, dict):
        raise CorruptCheckpoint("model states file does not hold a dict", path=ms_path)
    return ms_path, ms


def _weights(ms, shape_groups, stage, opt, ext, cache, first_rank, dp_size, rel_ms) -> tuple[dict, dict, str]:
    """(the model's tensors by name, the frozen parameters' shapes, where the weights come from): module tensors
    (stage 1/2), else the fp32 master (stage 3 saves placeholders only); buffers from `module`."""
    model: dict[str, Any] = {}
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    names = [n for g in shape_groups for n in g]
    frozen = ms.get("frozen_param_shapes") if isinstance(ms.get("frozen_param_shapes"), dict) else {}
    buffers = [str(b) for b in ms.get("buffer_names") or []]
    shared = ms.get("shared_params") if isinstance(ms.get("shared_params"), dict) else {}
    if not frozen and module and stage is not None and stage < 3:
        # ZeRO-1 writes no frozen_param_shapes: a frozen weight is only in `module` (not a trainable
        # param, a buffer or a tied alias)
        known = set(names) | set(buffers) | {str(k) for k in shared}
        frozen = {  # the name first: a ZeRO-2 file's empty frozen_param_shapes leads here too, with 18k known names
            str(n): r.shape
            for n, r in module.items()
            if str(n) not in known and isinstance(r, TensorRef) and r.numel > 0
        }
    weight_source = "module"
    for name in names + [str(n) for n in frozen]:
        ref = module.get(name)
        if ext and name in ext.model:
            model[name] = ext.model[name]
        elif isinstance(ref, TensorRef) and ref.numel > 0:
            model[name] = tensor_node(ref, rel_ms, {"tp": first_rank.mp_rank})
        elif opt and name in opt.state and "fp32" in opt.state[name]:
            model[name] = opt.state[name]["fp32"]
            weight_source = (
                "module and expert files; where an expert file is missing, its fp32 master"
                if ext
                else "fp32 master (ZeRO-3 saves no module weights)"
            )
    if stage == 3 and frozen:
        model.update(_z3_frozen_nodes(cache, first_rank, frozen, dp_size, {n for n in frozen if n not in model}))
    for name in buffers:
        if isinstance(module.get(name), TensorRef):
            model[name] = tensor_node(module[name], rel_ms)
    return model, frozen, weight_source


def _tree(ms: dict, model: dict, opt: ZeroOptimizer | None, rel_ms: str) -> tuple[dict[str, Any], Any]:
    """(the tree: model, optimizer, scheduler, counters, client state, universal info, config; the scheduler node
    or None)."""
    tree: dict[str, Any] = {"model": GroupNode(model)}
    if opt:
        tree["optimizer"] = _optimizer_node(opt)
    sched_node = to_node(ms.get("lr_scheduler"), rel_ms) if isinstance(ms.get("lr_scheduler"), dict) else None
    if sched_node is not None:
        tree["scheduler"] = sched_node
    counters_raw = {k: ms.get(k) for k in ("global_steps", "global_samples", "skipped_steps")}
    tree["counters"] = GroupNode({k: ValueNode(v) for k, v in counters_raw.items()})
    client = {k: v for k, v in ms.items() if k not in DS_MODEL_KEYS}
    if client:
        tree["client_state"] = to_node(client, rel_ms)
    if "universal_checkpoint_info" in ms:
        tree["universal_checkpoint_info"] = to_node(ms["universal_checkpoint_info"], rel_ms)
    if isinstance(ms.get("ds_config"), dict):
        tree["config"] = to_node(ms["ds_config"], rel_ms)
    return tree, sched_node


def _state_warnings(ms, opt, counters, opt_steps, sched_node, stage, rel_ms) -> list[Warning_]:
    """LRs that differ across DP ranks, counters that disagree, a scheduler not saved, frozen parameters left
    out of the save."""
    warnings = []
    if opt and len(set(opt.lrs_by_rank.values())) > 1:
        warnings.append(Warning_("lr-mismatch", f"param group LRs differ across DP ranks: {opt.lrs_by_rank}"))
    warnings += C.counter_warnings(counters, optimizer_steps_seen=opt_steps)
    if sched_node is None and isinstance(_dig(ms, "ds_config", "scheduler"), dict):
        warnings.append(Warning_("scheduler-missing", "ds_config names a scheduler but lr_scheduler was not saved"))
    if stage in (2, 3) and "frozen_param_shapes" in ms and ms["frozen_param_shapes"] is None:
        # stages 2/3 record frozen parameters (an empty dict when there are none) unless save_checkpoint was
        # told exclude_frozen_parameters=True; ZeRO-1 never records them, so there it cannot be told
        warnings.append(
            Warning_(
                "frozen-excluded",
                "saved with exclude_frozen_parameters=True: parameters that do "
                "not train are not in this checkpoint (nor counted); a resume or export takes them "
                "from the model's own initial weights",
                rel_ms,
            )
        )
    return warnings


def _rank_file_infos(ranks: dict[int, RankFiles], root: Path, ms_path: Path, warnings: list[Warning_]) -> list:
    """Every rank's model and optimizer files listed; a model file other than the one read is checked for zip
    damage (its directory only, not loaded), warned about into `warnings`."""
    files = []
    for rf in ranks.values():
        for p in [rf.model_states, *rf.z3_model.values()]:
            if p:
                files.append(C.file_info(p, root, "model", {"tp": rf.mp_rank}))
            damage = C.zip_damage(p) if p and p != ms_path else None  # listed, not loaded: its zip directory only
            if damage:
                warnings.append(
                    Warning_(
                        "corrupt-file",
                        f"{p.name}: {damage}; the rank that loads it cannot resume "
                        "(re-copy it from where the checkpoint was saved)",
                        str(p.relative_to(root)),
                    )
                )
        for d, p in sorted(rf.optim.items()):
            files.append(C.file_info(p, root, "optimizer", {"tp": rf.mp_rank, "dp": d}))
    return files


def _z3_frozen_nodes(
    cache: C.LoadCache, rf: RankFiles, frozen: dict, dp: int, wanted: set[str]
) -> dict[str, TensorNode]:
    """ZeRO-3 frozen parameters (requires_grad=False): every DP rank's `zero_pp_rank_D_..._model_states.pt`
    holds its `ceil(numel / dp)`-element fragment in `frozen_param_fragments` (the last one padded), the same
    split as a trainable parameter's; the fragments in rank order, cut to numel, are the parameter."""
    out: dict[str, TensorNode] = {}
    if not wanted or not rf.z3_model:
        return out
    frags: dict[int, dict] = {}
    for d, p in sorted(rf.z3_model.items()):
        if d >= dp:
            continue
        obj = cache.load(p).obj
        f = obj.get("frozen_param_fragments") if isinstance(obj, dict) else None
        frags[d] = (f if isinstance(f, dict) else {}, cache.rel(p))
    for name in frozen:
        if name not in wanted:
            continue
        shape = tuple(frozen[name])
        numel = math.prod(shape)
        part = math.ceil(numel / dp) if numel else 0
        pieces = []
        for d in range(dp):
            frag, rel = frags.get(d, ({}, ""))
            ref = frag.get(name)
            cnt = max(0, min(part, numel - d * part))
            if not cnt:
                continue
            if not isinstance(ref, TensorRef) or ref.numel < cnt:
                raise CorruptCheckpoint(
                    f"frozen parameter {name}: the fragment of DP rank {d} is missing or short",
                    path=rf.z3_model.get(d),
                    hint="the rank files are from different runs",
                )
            pieces.append(Piece(rel, ref, 0, cnt, d * part, {"tp": rf.mp_rank, "dp": d}))
        if pieces:
            out[name] = TensorNode(shape, pieces[0].ref.dtype, tuple(pieces))
    return out


def model_layout(tag_dir: Path, cache: C.LoadCache | None = None) -> dict[str, Any]:
    """What a DeepSpeed tag folder's model-states file says about the model beyond its trainable parameters
        (what `zero_to_fp32` uses): {"order": every state-dict name in the module's own order (ZeRO-3 keeps
        empty placeholders under every name), "frozen": names of parameters with requires_grad=False,
        "tied": {alias: source} (DeepSpeed's `shared_params`: the alias is written with the source's value),
        "buffers": buffer names, "groups": the trainable names of each param group (`param_shapes`)}. Reads the one
    model-states file (metadata; no tensor bytes)."""
    cache = cache or C.LoadCache(tag_dir)
    ranks = list_rank_files(tag_dir)
    out: dict[str, Any] = {"order": [], "frozen": [], "tied": {}, "buffers": [], "groups": []}
    if not ranks:
        return out
    rf = ranks[min(ranks)]
    ms_path = rf.model_states or (rf.z3_model and rf.z3_model[min(rf.z3_model)])
    if not ms_path:
        return out
    ms = cache.load(ms_path).obj
    if not isinstance(ms, dict):
        return out
    module = ms.get("module") if isinstance(ms.get("module"), dict) else {}
    groups = [list(g) for g in _shape_groups(ms.get("param_shapes"))]
    names = [n for g in groups for n in g]
    frozen = ms.get("frozen_param_shapes") if isinstance(ms.get("frozen_param_shapes"), dict) else {}
    shared = ms.get("shared_params") if isinstance(ms.get("shared_params"), dict) else {}
    buffers = [str(b) for b in ms.get("buffer_names") or []]
    frozen_names = [str(n) for n in frozen]
    if not frozen_names and module:
        known = set(names) | set(buffers) | {str(k) for k in shared}
        frozen_names = [
            str(n) for n, r in module.items() if isinstance(r, TensorRef) and r.numel > 0 and str(n) not in known
        ]
    order = [str(n) for n in module] if module else []
    for n in [*buffers, *frozen_names, *names, *map(str, shared)]:
        if n not in order:
            order.append(n)
    out.update(
        order=order,
        frozen=frozen_names,
        tied={str(k): str(v) for k, v in shared.items()},
        buffers=buffers,
        groups=groups,
    )
    return out


def logical_layout(ck: Checkpoint) -> dict[str, Any]:
    """`model_layout` of the tag folder this Checkpoint was read from (`ckpt_tools.view.logical` asks for it)."""
    root = Path(ck.path)
    tag = ck.details.get("tag")
    tag_dir = root / tag if tag and (root / str(tag)).is_dir() else root
    return model_layout(tag_dir)


def _optimizer_node(opt: ZeroOptimizer) -> GroupNode:
    state = {}
    values: dict[Any, ValueNode] = {}  # nodes are immutable: one per distinct step / group number, shared
    for name, entry in opt.state.items():
        kids = {k: v for k, v in entry.items() if isinstance(v, TensorNode)}
        for key in ("step", "param_group"):
            if key in entry:
                v = entry[key]
                node = values.get((type(v), v))
                if node is None:
                    node = values[(type(v), v)] = ValueNode(v)
                kids[key] = node
        state[name] = group_node(kids)
    groups = {str(i): GroupNode({k: to_node(v, "") for k, v in g.items()}) for i, g in enumerate(opt.param_groups)}
    extras = {k: to_node(v, "") for k, v in opt.extras.items()}
    return GroupNode({"state": GroupNode(state), "param_groups": GroupNode(groups), **extras})


def _check_rank_files(tag_dir: Path, ranks: dict[int, RankFiles], dp: int, mp: int, warnings: list) -> None:
    """Missing rank files are fatal (the flat state cannot be un-flattened); extra ones are warnings."""
    for t in range(mp):
        rf = ranks.get(t)
        if rf is None or (rf.model_states is None and not rf.z3_model):
            raise MissingFile(
                f"mp_rank_{t:02d}_model_states.pt is missing (mp_world_size={mp})",
                path=tag_dir,
                hint="re-copy the tag folder; every model-parallel rank's file is needed",
            )
        if rf.optim:
            prefix = next(iter(rf.optim.values())).name.split("zero_pp_rank_")[0]
            for d in range(dp):
                if d not in rf.optim:
                    raise MissingFile(
                        f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt is missing (dp_world_size={dp})",
                        path=tag_dir,
                        hint="re-copy the tag folder; every DP rank's optimizer file is needed",
                    )
            if rf.z3_model:  # ZeRO-3: every DP rank loads its own model-states file
                for d in range(dp):
                    if d not in rf.z3_model:
                        raise MissingFile(
                            f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt is missing "
                            f"(ZeRO-3, dp_world_size={dp}: each rank loads its own)",
                            path=tag_dir,
                            hint="re-copy the tag folder; every DP rank's file is needed",
                        )
            for d in sorted(rf.optim):
                if d >= dp:
                    warnings.append(
                        Warning_(
                            "extra-rank-file",
                            f"{rf.optim[d].name} is beyond dp_world_size={dp}: "
                            "left over from another run? Move it out of the folder",
                            str(rf.optim[d].relative_to(tag_dir.parent)),
                        )
                    )
    for t in sorted(ranks):
        if t >= mp:
            warnings.append(
                Warning_(
                    "extra-rank-file",
                    f"files for mp_rank {t:02d} are beyond mp_world_size={mp}: "
                    "left over from another run? Move them out of the folder",
                )
            )


def tag_state_sources(root: Path, tag_dir: Path) -> list:
    """The files of a DeepSpeed tag folder that hold training state: model states (scheduler, counters,
    ds_config) and optim states (param groups, Adam steps); pipeline `layer_*` files hold weights only."""
    files = [p for p in sorted(tag_dir.glob("*model_states.pt")) if not p.name.startswith("layer_")]
    files += sorted(tag_dir.glob("*optim_states.pt"))
    return [StateSource(p, str(p.relative_to(root))) for p in files]


def training_state(ck: Checkpoint):
    root = Path(ck.path)
    tag = ck.details.get("tag")
    tag_dir = root / tag if tag and (root / tag).is_dir() else root
    return StateMap(root, tuple(tag_state_sources(root, tag_dir)))


def zero_tag_dir(path: Path) -> Path:
    """The DeepSpeed tag folder inside `path` that `ckpt to-universal` converts: a DeepSpeed run folder's (named by
    `latest`); Accelerate's `pytorch_model/`, a plain DeepSpeed tag folder named by `latest`; an HF Trainer
    `checkpoint-N/` holding `global_stepN/` named by `latest` the same way. A refusal naming the fix otherwise."""
    try:
        _, tag_dir, _ = C.resolve_tag(path, "*mp_rank_*_model_states.pt")
    except CkptError:
        raise UnsupportedCheckpoint(
            "no DeepSpeed tag folder inside",
            path=path,
            hint="to-universal converts DeepSpeed ZeRO, Megatron-DeepSpeed pipeline, "
            "Accelerate+DeepSpeed checkpoints and HF Trainer+DeepSpeed "
            "checkpoint-N folders (pass one checkpoint-N)",
        ) from None
    return tag_dir


def universal_source(path: Path, tp_patterns: tuple[str, ...] = ()) -> UniversalSource:
    """For `ckpt to-universal`: the tag folder (`zero_tag_dir`); `detect` gave this module, not `deepspeed_moe`, so
    it holds no expert files."""
    tag_dir = zero_tag_dir(path)
    return UniversalSource(open(tag_dir), tag_dir, "zero", tag_dir)
