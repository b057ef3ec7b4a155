"""`ckpt resume` of a DeepSpeed checkpoint (ZeRO, pipeline, universal): the plan — world size, topology, launch
config, model, data — decided before any process starts (`plan_deepspeed`). `resume.deepspeed_run` converts,
launches DeepSpeed's engine (`resume.workers.deepspeed`) and judges the run.

Resumes go wrong quietly — an Adam step that restarts, a scheduler whose state was not loaded and warms up
again, a loss jump nobody can tell from data noise — so the verdict compares what the resumed engine did
with values read from the checkpoint *without* the engine (`open_checkpoint`), and the expected LR is
computed from the saved scheduler state, never asked of the engine's scheduler.

The training runs in `ckpt_tools.resume.workers.deepspeed` under `python -m torch.distributed.run` (NCCL on CUDA,
gloo on CPU, the same code). Re-topology (another DP size, TP or PP) goes through a DeepSpeed universal
checkpoint made by `deepspeed_run.ckpt_to_universal`.

Model-free resume: when the model is not one `ckpt` knows (`--model auto`), or with `--model replica` / `none`,
the worker builds a replica of the checkpoint's parameters (`ckpt_tools.train.replica`) and trains it with a
synthetic loss whose gradient is known; after each resumed step the worker writes the engine's full fp32 master,
exp_avg, exp_avg_sq and step per parameter into the scratch folder, and the verdict compares them with the Adam /
SGD formula applied to the state saved in the checkpoint the user named (read with `open_checkpoint`, never
through the engine) — the "optimizer state" row.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import CkptError, UnsupportedCheckpoint
from ..ops.to_universal import zero3_group_warnings
from ..read import gate
from ..read.meta import meta_device
from ..read.tree import Checkpoint, GroupNode
from ..train import replica_layout as R
from ..train.gpt_config import tiny_gpt_shapes
from ..view.checkpoint import open_checkpoint
from .common import ResumeOptions, RunPlan, _device, _gpus
from .verdict import SavedState, _names, mismatch, saved_state

SUPPORTED_FORMATS = ("deepspeed_zero", "deepspeed_pipeline", "deepspeed_universal")


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePlan(RunPlan):
    """Everything decided before any process starts; `worker_plan()` is what the worker reads."""

    tp: int
    pp: int
    model: str
    ds_config: dict[str, Any]
    micro_batch: int
    gas: int
    orig_gas: int
    universal: bool  # load with {"checkpoint": {"load_universal": true}}
    convert_from: str | None  # a tag folder to convert to universal first (None: load `load_dir` as is)
    inject_missing_state: bool
    load_dir: str | None  # None until the conversion has made it
    tag: str | None
    load_lr_scheduler_states: bool
    data: str | None
    lambda_epochs: tuple[int, ...]
    notes: tuple[str, ...] = ()
    replica: dict[str, Any] | None = None  # the model-free layout (model == "replica"), see replica_layout_for
    scheduler_fn: str | None = None  # --scheduler module:function (a LambdaLR's function)
    load_optimizer_states: bool = True  # False only to test that the optimizer-state check notices
    against: str | None = None  # the checkpoint the optimizer-state check reads the saved state from (default: path)
    no_scheduler: bool = False  # --no-scheduler: the user says the run had no LR scheduler (see lost_scheduler)

    def worker_plan(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "ds_config": self.ds_config,
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "model": self.model,
            "lambda_epochs": list(self.lambda_epochs),
            "load_dir": self.load_dir,
            "tag": self.tag,
            "load_lr_scheduler_states": self.load_lr_scheduler_states,
            "load_optimizer_states": self.load_optimizer_states,
            "micro_batch": self.micro_batch,
            "orig_gas": self.orig_gas,
            "gas": self.gas,
            "steps": self.steps,
            "data": self.data,
            "replica": self.replica,
            "scheduler_fn": self.scheduler_fn,
        }


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


MODEL_FREE = ("replica", "none")


def _is_pipeline_layout(ck: Checkpoint) -> bool:
    if ck.format == "deepspeed_pipeline":
        return True
    # A universal checkpoint of a pipeline run keeps DeepSpeed's '<layer>.<local name>' parameter names.
    names = list(ck.model.children) or list(ck.optimizer.children.get("state", GroupNode()).children)
    return bool(names) and all(n.split(".", 1)[0].isdigit() for n in names)


def _auto_model(ck: Checkpoint, layout: dict[str, Any] | None) -> str:
    """megatron-gpt for pipeline layouts; tiny-gpt when the checkpoint's parameters are exactly the bundled tiny
    GPT's (names and shapes); else the model-free replica."""
    if _is_pipeline_layout(ck):
        return "megatron-gpt"
    if layout is None:
        return "tiny-gpt"
    have = {p["name"]: tuple(p["shape"]) for p in layout["specs"]}
    return "tiny-gpt" if tiny_gpt_shapes() == have else "replica"


