"""Resume a torch DCP checkpoint of an FSDP2 run (the fsdp2_dcp sample, torchtitan's and the DCP recipe's layouts)
with `dcp.load` into a `fully_shard` replica, model-free.

The replica has the checkpoint's parameter FQNs, shapes and dtypes; `fully_shard` over all ranks; an optimizer of
the saved kind with the saved groups; a scheduler of the saved class rebuilt from its state dict. The state dict
handed to `dcp.load` is built the way the layout's producer builds it — `get_state_dict` (flattened optimizer
keys for torchtitan), the scheduler's `state_dict()`, the step counter — under the key names the checkpoint's
metadata shows (`model`/`optim`/`optimizer`, `scheduler`/`lr_scheduler`, `step`/`train_state.step`, all under
`app.` for the recipe), then `set_state_dict` and `scheduler.load_state_dict`, as the producers do. torchtitan's
`lr_scheduler {last_epoch}` (its schedule is in the job config) is loaded as the position only, with no scheduler
stepping the replica; a fused parameter saved split (torchtitan's wqkv: `spec["fused"]`) is loaded from its split
weights and put at its rows, as torchtitan's load hook does. The expected
optimizer state is read with ckpt's own DCP reader (`open_checkpoint`), not from what `dcp.load` filled in.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from ckpt_tools.read.qkv import assemble
from ckpt_tools.read.tree import GroupNode, TensorNode
from ckpt_tools.resume.workers import _common as c
from ckpt_tools.view.checkpoint import open_checkpoint


def layout(path: str) -> dict[str, Any]:
    """Key names from the checkpoint's metadata: prefix ('' or 'app.'), model / optimizer / scheduler roots, the
    step key path, and whether the optimizer state dict was flattened."""

    keys = list(FileSystemReader(path).read_metadata().state_dict_metadata)
    prefix = "app." if any(k.startswith("app.") for k in keys) else ""
    tops = {k[len(prefix) :].split(".", 1)[0] for k in keys if k.startswith(prefix)}
    opt = next((t for t in ("optim", "optimizer") if t in tops), None)
    sched = next((t for t in ("scheduler", "lr_scheduler") if t in tops), None)
    if opt is None:
        raise RuntimeError(f"no optimizer state in the DCP metadata (top-level keys: {sorted(tops)})")
    groups = [k for k in keys if k.startswith(f"{prefix}{opt}.param_groups.")]
    flat = any(not k[len(f"{prefix}{opt}.param_groups.") :].split(".", 1)[0].isdigit() for k in groups)
    step = ("step",) if "step" in tops else (("train_state", "step") if f"{prefix}train_state.step" in keys else None)
    # torchtitan 0.3.0 saves the model's keys flat at the top level, beside optimizer / lr_scheduler / train_state
    return {
        "prefix": prefix,
        "optim": opt,
        "scheduler": sched,
        "step": step,
        "flat": flat,
        "model_at_top": "model" not in tops,
        "train_state": [k[len(prefix) + len("train_state.") :] for k in keys if k.startswith(f"{prefix}train_state.")],
    }


def saved_from_tree(path: str, names: list[str]) -> list[dict[str, torch.Tensor] | None] | None:
    """The saved optimizer state per parameter FQN (in `names` order), read with ckpt's own DCP reader."""

    ck = open_checkpoint(path)
    state = ck.optimizer.children.get("state")
    if not isinstance(state, GroupNode):
        return None
    out: list[dict[str, torch.Tensor] | None] = []
    for n in names:
        node = state.children.get(n)
        if not isinstance(node, GroupNode):
            out.append(None)
            continue
        out.append(
            {k: v.read_torch().detach().float().clone() for k, v in node.children.items() if isinstance(v, TensorNode)}
        )
    return out


