"""DeepSpeed Mixture-of-Experts checkpoints (`deepspeed.moe.layer.MoE`): a DeepSpeed tag folder whose experts sit
in their own files. Measured layouts (DeepSpeed 0.19.8; docs/deepspeed.md, Mixture-of-Experts):

- `layer_{L}_expert_{E}_mp_rank_{tp:02d}_model_states.pt`: the weights of expert E (a GLOBAL id) of MoE layer L,
  under their global names (`…deepspeed_experts.{E}.…`); `mp_rank_00_model_states.pt` holds the rest of the model,
  the scheduler and the counters, as for any DeepSpeed checkpoint.
- The param groups are split into non-MoE and MoE groups (`moe: True`, named `ep_size_<N>`: N is the
  expert-parallel size). Expert-parallel rank e holds experts e * n_local … (e + 1) * n_local - 1 under LOCAL
  names (`deepspeed_experts.{i}`), global id = e * n_local + i (DeepSpeed's own expert file naming).
- ZeRO-1/2: `[bf16_]zero_pp_rank_{r}_…_optim_states.pt` per DP rank. Non-MoE groups are partitioned over all DP
  ranks; MoE groups over the expert-data-parallel group only (`partition_count`), with DeepSpeed's default
  groups: DP rank r is expert-parallel rank r % ep and expert-data-parallel rank r // ep. DeepSpeed 0.19.8 saves
  `param_shapes` (MoE groups under local names); 0.14 / 0.16 save none (then the groups come from
  `param_slice_mappings`) and add `expp_rank_*` files holding `{'optimizer': None}`.
- No ZeRO: `expp_rank_{e}_mp_rank_00_optim_states.pt` per expert-parallel rank, the whole torch optimizer of that
  rank (its non-MoE parameters, replicated, and its own experts), numbered in param-group order.

Read here: every expert counted once under its global name, with its optimizer state; where a ZeRO file holds an
fp32 master, each expert's placement is CONFIRMED by the data (its master rounds to the weights of its expert file),
never assumed. Where the training state lives: every rank file (model states, ZeRO or expp files). Writes are
set-lr / set-step edit every rank file (proven by DeepSpeed resumes of edited copies). `to-universal` writes every
expert under its global id (without ZeRO: the fp32 weights as master), which DeepSpeed's universal loader takes at
expert-parallel size 1 (any DP
size): the expert-parallel re-shape, proven by DeepSpeed resumes. convert to DCP / torch is refused for now (no
resume has proven it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, MissingFile, NotACheckpoint, UnsupportedCheckpoint
from ..read.pickle_reader import TensorRef
from ..read.tree import Checkpoint, TensorNode, Warning_, as_int, tensor_node
from . import _common as C
from . import deepspeed as D
from ._protocol import UniversalSource
from .torch_file import match_param_ids

FORMAT = "deepspeed_moe"
_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_LOCAL = re.compile(r"(\.deepspeed_experts\.)(\d+)(\.)")


def _tag_dir(path: Path) -> Path | None:
    if not path.is_dir():
        return None
    try:
        return C.resolve_tag(path, D._STATE_GLOB)[1]
    except Exception:  # noqa: BLE001  not a DeepSpeed folder: not ours
        return None


def sniff(path: Path) -> bool:
    tag_dir = _tag_dir(path)
    return tag_dir is not None and any(_EXPERT.match(p.name) for p in tag_dir.iterdir())


def _rename(e: int, n_local: int):
    """Local expert names of expert-parallel rank e -> global names."""
    return lambda name: _LOCAL.sub(lambda m: f"{m[1]}{e * n_local + int(m[2])}{m[3]}", name)


def _gate_rows(module: dict) -> list[int]:
    """Experts per MoE layer, from each layer's gate `…deepspeed_moe.gate.wg.weight` [num_experts, hidden]."""
    return [r.shape[0] for n, r in module.items() if str(n).endswith(D._GATE) and isinstance(r, TensorRef)]


def _is_moe(g: Any) -> bool:
    return isinstance(g, dict) and bool(g.get("moe"))


def _ep_size(groups: list[dict]) -> int | None:
    sizes = {
        int(g["name"][8:])
        for g in groups
        if _is_moe(g) and isinstance(g.get("name"), str) and re.fullmatch(r"ep_size_\d+", g["name"])
    }
    return sizes.pop() if len(sizes) == 1 else None


