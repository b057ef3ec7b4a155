"""Megatron-LM samples: what Megatron-LM's own `pretrain()` writes, run on 2 CPU ranks over gloo.

Nothing here re-implements Megatron: the run is `megatron.training.pretrain` with `pretrain_gpt.py`'s dataset
provider and forward step and `gpt_builders.gpt_builder` (a Megatron-Core `GPTModel`, local layer spec: no
TransformerEngine, no Apex), Megatron's optimizer (bf16 weights, fp32 master, torch AdamW as Megatron's "adam"
when Apex/TE are absent), its `OptimizerParamScheduler` (linear warm-up + cosine decay) and its real
`megatron.training.checkpointing.save_checkpoint`. `--check` loads a sample with Megatron's own
`load_checkpoint` (through `setup_model_and_optimizer`) and prints what it restored.

Versions: Megatron-LM tag `core_v0.16.1` (commit 55ac7082517c3878ae653c07c09c534b8aed49f6), megatron-core 0.16.1
(the wheel), torch 2.13 CPU. Megatron-LM's training code is not in the wheel: the environment variable
`MEGATRON_LM_DIR` names a checkout of that tag; it is put on `sys.path` at run time. Run with e.g.

    MEGATRON_LM_DIR=/tmp/Megatron-LM python -m torch.distributed.run --nproc_per_node 2 \\
        --master_addr 127.0.0.1 --master_port 29511 -m ckpt_tools.samples.workers.megatron_lm \\
        --sample megatron_tp2_legacy --out /tmp/mlm_out/megatron_lm
    ... -m ckpt_tools.samples.workers.megatron_lm --sample megatron_tp2_legacy \\
        --check /tmp/mlm_out/megatron_lm/megatron_tp2_legacy

`--out` is the group folder (as for every worker that `ckpt_tools.samples` runs): the sample is the run's save
folder `<out>/<sample>/` (`latest_checkpointed_iteration.txt`, `iter_0000010/`) with
`<out>/<sample>.manifest.json` beside it. Megatron's dataset cache goes to a temporary folder, removed at the end;
no logs or TensorBoard files are written into the sample.

The command lines (the variants, the recipe's flags, the relaunch from saved args) are in `megatron_lm_args`.

The recipe: GPT with 2 layers, hidden 64, FFN 128, 4 heads, vocab 128 (`--vocab-size 127`: the NullTokenizer
adds an EOD token; `--make-vocab-size-divisible-by 64` keeps 128 unpadded at TP 2), sequence 16, learned
absolute positions, tied embeddings, dropout 0 (attention and hidden: with dropout on, the CPU data loader and
dropout share one generator and TP-replicated weights drift apart), mock data (`--mock-data`, NullTokenizer),
micro batch 2, global batch 4, 10 iterations, LR 3e-3 -> min 3e-4, 3 warm-up iterations, cosine decay over 20
iterations (so the LR after the save is not yet the floor), weight decay 0.01, clip 1.0, a save after the last
iteration. `megatron_tp2_llama_legacy` / `_torch_dist` are the same run with a Llama-style GPT (`LLAMA_FLAGS`: rotary
positions
with base 5e5, RMSNorm, SwiGLU, an untied output layer, grouped-query attention with 2 query groups, no linear
biases). `megatron_moe_ep2_torch_dist` is a Mixture-of-Experts GPT (hidden 32, FFN 64; `MOE_FLAGS`: 4 experts,
top-2 routing, expert FFN 64, SequentialMLP) at expert-parallel size 2 over the 2 data-parallel ranks, plain Adam:
its optimizer is Megatron's ChainedOptimizer (dense, expert: 4 param groups), made with this same maker and
checked with `--check` (Megatron's own load restores the 4 groups' LRs and the Adam step). `megatron_moe_ep2_legacy`
is the same run saved in the legacy format (one folder per EP rank, `mp_rank_00_000`, `mp_rank_00_001`);
`megatron_moe_ep2_distopt_torch_dist` / `_legacy` the same run with `--use-distributed-optimizer` (a ChainedOptimizer
of two DistributedOptimizers; Megatron-core 0.16.1 cannot load those on CPU without Apex / TransformerEngine,
KeyError 'step', so `--check` runs the plain-Adam ones). `megatron_moe_mixtral_ep2_*` /
`megatron_moe_qwen_ep2_torch_dist` (made by the tests) are the Llama-style GPT with MoE at EP 2 (and
`megatron_moe_mixtral_tp2_legacy` at TP 2 x EP 1, `MOE_TP_FLAGS`), the Qwen one with a
gated shared expert and softmax before top-k (`MOE_SHARED_FLAGS`): the shapes of Mixtral and Qwen2-MoE. `--forward`
runs Megatron's own forward of a saved TP sample (`logits_sample`); `--out` with `--tokens` / `--logits` runs it on
the model just saved, in the same launch (`_saved_model_logits`). The manifest's `history` holds each `train_step`'s own
loss (Megatron's log line for iteration 2
averages iterations 1 and 2).

Run-time changes, all in this process (nothing installed is edited; see `install_cpu_shims`):
  1. `torch.cuda` redirected to the CPU: `is_available()` True and `device_count()` 1 only while
     `initialize_megatron` runs (its CUDA assert, model-parallel setup and CUDA RNG tracker need them; later, True
     would make the data loader pin memory); `current_device()` 0; `set_device`, `synchronize`, `empty_cache`,
     `set_stream` no-ops; `Stream`, `Event`, `current_stream()`, `stream()` stand-ins; `get_device_capability()`
     (9, 0), `get_device_name()`, `get_device_properties()`; memory statistics all 0.
  2. CUDA RNG state = the CPU generator: `torch.cuda.{get,set}_rng_state`, `torch.cuda.random.get_rng_state`,
     `manual_seed`, `manual_seed_all`, `default_generators` (and `torch.cuda._lazy_call` runs at once, as
     Megatron's tensor_parallel.random imports it). So Megatron's RNG tracker logs "CPU RNG state changed within
     GPU RNG context" at each fork: expected here (one generator); the saved `rng_state` holds CPU states.
  3. A `TorchFunctionMode` for the whole run: `device='cuda'` / `device=<int>` / `torch.device('cuda', i)` arguments
     of tensor factories and `Tensor.to` become the CPU; `Tensor.cuda()` returns the tensor;
     `Tensor.type()` (no argument) answers `torch.cuda.<X>Tensor` (Megatron's mixed-precision optimizer selects
     parameters by those names); `torch.nn.Module.cuda` returns the module unchanged.
  4. `megatron.core.datasets.utils.compile_helpers` is a no-op: the wheel ships the compiled `helpers_cpp` but not
     the Makefile that `make -C` needs.
  5. `megatron.legacy.fused_kernels.load` is a no-op: it only runs `$CUDA_HOME/bin/nvcc -V` (no CUDA_HOME
     here) and makes a build folder; it compiles nothing for this run.
  6. A stand-in `triton` module exists only while Megatron's training code is imported: megatron-core imports
     triton unconditionally for CUDA kernels this run never calls; it is removed again right after.
  7. `CUDA_DEVICE_MAX_CONNECTIONS=1` is set in the environment (Megatron asserts it for TP; users export it).
  8. Megatron's `jit_fuser` (torch.compile, bound when megatron.core is first imported) is the identity: inductor
     on CPU fails under the CUDA redirection (it asks the device properties for `gcnArchName`); the fused
     functions (bias-GeLU etc.) run as plain eager PyTorch, the same maths.
  9. The process group is created here (gloo) before Megatron's `initialize_megatron`, which then uses it; Megatron
     gets `--distributed-backend gloo`.
 10. Mixture-of-Experts variants (`megatron_moe_ep2_*`): `megatron.core.transformer.moe.moe_utils.
     te_general_gemm` is set to None where megatron-core 0.16.1 leaves it undefined without Transformer Engine
     (the router's linear asks for it and then uses torch's matmul); the command line picks the `allgather`
     token dispatcher (`MOE_FLAGS`: the `alltoall` one synchronizes a CUDA event). Nothing else differs from the
     dense recipe: `pretrain()` builds the ChainedOptimizer (dense, expert) and saves it as Megatron does.
 11. MoE at TP > 1 (`megatron_moe_tp2_*`, made by the tests): Megatron requires `--sequence-parallel` there (and then
     expert biases only at expert TP 1: `--disable-bias-linear`), which the local spec's torch LayerNorm
     (`WrappedTorchNorm`) refuses by an assert: it is built as without sequence parallelism and its weights marked
     `sequence_parallel`, so `finalize_model_grads` sums their gradients over TP as it does for Apex's LayerNorm on
     GPUs (`_sequence_parallel_torch_norm`; a run without the flag is unchanged).
  Recording only (no behaviour change): `megatron.training.training.save_checkpoint` and `train_step` are wrapped
  to read the live model / optimizer / scheduler at save time and each iteration's LR and loss for the manifest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import multiprocessing
import os
import shlex
import shutil
import sys
import tempfile
import types
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ckpt_tools.train import manifest as train_manifest
from ckpt_tools.train.procgroup import join, leave
from ckpt_tools.view.logical import node_to_display, open_any
from ckpt_tools.samples.workers.megatron_lm_args import (
    CPU_FLAGS,
    GLOBAL_BATCH,
    ITERATIONS,
    MICRO_BATCH,
    MODEL,
    VARIANTS,
    Variant,
    megatron_argv,
    model_config,
    parallel_argv,
    relaunch_argv,
)

MEGATRON_LM_TAG = "core_v0.16.1"
MEGATRON_LM_COMMIT = "55ac7082517c3878ae653c07c09c534b8aed49f6"


#: what this process changes at run time (the module docstring's list, in short), recorded in each manifest
RUN_TIME_CHANGES = [
    "torch.cuda redirected to the CPU (is_available/device_count 1 only during initialize_megatron; streams, "
    "events, device properties, memory statistics stand-ins)",
    "the CUDA RNG state is the CPU generator's",
    "a TorchFunctionMode: device='cuda' arguments -> CPU, Tensor.cuda() identity, Tensor.type() answers torch.cuda.* "
    "names; Module.cuda returns the module",
    "megatron.core.datasets.utils.compile_helpers a no-op (the wheel has helpers_cpp but no Makefile)",
    "megatron.legacy.fused_kernels.load a no-op (it only runs nvcc -V)",
    "a stand-in triton module while Megatron's training code is imported",
    "CUDA_DEVICE_MAX_CONNECTIONS=1",
    "megatron.core.jit's jit_fuser is the identity (fused functions run eager)",
    "the gloo process group is created before initialize_megatron (--distributed-backend gloo)",
]
MOE_RUN_TIME_CHANGES = [
    "megatron.core.transformer.moe.moe_utils.te_general_gemm = None (undefined in megatron-core 0.16.1 without "
    "Transformer Engine)",
    "--moe-token-dispatcher-type allgather (the alltoall dispatcher synchronizes a CUDA event)",
]
MOE_TP_RUN_TIME_CHANGES = [
    "megatron.core.transformer.torch_norm.WrappedTorchNorm builds torch's LayerNorm under sequence parallelism "
    "(its assert refuses it) and marks the weights sequence_parallel, so their gradients are summed over TP as "
    "Apex's LayerNorm does (MoE at TP > 1 needs --sequence-parallel)",
]


def _to_cpu_device(d: Any) -> Any:
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cpu")
    if isinstance(d, str) and d.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(d, torch.device) and d.type == "cuda":
        return torch.device("cpu")
    return d


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU; `Tensor.cuda()` is the identity; `Tensor.type()` answers CUDA
    type names (Megatron's optimizer sorts parameters by them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


class _Stream:
    def __init__(self, *a: Any, **k: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


_CUDA_PRESENT = [False]


def install_cpu_shims() -> None:
    """Point `torch.cuda` at the CPU (see the module docstring for the list); call before importing Megatron."""
    cuda = torch.cuda
    gen = torch.default_generator
    cuda.is_available = lambda: _CUDA_PRESENT[0]
    cuda.device_count = lambda: 1 if _CUDA_PRESENT[0] else 0
    cuda.current_device = lambda: 0
    for name in ("set_device", "synchronize", "empty_cache", "set_stream", "reset_peak_memory_stats", "ipc_collect"):
        setattr(cuda, name, lambda *a, **k: None)
    cuda.Stream = _Stream
    cuda.Event = _Stream
    cuda.current_stream = lambda *a, **k: _Stream()
    cuda.default_stream = lambda *a, **k: _Stream()
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.device = lambda *a, **k: contextlib.nullcontext()
    cuda.get_device_capability = lambda *a, **k: (9, 0)
    cuda.get_device_name = lambda *a, **k: "cpu (ckpt_tools shim)"
    cuda.get_device_properties = lambda *a, **k: argparse.Namespace(
        name="cpu (ckpt_tools shim)", major=9, minor=0, total_memory=1 << 34, multi_processor_count=1
    )
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.memory_stats = lambda *a, **k: {}
    cuda.mem_get_info = lambda *a, **k: (1 << 34, 1 << 34)
    # The CUDA RNG is the CPU generator.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.get_rng_state_all = lambda: [torch.get_rng_state()]
    cuda.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
    cuda.manual_seed = lambda seed: gen.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: gen.manual_seed(seed)
    cuda.random.manual_seed = cuda.manual_seed
    cuda.random.manual_seed_all = cuda.manual_seed_all
    cuda.default_generators = (gen,)
    cuda._lazy_call = lambda fn, **k: fn()
    cuda._lazy_init = lambda: None
    torch.nn.Module.cuda = lambda self, device=None: self
    _CudaToCpu().__enter__()  # for the rest of the process


def _copying_single_rank_reduce() -> None:
    """megatron-core 0.16.1's `_reduce` over a group of one returns its input as is, so the autograd Function
    `_ReduceFromModelParallelRegion` hands back a view of it; a SequentialMLP expert with a bias at EP 1 x TP 1 then
    adds its bias to that output in place (`mlp.py`: `output += output_bias ...`), which autograd forbids ("Output 0
    of _ReduceFromModelParallelRegion is a view and is being modified inplace"). At EP > 1 or TP > 1 the expert's
    row-parallel linear skips that reduce. The same values, as a copy: the numbers do not change."""
    import megatron.core.tensor_parallel.mappings as mappings  # lazy: called after import_megatron (its path)

    reduce = mappings._reduce
    if getattr(reduce, "_ckpt_copying", False):
        return

    def _reduce(input_, group):
        out = reduce(input_, group)
        return out.clone() if out is input_ and group is not None and group.size() == 1 else out

    _reduce._ckpt_copying = True
    mappings._reduce = _reduce


def _after_megatron_import() -> None:
    """Shims on names Megatron bound at import time."""
    import megatron.core.datasets.utils as dutils  # lazy: called from import_megatron, once on the path
    import megatron.core.tensor_parallel.random as trandom  # lazy: as above
    import megatron.core.transformer.moe.moe_utils as moe_utils  # lazy: as above

    dutils.compile_helpers = lambda: None

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 leaves it undefined without TE; the router asks for it
        moe_utils.te_general_gemm = None
    _copying_single_rank_reduce()
    _sequence_parallel_torch_norm()
    trandom._lazy_call = torch.cuda._lazy_call
    trandom._lazy_init = torch.cuda._lazy_init


def _sequence_parallel_torch_norm() -> None:
    """Megatron's local spec builds torch's LayerNorm (`WrappedTorchNorm`), which asserts `not sequence_parallel`;
    Apex's LayerNorm, used on GPUs, runs under it and marks its weights `sequence_parallel` so that
    `finalize_model_grads` sums their gradients over the TP group (each TP rank normed only its slice of the
    sequence). The same here: the norm is built as without sequence parallelism, its weights marked. A run without
    `--sequence-parallel` is unchanged."""
    from megatron.core.transformer import torch_norm  # lazy: called after import_megatron (its path)

    build = torch_norm.WrappedTorchNorm.__new__
    if getattr(build, "_ckpt_sequence_parallel", False):
        return

    def new(cls, config, *a: Any, **k: Any):
        if not config.sequence_parallel:
            return build(cls, config, *a, **k)
        plain = copy.copy(config)  # a shallow copy: no __post_init__ validation runs again
        plain.sequence_parallel = False
        norm = build(cls, plain, *a, **k)
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    new._ckpt_sequence_parallel = True
    torch_norm.WrappedTorchNorm.__new__ = new


class _Anything:
    """Stands for any triton object at import time: a decorator with or without arguments, an annotation."""

    def __init__(self, *a: Any, **k: Any) -> None:
        self._fn = a[0] if len(a) == 1 and callable(a[0]) and not k else None

    def __call__(self, *a: Any, **k: Any) -> Any:
        if len(a) == 1 and callable(a[0]) and not k:
            return a[0]  # used as a decorator: the kernel stays an uncalled Python function
        return _Anything(*a, **k)

    def __getattr__(self, name: str) -> Any:
        return _Anything()

    def __getitem__(self, key: Any) -> Any:
        return _Anything()


@contextlib.contextmanager
def _triton_stub():
    """A `triton` module only while Megatron's training code is imported: megatron-core imports triton
    unconditionally for kernels this CPU run never calls (batch-invariant matmul, inference KV append).
    Removed afterwards so that torch's own `find_spec("triton")` checks still see no triton."""
    if "triton" in sys.modules or __import__("importlib.util").util.find_spec("triton") is not None:
        yield
        return

    class _Module(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()

    names = ("triton", "triton.language", "triton.language.core", "triton.runtime", "triton.runtime.jit")
    for name in names:
        sys.modules[name] = _Module(name)
    sys.modules["triton"].language = sys.modules["triton.language"]
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _no_compile(fn: Any = None, **kwargs: Any) -> Any:
    return fn if fn is not None else (lambda f: f)


@contextlib.contextmanager
def _cuda_present():
    _CUDA_PRESENT[0] = True
    try:
        yield
    finally:
        _CUDA_PRESENT[0] = False


def import_megatron(cpu: bool = True) -> None:
    """Put MEGATRON_LM_DIR on sys.path and import the training code with the shims in place. With `cpu=False` (a
    run on CUDA, NCCL: `ckpt resume --device cuda`) changes 1-3 and the CUDA-present window are left out; 4, 5, 6
    (only where no triton is installed) and 8 stay: none of them is about the device (the wheel has no Makefile,
    `fused_kernels.load` compiles nothing, the fused functions run eager, the same maths as on the CPU)."""
    root = os.environ.get("MEGATRON_LM_DIR")
    if not root or not (Path(root) / "megatron" / "training" / "checkpointing.py").is_file():
        raise SystemExit(
            "set MEGATRON_LM_DIR to a Megatron-LM checkout (tag core_v0.16.1) holding "
            "megatron/training/checkpointing.py"
        )
    # `megatron` is a namespace package in both the wheel and the checkout; with the checkout last on the path,
    # megatron.core comes from the wheel and megatron.training (absent from the wheel) from the checkout.
    sys.path.append(root)
    if cpu:
        install_cpu_shims()
    compile_ = torch.compile
    torch.compile = _no_compile  # megatron.core.jit binds `jit_fuser = torch.compile` when first imported
    try:
        import megatron.core.jit  # lazy: the point of this function: MEGATRON_LM_DIR is on the path only now
    finally:
        torch.compile = compile_
    megatron.core.jit.disable_jit_fuser()
    _after_megatron_import()
    with _triton_stub():
        # lazy: these five imports and the two below: Megatron's training code, imported here with the shims in place
        import megatron.training.initialize as init
        import megatron.training.training  # noqa: F401
        import pretrain_gpt  # noqa: F401
        import gpt_builders  # noqa: F401
        import model_provider  # noqa: F401
    import megatron.legacy.fused_kernels as fused_kernels  # lazy: as above

    # It only reads `$CUDA_HOME/bin/nvcc -V` and makes a build folder: no kernel is compiled for this run.
    fused_kernels.load = lambda args: None

    if not cpu:
        return
    original = init.initialize_megatron

    def initialize_megatron(*a: Any, **k: Any):
        with _cuda_present():
            return original(*a, **k)

    init.initialize_megatron = initialize_megatron
    import megatron.training.training as training  # lazy: as above

    training.initialize_megatron = initialize_megatron


# --- what the run did, read from the live objects ---------------------------------------------------------


def _groups(optimizer: Any) -> list[dict[str, Any]]:
    return list(optimizer.param_groups)


def _adam_steps(optimizer: Any) -> list[int]:
    """Every Adam `step` value in this rank's torch optimizer state (one per parameter or flat shard)."""
    steps: set[int] = set()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        for state in inner.state.values():
            if "step" in state:
                steps.add(int(state["step"]))
    return sorted(steps)


def _scheduler_state(sched: Any) -> dict[str, Any]:
    return {
        "num_steps": int(sched.num_steps),
        "num_steps_unit": "samples (iterations x global batch size)",
        "init_lr": float(sched.init_lr),
        "max_lr": float(sched.max_lr),
        "min_lr": float(sched.min_lr),
        "lr_warmup_steps": int(sched.lr_warmup_steps),
        "lr_decay_steps": int(sched.lr_decay_steps),
        "lr_decay_style": sched.lr_decay_style,
        "start_wd": float(sched.start_wd),
        "end_wd": float(sched.end_wd),
        "wd_incr_steps": int(sched.wd_incr_steps),
        "wd_incr_style": sched.wd_incr_style,
        "use_checkpoint_opt_param_scheduler": bool(sched.use_checkpoint_opt_param_scheduler),
        "override_opt_param_scheduler": bool(sched.override_opt_param_scheduler),
    }


def _parameter_count(model: list[Any]) -> tuple[int, int]:
    """(elements, tensors) of the whole model, each parameter counted once: TP-split tensors summed over the TP
    ranks, replicated ones taken from TP rank 0, summed over pipeline stages, read on the live modules. With
    tied embeddings and PP > 1 the last stage's `output_layer.weight` is Megatron's copy of the first stage's word
    embeddings (kept equal by the embedding group's all-reduce): one parameter of the model, counted there.
    Expert parameters (Megatron marks them `allreduce=False`) are each EP rank's own experts: summed over the
    expert-parallel group (at expert TP 1), each local expert tensor counted once per EP rank."""
    from megatron.core import parallel_state as ps  # lazy: called after import_megatron (its path)

    tp_rank = ps.get_tensor_model_parallel_rank()
    count = tensors = 0
    expert_count = expert_tensors = 0
    for chunk in model:
        inner = chunk
        while hasattr(inner, "module"):  # DDP / Float16Module wrappers around the GPTModel
            inner = inner.module
        tied = getattr(inner, "share_embeddings_and_output_weights", False) and not ps.is_pipeline_first_stage()
        for name, p in chunk.named_parameters():
            if tied and name.endswith("output_layer.weight"):
                continue
            if not getattr(p, "allreduce", True):
                expert_count += p.numel()
                expert_tensors += 1
                continue
            split = getattr(p, "tensor_model_parallel", False)
            if split or tp_rank == 0:
                count += p.numel()
            if tp_rank == 0:
                tensors += 1
    t = torch.tensor([count, tensors], dtype=torch.long)
    torch.distributed.all_reduce(t, group=ps.get_model_parallel_group())
    if ps.get_expert_model_parallel_world_size() > 1 or expert_count:
        if ps.get_expert_tensor_parallel_world_size() != 1 or ps.get_pipeline_model_parallel_world_size() != 1:
            raise RuntimeError("counting expert parameters at expert TP or PP > 1 is not written")
        e = torch.tensor([expert_count, expert_tensors], dtype=torch.long)
        torch.distributed.all_reduce(e, group=ps.get_expert_model_parallel_group())
        t += e
    return int(t[0]), int(t[1])


class Recorder:
    """Wraps Megatron's `train_step` and `save_checkpoint` (as `megatron.training.training` calls them) to keep
    each iteration's LR and loss and the live state at save time. Changes nothing they do."""

    def __init__(self) -> None:
        self.history: list[dict[str, Any]] = []
        self.saved: dict[str, Any] | None = None
        self.model: list[Any] | None = None  # the live model chunks at the last save

    def install(self) -> None:
        import megatron.training.training as training  # lazy: called after import_megatron (its path)

        train_step, save_checkpoint = training.train_step, training.save_checkpoint

        def recorded_train_step(
            forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *a: Any, **k: Any
        ):
            lrs = [float(g["lr"]) for g in _groups(optimizer)]
            out = train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *a, **k)
            loss = out[0].get("lm loss") if isinstance(out[0], dict) else None
            self.history.append(
                {
                    "iteration": len(self.history) + 1,
                    "lr": lrs,
                    "loss": None if loss is None else float(loss),
                    "skipped": bool(out[1]),
                }
            )
            return out

        def recorded_save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *a: Any, **k: Any):
            result = save_checkpoint(iteration, model, optimizer, opt_param_scheduler, *a, **k)
            self.saved = self.snapshot(iteration, model, optimizer, opt_param_scheduler)
            self.model = model
            return result

        training.train_step = recorded_train_step
        training.save_checkpoint = recorded_save_checkpoint

    @staticmethod
    def snapshot(iteration: int, model: list[Any], optimizer: Any, sched: Any) -> dict[str, Any]:
        from megatron.core import parallel_state as ps  # lazy: called after import_megatron (its path)

        groups = []
        for g in _groups(optimizer):
            groups.append(
                {
                    "lr": float(g["lr"]),
                    "max_lr": float(g.get("max_lr", sched.max_lr)),
                    "min_lr": float(g.get("min_lr", sched.min_lr)),
                    "weight_decay": float(g["weight_decay"]),
                    "wd_mult": g.get("wd_mult"),
                    "lr_mult": g.get("lr_mult"),
                    "params": len(g["params"]),
                    "is_expert_parallel": bool(g.get("is_expert_parallel", False)),
                    "next_lr": float(sched.get_lr(g)),
                }
            )
        count, tensors = _parameter_count(model)
        return {
            "iteration": int(iteration),
            "rank": torch.distributed.get_rank(),
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "ep": ps.get_expert_model_parallel_world_size(),
            "param_groups": groups,
            "adam_steps": _adam_steps(optimizer),
            "scheduler": _scheduler_state(sched),
            "parameters": {"count": count, "tensors": tensors},
            "optimizer": type(optimizer).__name__,
            # a ChainedOptimizer (MoE: dense, expert) has no single `.optimizer`: each inner one's torch optimizer
            "inner_optimizer": ", ".join(
                type(o.optimizer).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])
            ),
        }


