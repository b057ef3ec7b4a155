"""The way into Megatron-LM: a Megatron-DeepSpeed pipeline checkpoint (DeepSpeed's `PipelineModule` save of
GPTModelPipe: `layer_LL-model_TT-model_states.pt` + `bf16_zero_pp_rank_*` ZeRO-1/2 optimizer files), or a torchtitan
Llama's DCP save (its own section below: `titan_view`), written as a Megatron-LM core_v0.16.1 torch_dist run folder
(`ckpt convert SRC OUT --to megatron`), plain Adam.

What is written (the layout of `megatron_write`'s torch_dist writer, the same DCP keys Megatron's own save of a GPT
with LayerNorm / GeLU / learned positions / untied output holds; from torchtitan, of its Llama-style GPT: RMSNorm,
SwiGLU, RoPE, no biases, the norms under the same fused names, each linear's extra state after its weight):

    weights       the layer files' module weights (bf16, Megatron's param dtype) under Megatron-core names, decoder
                  layers stacked on a leading layer axis; `optimizer.state.fp32_param.<name>` the ZeRO fp32 master,
                  `optimizer.state.{exp_avg,exp_avg_sq}.<name>` Adam's moments (TP shards merged by the reader)
    extra states  `decoder.layers.<linear>._extra_state/shard_i_L` = [None] (Megatron's local linears)
    common.pt     iteration, an `args` Namespace for this architecture (built here: a DeepSpeed run has no
                  Megatron-LM args), the param groups in Megatron's order with its fields (wd_mult, max_lr, ...),
                  the common Adam step, the OptimizerParamScheduler state, content_metadata

The names (`core_names`): DeepSpeed's pipeline names are `<layer spec index>.<local name>`; the embedding spec,
the transformer-layer specs (numbered in order), the final norm (bare weight / bias) and the LM head are told apart
by their local names. One map serves the writer and the verification: the logical diff runs on `core_view(src)`,
the source's tree under the Megatron-core names, against the written folder.

QKV: Megatron-DeepSpeed's query_key_value rows are [heads][q|k|v][head_dim] on each TP rank, so the TP shards
concatenated on dim 0 (what the reader merges) are [heads][q|k|v][head_dim] for the whole model; Megatron-core's
linear_qkv is [query_groups][q x heads/groups | k | v][head_dim], which with one head per group (no GQA) is the
same order: the rows are carried as they are. A GQA source is refused.

The schedule: DeepSpeed's WarmupLR past its warm-up gives the maximum LR at every later step; Megatron's
OptimizerParamScheduler with `lr_decay_style constant` and the same warm-up length in iterations gives the same
(exact, from the next update on). Still in the warm-up (DeepSpeed's update k uses warm-up position k-2, Megatron's
k-1: no Megatron warm-up matches every step), another DeepSpeed scheduler: written as a constant schedule at the
param groups' current LR and listed as not moved.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedCheckpoint

SOURCE_FORMATS = ("deepspeed_pipeline",)

#: a transformer layer's local names (Megatron-DeepSpeed's ParallelTransformerLayer) -> Megatron-core's names in
#: its torch_dist checkpoint (local spec; the layer norms under the fused names dist-checkpointing gives them)
LAYER_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.query_key_value.weight": "self_attention.linear_qkv.weight",
    "self_attention.query_key_value.bias": "self_attention.linear_qkv.bias",
    "self_attention.dense.weight": "self_attention.linear_proj.weight",
    "self_attention.dense.bias": "self_attention.linear_proj.bias",
    "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "post_attention_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
    "mlp.dense_h_to_4h.weight": "mlp.linear_fc1.weight",
    "mlp.dense_h_to_4h.bias": "mlp.linear_fc1.bias",
    "mlp.dense_4h_to_h.weight": "mlp.linear_fc2.weight",
    "mlp.dense_4h_to_h.bias": "mlp.linear_fc2.bias",
}
EMBEDDING_NAMES = {
    "word_embeddings.weight": "embedding.word_embeddings.weight",
    "position_embeddings.weight": "embedding.position_embeddings.weight",
}
FINAL_NORM_NAMES = {"weight": "decoder.final_layernorm.weight", "bias": "decoder.final_layernorm.bias"}
HEAD_NAMES = {"lm_head.weight": "output_layer.weight"}
#: a decoder layer's tensors in the order Megatron-core registers its modules (the order its sharded state dict,
#: and so its torch_dist .metadata, lists them; `megatron_write`'s legacy writer numbers the optimizer's ids by it)
LAYER_ORDER = (
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.layer_norm_bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.layer_norm_bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
TOP_ORDER = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "decoder.layers",
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)
#: the linears whose `_extra_state` Megatron's local spec saves ([None]) and asks for at load
EXTRA_STATE_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
#: param-group fields Megatron-core keeps beside torch's (core_v0.16.1 `_get_param_groups`): written, reported as
#: added by the logical diff (the source's torch groups do not have them)
MEGATRON_GROUP_KEYS = (
    "is_expert_parallel",
    "default_config",
    "wd_mult",
    "lr_mult",
    "is_decoupled_lr",
    "max_lr",
    "min_lr",
)
_NAME = re.compile(r"^(\d+)\.(.+)$")


def handles(ck) -> bool:
    return ck.format in SOURCE_FORMATS or _VIEW in ck.details or is_torchtitan(ck)


def _titan(ck) -> bool:
    """`ck` is a torchtitan source read under Megatron-core names (`titan_view`)."""
    return _VIEW in ck.details


def _refuse(msg: str, ck, hint: str | None = None):
    raise UnsupportedCheckpoint(msg, path=Path(ck.path) if ck is not None else None, hint=hint)


#: the last checkpoint `core_names` mapped and its map: check, plan and write each ask again for the same tree
_LAST: list[tuple[Any, dict[str, str]]] = []


def core_names(ck) -> dict[str, str]:
    """{DeepSpeed pipeline name (`2.input_layernorm.weight`): Megatron-core name
    (`decoder.layers.0.self_attention.linear_qkv.layer_norm_weight`)} for every model tensor; refuses, naming it,
    a pipeline layer or a local name that is not Megatron-DeepSpeed's GPT. Mapped once per checkpoint object."""
    if _LAST and _LAST[0][0] is ck:
        return _LAST[0][1]
    if _titan(ck):  # already named so
        from ..view import logical as L

        out = {t.name: t.name for t in L.model_tensors(ck, weights="module")}
        _LAST[:] = [(ck, out)]
        return out
    out = _core_names(ck)
    _LAST[:] = [(ck, out)]
    return out


def _core_names(ck) -> dict[str, str]:
    from ..view import logical as L

    by_spec: dict[int, list[str]] = {}
    for t in L.model_tensors(ck, weights="module"):
        m = _NAME.match(t.name)
        if m is None:
            _refuse(f"{t.name}: not a pipeline layer's parameter (<layer index>.<name>)", ck)
        by_spec.setdefault(int(m[1]), []).append(m[2])
    out: dict[str, str] = {}
    layer = 0
    seen_layers = False
    for spec in sorted(by_spec):
        names = by_spec[spec]
        for table, kind in (
            (EMBEDDING_NAMES, "embedding"),
            (LAYER_NAMES, "layer"),
            (FINAL_NORM_NAMES, "norm"),
            (HEAD_NAMES, "head"),
        ):
            if set(names) <= set(table):
                break
        else:
            bad = sorted(
                n
                for n in names
                if not any(n in t for t in (EMBEDDING_NAMES, LAYER_NAMES, FINAL_NORM_NAMES, HEAD_NAMES))
            )
            _refuse(
                f"pipeline layer {spec} holds {', '.join(bad or names)}: not a layer of Megatron-DeepSpeed's GPT "
                "(embedding, ParallelTransformerLayer, final LayerNorm, LM head): ckpt does not map it to "
                "Megatron-core",
                ck,
            )
        if kind == "layer":
            if set(names) != set(LAYER_NAMES):
                _refuse(
                    f"pipeline layer {spec} holds {sorted(names)}: not the LayerNorm / GeLU / biased layer "
                    f"({sorted(LAYER_NAMES)}) ckpt maps to Megatron-core",
                    ck,
                )
            out.update({f"{spec}.{n}": f"decoder.layers.{layer}.{LAYER_NAMES[n]}" for n in names})
            layer += 1
            seen_layers = True
        elif kind == "norm" and not seen_layers:
            _refuse(f"pipeline layer {spec}: a bare weight/bias before any transformer layer", ck)
        else:
            out.update({f"{spec}.{n}": table[n] for n in names})
    core = set(out.values())
    need = {"embedding.word_embeddings.weight", "decoder.final_layernorm.weight", "output_layer.weight"}
    if need - core:
        _refuse(
            f"no {', '.join(sorted(need - core))} in the pipeline: ckpt maps an untied GPT with learned "
            "positions, a final LayerNorm and an LM head (a tied output layer is not handled yet)",
            ck,
        )
    return out


