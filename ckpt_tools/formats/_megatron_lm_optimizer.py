"""Megatron-LM legacy checkpoints (formats/megatron_lm.py): the optimizer side, read out of the rank files.

The launch `args` a rank file saved, the inner optimizers of a (Chained)Optimizer, Megatron's default param-group
rule (which group a parameter is in, which groups a model declares), the plain Adam state mapped to parameters by
param id, and the distributed optimizer's flat buffers (`distrib_optim.pt`) mapped to parameters by Megatron's
buffer layout. Not a format module: `megatron_lm` reads the checkpoint and imports these (and re-exports the public
ones, where the other modules import them from).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpoint, UnsupportedCheckpoint
from ..read.pickle_reader import Opaque, TensorRef
from ..read.tree import GroupNode, Piece, TensorNode, ValueNode, Warning_, as_int, tensor_node, to_node
from . import _common as C
from .torch_file import match_param_ids

RANK_FILE = "model_optim_rng.pt"
DISTRIB = "distrib_optim.pt"


def args_of(obj: Any) -> dict[str, Any]:
    """The launch arguments a rank file saved (an argparse Namespace, read inert), as a dict."""
    a = obj.get("args") if isinstance(obj, dict) else None
    if isinstance(a, Opaque) and isinstance(a.state, dict):
        return dict(a.state)
    return dict(a) if isinstance(a, dict) else {}


def _inner_parts(saved: Any) -> list[Any]:
    """A saved Megatron optimizer as its inner optimizers' own dicts ({`optimizer`, `fp32_from_fp16_params`}), in
    Megatron's order: itself, or each inner optimizer of a ChainedOptimizer (saved as a list; MoE: dense, expert);
    a distributed optimizer's `distrib_optim.pt` of a chained one holds a list too (None where this rank is not the
    inner optimizer's data-parallel rank 0)."""
    return list(saved) if isinstance(saved, (list, tuple)) else [saved]


def _part_names(names: list[str], shapes: dict[str, tuple], groups: list[dict], chained: int, args: dict) -> list[str]:
    """The parameters (of `names`, model order) one inner optimizer of a ChainedOptimizer of `chained` holds: all of
    them without chaining; at EP > 1 (dense, expert) the expert ones when its groups say `is_expert_parallel`."""
    expert = {bool(g.get("is_expert_parallel")) for g in groups}
    if not groups and chained > 1:
        return []  # an inner optimizer without groups maps no parameter (the accounting names the lost groups)
    if chained == 1 and (len(expert) != 1 or not expert_parallel(args)):
        return list(names)
    if chained > 2 or len(expert) != 1 or not expert_parallel(args):
        raise UnsupportedCheckpoint(
            f"a Megatron-LM legacy rank file whose optimizer is a ChainedOptimizer of {chained} other than the "
            "(dense, expert) pair of a Mixture-of-Experts run at EP > 1: ckpt does not map its state"
        )
    want = expert.pop()
    return [n for n in names if _group_key(n, shapes[n], args)[0] == want]


def _owner(group: int, offset: list[int]) -> int:
    """The inner optimizer (of a ChainedOptimizer whose groups start at `offset`) that holds param group `group`."""
    return max(k for k, start in enumerate(offset) if start <= group)


