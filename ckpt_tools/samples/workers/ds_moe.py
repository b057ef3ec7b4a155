"""DeepSpeed Mixture-of-Experts samples: real `engine.save_checkpoint` output of a model with
`deepspeed.moe.layer.MoE` layers, trained on 2 CPU ranks over gloo.

The model (`TinyMoE`): token + position embeddings, 2 layers of hidden size 32 (a LayerNorm, a dense
residual Linear, a LayerNorm and an MoE feed-forward with 4 experts, top-1 gating, ep_size 2), a final
LayerNorm and an LM head. Both layers are MoE layers, so DeepSpeed writes one file per (MoE layer, GLOBAL
expert id): `layer_{0,1}_expert_{0..3}_mp_rank_00_model_states.pt`, and the non-expert weights in
`mp_rank_00_model_states.pt`. With 2 ranks and ep_size 2 every rank holds 2 of the 4 experts of each layer
(expert-data-parallel size 1) while the non-expert weights are data parallel over both ranks.

Optimizer: two param groups as LM runs have them ("decay": dim >= 2 with weight decay, "no_decay": biases
and norms), given names because DeepSpeed's MoE splitter needs them, then split with
`deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer` (as DeepSpeed's MoE tutorial
tells users to) into 4 groups: decay, no_decay (non-expert), and one `moe: True` group per original group
holding the expert parameters (both named after the expert group, "ep_size_2"). A torch AdamW over those
groups and a torch CosineAnnealingLR are built here and passed to `deepspeed.initialize(optimizer=...,
lr_scheduler=...)`; the config has no optimizer/scheduler section. The loss is the LM loss plus
`AUX_LOSS_COEF` times the gates' load-balancing losses. 6 updates, saved after update 4 (the shared recipe).

Samples:
- `moe_zero2_bf16`: ZeRO stage 2, bf16. In 0.19.8 this writes no `expp_rank_*` files: the optimizer is in
  `bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt`, expert params partitioned over the expert-data-parallel
  group (size 1 here), not over the whole data-parallel group.
- `moe_stage0`: no ZeRO (stage 0), fp32: `expp_rank_{r}_mp_rank_00_optim_states.pt` per expert-parallel rank,
  each holding the full torch optimizer state of that rank (the non-expert part and its own experts).

Every expert starts from different weights (re-initialised with a seed derived from the GLOBAL expert id
and the layer), so that a reader that swaps experts is caught; DeepSpeed's own `Experts` deep-copies one
expert module, which would make all experts of a layer identical at step 0.

Run-time changes needed on CPU (DeepSpeed 0.19.8, torch 2.13.0+cpu, Python 3.11): none beyond what every
DeepSpeed sample here uses: `DS_ACCELERATOR=cpu` (set by `ckpt_tools.samples.worker_env`),
`deepspeed.init_distributed(dist_backend="gloo")`, and a torch AdamW instead of DeepSpeed's FusedAdam. The
MoE all-to-all (`dist.all_to_all_single`) runs on gloo; the top-k gate has no CUDA calls.

`--check CKPT` (instead of `--out`) rebuilds the same model, optimizer and scheduler on the same ranks,
calls `engine.load_checkpoint` and checks that global_steps, the param groups' LRs, the scheduler state and
the Adam step match the manifest beside CKPT, and that the expert weights were loaded (they differ from
the freshly initialised ones); rank 0 prints one `CHECK OK ...` line, or the process exits 1.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import is_moe_param, split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import groups, safe_get_full_fp32_param

from ckpt_tools.read import safe_load
from ckpt_tools.train.manifest import manifest_path, write_manifest
from ckpt_tools.train.procgroup import leave
from ckpt_tools.samples.workers import _common as c
from ckpt_tools.samples.workers.ds_pipeline import gather_whole, master_and_moments

VOCAB = 64
SEQ_LEN = 16
HIDDEN = 32
N_LAYERS = 2
NUM_EXPERTS = 4
EP_SIZE = 2
_RECIPE = (NUM_EXPERTS, N_LAYERS, EP_SIZE)  # each run of a launch starts from these (for_each_run)
EXPERT_FFN = 32  # each expert: Linear(32, 32) -> GELU -> Linear(32, 32)
TOP_K = 1
USE_RTS = False  # Random Token Selection draws from torch's RNG, which no checkpoint saves: a resume could
#                 not reproduce the token drops, so the resumed losses would not match the run's
AUX_LOSS_COEF = 0.01
COSINE_T_MAX = 8
COSINE_ETA_MIN = 1e-4


@dataclass(frozen=True)
class MoEVariant:
    stage: int
    bf16: bool


VARIANTS = {
    "moe_zero2_bf16": MoEVariant(stage=2, bf16=True),
    "moe_stage0": MoEVariant(stage=0, bf16=False),
    # made by tests in a temporary folder (not a stored sample): fp32 ZeRO-2, so that a resume at another expert-
    # parallel size can be compared with the run's own at fp32 rounding (bf16 GEMMs of other shapes round apart)
    "moe_zero2_fp32": MoEVariant(stage=2, bf16=False),
    # the same run under an older DeepSpeed (0.16.9: expp_rank files of {'optimizer': None} beside the ZeRO files,
    # model states without param_shapes / ds_config): run by the Python of a virtualenv holding that release
    "moe_zero2_bf16_ds0169": MoEVariant(stage=2, bf16=True),
}


class ExpertMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(HIDDEN, EXPERT_FFN)
        self.fc2 = nn.Linear(EXPERT_FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()

        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.moe = MoE(
            hidden_size=HIDDEN, expert=ExpertMLP(), num_experts=NUM_EXPERTS, ep_size=EP_SIZE, k=TOP_K, use_rts=USE_RTS
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.dense(self.ln_1(x))
        out, l_aux, _ = self.moe(self.ln_2(x))
        return x + out, l_aux


class TinyMoE(nn.Module):
    """`wte`, `wpe`, `blocks.{0,1}.{ln_1,dense,ln_2,moe}`, `ln_f`, `lm_head`; `forward(tokens)` returns
    logits and keeps the summed gate loss in `self.l_aux`."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ_LEN, HIDDEN)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(N_LAYERS))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.l_aux = torch.zeros(())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        l_aux = x.new_zeros((), dtype=torch.float32)
        for blk in self.blocks:
            x, aux = blk(x)
            l_aux = l_aux + aux.float()
        self.l_aux = l_aux
        return self.lm_head(self.ln_f(x))


