"""`ckpt resume`: load a DeepSpeed checkpoint into a real engine, train a few steps, say whether the run continued.

Resumes go wrong quietly — an Adam step that restarts, a scheduler whose state was not loaded and warms up
again, a loss jump nobody can tell from data noise — so the verdict compares what the resumed engine did
with values read from the checkpoint *without* the engine (`open_checkpoint`), and the expected LR is
computed here from the saved scheduler state, never asked of the engine's scheduler.

Order of use:

    plan = plan_resume(path, steps=2, ...)        # reads metadata only; rejects bad option combinations
    result = run_resume(plan, on_event=print)     # converts to universal if needed, launches, checks
    result.ok, result.checks, result.records      # data only: nothing here prints

The training runs in `ckpt_tools.resume.workers.deepspeed` under `python -m torch.distributed.run` (NCCL on CUDA,
gloo on CPU, the same code). Re-topology (another DP size, TP or PP) goes through a DeepSpeed universal
checkpoint made by `converter`, a single function so that `ckpt to-universal` can replace DeepSpeed's.

Model-free resume (DeepSpeed): when the model is not one `ckpt` knows (`--model auto`), or with `--model
replica` / `none`, the worker builds a replica of the checkpoint's parameters (`ckpt_tools.train.replica`)
and trains it with a synthetic loss whose gradient is known; after each resumed step the worker writes the
engine's full fp32 master, exp_avg, exp_avg_sq and step per parameter into the scratch folder, and
`verdict` compares them with the Adam / SGD formula applied to the state saved in the checkpoint the user
named (read here with `open_checkpoint`, never through the engine) — the "optimizer state" row.

Other frameworks — the dispatch contract (the module `ckpt_tools.resume.frameworks`, imported lazily):

    plan_resume(path, ...) opens the checkpoint; when `ck.format` is not in SUPPORTED_FORMATS it returns
        resume_frameworks.plan_resume(ck, path, steps=steps, nproc=nproc, device=device, model=model,
                                      scheduler=scheduler, trust_pickles=trust_pickles)
    before the pickle-safety check (the framework module does its own). The DeepSpeed-only options
    (--universal, --tp, --pp, --config, --data) are refused for other formats here, naming the option.
    If importing the module raises ImportError, the old UnsupportedCheckpoint ("trains DeepSpeed
    checkpoints") is raised.
    The plan it returns must be a dataclass with a truthy `framework` attribute (e.g. "hf_trainer") and the
    fields the CLI renders: `path`, `steps`, `nproc`, `device`, `model`, `notes` (tuple of str); optional
    `saved` (with `format`, `global_step`, `optimizer_step`, and `dp`/`tp`/`pp` when known), `dp`, `tp`, `pp`.

    run_resume(plan, on_event=..., work_dir=...) with `getattr(plan, "framework", None)` set returns
        resume_frameworks.run_resume(plan, on_event=on_event, keep=work_dir)
    plus `reference=`, `loss_tol=`, `jump_tol=`, `timeout=` for each of those its signature accepts. It must
    return a `ResumeResult` built from `verdict`'s `Check` / `CheckRow` / `StepRecord` (`setup`/`loaded`
    dicts may be empty); `ResumeResult.to_dict` and the CLI render it like a DeepSpeed result. Use the row
    names "global step", "optimizer step", "learning rate", "optimizer state", "loss".
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ..schedules.deepspeed import DS_SCHEDULERS, lr_at as _ds_scheduler_lr
from ..errors import CkptError, UnsupportedCheckpoint
from ..read.tree import Checkpoint, GroupNode, TensorNode, ValueNode
from ..read import gate
from ..read.meta import meta_device
from ..train.processes import _cpu_env, launch as _launch, run_stoppable, scratch_folder
from .frameworks import _gpus as _visible_gpus
from .verdict import LR_REL_TOL, Check, CheckRow, ResumeResult, SavedState, StepRecord, _names, mismatch, saved_state

#: the process each rank runs: DeepSpeed's engine loads the checkpoint and trains
WORKER_MODULE = "ckpt_tools.resume.workers.deepspeed"

REFERENCE_KIND = "ckpt-resume-reference"
SUPPORTED_FORMATS = ("deepspeed_zero", "deepspeed_pipeline", "deepspeed_universal")

Converter = Callable[[Path, Path, bool], None]


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePlan:
    """Everything decided before any process starts; `worker_plan()` is what the worker reads."""

    path: str
    saved: SavedState
    steps: int
    device: str
    nproc: int
    dp: int
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
    try:
        from ..train.models import GPTConfig, TinyGPT

        with meta_device():
            known = {n: tuple(p.shape) for n, p in TinyGPT(GPTConfig()).named_parameters()}
    except Exception:  # noqa: BLE001  no torch model to compare with: model-free
        return "replica"
    have = {p["name"]: tuple(p["shape"]) for p in layout["specs"]}
    return "tiny-gpt" if known == have else "replica"


def check_model_matches(model: str, layout: dict[str, Any], ctx_fields: dict[str, Any], path: Path) -> str | None:
    """Build `model` in this process on the meta device and compare its parameters with the checkpoint's;
    a mismatch is a CkptError before any process starts. Returns a note when the model could not be built
    here (the worker then reports its own error)."""

    from .workers.deepspeed import SetupContext, load_factory

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
    import importlib

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
    from ..view.checkpoint import open_checkpoint
    from ..train import replica as R

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
    from ..train import replica as R

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


def plan_resume(
    path: str | os.PathLike,
    *,
    steps: int,
    nproc: int | None = None,
    device: str = "auto",
    universal: bool = False,
    tp: int | None = None,
    pp: int | None = None,
    model: str = "auto",
    config: dict[str, Any] | None = None,
    data: str | None = None,
    trust_pickles: bool = False,
    scheduler: str | None = None,
    against: str | os.PathLike | None = None,
    n_kv_heads: int | None = None,
    framework_args: str | None = None,
    no_scheduler: bool = False,
) -> Any:
    """Decide how to resume the checkpoint at `path`: world size, topology, launch config, model, data.

    Bad combinations are rejected here, naming the option, before anything is converted or launched.
    DeepSpeed's `load_checkpoint` unpickles with torch's full (not weights-only) loader, which runs whatever
    a pickle names; so a checkpoint whose pickles name globals outside the frameworks' own classes is
    refused unless `trust_pickles`.
    """
    from ..view.checkpoint import open_checkpoint

    if steps < 1:
        raise CkptError("--steps must be at least 1")
    p = Path(path)
    from ..view.logical import with_kv_heads
    from ..read.qkv import find_fused

    ck = open_checkpoint(p)
    if n_kv_heads is not None and not find_fused(ck.tree):
        raise CkptError(
            "--n-kv-heads orders a fused wqkv's Adam state saved beside split weights (torchtitan); "
            "this checkpoint has none",
            path=p,
            hint="drop --n-kv-heads",
        )
    ck = with_kv_heads(ck, n_kv_heads)
    if ck.details.get("resume_unsupported"):  # a format reader's own word: what a resume here cannot rebuild
        raise UnsupportedCheckpoint(
            f"ckpt resume cannot replay this {ck.format} checkpoint: {ck.details['resume_unsupported']}", path=p
        )
    if ck.format not in SUPPORTED_FORMATS:
        if against is not None:
            raise CkptError(f"--against applies to DeepSpeed checkpoints; this is {ck.format}", path=p)
        plan = _framework_plan(
            ck,
            p,
            steps=steps,
            nproc=nproc,
            device=device,
            model=model,
            scheduler=scheduler,
            trust_pickles=trust_pickles,
            universal=universal,
            tp=tp,
            pp=pp,
            config=config,
            data=data,
            framework_args=framework_args,
        )
        if no_scheduler and getattr(plan, "lr_missing", None):  # the user's word: the traces are not a lost schedule
            plan = replace(plan, lr_missing=None)
        return plan
    if framework_args:
        raise CkptError(
            f"--megatron-args applies to Megatron-LM checkpoints; this is {ck.format}",
            path=p,
            hint="drop --megatron-args",
        )
    if not trust_pickles:
        gate.refuse(gate.scan_checkpoint(ck), p, action="resuming runs DeepSpeed's torch.load, which would execute it")
    if ck.format not in SUPPORTED_FORMATS:
        raise UnsupportedCheckpoint(
            f"`ckpt resume` trains DeepSpeed checkpoints; this is {ck.format}",
            path=p,
            hint=f"supported: {', '.join(SUPPORTED_FORMATS)}",
        )
    saved = saved_state(ck)
    notes: list[str] = []

    if device == "auto":
        device = "cuda" if _visible_gpus() else "cpu"
    if device not in ("cpu", "cuda"):
        raise CkptError(f"--device {device!r}: use cpu, cuda or auto")
    if device == "cuda" and not _visible_gpus():
        raise CkptError("--device cuda: no CUDA device is visible", hint="use --device cpu")

    new_tp, new_pp = tp or saved.tp, pp or saved.pp
    is_universal = ck.format == "deepspeed_universal"
    retopo = (new_tp, new_pp) != (saved.tp, saved.pp)
    if retopo and not is_universal:
        universal = True
        notes.append(f"TP x PP {saved.tp}x{saved.pp} -> {new_tp}x{new_pp} goes through a universal checkpoint")
    universal = universal or is_universal
    mp = new_tp * new_pp
    if nproc is None:
        if device == "cuda" and universal:
            nproc = (_visible_gpus() // mp) * mp  # re-topology: use every visible GPU
        else:
            nproc = saved.dp * mp
        if device == "cuda" and nproc > _visible_gpus():
            raise CkptError(
                f"the checkpoint needs {nproc} ranks but {_visible_gpus()} GPUs are visible",
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

    cfg = json.loads(json.dumps(saved.ds_config or config or {}))  # a universal made from another framework
    if not cfg:  # holds none: --config is the whole config
        raise CkptError("the checkpoint holds no ds_config", path=p, hint="pass the run's config with --config")
    micro = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    orig_gas = int(cfg.get("gradient_accumulation_steps", 1))
    # Keep the uninterrupted run's global batch: fewer DP ranks accumulate more micro-batches.
    if (saved.dp * orig_gas) % new_dp:
        raise CkptError(
            f"the global batch of {saved.dp * orig_gas} micro-batches cannot be shared by DP={new_dp}",
            hint="pick --nproc so that the DP size divides the original DP x accumulation steps",
        )
    cfg["gradient_accumulation_steps"] = saved.dp * orig_gas // new_dp
    cfg["train_batch_size"] = micro * saved.dp * orig_gas
    if config:
        cfg = _deep_merge(cfg, config)
        micro = int(cfg.get("train_micro_batch_size_per_gpu", micro))
    if universal:
        cfg = _deep_merge(cfg, {"checkpoint": {"load_universal": True}})
        if int((cfg.get("zero_optimization") or {}).get("stage", 0) or 0) == 3:
            # issue 12: DeepSpeed's ZeRO-3 universal loader gives every group group 0's hyper-parameters; the
            # LR check (expected LR per group from the saved state) fails then — say why up front
            from ..ops.to_universal import zero3_group_warnings

            state = ck.optimizer.children.get("state")
            adam = isinstance(state, GroupNode) and any(
                isinstance(v, GroupNode) and "exp_avg" in v.children for v in state.children.values()
            )
            notes.extend(zero3_group_warnings([dict(g) for g in saved.group_options], shared_step=adam))
    gas = int(cfg.get("gradient_accumulation_steps", 1))

    convert_from = None
    inject = False
    load_dir: Path | None
    tag = ck.details.get("tag")
    if universal and not is_universal:
        if not saved.has_universal_info and saved.tp > 1:
            raise UnsupportedCheckpoint(
                "TP>1 checkpoint without universal_checkpoint_info: DeepSpeed's converter would concatenate "
                "replicated and row-parallel tensors on dim 0",
                path=p,
                hint="resume at the saved TP (drop --tp/--universal) or add the info to the model states",
            )
        inject = not saved.has_universal_info
        base, t = _load_location(p, tag)
        tag_name = t or (base / "latest").read_text().strip()
        convert_from = str(base / tag_name)
        load_dir = None
    else:
        base, t = _load_location(p, tag)
        load_dir, tag = base, t

    if scheduler is not None:
        _check_scheduler_fn(scheduler)
    layout = None
    layout_error = None
    if not _is_pipeline_layout(ck):
        try:
            layout = replica_layout_for(ck, saved, cfg, scheduler)
        except ValueError as e:
            layout_error = str(e)
            layout = None
            try:  # the parameters alone still tell a known model (or a mismatched --model) apart
                from ..train.replica import replica_layout

                lay = replica_layout(ck)
                layout = {"specs": [asdict(x) for x in lay["specs"]]}
            except ValueError:
                pass
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
        note = check_model_matches(
            model,
            layout,
            {"ds_config": cfg, "world_size": nproc, "dp": new_dp, "tp": new_tp, "pp": new_pp, "device": device},
            p,
        )
        if note:
            notes.append(note)
    if scheduler and model != "replica":
        notes.append("--scheduler is used by the model-free check only; the --model factory builds the scheduler")

    # The scheduler epochs whose lambda the worker evaluates for the expected LR of a torch LambdaLR:
    # the saved last_epoch onwards, or the global step when the state is missing (what it should have been).
    start = saved.scheduler_position if saved.scheduler_state == "torch" else (saved.global_step or 0)
    lambda_epochs = tuple(start + k for k in range(steps))
    load_sched = saved.scheduler_state != "none"
    if not load_sched and (cfg.get("scheduler") or saved.base_lrs is not None):
        notes.append(
            "the checkpoint holds no scheduler state: the scheduler starts fresh, as a training "
            "script that tolerates a missing state would"
        )
    if not (load_sched or cfg.get("scheduler") or no_scheduler) and saved.initial_lrs and model in MODEL_FREE:
        notes.append(
            "the param groups carry initial_lr but the checkpoint holds no scheduler state: the "
            "learning-rate check fails (the real run restarts its schedule) unless --no-scheduler says the "
            "run had none"
        )
    if no_scheduler and (load_sched or cfg.get("scheduler")):
        raise CkptError(
            "--no-scheduler says the run had no LR scheduler, but the checkpoint holds scheduler state "
            "or its launch config names one",
            path=p,
            hint="drop --no-scheduler",
        )
    return ResumePlan(
        path=str(p),
        saved=saved,
        steps=steps,
        device=device,
        nproc=nproc,
        dp=new_dp,
        tp=new_tp,
        pp=new_pp,
        model=model,
        ds_config=cfg,
        micro_batch=micro,
        gas=gas,
        orig_gas=orig_gas,
        universal=universal,
        convert_from=convert_from,
        inject_missing_state=inject,
        load_dir=str(load_dir) if load_dir else None,
        tag=tag if load_dir is not None else None,
        load_lr_scheduler_states=load_sched,
        data=data,
        lambda_epochs=lambda_epochs,
        notes=tuple(notes),
        replica=layout if model == "replica" else None,
        scheduler_fn=scheduler,
        against=_against(against, layout, model),
        no_scheduler=no_scheduler,
    )


def _framework_plan(
    ck: Checkpoint,
    p: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    scheduler: str | None,
    trust_pickles: bool,
    universal: bool,
    tp: int | None,
    pp: int | None,
    config: dict[str, Any] | None,
    data: str | None,
    framework_args: str | None = None,
) -> Any:
    """A checkpoint of another framework: hand it to `resume_frameworks` (see the module docstring)."""
    try:
        from . import frameworks as resume_frameworks
    except ImportError:
        raise UnsupportedCheckpoint(
            f"`ckpt resume` trains DeepSpeed checkpoints; this is {ck.format}",
            path=p,
            hint=f"supported: {', '.join(SUPPORTED_FORMATS)}",
        ) from None
    reshard = ck.format == "megatron_torch_dist"  # Megatron's dist-checkpointing loads it at any TP / PP
    if ck.format == "megatron_legacy" and (tp is not None or pp is not None):
        raise CkptError(
            "Megatron-LM loads a legacy checkpoint only at the TP / PP it was saved at",
            path=p,
            hint="drop --tp / --pp (--nproc changes the DP size; a torch_dist save reshards at load)",
        )
    for flag, given in (
        ("--universal", universal),
        ("--tp", tp is not None and not reshard),
        ("--pp", pp is not None and not reshard),
        ("--config", config is not None),
        ("--data", data is not None),
    ):
        if given:
            raise CkptError(
                f"{flag} applies to DeepSpeed checkpoints; this is {ck.format}", path=p, hint=f"drop {flag}"
            )
    return resume_frameworks.plan_resume(
        ck,
        p,
        steps=steps,
        nproc=nproc,
        device=device,
        model=model,
        scheduler=scheduler,
        trust_pickles=trust_pickles,
        framework_args=framework_args,
        tp=tp,
        pp=pp,
    )


def _framework_run(plan: Any, *, on_event: Callable[[dict], None] | None, work_dir: Any, **optional: Any) -> Any:
    import inspect

    from . import frameworks as resume_frameworks

    accepted = inspect.signature(resume_frameworks.run_resume).parameters
    extra = {k: v for k, v in optional.items() if k in accepted}
    return resume_frameworks.run_resume(plan, on_event=on_event, keep=work_dir, **extra)


# --- universal conversion (swappable) ---------------------------------------------------------------


def ckpt_to_universal(tag_dir: Path, out_dir: Path, inject_missing_state: bool) -> None:
    """`ckpt to-universal` (the default converter): `tag_dir` -> `out_dir/<tag>_universal` +
    `out_dir/latest_universal`. Plain ZeRO (TP=1) needs no injected state; TP merges follow the
    checkpoint's universal_checkpoint_info, and disagreeing TP replicas stop the conversion."""
    from ..ops.to_universal import execute, plan_to_universal

    execute(plan_to_universal(tag_dir, out_dir))


