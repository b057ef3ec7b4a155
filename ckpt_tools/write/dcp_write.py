"""Replace a few items of a torch distributed checkpoint (DCP) folder: new `.distcp` files and a new `.metadata`.

Every DCP item (a tensor chunk, or a pickled Python value) is its own small torch.save zip inside a
`.distcp` file, found through `.metadata`'s `storage_data[MetadataIndex] -> _StorageInfo(relative_path,
offset, length)`. A changed value is a new blob whose length may differ from the old one, so every item
after it in the same file moves: the file is rewritten (unchanged items and any bytes between them copied
as they are, in their order; new blobs in place of the changed ones) and `.metadata` is re-pickled with
the moved items' offsets and lengths (`pickle_writer.dumps` of the inert tree the safe reader produced:
nothing from the checkpoint is imported or run). When no offset or length changes, `.metadata` is left
alone.

In O(changed bytes) (`append`, what set-lr / set-step use): each new blob is appended to its `.distcp` file in
place (journaled by io.execute; the old blob stays as dead bytes no reader visits), and `.metadata` — small —
is re-pickled with the appended items' offsets and lengths and replaced atomically in the same transaction.

Order of use: `DcpFolder(root)` (reads `.metadata`) -> `value(key)` / `tensor(key)` / `state_tree(...)`
to find what to edit -> `append({key: new blob})` (or `rewrite(...)`: whole files, items moved) -> the
`(relative path, nbytes, produce[, edit])` tuples that go into one `io.WritePlan`, so that the `.distcp` files
and `.metadata` are changed (and rolled back) together. `read_item(root, key)` re-reads one item for
verification.
"""

from __future__ import annotations

import hashlib
import io as _io
import json
import os
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, UnsupportedCheckpoint
from ..formats.dcp import METADATA, DcpItems, Item
from ..read.pickle_reader import TensorRef
from ..view.logical import torch_dtype
from .io import ByteEdit, InPlace, copy_file, copy_range
from .pickle_writer import dumps
from .torch_zip import own_storage, plan_save

#: the only value types written as new bytes items (our own plain values, never objects from the file)
_PLAIN = (bool, int, float, str, type(None))


