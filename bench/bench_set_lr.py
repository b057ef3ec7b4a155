"""Benchmark: `ckpt set-lr --scale 0.5 --yes` (in place, O(changed bytes)) on real DeepSpeed ZeRO-2 checkpoints of
0.2 GB and 2.2 GB, side by side in one run with the whole-file path (`--copy`), `cp` + `sync` of the files it
changes, and the by-hand way (torch.load / edit / torch.save of each file).

    python bench/make_big_zero.py --out bench/out/zero2_200m --params 14e6    # once (0.24 GB; reused if present)
    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6     # once (2.2 GB)
    python bench/bench_set_lr.py [--ckpt bench/out/zero2_200m --ckpt bench/out/zero2_2g] [--repeat 3]

Each command is its own process, timed from spawn to exit with its peak RSS (`bench/_util.py`):

- `ckpt set-lr --scale 0.5 --yes`: the whole transaction — plan (safe pickle read), the in-place change of every
  file holding an LR (a new data.pkl member + central directory appended; original bytes of the overwritten
  ranges journaled and fsynced outside the checkpoint first), fsync, re-verify with the reader. Its `--json`
  output says how many bytes it wrote into the checkpoint (`bytes_written`);
- `ckpt set-lr --scale 0.5 --yes --copy`: the whole-file path (each file rewritten into staging, hard-link
  backup, atomic rename): what every write cost before issue 14;
- `ckpt restore --yes` after each: puts the originals back (so every repeat starts from the same bytes);
- `cp` of exactly the files set-lr changes into a scratch folder on the same filesystem, then `sync`: the floor
  for "write a new copy of these bytes";
- by hand: `torch.load(weights_only=False)`, every param group's `lr`/`initial_lr` and the scheduler's LR lists
  scaled, `torch.save` to the scratch folder, per file (what a user would script).

Results go to bench/out/set_lr_results.json. Every checkpoint is left byte-identical (restore after each run).
`--check` (used once on a small checkpoint for correctness, not for figures) also checks that.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (
    OUT_DIR,
    REPO_ROOT,
    ckpt_command,
    cpu_busy_fraction,
    dir_bytes,
    fmt_bytes,  # noqa: E402
    machine_info,
    precompile,
    run_measured,
    summarize,
)

BY_HAND = r"""
import sys, torch
LR = ("lr", "initial_lr", "max_lr", "min_lr")
LISTS = ("base_lrs", "_last_lr")

def scale(o, depth=0):
    if depth > 50:
        return
    if isinstance(o, dict):
        for k, v in list(o.items()):
            if k in LR and isinstance(v, float):
                o[k] = v * 0.5
            elif k in LISTS and isinstance(v, list):
                o[k] = [x * 0.5 for x in v]
            else:
                scale(v, depth + 1)
    elif isinstance(o, (list, tuple)):
        for v in o:
            scale(v, depth + 1)

for src, dst in zip(sys.argv[1::2], sys.argv[2::2]):
    sd = torch.load(src, weights_only=False, map_location="cpu")
    scale(sd)
    torch.save(sd, dst)
