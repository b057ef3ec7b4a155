"""Write a torch checkpoint back after editing a few fields, without running or importing anything.

`pickle_reader` turns a checkpoint's pickle into inert records (TensorRef, Opaque, DType, ...). This
module is its inverse: `dumps` pickles such a tree into the opcodes torch.save would have written, and
`rewrite_torch_zip` puts that pickle into a copy of the original zip whose other members (the tensor
bytes, `version`, `byteorder`, ...) are copied byte for byte. So an LR or a step counter can be edited in
a DeepSpeed optimizer file without importing deepspeed, without executing a pickled global, and without
materialising a single tensor.

Faithfulness over convenience: every record is re-emitted the way the pickle built it (the same
global, REDUCE vs NEWOBJ vs copyreg._reconstructor, the same BUILD state, the exact tensor rebuild call
with its hooks and metadata). Anything that cannot be re-emitted exactly raises `UnwritableObject`
naming its path in the tree; nothing different is ever written silently. Globals are written as
GLOBAL opcodes from their recorded names: `pickle.Pickler.save_global` would import the module to
check the name, which is exactly what must never happen with a hostile file.

The zip is laid out the way torch's writer (miniz + PyTorchStreamWriter) lays it out: each member's
local header carries a 'FB' extra field that pads its data to `.storage_alignment` (64) bytes, CRC and
sizes follow the data in a data descriptor, ZIP64 records appear where sizes or offsets pass 4 GiB, and
a ZIP64 end record is always written. torch.load's optional `calculate_storage_offsets` mode relies on
exactly this layout, and an unedited round trip reproduces the original file byte for byte.
"""

from __future__ import annotations

import _compat_pickle
import collections
import io
import mmap
import os
import pickle
import struct
import zipfile
import zlib
from dataclasses import replace
from typing import Any, BinaryIO, Callable, Iterator

from ..errors import CkptError, CorruptCheckpoint, UnsupportedCheckpoint
from .io import copy_range
from ..read.pickle_reader import (
    DType,
    NumpyArray,
    NumpyDType,
    NumpyFloat,
    NumpyInt,
    Opaque,
    RecordedCall,
    StorageRef,
    TensorRef,
    TorchSize,
    _Counter,
    _DefaultDict,
    _SAFE_GLOBALS,
)


class UnwritableObject(CkptError):
    """An object in the tree cannot be pickled back exactly as it was read (`path` is the file, if any;
    the message names the object's path inside the tree)."""


# --- dumps ----------------------------------------------------------------------------------------

#: the storage class torch names in a persistent id, per element dtype (the inverse of the reader's map)
_STORAGE_FOR_DTYPE = {
    "float64": "DoubleStorage",
    "float32": "FloatStorage",
    "float16": "HalfStorage",
    "bfloat16": "BFloat16Storage",
    "int64": "LongStorage",
    "int32": "IntStorage",
    "int16": "ShortStorage",
    "int8": "CharStorage",
    "uint8": "ByteStorage",
    "bool": "BoolStorage",
    "complex64": "ComplexFloatStorage",
    "complex128": "ComplexDoubleStorage",
}

#: real Python types the reader hands out for globals, and the global each stands for
_TYPE_GLOBALS: dict[type, tuple[str, str]] = {
    dict: ("builtins", "dict"),
    list: ("builtins", "list"),
    tuple: ("builtins", "tuple"),
    set: ("builtins", "set"),
    frozenset: ("builtins", "frozenset"),
    int: ("builtins", "int"),
    float: ("builtins", "float"),
    str: ("builtins", "str"),
    bytes: ("builtins", "bytes"),
    bool: ("builtins", "bool"),
    bytearray: ("builtins", "bytearray"),
    slice: ("builtins", "slice"),
    complex: ("builtins", "complex"),
    collections.OrderedDict: ("collections", "OrderedDict"),
    NumpyArray: ("numpy", "ndarray"),
}


