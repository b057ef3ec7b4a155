"""Run under `torch.distributed.run --nproc_per_node 4` (or 8 for DP=2) with one or more checkpoint folders: for each,
load the TP=2 x PP=2 pipeline checkpoint into a new real DeepSpeed `PipelineEngine` (the one the samples were trained
with), measure the TP replicas' drift on the live engine, train one step. Rank 0 prints one line
`DS_PIPELINE_STEP {json}` per folder, in order (several folders in one launch: the processes start once).

The model, config and batches are `ckpt_tools.samples.workers.ds_pipeline`'s own functions, so the engine
is the one that wrote the samples (with the default RNG seeded alike on every TP rank, as Megatron does).
"""

from __future__ import annotations

import json
import math
import sys

import deepspeed
import torch
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from ckpt_tools.train.megatron import GPTModelPipe, MegatronGPTConfig
from ckpt_tools.samples.workers import _common as c
from ckpt_tools.samples.workers import ds_pipeline as P


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    for load_dir in sys.argv[1:]:
        step(load_dir)


def step(load_dir: str) -> None:
    dp = c.world_size() // (P.TP * P.PP)
    topology = PipeModelDataParallelTopology(num_pp=P.PP, num_mp=P.TP, num_dp=dp)
    coord = topology.get_coord(c.rank())
    torch.manual_seed(P.default_rng_seed(coord.pipe, coord.model, per_tp_rank=False))
    cfg = MegatronGPTConfig()
    model = GPTModelPipe(cfg, topology, seed=c.SEED)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=c.param_groups(model), config=P.ds_config(dp))
    loaded, _ = engine.load_checkpoint(load_dir)
    if loaded is None:
        raise SystemExit(f"DeepSpeed loaded nothing from {load_dir}")
    step_loaded = engine.global_steps
    drift = P.replica_drift(engine, coord.model, coord.data)  # collective: every rank calls it
    loss = float(engine.train_batch(data_iter=P.micro_batches(step_loaded, cfg, coord.data)))
    if c.rank() == 0:
        print(
            "DS_PIPELINE_STEP "
            + json.dumps(
                {
                    "path": load_dir,
                    "loaded": loaded,
                    "global_steps_loaded": step_loaded,
                    "global_steps_after": engine.global_steps,
                    "drift": drift,
                    "loss": loss,
                    "finite": math.isfinite(loss),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
    c.shutdown()
