"""One module per checkpoint format. Each has `sniff(path) -> bool` and `open(path) -> Checkpoint`.

`detect` asks them in order; the order matters where layouts nest (an Accelerate folder can hold a
DeepSpeed tag folder, a universal checkpoint holds DeepSpeed model-states files).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from ..errors import NotACheckpoint

#: detection order: the most specific layouts first
FORMAT_MODULES = (
    "hf_trainer", "safetensors_file", "dcp", "universal", "accelerate", "megatron_pipeline", "deepspeed", "fsdp_sharded",
    "lightning", "torch_file",
)


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name == f"{__name__}.{name}":
            return None  # format not built yet in this checkout
        raise


def training_state(ck):
    """Where `ck`'s training state lives (`ckpt_tools.state.StateMap`), as its format module says; a format
    without a `training_state` is read-only for the writing commands."""
    from ..state import StateMap

    for name in FORMAT_MODULES:
        mod = _module(name)
        if mod is not None and getattr(mod, "FORMAT", None) == ck.format:
            if hasattr(mod, "training_state"):
                return mod.training_state(ck)
            break
    return StateMap(Path(ck.path), (), read_only=f"set-lr/set-step do not edit {ck.format} checkpoints: they hold no "
                    "optimizer or scheduler state", hint="edit the training checkpoint the run resumes from")


def detect(path: Path) -> ModuleType:
    """The format module that reads `path`; raises NotACheckpoint naming what was looked for."""
    if not path.exists():
        raise NotACheckpoint("no such file or folder", path=path, hint="check the path")
    for name in FORMAT_MODULES:
        mod = _module(name)
        if mod is not None and mod.sniff(path):
            return mod
    what = "folder" if path.is_dir() else "file"
    raise NotACheckpoint(
        f"this {what} is not a supported checkpoint (looked for DeepSpeed mp_rank_*/zero_pp_rank_* files, "
        "layer_*-model_* files, a DCP .metadata, Accelerate state files, torch.save files, safetensors)",
        path=path, hint="pass the checkpoint folder, its tag folder, or a checkpoint file")
