"""Megatron-DeepSpeed pipeline samples: real `PipelineEngine.save_checkpoint` output from TP=2 x PP=2.

Four CPU ranks over gloo train `ckpt_tools.train.megatron.GPTModelPipe` with bf16 and ZeRO stage 1,
two micro-batches per step (eight ranks for the DP=2 sample). The samples differ in what a TP-aware reader
must handle:

- `gpt_tp2_pp2`: the model states carry `universal_checkpoint_info` as Megatron-DeepSpeed writes it,
  so `ds_to_universal` knows which tensors are replicated, row-parallel or vocabulary-split.
- `gpt_tp2_pp2_noinfo`: the same run without it (what DeepSpeed alone writes for a pipeline model).
- `gpt_tp2_pp2_drifted`: the BLOOM-176B failure, reproduced by training: on TP rank 0 only, the
  gradients of a few TP-replicated parameters are halved for some steps, so their replicas drift apart
  in the fp32 master weights and the Adam moments, and in the bf16 weights where the difference
  survives rounding. The drift spreads to other replicated tensors through the activations, so the
  manifest records both the perturbed tensors and the drifted ones, measured on the live engine.
  The default torch RNG is also seeded per TP rank, so `torch_rng_state` differs across TP ranks.
- `gpt_tp2_pp2_dp2_drifted`: the same drift at DP=2 (8 ranks): ZeRO-1 splits every optimizer state across
  the two DP ranks, so a replica's fp32 master weight and moments lie in pieces of two files per TP rank.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.checkpoint.constants import (
    ORIGINAL_VOCAB_SIZE,
    PADDED_VOCAB_SIZE,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PIPELINE_REPLICATED_PARAMETER_PATTERNS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    VOCABULARY_PARAMETER_PATTERNS,
)
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from ckpt_tools.train.data import batch_for_step
from ckpt_tools.train.manifest import write_manifest
from ckpt_tools.train.megatron import GPTModelPipe, MegatronGPTConfig, is_tp_split
from ckpt_tools.samples.workers import _common as c

TP, PP = 2, 2
DP = 1  # the default data-parallel size; the DP=2 sample's is its variant's `dp`
MICRO_BATCHES = 2  # gradient accumulation steps: each train_batch runs the 1F1B schedule over two
MICRO_BATCH = c.MICRO_BATCH // MICRO_BATCHES

NAMING = (
    "a logical parameter is '<LL>.<local name>': LL is the two-digit pipeline layer index of the "
    "layer_LL-model_TT-model_states.pt file that holds it and the local name is the key inside that file "
    "(e.g. '02.input_layernorm.weight', '06.weight' for the final layer norm). DeepSpeed's own "
    "param_shapes / param_slice_mappings / universal_checkpoint_info patterns name the same tensor "
    "'<int(LL)>.<local name>' (e.g. '2.input_layernorm.weight')"
)
HISTORY_NOTE = (
    "one entry per optimizer step (one train_batch): 'step' is the global step after the update, 'loss' "
    "is the pipeline's loss averaged over the micro-batches (the same on every rank), 'lr' is the LR of "
    "each param group used for that update; the batch for the update that ends at step s is "
    f"batch_for_step(s - 1, batch_size={c.MICRO_BATCH}, dp_rank=<the rank's DP index>), split into {MICRO_BATCHES} "
    "micro-batches of consecutive rows, and both TP ranks of a stage read the same batch"
)


@dataclass(frozen=True)
class Drift:
    """Which TP-replicated gradients TP rank 0 scales, by how much, and during which steps (1-based)."""

    params: tuple[str, ...]
    factor: float
    steps: tuple[int, ...]


@dataclass(frozen=True)
class PipelineVariant:
    universal_info: bool = True
    drift: Drift | None = None
    dp: int = DP


BLOOM_DRIFT = Drift(
    # One family on both pipeline stages, another in one layer only.
    params=("02.post_attention_layernorm.weight", "05.post_attention_layernorm.weight", "03.self_attention.dense.bias"),
    factor=0.5,
    # Adam is invariant to a constant gradient scale, so the steps halved are not all the steps:
    # the moments then mix halved and full gradients and the updates really differ.
    steps=(2, 3, 4),
)
VARIANTS = {
    "gpt_tp2_pp2": PipelineVariant(),
    "gpt_tp2_pp2_noinfo": PipelineVariant(universal_info=False),
    "gpt_tp2_pp2_drifted": PipelineVariant(drift=BLOOM_DRIFT),
    "gpt_tp2_pp2_dp2_drifted": PipelineVariant(drift=BLOOM_DRIFT, dp=2),
}


def logical_name(module_name: str) -> str:
    """`PipelineModule` parameter name ('2.input_layernorm.weight') -> the manifest's '02.input_layernorm.weight'."""
    layer, _, local = module_name.partition(".")
    return f"{int(layer):02d}.{local}"


