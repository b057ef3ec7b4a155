"""DeepSpeed training torchtitan's own llama3 (the torchtitan sample's model, with the stock wq/wk/wv), for the
proof that a DeepSpeed checkpoint converted to the torchtitan layout resumes in the REAL torchtitan Trainer.

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.ds_torchtitan \\
        --out DIR --record REF.pt

What runs (2 gloo ranks, DeepSpeed ZeRO-1, fp32): the model is `torchtitan_run.model_config(fuse_qkv=False)` built
by torchtitan (meta device, `init_weights`), so its parameter names are the ones torchtitan's fused model saves its
weights under (`layers.0.attention.qkv_linear.wq.weight`, ...). The batches are torchtitan's own: the tokenizer and
`HuggingFaceTextDataLoader` that torchtitan's `ConfigManager` builds from the torchtitan sample's job config (the
same local assets, per DP rank), the attention masks from the model's own `get_attention_masks`, the loss
torchtitan's `ChunkedLossWrapper(CrossEntropyLoss)` (sum over this rank's tokens / the global token count). torchtitan
sums gradients over DP ranks (FSDP divide factor 1.0); DeepSpeed averages them, so the loss handed to
`engine.backward` is multiplied by the DP size: the same gradient. AdamW (torch, fused, the sample's betas / eps)
with torchtitan's two param groups (norm weights: lr 4e-4, no weight decay; the rest: lr 8e-4, weight decay 0.1),
a LambdaLR warm-up over 2 steps, gradient clipping at 1.0 (torchtitan's default max_norm).

Three updates on the loader's first three batches, `save_checkpoint(DIR, tag="global_step3")`, then the fourth update
on the first batch of a NEW loader: what torchtitan's Trainer sees when it resumes with
`--checkpoint.exclude-from-loading dataloader` (the converted checkpoint carries no torchtitan loader state). Rank 0
saves REF.pt: {"params": {name: {"param" (the fp32 master), "exp_avg", "exp_avg_sq"}} after the fourth update,
read from the live ZeRO optimizer (`_whole_state`), "lr": the fourth update's group LRs, "loss"}.

`--load-universal DIR` instead (the other direction): the same engine without a scheduler and with
`{"checkpoint": {"load_universal": true}}` loads DIR (a universal checkpoint, e.g. `ckpt convert` of torchtitan's own
step-3), then makes one update on a new loader's first batch and saves REF.pt the same way (plus the Adam steps).

Run-time changes: torchtitan's CPU shims (`torchtitan_run.apply_cpu_shims`: the device module, FlexAttention's
attention computed by SDPA on the same mask); nothing else.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckpt_tools.samples.workers import torchtitan_run as tt
from ckpt_tools.train.procgroup import leave

TAG = "global_step3"
SAVED_STEPS = 3


def _batches(config, rank: int, world: int):
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    loader = config.dataloader.build(
        dp_world_size=world,
        dp_rank=rank,
        tokenizer=tokenizer,
        seq_len=tt.SEQ_LEN,
        local_batch_size=tt.LOCAL_BATCH,
        snapshot_every_n_steps=None,
    )
    return iter(loader)


def _update(engine, model, loss_fn, batch, world: int) -> float:
    input_dict, labels = batch
    extra = {k: v for k, v in input_dict.items() if k != "input"}
    if extra.get("positions") is not None:
        extra["attention_masks"] = model.get_attention_masks(positions=extra["positions"])
    tokens = torch.tensor((labels != -100).sum().item(), dtype=torch.int64)
    dist.all_reduce(tokens)
    pred = engine(input_dict["input"], **extra)
    loss, _ = loss_fn(pred, labels, tokens)
    engine.backward(loss * world)  # DeepSpeed averages over DP ranks; torchtitan sums
    engine.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total)


def _whole_state(engine) -> dict[str, dict[str, Any]]:
    """Every parameter's fp32 master and Adam moments, whole: each rank's ZeRO-1 pieces (read through the
    parameter's fragment address, `ds_pipeline.master_and_moments`: DeepSpeed 0.19.8's
    `safe_get_full_optimizer_state` fails outside the first param group) put together by
    `ds_pipeline.gather_whole`; the master under "param"."""
    # lazy: ds_pipeline imports DeepSpeed at its top; DeepSpeed is kept after torchtitan's CPU shims (see _run)
    from ckpt_tools.samples.workers.ds_pipeline import gather_whole, master_and_moments

    local, shapes = {}, {}
    for name, prm in engine.module.named_parameters():
        shapes[name] = tuple(prm.shape)
        piece = master_and_moments(engine.optimizer, prm)
        if piece is not None:
            offset, views = piece
            local[name] = (offset, {k: v.detach().clone() for k, v in views.items()})
    return {
        name: {("param" if k == "fp32" else k): v for k, v in st.items()}
        for name, st in gather_whole(local, shapes).items()
    }


def _parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="DeepSpeed checkpoint folder to write (global_step3)")
    p.add_argument(
        "--load-universal",
        type=Path,
        default=None,
        help="instead of training: load this universal "
        "checkpoint folder (its latest_universal) and make one update on a new loader's first batch",
    )
    p.add_argument("--record", type=Path, required=True, help="rank 0: the fourth update's result (torch.save)")
    args = p.parse_args()
    if (args.out is None) == (args.load_universal is None):
        p.error("give exactly one of --out or --load-universal")
    return args


def _job_config(work: Path):
    """torchtitan's own job config of the torchtitan sample (its local assets under `work`), parsed by its
    ConfigManager: the tokenizer, loader and loss are built from it."""
    # lazy: torchtitan is imported only after tt.apply_cpu_shims() (it picks its device at import)
    from torchtitan.config import ConfigManager

    assets, dataset = tt.write_assets(work / "assets")
    os.environ["HF_DATASETS_CACHE"] = str(work / "hf_cache")
    return ConfigManager().parse_args(
        tt.trainer_argv(assets=assets, dataset=dataset, dump=work / "dump", ckpt_folder=work / "unused")
    )


def _model():
    """The torchtitan sample's llama3 with the stock wq/wk/wv, built by torchtitan on the meta device and
    initialised by its own `init_weights` (seeded)."""
    torch.manual_seed(tt.SEED)
    with torch.device("meta"):
        model = tt.model_config(fuse_qkv=False).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def _optimizer(model, with_schedule: bool):
    """AdamW with torchtitan's two param groups, and (when training from scratch) the warm-up LambdaLR."""
    norm = [p for n, p in model.named_parameters() if re.search(tt.NORM_PATTERN, n)]
    rest = [p for n, p in model.named_parameters() if not re.search(tt.NORM_PATTERN, n)]
    opt = torch.optim.AdamW(
        [
            {"params": norm, "lr": tt.NORM_LR, "weight_decay": 0.0},
            {"params": rest, "lr": tt.LR, "weight_decay": tt.WEIGHT_DECAY},
        ],
        betas=tt.BETAS,
        eps=tt.EPS,
        fused=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / tt.WARMUP)) if with_schedule else None
    return opt, sched


