"""Resume a checkpoint made by `ckpt convert` in its target framework (and the source in DeepSpeed), for the tests.

Run under torchrun with CPU ranks (gloo):

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.resume.workers.convert_resume \\
        --framework fsdp2 --ckpt OUT_DCP --spec SPEC.json --record REC.json [--state STATE.pt]

`--framework fsdp2`: FSDP2 (`fully_shard`) loads a DCP checkpoint the way an FSDP2 loop does: build the model,
optimizer and scheduler, `get_state_dict` (which creates the optimizer state), `dcp.load` into that structure
(layout `fsdp2`: {model, optim, scheduler, step}; `torchtitan`: {the model's keys flat, optimizer (flattened),
lr_scheduler {last_epoch} (the schedule from SPEC, as torchtitan's from its job config), train_state};
`recipe`: {app: {...}}), `set_state_dict`, `scheduler.load_state_dict`.
`--framework deepspeed`: a DeepSpeed engine (ZeRO `--stage`, bf16 as the source ran) loads a DeepSpeed
checkpoint with `engine.load_checkpoint` (`--universal`: `"checkpoint": {"load_universal": true}`).

`--model replica` (default): the model is `ckpt_tools.train.replica`'s stand-in built from SPEC (the
checkpoint's parameter names and shapes) and trained with the synthetic loss whose gradient is a fixed
direction, the same on both frameworks — so the first update of both can be compared to fp32 tolerance.
`--model tinygpt`: the samples' tiny GPT on the samples' batches (the real loss; FSDP2 in bf16 mixed precision
when SPEC says bf16, as DeepSpeed's bf16 run; DeepSpeed at DP=1 accumulates the source's DP=2 micro-batches):
the loss must continue the uninterrupted run's history.

SPEC (JSON): {"ds_scheduler": the source's DeepSpeed scheduler config or null (the DeepSpeed side builds it),
"specs": [{"name", "shape", "requires_grad"}], "groups": [{"names": [...], "options": {lr,
betas, eps, weight_decay, ...}}], "scheduler": null | {"class": "LambdaLR"|"LinearLR", "hold": [factor per
group]}, "seed": 0, "max_norm": 1.0, "bf16": true, "global_step": N}.
REC (written by rank 0): one record per update: {"step", "lr" (used by the update), "optimizer_step",
"loss"}. STATE (rank 0, replica only): torch.save of {name: {"fp32", "exp_avg", "exp_avg_sq"}} after the
first update, gathered whole.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ckpt_tools.read.tree import saved_config
from ckpt_tools.resume.workers.deepspeed import full_state
from ckpt_tools.samples.workers import _common as c
from ckpt_tools.train import replica as R
from ckpt_tools.view import logical as L

_GROUP_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "initial_lr")


def spec_from_checkpoint(
    ck: Any, *, scheduler_class: str | None = None, seed: int = 0, max_norm: float | None = 1.0, bf16: bool = True
) -> dict[str, Any]:
    """The SPEC of a checkpoint, from its logical view (any format): trainable parameters, groups, scheduler."""
    ck = L.open_any(ck)
    model = L.model_tensors(ck, tied="dedupe")
    groups = L.param_groups(ck)
    members = {n for g in groups for n in g["params"]}
    specs = [
        {"name": t.name, "shape": list(t.shape), "requires_grad": t.name in members}
        for t in model
        if t.kind in ("param", "frozen")
    ]
    sched = None
    if scheduler_class:
        hold = [float(g["lr"]) / float(g.get("initial_lr") or g["lr"]) for g in groups]
        sched = {"class": scheduler_class, "hold": hold}
    ds_sched = saved_config(ck).get("scheduler")
    return {
        "ds_scheduler": ds_sched if isinstance(ds_sched, dict) else None,
        "specs": specs,
        "groups": [{"names": list(g["params"]), "options": {k: g[k] for k in _GROUP_KEYS if k in g}} for g in groups],
        "scheduler": sched,
        "seed": seed,
        "max_norm": max_norm,
        "bf16": bf16,
        "global_step": ck.counters.global_step,
    }


def _replica(spec: dict[str, Any]):
    specs = [R.ParamSpec(s["name"], tuple(s["shape"]), "float32", s["requires_grad"]) for s in spec["specs"]]
    model = R.build_replica(specs)
    directions = R.synthetic_directions(specs, spec.get("seed", 0), max_norm=spec.get("max_norm"))
    return model, directions


def _optimizer(model: torch.nn.Module, spec: dict[str, Any]):
    params = dict(model.named_parameters())
    groups = []
    for g in spec["groups"]:
        opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in g["options"].items() if k != "initial_lr"}
        groups.append({"params": [params[n] for n in g["names"]], **opts})
    optimizer = torch.optim.AdamW(groups)
    sched = spec.get("scheduler")
    scheduler = None
    if sched:
        for g, src in zip(optimizer.param_groups, spec["groups"]):
            if "initial_lr" in src["options"]:
                g["initial_lr"] = src["options"]["initial_lr"]
        if sched["class"] == "LambdaLR":
            hold = sched.get("hold") or [1.0] * len(groups)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [(lambda e, h=h: h) for h in hold])
        elif sched["class"] == "LinearLR":
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.5, total_iters=1)
        else:
            raise SystemExit(f"scheduler {sched['class']} is not rebuilt by this worker")
    return optimizer, scheduler


def _full(t: Any) -> torch.Tensor:
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


# --- FSDP2 ------------------------------------------------------------------------------------------------


def _fsdp2_state(model, optimizer, scheduler, layout: str) -> dict[str, Any]:
    flatten = layout == "torchtitan"
    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flatten)
    )
    if layout == "torchtitan":  # torchtitan 0.3.0's CheckpointManager: the model's keys flat at the top level
        state = {**model_sd, "optimizer": optim_sd, "train_state": {"step": 0}}
        if scheduler is not None:
            state["lr_scheduler"] = {"last_epoch": 0}  # all its LRSchedulersContainer saves
        return state
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return {"app": state} if layout == "recipe" else state


def fsdp2_resume(args, spec: dict[str, Any]) -> None:
    mesh = init_device_mesh("cpu", (c.world_size(),))
    if args.model == "tinygpt":
        model = c.build_model()
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if spec.get("bf16")
            else MixedPrecisionPolicy()
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
        directions = None
    else:
        model, directions = _replica(spec)
        fully_shard(model, mesh=mesh)
        optimizer, scheduler = _optimizer(model, spec)
    state = _fsdp2_state(model, optimizer, scheduler, args.layout)
    dcp.load(state, checkpoint_id=args.ckpt)
    inner = state["app"] if args.layout == "recipe" else state
    titan = args.layout == "torchtitan"
    opt_key = "optimizer" if titan else "optim"
    model_state = (
        {k: v for k, v in inner.items() if k not in ("optimizer", "train_state", "lr_scheduler")}
        if titan
        else inner["model"]
    )
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=inner[opt_key],
        options=StateDictOptions(flatten_optimizer_state_dict=titan),
    )
    if scheduler is not None and titan:
        # torchtitan's LRSchedulersContainer.load_state_dict: the schedule is the one built from the config (here
        # SPEC), only the position is restored; the first update uses the optimizer's loaded lr
        last = int(inner["lr_scheduler"]["last_epoch"])
        scheduler.last_epoch, scheduler._step_count = last, last + 1
        scheduler._last_lr = scheduler.get_lr()
    elif scheduler is not None:
        scheduler.load_state_dict(inner["scheduler"])
    step = int(inner["train_state"]["step"] if titan else inner["step"])
    records = []
    for i in range(args.steps):
        lrs = c.current_lrs(optimizer)
        if directions is None:
            loss = c.lm_loss(model, c.tokens_for_step(step + i, c.rank()))
        else:
            loss = model(directions)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if spec.get("max_norm"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(spec["max_norm"]))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        records.append(
            {"step": step + i + 1, "lr": lrs, "optimizer_step": c.adam_step(optimizer), "loss": float(loss.detach())}
        )
        if i == 0 and args.state is not None and directions is not None:
            out = {}
            for name, p in model.named_parameters():
                st = optimizer.state.get(p, {})
                out[name] = {"fp32": _full(p), **{k: _full(st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st}}
            if c.rank() == 0:
                torch.save(out, args.state)
    if c.rank() == 0:
        args.record.write_text(json.dumps(records, indent=1) + "\n")


# --- DeepSpeed --------------------------------------------------------------------------------------------


def deepspeed_resume(args, spec: dict[str, Any]) -> None:
    import deepspeed  # lazy: only the DeepSpeed route imports it; the FSDP2 route runs without

    world = c.world_size()
    ds_sched = spec.get("ds_scheduler")
    gas = 1
    if args.model == "tinygpt":
        # the samples' recipe: 2 data-parallel micro-batches per update; at DP=1 they are accumulated
        gas = max(1, args.source_dp // world)
        model, directions = c.build_model(), None
        optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
    else:
        model, directions = _replica(spec)
        optimizer, scheduler = _optimizer(model, {**spec, "scheduler": None} if ds_sched else spec)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": c.MICRO_BATCH if directions is None else 1,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "bf16": {"enabled": bool(spec.get("bf16"))},
        "zero_optimization": {"stage": args.stage},
    }
    cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * gas * world
    if spec.get("max_norm"):
        cfg["gradient_clipping"] = float(spec["max_norm"])
    if args.universal:
        cfg["checkpoint"] = {"load_universal": True}
    if ds_sched:  # DeepSpeed's own scheduler, from the source's config, as the source run had it
        cfg["scheduler"] = ds_sched
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=cfg,
        model_parameters=[p for p in model.parameters()],
    )
    load_path, _ = engine.load_checkpoint(str(args.ckpt), load_lr_scheduler_states=True)
    if load_path is None:
        raise SystemExit(f"DeepSpeed found no checkpoint in {args.ckpt}")
    records = []
    for i in range(args.steps):
        lrs = [float(g["lr"]) for g in engine.optimizer.param_groups]
        step = int(engine.global_steps)
        losses = []
        for j in range(gas):
            if directions is None:
                loss = c.lm_loss(engine, c.tokens_for_step(step, c.rank() * gas + j))
            else:
                loss = engine(directions)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        records.append(
            {
                "step": int(engine.global_steps),
                "lr": lrs,
                "optimizer_step": c.adam_step(engine.optimizer),
                "loss": losses[0],
            }
        )
        if i == 0 and args.state is not None and directions is not None:
            out = full_state(engine, engine.module, ("exp_avg", "exp_avg_sq"))
            if c.rank() == 0:
                torch.save(out, args.state)
    if c.rank() == 0:
        args.record.write_text(json.dumps(records, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description="Resume a converted checkpoint in its target framework (tests).")
    p.add_argument("--framework", required=True, choices=("fsdp2", "deepspeed"))
    p.add_argument("--ckpt", required=True, type=Path)
    p.add_argument("--spec", required=True, type=Path)
    p.add_argument("--record", required=True, type=Path)
    p.add_argument("--state", type=Path, help="replica: the full state after the first update goes here")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--model", choices=("replica", "tinygpt"), default="replica")
    p.add_argument("--layout", choices=("fsdp2", "torchtitan", "recipe"), default="fsdp2")
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--universal", action="store_true")
    p.add_argument(
        "--source-dp",
        type=int,
        default=2,
        help="tinygpt: the data-parallel size of the run that saved "
        "the checkpoint (its micro-batches are accumulated at a smaller DP)",
    )
    p.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher adds it
    args = p.parse_args()
    spec = json.loads(args.spec.read_text())
    if args.framework == "deepspeed":
        import deepspeed  # lazy: as in deepspeed_resume

        deepspeed.init_distributed(dist_backend="gloo")
        deepspeed_resume(args, spec)
    else:
        if not dist.is_initialized():  # a run before it in this launch (`--then`) made the group
            dist.init_process_group("gloo")
        fsdp2_resume(args, spec)


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