def ds_config(dp: int = DP) -> dict[str, Any]:
    """bf16 with ZeRO stage 1 (the only ZeRO stage the pipeline engine supports), torch AdamW (DeepSpeed's
    FusedAdam needs CUDA) and DeepSpeed's WarmupLR, whose state is just `last_batch_iteration`."""
    return {
        "train_batch_size": c.MICRO_BATCH * dp,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": MICRO_BATCHES,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": c.PEAK_LR,
                "betas": list(c.BETAS),
                "eps": 1e-8,
                "weight_decay": c.WEIGHT_DECAY,
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": c.PEAK_LR,
                "warmup_num_steps": c.WARMUP_STEPS,
                "warmup_type": "linear",
            },
        },
    }


def universal_checkpoint_info(cfg: MegatronGPTConfig) -> dict[str, Any]:
    """What Megatron-DeepSpeed's `UniversalCheckpointInfo` gives a pipeline model with untied embeddings,
    TP > 1, layer norms, linear biases, learned position embeddings and no SwiGLU.

    The patterns are `re.match`ed against DeepSpeed's parameter names ('2.input_layernorm.weight').
    Megatron lists the position embedding as 'tied_modules.embed.position_embeddings.weight' even when
    the embeddings are untied, which matches nothing here (a strict `ds_to_universal` rejects unused
    patterns, and the tensor would be concatenated instead of deduplicated); this model's name is used.
    """
    return {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        ORIGINAL_VOCAB_SIZE: cfg.vocab_size,
        PADDED_VOCAB_SIZE: cfg.vocab_size,
        VOCABULARY_PARAMETER_PATTERNS: [r"\d+.word_embeddings.weight", r"\d+.lm_head.weight"],
        # Untied: no tensor lives on more than one pipeline stage.
        PIPELINE_REPLICATED_PARAMETER_PATTERNS: [],
        TP_REPLICATED_PARAMETER_PATTERNS: [
            r"\d+.input_layernorm.weight",
            r"\d+.post_attention_layernorm.weight",
            r"\d+.weight",
            r"\d+.bias",
            r"\d+.position_embeddings.weight",
            r"\d+.self_attention.dense.bias",
            r"\d+.mlp.dense_4h_to_h.bias",
            r"\d+.input_layernorm.bias",
            r"\d+.post_attention_layernorm.bias",
        ],
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight"],
        PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [],
    }


def megatron_args(cfg: MegatronGPTConfig, dp: int = DP) -> argparse.Namespace:
    """The subset of Megatron's `args` that checkpoint readers and converters look at."""
    return argparse.Namespace(
        tensor_model_parallel_size=TP,
        pipeline_model_parallel_size=PP,
        data_parallel_size=dp,
        world_size=TP * PP * dp,
        num_layers=cfg.n_layers,
        hidden_size=cfg.hidden,
        ffn_hidden_size=cfg.ffn_hidden,
        num_attention_heads=cfg.n_heads,
        seq_length=cfg.seq_len,
        max_position_embeddings=cfg.seq_len,
        padded_vocab_size=cfg.vocab_size,
        micro_batch_size=MICRO_BATCH,
        global_batch_size=c.MICRO_BATCH * dp,
        train_iters=c.TOTAL_STEPS,
        lr=c.PEAK_LR,
        lr_warmup_iters=c.WARMUP_STEPS,
        weight_decay=c.WEIGHT_DECAY,
        adam_beta1=c.BETAS[0],
        adam_beta2=c.BETAS[1],
        clip_grad=1.0,
        seed=c.SEED,
        bf16=True,
        fp16=False,
        deepspeed=True,
        zero_stage=1,
        normalization="layernorm",
        layernorm_epsilon=cfg.layernorm_eps,
        untie_embeddings_and_output_weights=True,
        add_position_embedding=True,
        add_bias_linear=True,
        swiglu=False,
        position_embedding_type="learned_absolute",
    )