def deepspeed_to_universal(tag_dir: Path, out_dir: Path, inject_missing_state: bool) -> None:
    """DeepSpeed's own `ds_to_universal`, kept to compare against: same output layout as `ckpt_to_universal`.

    `inject_missing_state` adds an empty universal_checkpoint_info: right at TP=1, wrong at TP>1
    (`plan_resume` refuses that case).
    """
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(tag_dir),
        "--output_folder",
        str(out_dir / f"{tag_dir.name}_universal"),
        "--num_extract_workers",
        "2",
        "--num_merge_workers",
        "1",
    ]
    if inject_missing_state:
        cmd.append("--inject_missing_state")
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = run_stoppable(cmd, env=_cpu_env())
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CkptError(f"ds_to_universal failed (exit {proc.returncode}):\n{tail}", path=tag_dir)


# --- launching ------------------------------------------------------------------------------------


def expected_lrs(plan: ResumePlan, setup: dict[str, Any]) -> tuple[list[list[float]] | None, str]:
    """(LR per param group for each resumed update, how it was derived) — or (None, why not)."""
    s = plan.saved
    sched_cfg = plan.ds_config.get("scheduler")
    live = setup.get("scheduler")
    k = range(plan.steps)
    if sched_cfg:
        if sched_cfg.get("type") not in DS_SCHEDULERS:
            return None, f"no formula here for DeepSpeed's {sched_cfg.get('type')}"
        if s.scheduler_state == "deepspeed":
            start, src = s.scheduler_position, f"saved last_batch_iteration={s.scheduler_position}"
        else:
            start = (s.global_step or 0) - 1
            src = f"NO saved scheduler state; last_batch_iteration should be global_step - 1 = {start}"
        # WarmupCosineLR scales the optimizer's LR at construction: the config's optimizer lr.
        opt_lr = plan.ds_config.get("optimizer", {}).get("params", {}).get("lr")
        group_lrs = [float(opt_lr)] * len(s.param_group_lrs) if opt_lr is not None else list(s.param_group_lrs)
        return (
            [_ds_scheduler_lr(sched_cfg, start + i, group_lrs) for i in k],
            f"{sched_cfg['type']} from the launch config at {src}",
        )
    if s.scheduler_state == "deepspeed":
        return None, "the checkpoint has a DeepSpeed scheduler state but the launch config names no scheduler"
    from ..train.replica import LAMBDA_SCHEDULERS, expected_torch_lrs, infer_torch_scheduler

    values = setup.get("lambda_values")
    cls = infer_torch_scheduler(s.scheduler_saved) if s.scheduler_saved else None
    if s.scheduler_state == "torch" and cls and cls not in LAMBDA_SCHEDULERS:
        try:
            want = expected_torch_lrs(
                s.scheduler_saved, list(s.param_group_lrs), plan.steps, saved_groups=list(s.group_options)
            )
        except (ValueError, TypeError, KeyError) as e:
            return None, f"cannot rebuild the saved {cls} from its state: {e}"
        return want, f"torch {cls} rebuilt from its saved state (last_epoch={s.scheduler_position})"
    if s.scheduler_state == "torch" and cls in LAMBDA_SCHEDULERS and not values:
        # the function is not in the checkpoint: the first resumed update runs at the saved LR, the rest is unknown
        return (
            [list(s.param_group_lrs)] + [None] * (plan.steps - 1),  # type: ignore[list-item]
            f"{cls}: the first resumed step at the saved param_groups lr; later steps NOT checked (the "
            f"{cls}'s function is not in the checkpoint: pass --scheduler module:function)",
        )
    if live is not None or s.scheduler_state == "torch":
        if live != "LambdaLR" or not values:
            return None, (
                f"the resumed run's scheduler is {live}; the expected LR is computed for LambdaLR "
                "(give the factory's TrainSetup an lr_lambda)"
            )
        if s.scheduler_state == "torch" and s.base_lrs:
            base, src = list(s.base_lrs), f"saved base_lrs x lambda(last_epoch={s.scheduler_position} + k)"
        else:
            base = list(s.initial_lrs or s.param_group_lrs)
            src = (
                f"NO saved scheduler state; initial_lr x lambda(global_step={s.global_step} + k), what a "
                "scheduler stepped once per optimizer step would be at"
            )
        return [[b * f for b, f in zip(base, values[i])] for i in k], src
    return [list(s.param_group_lrs) for _ in k], "no scheduler: the saved param_groups lr"


