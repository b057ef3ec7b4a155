"""The process `ckpt resume` runs under torch.distributed: load a DeepSpeed checkpoint into a real engine, train.

One script for CPU (gloo) and CUDA (NCCL). It reads the plan that `ckpt_tools.resume.deepspeed` wrote (a JSON
file: the load folder, the launch ds_config, the model, the data, how many steps) and rank 0 prints one
line per event on stdout, `CKPT_RESUME {json}`, which the parent parses:

    setup   the scheduler the model factory built and its lambda at the epochs the parent asked about
    loaded  the live counters right after `engine.load_checkpoint`
    step    per optimizer step: global step, loss, LR per group, grad norm, Adam step, tokens/s
    error   (any rank) the exception that stopped this process, as one line: the parent shows it
    done

Model-free (`"model": "replica"`): the model is a replica of the checkpoint's parameters built from the
plan's `replica` layout (`ckpt_tools.train.replica`), trained with the synthetic loss sum(p * r); after
each optimizer step every rank joins in gathering the full fp32 master and optimizer state of each
parameter, and rank 0 writes them to `<state_dir>/step_<global step>.pt` for the parent to check.

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
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ckpt_tools.resume.common import GROUP_HYPERPARAMS
from ckpt_tools.resume.workers._common import adam_step_or_none, emit, load_callable
from ckpt_tools.samples.workers import _common as c
from ckpt_tools.train import replica as R
from ckpt_tools.train.data import batch_for_step
from ckpt_tools.train.models import GPTConfig
from ckpt_tools.train.procgroup import leave


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
    model = c.build_model()
    groups = c.param_groups(model)
    optimizer = scheduler = lr_lambda = None
    if "optimizer" not in ctx.ds_config:
        optimizer, scheduler = c.adamw_with_lambdalr(groups)
        lr_lambda = c.lr_factor
    cfg = GPTConfig()
    return TrainSetup(
        model=model,
        seq_len=cfg.seq_len,
        vocab_size=cfg.vocab_size,
        model_parameters=groups,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        lr_lambda=lr_lambda,
    )


def megatron_gpt(ctx: SetupContext) -> TrainSetup:
    """The pipeline samples' recipe (`ds_pipeline`), at whatever TP x PP x DP this launch has."""
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # lazy: as in run

    from ckpt_tools.samples.workers import ds_pipeline  # lazy: it imports deepspeed at the top
    from ckpt_tools.train.megatron import GPTModelPipe, MegatronGPTConfig  # lazy: so does this one

    topology = PipeModelDataParallelTopology(num_pp=ctx.pp, num_mp=ctx.tp, num_dp=ctx.dp)
    coord = topology.get_coord(ctx.rank)
    torch.manual_seed(ds_pipeline.default_rng_seed(coord.pipe, coord.model, per_tp_rank=False))
    cfg = MegatronGPTConfig()
    model = GPTModelPipe(cfg, topology, seed=c.SEED)
    return TrainSetup(
        model=model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, model_parameters=c.param_groups(model)
    )


BUILTIN_MODELS: dict[str, Callable[[SetupContext], TrainSetup]] = {"tiny-gpt": tiny_gpt, "megatron-gpt": megatron_gpt}


# --- the model-free replica ---------------------------------------------------------------------------

_GROUP_KEYS = tuple(k for k in GROUP_HYPERPARAMS if k != "maximize")


def lambda_from_spec(spec: str | None, n_groups: int) -> Any:
    """`module:function` -> the LambdaLR lr_lambda (one per group when the function returns a list)."""
    fn = load_callable(spec)
    if fn is None:
        return None
    probe = fn(0)
    if isinstance(probe, (list, tuple)):
        return [(lambda e, i=i: float(fn(e)[i])) for i in range(n_groups)]
    return fn


