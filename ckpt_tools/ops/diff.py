"""`ckpt diff A B`: what changed between two checkpoints, file by file, field by field, tensor by tensor.

The comparison runs on each file's inert pickle tree (`pickle_reader`, nothing executed), so a field is
named by where it lives in its file (`optimizer_state_dict.base_optimizer_state.param_groups.0.lr`) and
every rank's file is compared — the exact counterpart of the `FieldChange`s a `set-lr` plan lists.

Tensor bytes are read only where metadata cannot decide: two tensors with a different shape or dtype are
reported from metadata alone; two files that are the same inode (a hard-linked backup) are equal without
reading anything; otherwise equal-metadata tensors are compared in chunks through mmap (bit-exact first,
then `|a - b| <= atol + rtol * |b|`, torch.allclose semantics). Files that are not pickles (safetensors are
read by header + tensor bytes; `latest`, JSON, `.distcp` blobs) are compared byte for byte.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from .. import pickle_reader
from ..errors import CkptError, NotACheckpoint
from ..pickle_reader import DType, NumpyArray, Opaque, TensorRef
from ..tree import jsonable

_CHUNK_ELEMS = 8 << 20


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
                from ..formats.safetensors_file import read_header

                self.value(rel, (), read_header(pa)[0], read_header(pb)[0])
            elif not _same_bytes(pa, pb):
                self.out.append(Difference(rel, "", "changed", f"{pa.stat().st_size} bytes", f"{pb.stat().st_size} bytes"))
            return
        self.value(rel, (), la.obj, lb.obj)

    def value(self, rel: str, path: tuple, a: Any, b: Any) -> None:
        name = ".".join(map(str, path))
        if isinstance(a, TensorRef) and isinstance(b, TensorRef):
            self.tensor(rel, name, a, b)
        elif isinstance(a, dict) and isinstance(b, dict):
            for k in a:
                if k not in b:
                    self.out.append(Difference(rel, ".".join(map(str, path + (k,))), "removed", _short(a[k]), None))
                else:
                    self.value(rel, path + (k,), a[k], b[k])
            for k in b:
                if k not in a:
                    self.out.append(Difference(rel, ".".join(map(str, path + (k,))), "added", None, _short(b[k])))
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
            self.out.append(Difference(rel, name, "changed", f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}"))
            return
        if a.numel == 0 or a.storage is None or b.storage is None:
            return
        self.read += 1
        import numpy as np

        worst, exact, ok = 0.0, True, True
        for start in range(0, a.numel, _CHUNK_ELEMS):
            n = min(_CHUNK_ELEMS, a.numel - start)
            xa, xb = a.read_numpy(start, n), b.read_numpy(start, n)
            if np.array_equal(xa.view(np.uint8) if xa.dtype != np.bool_ else xa,
                              xb.view(np.uint8) if xb.dtype != np.bool_ else xb):
                continue
            exact = False
            fa, fb = _as_float(xa, a.dtype), _as_float(xb, b.dtype)
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
            self.out.append(Difference(rel, name, "changed", f"{a.dtype} {list(a.shape)}", f"{b.dtype} {list(b.shape)}",
                                       worst))


def _as_float(x, dtype: str):
    import numpy as np

    if dtype == "bfloat16":
        return (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return x.astype(np.float64)


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
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(16 << 20), fb.read(16 << 20)
            if x != y:
                return False
            if not x:
                return True


def diff(a: str | os.PathLike, b: str | os.PathLike, atol: float = 0.0, rtol: float = 0.0) -> DiffReport:
    """Compare checkpoint `a` (before) with `b` (after): a file, or a folder compared file by file (same
    relative paths). Returns every difference beyond `atol`/`rtol`; `report.same` when there is none."""
    pa, pb = Path(a), Path(b)
    if atol < 0 or rtol < 0:
        raise CkptError("--atol/--rtol must be >= 0")
    from ..formats import detect

    for p in (pa, pb):
        detect(p)  # both must be checkpoints: an empty or unrelated folder is an error, not "no difference"
    fa, fb = _files(pa), _files(pb)
    if pa.is_file() and pb.is_file():
        fb = {pa.name: pb}  # two single files: compare them whatever their names
    d = _Differ(atol, rtol)
    for rel in sorted(set(fa) | set(fb)):
        if rel not in fb:
            d.out.append(Difference(rel, "", "removed"))
        elif rel not in fa:
            d.out.append(Difference(rel, "", "added"))
        else:
            d.file(rel, fa[rel], fb[rel])
    return DiffReport(str(pa), str(pb), atol, rtol, tuple(d.out), len(set(fa) & set(fb)), d.tensors, d.read, d.within)


def iter_lines(report: DiffReport) -> Iterator[tuple[str, str, str]]:
    """(file, field, "old -> new") per difference, for the CLI table."""
    for x in report.differences:
        if x.kind == "added":
            what = f"added: {x.new}" if x.new is not None else "added"
        elif x.kind == "removed":
            what = f"removed: {x.old}" if x.old is not None else "removed"
        else:
            what = f"{x.old} -> {x.new}" + (f"  (max |diff| {x.max_abs_diff:.3g})" if x.max_abs_diff is not None
                                            and not _number(x.old) else "")
        yield x.file, x.field, what


__all__ = ["Difference", "DiffReport", "diff", "iter_lines"]