def lost_scheduler(plan: ResumePlan, setup: dict[str, Any]) -> str | None:
    """Why the LR of this resume cannot be the saved run's, or None. A torch scheduler writes `initial_lr` into
    every param group it drives; groups that carry it while the checkpoint holds no scheduler state (DeepSpeed
    saved `lr_scheduler` None: the scheduler was not handed to `deepspeed.initialize`, or its state was dropped),
    no launch config names one and the resumed run builds none, mean the real run would restart its schedule
    (or lose it) while this resume trains at the saved LR: a pass there would be a false one. The user's
    --no-scheduler (the run had none) makes it a constant LR."""
    s = plan.saved
    if (
        plan.no_scheduler
        or s.scheduler_state != "none"
        or plan.ds_config.get("scheduler")
        or setup.get("scheduler") is not None
        or not s.initial_lrs
    ):
        return None
    return (
        f"the saved param groups carry initial_lr={list(s.initial_lrs)}, so an LR scheduler drove this run, but "
        "the checkpoint holds no scheduler state: the real run restarts its schedule from its first step (or "
        "runs without it), so the LR it will train at is not the saved run's. Save the scheduler (pass it to "
        "deepspeed.initialize as lr_scheduler), or pass --no-scheduler if the run really had none"
    )


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_REL_TOL, abs_tol=1e-12)


