"""`ckpt resume` for checkpoints that DeepSpeed did not write: HF Trainer, Accelerate, torch DCP / FSDP2, Lightning.

Each is resumed in the framework that wrote it (`ckpt_tools.resume.workers.<framework>` under
`python -m torch.distributed.run`, gloo on CPU, NCCL on CUDA) and judged with the same verdict as the DeepSpeed
resume (`ckpt_tools.resume.deepspeed`):

    global step       the framework's loop counter continues from the saved one
    optimizer step    the Adam step continues
    learning rate     the LR each resumed update used is what the SAVED scheduler prescribes — computed here
                      from the saved state (HF: `training_args.bin`'s schedule; torch schedulers: their state
                      dict), never asked of the framework's scheduler, so a scheduler that silently restarts
                      its warm-up fails it
    optimizer state   after every update, the moments, step and parameter update equal the closed-form
                      Adam/AdamW/SGD update applied to the state saved in the checkpoint (read by the worker
                      with `safe_load`, not taken from what the framework loaded) with the gradient the
                      optimizer got: proves the optimizer state continued, without the user's model code
    loss              HF: against trainer_state.json's log_history (this checkpoint-N's and the later ones of
                      the same output_dir) where it has the resumed steps, or `--reference`; the model is the
                      real one (config.json) but the data are ckpt's synthetic rows (the bundled samples' rule).
                      Model-free resumes: n/a (loss continuity needs the model)
    plus, model-free: "scheduler state" (the position right after the load is the saved one) and, for
    Accelerate, "custom state" (registered objects restored; a stray `custom_checkpoint_*` file is reported).

What each framework runs (`ckpt_tools/resume/workers/`): hf_trainer — `trainer.train(resume_from_checkpoint=)`
with `AutoModelForCausalLM.from_config(config.json)` and TrainingArguments rebuilt from the fields of
training_args.bin read by the inert pickle reader; accelerate — `accelerator.load_state` into replicas (DDP or
the DeepSpeed plugin with the saved ds_config); dcp — `dcp.load` into a `fully_shard` replica under the layout's
key names + `set_state_dict`; lightning — `Trainer.fit(ckpt_path=)` with a LightningModule built from the saved
state_dict, optimizer and scheduler of the saved kinds.

Order of use (the same as the DeepSpeed resume; `ckpt_tools.resume.deepspeed` dispatches here):

    plan = plan_resume(ck, path, steps=2, nproc=None, device="auto", model="auto", scheduler=None,
                       trust_pickles=False)
    result = run_resume(plan, on_event=print)          # -> ckpt_tools.resume.deepspeed.ResumeResult
    # also: keep=DIR|True (scratch files kept), reference={step: loss}, loss_tol=, timeout=

Nothing here prints; a bad input is a `CkptError` before anything starts, and a failing training process is a
`WorkerFailed` whose message is that process's own last error line.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError, UnsupportedCheckpoint
from ..read.meta import meta_device
from ..read.tree import Checkpoint, GroupNode, node_to_python
from ..train.processes import scratch_folder
from .verdict import LR_REL_TOL, Check, CheckRow, ResumeResult, SavedState, StepRecord, mismatch

WORKERS = {
    "hf_trainer": "ckpt_tools.resume.workers.hf_trainer",
    "accelerate": "ckpt_tools.resume.workers.accelerate",
    "dcp": "ckpt_tools.resume.workers.dcp",
    "lightning": "ckpt_tools.resume.workers.lightning",
    "megatron": "ckpt_tools.resume.workers.megatron",
}
#: checkpoint format -> the framework that resumes it
FRAMEWORK_OF_FORMAT = {
    "hf_trainer": "hf_trainer",
    "accelerate": "accelerate",
    "dcp": "dcp",
    "lightning": "lightning",
    "megatron_legacy": "megatron",
    "megatron_torch_dist": "megatron",
}
LOSS_TOL = 1e-3  # absolute, vs a logged loss (the Trainer logs float32 losses rounded by json)


@dataclass(frozen=True)
class FrameworkPlan:
    """Everything decided before any process starts. Field names follow `ResumePlan` where they mean the same
    (the CLI renders both); `framework` is what `ckpt_tools.resume.deepspeed.run_resume` dispatches on."""

    framework: str
    path: str
    saved: SavedState
    steps: int
    device: str
    nproc: int
    dp: int
    model: str  # "real (config.json)" or "model-free"
    load_dir: str
    expected_lrs: tuple[tuple[float, ...] | None, ...] | None  # per update (None: not determined)
    lr_source: str
    loss_reference: dict[int, float] = field(default_factory=dict)
    loss_reference_source: str = ""
    worker: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    lr_missing: str | None = None  # why the schedule cannot continue (a scheduler was attached, its state is gone)
    tp: int = 1
    pp: int = 1
    universal: bool = False
    micro_batch: int = 1
    gas: int = 1

    def worker_plan(self) -> dict[str, Any]:
        return _finite(
            {
                "framework": self.framework,
                "load_dir": self.load_dir,
                "device": self.device,
                "steps": self.steps,
                "expected_lrs": [None if x is None else list(x) for x in self.expected_lrs]
                if self.expected_lrs
                else None,
                **self.worker,
            }
        )


# --- reading what the checkpoint says -------------------------------------------------------------


def _plain(v: Any) -> Any:
    """A value read by the inert pickle reader, as JSON: enums (`{'value': x}`) become x; others str."""
    if isinstance(v, dict):
        if set(v) == {"value"}:
            return _plain(v["value"])
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def _saved_state(
    ck: Checkpoint, sched: dict[str, Any], *, global_step: int | None, optimizer_step: int | None, dp: int
) -> SavedState:
    groups = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) or {}
    initial = (
        [g.get("initial_lr") for _, g in sorted(groups.items(), key=lambda kv: int(kv[0])) if isinstance(g, dict)]
        if all(str(k).isdigit() for k in groups)
        else []
    )
    if "last_epoch" in sched:
        kind, pos = "torch", sched["last_epoch"]
    else:
        kind, pos = "none", None
    return SavedState(
        format=ck.format,
        global_step=global_step,
        optimizer_step=optimizer_step,
        skipped_steps=ck.counters.skipped_steps,
        param_group_lrs=tuple(ck.lr.param_groups),
        initial_lrs=tuple(initial) if initial and all(x is not None for x in initial) else None,
        scheduler_state=kind,
        scheduler_position=pos,
        base_lrs=tuple(float(x) for x in sched["base_lrs"]) if sched.get("base_lrs") else None,
        loss=None,
        loss_key=None,
        ds_config={},
        has_universal_info=False,
        dp=dp,
        tp=1,
        pp=1,
    )


# --- the schedules, computed here -----------------------------------------------------------------


def hf_lambda(kind: str, step: int, *, warmup: int, total: int, kwargs: dict[str, Any]) -> float | None:
    """transformers' `get_scheduler(kind)` factor at scheduler epoch `step` (None: no formula here)."""
    if step < warmup and kind != "constant":
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    if kind == "constant_with_warmup":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * float(kwargs.get("num_cycles", 0.5)) * 2.0 * progress)))
    if kind == "cosine_with_min_lr" and "min_lr_rate" in kwargs:
        f = 0.5 * (1.0 + math.cos(math.pi * float(kwargs.get("num_cycles", 0.5)) * 2.0 * progress))
        return max(0.0, f * (1 - kwargs["min_lr_rate"]) + kwargs["min_lr_rate"])
    if kind == "cosine_with_restarts":
        if progress >= 1.0:
            return 0.0
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(kwargs.get("num_cycles", 1)) * progress) % 1.0))))
    return None


def hf_expected_lrs(args: dict[str, Any], saved: SavedState, steps: int) -> tuple[list[list[float]] | None, str]:
    kind = args.get("lr_scheduler_type")
    total = args.get("max_steps")
    if not isinstance(total, int) or total <= 0:
        return None, "training_args.bin has no max_steps (an epoch-based schedule needs the dataset size)"
    w = args.get("warmup_steps") or 0
    ratio = args.get("warmup_ratio") or 0
    warmup = int(w) if w >= 1 else math.ceil(total * (w or ratio))
    kwargs = args.get("lr_scheduler_kwargs") or {}
    if saved.scheduler_state == "torch" and saved.base_lrs:
        base, pos = list(saved.base_lrs), int(saved.scheduler_position)
        src = f"saved scheduler.pt last_epoch={pos}, base_lrs"
    else:
        pos = saved.global_step or 0
        lr = float(args.get("learning_rate") or 0)
        base = list(saved.initial_lrs or [lr] * max(1, len(saved.param_group_lrs)))
        src = f"NO saved scheduler state: the position should be global_step={pos}"
    out = []
    for k in range(steps):
        f = hf_lambda(str(kind), pos + k, warmup=warmup, total=total, kwargs=kwargs)
        if f is None:
            return None, f"no formula here for lr_scheduler_type={kind!r}"
        out.append([b * f for b in base])
    return out, f"{kind} (warmup {warmup}, max_steps {total}) from training_args.bin at {src}"


