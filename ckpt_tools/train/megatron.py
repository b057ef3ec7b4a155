"""A tiny Megatron-style GPT with real tensor parallelism, built as a DeepSpeed `PipelineModule`.

It exists so that the Megatron-DeepSpeed samples are what such runs really write: one
`layer_LL-model_TT-model_states.pt` file per pipeline layer and TP rank, holding Megatron's local
parameter names (`input_layernorm.weight`, `self_attention.query_key_value.weight`, ...), where the
TP-split tensors differ per TP rank and the TP-replicated ones (layer norms, row-parallel biases,
position embeddings) must stay identical. Nothing is copied from Megatron: the layers are small
re-implementations of the same maths and the same parameter layout.

Pipeline layer specs (the LL in the file names; functions have no parameters and get no file), the
same order as Megatron-DeepSpeed's `GPTModelPipe` with untied embeddings:

    0  _with_position_ids      tokens -> (tokens, position ids)
    1  EmbeddingPipe           word_embeddings.weight (vocab-split, dim 0), position_embeddings.weight
    2-5 ParallelTransformerLayerPipe (one per transformer layer)
    6  torch LayerNorm         the final layer norm: bare weight / bias
    7  LMHeadPipe              lm_head.weight (vocab-split, dim 0)

Activations travel between layers (and pipeline stages) as [seq, batch, hidden], as in Megatron.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

# Megatron seeds its model-parallel RNG with `seed + 2718 + tp_rank`, so that every TP rank draws its own
# values for its slice of each split weight; the replicated weights come from a TP-shared seed.
TP_SEED_OFFSET = 2718
INIT_STD = 0.02


@dataclass(frozen=True)
class MegatronGPTConfig:
    vocab_size: int = 64
    seq_len: int = 16
    hidden: int = 16  # small enough that a whole TP=2 x PP=2 sample with optimizer state is ~300 KB
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int = 64
    layernorm_eps: float = 1e-5

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TensorParallel:
    """This rank's place in the TP group.

    `group` is filled in once the `PipelineModule` has built its grid, because the layers are constructed
    inside the `PipelineModule` constructor but only communicate in forward/backward.
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = None


