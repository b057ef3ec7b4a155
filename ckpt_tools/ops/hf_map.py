"""Parameter names of a training framework's model -> the Hugging Face transformers names `export --hf` writes.

torchtitan's Llama (llama3 flavours, measured with torchtitan 0.3.0): the names and the q/k permutation are the ones
torchtitan's own `Llama3StateDictAdapter.to_hf` applies (tests compare with it tensor for tensor). The permutation
turns torchtitan's interleaved (complex) RoPE pairs into Hugging Face's rotate-half layout and needs the head counts,
which a torchtitan checkpoint does not hold: they come from the model's Hugging Face `config.json`
(`num_attention_heads`, `num_key_value_heads`, `head_dim`), checked against every tensor's shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..errors import CkptError
from ..read import qkv
from ..read.qkv import rope_halves

#: torchtitan Llama name (regex; the fused attention's split keys `attention.qkv_linear.w?` or the plain
#: `attention.w?`) -> Hugging Face Llama name
_TITAN_LLAMA = (
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wq\.weight", "model.layers.{}.self_attn.q_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wk\.weight", "model.layers.{}.self_attn.k_proj.weight"),
    (r"layers\.(\d+)\.attention\.(?:qkv_linear\.)?wv\.weight", "model.layers.{}.self_attn.v_proj.weight"),
    (r"layers\.(\d+)\.attention\.wo\.weight", "model.layers.{}.self_attn.o_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w1\.weight", "model.layers.{}.mlp.gate_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w2\.weight", "model.layers.{}.mlp.down_proj.weight"),
    (r"layers\.(\d+)\.feed_forward\.w3\.weight", "model.layers.{}.mlp.up_proj.weight"),
    (r"layers\.(\d+)\.attention_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"(?:lm_head|output)\.weight", "lm_head.weight"),
)
_COMPILED = tuple((re.compile(p + r"$"), hf) for p, hf in _TITAN_LLAMA)

Transform = Callable[[Any], Any]


def rope_permute(n_heads: int) -> Transform:
    """Hugging Face's q/k permutation for `n_heads` heads: each head's interleaved (x0, y0, x1, y1, …) rows become
    (x0, x1, …, y0, y1, …)."""
    return lambda w: rope_halves(w, n_heads)


def torchtitan_llama_to_hf(
    shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], config_path: str
) -> dict[str, tuple[str, Transform | None]]:
    """{torchtitan name: (Hugging Face name, transform or None)} for every tensor, or CkptError naming the tensor
    the map does not cover or the config value a shape contradicts."""

    def need(key: str) -> int:
        v = config.get(key)
        if not isinstance(v, int):
            raise CkptError(
                f"{config_path} has no integer {key!r}: the q/k permutation needs it",
                path=config_path,
                hint="pass the model's Hugging Face config.json (LlamaConfig)",
            )
        return v

    n_heads = need("num_attention_heads")
    n_kv = config.get("num_key_value_heads") or n_heads
    hidden = need("hidden_size")
    head_dim = config.get("head_dim") or hidden // n_heads
    out: dict[str, tuple[str, Transform | None]] = {}
    layers: set[int] = set()
    for name, shape in shapes.items():
        hit = next(((m, hf) for rx, hf in _COMPILED for m in [rx.match(name)] if m), None)
        if hit is None:
            raise CkptError(
                f"{name}: not a torchtitan Llama parameter this export maps to Hugging Face names",
                hint="export without --hf (the names as saved)",
            )
        m, hf = hit
        if m.groups():
            layers.add(int(m[1]))
            hf = hf.format(m[1])
        transform = None
        if hf.endswith("q_proj.weight"):
            _check(
                name, shape, (n_heads * head_dim, hidden), "num_attention_heads x head_dim, hidden_size", config_path
            )
            transform = rope_permute(n_heads)
        elif hf.endswith("k_proj.weight"):
            _check(name, shape, (n_kv * head_dim, hidden), "num_key_value_heads x head_dim, hidden_size", config_path)
            transform = rope_permute(n_kv)
        elif hf == "model.embed_tokens.weight":
            _check(name, shape, (need("vocab_size"), hidden), "vocab_size, hidden_size", config_path)
        out[name] = (hf, transform)
    if len(layers) != need("num_hidden_layers"):
        raise CkptError(
            f"the checkpoint has {len(layers)} layers, {config_path} says num_hidden_layers="
            f"{config['num_hidden_layers']}",
            path=config_path,
            hint="pass this model's config.json",
        )
    return out


def _check(name: str, shape: tuple[int, ...], want: tuple[int, ...], what: str, config_path: str) -> None:
    if tuple(shape) != tuple(want):
        raise CkptError(
            f"{name} has shape {list(shape)}, but {config_path} gives [{what}] = {list(want)}",
            path=config_path,
            hint="pass this model's config.json",
        )


# --- Megatron-LM GPT (megatron-core names) -> Hugging Face GPT-2 or Llama ------------------------------------------
#
# The architecture comes from the checkpoint's own `args`: learned absolute positions + LayerNorm + GeLU + biases +
# multi-head attention + tied output is GPT-2 (GPT2LMHeadModel); rotary positions + RMSNorm + SwiGLU without biases
# (grouped-query attention and an untied output allowed) is Llama (LlamaForCausalLM). Anything else is refused by
# name. Megatron's fused QKV groups its rows per query group ([q heads of the group, k, v], head_dim rows each: the
# layout `qkv.row_index` describes); its SwiGLU `linear_fc1` is [gate; up] (the TP shards merged per sub-parameter
# by the reader); megatron-core's rotary embedding is the rotate-half layout Hugging Face's Llama uses (refused when
# `rotary_interleaved`), so q/k need no permutation.

#: name pattern (megatron-core; the TransformerEngine spec keeps the norms in the next linear) -> role
_MEGATRON_ROLES = (
    (r"embedding\.word_embeddings\.weight", "embed"),
    (r"embedding\.position_embeddings\.weight", "positions"),
    (r"decoder\.layers\.(\d+)\.(?:input_layernorm\.|self_attention\.linear_qkv\.layer_norm_)(weight|bias)", "ln_1"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_qkv\.(weight|bias)", "qkv"),
    (r"decoder\.layers\.(\d+)\.self_attention\.linear_proj\.(weight|bias)", "proj"),
    (r"decoder\.layers\.(\d+)\.(?:pre_mlp_layernorm\.|mlp\.linear_fc1\.layer_norm_)(weight|bias)", "ln_2"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc1\.(weight|bias)", "fc1"),
    (r"decoder\.layers\.(\d+)\.mlp\.linear_fc2\.(weight|bias)", "fc2"),
    (r"decoder\.final_layernorm\.(weight|bias)", "ln_f"),
    (r"output_layer\.weight", "output"),
    # Mixture-of-Experts layers (SequentialMLP: every expert its own linears, under its global id in the view)
    (r"decoder\.layers\.(\d+)\.mlp\.router\.(weight)", "router"),
    (r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc1\.(weight)", "expert_fc1"),
    (r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc2\.(weight)", "expert_fc2"),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc1\.(weight)", "shared_fc1"),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.linear_fc2\.(weight)", "shared_fc2"),
    (r"decoder\.layers\.(\d+)\.mlp\.shared_experts\.gate_(weight)", "shared_gate"),
)
_MEGATRON_COMPILED = tuple((re.compile(p + r"$"), role) for p, role in _MEGATRON_ROLES)

#: MoE role -> (Mixtral name, Qwen2-MoE name) templates ({L}: layer, {E}: global expert id; fc1's [gate; up] halves
#: as (gate, up) pairs)
_MOE_NAMES = {
    "router": ("block_sparse_moe.gate.weight", "mlp.gate.weight"),
    "expert_fc1": (
        ("block_sparse_moe.experts.{E}.w1.weight", "block_sparse_moe.experts.{E}.w3.weight"),
        ("mlp.experts.{E}.gate_proj.weight", "mlp.experts.{E}.up_proj.weight"),
    ),
    "expert_fc2": ("block_sparse_moe.experts.{E}.w2.weight", "mlp.experts.{E}.down_proj.weight"),
    "shared_fc1": (None, ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
    "shared_fc2": (None, "mlp.shared_expert.down_proj.weight"),
    "shared_gate": (None, "mlp.shared_expert_gate.weight"),
}

#: role -> GPT-2 name template ({L}: layer, {k}: weight/bias) and whether it is a Linear weight (Conv1D: transposed)
_GPT2 = {
    "embed": ("transformer.wte.weight", False),
    "positions": ("transformer.wpe.weight", False),
    "ln_1": ("transformer.h.{L}.ln_1.{k}", False),
    "qkv": ("transformer.h.{L}.attn.c_attn.{k}", True),
    "proj": ("transformer.h.{L}.attn.c_proj.{k}", True),
    "ln_2": ("transformer.h.{L}.ln_2.{k}", False),
    "fc1": ("transformer.h.{L}.mlp.c_fc.{k}", True),
    "fc2": ("transformer.h.{L}.mlp.c_proj.{k}", True),
    "ln_f": ("transformer.ln_f.{k}", False),
}
_LLAMA = {
    "embed": "model.embed_tokens.weight",
    "ln_1": "model.layers.{L}.input_layernorm.{k}",
    "proj": "model.layers.{L}.self_attn.o_proj.{k}",
    "ln_2": "model.layers.{L}.post_attention_layernorm.{k}",
    "fc2": "model.layers.{L}.mlp.down_proj.{k}",
    "ln_f": "model.norm.{k}",
    "output": "lm_head.weight",
}

Out = tuple  # (Hugging Face name, transform or None, shape written)


#: megatron-core's llama3 RoPE scaling (`RotaryEmbedding._apply_scaling`, core_v0.16): only the factor is a flag
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def is_megatron_gpt(names: list[str]) -> bool:
    """Megatron-core GPT parameter names: `embedding.word_embeddings.weight` and `decoder.layers.N.…linear_qkv…`."""
    return "embedding.word_embeddings.weight" in names and any(
        re.search(r"^decoder\.layers\.\d+\.self_attention\.linear_qkv\.weight$", n) for n in names
    )


def megatron_hf_config(args: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The Hugging Face config.json of a Megatron GPT from its launch `args`: GPT2Config or LlamaConfig (see
    above); CkptError naming what neither holds."""

    def arg(*keys: str) -> Any:
        return next((args[k] for k in keys if args.get(k) is not None), None)

    missing = [
        k
        for k in ("hidden_size", "num_attention_heads", "num_layers", "padded_vocab_size", "max_position_embeddings")
        if not isinstance(args.get(k), int)
    ]
    if missing:
        raise CkptError(
            f"the checkpoint's args lack {', '.join(missing)}: the Hugging Face config needs them",
            path=where,
            hint="export without --hf",
        )
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    groups = arg("num_query_groups") if arg("group_query_attention") else heads
    head_dim = arg("kv_channels") or hidden // heads
    pos, norm = arg("position_embedding_type") or "learned_absolute", arg("normalization") or "LayerNorm"
    common = [
        (bool(arg("qk_layernorm")), "QK layer norm"),
        (bool(arg("multi_latent_attention")), "multi-latent attention"),
        (bool(arg("squared_relu")), "squared ReLU"),
        (bool(arg("apply_residual_connection_post_layernorm")), "residuals after the layer norm"),
    ]
    llama = pos == "rope" or norm == "RMSNorm" or bool(arg("swiglu"))
    if llama:
        bad = common + [
            (pos != "rope", f"position embeddings {pos!r} (Llama: rope)"),
            (norm != "RMSNorm", f"{norm} (Llama: RMSNorm)"),
            (not arg("swiglu"), "no SwiGLU (Llama: SwiGLU)"),
            (arg("add_bias_linear") is not False, "linear biases"),
            (bool(arg("add_qkv_bias")) and arg("add_bias_linear") is False, "a QKV bias"),
            (bool(arg("rotary_interleaved")), "interleaved rotary pairs"),
            ((arg("rotary_percent") or 1.0) != 1.0, f"rotary_percent {arg('rotary_percent')}"),
        ]
    else:
        bad = common + [
            (bool(arg("num_experts")), "Mixture-of-Experts layers (the MoE classes are Llama-shaped)"),
            (bool(arg("openai_gelu")), "openai_gelu"),
            (bool(arg("untie_embeddings_and_output_weights")), "an untied output layer (GPT-2 ties it)"),
            (arg("add_bias_linear") is False, "linear layers without biases (GPT-2 has them)"),
            (arg("add_qkv_bias") is False, "a QKV projection without bias"),
            (groups != heads, f"grouped-query attention ({groups} groups; GPT-2 has none)"),
            (head_dim != hidden // heads, f"kv_channels {head_dim} != hidden_size / num_attention_heads"),
        ]
    named = [what for hit, what in bad if hit]
    if named:
        target = "Llama (rope, RMSNorm, SwiGLU, no biases)" if llama else "GPT-2 (learned positions, LayerNorm, GeLU)"
        raise CkptError(
            f"--hf maps a Megatron GPT to {target}; this one has {', '.join(named)}",
            path=where,
            hint="export without --hf (the merged weights under Megatron's names)",
        )
    eps = float(arg("norm_epsilon", "layernorm_epsilon") or 1e-5)
    special = {"bos_token_id": None, "eos_token_id": None}  # the tokenizer's ids are not in the checkpoint
    if llama and arg("num_experts"):
        return megatron_moe_config(args, _llama_config(args, arg, groups, head_dim, eps, special), where)
    if llama:
        return _llama_config(args, arg, groups, head_dim, eps, special)
    return _gpt2_config(args, arg, eps, special)


def _llama_config(args, arg, groups: int, head_dim: int, eps: float, special: dict) -> dict[str, Any]:
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args["padded_vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": arg("ffn_hidden_size") or 4 * hidden,
        "num_hidden_layers": args["num_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args["max_position_embeddings"],
        "rms_norm_eps": eps,
        "rope_theta": float(arg("rotary_base") or 10000),
        **(
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": float(arg("rope_scaling_factor") or 8.0),
                    **LLAMA3_ROPE,
                }
            }
            if arg("use_rope_scaling")
            else {}
        ),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": not arg("untie_embeddings_and_output_weights"),
        "initializer_range": float(arg("init_method_std") or 0.02),
        "use_cache": True,
        **special,
    }


