"""The one tree every checkpoint format becomes.

A `Checkpoint` has a header (format, topology, counters, learning rates, parameter count, warnings)
and a `tree` of nodes:

    model.<param>                         TensorNode, full logical shape; per-rank pieces inside
    optimizer.state.<param>.{exp_avg,exp_avg_sq,fp32,step}
    optimizer.param_groups.<i>.<field>    ValueNode
    scheduler.<field>                     ValueNode (base_lrs, _last_lr, last_epoch, ...)
    counters.<name>                       ValueNode
    rng.*, client_state.*, config.*       whatever the format saved

Paths are stable and greppable: `optimizer.state.blocks.0.ln_1.weight.exp_avg`. Tensor bytes are never
read while building the tree, except tiny tensors (<= 16 elements: step counters) whose values show.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from ..errors import CorruptCheckpoint
from .pickle_reader import SMALL_TENSOR_NUMEL, NumpyArray, NumpyDType, Opaque, TensorRef, DType


@dataclass(frozen=True)
class Piece:
    """A run of a logical tensor's elements stored inside some file's tensor.

    Elements [src_offset, src_offset+numel) of `ref` (flattened) are elements
    [dst_offset, dst_offset+numel) of the logical (flattened) tensor. Plain tensors have one piece
    covering everything; ZeRO partitions give one piece per DP rank that holds part of the parameter.
    """

    file: str
    ref: TensorRef = field(repr=False)
    src_offset: int
    numel: int
    dst_offset: int
    rank: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TensorNode:
    """A tensor in the tree: logical shape and dtype; where its bytes are; its value if tiny.

    For tensor-parallel checkpoints `shards` holds one TensorNode per TP rank and `merge` says how
    they form the logical tensor: "replicated", "cat:<dim>", or None when unknown.
    """

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...] = ()
    shards: tuple["TensorNode", ...] = ()
    merge: str | None = None
    value: Any = None  # a number for one-element tensors, a list for other tiny ones, else None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read_torch(self):
        """Materialise the logical tensor (torch, saved dtype). Reads only the bytes of its pieces."""
        import torch  # lazy: torch only when a tensor is read; read/ is the torch-free core

        if self.shards:
            parts = [s.read_torch() for s in self.shards]
            if self.merge == "replicated":
                return parts[0]
            if self.merge and self.merge.startswith("cat:"):
                return torch.cat(parts, dim=int(self.merge[4:]))
            raise ValueError("unknown TP merge rule for this tensor; read its shards")
        if len(self.pieces) == 1 and self.pieces[0].numel == self.numel and self.pieces[0].ref.numel == self.numel:
            t = self.pieces[0].ref.read_torch()
            return t if tuple(t.shape) == tuple(self.shape) else t.reshape(self.shape)
        out = None
        for p in self.pieces:
            chunk = p.ref.read_torch(p.src_offset, p.numel)
            if out is None:
                out = torch.empty(self.numel, dtype=chunk.dtype)
            out[p.dst_offset : p.dst_offset + p.numel] = chunk
        if out is None:
            return torch.empty(self.shape)
        return out.reshape(self.shape)


@dataclass(frozen=True)
class ValueNode:
    """A plain value: number, string, bool, None, or a list of them (of any length)."""

    value: Any


@dataclass(frozen=True)
class OpaqueNode:
    """An object of a class the reader does not execute; `children` holds what its pickle recorded."""

    cls: str
    children: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GroupNode:
    """A mapping of names to nodes (dicts, lists, namespaces, sections)."""

    children: Mapping[str, Any] = field(default_factory=dict)


Node = TensorNode | ValueNode | OpaqueNode | GroupNode


@dataclass(frozen=True)
class Topology:
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    zero_stage: int | None = None
    ep: int | None = None  # expert-parallel size, where the checkpoint declares experts
    vpp: int | None = None  # virtual pipeline chunks per stage (Megatron's interleaved schedule)


@dataclass(frozen=True)
class Counters:
    """Step counters as saved. None means the checkpoint does not record it (never guessed)."""

    global_step: int | None = None
    optimizer_step: int | None = None
    scheduler_last_epoch: int | None = None
    scheduler_step_count: int | None = None
    skipped_steps: int | None = None


@dataclass(frozen=True)
class LearningRates:
    param_groups: tuple[float, ...] = ()
    base_lrs: tuple[float, ...] | None = None
    last_lr: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Warning_:
    """A problem found while reading. `code` is stable for scripts (e.g. "stray-file")."""

    code: str
    message: str
    path: str | None = None


@dataclass(frozen=True)
class FileInfo:
    path: str  # relative to the checkpoint root
    bytes: int
    role: str  # "model", "optimizer", "scheduler", "rng", "metadata", "other"
    rank: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint of any format as one lazily-read tree. Made by `ckpt_tools.open_checkpoint`."""

    format: str
    path: str
    topology: Topology
    tree: GroupNode
    counters: Counters
    lr: LearningRates
    parameter_count: int
    parameter_tensors: int
    files: tuple[FileInfo, ...] = ()
    warnings: tuple[Warning_, ...] = ()
    dtypes: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)  # format-specific facts (tag, versions)
    #: {fused optimizer FQN: {split model key: the fused rows it owns}} once the reader's user gave what the split
    #: needs (`logical.with_kv_heads`); the logical view then keys that optimizer state by the split names
    state_split: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict, repr=False)

    def get(self, dotted: str) -> Node:
        """The node at a dotted path. Names may contain dots (`blocks.0.ln_1.weight`), so the longest
        matching child name wins at each level."""
        node: Any = self.tree
        rest = dotted
        while rest:
            if not isinstance(node, (GroupNode, OpaqueNode)):
                raise KeyError(dotted)
            kids = node.children
            hit = None
            for name in sorted(kids, key=len, reverse=True):
                if rest == name or rest.startswith(name + "."):
                    hit = name
                    break
            if hit is None:
                raise KeyError(dotted)
            node = kids[hit]
            rest = rest[len(hit) + 1 :]
        return node

    @property
    def model(self) -> GroupNode:
        return self.tree.children.get("model", GroupNode())

    @property
    def optimizer(self) -> GroupNode:
        return self.tree.children.get("optimizer", GroupNode())


