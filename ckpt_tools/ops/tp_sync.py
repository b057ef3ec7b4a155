"""`check-tp-sync` / `sync-tp`: find and repair tensor-parallel replicas that drifted apart.

Layer norms, the biases added after a row-parallel all-reduce and learned position embeddings are one
tensor stored once per TP rank. Nothing in training compares the copies, so a rank-local bug (BLOOM-176B:
gradient clipping skipped on TP ranks > 0) lets them drift apart silently, and merging TP ranks later
has no correct answer. A replica lives in four places per TP rank, and all four can drift on their own:

    bf16 / fp16 module weights   `layer_LL-model_TT-model_states.pt` (what inference and merging read)
    fp32 master weights          the flat ZeRO partition of every DP rank (what the next step updates)
    exp_avg, exp_avg_sq          the Adam moments, flat the same way

The bf16 weights are a rounding of the fp32 master, so a small master drift can leave them identical;
that is why the master and the moments are compared too (they are what keeps the drift going).

`check_tp_sync` reads only those tensors' bytes (mmap'd zip members, the pieces of the flat partitions
that `param_slice_mappings` point at) and compares every TP rank with TP rank 0. `plan_sync_tp` makes an
`io.WritePlan` that overwrites exactly those byte ranges in place (`zip_patch.plan_in_place`: the pickles are
not touched, each member's CRC-32 is updated from the changed bytes alone; io.execute journals the original
bytes first, and copies the file whole where in place is refused), so
that every representation on every TP rank and DP shard holds the average (BLOOM's remedy) or one
rank's value, and the module weights hold the cast of the synced fp32 master — the value the optimizer
would have written into them.
"""

from __future__ import annotations

import inspect
import math
import re
import struct
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..errors import UnsupportedCheckpoint
from ..formats import detect
from ..read.pickle_reader import DTYPE_SIZE, ZipSource
from ..read.tp_layout import SOURCE_DATA, Rule, TPLayout, rule_from_data
from ..read.tree import Checkpoint, GroupNode, OpaqueNode, Piece, TensorNode, ValueNode, Warning_
from ..view.accounting import guard
from ..write import io
from ..write.zip_patch import Patch, patch_file, plan_in_place

OPTIMIZER_REPRESENTATIONS = ("fp32", "exp_avg", "exp_avg_sq")
#: merge rules whose shards are copies of one tensor (DeepSpeed averages the second kind when merging)
REPLICA_MERGES = ("replicated", "average")
METHODS = ("average", "rank0")
#: shards of an undecided parameter closer than this (max |diff| / max |value|) are taken for drifted
#: replicas by the data fallback; independently initialised split shards differ by O(1)
DATA_REPLICA_REL = 1e-2
_LAYER_RE = re.compile(r"^(\d+)\.(.+)$")


def module_representation(dtype: str) -> str:
    """The report's name for the module weights: their precision ("bf16", "fp16"; "weights" for fp32
    module weights, which would otherwise read like the fp32 master)."""
    return {"bfloat16": "bf16", "float16": "fp16"}.get(dtype, "weights")


# --- the report ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RepresentationDiff:
    """One representation of one replicated parameter, every TP rank compared with TP rank 0.

    `max_abs_diff` = max |x_t - x_0| and `max_rel_diff` = max |x_t - x_0| / max(|x_t|, |x_0|) (0 where both
    are 0) over elements and TP ranks t, computed in float64 (exact for fp32 and bf16 values).
    `in_tolerance` follows `torch.allclose`: |x_t - x_0| <= atol + rtol * |x_0| everywhere.
    """

    representation: str  # "bf16" / "fp16" / "weights" (module weights), "fp32" (master), "exp_avg", "exp_avg_sq"
    dtype: str
    max_abs_diff: float
    max_rel_diff: float
    bit_exact: bool
    in_tolerance: bool
    ranks_differing: tuple[int, ...] = ()  # TP ranks whose bytes differ from TP rank 0's


