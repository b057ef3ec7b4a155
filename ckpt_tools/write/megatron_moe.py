"""Megatron-LM legacy rank files of a Mixture-of-Experts run at another expert-parallel size (`ckpt convert SRC OUT
--to megatron --ckpt-format torch --ep N`), as Megatron-LM core_v0.16.1's `--ckpt-format torch` save lays them out
for plain Adam at TP 1 x PP 1:

    OUT/iter_{N:07d}/mp_rank_00_{e:03d}/model_optim_rng.pt   one per EP rank e (EP 1: `mp_rank_00`)
        model       the dense parameters (a replica on every EP rank) and EP rank e's experts: global expert g sits
                    on EP rank g // (E / N) under its local id g % (E / N), in Megatron-core's module order
        optimizer   EP > 1: Megatron's ChainedOptimizer as its legacy save writes it, [dense, expert], each
                    {optimizer: {state, param_groups}, fp32_from_fp16_params}; EP 1: one such dict (at EP 1
                    Megatron's `_get_param_groups` finds no `is_expert_parallel` parameter: the experts sit in the
                    dense groups). Each inner optimizer numbers its parameters group after group, each group in
                    `named_parameters` order (the module order), as torch's Optimizer.state_dict does
        args, checkpoint_version, iteration, opt_param_scheduler, rng_state, num_floating_point_operations_so_far

`--ckpt-format torch_dist` (`_write_dist`, from legacy rank files): Megatron's torch_dist run folder, the experts
stacked `[layers, num_experts, ...]` under `decoder.layers.mlp.experts.experts.*`, and common.pt's param groups as
Megatron builds them at EP N (the DCP tensors do not depend on EP; Megatron-core 0.16.1 loads plain-Adam MoE groups
only at the EP they were built for).

The source is a torch_dist save (experts stacked on a `num_experts` axis) or legacy rank files (one folder per EP
rank), read through the logical view under GLOBAL expert ids. The param groups are the source's, regrouped for the
new EP (`groups_at`): at EP 1 each expert group joins the dense group with the same hyper-parameters; at EP > 1 the
experts leave the dense groups for groups of their own (`is_expert_parallel`). Nothing is unpickled: args, scheduler
and RNG states are the source's inert trees.
"""

from __future__ import annotations

import collections
import copy
import json
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedCheckpoint
from ..read import pickle_reader as pr
from ..view import logical as L
from ..view.logical import name_key
from .dcp_write import DcpStreamWriter, LazyPart, plan_save_id
from .megatron_common import LATEST, _args, rank_files
from .megatron_to_legacy import _DistSource, _Records, _rng_list
from .megatron_write import CONTENT_METADATA, DIST_META, _zip_bytes, dist_key
from .pickle_writer import rewrite_torch_zip
from .torch_zip import save

_EXPERT = re.compile(r"^decoder\.layers\.\d+\.mlp\.experts\.local_experts\.(\d+)\.")
#: a MoE layer's modules (local spec, SequentialMLP) in the order Megatron-core's TransformerLayer registers them
_LAYER_MODULES = (
    "input_layernorm.",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "pre_mlp_layernorm.",
    "mlp.router.",
)
_LINEAR = ("self_attention.linear_proj.", "self_attention.linear_qkv.", "linear_fc1.", "linear_fc2.")


def is_moe(ck) -> bool:
    return bool(_args(ck).get("num_experts"))


def is_expert(name: str) -> bool:
    """Whether the logical parameter `name` is a routed expert's (`decoder.layers.L.mlp.experts.local_experts.g.`)."""
    return _EXPERT.match(name) is not None


def saved_ep(ck) -> int:
    return int(ck.topology.ep or _args(ck).get("expert_model_parallel_size") or 1)


def _refuse(what: str, src: Path, hint: str | None = None):
    return UnsupportedCheckpoint(f"--to megatron of a Mixture-of-Experts run: {what}", path=src, hint=hint)


def target_ep(ck, ep: int | None) -> int:
    """The EP size the rank files are written at (default: the saved one)."""
    return saved_ep(ck) if ep is None else ep


