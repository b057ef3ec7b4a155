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
                      what DeepSpeed 0.19's `load_universal` reads (see `_write_universal`), loadable at any DP
                      size; a DeepSpeed source is `ckpt to-universal`'s job (`to_universal.handles`)
    megatron          from a Megatron-LM legacy run (plain Adam): Megatron-LM's torch_dist run folder, as its own
                      save writes it (`ckpt_tools.write.megatron_write`); the scheduler, args and RNG states are carried
                      as saved, so nothing is listed as not moved but a pipeline's tied embedding copy;
                      with `ckpt_format="torch"` the other way, a torch_dist run as Megatron's legacy rank files at
                      the saved TP x PP or `tp` x `pp` (`megatron_write.write`); from a Megatron-DeepSpeed pipeline run
                      (GPTModelPipe, bf16 + ZeRO-1/2): torch_dist under Megatron-core names with built args, param
                      groups and schedule (`ckpt_tools.ops.megatron_in`; verified against the source under those names)

A torchrun job (`execute(distributed=True)`, every target; `_execute_job` on `write/shares.run_job`, to-universal's
job): every rank writes a share of the output's units balanced by bytes into a staging folder of a fixed name, each
unit journaled as it is finished; rank 0 writes the rest; every rank compares a share of the output with the source
(`verify_logical(only=...)`); rank 0 renames. The units are such that the bytes do not depend on how many processes
wrote them: dcp a parameter's own files (`dcp_unit_files`; not one per rank, as DCP's own save writes), universal a
parameter's folder, torch a parameter's storages at the offsets torch.save gives them in the one file
(`torch_save_layout`, `_torch_job_parts`), megatron legacy a rank folder, megatron torch_dist a parameter's items
(or a buffer chunk's) at the offsets one process writes them at (`dcp_write.PlannedDcpWriter`). The same command
resumes an interrupted job.

Order of use: `plan = plan_convert(src, out, to="dcp", layout="fsdp2")` (metadata only; every refusal raised
here) -> `plan.to_json()` for --dry-run -> `execute(plan, progress=...)`: streams one tensor at a time into a
staging folder beside OUT (`io.new_folder`), re-opens the result and compares it with the source by logical
parameter (`ops.diff.logical_diff`, bit for bit), and only then renames it into place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..read import qkv
from ..errors import CkptError, UnsupportedCheckpoint

TARGETS = ("dcp", "torch", "deepspeed-universal", "megatron")
DCP_LAYOUTS = ("fsdp2", "torchtitan", "recipe")
#: tensors are written in this many dim-0 chunks (parameter i's chunk r in `__<r>_<i+1>.distcp`), as FSDP2 at DP=2
#: saves them; DCP reshards at load, so the output loads at any world size
DCP_SHARDS = 2
#: tree children the conversion moves (or reads to move); any other top-level child is reported as not moved
MOVED_CHILDREN = ("model", "optimizer", "scheduler", "counters")
#: param-group keys that are not hyper-parameters
_MEMBER_KEYS = ("params", "param_names")


@dataclass(frozen=True)
class ParamItem:
    """One model tensor and, for a trained parameter, its optimizer state."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "param" | "frozen" | "tied" | "buffer"
    weight: Any = field(repr=False, compare=False)  # LogicalTensor
    states: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # key -> LogicalTensor
    step: float | None = None  # the optimizer's step for this parameter (None: the optimizer keeps none)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        size = {"float64": 8, "float32": 4, "int64": 8, "int32": 4}.get(self.dtype, 2)
        return n * size + sum(t.numel * 4 for t in self.states.values())


@dataclass(frozen=True)
class ConvertPlan:
    source: Path
    source_format: str
    out: Path
    to: str
    layout: str | None
    params: tuple[ParamItem, ...]
    groups: tuple[dict[str, Any], ...]  # hyper-parameters + "params": member names
    scheduler: dict[str, Any] | None  # the state dict written
    scheduler_class: str | None  # the torch class it belongs to (None: unknown / none)
    step: int | None
    notes: tuple[str, ...] = ()
    not_moved: tuple[str, ...] = ()
    #: what the target needs that the source did not record (`param_groups 0.initial_lr`): the logical diff
    #: reports these as added, and verification expects exactly that
    added: tuple[str, ...] = ()
    dp: int | None = None  # the source's data-parallel size (recorded in a universal checkpoint's model states)
    #: the model's KV heads (`--n-kv-heads`): splits a fused wqkv state read from the source; with the torchtitan
    #: layout, `fused` lists the (wqkv name, (wq, wk, wv names)) whose optimizer state is written fused
    n_kv_heads: int | None = None
    fused: tuple[tuple[str, tuple[str, str, str]], ...] = ()
    #: --to megatron: Megatron's checkpoint format written ("torch_dist" or "torch", the legacy rank files) and,
    #: for "torch", the tensor- and pipeline-parallel sizes of the rank files
    ckpt_format: str | None = None
    tp: int | None = None
    pp: int | None = None
    #: --to megatron from torchtitan: the model's Hugging Face config.json (`--hf-config`; the checkpoint holds no
    #: model config) and the sequence length the run trains with (`--seq-length`)
    hf_config: str | None = None
    seq_length: int | None = None
    #: --to megatron from torchtitan: its LR schedule's settings (`--lr-scheduler`; not in the checkpoint)
    lr_scheduler: str | None = None
    #: --to megatron from torchtitan: its decaying norms moved into a group without weight decay (`--drop-norm-decay`)
    drop_norm_decay: bool = False
    #: `--trust-pickles` let the source's globals outside the allowlist through: the output may carry them
    trust_pickles: bool = False
    #: --to megatron --ckpt-format torch of a Mixture-of-Experts run: the expert-parallel size of the rank files
    #: (`--ep`; None for a dense run); `groups` are then Megatron's param groups at that size (`megatron_moe`)
    ep: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def to_json(self) -> dict[str, Any]:
        state_keys = sorted({k for p in self.params for k in p.states})
        return {
            "source": str(self.source),
            "format": self.source_format,
            "out": str(self.out),
            "to": self.to,
            "layout": self.layout,
            "bytes": self.nbytes,
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "kind": p.kind,
                    "states": sorted(p.states) + (["step"] if p.step is not None else []),
                    "bytes": p.nbytes,
                }
                for p in self.params
            ],
            "optimizer_state": state_keys + (["step"] if any(p.step is not None for p in self.params) else []),
            "param_groups": [
                {k: _jsonable(v) for k, v in g.items() if k != "params"} | {"params": len(g["params"])}
                for g in self.groups
            ],
            "scheduler": self.scheduler_class,
            "scheduler_state": _jsonable(self.scheduler),
            "step": self.step,
            "notes": list(self.notes),
            "not_moved": list(self.not_moved),
            "n_kv_heads": self.n_kv_heads,
            "fused": {name: list(parts) for name, parts in self.fused},
            "ckpt_format": self.ckpt_format,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "hf_config": self.hf_config,
            "seq_length": self.seq_length,
            "lr_scheduler": self.lr_scheduler,
            "drop_norm_decay": self.drop_norm_decay,
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return repr(v)


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


def _plain_scheduler(ck) -> dict[str, Any] | None:
    from ..read.tree import node_to_python

    node = ck.tree.children.get("scheduler")
    if node is None:
        return None
    val = node_to_python(node)
    return val if isinstance(val, dict) and val else None


def _config(ck) -> dict[str, Any]:
    from ..read.tree import saved_config

    return saved_config(ck)


def translate_scheduler(
    state: dict[str, Any] | None, config: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, str | None, list[str], list[str]]:
    """(torch state dict, torch class name, notes, not moved) for the source's scheduler state."""
    from ..read.state import is_scheduler_state
    from ..train.replica import infer_torch_scheduler

    if state is None:
        return None, None, ["the source has no LR scheduler: the LR stays at the param groups' lr"], []
    if "last_batch_iteration" not in state:
        megatron = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps")
        if all(k in state for k in megatron):
            # Megatron-LM's OptimizerParamScheduler: a closed form over SAMPLES with a clamp at min_lr; no torch
            # scheduler computes it (LinearLR + CosineAnnealingLR step per call, recursively, and never clamp)
            return (
                None,
                None,
                [],
                [
                    f"scheduler: Megatron's OptimizerParamScheduler ({state['lr_decay_style']}, LR "
                    f"{state['max_lr']:g} -> "
                    f"{state['min_lr']:g}, warm-up {state['lr_warmup_steps']} and decay "
                    f"{state['lr_decay_steps']} samples, "
                    f"at num_steps {state['num_steps']}): no torch scheduler computes the same schedule; the param "
                    "groups' current lr is carried, so set the target's schedule to continue from there"
                ],
            )
        if not is_scheduler_state(state):
            return None, None, [], [f"scheduler state with keys {sorted(state)}: not a scheduler state dict"]
        cls = infer_torch_scheduler(state)
        return dict(state), cls, [f"scheduler: the torch {cls or 'scheduler'} state dict, as saved"], []
    # DeepSpeed's own scheduler: only the position is saved; its parameters are in the DeepSpeed config
    sched = config.get("scheduler") if isinstance(config.get("scheduler"), dict) else {}
    kind, params = sched.get("type"), dict(sched.get("params") or {})
    it = int(state["last_batch_iteration"])
    n = len(groups)
    if kind == "WarmupLR" and params.get("warmup_type", "log") == "linear":
        lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
        lo = lo if isinstance(lo, list) else [lo] * n
        hi = hi if isinstance(hi, list) else [hi] * n
        total = int(params.get("warmup_num_steps", 1000))
        if len(set(zip(lo, hi))) != 1 or not hi[0]:
            return (
                dict(state),
                None,
                [],
                [
                    f"DeepSpeed {kind} with per-group limits {lo}->{hi}: no single torch "
                    "LinearLR equivalent; its state is kept as saved ({'last_batch_iteration': ...})"
                ],
            )
        start = lo[0] / hi[0]
        lrs = [float(lo[0] + (hi[0] - lo[0]) * min(1.0, max(it, 0) / total))] * n
        out = {
            "start_factor": start,
            "end_factor": 1.0,
            "total_iters": total,
            "base_lrs": [float(h) for h in hi],
            "last_epoch": it,
            "_step_count": it + 1,
            "_is_initial": False,
            "_get_lr_called_within_step": False,
            "_last_lr": lrs,
        }
        note = (
            f"scheduler: DeepSpeed WarmupLR (linear, {lo[0]:g} -> {hi[0]:g} over {total} steps, "
            f"last_batch_iteration {it}) translated to torch LinearLR(start_factor={start:g}, end_factor=1.0, "
            f"total_iters={total}) with last_epoch {it}: the same LR at every step"
        )
        if start <= 0:
            note += (
                "; LinearLR's constructor refuses start_factor 0, so build it with any start_factor and "
                "load_state_dict (the saved start_factor 0 is what it then uses)"
            )
        return out, "LinearLR", [note], []
    return (
        dict(state),
        None,
        [],
        [
            f"DeepSpeed scheduler {kind or '(unknown type)'} {params}: torch has no "
            "equivalent class; its state is kept as saved ({'last_batch_iteration': "
            f"{it}}}) and the target loop must rebuild it"
        ],
    )


#: tree children that hold a launch configuration (not training state): reported in one line
_CONFIG_CHILDREN = ("config", "training_args", "args", "hparams", "hyper_parameters")
_DATA_WORDS = ("tokens", "seen", "consumed", "dataloader", "data_loader", "data_sampler", "batches_yielded", "samples")


def _names(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _not_moved(ck, config: dict[str, Any]) -> list[str]:
    """What the source holds that the conversion does not carry, one line each."""
    from ..read.state import COUNTER_KEYS
    from ..read.tree import node_to_python

    out: list[str] = []
    for name, node in ck.tree.children.items():
        if name in MOVED_CHILDREN or name.startswith(("model_", "optimizer_")):
            continue
        if name == "universal_checkpoint_info":
            out.append(
                f"{name}: DeepSpeed's TP merge metadata; used to merge the TP shards (the output holds whole tensors)"
            )
            continue
        if name in _CONFIG_CHILDREN:
            out.append(
                f"{name}: the source framework's launch configuration (for DeepSpeed, ds_config); the "
                "target's own training config replaces it"
            )
            continue
        val = node_to_python(node)
        keys = []
        for k, v in val.items() if isinstance(val, dict) else ():
            if isinstance(v, dict) and v and k not in ("args", "dataloader") and len(v) <= 16:
                keys += [f"{k}.{kk}" for kk in v if kk not in COUNTER_KEYS]  # train_state.ntokens_seen
            elif k not in COUNTER_KEYS:  # the step moves as the target's counter
                keys.append(k)
        keys.sort()
        if not keys:
            continue
        rng = [k for k in keys if "rng" in k.lower() or "random" in k.lower()]
        data = [k for k in keys if k not in rng and any(w in k.rsplit(".", 1)[-1].lower() for w in _DATA_WORDS)]
        rest = [k for k in keys if k not in rng and k not in data]
        detail = []
        if rng:
            detail.append(f"RNG states ({_names(rng)}): the target seeds its own")
        if data:
            detail.append(f"data position ({_names(data)}): the target's data loader must be positioned by hand")
        if rest:
            detail.append(f"other fields ({_names(rest)})")
        out.append(f"{name}: " + "; ".join(detail))
    c = ck.counters
    if getattr(c, "skipped_steps", None):
        out.append(f"skipped_steps={c.skipped_steps} (DeepSpeed's overflow count): no equivalent in the target")
    if isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled"):
        out.append("fp16 loss scaler state: the target framework keeps its own (torch GradScaler)")
    return out


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
    (default: the saved one)."""
    from ..view import logical as L

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
        from ..write.megatron_write import CKPT_FORMATS

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
    src, dst = Path(source), Path(out)
    _refuse_out(src, dst)
    from ..view.accounting import guard

    ck = L.with_kv_heads(
        guard(L.open_any(src), src, "convert", allow_unread=allow_unread, trust_pickles=trust_pickles), n_kv_heads
    )
    if to == "megatron":  # a torchtitan Llama is read under Megatron-core names (`megatron_in.source_view`)
        from . import megatron_in

        if n_kv_heads is not None and megatron_in.is_torchtitan(ck):
            raise ValueError("--n-kv-heads: --to megatron reads the KV heads from --hf-config's num_key_value_heads")
        ck = megatron_in.source_view(ck, hf_config, seq_length, lr_scheduler, drop_norm_decay)
    elif hf_config is not None or seq_length is not None or lr_scheduler is not None or drop_norm_decay:
        raise ValueError(
            f"--hf-config / --seq-length / --lr-scheduler / --drop-norm-decay apply to --to megatron "
            f"(from torchtitan), not --to {to}"
        )
    if to == "deepspeed-universal":
        from .to_universal import handles

        if handles(src):
            raise CkptError(
                "a DeepSpeed checkpoint: convert it with `ckpt to-universal`",
                path=src,
                hint=f"ckpt to-universal {src} {dst} (what `ckpt convert --to deepspeed-universal` runs)",
            )
    unproven = ck.details.get("convert_unproven")
    if unproven:  # a format reader's own word: its conversions have no resume proving them yet
        raise UnsupportedCheckpoint(f"convert cannot move this {ck.format} checkpoint yet: {unproven}", path=src)
    if to == "deepspeed-universal":
        if ck.format == "deepspeed_universal":
            raise CkptError("the checkpoint is already a DeepSpeed universal checkpoint: nothing to convert", path=src)
    if to == "megatron":  # Megatron-LM and Megatron-DeepSpeed pipeline sources (Megatron's args, names, schedule)
        writer = _megatron_writer(ck)
        if ep is not None and not hasattr(writer, "target_ep"):
            raise ValueError("--ep applies to a Megatron-LM Mixture-of-Experts run")
        tp, pp = writer.check(ck, src, ckpt_format, tp, pp, **({"ep": ep} if ep is not None else {}))
        ep = writer.target_ep(ck, ep) if hasattr(writer, "target_ep") else None
    if to == "dcp" and ck.format == "dcp":
        raise CkptError(
            "the checkpoint is already a DCP checkpoint: nothing to convert",
            path=src,
            hint="DCP reshards at load; `--to torch` writes one training dict",
        )

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
        from ..write.megatron_moe import groups_at

        groups = groups_at(groups, ep, src)
    from ..view.accounting import left_behind

    notes: list[str] = left_behind(ck)
    if not states:
        notes.append("the source has no optimizer state: weights only")
    missing = [p.name for p in params if p.kind == "param" and p.name not in states]
    if states and missing:
        notes.append(
            f"{len(missing)} trainable parameters have no optimizer state in the source "
            f"({', '.join(missing[:3])}): written without"
        )
    config = _config(ck)
    from . import megatron_in

    into_megatron = to == "megatron" and ckpt_format == "torch_dist" and megatron_in.handles(ck)
    if into_megatron:  # a DeepSpeed schedule as Megatron's OptimizerParamScheduler (`megatron_in`'s plan lines)
        margs = megatron_in.megatron_args(ck)
        sched, cls, snotes, sgone = megatron_in.scheduler_state(ck, margs), "OptimizerParamScheduler", [], []
    elif to == "megatron":  # Megatron's own scheduler state, carried as saved into common.pt
        sched, cls, snotes, sgone = _plain_scheduler(ck), "OptimizerParamScheduler", [], []
    else:
        sched, cls, snotes, sgone = translate_scheduler(_plain_scheduler(ck), config, groups)
    notes += snotes
    added: list[str] = []
    if cls is not None and sched is not None and "base_lrs" in sched and groups:
        for i, (g, base) in enumerate(zip(groups, sched["base_lrs"])):
            if "initial_lr" not in g:
                g["initial_lr"] = float(base)  # torch schedulers attach it; set_state_dict restores it
                added.append(f"param_groups {i}.initial_lr")
        if added:
            notes.append(f"param groups: initial_lr (= the scheduler's base_lrs) added, as a torch {cls} attaches it")
    step = ck.counters.global_step
    if step is None:
        notes.append("the source records no global step: `step` is not written")
    if to == "megatron":
        extra_notes, not_moved = writer.plan_lines(ck, ckpt_format, tp, pp, **({"ep": ep} if ep is not None else {}))
        notes += extra_notes
        if into_megatron:
            added += list(megatron_in.added())
    else:
        not_moved = sgone + _not_moved(ck, config)
    if ck.details.get("scheduler_rebuilt"):  # the producer rebuilds its schedule on resume (torchtune)
        not_moved.append(
            f"scheduler: {ck.details['scheduler_rebuilt']} (its shape is in the producer's config, not "
            "in the checkpoint): configure the same schedule in the target's launch config"
        )
    fused = _fused_targets(params, n_kv_heads, src) if layout == "torchtitan" else ()
    if layout == "torchtitan":
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
        ckpt_format,
        tp,
        pp,
        str(ck.details["hf_config"]) if to == "megatron" and "hf_config" in ck.details else None,
        seq_length,
        lr_scheduler,
        drop_norm_decay,
        trust_pickles=bool(ck.details.get("carried_pickles")),
        ep=ep,
    )


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


def _step_tensor(value: float):
    import torch

    return torch.tensor(float(value), dtype=torch.float32)


def _dcp_values(plan: ConvertPlan) -> tuple[tuple, dict[str, Any], dict[str, Any]]:
    """(prefix of everything, the optim dict's small values, the rest of the top level) for the layout."""
    groups = []
    for g in plan.groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])})
    rest: dict[str, Any] = {}
    if plan.layout == "torchtitan":
        optim: dict[str, Any] = {}
        into = {q: name for name, (q, _, _) in plan.fused}  # a fused wqkv: one entry, under its own name
        gone = {n for _, (_, k, v) in plan.fused for n in (k, v)}
        for g in groups:
            for n in (into.get(n, n) for n in g["params"] if n not in gone):
                for k, v in g.items():
                    if k != "params":
                        optim[f"param_groups.{n}.{k}"] = v
        if plan.scheduler is not None and "last_epoch" in plan.scheduler:
            # torchtitan's LRSchedulersContainer saves and restores only the position
            rest["lr_scheduler"] = {"last_epoch": plan.scheduler["last_epoch"]}
        if plan.step is not None:
            rest["train_state"] = {"step": plan.step, "ntokens_seen": 0}
        return (), optim, rest
    optim = {"param_groups": groups}
    if plan.scheduler is not None:
        rest["scheduler"] = plan.scheduler
    if plan.step is not None:
        rest["step"] = plan.step
    return (("app",) if plan.layout == "recipe" else ()), optim, rest


