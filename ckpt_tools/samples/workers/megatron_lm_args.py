"""The Megatron-LM samples' command lines (`megatron_lm`'s recipe): the variants, the model, the flags a run passes
to pretrain_gpt.py (`megatron_argv`), and the command line that rebuilds a run from a checkpoint's own saved `args`
(`relaunch_argv`, `parallel_argv`; `ckpt resume` and `--forward` use them). No Megatron import at module level:
`relaunch_argv` reads Megatron's own parser once `megatron_lm.import_megatron` has put the checkout on the path."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ITERATIONS = 10
MICRO_BATCH = 2
GLOBAL_BATCH = 4
MAX_LR = 3e-3
MIN_LR = 3e-4
WARMUP_ITERS = 3
DECAY_ITERS = 20
WEIGHT_DECAY = 0.01
SEED = 1234


@dataclass(frozen=True)
class Variant:
    tp: int
    ckpt_format: str  # "torch" (legacy per-rank files) or "torch_dist"
    distributed_optimizer: bool = False
    pp: int = 1
    vpp: int = 0  # virtual pipeline chunks per stage (0: none); the model then has pp * vpp layers, hidden 32
    llama: bool = False  # the Llama-style GPT: RoPE, RMSNorm, SwiGLU, untied output, 2 query groups, no biases
    ep: int = 0  # a Mixture-of-Experts GPT (`MOE_FLAGS`) at this expert-parallel size (0: a dense GPT)
    shared_expert: bool = False  # MoE with a gated shared expert and softmax before top-k (`MOE_SHARED_FLAGS`)


VARIANTS = {
    "megatron_tp2_legacy": Variant(tp=2, ckpt_format="torch"),
    "megatron_tp2_torch_dist": Variant(tp=2, ckpt_format="torch_dist"),
    "megatron_dp2_distopt_legacy": Variant(tp=1, ckpt_format="torch", distributed_optimizer=True),
    "megatron_dp2_distopt_torch_dist": Variant(tp=1, ckpt_format="torch_dist", distributed_optimizer=True),
    "megatron_pp2_legacy": Variant(tp=1, ckpt_format="torch", pp=2),
    "megatron_pp2_torch_dist": Variant(tp=1, ckpt_format="torch_dist", pp=2),
    "megatron_pp2_vpp2_legacy": Variant(tp=1, ckpt_format="torch", pp=2, vpp=2),
    "megatron_pp2_vpp2_torch_dist": Variant(tp=1, ckpt_format="torch_dist", pp=2, vpp=2),
    "megatron_tp2_llama_legacy": Variant(tp=2, ckpt_format="torch", llama=True),
    "megatron_tp2_llama_torch_dist": Variant(tp=2, ckpt_format="torch_dist", llama=True),
    # not bundled (sample_ckpts/ is at its size budget): made by tests/test_convert_to_megatron.py when
    # MEGATRON_LM_DIR is set, on 4 processes (TP 2 x DP 2)
    "megatron_tp2_dp2_distopt_legacy": Variant(tp=2, ckpt_format="torch", distributed_optimizer=True),
    "megatron_tp2_dp2_distopt_torch_dist": Variant(tp=2, ckpt_format="torch_dist", distributed_optimizer=True),
    # not bundled: the distributed optimizer with pipeline stages (PP 2 x DP 2, 4 processes)
    "megatron_pp2_dp2_distopt_legacy": Variant(tp=1, ckpt_format="torch", distributed_optimizer=True, pp=2),
    "megatron_pp2_dp2_distopt_torch_dist": Variant(tp=1, ckpt_format="torch_dist", distributed_optimizer=True, pp=2),
    # Megatron-core MoE (4 experts, top-2, SequentialMLP) at EP 2 over the 2 data-parallel ranks, plain Adam
    "megatron_moe_ep2_torch_dist": Variant(tp=1, ckpt_format="torch_dist", ep=2),
    # the same run saved in the legacy format: one folder per EP rank, `mp_rank_00_000` and `mp_rank_00_001`
    "megatron_moe_ep2_legacy": Variant(tp=1, ckpt_format="torch", ep=2),
    # the same run with Megatron's distributed optimizer (a ChainedOptimizer of two DistributedOptimizers)
    "megatron_moe_ep2_distopt_torch_dist": Variant(tp=1, ckpt_format="torch_dist", distributed_optimizer=True, ep=2),
    "megatron_moe_ep2_distopt_legacy": Variant(tp=1, ckpt_format="torch", distributed_optimizer=True, ep=2),
    # not bundled (made by tests/test_megatron_moe.py): MoE at TP 2 x EP 1 (expert TP 2: each TP rank holds half of
    # every expert; router and norms replicated), `MOE_TP_FLAGS`
    "megatron_moe_tp2_legacy": Variant(tp=2, ckpt_format="torch", ep=1),
    "megatron_moe_tp2_torch_dist": Variant(tp=2, ckpt_format="torch_dist", ep=1),
    # not bundled (made by tests/test_megatron_moe.py): the Llama-style GPT (`LLAMA_FLAGS`) with MoE at EP 2, the
    # shape of Mixtral (RMSNorm, RoPE, SwiGLU experts, no biases, top-2 softmax routing) for `export --hf`
    "megatron_moe_mixtral_ep2_torch_dist": Variant(tp=1, ckpt_format="torch_dist", llama=True, ep=2),
    "megatron_moe_mixtral_ep2_legacy": Variant(tp=1, ckpt_format="torch", llama=True, ep=2),
    # Mixtral-shaped at TP 2 x EP 1 (expert TP 2: each TP rank holds its slice of every expert's gate and up)
    "megatron_moe_mixtral_tp2_legacy": Variant(tp=2, ckpt_format="torch", llama=True, ep=1),
    # the same with a gated shared expert and softmax before top-k (`MOE_SHARED_FLAGS`): the shape of Qwen2-MoE
    "megatron_moe_qwen_ep2_torch_dist": Variant(tp=1, ckpt_format="torch_dist", llama=True, ep=2, shared_expert=True),
}
#: the Llama-style variant's architecture flags (what a Llama run passes to pretrain_gpt.py)
LLAMA_FLAGS = [
    "--position-embedding-type",
    "rope",
    "--rotary-base",
    "500000",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--untie-embeddings-and-output-weights",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--disable-bias-linear",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
]

#: the MoE variants' flags: 4 experts with top-2 routing (SequentialMLP: the local spec without grouped GEMM), the
#: allgather dispatcher (the alltoall one synchronizes a CUDA event, which the CPU run has not got)
MOE_FLAGS = [
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--moe-ffn-hidden-size",
    "64",
    "--moe-token-dispatcher-type",
    "allgather",
]

#: the shared-expert variant's flags: a shared expert (FFN 32) beside the routed ones, its output scaled by a
#: sigmoid gate, and the router's softmax over all experts before top-k (probabilities not renormalised)
MOE_SHARED_FLAGS = [
    "--moe-shared-expert-intermediate-size",
    "32",
    "--moe-shared-expert-gate",
    "--moe-router-pre-softmax",
]

#: MoE at TP > 1: Megatron requires sequence parallelism there, and with it expert biases only at expert TP 1
MOE_TP_FLAGS = ["--sequence-parallel", "--disable-bias-linear"]

# vocab_size is the model's (padded) vocabulary: Megatron's NullTokenizer adds an EOD token to --vocab-size.
MODEL = {
    "num_layers": 2,
    "hidden_size": 64,
    "ffn_hidden_size": 128,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "seq_length": 16,
}


def model_config(v: Variant) -> dict[str, int]:
    """The recipe's model for variant `v`: the interleaved schedule needs a layer per model chunk, so a virtual
    pipeline gets pp * vpp layers, kept small (hidden 32, FFN 64); the Llama-style variant is as small."""
    if v.vpp:
        return {**MODEL, "num_layers": v.pp * v.vpp, "hidden_size": 32, "ffn_hidden_size": 64}
    if v.llama or v.ep:  # hidden 32 (4 heads of 8; Llama: 2 query groups), FFN 64: small samples
        return {**MODEL, "hidden_size": 32, "ffn_hidden_size": 64}
    return dict(MODEL)


def megatron_argv(v: Variant, *, save: Path | None, load: Path | None, work: Path) -> list[str]:
    """Megatron's command line for variant `v` (what a user passes to pretrain_gpt.py): the model, the training
    recipe, the run's plumbing, then the variant's own flags and where it saves / loads."""
    argv = [*_model_argv(v), *_training_argv(), *_run_argv(v, work)]
    argv += _variant_flags(v)
    if save is not None:
        argv += ["--save", str(save), "--save-interval", str(ITERATIONS)]
    if load is not None:
        argv += ["--load", str(load), "--exit-on-missing-checkpoint"]
    return argv


def _model_argv(v: Variant) -> list[str]:
    """The model (`model_config(v)`), its parallel sizes and the local implementation: no fusions, no dropout."""
    m = model_config(v)
    argv = [
        "--tensor-model-parallel-size",
        str(v.tp),
        "--pipeline-model-parallel-size",
        str(v.pp),
        "--num-layers",
        str(m["num_layers"]),
        "--hidden-size",
        str(m["hidden_size"]),
        "--ffn-hidden-size",
        str(m["ffn_hidden_size"]),
        "--num-attention-heads",
        str(m["num_attention_heads"]),
        "--seq-length",
        str(m["seq_length"]),
        "--max-position-embeddings",
        str(m["seq_length"]),
        "--vocab-size",
        str(m["vocab_size"] - 1),
        "--make-vocab-size-divisible-by",
        "64",
        "--tokenizer-type",
        "NullTokenizer",
        "--mock-data",
        "--transformer-impl",
        "local",
        "--normalization",
        "LayerNorm",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion",
        "--no-persist-layer-norm",
    ]
    if v.llama:  # its own normalization (RMSNorm, `LLAMA_FLAGS`)
        argv[argv.index("--normalization") : argv.index("--normalization") + 2] = []
    return argv


def _training_argv() -> list[str]:
    """The recipe: batches, iterations, bf16, Adam, the LR schedule, weight decay, clipping, the seed."""
    return [
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--train-iters",
        str(ITERATIONS),
        "--bf16",
        "--optimizer",
        "adam",
        "--adam-beta1",
        "0.9",
        "--adam-beta2",
        "0.95",
        "--adam-eps",
        "1e-8",
        "--lr",
        str(MAX_LR),
        "--min-lr",
        str(MIN_LR),
        "--lr-warmup-iters",
        str(WARMUP_ITERS),
        "--lr-decay-style",
        "cosine",
        "--lr-decay-iters",
        str(DECAY_ITERS),
        "--weight-decay",
        str(WEIGHT_DECAY),
        "--clip-grad",
        "1.0",
        "--seed",
        str(SEED),
    ]


def _run_argv(v: Variant, work: Path) -> list[str]:
    """The run's plumbing: gloo, no evaluation, a log line per iteration, the checkpoint format, the data cache."""
    return [
        "--distributed-backend",
        "gloo",
        "--eval-iters",
        "0",
        "--eval-interval",
        str(10 * ITERATIONS),
        "--log-interval",
        "1",
        "--ckpt-format",
        v.ckpt_format,
        "--data-cache-path",
        str(work / "data_cache"),
    ]