# --- communication with the autograd rules of Megatron's mappings ---------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce backward: the input of a column-parallel linear is replicated, and
    each TP rank only sees the gradient through its own output columns, so the pieces must be summed."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward: each TP rank holds a partial sum of a row-parallel output
    (or of a vocab-split embedding lookup); the summed output's gradient is already replicated."""

    @staticmethod
    def forward(ctx, x, tp):
        x = x.clone()
        dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward, keep-own-slice backward: every TP rank then computes the
    same full loss, so each rank's slice of the gradient is exactly the gradient of its own columns."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        pieces = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(pieces, x.contiguous(), group=tp.group)
        return torch.cat(pieces, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


# --- parameters and layers ------------------------------------------------------------------------


def _split_param(
    full_rows: int, cols: int, tp: TensorParallel, dim: int, gen: torch.Generator, std: float
) -> nn.Parameter:
    """A TP-split weight of the logical shape [full_rows, cols] split along `dim`, drawn from `gen`.

    The `tensor_model_parallel` / `partition_dim` attributes are the ones Megatron sets: DeepSpeed's
    gradient-norm computation reads them to count split tensors on every TP rank but replicated
    tensors only once.
    """
    shape = [full_rows, cols]
    if shape[dim] % tp.size:
        raise ValueError(f"dimension {dim} of {shape} is not divisible by the TP size {tp.size}")
    shape[dim] //= tp.size
    p = nn.Parameter(torch.empty(shape).normal_(0.0, std, generator=gen))
    p.tensor_model_parallel = True
    p.partition_dim = dim
    p.partition_stride = 1
    return p


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A and b split along the output dim: each TP rank computes its own columns."""

    def __init__(
        self, in_features: int, out_features: int, tp: TensorParallel, gen: torch.Generator, std: float = INIT_STD
    ):
        super().__init__()
        self.tp = tp
        self.weight = _split_param(out_features, in_features, tp, 0, gen, std)
        self.bias = nn.Parameter(torch.zeros(out_features // tp.size))
        self.bias.tensor_model_parallel = True
        self.bias.partition_dim = 0
        self.bias.partition_stride = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split along the input dim: the partial products are summed over the TP group,
    then the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, gen: torch.Generator, std: float):
        super().__init__()
        self.tp = tp
        self.weight = _split_param(out_features, in_features, tp, 1, gen, std)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.tp) + self.bias


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the TP group: each rank looks up the
    tokens in its own range, zeroes the others, and the all-reduce assembles the full lookup."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel, gen: torch.Generator):
        super().__init__()
        self.tp = tp
        self.weight = _split_param(vocab_size, hidden, tp, 0, gen, INIT_STD)
        self.vocab_start = tp.rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return _ReduceFromTP.apply(out, self.tp)


def _layer_generators(seed: int, layer_idx: int, tp: TensorParallel) -> tuple[torch.Generator, torch.Generator]:
    """(replicated, split) generators for one pipeline layer: the first is the same on every TP rank, the
    second differs per TP rank. Seeding per layer keeps a layer's weights independent of which pipeline
    stage builds it."""
    replicated = torch.Generator().manual_seed(seed * 1000 + layer_idx)
    split = torch.Generator().manual_seed(seed * 1000 + layer_idx + TP_SEED_OFFSET + 100 * tp.rank)
    return replicated, split


class EmbeddingPipe(nn.Module):
    """(tokens, position ids) [batch, seq] -> hidden states [seq, batch, hidden]."""

    def __init__(self, cfg: MegatronGPTConfig, tp: TensorParallel, seed: int, layer_idx: int):
        super().__init__()
        replicated, split = _layer_generators(seed, layer_idx, tp)
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, tp, split)
        self.position_embeddings = nn.Embedding(cfg.seq_len, cfg.hidden)
        with torch.no_grad():
            self.position_embeddings.weight.normal_(0.0, INIT_STD, generator=replicated)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, positions = inputs
        x = self.word_embeddings(tokens) + self.position_embeddings(positions)
        return x.transpose(0, 1).contiguous()


class ParallelAttention(nn.Module):
    """Causal self-attention over the heads this TP rank owns.

    `query_key_value` rows are laid out per head ([head][q|k|v][head_dim]), Megatron's layout, so that
    splitting the full weight along dim 0 gives each TP rank whole heads.
    """

    def __init__(self, cfg: MegatronGPTConfig, tp: TensorParallel, gen: torch.Generator, out_std: float):
        super().__init__()
        if cfg.n_heads % tp.size:
            raise ValueError(f"{cfg.n_heads} attention heads cannot be split over {tp.size} TP ranks")
        self.local_heads = cfg.n_heads // tp.size
        self.head_dim = cfg.hidden // cfg.n_heads
        self.query_key_value = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, tp, gen)
        self.dense = RowParallelLinear(cfg.hidden, cfg.hidden, tp, gen, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv = self.query_key_value(x).view(s, b, self.local_heads, 3 * self.head_dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.split(self.head_dim, dim=-1))  # [b, heads, s, d]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(ctx.permute(2, 0, 1, 3).reshape(s, b, self.local_heads * self.head_dim))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: MegatronGPTConfig, tp: TensorParallel, gen: torch.Generator, out_std: float):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden, cfg.ffn_hidden, tp, gen)
        self.dense_4h_to_h = RowParallelLinear(cfg.ffn_hidden, cfg.hidden, tp, gen, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class ParallelTransformerLayerPipe(nn.Module):
    """A pre-LN transformer layer with Megatron's parameter names."""

    def __init__(self, cfg: MegatronGPTConfig, tp: TensorParallel, seed: int, layer_idx: int):
        super().__init__()
        _, split = _layer_generators(seed, layer_idx, tp)
        # Megatron's scaled init for the projections that write into the residual stream.
        out_std = INIT_STD / math.sqrt(2.0 * cfg.n_layers)
        self.input_layernorm = nn.LayerNorm(cfg.hidden, eps=cfg.layernorm_eps)
        self.self_attention = ParallelAttention(cfg, tp, split, out_std)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden, eps=cfg.layernorm_eps)
        self.mlp = ParallelMLP(cfg, tp, split, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LMHeadPipe(nn.Module):
    """Hidden states [seq, batch, hidden] -> this TP rank's vocabulary slice of the logits [batch, seq, V/tp]."""

    def __init__(self, cfg: MegatronGPTConfig, tp: TensorParallel, seed: int, layer_idx: int):
        super().__init__()
        _, split = _layer_generators(seed, layer_idx, tp)
        self.tp = tp
        self.lm_head = nn.Module()
        self.lm_head.weight = _split_param(cfg.vocab_size, cfg.hidden, tp, 0, split, INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(_CopyToTP.apply(x, self.tp), self.lm_head.weight)
        return logits.transpose(0, 1).contiguous()


def _with_position_ids(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return tokens, positions


class VocabParallelLoss:
    """Next-token cross entropy in fp32 over the vocabulary slices gathered from the TP group."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        full = _GatherFromTP.apply(logits, self.tp).float()
        return F.cross_entropy(full.reshape(-1, full.shape[-1]), labels.reshape(-1))


class GPTModelPipe(PipelineModule):
    """The tiny GPT over a (pipe, data, model) topology; see the module docstring for the layer layout."""

    def __init__(self, cfg: MegatronGPTConfig, topology: PipeModelDataParallelTopology, seed: int):
        tp = TensorParallel(rank=topology.get_coord(dist.get_rank()).model, size=topology.get_dim("model"))
        if cfg.vocab_size % tp.size:
            raise ValueError(f"vocab size {cfg.vocab_size} is not divisible by the TP size {tp.size}")
        specs = [_with_position_ids, LayerSpec(EmbeddingPipe, cfg, tp, seed, 1)]
        specs += [LayerSpec(ParallelTransformerLayerPipe, cfg, tp, seed, 2 + i) for i in range(cfg.n_layers)]
        specs += [
            LayerSpec(nn.LayerNorm, cfg.hidden, eps=cfg.layernorm_eps),
            LayerSpec(LMHeadPipe, cfg, tp, seed, 2 + cfg.n_layers + 1),
        ]
        super().__init__(
            layers=specs,
            topology=topology,
            loss_fn=VocabParallelLoss(tp),
            partition_method="type:ParallelTransformerLayerPipe",
        )
        tp.group = self._grid.get_slice_parallel_group()


def is_tp_split(param: nn.Parameter) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))
