"""ckpt_tools: inspect and repair large-model training checkpoints.

    import ckpt_tools
    ck = ckpt_tools.open_checkpoint("runs/gpt/checkpoints")   # any supported format, auto-detected
    ck.format, ck.topology, ck.counters, ck.lr, ck.parameter_count
    ck.get("optimizer.state.blocks.0.ln_1.weight.exp_avg").read_torch()

Opening reads metadata only: pickles are parsed without executing them, tensor bytes are read on demand.
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from pathlib import Path

from .errors import CkptError, CorruptCheckpoint, MissingFile, NotACheckpoint, UnsupportedCheckpoint
from .tree import (Checkpoint, Counters, FileInfo, GroupNode, LearningRates, OpaqueNode, Piece, TensorNode,
                   Topology, ValueNode, Warning_, iter_tensors, walk)

__version__ = "0.1.0"


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a checkpoint of any supported format as one lazily-read tree (see `ckpt_tools.tree`).

    The result accounts for the whole checkpoint (`ckpt_tools.accounting`): `details["accounting"]` lists the
    files read and the state files no reader took, and the warnings say what the view leaves out (`unread-files`,
    `part-of-checkpoint` for one piece of a larger checkpoint, `scheduler-state-missing`)."""
    from .accounting import account
    from .formats import detect
    from .state import lost_scheduler_warnings

    p = Path(path)
    with gc_paused():
        ck = detect(p).open(p)
        ck = account(ck, p)
        return lost_scheduler_warnings(ck)


#: set by the CLI (a short-lived process): after a parse, move the parsed objects out of the collector's
#: sight (`gc.freeze()`), so that the first collection after it does not traverse every one of them
FREEZE_AFTER_PARSE = False


@contextmanager
def gc_paused():
    """No cyclic garbage collection while a checkpoint's metadata is parsed. Parsing allocates a few objects
    per tensor and frees none of them, so every collection the allocation count triggers finds nothing and
    re-traverses the whole growing tree: on an 18,437-tensor ZeRO-2 checkpoint the full collections were
    0.35 s of a 0.95 s open. Reference counting still frees everything acyclic as usual."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if FREEZE_AFTER_PARSE:
            gc.freeze()
        if was:
            gc.enable()


__all__ = [
    "open_checkpoint", "Checkpoint", "Counters", "FileInfo", "GroupNode", "LearningRates", "OpaqueNode", "Piece",
    "TensorNode", "Topology", "ValueNode", "Warning_", "iter_tensors", "walk", "CkptError", "CorruptCheckpoint",
    "MissingFile", "NotACheckpoint", "UnsupportedCheckpoint",
]
