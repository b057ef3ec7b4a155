"""`ckpt to-universal` vs DeepSpeed's `ds_to_universal`, and `ckpt export` vs `zero_to_fp32`, vs `cp -r`, in one run.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6   # once (~2.2 GB, 581 tensors, DP=2)
    python bench/bench_to_universal.py [--ckpt bench/out/zero2_2g] [--workers 2]

Every command is a separate process timed from spawn to exit (imports included) with its peak RSS
(`bench/_util.run_measured`: ru_maxrss of that child and the grandchildren it reaped, so DeepSpeed's
worker pool counts at the size of its largest process). Outputs are deleted after each run; the page cache
is warm for every contender (the source is read once by `cp -r` first). Results: stdout table and
bench/out/to_universal_results.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import OUT_DIR, REPO_ROOT, dir_bytes, fmt_bytes, machine_info, run_measured  # noqa: E402

PY = sys.executable


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "zero2_2g")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument(
        "--scratch",
        type=Path,
        default=OUT_DIR / "to_universal_scratch",
        help="where outputs go; put it (and --ckpt) on tmpfs to measure the converters without the disk",
    )
    ap.add_argument("--results", default="to_universal_results.json", help="file name under bench/out/")
    args = ap.parse_args()
    ck = args.ckpt.resolve()
    tag = (ck / "latest").read_text().strip()
    scratch = args.scratch.resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    w = str(args.workers)
    runs = {
        "cp -r": [["cp", "-r", str(ck), str(scratch / "cp")]],
        "ckpt to-universal": [
            [PY, "-m", "ckpt_cli.main", "to-universal", str(ck), str(scratch / "ckpt_u"), "--workers", w, "--json"]
        ],
        "ckpt to-universal (1 worker)": [
            [PY, "-m", "ckpt_cli.main", "to-universal", str(ck), str(scratch / "ckpt_u1"), "--workers", "1", "--json"]
        ],
        "ds_to_universal": [
            [
                PY,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(ck / tag),
                "--output_folder",
                str(scratch / "ds_u" / f"{tag}_universal"),
                "--inject_missing_state",
                "--num_extract_workers",
                w,
                "--num_merge_workers",
                w,
            ]
        ],
        "ckpt export (fp32, safetensors)": [
            ["mkdir", "-p", str(scratch / "ckpt_e")],  # export writes into a folder
            [PY, "-m", "ckpt_cli.main", "export", str(ck), str(scratch / "ckpt_e" / "model.safetensors"), "--json"],
        ],
        "zero_to_fp32 (safetensors)": [
            [PY, "-m", "deepspeed.utils.zero_to_fp32", str(ck), str(scratch / "ds_e"), "--safe_serialization"]
        ],
    }
    if args.skip_deepspeed:
        runs = {k: v for k, v in runs.items() if "ds_" not in k and "zero_to" not in k}
    results = {}
    for name, cmds in runs.items():
        out_dir = None
        for cmd in cmds:
            m = run_measured(cmd, cwd=REPO_ROOT)
            out_dir = Path(cmd[-1] if "cp" == cmd[0] else next(a for a in cmd if str(scratch) in a))
            while out_dir.parent != scratch:
                out_dir = out_dir.parent
            results[name] = {
                "wall_s": round(m.wall_s, 2),
                "cpu_s": round(m.cpu_s, 2),
                "peak_rss_bytes": m.peak_rss_bytes,
                "output_bytes": dir_bytes(out_dir),
            }
        print(
            f"{name:34s} {results[name]['wall_s']:8.2f} s  cpu {results[name]['cpu_s']:6.2f} s  "
            f"{fmt_bytes(results[name]['peak_rss_bytes']):>10s}  out {fmt_bytes(results[name]['output_bytes'])}",
            flush=True,
        )
        if out_dir is not None:
            shutil.rmtree(out_dir, ignore_errors=True)
    shutil.rmtree(scratch, ignore_errors=True)
    doc = {
        "checkpoint": str(ck),
        "checkpoint_bytes": dir_bytes(ck),
        "workers": args.workers,
        "machine": machine_info(),
        "results": results,
    }
    r = results
    if "ds_to_universal" in r:
        doc["to_universal_speedup_vs_deepspeed"] = r["ds_to_universal"]["wall_s"] / r["ckpt to-universal"]["wall_s"]
        doc["to_universal_rss_ratio_vs_deepspeed"] = (
            r["ckpt to-universal"]["peak_rss_bytes"] / r["ds_to_universal"]["peak_rss_bytes"]
        )
        doc["export_speedup_vs_zero_to_fp32"] = (
            r["zero_to_fp32 (safetensors)"]["wall_s"] / r["ckpt export (fp32, safetensors)"]["wall_s"]
        )
        doc["export_rss_ratio_vs_zero_to_fp32"] = (
            r["ckpt export (fp32, safetensors)"]["peak_rss_bytes"] / r["zero_to_fp32 (safetensors)"]["peak_rss_bytes"]
        )
    doc["to_universal_vs_cp"] = r["ckpt to-universal"]["wall_s"] / r["cp -r"]["wall_s"]
    doc["scratch"] = str(scratch)
    (OUT_DIR / args.results).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("results", "machine")}, indent=1))


if __name__ == "__main__":
    main()