def ep_rank() -> int:
    return groups._get_expert_parallel_rank(f"ep_size_{EP_SIZE}")


def build_model() -> TinyMoE:
    """Same non-expert weights on every rank (seeded); each local expert re-initialised from a seed of its
    (layer, GLOBAL expert id), so expert E has the same start wherever it lives and differs from the others.
    Needs the expert-parallel rank, so the expert process groups are created here with DeepSpeed's own
    `groups._create_expert_and_data_parallel` (what `MoE.set_deepspeed_parallelism` calls; deepspeed.initialize
    then finds the group and only attaches it to the layers)."""
    if f"ep_size_{EP_SIZE}" not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(EP_SIZE)
    torch.manual_seed(c.SEED)
    model = TinyMoE()
    local = NUM_EXPERTS // EP_SIZE
    for layer, blk in enumerate(model.blocks):
        for i, expert in enumerate(blk.moe.deepspeed_moe.experts.deepspeed_experts):
            gid = ep_rank() * local + i
            g = torch.Generator().manual_seed(10_000 + 100 * layer + gid)
            with torch.no_grad():
                for p in expert.parameters():
                    bound = 1.0 / math.sqrt(p.shape[-1] if p.dim() > 1 else HIDDEN)
                    p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
    return model


def optimizer_groups(model: nn.Module) -> list[dict[str, Any]]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "name": "decay", "weight_decay": c.WEIGHT_DECAY},
        {"params": no_decay, "name": "no_decay", "weight_decay": 0.0},
    ]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def build_engine(v: MoEVariant, dp: int, *, gas: int = 1, universal: bool = False):
    """The engine over `build_model()` with the split groups, a torch AdamW and CosineAnnealingLR; the model
    keeps, in `group_sizes`, what rank 0 gave each group (ZeRO-2's groups then hold one flat partition).
    `gas`: gradient accumulation steps; `universal`: the config loads universal checkpoints."""
    cfg = c.ds_config(v.stage, dp, bf16={"enabled": v.bf16})
    if gas > 1:
        cfg.update(train_batch_size=c.MICRO_BATCH * dp * gas, gradient_accumulation_steps=gas)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    model = build_model()
    groups = optimizer_groups(model)
    model.group_sizes = [
        {"param_tensors_this_rank": len(g["params"]), "elements_this_rank": sum(p.numel() for p in g["params"])}
        for g in groups
    ]
    optimizer = torch.optim.AdamW(groups, lr=c.PEAK_LR, betas=c.BETAS, eps=1e-8)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=COSINE_T_MAX, eta_min=COSINE_ETA_MIN)
    engine = c.ds_initialize(model, cfg, optimizer=optimizer, scheduler=scheduler)
    return engine, cfg, optimizer, scheduler


