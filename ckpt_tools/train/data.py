"""Deterministic synthetic token batches, seeded by the global step.

A batch depends only on (seed, global_step, dp_rank), so a run resumed at step N sees exactly the
batches the uninterrupted run saw at step N: losses can be compared bit for bit.
"""

from __future__ import annotations

import torch


def batch_for_step(
    global_step: int, *, batch_size: int, seq_len: int, vocab_size: int, dp_rank: int = 0, seed: int = 1234
) -> torch.Tensor:
    """Tokens of shape (batch_size, seq_len + 1) for this step and data-parallel rank.

    The sequence follows a simple learnable rule (each token is the previous one plus a per-row stride,
    mod vocab) so that the loss visibly falls during the tiny runs.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + global_step * 1009 + dp_rank)
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    pos = torch.arange(seq_len + 1).unsqueeze(0)
    return (start + stride * pos) % vocab_size
