"""Make DCP checkpoints with torch's own `torch.distributed.checkpoint.save`, at a chosen number of items.

    python bench/make_big_dcp.py --out bench/out/dcp_10k --params 2500             # 10,013 items, one process
    python bench/make_big_dcp.py --out bench/out/dcp_10k_2p --params 1430 --procs 2
    python bench/make_big_dcp.py --out bench/out/dcp_wide --params 500 --shape 64x512

A model of N small parameters (16 x 8 fp32 each; `--shape` to change) trained one real Adam step, saved as
{"model", "optim", "step"} with `get_state_dict` (the FSDP2 / torchtitan way: the optimizer state keyed by
parameter name): 4 items per parameter (the weight, exp_avg, exp_avg_sq and Adam's 0-d `step` tensor) plus the
param group's items and `step`. `--procs 2` saves from two gloo processes over a 2-way DP mesh: each parameter is
an FSDP2-style DTensor sharded on dim 0, so each of its 3 big items is 2 chunks, one per `.distcp` file.
Skips an existing complete checkpoint (its `.metadata` is written last); `--force` remakes it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path


def _state(n: int, world: int, rank: int, shape: tuple[int, int] = (16, 8)):
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(*shape)) for i in range(n)})
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        for k, p in list(model.items()):
            model[k] = torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = sum((p * p).sum() for p in model.values())
    if world > 1:
        loss = loss.full_tensor()
    loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "step": 1}


def _worker(rank: int, world: int, n: int, out: str, port: int, shape: tuple[int, int] = (16, 8)) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    dcp.save(_state(n, world, rank, shape), checkpoint_id=out)
    if world > 1:
        dist.destroy_process_group()


def make(out: Path, params: int, procs: int = 1, force: bool = False, shape: tuple[int, int] = (16, 8)) -> Path:
    """The checkpoint at `out` (made when missing or `force`)."""
    if (out / ".metadata").is_file() and not force:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if procs == 1:
        _worker(0, 1, params, str(out), 0, shape)
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_worker, args=(procs, params, str(out), port, shape), nprocs=procs)
    print(f"{out}: {params} parameters, {procs} process(es), {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--params", type=int, required=True, help="parameters (about 4 items each)")
    p.add_argument("--procs", type=int, default=1, choices=(1, 2))
    p.add_argument("--shape", default="16x8", help="each parameter's shape, ROWSxCOLS (default 16x8)")
    p.add_argument("--force", action="store_true")
    a = p.parse_args()
    make(a.out, a.params, a.procs, a.force, tuple(int(x) for x in a.shape.split("x")))


if __name__ == "__main__":
    main()
