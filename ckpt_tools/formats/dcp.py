"""PyTorch distributed checkpoints (`torch.distributed.checkpoint`, what FSDP2 and torchtitan save).

Layout (docs/formats.md): a folder with `.metadata` (a plain pickle of `Metadata`) and
`__{rank}_{n}.distcp` files. Every saved item (one chunk of a tensor, or one pickled Python value)
is its own small torch.save zip inside a `.distcp` file, located by
`storage_data[MetadataIndex(fqn, chunk offset)] -> _StorageInfo(relative_path, offset, length)`.

Only `.metadata` and the small items are read when opening (the values: bytes items up to 1 MiB, and
the tensors of up to 16 elements whose values show, such as Adam's `step`): every other tensor chunk
becomes a `Piece` whose `LazyTensorRef` has the dtype and shape `.metadata` gives, and reads its item's
record (the head of its embedded torch.save zip: strides, where its bytes start) only when its bytes
are read, checked then against `.metadata` (a chunk its item is too short to hold is read when opening).
Flat keys are split with `planner_data`, never at dots, because FQNs contain dots
(`optim.state.blocks.0.ln_1.bias.step` -> ('optim', 'state', 'blocks.0.ln_1.bias', 'step')).

The chunk assembly (`Chunk`, `chunked_tensor`) and the header of a torch training dict
(`training_checkpoint`) are shared with the FSDP1 ShardedTensor reader, whose shards are the same
idea: a block of the logical tensor at some offsets, stored by one rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from ..read import native_dcp, pickle_reader, remote
from ..errors import CorruptCheckpoint, MissingFile, UnsupportedCheckpoint
from ..read.pickle_reader import Loaded, _unpickle
from ..read.pickle_reader import DTYPE_SIZE, SMALL_TENSOR_NUMEL, DType, LazyTensorRef, TensorRef, is_opaque
from ..read.qkv import find_fused
from ..read.tree import (
    Checkpoint,
    FileInfo,
    GroupNode,
    Node,
    OpaqueNode,
    Piece,
    TensorNode,
    Topology,
    ValueNode,
    Warning_,
    as_int,
    iter_tensors,
    leaf_node,
    tensor_node,
    to_node,
)
from . import _common as C
from ..read.state import StateMap, StateSource, is_flattened
from .torch_file import flattened_optimizer_tree, split_training_dict

FORMAT = "dcp"
_DISTCP_RE = re.compile(r"^__(\d+)_(\d+)\.distcp$")
#: pickled values larger than this are listed, not parsed, when opening (they are not scalars)
_MAX_VALUE_BYTES = 1 << 20


def sniff(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


# --- chunked tensors (shared with fsdp_sharded) ------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """A block of a logical tensor stored whole in one file: `ref` has shape `sizes` and sits at
    `offsets` of the logical tensor (a DCP chunk, a ShardedTensor shard)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    ref: TensorRef
    file: str
    rank: Mapping[str, int] = field(default_factory=dict)


def _runs(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]):
    """(src, dst, count) for each run of a chunk's elements that is contiguous in the flattened logical
    tensor. A split on dim 0 is one run; a split on a later dim gives one run per row of the dims
    before it, which is what keeps `read_torch` correct for any split."""
    inner, d = 1, len(shape) - 1
    while d >= 0 and sizes[d] == shape[d]:
        inner *= shape[d]
        d -= 1
    if d < 0:
        yield 0, 0, inner
        return
    strides = [math.prod(shape[j + 1 :]) for j in range(len(shape))]
    run = sizes[d] * inner
    # the rows' destinations in row-major order, built a dimension at a time (a row per leading-dims index)
    dsts = [sum(offsets[j] * strides[j] for j in range(d + 1))]
    for j in range(d):
        step = strides[j]
        dsts = [x + i * step for x in dsts for i in range(sizes[j])]
    for k, dst in enumerate(dsts):
        yield k * run, dst, run


