"""The tiny GPT's configuration and its parameters' names and shapes, without torch: `ckpt resume --model auto`
tells a checkpoint of the bundled model from any other in the `ckpt` process, which stays torch-free.
`train.models.TinyGPT` is the model itself (`tests/test_resume.py` checks that the two agree)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    hidden: int = 32
    n_layers: int = 2
    n_heads: int = 4
    ffn_mult: int = 4

    def to_dict(self) -> dict:
        return asdict(self)


def tiny_gpt_shapes(cfg: GPTConfig = GPTConfig()) -> dict[str, tuple[int, ...]]:
    """`{name: shape}` of `TinyGPT(cfg).named_parameters()`, in that order."""
    h, f = cfg.hidden, cfg.ffn_mult * cfg.hidden
    out: dict[str, tuple[int, ...]] = {"wte.weight": (cfg.vocab_size, h), "wpe.weight": (cfg.seq_len, h)}
    for i in range(cfg.n_layers):
        for name, (rows, cols) in (
            ("ln_1", (h, 0)),
            ("attn_qkv", (3 * h, h)),
            ("attn_proj", (h, h)),
            ("ln_2", (h, 0)),
            ("mlp_fc", (f, h)),
            ("mlp_proj", (h, f)),
        ):
            out[f"blocks.{i}.{name}.weight"] = (rows, cols) if cols else (rows,)
            out[f"blocks.{i}.{name}.bias"] = (rows,)
    out["ln_f.weight"] = out["ln_f.bias"] = (h,)
    out["lm_head.weight"] = (cfg.vocab_size, h)
    return out
