"""The one interface every writer of a Megatron-LM run has (`MegatronTarget`: `write.megatron_write` between
Megatron-LM's two formats, `write.megatron_moe` a Mixture-of-Experts run at another EP size,
`write.megatron_from_view` the way in from a Megatron-DeepSpeed pipeline or a torchtitan Llama), the optional parts
some have, and the choice of the writer for a source (`writer_for`): what `ckpt convert --to megatron` calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from ..view.megatron_core import needs_core_view, plan_needs_core_view
from . import megatron_from_view, megatron_moe, megatron_write


@runtime_checkable
class MegatronTarget(Protocol):
    """A writer of a Megatron-LM run folder (a module, or an object with these functions)."""

    def check(
        self, ck: Any, src: Path, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
    ) -> tuple[int | None, int | None]:
        """Refuse, in one line naming it, a source (or a TP / PP / EP size) this writer cannot write as Megatron's
        `ckpt_format` ("torch_dist" or "torch"); returns the (TP, PP) sizes the plan records (None: whole
        tensors, resharded at load)."""
        ...

    def plan_lines(
        self, ck: Any, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
    ) -> tuple[list[str], list[str]]:
        """(notes, not moved) of the conversion: the plan's lines this writer adds."""
        ...

    def write(self, plan: Any, root: Path, progress: Callable[[int], None] | None) -> int:
        """Write the planned run into the empty staging folder `root`, calling `progress(bytes)` as parameters
        are written; returns the bytes written."""
        ...


@runtime_checkable
class ExpertParallelTarget(MegatronTarget, Protocol):
    """A writer that takes `--ep` (`megatron_write`: a dense run has none; `megatron_moe`)."""

    def target_ep(self, ck: Any, ep: int | None) -> int | None:
        """The expert-parallel size the run is written at (None: a dense run; default: the saved one)."""
        ...


@runtime_checkable
class BuildsRun(MegatronTarget, Protocol):
    """A writer for a source that holds no Megatron-LM args or scheduler (`megatron_from_view`): it builds them."""

    def built_scheduler(self, ck: Any) -> dict[str, Any]:
        """The OptimizerParamScheduler state the plan records, built for the source."""
        ...

    def added(self) -> tuple[str, ...]:
        """What the written run holds that the source's view lacks (the logical diff reports it as added)."""
        ...


@runtime_checkable
class DistJobTarget(MegatronTarget, Protocol):
    """A writer whose torch_dist folder a torchrun job writes in shares."""

    def plan_dist(self, plan: Any, root: Path) -> tuple[Any, Callable[[Path], int]]:
        """(a `dcp_write.PlannedDcpWriter` holding the folder's items by unit, what writes the rest into `root`)."""
        ...


class _FromView:
    """`megatron_from_view` with the caller's check of TP replicas (`tp_drift`) bound into its `check`."""

    def __init__(self, tp_drift: megatron_from_view.TpDrift | None) -> None:
        self._tp_drift = tp_drift

    def check(self, ck, src: Path, ckpt_format: str = "torch_dist", tp=None, pp=None, ep=None):
        return megatron_from_view.check(ck, src, ckpt_format, tp, pp, ep, tp_drift=self._tp_drift)

    plan_lines = staticmethod(megatron_from_view.plan_lines)
    write = staticmethod(megatron_from_view.write)
    plan_dist = staticmethod(megatron_from_view.plan_dist)
    built_scheduler = staticmethod(megatron_from_view.built_scheduler)
    added = staticmethod(megatron_from_view.added)


def writer_for(source: Any, *, tp_drift: megatron_from_view.TpDrift | None = None) -> MegatronTarget:
    """The writer of a Megatron-LM run from `source` (a Checkpoint, or a plan: what it records of its source): the
    way in from a source read under Megatron-core names (`view.megatron_core.needs_core_view`), a Mixture-of-Experts
    run at another EP size, else between Megatron-LM's two formats. `tp_drift`: the TP-replica check the way in
    runs on a source saved at TP > 1."""
    if hasattr(source, "source_format"):  # a plan
        way_in = plan_needs_core_view(source.source_format, source.hf_config)
        moe = source.ep is not None
    else:
        way_in = needs_core_view(source)
        moe = not way_in and megatron_moe.is_moe(source)
    if way_in:
        return _FromView(tp_drift)
    return megatron_moe if moe else megatron_write