def write_manifest(
    ckpt: Path, sample: str, v: Variant, per_rank: list[dict[str, Any]], history: list[dict[str, Any]]
) -> None:
    """Rank 0: `<ckpt>.manifest.json` from every rank's snapshot at the save (`Recorder.snapshot`) and the run's
    history: the counters, the LRs, the parameter count, and the run's recipe and changes (`_manifest_extra`)."""
    s = per_rank[0]
    steps = sorted({x for r in per_rank for x in r["adam_steps"]})
    if len(steps) != 1:
        raise RuntimeError(f"expected one Adam step across ranks, got {steps}")
    sched = s["scheduler"]
    train_manifest.write_manifest(
        ckpt,
        sample=sample,
        format="megatron_legacy" if v.ckpt_format == "torch" else "megatron_torch_dist",
        world_size=len(per_rank),
        topology={
            "tp": s["tp"],
            "pp": s["pp"],
            "dp": s["dp"],
            "distributed_optimizer": v.distributed_optimizer,
            **({"ep": s["ep"]} if v.ep else {}),
        },
        steps=s["iteration"],
        counters={
            "global_step": s["iteration"],
            "iteration": s["iteration"],
            "optimizer_step": steps[0],
            "scheduler_num_steps": sched["num_steps"],
            "skipped_steps": sum(h["skipped"] for h in history),
        },
        lr={
            "param_groups": [g["lr"] for g in s["param_groups"]],
            "max_lr": [g["max_lr"] for g in s["param_groups"]],
            "min_lr": [g["min_lr"] for g in s["param_groups"]],
            "next_lr": [g["next_lr"] for g in s["param_groups"]],
            "next_lr_note": "the LR the next iteration uses: OptimizerParamScheduler.get_lr(group) at "
            "num_steps (Megatron recomputes it from num_steps and each group's max_lr/min_lr "
            "on resume; equal to the saved group 'lr')",
        },
        parameters=s["parameters"],
        extra=_manifest_extra(v, per_rank, history),
    )


