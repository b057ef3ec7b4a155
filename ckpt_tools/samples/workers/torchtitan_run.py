"""torchtitan sample made by the REAL torchtitan Trainer (not an imitation), 2 gloo ranks on CPU, FSDP2.

Measured with torchtitan 0.3.0 and torch 2.13.0+cpu (Python 3.11). Run under torchrun with 2 ranks, as
`ckpt_tools.samples.run_torchrun` does:

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.torchtitan_run \\
        --sample torchtitan_real --out DIR

What runs: torchtitan's own `ConfigManager` parses `--module ckpt_tools.samples.workers.torchtitan_run --config
torchtitan_tiny` plus the flags below (the same path `torchtitan.train.main` takes), `config.build()` builds
torchtitan's `Trainer` (its FSDP2 `parallelize_llama`, `OptimizersContainer`, `LRSchedulersContainer`,
`HuggingFaceTextDataLoader`, `CheckpointManager`), and `trainer.train()` trains and saves. `torchtitan_tiny` is a
config-registry function like torchtitan's own `llama3_debugmodel`, with the model shrunk to a llama3 of 2
layers, dim 64, 4 heads, FFN hidden 96, vocab 64 (built with torchtitan's own llama3 builders). Nothing is
downloaded: the tokenizer (a character-level `tokenizers` WordLevel `tokenizer.json` + `tokenizer_config.json`
with BOS/EOS) and a small c4-like JSON text dataset (torchtitan's `c4_test` loader pointed at it with
`--dataloader.dataset-path`) are written to a per-rank temporary folder at start. torchtitan's package ships
neither (its `tests/assets` are only in the repository).

The run: 5 steps, local batch 2 x seq 32 per rank, AdamW with two param groups from torchtitan's
`ParamGroupConfig` (norm weights: lr 4e-4, no weight decay; everything else: lr 8e-4, weight decay 0.1),
torchtitan's warmup-stable-decay LambdaLR (warmup 2, linear decay to 0 over the last 60%: factors 0.5, 1,
1, 2/3, 1/3 for steps 1-5), checkpoint interval 3,
`last_save_model_only` (torchtitan's default): torchtitan writes `step-3/` (the full training state) and
`step-5/` (the final, model-only save). `--checkpoint.folder` is the sample folder itself, so both step folders
are exactly what torchtitan wrote (`.metadata` + `__0_0.distcp`, `__1_0.distcp`; nothing else).
The job's dump folder (torchtitan's structured logs, comm traces) is a temporary folder, removed at the end.

Run-time changes needed on CPU (no installed file is edited; all are applied in this process before the
Trainer starts; each was needed, found by running torchtitan 0.3.0 on torch 2.13.0+cpu):
1. device selection: `torchtitan.tools.utils` picks `_get_available_device_type() or "cuda"` at import, i.e.
   "cuda" without an accelerator. `torch._utils._get_available_device_type` answers "cpu" only while that
   module is first imported (restored right after), so torchtitan's `device_type` is "cpu" (the default
   process-group backend for "cpu" is gloo). Its `device_module` is then `torch.cpu`, which lacks what
   torchtitan's `DeviceMemoryMonitor` asks (`get_device_name`, `get_device_properties().total_memory`,
   `memory_stats`, `reset_peak_memory_stats`, `empty_cache`) and answers `current_device()` with "cpu", which
   `barrier(device_ids=[...])` in `set_pg_timeouts` rejects: `tools.utils.device_module` is replaced (before
   any other torchtitan module imports it) by `torch.cpu` plus host answers to those (no memory statistics,
   so torchtitan logs memory as -0.00GiB; `current_device()` 0).
2. attention: torchtitan's llama3 uses `FlexAttention` (SDPA is refused for language models) and
   `flex_attention` has no CPU backward. `FlexAttention.compiled_flex_attn` is replaced with
   `F.scaled_dot_product_attention` on the dense boolean mask made from the same `BlockMask.mask_mod`
   (torchtitan's per-document causal mask), so the math is the same attention.
3. gloo has no `ReduceOp.PREMUL_SUM`: torchtitan sets FSDP's gradient divide factor to 1.0, which makes FSDP
   reduce-scatter with PREMUL_SUM(1.0). `disable_fsdp_gradient_division` is wrapped to also call
   `set_force_sum_reduction_for_comms(True)` on each FSDP module: SUM, then divide by 1.0 (the same numbers).
4. `torch.distributed.set_timeout` (called by torchtitan after the first step) does not exist in torch 2.13:
   it is provided as `torch.distributed.distributed_c10d._set_pg_timeout`.
Flag: `--parallelism.spmd-backend partial_dtensor`. With torchtitan 0.3.0's default ("spmd_types") the FSDP
wrapping fails: "ValueError: When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh
(e.g. via distribute_module). Got plain tensor for parameter 'weight'." Not needed: `--training.mixed-precision-param
float32`; torchtitan's default bf16 FSDP compute runs on CPU (the sharded parameters, the optimizer state and the
saved tensors stay float32), so the sample keeps the default. Each change above was checked by leaving it out:
without 2 "NotImplementedError: FlexAttention does not support backward on CPU", without 3 "RuntimeError: Cannot
use ReduceOp.PREMUL_SUM with Gloo", without 4 AttributeError (no torch.distributed.set_timeout), without 1
torchtitan asks torch.cuda for the device.
Packages (import-time needs of torchtitan 0.3.0): `torchtitan==0.3.0` (--no-deps), `tyro`, `spmd_types==0.2.3`,
`torchdata`, `torch_checkpointing` (all three --no-deps: they require torch), `tensorboard` (imported by
torch.utils.tensorboard at import), `triton` (imported unconditionally by torchtitan's EP kernels; --no-deps),
`datasets` (--no-deps; its pins would downgrade huggingface-hub/fsspec) with `pyarrow`, `pandas`, `dill`,
`multiprocess`, `xxhash`, `httpx`.

Observation only (no behaviour change): the trainer instance's `train_step`, `metrics_processor.log` and
`checkpointer.dcp_save` are wrapped to record, from the live objects, the LR each step used, the logged loss,
and at each save the counters, LRs and the keys handed to DCP. The manifest
`<out>/torchtitan_real.manifest.json` holds them.

Check mode (resume in torchtitan's own Trainer):

    python -m torch.distributed.run --nproc_per_node 2 -m ckpt_tools.samples.workers.torchtitan_run \\
        --sample torchtitan_real --check DIR/torchtitan_real/step-3 [--record OUT.json] [--steps 1]

starts the Trainer with the same config, `--checkpoint.folder` = the step folder's parent,
`--checkpoint.load-step N`, `--checkpoint.load-only` (no saves), `--training.steps N+steps` and
`--lr-scheduler.total-steps 5` (the schedule of the original run), trains `steps` step(s) and prints, per
resumed step, the LR each param group used, the step, the scheduler's last_epoch and the loss. `--trainer-arg A`
(repeatable) appends A
to torchtitan's job-config arguments, as a user relaunching would (e.g. the config LR `ckpt set-lr` names);
`--record` holds rank 0's steps and every rank's param-group LRs (`ranks`); `--dump OUT.pt` saves, after the steps,
every parameter and its Adam state whole (FSDP2 shards gathered), by the module's parameter names (`full_state`).
`model_config(fuse_qkv=False)` is the same llama3 with the stock wq/wk/wv (the DeepSpeed worker `ds_torchtitan`
trains it).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch._utils
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import AuxOutput, create_mask

from ckpt_tools.samples.workers._common import check_mode_parser, param_group_value, rank, shared_adam_step
from ckpt_tools.train.manifest import write_manifest
from ckpt_tools.train.procgroup import leave

SAMPLES = ("torchtitan_real", "torchtitan_gqa", "torchtitan_onegroup", "torchtitan_split")
#: the grouped-query variant (not bundled: tests make it where torchtitan is installed): 4 heads in 2 KV groups
N_KV_HEADS = {"torchtitan_real": None, "torchtitan_gqa": 2, "torchtitan_onegroup": None, "torchtitan_split": None}
#: llama3's attention as fused wqkv (its default) or torchtitan's stock separate wq / wk / wv (`torchtitan_split`)
FUSE_QKV = {name: name != "torchtitan_split" for name in SAMPLES}
TORCHTITAN_VERSION = "0.3.0"
MODULE = "ckpt_tools.samples.workers.torchtitan_run"
CONFIG_FN = "torchtitan_tiny"
CONFIG_FNS = {
    "torchtitan_real": CONFIG_FN,
    "torchtitan_gqa": "torchtitan_tiny_gqa",
    "torchtitan_onegroup": "torchtitan_tiny_onegroup",
    "torchtitan_split": "torchtitan_tiny_split",
}

DP = 2
# model (torchtitan llama3 builders)
DIM, N_HEADS, N_LAYERS, HIDDEN_DIM, VOCAB = 64, 4, 2, 96, 64
# run
SEQ_LEN, LOCAL_BATCH, STEPS, INTERVAL = 32, 2, 5, 3
LR, NORM_LR, WEIGHT_DECAY, BETAS, EPS = 8e-4, 4e-4, 0.1, (0.9, 0.95), 1e-8
NORM_PATTERN = r"norm\."
WARMUP, DECAY_RATIO, DECAY_TYPE, MIN_LR_FACTOR = 2, 0.6, "linear", 0.0
SEED = 0
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<unk>"

CPU_SHIMS = [
    "device selection: torch._utils._get_available_device_type answers 'cpu' while torchtitan.tools.utils is "
    "imported (torchtitan 0.3.0 falls back to 'cuda' without an accelerator); restored right after; "
    "torchtitan's device_module is torch.cpu plus host answers to the memory-monitor queries torch.cpu lacks "
    "(get_device_name, get_device_properties, memory_stats, reset_peak_memory_stats, empty_cache), and "
    "current_device() == 0 (an index, as torch.cuda answers; torch.cpu answers 'cpu', which barrier(device_ids=) "
    "rejects)",
    "FlexAttention.compiled_flex_attn -> F.scaled_dot_product_attention with the dense mask of the same "
    "BlockMask.mask_mod (flex_attention has no CPU backward in torch 2.13)",
    "torchtitan.distributed.fsdp.disable_fsdp_gradient_division also sets set_force_sum_reduction_for_comms(True) "
    "(gloo lacks ReduceOp.PREMUL_SUM; divide factor 1.0, so SUM gives the same gradients)",
    "torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout (missing in torch 2.13)",
]
CPU_FLAGS = ["--parallelism.spmd-backend", "partial_dtensor"]


# --- the config (a torchtitan config-registry function, found by ConfigManager via --module/--config) -------


def model_config(fuse_qkv: bool = True, n_kv_heads: int | None = None):
    """The sample's llama3 (torchtitan's own builders): fused wqkv (llama3's default) or the stock wq/wk/wv;
    `n_kv_heads` < 4: grouped-query attention."""
    # lazy: torchtitan is imported only after apply_cpu_shims() (it picks its device at import); the same below
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        Llama3Model,
        _build_llama3_layers,
        _EMBEDDING_INIT,
        _NORM_INIT,
        _output_linear_init,
    )

    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=fuse_qkv,
            n_layers=N_LAYERS,
            dim=DIM,
            n_heads=N_HEADS,
            hidden_dim=HIDDEN_DIM,
            n_kv_heads=n_kv_heads,
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=SEQ_LEN, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )


def torchtitan_tiny_gqa():
    """`torchtitan_tiny` with grouped-query attention (4 heads in 2 KV groups)."""
    return torchtitan_tiny(n_kv_heads=N_KV_HEADS["torchtitan_gqa"])


def torchtitan_tiny_onegroup():
    """`torchtitan_tiny` with torchtitan's own stock optimizer, `default_adamw(lr=LR)` (what its llama3 configs use):
    one AdamW param group, weight decay 0.1 on every parameter, the norms included (not bundled: tests make it)."""
    from torchtitan.components.optimizer import default_adamw  # lazy: after apply_cpu_shims(), as above

    return torchtitan_tiny(optimizer=default_adamw(lr=LR))


def torchtitan_tiny_split():
    """`torchtitan_tiny` with `fuse_qkv=False`: separate wq / wk / wv parameters, each with its own Adam state (not
    bundled: tests make it)."""
    return torchtitan_tiny(fuse_qkv=False)


def torchtitan_tiny(n_kv_heads: int | None = None, optimizer=None, fuse_qkv: bool = True):
    """Like torchtitan's `llama3_debugmodel`, with a llama3 small enough for a bundled sample."""
    # lazy: these imports run after apply_cpu_shims(), as in model_config
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import Llama3StateDictAdapter, parallelize_llama
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    model = model_config(fuse_qkv=fuse_qkv, n_kv_heads=n_kv_heads)
    spec = ModelSpec(
        name="llama3",
        flavor="tiny",
        model=model,
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=Llama3StateDictAdapter,
    )
    adamw = {"betas": BETAS, "eps": EPS}
    return Trainer.Config(
        loss=ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))),
        hf_assets_path="./tests/assets/tokenizer",  # replaced by --hf-assets-path
        model_spec=spec,
        optimizer=optimizer
        or OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern=NORM_PATTERN,
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": NORM_LR, **adamw, "weight_decay": 0.0},
                ),
                ParamGroupConfig(
                    pattern=r".*",
                    optimizer_name="AdamW",
                    optimizer_kwargs={"lr": LR, **adamw, "weight_decay": WEIGHT_DECAY},
                ),
            ]
        ),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=WARMUP, decay_ratio=DECAY_RATIO, decay_type=DECAY_TYPE, min_lr_factor=MIN_LR_FACTOR
        ),
        training=TrainingConfig(local_batch_size=LOCAL_BATCH, seq_len=SEQ_LEN, steps=STEPS),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test"),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(data_parallel_shard_degree=DP),
        checkpoint=CheckpointManager.Config(enable=True, interval=INTERVAL, last_save_model_only=True),
        activation_checkpoint=SelectiveAC.Config(),
        debug=DebugConfig(seed=SEED),
    )


