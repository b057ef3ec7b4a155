"""`ckpt resume`'s one entry: which framework resumes a checkpoint, and that framework's planner and runner.

    plan = plan_resume(path, steps=2, ...)        # reads metadata only; rejects bad option combinations
    result = run_resume(plan, on_event=print)     # converts if needed, launches, checks
    result.ok, result.checks, result.records      # data only: nothing here prints

`plan_resume` opens the checkpoint and hands it to the planner `PLANNERS` names for its framework
(`FRAMEWORK_OF_FORMAT`): DeepSpeed (`resume.deepspeed`, run by `resume.deepspeed_run`) or one of the frameworks
resumed in the code that wrote them (`resume.hf_trainer`, `accelerate`, `dcp`, `lightning`, `megatron`, run by
`resume.framework_run`). The DeepSpeed-only options (--universal, --tp, --pp, --config, --data, --against) are
refused for the others, naming the option; --megatron-args for all but Megatron-LM.

Each framework's resume runs its framework under `python -m torch.distributed.run` (gloo on CPU, NCCL on CUDA)
and is judged with the same rows (`verdict`): global step, optimizer step, learning rate (what the SAVED schedule
prescribes, computed here, never asked of the framework's scheduler), optimizer state (model-free: the
closed-form update of the saved state), loss. Nothing here prints; a bad input is a `CkptError` before anything
starts, and a failing training process is a `WorkerFailed` whose message is that process's own last error line.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError, UnsupportedCheckpoint
from ..read.qkv import find_fused
from ..read.tree import Checkpoint
from ..view.checkpoint import open_checkpoint
from ..view.logical import with_kv_heads
from .accelerate import installed_accelerate_counts_loosely as _installed_accelerate_counts_loosely
from .accelerate import plan_accelerate
from .common import FrameworkPlan, PlannerOptions, ResumeOptions, _check_pickles, _device
from .dcp import plan_dcp
from .deepspeed import SUPPORTED_FORMATS, ResumePlan, plan_deepspeed
from .deepspeed_run import load_reference, reference_doc, run_deepspeed
from .framework_run import run_framework
from .hf_trainer import plan_hf_trainer
from .lightning import plan_lightning
from .megatron import plan_megatron
from .verdict import ResumeResult


#: checkpoint format -> the framework that resumes it
FRAMEWORK_OF_FORMAT = {
    **dict.fromkeys(SUPPORTED_FORMATS, "deepspeed"),
    "hf_trainer": "hf_trainer",
    "accelerate": "accelerate",
    "dcp": "dcp",
    "lightning": "lightning",
    "megatron_legacy": "megatron",
    "megatron_torch_dist": "megatron",
}

Planner = Callable[[Checkpoint, Path, ResumeOptions], Any]


def framework_of(ck: Checkpoint) -> str | None:
    """The framework that resumes `ck` (None: none does)."""
    return FRAMEWORK_OF_FORMAT.get(ck.format)


def plan_resume(
    checkpoint: str | os.PathLike | Checkpoint,
    path: str | os.PathLike | None = None,
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
) -> ResumePlan | FrameworkPlan:
    """Decide how to resume the checkpoint at `checkpoint` (a path, or a `Checkpoint` already opened from `path`):
    validate, choose the framework's planner (`PLANNERS`), which plans world size, topology, model and what to
    launch. Bad combinations are rejected here, naming the option, before anything is converted or launched."""
    o = ResumeOptions(
        steps=steps,
        nproc=nproc,
        device=device,
        universal=universal,
        tp=tp,
        pp=pp,
        model=model,
        config=config,
        data=data,
        trust_pickles=trust_pickles,
        scheduler=scheduler,
        against=against,
        n_kv_heads=n_kv_heads,
        framework_args=framework_args,
        no_scheduler=no_scheduler,
    )
    if steps < 1:
        raise CkptError("--steps must be at least 1")
    if isinstance(checkpoint, Checkpoint):
        ck, p = checkpoint, Path(path if path is not None else checkpoint.path)
    else:
        p = Path(checkpoint)
        ck = _open(p, n_kv_heads)
    return PLANNERS.get(framework_of(ck), _no_planner)(ck, p, o)


def _open(p: Path, n_kv_heads: int | None) -> Checkpoint:
    """The checkpoint at `p`, with `--n-kv-heads` applied; refused where its format reader says a resume cannot
    rebuild it."""
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
    return ck


# --- the frameworks other than DeepSpeed ------------------------------------------------------------


def _framework(plan_it: Callable[[Checkpoint, Path, ResumeOptions, str], FrameworkPlan] | None) -> Planner:
    """The planner of a framework other than DeepSpeed: the DeepSpeed-only options refused, the device resolved,
    `plan_it` (None: no framework resumes this format), and --no-scheduler honoured (the user's word: the traces
    of a scheduler are not a lost schedule)."""

    def plan(ck: Checkpoint, p: Path, o: ResumeOptions) -> FrameworkPlan:
        _refuse_deepspeed_options(ck, p, o)
        if plan_it is None:
            others = sorted(f for f, fw in FRAMEWORK_OF_FORMAT.items() if fw != "deepspeed")
            raise UnsupportedCheckpoint(
                f"`ckpt resume` has no framework resume for {ck.format}",
                path=p,
                hint=f"supported: deepspeed, {', '.join(others)}",
            )
        fp = plan_it(ck, p, o, _device(o.device))
        return replace(fp, lr_missing=None) if o.no_scheduler and fp.lr_missing else fp

    return plan


def _refuse_deepspeed_options(ck: Checkpoint, p: Path, o: ResumeOptions) -> None:
    """--against, --universal, --config, --data, and --tp / --pp but where Megatron's torch_dist load reshards."""
    if o.against is not None:
        raise CkptError(f"--against applies to DeepSpeed checkpoints; this is {ck.format}", path=p)
    reshard = ck.format == "megatron_torch_dist"  # Megatron's dist-checkpointing loads it at any TP / PP
    if ck.format == "megatron_legacy" and (o.tp is not None or o.pp is not None):
        raise CkptError(
            "Megatron-LM loads a legacy checkpoint only at the TP / PP it was saved at",
            path=p,
            hint="drop --tp / --pp (--nproc changes the DP size; a torch_dist save reshards at load)",
        )
    for flag, given in (
        ("--universal", o.universal),
        ("--tp", o.tp is not None and not reshard),
        ("--pp", o.pp is not None and not reshard),
        ("--config", o.config is not None),
        ("--data", o.data is not None),
    ):
        if given:
            raise CkptError(
                f"{flag} applies to DeepSpeed checkpoints; this is {ck.format}", path=p, hint=f"drop {flag}"
            )


