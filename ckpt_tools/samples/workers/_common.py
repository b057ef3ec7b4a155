"""What every sample worker shares: the command line, the run recipe, the loop and the manifest fields.

All samples follow one recipe so that their manifests can be compared: the same tiny GPT with the same
initial weights on every rank, the same deterministic batches, 6 optimizer steps, one checkpoint saved
after step 4 (so a resume has steps left to check against), and a per-step history of loss and LR.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ckpt_tools.train.data import batch_for_step
from ckpt_tools.train.manifest import write_manifest
from ckpt_tools.train.models import GPTConfig, TinyGPT, count_parameters
from ckpt_tools.train.procgroup import leave

TOTAL_STEPS = 6
SAVE_AFTER_STEP = 4
MICRO_BATCH = 4
PEAK_LR = 3e-3
WARMUP_STEPS = 3
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.95)
SEED = 0

HISTORY_NOTE = (
    "one entry per optimizer step: 'step' is the global step after the update, 'loss' is rank 0's local "
    "loss on its own micro-batch (not averaged over data-parallel ranks), 'lr' is the LR of each param "
    "group used for that update; the batch for the update that ends at step s is "
    "batch_for_step(s - 1, dp_rank=rank)"
)


THEN = "--then"


def for_each_run(main: Callable[[], None]) -> None:
    """Call `main` once per `--then`-separated part of this process's command line, each part what one launch
    of the worker would be given (`--sample A --out D --then --sample B --out D`): several samples or resumes in
    one torchrun launch pay torch's and DeepSpeed's imports and the process group once. Each part seeds its own
    run (the recipe's `torch.manual_seed` at model build), so a part's results do not depend on the parts before."""
    parts: list[list[str]] = [[]]
    for arg in sys.argv[1:]:
        if arg == THEN:
            parts.append([])
        else:
            parts[-1].append(arg)
    program = sys.argv[0]
    for part in parts:
        sys.argv[:] = [program, *part]
        main()


def then(*parts: list[str]) -> list[str]:
    """The command line of several runs in one launch (`for_each_run`'s parts, `--then` between them)."""
    return [arg for i, part in enumerate(parts) for arg in ([THEN] if i else []) + list(part)]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train the tiny GPT and save one sample checkpoint.")
    parser.add_argument("--sample", required=True, help="sample name from ckpt_tools.samples.SAMPLES")
    parser.add_argument("--out", required=True, type=Path, help="the group folder the sample goes into")
    return parser.parse_args()


def check_mode_parser(
    description: str, samples, *, check_help: str, steps_default: int | None, steps_help: str
) -> argparse.ArgumentParser:
    """The command line of a worker that runs a producer's own entry point (torchtitan's Trainer, torchtune's
    recipes): `--sample NAME` and either `--out DIR` (make it) or `--check CKPT [--record OUT.json] [--steps N]`
    (resume it in the producer and record the steps). The worker adds its own pass-through option."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--sample", required=True, choices=samples)
    p.add_argument("--out", type=Path, help="the group folder the sample goes into")
    p.add_argument("--check", type=Path, help=check_help)
    p.add_argument("--record", type=Path, help="check mode: write the resumed steps here (JSON)")
    p.add_argument("--steps", type=int, default=steps_default, help=steps_help)
    return p


def parse_producer_args(
    description: str,
    samples,
    *,
    default_steps: int | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The command line of a producer worker (HF Trainer, Lightning, DCP layouts, Accelerate with two models):
    `--sample NAME` and either `--out DIR` (make the sample) or `--resume CKPT --record OUT.json [--steps N]`
    (load CKPT the way the producer does, train, and write the per-update records). `add_arguments(parser)`
    adds a worker's own options."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--sample", required=True, choices=sorted(samples))
    p.add_argument("--out", type=Path, help="the group folder the sample goes into")
    p.add_argument("--resume", type=Path, help="a checkpoint of this sample's kind to resume from (resume mode)")
    p.add_argument("--record", type=Path, help="resume mode: the main process writes the resumed updates here")
    p.add_argument(
        "--steps",
        type=int,
        default=default_steps,
        help="resume mode: updates to run (default: the steps the sample run had left)",
    )
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args()
    if (args.out is None) == (args.resume is None):
        p.error("give exactly one of --out (make the sample) or --resume CKPT --record OUT.json")
    if args.resume is not None and args.record is None:
        p.error("--resume needs --record")
    return args


def rank() -> int:
    """Global rank as torchrun exports it (0 when run without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def param_group_value(v: Any) -> Any:
    """An optimizer param-group value as a manifest holds it: tuples and lists as lists (element by element), a
    one-element tensor as its number, anything else as it is (not `read.tree.jsonable`, which turns objects into
    their repr and knows no tensors)."""
    if isinstance(v, (tuple, list)):
        return [param_group_value(x) for x in v]
    if hasattr(v, "item") and getattr(v, "numel", lambda: 2)() == 1:
        return v.item()
    return v


def shared_adam_step(values: list[float]) -> int | None:
    """The Adam step, as an int, when every parameter has the same one (`values`: the sorted set of them); None
    when they differ or there is none (`adam_step` of a live optimizer raises instead)."""
    return int(values[0]) if len(values) == 1 else None


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def shutdown() -> None:
    """End the worker process: barrier, destroy the group, flush, exit 0 (see `ckpt_tools.train.procgroup`:
    returning normally lets gloo abort a run that succeeded). Call it last; it never returns."""
    leave(0)


def drop_deepspeed_scripts(folder: Path) -> None:
    """DeepSpeed's save_checkpoint copies its own recovery scripts (zero_to_fp32.py, zero_to_torch.py) into
    the checkpoint's parent folder. They are DeepSpeed's code, not checkpoint state, and this project does
    not ship DeepSpeed's code, so the samples leave them out (rank 0 removes them after saving)."""
    if rank() == 0:
        for name in ("zero_to_fp32.py", "zero_to_torch.py"):
            (Path(folder) / name).unlink(missing_ok=True)


def build_model() -> TinyGPT:
    """The tiny GPT, seeded so that every rank starts from the same weights without a broadcast."""
    torch.manual_seed(SEED)
    return TinyGPT(GPTConfig())


def split_groups(model: torch.nn.Module, matrices: dict[str, Any], vectors: dict[str, Any]) -> list[dict[str, Any]]:
    """Two param groups over the trainable parameters (`parameters()` yields a tied one once): group 0 the
    matrices (dim >= 2) with the settings `matrices`, group 1 the vectors (biases, norms) with `vectors`. The
    settings keep their order after "params" (the order the optimizer's state dict saves them in)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in trainable if p.dim() >= 2], **matrices},
        {"params": [p for p in trainable if p.dim() < 2], **vectors},
    ]


PARAM_GROUPS_NOTE = "0: tensors with dim >= 2 (weight decay), 1: biases and norms (no decay)"


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two groups as real LM runs have them: weight decay on matrices (dim >= 2), none on biases and norms.

    Two groups make every per-group field in a checkpoint (lr, weight_decay, flat partitions) a list of
    two, which is what readers must handle.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step: int) -> float:
    """Linear warmup over WARMUP_STEPS, then 20% decay per step: every step has a different LR."""
    if step < WARMUP_STEPS:
        return (step + 1) / WARMUP_STEPS
    return 0.8 ** (step - WARMUP_STEPS + 1)


def adamw_with_lambdalr(groups: list[dict[str, Any]]) -> tuple[torch.optim.Optimizer, Any]:
    """The torch AdamW + LambdaLR(`lr_factor`) pair every sample with a torch scheduler uses (DeepSpeed with a
    torch scheduler, FSDP, Accelerate, plain). `lr_factor` is a plain function, so the scheduler's state dict
    stores None for it and the checkpoint stays plain data. `ckpt resume` rebuilds exactly this pair."""
    optimizer = torch.optim.AdamW(groups, lr=PEAK_LR, betas=BETAS, eps=1e-8)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def tokens_for_step(step: int, dp_rank: int) -> torch.Tensor:
    cfg = GPTConfig()
    return batch_for_step(step, batch_size=MICRO_BATCH, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, dp_rank=dp_rank)


def lm_loss(forward: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Next-token loss through `forward` (an engine or DDP wrapper, whose hooks must run, not the bare module)."""
    logits = forward(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def innermost_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer that owns the Adam state, under DeepSpeed's / Accelerate's wrappers (`.optimizer`)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def adam_step(optimizer: Any) -> int:
    """The live Adam 'step' (one value shared by every parameter or flat partition)."""
    steps = {int(s["step"]) for s in innermost_optimizer(optimizer).state.values() if "step" in s}
    if len(steps) != 1:
        raise RuntimeError(f"expected one Adam step value across the optimizer state, got {sorted(steps)}")
    return steps.pop()


def current_lrs(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def snapshot(
    *, global_step: int, optimizer: Any, scheduler: Any = None, skipped_steps: int | None = None
) -> dict[str, dict[str, Any]]:
    """Manifest `counters` and `lr`, read from the live optimizer and scheduler at save time.

    Handles torch schedulers (`last_epoch`, `_step_count`, `base_lrs`) and DeepSpeed's own schedulers,
    which only have `last_batch_iteration` and `get_last_lr()`.
    """
    if scheduler is None:
        last_epoch = step_count = base_lrs = last_lr = None
    else:
        last_epoch = getattr(scheduler, "last_epoch", getattr(scheduler, "last_batch_iteration", None))
        step_count = getattr(scheduler, "_step_count", None)
        base_lrs = [float(x) for x in scheduler.base_lrs] if hasattr(scheduler, "base_lrs") else None
        last_lr = [float(x) for x in scheduler.get_last_lr()]
    return {
        "counters": {
            "global_step": int(global_step),
            "optimizer_step": adam_step(optimizer),
            "scheduler_last_epoch": last_epoch,
            "scheduler_step_count": step_count,
            "skipped_steps": skipped_steps,
        },
        "lr": {"param_groups": current_lrs(optimizer), "base_lrs": base_lrs, "last_lr": last_lr},
    }


def train(
    step_fn: Callable[[int], float], lrs_fn: Callable[[], list[float]], save_fn: Callable[[], dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run TOTAL_STEPS updates; call `save_fn` after update SAVE_AFTER_STEP and keep what it returns.

    `step_fn(step)` does the update that starts at global step `step` and returns rank 0's loss.
    Returns (history, what save_fn returned).
    """
    history: list[dict[str, Any]] = []
    saved: dict[str, Any] | None = None
    for step in range(TOTAL_STEPS):
        lrs = lrs_fn()
        loss = step_fn(step)
        history.append({"step": step + 1, "loss": float(loss), "lr": lrs})
        if step + 1 == SAVE_AFTER_STEP:
            saved = save_fn()
    assert saved is not None
    return history, saved


def write_sample_manifest(
    ckpt_path: Path,
    *,
    sample: str,
    format: str,
    model: torch.nn.Module,
    topology: dict[str, int | None],
    saved: dict[str, Any],
    history: list[dict[str, Any]],
    extra: dict[str, Any],
) -> Path:
    """The manifest for a sample made with this module's recipe; `saved` is `snapshot()`'s result."""
    count, tensors = count_parameters(model)
    return write_manifest(
        ckpt_path,
        sample=sample,
        format=format,
        world_size=world_size(),
        topology=topology,
        steps=SAVE_AFTER_STEP,
        counters=saved["counters"],
        lr=saved["lr"],
        parameters={"count": count, "tensors": tensors},
        extra={
            "model_config": GPTConfig().to_dict(),
            "micro_batch_per_rank": MICRO_BATCH,
            "total_steps_trained": TOTAL_STEPS,
            "saved_after_step": SAVE_AFTER_STEP,
            "history": history,
            "history_note": HISTORY_NOTE,
            **extra,
        },
    )


# --- DeepSpeed ------------------------------------------------------------------------------------------


def ds_setup() -> tuple[argparse.Namespace, int, int]:
    """A DeepSpeed sample worker's start: its command line (`parse_args`), then DeepSpeed's gloo process group.
    Returns (args, rank, dp world size)."""
    args = parse_args()
    import deepspeed  # lazy: only the DeepSpeed workers call it; the FSDP, Accelerate, HF, Lightning ones share _common

    deepspeed.init_distributed(dist_backend="gloo")
    return args, rank(), world_size()


def ds_config(stage: int, dp: int, **settings: Any) -> dict[str, Any]:
    """The DeepSpeed config every DeepSpeed sample starts from: this recipe's batch sizes, clipping at 1.0,
    `settings` (e.g. `bf16={"enabled": True}`), then ZeRO `stage` (at stage 3 with no persistence threshold:
    the default, 1e5 elements, would keep every tensor of the tiny models unpartitioned). Callers add the
    optimizer/scheduler sections after it; the key order is what DeepSpeed saves (`ds_config` in the model
    states), so it stays the same."""
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "train_batch_size": MICRO_BATCH * dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        **settings,
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def ds_adamw(
    lr: float = PEAK_LR, betas: tuple[float, float] = BETAS, weight_decay: float = WEIGHT_DECAY
) -> dict[str, Any]:
    """The "optimizer" section for DeepSpeed's AdamW from the config (torch's AdamW: FusedAdam needs CUDA)."""
    return {
        "type": "AdamW",
        "params": {"lr": lr, "betas": list(betas), "eps": 1e-8, "weight_decay": weight_decay, "torch_adam": True},
    }


def ds_initialize(
    model: torch.nn.Module,
    cfg: dict[str, Any],
    *,
    groups: list[dict[str, Any]] | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
):
    """`deepspeed.initialize` on a copy of `cfg` (DeepSpeed may fill in defaults in the dict it is given; the
    manifest keeps what we asked for); returns the engine."""
    import deepspeed  # lazy: as in ds_setup

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=groups, optimizer=optimizer, lr_scheduler=scheduler, config=copy.deepcopy(cfg)
    )
    return engine


def ds_update(engine: Any, tokens: torch.Tensor) -> float:
    """One DeepSpeed update on `tokens`; returns this rank's loss."""
    loss = lm_loss(engine, tokens)
    engine.backward(loss)
    engine.step()
    return loss.item()


def ds_train(
    engine: Any,
    ckpt: Path,
    tokens: Callable[[int], torch.Tensor],
    *,
    saved: Callable[[], dict[str, Any]] | None = None,
    **save_kwargs: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`train` with a DeepSpeed engine: update `step` runs on `tokens(step)`; after update SAVE_AFTER_STEP,
    `engine.save_checkpoint(ckpt, **save_kwargs)` (DeepSpeed's scripts dropped) and the manifest fields from
    `saved()` (default: `snapshot` of the engine's optimizer, scheduler and skipped steps)."""

    def save() -> dict[str, Any]:
        engine.save_checkpoint(str(ckpt), **save_kwargs)
        drop_deepspeed_scripts(ckpt)
        if saved is not None:
            return saved()
        return snapshot(
            global_step=engine.global_steps,
            optimizer=engine.optimizer,
            scheduler=engine.lr_scheduler,
            skipped_steps=engine.skipped_steps,
        )

    return train(lambda step: ds_update(engine, tokens(step)), lambda: current_lrs(engine.optimizer), save)
