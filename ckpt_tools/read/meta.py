"""Models built on the meta device (names and shapes, no memory): what planners compare with a checkpoint."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def meta_device() -> Iterator[None]:
    """`torch.device("meta")` with `torch.nn.init`'s initializers as no-ops while it lasts. On meta tensors they
    fill nothing, and the first one run there (through `torch._refs`) imports `torch._dynamo`: about 2 CPU-s of a
    command's start (torch 2.13), for a model whose values nobody reads."""
    # torch is imported here, not at the top: read/ is the torch-free core and only a planner that builds a model
    # needs it
    import torch  # lazy: read/ is the torch-free core; only a planner that builds a model needs torch
    import torch.nn.init as init  # lazy: as torch above

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}

    def keep(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    try:
        for n in names:
            setattr(init, n, keep)
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(init, n, f)
