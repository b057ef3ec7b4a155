"""The logical view of any checkpoint the tree can open: the model's tensors and the optimizer's
per-parameter state by parameter name, whole, whatever the files split them into.

Every format becomes one lazy tree (`ckpt_tools.read.tree`); this module reads that tree as the model it
saved. A ZeRO parameter is the run of its pieces across DP ranks, a pipeline parameter its TP shards
merged by the layout rules (`ckpt_tools.read.tp_layout`, decided when the tree was built), a DCP tensor its
chunks, an FSDP1 ShardedTensor its shards. Nothing is read until `LogicalTensor.read()` is called, and
that reads one tensor.

API (stable; `ckpt export`, `export --verify` and the logical `ckpt diff` are built on it)::

    from ckpt_tools.view.logical import LogicalTensor, model_tensors, optimizer_states, optimizer_scalars, param_groups

    @dataclass(frozen=True)
    class LogicalTensor:
        name: str                   # the state-dict name ("transformer.wte.weight"; "<param>.<key>" for state)
        shape: tuple[int, ...]      # the logical (merged) shape
        dtype: str                  # torch dtype name as stored ("float32", "bfloat16")
        kind: str                   # "param" | "frozen" | "tied" | "buffer" (model); "state" (optimizer)
        tied_to: str | None         # for kind "tied": the parameter whose value it has
        node: Any                   # the TensorNode it is read from (pieces / TP shards / chunks)
        def read(self, dtype=None) -> torch.Tensor   # the whole tensor, merged; dtype: torch.dtype or
                                                     # "float32"/"fp32"/"bf16"/... (None: as stored)

    model_tensors(ck, *, weights="fp32", include_frozen=True, tied="all", include=None, exclude=None)
        -> list[LogicalTensor]
        In the model's own (state-dict) order where the checkpoint records it. `ck`: a Checkpoint or a path.
        weights="fp32": the fp32 master where the format keeps one (DeepSpeed ZeRO 1/2/3, the pipeline,
            universal: the values `zero_to_fp32` writes), else the stored weights; "module": the weights
            the module held (bf16 under mixed precision; ZeRO-3 saves none, so its fp32 master).
        Tied parameters (DeepSpeed's `shared_params`, an HF model's tied lm_head, two names sharing one
            storage in a torch file) come under every name with kind "tied" and the source's value, as
            `zero_to_fp32` writes them; tied="dedupe" leaves the aliases out (the source stays).
        Frozen parameters (requires_grad=False; ZeRO-3's `frozen_param_fragments` merged across ranks)
            come with kind "frozen"; include_frozen=False leaves them out. Buffers have kind "buffer".
        include / exclude: regexes (or lists of them) `re.search`ed against the name.

    optimizer_states(ck, optimizer=0) -> dict[str, dict[str, LogicalTensor]]
        param name -> state key -> tensor, for every per-parameter tensor the optimizer keeps: "exp_avg",
        "exp_avg_sq", "momentum_buffer", "sum", ..., "step" where it is a tensor, and "fp32" (the fp32
        master) in DeepSpeed formats. `optimizer` numbers the optimizers of a checkpoint that has several
        (Accelerate's optimizer_1.bin). Where the file records only param ids and no names can be matched
        (Accelerate/HF Trainer with safetensors weights) the keys are the ids as strings. {} when the
        checkpoint has no optimizer state.

    optimizer_scalars(ck, optimizer=0) -> dict[str, dict[str, Any]]
        param name -> key -> plain value: the per-parameter values that are not tensors (DeepSpeed's
        `step`, a tensor `step`'s value, the param group index).

    param_groups(ck, optimizer=0) -> list[dict]
        one dict per group: its hyper-parameters as plain values (lr, betas, weight_decay, ...) and
        "params": the member parameter names (ids as strings where names are unknown).

    layout(ck) -> dict   # what the format module says: {"order", "frozen", "tied", "buffers", "groups"}

    name_key(name) -> str
        the name two checkpoints of the same model share for one parameter: Megatron-core's local layer-norm
        modules (`…input_layernorm.weight`, `…pre_mlp_layernorm.weight`, what the legacy format saves) under
        the names its dist-checkpointing saves them by (`…self_attention.linear_qkv.layer_norm_weight`,
        `…mlp.linear_fc1.layer_norm_weight`: fused into the next linear, as Transformer Engine holds them);
        every other name as it is. The logical diff pairs parameters by it.

A format module can tell more than its tree by defining `logical_layout(ck) -> dict` with any of the keys
"order" (state-dict names in module order), "frozen" (names), "tied" ({alias: source}), "buffers" (names),
"groups" (the trainable parameter names of each param group, for optimizers that flatten their groups).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import CkptError
from ..formats import module_of_format
from ..formats.torch_file import match_param_ids
from ..read import qkv
from ..read.pickle_reader import FdCache, LazyTensorRef
from ..read.tensor_read import merged_read
from ..read.tree import Checkpoint, GroupNode, OpaqueNode, TensorNode, ValueNode, scalar
from .checkpoint import open_checkpoint

__all__ = [
    "LogicalTensor",
    "model_tensors",
    "optimizer_states",
    "optimizer_scalars",
    "param_groups",
    "layout",
    "open_any",
    "torch_dtype",
    "with_kv_heads",
    "name_key",
]

#: Megatron-core's local-spec layer norms and the names its sharded state dict gives them (the transformer
#: layer's `sharded_state_dict_keys_map`): one parameter, two names, depending on the checkpoint format
MEGATRON_FUSED_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)
#: Megatron-core's decoder layers only (`decoder.layers.N.`): HF models also name an `input_layernorm`
_MEGATRON_NORM = re.compile(r"(?:^|\.)decoder\.layers\.\d+\.(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$")


def name_key(name: str) -> str:
    """The name under which `name` is compared with another checkpoint of the same model (module docstring)."""
    m = _MEGATRON_NORM.search(name)
    if m is None:
        return name
    fused = dict(MEGATRON_FUSED_NORMS)[f"{m[1]}."]
    return f"{name[: m.start(1)]}{fused}{m[2]}"


_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp64": "float64",
    "double": "float64",
}


def torch_dtype(dtype: Any):
    """A torch.dtype from a torch.dtype or a name ("float32", "fp32", "bf16", "torch.bfloat16")."""
    import torch  # lazy: torch only when a dtype is converted; the logical view stays torch-free

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    t = getattr(torch, name, None)
    if not isinstance(t, torch.dtype):
        raise ValueError(f"{dtype!r} is not a dtype (use fp32, bf16, fp16 or a torch dtype name)")
    return t


@dataclass(frozen=True)
class LogicalTensor:
    """One logical tensor of a checkpoint: whole, by name, read on demand (see the module docstring)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    tied_to: str | None = None
    node: Any = field(default=None, repr=False, compare=False)
    #: rows of `node` this tensor is (a split parameter's share of a fused optimizer state, see `with_kv_heads`);
    #: None: all of it
    rows: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def read(self, dtype: Any = None):
        """The tensor, merged across ZeRO pieces / TP shards / DCP chunks / ShardedTensor shards. Reads only
        this tensor's bytes; `dtype` converts (None: as stored)."""
        fds = FdCache()
        try:
            t = merged_read(self.node, fds)
        except ValueError as e:
            raise CkptError(
                f"{self.name}: {e}",
                hint="pass --pattern REGEX=MERGE (or --tp-layout megatron) so the TP shards can be merged",
            ) from None
        finally:
            fds.close()
        if self.rows is not None:
            import torch  # lazy: torch only when a tensor is read; the logical view stays torch-free

            t = t.reshape(tuple(self.node.shape)).index_select(0, torch.tensor(self.rows))
        shape = tuple(self.shape)
        if tuple(t.shape) != shape:
            if t.numel() == self.numel:
                t = t.reshape(shape)
            elif t.dim() == len(shape) and t.shape[0] > shape[0] and tuple(t.shape[1:]) == shape[1:]:
                t = t[: shape[0]]  # vocabulary padding rows beyond the real vocabulary
            else:
                raise CkptError(
                    f"{self.name}: read shape {tuple(t.shape)} but the checkpoint says {shape}",
                    hint="the files disagree with their metadata; the checkpoint may be damaged",
                )
        want = torch_dtype(dtype)
        if want is not None and t.dtype != want:
            t = t.to(want)
        return t


