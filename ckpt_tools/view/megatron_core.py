"""The way into Megatron-LM, as a view: a Megatron-DeepSpeed pipeline checkpoint (DeepSpeed's `PipelineModule` save of
GPTModelPipe: `layer_LL-model_TT-model_states.pt` + `bf16_zero_pp_rank_*` ZeRO-1/2 optimizer files), or a torchtitan
Llama's DCP save (`view.torchtitan.titan_view`), presented under Megatron-core's names with the Megatron-LM args,
param groups and schedule a core_v0.16.1 torch_dist run folder holds for it; `write.megatron_from_view` writes that
folder (`ckpt convert SRC OUT --to megatron`), plain Adam.

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
import re
from typing import Any

from ..read.tree import GroupNode, node_to_python, saved_config
from . import logical as L
from .format_facts import naming_of_format, param_naming
from .torchtitan import (
    WSD_STYLE,
    from_torchtitan,
    is_titan_view,
    is_torchtitan,
    refuse as _refuse,
    titan_arch,
    titan_schedule,
    titan_view,
)


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


def needs_core_view(ck) -> bool:
    """`ck` is a source Megatron-LM reads only under the Megatron-core names this view gives it (a Megatron-DeepSpeed
    pipeline, a torchtitan Llama as saved or already under those names)."""
    return param_naming(ck) == "megatron_deepspeed" or from_torchtitan(ck)


def plan_needs_core_view(source_format: str, hf_config: str | None) -> bool:
    """`needs_core_view` of a plan's source, from what the plan records (its format id, a torchtitan source's
    `--hf-config`)."""
    return naming_of_format(source_format) == "megatron_deepspeed" or hf_config is not None


#: the last checkpoint `core_names` mapped and its map: check, plan and write each ask again for the same tree
_LAST: list[tuple[Any, dict[str, str]]] = []


def core_names(ck) -> dict[str, str]:
    """{DeepSpeed pipeline name (`2.input_layernorm.weight`): Megatron-core name
    (`decoder.layers.0.self_attention.linear_qkv.layer_norm_weight`)} for every model tensor; refuses, naming it,
    a pipeline layer or a local name that is not Megatron-DeepSpeed's GPT. Mapped once per checkpoint object."""
    if _LAST and _LAST[0][0] is ck:
        return _LAST[0][1]
    if is_titan_view(ck):  # already named so
        out = {t.name: t.name for t in L.model_tensors(ck, weights="module")}
        _LAST[:] = [(ck, out)]
        return out
    out = _core_names(ck)
    _LAST[:] = [(ck, out)]
    return out


def _core_names(ck) -> dict[str, str]:
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

    ck = L.open_any(ck)
    if is_titan_view(ck):
        return ck
    if is_torchtitan(ck):
        args = (
            L.node_to_display(other.tree.children["args"])
            if other is not None and "args" in other.tree.children
            else None
        )
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


def pairs_with_core_names(ck, other) -> bool:
    """`ck`, compared with `other`, is read under Megatron-core names (`core_view`): a source `needs_core_view`
    compared with a Megatron-LM checkpoint (what `convert --to megatron` writes from it)."""
    return needs_core_view(ck) and param_naming(other) == "megatron_core"


def _ds_args(ck) -> dict[str, Any]:
    node = ck.tree.children.get("client_state")
    val = node_to_python(node) if node is not None else None
    args = val.get("args") if isinstance(val, dict) else None
    return args if isinstance(args, dict) else {}


def _shapes(ck) -> dict[str, tuple[int, ...]]:
    names = core_names(ck)
    return {names[t.name]: tuple(t.shape) for t in L.model_tensors(ck, weights="module")}


def architecture(ck) -> dict[str, Any]:
    """The GPT the checkpoint holds, from its tensors' shapes (checked against the saved Megatron-DeepSpeed args
    where they say more)."""
    if is_titan_view(ck):
        return titan_arch(ck, _shapes(ck))
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


def schedule(ck, groups: list[dict[str, Any]]) -> tuple[dict[str, Any], str, str | None]:
    """(Megatron's lr schedule in iterations: lr, min_lr, warmup_iters, warmup_init, style; the plan note; the
    not-moved line or None when the schedule carries exactly)."""
    if is_titan_view(ck):  # torchtitan's schedule is in its job config: --lr-scheduler, or each group's LR as it stands
        return _titan_lr_schedule(ck, groups), "", None
    return _deepspeed_schedule(ck, groups)


