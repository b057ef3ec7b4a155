"""Benchmark: `ckpt inspect` and `ckpt export` on a DeepSpeed Mixture-of-Experts checkpoint with many experts,
against what users run today, side by side in one run.

    python bench/bench_moe.py --make --experts 64 --layers 8   # once: the checkpoint (DeepSpeed's own save)
    python bench/bench_moe.py --experts 64 --layers 8 --repeat 3

`--make` trains the sample recipe of `ckpt_tools/samples/workers/ds_moe.py` (ZeRO-2 bf16, ep_size 2, 2 gloo
ranks) with `--experts` experts in each of `--layers` MoE layers and saves it with DeepSpeed's
`save_checkpoint` into bench/out/moe_E<experts>_L<layers>/. Each command is a whole process (spawn to exit, peak
RSS; `_util.run_measured`), runs interleaved, medians of `--repeat`:

- `ckpt inspect --json` vs `torch.load(weights_only=False)` of every file of the tag folder in one process (a
  hand walk: the only way to see the experts today);
- `ckpt export` (every expert's fp32 master to safetensors) vs DeepSpeed's own `zero_to_fp32`, which stops at the
  first expert file on MoE checkpoints (its exit status is recorded, not hidden).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (
    OUT_DIR,
    REPO_ROOT,
    ckpt_command,
    machine_info,
    precompile,
    report,  # noqa: E402
    run_measured,
)

TORCH_LOAD = r"""
import sys, torch
n = 0
for f in sys.argv[1:]:
    obj = torch.load(f, map_location="cpu", weights_only=False)
    n += 1
print(n, "files", flush=True)
"""


def make(experts: int, layers: int, out: Path) -> None:
    from ckpt_tools.samples import free_port, worker_env

    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "ckpt_tools.samples.workers.ds_moe",
        "--sample",
        "moe_zero2_bf16",
        "--out",
        str(out),
        "--experts",
        str(experts),
        "--layers",
        str(layers),
    ]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, env=worker_env())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--make", action="store_true")
    a = ap.parse_args()
    out = OUT_DIR / f"moe_E{a.experts}_L{a.layers}"
    if a.make:
        make(a.experts, a.layers, out)
    ckpt = out / "moe_zero2_bf16"
    tag = ckpt / (ckpt / "latest").read_text().strip()
    files = sorted(str(p) for p in tag.glob("*.pt"))
    precompile()
    ck = ckpt_command()
    export_to = out / "export.safetensors"
    z2f = out / "zero_to_fp32_out"
    cmds = {
        "ckpt inspect --json": ck + ["inspect", str(ckpt), "--json"],
        f"torch.load every file ({len(files)})": [sys.executable, "-c", TORCH_LOAD, *files],
        "ckpt export": ck + ["export", str(ckpt), str(export_to)],
        "deepspeed zero_to_fp32": [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(z2f)],
    }
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    runs: dict[str, list] = {k: [] for k in cmds}
    status: dict[str, int] = {}
    for _ in range(a.repeat):
        for name, cmd in cmds.items():
            export_to.unlink(missing_ok=True)  # export never overwrites: each run writes afresh
            m = run_measured(cmd, env=env, cwd=REPO_ROOT, check=False)
            runs[name].append(m)
            status[name] = m.returncode
    doc = json.loads(subprocess.run(ck + ["inspect", str(ckpt), "--json"], capture_output=True, text=True).stdout)
    result = {
        "machine": machine_info(),
        "experts": a.experts,
        "moe_layers": a.layers,
        "checkpoint": {
            "parameter_tensors": doc["parameters"]["tensors"],
            "parameters": doc["parameters"]["count"],
            "files": len(doc["files"]),
            "unread": doc["files_unread"],
        },
        "exit_status": status,
    }
    report(runs, "moe_results.json", result, {n: f"exit {c}" for n, c in status.items()})


if __name__ == "__main__":
    main()
