"""Make the torch FSDP samples: FSDP2 saved with torch.distributed.checkpoint, FSDP1 saved as per-rank sharded files.

Run under torchrun with 2 CPU ranks (gloo), as `ckpt_tools.samples.run_torchrun` does:

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.fsdp --sample fsdp2_dcp --out DIR

Both follow the recipe in `_common` (same init, batches, two AdamW param groups, LambdaLR, save after step 4 of 6),
so at the save both samples hold the same weights: a reader can check one against the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from ckpt_tools.train.models import Block, TinyGPT
from ckpt_tools.samples.workers import _common as c

DP = 2
FSDP1_FILE_PATTERN = "rank{rank}.pt"

Saver = Callable[[], dict[str, Any]]


def fsdp2_dcp(model: TinyGPT, path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Saver]:
    """FSDP2 (`fully_shard` per block, then the root) saved with `torch.distributed.checkpoint.save`.

    The state dicts come from `get_state_dict`, so optimizer state is keyed by parameter FQN (not by index)
    and every tensor is a DTensor that DCP writes as one chunk per rank.
    """
    mesh = init_device_mesh("cpu", (DP,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # fully_shard swaps every parameter for a DTensor one, so the groups are built from the sharded model
    # (DTensor parameters keep their global shape, which is what the grouping looks at).
    optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))

    def save() -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": c.SAVE_AFTER_STEP},
            checkpoint_id=path,
        )
        return c.snapshot(global_step=c.SAVE_AFTER_STEP, optimizer=optimizer, scheduler=scheduler)

    return model, optimizer, scheduler, save


def fsdp1_sharded(model: TinyGPT, path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Saver]:
    """FSDP1 (`FullyShardedDataParallel`, one unit per Block) saved as one torch.save file per rank under
    `SHARDED_STATE_DICT`: model and optimizer tensors are ShardedTensors holding this rank's dim-0 shard.

    `use_orig_params=True` so that the optimizer can have two param groups: FSDP keeps the original
    Parameter objects (as views into its flat shard), so groups built before wrapping stay valid.
    """
    groups = c.param_groups(model)
    wrapped = FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=True
    )
    optimizer, scheduler = c.adamw_with_lambdalr(groups)

    def save() -> dict[str, Any]:
        with FSDP.state_dict_type(wrapped, StateDictType.SHARDED_STATE_DICT):
            state = {
                "model": wrapped.state_dict(),
                "optimizer": FSDP.optim_state_dict(wrapped, optimizer),
                "scheduler": scheduler.state_dict(),
                "step": c.SAVE_AFTER_STEP,
            }
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        torch.save(state, path / FSDP1_FILE_PATTERN.format(rank=dist.get_rank()))
        return c.snapshot(global_step=c.SAVE_AFTER_STEP, optimizer=optimizer, scheduler=scheduler)

    return wrapped, optimizer, scheduler, save


SAMPLES = {
    "fsdp2_dcp": (
        fsdp2_dcp,
        "dcp",
        {
            "api": "FSDP2 fully_shard per Block and root; torch.distributed.checkpoint.save of "
            "{model, optim (get_state_dict, FQN keys), scheduler (LambdaLR.state_dict()), step}",
            "file_pattern": "__{rank}_0.distcp",
        },
    ),
    "fsdp1_sharded": (
        fsdp1_sharded,
        "fsdp_sharded_torch",
        {
            "api": "FSDP1 FullyShardedDataParallel (ModuleWrapPolicy({Block}), use_orig_params=True); per-rank "
            "torch.save of {model, optimizer (FSDP.optim_state_dict), scheduler, step} under SHARDED_STATE_DICT",
            "file_pattern": FSDP1_FILE_PATTERN,
        },
    ),
}


def main() -> None:
    args = c.parse_args()
    build, fmt, extra = SAMPLES[args.sample]
    dist.init_process_group("gloo")
    if c.world_size() != DP:
        raise SystemExit(f"run with --nproc_per_node {DP}, not {c.world_size()}")
    rank = c.rank()
    path = args.out / args.sample

    model, optimizer, scheduler, save = build(c.build_model(), path)

    def step(global_step: int) -> float:
        loss = c.lm_loss(model, c.tokens_for_step(global_step, rank))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        return loss.item()

    history, saved = c.train(step, lambda: c.current_lrs(optimizer), save)
    dist.barrier()
    if rank == 0:
        # Sharding replaced the live model's parameters with shards; count on a fresh, unsharded copy.
        c.write_sample_manifest(
            path,
            sample=args.sample,
            format=fmt,
            model=c.build_model(),
            topology={"dp": DP, "tp": 1, "pp": 1, "zero_stage": None},
            saved=saved,
            history=history,
            extra={
                **extra,
                "optimizer": type(optimizer).__name__,
                "scheduler": "torch LambdaLR (warmup then decay)",
                "param_groups": "0: tensors with dim >= 2 (weight decay), 1: biases and norms (no decay)",
            },
        )


if __name__ == "__main__":
    main()
    c.shutdown()