def torch_scheduler_kind(state: dict[str, Any]) -> str | None:
    """The torch scheduler class a saved state dict belongs to, from its keys (None: not a torch scheduler)."""
    keys = set(map(str, state))
    if "last_epoch" not in keys:
        return None
    if "total_steps" in keys and "_schedule_phases" in keys:
        return "OneCycleLR"
    if "lr_lambdas" in keys:
        return "LambdaLR"  # MultiplicativeLR saves the same keys; its factor is not in the checkpoint either
    if "milestones" in keys:
        return "MultiStepLR"
    if "step_size" in keys:
        return "StepLR"
    if "T_max" in keys:
        return "CosineAnnealingLR"
    if {"start_factor", "end_factor"} <= keys:
        return "LinearLR"
    if "factor" in keys and "total_iters" in keys:
        return "ConstantLR"
    if "gamma" in keys:
        return "ExponentialLR"
    return None


def _anneal(kind: str, start: float, end: float, pct: float) -> float:
    if kind == "linear":
        return (end - start) * pct + start
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def torch_expected_lrs(
    state: dict[str, Any] | None,
    groups: list[dict[str, Any]],
    steps: int,
    *,
    per_update: int = 1,
    lr_fn: Callable[[int], float] | None = None,
    fn_name: str | None = None,
) -> tuple[list[list[float] | None], str]:
    """The LR per group of each resumed update, from the SAVED scheduler state and optimizer param groups.

    Update k uses the LR set after `per_update * k` scheduler steps past the saved `last_epoch` (update 0: the
    saved param_groups lr). Entries are None where the saved state does not determine the LR (a LambdaLR
    without its function). Returns (rows, how)."""
    lrs = [float(g["lr"]) for g in groups]
    if not state:
        return [lrs for _ in range(steps)], "no scheduler state: the saved param_groups lr, constant"
    kind = torch_scheduler_kind(state)
    last = int(state["last_epoch"])
    epochs = [last + per_update * k for k in range(steps)]
    src = f"saved {kind} state last_epoch={last}" + (
        f", {per_update} scheduler steps per update" if per_update != 1 else ""
    )
    rows: list[list[float] | None] = [lrs]
    if kind in ("LambdaLR", "MultiplicativeLR"):
        if lr_fn is None:
            return rows + [None] * (steps - 1), (
                f"{src}: the first update uses the saved lr; the later ones need "
                "the lambda (--scheduler module:function), not in the checkpoint"
            )
        if kind == "MultiplicativeLR":
            cur = list(lrs)
            prev = last
            for e in epochs[1:]:
                for x in range(prev + 1, e + 1):
                    cur = [v * lr_fn(x) for v in cur]
                prev = e
                rows.append(list(cur))
            return rows, f"{src} x {fn_name}"
        base = [float(b) for b in state["base_lrs"]]
        return rows + [[b * lr_fn(e) for b in base] for e in epochs[1:]], f"{src}: base_lrs x {fn_name}(epoch)"
    if kind == "OneCycleLR":
        phases = state["_schedule_phases"]
        if isinstance(phases, dict):  # the tree keeps a list as {"0": ..., "1": ...}
            phases = [phases[k] for k in sorted(phases, key=int)]
        total = int(state["total_steps"])
        anneal = "linear" if state.get("_anneal_func_type") == "linear" else "cos"
        out = []
        for e in epochs:
            row = []
            for g in groups:
                start_step, val = 0.0, None
                for i, ph in enumerate(phases):
                    end_step = float(ph["end_step"])
                    if e <= end_step or i == len(phases) - 1:
                        pct = (e - start_step) / (end_step - start_step)
                        val = _anneal(anneal, float(g[ph["start_lr"]]), float(g[ph["end_lr"]]), pct)
                        break
                    start_step = float(ph["end_step"])
                row.append(val if e < total else float("nan"))
            out.append(row)
        return out, f"{src}: OneCycleLR ({anneal}, total_steps {total}) from the saved phases and param groups"
    cur = list(lrs)
    prev = last
    out = [list(cur)]
    for e in epochs[1:]:
        for x in range(prev + 1, e + 1):
            if kind == "StepLR":
                if x % int(state["step_size"]) == 0:
                    cur = [v * float(state["gamma"]) for v in cur]
            elif kind == "MultiStepLR":
                ms = state["milestones"]
                n = int(ms.get(x, ms.get(str(x), 0))) if isinstance(ms, dict) else list(ms).count(x)
                cur = [v * float(state["gamma"]) ** n for v in cur]
            elif kind == "ExponentialLR":
                cur = [v * float(state["gamma"]) for v in cur]
            elif kind == "CosineAnnealingLR":
                T, eta = float(state["T_max"]), float(state.get("eta_min", 0.0))
                base = [float(b) for b in state["base_lrs"]]
                if (x - 1 - T) % (2 * T) == 0:
                    cur = [v + (b - eta) * (1 - math.cos(math.pi / T)) / 2 for v, b in zip(cur, base)]
                else:
                    cur = [
                        (1 + math.cos(math.pi * x / T)) / (1 + math.cos(math.pi * (x - 1) / T)) * (v - eta) + eta
                        for v in cur
                    ]
            else:
                return out + [None] * (steps - len(out)), f"{src}: no formula here for {kind} after the first update"
        prev = e
        out.append(list(cur))
    return out, f"{src}: chained from the saved param_groups lr"


def _scheduler_gone(groups: list[dict[str, Any]], where: str) -> str | None:
    """A torch scheduler sets `initial_lr` in every param group when it is constructed: groups that carry it
    with no scheduler state saved beside them belonged to a run whose schedule cannot be continued."""
    if any("initial_lr" in g for g in groups):
        extra = " and max_lr/min_lr (a OneCycleLR)" if any("max_lr" in g for g in groups) else ""
        return (
            f"{where}: the param groups carry initial_lr{extra}, so a scheduler drove this run, but the "
            "checkpoint holds no scheduler state: a resumed run restarts the schedule (or runs without it)"
        )
    return None


def _optimizer_kind(groups: list[dict[str, Any]]) -> str:
    g = groups[0] if groups else {}
    if "betas" in g:
        return "adamw" if g.get("decoupled_weight_decay") else "adam"
    if "momentum" in g or "nesterov" in g:
        return "sgd"
    raise CkptError(
        f"the saved optimizer has param_group fields {sorted(g)}: not Adam, AdamW or SGD",
        hint="model-free resume knows torch Adam, AdamW and SGD",
    )


_HYPER = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "momentum",
    "dampening",
    "nesterov",
    "initial_lr",
    "max_lr",
    "min_lr",
)


