"""DeepSpeed ZeRO runs whose optimizer is not Adam: what `ckpt to-universal` must carry besides exp_avg/exp_avg_sq.

Each run is the common recipe (tiny GPT, 2 CPU ranks over gloo, 6 updates, checkpoint after update 4) with a
client optimizer handed to `deepspeed.initialize` (the DeepSpeed config has no "optimizer" section, and
`zero_allow_untested_optimizer` lets ZeRO take it). fp32 throughout, so a resume can be compared bitwise with
the uninterrupted run made on the same machine.

- zero2_sgd:        ZeRO-2, torch SGD(momentum=0.9): per-parameter state `momentum_buffer` only (no step);
                    two param groups with different LRs (group 1 at twice group 0's) and weight decays.
- zero1_adagrad:    ZeRO-1, torch Adagrad: state `sum` and `step`. One param group: DeepSpeed's ZeRO-1/2
                    optimizer rebuilds a client Adagrad over its flat fp32 partitions as ONE group
                    (stage_1_and_2.py `initialize_optimizer_states`), and with two groups DeepSpeed 0.19.8's
                    first backward fails (IndexError: list index out of range), so a two-group Adagrad run
                    cannot be trained under ZeRO-1/2 to begin with.
- zero2_onemoment:  ZeRO-2, `OneMoment` below (sign-of-momentum update, Lion-like): state `exp_avg` only, no
                    `exp_avg_sq`, no step. Two param groups.
- zero3_sgd:        ZeRO-3, SGD(momentum) as zero2_sgd: DeepSpeed's ZeRO-3 universal loader cannot take it.
- zero2_adamw_2lr:  ZeRO-2, torch AdamW with group 1 at twice group 0's LR: what DeepSpeed's ZeRO-3 universal
                    loader does to per-group hyper-parameters (it copies group 0's onto every group).

Modes (the other producer workers' command line, plus two options):
  --sample NAME --out DIR                 train, save DIR/NAME after update 4, write the manifest; its history
                                          has per update {step, loss, lr, params_sha256} (the sha256 of every
                                          module parameter after that update, ZeRO-1/2 only)
  --sample NAME --resume CKPT --record OUT.json [--steps N] [--stage S] [--universal]
                                          build the same engine (at ZeRO stage S if given), load CKPT (a
                                          universal checkpoint with --universal), run N updates (default: the 2
                                          left) on the uninterrupted run's batches, and write the same records
                                          plus `state_keys` (the optimizer's per-parameter state keys)
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch

from ckpt_tools.samples.workers import _common as c
from ckpt_tools.train.manifest import write_manifest
from ckpt_tools.train.models import count_parameters


class OneMoment(torch.optim.Optimizer):
    """A client optimizer that keeps ONE moment per parameter (`exp_avg`), like Lion: update by the sign of
    an interpolation of the moment and the gradient, decoupled weight decay."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p)
                m = st["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


@dataclass(frozen=True)
class OptimVariant:
    stage: int
    optimizer: str  # sgd, adagrad, onemoment
    lr: float
    two_groups: bool = True


VARIANTS = {
    "zero2_sgd": OptimVariant(stage=2, optimizer="sgd", lr=0.05),
    "zero1_adagrad": OptimVariant(stage=1, optimizer="adagrad", lr=0.02, two_groups=False),
    "zero2_onemoment": OptimVariant(stage=2, optimizer="onemoment", lr=1e-3),
    "zero3_sgd": OptimVariant(stage=3, optimizer="sgd", lr=0.05),
    "zero2_adamw_2lr": OptimVariant(stage=2, optimizer="adamw", lr=1e-3),
}
GROUP1_LR_FACTOR = 2.0


def ds_config(stage: int, dp: int) -> dict[str, Any]:
    return c.ds_config(stage, dp, zero_allow_untested_optimizer=True)


def build_optimizer(v: OptimVariant, model: torch.nn.Module) -> torch.optim.Optimizer:
    if v.two_groups:
        groups = c.param_groups(model)
        groups[1]["lr"] = v.lr * GROUP1_LR_FACTOR
    else:
        groups = [{"params": list(model.parameters()), "weight_decay": c.WEIGHT_DECAY}]
    if v.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=v.lr, momentum=0.9)
    if v.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=v.lr)
    if v.optimizer == "onemoment":
        return OneMoment(groups, lr=v.lr)
    if v.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=v.lr, betas=c.BETAS, eps=1e-8)
    raise ValueError(v.optimizer)


