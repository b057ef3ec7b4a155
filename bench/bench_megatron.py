"""Benchmark: `ckpt inspect` on real Megatron-LM checkpoints against what Megatron users run today, side by side.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron.py --make --layers 96   # once: the checkpoints
    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron.py --repeat 3           # table + JSON

`--make` writes two checkpoints with Megatron-LM's own `pretrain` / `save_checkpoint` (the sample worker
`ckpt_tools/samples/workers/megatron_lm.py`, the samples' recipe made `--layers` deep: TP=2 on 2 gloo ranks) into
bench/out/megatron_L<layers>/: the legacy format (one `model_optim_rng.pt` per TP rank) and torch_dist.

Each command is a whole process, timed from spawn to exit with its peak RSS (`_util.run_measured`), runs
interleaved, medians of `--repeat`:

- legacy: `ckpt inspect RUN --json` vs `torch.load(weights_only=False)` of every rank file in one process (what
  hand inspection does; unpickling imports megatron.core for its enums, as it does for users);
- torch_dist: `ckpt inspect RUN --json` vs Megatron-LM's own `tools/checkpoint/checkpoint_inspector.py inspect
  ITER_DIR` (it reads the DCP metadata and prints every key; run with the checkout on PYTHONPATH).
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
for f in sys.argv[1:]:
    obj = torch.load(f, map_location="cpu", weights_only=False)
    print(f, len(obj["model"]), flush=True)
"""


def make(layers: int, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for sample in ("megatron_tp2_legacy", "megatron_tp2_torch_dist"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(29600 + layers % 50 + (sample.endswith("dist"))),
            "-m",
            "ckpt_tools.samples.workers.megatron_lm",
            "--sample",
            sample,
            "--out",
            str(out),
            "--num-layers",
            str(layers),
        ]
        env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, cwd=REPO_ROOT, env=env)


def arguments(ap: argparse.ArgumentParser | None = None) -> tuple[argparse.Namespace, Path]:
    """The Megatron benchmarks' common options (--layers, --repeat, --make); makes the run when asked; returns the
    options and the folder holding megatron_tp2_legacy / megatron_tp2_torch_dist."""
    ap = ap or argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--make", action="store_true")
    a = ap.parse_args()
    out = OUT_DIR / f"megatron_L{a.layers}"
    if a.make:
        make(a.layers, out)
    return a, out


def main() -> None:
    a, out = arguments()
    megatron = os.environ.get("MEGATRON_LM_DIR")
    legacy, dist = out / "megatron_tp2_legacy", out / "megatron_tp2_torch_dist"
    it = next(dist.glob("iter_*"))
    rank_files = sorted(str(p) for p in legacy.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    precompile()
    ck = ckpt_command()
    cmds = {
        "ckpt inspect legacy --json": ck + ["inspect", str(legacy), "--json"],
        "torch.load every legacy rank file": [sys.executable, "-c", TORCH_LOAD, *rank_files],
        "ckpt inspect torch_dist --json": ck + ["inspect", str(dist), "--json"],
    }
    env = dict(os.environ)
    if megatron:
        cmds["Megatron checkpoint_inspector.py inspect (torch_dist)"] = [
            sys.executable,
            str(Path(megatron) / "tools" / "checkpoint" / "checkpoint_inspector.py"),
            "inspect",
            str(it),
        ]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(megatron), env.get("PYTHONPATH")]))
    runs: dict[str, list] = {k: [] for k in cmds}
    for _ in range(a.repeat):
        for name, cmd in cmds.items():
            runs[name].append(run_measured(cmd, env=env, cwd=REPO_ROOT))
    counts = {}
    for label, path in (("legacy", legacy), ("torch_dist", dist)):
        doc = json.loads(subprocess.run(ck + ["inspect", str(path), "--json"], capture_output=True, text=True).stdout)
        counts[label] = {"parameter_tensors": doc["parameters"]["tensors"], "files": len(doc["files"])}
    report(runs, "megatron_results.json", {"machine": machine_info(), "layers": a.layers, "checkpoints": counts})


if __name__ == "__main__":
    main()
