"""HF `transformers.Trainer` samples: a real Trainer `output_dir` with `checkpoint-N/` folders, 2 CPU ranks (gloo).

The model is a tiny GPT-2 built from a `GPT2Config` (tied embeddings: `lm_head.weight` is
`transformer.wte.weight`, the GPT-2 default), trained the way users run the Trainer: its own AdamW with two
param groups (weight decay / none on biases and LayerNorm weights), its own cosine schedule with warmup,
`save_steps` checkpoints. The sample path is the output_dir; after training rank 0 deletes `checkpoint-6`, so
it holds `checkpoint-2` and `checkpoint-4` (a resume continues from the newest, checkpoint-4; steps 5 and 6 of
the uninterrupted run are in the manifest's history).

- hf_trainer_ddp: plain DDP. checkpoint-N holds model.safetensors, optimizer.pt, scheduler.pt,
  trainer_state.json, rng_state_<rank>.pth, training_args.bin, config.json, generation_config.json.
- hf_trainer_zero2: the same through `TrainingArguments(deepspeed=<dict>, bf16=True, use_cpu=True)`, ZeRO-2 in
  bf16. DeepSpeed writes `global_stepN/` (bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt,
  mp_rank_00_model_states.pt) + `latest` inside checkpoint-N instead of optimizer.pt; model.safetensors holds
  bf16 weights. The DS config has no scheduler section, so the Trainer keeps its own scheduler (not handed to
  the engine: the model states' `lr_scheduler` is None) and still writes scheduler.pt, which a resume loads.

Resume mode (`--resume CKPT_DIR --record OUT.json`): the same model and Trainer (scratch output_dir, no saving)
run `trainer.train(resume_from_checkpoint=CKPT_DIR)` up to max_steps (or `--steps N` updates, if fewer); rank 0
writes one record per resumed update: {step, lr (per group, the LR that update used), optimizer_step (Adam step
after it), loss}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ckpt_tools.train.data import batch_for_step
from ckpt_tools.train.manifest import write_manifest
from ckpt_tools.train.models import count_parameters
from ckpt_tools.samples.workers import _common as c

SAMPLES = ("hf_trainer_ddp", "hf_trainer_zero2")

VOCAB = 64
N_POSITIONS = 32
SEQ_LEN = 16  # tokens per example (input_ids == labels; the model shifts them itself)
N_EMBD = 32
N_LAYER = 2
N_HEAD = 4

MAX_STEPS = c.TOTAL_STEPS  # 6
SAVE_STEPS = 2  # checkpoint-2, checkpoint-4, checkpoint-6 (deleted afterwards)
KEEP_CHECKPOINT = c.SAVE_AFTER_STEP  # checkpoint-4 is the one a resume continues from
LEARNING_RATE = 3e-3
WARMUP = 2
WEIGHT_DECAY = 0.01
SEED = 42
DATA_SEED = 1234

HISTORY_NOTE = (
    "one entry per optimizer step: 'step' is the Trainer's global step after the update, 'loss' is rank 0's "
    "local loss on its own micro-batch (the loss compute_loss returned; every example has the same number of "
    "label tokens, so it is the plain mean over rank 0's tokens), 'lr' is the LR of each param group read from "
    "the live optimizer before that update (on_step_begin)"
)


def ds_config() -> dict[str, Any]:
    """A ZeRO-2 config as users write them for the Trainer: no optimizer/scheduler (the Trainer's own AdamW and
    cosine schedule are handed to DeepSpeed), "auto" values filled from TrainingArguments."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1000,
    }


def gpt2_config():
    # Dropout off so that a resumed step computes exactly the loss of the uninterrupted run's step.
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=N_POSITIONS,
        n_embd=N_EMBD,
        n_layer=N_LAYER,
        n_head=N_HEAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        tie_word_embeddings=True,
    )


def build_model():
    torch.manual_seed(c.SEED)
    return GPT2LMHeadModel(gpt2_config())


class Rows(torch.utils.data.Dataset):
    """Token rows as causal-LM examples (input_ids == labels; the model shifts them itself)."""

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i].clone(), "labels": self.rows[i].clone()}


