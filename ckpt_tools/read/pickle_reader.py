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
"""

from __future__ import annotations

import contextvars
import io
import mmap
import os
import pickle
import struct
import threading
import types
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

from . import allowlist, native_walk, remote
from ..errors import CorruptCheckpoint, NotACheckpoint

# --- dtypes -----------------------------------------------------------------------------------------

#: element size in bytes per dtype name (torch spelling without the "torch." prefix)
DTYPE_SIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}

_STORAGE_DTYPE = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
    "UntypedStorage": "uint8",
}

# torch dtype attribute names that alias a canonical name
_DTYPE_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "cfloat": "complex64",
    "cdouble": "complex128",
}

_STRUCT = {
    "float64": "d",
    "float32": "f",
    "float16": "e",
    "int64": "q",
    "int32": "i",
    "int16": "h",
    "int8": "b",
    "uint8": "B",
    "bool": "?",
    "uint16": "H",
    "uint32": "I",
    "uint64": "Q",
}

_new = object.__new__
_set = object.__setattr__

#: tensors up to this many elements get their values read when a tree is built (step counters etc.)
SMALL_TENSOR_NUMEL = 16


def _decode(dtype: str, raw: bytes, count: int) -> list:
    if dtype == "bfloat16":
        halves = struct.unpack(f"<{count}H", raw[: 2 * count])
        return [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in halves]
    fmt = _STRUCT.get(dtype)
    if fmt is None:
        raise ValueError(f"no scalar decoding for dtype {dtype}")
    return list(struct.unpack(f"<{count}{fmt}", raw[: DTYPE_SIZE[dtype] * count]))


# --- inert records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DType:
    """A `torch.<dtype>` global seen in a pickle (e.g. a DCP `TensorProperties.dtype`)."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class StorageRef:
    """One torch storage: its element dtype and size, and where its bytes lie in `source`."""

    key: str
    dtype: str
    numel: int
    location: str
    source: "Source" = field(repr=False, compare=False)
    #: the storage global the persistent id named ("torch.FloatStorage"); pickle_writer re-emits it
    storage_type: str = field(default="", repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZE.get(self.dtype, 1)


class FdCache:
    """One read-only descriptor per file, shared by threads (pread has no file position), for
    `TensorRef.read_into`. Close it when done."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def get(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = os.open(path, os.O_RDONLY)
                    self._sizes[path] = os.fstat(fd).st_size
                    self._fds[path] = fd
        return fd

    def size(self, path: str) -> int:
        self.get(path)
        return self._sizes[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._sizes.clear()


class _Numel:
    """`TensorRef.numel`, asked for per piece when un-flattening: the product of `shape`, computed once and kept on
    the record (the record is frozen), as `functools.cached_property` would, without the lock Python 3.11's takes on
    every first access (18k in a ZeRO model-states file)."""

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        n = 1
        for s in obj.shape:
            n *= s
        _set(obj, "numel", n)
        return n


@dataclass(frozen=True)
class TensorRef:
    """A tensor seen in a pickle: metadata plus a pointer to its bytes. Reading them is on demand."""

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: StorageRef | None  # None for meta/empty tensors that have no storage
    requires_grad: bool = False
    is_parameter: bool = False
    subclass: str | None = None  # e.g. "torch.nn.parameter.Parameter" via _rebuild_from_type_v2
    # what a tensor subclass's pickle carried beside its metadata: for a ShardedTensor the tuple
    # (local shards, ShardedTensorMetadata, process-group state, sharding spec, init_rrefs)
    subclass_state: Any = field(default=None, repr=False, compare=False)
    # the rebuild call the pickle made: (global dotted name, args). pickle_writer re-emits exactly this
    # call (backward hooks, metadata, layout and device included), after checking it still yields this
    # record; None for a TensorRef built by hand
    pickled: Any = field(default=None, repr=False, compare=False)

    numel = _Numel()  # not a field (no annotation): computed from `shape` when first asked

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZE.get(self.dtype, 1)

    @property
    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for s in reversed(self.shape):
            expected.append(acc)
            acc *= s
        dims = [(sz, st, ex) for sz, st, ex in zip(self.shape, self.stride, reversed(expected))]
        return all(sz == 1 or st == ex for sz, st, ex in dims)

    def _raw(self, start_elem: int = 0, count: int | None = None) -> memoryview:
        if self.storage is None:
            raise ValueError("tensor has no storage")
        if not self.is_contiguous:
            raise ValueError("non-contiguous tensor: read it with read_numpy()")
        esize = DTYPE_SIZE[self.dtype]
        count = self.numel if count is None else count
        begin = (self.storage_offset + start_elem) * esize
        return self.storage.source.read_storage(self.storage, begin, count * esize)

    def read_into(
        self, out: memoryview, start_elem: int = 0, count: int | None = None, fds: FdCache | None = None
    ) -> None:
        """Copy the raw bytes of flattened elements [start, start+count) into `out` with `os.preadv`.

        Unlike the mmap view `read_numpy` gives, nothing stays resident afterwards: each page read through a
        mapping counts in the process's RSS for as long as the file's Source lives (the whole tree), so
        reading every tensor of a 2 GB checkpoint that way shows 2 GB of RSS. A strided view or a source
        without a file offset is copied through the mapping instead. `fds` keeps one descriptor per file."""
        count = self.numel if count is None else count
        if self.storage is None:
            raise ValueError("tensor has no storage")
        esize = DTYPE_SIZE[self.dtype]
        src = self.storage.source
        try:
            base = src.storage_offset(self.storage) if self.is_contiguous else None
        except NotImplementedError:
            base = None
        if base is None or getattr(src, "path", None) is None or fds is None:
            out[:] = memoryview(self.read_numpy(start_elem, count).tobytes()).cast("B")
            return
        begin = (self.storage_offset + start_elem) * esize
        if begin < 0 or count < 0 or begin + count * esize > self.storage.nbytes or len(out) != count * esize:
            raise CorruptCheckpoint(
                f"tensor bytes of storage {self.storage.key} lie outside the file",
                path=src.path,
                hint="the file is truncated; re-copy it",
            )
        if remote._MOUNTS:
            remote.ensure(src.path, base + begin, len(out))
        fd, offset, done = fds.get(src.path), base + begin, 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpoint(
                    f"tensor bytes of storage {self.storage.key} lie outside the file",
                    path=src.path,
                    hint="the file is truncated; re-copy it",
                )
            done += n

    def prefetch(self, start_elem: int = 0, count: int | None = None) -> None:
        """Start reading elements [start, start+count) from disk in the background (see Source.prefetch)."""
        if self.storage is None or not self.is_contiguous or self.storage.source is None:
            return
        esize = DTYPE_SIZE[self.dtype]
        count = self.numel if count is None else count
        self.storage.source.prefetch(self.storage, (self.storage_offset + start_elem) * esize, count * esize)

    def read_bytes(self) -> bytes:
        """The tensor's raw bytes (contiguous tensors; no numpy, no torch)."""
        return bytes(self._raw())

    def read_values(self) -> list:
        """The elements as Python numbers, flattened (for small tensors: counters, scalars)."""
        if self.numel == 0:
            return []
        return _decode(self.dtype, bytes(self._raw()), self.numel)

    def item(self):
        """The value of a one-element tensor (e.g. Adam's `step`)."""
        if self.numel != 1:
            raise ValueError(f"item() on a tensor of shape {self.shape}")
        return self.read_values()[0]

    def read_numpy(self, start_elem: int = 0, count: int | None = None):
        """A read-only numpy view (mmap-backed) of the flattened elements [start, start+count).

        bfloat16 comes back as uint16 bit patterns (numpy has no bf16); use `read_torch()` for a tensor.
        """
        import numpy as np

        npd = {"bfloat16": np.uint16, "bool": np.bool_}.get(self.dtype) or np.dtype(self.dtype)
        if self.is_contiguous:
            return np.frombuffer(self._raw(start_elem, count), dtype=npd)
        # a view into a larger storage with odd strides: materialise via as_strided on the storage
        full = np.frombuffer(self.storage.source.read_storage(self.storage, 0, self.storage.nbytes), dtype=npd)
        esize = DTYPE_SIZE[self.dtype]
        arr = np.lib.stride_tricks.as_strided(
            full[self.storage_offset :], shape=self.shape, strides=[s * esize for s in self.stride]
        )
        flat = arr.reshape(-1)
        return flat[start_elem : None if count is None else start_elem + count]

    def read_torch(self, start_elem: int = 0, count: int | None = None):
        """A torch tensor (a copy) of the flattened elements, in the saved dtype; shaped when whole."""
        import torch

        arr = self.read_numpy(start_elem, count)
        t = torch.from_numpy(arr.copy())
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        if start_elem == 0 and count is None:
            t = t.reshape(self.shape)
        return t


#: the keyword arguments of an Opaque built without any (shared, read-only)
_NO_KWARGS = types.MappingProxyType({})


class Opaque:
    """An object of a class this reader does not know (or will not run). Records what the pickle says.

    `cls` is the dotted name of the global; `args` the constructor/reduce arguments; `state` what BUILD
    set; `items`/`list` what SETITEMS/APPENDS added (for dict/list subclasses). `made_by` says which
    opcode built it ("reduce": the global was called; "newobj": `cls.__new__(cls, *args)`;
    "reconstructor": `copyreg._reconstructor(cls, *reconstructor_args)`), so that pickle_writer can
    build it the same way again.
    """

    cls: str = "?"
    # what a record built by NEWOBJ holds until its pickle says otherwise, as class attributes (a 120k-item DCP
    # .metadata is 600k records: three attributes fewer to set on each; `args` is set on each, since the readers that
    # compare two records look into `__dict__` for it)
    kwargs: Any = _NO_KWARGS  # no empty dict of its own: 38 MB of empty dicts in that .metadata
    state: Any = None
    made_by: str = "newobj"

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.made_by = "reduce"  # __init__ runs only when the pickle called the global (REDUCE)

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args = args
        if kwargs:
            obj.kwargs = kwargs
        return obj

    def __setstate__(self, state):
        # dataclasses with slots pickle (None, slotsdict); plain objects pickle their __dict__
        if type(state) is dict:
            self.state = state
            return
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            self.slot_state = state  # the (dict, slots) pair as pickled: a slotted class needs it back
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            state = merged
        self.state = state

    def __setitem__(self, key, value):
        self.__dict__.setdefault("items", {})[key] = value

    def append(self, value):
        self.__dict__.setdefault("list", []).append(value)

    def extend(self, values):
        self.__dict__.setdefault("list", []).extend(values)

    def __call__(self, *args, **kwargs):
        # hostile chains call what a call returned (getattr(__import__('os'), 'system')(cmd)): record that
        # call as one more inert placeholder, so the file still reads and its globals get reported
        _flag(f"a call of what {self.cls} built")
        return opaque_class(f"{self.cls}.__call__")(self, *args)

    def field(self, name: str, default=None):
        """A field from the BUILD state (dataclasses, plain objects), else `default`."""
        if isinstance(self.state, dict):
            return self.state.get(name, default)
        return default

    def __repr__(self) -> str:
        return f"<{self.cls}>"


_placeholder_cache: dict[str, type] = {}
_placeholder_lock = threading.Lock()


def opaque_class(dotted: str) -> type:
    """The placeholder class standing for the global `dotted` (one per name, so identity comparisons work)."""
    with _placeholder_lock:
        cls = _placeholder_cache.get(dotted)
        if cls is None:
            cls = type(dotted.rsplit(".", 1)[-1], (Opaque,), {"cls": dotted, "__module__": "ckpt_tools.opaque"})
            _placeholder_cache[dotted] = cls
        return cls


def is_opaque(obj: Any, dotted: str | None = None) -> bool:
    return isinstance(obj, Opaque) and (dotted is None or obj.cls == dotted or obj.cls.endswith("." + dotted))


@dataclass
class NumpyArray:
    """A pickled numpy array (RNG states): shape and dtype; the raw bytes are kept (they are in the pickle)."""

    shape: tuple = ()
    dtype: str = "?"
    raw: bytes = b""
    # the `_reconstruct` call and the BUILD state as pickled, for pickle_writer
    pickled: Any = field(default=None, repr=False, compare=False)
    pickled_state: Any = field(default=None, repr=False, compare=False)

    def __setstate__(self, state):
        # (version, shape, dtype, is_fortran, rawdata)
        self.pickled_state = state
        try:
            _, shape, dt, _, raw = state
            self.shape = tuple(shape)
            self.dtype = dt.dtype if isinstance(dt, NumpyDType) else str(dt)
            self.raw = raw if isinstance(raw, (bytes, bytearray)) else b""
        except (TypeError, ValueError):
            pass


@dataclass
class NumpyDType:
    dtype: str = "?"
    pickled: Any = field(default=None, repr=False, compare=False)
    pickled_state: Any = field(default=None, repr=False, compare=False)

    def __setstate__(self, state):
        self.pickled_state = state  # (version, byte order, ...): only pickle_writer needs it


# --- the unpickler --------------------------------------------------------------------------------


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if (
        type(storage) is StorageRef
        and type(storage_offset) is int
        and type(size) is tuple
        and type(stride) is tuple
        and type(requires_grad) is bool
        and _NESTING_TYPES.isdisjoint(map(type, size))
        and _NESTING_TYPES.isdisjoint(map(type, stride))
    ):
        # the call torch.save writes for every tensor (18k in a ZeRO model-states file): the record below, its fields
        # set in `__init__`'s order without the frozen dataclass's `__init__` and the two `_flat_tuple` copies
        t = _new(TensorRef)
        _set(t, "dtype", storage.dtype)
        _set(t, "shape", size)
        _set(t, "stride", stride)
        _set(t, "storage_offset", storage_offset)
        _set(t, "storage", storage)
        _set(t, "requires_grad", requires_grad)
        _set(t, "is_parameter", False)
        _set(t, "subclass", None)
        _set(t, "subclass_state", None)
        _set(t, "pickled", None)
        return t
    dtype = storage.dtype if isinstance(storage, StorageRef) else "uint8"
    return TensorRef(
        dtype,
        _flat_tuple(size, "tensor size"),
        _flat_tuple(stride, "tensor stride"),
        int(storage_offset),
        storage if isinstance(storage, StorageRef) else None,
        bool(requires_grad),
    )


def _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, backward_hooks, dtype, metadata=None):
    t = _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad)
    name = dtype.name if isinstance(dtype, DType) else t.dtype
    st = t.storage
    if st is not None and st.dtype != name:
        st = StorageRef(
            st.key,
            name,
            st.numel // DTYPE_SIZE.get(name, 1) if st.dtype == "uint8" else st.numel,
            st.location,
            st.source,
            st.storage_type,
        )
    return TensorRef(name, t.shape, t.stride, t.storage_offset, st, t.requires_grad)


