"""`ckpt resume` of an HF Trainer checkpoint-N: `trainer.train(resume_from_checkpoint=)` in
`resume.workers.hf_trainer` with the model config.json describes and TrainingArguments rebuilt from
training_args.bin (read by the inert pickle reader); the LR each resumed update must use from that schedule
(`hf_lambda`, `hf_expected_lrs`), the loss from trainer_state.json's log_history."""

from __future__ import annotations

import json
import math
from dataclasses import astuple
from pathlib import Path
from typing import Any

from ..errors import CkptError
from ..formats import hf_trainer as fmt
from ..read.meta import meta_device
from ..read.tree import Checkpoint, GroupNode, node_to_python
from .common import (
    PlannerOptions,
    FrameworkPlan,
    plan_header,
    _check_pickles,
    _finite,
    _saved_state,
    _tensor_specs,
    inert_to_json,
)
from .verdict import SavedState, mismatch


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
    """The LR of each resumed update from training_args.bin's schedule at the saved scheduler position (or the
    global step, where no scheduler state was saved); (None, why) where no formula here applies."""
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


def plan_hf_trainer(
    ck: Checkpoint,
    path: Path,
    opts: PlannerOptions,
) -> FrameworkPlan:
    """Validate the checkpoint-N folder and the options, read the Trainer's arguments and the saved state, choose
    the world size and the number of updates, build the plan."""
    steps, nproc, device, model, scheduler, trust_pickles = astuple(opts)
    folder = fmt.checkpoint_folder(ck)
    _refuse_hf(ck, path, folder, model=model, scheduler=scheduler, trust_pickles=trust_pickles)
    args = _finite(inert_to_json(node_to_python(ck.tree.children["training_args"])))
    if not isinstance(args, dict):
        raise CkptError("training_args.bin does not hold a TrainingArguments", path=folder / "training_args.bin")
    sched = node_to_python(ck.tree.children.get("scheduler", GroupNode())) or {}
    world = ck.details.get("world_size") or ck.topology.dp or 1
    saved = _saved_state(
        ck, sched, global_step=ck.counters.global_step, optimizer_step=ck.counters.optimizer_step, dp=world
    )
    notes: list[str] = []
    zero_files = _zero_files(ck, folder)
    world = len(zero_files) or world
    n = _hf_world(nproc, world, zero_files, notes)
    gstep = saved.global_step or 0
    steps = _hf_steps(args, gstep, steps, folder, notes)
    want, how = hf_expected_lrs(args, saved, steps)
    if saved.scheduler_state == "none":
        notes.append(
            "the checkpoint holds no scheduler state: the Trainer then loads neither the scheduler nor "
            "the optimizer (it needs both files)"
        )
    ref, ref_src = _hf_log_reference(folder, range(gstep + 1, gstep + steps + 1))
    ds_cfg = args.get("deepspeed")
    return FrameworkPlan(
        **plan_header("hf_trainer", path, saved, steps, device, n),
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


def _refuse_hf(
    ck: Checkpoint, path: Path, folder: Path, *, model: str, scheduler: str | None, trust_pickles: bool
) -> None:
    """What makes an HF Trainer resume impossible, refused before anything starts: another --model, --scheduler,
    no config.json or training_args.bin, an untrusted pickle, a config.json that does not match the weights."""
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


def _zero_files(ck: Checkpoint, folder: Path) -> list[str]:
    """A DeepSpeed checkpoint-N: its ZeRO optimizer files by rank, relative to the folder ([] without ZeRO)."""
    if ck.topology.zero_stage is None:
        return []
    tag = (folder / "latest").read_text().strip() if (folder / "latest").is_file() else None
    tag_dir = folder / tag if tag else next(iter(sorted(folder.glob("global_step*"))), None)
    if tag_dir is None:
        raise CkptError("a DeepSpeed checkpoint-N folder without its global_stepN tag folder", path=folder)
    by_rank = {}
    for f in tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"):
        r = int(f.name.split("zero_pp_rank_")[1].split("_")[0])
        by_rank[r] = str(f.relative_to(folder))
    return [by_rank[r] for r in sorted(by_rank)]


def _hf_world(nproc: int | None, world: int, zero_files: list[str], notes: list[str]) -> int:
    """The processes to resume on: `--nproc` or the saved world; a ZeRO checkpoint only on its saved ranks."""
    n = nproc or world
    if zero_files and n != len(zero_files):
        raise CkptError(
            f"--nproc {n}: the ZeRO checkpoint was saved by {len(zero_files)} ranks and DeepSpeed "
            "refuses to repartition it",
            hint=f"use --nproc {len(zero_files)}",
        )
    if n != world:
        notes.append(f"resumed on {n} processes, saved by {world}: the global batch (and the loss) differ")
    return n


def _hf_steps(args: dict[str, Any], gstep: int, steps: int, folder: Path, notes: list[str]) -> int:
    """`--steps`, cut to what is left before max_steps (the Trainer stops there)."""
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
    return steps


def _hf_model_matches(folder: Path, ck: Checkpoint) -> None:
    """Build the config.json model on the meta device (no memory, no download) and compare its parameters with
    the saved weights, so that a model that cannot load is refused before any process starts."""
    try:
        # lazy: transformers only when an HF Trainer checkpoint is planned; `ckpt` runs without it
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