def _hyper(g: dict[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in _HYPER}


def _match_groups(
    tensors: list[tuple[str, list[int], str]],
    groups: list[dict[str, Any]],
    state_shapes: dict[int, tuple[int, ...]],
    where: str,
) -> list[list[str]]:
    """Assign the model's parameters to the saved optimizer's groups by position and shape: torch optimizer state
    dicts record ids, not names, so id i gets the first unassigned parameter (in the model file's order) of
    the saved moment's shape. Same-shaped parameters may swap; the load and the closed-form check are the
    same either way."""
    free = list(tensors)
    out: list[list[str]] = []
    for g in groups:
        names = []
        for pid in g.get("params", []):
            shape = state_shapes.get(int(pid))
            pick = next((t for t in free if shape is None or tuple(t[1]) == tuple(shape)), None)
            if pick is None:
                raise CkptError(
                    f"{where}: the saved optimizer's parameter {pid} (shape {shape}) has no parameter "
                    "of that shape in the model file",
                    hint="the model and optimizer files disagree",
                )
            free.remove(pick)
            names.append(pick[0])
        out.append(names)
    return out


# --- planning -------------------------------------------------------------------------------------


def _device(device: str) -> str:
    gpus = _gpus()
    if device == "auto":
        return "cuda" if gpus else "cpu"
    if device not in ("cpu", "cuda"):
        raise CkptError(f"--device {device!r}: use cpu, cuda or auto")
    if device == "cuda" and not gpus:
        raise CkptError("--device cuda: no CUDA device is visible", hint="use --device cpu")
    return device


def framework_of(ck: Checkpoint) -> str | None:
    return FRAMEWORK_OF_FORMAT.get(ck.format)


def plan_resume(
    ck: Checkpoint,
    path: str | os.PathLike,
    *,
    steps: int,
    nproc: int | None = None,
    device: str = "auto",
    model: str = "auto",
    scheduler: str | None = None,
    trust_pickles: bool = False,
    framework_args: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> FrameworkPlan:
    """Decide how to resume `ck` (already opened from `path`) in its framework. Raises CkptError (one line)
    for anything that would make the launch fail."""
    fw = framework_of(ck)
    if fw is None:
        raise UnsupportedCheckpoint(
            f"`ckpt resume` has no framework resume for {ck.format}",
            path=path,
            hint=f"supported: deepspeed, {', '.join(sorted(set(FRAMEWORK_OF_FORMAT)))}",
        )
    if steps < 1:
        raise CkptError("--steps must be at least 1")
    dev = _device(device)
    planner = {
        "hf_trainer": _plan_hf,
        "accelerate": _plan_accelerate,
        "dcp": _plan_dcp,
        "lightning": _plan_lightning,
        "megatron": _plan_megatron,
    }.get(fw)
    if planner is None:
        raise UnsupportedCheckpoint(f"`ckpt resume` of {ck.format} checkpoints is not implemented yet", path=path)
    if fw == "megatron":
        # Megatron-LM loads every rank file and common.pt with torch.load(weights_only=False)
        _check_pickles(ck, Path(path), trust_pickles, "Megatron-LM")
        return _plan_megatron(
            ck, Path(path), steps=steps, nproc=nproc, device=dev, model=model, extra_args=framework_args, tp=tp, pp=pp
        )
    if framework_args:
        raise CkptError(
            f"--megatron-args applies to Megatron-LM checkpoints; this is {ck.format}",
            path=path,
            hint="drop --megatron-args",
        )
    return planner(
        ck,
        Path(path),
        steps=steps,
        nproc=nproc,
        device=dev,
        model=model,
        scheduler=scheduler,
        trust_pickles=trust_pickles,
    )


def _plan_hf(
    ck: Checkpoint,
    path: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    scheduler: str | None,
    trust_pickles: bool,
) -> FrameworkPlan:
    from ..formats import hf_trainer as fmt

    folder = fmt.checkpoint_folder(ck)
    notes: list[str] = []
    if model not in ("auto", "real", "config"):
        raise CkptError(
            f"--model {model!r}: an HF Trainer checkpoint is resumed with the model its config.json describes",
            hint="drop --model",
        )
    if scheduler:
        raise CkptError("--scheduler: the HF schedule is rebuilt from training_args.bin", hint="drop --scheduler")
    if not (folder / "config.json").is_file():
        raise CkptError(
            "no config.json: the model cannot be built without the user's code",
            path=folder,
            hint="HF Trainer checkpoints of a PreTrainedModel carry config.json",
        )
    if "training_args" not in ck.tree.children:
        raise CkptError("no training_args.bin: the Trainer's arguments (schedule, batch size) are unknown", path=folder)
    # the Trainer never unpickles training_args.bin on resume (ckpt read it inert, above); the other files it
    # loads with weights_only, and DeepSpeed's tag folder with torch's full loader
    _check_pickles(ck, path, trust_pickles, "the HF Trainer", never_loaded=("training_args.bin",))
    _hf_model_matches(folder, ck)
    args = _finite(_plain(node_to_python(ck.tree.children["training_args"])))
    if not isinstance(args, dict):
        raise CkptError("training_args.bin does not hold a TrainingArguments", path=folder / "training_args.bin")
    sched = node_to_python(ck.tree.children.get("scheduler", GroupNode())) or {}
    world = ck.details.get("world_size") or ck.topology.dp or 1
    saved = _saved_state(
        ck, sched, global_step=ck.counters.global_step, optimizer_step=ck.counters.optimizer_step, dp=world
    )
    zero_files: list[str] = []
    ds_cfg = args.get("deepspeed")
    if ck.topology.zero_stage is not None:
        tag = (folder / "latest").read_text().strip() if (folder / "latest").is_file() else None
        tag_dir = folder / tag if tag else next(iter(sorted(folder.glob("global_step*"))), None)
        if tag_dir is None:
            raise CkptError("a DeepSpeed checkpoint-N folder without its global_stepN tag folder", path=folder)
        by_rank = {}
        for f in tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"):
            r = int(f.name.split("zero_pp_rank_")[1].split("_")[0])
            by_rank[r] = str(f.relative_to(folder))
        zero_files = [by_rank[r] for r in sorted(by_rank)]
        world = len(zero_files) or world
    n = nproc or world
    if zero_files and n != len(zero_files):
        raise CkptError(
            f"--nproc {n}: the ZeRO checkpoint was saved by {len(zero_files)} ranks and DeepSpeed "
            "refuses to repartition it",
            hint=f"use --nproc {len(zero_files)}",
        )
    if n != world:
        notes.append(f"resumed on {n} processes, saved by {world}: the global batch (and the loss) differ")
    gstep = saved.global_step or 0
    max_steps = args.get("max_steps")
    if isinstance(max_steps, int) and max_steps > 0:
        left = max_steps - gstep
        if left < 1:
            raise CkptError(
                f"the checkpoint is at global_step={gstep} = max_steps: the Trainer would train no update", path=folder
            )
        if steps > left:
            notes.append(f"--steps {steps} cut to {left}: the Trainer stops at max_steps={max_steps}")
            steps = left
    want, how = hf_expected_lrs(args, saved, steps)
    if saved.scheduler_state == "none":
        notes.append(
            "the checkpoint holds no scheduler state: the Trainer then loads neither the scheduler nor "
            "the optimizer (it needs both files)"
        )
    ref, ref_src = _hf_log_reference(folder, range(gstep + 1, gstep + steps + 1))
    return FrameworkPlan(
        framework="hf_trainer",
        path=str(path),
        saved=saved,
        steps=steps,
        device=device,
        nproc=n,
        dp=n,
        model=f"{json.loads((folder / 'config.json').read_text()).get('model_type', '?')} from config.json",
        load_dir=str(folder.resolve()),
        expected_lrs=tuple(tuple(x) for x in want) if want else None,
        lr_source=how,
        loss_reference=ref,
        loss_reference_source=ref_src,
        worker={
            "training_args": args,
            "zero_files": zero_files,
            "opt_state_source": ", ".join(zero_files) if zero_files else "optimizer.pt",
            "ds_config": ds_cfg if isinstance(ds_cfg, dict) else None,
        },
        notes=tuple(notes),
        micro_batch=int(args.get("per_device_train_batch_size") or 1),
        gas=int(args.get("gradient_accumulation_steps") or 1),
    )


def _tensor_specs(node: Any) -> list[tuple[str, list[int], str]]:
    from ..read.tree import TensorNode

    out = []
    for name, t in node.children.items() if isinstance(node, GroupNode) else []:
        if isinstance(t, TensorNode):
            out.append((str(name), list(t.shape), str(t.dtype)))
    return out


def _state_shapes(opt_node: Any) -> dict[int, tuple[int, ...]]:
    from ..read.tree import TensorNode

    shapes: dict[int, tuple[int, ...]] = {}
    state = opt_node.children.get("state") if isinstance(opt_node, GroupNode) else None
    for pid, st in state.children.items() if isinstance(state, GroupNode) else []:
        for key in ("exp_avg", "momentum_buffer", "exp_avg_sq"):
            t = st.children.get(key) if isinstance(st, GroupNode) else None
            if isinstance(t, TensorNode) and str(pid).isdigit():
                shapes[int(pid)] = tuple(t.shape)
                break
    return shapes


def _groups_of(opt_node: Any) -> list[dict[str, Any]]:
    groups = (
        node_to_python(opt_node.children.get("param_groups", GroupNode())) if isinstance(opt_node, GroupNode) else None
    )
    if isinstance(groups, dict):
        return [g for _, g in sorted(groups.items(), key=lambda kv: int(kv[0])) if isinstance(g, dict)]
    return [g for g in (groups or []) if isinstance(g, dict)]


def _check_pickles(
    ck: Checkpoint, path: Path, trust_pickles: bool, who: str, never_loaded: tuple[str, ...] = ()
) -> None:
    """Refuse (unless trusted) a checkpoint whose pickles name globals outside the frameworks' classes, over the
    files the framework's loader will unpickle (`never_loaded`: file names it does not read on resume)."""
    if trust_pickles:
        return
    from ..read import gate

    found = [f for f in gate.scan_checkpoint(ck) if Path(f.file).name not in never_loaded]
    gate.refuse(found, path, action=f"resuming runs {who}'s loader, which would execute it")


def _finite(v: Any) -> Any:
    """JSON-safe copy: DeepSpeed saves `steps_per_print: inf` ("never"); strict JSON has no Infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else (2**31 - 1 if v > 0 else -(2**31 - 1))
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def _installed_accelerate_counts_loosely() -> bool:
    """Whether the installed Accelerate counts every file with `custom_checkpoint` in its name (older versions:
    a stray copy then makes `load_state` skip or refuse the custom objects) rather than `^custom_checkpoint_N.pkl$`."""
    import inspect

    try:
        from accelerate import Accelerator

        src = inspect.getsource(Accelerator.load_state)
    except (ImportError, OSError, TypeError):
        return True
    return "custom_checkpoint_\\d+\\.pkl$" not in src


def _plan_accelerate(
    ck: Checkpoint,
    path: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    scheduler: str | None,
    trust_pickles: bool,
) -> FrameworkPlan:
    import re

    from ..read import pickle_reader
    from ..formats import training_state

    if model not in ("auto", "model-free", "replica"):
        raise CkptError(f"--model {model!r}: Accelerate checkpoints resume model-free here", hint="drop --model")
    folder = Path(ck.path)
    if "fsdp" in str(ck.details.get("engine", "")):
        raise UnsupportedCheckpoint("Accelerate FSDP checkpoints: not resumable model-free yet", path=folder)
    _check_pickles(ck, path, trust_pickles, "Accelerate")
    kids = ck.tree.children
    world = int(ck.details.get("world_size") or ck.topology.dp or 1)
    notes: list[str] = []
    zero = ck.topology.zero_stage is not None
    ds_cfg = _finite(node_to_python(kids["config"])) if zero and "config" in kids else None
    per_update = training_state(ck).scheduler_steps_per_update
    lr_fn = _scheduler_fn(scheduler)

    models: list[dict[str, Any]] = []
    expected_rows: list[list[float | None]] = [[] for _ in range(steps)]
    lr_how: list[str] = []
    gone: str | None = None
    i = 0
    while True:
        suffix = "" if i == 0 else f"_{i}"
        if f"optimizer{suffix}" not in kids and not (i == 0 and zero):
            break
        opt_node = kids.get(f"optimizer{suffix}")
        groups = _groups_of(opt_node)
        if not groups:
            raise CkptError(f"optimizer{suffix}: no param_groups", path=folder)
        specs = _tensor_specs(kids.get(f"model{suffix}"))
        if not specs:
            raise CkptError(f"model{suffix}: no weights to build the replica from", path=folder)
        if zero:
            tag = (folder / "latest").read_text().strip() if (folder / "latest").is_file() else "pytorch_model"
            ms_file = next(iter(sorted((folder / tag).glob("*mp_rank_00_model_states.pt"))), None)
            loaded = pickle_reader.load(ms_file)
            shapes = loaded.obj.get("param_shapes") if isinstance(loaded.obj, dict) else None
            if loaded.source is not None:
                loaded.source.close()
            shapes = [shapes] if isinstance(shapes, dict) else (shapes or [])
            names_by_group = [[str(n) for n in g] for g in shapes]
            by_rank = {}
            for f in (folder / tag).glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"):
                by_rank[int(f.name.split("zero_pp_rank_")[1].split("_")[0])] = str(f.relative_to(folder))
            opt_files = [by_rank[r] for r in sorted(by_rank)]
            # DeepSpeed's engine converts the module to bf16 itself; the replica starts in fp32 as the user's did
            specs = [(n, s, "float32") for n, s, _ in specs]
        else:
            names_by_group = _match_groups(specs, groups, _state_shapes(opt_node), f"optimizer{suffix}")
            opt_files = [f"optimizer{suffix}.bin"]
        if len(names_by_group) != len(groups):
            raise CkptError(
                f"optimizer{suffix}: {len(groups)} param groups but the model layout has {len(names_by_group)}",
                path=folder,
            )
        sched, kind = _saved_scheduler(
            kids,
            f"scheduler{suffix}",
            folder,
            f"scheduler{suffix}: not a torch scheduler state this resume can rebuild",
        )
        if not sched:
            gone = gone or _scheduler_gone(groups, f"optimizer{suffix}")
        rows, how = torch_expected_lrs(
            sched or None, groups, steps, per_update=per_update, lr_fn=lr_fn, fn_name=scheduler
        )
        for k in range(steps):
            if rows[k] is None or expected_rows[k] is None:
                expected_rows[k] = None
            else:
                expected_rows[k] = expected_rows[k] + list(rows[k])
        lr_how.append(f"optimizer{suffix}: {how}")
        models.append(_replica_model(specs, groups, names_by_group, sched, kind, optimizer_files=opt_files))
        i += 1
    if not models:
        raise CkptError("no optimizer state: nothing to resume", path=folder)
    strict = [f.name for f in folder.iterdir() if re.match(r"^custom_checkpoint_\d+\.pkl$", f.name)]
    loose = [f.name for f in folder.iterdir() if "custom_checkpoint" in f.name and f.name not in strict]
    custom_saved = node_to_python(kids.get("client_state", GroupNode())) or {}
    stray_effect = None
    if loose:
        if _installed_accelerate_counts_loosely():
            stray_effect = "fail"
            notes.append(
                f"stray {', '.join(loose)}: the installed Accelerate counts it as a custom checkpoint, so "
                "load_state will not restore the registered objects; move it out of the folder"
            )
        else:
            stray_effect = "warn"
            notes.append(
                f"stray {', '.join(loose)} in the checkpoint folder: this Accelerate ignores it, but "
                "versions that count any 'custom_checkpoint' file would skip the custom state; move it out"
            )
    n = nproc or world
    if zero and n != world:
        raise CkptError(
            f"--nproc {n}: the ZeRO checkpoint was saved by {world} ranks and DeepSpeed refuses to repartition it",
            hint=f"use --nproc {world}",
        )
    if n != world:
        notes.append(
            f"resumed on {n} processes, saved by {world}: Accelerate steps the scheduler once per "
            f"process, so the schedule advances {n} (not {world}) epochs per update"
        )
        per_update = n
    sched0 = node_to_python(kids.get("scheduler", GroupNode())) or {}
    saved = _saved_state(
        ck, sched0, global_step=ck.counters.global_step, optimizer_step=ck.counters.optimizer_step, dp=world
    )
    want = None if all(r is None for r in expected_rows) else expected_rows
    return FrameworkPlan(
        framework="accelerate",
        path=str(path),
        saved=saved,
        steps=steps,
        device=device,
        nproc=n,
        dp=n,
        model="model-free replica (synthetic loss)",
        load_dir=str(folder.resolve()),
        expected_lrs=tuple(None if r is None else tuple(r) for r in want) if want else None,
        lr_source="; ".join(lr_how),
        notes=tuple(notes),
        lr_missing=gone,
        worker={
            "models": models,
            "ds_config": ds_cfg,
            "custom_objects": len(strict),
            "custom_saved": {k: custom_saved.get(k) for k in sorted(custom_saved)},
            "stray_custom": loose,
            "stray_effect": stray_effect,
            "scheduler_fn": scheduler,
            "global_step": ck.counters.global_step
            if ck.counters.global_step is not None
            else ck.counters.optimizer_step,
            "opt_state_source": ", ".join(f for m in models for f in m["optimizer_files"]),
        },
        micro_batch=1,
        gas=1,
    )


def _specs_and_groups(
    ck: Checkpoint,
    path: Path,
    trust_pickles: bool,
    who: str,
    at: Path,
    *,
    weights: str,
    optimizer: str,
    hint: str | None = None,
) -> tuple[list, list[dict[str, Any]]]:
    """What a model-free replica is built from, after the pickle check: the saved weights' (name, shape,
    dtype) and the optimizer's param groups; a CkptError naming `at` when either is missing."""
    _check_pickles(ck, path, trust_pickles, who)
    specs = _tensor_specs(ck.tree.children.get("model"))
    if not specs:
        raise CkptError(f"no {weights}: the replica needs the parameter shapes", path=at)
    groups = _groups_of(ck.optimizer)
    if not groups:
        raise CkptError(f"no {optimizer}: nothing to resume", path=at, hint=hint)
    return specs, groups


def _saved_scheduler(kids: dict[str, Any], key: str, at: Path, not_torch: str) -> tuple[dict[str, Any], str | None]:
    """The saved scheduler state under `key` ({} when there is none) and its torch scheduler kind; a
    CkptError (`not_torch`) when it is not a torch scheduler this resume can rebuild."""
    sched = node_to_python(kids.get(key, GroupNode())) or {}
    kind = torch_scheduler_kind(sched) if sched else None
    if sched and kind is None and set(map(str, sched)) == {"last_epoch"}:
        raise CkptError(
            "the scheduler state holds only last_epoch (torchtitan's LRSchedulersContainer): the "
            "schedule itself is in the job config, which the checkpoint does not hold",
            path=at,
            hint="resume it in torchtitan with its job config (--checkpoint.load-step)",
        )
    if sched and kind is None:
        raise CkptError(not_torch, path=at)
    return sched, kind


def _replica_model(
    specs: list,
    groups: list[dict[str, Any]],
    names_by_group: list[list[str]],
    sched: dict[str, Any],
    kind: str | None,
    **more: Any,
) -> dict[str, Any]:
    """One model of the replica worker's plan: parameters, optimizer groups by name, saved scheduler."""
    return {
        "params": specs,
        "optimizer_kind": _optimizer_kind(groups),
        "groups": [{"names": nm, "hyper": _hyper(g)} for nm, g in zip(names_by_group, groups)],
        "scheduler_kind": kind,
        "scheduler_state": sched or None,
        **more,
    }


def _expected_lrs(rows: list) -> tuple[tuple[float, ...] | None, ...] | None:
    """Per-update expected LRs as the plan keeps them: None when no update's LRs are determined."""
    return tuple(None if r is None else tuple(r) for r in rows) if any(r is not None for r in rows) else None


def _plan_dcp(
    ck: Checkpoint,
    path: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    scheduler: str | None,
    trust_pickles: bool,
) -> FrameworkPlan:
    if model not in ("auto", "model-free", "replica"):
        raise CkptError(f"--model {model!r}: DCP checkpoints resume model-free here", hint="drop --model")
    folder = Path(ck.path)
    if not folder.is_dir() or not (folder / ".metadata").is_file():
        raise CkptError("not a DCP folder with .metadata", path=folder)
    specs, groups = _specs_and_groups(
        ck,
        path,
        trust_pickles,
        "torch DCP",
        folder,
        weights="model weights in the DCP checkpoint",
        optimizer="optimizer param_groups in the DCP checkpoint",
    )
    specs, fused = _fused_specs(specs, ck)
    known = {n for n, _, _ in specs}
    names_by_group = []
    for i, g in enumerate(groups):
        names = [str(n) for n in g.get("params") or []]
        missing = [n for n in names if n not in known]
        if not names or missing:
            raise CkptError(
                f"optimizer param group {i} lists {missing[:3] or 'no'} parameters the model does not have",
                path=folder,
                hint="the checkpoint's model and optimizer disagree",
            )
        names_by_group.append(names)
    position_only = node_to_python(ck.tree.children.get("scheduler", GroupNode())) or {}
    if set(map(str, position_only)) == {"last_epoch"}:
        # torchtitan's LRSchedulersContainer: only the position is saved; the schedule comes back from the job
        # config, while the saved per-parameter lr drives the first resumed update (measured,
        # docs/torchtitan-torchtune.md)
        sched, kind = {}, None
        rows: list = [[float(g["lr"]) for g in groups]] + [None] * (steps - 1)
        how = (
            "the saved param groups' lr for the first update (the scheduler state holds only last_epoch = "
            f"{position_only['last_epoch']}: the producer, torchtitan, rebuilds the schedule from its job config, "
            "which the checkpoint does not hold)"
        )
    else:
        position_only = {}
        sched, kind = _saved_scheduler(
            ck.tree.children,
            "scheduler",
            folder,
            "the scheduler state is not a torch scheduler this resume can rebuild",
        )
        lr_fn = _scheduler_fn(scheduler)
        rows, how = torch_expected_lrs(sched or None, groups, steps, per_update=1, lr_fn=lr_fn, fn_name=scheduler)
    world = ck.topology.dp or 1
    n = nproc or world
    notes = []
    if n != world:
        notes.append(f"resharded by dcp.load: saved by {world} ranks, resumed on {n}")
    if fused:
        notes.append(
            f"{len(fused)} fused parameter(s) ({next(iter(fused))}, …) loaded from their split weights in "
            "the row order --n-kv-heads gives (as torchtitan's FusedQKVLinear merges them)"
        )
    saved = _saved_state(
        ck,
        sched or position_only,
        global_step=ck.counters.global_step,
        optimizer_step=ck.counters.optimizer_step,
        dp=world,
    )
    spec = _replica_model(
        specs, groups, names_by_group, sched, kind, fused=fused, scheduler_position_only=bool(position_only)
    )
    return FrameworkPlan(
        framework="dcp",
        path=str(path),
        saved=saved,
        steps=steps,
        device=device,
        nproc=n,
        dp=n,
        model="model-free FSDP2 replica (synthetic loss)",
        load_dir=str(folder.resolve()),
        expected_lrs=_expected_lrs(rows),
        lr_source=how,
        notes=tuple(notes),
        lr_missing=None if sched or position_only else _scheduler_gone(groups, "optim"),
        worker={
            "models": [spec],
            "scheduler_fn": scheduler,
            "opt_state_source": "the DCP optimizer state (ckpt's reader)",
        },
    )


#: Megatron flags that reshape the LR schedule (with --override-opt_param-scheduler they replace the saved one)
SCHEDULE_FLAGS = frozenset(
    (
        "--lr",
        "--min-lr",
        "--lr-decay-style",
        "--lr-decay-iters",
        "--lr-decay-samples",
        "--lr-warmup-iters",
        "--lr-warmup-samples",
        "--lr-warmup-fraction",
        "--lr-warmup-init",
        "--train-iters",
        "--train-samples",
        "--lr-wsd-decay-style",
        "--lr-wsd-decay-iters",
        "--lr-wsd-decay-samples",
        "--global-batch-size",
    )
)


def _plan_megatron(
    ck: Checkpoint,
    path: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    extra_args: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> FrameworkPlan:
    """Megatron-LM's own pretrain rebuilt from the checkpoint's `args` (`resume.workers.megatron`), at the saved TP
    and PP
    (DP: `--nproc` / (TP x PP)); the LR each resumed iteration must use from Megatron's schedule formula
    (`megatron_schedule`) on the saved scheduler state, param groups and args."""
    from ..schedules.megatron import expected_lrs

    if model not in ("auto", "real"):
        raise CkptError(
            f"--model {model!r}: a Megatron-LM checkpoint resumes with the model its args describe", hint="drop --model"
        )
    args = _plain(node_to_python(ck.tree.children.get("args", GroupNode())) or {})
    sched = _plain(node_to_python(ck.tree.children.get("scheduler", GroupNode())) or {})
    raw = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) if ck.optimizer else None
    groups = [raw[k] for k in sorted(raw, key=int)] if isinstance(raw, dict) else list(raw or [])
    if not args:
        raise CkptError(
            "the checkpoint holds no Megatron `args`: the model and the run cannot be rebuilt from it", path=path
        )
    saved_sizes = (ck.topology.tp or 1, ck.topology.pp or 1)
    if args.get("num_experts") and (tp or saved_sizes[0], pp or saved_sizes[1]) != saved_sizes:
        # not run yet: the experts would be re-cut over another expert-TP / pipeline layout at load
        raise UnsupportedCheckpoint(
            f"a Megatron Mixture-of-Experts checkpoint resumed at another TP / PP (saved TP {saved_sizes[0]} x PP "
            f"{saved_sizes[1]}; asked --tp {tp}, --pp {pp}): `ckpt resume` relaunches MoE runs at their saved sizes "
            "only",
            path=path,
            hint="drop --tp / --pp",
        )
    if args.get("use_distributed_optimizer"):
        # measured with core_v0.16.1: without Apex / TransformerEngine (none on a CPU) the distributed optimizer's
        # load reads an Adam `step` the fresh torch optimizer does not have yet (legacy: KeyError 'step' in
        # _set_main_param_and_optimizer_states; torch_dist: `assert len(steps) == 1` in state_dict)
        raise UnsupportedCheckpoint(
            "a Megatron-LM checkpoint of the distributed optimizer: Megatron-LM's loader "
            "without Apex or TransformerEngine reads an Adam step the fresh optimizer does "
            "not hold yet, and ckpt's resume has not been run with either",
            path=path,
            hint="inspect / diff / export / convert it with ckpt; resume it with "
            "Megatron-LM's own launch where Apex or TransformerEngine is "
            "installed",
        )
    root = os.environ.get("MEGATRON_LM_DIR")
    if not root or not (Path(root) / "pretrain_gpt.py").is_file():
        raise CkptError(
            "resuming a Megatron-LM checkpoint runs Megatron-LM's own pretrain_gpt.py, which is not in "
            "the megatron-core wheel",
            path=path,
            hint="set MEGATRON_LM_DIR to a checkout of the Megatron-LM release that wrote it "
            "(e.g. git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM)",
        )
    saved_tp, saved_pp, dp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.dp or 1
    tp, pp = tp or saved_tp, pp or saved_pp
    n = nproc or tp * pp * dp
    if n % (tp * pp):
        raise CkptError(f"--nproc {n} is not a multiple of TP x PP = {tp * pp}", path=path)
    if device == "cuda" and n > _gpus():
        raise CkptError(
            f"{n} processes (TP {tp} x PP {pp} x DP {n // (tp * pp)}) need {n} GPUs; {_gpus()} "
            "visible (NCCL takes one GPU per process)",
            path=path,
            hint="resume at a smaller size (--tp / --pp / --nproc) or on the CPU (--device cpu)",
        )
    iteration = ck.counters.global_step
    if iteration is None:
        raise CkptError("the checkpoint records no iteration", path=path)
    import shlex

    user = shlex.split(extra_args or "")
    reshaped = sorted(f for f in user if f.split("=", 1)[0] in SCHEDULE_FLAGS)
    if "--override-opt_param-scheduler" in user and reshaped:
        rows, how = (
            None,
            (
                f"your --override-opt_param-scheduler with {', '.join(reshaped)}: the command line's "
                "schedule replaces the saved one, which ckpt does not model"
            ),
        )
    else:
        try:
            rows, how = expected_lrs(sched, groups, args, steps)
        except ValueError as e:
            rows, how = None, str(e)
    # how long it runs: Megatron asserts that the launch's schedule (train_iters / train_samples enter the weight
    # decay schedule) equals the saved one, so the saved length is kept and --exit-interval stops the run after
    # `steps` iterations; a run that had reached its end is extended, with the saved schedule taken as saved
    end = iteration + steps
    gbs = args.get("global_batch_size") or 0
    if args.get("train_samples"):
        if (args.get("consumed_train_samples") or 0) + steps * gbs > args["train_samples"]:
            raise CkptError(
                f"the run's train_samples {args['train_samples']} end before {steps} more iterations",
                path=path,
                hint="pass fewer --steps",
            )
        run = ["--train-samples", str(args["train_samples"]), "--exit-interval", str(end)]
        length = f"the saved train_samples {args['train_samples']}, stopped by --exit-interval {end}"
    elif args.get("train_iters") and end <= args["train_iters"]:
        run = ["--train-iters", str(args["train_iters"]), "--exit-interval", str(end)]
        length = f"the saved train_iters {args['train_iters']}, stopped by --exit-interval {end}"
    elif "--use-checkpoint-opt_param-scheduler" in user or "--override-opt_param-scheduler" in user:
        run = ["--train-iters", str(end)]
        length = f"the run had reached its train_iters {args.get('train_iters')}: extended to {end}"
    else:
        run = ["--train-iters", str(end), "--use-checkpoint-opt_param-scheduler"]
        length = (
            f"the run had reached its train_iters {args.get('train_iters')}: extended to {end} with "
            "--use-checkpoint-opt_param-scheduler (the schedule as saved)"
        )
    notes = [
        f"Megatron-LM from {root}, rebuilt from the checkpoint's {len(args)} saved args (the parser's "
        f"options whose saved value is not the default), at TP {tp}, PP {pp}, DP {n // (tp * pp)}",
        "CPU run-time changes: CUDA redirected to the CPU, gloo, the local transformer implementation and no "
        "fused kernels (the same maths in eager PyTorch)"
        if device == "cpu"
        else "on CUDA: NCCL, one GPU per process, the saved flags as they are",
    ]
    notes.append(f"length: {length}")
    if (tp, pp) != (saved_tp, saved_pp):
        notes.append(
            f"saved at TP {saved_tp} x PP {saved_pp}, resumed at TP {tp} x PP {pp}: Megatron's "
            "dist-checkpointing reshards the torch_dist checkpoint at load"
        )
    if n // (tp * pp) != dp:
        notes.append(f"saved at DP {dp}, resumed at DP {n // (tp * pp)}")
    if ck.format == "megatron_legacy" and not {"--no-load-rng", "--finetune"} & set(user) and not _legacy_has_rng(ck):
        # Megatron's legacy load asks for the RNG state unless told not to, and calls sys.exit() without it
        run.append("--no-load-rng")
        notes.append(
            "RNG: the rank files hold no rng_state: relaunched with --no-load-rng (Megatron's legacy "
            "load exits without it), so the generators are seeded afresh"
        )
    if device == "cuda" and not {"--no-load-rng", "--finetune"} & set(run + user) and _rng_not_cuda(ck):
        # measured on an H100: Megatron's load hands the saved `cuda_rng_state` to torch.cuda.set_rng_state
        run.append("--no-load-rng")
        notes.append(
            "RNG: the saved CUDA generator states are not CUDA's (saved by a run on the CPU, whose "
            "generator state is 5056 bytes; CUDA's is 16): relaunched with --no-load-rng, so the "
            "generators are seeded afresh"
        )
    if args.get("mock_data"):
        notes.append("the run's data: Megatron's mock dataset, as saved")
    elif args.get("data_path"):
        notes.append(f"the run's data from the saved data_path {args['data_path']}")
    saved = SavedState(
        format=ck.format,
        global_step=iteration,
        optimizer_step=ck.counters.optimizer_step,
        skipped_steps=None,
        param_group_lrs=tuple(ck.lr.param_groups),
        initial_lrs=None,
        scheduler_state="megatron",
        scheduler_position=sched.get("num_steps"),
        base_lrs=None,
        loss=None,
        loss_key=None,
        ds_config={},
        has_universal_info=False,
        dp=dp,
        tp=saved_tp,
        pp=saved_pp,
    )
    return FrameworkPlan(
        framework="megatron",
        path=str(path),
        saved=saved,
        steps=steps,
        device=device,
        nproc=n,
        dp=n // (tp * pp),
        model="real (Megatron-LM GPT from the saved args)",
        load_dir=str(Path(ck.path).resolve()),
        expected_lrs=_expected_lrs(rows) if rows else None,
        lr_source=how,
        notes=tuple(notes),
        tp=tp,
        pp=pp,
        worker={
            "saved_args": args,
            "iteration": iteration,
            "tp": tp,
            "pp": pp,
            "run_argv": run,
            "extra_args": extra_args or "",
            "legacy": ck.format == "megatron_legacy",
            "opt_state_source": "each rank's model_optim_rng.pt (ckpt's reader)",
            "no_opt_check": "loaded by Megatron's own load_checkpoint; checked in closed form for "
            "a legacy checkpoint resumed at its saved TP / PP only (the Adam step "
            "continuing is checked above)",
        },
    )


def _rng_not_cuda(ck: Checkpoint) -> bool:
    """Whether a saved `cuda_rng_state` (a legacy rank file's `rng_state`, a torch_dist `rng_state/*` item, the RNG
    tracker's states included) is not a CUDA generator state (16 bytes: seed and offset), read without unpickling."""
    from ..read import pickle_reader as pr
    from ..write.megatron_write import rank_files

    def odd(x: Any, cuda: bool = False) -> bool:  # cuda: under `cuda_rng_state` or the tracker's states
        if isinstance(x, pr.TensorRef):
            return cuda and tuple(x.shape) != (16,)
        if isinstance(x, dict):
            return any(odd(v, cuda or k in ("cuda_rng_state", "rng_tracker_states")) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return any(odd(v, cuda) for v in x)
        return False

    if ck.format == "megatron_legacy":
        return any(odd(pr.load(f).obj.get("rng_state")) for f in rank_files(ck).values())
    from ..formats.dcp import DcpItems
    from ..write.megatron_write import _dist_iter

    items = DcpItems(_dist_iter(ck))
    return any(
        odd(items.value(key)) for key in items.sdm if key.split("/", 1)[0] == "rng_state" and (key, None) in items.items
    )


def _gpus() -> int:
    """The CUDA devices this process sees (0 without CUDA); the DeepSpeed planner asks the same."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _legacy_has_rng(ck: Checkpoint) -> bool:
    """Whether every rank file of a Megatron legacy checkpoint holds an `rng_state` (read without unpickling)."""
    from ..read import pickle_reader as pr
    from ..write.megatron_write import rank_files

    return all(pr.load(f).obj.get("rng_state") is not None for f in rank_files(ck).values())


def _fused_specs(specs: list, ck: Checkpoint) -> tuple[list, dict[str, dict[str, list[int]]]]:
    """The replica's parameters where the checkpoint holds a fused parameter saved split (`logical.with_kv_heads`
    gave its row order): one fused parameter in place of its split weights, which the worker loads and puts at
    their fused rows, as the producer's load hook does; {fused: {split name: its rows in the fused one}}."""
    by = {n: (shape, dtype) for n, shape, dtype in specs}
    out = list(specs)
    fused: dict[str, dict[str, list[int]]] = {}
    for name, parts in ck.state_split.items():
        first = next(iter(parts))
        at = next(i for i, (n, _, _) in enumerate(out) if n == first)
        out = [x for x in out if x[0] not in parts]
        out.insert(at, (name, [sum(len(r) for r in parts.values()), *by[first][0][1:]], by[first][1]))
        fused[name] = {part: list(rows) for part, rows in parts.items()}
    return out, fused


def _plan_lightning(
    ck: Checkpoint,
    path: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    scheduler: str | None,
    trust_pickles: bool,
) -> FrameworkPlan:
    if model not in ("auto", "model-free", "replica"):
        raise CkptError(f"--model {model!r}: Lightning checkpoints resume model-free here", hint="drop --model")
    if nproc not in (None, 1):
        raise CkptError(f"--nproc {nproc}: the Lightning resume runs one process", hint="drop --nproc")
    specs, groups = _specs_and_groups(
        ck,
        path,
        trust_pickles,
        "Lightning",
        path,
        weights="state_dict weights in the .ckpt",
        optimizer="optimizer_states in the .ckpt",
        hint="a checkpoint saved with save_weights_only=True has no training state",
    )
    known = {n for n, _, _ in specs}
    if all(g.get("param_names") for g in groups) and all(n in known for g in groups for n in g["param_names"]):
        names_by_group = [[str(n) for n in g["param_names"]] for g in groups]
        how_groups = "param_names"
    else:
        names_by_group = _match_groups(specs, groups, _state_shapes(ck.optimizer), "optimizer_states[0]")
        how_groups = "shapes"
    sched, kind = _saved_scheduler(
        ck.tree.children, "scheduler", path, "lr_schedulers[0] is not a torch scheduler state this resume can rebuild"
    )
    gstep = ck.counters.global_step
    notes = [f"optimizer groups from the saved {how_groups}"]
    interval = "step"
    if sched and gstep is not None and int(sched["last_epoch"]) != gstep:
        interval = "epoch"
        notes.append(
            f"scheduler last_epoch={sched['last_epoch']} != global_step={gstep}: stepped per epoch; the "
            "LRs of the resumed updates stay the saved ones until the epoch ends"
        )
    if kind == "OneCycleLR":
        left = int(sched["total_steps"]) - int(sched["last_epoch"]) - 1
        if steps > left:
            if left < 1:
                raise CkptError(
                    f"OneCycleLR is at its last step ({sched['last_epoch']} of total_steps "
                    f"{sched['total_steps']}): one more update would make it raise",
                    path=path,
                )
            notes.append(f"--steps {steps} cut to {left}: OneCycleLR raises past total_steps={sched['total_steps']}")
            steps = left
    lr_fn = _scheduler_fn(scheduler)
    if interval == "epoch":
        rows = [[float(g["lr"]) for g in groups] for _ in range(steps)]
        how = "per-epoch scheduler: the saved param_groups lr for every update of this epoch"
    else:
        rows, how = torch_expected_lrs(sched or None, groups, steps, per_update=1, lr_fn=lr_fn, fn_name=scheduler)
    saved = _saved_state(ck, sched, global_step=gstep, optimizer_step=ck.counters.optimizer_step, dp=1)
    spec = _replica_model(specs, groups, names_by_group, sched, kind)
    return FrameworkPlan(
        framework="lightning",
        path=str(path),
        saved=saved,
        steps=steps,
        device=device,
        nproc=1,
        dp=1,
        model="model-free LightningModule (synthetic loss)",
        load_dir=str(Path(ck.path).resolve()),
        expected_lrs=_expected_lrs(rows),
        lr_source=how,
        notes=tuple(notes),
        lr_missing=None if sched else _scheduler_gone(groups, "optimizer_states[0]"),
        worker={
            "models": [spec],
            "scheduler_fn": scheduler,
            "interval": interval,
            "global_step": gstep,
            "opt_state_source": "optimizer_states[0]",
        },
    )


def _scheduler_fn(spec: str | None) -> Callable[[int], float] | None:
    if not spec:
        return None
    import importlib

    module, _, func = spec.partition(":")
    if not module or not func:
        raise CkptError(f"--scheduler {spec!r}: use module:function (the LambdaLR's lr_lambda)")
    try:
        return getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        raise CkptError(f"--scheduler {spec!r}: {e}") from None


def _hf_model_matches(folder: Path, ck: Checkpoint) -> None:
    """Build the config.json model on the meta device (no memory, no download) and compare its parameters with
    the saved weights, so that a model that cannot load is refused before any process starts."""

    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with meta_device():
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001 - transformers raises ValueError/KeyError/OSError for a bad config
        raise CkptError(
            f"config.json: transformers cannot build a causal-LM model from it ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})",
            path=folder / "config.json",
        ) from None
    want = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied weights appear once
    sd_keys = set(model.state_dict())
    have = {n: tuple(s) for n, s, _ in _tensor_specs(ck.model)}
    if not have:
        return  # weights elsewhere (an FSDP folder): the Trainer's own load decides
    # the checkpoint's names that are the model's state-dict entries but not parameters (tied aliases, buffers)
    # are no mismatch
    parts = mismatch(want, {n: have[n] for n in have if n in want or n not in sd_keys})
    if parts:
        raise CkptError(
            f"the config.json model has {len(want)} parameters, the checkpoint {len(have)}: {'; '.join(parts)}",
            path=folder,
            hint="config.json and the saved weights disagree: restore the run's config.json",
        )


def _hf_log_reference(folder: Path, steps: range) -> tuple[dict[int, float], str]:
    """step -> logged loss for the resumed steps, from this folder's trainer_state.json and those of the later
    checkpoint-M folders beside it (the uninterrupted run kept logging)."""
    from ..formats import hf_trainer as fmt

    folders = [folder]
    if fmt._CKPT_RE.match(folder.name) and folder.parent.is_dir():
        folders += [d for d in fmt.checkpoints(folder.parent) if d != folder]
    out: dict[int, float] = {}
    used: list[str] = []
    for d in folders:
        try:
            log = json.loads((d / fmt.STATE_FILE).read_text()).get("log_history") or []
        except (OSError, ValueError):
            continue
        hit = False
        for e in log:
            if isinstance(e, dict) and e.get("step") in steps and isinstance(e.get("loss"), (int, float)):
                out.setdefault(int(e["step"]), float(e["loss"]))
                hit = True
        if hit:
            used.append(d.name)
    return out, ", ".join(used)


# --- launching ------------------------------------------------------------------------------------


def _launch(
    plan: FrameworkPlan, plan_file: Path, on_event: Callable[[dict], None] | None, timeout: float
) -> list[dict[str, Any]]:
    """The framework's worker under torchrun, launched, logged and reported as `ckpt_tools.resume.deepspeed` does
    for DeepSpeed (one launcher for every framework)."""
    from ..train.processes import launch

    return launch(plan, plan_file, on_event, timeout, module=WORKERS[plan.framework])


# --- the verdict ----------------------------------------------------------------------------------


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_REL_TOL, abs_tol=1e-12)