class ReplicaGradPerturbation:
    """Scales the gradient of some parameters while `active`, through tensor hooks.

    A hook on the bf16 parameter runs before the gradient is accumulated into `.grad`, so whatever
    DeepSpeed does next (micro-batch accumulation, ZeRO-1 partitioning, clipping, the fp32 master
    update) sees the perturbed gradient, exactly like a rank whose own gradient was wrong.
    """

    def __init__(self, factor: float):
        self.factor = factor
        self.active = False

    def attach(self, params: list[torch.nn.Parameter]) -> None:
        for p in params:
            p.register_hook(self._hook)

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor if self.active else grad


def master_and_moments(optimizer: Any, param: torch.nn.Parameter) -> tuple[int, dict[str, torch.Tensor]] | None:
    """(offset into the flattened parameter, {fp32, exp_avg, exp_avg_sq}) of the piece of `param` that this
    rank's ZeRO-1 partition holds, as flat views; None when this DP rank holds none of it. With DP=1 the
    piece is the whole tensor.

    Read through the parameter's fragment address (what `param_slice_mappings` records) rather than
    `deepspeed.utils.safe_get_full_optimizer_state`: in DeepSpeed 0.19.8 that fails for every parameter
    outside the first param group, because ZeRO links the optimizer-state views right after stepping the
    first group, before the other groups have any Adam state.
    """
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    address = mapping.hp_fragment_address
    flat = optimizer.single_partition_of_fp32_groups[mapping.param_group_index]
    state = optimizer.optimizer.state[flat]
    return mapping.lp_fragment_address.start, {
        key: t.narrow(0, address.start, address.numel)
        for key, t in (("fp32", flat), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]))
    }


def gather_whole(
    local: dict[str, tuple[int, dict[str, torch.Tensor]]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's pieces (`local`: name -> (offset into the flattened parameter, flat {fp32, exp_avg,
    exp_avg_sq}), e.g. from `master_and_moments`; `shapes`: this rank's names -> shapes) all-gathered and put at
    their offsets: each name's whole tensors, in name order. A collective; every element must be covered once."""
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (local, shapes))
    every = {n: s for _, sh in parts for n, s in sh.items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape in sorted(every.items()):
        n = math.prod(shape)
        whole = {k: torch.full((n,), float("nan")) for k in ("fp32", "exp_avg", "exp_avg_sq")}
        covered = 0
        for rank_parts, _ in parts:
            if name in rank_parts:
                offset, views = rank_parts[name]
                for k, v in views.items():
                    whole[k][offset : offset + v.numel()] = v
                covered += views["fp32"].numel()
        if covered != n:
            raise RuntimeError(f"{name}: the ZeRO pieces cover {covered} of {n} elements")
        out[name] = {k: v.reshape(shape) for k, v in whole.items()}
    return out


def replica_drift(engine: Any, tp_rank: int, dp_rank: int = 0) -> dict[str, dict[str, float]]:
    """For every TP-replicated parameter whose replicas differ, the largest |TP rank 0 - TP rank 1| of its
    bf16 weight, fp32 master weight and Adam moments, read from the live engine (empty when all agree).
    At DP > 1 each DP rank compares the pieces its partition holds (the flat layout is the same on both
    TP ranks of a stage, so they hold the same pieces) and the maximum over DP ranks is reported.

    Measured rather than predicted because drift spreads: once a perturbed replica differs, the TP ranks'
    activations differ, and so do the gradients of replicated parameters that were never perturbed.
    """
    local = {}
    for name, p in engine.module.named_parameters():
        if not is_tp_split(p):
            states = {"bf16": (0, p.detach().float().flatten())}
            piece = master_and_moments(engine.optimizer, p)
            if piece is not None:
                offset, views = piece
                states.update({k: (offset, v.detach().clone()) for k, v in views.items()})
            local[logical_name(name)] = states
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (tp_rank, dp_rank, local))
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for t, d, states in per_rank:
        by_key.setdefault((t, d), {}).update(states)
    drift: dict[str, dict[str, float]] = {}
    for (t, d), params in by_key.items():
        if t != 0:
            continue
        other = by_key[(1, d)]
        for name, states in params.items():
            for k, (offset, v) in states.items():
                o_offset, o = other[name][k]
                if o_offset != offset or o.shape != v.shape:
                    raise RuntimeError(
                        f"{name} {k}: TP ranks hold different pieces ({offset}+{v.numel()} vs {o_offset}+{o.numel()})"
                    )
                diff = float((v - o).abs().max()) if v.numel() else 0.0
                if diff:
                    entry = drift.setdefault(name, {})
                    entry[k] = max(entry.get(k, 0.0), diff)
    return {
        name: {k: drift[name].get(k, 0.0) for k in ("bf16", "fp32", "exp_avg", "exp_avg_sq")} for name in sorted(drift)
    }