def _ds_config(world: int, load_universal: bool) -> dict[str, Any]:
    cfg = {
        "train_micro_batch_size_per_gpu": tt.LOCAL_BATCH,
        "train_batch_size": tt.LOCAL_BATCH * world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": 1},
    }
    if load_universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def _run(args: argparse.Namespace, work: Path, rank: int, world: int) -> None:
    """Train and save (--out) or load the universal checkpoint (--load-universal), then the recorded update."""
    # lazy: DeepSpeed is imported after tt.apply_cpu_shims(), the order this worker was measured in
    import deepspeed

    config = _job_config(work)
    model = _model()
    opt, sched = _optimizer(model, with_schedule=args.out is not None)
    cfg = _ds_config(world, load_universal=args.load_universal is not None)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=sched, config=cfg)
    # the loss torchtitan's ChunkedLossWrapper applies per sequence chunk, here on the whole sequence (a sum
    # over tokens / the global token count either way); the wrapper itself runs the lm_head's backward inside
    # the loss call, outside DeepSpeed's engine.backward
    loss_fn = config.loss.loss_fn.build(compile_config=config.compile)
    if args.out is not None:
        batches = _batches(config, rank, world)
        for _ in range(SAVED_STEPS):
            _update(engine, model, loss_fn, next(batches), world)
        engine.save_checkpoint(str(args.out), tag=TAG)
    else:
        path, _ = engine.load_checkpoint(str(args.load_universal), load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed loaded nothing from {args.load_universal}")
    lrs = [float(g["lr"]) for g in engine.optimizer.param_groups]
    loss = _update(engine, model, loss_fn, next(_batches(config, rank, world)), world)
    params = _whole_state(engine)
    if rank == 0:
        adam = sorted({float(st["step"]) for st in engine.optimizer.optimizer.state.values() if "step" in st})
        torch.save(
            {"params": params, "lr": lrs, "loss": loss, "step": SAVED_STEPS + 1, "adam_steps": adam}, args.record
        )
        print(f"DS step {SAVED_STEPS + 1}: lr {lrs}, loss {loss}", flush=True)


def main() -> None:
    args = _parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    tt.apply_cpu_shims()
    # lazy: as in _run
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work = Path(tempfile.mkdtemp(prefix=f"ckpt_ds_torchtitan_r{rank}_"))
    code = 0
    try:
        _run(args, work, rank, world)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    leave(code, barrier=code == 0)


if __name__ == "__main__":
    main()