def dcp_unit_files(i: int) -> list[str]:
    """The `.distcp` files that parameter `i` of the plan may write (`DcpStreamWriter(unit=i + 1)`); unit 0,
    `__0_0.distcp`, holds the values (param groups, scheduler, step)."""
    return [f"__{r}_{i + 1}.distcp" for r in range(DCP_SHARDS)]


def _write_dcp_param(
    plan: ConvertPlan, folder: Path, i: int, progress: Callable[[int], None] | None
) -> tuple[int, list[str], dict]:
    """Parameter `i`'s DCP items (its weight, then its optimizer state) into its own files (`dcp_unit_files`).
    Returns (bytes written, the files written, its `.metadata` part as JSON: `dcp_write.part_to_json`). The files
    depend on this parameter alone, so any number of processes writing any split of the parameters writes the
    same bytes."""
    from ..write.dcp_write import DcpStreamWriter, part_to_json

    w = DcpStreamWriter(folder, checkpoint_id=str(plan.out), shards=DCP_SHARDS, unit=i + 1)
    prefix, _, _ = _dcp_values(plan)
    titan = plan.layout == "torchtitan"
    opt_key = "optimizer" if titan else "optim"
    p = plan.params[i]
    fused = {q: (name, (q, k, v)) for name, (q, k, v) in plan.fused}
    members = {n for _, parts in plan.fused for n in parts}
    by = {x.name: x for x in plan.params} if plan.fused else {}
    try:
        # torchtitan saves the model's keys flat at the top level, beside optimizer / lr_scheduler / train_state
        w.tensor(prefix + ((p.name,) if titan else ("model", p.name)), p.weight.read())
        if progress:
            progress(p.nbytes - sum(t.numel * 4 for t in p.states.values()))
        if p.name in fused:  # the fused wqkv's state, from its three split parameters (`qkv.fuse`)
            name, parts = fused[p.name]
            for k in p.states:
                w.tensor(
                    prefix + (opt_key, f"state.{name}.{k}"),
                    qkv.fuse(*(by[n].states[k].read() for n in parts), plan.n_kv_heads),
                )
                if progress:
                    progress(p.states[k].numel * 4)
            if p.step is not None:
                w.tensor(prefix + (opt_key, f"state.{name}.step"), _step_tensor(p.step))
        elif p.name not in members:
            for k, t in p.states.items():
                path = (opt_key, f"state.{p.name}.{k}") if titan else (opt_key, "state", p.name, k)
                w.tensor(prefix + path, t.read())
                if progress:
                    progress(t.numel * 4)
            if p.step is not None and (p.states or p.kind == "param"):
                path = (opt_key, f"state.{p.name}.step") if titan else (opt_key, "state", p.name, "step")
                w.tensor(prefix + path, _step_tensor(p.step))
        elif progress:
            progress(sum(t.numel * 4 for t in p.states.values()))
    except BaseException:
        w.abort()
        raise
    part = w.finish()
    return w.bytes_written, w.files(), part_to_json(part)