class DcpFolder(DcpItems):
    """A DCP folder's items (`formats.dcp.DcpItems`), and the files that replace or add some of them."""

    # --- writing ----------------------------------------------------------------------------------------

    def rewrite(self, blobs: dict[str, bytes]) -> list[tuple[str, int, Callable[[Path], None]]]:
        """The files to write so that each flat key in `blobs` holds the new blob: `(rel, nbytes, produce)`
        for every `.distcp` file holding a changed item, then `.metadata` when an item moved or resized."""
        changed = {self.item(k).rel for k in blobs}
        out = []
        moved = False
        for rel in sorted(changed):
            items = sorted((it for it in self.items.values() if it.rel == rel), key=lambda it: it.offset)
            size = (self.root / rel).stat().st_size
            segments: list[tuple[str, Any]] = []  # ("copy", (src_off, n)) | ("blob", bytes)
            cursor = pos = 0
            for it in items:
                if it.offset < cursor or it.offset + it.length > size:
                    raise CorruptCheckpoint(
                        f"{it.key}: item at {rel}[{it.offset}:{it.offset + it.length}] "
                        "overlaps another or lies outside the file",
                        path=self.root / rel,
                    )
                if it.offset > cursor:
                    segments.append(("copy", (cursor, it.offset - cursor)))
                    pos += it.offset - cursor
                new = blobs.get(it.key) if not it.is_tensor or it.offsets == () else None
                if new is None:
                    segments.append(("copy", (it.offset, it.length)))
                    n = it.length
                else:
                    segments.append(("blob", new))
                    n = len(new)
                if (pos, n) != (it.offset, it.length):
                    moved = True
                    it.info.state = {**it.info.state, "offset": pos, "length": n}
                pos += n
                cursor = it.offset + it.length
            if cursor < size:
                segments.append(("copy", (cursor, size - cursor)))
                pos += size - cursor
            out.append((rel, pos, _producer(self.root / rel, segments)))
        if moved:
            data = dumps(self.meta)
            out.append((METADATA, len(data), lambda tmp, data=data: Path(tmp).write_bytes(data)))
        return out

    def append(self, blobs: dict[str, bytes]) -> list[tuple[str, int, Callable[[Path], None], Any]]:
        """The files to write so that each flat key in `blobs` holds the new blob, in O(changed bytes): every
        new blob is APPENDED to the `.distcp` file holding its item (the old bytes stay, dead: no reader visits
        a byte `.metadata` does not point at), and `.metadata` is re-pickled with those items' new offsets and
        lengths. `(rel, nbytes, produce, edit)` for each `.distcp` file — `edit(path)` the in-place form
        (`io.InPlace`: the blobs at the file's old end), `produce(tmp)` the same bytes as a whole new file —
        then `(".metadata", nbytes, produce, None)`: always replaced whole (small), atomically, in the same
        transaction."""
        by_file: dict[str, list[tuple[Item, bytes]]] = {}
        for key, blob in blobs.items():
            it = self.item(key)
            if it.is_tensor and it.offsets != ():
                raise UnsupportedCheckpoint(f"{key}: only whole 0-d tensor items can be replaced", path=self.root)
            by_file.setdefault(it.rel, []).append((it, bytes(blob)))
        out: list[tuple[str, int, Callable[[Path], None], Any]] = []
        for rel in sorted(by_file):
            size = (self.root / rel).stat().st_size
            tail, pos = [], size
            for it, blob in sorted(by_file[rel], key=lambda x: x[0].offset):
                it.info.state = {**it.info.state, "offset": pos, "length": len(blob)}
                tail.append(blob)
                pos += len(blob)
            data = b"".join(tail)

            def edit(path: Path, size=size, data=data, rel=rel) -> InPlace:
                now = Path(path).stat().st_size
                if now != size:
                    raise CorruptCheckpoint(
                        f"{rel} is {now} bytes, it was {size} when planned",
                        path=path,
                        hint="the checkpoint changed since it was read; run the command again",
                    )
                return InPlace((ByteEdit(size, data),), size + len(data))

            def produce(tmp: Path, src=self.root / rel, size=size, data=data) -> None:
                copy_file(src, tmp)
                with open(tmp, "r+b") as fh:
                    fh.truncate(size)
                    fh.seek(size)
                    fh.write(data)

            out.append((rel, pos, produce, edit))
        meta = dumps(self.meta)
        out.append((METADATA, len(meta), lambda tmp, meta=meta: Path(tmp).write_bytes(meta), None))
        return out


def _producer(src: Path, segments: list[tuple[str, Any]]) -> Callable[[Path], None]:
    def produce(tmp: Path) -> None:
        sfd = os.open(src, os.O_RDONLY)
        try:
            dfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                pos = 0
                for kind, what in segments:
                    if kind == "copy":
                        off, n = what
                        copy_range(sfd, dfd, off, pos, n)
                    else:
                        n = os.pwrite(dfd, what, pos)
                        if n != len(what):
                            raise OSError(f"short write to {tmp}")
                    pos += n
                os.ftruncate(dfd, pos)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    return produce


def value_blob(value: Any) -> bytes:
    """A bytes item as DCP writes it (`torch.save` of the value), for one of our own plain values."""
    import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

    if not _is_plain(value):
        raise UnsupportedCheckpoint(f"refusing to write {type(value).__name__} value {value!r} as a DCP item")
    buf = _io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def tensor_blob(dtype: str, value: float) -> bytes:
    """A 0-d tensor item as DCP writes it (`torch.save` of the tensor)."""
    import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

    buf = _io.BytesIO()
    torch.save(torch.tensor(value, dtype=getattr(torch, dtype)), buf)
    return buf.getvalue()


