"""Megatron-LM's torch_dist checkpoints (`--ckpt-format torch_dist`, the default), as `save_checkpoint` writes them.

An iteration folder `iter_{N:07d}/` (beside `latest_checkpointed_iteration.txt`) holds a torch DCP (`.metadata`,
`__R_0.distcp`), `common.pt` (iteration, `args`, `opt_param_scheduler`, and with plain Adam the optimizer's
`param_groups` and its common Adam `step`) and `metadata.json` (`sharded_backend: torch_dist`). Tensors are GLOBAL
(TP and PP merged by Megatron's dist_checkpointing): the per-layer weights are stacked with a leading layer axis
(`decoder.layers.self_attention.linear_qkv.weight` [num_layers, …]), the input layer norms fused into the next
linear (`…linear_qkv.layer_norm_weight`), the plain optimizer's state as `optimizer.state.{exp_avg,exp_avg_sq,
fp32_param}.<param>`. The distributed optimizer saves flat bucket buffers (`optimizer.distributed.…bucket_idx_N.
{param,exp_avg,exp_avg_sq}`) and its param groups in a sharded object inside the .distcp files.

Read here: the DCP through the generic DCP reader (metadata only), `common.pt` through the safe reader; the layer
axis unstacked into `decoder.layers.{i}.…` (one parameter per layer, counted once), the optimizer state attached to
its parameter. Topology from `args` (the writer count is not the DP size). Training state: `common.pt` (param groups
and scheduler); the distributed optimizer's param groups sit in one sharded object (a pickled DCP item, which
set-lr rewrites whole). Its flat bucket buffers are mapped back to parameters (`_map_buckets`: each parameter's
range found from the DCP chunk boundaries and confirmed by its weights), or shown unmapped when that fails.
With PP > 1 and tied embeddings the last stage's output-layer copy is saved under the word embeddings' key with
another replica id, so the files hold it once.

Mixture-of-Experts: the routed experts are stacked on a second axis of `num_experts` (global ids) and shown one
parameter per expert (`….mlp.experts.local_experts.{e}.…`, the legacy format's names made global). The optimizer is
a ChainedOptimizer (dense, expert): with plain Adam common.pt keeps `optimizer[0]`, `optimizer[1]`, each with its own
param groups and common step; with the distributed optimizer its keys carry `chained_0.` / `chained_1.` (the expert
one's buckets one domain per EP rank), each with its own sharded param groups.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, NotACheckpoint, UnsupportedCheckpoint
from ..read.state import StateMap, StateSource
from ..read.tree import (
    Checkpoint,
    Counters,
    GroupNode,
    LearningRates,
    Piece,
    TensorNode,
    ValueNode,
    Warning_,
    as_int,
    to_node,
)
from . import _common as C
from . import dcp, megatron_lm
from .megatron_lm import LATEST, args_of, group_rule, group_warnings, next_lr

FORMAT = "megatron_torch_dist"
COMMON = "common.pt"
META = "metadata.json"
_LAYERS = "decoder.layers."
_STATE = "optimizer.state."
_DIST = "optimizer.distributed."
#: a ChainedOptimizer's distributed inner optimizers (MoE at EP > 1: 0 dense, 1 expert) prefix their keys
_CHAINED_DIST = re.compile(r"^chained_(\d+)\.optimizer\.distributed\.")


def _is_iter(d: Path) -> bool:
    if not ((d / ".metadata").is_file() and (d / COMMON).is_file() and (d / META).is_file()):
        return False
    try:
        return json.loads((d / META).read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


def _locate(path: Path) -> tuple[Path, Path, str | None] | None:
    if path.is_dir() and _is_iter(path):
        return path, path, None
    if path.is_dir() and (path / LATEST).is_file():
        try:
            txt = (path / LATEST).read_text().strip()
        except OSError:
            return None
        name = "release" if txt == "release" else (f"iter_{int(txt):07d}" if txt.isdigit() else txt)
        if _is_iter(path / name):
            return path, path / name, name
    return None


def sniff(path: Path) -> bool:
    return _locate(path) is not None


def _slice(node: TensorNode, i: int, starts: list[int], axis: str = "layer") -> TensorNode:
    """Entry `i` of a tensor stacked on a leading axis (`starts`: its pieces' sorted dst offsets)."""
    shape = tuple(node.shape[1:])
    n = math.prod(shape)
    out = _range(node, i * n, n, shape, starts, {axis: i})
    if isinstance(node.value, list) and len(node.value) == node.numel:
        out = replace(out, value=node.value[i * n : (i + 1) * n] if n > 1 else node.value[i * n])
    return out


def _split(name: str, node: TensorNode, count: int, axis: str, where: Path) -> list[TensorNode]:
    """The `count` entries of `node` along its leading `axis` (layer, expert), which args say it has."""
    if not node.shape or node.shape[0] != count:
        raise CorruptCheckpoint(
            f"{name}: shape {list(node.shape)} has no leading {axis} axis of {count} (args.num_{axis}s)",
            path=where,
            hint="the args and the tensors disagree",
        )
    starts = [p.dst_offset for p in node.pieces]
    if starts != sorted(starts):
        raise CorruptCheckpoint(f"{name}: pieces out of order", path=where)
    return [_slice(node, i, starts, axis) for i in range(count)]


#: a layer's routed experts as torch_dist stacks them (after the layer axis is unstacked): [num_experts, ...]
_STACKED_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)experts\.(.*)$")