def params_sha256(engine) -> str | None:
    """sha256 of every module parameter (fp32 bytes, in named_parameters order); None under ZeRO-3 (partitioned)."""
    if engine.zero_optimization_stage() == 3:
        return None
    h = hashlib.sha256()
    for _, p in engine.module.named_parameters():
        h.update(p.detach().float().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def state_keys(engine) -> list[str]:
    keys: set[str] = set()
    for st in c.innermost_optimizer(engine.optimizer).state.values():
        keys |= set(st)
    return sorted(keys)


def make_engine(v: OptimVariant, stage: int, load_universal: bool = False):
    dp = c.world_size()
    cfg = ds_config(stage, dp)
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    model = c.build_model()
    optimizer = build_optimizer(v, model)
    return c.ds_initialize(model, cfg, optimizer=optimizer), cfg


def one_update(engine, global_step: int) -> float:
    return c.ds_update(engine, c.tokens_for_step(global_step, c.rank()))


def parse_args(samples) -> argparse.Namespace:
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--stage", type=int, help="resume mode: the ZeRO stage to load at (default: the sample's)")
        p.add_argument("--universal", action="store_true", help="resume mode: CKPT is a universal checkpoint")

    return c.parse_producer_args(
        "DeepSpeed ZeRO with a non-Adam client optimizer",
        samples,
        default_steps=c.TOTAL_STEPS - c.SAVE_AFTER_STEP,
        add_arguments=add_arguments,
    )


def make(name: str, out: Path) -> None:
    v = VARIANTS[name]
    engine, cfg = make_engine(v, v.stage)
    ckpt = out / name
    history: list[dict[str, Any]] = []
    saved: dict[str, Any] = {}
    for step in range(c.TOTAL_STEPS):
        lrs = c.current_lrs(engine.optimizer)
        loss = one_update(engine, step)
        history.append({"step": step + 1, "loss": loss, "lr": lrs, "params_sha256": params_sha256(engine)})
        if step + 1 == c.SAVE_AFTER_STEP:
            engine.save_checkpoint(str(ckpt))
            c.drop_deepspeed_scripts(ckpt)
            saved = {
                "global_step": engine.global_steps,
                "lr": c.current_lrs(engine.optimizer),
                "state_keys": state_keys(engine),
            }
    if c.rank() == 0:
        count, tensors = count_parameters(c.build_model())
        write_manifest(
            ckpt,
            sample=name,
            format="deepspeed_zero",
            world_size=c.world_size(),
            topology={"dp": c.world_size(), "tp": 1, "pp": 1, "zero_stage": v.stage},
            steps=c.SAVE_AFTER_STEP,
            counters={
                "global_step": saved["global_step"],
                "optimizer_step": None,
                "scheduler_last_epoch": None,
                "scheduler_step_count": None,
                "skipped_steps": engine.skipped_steps,
            },
            lr={"param_groups": saved["lr"], "base_lrs": None, "last_lr": None},
            parameters={"count": count, "tensors": tensors},
            extra={
                "ds_config": cfg,
                "dtype": "float32",
                "tag": f"global_step{c.SAVE_AFTER_STEP}",
                "optimizer": type(c.innermost_optimizer(engine.optimizer)).__name__,
                "state_keys": saved["state_keys"],
                "micro_batch_per_rank": c.MICRO_BATCH,
                "history": history,
                "history_note": c.HISTORY_NOTE + "; params_sha256: sha256 of every "
                "module parameter after the update (fp32 bytes, named_parameters order)",
            },
        )


def optimizer_steps(engine) -> list[int]:
    """The `step` the wrapped torch optimizer keeps for each param group (from its first parameter's state),
    after the update: what the bias correction of the next update will use."""
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    out = []
    for g in opt.param_groups:
        st = next((opt.state[p] for p in g["params"] if p in opt.state and "step" in opt.state[p]), None)
        if st is not None:
            out.append(int(st["step"]))
    # ZeRO-3 puts a sub-group's fp32 partition into its param group only while it steps: read the state
    return out or [int(st["step"]) for st in opt.state.values() if "step" in st]


def resume(name: str, ckpt: Path, record: Path, steps: int, stage: int | None, universal: bool) -> None:
    v = VARIANTS[name]
    engine, _ = make_engine(v, stage or v.stage, load_universal=universal)
    path, _ = engine.load_checkpoint(str(ckpt))
    if path is None:
        raise RuntimeError(f"DeepSpeed loaded nothing from {ckpt}")
    records = []
    start = engine.global_steps
    for i in range(steps):
        lrs = c.current_lrs(engine.optimizer)
        loss = one_update(engine, start + i)
        records.append(
            {
                "step": start + i + 1,
                "loss": loss,
                "lr": lrs,
                "params_sha256": params_sha256(engine),
                "state_keys": state_keys(engine),
                "optimizer_steps": optimizer_steps(engine),
            }
        )
    if c.rank() == 0:
        record.write_text(json.dumps(records, indent=1) + "\n")


def main() -> None:
    args = parse_args(VARIANTS)
    deepspeed.init_distributed(dist_backend="gloo")
    if args.out is not None:
        make(args.sample, args.out)
    else:
        resume(args.sample, args.resume, args.record, args.steps, args.stage, args.universal)


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