# --- helpers ---------------------------------------------------------------------------------------------


def open_any(ck: Checkpoint | str | os.PathLike) -> Checkpoint:
    """`ck` itself, or the checkpoint at that path."""
    if isinstance(ck, Checkpoint):
        return ck
    return open_checkpoint(Path(ck))


def layout(ck: Checkpoint | str | os.PathLike) -> dict[str, Any]:
    """{"order": [...], "frozen": [...], "tied": {alias: source}, "buffers": [...], "groups": [[names of
    param group 0], ...]}, as far as the format module's `logical_layout` knows them (empty otherwise)."""
    ck = open_any(ck)
    out: dict[str, Any] = {"order": [], "frozen": [], "tied": {}, "buffers": [], "groups": []}
    mod = module_of_format(ck.format)
    fn = getattr(mod, "logical_layout", None) if mod is not None else None
    if fn is not None:
        got = fn(ck) or {}
        for k in out:
            if got.get(k):
                out[k] = type(out[k])(got[k])
    return out


def _patterns(p: str | Sequence[str] | None) -> list[re.Pattern]:
    if p is None:
        return []
    if isinstance(p, (str, re.Pattern)):
        p = [p]
    out = []
    for x in p:
        try:
            out.append(re.compile(x) if isinstance(x, str) else x)
        except re.error as e:
            raise ValueError(f"bad regex {x!r}: {e}") from None
    return out


