"""Benchmark: peak memory of every read-only `ckpt` command on big checkpoints, against the largest tensor.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6          # once (2.2 GB ZeRO-2)
    python bench/bench_memory.py [--ckpt bench/out/zero2_2g] [--pipe bench/out/pipe_400m] [--repeat 3]

The goal (issue 14): peak RSS bounded by the largest single tensor plus a fixed amount, whatever the
checkpoint's size. Each command is its own process, timed from spawn to exit with its CPU time and peak
RSS (`bench/_util.py`); runs are interleaved and the table shows medians. Beside each command:

- "RSS - floor": its peak RSS minus that of a process that imports the CLI and exits (the interpreter,
  typer, rich); "torch floor" is the same plus `import torch`, which `inspect --stats` still pays for;
- "largest tensor": of the checkpoint the command reads, both as stored (a ZeRO flat partition holds a
  whole rank's parameters in one tensor) and as a logical tensor (one parameter, merged).

With --pipe (a TP x PP pipeline checkpoint, `make_big_pipeline.py`), also `check-tp-sync` and a logical
`diff` of the pipeline with itself (every TP-sharded tensor merged while it is read).

The second checkpoints `diff` needs are made once under --scratch (kept for the next run): a `cp -r` with
`ckpt set-lr --scale 0.5 --yes` applied, an identical `cp -r`, and `ckpt export` to fp32 safetensors.
Results go to bench/out/memory_results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (
    OUT_DIR,
    REPO_ROOT,
    cpu_busy_fraction,
    dir_bytes,
    fmt_bytes,
    machine_info,  # noqa: E402
    run_measured,
    summarize,
)

CLI = "from ckpt_cli.main import main; main()"

# run in a child: this driver stays small, because a child's ru_maxrss starts at its parent's size
LARGEST = r"""
import json, sys
from ckpt_tools import open_checkpoint
from ckpt_tools.read.pickle_reader import DTYPE_SIZE
from ckpt_tools.read.tree import iter_tensors

def refs(node):
    for s in node.shards:
        yield from refs(s)
    for p in node.pieces:
        yield p.ref

ck = open_checkpoint(sys.argv[1])
logical, stored = (0, None), (0, None)
for path, t in iter_tensors(ck.tree):
    logical = max(logical, (t.numel * DTYPE_SIZE.get(t.dtype, 4), path))
    for r in refs(t):
        stored = max(stored, (r.nbytes, f"{path} ({r.dtype} {list(r.shape)})"))