def walk(node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
    """Depth-first (path, node) pairs, leaves and groups alike, paths dotted from the root."""
    yield prefix, node
    if isinstance(node, (GroupNode, OpaqueNode)):
        for name, child in node.children.items():
            yield from walk(child, f"{prefix}.{name}" if prefix else str(name))


def iter_tensors(node: Node, prefix: str = "") -> Iterator[tuple[str, TensorNode]]:
    for path, n in walk(node, prefix):
        if isinstance(n, TensorNode):
            yield path, n


# --- turning unpickled objects into nodes -----------------------------------------------------------


def tensor_node(ref: TensorRef, file: str, rank: Mapping[str, int] | None = None) -> TensorNode:
    """A TensorNode for a tensor stored whole in one file; tiny tensors get their values read."""
    value = None
    # numel first: a lazily read record (a DCP chunk's `LazyTensorRef`) is read only for a tensor whose values show
    if 0 < ref.numel <= SMALL_TENSOR_NUMEL and ref.storage is not None:
        try:
            vals = ref.read_values()
            value = vals[0] if ref.shape == () else vals
        except Exception:  # unreadable bytes show up as a missing value, the reader reports corruption elsewhere
            value = None
    return leaf_node(ref.shape, ref.dtype, file, ref, ref.numel, dict(rank or {}), value)


_new = object.__new__
_set = object.__setattr__


def leaf_node(
    shape: tuple[int, ...],
    dtype: str,
    file: str,
    ref: TensorRef,
    numel: int,
    rank: Mapping[str, int],
    value: Any = None,
) -> TensorNode:
    """`TensorNode(shape, dtype, (Piece(file, ref, 0, numel, 0, rank),), value=value)`: a tensor stored whole as one
    piece, built without the frozen dataclasses' `__init__` calls: a DCP open makes one per item, 10^5-10^6 of
    them. The same objects, equal and hashed alike (fields set one by one as `__init__` sets them: reaching for
    `__dict__` would give each a dict object of its own, ~45 bytes more)."""
    piece = _new(Piece)
    _set(piece, "file", file)
    _set(piece, "ref", ref)
    _set(piece, "src_offset", 0)
    _set(piece, "numel", numel)
    _set(piece, "dst_offset", 0)
    _set(piece, "rank", rank)
    node = _new(TensorNode)
    _set(node, "shape", shape)
    _set(node, "dtype", dtype)
    _set(node, "pieces", (piece,))
    _set(node, "shards", ())
    _set(node, "merge", None)
    _set(node, "value", value)
    return node


def piece(file: str, ref: TensorRef, src_offset: int, numel: int, dst_offset: int, rank: Mapping[str, int]) -> Piece:
    """`Piece(file, ref, src_offset, numel, dst_offset, rank)` without the frozen dataclass's `__init__` (as
    `leaf_node`): un-flattening a ZeRO optimizer makes one per parameter, state and DP rank holding a part of it."""
    p = _new(Piece)
    _set(p, "file", file)
    _set(p, "ref", ref)
    _set(p, "src_offset", src_offset)
    _set(p, "numel", numel)
    _set(p, "dst_offset", dst_offset)
    _set(p, "rank", rank)
    return p


def group_node(children: Mapping[str, Any]) -> GroupNode:
    """`GroupNode(children)` without the frozen dataclass's `__init__` (as `leaf_node`): one per parameter under
    `optimizer.state` of a ZeRO checkpoint."""
    node = _new(GroupNode)
    _set(node, "children", children)
    return node


def pieces_node(shape: tuple[int, ...], dtype: str, pieces: tuple[Piece, ...]) -> TensorNode:
    """`TensorNode(shape, dtype, pieces)` without the frozen dataclass's `__init__` (as `leaf_node`)."""
    node = _new(TensorNode)
    _set(node, "shape", shape)
    _set(node, "dtype", dtype)
    _set(node, "pieces", pieces)
    _set(node, "shards", ())
    _set(node, "merge", None)
    _set(node, "value", None)
    return node


#: most nodes one `to_node` call may build. A pickle can reference one memoized container many times
#: ("billion laughs": 40 nested pairs expand to 2**40 nodes); real checkpoints stay far below this.
MAX_TREE_NODES = 1_000_000


def to_node(
    obj: Any, file: str, rank: Mapping[str, int] | None = None, _depth: int = 0, _budget: list[int] | None = None
) -> Node:
    """Convert an unpickled object (from `pickle_reader`) into tree nodes."""
    if _budget is None:
        _budget = [MAX_TREE_NODES]
    _budget[0] -= 1
    if _budget[0] < 0:
        raise CorruptCheckpoint(
            f"the pickled object tree expands to more than {MAX_TREE_NODES:,} nodes "
            "(one container referenced over and over)",
            path=file or None,
            hint="the file is corrupt or hostile; do not load it with torch.load",
        )
    if _depth > 64:
        return ValueNode("<nested too deeply>")
    if isinstance(obj, TensorRef):
        return tensor_node(obj, file, rank)
    if isinstance(obj, Mapping):
        return GroupNode({_key(k): to_node(v, file, rank, _depth + 1, _budget) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        # a list of plain values is one value however long (an RNG state's 625 integers): one node, which
        # `ckpt inspect` shows as type, length and first values, not 625 tree lines
        if all(_is_scalar(v) for v in obj):
            return ValueNode(list(obj) if isinstance(obj, list) else tuple(obj))
        return GroupNode({str(i): to_node(v, file, rank, _depth + 1, _budget) for i, v in enumerate(obj)})
    if isinstance(obj, Opaque):
        kids: dict[str, Any] = {}
        if isinstance(obj.state, dict):
            kids.update({_key(k): to_node(v, file, rank, _depth + 1, _budget) for k, v in obj.state.items()})
        elif obj.state is not None:
            kids["state"] = to_node(obj.state, file, rank, _depth + 1, _budget)
        if obj.args:
            if len(obj.args) == 1 and _is_scalar(obj.args[0]):
                kids["value"] = ValueNode(obj.args[0])
            else:
                kids["args"] = to_node(list(obj.args), file, rank, _depth + 1, _budget)
        for extra in ("items", "list"):
            if extra in obj.__dict__:
                kids[extra] = to_node(obj.__dict__[extra], file, rank, _depth + 1, _budget)
        return OpaqueNode(obj.cls, kids)
    if isinstance(obj, NumpyArray):
        return OpaqueNode("numpy.ndarray", {"shape": ValueNode(list(obj.shape)), "dtype": ValueNode(obj.dtype)})
    if isinstance(obj, NumpyDType):
        return ValueNode(f"numpy.dtype({obj.dtype})")
    if isinstance(obj, DType):
        return ValueNode(repr(obj))
    if isinstance(obj, (set, frozenset)):
        return ValueNode(sorted(map(repr, obj)))
    if isinstance(obj, (bytes, bytearray)):
        return ValueNode(f"<{len(obj)} bytes>")
    if _is_scalar(obj):
        return ValueNode(obj)
    return ValueNode(repr(obj)[:200])


def node_to_python(node: Any) -> Any:
    """A subtree as plain Python: groups as dicts, values as they are, a tensor as its (small) inline value."""
    if isinstance(node, ValueNode):
        return node.value
    if isinstance(node, (GroupNode, OpaqueNode)):
        return {k: node_to_python(v) for k, v in node.children.items()}
    if isinstance(node, TensorNode):
        return node.value
    return node


def saved_config(ck: "Checkpoint") -> dict:
    """The training config a checkpoint saved beside its state (DeepSpeed's ds_config under `config`), or {}."""
    node = ck.tree.children.get("config")
    val = node_to_python(node) if node is not None else None
    return val if isinstance(val, dict) else {}


def jsonable(v: Any) -> Any:
    """A value as plain JSON: lists for tuples, string keys, non-finite floats and objects as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def _key(k: Any) -> str:
    if isinstance(k, Opaque):
        return repr(k)
    return str(k)


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str, complex))


def scalar(node: Node | None) -> Any:
    """The plain value of a ValueNode or of a tiny TensorNode; None otherwise."""
    if isinstance(node, ValueNode):
        return node.value
    if isinstance(node, TensorNode):
        return node.value
    return None


def as_int(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    return None


def floats(v: Any) -> tuple[float, ...] | None:
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        return tuple(float(x) for x in v)
    return None


_NUM_RE = re.compile(r"(\d+)")


def natural_key(name: str) -> list:
    """Sort `blocks.10` after `blocks.9`."""
    return [int(t) if t.isdigit() else t for t in _NUM_RE.split(name)]
