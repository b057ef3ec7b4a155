"""The inert records the pickle reader builds: dtypes, storages, tensors (`TensorRef`: metadata plus where the
bytes are, read on demand), placeholders for unknown classes (`Opaque`), numpy arrays and dtypes. Importing this
module imports neither torch nor numpy.
"""

from __future__ import annotations

import contextvars
import os
import struct
import threading
import types
from dataclasses import dataclass, field
from typing import Any

from . import remote
from ..errors import CorruptCheckpoint

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
    # a `pickle_sources.Source` (not imported here: that module imports this one)
    source: "Source" = field(repr=False, compare=False)  # noqa: F821
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
        import numpy as np  # lazy: numpy only when tensor bytes are read; opening a checkpoint stays numpy-free

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
        import torch  # lazy: torch only when a tensor is read; read/ is the torch-free core

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


#: while a pickle is parsed: the set its flagged calls go to (see `_flag`)
_FLAGGED: contextvars.ContextVar[set | None] = contextvars.ContextVar("ckpt_pickle_flagged", default=None)


def _flag(what: str) -> None:
    """Record a call a full unpickler would make beyond the globals the pickle names: it joins the file's
    globals and is reported (and refused) like an unknown one."""
    seen = _FLAGGED.get()
    if seen is not None:
        seen.add(what)