def default_rng_seed(pp_rank: int, tp_rank: int, per_tp_rank: bool) -> int:
    """Megatron seeds the default generator with `seed + 100 * pp_rank`: identical across TP ranks. The
    drifted sample adds the TP rank, so its saved `torch_rng_state` differs across TP ranks too."""
    return c.SEED + 100 * pp_rank + (tp_rank if per_tp_rank else 0)


def parameter_inventory(engine: Any, tp_rank: int, dp_rank: int = 0) -> dict[str, Any]:
    """Logical parameter names, split dims, full shapes and exact counts, gathered from the live modules of
    DP rank 0 (the other DP ranks hold copies): split tensors contribute every TP piece, replicated
    tensors count once (from TP rank 0)."""
    local = []
    for name, p in engine.module.named_parameters() if dp_rank == 0 else ():
        dim = p.partition_dim if is_tp_split(p) else None
        local.append((logical_name(name), dim, list(p.shape)))
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (tp_rank, local))

    shapes: dict[str, list[int]] = {}
    split: dict[str, dict[str, int]] = {}
    replicated: set[str] = set()
    for rank_tp, params in per_rank:
        for name, dim, shape in params:
            if dim is None:
                replicated.add(name)
                if rank_tp == 0:
                    shapes[name] = shape
            else:
                split[name] = {"dim": dim}
                full = shapes.setdefault(name, [0 if d == dim else s for d, s in enumerate(shape)])
                full[dim] += shape[dim]
    count = sum(torch.Size(s).numel() for s in shapes.values())
    return {
        "shapes": shapes,
        "split": split,
        "tp_replicated": sorted(replicated),
        "count": count,
        "tensors": len(shapes),
    }


def expected_parameter_count(cfg: MegatronGPTConfig) -> int:
    """The same model at TP=1, counted by formula: guards `parameter_inventory`'s merging."""
    h, f = cfg.hidden, cfg.ffn_hidden
    layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h)
    return cfg.vocab_size * h + cfg.seq_len * h + cfg.n_layers * layer + 2 * h + cfg.vocab_size * h


def micro_batches(step: int, cfg: MegatronGPTConfig, dp_rank: int = 0):
    """The (inputs, labels) micro-batches of one train_batch of one DP rank; both TP ranks of a stage read
    the same."""
    tokens = batch_for_step(
        step, batch_size=c.MICRO_BATCH, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, dp_rank=dp_rank
    )
    for mb in tokens.split(MICRO_BATCH):
        yield mb[:, :-1].contiguous(), mb[:, 1:].contiguous()