@dataclass(frozen=True)
class ParamSync:
    """One TP-replicated parameter across its TP ranks, all representations."""

    name: str  # DeepSpeed's name: "2.post_attention_layernorm.weight"
    family: str  # the name without its layer index: "post_attention_layernorm.weight"
    layer: int | None
    pp_stage: int | None
    shape: tuple[int, ...]
    merge: str
    rule: str  # why it counts as replicated: "replicated (universal_checkpoint_info /\d+.input_layernorm.weight/)"
    rule_source: str
    diffs: tuple[RepresentationDiff, ...]

    @property
    def in_sync(self) -> bool:
        return all(d.in_tolerance for d in self.diffs)

    @property
    def bit_exact(self) -> bool:
        return all(d.bit_exact for d in self.diffs)

    def diff(self, representation: str) -> RepresentationDiff | None:
        return next((d for d in self.diffs if d.representation == representation), None)


@dataclass(frozen=True)
class FamilySummary:
    family: str
    in_sync: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.in_sync / self.total if self.total else 100.0

    def line(self) -> str:
        return f"{self.family}: {self.in_sync}/{self.total} layers in sync ({self.percent:.0f}%)"


@dataclass(frozen=True)
class TPSyncReport:
    """What `check_tp_sync` found. `ok` is False when any replica is out of tolerance."""

    path: str
    format: str
    tp: int
    pp: int | None
    dp: int | None
    layout_source: str  # the sources asked, first first ("user pattern > universal_checkpoint_info"), + data
    atol: float
    rtol: float
    representations: tuple[str, ...]
    params: tuple[ParamSync, ...]
    families: tuple[FamilySummary, ...]
    undecided: tuple[str, ...] = ()  # no rule and the data could not tell: not compared
    warnings: tuple[Warning_, ...] = ()

    @property
    def out_of_sync(self) -> list[ParamSync]:
        return [p for p in self.params if not p.in_sync]

    @property
    def ok(self) -> bool:
        return not self.out_of_sync

    @property
    def percent_in_sync(self) -> float:
        return 100.0 * (len(self.params) - len(self.out_of_sync)) / len(self.params) if self.params else 100.0

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok
        doc["percent_in_sync"] = self.percent_in_sync
        doc["families"] = [{**asdict(f), "percent": f.percent, "line": f.line()} for f in self.families]
        for p, d in zip(self.params, doc["params"]):
            d["in_sync"], d["bit_exact"] = p.in_sync, p.bit_exact
        return doc


# --- opening and deciding which tensors are replicas ------------------------------------------------------


def open_for_tp_sync(path: str | Path, patterns: Sequence[str] = ()) -> Checkpoint:
    """Open a checkpoint with user `REGEX[=MERGE]` patterns passed to a reader that takes them (the
    pipeline reader), so that its merge rules and this module's agree."""
    p = Path(path)
    mod = detect(p)
    if patterns and "tp_patterns" in inspect.signature(mod.open).parameters:
        return mod.open(p, tp_patterns=tuple(patterns))
    return mod.open(p)


def _plain_without_tensors(node: Any) -> Any:
    """A tree node back to plain Python (for `universal_checkpoint_info`), like `read.tree.node_to_python` except
    that a tensor becomes None, not its inline value: only the plain values DeepSpeed records there are rules."""
    if isinstance(node, GroupNode):
        return {k: _plain_without_tensors(v) for k, v in node.children.items()}
    if isinstance(node, OpaqueNode):
        return {k: _plain_without_tensors(v) for k, v in node.children.items()}
    if isinstance(node, ValueNode):
        return node.value
    return None


def _layout(ck: Checkpoint, patterns: Sequence[str]) -> TPLayout:
    info = _plain_without_tensors(ck.tree.children.get("universal_checkpoint_info"))
    swiglu = False
    client = ck.tree.children.get("client_state")
    args = client.children.get("args") if isinstance(client, GroupNode) else None
    if isinstance(args, OpaqueNode) and isinstance(args.children.get("swiglu"), ValueNode):
        swiglu = bool(args.children["swiglu"].value)
    return TPLayout.for_checkpoint(
        info if isinstance(info, dict) and info else None, user_patterns=patterns, swiglu=swiglu
    )


