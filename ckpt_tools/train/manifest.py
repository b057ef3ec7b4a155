"""The manifest written beside each sample: what the real training run did.

Tests assert the reader against these values, so every value must come from the live training
objects (the model, the optimizer, the scheduler, the engine), never from reading the checkpoint back.
Unknown values are None, never guessed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def manifest_path(ckpt_path: str | os.PathLike) -> Path:
    """`<out>/<group>/<name>` -> `<out>/<group>/<name>.manifest.json` (beside, never inside, the checkpoint)."""
    p = Path(ckpt_path)
    return p.with_name(p.name + ".manifest.json")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for mod in ("torch", "deepspeed", "accelerate", "safetensors", "transformers"):
        m = sys.modules.get(mod)
        out[mod] = getattr(m, "__version__", None) if m else None
    return out


def write_manifest(
    ckpt_path: str | os.PathLike,
    *,
    sample: str,
    format: str,
    world_size: int,
    topology: dict[str, int | None],
    steps: int,
    counters: dict[str, Any],
    lr: dict[str, Any],
    parameters: dict[str, int],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write the manifest for the checkpoint at `ckpt_path` (the path a user passes to `ckpt inspect`)."""
    data = {
        "sample": sample,
        "format": format,
        "world_size": world_size,
        "topology": topology,
        "steps": steps,
        "counters": counters,
        "lr": lr,
        "parameters": parameters,
        "versions": versions(),
        "extra": extra or {},
    }
    path = manifest_path(ckpt_path)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
