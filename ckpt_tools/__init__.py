"""ckpt_tools: inspect and repair large-model training checkpoints.

    import ckpt_tools
    ck = ckpt_tools.open_checkpoint("runs/gpt/checkpoints")   # any supported format, auto-detected
    ck.format, ck.topology, ck.counters, ck.lr, ck.parameter_count
    ck.get("optimizer.state.blocks.0.ln_1.weight.exp_avg").read_torch()

Opening reads metadata only: pickles are parsed without executing them, tensor bytes are read on demand.
"""

from __future__ import annotations

from .errors import CkptError, CorruptCheckpoint, MissingFile, NotACheckpoint, UnsupportedCheckpoint
from .view.checkpoint import open_checkpoint
from .read.tree import (
    Checkpoint,
    Counters,
    FileInfo,
    GroupNode,
    LearningRates,
    OpaqueNode,
    Piece,
    TensorNode,
    Topology,
    ValueNode,
    Warning_,
    iter_tensors,
    walk,
)

__version__ = "0.1.0"


__all__ = [
    "open_checkpoint",
    "Checkpoint",
    "Counters",
    "FileInfo",
    "GroupNode",
    "LearningRates",
    "OpaqueNode",
    "Piece",
    "TensorNode",
    "Topology",
    "ValueNode",
    "Warning_",
    "iter_tensors",
    "walk",
    "CkptError",
    "CorruptCheckpoint",
    "MissingFile",
    "NotACheckpoint",
    "UnsupportedCheckpoint",
]