def replica_setup(ctx: SetupContext, layout: dict[str, Any], scheduler_fn: str | None) -> TrainSetup:
    """The replica model, its param groups as the checkpoint saved them, and — when the launch config names no
    optimizer — the torch optimizer and scheduler the saved state belongs to (rebuilt from that state)."""
    specs = [R.ParamSpec(p["name"], tuple(p["shape"]), p["dtype"], p["requires_grad"]) for p in layout["specs"]]
    model = R.build_replica(
        specs,
        tied=layout.get("tied"),
        buffers={k: (tuple(v[0]), v[1]) for k, v in (layout.get("buffers") or {}).items()},
    )
    params = dict(model.named_parameters())
    groups = []
    for g in layout["groups"]:
        opts = {k: (tuple(v) if isinstance(v, list) else v) for k, v in g["options"].items() if k in _GROUP_KEYS}
        groups.append({"params": [params[n] for n in g["names"]], **opts})
    optimizer = scheduler = lr_lambda = None
    if "optimizer" not in ctx.ds_config:
        kind = layout.get("optimizer") or "AdamW"
        cls = getattr(torch.optim, kind)
        clean = [{k: v for k, v in g.items() if k not in ("initial_lr", "max_lr", "min_lr")} for g in groups]
        if kind == "SGD":
            clean = [{k: v for k, v in g.items() if k not in ("betas", "eps", "amsgrad")} for g in clean]
        else:
            clean = [{k: v for k, v in g.items() if k not in ("momentum", "dampening", "nesterov")} for g in clean]
        optimizer = cls(clean)
        sched = layout.get("scheduler")
        if sched:
            lr_lambda = lambda_from_spec(scheduler_fn, len(groups))
            if sched["class"] in R.LAMBDA_SCHEDULERS and lr_lambda is None:
                # the function is not in the checkpoint: a stand-in keeps the saved LR (the parent checks only
                # the first resumed step's LR and the loaded position / base_lrs then)
                lr_lambda = [(lambda e, r=r: r) for r in layout.get("lambda_hold") or [1.0] * len(groups)]
                hold = True
            else:
                hold = False
            for g, src in zip(optimizer.param_groups, groups):
                for k in ("initial_lr", "max_lr", "min_lr"):
                    if k in src:
                        g[k] = src[k]
            scheduler = R.rebuild_torch_scheduler(optimizer, sched["state"], sched["class"], lr_lambda)
            if hold:
                lr_lambda = None
    return TrainSetup(
        model=model,
        seq_len=1,
        vocab_size=1,
        model_parameters=groups,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        lr_lambda=lr_lambda,
    )


