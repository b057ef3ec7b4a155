"""A DeepSpeed checkpoint of a model `ckpt` has never seen: what the model-free `ckpt resume` must handle.

A 3-block MLP language model — `embed`, `blocks.N.norm1/proj_in/proj_out/norm2`, `head` — trained by real
DeepSpeed (2 CPU ranks, gloo) with a torch AdamW of two param groups with different LRs and weight decays
(matrices; norms and biases) and a torch CosineAnnealingLR (not a LambdaLR: its state dict rebuilds it).
The same 6-step recipe as the other samples: saved after step 4.

Variants: `unseen_zero2` (ZeRO-2, bf16), `unseen_zero1_tied` (ZeRO-1, bf16, `head.weight` tied to
`embed.weight` and `blocks.0.norm1.weight` frozen: shared and frozen parameters), `unseen_zero3` (ZeRO-3,
fp32, DeepSpeed's AdamW from the config and its WarmupLR), `unseen_zero2_sgd` (ZeRO-2, fp32, torch SGD with
Nesterov momentum and a StepLR).

Run: `python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.ds_unseen --sample
unseen_zero2 --out DIR` (made by tests in a temporary folder; not a committed sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ckpt_tools.samples.workers import _common as c
from ckpt_tools.train.data import batch_for_step

VOCAB = 48
DIM = 16
HIDDEN = 32
BLOCKS = 3
SEQ = 12
LRS = (3e-3, 1e-3)  # group 0: matrices (weight decay), group 1: norms and biases (none)
WEIGHT_DECAYS = (0.05, 0.0)


@dataclass(frozen=True)
class Variant:
    stage: int
    bf16: bool = True
    tied: bool = False
    frozen: tuple[str, ...] = ()
    ds_optimizer: bool = False  # DeepSpeed's AdamW + WarmupLR from the config instead of torch's
    sgd: bool = False  # torch SGD with momentum (nesterov) and a StepLR instead of AdamW + cosine


VARIANTS = {
    "unseen_zero2": Variant(stage=2),
    "unseen_zero1_tied": Variant(stage=1, tied=True, frozen=("blocks.0.norm1.weight",)),
    "unseen_zero3": Variant(stage=3, bf16=False, ds_optimizer=True),
    "unseen_zero2_sgd": Variant(stage=2, bf16=False, sgd=True),
}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.proj_in = torch.nn.Linear(DIM, HIDDEN)
        self.proj_out = torch.nn.Linear(HIDDEN, DIM)
        self.norm2 = torch.nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj_out(F.gelu(self.proj_in(self.norm1(x))))
        return self.norm2(x)


class MLPLM(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(v: Variant) -> MLPLM:
    torch.manual_seed(c.SEED)
    model = MLPLM(v.tied)
    for name, p in model.named_parameters():
        if name in v.frozen:
            p.requires_grad_(False)
    return model


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    return c.split_groups(
        model, {"lr": LRS[0], "weight_decay": WEIGHT_DECAYS[0]}, {"lr": LRS[1], "weight_decay": WEIGHT_DECAYS[1]}
    )


def ds_config(v: Variant, dp: int) -> dict[str, Any]:
    cfg = c.ds_config(v.stage, dp, bf16={"enabled": v.bf16})
    if v.sgd:
        cfg["zero_allow_untested_optimizer"] = True  # torch SGD is not on ZeRO's list of tested optimizers
    if v.ds_optimizer:
        cfg["optimizer"] = c.ds_adamw(lr=LRS[0], betas=(0.9, 0.98), weight_decay=WEIGHT_DECAYS[0])
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": LRS[0], "warmup_num_steps": 3, "warmup_type": "linear"},
        }
    return cfg


def tokens(step: int, rank: int) -> torch.Tensor:
    return batch_for_step(step, batch_size=c.MICRO_BATCH, seq_len=SEQ, vocab_size=VOCAB, dp_rank=rank)


def main() -> None:
    args, rank, dp = c.ds_setup()
    v = VARIANTS[args.sample]
    cfg = ds_config(v, dp)
    model = build(v)
    param_groups = groups(model)
    optimizer = scheduler = None
    if v.sgd:
        optimizer = torch.optim.SGD(param_groups, momentum=0.9, nesterov=True)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    elif not v.ds_optimizer:
        optimizer = torch.optim.AdamW(param_groups, betas=(0.9, 0.98), eps=1e-8)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10, eta_min=1e-4)
    engine = c.ds_initialize(model, cfg, groups=param_groups, optimizer=optimizer, scheduler=scheduler)

    def sgd_saved() -> dict[str, Any]:  # SGD keeps no step counter: the snapshot's Adam step does not apply
        sched = engine.lr_scheduler
        return {
            "counters": {
                "global_step": int(engine.global_steps),
                "optimizer_step": None,
                "scheduler_last_epoch": sched.last_epoch,
                "scheduler_step_count": sched._step_count,
                "skipped_steps": engine.skipped_steps,
            },
            "lr": {
                "param_groups": c.current_lrs(engine.optimizer),
                "base_lrs": [float(x) for x in sched.base_lrs],
                "last_lr": [float(x) for x in sched.get_last_lr()],
            },
        }

    ckpt = args.out / args.sample
    history, saved = c.ds_train(engine, ckpt, lambda step: tokens(step, rank), saved=sgd_saved if v.sgd else None)
    if rank == 0:
        c.write_sample_manifest(
            ckpt,
            sample=args.sample,
            format="deepspeed_zero",
            model=build(v),
            topology={"dp": dp, "tp": 1, "pp": 1, "zero_stage": v.stage},
            saved=saved,
            history=history,
            extra={
                "ds_config": cfg,
                "dtype": "bfloat16" if v.bf16 else "float32",
                "tag": f"global_step{c.SAVE_AFTER_STEP}",
                "model": "3-block MLP LM (embed, blocks.N.norm1/proj_in/proj_out/norm2, head)",
                "tied": {"head.weight": "embed.weight"} if v.tied else {},
                "frozen": list(v.frozen),
                "scheduler": "DeepSpeed WarmupLR"
                if v.ds_optimizer
                else "torch StepLR(2, 0.5)"
                if v.sgd
                else "torch CosineAnnealingLR(T_max=10)",
                "param_groups": f"lr {LRS}, weight_decay {WEIGHT_DECAYS}",
            },
        )


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
