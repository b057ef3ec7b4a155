"""ckpt_tools: inspect and repair large-model training checkpoints.

    import ckpt_tools
    ck = ckpt_tools.open_checkpoint("runs/gpt/checkpoints")   # any supported format, auto-detected
    ck.format, ck.topology, ck.counters, ck.lr, ck.parameter_count
    ck.get("optimizer.state.blocks.0.ln_1.weight.exp_avg").read_torch()

Opening reads metadata only: pickles are parsed without executing them, tensor bytes are read on demand.
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import CkptError, CorruptCheckpoint, MissingFile, NotACheckpoint, UnsupportedCheckpoint
from .tree import (Checkpoint, Counters, FileInfo, GroupNode, LearningRates, OpaqueNode, Piece, TensorNode,
                   Topology, ValueNode, Warning_, iter_tensors, walk)

__version__ = "0.1.0"


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint of any supported format as one lazily-read tree (see `ckpt_tools.tree`)."""
    from .formats import detect

    p = Path(path)
    return detect(p).open(p)


__all__ = [
    "open_checkpoint", "Checkpoint", "Counters", "FileInfo", "GroupNode", "LearningRates", "OpaqueNode", "Piece",
    "TensorNode", "Topology", "ValueNode", "Warning_", "iter_tensors", "walk", "CkptError", "CorruptCheckpoint",
    "MissingFile", "NotACheckpoint", "UnsupportedCheckpoint",
]
