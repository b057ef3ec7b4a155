"""The way into Megatron-LM: a Megatron-DeepSpeed pipeline checkpoint (DeepSpeed's `PipelineModule` save of
GPTModelPipe: `layer_LL-model_TT-model_states.pt` + `bf16_zero_pp_rank_*` ZeRO-1/2 optimizer files) written as a
Megatron-LM core_v0.16.1 torch_dist run folder (`ckpt convert SRC OUT --to megatron`), plain Adam.

What is written (the layout of `megatron_write`'s torch_dist writer, the same DCP keys Megatron's own save of a GPT
with LayerNorm / GeLU / learned positions / untied output holds):

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
EMBEDDING_NAMES = {"word_embeddings.weight": "embedding.word_embeddings.weight",
                   "position_embeddings.weight": "embedding.position_embeddings.weight"}
FINAL_NORM_NAMES = {"weight": "decoder.final_layernorm.weight", "bias": "decoder.final_layernorm.bias"}
HEAD_NAMES = {"lm_head.weight": "output_layer.weight"}
#: a decoder layer's tensors in the order Megatron-core registers its modules (the order its sharded state dict,
#: and so its torch_dist .metadata, lists them; `megatron_write`'s legacy writer numbers the optimizer's ids by it)
LAYER_ORDER = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias",
               "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
               "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
               "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
               "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
TOP_ORDER = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "decoder.layers",
             "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
#: the linears whose `_extra_state` Megatron's local spec saves ([None]) and asks for at load
EXTRA_STATE_LINEARS = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
#: param-group fields Megatron-core keeps beside torch's (core_v0.16.1 `_get_param_groups`): written, reported as
#: added by the logical diff (the source's torch groups do not have them)
MEGATRON_GROUP_KEYS = ("is_expert_parallel", "default_config", "wd_mult", "lr_mult", "is_decoupled_lr", "max_lr",
                       "min_lr")
_NAME = re.compile(r"^(\d+)\.(.+)$")


def handles(ck) -> bool:
    return ck.format in SOURCE_FORMATS


def _refuse(msg: str, ck, hint: str | None = None):
    raise UnsupportedCheckpoint(msg, path=Path(ck.path), hint=hint)


#: the last checkpoint `core_names` mapped and its map: check, plan and write each ask again for the same tree
_LAST: list[tuple[Any, dict[str, str]]] = []


def core_names(ck) -> dict[str, str]:
    """{DeepSpeed pipeline name (`2.input_layernorm.weight`): Megatron-core name
    (`decoder.layers.0.self_attention.linear_qkv.layer_norm_weight`)} for every model tensor; refuses, naming it,
    a pipeline layer or a local name that is not Megatron-DeepSpeed's GPT. Mapped once per checkpoint object."""
    if _LAST and _LAST[0][0] is ck:
        return _LAST[0][1]
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
        for table, kind in ((EMBEDDING_NAMES, "embedding"), (LAYER_NAMES, "layer"), (FINAL_NORM_NAMES, "norm"),
                            (HEAD_NAMES, "head")):
            if set(names) <= set(table):
                break
        else:
            bad = sorted(n for n in names if not any(n in t for t in (EMBEDDING_NAMES, LAYER_NAMES, FINAL_NORM_NAMES,
                                                                        HEAD_NAMES)))
            _refuse(f"pipeline layer {spec} holds {', '.join(bad or names)}: not a layer of Megatron-DeepSpeed's GPT "
                    "(embedding, ParallelTransformerLayer, final LayerNorm, LM head): ckpt does not map it to "
                    "Megatron-core", ck)
        if kind == "layer":
            if set(names) != set(LAYER_NAMES):
                _refuse(f"pipeline layer {spec} holds {sorted(names)}: not the LayerNorm / GeLU / biased layer "
                        f"({sorted(LAYER_NAMES)}) ckpt maps to Megatron-core", ck)
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
        _refuse(f"no {', '.join(sorted(need - core))} in the pipeline: ckpt maps an untied GPT with learned "
                "positions, a final LayerNorm and an LM head (a tied output layer is not handled yet)", ck)
    return out


def _rename(node, names: dict[str, str]):
    return dataclasses.replace(node, children={names.get(k, k): v for k, v in node.children.items()})