def chunked_tensor(key: str, shape: tuple[int, ...], dtype: str, chunks: list[Chunk], where: Path) -> TensorNode:
    """One logical TensorNode from its chunks, checking that they tile the tensor exactly (a missing
    or foreign rank's chunk shows up here as a gap or an overlap)."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if len(chunks) == 1 and tuple(chunks[0].sizes) == shape and chunks[0].ref.shape == shape:
        c = chunks[0]
        _check_chunk(key, shape, dtype, c, where)
        if not 0 < c.ref.numel <= SMALL_TENSOR_NUMEL:  # tensor_node's node, its piece sharing the chunk's rank
            return TensorNode(c.ref.shape, c.ref.dtype, (Piece(c.file, c.ref, 0, c.ref.numel, 0, c.rank),))
        return tensor_node(c.ref, c.file, c.rank)
    pieces = []
    for c in chunks:
        _check_chunk(key, shape, dtype, c, where)
        rank = dict(c.rank)  # one mapping for the chunk's runs (read-only, as every piece's)
        pieces += [
            Piece(c.file, c.ref, src, n, dst, rank)
            for src, dst, n in _runs(shape, tuple(c.offsets), tuple(c.sizes))
            if n
        ]
    pieces.sort(key=lambda p: p.dst_offset)
    covered = 0
    for p in pieces:
        if p.dst_offset != covered:
            what = "overlap" if p.dst_offset < covered else f"leave elements {covered}..{p.dst_offset} uncovered"
            raise CorruptCheckpoint(
                f"{key}: the chunks {what} (shape {list(shape)})",
                path=where,
                hint="a rank's file is missing or comes from another run",
            )
        covered += p.numel
    if covered != numel:
        raise CorruptCheckpoint(
            f"{key}: the chunks cover {covered} of {numel} elements",
            path=where,
            hint="a rank's file is missing or comes from another run",
        )
    return TensorNode(shape, dtype, tuple(pieces), value=_tiny_value(shape, pieces))


def _check_chunk(key: str, shape: tuple[int, ...], dtype: str, c: Chunk, where: Path) -> None:
    if (
        len(c.offsets) != len(shape)
        or len(c.sizes) != len(shape)
        or any(o < 0 or o + s > d for o, s, d in zip(c.offsets, c.sizes, shape))
    ):
        raise CorruptCheckpoint(
            f"{key}: chunk at {list(c.offsets)} of size {list(c.sizes)} lies outside the tensor's shape {list(shape)}",
            path=where,
            hint="the metadata is corrupt",
        )
    if c.ref.numel != math.prod(c.sizes) or c.ref.dtype != dtype:
        raise CorruptCheckpoint(
            f"{key}: the stored chunk is {c.ref.dtype} {list(c.ref.shape)}, the metadata says {dtype} {list(c.sizes)}",
            path=where,
            hint=f"{c.file} comes from another run",
        )


def _tiny_value(shape: tuple[int, ...], pieces: list[Piece]) -> Any:
    """The values of a tiny chunked tensor, as `tensor_node` gives them for a whole one."""
    numel = math.prod(shape)
    if not 0 < numel <= SMALL_TENSOR_NUMEL or any(p.ref.storage is None for p in pieces):
        return None
    vals: list = [None] * numel
    try:
        for p in pieces:
            vals[p.dst_offset : p.dst_offset + p.numel] = p.ref.read_values()[p.src_offset : p.src_offset + p.numel]
    except Exception:  # unreadable bytes show as a missing value, as in tree.tensor_node
        return None
    return vals[0] if shape == () else vals


# --- the header of a torch training dict (shared with fsdp_sharded) ---------------------------------


def _nodes(obj: Any, file: str) -> Node:
    """Tree nodes for a nested dict whose leaves are already nodes or still raw unpickled objects."""
    if isinstance(obj, (TensorNode, ValueNode, GroupNode, OpaqueNode)):
        return obj
    if isinstance(obj, dict) or isinstance(obj, Mapping):  # (typing's Mapping: ~3 us per check, once per dict)
        return GroupNode({str(k): v if type(v) is TensorNode else _nodes(v, file) for k, v in obj.items()})
    if isinstance(obj, list) and any(isinstance(v, (Mapping, TensorNode)) for v in obj):
        return GroupNode({str(i): _nodes(v, file) for i, v in enumerate(obj)})
    return to_node(obj, file)


def training_checkpoint(
    fmt: str,
    root: Path,
    top: Mapping[str, Any],
    *,
    file: str,
    dp: int,
    files: list[FileInfo],
    warnings: list[Warning_],
    details: dict,
) -> Checkpoint:
    """A Checkpoint from the state dict a torch training loop saved ({model, optimizer, scheduler, step});
    `top` holds nodes (sharded tensors already assembled) or raw objects from `file`."""
    model, optims, scheds, rest = split_training_dict(dict(top))
    if model is None and rest and all(isinstance(v, TensorNode) for v in rest.values()):
        model, rest = rest, {}  # a bare model state dict
    elif model is None and sum(isinstance(v, TensorNode) for v in rest.values()) > 1:
        # torchtitan: the model's keys sit flat at the top level beside optimizer / lr_scheduler / train_state
        model = {k: v for k, v in rest.items() if isinstance(v, TensorNode)}
        rest = {k: v for k, v in rest.items() if k not in model}
    details = {**details, **_train_state_summary(rest)}
    tree: dict[str, Node] = {}
    if model is not None:
        tree["model"] = _nodes(model, file)
    for i, osd in enumerate(optims):
        tree[C._numbered("optimizer", i)] = (
            flattened_optimizer_tree(osd, file, _nodes) if is_flattened(osd) else _nodes(osd, file)
        )
    for i, sd in enumerate(scheds):
        tree[C._numbered("scheduler", i)] = _nodes(sd, file)
    if rest:
        tree["client_state"] = _nodes(rest, file)
    counters, lrs, steps = C.training_header(tree)
    params = [t for _, t in iter_tensors(tree["model"])] if "model" in tree else []
    fused = find_fused(GroupNode(tree))
    if fused:
        first = next(iter(fused))
        why = (
            f"its Adam state is saved under the fused name ({first}), with rows interleaved per KV-head group, "
            "while the weights are saved split; the checkpoint does not record the model's n_kv_heads that "
            "orders those rows"
        )
        details = {
            **details,
            "fused": f"{len(fused)} fused parameter(s) saved split, counted once "
            f"({first} = {' + '.join(p.rsplit('.', 2)[-2] for p in fused[first])}"
            f"{', …' if len(fused) > 1 else ''})",
            "convert_unproven": f"{why}: pass --n-kv-heads N (the model's KV heads) to split it "
            "(export writes the weights as saved)",
            "resume_unsupported": f"the Adam state of the fused {first} cannot be matched to its split "
            "weights without the model's n_kv_heads (convert_unproven says why): "
            "pass --n-kv-heads N",
        }
    return Checkpoint(
        format=fmt,
        path=str(root),
        topology=Topology(dp=dp, tp=1, pp=1, zero_stage=None),
        tree=GroupNode(tree),
        counters=counters,
        lr=lrs,
        parameter_count=sum(t.numel for t in params),
        parameter_tensors=len(params) - sum(len(parts) - 1 for parts in fused.values()),
        files=tuple(files),
        warnings=tuple(C.counter_warnings(counters, optimizer_steps_seen=steps) + warnings),
        dtypes=tuple(sorted({t.dtype for t in params})),
        details=details,
    )


def _raw(v: Any) -> Any:
    return v.value if isinstance(v, ValueNode) else v


def _train_state_summary(rest: Mapping[str, Any]) -> dict[str, str]:
    """torchtitan's `train_state` in one line."""
    train = rest.get("train_state")
    if isinstance(train, Mapping) and train:
        return {"train_state": ", ".join(f"{k} {_raw(v)}" for k, v in train.items())}
    return {}