def _rebuild_legacy(storage, storage_offset, size, stride):
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=True, backward_hooks=None, state=None):
    if isinstance(data, TensorRef):
        return TensorRef(
            data.dtype,
            data.shape,
            data.stride,
            data.storage_offset,
            data.storage,
            bool(requires_grad),
            True,
            data.subclass,
        )
    return data


def _rebuild_from_type_v2(func, new_type, args, state):
    ret = func(*args)
    if isinstance(ret, TensorRef):
        name = getattr(new_type, "cls", None) or getattr(new_type, "__name__", None)
        is_param = name is not None and name.endswith("Parameter")
        return TensorRef(
            ret.dtype,
            ret.shape,
            ret.stride,
            ret.storage_offset,
            ret.storage,
            ret.requires_grad,
            ret.is_parameter or is_param,
            None if is_param else name,
            None if is_param else state,
        )
    return ret


def _rebuild_meta(dtype, size, stride, requires_grad=False):
    name = dtype.name if isinstance(dtype, DType) else "?"
    return TensorRef(
        name, _flat_tuple(size, "tensor size"), _flat_tuple(stride, "tensor stride"), 0, None, bool(requires_grad)
    )


def _rebuild_wrapper_subclass(cls, dtype, size, stride, storage_offset, layout, device, requires_grad):
    name = dtype.name if isinstance(dtype, DType) else "?"
    return TensorRef(
        name,
        _flat_tuple(size, "tensor size"),
        _flat_tuple(stride, "tensor stride"),
        int(storage_offset),
        None,
        bool(requires_grad),
        subclass=getattr(cls, "cls", None),
    )


