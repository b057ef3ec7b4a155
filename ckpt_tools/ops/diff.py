"""`ckpt diff A B`: what changed between two checkpoints, file by file, field by field, tensor by tensor —
or, across formats and topologies, parameter by parameter (the logical comparison below).

Two modes (`mode=`; the CLI's --files / --logical force one, "auto" picks):
  files    two checkpoints of the same format and topology: every file compared by relative path (below).
  logical  A and B of different formats or topologies (a ZeRO checkpoint and its universal output, its
           export, a DCP copy, ZeRO-2 vs ZeRO-3): both are read through `ckpt_tools.logical` and compared by
           logical name — every model tensor (the fp32 master where the format keeps one), every
           per-parameter optimizer state tensor (exp_avg, momentum_buffer, sum, ...) and scalar (step), each
           param group's hyper-parameters and members, and the step counters. A side without optimizer state
           (an export) has its model compared only, and the report says so. One tensor is read at a time.

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
from typing import Any, Callable, Iterator

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


MODES = ("auto", "files", "logical")


def choose_mode(a: str | os.PathLike, b: str | os.PathLike) -> str:
    """"files" when A and B are the same format with the same topology and one's files are among the other's
    (their files correspond one to one; an added or removed file is then a difference to name), else "logical". When one of them cannot be opened as a whole (a damaged copy), "files": the file by file
    comparison still names what differs."""
    from .. import open_checkpoint
    from ..formats import detect

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


def diff(a: str | os.PathLike, b: str | os.PathLike, atol: float = 0.0, rtol: float = 0.0, *,
         mode: str = "auto", progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare checkpoint `a` (before) with `b` (after). mode "files": a file, or a folder compared file by
    file (same relative paths); "logical": by logical parameter and optimizer state (`logical_diff`); "auto":
    `choose_mode`. Returns every difference beyond `atol`/`rtol`; `report.same` when there is none."""
    pa, pb = Path(a), Path(b)
    if atol < 0 or rtol < 0:
        raise CkptError("--atol/--rtol must be >= 0")
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    from ..formats import detect

    for p in (pa, pb):
        detect(p)  # both must be checkpoints: an empty or unrelated folder is an error, not "no difference"
    if mode == "auto":
        mode = choose_mode(pa, pb)
    if mode == "logical":
        return logical_diff(pa, pb, atol, rtol, progress=progress)
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


# --- the logical comparison ----------------------------------------------------------------------------------


def _read_compare(d: "_Differ", section: str, name: str, ta, tb) -> None:
    """Compare two LogicalTensors: metadata first, then values (bit-exact, then atol/rtol) one tensor at a time."""
    import torch

    d.tensors += 1
    if tuple(ta.shape) != tuple(tb.shape):
        d.out.append(Difference(section, name, "changed", f"{ta.dtype} {list(ta.shape)}", f"{tb.dtype} {list(tb.shape)}"))
        return
    d.read += 1
    xa, xb = ta.read(), tb.read()
    if xa.dtype == xb.dtype and (xa.numel() == 0 or torch.equal(xa.reshape(-1).view(torch.uint8) if xa.dtype != torch.bool
                                                              else xa.reshape(-1),
                                                              xb.reshape(-1).view(torch.uint8) if xb.dtype != torch.bool
                                                              else xb.reshape(-1))):
        return
    fa, fb = xa.double().reshape(-1), xb.double().reshape(-1)
    both_nan = torch.isnan(fa) & torch.isnan(fb)
    delta = (fa - fb).abs()
    delta[both_nan] = 0
    worst = float(delta.max()) if delta.numel() else 0.0
    if xa.dtype != xb.dtype:
        if worst == 0.0 and bool(torch.all(torch.isnan(fa) == torch.isnan(fb))):
            d.widened.append(f"{name} ({ta.dtype} -> {tb.dtype})")  # the same values, stored wider/narrower
            return
        d.out.append(Difference(section, name, "type", f"{ta.dtype} {list(ta.shape)}", f"{tb.dtype} {list(tb.shape)}",
                                worst))
        return
    ok = bool(torch.all((delta <= d.atol + d.rtol * fb.abs()) | both_nan))
    if ok:
        d.within += 1
        return
    if xa.numel() == 1:
        d.out.append(Difference(section, name, "changed", fa.item(), fb.item(), worst))
    else:
        d.out.append(Difference(section, name, "changed", f"{ta.dtype} {list(ta.shape)}", f"{tb.dtype} {list(tb.shape)}",
                                worst))


def _names_only(params: Any) -> list[str] | None:
    if isinstance(params, list) and params and all(isinstance(p, str) and not p.isdigit() for p in params):
        return sorted(params)
    return None