def loader_summary(loader: Mapping[str, Any], world: Any, unknown: dict[str, Any] | None = None) -> str:
    """torchtitan's `dataloader` ({dp_rank_<r>: pickled StatefulDataLoader state, world_size}) in one line: each
    rank's pickle parsed inertly (no code runs): batches yielded, the dataset's sample index and epoch.
    `unknown`, when given, gets {dp_rank_<r>: its inner pickle as a `pickle_reader.Loaded`} for each one naming
    unknown globals (torchtitan's loader unpickles it with the full unpickler on resume: reported like a file's)."""
    parts = []
    for k in sorted(loader, key=lambda k: int(str(k)[8:]) if str(k)[8:].isdigit() else 0):
        raw = loader[k]
        try:
            state, seen = _unpickle(bytes(raw), None, None, f"dataloader.{k}")
        except Exception as e:  # noqa: BLE001  a loader state we cannot parse is shown as such, never fatal
            parts.append(f"{k}: unreadable ({type(e).__name__})")
            continue
        loaded = Loaded(state, "pickle", None, frozenset(seen))
        if unknown is not None and loaded.unknown_globals:
            unknown[k] = loaded
        ds = state.get("dataset_state") if isinstance(state, Mapping) else None
        bits = [f"{state.get('_num_yielded')} batches yielded"] if isinstance(state, Mapping) else []
        if isinstance(ds, Mapping):
            bits += [f"{f} {ds[f]}" for f in ("sample_idx", "epoch") if f in ds]
        parts.append(f"{k}: {', '.join(bits) or 'state saved'}")
    return (f"world_size {world}; " if world is not None else "") + "; ".join(parts)


# --- DCP ----------------------------------------------------------------------------------------------


def _rank(rel: str) -> dict[str, int]:
    m = _DISTCP_RE.match(Path(rel).name)
    return {"dp": int(m[1])} if m else {}


_FLAT_OPTIM = ("state.", "param_groups.")


def logical_path(key: str, planner: dict) -> tuple:
    """The nested key path of a flat DCP key: `planner_data`'s tuple (FQNs keep their dots), with an optimizer
    state dict saved by `flatten_optimizer_state_dict=True` (torchtitan: `optimizer.state.<fqn>.exp_avg`,
    `optimizer.param_groups.<fqn>.lr` stored as ONE key each) opened up to state/param_groups -> fqn -> field,
    so it reads like an unflattened one."""
    keys = planner.get(key)
    if not isinstance(keys, tuple):
        keys = (key,)
    last = keys[-1]
    if len(keys) >= 2 and isinstance(last, str) and last.startswith(_FLAT_OPTIM) and last.count(".") >= 2:
        head, rest = last.split(".", 1)
        fqn, fld = rest.rsplit(".", 1)
        return tuple(keys[:-1]) + (head, fqn, fld)
    return tuple(keys)


def _offsets(v: Any) -> tuple[int, ...] | None:
    return None if v is None else tuple(map(int, v))


def open(path: Path) -> Checkpoint:  # noqa: A001  (the format-module interface)
    """The DCP folder at `path`. Reads `.metadata` (by the C reader `native_dcp` where it takes the file exactly,
    else the inert unpickler), stats every `__R_C.distcp` file it names, and reads out of them only the bytes
    items (pickled objects: param groups, schedulers, torchtitan's data-loader states) and tiny tensors' values;
    every other tensor stays a lazy chunk of a `.distcp` file. Unnamed `.distcp` files are listed as warnings.
    Training state: the whole DCP, found by shape under any nesting (`training_state`: `.metadata`)."""
    cache = C.LoadCache(path)
    meta_path = path / ".metadata"
    # the C reader (`native_dcp`: no Python object per record) where it takes the file exactly; else the records
    native = None if remote._MOUNTS else native_dcp.read(meta_path)
    native_read = native is not None
    if native is not None:
        cache._note_unknown(meta_path, pickle_reader.Loaded(None, "pickle", None, native.globals_seen))
        sdm, planner, version = native.state_dict_metadata, native.planner_data, native.version
        _check_files(native.files, meta_path)
        where = native.where
        del native
    else:
        sdm, planner, where, version = _records(cache, meta_path)
    return _open(cache, path, meta_path, sdm, planner, where, version, native=native_read)