#: while a pickle is parsed: the set its flagged calls go to (see `_flag`)
_FLAGGED: contextvars.ContextVar[set | None] = contextvars.ContextVar("ckpt_pickle_flagged", default=None)


def _flag(what: str) -> None:
    """Record a call a full unpickler would make beyond the globals the pickle names: it joins the file's
    globals and is reported (and refused) like an unknown one."""
    seen = _FLAGGED.get()
    if seen is not None:
        seen.add(what)


def _safe_getattr(obj, name, *default):
    # ShardedTensor pickles reach a nested class with getattr(ShardedTensor, "ProcessGroupState").
    # Only placeholder classes are looked into (giving another placeholder); a real object never is,
    # since getattr chains on real objects are how hostile pickles reach os.system. A full unpickler runs the
    # getattr for real, so anything but a listed nested class is flagged.
    if isinstance(obj, type) and issubclass(obj, Opaque) and isinstance(name, str):
        if not allowlist.is_allowed_nested(obj.cls, name):
            _flag(f"getattr({obj.cls}, {name!r})")
        nested = opaque_class(f"{obj.cls}.{name}")
        nested.getattr_of = (obj, name)  # a pickle can only reach it this way again (no dotted GLOBAL)
        return nested
    _flag(f"getattr(<{getattr(obj, 'cls', type(obj).__name__)}>, {str(name)[:40]!r})")
    return opaque_class("builtins.getattr")(obj, name)