class _Global:
    """A GLOBAL opcode to write: `module` and `name` as the pickle had them (Python 3 spelling)."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


def _split_dotted(dotted: str) -> tuple[str, str]:
    module, _, name = dotted.rpartition(".")
    return module, name


class _InertPickler(pickle._Pickler):
    """The pure-Python pickler, protocol 2, with every object kind dispatched here.

    Only the primitive savers of `pickle._Pickler` are reused (None, bool, int, float, str, tuple, list,
    dict: pure data); every type that would go through `save_global` or `__reduce_ex__` (bytes, set,
    OrderedDict, globals) is written here instead, so no module is ever imported.
    """

    _PRIMITIVES = {t: pickle._Pickler.dispatch[t] for t in (type(None), bool, int, float, str, tuple, list, dict)}

    def __init__(self, file: BinaryIO):
        super().__init__(file, protocol=2)
        self._globals: dict[tuple[str, str], _Global] = {}
        #: every storage the pickle refers to, by key (to check them against the archive's members)
        self.storages: dict[str, StorageRef] = {}

    # -- the entry point for every object --

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if save_persistent_id and isinstance(obj, StorageRef):
            self.save_pers(self._storage_pid(obj))
            return
        memo = self.memo.get(id(obj))
        if memo is not None:
            self.write(self.get(memo[0]))
            return
        t = type(obj)
        primitive = self._PRIMITIVES.get(t)
        if primitive is not None:
            primitive(self, obj)
            return
        saver = self._SAVERS.get(t)
        if saver is not None:
            saver(self, obj)
        elif isinstance(obj, Opaque):
            self._save_opaque(obj)
        elif isinstance(obj, type):
            self._save_type(obj)
        else:
            raise _Unwritable(obj, f"a {t.__module__}.{t.__qualname__} (not a record the reader makes)")

    # -- helpers --

    def _global(self, module: str, name: str) -> _Global:
        # one marker per name: the memo is keyed by id, so a global is written once and then fetched
        key = (module, name)
        g = self._globals.get(key)
        if g is None:
            g = self._globals[key] = _Global(module, name)
        return g

    def _write_global(self, g: _Global) -> None:
        module, name = g.module, g.name
        if "." in name:
            raise _Unwritable(g, f"global {module}.{name}: protocol 2 cannot name a nested attribute")
        # what pickle does for protocol < 3 (fix_imports): Python 2 names, which Python 3 maps back
        if (module, name) in _compat_pickle.REVERSE_NAME_MAPPING:
            module, name = _compat_pickle.REVERSE_NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.REVERSE_IMPORT_MAPPING:
            module = _compat_pickle.REVERSE_IMPORT_MAPPING[module]
        self.write(pickle.GLOBAL + f"{module}\n{name}\n".encode("utf-8"))
        self.memoize(g)

    def _call(self, func: Any, args: tuple, obj: Any, opcode: bytes = pickle.REDUCE) -> None:
        """`func(*args)` (REDUCE) or `func.__new__(func, *args)` (NEWOBJ), then memoize `obj`."""
        self.save(func)
        self.save(args)
        self.write(opcode)
        self.memoize(obj)

    def _build(self, state: Any) -> None:
        self.save(state)
        self.write(pickle.BUILD)

    # -- records and the types the reader hands out --

    def _storage_pid(self, s: StorageRef) -> tuple:
        seen = self.storages.get(s.key)
        if seen is not None and (seen.dtype, seen.numel, seen.location) != (s.dtype, s.numel, s.location):
            raise _Unwritable(s, f"storage {s.key} appears as both {seen} and {s}")
        self.storages.setdefault(s.key, s)
        stype = s.storage_type or (f"torch.{_STORAGE_FOR_DTYPE[s.dtype]}" if s.dtype in _STORAGE_FOR_DTYPE else "")
        if not stype:
            raise _Unwritable(s, f"storage {s.key}: no torch storage class for dtype {s.dtype}")
        return ("storage", self._global(*_split_dotted(stype)), s.key, s.location, s.numel)

    def _save_tensor(self, t: TensorRef) -> None:
        name, args = t.pickled if t.pickled is not None else _standard_call(t)
        # the call is re-run through the reader's inert rebuild: it must give this very record back,
        # else the record was edited after reading and the call would write the old tensor
        fn = _SAFE_GLOBALS.get(_split_dotted(name))
        if fn is None or RecordedCall(name, fn)(*args) != t:
            raise _Unwritable(
                t,
                "tensor metadata was edited (dtype/shape/stride/storage no longer match how "
                "the tensor is rebuilt); rewriting tensors is not supported",
            )
        self._call(self._global(*_split_dotted(name)), args, t)

    def _save_opaque(self, obj: Opaque) -> None:
        pickled = getattr(obj, "pickled", None)
        if pickled is not None:  # built by a safe global function (an unknown tensor subclass, numpy scalar)
            self._call(self._global(*_split_dotted(pickled[0])), pickled[1], obj)
            return
        cls = type(obj)
        made_by = getattr(obj, "made_by", "reduce")
        if obj.kwargs:
            raise _Unwritable(
                obj,
                f"{obj.cls} was built with keyword arguments (protocol 4 NEWOBJ_EX), "
                "which a protocol 2 pickle cannot express",
            )
        if made_by == "reconstructor":
            self._call(self._global("copyreg", "_reconstructor"), (cls, *obj.reconstructor_args), obj)
        else:
            self._call(cls, obj.args, obj, pickle.NEWOBJ if made_by == "newobj" else pickle.REDUCE)
        if "list" in obj.__dict__:
            self._batch_appends(iter(obj.list))
        if "items" in obj.__dict__:
            self._batch_setitems(iter(obj.items.items()))
        if obj.state is not None:
            self._build(self._opaque_state(obj))

    def _opaque_state(self, obj: Opaque) -> Any:
        slot_state = getattr(obj, "slot_state", None)
        if slot_state is None:
            return obj.state
        merged = dict(slot_state[0] or {})
        merged.update(slot_state[1] or {})
        if merged != obj.state:
            raise _Unwritable(
                obj,
                f"{obj.cls} has __slots__ and its state was edited; only unedited slotted objects can be written back",
            )
        return slot_state

    def _save_type(self, cls: type) -> None:
        if issubclass(cls, Opaque):
            parent = cls.__dict__.get("getattr_of")
            if parent is not None:  # a nested class (ShardedTensor.ProcessGroupState): getattr(parent, name)
                self._call(self._global("builtins", "getattr"), parent, cls)
                return
            g = cls.__dict__.get("pickle_global") or _split_dotted(cls.cls)
        elif cls in _TYPE_GLOBALS:
            g = _TYPE_GLOBALS[cls]
        else:
            raise _Unwritable(cls, f"class {cls.__module__}.{cls.__qualname__} is not a global the reader produces")
        self.save(self._global(*g))

    def _save_recorded(self, obj: Any) -> None:
        if obj.pickled is None:
            raise _Unwritable(obj, f"{type(obj).__name__} built by hand: how it was pickled is unknown")
        name, args = obj.pickled
        self._call(self._global(*_split_dotted(name)), args, obj)

    def _save_numpy_array(self, a: NumpyArray) -> None:
        check = NumpyArray()
        check.__setstate__(a.pickled_state)
        if a.pickled is None or (check.shape, check.dtype, check.raw) != (a.shape, a.dtype, a.raw):
            raise _Unwritable(a, "a numpy array that was built or edited by hand cannot be written back")
        self._save_recorded(a)
        self._build(a.pickled_state)

    def _save_numpy_dtype(self, d: NumpyDType) -> None:
        if d.pickled is None or str(d.pickled[1][0] if d.pickled[1] else "") != d.dtype:
            raise _Unwritable(d, "a numpy dtype that was built or edited by hand cannot be written back")
        self._save_recorded(d)
        if d.pickled_state is not None:
            self._build(d.pickled_state)

    def _save_bytes(self, b: bytes) -> None:
        # protocol 2 has no bytes opcode: Python 3 writes _codecs.encode(latin-1 text), as pickle does
        if not b:
            self._call(self._global("builtins", "bytes"), (), b)
        else:
            self._call(self._global("_codecs", "encode"), (str(b, "latin1"), "latin1"), b)

    def _save_ordered_dict(self, d: collections.OrderedDict) -> None:
        self._call(self._global("collections", "OrderedDict"), (), d)
        self._batch_setitems(iter(d.items()))
        if vars(d):  # e.g. a Module.state_dict()'s `_metadata`
            self._build(vars(d))

    def _save_default_dict(self, d: _DefaultDict) -> None:
        self._call(self._global("collections", "defaultdict"), () if d.factory is None else (d.factory,), d)
        self._batch_setitems(iter(d.items()))

    _SAVERS: dict[type, Callable[["_InertPickler", Any], None]] = {
        _Global: _write_global,
        TensorRef: _save_tensor,
        DType: lambda self, d: self.save(self._global("torch", d.name)),
        TorchSize: lambda self, s: self._call(self._global("torch", "Size"), (tuple(s),), s),
        RecordedCall: lambda self, f: self.save(self._global(*_split_dotted(f.name))),
        NumpyArray: _save_numpy_array,
        NumpyDType: _save_numpy_dtype,
        NumpyFloat: _save_recorded,
        NumpyInt: _save_recorded,
        bytes: _save_bytes,
        bytearray: lambda self, b: self._call(self._global("builtins", "bytearray"), (bytes(b),), b),
        set: lambda self, s: self._call(self._global("builtins", "set"), (list(s),), s),
        frozenset: lambda self, s: self._call(self._global("builtins", "frozenset"), (list(s),), s),
        complex: lambda self, c: self._call(self._global("builtins", "complex"), (c.real, c.imag), c),
        slice: lambda self, s: self._call(self._global("builtins", "slice"), (s.start, s.stop, s.step), s),
        collections.OrderedDict: _save_ordered_dict,
        _DefaultDict: _save_default_dict,
        _Counter: lambda self, c: self._call(self._global("collections", "Counter"), (dict(c),), c),
    }


def _standard_call(t: TensorRef) -> tuple[str, tuple]:
    """The call torch.save makes for a plain tensor or a Parameter, for a TensorRef built by hand."""
    if t.storage is None or t.subclass is not None:
        raise _Unwritable(
            t, "a tensor without storage or of a subclass, built by hand: how torch would pickle it is unknown"
        )
    requires_grad = False if t.is_parameter else t.requires_grad
    data_call = (
        "torch._utils._rebuild_tensor_v2",
        (t.storage, t.storage_offset, t.shape, t.stride, requires_grad, collections.OrderedDict()),
    )
    if not t.is_parameter:
        return data_call
    data = replace(t, requires_grad=False, is_parameter=False, pickled=data_call)
    return "torch._utils._rebuild_parameter", (data, t.requires_grad, collections.OrderedDict())


class _Unwritable(Exception):
    """Raised deep inside the pickler; `dumps` turns it into UnwritableObject with the object's path."""

    def __init__(self, obj: Any, why: str):
        super().__init__(why)
        self.obj, self.why = obj, why


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", k
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    elif isinstance(obj, TensorRef):
        yield ".pickled", obj.pickled
    elif isinstance(obj, Opaque):
        for attr in ("args", "state", "items", "list", "pickled"):
            if attr in obj.__dict__:
                yield f".{attr}", obj.__dict__[attr]


