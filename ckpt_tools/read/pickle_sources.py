"""Where a checkpoint's bytes are: `Source` and its kinds (a torch.save zip, one embedded in a bigger file, a legacy
torch file), and the torch.save zip layout read from an embedded zip's head alone (local headers, data descriptors,
the heads seen last).
"""

from __future__ import annotations

import collections
import io
import mmap
import os
import struct
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable

from . import allowlist, remote
from ..errors import CorruptCheckpoint
from .pickle_records import StorageRef, TensorRef


class Source:
    """An opened checkpoint file. Holds the mmap; `read_storage` returns a view of a storage's bytes."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        self._fh = None
        self._lock = threading.Lock()

    def _map(self) -> mmap.mmap:
        """The file's mapping, made once. Thread-safe: to-universal's worker threads share Sources, and two first
        calls racing used to replace each other's file object, closing the descriptor the other was mapping
        ("OSError: [Errno 9] Bad file descriptor", seen once in a full run)."""
        mm = self._mm
        if mm is not None:
            return mm
        with self._lock:
            if self._mm is None:
                fh = open(self.path, "rb")
                try:
                    self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
                except ValueError:  # empty file
                    fh.close()
                    raise CorruptCheckpoint(
                        "file is empty",
                        path=self.path,
                        hint="the save was interrupted; restore it from a backup or an earlier step",
                    ) from None
                self._fh = fh
            return self._mm

    def storage_offset(self, storage: StorageRef) -> int:
        raise NotImplementedError

    def read_storage(self, storage: StorageRef, begin: int, length: int) -> memoryview:
        mm = self._map()
        start = self.storage_offset(storage) + begin
        if remote._MOUNTS:
            remote.ensure(self.path, start, length)
        if begin < 0 or length < 0 or begin + length > storage.nbytes or start + length > len(mm):
            raise CorruptCheckpoint(
                f"tensor bytes of storage {storage.key} lie outside the file",
                path=self.path,
                hint="the file is truncated; re-copy it",
            )
        return memoryview(mm)[start : start + length]

    def prefetch(self, storage: StorageRef, begin: int, length: int) -> None:
        """Ask the kernel to start reading these bytes now (POSIX_FADV_WILLNEED returns at once; the reads
        run in the background, many at a time). A later `read_storage` of a cold file then finds them in the
        page cache instead of faulting them in one page cluster after another. A hint: never fails."""
        mm = self._map()
        start = self.storage_offset(storage) + begin
        if remote._MOUNTS and begin >= 0 and length > 0:
            remote.ensure(self.path, start, length)  # a remote object: fetch now (the ranges a caller plans)
        fh = self._fh if self._fh is not None else getattr(getattr(self, "_outer", None), "_fh", None)
        if fh is not None and hasattr(os, "posix_fadvise") and begin >= 0 and length > 0 and start + length <= len(mm):
            try:
                os.posix_fadvise(fh.fileno(), start, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class ZipSource(Source):
    """torch's zip format: `<archive>/data.pkl` plus one stored (uncompressed) member per storage."""

    #: where the archive starts in the file (non-zero for an archive embedded in a bigger file)
    base = 0

    def __init__(self, path, zf: zipfile.ZipFile, prefix: str):
        super().__init__(path)
        self._infos = {i.filename: i for i in zf.infolist()}
        self.prefix = prefix
        self._offsets: dict[str, int] = {}

    def member_names(self) -> list[str]:
        """The archive's member names, as its central directory lists them."""
        return list(self._infos)

    def member_offset(self, name: str) -> int:
        off = self._offsets.get(name)
        if off is None:
            info = self._infos.get(name)
            if info is None:
                raise CorruptCheckpoint(
                    f"zip member {name} is missing",
                    path=self.path,
                    hint="the file is truncated or was not written by torch.save",
                )
            if info.compress_type != zipfile.ZIP_STORED:
                raise CorruptCheckpoint(
                    f"zip member {name} is compressed",
                    path=self.path,
                    hint="torch.save writes stored members; re-save with torch.save",
                )
            mm = self._map()
            header = self.base + info.header_offset
            if remote._MOUNTS:  # the local header (torch pads its extra field to 64-byte alignment)
                remote.ensure(self.path, header, 30 + len(name.encode()) + 256)
            hdr = mm[header : header + 30]
            if len(hdr) < 30 or hdr[:4] != b"PK\x03\x04":
                raise CorruptCheckpoint(
                    f"bad local header for zip member {name}", path=self.path, hint="the file is corrupt; re-copy it"
                )
            name_len, extra_len = struct.unpack("<HH", hdr[26:30])
            off = header + 30 + name_len + extra_len
            if off + info.file_size > len(mm):
                raise CorruptCheckpoint(
                    f"zip member {name} runs past the end of the file",
                    path=self.path,
                    hint="the file is truncated; re-copy it",
                )
            self._offsets[name] = off
        return off

    def storage_offset(self, storage: StorageRef) -> int:
        return self.member_offset(f"{self.prefix}data/{storage.key}")

    def member_size(self, name: str) -> int:
        return self._infos[name].file_size