class TorchSize(tuple):
    """A `torch.Size` seen in a pickle: a tuple that remembers it was a Size, so that a rewrite saves a
    Size again (DeepSpeed's zero_to_fp32 calls `.numel()` on `param_shapes` values)."""


def _torch_size(dims=()):
    # `TorchSize(_flat_tuple(dims, "torch.Size"))` in one call and one tuple: 4 per item of a DCP .metadata
    size = TorchSize(dims)
    if _NESTING_TYPES.isdisjoint(map(type, size)):
        return size
    raise pickle.UnpicklingError("torch.Size of items that are tuples (a tuple nested out of the walk's sight)")


def _tuple_call(items=()):
    return _flat_tuple(items, "tuple()")


#: what hashing recurses into: a tuple made by a call may not hold one (see _flat_tuple)
_NESTING_TYPES = frozenset({tuple, TorchSize, slice})


def _flat_tuple(items, what: str) -> tuple:
    """tuple(items) for a call the pickle makes (`tuple(x)`, `torch.Size(x)`, a tensor's size and stride),
    refused when an item is a tuple or a slice.

    check_expansion bounds how deep the tuples the pickle's opcodes build nest, but a call reads a list's items
    as they are when it is made: a list filled after the walk last saw it (through a memo reference) hands over
    items the walk did not count, and hashing a tuple (a dict key) recurses in C without a limit. Other items
    (numbers, strings, tensors, objects) hash without recursing, or not at all, so a tuple made by a call stays
    a few levels deep whatever the list held. No pickler calls these with tuples inside."""
    t = tuple(items)
    if not _NESTING_TYPES.isdisjoint(map(type, t)):  # (in C)
        raise pickle.UnpicklingError(f"{what} of items that are tuples (a tuple nested out of the walk's sight)")
    return t


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    # protocol-2 pickles of `bytes` go through _codecs.encode(str, "latin1"): pure data, safe to run
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1", "utf-8", "utf8"):
        raise pickle.UnpicklingError("unexpected _codecs.encode call")
    return obj.encode(encoding, errors)


def _reconstructor(cls, base, state=None):
    # protocol 0/1 object pickles: copyreg._reconstructor(cls, object, None); state follows via BUILD
    if isinstance(cls, type) and issubclass(cls, Opaque):
        obj = cls.__new__(cls)
        obj.made_by, obj.reconstructor_args = "reconstructor", (base, state)
        return obj
    if cls in (dict, list, set, collections_OrderedDict):
        return cls()
    raise pickle.UnpicklingError("copyreg._reconstructor on an unexpected class")


def _numpy_scalar(dtype, raw=b""):
    name = dtype.dtype if isinstance(dtype, NumpyDType) else str(dtype)
    code = name.lstrip("<>|=")
    fmt = {
        "f8": "d",
        "f4": "f",
        "f2": "e",
        "i8": "q",
        "i4": "i",
        "i2": "h",
        "i1": "b",
        "u8": "Q",
        "u4": "I",
        "u2": "H",
        "u1": "B",
        "b1": "?",
    }.get(code)
    if fmt and isinstance(raw, (bytes, bytearray)) and len(raw) == struct.calcsize(fmt):
        value = struct.unpack("<" + fmt, raw)[0]
        if isinstance(value, bool):  # numpy.bool_ stays a bool: bool cannot be subclassed
            return value
        return NumpyFloat(value) if isinstance(value, float) else NumpyInt(value)
    return opaque_class("numpy.generic")(name, raw)


class NumpyFloat(float):
    """A numpy float scalar read as a Python float; `pickled` (set when read) lets a rewrite save it as
    the numpy scalar it was."""


