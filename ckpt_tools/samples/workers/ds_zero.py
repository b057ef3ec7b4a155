"""DeepSpeed ZeRO samples: real `engine.save_checkpoint` output from 2 CPU ranks over gloo.

Each sample varies one thing a reader must handle: the ZeRO stage (1/2/3, which changes the file set
and how the optimizer state is partitioned), the precision (the `bf16_` prefix of the optim files),
and where the LR schedule lives (nowhere; a torch LambdaLR whose full state_dict is saved; DeepSpeed's
WarmupLR, which saves only `last_batch_iteration`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpt_tools.samples.workers import _common as c


@dataclass(frozen=True)
class ZeroVariant:
    stage: int
    bf16: bool = True
    scheduler: str | None = None  # None, "lambdalr" (torch, built here) or "warmuplr" (DeepSpeed config)
    frozen: tuple[str, ...] = ()  # parameters with requires_grad=False (ZeRO-1 writes them only in `module`)
    exclude_frozen: bool = False  # save_checkpoint(exclude_frozen_parameters=True)


VARIANTS = {
    "zero1_bf16": ZeroVariant(stage=1),
    "zero2_bf16": ZeroVariant(stage=2),
    "zero3_bf16": ZeroVariant(stage=3),
    "zero2_fp32": ZeroVariant(stage=2, bf16=False),
    "zero2_lambdalr": ZeroVariant(stage=2, scheduler="lambdalr"),
    "zero2_warmuplr": ZeroVariant(stage=2, scheduler="warmuplr"),
    "zero1_frozen": ZeroVariant(stage=1, frozen=("wpe.weight",)),
    # made by tests only (not a committed sample): the frozen weight left out of the checkpoint
    "zero2_frozen_excluded": ZeroVariant(stage=2, frozen=("wpe.weight",), exclude_frozen=True),
}


def ds_config(v: ZeroVariant, dp: int) -> dict[str, Any]:
    """The DeepSpeed config for one variant.

    The optimizer is given in the config (torch's AdamW: DeepSpeed's FusedAdam needs CUDA) unless a torch
    scheduler is used: a torch scheduler must wrap a torch optimizer we build, so then the config has none.
    """
    cfg = c.ds_config(v.stage, dp, bf16={"enabled": v.bf16})
    if v.scheduler != "lambdalr":
        cfg["optimizer"] = c.ds_adamw()
    if v.scheduler == "warmuplr":
        # A non-zero floor: with 0, WarmupLR's first two updates (iterations -1 and 0) would both run at LR 0.
        cfg["scheduler"] = {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": c.PEAK_LR / 10,
                "warmup_max_lr": c.PEAK_LR,
                "warmup_num_steps": c.WARMUP_STEPS,
                "warmup_type": "linear",
            },
        }
    return cfg


def main() -> None:
    args, rank, dp = c.ds_setup()
    v = VARIANTS[args.sample]
    cfg = ds_config(v, dp)

    model = c.build_model()
    for name, p in model.named_parameters():
        if name in v.frozen:
            p.requires_grad_(False)
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in c.param_groups(model)]
    optimizer = scheduler = None
    if v.scheduler == "lambdalr":
        optimizer, scheduler = c.adamw_with_lambdalr(groups)
    engine = c.ds_initialize(model, cfg, groups=groups, optimizer=optimizer, scheduler=scheduler)
    ckpt = args.out / args.sample
    history, saved = c.ds_train(
        engine, ckpt, lambda step: c.tokens_for_step(step, rank), exclude_frozen_parameters=v.exclude_frozen
    )
    if rank == 0:
        # Parameters are counted on an unwrapped copy: ZeRO-3 leaves the live module's as empty placeholders.
        c.write_sample_manifest(
            ckpt,
            sample=args.sample,
            format="deepspeed_zero",
            model=c.build_model(),
            topology={"dp": dp, "tp": 1, "pp": 1, "zero_stage": v.stage},
            saved=saved,
            history=history,
            extra={
                "ds_config": cfg,
                "dtype": "bfloat16" if v.bf16 else "float32",
                "tag": f"global_step{c.SAVE_AFTER_STEP}",
                "scheduler": {
                    None: None,
                    "lambdalr": "torch LambdaLR (warmup then decay), passed to deepspeed.initialize with a torch AdamW",
                    "warmuplr": "DeepSpeed WarmupLR from the config",
                }[v.scheduler],
                "optimizer": type(c.innermost_optimizer(engine.optimizer)).__name__,
                "param_groups": c.PARAM_GROUPS_NOTE,
                "frozen": list(v.frozen),
            },
        )


if __name__ == "__main__":
    main()
    c.shutdown()
