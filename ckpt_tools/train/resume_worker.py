"""The process `ckpt resume` runs under torch.distributed: load a DeepSpeed checkpoint into a real engine, train.

One script for CPU (gloo) and CUDA (NCCL). It reads the plan that `ckpt_tools.ops.resume` wrote (a JSON
file: the load folder, the launch ds_config, the model, the data, how many steps) and rank 0 prints one
line per event on stdout, `CKPT_RESUME {json}`, which the parent parses:

    setup   the scheduler the model factory built and its lambda at the epochs the parent asked about
    loaded  the live counters right after `engine.load_checkpoint`
    step    per optimizer step: global step, loss, LR per group, grad norm, Adam step, tokens/s
    done

Nothing here decides whether the resume was right: the parent compares these records with what it read
from the checkpoint itself.

Models: `tiny-gpt` and `megatron-gpt` are the recipes of the sample workers (imported from them, so the
engine built here is the one the samples were trained with), or a user factory `module:function` that
takes a `SetupContext` and returns a `TrainSetup`.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ckpt_tools.procgroup import leave

RECORD_PREFIX = "CKPT_RESUME "


@dataclass(frozen=True)
class SetupContext:
    """What a model factory gets: the launch ds_config and this rank's place in the new topology."""

    ds_config: dict[str, Any]
    rank: int
    world_size: int
    dp: int
    tp: int
    pp: int
    device: str  # "cpu" or "cuda"


@dataclass
class TrainSetup:
    """What a model factory returns; the arguments of `deepspeed.initialize` plus what the loop needs.

    `lr_lambda` is the function (or one per param group) of a torch LambdaLR passed as `lr_scheduler`:
    `ckpt resume` evaluates it to compute the expected LR independently of the engine. `loss_fn(engine,
    tokens)` runs a non-pipeline model (default: next-token cross entropy on `tokens[:, :-1]`); a
    `PipelineModule` is trained with `engine.train_batch` over (inputs, labels) micro-batches instead.
    """

    model: torch.nn.Module
    seq_len: int
    vocab_size: int
    model_parameters: Any = None
    optimizer: Any = None
    lr_scheduler: Any = None
    lr_lambda: Callable[[int], float] | list[Callable[[int], float]] | None = None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None


# --- the built-in model recipes -------------------------------------------------------------------


def tiny_gpt(ctx: SetupContext) -> TrainSetup:
    """The ZeRO samples' recipe: the tiny GPT, two param groups, and — when the ds_config names no optimizer —
    the torch AdamW + LambdaLR pair (that is how the samples that pass a torch scheduler were made)."""
    from ckpt_tools.train.models import GPTConfig
    from ckpt_tools.train.workers import _common as c

    model = c.build_model()
    groups = c.param_groups(model)
    optimizer = scheduler = lr_lambda = None
    if "optimizer" not in ctx.ds_config:
        optimizer, scheduler = c.adamw_with_lambdalr(groups)
        lr_lambda = c.lr_factor
    cfg = GPTConfig()
    return TrainSetup(model=model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, model_parameters=groups,
                      optimizer=optimizer, lr_scheduler=scheduler, lr_lambda=lr_lambda)