class NumpyInt(int):
    """A numpy integer scalar read as a Python int (see NumpyFloat)."""


def _numpy_reconstruct(cls, shape=(0,), dtype=b"b"):
    return NumpyArray()


def _numpy_dtype(spec, align=False, copy=False):
    return NumpyDType(str(spec))


def _no_size_arg(ctor):
    # bytes(n) / bytearray(n) allocate and zero n bytes: a 60-byte pickle can ask for 64 GiB. Pickles
    # only ever call them with data (bytes, or text plus an encoding), never with a size.
    def build(*args):
        if args and isinstance(args[0], int):
            raise pickle.UnpicklingError(f"{ctor.__name__}() called with a size ({args[0]})")
        return ctor(*args)

    return build


import collections  # noqa: E402  (kept next to its only use)

collections_OrderedDict = collections.OrderedDict


class _DefaultDict(dict):
    """collections.defaultdict without its factory (the factory would be code); `factory` is the inert
    record of the global it named, kept for pickle_writer."""

    def __init__(self, factory=None, *args):
        super().__init__(*args)
        self.factory = factory


class _Counter(dict):
    """collections.Counter as a plain dict that remembers it was a Counter (for pickle_writer)."""


_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("collections", "defaultdict"): _DefaultDict,
    ("collections", "Counter"): _Counter,
    ("builtins", "getattr"): _safe_getattr,
    ("__builtin__", "getattr"): _safe_getattr,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): _no_size_arg(bytearray),
    ("builtins", "list"): list,
    ("builtins", "dict"): dict,
    ("builtins", "tuple"): _tuple_call,  # a RecordedCall: stays writable as the `tuple` global
    ("builtins", "int"): int,
    ("builtins", "float"): float,
    ("builtins", "str"): str,
    ("builtins", "bytes"): _no_size_arg(bytes),
    ("builtins", "bool"): bool,
    ("__builtin__", "set"): set,
    ("_codecs", "encode"): _codecs_encode,
    ("copy_reg", "_reconstructor"): _reconstructor,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_legacy,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): _rebuild_meta,
    ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
    ("torch", "Size"): _torch_size,
    ("numpy.core.multiarray", "scalar"): _numpy_scalar,
    ("numpy._core.multiarray", "scalar"): _numpy_scalar,
    ("numpy.core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _numpy_reconstruct,
    ("numpy", "dtype"): _numpy_dtype,
    ("numpy", "ndarray"): NumpyArray,
}

#: safe globals whose results remember the call that made them (`pickled`), for pickle_writer
_RECORDED_CALLS = frozenset(
    {
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._tensor._rebuild_from_type_v2",
        "torch._utils._rebuild_meta_tensor_no_storage",
        "torch._utils._rebuild_wrapper_subclass",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.dtype",
        "builtins.tuple",  # only so that the call goes through _tuple_call, and the global still reads as itself
    }
)


class RecordedCall:
    """A safe global function as the pickle named it. Calling it runs the inert rebuild and stores
    `(name, args)` on the result (`pickled`), because the record alone loses what pickle_writer needs to
    emit the same call again: which of two aliases was named, backward hooks, layout, device."""

    def __init__(self, name: str, fn: Callable):
        self.name = name
        self.fn = fn

    def __repr__(self) -> str:  # a global as a value (a type annotation saved in a config) prints as its name
        return self.name

    def __call__(self, *args):
        ret = self.fn(*args)
        call = (self.name, args)
        if isinstance(ret, TensorRef):
            # `ret` was made by this call and nothing else holds it yet: fill in the field instead of copying
            # the frozen record (`dataclasses.replace` costs ~3 us, once per tensor of the checkpoint)
            object.__setattr__(ret, "pickled", call)
            return ret
        if type(ret) in (NumpyFloat, NumpyInt, NumpyArray, NumpyDType) or (
            isinstance(ret, Opaque) and not any(a is ret for a in args)
        ):
            ret.pickled = call  # e.g. an unknown tensor subclass behind _rebuild_from_type_v2
        return ret


def resolve_global(module: str, name: str) -> Any:
    """What the inert unpickler puts where a pickle names the global `module.name`: a safe function or class, a
    `DType`, or the placeholder class (`opaque_class`); nothing is imported."""
    hit = _SAFE_GLOBALS.get((module, name))
    if hit is not None:
        dotted = f"{module}.{name}"
        return RecordedCall(dotted, hit) if dotted in _RECORDED_CALLS else hit
    if module == "torch":
        if name.endswith("Storage"):
            return opaque_class(f"torch.{name}")  # used only as the storage type in persistent ids
        canonical = _DTYPE_ALIASES.get(name, name)
        if canonical in DTYPE_SIZE:
            return DType(canonical)
    if module == "torch.storage" and name in ("UntypedStorage", "TypedStorage", "_LegacyStorage"):
        return opaque_class(f"torch.{name}")
    cls = opaque_class(f"{module}.{name}")
    if "pickle_global" not in cls.__dict__:
        cls.pickle_global = (module, name)  # the dotted name alone does not say where the module ends
    return cls


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


def _storage_dtype(storage_type) -> str:
    name = getattr(storage_type, "cls", str(storage_type)).rsplit(".", 1)[-1]
    return _STORAGE_DTYPE.get(name, "uint8")


def _storage_type_name(storage_type) -> str:
    return getattr(storage_type, "cls", "")


# --- sources: where the bytes are ------------------------------------------------------------------


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