def _records(cache: C.LoadCache, meta_path: Path) -> tuple[dict, dict, dict, Any]:
    """`.metadata` read by the inert unpickler: (state_dict_metadata, planner_data, the storage index, version)."""
    loaded = pickle_reader.load(meta_path)  # not kept in the cache: its records are dropped as they are used
    cache._note_unknown(meta_path, loaded)
    md = loaded.obj
    del loaded
    sdm = md.field("state_dict_metadata") if is_opaque(md, "Metadata") else None
    storage = md.field("storage_data") if is_opaque(md, "Metadata") else None
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise CorruptCheckpoint(
            ".metadata does not hold a torch.distributed.checkpoint Metadata",
            path=meta_path,
            hint="re-copy .metadata from the run that wrote the .distcp files",
        )
    planner = md.field("planner_data")
    if not isinstance(planner, dict):
        planner = {}
    where = _storage_index(storage, meta_path)
    # .metadata's records are this open's alone: each goes once used, so that the tree's nodes reuse their memory
    # (a 120k-item .metadata parses to ~300 MB of records; the tree is as big again)
    storage.clear()
    del storage
    return sdm, planner, where, md.field("version")


def _open(
    cache: C.LoadCache,
    path: Path,
    meta_path: Path,
    sdm: dict,
    planner: dict,
    where: dict,
    version: Any,
    *,
    native: bool,
) -> Checkpoint:
    """The rest of `open`: `sdm` holds the inert records, or `native_dcp.Metadata`'s entries when `native`."""
    details = {"dcp_version": version, "items": len(sdm)}
    used, sizes = _used_files(path, where)
    unread, optional = 0, []  # tiny tensors whose values a remote open leaves unread (`_first_reads`)
    if remote._MOUNTS:  # a remote checkpoint: what opening reads of the items, planned as one parallel batch
        wants, optional = _first_reads(path, sdm, where)
        remote.plan(wants, exact=True, optional=optional)
        unread = sum(1 for p, off, n in optional if not remote.held(p, off, n))

    files = {rel: _File(path / rel, _rank(rel), sizes[rel], cache.outer(path / rel)) for rel in used}
    top, loader, loader_at = _items_tree(cache, path, meta_path, sdm, planner, where, files, native)
    del sdm, planner

    if loader:
        world = top.get("dataloader", {}).get("world_size") if isinstance(top.get("dataloader"), dict) else None
        inner: dict[str, Any] = {}
        details["dataloader"] = loader_summary(loader, _raw(world), inner)
        for k, loaded in inner.items():  # torchtitan's loader unpickles these bytes on resume: an unknown-global
            cache._note_unknown(path / loader_at[k], loaded)  # warning on the .distcp file that holds them
    present = sorted(p.name for p in path.iterdir() if _DISTCP_RE.match(p.name))
    warnings = [
        Warning_(
            "unreferenced-file",
            f"{name} is not named by .metadata: left over from another save? Move it out of the folder",
            name,
        )
        for name in present
        if name not in used
    ]
    if unread:
        warnings.append(
            Warning_(
                "values-not-read",
                f"{unread} of {len(optional)} tiny tensors (such as Adam's `step`) show no value: over remote storage "
                "they lie between the tensor bytes, and a remote open reads them only within a fixed budget of "
                f"{remote.SMALL_GETS} requests and {remote.OPTIONAL_BYTES >> 20} MiB. Inspect a local copy to see "
                "every value",
                ".metadata",
            )
        )
    warnings += C.stray_file_warnings(path, path) + cache.warnings()
    files = [C.file_info(meta_path, path, "metadata")] + [
        C.file_info(path / rel, path, "checkpoint", _rank(rel)) for rel in used
    ]
    ranks = {r["dp"] for r in map(_rank, used) if r}
    ck = training_checkpoint(
        FORMAT, path, top, file=".metadata", dp=len(ranks) or 1, files=files, warnings=warnings, details=details
    )
    if (path / "common.pt").is_file() and (path / "metadata.json").is_file():
        # Megatron-LM's torch_dist: global tensors under Megatron's own keys, the topology in common.pt's `args`
        # (the writer count is not the DP size), the LRs and counters there too: none of it is read here
        w = Warning_(
            "megatron-torch-dist",
            "a Megatron-LM torch_dist checkpoint (common.pt + metadata.json): read "
            "as a generic DCP, so parameters, topology, counters and LRs shown are not Megatron's (they "
            "are in common.pt's args and the sharded optimizer items, which ckpt does not map yet)",
            "common.pt",
        )
        ck = replace(ck, topology=Topology(), warnings=(w, *ck.warnings))
    return ck


def _used_files(path: Path, where: dict) -> tuple[list[str], dict[str, int]]:
    """(the .distcp files `.metadata` places items in, their sizes); one missing is refused with how many items
    it holds."""
    used = sorted({rel for rel, _, _ in where.values()})
    sizes: dict[str, int] = {}
    for rel in used:
        try:
            sizes[rel] = (path / rel).stat().st_size
        except OSError:
            sizes[rel] = -1
        if sizes[rel] < 0 or not (path / rel).is_file():
            n = sum(1 for r, _, _ in where.values() if r == rel)
            raise MissingFile(
                f"{rel} is missing (.metadata places {n} items in it)",
                path=path / rel,
                hint="re-copy the checkpoint folder; every rank's .distcp file is needed",
            )
    return used, sizes