def check(
    ck, src: Path, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
) -> tuple[int | None, int | None]:
    """Refuse, each in one line naming it, a MoE source or target ckpt does not write; returns the (TP, PP) sizes
    of the rank files (1, 1; torch_dist: None, None)."""
    args = _args(ck)
    experts, saved = int(args.get("num_experts") or 0), saved_ep(ck)
    head = f"(num_experts={experts}, expert_model_parallel_size={saved})"
    if ckpt_format == "torch_dist" and ck.format == "megatron_torch_dist":
        raise _refuse(
            f"--ckpt-format torch_dist of a torch_dist save {head}: nothing to convert",
            src,
            hint="--ckpt-format torch --ep N writes legacy rank files at another EP size",
        )
    if ckpt_format not in ("torch", "torch_dist"):
        raise _refuse(
            f"--ckpt-format {ckpt_format} {head} is not written yet (only --ckpt-format torch: legacy rank files "
            "per EP rank)",
            src,
            hint="--ckpt-format torch --ep N writes legacy rank files at another EP size (Megatron-core "
            "0.16.1 does not load a plain-Adam torch_dist MoE save at another EP: its param groups differ)",
        )
    if ck.format not in ("megatron_torch_dist", "megatron_legacy"):
        raise _refuse(f"a {ck.format} source holds no Megatron-LM MoE layout", src)
    named = [
        (args.get("use_distributed_optimizer"), "the distributed optimizer (--use-distributed-optimizer)"),
        ((args.get("transformer_impl") or "local") != "local", f"transformer_impl={args.get('transformer_impl')}"),
        ((args.get("expert_tensor_parallel_size") or 1) != 1, "expert tensor parallelism (ETP > 1)"),
        (args.get("moe_grouped_gemm"), "the grouped-GEMM experts (--moe-grouped-gemm)"),
        (args.get("moe_shared_expert_intermediate_size"), "a shared expert (--moe-shared-expert-intermediate-size)"),
        (args.get("moe_layer_freq") not in (None, 1), "dense layers between MoE layers (--moe-layer-freq)"),
        ((ck.topology.tp or 1) != 1 or (ck.topology.pp or 1) != 1 or ck.topology.vpp, "a source at TP or PP > 1"),
        (tp not in (None, 1) or pp not in (None, 1), f"--tp {tp} / --pp {pp} (a TP / PP change)"),
    ]
    for bad, what in named:
        if bad:
            raise _refuse(f"{what} {head} is not written yet (plain Adam at TP 1 x PP 1 only)", src)
    ep = saved if ep is None else ep
    world = int(args.get("world_size") or args.get("data_parallel_size") or 1)
    if ep < 1 or experts % ep or world % ep:
        raise _refuse(
            f"--ep {ep} {head}: an EP size divides num_experts and the run's world size ({world})",
            src,
            hint="choose an EP size that divides both",
        )
    if ckpt_format == "torch_dist":
        return None, None
    if ck.format == "megatron_legacy" and ep == saved:
        raise UnsupportedCheckpoint(
            f"the checkpoint is already in Megatron-LM's legacy format at EP {saved}: nothing to convert",
            path=src,
            hint="--ep N writes the rank files of another expert-parallel size",
        )
    return 1, 1


def groups_at(groups: list[dict], ep: int, src: Path) -> list[dict]:
    """Megatron's param groups at EP `ep` from the source's: the dense groups, then (EP > 1) the expert groups, each
    keyed by its hyper-parameters but `is_expert_parallel`; an expert group without a dense group of the same
    hyper-parameters at EP 1 (Megatron would put them in one) is refused naming the field."""

    def hyper(g: dict) -> dict:
        return {k: v for k, v in g.items() if k not in ("params", "is_expert_parallel")}

    out: list[dict] = []
    for expert_side in (False, True) if ep > 1 else (False,):
        for g in groups:
            names = [n for n in g["params"] if (ep > 1 and is_expert(n)) == expert_side]
            if not names:
                continue
            h = hyper(g)
            same = next((o for o in out if hyper(o) == h and o["is_expert_parallel"] == expert_side), None)
            if same is None:
                if ep == 1 and g.get("is_expert_parallel"):
                    raise _refuse(
                        f"expert param group {groups.index(g)} has no dense group with the same hyper-parameters "
                        f"({', '.join(f'{k}={v}' for k, v in h.items())}): at EP 1 Megatron groups them together",
                        src,
                    )
                out.append({"params": list(names), "is_expert_parallel": expert_side, **h})
            else:
                same["params"].extend(names)
    return out


