"""What a resume is judged on, shared by every framework's resume (`resume.deepspeed_verdict` for DeepSpeed,
`resume.framework_run` for the others): the counters and scheduler state a checkpoint records, read without the
engine (`saved_state`), one update's record (`StepRecord`), the verdict's rows (`Check`, `CheckRow`) and the
result (`ResumeResult`), how a model's parameters differ from a checkpoint's (`mismatch`), and when two LRs are
the same (`lrs_close`)."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..read.tree import Checkpoint, GroupNode, node_to_python

# Keys a training script may keep in the client state for the loss at the checkpoint (Megatron logs it
# elsewhere; many custom loops save one of these).
CLIENT_LOSS_KEYS = ("loss", "lm_loss", "train_loss", "last_loss")
LR_REL_TOL = 1e-6


def lrs_close(a: float, b: float) -> bool:
    """An LR the resumed run used against the one expected: equal to `LR_REL_TOL` (1e-12 absolute near 0)."""
    return math.isclose(a, b, rel_tol=LR_REL_TOL, abs_tol=1e-12)


# --- what the checkpoint says, read without the engine --------------------------------------------


@dataclass(frozen=True)
class SavedState:
    """Counters and scheduler state as the checkpoint records them (None: not recorded)."""

    format: str
    global_step: int | None
    optimizer_step: int | None
    skipped_steps: int | None
    param_group_lrs: tuple[float, ...]
    initial_lrs: tuple[float, ...] | None  # torch schedulers' `initial_lr` in the saved param groups
    scheduler_state: str  # "torch", "deepspeed" or "none"
    scheduler_position: int | None  # torch `last_epoch` / DeepSpeed `last_batch_iteration`
    base_lrs: tuple[float, ...] | None
    loss: float | None  # a loss found in the client state
    loss_key: str | None
    ds_config: dict[str, Any]
    has_universal_info: bool
    dp: int
    tp: int
    pp: int
    scheduler_saved: dict[str, Any] | None = None  # a torch scheduler's saved state dict (JSON-safe copy)
    group_options: tuple[dict[str, Any], ...] = ()  # the saved param groups without `params` (JSON-safe)


def _json_safe(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=lambda o: dict(o) if isinstance(o, collections.Counter) else repr(o)))


def saved_state(ck: Checkpoint) -> SavedState:
    kids = ck.tree.children
    sched = node_to_python(kids.get("scheduler", GroupNode())) or {}
    if "last_batch_iteration" in sched:
        kind, position = "deepspeed", sched["last_batch_iteration"]
    elif "last_epoch" in sched:
        kind, position = "torch", sched["last_epoch"]
    else:
        kind, position = "none", None
    groups = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) or {}
    initial = [g.get("initial_lr") for _, g in sorted(groups.items(), key=lambda kv: int(kv[0]))]
    client = node_to_python(kids.get("client_state", GroupNode())) or {}
    loss_key = next((k for k in CLIENT_LOSS_KEYS if isinstance(client.get(k), (int, float))), None)
    topo = ck.topology
    return SavedState(
        format=ck.format,
        global_step=ck.counters.global_step,
        optimizer_step=ck.counters.optimizer_step,
        skipped_steps=ck.counters.skipped_steps,
        param_group_lrs=tuple(ck.lr.param_groups),
        initial_lrs=tuple(initial) if initial and all(x is not None for x in initial) else None,
        scheduler_state=kind,
        scheduler_position=position,
        base_lrs=tuple(ck.lr.base_lrs) if ck.lr.base_lrs else None,
        loss=float(client[loss_key]) if loss_key else None,
        loss_key=loss_key,
        ds_config=node_to_python(kids.get("config", GroupNode())) or {},
        has_universal_info=bool(node_to_python(kids.get("universal_checkpoint_info", GroupNode()))),
        dp=topo.dp or 1,
        tp=topo.tp or 1,
        pp=topo.pp or 1,
        scheduler_saved=_json_safe(sched) if kind == "torch" else None,
        group_options=tuple(
            _json_safe({k: v for k, v in g.items() if k != "params"})
            for _, g in sorted(groups.items(), key=lambda kv: int(kv[0]))
        ),
    )


def _names(items: list[str], limit: int = 4) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more" if len(items) > limit else "")


def mismatch(have: dict[str, tuple], want: dict[str, tuple]) -> list[str]:
    """How a model's parameters (`have`: name -> shape) differ from a checkpoint's (`want`): "missing ...",
    "unexpected ...", "shape differs: ..." parts, [] when they match."""
    missing = [n for n in have if n not in want]
    unexpected = [n for n in want if n not in have]
    shapes = [f"{n} {list(have[n])} vs {list(want[n])}" for n in have if n in want and have[n] != want[n]]
    parts = []
    if missing:
        parts.append(f"missing {_names(missing)}")
    if unexpected:
        parts.append(f"unexpected {_names(unexpected)}")
    if shapes:
        parts.append(f"shape differs: {_names(shapes, 2)}")
    return parts


# --- the verdict ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    loss_mean: float
    lr: tuple[float, ...]
    grad_norm: float | None
    optimizer_step: int | None
    tokens_per_s: float | None
    seconds: float
    skipped_steps: int


@dataclass(frozen=True)
class CheckRow:
    step: int
    expected: Any
    actual: Any
    ok: bool


@dataclass(frozen=True)
class Check:
    """One line of the verdict: status is "pass", "fail" or "n/a" (not available, with the reason)."""

    name: str
    status: str
    detail: str
    rows: tuple[CheckRow, ...] = ()


def judged(name: str, rows: Sequence[CheckRow], passed: str, failed: str, *, need_rows: bool = False) -> Check:
    """A check that passes where every row does (and, with `need_rows`, where there is a row at all), saying
    `passed` or `failed`."""
    ok = all(r.ok for r in rows) and (bool(rows) or not need_rows)
    return Check(name, "pass" if ok else "fail", passed if ok else failed, tuple(rows))


@dataclass(frozen=True)
class ResumeResult:
    plan: Any  # a DeepSpeed `ResumePlan` or another framework's `FrameworkPlan`
    setup: dict[str, Any]
    loaded: dict[str, Any]
    records: tuple[StepRecord, ...]
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        plan = asdict(self.plan) if dataclasses.is_dataclass(self.plan) else dict(vars(self.plan))
        return {
            "ok": self.ok,
            "plan": plan,
            "setup": self.setup,
            "loaded": self.loaded,
            "records": [asdict(r) for r in self.records],
            "checks": [asdict(c) for c in self.checks],
        }