def _tensors(node: Any, prefix: str = "") -> Iterable[tuple[str, TensorNode]]:
    """(name, TensorNode) of a model group, nested groups' names dotted."""
    if isinstance(node, TensorNode):
        yield prefix, node
    elif isinstance(node, (GroupNode, OpaqueNode)):
        for k, v in node.children.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))


def models(ck: Checkpoint | str | os.PathLike) -> list[int]:
    """The model indices a checkpoint holds: [0], or [0, 1, ...] where the tree has `model_1`, ... (Accelerate
    with several `prepare`d models)."""
    ck = open_any(ck)
    out = [0]
    while f"model_{out[-1] + 1}" in ck.tree.children:
        out.append(out[-1] + 1)
    return out


def _storage_key(node: TensorNode) -> tuple | None:
    if node.shards or len(node.pieces) != 1:
        return None
    p = node.pieces[0]
    ref = p.ref
    if ref is None or getattr(ref, "storage", None) is None or node.numel == 0:
        return None
    # a DCP item is its own serialized blob inside the .distcp, every blob's storage keyed "0": the blob's
    # offset in the file (its source's base) tells two same-shape items of one file apart
    base = getattr(getattr(ref.storage, "source", None), "base", None)
    return (p.file, base, ref.storage.key, ref.storage_offset, tuple(ref.shape), tuple(ref.stride or ()))


def _opt_key(optimizer: int) -> str:
    return "optimizer" if optimizer == 0 else f"optimizer_{optimizer}"


def _state_group(ck: Checkpoint, optimizer: int = 0) -> dict[str, Any]:
    opt = ck.tree.children.get(_opt_key(optimizer))
    st = opt.children.get("state") if isinstance(opt, GroupNode) else None
    return dict(st.children) if isinstance(st, GroupNode) else {}


def _resolve(tied: dict[str, str], name: str) -> str:
    seen = {name}
    while name in tied and tied[name] not in seen:
        name = tied[name]
        seen.add(name)
    return name


# --- the model --------------------------------------------------------------------------------------------


def model_tensors(
    ck: Checkpoint | str | os.PathLike,
    *,
    weights: str = "fp32",
    include_frozen: bool = True,
    tied: str = "all",
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    model: int = 0,
) -> list[LogicalTensor]:
    """The model's tensors by name, in the model's own order (see the module docstring). `model`: which
    model of a checkpoint that holds several (Accelerate's `model_1.safetensors`, ...: the tree's `model_<N>`);
    the layout and the fp32 masters the format module knows describe model 0, so another model's tensors are
    its stored weights, in the order stored (ties found by shared storage)."""
    if weights not in ("fp32", "module"):
        raise ValueError(f"weights={weights!r}: use 'fp32' or 'module'")
    if tied not in ("all", "dedupe"):
        raise ValueError(f"tied={tied!r}: use 'all' or 'dedupe'")
    ck = open_any(ck)
    lay, stored, state = _model_source(ck, model)
    ties: dict[str, str] = {a: s for a, s in lay["tied"].items() if a != s}
    frozen, buffers = set(lay["frozen"]), set(lay["buffers"])
    _tie_shared_storage(stored, ties)
    inc, exc = _patterns(include), _patterns(exclude)
    out: list[LogicalTensor] = []
    for name in _ordered_names(lay["order"], stored, ties):
        tied_to = None
        if name in ties:
            source = _resolve(ties, name)
            if source == name:
                continue
            node = _node_for(source, weights, stored, state)
            if node is None:
                continue  # an alias of a parameter this checkpoint does not hold (excluded frozen weight)
            if weights == "module" and stored.get(name) is not None and stored[name].numel:
                node = stored[name]
            kind, tied_to = "tied", source
        else:
            node = _node_for(name, weights, stored, state)
            if node is None:
                continue
            kind = "buffer" if name in buffers else "frozen" if name in frozen else "param"
        if tied == "dedupe" and kind == "tied":
            continue
        if not include_frozen and (kind == "frozen" or (kind == "tied" and tied_to in frozen)):
            continue
        if inc and not any(p.search(name) for p in inc):
            continue
        if exc and any(p.search(name) for p in exc):
            continue
        out.append(LogicalTensor(name, tuple(node.shape), node.dtype, kind, tied_to, node))
    return out