def load_reference(path: str | os.PathLike) -> dict[int, float]:
    """step -> loss from a reference JSON: what `--record-reference` writes ({"records": [...]}), a sample
    manifest ({"extra": {"history": [...]}}), {"history": [...]} or a bare list of {step, loss}."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"cannot read the reference: {e}", path=p) from None
    if isinstance(doc, dict):
        doc = doc.get("records") or doc.get("history") or (doc.get("extra") or {}).get("history")
    if not isinstance(doc, list) or not all(isinstance(r, dict) and "step" in r and "loss" in r for r in doc):
        raise CkptError(
            "not a reference: expected a list of {step, loss} under 'records' or 'history'",
            path=p,
            hint="make one with `ckpt resume EARLIER_CKPT --steps N --record-reference REF.json`",
        )
    return {int(r["step"]): float(r["loss"]) for r in doc}


def reference_doc(result: ResumeResult) -> dict[str, Any]:
    """What `--record-reference` writes: the per-step records of this run, to compare a later resume with."""
    return {
        "kind": REFERENCE_KIND,
        "version": 1,
        "checkpoint": result.plan.path,
        "topology": {"dp": result.plan.dp, "tp": result.plan.tp, "pp": result.plan.pp},
        "device": result.plan.device,
        "records": [asdict(r) for r in result.records],
    }


def verdict(
    plan: ResumePlan,
    setup: dict[str, Any],
    loaded: dict[str, Any],
    records: list[StepRecord],
    *,
    reference: dict[int, float] | None = None,
    loss_tol: float = 1e-3,
    jump_tol: float = 0.1,
    state_dir: Path | None = None,
) -> list[Check]:
    """The checks: counters continue, the LR is what the saved schedule prescribes, (model-free) the optimizer
    state continues, the loss continues."""
    s = plan.saved
    checks: list[Check] = []

    # (1) counters
    rows = []
    if s.global_step is None:
        checks.append(Check("global step", "n/a", "the checkpoint records no global step"))
    else:
        rows = [
            CheckRow(r.step, s.global_step + i + 1, r.step, r.step == s.global_step + i + 1)
            for i, r in enumerate(records)
        ]
        ok = all(r.ok for r in rows)
        checks.append(
            Check(
                "global step",
                "pass" if ok else "fail",
                f"continues from the saved global_steps={s.global_step}"
                if ok
                else f"does not continue from the saved global_steps={s.global_step}",
                tuple(rows),
            )
        )
    if s.optimizer_step is None:
        checks.append(Check("optimizer step", "n/a", "the checkpoint records no Adam step"))
    else:
        rows = []
        for i, r in enumerate(records):
            # a skipped step (fp16 overflow) does not advance Adam
            want = s.optimizer_step + i + 1 - (r.skipped_steps - (s.skipped_steps or 0))
            rows.append(CheckRow(r.step, want, r.optimizer_step, r.optimizer_step == want))
        ok = all(r.ok for r in rows)
        checks.append(
            Check(
                "optimizer step",
                "pass" if ok else "fail",
                f"Adam step continues from the saved {s.optimizer_step}"
                if ok
                else f"Adam step does not continue from the saved {s.optimizer_step} (reset?)",
                tuple(rows),
            )
        )

    # (2) LR
    want, how = expected_lrs(plan, setup)
    lost = lost_scheduler(plan, setup)
    if lost:
        checks.append(
            Check("learning rate", "fail", lost, tuple(CheckRow(r.step, None, list(r.lr), False) for r in records))
        )
    elif want is None:
        checks.append(Check("learning rate", "n/a", how))
    else:
        rows = [
            CheckRow(r.step, w, list(r.lr), len(w) == len(r.lr) and all(_close(a, b) for a, b in zip(w, r.lr)))
            for w, r in zip(want, records)
            if w is not None
        ]
        if s.scheduler_state == "torch" and any(w is None for w in want):
            # what can be checked of a scheduler whose function is missing: the state was loaded
            pos, base = loaded.get("scheduler_position"), loaded.get("base_lrs")
            ok_pos = pos == s.scheduler_position
            ok_base = (
                base is not None
                and s.base_lrs is not None
                and len(base) == len(s.base_lrs)
                and all(_close(a, b) for a, b in zip(base, s.base_lrs))
            )
            rows.append(
                CheckRow(
                    s.global_step or 0,
                    {"last_epoch": s.scheduler_position, "base_lrs": s.base_lrs},
                    {"last_epoch": pos, "base_lrs": base},
                    ok_pos and ok_base,
                )
            )
            how += (
                "; the scheduler state was loaded (last_epoch and base_lrs as saved)"
                if ok_pos and ok_base
                else f"; the scheduler state was NOT loaded: last_epoch {pos}, base_lrs {base} after the load"
            )
        ok = all(r.ok for r in rows)
        bad = next((r for r in rows if not r.ok), None)
        detail = (
            f"expected: {how}"
            if ok
            else (f"step {bad.step}: expected {bad.expected}, the engine used {bad.actual} (expected: {how})")
        )
        checks.append(Check("learning rate", "pass" if ok else "fail", detail, tuple(rows)))

    # (3) loss
    if reference is not None:
        rows = [
            CheckRow(r.step, reference[r.step], r.loss, abs(reference[r.step] - r.loss) <= loss_tol)
            for r in records
            if r.step in reference
        ]
        if not rows:
            checks.append(
                Check(
                    "loss", "fail", f"the reference has none of the resumed steps {records[0].step}..{records[-1].step}"
                )
            )
        else:
            diff = max(abs(r.expected - r.actual) for r in rows)
            ok = all(r.ok for r in rows)
            exact = all(r.expected == r.actual for r in rows)
            checks.append(
                Check(
                    "loss",
                    "pass" if ok else "fail",
                    f"{len(rows)} steps vs the reference: max |diff| {diff:.3g} "
                    f"({'bitwise equal' if exact else f'tolerance {loss_tol:g}'})",
                    tuple(rows),
                )
            )
    elif plan.model == "replica":
        checks.append(
            Check(
                "loss",
                "n/a",
                "the model-free check trains a stand-in with a synthetic loss: loss "
                "continuity needs --model module:function",
            )
        )
    elif s.loss is not None and records:
        first = records[0]
        ok = first.loss <= s.loss * (1 + jump_tol)
        checks.append(
            Check(
                "loss",
                "pass" if ok else "fail",
                f"first resumed loss {first.loss:.6g} vs client state {s.loss_key}={s.loss:.6g} "
                f"(allowed jump {jump_tol:.0%})",
                (CheckRow(first.step, s.loss, first.loss, ok),),
            )
        )
    else:
        checks.append(Check("loss", "n/a", "no --reference and no loss saved in the checkpoint's client state"))
    if plan.model == "replica":
        checks.insert(-1, optimizer_state_check(plan, records, want, state_dir))
    return checks


def _saved_optimizer_state(ck: Checkpoint, names: list[str]) -> dict[str, dict[str, Any]]:
    import torch

    state = ck.optimizer.children.get("state", GroupNode()).children
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        node = state.get(n)
        if not isinstance(node, GroupNode):
            raise KeyError(n)
        entry: dict[str, Any] = {}
        for key in ("fp32", "exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq"):
            t = node.children.get(key)
            if isinstance(t, TensorNode):
                entry[key] = t.read_torch().to(torch.float64)
        st = node.children.get("step")
        v = st.value if isinstance(st, ValueNode) else (st.read_torch() if isinstance(st, TensorNode) else None)
        entry["step"] = None if v is None else int(float(v if not hasattr(v, "item") else v.item()))
        out[n] = entry
    return out


def _decoupled(opts: dict[str, Any], cfg: dict[str, Any], kind: str) -> bool:
    if "decoupled_weight_decay" in opts:
        return bool(opts["decoupled_weight_decay"])
    ds_opt = cfg.get("optimizer") or {}
    t = str(ds_opt.get("type", kind)).lower()
    if t == "adamw":
        return True
    if t == "adam":  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
        return bool((ds_opt.get("params") or {}).get("adam_w_mode", True)) if ds_opt else False
    return kind == "AdamW"


def optimizer_state_check(
    plan: ResumePlan, records: list[StepRecord], lrs: list[list[float] | None] | None, state_dir: Path | None
) -> Check:
    """The model-free "optimizer state" row: after each resumed step, the engine's fp32 master, exp_avg,
    exp_avg_sq (or SGD momentum) and step equal the closed-form update applied — step after step — to the
    state saved in the checkpoint the user named (read here, never through the engine), with the known
    gradient r (times DeepSpeed's clip factor) and the expected LR of each group."""
    import torch

    from ..view.checkpoint import open_checkpoint
    from ..train import replica as R

    name = "optimizer state"
    lay = plan.replica or {}
    if state_dir is None or not records:
        return Check(name, "n/a", "no resumed step to compare")
    specs = [R.ParamSpec(p["name"], tuple(p["shape"]), p["dtype"], p["requires_grad"]) for p in lay["specs"]]
    directions = R.synthetic_directions(specs, lay.get("seed", 0), max_norm=lay.get("max_norm"))
    factor = R.clip_factor(directions, lay.get("max_norm"))
    names = [s.name for s in specs if s.requires_grad]
    try:
        saved = _saved_optimizer_state(open_checkpoint(plan.against or plan.path), names)
    except KeyError as e:
        return Check(name, "n/a", f"the checkpoint holds no optimizer state for {e}")
    kind = lay.get("optimizer") or "AdamW"
    adam = all("exp_avg" in saved[n] and "exp_avg_sq" in saved[n] for n in names)
    sgd = not adam and all("momentum_buffer" in saved[n] for n in names)
    if not (adam or sgd):
        return Check(
            name,
            "n/a",
            "the saved optimizer state is neither Adam (exp_avg, exp_avg_sq) nor SGD momentum: no closed form here",
        )
    group_of = {n: gi for gi, g in enumerate(lay["groups"]) for n in g["names"]}
    cur = {
        n: {
            "param": saved[n]["fp32"],
            "exp_avg": saved[n].get("exp_avg"),
            "exp_avg_sq": saved[n].get("exp_avg_sq"),
            "max_exp_avg_sq": saved[n].get("max_exp_avg_sq"),
            "momentum_buffer": saved[n].get("momentum_buffer"),
            "step": saved[n]["step"],
        }
        for n in names
    }
    rows: list[CheckRow] = []
    first_bad = None
    used_engine_lr = []
    skipped_before = plan.saved.skipped_steps or 0
    for i, rec in enumerate(records):
        f = state_dir / f"step_{rec.step}.pt"
        if not f.is_file():
            rows.append(CheckRow(rec.step, "state file", "missing", False))
            first_bad = first_bad or f"step {rec.step}: the worker wrote no state"
            continue
        live = torch.load(f, map_location="cpu", weights_only=True)
        step_lrs = lrs[i] if lrs is not None and i < len(lrs) and lrs[i] is not None else None
        if step_lrs is None:
            step_lrs = list(rec.lr)
            used_engine_lr.append(rec.step)
        skipped = rec.skipped_steps > skipped_before
        skipped_before = rec.skipped_steps
        worst: tuple[float, str, str, float] = (0.0, "", "", 0.0)  # (ratio, param, field, diff)
        ok = True
        for n in names:
            gi = group_of.get(n, 0)
            opts = lay["groups"][gi]["options"] if gi < len(lay["groups"]) else {}
            lr = float(step_lrs[gi] if gi < len(step_lrs) else step_lrs[0])
            prev = cur[n]
            if skipped:
                new = dict(prev)
            elif adam:
                new = R.expected_adam(
                    prev["param"],
                    directions[n] * factor,
                    prev.get("exp_avg"),
                    prev.get("exp_avg_sq"),
                    prev.get("step"),
                    lr=lr,
                    betas=opts.get("betas", (0.9, 0.999)),
                    eps=float(opts.get("eps", 1e-8)),
                    weight_decay=float(opts.get("weight_decay", 0)),
                    decoupled=_decoupled(opts, plan.ds_config, kind),
                    amsgrad=bool(opts.get("amsgrad", False)),
                    max_exp_avg_sq=prev.get("max_exp_avg_sq"),
                )
            else:
                new = R.expected_sgd(
                    prev["param"],
                    directions[n] * factor,
                    prev.get("momentum_buffer"),
                    lr=lr,
                    momentum=float(opts.get("momentum", 0)),
                    dampening=float(opts.get("dampening", 0)),
                    weight_decay=float(opts.get("weight_decay", 0)),
                    nesterov=bool(opts.get("nesterov", False)),
                )
                new["step"] = None
            got = live["params"].get(n, {})
            fields = [("fp32", "param")] + (
                [("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")]
                if adam
                else [("momentum_buffer", "momentum_buffer")]
            )
            for live_key, want_key in fields:
                if new.get(want_key) is None:
                    continue
                if live_key not in got:
                    ok, worst = False, (math.inf, n, live_key, math.inf)
                    continue
                good, diff, tol = R.state_close(
                    got[live_key],
                    new[want_key],
                    "param" if live_key == "fp32" else "m",
                    saved=prev["param"] if live_key == "fp32" else None,
                )
                ratio = diff / tol if tol > 0 else (0.0 if diff == 0 else math.inf)
                if ratio > worst[0]:
                    worst = (ratio, n, live_key, diff)
                ok = ok and good
            cur[n] = new
        want_step = None if not adam or cur[names[0]]["step"] is None else cur[names[0]]["step"]
        step_ok = want_step is None or live.get("step") == want_step
        ok = ok and step_ok
        rows.append(
            CheckRow(
                rec.step,
                {"step": want_step, "tolerance": "fp32"},
                {
                    "step": live.get("step"),
                    "worst": worst[1],
                    "field": worst[2],
                    "max_abs_diff": worst[3],
                    "diff_over_tolerance": worst[0],
                },
                ok,
            )
        )
        if not ok and first_bad is None:
            first_bad = (
                f"step {rec.step}: Adam step {live.get('step')} instead of {want_step}"
                if not step_ok
                else f"step {rec.step}: {worst[2]} of {worst[1]} is {worst[3]:.3g} off the formula applied to the "
                f"saved state ({worst[0]:.3g}x the tolerance)"
            )
    formula = ("Adam" if adam else "SGD") if kind not in ("AdamW", "Adam", "SGD") else kind
    what = "fp32 master, exp_avg, exp_avg_sq and step" if adam else "fp32 master and momentum buffer"
    tol = (
        f"fp32 tolerance: moments {R.MOMENT_RTOL:g} x max|value|, parameters {R.PARAM_ULPS} ulp + "
        f"{R.UPDATE_RTOL:g} x the update"
    )
    note = f"; LR of steps {used_engine_lr} taken from the engine (not checked)" if used_engine_lr else ""
    clip = f"; gradient clipped by {factor:.6g}" if factor != 1.0 else ""
    src = f" saved in {plan.against}" if plan.against else ""
    if first_bad:
        return Check(name, "fail", f"{first_bad}{src}: the optimizer state did not continue ({tol}{note})", tuple(rows))
    return Check(
        name,
        "pass",
        f"{what} of {len(names)} parameters follow {formula} applied to the state{src} with "
        f"the known gradient ({tol}{clip}{note})",
        tuple(rows),
    )


def run_resume(
    plan: ResumePlan,
    *,
    on_event: Callable[[dict], None] | None = None,
    converter: Converter = ckpt_to_universal,
    reference: dict[int, float] | None = None,
    loss_tol: float = 1e-3,
    jump_tol: float = 0.1,
    work_dir: str | os.PathLike | None = None,
    timeout: float = 3600,
) -> ResumeResult:
    """Convert (if the plan says so), launch the training processes, and judge the records.

    Scratch files (the worker plan, a universal conversion, the processes' temp files) go to `work_dir` — never
    into the checkpoint folder — and a temporary `work_dir` is removed afterwards, also on Ctrl-C / SIGTERM
    (`scratch_folder`), after the training processes were stopped (`_launch`).
    """
    if getattr(plan, "framework", None):
        return _framework_run(
            plan,
            on_event=on_event,
            work_dir=work_dir,
            reference=reference,
            loss_tol=loss_tol,
            jump_tol=jump_tol,
            timeout=timeout,
        )
    with scratch_folder(work_dir) as scratch:
        if plan.convert_from is not None:
            out = scratch / "universal"
            if on_event:
                on_event({"event": "converting", "source": plan.convert_from, "target": str(out)})
            converter(Path(plan.convert_from), out, plan.inject_missing_state)
            plan = replace(plan, load_dir=str(out), tag=None)
        plan_file = scratch / "worker_plan.json"
        state_dir = scratch / "state"
        state_dir.mkdir(exist_ok=True)
        doc = plan.worker_plan()
        doc["state_dir"] = str(state_dir)
        plan_file.write_text(json.dumps(doc, indent=1))
        events = _launch(plan, plan_file, on_event, timeout, module=WORKER_MODULE)
        setup = next((e for e in events if e["event"] == "setup"), {})
        loaded = next((e for e in events if e["event"] == "loaded"), {})
        records = [
            StepRecord(
                step=e["step"],
                loss=e["loss"],
                loss_mean=e["loss_mean"],
                lr=tuple(e["lr"]),
                grad_norm=e["grad_norm"],
                optimizer_step=e["optimizer_step"],
                tokens_per_s=e["tokens_per_s"],
                seconds=e["seconds"],
                skipped_steps=e["skipped_steps"],
            )
            for e in events
            if e["event"] == "step"
        ]
        checks = verdict(
            plan, setup, loaded, records, reference=reference, loss_tol=loss_tol, jump_tol=jump_tol, state_dir=state_dir
        )
    return ResumeResult(plan=plan, setup=setup, loaded=loaded, records=tuple(records), checks=tuple(checks))


__all__ = [
    "plan_resume",
    "run_resume",
    "deepspeed_to_universal",
    "expected_lrs",
    "verdict",
    "load_reference",
    "reference_doc",
    "ResumePlan",
    "ResumeResult",
    "StepRecord",
    "Check",
    "CheckRow",
    "SavedState",
    "saved_state",
]
