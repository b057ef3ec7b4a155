"""Reading one tensor of the tree: a node's pieces preadv'd into one buffer (`read_tensor`), the file ranges that
hold its bytes as they are, for a raw copy (`source_ranges`), and a TP-sharded node merged by its reader's rule
(`merged_read`). The operations (to-universal, export, convert) and the logical view read through here."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CkptError
from .pickle_reader import DTYPE_SIZE, FdCache
from .tp_layout import merge_shards
from .tree import TensorNode

#: the tree's float dtype names, as torch names them
_TORCH_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}

_FDS = FdCache()


@dataclass(frozen=True)
class FileRange:
    """`length` bytes at `offset` of the open file `fd` (read with pread: the fd may be shared by threads)."""

    fd: int
    offset: int
    length: int


def read_tensor(node: TensorNode, fds: FdCache | None = None):
    """The logical tensor of a node without TP shards, its pieces preadv'd into one buffer."""
    import torch  # lazy: torch only when a tensor is read; read/ is the torch-free core

    if node.shards:
        raise ValueError("read the shards one by one")
    fds = fds or _FDS
    out = torch.empty(node.numel, dtype=getattr(torch, _TORCH_DTYPES.get(node.dtype, node.dtype)))
    raw = out.view(torch.uint8).numpy() if node.numel else None
    for p in node.pieces:
        ref = p.ref
        esize = DTYPE_SIZE[ref.dtype]
        src = ref.storage.source if ref.storage is not None else None
        if src is None or not ref.is_contiguous or not hasattr(src, "storage_offset") or ref.dtype != node.dtype:
            out[p.dst_offset : p.dst_offset + p.numel] = ref.read_torch(p.src_offset, p.numel).view(-1).to(out.dtype)
            continue
        ref.read_into(
            memoryview(raw)[p.dst_offset * esize : (p.dst_offset + p.numel) * esize], p.src_offset, p.numel, fds
        )
    return out.view(node.shape)


def source_ranges(node: TensorNode, fds: FdCache):
    """The file ranges (`FileRange`) that hold a node's bytes, in element order, when they can be
    copied as they are: no TP shards, and every piece a contiguous run of a stored tensor of the node's own
    dtype whose file offset is known. None otherwise (read it with `read_tensor`). Adjacent ranges merge."""
    if node.shards or node.dtype not in DTYPE_SIZE:
        return None
    esize = DTYPE_SIZE[node.dtype]
    ranges: list[FileRange] = []
    at = 0
    for p in sorted(node.pieces, key=lambda p: p.dst_offset):
        ref = p.ref
        src = ref.storage.source if ref.storage is not None else None
        if (
            src is None
            or p.dst_offset != at
            or ref.dtype != node.dtype
            or not ref.is_contiguous
            or p.src_offset < 0
            or p.src_offset + p.numel > ref.numel
            or ref.storage_offset + ref.numel > ref.storage.numel
        ):
            return None
        try:
            base = src.storage_offset(ref.storage)
        except (NotImplementedError, KeyError):
            return None
        offset, length = base + (ref.storage_offset + p.src_offset) * esize, p.numel * esize
        if offset + length > fds.size(src.path):
            raise CkptError("file ended inside a tensor", path=src.path, hint="the file is truncated; re-copy it")
        fd = fds.get(src.path)
        if ranges and ranges[-1].fd == fd and ranges[-1].offset + ranges[-1].length == offset:
            ranges[-1] = FileRange(fd, ranges[-1].offset, ranges[-1].length + length)
        elif length:
            ranges.append(FileRange(fd, offset, length))
        at += p.numel
    return ranges if at == node.numel else None


def merged_read(node: TensorNode, fds: FdCache | None = None):
    """A node's logical tensor, TP shards merged by the reader's rule (`node.merge`)."""
    if not node.shards:
        return read_tensor(node, fds)
    parts = [read_tensor(s, fds) for s in node.shards]
    if node.merge in (None, "unknown"):
        raise ValueError("unknown TP merge rule")
    return merge_shards(node.merge, parts)