class TokenDataset(Rows):
    """Deterministic synthetic sequences (the `batch_for_step` rule), one example per index."""

    def __init__(self, n: int) -> None:
        super().__init__(
            [
                batch_for_step(i, batch_size=1, seq_len=SEQ_LEN - 1, vocab_size=VOCAB, seed=DATA_SEED)[0]
                for i in range(n)
            ]
        )


def unwrap_scheduler(sched: Any) -> Any:
    """The torch LR scheduler under Accelerate's / DeepSpeed's wrappers (`.scheduler`)."""
    while hasattr(sched, "scheduler"):
        sched = sched.scheduler
    return sched


def training_arguments(sample: str, output_dir: Path, *, resume: bool):
    kwargs: dict[str, Any] = {}
    if sample == "hf_trainer_zero2":
        # What a user writes for DeepSpeed on CPU: use_cpu (the Trainer refuses bf16 without a bf16 GPU unless
        # use_cpu is set) makes a gloo PartialState; the Trainer's Accelerator then runs DeepSpeed on it.
        kwargs.update(deepspeed=ds_config(), bf16=True)
    return TrainingArguments(
        output_dir=str(output_dir),
        max_steps=MAX_STEPS,
        save_strategy="no" if resume else "steps",
        save_steps=SAVE_STEPS,
        lr_scheduler_type="cosine",
        warmup_steps=WARMUP,
        learning_rate=LEARNING_RATE,
        weight_decay=WEIGHT_DECAY,
        logging_steps=1,
        per_device_train_batch_size=c.MICRO_BATCH,
        report_to=[],
        seed=SEED,
        dataloader_num_workers=0,
        ddp_backend="gloo",
        disable_tqdm=True,
        use_cpu=True,
        **kwargs,
    )


class LossTrainer(Trainer):
    """The stock `transformers.Trainer`; only remembers the loss `compute_loss` returned for the last micro-batch
    (`last_loss`); shared with the resume worker (`ckpt_tools.resume.workers.hf_trainer`)."""

    last_loss: float | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        loss = out[0] if return_outputs else out
        self.last_loss = float(loss.detach().float())
        return out


