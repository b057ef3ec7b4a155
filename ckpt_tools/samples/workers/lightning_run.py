"""Lightning sample: a real `lightning.Trainer.save_checkpoint` `.ckpt` (one torch.save file), 1 CPU process.

The LightningModule wraps the tiny GPT of every other sample (`_common.build_model`); `configure_optimizers`
returns torch AdamW with the two usual param groups (`_common.param_groups`) and a OneCycleLR with one max_lr
per group, stepped every optimizer step (interval "step"). OneCycleLR also cycles Adam's beta1
(cycle_momentum, the default), so the optimizer's param groups change `betas` as well as `lr` every step.
A callback saves `onecycle.ckpt` with `trainer.save_checkpoint` in `on_train_batch_end` after update 4 (Lightning
has already stepped the scheduler for that update by then), and records per update, from the live objects,
the LR of each group used, the loss, the Adam step, and at the save the counters and scheduler state.

Data: the dataloader is deterministic (no shuffling, one batch index per step); `training_step` trains on
`_common.tokens_for_step(trainer.global_step, 0)`, i.e. the batch is keyed by the global step as in every
other sample, so a resumed run sees exactly the batches the uninterrupted run saw (Lightning restarts a plain
dataloader from its first batch when it resumes mid-epoch).

Resume mode (`--resume CKPT --record OUT.json [--steps N]`): the same module, `trainer.fit(model, dl,
ckpt_path=CKPT)` with max_steps=6 (stopped after N updates if N is given); one record per resumed update:
{step, lr (per group), optimizer_step (Adam step after it), loss}.

Under torchrun with one process Lightning's strategy is the single-device one (devices=1): no process group.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from ckpt_tools.samples.workers import _common as c

SAMPLES = ("lightning_onecycle",)
CKPT_NAME = "onecycle.ckpt"
MAX_LR = [c.PEAK_LR, c.PEAK_LR / 2]  # one per param group: decay, no decay
ONECYCLE_TOTAL_STEPS = 8  # > TOTAL_STEPS: the schedule is still in its anneal phase at step 6
PCT_START = 0.3

SCHEDULER_NOTE = (
    f"torch OneCycleLR(max_lr={MAX_LR}, total_steps={ONECYCLE_TOTAL_STEPS}, pct_start={PCT_START}, "
    "anneal_strategy='cos', cycle_momentum=True (beta1 cycles 0.95 -> 0.85 -> 0.95), div_factor=25, "
    "final_div_factor=1e4), Lightning interval 'step', frequency 1"
)


def data_loader() -> torch.utils.data.DataLoader:
    """One batch index per step (the batch itself comes from `tokens_for_step(global_step, 0)`)."""
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(c.TOTAL_STEPS)), batch_size=1, shuffle=False, num_workers=0
    )


class OneCycleGPT(L.LightningModule):
    """The tiny GPT of `_common` with AdamW and a per-step OneCycleLR; the batch is chosen by the global step."""

    def __init__(self) -> None:
        super().__init__()
        self.model = c.build_model()

    def training_step(self, batch, batch_idx):
        tokens = c.tokens_for_step(self.trainer.global_step, 0)
        return c.lm_loss(self.model, tokens)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(c.param_groups(self.model), lr=c.PEAK_LR, betas=c.BETAS, eps=1e-8)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=MAX_LR, total_steps=ONECYCLE_TOTAL_STEPS, pct_start=PCT_START
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


class Recorder(L.Callback):
    """Per update, from the live objects; saves the checkpoint after update SAVE_AFTER_STEP to `save_to` if asked;
    stops the run after `max_updates` (None: runs to the end)."""

    def __init__(self, save_to: Path | None, max_updates: int | None = None) -> None:
        self.save_to, self.max_updates = save_to, max_updates
        self.pending: dict[str, Any] | None = None
        self.steps: list[dict[str, Any]] = []
        self.saved: dict[str, Any] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.pending = {"lr": c.current_lrs(opt), "beta1": [float(g["betas"][0]) for g in opt.param_groups]}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self.pending is not None
        opt = trainer.optimizers[0]
        self.steps.append(
            {
                "step": int(trainer.global_step),
                "lr": self.pending["lr"],
                "optimizer_step": c.adam_step(opt),
                "loss": float(outputs["loss"]),
                "beta1": self.pending["beta1"],
            }
        )
        self.pending = None
        if self.max_updates is not None and len(self.steps) >= self.max_updates:
            trainer.should_stop = True
        if self.save_to is not None and trainer.global_step == c.SAVE_AFTER_STEP:
            trainer.save_checkpoint(str(self.save_to))
            sched = trainer.lr_scheduler_configs[0].scheduler
            self.saved = c.snapshot(global_step=trainer.global_step, optimizer=opt, scheduler=sched)
            loop = trainer.fit_loop.epoch_loop
            self.saved["lightning"] = {
                "global_step": int(trainer.global_step),
                "current_epoch": int(trainer.current_epoch),
                "batch_idx": int(batch_idx),
                "batches_that_stepped": int(loop._batches_that_stepped),
                "scheduler_state": {
                    k: v
                    for k, v in sched.state_dict().items()
                    if isinstance(v, (int, float, str, bool, list, type(None)))
                },
                "betas": [list(map(float, g["betas"])) for g in opt.param_groups],
            }


def make_trainer(root: Path, callbacks: list):
    return L.Trainer(
        max_steps=c.TOTAL_STEPS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=str(root),
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )


def parse_args() -> argparse.Namespace:
    return c.parse_producer_args("Train the tiny GPT with Lightning (sample or resume).", SAMPLES)


def make_sample(sample: str, out: Path) -> None:
    ckpt = out / CKPT_NAME
    ckpt.unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="lightning_sample_"))  # default_root_dir: nothing lands in out/
    try:
        rec = Recorder(ckpt)
        model = OneCycleGPT()
        trainer = make_trainer(scratch, [rec])
        trainer.fit(model, data_loader())
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert rec.saved is not None and [s["step"] for s in rec.steps] == list(range(1, c.TOTAL_STEPS + 1)), rec.steps
    assert [s["optimizer_step"] for s in rec.steps] == list(range(1, c.TOTAL_STEPS + 1)), rec.steps
    history = [{"step": s["step"], "loss": s["loss"], "lr": s["lr"]} for s in rec.steps]
    opt = trainer.optimizers[0]
    c.write_sample_manifest(
        ckpt,
        sample=sample,
        format="lightning",
        model=c.build_model(),
        topology={"dp": 1, "tp": 1, "pp": 1, "zero_stage": None},
        saved=rec.saved,
        history=history,
        extra={
            "checkpoint": CKPT_NAME,
            "next_lr": history[c.SAVE_AFTER_STEP]["lr"],
            "dtype": "float32",
            "scheduler": SCHEDULER_NOTE,
            "max_lr": MAX_LR,
            "onecycle_total_steps": ONECYCLE_TOTAL_STEPS,
            "pct_start": PCT_START,
            "optimizer": type(opt).__name__,
            "param_groups": c.PARAM_GROUPS_NOTE,
            "param_group_sizes": [len(g["params"]) for g in opt.param_groups],
            "beta1_history": [{"step": s["step"], "beta1": s["beta1"]} for s in rec.steps],
            "lightning": rec.saved["lightning"],
            "lightning_version": L.__version__,
            "state_dict_prefix": "model.",
            "data_note": "the batch of the update that ends at step s is tokens_for_step(s - 1, 0) "
            "(batch_for_step, dp_rank 0), chosen by trainer.global_step in training_step",
        },
    )


def resume(ckpt: Path, record: Path, max_updates: int | None) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="lightning_resume_"))
    try:
        rec = Recorder(None, max_updates)
        trainer = make_trainer(scratch, [rec])
        trainer.fit(OneCycleGPT(), data_loader(), ckpt_path=str(ckpt))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    steps = [{k: s[k] for k in ("step", "lr", "optimizer_step", "loss")} for s in rec.steps]
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(steps, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    if args.resume is not None:
        resume(args.resume.resolve(), args.record.resolve(), args.steps)
    else:
        make_sample(args.sample, args.out.resolve())


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