def _is_plain(v: Any, depth: int = 0) -> bool:
    if isinstance(v, _PLAIN) and type(v) in _PLAIN:
        return True
    if isinstance(v, (list, tuple)) and type(v) in (list, tuple) and depth < 8:
        return all(_is_plain(x, depth + 1) for x in v)
    if type(v) is dict and depth < 8:  # a pickled object of plain values (Megatron's sharded param groups)
        return all(type(k) in (str, int) and _is_plain(x, depth + 1) for k, x in v.items())
    return False


def read_item(root: Path, key: str) -> Any:
    """Re-read one item (a bytes item's value, or a 0-d tensor's value) through `.metadata`: for verify."""
    folder = DcpFolder(root)
    it = folder.item(key)
    obj = folder._load(it)
    return obj.item() if isinstance(obj, TensorRef) else obj


# --- writing a new DCP folder, one item at a time (`ckpt convert --to dcp`) ---------------------------------


class DcpStreamWriter:
    """Write a new torch.distributed.checkpoint folder item by item, as `dcp.save` lays it out: every item a
    `torch.save` blob appended to a `__<r>_0.distcp` file; with `shards=N` every tensor of N rows or more is
    cut into N dim-0 chunks, chunk r in `__<r>_0.distcp` (what an FSDP2 run at DP=N saves; DCP reshards at
    load, so any N loads at any world size), smaller tensors and values whole in `__0_0.distcp` (with `unit=U`,
    one piece of an output written piece by piece, by one process or many: `__<r>_<U>.distcp`, DCP's name for
    the U-th file of rank r; a file left empty is removed by `finish`); then
    `.metadata` (a `Metadata` with `planner_data` mapping each flat key to its state-dict path, the way
    `flatten_state_dict` does). Only the item being written is in memory, so a model of any size streams.

    Order of use: `w = DcpStreamWriter(folder)`; `w.tensor(path, t)` / `w.value(path, v)` for each leaf
    (`path`: the tuple of keys in the nested state dict, e.g. ("optim", "state", "wte.weight", "exp_avg"),
    list positions as ints); `w.close()` writes `.metadata`. `flatten_paths(obj)` yields the leaves of a
    nested dict the way DCP flattens it (lists of plain values are one value)."""

    def __init__(
        self,
        folder: Path,
        checkpoint_id: str | None = None,
        shards: int = 1,
        unit: int = 0,
        save_id: str | None = None,
    ):
        self.folder = Path(folder)
        self.save_id = save_id
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shards = max(1, int(shards))
        self._names = [f"__{i}_{unit}.distcp" for i in range(self.shards)]
        self._fhs = [open(self.folder / n, "wb") for n in self._names]
        self._fh = self._fhs[0]
        self._sdm: dict[str, Any] = {}
        self._storage: dict[Any, Any] = {}
        self._planner: dict[str, tuple] = {}
        self._checkpoint_id = checkpoint_id
        self.bytes_written = 0

    @staticmethod
    def flat_key(path: tuple) -> str:
        return ".".join(str(p) for p in path)

    def _claim(self, path: tuple) -> str:
        key = self.flat_key(path)
        if key in self._sdm:
            raise ValueError(f"{key}: written twice")
        self._planner[key] = tuple(path)
        return key

    def _append(self, blob_writer: Callable[[Any], None], shard: int = 0, lazy: Any = None) -> tuple[int, int]:
        fh = self._fhs[shard]
        start = fh.tell()
        blob_writer(fh)
        end = fh.tell()
        self.bytes_written += end - start
        return start, end - start

    def tensor(self, path: tuple, t: Any) -> None:
        """A whole tensor, in `shards` dim-0 chunks (one per file, as FSDP2 at that DP size saves it)."""
        if self.flat_key(path) in self._sdm:
            raise ValueError(f"{self.flat_key(path)}: written twice")
        t = t.detach().cpu()
        n = self.shards if t.dim() >= 1 and t.shape[0] >= self.shards else 1
        if n == 1:
            self.tensor_part(path, tuple(t.shape), (0,) * t.dim(), t)
            return
        rows = -(-t.shape[0] // n)
        for r in range(n):
            part = t[r * rows : (r + 1) * rows]
            if part.numel():
                self.tensor_part(path, tuple(t.shape), (r * rows,) + (0,) * (t.dim() - 1), part)

    def tensor_part(self, path: tuple, size: tuple[int, ...], offsets: tuple[int, ...], part: Any) -> None:
        """One chunk of a global tensor of shape `size` at `offsets` (Megatron's layers stacked on a leading axis:
        layer i at (i, 0, ...)); the chunks of one key are written by successive calls, chunk i into
        `__<i % shards>_0.distcp`, and must tile the tensor (DCP reads any region from them). `part`: a tensor, or
        a `LazyPart` (read here; `PlannedDcpWriter` plans it without reading it)."""
        import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

        if isinstance(part, LazyPart):
            part = part.make()
        part = own_storage(part)
        self._chunk(path, size, offsets, tuple(part.shape), part.dtype, lambda fh: torch.save(part, fh), None)

    def _chunk(
        self,
        path: tuple,
        size: tuple[int, ...],
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        dtype: Any,
        blob_writer: Callable[[Any], Any],
        lazy: LazyPart | None,
    ) -> None:
        """The metadata of one tensor chunk, its blob appended (`_append`)."""
        import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

        # lazy: torch only when a DCP is written; write/ stays torch-free at import
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (  # lazy: torch.distributed only when a DCP is written
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
            TensorStorageMetadata,
        )

        key = self.flat_key(path)
        meta = self._sdm.get(key)
        if meta is None:
            self._claim(path)
            meta = self._sdm[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size), [])
        elif (
            not isinstance(meta, TensorStorageMetadata)
            or tuple(meta.size) != tuple(size)
            or meta.properties.dtype != dtype
        ):
            raise ValueError(f"{key}: a part of another shape or dtype than the tensor's first part")
        if len(offsets) != len(size) or any(o < 0 or o + n > s for o, n, s in zip(offsets, shape, size)):
            raise ValueError(f"{key}: part {tuple(shape)} at {tuple(offsets)} lies outside {tuple(size)}")
        f = len(meta.chunks) % len(self._fhs)
        off, n = self._append(blob_writer, f, lazy)
        meta.chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(shape)))
        self._storage[MetadataIndex(key, torch.Size(offsets), len(meta.chunks) - 1)] = _StorageInfo(
            self._names[f], off, n
        )

    def value_blob(self, path: tuple, blob: bytes) -> None:
        """A bytes item whose torch.save bytes are already made (an object read inert from another checkpoint and
        written back by `pickle_writer.rewrite_torch_zip`: nothing is unpickled to write it)."""
        # lazy: torch only when a DCP is written; write/ stays torch-free at import
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        # lazy: torch.distributed only when a DCP is written
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        key = self._claim(path)
        off, n = self._append(lambda fh: fh.write(blob))
        self._sdm[key] = BytesStorageMetadata()
        self._storage[MetadataIndex(key)] = _StorageInfo(self._names[0], off, n)

    def value(self, path: tuple, v: Any) -> None:
        import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

        # lazy: torch only when a DCP is written; write/ stays torch-free at import
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        # lazy: torch.distributed only when a DCP is written
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

        key = self._claim(path)
        buf = _io.BytesIO()
        torch.save(v, buf)
        off, n = self._append(lambda fh: fh.write(buf.getbuffer()))
        self._sdm[key] = BytesStorageMetadata()
        self._storage[MetadataIndex(key)] = _StorageInfo(self._names[0], off, n)

    def finish(self) -> tuple[dict, dict, dict]:
        """Close the data files; this writer's (state_dict_metadata, storage_data, planner_data) for
        `write_metadata` (several writers' parts merge into one `.metadata`). Not fsynced here: every writer
        writes into a staging folder that `io.put_in_place` fsyncs file by file before the rename (a second fsync
        of each of a conversion's thousand files costs seconds on a VM)."""
        for fh, name in zip(self._fhs, self._names):
            fh.flush()
            empty = fh.tell() == 0
            fh.close()
            if empty:  # no item in it: a reader would report an unreferenced file
                (self.folder / name).unlink()
        return self._sdm, self._storage, self._planner

    def files(self) -> list[str]:
        """The data files this writer wrote items into (after `finish`: those it kept)."""
        return [n for n in self._names if (self.folder / n).is_file()]

    def close(self) -> Path:
        return write_metadata(self.folder, [self.finish()], self._checkpoint_id, self.save_id)

    def abort(self) -> None:
        for fh in self._fhs:
            if not fh.closed:
                fh.close()


