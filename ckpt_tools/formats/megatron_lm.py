"""Megatron-LM's own checkpoints in the legacy format (`--ckpt-format torch`), as `save_checkpoint` writes them.

A run folder holds `latest_checkpointed_iteration.txt` (the iteration, or `release`) and one `iter_{N:07d}/` per
save; each holds one `mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt` per tensor- (x pipeline-) parallel rank, and
with the distributed optimizer a `distrib_optim.pt` beside it. Each rank file: `args` (the launch Namespace: the
parallel sizes, the architecture, the LR schedule), `iteration`, `checkpoint_version`, `model` (this rank's TP shards,
local shapes, bf16), `optimizer` = {`optimizer` {`state`, `param_groups`}, `fp32_from_fp16_params`} (plain Adam; the
distributed optimizer keeps only `param_groups` here), `opt_param_scheduler`, `rng_state`,
`num_floating_point_operations_so_far`. Measured on samples written by Megatron-LM core_v0.16.1 (docs/megatron.md,
docs/samples.md).

The checkpoint is the `iter_N` folder (or the run folder, which names it); one rank's file is a part of it (the
accounting marks it so). Topology comes from `args`, never from the file count: a missing rank folder is fatal, an
extra one is a warning that blocks writes.

TP merge (Megatron-core's GPT modules): column-parallel layers (`linear_qkv`, `linear_fc1`) and the
vocabulary-parallel embedding / output layer are split on dim 0; row-parallel weights (`linear_proj`,
`linear_fc2`) on dim 1, their biases replicated (added after the all-reduce); norms and learned position embeddings
replicated. Each rule is checked against the global shape `args` implies; a parameter no rule covers, with TP > 1,
is refused by name rather than guessed.

Pipeline stages (`mp_rank_XX_YYY`) and virtual-pipeline model chunks (`model0`, `model1`, … in each rank file) number
their layers from 0 and are renumbered by Megatron's layer offset; the stages must hold exactly layers
0..num_layers-1. With tied embeddings the last stage's `output_layer.weight` is Megatron's copy of the word
embeddings, shown under `tied_copies` and counted once. Uneven stages and multi-token prediction are refused by name.

Mixture-of-Experts at EP 1 (any TP / PP): the dense folders; the router and norms are TP-replicated, the routed
experts split over the expert-TP group by the linear_fc1 / linear_fc2 rules (expert TP = TP), or whole on every TP
rank (expert TP 1); other expert-TP sizes are refused by name. At expert parallel EP > 1 (TP 1, PP 1; with TP or
PP > 1 refused by name): one folder per EP rank, `mp_rank_00_{e:03d}`, each holding the dense parameters
(data-parallel replicas) and its experts under LOCAL ids; shown under global ids (`_model_ep`). Its optimizer is a
ChainedOptimizer (dense, expert), saved as a list of inner optimizers in every rank file (and in `distrib_optim.pt`,
None where the rank does not save that inner one), read inner optimizer by inner optimizer (`_optimizer`).

Where the training state lives: every rank file holds the same param groups (`max_lr`/`min_lr` drive the LR: Megatron
recomputes it every step from them and `opt_param_scheduler.num_steps`) and its own copy of the scheduler, so an
edit goes to every rank file (`training_state`). The distributed optimizer's flat buffers (`distrib_optim.pt`) are
mapped to parameters by Megatron's buffer layout, confirmed by the weights (`_distopt_entries`, in
formats/_megatron_lm_optimizer.py with the rest of the optimizer reading); where that cannot be confirmed they are
shown as saved (`not-mapped`) and commands that need per-parameter optimizer state refuse.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, MissingFile, NotACheckpoint, UnsupportedCheckpoint
from ..read.pickle_reader import TensorRef
from ..read.state import StateMap, StateSource
from ..read.tp_layout import merged_shape
from ..schedules.megatron import lr_at
from ..read.tree import (
    Checkpoint,
    Counters,
    GroupNode,
    LearningRates,
    TensorNode,
    Topology,
    ValueNode,
    Warning_,
    as_int,
    tensor_node,
    to_node,
)
from . import _common as C
from ._megatron_lm_optimizer import (  # noqa: F401  (re-exported: callers import them from here)
    DISTRIB,
    RANK_FILE,
    _inner_parts,
    _optimizer,
    args_of,
    declared_groups,
    distopt_layout,
    expert_parallel,
    group_rule,
    group_warnings,
    inner_optimizers,
    missing_groups,
)

FORMAT = "megatron_legacy"
LATEST = "latest_checkpointed_iteration.txt"
#: mp_rank_TT, mp_rank_TT_PPP (pipeline stages) or mp_rank_TT_EEE (expert-parallel ranks, PP 1), mp_rank_TT_PPP_EEE
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")

#: Megatron-core GPT submodules and how their TP shards form the parameter (ColumnParallelLinear: dim 0,
#: RowParallelLinear: dim 1 with a replicated bias, VocabParallelEmbedding: dim 0, everything else replicated)
_TP_RULES = (
    (re.compile(r"(^|\.)(linear_qkv|linear_fc1)\.(weight|bias)$"), "cat:0"),
    (re.compile(r"(^|\.)(linear_proj|linear_fc2)\.weight$"), "cat:1"),
    (re.compile(r"(^|\.)(linear_proj|linear_fc2)\.bias$"), "replicated"),
    (re.compile(r"^embedding\.word_embeddings\.weight$|^output_layer\.weight$"), "cat:0"),
    (re.compile(r"^embedding\.position_embeddings\.weight$"), "replicated"),
    (re.compile(r"(norm|layernorm)[^.]*\.(weight|bias)$|\.layer_norm_(weight|bias)$"), "replicated"),
    # Megatron-core MoE: the router (its gating weight [experts, hidden] and the optional expert bias) is
    # TP-replicated (`TopKRouter`: a plain parameter, `sequence_parallel`-marked); routed experts split by the
    # linear_fc1 / linear_fc2 rules above over the expert-TP group
    (re.compile(r"\.mlp\.router\.(weight|expert_bias)$"), "replicated"),
)
#: a routed expert's parameters (SequentialMLP's `local_experts.{j}`), TP-split over the expert-TP group
_ROUTED_EXPERT = re.compile(r"\.mlp\.experts\.")


def sniff(path: Path) -> bool:
    return path.is_dir() and _locate(path) is not None


def _rank_dirs(d: Path) -> dict[tuple[int, ...], Path]:
    """{(tp, second number): folder}: the second number is the pipeline stage, or with expert parallelism at PP 1
    the expert-parallel rank (only the args tell which); a folder with both numbers is keyed (tp, pp, ep)."""
    out: dict[tuple[int, ...], Path] = {}
    if d.is_dir():
        for sub in d.iterdir():
            m = _RANK_DIR.match(sub.name)
            if m and sub.is_dir() and ((sub / RANK_FILE).is_file() or (sub / DISTRIB).is_file()):
                key = (int(m[1]), int(m[2] or 0)) if m[3] is None else (int(m[1]), int(m[2]), int(m[3]))
                out[key] = sub
    return out


def _locate(path: Path) -> tuple[Path, Path, str] | None:
    """(root the user gave, the iteration folder, its name) for a run folder or an iteration folder of the legacy
    layout; a run folder whose latest file names a missing iteration still claims (open names what is missing)."""
    if (path / LATEST).is_file():
        try:
            txt = (path / LATEST).read_text().strip()
        except OSError:
            return None
        name = "release" if txt == "release" else (f"iter_{int(txt):07d}" if txt.isdigit() else txt)
        if _rank_dirs(path / name) or any(_rank_dirs(d) for d in path.iterdir() if _ITER_DIR.match(d.name)):
            return path, path / name, name
        return None
    if _rank_dirs(path):
        return path, path, path.name
    return None


def _global_shapes(args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name suffix -> the global shape `args` implies (GPT: hidden h, heads n, query groups g, FFN f)."""
    h, n = as_int(args.get("hidden_size")), as_int(args.get("num_attention_heads"))
    f = as_int(args.get("ffn_hidden_size"))
    if not h or not n:
        return {}
    kv = as_int(args.get("kv_channels")) or h // n
    g = as_int(args.get("num_query_groups")) if args.get("group_query_attention") else n
    fc1 = 2 * f if f and args.get("swiglu") else f
    out = {
        "linear_qkv.weight": ((n + 2 * g) * kv, h),
        "linear_qkv.bias": ((n + 2 * g) * kv,),
        "linear_proj.weight": (h, n * kv),
    }
    if f:
        out.update({"linear_fc1.weight": (fc1, h), "linear_fc1.bias": (fc1,), "linear_fc2.weight": (h, f)})
    vocab = as_int(args.get("padded_vocab_size"))
    if vocab:
        out["word_embeddings.weight"] = (vocab, h)
        out["output_layer.weight"] = (vocab, h)
    return out


