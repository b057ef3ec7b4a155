"""Read torch checkpoints and pickles WITHOUT executing code from them and without reading tensor bytes.

`torch.load` runs whatever the pickle names (`os.system` included) unless `weights_only=True`, and
`weights_only=True` refuses DeepSpeed's optimizer files. This reader takes a third way: a restricted
unpickler whose `find_class` never imports anything. Known globals (tensor rebuild functions, storages,
OrderedDict, ...) map to inert records built here; every other global becomes an `Opaque` placeholder
class that records its constructor arguments and state and is shown by its dotted name. Nothing named
in a pickle is ever imported or called.

Tensors become `TensorRef` records (dtype, shape, where the bytes are). Bytes are read only on demand:
`TensorRef.read_values()` for small tensors (step counters), `TensorRef.read_numpy()` via mmap for big
ones. Importing this module imports neither torch nor numpy.

Supported containers: torch's zip format (`torch.save` since 1.6), torch's legacy pickle format, and
plain pickles (DCP `.metadata`, Accelerate `*.pkl`).

Here: the unpickler, the entry points (`load`, `loads`, `load_embedded`, `load_embedded_head`, `check_pickles`),
which safety walk runs (`check_expansion`: the C copy or the Python walk) and `LazyTensorRef`. Beside it, each
importable from here as well: the records (`pickle_records`), what a global becomes (`pickle_globals`), where the
bytes are (`pickle_sources`) and the Python safety walk (`pickle_walk`).
"""

from __future__ import annotations

import collections
import hashlib
import io
import linecache
import os
import pickle
import pickletools
import struct
import threading
import zipfile
from typing import Any, Callable

from . import allowlist, native_walk, remote
from ..errors import CorruptCheckpoint, NotACheckpoint
from .pickle_globals import (  # noqa: F401  (NumpyFloat ... _SAFE_GLOBALS: re-exported for pickle_writer)
    NumpyFloat,
    NumpyInt,
    RecordedCall,
    TorchSize,
    _Counter,
    _DefaultDict,
    _SAFE_GLOBALS,
    _storage_dtype,
    _storage_type_name,
    resolve_global,
)
from .pickle_records import (  # noqa: F401  (the records, re-exported: every reader imports them from here)
    _STRUCT,
    DTYPE_SIZE,
    SMALL_TENSOR_NUMEL,
    DType,
    FdCache,
    NumpyArray,
    NumpyDType,
    Opaque,
    StorageRef,
    TensorRef,
    _FLAGGED,
    _new,
    _set,
    is_opaque,
    opaque_class,
)
from .pickle_sources import (  # noqa: F401  (Source ... HeadZipSource: re-exported)
    ITEM_HEAD_BYTES,
    EmbeddedZipSource,
    HeadZipSource,
    LegacySource,
    Loaded,
    Source,
    ZipSource,
    _CENTRAL,
    _member,
    _member_end,
    _NotTorchLayout,
    _remember_head,
    _same_head,
    _Window,
)
from .pickle_walk import (  # noqa: F401  (the limits, re-exported)
    _DEPTH_SHIFT,
    _EMPTY_CONTAINER_OPS,
    _FAST,
    _LEAF_OPS,
    MAX_NESTING,
    MAX_SHARED_EXPANSION,
    MAX_TUPLE_EXPANSION,
    _fill,
    _make_container,
    _op_table,
    _refill,
    _skip_argument,
    _table_op,
    _walk_expansion,
)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, source: "Source | None", persistent: Callable[[tuple], Any] | None):
        if persistent is not None:  # called straight from C, once per tensor storage: the C unpickler takes
            self.persistent_load = persistent  # its persistent_load when initialised, so set it before that
        super().__init__(file, encoding="latin1")
        self._source = source
        self._persistent = persistent
        self.globals_seen: set[str] = set()

    def find_class(self, module: str, name: str):
        self.globals_seen.add(allowlist.dotted(module, name))
        return resolve_global(module, name)

    def persistent_load(self, pid):
        if self._persistent is None:
            raise pickle.UnpicklingError("persistent id in a plain pickle")
        return self._persistent(pid)


# --- the safety walk: which one runs ---------------------------------------------------------------