def open_any(path: Path) -> Checkpoint:
    """A DeepSpeed checkpoint folder (the run folder with `latest`, or a tag folder) found inside another
    framework's folder (Accelerate, HF Trainer, to-universal's source), MoE or not: read by this module where the
    tag folder holds expert files, by `deepspeed.open` otherwise."""
    _, tag_dir, _ = C.resolve_tag(path, D._STATE_GLOB)
    if any(_EXPERT.match(p.name) for p in tag_dir.iterdir()):
        return open(tag_dir)
    return D.open(path)


def universal_source(path: Path, tp_patterns: tuple[str, ...] = ()) -> UniversalSource:
    """For `ckpt to-universal`: every expert under its global name, with its state from the ZeRO partitions of its
    expert-parallel rank (`tp_patterns` are not this reader's: the TP rules come from the checkpoint)."""
    _, tag_dir, _ = C.resolve_tag(path, D._STATE_GLOB)
    return UniversalSource(open(path), tag_dir, "zero", path)


def zero_tag_source(path: Path) -> UniversalSource:
    """For `ckpt to-universal`, the DeepSpeed tag folder inside `path` (`deepspeed.zero_tag_dir`), read by
    `open_any`."""
    tag_dir = D.zero_tag_dir(path)
    return UniversalSource(open_any(tag_dir), tag_dir, "zero", tag_dir)


def open(path: Path) -> Checkpoint:  # noqa: A001  (the format-module interface)
    """The DeepSpeed Mixture-of-Experts tag folder at `path` (or its run folder with `latest`). Reads (inert)
    `mp_rank_00_model_states.pt`, every `layer_*_expert_*_model_states.pt` (each expert's weights, global ids)
    and the optimizer files: the ZeRO `*zero_pp_rank_*_optim_states.pt` of every DP rank (experts placed by
    their group's partitioning and confirmed against their weights) or, without ZeRO, every
    `expp_rank_*_optim_states.pt`. Tensors stay lazy. Training state: every rank file, as for DeepSpeed
    (`training_state`)."""
    if not path.is_dir():
        raise NotACheckpoint("no DeepSpeed Mixture-of-Experts tag folder", path=path)
    root, tag_dir, tag = C.resolve_tag(path, D._STATE_GLOB)
    cache = C.LoadCache(root)
    ranks = D.list_rank_files(tag_dir)
    if not ranks or ranks[min(ranks)].model_states is None:
        raise MissingFile(
            "mp_rank_00_model_states.pt is missing (the non-expert weights, counters, scheduler)",
            path=tag_dir,
            hint="copy it back from where the checkpoint was saved",
        )
    if len(ranks) > 1 or any(rf.z3_model for rf in ranks.values()):
        raise UnsupportedCheckpoint(
            "a DeepSpeed MoE checkpoint with tensor parallelism or ZeRO-3: ckpt reads MoE "
            "checkpoints of one model-parallel rank with ZeRO 0-2",
            path=tag_dir,
        )
    rf = ranks[min(ranks)]
    ms = cache.load(rf.model_states).obj
    if not isinstance(ms, dict) or not isinstance(ms.get("module"), dict):
        raise CorruptCheckpoint("model states file does not hold a module", path=rf.model_states)
    module = ms["module"]
    dp = as_int(ms.get("dp_world_size")) or max(len(rf.optim), 1)
    _refuse_variants(ms, rf)

    experts, expert_files = _expert_weights(tag_dir, root, cache)
    expp = {int(m[1]): p for p in sorted(tag_dir.iterdir()) if (m := _EXPP.match(p.name))}
    ext = D.Extension(
        model=experts,
        files=[C.file_info(p, root, "model", {"expert": e, "layer": L}) for (L, e), p in sorted(expert_files.items())],
    )
    ext.details["convert_unproven"] = (
        "no framework has resumed a Mixture-of-Experts checkpoint converted to DCP "
        "or torch in a test yet; `ckpt to-universal` carries every expert and its "
        "optimizer state (resumed by DeepSpeed at expert-parallel size 1), and "
        "`ckpt export` writes every expert"
    )
    if rf.optim:
        _zero_layout(ext, rf, ms, module, experts, dp, cache, expp, root)
    elif expp:
        _expp_optimizer(ext, expp, module, experts, cache, root)
    else:
        raise MissingFile(
            "no optimizer files (ZeRO *_optim_states.pt or expp_rank_*): the experts' optimizer state is missing",
            path=tag_dir,
            hint="copy the tag folder whole",
        )
    per = {}
    for name, node in experts.items():
        m = _LOCAL.search(name)
        key = (name[: m.start()], int(m[2]))  # (MoE layer's module, expert id)
        per[key] = per.get(key, 0) + node.numel
    if per:
        sizes = sorted(set(per.values()))
        ext.details["expert_parameters"] = (
            f"{'/'.join(f'{x:,}' for x in sizes)} per expert, {sum(per.values()):,} in {len(per)} experts"
        )
    ck = D.build(root, tag_dir, tag, cache, ranks, fmt=FORMAT, ext=ext)
    if rf.optim:
        state = ck.get("optimizer.state").children
        _confirm_placement({n: state[n].children.get("fp32") if n in state else None for n in experts}, experts, rf)
    return ck