"""


def _digest(files: list[Path]) -> dict[str, str]:
    out = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(16 << 20), b""):
                h.update(chunk)
        out[str(f)] = h.hexdigest()
    return out


def bench_one(ck: Path, repeat: int, check: bool) -> dict:
    py = sys.executable
    ckpt = ckpt_command()
    plan_out = OUT_DIR / "set_lr_plan.json"
    run_measured(
        [*ckpt, "set-lr", str(ck), "--scale", "0.5", "--dry-run", "--json"], cwd=REPO_ROOT, stdout_path=plan_out
    )
    plan = json.loads(plan_out.read_text())["plan"]
    root = Path(plan["root"])
    files = [root / f["path"] for f in plan["files"]]
    nbytes = sum(f.stat().st_size for f in files)
    before = _digest(files) if check else None
    scratch = Path(tempfile.mkdtemp(prefix=".bench-cp-", dir=root.parent))  # same filesystem as the checkpoint
    torch_files = [f for f in files if f.suffix in (".pt", ".bin", ".pth")]
    hand_args = [str(a) for f in torch_files for a in (f, scratch / f.name)]
    commands = {
        "ckpt set-lr (in place)": [*ckpt, "set-lr", str(ck), "--scale", "0.5", "--yes", "--json"],
        "ckpt restore (in place)": [*ckpt, "restore", str(ck), "--yes"],
        "ckpt set-lr --copy": [*ckpt, "set-lr", str(ck), "--scale", "0.5", "--yes", "--copy"],
        "ckpt restore (--copy)": [*ckpt, "restore", str(ck), "--yes"],
        "cp + sync": ["sh", "-c", 'cp "$@" ' + f"'{scratch}'" + " && sync", "cp", *map(str, files)],
        "by hand: torch.load/edit/save": [py, "-c", BY_HAND, *hand_args],
    }
    runs: dict[str, list] = {k: [] for k in commands}
    written, problems = [], []
    try:
        for _ in range(repeat):
            for name, cmd in commands.items():
                out = OUT_DIR / "set_lr_last.json"
                runs[name].append(run_measured(cmd, cwd=REPO_ROOT, stdout_path=out))
                if name == "ckpt set-lr (in place)":
                    doc = json.loads(out.read_text())
                    written.append(doc.get("bytes_written"))
                    if check and len(doc.get("in_place", [])) != len(files):
                        problems.append(f"not every file was changed in place: {doc.get('in_place')}")
                if check and name.startswith("ckpt restore") and _digest(files) != before:
                    problems.append(f"{name}: the checkpoint is not byte-identical after restore")
            for f in scratch.iterdir():
                f.unlink()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summaries = {k: summarize(v) for k, v in runs.items()}
    return {
        "checkpoint": str(ck),
        "bytes": dir_bytes(ck),
        "files": [str(f) for f in files],
        "file_bytes": nbytes,
        "bytes_written_in_place": written[-1] if written else None,
        "repeat": repeat,
        "results": {k: s.to_dict() for k, s in summaries.items()},
        "_summaries": summaries,
        "problems": problems,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--ckpt",
        type=Path,
        action="append",
        help="checkpoint (repeatable); default bench/out/zero2_200m and bench/out/zero2_2g",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--check", action="store_true", help="also check bytes after every restore (slower)")
    ap.add_argument("--out", type=Path, default=OUT_DIR / "set_lr_results.json")
    args = ap.parse_args()
    precompile()
    cks = args.ckpt or [OUT_DIR / "zero2_200m", OUT_DIR / "zero2_2g"]
    missing = [c for c in cks if not c.is_dir()]
    if missing:
        sys.exit(f"missing {', '.join(map(str, missing))}: make them with bench/make_big_zero.py (see the docstring)")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    busy = cpu_busy_fraction()
    results = [bench_one(c, args.repeat, args.check) for c in cks]
    print(
        f"set-lr --scale 0.5: warm page cache, median of {args.repeat} (min-max); CPU busy before: "
        f"{busy if busy is None else f'{busy:.0%}'}"
    )
    for r in results:
        s = r.pop("_summaries")
        base = s["cp + sync"].wall_s_median
        print(
            f"\n{r['checkpoint']} ({fmt_bytes(r['bytes'])}): set-lr changes {len(r['files'])} files "
            f"({fmt_bytes(r['file_bytes'])}); in place it writes {r['bytes_written_in_place']:,} bytes"
        )
        print(f"{'command':<32} {'wall s':>18} {'cpu s':>7} {'peak RSS':>10} {'x cp+sync':>9}")
        for name, m in s.items():
            print(
                f"{name:<32} {m.wall_s_median:>7.2f} ({m.wall_s_min:.2f}-{m.wall_s_max:.2f}) {m.cpu_s_median:>7.2f} "
                f"{fmt_bytes(m.peak_rss_bytes_median):>10} {m.wall_s_median / base:>9.2f}"
            )
        for p in r["problems"]:
            print(f"PROBLEM: {p}")
    if len(results) > 1:
        a, b = (r["results"]["ckpt set-lr (in place)"]["wall_s_median"] for r in (results[0], results[-1]))
        print(f"\nset-lr in place, largest / smallest checkpoint: {b / a:.2f}x wall")
    doc = {"machine": machine_info(), "cpu_busy": busy, "checkpoints": results}
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    if any(r["problems"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