#: a pickle stream (not a zip member) whose remaining bytes are at most this is read whole for the expansion walk;
#: a longer one (a legacy torch file with its tensor bytes after the pickles) is delimited with genops first
_WHOLE_STREAM_BYTES = 64 << 20


def check_expansion(data, path: str) -> int:
    """Refuse a pickle that would hang or kill whatever unpickles it: tuples that expand exponentially through
    shared references, or containers nested deeper than MAX_NESTING. Returns the pickle's length in bytes (up to
    and including its STOP opcode).

    `t0 = (); t1 = (t0, t0); t2 = (t1, t1); ...` is a few hundred bytes, and hashing t60 (a dict key, a set
    member) or printing it never ends: Python's tuple hash is not cached, and the C unpickler cannot be
    interrupted while it hashes. A 300,000-deep tuple `((((...),),),)` used as a dict key is 300 KB, and hashing
    it recurses in C without a limit: SIGSEGV, in this reader's unpickler, in `pickle.load` and in
    `torch.load(weights_only=True)` alike. So the opcode stream is walked first (no object is built; arguments
    are skipped by size, not decoded), keeping for every stack slot how many items it expands to (tuples and
    frozensets add up their items, memo gets and DUP re-use a slot's count and add it to a stream-wide budget; a
    leaf counts 1, a list, dict, set or object 0: unhashable or hashed by identity) and how deep it nests (a
    container one level above its deepest item; filling a list, dict or object keeps the deeper of it and one
    above the new item, so a long flat list stays flat). Cost of the Python walk: about 0.1 µs per pickle byte
    (11 ms for an 89 KB DCP `.metadata`, 4 s for a 35 MB torch.save pickle); the C copy (`native_walk`) runs
    instead where it is built. A stream longer than 64 MB (a legacy torch file with its tensor bytes) is first
    delimited with pickletools.genops.

    A stream the walk cannot follow (an unknown opcode, an argument running past the end, no STOP) is refused
    here as well, rather than left to the unpickler: what was not measured must not be built."""
    if hasattr(data, "read"):
        start = data.tell()
        try:
            rest = data.seek(0, 2) - start
            data.seek(start)
        except (OSError, ValueError):
            rest = None
        end = _native_prefix_walk(data, start, rest) if rest is not None and rest > _WHOLE_STREAM_BYTES else None
        if end is not None:
            return end
        if rest is not None and rest <= _WHOLE_STREAM_BYTES:
            # the walk stops at the pickle's STOP by itself: no need to delimit it first with pickletools.genops
            # (pure Python, ~10 us per opcode: 8 s for a 2 MB DCP .metadata of 7,000 chunks)
            buf = data.read(rest)
            data.seek(start)
            data = buf
        else:
            try:
                for _ in pickletools.genops(data):
                    pass
            except Exception as e:  # noqa: BLE001  pickletools raises many types on a malformed stream
                raise _unfollowable(e, path) from None
            end = data.tell()
            data.seek(start)
            data = data.read(end - start)
    native = _native_walk()
    if native is not None:
        end = native(data)
        if end >= 0:  # passed; anything else is decided (and its error worded) by the Python walk below
            return end
    try:
        return _walk_expansion(data, path)
    except CorruptCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001  malformed: an argument past the end, a bad text argument, ...
        raise _unfollowable(e, path) from None


#: the most of a long stream `_native_prefix_walk` reads to find its pickle's end
_PREFIX_WALK_MAX_BYTES = 512 << 20


def _native_prefix_walk(fh, start: int, rest: int) -> int | None:
    """The length of the pickle at `fh`'s position in a stream longer than `_WHOLE_STREAM_BYTES` (a 700k-item DCP
    `.metadata` is ~150 MB; a legacy torch file holds its tensor bytes after its small pickles), found by the C walk
    over a prefix of the stream: 1 MB first, eight times more each time the walk needs more, up to the whole stream or
    `_PREFIX_WALK_MAX_BYTES`. None (the caller's pickletools.genops path decides: ~10 us per opcode, minutes for
    such a `.metadata`) without the C walk, or when it does not pass the pickle within that (the C walk only ever
    answers "passes, and ends here")."""
    native = _native_walk()
    n = 1 << 20
    while native is not None:
        n = min(n, rest, _PREFIX_WALK_MAX_BYTES)
        buf = fh.read(n)
        fh.seek(start)
        end = native(buf)
        del buf
        if end >= 0:
            return end
        if n >= rest or n >= _PREFIX_WALK_MAX_BYTES:
            return None
        n *= 8
    return None