def _planner_options(ck: Checkpoint, p: Path, o: ResumeOptions, device: str) -> PlannerOptions:
    """The options of the HF Trainer, Accelerate, DCP and Lightning planners; --megatron-args refused."""
    if o.framework_args:
        raise CkptError(
            f"--megatron-args applies to Megatron-LM checkpoints; this is {ck.format}",
            path=p,
            hint="drop --megatron-args",
        )
    return PlannerOptions(o.steps, o.nproc, device, o.model, o.scheduler, o.trust_pickles)


def _hf_trainer(ck: Checkpoint, p: Path, o: ResumeOptions, device: str) -> FrameworkPlan:
    return plan_hf_trainer(ck, p, _planner_options(ck, p, o, device))


def _accelerate(ck: Checkpoint, p: Path, o: ResumeOptions, device: str) -> FrameworkPlan:
    opts = _planner_options(ck, p, o, device)
    return plan_accelerate(ck, p, opts, counts_loosely=_installed_accelerate_counts_loosely)


def _dcp(ck: Checkpoint, p: Path, o: ResumeOptions, device: str) -> FrameworkPlan:
    return plan_dcp(ck, p, _planner_options(ck, p, o, device))


def _lightning(ck: Checkpoint, p: Path, o: ResumeOptions, device: str) -> FrameworkPlan:
    return plan_lightning(ck, p, _planner_options(ck, p, o, device))


def _megatron(ck: Checkpoint, p: Path, o: ResumeOptions, device: str) -> FrameworkPlan:
    # Megatron-LM loads every rank file and common.pt with torch.load(weights_only=False)
    _check_pickles(ck, p, o.trust_pickles, "Megatron-LM")
    return plan_megatron(
        ck, p, steps=o.steps, nproc=o.nproc, device=device, model=o.model, extra_args=o.framework_args, tp=o.tp, pp=o.pp
    )


#: framework -> its planner, given the opened checkpoint, its path and the options
PLANNERS: dict[str | None, Planner] = {
    "deepspeed": plan_deepspeed,
    "hf_trainer": _framework(_hf_trainer),
    "accelerate": _framework(_accelerate),
    "dcp": _framework(_dcp),
    "lightning": _framework(_lightning),
    "megatron": _framework(_megatron),
}
_no_planner = _framework(None)


# --- running ---------------------------------------------------------------------------------------


def run_resume(plan: ResumePlan | FrameworkPlan, **options: Any) -> ResumeResult:
    """Run the plan with its framework's runner and judge the records: `deepspeed_run.run_deepspeed` and its
    keywords (on_event, converter, reference, loss_tol, jump_tol, work_dir, timeout) for a `ResumePlan`,
    `framework_run.run_framework` for a `FrameworkPlan` (the same keywords but `converter` and `jump_tol`, which
    apply to DeepSpeed only; `work_dir` is its `keep`). Scratch files go to `work_dir` (kept) or a temporary folder
    (removed), never into the checkpoint folder."""
    if isinstance(plan, FrameworkPlan):
        options.pop("converter", None)
        options.pop("jump_tol", None)
        if "work_dir" in options:
            options["keep"] = options.pop("work_dir")
        return run_framework(plan, **options)
    return run_deepspeed(plan, **options)


__all__ = [
    "plan_resume",
    "run_resume",
    "load_reference",
    "reference_doc",
    "framework_of",
    "FRAMEWORK_OF_FORMAT",
    "PLANNERS",
    "ResumeOptions",
    "ResumePlan",
    "FrameworkPlan",
    "ResumeResult",
]
