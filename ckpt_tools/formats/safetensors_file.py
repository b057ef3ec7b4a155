"""safetensors files, single or sharded with `*.safetensors.index.json`. Only headers are read.

Header layout: 8-byte little-endian length N, N bytes of JSON {name: {dtype, shape, data_offsets},
"__metadata__": {...}}, then the data. Offsets are checked against the file size and the dtype/shape,
since a header that lies about offsets is the classic way a truncated or hostile file misleads a reader.
"""

from __future__ import annotations

import json
import re
import math
import struct
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, MissingFile, NotACheckpoint
from ..read.pickle_reader import DTYPE_SIZE, Source, StorageRef, TensorRef
from ..read.tree import Checkpoint, Counters, GroupNode, LearningRates, Topology, ValueNode, natural_key, tensor_node
from . import _common as C

FORMAT = "safetensors"
_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "C64": "complex64",
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsSource(Source):
    def __init__(self, path, data_start: int, offsets: dict[str, int]):
        super().__init__(path)
        self.data_start = data_start
        self._offsets = offsets

    def storage_offset(self, storage: StorageRef) -> int:
        return self.data_start + self._offsets[storage.key]


def _index_file(path: Path) -> Path | None:
    if path.is_file() and path.name.endswith(".safetensors.index.json"):
        return path
    if path.is_dir():
        hits = sorted(path.glob("*.safetensors.index.json"))
        return hits[0] if hits else None
    return None


def sniff(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json")
    if path.is_dir():
        # an Accelerate folder also holds model.safetensors; it is recognised before this module
        return _index_file(path) is not None or (
            any(path.glob("*.safetensors")) and not any(path.glob("*.bin")) and not any(path.glob("*.pt"))
        )
    return False


def read_header(path: Path) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """name -> TensorRef (bytes not read) and the `__metadata__` dict, validated against the file size."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise CorruptCheckpoint(
                    "file is shorter than a safetensors header", path=path, hint="the file is truncated; re-copy it"
                )
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, _MAX_HEADER):
                raise CorruptCheckpoint(
                    f"header length {n} exceeds the file", path=path, hint="the file is truncated or not safetensors"
                )
            header = json.loads(fh.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpoint(f"header is not valid JSON ({e})", path=path, hint="the file is corrupt")
    except OSError as e:
        raise NotACheckpoint(f"cannot read ({e.strerror})", path=path)
    if not isinstance(header, dict):
        raise CorruptCheckpoint("header is not a JSON object", path=path, hint="the file is corrupt")
    meta = header.pop("__metadata__", None) or {}
    data_start = 8 + n
    offsets: dict[str, int] = {}
    source = SafetensorsSource(path, data_start, offsets)
    out: dict[str, TensorRef] = {}
    spans = []
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpoint(f"bad header entry for tensor {name!r}", path=path, hint="the file is corrupt")
        numel = math.prod(shape)
        if end - begin != numel * DTYPE_SIZE[dtype] or begin < 0 or data_start + end > size:
            raise CorruptCheckpoint(
                f"header offsets of tensor {name!r} ({begin}..{end}) do not fit its dtype/shape or the file size",
                path=path,
                hint="the file is truncated or corrupt",
            )
        offsets[name] = begin
        spans.append((begin, end, name))
        strides = []
        acc = 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        out[name] = TensorRef(dtype, shape, tuple(reversed(strides)), 0, StorageRef(name, dtype, numel, "cpu", source))
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CorruptCheckpoint(
                f"tensors {n0!r} and {n1!r} overlap in the data", path=path, hint="the file is corrupt"
            )
    return out, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


_SHARD_RE = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")


def open(path: Path) -> Checkpoint:  # noqa: A001
    """The safetensors file at `path`, or the folder of shards (with `*.safetensors.index.json`, read as JSON, or
    without). Reads each shard's header only (offsets checked against the file size, dtype and shape); the
    tensors stay lazy ranges of the files. Weights only: no `training_state` (read-only for the writing
    commands)."""
    index_missing = False
    index = _index_file(path)
    root = path if path.is_dir() else path.parent
    if index is not None:
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError) as e:
            raise CorruptCheckpoint(f"cannot read the index ({e})", path=index, hint="re-download or rebuild the index")
        shard_names = sorted(set(weight_map.values()))
        base = index.parent
    else:
        shard_names = [path.name] if path.is_file() else sorted(p.name for p in path.glob("*.safetensors"))
        base = path if path.is_dir() else path.parent
        weight_map = None
        if path.is_dir() and any(_SHARD_RE.search(n) for n in shard_names):
            # shards named -0000i-of-0000N were written with an index: without it a loader finds no weights
            # (from_pretrained) and a missing shard would go unnoticed
            index_missing = True
    tensors: dict[str, Any] = {}
    files, meta = [], {}
    for shard in shard_names:
        f = base / shard
        if not f.is_file():
            raise MissingFile(
                f"shard {shard} named by the index is missing", path=f, hint="re-download the missing shard"
            )
        refs, m = read_header(f)
        meta.update(m)
        for name, ref in refs.items():
            tensors[name] = tensor_node(ref, shard)
        files.append(C.file_info(f, root, "model"))
    warnings = []
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            warnings.append(
                C.Warning_(
                    "index-mismatch",
                    f"{len(missing)} tensors named by the index are not in their shard: {', '.join(missing[:5])}",
                    str(index.relative_to(root)),
                )
            )
    if index_missing:
        total = max(int(m[2]) for m in map(_SHARD_RE.search, shard_names) if m)
        warnings.append(
            C.Warning_(
                "index-missing",
                f"sharded safetensors ({len(shard_names)} of {total} shards "
                "here) without their *.safetensors.index.json: from_pretrained finds no weights, "
                "and a missing shard cannot be told",
                "model.safetensors.index.json",
            )
        )
    if path.is_dir():
        warnings += C.stray_file_warnings(path, root)
    model = GroupNode(dict(sorted(tensors.items(), key=lambda kv: natural_key(kv[0]))))
    tree = {"model": model}
    if meta:
        tree["metadata"] = GroupNode({k: ValueNode(v) for k, v in meta.items()})
    return Checkpoint(
        format=FORMAT,
        path=str(path),
        topology=Topology(),
        tree=GroupNode(tree),
        counters=Counters(),
        lr=LearningRates(),
        parameter_count=sum(t.numel for t in tensors.values()),
        parameter_tensors=len(tensors),
        files=tuple(files),
        warnings=tuple(warnings),
        dtypes=tuple(sorted({t.dtype for t in tensors.values()})),
        details={"shards": len(shard_names)},
    )
