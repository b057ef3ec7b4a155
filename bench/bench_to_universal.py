"""`ckpt to-universal` at 1, 2, ... processes vs `cp -r` (the floor) and DeepSpeed's `ds_to_universal`, in one run.

    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6   # once (~2.2 GB, 581 tensors, DP=2)
    python bench/bench_to_universal.py [--ckpt bench/out/zero2_2g] [--nprocs 1,2] [--skip-deepspeed]
    python bench/bench_to_universal.py --nprocs 1,2,4,8,16 --skip-deepspeed     # the scaling table, 16 cores

Every command is a separate process tree timed from spawn to exit (imports included) with its CPU seconds and the
peak RSS of its largest process (`bench/_util.run_measured`), the machine's load read before it (`_scaling`).
1 process is `ckpt to-universal SRC OUT`; N > 1 is `--nproc N` (a one-node torchrun job: each rank converts a
share of the parameters balanced by bytes). Each N-process output is checked to have the same bytes as the
1-process one (sha256 of every file, after the timing); outputs are deleted after each run, so the scratch
folder holds one output at a time (ds_to_universal also keeps its extraction folder there while it runs). The page
cache is warm for every contender (`cp -r` reads the source first). Results: stdout table and
bench/out/to_universal_results.json (or --results), with bytes/s per process and parallel efficiency
(speed-up over 1 process / N).

`--with-export` adds `ckpt export` vs `zero_to_fp32` (the latter holds the whole model in memory: not at 20 GB
on a 24 GiB machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scaling import floor, measure_once, parse_nprocs, print_row, remove, scaling  # noqa: E402
from _util import OUT_DIR, dir_bytes, machine_info  # noqa: E402

PY = sys.executable
CKPT = [PY, "-m", "ckpt_cli.main"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "zero2_2g")
    ap.add_argument("--nprocs", default="1,2", help="counts of processes to measure, e.g. 1,2,4,8,16 (1 always)")
    ap.add_argument("--workers", type=int, default=1, help="threads per ckpt process (--workers); 1: processes only")
    ap.add_argument("--ds-workers", type=int, default=0, help="ds_to_universal's worker pools (default: max --nprocs)")
    ap.add_argument("--verify", action="store_true", help="run ckpt to-universal with --verify (split between ranks)")
    ap.add_argument("--skip-deepspeed", action="store_true", help="leave out ds_to_universal (and zero_to_fp32)")
    ap.add_argument("--with-export", action="store_true", help="also ckpt export vs zero_to_fp32 (whole model in RAM)")
    ap.add_argument(
        "--scratch",
        type=Path,
        default=OUT_DIR / "to_universal_scratch",
        help="where outputs go; put it (and --ckpt) on tmpfs to measure the converters without the disk",
    )
    ap.add_argument("--results", default="to_universal_results.json", help="file name under bench/out/ (or a path)")
    args = ap.parse_args()
    nprocs = parse_nprocs(args.nprocs)
    ck = args.ckpt.resolve()
    tag = (ck / "latest").read_text().strip()
    scratch = args.scratch.resolve()
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    out = scratch / "out"
    w = str(args.workers)

    def to_universal(n: int, dest: Path) -> list[str]:
        cmd = [*CKPT, "to-universal", str(ck), str(dest), "--workers", w, "--json"]
        return cmd + (["--verify"] if args.verify else []) + (["--nproc", str(n)] if n > 1 else [])

    results = {"cp -r + sync": floor(ck, out)}
    results.update(scaling("ckpt to-universal", to_universal, out, nprocs))
    if not args.skip_deepspeed:
        dw = str(args.ds_workers or max(nprocs))
        ds = [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ck / tag)]
        ds += ["--output_folder", str(out / f"{tag}_universal"), "--inject_missing_state"]
        ds += ["--num_extract_workers", dw, "--num_merge_workers", dw]
        remove(out)
        try:
            results["ds_to_universal"] = row = measure_once(ds, out, nproc=int(dw))
            print_row("ds_to_universal", row)
        finally:
            remove(out)
    if args.with_export:
        out.mkdir()
        try:
            row = measure_once([*CKPT, "export", str(ck), str(out / "model.safetensors"), "--json"], out, nproc=1)
            results["ckpt export (fp32, safetensors)"] = row
            print_row("ckpt export (fp32, safetensors)", row)
        finally:
            remove(out)
        if not args.skip_deepspeed:
            cmd = [PY, "-m", "deepspeed.utils.zero_to_fp32", str(ck), str(out), "--safe_serialization"]
            try:
                results["zero_to_fp32 (safetensors)"] = row = measure_once(cmd, out, nproc=1)
                print_row("zero_to_fp32 (safetensors)", row)
            finally:
                remove(out)
    shutil.rmtree(scratch, ignore_errors=True)

    one = results["ckpt to-universal, 1 process"]
    doc = {
        "checkpoint": str(ck),
        "checkpoint_bytes": dir_bytes(ck),
        "nprocs": nprocs,
        "workers_per_process": args.workers,
        "verify": args.verify,
        "scratch": str(scratch),
        "machine": machine_info(),
        "results": results,
        "to_universal_1_process_vs_cp": round(one["wall_s"] / results["cp -r + sync"]["wall_s"], 3),
    }
    if "ds_to_universal" in results:
        ds_row = results["ds_to_universal"]
        doc["speedup_vs_ds_to_universal"] = {
            name: round(ds_row["wall_s"] / r["wall_s"], 3)
            for name, r in results.items()
            if name.startswith("ckpt to-universal")
        }
    same = [r["same_bytes_as_1_process"] for r in results.values() if "same_bytes_as_1_process" in r]
    doc["all_outputs_same_bytes_as_1_process"] = all(same)
    path = Path(args.results) if "/" in args.results else OUT_DIR / args.results
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("results", "machine")}, indent=1))
    print(f"results: {path}")
    if not all(same):
        raise SystemExit("an N-process output differs from the 1-process one")


if __name__ == "__main__":
    main()