def _path_to(root: Any, target: Any) -> str:
    """Where `target` sits in `root` ("['optimizer_state_dict']['loss_scaler'].state"), for error messages."""
    stack, seen = [("obj", root)], set()
    while stack:
        path, obj = stack.pop()
        if obj is target:
            return path
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        stack.extend((path + step, child) for step, child in _children(obj))
    return "?"


def dumps(obj: Any) -> bytes:
    """Pickle a tree read by `pickle_reader` (protocol 2, as torch.save writes `data.pkl`).

    Tensors become persistent ids naming their storage keys, so the pickle only makes sense inside an
    archive that holds those storages (see `rewrite_torch_zip`). Raises `UnwritableObject`, naming the
    object's path in the tree, when a record cannot be written back exactly as it was read.
    """
    return _pickle_tree(obj, None)[0]


def _pickle_tree(obj: Any, path: str | None) -> tuple[bytes, dict[str, StorageRef]]:
    """`dumps`, plus the storages the pickle refers to by key; `path` is for error messages."""
    buf = io.BytesIO()
    pickler = _InertPickler(buf)
    try:
        pickler.dump(obj)
    except _Unwritable as e:
        raise UnwritableObject(
            f"cannot write back {_path_to(obj, e.obj)}: {e.why}",
            path=path,
            hint="leave that object unedited, or save the file with torch",
        ) from None
    except RecursionError:
        raise UnwritableObject("the object tree nests too deeply to pickle", path=path) from None
    return buf.getvalue(), pickler.storages


