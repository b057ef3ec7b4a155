"""What every framework resume worker shares: the plan, events, the closed-form optimizer check, errors.

Events (rank 0 prints them, one per line, `CKPT_RESUME {json}`; the parent parses them):

    loaded  the live counters right after the framework loaded the checkpoint (before the first update)
    step    per update: global step, loss, LR per group used, the Adam step after it, and `opt_check`
    done
    error   any rank: the exception that stopped it (`message` is its own last line, what the user sees)

`OptimizerCheck` is the model-free proof that the optimizer continued: it takes the optimizer state saved in
the checkpoint (read here with `ckpt_tools.read.safe_load`, not taken from the framework's loaded optimizer),
applies the closed-form Adam/AdamW (or SGD-momentum) update with the gradient the optimizer really got and the
LR the parent computed from the saved schedule, and compares moments, step and parameter update after every
update. The expected state chains from its own previous expectation, so a wrong start shows on every step.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from ckpt_tools.read import safe_load

# the sample workers' names for the same things; current_lrs and world_size are used by the workers as `c.` names
from ckpt_tools.samples.workers._common import current_lrs, innermost_optimizer, rank, world_size  # noqa: F401
from ckpt_tools.train.data import batch_for_step
from ckpt_tools.train.processes import RECORD_PREFIX
from ckpt_tools.train.procgroup import leave
from ckpt_tools.train.replica import ParamSpec, expected_adam, expected_sgd, synthetic_directions

#: relative tolerance of the fp32 closed-form comparison (moments and parameter updates)
REL_TOL = 1e-4


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(RECORD_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def read_plan(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="ckpt resume worker (launched by `ckpt resume`)")
    p.add_argument("--plan", required=True)
    p.add_argument("--local_rank", type=int, default=None)
    args, _ = p.parse_known_args(argv)
    with open(args.plan) as f:
        return json.load(f)


def last_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    text = msg[-1] if msg else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run_main(main: Callable[[dict[str, Any]], None]) -> None:
    """Run `main(plan)`; on an exception print one `error` event (every rank: the first one the parent sees
    wins), the traceback on stderr when CKPT_DEBUG is set, and exit 2. On success leave the group cleanly."""
    plan = read_plan()
    try:
        main(plan)
    except BaseException as e:  # noqa: BLE001 - the parent shows this line instead of torchrun's traceback
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        emit("error", rank=rank(), message=last_line(e))
        if os.environ.get("CKPT_DEBUG"):
            traceback.print_exc()
            sys.stderr.flush()
        sys.stdout.flush()
        os._exit(2)
    leave(0)


def adam_step_or_none(optimizer: Any) -> int | None:
    """The live Adam 'step' where every parameter holds the same one; None before the first step or where they
    differ (the parent reports it as unknown). `samples.workers._common.adam_step` raises there instead."""
    steps = {
        int(s["step"]) for s in innermost_optimizer(optimizer).state.values() if isinstance(s, dict) and "step" in s
    }
    return steps.pop() if len(steps) == 1 else None


def find_osd(obj: Any, depth: int = 0) -> dict | None:
    """The first torch optimizer state dict (`state` + `param_groups` list) inside a loaded object."""
    if depth > 6:
        return None
    if isinstance(obj, Mapping):
        if isinstance(obj.get("param_groups"), list) and isinstance(obj.get("state"), Mapping):
            return dict(obj)
        for v in obj.values():
            found = find_osd(v, depth + 1)
            if found is not None:
                return found
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            found = find_osd(v, depth + 1)
            if found is not None:
                return found
    return None


def saved_states_by_position(osd: Mapping) -> list[dict[str, torch.Tensor] | None]:
    """Per parameter in param-group order (the order `params` ids are listed), its saved state (or None)."""
    out: list[dict[str, torch.Tensor] | None] = []
    state = osd.get("state") or {}
    for g in osd.get("param_groups") or []:
        for pid in g.get("params", []):
            s = state.get(pid, state.get(str(pid)))
            out.append(
                {
                    k: (v.detach().float().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
                    for k, v in s.items()
                }
                if s
                else None
            )
    return out if any(x is not None for x in out) else None  # an empty `state`: nothing was saved


def local(t: Any) -> Any:
    """A DTensor's local shard (FSDP2 parameters, grads and optimizer state); other values unchanged."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_slice(full: torch.Tensor, like: Any) -> torch.Tensor:
    """The part of the full (unsharded) tensor `full` that DTensor `like` holds on this rank (no collective)."""
    if not hasattr(like, "device_mesh") or full.dim() == 0:
        return full
    # lazy: torch.distributed.tensor costs ~0.7 s to import; only FSDP2 (DTensor) resumes reach this line
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].clone()


