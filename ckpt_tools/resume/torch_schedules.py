"""The LR a torch scheduler prescribes for each resumed update, computed here from its SAVED state dict and the
saved param groups (never asked of a rebuilt scheduler): `torch_scheduler_kind` tells the class from the state's
keys, `torch_expected_lrs` gives the rows. Used by the Accelerate, DCP and Lightning planners."""

from __future__ import annotations

import math
from typing import Any, Callable


def torch_scheduler_kind(state: dict[str, Any]) -> str | None:
    """The torch scheduler class a saved state dict belongs to, from its keys (None: not a torch scheduler)."""
    keys = set(map(str, state))
    if "last_epoch" not in keys:
        return None
    if "total_steps" in keys and "_schedule_phases" in keys:
        return "OneCycleLR"
    if "lr_lambdas" in keys:
        return "LambdaLR"  # MultiplicativeLR saves the same keys; its factor is not in the checkpoint either
    if "milestones" in keys:
        return "MultiStepLR"
    if "step_size" in keys:
        return "StepLR"
    if "T_max" in keys:
        return "CosineAnnealingLR"
    if {"start_factor", "end_factor"} <= keys:
        return "LinearLR"
    if "factor" in keys and "total_iters" in keys:
        return "ConstantLR"
    if "gamma" in keys:
        return "ExponentialLR"
    return None


def _anneal(kind: str, start: float, end: float, pct: float) -> float:
    if kind == "linear":
        return (end - start) * pct + start
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def torch_expected_lrs(
    state: dict[str, Any] | None,
    groups: list[dict[str, Any]],
    steps: int,
    *,
    per_update: int = 1,
    lr_fn: Callable[[int], float] | None = None,
    fn_name: str | None = None,
) -> tuple[list[list[float] | None], str]:
    """The LR per group of each resumed update, from the SAVED scheduler state and optimizer param groups.

    Update k uses the LR set after `per_update * k` scheduler steps past the saved `last_epoch` (update 0: the
    saved param_groups lr). Entries are None where the saved state does not determine the LR (a LambdaLR
    without its function). Returns (rows, how)."""
    lrs = [float(g["lr"]) for g in groups]
    if not state:
        return [lrs for _ in range(steps)], "no scheduler state: the saved param_groups lr, constant"
    kind = torch_scheduler_kind(state)
    last = int(state["last_epoch"])
    epochs = [last + per_update * k for k in range(steps)]
    src = f"saved {kind} state last_epoch={last}" + (
        f", {per_update} scheduler steps per update" if per_update != 1 else ""
    )
    if kind in ("LambdaLR", "MultiplicativeLR"):
        return _function_rows(kind, state, lrs, last, epochs, steps, src, lr_fn, fn_name)
    if kind == "OneCycleLR":
        return _one_cycle_rows(state, groups, epochs, src)
    return _chained_rows(kind, state, lrs, last, epochs, steps, src)


def _function_rows(
    kind: str,
    state: dict[str, Any],
    lrs: list[float],
    last: int,
    epochs: list[int],
    steps: int,
    src: str,
    lr_fn: Callable[[int], float] | None,
    fn_name: str | None,
) -> tuple[list[list[float] | None], str]:
    """LambdaLR / MultiplicativeLR: the saved lr first, then the user's function (`--scheduler`), which the
    checkpoint does not hold (None rows without it)."""
    rows: list[list[float] | None] = [lrs]
    if lr_fn is None:
        return rows + [None] * (steps - 1), (
            f"{src}: the first update uses the saved lr; the later ones need "
            "the lambda (--scheduler module:function), not in the checkpoint"
        )
    if kind == "MultiplicativeLR":
        cur = list(lrs)
        prev = last
        for e in epochs[1:]:
            for x in range(prev + 1, e + 1):
                cur = [v * lr_fn(x) for v in cur]
            prev = e
            rows.append(list(cur))
        return rows, f"{src} x {fn_name}"
    base = [float(b) for b in state["base_lrs"]]
    return rows + [[b * lr_fn(e) for b in base] for e in epochs[1:]], f"{src}: base_lrs x {fn_name}(epoch)"


def _one_cycle_rows(
    state: dict[str, Any], groups: list[dict[str, Any]], epochs: list[int], src: str
) -> tuple[list[list[float] | None], str]:
    """OneCycleLR: every update's LR from the saved phases and the param groups' phase bounds."""
    phases = state["_schedule_phases"]
    if isinstance(phases, dict):  # the tree keeps a list as {"0": ..., "1": ...}
        phases = [phases[k] for k in sorted(phases, key=int)]
    total = int(state["total_steps"])
    anneal = "linear" if state.get("_anneal_func_type") == "linear" else "cos"
    out: list[list[float] | None] = []
    for e in epochs:
        row = []
        for g in groups:
            start_step, val = 0.0, None
            for i, ph in enumerate(phases):
                end_step = float(ph["end_step"])
                if e <= end_step or i == len(phases) - 1:
                    pct = (e - start_step) / (end_step - start_step)
                    val = _anneal(anneal, float(g[ph["start_lr"]]), float(g[ph["end_lr"]]), pct)
                    break
                start_step = float(ph["end_step"])
            row.append(val if e < total else float("nan"))
        out.append(row)
    return out, f"{src}: OneCycleLR ({anneal}, total_steps {total}) from the saved phases and param groups"


def _chained_step(kind: str | None, state: dict[str, Any], cur: list[float], x: int) -> list[float] | None:
    """The LRs after scheduler epoch `x`, chained from those before it as torch's `get_lr` does (None: no formula
    here for `kind`)."""
    if kind == "StepLR":
        if x % int(state["step_size"]) == 0:
            cur = [v * float(state["gamma"]) for v in cur]
        return cur
    if kind == "MultiStepLR":
        ms = state["milestones"]
        n = int(ms.get(x, ms.get(str(x), 0))) if isinstance(ms, dict) else list(ms).count(x)
        return [v * float(state["gamma"]) ** n for v in cur]
    if kind == "ExponentialLR":
        return [v * float(state["gamma"]) for v in cur]
    if kind == "CosineAnnealingLR":
        T, eta = float(state["T_max"]), float(state.get("eta_min", 0.0))
        base = [float(b) for b in state["base_lrs"]]
        if (x - 1 - T) % (2 * T) == 0:
            return [v + (b - eta) * (1 - math.cos(math.pi / T)) / 2 for v, b in zip(cur, base)]
        return [(1 + math.cos(math.pi * x / T)) / (1 + math.cos(math.pi * (x - 1) / T)) * (v - eta) + eta for v in cur]
    return None


def _chained_rows(
    kind: str | None, state: dict[str, Any], lrs: list[float], last: int, epochs: list[int], steps: int, src: str
) -> tuple[list[list[float] | None], str]:
    """The chainable schedulers (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR): each update's LR stepped
    from the saved param_groups lr; None from the first epoch with no formula here."""
    cur = list(lrs)
    prev = last
    out: list[list[float] | None] = [list(cur)]
    for e in epochs[1:]:
        for x in range(prev + 1, e + 1):
            nxt = _chained_step(kind, state, cur, x)
            if nxt is None:
                return out + [None] * (steps - len(out)), f"{src}: no formula here for {kind} after the first update"
            cur = nxt
        prev = e
        out.append(list(cur))
    return out, f"{src}: chained from the saved param_groups lr"