def _rule_from_close_data(shards: Sequence[TensorNode]) -> Rule:
    """The data fallback: bit-identical shards are replicas (tp_layout's rule); equal-shaped shards that
    are close are taken for drifted replicas. Split shards of one parameter are initialised independently
    and differ by as much as the values themselves."""
    exact = rule_from_data(shards)
    if exact.merge is not None or len({s.shape for s in shards}) > 1 or len({s.dtype for s in shards}) > 1:
        return exact
    ts = [shard_values(s)[0] for s in shards]
    scale = max(float(abs(t).max()) for t in ts) if ts[0].size else 0.0
    worst = max(float(abs(t - ts[0]).max()) for t in ts[1:]) if ts[0].size else 0.0
    if scale and worst <= DATA_REPLICA_REL * scale:
        return Rule(
            "replicated",
            SOURCE_DATA,
            note=f"TP shards equal in shape and within {DATA_REPLICA_REL:g} of each other: drifted replicas",
        )
    return exact


def _family(name: str) -> tuple[str, int | None]:
    m = _LAYER_RE.match(name)
    if not m:
        return name, None
    # a bare LayerNorm layer ("6.weight") keeps its index: "weight" alone names nothing
    return (m[2] if "." in m[2] else name), int(m[1])


def _optimizer_shards(ck: Checkpoint, name: str) -> dict[str, TensorNode]:
    state = ck.optimizer.children.get("state")
    entry = state.children.get(name) if isinstance(state, GroupNode) else None
    if not isinstance(entry, GroupNode):
        return {}
    return {k: v for k in OPTIMIZER_REPRESENTATIONS if isinstance(v := entry.children.get(k), TensorNode) and v.shards}


@dataclass(frozen=True)
class _Replica:
    name: str
    rule: Rule
    merge: str
    nodes: dict[str, TensorNode]  # representation -> TensorNode with one shard per TP rank


def _replicas(ck: Checkpoint, layout: TPLayout) -> tuple[list[_Replica], list[str]]:
    out, undecided = [], []
    for name, node in ck.model.children.items():
        if not isinstance(node, TensorNode) or len(node.shards) < 2:
            continue
        rule = layout.rule(name)
        if rule.merge is None:
            rule = _rule_from_close_data(node.shards)
        if rule.merge is None:
            undecided.append(name)
            continue
        if rule.merge not in REPLICA_MERGES:
            continue
        nodes = {module_representation(node.dtype): node, **_optimizer_shards(ck, name)}
        out.append(_Replica(name, rule, rule.merge, nodes))
    return out, undecided


# --- comparing ----------------------------------------------------------------------------------------------


def shard_values(shard: Any):
    """(float64 values, raw bit patterns, dtype name) of one TP shard, flattened, read with numpy: no torch on
    the check path (bf16, which numpy lacks, is widened from its bit patterns: the top half of a float32).
    `shard` is a TensorNode (its pieces read one by one), anything with `read_numpy()`, or a torch tensor."""
    import numpy as np  # lazy: numpy only when shard values are read; opening and planning stay numpy-free

    dtype = str(getattr(shard, "dtype", "")).replace("torch.", "")
    pieces = getattr(shard, "pieces", None)
    if hasattr(shard, "detach"):  # a torch tensor (to-universal compares tensors it already read)
        t = shard.detach().contiguous().reshape(-1)
        raw = (t.view(__import__("torch").int16) if dtype == "bfloat16" else t).numpy()
    elif pieces:
        first = pieces[0].ref.read_numpy(pieces[0].src_offset, pieces[0].numel)
        raw = np.empty(math.prod(shard.shape), dtype=first.dtype)
        for p in pieces:
            raw[p.dst_offset : p.dst_offset + p.numel] = p.ref.read_numpy(p.src_offset, p.numel)
    else:
        raw = np.asarray(shard.read_numpy()).reshape(-1)
    if dtype == "bfloat16":
        values = (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        values = raw.astype(np.float64)
    bits = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[raw.itemsize])
    return values, bits, dtype


#: a representation whose TP shards differ is compared in pure Python up to this many elements per shard
#: (a few drifted layer norms: importing numpy would cost more than the maths), with numpy above it
PY_COMPARE_MAX = 1 << 16