# --- assets: tokenizer + dataset, written locally (no network) -----------------------------------------------

_WORDS = (
    "the model saves a checkpoint every few steps and the optimizer keeps two moments for each weight "
    "while the scheduler warms the learning rate up then decays it linearly to zero at the end of "
    "training shards live on two ranks gloo moves the gradients"
).split()


def write_assets(folder: Path) -> tuple[Path, Path]:
    """A character-level tokenizer (tokenizer.json + tokenizer_config.json) and a c4-like JSON dataset.
    Returns (hf_assets_path, dataset_path)."""
    chars = list(" abcdefghijklmnopqrstuvwxyz0123456789.,'-!?")
    vocab = {BOS: 0, EOS: 1, UNK: 2, **{ch: i + 3 for i, ch in enumerate(chars)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    assets = folder / "tokenizer"
    assets.mkdir(parents=True)
    tok.save(str(assets / "tokenizer.json"))
    (assets / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "add_bos_token": True, "add_eos_token": True})
    )
    data = folder / "c4_test"
    data.mkdir()
    rng = random.Random(SEED)
    with open(data / "data.json", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 20)))}) + "\n")
    return assets, data


# --- CPU run-time changes ----------------------------------------------------------------------------------


def apply_cpu_shims() -> None:
    """The run-time changes listed in the module docstring; call before anything imports torchtitan."""
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError("apply_cpu_shims() must run before torchtitan is imported")
    # 1. device selection
    real = torch._utils._get_available_device_type
    torch._utils._get_available_device_type = lambda: real() or "cpu"
    try:
        import torchtitan.tools.utils as tt_utils  # lazy: the point of this function: imported with the shim in place
    finally:
        torch._utils._get_available_device_type = real
    if tt_utils.device_type != "cpu":
        raise RuntimeError(f"torchtitan picked device {tt_utils.device_type!r}; this worker is for CPU only")
    # torch.cpu lacks the memory queries torchtitan's DeviceMemoryMonitor makes; the other torchtitan modules
    # import `device_module` from tools.utils after this point, so they all get the stand-in
    tt_utils.device_module = _CpuDeviceModule()

    # 2. flex_attention -> SDPA with the same mask
    from torchtitan.models.common import attention as tt_attention  # lazy: after the device shim above

    def sdpa_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None:
            raise NotImplementedError("score_mod is not supported by the CPU SDPA stand-in")
        batch, _, q_len, _ = q.shape
        mask = create_mask(block_mask.mask_mod, batch, 1, q_len, k.shape[-2], device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        lse = None
        if return_aux is not None and return_aux.lse:
            s = scale if scale is not None else q.shape[-1] ** -0.5
            kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1) if enable_gqa else k
            scores = (q @ kk.transpose(-2, -1)) * s
            lse = scores.masked_fill(~mask, float("-inf")).logsumexp(dim=-1)
        return out, AuxOutput(lse=lse)

    tt_attention.FlexAttention.compiled_flex_attn = staticmethod(sdpa_flex)

    # 3. gloo lacks PREMUL_SUM
    import torchtitan.distributed.fsdp as tt_fsdp  # lazy: after the device shim above

    real_disable = tt_fsdp.disable_fsdp_gradient_division

    def disable_division_sum_only(model):
        real_disable(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_division_sum_only

    # 4. torch.distributed.set_timeout
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


class _CpuDeviceModule:
    """`torch.cpu` plus the device queries torchtitan's metrics make of a device module (name, total memory,
    memory stats, peak reset, cache flush), answered for the host: no accelerator memory statistics exist."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def current_device() -> int:
        # torch.cpu.current_device() is the string "cpu"; torchtitan passes it to barrier(device_ids=[...]),
        # which takes integer indices (as torch.cuda.current_device() returns)
        return 0

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return SimpleNamespace(name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None


# --- running the Trainer -----------------------------------------------------------------------------------


def trainer_argv(
    *, assets: Path, dataset: Path, dump: Path, ckpt_folder: Path, extra: list[str] = (), config_fn: str = CONFIG_FN
) -> list[str]:
    return [
        "--module",
        MODULE,
        "--config",
        config_fn,
        *CPU_FLAGS,
        "--hf-assets-path",
        str(assets),
        "--dataloader.dataset-path",
        str(dataset),
        "--dump-folder",
        str(dump),
        "--checkpoint.folder",
        str(ckpt_folder),
        *extra,
    ]


class Recorder:
    """Wraps a live Trainer's train_step / metrics log / dcp_save to record what happened (no behaviour change)."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.history: list[dict[str, Any]] = []
        self.saves: list[dict[str, Any]] = []
        self._pending: dict[str, Any] | None = None
        train_step, log, dcp_save = trainer.train_step, trainer.metrics_processor.log, trainer.checkpointer.dcp_save

        def recorded_train_step(data_iterator):
            lrs = self.group_values("lr")
            self._pending = {"step": trainer.step, "lr": lrs}
            out = train_step(data_iterator)
            self._pending["lr_after"] = self.group_values("lr")
            self._pending["scheduler_last_epoch"] = self.scheduler().last_epoch
            self.history.append(self._pending)
            return out

        def recorded_log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
            if self._pending is not None and self._pending["step"] == step:
                self._pending["loss"] = float(global_avg_loss)
                self._pending["grad_norm"] = float(grad_norm)
            return log(step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

        def recorded_dcp_save(state_dict, checkpoint_id, *args, **kwargs):
            self.saves.append(self.snapshot(state_dict, checkpoint_id))
            return dcp_save(state_dict, checkpoint_id, *args, **kwargs)

        trainer.train_step = recorded_train_step
        trainer.metrics_processor.log = recorded_log
        trainer.checkpointer.dcp_save = recorded_dcp_save

    def optimizers(self) -> list:
        return list(self.trainer.optimizers.optimizers)

    def scheduler(self):
        return self.trainer.lr_schedulers.schedulers[0]

    def group_values(self, key: str) -> list[Any]:
        return [param_group_value(g.get(key)) for opt in self.optimizers() for g in opt.param_groups]

    def adam_steps(self) -> list[float]:
        steps = {float(s["step"]) for opt in self.optimizers() for s in opt.state.values() if "step" in s}
        return sorted(steps)

    def snapshot(self, state_dict: dict[str, Any], checkpoint_id: str) -> dict[str, Any]:
        plain = {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}
        flat, _ = flatten_state_dict(plain)
        keys = sorted(flat)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, keys)
        all_keys = sorted(set().union(*gathered))
        sched = self.scheduler()
        return {
            "step": self.trainer.step,
            "folder": Path(checkpoint_id).name,
            "kind": "full" if "optimizer" in state_dict else "model_only",
            "top_level": sorted(k for k in state_dict if not hasattr(state_dict[k], "shape")),
            "keys": all_keys,
            "keys_per_rank": {
                str(r): sorted(set(g) - set.intersection(*map(set, gathered))) for r, g in enumerate(gathered)
            },
            "counters": {
                "global_step": self.trainer.step,
                "ntokens_seen": self.trainer.ntokens_seen,
                "optimizer_step": self.adam_steps(),
                "scheduler_last_epoch": sched.last_epoch,
                "scheduler_step_count": sched._step_count,
                "skipped_steps": None,
            },
            "lr": {
                "param_groups": self.group_values("lr"),
                "initial_lr": self.group_values("initial_lr"),
                "base_lrs": [float(x) for x in sched.base_lrs],
                "last_lr": [float(x) for x in sched.get_last_lr()],
            },
            "weight_decay": self.group_values("weight_decay"),
            "param_names": self.group_values("param_names"),
        }


def build_trainer(argv: list[str]):
    # lazy: torchtitan, after apply_cpu_shims()
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(argv)
    return config, config.build()


def finish(trainer) -> None:
    """What torchtitan.train.main does after training, except destroying the process group (ours, at exit)."""
    trainer.close()


# --- make --------------------------------------------------------------------------------------------------


def make(sample: str, out: Path) -> None:
    target = (out / sample).resolve()
    if target.exists() and any(target.iterdir()):
        raise SystemExit(f"{target} exists and is not empty")
    work = Path(tempfile.mkdtemp(prefix=f"ckpt_torchtitan_r{rank()}_"))
    try:
        assets, dataset = write_assets(work / "assets")
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_cache")
        argv = trainer_argv(
            assets=assets, dataset=dataset, dump=work / "dump", ckpt_folder=target, config_fn=CONFIG_FNS[sample]
        )
        config, trainer = build_trainer(argv)
        rec = Recorder(trainer)
        model = trainer.model_parts[0]
        trainer.train()
        dist.barrier()
        if rank() == 0:
            write_make_manifest(sample, target, config, trainer, model, rec, argv, work)
        finish(trainer)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def write_make_manifest(sample, target, config, trainer, model, rec: Recorder, argv, work: Path) -> None:
    # lazy: torchtitan (its version), after apply_cpu_shims()
    import torchtitan

    saved, model_only = _the_two_saves(rec, target)
    write_manifest(
        target,
        sample=sample,
        format="dcp",
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        topology={"dp": DP, "tp": 1, "pp": 1, "zero_stage": None},
        steps=saved["step"],
        counters={**saved["counters"], "optimizer_step": shared_adam_step(saved["counters"]["optimizer_step"])},
        lr=saved["lr"],
        parameters={"count": int(sum(p.numel() for p in model.parameters())), "tensors": len(list(model.parameters()))},
        extra={
            "producer": "torchtitan Trainer (real)",
            "saved_model_keys": [
                k
                for k in saved["keys"]
                if k.split(".")[0] not in ("optimizer", "lr_scheduler", "dataloader", "train_state")
            ],
            "model_keys_note": "model keys sit flat at the top level; torchtitan's state-dict hook saves each fused "
            "attention.qkv_linear.wqkv.weight as three full (unsharded, one-chunk) tensors "
            "wq/wk/wv, while the optimizer state stays under the fused name "
            "(optimizer.state.<...>.wqkv.weight.*): 21 model keys for 17 live parameters",
            "torchtitan_version": getattr(torchtitan, "__version__", None),
            "layout": "torchtitan",
            "full_save": saved["folder"],
            "model_only_save": model_only["folder"],
            "saves": rec.saves,
            "history": rec.history,
            "history_note": "one entry per training step (1-based; the save at step N holds the state after "
            "update N): 'lr' is the LR of each param group (group order: norms, rest) that update "
            "used (read before it), 'lr_after' after the scheduler stepped, 'loss' and "
            "'grad_norm' what torchtitan logged (loss averaged over both ranks)",
            "config": _run_config(config, sample),
            "trainer_argv": [a.replace(str(target), "<sample>").replace(str(work), "<per-rank temp>") for a in argv],
            "cpu_shims": CPU_SHIMS,
            "cpu_flags": CPU_FLAGS,
            "live_parameter_names": [n for n, _ in model.named_parameters()],
            "scheduler_note": "torchtitan LRSchedulersContainer: one LambdaLR per optimizer; the checkpoint saves "
            "only lr_scheduler.last_epoch; on resume base_lrs come from the job config and the "
            "saved per-parameter optimizer.param_groups.<fqn>.lr drives the first resumed step",
        },
    )


def _the_two_saves(rec: Recorder, target: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the full save, the model-only save) the Recorder saw; the sample folder must hold exactly their folders."""
    full = [s for s in rec.saves if s["kind"] == "full"]
    model_only = [s for s in rec.saves if s["kind"] == "model_only"]
    if len(full) != 1 or len(model_only) != 1:
        raise RuntimeError(f"expected one full and one model-only save, got {[s['folder'] for s in rec.saves]}")
    on_disk = sorted(p.name for p in target.iterdir())
    if on_disk != sorted(s["folder"] for s in rec.saves):
        raise RuntimeError(f"{target} holds {on_disk}, expected {[s['folder'] for s in rec.saves]}")
    return full[0], model_only[0]


def _run_config(config, sample: str) -> dict[str, Any]:
    """The job config's optimizer, schedule, checkpoint and batch settings, and the model's size."""
    sched_cfg = config.lr_scheduler
    return {
        "lr": [pg.optimizer_kwargs["lr"] for pg in config.optimizer.param_groups],
        "param_group_patterns": [pg.pattern for pg in config.optimizer.param_groups],
        "weight_decay": [pg.optimizer_kwargs["weight_decay"] for pg in config.optimizer.param_groups],
        "warmup_steps": sched_cfg.warmup_steps,
        "decay_ratio": sched_cfg.decay_ratio,
        "decay_type": sched_cfg.decay_type,
        "min_lr_factor": sched_cfg.min_lr_factor,
        "lr_scheduler_total_steps": sched_cfg.total_steps,
        "training_steps": config.training.steps,
        "checkpoint_interval": config.checkpoint.interval,
        "last_save_model_only": config.checkpoint.last_save_model_only,
        "export_dtype": config.checkpoint.export_dtype,
        "local_batch_size": config.training.local_batch_size,
        "seq_len": config.training.seq_len,
        "model": {
            "dim": DIM,
            "n_heads": N_HEADS,
            "n_layers": N_LAYERS,
            "hidden_dim": HIDDEN_DIM,
            "vocab_size": VOCAB,
            "fuse_qkv": FUSE_QKV[sample],
            "n_kv_heads": N_KV_HEADS[sample] or N_HEADS,
        },
        "seed": SEED,
    }


# --- check (resume) ----------------------------------------------------------------------------------------


def full_state(model, optimizers) -> dict[str, Any]:
    """Every parameter and its Adam state, whole (FSDP2 shards gathered: a collective, on every rank), by the
    module's parameter name ({name: {"param", "exp_avg", "exp_avg_sq", "step"}})."""

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out: dict[str, Any] = {}
    states = {id(p): st for opt in optimizers for p, st in opt.state.items()}
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        entry = {"param": whole(p.detach()).clone()}
        for k, v in states.get(id(p), {}).items():
            entry[k] = whole(v).clone() if hasattr(v, "shape") and v.dim() else float(v)
        out[name] = entry
    return out


def check(
    step_folder: Path,
    record: Path | None,
    steps: int,
    trainer_args: list[str] = (),
    dump: Path | None = None,
    config_fn: str = CONFIG_FN,
) -> None:
    """Resume from `step_folder` in torchtitan's Trainer for `steps` steps; print each step's LR and loss beside
    the uninterrupted run's, and write them (with every rank's LRs) to `record`; `dump`: the whole state after."""
    step_folder = step_folder.resolve()
    name = step_folder.name
    if not name.startswith("step-"):
        raise SystemExit(f"{step_folder}: expected a torchtitan step folder named step-N")
    load_step = int(name.split("-", 1)[1])
    work = Path(tempfile.mkdtemp(prefix=f"ckpt_torchtitan_check_r{rank()}_"))
    try:
        assets, dataset = write_assets(work / "assets")
        os.environ["HF_DATASETS_CACHE"] = str(work / "hf_cache")
        resume = ["--checkpoint.load-step", str(load_step), "--checkpoint.load-only"]
        steps_args = ["--training.steps", str(load_step + steps), "--lr-scheduler.total-steps", str(STEPS)]
        argv = trainer_argv(
            assets=assets,
            dataset=dataset,
            dump=work / "dump",
            ckpt_folder=step_folder.parent,
            extra=[*resume, *steps_args, *trainer_args],
            config_fn=config_fn,
        )
        _, trainer = build_trainer(argv)
        rec = Recorder(trainer)
        trainer.train()
        dist.barrier()
        keys = ("step", "lr", "lr_after", "scheduler_last_epoch")
        records = [{**{k: h[k] for k in keys}, "loss": h.get("loss")} for h in rec.history]
        # every rank's own optimizer LRs (each rank steps its own shard's param groups)
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, [{"step": h["step"], "lr": h["lr"]} for h in rec.history])
        if dump is not None:
            state = full_state(trainer.model_parts[0], rec.optimizers())
            if rank() == 0:
                torch.save(state, dump)
        if rank() == 0:
            _compare_with_uninterrupted(records, _original_history(step_folder))
            if record is not None:
                result = {"loaded_step": load_step, "trainer_args": list(trainer_args), "records": records}
                record.write_text(json.dumps({**result, "ranks": per_rank}, indent=1) + "\n")
        finish(trainer)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _compare_with_uninterrupted(records: list[dict[str, Any]], original: dict[int, dict[str, Any]]) -> None:
    """Print each resumed step, and beside it the uninterrupted run's same step (SAME: equal LR, loss within
    1e-5); the comparison is added to the record as "uninterrupted"."""
    for r in records:
        print(
            f"RESUMED step {r['step']}: lr {r['lr']} (after scheduler step {r['lr_after']}), "
            f"scheduler last_epoch {r['scheduler_last_epoch']}, loss {r['loss']}",
            flush=True,
        )
        o = original.get(r["step"])
        if o is not None:
            same = o["lr"] == r["lr"] and abs(o["loss"] - r["loss"]) < 1e-5
            r["uninterrupted"] = {"lr": o["lr"], "loss": o["loss"], "same": same}
            print(
                f"UNINTERRUPTED step {r['step']}: lr {o['lr']}, loss {o['loss']} -> {'SAME' if same else 'DIFFERENT'}",
                flush=True,
            )