_native: list = []  # [the C walk or None], once built


def _native_walk() -> Callable[[bytes], int] | None:
    """`native_walk`'s C copy of `_walk_expansion`, with this module's opcode table and bounds; None without a
    C compiler, with CKPT_NATIVE=0 (re-read on each call, so a test can switch it off), or when the Python walk
    is no longer the one the C copy mirrors (`walk_fingerprint`): an edit here must not leave a stale C walk
    deciding alone."""
    if not native_walk.enabled():
        return None
    if not _native:
        fn = None
        if walk_fingerprint() == native_walk.MIRRORS:
            table = []
            for entry in _op_table():
                table += [0] * 6 if entry is None else [1, entry[0], entry[1], int(entry[2]), entry[3], entry[4]]
            fn = native_walk.walker(table, MAX_TUPLE_EXPANSION, MAX_SHARED_EXPANSION, MAX_NESTING)
        _native.append(fn)
    return _native[0]


def walk_fingerprint() -> str:
    """A hash of the Python walk's source (`pickle_walk`: `_walk_expansion` and the steps it calls, `_refill`,
    `_op_table`) and of the constants the C copy hard-codes: what `native_walk.MIRRORS` must equal for the C walk to
    be used."""
    text = []
    for fn in (_walk_expansion, _table_op, _skip_argument, _fill, _make_container, _refill, _op_table):
        code = fn.__code__
        last = max(line for _, _, line in code.co_lines() if line is not None)
        text += linecache.getlines(code.co_filename)[code.co_firstlineno - 1 : last]
    text.append(repr((_DEPTH_SHIFT, sorted(_LEAF_OPS), sorted(_EMPTY_CONTAINER_OPS), _FAST)))
    return hashlib.sha256("".join(text).encode()).hexdigest()[:16]


def _unfollowable(e: Exception, path: str) -> CorruptCheckpoint:
    why = str(e) if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {e}"
    return CorruptCheckpoint(
        f"cannot parse the pickle ({why})",
        path=path,
        hint="the file is truncated or corrupt; re-copy it or restore a backup",
    )


# --- entry points ---------------------------------------------------------------------------------

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def _unpickle(data, source, persistent, path, walked: bool = False) -> tuple[Any, set[str]]:
    """The inert object tree of the pickle `data` (bytes or a file at the pickle's start) and the globals it
    names. `walked`: `check_expansion` already passed these very bytes (`load_embedded_head` walks data.pkl to find
    where it ends)."""
    if walked:
        pass
    elif hasattr(data, "read"):
        start = data.tell()
        check_expansion(data, path)
        data.seek(start)
    else:
        check_expansion(data, path)
    up = _Unpickler(data if hasattr(data, "read") else io.BytesIO(data), source, persistent)
    token = _FLAGGED.set(up.globals_seen)  # flagged calls join the globals the pickle names
    try:
        obj = up.load()
    except CorruptCheckpoint:
        raise
    except RecursionError:
        raise CorruptCheckpoint("pickle nests too deeply", path=path, hint="the file is corrupt or hostile")
    except MemoryError:
        raise CorruptCheckpoint("pickle asks for too much memory", path=path, hint="the file is corrupt or hostile")
    except Exception as e:  # any malformed opcode stream ends here: pickle raises many types
        raise CorruptCheckpoint(
            f"cannot parse the pickle ({type(e).__name__}: {e})",
            path=path,
            hint="the file is truncated or corrupt; re-copy it or restore a backup",
        )
    finally:
        _FLAGGED.reset(token)
    return obj, up.globals_seen


