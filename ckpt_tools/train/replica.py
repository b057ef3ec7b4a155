"""A stand-in for the user's model, built from a checkpoint, and the closed-form optimizer maths to check it with.

`ckpt resume` without the user's code (the model-free check): the real framework loads the checkpoint into a
*replica* — a module whose `named_parameters()` are the checkpoint's parameters (names, shapes, dtypes,
order, frozen and tied parameters) — and trains it with a synthetic loss whose gradient is known exactly:

    loss = sum over trainable parameters p of (p.float() * r_p).sum()      =>   d loss / d p = r_p

`r_p` is a fixed seeded direction per parameter (`synthetic_directions`), made of small multiples of a power
of two, so it is exact in bf16 and fp16 and its sum over data-parallel ranks / accumulation steps stays
exact. Knowing the gradient, one resumed Adam (or SGD) step has a closed form (`expected_adam`,
`expected_sgd`) applied to the state the checkpoint saved: that is what proves the optimizer state, the
step counter and the LR continue, without the user's model or data.

Shared API (other framework resumers import it; keep names and signatures):

    ParamSpec(name, shape, dtype, requires_grad=True)
    build_replica(specs, *, tied=None, buffers=None) -> torch.nn.Module
    synthetic_directions(specs, seed=0, *, max_norm=None) -> {name: fp32 tensor}
    synthetic_loss(module, directions) -> scalar tensor
    expected_adam(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas, eps, weight_decay, decoupled,
                  amsgrad=False, max_exp_avg_sq=None) -> {"param", "exp_avg", "exp_avg_sq", "step"[, "max_exp_avg_sq"]}
    expected_sgd(param, grad, momentum_buffer, *, lr, momentum, dampening, weight_decay, nesterov)
                  -> {"param", "momentum_buffer"}
    specs_from_checkpoint(ck) -> (list[ParamSpec], tied {alias: owner})       # DeepSpeed trees
    groups_from_checkpoint(ck) -> list[GroupSpec]                             # DeepSpeed trees
    clip_factor(directions, max_norm) -> float                                # DeepSpeed's clip of r
    infer_torch_scheduler(state) -> class name | None; rebuild_torch_scheduler(optimizer, state) -> scheduler
    state_close(got, want, kind) -> (ok, max |diff|, tolerance)               # the fp32 tolerance

Nothing here launches processes.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Mapping, Sequence

import torch
from torch.optim import lr_scheduler as S

from .replica_layout import (
    _SCHED_GROUP_KEYS,
    _TORCH_SCHEDULERS,
    LAMBDA_SCHEDULERS,
    GroupSpec,
    ParamSpec,
    groups_from_checkpoint,
    infer_torch_scheduler,
    replica_layout,
    specs_from_checkpoint,
)

#: the tolerance of the optimizer-state check (the engine computes in fp32, the formula here in float64 from
#: the saved fp32 state): a moment tensor passes when max |got - want| <= MOMENT_RTOL * max |want| (+ 1e-30);
#: a parameter when max |got - want| <= PARAM_ULPS * fp32 eps * |want| + UPDATE_RTOL * |want - saved| per
#: element. A zeroed or reset Adam moment, a lost step counter or another LR moves them by orders more.
MOMENT_RTOL = 1e-5
PARAM_ULPS = 4
UPDATE_RTOL = 1e-3


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dt


class _Node(torch.nn.Module):
    """A container of a replica. Its forward adds its own parameters' terms of the synthetic loss and calls its
    children: run through an engine, each module's forward is where ZeRO-3 gathers that module's parameters."""

    def forward(
        self, directions: Mapping[str, torch.Tensor], prefix: str = "", seen: set[int] | None = None
    ) -> torch.Tensor | None:
        seen = set() if seen is None else seen
        total = None
        for leaf, p in self._parameters.items():
            r = directions.get(prefix + leaf)
            if p is None or r is None or not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            term = (p.float() * r.to(device=p.device)).sum()
            total = term if total is None else total + term
        for name, child in self._modules.items():
            sub = child(directions, f"{prefix}{name}.", seen)
            if sub is not None:
                total = sub if total is None else total + sub
        return total


class Replica(_Node):
    """Root of a replica: `named_parameters()` yields the specs' order even where the nesting alone would not
    (a module's own parameters come before its children's in torch's walk). Calling it with the directions
    returns the synthetic loss."""

    def __init__(self) -> None:
        super().__init__()
        self._order: list[str] = []

    def forward(
        self,
        directions: Mapping[str, torch.Tensor],
        prefix: str = "",  # type: ignore[override]
        seen: set[int] | None = None,
    ) -> torch.Tensor:
        total = super().forward(directions, prefix, seen)
        if total is None:
            raise ValueError("no trainable parameter has a direction")
        return total

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        if not recurse or prefix:
            yield from super().named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)
            return
        found = dict(super().named_parameters(remove_duplicate=False))
        seen: set[int] = set()
        for name in self._order:
            p = found[name]
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            yield name, p


def _owner(root: torch.nn.Module, dotted: str) -> tuple[torch.nn.Module, str]:
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = _Node()
            mod.add_module(part, child)
        mod = child
    return mod, leaf


def build_replica(
    specs: Sequence[ParamSpec],
    *,
    tied: Mapping[str, str] | None = None,
    buffers: Mapping[str, tuple[tuple[int, ...], str]] | None = None,
) -> torch.nn.Module:
    """A module whose `named_parameters()` yields exactly `specs` (names, shapes, dtypes, requires_grad, order).

    `tied`: alias -> owner name; the alias is registered as the very same Parameter (so, as in the real
    model, it is not listed again by `named_parameters()` but is in `state_dict()`). `buffers`: name ->
    (shape, dtype) registered as persistent buffers (DeepSpeed's strict module load needs them).
    Values are zeros: the checkpoint's load overwrites them.
    """
    root = Replica()
    params: dict[str, torch.nn.Parameter] = {}
    for s in specs:
        if s.name in params:
            raise ValueError(f"parameter {s.name!r} listed twice")
        mod, leaf = _owner(root, s.name)
        p = torch.nn.Parameter(torch.zeros(tuple(s.shape), dtype=_dtype(s.dtype)), requires_grad=s.requires_grad)
        mod.register_parameter(leaf, p)
        params[s.name] = p
    for alias, owner in (tied or {}).items():
        if owner not in params:
            raise ValueError(f"tied parameter {alias!r} -> {owner!r}: no such parameter")
        mod, leaf = _owner(root, alias)
        mod.register_parameter(leaf, params[owner])
    for name, (shape, dtype) in (buffers or {}).items():
        mod, leaf = _owner(root, name)
        mod.register_buffer(leaf, torch.zeros(tuple(shape), dtype=_dtype(dtype)))
    root._order = [s.name for s in specs]
    got = [n for n, _ in root.named_parameters()]
    assert got == root._order, (got, root._order)
    return root


# --- the synthetic loss ---------------------------------------------------------------------------------

#: |k| of r = k * 2**-e: small integers, so r is exact in bf16/fp16 and sums of a few copies stay exact
_K = (-3, -2, -1, 1, 2, 3)


def synthetic_directions(
    specs: Sequence[ParamSpec], seed: int = 0, *, max_norm: float | None = None
) -> dict[str, torch.Tensor]:
    """A fixed direction r per trainable parameter (fp32, same on every rank and every run for the same
    specs and seed): values k * 2**-e with k in ±{1, 2, 3} and one power of two e chosen so that the global
    L2 norm of r is at most half of `max_norm` (default 1.0, DeepSpeed's usual `gradient_clipping`), so a
    typical clip does not fire (`clip_factor` says what a smaller clip does)."""
    train = [s for s in specs if s.requires_grad]
    g = torch.Generator().manual_seed(int(seed))
    ks = torch.tensor(_K, dtype=torch.float32)
    raw = {s.name: ks[torch.randint(0, len(_K), tuple(s.shape), generator=g)] for s in train}
    sq = sum(float((t * t).sum()) for t in raw.values())
    target = 0.5 * (1.0 if max_norm is None or max_norm <= 0 else float(max_norm))
    e = 0 if sq == 0 else max(0, math.ceil(math.log2(math.sqrt(sq) / target)))
    e = min(e, 14)  # stay a normal fp16 number (3 * 2**-14 > fp16's smallest normal 2**-14)
    scale = 2.0**-e
    return {n: t * scale for n, t in raw.items()}


def synthetic_loss(module: torch.nn.Module, directions: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """sum_p (p.float() * r_p).sum() over the module's trainable parameters that have a direction: the gradient
    of each is exactly r_p (cast to the parameter's dtype, which is exact). A replica computes it in its
    forward (`module(directions)`, what an engine should call); any other module is summed here directly."""
    if isinstance(module, Replica):
        return module(directions)
    total = None
    for name, p in module.named_parameters():
        r = directions.get(name)
        if r is None or not p.requires_grad:
            continue
        term = (p.float() * r.to(device=p.device)).sum()
        total = term if total is None else total + term
    if total is None:
        raise ValueError("no trainable parameter has a direction")
    return total


def grad_norm(directions: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float((r.double() ** 2).sum()) for r in directions.values()))


def clip_factor(directions: Mapping[str, torch.Tensor], max_norm: float | None) -> float:
    """The factor DeepSpeed's gradient clipping applies to the gradient r (1.0 when it does not clip):
    max_norm / (norm + 1e-6) when (norm + 1e-6) / max_norm > 1."""
    if not max_norm or max_norm <= 0:
        return 1.0
    ratio = (grad_norm(directions) + 1e-6) / float(max_norm)
    return 1.0 / ratio if ratio > 1 else 1.0


# --- the closed-form optimizer steps --------------------------------------------------------------------


def _f64(t: Any) -> torch.Tensor:
    return torch.as_tensor(t).detach().to(device="cpu", dtype=torch.float64)


def expected_adam(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    step: Any,
    *,
    lr: float,
    betas: Sequence[float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    amsgrad: bool = False,
    max_exp_avg_sq: Any = None,
) -> dict[str, Any]:
    """One Adam / AdamW step in float64 from the saved state, as torch's Adam(W) (single-tensor and foreach)
    and DeepSpeed's CPU Adam (`DeepSpeedCPUAdam`, `adamw_mode`) compute it:

        step += 1
        decoupled (AdamW):  param *= 1 - lr * weight_decay          else (L2):  grad += weight_decay * param
        exp_avg    = beta1 * exp_avg    + (1 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad**2      (amsgrad: max with the saved max)
        param     -= lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)

    `exp_avg`/`exp_avg_sq` None mean a fresh state (zeros, step 0). Returns float64 tensors and the new step.
    """
    b1, b2 = float(betas[0]), float(betas[1])
    p = _f64(param).clone()
    g = _f64(grad)
    m = torch.zeros_like(p) if exp_avg is None else _f64(exp_avg).clone()
    v = torch.zeros_like(p) if exp_avg_sq is None else _f64(exp_avg_sq).clone()
    t = int(float(step or 0)) + 1
    if weight_decay:
        if decoupled:
            p = p * (1.0 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * g * g
    out: dict[str, Any] = {}
    denom_v = v
    if amsgrad:
        mx = v if max_exp_avg_sq is None else torch.maximum(_f64(max_exp_avg_sq), v)
        out["max_exp_avg_sq"] = mx
        denom_v = mx
    bc1 = 1.0 - b1**t
    bc2 = 1.0 - b2**t
    p = p - (lr / bc1) * m / (denom_v.sqrt() / math.sqrt(bc2) + eps)
    out.update(param=p, exp_avg=m, exp_avg_sq=v, step=t)
    return out


def expected_sgd(
    param: Any,
    grad: Any,
    momentum_buffer: Any,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
) -> dict[str, Any]:
    """One torch SGD step in float64: grad += wd * param; buf = grad (first step) or momentum * buf +
    (1 - dampening) * grad; grad = grad + momentum * buf (nesterov) or buf; param -= lr * grad."""
    p = _f64(param).clone()
    g = _f64(grad)
    if weight_decay:
        g = g + weight_decay * p
    buf = None
    if momentum:
        buf = g.clone() if momentum_buffer is None else momentum * _f64(momentum_buffer) + (1.0 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    return {"param": p - lr * g, "momentum_buffer": buf}


def state_close(got: Any, want: Any, kind: str, *, saved: Any = None) -> tuple[bool, float, float]:
    """(ok, max |got - want|, the tolerance used) with the module's fp32 tolerance: `kind` "param" (then
    `saved`, the parameter before the step, scales the update term) or anything else (a moment)."""
    g, w = _f64(got), _f64(want)
    if g.shape != w.shape:
        return False, math.inf, 0.0
    diff = (g - w).abs()
    if kind == "param":
        upd = (w - _f64(saved)).abs() if saved is not None else torch.zeros_like(w)
        tol_t = PARAM_ULPS * torch.finfo(torch.float32).eps * w.abs() + UPDATE_RTOL * upd + 1e-30
        bad = diff > tol_t
        worst = float(diff.max()) if diff.numel() else 0.0
        return (not bool(bad.any())), worst, float(tol_t.max()) if tol_t.numel() else 0.0
    tol = MOMENT_RTOL * (float(w.abs().max()) if w.numel() else 0.0) + 1e-30
    worst = float(diff.max()) if diff.numel() else 0.0
    return worst <= tol, worst, tol


# --- reading a DeepSpeed checkpoint's parameters without the model ------------------------------------


def rebuild_torch_scheduler(
    optimizer: torch.optim.Optimizer, state: Mapping[str, Any], class_name: str | None = None, lr_lambda: Any = None
) -> Any:
    """A torch scheduler of the saved class on `optimizer`, constructed from the arguments its state holds
    (with `lr_lambda` for a LambdaLR / MultiplicativeLR), NOT yet loaded: the caller (the engine's
    `load_checkpoint`, or `expected_torch_lrs`) loads `state` into it. Raises ValueError when unknown."""
    name = infer_torch_scheduler(state, class_name)
    if name is None:
        raise ValueError(f"cannot tell the torch scheduler from its state keys {sorted(state)}")
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    if name in LAMBDA_SCHEDULERS:
        if lr_lambda is None:
            raise ValueError(f"a {name} needs its function (--scheduler module:function)")
        return getattr(S, name)(optimizer, lr_lambda, last_epoch=-1)
    if name == "OneCycleLR":
        phases = state["_schedule_phases"]
        max_lrs = [g.get("max_lr", g["lr"]) for g in optimizer.param_groups]  # saved groups keep max_lr
        return S.OneCycleLR(
            optimizer,
            max_lr=max_lrs,
            total_steps=int(state["total_steps"]),
            anneal_strategy="cos" if state.get("_anneal_func_type", "cos") == "cos" else "linear",
            cycle_momentum=bool(state.get("cycle_momentum", False)),
            three_phase=len(phases) == 3,
        )
    if name == "CyclicLR":
        return S.CyclicLR(
            optimizer,
            base_lr=[g["lr"] for g in optimizer.param_groups],
            max_lr=list(state["max_lrs"]),
            cycle_momentum=False,
        )
    spec = next(s for s in _TORCH_SCHEDULERS if s[0] == name)
    kwargs = {k: state[k] for k in spec[2] if k in state}
    if name == "MultiStepLR":
        kwargs["milestones"] = (
            sorted(int(m) for m in dict(state["milestones"]).keys())
            if isinstance(state["milestones"], Mapping)
            else list(state["milestones"])
        )
    return getattr(S, name)(optimizer, **kwargs)


def expected_torch_lrs(
    state: Mapping[str, Any],
    group_lrs: Sequence[float],
    steps: int,
    *,
    class_name: str | None = None,
    lr_lambda: Any = None,
    saved_groups: Sequence[Mapping[str, Any]] | None = None,
) -> list[list[float]]:
    """The LR per group of each of `steps` resumed updates of a torch scheduler, from its saved state and the
    saved param groups (`group_lrs`; `saved_groups`: their other fields, e.g. OneCycleLR's max_lr/min_lr):
    update 1 runs at the saved LR, then the rebuilt scheduler (loaded with `state`) steps once per update.
    No engine involved: torch's scheduler on a stand-in optimizer with one dummy parameter per group."""
    extra = [dict(g) for g in (saved_groups or [])]
    groups = []
    for i, lr in enumerate(group_lrs):
        g = {k: v for k, v in (extra[i] if i < len(extra) else {}).items() if k in _SCHED_GROUP_KEYS}
        g.update(params=[torch.nn.Parameter(torch.zeros(1))], lr=float(lr))
        groups.append(g)
    for g, b in zip(groups, state.get("base_lrs") or []):
        g.setdefault("initial_lr", float(b))
    opt = torch.optim.Adam(groups, lr=float(group_lrs[0]) if group_lrs else 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched = rebuild_torch_scheduler(opt, state, class_name, lr_lambda)
        loadable = {k: v for k, v in state.items() if k != "lr_lambdas"} if lr_lambda is not None else dict(state)
        sched.load_state_dict(loadable)
        for i, (g, lr) in enumerate(zip(opt.param_groups, group_lrs)):
            g.update({k: v for k, v in (extra[i] if i < len(extra) else {}).items() if k in _SCHED_GROUP_KEYS})
            g["lr"] = float(lr)
        out = []
        for k in range(steps):
            out.append([float(g["lr"]) for g in opt.param_groups])
            opt.step()
            sched.step()
    return out


__all__ = [
    "ParamSpec",
    "GroupSpec",
    "Replica",
    "build_replica",
    "synthetic_directions",
    "synthetic_loss",
    "grad_norm",
    "clip_factor",
    "expected_adam",
    "expected_sgd",
    "state_close",
    "specs_from_checkpoint",
    "groups_from_checkpoint",
    "replica_layout",
    "infer_torch_scheduler",
    "rebuild_torch_scheduler",
    "expected_torch_lrs",
    "LAMBDA_SCHEDULERS",
    "MOMENT_RTOL",
    "PARAM_ULPS",
    "UPDATE_RTOL",
]
