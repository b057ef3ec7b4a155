"""Make a large REAL DeepSpeed ZeRO-2 bf16 checkpoint (DP=2) for the benchmarks, by training for real.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6    # ~2.2 GB, ~580 tensors
    python bench/make_big_zero.py --out bench/out/zero2_200m --params 14e6   # ~0.24 GB, same tensor count

A synthetic file of the right size would not do: what a reader pays for is the real layout (the
pickled `param_slice_mappings`, `LossScaler`, `ZeroStageEnum`, flat partitions per group, the
`zero_to_fp32.py` beside the tag folder), so the checkpoint comes from `engine.save_checkpoint` after
real optimizer steps, on 2 CPU ranks over gloo, with the same recipe as the ZeRO samples
(`ckpt_tools/samples/workers/ds_zero.py`: its DeepSpeed config, param groups and loss), only bigger.

Size: bf16 weights (2 B/param) + fp32 master (4) + exp_avg (4) + exp_avg_sq (4) = ~14 bytes/param.
The number of layers is fixed (48 by default: 48 x 12 + 5 = 581 parameter tensors), and `--params`
picks the hidden size, so checkpoints of different sizes have the same tree and differ only in bytes:
exactly what is needed to show that `ckpt inspect` costs the same whatever the size.

Memory: each rank holds the fp32 model, its bf16 copy, and half of the fp32 master and Adam state;
measured peak 2.9 GB RSS per rank at 160M params (~1 min on 2 CPU cores), so 2 ranks fit in 24 GiB.

Run it from anywhere; it skips a checkpoint that is already complete (use --force to remake it). Besides
`<out>/` (with `latest` and the tag folder) it writes `<out>.manifest.json` (model config, counters, LR,
parameter count, versions) and `<out>.log` (the torchrun output).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER_MODULE = "bench.make_big_zero"
TAG = "global_step{steps}"


def model_config(params: float, *, layers: int, vocab: int, seq_len: int, heads: int):
    """The smallest TinyGPT config (hidden a multiple of 32) with at least `params` parameters."""
    import torch

    from ckpt_tools.train.models import GPTConfig, TinyGPT, count_parameters

    hidden = 32
    while True:
        cfg = GPTConfig(vocab_size=vocab, seq_len=seq_len, hidden=hidden, n_layers=layers, n_heads=heads)
        with torch.device("meta"):  # counts without allocating
            count, tensors = count_parameters(TinyGPT(cfg))
        if count >= params:
            return cfg, count, tensors
        hidden += 32


def is_complete(out: Path, steps: int) -> bool:
    tag = out / TAG.format(steps=steps)
    return (
        (out / "latest").is_file()
        and (tag / "mp_rank_00_model_states.pt").is_file()
        and all((tag / f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt").is_file() for r in (0, 1))
    )


def make(
    out: Path, *, params: float, layers: int, vocab: int, seq_len: int, heads: int, steps: int, force: bool = False
) -> Path:
    """Train and save unless `out` already holds a complete checkpoint; returns `out`."""
    import os

    from ckpt_tools.samples import run_torchrun
    from ckpt_tools.train.manifest import manifest_path

    if is_complete(out, steps) and not force:
        print(f"{out}: already there, skipping (--force to remake)")
        return out
    cfg, count, tensors = model_config(params, layers=layers, vocab=vocab, seq_len=seq_len, heads=heads)
    print(
        f"{out}: TinyGPT hidden={cfg.hidden} layers={cfg.n_layers} vocab={cfg.vocab_size}: {count:,} params "
        f"in {tensors} tensors, ~{count * 14 / 1e9:.2f} GB expected; training {steps} steps on 2 CPU ranks"
    )
    if out.exists():
        shutil.rmtree(out)  # a partial run: start clean so no stale tag folder is left behind
    manifest_path(out).unlink(missing_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    # The worker is this file run as a module under torchrun: its ranks need the repo root on sys.path,
    # and worker_env() passes os.environ through.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    run_torchrun(
        WORKER_MODULE,
        2,
        [
            "--worker",
            "--out",
            str(out),
            "--hidden",
            str(cfg.hidden),
            "--layers",
            str(cfg.n_layers),
            "--vocab",
            str(cfg.vocab_size),
            "--seq-len",
            str(cfg.seq_len),
            "--heads",
            str(cfg.n_heads),
            "--steps",
            str(steps),
        ],
        log_path=out.with_name(out.name + ".log"),
        timeout=3600,
    )
    if not is_complete(out, steps):
        raise RuntimeError(f"the DeepSpeed run finished but {out} is not a complete checkpoint; see {out}.log")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s")
    return out


def worker(args: argparse.Namespace) -> None:
    """One torchrun rank: the ds_zero recipe (config, param groups, loss) on a bigger TinyGPT."""
    import deepspeed
    import torch

    from ckpt_tools.train.data import batch_for_step
    from ckpt_tools.train.manifest import write_manifest
    from ckpt_tools.train.models import GPTConfig, TinyGPT, count_parameters
    from ckpt_tools.samples.workers import _common as c
    from ckpt_tools.samples.workers.ds_zero import ZeroVariant, ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    rank, dp = c.rank(), c.world_size()
    variant = ZeroVariant(stage=2)
    cfg = GPTConfig(
        vocab_size=args.vocab, seq_len=args.seq_len, hidden=args.hidden, n_layers=args.layers, n_heads=args.heads
    )
    torch.manual_seed(c.SEED)  # the same initial weights on every rank without a broadcast
    model = TinyGPT(cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=c.param_groups(model), config=ds_config(variant, dp)
    )
    history = []
    for step in range(args.steps):
        lrs = c.current_lrs(engine.optimizer)
        tokens = batch_for_step(
            step, batch_size=c.MICRO_BATCH, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, dp_rank=rank
        )
        loss = c.lm_loss(engine, tokens)
        engine.backward(loss)
        engine.step()
        history.append({"step": step + 1, "loss": float(loss.item()), "lr": lrs})
    engine.save_checkpoint(str(args.out))
    saved = c.snapshot(
        global_step=engine.global_steps,
        optimizer=engine.optimizer,
        scheduler=engine.lr_scheduler,
        skipped_steps=engine.skipped_steps,
    )
    if rank == 0:
        count, tensors = count_parameters(model)
        write_manifest(
            args.out,
            sample=args.out.name,
            format="deepspeed_zero",
            world_size=dp,
            topology={"dp": dp, "tp": 1, "pp": 1, "zero_stage": variant.stage},
            steps=args.steps,
            counters=saved["counters"],
            lr=saved["lr"],
            parameters={"count": count, "tensors": tensors},
            extra={
                "model_config": cfg.to_dict(),
                "micro_batch_per_rank": c.MICRO_BATCH,
                "ds_config": ds_config(variant, dp),
                "dtype": "bfloat16",
                "tag": TAG.format(steps=args.steps),
                "history": history,
                "made_by": "bench/make_big_zero.py",
            },
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint folder to write (holds `latest`)")
    p.add_argument("--params", type=float, default=150e6, help="at least this many parameters (default 150e6)")
    p.add_argument("--layers", type=int, default=48, help="transformer blocks; 12 tensors each (default 48)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--steps", type=int, default=2, help="optimizer steps before the save (default 2)")
    p.add_argument("--force", action="store_true", help="remake even if a complete checkpoint is there")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one torchrun rank
    p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    make(
        args.out.resolve(),
        params=args.params,
        layers=args.layers,
        vocab=args.vocab,
        seq_len=args.seq_len,
        heads=args.heads,
        steps=args.steps,
        force=args.force,
    )


if __name__ == "__main__":
    from ckpt_tools.train.procgroup import leave

    main()
    leave(0)  # ckpt_tools.train.procgroup: a plain exit lets gloo abort a finished rank
