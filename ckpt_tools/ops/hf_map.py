"""Parameter names of a training framework's model -> the Hugging Face transformers names `export --hf` writes.

torchtitan's Llama (llama3 flavours, measured with torchtitan 0.3.0): the names and the q/k permutation are the ones
torchtitan's own `Llama3StateDictAdapter.to_hf` applies (tests compare with it tensor for tensor). The permutation
turns torchtitan's interleaved (complex) RoPE pairs into Hugging Face's rotate-half layout and needs the head counts,
which a torchtitan checkpoint does not hold: they come from the model's Hugging Face `config.json`
(`num_attention_heads`, `num_key_value_heads`, `head_dim`), checked against every tensor's shape.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

from ..errors import CkptError

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


def is_torchtitan_llama(names: list[str]) -> bool:
    """torchtitan's Llama parameter names: `tok_embeddings.weight` and `layers.N.attention.…wq.weight`."""
    return "tok_embeddings.weight" in names and any(re.search(r"^layers\.\d+\.attention\.(qkv_linear\.)?wq\.weight$",
                                                              n) for n in names)


def rope_permute(n_heads: int) -> Transform:
    """Hugging Face's q/k permutation for `n_heads` heads: each head's interleaved (x0, y0, x1, y1, …) rows become
    (x0, x1, …, y0, y1, …)."""
    def apply(w):
        rows, cols = w.shape
        return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()

    return apply


def torchtitan_llama_to_hf(shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any],
                           config_path: str) -> dict[str, tuple[str, Transform | None]]:
    """{torchtitan name: (Hugging Face name, transform or None)} for every tensor, or CkptError naming the tensor
    the map does not cover or the config value a shape contradicts."""
    def need(key: str) -> int:
        v = config.get(key)
        if not isinstance(v, int):
            raise CkptError(f"{config_path} has no integer {key!r}: the q/k permutation needs it", path=config_path,
                            hint="pass the model's Hugging Face config.json (LlamaConfig)")
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
            raise CkptError(f"{name}: not a torchtitan Llama parameter this export maps to Hugging Face names",
                            hint="export without --hf (the names as saved)")
        m, hf = hit
        if m.groups():
            layers.add(int(m[1]))
            hf = hf.format(m[1])
        transform = None
        if hf.endswith("q_proj.weight"):
            _check(name, shape, (n_heads * head_dim, hidden), "num_attention_heads x head_dim, hidden_size",
                   config_path)
            transform = rope_permute(n_heads)
        elif hf.endswith("k_proj.weight"):
            _check(name, shape, (n_kv * head_dim, hidden), "num_key_value_heads x head_dim, hidden_size",
                   config_path)
            transform = rope_permute(n_kv)
        elif hf == "model.embed_tokens.weight":
            _check(name, shape, (need("vocab_size"), hidden), "vocab_size, hidden_size", config_path)
        out[name] = (hf, transform)
    if len(layers) != need("num_hidden_layers"):
        raise CkptError(f"the checkpoint has {len(layers)} layers, {config_path} says num_hidden_layers="
                        f"{config['num_hidden_layers']}", path=config_path, hint="pass this model's config.json")
    return out


def _check(name: str, shape: tuple[int, ...], want: tuple[int, ...], what: str, config_path: str) -> None:
    if tuple(shape) != tuple(want):
        raise CkptError(f"{name} has shape {list(shape)}, but {config_path} gives [{what}] = {list(want)}",
                        path=config_path, hint="pass this model's config.json")
