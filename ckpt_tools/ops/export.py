"""`ckpt export`: consolidated model weights as safetensors, from the fp32 master (like DeepSpeed's
zero_to_fp32) or from the module weights the checkpoint saved.

The file is written as a stream: the safetensors header is computed from the tree's shapes and dtypes
before any tensor is read, then each tensor is read (its ZeRO pieces / TP shards, `to_universal.read_tensor`)
and appended. Memory stays at one tensor, whatever the model size. Sharded output (`--max-shard-size`)
follows the Hugging Face convention: `<stem>-00001-of-0000N.safetensors` + `<stem>.safetensors.index.json`.
Every file is written under a `.ckpt-staging-` name in the target folder and renamed when complete.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import CkptError, UnsupportedCheckpoint
from ..tree import TensorNode

_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_SIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
         "uint8": 1, "bool": 1}
_DTYPE_ARG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", None: None}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000, '500MiB' -> 524_288_000, '1000' -> 1000 (Hugging Face's convention)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.I)
    if not m:
        raise ValueError(f"{text!r} is not a size (use e.g. 5GB, 500MB, 2GiB)")
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** " KMGT".index(m[2].upper() or " "))


@dataclass(frozen=True)
class ExportTensor:
    name: str
    node: TensorNode = field(repr=False)
    shape: tuple[int, ...]
    dtype: str  # output dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _SIZE[self.dtype]


@dataclass(frozen=True)
class ExportPlan:
    """The files `execute` writes: `shards[i]` is the list of tensors of file `files[i]`."""

    source: Path
    out: Path
    weights_from: str
    files: tuple[Path, ...]
    shards: tuple[tuple[ExportTensor, ...], ...]
    index: Path | None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for s in self.shards for t in s)

    def to_json(self) -> dict[str, Any]:
        return {"source": str(self.source), "out": str(self.out), "weights_from": self.weights_from,
                "bytes": self.nbytes, "index": str(self.index) if self.index else None,
                "files": [{"path": str(f), "tensors": len(s), "bytes": sum(t.nbytes for t in s)}
                          for f, s in zip(self.files, self.shards)]}


def plan_export(source: str | os.PathLike, out: str | os.PathLike, *, dtype: str | None = None,
                max_shard_size: int | None = None, source_weights: str = "fp32",
                tp_layout: str | None = None, patterns: Sequence[str] = ()) -> ExportPlan:
    """Which tensors go into which file. `source_weights`: "fp32" (the optimizer's fp32 master, the same
    values zero_to_fp32 writes) or "module" (the saved module weights, e.g. bf16)."""
    from .to_universal import _open_source

    if source_weights not in ("fp32", "module"):
        raise ValueError(f"--source {source_weights!r}: use fp32 or module")
    if dtype not in _DTYPE_ARG:
        raise ValueError(f"--dtype {dtype!r}: use fp32, bf16 or fp16")
    src = Path(source)
    ck, _, kind = _open_source(src, patterns)
    if kind == "pipeline" and (ck.topology.tp or 1) > 1 and "universal_checkpoint_info" not in ck.tree.children \
            and tp_layout != "megatron" and not patterns:
        raise UnsupportedCheckpoint("tensor-parallel checkpoint without universal_checkpoint_info", path=src,
                                    hint="pass --tp-layout megatron or --pattern REGEX=MERGE")
    state = ck.optimizer.children.get("state")
    tensors: list[ExportTensor] = []
    for name, node in ck.model.children.items():
        if not isinstance(node, TensorNode):
            continue
        if source_weights == "fp32" and state is not None and name in state.children \
                and isinstance(state.children[name].children.get("fp32"), TensorNode):
            node = state.children[name].children["fp32"]
        if node.shards and node.merge not in ("replicated",) and not (node.merge or "").startswith("cat:"):
            raise UnsupportedCheckpoint(f"no TP merge rule for {name}", path=src,
                                        hint="pass --pattern REGEX=MERGE for it")
        tensors.append(ExportTensor(name, node, tuple(node.shape), _DTYPE_ARG[dtype] or node.dtype))
    if not tensors:
        raise UnsupportedCheckpoint("no model tensors found", path=src)
    out = Path(out)
    groups: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        if max_shard_size and groups[-1] and size + t.nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) == 1:
        files, index = (out,), None
    else:
        stem = out.name[: -len(".safetensors")] if out.name.endswith(".safetensors") else out.name
        files = tuple(out.parent / f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups)))
        index = out.parent / f"{stem}.safetensors.index.json"
    return ExportPlan(src, out, "fp32 master" if source_weights == "fp32" else "module weights", files,
                      tuple(tuple(g) for g in groups), index)


def _header(tensors: Sequence[ExportTensor], metadata: dict[str, str]) -> bytes:
    head: dict[str, Any] = {"__metadata__": metadata}
    off = 0
    for t in tensors:
        head[t.name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


def _write_file(path: Path, tensors: Sequence[ExportTensor], progress: Callable[[int], None] | None) -> None:
    import torch

    from .to_universal import _Fds, _merged_read

    fds = _Fds()
    tmp = path.parent / f".ckpt-staging-{path.name}-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(_header(tensors, {"format": "pt"}))
            for t in tensors:
                x = _merged_read(t.node, fds)
                want = getattr(torch, t.dtype)
                if x.dtype != want:
                    x = x.to(want)
                fh.write(x.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b"")
                if progress:
                    progress(t.nbytes)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        fds.close()


@dataclass(frozen=True)
class ExportResult:
    files: tuple[Path, ...]
    index: Path | None
    tensors: int
    bytes: int


def execute(plan: ExportPlan, *, progress: Callable[[int], None] | None = None) -> ExportResult:
    """Write the planned safetensors file(s) (and index); refuses to overwrite existing files."""
    for f in (*plan.files, *([plan.index] if plan.index else [])):
        if f.exists():
            raise CkptError("output file already exists", path=f, hint="choose a new path or remove it first")
    plan.out.parent.mkdir(parents=True, exist_ok=True)
    for f, tensors in zip(plan.files, plan.shards):
        _write_file(f, tensors, progress)
    if plan.index:
        doc = {"metadata": {"total_size": plan.nbytes},
               "weight_map": {t.name: f.name for f, s in zip(plan.files, plan.shards) for t in s}}
        tmp = plan.index.parent / f".ckpt-staging-{plan.index.name}"
        tmp.write_text(json.dumps(doc, indent=2))
        os.replace(tmp, plan.index)
    return ExportResult(plan.files, plan.index, sum(len(s) for s in plan.shards), plan.nbytes)