def verdict(
    plan: FrameworkPlan,
    loaded: dict[str, Any],
    events: list[dict[str, Any]],
    records: list[StepRecord],
    *,
    loss_tol: float = LOSS_TOL,
) -> list[Check]:
    s = plan.saved
    checks: list[Check] = []
    if s.global_step is None:
        checks.append(Check("global step", "n/a", "the checkpoint records no global step"))
    else:
        rows = tuple(
            CheckRow(r.step, s.global_step + i + 1, r.step, r.step == s.global_step + i + 1)
            for i, r in enumerate(records)
        )
        ok = all(r.ok for r in rows) and bool(rows)
        checks.append(
            Check(
                "global step",
                "pass" if ok else "fail",
                f"continues from the saved global step {s.global_step}"
                if ok
                else f"does not continue from the saved global step {s.global_step}",
                rows,
            )
        )
    base, src = s.optimizer_step, f"the saved Adam step {s.optimizer_step}"
    if base is None and s.global_step is not None:
        base, src = (
            s.global_step,
            (f"global step {s.global_step} (the checkpoint holds no Adam step; one update per step)"),
        )
    if base is None:
        checks.append(Check("optimizer step", "n/a", "the checkpoint records no Adam step"))
    else:
        rows = tuple(
            CheckRow(r.step, base + i + 1, r.optimizer_step, r.optimizer_step == base + i + 1)
            for i, r in enumerate(records)
        )
        ok = all(r.ok for r in rows) and bool(rows)
        checks.append(
            Check(
                "optimizer step",
                "pass" if ok else "fail",
                f"Adam step continues from {src}"
                if ok
                else f"Adam step does not continue from {src} (optimizer state not loaded?)",
                rows,
            )
        )

    if plan.lr_missing:
        checks.append(Check("learning rate", "fail", plan.lr_missing))
    elif plan.expected_lrs is None:
        checks.append(Check("learning rate", "n/a", plan.lr_source))
    else:
        rows = tuple(
            CheckRow(r.step, list(w), list(r.lr), len(w) == len(r.lr) and all(_close(a, b) for a, b in zip(w, r.lr)))
            for w, r in zip(plan.expected_lrs, records)
            if w is not None
        )
        ok = all(r.ok for r in rows) and bool(rows)
        bad = next((r for r in rows if not r.ok), None)
        unchecked = sum(1 for w in plan.expected_lrs[: len(records)] if w is None)
        more = f"; {unchecked} later update(s) not determined by the checkpoint" if unchecked else ""
        detail = (
            f"expected: {plan.lr_source}"
            if ok
            else f"step {bad.step}: expected {bad.expected}, the resumed run used {bad.actual} "
            f"(expected: {plan.lr_source})"
            if bad
            else "no resumed update to compare"
        )
        checks.append(Check("learning rate", "pass" if ok else "fail", detail + more, rows))
    if plan.framework in ("accelerate", "lightning", "dcp"):
        checks.append(_scheduler_loaded(plan, loaded))
    if plan.framework == "megatron":
        differ = loaded.get("args_differ")
        if differ is None:
            checks.append(Check("run rebuilt", "n/a", "the worker did not report the relaunched args"))
        else:
            import shlex

            asked = {
                f.split("=", 1)[0][2:].replace("-", "_")
                for f in shlex.split(str(plan.worker.get("extra_args") or ""))
                if f.startswith("--")
            }
            if plan.nproc != (plan.worker.get("saved_args") or {}).get("world_size"):
                asked |= {"world_size", "data_parallel_size"}  # resumed on another number of ranks, as asked
            bad = [d for d in differ if d[0] not in asked]
            if bad:
                detail = f"{len(bad)} saved arg(s) came back with another value: " + "; ".join(
                    f"{k}: saved {a!r}, now {b!r}" for k, a, b in bad[:4]
                )
            else:
                detail = (
                    f"the relaunched run holds every saved arg ({len(plan.worker.get('saved_args') or {})}), "
                    f"counters, paths and the CPU run-time flags aside"
                    + (f"; {len(differ)} changed as asked" if differ else "")
                )
            checks.append(
                Check(
                    "run rebuilt",
                    "fail" if bad else "pass",
                    detail,
                    tuple(CheckRow(s.global_step or 0, a, b, False) for _, a, b in bad[:8]),
                )
            )
        live, want = loaded.get("scheduler_position"), s.scheduler_position
        ok = live is not None and live == want
        checks.append(
            Check(
                "scheduler state",
                "pass" if ok else "fail",
                f"OptimizerParamScheduler loaded at num_steps={live}, saved {want}"
                + ("" if ok else " (the saved scheduler was not loaded)"),
                (CheckRow(s.global_step or 0, want, live, ok),),
            )
        )
    if plan.framework == "accelerate" and (plan.worker.get("custom_objects") or plan.worker.get("stray_custom")):
        checks.append(_custom_state(plan, loaded))

    checks.append(_optimizer_check(plan, events))

    if plan.loss_reference:
        # the Trainer logs the loss averaged over processes: compare the resumed run's mean
        rows = tuple(
            CheckRow(
                r.step,
                plan.loss_reference[r.step],
                r.loss_mean,
                abs(plan.loss_reference[r.step] - r.loss_mean) <= loss_tol,
            )
            for r in records
            if r.step in plan.loss_reference
        )
        if rows:
            ok = all(r.ok for r in rows)
            diff = max(abs(r.expected - r.actual) for r in rows)
            # The run's data are not in the checkpoint: the resumed steps train on ckpt's synthetic rows. Equal
            # losses prove the run continued; different ones prove nothing unless the reference was made on the
            # same rows (`--reference`, e.g. an uninterrupted run recorded by ckpt) — so a log_history mismatch
            # is "n/a" with the numbers, never a failed check on a healthy checkpoint of a user's own data.
            strict = plan.loss_reference_source == "--reference"
            status = "pass" if ok else "fail" if strict else "n/a"
            why = (
                ""
                if ok
                else (
                    ": a resume that did not continue"
                    if strict
                    else ": not a verdict — the run's data are not in the checkpoint and the resumed steps "
                    "trained on ckpt's synthetic rows; pass --reference FILE (losses of an "
                    "uninterrupted run on the same rows) to check the loss"
                )
            )
            checks.append(
                Check(
                    "loss",
                    status,
                    f"{len(rows)} steps vs {'' if strict else 'log_history of '}{plan.loss_reference_source}: "
                    f"max |diff| "
                    f"{diff:.3g} (tolerance {loss_tol:g}){why}",
                    rows,
                )
            )
        else:
            checks.append(Check("loss", "n/a", "log_history has none of the resumed steps"))
    elif plan.framework == "hf_trainer":
        checks.append(
            Check(
                "loss",
                "n/a",
                "no trainer_state.json log_history entry for the resumed steps "
                "(resume an earlier checkpoint-N of the output_dir to compare)",
            )
        )
    elif plan.framework == "megatron":
        checks.append(
            Check(
                "loss",
                "n/a",
                "Megatron saves no loss: pass --reference FILE (the losses of the uninterrupted run) to check it",
            )
        )
    else:
        checks.append(Check("loss", "n/a", "model-free resume (synthetic loss): loss continuity needs --model"))
    return checks