def check_model_matches(model: str, layout: dict[str, Any], ctx_fields: dict[str, Any], path: Path) -> str | None:
    """Build `model` in this process on the meta device and compare its parameters with the checkpoint's;
    a mismatch is a CkptError before any process starts. Returns a note when the model could not be built
    here (the worker then reports its own error)."""
    from .workers.deepspeed import SetupContext, load_factory  # lazy: the worker module imports torch

    try:
        factory = load_factory(model)
    except SystemExit as e:
        raise CkptError(str(e.code)) from None
    except (ImportError, AttributeError) as e:
        raise CkptError(
            f"--model {model}: cannot load the factory: {e}",
            hint="give module:function importable from here (PYTHONPATH)",
        ) from None
    try:
        with meta_device():
            built = factory(SetupContext(rank=0, **ctx_fields)).model
        have = {n: tuple(p.shape) for n, p in built.named_parameters()}
    except Exception as e:  # noqa: BLE001  the factory needs a process group or a device: the worker builds it
        return f"--model {model} could not be built here to compare with the checkpoint ({type(e).__name__})"
    want = {p["name"]: tuple(p["shape"]) for p in layout["specs"]}
    parts = mismatch(have, want)
    if not parts:
        return None
    raise CkptError(
        f"--model {model} does not match the checkpoint: the model has {len(have)} parameters, the "
        f"checkpoint {len(want)}: " + "; ".join(parts),
        path=path,
        hint="pass --model module:function or drop --model for the model-free check",
    )


def _check_scheduler_fn(spec: str) -> None:
    """`--scheduler module:function`: importable here and callable as function(step) -> factor or list."""
    module, _, func = spec.partition(":")
    if not module or not func:
        raise CkptError(f"--scheduler {spec!r}: use module:function")
    try:
        fn = getattr(importlib.import_module(module), func)
        probe = fn(0)
    except Exception as e:  # noqa: BLE001  the user's code: any failure is bad input
        raise CkptError(
            f"--scheduler {spec}: {type(e).__name__}: {e}",
            hint="give module:function, importable from here, with function(step) -> factor",
        ) from None
    values = probe if isinstance(probe, (list, tuple)) else [probe]
    if not all(isinstance(v, (int, float)) for v in values):
        raise CkptError(f"--scheduler {spec}: function(0) returned {probe!r}, not a number or a list of numbers")


def _against(against: str | os.PathLike | None, layout: dict[str, Any] | None, model: str) -> str | None:
    """Check `--against CKPT` before launch: a DeepSpeed checkpoint with the same parameters as the one resumed."""
    if against is None:
        return None
    if model != "replica" or layout is None:
        raise CkptError("--against is used by the model-free optimizer-state check only", hint="add --model replica")
    a = Path(against)
    ck = open_checkpoint(a)
    if ck.format not in SUPPORTED_FORMATS:
        raise CkptError(f"--against: a DeepSpeed checkpoint is needed; this is {ck.format}", path=a)
    try:
        specs, _ = R.specs_from_checkpoint(ck)
    except ValueError as e:
        raise CkptError(f"--against: {e}", path=a) from None
    have = {s.name: list(s.shape) for s in specs if s.requires_grad}
    want = {p["name"]: list(p["shape"]) for p in layout["specs"] if p["requires_grad"]}
    if have != want:
        diff = sorted(set(have) ^ set(want)) or [n for n in want if have.get(n) != want[n]]
        raise CkptError(f"--against has other parameters than the checkpoint resumed: {_names(diff)}", path=a)
    return str(a)