def _rename(node, names: dict[str, str]):
    return dataclasses.replace(node, children={names.get(k, k): v for k, v in node.children.items()})


def core_view(ck, other=None):
    """The source read under Megatron-core's names: the model and the optimizer state renamed by `core_names`
    (values, param-group membership and counters as the reader gives them); a torchtitan source as `titan_view`,
    its head counts from `other`'s (the Megatron-LM checkpoint it is compared with) args. What the logical diff
    compares the written folder with."""
    from ..view import logical as L
    from ..read.tree import GroupNode

    ck = L.open_any(ck)
    if _titan(ck):
        return ck
    if is_torchtitan(ck):
        args = L._plain(other.tree.children["args"]) if other is not None and "args" in other.tree.children else None
        heads = args.get("num_attention_heads") if isinstance(args, dict) else None
        if not isinstance(heads, int):
            _refuse(
                "a torchtitan checkpoint read under Megatron-core names needs the head counts: the other side "
                "holds no Megatron args with num_attention_heads",
                ck,
            )
        groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
        return titan_view(ck, heads, int(groups or heads))
    names = core_names(ck)
    kids = dict(ck.tree.children)
    kids["model"] = _rename(ck.tree.children["model"], names)
    opt = ck.tree.children.get("optimizer")
    if isinstance(opt, GroupNode) and isinstance(opt.children.get("state"), GroupNode):
        kids["optimizer"] = dataclasses.replace(
            opt, children={**opt.children, "state": _rename(opt.children["state"], names)}
        )
    return dataclasses.replace(ck, tree=dataclasses.replace(ck.tree, children=kids))


def _ds_args(ck) -> dict[str, Any]:
    from ..read.tree import node_to_python

    node = ck.tree.children.get("client_state")
    val = node_to_python(node) if node is not None else None
    args = val.get("args") if isinstance(val, dict) else None
    return args if isinstance(args, dict) else {}


def _config(ck) -> dict[str, Any]:
    from ..read.tree import saved_config

    return saved_config(ck)


def _shapes(ck) -> dict[str, tuple[int, ...]]:
    from ..view import logical as L

    names = core_names(ck)
    return {names[t.name]: tuple(t.shape) for t in L.model_tensors(ck, weights="module")}


def _architecture(ck) -> dict[str, Any]:
    """The GPT the checkpoint holds, from its tensors' shapes (checked against the saved Megatron-DeepSpeed args
    where they say more)."""
    if _titan(ck):
        return _titan_arch(ck)
    shapes = _shapes(ck)
    a = _ds_args(ck)
    layers = sum(1 for k in shapes if k.endswith(".self_attention.linear_qkv.weight"))
    vocab, hidden = shapes["embedding.word_embeddings.weight"]
    qkv_rows = shapes["decoder.layers.0.self_attention.linear_qkv.weight"][0]
    ffn = shapes["decoder.layers.0.mlp.linear_fc1.weight"][0]
    heads = a.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        _refuse(
            "the checkpoint's client state holds no Megatron-DeepSpeed `args` with num_attention_heads: the "
            "attention heads cannot be read from the tensors",
            ck,
        )
    if qkv_rows != 3 * hidden or hidden % heads:
        _refuse(
            f"query_key_value has {qkv_rows} rows for hidden {hidden} and {heads} heads: ckpt maps multi-head "
            "attention only (GQA / MQA not handled: their per-group row order differs from Megatron-core's)",
            ck,
        )
    norm = str(a.get("normalization") or "layernorm").lower()
    checks = {
        "normalization": (norm, "layernorm"),
        "swiglu": (bool(a.get("swiglu")), False),
        "untie_embeddings_and_output_weights": (bool(a.get("untie_embeddings_and_output_weights", True)), True),
        "position_embedding_type": (a.get("position_embedding_type") or "learned_absolute", "learned_absolute"),
        "add_bias_linear": (bool(a.get("add_bias_linear", True)), True),
        "num_layers": (a.get("num_layers", layers), layers),
        "hidden_size": (a.get("hidden_size", hidden), hidden),
        "ffn_hidden_size": (a.get("ffn_hidden_size", ffn), ffn),
    }
    bad = [f"{k}={v!r}" for k, (v, want) in checks.items() if v != want]
    if bad:
        _refuse(
            f"saved args {', '.join(bad)}: ckpt maps Megatron-DeepSpeed's GPT with LayerNorm, GeLU MLP, learned "
            "positions, biases and an untied output layer, as its tensors hold it",
            ck,
        )
    seq = shapes["embedding.position_embeddings.weight"][0]
    return {
        "num_layers": layers,
        "hidden_size": hidden,
        "ffn_hidden_size": ffn,
        "num_attention_heads": heads,
        "padded_vocab_size": vocab,
        "max_position_embeddings": seq,
        "seq_length": int(a.get("seq_length") or seq),
        "layernorm_epsilon": float(a.get("layernorm_epsilon") or 1e-5),
    }


def _schedule(ck, groups: list[dict[str, Any]]) -> tuple[dict[str, Any], str, str | None]:
    """(Megatron's lr schedule in iterations: lr, min_lr, warmup_iters, warmup_init, style; the plan note; the
    not-moved line or None when the schedule carries exactly)."""
    from ..read.tree import node_to_python

    if _titan(ck):  # torchtitan's schedule is in its job config: --lr-scheduler, or each group's LR as it stands
        s = _titan_schedule(ck)
        if s is None:
            lr = float(groups[0]["lr"])
            return ({"lr": lr, "min_lr": lr, "warmup": 0, "init": 0.0, "style": "constant"}, "", None)
        top = float(groups[0]["initial_lr"])
        return (
            {
                "lr": top,
                "min_lr": top * s["mf"],
                "warmup": max(s["W"] - 1, 0),
                "init": top / s["W"] if s["W"] > 1 else 0.0,
                "style": "WSD",
                "wsd_style": _WSD_STYLE[s["type"]],
                "wsd_iters": s["D"],
                "decay_iters": s["T"],
                "train_iters": s["training_steps"],
            },
            "",
            None,
        )
    cfg = _config(ck)
    node = ck.tree.children.get("scheduler")
    state = node_to_python(node) if node is not None else None
    lrs = sorted({float(g["lr"]) for g in groups})
    sched = cfg.get("scheduler") if isinstance(cfg.get("scheduler"), dict) else None
    current = lrs[0]
    if not state and not sched:
        return (
            {"lr": current, "min_lr": current, "warmup": 0, "init": 0.0, "style": "constant"},
            f"scheduler: none in the source (constant LR {current:g}): Megatron's constant schedule at that LR",
            None,
        )
    kind, params = (sched or {}).get("type"), dict((sched or {}).get("params") or {})
    it = (state or {}).get("last_batch_iteration")
    iteration = ck.counters.global_step or 0
    if kind == "WarmupLR" and isinstance(it, int):
        lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
        w = int(params.get("warmup_num_steps", 1000))
        if not isinstance(lo, list) and not isinstance(hi, list) and it >= w and iteration >= w and lrs == [float(hi)]:
            return (
                {"lr": float(hi), "min_lr": float(hi), "warmup": w, "init": float(lo), "style": "constant"},
                f"scheduler: DeepSpeed WarmupLR ({params.get('warmup_type', 'log')}, {lo:g} -> {hi:g} over {w} "
                f"steps) past its warm-up (last_batch_iteration {it}) as Megatron's OptimizerParamScheduler, "
                f"constant at {hi:g} with lr_warmup_iters {w}: the same LR at every later step",
                None,
            )
    line = (
        f"scheduler: DeepSpeed {kind or 'scheduler'} {params} at last_batch_iteration {it}: no Megatron "
        "OptimizerParamScheduler gives the same LR at every later step; written as a constant schedule at the "
        f"param groups' current LR {current:g}: relaunch with --override-opt_param-scheduler and your schedule"
    )
    return ({"lr": current, "min_lr": current, "warmup": 0, "init": 0.0, "style": "constant"}, line, line)