def _items_tree(cache, path, meta_path, sdm, planner, where, files, native) -> tuple[dict, dict, dict]:
    """(the items as nested dicts by their logical key paths, torchtitan's per-DP-rank pickled data-loader states,
    the .distcp file holding each). One pass over the records, each popped from `sdm` as it is placed (a
    checkpoint of 100k+ items keeps no second copy)."""
    top: dict[Any, Any] = {}
    loader: dict[str, bytes] = {}  # torchtitan's per-DP-rank pickled data-loader states
    loader_at: dict[str, str] = {}  # ... and the .distcp file holding each
    kinds: dict[type, str] = {}  # what `is_opaque` says of each record class (one answer per class)
    seen: dict[bytes, tuple] = {}  # small items parsed: their bytes -> their node (`_tensor`)
    parents: dict[tuple, dict] = {}  # key path -> the dict of `top` it names (each path walked once)
    meta = None
    for key in list(sdm):
        meta = sdm.pop(key)
        keys = logical_path(key, planner)
        if native:  # an entry of `native_dcp.Metadata`: None is a bytes item
            kind = "bytes" if meta is None else "native"
        else:
            kind = kinds.get(type(meta))
            if kind is None:
                kind = kinds[type(meta)] = (
                    "tensor"
                    if is_opaque(meta, "TensorStorageMetadata")
                    else "bytes"
                    if is_opaque(meta, "BytesStorageMetadata")
                    else "other"
                )
        if kind == "native":
            node = _native_tensor(cache, path, key, meta, where, files, seen)
        elif kind == "tensor":
            node = _tensor(cache, path, key, meta, where, files, seen)
        elif kind == "bytes":
            node, obj = _value(cache, path, key, where, files)
            if keys[0] == "dataloader" and str(keys[-1]).startswith("dp_rank_") and isinstance(obj, (bytes, bytearray)):
                loader[str(keys[-1])] = bytes(obj)
                loader_at[str(keys[-1])] = where[(key, None)][0]
        else:
            node = ValueNode(repr(meta))
        slot = parents.get(keys[:-1])
        if slot is None:
            slot = top
            for k in keys[:-1]:
                slot = slot.setdefault(k, {})
                if not isinstance(slot, dict):
                    raise CorruptCheckpoint(
                        f"{key}: planner_data path {keys} runs through a value",
                        path=meta_path,
                        hint="the metadata is corrupt",
                    )
            parents[keys[:-1]] = slot
        if keys in parents:  # a value where a group was: the groups under it are no longer in the tree
            parents = {p: d for p, d in parents.items() if p[: len(keys)] != keys}
        slot[keys[-1]] = node
    del meta, parents
    return top, loader, loader_at


#: a tiny tensor's item up to this size is fetched whole from a remote store (its record and its bytes)
_SMALL_ITEM_BYTES = 64 << 10


def _storage_index(storage: dict, meta_path: Path) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]]:
    """{(fqn, chunk offsets or None): (relative_path, offset, length)} from `.metadata`'s `storage_data`, every entry
    checked (one record class, one file name checked once: a folder holds a few files and 10^5-10^6 entries)."""
    where: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    index_types: set[type] = set()
    names: set[str] = set()
    for idx, info in storage.items():
        if type(idx) not in index_types:
            if not is_opaque(idx, "MetadataIndex"):
                raise CorruptCheckpoint(
                    f"bad storage_data entry {idx!r}", path=meta_path, hint="the metadata is corrupt"
                )
            index_types.add(type(idx))
        if not is_opaque(info):
            raise CorruptCheckpoint(f"bad storage_data entry {idx!r}", path=meta_path, hint="the metadata is corrupt")
        st = info.state if isinstance(info.state, dict) else {}  # what Opaque.field reads
        rel, off, length = st.get("relative_path"), st.get("offset"), st.get("length")
        off = off if type(off) is int else as_int(off)
        length = length if type(length) is int else as_int(length)
        # a path that leaves the folder is never followed: DCP writes bare file names
        if type(rel) is not str or rel not in names:
            if not isinstance(rel, str) or Path(rel).name != rel or rel in ("", ".", ".."):
                off = None
            else:
                names.add(rel)
        if off is None or length is None:
            raise CorruptCheckpoint(
                f"bad storage entry for {idx.field('fqn')!r}", path=meta_path, hint="the metadata is corrupt"
            )
        if st.get("transform_descriptors"):
            raise UnsupportedCheckpoint(
                f"{idx.field('fqn')} is stored with transforms {info.field('transform_descriptors')} (compressed?)",
                path=meta_path,
                hint="re-save without storage transforms to inspect it",
            )
        ist = idx.state if isinstance(idx.state, dict) else {}
        where[(ist.get("fqn"), _offsets(ist.get("offset")))] = (rel, off, length)
    return where


def _check_files(files: dict[str, str], meta_path: Path) -> None:
    """`_storage_index`'s check of the relative paths, on `native_dcp.Metadata.files`: the first entry naming a bad
    one is the entry `_storage_index` refuses first, with the same message."""
    for rel, fqn in files.items():
        if Path(rel).name != rel or rel in ("", ".", ".."):
            raise CorruptCheckpoint(f"bad storage entry for {fqn!r}", path=meta_path, hint="the metadata is corrupt")


def _first_reads(root: Path, sdm: dict, where: dict) -> tuple[list, list]:
    """The byte ranges opening reads of the items, as (needed, optional): each value item whole (up to the size
    `_value` reads) and each tiny tensor's item (`_shows_values`: its record and bytes). A tiny tensor stored whole
    whose dtype `.metadata` gives (one Adam `step` per parameter) is optional: a remote open reads those within a
    fixed budget (`remote.plan`) and shows the rest without a value. Other tensor chunks are read only when their
    bytes are asked for (their record's head then, `LazyTensorRef`)."""
    out, optional = [], []
    for (key, offsets), (rel, off, length) in where.items():
        if offsets is None:
            if length <= _MAX_VALUE_BYTES:
                out.append((root / rel, off, length))
        elif _shows_values(meta := sdm.get(key)):
            want = (root / rel, off, min(length, _SMALL_ITEM_BYTES))
            (optional if _whole_known(meta, offsets, length) else out).append(want)
    return out, optional