def _gpt2_config(args, arg, eps: float, special: dict) -> dict[str, Any]:
    hidden, heads = args["hidden_size"], args["num_attention_heads"]
    # megatron-core's MLP: with bias_gelu_fusion the fused bias-GeLU (tanh approximation), else F.gelu (erf)
    act = "gelu_new" if arg("bias_gelu_fusion", "bias_activation_fusion") else "gelu"
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": args["padded_vocab_size"],
        "n_positions": args["max_position_embeddings"],
        "n_embd": hidden,
        "n_layer": args["num_layers"],
        "n_head": heads,
        "n_inner": arg("ffn_hidden_size") or 4 * hidden,
        "activation_function": act,
        "layer_norm_epsilon": eps,
        "resid_pdrop": float(arg("hidden_dropout") or 0.0),
        "embd_pdrop": float(arg("hidden_dropout") or 0.0),
        "attn_pdrop": float(arg("attention_dropout") or 0.0),
        "initializer_range": float(arg("init_method_std") or 0.02),
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        **special,
    }


#: Megatron's MoE settings whose forward neither Mixtral's nor Qwen2-MoE's block computes: (arg, is it set, the flag)
_MOE_UNMAPPED = (
    ("moe_router_score_function", lambda v: v not in (None, "softmax"), "--moe-router-score-function"),
    (
        "moe_router_load_balancing_type",
        lambda v: "sinkhorn" in _as_list(v),
        "--moe-router-load-balancing-type sinkhorn",
    ),
    ("moe_router_topk_scaling_factor", lambda v: v not in (None, 1, 1.0), "--moe-router-topk-scaling-factor"),
    ("moe_router_num_groups", bool, "--moe-router-num-groups (group-limited routing)"),
    ("moe_router_group_topk", bool, "--moe-router-group-topk"),
    ("moe_router_topk_limited_devices", bool, "--moe-router-topk-limited-devices"),
    ("moe_router_enable_expert_bias", bool, "--moe-router-enable-expert-bias"),
    ("moe_router_force_load_balancing", bool, "--moe-router-force-load-balancing"),
    ("moe_expert_capacity_factor", lambda v: v is not None, "--moe-expert-capacity-factor (token dropping)"),
    ("moe_input_jitter_eps", lambda v: v is not None, "--moe-input-jitter-eps (applied at inference too)"),
    ("moe_apply_probs_on_input", bool, "--moe-apply-probs-on-input"),
    ("moe_latent_size", bool, "--moe-latent-size"),
    (
        "moe_layer_freq",
        lambda v: any(x != 1 for x in _as_list(v)),
        "dense layers between MoE layers (--moe-layer-freq)",
    ),
)


