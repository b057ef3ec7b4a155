"""Write files that `torch.load` reads (torch.save's zip format) without torch, copying tensor bytes file to file.

A torch.save file is a zip of stored (uncompressed) members under one archive folder named after the file
(`fp32.pt` -> `fp32/`), in this order (torch 2.13's `_save` and its PyTorchStreamWriter):

    fp32/data.pkl                 the pickle (protocol 2); each storage is a persistent id ("storage", class, key, ...)
    fp32/.format_version          "1"
    fp32/.storage_alignment       "64": every member's data starts on a 64-byte boundary (what torch.load with
    mmap=True needs)
    fp32/byteorder                "little"
    fp32/data/<key>               one member per storage, its raw bytes
    fp32/version                  "3\\n"
    fp32/.data/serialization_id   40 digits; torch derives them from the member names and CRCs (so do we,
                                  differently: nothing reads them back, but equal inputs give equal files)

`pickle_writer` makes the pickle from the inert records `pickle_reader` produces (a hand-built `TensorRef`
pickles as torch.save pickles a plain tensor) and lays the zip out (`pickle_writer.ZipWriter`). What this
module adds is where a storage's bytes come from: bytes in memory, or ranges of other files copied by the kernel
(`io.copy_range`: copy_file_range, a reflink on XFS/btrfs) with their CRC-32 computed from a small reused
buffer. So writing a tensor that lies in a source file costs one pass over its bytes for the CRC plus a
kernel copy, and memory stays at that buffer whatever the tensor's size.
"""

from __future__ import annotations

import ctypes
import io as _io
import os
import pickle
import threading
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

from ..errors import CkptError, CorruptCheckpoint
from ..read import remote
from ..read.pickle_reader import StorageRef, TensorRef
from ..read.tensor_read import FileRange
from .io import copy_range
from .pickle_writer import ZipWriter, _pickle_tree, _pwrite_all

FORMAT_VERSION = b"1"
STORAGE_ALIGNMENT = 64
VERSION = b"3\n"  # the record format version torch 2.x writes (kProducedFileFormatVersion)
CRC_CHUNK = 8 << 20  # bytes read at a time to compute a copied range's CRC-32 (per thread)


#: what one storage member is made of: a buffer (bytes, memoryview, numpy array), a list/tuple of file ranges
#: copied one after another, or a function that makes the buffer when the member is written (so that a file of
#: many tensors holds one of them in memory at a time)
StorageData = Union[bytes, bytearray, memoryview, Sequence[FileRange], Callable[[], Any]]

_local = threading.local()


def _crc_buffer() -> memoryview:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = memoryview(bytearray(CRC_CHUNK))
    return buf


def range_crc(r: FileRange, crc: int = 0) -> int:
    """CRC-32 of a file range (continuing `crc`), read through this thread's buffer."""
    buf = _crc_buffer()
    done = 0
    while done < r.length:
        n = os.preadv(r.fd, [buf[: min(CRC_CHUNK, r.length - done)]], r.offset + done)
        if n <= 0:
            raise CorruptCheckpoint(
                f"file ended inside a tensor (fd {r.fd}, byte {r.offset + done})",
                hint="the source file is truncated; re-copy it",
            )
        crc = zlib.crc32(buf[:n], crc)
        done += n
    return crc


def copy_ranges(ranges: Sequence[FileRange], fd: int, at: int) -> int:
    """Copy `ranges` one after another into `fd` from byte `at` (kernel copies); returns their CRC-32."""
    crc = 0
    for r in ranges:
        crc = range_crc(r, crc)
        copy_range(r.fd, fd, r.offset, at, r.length)
        at += r.length
    return crc


_sync_file_range = None


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing `fd`'s dirty pages to disk now, without waiting (Linux
    sync_file_range(SYNC_FILE_RANGE_WRITE)): the fsync that makes the output durable later then finds most of
    them written, and the disk works while the next files are copied. A no-op where it is unavailable."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            _sync_file_range = f
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, 0, 0, 2)  # SYNC_FILE_RANGE_WRITE


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy a file to a new file `dst` with kernel copies (`io.copy_range`), its writeback started."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        copy_range(fin.fileno(), fout.fileno(), 0, 0, os.fstat(fin.fileno()).st_size)
        start_writeback(fout.fileno())


def archive_name(path: str | os.PathLike) -> str:
    """The folder torch.save puts the members under: the file name without its last extension."""
    base = os.path.basename(os.fspath(path))
    dot = base.rfind(".")
    return (base[:dot] if dot > 0 else base) or "archive"