def _expected_shape(name: str, shapes: dict[str, tuple[int, ...]], args: dict[str, Any]) -> tuple[int, ...] | None:
    """The global shape `args` imply for `name`: a routed expert's FFN is `moe_ffn_hidden_size` wide, a shared
    expert's `moe_shared_expert_intermediate_size` (not `ffn_hidden_size`); None where no rule says."""
    width = None
    if _ROUTED_EXPERT.search(f".{name}"):
        width = as_int(args.get("moe_ffn_hidden_size"))
    elif ".mlp.shared_experts." in f".{name}":
        width = as_int(args.get("moe_shared_expert_intermediate_size"))
    if width:
        shapes = _global_shapes({**args, "ffn_hidden_size": width})
    return next((v for k, v in shapes.items() if name.endswith(k)), None)


def refuse_grouped_gemm(args: dict[str, Any], where: Path) -> None:
    """`--moe-grouped-gemm` (GroupedMLP / TEGroupedMLP: all of a rank's local experts in one `weight1` / `weight2`
    tensor, or TE's `linear_fc1.weight{j}`) has not been saved and read here (no GPU run made one): refused by name
    rather than read under the SequentialMLP layout."""
    if as_int(args.get("num_experts")) and args.get("moe_grouped_gemm"):
        raise UnsupportedCheckpoint(
            f"a Megatron-core Mixture-of-Experts run with --moe-grouped-gemm (num_experts={args.get('num_experts')}): "
            "ckpt reads the SequentialMLP expert layout (local_experts.{j}) only; the grouped-GEMM layout is not "
            "mapped yet",
            path=where,
        )


def expert_tp(args: dict[str, Any], tp: int) -> int:
    """The expert tensor-parallel size of a MoE run (Megatron's default: the TP size)."""
    return as_int(args.get("expert_tensor_parallel_size")) or tp


_FC1 = re.compile(r"(^|\.)linear_fc1\.(weight|bias)$")


def _rule(name: str, swiglu: bool = False, experts_replicated: bool = False) -> str | None:
    """The TP merge of `name`. With SwiGLU each TP rank's `linear_fc1` holds its slice of the gate, then its slice
    of the up projection: the shards merge per sub-parameter (`cat_sub:0`, 2 sub-parameters), so the logical
    tensor is [gate; up] as a TP=1 run holds it. `experts_replicated`: a MoE run at TP > 1 with expert TP 1,
    where every TP rank holds whole routed experts."""
    if experts_replicated and _ROUTED_EXPERT.search(f".{name}"):
        return "replicated"
    if swiglu and _FC1.search(name):
        return "cat_sub:0"
    return next((merge for pat, merge in _TP_RULES if pat.search(name)), None)