def _as_list(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else [] if v is None else [v]


def megatron_moe_config(args: Mapping[str, Any], llama: dict[str, Any], where: str) -> dict[str, Any]:
    """The Hugging Face MoE config of a Llama-shaped Megatron MoE GPT (`llama`: its dense LlamaConfig): Mixtral
    (MixtralForCausalLM) for routed experts only, Qwen2-MoE (Qwen2MoeForCausalLM) with a gated shared expert.

    The routing is the same maths: Megatron's softmax router without `--moe-router-pre-softmax` takes the top-k
    logits and softmaxes them, which equals Mixtral's (and Qwen2-MoE's `norm_topk_prob`) softmax over all experts
    renormalised over the top k; with it the top-k of the softmax over all experts, unnormalised: Qwen2-MoE with
    `norm_topk_prob` false (Mixtral has no such setting). Megatron's shared expert gate is
    `sigmoid(x @ gate_weight.T) * shared_expert(x)`, Qwen2-MoE's `shared_expert_gate`. Anything else that changes
    the forward (`_MOE_UNMAPPED`, a shared expert without a gate) is a CkptError naming the flag."""
    named = [flag for key, hit, flag in _MOE_UNMAPPED if args.get(key) is not None and hit(args.get(key))]
    shared = args.get("moe_shared_expert_intermediate_size")
    pre_softmax = bool(args.get("moe_router_pre_softmax"))
    if shared and not args.get("moe_shared_expert_gate"):
        named.append("a shared expert without --moe-shared-expert-gate (Qwen2-MoE gates it by a sigmoid)")
    if pre_softmax and not shared:
        named.append("--moe-router-pre-softmax without a shared expert (Mixtral renormalises the top-k weights)")
    if named:
        raise CkptError(
            f"--hf maps a Megatron MoE GPT to Mixtral or Qwen2-MoE; this one has {', '.join(named)}",
            path=where,
            hint="export without --hf (the merged weights, every expert under its global id, Megatron's names)",
        )
    experts, topk = int(args["num_experts"]), int(args.get("moe_router_topk") or 2)
    ffn = int(args.get("moe_ffn_hidden_size") or llama["intermediate_size"])
    base = {k: v for k, v in llama.items() if k not in ("architectures", "model_type", "attention_bias", "mlp_bias")}
    if not shared:
        return {
            **base,
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "intermediate_size": ffn,
            "num_local_experts": experts,
            "num_experts_per_tok": topk,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
        }
    return {
        **base,
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "moe_intermediate_size": ffn,
        "shared_expert_intermediate_size": int(shared),
        "num_experts": experts,
        "num_experts_per_tok": topk,
        "norm_topk_prob": not pre_softmax,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "qkv_bias": False,
        "use_sliding_window": False,
    }


def _rows(idx: list[int], transpose: bool = False) -> Transform:
    def apply(t):
        import torch  # lazy: torch only when a tensor is exported; the name map is torch-free

        t = t.index_select(0, torch.tensor(idx))
        return t.t().contiguous() if transpose else t

    return apply


def _transposed(t):
    return t.t().contiguous()


def megatron_to_hf(
    shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any], where: str
) -> dict[str, list[Out]]:
    """{Megatron name: [(Hugging Face name, transform or None, shape written), ...]} for the config
    `megatron_hf_config` wrote (one entry per tensor; Llama's fused QKV and SwiGLU fc1 give three and two). CkptError
    naming a tensor the map does not cover or whose shape the config contradicts."""
    moe = config["model_type"] in ("mixtral", "qwen2_moe")
    llama = config["model_type"] == "llama" or moe
    if llama:
        hidden, heads, groups = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
        head_dim, layers, ffn = config["head_dim"], config["num_hidden_layers"], config["intermediate_size"]
    else:
        hidden, heads, layers = config["n_embd"], config["n_head"], config["n_layer"]
        groups, head_dim, ffn = heads, hidden // heads, config["n_inner"]
    dims = _Dims(hidden, heads, groups, head_dim, ffn, qkv.row_index(heads * head_dim, groups * head_dim, groups))
    out: dict[str, list[Out]] = {}
    seen: set[int] = set()
    moe_found: dict[str, set[tuple[int, ...]]] = {}  # MoE role -> the (layer[, expert]) it was found for
    for name, shape in shapes.items():
        shape = tuple(shape)
        hit = next(((m, role) for rx, role in _MEGATRON_COMPILED for m in [rx.match(name)] if m), None)
        if hit is None or (not llama and hit[1] == "output"):
            raise CkptError(
                f"{name}: not a Megatron GPT parameter this export maps to {config['model_type']} names",
                path=where,
                hint="export without --hf (the names as saved)",
            )
        m, role = hit
        if role in _MOE_NAMES or (moe and role in ("fc1", "fc2")):
            if not moe or role in ("fc1", "fc2"):
                what = "a dense MLP in a MoE model" if moe else "an MoE tensor in a dense model"
                raise CkptError(f"{name}: {what}", path=where, hint="export without --hf")
            seen.add(int(m[1]))
            moe_found.setdefault(role, set()).add(tuple(int(x) for x in m.groups()[:-1]))
            out[name] = _moe_entries(name, role, m.groups(), shape, config, where)
            continue
        g = m.groups()
        layer, kind = (g[0], g[1]) if len(g) == 2 else (None, g[0] if g else "weight")
        if layer is not None:
            seen.add(int(layer))
        out[name] = _dense_entries(name, role, layer, kind, shape, dims, llama, where)
    if len(seen) != layers:
        raise CkptError(
            f"the checkpoint has {len(seen)} layers, its args say num_layers={layers}",
            path=where,
            hint="export without --hf",
        )
    if moe:
        _check_every_expert(moe_found, config, layers, where)
    return out