def _unstack(flat: dict[str, TensorNode], layers: int, where: Path, experts: int = 0) -> dict[str, TensorNode]:
    """The layer axis unstacked (`decoder.layers.{i}.…`), and with `experts` the routed experts' axis too: Megatron's
    sharded `….mlp.experts.experts.<rest>` [layers, num_experts, ...] (global expert ids, whatever the EP size)
    becomes `….mlp.experts.local_experts.{e}.<rest>`, the name an EP 1 run's SequentialMLP (and the legacy format,
    ids made global) gives expert e: the two formats of one run read under the same names."""
    out: dict[str, TensorNode] = {}
    for name, node in flat.items():
        if not name.startswith(_LAYERS):
            out[name] = node
            continue
        for i, part in enumerate(_split(name, node, layers, "layer", where)):
            one = f"{_LAYERS}{i}.{name[len(_LAYERS) :]}"
            m = _STACKED_EXPERTS.match(one) if experts else None
            if m is None:
                out[one] = part
                continue
            for e, expert in enumerate(_split(one, part, experts, "expert", where)):
                out[f"{m[1]}local_experts.{e}.{m[2]}"] = expert
    return out


def _flat(node: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(node, GroupNode):
        for k, v in node.children.items():
            out.update(_flat(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = node
    return out


@dataclass
class _Optimizers:
    """The optimizer(s) common.pt (or the DCP's sharded objects) hold: the inner optimizers of a chained one, all
    their param groups (`owner`: which inner optimizer each group belongs to), each inner one's Adam step, and the
    step the checkpoint shows (None where they disagree or none is found)."""

    inner: list
    groups: list
    owner: list
    inner_steps: list
    found_steps: list
    step: int | None
    lost: list  # the inner optimizers without a common step (plain Adam only)


def open(path: Path) -> Checkpoint:  # noqa: A001  (the format-module interface)
    """The torch_dist iteration at `path` (the run folder, read through `latest_checkpointed_iteration.txt`, or the
    `iter_N` folder itself). Reads the DCP `.metadata` through `dcp.open` (metadata only: every tensor stays a lazy
    range of a `.distcp` file), `common.pt` through the safe reader, and `metadata.json` when sniffing; the
    distributed optimizer's param groups are one pickled sharded object read out of a `.distcp` file. The stacked
    layer (and expert) axes are unstacked into one lazy TensorNode per layer (expert), the optimizer state attached
    to its parameter. Training state: `common.pt` (param groups, scheduler) and, with the distributed optimizer,
    the sharded param-groups object in the DCP (`training_state`)."""
    root, it, tag, base, cache, common, args = _read_iteration(path)
    layers = as_int(args.get("num_layers")) or 0
    experts = as_int(args.get("num_experts")) or 0
    tensors, chains = _dcp_tensors(base, it)
    model, state, distributed, mapped = _model_and_state(tensors, layers, experts, it, args)
    opt = _optimizers(common, it, distributed, chains, mapped)
    warnings = [w for w in base.warnings if w.code not in ("megatron-torch-dist", "unread-files")]
    warnings += _state_warnings(model, state, distributed, opt, args)
    tree = _tree(model, state, distributed, mapped, opt, args)
    if distributed and mapped is None:
        tree["distributed_optimizer"] = GroupNode(distributed)
        warnings.append(
            Warning_(
                "not-mapped",
                "the distributed optimizer's flat fp32 master and Adam buffers (per "
                "bucket) are shown as saved, not per parameter: set-lr/set-step edit its param "
                "groups (a sharded object); export, convert and to-universal refuse (they would "
                "leave the fp32 master and Adam moments behind)",
                ".metadata",
            )
        )
    sched = common.get("opt_param_scheduler") if isinstance(common.get("opt_param_scheduler"), dict) else None
    if sched is not None:
        tree["scheduler"] = to_node(sched, COMMON)
    tree["counters"] = GroupNode(
        {
            k: ValueNode(common.get(k))
            for k in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far")
        }
    )
    tree["args"] = to_node(args, COMMON)
    rest = base.tree.children.get("client_state")
    if rest is not None:
        tree["client_state"] = rest
    warnings += cache.warnings()
    return _checkpoint(root, it, tag, base, common, args, sched, model, tree, opt, warnings, distributed, mapped)


def _read_iteration(path: Path) -> tuple[Path, Path, str | None, Checkpoint, C.LoadCache, dict, dict]:
    """(run folder, iteration folder, tag, the DCP opened by `dcp.open`, the load cache, common.pt's dict, its
    `args`), refusing what is not a torch_dist iteration, a common.pt without args and grouped-GEMM experts."""
    found = _locate(path)
    if found is None:
        raise NotACheckpoint("no Megatron-LM torch_dist iteration (.metadata + common.pt + metadata.json)", path=path)
    root, it, tag = found
    base = dcp.open(it)
    cache = C.LoadCache(root)
    common = cache.load(it / COMMON).obj
    if not isinstance(common, dict):
        raise CorruptCheckpoint("common.pt does not hold a dict", path=it / COMMON)
    args = args_of(common)
    if not args:
        raise CorruptCheckpoint(
            "common.pt holds no `args`", path=it / COMMON, hint="Megatron-LM saves its launch arguments in common.pt"
        )
    megatron_lm.refuse_grouped_gemm(args, it)
    return root, it, tag, base, cache, common, args


def _dcp_tensors(base: Checkpoint, it: Path) -> tuple[dict[str, TensorNode], list[int]]:
    """The DCP's tensors by flat key, and the chained distributed optimizers' indexes (MoE runs with the distributed
    optimizer chain a dense and an expert one: their keys carry a chained_N. prefix); other chained state is
    refused."""
    tensors = {
        k: v for k, v in _flat(base.tree.children.get("model", GroupNode({}))).items() if isinstance(v, TensorNode)
    }
    chains = sorted({int(m[1]) for k in tensors if (m := _CHAINED_DIST.match(k))})
    other = sorted(
        {k.split(".", 1)[0] for k in tensors if re.match(r"chained_\d+\.", k) and not _CHAINED_DIST.match(k)}
    )
    if other:
        raise UnsupportedCheckpoint(
            f"a Megatron-LM torch_dist checkpoint with chained optimizer state ckpt does not know "
            f"({', '.join(other)}: not a distributed optimizer's buckets): not mapped",
            path=it,
        )
    return tensors, chains


def _model_and_state(
    tensors: dict[str, TensorNode], layers: int, experts: int, it: Path, args: dict
) -> tuple[dict[str, TensorNode], dict[str, dict[str, Any]], dict[str, TensorNode], dict | None]:
    """(the weights unstacked per layer/expert, the plain optimizer's state per parameter, the distributed
    optimizer's flat buckets, those buckets mapped per parameter or None)."""
    # never a weight: any optimizer key (a prefix ckpt does not know still names an `optimizer.` segment)
    weights = {k: v for k, v in tensors.items() if not k.startswith("optimizer.") and ".optimizer." not in f".{k}"}
    model = _unstack(weights, layers, it, experts)
    state: dict[str, dict[str, Any]] = {}
    for key, node in tensors.items():
        if key.startswith(_STATE):
            kind, _, pname = key[len(_STATE) :].partition(".")
            for name, part in _unstack({pname: node}, layers, it, experts).items():
                state.setdefault(name, {})["fp32" if kind == "fp32_param" else kind] = part
    distributed = {k: v for k, v in tensors.items() if k.startswith(_DIST) or _CHAINED_DIST.match(k)}
    mapped = _map_buckets(distributed, model, it, args) if distributed and not state else None
    if mapped is not None:
        state = {n: mapped[n] for n in model}  # shown in model order (the buckets hold them in reverse)
    return model, state, distributed, mapped


def _optimizers(common: dict, it: Path, distributed: dict, chains: list[int], mapped: dict | None) -> _Optimizers:
    """The param groups and Adam steps: plain Adam keeps Megatron's wrapper around torch's state dict in common.pt,
    or a ChainedOptimizer's inner ones (MoE at EP > 1: dense, expert; `optimizer[0]`, `optimizer[1]`), each with its
    own param groups and common step; the distributed optimizer keeps them in sharded objects of the DCP."""
    inner = megatron_lm.inner_optimizers(common.get("optimizer"))
    groups, owner, inner_steps = [], [], []
    for k, osd in enumerate(inner):
        mine = [g for g in osd.get("param_groups") or [] if isinstance(g, dict)]
        groups += mine
        owner += [k] * len(mine)
        inner_steps.append(_common_step(osd))
    if not groups and distributed and chains:
        # each inner distributed optimizer's groups in a sharded object of its own (dense, then expert), each with
        # Adam's step; common.pt's `optimizer` holds only each one's sharding type
        inner, owner, inner_steps = [], [], []
        for k, c in enumerate(chains):
            mine = _sharded_param_groups(it, f"chained_{c}.{_DIST}")
            inner.append({"param_groups": mine})
            groups += mine
            owner += [k] * len(mine)
            seen = {as_int(g.get("step")) for g in mine}
            inner_steps.append(seen.pop() if len(seen) == 1 else None)
    elif not groups and distributed:
        groups = _sharded_param_groups(it)
    found_steps = [x for x in inner_steps if x is not None]
    step = found_steps[0] if found_steps and len(set(found_steps)) == 1 else None
    group_steps = {as_int(g.get("step")) for g in groups}
    if step is None and mapped is not None and len(group_steps) == 1:
        step = next(iter(group_steps))  # the distributed optimizer keeps Adam's step in its param groups
    # the distributed optimizer keeps its step in its param groups, not in common.pt's state
    lost = [k for k, x in enumerate(inner_steps) if x is None] if not distributed else []
    return _Optimizers(inner, groups, owner, inner_steps, found_steps, step, lost)


def _state_warnings(
    model: dict[str, TensorNode], state: dict, distributed: dict, opt: _Optimizers, args: dict
) -> list[Warning_]:
    """Optimizer state without a parameter or parameters without it, the param groups against the model, and a
    plain optimizer saved without its Adam step."""
    warnings = []
    orphan = sorted(set(state) - set(model))
    if orphan:
        warnings.append(
            Warning_(
                "declared-mismatch",
                f"optimizer state for {len(orphan)} name(s) the model does not "
                f"hold ({', '.join(orphan[:4])}{' …' if len(orphan) > 4 else ''})",
                ".metadata",
            )
        )
    lacking = sorted(n for n in model if state and n not in state)
    if lacking and not distributed:
        warnings.append(
            Warning_(
                "declared-mismatch",
                f"{len(lacking)} parameter(s) without optimizer state while the "
                f"others have it ({', '.join(lacking[:4])}{' …' if len(lacking) > 4 else ''})",
                ".metadata",
            )
        )
    warnings += group_warnings(opt.groups, {n: tuple(t.shape) for n, t in model.items()}, args, COMMON)
    if state and not distributed and (opt.step is None and not opt.found_steps or opt.lost):
        which = (
            f" of inner optimizer {', '.join(map(str, opt.lost))} (of {len(opt.inner)})" if len(opt.inner) > 1 else ""
        )
        warnings.append(
            Warning_(
                "optimizer-state-missing",
                f"common.pt holds no Adam step{which} (optimizer.state."
                "common_step) beside the saved moments: a resume restarts bias correction",
                COMMON,
            )
        )
    return warnings


def _tree(
    model: dict[str, TensorNode], state: dict, distributed: dict, mapped: dict | None, opt: _Optimizers, args: dict
) -> dict[str, Any]:
    """The tree's `model` and `optimizer` (state per parameter with its step and param group; the param groups)."""
    tree: dict[str, Any] = {"model": GroupNode(model)}
    opt_children: dict[str, Any] = {}
    if state:
        # common.pt's param groups list no members: Megatron re-derives them at load, by its default rule
        rule = group_rule(opt.groups, args)
        member = {n: rule(n, model[n].shape) for n in state if n in model} if rule else {}

        def step_of(n: str) -> int | None:  # a chained optimizer's inner ones each keep their own step
            if len(opt.inner) > 1 and member.get(n) is not None and member[n] < len(opt.owner):
                return opt.inner_steps[opt.owner[member[n]]]
            return None if opt.lost else opt.step  # which inner optimizer holds it is not known: not guessed

        kids = {
            n: GroupNode(
                {
                    **s,
                    **({"step": ValueNode(step_of(n))} if step_of(n) is not None else {}),
                    **({"param_group": ValueNode(member[n])} if member.get(n) is not None else {}),
                }
            )
            for n, s in state.items()
        }
        opt_children["state"] = GroupNode(kids)
    opt_children["param_groups"] = GroupNode(
        {str(i): GroupNode({k: to_node(v, COMMON) for k, v in g.items()}) for i, g in enumerate(opt.groups)}
    )
    tree["optimizer"] = GroupNode(opt_children)
    return tree


def _checkpoint(
    root: Path,
    it: Path,
    tag: str | None,
    base: Checkpoint,
    common: dict,
    args: dict,
    sched: dict | None,
    model: dict[str, TensorNode],
    tree: dict[str, Any],
    opt: _Optimizers,
    warnings: list[Warning_],
    distributed: dict,
    mapped: dict | None,
) -> Checkpoint:
    """The Checkpoint: files, topology, LRs (and the scheduler's next one), counters and details."""
    groups = opt.groups
    prefix = "" if it == root else f"{it.name}/"
    files = [replace(f, path=prefix + f.path) for f in base.files]
    files += [C.file_info(it / COMMON, root, "optimizer"), C.file_info(it / META, root, "config")]
    tp = as_int(args.get("tensor_model_parallel_size")) or 1
    pp = as_int(args.get("pipeline_model_parallel_size")) or 1
    lrs = tuple(float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float)))
    max_lrs = tuple(float(g["max_lr"]) for g in groups if isinstance(g.get("max_lr"), (int, float)))
    nxt = tuple(next_lr(sched, g, args) for g in groups) if sched and groups else ()
    steps = opt.found_steps or (
        [opt.step]
        if opt.step is not None
        else [as_int(g.get("step")) for g in groups if as_int(g.get("step")) is not None]
    )
    counters = Counters(
        global_step=as_int(common.get("iteration")), optimizer_step=steps[0] if steps and len(set(steps)) == 1 else None
    )
    warnings += C.counter_warnings(counters, optimizer_steps_seen=steps)
    details = _details(common, args, sched, model, opt, distributed, mapped, nxt)
    return Checkpoint(
        format=FORMAT,
        path=str(root),
        topology=megatron_lm.topology(args, as_int(args.get("data_parallel_size")), tp, pp),
        tree=GroupNode(tree),
        counters=counters,
        lr=LearningRates(param_groups=lrs, base_lrs=max_lrs or None, last_lr=nxt or None),
        parameter_count=sum(n.numel for n in model.values()),
        parameter_tensors=len(model),
        files=tuple(files),
        warnings=tuple(warnings),
        dtypes=tuple(sorted({n.dtype for n in model.values()})),
        details={"tag": tag, **details},
    )


def _details(
    common: dict,
    args: dict,
    sched: dict | None,
    model: dict[str, TensorNode],
    opt: _Optimizers,
    distributed: dict,
    mapped: dict | None,
    nxt: tuple,
) -> dict[str, Any]:
    """What `ckpt inspect` prints under details: iteration, the optimizer's kind, the layer axis, experts, scheduler."""
    layers = as_int(args.get("num_layers")) or 0
    experts = as_int(args.get("num_experts")) or 0
    details = {
        "iteration": common.get("iteration"),
        "checkpoint_version": common.get("checkpoint_version"),
        "consumed_train_samples": args.get("consumed_train_samples"),
        "floating_point_operations": common.get("num_floating_point_operations_so_far"),
        "optimizer": (
            (
                "distributed (flat buckets"
                + (
                    ", mapped to parameters: each one's range found in the bucket and checked against its weights)"
                    if mapped is not None
                    else ", not mapped)"
                )
            )
            if distributed
            else "Adam (per-parameter state)"
        )
        + megatron_lm.chained_note(opt.groups, len(opt.inner)),
        "layers": f"stacked on a leading axis of {layers} in the files; shown per layer"
        + (f", the routed experts on a second axis of {experts} (global expert ids)" if experts else ""),
        "tp_replicas": "Megatron's torch_dist saves each TP-replicated tensor once (one replica id), so the "
        "files hold no replicas to compare; the legacy format keeps every TP rank's copy",
    }
    if megatron_lm.experts_note(model, args):
        details["experts"] = megatron_lm.experts_note(model, args)
    if sched:
        details["scheduler"] = (
            f"OptimizerParamScheduler num_steps={sched.get('num_steps')}, "
            f"{sched.get('lr_decay_style')}, warmup {sched.get('lr_warmup_steps')}, decay "
            f"{sched.get('lr_decay_steps')}; next LR {', '.join(f'{x:.6g}' for x in nxt)}"
        )
    return details


def _map_buckets(
    distributed: dict[str, TensorNode], model: dict[str, TensorNode], where: Path, args: dict[str, Any] | None = None
) -> dict[str, dict[str, TensorNode]] | None:
    """Per-parameter {fp32, exp_avg, exp_avg_sq} inside the distributed optimizer's flat bucket tensors
    (`…dp_group_idx_D.gbuf_idx_G.dtype_(param dtype, grad dtype).bucket_idx_B.{param,exp_avg,exp_avg_sq}`), or None
    when the layout cannot be told for sure. The bucket holds its parameters back to back, unpadded, in an order the
    file does not write (Megatron's: reverse module order), and the DCP's chunk boundaries fall on every parameter's
    start. So each parameter is FOUND, not assumed (`_walk_bucket`). At TP x PP > 1 each model-parallel domain
    (D = tp + TP x pp) has buckets of its own holding its TP shards: there each parameter's shard is found in the
    domain's buckets, and the state is the shards merged by Megatron's TP rule (`_map_sharded_buckets`)."""
    buckets: dict[str, dict[str, TensorNode]] = {}
    for key, node in distributed.items():
        prefix, _, kind = key.rpartition(".")
        if kind in ("param", "exp_avg", "exp_avg_sq") and ".bucket_idx_" in prefix:
            buckets.setdefault(prefix, {})[kind] = node
    if not buckets or any(set(b) != {"param", "exp_avg", "exp_avg_sq"} for b in buckets.values()):
        return None
    args = args or {}
    try:
        if (as_int(args.get("tensor_model_parallel_size")) or 1) * (
            as_int(args.get("pipeline_model_parallel_size")) or 1
        ) > 1:
            return _map_sharded_buckets(buckets, model, args)
        k = 128
        finger: dict[tuple[str, int, bytes], list[str]] = {}
        for name, node in model.items():
            finger.setdefault((node.dtype, node.numel, C.read_range(node, 0, min(k, node.numel)).tobytes()), []).append(
                name
            )
        out: dict[str, dict[str, TensorNode]] = {}
        for prefix, kinds in sorted(buckets.items()):
            found = _walk_bucket(prefix, kinds, finger, {n: t.numel for n, t in model.items()}, set(out))
            if found is None:
                return None
            for name, (pos, n) in found.items():
                offsets = {kind: [q.dst_offset for q in v.pieces] for kind, v in kinds.items()}
                out[name] = {
                    ("fp32" if kind == "param" else kind): _range(v, pos, n, model[name].shape, offsets[kind])
                    for kind, v in kinds.items()
                }
    except (ValueError, OSError, TypeError):
        return None
    return out if set(out) == set(model) else None


#: Megatron's distributed optimizer starts each parameter at a multiple of 64 elements in its bucket
#: (`_ParamAndGradBuffer._pad_start_of_param_if_needed`); the gap before it is padding
_PARAM_ALIGN = 64


def _walk_bucket(
    prefix: str,
    kinds: dict[str, TensorNode],
    finger: dict[tuple[str, int, bytes], list[str]],
    numel: dict[str, int],
    taken: set[str],
    k: int = 128,
) -> dict[str, tuple[int, int]] | None:
    """{name: (start, numel)} of the parameters one bucket holds: at each start, the one parameter (of the bucket's
    param dtype, not `taken`) whose size reaches a chunk boundary and whose fingerprint (`finger`: its first `k`
    weights' bytes) is the bucket's fp32 master there rounded; a start off the 64-element alignment that ends on a
    chunk boundary is Megatron's padding, skipped; none or two such parameters, or a wrong shape: None."""
    pdtype = prefix.split("dtype_(", 1)[-1].split(",", 1)[0].replace("torch.", "")
    flat = kinds["param"]
    if flat.dtype != "float32" or len(flat.shape) != 1 or any(v.shape != flat.shape for v in kinds.values()):
        return None
    total = flat.shape[0]
    offsets = {kind: [q.dst_offset for q in v.pieces] for kind, v in kinds.items()}
    if any(o != sorted(o) for o in offsets.values()):
        return None
    starts = offsets["param"]
    bounds = set(starts) | {total}
    sizes = sorted({key[1] for key in finger if key[0] == pdtype})
    out: dict[str, tuple[int, int]] = {}
    pos = 0
    while pos < total:
        aligned = -(-pos // _PARAM_ALIGN) * _PARAM_ALIGN
        if aligned != pos and (aligned in bounds or aligned >= total):
            pos = min(aligned, total)  # Megatron's padding before a parameter start (its own chunk)
            continue
        found = []
        # one read per parameter start, rounded once: a parameter matches when its first elements ARE these
        # rounded bits (the fingerprint holds the weights' own bytes, so the lookup is the check)
        head = C.rounded_bits(C.read_range(flat, pos, min(k, total - pos), starts), pdtype)
        for n in sizes:  # only sizes a parameter has that end on a chunk boundary
            if pos + n in bounds:
                key = (pdtype, n, head[: min(k, n)].tobytes())
                found += [(name, n) for name in finger.get(key, ()) if name not in taken and name not in out]
        if len(found) != 1:
            return None
        name, n = found[0]
        out[name] = (pos, n)
        pos += n
    return out


def _map_sharded_buckets(
    buckets: dict[str, dict[str, TensorNode]], model: dict[str, TensorNode], args: dict[str, Any], k: int = 128
) -> dict[str, dict[str, TensorNode]] | None:
    """The TP x PP > 1 case of `_map_buckets`: domain D = tp + TP x pp holds TP rank tp's shard of each parameter of
    stage pp (Megatron's data-parallel group index: the rank in the model-parallel group). Each shard is found by
    its own fingerprint (its first `k` elements as TP rank tp holds them under `megatron_lm._rule`, read from the
    global weight: a few small reads per parameter and TP rank, never the whole tensor); the state of a parameter
    is its TP shards, merged by that rule. None unless every parameter is found on every TP rank."""
    tp = as_int(args.get("tensor_model_parallel_size")) or 1
    swiglu = bool(args.get("swiglu"))
    by_domain: dict[int, dict[str, dict[str, TensorNode]]] = {}
    for prefix, kinds in buckets.items():
        m = re.search(r"dp_group_idx_(\d+)\.", prefix)
        if m is None:
            return None
        by_domain.setdefault(int(m[1]), {})[prefix] = kinds
    rules = {name: megatron_lm._rule(name, swiglu) for name in model}  # fused norm names: replicated
    if any(r is None for r in rules.values()):
        return None
    shapes = {name: _shard_shape(node.shape, rules[name], tp) for name, node in model.items()}
    if any(v is None for v in shapes.values()):
        return None
    fingers: dict[int, dict[tuple[str, int, bytes], list[str]]] = {}  # per TP rank: every stage's domain shares it
    found: dict[str, dict[int, dict[str, TensorNode]]] = {}  # name -> tp rank -> kind -> range node
    for domain, domain_buckets in sorted(by_domain.items()):
        t = domain % tp
        if t not in fingers:
            fingers[t] = {}
            for name, node in model.items():
                head = _shard_head(node, rules[name], t, tp, k)
                fingers[t].setdefault((node.dtype, math.prod(shapes[name]), head), []).append(name)
        finger = fingers[t]
        taken: set[str] = set()
        for prefix, kinds in sorted(domain_buckets.items()):
            walked = _walk_bucket(prefix, kinds, finger, {}, taken, k)
            if walked is None:
                return None
            for name, (pos, n) in walked.items():
                offsets = {kind: [q.dst_offset for q in v.pieces] for kind, v in kinds.items()}
                found.setdefault(name, {})[t] = {
                    ("fp32" if kind == "param" else kind): _range(v, pos, n, shapes[name], offsets[kind])
                    for kind, v in kinds.items()
                }
                taken.add(name)
    if set(found) != set(model) or any(set(v) != set(range(tp)) for v in found.values()):
        return None
    return {
        name: {
            kind: TensorNode(
                model[name].shape, "float32", shards=tuple(found[name][t][kind] for t in range(tp)), merge=rules[name]
            )
            for kind in ("fp32", "exp_avg", "exp_avg_sq")
        }
        for name in model
    }


def _shard_shape(shape: tuple[int, ...], rule: str, tp: int) -> tuple[int, ...] | None:
    """The shape of one TP rank's shard of a tensor of `shape` under the merge `rule`; None for a rule it cannot
    split evenly."""
    if rule == "replicated":
        return tuple(shape)
    dim = int(rule.rsplit(":", 1)[1])
    if dim >= len(shape) or shape[dim] % (tp * (2 if rule.startswith("cat_sub") else 1)):
        return None
    return tuple(n // tp if i == dim else n for i, n in enumerate(shape))


def _shard_head(node: TensorNode, rule: str, t: int, tp: int, k: int) -> bytes:
    """The bytes of the first `k` elements (flattened) of TP rank `t`'s shard of the global tensor `node`, as
    `megatron_lm._rule`'s merge splits it (SwiGLU's cat_sub:0: the rank's slice of the gate, then of the up
    projection), read as ranges of the global tensor."""
    import numpy as np  # lazy: numpy only where tensor bytes are compared; importing formats stays numpy-free

    shape, numel = node.shape, node.numel
    if rule == "replicated":
        runs = [(0, numel)]
    elif rule == "cat:0":
        runs = [(t * (numel // tp), numel // tp)]
    elif rule == "cat_sub:0":  # [gate; up], each split over the ranks
        half, part = numel // 2, numel // 2 // tp
        runs = [(t * part, part), (half + t * part, part)]
    else:  # cat:d, d > 0: each slab of the leading dims holds the rank's slice of dim d and what follows it
        d = int(rule.rsplit(":", 1)[1])
        inner = math.prod(shape[d:])
        width = inner // tp
        runs = ((row * inner + t * width, width) for row in range(numel // inner))
    parts, got = [], 0
    for start, count in runs:
        take = min(count, k - got)
        parts.append(C.read_range(node, start, take))
        got += take
        if got >= min(k, numel // (1 if rule == "replicated" else tp)):
            break
    return np.concatenate(parts).tobytes() if len(parts) > 1 else parts[0].tobytes()


def _range(
    flat: TensorNode, start: int, n: int, shape: tuple[int, ...], starts: list[int], rank: dict[str, int] | None = None
) -> TensorNode:
    """Elements [start, start+n) of a tensor's flat elements as a node of `shape`, its pieces re-based (`starts`:
    the pieces' sorted dst offsets; `rank`: coordinates added to each piece's, e.g. the layer)."""
    every, end = flat.pieces, start + n
    lo, hi = max(bisect.bisect_right(starts, start) - 1, 0), bisect.bisect_left(starts, end)
    taken = [p for p in every[lo:hi] if p.numel and p.dst_offset + p.numel > start]  # those reaching into [start, end)
    if rank:  # each distinct rank mapping with `rank` added, shared by its pieces (read-only)
        merged = {id(p.rank): p.rank for p in taken}
        merged = {k: {**r, **rank} for k, r in merged.items()}
        pieces = [Piece(p.file, p.ref, p.src_offset, p.numel, p.dst_offset - start, merged[id(p.rank)]) for p in taken]
    else:
        pieces = [Piece(p.file, p.ref, p.src_offset, p.numel, p.dst_offset - start, p.rank) for p in taken]
    for k in {0, len(pieces) - 1} if pieces else ():  # only the first and last piece can stick out: clipped
        p = pieces[k]
        a, b = max(p.dst_offset, 0), min(p.dst_offset + p.numel, n)
        if (a, b) != (p.dst_offset, p.dst_offset + p.numel):
            pieces[k] = Piece(p.file, p.ref, p.src_offset + (a - p.dst_offset), b - a, a, p.rank)
    return TensorNode(tuple(shape), flat.dtype, tuple(pieces))


def _common_step(osd: dict) -> int | None:
    """torch_dist's common Adam step of one optimizer (`state.common_step`, a 0-d tensor; Megatron restores it
    into every parameter's `step` at load)."""
    ref = (osd.get("state") or {}).get("common_step") if isinstance(osd.get("state"), dict) else None
    return as_int(ref.item()) if hasattr(ref, "item") and getattr(ref, "numel", 0) == 1 else None


def _sharded_param_groups(it: Path, prefix: str = _DIST) -> list[dict]:
    """The distributed optimizer's param groups, saved as one sharded object (`optimizer.distributed.
    dp_group_idx_N.optimizer/shard_…`: [{param_groups: [...]}]) in the DCP: small pickled items, read inert.
    `prefix`: a chained inner optimizer's keys (`chained_1.optimizer.distributed.`)."""
    folder = dcp.DcpItems(it)
    tops = tuple(k for k in folder.sdm if k.startswith(prefix) and ".optimizer/shard_" in k)
    obj, _index = folder.state_tree(tops)  # the optimizer's object only, not every small item again
    per_domain: list[list[dict]] = []
    for key, v in sorted(obj.items(), key=lambda kv: str(kv[0])):
        if str(key).startswith(prefix) and "/shard_" in str(key) and str(key).split("/")[0].endswith(".optimizer"):
            groups: list[dict] = []
            for o in v if isinstance(v, list) else [v]:
                if isinstance(o, dict) and isinstance(o.get("param_groups"), list):
                    groups += [g for g in o["param_groups"] if isinstance(g, dict)]
            per_domain.append(groups)
    # at TP x PP > 1 (and an expert optimizer at EP > 1) each domain saves its own copy of the same groups: one copy
    # is the run's;
    # copies that differ are all shown, so the difference stays visible
    if per_domain and all(repr(g) == repr(per_domain[0]) for g in per_domain[1:]):
        return per_domain[0]
    return [g for groups in per_domain for g in groups]


def training_state(ck: Checkpoint):
    """common.pt holds the plain optimizer's param groups and the scheduler; the distributed optimizer's param groups
    are in a sharded object of the DCP, which ckpt does not edit yet."""
    root = Path(ck.path)
    common = next(f.path for f in ck.files if f.path.endswith(COMMON))
    sources = [StateSource(root / common, common)]
    if str(ck.details.get("optimizer", "")).startswith("distributed"):
        # the distributed optimizer's param groups: a sharded object (one pickled item) inside the .distcp files
        it = (root / common).parent
        sources.append(StateSource(it, str((it / ".metadata").relative_to(root)), kind="dcp"))
    return StateMap(root, tuple(sources))


__all__ = ["sniff", "open", "training_state", "FORMAT"]
