"""The DCP sample in the layout of PyTorch's DCP recipe (the tutorial's `AppState(Stateful)`) with FSDP2.

Run under torchrun with 2 CPU ranks (gloo), as `ckpt_tools.samples.run_torchrun` does:

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.dcp_layouts \\
        --sample dcp_recipe_fsdp2 --out DIR

and, to resume a checkpoint the way the recipe does and record the two updates it makes:

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.dcp_layouts \\
        --sample dcp_recipe_fsdp2 --resume DIR/dcp_recipe_fsdp2 --record OUT.json

The sample follows the recipe in `_common` (the tiny GPT, FSDP2 `fully_shard` per Block then the root, AdamW with
two param groups, 6 steps, one `dcp.save` after step 4), saved the way the tutorial's user code does: everything
under `app`: `app.model.*`, `app.optim.*` (get_state_dict, not flattened: `state.<fqn>.*`, `param_groups.<index>.*`),
`app.scheduler.*` (a CosineAnnealingLR, chainable: each LR is computed from the optimizer's current LR),
`app.step`. (torchtitan's layout is written by torchtitan's own Trainer: `torchtitan_run`.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckpt_tools.train.models import TinyGPT
from ckpt_tools.samples.workers import _common as c

DP = 2
LAYOUTS = {"dcp_recipe_fsdp2": "recipe"}
COSINE_T_MAX = c.TOTAL_STEPS
COSINE_ETA_MIN = c.PEAK_LR * 0.1


def build(sample: str) -> tuple[TinyGPT, torch.optim.Optimizer, Any]:
    """The tiny GPT sharded with FSDP2 over 2 CPU ranks, AdamW (two groups) and the sample's scheduler."""
    model = c.build_model()
    mesh = init_device_mesh("cpu", (DP,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # groups from the sharded model: fully_shard replaced every parameter with a DTensor one
    optimizer = torch.optim.AdamW(c.param_groups(model), lr=c.PEAK_LR, betas=c.BETAS, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=COSINE_T_MAX, eta_min=COSINE_ETA_MIN)
    return model, optimizer, scheduler


# --- PyTorch DCP recipe layout ----------------------------------------------------------------------------


class AppState(Stateful):
    """The DCP tutorial's application state: dcp.save/load call `state_dict()` / `load_state_dict()` on it."""

    def __init__(self, model, optimizer, scheduler, step: int = 0) -> None:
        self.model, self.optimizer, self.scheduler, self.step = model, optimizer, scheduler, step

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict(), "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.step = int(state_dict["step"])


# --- the run ----------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    return c.parse_producer_args(
        "Make (or resume) the DCP-recipe FSDP2 sample.", LAYOUTS, default_steps=c.TOTAL_STEPS - c.SAVE_AFTER_STEP
    )


def update(model, optimizer, scheduler, batch: int) -> float:
    loss = c.lm_loss(model, c.tokens_for_step(batch, c.rank()))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def make(sample: str, out: Path) -> None:
    path = out / sample
    model, optimizer, scheduler = build(sample)

    def save() -> dict[str, Any]:
        dcp.save({"app": AppState(model, optimizer, scheduler, step=c.SAVE_AFTER_STEP)}, checkpoint_id=path)
        return c.snapshot(global_step=c.SAVE_AFTER_STEP, optimizer=optimizer, scheduler=scheduler)

    history, saved = c.train(lambda s: update(model, optimizer, scheduler, s), lambda: c.current_lrs(optimizer), save)
    dist.barrier()
    if c.rank() != 0:
        return
    # group membership by FQN, from a fresh unsharded copy (same order as the sharded model's parameters)
    fresh = c.build_model()
    names = {id(p): n for n, p in fresh.named_parameters()}
    group_fqns = [[names[id(p)] for p in g["params"]] for g in c.param_groups(fresh)]
    extra = {
        "layout": "recipe",
        "api": "FSDP2 fully_shard per Block and root; dcp.save({'app': AppState}) where AppState.state_dict() "
        "is {model, optim (get_state_dict, not flattened), scheduler (CosineAnnealingLR.state_dict()), "
        "step}",
        "scheduler": f"torch CosineAnnealingLR(T_max={COSINE_T_MAX}, eta_min={COSINE_ETA_MIN}) (chainable: "
        "each step's LR is computed from the optimizer's current LR)",
        "scheduler_kind": "CosineAnnealingLR",
        "scheduler_params": {"T_max": COSINE_T_MAX, "eta_min": COSINE_ETA_MIN},
        "lr_source_note": "the first resumed update uses app.optim.param_groups.<i>.lr; CosineAnnealingLR's "
        "recursive form derives every later LR from the optimizer's current lr",
    }
    c.write_sample_manifest(
        path,
        sample=sample,
        format="dcp",
        model=fresh,
        topology={"dp": DP, "tp": 1, "pp": 1, "zero_stage": None},
        saved=saved,
        history=history,
        extra={
            **extra,
            "optimizer": type(optimizer).__name__,
            "file_pattern": "__{rank}_0.distcp",
            "param_groups": c.PARAM_GROUPS_NOTE,
            "param_group_fqns": group_fqns,
            "next_lr": saved["lr"]["param_groups"],
        },
    )


def resume(sample: str, ckpt: Path, record: Path, steps: int) -> None:
    """Load `ckpt` as the producer does, run `steps` updates on the uninterrupted run's batches, record them."""
    model, optimizer, scheduler = build(sample)
    app = AppState(model, optimizer, scheduler, step=0)
    dcp.load({"app": app}, checkpoint_id=ckpt)
    step = batch = app.step
    records = []
    for i in range(steps):
        lrs = c.current_lrs(optimizer)  # what this update uses: read before optimizer.step()
        loss = update(model, optimizer, scheduler, batch + i)
        records.append(
            {
                "step": step + i + 1,
                "batch": batch + i,
                "lr": lrs,
                "optimizer_step": c.adam_step(optimizer),
                "scheduler_last_epoch": scheduler.last_epoch,
                "loss": loss,
            }
        )
    if c.rank() == 0:
        record.write_text(json.dumps(records, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    if not dist.is_initialized():  # the second run of a launch (for_each_run)
        dist.init_process_group("gloo")
    if c.world_size() != DP:
        raise SystemExit(f"run with --nproc_per_node {DP}, not {c.world_size()}")
    if args.resume is not None:
        resume(args.sample, args.resume, args.record, args.steps)
    else:
        make(args.sample, args.out)


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
