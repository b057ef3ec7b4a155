"""The tiny GPT used by the non-pipeline samples and by `ckpt resume`.

Small enough that a checkpoint is a few hundred KB, real enough to have what large runs have:
embeddings, layer norms, attention and MLP linears with biases, a separate LM head.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gpt_config import GPTConfig


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden
        self.n_heads = cfg.n_heads
        self.ln_1 = nn.LayerNorm(h)
        self.attn_qkv = nn.Linear(h, 3 * h)
        self.attn_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.mlp_fc = nn.Linear(h, cfg.ffn_mult * h)
        self.mlp_proj = nn.Linear(cfg.ffn_mult * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.attn_qkv(self.ln_1(x)).split(h, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, h // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(a.transpose(1, 2).reshape(b, t, h))
        return x + self.mlp_proj(F.gelu(self.mlp_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """Parameter names: `wte.weight`, `wpe.weight`, `blocks.N.{ln_1,attn_qkv,attn_proj,ln_2,mlp_fc,mlp_proj}.*`,
    `ln_f.*`, `lm_head.weight`. `forward(tokens)` returns logits; `loss(tokens)` the next-token loss."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.lm_head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(exact number of elements, number of parameter tensors), shared tensors counted once."""
    seen: set[int] = set()
    count = tensors = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        count += p.numel()
        tensors += 1
    return count, tensors