def plan_lines(
    ck, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
) -> tuple[list[str], list[str]]:
    """(notes, not moved) for a MoE run written as legacy rank files at EP `ep`."""
    ep = target_ep(ck, ep)
    args, saved = _args(ck), saved_ep(ck)
    experts = int(args["num_experts"])
    n = experts // ep
    if ckpt_format == "torch_dist":
        return _dist_plan_lines(args, ep, saved)
    notes = [
        f"Megatron-LM legacy layout (--ckpt-format torch, plain Adam) of a Mixture-of-Experts run at EP {ep} "
        f"(saved at EP {saved}): iter_N/{'mp_rank_00_EEE' if ep > 1 else 'mp_rank_00'}/model_optim_rng.pt per EP "
        f"rank; EP rank e holds global experts e*{n}..e*{n}+{n - 1} of each of the {args['num_layers']} layers "
        "under local ids 0..n-1, and the dense parameters (a replica per EP rank), in Megatron-core's module order",
        (
            "optimizer: Megatron's ChainedOptimizer [dense, expert], each {optimizer: {state, param_groups}, "
            "fp32_from_fp16_params}, the expert one holding exactly its EP rank's experts"
            if ep > 1
            else "optimizer: one inner optimizer (at EP 1 Megatron's param groups hold no expert-parallel "
            "parameter: each expert group joins the dense group with its hyper-parameters)"
        )
        + "; every parameter's fp32 master, exp_avg, exp_avg_sq and Adam step; opt_param_scheduler, iteration, "
        "checkpoint_version and floating-point-operation count as saved",
        f"args: carried as saved with ckpt_format=torch, use_dist_ckpt=False, expert_model_parallel_size={ep} "
        "and each file's rank / local_rank",
    ]
    not_moved = []
    if ck.format == "megatron_torch_dist":
        not_moved.append("content_metadata (common.pt): the legacy format has no such field")
    if ep != saved:
        not_moved.append(
            f"RNG at another EP: each rank file carries the RNG state of the saved EP rank that held its first "
            f"expert (EP rank e <- e x {saved} // {ep}): the Python / NumPy / torch generators and the "
            "data-, model- and expert-parallel CUDA trackers are that rank's. Relaunch with --no-load-rng for "
            "Megatron's fresh seeding instead"
        )
    return notes, not_moved


def _dist_plan_lines(args: dict, ep: int, saved: int) -> tuple[list[str], list[str]]:
    notes = [
        f"Megatron-LM torch_dist (plain Adam) of a Mixture-of-Experts run: global tensors, layers stacked on a "
        f"leading axis of {args['num_layers']}, each routed expert's on [layers, num_experts={args['num_experts']}, "
        "...] under decoder.layers.mlp.experts.experts.* by global id; the fp32 master and Adam moments alike; each "
        "expert linear's extra state per (layer, expert)",
        f"common.pt: the param groups as Megatron builds them at EP {ep} (saved at EP {saved}; "
        + (
            "{0: dense, 1: expert} inner optimizers"
            if ep > 1
            else "one optimizer, the experts in the dense groups of the same hyper-parameters"
        )
        + "), each with the common Adam step; the OptimizerParamScheduler, iteration and args as saved with "
        f"ckpt_format=torch_dist, use_dist_ckpt=True, expert_model_parallel_size={ep} (Megatron-core 0.16.1 "
        "loads a plain-Adam MoE torch_dist save only at the EP its param groups were built for)",
    ]
    not_moved = []
    if ep != saved:
        not_moved.append(
            f"RNG at another EP: rng_state for EP rank e is the saved EP rank e x {saved} // {ep}'s (Python, NumPy, "
            "torch and the CUDA trackers); relaunch with --no-load-rng for Megatron's fresh seeding instead"
        )
    else:
        notes.append("RNG: each EP rank's rng_state as rng_state/shard_0.0.E_1.1.EP, as Megatron saves it")
    return notes, not_moved


