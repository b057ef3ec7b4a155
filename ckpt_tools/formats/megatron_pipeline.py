"""DeepSpeed pipeline checkpoints as Megatron-DeepSpeed writes them: tensor x pipeline x data parallel.

Layout of a tag folder (docs/formats.md):

- `layer_LL-model_TT-model_states.pt`: the module weights of pipeline layer spec LL on TP rank TT, under
  the layer's LOCAL names (`input_layernorm.weight`; a bare LayerNorm layer holds `weight`/`bias`).
  Written by DP rank 0 only. Layers without parameters (functions) have no file.
- `mp_rank_MM_model_states.pt`, MM = pp_stage x tp + tp_rank: `module` is None; `param_shapes` names the
  stage's parameters the DeepSpeed way, `<LL>.<local name>` without zero padding ("2.input_layernorm.weight");
  `mp_world_size` counts pipeline x tensor ranks; client state (`args`, `iteration`, `torch_rng_state`,
  `universal_checkpoint_info`, ...).
- `[bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt`: the flat ZeRO-1/2 optimizer partitions of one
  model-parallel rank, un-flattened by `deepspeed.read_zero_optimizer` exactly as for plain ZeRO.

The tree has one logical tensor per DeepSpeed parameter name (`model.2.self_attention.dense.weight`,
`optimizer.state.2.self_attention.dense.weight.exp_avg`) with the full shape; its `shards` are the TP
ranks' tensors and `merge` says how they combine ("replicated", "cat:0", "cat:1"), decided by
`ckpt_tools.read.tp_layout` from the checkpoint's `universal_checkpoint_info` or, without one, the Megatron
naming preset. The source used is in `Checkpoint.details["tp_layout"]`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpoint, MissingFile
from ..read.pickle_reader import Opaque, TensorRef
from ..read.tp_layout import SOURCE_INFO, TPLayout, merged_shape
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
from . import deepspeed as D
from ._protocol import UniversalSource

FORMAT = "deepspeed_pipeline"
MARKER = "layer_*-model_*-model_states.pt"
_LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
_NAME_RE = re.compile(r"^(\d+)\.(.+)$")
_TIED_RE = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")
_SAME_ACROSS_RANKS = ("global_steps", "global_samples", "skipped_steps", "iteration")


def sniff(path: Path) -> bool:
    if not path.is_dir():
        return False
    if any(path.glob(MARKER)):
        return True
    tag = C.read_latest(path)
    return bool(tag) and (path / tag).is_dir() and any((path / tag).glob(MARKER))


def layer_file_name(layer: int, tp_rank: int) -> str:
    return f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt"


def list_layer_files(tag_dir: Path) -> dict[tuple[int, int], Path]:
    """(layer index, TP rank) -> file, for every `layer_LL-model_TT-model_states.pt` in the tag folder."""
    out = {}
    for p in sorted(tag_dir.iterdir()):
        m = _LAYER_RE.match(p.name)
        if m:
            out[(int(m[1]), int(m[2]))] = p
    return out


def universal_source(path: Path, tp_patterns: tuple[str, ...] = ()) -> UniversalSource:
    """For `ckpt to-universal`: the pipeline's layer files merged by the user's TP patterns, and its tag folder."""
    ck = open(path, tp_patterns=tuple(tp_patterns))
    _, tag_dir, _ = C.resolve_tag(path, MARKER)
    return UniversalSource(ck, tag_dir, "pipeline", path)


def open(path: Path, *, tp_patterns: tuple[str, ...] = ()) -> Checkpoint:  # noqa: A001  (format-module interface)
    """Open a pipeline checkpoint (tag folder, or its parent with `latest`). `tp_patterns` are user
    `REGEX[=MERGE]` overrides of the TP merge rules (see `TPLayout.from_user_patterns`). Reads (inert) every
    `mp_rank_XX_model_states.pt` (param shapes per stage and TP rank, counters, scheduler, config), the
    `layer_LL-model_TT-model_states.pt` files that hold the parameters (one TensorNode per parameter over its TP
    shards, merged when read) and the ZeRO `*_optim_states.pt` of every rank; tensors stay lazy. Training state:
    as for DeepSpeed, the tag folder's model- and optim-states files (`training_state`)."""
    root, tag_dir, tag = C.resolve_tag(path, MARKER)
    return _Reader(root, tag_dir, tag, tuple(tp_patterns)).build()