def _finish_dcp(plan: ConvertPlan, folder: Path, parts: list[dict]) -> int:
    """The values (`__0_0.distcp`) and `.metadata` from every parameter's part (JSON, in the plan's order), its
    save_id derived from the plan: the same bytes whatever wrote the parameters. Returns the values' bytes."""
    from ..write.dcp_write import DcpStreamWriter, flatten_paths, part_from_json, plan_save_id, write_metadata

    w = DcpStreamWriter(folder, checkpoint_id=str(plan.out), shards=1, unit=0)
    prefix, optim_values, rest = _dcp_values(plan)
    opt_key = "optimizer" if plan.layout == "torchtitan" else "optim"
    try:
        for path, v in flatten_paths(optim_values, prefix + (opt_key,)):
            w.value(path, v)
        for path, v in flatten_paths(rest, prefix):
            w.value(path, v)
    except BaseException:
        w.abort()
        raise
    values = w.finish()
    write_metadata(folder, [part_from_json(d) for d in parts] + [values], str(plan.out), plan_save_id(plan))
    return w.bytes_written


def _write_dcp(plan: ConvertPlan, folder: Path, progress: Callable[[int], None] | None) -> int:
    """The whole DCP folder in one process: every parameter's files, then the values and `.metadata`, by the
    same functions as the ranks of a job (`_execute_job`), so the bytes are the same."""
    import json

    total, parts = 0, []
    for i in range(len(plan.params)):
        n, _, part = _write_dcp_param(plan, folder, i, progress)
        total += n
        parts.append(json.loads(json.dumps(part)))  # as a job reads it back from its journal: the same pickle
    return total + _finish_dcp(plan, folder, parts)