def _scheduler_loaded(plan: FrameworkPlan, loaded: dict[str, Any]) -> Check:
    """The scheduler position right after the load equals the saved one (the state was loaded at all)."""
    s = plan.saved
    live = loaded.get("scheduler_position")
    live0 = live[0] if isinstance(live, list) and live else live
    if s.scheduler_state != "torch":
        return Check("scheduler state", "n/a", "the checkpoint holds no torch scheduler state")
    ok = live0 == s.scheduler_position
    return Check(
        "scheduler state",
        "pass" if ok else "fail",
        f"loaded at last_epoch={live0}, saved {s.scheduler_position}"
        + ("" if ok else " (the saved state was ignored)"),
        (CheckRow(s.global_step or 0, s.scheduler_position, live0, ok),),
    )


def _custom_state(plan: FrameworkPlan, loaded: dict[str, Any]) -> Check:
    saved = plan.worker.get("custom_saved") or {}
    live = loaded.get("custom_states") or []
    want = [
        saved[k]
        for k in sorted(saved, key=lambda k: int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit() else 0)
    ]
    rows = tuple(CheckRow(i, w, got, w == got) for i, (w, got) in enumerate(zip(want, live)))
    ok = bool(rows) and all(r.ok for r in rows) and len(live) == len(want)
    stray = plan.worker.get("stray_custom") or []
    effect = plan.worker.get("stray_effect")
    if stray and effect == "fail":
        return Check(
            "custom state",
            "fail",
            f"stray {', '.join(stray)}: the installed Accelerate counts it, so "
            "load_state does not restore the registered objects",
            rows,
        )
    note = (
        f"; WARNING stray {', '.join(stray)} in the folder: ignored by this Accelerate, but older versions "
        "count it and skip the custom state"
        if stray
        else ""
    )
    if ok:
        return Check("custom state", "pass", f"{len(rows)} registered object(s) restored as saved{note}", rows)
    return Check(
        "custom state", "fail", f"registered objects not restored as saved (saved {want}, loaded {live}){note}", rows
    )


