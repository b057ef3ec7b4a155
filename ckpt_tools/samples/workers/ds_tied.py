"""DeepSpeed ZeRO samples with a tied and frozen weights: what `zero_to_fp32` must put back.

The model ties its output head to its token embedding (`head.weight` is `emb.weight`: DeepSpeed records
`shared_params = {"head.weight": "emb.weight"}` and saves one copy), and freezes two parameters
(`requires_grad=False`: the position embedding and the layer norm's weight, whose 33 elements do not
split evenly over 2 ranks, so ZeRO-3 pads its last fragment). Two param groups with different LRs
(matrices with weight decay at LR, vectors without at 2 x LR). Real `engine.save_checkpoint` output from
2 CPU ranks over gloo, bf16 (DeepSpeed's CPU accelerator has no fp16: `supported_dtypes()` is
[float32, bfloat16], so there is no loss scaler and no skipped step to record here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ckpt_tools.samples.workers import _common as c

HIDDEN = 33
FFN = 48
FROZEN = ("pos.weight", "ln.weight")
STAGES = {"zero1_tied_frozen": 1, "zero2_tied_frozen": 2, "zero3_tied_frozen": 3}
GROUP_LR_FACTORS = (1.0, 2.0)


class TiedNet(nn.Module):
    """emb -> + pos -> LayerNorm -> MLP (residual) -> head, with head.weight tied to emb.weight."""

    def __init__(self, vocab: int = 64, seq_len: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, HIDDEN)
        self.pos = nn.Embedding(seq_len, HIDDEN)
        self.ln = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        x = x + self.fc2(F.gelu(self.fc1(self.ln(x))))
        return self.head(x)


def build_model() -> TiedNet:
    torch.manual_seed(c.SEED)
    model = TiedNet()
    for name, p in model.named_parameters():
        if name in FROZEN:
            p.requires_grad_(False)
    return model


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    return c.split_groups(
        model,
        {"weight_decay": c.WEIGHT_DECAY, "lr": c.PEAK_LR * GROUP_LR_FACTORS[0]},
        {"weight_decay": 0.0, "lr": c.PEAK_LR * GROUP_LR_FACTORS[1]},
    )


def ds_config(stage: int, dp: int) -> dict[str, Any]:
    cfg = c.ds_config(stage, dp, bf16={"enabled": True})
    cfg["optimizer"] = c.ds_adamw()
    return cfg


def main() -> None:
    args, rank, dp = c.ds_setup()
    stage = STAGES[args.sample]
    cfg = ds_config(stage, dp)
    model = build_model()
    engine = c.ds_initialize(model, cfg, groups=param_groups(model))
    ckpt = args.out / args.sample
    # no scheduler: the config has none, so engine.lr_scheduler is None
    history, saved = c.ds_train(engine, ckpt, lambda step: c.tokens_for_step(step, rank))
    if rank == 0:
        c.write_sample_manifest(
            ckpt,
            sample=args.sample,
            format="deepspeed_zero",
            model=build_model(),
            topology={"dp": dp, "tp": 1, "pp": 1, "zero_stage": stage},
            saved=saved,
            history=history,
            extra={
                "ds_config": cfg,
                "dtype": "bfloat16",
                "tag": f"global_step{c.SAVE_AFTER_STEP}",
                "model": "TiedNet (ckpt_tools.samples.workers.ds_tied): head.weight tied to emb.weight",
                "tied": {"head.weight": "emb.weight"},
                "frozen": list(FROZEN),
                "param_groups": "0: matrices (weight decay, LR), 1: vectors (no decay, 2 x LR)",
                "fp16": "not available: DeepSpeed's CPU accelerator supports float32 and bfloat16 only",
            },
        )


if __name__ == "__main__":
    main()
    c.shutdown()