def _variant_flags(v: Variant) -> list[str]:
    """The variant's own flags after the common ones."""
    extra: list[str] = []
    if v.distributed_optimizer:
        extra.append("--use-distributed-optimizer")
    if v.llama:
        extra += LLAMA_FLAGS
    if v.vpp:
        extra += ["--num-layers-per-virtual-pipeline-stage", "1"]
    if v.ep:
        extra += [*MOE_FLAGS, "--expert-model-parallel-size", str(v.ep)]
        if v.tp > 1:
            extra += MOE_TP_FLAGS
        if v.shared_expert:
            extra += MOE_SHARED_FLAGS
    return extra


#: saved args never passed back: where this run reads and writes, how long it runs, how it logs, and what this
#: process sets itself (the resume's own --load, --train-iters, backend, data cache)
RELAUNCH_SKIP = frozenset(
    (
        "load",
        "save",
        "save_interval",
        "train_iters",
        "train_samples",
        "exit_interval",
        "exit_duration_in_mins",
        "exit_signal_handler",
        "local_rank",
        "distributed_backend",
        "data_cache_path",
        "use_checkpoint_args",
        "use_mp_args_from_checkpoint_args",
        "tensorboard_dir",
        "wandb_project",
        "wandb_exp_name",
        "wandb_save_dir",
        "finetune",
        "no_load_optim",
        "no_load_rng",
        "pretrained_checkpoint",
        "non_persistent_save_interval",
        "non_persistent_ckpt_dir",
        "ckpt_convert_format",
        "ckpt_convert_save",
        "yaml_cfg",
        "exit_on_missing_checkpoint",
        "auto_detect_ckpt_format",
        "async_save",
        "eval_interval",
        "eval_iters",
        "log_interval",
        "one_logger_project",
        "one_logger_run_name",
        "structured_logs_dir",
        "config_logger_dir",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank",
        "virtual_pipeline_model_parallel_size",
        # Megatron derives these from the sizes and the vocabulary (validate_args): passing the saved values back
        # would pin the run to the saved world
        "expert_tensor_parallel_size",
        "inprocess_active_world_size",
        "padded_vocab_size",
        "encoder_num_layers",
        "encoder_seq_length",
        "transformer_pipeline_model_parallel_size",
    )
)
#: derived only in some runs: passed back unless validate_args sets them from other options itself
DERIVED_IF = {
    "start_weight_decay": lambda a: a.get("weight_decay_incr_style") == "constant",
    "end_weight_decay": lambda a: a.get("weight_decay_incr_style") == "constant",
}
#: CPU run-time flags (no TransformerEngine, Apex or fused CUDA kernels on a CPU): the same maths, eager PyTorch
CPU_FLAGS = [
    "--transformer-impl",
    "local",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-bias-swiglu-fusion",
    "--no-rope-fusion",
]