def _manifest_extra(v: Variant, per_rank: list[dict[str, Any]], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `extra`: Megatron's version, what this process changed, the recipe, the param groups, the
    scheduler, each rank's Adam step, the history and the command line."""
    import megatron.core  # lazy: called after import_megatron (its path)

    s = per_rank[0]
    sched = s["scheduler"]
    return {
        "megatron_lm": {"tag": MEGATRON_LM_TAG, "commit": MEGATRON_LM_COMMIT},
        "run_time_changes": RUN_TIME_CHANGES
        + (MOE_RUN_TIME_CHANGES if v.ep else [])
        + (MOE_TP_RUN_TIME_CHANGES if v.ep and v.tp > 1 else []),
        "megatron_core": megatron.core.__version__,
        "ckpt_format": v.ckpt_format,
        "model_config": model_config(v),
        "precision": "bf16 weights, fp32 master (Megatron mixed-precision optimizer)",
        "optimizer": s["optimizer"],
        "inner_optimizer": s["inner_optimizer"],
        "micro_batch": MICRO_BATCH,
        "global_batch": GLOBAL_BATCH,
        "train_iters": ITERATIONS,
        "param_groups": [
            {
                k: g[k]
                for k in (
                    "weight_decay",
                    "wd_mult",
                    "lr_mult",
                    "params",
                    *(("is_expert_parallel",) if v.ep else ()),
                )
            }
            for g in s["param_groups"]
        ],
        "param_groups_note": "Megatron's default grouping: 0 = weights with decay, 1 = biases and norms "
        "without ('params' counts this rank-0 group's tensors)"
        + (
            "; with experts (a ChainedOptimizer: dense, expert) 2, 3 = the same for the "
            "expert parameters (is_expert_parallel)"
            if v.ep
            else ""
        ),
        "opt_param_scheduler": sched,
        "adam_step_per_rank": [r["adam_steps"] for r in per_rank],
        "ranks_agree_on_lr": all(
            [g["lr"] for g in r["param_groups"]] == [g["lr"] for g in s["param_groups"]] for r in per_rank
        ),
        "history": history,
        "history_note": "one entry per iteration: the LR of each param group used for the update, and "
        "the 'lm loss' Megatron reports (averaged over data-parallel ranks)",
        "megatron_argv": megatron_argv(v, save=Path("<save>"), load=None, work=Path("<work>")),
    }


# --- entry points -----------------------------------------------------------------------------------------


def _pretrain_entry() -> tuple[Any, ...]:
    """What `pretrain_gpt.py`'s __main__ passes to `pretrain` (imported from the checkout, not copied)."""
    import pretrain_gpt  # lazy: Megatron-LM's checkout, on the path only after import_megatron
    from gpt_builders import gpt_builder  # lazy: as above
    from megatron.core.enums import ModelType  # lazy: as above
    from model_provider import model_provider  # lazy: as above

    pretrain_gpt.train_valid_test_datasets_provider.is_distributed = True
    return (
        pretrain_gpt.train_valid_test_datasets_provider,
        partial(model_provider, gpt_builder),
        ModelType.encoder_or_decoder,
        pretrain_gpt.forward_step,
        pretrain_gpt.get_embedding_ranks,
    )


def pretrain_gpt(argv: list[str]) -> None:
    """Megatron's own `pretrain` as `pretrain_gpt.py` runs it, on the command line `argv` (Megatron's argument
    parser reads sys.argv)."""
    from megatron.training import pretrain  # lazy: called after import_megatron (its path)

    datasets, model_provider, model_type, forward_step, embedding_ranks = _pretrain_entry()
    sys.argv = [sys.argv[0], *argv]
    pretrain(
        datasets,
        model_provider,
        model_type,
        forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
        get_embedding_ranks=embedding_ranks,
    )


def _shared_tempdir(prefix: str) -> Path:
    """One temporary folder for all ranks (rank 0 makes it, the others get its name)."""
    name = [tempfile.mkdtemp(prefix=prefix) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(name, src=0)
    return Path(name[0])


def make_sample(args: argparse.Namespace, work: Path) -> int:
    """Train with Megatron's `pretrain` and save `<out>/<sample>`; rank 0 writes the manifest beside it."""
    v = VARIANTS[args.sample]
    ckpt = args.out.resolve() / args.sample
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(parents=True)
    torch.distributed.barrier()
    recorder = Recorder()
    recorder.install()
    pretrain_gpt(megatron_argv(v, save=ckpt, load=None, work=work))
    if recorder.saved is None:
        raise RuntimeError("Megatron did not save a checkpoint")
    per_rank: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(per_rank, recorder.saved)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        write_manifest(ckpt, args.sample, v, per_rank, recorder.history)
    if args.tokens is not None:
        _saved_model_logits(recorder.model, args)
    return 0


def _saved_model_logits(model: list[Any], args: argparse.Namespace) -> None:
    """`--out` with `--tokens` / `--logits`: Megatron's forward of the model it has just saved (the same launch: no
    second start for the reference logits). The GPTModel unwrapped (DDP, Float16Module) and cast to fp32: its bf16
    weights, the ones the checkpoint's model holds, as fp32 parameters, as `logits_sample` runs a loaded one."""
    from megatron.training.utils import unwrap_model  # lazy: called after import_megatron (its path)

    net = unwrap_model(model[0])
    net.float()
    _write_logits(net, args)


def _write_logits(net: Any, args: argparse.Namespace) -> None:
    """The GPTModel's forward (eval) on `--tokens` (JSON rows) with the causal mask `pretrain_gpt` uses, the
    vocab-parallel logits gathered over TP (every EP rank runs the same batch: the token dispatcher's collectives
    need all of them); rank 0 saves them (torch.save, [batch, seq, vocab], fp32) to `args.logits`."""
    from megatron.core import tensor_parallel  # lazy: called after import_megatron (its path)

    net.eval()
    tokens = torch.tensor(json.loads(args.tokens), dtype=torch.long)
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)  # True: masked
    with torch.no_grad():
        logits = net(tokens, positions, mask)
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    if torch.distributed.get_rank() == 0:
        torch.save(logits.float().clone(), args.logits)


def check_sample(args: argparse.Namespace, work: Path) -> int:
    """Load `args.check` with Megatron's own `load_checkpoint` (via `setup_model_and_optimizer`) and print the
    restored iteration and each param group's LR on each rank; compare with the manifest when there is one."""
    v = VARIANTS[args.sample]
    ckpt = args.check.resolve()
    _, model_provider, model_type, _, embedding_ranks = _pretrain_entry()
    import megatron.training.training as training  # lazy: called after import_megatron (its path)
    from megatron.training import get_args  # lazy: as above

    sys.argv = [sys.argv[0], *megatron_argv(v, save=None, load=ckpt, work=work)]
    training.initialize_megatron(
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, get_embedding_ranks=embedding_ranks
    )
    model, optimizer, sched = training.setup_model_and_optimizer(model_provider, model_type)
    iteration = get_args().iteration
    lrs = [float(g["lr"]) for g in _groups(optimizer)]
    state = Recorder.snapshot(iteration, model, optimizer, sched)
    rank = torch.distributed.get_rank()
    print(
        f"[check rank {rank}] loaded {ckpt}: iteration {iteration}, group lr {lrs}, max_lr "
        f"{[g['max_lr'] for g in state['param_groups']]}, min_lr {[g['min_lr'] for g in state['param_groups']]},"
        f" scheduler num_steps {state['scheduler']['num_steps']}, adam steps {state['adam_steps']}",
        flush=True,
    )
    manifest = ckpt.with_name(ckpt.name + ".manifest.json")
    ok = True
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        want_lr = m["lr"]["next_lr"]
        ok = (
            iteration == m["counters"]["iteration"]
            and all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(lrs, want_lr, strict=True))
            and state["scheduler"]["num_steps"] == m["counters"]["scheduler_num_steps"]
            and state["adam_steps"] == [m["counters"]["optimizer_step"]]
        )
        print(
            f"[check rank {rank}] manifest: iteration {m['counters']['iteration']}, next lr {want_lr}, "
            f"optimizer step {m['counters']['optimizer_step']} -> {'MATCH' if ok else 'MISMATCH'}",
            flush=True,
        )
    return 0 if ok else 1