def plan_digest(plan: ConvertPlan) -> str:
    """What identifies a plan's output (a job's staging folder is resumed only by the same plan)."""
    from ..write.dcp_write import plan_digest as digest

    return digest(plan)


def torch_training_dict(plan: ConvertPlan) -> dict[str, Any]:
    """The {model, optimizer, scheduler, step} dict `--to torch` saves (every tensor read: small runs), each
    tensor contiguous with a storage of its own (`torch_zip.own_storage`), so that `torch_save_layout` can plan
    its file."""
    from ..write.torch_zip import own_storage

    return _torch_dict(plan, lambda i, read, dtype, shape: own_storage(read()))


def _torch_dict(plan: ConvertPlan, leaf: Callable[[int, Callable[[], Any], str, tuple[int, ...]], Any]) -> dict:
    """`torch_training_dict`'s structure with `leaf(i, read, dtype, shape)` at each tensor: parameter `i`'s tensor
    that `read()` gives, of that dtype and shape. Called in the order torch.save's pickler meets the tensors."""
    model = {p.name: leaf(i, p.weight.read, p.weight.dtype, tuple(p.shape)) for i, p in enumerate(plan.params)}
    index: dict[str, int] = {}
    groups = []
    for g in plan.groups:
        ids = []
        for n in g["params"]:
            index.setdefault(n, len(index))
            ids.append(index[n])
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": ids, "param_names": list(g["params"])}
        )
    state: dict[int, dict[str, Any]] = {}
    at = {p.name: i for i, p in enumerate(plan.params)}
    for n, i in index.items():
        p = plan.params[at[n]]
        entry: dict[str, Any] = {}
        if p.step is not None:
            entry["step"] = leaf(at[n], lambda p=p: _step_tensor(p.step), "float32", ())
        for k, t in p.states.items():
            entry[k] = leaf(at[n], t.read, t.dtype, tuple(t.shape))
        if entry:
            state[i] = entry
    out: dict[str, Any] = {"model": model, "optimizer": {"state": state, "param_groups": groups}}
    if plan.scheduler is not None:
        out["scheduler"] = plan.scheduler
    if plan.step is not None:
        out["step"] = plan.step
    return out


