"""HF Accelerate with two models: real `accelerator.save_state` output of a run that prepares several objects.

Run under torchrun with 2 CPU ranks (gloo), as `ckpt_tools.samples.run_torchrun` does:

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.accel_multi \\
        --sample accelerate_two_models --out DIR

and, to resume the checkpoint the way the script does (`accelerator.load_state`) and record two updates:

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.accel_multi \\
        --sample accelerate_two_models --resume DIR/accelerate_two_models --record OUT.json

`Accelerator(cpu=True)` under torchrun is MULTI_CPU DDP. Two models are prepared together with two AdamW
optimizers (two param groups each) and two schedulers of different kinds:

- model 0: the tiny GPT of `_common` with AdamW + LambdaLR(`lr_factor`) (`_common.adamw_with_lambdalr`);
- model 1: `BigramMLP`, a small next-token model (embedding -> MLP -> logits), seeded differently, with
  AdamW(lr=PEAK_LR_1) + StepLR(step_size=STEP_SIZE_1, gamma=GAMMA_1) (chainable: the optimizer's lr drives it).

Accelerate numbers the files in the order the objects were prepared: model.safetensors / model_1.safetensors,
optimizer.bin / optimizer_1.bin, scheduler.bin / scheduler_1.bin, plus random_states_<rank>.pkl and
custom_checkpoint_0.pkl (the `TrainProgress` registered with `register_for_checkpointing`). Accelerate steps each
scheduler once per process per optimizer step, so after 4 steps both schedulers have last_epoch 8.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator

from ckpt_tools.train.models import GPTConfig, count_parameters
from ckpt_tools.samples.workers import _common as c
from ckpt_tools.samples.workers.accel import TrainProgress

SAMPLE = "accelerate_two_models"
SEED_1 = c.SEED + 1
PEAK_LR_1 = 1e-3
STEP_SIZE_1 = 3
GAMMA_1 = 0.5
MLP_HIDDEN = 16
MLP_FFN = 64


class BigramMLP(nn.Module):
    """The second model: predicts the next token from the current one alone. Parameter names: `emb.weight`,
    `fc.weight`, `fc.bias`, `proj.weight`, `proj.bias`."""

    def __init__(self, vocab_size: int = GPTConfig().vocab_size, hidden: int = MLP_HIDDEN, ffn: int = MLP_FFN):
        super().__init__()
        self.emb = nn.Embedding(vocab_size, hidden)
        self.fc = nn.Linear(hidden, ffn)
        self.proj = nn.Linear(ffn, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(self.emb(tokens))))


def build_model_1() -> BigramMLP:
    torch.manual_seed(SEED_1)
    return BigramMLP()


def adamw_with_steplr(groups: list[dict[str, Any]]) -> tuple[torch.optim.Optimizer, Any]:
    optimizer = torch.optim.AdamW(groups, lr=PEAK_LR_1, betas=c.BETAS, eps=1e-8)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=STEP_SIZE_1, gamma=GAMMA_1)


def setup():
    """The Accelerator and every prepared object, in the order that numbers the saved files."""
    accelerator = Accelerator(cpu=True)
    model_0, model_1 = c.build_model(), build_model_1()
    opt_0, sched_0 = c.adamw_with_lambdalr(c.param_groups(model_0))
    opt_1, sched_1 = adamw_with_steplr(c.param_groups(model_1))
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    prepared = accelerator.prepare(model_0, model_1, opt_0, opt_1, sched_0, sched_1)
    return accelerator, (model_0, model_1), prepared, progress


class TwoModels:
    """The prepared run (`setup`) and one update of both models, as the training script does it."""

    def __init__(self) -> None:
        self.accelerator, (self.model_0, self.model_1), prepared, self.progress = setup()
        self.wrapped_0, self.wrapped_1, self.opt_0, self.opt_1, self.sched_0, self.sched_1 = prepared
        self.rank = self.accelerator.process_index

    def update(self, batch: int) -> tuple[float, float]:
        """One optimizer step of both models on batch `batch` (the sum of their losses); the two losses."""
        tokens = c.tokens_for_step(batch, self.rank)
        loss_0 = c.lm_loss(self.wrapped_0, tokens)
        loss_1 = c.lm_loss(self.wrapped_1, tokens)
        self.accelerator.backward(loss_0 + loss_1)
        self.accelerator.clip_grad_norm_(self.wrapped_0.parameters(), 1.0)
        self.accelerator.clip_grad_norm_(self.wrapped_1.parameters(), 1.0)
        self.opt_0.step()
        self.opt_1.step()
        self.sched_0.step()
        self.sched_1.step()
        self.opt_0.zero_grad()
        self.opt_1.zero_grad()
        self.progress.update(c.MICRO_BATCH * self.accelerator.num_processes)
        return loss_0.item(), loss_1.item()


def parse_args() -> argparse.Namespace:
    return c.parse_producer_args(
        "Make (or resume) the Accelerate two-model sample.", [SAMPLE], default_steps=c.TOTAL_STEPS - c.SAVE_AFTER_STEP
    )


def main() -> None:
    args = parse_args()
    run = TwoModels()
    if args.resume is not None:
        resume(run, args)
    else:
        make(run, args)


def resume(run: TwoModels, args: argparse.Namespace) -> None:
    """`accelerator.load_state`, `args.steps` updates; rank 0 writes their records to `args.record`."""
    run.accelerator.load_state(str(args.resume))
    records = []
    for _ in range(args.steps):
        batch = run.progress.steps
        lr_0, lr_1 = c.current_lrs(run.opt_0), c.current_lrs(run.opt_1)  # what this update uses
        loss_0, loss_1 = run.update(batch)
        records.append(
            {
                "step": batch + 1,
                "lr": lr_0,
                "lr_1": lr_1,
                "optimizer_step": c.adam_step(run.opt_0),
                "optimizer_step_1": c.adam_step(run.opt_1),
                "scheduler_last_epoch": run.sched_0.scheduler.last_epoch,
                "scheduler_last_epoch_1": run.sched_1.scheduler.last_epoch,
                "loss": loss_0,
                "loss_1": loss_1,
            }
        )
    run.accelerator.wait_for_everyone()
    if run.accelerator.is_main_process:
        args.record.write_text(json.dumps(records, indent=1) + "\n")


def optimizer_info(opt: Any, sched: Any) -> dict[str, Any]:
    """One prepared optimizer and its scheduler as the manifest lists them."""
    s = sched.scheduler
    return {
        "optimizer": type(c.innermost_optimizer(opt)).__name__,
        "scheduler": type(s).__name__,
        "lr": c.current_lrs(opt),
        "base_lrs": [float(x) for x in s.base_lrs],
        "last_lr": [float(x) for x in s.get_last_lr()],
        "last_epoch": s.last_epoch,
        "step_count": s._step_count,
        "optimizer_step": c.adam_step(opt),
    }


def make(run: TwoModels, args: argparse.Namespace) -> None:
    """Train, `accelerator.save_state` after the save step, and rank 0 writes the manifest."""
    ckpt = args.out / args.sample
    side: list[dict[str, Any]] = []  # per step: optimizer 1's LRs and model 1's loss
    saved_extra: dict[str, Any] = {}

    def step(batch: int) -> float:
        lr_1 = c.current_lrs(run.opt_1)
        loss_0, loss_1 = run.update(batch)
        side.append({"lr_1": lr_1, "loss_1": loss_1})
        return loss_0

    def save() -> dict[str, Any]:
        run.accelerator.save_state(str(ckpt))
        saved_extra["progress"] = run.progress.state_dict()
        saved_extra["optimizers"] = [optimizer_info(run.opt_0, run.sched_0), optimizer_info(run.opt_1, run.sched_1)]
        return c.snapshot(global_step=run.progress.steps, optimizer=run.opt_0, scheduler=run.sched_0.scheduler)

    history, saved = c.train(step, lambda: c.current_lrs(run.opt_0), save)
    for h, s in zip(history, side):
        h.update(s)
    run.accelerator.wait_for_everyone()
    if run.accelerator.is_main_process:
        write_manifest(run, ckpt, args.sample, history, saved, saved_extra)


def models_info(model_0: nn.Module, model_1: nn.Module) -> list[dict[str, Any]]:
    """Each model as the manifest lists it: its file, class, parameter count and config."""
    models = []
    for i, (m, cfg) in enumerate(
        (
            (model_0, GPTConfig().to_dict()),
            (model_1, {"vocab_size": GPTConfig().vocab_size, "hidden": MLP_HIDDEN, "ffn": MLP_FFN}),
        )
    ):
        count, tensors = count_parameters(m)
        models.append(
            {
                "file": "model.safetensors" if i == 0 else f"model_{i}.safetensors",
                "class": type(m).__name__,
                "parameters": count,
                "tensors": tensors,
                "config": cfg,
            }
        )
    return models


def write_manifest(
    run: TwoModels,
    ckpt: Any,
    sample: str,
    history: list[dict[str, Any]],
    saved: dict[str, Any],
    saved_extra: dict[str, Any],
) -> None:
    """Rank 0: the sample's manifest (`_common.write_sample_manifest`) with both models and both optimizers."""
    accelerator = run.accelerator
    c.write_sample_manifest(
        ckpt,
        sample=sample,
        format="accelerate",
        model=nn.ModuleList([run.model_0, run.model_1]),
        topology={"dp": accelerator.num_processes, "tp": 1, "pp": 1, "zero_stage": None},
        saved=saved,
        history=history,
        extra={
            "distributed_type": str(accelerator.distributed_type.value),
            "mixed_precision": accelerator.mixed_precision,
            "models": models_info(run.model_0, run.model_1),
            "optimizers": saved_extra["optimizers"],
            "schedulers": [
                "torch LambdaLR (warmup then decay) on optimizer 0 (scheduler.bin)",
                f"torch StepLR(step_size={STEP_SIZE_1}, gamma={GAMMA_1}) on optimizer 1 (scheduler_1.bin), "
                "chainable: each LR is computed from the optimizer's current lr",
            ],
            "scheduler": "two schedulers of different kinds, each stepped by Accelerate once per process per "
            "optimizer step: see 'schedulers'",
            "scheduler_kinds": ["LambdaLR", "StepLR"],
            "custom_checkpoint_0": saved_extra["progress"],
            "param_groups": c.PARAM_GROUPS_NOTE + " (in both optimizers)",
            "counters_note": "'counters' and 'lr' are optimizer 0's / scheduler 0's; 'optimizers' has both",
            "history_lr_note": "'lr' is optimizer 0's groups, 'lr_1' optimizer 1's; 'loss' is model 0's, "
            "'loss_1' model 1's (rank 0's micro-batch)",
            "next_lr": saved["lr"]["param_groups"],
            "next_lr_1": saved_extra["optimizers"][1]["lr"],
        },
    )


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