def full_state(engine: Any, module: torch.nn.Module, keys: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {"fp32": master, and each of `keys` (the optimizer's state names)} for every trainable
    parameter, gathered whole. Collective: every rank calls it; first the ranks agree (one all-reduce of
    flags) on which states every rank can provide — DeepSpeed's full getters raise on a rank whose fragment
    lacks a state (e.g. after a load without optimizer states) while the others wait in their all-reduce."""
    # lazy: as in run
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_get_local_optimizer_state

    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    flags = torch.ones(len(named), len(keys), dtype=torch.int32)
    for i, (_, p) in enumerate(named):
        for j, key in enumerate(keys):
            try:
                if hasattr(p, "ds_id"):  # ZeRO-3
                    safe_get_local_optimizer_state(p, key)
                elif getattr(p, "_hp_mapping", None) is not None:  # ZeRO-1/2, bf16 optimizer: this rank's piece
                    p._hp_mapping.get_hp_fragment(key)
            except (KeyError, AttributeError, TypeError, ValueError, IndexError):
                flags[i, j] = 0
    dev = engine.device if dist.get_backend() == "nccl" else torch.device("cpu")
    flags = flags.to(dev)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    flags = flags.cpu()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for i, (name, p) in enumerate(named):
        master = safe_get_full_fp32_param(p)
        entry = {"fp32": (master if master is not None else p.detach()).float().cpu().clone()}
        for j, key in enumerate(keys):
            if flags[i, j]:
                v = safe_get_full_optimizer_state(p, key)
                if v is not None:
                    entry[key] = v.float().cpu().clone().reshape(entry["fp32"].shape)
        out[name] = entry
    return out


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
            import numpy as np  # lazy: only for a user token file

            path = plan["data"]
            self.tokens = (
                np.load(path, mmap_mode="r") if path.endswith(".npy") else np.memmap(path, dtype=np.uint16, mode="r")
            )

    def _rows(self, step: int, orig_rank: int) -> torch.Tensor:
        n = self.micro * self.orig_gas
        if self.tokens is None:
            return batch_for_step(
                step, batch_size=n, seq_len=self.seq_len, vocab_size=self.vocab_size, dp_rank=orig_rank
            )
        # A user token file: windows of seq_len + 1 tokens, picked by the same (step, rank) seeding.
        windows = len(self.tokens) // (self.seq_len + 1)
        g = torch.Generator().manual_seed(1234 * 1_000_003 + step * 1009 + orig_rank)
        starts = torch.randint(0, windows, (n,), generator=g) * (self.seq_len + 1)
        rows = [torch.from_numpy(self.tokens[s : s + self.seq_len + 1].astype("int64")) for s in starts.tolist()]
        return torch.stack(rows)

    def micro_batches(self, step: int) -> list[torch.Tensor]:
        out = []
        for j in range(self.gas):
            number = self.dp_rank * self.gas + j
            orig_rank, orig_j = divmod(number, self.orig_gas)
            out.append(self._rows(step, orig_rank)[orig_j * self.micro : (orig_j + 1) * self.micro])
        return out


# --- the loop -------------------------------------------------------------------------------------


def lm_loss(engine: Any, tokens: torch.Tensor) -> torch.Tensor:
    return c.lm_loss(engine, tokens)


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


def one_line(e: BaseException) -> str:
    """The exception as the one line the user sees: its type and its message with the lines joined."""
    msg = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    if len(msg) > 600:
        msg = msg[:597] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def main() -> None:
    try:
        run()
    except BaseException as e:  # noqa: BLE001  report this process's own error, then leave without a hang
        if isinstance(e, SystemExit) and e.code in (0, None):
            raise
        traceback.print_exc()
        emit(
            "error",
            rank=int(os.environ.get("RANK", "0")),
            message=str(e.code) if isinstance(e, SystemExit) else one_line(e),
        )
        leave(2, barrier=False)


def run() -> None:
    parser = argparse.ArgumentParser(description="ckpt resume worker (launched by `ckpt resume`)")
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--local_rank", type=int, default=None)  # DeepSpeed's launcher adds it
    args = parser.parse_args()
    plan = json.loads(args.plan.read_text())

    import deepspeed  # lazy: only where an engine is built; user factories import this module for its types

    if plan["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend="nccl" if plan["device"] == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    engine, setup = build_engine(plan, rank, world)
    # A PipelineModule trains through train_batch even with one stage (forward() is refused then).
    pipeline = isinstance(engine, deepspeed.runtime.pipe.engine.PipelineEngine)
    if rank == 0:
        emit(
            "setup",
            scheduler=None if engine.lr_scheduler is None else type(engine.lr_scheduler).__name__,
            lambda_epochs=plan["lambda_epochs"],
            lambda_values=lambda_values(setup.lr_lambda, plan["lambda_epochs"], len(engine.optimizer.param_groups)),
            pipeline=bool(pipeline),
            world_size=world,
        )
    load(plan, engine, rank)
    if plan["model"] == "replica":
        run_replica(plan, engine, setup, rank, world)
    else:
        train(plan, engine, setup, pipeline, rank, world)
    if rank == 0:
        emit("done")
    leave(0)  # barrier, destroy the group, exit: a plain return lets gloo abort a finished run


def build_engine(plan: dict[str, Any], rank: int, world: int) -> tuple[Any, TrainSetup]:
    """The model (the model-free replica, a built-in recipe or the user's factory) in DeepSpeed's engine, with the
    launch ds_config."""
    import deepspeed  # lazy: as in run

    ds_config = plan["ds_config"]
    ctx = SetupContext(
        ds_config=ds_config,
        rank=rank,
        world_size=world,
        dp=plan["dp"],
        tp=plan["tp"],
        pp=plan["pp"],
        device=plan["device"],
    )
    if plan["model"] == "replica":
        setup = replica_setup(ctx, plan["replica"], plan.get("scheduler_fn"))
    else:
        setup = load_factory(plan["model"])(ctx)
    engine, _, _, _ = deepspeed.initialize(
        model=setup.model,
        model_parameters=setup.model_parameters,
        optimizer=setup.optimizer,
        lr_scheduler=setup.lr_scheduler,
        config=json.loads(json.dumps(ds_config)),
    )
    return engine, setup


def load(plan: dict[str, Any], engine: Any, rank: int) -> None:
    """`engine.load_checkpoint` of the plan's folder and tag; rank 0 emits the live counters right after."""
    load_path, _ = engine.load_checkpoint(
        plan["load_dir"],
        tag=plan.get("tag"),
        load_lr_scheduler_states=plan["load_lr_scheduler_states"],
        load_optimizer_states=plan.get("load_optimizer_states", True),
    )
    if load_path is None:
        raise SystemExit(f"DeepSpeed found no checkpoint to load in {plan['load_dir']}")
    if rank == 0:
        base_lrs = getattr(engine.lr_scheduler, "base_lrs", None)
        emit(
            "loaded",
            load_path=str(load_path),
            global_step=int(engine.global_steps),
            optimizer_step=adam_step_or_none(engine.optimizer),
            scheduler_position=scheduler_position(engine.lr_scheduler),
            base_lrs=[float(x) for x in base_lrs] if base_lrs is not None else None,
            lr=[float(g["lr"]) for g in engine.optimizer.param_groups],
        )


def train(plan: dict[str, Any], engine: Any, setup: TrainSetup, pipeline: bool, rank: int, world: int) -> None:
    """The model loop: `plan["steps"]` optimizer steps on the uninterrupted run's batches (`Batches`), one `step`
    record each."""
    dp_rank = engine.grid.get_data_parallel_rank() if pipeline else rank
    batches = Batches(plan, setup, dp_rank)
    loss_fn = setup.loss_fn or lm_loss
    tokens_per_step = plan["micro_batch"] * plan["gas"] * plan["dp"] * setup.seq_len
    for _ in range(plan["steps"]):
        step_index = int(engine.global_steps)  # the update ending at step s reads batch_for_step(s - 1)
        lrs = [float(g["lr"]) for g in engine.optimizer.param_groups]
        micro = [mb.to(engine.device) for mb in batches.micro_batches(step_index)]
        t0 = time.perf_counter()
        first_loss, mean_loss = optimizer_step(engine, micro, pipeline, loss_fn, world)
        if plan["device"] == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        if rank == 0:
            emit(
                "step",
                step=int(engine.global_steps),
                loss=first_loss,
                loss_mean=mean_loss,
                lr=lrs,
                grad_norm=grad_norm(engine),
                optimizer_step=adam_step_or_none(engine.optimizer),
                tokens_per_s=tokens_per_step / seconds if seconds > 0 else None,
                seconds=seconds,
                skipped_steps=int(engine.skipped_steps),
            )


def optimizer_step(
    engine: Any, micro: list[torch.Tensor], pipeline: bool, loss_fn: Callable, world: int
) -> tuple[float, float]:
    """One optimizer step over this rank's micro-batches: (the first micro-batch's loss, the mean over all ranks'
    micro-batches). A pipeline runs `train_batch` (its loss is already the mean)."""
    if pipeline:
        data = iter([(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in micro])
        loss = float(engine.train_batch(data_iter=data))
        return loss, loss
    losses = []
    for mb in micro:
        loss_t = loss_fn(engine, mb)
        engine.backward(loss_t)
        engine.step()
        losses.append(loss_t.detach().float())
    total = torch.stack(losses).mean().reshape(1)
    dist.all_reduce(total)
    return float(losses[0]), float(total) / world


def run_replica(plan: dict[str, Any], engine: Any, setup: TrainSetup, rank: int, world: int) -> None:
    """The model-free loop: the synthetic loss through the engine (so ZeRO-3 gathers each module's
    parameters in its forward), one step record and one state file per optimizer step."""
    layout = plan["replica"]
    specs = [R.ParamSpec(p["name"], tuple(p["shape"]), p["dtype"], p["requires_grad"]) for p in layout["specs"]]
    directions = R.synthetic_directions(specs, layout.get("seed", 0), max_norm=layout.get("max_norm"))
    state_dir = Path(plan["state_dir"])
    keys = ("momentum_buffer",) if layout.get("optimizer") == "SGD" else ("exp_avg", "exp_avg_sq")
    for _ in range(plan["steps"]):
        lrs = [float(g["lr"]) for g in engine.optimizer.param_groups]
        t0 = time.perf_counter()
        losses = []
        for _j in range(plan["gas"]):
            loss_t = engine(directions)
            engine.backward(loss_t)
            engine.step()
            losses.append(loss_t.detach().float())
        if plan["device"] == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        total = torch.stack(losses).mean().reshape(1)
        dist.all_reduce(total)
        state = full_state(engine, engine.module, keys)
        if rank == 0:
            step = int(engine.global_steps)
            torch.save({"step": adam_step_or_none(engine.optimizer), "params": state}, state_dir / f"step_{step}.pt")
            emit(
                "step",
                step=step,
                loss=float(losses[0]),
                loss_mean=float(total) / world,
                lr=lrs,
                grad_norm=grad_norm(engine),
                optimizer_step=adam_step_or_none(engine.optimizer),
                tokens_per_s=None,
                seconds=seconds,
                skipped_steps=int(engine.skipped_steps),
            )


if __name__ == "__main__":
    main()