@dataclass(frozen=True)
class _Dims:
    """The sizes a dense Megatron tensor's shape is checked against, and the fused QKV's (q, k, v) row indices."""

    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    qkv_rows: tuple[list[int], list[int], list[int]]


def _dense_entries(
    name: str, role: str, layer: str | None, kind: str, shape: tuple[int, ...], dims: _Dims, llama: bool, where: str
) -> list[Out]:
    """The Llama or GPT-2 tensors of one dense Megatron tensor (its shape checked): the fused QKV split into q, k,
    v (Llama) or reordered (GPT-2), SwiGLU's fc1 into gate and up (Llama), GPT-2's linear weights transposed."""
    hidden, heads, groups, head_dim, ffn = dims.hidden, dims.heads, dims.groups, dims.head_dim, dims.ffn
    q, k, v = dims.qkv_rows
    fill = {"L": layer, "k": kind}
    if role == "qkv":
        _check(
            name,
            shape,
            ((heads + 2 * groups) * head_dim, hidden)[: len(shape)],
            "(heads + 2 x query groups) x head_dim, hidden",
            where,
        )
    if role == "fc1":
        _check(name, shape, ((2 if llama else 1) * ffn, hidden)[: len(shape)], "FFN rows, hidden", where)
    if llama:
        if role == "qkv":
            return [
                (f"model.layers.{layer}.self_attn.{p}_proj.{kind}", _rows(idx), (len(idx), *shape[1:]))
                for p, idx in (("q", q), ("k", k), ("v", v))
            ]
        if role == "fc1":
            return [
                (f"model.layers.{layer}.mlp.{p}_proj.{kind}", _rows(list(idx)), (ffn, *shape[1:]))
                for p, idx in (("gate", range(ffn)), ("up", range(ffn, 2 * ffn)))
            ]
        if role in _LLAMA:
            return [(_LLAMA[role].format(**fill), None, shape)]
        raise CkptError(f"{name}: a Llama has no {role} tensor", path=where, hint="export without --hf")
    hf, linear = _GPT2[role]
    hf = hf.format(**fill)
    flip = linear and len(shape) == 2
    if role == "qkv":
        return [(hf, _rows([*q, *k, *v], transpose=flip), shape[::-1] if flip else shape)]
    return [(hf, _transposed if flip else None, shape[::-1] if flip else shape)]


