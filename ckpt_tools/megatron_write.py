"""Write a Megatron-LM torch_dist run folder (`ckpt convert SRC OUT --to megatron`), as Megatron-LM core_v0.16.1's
`save_checkpoint` lays it out for plain Adam (not the distributed optimizer), from a Megatron-LM legacy checkpoint.

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
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

from .errors import UnsupportedCheckpoint

SOURCE_FORMATS = ("megatron_legacy",)
LATEST = "latest_checkpointed_iteration.txt"
DIST_META = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}
#: what Megatron core_v0.16.1 records in common.pt about how the sharded state dict was built (plain optimizer)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def check_source(ck, src: Path) -> None:
    """Refuse, in one line naming what is missing, a source this writer cannot turn into a loadable Megatron run."""
    if ck.format == "megatron_torch_dist":
        raise UnsupportedCheckpoint("the checkpoint is already a Megatron-LM torch_dist checkpoint: nothing to convert "
                                    "(Megatron reshards it at load: resume it at any TP / PP)", path=src)
    if ck.format not in SOURCE_FORMATS:
        raise UnsupportedCheckpoint(
            f"--to megatron needs a Megatron-LM legacy checkpoint; this is {ck.format}, which holds no Megatron "
            "`args` (the GPT architecture, parallel sizes and schedule Megatron's load_checkpoint rebuilds the run "
            "from), no OptimizerParamScheduler state and no Megatron-core parameter names", path=src,
            hint="convert a checkpoint Megatron-LM saved (--ckpt-format torch); other frameworks: --to dcp / torch")
    args = _args(ck)
    if args.get("use_distributed_optimizer"):
        raise UnsupportedCheckpoint("--to megatron writes the plain Adam layout; this run used Megatron's distributed "
                                    "optimizer (args.use_distributed_optimizer), whose torch_dist layout (flat "
                                    "bucket buffers) ckpt does not write", path=src)
    if not (args.get("bf16") or args.get("fp16")):
        raise UnsupportedCheckpoint("--to megatron is proven for bf16/fp16 runs (Float16 optimizer with an fp32 "
                                    "master); this run trained in fp32", path=src)
    if ck.tree.children.get("optimizer") is None or "state" not in ck.tree.children["optimizer"].children:
        raise UnsupportedCheckpoint("the checkpoint holds no per-parameter Adam state to write", path=src)


def _args(ck) -> dict[str, Any]:
    from .ops.resume import node_to_python

    node = ck.tree.children.get("args")
    val = node_to_python(node) if node is not None else None
    return val if isinstance(val, dict) else {}


def rank_files(ck) -> dict[tuple[int, int], Path]:
    """{(tp, pp): the rank's model_optim_rng.pt} of a legacy checkpoint."""
    root = Path(ck.path)
    return {(f.rank["tp"], f.rank["pp"]): root / f.path for f in ck.files
            if f.role == "model" and f.path.endswith("model_optim_rng.pt")}


def dist_key(name: str, layers: int) -> tuple[str, int | None]:
    """(the torch_dist key, the layer index or None) of a logical parameter name."""
    from .logical import name_key

    name = name_key(name)
    m = _LAYER.match(name)
    if m is None:
        return name, None
    if int(m[1]) >= layers:
        raise UnsupportedCheckpoint(f"{name}: layer {m[1]} beyond args.num_layers={layers}")
    return f"decoder.layers.{m[2]}", int(m[1])


def plan_lines(ck) -> tuple[list[str], list[str]]:
    """(notes, not moved) for a conversion of `ck` into Megatron's torch_dist."""
    args = _args(ck)
    tp, pp = ck.topology.tp or 1, ck.topology.pp or 1
    notes = [f"Megatron-LM torch_dist (plain Adam): global tensors, layers stacked on a leading axis of "
             f"{args.get('num_layers')}; Megatron reshards them at load, so it resumes at any TP / PP (saved at TP "
             f"{tp} x PP {pp})",
             "weights: the module's weights as saved (bf16) and the fp32 master as optimizer.state.fp32_param; Adam's "
             "exp_avg / exp_avg_sq; the common Adam step, param groups and the OptimizerParamScheduler state in "
             "common.pt, as saved",
             "args: carried as saved, with ckpt_format=torch_dist and use_dist_ckpt=True (what Megatron's own "
             "torch_dist save of the run records)",
             f"RNG: each rank file's rng_state as the sharded object rng_state/shard_{{pp}}.{{tp}}_{pp}.{tp}: Megatron "
             "loads it when resumed at the saved TP x PP and ignores it at another (no flag needed)"]
    not_moved = []
    if ck.tree.children.get("tied_copies") is not None:
        not_moved.append("tied_copies: the last pipeline stage's copy of the word embeddings; torch_dist saves the "
                         "tied weight once and Megatron re-makes the copy at load")
    return notes, not_moved


def write(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Write the run folder for `plan` (a `ops.convert.ConvertPlan` with to="megatron") into the empty folder `root`
    (the staging folder `ops.convert.execute` renames into place); returns the bytes written."""
    from . import logical as L
    from . import pickle_reader as pr
    from .dcp_write import DcpStreamWriter

    ck = L.open_any(plan.source)
    args = _args(ck)
    layers = int(args.get("num_layers") or 0)
    tp, pp = ck.topology.tp or 1, ck.topology.pp or 1
    ranks = rank_files(ck)
    obj0 = pr.load(ranks[min(ranks)]).obj
    iteration = int(obj0["iteration"])
    it = root / f"iter_{iteration:07d}"
    module = {t.name: t for t in L.model_tensors(ck, weights="module")}
    w = DcpStreamWriter(it, checkpoint_id=str(plan.out / it.name), shards=2)
    try:
        for p in plan.params:
            if p.kind == "tied":
                continue
            key, layer = dist_key(p.name, layers)
            tensors = [(key, module[p.name].read())]
            if p.states:
                tensors.append((f"optimizer.state.fp32_param.{key}", p.weight.read()))
                tensors += [(f"optimizer.state.{k}.{key}", t.read()) for k, t in sorted(p.states.items())]
            for k, t in tensors:
                if layer is None:
                    w.tensor_part((k,), tuple(t.shape), (0,) * t.dim(), t)
                else:
                    w.tensor_part((k,), (layers, *t.shape), (layer,) + (0,) * t.dim(), t.unsqueeze(0))
            if progress:
                progress(p.nbytes)
        for rest in _extra_states(obj0):
            for i in range(layers):
                w.value((f"decoder.layers.{rest}._extra_state/shard_{i}_{layers}",), [None])
        for (t, s), f in sorted(ranks.items()):
            rng = pr.load(f).obj.get("rng_state")
            if rng is not None:  # a run saved with --no-save-rng has none, and its args tell Megatron so
                w.value_blob((f"rng_state/shard_{s}.{t}_{pp}.{tp}",), _zip_bytes(f, [rng]))
    except BaseException:
        w.abort()
        raise
    w.close()
    _write_common(ranks[min(ranks)], obj0, plan, it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(DIST_META))
    (root / LATEST).write_text(str(iteration))
    return w.bytes_written + (it / "common.pt").stat().st_size


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
            raise UnsupportedCheckpoint(f"{k}: a module extra state that is not None (Transformer Engine FP8 "
                                        "metadata?): ckpt does not carry it into torch_dist")
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

    from .pickle_reader import TensorRef
    from .pickle_writer import rewrite_torch_zip

    opt = obj0["optimizer"]["optimizer"]
    steps = [s.get("step") for s in (opt.get("state") or {}).values() if isinstance(s, dict)]
    refs = [s for s in steps if isinstance(s, TensorRef) and s.numel == 1]
    values = {float(r.read_torch().item()) for r in refs}
    if not refs or len(refs) != len(steps) or len(values) != 1:
        raise UnsupportedCheckpoint(f"Adam steps {sorted(values)} across parameters: torch_dist keeps one common "
                                    "step", path=src)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    args = copy.copy(obj0["args"])
    args.state = {**obj0["args"].state, "ckpt_format": "torch_dist", "use_dist_ckpt": True}
    common = {"args": args, "checkpoint_version": obj0["checkpoint_version"], "iteration": obj0["iteration"],
              "optimizer": {"optimizer": {"state": {"common_step": refs[0]}, "param_groups": groups}},
              "opt_param_scheduler": obj0["opt_param_scheduler"],
              "num_floating_point_operations_so_far": obj0.get("num_floating_point_operations_so_far"),
              "content_metadata": dict(CONTENT_METADATA)}
    rewrite_torch_zip(src, dst, common, prune=True)


__all__ = ["check_source", "plan_lines", "write", "dist_key", "rank_files"]