print(json.dumps({"logical_bytes": logical[0], "logical": logical[1], "stored_bytes": stored[0], "stored": stored[1]}))
"""


def cli(*args) -> list[str]:
    return [sys.executable, "-c", CLI, *map(str, args)]


def prepare(ckpt: Path, scratch: Path) -> dict[str, Path]:
    """The second checkpoints for `diff`, made once and kept under `scratch`."""
    scratch.mkdir(parents=True, exist_ok=True)
    out = {"lr_halved": scratch / "lr_halved", "copy": scratch / "copy", "export": scratch / "export.safetensors"}
    for name in ("lr_halved", "copy"):
        if not out[name].exists():
            shutil.copytree(ckpt, out[name].with_suffix(".partial"))
            if name == "lr_halved":
                subprocess.run(
                    cli("set-lr", out[name].with_suffix(".partial"), "--scale", "0.5", "--yes"),
                    cwd=REPO_ROOT,
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
            out[name].with_suffix(".partial").rename(out[name])
    if not out["export"].exists():
        subprocess.run(
            cli("export", ckpt, out["export"]),
            cwd=REPO_ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    return out


def largest(ckpt: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", LARGEST, str(ckpt)], cwd=REPO_ROOT, check=True, capture_output=True, text=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "zero2_2g")
    ap.add_argument(
        "--pipe",
        type=Path,
        default=OUT_DIR / "pipe_400m",
        help="TP x PP checkpoint for check-tp-sync (skipped if missing)",
    )
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/ckpt_bench_memory"))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    other = prepare(args.ckpt, args.scratch)
    a = args.ckpt
    py = sys.executable
    commands: dict[str, tuple[list[str], Path | None]] = {
        "floor: import ckpt_cli.main": ([py, "-c", "import ckpt_cli.main"], None),
        "torch floor: import ckpt_cli.main, torch": ([py, "-c", "import ckpt_cli.main, torch"], None),
        "inspect": (cli("inspect", a), a),
        "inspect --json": (cli("inspect", a, "--json"), a),
        "inspect --stats": (cli("inspect", a, "--stats"), a),
        "inspect --stats --json": (cli("inspect", a, "--stats", "--json"), a),
        "diff A B (B: set-lr --scale 0.5)": (cli("diff", a, other["lr_halved"]), a),
        "diff A A' (identical copy)": (cli("diff", a, other["copy"]), a),
        "diff --logical A export.safetensors": (cli("diff", "--logical", a, other["export"]), a),
        "set-lr --scale 0.5 --dry-run": (cli("set-lr", a, "--scale", "0.5", "--dry-run"), a),
    }
    if (args.pipe / "latest").exists():
        commands["check-tp-sync (pipeline)"] = (cli("check-tp-sync", args.pipe), args.pipe)
        # every TP-sharded tensor merged on the fly (row blocks of each shard interleaved per read)
        commands["diff --logical pipeline itself"] = (cli("diff", "--logical", args.pipe, args.pipe), args.pipe)
    sizes = {p: largest(p) for p in {p for _, p in commands.values() if p is not None}}
    runs: dict[str, list] = {k: [] for k in commands}
    busy = cpu_busy_fraction()
    for _ in range(args.repeat):
        for name, (cmd, _) in commands.items():
            # diff and check-tp-sync exit 1 when they find a difference: that is their answer
            m = run_measured(cmd, cwd=REPO_ROOT, stdout_path=OUT_DIR / "memory_stdout.txt", check=False)
            if m.returncode not in (0, 1):
                raise SystemExit(f"{name} failed ({m.returncode}): {' '.join(cmd)}")
            runs[name].append(m)
    summaries = {k: summarize(v) for k, v in runs.items()}
    floor = summaries["floor: import ckpt_cli.main"].peak_rss_bytes_median
    print(
        f"{a} ({fmt_bytes(dir_bytes(a))}); median of {args.repeat}, warm page cache; "
        f"CPU busy before: {busy if busy is None else f'{busy:.0%}'}"
    )
    for p, s in sizes.items():
        print(
            f"  largest tensor in {p}: stored {fmt_bytes(s['stored_bytes'])} ({s['stored']}), "
            f"logical {fmt_bytes(s['logical_bytes'])} ({s['logical']})"
        )
    print(
        f"{'command':<38} {'wall s':>7} {'CPU s':>6} {'peak RSS':>10} {'RSS - floor':>11} "
        f"{'largest stored':>14} {'largest logical':>15}"
    )
    rows = {}
    for name, s in summaries.items():
        size = sizes.get(commands[name][1])
        over = s.peak_rss_bytes_median - floor
        print(
            f"{name:<38} {s.wall_s_median:>7.2f} {s.cpu_s_median:>6.2f} {fmt_bytes(s.peak_rss_bytes_median):>10} "
            f"{fmt_bytes(over):>11} {fmt_bytes(size['stored_bytes']) if size else '':>14} "
            f"{fmt_bytes(size['logical_bytes']) if size else '':>15}"
        )
        cmd = commands[name][0]
        rows[name] = {
            "command": cmd[3:] if cmd[1:3] == ["-c", CLI] else cmd[1:],
            "rss_minus_floor_bytes": over,
            "largest": size,
            **s.to_dict(),
        }
    result = {
        "checkpoint": str(a),
        "bytes": dir_bytes(a),
        "pipe": str(args.pipe),
        "repeat": args.repeat,
        "cpu_busy": busy,
        "machine": machine_info(),
        "floor_rss_bytes": floor,
        "results": rows,
    }
    (OUT_DIR / "memory_results.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
