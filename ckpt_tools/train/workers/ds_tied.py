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

import copy
from typing import Any

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F

from ckpt_tools.train.workers import _common as c

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
    trainable = [p for p in model.parameters() if p.requires_grad]  # parameters() yields the tied one once
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": c.WEIGHT_DECAY,
             "lr": c.PEAK_LR * GROUP_LR_FACTORS[0]},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0,
             "lr": c.PEAK_LR * GROUP_LR_FACTORS[1]}]


def ds_config(stage: int, dp: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": c.MICRO_BATCH,
        "train_batch_size": c.MICRO_BATCH * dp,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": c.PEAK_LR, "betas": list(c.BETAS), "eps": 1e-8,
                                                  "weight_decay": c.WEIGHT_DECAY, "torch_adam": True}},
    }
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return cfg


def main() -> None:
    args = c.parse_args()
    stage = STAGES[args.sample]
    deepspeed.init_distributed(dist_backend="gloo")
    dp = c.world_size()
    rank = c.rank()
    cfg = ds_config(stage, dp)
    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                           config=copy.deepcopy(cfg))

    def step(global_step: int) -> float:
        loss = c.lm_loss(engine, c.tokens_for_step(global_step, rank))
        engine.backward(loss)
        engine.step()
        return loss.item()

    ckpt = args.out / args.sample

    def save() -> dict[str, Any]:
        engine.save_checkpoint(str(ckpt))
        c.drop_deepspeed_scripts(ckpt)
        return c.snapshot(global_step=engine.global_steps, optimizer=engine.optimizer,
                          skipped_steps=engine.skipped_steps)

    history, saved = c.train(step, lambda: c.current_lrs(engine.optimizer), save)
    if rank == 0:
        c.write_sample_manifest(
            ckpt, sample=args.sample, format="deepspeed_zero", model=build_model(),
            topology={"dp": dp, "tp": 1, "pp": 1, "zero_stage": stage}, saved=saved, history=history,
            extra={"ds_config": cfg, "dtype": "bfloat16", "tag": f"global_step{c.SAVE_AFTER_STEP}",
                   "model": "TiedNet (ckpt_tools.train.workers.ds_tied): head.weight tied to emb.weight",
                   "tied": {"head.weight": "emb.weight"}, "frozen": list(FROZEN),
                   "param_groups": "0: matrices (weight decay, LR), 1: vectors (no decay, 2 x LR)",
                   "fp16": "not available: DeepSpeed's CPU accelerator supports float32 and bfloat16 only"})


if __name__ == "__main__":
    main()
    c.shutdown()