def main() -> None:
    args = c.parse_args()
    variant = VARIANTS[args.sample]
    deepspeed.init_distributed(dist_backend="gloo")
    dp = variant.dp
    topology = pipeline_topology(args.sample, dp)
    coord = topology.get_coord(c.rank())
    per_tp_rng = variant.drift is not None
    rng_seed = default_rng_seed(coord.pipe, coord.model, per_tp_rng)
    torch.manual_seed(rng_seed)

    cfg = MegatronGPTConfig()
    ds_cfg = ds_config(dp)
    engine, perturb = build_engine(variant, cfg, topology, coord, ds_cfg)

    def step(global_step: int) -> float:
        if perturb is not None:
            perturb.active = global_step + 1 in variant.drift.steps
        return float(engine.train_batch(data_iter=micro_batches(global_step, cfg, coord.data)))

    ckpt = args.out / args.sample
    uc_info = universal_checkpoint_info(cfg) if variant.universal_info else None
    history, saved = c.train(
        step, lambda: c.current_lrs(engine.optimizer), lambda: save_sample(engine, ckpt, cfg, dp, uc_info, coord)
    )
    inventory = parameter_inventory(engine, coord.model, coord.data)
    seeds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seeds, rng_seed)
    if inventory["count"] != expected_parameter_count(cfg):
        raise RuntimeError(
            f"merged parameter count {inventory['count']} != the TP=1 model's {expected_parameter_count(cfg)}"
        )
    if c.rank() == 0:
        write_manifest(
            ckpt,
            sample=args.sample,
            format="deepspeed_pipeline",
            world_size=c.world_size(),
            topology={"dp": dp, "tp": TP, "pp": PP, "zero_stage": 1},
            steps=c.SAVE_AFTER_STEP,
            counters=saved["counters"],
            lr=saved["lr"],
            parameters={"count": inventory["count"], "tensors": inventory["tensors"]},
            extra=manifest_extra(variant, cfg, engine, ds_cfg, history, saved, inventory, uc_info, seeds),
        )


def pipeline_topology(sample: str, dp: int) -> PipeModelDataParallelTopology:
    """TP x PP x `dp` over this run's ranks (refused when the world has another size)."""
    if c.world_size() != TP * PP * dp:
        raise SystemExit(f"{sample} needs {TP * PP * dp} ranks (TP={TP} x PP={PP} x DP={dp}), got {c.world_size()}")
    return PipeModelDataParallelTopology(num_pp=PP, num_mp=TP, num_dp=dp)


def build_engine(
    variant: PipelineVariant, cfg: MegatronGPTConfig, topology: Any, coord: Any, ds_cfg: dict[str, Any]
) -> tuple[Any, ReplicaGradPerturbation | None]:
    """This rank's stage of the pipeline model in DeepSpeed's engine, and (drifted variants) the gradient
    perturbation, attached on TP rank 0 only."""
    model = GPTModelPipe(cfg, topology, seed=c.SEED)
    perturb = ReplicaGradPerturbation(variant.drift.factor) if variant.drift else None
    if variant.drift and coord.model == 0:
        perturb.attach([p for n, p in model.named_parameters() if logical_name(n) in variant.drift.params])
    # DeepSpeed may fill in defaults in the dict it is given; the manifest keeps what we asked for.
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=c.param_groups(model), config=copy.deepcopy(ds_cfg)
    )
    return engine, perturb


def save_sample(
    engine: Any, ckpt: Any, cfg: MegatronGPTConfig, dp: int, uc_info: dict[str, Any] | None, coord: Any
) -> dict[str, Any]:
    """`PipelineEngine.save_checkpoint` with Megatron-DeepSpeed's client state; the live snapshot and the replicas'
    drift at save time."""
    client_state: dict[str, Any] = {
        "args": megatron_args(cfg, dp),
        "checkpoint_version": 3.0,
        "iteration": engine.global_steps,
        "tokens": engine.global_steps * c.MICRO_BATCH * cfg.seq_len,
        "torch_rng_state": torch.get_rng_state(),
    }
    if uc_info is not None:
        client_state[UNIVERSAL_CHECKPOINT_INFO] = uc_info
    engine.save_checkpoint(str(ckpt), client_state=client_state)
    c.drop_deepspeed_scripts(ckpt)
    return {
        **c.snapshot(
            global_step=engine.global_steps,
            optimizer=engine.optimizer,
            scheduler=engine.lr_scheduler,
            skipped_steps=engine.skipped_steps,
        ),
        "drift": replica_drift(engine, coord.model, coord.data),
    }


