"""HF Accelerate samples: real `accelerator.save_state` output from 2 CPU ranks over gloo.

- accelerate_ddp: `Accelerator(cpu=True)` under torchrun is MULTI_CPU DDP. The folder holds
  model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl and custom_checkpoint_0.pkl
  (from an object registered with `register_for_checkpointing`).
- accelerate_deepspeed: the same loop through Accelerate's DeepSpeed ZeRO-2 plugin: DeepSpeed writes a
  `pytorch_model/` tag folder + `latest`, Accelerate adds its own files beside them. The LambdaLR is not
  handed to the engine (model_states['lr_scheduler'] is None); it lives in scheduler.bin.

Accelerate decides at import time and at `Accelerator()` whether DeepSpeed is on (from
ACCELERATE_USE_DEEPSPEED), so the environment is set before accelerate is first imported, inside `main`.
"""

from __future__ import annotations

import os
from typing import Any

from ckpt_tools.samples.workers import _common as c

SAMPLES = ("accelerate_ddp", "accelerate_deepspeed")


class TrainProgress:
    """A custom stateful object, as training scripts register for data-loader position and the like.

    Saved by Accelerate as custom_checkpoint_0.pkl (a torch.save of `state_dict()`).
    """

    def __init__(self) -> None:
        self.steps = 0
        self.samples_seen = 0

    def update(self, samples: int) -> None:
        self.steps += 1
        self.samples_seen += samples

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]
        self.samples_seen = state["samples_seen"]


def ds_plugin_config(dp: int) -> dict[str, Any]:
    """ZeRO-2 in bf16 with no optimizer/scheduler: ours (torch AdamW + LambdaLR) are handed to DeepSpeed.

    The batch sizes must be explicit: Accelerate can only fill "auto" from a prepared DataLoader.
    """
    return c.ds_config(2, dp, bf16={"enabled": True})


def make_accelerator(sample: str):
    """The Accelerator for `sample`; for DeepSpeed on CPU the gloo process group must exist first."""
    if sample == "accelerate_deepspeed":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        # lazy: accelerate imported only after ACCELERATE_USE_DEEPSPEED is set (see the module docstring)
        from accelerate import Accelerator, DeepSpeedPlugin, PartialState

        PartialState(backend="gloo")
        plugin = DeepSpeedPlugin(hf_ds_config=ds_plugin_config(c.world_size()))
        return Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    from accelerate import Accelerator  # lazy: as above, the DeepSpeed sample's process must not import it first

    return Accelerator(cpu=True)


def main() -> None:
    args = c.parse_args()
    if args.sample not in SAMPLES:
        raise SystemExit(f"accel worker makes {SAMPLES}, not {args.sample!r}")
    accelerator = make_accelerator(args.sample)
    rank = accelerator.process_index

    model = c.build_model()
    optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    wrapped, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    def step(global_step: int) -> float:
        tokens = c.tokens_for_step(global_step, rank)
        loss = c.lm_loss(wrapped, tokens)
        # Under DeepSpeed, backward also runs engine.step() (clipping per the config, the optimizer step), and
        # clip_grad_norm_ / optimizer.step() are Accelerate's no-ops, as in any script written for both.
        # The LambdaLR is not DeepSpeed's (Accelerate hands only DeepSpeed's own scheduler types to the
        # engine), so in both samples Accelerate steps it, once per process, and saves it in scheduler.bin.
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(wrapped.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        progress.update(c.MICRO_BATCH * accelerator.num_processes)
        return loss.item()

    ckpt = args.out / args.sample
    saved_progress: dict[str, int] = {}

    def save() -> dict[str, Any]:
        accelerator.save_state(str(ckpt))
        c.drop_deepspeed_scripts(ckpt)
        saved_progress.update(progress.state_dict())
        # the DeepSpeed engine counts overflow-skipped steps; DDP has no such counter
        return c.snapshot(
            global_step=progress.steps,
            optimizer=optimizer,
            scheduler=scheduler.scheduler,
            skipped_steps=getattr(wrapped, "skipped_steps", None),
        )

    history, saved = c.train(step, lambda: c.current_lrs(optimizer), save)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        extra: dict[str, Any] = {
            "distributed_type": str(accelerator.distributed_type.value),
            "mixed_precision": accelerator.mixed_precision,
            "scheduler": "torch LambdaLR (warmup then decay), kept by Accelerate (scheduler.bin), which "
            "steps it once per process per optimizer step",
            "custom_checkpoint_0": saved_progress,
            "param_groups": c.PARAM_GROUPS_NOTE,
        }
        if args.sample == "accelerate_deepspeed":
            extra["ds_config"] = ds_plugin_config(accelerator.num_processes)
            extra["tag"] = "pytorch_model"
        c.write_sample_manifest(
            ckpt,
            sample=args.sample,
            format="accelerate",
            model=model,
            topology={
                "dp": accelerator.num_processes,
                "tp": 1,
                "pp": 1,
                "zero_stage": 2 if args.sample == "accelerate_deepspeed" else None,
            },
            saved=saved,
            history=history,
            extra=extra,
        )


if __name__ == "__main__":
    main()
    c.shutdown()