def shard_bytes(shard: Any) -> bytes | None:
    """The raw bytes of one TP shard (a TensorNode whose pieces are contiguous), in element order; None
    for anything else (a torch tensor, a numpy-backed shard, a non-contiguous view)."""
    pieces = getattr(shard, "pieces", None)
    if not pieces or hasattr(shard, "detach"):
        return None
    out, at = [], 0
    for p in sorted(pieces, key=lambda p: p.dst_offset):
        if p.dst_offset != at or p.ref.storage is None or not p.ref.is_contiguous:
            return None
        out.append(p.ref._raw(p.src_offset, p.numel))
        at += p.numel
    if at != math.prod(shard.shape):
        return None
    return b"".join(out)


def _py_values(raw: bytes, dtype: str):
    """The elements of `raw` as Python floats (exact for bf16/fp16/fp32/fp64), or None for other dtypes."""
    if dtype == "bfloat16":  # bf16 is the top half of a float32
        return array("f", array("I", [h << 16 for h in array("H", raw)]).tobytes())
    if dtype == "float16":
        return struct.unpack(f"<{len(raw) // 2}e", raw)
    if dtype in ("float32", "float64"):
        return array("f" if dtype == "float32" else "d", raw)
    return None


def _same(representation: str, dtype: str) -> RepresentationDiff:
    return RepresentationDiff(representation, dtype, 0.0, 0.0, True, True, ())


def compare_shards(shards: Sequence[Any], representation: str, atol: float, rtol: float) -> RepresentationDiff:
    """Compare TP ranks 1.. with TP rank 0 (the shards of one representation, TP rank order).

    Raw bytes first: bit-identical shards (the usual case) need no arithmetic and no numpy. Shards that
    differ are compared element by element in float64 — in pure Python when small, with numpy above
    `PY_COMPARE_MAX` elements; both give the same numbers."""
    dtype = str(getattr(shards[0], "dtype", "")).replace("torch.", "")
    if any(tuple(s.shape) != tuple(shards[0].shape) for s in shards[1:]):
        return RepresentationDiff(representation, dtype, math.inf, math.inf, False, False, tuple(range(1, len(shards))))
    raws = [shard_bytes(s) for s in shards]
    if all(r is not None for r in raws):
        if all(r == raws[0] for r in raws[1:]):
            return _same(representation, dtype)
        if math.prod(shards[0].shape) <= PY_COMPARE_MAX:
            values = [_py_values(r, dtype) for r in raws]
            if values[0] is not None:
                return _compare_py(raws, values, representation, dtype, atol, rtol)
    return _compare_numpy(shards, representation, atol, rtol)


def _compare_py(raws, values, representation: str, dtype: str, atol: float, rtol: float) -> RepresentationDiff:
    ref = values[0]
    max_abs = max_rel = 0.0
    in_tol, differing = True, []
    for t in range(1, len(values)):
        if raws[t] == raws[0]:
            continue
        differing.append(t)
        for a, b in zip(ref, values[t]):
            d = abs(b - a)
            if d > max_abs:
                max_abs = d
            m = max(abs(a), abs(b))
            if m > 0 and d / m > max_rel:
                max_rel = d / m
            if not d <= atol + rtol * abs(a):
                in_tol = False
    return RepresentationDiff(representation, dtype, max_abs, max_rel, not differing, in_tol, tuple(differing))


def _compare_numpy(shards: Sequence[Any], representation: str, atol: float, rtol: float) -> RepresentationDiff:
    import numpy as np  # lazy: numpy only for large shards (small ones are compared in pure Python)

    ref, ref_bits, dtype = shard_values(shards[0])
    max_abs = max_rel = 0.0
    in_tol, differing = True, []
    for t, shard in enumerate(shards[1:], start=1):
        other, bits, _ = shard_values(shard)
        if not np.array_equal(bits, ref_bits):
            differing.append(t)
        d = np.abs(other - ref)
        if d.size:
            max_abs = max(max_abs, float(d.max()))
            denom = np.maximum(np.abs(other), np.abs(ref))
            rel = np.divide(d, denom, out=np.zeros_like(d), where=denom > 0)
            max_rel = max(max_rel, float(rel.max()))
            if not bool((d <= atol + rtol * np.abs(ref)).all()):
                in_tol = False
    return RepresentationDiff(representation, dtype, max_abs, max_rel, not differing, in_tol, tuple(differing))


