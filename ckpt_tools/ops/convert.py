"""`ckpt convert CKPT OUT --to dcp|torch|deepspeed-universal|megatron`: move a run between frameworks with its whole
training state.

What moves (read through the logical view, `ckpt_tools.view.logical`, so every format the tree reads is a source):

    weights          every model tensor by state-dict name; the fp32 master where the source keeps one
                     (DeepSpeed ZeRO 1/2/3, the pipeline with its TP shards merged, universal)
    optimizer state  every per-parameter tensor under its own name (Adam(W): exp_avg, exp_avg_sq — torch's
                     names already; SGD momentum_buffer, Adagrad sum, ... as they are) and `step`, written as
                     torch keeps it (a 0-d float32 tensor per parameter)
    param groups     every hyper-parameter (lr, betas, eps, weight_decay, initial_lr, ...) and the members by
                     FQN (`params`), what `set_optimizer_state_dict` matches groups by
    scheduler        a torch scheduler's state dict as it is; DeepSpeed's own WarmupLR (linear) as the
                     equivalent torch LinearLR state (a note says so); other DeepSpeed schedulers are kept as
                     saved and reported
    counters         the global step (`step`; torchtitan: `train_state.step`)

and everything else the source holds (RNG states, a data-loader position, client state, the DeepSpeed
config, loss-scaler fields) is listed in the plan's `not_moved`: nothing is dropped silently.

Targets (`--to`, `--layout`):

    dcp / fsdp2       {model, optim (get_state_dict: `state.<fqn>.<key>`, `param_groups.<i>.*`), scheduler, step}
                      — what an FSDP2 loop passes to `dcp.load` then `set_state_dict`
    dcp / torchtitan  as torchtitan 0.3.0's CheckpointManager saves: the model's keys flat at the top level,
                      optimizer (flattened: `state.<fqn>.<key>`, `param_groups.<fqn>.<hp>`),
                      lr_scheduler {last_epoch} (all torchtitan keeps), train_state: {step}
    dcp / recipe      {app: {model, optim, scheduler, step}} (the DCP tutorial's AppState)
    torch             one torch.save file {model, optimizer (a torch state dict: ids, with `param_names`),
                      scheduler, step} — small runs and tests
    deepspeed-universal  from DCP (FSDP2 / torchtitan / recipe), FSDP1, HF Trainer, Lightning, torch files:
                      what DeepSpeed 0.19's `load_universal` reads (see `write_universal`), loadable at any DP
                      size; a DeepSpeed source is `ckpt to-universal`'s job (`to_universal.handles`)
    megatron          from a Megatron-LM legacy run (plain Adam): Megatron-LM's torch_dist run folder, as its own
                      save writes it (`ckpt_tools.write.megatron_write`); the scheduler, args and RNG states are carried
                      as saved, so nothing is listed as not moved but a pipeline's tied embedding copy;
                      with `ckpt_format="torch"` the other way, a torch_dist run as Megatron's legacy rank files at
                      the saved TP x PP or `tp` x `pp` (`megatron_write.write`); from a Megatron-DeepSpeed pipeline run
                      (GPTModelPipe, bf16 + ZeRO-1/2): torch_dist under Megatron-core names with built args, param
                      groups and schedule (`write.megatron_from_view`; verified against the source under those names)

A torchrun job (`execute(distributed=True)`, every target; `_execute_job` on `write/shares.run_job`, to-universal's
job): every rank writes a share of the output's units balanced by bytes into a staging folder of a fixed name, each
unit journaled as it is finished; rank 0 writes the rest; every rank compares a share of the output with the source
(`verify_logical(only=...)`); rank 0 renames. The units are such that the bytes do not depend on how many processes
wrote them: dcp a parameter's own files (`dcp_unit_files`; not one per rank, as DCP's own save writes), universal a
parameter's folder, torch a parameter's storages at the offsets torch.save gives them in the one file
(`torch_save_layout`, `torch_job_parts`), megatron legacy a rank folder, megatron torch_dist a parameter's items
(or a buffer chunk's) at the offsets one process writes them at (`dcp_write.PlannedDcpWriter`). The same command
resumes an interrupted job.

Order of use: `plan = plan_convert(src, out, to="dcp", layout="fsdp2")` (metadata only; every refusal raised
here) -> `plan.to_json()` for --dry-run -> `execute(plan, progress=...)`: streams one tensor at a time into a
staging folder beside OUT (`io.new_folder`), re-opens the result and compares it with the source by logical
parameter (`ops.diff.logical_diff`, bit for bit), and only then renames it into place.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError, UnsupportedCheckpoint
from ..read import qkv
from ..read.tree import saved_config
from ..view import logical as L
from ..view.accounting import guard, left_behind
from ..view.format_facts import already_in
from ..write import io, megatron_write, shares
from ..write.dcp_write import plan_digest as dcp_plan_digest
from ..write.megatron_moe import groups_at
from ..write.megatron_target import BuildsRun, ExpertParallelTarget, MegatronTarget, writer_for
from ..write.megatron_write import CKPT_FORMATS
from . import convert_megatron
from .diff import iter_lines, logical_diff
from .convert_plan import (
    _MEMBER_KEYS,
    DCP_LAYOUTS,
    DCP_SHARDS,
    MOVED_CHILDREN,
    TARGETS,
    ConvertPlan,
    ConvertResult,
    ParamItem,
    _jsonable,
)
from .convert_state import not_moved_lines, plain_scheduler, translate_scheduler
from .convert_writers import (
    TorchLayout,
    dcp_unit_files,
    finish_dcp,
    torch_job_parts,
    torch_save_layout,
    torch_training_dict,
    universal_tag,
    write_dcp,
    write_dcp_param,
    write_universal,
)
from .to_universal import handles as to_universal_handles


# --- the plan -------------------------------------------------------------------------------------------


def _refuse_out(src: Path, out: Path) -> None:
    s, o = src.resolve(), out.resolve()
    if o == s or s in o.parents:
        raise CkptError(
            f"OUT {out} is inside the checkpoint {src}",
            path=out,
            hint="write the converted checkpoint to a new path outside it",
        )
    if o.exists():
        raise CkptError("output already exists", path=out, hint="choose a new path or remove it first")


def plan_convert(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    to: str = "dcp",
    layout: str | None = None,
    allow_unread: bool = False,
    trust_pickles: bool = False,
    n_kv_heads: int | None = None,
    ckpt_format: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    hf_config: str | os.PathLike | None = None,
    seq_length: int | None = None,
    lr_scheduler: str | None = None,
    drop_norm_decay: bool = False,
    ep: int | None = None,
) -> ConvertPlan:
    """Decide everything `execute` writes; reads metadata and small values only. `n_kv_heads`: the model's KV
    heads, which orders a fused wqkv's optimizer state (`ckpt_tools.read.qkv`): read from a torchtitan source that
    saved one, and written fused for the torchtitan layout. `ckpt_format` (--to megatron): "torch_dist" (default,
    from a legacy run) or "torch" (Megatron's legacy rank files, from a torch_dist run) at TP `tp` x PP `pp`
    (default: the saved sizes). `hf_config` / `seq_length` (--to megatron from a torchtitan Llama): the model's
    Hugging Face config.json, which the checkpoint does not hold, and Megatron's seq_length (default: the config's
    max_position_embeddings); `lr_scheduler`: torchtitan's schedule settings (`warmup_steps=…,decay_ratio=…,
    decay_type=…,min_lr_factor=…,training_steps=…`), carried as Megatron's WSD schedule; `drop_norm_decay`: a
    torchtitan run that decays its norms converted with them in a group without weight decay (listed). `ep`
    (--to megatron --ckpt-format torch of a Mixture-of-Experts run): the expert-parallel size of the rank files
    (default: the saved one).

    In three steps: validate the options and the source (`_validate_options`, `_open_source`, `_refuse_source`),
    choose the route (`_choose_route`: the Megatron writer and its sizes), build the plan (`_build_plan`)."""
    layout, ckpt_format = _validate_options(to, layout, ckpt_format, ep, tp, pp)
    src, dst = Path(source), Path(out)
    _refuse_out(src, dst)
    view = (hf_config, seq_length, lr_scheduler, drop_norm_decay)
    ck = _open_source(src, to, allow_unread, trust_pickles, n_kv_heads, view)
    _refuse_source(ck, src, dst, to)
    route = _choose_route(ck, src, to, ckpt_format, tp, pp, ep)
    return _build_plan(ck, src, dst, to, layout, n_kv_heads, route, view)


def _validate_options(
    to: str, layout: str | None, ckpt_format: str | None, ep: int | None, tp: int | None, pp: int | None
) -> tuple[str | None, str | None]:
    """Refuse an option the target does not take (ValueError); returns (the DCP layout, Megatron's checkpoint
    format), defaulted."""
    if to not in TARGETS:
        raise ValueError(f"--to {to!r}: use one of {', '.join(TARGETS)}")
    if to == "dcp":
        layout = layout or "fsdp2"
        if layout not in DCP_LAYOUTS:
            raise ValueError(f"--layout {layout!r}: use one of {', '.join(DCP_LAYOUTS)}")
    elif layout is not None:
        raise ValueError(f"--layout applies to --to dcp, not --to {to}")
    if to != "megatron" and ckpt_format is not None:
        raise ValueError(f"--ckpt-format applies to --to megatron, not --to {to}")
    if to == "megatron":
        ckpt_format = ckpt_format or "torch_dist"
        if ckpt_format not in CKPT_FORMATS:
            raise ValueError(f"--ckpt-format {ckpt_format!r}: use one of {', '.join(CKPT_FORMATS)}")
    if ep is not None and to != "megatron":
        raise ValueError(f"--ep applies to --to megatron (a Megatron-LM Mixture-of-Experts run), not --to {to}")
    for flag, size in (("--tp", tp), ("--pp", pp)):
        if size is not None and ckpt_format != "torch":
            raise ValueError(
                f"{flag} applies to --to megatron --ckpt-format torch (legacy rank files are written per "
                "TP x PP rank; torch_dist and the other targets hold whole tensors, resharded at load)"
            )
    return layout, ckpt_format


def _open_source(src: Path, to: str, allow_unread: bool, trust_pickles: bool, n_kv_heads: int | None, view: tuple):
    """The source, guarded (`view.accounting.guard`), its fused wqkv split by `n_kv_heads`; for --to megatron as
    the conversion reads it (`view.torchtitan.source_view`: a torchtitan Llama under Megatron-core names, with
    `view` = (hf_config, seq_length, lr_scheduler, drop_norm_decay)), which no other target takes."""
    ck = L.with_kv_heads(
        guard(L.open_any(src), src, "convert", allow_unread=allow_unread, trust_pickles=trust_pickles), n_kv_heads
    )
    if to == "megatron":
        return convert_megatron.source_view(ck, *view, n_kv_heads=n_kv_heads)
    hf_config, seq_length, lr_scheduler, drop_norm_decay = view
    if hf_config is not None or seq_length is not None or lr_scheduler is not None or drop_norm_decay:
        raise ValueError(
            f"--hf-config / --seq-length / --lr-scheduler / --drop-norm-decay apply to --to megatron "
            f"(from torchtitan), not --to {to}"
        )
    return ck


#: a source already in the format the `--to` target writes: (message, hint)
_ALREADY = {
    "deepspeed-universal": ("the checkpoint is already a DeepSpeed universal checkpoint: nothing to convert", None),
    "dcp": (
        "the checkpoint is already a DCP checkpoint: nothing to convert",
        "DCP reshards at load; `--to torch` writes one training dict",
    ),
}


def _refuse_source(ck, src: Path, dst: Path, to: str) -> None:
    """Refuse a source another command converts (DeepSpeed to universal: `ckpt to-universal`), one its reader
    says no conversion is proven for, or one already in the target's format."""
    if to == "deepspeed-universal" and to_universal_handles(src):
        raise CkptError(
            "a DeepSpeed checkpoint: convert it with `ckpt to-universal`",
            path=src,
            hint=f"ckpt to-universal {src} {dst} (what `ckpt convert --to deepspeed-universal` runs)",
        )
    unproven = ck.details.get("convert_unproven")
    if unproven:  # a format reader's own word: its conversions have no resume proving them yet
        raise UnsupportedCheckpoint(f"convert cannot move this {ck.format} checkpoint yet: {unproven}", path=src)
    if already_in(ck, to):
        message, hint = _ALREADY[to]
        raise CkptError(message, path=src, hint=hint)


@dataclass(frozen=True)
class _Route:
    """How the plan is written: for --to megatron the writer (`write.megatron_target`), its checkpoint format and
    the TP / PP / EP sizes its check settled; else no writer."""

    writer: MegatronTarget | None = None
    ckpt_format: str | None = None
    tp: int | None = None
    pp: int | None = None
    ep: int | None = None

    @property
    def builds_run(self) -> bool:
        """The writer builds Megatron's args and scheduler for a source that has none (`BuildsRun`)."""
        return self.ckpt_format == "torch_dist" and isinstance(self.writer, BuildsRun)


def _choose_route(
    ck, src: Path, to: str, ckpt_format: str | None, tp: int | None, pp: int | None, ep: int | None
) -> _Route:
    """--to megatron: the writer for this source (`megatron_target.writer_for`) and the sizes its `check` gives,
    refusing what it cannot write; the other targets are written here."""
    if to != "megatron":
        return _Route(ckpt_format=ckpt_format, tp=tp, pp=pp, ep=ep)
    writer = writer_for(ck, tp_drift=convert_megatron.tp_drift)
    takes_ep = isinstance(writer, ExpertParallelTarget)
    if ep is not None and not takes_ep:
        raise ValueError("--ep applies to a Megatron-LM Mixture-of-Experts run")
    tp, pp = writer.check(ck, src, ckpt_format, tp, pp, **({"ep": ep} if ep is not None else {}))
    ep = writer.target_ep(ck, ep) if takes_ep else None
    return _Route(writer, ckpt_format, tp, pp, ep)


def _build_plan(ck, src: Path, dst: Path, to: str, layout: str | None, n_kv_heads: int | None, route: _Route, view):
    """The plan: every parameter with its state, the param groups, the scheduler and step, and the notes."""
    model, states, params, groups = _params_and_groups(ck, src, to, route.ep)
    notes: list[str] = left_behind(ck)
    if not states:
        notes.append("the source has no optimizer state: weights only")
    missing = [p.name for p in params if p.kind == "param" and p.name not in states]
    if states and missing:
        notes.append(
            f"{len(missing)} trainable parameters have no optimizer state in the source "
            f"({', '.join(missing[:3])}): written without"
        )
    config = saved_config(ck)
    sched, cls, snotes, sgone = _scheduler(ck, to, route, config, groups)
    notes += snotes
    added = _initial_lrs(groups, sched, cls, notes)
    step = ck.counters.global_step
    if step is None:
        notes.append("the source records no global step: `step` is not written")
    if route.writer is not None:
        kw = {"ep": route.ep} if route.ep is not None else {}
        extra_notes, not_moved = route.writer.plan_lines(ck, route.ckpt_format, route.tp, route.pp, **kw)
        notes += extra_notes
        if route.builds_run:
            added += list(route.writer.added())
    else:
        not_moved = sgone + not_moved_lines(ck, config)
    if ck.details.get("scheduler_rebuilt"):  # the producer rebuilds its schedule on resume (torchtune)
        not_moved.append(
            f"scheduler: {ck.details['scheduler_rebuilt']} (its shape is in the producer's config, not "
            "in the checkpoint): configure the same schedule in the target's launch config"
        )
    fused = _fused_targets(params, n_kv_heads, src) if layout == "torchtitan" else ()
    if layout == "torchtitan":
        _torchtitan_layout_notes(notes, not_moved, params, fused, n_kv_heads, sched, cls)
    _target_notes(notes, to, params, groups, model, states)
    hf_config, seq_length, lr_scheduler, drop_norm_decay = view
    return ConvertPlan(
        src,
        ck.format,
        dst,
        to,
        layout,
        tuple(params),
        tuple(groups),
        sched,
        cls,
        int(step) if step is not None else None,
        tuple(notes),
        tuple(not_moved),
        tuple(added),
        ck.topology.dp,
        n_kv_heads,
        fused,
        route.ckpt_format,
        route.tp,
        route.pp,
        str(ck.details["hf_config"]) if to == "megatron" and "hf_config" in ck.details else None,
        seq_length,
        lr_scheduler,
        drop_norm_decay,
        trust_pickles=bool(ck.details.get("carried_pickles")),
        ep=route.ep,
    )


def _params_and_groups(ck, src: Path, to: str, ep: int | None):
    """(the model's tensors, their optimizer states, a `ParamItem` per tensor, the param groups by member names;
    --to megatron at an EP size: Megatron's groups at that size)."""
    model = L.model_tensors(ck, weights="fp32")
    if not model:
        raise UnsupportedCheckpoint("no model tensors found: nothing to convert", path=src)
    states = L.optimizer_states(ck)
    scalars = L.optimizer_scalars(ck)
    raw_groups = L.param_groups(ck)
    names = {t.name for t in model}
    unknown = [p for p in states if p not in names]
    if unknown:
        raise UnsupportedCheckpoint(
            f"optimizer state for {len(unknown)} parameters the model does not name ({', '.join(unknown[:3])})",
            path=src,
            hint="the optimizer state is keyed by ids that could not be matched to names",
        )
    params: list[ParamItem] = []
    for t in model:
        st = {k: v for k, v in states.get(t.name, {}).items() if k not in ("fp32", "step")}
        step = None
        sc = scalars.get(t.name, {})
        if "step" in sc and sc["step"] is not None:
            step = float(sc["step"])
        elif "step" in states.get(t.name, {}):
            step = float(states[t.name]["step"].read().item())
        if t.kind == "tied":
            st, step = {}, None  # the state belongs to the source parameter
        params.append(ParamItem(t.name, tuple(t.shape), t.dtype, t.kind, t, st, step))
    groups = []
    for g in raw_groups:
        hp = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k not in _MEMBER_KEYS}
        if "betas" in hp and isinstance(hp["betas"], list):
            hp["betas"] = tuple(hp["betas"])
        members = [n for n in g.get("params", []) if n in names]
        groups.append({**hp, "params": members})
    if to == "megatron" and ep is not None:  # Megatron's groups at the written EP size (experts in or out)
        groups = groups_at(groups, ep, src)
    return model, states, params, groups


def _scheduler(ck, to: str, route: _Route, config: dict[str, Any], groups: list[dict[str, Any]]):
    """(the scheduler state written, its torch class, notes, not moved): built by the Megatron writer for a source
    without Megatron's (`BuildsRun`), Megatron's own carried as saved, else translated (`translate_scheduler`)."""
    if route.builds_run:  # a DeepSpeed schedule as Megatron's OptimizerParamScheduler (the writer's plan lines)
        return route.writer.built_scheduler(ck), "OptimizerParamScheduler", [], []
    if to == "megatron":  # Megatron's own scheduler state, carried as saved into common.pt
        return plain_scheduler(ck), "OptimizerParamScheduler", [], []
    return translate_scheduler(plain_scheduler(ck), config, groups)


def _initial_lrs(groups: list[dict[str, Any]], sched: dict | None, cls: str | None, notes: list[str]) -> list[str]:
    """Each group's initial_lr from a torch scheduler's base_lrs where the source's groups lack it (a torch
    scheduler attaches it; set_state_dict restores it); returns what was added, noted in `notes`."""
    added: list[str] = []
    if cls is not None and sched is not None and "base_lrs" in sched and groups:
        for i, (g, base) in enumerate(zip(groups, sched["base_lrs"])):
            if "initial_lr" not in g:
                g["initial_lr"] = float(base)  # torch schedulers attach it; set_state_dict restores it
                added.append(f"param_groups {i}.initial_lr")
        if added:
            notes.append(f"param groups: initial_lr (= the scheduler's base_lrs) added, as a torch {cls} attaches it")
    return added


def _torchtitan_layout_notes(
    notes: list[str], not_moved: list[str], params, fused, n_kv_heads: int | None, sched, cls: str | None
) -> None:
    """--layout torchtitan: what torchtitan's CheckpointManager saves that the source lacks, how wq/wk/wv are
    written, and the scheduler torchtitan rebuilds from its job config."""
    notes.append(
        "torchtitan layout (as torchtitan 0.3.0's CheckpointManager saves): the model's keys flat at the "
        "top level; train_state {step, ntokens_seen: 0} (the source does not count tokens; torchtitan "
        "uses it for its tokens-seen metric only) and no `dataloader` entry (the source has no "
        "torchtitan loader state): resume with --checkpoint.exclude-from-loading dataloader"
    )
    if fused:
        notes.append(
            f"{len(fused)} wq/wk/wv triple(s) given torchtitan's fused layout (--n-kv-heads "
            f"{n_kv_heads}): model keys split as torchtitan saves them, the optimizer state and param "
            f"groups under {fused[0][0]}, … with rows grouped per KV head (FusedQKVLinear)"
        )
    elif any(qkv.fused_name(p.name) for p in params):
        notes.append(
            "wq/wk/wv optimizer state written unfused, for a torchtitan model built with "
            "fuse_qkv=False; torchtitan 0.3.0's llama3 fuses them by default (fuse_qkv=True) and then "
            "loads their Adam state under …wqkv.weight: pass --n-kv-heads N to write that"
        )
    if sched is not None:
        not_moved.append(
            f"scheduler{' ' + cls if cls else ''}: torchtitan saves and restores only "
            f"lr_scheduler.last_epoch (= {sched.get('last_epoch')}, written) and rebuilds the "
            "schedule from its job config: set the source's schedule there (lr_scheduler warmup / "
            "decay, the param groups' lr)"
        )


def _target_notes(notes: list[str], to: str, params, groups, model, states) -> None:
    """What the target does with what is written: --to torch's memory, DeepSpeed universal's groups and frozen
    parameters, the weights written (the fp32 master or as stored; --to megatron's plan lines say it)."""
    if to == "torch":
        notes.append(
            "--to torch writes one torch.save file: in one process the whole training state is held in memory "
            "while it is written (small runs, tests; as a torchrun job, --nproc M, each process holds one tensor at "
            "a time); --to dcp streams one tensor at a time"
        )
    if to == "deepspeed-universal" and len(groups) > 1:
        notes.append(
            "loaded at ZeRO-3, DeepSpeed's universal loader copies param group 0's hyper-parameters "
            "(lr, weight_decay, ...) onto every group and shares one step: load it at ZeRO-1/2 to keep "
            f"the {len(groups)} groups as they are"
        )
    if to == "deepspeed-universal" and any(p.kind == "frozen" for p in params):
        notes.append(
            "frozen parameters are written in the model states' `module` only: DeepSpeed's universal "
            "loader restores trained parameters from zero/, so a frozen one keeps its initial value"
        )
    dtypes = sorted({p.dtype for p in params if p.kind == "param"})
    if to == "megatron":  # both: the module's weights as saved and the fp32 master (its plan lines say so)
        pass
    elif any(t.kind == "param" for t in model) and states and "fp32" in next(iter(states.values())):
        notes.append("weights: the fp32 master weights (the module's low-precision copy is derived from them)")
    elif dtypes:
        notes.append(f"weights: as stored ({', '.join(dtypes)})")


def _fused_targets(
    params: list[ParamItem], n_kv_heads: int | None, src: Path
) -> tuple[tuple[str, tuple[str, str, str]], ...]:
    """The wq/wk/wv triples written as one fused wqkv (torchtitan's layout) when `n_kv_heads` is given."""
    if n_kv_heads is None:
        return ()
    by = {p.name: p for p in params}
    out = []
    for p in params:
        name = qkv.fused_name(p.name)
        if name is None:
            continue
        q, k, v = qkv.split_names(name)
        if k not in by or v not in by or any(by[n].kind != "param" for n in (q, k, v)):
            continue
        qkv.rows_or_refuse(by[q].shape[0], by[k].shape[0], n_kv_heads, src)
        out.append((name, (q, k, v)))
    return tuple(out)


# --- writing --------------------------------------------------------------------------------------------


def plan_digest(plan: ConvertPlan) -> str:
    """What identifies a plan's output (a job's staging folder is resumed only by the same plan)."""
    return dcp_plan_digest(plan)


def verify_logical(plan: ConvertPlan, root: Path, only: Callable[[str], bool] | None = None) -> list[str]:
    """`ckpt diff SRC OUT` (logical): one line per difference between the source and the written checkpoint. With
    `only`, one process's share of it (`logical_diff(only=...)`: the tensors of the parameters it accepts, all
    else whole) and without `_not_carried`, which the caller runs once."""
    # a Megatron-DeepSpeed source is read under the Megatron-core names the writer gave it (`diff._megatron_names`);
    # a torchtitan source whose norms' weight decay the plan drops (listed in not_moved) as the view with that change
    source: Any = plan.source
    if plan.drop_norm_decay:
        source = convert_megatron.source_view(
            L.open_any(plan.source), plan.hf_config, plan.seq_length, plan.lr_scheduler, True
        )
    rep = logical_diff(L.with_kv_heads(source, plan.n_kv_heads), L.with_kv_heads(root, plan.n_kv_heads), only=only)
    lines = [f"{section} {name}: {what}" for section, name, what in iter_lines(rep)]
    lines = [x for x in lines if not any(x.startswith(f"{a}: added") for a in plan.added)]
    if plan.ep is not None:  # a MoE run at another EP: Megatron regroups the experts, compared with the plan's groups
        lines = [x for x in lines if not x.startswith("param_groups ")] + _regrouped(plan, root)
    return lines + (_not_carried(plan, root) if only is None else [])


def _regrouped(plan: ConvertPlan, root: Path) -> list[str]:
    """The output's param groups against the plan's (Megatron's groups at the written EP size, `groups_at`): the
    same number, each with the same hyper-parameters and exactly the same parameters; a parameter's group changes
    only where the source's group of it had the same hyper-parameters (at EP 1 the experts join the dense groups)."""
    out = L.param_groups(L.open_any(root))
    lines = []
    if len(out) != len(plan.groups):
        lines.append(f"param_groups : {len(plan.groups)} groups planned -> {len(out)} groups written")
    for i, (want, got) in enumerate(zip(plan.groups, out)):
        for k in sorted(set(want) | set(got)):
            if k == "params":
                a, b = ({L.name_key(n) for n in g.get("params", [])} for g in (want, got))
                if a != b:
                    lines.append(f"param_groups {i}.params: {len(a)} planned -> {len(b)} written ({sorted(a ^ b)[:3]})")
            elif _jsonable(want.get(k)) != _jsonable(got.get(k)):
                lines.append(f"param_groups {i}.{k}: {want.get(k)!r} planned -> {got.get(k)!r} written")
    return lines


def _not_carried(plan: ConvertPlan, root: Path) -> list[str]:
    """What the logical diff only notes, since it also compares a checkpoint with its export (no optimizer): an
    output without the per-parameter optimizer state, with fewer param groups, or without any step where the plan
    carries them is a failed conversion (a lost group's parameters resume without their LR and weight decay; a
    lost step restarts Adam's bias correction)."""
    out = L.open_any(root)
    problems = []
    states = L.optimizer_states(out)
    if any(p.states for p in plan.params) and not states:
        problems.append("optimizer: the output holds no per-parameter optimizer state; the source's was planned")
    groups = L.param_groups(out)
    if len(groups) < len(plan.groups):
        problems.append(f"param_groups: {len(plan.groups)} groups planned -> {len(groups)} groups written")
    stepped = any("step" in v for v in L.optimizer_scalars(out).values()) or any("step" in v for v in states.values())
    if any(p.step is not None for p in plan.params) and not stepped:
        problems.append("optimizer step: the source's parameters hold Adam's step, no parameter of the output does")
    return problems


def execute(
    plan: ConvertPlan,
    *,
    progress: Callable[[int], None] | None = None,
    verify: bool = True,
    distributed: bool = False,
    restart: bool = False,
) -> ConvertResult:
    """Write the planned checkpoint under a staging name beside OUT, compare it with the source by logical
    parameter (unless `verify=False`), rename it into place. Any difference: nothing is written.

    With `distributed` (dcp and deepspeed-universal targets), every rank of the initialised torch.distributed
    group (a torchrun job) calls this: `_execute_job`, the same bytes as one process. A job's staging folder left
    by an interrupted job is resumed by the same command, in one process too (`restart`: thrown away)."""
    if distributed:
        import torch.distributed as dist  # lazy: torch only in a torchrun job; planning stays torch-free

        if not dist.is_initialized():
            raise CkptError(
                "--distributed needs torch.distributed: run it under torchrun",
                hint="torchrun --nproc-per-node N --no-python ckpt convert CKPT OUT --to dcp",
            )
        refuse_job(plan.to)
        return _execute_job(plan, shares.Job(dist.get_rank(), dist.get_world_size()), progress, verify, restart)
    _refuse_out(plan.source, plan.out)
    if runs_as_job(plan.to) and shares.job_staging(plan.out).exists():  # an interrupted job: resumed alone
        return _execute_job(plan, shares.LocalJob(), progress, verify, restart)
    if plan.to in ("dcp", "deepspeed-universal", "megatron"):
        write = {"dcp": write_dcp, "deepspeed-universal": write_universal}.get(plan.to) or writer_for(plan).write
        with io.new_folder(plan.out, trust_pickles=plan.trust_pickles) as tmp:
            n = write(plan, tmp, progress)
            problems = verify_logical(plan, tmp) if verify else []
            _raise_problems(problems, plan)
        return ConvertResult(plan.out, len(plan.params), n, verify)
    if plan.to == "torch":
        import torch  # lazy: torch only when --to torch is written; planning stays torch-free

        out = plan.out.resolve()
        out.parent.mkdir(parents=True, exist_ok=True)
        shares.remove_stale_staging(out)  # left by a killed run
        tmp = out.parent / f".ckpt-staging-{out.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            f = tmp / out.name
            torch.save(torch_training_dict(plan), f)
            if progress:
                progress(plan.nbytes)
            problems = verify_logical(plan, f) if verify else []
            _raise_problems(problems, plan)
            os.link(f, out)  # refuses if something appeared at OUT meanwhile
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return ConvertResult(out, len(plan.params), out.stat().st_size, verify)
    raise UnsupportedCheckpoint(f"--to {plan.to} is not implemented", path=plan.source)


#: the targets a torchrun job writes in shares (`_execute_job`): dcp and deepspeed-universal a folder (or files) per
#: parameter, torch one file of which each rank writes its parameters' storages, megatron the legacy rank folders or
#: (torch_dist) each parameter's items at the offsets one process gives them (`dcp_write.PlannedDcpWriter`)
JOB_TARGETS = TARGETS


def runs_as_job(to: str) -> bool:
    """Whether `--to to` is written in shares by a torchrun job."""
    return to in JOB_TARGETS


def refuse_job(to: str) -> None:
    """A target that one process writes, asked of a torchrun job: refused before any work, saying what to run."""
    if to in TARGETS and not runs_as_job(to):  # an unknown target is the plan's to refuse
        raise CkptError(
            f"--to {to} is written by one process, not shared between the ranks of a torchrun job",
            hint=f"run `ckpt convert SRC OUT --to {to}` without torchrun",
        )


def _execute_job(
    plan: ConvertPlan, job, progress: Callable[[int], None] | None, verify: bool, restart: bool
) -> ConvertResult:
    """A torchrun job (`shares.run_job`), or one process resuming one: every rank writes a share of the units
    balanced by bytes, each journaled (DCP: a parameter's own `__<r>_<i+1>.distcp` files and its `.metadata` part;
    universal: a parameter's `zero/<param>/` folder; torch: a parameter's storages, spans of the one file
    (`torch_job_parts`); megatron legacy: a rank folder `iter_N/mp_rank_TT[_PPP]`); rank 0 then writes the common
    files (DCP: the values and `.metadata`; universal: the model states and optimizer_state.pt; torch: the file's
    records, headers and central directory; megatron: the iteration file); every rank compares a share of the
    parameters of the whole output with the source by logical parameter (unless `verify=False`; `_job_check`),
    and rank 0 puts it in place. The bytes do not depend on the number of ranks."""
    _refuse_out(plan.source, plan.out)
    parts = _job_parts(plan)
    fig, figs = shares.run_job(
        job,
        plan.out,
        parts.units,
        digest=plan_digest(plan),
        restart=restart,
        convert=parts.convert,
        finish=parts.finish,
        verify=_job_check(plan, job, parts) if verify else None,
        progress=progress,
        trust_pickles=plan.trust_pickles,
        place=parts.place,
        targets=parts.targets,
    )
    total = sum(f["bytes"] for f in figs)
    return ConvertResult(
        plan.out,
        len(plan.params),
        total if job.rank == 0 else fig["bytes"],
        verify,
        **shares.job_figures(figs),
    )


@dataclass
class _JobParts:
    """What `shares.run_job` runs for a target: the units, `convert(todo, journal, counted)` (a rank's share),
    `finish(staging, journal)` (rank 0's rest); `params`: the parameters the units hold (those rank 0 writes are
    the others); `place` / `targets` / `verified`: the output when it is a file (--to torch), else None."""

    units: list
    convert: Callable
    finish: Callable
    params: list[int]
    place: Callable | None = None
    targets: list[Path] | None = None
    verified: str | None = None


def _job_parts(plan: ConvertPlan) -> _JobParts:
    """The units and their writers of `plan`'s target (`_execute_job`); refuses a target one process writes."""
    params = list(range(len(plan.params)))
    if plan.to == "dcp":
        return _dcp_job_parts(plan, params)
    if plan.to == "deepspeed-universal":
        return _universal_job_parts(plan)
    if plan.to == "torch":
        units, convert, finish, verified = torch_job_parts(plan)
        targets = [plan.out.resolve()]
        place = lambda staging: io.put_files_in_place(staging, targets, trust_pickles=plan.trust_pickles)  # noqa: E731
        return _JobParts(units, convert, finish, params, place, targets, verified)
    if plan.to == "megatron" and plan.ckpt_format == "torch":
        return _legacy_job_parts(plan, params)
    if plan.to == "megatron":
        return _dist_job_parts(plan, params)
    refuse_job(plan.to)


def _dcp_job_parts(plan: ConvertPlan, params: list[int]) -> _JobParts:
    """DCP: a unit per parameter, its own `.distcp` files and its `.metadata` part; rank 0 the values and
    `.metadata`."""
    units = [shares.Unit(f"param{i}", plan.params[i].nbytes, plan.params[i].name) for i in params]

    def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
        n = 0
        for k in todo:
            wrote, files, part = write_dcp_param(plan, journal.root, params[k], counted)
            journal.record(units[k].rel, paths=files, extra=part)
            n += wrote
        return n

    def finish(staging: Path, journal) -> None:
        finish_dcp(plan, staging, [journal.extra[u.rel] for u in units])

    return _JobParts(units, convert, finish, params)


def _universal_job_parts(plan: ConvertPlan) -> _JobParts:
    """DeepSpeed universal: a unit per trained parameter, its `zero/<param>/` folder; rank 0 the others' weights,
    the model states and optimizer_state.pt."""
    params = [i for i, p in enumerate(plan.params) if p.kind == "param" and p.states]
    units = [
        shares.Unit(f"{universal_tag(plan)}/zero/{plan.params[i].name}", plan.params[i].nbytes, plan.params[i].name)
        for i in params
    ]

    def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
        n = 0
        for k in todo:
            n += write_universal(plan, journal.root, counted, indices=[params[k]], common=False)
            journal.record(units[k].rel)
        return n

    def finish(staging: Path, journal) -> None:
        write_universal(plan, staging, None, indices=[], common=True)

    return _JobParts(units, convert, finish, params)


def _legacy_job_parts(plan: ConvertPlan, params: list[int]) -> _JobParts:
    """Megatron's legacy rank files: a unit per rank folder; rank 0 the iteration file."""
    dirs = megatron_write.legacy_rank_dirs(plan)
    units = [shares.Unit(rel, nbytes) for rel, nbytes in dirs]

    def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
        n = 0
        for k in todo:
            n += megatron_write._write_legacy(plan, journal.root, counted, only=[k], common=False)
            journal.record(units[k].rel)
        return n

    def finish(staging: Path, journal) -> None:
        megatron_write._write_legacy(plan, staging, None, only=[], common=True)

    return _JobParts(units, convert, finish, params)


def _dist_job_parts(plan: ConvertPlan, params: list[int]) -> _JobParts:
    """Megatron torch_dist: each parameter's items (or a buffer chunk's) at the offsets one process writes them
    at (the writer's `plan_dist`); rank 0 the rest of the items and the run folder's other files."""
    planned, tail = writer_for(plan).plan_dist(plan, shares.job_staging(plan.out))
    sizes = planned.units()
    labels = list(sizes)
    at = {f"param{i}": i for i in params}
    units = [shares.Unit(u, sizes[u], plan.params[at[u]].name if u in at else "") for u in labels]
    rel = planned.folder.name  # iter_NNNNNNN

    def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
        def done(unit: str, spans: list[tuple[str, int, int]]) -> None:
            journal.record(unit, spans=[(f"{rel}/{f}", o, n) for f, o, n in spans])
            counted(plan.params[at[unit]].nbytes if unit in at else 0)

        return planned.write_units([labels[k] for k in todo], done)

    def finish(staging: Path, journal) -> None:
        planned.write_rest()
        tail(staging)

    return _JobParts(units, convert, finish, params)


def _job_check(plan: ConvertPlan, job, parts: _JobParts) -> Callable:
    """This rank's share of the logical comparison, `check(staging, share, first)`: the tensors of its share's
    parameters (units of parameters; else a share of the parameters balanced by bytes); rank 0 also those of the
    parameters no unit holds, and what `_not_carried` checks."""
    by_params = plan.to == "megatron"  # its units are no parameters: each rank verifies a share of the parameters
    params, verified = parts.params, parts.verified
    held = {L.name_key(plan.params[i].name) for i in params}

    def check(staging: Path, share: list[int], first: bool) -> list[str]:
        if by_params:  # units of rank folders or of items in Megatron's order: a share of the parameters
            share = shares.balanced_shares([p.nbytes for p in plan.params], job.world)[job.rank]
        indices = share if by_params else [params[k] for k in share]
        mine = {L.name_key(plan.params[i].name) for i in indices}
        root = staging / verified if verified else staging
        lines = verify_logical(plan, root, only=lambda n: n in mine or (first and n not in held))
        lines += _not_carried(plan, root) if first else []
        if by_params:
            return lines, [plan.params[i].name for i in indices], sum(plan.params[i].nbytes for i in indices)
        return lines

    return check


def _raise_problems(problems: list[str], plan: ConvertPlan) -> None:
    if problems:
        raise CkptError(
            f"verification: the converted checkpoint differs from the source in {len(problems)} "
            "places: " + "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else ""),
            path=plan.out,
            hint="nothing was written; please report this with `ckpt diff` of the two",
        )


__all__ = [
    "DCP_LAYOUTS",
    "DCP_SHARDS",
    "JOB_TARGETS",
    "MOVED_CHILDREN",
    "TARGETS",
    "ConvertPlan",
    "ConvertResult",
    "ParamItem",
    "TorchLayout",
    "dcp_unit_files",
    "execute",
    "plan_convert",
    "plan_digest",
    "refuse_job",
    "runs_as_job",
    "torch_save_layout",
    "torch_training_dict",
    "translate_scheduler",
    "universal_tag",
    "verify_logical",
]