def _source_data(s: StorageRef, path: str, fds: dict[str, int]) -> StorageData:
    """The bytes of a storage read by `pickle_reader` (kept where they are; small ones read now)."""
    if s.source is None:
        raise ValueError(f"storage {s.key} has no source and no bytes were given for it")
    if s.nbytes <= ZipWriter.SMALL:
        return bytes(s.source.read_storage(s, 0, s.nbytes))
    fd = fds.get(s.source.path)
    if fd is None:
        fd = fds[s.source.path] = os.open(s.source.path, os.O_RDONLY)
    start = s.source.storage_offset(s)
    remote.ensure(s.source.path, start, s.nbytes)
    if start + s.nbytes > os.fstat(fd).st_size:
        raise CorruptCheckpoint(
            f"storage {s.key} lies outside the file", path=s.source.path, hint="the file is truncated; re-copy it"
        )
    return (FileRange(fd, start, s.nbytes),)


def save(
    obj: Any,
    path: str | os.PathLike,
    data: Mapping[str, StorageData] | None = None,
    *,
    pickle_bytes: bytes | None = None,
    storages: Mapping[str, StorageRef] | None = None,
) -> int:
    """Write `obj` (a tree of plain values and `pickle_reader` records) to a new file `path`, as torch.save
    would: torch.load of the file gives back the objects the records stand for.

    Each storage the pickle names is written from `data[key]` when given (it must hold exactly the storage's
    bytes; a function is called for them when the member is written, and they are dropped after), else from the
    file the record was read from. `pickle_bytes` and `storages` (what
    `pickle_writer._pickle_tree(obj)` returns) may be passed to reuse a pickle made once for many files.
    Returns the number of storage bytes written. The file is not fsynced (the caller's staging does that);
    its writeback to disk is started (`start_writeback`)."""
    path = os.fspath(path)
    if pickle_bytes is None or storages is None:
        pickle_bytes, storages = _pickle_tree(obj, path)
    data = data or {}
    prefix = archive_name(path) + "/"
    opened: dict[str, int] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        out = ZipWriter(fd, STORAGE_ALIGNMENT)
        out.add(prefix + "data.pkl", pickle_bytes)
        out.add(prefix + ".format_version", FORMAT_VERSION)
        out.add(prefix + ".storage_alignment", str(STORAGE_ALIGNMENT).encode())
        out.add(prefix + "byteorder", b"little")
        total = 0
        for key, s in storages.items():
            given = data.get(key)
            body = given if given is not None else _source_data(s, path, opened)
            if callable(body):
                out.add_written(
                    f"{prefix}data/{key}",
                    s.nbytes,
                    lambda fd_, at, make=body, key=key, n=s.nbytes: _write_made(make, key, n, fd_, at),
                )
                size = s.nbytes
            elif not isinstance(body, (list, tuple)):  # a buffer: bytes, memoryview, a numpy array
                size = memoryview(body).nbytes
                if size != s.nbytes:
                    raise ValueError(f"storage {key}: {size} bytes given, the pickle says {s.nbytes}")
                out.add(f"{prefix}data/{key}", body)
            else:
                size = sum(r.length for r in body)
                if size != s.nbytes:
                    raise ValueError(f"storage {key}: {size} bytes in ranges, the pickle says {s.nbytes}")
                out.add_written(f"{prefix}data/{key}", size, lambda fd_, at, body=body: copy_ranges(body, fd_, at))
            total += size
        out.add(prefix + "version", VERSION)
        names = "\n".join(out.names).encode()
        crcs = b"".join(c.to_bytes(4, "little") for c in out.crcs)
        out.add(prefix + ".data/serialization_id", f"{zlib.crc32(names):020d}{zlib.crc32(crcs):020d}".encode())
        out.finish()
        start_writeback(fd)
    finally:
        os.close(fd)
        for f in opened.values():
            os.close(f)
    return total


def _write_made(make: Callable[[], Any], key: str, nbytes: int, fd: int, at: int) -> int:
    """Write the buffer `make()` returns as storage `key` at `at`; returns its CRC-32."""
    view = memoryview(make()).cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"storage {key}: {view.nbytes} bytes made, the pickle says {nbytes}")
    return _pwrite_all(fd, view, at)


def own_storage(t: Any) -> Any:
    """`t` on the CPU, contiguous, over a storage of exactly its bytes (torch.save writes a tensor's whole storage:
    never a view's neighbours), so that where its bytes go in a file follows from its shape and dtype."""
    t = t.detach().cpu().contiguous()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def tensor_record(dtype: str, shape: Sequence[int], key: str = "0"):
    """A `TensorRef` for a new contiguous tensor of its own storage `key` (offset 0, not requiring grad):
    pickled, it is what torch.save writes for a plain CPU tensor."""
    shape = tuple(int(d) for d in shape)
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= max(d, 1)
    numel = 1
    for d in shape:
        numel *= d
    return TensorRef(dtype, shape, tuple(reversed(stride)), 0, StorageRef(key, dtype, numel, "cpu", None))


# --- one torch.save file written by many processes (`ckpt convert --to torch` as a torchrun job) ---------------