def check_tp_sync(ck: Checkpoint, atol: float = 0.0, rtol: float = 0.0, patterns: Sequence[str] = ()) -> TPSyncReport:
    """Compare every TP-replicated parameter across TP ranks (and pipeline stages) in every representation.

    Which parameters are replicas comes from the checkpoint's `universal_checkpoint_info`, else the
    Megatron naming preset, with user `patterns` (`REGEX` = replicated, or `REGEX=MERGE`) asked first and
    the data deciding names nothing else does. With the default atol = rtol = 0 "in sync" means
    bit-identical. Reads only the replicas' bytes.
    """
    if atol < 0 or rtol < 0:
        raise ValueError("atol and rtol must be >= 0")
    tp = ck.topology.tp or 1
    if not any(isinstance(n, TensorNode) and n.shards for n in ck.model.children.values()):
        why = ck.details.get("tp_replicas")  # a format that saves replicas once says so
        raise UnsupportedCheckpoint(
            f"no tensor-parallel shards in this {ck.format} checkpoint (tp={ck.topology.tp})"
            + (f": {why}" if why else ""),
            path=ck.path,
            hint="check-tp-sync reads checkpoints that keep one file per TP rank with TP > 1 "
            "(Megatron-DeepSpeed pipeline layer_*-model_* files, Megatron-LM legacy mp_rank_* "
            "folders)",
        )
    layout = _layout(ck, patterns)
    replicas, undecided = _replicas(ck, layout)
    for r in replicas:  # every byte range this check reads, requested at once: on a cold cache the disk
        for node in r.nodes.values():  # serves them in parallel instead of one page fault after another
            for shard in node.shards:
                for p in shard.pieces:
                    p.ref.prefetch(p.src_offset, p.numel)
    params = []
    reps_seen: list[str] = []
    for r in replicas:
        diffs = []
        for rep, node in r.nodes.items():
            if rep not in reps_seen:
                reps_seen.append(rep)
            diffs.append(compare_shards(node.shards, rep, atol, rtol))
        family, layer = _family(r.name)
        first = r.nodes[next(iter(r.nodes))].shards[0].pieces[0]
        params.append(
            ParamSync(
                r.name,
                family,
                layer,
                first.rank.get("pp"),
                r.nodes[next(iter(r.nodes))].shape,
                r.merge,
                r.rule.describe(),
                r.rule.source,
                tuple(diffs),
            )
        )
    fams: dict[str, list[ParamSync]] = {}
    for p in params:
        fams.setdefault(p.family, []).append(p)
    families = tuple(FamilySummary(f, sum(p.in_sync for p in ps), len(ps)) for f, ps in fams.items())
    sources = list(layout.sources)
    if any(p.rule_source == SOURCE_DATA for p in params):
        sources.append(SOURCE_DATA)
    # unknown pickle globals too: a hostile file must be named whichever command opens it
    warnings = tuple(w for w in ck.warnings if w.code.startswith("tp-") or w.code == "unknown-global")
    return TPSyncReport(
        ck.path,
        ck.format,
        tp,
        ck.topology.pp,
        ck.topology.dp,
        " > ".join(sources),
        atol,
        rtol,
        tuple(reps_seen),
        tuple(params),
        families,
        tuple(undecided),
        warnings,
    )


# --- repairing -------------------------------------------------------------------------------------------------


def _synced_values(nodes: dict[str, TensorNode], method: str, from_rank: int) -> dict[str, Any]:
    """representation -> the one tensor every TP rank will hold."""
    import torch  # lazy: torch only when a replica is synced; the check reads with numpy

    def pick(node: TensorNode):
        ts = [s.read_torch() for s in node.shards]
        if method == "rank0":
            return ts[from_rank]
        # the mean in float64, rounded once to the stored dtype: the correctly rounded average
        return (torch.stack([t.double() for t in ts]).mean(0)).to(ts[0].dtype)

    out = {rep: pick(node) for rep, node in nodes.items() if rep in OPTIMIZER_REPRESENTATIONS}
    for rep, node in nodes.items():
        if rep in OPTIMIZER_REPRESENTATIONS:
            continue
        if "fp32" in out:
            # what the optimizer writes into the module weights after a step: the cast of the master
            out[rep] = out["fp32"].reshape(node.shape).to(getattr(torch, node.dtype))
        else:
            out[rep] = pick(node)
    return out