def _model_source(ck: Checkpoint, model: int) -> tuple[dict[str, Any], dict[str, TensorNode], dict[str, Any]]:
    """(layout, stored tensors by name, optimizer state by name) of model `model`: another model than 0 has no
    layout and no state the format module knows."""
    if not model:
        return layout(ck), dict(_tensors(ck.model)), _state_group(ck)
    group = ck.tree.children.get(f"model_{model}")
    if group is None:
        held = models(ck)
        raise ValueError(
            f"model={model}: the checkpoint holds {len(held)} model"
            f"{'' if len(held) == 1 else 's'} ({', '.join(map(str, held))})"
        )
    return {"order": [], "frozen": [], "tied": {}, "buffers": [], "groups": []}, dict(_tensors(group)), {}


def _tie_shared_storage(stored: dict[str, TensorNode], ties: dict[str, str]) -> None:
    """Add to `ties` the names that share one storage in the same file (torch.save of a state dict with a tied
    weight): each an alias of the first name stored on it."""
    first_of: dict[tuple, str] = {}
    for name, node in stored.items():
        key = _storage_key(node)
        if key is None or name in ties:
            continue
        if key in first_of:
            ties[name] = first_of[key]
        else:
            first_of[key] = name


def _ordered_names(order: list[str], stored: dict[str, TensorNode], ties: dict[str, str]) -> list[str]:
    """The layout's order, then the stored names it misses, then the aliases, each name once."""
    out: list[str] = []
    seen: set[str] = set()
    for n in [*order, *stored, *ties]:
        if n not in seen:
            seen.add(n)
            out.append(n)
    return out


def _master(state: dict[str, Any], name: str) -> TensorNode | None:
    """The fp32 master copy the optimizer state holds for `name`, if any."""
    entry = state.get(name)
    if isinstance(entry, GroupNode) and isinstance(entry.children.get("fp32"), TensorNode):
        return entry.children["fp32"]
    return None


def _node_for(name: str, weights: str, stored: dict[str, TensorNode], state: dict[str, Any]) -> TensorNode | None:
    """The tensor read for `name`: its fp32 master where `weights` is "fp32" and there is one, else the stored
    weight (the master still where the stored one is a ZeRO-3 placeholder)."""
    if weights == "fp32":
        m = _master(state, name)
        if m is not None:
            return m
    node = stored.get(name)
    if node is not None and node.numel == 0 and _master(state, name) is not None:
        return _master(state, name)  # ZeRO-3 placeholders
    return node


# --- the optimizer ----------------------------------------------------------------------------------------


