"""DeepSpeed's own LR schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR) as formulas.

A DeepSpeed scheduler saves only `last_batch_iteration`; its LRs come from the launch config. With the config
the checkpoint records (`ds_config`) these give the LR at any position: the header's `last_lr`, and what
`ckpt resume` expects each resumed step to use. Pure Python: no torch, no deepspeed.
"""

from __future__ import annotations

import math
from typing import Any

DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def lr_at(sched: dict[str, Any], position: int, group_lrs: list[float]) -> list[float]:
    """The LR DeepSpeed's WarmupLR / WarmupDecayLR / WarmupCosineLR give at `last_batch_iteration=position`.

    From their documented semantics: warm up from the min LR (ratio) to the max over `warmup_num_steps`
    (at least 2) iterations, by log(position + 1) / log(n) or position / n; then WarmupLR stays at the max,
    WarmupDecayLR falls linearly to 0 at `total_num_steps`, WarmupCosineLR follows a half cosine down to
    `cos_min_ratio`. Before the first step (position < 0) the LR is the min (0 for the cosine one).
    """
    kind, params = sched["type"], sched.get("params", {})
    n_groups = len(group_lrs)

    def per_group(v: Any) -> list[float]:
        return [float(x) for x in v] if isinstance(v, (list, tuple)) else [float(v)] * n_groups

    n = max(2, int(params.get("warmup_num_steps", 1000)))
    log_warmup = params.get("warmup_type", "log") != "linear"

    def warm(pos: int) -> float:
        return math.log(pos + 1) / math.log(n) if log_warmup else pos / n

    if kind == "WarmupCosineLR":
        if position < 0:
            return [0.0] * n_groups
        if position < n:
            lo = float(params.get("warmup_min_ratio", 0.0))
            ratio = lo + warm(position) * (1.0 - lo)
        else:
            total = int(params["total_num_steps"])
            progress = min(1.0, (position - n + 1) / max(1, total - n))
            cos_min = float(params.get("cos_min_ratio", 0.0001))
            ratio = max(0.0, cos_min + (1.0 - cos_min) * (1 + math.cos(math.pi * progress)) / 2)
        return [lr * ratio for lr in group_lrs]

    lo = per_group(params.get("warmup_min_lr", 0.0))
    hi = per_group(params["warmup_max_lr"]) if params.get("warmup_max_lr") is not None else list(group_lrs)
    if position < 0:
        return lo
    if position < n:
        gamma = warm(position)
    elif kind == "WarmupDecayLR":
        total = int(params["total_num_steps"])
        gamma = max(0.0, (total - position) / max(1.0, total - n))
    else:
        gamma = 1.0
    return [a + (b - a) * gamma for a, b in zip(lo, hi)]


def last_lr(ds_config: Any, last_batch_iteration: Any, group_lrs: list[float]) -> tuple[float, ...] | None:
    """The LR per group in effect after the saved position (None when the config names no scheduler we know).
    `group_lrs`: the optimizer's LR from the config (WarmupCosineLR scales it), else the groups' saved lr."""
    sched = ds_config.get("scheduler") if isinstance(ds_config, dict) else None
    if not isinstance(sched, dict) or sched.get("type") not in DS_SCHEDULERS or not group_lrs:
        return None
    if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int):
        return None
    opt_lr = ((ds_config.get("optimizer") or {}).get("params") or {}).get("lr")
    base = [float(opt_lr)] * len(group_lrs) if isinstance(opt_lr, (int, float)) else list(group_lrs)
    try:
        return tuple(lr_at(sched, last_batch_iteration, base))
    except (KeyError, TypeError, ValueError):
        return None