class _Source:
    """common.pt's fields (from common.pt, or from the first legacy rank file) and each saved EP rank's RNG state."""

    def __init__(self, ck):
        self.ck = ck
        if ck.format == "megatron_legacy":
            self.files = {k[2] if len(k) > 2 else 0: f for k, f in rank_files(ck).items()}
            self.common = pr.load(self.files[min(self.files)]).obj
            self.dist = None
        else:
            self.dist = _DistSource(ck)
            self.common = self.dist.common

    def rng(self, e: int, ep: int):
        if self.dist is None:
            f = self.files[e]
            rng = pr.load(f).obj.get("rng_state")
            return None if rng is None else _rng_list(rng, "rng_state", f)
        for key in (f"rng_state/shard_0.0.{e}_1.1.{ep}", "rng_state/shard_0.0_1.1"):
            if (key, None) in self.dist._items.items:
                return self.dist._rng(key)
        return None


def _model_order(module: dict, layers: int, experts: range, tied: bool, src: Path) -> list[tuple[str, str | None]]:
    """[(the legacy name in the EP rank's `model`, the logical name read, None for an extra state)] for the EP rank
    holding global `experts`, in Megatron-core's registration order; refuses a layer missing one of its experts."""
    items: list[tuple[str, str | None]] = []

    def module_items(local: str, key: str, linear: bool) -> None:
        if name_key(key + "weight") not in module:
            return
        for p in ("weight", "bias"):
            if name_key(key + p) in module:
                items.append((local + p, name_key(key + p)))
        if linear:
            items.append((local + "_extra_state", None))

    for k in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight"):
        if k in module:
            items.append((k, k))
    for i in range(layers):
        for mod in _LAYER_MODULES:
            module_items(f"decoder.layers.{i}.{mod}", f"decoder.layers.{i}.{mod}", mod in _LINEAR)
        for local, g in enumerate(experts):
            for fc in ("linear_fc1.", "linear_fc2."):
                key = f"decoder.layers.{i}.mlp.experts.local_experts.{g}.{fc}"
                if name_key(key + "weight") not in module:
                    raise _refuse(
                        f"layer {i} lacks expert {g}'s {fc}weight: every expert of every layer is written", src
                    )
                module_items(f"decoder.layers.{i}.mlp.experts.local_experts.{local}.{fc}", key, True)
    for k in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        if k in module:
            items.append((k, k))
    if not tied and "output_layer.weight" in module:
        items.append(("output_layer.weight", "output_layer.weight"))
    items.append(("output_layer._extra_state", None))
    return items


def _check_experts(names: set[str], layers: int, experts: int, src: Path) -> None:
    """Every expert of every layer (global ids 0..num_experts-1) holds its linear_fc1 and linear_fc2 weights, and
    no expert id lies beyond num_experts: the stacked torch_dist tensors tile [layers, num_experts, ...]."""
    for i in range(layers):
        for g in range(experts):
            for fc in ("linear_fc1", "linear_fc2"):
                if f"decoder.layers.{i}.mlp.experts.local_experts.{g}.{fc}.weight" not in names:
                    raise _refuse(
                        f"layer {i} lacks expert {g}'s {fc}.weight: every expert of every layer is written", src
                    )
    beyond = sorted(n for n in names if (m := _EXPERT_NAME.match(n)) and int(m[2]) >= experts)
    if beyond:
        raise _refuse(f"{beyond[0]}: an expert id beyond num_experts={experts}", src)


def rank_dirs(ep: int, iteration: int) -> list[str]:
    return [f"iter_{iteration:07d}/mp_rank_00" + (f"_{e:03d}" if ep > 1 else "") for e in range(ep)]


