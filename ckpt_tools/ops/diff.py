"""`ckpt diff A B`: what changed between two checkpoints, file by file, field by field, tensor by tensor —
or, across formats and topologies, parameter by parameter (the logical comparison below).

Two modes (`mode=`; the CLI's --files / --logical force one, "auto" picks):
  files    two checkpoints of the same format and topology: every file compared by relative path (below).
  logical  A and B of different formats or topologies (a ZeRO checkpoint and its universal output, its
           export, a DCP copy, ZeRO-2 vs ZeRO-3): both are read through `ckpt_tools.view.logical` and compared by
           logical name — every model tensor (the fp32 master where the format keeps one), every
           per-parameter optimizer state tensor (exp_avg, momentum_buffer, sum, ...) and scalar (step), each
           param group's hyper-parameters and members, and the step counters. A side without optimizer state
           (an export) has its model compared only, and the report says so. One chunk is read at a time.

The comparison runs on each file's inert pickle tree (`pickle_reader`, nothing executed), so a field is
named by where it lives in its file (`optimizer_state_dict.base_optimizer_state.param_groups.0.lr`) and
every rank's file is compared — the exact counterpart of the `FieldChange`s a `set-lr` plan lists.

Tensor bytes are read only where metadata cannot decide: two tensors with a different shape or dtype are
reported from metadata alone; two files that are the same inode (a hard-linked backup) are equal without
reading anything; otherwise equal-metadata tensors are compared `CHUNK_ELEMS` elements at a time, read with
pread into one reused buffer per side (`ChunkReader`), bit-exact first, then `|a - b| <= atol + rtol * |b|`
(torch.allclose semantics); memory stays flat in tensor and checkpoint size. The logical mode reads the same
way, interleaving row blocks of TP shards concatenated along a dimension as it reads them. Files that are not
pickles (safetensors are read by header + tensor bytes; `latest`, JSON, `.distcp` blobs) are compared byte for
byte.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..read import pickle_reader, remote
from ..errors import CkptError, NotACheckpoint, UnsupportedCheckpoint
from ..formats import detect
from ..formats.safetensors_file import read_header
from ..read.pickle_reader import DTYPE_SIZE, DType, FdCache, NumpyArray, Opaque, TensorRef
from ..read.qkv import find_fused
from ..read.tree import TensorNode, jsonable
from ..view import logical as L
from ..view.checkpoint import open_checkpoint
from ..view.megatron_core import core_view, pairs_with_core_names
from ..view.torchtitan import from_torchtitan

#: elements read and compared per step, whatever a tensor's size: the read buffers (one per side) and the
#: float64 temporaries of a comparison are a few times this, so a command's memory stays flat in tensor and
#: checkpoint size. Tests set it to a few elements so that chunk boundaries are crossed.
CHUNK_ELEMS = 1 << 20

#: numpy dtype for a stored dtype's raw elements (bf16 and float8 as their bit patterns: numpy has neither)
_RAW_NP = {
    "bfloat16": "uint16",
    "bool": "bool",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2fnuz": "uint8",
}


class ChunkReader:
    """Reads runs of stored tensor elements (`TensorRef.read_into`: preadv, not the mmap, whose pages would
    stay resident) into one buffer reused for every read, so RSS stays at the buffer's size."""

    def __init__(self):
        self._fds = FdCache()
        self._buf = bytearray()

    def read(self, runs: list[tuple[TensorRef, int, int]], dtype: str):
        """The elements of `runs` ((ref, first element, count) each, flattened order, all of `dtype`),
        one after the other, as a numpy array of raw elements (`raw_np_dtype`). The array is a view of
        the reused buffer: valid until the next `read`."""
        import numpy as np  # lazy: numpy only when values are compared; inspect stays numpy-free

        esize = DTYPE_SIZE[dtype]
        total = sum(n for _, _, n in runs)
        if len(self._buf) < total * esize:
            self._buf = bytearray(total * esize)
        view = memoryview(self._buf)
        pos = 0
        for ref, start, count in runs:
            ref.read_into(view[pos : pos + count * esize], start, count, self._fds)
            pos += count * esize
        return np.frombuffer(self._buf, dtype=raw_np_dtype(dtype), count=total)

    def close(self) -> None:
        self._fds.close()
        self._buf = bytearray()

    def __enter__(self) -> "ChunkReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def raw_np_dtype(dtype: str):
    import numpy as np  # lazy: numpy only when values are compared; inspect stays numpy-free

    return np.dtype(_RAW_NP.get(dtype, dtype))