def megatron_gpt(ctx: SetupContext) -> TrainSetup:
    """The pipeline samples' recipe (`ds_pipeline`), at whatever TP x PP x DP this launch has."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from ckpt_tools.train.megatron import GPTModelPipe, MegatronGPTConfig
    from ckpt_tools.train.workers import _common as c
    from ckpt_tools.train.workers import ds_pipeline

    topology = PipeModelDataParallelTopology(num_pp=ctx.pp, num_mp=ctx.tp, num_dp=ctx.dp)
    coord = topology.get_coord(ctx.rank)
    torch.manual_seed(ds_pipeline.default_rng_seed(coord.pipe, coord.model, per_tp_rank=False))
    cfg = MegatronGPTConfig()
    model = GPTModelPipe(cfg, topology, seed=c.SEED)
    return TrainSetup(model=model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size,
                      model_parameters=c.param_groups(model))


BUILTIN_MODELS: dict[str, Callable[[SetupContext], TrainSetup]] = {"tiny-gpt": tiny_gpt,
                                                                   "megatron-gpt": megatron_gpt}


def load_factory(spec: str) -> Callable[[SetupContext], TrainSetup]:
    if spec in BUILTIN_MODELS:
        return BUILTIN_MODELS[spec]
    module, _, func = spec.partition(":")
    if not module or not func:
        raise SystemExit(f"--model {spec!r}: use one of {sorted(BUILTIN_MODELS)} or module:function")
    return getattr(importlib.import_module(module), func)


# --- data -----------------------------------------------------------------------------------------


class Batches:
    """The uninterrupted run's global batch, re-cut for this launch's DP size.

    The original run had `orig_dp` ranks, each reading `orig_gas` micro-batches of `micro` rows per step:
    rows `[j*micro, (j+1)*micro)` of `batch_for_step(step, batch_size=micro*orig_gas, dp_rank=r)`. Number
    those micro-batches r*orig_gas + j; this launch's DP rank d reads numbers d*gas .. d*gas+gas-1. The
    global batch (and so the averaged gradient) of every step is then the uninterrupted run's, whatever
    the DP size, and micro-batch 0 of DP rank 0 is the original DP rank 0's first micro-batch.
    """

    def __init__(self, plan: dict[str, Any], setup: TrainSetup, dp_rank: int):
        self.micro = plan["micro_batch"]
        self.orig_gas = plan["orig_gas"]
        self.gas = plan["gas"]
        self.dp_rank = dp_rank
        self.seq_len = setup.seq_len
        self.vocab_size = setup.vocab_size
        self.tokens = None
        if plan.get("data"):
            import numpy as np

            path = plan["data"]
            self.tokens = (np.load(path, mmap_mode="r") if path.endswith(".npy")
                           else np.memmap(path, dtype=np.uint16, mode="r"))

    def _rows(self, step: int, orig_rank: int) -> torch.Tensor:
        n = self.micro * self.orig_gas
        if self.tokens is None:
            from ckpt_tools.train.data import batch_for_step

            return batch_for_step(step, batch_size=n, seq_len=self.seq_len, vocab_size=self.vocab_size,
                                  dp_rank=orig_rank)
        # A user token file: windows of seq_len + 1 tokens, picked by the same (step, rank) seeding.
        windows = len(self.tokens) // (self.seq_len + 1)
        g = torch.Generator().manual_seed(1234 * 1_000_003 + step * 1009 + orig_rank)
        starts = torch.randint(0, windows, (n,), generator=g) * (self.seq_len + 1)
        rows = [torch.from_numpy(self.tokens[s: s + self.seq_len + 1].astype("int64")) for s in starts.tolist()]
        return torch.stack(rows)

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        out = []
        for j in range(self.gas):
            number = self.dp_rank * self.gas + j
            orig_rank, orig_j = divmod(number, self.orig_gas)
            out.append(self._rows(step, orig_rank)[orig_j * self.micro:(orig_j + 1) * self.micro])
        return out


# --- the loop -------------------------------------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(RECORD_PREFIX + json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def lm_loss(engine: Any, tokens: torch.Tensor) -> torch.Tensor:
    from ckpt_tools.train.workers import _common as c

    return c.lm_loss(engine, tokens)


def adam_step_or_none(optimizer: Any) -> int | None:
    from ckpt_tools.train.workers import _common as c

    try:
        return c.adam_step(optimizer)
    except RuntimeError:
        return None  # no Adam state yet, or several values: the parent reports it as unknown


def scheduler_position(scheduler: Any) -> int | None:
    if scheduler is None:
        return None
    pos = getattr(scheduler, "last_epoch", getattr(scheduler, "last_batch_iteration", None))
    return None if pos is None else int(pos)


def lambda_values(lr_lambda: Any, epochs: list[int], n_groups: int) -> list[list[float]] | None:
    if lr_lambda is None:
        return None
    fns = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * n_groups
    return [[float(f(e)) for f in fns] for e in epochs]


def grad_norm(engine: Any) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if torch.is_tensor(norm) else norm)


def main() -> None:
    parser = argparse.ArgumentParser(description="ckpt resume worker (launched by `ckpt resume`)")
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher adds it
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())

    import deepspeed
    import torch.distributed as dist

    device = plan["device"]
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = plan["ds_config"]
    ctx = SetupContext(ds_config=ds_config, rank=rank, world_size=world, dp=plan["dp"], tp=plan["tp"],
                       pp=plan["pp"], device=device)
    setup = load_factory(plan["model"])(ctx)
    engine, _, _, _ = deepspeed.initialize(model=setup.model, model_parameters=setup.model_parameters,
                                           optimizer=setup.optimizer, lr_scheduler=setup.lr_scheduler,
                                           config=json.loads(json.dumps(ds_config)))
    # A PipelineModule trains through train_batch even with one stage (forward() is refused then).
    pipeline = isinstance(engine, deepspeed.runtime.pipe.engine.PipelineEngine)
    n_groups = len(engine.optimizer.param_groups)
    if rank == 0:
        emit("setup", scheduler=None if engine.lr_scheduler is None else type(engine.lr_scheduler).__name__,
             lambda_epochs=plan["lambda_epochs"],
             lambda_values=lambda_values(setup.lr_lambda, plan["lambda_epochs"], n_groups),
             pipeline=bool(pipeline), world_size=world)

    load_path, _ = engine.load_checkpoint(plan["load_dir"], tag=plan.get("tag"),
                                                     load_lr_scheduler_states=plan["load_lr_scheduler_states"])
    if load_path is None:
        raise SystemExit(f"DeepSpeed found no checkpoint to load in {plan['load_dir']}")
    if rank == 0:
        emit("loaded", load_path=str(load_path), global_step=int(engine.global_steps),
             optimizer_step=adam_step_or_none(engine.optimizer),
             scheduler_position=scheduler_position(engine.lr_scheduler),
             lr=[float(g["lr"]) for g in engine.optimizer.param_groups])

    dp_rank = engine.grid.get_data_parallel_rank() if pipeline else rank
    batches = Batches(plan, setup, dp_rank)
    loss_fn = setup.loss_fn or lm_loss
    tokens_per_step = plan["micro_batch"] * plan["gas"] * plan["dp"] * setup.seq_len
    for _ in range(plan["steps"]):
        step_index = int(engine.global_steps)  # the update ending at step s reads batch_for_step(s - 1)
        lrs = [float(g["lr"]) for g in engine.optimizer.param_groups]
        micro = [mb.to(engine.device) for mb in batches.micro_batches(step_index)]
        t0 = time.perf_counter()
        if pipeline:
            data = iter([(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in micro])
            loss = float(engine.train_batch(data_iter=data))
            first_loss = mean_loss = loss
        else:
            losses = []
            for mb in micro:
                loss_t = loss_fn(engine, mb)
                engine.backward(loss_t)
                engine.step()
                losses.append(loss_t.detach().float())
            first_loss = float(losses[0])
            total = torch.stack(losses).mean().reshape(1)
            dist.all_reduce(total)
            mean_loss = float(total) / world
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if rank == 0:
            emit("step", step=int(engine.global_steps), loss=first_loss, loss_mean=mean_loss, lr=lrs,
                 grad_norm=grad_norm(engine), optimizer_step=adam_step_or_none(engine.optimizer),
                 tokens_per_s=tokens_per_step / seconds if seconds > 0 else None, seconds=seconds,
                 skipped_steps=int(engine.skipped_steps))
    if rank == 0:
        emit("done")
    leave(0)  # barrier, destroy the group, exit: a plain return lets gloo abort a finished run


if __name__ == "__main__":
    main()