def _refuse_variants(ms: dict, rf) -> None:
    """Layouts this reader does not place yet, refused by name rather than mis-read or called corrupt."""
    where = rf.model_states
    if ms.get("ds_autoep_layers"):
        raise UnsupportedCheckpoint(
            "a DeepSpeed AutoEP checkpoint (ds_autoep_layers): its expert files hold "
            "fused expert weights ckpt does not read yet",
            path=where,
        )
    if D._dig(ms, "ds_config", "use_data_before_expert_parallelism"):
        raise UnsupportedCheckpoint(
            "a DeepSpeed MoE checkpoint saved with use_data_before_expert_parallelism: its "
            "expert-parallel groups are laid out differently, which ckpt does not place yet",
            path=where,
        )
    frozen = ms.get("frozen_param_shapes")
    if isinstance(frozen, dict) and any(_LOCAL.search(str(n)) for n in frozen):
        raise UnsupportedCheckpoint(
            "a DeepSpeed MoE checkpoint with frozen experts (frozen_param_shapes names "
            "expert parameters): ckpt does not place frozen experts yet",
            path=where,
        )


def _expert_weights(tag_dir: Path, root: Path, cache: C.LoadCache):
    """Every expert file's tensors under their (global) names; {(layer, expert): path}."""
    out: dict[str, TensorNode] = {}
    files: dict[tuple[int, int], Path] = {}
    found = sorted(
        ((int(m[1]), int(m[2]), p) for p in tag_dir.iterdir() if (m := _EXPERT.match(p.name))), key=lambda x: x[:2]
    )  # (MoE layer, expert) in number order: model order
    for layer, expert, p in found:
        files[(layer, expert)] = p
        obj = cache.load(p).obj
        if not isinstance(obj, dict) or not any(isinstance(v, TensorRef) for v in obj.values()):
            raise CorruptCheckpoint(f"{p.name} holds no expert tensors", path=p, hint="re-copy it")
        for k, v in obj.items():
            if isinstance(v, TensorRef):
                ids = [int(x[2]) for x in _LOCAL.finditer(str(k))]
                if ids != [expert]:
                    raise CorruptCheckpoint(
                        f"{p.name} holds {k}, not a tensor of expert {expert}",
                        path=p,
                        hint="the file was renamed or comes from another run",
                    )
                out[str(k)] = tensor_node(v, cache.rel(p), {"expert": expert})
    return out, files


def _groups_of(obj: Any) -> list[dict]:
    for keys in (("optimizer_state_dict", "base_optimizer_state", "param_groups"), ("optimizer", "param_groups")):
        g = D._dig(obj, *keys)
        if isinstance(g, list):
            return [x for x in g if isinstance(x, dict)]
    return []