@dataclass(frozen=True)
class TorchLayout:
    """Where the `--to torch` file's storages lie (`torch_zip.SaveLayout`) and what fills each: (parameter index,
    read, dtype) per storage key, in key order."""

    save: Any  # torch_zip.SaveLayout
    leaves: tuple[tuple[int, Callable[[], Any], str], ...]


def torch_save_layout(plan: ConvertPlan) -> TorchLayout:
    """The layout of `torch.save(torch_training_dict(plan), OUT)`, planned without reading a tensor: the same dict
    with every tensor `torch.empty` (address space, no page touched) through torch's own pickler
    (`torch_zip.plan_save`). Every process of a job plans the same."""
    import torch

    from ..view.logical import torch_dtype
    from ..write.torch_zip import plan_save

    leaves: list[tuple[int, Callable[[], Any], str]] = []

    def leaf(i: int, read: Callable[[], Any], dtype: str, shape: tuple[int, ...]):
        leaves.append((i, read, dtype))
        return torch.empty(shape, dtype=torch_dtype(dtype))

    save = plan_save(_torch_dict(plan, leaf), plan.out.resolve())
    if len(save.sizes) != len(leaves):  # a tensor outside the model and optimizer state (in the scheduler?)
        raise UnsupportedCheckpoint(
            f"--to torch as a job: the training dict holds {len(save.sizes)} tensors, {len(leaves)} planned",
            path=plan.source,
            hint=f"run `ckpt convert {plan.source} {plan.out} --to torch` in one process",
        )
    return TorchLayout(save, tuple(leaves))


