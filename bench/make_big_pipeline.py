"""Make a larger Megatron-DeepSpeed pipeline checkpoint (TP=2 x PP=2, bf16 ZeRO-1) for bench_tp_sync.py.

    python -m torch.distributed.run --standalone --nproc_per_node 4 bench/make_big_pipeline.py \
        --out bench/out/pipe_100m --hidden 1024 --layers 8
    # many files (bench_inspect's file-count row): TP=2 x PP=2 x DP=2, 8 ranks
    python -m torch.distributed.run --standalone --nproc_per_node 8 bench/make_big_pipeline.py \
        --out bench/out/pipe_dp2_l96 --hidden 64 --layers 96 --dp 2

The real `PipelineEngine`, trained for a few steps: the model, ds_config, batches and the replica drift
are `ckpt_tools.samples.workers.ds_pipeline`'s own (the sample worker), only the model is bigger. TP rank 0
halves the gradients of two layer norms for two steps, the BLOOM bug the samples reproduce, so there is
drift to find.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO  # noqa: E402
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology  # noqa: E402

from ckpt_tools.train.procgroup import leave  # noqa: E402
from ckpt_tools.train.megatron import GPTModelPipe, MegatronGPTConfig  # noqa: E402
from ckpt_tools.samples.workers import _common as c  # noqa: E402
from ckpt_tools.samples.workers import ds_pipeline as P  # noqa: E402

STEPS = 3
PERTURBED_STEPS = (2, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel size: run TP*PP*DP = 4*DP ranks")
    args, _ = ap.parse_known_args()
    deepspeed.init_distributed(dist_backend="gloo")
    topology = PipeModelDataParallelTopology(num_pp=P.PP, num_mp=P.TP, num_dp=args.dp)
    coord = topology.get_coord(c.rank())
    torch.manual_seed(P.default_rng_seed(coord.pipe, coord.model, per_tp_rank=False))
    cfg = MegatronGPTConfig(
        hidden=args.hidden, n_layers=args.layers, ffn_hidden=4 * args.hidden, n_heads=max(4, args.hidden // 64)
    )
    model = GPTModelPipe(cfg, topology, seed=c.SEED)
    # the first and the last transformer layer's post-attention norm: one per pipeline stage
    drifted = {f"{2:02d}.post_attention_layernorm.weight", f"{1 + args.layers:02d}.post_attention_layernorm.weight"}
    perturb = P.ReplicaGradPerturbation(0.5)
    if coord.model == 0:
        perturb.attach([p for n, p in model.named_parameters() if P.logical_name(n) in drifted])
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=c.param_groups(model), config=P.ds_config(args.dp)
    )
    for step in range(STEPS):
        perturb.active = step + 1 in PERTURBED_STEPS
        engine.train_batch(data_iter=P.micro_batches(step, cfg, coord.data))
    engine.save_checkpoint(
        str(args.out),
        client_state={
            "args": P.megatron_args(cfg, args.dp),
            "iteration": engine.global_steps,
            "torch_rng_state": torch.get_rng_state(),
            UNIVERSAL_CHECKPOINT_INFO: P.universal_checkpoint_info(cfg),
        },
    )
    drift = P.replica_drift(engine, coord.model, coord.data)
    if c.rank() == 0:
        print(
            f"saved {args.out}: hidden={cfg.hidden} layers={cfg.n_layers}; drifted on the live engine: {sorted(drift)}",
            flush=True,
        )
    os.sync()


if __name__ == "__main__":
    main()
    leave(0)  # ckpt_tools.train.procgroup: a plain exit lets gloo abort a finished rank