# --- the zip container ----------------------------------------------------------------------------

_ZIP64_LIMIT = 0xFFFFFFFF  # a size or offset at or above this needs a ZIP64 record (what miniz checks)
_UTF8 = 0x0800  # general purpose flag bit 11: UTF-8 names
_DESCRIPTOR = 0x0008  # bit 3: CRC and sizes follow the data; miniz writes no descriptor for an empty member


def _local_header(name: bytes, offset: int, size: int, alignment: int) -> bytes:
    """The local file header torch writes for a stored member at `offset`: zero CRC and sizes (they come
    in the data descriptor), a ZIP64 extra field when size or offset is large, then a 'FB' extra field
    whose padding makes the data start on an `alignment` boundary (PyTorchStreamWriter's getPadding)."""
    zip64 = b""
    if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
        # miniz: the compressed size is not known yet when a data-descriptor header is written
        fields = (struct.pack("<QQ", size, 0) if size >= _ZIP64_LIMIT else b"") + (
            struct.pack("<Q", offset) if offset >= _ZIP64_LIMIT else b""
        )
        zip64 = struct.pack("<HH", 0x0001, len(fields)) + fields
    start = offset + 30 + len(name) + len(zip64) + 4
    padding = -start % alignment
    extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
    return (
        struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra
    )