def manifest_extra(
    variant: PipelineVariant,
    cfg: MegatronGPTConfig,
    engine: Any,
    ds_cfg: dict[str, Any],
    history: list[dict[str, Any]],
    saved: dict[str, Any],
    inventory: dict[str, Any],
    uc_info: dict[str, Any] | None,
    seeds: list[Any],
) -> dict[str, Any]:
    """The manifest's `extra`: the recipe, the history, the pipeline's layers and ranks, the parameters' shapes and
    TP roles, and for the drifted variants what was perturbed and what drifted."""
    dp = variant.dp
    per_tp_rng = variant.drift is not None
    return {
        "model_config": cfg.to_dict(),
        "micro_batch_per_rank": MICRO_BATCH,
        "micro_batches_per_step": MICRO_BATCHES,
        "total_steps_trained": c.TOTAL_STEPS,
        "saved_after_step": c.SAVE_AFTER_STEP,
        "history": history,
        "history_note": HISTORY_NOTE,
        "ds_config": ds_cfg,
        "dtype": "bfloat16",
        "tag": f"global_step{c.SAVE_AFTER_STEP}",
        "scheduler": "DeepSpeed WarmupLR from the config",
        "optimizer": type(c.innermost_optimizer(engine.optimizer)).__name__,
        "param_groups": "0: tensors with dim >= 2 (weight decay), 1: biases and norms (no decay)",
        "naming": NAMING,
        "pipeline_layers": {
            "00": "function: tokens -> (tokens, position ids); no parameters, no file",
            "01": "EmbeddingPipe: word_embeddings.weight (vocab-split), position_embeddings.weight",
            **{f"{2 + i:02d}": f"ParallelTransformerLayerPipe, transformer layer {i}" for i in range(cfg.n_layers)},
            f"{2 + cfg.n_layers:02d}": "final LayerNorm: weight, bias",
            f"{3 + cfg.n_layers:02d}": "LMHeadPipe: lm_head.weight (vocab-split)",
        },
        "stage_layers": {str(s): list(range(engine.module.parts[s], engine.module.parts[s + 1])) for s in range(PP)},
        "rank_coords": (
            f"global rank = (pp_stage * {dp} + dp_rank) * {TP} + tp_rank; mp_rank_MM: "
            f"MM = pp_stage * {TP} + tp_rank; zero_pp_rank_D: D = dp_rank"
        ),
        "parameter_shapes": inventory["shapes"],
        "tp_replicated": inventory["tp_replicated"],
        "split": inventory["split"],
        "universal_checkpoint_info": uc_info,
        "torch_rng_seed_per_rank": seeds,
        "torch_rng_state_differs_across_tp": per_tp_rng,
        # what `ckpt inspect` must warn about in this sample (seeded per TP rank on purpose)
        "expected_warnings": ["tp-rng-mismatch"] if per_tp_rng else [],
        "perturbed": sorted(variant.drift.params) if variant.drift else [],
        "drifted": saved["drift"],
        "drifted_note": "TP-replicated tensors whose two TP replicas differ in the saved state, with "
        "max |tp0 - tp1| per state ('bf16' = the layer files' weights, 'fp32' = the "
        "master weights, 'exp_avg', 'exp_avg_sq'), measured on the live engine at "
        "save time; a superset of 'perturbed' because drifted replicas make the TP "
        "ranks' activations, and so other replicated gradients, differ",
        "perturbation": None
        if variant.drift is None
        else {
            "tp_rank": 0,
            "grad_factor": variant.drift.factor,
            "steps": list(variant.drift.steps),
            "how": "tensor hooks on TP rank 0's bf16 parameters scale their gradients before "
            "accumulation, so clipping, ZeRO-1 and AdamW all see the scaled gradient",
        },
    }


if __name__ == "__main__":
    main()
    c.shutdown()
