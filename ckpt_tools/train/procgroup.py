"""Leaving a torch.distributed (gloo) process cleanly.

Why a process that succeeded must not simply return: gloo runs collectives on its own C++ worker threads,
and a finished collective is freed on that thread a moment *after* the caller's `wait()` returned. If the
freed work still holds a tensor that Python has seen (any tensor passed to `all_reduce`, kept alive by a
later `barrier`), freeing it needs the GIL; when the interpreter is already finalizing, the thread is
unwound while holding C++ state and the process dies with "terminate called without an active exception"
(SIGABRT), turning a run that wrote and verified everything into a failure. It depends on timing (seen in
about one run in ten on a loaded 2-core machine; core dump: `ProcessGroupGloo::runLoop` ->
`~AsyncBarrierWork` -> `~AsyncAllreduceWork` -> `TensorImpl::decref_pyobject` -> `take_gil` during
`Py_FinalizeEx`). `destroy_process_group()` does not join those threads.

So a distributed entry point ends with `leave(code)`: all ranks meet at a barrier, the group is destroyed,
Python's streams and logging handlers are flushed, and the process ends with `os._exit(code)`, which skips
interpreter finalization (and the race) entirely. Call it only when everything the process writes has been
closed: it runs no atexit handlers.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta

_JOINED = [False]


def under_torchrun() -> bool:
    """Whether this process is a rank of a torchrun job: the variables torchrun sets are all there, its elastic
    agent's run id included (a process that merely inherited RANK / WORLD_SIZE from an in-process DeepSpeed or
    torch.distributed init is not a job rank)."""
    return all(
        os.environ.get(k)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    )


def join(backend: str = "gloo") -> int:
    """Initialise the default process group from torchrun's environment unless one exists; remember that this
    process made it (`joined()`), so that its entry point knows to `leave`. Returns this rank. Every collective
    of the group times out after `CKPT_DIST_TIMEOUT_S` seconds (default 600): a lost peer never hangs a rank."""
    # lazy: torch.distributed only in a torchrun process; the CLI imports this module torch-free
    import torch.distributed as dist

    if not dist.is_initialized():
        try:
            seconds = float(os.environ.get("CKPT_DIST_TIMEOUT_S", 600))
        except ValueError:
            seconds = 600.0
        dist.init_process_group(backend, timeout=timedelta(seconds=seconds))
        _JOINED[0] = True
    return dist.get_rank()


def joined() -> bool:
    """Whether `join` created the default process group and it is still alive."""
    if not _JOINED[0]:
        return False
    # lazy: torch.distributed only in a torchrun process; the CLI imports this module torch-free
    import torch.distributed as dist

    return dist.is_initialized()


def leave(code: int = 0, *, barrier: bool = True) -> None:
    """End this rank: barrier (unless `barrier` is False, e.g. after a failure on one rank), destroy the
    default process group if one is alive, flush, and `os._exit(code)`. Never returns."""
    try:
        # lazy: torch.distributed only in a torchrun process; the CLI imports this module torch-free
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            if barrier:
                dist.barrier()
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001  a peer died at the barrier: this rank did not finish cleanly
        print(f"error: leaving the process group failed: {e}", file=sys.stderr)
        code = code or 1
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe or stream: nothing left to say
                pass
        os._exit(code)