def logits_sample(args: argparse.Namespace, work: Path) -> int:
    """Megatron's own forward of a saved sample: `initialize_megatron` with the variant's command line in fp32
    (`--bf16` left out: the bf16 weights the checkpoint's model holds are loaded into fp32 parameters),
    `setup_model_and_optimizer` + Megatron's `load_checkpoint` (`--no-load-optim --no-load-rng`), then the GPTModel's
    forward on `--tokens` (JSON rows) with the causal mask `pretrain_gpt` uses; the vocab-parallel logits gathered
    over the TP ranks; rank 0 saves them (torch.save, [batch, seq, vocab]) to `args.logits`. Pipeline parallelism is
    not run here (TP samples only). Without `--sample`, any run folder (a conversion's output): the command line is
    rebuilt from its own saved `args` (`relaunch_argv`, as `ckpt resume` does) at TP = the world size, PP 1."""
    _, model_provider, model_type, _, embedding_ranks = _pretrain_entry()
    import megatron.training.training as training  # lazy: called after import_megatron (its path)

    if args.sample is None:
        saved = node_to_display(open_any(args.forward).tree.children["args"])  # read inert, as `ckpt resume` reads them
        argv = [
            *relaunch_argv(saved),
            *parallel_argv(saved, torch.distributed.get_world_size(), 1),
            *CPU_FLAGS,
            "--distributed-backend",
            "gloo",
            "--load",
            str(args.forward.resolve()),
            "--train-iters",
            str(int(saved.get("iteration") or 0) + 1),
            "--data-cache-path",
            str(work / "data_cache"),
        ]
        argv = [a for a in argv if a != "--bf16"]
    else:
        v = VARIANTS[args.sample]
        if v.pp > 1:
            raise SystemExit("--logits runs the TP samples (no pipeline schedule here)")
        argv = megatron_argv(v, save=None, load=args.forward.resolve(), work=work)
        argv.remove("--bf16")
    sys.argv = [sys.argv[0], *argv, "--no-load-optim", "--no-load-rng"]
    training.initialize_megatron(
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, get_embedding_ranks=embedding_ranks
    )
    model, _, _ = training.setup_model_and_optimizer(model_provider, model_type)
    _write_logits(model[0], args)
    return 0