@dataclass(frozen=True)
class LazyPart:
    """A tensor chunk known by its shape and dtype, read when it is written (`make()`); `unit`: the piece of a
    job's output it belongs to (None: what the rank that finishes the job writes)."""

    shape: tuple[int, ...]
    dtype: Any  # torch.dtype
    make: Callable[[], Any]
    unit: Any = None


def lazy_part(t: Any, dtype: Any = None, *, unit: Any = None, layer: bool = False) -> LazyPart:
    """The logical tensor `t` (`view.logical.LogicalTensor`) read as `dtype` (None: as stored), as a `LazyPart`;
    `layer`: with a leading axis of 1 (one layer of Megatron's layers stacked on a leading axis)."""
    want = torch_dtype(dtype or t.dtype)
    shape = ((1,) if layer else ()) + tuple(t.shape)

    def make():
        v = t.read(dtype)
        return v.unsqueeze(0) if layer else v

    return LazyPart(shape, want, make, unit)


@dataclass(frozen=True)
class PlannedItem:
    """Where one item of a `PlannedDcpWriter` goes: its file (from the writer's folder), offset and length; its
    blob (a value's, made when planned) or its `LazyPart` (a tensor chunk's, read by the rank that writes it)."""

    file: str
    offset: int
    length: int
    blob: bytes | None
    part: LazyPart | None

    @property
    def unit(self) -> Any:
        return self.part.unit if self.part is not None else None