def _optimizer(objs, names_by_rank, local, model, origin, tp, distributed, cache, ranks, problems, coords):
    """(the merged `optimizer` node or None, rank 0's param groups, the Adam steps seen). Plain Adam: the param ids
    of each rank's groups are mapped to its parameters (Megatron groups by weight decay / LR multiplier, each in
    model order), the fp32 master from `fp32_from_fp16_params`, then merged across TP like the model. A
    ChainedOptimizer (MoE at EP > 1: dense, expert; a list of inner optimizers) is read inner optimizer by inner
    optimizer, each over its own parameters and numbering its own param ids; its groups follow one another (dense,
    then expert), as `ChainedOptimizer.param_groups` lists them."""
    o0 = objs[min(objs)]
    args = args_of(o0)
    parts0 = [p for p in _inner_parts(o0.get("optimizer")) if isinstance(p, dict)]
    inner_groups = [
        [g for g in (osd.get("param_groups") or []) if isinstance(g, dict)] for osd in inner_optimizers(parts0)
    ]
    groups = [g for gs in inner_groups for g in gs]
    chained = len(inner_groups)
    steps: list[int] = []
    per_rank: dict[tuple[int, int], dict[str, dict[str, Any]]] | None = {}
    if distributed:
        for g in groups:
            if as_int(g.get("step")) is not None:
                steps.append(as_int(g.get("step")))
        per_rank = _distopt_per_rank(
            objs, names_by_rank, local, inner_groups, groups, steps, args, cache, ranks, coords
        )
        if per_rank is None:
            shown = {str(i): GroupNode({k: to_node(v, "") for k, v in g.items()}) for i, g in enumerate(groups)}
            return GroupNode({"param_groups": GroupNode(shown)}), groups, steps
    if not chained and not distributed:
        if not args.get("no_save_optim"):
            problems.append(
                Warning_(
                    "optimizer-state-missing",
                    "the rank files hold no optimizer state although args.no_save_optim is not set: a resume "
                    "starts the optimizer afresh",
                    cache.rel(ranks[min(objs)] / RANK_FILE),
                )
            )
        return None, [], []
    if not distributed:
        per_rank = _adam_per_rank(objs, names_by_rank, local, inner_groups, steps, args, cache, ranks, coords)
    kinds = {k for es in per_rank.values() for e in es.values() for k in ("exp_avg", "exp_avg_sq") if k in e}
    for key, es in sorted(per_rank.items()):
        lost = [n for n, e in es.items() if not kinds <= set(e)]
        if lost:
            problems.append(
                Warning_(
                    "declared-mismatch",
                    f"{len(lost)} parameter(s) its param groups list have no "
                    f"Adam state in this rank's file ({', '.join(lost[:4])}"
                    f"{' …' if len(lost) > 4 else ''}) while the others have it: lost state (a "
                    "resume restarts those moments at zero)",
                    cache.rel(ranks[key] / RANK_FILE),
                )
            )
    state_out = _merged_state(per_rank, model, origin, tp)
    shown = {str(i): GroupNode({k: to_node(v, "") for k, v in g.items()}) for i, g in enumerate(groups)}
    return GroupNode({"state": GroupNode(state_out), "param_groups": GroupNode(shown)}), groups, steps


def _distopt_per_rank(objs, names_by_rank, local, inner_groups, groups, steps, args, cache, ranks, coords):
    """{rank key: {local name: {fp32, exp_avg, exp_avg_sq, step, param_group}}} out of each rank's
    `distrib_optim.pt` (each inner optimizer's buffers over its own parameters), or None when one rank's layout
    cannot be told for sure (then the buffers are shown as saved)."""
    offset = [sum(len(gs) for gs in inner_groups[:k]) for k in range(len(inner_groups))]
    chained = len(inner_groups)
    per_rank: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for key in sorted(objs):
        f = ranks[key] / DISTRIB
        saved = _inner_parts(cache.load(f).obj) if f.is_file() else [None] * chained
        shapes = {n: tuple(r.shape) for n, r in local[key].items()}
        entries: dict[str, dict[str, Any]] | None = {} if len(saved) == chained else None
        for k, part in enumerate(saved if entries is not None else ()):
            mine = _part_names(names_by_rank[key], shapes, inner_groups[k], chained, args)
            if part is None and chained > 1 and key[1] > 0:
                continue  # this inner optimizer's state is saved by its data-parallel rank 0's folder
            found = (
                _distopt_entries(part, mine, local[key], args, cache.rel(f), coords(key)) if part is not None else None
            )
            if found is None:
                entries = None
                break
            entries.update(found)
        if entries is None:
            return None
        rule = group_rule(groups, args)  # the buffers do not record it: Megatron's own grouping rule
        per_rank[key] = {}
        for n, e in entries.items():
            gi = rule(n, local[key][n].shape) if rule else None
            inner_steps = {as_int(g.get("step")) for g in inner_groups[_owner(gi, offset)]} if gi is not None else set()
            step = steps[0] if steps and len(set(steps)) == 1 else None
            if len(inner_steps) == 1 and None not in inner_steps:
                step = next(iter(inner_steps))
            per_rank[key][n] = {
                **e,
                **({"step": step} if step is not None else {}),
                **({"param_group": gi} if gi is not None else {}),
            }
    return per_rank