# --- entry points ---------------------------------------------------------------------------------


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


#: the most items a tuple may expand to (shared sub-tuples counted every time they appear); legitimate
#: checkpoint tuples (shapes, persistent ids, RNG states) stay in the thousands
MAX_TUPLE_EXPANSION = 1_000_000
#: the most expanded tuple items the whole stream may re-reference through the memo or DUP
MAX_SHARED_EXPANSION = 10_000_000
#: the most levels containers may nest (a tuple in a tuple, a dict in a list, an object's state, ...). Hashing a
#: tuple recurses in C without a limit: a 300,000-deep tuple used as a dict key kills the process (SIGSEGV),
#: whichever unpickler builds the dict. The deepest sample pickle nests 18 levels (FSDP1's sharded state dict:
#: ShardedTensor metadata inside optimizer state); 256 also keeps what recurses in Python over the tree clear of
#: its 1,000-frame limit.
MAX_NESTING = 256
_U32, _U64 = struct.Struct("<I").unpack_from, struct.Struct("<Q").unpack_from
# a walk's stack slot packs (nesting depth << _DEPTH_SHIFT) | expanded width (see _walk_expansion)
_DEPTH_SHIFT = 40
_WIDTH = (1 << _DEPTH_SHIFT) - 1
# what the expansion walk does with an opcode
(_GENERIC, _GET, _PUT, _MEMOIZE, _MARKOP, _DUP, _TUPLE_TO_MARK, _NEW_TO_MARK, _FILL_TO_MARK, _FILL, _TUPLE_N, _STOP) = (
    range(12)
)
#: opcodes pushing a leaf (width 1) / an empty container that may be filled (width 0), without an argument
_LEAF_OPS = frozenset(b")N\x88\x89")  # EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
_EMPTY_CONTAINER_OPS = frozenset(b"}]\x8f")  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
#: opcode byte -> (kind, argument size as pickletools gives it, two text lines?, pops, pushes, name)
_OPS: list[tuple[int, int, bool, int, int, str] | None] = []


def _op_table() -> list:
    import pickletools

    if not _OPS:
        _OPS.extend([None] * 256)
        for op in pickletools.opcodes:
            name, to_mark = op.name, pickletools.markobject in op.stack_before
            kind = (
                _GET
                if name in ("GET", "BINGET", "LONG_BINGET")
                else _PUT
                if name in ("PUT", "BINPUT", "LONG_BINPUT")
                else _MEMOIZE
                if name == "MEMOIZE"
                else _MARKOP
                if name == "MARK"
                else _DUP
                if name == "DUP"
                else _TUPLE_TO_MARK
                if name in ("TUPLE", "FROZENSET")
                # fill the container below the MARK (it stays on the stack) / build one from what lies above
                else _FILL_TO_MARK
                if name in ("APPENDS", "SETITEMS", "ADDITEMS")
                else _NEW_TO_MARK
                if to_mark
                else _FILL
                if name in ("APPEND", "SETITEM", "BUILD")
                # fill the container under the items
                else _TUPLE_N
                if name in ("TUPLE1", "TUPLE2", "TUPLE3")
                else _STOP
                if name == "STOP"
                else _GENERIC
            )
            _OPS[ord(op.code)] = (
                kind,
                0 if op.arg is None else op.arg.n,
                name in ("GLOBAL", "INST"),
                0 if to_mark else len(op.stack_before),
                len(op.stack_after),
                name,
            )
    return _OPS


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
            import pickletools

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
    """A hash of the Python walk's source (`_walk_expansion`, `_refill`, `_op_table`) and of the constants the C copy
    hard-codes: what `native_walk.MIRRORS` must equal for the C walk to be used."""
    import hashlib
    import linecache

    text = []
    for fn in (_walk_expansion, _refill, _op_table):
        code = fn.__code__
        last = max(line for _, _, line in code.co_lines() if line is not None)
        text += linecache.getlines(code.co_filename)[code.co_firstlineno - 1 : last]
    text.append(repr((_DEPTH_SHIFT, sorted(_LEAF_OPS), sorted(_EMPTY_CONTAINER_OPS))))
    return hashlib.sha256("".join(text).encode()).hexdigest()[:16]


def _unfollowable(e: Exception, path: str) -> CorruptCheckpoint:
    why = str(e) if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {e}"
    return CorruptCheckpoint(
        f"cannot parse the pickle ({why})",
        path=path,
        hint="the file is truncated or corrupt; re-copy it or restore a backup",
    )