def open(path: Path) -> Checkpoint:  # noqa: A001  (the format-module interface)
    """The legacy-format iteration at `path` (the run folder, read through `latest_checkpointed_iteration.txt`,
    or an `iter_N` folder). Reads every rank's `mp_rank_*/model_optim_rng.pt` through the safe reader (the pickle
    parsed inert: tensors stay lazy ranges of the zip entries), and with the distributed optimizer each
    `distrib_optim.pt` beside it (its flat buffers mapped to parameters, checked against a few hundred bytes of
    each weight). TP shards become one TensorNode per parameter over its shards (merged when read), pipeline stages
    and virtual-pipeline chunks renumbered into global layers, EP ranks' experts given global ids. Training state:
    every rank file's param groups and scheduler (`training_state`)."""
    root, it, tag, cache, ranks, first, obj0, args = _first_rank(path)
    tp, pp, dp, ep, slots, sizes, vpp = _sizes(args, it)
    coords = functools.partial(_coords, ep)
    want = {(t, p) for t in range(tp) for p in range(slots)}
    gone = sorted(want - set(ranks))
    if gone:
        names = ", ".join(_dir_name(t, p, slots) for t, p in gone)
        raise MissingFile(
            f"rank folder(s) {names} missing (args: tensor_model_parallel_size={tp}, {sizes})",
            path=it,
            hint="copy every rank folder back; each holds that rank's shards and optimizer state",
        )
    warnings: list[Warning_] = []
    for key in sorted(set(ranks) - want):
        warnings.append(
            Warning_(
                "extra-rank-file",
                f"{ranks[key].name} is beyond the sizes args declare "
                f"(TP={tp}, PP={pp}{f', EP={ep}' if ep > 1 else ''}): left over from another run? Move it out of "
                "the folder",
                str(ranks[key].relative_to(root)),
            )
        )
    objs, files = _rank_files(want, ranks, cache, root, obj0, tp, pp, vpp, coords)
    if ep > 1:
        model, names_by_rank, local, origin, tied_copies = _model_ep(objs, ep, args, cache, ranks, root)
    else:
        model, names_by_rank, local, origin, tied_copies = _model(objs, tp, pp, args, cache, ranks, root)
    distributed = bool(args.get("use_distributed_optimizer")) or any((d / DISTRIB).is_file() for d in ranks.values())
    optim, groups, steps = _optimizer(
        objs, names_by_rank, local, model, origin, tp, distributed, cache, ranks, warnings, coords
    )
    tree: dict[str, Any] = {"model": GroupNode(model)}
    if tied_copies:
        tree["tied_copies"] = GroupNode(tied_copies)
    if optim is not None:
        tree["optimizer"] = optim
    mapped = optim is not None and "state" in optim.children
    if distributed and not mapped:
        tree["distributed_optimizer"] = _distrib_nodes(ranks, cache, root)
        where = next((str((d / DISTRIB).relative_to(root)) for d in ranks.values() if (d / DISTRIB).is_file()), None)
        warnings.append(
            Warning_(
                "not-mapped",
                f"the distributed optimizer's state ({DISTRIB}: flat fp32 master and "
                "Adam buffers per bucket) is shown as saved, not per parameter: set-lr/set-step "
                "edit its param groups; export, convert and to-universal refuse (they would leave "
                "the fp32 master and Adam moments behind)",
                where,
            )
        )
    sched = obj0.get("opt_param_scheduler") if isinstance(obj0.get("opt_param_scheduler"), dict) else None
    rel0 = cache.rel(first)
    if sched is not None:
        tree["scheduler"] = to_node(sched, rel0)
    tree["counters"] = GroupNode(
        {k: ValueNode(obj0.get(k)) for k in ("iteration", "checkpoint_version", "num_floating_point_operations_so_far")}
    )
    tree["args"] = to_node(args, rel0)
    warnings += _agreement(objs, ranks, root)
    warnings += group_warnings(groups, {n: tuple(t.shape) for n, t in model.items()}, args, rel0)
    warnings += cache.warnings()
    return _checkpoint(
        root, it, tag, obj0, args, (dp, tp, pp), model, tree, groups, steps, sched, files, warnings, distributed, mapped
    )


def _first_rank(path: Path) -> tuple[Path, Path, str, C.LoadCache, dict, Path, dict, dict[str, Any]]:
    """(run folder, iteration folder, tag, the load cache, the rank folders, the first rank file, its object, its
    `args`), refusing what is not a legacy iteration, a `latest` naming an absent one, and a rank file without
    args."""
    found = _locate(path)
    if found is None:
        raise NotACheckpoint("no Megatron-LM iteration folder (mp_rank_*/model_optim_rng.pt)", path=path)
    root, it, tag = found
    if not it.is_dir():
        have = sorted(d.name for d in root.iterdir() if _ITER_DIR.match(d.name))
        raise MissingFile(
            f"{LATEST} names {tag}, which is not here (iterations present: {', '.join(have) or 'none'})",
            path=root / LATEST,
            hint=f"copy {tag} back, or pass one of the iteration folders present",
        )
    cache = C.LoadCache(root)
    ranks = _rank_dirs(it)
    first = ranks[min(ranks)] / RANK_FILE
    if not first.is_file():
        raise MissingFile(f"{RANK_FILE} is missing", path=first.parent, hint="copy the rank folder back")
    obj0 = cache.load(first).obj
    args = args_of(obj0)
    if not args:
        raise CorruptCheckpoint(
            f"{first.name} holds no `args`",
            path=first,
            hint="Megatron-LM saves its launch arguments in every rank file",
        )
    return root, it, tag, cache, ranks, first, obj0, args


