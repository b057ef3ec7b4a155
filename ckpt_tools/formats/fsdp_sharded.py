"""FSDP1 SHARDED_STATE_DICT saved with one `torch.save` per rank (`rank0.pt`, `rank1.pt`, ...).

Each rank's file holds the whole training dict, but every sharded tensor in it is a `ShardedTensor`:
the global size, this rank's local shards (tensor + offsets) and the metadata of every rank's shard.
`torch.load` needs a process group of the saving world size to unpickle these; the safe reader just
records them (`TensorRef.subclass_state`), so one logical TensorNode per tensor is assembled here from
the local shards of ALL rank files, each shard a `Piece` placed by its `shard_offsets`.

Values that are not sharded (Adam's `step`, param_groups, the scheduler, the loop step) are taken from
the lowest rank's file, as torch itself restores them per rank.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any, Mapping

from ..errors import CorruptCheckpoint, MissingFile, NotACheckpoint
from ..read.pickle_reader import Opaque, TensorRef, is_opaque
from ..read.tree import Checkpoint, Warning_, as_int
from . import _common as C
from .dcp import Chunk, chunked_tensor, training_checkpoint

FORMAT = "fsdp_sharded_torch"
_RANK_FILE_RE = re.compile(r"^(.*?)(\d+)\.(pt|pth|bin)$")


def _rank_files(folder: Path) -> tuple[str, dict[int, Path]]:
    """(naming pattern with `{rank}`, rank -> file) for the most common `<prefix><rank>.<ext>` naming."""
    groups: dict[tuple[str, str, int], dict[int, Path]] = {}
    for p in sorted(folder.iterdir()):
        m = _RANK_FILE_RE.match(p.name)
        if m and p.is_file():
            width = len(m[2]) if m[2].startswith("0") and len(m[2]) > 1 else 0
            groups.setdefault((m[1], m[3], width), {})[int(m[2])] = p
    if not groups:
        return "", {}
    (prefix, ext, width), files = max(groups.items(), key=lambda kv: len(kv[1]))
    return f"{prefix}{{rank:0{width}d}}.{ext}" if width else f"{prefix}{{rank}}.{ext}", files


def _has_sharded_tensor(path: Path) -> bool:
    """Whether the file's pickle names ShardedTensor: a byte search in data.pkl, nothing unpickled."""
    try:
        with zipfile.ZipFile(path) as zf:
            pkl = [n for n in zf.namelist() if n.endswith("data.pkl") and n.count("/") <= 1]
            return bool(pkl) and b"ShardedTensor" in zf.read(min(pkl, key=len))
    except (zipfile.BadZipFile, OSError, ValueError, KeyError):
        return False


def sniff(path: Path) -> bool:
    # DeepSpeed and Accelerate folders are recognised before this module; their files also never name
    # ShardedTensor except Accelerate's own FSDP files, which is why the order in formats/__init__ matters.
    # One file naming it is enough: a damaged rank file is then reported by open(), not as "unknown format".
    if not path.is_dir():
        return False
    _, files = _rank_files(path)
    return any(_has_sharded_tensor(p) for p in files.values())


def _is_sharded(obj: Any) -> bool:
    return (
        isinstance(obj, TensorRef)
        and (obj.subclass or "").endswith("ShardedTensor")
        and isinstance(obj.subclass_state, tuple)
        and len(obj.subclass_state) >= 2
    )


def _iter_sharded(obj: Any, _depth: int = 0):
    if _is_sharded(obj):
        yield obj
    elif _depth < 64 and isinstance(obj, Mapping):
        for v in obj.values():
            yield from _iter_sharded(v, _depth + 1)
    elif _depth < 64 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _iter_sharded(v, _depth + 1)


def _saving_ranks(st: TensorRef) -> tuple[set[int], int | None]:
    """(ranks the metadata places shards on, the world size that saved) of one ShardedTensor."""
    _, st_meta, *rest = st.subclass_state
    shards = st_meta.field("shards_metadata") if is_opaque(st_meta) else None
    ranks = {as_int(_placement_rank(m)) for m in shards or []} - {None}
    pg = rest[0] if rest else None
    return ranks, as_int(pg.field("global_world_size")) if isinstance(pg, Opaque) else None


def _placement_rank(shard_meta: Any) -> Any:
    placement = shard_meta.field("placement") if isinstance(shard_meta, Opaque) else None
    return placement.field("_rank") if isinstance(placement, Opaque) else None


