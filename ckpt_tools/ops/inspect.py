"""`ckpt inspect`: the header and tree of a checkpoint as data (the CLI renders it).

The JSON contract (`summary()`), which scripts rely on — keep these names:
    {"format", "path", "topology": {"dp","tp","pp","zero_stage"}, "parameters": {"count","tensors"},
     "counters": {"global_step","optimizer_step","scheduler_last_epoch","scheduler_step_count","skipped_steps"},
     "lr": {"param_groups": [float]|null, "base_lrs": [float]|null, "last_lr": [float]|null},
     "warnings": [{"code","message","path"}], "tree": {...}}
plus "dtypes", "files" (every file read), "files_unread" (state files no reader took), "details". Unknown values are
null, never guessed: "lr.param_groups" is null when
the checkpoint holds no optimizer (a safetensors file), not an empty list. In "tree", a tensor is
{"shape","dtype","numel"} (+ "value" for tiny tensors, "merge" for TP tensors); an object of a class the
reader does not run is {"class", "fields"}; other values are plain JSON.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from .. import formats
from ..errors import CkptError
from ..read.tree import Checkpoint, GroupNode, Node, OpaqueNode, TensorNode, ValueNode, Warning_, iter_tensors, jsonable
from ..view.checkpoint import open_checkpoint
from ..write import io
from . import diff as chunked


def open_for_inspect(path: str | Path) -> Checkpoint:
    """`open_checkpoint(path)`; when `path` is one file of a larger checkpoint (a ZeRO rank file, a DCP
    `.distcp`, a safetensors shard), the file's own view with a `part-of-checkpoint` warning naming the
    folder that opens the whole checkpoint: read alone, such a file looks like an empty or broken one."""
    ck = open_checkpoint(path)
    return replace(ck, warnings=(*write_warnings(ck), *ck.warnings))


def write_warnings(ck: Checkpoint) -> list[Warning_]:
    """`interrupted-write` when a ckpt write on this checkpoint was killed midway: the values shown may mix old
    and new ones, and the message says what `ckpt restore` will do. Only reads the journal (io.interrupted_write)."""
    said = io.interrupted_write(Path(ck.path))
    return [Warning_("interrupted-write", said, str(ck.path))] if said else []


def list_checkpoints(folder: str | Path) -> list[dict[str, Any]]:
    """The checkpoints inside a folder that is not one (`formats.checkpoints_inside`), newest first, each
    {"path", "format", "step", "bytes", "modified", "error"}: `step` is the global step (the optimizer step
    where no loop counter is saved), `modified` the newest file's time (ISO 8601, local), `error` the
    one-line reason one cannot be opened (then `step` and `bytes` are null)."""
    rows = []
    for path, mod in formats.checkpoints_inside(Path(folder)):
        row: dict[str, Any] = {
            "path": str(path),
            "format": getattr(mod, "FORMAT", None),
            "step": None,
            "bytes": None,
            "error": None,
            "modified": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(formats.newest_mtime(path))),
        }
        try:
            ck = mod.open(path)
        except (CkptError, OSError) as e:
            row["error"] = e.one_line() if isinstance(e, CkptError) else str(e)
        else:
            c = ck.counters
            row.update(
                format=ck.format,
                bytes=sum(f.bytes for f in ck.files),
                step=c.global_step if c.global_step is not None else c.optimizer_step,
            )
        rows.append(row)
    return rows


def filter_tree(
    node: Node,
    *,
    grep: str | None = None,
    depth: int | None = None,
    rank: dict[str, int] | None = None,
    _path: str = "",
    _level: int = 0,
) -> Node | None:
    """The subtree whose leaf paths match `grep` (a case-insensitive regex), cut at `depth` levels,
    keeping only tensors with a piece on `rank` (e.g. {"dp": 1}). None when nothing is left."""
    if grep is None and depth is None and not rank:
        return node  # nothing to filter: the tree as it is (no copy of tens of thousands of nodes)
    pat = re.compile(grep, re.IGNORECASE) if isinstance(grep, str) else grep
    if isinstance(node, (GroupNode, OpaqueNode)):
        if depth is not None and _level >= depth:
            if pat is not None and not pat.search(_path):
                return None
            if not node.children:
                return node
            n = len(node.children)
            cut = {"…": ValueNode(f"{n} {'entry' if n == 1 else 'entries'} below --depth {depth}")}
            return GroupNode(cut) if isinstance(node, GroupNode) else OpaqueNode(node.cls, cut)
        kids = {}
        for name, child in node.children.items():
            sub = filter_tree(
                child,
                grep=pat,
                depth=depth,
                rank=rank,
                _path=f"{_path}.{name}" if _path else str(name),
                _level=_level + 1,
            )
            if sub is not None:
                kids[name] = sub
        if not kids and (pat is not None or rank) and _path:
            return None
        return GroupNode(kids) if isinstance(node, GroupNode) else OpaqueNode(node.cls, kids)
    if pat is not None and not pat.search(_path):
        return None
    if rank and isinstance(node, TensorNode) and not _has_rank(node, rank):
        return None
    if rank and not isinstance(node, TensorNode):
        return None
    return node


def _has_rank(t: TensorNode, rank: dict[str, int]) -> bool:
    pieces = list(t.pieces) + [p for s in t.shards for p in s.pieces]
    return any(all(p.rank.get(k) == v for k, v in rank.items()) for p in pieces)


def rank_pieces(t: TensorNode, rank: dict[str, int]) -> list:
    pieces = list(t.pieces) + [p for s in t.shards for p in s.pieces]
    return [p for p in pieces if all(p.rank.get(k) == v for k, v in rank.items())]


#: values `jsonable` gives back as they are (a float may not be finite: it goes through `jsonable`)
_PLAIN = frozenset({int, str, bool})


def node_to_json(node: Node, rank: dict[str, int] | None = None) -> Any:
    # the two kinds of node an 18k-tensor checkpoint has ~100k of, first and by exact type: the same answer as below
    kind = type(node)
    if kind is GroupNode:
        return {k: node_to_json(v, rank) for k, v in node.children.items()}
    if kind is TensorNode and not rank and node.value is None and not node.shards:
        return {"shape": list(node.shape), "dtype": node.dtype, "numel": math.prod(node.shape)}
    if kind is ValueNode:
        value = node.value
        return value if value is None or type(value) in _PLAIN else jsonable(value)
    if isinstance(node, TensorNode):
        out: dict[str, Any] = {"shape": list(node.shape), "dtype": node.dtype, "numel": node.numel}
        if node.value is not None:
            out["value"] = jsonable(node.value)
        if node.shards:
            out["merge"] = node.merge
            out["shards"] = [{"shape": list(s.shape)} for s in node.shards]
        if rank:
            out["pieces"] = [
                {
                    "file": p.file,
                    "rank": dict(p.rank),
                    "numel": p.numel,
                    "offset": p.src_offset,
                    "dst_offset": p.dst_offset,
                }
                for p in rank_pieces(node, rank)
            ]
        return out
    if isinstance(node, OpaqueNode):
        return {"class": node.cls, "fields": {k: node_to_json(v, rank) for k, v in node.children.items()}}
    if isinstance(node, GroupNode):
        return {k: node_to_json(v, rank) for k, v in node.children.items()}
    if isinstance(node, ValueNode):
        return jsonable(node.value)
    return None


def summary(ck: Checkpoint, tree: Node | None = None, rank: dict[str, int] | None = None) -> dict[str, Any]:
    """The `--json` document (see the module docstring)."""
    return {
        "format": ck.format,
        "path": ck.path,
        # ep / vpp only where the checkpoint has them: the four sizes every format reports stay the contract
        "topology": {k: v for k, v in asdict(ck.topology).items() if v is not None or k not in ("ep", "vpp")},
        "parameters": {"count": ck.parameter_count, "tensors": ck.parameter_tensors},
        "counters": asdict(ck.counters),
        "lr": {
            "param_groups": list(ck.lr.param_groups) if ck.lr.param_groups else None,
            "base_lrs": list(ck.lr.base_lrs) if ck.lr.base_lrs is not None else None,
            "last_lr": list(ck.lr.last_lr) if ck.lr.last_lr is not None else None,
        },
        "dtypes": list(ck.dtypes),
        "files": [{"path": f.path, "bytes": f.bytes, "role": f.role, "rank": dict(f.rank)} for f in ck.files],
        "files_unread": list((ck.details.get("accounting") or {}).get("unread", ())),
        "details": {k: jsonable(v) for k, v in ck.details.items() if k != "accounting"},
        "warnings": [asdict(w) for w in ck.warnings],
        "tree": node_to_json(tree if tree is not None else ck.tree, rank),
    }


@dataclass(frozen=True)
class TensorStats:
    path: str
    shape: tuple[int, ...]
    dtype: str
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int
    inf: int


def tensor_stats(ck: Checkpoint, grep: str | None = None) -> Iterator[TensorStats]:
    """Read every (matching) tensor and compute min/max/mean/std and NaN/Inf counts. Slow: reads bytes.

    Reads `diff.CHUNK_ELEMS` elements at a time into one reused buffer (`diff.ChunkReader`: pread, no mmap
    whose pages would stay resident), so memory stays flat whatever the tensor and checkpoint sizes. The
    values are taken as float32 (integers and bools widened, complex as |z|); min/max over the finite ones
    are exact, mean and the sample std are merged across chunks in float64 (Chan et al.'s pairwise update,
    stable where a sum of squares would cancel). numpy only: torch is imported for float8 tensors alone."""
    import numpy as np  # lazy: numpy only when --stats reads values; inspect itself stays numpy-free

    def as_float32(raw, dtype: str):
        if dtype == "float32":
            return raw
        if dtype == "bfloat16":
            return (raw.astype(np.uint32) << 16).view(np.float32)
        if dtype in ("float16", "float64"):
            return raw.astype(np.float32)
        if dtype.startswith("complex"):
            return np.abs(raw).astype(np.float32)
        if dtype.startswith("float8"):
            return chunked.to_float64(raw, dtype).astype(np.float32)
        return raw.astype(np.float64).astype(np.float32)  # integers and bools, as torch's .double().float()

    pat = re.compile(grep, re.IGNORECASE) if grep else None
    with chunked.ChunkReader() as reader:
        for path, t in iter_tensors(ck.tree):
            if pat and not pat.search(path):
                continue
            if t.numel == 0 or (not t.pieces and not t.shards):
                continue
            try:
                runs = chunked.tensor_runs(t)
            except ValueError:
                continue
            n = nan = inf = 0
            mean = m2 = 0.0
            mn, mx = math.inf, -math.inf
            for run in runs:
                for part in chunked.iter_chunks([run]):
                    x = as_float32(reader.read(part, run[0].dtype), run[0].dtype)
                    finite = np.isfinite(x)
                    k = int(np.count_nonzero(finite))
                    if k != x.size:
                        bad_nan = int(np.count_nonzero(np.isnan(x)))
                        nan, inf = nan + bad_nan, inf + x.size - k - bad_nan
                        x = x[finite]
                    if not k:
                        continue
                    mn, mx = min(mn, float(x.min())), max(mx, float(x.max()))
                    xd = x.astype(np.float64)
                    cmean = float(xd.sum()) / k
                    xd -= cmean
                    cm2 = float(np.square(xd, out=xd).sum())  # not np.dot: BLAS threads spin, 2x the CPU
                    total = n + k
                    delta = cmean - mean
                    mean += delta * k / total
                    m2 += cm2 + delta * delta * n * k / total
                    n = total
            if n:
                std = math.sqrt(m2 / (n - 1)) if n > 1 else 0.0
                yield TensorStats(path, t.shape, t.dtype, mn, mx, mean, std, nan, inf)
            else:
                yield TensorStats(path, t.shape, t.dtype, None, None, None, None, nan, inf)


def stats_warnings(stats: list[TensorStats]) -> list[Warning_]:
    return [
        Warning_("non-finite", f"{s.path}: {s.nan} NaN and {s.inf} Inf values", s.path) for s in stats if s.nan or s.inf
    ]