def _ids_to_names(ck: Checkpoint, optimizer: int) -> dict[str, str]:
    """Param id -> name for an optimizer whose state the reader left keyed by ids, when the format tells the
    model's parameter order (`logical_layout`'s "order") and `torch_file.match_param_ids` can match the ids
    to it by group and shape."""
    groups = _raw_groups(ck, optimizer)
    group_ids = [[str(i) for i in (g.get("params") or []) if isinstance(i, int)] for g in groups]
    if not any(group_ids):
        return {}
    named = [(ids, g.get("param_names")) for ids, g in zip(group_ids, groups)]
    if all(isinstance(n, list) and len(n) == len(ids) for ids, n in named):
        return {i: str(n) for ids, names in named for i, n in zip(ids, names)}  # torch saved each id's name
    lay = layout(ck)
    state = _state_group(ck, optimizer)
    named_state = bool(state) and not all(k.isdigit() for k in state)
    model = ck.tree.children.get("model" if optimizer == 0 else f"model_{optimizer}")
    stored = dict(_tensors(model)) if model is not None else {}
    # the reader named the state from the model's state-dict order (a torch state dict keeps module order);
    # without that, only a format that records the order can tell
    order = lay["order"] if optimizer == 0 and lay["order"] else (list(stored) if named_state else [])
    if not order:
        return {}
    skip = set(lay["buffers"]) | set(lay["tied"])
    names = [n for n in order if n not in skip]
    shapes = {n: tuple(stored[n].shape) for n in names if n in stored}
    id_shapes = {}
    for i, entry in _state_group(ck, optimizer).items():
        if isinstance(entry, GroupNode):
            big = [n for n in entry.children.values() if isinstance(n, TensorNode) and n.numel > 1]
            if big:
                id_shapes[i] = tuple(big[0].shape)
    if named_state:
        return {}  # the reader named the state; its groups carry `param_names` (see param_groups)
    got = match_param_ids(group_ids, id_shapes, names, shapes)
    return {str(k): v for k, v in (got or {}).items()}


def optimizer_states(ck: Checkpoint | str | os.PathLike, optimizer: int = 0) -> dict[str, dict[str, LogicalTensor]]:
    """param name -> state key -> LogicalTensor (see the module docstring)."""
    ck = open_any(ck)
    state = _state_group(ck, optimizer)
    rename = _ids_to_names(ck, optimizer) if state and all(k.isdigit() for k in state) else {}
    out: dict[str, dict[str, LogicalTensor]] = {}
    for pname, entry in state.items():
        if not isinstance(entry, (GroupNode, OpaqueNode)):
            continue
        name = rename.get(pname, pname)
        keys = {}
        for key, node in entry.children.items():
            if isinstance(node, TensorNode):
                keys[key] = LogicalTensor(f"{name}.{key}", tuple(node.shape), node.dtype, "state", None, node)
        if keys:
            out[name] = keys
    for fused, parts in (ck.state_split if optimizer == 0 else {}).items():  # split as its weights were saved
        keys = out.pop(fused, {})
        for part, rows in parts.items():  # a 0-d `step` is the whole parameter's
            out[part] = {
                k: LogicalTensor(
                    f"{part}.{k}",
                    (len(rows), *t.shape[1:]) if t.shape else t.shape,
                    t.dtype,
                    "state",
                    None,
                    t.node,
                    rows if t.shape else None,
                )
                for k, t in keys.items()
            }
    return out


def optimizer_scalars(ck: Checkpoint | str | os.PathLike, optimizer: int = 0) -> dict[str, dict[str, Any]]:
    """param name -> key -> plain value for the per-parameter values that are not whole tensors."""
    ck = open_any(ck)
    state = _state_group(ck, optimizer)
    rename = _ids_to_names(ck, optimizer) if state and all(k.isdigit() for k in state) else {}
    out: dict[str, dict[str, Any]] = {}
    for pname, entry in state.items():
        if not isinstance(entry, (GroupNode, OpaqueNode)):
            continue
        vals = {}
        for key, node in entry.children.items():
            if isinstance(node, ValueNode):
                vals[key] = node.value
            elif isinstance(node, TensorNode) and node.numel == 1:
                value = node.value if node.value is not None else _unread_value(node)
                if value is not None:
                    vals[key] = value
        if vals:
            out[rename.get(pname, pname)] = vals
    for fused, parts in (ck.state_split if optimizer == 0 else {}).items():
        if fused in out:
            vals = out.pop(fused)
            out.update({part: dict(vals) for part in parts})
    return out


def _unread_value(node: TensorNode) -> Any:
    """The value of a one-element tensor an open left unread (a DCP `step` a remote open did not fetch: its one
    piece a `LazyTensorRef`), read now; None when it has none to read."""
    if len(node.pieces) != 1 or not isinstance(node.pieces[0].ref, LazyTensorRef):
        return None
    return node.pieces[0].ref.item()