def relaunch_argv(saved: dict[str, Any]) -> list[str]:
    """A Megatron command line that rebuilds the run a checkpoint's `args` describe: each option of Megatron's own
    parser (`add_megatron_arguments`) whose saved value differs from the option's default, written back as that
    option (a flag where it is one); `RELAUNCH_SKIP` and values Megatron derives itself (not options) left out.
    The parallel sizes come back separately (`parallel_argv`)."""
    # lazy: Megatron's training code is on the path only after megatron_lm.import_megatron
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    argv: list[str] = []
    seen: set[str] = set()
    for action in parser._actions:
        dest = action.dest
        if dest in RELAUNCH_SKIP or dest in seen or dest not in saved or not action.option_strings:
            continue
        if dest in DERIVED_IF and DERIVED_IF[dest](saved):
            continue
        value, default = saved[dest], action.default
        option = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse._StoreTrueAction):
            if value is True and default is not True:
                argv.append(option)
                seen.add(dest)
            continue
        if isinstance(action, argparse._StoreFalseAction):
            if value is False and default is not False:
                argv.append(option)
                seen.add(dest)
            continue
        if not isinstance(action, argparse._StoreAction) or value is None or value == default:
            continue
        if isinstance(value, dict) or (
            action.choices is not None and not isinstance(value, (list, tuple)) and value not in action.choices
        ):
            continue  # an enum or a structure Megatron built from the option: not passed back
        seen.add(dest)
        argv.append(option)
        argv += [str(x) for x in value] if isinstance(value, (list, tuple)) else [str(value)]
    return argv


def parallel_argv(saved: dict[str, Any], tp: int | None = None, pp: int | None = None) -> list[str]:
    """The saved (or the given) tensor / pipeline sizes, and the saved virtual pipeline."""
    argv = [
        "--tensor-model-parallel-size",
        str(tp or saved.get("tensor_model_parallel_size") or 1),
        "--pipeline-model-parallel-size",
        str(pp or saved.get("pipeline_model_parallel_size") or 1),
    ]
    if saved.get("num_layers_per_virtual_pipeline_stage"):
        argv += ["--num-layers-per-virtual-pipeline-stage", str(saved["num_layers_per_virtual_pipeline_stage"])]
    return argv