def logical_diff(a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0, *,
                 progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare A and B by logical parameter (see the module docstring); any two formats the tree reads. A and
    B: paths or opened `Checkpoint`s."""
    from .. import logical as L

    ca, cb = L.open_any(a), L.open_any(b)
    d = _Differ(atol, rtol)
    notes: list[str] = []

    # the model: every tensor by name, the fp32 master where the format keeps one
    ma = {t.name: t for t in L.model_tensors(ca, weights="fp32")}
    mb = {t.name: t for t in L.model_tensors(cb, weights="fp32")}
    for name in ma:
        if name not in mb:
            d.out.append(Difference("model", name, "removed", f"{ma[name].dtype} {list(ma[name].shape)}"))
    for name in mb:
        if name not in ma:
            d.out.append(Difference("model", name, "added", None, f"{mb[name].dtype} {list(mb[name].shape)}"))
    for name in ma:
        if name in mb:
            _read_compare(d, "model", name, ma[name], mb[name])
            if progress:
                progress(1)

    # the optimizer: per-parameter state tensors (the fp32 master was compared as the model) and scalars
    oa, ob = L.optimizer_states(ca), L.optimizer_states(cb)
    sa, sb = L.optimizer_scalars(ca), L.optimizer_scalars(cb)
    strip = lambda o: {p: {k: t for k, t in ks.items() if k not in ("fp32", "step")} for p, ks in o.items()}  # noqa: E731
    oa, ob = {p: ks for p, ks in strip(oa).items() if ks}, {p: ks for p, ks in strip(ob).items() if ks}
    if bool(oa) != bool(ob):
        side, other = ("B", "A") if oa else ("A", "B")
        notes.append(f"{side} has no per-parameter optimizer state (an export?): only the model and what both "
                     f"record were compared; {other}'s optimizer state was not")
    elif oa:
        for p in oa:
            for k in oa[p]:
                if k not in ob.get(p, {}):
                    d.out.append(Difference("optimizer", f"{p}.{k}", "removed", f"{oa[p][k].dtype} {list(oa[p][k].shape)}"))
        for p in ob:
            for k in ob[p]:
                if k not in oa.get(p, {}):
                    d.out.append(Difference("optimizer", f"{p}.{k}", "added", None, f"{ob[p][k].dtype} {list(ob[p][k].shape)}"))
        for p in oa:
            for k in oa[p]:
                if k in ob.get(p, {}):
                    _read_compare(d, "optimizer", f"{p}.{k}", oa[p][k], ob[p][k])
                    if progress:
                        progress(1)
        for p in sorted(set(sa) & set(sb)):
            for k in ("step",):
                va, vb = _as_number(sa[p].get(k)), _as_number(sb[p].get(k))
                if va is None and vb is None:
                    continue
                if va is None or vb is None:
                    d.out.append(Difference("optimizer", f"{p}.{k}", "added" if va is None else "removed", va, vb))
                else:
                    d.value("optimizer", (p, k), va, vb)

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
                d.out.append(Difference("param_groups", f"{i}.params", "changed",
                                        f"{len(na)} params" + (f", without {gone[:4]}" if gone else ""),
                                        f"{len(nb)} params" + (f", with {new[:4]}" if new else "")))
    elif ga or gb:
        notes.append(f"{'B' if ga else 'A'} records no param groups: not compared")

    if d.widened:
        notes.append(f"{len(d.widened)} tensor{'s hold' if len(d.widened) > 1 else ' holds'} the same values in another "
                     f"dtype: {', '.join(d.widened[:4])}{', ...' if len(d.widened) > 4 else ''}")

    # the counters both sides record
    for field in ("global_step", "optimizer_step", "scheduler_last_epoch", "scheduler_step_count", "skipped_steps"):
        va, vb = getattr(ca.counters, field), getattr(cb.counters, field)
        if va is not None and vb is not None and va != vb:
            d.out.append(Difference("counters", field, "changed", va, vb, abs(float(va) - float(vb))))
    return DiffReport(str(ca.path), str(cb.path), atol, rtol, tuple(d.out), 0, d.tensors, d.read, d.within, "logical",
                      tuple(notes))


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
            what = f"{x.old} -> {x.new}" + (f"  (max |diff| {x.max_abs_diff:.3g})" if x.max_abs_diff is not None
                                            and not _number(x.old) else "")
        yield x.file, x.field, what


__all__ = ["Difference", "DiffReport", "MODES", "choose_mode", "diff", "iter_lines", "logical_diff"]