class Recorder(TrainerCallback):
    """Per update, from the live objects: the LRs it used, rank 0's loss, the Adam step after it; at the
    checkpoint-4 save, the counters and LRs (`_common.snapshot`). Stops the run after `max_updates` (None: runs
    to the end)."""

    def __init__(self, max_updates: int | None = None) -> None:
        self.max_updates = max_updates
        self.trainer: Any = None  # the LossTrainer
        self.pending_lr: list[float] | None = None
        self.steps: list[dict[str, Any]] = []
        self.saved: dict[str, Any] | None = None

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        # Before the forward/backward of this update. Under DeepSpeed the engine steps the optimizer (and
        # the scheduler) inside backward, before on_pre_optimizer_step, so this is the last point where
        # the LR of the coming update can be read for both DDP and DeepSpeed.
        self.pending_lr = c.current_lrs(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        assert self.trainer is not None and self.pending_lr is not None
        self.steps.append(
            {
                "step": int(state.global_step),
                "lr": self.pending_lr,
                "optimizer_step": c.adam_step(optimizer),
                "loss": self.trainer.last_loss,
            }
        )
        self.pending_lr = None
        if self.max_updates is not None and len(self.steps) >= self.max_updates:
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if state.global_step == KEEP_CHECKPOINT:
            engine = getattr(self.trainer, "deepspeed", None)  # the DeepSpeed engine, None under DDP
            self.saved = c.snapshot(
                global_step=state.global_step,
                optimizer=optimizer,
                scheduler=unwrap_scheduler(lr_scheduler),
                skipped_steps=getattr(engine, "skipped_steps", None),
            )


def make_trainer(sample: str, output_dir: Path, *, resume: bool, max_updates: int | None = None):
    recorder = Recorder(max_updates)
    model = build_model()
    n_examples = MAX_STEPS * c.MICRO_BATCH * c.world_size()  # exactly one epoch of MAX_STEPS updates
    trainer = LossTrainer(
        model=model,
        args=training_arguments(sample, output_dir, resume=resume),
        train_dataset=TokenDataset(n_examples),
        callbacks=[recorder],
    )
    recorder.trainer = trainer
    return trainer, recorder


def parse_args() -> argparse.Namespace:
    return c.parse_producer_args("Train a tiny GPT-2 with transformers.Trainer (sample or resume).", SAMPLES)


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def make_sample(sample: str, out: Path) -> None:
    output_dir = out / sample
    if c.rank() == 0 and output_dir.exists():
        shutil.rmtree(output_dir)
    trainer, rec = make_trainer(sample, output_dir, resume=False)
    trainer.train()
    barrier()
    if c.rank() == 0:
        shutil.rmtree(output_dir / f"checkpoint-{MAX_STEPS}")
        for ck in sorted(output_dir.glob("checkpoint-*")):
            c.drop_deepspeed_scripts(ck)
        # anything else the Trainer may leave in output_dir (runs/ for a logger) is not part of the sample
        for extra in output_dir.iterdir():
            if not extra.name.startswith("checkpoint-"):
                shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
    barrier()
    if c.rank() != 0:
        return
    assert rec.saved is not None and [s["step"] for s in rec.steps] == list(range(1, MAX_STEPS + 1)), rec.steps
    history = [{"step": s["step"], "loss": s["loss"], "lr": s["lr"]} for s in rec.steps]
    opt = c.innermost_optimizer(trainer.optimizer)
    zero = sample == "hf_trainer_zero2"
    count, tensors = count_parameters(build_model())
    write_manifest(
        output_dir,
        sample=sample,
        format="hf_trainer",
        world_size=c.world_size(),
        topology={"dp": c.world_size(), "tp": 1, "pp": 1, "zero_stage": 2 if zero else None},
        steps=KEEP_CHECKPOINT,
        counters=rec.saved["counters"],
        lr=rec.saved["lr"],
        parameters={"count": count, "tensors": tensors},
        extra={
            "checkpoint": f"checkpoint-{KEEP_CHECKPOINT}",
            "checkpoints": sorted(p.name for p in output_dir.glob("checkpoint-*")),
            "deleted_checkpoint": f"checkpoint-{MAX_STEPS}",
            "next_lr": history[KEEP_CHECKPOINT]["lr"],
            "dtype": "bfloat16" if zero else "float32",
            "model_config": gpt2_config().to_dict(),
            "tied": {"lm_head.weight": "transformer.wte.weight"},
            "scheduler": "transformers get_scheduler('cosine'): a torch LambdaLR (linear warmup from 0, then "
            "cosine to 0 at max_steps), stepped by the Trainer once per update and saved by it in "
            "scheduler.pt" + (" (not handed to DeepSpeed: the model states' lr_scheduler is None)" if zero else ""),
            "lr_scheduler_type": "cosine",
            "learning_rate": LEARNING_RATE,
            "warmup_steps": WARMUP,
            "max_steps": MAX_STEPS,
            "save_steps": SAVE_STEPS,
            "weight_decay": WEIGHT_DECAY,
            "seed": SEED,
            "optimizer": type(opt).__name__,
            "param_group_sizes": [len(g["params"]) for g in opt.param_groups],
            "param_group_weight_decay": [float(g["weight_decay"]) for g in opt.param_groups],
            "param_groups": "0: weights with decay, 1: biases and LayerNorm weights (no decay), as the "
            "Trainer's get_decay_parameter_names splits them"
            + ("; under ZeRO each group is one flat partition per rank" if zero else ""),
            "micro_batch_per_rank": c.MICRO_BATCH,
            "seq_len": SEQ_LEN,
            "total_steps_trained": MAX_STEPS,
            "saved_after_step": KEEP_CHECKPOINT,
            "history": history,
            "history_note": HISTORY_NOTE,
            "optimizer_steps": [s["optimizer_step"] for s in rec.steps],
            **({"ds_config": ds_config()} if zero else {}),
        },
    )


def resume(sample: str, ckpt: Path, record: Path, max_updates: int | None) -> None:
    scratch = Path(tempfile.mkdtemp(prefix=f"hf_trainer_resume_r{c.rank()}_"))
    try:
        trainer, rec = make_trainer(sample, scratch, resume=True, max_updates=max_updates)
        trainer.train(resume_from_checkpoint=str(ckpt))
        barrier()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if c.rank() == 0:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(rec.steps, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    if args.resume is not None:
        resume(args.sample, args.resume.resolve(), args.record.resolve(), args.steps)
    else:
        make_sample(args.sample, args.out.resolve())


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
