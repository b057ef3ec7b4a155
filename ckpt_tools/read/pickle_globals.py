"""What a global named in a pickle becomes (`resolve_global`): a safe function or class from the allowlist below
(torch's tensor rebuild calls, storages, OrderedDict, numpy scalars, ...) that builds an inert record, a `DType`, or a
placeholder class. Nothing named in a pickle is ever imported or called.
"""

from __future__ import annotations

import collections
import pickle
import struct
from typing import Any, Callable

from . import allowlist
from .pickle_records import (
    _DTYPE_ALIASES,
    _STORAGE_DTYPE,
    DTYPE_SIZE,
    DType,
    NumpyArray,
    NumpyDType,
    Opaque,
    StorageRef,
    TensorRef,
    _flag,
    _new,
    _set,
    opaque_class,
)


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


def _storage_dtype(storage_type) -> str:
    name = getattr(storage_type, "cls", str(storage_type)).rsplit(".", 1)[-1]
    return _STORAGE_DTYPE.get(name, "uint8")


def _storage_type_name(storage_type) -> str:
    return getattr(storage_type, "cls", "")