def load(path: str | os.PathLike) -> Loaded:
    """Parse a torch checkpoint file or a pickle without running code or reading tensor bytes."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(4)
    except IsADirectoryError:
        raise NotACheckpoint("is a folder, not a file", path=path)
    except OSError as e:
        raise NotACheckpoint(f"cannot read ({e.strerror})", path=path)
    if not head:
        raise CorruptCheckpoint(
            "file is empty", path=path, hint="the save was interrupted; restore it from a backup or an earlier step"
        )
    if head[:4] == b"PK\x03\x04" or head[:2] == b"PK":
        return _load_zip(path)
    if head[:1] == b"\x80":
        return _load_pickle_stream(path)
    raise NotACheckpoint("not a torch checkpoint or pickle (unknown file signature)", path=path)


def check_pickles(path: str | os.PathLike) -> None:
    """Run `check_expansion` over every pickle `torch.load` would unpickle in the file at `path` (a zip's
    `data.pkl`; the pickles of a legacy file, one after the other; a plain pickle's first), building no object:
    refuse (CorruptCheckpoint) what would hang or kill a real unpickler before one sees it. A path that is not a
    file is left to the loader's own error."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return
    with open(path, "rb") as fh:
        head = fh.read(4)
        if head[:2] == b"PK":
            try:
                with zipfile.ZipFile(fh) as zf:
                    names = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
                    blobs = [(n, zf.read(n)) for n in names]
            except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as e:
                # torch reads zips with its own reader: one zipfile cannot read is not handed on unchecked
                raise CorruptCheckpoint(
                    f"not a readable zip archive ({e})",
                    path=path,
                    hint="the file is truncated or corrupt; re-copy it or restore a backup",
                )
            for name, blob in blobs:
                check_expansion(blob, f"{path}:{name}")
            return
        fh.seek(0)
        first = check_expansion(fh, path)
        if first > 64:
            return  # not the legacy magic number: torch.load unpickles this one pickle and stops
        try:
            magic = _Unpickler(io.BytesIO(fh.read(first)), None, None).load()  # inert: the walk has passed it
        except Exception:  # noqa: BLE001  torch.load fails on it the same way, having unpickled nothing more
            return
        if isinstance(magic, int) and magic == _LEGACY_MAGIC:
            for _ in range(4):  # protocol version, system info, the object, the storage keys
                fh.seek(fh.tell() + check_expansion(fh, path))


def load_embedded(outer: Source, offset: int, length: int) -> Loaded:
    """Parse a torch.save zip stored at bytes [offset, offset+length) of `outer`'s file (a DCP `.distcp`
    item) without running code or reading tensor bytes; its tensors read through `outer`'s mapping."""
    mm = outer._map()
    if offset < 0 or length <= 0 or offset + length > len(mm):
        raise CorruptCheckpoint(
            f"item at bytes {offset}..{offset + length} lies outside the file ({len(mm)} bytes)",
            path=outer.path,
            hint="the file is truncated; re-copy it",
        )
    before = None
    if remote.mount_of(os.path.abspath(outer.path)) is not None:  # only the item's directory and data.pkl

        def before(pos: int, n: int) -> None:
            remote.ensure(outer.path, offset + pos, n)

    view = memoryview(mm)[offset : offset + length]
    try:
        return _load_zip(
            outer.path, _Window(view, before), lambda path, zf, prefix: EmbeddedZipSource(outer, zf, prefix, offset)
        )
    finally:
        view.release()


def loads(data: bytes, path: str) -> Loaded:
    """Parse a pickle held in memory (one stored as bytes inside a checkpoint) without running code."""
    obj, seen = _unpickle(data, None, None, path)
    return Loaded(obj, "pickle", None, frozenset(seen))


def embedded_names(outer: Source, offset: int, length: int) -> list[str]:
    """The member names of the torch.save zip at bytes [offset, offset+length) of `outer`'s file."""
    mm = outer._map()
    if offset < 0 or length <= 0 or offset + length > len(mm):
        raise CorruptCheckpoint(
            f"item at bytes {offset}..{offset + length} lies outside the file ({len(mm)} bytes)",
            path=outer.path,
            hint="the file is truncated; re-copy it",
        )
    view = memoryview(mm)[offset : offset + length]
    try:
        with zipfile.ZipFile(_Window(view)) as zf:
            return zf.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as e:
        raise CorruptCheckpoint(
            f"item at byte {offset} is not a readable zip archive ({e})",
            path=outer.path,
            hint="the file is truncated or corrupt; re-copy it or restore a backup",
        )
    finally:
        view.release()


def load_embedded_head(outer: Source, offset: int, length: int, head_bytes: int = ITEM_HEAD_BYTES) -> Loaded:
    """`load_embedded` from the zip's head alone: one read of `head_bytes` (one ranged GET remotely) where zipfile
    reads the central directory at the item's end, then data.pkl, then each member's local header.

    torch.save streams its members (flag bit 3: each local header's sizes are zero, a data descriptor follows the
    data), so each member before the storages ends at the first data descriptor whose sizes and CRC-32 match what
    precedes it; data.pkl must also end with its pickle's STOP (`check_expansion`'s walk, the one the parse needs
    anyway). The walk stops at the first storage's local header: where its bytes start.
    Anything laid out otherwise (another member first, a compressed member, a pickle or header past the head read, a
    hostile pickle, a storage not found) goes through `load_embedded` unchanged: its checks, its messages."""
    mm = outer._map()
    if offset < 0 or length <= 0 or offset + length > len(mm):
        return load_embedded(outer, offset, length)  # raises, naming the file
    n = min(length, head_bytes)
    if remote._MOUNTS:
        remote.ensure(outer.path, offset, n)
    head = mm[offset : offset + n]
    try:
        return _from_head(outer, offset, length, head)
    except _NotTorchLayout:
        return load_embedded(outer, offset, length)


def _from_head(outer: Source, offset: int, length: int, head: bytes) -> Loaded:
    hit = _same_head(head, outer, offset, length)
    if hit is not None:
        return hit
    name, flags, crc, csize, start = _member(head, 0)
    if not name.endswith("data.pkl") or name.count("/") > 1:
        raise _NotTorchLayout
    pkl, pos = _member_end(head, flags, crc, csize, start)
    try:
        walked = check_expansion(pkl, outer.path) == len(pkl)  # the pickle's STOP ends the member
    except CorruptCheckpoint:
        walked = False
    if not walked:  # load_embedded reads it through zipfile and names what is wrong
        raise _NotTorchLayout
    prefix = name[: -len("data.pkl")]
    source = HeadZipSource(outer, offset, prefix)
    while True:  # the members after data.pkl, up to the first storage
        if head[pos : pos + 4] in _CENTRAL:
            break
        name, flags, crc, csize, start = _member(head, pos)
        if name.startswith(prefix + "data/"):
            source.data_at[name[len(prefix) + 5 :]] = offset + start
            break
        data, pos = _member_end(head, flags, crc, csize, start)
        if name == prefix + "byteorder":
            try:
                order = data.decode().strip()
            except UnicodeDecodeError:
                order = "little"
            if order != "little":
                raise CorruptCheckpoint(
                    "big-endian checkpoint", path=outer.path, hint="re-save it on a little-endian machine"
                )
    named: list[StorageRef] = []
    obj, seen = _unpickle(pkl, source, _zip_persistent(source, named), outer.path, walked=True)
    seen = frozenset(seen)
    for st in named:  # every storage named must be the one found, whole inside the item
        at = source.data_at.get(st.key)
        if at is None or at + st.nbytes > offset + length:
            raise _NotTorchLayout
    _remember_head(head, obj, seen, named, source, offset)
    return Loaded(obj, "torch_zip", source, seen)


#: how many records of `LazyTensorRef`s are kept once read (the least recently used go first): reading every chunk
#: of a 700k-chunk checkpoint must not keep 700k records
RESOLVED_KEPT = 4096
_resolved: "collections.OrderedDict[int, tuple[LazyTensorRef, TensorRef]]" = collections.OrderedDict()
_resolved_lock = threading.Lock()


class LazyTensorRef(TensorRef):
    """A tensor stored as a torch.save zip embedded in a bigger file (a DCP chunk: `outer`'s bytes [offset,
    offset+length)) whose dtype and shape are known without reading it (from `.metadata`). Its record (strides,
    storage, where its bytes start) is read with `load_embedded_head` the first time anything else is asked for, and
    must be a tensor of that dtype and element count; every byte read goes through that record. `what` names the
    tensor in errors."""

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        outer: Source,
        offset: int,
        length: int,
        what: str,
        numel: int | None = None,
    ):
        if numel is None:
            numel = 1
            for s in shape:
                numel *= s
        # (not `self.__dict__.update`: reaching for `__dict__` builds a dict object, ~45 bytes more per DCP chunk)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "numel", numel)  # what the cached property would hold, set with the rest
        object.__setattr__(self, "_at", (outer, offset, length, what))

    def resolve(self) -> TensorRef:
        """The record as stored (read once, kept among the RESOLVED_KEPT most recent)."""
        with _resolved_lock:
            hit = _resolved.get(id(self))
            if hit is not None:
                _resolved.move_to_end(id(self))
                return hit[1]
        outer, offset, length, what = self._at
        real = load_embedded_head(outer, offset, length).obj
        where = f"{os.path.basename(outer.path)}[{offset}:{offset + length}]"
        if not isinstance(real, TensorRef):
            raise CorruptCheckpoint(
                f"{what}: the item at {where} is not a tensor",
                path=outer.path,
                hint="the .distcp file does not match .metadata",
            )
        if real.numel != self.numel or real.dtype != self.dtype:
            raise CorruptCheckpoint(
                f"{what}: the stored chunk at {where} is {real.dtype} {list(real.shape)}, the "
                f"metadata says {self.dtype} {list(self.shape)}",
                path=outer.path,
                hint=f"{os.path.basename(outer.path)} comes from another run",
            )
        with _resolved_lock:
            _resolved[id(self)] = (self, real)
            while len(_resolved) > RESOLVED_KEPT:
                _resolved.popitem(last=False)
        return real

    # what the record alone says: read it
    stride = property(lambda self: self.resolve().stride)
    storage_offset = property(lambda self: self.resolve().storage_offset)
    storage = property(lambda self: self.resolve().storage)
    requires_grad = property(lambda self: self.resolve().requires_grad)
    is_parameter = property(lambda self: self.resolve().is_parameter)
    subclass = property(lambda self: self.resolve().subclass)
    subclass_state = property(lambda self: self.resolve().subclass_state)
    pickled = property(lambda self: self.resolve().pickled)
    is_contiguous = property(lambda self: self.resolve().is_contiguous)  # of the stored shape and strides

    def _raw(self, start_elem: int = 0, count: int | None = None) -> memoryview:
        return self.resolve()._raw(start_elem, count)

    def read_into(
        self, out: memoryview, start_elem: int = 0, count: int | None = None, fds: FdCache | None = None
    ) -> None:
        self.resolve().read_into(out, start_elem, count, fds)

    def prefetch(self, start_elem: int = 0, count: int | None = None) -> None:
        self.resolve().prefetch(start_elem, count)

    def read_numpy(self, start_elem: int = 0, count: int | None = None):
        return self.resolve().read_numpy(start_elem, count)

    def read_torch(self, start_elem: int = 0, count: int | None = None):
        t = self.resolve().read_torch(start_elem, count)
        return t.reshape(self.shape) if start_elem == 0 and count is None and tuple(t.shape) != self.shape else t

    # the stored record decides equality (pickle_writer compares a rebuilt record with it)
    def __eq__(self, other):
        other = other.resolve() if isinstance(other, LazyTensorRef) else other
        return self.resolve() == other if isinstance(other, TensorRef) else NotImplemented

    def __hash__(self):
        return hash(self.resolve())

    def __repr__(self) -> str:
        outer, offset, length, _ = self._at
        return (
            f"LazyTensorRef(dtype={self.dtype!r}, shape={self.shape!r}, "
            f"at={os.path.basename(outer.path)}[{offset}:{offset + length}])"
        )


