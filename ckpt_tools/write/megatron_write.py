"""Write a Megatron-LM torch_dist run folder (`ckpt convert SRC OUT --to megatron`), as Megatron-LM core_v0.16.1's
`save_checkpoint` lays it out for plain Adam (the distributed optimizer: `_write_distopt_buffers`, its dp_reshardable
buckets), from a Megatron-LM legacy checkpoint (from a Megatron-DeepSpeed pipeline checkpoint:
`write.megatron_from_view`, with the same three entries).

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

The other direction (`--ckpt-format torch`, `megatron_to_legacy`): a torch_dist run (plain Adam) as the legacy run
folder Megatron's `--ckpt-format torch` save writes, `iter_{N:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`
per rank (args, checkpoint_version, iteration, model / model0.., optimizer {optimizer {state, param_groups},
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

import copy
import json
import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedCheckpoint
from ..formats.megatron_lm import distopt_layout
from ..read import pickle_reader as pr
from ..view import logical as L
from ..view.logical import name_key
from .dcp_write import DcpStreamWriter, LazyPart, PlannedDcpWriter, lazy_part, plan_save_id
from .pickle_writer import rewrite_torch_zip

# the shared pieces and the torch_dist -> legacy writer live in sibling modules; callers (ops.convert,
# write.megatron_from_view, resume.frameworks, megatron_moe) import them from here, so they are re-exported
from .megatron_common import (  # noqa: F401
    LATEST,
    _LAYER,
    _args,
    _check_plain_adam,
    _common_of_rank_file,
    rank_files,
)
from .megatron_to_legacy import (  # noqa: F401
    CKPT_FORMATS,
    _check_legacy_target,
    _dist_iter,
    _distopt_buckets,
    _DistSource,
    _legacy_plan_lines,
    _Records,
    _rng_list,
    _write_legacy,
    legacy_rank_dirs,
)

SOURCE_FORMATS = ("megatron_legacy",)
DIST_META = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
#: what Megatron core_v0.16.1 records in common.pt about how the sharded state dict was built (plain optimizer)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}


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


def dist_key(name: str, layers: int) -> tuple[str, int | None]:
    """(the torch_dist key, the layer index or None) of a logical parameter name."""
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
    w, tail = _dist_items(plan, root, DcpStreamWriter, progress)
    w.close()
    return w.bytes_written + tail(root)


def plan_dist(plan, root: Path):
    """(a `dcp_write.PlannedDcpWriter` holding the items `_write_dist` writes, in its order, each parameter's
    tensor chunks of unit `param<i>` (the plan's index), each chunk of a distributed optimizer's buffers a unit of
    its own (`<bucket key>.<state>@<first element>`); what writes the rest of the run folder into `root`): a
    torchrun job's plan."""
    return _dist_items(plan, root, PlannedDcpWriter, None)


def _dist_items(plan, root: Path, writer, progress: Callable[[int], None] | None):
    """The DCP items of the run folder, written (or planned) through `writer(folder, checkpoint_id, shards,
    save_id)`; returns (the writer, not closed; tail(root) -> bytes: common.pt, metadata.json, the iteration)."""
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


def _distrib_optim(rank_file: Path) -> dict:
    """The inert tree of distrib_optim.pt beside `rank_file`; refuses one that is not `buckets_coalesced` or holds
    more than Adam's fp32 master / exp_avg / exp_avg_sq per buffer (it would be left behind)."""
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
    return dist


def _bucket_cuts(names: list[str], where: dict, model: dict, start: int, nb: int, padded: int, dp: int) -> list[int]:
    """Where one bucket (elements `start`..`start + nb` of its buffer) is cut into chunks: at each DP rank's share,
    at each parameter's range, and every `_BUFFER_CHUNK` elements in between."""
    bounds = {0, nb} | {k * (padded // dp) for k in range(dp) if k * (padded // dp) < nb}
    for name in names:  # each parameter's range is its own chunk
        bounds |= {x - start for x in (where[name], where[name] + model[name].numel) if start < x < start + nb}
    edges = sorted(bounds)
    return [x for a, c in zip(edges, edges[1:]) for x in range(a, c, _BUFFER_CHUNK)] + [nb]


def _write_buffer(
    w, rank_file: Path, prefix: str, g: int, dkey, entry: dict, model: dict, args: dict[str, Any], dp: int, divisor: int
) -> tuple[list[int], list[int]]:
    """Buffer `g` of dtypes `dkey` of distrib_optim.pt as its buckets' global tensors (keys under `prefix`), a
    chunk at a time; returns (the buckets' sizes, padded as Megatron pads them)."""
    import torch  # lazy: torch only when a torch_dist run is written; write/ stays torch-free at import

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
        cuts = _bucket_cuts(names, where, model, start, nb, padded, dp)
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
    return list(sizes), padded_sizes


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
    import torch  # lazy: torch only when a torch_dist run is written; write/ stays torch-free at import

    dist = _distrib_optim(rank_file)
    dp = int(args.get("data_parallel_size") or 1)
    divisor = math.lcm(dp, 128, 2**16) if args.get("ddp_pad_buckets_for_high_nccl_busbw") else math.lcm(dp, 128)
    prefix = f"optimizer.distributed.dp_group_idx_{domain}"
    model = {k: v for k, v in (obj.get("model") or {}).items() if isinstance(v, pr.TensorRef)}
    numel: list[dict] = []
    unpadded: list[dict] = []
    for g in sorted(k for k in dist if isinstance(k, int)):
        padded_g, unpadded_g = {}, {}
        for dkey, entry in dist[g].items():
            sizes, padded_sizes = _write_buffer(w, rank_file, prefix, g, dkey, entry, model, args, dp, divisor)
            dtypes = tuple(getattr(torch, repr(x).rsplit(".", 1)[-1]) for x in dkey)
            padded_g[dtypes], unpadded_g[dtypes] = padded_sizes, sizes
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
    fd, tmp = tempfile.mkstemp(prefix="ckpt-megatron-", suffix=".pt")  # outside the checkpoint being written
    os.close(fd)
    try:
        rewrite_torch_zip(src, tmp, obj, prune=True)
        return Path(tmp).read_bytes()
    finally:
        os.unlink(tmp)


def _write_common(src: Path, obj0: dict, plan, dst: Path) -> None:
    """common.pt from rank 0's inert tree: what Megatron's torch_dist save keeps outside the DCP."""
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


# --- what `ops.convert` calls: one entry each, the format written chosen here ------------------------------------


def check(
    ck, src: Path, ckpt_format: str, tp: int | None, pp: int | None = None, ep: int | None = None
) -> tuple[int | None, int | None]:
    """Refuse, in one line, a source (or TP / PP / EP size) that cannot be written as Megatron's `ckpt_format`;
    returns the (TP, PP) sizes of the legacy rank files ((None, None) for torch_dist, which holds whole tensors).
    A Mixture-of-Experts run is written by `megatron_moe` (`write.megatron_target.writer_for` chooses)."""
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