def _optimizer_check(plan: FrameworkPlan, events: list[dict[str, Any]]) -> Check:
    steps = [e for e in events if e["event"] == "step"]
    results = [(e["step"], e.get("opt_check")) for e in steps]
    if not results or any(r is None for _, r in results):
        return Check(
            "optimizer state", "n/a", plan.worker.get("no_opt_check") or "the worker reported no optimizer check"
        )
    problem = next((r["problem"] for _, r in results if r.get("problem")), None)
    if problem and "no optimizer state" not in problem and "parameters" not in problem:
        return Check("optimizer state", "n/a", problem)
    rows = []
    worst: dict[str, float] = {}
    for step, r in results:
        errs = {k: v for k, v in r["errors"].items() if v}
        for k, v in r["errors"].items():
            worst[k] = max(worst.get(k, 0.0), v)
        ok = (
            not r.get("problem")
            and not r["any_step_bad"]
            and r["checked"] > 0
            and all(v <= r["tol"] for v in r["errors"].values())
        )
        rows.append(
            CheckRow(step, f"rel err <= {r['tol']:g}", {k: float(f"{v:.3g}") for k, v in errs.items()} or "exact", ok)
        )
    ok = all(r.ok for r in rows)
    kinds = "/".join(sorted({k for _, r in results for k in r.get("kinds", [])})) or "?"
    lr_note = "" if all(r.get("lr_from_plan") for _, r in results) else " (with the LR the run used: no expected LR)"
    where = plan.worker.get("opt_state_source") or "the checkpoint"
    worst_s = ", ".join(f"{k} {v:.2g}" for k, v in worst.items() if k != "momentum_buffer" or v)
    if ok:
        detail = (
            f"{kinds} closed form from the state saved in {where} with each update's gradient{lr_note}: "
            f"max rel err {worst_s}"
        )
    elif problem:
        detail = f"{problem}: the resumed optimizer cannot have continued it"
    else:
        bad_step = any(r["any_step_bad"] for _, r in results)
        detail = (
            f"the resumed optimizer state is not the closed-form update of the state saved in {where} "
            f"({'Adam step differs; ' if bad_step else ''}max rel err {worst_s}): its state was not "
            "loaded, or not the saved one"
        )
    return Check("optimizer state", "pass" if ok else "fail", detail, tuple(rows))