def _titan_lr_schedule(ck, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """torchtitan's schedule (`--lr-scheduler`) as Megatron's WSD schedule, or constant at the first group's LR."""
    s = titan_schedule(ck)
    if s is None:
        lr = float(groups[0]["lr"])
        return {"lr": lr, "min_lr": lr, "warmup": 0, "init": 0.0, "style": "constant"}
    top = float(groups[0]["initial_lr"])
    return {
        "lr": top,
        "min_lr": top * s["mf"],
        "warmup": max(s["W"] - 1, 0),
        "init": top / s["W"] if s["W"] > 1 else 0.0,
        "style": "WSD",
        "wsd_style": WSD_STYLE[s["type"]],
        "wsd_iters": s["D"],
        "decay_iters": s["T"],
        "train_iters": s["training_steps"],
    }


def _deepspeed_schedule(ck, groups: list[dict[str, Any]]) -> tuple[dict[str, Any], str, str | None]:
    """`schedule` of a DeepSpeed run: its WarmupLR past the warm-up exactly, anything else constant (listed)."""
    cfg = saved_config(ck)
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
    return L.param_groups(core_view(ck))


#: what a torchtitan run whose norms decay (its stock default_adamw: one group) can do about it
_DROP_HINT = (
    "; --drop-norm-decay converts it with the norms (1-D tensors) in a group without weight decay, as "
    "Megatron-core trains them (a change to the run, listed in the plan)"
)


def megatron_groups(ck) -> tuple[list[dict[str, Any]], list[list[str]]]:
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
            + (_DROP_HINT if is_titan_view(ck) and len(groups) == 1 else ""),
            ck,
        )
    wd, nowd = by[tuple(want_decay)], by[tuple(want_none)]
    if float(nowd.get("weight_decay") or 0.0) != 0.0:
        _refuse(
            f"the biases' / norms' param group decays (weight_decay {nowd['weight_decay']}): Megatron-core's "
            "default gives them wd_mult 0" + (_DROP_HINT if is_titan_view(ck) else ""),
            ck,
        )
    same = ("betas", "eps") if is_titan_view(ck) else ("lr", "betas", "eps")  # torchtitan: each group's own max_lr
    diff = [k for k in same if wd.get(k) != nowd.get(k)]
    if diff:
        _refuse(
            f"the two param groups differ in {', '.join(diff)}: Megatron-core has one "
            f"{'Adam' if 'lr' not in diff else 'LR schedule'} for both",
            ck,
        )
    return [wd, nowd], [want_decay, want_none]


def tp_pp(ck) -> tuple[int, int, int]:
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
    arch = architecture(ck)
    groups, _ = megatron_groups(ck)
    sched, _, _ = schedule(ck, groups)
    run = _run_settings(ck, groups, sched, arch["padded_vocab_size"])
    out = {**_model_args(arch, arch["padded_vocab_size"], run["multiple"]), **_training_args(ck, groups, sched, run)}
    if is_titan_view(ck):
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


def _run_settings(ck, groups: list[dict[str, Any]], sched: dict[str, Any], padded: int) -> dict[str, Any]:
    """What the run was launched with: the DeepSpeed config (`cfg`), its Megatron-DeepSpeed args (`a`), Adam's
    settings (`o`, `betas`), batch sizes, train_iters, the vocabulary multiple, the parallel sizes, the iteration; a
    torchtitan run's from its param groups (its job config is not saved)."""
    tp, pp, dp = tp_pp(ck)
    iteration = int(ck.counters.global_step or 0)
    if is_titan_view(ck):  # no DeepSpeed config: what torchtitan's job config held is listed as not moved
        cfg, a, o = {}, {}, {"eps": groups[0]["eps"]}
        betas, gbs, mbs, train_iters = groups[0]["betas"], dp, 1, int(sched.get("train_iters") or iteration)
        multiple = _vocab_multiple(padded, 8)  # the saved rows at TP 1 to 8
    else:
        cfg, a = saved_config(ck), _ds_args(ck)
        o = dict((cfg.get("optimizer") or {}).get("params") or {})
        betas = o.get("betas") or groups[0].get("betas") or (0.9, 0.999)
        gbs = int(cfg.get("train_batch_size") or a.get("global_batch_size"))
        mbs = int(cfg.get("train_micro_batch_size_per_gpu") or a.get("micro_batch_size"))
        train_iters = int(a.get("train_iters") or iteration)
        multiple = _vocab_multiple(padded, tp)
    return dict(
        cfg=cfg, a=a, o=o, betas=betas, gbs=gbs, mbs=mbs, train_iters=train_iters, multiple=multiple,
        tp=tp, pp=pp, dp=dp, iteration=iteration,
    )  # fmt: skip


def _model_args(arch: dict[str, Any], padded: int, multiple: int) -> dict[str, Any]:
    """The model's args (Megatron-DeepSpeed's GPT as Megatron-core builds it; a torchtitan Llama's `arch` overrides
    them), the tokenizer and the precision, in Megatron's args order."""
    import torch  # lazy: params_dtype is a torch dtype; the view stays torch-free until the args are built

    return {
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
    }


def _training_args(ck, groups: list[dict[str, Any]], sched: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The optimizer, schedule, batch, parallel sizes and position args of the run (`_run_settings`)."""
    cfg, a, o, betas = run["cfg"], run["a"], run["o"], run["betas"]
    mbs, gbs, train_iters, iteration = run["mbs"], run["gbs"], run["train_iters"], run["iteration"]
    tp, pp, dp = run["tp"], run["pp"], run["dp"]
    return {
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
        "clip_grad": 1.0 if is_titan_view(ck) else float(cfg.get("gradient_clipping") or 0.0),
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