def _original_history(step_folder: Path) -> dict[int, dict[str, Any]]:
    """The uninterrupted run's steps from the manifest beside the sample folder (empty if there is none)."""
    manifest = step_folder.parent.with_name(step_folder.parent.name + ".manifest.json")
    if not manifest.is_file():
        return {}
    history = json.loads(manifest.read_text()).get("extra", {}).get("history", [])
    return {h["step"]: h for h in history if "loss" in h}


def forward_logits(step_folder: Path, tokens: list[list[int]], n_kv_heads: int | None = None):
    """torchtitan's own forward of the sample's llama3 (fused wqkv) with the weights of a saved step: the model
    built by torchtitan, its state dict (wq/wk/wv, split by its save hook) filled by `dcp.load` from the step folder
    and loaded through its merge hook, the attention mask from its own `get_attention_masks` (one document per
    row: causal). Single process; the CPU shims applied first."""
    apply_cpu_shims()
    with torch.device("meta"):
        model = model_config(n_kv_heads=n_kv_heads).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    saved = set(dcp.FileSystemReader(str(step_folder)).read_metadata().state_dict_metadata)
    sd = {k: v for k, v in model.state_dict().items() if k in saved}
    dcp.load(sd, checkpoint_id=str(step_folder))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    params = {n for n, _ in model.named_parameters()}
    if [k for k in missing if k in params] or unexpected:
        raise RuntimeError(f"the step's weights do not fill the model: missing {missing}, unexpected {unexpected}")
    model.eval()
    x = torch.tensor(tokens, dtype=torch.long)
    positions = torch.arange(x.shape[1]).expand(x.shape[0], -1).contiguous()
    with torch.no_grad():
        return model(x, positions=positions, attention_masks=model.get_attention_masks(positions=positions))