class EmbeddedZipSource(ZipSource):
    """A torch.save zip stored inside a bigger file (one DCP `.distcp` item). Offsets shift by `base`,
    and the outer file's mapping is shared: a DCP file holds thousands of items, and one mmap (two
    file descriptors) per item would exhaust the descriptor limit."""

    def __init__(self, outer: Source, zf: zipfile.ZipFile, prefix: str, base: int):
        super().__init__(outer.path, zf, prefix)
        self._outer = outer
        self.base = base

    def _map(self) -> mmap.mmap:
        return self._outer._map()

    def close(self) -> None:
        pass  # the mapping belongs to the outer Source


class _Window(io.RawIOBase):
    """A read-only file over a slice of a mapping, so zipfile can parse an embedded archive by reading
    only its directory and `data.pkl` (copying the slice would read the tensor bytes too)."""

    def __init__(self, buf: memoryview, before_read: Callable[[int, int], None] | None = None):
        self._buf = buf
        self._pos = 0
        self._before_read = before_read  # a remote object's window: fetch what is about to be read

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._buf) - self._pos))
        if self._before_read is not None and n:
            self._before_read(self._pos, n)
        b[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n


class LegacySource(Source):
    """torch's pre-1.6 format: pickles in sequence, then each storage as <int64 numel><bytes>."""

    def __init__(self, path, offsets: dict[str, int]):
        super().__init__(path)
        self._storage_offsets = offsets

    def storage_offset(self, storage: StorageRef) -> int:
        return self._storage_offsets[storage.key]


@dataclass
class Loaded:
    """What a file holds: the unpickled object tree (with `TensorRef`/`Opaque` leaves) and its container."""

    obj: Any
    kind: str  # "torch_zip", "torch_legacy", "pickle"
    source: Source | None
    globals_seen: frozenset[str]

    @property
    def unknown_globals(self) -> list[str]:
        """Globals outside the exact allowlist (`read.allowlist`), and the calls a framework's full unpickler
        would make beyond them (getattr on an object, calling what a call returned): what it would import or run
        beyond the classes real checkpoints carry."""
        out = []
        for g in sorted(self.globals_seen):
            module, _, name = g.partition(":") if ":" in g else g.rpartition(".")
            if allowlist.is_allowed(module, name, calls_checked=True) or allowlist.is_allowed_nested(module, name):
                continue
            out.append(g)
        return sorted(out, key=lambda g: ("(" in g or g.startswith("a call"), g))  # the named globals first


#: how much of an embedded torch.save zip `load_embedded_head` reads at once: torch.save writes data.pkl first (a few
#: hundred bytes for one tensor), then `.format_version`, `.storage_alignment`, `byteorder`, then each storage; a DCP
#: tensor item's members up to its storage's local header take under 1 KB
ITEM_HEAD_BYTES = 4096
#: a zip local file header: signature, version, flags, method, time, date, CRC-32, sizes, name and extra lengths
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
#: the data descriptor torch.save writes after each member (flag bit 3: the header's sizes are zero)
_DESCRIPTOR = struct.Struct("<4sIII")
_CENTRAL = (b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x06")


class _NotTorchLayout(Exception):
    """An embedded zip whose head is not laid out as torch.save writes it: read it with zipfile instead."""


class HeadZipSource(Source):
    """A torch.save zip embedded in a bigger file, its storages located from the zip's head (`load_embedded_head`):
    storage key -> absolute offset of its bytes in the outer file, whose mapping is shared."""

    def __init__(self, outer: Source, base: int, prefix: str):
        # not Source.__init__: no mapping or lock of its own (one of these per DCP item read)
        self.path, self._mm, self._fh = outer.path, None, None
        self._outer = outer
        self.base = base
        self.prefix = prefix
        self.data_at: dict[str, int] = {}

    def _map(self) -> mmap.mmap:
        return self._outer._map()

    def storage_offset(self, storage: StorageRef) -> int:
        try:
            return self.data_at[storage.key]
        except KeyError:  # load_embedded_head located every storage its pickle names
            raise CorruptCheckpoint(
                f"zip member {self.prefix}data/{storage.key} is missing",
                path=self.path,
                hint="the file is truncated or was not written by torch.save",
            ) from None

    def close(self) -> None:
        pass  # the mapping belongs to the outer Source


def _member(head: bytes, pos: int) -> tuple[str, int, int, int, int]:
    """(name, flags, CRC-32, compressed size, where its data starts) of the local header at `pos` of `head`."""
    if pos + 30 > len(head):
        raise _NotTorchLayout
    sig, _, flags, method, _, _, crc, csize, _, nlen, xlen = _LOCAL_HEADER.unpack_from(head, pos)
    start = pos + 30 + nlen + xlen
    if sig != b"PK\x03\x04" or method != zipfile.ZIP_STORED or start > len(head):
        raise _NotTorchLayout
    name = head[pos + 30 : pos + 30 + nlen].decode("utf-8" if flags & 0x800 else "cp437")
    return name, flags, crc, csize, start


def _member_end(head: bytes, flags: int, crc: int, csize: int, start: int) -> tuple[bytes, int]:
    """(the member's data, where the next header starts) for a member whose data starts at `start`: its size from the
    header, else (flag bit 3) up to the first data descriptor whose sizes fit; the CRC-32 checked."""
    if not flags & 8:
        end, nxt = start + csize, start + csize
    else:
        at = head.find(b"PK\x07\x08", start)
        while True:
            if at < 0 or at + _DESCRIPTOR.size > len(head):
                raise _NotTorchLayout
            sig, crc, csize, usize = _DESCRIPTOR.unpack_from(head, at)
            if csize == usize == at - start:
                break
            at = head.find(b"PK\x07\x08", at + 1)  # the signature's bytes inside the data: look further
        end, nxt = at, at + _DESCRIPTOR.size
    if end > len(head):
        raise _NotTorchLayout
    data = head[start:end]
    if zlib.crc32(data) != crc:
        raise _NotTorchLayout
    return data, nxt


#: the heads of the last few items `load_embedded_head` parsed that held one plain tensor: the bytes from the item's
#: start to its storage's data (data.pkl's local header and pickle, the small members, the storage's local header)
#: -> (the parse, its storage's source dropped; the globals it names; the archive's folder). Equal bytes parse
#: alike, and a DCP folder's chunks repeat a handful of heads (every Adam `step` the same 0-d float32 one): each
#: parse costs ~60 us in Python, a hit ~5 us
_SEEN_HEADS: "collections.OrderedDict[bytes, tuple[TensorRef, frozenset[str], str]]" = collections.OrderedDict()
_HEAD_SIZES: dict[int, int] = {}  # the lengths of those heads -> how many have it
_SEEN_KEPT = 64
_heads_lock = threading.Lock()  # guards the two above


def _remember_head(
    head: bytes, obj: Any, seen: frozenset[str], named: list[StorageRef], source: HeadZipSource, offset: int
) -> None:
    """Keep a parse `_same_head` can repeat: a plain tensor (`_rebuild_tensor_v2` of its one storage), no more."""
    call = getattr(obj, "pickled", None) if type(obj) is TensorRef else None
    if (
        call is None
        or call[0] != "torch._utils._rebuild_tensor_v2"
        or len(named) != 1
        or not call[1]
        or call[1][0] is not obj.storage
        or obj.storage is not named[0]
        or obj.subclass is not None
    ):
        return
    s = obj.storage  # kept without its source: a template must not hold a file's mapping open
    storage = StorageRef(s.key, s.dtype, s.numel, s.location, None, s.storage_type)
    template = TensorRef(
        obj.dtype,
        obj.shape,
        obj.stride,
        obj.storage_offset,
        storage,
        obj.requires_grad,
        obj.is_parameter,
        None,
        None,
        (call[0], (storage, *call[1][1:])),
    )
    n = source.data_at[s.key] - offset
    with _heads_lock:
        if head[:n] in _SEEN_HEADS:
            return
        _SEEN_HEADS[head[:n]] = (template, seen, source.prefix)
        _HEAD_SIZES[n] = _HEAD_SIZES.get(n, 0) + 1
        while len(_SEEN_HEADS) > _SEEN_KEPT:
            old, _ = _SEEN_HEADS.popitem(last=False)
            _HEAD_SIZES[len(old)] -= 1
            if not _HEAD_SIZES[len(old)]:
                del _HEAD_SIZES[len(old)]


def _same_head(head: bytes, outer: Source, offset: int, length: int) -> Loaded | None:
    """The parse of an item whose head repeats one `_remember_head` kept (its storage read through `outer` at this
    item's offset); None when none matches."""
    with _heads_lock:
        sizes = tuple(_HEAD_SIZES)
    for n in sizes:
        if n > len(head):
            continue
        with _heads_lock:
            hit = _SEEN_HEADS.get(head[:n])
        if hit is None:
            continue
        t, seen, prefix = hit
        s = t.storage
        if offset + n + s.nbytes > offset + length:
            raise _NotTorchLayout
        source = HeadZipSource(outer, offset, prefix)
        source.data_at[s.key] = offset + n
        storage = StorageRef(s.key, s.dtype, s.numel, s.location, source, s.storage_type)
        name, args = t.pickled
        obj = TensorRef(
            t.dtype,
            t.shape,
            t.stride,
            t.storage_offset,
            storage,
            t.requires_grad,
            t.is_parameter,
            None,
            None,
            (name, (storage, *args[1:])),
        )
        return Loaded(obj, "torch_zip", source, seen)
    return None