def _sizes(args: dict[str, Any], it: Path) -> tuple[int, int, int | None, int, int, str, int]:
    """(tp, pp, dp, ep, the second number of a rank key counts up to (EP or PP), the sizes named in errors, vpp),
    refusing the MoE layouts and multi-token prediction ckpt does not place."""
    tp = as_int(args.get("tensor_model_parallel_size")) or 1
    pp = as_int(args.get("pipeline_model_parallel_size")) or 1
    dp = as_int(args.get("data_parallel_size"))
    ep = as_int(args.get("expert_model_parallel_size")) or 1
    experts = as_int(args.get("num_experts")) or 0
    refuse_grouped_gemm(args, it)
    etp = expert_tp(args, tp)
    # EP > 1 with TP or PP > 1: mp_rank_TT_EEE / mp_rank_TT_PPP_EEE folders whose experts are split over expert TP;
    # at EP 1 the folders are the dense ones and the experts split over TP (expert TP = TP) or are whole (1)
    if experts and ((ep > 1 and (tp > 1 or pp > 1)) or (ep == 1 and etp not in (1, tp))):
        raise UnsupportedCheckpoint(
            f"a Megatron-LM legacy Mixture-of-Experts checkpoint with expert parallelism (EP={ep}) at TP={tp}, "
            f"PP={pp} (expert TP={etp}): ckpt reads legacy MoE rank folders at EP > 1 with TP 1 and PP 1, and at "
            "EP 1 with expert TP 1 or equal to TP, only yet",
            path=it,
        )
    # with EP > 1 (PP 1) the folders are mp_rank_00_EEE: the second number of a rank key is the EP rank
    slots = ep if ep > 1 else pp
    sizes = f"expert_model_parallel_size={ep}" if ep > 1 else f"pipeline_model_parallel_size={pp}"
    if as_int(args.get("mtp_num_layers")):
        raise UnsupportedCheckpoint(
            f"a Megatron-LM checkpoint with multi-token prediction (mtp_num_layers="
            f"{args.get('mtp_num_layers')}): its last stage holds its own embedding and MTP "
            "layers, which ckpt does not place yet",
            path=it,
        )
    vpp = as_int(args.get("virtual_pipeline_model_parallel_size")) or 0
    return tp, pp, dp, ep, slots, sizes, vpp


def _coords(ep: int, key: tuple[int, ...]) -> dict[str, int]:
    """A rank key's coordinates: (tp, ep) at EP > 1, else (tp, pp)."""
    return {"tp": key[0], "ep": key[1]} if ep > 1 else {"tp": key[0], "pp": key[1]}


def _rank_files(want, ranks, cache, root, obj0, tp, pp, vpp, coords) -> tuple[dict[tuple[int, int], dict], list]:
    """Every wanted rank's file loaded (inert) and checked against the first one (model chunks, iteration, TP/PP),
    and the files listed (with each `distrib_optim.pt`)."""
    objs: dict[tuple[int, int], dict] = {}
    files = []
    for key in sorted(want):
        f = ranks[key] / RANK_FILE
        if not f.is_file():
            raise MissingFile(
                f"{ranks[key].name}/{RANK_FILE} is missing",
                path=ranks[key],
                hint="copy the rank's file back from where the checkpoint was saved",
            )
        o = cache.load(f).obj
        if not isinstance(o, dict) or ("model" not in o and "model0" not in o):
            raise CorruptCheckpoint(f"{f.name} holds no `model`", path=f, hint="copy the rank's file back")
        chunks = sorted(k for k in o if isinstance(k, str) and re.fullmatch(r"model\d+", k))
        if (len(chunks) != vpp) if vpp else (chunks or "model" not in o):
            raise CorruptCheckpoint(
                f"{ranks[key].name}/{RANK_FILE} holds {len(chunks) or 1} model chunk(s) "
                f"({', '.join(chunks) or 'model'}) but args say virtual_pipeline_model_parallel_size"
                f"={vpp or None}: files from different runs?",
                path=f,
            )
        if as_int(o.get("iteration")) != as_int(obj0.get("iteration")):
            raise CorruptCheckpoint(
                f"{ranks[key].name} is from iteration {o.get('iteration')}, "
                f"{ranks[min(ranks)].name} from {obj0.get('iteration')}: a rank file from another "
                "save",
                path=f,
                hint="copy the rank folder of the same iteration back",
            )
        a = args_of(o)
        if (as_int(a.get("tensor_model_parallel_size")) or 1, as_int(a.get("pipeline_model_parallel_size")) or 1) != (
            tp,
            pp,
        ):
            raise CorruptCheckpoint(
                f"{ranks[key].name}'s args say TP={a.get('tensor_model_parallel_size')}, "
                f"PP={a.get('pipeline_model_parallel_size')}; {ranks[min(ranks)].name}'s TP={tp}, "
                f"PP={pp}: files from different runs",
                path=f,
            )
        objs[key] = o
        files.append(C.file_info(f, root, "model", coords(key)))
        if (ranks[key] / DISTRIB).is_file():
            files.append(C.file_info(ranks[key] / DISTRIB, root, "optimizer", coords(key)))
    return objs, files