def _flags(size: int) -> int:
    return _UTF8 | _DESCRIPTOR if size else _UTF8


def _data_descriptor(crc: int, size: int, offset: int) -> bytes:
    if not size:
        return b""
    if size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT:
        return struct.pack("<IIQQ", 0x08074B50, crc, size, size)
    return struct.pack("<IIII", 0x08074B50, crc, size, size)


def _central_entry(name: bytes, offset: int, size: int, crc: int) -> bytes:
    """A central directory entry; sizes and offset at or above 4 GiB move into a ZIP64 extra field."""
    fields = b""
    if size >= _ZIP64_LIMIT:
        fields += struct.pack("<QQ", size, size)
    if offset >= _ZIP64_LIMIT:
        fields += struct.pack("<Q", offset)
    extra = struct.pack("<HH", 0x0001, len(fields)) + fields if fields else b""
    return (
        struct.pack(
            "<IHHHHHHIIIHHHHHII",
            0x02014B50,
            0,
            0,
            _flags(size),
            0,
            0,
            0,
            crc,
            _field32(size),
            _field32(size),
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            _field32(offset),
        )
        + name
        + extra
    )


def _field32(value: int) -> int:
    """A 4-byte size/offset field: the value, or 0xFFFFFFFF meaning "see the ZIP64 record"."""
    return 0xFFFFFFFF if value >= _ZIP64_LIMIT else value


