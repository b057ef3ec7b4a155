"""Single-process samples without a distributed framework: the formats most scripts and hubs use.

- plain: one `torch.save` of a training-script checkpoint dict (model, optimizer, scheduler, counters,
  and the script's argparse.Namespace, which is why such files need `weights_only=False`).
- safetensors_single: `model.safetensors` with the `{"format": "pt"}` metadata that transformers writes.
- safetensors_sharded: the Hugging Face sharded layout, `model-0000i-of-0000n.safetensors` plus
  `model.safetensors.index.json` = {"metadata": {"total_size": bytes}, "weight_map": {name: file}}.

The safetensors files hold weights only; their manifests still give the run's counters and LR so that
a test can tell "not stored" from "stored wrong".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from ckpt_tools.train.models import GPTConfig
from ckpt_tools.samples.workers import _common as c

SAFETENSORS_METADATA = {"format": "pt"}
NUM_SHARDS = 2


def save_plain(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
) -> None:
    script_args = argparse.Namespace(
        lr=c.PEAK_LR,
        warmup_steps=c.WARMUP_STEPS,
        weight_decay=c.WEIGHT_DECAY,
        betas=c.BETAS,
        batch_size=c.MICRO_BATCH,
        train_steps=c.TOTAL_STEPS,
        seed=c.SEED,
        model=GPTConfig().to_dict(),
    )
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "epoch": 0,
            "args": script_args,
        },
        path,
    )


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage or are views; a copy per tensor is always safe.
    return {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}


def save_single(path: Path, model: torch.nn.Module) -> None:
    save_file(weights(model), str(path), metadata=SAFETENSORS_METADATA)


def save_sharded(folder: Path, model: torch.nn.Module) -> None:
    """Split the state dict, in order, into NUM_SHARDS files of about equal size, as `save_pretrained` does."""
    tensors = weights(model)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(NUM_SHARDS)]
    filled = 0
    for name, t in tensors.items():
        shard = min(filled * NUM_SHARDS // total, NUM_SHARDS - 1)
        shards[shard][name] = t
        filled += t.numel() * t.element_size()
    folder.mkdir()
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{NUM_SHARDS:05d}.safetensors"
        save_file(shard, str(folder / file), metadata=SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def main() -> None:
    args = c.parse_args()
    model = c.build_model()
    optimizer, scheduler = c.adamw_with_lambdalr(c.param_groups(model))
    savers: dict[str, tuple[str, str, Callable[[Path, int], None]]] = {
        "plain": ("plain.pt", "torch_file", lambda p, s: save_plain(p, model, optimizer, scheduler, s)),
        "safetensors_single": ("model.safetensors", "safetensors", lambda p, s: save_single(p, model)),
        "safetensors_sharded": ("sharded", "safetensors", lambda p, s: save_sharded(p, model)),
    }
    filename, fmt, save_to = savers[args.sample]
    ckpt = args.out / filename

    def step(global_step: int) -> float:
        loss = model.loss(c.tokens_for_step(global_step, 0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        return loss.item()

    def save() -> dict[str, Any]:
        save_to(ckpt, c.SAVE_AFTER_STEP)
        return c.snapshot(global_step=c.SAVE_AFTER_STEP, optimizer=optimizer, scheduler=scheduler)

    history, saved = c.train(step, lambda: c.current_lrs(optimizer), save)
    c.write_sample_manifest(
        ckpt,
        sample=args.sample,
        format=fmt,
        model=model,
        topology={"dp": 1, "tp": 1, "pp": 1, "zero_stage": None},
        saved=saved,
        history=history,
        extra={
            "dtype": "float32",
            "scheduler": "torch LambdaLR (warmup then decay)",
            "param_groups": c.PARAM_GROUPS_NOTE,
            "stored": (
                "model, optimizer, scheduler, step, epoch, args"
                if fmt == "torch_file"
                else "weights only: counters and lr are the run's, not stored in the file"
            ),
        },
    )


if __name__ == "__main__":
    main()