def _walk_expansion(data: bytes, path: str) -> int:
    table = _op_table()
    # One int per stack slot: (nesting depth << _DEPTH_SHIFT) | width. One sum() over a tuple's items then gives
    # its width in the low bits (the widths summed stay far below 2**40), one max() its deepest item in the high
    # bits, and one comparison (>= deep) finds a slot nested too deep. Width: a leaf (a number, a string, None,
    # an empty tuple) is 1, a tuple 1 + its items; a dict, list, set or object is 0: it can be filled after it
    # is made, and hashing stops at it (unhashable, or hashed by identity) but its walls still count 1 in depth.
    stack: list[int] = []
    marks: list[int] = []
    memo: dict[Any, int] = {}
    # stack position -> the memo key of the container PUT from there. Picklers memoize a dict, list or object as
    # soon as it is made and fill it after (`}` BINPUT, then SETITEMS: every dict torch.save writes): filling it
    # raises its memo entry too, so that a later GET carries the depth it was filled to, not the depth it had
    # empty. (A key left there by a container since popped can only make a depth come out higher.)
    put_at: dict[int, Any] = {}
    push, pop, shared, i, end = stack.append, stack.pop, 0, 0, len(data)
    u32, max_w, max_shared, S, W = _U32, MAX_TUPLE_EXPANSION, MAX_SHARED_EXPANSION, _DEPTH_SHIFT, _WIDTH
    leaves, empties = _LEAF_OPS, _EMPTY_CONTAINER_OPS
    level = 1 << S  # one level of depth, in slot units
    deep = (MAX_NESTING + 1) << S  # a slot at least this large nests more than MAX_NESTING levels
    while i < end:
        op = data[i]
        # the opcodes torch.save's protocol-2 pickles are made of, most frequent first; the table-driven path
        # below handles every opcode (these included) the same way, at about twice the cost per opcode
        if op == 114:  # LONG_BINPUT
            k = u32(data, i + 1)[0]
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            i += 5
            continue
        if op == 104 or op == 106:  # BINGET, LONG_BINGET
            v = memo.get(data[i + 1] if op == 104 else u32(data, i + 1)[0], 1)
            push(v)
            if v > 1 and v & W > 1:  # a tuple: hashing the reference hashes its items again
                shared += (v & W) - 1
                if shared > max_shared:
                    _refuse(table, data, i, v, shared, path)
            i += 2 if op == 104 else 5
            continue
        if op == 75:  # BININT1
            push(1)
            i += 2
            continue
        if op == 40:  # MARK
            marks.append(len(stack))
            i += 1
            continue
        if op == 82 or op == 129:  # REDUCE, NEWOBJ: callable/class and arguments -> an object a level above both
            if len(stack) > 1:
                v = (max(pop(), stack[-1]) >> S) + 1 << S
                stack[-1] = v
                if v >= deep:
                    _refuse(table, data, i, v, shared, path)
            else:
                stack[:] = [0]
            i += 1
            continue
        if op == 116:  # TUPLE: of the items above the topmost MARK
            m = marks.pop() if marks else 0
            if m < len(stack):
                top = stack[m:]
                del stack[m:]
                v = ((max(top) >> S) + 1 << S) | ((sum(top) & W) + 1)
                push(v)
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i, v, shared, path)
            else:
                push(1)
            i += 1
            continue
        if op in leaves:  # EMPTY_TUPLE, NONE, NEWTRUE, NEWFALSE
            push(1)
            i += 1
            continue
        if op == 133:  # TUPLE1: one item wider, one level deeper
            if stack:
                v = stack[-1] + level + 1
                stack[-1] = v
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i, v, shared, path)
            i += 1
            continue
        if op == 81:  # BINPERSID: a persistent id -> the object it names (a storage), a level above it
            if stack:
                v = (stack[-1] >> S) + 1 << S
                stack[-1] = v
                if v >= deep:
                    _refuse(table, data, i, v, shared, path)
            i += 1
            continue
        if op == 88 or op == 140:  # BINUNICODE, SHORT_BINUNICODE
            push(1)
            i += 5 + u32(data, i + 1)[0] if op == 88 else 2 + data[i + 1]
            continue
        if op in empties:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            push(0)
            i += 1
            continue
        if op == 148 or op == 113:  # MEMOIZE, BINPUT
            k = len(memo) if op == 148 else data[i + 1]
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            i += 1 if op == 148 else 2
            continue
        if op == 134:  # TUPLE2
            if len(stack) > 1:
                a = pop()
                b = stack[-1]
                v = ((max(a, b) >> S) + 1 << S) | (((a + b) & W) + 1)
                stack[-1] = v
                if v >= deep or v & W > max_w:
                    _refuse(table, data, i, v, shared, path)
            else:
                stack[:] = [1]
            i += 1
            continue
        if op == 98 or op == 97 or op == 117 or op == 101:
            # BUILD, APPEND / SETITEMS, APPENDS: the object or list under the item (under the MARK) takes in what
            # lies above it and stays on the stack, one level above its new deepest item
            if op == 98 or op == 97:
                if len(stack) < 2:
                    stack.clear()
                    i += 1
                    continue
                d = (pop() >> S) + 1
            else:
                m = marks.pop() if marks else 0
                if not 0 < m < len(stack):
                    del stack[m:]
                    i += 1
                    continue
                d = (max(stack[m:]) >> S) + 1
                del stack[m:]
            c = stack[-1]
            if d > c >> S:
                v = stack[-1] = (d << S) | (c & W)
                if v >= deep:
                    _refuse(table, data, i, v, shared, path)
                _refill(memo, put_at.get(len(stack) - 1), d)
            i += 1
            continue
        pos = i
        entry = table[op]
        if entry is None:
            raise pickle.UnpicklingError(f"unknown opcode {op:#04x} at byte {pos}")
        kind, n, two_lines, pops, pushes, name = entry
        i += 1
        arg = None
        if n > 0:
            if kind == _GET or kind == _PUT:
                arg = data[i] if n == 1 else u32(data, i)[0]
            i += n
        elif n == -1:  # text up to a newline (two lines for GLOBAL / INST)
            j = data.index(b"\n", i)
            if kind == _GET or kind == _PUT:
                arg = int(data[i:j])
            i = data.index(b"\n", j + 1) + 1 if two_lines else j + 1
        elif n == -2:  # one-byte length prefix
            i += 1 + data[i]
        elif n == -3 or n == -4:  # four-byte length prefix
            i += 4 + u32(data, i)[0]
        elif n == -5:  # eight-byte length prefix
            i += 8 + _U64(data, i)[0]
        if kind == _GENERIC:
            if pops:  # REDUCE, NEWOBJ(_EX), BINPERSID, STACK_GLOBAL, ...: an object made of what was popped
                top = stack[-pops:]
                del stack[-pops:]
                if pushes:
                    v = (max(top) >> S) + 1 << S if top else 0
                    push(v)
                    if v >= deep:
                        _refuse(table, data, pos, v, shared, path)
            elif pushes:  # a leaf, or an empty dict / list / set (width 0: it may be filled)
                push(0 if op in empties else 1)
            continue
        if kind == _GET or kind == _DUP:
            if kind == _GET:
                v = memo.get(arg, 1)
            else:
                v = stack[-1] if stack else 1
                put_at[len(stack)] = put_at.get(len(stack) - 1)
            push(v)
            if v & W > 1:
                shared += (v & W) - 1
                if shared > max_shared:
                    _refuse(table, data, pos, v, shared, path)
            continue
        if kind == _PUT or kind == _MEMOIZE:
            k = arg if kind == _PUT else len(memo)
            v = memo[k] = stack[-1] if stack else 1
            if not v & W:
                put_at[len(stack) - 1] = k
            continue
        if kind == _MARKOP:
            marks.append(len(stack))
            continue
        if kind == _STOP:
            return i
        if kind == _FILL or kind == _FILL_TO_MARK:  # SETITEM, ADDITEMS and the fast ones above
            if kind == _FILL:
                top = stack[-pops:]
                del stack[-pops:]
                if top:
                    push(top.pop(0))
            else:
                m = marks.pop() if marks else 0
                top = stack[m:]
                del stack[m:]
            if not top or not stack:
                continue
            d = (max(top) >> S) + 1
            c = stack[-1]
            if d > c >> S:
                v = stack[-1] = (d << S) | (c & W)
                if v >= deep:
                    _refuse(table, data, pos, v, shared, path)
                _refill(memo, put_at.get(len(stack) - 1), d)
            continue
        if kind == _TUPLE_N:
            top = stack[-pops:]
            del stack[-pops:]
        else:  # TUPLE, FROZENSET, LIST, DICT, INST, OBJ, POP_MARK: what lies above the topmost MARK
            m = marks.pop() if marks else 0
            top = stack[m:]
            del stack[m:]
            if not pushes:
                continue
        if kind == _NEW_TO_MARK:  # a list, dict or object: width 0
            v = (max(top) >> S) + 1 << S if top else 0
        else:  # a tuple or frozenset: its items are hashed, it is as wide as they are together
            v = ((max(top) >> S) + 1 << S) | ((sum(top) & W) + 1) if top else 1
        push(v)
        if v >= deep or v & W > max_w:
            _refuse(table, data, pos, v, shared, path)
    raise pickle.UnpicklingError("the pickle ends before its STOP opcode")