def _whole_known(meta, offsets: tuple[int, ...], length: int) -> bool:
    """A tensor of one chunk that is all of it, of a dtype `.metadata` gives, in an item that can hold it and is
    small (`_tensor` reads such an item's value when opening, and leaves it unread when a remote open did not
    fetch it)."""
    st = meta.state if isinstance(meta.state, dict) else {}
    chunks = st.get("chunks") or []
    esize = DTYPE_SIZE.get(_props_dtype(st.get("properties")))
    if esize is None or len(chunks) != 1 or any(offsets) or length > _SMALL_ITEM_BYTES:
        return False
    if not is_opaque(chunks[0], "ChunkStorageMetadata") or not isinstance(chunks[0].state, dict):
        return False  # `_tensor` says why
    try:
        shape = tuple(map(int, st.get("size") or ()))
        sizes = _offsets(chunks[0].state.get("sizes"))
    except (TypeError, ValueError):
        return False
    return sizes == shape and len(offsets) == len(shape) and math.prod(shape) * esize <= length


def _shows_values(meta) -> bool:
    """A tensor whose values the tree shows (`tree.SMALL_TENSOR_NUMEL` elements or fewer): its chunks are read
    when opening. So is a tensor whose `.metadata` gives no dtype (or one without a known size): its chunks'
    records say it."""
    if not is_opaque(meta, "TensorStorageMetadata"):
        return False
    try:
        numel = math.prod(int(s) for s in meta.field("size") or ())
    except (TypeError, ValueError):
        return True
    return numel <= SMALL_TENSOR_NUMEL or DTYPE_SIZE.get(_dtype(meta)) is None


def _dtype(meta) -> str | None:
    return _props_dtype(meta.field("properties"))


def _props_dtype(props) -> str | None:
    """The dtype a `TensorProperties` record gives (its state: (dtype, layout, requires_grad, ...)), or None."""
    state = props.state if is_opaque(props) else None
    return state[0].name if isinstance(state, tuple) and state and isinstance(state[0], DType) else None


