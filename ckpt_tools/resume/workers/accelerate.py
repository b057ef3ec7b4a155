"""Resume an Accelerate `save_state` folder with `accelerator.load_state`, model-free.

For each saved model (model.safetensors, model_1.safetensors, or DeepSpeed's model states) a `Replica` with the
checkpoint's parameter names, shapes and dtypes; for each an optimizer of the saved kind (AdamW / Adam / SGD,
from the saved param_group fields) with the saved group membership, and a scheduler of the saved class rebuilt
from its state dict; custom objects registered with `register_for_checkpointing` are stand-ins that keep
whatever state dict Accelerate hands them. All prepared in Accelerate's numbering order, then `load_state`,
then updates with the synthetic loss (gradient known exactly): optimizer.step(), scheduler.step(), as a
training script does. DeepSpeed ZeRO (the `pytorch_model/` tag folder) goes through Accelerate's DeepSpeed
plugin with the saved ds_config.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ckpt_tools.resume.workers import _common as c


class CustomState:
    """Stand-in for a registered custom object: remembers the state dict Accelerate loads into it."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state or {})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def live_json(v: Any) -> Any:
    """A live state (what Accelerate loaded into a custom object: torch tensors, dicts, tuples) as JSON for the
    `loaded` event: tensors as lists, anything else not JSON as its str. Not `read.tree.node_to_python`, which
    reads the nodes of a checkpoint's tree, not live torch objects."""
    if torch.is_tensor(v):
        return v.tolist()
    if isinstance(v, dict):
        return {str(k): live_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [live_json(x) for x in v]
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)


def make_accelerator(plan: dict[str, Any]):
    if plan.get("ds_config"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        # lazy: accelerate imported only after ACCELERATE_USE_DEEPSPEED is set (as samples/workers/accel does)
        from accelerate import Accelerator, DeepSpeedPlugin, PartialState

        if plan["device"] == "cpu":
            PartialState(backend="gloo")
        cfg = plan["ds_config"]
        plugin = DeepSpeedPlugin(hf_ds_config=cfg)
        mp = (
            "bf16"
            if (cfg.get("bf16") or {}).get("enabled")
            else ("fp16" if (cfg.get("fp16") or {}).get("enabled") else "no")
        )
        return Accelerator(deepspeed_plugin=plugin, mixed_precision=mp)
    from accelerate import Accelerator  # lazy: as above, one function for both routes

    return Accelerator(cpu=plan["device"] == "cpu")


def main(plan: dict[str, Any]) -> None:
    accelerator = make_accelerator(plan)
    lr_fn = c.load_callable(plan.get("scheduler_fn"))
    models, optimizers, schedulers = [], [], []
    for spec in plan["models"]:
        replica = c.Replica(spec["params"])
        params = dict(replica.named_parameters())
        groups = [dict(g["hyper"], params=[params[n] for n in g["names"]]) for g in spec["groups"]]
        opt = c.build_optimizer(spec["optimizer_kind"], groups)
        models.append(replica)
        optimizers.append(opt)
        sched = c.build_scheduler(spec.get("scheduler_kind"), spec.get("scheduler_state"), opt, lr_fn)
        if sched is not None:
            schedulers.append(sched)
    customs = [CustomState() for _ in range(plan.get("custom_objects", 0))]
    for obj in customs:
        accelerator.register_for_checkpointing(obj)
    prepared = accelerator.prepare(*models, *optimizers, *schedulers)
    prepared = list(prepared) if isinstance(prepared, (list, tuple)) else [prepared]
    n_m, n_o = len(models), len(optimizers)
    wrapped, opts, scheds = prepared[:n_m], prepared[n_m : n_m + n_o], prepared[n_m + n_o :]

    accelerator.load_state(plan["load_dir"])

    expected = plan.get("expected_lrs")
    checks, g0 = [], 0
    for i, opt in enumerate(opts):
        n_groups = len(opt.param_groups)
        exp_i = [None if row is None else row[g0 : g0 + n_groups] for row in expected] if expected else None
        g0 += n_groups
        f = plan["models"][i].get("optimizer_files") or []
        saved = c.saved_osd_file(os.path.join(plan["load_dir"], f[c.rank()] if len(f) > 1 else f[0])) if f else None
        checks.append(c.OptimizerCheck(opt, saved, exp_i))

    def inner_sched(s: Any) -> Any:
        while hasattr(s, "scheduler"):
            s = s.scheduler
        return s

    if c.rank() == 0:
        c.emit(
            "loaded",
            optimizer_step=c.adam_step_or_none(opts[0]) if opts else None,
            optimizer_steps=[c.adam_step_or_none(o) for o in opts],
            scheduler_position=[getattr(inner_sched(s), "last_epoch", None) for s in scheds],
            lr=[lr for o in opts for lr in c.current_lrs(o)],
            custom_states=[live_json(o.state) for o in customs],
            global_step=getattr(wrapped[0], "global_steps", None),
        )
    for k in range(plan["steps"]):
        used = [lr for o in opts for lr in c.current_lrs(o)]
        loss = None
        for m in wrapped:
            term = m()
            loss = term if loss is None else loss + term
        accelerator.backward(loss)
        for o in opts:
            o.step()
        for s in scheds:
            s.step()
        for o in opts:
            o.zero_grad()
        result = c.combine([ch.reduced() for ch in checks])
        if c.rank() == 0:
            steps = [c.adam_step_or_none(o) for o in opts]
            live = getattr(wrapped[0], "global_steps", None)  # DeepSpeed's engine counts; DDP keeps no counter
            c.emit(
                "step",
                step=int(live) if live is not None else (plan.get("global_step") or 0) + k + 1,
                step_is_live=live is not None,
                loss=float(loss.detach()),
                lr=used,
                optimizer_step=steps[0] if len(set(steps)) == 1 else None,
                optimizer_steps=steps,
                opt_check=result,
                scheduler_position=[getattr(inner_sched(s), "last_epoch", None) for s in scheds],
            )
    accelerator.wait_for_everyone()
    if c.rank() == 0:
        c.emit("done")


if __name__ == "__main__":
    c.run_main(main)