def _zero_layout(ext, rf, ms, module, experts, dp, cache, expp, root) -> None:
    """ZeRO-1/2: the MoE groups' partitions are per expert-parallel rank; non-MoE groups as plain ZeRO."""
    first = cache.load(rf.optim[min(rf.optim)]).obj
    groups = _groups_of(first)
    ep = _ep_size(groups)
    moe = [i for i, g in enumerate(groups) if _is_moe(g)]
    if not moe or ep is None or dp % ep:
        raise UnsupportedCheckpoint(
            f"MoE param groups {[g.get('name') for g in groups]} name no single "
            f"expert-parallel size dividing dp={dp}: ckpt will not guess where the experts "
            "are",
            path=rf.optim[min(rf.optim)],
        )
    n_experts = {int(x) for x in (ms.get("num_experts") or _gate_rows(module))}
    if len(n_experts) != 1 or next(iter(n_experts)) % ep:
        raise UnsupportedCheckpoint(
            f"MoE layers of {sorted(n_experts)} experts with ep_size {ep}: ckpt reads MoE "
            "models whose layers all have the same number of experts",
            path=rf.model_states,
        )
    n_local = next(iter(n_experts)) // ep
    osd = first.get("optimizer_state_dict") if isinstance(first, dict) else {}
    counts = osd.get("partition_count") if isinstance(osd, dict) else None
    if isinstance(counts, list) and any(as_int(counts[i]) != dp // ep for i in moe if i < len(counts)):
        raise UnsupportedCheckpoint(
            f"partition_count {counts}: the MoE groups are not partitioned over the "
            f"expert-data-parallel group of {dp // ep} rank(s) DeepSpeed's default groups give",
            path=rf.optim[min(rf.optim)],
        )
    file_groups = D._shape_groups(ms.get("param_shapes")) or _groups_from_mappings(
        rf, cache, module, experts, ep, n_local
    )

    def layout(gi: int, r: int):
        return (r // ep, _rename(r % ep, n_local)) if gi in moe else (r, None)

    groups_out = []
    for gi, shapes in enumerate(file_groups):
        if gi not in moe:
            groups_out.append(shapes)
            continue
        out = {}
        for e in range(ep):
            ren = _rename(e, n_local)
            out.update({ren(n): s for n, s in shapes.items()})
        groups_out.append(out)
    missing = sorted(set(experts) - {n for gi in moe for n in groups_out[gi]})
    if missing:
        raise CorruptCheckpoint(
            f"{len(missing)} expert tensor(s) in the expert files belong to no MoE param group "
            f"({', '.join(missing[:3])} …)",
            path=rf.model_states,
        )
    ext.file_groups, ext.groups, ext.group_layout, ext.ep = file_groups, groups_out, layout, ep
    _set_experts(ext, next(iter(n_experts)), ep, len(groups_out), moe)
    for e, p in expp.items():  # DeepSpeed 0.14 / 0.16 write them with ZeRO too: {'optimizer': None}
        obj = cache.load(p).obj
        if not (isinstance(obj, dict) and obj.get("optimizer") is None):
            raise UnsupportedCheckpoint(
                f"{p.name} holds an optimizer beside ZeRO partitions: ckpt does not know which one DeepSpeed loads",
                path=p,
            )
        ext.files.append(C.file_info(p, root, "optimizer", {"ep": e}))
    ext.details["expert_check"] = "each expert's fp32 master rounds to its expert file's weights (checked)"


def _set_experts(ext, n: int, ep: int, groups: int, moe: list[int]) -> None:
    """The experts per MoE layer (`num_experts`: to-universal marks the expert files with it) and their line."""
    ext.details["num_experts"] = n
    ext.details["experts"] = (
        f"{n} per MoE layer, expert parallel {ep} ({n // ep} per rank); param groups "
        f"{', '.join(str(i) for i in moe)} of {groups} hold them"
    )


def _groups_from_mappings(rf, cache, module, experts, ep, n_local) -> list[dict[str, tuple[int, ...]]]:
    """No `param_shapes` (DeepSpeed < 0.19): each group's parameters in order from the DP ranks'
    `param_slice_mappings` (rank order, a parameter split across two ranks named by both), shapes from the
    weights (MoE groups under EP rank 0's local names)."""
    ren0 = _rename(0, n_local)
    out: list[dict[str, tuple[int, ...]]] = []
    for r in sorted(rf.optim):
        obj = cache.load(rf.optim[r]).obj
        maps = D._dig(obj, "optimizer_state_dict", "param_slice_mappings")
        if not isinstance(maps, list):
            raise CorruptCheckpoint(
                "no param_shapes in the model states and no param_slice_mappings in the "
                "optimizer file: the flat partitions cannot be named",
                path=rf.optim[r],
            )
        while len(out) < len(maps):
            out.append({})
        for gi, mp in enumerate(maps):
            for name in mp:
                name = str(name)
                ref = module.get(name)
                node = experts.get(ren0(name))
                shape = tuple(ref.shape) if isinstance(ref, TensorRef) else node.shape if node is not None else None
                if shape is None:
                    raise CorruptCheckpoint(
                        f"{name} is in the optimizer's param_slice_mappings but in no weights file", path=rf.optim[r]
                    )
                out[gi].setdefault(name, shape)
    return out


def _confirm_placement(masters: dict[str, TensorNode | None], experts: dict[str, TensorNode], rf) -> None:
    """Each expert's fp32 master (first 128 elements) rounds to its expert file's weights: the expert-parallel
    rank -> global id mapping is the one DeepSpeed used, not an assumption."""
    for name, node in experts.items():
        fp32 = masters.get(name)
        if fp32 is None:
            raise CorruptCheckpoint(
                f"expert parameter {name} has no fp32 master in the ZeRO files", path=rf.model_states
            )
        k = min(node.numel, 128)
        if node.dtype in ("bfloat16", "float16", "float32") and not C.rounds_to(
            C.read_range(fp32, 0, k), C.read_range(node, 0, k), node.dtype
        ):
            raise UnsupportedCheckpoint(
                f"the fp32 master ckpt places at {name} does not round to that expert's "
                "weights: the experts are not where DeepSpeed's default expert-parallel "
                "groups put them (a custom group layout?); ckpt will not guess",
                path=rf.model_states,
            )


def _expp_optimizer(ext, expp: dict[int, Path], module, experts, cache, root) -> None:
    """No ZeRO: one whole torch optimizer per expert-parallel rank. Ids map to names group by group in model
    order (the non-MoE names, then this rank's experts under local names); non-MoE state from rank 0's file
    (the others hold the same replicas), each expert's from its own rank's file."""
    ep, gates = _expp_size(expp, module, cache)
    n_local = gates[0] // ep
    dense = [str(n) for n, r in module.items() if isinstance(r, TensorRef) and r.numel > 0]
    order = {n: i for i, n in enumerate(experts)}  # expert files in (layer, expert) order, each file in its order
    ren0 = _rename(0, n_local)
    local = sorted(
        {_LOCAL.sub(lambda m: f"{m[1]}{int(m[2]) % n_local}{m[3]}", n) for n in experts},
        key=lambda n: order.get(ren0(n), -1),
    )
    shapes = {n: tuple(module[n].shape) for n in dense}
    for n in local:
        shapes[n] = experts[ren0(n)].shape
    state: dict[str, dict[str, Any]] = {}
    steps: list[int] = []
    lrs: dict[int, tuple[float, ...]] = {}
    groups0: list[dict] = []
    out_groups: list[dict[str, tuple[int, ...]]] = []
    for e, p in sorted(expp.items()):
        osd, groups, gids, ids = _expp_ids(p, cache.load(p).obj, dense, local, shapes)
        ren = _rename(e, n_local)
        rel = cache.rel(p)
        lrs[e] = tuple(float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float)))
        if e == 0:
            groups0 = groups
            out_groups = [{} for _ in groups]
        for gi, glist in enumerate(gids):
            for i in glist:
                name = ids[i]
                if not _is_moe(groups[gi]) and e > 0:
                    continue
                gname = ren(name) if _is_moe(groups[gi]) else name
                entry: dict[str, Any] = {"param_group": gi, "_file": rel}
                s = osd["state"].get(i) if isinstance(osd["state"].get(i), dict) else {}
                for k in ("exp_avg", "exp_avg_sq"):
                    if isinstance(s.get(k), TensorRef):
                        entry[k] = tensor_node(s[k], rel, {"ep": e})
                st = s.get("step")
                st = st.item() if isinstance(st, TensorRef) and st.numel == 1 else st
                if as_int(st) is not None:
                    entry["step"] = as_int(st)
                    steps.append(as_int(st))
                state[gname] = entry
                if gi < len(out_groups):
                    out_groups[gi][gname] = experts[gname].shape if gname in experts else shapes[name]
        ext.files.append(C.file_info(p, root, "optimizer", {"ep": e}))
    problems = _lost_state(state)
    ext.optimizer = D.ZeroOptimizer(0, state, groups0, steps, lrs, {}, warnings=problems)
    ext.groups, ext.ep = out_groups, ep
    moe = [i for i, g in enumerate(groups0) if _is_moe(g)]
    _set_experts(ext, gates[0], ep, len(out_groups), moe)


