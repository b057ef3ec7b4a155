"""Megatron-LM's learning-rate schedule (`megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.get_lr`,
core_v0.16.1), computed from what a checkpoint saves: its `opt_param_scheduler` state (`max_lr`, `min_lr`,
`lr_warmup_steps`, `lr_decay_steps`, `lr_decay_style`, `num_steps`: counted in SAMPLES), each param group's own
`max_lr` / `min_lr` (decoupled or scaled LRs) and the saved `args` (`lr_warmup_init`, the WSD settings,
`global_batch_size`: the samples one iteration adds). Megatron sets the LR of an iteration before it runs, from
`num_steps` so far: after a load at num_steps N, iteration k of the resumed run (k = 1, 2, ...) uses the LR at
N + (k - 1) x global batch. Nothing here imports Megatron.
"""

from __future__ import annotations

import math
from typing import Any

STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")


def lr_at(
    num_steps: float,
    *,
    max_lr: float,
    min_lr: float,
    warmup: float,
    decay: float,
    style: str,
    init_lr: float = 0.0,
    wsd_decay: float | None = None,
    wsd_style: str | None = None,
) -> float:
    """The LR Megatron's scheduler gives a group at `num_steps` (samples), as its get_lr computes it."""
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warmup)
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / (max(num_steps, 1) ** 0.5))
    ratio = float(num_steps - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    elif style == "WSD":
        if wsd_decay is None:
            raise ValueError("a WSD schedule needs its decay length (lr_wsd_decay_iters / _samples)")
        start = decay - wsd_decay
        if num_steps <= start:
            coeff = 1.0
        else:
            r = float(num_steps - start) / float(wsd_decay)
            if str(wsd_style) not in ("linear", "cosine", "exponential", "minus_sqrt"):
                raise ValueError(f"lr_wsd_decay_style {wsd_style!r}: not one of Megatron's")
            coeff = {
                "linear": lambda: 1.0 - r,
                "cosine": lambda: 0.5 * (math.cos(math.pi * r) + 1.0),
                "exponential": lambda: 2.0 * math.pow(0.5, r) - 1.0,
                "minus_sqrt": lambda: 1.0 - math.sqrt(r),
            }[str(wsd_style)]()
    else:
        raise ValueError(f"lr_decay_style {style!r}: not one of Megatron's ({', '.join(STYLES)})")
    return min_lr + coeff * (max_lr - min_lr)


def expected_lrs(
    sched: dict[str, Any], groups: list[dict[str, Any]], args: dict[str, Any], steps: int
) -> tuple[list[list[float]], str]:
    """(per resumed iteration, each group's LR; how) from the saved scheduler state, param groups and args.
    ValueError (naming the field) where the checkpoint does not determine it."""
    need = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps")
    missing = [k for k in need if sched.get(k) is None]
    if missing:
        raise ValueError(f"the saved opt_param_scheduler lacks {', '.join(missing)}")
    gbs = args.get("global_batch_size")
    if not isinstance(gbs, int) or gbs < 1:
        raise ValueError("the saved args hold no global_batch_size (the samples one iteration adds to num_steps)")
    style = str(sched["lr_decay_style"])
    wsd = None
    if style == "WSD":
        wsd = args.get("lr_wsd_decay_samples") or (
            args["lr_wsd_decay_iters"] * gbs if args.get("lr_wsd_decay_iters") else None
        )
    common = dict(
        warmup=float(sched["lr_warmup_steps"]),
        decay=float(sched["lr_decay_steps"]),
        style=style,
        init_lr=float(args.get("lr_warmup_init") or 0.0),
        wsd_decay=wsd,
        wsd_style=args.get("lr_wsd_decay_style"),
    )
    rows = []
    for k in range(steps):
        n = float(sched["num_steps"]) + k * gbs
        rows.append(
            [
                lr_at(
                    n,
                    max_lr=float(g.get("max_lr", sched["max_lr"])),
                    min_lr=float(g.get("min_lr", sched["min_lr"])),
                    **common,
                )
                for g in groups
            ]
        )
    how = (
        f"Megatron's OptimizerParamScheduler ({style}, warm-up {sched['lr_warmup_steps']} and decay "
        f"{sched['lr_decay_steps']} samples, {gbs} samples per iteration) from the saved num_steps "
        f"{sched['num_steps']} and each param group's max_lr / min_lr"
    )
    return rows, how


__all__ = ["lr_at", "expected_lrs", "STYLES"]