def _adam_per_rank(objs, names_by_rank, local, inner_groups, steps, args, cache, ranks, coords):
    """{rank key: {local name: {fp32, exp_avg, exp_avg_sq, step, param_group}}} out of each rank file's plain
    (Chained)Optimizer: param ids mapped to the rank's parameters by group and shape (ckpt will not guess), the
    fp32 master from `fp32_from_fp16_params`; the Adam steps found are appended to `steps`."""
    offset = [sum(len(gs) for gs in inner_groups[:k]) for k in range(len(inner_groups))]
    chained = len(inner_groups)
    per_rank: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for key, o in objs.items():
        parts = [p for p in _inner_parts(o.get("optimizer")) if isinstance(p, dict)]
        if len(parts) != chained:
            raise CorruptCheckpoint(
                f"{ranks[key].name} holds {len(parts)} inner optimizer(s), {ranks[min(objs)].name} {chained}: files "
                "from different runs",
                path=ranks[key] / RANK_FILE,
            )
        rel = cache.rel(ranks[key] / RANK_FILE)
        shapes = {n: tuple(r.shape) for n, r in local[key].items()}
        entries = {}
        for k, opt in enumerate(parts):
            inner = opt.get("optimizer") if isinstance(opt.get("optimizer"), dict) else {}
            state = inner.get("state") if isinstance(inner.get("state"), dict) else {}
            gids = [list(g.get("params") or []) for g in inner.get("param_groups") or [] if isinstance(g, dict)]
            names = _part_names(names_by_rank[key], shapes, inner_groups[k], chained, args)
            id_shapes = {
                i: next((tuple(v.shape) for v in s.values() if isinstance(v, TensorRef) and v.numel > 1), None)
                for i, s in state.items()
                if isinstance(s, dict)
            }
            ids = match_param_ids(gids, id_shapes, names, shapes)
            if ids is None:
                which = f" (inner optimizer {k} of {chained})" if chained > 1 else ""
                raise UnsupportedCheckpoint(
                    f"{rel}: the optimizer's{which} {sum(map(len, gids))} parameter ids do not map onto "
                    f"the {len(names)} model parameters by group and shape: ckpt will not guess",
                    path=ranks[key] / RANK_FILE,
                )
            masters = opt.get("fp32_from_fp16_params") if isinstance(opt.get("fp32_from_fp16_params"), list) else []
            for gi, glist in enumerate(gids):
                for pos, i in enumerate(glist):
                    name = ids[i]
                    e: dict[str, Any] = {"param_group": offset[k] + gi}
                    s = state.get(i) if isinstance(state.get(i), dict) else {}
                    for kind in ("exp_avg", "exp_avg_sq"):
                        if isinstance(s.get(kind), TensorRef):
                            e[kind] = tensor_node(s[kind], rel, coords(key))
                    stepv = s.get("step")
                    stepv = stepv.item() if isinstance(stepv, TensorRef) and stepv.numel == 1 else stepv
                    if as_int(stepv) is not None:
                        e["step"] = as_int(stepv)
                        steps.append(as_int(stepv))
                    if (
                        gi < len(masters)
                        and isinstance(masters[gi], list)
                        and pos < len(masters[gi])
                        and isinstance(masters[gi][pos], TensorRef)
                    ):
                        e["fp32"] = tensor_node(masters[gi][pos], rel, coords(key))
                    entries[name] = e
        per_rank[key] = entries
    return per_rank