def _location(piece: Piece) -> tuple[str, int]:
    """(zip member, byte offset of the piece's first element in it)."""
    ref = piece.ref
    src = ref.storage.source if ref.storage is not None else None
    if not isinstance(src, ZipSource) or getattr(src, "base", 0):
        raise UnsupportedCheckpoint(
            f"{piece.file} is not a torch zip file; only those can be patched in place",
            path=piece.file,
            hint="re-save it with a torch >= 1.6 torch.save",
        )
    if not ref.is_contiguous:
        raise UnsupportedCheckpoint(
            f"a tensor in {piece.file} is a non-contiguous view; cannot patch it in place", path=piece.file
        )
    esize = DTYPE_SIZE[ref.dtype]
    return f"{src.prefix}data/{ref.storage.key}", (ref.storage_offset + piece.src_offset) * esize


def _to_bytes(t) -> bytes:
    import torch  # lazy: torch only when a replica is synced; the check reads with numpy

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@dataclass
class _FilePatches:
    patches: list[Patch] = field(default_factory=list)
    changes: list[io.FieldChange] = field(default_factory=list)


def plan_sync_tp(
    ck: Checkpoint,
    method: str = "average",
    *,
    from_rank: int = 0,
    patterns: Sequence[str] = (),
    report: TPSyncReport | None = None,
    allow_unread: bool = False,
    trust_pickles: bool = False,
) -> tuple[io.WritePlan, TPSyncReport]:
    """The write that makes every out-of-sync replica identical on every TP rank, in every representation.

    `method`: "average" (the mean over TP ranks of the fp32 master and of each Adam moment) or "rank0"
    (TP rank `from_rank`'s values). The module weights become the cast of the synced fp32 master (or,
    without optimizer state, the average / the rank's weights). Only bytes that change are written; every
    DP rank's piece of a flat partition is patched. Replicas only the data fallback vouches for are left
    alone (a note says so): pass `--pattern` to include them. Returns the plan and the report it is based on.
    """
    ck = guard(ck, ck.path, "sync-tp", allow_unread=allow_unread, trust_pickles=trust_pickles)
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (use {' or '.join(METHODS)})")
    report = report or check_tp_sync(ck, patterns=patterns)
    if method == "rank0" and not 0 <= from_rank < report.tp:
        raise ValueError(f"--from-rank {from_rank} is not a TP rank (tp={report.tp})")
    layout = _layout(ck, patterns)
    by_name = {r.name: r for r in _replicas(ck, layout)[0]}
    targets = [p for p in report.params if not p.bit_exact and p.rule_source != SOURCE_DATA]
    left = [p.name for p in report.params if not p.bit_exact and p.rule_source == SOURCE_DATA]
    root = Path(ck.path)
    files: dict[str, _FilePatches] = {}
    how = "average of the TP ranks" if method == "average" else f"TP rank {from_rank}'s value"
    for p in targets:
        _patch_param(p, by_name[p.name].nodes, method, from_rank, how, files)
    writes = _patch_writes(root, files)
    notes = [
        *ck.details.get("carried_pickles", ()),
        f"method: {method}" + (f" (TP rank {from_rank})" if method == "rank0" else ""),
        f"{len(targets)} replicated parameters out of sync, {len(writes)} files to patch",
        "old = max |diff| across TP ranks before, new = after",
    ]
    if left:
        notes.append(
            f"not synced, replicas only by the data heuristic: {', '.join(left)} (pass --pattern REGEX to include them)"
        )
    rng = [w for w in report.warnings if w.code == "tp-rng-mismatch"]
    if rng:
        notes.append("torch_rng_state differs across TP ranks: reported, not changed (a likely cause of the drift)")
    plan = io.WritePlan(
        root,
        f"sync-tp --method {method}",
        writes,
        tuple(notes),
        _verify_synced(patterns, {p.name for p in targets}),
        trust_pickles=bool(ck.details.get("carried_pickles")),
    )
    return plan, report


