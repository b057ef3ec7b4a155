"""Benchmark: `ckpt set-lr --scale 0.5 --yes` on a >= 2 GB DeepSpeed ZeRO-2 checkpoint vs `cp` of the files it
rewrites, side by side in one run.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6     # once (2.2 GB; reused if present)
    python bench/bench_set_lr.py [--ckpt bench/out/zero2_2g] [--repeat 3]

Each command is its own process, timed from spawn to exit with its peak RSS (`bench/_util.py`):

- `ckpt set-lr --scale 0.5 --yes`: the whole transaction — plan (safe pickle read), pickle-only rewrite of
  every file holding an LR (tensor members copied in-kernel, never materialised), fsync, hard-link
  backup, atomic rename, re-verify with the reader;
- `ckpt restore --yes`: puts the originals back (so every repeat starts from the same bytes);
- `cp` of exactly the files set-lr rewrites, into a scratch folder on the same filesystem: the floor for
  "write a new copy of these bytes".

Results go to bench/out/set_lr_results.json. The checkpoint is left byte-identical (restore after each run).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (OUT_DIR, REPO_ROOT, cpu_busy_fraction, dir_bytes, fmt_bytes, machine_info,  # noqa: E402
                         run_measured, summarize)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "zero2_2g")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    py = sys.executable
    ckpt = [py, "-c", "from cli.main import main; main()"]
    plan_out = OUT_DIR / "set_lr_plan.json"
    run_measured([*ckpt, "set-lr", str(args.ckpt), "--scale", "0.5", "--dry-run", "--json"], cwd=REPO_ROOT,
                 stdout_path=plan_out)
    plan = json.loads(plan_out.read_text())["plan"]
    root = Path(plan["root"])
    files = [root / f["path"] for f in plan["files"]]
    nbytes = sum(f.stat().st_size for f in files)
    scratch = Path(tempfile.mkdtemp(prefix=".bench-cp-", dir=root.parent))  # same filesystem as the checkpoint
    commands = {
        "ckpt set-lr --scale 0.5 --yes": [*ckpt, "set-lr", str(args.ckpt), "--scale", "0.5", "--yes"],
        "ckpt restore --yes": [*ckpt, "restore", str(args.ckpt), "--yes"],
        f"cp of the {len(files)} rewritten files": ["cp", *map(str, files), str(scratch)],
    }
    runs: dict[str, list] = {k: [] for k in commands}
    busy = cpu_busy_fraction()
    try:
        for _ in range(args.repeat):
            for name, cmd in commands.items():
                runs[name].append(run_measured(cmd, cwd=REPO_ROOT))
            for f in scratch.iterdir():
                f.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summaries = {k: summarize(v) for k, v in runs.items()}
    base = summaries[f"cp of the {len(files)} rewritten files"]
    print(f"checkpoint {args.ckpt} ({fmt_bytes(dir_bytes(args.ckpt))}); set-lr rewrites {len(files)} files "
          f"({fmt_bytes(nbytes)}); warm page cache, median of {args.repeat}; CPU busy before: "
          f"{busy if busy is None else f'{busy:.0%}'}")
    print(f"{'command':<34} {'wall s':>18} {'cpu s':>7} {'peak RSS':>10} {'x cp wall':>9}")
    for name, s in summaries.items():
        print(f"{name:<34} {s.wall_s_median:>7.2f} ({s.wall_s_min:.2f}-{s.wall_s_max:.2f}) {s.cpu_s_median:>7.2f} "
              f"{fmt_bytes(s.peak_rss_bytes_median):>10} {s.wall_s_median / base.wall_s_median:>9.2f}")
    result = {"checkpoint": str(args.ckpt), "bytes": dir_bytes(args.ckpt), "rewritten_files": [str(f) for f in files],
              "rewritten_bytes": nbytes, "repeat": args.repeat, "cpu_busy": busy, "machine": machine_info(),
              "results": {k: s.to_dict() for k, s in summaries.items()}}
    (OUT_DIR / "set_lr_results.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
