"""Resume a Lightning `.ckpt` with `Trainer.fit(module, ckpt_path=...)`, model-free.

The LightningModule is built from the checkpoint itself: its parameters are the saved `state_dict`'s names,
shapes and dtypes (registered on the module, so Lightning's strict load matches), `training_step` returns the
synthetic loss (gradient known exactly), and `configure_optimizers` returns an optimizer of the saved kind with
the saved groups (`param_names`, or by shape) and the saved scheduler class rebuilt from its state dict, stepped
every update (interval "step") or every epoch, as the saved positions say. Lightning then restores the weights,
optimizer, scheduler and loop counters itself.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from ckpt_tools.read import safe_load
from ckpt_tools.resume.workers import _common as c


class ReplicaModule(L.LightningModule):
    """The checkpoint's parameters (`_common.Replica`, the saved names at the top level), the synthetic loss, and
    the saved optimizer kind, groups and scheduler (`spec`: the plan's model)."""

    def __init__(self, spec: dict[str, Any], interval: str, lr_fn: Any) -> None:
        super().__init__()
        self.replica = c.Replica(spec["params"])
        self.spec, self.interval, self.lr_fn = spec, interval, lr_fn

    def state_dict(self, *args: Any, **kwargs: Any):  # the checkpoint's names, without the `replica.` level
        sd = self.replica.state_dict(*args, **kwargs)
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.replica.load_state_dict(state_dict, strict=strict, assign=assign)

    def training_step(self, batch, batch_idx):
        return self.replica()

    def configure_optimizers(self):
        spec = self.spec
        params = dict(self.replica.named_parameters())
        groups = [dict(g["hyper"], params=[params[n] for n in g["names"]]) for g in spec["groups"]]
        opt = c.build_optimizer(spec["optimizer_kind"], groups)
        sched = c.build_scheduler(spec.get("scheduler_kind"), spec.get("scheduler_state"), opt, self.lr_fn)
        if sched is None:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": sched, "interval": self.interval, "frequency": 1},
        }


class Recorder(L.Callback):
    """Emits `loaded` before the first resumed batch (and sets up the closed-form check from `saved_osd`, the
    optimizer state the checkpoint saved), one `step` per batch, and stops the run after `steps` batches."""

    def __init__(self, saved_osd: dict | None, expected: Any, steps: int) -> None:
        self.saved_osd, self.expected, self.steps = saved_osd, expected, steps
        self.check: c.OptimizerCheck | None = None
        self.pending: list[float] | None = None
        self.n = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        opt = trainer.optimizers[0]
        if self.check is None:
            sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
            c.emit(
                "loaded",
                global_step=int(trainer.global_step),
                optimizer_step=c.adam_step_or_none(opt),
                scheduler_position=getattr(sched, "last_epoch", None),
                lr=c.current_lrs(opt),
            )
            saved = c.saved_states_by_position(self.saved_osd) if self.saved_osd is not None else None
            self.check = c.OptimizerCheck(opt, saved, self.expected)
        self.pending = c.current_lrs(opt)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        assert self.check is not None
        result = self.check.reduced()
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        c.emit(
            "step",
            step=int(trainer.global_step),
            loss=float(loss.detach()) if loss is not None else None,
            lr=self.pending,
            optimizer_step=c.adam_step_or_none(trainer.optimizers[0]),
            opt_check=result,
        )
        self.n += 1
        if self.n >= self.steps:
            trainer.should_stop = True


def saved_optimizer_state(path: str) -> dict | None:
    """The first optimizer state the `.ckpt` saved, read with ckpt's allowlisted torch loader (not Lightning's
    restore)."""
    loaded = safe_load.torch_load_allowlisted(path, mmap=False)
    states = loaded.get("optimizer_states") if isinstance(loaded, dict) else None
    return states[0] if isinstance(states, list) and states else None


def main(plan: dict[str, Any]) -> None:
    steps = plan["steps"]
    lr_fn = c.load_callable(plan.get("scheduler_fn"))
    recorder = Recorder(saved_optimizer_state(plan["load_dir"]), plan.get("expected_lrs"), steps)
    gstep = plan.get("global_step") or 0
    n_batches = gstep + steps + 1
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(n_batches)), batch_size=1)
    trainer = L.Trainer(
        accelerator="gpu" if plan["device"] == "cuda" else "cpu",
        devices=1,
        max_steps=gstep + steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        num_sanity_val_steps=0,
    )
    trainer.fit(ReplicaModule(plan["models"][0], plan["interval"], lr_fn), data, ckpt_path=plan["load_dir"])
    c.emit("done")


if __name__ == "__main__":
    c.run_main(main)