@dataclass(frozen=True)
class SaveLayout:
    """Where `torch.save(obj, path)` puts every record of `obj`, planned from a skeleton of it (`plan_save`): the
    pickle torch's own pickler makes, the storages' sizes (key "0", "1", ... in this order) and the offsets their
    bytes start at, the file's size. With each storage's CRC-32 (`write_frame`) the rest of the file follows: the
    same bytes torch.save writes, whoever writes the storages' bytes at `offsets`."""

    prefix: str
    records: tuple[tuple[str, bytes], ...]  # data.pkl and the small records before the storages, as torch gives them
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int
    name_hash: str  # the first 20 digits of `.data/serialization_id`: torch's hash of the record names


def plan_save(skeleton: Any, path: str | os.PathLike) -> SaveLayout:
    """The layout of `torch.save(obj, path)` for an `obj` of which `skeleton` has the structure, values and tensors'
    dtypes and shapes, each tensor contiguous with a storage of its own (`torch.empty`: its pages are never
    touched). torch's own `_save` pickles it under `skip_data` into a recorder (no storage byte is read), and
    torch's own writer hashes the record names; the offsets are those `ZipWriter` lays out, torch's layout."""
    import torch  # lazy: torch only when a tensor is saved; write/ stays torch-free at import
    import torch.serialization as S  # lazy: torch only when a tensor is saved; write/ stays torch-free at import

    if not hasattr(S, "skip_data"):
        raise CkptError(
            f"torch {torch.__version__} cannot plan a torch.save file without its bytes (torch.serialization."
            "skip_data, torch >= 2.5): a torchrun job of --to torch / megatron needs it",
            hint="run the command in one process (without torchrun / --nproc), or upgrade torch",
        )

    class _Recorder:
        def __init__(self) -> None:
            self.records: list[tuple[str, bytes]] = []
            self.sizes: list[int] = []

        def write_record(self, name: str, data: Any, nbytes: int) -> None:
            self.records.append((name, data.encode() if isinstance(data, str) else bytes(data)[:nbytes]))

        def write_record_metadata(self, name: str, nbytes: int) -> None:
            if name != f"data/{len(self.sizes)}":
                raise ValueError(f"torch.save wrote record {name} where data/{len(self.sizes)} was expected")
            self.sizes.append(int(nbytes))

    rec = _Recorder()
    with S.skip_data():
        S._save(skeleton, rec, pickle, 2, False)
    names = [n for n, _ in rec.records] + [f"data/{k}" for k in range(len(rec.sizes))] + ["version"]
    buf = _io.BytesIO()
    writer = torch._C.PyTorchFileWriter(buf, True, STORAGE_ALIGNMENT)
    for n in names:
        writer.write_record(n, b"", 0)
    writer.write_end_of_file()
    with zipfile.ZipFile(_io.BytesIO(buf.getvalue())) as zf:
        name_hash = zf.read(f"{archive_name('archive')}/.data/serialization_id")[:20].decode()
    layout = SaveLayout(archive_name(path) + "/", tuple(rec.records), tuple(rec.sizes), (), 0, name_hash)
    offsets: list[int] = []
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        size = _frame(fd, layout, [0] * len(rec.sizes), offsets)
    finally:
        os.close(fd)
    return SaveLayout(layout.prefix, layout.records, layout.sizes, tuple(offsets), size, name_hash)


def _frame(fd: int, layout: SaveLayout, crcs: Sequence[int], offsets: list[int] | None = None) -> int:
    """Write everything of the file but the storages' bytes (`ZipWriter`, each storage member given its CRC-32),
    with torch's serialization id; `offsets` collects where each storage's bytes start. Returns the file's size."""
    out = ZipWriter(fd, STORAGE_ALIGNMENT)
    for name, data in layout.records:
        out.add(layout.prefix + name, data)

    def placed(key: int):
        def write(fd_: int, at: int) -> int:
            if offsets is not None:
                offsets.append(at)
            elif at != layout.offsets[key]:
                raise ValueError(f"storage {key}: laid out at byte {at}, planned at {layout.offsets[key]}")
            return crcs[key]

        return write

    for key, size in enumerate(layout.sizes):
        out.add_written(f"{layout.prefix}data/{key}", size, placed(key))
    out.add(layout.prefix + "version", VERSION)
    combined = 0  # c10::hash_combine of the CRC-32s of the non-empty records in the order written (torch's writer)
    for crc, size in zip(out.crcs, out.sizes):
        if size:
            combined = (combined ^ (crc + 0x9E3779B9 + ((combined << 6) & _U64) + (combined >> 2))) & _U64
    out.add(layout.prefix + ".data/serialization_id", f"{layout.name_hash}{combined:020d}".encode())
    return out.finish()


_U64 = (1 << 64) - 1


def write_frame(fd: int, layout: SaveLayout, crcs: Sequence[int]) -> int:
    """(the last writer) Write the file's records, headers, central directory and serialization id around the
    storages' bytes already at `layout.offsets`, given each storage's CRC-32; returns the file's size."""
    if len(crcs) != len(layout.sizes):
        raise ValueError(f"{len(crcs)} CRC-32s for {len(layout.sizes)} storages")
    return _frame(fd, layout, crcs)
