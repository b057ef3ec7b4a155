"""`ckpt to-universal`: DeepSpeed ZeRO / Megatron pipeline / Accelerate / HF Trainer+DeepSpeed -> DeepSpeed universal.

What DeepSpeed's `load_universal` reads (deepspeed 0.19: `runtime/base_optimizer.py`,
`checkpoint/universal_checkpoint.py`, `runtime/zero/stage3.py`, `runtime/engine.py`), and so what we write:

    OUT/latest_universal                      the tag name
    OUT/<tag>_universal/mp_rank_MM_model_states.pt              ZeRO-1/2 loaders glob these (counters, scheduler)
    OUT/<tag>_universal/zero_pp_rank_0_mp_rank_MM_model_states.pt  ZeRO-3 loaders glob these instead
    OUT/<tag>_universal/zero/<param>/{fp32,<state>}.pt         {"param": full tensor, "cat_dim": d, ...}; <state>
                                                                 is every per-parameter optimizer state the source
                                                                 keeps: exp_avg/exp_avg_sq (Adam), momentum_buffer
                                                                 (SGD), sum (Adagrad), ...
    OUT/<tag>_universal/zero/<param>/step.pt                    the optimizer's step where it keeps one (Adam,
                                                                 Adagrad; not SGD): ZeRO-1/2 loaders take it here
    OUT/<tag>_universal/zero/optimizer_state.pt                 param_groups + loss-scaler fields (1/2), and
                                                                 optimizer_state_dict.{state[g].step,param_groups} (3)

Which optimizer state each DeepSpeed loader takes (0.19.8, read in its source):
  ZeRO-1/2 (`base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir` -> `universal_checkpoint.
  load_hp_checkpoint_state`): every `<key>.pt` in the parameter's folder; fp32 becomes the master weight, step
  the optimizer step, any other key `optimizer.state[flat partition][key]` (`map_to_flat_opt_states`). So SGD's
  momentum_buffer, Adagrad's sum or a one-moment optimizer's exp_avg load as they are.
  ZeRO-3 (`stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`): exactly fp32, exp_avg, exp_avg_sq
  (a hard-coded list; a missing file is a FileNotFoundError, any other file is ignored) and
  `optimizer_state.pt`'s optimizer_state_dict.state[0].step (KeyError without it); then it copies param group
  0's hyper-parameters (lr, weight_decay, ...) onto every group. Non-Adam state therefore cannot be loaded at
  ZeRO-3 from any universal checkpoint: `--target-stage 3` is refused for it, and by default only the
  ZeRO-1/2 half is written, with a note. `zero3_group_warnings` says what the group-0 copy will change.

DeepSpeed's own converter writes only one stage's half of this (ZeRO-3 input: bare flat tensors, no step.pt,
no mp_rank_* file a ZeRO-1/2 loader globs; ZeRO-1/2 input: no zero_pp_rank_0 file, no nested
optimizer_state_dict), which is why its output cannot change ZeRO stage. Both halves are small.

How: the source is opened as a lazy tree (`Checkpoint`); each parameter's fp32 master / exp_avg /
exp_avg_sq is a TensorNode whose `pieces` locate its elements inside the flat ZeRO partitions of every DP
rank (and whose `shards` are its TP ranks). Where a state needs no merge and no dtype change (every ZeRO
checkpoint at TP=1: the fp32 partitions hold exactly the bytes the output tensor has), its file is written
directly in torch.save's format (`torch_zip`): a small pickle (`pickle_writer`, the one torch.save would
write), and the tensor's bytes copied file to file by the kernel from the partitions' ranges
(copy_file_range), their CRC-32 read through a small buffer. Nothing imports torch on that path, and memory
stays at that buffer. Otherwise (TP shards to merge, vocabulary padding to strip, a bf16 module weight to
widen) a worker reads the pieces into one buffer with `os.preadv` (pread copies from the page cache and
leaves nothing behind in RSS, unlike a touched mmap), merges them by the rule `tp_layout` gives, and writes
that buffer the same way. step.pt and optimizer_state.pt are the optimizer file's own records (read by
`pickle_reader`, nothing run) pickled back by `pickle_writer`. No fragment files, no second pass.
The folder is built under `io.new_folder`'s staging name and renamed into place when complete and verified.
Under torchrun (`execute(distributed=True)`, `_execute_job`) the ranks share the parameters by bytes in a staging
folder of a fixed name with a journal (`write/shares`), so that the same command resumes an interrupted job.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import CkptError, UnsupportedCheckpoint
from ..formats import _common as C
from ..formats import deepspeed as D
from ..formats import detect
from ..formats._protocol import UniversalSourceModule
from ..read.tensor_read import read_tensor
from ..read.tp_layout import TPLayout
from ..read.tree import Checkpoint, GroupNode, TensorNode, ValueNode
from ..view.accounting import guard, left_behind
from ..view.logical import name_key
from ..write import io, shares
from .diff import iter_lines, logical_diff
from .tp_sync import compare_shards
from .universal_files import (  # the plan's types and the files' writers; _save_record and verify_written stay
    ADAM_STATE,  # importable from here (tests write records with it and re-read outputs)
    PARAM_N_SUB_PARAMS,
    VOCAB_TENSOR,
    ParamJob,
    UniversalPlan,
    UniversalResult,
    _save_record,  # noqa: F401
    _steps_and_globals,
    _write_common,
    convert_params,
    verify_written,
)

_EXPERT_NAME = re.compile(r"\.deepspeed_experts\.\d+\.")  # deepspeed.moe's expert parameters


class ReplicasDisagree(CkptError):
    """TP-replicated parameters differ across TP ranks: averaging or picking one is a decision for the user."""


def _open_source(
    path: Path, patterns: Sequence[str], *, allow_unread: bool = False, trust_pickles: bool = False
) -> tuple[Checkpoint, Path, str]:
    """(checkpoint, tag folder, kind) for the inputs we convert, refused while it is not the whole checkpoint
    (`accounting.require_whole`). The format module says what it converts (its `universal_source` hook)."""
    mod = detect(path)
    if path.is_file():
        guard(mod.open(path), path, "to-universal", allow_unread=allow_unread, trust_pickles=trust_pickles)
    if not isinstance(mod, UniversalSourceModule):
        raise UnsupportedCheckpoint(
            f"to-universal does not convert {mod.FORMAT} checkpoints",
            path=path,
            hint=f"it converts DeepSpeed ZeRO, Megatron-DeepSpeed pipeline and "
            f"Accelerate+DeepSpeed checkpoints; for this one: ckpt convert {path} OUT "
            "--to deepspeed-universal (weights and optimizer state), or `ckpt export` "
            "(plain weights)",
        )
    src = mod.universal_source(path, tuple(patterns))
    ck = guard(src.ck, src.opened_at, "to-universal", allow_unread=allow_unread, trust_pickles=trust_pickles)
    return ck, src.tag_dir, src.kind


def handles(path: str | os.PathLike) -> bool:
    """Whether `path` is a checkpoint this module converts (DeepSpeed ZeRO, pipeline, Accelerate/HF Trainer with
    a DeepSpeed tag folder): `ckpt convert --to deepspeed-universal` hands those to `ckpt to-universal`."""
    try:
        _open_source(Path(path), (), allow_unread=True, trust_pickles=True)  # a probe: the plan checks
    except CkptError:
        return False
    return True


def _layout_for(info: Any, tp: int, tp_layout: str | None, patterns: Sequence[str], swiglu: bool) -> TPLayout | None:
    """The merge rules, in the order the issue asks: user patterns, the checkpoint's own info, the named
    preset. None at TP=1 (nothing to merge)."""
    if tp <= 1:
        return None
    if tp_layout not in (None, "megatron"):
        raise ValueError(f"--tp-layout {tp_layout!r}: the only preset is 'megatron'")
    base = None
    if isinstance(info, dict) and info:
        base = TPLayout.from_checkpoint_info(info)
    elif tp_layout == "megatron":
        base = TPLayout.megatron_preset(swiglu=swiglu)
    user = TPLayout.from_user_patterns(patterns) if patterns else None
    if user and base:
        return user.then(base)
    return user or base


def plan_to_universal(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    tp_layout: str | None = None,
    patterns: Sequence[str] = (),
    tp_replicated: str | None = None,
    target_stage: int | None = None,
    allow_unread: bool = False,
    trust_pickles: bool = False,
) -> UniversalPlan:
    """Decide every output file. Reads metadata, plus the bytes of TP-replicated parameters (to check that
    the TP ranks agree). Raises a CkptError naming the fix when the conversion would be a guess."""
    if tp_replicated not in (None, "average", "rank0"):
        raise ValueError(f"--tp-replicated {tp_replicated!r}: use average or rank0")
    if target_stage not in (None, 1, 2, 3):
        raise ValueError(f"--target-stage {target_stage!r}: use 1, 2 or 3")
    src = Path(source)
    ck, tag_dir, kind = _open_source(src, (), allow_unread=allow_unread, trust_pickles=trust_pickles)
    ranks = D.list_rank_files(tag_dir)
    tp, pp, dp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.dp or 1
    optim_file = _optimizer_file(ck, tag_dir, kind, ranks, tp)
    layout, layout_name = _merge_layout(ck, tag_dir, ranks, tp, tp_layout, patterns)
    notes: list[str] = left_behind(ck)
    # a pickle naming code the reader would not run: the dry run must say so before anything loads it
    notes += [f"warning {w.code}: {w.message} ({w.path})" for w in ck.warnings if w.code == "unknown-global"]
    jobs, state_keys = _param_jobs(ck, tag_dir, kind, layout, layout_name, tp)
    jobs = _check_replicas(jobs, tp_replicated, tag_dir, notes)
    stages, jobs = _loader_stages(ck, tag_dir, jobs, state_keys, target_stage, notes)
    warnings: list[str] = []
    if 3 in stages:
        groups = _param_groups_of(ck)
        adam = any("exp_avg" in j.states for j in jobs)
        warnings += [
            w if target_stage == 3 else f"if loaded at ZeRO-3: {w}"
            for w in zero3_group_warnings(groups, shared_step=adam)
        ]
    model_files, aliases = _model_files(ck, tag_dir, kind, ranks, stages)
    topo = {"dp": dp, "tp": tp, "pp": pp, "zero_stage": ck.topology.zero_stage}
    if kind == "pipeline" and tp > 1:
        notes.append(f"TP shards merged by {layout_name}; the loader splits them again for any TP size")
    return UniversalPlan(
        src,
        ck.format,
        tag_dir,
        tag_dir.name,
        Path(out),
        topo,
        tuple(jobs),
        model_files,
        tuple(aliases),
        optim_file,
        ck.details.get("ds_version"),
        layout_name,
        tuple(notes),
        {
            "tp_layout": tp_layout,
            "patterns": list(patterns),
            "tp_replicated": tp_replicated,
            "target_stage": target_stage,
        },
        state_keys,
        tuple(warnings),
        stages,
        trust_pickles=bool(ck.details.get("carried_pickles")),
    )


def _optimizer_file(ck: Checkpoint, tag_dir: Path, kind: str, ranks: dict, tp: int) -> Path:
    """The pp0/tp0/dp0 optimizer file (param groups, loss scaler, step), refused where there is none to convert
    from or the ZeRO checkpoint is tensor-parallel (AutoTP)."""
    if kind == "zero" and tp > 1:
        raise UnsupportedCheckpoint(
            f"a ZeRO checkpoint with mp_world_size={tp} (AutoTP) is not supported yet",
            path=tag_dir,
            hint="convert it with DeepSpeed's ds_to_universal",
        )
    first = ranks[min(ranks)]
    # without ZeRO (a deepspeed.moe run at stage 0): the whole torch optimizer of expert-parallel rank 0, its
    # fp32 weights the master
    expp0 = [f for f in ck.files if f.role == "optimizer" and f.rank.get("ep") == 0] if not first.optim else []
    if not first.optim and not (expp0 and ck.topology.zero_stage == 0):
        raise UnsupportedCheckpoint(
            "no optimizer files (*_optim_states.pt): nothing to convert",
            path=tag_dir,
            hint="a universal checkpoint is built from the ZeRO optimizer state",
        )
    return first.optim[min(first.optim)] if first.optim else Path(ck.path) / expp0[0].path


def _merge_layout(
    ck: Checkpoint, tag_dir: Path, ranks: dict, tp: int, tp_layout: str | None, patterns: Sequence[str]
) -> tuple[TPLayout | None, str]:
    """(the TP merge rules, their name for the plan): None at TP=1; refused at TP > 1 when no rule source is
    known (no universal_checkpoint_info, no --tp-layout, no --pattern)."""
    ms0 = ck.get("universal_checkpoint_info") if "universal_checkpoint_info" in ck.tree.children else None
    info = _raw_info(tag_dir, ranks) if ms0 is not None else None
    swiglu = False
    layout = _layout_for(info, tp, tp_layout, patterns, swiglu)
    if tp > 1 and layout is None:
        raise UnsupportedCheckpoint(
            f"tensor-parallel checkpoint (tp={tp}) without universal_checkpoint_info: which parameters are "
            "replicated and which are split (and on which dim) is not recorded",
            path=tag_dir,
            hint="pass --tp-layout megatron for Megatron-style names, or --pattern REGEX=MERGE for each kind; "
            "DeepSpeed's --inject_missing_state would concatenate every tensor on dim 0",
        )
    return layout, "tp=1 (nothing to merge)" if layout is None else " > ".join(layout.sources)


def _param_jobs(
    ck: Checkpoint, tag_dir: Path, kind: str, layout: TPLayout | None, layout_name: str, tp: int
) -> tuple[list[ParamJob], tuple[str, ...]]:
    """(one job per parameter with optimizer state, then (ZeRO) one per module tensor without, the per-parameter
    optimizer state keys besides fp32); refused when a parameter has no TP merge rule."""
    state = ck.optimizer.children.get("state", GroupNode()).children
    jobs: list[ParamJob] = []
    unknown: list[str] = []
    keys_seen: set[str] = set()
    for name, entry in state.items():
        job = _param_job(ck, tag_dir, name, entry, layout, tp, keys_seen)
        if job is None:
            unknown.append(name)
        else:
            jobs.append(job)
    if unknown:
        raise UnsupportedCheckpoint(
            f"no TP merge rule for {len(unknown)} parameters ({', '.join(unknown[:6])}"
            f"{', ...' if len(unknown) > 6 else ''}) under {layout_name}",
            path=tag_dir,
            hint="add --pattern REGEX=MERGE (replicated, average, cat:0, cat:1) for them, or --tp-layout megatron",
        )
    # module tensors without optimizer state: DeepSpeed writes {"param": weight.float()} as fp32.pt for them
    if kind == "zero":
        for name, node in ck.model.children.items():
            if name not in state and isinstance(node, TensorNode) and node.numel > 0:
                jobs.append(
                    ParamJob(
                        name,
                        node.shape,
                        -1,
                        {"fp32": node},
                        "whole",
                        None,
                        "module weight (no optimizer state)",
                        {},
                        module_only=True,
                    )
                )
    return jobs, tuple(sorted(keys_seen))


def _param_job(
    ck: Checkpoint, tag_dir: Path, name: str, entry: Any, layout: TPLayout | None, tp: int, keys_seen: set[str]
) -> ParamJob | None:
    """One parameter's job: its fp32 master and every per-parameter state, merged by the layout's rule (None: the
    layout has no rule for it). Adds its state keys to `keys_seen`."""
    kids = entry.children
    # every per-parameter state the format reader found (exp_avg/exp_avg_sq, momentum_buffer, sum, ...)
    nodes = {k: v for k, v in kids.items() if isinstance(v, TensorNode) and k != "step"}
    weight = ck.model.children.get(name) if ck.topology.zero_stage == 0 else None
    if "fp32" not in nodes and isinstance(weight, TensorNode) and weight.dtype == "float32":
        nodes["fp32"] = weight  # no ZeRO, fp32 training: the weights are the master
    if "fp32" not in nodes:
        raise UnsupportedCheckpoint(
            f"parameter {name} has no fp32 master weight in the optimizer files",
            path=tag_dir,
            hint="the optimizer files are incomplete; re-copy them",
        )
    nodes = {"fp32": nodes["fp32"], **{k: nodes[k] for k in sorted(nodes) if k != "fp32"}}
    keys_seen |= set(nodes) - {"fp32"}
    group = int(kids["param_group"].value) if isinstance(kids.get("param_group"), ValueNode) else 0
    fp32 = nodes["fp32"]
    has_step = "step" in kids
    if layout is None:
        return ParamJob(name, fp32.shape, group, nodes, "whole", None, "tp=1", {"cat_dim": 0}, has_step=has_step)
    shard_shape = fp32.shards[0].shape if fp32.shards else fp32.shape
    rule = layout.rule(name)
    if rule.merge is None:
        return None
    merge = rule.merge
    extra: dict[str, Any] = {}
    shape = list(shard_shape)
    if merge.startswith(("cat:", "cat_sub:")):
        d = rule.cat_dim
        shape[d] *= tp
        extra["cat_dim"] = d
        if merge.startswith("cat_sub:"):
            extra[PARAM_N_SUB_PARAMS] = rule.sub_params or 2
    if rule.vocab_size and merge.startswith("cat:") and shape[0] >= rule.vocab_size:
        shape[0] = rule.vocab_size
        extra[VOCAB_TENSOR] = True
    return ParamJob(name, tuple(shape), group, nodes, merge, rule, rule.describe(), extra, has_step=has_step)


def _loader_stages(
    ck: Checkpoint,
    tag_dir: Path,
    jobs: list[ParamJob],
    state_keys: tuple[str, ...],
    target_stage: int | None,
    notes: list[str],
) -> tuple[tuple[int, ...], list[ParamJob]]:
    """(the ZeRO stages whose universal loader can load the state (see the module docstring), the jobs with
    deepspeed.moe's experts marked); refused when --target-stage asks for a stage that cannot."""
    stages: tuple[int, ...] = (1, 2, 3)
    reason3 = stage3_incompatibility(state_keys)
    if reason3 is not None:
        if target_stage == 3:
            raise UnsupportedCheckpoint(
                f"the output cannot be loaded at ZeRO-3: {reason3}",
                path=tag_dir,
                hint="load it at ZeRO stage 1 or 2 (--target-stage 2): their universal loader takes every state file",
            )
        stages = (1, 2)
        notes.append(f"written for ZeRO-1/2 loaders only: {reason3}")
    elif target_stage is not None:
        stages = (3,) if target_stage == 3 else (1, 2)
    if not ck.details.get("num_experts"):  # a checkpoint that declares deepspeed.moe experts
        return stages, jobs
    if target_stage == 3:
        raise UnsupportedCheckpoint(
            "a deepspeed.moe checkpoint cannot be loaded at ZeRO-3: DeepSpeed's ZeRO-3 "
            "universal loader gives every param group group 0's settings, and its "
            "MoE groups would lose `moe`",
            path=tag_dir,
            hint="load it at ZeRO stage 1 or 2",
        )
    # DeepSpeed's universal loader finds each expert's folder by the loading rank's LOCAL expert id: at
    # ep_size > 1 every expert-parallel rank would load experts 0.. of its layer. Marked as expert
    # parameters (`is_expert_param`, `ep_num_experts`: DeepSpeed's own keys), the loader stops instead at
    # ep_size > 1 (it then asserts a stacked [num_experts, ...] tensor), and loads them as they are at 1
    n_exp = ck.details.get("num_experts")
    jobs = [
        replace(j, extra={**j.extra, "is_expert_param": True, "ep_num_experts": n_exp})
        if _EXPERT_NAME.search(j.name)
        else j
        for j in jobs
    ]
    notes += [
        f"every expert is written under its global id ({ck.details.get('experts', '')}): load it at "
        "expert-parallel size 1 (any DP size, ZeRO-1/2). DeepSpeed's universal loader finds each expert's "
        "folder by the loading rank's LOCAL expert id; the expert files are marked so that it stops with "
        "an assertion at ep_size > 1 rather than load every rank's experts from experts 0..",
        "the MoE param groups' `name` (ep_size_N, the saved expert-parallel size) is left out: the "
        "loading run keeps its own",
    ]
    return (1, 2), jobs


def _model_files(
    ck: Checkpoint, tag_dir: Path, kind: str, ranks: dict, stages: tuple[int, ...]
) -> tuple[tuple[Path, ...], list[tuple[str, str]]]:
    """(the model-states files copied into the tag folder, (name, copied file) for each second name a loader of
    the other ZeRO stages globs)."""
    model_files = tuple(sorted(rf.model_states for rf in ranks.values() if rf.model_states))
    if kind == "zero" and ck.topology.zero_stage == 3:
        model_files = tuple(sorted([*model_files, *(p for rf in ranks.values() for p in rf.z3_model.values())]))
    names = {p.name for p in model_files}
    aliases = []
    for rf in sorted(ranks.values(), key=lambda r: r.mp_rank):
        # ZeRO-1/2 loaders glob mp_rank_MM_model_states.pt, ZeRO-3 loaders zero_pp_rank_0_mp_rank_MM_...;
        # a source of either stage has only its own name: the other is the same file under a second name
        plain, z3 = (
            f"mp_rank_{rf.mp_rank:02d}_model_states.pt",
            f"zero_pp_rank_0_mp_rank_{rf.mp_rank:02d}_model_states.pt",
        )
        have = (
            rf.model_states.name if rf.model_states else (rf.z3_model[min(rf.z3_model)].name if rf.z3_model else None)
        )
        if have is None:
            raise UnsupportedCheckpoint(f"mp_rank {rf.mp_rank:02d} has no model-states file", path=tag_dir)
        if 3 in stages and z3 not in names:
            aliases.append((z3, have))
        if 1 in stages and plain not in names:
            aliases.append((plain, have))
    return model_files, aliases


# --- optimizer state beyond Adam's ---------------------------------------------------------------------


def stage3_incompatibility(state_keys: Sequence[str]) -> str | None:
    """Why DeepSpeed's ZeRO-3 universal loader cannot load this per-parameter optimizer state (None: it can).

    deepspeed 0.19.8 runtime/zero/stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3` loops over
    the hard-coded keys ["fp32", "exp_avg", "exp_avg_sq"] (torch.load of `<key>.pt`: FileNotFoundError when
    one is absent; other files in the folder are never opened) and reads
    optimizer_state["optimizer_state_dict"]["state"][0]["step"] (KeyError for an optimizer without a step)."""
    keys = set(state_keys)
    if keys == ADAM_STATE:
        return None
    missing, dropped = sorted(ADAM_STATE - keys), sorted(keys - ADAM_STATE)
    parts = []
    if dropped:
        parts.append(f"it would drop {', '.join(dropped)}")
    if missing:
        parts.append(f"it requires {', '.join(k + '.pt' for k in missing)}, which this optimizer does not keep")
    return (
        "DeepSpeed's ZeRO-3 universal loader reads only fp32/exp_avg/exp_avg_sq.pt (stage3.py "
        "load_hp_checkpoint_state_from_checkpoint_dir_stage3): " + " and ".join(parts)
    )


#: hyper-parameters every group gets from group 0 when DeepSpeed's ZeRO-3 universal loader runs
_HPARAM_SKIP = ("params", "param_names")


def zero3_group_warnings(param_groups: list[dict], *, shared_step: bool = False) -> list[str]:
    """What DeepSpeed's ZeRO-3 universal loader will change in these (saved) param groups.

    deepspeed 0.19.8 runtime/zero/stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3` ends with
        for param_group in self.optimizer.param_groups:
            for key, value in optim_sd["optimizer_state_dict"]["param_groups"][0].items(): ...param_group[key] = value
    i.e. every group gets group 0's lr, weight_decay and every other hyper-parameter. Returns one line per
    group whose lr or weight_decay differs from group 0's (naming the values DeepSpeed will use instead), plus
    one line for any other hyper-parameter that differs; [] when all groups agree.

    `shared_step` (the optimizer keeps a tensor `step`, as torch's Adam(W) does): the same function also
    assigns ONE step tensor (`optim_sd["optimizer_state_dict"]["state"][0]["step"]`) to every group's state,
    and torch's Adam increments it in place once per group, so each update advances the step by the number of
    groups and the bias correction runs ahead (seen in a real resume: 4 -> 6 -> 8 with two groups)."""
    if len(param_groups) < 2:
        return []
    g0 = param_groups[0]
    out: list[str] = []
    others: dict[str, list[int]] = {}
    for i, g in enumerate(param_groups[1:], start=1):
        changes = []
        for key in ("lr", "weight_decay"):
            if key in g and g.get(key) != g0.get(key):
                changes.append(f"{key} {_fmt(g0.get(key))} instead of {_fmt(g.get(key))}")
        if changes:
            out.append(
                f"DeepSpeed's ZeRO-3 universal loader copies param group 0's hyper-parameters onto every "
                f"group: group {i} will train with " + " and ".join(changes)
            )
        for key in g:
            if key not in _HPARAM_SKIP and key not in ("lr", "weight_decay") and g.get(key) != g0.get(key):
                others.setdefault(key, []).append(i)
    for key, idx in sorted(others.items()):
        out.append(
            f"DeepSpeed's ZeRO-3 universal loader also sets {key} of group{'s' if len(idx) > 1 else ''} "
            f"{', '.join(map(str, idx))} to group 0's {_fmt(g0.get(key))}"
        )
    if shared_step:
        n = len(param_groups)
        out.append(
            f"DeepSpeed's ZeRO-3 universal loader gives all {n} param groups one shared Adam step tensor: "
            f"each update advances the step by {n} instead of 1 (bias correction runs ahead)"
        )
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return repr(v) if not isinstance(v, (int, list, tuple)) else str(v)


def _plain_without_objects(node: Any) -> Any:
    """A subtree as plain Python, like `read.tree.node_to_python` except that an object of a class the reader does
    not run (an OpaqueNode) becomes None, not a dict of its recorded fields: so no object is taken for a param
    group."""
    if isinstance(node, ValueNode):
        return node.value
    if isinstance(node, GroupNode):
        return {k: _plain_without_objects(v) for k, v in node.children.items()}
    if isinstance(node, TensorNode):
        return node.value
    return None


def _param_groups_of(ck: Checkpoint) -> list[dict]:
    """The saved param groups as plain dicts (group order), from the tree."""
    node = ck.optimizer.children.get("param_groups") if ck.optimizer is not None else None
    raw = _plain_without_objects(node)
    if isinstance(raw, dict):
        raw = [raw[k] for k in sorted(raw, key=lambda k: int(k) if str(k).isdigit() else 0)]
    return [g for g in (raw or []) if isinstance(g, dict)]


def _raw_info(tag_dir: Path, ranks) -> Any:
    """The universal_checkpoint_info dict of mp_rank 00 as plain Python (our reader keeps it as nodes)."""
    ms = C.LoadCache(tag_dir).load(ranks[min(ranks)].model_states).obj
    return ms.get("universal_checkpoint_info") if isinstance(ms, dict) else None


# --- replicas ------------------------------------------------------------------------------------------


def replica_differences(node: TensorNode) -> float | None:
    """Max |shard_t - shard_0| over the TP shards of a replicated tensor; None when all are bit-identical.
    The comparison is `ops.tp_sync.compare_shards` (the one `ckpt sync-tp` reports with)."""
    if len(node.shards) < 2:
        return None
    diff = compare_shards([read_tensor(s) for s in node.shards], "fp32", 0.0, 0.0)
    return None if diff.bit_exact else diff.max_abs_diff


def _check_replicas(jobs: list[ParamJob], policy: str | None, where: Path, notes: list[str]) -> list[ParamJob]:
    bad: list[tuple[str, str, float]] = []
    for j in jobs:
        if j.merge != "replicated":
            continue
        for key, node in j.states.items():
            d = replica_differences(node)
            if d is not None:
                bad.append((j.name, key, d))
    if not bad:
        return jobs
    names = sorted({n for n, _, _ in bad})
    shown = ", ".join(f"{n}.{k} (max |diff| {d:.3g})" for n, k, d in bad[:6])
    if policy is None:
        raise ReplicasDisagree(
            f"{len(names)} TP-replicated parameters differ across TP ranks: {shown}{', ...' if len(bad) > 6 else ''}",
            path=where,
            hint="the replicas drifted apart during training; pass --tp-replicated average or "
            "--tp-replicated rank0 to choose (or repair them first with `ckpt sync-tp`)",
        )
    notes.append(
        f"{len(names)} drifted TP replicas resolved by --tp-replicated {policy}: {', '.join(names[:6])}"
        + (", ..." if len(names) > 6 else "")
    )
    if policy == "rank0":
        return jobs
    return [
        replace(j, merge="average", how=j.how + "; drifted: averaged (--tp-replicated average)")
        if j.name in names
        else j
        for j in jobs
    ]


def verify_logical(plan: UniversalPlan, root: Path, only: Callable[[str], bool] | None = None) -> list[str]:
    """The logical comparison (`ckpt diff --logical`) of the source with the universal checkpoint at `root`:
    every parameter's fp32 master, every optimizer state tensor and step, the param groups and the counters
    must be equal, bit for bit. Returns one line per difference ([] when equal). With `only`, one process's
    share of it (`logical_diff(only=...)`: the tensors of the parameters it accepts, all else whole)."""
    src, _, _ = _open_source(
        plan.source, plan.options.get("patterns") or (), allow_unread=True, trust_pickles=True
    )  # the plan checked the source
    rep = logical_diff(src, root, only=only)
    return [f"{section} {name}: {what}" for section, name, what in iter_lines(rep)]


def execute(
    plan: UniversalPlan,
    *,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
    distributed: bool = False,
    check: Callable[[Path], list[str]] | None = None,
    restart: bool = False,
    verify: bool = False,
) -> UniversalResult:
    """Write the planned universal checkpoint into `plan.out` (atomically), verify it, return a summary.

    `verify` (what `--verify` passes): before the folder is renamed into place, compare it with the source by
    logical parameter (`verify_logical`); a job splits the comparison between its ranks, each its share of the
    parameters. `check(staging_root)`, when given, runs after the structural verification on the whole folder
    (in a job, on rank 0). Any line either returns stops the conversion with nothing written.

    With `distributed`, every rank of the initialised torch.distributed group (a torchrun job) calls this:
    `_execute_job`. Output bytes do not depend on the number of ranks.
    """
    if distributed:
        import torch.distributed as dist  # lazy: torch only under torchrun (--distributed)

        if not dist.is_initialized():
            raise CkptError(
                "--distributed needs torch.distributed: run it under torchrun",
                hint="torchrun --nproc-per-node N --no-python ckpt to-universal CKPT OUT",
            )
        job = shares.Job(dist.get_rank(), dist.get_world_size())
    elif shares.job_staging(plan.out).exists():  # a job was interrupted: this process resumes it alone
        job = shares.LocalJob()
    else:
        job = None
    if job is not None:
        return _execute_job(plan, job, workers=workers, progress=progress, check=check, restart=restart, verify=verify)
    steps, optimizer_state = _steps_and_globals(plan)
    shares.remove_stale_staging(plan.out)  # left by killed runs: a rerun starts over
    with io.new_folder(plan.out, trust_pickles=plan.trust_pickles) as tmp:
        n = convert_params(
            plan, tmp / plan.out_tag, range(len(plan.params)), workers=workers, progress=progress, steps=steps
        )
        _write_common(plan, tmp, optimizer_state)
        _raise_written(verify_written(plan, tmp), plan)
        _run_check(check, plan, tmp)
        if verify:
            _run_check(lambda root: verify_logical(plan, root), plan, tmp)
    return UniversalResult(plan.out, plan.out_tag, len(plan.params), n, _count_files(plan.out))


def _plan_digest(plan: UniversalPlan) -> str:
    doc = [
        str(plan.source),
        plan.out_tag,
        repr(sorted(plan.options.items(), key=str)),
        [(p.name, list(p.shape), p.nbytes, p.merge, sorted(p.states)) for p in plan.params],
    ]
    return hashlib.sha256(json.dumps(doc, default=str).encode()).hexdigest()


def _execute_job(
    plan: UniversalPlan,
    job,
    *,
    workers: int,
    progress: Callable[[int], None] | None,
    check: Callable[[Path], list[str]] | None,
    restart: bool,
    verify: bool = False,
) -> UniversalResult:
    """A torchrun job (`shares.run_job`): every rank converts a share of the parameters balanced by bytes, each
    parameter folder verified and journaled; rank 0 writes the common files, verifies them (and runs `check`);
    with `verify` every rank compares a share of the parameters with the source (`verify_logical(only=...)`),
    rank 0 also what belongs to no parameter folder; rank 0 renames the folder into place. The same command
    resumes an interrupted job."""
    units = [shares.Unit(f"{plan.out_tag}/zero/{p.name}", p.nbytes, p.name) for p in plan.params]
    held = {name_key(p.name) for p in plan.params}

    def compare(staging: Path, share: list[int], first: bool) -> list[str]:
        """This rank's share of `--verify`: the tensors of its share's parameters, and everything that is not a
        tensor of a parameter (param groups, counters) in full; rank 0 also the tensors no parameter holds."""
        mine = {name_key(plan.params[i].name) for i in share}
        return verify_logical(plan, staging, only=lambda n: n in mine or (first and n not in held))

    fig, figs = shares.run_job(
        job,
        plan.out,
        units,
        digest=_plan_digest(plan),
        restart=restart,
        convert=lambda todo, journal, counted: _convert_share(plan, todo, journal, workers, counted),
        finish=lambda staging, _: _finish_job(plan, staging, check),
        verify=compare if verify else None,
        progress=progress,
        trust_pickles=plan.trust_pickles,
    )
    total = sum(f["bytes"] for f in figs)
    return UniversalResult(
        plan.out,
        plan.out_tag,
        len(plan.params),
        total if job.rank == 0 else fig["bytes"],
        _count_files(plan.out) if job.rank == 0 else 0,
        **shares.job_figures(figs),
    )


def _convert_share(plan: UniversalPlan, todo: list[int], journal, workers: int, progress: Callable[[int], None]) -> int:
    """The parameters at `todo`, each verified (`verify_written`) and journaled as soon as it is written."""
    staging = journal.root
    index = {plan.params[i].name: i for i in todo}
    parsed: dict = {}

    def done(j: ParamJob) -> None:
        rel = f"{plan.out_tag}/zero/{j.name}"
        problems = verify_written(plan, staging, [index[j.name]], common=False, parsed=parsed)
        if problems:
            raise CkptError(
                "verification of a written parameter failed: " + "; ".join(problems[:5]),
                path=staging / rel,
                hint="please report this",
            )
        journal.record(rel)

    steps, _ = _steps_and_globals(plan)
    return convert_params(
        plan, staging / plan.out_tag, todo, workers=workers, progress=progress, steps=steps, on_done=done
    )


def _finish_job(plan: UniversalPlan, staging: Path, check: Callable[[Path], list[str]] | None) -> None:
    """(rank 0) The common files, their verification and `check`, before `shares.run_job` puts them in place."""
    _, optimizer_state = _steps_and_globals(plan)
    _write_common(plan, staging, optimizer_state)
    _raise_written(verify_written(plan, staging, [], common=True), plan)
    _run_check(check, plan, staging)


def _raise_written(problems: list[str], plan: UniversalPlan) -> None:
    """`verify_written`'s problems (a file that does not read back as written) as the error that puts nothing in
    place."""
    if problems:
        raise CkptError(
            "verification of the written universal checkpoint failed: " + "; ".join(problems[:5]),
            path=plan.out,
            hint="nothing was written; please report this",
        )


def _run_check(check: Callable[[Path], list[str]] | None, plan: UniversalPlan, tmp: Path) -> None:
    if check is None:
        return
    problems = check(tmp)
    if problems:
        raise CkptError(
            f"--verify: the written universal checkpoint differs from the source in {len(problems)} "
            "places: " + "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else ""),
            path=plan.out,
            hint="nothing was written; please report this with `ckpt diff --logical` of the two",
        )


def _count_files(root: Path) -> int:
    return sum(len(f) for _, _, f in os.walk(root))