def _groups(ck) -> list[dict[str, Any]]:
    from ..view import logical as L

    return L.param_groups(core_view(ck))


#: what a torchtitan run whose norms decay (its stock default_adamw: one group) can do about it
_DROP_HINT = (
    "; --drop-norm-decay converts it with the norms (1-D tensors) in a group without weight decay, as "
    "Megatron-core trains them (a change to the run, listed in the plan)"
)


def _megatron_groups(ck) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """(the source's groups in Megatron's order, their member core names): Megatron-core puts the weights that
    decay in its default group (first) and the biases and 1-D tensors in a wd_mult 0 group; refuses a source whose
    groups are split otherwise or whose hyper-parameters differ between groups by more than the weight decay."""
    shapes = _shapes(ck)
    groups = _groups(ck)
    want_decay = sorted(n for n, s in shapes.items() if len(s) > 1 and not n.endswith(".bias"))
    want_none = sorted(n for n in shapes if n not in want_decay)
    by = {tuple(sorted(g["params"])): g for g in groups}
    if set(by) != {tuple(want_decay), tuple(want_none)} or len(groups) != 2:
        _refuse(
            f"{len(groups)} param groups not split as Megatron-core splits them (weights with decay; biases and "
            "1-D tensors without): Megatron would rebuild other groups and load the state into them"
            + (_DROP_HINT if _titan(ck) and len(groups) == 1 else ""),
            ck,
        )
    wd, nowd = by[tuple(want_decay)], by[tuple(want_none)]
    if float(nowd.get("weight_decay") or 0.0) != 0.0:
        _refuse(
            f"the biases' / norms' param group decays (weight_decay {nowd['weight_decay']}): Megatron-core's "
            "default gives them wd_mult 0" + (_DROP_HINT if _titan(ck) else ""),
            ck,
        )
    same = ("betas", "eps") if _titan(ck) else ("lr", "betas", "eps")  # torchtitan: each group's own max_lr
    diff = [k for k in same if wd.get(k) != nowd.get(k)]
    if diff:
        _refuse(
            f"the two param groups differ in {', '.join(diff)}: Megatron-core has one "
            f"{'Adam' if 'lr' not in diff else 'LR schedule'} for both",
            ck,
        )
    return [wd, nowd], [want_decay, want_none]


def check(
    ck, src: Path, ckpt_format: str = "torch_dist", tp: int | None = None, pp: int | None = None
) -> tuple[None, None]:
    """Refuse, in one line naming it, what this conversion does not carry into a loadable Megatron run; returns
    (None, None): torch_dist holds whole tensors, Megatron reshards them at load (`megatron_write.check`'s shape)."""
    if ckpt_format != "torch_dist":
        raise UnsupportedCheckpoint(
            f"--to megatron --ckpt-format {ckpt_format} needs a Megatron-LM torch_dist checkpoint; this is {ck.format}",
            path=src,
            hint="convert it with --ckpt-format torch_dist first, then that run with --ckpt-format torch",
        )
    if _titan(ck):
        _titan_check(ck)
    else:
        _check_deepspeed(ck)
    _megatron_groups(ck)
    from ..view import logical as L

    steps = {float(v["step"]) for v in L.optimizer_scalars(ck).values() if v.get("step") is not None}
    if len(steps) != 1:
        _refuse(f"Adam steps {sorted(steps)} across parameters: torch_dist keeps one common step", ck)
    return None, None