def _chunk_at(ch, key: str, root: Path) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(offsets, sizes) of a `ChunkStorageMetadata` record."""
    if type(ch) is not _ChunkType[0]:
        if not is_opaque(ch, "ChunkStorageMetadata"):
            raise CorruptCheckpoint(
                f"{key}: bad chunk entry {ch!r}", path=root / ".metadata", hint="the metadata is corrupt"
            )
        _ChunkType[0] = type(ch)
    cst = ch.state if isinstance(ch.state, dict) else {}
    return _offsets(cst.get("offsets")), _offsets(cst.get("sizes"))


#: the record class of the last ChunkStorageMetadata seen (`is_opaque` says the same of every one)
_ChunkType: list[type | None] = [None]


@dataclass(frozen=True)
class _File:
    """A `.distcp` file named by `.metadata`: its path, the rank its name gives, its size in bytes, the Source
    (one mmap) every item in it reads through."""

    path: Path
    rank: Mapping[str, int]
    size: int
    outer: Any


def _item(
    root: Path, key: str, where: dict, offsets: tuple[int, ...] | None, files: dict[str, _File]
) -> tuple[str, int, int]:
    """(relative_path, offset, length) of one item: a tensor chunk at `offsets`, or a value (None); inside its
    file (checked from the file's size: nothing of the item is read here)."""
    loc = where.get((key, offsets))
    if loc is None:
        raise CorruptCheckpoint(
            f"{key}: no storage entry for the chunk at {offsets}",
            path=root / ".metadata",
            hint="the metadata is corrupt or from another save",
        )
    rel, off, length = loc
    size = files[rel].size
    if off < 0 or length <= 0 or off + length > size:
        raise CorruptCheckpoint(
            f"item at bytes {off}..{off + length} lies outside the file ({size} bytes)",
            path=root / rel,
            hint="the file is truncated; re-copy it",
        )
    return loc


#: the most distinct small items (their bytes, up to `_SMALL_ITEM_BYTES` each) one open remembers the node of
_SEEN_ITEMS_KEPT = 256


def _tensor(
    cache: C.LoadCache,
    root: Path,
    key: str,
    meta,
    where: dict,
    files: dict[str, _File],
    seen: dict[bytes, tuple] | None = None,
) -> TensorNode:
    """The node of one tensor of `.metadata`. `seen` (one per open) maps the bytes of small items whose values
    show to the node parsed from them: an item equal byte for byte to one parsed before (every Adam `step` of a
    run is the same 1.5 KB) parses alike, so it gets that node's shape, dtype and value without a parse, and a
    `LazyTensorRef` to its own bytes (read, and checked, when they are)."""
    st = meta.state if isinstance(meta.state, dict) else {}  # what Opaque.field reads
    size = st.get("size")
    metas = st.get("chunks") or []
    whole = None
    if len(metas) == 1 and type(metas[0]) is _ChunkType[0] and type(metas[0].state) is dict:
        cst = metas[0].state
        if cst.get("sizes") == size:  # sizes equal to the tensor's (before `int`): its shape
            try:
                whole = _offsets(cst.get("offsets"))
            except (TypeError, ValueError):  # raised by the loop, where `_chunk_at` reads them
                whole = None
    dtype = _props_dtype(st.get("properties"))
    return _tensor_of(cache, root, key, size, dtype, metas, whole, _chunk_at, where, files, seen)


def _native_tensor(
    cache: C.LoadCache,
    root: Path,
    key: str,
    meta: tuple,
    where: dict,
    files: dict[str, _File],
    seen: dict[bytes, tuple] | None = None,
) -> TensorNode:
    """`_tensor` for an entry of `native_dcp`'s `.metadata` (dtype, size, [(offsets, sizes), ...]): the same node."""
    dtype, size, chunks = meta
    whole = chunks[0][0] if len(chunks) == 1 and chunks[0][1] == size else None
    return _tensor_of(cache, root, key, size, dtype, chunks, whole, _chunk_pair, where, files, seen, size)


def _chunk_pair(ch: tuple, key: str, root: Path) -> tuple:
    return ch


def _tensor_of(
    cache: C.LoadCache,
    root: Path,
    key: str,
    size: Any,
    dtype: str | None,
    metas: list,
    whole: tuple[int, ...] | None,
    chunk_at: Any,
    where: dict,
    files: dict[str, _File],
    seen: dict[bytes, tuple] | None,
    shape: tuple[int, ...] | None = None,
) -> TensorNode:
    """`_tensor` past its record: `size` as `.metadata` gives it, `metas` the chunk entries (`chunk_at` gives an
    entry's (offsets, sizes)), `whole` the offsets of a single chunk whose sizes equal `size` (else None), `shape`
    the ints of `size` when the caller has them."""
    if shape is None:
        shape = tuple(map(int, size or ()))
    esize = DTYPE_SIZE.get(dtype)
    numel = math.prod(shape)
    shows = esize is None or numel <= SMALL_TENSOR_NUMEL  # `_shows_values`
    if whole is not None and not shows:
        # one chunk (most items): when it is the whole tensor, its node is the one the loop below makes, without the
        # checks that hold by construction (its record is checked against .metadata when read); anything else
        # takes the loop
        offsets = whole
        if len(offsets) == len(shape):
            loc = where.get((key, offsets))
            if loc is not None and not any(offsets):
                rel, off, length = loc
                f = files[rel]
                if off >= 0 and length > 0 and off + length <= f.size and numel * esize <= length:
                    ref = LazyTensorRef(dtype, shape, f.outer, off, length, key, numel)
                    return leaf_node(shape, dtype, rel, ref, numel, f.rank)
    chunks = []
    for ch in metas:
        offsets, sizes = chunk_at(ch, key, root)
        rel, off, length = _item(root, key, where, offsets, files)
        f = files[rel]
        numel = math.prod(sizes) if sizes is not None else 0
        if shows or sizes is None or numel * esize > length:
            # its values show; or its item is too short for the chunk .metadata declares: its record says why
            blob = None
            whole = len(metas) == 1 and sizes == shape and offsets is not None and len(offsets) == len(shape)
            if whole and shows and seen is not None and length <= _SMALL_ITEM_BYTES and not any(offsets):
                if remote._MOUNTS:
                    if esize is not None and numel * esize <= length and not remote.held(f.path, off, length):
                        # left unread by the open's plan (`_first_reads`): no value; its record is read, and
                        # checked, when its bytes are
                        ref = LazyTensorRef(dtype, shape, f.outer, off, length, key, numel)
                        return leaf_node(shape, dtype, rel, ref, numel, f.rank)
                    remote.ensure(f.path, off, length)
                blob = f.outer._map()[off : off + length]
                hit = seen.get(blob)
                if hit is not None and hit[0] == dtype and hit[1] == shape:
                    return _seen_node(
                        hit[2], LazyTensorRef(hit[2].dtype, hit[2].shape, f.outer, off, length, key), rel, f
                    )
            loaded = cache.load_embedded_head(f.path, off, length)
            ref = loaded.obj
            if not isinstance(ref, TensorRef):
                raise CorruptCheckpoint(
                    f"{key}: the item at {rel}[{off}:{off + length}] is not a tensor",
                    path=f.path,
                    hint="the .distcp file does not match .metadata",
                )
            if blob is not None and type(ref) is TensorRef and ref.shape == shape and not loaded.unknown_globals:
                d = ref.dtype if dtype is None else dtype  # as below
                node = chunked_tensor(key, shape, d or "?", [Chunk(offsets, sizes, ref, rel, f.rank)], root)
                if len(seen) < _SEEN_ITEMS_KEPT:
                    seen[blob] = (dtype, shape, node)
                return node
        else:  # dtype and shape from .metadata; the record is read (and checked) when its bytes are
            ref = LazyTensorRef(dtype, sizes, f.outer, off, length, key, numel)
        chunks.append(Chunk(offsets, sizes, ref, rel, f.rank))
    if dtype is None and chunks:
        dtype = chunks[0].ref.dtype
    return chunked_tensor(key, shape, dtype or "?", chunks, root)


def _seen_node(node: TensorNode, ref: LazyTensorRef, rel: str, f: _File) -> TensorNode:
    """The node `_tensor` made of an item (`seen`), for another item of the same bytes: `ref`, in `rel`."""
    value = list(node.value) if isinstance(node.value, list) else node.value
    return leaf_node(node.shape, node.dtype, rel, ref, node.pieces[0].numel, dict(f.rank), value)


def _value(cache: C.LoadCache, root: Path, key: str, where: dict, files: dict[str, _File]) -> tuple[Node, Any]:
    """(the node of a non-tensor item, the object read: None when too large to read)."""
    rel, off, length = _item(root, key, where, None, files)
    if length > _MAX_VALUE_BYTES:
        return ValueNode(f"<{length} bytes in {rel}, not read>"), None
    f = files[rel]
    obj = cache.load_embedded_head(f.path, off, length, length).obj
    return to_node(obj, rel, f.rank), obj


def training_state(ck: Checkpoint):
    """A DCP folder is one state dict over its items: optimizer, scheduler and counters are found by shape at
    any nesting (torchtitan's top-level `optimizer`/`lr_scheduler`/`train_state`, the recipe's `app.*`)."""
    root = Path(ck.path)
    return StateMap(root, (StateSource(root, ".metadata", kind="dcp"),))


# --- the stored items of a DCP folder, read inert (the writers and the Megatron reader build on them) ---

METADATA = ".metadata"


@dataclass
class Item:
    """One stored item: its flat key, chunk offsets (None for a bytes item), where it lives, and the
    inert `_StorageInfo` record that `.metadata` holds for it (edited when the item moves)."""

    key: str
    offsets: tuple[int, ...] | None
    rel: str
    offset: int
    length: int
    info: Any
    is_tensor: bool


class DcpItems:
    """A DCP folder's stored items, read inert from its `.metadata`: where each lives, bytes items' values,
    0-d tensors, and the nested state under chosen top-level keys (`write.dcp_write.DcpFolder` adds rewriting)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        meta_path = self.root / METADATA
        self.meta = pickle_reader.load(meta_path).obj
        md = self.meta
        sdm = md.field("state_dict_metadata") if is_opaque(md, "Metadata") else None
        storage = md.field("storage_data") if is_opaque(md, "Metadata") else None
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise CorruptCheckpoint(".metadata does not hold a torch.distributed.checkpoint Metadata", path=meta_path)
        planner = md.field("planner_data")
        self.planner = planner if isinstance(planner, dict) else {}
        self.sdm = sdm
        self.items: dict[tuple[str, tuple[int, ...] | None], Item] = {}
        for idx, info in storage.items():
            if not (is_opaque(idx, "MetadataIndex") and is_opaque(info) and isinstance(info.state, dict)):
                raise UnsupportedCheckpoint(f"storage_data entry {idx!r} is not a plain _StorageInfo", path=meta_path)
            rel, off, n = info.field("relative_path"), info.field("offset"), info.field("length")
            if not isinstance(rel, str) or Path(rel).name != rel or not isinstance(off, int) or not isinstance(n, int):
                raise CorruptCheckpoint(f"bad storage entry for {idx.field('fqn')!r}", path=meta_path)
            if info.field("transform_descriptors"):
                raise UnsupportedCheckpoint(
                    f"{idx.field('fqn')} is stored with transforms; cannot rewrite it",
                    path=meta_path,
                    hint="re-save without storage transforms",
                )
            key = idx.field("fqn")
            offsets = _offsets(idx.field("offset"))
            self.items[(key, offsets)] = Item(
                key, offsets, rel, off, n, info, is_opaque(sdm.get(key), "TensorStorageMetadata")
            )
        self._sources: dict[str, pickle_reader.Source] = {}

    # --- reading ----------------------------------------------------------------------------------------

    def _load(self, it: Item) -> Any:
        src = self._sources.get(it.rel)
        if src is None:
            src = self._sources[it.rel] = pickle_reader.Source(self.root / it.rel)
        return pickle_reader.load_embedded(src, it.offset, it.length).obj

    def value(self, key: str) -> Any:
        """The inert value of a bytes item."""
        return self._load(self.items[(key, None)])

    def tensor(self, key: str) -> TensorRef | None:
        """A tensor item stored whole as one 0-d chunk (an Adam `step`), else None."""
        meta = self.sdm.get(key)
        chunks = meta.field("chunks") if is_opaque(meta, "TensorStorageMetadata") else None
        if not isinstance(chunks, list) or len(chunks) != 1 or tuple(meta.field("size") or ()) != ():
            return None
        it = self.items.get((key, ()))
        ref = self._load(it) if it else None
        return ref if isinstance(ref, TensorRef) and ref.shape == () else None

    def item(self, key: str) -> Item:
        it = self.items.get((key, None)) or self.items.get((key, ()))
        if it is None:
            raise CorruptCheckpoint(f"{key}: no storage entry", path=self.root / METADATA)
        return it

    def state_tree(self, tops: tuple[str, ...] | None = None) -> tuple[dict, dict[tuple, str]]:
        """The nested state dict under the top-level keys `tops` (all when None; values read, 0-d tensors as TensorRefs,
        bigger tensors left out), with dicts keyed 0..n-1 turned into lists (param_groups), and the map from
        each leaf's key path to its flat DCP key."""
        tree: dict = {}
        index: dict[tuple, str] = {}
        for key, meta in self.sdm.items():
            path = logical_path(key, self.planner)
            if not path or (tops is not None and path[0] not in tops):
                continue
            if is_opaque(meta, "BytesStorageMetadata"):
                leaf = self.value(key)
            elif is_opaque(meta, "TensorStorageMetadata"):
                leaf = self.tensor(key)
                if leaf is None:
                    continue
            else:
                continue
            slot = tree
            for k in path[:-1]:
                slot = slot.setdefault(k, {})
                if not isinstance(slot, dict):
                    raise CorruptCheckpoint(
                        f"{key}: planner_data path {path} runs through a value", path=self.root / METADATA
                    )
            slot[path[-1]] = leaf
            index[path] = key
        return _listify(tree), index


def _listify(obj: Any) -> Any:
    if isinstance(obj, dict):
        obj = {k: _listify(v) for k, v in obj.items()}
        if obj and all(isinstance(k, int) for k in obj) and sorted(obj) == list(range(len(obj))):
            return [obj[i] for i in range(len(obj))]
    return obj