def write(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Write `plan` (a MoE run at EP `plan.ep`: legacy rank files, or a torch_dist run folder) into the empty folder
    `root`; returns the bytes written."""
    return (_write_legacy if plan.ckpt_format == "torch" else _write_dist)(plan, root, progress)


def _rank_args(common: dict, e: int, ep: int):
    """EP rank e's saved args: ckpt_format torch, expert_model_parallel_size `ep`, its rank."""
    a = copy.copy(common["args"])
    state = {**common["args"].state, "ckpt_format": "torch", "use_dist_ckpt": False}
    state["expert_model_parallel_size"] = ep
    for k in ("rank", "local_rank"):
        if k in state:
            state[k] = e  # Megatron's rank order tp-cp-ep-dp-pp at TP 1: EP rank e, expert-DP rank 0
    a.state = state
    return a


def _rank_model(
    plan, rec: _Records, module: dict, order: list, params: dict, group_of: dict, placed: set[str]
) -> tuple[collections.OrderedDict, list[list[str]]]:
    """An EP rank's `model` in `order` (`_model_order`), each tensor recorded to be read when written (what it
    places goes into `placed`); returns it with the names of each param group's parameters on this rank."""
    import torch  # lazy: torch only when tensors are written; write/ stays torch-free at import

    m: collections.OrderedDict = collections.OrderedDict()
    members: list[list[str]] = [[] for _ in plan.groups]
    for local, key in order:
        if key is None:
            m[local] = None
            continue
        node = module[key]
        like = torch.empty(node.shape, dtype=L.torch_dtype(node.dtype), device="meta")
        m[local] = rec.made(like, lambda node=node: node.read())
        placed.add(key)
        if key in params and params[key].states:
            if key not in group_of:
                raise UnsupportedCheckpoint(f"{key}: in no param group", path=plan.source)
            members[group_of[key]].append(key)
    return m, members


def _inner_optimizer(plan, rec: _Records, params: dict, members: list[list[str]], gids: list[int]) -> dict:
    """One inner optimizer of an EP rank (the param groups `gids`): Adam's state per parameter id, the param
    groups, and the fp32 masters, each recorded to be read when written."""
    import torch  # lazy: torch only when tensors are written; write/ stays torch-free at import

    state_out: dict[int, Any] = {}
    groups, masters = [], []
    for gi in gids:
        ids = []
        for key in members[gi]:
            p = params[key]
            if p.step is None:
                raise UnsupportedCheckpoint(f"{key}: no Adam step in the source", path=plan.source)
            s: dict[str, Any] = {"step": rec.add(torch.tensor(float(p.step), dtype=torch.float32))}
            for k in ("exp_avg", "exp_avg_sq"):
                node = p.states[k]
                like = torch.empty(node.shape, dtype=torch.float32, device="meta")
                s[k] = rec.made(like, lambda node=node: node.read(torch.float32))
            ids.append(len(state_out))
            state_out[len(state_out)] = s
        g = plan.groups[gi]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        row = []
        for key in members[gi]:
            w = params[key].weight
            like = torch.empty(w.shape, dtype=torch.float32, device="meta")
            row.append(rec.made(like, lambda w=w: w.read(torch.float32)))
        masters.append(row)
    return {"optimizer": {"state": state_out, "param_groups": groups}, "fp32_from_fp16_params": masters}


def _write_legacy(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Legacy rank files: every module tensor of the source placed on its EP rank(s), or refused naming it."""
    ck = L.open_any(plan.source)
    args = _args(ck)
    ep, layers, experts = plan.ep, int(args["num_layers"]), int(args["num_experts"])
    per = experts // ep
    tied = not args.get("untie_embeddings_and_output_weights")
    src = _Source(ck)
    common = src.common
    module = {name_key(t.name): t for t in L.model_tensors(ck, weights="module")}
    _check_experts(set(module), layers, experts, plan.source)
    params = {name_key(p.name): p for p in plan.params}
    group_of = {name_key(n): gi for gi, g in enumerate(plan.groups) for n in g["params"]}
    placed: set[str] = set()
    iteration = int(common["iteration"])
    written = 0
    for e, rel in enumerate(rank_dirs(ep, iteration)):
        rec = _Records()
        obj: dict[str, Any] = {
            "args": _rank_args(common, e, ep),
            "checkpoint_version": common["checkpoint_version"],
            "iteration": common["iteration"],
        }
        order = _model_order(module, layers, range(e * per, (e + 1) * per), tied, plan.source)
        obj["model"], members = _rank_model(plan, rec, module, order, params, group_of, placed)
        dense = [gi for gi, g in enumerate(plan.groups) if not g.get("is_expert_parallel")]
        expert = [gi for gi, g in enumerate(plan.groups) if g.get("is_expert_parallel")]
        obj["optimizer"] = (
            [_inner_optimizer(plan, rec, params, members, dense), _inner_optimizer(plan, rec, params, members, expert)]
            if expert
            else _inner_optimizer(plan, rec, params, members, dense)
        )
        obj["opt_param_scheduler"] = common["opt_param_scheduler"]
        rng = src.rng(e * saved_ep(ck) // ep, saved_ep(ck))
        if rng is not None:
            obj["rng_state"] = rec.tree(rng)
        obj["num_floating_point_operations_so_far"] = common.get("num_floating_point_operations_so_far")
        d = root / rel
        d.mkdir(parents=True)
        written += save(obj, d / "model_optim_rng.pt", rec.data)
        if progress:
            progress(plan.nbytes * (e + 1) // ep - plan.nbytes * e // ep)
    left = sorted(set(module) - placed)
    if left:
        raise UnsupportedCheckpoint(
            f"{len(left)} model tensor(s) of the source have no place in Megatron's MoE layer layout: "
            f"{', '.join(left[:3])}",
            path=plan.source,
        )
    (root / LATEST).write_text(str(iteration))
    return written


_EXPERT_NAME = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def _dist_key(name: str, layers: int) -> tuple[str, tuple[int, ...]]:
    """(the torch_dist key, its leading offsets) of a logical parameter name: an expert's stacked [layers, experts,
    ...] as Megatron's SequentialMLP shards it, a layer's [layers, ...], else the whole tensor."""
    m = _EXPERT_NAME.match(name_key(name))
    if m:
        return f"decoder.layers.mlp.experts.experts.{m[3]}", (int(m[1]), int(m[2]))
    key, layer = dist_key(name, layers)
    return key, () if layer is None else (layer,)


def _common_step(plan, src: Path):
    """The one Adam step every parameter holds (torch_dist keeps one per inner optimizer, `common_step`)."""
    steps = {p.step for p in plan.params if p.states}
    if len(steps) != 1 or None in steps:
        raise UnsupportedCheckpoint(
            f"Adam steps {sorted(map(str, steps))} across parameters: torch_dist keeps one", path=src
        )
    return steps.pop()


def _write_params(w, plan, module: dict, layers: int, experts: int, progress: Callable[[int], None] | None) -> None:
    """Every parameter (and its fp32 master and Adam moments) as its torch_dist key's part: an expert's at its
    (layer, expert) of the stacked tensor, a layer's at its layer, else whole; each read when written."""
    for i, p in enumerate(plan.params):
        key, lead = _dist_key(p.name, layers)
        tensors = [(key, module[p.name])]
        if p.states:
            tensors.append((f"optimizer.state.fp32_param.{key}", p.weight))
            tensors += [(f"optimizer.state.{k}.{key}", t) for k, t in sorted(p.states.items())]
        for k, t in tensors:
            shape = (1,) * len(lead) + tuple(t.shape)
            part = LazyPart(
                shape, L.torch_dtype(t.dtype), lambda t=t, shape=shape: t.read().reshape(shape), f"param{i}"
            )
            size = (layers, experts)[: len(lead)] + tuple(t.shape)
            w.tensor_part((k,), size, lead + (0,) * len(t.shape), part)
        if progress:
            progress(p.nbytes)


def _write_extra_and_rng(w, src: _Source, layers: int, experts: int, ep: int, saved: int) -> None:
    """Every linear's extra state per layer (and per expert), and each EP rank's RNG state (from the legacy rank
    file of the saved EP rank it continues)."""
    for rest in ("self_attention.linear_proj", "self_attention.linear_qkv"):
        for i in range(layers):
            w.value((f"decoder.layers.{rest}._extra_state/shard_{i}_{layers}",), [None])
    for fc in ("linear_fc1", "linear_fc2"):
        for i in range(layers):
            for g in range(experts):
                w.value(
                    (f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{g}_{layers}.{experts}",),
                    [None],
                )
    for e in range(ep):
        s = e * saved // ep
        if src.dist is None and s in src.files:
            rng = pr.load(src.files[s]).obj.get("rng_state")
            if rng is not None:
                key = f"rng_state/shard_0.0.{e}_1.1.{ep}" if ep > 1 else "rng_state/shard_0.0_1.1"
                w.value_blob((key,), _zip_bytes(src.files[s], [_rng_list(rng, "rng_state", src.files[s])]))


def _dist_common(plan, obj0: dict, ep: int) -> dict:
    """common.pt's tree: the args at EP `ep` (torch_dist), the inner optimizers' param groups (`{0: dense,
    1: expert}`; EP 1: one) with the common Adam step (refused when the rank file's differs), the scheduler."""
    step = _common_step(plan, plan.source)
    opt0 = obj0["optimizer"][0] if isinstance(obj0["optimizer"], list) else obj0["optimizer"]
    step_ref = next(iter(opt0["optimizer"]["state"].values()))["step"]  # a TensorRef of the source file
    if float(step_ref.read_torch().item()) != step:
        raise UnsupportedCheckpoint(f"the rank file's Adam step is not the parameters' ({step})", path=plan.source)
    a = copy.copy(obj0["args"])
    a.state = {
        **obj0["args"].state,
        "ckpt_format": "torch_dist",
        "use_dist_ckpt": True,
        "expert_model_parallel_size": ep,
    }

    def inner(expert_side: bool) -> dict:
        groups = [
            {k: v for k, v in g.items() if k != "params"}
            for g in plan.groups
            if bool(g.get("is_expert_parallel")) == expert_side
        ]
        return {"optimizer": {"state": {"common_step": step_ref}, "param_groups": groups}}

    return {
        "args": a,
        "checkpoint_version": obj0["checkpoint_version"],
        "iteration": obj0["iteration"],
        "optimizer": {0: inner(False), 1: inner(True)} if ep > 1 else inner(False),
        "opt_param_scheduler": obj0["opt_param_scheduler"],
        "num_floating_point_operations_so_far": obj0.get("num_floating_point_operations_so_far"),
        "content_metadata": dict(CONTENT_METADATA),
    }


def _write_dist(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """A torch_dist run folder of a legacy MoE run, as Megatron core_v0.16.1's torch_dist save writes it: the experts
    stacked `[layers, num_experts, ...]` under `decoder.layers.mlp.experts.experts.*` (global ids), every expert
    linear's extra state per (layer, expert), each EP rank's RNG state `rng_state/shard_0.0.E_1.1.EP`, and common.pt
    with the inner optimizers' param groups at EP `plan.ep` (`{0: dense, 1: expert}`; EP 1: one) and their common
    Adam step."""
    ck = L.open_any(plan.source)
    args = _args(ck)
    ep, saved, layers, experts = plan.ep, saved_ep(ck), int(args["num_layers"]), int(args["num_experts"])
    src = _Source(ck)
    obj0 = src.common
    iteration = int(obj0["iteration"])
    it = root / f"iter_{iteration:07d}"
    module = {t.name: t for t in L.model_tensors(ck, weights="module")}
    _check_experts({L.name_key(n) for n in module}, layers, experts, plan.source)
    w = DcpStreamWriter(it, checkpoint_id=str(plan.out / it.name), shards=2, save_id=plan_save_id(plan))
    try:
        _write_params(w, plan, module, layers, experts, progress)
        _write_extra_and_rng(w, src, layers, experts, ep, saved)
    except BaseException:
        w.abort()
        raise
    w.close()
    common = _dist_common(plan, obj0, ep)
    first = src.files[min(src.files)]
    rewrite_torch_zip(first, it / "common.pt", common, prune=True)
    (it / "metadata.json").write_text(json.dumps(DIST_META))
    (root / LATEST).write_text(str(iteration))
    return w.bytes_written + (it / "common.pt").stat().st_size
