"""What `ckpt convert` plans and returns (`ConvertPlan`, its `ParamItem`s, `ConvertResult`) and the targets it
knows: shared by `ops.convert` (plan, execute, verify) and the writers it runs (`ops.convert_writers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..write.shares import JobFigures

TARGETS = ("dcp", "torch", "deepspeed-universal", "megatron")
DCP_LAYOUTS = ("fsdp2", "torchtitan", "recipe")
#: tensors are written in this many dim-0 chunks (parameter i's chunk r in `__<r>_<i+1>.distcp`), as FSDP2 at DP=2
#: saves them; DCP reshards at load, so the output loads at any world size
DCP_SHARDS = 2
#: tree children the conversion moves (or reads to move); any other top-level child is reported as not moved
MOVED_CHILDREN = ("model", "optimizer", "scheduler", "counters")
#: param-group keys that are not hyper-parameters
_MEMBER_KEYS = ("params", "param_names")


@dataclass(frozen=True)
class ParamItem:
    """One model tensor and, for a trained parameter, its optimizer state."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "param" | "frozen" | "tied" | "buffer"
    weight: Any = field(repr=False, compare=False)  # LogicalTensor
    states: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # key -> LogicalTensor
    step: float | None = None  # the optimizer's step for this parameter (None: the optimizer keeps none)

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        size = {"float64": 8, "float32": 4, "int64": 8, "int32": 4}.get(self.dtype, 2)
        return n * size + sum(t.numel * 4 for t in self.states.values())


@dataclass(frozen=True)
class ConvertPlan:
    source: Path
    source_format: str
    out: Path
    to: str
    layout: str | None
    params: tuple[ParamItem, ...]
    groups: tuple[dict[str, Any], ...]  # hyper-parameters + "params": member names
    scheduler: dict[str, Any] | None  # the state dict written
    scheduler_class: str | None  # the torch class it belongs to (None: unknown / none)
    step: int | None
    notes: tuple[str, ...] = ()
    not_moved: tuple[str, ...] = ()
    #: what the target needs that the source did not record (`param_groups 0.initial_lr`): the logical diff
    #: reports these as added, and verification expects exactly that
    added: tuple[str, ...] = ()
    dp: int | None = None  # the source's data-parallel size (recorded in a universal checkpoint's model states)
    #: the model's KV heads (`--n-kv-heads`): splits a fused wqkv state read from the source; with the torchtitan
    #: layout, `fused` lists the (wqkv name, (wq, wk, wv names)) whose optimizer state is written fused
    n_kv_heads: int | None = None
    fused: tuple[tuple[str, tuple[str, str, str]], ...] = ()
    #: --to megatron: Megatron's checkpoint format written ("torch_dist" or "torch", the legacy rank files) and,
    #: for "torch", the tensor- and pipeline-parallel sizes of the rank files
    ckpt_format: str | None = None
    tp: int | None = None
    pp: int | None = None
    #: --to megatron from torchtitan: the model's Hugging Face config.json (`--hf-config`; the checkpoint holds no
    #: model config) and the sequence length the run trains with (`--seq-length`)
    hf_config: str | None = None
    seq_length: int | None = None
    #: --to megatron from torchtitan: its LR schedule's settings (`--lr-scheduler`; not in the checkpoint)
    lr_scheduler: str | None = None
    #: --to megatron from torchtitan: its decaying norms moved into a group without weight decay (`--drop-norm-decay`)
    drop_norm_decay: bool = False
    #: `--trust-pickles` let the source's globals outside the allowlist through: the output may carry them
    trust_pickles: bool = False
    #: --to megatron --ckpt-format torch of a Mixture-of-Experts run: the expert-parallel size of the rank files
    #: (`--ep`; None for a dense run); `groups` are then Megatron's param groups at that size (`megatron_moe`)
    ep: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def to_json(self) -> dict[str, Any]:
        state_keys = sorted({k for p in self.params for k in p.states})
        return {
            "source": str(self.source),
            "format": self.source_format,
            "out": str(self.out),
            "to": self.to,
            "layout": self.layout,
            "bytes": self.nbytes,
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "kind": p.kind,
                    "states": sorted(p.states) + (["step"] if p.step is not None else []),
                    "bytes": p.nbytes,
                }
                for p in self.params
            ],
            "optimizer_state": state_keys + (["step"] if any(p.step is not None for p in self.params) else []),
            "param_groups": [
                {k: _jsonable(v) for k, v in g.items() if k != "params"} | {"params": len(g["params"])}
                for g in self.groups
            ],
            "scheduler": self.scheduler_class,
            "scheduler_state": _jsonable(self.scheduler),
            "step": self.step,
            "notes": list(self.notes),
            "not_moved": list(self.not_moved),
            "n_kv_heads": self.n_kv_heads,
            "fused": {name: list(parts) for name, parts in self.fused},
            "ckpt_format": self.ckpt_format,
            "tp": self.tp,
            "pp": self.pp,
            "ep": self.ep,
            "hf_config": self.hf_config,
            "seq_length": self.seq_length,
            "lr_scheduler": self.lr_scheduler,
            "drop_norm_decay": self.drop_norm_decay,
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    return repr(v)


def step_tensor(value: float):
    """Adam's step as torch keeps it: a 0-d float32 tensor."""
    import torch  # lazy: torch only when a step is written; planning stays torch-free

    return torch.tensor(float(value), dtype=torch.float32)


@dataclass(frozen=True)
class ConvertResult(JobFigures):
    out: Path
    params: int
    bytes_written: int
    verified: bool
    problems: tuple[str, ...] = ()