def replica_layout_for(
    ck: Checkpoint, saved: SavedState, cfg: dict[str, Any], scheduler_fn: str | None, seed: int = 0
) -> dict[str, Any]:
    """The JSON layout the worker builds the replica from: parameter specs in the model's order, tied aliases,
    buffers, param groups (members and saved hyper-parameters), the torch optimizer / scheduler to rebuild
    when the launch config names none, the synthetic gradient's seed and clip."""
    lay = R.replica_layout(ck)
    opts = list(saved.group_options)
    groups = [{"names": names, "options": opts[i] if i < len(opts) else {}} for i, names in enumerate(lay["groups"])]
    state = ck.optimizer.children.get("state", GroupNode()).children
    first = next(iter(state.values()), None)
    keys = set(first.children) if isinstance(first, GroupNode) else set()
    if "momentum_buffer" in keys or (opts and "momentum" in opts[0] and "betas" not in opts[0]):
        kind = "SGD"
    elif opts and opts[0].get("decoupled_weight_decay") is False:
        kind = "Adam"
    else:
        kind = "AdamW"
    sched = None
    hold = None
    if saved.scheduler_state == "torch" and saved.scheduler_saved:
        cls = R.infer_torch_scheduler(saved.scheduler_saved)
        if cls is None:
            keys = _names(sorted(saved.scheduler_saved))
            raise ValueError(
                f"the saved torch scheduler state (keys {keys}) matches no torch scheduler class; "
                "resume with --model module:function, whose factory builds it"
            )
        sched = {"class": cls, "state": saved.scheduler_saved}
        if cls in R.LAMBDA_SCHEDULERS and saved.base_lrs:
            hold = [lr / b if b else 1.0 for lr, b in zip(saved.param_group_lrs, saved.base_lrs)]
    clip = float(cfg.get("gradient_clipping") or 0.0)
    return {
        "specs": [asdict(s) for s in lay["specs"]],
        "tied": lay["tied"],
        "buffers": {k: [list(v[0]), v[1]] for k, v in lay["buffers"].items()},
        "groups": groups,
        "optimizer": kind,
        "scheduler": sched,
        "lambda_hold": hold,
        "seed": seed,
        "max_norm": clip if clip > 0 else None,
    }


def _load_location(path: Path, tag: str | None) -> tuple[Path, str | None]:
    """(load_dir, tag) for `engine.load_checkpoint`: the folder holding `latest`/`latest_universal`, or the
    tag folder's parent plus its name."""
    if (path / "latest").is_file() or (path / "latest_universal").is_file():
        return path, None
    if tag and path.name == tag:
        return path.parent, tag
    return path, tag


class _Topology(NamedTuple):
    """How the resume is laid out: through a universal checkpoint or not, the processes, DP x TP x PP."""

    universal: bool
    nproc: int
    dp: int
    tp: int
    pp: int


def plan_deepspeed(ck: Checkpoint, p: Path, o: ResumeOptions) -> ResumePlan:
    """Decide how to resume the DeepSpeed checkpoint `ck` (opened from `p`): validate, choose the route (device,
    topology, launch config, what to load), choose the model, build the plan.

    Bad combinations are rejected here, naming the option, before anything is converted or launched.
    DeepSpeed's `load_checkpoint` unpickles with torch's full (not weights-only) loader, which runs whatever
    a pickle names; so a checkpoint whose pickles name globals outside the frameworks' own classes is
    refused unless `trust_pickles`.
    """
    _refuse(ck, p, o)
    saved = saved_state(ck)
    notes: list[str] = []
    device = _device(o.device)
    topo = _topology(ck, saved, o, device, notes)
    cfg, micro, gas, orig_gas = _launch_config(ck, p, saved, o.config, topo, notes)
    convert_from, inject, load_dir, tag = _load_source(ck, p, saved, topo.universal)
    model, layout = _choose_model(ck, p, saved, cfg, o, topo, device, notes)
    load_sched, lambda_epochs = _schedule(p, saved, cfg, o, model, notes)
    return ResumePlan(
        path=str(p),
        saved=saved,
        steps=o.steps,
        device=device,
        nproc=topo.nproc,
        dp=topo.dp,
        tp=topo.tp,
        pp=topo.pp,
        model=model,
        ds_config=cfg,
        micro_batch=micro,
        gas=gas,
        orig_gas=orig_gas,
        universal=topo.universal,
        convert_from=convert_from,
        inject_missing_state=inject,
        load_dir=str(load_dir) if load_dir else None,
        tag=tag if load_dir is not None else None,
        load_lr_scheduler_states=load_sched,
        data=o.data,
        lambda_epochs=lambda_epochs,
        notes=tuple(notes),
        replica=layout if model == "replica" else None,
        scheduler_fn=o.scheduler,
        against=_against(o.against, layout, model),
        no_scheduler=o.no_scheduler,
    )


def _refuse(ck: Checkpoint, p: Path, o: ResumeOptions) -> None:
    """--megatron-args (not a DeepSpeed option); an untrusted pickle (DeepSpeed's loader would run it)."""
    if o.framework_args:
        raise CkptError(
            f"--megatron-args applies to Megatron-LM checkpoints; this is {ck.format}",
            path=p,
            hint="drop --megatron-args",
        )
    if not o.trust_pickles:
        gate.refuse(gate.scan_checkpoint(ck), p, action="resuming runs DeepSpeed's torch.load, which would execute it")


