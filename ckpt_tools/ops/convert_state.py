"""What `ckpt convert` carries of a run beside its tensors: the source's LR scheduler as a torch scheduler's state
(`translate_scheduler`), and one line for each thing the source holds that the conversion does not move
(`not_moved_lines`).
"""

from __future__ import annotations

from typing import Any

from ..read.state import COUNTER_KEYS, is_scheduler_state
from ..read.tree import node_to_python
from ..train.replica_layout import infer_torch_scheduler
from .convert_plan import MOVED_CHILDREN


def plain_scheduler(ck) -> dict[str, Any] | None:
    """The source's scheduler state as plain Python (`read.tree.node_to_python`), None where it holds none (or an
    empty / non-dict one)."""
    node = ck.tree.children.get("scheduler")
    if node is None:
        return None
    val = node_to_python(node)
    return val if isinstance(val, dict) and val else None


def translate_scheduler(
    state: dict[str, Any] | None, config: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, str | None, list[str], list[str]]:
    """(torch state dict, torch class name, notes, not moved) for the source's scheduler state."""
    if state is None:
        return None, None, ["the source has no LR scheduler: the LR stays at the param groups' lr"], []
    if "last_batch_iteration" not in state:
        return _torch_scheduler(state)
    return _deepspeed_scheduler(state, config, groups)


def _torch_scheduler(state: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None, list[str], list[str]]:
    """`translate_scheduler` of a state that is not DeepSpeed's: a torch scheduler's as it is, Megatron's
    OptimizerParamScheduler listed as not moved."""
    megatron = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "num_steps")
    if all(k in state for k in megatron):
        # Megatron-LM's OptimizerParamScheduler: a closed form over SAMPLES with a clamp at min_lr; no torch
        # scheduler computes it (LinearLR + CosineAnnealingLR step per call, recursively, and never clamp)
        return (
            None,
            None,
            [],
            [
                f"scheduler: Megatron's OptimizerParamScheduler ({state['lr_decay_style']}, LR "
                f"{state['max_lr']:g} -> "
                f"{state['min_lr']:g}, warm-up {state['lr_warmup_steps']} and decay "
                f"{state['lr_decay_steps']} samples, "
                f"at num_steps {state['num_steps']}): no torch scheduler computes the same schedule; the param "
                "groups' current lr is carried, so set the target's schedule to continue from there"
            ],
        )
    if not is_scheduler_state(state):
        return None, None, [], [f"scheduler state with keys {sorted(state)}: not a scheduler state dict"]
    cls = infer_torch_scheduler(state)
    return dict(state), cls, [f"scheduler: the torch {cls or 'scheduler'} state dict, as saved"], []


def _deepspeed_scheduler(
    state: dict[str, Any], config: dict[str, Any], groups: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, str | None, list[str], list[str]]:
    """`translate_scheduler` of DeepSpeed's own scheduler: its linear WarmupLR as torch's LinearLR, any other kept
    as saved (listed)."""
    # DeepSpeed's own scheduler: only the position is saved; its parameters are in the DeepSpeed config
    sched = config.get("scheduler") if isinstance(config.get("scheduler"), dict) else {}
    kind, params = sched.get("type"), dict(sched.get("params") or {})
    it = int(state["last_batch_iteration"])
    n = len(groups)
    if kind == "WarmupLR" and params.get("warmup_type", "log") == "linear":
        lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
        lo = lo if isinstance(lo, list) else [lo] * n
        hi = hi if isinstance(hi, list) else [hi] * n
        total = int(params.get("warmup_num_steps", 1000))
        if len(set(zip(lo, hi))) != 1 or not hi[0]:
            return (
                dict(state),
                None,
                [],
                [
                    f"DeepSpeed {kind} with per-group limits {lo}->{hi}: no single torch "
                    "LinearLR equivalent; its state is kept as saved ({'last_batch_iteration': ...})"
                ],
            )
        start = lo[0] / hi[0]
        lrs = [float(lo[0] + (hi[0] - lo[0]) * min(1.0, max(it, 0) / total))] * n
        out = {
            "start_factor": start,
            "end_factor": 1.0,
            "total_iters": total,
            "base_lrs": [float(h) for h in hi],
            "last_epoch": it,
            "_step_count": it + 1,
            "_is_initial": False,
            "_get_lr_called_within_step": False,
            "_last_lr": lrs,
        }
        note = (
            f"scheduler: DeepSpeed WarmupLR (linear, {lo[0]:g} -> {hi[0]:g} over {total} steps, "
            f"last_batch_iteration {it}) translated to torch LinearLR(start_factor={start:g}, end_factor=1.0, "
            f"total_iters={total}) with last_epoch {it}: the same LR at every step"
        )
        if start <= 0:
            note += (
                "; LinearLR's constructor refuses start_factor 0, so build it with any start_factor and "
                "load_state_dict (the saved start_factor 0 is what it then uses)"
            )
        return out, "LinearLR", [note], []
    return (
        dict(state),
        None,
        [],
        [
            f"DeepSpeed scheduler {kind or '(unknown type)'} {params}: torch has no "
            "equivalent class; its state is kept as saved ({'last_batch_iteration': "
            f"{it}}}) and the target loop must rebuild it"
        ],
    )


#: tree children that hold a launch configuration (not training state): reported in one line
_CONFIG_CHILDREN = ("config", "training_args", "args", "hparams", "hyper_parameters")
_DATA_WORDS = ("tokens", "seen", "consumed", "dataloader", "data_loader", "data_sampler", "batches_yielded", "samples")


def _names(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def not_moved_lines(ck, config: dict[str, Any]) -> list[str]:
    """What the source holds that the conversion does not carry, one line each."""
    out: list[str] = []
    for name, node in ck.tree.children.items():
        if name in MOVED_CHILDREN or name.startswith(("model_", "optimizer_")):
            continue
        if name == "universal_checkpoint_info":
            out.append(
                f"{name}: DeepSpeed's TP merge metadata; used to merge the TP shards (the output holds whole tensors)"
            )
            continue
        if name in _CONFIG_CHILDREN:
            out.append(
                f"{name}: the source framework's launch configuration (for DeepSpeed, ds_config); the "
                "target's own training config replaces it"
            )
            continue
        val = node_to_python(node)
        keys = []
        for k, v in val.items() if isinstance(val, dict) else ():
            if isinstance(v, dict) and v and k not in ("args", "dataloader") and len(v) <= 16:
                keys += [f"{k}.{kk}" for kk in v if kk not in COUNTER_KEYS]  # train_state.ntokens_seen
            elif k not in COUNTER_KEYS:  # the step moves as the target's counter
                keys.append(k)
        keys.sort()
        if not keys:
            continue
        rng = [k for k in keys if "rng" in k.lower() or "random" in k.lower()]
        data = [k for k in keys if k not in rng and any(w in k.rsplit(".", 1)[-1].lower() for w in _DATA_WORDS)]
        rest = [k for k in keys if k not in rng and k not in data]
        detail = []
        if rng:
            detail.append(f"RNG states ({_names(rng)}): the target seeds its own")
        if data:
            detail.append(f"data position ({_names(data)}): the target's data loader must be positioned by hand")
        if rest:
            detail.append(f"other fields ({_names(rest)})")
        out.append(f"{name}: " + "; ".join(detail))
    c = ck.counters
    if getattr(c, "skipped_steps", None):
        out.append(f"skipped_steps={c.skipped_steps} (DeepSpeed's overflow count): no equivalent in the target")
    if isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled"):
        out.append("fp16 loss scaler state: the target framework keeps its own (torch GradScaler)")
    return out