def _expp_size(expp: dict[int, Path], module: dict, cache: C.LoadCache) -> tuple[int, list[int]]:
    """(the expert-parallel size the param groups name, each MoE layer's expert count from its gate), refusing the
    mixed-precision wrapper, a missing or extra expp_rank file, and layers whose experts do not split over EP."""
    for p in expp.values():
        wrapped = D._dig(cache.load(p).obj, "optimizer")
        if isinstance(wrapped, dict) and ("optimizer_state_dict" in wrapped or "fp32_groups" in wrapped):
            raise UnsupportedCheckpoint(
                f"{p.name} holds DeepSpeed's mixed-precision optimizer wrapper (bf16/fp16 "
                "without ZeRO: fp32_groups): ckpt does not read it yet",
                path=p,
            )
    first = expp[min(expp)]
    ep = _ep_size(_groups_of(cache.load(first).obj))
    if ep is None:
        raise UnsupportedCheckpoint("the MoE param groups name no single expert-parallel size (ep_size_N)", path=first)
    gone = [f"expp_rank_{e}_mp_rank_00_optim_states.pt" for e in range(ep) if e not in expp]
    if gone:
        raise MissingFile(
            f"{', '.join(gone)} missing: the param groups say ep_size {ep}, one optimizer file per "
            "expert-parallel rank (its experts' Adam state)",
            path=first.parent / gone[0],
            hint="copy it back from where the checkpoint was saved",
        )
    if max(expp) >= ep:
        raise CorruptCheckpoint(
            f"expp_rank_{max(expp)} is beyond ep_size {ep}: files from another run?",
            path=expp[max(expp)],
            hint="move it out of the folder",
        )
    gates = _gate_rows(module)
    if len(set(gates)) != 1 or gates[0] % ep:
        raise UnsupportedCheckpoint(
            f"MoE layers of {sorted(set(gates))} experts over {ep} expp_rank files", path=next(iter(expp.values()))
        )
    return ep, gates