def _torch_job_parts(plan: ConvertPlan):
    """`--to torch` in a job: (units, convert, finish, the file verified) for `shares.run_job`. A unit is one
    parameter: the storages of its weight and optimizer state, written by the rank that has it at the offsets
    torch.save gives them in the staging file (`torch_save_layout`; holes until every share is in) and journaled
    as spans with their CRC-32s; rank 0 then writes the records, headers and central directory around them
    (`torch_zip.write_frame`): the bytes of the one-process `torch.save`."""
    import torch

    from ..view.logical import torch_dtype
    from ..write import shares
    from ..write.torch_zip import own_storage, start_writeback, write_frame

    layout = torch_save_layout(plan)
    save, name = layout.save, plan.out.name
    keys: list[list[int]] = [[] for _ in plan.params]
    for key, (i, _, _) in enumerate(layout.leaves):
        keys[i].append(key)
    units = [shares.Unit(f"param{i}", sum(save.sizes[k] for k in keys[i]), p.name) for i, p in enumerate(plan.params)]

    def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
        n = 0
        fd = os.open(journal.root / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < save.size:  # only grows: the other ranks' bytes stay
                os.ftruncate(fd, save.size)
            for i in todo:
                spans = []
                for k in keys[i]:
                    _, read, dtype = layout.leaves[k]
                    t = own_storage(read())
                    if t.dtype != torch_dtype(dtype) or t.numel() * t.element_size() != save.sizes[k]:
                        raise CkptError(
                            f"{plan.params[i].name}: read as {t.dtype} {tuple(t.shape)}, planned as {dtype} of "
                            f"{save.sizes[k]} bytes",
                            path=plan.source,
                        )
                    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    done = 0
                    while done < view.nbytes:
                        done += os.pwrite(fd, view[done:], save.offsets[k] + done)
                    spans.append((name, save.offsets[k], save.sizes[k]))
                    n += save.sizes[k]
                start_writeback(fd)
                journal.record(units[i].rel, spans=spans)
                counted(plan.params[i].nbytes)
            os.fsync(fd)
            journal.fsynced += 1
        finally:
            os.close(fd)
        return n

    def finish(staging: Path, journal) -> None:
        crcs = [0] * len(save.sizes)
        for i, unit in enumerate(units):
            for k, (_, _, _, crc) in zip(keys[i], journal.spans(unit.rel)):
                crcs[k] = crc
        fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, write_frame(fd, save, crcs))
        finally:
            os.close(fd)

    return units, convert, finish, name


@dataclass(frozen=True)
class ConvertResult:
    out: Path
    params: int
    bytes_written: int
    verified: bool
    problems: tuple[str, ...] = ()
    #: a many-process job (`_execute_job`): pieces converted by this run and found finished in the journal, and
    #: each rank's figures ({rank, host, params, resumed, bytes, seconds})
    converted: int = -1
    resumed: int = 0
    ranks: tuple[dict, ...] = ()