def _load_zip(
    path: str,
    file: io.RawIOBase | None = None,
    make_source: Callable[[str, zipfile.ZipFile, str], ZipSource] = ZipSource,
) -> Loaded:
    try:
        zf = zipfile.ZipFile(path if file is None else file)
    except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError) as e:
        # NotImplementedError: a directory entry claims a newer zip version (one flipped byte does it)
        raise CorruptCheckpoint(
            f"not a readable zip archive ({e})",
            path=path,
            hint="the file is truncated or corrupt; re-copy it or restore a backup",
        )
    with zf:
        pkl = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
        if not pkl:
            raise NotACheckpoint("zip archive without data.pkl (not written by torch.save)", path=path)
        name = min(pkl, key=len)
        prefix = name[: -len("data.pkl")]
        source = make_source(path, zf, prefix)
        bo = prefix + "byteorder"
        if bo in source._infos:
            try:
                order = zf.read(bo).decode().strip()
            except Exception:
                order = "little"
            if order != "little":
                raise CorruptCheckpoint(
                    "big-endian checkpoint", path=path, hint="re-save it on a little-endian machine"
                )
        try:
            data = zf.read(name)
        except Exception as e:
            raise CorruptCheckpoint(
                f"cannot read {name} ({type(e).__name__}: {e})",
                path=path,
                hint="the file is truncated or corrupt; re-copy it or restore a backup",
            )

    obj, seen = _unpickle(data, source, _zip_persistent(source), path)
    return Loaded(obj, "torch_zip", source, frozenset(seen))