def _refill(memo: dict, k, d: int) -> None:
    """The container memoized under `k` was filled to depth `d`: its memo entry follows."""
    held = memo.get(k) if k is not None else None
    if held is not None and held >> _DEPTH_SHIFT < d:
        memo[k] = (d << _DEPTH_SHIFT) | (held & _WIDTH)


def _refuse(table, data: bytes, pos: int, v: int, shared: int, path: str) -> None:
    """Raise CorruptCheckpoint for the slot `v` the opcode at `pos` made: nested too deep, or too wide."""
    op = table[data[pos]][5]
    if v >> _DEPTH_SHIFT > MAX_NESTING:
        raise CorruptCheckpoint(
            f"pickle nests more than {MAX_NESTING} levels (opcode {op} at byte {pos}): "
            "hashing or walking it would overflow the stack",
            path=path,
            hint="the file is hostile or corrupt; do not load it with torch.load or pickle either",
        )
    w = v & _WIDTH
    what = (
        f"builds a tuple of more than {MAX_TUPLE_EXPANSION:,} items"
        if w > MAX_TUPLE_EXPANSION
        else f"re-references more than {MAX_SHARED_EXPANSION:,} tuple items"
    )
    raise CorruptCheckpoint(
        f"pickle {what} out of shared references (opcode {op} at byte {pos}): a hash bomb",
        path=path,
        hint="the file is hostile or corrupt; do not load it with torch.load either",
    )


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


#: the heads of the last few items `load_embedded_head` parsed that held one plain tensor: the bytes from the item's
#: start to its storage's data (data.pkl's local header and pickle, the small members, the storage's local header)
#: -> (the parse, its storage's source dropped; the globals it names; the archive's folder). Equal bytes parse
#: alike, and a DCP folder's chunks repeat a handful of heads (every Adam `step` the same 0-d float32 one): each
#: parse costs ~60 us in Python, a hit ~5 us
_SEEN_HEADS: "collections.OrderedDict[bytes, tuple[TensorRef, frozenset[str], str]]" = collections.OrderedDict()
_HEAD_SIZES: dict[int, int] = {}  # the lengths of those heads -> how many have it
_SEEN_KEPT = 64


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
    with _resolved_lock:
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
    with _resolved_lock:
        sizes = tuple(_HEAD_SIZES)
    for n in sizes:
        if n > len(head):
            continue
        with _resolved_lock:
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