def _expp_ids(p: Path, obj: Any, dense: list[str], local: list[str], shapes: dict) -> tuple[dict, list, list, dict]:
    """(the optimizer state dict of one expp_rank file, its param groups, their param ids, id -> local name): the
    MoE groups hold exactly this rank's experts and the others the rest, matched apart by group and shape, so
    that a bias of one kind is never taken for the other's."""
    osd = obj.get("optimizer") if isinstance(obj, dict) else None
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict):
        raise CorruptCheckpoint(f"{p.name} holds no optimizer state", path=p, hint="re-copy it")
    groups = [g for g in osd.get("param_groups") or [] if isinstance(g, dict)]
    gids = [list(g.get("params") or []) for g in groups]
    id_shapes = {
        i: next((tuple(v.shape) for v in s.values() if isinstance(v, TensorRef) and v.numel > 1), None)
        for i, s in osd["state"].items()
        if isinstance(s, dict)
    }
    ids: dict[Any, str] = {}
    for is_moe, names in ((False, dense), (True, local)):
        part = [gids[gi] for gi in range(len(groups)) if _is_moe(groups[gi]) == is_moe]
        got = match_param_ids(part, id_shapes, names, shapes)
        if got is None:
            raise UnsupportedCheckpoint(
                f"{p.name}: the optimizer's {sum(map(len, part))} "
                f"{'MoE' if is_moe else 'non-MoE'} parameter ids do not map onto the "
                f"{len(names)} {'expert' if is_moe else 'non-expert'} parameters of this "
                "rank by group and shape",
                path=p,
            )
        ids.update(got)
    return osd, groups, gids, ids


def _lost_state(state: dict[str, dict[str, Any]]) -> list[Warning_]:
    """Parameters without the Adam state the others have, per file (each entry's `_file`, removed here)."""
    kinds = {k for e in state.values() for k in ("exp_avg", "exp_avg_sq") if k in e}
    lost: dict[str, list[str]] = {}
    for name, e in state.items():
        if not kinds <= set(e):
            lost.setdefault(e["_file"], []).append(name)
    problems = [
        Warning_(
            "declared-mismatch",
            f"{len(names)} parameter(s) its param groups list have no Adam state "
            f"in this file ({', '.join(names[:4])}{' …' if len(names) > 4 else ''}) while the others "
            "have it: lost state (a resume restarts those moments at zero)",
            f,
        )
        for f, names in sorted(lost.items())
    ]
    for e in state.values():
        del e["_file"]
    return problems


def training_state(ck: Checkpoint):
    """The model states (scheduler, counters) and every ZeRO / expp_rank optimizer file (each holds the MoE and
    non-MoE param groups of its rank): DeepSpeed's own tag-folder sources; the expert files hold weights only."""
    return D.training_state(ck)


__all__ = ["sniff", "open", "training_state", "FORMAT"]
