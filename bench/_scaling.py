"""One command measured at 1, 2, 4, ... processes, what bench_to_universal.py and bench_convert.py share.

Each run is a separate process tree (`_util.run_measured`: wall from spawn to exit, CPU seconds of the whole tree,
peak RSS of its largest process), with the machine's load read just before it. Every run of one command writes
the same OUT path (a DCP `.metadata` names its path), its files are hashed after the timing and deleted, and the
hashes of each N-process output are compared with the 1-process one's: one output on disk at a time, and a fast
wrong answer cannot pass. Stdlib only (see _util).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable, Sequence

from _util import REPO_ROOT, cpu_busy_fraction, dir_bytes, fmt_bytes, run_measured


def parse_nprocs(text: str) -> list[int]:
    """`--nprocs 1,2,4` -> [1, 2, 4]; 1 is always measured first (the reference of speed-up and bytes)."""
    counts = sorted({int(x) for x in text.split(",") if x.strip()})
    if not counts or counts[0] < 1:
        raise SystemExit(f"--nprocs: counts of processes, at least 1 (got {text!r})")
    return counts if counts[0] == 1 else [1, *counts]


def tree_digest(root: Path) -> dict[str, str]:
    """Every file under `root` (or `root` itself): relative path -> sha256 of its bytes."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            while chunk := fh.read(8 << 20):
                h.update(chunk)
        out[str(f.relative_to(root)) if f != root else f.name] = h.hexdigest()
    return out


def load_now() -> dict:
    """How busy the machine is just before a run: the CPUs over half a second (/proc/stat) and the load average."""
    busy = cpu_busy_fraction()
    return {
        "cpu_busy_before": None if busy is None else round(busy, 3),
        "loadavg_before": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def measure_once(cmd: Sequence[str], out: Path, *, nproc: int, env: dict | None = None) -> dict:
    """One measured run of `cmd` that writes `out`; its figures (out is left for the caller to check and delete)."""
    before = load_now()
    m = run_measured(cmd, cwd=REPO_ROOT, env=env)
    written = dir_bytes(out) if out.exists() else 0
    return {
        "processes": nproc,
        "wall_s": round(m.wall_s, 3),
        "cpu_s": round(m.cpu_s, 3),
        "peak_rss_bytes": m.peak_rss_bytes,  # of the largest process of the tree (ru_maxrss)
        "output_bytes": written,
        "bytes_per_s": round(written / m.wall_s) if m.wall_s else None,
        "bytes_per_s_per_process": round(written / m.wall_s / nproc) if m.wall_s else None,
        **before,
        "command": [str(c) for c in cmd],
    }


def remove(out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()


def scaling(
    label: str,
    command: Callable[[int, Path], list[str]],
    out: Path,
    nprocs: list[int],
    *,
    env: dict | None = None,
) -> dict[str, dict]:
    """`command(n, out)` at each count of `nprocs` (1 first): rows named "<label>, N process(es)", each with its
    speed-up over 1 process, parallel efficiency (speed-up / N) and, for N > 1, whether its output has the same
    bytes as the 1-process one. `out` is deleted after each run."""
    rows: dict[str, dict] = {}
    ref_digest: dict[str, str] | None = None
    ref_wall = None
    for n in nprocs:
        name = f"{label}, {n} process{'es' if n > 1 else ''}"
        remove(out)
        try:
            row = measure_once(command(n, out), out, nproc=n, env=env)
            digest = tree_digest(out)
        finally:
            remove(out)
        if ref_digest is None:
            ref_digest, ref_wall = digest, row["wall_s"]
        else:
            row["same_bytes_as_1_process"] = digest == ref_digest
        row["files"] = len(digest)
        row["speedup_vs_1_process"] = round(ref_wall / row["wall_s"], 3)
        row["parallel_efficiency"] = round(row["speedup_vs_1_process"] / n, 3)
        rows[name] = row
        print_row(name, row)
    return rows


def print_row(name: str, row: dict) -> None:
    same = row.get("same_bytes_as_1_process")
    print(
        f"{name:44s} {row['wall_s']:8.2f} s  cpu {row['cpu_s']:7.2f} s  {fmt_bytes(row['peak_rss_bytes']):>10s}  "
        f"out {fmt_bytes(row['output_bytes']):>10s}  {fmt_bytes(row['bytes_per_s'] or 0)}/s"
        + (
            f"  x{row['speedup_vs_1_process']:.2f} eff {row['parallel_efficiency']:.2f}"
            if "speedup_vs_1_process" in row
            else ""
        )
        + ("" if same is None else f"  same bytes: {same}")
        + f"  (busy before {row['cpu_busy_before']})",
        flush=True,
    )


def floor(src: Path, out: Path) -> dict:
    """`cp -r` of the source, then `sync -f` of the output's file system (the converters fsync what they write):
    the floor every conversion is compared with. `out` is deleted after."""
    remove(out)
    try:
        row = measure_once(["sh", "-c", 'cp -r "$0" "$1" && sync -f "$1"', str(src), str(out)], out, nproc=1)
    finally:
        remove(out)
    print_row("cp -r + sync", row)
    return row