def _kind(opt: torch.optim.Optimizer, group: Mapping) -> str:
    name = type(opt).__name__.lower()
    if "sgd" in name:
        return "sgd"
    if "adamw" in name or group.get("decoupled_weight_decay"):
        return "adamw"
    if "adam" in name:
        return "adam"
    return name


class OptimizerCheck:
    """Closed-form check of every update of `optimizer` against the saved state (see the module docstring).

    `saved` lists the saved per-parameter state in the live optimizer's parameter order (param groups in
    order); `expected_lrs[k]` is the LR per group the saved schedule prescribes for update k (None: use the
    live LR, and say so)."""

    def __init__(
        self, optimizer: Any, saved: list[dict[str, torch.Tensor] | None] | None, expected_lrs: list[list[float]] | None
    ):
        self.opt = innermost_optimizer(optimizer)
        self.groups = list(self.opt.param_groups)
        self.params = [p for g in self.groups for p in g["params"]]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.group_of = [gi for gi, g in enumerate(self.groups) for _ in g["params"]]
        self.problem: str | None = None
        if saved is None:
            self.problem = "the checkpoint holds no optimizer state to compare with"
            saved = [None] * len(self.params)
        elif len(saved) != len(self.params):
            self.problem = f"the live optimizer has {len(self.params)} parameters, the saved state {len(saved)}"
            saved = [None] * len(self.params)
        self.expected = [
            None if st is None else {k: local_slice(v, p) if v.dim() else v for k, v in st.items()}
            for st, p in zip(saved, self.params)
        ]
        self.expected_lrs = expected_lrs
        self.k = 0
        self._new_update()
        self._before: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.opt.register_step_pre_hook(self._pre)
        self.opt.register_step_post_hook(self._post)

    def _new_update(self) -> None:
        self.cur = {
            "errors": {"exp_avg": 0.0, "exp_avg_sq": 0.0, "momentum_buffer": 0.0, "update": 0.0},
            "steps_bad": [],
            "checked": 0,
            "kinds": set(),
            "lr_from_plan": True,
        }

    def _current(self) -> list[int]:
        """Indices of the parameters in the groups being stepped now (DeepSpeed ZeRO steps one group at a time
        by swapping `param_groups`)."""
        ids = [id(p) for g in self.opt.param_groups for p in g["params"]]
        return [self.index[i] for i in ids if i in self.index]

    def _pre(self, opt, args, kwargs):
        # the parameters before the update; the gradient is read after it (step() leaves .grad alone), because
        # an optimizer stepped with a closure (Lightning) computes the gradient inside step()
        self._before = {i: local(self.params[i].detach()).float().cpu().clone() for i in self._current()}

    def _lr(self, gi: int) -> tuple[float, bool]:
        if self.expected_lrs is not None and self.k < len(self.expected_lrs) and self.expected_lrs[self.k]:
            return float(self.expected_lrs[self.k][gi]), True
        return float(self.groups[gi]["lr"]), False

    def _post(self, opt, args, kwargs):
        err = self.cur["errors"]
        for i, before in self._before.items():
            p = self.params[i]
            if p.grad is None:
                continue
            grad = local(p.grad.detach()).float().cpu().clone()
            gi = self.group_of[i]
            group = self.groups[gi]
            kind = _kind(self.opt, group)
            self.cur["kinds"].add(kind)
            lr, from_plan = self._lr(gi)
            self.cur["lr_from_plan"] &= from_plan
            live = {k: local(v) for k, v in self.opt.state.get(p, {}).items()}
            saved = self.expected[i] or {}
            wd = float(group.get("weight_decay", 0.0))
            if kind in ("adam", "adamw"):
                if group.get("maximize"):
                    self.problem = "maximize=True Adam: no closed form here"
                    continue
                want = expected_adam(
                    before,
                    grad,
                    saved.get("exp_avg"),
                    saved.get("exp_avg_sq"),
                    saved.get("step"),
                    lr=lr,
                    betas=group["betas"],
                    eps=float(group["eps"]),
                    weight_decay=wd,
                    decoupled=kind == "adamw",
                    amsgrad=bool(group.get("amsgrad")),
                    max_exp_avg_sq=saved.get("max_exp_avg_sq"),
                )
                err["exp_avg"] = max(err["exp_avg"], _rel(live.get("exp_avg"), want["exp_avg"]))
                err["exp_avg_sq"] = max(err["exp_avg_sq"], _rel(live.get("exp_avg_sq"), want["exp_avg_sq"]))
                live_step = float(live["step"]) if "step" in live else float("nan")
                if live_step != float(want["step"]):
                    self.cur["steps_bad"].append((float(want["step"]), live_step))
                self.expected[i] = {
                    k: (v if torch.is_tensor(v) else torch.tensor(float(v))) for k, v in want.items() if k != "param"
                }
                after = want["param"]
            elif kind == "sgd":
                want = expected_sgd(
                    before,
                    grad,
                    saved.get("momentum_buffer"),
                    lr=lr,
                    momentum=float(group.get("momentum", 0.0)),
                    dampening=float(group.get("dampening", 0.0)),
                    weight_decay=wd,
                    nesterov=bool(group.get("nesterov")),
                )
                if want["momentum_buffer"] is not None:
                    err["momentum_buffer"] = max(
                        err["momentum_buffer"], _rel(live.get("momentum_buffer"), want["momentum_buffer"])
                    )
                    self.expected[i] = {"momentum_buffer": want["momentum_buffer"]}
                after = want["param"]
            else:
                self.problem = f"no closed form here for {type(self.opt).__name__}"
                continue
            floor = 4 * torch.finfo(torch.float32).eps * float(before.abs().max()) if before.numel() else 0.0
            moved = local(p.detach()).double().cpu() - before.double()
            err["update"] = max(err["update"], _rel(moved, after - before.double(), floor=floor))
            self.cur["checked"] += 1
        self._before = {}

    def reduced(self) -> dict[str, Any]:
        """Close the current update and return its result, the worst over all ranks (a collective: every rank
        must call it once per update, after the optimizer stepped)."""
        r = self.cur
        self._new_update()
        self.k += 1
        names = ["exp_avg", "exp_avg_sq", "momentum_buffer", "update"]
        vals = torch.tensor(
            [r["errors"][n] for n in names]
            + [float(bool(r["steps_bad"])), float(r["checked"]), float(bool(self.problem))],
            dtype=torch.float64,
        )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
                vals = vals.to(torch.device("cuda", torch.cuda.current_device()))
            checked = vals[5:6].clone()
            dist.all_reduce(vals, op=dist.ReduceOp.MAX)
            dist.all_reduce(checked, op=dist.ReduceOp.SUM)
            vals[5] = checked[0]
            vals = vals.cpu()
        return {
            "errors": {n: float(vals[i]) for i, n in enumerate(names)},
            "any_step_bad": bool(vals[4]),
            "steps_bad": r["steps_bad"][:3],
            "checked": int(vals[5]),
            "kinds": sorted(r["kinds"]),
            "lr_from_plan": r["lr_from_plan"],
            "problem": self.problem or ("another rank found a problem" if vals[6] else None),
            "tol": REL_TOL,
        }