class PlannedDcpWriter(DcpStreamWriter):
    """`DcpStreamWriter`'s items planned, not written: given the same calls in the same order, each item's file,
    offset and length (a tensor chunk's from its shape and dtype alone: the size of torch.save's file for it,
    `torch_zip.plan_save` of an empty tensor; a value's blob made now), and the same `.metadata`. So the ranks of a
    torchrun job write one DCP folder, each the items of its units at their offsets (`write_unit`), one rank the
    rest and `.metadata` (`write_rest`): the bytes one process writes."""

    def __init__(self, folder: Path, checkpoint_id: str | None = None, shards: int = 1, save_id: str | None = None):
        self.folder = Path(folder)
        self.save_id = save_id
        self.shards = max(1, int(shards))
        self._names = [f"__{i}_0.distcp" for i in range(self.shards)]
        self._fhs: list[Any] = [None] * self.shards  # nothing is opened while planning
        self._sdm: dict[str, Any] = {}
        self._storage: dict[Any, Any] = {}
        self._planner: dict[str, tuple] = {}
        self._checkpoint_id = checkpoint_id
        self.bytes_written = 0
        self.items: list[PlannedItem] = []
        self.sizes = [0] * self.shards
        self._blob_sizes: dict[tuple, int] = {}

    def tensor_part(self, path: tuple, size: tuple[int, ...], offsets: tuple[int, ...], part: Any) -> None:
        if not isinstance(part, LazyPart):
            t = own_storage(part)
            part = LazyPart(tuple(t.shape), t.dtype, lambda t=t: t)
        self._chunk(path, size, offsets, tuple(part.shape), part.dtype, None, part)

    def _append(self, blob_writer: Callable[[Any], None] | None, shard: int = 0, lazy: Any = None) -> tuple[int, int]:
        blob = None
        if lazy is None:
            buf = _io.BytesIO()
            blob_writer(buf)
            blob = buf.getvalue()
            n = len(blob)
        else:
            n = self._blob_size(tuple(lazy.shape), lazy.dtype)
        at = self.sizes[shard]
        self.items.append(PlannedItem(self._names[shard], at, n, blob, lazy))
        self.sizes[shard] += n
        self.bytes_written += n
        return at, n

    def _blob_size(self, shape: tuple[int, ...], dtype: Any) -> int:
        """The length of torch.save's file of a contiguous tensor of this shape and dtype (written to a stream:
        its records under `archive/`)."""
        import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

        key = (shape, dtype)
        if key not in self._blob_sizes:
            self._blob_sizes[key] = plan_save(torch.empty(shape, dtype=dtype), "archive").size
        return self._blob_sizes[key]

    def units(self) -> dict[Any, int]:
        """The units the planned tensor chunks belong to, in the order first met, with their chunks' bytes."""
        out: dict[Any, int] = {}
        for it in self.items:
            if it.unit is not None:
                out[it.unit] = out.get(it.unit, 0) + it.length
        return out

    def _open(self) -> dict[str, int]:
        """The data files that hold an item, opened for writing and grown to their planned size (only grown: the
        other ranks' items stay)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        fds = {}
        for name, size in zip(self._names, self.sizes):
            if size:
                fd = fds[name] = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT, 0o644)
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, size)
        return fds

    def write_units(self, units: list[Any], done: Callable[[Any, list[tuple[str, int, int]]], None]) -> int:
        """Write the tensor chunks of each of `units` at their planned offsets (one chunk in memory at a time),
        calling `done(unit, spans)` after each unit's ((file from the writer's folder, offset, length) of its
        chunks); the files are fsynced at the end. Returns the bytes written."""
        import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

        by: dict[Any, list[PlannedItem]] = {}
        for it in self.items:
            if it.part is not None and it.unit is not None:
                by.setdefault(it.unit, []).append(it)
        fds, n = self._open(), 0
        try:
            for unit in units:
                spans = []
                for it in by.get(unit, []):
                    t = own_storage(it.part.make())
                    if t.dtype != it.part.dtype or tuple(t.shape) != tuple(it.part.shape):
                        raise ValueError(
                            f"a chunk of {unit}: read as {t.dtype} {tuple(t.shape)}, planned as {it.part.dtype} "
                            f"{tuple(it.part.shape)}"
                        )
                    buf = _io.BytesIO()
                    torch.save(t, buf)
                    if buf.tell() != it.length:
                        raise ValueError(f"a chunk of {unit}: {buf.tell()} bytes, planned {it.length}")
                    _pwrite(fds[it.file], buf.getbuffer(), it.offset)
                    spans.append((it.file, it.offset, it.length))
                    n += it.length
                done(unit, spans)
            for fd in fds.values():
                os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)
        return n

    def write_rest(self) -> Path:
        """Write the items of no unit (the values, and tensor chunks without a unit) at their offsets and
        `.metadata`; the units' chunks must all be written by then."""
        fds = self._open()
        try:
            for it in self.items:
                if it.unit is not None:
                    continue
                if it.blob is None:  # a tensor chunk of no unit: read now
                    import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

                    buf = _io.BytesIO()
                    torch.save(own_storage(it.part.make()), buf)
                    blob = buf.getvalue()
                else:
                    blob = it.blob
                if len(blob) != it.length:
                    raise ValueError(f"an item of {it.file}: {len(blob)} bytes, planned {it.length}")
                _pwrite(fds[it.file], memoryview(blob), it.offset)
        finally:
            for fd in fds.values():
                os.close(fd)
        return write_metadata(
            self.folder, [(self._sdm, self._storage, self._planner)], self._checkpoint_id, self.save_id
        )

    def finish(self) -> tuple[dict, dict, dict]:
        return self._sdm, self._storage, self._planner

    def abort(self) -> None:
        pass