def logits_main() -> None:
    """`python -c "from ckpt_tools.samples.workers.torchtitan_run import logits_main; logits_main()" STEP OUT.pt
    TOKENS_JSON [N_KV_HEADS]`: torch.save of `forward_logits` (N_KV_HEADS: the grouped-query variant's)."""
    step, out, tokens = sys.argv[1:4]
    kv = int(sys.argv[4]) if len(sys.argv) > 4 else None  # the KV heads of the grouped-query variant
    torch.save(forward_logits(Path(step), json.loads(tokens), kv), out)


def main() -> None:
    p = check_mode_parser(
        "Make (or resume-check) the real torchtitan sample.",
        SAMPLES,
        check_help="a torchtitan step-N folder to resume from in torchtitan's Trainer",
        steps_default=1,
        steps_help="check mode: steps to train after loading (default 1)",
    )
    p.add_argument(
        "--trainer-arg",
        action="append",
        default=[],
        dest="trainer_args",
        help="check mode: one more job-config argument for torchtitan's ConfigManager, as a user adds to "
        "the launch command (repeat; e.g. --trainer-arg=--optimizer.param-groups.0.optimizer-kwargs.lr "
        "--trainer-arg=0.0002)",
    )
    p.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="check mode: after the steps, save every parameter and "
        "its Adam state, whole, by parameter name (torch.save, rank 0)",
    )
    p.add_argument(
        "--size",
        default=None,
        metavar="LAYERS,DIM,HIDDEN",
        help="a larger llama3 than the sample's "
        "(bench/bench_titan_to_megatron.py; not for samples): layers, model dim (4 heads), FFN hidden",
    )
    args = p.parse_args()
    if args.size:  # read by model_config when torchtitan's ConfigManager calls the config function, below
        size = dict(zip(("N_LAYERS", "DIM", "HIDDEN_DIM"), (int(x) for x in args.size.split(","))))
        globals().update(size)  # this module run as __main__, and the one ConfigManager imports by --module
        vars(importlib.import_module(MODULE)).update(size)
    if (args.out is None) == (args.check is None):
        p.error("give exactly one of --out or --check")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    apply_cpu_shims()
    code = 0
    try:
        if args.check is not None:
            check(args.check, args.record, args.steps, args.trainer_args, args.dump, CONFIG_FNS[args.sample])
        else:
            make(args.sample, args.out)
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code, barrier=code == 0)


if __name__ == "__main__":
    main()