def tensor_runs(node) -> list[tuple[TensorRef, int, int]]:
    """The stored runs (ref, first element, count) that hold a TensorNode's elements, in the logical
    flattened order for pieces and replicated TP shards; for shards concatenated along a dimension, shard
    after shard (every element once, not in the merged order: enough for order-free statistics). Raises
    ValueError where the TP merge rule is unknown or a tensor has no storage."""
    if node.shards:
        if node.merge == "replicated":
            return tensor_runs(node.shards[0])
        if node.merge and node.merge.startswith("cat:"):
            return [r for s in node.shards for r in tensor_runs(s)]
        raise ValueError("unknown TP merge rule for this tensor; read its shards")
    runs = []
    for p in sorted(node.pieces, key=lambda p: p.dst_offset):
        if p.ref.storage is None:
            raise ValueError("tensor has no storage")
        runs.append((p.ref, p.src_offset, p.numel))
    return runs


def iter_chunks(
    runs: list[tuple[TensorRef, int, int]], chunk: int | None = None
) -> Iterator[list[tuple[TensorRef, int, int]]]:
    """`runs` cut at every multiple of `chunk` elements (default `CHUNK_ELEMS`), counted from the start of
    the whole sequence: each item is the runs (or parts of runs) that one chunk reads."""
    chunk = chunk or CHUNK_ELEMS
    cur: list[tuple[TensorRef, int, int]] = []
    room = chunk
    for ref, start, count in runs:
        while count:
            n = min(count, room)
            cur.append((ref, start, n))
            start, count, room = start + n, count - n, room - n
            if not room:
                yield cur
                cur, room = [], chunk
    if cur:
        yield cur


def to_float64(raw, dtype: str):
    """Raw elements (`ChunkReader.read`) as float64 values."""
    import numpy as np  # lazy: numpy only when values are compared; inspect stays numpy-free

    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype.startswith("float8"):
        import torch  # lazy: torch only for dtypes numpy lacks (float8, bfloat16)

        return torch.from_numpy(raw.copy()).view(getattr(torch, dtype)).double().numpy()
    return raw.astype(np.float64)


@dataclass(frozen=True)
class Difference:
    """One field or tensor that differs. `kind`: changed, added (only in B), removed (only in A), type."""

    file: str
    field: str
    kind: str
    old: Any = None
    new: Any = None
    max_abs_diff: float | None = None  # tensors and numbers: max |a - b|


@dataclass(frozen=True)
class DiffReport:
    a: str
    b: str
    atol: float
    rtol: float
    differences: tuple[Difference, ...]
    files_compared: int
    tensors_compared: int
    tensors_read: int  # tensors whose bytes had to be read
    within_tolerance: int  # values/tensors not bit-identical but inside atol/rtol
    mode: str = "files"  # "files" or "logical"
    notes: tuple[str, ...] = ()  # what a logical comparison could not compare, and why

    @property
    def same(self) -> bool:
        return not self.differences

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["same"] = self.same
        d["differences"] = [{k: jsonable(v) for k, v in asdict(x).items()} for x in self.differences]
        return d


def _files(p: Path) -> dict[str, Path]:
    if p.is_file():
        return {p.name: p}
    if not p.is_dir():
        raise NotACheckpoint("does not exist", path=p)
    return {str(f.relative_to(p)): f for f in sorted(p.rglob("*")) if f.is_file()}