class _Reader:
    """One `open` call: the files, the per-rank metadata, the warnings collected on the way."""

    def __init__(self, root: Path, tag_dir: Path, tag: str | None, tp_patterns: tuple[str, ...]):
        self.root, self.tag_dir, self.tag = root, tag_dir, tag
        self.cache = C.LoadCache(root)
        self.warnings: list[Warning_] = []
        self.layer_files = list_layer_files(tag_dir)
        self.ranks = D.list_rank_files(tag_dir)
        self.tp_patterns = tp_patterns

    def rel(self, p: Path) -> str:
        return self.cache.rel(p)

    def warn(self, code: str, message: str, path: Path | str | None = None) -> None:
        self.warnings.append(Warning_(code, message, self.rel(path) if isinstance(path, Path) else path))

    # --- topology ---------------------------------------------------------------------------------

    def _model_states(self, mp_rank: int) -> dict:
        rf = self.ranks.get(mp_rank)
        if rf is None or rf.model_states is None:
            raise MissingFile(
                f"mp_rank_{mp_rank:02d}_model_states.pt is missing",
                path=self.tag_dir,
                hint="re-copy the tag folder; every pipeline/tensor-parallel rank's file is needed",
            )
        ms = self.cache.load(rf.model_states).obj
        if not isinstance(ms, dict):
            raise CorruptCheckpoint("model states file does not hold a dict", path=rf.model_states)
        return ms

    def topology(self, ms0: dict) -> tuple[int, int, int, str]:
        """(tp, pp, dp, how tp/pp were decided). `mp_world_size` counts pp x tp ranks here, so tp comes
        from DeepSpeed's own `checkpoint_parallel_dimensions`, else Megatron's `args`, else the layer files'
        TP ranks; every other witness is checked against it."""
        mp = as_int(ms0.get("mp_world_size")) or len(self.ranks)
        dims = (
            ms0.get("checkpoint_parallel_dimensions")
            if isinstance(ms0.get("checkpoint_parallel_dimensions"), dict)
            else {}
        )
        args = ms0.get("args")
        args = (
            args.state
            if isinstance(args, Opaque) and isinstance(args.state, dict)
            else (args if isinstance(args, dict) else {})
        )
        tp_files = 1 + max(t for _, t in self.layer_files)
        witnesses = {
            "checkpoint_parallel_dimensions": (as_int(dims.get("tp_degree")), as_int(dims.get("pp_degree"))),
            "args": (as_int(args.get("tensor_model_parallel_size")), as_int(args.get("pipeline_model_parallel_size"))),
            "layer files": (tp_files, None),
        }
        source, (tp, pp) = next(((k, v) for k, v in witnesses.items() if v[0]), ("layer files", (tp_files, None)))
        if not pp:
            pp = witnesses["args"][1] if source != "args" and witnesses["args"][1] else None
        if not pp:
            pp = mp // tp if mp % tp == 0 else None
        if not pp:
            raise CorruptCheckpoint(
                f"mp_world_size={mp} is not a multiple of the TP size {tp}",
                path=self.ranks[min(self.ranks)].model_states,
                hint="the files come from different runs",
            )
        for name, (wtp, wpp) in witnesses.items():
            # layer files of other TP ranks are reported file by file (missing: error; extra: warning)
            if name != "layer files" and ((wtp and wtp != tp) or (wpp and wpp != pp)):
                self.warn("topology-mismatch", f"{name} says tp={wtp}, pp={wpp}; {source} says tp={tp}, pp={pp}")
        if tp * pp != mp:
            self.warn("topology-mismatch", f"mp_world_size={mp} but tp x pp = {tp} x {pp}")
        dp = as_int(ms0.get("dp_world_size")) or max(len(self.ranks[min(self.ranks)].optim), 1)
        if as_int(args.get("data_parallel_size")) not in (None, dp):
            self.warn(
                "topology-mismatch",
                f"args say data_parallel_size={args.get('data_parallel_size')}, model states say dp_world_size={dp}",
            )
        return tp, pp, dp, source

    # --- names -> layer files ---------------------------------------------------------------------

    def _check_layer_files(self, layer_stage: dict[int, int], tp: int) -> None:
        """Every (layer, TP rank) the stages' param_shapes need must exist; others are warned about."""
        for layer, stage in sorted(layer_stage.items()):
            for t in range(tp):
                if (layer, t) not in self.layer_files:
                    raise MissingFile(
                        f"{layer_file_name(layer, t)} is missing (layer {layer} of pipeline stage "
                        f"{stage}, TP rank {t} of {tp})",
                        path=self.tag_dir,
                        hint="re-copy the tag folder; every layer's file on every TP rank is needed",
                    )
        for (layer, t), p in sorted(self.layer_files.items()):
            if t >= tp:
                self.warn(
                    "extra-rank-file",
                    f"{p.name} is for TP rank {t}, beyond tp={tp}: left over from "
                    "another run? Move it out of the folder",
                    p,
                )
            elif layer not in layer_stage and t == 0:
                self.warn(
                    "extra-layer-file",
                    f"no stage's param_shapes names a parameter of layer {layer} "
                    f"({p.name}): left over from another run, or a layer with buffers only",
                    p,
                )

    def _check_optim_files(self, mp: int, dp: int) -> None:
        """`_check_rank_files` checks the DP files of a rank that has some; a model-parallel rank with none
        at all, while others have theirs, has lost its optimizer state too."""
        having = [rf for mm, rf in sorted(self.ranks.items()) if mm < mp and rf.optim]
        if not having:
            return
        prefix = next(iter(having[0].optim.values())).name.split("zero_pp_rank_")[0]
        for mm in range(mp):
            if not self.ranks[mm].optim:
                raise MissingFile(
                    f"{prefix}zero_pp_rank_0_mp_rank_{mm:02d}_optim_states.pt is missing "
                    f"(mp_rank {mm:02d} has no optimizer files; dp_world_size={dp})",
                    path=self.tag_dir,
                    hint="re-copy the tag folder; every rank's optimizer file is needed",
                )

    def _shard_ref(self, name: str, stage: int, t: int, stage_layers: list[int]) -> tuple[TensorRef, Path]:
        m = _NAME_RE.match(name)
        if m:
            candidates, local = [int(m[1])], m[2]
        else:
            # tied modules (`tied_modules.<key>.<local>`) are saved in the file of each layer that uses them
            tied = _TIED_RE.match(name)
            candidates, local = (stage_layers, tied[2]) if tied else (stage_layers, name)
        for layer in candidates:
            p = self.layer_files.get((layer, t))
            if p is None:
                continue
            obj = self.cache.load(p).obj
            ref = obj.get(local) if isinstance(obj, dict) else None
            if isinstance(ref, TensorRef):
                return ref, p
        if m:
            p = self.layer_files[(int(m[1]), t)]
            raise CorruptCheckpoint(
                f"no tensor '{local}' for parameter {name} (named by mp_rank {stage * self.tp + t:02d}'s param_shapes)",
                path=p,
                hint="the layer file and the model states come from different runs",
            )
        raise CorruptCheckpoint(
            f"no layer file of pipeline stage {stage} holds parameter {name}",
            path=self.tag_dir,
            hint="re-copy the tag folder",
        )

    def _cross_check_layout(self, layout: TPLayout, rules: dict, swiglu: bool) -> None:
        """Where the checkpoint's own info and the Megatron naming convention disagree, say so: an info
        whose pattern misses a replica (Megatron names the position embedding `tied_modules.embed...`
        even when untied) makes DeepSpeed's converter concatenate the replicas, silently."""
        if layout.source != SOURCE_INFO:
            return
        preset = TPLayout.megatron_preset(swiglu=swiglu)
        differ = [
            (n, r.merge, p.merge)
            for n, r in rules.items()
            if r.source == SOURCE_INFO and (p := preset.rule(n)).merge is not None and p.merge != r.merge
        ]
        if differ:
            shown = ", ".join(f"{n}: {a} (info) vs {b}" for n, a, b in differ[:5])
            self.warn(
                "tp-layout-disagrees",
                f"universal_checkpoint_info and the Megatron naming convention "
                f"disagree for {len(differ)} parameters ({shown}{', ...' if len(differ) > 5 else ''}); "
                "the info is followed, as DeepSpeed's ds_to_universal does. Check its patterns",
            )

    def _module_order(self, names: list[str]):
        """Sort key: layer index, then the layer file's own (module) order; param_shapes lists names by
        param group, which scatters a layer's tensors."""
        index = {n: i for i, n in enumerate(names)}
        positions: dict[int, dict[str, int]] = {}  # layer -> its file's key -> position

        def key(name: str) -> tuple:
            m = _NAME_RE.match(name)
            if not m or (int(m[1]), 0) not in self.layer_files:
                return (math.inf, 0, index[name])
            layer = int(m[1])
            pos = positions.get(layer)
            if pos is None:
                obj = self.cache.load(self.layer_files[(layer, 0)]).obj
                pos = positions[layer] = {k: i for i, k in enumerate(obj)} if isinstance(obj, dict) else {}
            return (layer, pos.get(m[2], len(pos)), index[name])

        return key

    # --- the whole checkpoint -----------------------------------------------------------------------

    def build(self) -> Checkpoint:
        """The checkpoint: topology from the rank files' metadata, one TP-merged tensor per parameter out of the
        layer files, the optimizer read by DeepSpeed's own rules per model-parallel rank and merged across TP,
        scheduler, counters, config, and the warnings collected on the way."""
        if not self.ranks:
            raise MissingFile(
                "mp_rank_00_model_states.pt is missing (no mp_rank_*_model_states.pt files)",
                path=self.tag_dir,
                hint="re-copy the tag folder",
            )
        ms0 = self._model_states(0)
        tp, pp, dp, topo_source = self.topology(ms0)
        self.tp = tp
        mp = tp * pp
        D._check_rank_files(self.tag_dir, self.ranks, dp, mp, self.warnings)
        self._check_optim_files(mp, dp)
        states = {mm: self._model_states(mm) for mm in range(mp)}

        info = ms0.get("universal_checkpoint_info")
        args = ms0.get("args")
        swiglu = bool(args.field("swiglu")) if isinstance(args, Opaque) else False
        layout = TPLayout.for_checkpoint(
            info if isinstance(info, dict) else None, user_patterns=self.tp_patterns, swiglu=swiglu
        )
        shape_groups, local_shapes, stage_layers = self._stages(states, mp, tp, pp)
        model, rules, stage_of = self._model(layout, local_shapes, stage_layers, tp, pp)
        self._cross_check_layout(layout, rules, swiglu)
        self._unknown_rules(layout, rules)
        param_names = [n for n in model]
        param_count = sum(
            model[n].numel if rules[n].merge else sum(s.numel for s in model[n].shards) for n in param_names
        )
        opts = self._read_optimizers(states, shape_groups, mp, tp, dp)
        tree: dict[str, Any] = {"model": GroupNode(model)}
        steps_seen, lrs, stage, opt_dtype = self._optimizer_summary(opts, tree, ms0, model, rules, stage_of, tp)
        sched_node = self._rest_of_tree(tree, ms0, info)
        self._compare_ranks(states, tp, pp)
        sched = C.scheduler_fields(sched_node)
        last_epoch, step_count = C.scheduler_counters(sched)
        base_lrs, last_lr = C.lr_from_scheduler(sched)
        counters = Counters(
            global_step=as_int(ms0.get("global_steps")),
            optimizer_step=Counter(steps_seen).most_common(1)[0][0] if steps_seen else None,
            scheduler_last_epoch=last_epoch,
            scheduler_step_count=step_count,
            skipped_steps=as_int(ms0.get("skipped_steps")),
        )
        self.warnings += C.counter_warnings(counters, optimizer_steps_seen=steps_seen)
        if sched_node is None and isinstance(D._dig(ms0, "ds_config", "scheduler"), dict):
            self.warn("scheduler-missing", "ds_config names a scheduler but lr_scheduler was not saved")

        self.warnings += C.stray_file_warnings(self.tag_dir, self.root)
        if self.tag_dir != self.root:
            self.warnings += C.stray_file_warnings(self.root, self.root)
        self.warnings += self.cache.warnings()
        details = self._details(ms0, layout, rules, topo_source, info, sched_node, sched, opt_dtype)
        dtypes = sorted({s.dtype for n in model.values() for s in n.shards} | ({opt_dtype} if opt_dtype else set()))
        return Checkpoint(
            format=FORMAT,
            path=str(self.root),
            topology=Topology(dp=dp, tp=tp, pp=pp, zero_stage=stage),
            tree=GroupNode(tree),
            counters=counters,
            lr=LearningRates(
                param_groups=lrs,
                base_lrs=base_lrs,
                last_lr=last_lr or C.ds_last_lr(sched, ms0.get("ds_config"), tuple(lrs)),
            ),
            parameter_count=param_count,
            parameter_tensors=len(param_names),
            files=tuple(self._files(tp)),
            warnings=tuple(self.warnings),
            dtypes=tuple(dtypes),
            details=details,
        )

    def _unknown_rules(self, layout: TPLayout, rules: dict[str, Any]) -> None:
        """Parameters no TP merge rule covers: warned about (their shards are shown unmerged)."""
        unknown = [n for n, r in rules.items() if r.merge is None]
        if unknown:
            self.warn(
                "tp-merge-unknown",
                f"no TP merge rule ({layout.source}) for {len(unknown)} parameters "
                f"({', '.join(unknown[:5])}{', ...' if len(unknown) > 5 else ''}); their shards are shown "
                "unmerged and counted as split. Pass --pattern REGEX=MERGE to decide",
            )

    def _stages(self, states: dict[int, dict], mp: int, tp: int, pp: int) -> tuple[dict, dict, dict]:
        """(each rank's param_shapes groups, each rank's parameter names and local shapes in param group order,
        each stage's layers): which stage holds which layer (`self.layer_stage`), its layer files checked."""
        shape_groups = {mm: D._shape_groups(states[mm].get("param_shapes")) for mm in range(mp)}
        frozen = {
            mm: {str(k): tuple(v) for k, v in (states[mm].get("frozen_param_shapes") or {}).items()} for mm in range(mp)
        }
        local_shapes = {mm: {n: s for g in shape_groups[mm] for n, s in g.items()} | frozen[mm] for mm in range(mp)}
        layer_stage: dict[int, int] = {}
        for s in range(pp):
            for t in range(1, tp):
                if list(local_shapes[s * tp + t]) != list(local_shapes[s * tp]):
                    self.warn(
                        "tp-names-mismatch",
                        f"mp_rank_{s * tp + t:02d} and mp_rank_{s * tp:02d} (pipeline "
                        f"stage {s}) list different parameters in param_shapes",
                    )
            for name in local_shapes[s * tp]:
                m = _NAME_RE.match(name)
                if m:
                    layer_stage.setdefault(int(m[1]), s)
        self._check_layer_files(layer_stage, tp)
        self.layer_stage = layer_stage
        stage_layers = {s: sorted(lay for lay, st in layer_stage.items() if st == s) for s in range(pp)}
        return shape_groups, local_shapes, stage_layers

    def _model(
        self, layout: TPLayout, local_shapes: dict, stage_layers: dict, tp: int, pp: int
    ) -> tuple[dict[str, TensorNode], dict[str, Any], dict[str, int]]:
        """(one logical tensor per name, one shard per TP rank; each one's TP rule; the stage that holds it)."""
        model: dict[str, TensorNode] = {}
        rules: dict[str, Any] = {}
        stage_of: dict[str, int] = {}
        for s in range(pp):
            for name in sorted(local_shapes[s * tp], key=self._module_order(list(local_shapes[s * tp]))):
                if name in model:
                    if not layout.is_pipeline_replicated(name):
                        self.warn(
                            "pp-duplicate",
                            f"parameter {name} is listed by pipeline stages {stage_of[name]} "
                            f"and {s}; the first stage's copy is shown",
                        )
                    continue
                shards = []
                for t in range(tp):
                    ref, p = self._shard_ref(name, s, t, stage_layers[s])
                    want = local_shapes[s * tp + t].get(name)
                    if want is not None and tuple(ref.shape) != tuple(want):
                        self.warn(
                            "shape-mismatch",
                            f"{name}: {p.name} holds shape {tuple(ref.shape)}, "
                            f"param_shapes of mp_rank_{s * tp + t:02d} says {tuple(want)}",
                            p,
                        )
                    shards.append(tensor_node(ref, self.rel(p), {"tp": t, "pp": s}))
                rule = layout.rule(name)
                rules[name], stage_of[name] = rule, s
                model[name] = _merged(shards, rule.merge, tp)
        return model, rules, stage_of

    def _read_optimizers(self, states: dict, shape_groups: dict, mp: int, tp: int, dp: int) -> dict:
        """DeepSpeed's own un-flattening of the optimizer, per model-parallel rank that has optimizer files."""
        opts = {}
        for mm in range(mp):
            rf = self.ranks[mm]
            if rf.optim:
                s, t = divmod(mm, tp)
                opts[mm] = D.read_zero_optimizer(
                    self.cache,
                    {d: p for d, p in rf.optim.items() if d < dp},
                    shape_groups[mm],
                    {"tp": t, "pp": s},
                    (self.rel(rf.model_states), states[mm].get("ds_config"))
                    if rf.model_states and mm in states
                    else None,
                )
                self.warnings += opts[mm].warnings
        return opts

    def _optimizer_summary(self, opts, tree, ms0, model, rules, stage_of, tp):
        """(Adam steps seen, the first rank's LRs, the ZeRO stage, the optimizer's dtype): the optimizer merged
        across TP ranks into `tree`, the param group LRs compared across ranks."""
        steps_seen: list[int] = []
        lrs: tuple[float, ...] = ()
        stage = as_int(D._dig(ms0, "ds_config", "zero_optimization", "stage"))
        opt_dtype = None
        if opts:
            tree["optimizer"] = self._optimizer(opts, model, rules, stage_of, tp)
            first = opts[min(opts)]
            stage = first.stage if first.stage is not None else stage
            opt_dtype = first.dtype
            steps_seen = [v for o in opts.values() for v in o.steps_seen]
            lrs = first.lrs_by_rank[min(first.lrs_by_rank)] if first.lrs_by_rank else ()
            by_rank = {(mm, d): v for mm, o in opts.items() for d, v in o.lrs_by_rank.items()}
            if len(set(by_rank.values())) > 1:
                self.warn(
                    "lr-mismatch",
                    "param group LRs differ across ranks: "
                    + ", ".join(f"mp_rank_{mm:02d}/dp {d}: {list(v)}" for (mm, d), v in sorted(by_rank.items())),
                )
        return steps_seen, lrs, stage, opt_dtype

    def _rest_of_tree(self, tree: dict[str, Any], ms0: dict, info: Any):
        """Scheduler, counters, client state, universal_checkpoint_info and ds_config into `tree`; the scheduler
        node (None when not saved)."""
        rel0 = self.rel(self.ranks[0].model_states)
        sched_node = to_node(ms0["lr_scheduler"], rel0) if isinstance(ms0.get("lr_scheduler"), dict) else None
        if sched_node is not None:
            tree["scheduler"] = sched_node
        tree["counters"] = GroupNode(
            {k: ValueNode(ms0.get(k)) for k in ("global_steps", "global_samples", "skipped_steps")}
        )
        client = {k: v for k, v in ms0.items() if k not in D.DS_MODEL_KEYS}
        if client:
            tree["client_state"] = to_node(client, rel0)
        if isinstance(info, dict):
            tree["universal_checkpoint_info"] = to_node(info, rel0)
        if isinstance(ms0.get("ds_config"), dict):
            tree["config"] = to_node(ms0["ds_config"], rel0)
        return sched_node

    def _details(self, ms0, layout, rules, topo_source, info, sched_node, sched, opt_dtype) -> dict[str, Any]:
        """What `ckpt inspect` prints under details: the TP layout and merges, where the topology came from, the
        layers' stages, vocab padding, the scheduler's kind."""
        merges = Counter(r.merge or "unknown" for r in rules.values())
        details = {
            "tag": self.tag,
            "ds_version": ms0.get("ds_version"),
            "tp_layout": " > ".join(layout.sources),
            "tp_merges": ", ".join(f"{n} {m}" for m, n in merges.most_common()),
            "topology_from": topo_source,
            "layer_stages": {f"{lay:02d}": s for lay, s in sorted(self.layer_stage.items())},
            "weights": "layer files (module weights per TP rank)",
            "optimizer_dtype": opt_dtype,
        }
        vocab = {r.vocab_size for r in rules.values() if r.vocab_size}
        padded = info.get("padded_vocab_size") if isinstance(info, dict) else None
        if vocab and padded and padded not in vocab:
            details["vocab_padding"] = f"padded to {padded}, original {sorted(vocab)[0]} (rows beyond are padding)"
        if sched_node is not None and "last_batch_iteration" in sched and "base_lrs" not in sched:
            details["scheduler_kind"] = "deepspeed (LR comes from the launch config)"
        return details

    def _optimizer(
        self,
        opts: dict[int, D.ZeroOptimizer],
        model: dict[str, TensorNode],
        rules: dict,
        stage_of: dict[str, int],
        tp: int,
    ) -> GroupNode:
        """`optimizer.state.<name>.{fp32,exp_avg,exp_avg_sq}` merged across TP ranks with the model's rule;
        param groups and loss-scaler fields from mp_rank 00 (the same on every rank)."""
        merged: dict[str, dict[str, Any]] = {}
        for name, s in stage_of.items():
            per_tp = [opts[s * tp + t].state.get(name) if s * tp + t in opts else None for t in range(tp)]
            if any(e is None for e in per_tp):
                continue
            entry: dict[str, Any] = {k: v for k, v in per_tp[0].items() if not isinstance(v, TensorNode)}
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                if all(key in e for e in per_tp):
                    entry[key] = _merged([e[key] for e in per_tp], rules[name].merge, tp)
            merged[name] = entry
        return D._optimizer_node(replace(opts[min(opts)], state=merged))

    def _compare_ranks(self, states: dict[int, dict], tp: int, pp: int) -> None:
        """Counters must agree on every rank; the default RNG state must agree across the TP ranks of a
        stage (Megatron seeds it with `seed + 100 * pp_rank`, the same on every TP rank)."""
        for key in _SAME_ACROSS_RANKS:
            vals = {mm: states[mm].get(key) for mm in states if key in states[mm]}
            if len({repr(v) for v in vals.values()}) > 1:
                self.warn(
                    "step-mismatch",
                    f"{key} differs across model-parallel ranks: "
                    + ", ".join(f"mp_rank_{mm:02d}={v}" for mm, v in sorted(vals.items())),
                )
        differ = []
        for s in range(pp):
            base = _rng_bytes(states[s * tp])
            for t in range(1, tp):
                other = _rng_bytes(states[s * tp + t])
                if base is not None and other is not None and other != base:
                    differ.append(f"mp_rank_{s * tp + t:02d} != mp_rank_{s * tp:02d} (stage {s}, TP rank {t} vs 0)")
        if differ:
            # reported, never "fixed": the state is what the run had; the weights it drifted are the damage
            self.warn(
                "tp-rng-mismatch",
                f"torch_rng_state differs across TP ranks: {'; '.join(differ)}. Megatron seeds the default "
                "generator alike on every TP rank; ranks drawing different random numbers in replicated "
                "computations (dropout) make their replicated weights drift apart. Compare the "
                "TP-replicated tensors across ranks",
            )

    def _files(self, tp: int) -> list:
        files = []
        for (layer, t), p in sorted(self.layer_files.items()):
            rank = {"tp": t} if layer not in self.layer_stage else {"tp": t, "pp": self.layer_stage[layer]}
            files.append(C.file_info(p, self.root, "model", rank))
        for mm, rf in sorted(self.ranks.items()):
            s, t = divmod(mm, tp)
            if rf.model_states:
                files.append(C.file_info(rf.model_states, self.root, "metadata", {"tp": t, "pp": s}))
            for d, p in sorted(rf.optim.items()):
                files.append(C.file_info(p, self.root, "optimizer", {"tp": t, "pp": s, "dp": d}))
        return files


def _merged(shards: list[TensorNode], merge: str | None, tp: int) -> TensorNode:
    """The logical tensor over TP shards; with no rule, shard 0's shape (the shards stay readable)."""
    shape = merged_shape(merge, shards[0].shape, tp) if merge else shards[0].shape
    # a one-element replica shows its value; longer tiny vectors stay on the shards (one line per tensor)
    value = shards[0].value if merge == "replicated" and math.prod(shape) == 1 else None
    return TensorNode(shape, shards[0].dtype, shards=tuple(shards), merge=merge, value=value)


def _rng_bytes(ms: dict) -> bytes | None:
    """The saved default-generator state (5 KB), top level (this layout) or in Megatron's `rng_state` list."""
    ref = ms.get("torch_rng_state")
    if (
        ref is None
        and isinstance(ms.get("rng_state"), list)
        and ms["rng_state"]
        and isinstance(ms["rng_state"][0], dict)
    ):
        ref = ms["rng_state"][0].get("torch_rng_state")
    if not isinstance(ref, TensorRef) or ref.storage is None:
        return None
    return ref.read_bytes()


def training_state(ck: Checkpoint):
    return D.training_state(ck)