def node_to_display(node: Any) -> Any:
    """A saved entry (a param group's field, a run's `args`) as plain Python for display and comparison. Unlike
    `read.tree.node_to_python`: a group keyed 0, 1, ... is a list, a tensor without an inline value a
    `<tensor [shape] dtype>` placeholder, an opaque object `<cls>`."""
    if isinstance(node, ValueNode):
        return node.value
    if isinstance(node, TensorNode):
        return node.value if node.value is not None else f"<tensor {list(node.shape)} {node.dtype}>"
    if isinstance(node, GroupNode):
        kids = node.children
        if kids and all(k.isdigit() for k in kids):
            return [node_to_display(v) for _, v in sorted(kids.items(), key=lambda kv: int(kv[0]))]
        return {k: node_to_display(v) for k, v in kids.items()}
    if isinstance(node, OpaqueNode):
        return f"<{node.cls}>"
    return scalar(node)


def _raw_groups(ck: Checkpoint, optimizer: int) -> list[dict[str, Any]]:
    opt = ck.tree.children.get(_opt_key(optimizer))
    groups = opt.children.get("param_groups") if isinstance(opt, GroupNode) else None
    if not isinstance(groups, GroupNode):
        return []
    out = []
    for _, g in sorted(groups.children.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        if isinstance(g, GroupNode):
            out.append({k: node_to_display(v) for k, v in g.children.items()})
    return out


def param_groups(ck: Checkpoint | str | os.PathLike, optimizer: int = 0) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters and its member parameter names (see the module docstring)."""
    ck = open_any(ck)
    groups = _raw_groups(ck, optimizer)
    state = _state_group(ck, optimizer)
    # DeepSpeed flattens each group into one tensor (`params: [0]`); the members are the parameters whose
    # state says `param_group == i`
    by_group: dict[int, list[str]] = {}
    for name, entry in state.items():
        if isinstance(entry, GroupNode) and isinstance(entry.children.get("param_group"), ValueNode):
            gi = entry.children["param_group"].value
            if isinstance(gi, int):
                by_group.setdefault(gi, []).append(name)
    if not by_group and len(layout(ck)["groups"]) == len(groups):
        by_group = dict(enumerate(layout(ck)["groups"]))
    rename = _ids_to_names(ck, optimizer) if not by_group else {}
    out = []
    for i, g in enumerate(groups):
        g = dict(g)
        if g.get("moe"):
            # DeepSpeed's MoE group `name` is the expert group of the run's expert-parallel size (`ep_size_N`):
            # topology, like the DP size, not a hyper-parameter (a universal checkpoint leaves it to the loader)
            g.pop("name", None)
        if by_group:
            g["params"] = list(by_group.get(i, []))
        elif isinstance(g.get("param_names"), list) and len(g["param_names"]) == len(g.get("params") or []):
            g["params"] = [str(n) for n in g["param_names"]]
        else:
            params = g.get("params") or []
            g["params"] = [rename.get(str(p), str(p)) for p in (params if isinstance(params, list) else [params])]
        split = ck.state_split
        if split and optimizer == 0:
            g["params"] = [n for p in g["params"] for n in (split[p] if p in split else [p])]
        out.append(g)
    return out


# --- a fused parameter saved split (torchtitan's FusedQKVLinear, `ckpt_tools.read.qkv`) ----------------------------


def with_kv_heads(ck: Checkpoint | str | os.PathLike, n_kv_heads: int | None) -> Checkpoint:
    """`ck` read with the model's KV-head count: the optimizer state of a fused wqkv saved split (`qkv`) comes
    under the split names (`<m>.wq.weight`, ...), each the fused state's rows that train it, so every parameter has
    its own state and the reader's convert refusal for it is lifted. `ck` unchanged when `n_kv_heads` is None or
    nothing is fused. CkptError where `n_kv_heads` does not fit the saved shapes."""
    ck = open_any(ck)
    fused = qkv.find_fused(ck.tree)
    if n_kv_heads is None or not fused:
        return ck
    shapes = {t.name: tuple(t.shape) for t in model_tensors(ck, weights="module")}
    split: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, parts in fused.items():
        try:
            q, k, v = qkv.ordered_parts(name, parts)
        except ValueError as e:
            raise CkptError(str(e), path=ck.path, hint="convert and resume know torchtitan's fused wqkv only") from None
        rows = qkv.rows_or_refuse(shapes[q][0], shapes[k][0], n_kv_heads, ck.path)
        split[name] = {q: tuple(rows[0]), k: tuple(rows[1]), v: tuple(rows[2])}
    details = {k: v for k, v in ck.details.items() if k not in ("convert_unproven", "resume_unsupported")}
    details["n_kv_heads"] = f"{n_kv_heads} (given): the fused optimizer state split by KV-head group"
    return replace(ck, details=details, state_split=split)