def _check_deepspeed(ck) -> None:
    cfg = _config(ck)
    if not (isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled")):
        _refuse(
            "--to megatron from DeepSpeed is proven for bf16 runs (Megatron's bf16 params with an fp32 master); "
            "this run is not bf16 (ds_config.bf16.enabled)",
            ck,
        )
    opt = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if opt not in ("adam", "adamw"):
        _refuse(f"optimizer {opt or '(not in ds_config)'}: Megatron's plain optimizer here is Adam(W)", ck)
    if (ck.topology.zero_stage or 0) > 2:
        _refuse("ZeRO-3 pipeline checkpoint: not handled (DeepSpeed pipelines run ZeRO-1/2)", ck)
    if ck.counters.skipped_steps:
        _refuse(
            f"{ck.counters.skipped_steps} skipped steps: the Adam step and the iteration differ, which "
            "Megatron's checkpoint cannot say",
            ck,
        )
    _architecture(ck)
    if (ck.topology.tp or 1) > 1:
        from .tp_sync import check_tp_sync

        drifted = [p.name for p in check_tp_sync(ck).params if not p.in_sync]
        if drifted:  # the merge would take TP rank 0's copy silently: Megatron saves a replica once
            _refuse(
                f"{len(drifted)} TP-replicated parameters differ across TP ranks ({', '.join(drifted[:4])}"
                f"{', ...' if len(drifted) > 4 else ''}): torch_dist keeps one copy",
                ck,
                hint=f"repair them first with `ckpt sync-tp {ck.path}` (average or one rank's value)",
            )


def _tp_pp(ck) -> tuple[int, int, int]:
    return ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.dp or 1


def _vocab_multiple(padded: int, tp: int) -> int:
    """Megatron pads the tokenizer's vocabulary to a multiple of make_vocab_size_divisible_by x TP: the largest
    power of two up to 128 that keeps the saved rows at the saved TP."""
    m = 128
    while m > 1 and padded % (m * tp):
        m //= 2
    return m


def megatron_args(ck) -> dict[str, Any]:
    """The args Megatron-LM 0.16 rebuilds this run from (`ckpt resume` relaunches from them; Megatron's load
    compares num_layers, hidden_size, num_attention_heads, add_position_embedding with the launch): the
    architecture from the tensors, sizes, batch, optimizer and schedule from the DeepSpeed run."""
    import torch

    arch = _architecture(ck)
    tp, pp, dp = _tp_pp(ck)
    groups, _ = _megatron_groups(ck)
    sched, _, _ = _schedule(ck, groups)
    iteration = int(ck.counters.global_step or 0)
    padded = arch["padded_vocab_size"]
    if _titan(ck):  # no DeepSpeed config: what torchtitan's job config held is listed as not moved
        cfg, a, o = {}, {}, {"eps": groups[0]["eps"]}
        betas, gbs, mbs, train_iters = groups[0]["betas"], dp, 1, int(sched.get("train_iters") or iteration)
        multiple = _vocab_multiple(padded, 8)  # the saved rows at TP 1 to 8
    else:
        cfg, a = _config(ck), _ds_args(ck)
        o = dict((cfg.get("optimizer") or {}).get("params") or {})
        betas = o.get("betas") or groups[0].get("betas") or (0.9, 0.999)
        gbs = int(cfg.get("train_batch_size") or a.get("global_batch_size"))
        mbs = int(cfg.get("train_micro_batch_size_per_gpu") or a.get("micro_batch_size"))
        train_iters = int(a.get("train_iters") or iteration)
        multiple = _vocab_multiple(padded, tp)
    out = {
        **arch,
        "num_query_groups": arch["num_attention_heads"],
        "kv_channels": arch["hidden_size"] // arch["num_attention_heads"],
        "group_query_attention": False,
        # Megatron's NullTokenizer counts vocab_size + 1 (the end-of-document id): the saved rows, unpadded
        "vocab_size": padded - 1,
        "tokenizer_type": "NullTokenizer",
        "make_vocab_size_divisible_by": multiple,
        "mock_data": True,
        "normalization": "LayerNorm",
        "swiglu": False,
        "untie_embeddings_and_output_weights": True,
        "position_embedding_type": "learned_absolute",
        "add_position_embedding": True,
        "add_bias_linear": True,
        "add_qkv_bias": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "transformer_impl": "local",
        # no fused kernels (Apex / Megatron's own): a run these args rebuild starts on any GPU or CPU, as the
        # same maths (measured on an H100 without Apex: the persistent LayerNorm default stops the model's build)
        "no_persist_layer_norm": True,
        "masked_softmax_fusion": False,
        "bias_gelu_fusion": False,
        "bias_dropout_fusion": False,
        "gradient_accumulation_fusion": False,
        "bf16": True,
        "fp16": False,
        "params_dtype": torch.bfloat16,
        "accumulate_allreduce_grads_in_fp32": True,
        "optimizer": "adam",
        "use_distributed_optimizer": False,
        "lr": sched["lr"],
        "min_lr": sched["min_lr"],
        "lr_decay_style": sched["style"],
        "lr_warmup_iters": sched["warmup"],
        "lr_warmup_init": sched["init"],
        "weight_decay": float(groups[0].get("weight_decay") or 0.0),
        "start_weight_decay": float(groups[0].get("weight_decay") or 0.0),
        "end_weight_decay": float(groups[0].get("weight_decay") or 0.0),
        "weight_decay_incr_style": "constant",
        "adam_beta1": float(betas[0]),
        "adam_beta2": float(betas[1]),
        "adam_eps": float(o.get("eps", groups[0].get("eps"))),
        "clip_grad": 1.0 if _titan(ck) else float(cfg.get("gradient_clipping") or 0.0),
        "micro_batch_size": mbs,
        "global_batch_size": gbs,
        "train_iters": train_iters,
        "seed": int(a.get("seed") or 1234),
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "data_parallel_size": dp,
        "world_size": tp * pp * dp,
        "ckpt_format": "torch_dist",
        "use_dist_ckpt": True,
        "no_save_rng": True,
        "iteration": iteration,
        "consumed_train_samples": iteration * gbs,
        "consumed_valid_samples": 0,
        "skipped_train_samples": 0,
    }
    if _titan(ck):
        out.update(arch)
        if sched["style"] == "WSD":
            out.update(
                {
                    "lr_decay_iters": sched["decay_iters"],
                    "lr_wsd_decay_style": sched["wsd_style"],
                    "lr_wsd_decay_iters": sched["wsd_iters"],
                }
            )
    return out


def scheduler_state(ck, args: dict[str, Any]) -> dict[str, Any]:
    """The OptimizerParamScheduler state Megatron builds from `args` at the source's iteration (num_steps in
    samples: iterations x global batch)."""
    gbs = args["global_batch_size"]
    return {
        "max_lr": args["lr"],
        "lr_warmup_steps": args["lr_warmup_iters"] * gbs,
        "num_steps": args["iteration"] * gbs,
        "lr_decay_style": args["lr_decay_style"],
        "lr_decay_steps": (args.get("lr_decay_iters") or args["train_iters"]) * gbs,
        "min_lr": args["min_lr"],
        "start_wd": args["weight_decay"],
        "end_wd": args["weight_decay"],
        "wd_incr_style": "constant",
        "wd_incr_steps": args["train_iters"] * gbs,
    }


def plan_lines(
    ck, ckpt_format: str = "torch_dist", tp: int | None = None, pp: int | None = None
) -> tuple[list[str], list[str]]:
    """(notes, not moved) for the conversion."""
    if _titan(ck):
        return _titan_lines(ck)
    tp, pp, dp = _tp_pp(ck)
    arch = _architecture(ck)
    groups, _ = _megatron_groups(ck)
    _, snote, sgone = _schedule(ck, groups)
    notes = [
        f"Megatron-LM torch_dist (plain Adam) from a Megatron-DeepSpeed pipeline (TP {tp} x PP {pp} x DP {dp}): "
        f"global tensors under Megatron-core names, {arch['num_layers']} layers stacked on a leading axis; "
        "Megatron reshards them at load, so it resumes at any TP / PP",
        "weights: the layer files' module weights (bf16, Megatron's param dtype) and the ZeRO fp32 master as "
        "optimizer.state.fp32_param; Adam's exp_avg / exp_avg_sq; the common Adam step; param groups in "
        "Megatron-core's order (decaying weights; biases and 1-D tensors with wd_mult 0) with its fields "
        "(max_lr, min_lr, wd_mult, lr_mult, ...)",
        "query_key_value rows carried as they are: Megatron-DeepSpeed's [heads][q|k|v][head_dim] is "
        "Megatron-core's linear_qkv order with one head per query group",
        "args: built for this architecture (LayerNorm, GeLU, learned positions, untied output, no dropout, "
        "the local transformer implementation), the parallel sizes, batch sizes, Adam hyper-parameters, "
        "train_iters and schedule of the DeepSpeed run; tokenizer NullTokenizer sized to the saved vocabulary "
        "rows and mock_data (relaunch with your own tokenizer and data flags)",
        snote,
    ]
    not_moved = [
        "RNG states: DeepSpeed's / the client's generators are not Megatron's (args.no_save_rng=True: "
        "Megatron seeds afresh from args.seed)",
        "data position: the DeepSpeed run's data loader is not Megatron's; consumed_train_samples = "
        "iteration x global batch is recorded",
        "num_floating_point_operations_so_far: DeepSpeed does not count it (written 0)",
        "ds_config and universal_checkpoint_info: DeepSpeed's launch configuration and TP merge metadata "
        "(used to read the source)",
    ]
    if sgone:
        not_moved.append(sgone)
    return notes, not_moved


def added() -> tuple[str, ...]:
    """The param-group fields Megatron keeps that the source's torch groups lack (the logical diff's 'added')."""
    return tuple(f"param_groups {i}.{k}" for i in (0, 1) for k in MEGATRON_GROUP_KEYS)


def _order(core: str) -> tuple:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", core)
    if m:
        return (TOP_ORDER.index("decoder.layers"), LAYER_ORDER.index(m[2]), int(m[1]))
    return (TOP_ORDER.index(core), 0, 0)


def write(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Write the run folder for `plan` (to="megatron" from a DeepSpeed pipeline or a torchtitan source, read as
    `source_view`) into the empty staging folder `root`; returns the bytes written. One parameter's tensors in
    memory at a time (a fused one: its parts)."""
    from ..write.dcp_write import DcpStreamWriter

    w, tail = _dist_items(plan, root, DcpStreamWriter, progress)
    w.close()
    return w.bytes_written + tail(root)


def plan_dist(plan, root: Path):
    """(a `write.dcp_write.PlannedDcpWriter` holding the items `write` writes, in its order, each parameter's
    tensor chunks of unit `param<i>` (the plan's index); what writes the rest of the run folder into `root`): a
    torchrun job's plan."""
    from ..write.dcp_write import PlannedDcpWriter

    return _dist_items(plan, root, PlannedDcpWriter, None)


def _dist_items(plan, root: Path, writer, progress: Callable[[int], None] | None):
    """The DCP items of the run folder, written (or planned) through `writer(folder, checkpoint_id, shards,
    save_id)`; returns (the writer, not closed; tail(root) -> bytes: common.pt, metadata.json, the iteration)."""
    import torch

    from ..view import logical as L
    from ..write.dcp_write import lazy_part, plan_save_id
    from ..write.megatron_write import dist_key

    ck = source_view(L.open_any(plan.source), plan.hf_config, plan.seq_length, plan.lr_scheduler, plan.drop_norm_decay)
    names = core_names(ck)
    args = megatron_args(ck)
    layers = args["num_layers"]
    iteration = args["iteration"]
    it = root / f"iter_{iteration:07d}"
    module = {t.name: t for t in L.model_tensors(ck, weights="module")}
    for p in plan.params:
        if p.kind != "param" or not p.states:
            raise UnsupportedCheckpoint(
                f"{p.name}: a {p.kind} tensor without Adam state: ckpt writes trained parameters only", path=plan.source
            )
    unit = {p.name: f"param{i}" for i, p in enumerate(plan.params)}
    # {torch_dist key: [(layer or None, param)]} in Megatron's module order; the groups' keys in that order too
    keys: dict[str, list] = {}
    for p in sorted(plan.params, key=lambda p: _order(names[p.name])):
        key, layer = dist_key(names[p.name], layers)
        keys.setdefault(key, []).append((layer, p))
    _, members = _megatron_groups(ck)
    grouped = [k for g in members for k in keys if names[keys[k][0][1].name] in g]  # a key's layers: one group
    w = writer(it, checkpoint_id=str(plan.out / it.name), shards=2, save_id=plan_save_id(plan))

    def put(key: str, layer: int | None, p, t, dtype=None) -> None:
        part = lazy_part(t, dtype, unit=unit[p.name], layer=layer is not None)
        if layer is None:
            w.tensor_part((key,), tuple(t.shape), (0,) * len(t.shape), part)
        else:
            w.tensor_part((key,), (layers, *t.shape), (layer,) + (0,) * len(t.shape), part)

    # each linear's extra state after its last tensor (its bias; its weight where it has none)
    extra = {
        next(k for k in (f"decoder.layers.{x}.bias", f"decoder.layers.{x}.weight") if k in keys): x
        for x in EXTRA_STATE_LINEARS
    }
    try:
        for key, items in keys.items():  # the module's weights (bf16), each linear's extra state after them
            for layer, p in items:
                put(key, layer, p, module[p.name], torch.bfloat16)
            if key in extra:
                w.value((f"decoder.layers.{extra[key]}._extra_state/shard_0_{layers}",), [None])
            if extra.get(key) == "mlp.linear_fc2":  # the other layers' extra states, as Megatron lists them
                for i in range(1, layers):
                    for x in EXTRA_STATE_LINEARS:
                        w.value((f"decoder.layers.{x}._extra_state/shard_{i}_{layers}",), [None])
        for key in grouped:  # Adam's moments, param group after param group, then the fp32 master
            for k in ("exp_avg", "exp_avg_sq"):
                for layer, p in keys[key]:
                    put(f"optimizer.state.{k}.{key}", layer, p, p.states[k])
        for key in grouped:
            for layer, p in keys[key]:
                put(f"optimizer.state.fp32_param.{key}", layer, p, p.weight)
                if progress:
                    progress(p.nbytes)
    except BaseException:
        w.abort()
        raise

    def tail(root: Path) -> int:
        return _write_tail(plan, ck, args, root / f"iter_{iteration:07d}", root)

    return w, tail


def _write_tail(plan, ck, args: dict[str, Any], it: Path, root: Path) -> int:
    """common.pt, metadata.json and the iteration file; returns common.pt's bytes."""
    import argparse

    import torch

    from ..view import logical as L
    from ..write.megatron_write import CONTENT_METADATA, DIST_META, LATEST

    iteration = args["iteration"]
    groups, _ = _megatron_groups(ck)
    titan_sched = _titan_schedule(ck) if _titan(ck) else None  # parsed and checked once, not per group
    pgroups = []
    for g, wd_mult in zip(groups, (1.0, 0.0)):
        hp = {k: v for k, v in g.items() if k != "params"}
        if not _titan(ck):
            top, low = args["lr"], args["min_lr"]
        elif titan_sched is not None:  # each group's own base LR and floor under the one WSD schedule
            top = float(g["initial_lr"])
            low = top * titan_sched["mf"]
        else:
            top = low = float(g["lr"])
        pgroups.append(
            {
                "is_expert_parallel": False,
                "default_config": True,
                "wd_mult": wd_mult,
                "lr_mult": 1.0,
                "is_decoupled_lr": False,
                "max_lr": top,
                "min_lr": low,
                **hp,
            }
        )
    step = next(float(v["step"]) for v in L.optimizer_scalars(ck).values() if v.get("step") is not None)
    common = {
        "args": argparse.Namespace(**args),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "optimizer": {
            "optimizer": {"state": {"common_step": torch.tensor(step, dtype=torch.float32)}, "param_groups": pgroups}
        },
        "opt_param_scheduler": scheduler_state(ck, args),
        "num_floating_point_operations_so_far": 0.0,
        "content_metadata": dict(CONTENT_METADATA),
    }
    torch.save(common, it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(DIST_META))
    (root / LATEST).write_text(str(iteration))
    return (it / "common.pt").stat().st_size


# --- the way in from torchtitan (its Llama, a DCP save of its CheckpointManager) -------------------------------
#
# torchtitan's checkpoint holds no model config: the head counts, RoPE and norm settings come from the model's
# Hugging Face config.json (`--hf-config`, as `export --hf` takes it), checked against every tensor's shape. The
# source is read as a Megatron-core view (`titan_view`): the same DCP tree, its tensors under Megatron-core names,
# where Megatron fuses what torchtitan keeps apart the view's tensor is made from the parts at read time (a
# `TensorNode` whose shards are the parts: `linear_qkv` by `read.qkv.megatron_qkv`, per query group with q / k
# rows from torchtitan's interleaved RoPE pairs to Megatron's rotate-half order; SwiGLU `linear_fc1` = [w1; w3]).
# The writer, the plan and the logical diff all read that view.

#: torchtitan Llama name -> Megatron-core name ({}: the layer); the parts of one fused Megatron tensor in order
_TITAN = (
    (r"tok_embeddings\.weight", "embedding.word_embeddings.weight"),
    (
        r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?w(q|k|v|qkv)\.weight",
        "decoder.layers.{}.self_attention.linear_qkv.weight",
    ),
    (r"layers\.(\d+)\.attention\.wo\.weight", "decoder.layers.{}.self_attention.linear_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight"),
    (r"layers\.(\d+)\.feed_forward\.w(1|3)\.weight", "decoder.layers.{}.mlp.linear_fc1.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "decoder.layers.{}.mlp.linear_fc2.weight"),
    (r"norm\.weight", "decoder.final_layernorm.weight"),
    (r"(?:lm_head|output)\.weight", "output_layer.weight"),
)
_TITAN_RX = tuple((re.compile(p + "$"), core) for p, core in _TITAN)
_PART_ORDER = {"q": 0, "k": 1, "v": 2, "qkv": 0, "1": 0, "3": 1}
_VIEW = "megatron_in"  # ck.details key marking a torchtitan source read under Megatron-core names


def is_torchtitan(ck) -> bool:
    """A torchtitan Llama DCP save (its model keys flat: `tok_embeddings.weight`, `layers.N.attention.…wq…`)."""
    from ..read.tree import GroupNode
    from .hf_map import is_torchtitan_llama

    model = ck.tree.children.get("model")
    return ck.format == "dcp" and isinstance(model, GroupNode) and is_torchtitan_llama(list(model.children))


def _titan_core(name: str, ck) -> tuple[str, int]:
    """(Megatron-core name, the part's position in it) of a torchtitan name; refuses one it does not map."""
    for rx, core in _TITAN_RX:
        m = rx.match(name)
        if m:
            g = m.groups()
            return core.format(g[0]) if g else core, _PART_ORDER.get(g[1], 0) if len(g) > 1 else 0
    _refuse(
        f"{name}: not a parameter of torchtitan's Llama (tok_embeddings, layers.N.attention / attention_norm / "
        "feed_forward / ffn_norm, norm, output): ckpt does not map it to Megatron-core",
        ck,
    )


def _hf_cfg(ck) -> tuple[dict[str, Any], str]:
    path = ck.details.get("hf_config")
    if not path:
        _refuse(
            "a torchtitan checkpoint holds no model config: --to megatron needs the model's Hugging Face "
            "config.json for the head counts, RoPE and norm settings",
            ck,
            hint="add --hf-config CONFIG.json (as for `ckpt export --hf`)",
        )
    return json.loads(Path(path).read_text()), path


def _rope(cfg: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(RoPE base, its scaling or None) from a config.json: transformers 5's `rope_parameters` {rope_theta,
    rope_type, ...} or the older `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        kind = params.get("rope_type") or params.get("type") or "default"
        return params.get("rope_theta", cfg.get("rope_theta")), (None if kind == "default" else params)
    scaling = cfg.get("rope_scaling") or None
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "default":
        scaling = None
    return cfg.get("rope_theta"), scaling


def titan_heads(cfg: dict[str, Any]) -> tuple[int, int]:
    heads = cfg.get("num_attention_heads")
    return heads, cfg.get("num_key_value_heads") or heads


def titan_view(
    ck,
    heads: int,
    groups: int,
    hf_config: str | None = None,
    seq_length: int | None = None,
    lr_scheduler: str | None = None,
    drop_norm_decay: bool = False,
):
    """The torchtitan checkpoint `ck` under Megatron-core names (see above), `heads` query heads in `groups` KV
    groups; `hf_config` / `seq_length` (the conversion's) kept in its details. `drop_norm_decay`
    (`--drop-norm-decay`): the 1-D tensors of a group that decays (torchtitan's stock `default_adamw`: one group,
    weight decay on every parameter) moved into a group of their own with weight decay 0, as Megatron-core's own
    rule groups them; the view then is what Megatron will train, and its details say what changed."""
    from ..read.qkv import megatron_rule
    from ..read.tree import GroupNode, TensorNode, ValueNode

    kids = ck.tree.children
    rule = megatron_rule(heads, groups)

    def composed(core: str, parts: list[tuple[int, Any]]):
        nodes = [n for _, n in sorted(parts, key=lambda x: x[0])]
        if len(nodes) == 1 and not core.endswith("linear_qkv.weight"):
            return nodes[0]
        if not all(isinstance(n, TensorNode) for n in nodes) or len({n.dtype for n in nodes}) > 1:
            _refuse(f"{core}: its torchtitan parts are not tensors of one dtype", ck)
        if core.endswith("linear_qkv.weight"):
            rows = sum(n.shape[0] for n in nodes)
            if rows != (heads + 2 * groups) * (rows // (heads + 2 * groups)) or len(nodes) not in (1, 3):
                _refuse(f"{core}: {rows} q/k/v rows do not fit {heads} heads in {groups} KV groups", ck)
            return TensorNode((rows, *nodes[0].shape[1:]), nodes[0].dtype, shards=tuple(nodes), merge=rule)
        return TensorNode(
            (sum(n.shape[0] for n in nodes), *nodes[0].shape[1:]), nodes[0].dtype, shards=tuple(nodes), merge="cat:0"
        )

    def by_core(items) -> dict[str, list[tuple[int, Any]]]:
        out: dict[str, list[tuple[int, Any]]] = {}
        for name, node in items:
            core, at = _titan_core(name, ck)
            out.setdefault(core, []).append((at, node))
        return out

    model = {core: composed(core, parts) for core, parts in by_core(kids["model"].children.items()).items()}
    new = dict(kids)
    new["model"] = GroupNode(model)
    opt = kids.get("optimizer")
    rename = {}
    if isinstance(opt, GroupNode) and isinstance(opt.children.get("state"), GroupNode):
        state = {}
        for core, parts in by_core(opt.children["state"].children.items()).items():
            keys = {k for _, e in parts for k in e.children}
            entry = {}
            for k in sorted(keys):
                got = [(at, e.children[k]) for at, e in parts if k in e.children]
                entry[k] = got[0][1] if k == "step" else composed(core, got)
            state[core] = GroupNode(entry)
        rename = {name: _titan_core(name, ck)[0] for name in opt.children["state"].children}
        groups_node = opt.children.get("param_groups")
        pg = {}
        for i, g in groups_node.children.items() if isinstance(groups_node, GroupNode) else ():
            members = g.children.get("params") if isinstance(g, GroupNode) else None
            if isinstance(members, ValueNode) and isinstance(members.value, list):
                names = list(dict.fromkeys(rename.get(n) or _titan_core(n, ck)[0] for n in members.value))
                g = GroupNode({**g.children, "params": ValueNode(names)})
            pg[i] = g

        def flat(g) -> bool:  # a group of 1-D tensors only: Megatron-core's no-decay group, which it puts last
            members = g.children.get("params") if isinstance(g, GroupNode) else None
            names = members.value if isinstance(members, ValueNode) and isinstance(members.value, list) else []
            return bool(names) and all(len(getattr(model.get(n), "shape", (0, 0))) == 1 for n in names)

        dropped: list[tuple[float, int]] = []
        if drop_norm_decay:
            pg, dropped = _split_decaying_norms(pg, model, ck)
        pg = {str(j): g for j, g in enumerate(sorted(pg.values(), key=flat))}  # Megatron-core's group order
        new["optimizer"] = GroupNode(
            {**opt.children, "state": GroupNode(state), **({"param_groups": GroupNode(pg)} if pg else {})}
        )
    details = {k: v for k, v in ck.details.items() if k not in ("convert_unproven", "resume_unsupported", "fused")}
    details[_VIEW] = (
        f"torchtitan Llama read under Megatron-core names ({heads} heads, {groups} KV groups: q/k rows "
        "in rotate-half order, wq/wk/wv fused per query group, w1/w3 as linear_fc1)"
    )
    if hf_config:
        details["hf_config"] = str(hf_config)
    if drop_norm_decay:
        details["norm_decay_dropped"] = dropped
    if seq_length:
        details["seq_length"] = int(seq_length)
    if lr_scheduler:
        details["titan_schedule"] = str(lr_scheduler)
    return dataclasses.replace(ck, tree=dataclasses.replace(ck.tree, children=new), details=details, state_split={})


def _split_decaying_norms(pg: dict, model: dict, ck) -> tuple[dict, list[tuple[float, int]]]:
    """`--drop-norm-decay`: each param group that decays and holds 1-D tensors (norm weights) split into its
    other members, as they were, and its 1-D members with weight decay 0 (Megatron-core's wd_mult 0 group);
    [(the weight decay dropped, how many tensors)] per split group. Refuses when no group needs it."""
    from ..read.tree import GroupNode, ValueNode

    out: dict = {}
    dropped: list[tuple[float, int]] = []
    for i, g in pg.items():
        members = g.children.get("params") if isinstance(g, GroupNode) else None
        wd = g.children.get("weight_decay") if isinstance(g, GroupNode) else None
        names = members.value if isinstance(members, ValueNode) and isinstance(members.value, list) else []
        decay = float(wd.value) if isinstance(wd, ValueNode) and isinstance(wd.value, (int, float)) else 0.0
        flat = [n for n in names if len(getattr(model.get(n), "shape", (0, 0))) == 1]
        if not decay or not flat:
            out[i] = g
            continue
        norms = set(flat)
        rest = [n for n in names if n not in norms]
        if rest:
            out[i] = GroupNode({**g.children, "params": ValueNode(rest)})
        out[f"{i}.norms"] = GroupNode({**g.children, "params": ValueNode(flat), "weight_decay": ValueNode(0.0)})
        dropped.append((decay, len(flat)))
    if not dropped:
        _refuse(
            "--drop-norm-decay: no param group decays the norms (1-D tensors): nothing to drop",
            ck,
            hint="drop the flag",
        )
    return out, dropped


def source_view(
    ck,
    hf_config: str | None = None,
    seq_length: int | None = None,
    lr_scheduler: str | None = None,
    drop_norm_decay: bool = False,
):
    """What the conversion into Megatron reads: a torchtitan source as `titan_view` (its heads from the
    `--hf-config` given, every shape checked against it), any other source as it is."""
    if not is_torchtitan(ck):
        if hf_config is not None or seq_length is not None or lr_scheduler is not None or drop_norm_decay:
            raise UnsupportedCheckpoint(
                "--hf-config / --seq-length / --lr-scheduler / --drop-norm-decay describe a "
                "torchtitan run, "
                f"which saves no config; this is a {ck.format} checkpoint",
                path=Path(ck.path),
                hint="drop them",
            )
        return ck
    from .export import _hf_config_file

    if hf_config is None:
        _hf_cfg(ck)  # refuses, naming --hf-config
    cfg_file = _hf_config_file(hf_config)
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise UnsupportedCheckpoint(
            f"--hf-config: cannot read it ({e})", path=cfg_file, hint="pass a JSON config.json"
        ) from None
    _titan_check_config(ck, cfg, str(cfg_file))
    heads, groups = titan_heads(cfg)
    return titan_view(ck, heads, groups, str(cfg_file), seq_length, lr_scheduler, drop_norm_decay)


def _titan_check_config(ck, cfg: dict[str, Any], where: str) -> None:
    """Refuse, naming it, a config.json that does not describe this torchtitan Llama as Megatron-core builds one."""
    from ..read.tree import iter_tensors
    from .hf_map import LLAMA3_ROPE as _ROPE_FIXED, torchtitan_llama_to_hf

    shapes = {n: tuple(t.shape) for n, t in iter_tensors(ck.tree.children["model"])}
    if not isinstance(cfg.get("head_dim"), int):  # without it any head count whose product fits passes the shapes
        _refuse(
            f"{where} has no integer head_dim: the head counts, which order the q / k rows, cannot be checked "
            "against the saved shapes (hidden_size / num_attention_heads would be assumed)",
            ck,
            hint='add "head_dim": N (the model\'s head dimension) to the config.json',
        )
    torchtitan_llama_to_hf(shapes, cfg, where)  # every name mapped; q / k / embedding shapes and layer count
    ffn = next(s[0] for n, s in shapes.items() if n.endswith("feed_forward.w1.weight"))
    theta, scaling = _rope(cfg)
    bad = []
    if cfg.get("intermediate_size") != ffn:
        bad.append(f"intermediate_size {cfg.get('intermediate_size')} (w1 has {ffn} rows)")
    if cfg.get("tie_word_embeddings"):
        bad.append("tie_word_embeddings (torchtitan's Llama keeps its own output weight)")
    if not any(n in shapes for n in ("output.weight", "lm_head.weight")):
        bad.append("no output weight in the checkpoint")
    if (cfg.get("hidden_act") or "silu") != "silu":
        bad.append(f"hidden_act {cfg.get('hidden_act')!r} (SwiGLU: silu)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        bad.append("biases")
    for key, v in (
        ("rope_theta", theta),
        ("rms_norm_eps", cfg.get("rms_norm_eps")),
        ("max_position_embeddings", cfg.get("max_position_embeddings")),
    ):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            bad.append(f"no {key}")
    if isinstance(theta, float) and not theta.is_integer():
        bad.append(f"rope_theta {theta} (Megatron's --rotary-base is an integer)")
    if scaling is not None:
        kind = scaling.get("rope_type") or scaling.get("type")
        fixed = {k: scaling.get(k) for k in _ROPE_FIXED}
        if kind != "llama3" or fixed != _ROPE_FIXED or not isinstance(scaling.get("factor"), (int, float)):
            bad.append(f"rope_scaling {scaling} (Megatron-core has llama3 scaling with {_ROPE_FIXED} only)")
    if bad:
        _refuse(
            f"{where} does not describe a torchtitan Llama Megatron-core can build: {'; '.join(bad)}",
            ck,
            hint="pass this model's Hugging Face config.json (LlamaConfig)",
        )


# torchtitan 0.3.0's LR schedule (`LRSchedulersContainer.Config.build`: one LambdaLR factor for every group, from its
# job config, not saved) and its exact Megatron equivalent. With T total steps, W warm-up, D decay steps
# (round(T x decay_ratio), or T - W) and S = T + 1 - W - D stable steps, update n + 1 uses factor(n):
#   n < W: (n + 1) / W;   n < W + S: 1;   else mf + (1 - mf) g((n + 1 - W - S) / D)   (g: linear / sqrt / cosine)
# Megatron's OptimizerParamScheduler (core_v0.16), also at update n + 1 with num_steps = n iterations (x global batch),
# in WSD style with lr_decay_iters T, lr_wsd_decay_iters D: n <= T - D (= W + S - 1) gives 1, then g((n - T + D) / D),
# between each group's max_lr and min_lr = max_lr x mf: the same factors; with lr_warmup_iters W - 1 and
# lr_warmup_init = max_lr / W its warm-up is (n + 1) / W for the group whose max_lr is args.lr (one init for all).
_TITAN_SCHEDULE_KEYS = ("warmup_steps", "decay_ratio", "decay_type", "min_lr_factor", "training_steps", "total_steps")
_WSD_STYLE = {"linear": "linear", "cosine": "cosine", "sqrt": "minus_sqrt"}


def parse_titan_schedule(spec: str, ck) -> dict[str, Any]:
    """`warmup_steps=2,decay_ratio=0.6,decay_type=linear,min_lr_factor=0,training_steps=5` (torchtitan's own
    `lr_scheduler` field names and `training.steps`) -> {T, W, D, S, type, mf}, by torchtitan 0.3.0's build rules."""
    got: dict[str, str] = {}
    for part in (p for p in spec.split(",") if p.strip()):
        key, _, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if key not in _TITAN_SCHEDULE_KEYS or not value.strip():
            _refuse(
                f"--lr-scheduler {part!r}: use {', '.join(k + '=' for k in _TITAN_SCHEDULE_KEYS)} (torchtitan's "
                "lr_scheduler fields and training.steps)",
                ck,
            )
        got[key] = value.strip()
    if "training_steps" not in got and "total_steps" not in got:
        _refuse("--lr-scheduler needs training_steps= (torchtitan's training.steps) or total_steps=", ck)
    try:
        t = int(got.get("total_steps") or got["training_steps"])
        w = min(int(got.get("warmup_steps", 200)), t)  # torchtitan's defaults where a field is left out
        ratio = None if got.get("decay_ratio", "none").lower() == "none" else float(got["decay_ratio"])
        mf = float(got.get("min_lr_factor", 0.0))
    except ValueError as e:
        _refuse(f"--lr-scheduler {spec!r}: {e}", ck)
    kind = got.get("decay_type", "linear")
    if kind not in _WSD_STYLE:
        _refuse(f"--lr-scheduler decay_type={kind}: torchtitan's are linear, sqrt, cosine", ck)
    d = round(t * ratio) if ratio is not None else t - w
    d = min(d, t - w)
    if d < 1:
        _refuse(
            f"--lr-scheduler {spec!r}: no decay steps (torchtitan's factor is then 1 after the warm-up): not mapped",
            ck,
            hint="omit --lr-scheduler: a constant schedule at each group's LR is written",
        )
    return {
        "T": t,
        "W": w,
        "D": d,
        "S": t + 1 - w - d,
        "type": kind,
        "mf": mf,
        "training_steps": int(got.get("training_steps") or t),
    }


def titan_factor(s: dict[str, Any], n: int) -> float:
    """torchtitan 0.3.0's LambdaLR factor for update n + 1 (see above)."""
    import math

    if n < s["W"]:
        return float((n + 1) / s["W"])
    if n < s["W"] + s["S"]:
        return 1.0
    progress = float(n + 1 - s["W"] - s["S"]) / s["D"]
    adj = {
        "linear": lambda: 1 - progress,
        "sqrt": lambda: 1 - math.sqrt(progress),
        "cosine": lambda: 0.5 * (1.0 + math.cos(math.pi * progress)),
    }[s["type"]]()
    return s["mf"] + (1 - s["mf"]) * adj


def _titan_schedule(ck) -> dict[str, Any] | None:
    """The torchtitan schedule `--lr-scheduler` gave, checked against the checkpoint: each group's saved `lr` must be
    its `initial_lr` x the factor at the saved `last_epoch` (what torchtitan's LambdaLR set), or it is not this
    run's."""
    spec = ck.details.get("titan_schedule")
    if not spec:
        return None
    s = parse_titan_schedule(spec, ck)
    epoch = ck.counters.scheduler_last_epoch
    if epoch is None:
        _refuse("the checkpoint holds no lr_scheduler.last_epoch: the schedule's position is unknown", ck)
    if ck.counters.global_step != epoch:  # Megatron's position is its iteration (train_state.step)
        _refuse(
            f"train_state.step {ck.counters.global_step} and lr_scheduler.last_epoch {epoch} differ: Megatron "
            "places its schedule at its iteration, so the two must agree",
            ck,
            hint="convert without --lr-scheduler (a constant schedule at each group's saved LR)",
        )
    from ..view import logical as L

    for g in L.param_groups(ck):
        base, lr = g.get("initial_lr"), g.get("lr")
        if not isinstance(base, (int, float)) or not isinstance(lr, (int, float)):
            _refuse("a param group without initial_lr / lr: torchtitan's LambdaLR sets both", ck)
        want = base * titan_factor(s, epoch)
        if abs(want - lr) > 1e-9 * max(abs(lr), abs(want), 1e-30):
            _refuse(
                f"--lr-scheduler {spec!r} gives lr {want:.6g} at last_epoch {epoch} for the group with initial_lr "
                f"{base:g}, but the checkpoint holds {lr:.6g}: not the schedule this run trained with",
                ck,
                hint="pass the run's own torchtitan lr_scheduler settings and training.steps",
            )
    mid_warmup = epoch < s["W"] - 1 and len({float(g["initial_lr"]) for g in L.param_groups(ck)}) > 1
    return {**s, "last_epoch": epoch, "mid_warmup": mid_warmup}


def _titan_arch(ck) -> dict[str, Any]:
    """The Llama the config.json describes (checked against the tensors by `source_view`), as Megatron's args."""
    cfg, _ = _hf_cfg(ck)
    shapes = _shapes(ck)
    heads, groups = titan_heads(cfg)
    hidden = shapes["embedding.word_embeddings.weight"][1]
    theta, scaling = _rope(cfg)
    seq = int(ck.details.get("seq_length") or cfg["max_position_embeddings"])
    return {
        "num_layers": sum(1 for k in shapes if k.endswith(".self_attention.linear_qkv.weight")),
        "hidden_size": hidden,
        "ffn_hidden_size": shapes["decoder.layers.0.mlp.linear_fc2.weight"][1],
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "group_query_attention": groups != heads,
        "kv_channels": int(cfg.get("head_dim") or hidden // heads),
        "padded_vocab_size": shapes["embedding.word_embeddings.weight"][0],
        "max_position_embeddings": int(cfg["max_position_embeddings"]),
        "seq_length": seq,
        "layernorm_epsilon": float(cfg["rms_norm_eps"]),
        "normalization": "RMSNorm",
        "swiglu": True,
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "use_rope_scaling": scaling is not None,
        "rope_scaling_factor": float(scaling["factor"]) if scaling else 8.0,
        "untie_embeddings_and_output_weights": True,
        "add_position_embedding": False,
        "add_bias_linear": False,
        "add_qkv_bias": False,
        "bias_swiglu_fusion": False,
        "apply_rope_fusion": False,
    }


def _titan_check(ck) -> None:
    from ..view import logical as L

    if not L.optimizer_states(ck):
        _refuse(
            "no optimizer state: a model-only save (torchtitan's last save is model-only by default, "
            "--checkpoint.last-save-model-only); --to megatron carries a run with its Adam state",
            ck,
            hint="convert an intermediate step-N folder, or export the weights with `ckpt export`",
        )
    moments = sorted({t.dtype for st in L.optimizer_states(ck).values() for k, t in st.items() if k != "step"})
    if moments != ["float32"]:
        _refuse(f"Adam moments saved as {', '.join(moments)}: Megatron's optimizer keeps them in float32", ck)
    dtypes = sorted({t.dtype for t in L.model_tensors(ck, weights="module")})
    if dtypes != ["float32"]:
        _refuse(
            f"weights saved as {', '.join(dtypes)}: the fp32 master Megatron's bf16 run keeps would be "
            "rounded; torchtitan's FSDP2 saves float32",
            ck,
        )
    for g in L.param_groups(ck):
        odd = [k for k in ("amsgrad", "maximize", "nesterov") if g.get(k)]
        if odd or g.get("decoupled_weight_decay") is False or "betas" not in g:
            why = ", ".join(odd) or "no betas / coupled weight decay"
            _refuse(
                f"param group of {', '.join(g.get('params', [])[:2])}, ...: not AdamW ({why}): Megatron's "
                "optimizer here is AdamW",
                ck,
            )
    _titan_arch(ck)


def _titan_lines(ck) -> tuple[list[str], list[str]]:
    from ..view import logical as L

    _, path = _hf_cfg(ck)
    arch = _titan_arch(ck)
    groups, _ = _megatron_groups(ck)
    lrs = ", ".join(f"{float(g['lr']):g}" for g in groups)
    dp = ck.topology.dp or 1
    sched = _titan_schedule(ck)
    notes = [
        f"Megatron-LM torch_dist (plain Adam) from a torchtitan Llama (FSDP2, DP {dp}): global tensors under "
        f"Megatron-core names, {arch['num_layers']} layers stacked on a leading axis; Megatron reshards them at "
        "load, so it resumes at any TP / PP",
        f"attention: wq / wk / wv fused per query group into linear_qkv ({arch['num_attention_heads']} heads, "
        f"{arch['num_query_groups']} KV groups from {path}); q / k rows permuted per head from torchtitan's "
        "interleaved RoPE pairs to Megatron's rotate-half order (the permutation torchtitan's own Hugging Face "
        "converter applies); SwiGLU w1 / w3 as linear_fc1 (gate rows, then up rows); Adam's moments moved with "
        "their rows",
        "weights: the saved float32 weights as optimizer.state.fp32_param, the module's bf16 copy rounded from "
        "them (Megatron's --bf16, as torchtitan's default bf16 FSDP compute); Adam's exp_avg / exp_avg_sq; the "
        "common Adam step; param groups in Megatron-core's order (decaying weights; 1-D tensors with wd_mult 0)",
        f"args: from {path} (its head counts checked against the q / k shapes; the RoPE base and scaling and the "
        "norm eps cannot be checked against a checkpoint and are taken as given): RMSNorm (eps "
        f"{arch['layernorm_epsilon']:g}), SwiGLU, RoPE base "
        f"{arch['rotary_base']}"
        + (f" with llama3 scaling (factor {arch['rope_scaling_factor']:g})" if arch["use_rope_scaling"] else "")
        + f", no biases, untied output; seq_length {arch['seq_length']}"
        f"{'' if ck.details.get('seq_length') else ' (max_position_embeddings; --seq-length sets it)'}; "
        "no dropout, the local transformer implementation; tokenizer NullTokenizer sized to the saved "
        "vocabulary rows and mock_data (relaunch with your own tokenizer and data flags)",
        (
            f"scheduler: Megatron's constant schedule at each param group's saved LR ({lrs}: the LR torchtitan's "
            "next step uses), each group's own max_lr / min_lr"
            if sched is None
            else f"scheduler: torchtitan's warm-up {sched['W']} / stable {sched['S']} / {sched['type']} decay "
            f"{sched['D']} "
            f"over {sched['T']} steps (min_lr_factor {sched['mf']:g}; --lr-scheduler, checked against every group's "
            f"saved LR at last_epoch {sched['last_epoch']}) as Megatron's WSD schedule (lr_decay_iters {sched['T']}, "
            f"lr_wsd_decay_iters {sched['D']}, {_WSD_STYLE[sched['type']]}), each group's initial_lr as its max_lr: "
            "the same LR at every later step"
        ),
    ]
    not_moved = (
        [
            f"LR schedule: torchtitan rebuilds its warmup / decay from its job config (the checkpoint's "
            f"lr_scheduler holds only last_epoch {ck.counters.scheduler_last_epoch}): written as a constant "
            f"schedule at the current LRs ({lrs}); pass --lr-scheduler with the run's settings to carry it"
        ]
        if sched is None
        else []
    )
    if sched is not None and sched["mid_warmup"]:
        not_moved.append(
            f"the rest of the warm-up (to step {sched['W']}): Megatron has one lr_warmup_init for all "
            "groups, so only the first group's warm-up LRs are torchtitan's"
        )
    if sched is not None:
        not_moved.append(
            "beyond torchtitan's last step its factor leaves min_lr_factor (its formula is not clamped); "
            "Megatron's stays at min_lr (the two agree up to the last step)"
        )
    not_moved += [
        "RNG states: torchtitan's generators are not Megatron's (args.no_save_rng=True: Megatron seeds "
        "afresh from args.seed)",
        "data position: torchtitan's dataloader state and ntokens_seen "
        f"({ck.details.get('train_state', 'not recorded')}); consumed_train_samples = iteration x global "
        "batch is recorded",
        f"batch sizes and gradient clipping live in torchtitan's job config: args record micro batch 1, "
        f"global batch {dp} (one sequence per DP rank) and clip_grad 1.0 (torchtitan's and Megatron's default "
        "max_norm): relaunch with yours; Megatron counts its schedule in samples of the saved global "
        "batch, so another --global-batch-size needs --override-opt_param-scheduler and moves the "
        "schedule's position",
    ]
    for decay, n in ck.details.get("norm_decay_dropped") or ():
        not_moved.append(
            f"weight decay {decay:g} on {n} norm weights (1-D tensors; --drop-norm-decay): torchtitan "
            "decayed them, Megatron-core never decays 1-D tensors (wd_mult 0): written in a group of "
            "their own with weight_decay 0, with their LR, Adam state and step as saved"
        )
    if L.optimizer_scalars(ck) and ck.counters.global_step is None:
        not_moved.append("the step: torchtitan's train_state is missing")
    return notes, not_moved


__all__ = [
    "handles",
    "core_names",
    "core_view",
    "check",
    "plan_lines",
    "write",
    "megatron_args",
    "added",
    "is_torchtitan",
    "source_view",
    "titan_view",
]