def update(engine: Any, tokens: torch.Tensor) -> float:
    logits = engine(tokens[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    total = loss + AUX_LOSS_COEF * engine.module.l_aux
    engine.backward(total)
    engine.step()
    return loss.item()


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Global counts from the live model: non-expert parameters once, expert parameters summed over the
    expert-parallel ranks (each global expert counted once, not once per expert-data-parallel replica)."""
    dense = [p for p in model.parameters() if not is_moe_param(p)]
    expert = [p for p in model.parameters() if is_moe_param(p)]
    local = torch.tensor([sum(p.numel() for p in expert), len(expert)], dtype=torch.long)
    dist.all_reduce(local, group=groups._get_expert_parallel_group(f"ep_size_{EP_SIZE}"))
    dense_n = sum(p.numel() for p in dense)
    return {
        "count": dense_n + int(local[0]),
        "tensors": len(dense) + int(local[1]),
        "non_expert_count": dense_n,
        "expert_count": int(local[0]),
        "per_expert_count": sum(p.numel() for p in ExpertMLP().parameters()),
    }


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def scheduler_state(scheduler: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in scheduler.state_dict().items()}


def make(args: argparse.Namespace, rank: int, dp: int) -> None:
    v = VARIANTS[args.sample]
    engine, cfg, _, scheduler = build_engine(v, dp)
    ckpt = args.out / args.sample
    history, saved = _train(engine, ckpt, rank, scheduler)
    counts = parameter_counts(engine.module)
    if rank == 0:
        group = f"ep_size_{EP_SIZE}"
        write_manifest(
            ckpt,
            sample=args.sample,
            format="deepspeed_moe",
            world_size=c.world_size(),
            topology={
                "dp": dp,
                "tp": 1,
                "pp": 1,
                "zero_stage": v.stage,
                "ep": EP_SIZE,
                "expert_dp": groups._get_expert_data_parallel_world_size(group),
            },
            steps=c.SAVE_AFTER_STEP,
            counters=saved["counters"],
            lr=saved["lr"],
            parameters={"count": counts["count"], "tensors": counts["tensors"]},
            extra={
                "moe": {
                    "num_experts": NUM_EXPERTS,
                    "ep_size": EP_SIZE,
                    "num_moe_layers": N_LAYERS,
                    "num_local_experts": NUM_EXPERTS // EP_SIZE,
                    "top_k": TOP_K,
                    "use_rts": USE_RTS,
                    "expert_group": group,
                    "expert_files": [f for f in saved["files"] if "_expert_" in f],
                    "aux_loss_coef": AUX_LOSS_COEF,
                    "expert_init": "each expert re-initialised from seed 10000 + 100*layer + global_expert_id",
                },
                "parameter_counts": counts,
                "param_groups": saved["param_groups"],
                "param_groups_note": "DeepSpeed's split of [decay (dim >= 2), no_decay] into non-MoE groups "
                "0-1 and MoE groups 2-3 (moe=True, name=expert group); the sizes are the "
                "model parameters rank 0 gave each group (its 2 local experts per layer "
                "in the MoE groups)",
                "scheduler": "torch CosineAnnealingLR(T_max=%d, eta_min=%g) over a torch AdamW, passed to "
                "deepspeed.initialize" % (COSINE_T_MAX, COSINE_ETA_MIN),
                "scheduler_state": saved["scheduler_state"],
                "optimizer": type(c.innermost_optimizer(engine.optimizer)).__name__,
                "optimizer_wrapper": type(engine.optimizer).__name__,
                "ds_config": cfg,
                "dtype": "bfloat16" if v.bf16 else "float32",
                "tag": f"global_step{c.SAVE_AFTER_STEP}",
                "files": saved["files"],
                "model": {
                    "vocab_size": VOCAB,
                    "seq_len": SEQ_LEN,
                    "hidden": HIDDEN,
                    "n_layers": N_LAYERS,
                    "expert_ffn": EXPERT_FFN,
                },
                "micro_batch_per_rank": c.MICRO_BATCH,
                "total_steps_trained": c.TOTAL_STEPS,
                "saved_after_step": c.SAVE_AFTER_STEP,
                "history": history,
                "history_note": c.HISTORY_NOTE + "; 'loss' excludes the aux (gate) loss",
            },
        )


def _train(engine: Any, ckpt: Path, rank: int, scheduler: Any):
    def save() -> dict[str, Any]:
        engine.save_checkpoint(str(ckpt))
        c.drop_deepspeed_scripts(ckpt)
        dist.barrier()
        return {
            **c.snapshot(
                global_step=engine.global_steps,
                optimizer=engine.optimizer,
                scheduler=scheduler,
                skipped_steps=engine.skipped_steps,
            ),
            "param_groups": [
                {k: val for k, val in g.items() if k != "params"} | sizes
                for g, sizes in zip(engine.optimizer.param_groups, engine.module.group_sizes)
            ],
            "scheduler_state": scheduler_state(scheduler),
            "files": files_under(ckpt),
        }

    return c.train(
        lambda step: update(engine, c.tokens_for_step(step, rank)), lambda: c.current_lrs(engine.optimizer), save
    )


def saved_weights(ckpt: Path, name: str) -> torch.Tensor:
    """The value of the live parameter `name` as stored in `ckpt` (read with torch.load): a local expert
    from its `layer_{L}_expert_{global id}` file, the rest from `mp_rank_00_model_states.pt`'s module."""
    tag = (ckpt / "latest").read_text().strip()
    m = re.match(r"blocks\.(\d+)\.moe\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.*)", name)
    if m is None:
        sd = safe_load.torch_load_allowlisted(ckpt / tag / "mp_rank_00_model_states.pt", mmap=False)
        return sd["module"][name]
    layer, local, rest = int(m[1]), int(m[2]), m[3]
    gid = ep_rank() * (NUM_EXPERTS // EP_SIZE) + local
    sd = safe_load.torch_load_allowlisted(
        ckpt / tag / f"layer_{layer}_expert_{gid}_mp_rank_00_model_states.pt", mmap=False
    )
    return sd[f"blocks.{layer}.moe.deepspeed_moe.experts.deepspeed_experts.{gid}.{rest}"]


def dump_fp32(engine: Any, path: Path) -> None:
    """What DeepSpeed itself holds as each parameter's full fp32 value after load_checkpoint
    (`deepspeed.utils.safe_get_full_fp32_param`: the optimizer's fp32 master; without ZeRO and mixed precision
    there is none and the parameter is the fp32 value), under GLOBAL expert names: the reference a reader's
    export is compared with."""
    local = NUM_EXPERTS // EP_SIZE
    out = {}
    for name, p in engine.module.named_parameters():
        v = safe_get_full_fp32_param(p)
        v = (p if v is None else v).detach().float().clone()
        name = re.sub(
            r"(\.deepspeed_experts\.)(\d+)(\.)", lambda m: f"{m[1]}{ep_rank() * local + int(m[2])}{m[3]}", name
        )
        out[name] = v
    torch.save(out, path)


def check(args: argparse.Namespace, rank: int, dp: int) -> None:
    """Reload `args.check` with DeepSpeed and compare with its manifest (see the module docstring)."""
    man = json.loads(manifest_path(args.check).read_text())
    v = VARIANTS[man["sample"]]
    engine, _, _, _ = build_engine(v, dp)
    fresh = {n: p.detach().float().clone() for n, p in engine.module.named_parameters() if "experts" in n}
    load_path, _ = engine.load_checkpoint(str(args.check), load_optimizer_states=True, load_lr_scheduler_states=True)
    problems = []
    if load_path is None:
        problems.append("load_checkpoint returned None")
    if args.dump_fp32 is not None:
        dump_fp32(engine, args.dump_fp32 / f"fp32_rank{rank}.pt")
    if engine.global_steps != man["counters"]["global_step"]:
        problems.append(f"global_steps {engine.global_steps} != {man['counters']['global_step']}")
    lrs = c.current_lrs(engine.optimizer)
    if any(abs(a - b) > 1e-12 for a, b in zip(lrs, man["lr"]["param_groups"])) or len(lrs) != len(
        man["lr"]["param_groups"]
    ):
        problems.append(f"lrs {lrs} != {man['lr']['param_groups']}")
    sched = scheduler_state(engine.lr_scheduler)
    if sched != man["extra"]["scheduler_state"]:
        problems.append(f"scheduler state {sched} != {man['extra']['scheduler_state']}")
    step = c.adam_step(engine.optimizer)
    if step != man["counters"]["optimizer_step"]:
        problems.append(f"adam step {step} != {man['counters']['optimizer_step']}")
    unchanged = [n for n, p in engine.module.named_parameters() if n in fresh and torch.equal(p.float(), fresh[n])]
    if unchanged:
        problems.append(f"expert weights not loaded: {unchanged}")
    mismatched = [
        n
        for n, p in engine.module.named_parameters()
        if not torch.equal(p.detach().float(), saved_weights(args.check, n).float())
    ]
    if mismatched:
        problems.append(f"weights differ from the files: {mismatched}")
    # the next update after the reload must give the loss the uninterrupted run had (rank 0's, as recorded)
    loss = update(engine, c.tokens_for_step(engine.global_steps, rank))
    expected = next(h["loss"] for h in man["extra"]["history"] if h["step"] == man["counters"]["global_step"] + 1)
    if rank == 0 and loss != expected:
        problems.append(f"resumed loss {loss!r} != the run's {expected!r}")
    flag = torch.tensor([len(problems)])
    dist.all_reduce(flag)
    for p in problems:
        print(f"rank {rank}: CHECK FAIL {p}", file=sys.stderr, flush=True)
    if rank == 0 and int(flag) == 0:
        print(
            f"CHECK OK {args.check}: global_steps={man['counters']['global_step']} lrs={lrs} adam_step={step} "
            f"scheduler last_epoch={sched.get('last_epoch')} resumed loss={loss!r} (run: {expected!r}), "
            f"all {len(list(engine.module.parameters()))} local weight tensors equal to the files",
            flush=True,
        )
    if int(flag):
        leave(1)


def whole_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's fp32 master and Adam moments, whole, under GLOBAL expert names: each rank's ZeRO-1/2
    pieces (read through the parameter's fragment address, `ds_pipeline.master_and_moments`; without ZeRO the
    fp32 weight and torch's Adam state) put together by `ds_pipeline.gather_whole`. An expert's pieces come from
    the ranks of its expert-data-parallel group only (the other expert-parallel ranks hold other experts under the
    same local name, renamed apart here)."""
    local_n = NUM_EXPERTS // EP_SIZE

    def glob(n):
        return re.sub(
            r"(\.deepspeed_experts\.)(\d+)(\.)",
            lambda m: f"{m[1]}{ep_rank() * local_n + int(m[2])}{m[3]}",
            n,
        )

    local, shapes = {}, {}
    zero = engine.zero_optimization()
    inner = c.innermost_optimizer(engine.optimizer)
    for name, prm in engine.module.named_parameters():
        shapes[glob(name)] = tuple(prm.shape)
        if not zero:  # no ZeRO, fp32: the weight is the master; the non-expert ones are replicas, rank 0's taken
            st = inner.state[prm]
            piece = (
                None
                if (c.rank() and not is_moe_param(prm))
                else (
                    0,
                    {
                        "fp32": prm.data.reshape(-1),
                        "exp_avg": st["exp_avg"].reshape(-1),
                        "exp_avg_sq": st["exp_avg_sq"].reshape(-1),
                    },
                )
            )
        else:
            piece = master_and_moments(engine.optimizer, prm)
        if piece is not None:
            offset, views = piece
            local[glob(name)] = (offset, {k: v.detach().float().clone() for k, v in views.items()})
    return gather_whole(local, shapes)


def resume(args: argparse.Namespace, rank: int, dp: int) -> None:
    """DeepSpeed's own engine.load_checkpoint of `args.resume` (the variant's model, optimizer and scheduler),
    then `args.steps` updates; rank 0 writes one record per update to `args.record`: `step`, `lr` (rank 0's param
    groups, the LR the update used), `lr_by_rank` (every rank's), `optimizer_step` (Adam's step after it) and
    `loss` (rank 0's LM loss, of the first micro-batch).

    Another shape than the run's: `--ep N` builds the MoE layers at expert-parallel size N; `--universal` loads
    a universal checkpoint (`"checkpoint": {"load_universal": true}`); with fewer ranks than `--run-dp` (the
    saved run's DP size) each rank accumulates the micro-batches of run-DP / DP ranks (gradient accumulation),
    so that every update sees the tokens the saved run's updates saw. `--dump DIR`: rank 0 writes
    `state_loaded.pt` and `state_step1.pt` (`whole_state`: every parameter's fp32 master and moments under
    global names, right after the load and after the first update)."""
    run_dp = args.run_dp or dp
    if run_dp % dp:
        raise SystemExit(f"--run-dp {run_dp} is not a multiple of the {dp} ranks")
    gas = run_dp // dp
    v = VARIANTS[args.sample]
    engine, _, _, _ = build_engine(v, dp, gas=gas, universal=args.universal)
    load_path, _ = engine.load_checkpoint(str(args.resume), load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise SystemExit(f"load_checkpoint found nothing in {args.resume}")
    if args.dump is not None:
        state = whole_state(engine)
        if rank == 0:
            torch.save(state, args.dump / "state_loaded.pt")
    records = []
    for i in range(args.steps):
        lrs = c.current_lrs(engine.optimizer)
        step = engine.global_steps
        losses = [update(engine, c.tokens_for_step(step, rank * gas + k)) for k in range(gas)]
        every: list[Any] = [None] * dp
        dist.all_gather_object(every, lrs)
        records.append(
            {
                "step": engine.global_steps,
                "lr": lrs,
                "lr_by_rank": every,
                "optimizer_step": c.adam_step(engine.optimizer),
                "loss": losses[0],
            }
        )
        if args.dump is not None and i == 0:
            state = whole_state(engine)
            if rank == 0:
                torch.save(state, args.dump / "state_step1.pt")
    if rank == 0 and args.record is not None:
        args.record.write_text(json.dumps(records, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description="Train the tiny MoE and save one DeepSpeed MoE sample, or --check one.")
    p.add_argument("--sample", choices=sorted(VARIANTS))
    p.add_argument("--out", type=Path, help="the group folder the sample goes into")
    p.add_argument("--check", type=Path, help="reload this sample checkpoint with DeepSpeed and compare")
    p.add_argument(
        "--dump-fp32",
        type=Path,
        help="--check: each rank writes fp32_rank<R>.pt here: DeepSpeed's "
        "safe_get_full_fp32_param of every parameter after the reload, under global expert names",
    )
    p.add_argument(
        "--resume",
        type=Path,
        help="resume this checkpoint with DeepSpeed (--sample names the variant) "
        "and record the LR of every update on every rank",
    )
    p.add_argument("--record", type=Path, help="--resume: rank 0 writes the records here (JSON)")
    p.add_argument("--steps", type=int, default=2, help="--resume: updates after the reload (default 2)")
    p.add_argument("--ep", type=int, help="--resume: the expert-parallel size to run at (default: the sample's, 2)")
    p.add_argument("--universal", action="store_true", help="--resume: the checkpoint is a universal one")
    p.add_argument(
        "--run-dp",
        type=int,
        help="--resume: the saved run's DP size; fewer ranks accumulate its micro-batches (default: this run's)",
    )
    p.add_argument("--dump", type=Path, help="--resume: rank 0 writes state_loaded.pt and state_step1.pt here")
    p.add_argument("--experts", type=int, help="--out: experts per MoE layer (bench/bench_moe.py; not for samples)")
    p.add_argument("--layers", type=int, help="--out: MoE layers (bench/bench_moe.py; not for samples)")
    args = p.parse_args()
    global NUM_EXPERTS, N_LAYERS, EP_SIZE
    NUM_EXPERTS, N_LAYERS = args.experts or _RECIPE[0], args.layers or _RECIPE[1]  # the same recipe, bigger
    EP_SIZE = args.ep or _RECIPE[2]
    if args.resume is not None:
        if args.sample is None:
            p.error("--resume needs --sample (the variant that wrote it)")
    elif (args.out is None) == (args.check is None) or (args.out is not None and args.sample is None):
        p.error("give --sample NAME --out DIR, --check CKPT, or --sample NAME --resume CKPT")

    deepspeed.init_distributed(dist_backend="gloo")
    rank, dp = c.rank(), c.world_size()
    if args.resume is not None:
        resume(args, rank, dp)
    elif args.check is not None:
        check(args, rank, dp)
    else:
        make(args, rank, dp)


if __name__ == "__main__":
    c.for_each_run(main)
    c.shutdown()