def _rel(live: Any, want: torch.Tensor, floor: float = 0.0) -> float:
    """max |live - want| / max(|want|), with an absolute floor; inf when the live value is missing."""
    if live is None or not torch.is_tensor(live):
        return float("inf")
    live = local(live).detach().double().cpu()
    want = want.double()
    if live.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if want.numel() else 0.0
    diff = float((live - want).abs().max()) if want.numel() else 0.0
    return max(0.0, diff - floor) / scale if scale > 0 else (0.0 if diff <= floor else float("inf"))


def synthetic_rows(n: int, seq_len: int, vocab: int, seed: int = 1234) -> list[torch.Tensor]:
    """ckpt's deterministic synthetic token rows (the bundled samples' data rule)."""
    return [batch_for_step(i, batch_size=1, seq_len=seq_len - 1, vocab_size=vocab, seed=seed)[0] for i in range(n)]


def directions(named_shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Fixed seeded directions r per parameter for the synthetic loss sum(p * r) (gradient r, exactly)."""
    return synthetic_directions([ParamSpec(n, tuple(s), "float32") for n, s in named_shapes], seed=seed)


# --- model-free replicas ------------------------------------------------------------------------------

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


class Replica(torch.nn.Module):
    """Parameters with the checkpoint's names, shapes and dtypes (registered in the order given, nested modules
    named like the checkpoint's keys, so state_dict() keys are exactly those names) and the synthetic loss
    `forward() = sum((p.float() * r).sum())`, whose gradient is r exactly."""

    def __init__(self, specs: list[tuple[str, list[int], str]], seed: int = 0) -> None:
        super().__init__()
        self.names = [n for n, _, _ in specs]
        for name, shape, dtype in specs:
            owner: torch.nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, torch.nn.Module())
                owner = owner._modules[part]
            owner.register_parameter(
                leaf, torch.nn.Parameter(torch.zeros(shape, dtype=DTYPES.get(dtype, torch.float32)))
            )
        dirs = directions([(n, tuple(s)) for n, s, _ in specs], seed=seed)
        self._dirs = {n: dirs[n] for n in self.names}

    def named_in_order(self) -> list[tuple[str, torch.nn.Parameter]]:
        params = dict(self.named_parameters())
        return [(n, params[n]) for n in self.names]

    def forward(self, *_: Any) -> torch.Tensor:
        total = None
        for name, p in self.named_in_order():
            term = (p.float() * self._dirs[name].to(p.device)).sum()
            total = term if total is None else total + term
        return total


def build_optimizer(kind: str, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of the saved kind over `groups` (each: params + the saved hyperparameters)."""
    clean = []
    for g in groups:
        h = {
            k: v
            for k, v in g.items()
            if k
            in (
                "params",
                "lr",
                "betas",
                "eps",
                "weight_decay",
                "amsgrad",
                "momentum",
                "dampening",
                "nesterov",
                "maximize",
            )
        }
        if "betas" in h:
            h["betas"] = tuple(h["betas"])
        clean.append(h)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}[kind]
    return cls(clean)