def _checkpoint(
    root, it, tag, obj0, args, sizes, model, tree, groups, steps, sched, files, warnings, distributed, mapped
) -> Checkpoint:
    """The Checkpoint: LRs (and the scheduler's next one), counters, details, topology."""
    dp, tp, pp = sizes
    lrs = tuple(float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float)))
    max_lrs = tuple(float(g["max_lr"]) for g in groups if isinstance(g.get("max_lr"), (int, float)))
    nxt = tuple(next_lr(sched, g, args) for g in groups) if sched else ()
    counters = Counters(
        global_step=as_int(obj0.get("iteration")), optimizer_step=max(set(steps), key=steps.count) if steps else None
    )
    warnings += C.counter_warnings(counters, optimizer_steps_seen=steps)
    details = _details(obj0, args, model, groups, sched, nxt, "tied_copies" in tree, distributed, mapped)
    params = [n for n in model]
    dtypes = sorted({n.dtype for n in model.values()})
    return Checkpoint(
        format=FORMAT,
        path=str(root),
        topology=topology(args, dp, tp, pp),
        tree=GroupNode(tree),
        counters=counters,
        lr=LearningRates(param_groups=lrs, base_lrs=max_lrs or None, last_lr=nxt or None),
        parameter_count=sum(model[n].numel for n in params),
        parameter_tensors=len(params),
        files=tuple(files),
        warnings=tuple(warnings),
        dtypes=tuple(dtypes),
        details={"tag": tag if root != it else None, **details},
    )


def _details(obj0, args, model, groups, sched, nxt, tied, distributed, mapped) -> dict[str, Any]:
    """What `ckpt inspect` prints under details: iteration, the optimizer's kind, weights, experts, tied
    embeddings, the scheduler."""
    if distributed:
        details_distopt = "distributed (distrib_optim.pt), " + (
            "buckets mapped to parameters by Megatron's buffer layout" if mapped else "buckets not mapped"
        )
    details = {
        "iteration": obj0.get("iteration"),
        "checkpoint_version": obj0.get("checkpoint_version"),
        "consumed_train_samples": args.get("consumed_train_samples"),
        "floating_point_operations": obj0.get("num_floating_point_operations_so_far"),
        "optimizer": (details_distopt if distributed else "Adam (per-parameter state)")
        + chained_note(groups, len(_inner_parts(obj0.get("optimizer")))),
        "weights": "bf16/fp16 model, fp32 master in the optimizer" if mapped else "as saved in `model`",
    }
    if experts_note(model, args):
        details["experts"] = experts_note(model, args)
    if tied:
        details["tied_embeddings"] = (
            "output_layer.weight on the last pipeline stage is Megatron's copy of "
            "embedding.word_embeddings.weight (tied; kept equal by the embedding group's "
            "all-reduce): shown under tied_copies, counted once"
        )
    if sched:
        details["scheduler"] = (
            f"OptimizerParamScheduler num_steps={sched.get('num_steps')} "
            f"({_sched_unit(args)}), "
            f"{sched.get('lr_decay_style')}, warmup {sched.get('lr_warmup_steps')}, "
            f"decay {sched.get('lr_decay_steps')}; next LR {', '.join(f'{x:.6g}' for x in nxt)}"
        )
    return details


def topology(args: dict[str, Any], dp: int | None, tp: int, pp: int) -> Topology:
    """The parallel sizes `args` declares (expert parallelism and virtual pipeline chunks where set)."""
    ep = as_int(args.get("expert_model_parallel_size"))
    moe = bool(as_int(args.get("num_experts")))
    return Topology(
        dp=dp,
        tp=tp,
        pp=pp,
        zero_stage=None,
        ep=ep if (moe or (ep or 1) > 1) else None,
        vpp=as_int(args.get("virtual_pipeline_model_parallel_size")),
    )


def _dir_name(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "")


def _model(objs, tp, pp, args, cache, ranks, root):
    """(global name -> TensorNode over the TP shards, {(tp, pp): [local names in model order]},
    {(tp, pp): {local name: TensorRef}}, {global name: (stage, local name)}, {tied copies}). Stages and model
    chunks number their layers from 0: chunk c of stage p starts at global layer c * pp * per_chunk + p * per_chunk
    (uneven stage sizes are refused)."""
    layers = as_int(args.get("num_layers")) or 0
    vpp = as_int(args.get("virtual_pipeline_model_parallel_size")) or 0
    if pp > 1 and (
        args.get("decoder_first_pipeline_num_layers")
        or args.get("decoder_last_pipeline_num_layers")
        or args.get("pipeline_model_parallel_layout")
        or layers % (pp * max(vpp, 1))
    ):
        raise UnsupportedCheckpoint(
            "a Megatron-LM checkpoint with uneven pipeline stages: ckpt does not renumber their layers yet", path=root
        )
    # tied embeddings with PP > 1: the last stage keeps `output_layer.weight` as a copy of the first stage's word
    # embeddings (Megatron's embedding group all-reduces their gradients so that both stay equal); Megatron's own
    # converters read the first stage's. Counted once; the copy is shown apart (`tied_copies`).
    tied = pp > 1 and not args.get("untie_embeddings_and_output_weights")
    names_by_rank: dict[tuple[int, int], list[str]] = {}
    local: dict[tuple[int, int], dict[str, TensorRef]] = {}
    for (t, p), o in sorted(objs.items()):
        refs = {}
        for c, m in enumerate([o[f"model{c}"] for c in range(vpp)] if vpp else [o["model"]]):
            if isinstance(m, dict):
                refs.update({_local(c, str(k), vpp): v for k, v in m.items() if isinstance(v, TensorRef)})
        names_by_rank[(t, p)] = list(refs)  # in model order, chunk after chunk (as Megatron builds its groups)
        local[(t, p)] = refs
    model, origin, tied_copy = _merge_stages(names_by_rank, local, tp, pp, vpp, tied, args, cache, ranks, root)
    found = {int(m[2]) for n in model if (m := _LAYER.match(n))}
    if found != set(range(layers)):
        gone = sorted(set(range(layers)) - found)
        raise CorruptCheckpoint(
            f"args say num_layers={layers} but the rank files hold layers "
            f"{_ranges(sorted(found))}: layer(s) {_ranges(gone)} missing",
            path=root,
            hint="the args and the files disagree: files from different runs?",
        )
    _check_experts(model, args, root)
    if tied and "embedding.word_embeddings.weight" not in model and tied_copy:
        raise CorruptCheckpoint(
            "the last pipeline stage holds output_layer.weight, tied to word embeddings no "
            "stage holds: files from different runs?",
            path=root,
        )
    copies = {}
    for p, key in tied_copy:
        shards = tuple(
            tensor_node(local[(t, p)][key], cache.rel(ranks[(t, p)] / RANK_FILE), {"tp": t, "pp": p}) for t in range(tp)
        )
        word = model.get("embedding.word_embeddings.weight")
        copies[f"output_layer.weight (stage {p})"] = (
            shards[0] if tp == 1 else TensorNode(word.shape, shards[0].dtype, shards=shards, merge=word.merge)
        )
    return model, names_by_rank, local, origin, copies


