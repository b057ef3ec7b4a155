"""Resume an HF Trainer `checkpoint-N` folder with `trainer.train(resume_from_checkpoint=...)`.

The model is the real one, built from the checkpoint's `config.json` with transformers
(`AutoModelForCausalLM.from_config`, nothing downloaded); the Trainer's arguments are rebuilt from the fields of
`training_args.bin` that the parent read with ckpt's inert pickle reader (this process never unpickles that
file: the Trainer does not need it to resume). The data are ckpt's synthetic token rows, one epoch of
`max_steps` updates, so the Trainer's own data skip and RNG restore apply as in the user's run.

Per update (a TrainerCallback plus optimizer step hooks): the LR each param group used, the global step and
Adam step after it, rank 0's loss, and the closed-form optimizer check (`_common.OptimizerCheck`) against the
state saved in optimizer.pt (DDP) or this rank's DeepSpeed `*optim_states.pt` (ZeRO).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, TrainingArguments

from ckpt_tools.read import safe_load
from ckpt_tools.resume.workers import _common as c
from ckpt_tools.samples.workers.hf_trainer import LossTrainer, Rows, unwrap_scheduler

# TrainingArguments fields that shape the optimization; everything else (output, logging, hub) is ckpt's own.
ARG_FIELDS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "max_steps",
    "num_train_epochs",
    "lr_scheduler_type",
    "lr_scheduler_kwargs",
    "warmup_steps",
    "warmup_ratio",
    "optim",
    "optim_args",
    "seed",
    "data_seed",
    "bf16",
    "fp16",
    "deepspeed",
    "dataloader_drop_last",
    "average_tokens_across_devices",
    "label_smoothing_factor",
    "ignore_data_skip",
    "accelerator_config",
    "full_determinism",
    "train_sampling_strategy",
)


def training_arguments(plan: dict[str, Any], output_dir: Path):
    known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    saved = plan["training_args"]
    kwargs = {k: saved[k] for k in ARG_FIELDS if k in known and k in saved and saved[k] is not None}
    if isinstance(kwargs.get("deepspeed"), str):
        kwargs.pop("deepspeed")  # a path to the user's JSON: use what the Trainer saved (hf_deepspeed_config)
    if "deepspeed" not in kwargs and plan.get("ds_config"):
        kwargs["deepspeed"] = plan["ds_config"]
    if plan["device"] == "cpu":
        kwargs.update(use_cpu=True, ddp_backend="gloo")
    kwargs.update(
        output_dir=str(output_dir),
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        push_to_hub=False,
    )
    return TrainingArguments(**kwargs)


def saved_optimizer(plan: dict[str, Any]) -> list | None:
    """This rank's saved optimizer state, in the live optimizer's parameter order (read with safe_load)."""
    folder = Path(plan["load_dir"])
    f = folder / "optimizer.pt"
    if plan.get("zero_files"):
        files = plan["zero_files"]
        f = folder / files[c.rank()] if c.rank() < len(files) else None
    if f is None or not f.is_file():
        return None
    osd = c.find_osd(safe_load.torch_load_allowlisted(f, mmap=False))
    return None if osd is None else c.saved_states_by_position(osd)


class Recorder(TrainerCallback):
    """Emits `loaded` before the first resumed update (and sets up the closed-form check from this rank's saved
    optimizer state), one `step` per update (rank 0's loss and the mean over ranks), and stops the run after the
    plan's steps."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.trainer: Any = None
        self.check: c.OptimizerCheck | None = None
        self.pending: list[float] | None = None
        self.n = 0

    def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
        if self.check is None:  # first update: the Trainer has loaded everything by now
            if c.rank() == 0:
                c.emit(
                    "loaded",
                    global_step=int(state.global_step),
                    optimizer_step=c.adam_step_or_none(optimizer),
                    scheduler_position=getattr(unwrap_scheduler(lr_scheduler), "last_epoch", None),
                    lr=c.current_lrs(optimizer),
                )
            self.check = c.OptimizerCheck(optimizer, saved_optimizer(self.plan), self.plan.get("expected_lrs"))
        self.pending = c.current_lrs(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        assert self.check is not None
        opt_check = self.check.reduced()
        mean = torch.tensor([float(self.trainer.last_loss)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(mean)
        if c.rank() == 0:
            # the Trainer logs the mean over processes: `loss_mean` is what log_history is compared with
            c.emit(
                "step",
                step=int(state.global_step),
                loss=self.trainer.last_loss,
                loss_mean=float(mean) / c.world_size(),
                lr=self.pending,
                optimizer_step=c.adam_step_or_none(optimizer),
                opt_check=opt_check,
            )
        self.n += 1
        if self.n >= self.plan["steps"]:
            control.should_training_stop = True
        return control


def main(plan: dict[str, Any]) -> None:
    folder = Path(plan["load_dir"])
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    scratch = Path(tempfile.mkdtemp(prefix=f"ckpt_resume_hf_r{c.rank()}_"))

    try:
        args = training_arguments(plan, scratch)
        world = c.world_size()
        n_rows = max(1, args.max_steps) * args.per_device_train_batch_size * world * args.gradient_accumulation_steps
        seq_len = min(
            plan.get("seq_len") or 16,
            getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", 16),
        )
        rows = c.synthetic_rows(n_rows, seq_len, config.vocab_size, seed=plan.get("data_seed", 1234))
        rec = Recorder(plan)
        trainer = LossTrainer(model=model, args=args, train_dataset=Rows(rows), callbacks=[rec])
        rec.trainer = trainer
        trainer.train(resume_from_checkpoint=str(folder))
        if rec.n == 0:
            raise RuntimeError(
                f"the Trainer ran no update after loading (global_step is already max_steps={args.max_steps}?)"
            )
        if dist.is_initialized():
            dist.barrier()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if c.rank() == 0:
        c.emit("done")


if __name__ == "__main__":
    c.run_main(main)