def _patch_param(
    p: ParamSync, nodes: dict, method: str, from_rank: int, how: str, files: dict[str, _FilePatches]
) -> None:
    """The byte patches (per file, into `files`) that give every TP rank's piece of parameter `p`, in each
    representation, its synced value; pieces already holding those bytes are left alone."""
    new = _synced_values(nodes, method, from_rank)
    for rep, node in nodes.items():
        flat_new = new[rep].reshape(-1)
        old = p.diff(rep)
        note = how if rep in OPTIMIZER_REPRESENTATIONS or "fp32" not in new else "cast of the synced fp32 master"
        for shard in node.shards:
            for piece in shard.pieces:
                member, offset = _location(piece)
                data = _to_bytes(flat_new[piece.dst_offset : piece.dst_offset + piece.numel])
                if data == piece.ref.read_numpy(piece.src_offset, piece.numel).tobytes():
                    continue
                fp = files.setdefault(piece.file, _FilePatches())
                fp.patches.append(Patch(member, offset, data))
                where = ", ".join(f"{k}{v}" for k, v in piece.rank.items())
                fp.changes.append(
                    io.FieldChange(
                        piece.file, f"{p.name} {rep} [{where}]", old.max_abs_diff if old else None, 0.0, note
                    )
                )


def _patch_writes(root: Path, files: dict[str, _FilePatches]) -> tuple[io.FileWrite, ...]:
    """One FileWrite per patched file: its byte patches in place, else a whole-file copy with them applied."""

    def producer(rel: str, patches: list[Patch]) -> Callable[[Path], None]:
        return lambda tmp: patch_file(root / rel, tmp, patches)

    def editor(patches: list[Patch]) -> Callable[[Path], io.InPlace]:
        return lambda target: plan_in_place(target, patches)

    return tuple(
        io.FileWrite(
            rel,
            tuple(fp.changes),
            (root / rel).stat().st_size,
            producer(rel, fp.patches),
            edit=editor(fp.patches),
            method="byte patch in place (pickle untouched, CRC-32 updated from the changed "
            "bytes; whole-file copy where in place is refused)",
        )
        for rel, fp in sorted(files.items())
    )


def _verify_synced(patterns: Sequence[str], synced: set[str]) -> Callable[[Path], list[str]]:
    """The plan's verify: the written checkpoint checked again; a synced parameter, or one a rule (not the data
    fallback) calls a replica, that still differs across TP ranks is a problem."""

    def verify(written_root: Path) -> list[str]:
        after = check_tp_sync(open_for_tp_sync(written_root, patterns), patterns=patterns)
        return [
            f"{q.name} still differs across TP ranks after the write"
            for q in after.params
            if not q.bit_exact and (q.name in synced or q.rule_source != SOURCE_DATA)
        ]

    return verify


def sync_tp(
    path: str | Path,
    method: str = "average",
    *,
    from_rank: int = 0,
    patterns: Sequence[str] = (),
    backup_dir: Path | None = None,
    on_stage: Callable[[str, str | None], None] | None = None,
    copy: bool = False,
) -> tuple[io.Transaction | None, TPSyncReport]:
    """Open, plan, execute and verify in one call (the library's `ckpt sync-tp --yes`). Returns the
    transaction (None when everything was already in sync) and the report after the write."""
    ck = open_for_tp_sync(path, patterns)
    plan, _ = plan_sync_tp(ck, method, from_rank=from_rank, patterns=patterns)
    tx = io.execute(plan, backup_dir=backup_dir, on_stage=on_stage, copy=copy) if plan.writes else None
    return tx, check_tp_sync(open_for_tp_sync(path, patterns), patterns=patterns)


def iter_rows(plan: io.WritePlan) -> Iterable[tuple[str, str, str, str, Any, str]]:
    """(file, parameter, representation, rank, old max diff, note) per change, for the dry-run table."""
    for w in plan.writes:
        for c in w.changes:
            name, rep, where = re.fullmatch(r"(\S+) (\S+) \[(.*)\]", c.field).groups()
            yield w.path, name, rep, where, c.old, c.note


__all__ = [
    "RepresentationDiff",
    "ParamSync",
    "FamilySummary",
    "TPSyncReport",
    "check_tp_sync",
    "plan_sync_tp",
    "sync_tp",
    "open_for_tp_sync",
    "compare_shards",
]