def _merge_stages(names_by_rank, local, tp, pp, vpp, tied, args, cache, ranks, root):
    """(global name -> TensorNode over its TP shards, {global name: (stage, local name)}, [(stage, local name) of
    each tied output-layer copy]): every stage's parameters renumbered into global layers and merged over TP by
    their rule, checked against the shapes `args` imply; a parameter no rule covers is refused by name."""
    layers = as_int(args.get("num_layers")) or 0
    # Megatron's layer offset: model chunk c (virtual pipeline rank) of stage p starts at global layer
    # c * pp * per_chunk + p * per_chunk (per_chunk = layers / (pp * vpp); without a virtual pipeline c = 0)
    per_chunk = layers // (pp * max(vpp, 1)) if pp else layers
    shapes = _global_shapes(args)
    tied_copy: list[tuple[int, str]] = []  # (stage, local name)
    model: dict[str, TensorNode] = {}
    origin: dict[str, tuple[int, str]] = {}  # global name -> (pipeline stage, the stage's own name for it)
    bad: list[str] = []
    for p in range(pp):
        for key in names_by_rank[(0, p)]:
            c, name = _chunk_of(key)
            start = c * pp * per_chunk + p * per_chunk
            lm = _LAYER.match(name)
            if lm and int(lm[2]) >= per_chunk:
                raise CorruptCheckpoint(
                    f"{_dir_name(0, p, pp)} holds local layer {lm[2]} but args (num_layers="
                    f"{layers}, PP={pp}{f', VPP={vpp}' if vpp else ''}) give each model chunk "
                    f"{per_chunk}: the args and the files disagree",
                    path=ranks[(0, p)] / RANK_FILE,
                )
            g = _LAYER.sub(lambda mm: f"{mm[1]}{int(mm[2]) + start}{mm[3]}", name)
            if g in model:
                raise CorruptCheckpoint(
                    f"{g} is held by two pipeline ranks (stage {origin[g][0]} and {p}): the "
                    "args' layer split does not match the files",
                    path=ranks[(0, p)] / RANK_FILE,
                )
            if p > 0 and name == "output_layer.weight" and tied:
                tied_copy.append((p, key))  # the word embeddings' copy, not a parameter of its own
                continue
            origin[g] = (p, key)
            shards = []
            for t in range(tp):
                ref = local[(t, p)].get(key)
                if ref is None:
                    raise CorruptCheckpoint(
                        f"{_dir_name(t, p, pp)} has no {name} while {_dir_name(0, p, pp)} "
                        "has it: files from different runs",
                        path=ranks[(t, p)] / RANK_FILE,
                    )
                shards.append(tensor_node(ref, cache.rel(ranks[(t, p)] / RANK_FILE), {"tp": t, "pp": p}))
            if tp == 1:
                model[g] = shards[0]
                continue
            merge = _rule(name, bool(args.get("swiglu")), experts_replicated=expert_tp(args, tp) == 1)
            if merge is None:
                bad.append(name)
                continue
            shape = merged_shape(merge, shards[0].shape, tp)
            if any(s.shape != shards[0].shape for s in shards):
                raise CorruptCheckpoint(
                    f"{name}: TP shards of different shapes ({', '.join(str(tuple(s.shape)) for s in shards)})",
                    path=ranks[(0, p)],
                )
            expect = _expected_shape(name, shapes, args)
            if expect is not None and tuple(shape) != tuple(expect):
                raise CorruptCheckpoint(
                    f"{name}: TP shards {tuple(shards[0].shape)} x {tp} merge ({merge}) to "
                    f"{tuple(shape)}, but args imply {tuple(expect)}",
                    path=ranks[(0, p)],
                    hint="the args and the files disagree: files from different runs?",
                )
            value = shards[0].value if merge == "replicated" and math.prod(shape) == 1 else None
            model[g] = TensorNode(tuple(shape), shards[0].dtype, shards=tuple(shards), merge=merge, value=value)
    if bad:
        raise UnsupportedCheckpoint(
            f"no TP merge rule for {len(bad)} parameter(s) of this Megatron-LM checkpoint "
            f"({', '.join(bad[:4])}{' …' if len(bad) > 4 else ''}): ckpt will not guess how "
            "their shards form the tensor",
            path=root,
        )
    return model, origin, tied_copy


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def _model_ep(objs, ep, args, cache, ranks, root):
    """`_model` for expert parallelism (EP > 1, TP 1, PP 1: folders mp_rank_00_EEE, keyed (0, e)). Each EP rank's
    file holds the dense parameters (replicas over the data-parallel group: EP rank 0's are read) and its own
    experts under LOCAL ids `decoder.layers.L.mlp.experts.local_experts.{j}.…`; EP rank e holds global experts
    e * n .. e * n + n - 1 (n = num_experts / EP, Megatron-core's `local_expert_indices`). Named here by their
    GLOBAL id, as an EP 1 run names them. Every layer must hold all num_experts experts; every EP rank the same
    dense parameters."""
    experts = as_int(args.get("num_experts")) or 0
    layers = as_int(args.get("num_layers")) or 0
    if not experts or experts % ep:
        raise CorruptCheckpoint(
            f"args say expert_model_parallel_size={ep} but num_experts={args.get('num_experts')}: the experts do not "
            "split evenly over the expert-parallel ranks",
            path=root,
        )
    per = experts // ep
    names_by_rank: dict[tuple[int, int], list[str]] = {}
    local: dict[tuple[int, int], dict[str, TensorRef]] = {}
    for key, o in sorted(objs.items()):
        m = o.get("model") if isinstance(o.get("model"), dict) else {}
        local[key] = {str(k): v for k, v in m.items() if isinstance(v, TensorRef)}
        names_by_rank[key] = list(local[key])
    dense0 = [n for n in names_by_rank[(0, 0)] if not _LOCAL_EXPERT.match(n)]
    placed: dict[str, tuple[str, tuple[int, int]]] = {}  # global name -> (local name, rank key)
    for key in sorted(objs):
        e = key[1]
        dense = [n for n in names_by_rank[key] if not _LOCAL_EXPERT.match(n)]
        if dense != dense0:
            raise CorruptCheckpoint(
                f"{ranks[key].name} holds other dense (non-expert) parameters than {ranks[(0, 0)].name}: files from "
                "different runs",
                path=ranks[key] / RANK_FILE,
            )
        for n in names_by_rank[key]:
            m = _LOCAL_EXPERT.match(n)
            if m is None:
                if e == 0:
                    placed[n] = (n, key)
                continue
            if int(m[3]) >= per:
                raise CorruptCheckpoint(
                    f"{ranks[key].name} holds local expert {m[3]} but args (num_experts={experts}, EP={ep}) give "
                    f"each expert-parallel rank {per}: the args and the files disagree",
                    path=ranks[key] / RANK_FILE,
                )
            placed[f"{m[1]}{e * per + int(m[3])}{m[4]}"] = (n, key)
    # the order of an EP 1 run: each layer's experts 0 .. num_experts - 1 where EP rank 0's local experts are
    at = {n: i for i, n in enumerate(names_by_rank[(0, 0)])}
    block = {}  # a layer's expert prefix -> where its first local expert starts on EP rank 0
    for n, i in at.items():
        if m := _LOCAL_EXPERT.match(n):
            block.setdefault(m[1], i)

    def order(g: str) -> tuple[int, int, int]:
        m = _LOCAL_EXPERT.match(g)
        if m is None:
            return (at[g], 0, 0)
        return (block.get(m[1], len(at)), int(m[3]), at.get(f"{m[1]}0{m[4]}", 0))

    model: dict[str, TensorNode] = {}
    origin: dict[str, tuple[int, str]] = {}
    for g in sorted(placed, key=order):
        n, key = placed[g]
        model[g] = tensor_node(local[key][n], cache.rel(ranks[key] / RANK_FILE), {"ep": key[1]})
        origin[g] = (key[1], n)
    found = {int(m[2]) for n in model if (m := _LAYER.match(n))}
    if found != set(range(layers)):
        raise CorruptCheckpoint(
            f"args say num_layers={layers} but the rank files hold layers {_ranges(sorted(found))}",
            path=root,
            hint="the args and the files disagree: files from different runs?",
        )
    _check_experts(model, args, root)
    return model, names_by_rank, local, origin, {}