class _Differ:
    def __init__(self, atol: float, rtol: float):
        self.atol, self.rtol = atol, rtol
        self.out: list[Difference] = []
        self.tensors = self.read = self.within = 0
        self.widened: list[str] = []  # logical mode: equal values in another dtype
        self.reader_a, self.reader_b = ChunkReader(), ChunkReader()  # one reused buffer per side

    def close_readers(self) -> None:
        self.reader_a.close()
        self.reader_b.close()

    def close(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.atol + self.rtol * abs(b)

    def same_scalar(self, a: Any, b: Any) -> bool:
        if _number(a) and _number(b):
            if a == b or (math.isnan(a) and math.isnan(b)):
                return True
            if self.close(float(a), float(b)):
                self.within += 1
                return True
            return False
        return type(a) is type(b) and a == b

    def file(self, rel: str, pa: Path, pb: Path) -> None:
        if os.path.samefile(pa, pb):
            return
        la, lb = _try_load(pa), _try_load(pb)
        if la is None or lb is None:
            if pa.suffix == ".safetensors" and pb.suffix == ".safetensors":
                self.value(rel, (), read_header(pa)[0], read_header(pb)[0])
            elif not _same_bytes(pa, pb):
                self.out.append(
                    Difference(rel, "", "changed", f"{pa.stat().st_size} bytes", f"{pb.stat().st_size} bytes")
                )
            return
        self.value(rel, (), la.obj, lb.obj)

    def value(self, rel: str, path: tuple, a: Any, b: Any) -> None:
        name = ".".join(map(str, path))
        if isinstance(a, TensorRef) and isinstance(b, TensorRef):
            self.tensor(rel, name, a, b)
        elif isinstance(a, dict) and isinstance(b, dict):
            # keys are paired by what they hold, not by identity: a DCP `storage_data` is keyed by MetadataIndex
            # records, inert placeholders that are a new object in every load (`_key`)
            ka, kb = {_key(k): k for k in a}, {_key(k): k for k in b}
            for c, k in ka.items():
                field = ".".join(map(str, path + (_label(k),)))
                if c not in kb:
                    self.out.append(Difference(rel, field, "removed", _short(a[k]), None))
                else:
                    self.value(rel, path + (_label(k),), a[k], b[kb[c]])
            for c, k in kb.items():
                if c not in ka:
                    self.out.append(
                        Difference(rel, ".".join(map(str, path + (_label(k),))), "added", None, _short(b[k]))
                    )
        elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
            if a and b and all(map(_scalar, a)) and all(map(_scalar, b)):  # a list of LRs is one field
                if len(a) != len(b) or not all(self.same_scalar(x, y) for x, y in zip(a, b)):
                    self.out.append(Difference(rel, name, "changed", list(a), list(b)))
                return
            for i in range(max(len(a), len(b))):
                if i >= len(a):
                    self.out.append(Difference(rel, ".".join(map(str, path + (i,))), "added", None, _short(b[i])))
                elif i >= len(b):
                    self.out.append(Difference(rel, ".".join(map(str, path + (i,))), "removed", _short(a[i]), None))
                else:
                    self.value(rel, path + (i,), a[i], b[i])
        elif isinstance(a, Opaque) and isinstance(b, Opaque):
            if a.cls != b.cls:
                self.out.append(Difference(rel, name, "type", a.cls, b.cls))
                return
            for attr in ("args", "state", "items", "list"):
                self.value(rel, path + ((attr,) if attr != "state" else ()), a.__dict__.get(attr), b.__dict__.get(attr))
        elif _number(a) and _number(b):
            if a == b or (math.isnan(a) and math.isnan(b)):
                return
            if self.close(float(a), float(b)):
                self.within += 1
                return
            self.out.append(Difference(rel, name, "changed", a, b, abs(float(a) - float(b))))
        elif isinstance(a, NumpyArray) and isinstance(b, NumpyArray):
            if (a.shape, a.dtype, a.raw) != (b.shape, b.dtype, b.raw):
                self.out.append(Difference(rel, name, "changed", f"ndarray {a.shape}", f"ndarray {b.shape}"))
        elif type(a) is not type(b) and not (isinstance(a, DType) and isinstance(b, DType)):
            self.out.append(Difference(rel, name, "type", _short(a), _short(b)))
        elif a != b:
            self.out.append(Difference(rel, name, "changed", _short(a), _short(b)))

    def tensor(self, rel: str, name: str, a: TensorRef, b: TensorRef) -> None:
        self.tensors += 1
        if (a.dtype, a.shape) != (b.dtype, b.shape):  # metadata alone decides
            self.out.append(
                Difference(rel, name, "changed", f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}")
            )
            return
        if a.numel == 0 or a.storage is None or b.storage is None:
            return
        self.read += 1
        import numpy as np  # lazy: numpy only when values are compared; inspect stays numpy-free

        worst, exact, ok = 0.0, True, True
        for start in range(0, a.numel, CHUNK_ELEMS):
            n = min(CHUNK_ELEMS, a.numel - start)
            xa, xb = self.reader_a.read([(a, start, n)], a.dtype), self.reader_b.read([(b, start, n)], b.dtype)
            if np.array_equal(
                xa.view(np.uint8) if xa.dtype != np.bool_ else xa, xb.view(np.uint8) if xb.dtype != np.bool_ else xb
            ):
                continue
            exact = False
            fa, fb = to_float64(xa, a.dtype), to_float64(xb, b.dtype)
            d = np.abs(fa - fb)
            worst = max(worst, float(np.nanmax(d)) if d.size else 0.0)
            ok = ok and bool(np.all((d <= self.atol + self.rtol * np.abs(fb)) | (np.isnan(fa) & np.isnan(fb))))
        if exact:
            return
        if ok:
            self.within += 1
            return
        if a.numel == 1:
            self.out.append(Difference(rel, name, "changed", a.item(), b.item(), worst))
        else:
            self.out.append(
                Difference(rel, name, "changed", f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}", worst)
            )


#: fields of a record that are hints, not part of its identity (torch's MetadataIndex.index: compare=False)
_KEY_HINTS = {"torch.distributed.checkpoint.metadata.MetadataIndex": ("index",)}


def _key(k: Any) -> Any:
    """A dict key as a hashable value equal for equal content: an inert record (`Opaque`, which compares by
    identity) by its class and fields, so the same key read from two files pairs up; anything else as is."""
    if isinstance(k, Opaque):
        state = k.state
        if isinstance(state, dict):
            skip = _KEY_HINTS.get(k.cls, ())
            state = {f: v for f, v in state.items() if f not in skip}
        return (
            "<opaque>",
            k.cls,
            _key(k.args),
            _key(state),
            _key(k.__dict__.get("items")),
            _key(k.__dict__.get("list")),
        )
    if isinstance(k, dict):
        return ("<dict>", frozenset((_key(x), _key(y)) for x, y in k.items()))
    if isinstance(k, (list, tuple)):
        return (type(k).__name__, tuple(_key(x) for x in k))
    try:
        hash(k)
    except TypeError:
        return ("<unhashable>", type(k).__name__, repr(k))
    return k


def _label(k: Any) -> Any:
    """How a dict key is named in a field path: a record by its fields (`MetadataIndex(fqn='w', offset=(0, 0))`)."""
    if isinstance(k, Opaque) and isinstance(k.state, dict):
        skip = _KEY_HINTS.get(k.cls, ())
        fields = ", ".join(f"{f}={v!r}" for f, v in k.state.items() if f not in skip)
        return f"{k.cls.rsplit('.', 1)[-1]}({fields})"
    return k


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _short(v: Any) -> Any:
    if _scalar(v):
        return v
    if isinstance(v, TensorRef):
        return f"tensor {v.dtype} {list(v.shape)}"
    if isinstance(v, (list, tuple)) and len(v) <= 8 and all(map(_scalar, v)):
        return list(v)
    return f"<{type(v).__name__ if not isinstance(v, Opaque) else v.cls}>"


def _try_load(p: Path):
    try:
        return pickle_reader.load(p)
    except CkptError:
        return None


def _same_bytes(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    remote.ensure_file(a)
    remote.ensure_file(b)
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(16 << 20), fb.read(16 << 20)
            if x != y:
                return False
            if not x:
                return True


MODES = ("auto", "files", "logical")


def choose_mode(a: str | os.PathLike, b: str | os.PathLike) -> str:
    """ "files" when A and B are the same format with the same topology and one's files are among the other's
    (their files correspond one to one; an added or removed file is then a difference to name), else "logical". When
    one of them cannot be opened as a whole (a damaged copy), "files": the file by file
    comparison still names what differs."""
    if detect(Path(a)) is not detect(Path(b)):
        return "logical"
    try:
        ca, cb = open_checkpoint(a), open_checkpoint(b)
    except CkptError:
        return "files"
    if ca.format != cb.format:
        return "logical"
    ta, tb = ca.topology, cb.topology
    if (ta.dp, ta.tp, ta.pp, ta.zero_stage) != (tb.dp, tb.tp, tb.pp, tb.zero_stage):
        return "logical"
    fa, fb = {f.path for f in ca.files}, {f.path for f in cb.files}
    if Path(a).is_dir() and Path(b).is_dir() and not (fa <= fb or fb <= fa):
        return "logical"  # the same state under other file names (bf16_zero_* vs zero_*, another tag)
    return "files"


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    atol: float = 0.0,
    rtol: float = 0.0,
    *,
    mode: str = "auto",
    progress: Callable[[int], None] | None = None,
    n_kv_heads: int | None = None,
) -> DiffReport:
    """Compare checkpoint `a` (before) with `b` (after). mode "files": a file, or a folder compared file by
    file (same relative paths); "logical": by logical parameter and optimizer state (`logical_diff`); "auto":
    `choose_mode`. `n_kv_heads` (logical): a torchtitan fused wqkv's optimizer state is compared split into the
    rows that train wq/wk/wv (`logical.with_kv_heads`), as its conversions carry it. Returns every difference
    beyond `atol`/`rtol`; `report.same` when there is none."""
    pa, pb = Path(a), Path(b)
    if atol < 0 or rtol < 0:
        raise CkptError("--atol/--rtol must be >= 0")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    for p in (pa, pb):
        detect(p)  # both must be checkpoints: an empty or unrelated folder is an error, not "no difference"
    if mode == "auto":
        mode = choose_mode(pa, pb)
    if n_kv_heads is not None and mode != "logical":
        raise CkptError("--n-kv-heads applies to the logical comparison", hint="add --logical")
    if mode == "logical":
        if n_kv_heads is not None:
            return logical_diff(
                L.with_kv_heads(pa, n_kv_heads), L.with_kv_heads(pb, n_kv_heads), atol, rtol, progress=progress
            )
        return logical_diff(pa, pb, atol, rtol, progress=progress)
    fa, fb = _files(pa), _files(pb)
    if pa.is_file() and pb.is_file():
        fb = {pa.name: pb}  # two single files: compare them whatever their names
    d = _Differ(atol, rtol)
    try:
        for rel in sorted(set(fa) | set(fb)):
            if rel not in fb:
                d.out.append(Difference(rel, "", "removed"))
            elif rel not in fa:
                d.out.append(Difference(rel, "", "added"))
            else:
                d.file(rel, fa[rel], fb[rel])
    finally:
        d.close_readers()
    return DiffReport(str(pa), str(pb), atol, rtol, tuple(d.out), len(set(fa) & set(fb)), d.tensors, d.read, d.within)


# --- the logical comparison ----------------------------------------------------------------------------------


def _node_runs(node, dtype: str) -> list[tuple[TensorRef, int, int]] | None:
    """The stored runs that hold a TensorNode's elements in its flattened order, where they can be read as
    stored: its pieces (ZeRO partitions, a plain tensor, a safetensors entry), a replicated TP shard's, or
    the shards' one after the other when they are concatenated along dim 0; contiguous and in `dtype`.
    None otherwise."""
    if not isinstance(node, TensorNode) or node.dtype != dtype:
        return None
    if node.shards:
        if node.merge == "replicated":
            return _node_runs(node.shards[0], dtype)
        if node.merge == "cat:0":
            parts = [_node_runs(sh, dtype) for sh in node.shards]
            return None if any(r is None for r in parts) else [r for part in parts for r in part]
        return None
    runs, pos = [], 0
    for p in sorted(node.pieces, key=lambda p: p.dst_offset):
        ref = p.ref
        if p.dst_offset != pos or ref.storage is None or not ref.is_contiguous or ref.dtype != dtype:
            return None
        runs.append((ref, p.src_offset, p.numel))
        pos += p.numel
    return runs if pos == node.numel else None


def _slice_runs(runs: list[tuple[TensorRef, int, int]], start: int, count: int) -> list[tuple[TensorRef, int, int]]:
    """Elements [start, start+count) of the concatenation of `runs`, as runs."""
    out = []
    for ref, s, n in runs:
        if start >= n:
            start -= n
            continue
        take = min(n - start, count)
        out.append((ref, s + start, take))
        count -= take
        start = 0
        if not count:
            break
    return out


def _logical_runs(lt) -> list[tuple[TensorRef, int, int]] | None:
    """`_node_runs` of a LogicalTensor's node, cut to the logical tensor where the node holds vocabulary
    padding rows beyond the real vocabulary (the logical tensor is then the stored one's prefix)."""
    node = lt.node
    if lt.rows is not None:  # some rows of the node (a fused state split): read through the LogicalTensor
        return None
    runs = _node_runs(node, lt.dtype)
    if runs is None or node.numel == lt.numel:
        return runs
    stored, shape = tuple(node.shape), tuple(lt.shape)
    if not (len(stored) == len(shape) and shape and stored[0] > shape[0] and stored[1:] == shape[1:]):
        return None
    return _slice_runs(runs, 0, lt.numel)


def _cat_layout(lt) -> tuple[int, list[tuple[list, int]]] | None:
    """For TP shards concatenated along a dimension d > 0: (the number of index tuples before d, and per
    shard its runs and how many elements it adds to each of them). None where that does not describe it."""
    node = lt.node
    if lt.rows is not None:
        return None
    merge = getattr(node, "merge", None) or ""
    if not getattr(node, "shards", None) or not merge.startswith("cat:") or merge == "cat:0" or node.dtype != lt.dtype:
        return None
    d, shape = int(merge[4:]), tuple(lt.shape)
    if not 0 < d < len(shape):
        return None
    outer, parts = math.prod(shape[:d]), []
    for sh in node.shards:
        runs = _node_runs(sh, lt.dtype)
        if runs is None or len(sh.shape) != len(shape) or math.prod(sh.shape[:d]) < outer:
            return None
        parts.append((runs, math.prod(sh.shape[d:])))
    if sum(inner for _, inner in parts) != math.prod(shape[d:]):
        return None
    return outer, parts


def _logical_chunks(lt, reader: ChunkReader) -> Iterator:
    """A LogicalTensor's raw elements (`raw_np_dtype`) in its flattened order, about `CHUNK_ELEMS` at a time
    (at most one chunk alive; the chunks of two tensors need not be cut at the same places: `_aligned`)."""
    import numpy as np  # lazy: numpy only when values are compared; inspect stays numpy-free

    runs = _logical_runs(lt)
    if runs is not None:
        for part in iter_chunks(runs):
            yield reader.read(part, lt.dtype)
        return
    cat = _cat_layout(lt)
    if cat is not None:  # a block of rows from every shard per read, interleaved as torch.cat(dim=d) would
        outer, parts = cat
        width = sum(inner for _, inner in parts)
        rows = max(1, CHUNK_ELEMS // width)
        for o0 in range(0, outer, rows):
            k = min(rows, outer - o0)
            raw = reader.read(
                [r for runs_i, inner in parts for r in _slice_runs(runs_i, o0 * inner, k * inner)], lt.dtype
            )
            blocks, pos = [], 0
            for _, inner in parts:
                blocks.append(raw[pos : pos + k * inner].reshape(k, inner))
                pos += k * inner
            yield np.concatenate(blocks, axis=1).reshape(-1)
        return
    import torch  # lazy: torch only where a tensor is read through torch; inspect stays torch-free

    t = lt.read().reshape(-1)  # anything else (cat_sub, average, strided storage): this one tensor, whole
    if t.dtype == torch.bfloat16:
        raw = t.view(torch.int16).numpy().view(np.uint16)
    elif lt.dtype.startswith("float8"):
        raw = t.view(torch.uint8).numpy()
    else:
        raw = t.numpy()
    for start in range(0, raw.size, CHUNK_ELEMS):
        yield raw[start : start + CHUNK_ELEMS]


def _aligned(chunks_a: Iterator, chunks_b: Iterator, total: int) -> Iterator:
    """Pairs of equal-length pieces of two chunk streams of `total` elements each, cut at different places."""
    xa = xb = None
    done = 0
    while done < total:
        if xa is None or not len(xa):
            xa = next(chunks_a)
        if xb is None or not len(xb):
            xb = next(chunks_b)
        n = min(len(xa), len(xb))
        yield xa[:n], xb[:n]
        xa, xb = xa[n:], xb[n:]
        done += n


def _read_compare(d: "_Differ", section: str, name: str, ta, tb) -> None:
    """Compare two LogicalTensors: metadata first, then values (bit-exact, then atol/rtol), chunk by chunk."""
    import numpy as np  # lazy: numpy only when values are compared; inspect stays numpy-free

    d.tensors += 1
    if tuple(ta.shape) != tuple(tb.shape):
        d.out.append(
            Difference(section, name, "changed", f"{ta.dtype} {list(ta.shape)}", f"{tb.dtype} {list(tb.shape)}")
        )
        return
    d.read += 1
    same_dtype = ta.dtype == tb.dtype
    exact, ok, nan_alike, worst, first = True, True, True, 0.0, None
    for xa, xb in _aligned(_logical_chunks(ta, d.reader_a), _logical_chunks(tb, d.reader_b), ta.numel):
        if same_dtype and np.array_equal(xa.view(np.uint8), xb.view(np.uint8)):
            continue  # bit-identical: every |a - b| here is 0 (or NaN on both sides)
        exact = False
        fa, fb = to_float64(xa, ta.dtype), to_float64(xb, tb.dtype)
        if first is None:
            first = (float(fa[0]), float(fb[0]))
        nan_a, nan_b = np.isnan(fa), np.isnan(fb)
        both_nan = nan_a & nan_b
        delta = np.abs(fa - fb)
        delta[both_nan] = 0
        top = float(delta.max()) if delta.size else 0.0
        if not math.isnan(worst) and (math.isnan(top) or top > worst):  # a NaN on one side only sticks
            worst = top
        nan_alike = nan_alike and bool(np.array_equal(nan_a, nan_b))
        ok = ok and bool(np.all((delta <= d.atol + d.rtol * np.abs(fb)) | both_nan))
    if same_dtype and exact:
        return
    if not same_dtype:
        if worst == 0.0 and nan_alike:
            d.widened.append(f"{name} ({ta.dtype} -> {tb.dtype})")  # the same values, stored wider/narrower
            return
        d.out.append(
            Difference(section, name, "type", f"{ta.dtype} {list(ta.shape)}", f"{tb.dtype} {list(tb.shape)}", worst)
        )
        return
    if ok:
        d.within += 1
        return
    if ta.numel == 1:
        d.out.append(Difference(section, name, "changed", first[0], first[1], worst))
    else:
        d.out.append(
            Difference(section, name, "changed", f"{ta.dtype} {list(ta.shape)}", f"{tb.dtype} {list(tb.shape)}", worst)
        )


def _names_only(params: Any) -> list[str] | None:
    if isinstance(params, list) and params and all(isinstance(p, str) and not p.isdigit() for p in params):
        return sorted(L.name_key(p) for p in params)
    return None


def logical_diff(
    a: Any,
    b: Any,
    atol: float = 0.0,
    rtol: float = 0.0,
    *,
    progress: Callable[[int], None] | None = None,
    only: Callable[[str], bool] | None = None,
) -> DiffReport:
    """Compare A and B by logical parameter (see the module docstring); any two formats the tree reads. A and
    B: paths or opened `Checkpoint`s. `only(name)`: whether to read and compare the tensors (weight and optimizer
    state) of the parameter `name` (`view.logical.name_key`); the others are compared by presence only, and
    everything else (scalars, param groups, counters) in full: one share of a comparison that several processes
    split by parameter."""
    d = _Differ(atol, rtol)
    try:
        return _logical_diff(a, b, d, progress, only)
    finally:
        d.close_readers()


def _megatron_names(ca, cb, notes: list[str]):
    """A Megatron-DeepSpeed pipeline or torchtitan Llama checkpoint compared with a Megatron-LM one (what `convert
    --to megatron` writes from it) is read under the Megatron-core names the conversion gives it
    (`view.megatron_core.core_view`; torchtitan's head counts from the Megatron side's args), so the two pair by
    parameter; said in a note. Where the source cannot be named so, the note says why."""
    sides = [ca, cb]
    for i, (ck, other) in enumerate(((ca, cb), (cb, ca))):
        if pairs_with_core_names(ck, other):
            try:
                sides[i] = core_view(ck, other)
            except UnsupportedCheckpoint as e:
                notes.append(f"{'AB'[i]}'s {ck.format} names are not paired with Megatron-core's: {e}")
            else:
                what = "torchtitan Llama" if from_torchtitan(ck) else "Megatron-DeepSpeed pipeline"
                notes.append(
                    f"{'AB'[i]} ({what}) read under the Megatron-core names `convert --to megatron` gives its tensors"
                )
    return sides[0], sides[1]


def _logical_diff(
    a: Any, b: Any, d: "_Differ", progress: Callable[[int], None] | None, only: Callable[[str], bool] | None = None
) -> DiffReport:
    ca, cb = L.open_any(a), L.open_any(b)
    notes: list[str] = []
    ca, cb = _megatron_names(ca, cb, notes)
    for side, ck in (("A", ca), ("B", cb)):
        fused = find_fused(ck.tree)
        if fused and not ck.state_split:
            notes.append(
                f"{side} holds {len(fused)} fused parameter(s) saved split ({next(iter(fused))}, …): its "
                "Adam state is compared fused; --n-kv-heads N compares it split into wq/wk/wv, as a "
                "conversion carries it"
            )

    _model_diff(ca, cb, d, progress, only)
    oa, ob = _optimizer_diff(ca, cb, d, notes, progress, only)
    _groups_diff(ca, cb, d, notes, bool(oa and ob))
    if d.widened:
        notes.append(
            f"{len(d.widened)} tensor{'s hold' if len(d.widened) > 1 else ' holds'} the same values in another "
            f"dtype: {', '.join(d.widened[:4])}{', ...' if len(d.widened) > 4 else ''}"
        )

    _counters_diff(ca, cb, d)
    return DiffReport(
        str(ca.path),
        str(cb.path),
        d.atol,
        d.rtol,
        tuple(d.out),
        0,
        d.tensors,
        d.read,
        d.within,
        "logical",
        tuple(notes),
    )


def _model_diff(ca, cb, d: "_Differ", progress: Callable[[int], None] | None, only) -> None:
    """The model: every tensor by name (`L.name_key`), the fp32 master where the format keeps one; added,
    removed, then the values of those `only` accepts."""
    # the model: every tensor by name, the fp32 master where the format keeps one
    # paired by `L.name_key`: one parameter the two formats of a framework name apart (Megatron's layer norms)
    ma = {L.name_key(t.name): t for t in L.model_tensors(ca, weights="fp32")}
    mb = {L.name_key(t.name): t for t in L.model_tensors(cb, weights="fp32")}
    for name in ma:
        if name not in mb:
            d.out.append(Difference("model", name, "removed", f"{ma[name].dtype} {list(ma[name].shape)}"))
    for name in mb:
        if name not in ma:
            d.out.append(Difference("model", name, "added", None, f"{mb[name].dtype} {list(mb[name].shape)}"))
    for name in ma:
        if name in mb and (only is None or only(name)):
            _read_compare(d, "model", name, ma[name], mb[name])
            if progress:
                progress(1)


def _optimizer_diff(ca, cb, d: "_Differ", notes: list[str], progress: Callable[[int], None] | None, only):
    """The optimizer: per-parameter state tensors (the fp32 master was compared as the model) and the step;
    returns both sides' per-parameter states ({name: {key: tensor}}, without fp32 and step)."""
    # the optimizer: per-parameter state tensors (the fp32 master was compared as the model) and scalars
    keyed = lambda d: {L.name_key(p): v for p, v in d.items()}  # noqa: E731
    oa, ob = keyed(L.optimizer_states(ca)), keyed(L.optimizer_states(cb))
    sa, sb = keyed(L.optimizer_scalars(ca)), keyed(L.optimizer_scalars(cb))
    strip = lambda o: {p: {k: t for k, t in ks.items() if k not in ("fp32", "step")} for p, ks in o.items()}  # noqa: E731
    oa, ob = {p: ks for p, ks in strip(oa).items() if ks}, {p: ks for p, ks in strip(ob).items() if ks}
    if bool(oa) != bool(ob):
        side, other = ("B", "A") if oa else ("A", "B")
        notes.append(
            f"{side} has no per-parameter optimizer state (an export?): only the model and what both "
            f"record were compared; {other}'s optimizer state was not"
        )
    elif oa:
        for p in oa:
            for k in oa[p]:
                if k not in ob.get(p, {}):
                    d.out.append(
                        Difference("optimizer", f"{p}.{k}", "removed", f"{oa[p][k].dtype} {list(oa[p][k].shape)}")
                    )
        for p in ob:
            for k in ob[p]:
                if k not in oa.get(p, {}):
                    d.out.append(
                        Difference("optimizer", f"{p}.{k}", "added", None, f"{ob[p][k].dtype} {list(ob[p][k].shape)}")
                    )
        for p in oa:
            for k in oa[p]:
                if k in ob.get(p, {}) and (only is None or only(p)):
                    _read_compare(d, "optimizer", f"{p}.{k}", oa[p][k], ob[p][k])
                    if progress:
                        progress(1)
        # a parameter whose step one side keeps and the other lost (no scalars for it at all) is a difference too:
        # a conversion that drops the per-parameter step restarts Adam's bias correction
        for p in sorted((set(sa) | set(sb)) & set(oa) & set(ob)):
            for k in ("step",):
                va, vb = _as_number(sa.get(p, {}).get(k)), _as_number(sb.get(p, {}).get(k))
                if va is None and vb is None:
                    continue
                if va is None or vb is None:
                    d.out.append(Difference("optimizer", f"{p}.{k}", "added" if va is None else "removed", va, vb))
                else:
                    d.value("optimizer", (p, k), va, vb)
    return oa, ob


def _groups_diff(ca, cb, d: "_Differ", notes: list[str], both_states: bool) -> None:
    """The param groups: hyper-parameters, and members where both sides name them; a side without groups where
    both keep per-parameter optimizer state (`both_states`) lost them."""
    # the param groups: hyper-parameters, and members where both sides name them
    ga, gb = L.param_groups(ca), L.param_groups(cb)
    if ga and gb:
        if len(ga) != len(gb):
            d.out.append(Difference("param_groups", "", "changed", f"{len(ga)} groups", f"{len(gb)} groups"))
        for i, (x, y) in enumerate(zip(ga, gb)):
            for k in sorted(set(x) | set(y), key=str):
                if k in ("params", "param_names"):
                    continue
                if k not in y:
                    d.out.append(Difference("param_groups", f"{i}.{k}", "removed", _short(x[k])))
                elif k not in x:
                    d.out.append(Difference("param_groups", f"{i}.{k}", "added", None, _short(y[k])))
                else:
                    d.value("param_groups", (i, k), x[k], y[k])
            na, nb = _names_only(x.get("params")), _names_only(y.get("params"))
            if na is not None and nb is not None and na != nb:
                gone, new = sorted(set(na) - set(nb)), sorted(set(nb) - set(na))
                d.out.append(
                    Difference(
                        "param_groups",
                        f"{i}.params",
                        "changed",
                        f"{len(na)} params" + (f", without {gone[:4]}" if gone else ""),
                        f"{len(nb)} params" + (f", with {new[:4]}" if new else ""),
                    )
                )
    elif (ga or gb) and both_states:  # both keep per-parameter optimizer state: a side without its groups lost them
        d.out.append(Difference("param_groups", "", "changed", f"{len(ga)} groups", f"{len(gb)} groups"))
    elif ga or gb:
        notes.append(f"{'B' if ga else 'A'} records no param groups: not compared")


def _counters_diff(ca, cb, d: "_Differ") -> None:
    """The counters both sides record."""
    # the counters both sides record
    for field in ("global_step", "optimizer_step", "scheduler_last_epoch", "scheduler_step_count", "skipped_steps"):
        va, vb = getattr(ca.counters, field), getattr(cb.counters, field)
        if va is not None and vb is not None and va != vb:
            d.out.append(Difference("counters", field, "changed", va, vb, abs(float(va) - float(vb))))


def _as_number(v: Any) -> float | int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v
    if isinstance(v, (list, tuple)) and len(v) == 1 and isinstance(v[0], (int, float)):
        return v[0]
    return None


def iter_lines(report: DiffReport) -> Iterator[tuple[str, str, str]]:
    """(file, field, "old -> new") per difference, for the CLI table."""
    for x in report.differences:
        if x.kind == "added":
            what = f"added: {x.new}" if x.new is not None else "added"
        elif x.kind == "removed":
            what = f"removed: {x.old}" if x.old is not None else "removed"
        else:
            what = f"{x.old} -> {x.new}" + (
                f"  (max |diff| {x.max_abs_diff:.3g})" if x.max_abs_diff is not None and not _number(x.old) else ""
            )
        yield x.file, x.field, what


__all__ = ["Difference", "DiffReport", "MODES", "choose_mode", "diff", "iter_lines", "logical_diff"]