def main(plan: dict[str, Any]) -> None:
    spec = plan["models"][0]
    replica, opt, sched = build(plan, spec)
    lay = layout(plan["load_dir"])
    state, step = load(plan, spec, lay, replica, opt, sched)
    names = [n for g in spec["groups"] for n in g["names"]]
    check = c.OptimizerCheck(opt, saved_from_tree(plan["load_dir"], names), plan.get("expected_lrs"))
    if c.rank() == 0:
        position = (
            getattr(sched, "last_epoch", None)
            if sched is not None
            else (state.get(lay["scheduler"]) or {}).get("last_epoch")
            if lay["scheduler"]
            else None
        )
        c.emit(
            "loaded",
            global_step=step,
            optimizer_step=c.adam_step_or_none(opt),
            scheduler_position=position,
            lr=c.current_lrs(opt),
        )
    for k in range(plan["steps"]):
        used = c.current_lrs(opt)
        opt.zero_grad(set_to_none=True)
        loss = replica()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        if step is not None:
            step += 1  # the producers' loop counter: one per update
        result = check.reduced()
        if c.rank() == 0:
            c.emit(
                "step",
                step=step if step is not None else k + 1,
                loss=float(loss.detach()),
                lr=used,
                optimizer_step=c.adam_step_or_none(opt),
                opt_check=result,
            )
    dist.barrier()
    if c.rank() == 0:
        c.emit("done")


def build(plan: dict[str, Any], spec: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The process group, the replica under `fully_shard` over all ranks, its optimizer of the saved kind with the
    saved groups and the scheduler of the saved class."""
    device = plan["device"]
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    mesh = init_device_mesh(device, (c.world_size(),))
    replica = c.Replica(spec["params"])
    if device == "cuda":
        replica = replica.cuda()
    fully_shard(replica, mesh=mesh)
    params = dict(replica.named_parameters())
    groups = [dict(g["hyper"], params=[params[n] for n in g["names"]]) for g in spec["groups"]]
    opt = c.build_optimizer(spec["optimizer_kind"], groups)
    sched = c.build_scheduler(
        spec.get("scheduler_kind"), spec.get("scheduler_state"), opt, c.load_callable(plan.get("scheduler_fn"))
    )
    return replica, opt, sched


def load(
    plan: dict[str, Any], spec: dict[str, Any], lay: dict[str, Any], replica: Any, opt: Any, sched: Any
) -> tuple[dict[str, Any], int | None]:
    """`dcp.load` of the state dict the layout's producer builds (`layout`'s names), then `set_state_dict` and
    `scheduler.load_state_dict`, as the producers do. (The loaded state dict, the loaded step or None.)"""
    options = StateDictOptions(flatten_optimizer_state_dict=lay["flat"])
    model_sd, optim_sd = get_state_dict(replica, opt, options=options)
    fused = spec.get("fused") or {}
    placeholders = {name: model_sd.pop(name) for name in fused}
    for name, parts in fused.items():  # the checkpoint holds the fused parameter's weights split: load those
        like = placeholders[name]
        for part, rows in parts.items():
            model_sd[part] = torch.empty((len(rows), *like.shape[1:]), dtype=like.dtype)
    state: dict[str, Any] = {**model_sd} if lay["model_at_top"] else {"model": model_sd}
    state[lay["optim"]] = optim_sd
    if lay["scheduler"] and sched is not None:
        state[lay["scheduler"]] = sched.state_dict()
    elif lay["scheduler"] and spec.get("scheduler_position_only"):
        state[lay["scheduler"]] = {"last_epoch": -1}  # torchtitan saves only the position
    if lay["step"] == ("step",):
        state["step"] = 0
    elif lay["step"]:
        state["train_state"] = {k: 0 for k in lay["train_state"]}
    top = {"app": state} if lay["prefix"] else state
    dcp.load(top, checkpoint_id=plan["load_dir"])
    if lay["model_at_top"]:
        model_sd = {k: state[k] for k in model_sd}
    for name, parts in fused.items():  # ... and put them at their rows, as the producer's load hook does
        like = placeholders[name]
        whole = assemble([(rows, model_sd.pop(part)) for part, rows in parts.items()])
        if hasattr(like, "device_mesh"):
            whole = distribute_tensor(whole.to(like.device), like.device_mesh, like.placements)
        model_sd[name] = whole
    set_state_dict(replica, opt, model_state_dict=model_sd, optim_state_dict=state[lay["optim"]], options=options)
    if sched is not None and lay["scheduler"]:
        sched.load_state_dict(state[lay["scheduler"]])
    step = state.get("step") if lay["step"] == ("step",) else (state.get("train_state") or {}).get("step")
    return state, int(step) if step is not None else None


if __name__ == "__main__":
    c.run_main(main)