def _check_experts(model: dict[str, TensorNode], args: dict[str, Any], root: Path) -> None:
    """Declared vs found for a MoE run (`num_experts` set): some layer holds routed experts, and every layer that
    holds a router or any expert holds all num_experts of them, by global id."""
    experts = as_int(args.get("num_experts")) or 0
    if not experts:
        return
    held: dict[int, set[int]] = {}
    for g in model:
        if m := _LOCAL_EXPERT.match(g):
            held.setdefault(int(m[2]), set()).add(int(m[3]))
        elif (m := _LAYER.match(g)) and m[3].startswith(".mlp.router."):
            held.setdefault(int(m[2]), set())
    if not held:
        raise CorruptCheckpoint(
            f"args say num_experts={experts} but no layer holds a router or routed experts "
            "(`decoder.layers.L.mlp.experts.local_experts.*`): the args and the files disagree",
            path=root,
        )
    short = {layer: ids for layer, ids in held.items() if ids != set(range(experts))}
    if short:
        layer, ids = sorted(short.items())[0]
        raise CorruptCheckpoint(
            f"args say num_experts={experts} but layer {layer} holds experts {_ranges(sorted(ids))}: an "
            "expert-parallel rank's experts are missing",
            path=root,
        )


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out) or "none"


def _local(chunk: int, name: str, vpp: int) -> str:
    """A rank's own name for a tensor: `name`, or `model<c>/name` in model chunk c of a virtual pipeline."""
    return f"model{chunk}/{name}" if vpp else name


def _chunk_of(key: str) -> tuple[int, str]:
    head, sep, rest = key.partition("/")
    return (int(head[5:]), rest) if sep and head.startswith("model") and head[5:].isdigit() else (0, key)


def chained_note(groups: list[dict], inner: int) -> str:
    """ ", a ChainedOptimizer of 2 (dense, expert): param groups 0 dense, …" for a chained optimizer, else ""."""
    if inner < 2:
        return ""
    kinds = ", ".join(f"{i} {'expert' if g.get('is_expert_parallel') else 'dense'}" for i, g in enumerate(groups))
    return f", a ChainedOptimizer of {inner} (dense, expert): param groups {kinds}"