def _moe_entries(name: str, role: str, groups: tuple, shape: tuple[int, ...], config, where: str) -> list[Out]:
    """The Mixtral / Qwen2-MoE tensors of one Megatron MoE tensor (its shape checked against the config): the
    router as the gate, an expert's (or the shared expert's) SwiGLU fc1 [gate; up] as two, fc2 as the down one."""
    qwen = config["model_type"] == "qwen2_moe"
    hidden = config["hidden_size"]
    layer, expert = groups[0], groups[1] if len(groups) == 3 else None
    n_experts = config["num_experts" if qwen else "num_local_experts"]
    ffn = config["moe_intermediate_size" if qwen else "intermediate_size"]
    shared = config.get("shared_expert_intermediate_size", 0)
    want = {
        "router": ((n_experts, hidden), "num_experts, hidden"),
        "expert_fc1": ((2 * ffn, hidden), "2 x moe_ffn_hidden_size (SwiGLU gate; up), hidden"),
        "expert_fc2": ((hidden, ffn), "hidden, moe_ffn_hidden_size"),
        "shared_fc1": ((2 * shared, hidden), "2 x moe_shared_expert_intermediate_size, hidden"),
        "shared_fc2": ((hidden, shared), "hidden, moe_shared_expert_intermediate_size"),
        "shared_gate": ((1, hidden), "1, hidden"),
    }[role]
    _check(name, shape, *want, where)
    template = _MOE_NAMES[role][1 if qwen else 0]
    if template is None:
        raise CkptError(f"{name}: Mixtral has no shared expert", path=where, hint="export without --hf")
    if isinstance(template, str):
        return [(f"model.layers.{layer}." + template.format(E=expert), None, shape)]
    half = shape[0] // 2
    return [
        (f"model.layers.{layer}." + t.format(E=expert), _rows(list(idx)), (half, *shape[1:]))
        for t, idx in zip(template, (range(half), range(half, 2 * half)), strict=True)
    ]


def _check_every_expert(found: dict[str, set[tuple[int, ...]]], config, layers: int, where: str) -> None:
    """Every layer holds the router and every expert id 0 .. num_experts-1 (fc1 and fc2), and with Qwen2-MoE the
    shared expert and its gate: an export without one of them would load with it left at random init."""
    qwen = config["model_type"] == "qwen2_moe"
    n = config["num_experts" if qwen else "num_local_experts"]
    want = {
        "router": {(L,) for L in range(layers)},
        "expert_fc1": {(L, e) for L in range(layers) for e in range(n)},
        "expert_fc2": {(L, e) for L in range(layers) for e in range(n)},
    }
    if qwen:
        want.update({r: {(L,) for L in range(layers)} for r in ("shared_fc1", "shared_fc2", "shared_gate")})
    for role, keys in want.items():
        missing = sorted(keys - found.get(role, set()))
        extra = sorted(found.get(role, set()) - keys)
        if missing or extra:
            raise CkptError(
                f"MoE {role}: {len(missing)} (layer[, expert]) missing {missing[:4]}, {len(extra)} beyond the args "
                f"{extra[:4]} (num_layers={layers}, num_experts={n})",
                path=where,
                hint="export without --hf",
            )
