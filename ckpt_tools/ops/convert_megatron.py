"""The parts of `ckpt convert --to megatron` that read with other operations' rules: a torchtitan source's
`--hf-config` found (`ops.export`'s rule) and checked against the checkpoint with `ops.hf_map`'s torchtitan ->
Hugging Face map (`read_checked_config`, the reader `view.torchtitan.source_view` is given), and a DeepSpeed source's
TP replicas compared (`tp_drift`, `ops.tp_sync`'s check) for `write.megatron_from_view.check`.
"""

from __future__ import annotations

from typing import Any

from ..read.tree import iter_tensors
from ..view import torchtitan
from ..view.torchtitan import read_config, refuse, rope
from .export import _hf_config_file
from .hf_map import LLAMA3_ROPE as _ROPE_FIXED, torchtitan_llama_to_hf
from .tp_sync import check_tp_sync


def read_checked_config(ck, hf_config: str) -> tuple[dict[str, Any], str]:
    """(the config.json `--hf-config` names: the file or its folder, its path), refused, naming it, where it does
    not describe this torchtitan Llama as Megatron-core builds one (`check_titan_config`)."""
    cfg, where = read_config(ck, _hf_config_file(hf_config))
    check_titan_config(ck, cfg, where)
    return cfg, where


def source_view(ck, *args: Any, **kwargs: Any):
    """`view.torchtitan.source_view` (same arguments) with the `--hf-config` found and checked
    (`read_checked_config`)."""
    return torchtitan.source_view(ck, *args, **kwargs, read=read_checked_config)


def tp_drift(ck) -> list[str]:
    """The TP-replicated parameters of `ck` that differ across its TP ranks (`ops.tp_sync.check_tp_sync`)."""
    return [p.name for p in check_tp_sync(ck).params if not p.in_sync]


def check_titan_config(ck, cfg: dict[str, Any], where: str) -> None:
    """Refuse, naming it, a config.json that does not describe this torchtitan Llama as Megatron-core builds one."""
    shapes = {n: tuple(t.shape) for n, t in iter_tensors(ck.tree.children["model"])}
    if not isinstance(cfg.get("head_dim"), int):  # without it any head count whose product fits passes the shapes
        refuse(
            f"{where} has no integer head_dim: the head counts, which order the q / k rows, cannot be checked "
            "against the saved shapes (hidden_size / num_attention_heads would be assumed)",
            ck,
            hint='add "head_dim": N (the model\'s head dimension) to the config.json',
        )
    torchtitan_llama_to_hf(shapes, cfg, where)  # every name mapped; q / k / embedding shapes and layer count
    ffn = next(s[0] for n, s in shapes.items() if n.endswith("feed_forward.w1.weight"))
    theta, scaling = rope(cfg)
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
        refuse(
            f"{where} does not describe a torchtitan Llama Megatron-core can build: {'; '.join(bad)}",
            ck,
            hint="pass this model's Hugging Face config.json (LlamaConfig)",
        )