def build_scheduler(
    kind: str | None,
    state: dict[str, Any] | None,
    optimizer: torch.optim.Optimizer,
    lr_lambda: Callable[[int], float] | None = None,
) -> Any:
    """A torch scheduler of the saved class, constructed from its saved state dict (the framework then loads that
    state into it). LambdaLR/MultiplicativeLR get `lr_lambda` (the user's `--scheduler`, or a constant
    placeholder: its LRs after the first resumed update are then not checked)."""
    S = torch.optim.lr_scheduler
    if not kind or state is None:
        return None
    fn = lr_lambda or (lambda e: 1.0)
    if kind == "LambdaLR":
        return S.LambdaLR(optimizer, fn)
    if kind == "MultiplicativeLR":
        return S.MultiplicativeLR(optimizer, fn)
    if kind == "StepLR":
        return S.StepLR(optimizer, step_size=int(state["step_size"]), gamma=float(state["gamma"]))
    if kind == "MultiStepLR":
        ms = state["milestones"]
        ms = [int(k) for k, n in ms.items() for _ in range(int(n))] if isinstance(ms, dict) else list(ms)
        return S.MultiStepLR(optimizer, milestones=sorted(ms), gamma=float(state["gamma"]))
    if kind == "ExponentialLR":
        return S.ExponentialLR(optimizer, gamma=float(state["gamma"]))
    if kind == "CosineAnnealingLR":
        return S.CosineAnnealingLR(optimizer, T_max=state["T_max"], eta_min=float(state.get("eta_min", 0.0)))
    if kind == "OneCycleLR":
        max_lrs = [float(g.get("max_lr", g["lr"])) for g in optimizer.param_groups]
        phases = state.get("_schedule_phases") or []
        return S.OneCycleLR(
            optimizer,
            max_lr=max_lrs,
            total_steps=int(state["total_steps"]),
            three_phase=len(phases) == 3,
            anneal_strategy="linear" if state.get("_anneal_func_type") == "linear" else "cos",
            cycle_momentum=bool(state.get("cycle_momentum", False)),
            div_factor=float(max_lrs[0] / optimizer.param_groups[0].get("initial_lr", max_lrs[0] / 25)),
            final_div_factor=1e4,
        )
    if kind == "LinearLR":
        return S.LinearLR(
            optimizer,
            start_factor=float(state["start_factor"]),
            end_factor=float(state["end_factor"]),
            total_iters=int(state["total_iters"]),
        )
    if kind == "ConstantLR":
        return S.ConstantLR(optimizer, factor=float(state["factor"]), total_iters=int(state["total_iters"]))
    raise RuntimeError(f"no model-free rebuild of a {kind} scheduler")


def load_callable(spec: str | None) -> Callable[[int], float] | None:
    if not spec:
        return None
    module, _, func = spec.partition(":")
    return getattr(importlib.import_module(module), func)


def saved_osd_file(path: str) -> list[dict[str, torch.Tensor] | None] | None:
    """The saved per-parameter optimizer state of one file (torch.save of an optimizer state dict, or a DeepSpeed
    optim_states file), read with ckpt's allowlisted `safe_load`."""
    if not Path(path).is_file():
        return None
    osd = find_osd(safe_load.torch_load_allowlisted(path, mmap=False))
    return None if osd is None else saved_states_by_position(osd)


def combine(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One optimizer-check result out of several optimizers' (the worst of each)."""
    if len(results) == 1:
        return results[0]
    out = dict(results[0])
    out["errors"] = {k: max(r["errors"].get(k, 0.0) for r in results) for k in results[0]["errors"]}
    out["any_step_bad"] = any(r["any_step_bad"] for r in results)
    out["checked"] = sum(r["checked"] for r in results)
    out["kinds"] = sorted({k for r in results for k in r["kinds"]})
    out["lr_from_plan"] = all(r["lr_from_plan"] for r in results)
    out["problem"] = next((r["problem"] for r in results if r["problem"]), None)
    return out