def experts_note(model: dict[str, TensorNode], args: dict) -> str | None:
    """What inspect says of a Mixture-of-Experts model: experts per MoE layer, which global ids each expert-parallel
    rank holds, the expert and dense parameters (tensors, elements), from the parameters read (global expert ids)
    and the args; None for a dense model."""
    experts = as_int(args.get("num_experts")) or 0
    if not experts:
        return None
    ep = as_int(args.get("expert_model_parallel_size")) or 1
    per_layer: dict[str, set[int]] = {}
    routed = [n for n in model if _LOCAL_EXPERT.match(n)]
    for n in routed:
        m = _LOCAL_EXPERT.match(n)
        per_layer.setdefault(m[2], set()).add(int(m[3]))
    shared = [n for n in model if ".mlp.shared_experts." in n]
    gated = " (sigmoid-gated)" if any(n.endswith(".shared_experts.gate_weight") for n in shared) else ""
    dense = [n for n in model if n not in set(routed) and n not in set(shared)]
    per = experts // ep if experts % ep == 0 else None
    ranks = "; ".join(f"EP rank {r}: {r * per}-{r * per + per - 1}" for r in range(ep)) if per and ep > 1 else "EP 1"
    counts = sorted({len(v) for v in per_layer.values()})
    return (
        f"{'/'.join(map(str, counts)) or 0} of num_experts={experts} in each of {len(per_layer)} MoE layer(s), by "
        f"global id ({ranks}); routed experts {len(routed)} tensors, {sum(model[n].numel for n in routed):,} "
        f"elements"
        + (
            f"; shared experts {len(shared)} tensors, {sum(model[n].numel for n in shared):,} elements{gated}"
            if shared
            else ""
        )
        + f"; dense {len(dense)} tensors, {sum(model[n].numel for n in dense):,} elements"
    )


def _distrib_nodes(ranks, cache, root) -> GroupNode:
    out = {}
    for (t, p), d in sorted(ranks.items()):
        f = d / DISTRIB
        if f.is_file():
            out[d.name] = to_node(cache.load(f).obj, cache.rel(f))
    return GroupNode(out)


def _agreement(objs, ranks, root) -> list[Warning_]:
    """Every rank file must hold the same param-group LRs and scheduler (Megatron saves one copy per rank and each
    rank resumes from its own): a rank edited alone runs at another LR with no error."""
    out = []
    ref_key = min(objs)

    def lrs(o):  # every inner optimizer's groups (a ChainedOptimizer saves a list of them)
        parts = [p for p in _inner_parts(o.get("optimizer")) if isinstance(p, dict)]
        return [
            tuple(g.get(k) for k in ("lr", "max_lr", "min_lr"))
            for inner in inner_optimizers(parts)
            for g in inner.get("param_groups") or []
            if isinstance(g, dict)
        ]

    ref = (lrs(objs[ref_key]), repr(objs[ref_key].get("opt_param_scheduler")))
    odd = [ranks[k].name for k, o in sorted(objs.items()) if (lrs(o), repr(o.get("opt_param_scheduler"))) != ref]
    if odd:
        out.append(
            Warning_(
                "lr-mismatch",
                f"{', '.join(odd)} hold other param-group LRs or scheduler state than "
                f"{ranks[ref_key].name}: those ranks resume at another LR (edit every rank file, e.g. "
                "with ckpt set-lr on the iteration folder)",
                str(ranks[ref_key].relative_to(root)),
            )
        )
    return out


def next_lr(sched: dict, group: dict, args: dict | None = None) -> float:
    """The LR Megatron's OptimizerParamScheduler gives `group` at the saved `num_steps` (what the first resumed
    iteration uses): `schedules.megatron.lr_at` between the group's max_lr and min_lr, with the warm-up's start
    (`lr_warmup_init`) and a WSD schedule's decay length from the saved `args`, times the group's lr_mult."""
    args = args or {}
    gbs = args.get("global_batch_size")
    wsd = args.get("lr_wsd_decay_samples") or (
        args["lr_wsd_decay_iters"] * gbs if args.get("lr_wsd_decay_iters") and isinstance(gbs, int) else None
    )
    try:
        lr = lr_at(
            float(sched.get("num_steps") or 0),
            max_lr=float(group.get("max_lr", sched.get("max_lr"))),
            min_lr=float(group.get("min_lr", sched.get("min_lr"))),
            warmup=float(sched.get("lr_warmup_steps") or 0),
            decay=float(sched.get("lr_decay_steps") or 0),
            style=str(sched.get("lr_decay_style")),
            init_lr=float(args.get("lr_warmup_init") or 0.0),
            wsd_decay=wsd,
            wsd_style=args.get("lr_wsd_decay_style"),
        )
    except ValueError as e:
        raise UnsupportedCheckpoint(f"Megatron LR schedule: {e}") from None
    return lr * float(group.get("lr_mult", 1.0) or 1.0)


def training_state(ck: Checkpoint):
    """Every rank file holds the param groups (and the distributed optimizer's `param_groups` too) and a copy of
    the scheduler: an edit goes to all of them. A rank file holds ONE Megatron optimizer and its scheduler, even
    where that optimizer is a ChainedOptimizer saved as a list of inner ones (MoE: dense, expert): index 0 for all,
    so their groups share the one scheduler (by list position the expert one would count as a second optimizer,
    and the scheduler would be edited once for each)."""
    root = Path(ck.path)
    srcs = [StateSource(root / f.path, f.path, index=0) for f in ck.files if f.path.endswith(RANK_FILE)]
    return StateMap(root, tuple(srcs))


__all__ = [
    "sniff",
    "open",
    "training_state",
    "next_lr",
    "args_of",
    "inner_optimizers",
    "expert_parallel",
    "declared_groups",
    "missing_groups",
    "FORMAT",
]


def _sched_unit(args: dict) -> str:
    """What Megatron's scheduler counts: samples (a sample-based run or a global batch over 1), else steps."""
    per_sample = args.get("train_samples") is None and (as_int(args.get("global_batch_size")) or 1) > 1
    return "samples" if per_sample else "steps"
