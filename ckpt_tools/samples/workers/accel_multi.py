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
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model_0, model_1 = c.build_model(), build_model_1()
    opt_0, sched_0 = c.adamw_with_lambdalr(c.param_groups(model_0))
    opt_1, sched_1 = adamw_with_steplr(c.param_groups(model_1))
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    prepared = accelerator.prepare(model_0, model_1, opt_0, opt_1, sched_0, sched_1)
    return accelerator, (model_0, model_1), prepared, progress


def parse_args() -> argparse.Namespace:
    return c.parse_producer_args(
        "Make (or resume) the Accelerate two-model sample.", [SAMPLE], default_steps=c.TOTAL_STEPS - c.SAVE_AFTER_STEP
    )


def main() -> None:
    args = parse_args()
    accelerator, (model_0, model_1), prepared, progress = setup()
    wrapped_0, wrapped_1, opt_0, opt_1, sched_0, sched_1 = prepared
    rank = accelerator.process_index

    def update(batch: int) -> tuple[float, float]:
        tokens = c.tokens_for_step(batch, rank)
        loss_0 = c.lm_loss(wrapped_0, tokens)
        loss_1 = c.lm_loss(wrapped_1, tokens)
        accelerator.backward(loss_0 + loss_1)
        accelerator.clip_grad_norm_(wrapped_0.parameters(), 1.0)
        accelerator.clip_grad_norm_(wrapped_1.parameters(), 1.0)
        opt_0.step()
        opt_1.step()
        sched_0.step()
        sched_1.step()
        opt_0.zero_grad()
        opt_1.zero_grad()
        progress.update(c.MICRO_BATCH * accelerator.num_processes)
        return loss_0.item(), loss_1.item()

    if args.resume is not None:
        accelerator.load_state(str(args.resume))
        records = []
        for _ in range(args.steps):
            batch = progress.steps
            lr_0, lr_1 = c.current_lrs(opt_0), c.current_lrs(opt_1)  # what this update uses
            loss_0, loss_1 = update(batch)
            records.append(
                {
                    "step": batch + 1,
                    "lr": lr_0,
                    "lr_1": lr_1,
                    "optimizer_step": c.adam_step(opt_0),
                    "optimizer_step_1": c.adam_step(opt_1),
                    "scheduler_last_epoch": sched_0.scheduler.last_epoch,
                    "scheduler_last_epoch_1": sched_1.scheduler.last_epoch,
                    "loss": loss_0,
                    "loss_1": loss_1,
                }
            )
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            args.record.write_text(json.dumps(records, indent=1) + "\n")
        return

    ckpt = args.out / args.sample
    side: list[dict[str, Any]] = []  # per step: optimizer 1's LRs and model 1's loss
    saved_extra: dict[str, Any] = {}

    def step(batch: int) -> float:
        lr_1 = c.current_lrs(opt_1)
        loss_0, loss_1 = update(batch)
        side.append({"lr_1": lr_1, "loss_1": loss_1})
        return loss_0

    def optimizer_info(opt, sched) -> dict[str, Any]:
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

    def save() -> dict[str, Any]:
        accelerator.save_state(str(ckpt))
        saved_extra["progress"] = progress.state_dict()
        saved_extra["optimizers"] = [optimizer_info(opt_0, sched_0), optimizer_info(opt_1, sched_1)]
        return c.snapshot(global_step=progress.steps, optimizer=opt_0, scheduler=sched_0.scheduler)

    history, saved = c.train(step, lambda: c.current_lrs(opt_0), save)
    for h, s in zip(history, side):
        h.update(s)
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
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
    c.write_sample_manifest(
        ckpt,
        sample=args.sample,
        format="accelerate",
        model=nn.ModuleList([model_0, model_1]),
        topology={"dp": accelerator.num_processes, "tp": 1, "pp": 1, "zero_stage": None},
        saved=saved,
        history=history,
        extra={
            "distributed_type": str(accelerator.distributed_type.value),
            "mixed_precision": accelerator.mixed_precision,
            "models": models,
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