def core_view(ck):
    """The source read under Megatron-core's names: the model and the optimizer state renamed by `core_names`
    (values, param-group membership and counters as the reader gives them). What the logical diff compares the
    written folder with."""
    from ..view import logical as L
    from ..read.tree import GroupNode

    ck = L.open_any(ck)
    names = core_names(ck)
    kids = dict(ck.tree.children)
    kids["model"] = _rename(ck.tree.children["model"], names)
    opt = ck.tree.children.get("optimizer")
    if isinstance(opt, GroupNode) and isinstance(opt.children.get("state"), GroupNode):
        kids["optimizer"] = dataclasses.replace(opt, children={**opt.children,
                                                               "state": _rename(opt.children["state"], names)})
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
    shapes = _shapes(ck)
    a = _ds_args(ck)
    layers = sum(1 for k in shapes if k.endswith(".self_attention.linear_qkv.weight"))
    vocab, hidden = shapes["embedding.word_embeddings.weight"]
    qkv_rows = shapes["decoder.layers.0.self_attention.linear_qkv.weight"][0]
    ffn = shapes["decoder.layers.0.mlp.linear_fc1.weight"][0]
    heads = a.get("num_attention_heads")
    if not isinstance(heads, int) or heads < 1:
        _refuse("the checkpoint's client state holds no Megatron-DeepSpeed `args` with num_attention_heads: the "
                "attention heads cannot be read from the tensors", ck)
    if qkv_rows != 3 * hidden or hidden % heads:
        _refuse(f"query_key_value has {qkv_rows} rows for hidden {hidden} and {heads} heads: ckpt maps multi-head "
                "attention only (GQA / MQA not handled: their per-group row order differs from Megatron-core's)", ck)
    norm = str(a.get("normalization") or "layernorm").lower()
    checks = {"normalization": (norm, "layernorm"), "swiglu": (bool(a.get("swiglu")), False),
              "untie_embeddings_and_output_weights": (bool(a.get("untie_embeddings_and_output_weights", True)), True),
              "position_embedding_type": (a.get("position_embedding_type") or "learned_absolute", "learned_absolute"),
              "add_bias_linear": (bool(a.get("add_bias_linear", True)), True),
              "num_layers": (a.get("num_layers", layers), layers), "hidden_size": (a.get("hidden_size", hidden), hidden),
              "ffn_hidden_size": (a.get("ffn_hidden_size", ffn), ffn)}
    bad = [f"{k}={v!r}" for k, (v, want) in checks.items() if v != want]
    if bad:
        _refuse(f"saved args {', '.join(bad)}: ckpt maps Megatron-DeepSpeed's GPT with LayerNorm, GeLU MLP, learned "
                "positions, biases and an untied output layer, as its tensors hold it", ck)
    seq = shapes["embedding.position_embeddings.weight"][0]
    return {"num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn, "num_attention_heads": heads,
            "padded_vocab_size": vocab, "max_position_embeddings": seq,
            "seq_length": int(a.get("seq_length") or seq), "layernorm_epsilon": float(a.get("layernorm_epsilon") or 1e-5)}


def _schedule(ck, groups: list[dict[str, Any]]) -> tuple[dict[str, Any], str, str | None]:
    """(Megatron's lr schedule in iterations: lr, min_lr, warmup_iters, warmup_init, style; the plan note; the
    not-moved line or None when the schedule carries exactly)."""
    from ..read.tree import node_to_python

    cfg = _config(ck)
    node = ck.tree.children.get("scheduler")
    state = node_to_python(node) if node is not None else None
    lrs = sorted({float(g["lr"]) for g in groups})
    sched = cfg.get("scheduler") if isinstance(cfg.get("scheduler"), dict) else None
    current = lrs[0]
    if not state and not sched:
        return ({"lr": current, "min_lr": current, "warmup": 0, "init": 0.0, "style": "constant"},
                f"scheduler: none in the source (constant LR {current:g}): Megatron's constant schedule at that LR", None)
    kind, params = (sched or {}).get("type"), dict((sched or {}).get("params") or {})
    it = (state or {}).get("last_batch_iteration")
    iteration = ck.counters.global_step or 0
    if kind == "WarmupLR" and isinstance(it, int):
        lo, hi = params.get("warmup_min_lr", 0.0), params.get("warmup_max_lr", 0.001)
        w = int(params.get("warmup_num_steps", 1000))
        if not isinstance(lo, list) and not isinstance(hi, list) and it >= w and iteration >= w and lrs == [float(hi)]:
            return ({"lr": float(hi), "min_lr": float(hi), "warmup": w, "init": float(lo), "style": "constant"},
                    f"scheduler: DeepSpeed WarmupLR ({params.get('warmup_type', 'log')}, {lo:g} -> {hi:g} over {w} "
                    f"steps) past its warm-up (last_batch_iteration {it}) as Megatron's OptimizerParamScheduler, "
                    f"constant at {hi:g} with lr_warmup_iters {w}: the same LR at every later step", None)
    line = (f"scheduler: DeepSpeed {kind or 'scheduler'} {params} at last_batch_iteration {it}: no Megatron "
            "OptimizerParamScheduler gives the same LR at every later step; written as a constant schedule at the "
            f"param groups' current LR {current:g}: relaunch with --override-opt_param-scheduler and your schedule")
    return ({"lr": current, "min_lr": current, "warmup": 0, "init": 0.0, "style": "constant"}, line, line)


