"""Write a Megatron-LM torch_dist run folder (`ckpt convert SRC OUT --to megatron`), as Megatron-LM core_v0.16.1's
`save_checkpoint` lays it out for plain Adam (the distributed optimizer: `_write_distopt_buffers`, its dp_reshardable
buckets), from a Megatron-LM legacy checkpoint (from a Megatron-DeepSpeed pipeline checkpoint: `ops.megatron_in`,
with the same three entries).

    OUT/latest_checkpointed_iteration.txt     the iteration
    OUT/iter_{N:07d}/.metadata, __R_0.distcp  a torch DCP of GLOBAL tensors (TP shards and pipeline stages merged):
        <param>                               the module's weights as saved (bf16), `decoder.layers.<rest>` stacked
                                              on a leading layer axis (layer i: the chunk at (i, 0, ...)), the
                                              local layer norms under the fused names dist-checkpointing gives them
                                              (`logical.MEGATRON_FUSED_NORMS`)
        optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.<param>   Adam's moments and the fp32 master
        decoder.layers.<linear>._extra_state/shard_{i}_{L}        each layer's linear extra state ([None] for
                                              Megatron's local modules: what it saves, what it asks for at load)
        rng_state/shard_{pp}.{tp}_{PP}.{TP}   each rank file's RNG state, as saved (Megatron loads it when resumed
                                              at the saved TP x PP and ignores it at another)
    OUT/iter_{N:07d}/common.pt                iteration, args, checkpoint_version, the optimizer's param groups and
                                              common Adam step (`optimizer.optimizer.state.common_step`),
                                              opt_param_scheduler, num_floating_point_operations_so_far,
                                              content_metadata
    OUT/iter_{N:07d}/metadata.json            {"sharded_backend": "torch_dist", ...}

Every key, global shape and dtype is the one Megatron's own torch_dist save of the same run holds (the samples
megatron_*_legacy / megatron_*_torch_dist are one run saved both ways; tests compare them). Megatron reshards
torch_dist at load, so the output resumes at any TP / PP.

Nothing from the source is unpickled: common.pt and the RNG items are the source's own inert trees (args Namespace,
scheduler, RNG state) written back by `pickle_writer` with only the storages they use; the tensors are read through
the logical view. The args change in two fields only, what Megatron's own `--ckpt-convert-format torch_dist` save
would record: `ckpt_format` torch_dist and `use_dist_ckpt` True.

The other direction (`--ckpt-format torch`, `_write_legacy`): a torch_dist run (plain Adam) as the legacy run folder
Megatron's `--ckpt-format torch` save writes, `iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt` per rank
(args, checkpoint_version, iteration, model / model0.., optimizer {optimizer {state, param_groups},
fp32_from_fp16_params}, opt_param_scheduler, rng_state, num_floating_point_operations_so_far), at the saved TP x PP
or another (`plan.tp`, `plan.pp`): each whole tensor split by Megatron's TP rules (`_tp_shard`, the inverse of
`formats.megatron_lm._rule`), the layers cut into equal stages (`_stage_layout`). The module order of each rank's
`model` is Megatron-core's registration order (`_MODULES`; a plain torch_dist .metadata lists them so too); param
groups list this rank's parameters in that order, chunk after chunk, numbered group after group as torch's
Optimizer.state_dict numbers them. Equal, file for file, to Megatron's own legacy save of the same run (the samples),
but for the args' run folders. The source is a torch_dist save (`_DistSource`) or legacy rank files at another TP / PP
(`_LegacySource`: one step, no torch_dist copy); a distributed-optimizer torch_dist save gets `distrib_optim.pt`
beside each rank file (`_write_distrib_optim`).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedCheckpoint

SOURCE_FORMATS = ("megatron_legacy",)
LATEST = "latest_checkpointed_iteration.txt"
DIST_META = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
#: what Megatron core_v0.16.1 records in common.pt about how the sharded state dict was built (plain optimizer)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _check_dist_target(ck, src: Path) -> None:
    """Refuse, in one line naming what is missing, a source this writer cannot turn into a loadable Megatron run."""
    if ck.format == "megatron_torch_dist":
        raise UnsupportedCheckpoint(
            "the checkpoint is already a Megatron-LM torch_dist checkpoint: nothing to convert "
            "(Megatron reshards it at load: resume it at any TP / PP)",
            path=src,
            hint="--ckpt-format torch writes it as legacy rank files, --tp N at another TP",
        )
    if ck.format not in SOURCE_FORMATS:
        raise UnsupportedCheckpoint(
            f"--to megatron needs a Megatron-LM legacy checkpoint (or a Megatron-DeepSpeed pipeline one); this is "
            f"{ck.format}, which holds no Megatron "
            "`args` (the GPT architecture, parallel sizes and schedule Megatron's load_checkpoint rebuilds the run "
            "from), no OptimizerParamScheduler state and no Megatron-core parameter names",
            path=src,
            hint="convert a checkpoint Megatron-LM saved (--ckpt-format torch); other frameworks: --to dcp / torch",
        )
    if _args(ck).get("use_distributed_optimizer"):
        _check_distopt_source(ck, src)
        return
    _check_plain_adam(
        ck, src, "--to megatron", "writes the plain Adam layout", "torch_dist layout (flat bucket buffers)"
    )


def _check_distopt_dist_source(ck, src: Path, tp: int | None, pp: int | None) -> None:
    """Refuse, in one line, a distributed-optimizer torch_dist run ckpt cannot write as legacy rank files with
    distrib_optim.pt: the saved sizes, no virtual pipeline, dp_reshardable buckets (joined per buffer)."""
    saved, saved_pp = ck.topology.tp or 1, ck.topology.pp or 1
    if ck.format != "megatron_torch_dist" or (tp or saved, pp or saved_pp) != (saved, saved_pp) or ck.topology.vpp:
        raise UnsupportedCheckpoint(
            f"a distributed-optimizer run at TP {saved} x PP {saved_pp} (to TP {tp or saved} "
            f"x PP {pp or saved_pp}): ckpt writes its legacy distrib_optim.pt from a torch_dist "
            "save at the saved TP and PP, without a virtual pipeline (each rank's buffers are "
            "Megatron's own, not re-cut)",
            path=src,
        )
    from ..read import pickle_reader as pr

    common = pr.load(_dist_iter(ck) / "common.pt").obj
    kind = (common.get("optimizer") or {}).get("param_state_sharding_type")
    if kind != "dp_reshardable":
        raise UnsupportedCheckpoint(
            f"the distributed optimizer's state is saved {kind!r}: ckpt writes the "
            "dp_reshardable buckets into distrib_optim.pt",
            path=src,
        )
    args = _args(ck)
    if not (args.get("bf16") or args.get("fp16")):
        raise UnsupportedCheckpoint(
            "--ckpt-format torch is proven for bf16/fp16 runs; this run trained in fp32", path=src
        )
    domains = {d for d, *_ in _distopt_buckets(ck)}
    if domains != set(range(saved * saved_pp)):  # one distrib_optim.pt per rank file: none may be left behind
        raise UnsupportedCheckpoint(
            f"the distributed optimizer's buckets name model-parallel domains "
            f"{sorted(domains)}, not the {saved * saved_pp} rank files of TP {saved} x PP "
            f"{saved_pp}: ckpt would leave some behind",
            path=src,
        )


def _check_distopt_source(ck, src: Path) -> None:
    """Refuse, in one line, a distributed-optimizer legacy run whose buffers ckpt cannot lay out as Megatron's
    dp_reshardable torch_dist save: the buckets Megatron makes without overlap_grad_reduce (one per buffer, plus the
    shared embedding's own with PP > 1 and tied embeddings: `distopt_layout`; the legacy file coalesces buckets
    without their boundaries, so no others), no virtual pipeline, no multi-token prediction, bf16 / fp16."""
    args = _args(ck)
    if not (args.get("bf16") or args.get("fp16")):
        raise UnsupportedCheckpoint(
            "--to megatron is proven for bf16/fp16 runs (an fp32 master in the buffers); this run trained in fp32",
            path=src,
        )
    if (
        ck.topology.vpp
        or args.get("num_layers_per_virtual_pipeline_stage")
        or args.get("virtual_pipeline_model_parallel_size")
    ):
        raise UnsupportedCheckpoint(
            "a distributed-optimizer run with a virtual pipeline: its buffers (one per model "
            "chunk) are not laid out by ckpt",
            path=src,
        )
    if args.get("mtp_num_layers"):
        raise UnsupportedCheckpoint(
            "a distributed-optimizer run with multi-token prediction: its shared embedding "
            "buckets are not laid out by ckpt",
            path=src,
        )
    if args.get("overlap_grad_reduce") or args.get("ddp_num_buckets"):
        raise UnsupportedCheckpoint(
            "the run split its gradient buffers into several buckets (overlap_grad_reduce / "
            "ddp_num_buckets): distrib_optim.pt coalesces them without their boundaries, "
            "which the torch_dist layout keys bucket by bucket",
            path=src,
        )
    if args.get("num_distributed_optimizer_instances", 1) not in (1, None):
        raise UnsupportedCheckpoint("several distributed-optimizer instances: not handled", path=src)
    for f in rank_files(ck).values():
        if not (f.parent / "distrib_optim.pt").is_file():
            raise UnsupportedCheckpoint(
                "no distrib_optim.pt beside the rank file: the distributed optimizer's state is missing", path=f.parent
            )


def _check_plain_adam(ck, src: Path, flag: str, writes: str, distopt_layout: str) -> None:
    """Refuse, in one line, what neither writer carries: the distributed optimizer, an fp32 run (no Float16
    optimizer with an fp32 master), a checkpoint without per-parameter Adam state."""
    args = _args(ck)
    if args.get("use_distributed_optimizer"):
        raise UnsupportedCheckpoint(
            f"{flag} {writes}; this run used Megatron's distributed optimizer "
            f"(args.use_distributed_optimizer), whose {distopt_layout} ckpt does not write",
            path=src,
        )
    if not (args.get("bf16") or args.get("fp16")):
        raise UnsupportedCheckpoint(
            f"{flag} is proven for bf16/fp16 runs (Float16 optimizer with an fp32 master); this run trained in fp32",
            path=src,
        )
    if ck.tree.children.get("optimizer") is None or "state" not in ck.tree.children["optimizer"].children:
        raise UnsupportedCheckpoint("the checkpoint holds no per-parameter Adam state to write", path=src)


def _args(ck) -> dict[str, Any]:
    from ..read.tree import node_to_python

    node = ck.tree.children.get("args")
    val = node_to_python(node) if node is not None else None
    return val if isinstance(val, dict) else {}


def rank_files(ck) -> dict[tuple[int, ...], Path]:
    """{(tp, pp): the rank's model_optim_rng.pt} of a legacy checkpoint; {(tp, pp, ep): …} for a Mixture-of-Experts
    one at expert parallel EP > 1 (folders `mp_rank_TT_EEE`, PP 1), which the writers here refuse before asking."""
    root = Path(ck.path)
    return {
        (f.rank["tp"], f.rank.get("pp", 0), *((f.rank["ep"],) if "ep" in f.rank else ())): root / f.path
        for f in ck.files
        if f.role == "model" and f.path.endswith("model_optim_rng.pt")
    }


def dist_key(name: str, layers: int) -> tuple[str, int | None]:
    """(the torch_dist key, the layer index or None) of a logical parameter name."""
    from ..view.logical import name_key

    name = name_key(name)
    m = _LAYER.match(name)
    if m is None:
        return name, None
    if int(m[1]) >= layers:
        raise UnsupportedCheckpoint(f"{name}: layer {m[1]} beyond args.num_layers={layers}")
    return f"decoder.layers.{m[2]}", int(m[1])


def _dist_plan_lines(ck) -> tuple[list[str], list[str]]:
    """(notes, not moved) for a conversion of `ck` into Megatron's torch_dist."""
    args = _args(ck)
    tp, pp = ck.topology.tp or 1, ck.topology.pp or 1
    if args.get("use_distributed_optimizer"):
        dp = args.get("data_parallel_size")
        notes = [
            f"Megatron-LM torch_dist with the distributed optimizer (dp_reshardable, as Megatron's own save of "
            f"it): the model's global tensors, layers stacked on a leading axis of {args.get('num_layers')}; "
            f"Megatron reshards the optimizer's buckets over another DP size at load, not over another TP / PP "
            f"(saved at TP {tp} x PP {pp} x DP {dp})",
            "optimizer: distrib_optim.pt's fp32 master / exp_avg / exp_avg_sq buffers as one bucket tensor each "
            "(optimizer.distributed.dp_group_idx_D.gbuf_idx_G.dtype_(...).bucket_idx_0.*, D the rank file's "
            "model-parallel rank), cut at every "
            "parameter's range and DP share as Megatron cuts them; per_bucket_numel(_unpadded); the inner "
            "optimizer's param groups (with the step) as saved; the OptimizerParamScheduler state in common.pt",
            "proof: Megatron-LM cannot load a distributed-optimizer checkpoint on a CPU (without Apex / "
            "TransformerEngine), so ckpt has not resumed such an output; on its sample it equals Megatron's "
            "own dp_reshardable save of the same run key for key, chunk for chunk, bit for bit",
        ]
    else:
        notes = [
            f"Megatron-LM torch_dist (plain Adam): global tensors, layers stacked on a leading axis of "
            f"{args.get('num_layers')}; Megatron reshards them at load, so it resumes at any TP / PP (saved at "
            f"TP {tp} x PP {pp})",
            "weights: the module's weights as saved (bf16) and the fp32 master as optimizer.state.fp32_param; "
            "Adam's exp_avg / exp_avg_sq; the common Adam step, param groups and the OptimizerParamScheduler "
            "state in common.pt, as saved",
        ]
    notes += [
        "args: carried as saved, with ckpt_format=torch_dist and use_dist_ckpt=True (what Megatron's own "
        "torch_dist save of the run records)",
        f"RNG: each rank file's rng_state as the sharded object rng_state/shard_{{pp}}.{{tp}}_{pp}.{tp}: "
        "Megatron loads it when resumed at the saved TP x PP and ignores it at another (no flag needed)",
    ]
    not_moved: list[str] = []
    if ck.tree.children.get("tied_copies") is not None:
        not_moved.append(
            "tied_copies: the last pipeline stage's copy of the word embeddings; torch_dist saves the "
            "tied weight once and Megatron re-makes the copy at load"
        )
    return notes, not_moved


def _write_dist(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Write the run folder for `plan` (a `ops.convert.ConvertPlan` with to="megatron") into the empty folder `root`
    (the staging folder `ops.convert.execute` renames into place); returns the bytes written."""
    from .dcp_write import DcpStreamWriter

    w, tail = _dist_items(plan, root, DcpStreamWriter, progress)
    w.close()
    return w.bytes_written + tail(root)


def plan_dist(plan, root: Path):
    """(a `dcp_write.PlannedDcpWriter` holding the items `_write_dist` writes, in its order, each parameter's
    tensor chunks of unit `param<i>` (the plan's index), each chunk of a distributed optimizer's buffers a unit of
    its own (`<bucket key>.<state>@<first element>`); what writes the rest of the run folder into `root`): a
    torchrun job's plan."""
    from .dcp_write import PlannedDcpWriter

    return _dist_items(plan, root, PlannedDcpWriter, None)


def _dist_items(plan, root: Path, writer, progress: Callable[[int], None] | None):
    """The DCP items of the run folder, written (or planned) through `writer(folder, checkpoint_id, shards,
    save_id)`; returns (the writer, not closed; tail(root) -> bytes: common.pt, metadata.json, the iteration)."""
    from ..view import logical as L
    from ..read import pickle_reader as pr
    from .dcp_write import lazy_part, plan_save_id

    ck = L.open_any(plan.source)
    args = _args(ck)
    layers = int(args.get("num_layers") or 0)
    tp, pp = ck.topology.tp or 1, ck.topology.pp or 1
    ranks = rank_files(ck)
    obj0 = pr.load(ranks[min(ranks)]).obj
    iteration = int(obj0["iteration"])
    it = root / f"iter_{iteration:07d}"
    module = {t.name: t for t in L.model_tensors(ck, weights="module")}
    distopt = bool(args.get("use_distributed_optimizer"))
    w = writer(it, checkpoint_id=str(plan.out / it.name), shards=2, save_id=plan_save_id(plan))
    try:
        for i, p in enumerate(plan.params):
            if p.kind == "tied":
                continue
            key, layer = dist_key(p.name, layers)
            unit = f"param{i}"
            tensors = [(key, module[p.name])]
            if p.states and not distopt:  # the distributed optimizer's state: its buffers, below
                tensors.append((f"optimizer.state.fp32_param.{key}", p.weight))
                tensors += [(f"optimizer.state.{k}.{key}", t) for k, t in sorted(p.states.items())]
            for k, t in tensors:
                part = lazy_part(t, unit=unit, layer=layer is not None)
                if layer is None:
                    w.tensor_part((k,), tuple(t.shape), (0,) * len(t.shape), part)
                else:
                    w.tensor_part((k,), (layers, *t.shape), (layer,) + (0,) * len(t.shape), part)
            if progress:
                progress(p.nbytes)
        for rest in _extra_states(obj0):
            for i in range(layers):
                w.value((f"decoder.layers.{rest}._extra_state/shard_{i}_{layers}",), [None])
        for (t, s), f in sorted(ranks.items()):
            obj = obj0 if f == ranks[min(ranks)] else pr.load(f).obj
            if distopt:  # Megatron's data-parallel group index: the rank in the model-parallel group, tp + TP x pp
                _write_distopt_buffers(w, f, obj, args, t + tp * s)
            rng = obj.get("rng_state")
            if rng is not None:  # a run saved with --no-save-rng has none, and its args tell Megatron so
                w.value_blob((f"rng_state/shard_{s}.{t}_{pp}.{tp}",), _zip_bytes(f, [rng]))
    except BaseException:
        w.abort()
        raise

    def tail(root: Path) -> int:
        it = root / f"iter_{iteration:07d}"
        _write_common(ranks[min(ranks)], obj0, plan, it / "common.pt")
        (it / "metadata.json").write_text(json.dumps(DIST_META))
        (root / LATEST).write_text(str(iteration))
        return (it / "common.pt").stat().st_size

    return w, tail


#: elements read and written at a time from a distributed-optimizer buffer (4 MiB of fp32)
_BUFFER_CHUNK = 1 << 20


def _write_distopt_buffers(w, rank_file: Path, obj: dict, args: dict[str, Any], domain: int) -> None:
    """The distributed optimizer's state as Megatron core_v0.16.1's dp_reshardable torch_dist save holds it
    (`DistributedOptimizer.sharded_param_state_dp_reshardable`): per buffer, dtype and bucket, the bucket's fp32
    master / exp_avg / exp_avg_sq as one global tensor of the bucket's unpadded length
    (`optimizer.distributed.dp_group_idx_D.gbuf_idx_G.dtype_(P, M).bucket_idx_B.<state>`), `per_bucket_numel`
    (padded as Megatron pads a bucket: to lcm(DP, 128), or with 2**16 under ddp_pad_buckets_for_high_nccl_busbw),
    `per_bucket_numel_unpadded`, and the inner optimizer's param groups (the step is in them). Read from
    distrib_optim.pt (`buckets_coalesced`: each bucket's world tensor cut to its unpadded length, joined) a chunk at a
    time, cut into buckets by Megatron's layout (`formats.megatron_lm.distopt_layout`: one bucket, or with PP > 1
    and tied embeddings the shared embedding's own). As in Megatron's save, each parameter's range is its own chunk
    (and so is each DP rank's share), which is how a reader finds the parameters in the bucket again. `obj`: the rank
    file's inert tree; `domain`: its model-parallel rank, Megatron's DP-group index in the keys."""
    import math

    import torch

    from ..read import pickle_reader as pr
    from .dcp_write import LazyPart

    dist = pr.load(rank_file.parent / "distrib_optim.pt").obj
    if not isinstance(dist, dict) or dist.get("buckets_coalesced") is not True:
        raise UnsupportedCheckpoint(
            "distrib_optim.pt does not say buckets_coalesced: an older layout ckpt does not write as torch_dist",
            path=rank_file.parent / "distrib_optim.pt",
        )
    unknown = [k for k in dist if k != "buckets_coalesced" and not isinstance(k, int)]
    unknown += [
        f"{g}.{dk}.{k}"
        for g, v in dist.items()
        if isinstance(g, int)
        for dk, e in v.items()
        for k in e
        if k not in ("param", "exp_avg", "exp_avg_sq", "numel_unpadded")
    ]
    if unknown:  # another optimizer's state (not Adam) or a newer layout: it would be left behind
        raise UnsupportedCheckpoint(
            f"distrib_optim.pt holds {', '.join(map(str, unknown[:4]))}, which ckpt does "
            "not write into the torch_dist buckets",
            path=rank_file.parent / "distrib_optim.pt",
        )
    from ..formats.megatron_lm import distopt_layout

    dp = int(args.get("data_parallel_size") or 1)
    divisor = math.lcm(dp, 128, 2**16) if args.get("ddp_pad_buckets_for_high_nccl_busbw") else math.lcm(dp, 128)
    prefix = f"optimizer.distributed.dp_group_idx_{domain}"
    model = {k: v for k, v in (obj.get("model") or {}).items() if isinstance(v, pr.TensorRef)}
    numel: list[dict] = []
    unpadded: list[dict] = []
    for g in sorted(k for k in dist if isinstance(k, int)):
        padded_g, unpadded_g = {}, {}
        for dkey, entry in dist[g].items():
            n = int(entry["numel_unpadded"])
            names = [k for k, v in model.items() if v.dtype == repr(dkey[0]).replace("torch.", "")]
            where, sizes = distopt_layout(names, {k: model[k].numel for k in names}, args)
            if sum(sizes) != n:
                raise UnsupportedCheckpoint(
                    f"distrib_optim.pt buffer {g} {dkey}: {n} elements, not the {sum(sizes)} "
                    "its parameters take in Megatron's bucket layout",
                    path=rank_file.parent,
                )
            start, padded_sizes = 0, [-(-nb // divisor) * divisor for nb in sizes]
            for b, (nb, padded) in enumerate(zip(sizes, padded_sizes)):  # each bucket its own global tensor
                bucket = f"{prefix}.gbuf_idx_{g}.dtype_({dkey[0]!r}, {dkey[1]!r}).bucket_idx_{b}"
                bounds = {0, nb} | {k * (padded // dp) for k in range(dp) if k * (padded // dp) < nb}
                for name in names:  # each parameter's range is its own chunk
                    bounds |= {
                        x - start for x in (where[name], where[name] + model[name].numel) if start < x < start + nb
                    }
                edges = sorted(bounds)
                cuts = [x for a, c in zip(edges, edges[1:]) for x in range(a, c, _BUFFER_CHUNK)] + [nb]
                for state in ("param", "exp_avg", "exp_avg_sq"):
                    ref = entry[state]
                    if tuple(ref.shape) != (n,):
                        raise UnsupportedCheckpoint(
                            f"distrib_optim.pt buffer {g} {dkey} {state}: "
                            f"{tuple(ref.shape)} elements, not its numel_unpadded {n}",
                            path=rank_file.parent,
                        )
                    for a, c in zip(cuts, cuts[1:]):
                        part = LazyPart(
                            (c - a,),
                            getattr(torch, ref.dtype),
                            lambda ref=ref, at=start + a, k=c - a: ref.read_torch(at, k),
                            f"{bucket}.{state}@{a}",  # a job's unit: each chunk, balanced with the parameters
                        )
                        w.tensor_part((f"{bucket}.{state}",), (nb,), (a,), part)
                start += nb
            dtypes = tuple(getattr(torch, repr(x).rsplit(".", 1)[-1]) for x in dkey)
            padded_g[dtypes], unpadded_g[dtypes] = padded_sizes, list(sizes)
        numel.append(padded_g)
        unpadded.append(unpadded_g)
    w.value((f"{prefix}.per_bucket_numel/shard_0_1",), [numel])
    w.value((f"{prefix}.per_bucket_numel_unpadded/shard_0_1",), [unpadded])
    w.value_blob((f"{prefix}.optimizer/shard_0_1",), _zip_bytes(rank_file, [obj["optimizer"]["optimizer"]]))


def _extra_states(obj0: dict) -> list[str]:
    """The layer modules whose `_extra_state` the rank file saves (`self_attention.linear_qkv`, ...): Megatron's
    local modules save None, which torch_dist stores per layer and asks for at load. Anything else (Transformer
    Engine's FP8 metadata) is refused: ckpt does not move it."""
    out: list[str] = []
    chunks = [v for k, v in obj0.items() if isinstance(k, str) and re.fullmatch(r"model\d*", k) and isinstance(v, dict)]
    for k, v in ((k, v) for m in chunks for k, v in m.items()):  # a virtual pipeline: model0, model1, ...
        m = _LAYER.match(str(k))
        if m is None or not m[2].endswith("._extra_state"):
            continue
        if v is not None:
            raise UnsupportedCheckpoint(
                f"{k}: a module extra state that is not None (Transformer Engine FP8 "
                "metadata?): ckpt does not carry it into torch_dist"
            )
        rest = m[2][: -len("._extra_state")]
        if rest not in out:
            out.append(rest)
    return out


def _zip_bytes(src: Path, obj: Any) -> bytes:
    """torch.save bytes of `obj`, a part of the inert tree read from `src` (its storages copied from there)."""
    from .pickle_writer import rewrite_torch_zip

    fd, tmp = tempfile.mkstemp(prefix="ckpt-megatron-", suffix=".pt")  # outside the checkpoint being written
    os.close(fd)
    try:
        rewrite_torch_zip(src, tmp, obj, prune=True)
        return Path(tmp).read_bytes()
    finally:
        os.unlink(tmp)


def _write_common(src: Path, obj0: dict, plan, dst: Path) -> None:
    """common.pt from rank 0's inert tree: what Megatron's torch_dist save keeps outside the DCP."""
    import copy

    from .pickle_writer import rewrite_torch_zip

    args = copy.copy(obj0["args"])
    args.state = {**obj0["args"].state, "ckpt_format": "torch_dist", "use_dist_ckpt": True}
    if args.state.get("use_distributed_optimizer"):  # the step is in the buffers' param groups (the DCP)
        common = {
            "args": args,
            "checkpoint_version": obj0["checkpoint_version"],
            "iteration": obj0["iteration"],
            "optimizer": {"param_state_sharding_type": "dp_reshardable"},
            "opt_param_scheduler": obj0["opt_param_scheduler"],
            "num_floating_point_operations_so_far": obj0.get("num_floating_point_operations_so_far"),
            "content_metadata": {"distrib_optim_sharding_type": "dp_reshardable", **CONTENT_METADATA},
        }
    else:
        common = _common_of_rank_file(src, obj0)
        common.update(args=args, content_metadata=dict(CONTENT_METADATA))
    rewrite_torch_zip(src, dst, common, prune=True)


def _common_of_rank_file(src: Path, obj0: dict) -> dict:
    """What a torch_dist common.pt holds, taken from a legacy rank file's inert tree `obj0`: args (as saved),
    checkpoint_version, iteration, the param groups without their ids, the one common Adam step (refused when
    the parameters' steps differ), opt_param_scheduler, num_floating_point_operations_so_far."""
    from ..read.pickle_reader import TensorRef

    opt = obj0["optimizer"]["optimizer"]
    steps = [s.get("step") for s in (opt.get("state") or {}).values() if isinstance(s, dict)]
    refs = [s for s in steps if isinstance(s, TensorRef) and s.numel == 1]
    values = {float(r.read_torch().item()) for r in refs}
    if not refs or len(refs) != len(steps) or len(values) != 1:
        raise UnsupportedCheckpoint(
            f"Adam steps {sorted(values)} across parameters: torch_dist keeps one common step", path=src
        )
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    return {
        "args": obj0["args"],
        "checkpoint_version": obj0["checkpoint_version"],
        "iteration": obj0["iteration"],
        "optimizer": {"optimizer": {"state": {"common_step": refs[0]}, "param_groups": groups}},
        "opt_param_scheduler": obj0["opt_param_scheduler"],
        "num_floating_point_operations_so_far": obj0.get("num_floating_point_operations_so_far"),
    }


# --- torch_dist -> legacy (`--to megatron --ckpt-format torch [--tp N]`) ------------------------------------------

#: Megatron-LM's two checkpoint formats, spelled as its own `--ckpt-format` flag spells them
CKPT_FORMATS = ("torch_dist", "torch")
_EXTRA = re.compile(r"^decoder\.layers\.(.+)\._extra_state/shard_\d+_\d+$")


def _dist_iter(ck) -> Path:
    from ..formats.megatron_dist import _locate

    found = _locate(Path(ck.path))
    if found is None:
        raise UnsupportedCheckpoint("no Megatron-LM torch_dist iteration folder", path=Path(ck.path))
    return found[1]


def _padded_vocab(args: dict[str, Any], tp: int) -> int | None:
    """Megatron's `_vocab_size_with_padding` at TP `tp` (what a run launched there builds its embedding with)."""
    vocab, mult = args.get("vocab_size"), args.get("make_vocab_size_divisible_by")
    if not isinstance(vocab, int) or not isinstance(mult, int) or mult <= 0:
        return None
    step = mult * tp
    return -(-vocab // step) * step


def _check_legacy_target(ck, src: Path, tp: int | None, pp: int | None) -> tuple[int, int]:
    """Refuse, in one line, a torch_dist source (or a TP / PP size) the legacy writer cannot turn into rank files
    that Megatron loads at that TP x PP; returns the (TP, PP) sizes to write."""
    if ck.format not in ("megatron_torch_dist", "megatron_legacy"):
        raise UnsupportedCheckpoint(
            f"--to megatron --ckpt-format torch needs a Megatron-LM checkpoint (torch_dist, or legacy at another "
            f"TP / PP); this is {ck.format}, which holds no Megatron `args`, OptimizerParamScheduler state or "
            "Megatron-core parameter names",
            path=src,
        )
    args = _args(ck)
    if (args.get("transformer_impl") or "local") != "local":
        raise UnsupportedCheckpoint(
            f"a run built with transformer_impl={args.get('transformer_impl')}: its legacy "
            "rank files use Transformer Engine's module names and extra state, which ckpt "
            "does not write (local-spec runs only)",
            path=src,
        )
    if args.get("use_distributed_optimizer"):
        _check_distopt_dist_source(ck, src, tp, pp)
    else:
        _check_plain_adam(
            ck,
            src,
            "--ckpt-format torch",
            "writes the plain Adam rank files",
            "legacy layout (distrib_optim.pt buckets)",
        )
    saved = ck.topology.tp or 1
    tp = saved if tp is None else tp
    if tp < 1:
        raise UnsupportedCheckpoint(f"--tp {tp}: a tensor-parallel size is 1 or more", path=src)
    saved_pp, vpp = ck.topology.pp or 1, ck.topology.vpp or 1
    pp = saved_pp if pp is None else pp
    if pp < 1:
        raise UnsupportedCheckpoint(f"--pp {pp}: a pipeline-parallel size is 1 or more", path=src)
    if pp != saved_pp and vpp > 1:
        raise UnsupportedCheckpoint(
            f"--pp {pp}: the run uses a virtual pipeline (VPP {vpp}), whose chunks ckpt does "
            "not re-cut for another PP size",
            path=src,
            hint=f"convert at the saved PP ({saved_pp}), or resume the torch_dist run at "
            "the new PP (Megatron reshards it at load)",
        )
    if ck.format == "megatron_legacy" and (tp, pp) == (saved, saved_pp):
        raise UnsupportedCheckpoint(
            f"the checkpoint is already in Megatron-LM's legacy format (--ckpt-format "
            f"torch) at TP {saved} x PP {saved_pp}: nothing to convert",
            path=src,
            hint="--tp N / --pp N write the rank files of another TP / PP size; "
            "--ckpt-format torch_dist the layout Megatron reshards at load",
        )
    layers = int(args.get("num_layers") or 0)
    if (
        not layers
        or layers % (pp * vpp)
        or args.get("decoder_first_pipeline_num_layers")
        or args.get("decoder_last_pipeline_num_layers")
        or args.get("pipeline_model_parallel_layout")
        or args.get("account_for_embedding_in_pipeline_split")
        or args.get("account_for_loss_in_pipeline_split")
    ):
        if layers and layers % (pp * vpp) and pp != saved_pp:
            raise UnsupportedCheckpoint(
                f"--pp {pp} does not divide num_layers={layers}"
                f"{f' x VPP {vpp}' if vpp > 1 else ''}: ckpt cuts the layers into equal "
                "stages",
                path=src,
                hint="choose a PP size that divides the layers",
            )
        raise UnsupportedCheckpoint(
            f"num_layers={layers} over PP {pp} x VPP {vpp}: uneven pipeline stages, which "
            "ckpt does not split into legacy rank files yet",
            path=src,
        )
    if tp != saved:
        heads = int(args.get("num_attention_heads") or 0)
        groups = int(args.get("num_query_groups") or 0) if args.get("group_query_attention") else heads
        sizes = {
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "ffn_hidden_size": int(args.get("ffn_hidden_size") or 0),
            "padded_vocab_size": int(args.get("padded_vocab_size") or 0),
        }
        bad = [f"{k}={v}" for k, v in sizes.items() if not v or v % tp]
        if bad:
            raise UnsupportedCheckpoint(
                f"--tp {tp} does not divide {', '.join(bad)}: Megatron splits each of them "
                "over the tensor-parallel ranks",
                path=src,
                hint=f"choose a TP size that divides them; saved at TP {saved}",
            )
        want = _padded_vocab(args, tp)
        if want is not None and want != sizes["padded_vocab_size"]:
            raise UnsupportedCheckpoint(
                f"at --tp {tp} Megatron pads the vocabulary ({args.get('vocab_size')}) to {want} rows "
                f"(make_vocab_size_divisible_by={args.get('make_vocab_size_divisible_by')} x TP), not the saved "
                f"{sizes['padded_vocab_size']}: its embedding would not take the saved rows",
                path=src,
                hint="choose a TP size at which the padded vocabulary stays the same",
            )
        if args.get("sequence_parallel") and tp == 1:
            raise UnsupportedCheckpoint(
                "the run used sequence parallelism, which Megatron turns off at TP 1: "
                "relaunch flags would differ from the saved args",
                path=src,
                hint="convert to a TP size of 2 or more",
            )
    return tp, pp


def _legacy_plan_lines(ck, tp: int, pp: int) -> tuple[list[str], list[str]]:
    """(notes, not moved) for a conversion of a torch_dist run into legacy rank files at TP `tp` x PP `pp`."""
    args = _args(ck)
    saved, saved_pp, vpp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.vpp
    notes = [
        f"Megatron-LM legacy layout (--ckpt-format torch, plain Adam): iter_N/mp_rank_TT"
        f"{'_PPP' if pp > 1 else ''}/model_optim_rng.pt for TP {tp} x PP {pp}"
        f"{f' (virtual pipeline: model0..model{vpp - 1})' if vpp else ''}, saved at TP {saved} x PP {saved_pp}; "
        f"each stage holds {int(args['num_layers']) // pp} of the {args['num_layers']} layers; each rank "
        "file holds its TP shards of the module's weights (bf16) and of the fp32 master and Adam moments, split "
        "by Megatron's own TP rules (column-parallel and vocabulary-parallel dim 0, SwiGLU fc1 per "
        "sub-parameter, row-parallel dim 1, norms and row-parallel biases replicated), its stage's layers "
        "numbered from 0",
        (
            "optimizer (distributed): the rank file's {optimizer: {param_groups}} (with the step) and "
            "distrib_optim.pt beside it, as Megatron's legacy save writes it: buckets_coalesced, each buffer's "
            "fp32 master / exp_avg / exp_avg_sq (its bucket's unpadded elements) and numel_unpadded; "
            if args.get("use_distributed_optimizer")
            else "optimizer: per rank {state: {id: {step, exp_avg, exp_avg_sq}}, param_groups (as saved, with the ids "
            "of this rank's parameters in model order)}, fp32_from_fp16_params; "
        )
        + "opt_param_scheduler, iteration, checkpoint_version and floating-point-operation count as saved",
        "args: carried as saved with ckpt_format=torch, use_dist_ckpt=False and each file's rank / local_rank"
        + (
            f"; tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
            f"world_size={tp * pp * int(args.get('data_parallel_size') or 1)}"
            if (tp, pp) != (saved, saved_pp)
            else ""
        ),
    ]
    source = _legacy_source(ck)
    if source.has_rng:
        source.check_rng()  # every saved rank's RNG state as Megatron's load reads it, before anything is written
    not_moved = []
    if ck.format == "megatron_legacy":
        notes.append(
            f"read from the legacy rank files at TP {saved} x PP {saved_pp}: each whole tensor merged by "
            "Megatron's TP rules, then split again at the new size (one step, no torch_dist copy)"
        )
    else:
        not_moved.append(
            "content_metadata (common.pt: how Megatron built the sharded state dict): the legacy "
            "format has no such field"
        )
    if not source.has_rng:
        not_moved.append(
            f"RNG: the source saved none ({source.none}): the rank files hold no rng_state; relaunch with --no-load-rng"
        )
    elif (tp, pp) == (saved, saved_pp):
        notes.append(f"RNG: each rank's rng_state as saved ({source.label})")
    else:
        not_moved.append(
            f"RNG at another TP x PP: Megatron's own resharding load ignores the saved RNG state (TP "
            f"{saved} x PP {saved_pp} != {tp} x {pp}); a legacy file has no way to say so, so each rank "
            f"file carries the state of the rank it takes its first shard from (TP rank t <- t x {saved} "
            f"// {tp}; stage p <- the saved stage of its first layer): the Python / NumPy / torch "
            "generators are that rank's, and so are the tensor-parallel CUDA tracker "
            "(model-parallel-rng) and expert-parallel-rng. Relaunch with --no-load-rng for Megatron's "
            "fresh seeding instead"
        )
    if ck.tree.children.get("tied_copies") is not None or (
        pp > 1 and not args.get("untie_embeddings_and_output_weights")
    ):
        notes.append(
            "tied embeddings with PP > 1: the last stage's output_layer.weight (Megatron's copy of the word "
            "embeddings) written from the word embeddings, with their optimizer state"
        )
    return notes, not_moved


class _DistSource:
    """What the legacy writer takes from a torch_dist source besides its logical tensors: common.pt, the keys in
    .metadata order (the module order of a rank file's `model`), each saved rank's RNG state."""

    def __init__(self, ck):
        from ..formats.dcp import DcpItems
        from ..read import pickle_reader as pr

        it = _dist_iter(ck)
        self.common = pr.load(it / "common.pt").obj
        self._items = DcpItems(it)
        self.keys = list(self._items.sdm)
        self.has_rng = any(k.startswith("rng_state/") for k in self.keys)
        self.label, self.none = "rng_state/shard_{pp}.{tp}_PP.TP", "no rng_state items"

    def rng(self, p: int, t: int, pp: int, tp: int):
        key = f"rng_state/shard_{p}.{t}_{pp}.{tp}"
        return self._rng(key) if (key, None) in self._items.items else None

    def _rng(self, key: str):
        """The legacy `rng_state` list of item `key`: Megatron's ShardedObject `rng_state` holds [that list]."""
        it = self._items.item(key)
        where = self._items.root / it.rel
        if it.is_tensor:
            raise _bad_rng(key, "a tensor", where, wrapped=True)
        obj = self._items.value(key)
        if not (isinstance(obj, (list, tuple)) and len(obj) == 1):
            raise _bad_rng(key, _what(obj), where, wrapped=True)
        return _rng_list(obj[0], key, where)

    def check_rng(self) -> None:
        for key in self.keys:
            if key.startswith("rng_state/"):
                self._rng(key)


class _LegacySource:
    """The same, from legacy rank files (legacy -> legacy at another TP / PP): common.pt's fields from rank (0, 0)'s
    file, the keys in the order the rank files' models list their modules (stage after stage, chunk after chunk:
    the order Megatron's sharded state dict, so its .metadata, lists them), each rank file's RNG state."""

    def __init__(self, ck):
        from ..read import pickle_reader as pr
        from ..view.logical import name_key

        self._files = rank_files(ck)
        first = self._files[min(self._files)]
        obj0 = pr.load(first).obj
        self.common = _common_of_rank_file(first, obj0)
        args = _args(ck)
        layers = int(args.get("num_layers") or 0)
        tied = not args.get("untie_embeddings_and_output_weights")
        keys: list[str] = []
        for (t, p), f in sorted(self._files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if t:
                continue
            o = obj0 if f == first else pr.load(f).obj
            chunks = sorted(
                (k for k in o if isinstance(k, str) and re.fullmatch(r"model\d*", k)), key=lambda k: int(k[5:] or 0)
            )
            for local in (str(k) for c in chunks for k in o[c]):
                m = _LAYER.match(local)
                if m and m[2].endswith("._extra_state"):
                    key = f"decoder.layers.{m[2]}/shard_0_{layers}"
                elif m:
                    key = "decoder.layers." + name_key(f"decoder.layers.0.{m[2]}")[len("decoder.layers.0.") :]
                elif local.endswith("._extra_state") or (local == "output_layer.weight" and tied):
                    continue  # written by the layout itself (the tied copy only where the stage needs it)
                else:
                    key = local
                if key not in keys:
                    keys.append(key)
        self.keys = keys
        self.has_rng = obj0.get("rng_state") is not None
        self.label, self.none = "each rank file's rng_state", "no rng_state in its rank files"

    def rng(self, p: int, t: int, pp: int, tp: int):
        f = self._files.get((t, p))
        return self._rng(f) if f is not None else None

    def _rng(self, f: Path):
        from ..read import pickle_reader as pr

        obj = pr.load(f).obj
        rng = obj.get("rng_state") if isinstance(obj, dict) else None
        return None if rng is None else _rng_list(rng, "rng_state", f)

    def check_rng(self) -> None:
        for f in self._files.values():
            self._rng(f)


#: what Megatron's legacy load reads from an entry of a rank file's `rng_state` list (`[0]`, or its DP rank's)
_RNG_FIELDS = ("random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states")


def _what(obj: Any) -> str:
    return f"a {type(obj).__name__}" + (f" of {len(obj)}" if isinstance(obj, (list, tuple, dict)) else "")


def _bad_rng(what: str, found: str, where: Path, wrapped: bool = False):
    """`what` (an item or field of the file `where`) holds `found`, not an RNG state (`wrapped`: a torch_dist
    item, Megatron's ShardedObject holding [the list])."""
    from ..errors import CorruptCheckpoint

    shape = f"a list of dicts with {', '.join(_RNG_FIELDS)}"
    return CorruptCheckpoint(
        f"{what} is not the RNG state Megatron saves: {found}, where it saves {f'[{shape}]' if wrapped else shape}",
        path=where,
        hint=f"re-copy {where.name} from the run that saved it",
    )


def _rng_list(rng: Any, what: str, where: Path) -> Any:
    """`rng` as a legacy rank file's `rng_state` (a non-empty list of dicts holding what Megatron's load reads),
    or a one-line CorruptCheckpoint naming `what` (the item and its file)."""
    if not isinstance(rng, (list, tuple)) or not rng:
        raise _bad_rng(what, _what(rng), where)
    for i, entry in enumerate(rng):
        if not isinstance(entry, dict):
            raise _bad_rng(what, f"entry {i} is {_what(entry)}", where)
        missing = [f for f in _RNG_FIELDS if f not in entry]
        if missing:
            raise _bad_rng(what, f"entry {i} lacks {', '.join(missing)}", where)
    return rng


def _legacy_source(ck):
    return _LegacySource(ck) if ck.format == "megatron_legacy" else _DistSource(ck)


def _legacy_name(key: str) -> str:
    """The local-spec module name of a torch_dist key (the fused layer-norm names back to the layer's own)."""
    from ..view.logical import MEGATRON_FUSED_NORMS

    for local, fused in MEGATRON_FUSED_NORMS:
        if key.startswith(fused):
            return local + key[len(fused) :]
    return key


#: a local-spec decoder layer's modules in the order Megatron-core's TransformerLayer registers them (so its
#: state_dict, and a legacy rank file's `model`, lists them): the layer norms under their fused torch_dist names
_MODULES = (
    "self_attention.linear_qkv.layer_norm_",
    "self_attention.linear_proj.",
    "self_attention.linear_qkv.",
    "self_attention.q_layernorm.",
    "self_attention.k_layernorm.",
    "mlp.linear_fc1.layer_norm_",
    "mlp.linear_fc1.",
    "mlp.linear_fc2.",
)
_PARAMS = ("weight", "bias", "_extra_state")


def _module_rank(rest: str) -> tuple[int, int] | None:
    """Where a layer's tensor (`self_attention.linear_proj.bias`) comes in Megatron's module order; None if unknown."""
    for i, prefix in enumerate(_MODULES):
        if rest.startswith(prefix) and rest[len(prefix) :] in _PARAMS:
            return i, _PARAMS.index(rest[len(prefix) :])
    return None


def _stage_layout(keys: list[str], args: dict[str, Any], pp: int, vpp: int) -> dict[tuple[int, int], list]:
    """{(stage, chunk): [(local legacy name, global logical name or None for an extra state)]} in the order
    Megatron's GPTModel.state_dict lists them: the embedding (first chunk of stage 0), each layer's modules in the
    order the torch_dist .metadata lists them (the sharded state dict walks the same modules), the final norm and
    output layer (last chunk of the last stage)."""
    from ..view.logical import name_key

    layers = int(args["num_layers"])
    chunks = max(vpp, 1)
    per = layers // (pp * chunks)
    pre, layer, post = [], [], []
    for k in keys:
        if k.startswith(("optimizer.", "rng_state/")):
            continue
        m = _EXTRA.match(k)
        if m:
            rest = m[1] + "._extra_state"
        elif k.startswith("decoder.layers."):
            rest = k[len("decoder.layers.") :]
        else:
            (pre if k.startswith("embedding.") else post).append(k)
            continue
        if rest not in layer:
            layer.append(rest)
    if all(_module_rank(r) is not None for r in layer):  # a distributed-optimizer save lists them otherwise
        layer.sort(key=_module_rank)
    tied = not args.get("untie_embeddings_and_output_weights")
    if "output_layer.weight" not in post and (pp > 1 and tied):
        post.append("output_layer.weight")  # the last stage's copy of the tied word embeddings
    out: dict[tuple[int, int], list] = {}
    for p in range(pp):
        for c in range(chunks):
            items = []
            if p == 0 and c == 0:
                items += [(k, k) for k in pre]
            start = c * pp * per + p * per
            for i in range(per):
                for rest in layer:
                    local = f"decoder.layers.{i}.{_legacy_name(rest)}"
                    extra = rest.endswith("._extra_state")
                    items.append((local, None if extra else name_key(f"decoder.layers.{start + i}.{rest}")))
            if p == pp - 1 and c == chunks - 1:
                for k in post:
                    src = "embedding.word_embeddings.weight" if (k == "output_layer.weight" and tied) else k
                    items.append((k, src))
                items.append(("output_layer._extra_state", None))
            out[(p, c)] = items
    return out


def _tp_shard(name: str, t, rank: int, tp: int, swiglu: bool):
    """Rank `rank`'s share of the whole tensor `t` of the local-spec parameter `name` at TP `tp` (the inverse of
    `formats.megatron_lm._rule`'s merge)."""
    from ..formats.megatron_lm import _rule
    from ..read.tp_layout import split_shard

    rule = _rule(name, swiglu)
    if tp > 1 and rule not in ("replicated", "cat:0", "cat:1", "cat_sub:0"):
        raise UnsupportedCheckpoint(
            f"{name}: no TP split rule (Megatron-core GPT local spec): ckpt will not guess how to split it"
        )
    return split_shard(rule, t, rank, tp)  # SwiGLU fc1 (cat_sub:0): [gate; up], each split over the ranks


def _raw(t):
    """A tensor's bytes (a view of them when it is contiguous)."""
    import torch

    t = t.detach().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""


class _Records:
    """Tensors of one rank file as `torch_zip` records: storage keys numbered in pickle order; the bytes kept (small
    values) or made when the file's writer reaches them (`made`: the weights and optimizer states)."""

    def __init__(self):
        self.data: dict[str, Any] = {}

    def _record(self, dtype, shape, data):
        from .torch_zip import tensor_record

        key = str(len(self.data))
        self.data[key] = data
        return tensor_record(str(dtype).replace("torch.", ""), tuple(shape), key)

    def add(self, t):
        return self._record(t.dtype, t.shape, _raw(t))

    def made(self, like, make: Callable[[], Any]):
        """A tensor shaped and typed as `like` (a meta tensor) whose bytes `make()` returns when written."""
        return self._record(like.dtype, like.shape, lambda: _raw(make()))

    def tree(self, obj: Any) -> Any:
        """An inert tree (the RNG state) with every tensor re-recorded under this file's storage keys."""
        from ..read.pickle_reader import TensorRef

        if isinstance(obj, TensorRef):
            return self.add(obj.read_torch())
        if isinstance(obj, dict):  # dict or OrderedDict, as saved
            return type(obj)((k, self.tree(v)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self.tree(v) for v in obj]
        if isinstance(obj, tuple) and type(obj) is tuple:
            return tuple(self.tree(v) for v in obj)
        return obj


_BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(torch\.(\w+), "
    r"torch\.(\w+)\)\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
)


def _distopt_buckets(ck) -> dict[tuple[int, int, str, str], dict[str, list[Any]]]:
    """{(domain, gbuf, param dtype, main dtype): {state: its buckets' TensorNodes, in bucket order}} of a torch_dist
    distributed-optimizer save (dp_reshardable; domain: Megatron's DP-group index, the model-parallel rank
    tp + TP x pp); refuses, in one line, buckets that are not numbered 0..n-1 or lack a state."""
    from ..formats import dcp as dcp_format
    from ..formats.megatron_dist import _flat

    it = _dist_iter(ck)
    found: dict[tuple[int, int, str, str], dict[str, dict[int, Any]]] = {}
    for key, node in _flat(dcp_format.open(it).tree.children.get("model")).items():
        if not key.startswith("optimizer.distributed.") or "/" in key or not hasattr(node, "pieces"):
            continue
        m = _BUCKET.match(key)
        if m is None:
            raise UnsupportedCheckpoint(f"{key}: not a bucket of Megatron's dp_reshardable layout", path=it)
        found.setdefault((int(m[1]), int(m[2]), m[3], m[4]), {}).setdefault(m[6], {})[int(m[5])] = node
    out: dict[tuple[int, int, str, str], dict[str, list[Any]]] = {}
    for k, states in found.items():
        if set(states) != {"param", "exp_avg", "exp_avg_sq"} or any(
            sorted(b) != list(range(len(b))) or len(b) != len(states["param"]) for b in states.values()
        ):
            raise UnsupportedCheckpoint(
                f"distributed-optimizer buffer {k}: its buckets are not param, exp_avg and "
                "exp_avg_sq each numbered 0..n-1",
                path=it,
            )
        out[k] = {state: [b[i] for i in range(len(b))] for state, b in states.items()}
    if not out:
        raise UnsupportedCheckpoint(
            "no complete distributed-optimizer buckets (param, exp_avg, exp_avg_sq) in the torch_dist save", path=it
        )
    return out


def _write_distrib_optim(buckets: dict[tuple[int, int, str, str], dict[str, Any]], dst: Path, domain: int) -> int:
    """distrib_optim.pt as Megatron core_v0.16.1's legacy save of the distributed optimizer writes it
    (`get_parameter_state_dp_zero`): {"buckets_coalesced": True, gbuf: {(param dtype, main dtype): {param, exp_avg,
    exp_avg_sq, numel_unpadded}}}, each tensor the buffer's buckets cut to their unpadded length and joined (the
    torch_dist bucket tensors, back to back). Its bytes are copied file range to file range from the .distcp
    files (no buffer in memory); where the pieces cannot be copied as they are, the buffer is read when written."""
    import torch

    from ..read.pickle_reader import DType
    from ..read.tensor_read import FdCache, read_tensor, source_ranges
    from .torch_zip import save

    fds = FdCache()
    rec = _Records()
    obj: dict[Any, Any] = {"buckets_coalesced": True}
    for (d, g, pdt, mdt), states in sorted(buckets.items()):
        if d != domain:
            continue
        n = sum(b.shape[0] for b in states["param"])
        entry: dict[str, Any] = {}
        for k in ("param", "exp_avg", "exp_avg_sq"):
            nodes = states[k]  # the buffer's buckets, joined in order
            like = torch.empty((n,), dtype=getattr(torch, nodes[0].dtype), device="meta")
            parts = [source_ranges(node, fds) for node in nodes]
            if all(r is not None for r in parts) and len({node.dtype for node in nodes}) == 1:
                entry[k] = rec._record(like.dtype, like.shape, tuple(x for r in parts for x in r))
            else:
                entry[k] = rec.made(like, lambda nodes=nodes: torch.cat([read_tensor(node) for node in nodes]))
        entry["numel_unpadded"] = n
        obj.setdefault(g, {})[(DType(pdt), DType(mdt))] = entry  # written as the torch.<dtype> globals
    try:
        return save(obj, dst, rec.data)
    finally:
        fds.close()


def legacy_rank_dirs(plan) -> list[tuple[str, int]]:
    """The rank folders `_write_legacy` writes for `plan`, in its order: (`iter_N/mp_rank_TT[_PPP]`, the bytes of
    the plan it counts for it). A torchrun job's units (`ops.convert`): each folder depends on the plan alone."""
    from ..view import logical as L
    from ..formats.megatron_lm import _dir_name

    ck = L.open_any(plan.source)
    saved, saved_pp = ck.topology.tp or 1, ck.topology.pp or 1
    tp, pp = plan.tp or saved, plan.pp or saved_pp
    iteration = int(_legacy_source(ck).common["iteration"])
    n = pp * tp
    return [
        (f"iter_{iteration:07d}/{_dir_name(k % tp, k // tp, pp)}", plan.nbytes * (k + 1) // n - plan.nbytes * k // n)
        for k in range(n)
    ]


def _write_legacy(
    plan, root: Path, progress: Callable[[int], None] | None, only: list[int] | None = None, common: bool = True
) -> int:
    """Write Megatron's legacy run folder for `plan` (to="megatron", ckpt_format="torch") into the empty folder
    `root`: one model_optim_rng.pt per (TP, PP) rank at `plan.tp`; returns the bytes written. Each tensor's bytes
    are read, split and written when the rank file's writer reaches them, so memory holds one whole tensor and its
    shard (plus the RNG state and the pickle); each rank reads the whole tensors it takes a shard of, so a stage is
    read once per TP rank written (TP x the reads). `only`: the rank folders (indices into `legacy_rank_dirs`) to
    write, each by itself the same bytes (a torchrun job's share); `common`: the iteration file."""
    import collections
    import copy

    from ..view import logical as L
    from ..formats.megatron_lm import _dir_name
    from ..view.logical import name_key
    from .torch_zip import save

    ck = L.open_any(plan.source)
    args = _args(ck)
    src_of = _legacy_source(ck)
    common = src_of.common
    saved, saved_pp, vpp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.vpp or 0
    tp, pp = plan.tp or saved, plan.pp or saved_pp
    dp = int(args.get("data_parallel_size") or 1)
    swiglu = bool(args.get("swiglu"))
    layout = _stage_layout(src_of.keys, args, pp, vpp)
    module = {name_key(t.name): t for t in L.model_tensors(ck, weights="module")}
    params = {name_key(p.name): p for p in plan.params}
    group_of = {name_key(n): gi for gi, g in enumerate(plan.groups) for n in g["params"]}
    distopt = bool(args.get("use_distributed_optimizer"))
    if distopt:  # the param groups (with the step) are a sharded object; the state is in the buckets
        from ..formats.megatron_dist import _sharded_param_groups

        groups_hp, step = _sharded_param_groups(_dist_iter(ck)), None
        buckets = _distopt_buckets(ck)  # the DCP's bucket tensors, found once for every rank file
    else:
        opt = common["optimizer"]["optimizer"]
        step = opt["state"]["common_step"].read_torch()
        groups_hp = [g for g in opt["param_groups"]]
    iteration = int(common["iteration"])
    itdir = root / f"iter_{iteration:07d}"
    written = 0

    def source(name: str, what: str):
        """(the logical tensor, the dtype read) of one whole tensor of the source: "module", "fp32" or a state."""
        if what == "module":
            if name not in module:
                raise UnsupportedCheckpoint(f"{name}: not in the checkpoint's model", path=plan.source)
            return module[name], None
        if what == "fp32":
            return params[name].weight, "float32"
        return params[name].states[what], None

    def shard(rec: _Records, local: str, name: str, what: str, t: int):
        """TP rank t's shard of one whole tensor, as a record: shaped by splitting an empty (meta) tensor now, read
        and split when the rank file's writer reaches it (memory: one whole tensor and its shard)."""
        import torch

        node, dtype = source(name, what)
        like = torch.empty(node.shape, dtype=L.torch_dtype(dtype or node.dtype), device="meta")
        return rec.made(
            _tp_shard(local, like, t, tp, swiglu),
            lambda: _tp_shard(local, node.read(L.torch_dtype(dtype) if dtype else None), t, tp, swiglu),
        )

    for p in range(pp):
        chunks = [layout[(p, c)] for c in range(max(vpp, 1))]
        for t in range(tp):
            if only is not None and p * tp + t not in only:
                continue
            rec = _Records()
            a = copy.copy(common["args"])
            rank = t + tp * dp * p  # Megatron's default rank order (tp-cp-ep-dp-pp), data-parallel rank 0
            state = {**common["args"].state, "ckpt_format": "torch", "use_dist_ckpt": False}
            for k in ("rank", "local_rank"):
                if k in state:
                    state[k] = rank
            if (tp, pp) != (saved, saved_pp):
                state.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, world_size=tp * pp * dp)
                if "transformer_pipeline_model_parallel_size" in state:
                    state["transformer_pipeline_model_parallel_size"] = pp
            a.state = state
            obj: dict[str, Any] = {
                "args": a,
                "checkpoint_version": common["checkpoint_version"],
                "iteration": common["iteration"],
            }
            members: list[list[str]] = [[] for _ in groups_hp]
            for c, items in enumerate(chunks):
                m = collections.OrderedDict()
                for local, name in items:
                    if name is None:
                        m[local] = None
                        continue
                    m[local] = shard(rec, local, name, "module", t)
                    if name in params and params[name].states:
                        if name not in group_of:
                            raise UnsupportedCheckpoint(f"{name}: in no param group", path=plan.source)
                        members[group_of[name]].append((local, name))
                obj[f"model{c}" if vpp else "model"] = m
            state_out: dict[int, Any] = {}
            masters: list[list[Any]] = []
            ids: list[list[int]] = []
            i = 0
            for gi, mem in enumerate(members):
                ids.append(list(range(i, i + len(mem))))
                for local, name in [] if distopt else mem:
                    state_out[i] = {
                        "step": rec.add(step.clone()),
                        **{k: shard(rec, local, name, k, t) for k in ("exp_avg", "exp_avg_sq")},
                    }
                    i += 1
            for gi, mem in enumerate([] if distopt else members):
                masters.append([shard(rec, local, name, "fp32", t) for local, name in mem])
            groups = [
                {**{k: v for k, v in g.items() if k != "params"}, "params": ids[gi]} for gi, g in enumerate(groups_hp)
            ]
            if distopt:  # what Megatron's legacy save of the distributed optimizer keeps in the rank file
                obj["optimizer"] = {"optimizer": {"param_groups": rec.tree(groups_hp)}}
            else:
                obj["optimizer"] = {
                    "optimizer": {"state": state_out, "param_groups": groups},
                    "fp32_from_fp16_params": masters,
                }
            obj["opt_param_scheduler"] = common["opt_param_scheduler"]
            src_t = t * saved // tp
            src_p = p * saved_pp // pp  # the saved stage of this stage's first layer (even stages: no VPP here)
            rng = src_of.rng(src_p, src_t, saved_pp, saved)
            if rng is not None:
                obj["rng_state"] = rec.tree(rng)
            obj["num_floating_point_operations_so_far"] = common.get("num_floating_point_operations_so_far")
            d = itdir / _dir_name(t, p, pp)
            d.mkdir(parents=True, exist_ok=only is not None)  # a job's rerun writes an unfinished folder over
            written += save(obj, d / "model_optim_rng.pt", rec.data)
            if distopt:
                written += _write_distrib_optim(buckets, d / "distrib_optim.pt", t + tp * p)
            if progress:  # in the plan's units (the source's bytes): its share per rank file written
                k, n = p * tp + t, pp * tp
                progress(plan.nbytes * (k + 1) // n - plan.nbytes * k // n)
    if common:
        (root / LATEST).write_text(str(iteration))
    return written


# --- what `ops.convert` calls: one entry each, the format written chosen here ------------------------------------


def check(
    ck, src: Path, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
) -> tuple[int | None, int | None]:
    """Refuse, in one line, a source (or TP / PP / EP size) that cannot be written as Megatron's `ckpt_format`;
    returns the (TP, PP) sizes of the legacy rank files ((None, None) for torch_dist, which holds whole tensors).
    A Mixture-of-Experts run is written by `megatron_moe` (`ops.convert._megatron_writer` chooses)."""
    if ep is not None:
        raise UnsupportedCheckpoint(
            f"--ep {ep} applies to a Mixture-of-Experts run; this one has no experts (num_experts unset)", path=src
        )
    if ckpt_format == "torch":
        return _check_legacy_target(ck, src, tp, pp)
    _check_dist_target(ck, src)
    return None, None


def target_ep(ck, ep: int | None) -> None:
    """A dense run has no expert-parallel size (`megatron_moe.target_ep`)."""
    return None


def plan_lines(
    ck, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
) -> tuple[list[str], list[str]]:
    """(notes, not moved) of the conversion."""
    return _legacy_plan_lines(ck, tp, pp) if ckpt_format == "torch" else _dist_plan_lines(ck)


def write(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Write `plan` (to="megatron") into the empty staging folder `root`; returns the bytes written."""
    return (_write_legacy if plan.ckpt_format == "torch" else _write_dist)(plan, root, progress)


__all__ = [
    "check",
    "target_ep",
    "plan_lines",
    "write",
    "plan_dist",
    "dist_key",
    "rank_files",
    "legacy_rank_dirs",
    "CKPT_FORMATS",
]