def _merged_state(per_rank, model, origin, tp) -> dict[str, GroupNode]:
    """{global name: its optimizer state}: each kind merged over the TP ranks like its parameter, step and param
    group from TP rank 0; a parameter some TP rank has no state for is left out."""
    state_out: dict[str, GroupNode] = {}
    for gname, node in model.items():
        p, lname = origin[gname]  # the same local name on every TP rank of its stage
        per_tp = [per_rank[(t, p)].get(lname) for t in range(tp)]
        if any(e is None for e in per_tp):
            continue
        kids: dict[str, Any] = {}
        for k in ("fp32", "exp_avg", "exp_avg_sq"):
            if all(k in e for e in per_tp):
                parts = [e[k] for e in per_tp]
                if tp == 1:
                    kids[k] = parts[0]
                else:
                    kids[k] = TensorNode(node.shape, parts[0].dtype, shards=tuple(parts), merge=node.merge)
        for k in ("step", "param_group"):
            if k in per_tp[0]:
                kids[k] = ValueNode(per_tp[0][k])
        state_out[gname] = GroupNode(kids)
    return state_out


def distopt_layout(names: list[str], numel: dict[str, int], args: dict) -> tuple[dict[str, int], list[int]]:
    """Where each parameter of one distributed-optimizer buffer (`names` in model order) starts in the legacy save's
    coalesced world tensor, and each bucket's unpadded length, by Megatron-core 0.16's `_ParamAndGradBuffer`:
    parameters in reverse model order, each start padded to 64 elements; one bucket, except that with PP > 1 and
    tied embeddings the shared embedding (the first stage's word embeddings, the last stage's output weight) is a
    bucket of its own; the bucket before it ends at its padded start, the one after it starts right at its end
    (the save drops the padding between buckets)."""
    shared = set()
    if (as_int(args.get("pipeline_model_parallel_size")) or 1) > 1 and not args.get(
        "untie_embeddings_and_output_weights"
    ):
        shared = {"embedding.word_embeddings.weight", "output_layer.weight"}
    pos, rel, in_bucket = 0, 0, 0  # the bucket's saved offset, the position in it, its parameters so far
    where: dict[str, int] = {}
    buckets: list[int] = []
    for n in reversed(names):
        rel = -(-rel // 64) * 64
        if n in shared and in_bucket:  # the bucket before it closes at its padded start
            buckets.append(rel)
            pos, rel, in_bucket = pos + rel, 0, 0
        where[n] = pos + rel
        rel += numel[n]
        in_bucket += 1
        if n in shared:  # a bucket of its own
            buckets.append(rel)
            pos, rel, in_bucket = pos + rel, 0, 0
    if in_bucket:
        buckets.append(rel)
    return where, buckets


def _distopt_entries(
    obj: Any, names: list[str], refs: dict[str, TensorRef], args: dict, rel: str, rank: dict[str, int]
) -> dict[str, dict[str, TensorNode]] | None:
    """Per-parameter {fp32, exp_avg, exp_avg_sq} inside the distributed optimizer's flat buffers of one rank file, or
    None when the layout cannot be told for sure. Megatron-core's grad buffer (`_ParamAndGradBuffer`, 0.16): one
    buffer per (param dtype, grad dtype), parameters in REVERSE model order, each start padded to 64 elements, one
    bucket unless a bucket size was set (`ddp_bucket_size`/`ddp_num_buckets`); with PP > 1 and tied embeddings the
    shared embedding (the first stage's word embeddings, the last stage's output weight) is a bucket of its own
    (`_does_param_require_new_bucket`). The saved buffers hold each bucket's `numel_unpadded` elements back to back
    (`get_parameter_state_dp_zero` drops the padding between buckets): a bucket closed before the shared weight
    ends at that weight's 64-padded start, the bucket after it starts right at its end. The layout is accepted only
    when it adds up exactly."""
    if (
        not isinstance(obj, dict)
        or args.get("ddp_bucket_size")
        or args.get("ddp_num_buckets")
        or args.get("mtp_num_layers")
    ):
        return None
    chunks = [v for k, v in obj.items() if isinstance(k, int)]
    if len(chunks) != 1 or not isinstance(chunks[0], dict):
        return None  # several model chunks (virtual pipeline): not mapped
    out: dict[str, dict[str, TensorNode]] = {}
    for dkey, buf in chunks[0].items():
        if not isinstance(buf, dict):
            return None
        pdtype = str(dkey[0] if isinstance(dkey, tuple) else dkey).replace("torch.", "")
        mine = [n for n in names if refs[n].dtype == pdtype]
        where, buckets = distopt_layout(mine, {n: refs[n].numel for n in mine}, args)
        pos = sum(buckets)
        flat = {k: buf.get(k) for k in ("param", "exp_avg", "exp_avg_sq")}
        if as_int(buf.get("numel_unpadded")) != pos or not all(
            isinstance(v, TensorRef) and v.numel >= pos for v in flat.values()
        ):
            return None
        # the order is Megatron's, not written in the file: every parameter's first elements in the model weights
        # must be its fp32 master's, rounded (Megatron copies the master into the weights after each step); a few
        # hundred bytes per parameter, so a wrong order is refused, never shown
        for n in mine:
            k = min(refs[n].numel, 128)
            try:
                same = C.rounds_to(flat["param"].read_numpy(where[n], k), refs[n].read_numpy(0, k), pdtype)
            except Exception:  # noqa: BLE001  unreadable bytes: not mapped (the reader reports corruption elsewhere)
                return None
            if not same:
                return None
        for n in mine:
            out[n] = {
                ("fp32" if k == "param" else k): TensorNode(
                    tuple(refs[n].shape), v.dtype, (Piece(rel, v, where[n], refs[n].numel, 0, rank),)
                )
                for k, v in flat.items()
            }
    return out if set(out) == set(names) else None


def inner_optimizers(saved: Any) -> list[dict]:
    """The torch optimizer state dicts ({`state`, `param_groups`}) in a saved Megatron optimizer, in Megatron's
    order: one for a plain MegatronOptimizer ({`optimizer`: {...}, `fp32_from_fp16_params`, ...}); one per inner
    optimizer of a ChainedOptimizer (a Mixture-of-Experts run at EP > 1: dense, then expert), which
    `ChainedOptimizer.state_dict` saves as a list (legacy) and `sharded_state_dict` as a dict keyed 0, 1
    (torch_dist's common.pt)."""
    if (
        isinstance(saved, dict)
        and saved
        and all(isinstance(k, int) or (isinstance(k, str) and k.isdigit()) for k in saved)
    ):
        parts = [saved[k] for k in sorted(saved, key=int)]
    elif isinstance(saved, (list, tuple)):
        parts = list(saved)
    else:
        parts = [saved]
    return [p["optimizer"] if isinstance(p.get("optimizer"), dict) else p for p in parts if isinstance(p, dict)]


def expert_parallel(args: dict) -> bool:
    """Whether Megatron-core (0.16) gave the experts their own optimizer: it marks expert weights `allreduce=False`
    only at expert-parallel size > 1 (`tensor_parallel.layers`, `moe.experts`), and `get_megatron_optimizer` then
    chains a second optimizer over their param groups (`is_expert_parallel: True`); at EP 1 they sit in the dense
    groups."""
    return bool(as_int(args.get("num_experts"))) and (as_int(args.get("expert_model_parallel_size")) or 1) > 1


def _group_key(name: str, shape: tuple, args: dict) -> tuple[bool, float]:
    """(is_expert_parallel, wd_mult): the param group Megatron's default grouping puts a parameter in. The routed
    experts are `….mlp.experts.…` (a shared expert, `….mlp.shared_experts.…`, is dense)."""
    return (expert_parallel(args) and ".mlp.experts." in f".{name}", _wd_mult(name, shape, args))


def declared_groups(shapes: dict[str, tuple], args: dict) -> set[tuple[bool, float]] | None:
    """The param groups (by `_group_key`) Megatron's default grouping makes for a model of these parameters; None
    where the args ask for another grouping (a custom no-weight-decay condition, a decoupled LR)."""
    if args.get("no_weight_decay_cond_type") or args.get("decoupled_lr") is not None:
        return None
    return {_group_key(name, tuple(shape), args) for name, shape in shapes.items()}


def _found_key(g: dict) -> tuple[bool, float] | None:
    return (bool(g.get("is_expert_parallel")), float(g["wd_mult"])) if "wd_mult" in g else None


def missing_groups(groups: list[dict], shapes: dict[str, tuple], args: dict) -> list[str]:
    """The param groups the args and the model declare that `groups` lacks, each named ("expert wd_mult 0"); []
    when all are there or the grouping is not Megatron's default one."""
    want = declared_groups(shapes, args)
    if want is None or not all("wd_mult" in g for g in groups):
        return []
    have = {_found_key(g) for g in groups}
    return [f"{'expert' if e else 'dense'} wd_mult {w:g}" for e, w in sorted(want - have)]


def _wd_mult(name: str, shape: tuple, args: dict) -> float:
    """Megatron's default weight-decay rule (megatron.core.optimizer.get_standard_config_overrides, 0.16): biases
    and 1-D parameters at wd_mult 0 (q/k layer norms excepted under --apply-wd-to-qk-layernorm), the rest at 1."""
    qk = bool(args.get("apply_wd_to_qk_layernorm")) and ("q_layernorm." in name or "k_layernorm." in name)
    return 0.0 if (name.endswith(".bias") or len(shape) == 1) and not qk else 1.0


def group_rule(groups: list[dict], args: dict):
    """`(name, shape) -> param group index` by Megatron's default grouping (`_get_param_groups`: one group per
    wd_mult, dense and expert apart at EP > 1, no LR multiplier, no decoupled LR), for the saves that do not record
    which
    parameter is in which group (torch_dist's common.pt, the distributed optimizer); None where the args or the
    saved groups say another grouping (then membership is not guessed)."""
    if args.get("no_weight_decay_cond_type") or args.get("decoupled_lr") is not None or not groups:
        return None
    index: dict[tuple[bool, float], int] = {}
    for i, g in enumerate(groups):
        key = _found_key(g)
        if key is None or float(g.get("lr_mult", 1.0)) != 1.0 or key in index or (key[0] and not expert_parallel(args)):
            return None
        index[key] = i
    return lambda name, shape: index.get(_group_key(name, tuple(shape), args))


def group_warnings(groups: list[dict], shapes: dict[str, tuple], args: dict, where: str | None) -> list[Warning_]:
    """Declared vs found for the param groups: Megatron's default grouping (`_get_param_groups`, no custom
    no-weight-decay condition or decoupled LR) puts biases and 1-D parameters at wd_mult 0 and the rest at
    wd_mult 1, so a model with both holds a group of each (and at EP > 1 the experts a pair of their own). A lost
    group is named (its parameters would resume without their LR/weight-decay settings)."""
    if not groups:
        return []
    gone = missing_groups(groups, shapes, args)
    if not gone:
        return []
    return [
        Warning_(
            "declared-mismatch",
            f"no param group {', '.join(gone)} although the model has parameters "
            f"Megatron puts there ({len(groups)} group(s) saved): a param group was lost",
            where,
        )
    ]