def _pwrite(fd: int, data: Any, at: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], at + done)


def plan_digest(plan: Any) -> str:
    """What identifies a conversion plan's output (`ops.convert.ConvertPlan`): a job's staging folder is resumed
    only by the same plan, and its DCP `.metadata` save_id is made from it (`plan_save_id`)."""
    return hashlib.sha256(
        json.dumps([str(plan.source), plan.to_json()], sort_keys=True, default=str).encode()
    ).hexdigest()


def plan_save_id(plan: Any) -> str:
    """The save_id of the `.metadata` a conversion writes: made from OUT and the plan, so that the same output has
    the same bytes whatever wrote it (one process or the ranks of a job)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"{plan.out}#{plan_digest(plan)}"))


def part_to_json(part: tuple[dict, dict, dict]) -> dict[str, Any]:
    """A `finish()` part of tensor items as JSON (journaled with the piece that wrote them; `part_from_json`)."""
    sdm, storage, planner = part
    tensors = []
    for key, meta in sdm.items():
        chunks = [[list(c.offsets), list(c.sizes)] for c in meta.chunks]
        tensors.append([key, str(meta.properties.dtype).removeprefix("torch."), list(meta.size), chunks])
    where = [[i.fqn, list(i.offset), i.index, st.relative_path, st.offset, st.length] for i, st in storage.items()]
    return {"tensors": tensors, "storage": where, "planner": {k: list(v) for k, v in planner.items()}}


def part_from_json(doc: dict[str, Any]) -> tuple[dict, dict, dict]:
    """The inverse of `part_to_json`."""
    import torch  # lazy: torch only when a DCP is written; write/ stays torch-free at import

    # lazy: torch only when a DCP is written; write/ stays torch-free at import
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (  # lazy: torch.distributed only when a DCP is written
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sdm = {
        key: TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, dtype)),
            torch.Size(size),
            [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n in chunks],
        )
        for key, dtype, size, chunks in doc["tensors"]
    }
    storage = {
        MetadataIndex(fqn, torch.Size(offset), index): _StorageInfo(rel, off, n)
        for fqn, offset, index, rel, off, n in doc["storage"]
    }
    return sdm, storage, {k: tuple(v) for k, v in doc["planner"].items()}


def write_metadata(
    folder: Path, parts: list[tuple[dict, dict, dict]], checkpoint_id: str | None = None, save_id: str | None = None
) -> Path:
    """`.metadata` for the items that one or more `DcpStreamWriter`s wrote into `folder` (`finish()` of each), in
    the order of `parts`. `save_id`: the same for the same output (a random one, as `dcp.save` makes, when None)."""
    # lazy: torch only when a DCP is written; write/ stays torch-free at import
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    sdm: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    planner: dict[str, tuple] = {}
    for s_, st, pl in parts:
        dup = set(sdm) & set(s_)
        if dup:
            raise ValueError(f"{sorted(dup)[:3]}: written by two writers")
        sdm.update(s_)
        storage.update(st)
        planner.update(pl)
    md = Metadata(
        state_dict_metadata=sdm,
        planner_data=planner,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id or str(uuid.uuid4())),
        version="1.0.0",
    )
    path = Path(folder) / METADATA
    with open(path, "wb") as fh:
        pickle.dump(md, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return path


def flatten_paths(obj: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) for a nested state dict, as DCP's `traverse_state_dict` cuts it: dicts are walked (keys
    as str), a list or tuple is walked when it holds a dict somewhere (else it is one value), anything else
    is a leaf."""
    out: list[tuple[tuple, Any]] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.extend(flatten_paths(v, prefix + (str(k),)))
    elif isinstance(obj, (list, tuple)) and not _terminal(obj):
        for i, v in enumerate(obj):
            out.extend(flatten_paths(v, prefix + (i,)))
    else:
        out.append((prefix, obj))
    return out


def _terminal(value: Any) -> bool:
    for x in value:
        if isinstance(x, dict) or (isinstance(x, (list, tuple)) and not _terminal(x)):
            return False
    return True