def _groups(ck) -> list[dict[str, Any]]:
    from ..view import logical as L

    return L.param_groups(core_view(ck))


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
        _refuse(f"{len(groups)} param groups not split as Megatron-core splits them (weights with decay; biases and "
                "1-D tensors without): Megatron would rebuild other groups and load the state into them", ck)
    wd, nowd = by[tuple(want_decay)], by[tuple(want_none)]
    if float(nowd.get("weight_decay") or 0.0) != 0.0:
        _refuse(f"the biases' / norms' param group decays (weight_decay {nowd['weight_decay']}): Megatron-core's "
                "default gives them wd_mult 0", ck)
    same = ("lr", "betas", "eps")
    diff = [k for k in same if wd.get(k) != nowd.get(k)]
    if diff:
        _refuse(f"the two param groups differ in {', '.join(diff)}: Megatron-core schedules one LR for both", ck)
    return [wd, nowd], [want_decay, want_none]


def check(ck, src: Path, ckpt_format: str = "torch_dist", tp: int | None = None,
          pp: int | None = None) -> tuple[None, None]:
    """Refuse, in one line naming it, what this conversion does not carry into a loadable Megatron run; returns
    (None, None): torch_dist holds whole tensors, Megatron reshards them at load (`megatron_write.check`'s shape)."""
    if ckpt_format != "torch_dist":
        raise UnsupportedCheckpoint(
            f"--to megatron --ckpt-format {ckpt_format} needs a Megatron-LM torch_dist checkpoint; this is {ck.format}",
            path=src, hint="convert it with --ckpt-format torch_dist first, then that run with --ckpt-format torch")
    cfg = _config(ck)
    if not (isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled")):
        _refuse("--to megatron from DeepSpeed is proven for bf16 runs (Megatron's bf16 params with an fp32 master); "
                "this run is not bf16 (ds_config.bf16.enabled)", ck)
    opt = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if opt not in ("adam", "adamw"):
        _refuse(f"optimizer {opt or '(not in ds_config)'}: Megatron's plain optimizer here is Adam(W)", ck)
    if (ck.topology.zero_stage or 0) > 2:
        _refuse("ZeRO-3 pipeline checkpoint: not handled (DeepSpeed pipelines run ZeRO-1/2)", ck)
    if ck.counters.skipped_steps:
        _refuse(f"{ck.counters.skipped_steps} skipped steps: the Adam step and the iteration differ, which "
                "Megatron's checkpoint cannot say", ck)
    _architecture(ck)
    _megatron_groups(ck)
    if (ck.topology.tp or 1) > 1:
        from .tp_sync import check_tp_sync

        drifted = [p.name for p in check_tp_sync(ck).params if not p.in_sync]
        if drifted:  # the merge would take TP rank 0's copy silently: Megatron saves a replica once
            _refuse(f"{len(drifted)} TP-replicated parameters differ across TP ranks ({', '.join(drifted[:4])}"
                    f"{', ...' if len(drifted) > 4 else ''}): torch_dist keeps one copy", ck,
                    hint=f"repair them first with `ckpt sync-tp {ck.path}` (average or one rank's value)")
    from ..view import logical as L

    steps = {float(v["step"]) for v in L.optimizer_scalars(ck).values() if v.get("step") is not None}
    if len(steps) != 1:
        _refuse(f"Adam steps {sorted(steps)} across parameters: torch_dist keeps one common step", ck)
    return None, None


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
    cfg = _config(ck)
    a = _ds_args(ck)
    tp, pp, dp = _tp_pp(ck)
    groups, _ = _megatron_groups(ck)
    sched, _, _ = _schedule(ck, groups)
    o = dict((cfg.get("optimizer") or {}).get("params") or {})
    betas = o.get("betas") or groups[0].get("betas") or (0.9, 0.999)
    iteration = int(ck.counters.global_step or 0)
    gbs = int(cfg.get("train_batch_size") or a.get("global_batch_size"))
    mbs = int(cfg.get("train_micro_batch_size_per_gpu") or a.get("micro_batch_size"))
    train_iters = int(a.get("train_iters") or iteration)
    padded = arch["padded_vocab_size"]
    out = {
        **arch,
        "num_query_groups": arch["num_attention_heads"], "kv_channels": arch["hidden_size"] // arch["num_attention_heads"],
        "group_query_attention": False,
        # Megatron's NullTokenizer counts vocab_size + 1 (the end-of-document id): the saved rows, unpadded
        "vocab_size": padded - 1, "tokenizer_type": "NullTokenizer",
        "make_vocab_size_divisible_by": _vocab_multiple(padded, tp), "mock_data": True,
        "normalization": "LayerNorm", "swiglu": False, "untie_embeddings_and_output_weights": True,
        "position_embedding_type": "learned_absolute", "add_position_embedding": True, "add_bias_linear": True,
        "add_qkv_bias": True, "hidden_dropout": 0.0, "attention_dropout": 0.0, "transformer_impl": "local",
        "bf16": True, "fp16": False, "params_dtype": torch.bfloat16, "accumulate_allreduce_grads_in_fp32": True,
        "optimizer": "adam", "use_distributed_optimizer": False,
        "lr": sched["lr"], "min_lr": sched["min_lr"], "lr_decay_style": sched["style"],
        "lr_warmup_iters": sched["warmup"], "lr_warmup_init": sched["init"],
        "weight_decay": float(groups[0].get("weight_decay") or 0.0), "start_weight_decay": float(groups[0].get("weight_decay") or 0.0),
        "end_weight_decay": float(groups[0].get("weight_decay") or 0.0), "weight_decay_incr_style": "constant",
        "adam_beta1": float(betas[0]), "adam_beta2": float(betas[1]), "adam_eps": float(o.get("eps", groups[0].get("eps"))),
        "clip_grad": float(cfg.get("gradient_clipping") or 0.0),
        "micro_batch_size": mbs, "global_batch_size": gbs, "train_iters": train_iters,
        "seed": int(a.get("seed") or 1234),
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "data_parallel_size": dp,
        "world_size": tp * pp * dp, "ckpt_format": "torch_dist", "use_dist_ckpt": True, "no_save_rng": True,
        "iteration": iteration, "consumed_train_samples": iteration * gbs, "consumed_valid_samples": 0,
        "skipped_train_samples": 0,
    }
    return out


def scheduler_state(ck, args: dict[str, Any]) -> dict[str, Any]:
    """The OptimizerParamScheduler state Megatron builds from `args` at the source's iteration (num_steps in
    samples: iterations x global batch)."""
    gbs = args["global_batch_size"]
    return {"max_lr": args["lr"], "lr_warmup_steps": args["lr_warmup_iters"] * gbs,
            "num_steps": args["iteration"] * gbs, "lr_decay_style": args["lr_decay_style"],
            "lr_decay_steps": args["train_iters"] * gbs, "min_lr": args["min_lr"],
            "start_wd": args["weight_decay"], "end_wd": args["weight_decay"], "wd_incr_style": "constant",
            "wd_incr_steps": args["train_iters"] * gbs}


def plan_lines(ck, ckpt_format: str = "torch_dist", tp: int | None = None,
               pp: int | None = None) -> tuple[list[str], list[str]]:
    """(notes, not moved) for the conversion."""
    tp, pp, dp = _tp_pp(ck)
    arch = _architecture(ck)
    groups, _ = _megatron_groups(ck)
    _, snote, sgone = _schedule(ck, groups)
    notes = [f"Megatron-LM torch_dist (plain Adam) from a Megatron-DeepSpeed pipeline (TP {tp} x PP {pp} x DP {dp}): "
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
             snote]
    not_moved = ["RNG states: DeepSpeed's / the client's generators are not Megatron's (args.no_save_rng=True: "
                 "Megatron seeds afresh from args.seed)",
                 "data position: the DeepSpeed run's data loader is not Megatron's; consumed_train_samples = "
                 "iteration x global batch is recorded",
                 "num_floating_point_operations_so_far: DeepSpeed does not count it (written 0)",
                 "ds_config and universal_checkpoint_info: DeepSpeed's launch configuration and TP merge metadata "
                 "(used to read the source)"]
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
    """Write the run folder for `plan` (to="megatron" from a DeepSpeed pipeline source) into the empty staging
    folder `root`; returns the bytes written. One parameter's tensors in memory at a time."""
    import argparse

    import torch

    from ..view import logical as L
    from ..write.dcp_write import DcpStreamWriter
    from ..write.megatron_write import CONTENT_METADATA, DIST_META, LATEST, dist_key

    ck = L.open_any(plan.source)
    names = core_names(ck)
    args = megatron_args(ck)
    layers = args["num_layers"]
    iteration = args["iteration"]
    it = root / f"iter_{iteration:07d}"
    module = {t.name: t for t in L.model_tensors(ck, weights="module")}
    for p in plan.params:
        if p.kind != "param" or not p.states:
            raise UnsupportedCheckpoint(f"{p.name}: a {p.kind} tensor without Adam state: ckpt writes trained "
                                        "parameters only", path=plan.source)
    # {torch_dist key: [(layer or None, param)]} in Megatron's module order; the groups' keys in that order too
    keys: dict[str, list] = {}
    for p in sorted(plan.params, key=lambda p: _order(names[p.name])):
        key, layer = dist_key(names[p.name], layers)
        keys.setdefault(key, []).append((layer, p))
    _, members = _megatron_groups(ck)
    grouped = [k for g in members for k in keys if names[keys[k][0][1].name] in g]  # a key's layers: one group
    w = DcpStreamWriter(it, checkpoint_id=str(plan.out / it.name), shards=2)

    def put(key: str, layer: int | None, t) -> None:
        if layer is None:
            w.tensor_part((key,), tuple(t.shape), (0,) * t.dim(), t)
        else:
            w.tensor_part((key,), (layers, *t.shape), (layer,) + (0,) * t.dim(), t.unsqueeze(0))

    extra = {f"decoder.layers.{x}.bias": x for x in EXTRA_STATE_LINEARS}
    try:
        for key, items in keys.items():  # the module's weights (bf16), each linear's extra state after its bias
            for layer, p in items:
                put(key, layer, module[p.name].read())
            if key in extra:
                w.value((f"decoder.layers.{extra[key]}._extra_state/shard_0_{layers}",), [None])
            if key == "decoder.layers.mlp.linear_fc2.bias":  # the other layers' extra states, as Megatron lists them
                for i in range(1, layers):
                    for x in EXTRA_STATE_LINEARS:
                        w.value((f"decoder.layers.{x}._extra_state/shard_{i}_{layers}",), [None])
        for key in grouped:  # Adam's moments, param group after param group, then the fp32 master
            for k in ("exp_avg", "exp_avg_sq"):
                for layer, p in keys[key]:
                    put(f"optimizer.state.{k}.{key}", layer, p.states[k].read())
        for key in grouped:
            for layer, p in keys[key]:
                put(f"optimizer.state.fp32_param.{key}", layer, p.weight.read())
                if progress:
                    progress(p.nbytes)
    except BaseException:
        w.abort()
        raise
    w.close()
    groups, _ = _megatron_groups(ck)
    pgroups = []
    for g, wd_mult in zip(groups, (1.0, 0.0)):
        hp = {k: v for k, v in g.items() if k != "params"}
        pgroups.append({"is_expert_parallel": False, "default_config": True, "wd_mult": wd_mult, "lr_mult": 1.0,
                        "is_decoupled_lr": False, "max_lr": args["lr"], "min_lr": args["min_lr"], **hp})
    step = next(float(v["step"]) for v in L.optimizer_scalars(ck).values() if v.get("step") is not None)
    common = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration,
              "optimizer": {"optimizer": {"state": {"common_step": torch.tensor(step, dtype=torch.float32)},
                                          "param_groups": pgroups}},
              "opt_param_scheduler": scheduler_state(ck, args),
              "num_floating_point_operations_so_far": 0.0, "content_metadata": dict(CONTENT_METADATA)}
    torch.save(common, it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(DIST_META))
    (root / LATEST).write_text(str(iteration))
    return w.bytes_written + (it / "common.pt").stat().st_size


__all__ = ["handles", "core_names", "core_view", "check", "plan_lines", "write", "megatron_args", "added"]