def _end_records(count: int, cd_offset: int, cd_size: int) -> bytes:
    """ZIP64 end record + locator (torch writes them always), then the classic end record."""
    zip64_end = cd_offset + cd_size
    return (
        struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 45, 0, 0, count, count, cd_size, cd_offset)
        + struct.pack("<IIQI", 0x07064B50, 0, zip64_end, 1)
        + struct.pack(
            "<IHHHHIIH",
            0x06054B50,
            0,
            0,
            min(count, 0xFFFF),
            min(count, 0xFFFF),
            _field32(cd_size),
            _field32(cd_offset),
            0,
        )
    )


def _pickle_member(zf: zipfile.ZipFile, names, path) -> tuple[str, str, int]:
    """The torch zip's data.pkl member name, the archive prefix before it, and the storage alignment
    (`.storage_alignment` when the archive has one, else 64). `names`: the member names, in archive order."""
    pkl = [n for n in names if n.endswith("data.pkl") and n.count("/") <= 1]
    if not pkl:
        raise UnsupportedCheckpoint("zip archive without data.pkl (not written by torch.save)", path=path)
    pkl_name = min(pkl, key=len)
    prefix = pkl_name[: -len("data.pkl")]
    alignment_name = prefix + ".storage_alignment"
    alignment = int(zf.read(alignment_name)) if alignment_name in names else 64
    return pkl_name, prefix, alignment


def _source_members(src_path: str) -> tuple[list[zipfile.ZipInfo], dict[str, zipfile.ZipInfo], str, str, int]:
    """The members of the torch zip `src_path` in file order, by name, its pickle member's name, the archive's
    prefix and its data alignment. Refuses a file that is not a torch zip, or has compressed members."""
    with open(src_path, "rb") as fh:
        if fh.read(2) != b"PK":
            raise UnsupportedCheckpoint(
                "not a torch zip file (legacy torch.save or plain pickle); only zip checkpoints are rewritten",
                path=src_path,
                hint="re-save it once with torch.save (zip format), then edit it",
            )
    try:
        zf = zipfile.ZipFile(src_path)
    except (zipfile.BadZipFile, OSError) as e:
        raise CorruptCheckpoint(
            f"not a readable zip archive ({e})", path=src_path, hint="the file is truncated or corrupt; re-copy it"
        ) from None
    with zf:
        infos = sorted(zf.infolist(), key=lambda i: i.header_offset)
        names = {i.filename: i for i in infos}
        pkl_name, prefix, alignment = _pickle_member(zf, names, src_path)
    compressed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if compressed:
        raise UnsupportedCheckpoint(
            f"compressed zip members ({compressed[0]}, ...)",
            path=src_path,
            hint="torch.save writes stored members; re-save it with torch.save",
        )
    return infos, names, pkl_name, prefix, alignment


def _check_storages(storages: dict[str, StorageRef], names: dict, prefix: str, src_path: str) -> None:
    """Every storage the new tree refers to must be one this archive holds (at least as large), read from it."""
    for key, s in storages.items():
        member = names.get(f"{prefix}data/{key}")
        if member is None or member.file_size < s.nbytes:
            raise UnsupportedCheckpoint(
                f"the new tree refers to storage {key} ({s.nbytes} bytes), which "
                f"{os.path.basename(src_path)} does not hold",
                path=src_path,
                hint="tensors can only be kept, not added or moved between files",
            )
        if s.source is not None and not os.path.samefile(s.source.path, src_path):
            raise UnsupportedCheckpoint(
                f"storage {key} was read from {s.source.path}, not from this file",
                path=src_path,
                hint="edit the tree read from the file being rewritten",
            )


