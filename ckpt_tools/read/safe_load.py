"""`torch.load` for the few places that need real objects: `weights_only=True` plus an explicit allowlist.

Reading for inspection never comes here (`pickle_reader` runs nothing). Where a real torch object tree
is needed (e.g. copying a DeepSpeed optimizer file's small fields into a new file), this is the only way
the project calls `torch.load`: torch's restricted unpickler, extended by name with the framework classes
real checkpoints carry. A pickle naming anything else fails loudly instead of running it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import sys
from typing import Any

from . import gate, pickle_reader
from ..errors import UnsupportedCheckpoint


def import_deepspeed():
    """Import deepspeed with its logger bound to stderr: it logs to stdout at import time (the accelerator
    it picked), which would corrupt `--json` output. Its handler keeps whichever stream it saw first."""
    with contextlib.redirect_stdout(sys.stderr):
        import deepspeed  # lazy: deepspeed is optional and heavy; only its own checkpoints need its classes
    return deepspeed


#: (module, name) of the framework classes real DeepSpeed/Megatron checkpoints pickle (docs/safety.md):
#: what `torch_load_allowlisted` lets torch's restricted unpickler build, and what to-universal lets through into
#: the files it writes (which DeepSpeed loads with its full unpickler)
ALLOWED_GLOBALS = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("argparse", "Namespace"),
)


def allowlist() -> list[Any]:
    """The classes of `ALLOWED_GLOBALS` (imports deepspeed)."""
    import_deepspeed()
    return [getattr(importlib.import_module(module), name) for module, name in ALLOWED_GLOBALS]


def torch_load_allowlisted(path: str | os.PathLike, *, mmap: bool = True) -> Any:
    """`torch.load(path, weights_only=True, mmap=mmap)` with `allowlist()` — tensors stay on disk with mmap."""
    import torch  # lazy: torch only for the few callers that need real objects; read/ is the torch-free core

    # torch's unpickler hashes dict keys in C: a tuple nested 300,000 deep kills the process (SIGSEGV). The inert
    # walk refuses such a file (and hash bombs) first, as every reader here does.
    pickle_reader.check_pickles(path)
    try:
        with torch.serialization.safe_globals(allowlist()):
            return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UnsupportedCheckpoint(
            f"refusing to load: the pickle names a class outside the allowlist ({first})",
            path=path,
            hint="inspect it with `ckpt inspect` to see the unknown global",
        ) from e


def untrusted_globals(ck: Any) -> dict[str, list[str]]:
    """file -> what a full unpickler would run beyond the allowlist (and foreign zip members), over EVERY file
    of the checkpoint: opening it parses only some (one ZeRO-3 model-states file of many), but a framework's
    loader unpickles them all (`read.gate`)."""
    return gate.by_file(gate.scan_checkpoint(ck))