def _zip_persistent(source: Source, named: list[StorageRef] | None = None) -> Callable[[Any], StorageRef]:
    """The persistent-id hook of a torch zip's data.pkl: ("storage", type, key, location, numel) -> a StorageRef
    read through `source`; `named`, when given, collects them."""
    types: dict[Any, tuple[str, str]] = {}  # storage type -> (dtype, its name): a few per file

    def persistent(pid):
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
        _, storage_type, key, location, numel = pid[:5]
        try:
            dtype, type_name = types[storage_type]
        except (KeyError, TypeError):
            dtype, type_name = _storage_dtype(storage_type), _storage_type_name(storage_type)
            if isinstance(storage_type, type):
                types[storage_type] = (dtype, type_name)
        # StorageRef(str(key), dtype, int(numel), str(location), source, type_name) without the frozen dataclass's
        # __init__ (one per tensor of the file)
        ref = _new(StorageRef)
        _set(ref, "key", str(key))
        _set(ref, "dtype", dtype)
        _set(ref, "numel", int(numel))
        _set(ref, "location", str(location))
        _set(ref, "source", source)
        _set(ref, "storage_type", type_name)
        if named is not None:
            named.append(ref)
        return ref

    return persistent


def _load_pickle_stream(path: str) -> Loaded:
    with open(path, "rb") as fh:
        first, seen = _unpickle(fh, None, None, path)
        if not (isinstance(first, int) and first == _LEGACY_MAGIC):
            return Loaded(first, "pickle", None, frozenset(seen))
        # legacy torch.save: magic, protocol version, sys info, the object, the storage keys, the bytes
        _unpickle(fh, None, None, path)
        _unpickle(fh, None, None, path)
        storages: dict[str, StorageRef] = {}
        offsets: dict[str, int] = {}
        source = LegacySource(path, offsets)

        def persistent(pid):
            if not isinstance(pid, tuple) or not pid or pid[0] != "storage":
                raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80}")
            _, storage_type, key, location, numel = pid[:5]
            ref = storages.get(str(key))
            if ref is None:
                ref = StorageRef(
                    str(key),
                    _storage_dtype(storage_type),
                    int(numel),
                    str(location),
                    source,
                    _storage_type_name(storage_type),
                )
                storages[str(key)] = ref
            return ref

        obj, seen2 = _unpickle(fh, source, persistent, path)
        keys, _ = _unpickle(fh, None, None, path)
        pos = fh.tell()
        size = os.fstat(fh.fileno()).st_size
        for key in keys if isinstance(keys, list) else []:
            ref = storages.get(str(key))
            if ref is None or pos + 8 > size:
                raise CorruptCheckpoint(f"legacy storage {key} missing", path=path, hint="the file is truncated")
            fh.seek(pos)
            (numel,) = struct.unpack("<q", fh.read(8))
            offsets[ref.key] = pos + 8
            pos += 8 + numel * DTYPE_SIZE.get(ref.dtype, 1)
        return Loaded(obj, "torch_legacy", source, frozenset(seen | seen2))
