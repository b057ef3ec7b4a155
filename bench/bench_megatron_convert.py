"""Benchmark: `ckpt convert --to megatron` (a Megatron-LM legacy TP=2 run -> torch_dist, with the optimizer state)
vs Megatron-LM's own way to the same place, loading the run in Megatron and saving it in the other format
(`--ckpt-convert-format torch_dist --ckpt-convert-save DIR`, Megatron's `pretrain` on 2 gloo CPU ranks), side by side,
plus a logical comparison of what each wrote.

    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron.py --make --layers 96            # once
    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron_convert.py --layers 96 --repeat 3
    MEGATRON_LM_DIR=/path/to/Megatron-LM python bench/bench_megatron_convert.py --to torch --layers 96 --repeat 3

`--to torch` times the other direction: the torch_dist run of the same `--make` -> legacy rank files at the saved TP
(`ckpt convert --to megatron --ckpt-format torch` vs Megatron's `--ckpt-convert-format torch`).

The checkpoint is `bench_megatron.py --make`'s: bench/out/megatron_L<layers>/megatron_tp2_legacy (Megatron-LM's own
`save_checkpoint`, plain Adam, bf16 weights + fp32 master). Each command is a whole process, timed from spawn to exit
with its peak RSS (`_util.run_measured`), runs interleaved, medians of `--repeat`; outputs are deleted (untimed)
before the next run writes them again:

- `ckpt convert RUN OUT --to megatron`: merged global tensors, fp32 master, exp_avg, exp_avg_sq, step, param groups
  and the OptimizerParamScheduler into Megatron's torch_dist layout, verified (logical diff) before it is put in place;
- Megatron: `ckpt resume RUN --device cpu --megatron-args "--ckpt-convert-format torch_dist --ckpt-convert-save DIR"`.
  `ckpt resume` is only the launcher here: it starts Megatron-LM's `pretrain` (pretrain_gpt.py's GPT builder) with
  the run's own saved args and the CPU run-time changes listed in `ckpt_tools/samples/workers/megatron_lm.py`; Megatron
  then loads the checkpoint with its `load_checkpoint`, saves it again with `save_checkpoint` in torch_dist format
  into DIR/torch_dist and exits before training (training.py, "Convert checkpoint format"). The verdict `ckpt resume`
  prints then fails (no step ran): the run counts as done when DIR/torch_dist holds the iteration's `.metadata`;
- the reference's fixed cost: a process that only runs `import_megatron()` (Megatron's training code with the CPU
  shims), converting nothing.

Then (untimed) `ckpt diff --logical` of the two outputs (every tensor by its logical name, bit-exact), and of ckpt's
output against the source.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (
    OUT_DIR,
    REPO_ROOT,
    ckpt_command,
    cpu_busy_fraction,
    machine_info,
    precompile,  # noqa: E402
    report_against,
    run_measured,
)
from bench.bench_megatron import arguments  # noqa: E402

#: --to: (source sample, `ckpt convert` flags, Megatron's --ckpt-convert-format, the format word in the row names)
DIRECTIONS = {
    "torch_dist": ("megatron_tp2_legacy", ["--to", "megatron"], "torch_dist"),
    "torch": ("megatron_tp2_torch_dist", ["--to", "megatron", "--ckpt-format", "torch"], "torch"),
}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--to",
        choices=sorted(DIRECTIONS),
        default="torch_dist",
        help="torch_dist: the legacy run -> torch_dist; torch: the torch_dist run -> legacy (same TP)",
    )
    a, src = arguments(ap)
    megatron = os.environ.get("MEGATRON_LM_DIR")
    if not megatron:
        raise SystemExit("set MEGATRON_LM_DIR to a Megatron-LM checkout (tag core_v0.16.1)")
    sample, flags, fmt = DIRECTIONS[a.to]
    source = src / sample
    if not list(source.glob("iter_*")):
        raise SystemExit(f"no {sample} in {src}: run with --make --layers {a.layers}")
    work = OUT_DIR / f"megatron_convert_L{a.layers}_{fmt}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ours, theirs = work / f"ckpt_{fmt}", work / "megatron"
    ckpt_row, megatron_row = f"ckpt convert {' '.join(flags)}", f"Megatron load + save (--ckpt-convert-format {fmt})"
    precompile()
    ck = ckpt_command()
    cmds = {
        ckpt_row: (ck + ["convert", str(source), str(ours), *flags], ours),
        megatron_row: (
            ck
            + [
                "resume",
                str(source),
                "--device",
                "cpu",
                "--megatron-args",
                f"--ckpt-convert-format {fmt} --ckpt-convert-save {theirs}",
            ],
            theirs,
        ),
        "floor: import_megatron() alone": (
            [sys.executable, "-c", "from ckpt_tools.samples.workers import megatron_lm as w; w.import_megatron()"],
            None,
        ),
    }
    env = dict(os.environ, MEGATRON_LM_DIR=megatron)
    runs: dict[str, list] = {k: [] for k in cmds}
    busy: list[float | None] = []
    for _ in range(a.repeat):
        for name, (cmd, target) in cmds.items():
            if target is not None:
                shutil.rmtree(target, ignore_errors=True)
            busy.append(cpu_busy_fraction())
            m = run_measured(cmd, env=env, cwd=REPO_ROOT, check=name != megatron_row)
            if name == megatron_row and not (theirs / fmt / "latest_checkpointed_iteration.txt").is_file():
                raise SystemExit(f"Megatron wrote no {fmt} checkpoint into {theirs} (exit {m.returncode})")
            runs[name].append(m)
    compare = {}
    for label, (x, y) in {"ckpt vs Megatron": (ours, theirs / fmt), "ckpt vs source": (source, ours)}.items():
        p = subprocess.run(
            ck + ["diff", "--logical", str(x), str(y)], capture_output=True, text=True, env=env, cwd=REPO_ROOT
        )
        compare[label] = {"exit": p.returncode, "last_line": (p.stdout.strip().splitlines() or [""])[-1]}
    sizes = {
        name: sum(f.stat().st_size for f in t.rglob("*") if f.is_file())
        for name, (_, t) in cmds.items()
        if t is not None
    }
    report_against(
        runs,
        megatron_row,
        "Megatron",
        f"megatron_convert_{fmt}_results.json",
        {
            "machine": machine_info(),
            "layers": a.layers,
            "checkpoint": str(source),
            "output_bytes": sizes,
            "comparison": compare,
        },
        busy,
    )
    print(json.dumps(compare, indent=1))


if __name__ == "__main__":
    main()