def _local_chunks(st: TensorRef, key: str, rel: str, file_rank: int, where: Path) -> list[Chunk]:
    out = []
    for shard in st.subclass_state[0] or []:
        ref = shard.field("tensor") if isinstance(shard, Opaque) else None
        meta = shard.field("metadata") if isinstance(shard, Opaque) else None
        offsets = meta.field("shard_offsets") if isinstance(meta, Opaque) else None
        sizes = meta.field("shard_sizes") if isinstance(meta, Opaque) else None
        if not isinstance(ref, TensorRef) or offsets is None or sizes is None:
            raise CorruptCheckpoint(
                f"{key}: a local shard has no tensor or no offsets",
                path=where,
                hint="the file was not written by FSDP's SHARDED_STATE_DICT",
            )
        rank = as_int(_placement_rank(meta))
        out.append(Chunk(tuple(offsets), tuple(sizes), ref, rel, {"dp": file_rank if rank is None else rank}))
    return out


def _merge(objs: dict[int, Any], key: str, cache: C.LoadCache, files: dict[int, Path]) -> Any:
    """The lowest rank's object with every ShardedTensor replaced by the TensorNode of all ranks' shards."""
    first_rank = min(objs)
    first = objs[first_rank]
    if _is_sharded(first):
        chunks = []
        for r, o in objs.items():
            if not _is_sharded(o):
                raise CorruptCheckpoint(
                    f"{key} is a ShardedTensor in {files[first_rank].name} but not here",
                    path=files[r],
                    hint="the rank files come from different runs",
                )
            chunks += _local_chunks(o, key, cache.rel(files[r]), r, files[r])
        return chunked_tensor(key, first.shape, first.dtype, chunks, files[first_rank].parent)
    if isinstance(first, Mapping):
        return {
            k: _merge(
                {r: o.get(k) if isinstance(o, Mapping) else None for r, o in objs.items()},
                f"{key}.{k}" if key else str(k),
                cache,
                files,
            )
            for k in first
        }
    if isinstance(first, list) and any(True for _ in _iter_sharded(first)):
        return [
            _merge(
                {r: o[i] if isinstance(o, list) and i < len(o) else None for r, o in objs.items()},
                f"{key}.{i}",
                cache,
                files,
            )
            for i in range(len(first))
        ]
    return first


def open(path: Path) -> Checkpoint:  # noqa: A001  (the format-module interface)
    """The folder of per-rank `torch.save` files at `path` (`rank0.pt`, ...). Reads every rank file inert (each
    holds the whole training dict with ShardedTensors recorded, not unpickled by torch) and assembles one lazy
    TensorNode per sharded tensor from the local shards of all of them; unsharded values come from the lowest
    rank's file. Training state: read-only here (no `training_state`)."""
    if not path.is_dir():
        raise NotACheckpoint("FSDP sharded checkpoints are folders of per-rank files", path=path)
    pattern, files = _rank_files(path)
    if not files:
        raise C.empty_checkpoint_error(path, "per-rank torch.save files (rank0.pt, ...)")
    cache = C.LoadCache(path)
    objs = {r: cache.load(p).obj for r, p in files.items()}
    for r, o in objs.items():
        if not isinstance(o, dict):
            raise CorruptCheckpoint(
                "the file does not hold a dict", path=files[r], hint="this is not a per-rank FSDP state dict"
            )
    placed, world = set(), None
    for st in _iter_sharded(objs[min(objs)]):
        ranks, ws = _saving_ranks(st)
        placed |= ranks
        world = world or ws
    expected = placed | set(range(world or 0))
    missing = sorted(expected - set(files))
    if missing:
        name = pattern.format(rank=missing[0])
        raise MissingFile(
            f"{name} is missing (the ShardedTensor metadata places shards on ranks {sorted(expected)})",
            path=path / name,
            hint="re-copy the checkpoint folder; every rank's file is needed",
        )
    warnings = [
        Warning_(
            "extra-rank-file",
            f"{p.name} is beyond the saving world size {len(expected)}: left over "
            "from another run? Move it out of the folder",
            cache.rel(p),
        )
        for r, p in files.items()
        if expected and r not in expected
    ]
    objs = {r: o for r, o in objs.items() if not expected or r in expected}
    top = _merge(objs, "", cache, files)
    warnings += C.stray_file_warnings(path, path) + cache.warnings()
    file_infos = [C.file_info(files[r], path, "checkpoint", {"dp": r}) for r in sorted(objs)]
    return training_checkpoint(
        FORMAT,
        path,
        top,
        file=cache.rel(files[min(objs)]),
        dp=world or len(objs),
        files=file_infos,
        warnings=warnings,
        details={"rank_files": pattern},
    )