def _replaced_members(storage_bytes: dict[str, bytes] | None, names: dict, prefix: str, src_path: str) -> dict:
    """{member name: new bytes} for `storage_bytes`; each must replace an existing storage of the same size."""
    replaced = {f"{prefix}data/{key}": bytes(data) for key, data in (storage_bytes or {}).items()}
    for member, data in replaced.items():
        if member not in names or names[member].file_size != len(data):
            raise UnsupportedCheckpoint(
                f"new bytes for {member} ({len(data)} bytes) do not replace a storage of the same size",
                path=src_path,
                hint="only the values of existing storages can be replaced",
            )
    return replaced


def _write_members(
    src_path: str,
    dst_path: str,
    infos: list[zipfile.ZipInfo],
    new: dict[str, bytes],
    alignment: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Write `dst_path`: the members `infos` in order, those in `new` with their new bytes, every other one
    copied byte for byte from `src_path` (in the kernel where it can), then the central directory; fsynced."""
    total = sum(len(new[i.filename]) if i.filename in new else i.file_size for i in infos)
    done = 0
    with open(src_path, "rb") as src, open(dst_path, "wb") as dst:
        src_map = mmap.mmap(src.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            out = ZipWriter(dst.fileno(), alignment)

            def copied(info: zipfile.ZipInfo) -> Callable[[int, int], int]:
                def write(fd: int, data_at: int) -> int:  # byte for byte, so the central directory's CRC holds
                    copy_range(src.fileno(), fd, _data_offset(src_map, info, src_path), data_at, info.file_size)
                    return info.CRC

                return write

            for info in infos:
                data = new.get(info.filename)
                if data is not None:
                    out.add(info.filename, data)
                    size = len(data)
                else:
                    size = info.file_size
                    out.add_written(info.filename, size, copied(info))
                done += size
                if progress is not None:
                    progress(done, total)
            out.finish()
            os.fsync(dst.fileno())
        finally:
            src_map.close()


def rewrite_torch_zip(
    src_path: str | os.PathLike,
    dst_path: str | os.PathLike,
    new_obj: Any,
    *,
    progress: Callable[[int, int], None] | None = None,
    storage_bytes: "dict[str, bytes] | None" = None,
    prune: bool = False,
) -> None:
    """Write `dst_path`: the torch zip `src_path` with its pickle replaced by `dumps(new_obj)`.

    Every other member is copied byte for byte in the original order (tensor bytes are never decoded
    or held in memory), keeping its CRC from the central directory. Refuses (UnsupportedCheckpoint) a
    file that is not a torch zip (the legacy pre-1.6 format included) or has compressed members, and
    a tree whose tensors point at storages the archive does not hold. `dst_path` is written in place and
    fsynced; callers write it outside the checkpoint and rename it over the original (see `io.execute`).
    `progress(done, total)` is called with bytes written.

    `storage_bytes` {storage key: bytes} gives new VALUES for a few storages (e.g. a 0-d Adam `step`):
    those members get exactly these bytes (same length as before: metadata cannot change here) and a
    new CRC-32; every other member is still copied byte for byte.

    `prune`: leave out the storages the new tree no longer refers to (a part of a file written as a file of its
    own: what torch.save of that part would hold).
    """
    src_path, dst_path = os.fspath(src_path), os.fspath(dst_path)
    infos, names, pkl_name, prefix, alignment = _source_members(src_path)
    if os.path.exists(dst_path) and os.path.samefile(src_path, dst_path):
        raise UnsupportedCheckpoint(
            "the rewrite would overwrite the file it copies from",
            path=dst_path,
            hint="write to a new path, then rename it over the original",
        )
    pickle_bytes, storages = _pickle_tree(new_obj, src_path)
    _check_storages(storages, names, prefix, src_path)
    replaced = _replaced_members(storage_bytes, names, prefix, src_path)
    if prune:
        used = {f"{prefix}data/{key}" for key in storages}
        infos = [i for i in infos if not i.filename.startswith(f"{prefix}data/") or i.filename in used]
    _write_members(src_path, dst_path, infos, {**replaced, pkl_name: pickle_bytes}, alignment, progress)


class ZipWriter:
    """Stored zip members written one after another into the open file `fd` from byte 0, laid out as torch's
    writer lays them out (`_local_header`, data, `_data_descriptor`; then the central directory and end records).

    Headers and small members are gathered and written with one `pwrite` before each large member and at the
    end, so a file of a few members costs a few system calls. `add_written(name, size, write)` leaves the data
    to `write(fd, data_at)`, which puts exactly `size` bytes at `data_at` (a kernel copy from another file,
    say) and returns their CRC-32."""

    #: members up to this size go through the gathered buffer (the pickle, version records, small tensors)
    SMALL = 1 << 16

    def __init__(self, fd: int, alignment: int = 64):
        self.fd, self.alignment = fd, alignment
        self.offset = 0  # where the next local header goes
        self.names: list[str] = []
        self.crcs: list[int] = []
        self.sizes: list[int] = []
        self._central: list[bytes] = []
        self._pending: list[bytes] = []
        self._pending_at = 0

    def _queue(self, data: bytes) -> None:
        if not self._pending:
            self._pending_at = self.offset
        self._pending.append(data)
        self.offset += len(data)

    def flush(self) -> None:
        if self._pending:
            buf = b"".join(self._pending)
            self._pending.clear()
            _pwrite_all(self.fd, memoryview(buf), self._pending_at)

    def _member(self, name: str, size: int, data: bytes | None, write) -> None:
        encoded = name.encode("utf-8")
        start = self.offset
        self._queue(_local_header(encoded, start, size, self.alignment))
        if data is not None:
            crc = zlib.crc32(data)
            if size:
                self._queue(bytes(data))
        else:
            self.flush()
            crc = write(self.fd, self.offset)
            self.offset += size
        self._queue(_data_descriptor(crc, size, start))
        self._central.append(_central_entry(encoded, start, size, crc))
        self.names.append(name)
        self.crcs.append(crc)
        self.sizes.append(size)

    def add(self, name: str, data: bytes | memoryview) -> None:
        """A member holding `data` (any bytes-like object; a large one is written from where it lies)."""
        view = memoryview(data).cast("B")
        if view.nbytes <= self.SMALL:
            self._member(name, view.nbytes, view, None)
        else:
            self._member(name, view.nbytes, None, lambda fd, at: _pwrite_all(fd, view, at))

    def add_written(self, name: str, size: int, write: Callable[[int, int], int]) -> None:
        """A member of `size` bytes that `write(fd, data_at)` puts in place, returning their CRC-32."""
        self._member(name, size, None, write)

    def finish(self) -> int:
        """Write the central directory and the end records; returns the file's size."""
        directory = b"".join(self._central)
        at = self.offset
        self._queue(directory + _end_records(len(self._central), at, len(directory)))
        self.flush()
        return self.offset


def _pwrite_all(fd: int, view: memoryview, at: int) -> int:
    """pwrite all of `view` at `at`; returns its CRC-32."""
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], at + done)
    return zlib.crc32(view)


def _data_offset(src_map, info: zipfile.ZipInfo, path: str) -> int:
    header = src_map[info.header_offset : info.header_offset + 30]
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        raise CorruptCheckpoint(
            f"bad local header for zip member {info.filename}", path=path, hint="the file is corrupt; re-copy it"
        )
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    start = info.header_offset + 30 + name_len + extra_len
    if start + info.file_size > len(src_map):
        raise CorruptCheckpoint(
            f"zip member {info.filename} runs past the end of the file",
            path=path,
            hint="the file is truncated; re-copy it",
        )
    return start