def _megatron_writer(source):
    """The module that writes a Megatron-LM run from this source (a Checkpoint, or a ConvertPlan) (`check`,
    `plan_lines`, `write`): the way in from a Megatron-DeepSpeed pipeline or a torchtitan Llama (`megatron_in`),
    a Mixture-of-Experts run at another EP size (`write.megatron_moe`), else between Megatron-LM's two formats
    (`write.megatron_write`)."""
    from ..write import megatron_moe, megatron_write
    from . import megatron_in

    if isinstance(source, ConvertPlan):
        way_in = source.source_format in megatron_in.SOURCE_FORMATS or source.hf_config is not None
        moe = source.ep is not None
    else:
        way_in = megatron_in.handles(source)
        moe = not way_in and megatron_moe.is_moe(source)
    return megatron_in if way_in else megatron_moe if moe else megatron_write


def verify_logical(plan: ConvertPlan, root: Path, only: Callable[[str], bool] | None = None) -> list[str]:
    """`ckpt diff SRC OUT` (logical): one line per difference between the source and the written checkpoint. With
    `only`, one process's share of it (`logical_diff(only=...)`: the tensors of the parameters it accepts, all
    else whole) and without `_not_carried`, which the caller runs once."""
    from .diff import iter_lines, logical_diff

    from ..view import logical as L

    # a Megatron-DeepSpeed source is read under the Megatron-core names the writer gave it (`diff._megatron_names`);
    # a torchtitan source whose norms' weight decay the plan drops (listed in not_moved) as the view with that change
    source: Any = plan.source
    if plan.drop_norm_decay:
        from . import megatron_in

        source = megatron_in.source_view(
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
    from ..view import logical as L

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
    from ..view import logical as L

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
    from ..write import io, shares

    if distributed:
        import torch.distributed as dist

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
        write = {"dcp": _write_dcp, "deepspeed-universal": _write_universal}.get(plan.to) or _megatron_writer(
            plan
        ).write
        with io.new_folder(plan.out, trust_pickles=plan.trust_pickles) as tmp:
            n = write(plan, tmp, progress)
            problems = verify_logical(plan, tmp) if verify else []
            _raise_problems(problems, plan)
        return ConvertResult(plan.out, len(plan.params), n, verify)
    if plan.to == "torch":
        import shutil

        import torch

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
    (`_torch_job_parts`); megatron legacy: a rank folder `iter_N/mp_rank_TT[_PPP]`); rank 0 then writes the common
    files (DCP: the values and `.metadata`; universal: the model states and optimizer_state.pt; torch: the file's
    records, headers and central directory; megatron: the iteration file); every rank compares a share of the
    parameters of the whole output with the source by logical parameter (unless `verify=False`; `check` below),
    and rank 0 puts it in place. The bytes do not depend on the number of ranks."""
    from ..view.logical import name_key
    from ..write import io, shares

    _refuse_out(plan.source, plan.out)
    place, targets, verified = None, None, None  # the output: the folder OUT (a file OUT for --to torch)
    by_params = plan.to == "megatron"  # its units are no parameters: each rank verifies a share of the parameters
    params = list(range(len(plan.params)))  # the parameters the units hold (those rank 0 writes are the others)
    if plan.to == "dcp":
        units = [shares.Unit(f"param{i}", plan.params[i].nbytes, plan.params[i].name) for i in params]

        def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
            n = 0
            for k in todo:
                wrote, files, part = _write_dcp_param(plan, journal.root, params[k], counted)
                journal.record(units[k].rel, paths=files, extra=part)
                n += wrote
            return n

        def finish(staging: Path, journal) -> None:
            _finish_dcp(plan, staging, [journal.extra[u.rel] for u in units])

    elif plan.to == "deepspeed-universal":  # only trained parameters have a folder; rank 0 writes the others' weights
        params = [i for i, p in enumerate(plan.params) if p.kind == "param" and p.states]
        units = [
            shares.Unit(f"{universal_tag(plan)}/zero/{plan.params[i].name}", plan.params[i].nbytes, plan.params[i].name)
            for i in params
        ]

        def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
            n = 0
            for k in todo:
                n += _write_universal(plan, journal.root, counted, indices=[params[k]], common=False)
                journal.record(units[k].rel)
            return n

        def finish(staging: Path, journal) -> None:
            _write_universal(plan, staging, None, indices=[], common=True)

    elif plan.to == "torch":
        units, convert, finish, verified = _torch_job_parts(plan)
        targets = [plan.out.resolve()]
        place = lambda staging: io.put_files_in_place(staging, targets, trust_pickles=plan.trust_pickles)  # noqa: E731
    elif plan.to == "megatron" and plan.ckpt_format == "torch":
        from ..write import megatron_write

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

    elif plan.to == "megatron":  # torch_dist: each parameter's items at the offsets one process writes them at
        planned, tail = _megatron_writer(plan).plan_dist(plan, shares.job_staging(plan.out))
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

    else:
        refuse_job(plan.to)
    held = {name_key(plan.params[i].name) for i in params}

    def check(staging: Path, share: list[int], first: bool) -> list[str]:
        """This rank's share of the logical comparison: the tensors of its share's parameters (units of parameters;
        else a share of the parameters balanced by bytes); rank 0 also those of the parameters no unit holds, and
        what `_not_carried` checks."""
        if by_params:  # units of rank folders or of items in Megatron's order: a share of the parameters
            share = shares.balanced_shares([p.nbytes for p in plan.params], job.world)[job.rank]
        indices = share if by_params else [params[k] for k in share]
        mine = {name_key(plan.params[i].name) for i in indices}
        root = staging / verified if verified else staging
        lines = verify_logical(plan, root, only=lambda n: n in mine or (first and n not in held))
        lines += _not_carried(plan, root) if first else []
        if by_params:
            return lines, [plan.params[i].name for i in indices], sum(plan.params[i].nbytes for i in indices)
        return lines

    fig, figs = shares.run_job(
        job,
        plan.out,
        units,
        digest=plan_digest(plan),
        restart=restart,
        convert=convert,
        finish=finish,
        verify=check if verify else None,
        progress=progress,
        trust_pickles=plan.trust_pickles,
        place=place,
        targets=targets,
    )
    total = sum(f["bytes"] for f in figs)
    return ConvertResult(
        plan.out,
        len(plan.params),
        total if job.rank == 0 else fig["bytes"],
        verify,
        converted=sum(f["params"] for f in figs),
        resumed=sum(f["resumed"] for f in figs),
        ranks=figs,
    )


# --- DeepSpeed universal ----------------------------------------------------------------------------------


def universal_tag(plan: ConvertPlan) -> str:
    return f"global_step{plan.step if plan.step is not None else 0}_universal"


def _write_universal(
    plan: ConvertPlan,
    root: Path,
    progress: Callable[[int], None] | None,
    *,
    indices: list[int] | None = None,
    common: bool = True,
) -> int:
    """What DeepSpeed 0.19's `load_universal` reads (see `ops.to_universal`'s module docstring), synthesized from
    the logical view: `zero/<param>/{fp32,<state>}.pt` ({"param": tensor, "cat_dim": 0}) and `step.pt` per
    trained parameter; `zero/optimizer_state.pt` (param groups, ds_version; the ZeRO-3 loader's
    optimizer_state_dict.state[0].step); the model-states file the engine globs for counters and the
    scheduler (`mp_rank_00_model_states.pt`, and `zero_pp_rank_0_mp_rank_00_model_states.pt` for ZeRO-3
    loaders), with `module` (the fp32 weights) and `param_shapes` (group membership, in group order);
    `latest_universal`."""
    import collections

    import torch

    from importlib import metadata

    try:  # the version string DeepSpeed's loaders assert is present (importing deepspeed itself logs to stdout)
        ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds_version = "0.19.8"
    tag = universal_tag(plan)
    tag_dir = root / tag
    zero = tag_dir / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    written = 0
    by_name = {p.name: p for p in plan.params}
    share = [plan.params[i] for i in indices] if indices is not None else list(plan.params)
    trained = [p for p in share if p.kind == "param" and p.states]
    for p in trained:
        d = zero / p.name
        d.mkdir(parents=True, exist_ok=True)
        t = p.weight.read(torch.float32)
        torch.save({"param": t, "cat_dim": 0}, d / "fp32.pt")
        written += t.numel() * 4
        for k, st in p.states.items():
            v = st.read()
            torch.save({"param": v, "cat_dim": 0}, d / f"{k}.pt")
            written += v.numel() * v.element_size()
        if p.step is not None:
            torch.save(_step_tensor(p.step), d / "step.pt")
        if progress:
            progress(p.nbytes)
    if not common:
        return written
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]} for i, g in enumerate(plan.groups)]
    steps = {}
    for i, g in enumerate(plan.groups):
        s = [by_name[n].step for n in g["params"] if n in by_name and by_name[n].step is not None]
        if s:
            steps[i] = _step_tensor(s[0])
    optim = {
        "ds_version": ds_version,
        "param_groups": groups,
        "optimizer_state_dict": {"state": {i: {"step": s} for i, s in steps.items()}, "param_groups": groups},
    }
    torch.save(optim, zero / "optimizer_state.pt")
    module = collections.OrderedDict((p.name, p.weight.read()) for p in plan.params if p.kind != "tied")
    shapes = [
        collections.OrderedDict((n, torch.Size(by_name[n].shape)) for n in g["params"] if n in by_name)
        for g in plan.groups
    ]
    frozen = collections.OrderedDict((p.name, torch.Size(p.shape)) for p in plan.params if p.kind == "frozen")
    states = {
        "module": module,
        "buffer_names": [p.name for p in plan.params if p.kind == "buffer"],
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": frozen or None,
        "shared_params": {p.name: p.weight.tied_to for p in plan.params if p.kind == "tied"},
        "frozen_param_fragments": None,
        "lr_scheduler": plan.scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": plan.step or 0,
        "dp_world_size": plan.dp or 1,
        "mp_world_size": 1,
        "ds_config": {},
        "ds_version": ds_version,
    }
    torch.save(states, tag_dir / "mp_rank_00_model_states.pt")
    try:
        os.link(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    except OSError:
        import shutil

        shutil.copyfile(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (root / "latest_universal").write_text(tag)
    return written


def _raise_problems(problems: list[str], plan: ConvertPlan) -> None:
    if problems:
        raise CkptError(
            f"verification: the converted checkpoint differs from the source in {len(problems)} "
            "places: " + "; ".join(problems[:5]) + ("; ..." if len(problems) > 5 else ""),
            path=plan.out,
            hint="nothing was written; please report this with `ckpt diff` of the two",
        )