def run_resume(
    plan: FrameworkPlan,
    *,
    on_event: Callable[[dict], None] | None = None,
    keep: str | os.PathLike | bool | None = None,
    reference: dict[int, float] | None = None,
    loss_tol: float = LOSS_TOL,
    timeout: float = 3600,
) -> ResumeResult:
    """Launch the framework's worker, collect its events, judge them.

    `keep`: a folder for the scratch files (the worker plan), kept afterwards (`ckpt resume --work-dir`); True
    keeps a temporary one; None/False: a temporary folder, removed. Never the checkpoint folder.
    `reference`: step -> loss of the uninterrupted run (`--reference`), compared with the resumed losses."""
    with scratch_folder(keep if isinstance(keep, (str, os.PathLike)) else None, keep=keep is True) as scratch:
        plan_file = scratch / "worker_plan.json"
        plan_file.write_text(json.dumps(plan.worker_plan(), indent=1))
        events = _launch(plan, plan_file, on_event, timeout)
    loaded = next((e for e in events if e["event"] == "loaded"), {})
    records = [
        StepRecord(
            step=e["step"],
            loss=float(e["loss"]) if e.get("loss") is not None else float("nan"),
            loss_mean=float(e.get("loss_mean", e.get("loss") or float("nan"))),
            lr=tuple(e["lr"]),
            grad_norm=e.get("grad_norm"),
            optimizer_step=e.get("optimizer_step"),
            tokens_per_s=e.get("tokens_per_s"),
            seconds=float(e.get("seconds", 0.0)),
            skipped_steps=int(e.get("skipped_steps", 0)),
        )
        for e in events
        if e["event"] == "step"
    ]
    if reference is not None:
        plan = replace(plan, loss_reference=dict(reference), loss_reference_source="--reference")
    checks = verdict(plan, loaded, events, records, loss_tol=loss_tol)
    setup = {"framework": plan.framework, "model": plan.model}
    return ResumeResult(plan=plan, setup=setup, loaded=loaded, records=tuple(records), checks=tuple(checks))


__all__ = [
    "plan_resume",
    "run_resume",
    "FrameworkPlan",
    "framework_of",
    "hf_expected_lrs",
    "hf_lambda",
    "verdict",
    "WORKERS",
]