def resume_sample(args: argparse.Namespace, work: Path) -> int:
    """Resume `args.resume` in Megatron's own `pretrain` (its `load_checkpoint`, then `--steps` more iterations,
    no save) with the variant's command line plus `--megatron-args`; rank 0 writes every rank's LR per resumed
    iteration to `args.record` (JSON: [{rank, tp_rank, dp_rank, history: [{iteration, lr, loss}]}])."""
    from megatron.core import parallel_state as ps  # lazy: called after import_megatron (its path)

    v = VARIANTS[args.sample]
    recorder = Recorder()
    recorder.install()
    argv = megatron_argv(v, save=None, load=args.resume.resolve(), work=work)
    argv[argv.index("--train-iters") + 1] = str(ITERATIONS + args.steps)
    pretrain_gpt([*argv, *shlex.split(args.megatron_args or "")])
    mine = {
        "rank": torch.distributed.get_rank(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "history": recorder.history,
    }
    every: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    if torch.distributed.get_rank() == 0 and args.record is not None:
        args.record.write_text(json.dumps(every, indent=1))
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sample",
        choices=sorted(VARIANTS),
        help="the variant (required but with --forward, which "
        "without it rebuilds the model from the run folder's own args)",
    )
    p.add_argument("--out", type=Path, help="the group folder: the sample goes to <out>/<sample>")
    p.add_argument("--check", type=Path, help="load this saved run folder with Megatron's load_checkpoint")
    p.add_argument("--resume", type=Path, help="resume this run folder in Megatron's pretrain and record the LRs")
    p.add_argument(
        "--forward",
        type=Path,
        help="run Megatron's forward of this saved run folder (TP samples) on --tokens and save the logits to --logits",
    )
    p.add_argument(
        "--tokens", help="--forward (or --out: the saved model's forward, same launch): token ids, JSON rows"
    )
    p.add_argument("--logits", type=Path, help="with --tokens: where rank 0 saves the logits (torch.save)")
    p.add_argument("--steps", type=int, default=3, help="resume: iterations to train after loading (default 3)")
    p.add_argument("--record", type=Path, help="resume: rank 0 writes every rank's LR per iteration here (JSON)")
    p.add_argument(
        "--num-layers", type=int, help="--out: a deeper model than the sample's (bench/make_big_megatron.py)"
    )
    p.add_argument(
        "--megatron-args",
        default="",
        help="resume: extra Megatron flags, one string (e.g. --megatron-args='--use-checkpoint-opt_param-scheduler')",
    )
    args = p.parse_args()
    if sum(x is not None for x in (args.out, args.check, args.resume, args.forward)) != 1:
        p.error("give exactly one of --out, --check, --resume or --forward")
    if args.sample is None and args.forward is None:
        p.error("--sample is required (but with --forward)")
    if (args.tokens is None) != (args.logits is None) or (args.tokens and not (args.forward or args.out)):
        p.error("--tokens and --logits go together, with --forward or --out")
    if args.num_layers:
        MODEL["num_layers"] = args.num_layers  # the same recipe, deeper: for benchmarks, not for samples
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # what Megatron's TP setup asserts (users export it)
    import_megatron()
    join("gloo")
    work = _shared_tempdir("megatron_lm_work_")  # Megatron's dataset cache, outside the sample
    try:
        code = (
            check_sample
            if args.check is not None
            else resume_sample
            if args.resume is not None
            else logits_sample
            if args.forward is not None
            else make_sample
        )(args, work)
        torch.distributed.barrier()
    finally:
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(work, ignore_errors=True)
        # Megatron's data loader keeps its worker processes (persistent workers): they would outlive this rank and
        # hold the pipes of whoever captures its output (`ckpt samples make` would wait on them forever)
        for child in multiprocessing.active_children():
            child.terminate()
    leave(code)


if __name__ == "__main__":
    main()