def _topology(ck: Checkpoint, saved: SavedState, o: ResumeOptions, device: str, notes: list[str]) -> _Topology:
    """TP x PP as asked (another one goes through a universal checkpoint), the processes (default: the saved DP,
    or every visible GPU for a universal resume on CUDA) and the DP size they give."""
    new_tp, new_pp = o.tp or saved.tp, o.pp or saved.pp
    is_universal = ck.format == "deepspeed_universal"
    universal = o.universal
    if (new_tp, new_pp) != (saved.tp, saved.pp) and not is_universal:
        universal = True
        notes.append(f"TP x PP {saved.tp}x{saved.pp} -> {new_tp}x{new_pp} goes through a universal checkpoint")
    universal = universal or is_universal
    mp = new_tp * new_pp
    nproc = o.nproc
    if nproc is None:
        if device == "cuda" and universal:
            nproc = (_gpus() // mp) * mp  # re-topology: use every visible GPU
        else:
            nproc = saved.dp * mp
        if device == "cuda" and nproc > _gpus():
            raise CkptError(
                f"the checkpoint needs {nproc} ranks but {_gpus()} GPUs are visible",
                hint="resume through a universal checkpoint: add --universal (and --nproc)",
            )
    if nproc < 1 or nproc % mp:
        raise CkptError(f"--nproc {nproc} is not a multiple of TP x PP = {mp}")
    new_dp = nproc // mp
    if new_dp != saved.dp and not universal:
        raise CkptError(
            f"the checkpoint was saved at DP={saved.dp}; DP={new_dp} needs a universal checkpoint "
            "(ZeRO refuses to repartition)",
            hint="add --universal",
        )
    return _Topology(universal, nproc, new_dp, new_tp, new_pp)


def _launch_config(
    ck: Checkpoint, p: Path, saved: SavedState, config: dict[str, Any] | None, topo: _Topology, notes: list[str]
) -> tuple[dict[str, Any], int, int, int]:
    """The ds_config to launch with (the saved one, `--config` merged over it), keeping the uninterrupted run's
    global batch: (config, micro batch, accumulation steps, the saved accumulation steps)."""
    cfg = json.loads(json.dumps(saved.ds_config or config or {}))  # a universal made from another framework
    if not cfg:  # holds none: --config is the whole config
        raise CkptError("the checkpoint holds no ds_config", path=p, hint="pass the run's config with --config")
    micro = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    orig_gas = int(cfg.get("gradient_accumulation_steps", 1))
    # Keep the uninterrupted run's global batch: fewer DP ranks accumulate more micro-batches.
    if (saved.dp * orig_gas) % topo.dp:
        raise CkptError(
            f"the global batch of {saved.dp * orig_gas} micro-batches cannot be shared by DP={topo.dp}",
            hint="pick --nproc so that the DP size divides the original DP x accumulation steps",
        )
    cfg["gradient_accumulation_steps"] = saved.dp * orig_gas // topo.dp
    cfg["train_batch_size"] = micro * saved.dp * orig_gas
    if config:
        cfg = _deep_merge(cfg, config)
        micro = int(cfg.get("train_micro_batch_size_per_gpu", micro))
    if topo.universal:
        cfg = _deep_merge(cfg, {"checkpoint": {"load_universal": True}})
        if int((cfg.get("zero_optimization") or {}).get("stage", 0) or 0) == 3:
            # issue 12: DeepSpeed's ZeRO-3 universal loader gives every group group 0's hyper-parameters; the
            # LR check (expected LR per group from the saved state) fails then — say why up front
            state = ck.optimizer.children.get("state")
            adam = isinstance(state, GroupNode) and any(
                isinstance(v, GroupNode) and "exp_avg" in v.children for v in state.children.values()
            )
            notes.extend(zero3_group_warnings([dict(g) for g in saved.group_options], shared_step=adam))
    return cfg, micro, int(cfg.get("gradient_accumulation_steps", 1)), orig_gas


def _load_source(
    ck: Checkpoint, p: Path, saved: SavedState, universal: bool
) -> tuple[str | None, bool, Path | None, str | None]:
    """What the engine loads: (the tag folder to convert to universal first or None, whether the conversion
    injects the missing universal info, the folder `load_checkpoint` reads (None until converted), the tag)."""
    tag = ck.details.get("tag")
    if universal and ck.format != "deepspeed_universal":
        if not saved.has_universal_info and saved.tp > 1:
            raise UnsupportedCheckpoint(
                "TP>1 checkpoint without universal_checkpoint_info: DeepSpeed's converter would concatenate "
                "replicated and row-parallel tensors on dim 0",
                path=p,
                hint="resume at the saved TP (drop --tp/--universal) or add the info to the model states",
            )
        base, t = _load_location(p, tag)
        tag_name = t or (base / "latest").read_text().strip()
        return str(base / tag_name), not saved.has_universal_info, None, tag
    base, t = _load_location(p, tag)
    return None, False, base, t


def _layout(
    ck: Checkpoint, saved: SavedState, cfg: dict[str, Any], scheduler: str | None
) -> tuple[dict[str, Any] | None, str | None]:
    """The model-free replica's layout (None for a pipeline layout) and why it cannot be built, if it cannot: then
    the layout holds the parameters alone, which still tell a known model (or a mismatched --model) apart."""
    if _is_pipeline_layout(ck):
        return None, None
    try:
        return replica_layout_for(ck, saved, cfg, scheduler), None
    except ValueError as e:
        layout_error = str(e)
    try:
        lay = R.replica_layout(ck)
        return {"specs": [asdict(x) for x in lay["specs"]]}, layout_error
    except ValueError:
        return None, layout_error


def _choose_model(
    ck: Checkpoint,
    p: Path,
    saved: SavedState,
    cfg: dict[str, Any],
    o: ResumeOptions,
    topo: _Topology,
    device: str,
    notes: list[str],
) -> tuple[str, dict[str, Any] | None]:
    """The model the worker trains (`--model`, or for `auto` a bundled model the checkpoint is, else the model-free
    replica) and the replica layout; a --model that does not match the checkpoint is refused here."""
    if o.scheduler is not None:
        _check_scheduler_fn(o.scheduler)
    layout, layout_error = _layout(ck, saved, cfg, o.scheduler)
    model = o.model
    if model == "auto":
        model = _auto_model(ck, layout)
        if model == "replica" and layout_error:
            raise UnsupportedCheckpoint(f"cannot build a model-free replica: {layout_error}", path=p)
        if model == "replica":
            notes.append(
                "the model is not one ckpt knows: model-free check (a replica of the checkpoint's "
                "parameters, trained with a synthetic loss of known gradient)"
            )
    elif model in MODEL_FREE:
        model = "replica"
        if layout_error:
            raise UnsupportedCheckpoint(f"cannot build a model-free replica: {layout_error}", path=p)
        if layout is None:
            raise UnsupportedCheckpoint(
                "the model-free check needs a ZeRO or universal checkpoint (this one is a pipeline layout)",
                path=p,
                hint="use --model megatron-gpt or module:function",
            )
    elif layout is not None:
        ctx = {"ds_config": cfg, "world_size": topo.nproc, "dp": topo.dp, "tp": topo.tp, "pp": topo.pp}
        note = check_model_matches(model, layout, {**ctx, "device": device}, p)
        if note:
            notes.append(note)
    if o.scheduler and model != "replica":
        notes.append("--scheduler is used by the model-free check only; the --model factory builds the scheduler")
    return model, layout


def _schedule(
    p: Path, saved: SavedState, cfg: dict[str, Any], o: ResumeOptions, model: str, notes: list[str]
) -> tuple[bool, tuple[int, ...]]:
    """(whether the engine loads the saved scheduler state, the scheduler epochs whose lambda the worker evaluates
    for the expected LR of a torch LambdaLR: the saved last_epoch onwards, or the global step when the state is
    missing — what it should have been); --no-scheduler refused where the run had one."""
    start = saved.scheduler_position if saved.scheduler_state == "torch" else (saved.global_step or 0)
    lambda_epochs = tuple(start + k for k in range(o.steps))
    load_sched = saved.scheduler_state != "none"
    if not load_sched and (cfg.get("scheduler") or saved.base_lrs is not None):
        notes.append(
            "the checkpoint holds no scheduler state: the scheduler starts fresh, as a training "
            "script that tolerates a missing state would"
        )
    if not (load_sched or cfg.get("scheduler") or o.no_scheduler) and saved.initial_lrs and model in MODEL_FREE:
        notes.append(
            "the param groups carry initial_lr but the checkpoint holds no scheduler state: the "
            "learning-rate check fails (the real run restarts its schedule) unless --no-scheduler says the "
            "run had none"
        )
    if o.no_scheduler and (load_sched or cfg.get("scheduler")):
        raise CkptError(
            "--no-scheduler says the run had no LR scheduler, but the checkpoint holds scheduler state "
            "or its launch config names one",
            path=p,
            hint="drop --no-scheduler",
        )
    return load_sched, lambda_epochs
