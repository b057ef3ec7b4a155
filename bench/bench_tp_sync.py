"""Benchmark: `ckpt check-tp-sync` against full-load comparisons of the TP replicas, side by side.

    python -m torch.distributed.run --standalone --nproc_per_node 4 bench/make_big_pipeline.py \
        --out bench/out/pipe_100m --hidden 1024 --layers 8          # once (~1.4 GB, TP=2 x PP=2)
    python bench/bench_tp_sync.py [--ckpt bench/out/pipe_100m] [--repeat 3]

Each command is its own process, timed from spawn to exit with its peak RSS (`bench/_util.py`):

- `ckpt check-tp-sync PATH --json`: every TP-replicated parameter in bf16, fp32 master, exp_avg and
  exp_avg_sq, reading only those tensors' bytes;
- "layer files" — what Megatron-DeepSpeed's compare_tp_weights-style tools do: `torch.load` every
  `layer_*-model_*` file of both TP ranks and compare the replicated tensors (bf16 weights only);
- "layer + optimizer files" — the same coverage as check-tp-sync done the full-load way: also
  `torch.load` every ZeRO optimizer file and un-flatten the fp32 master / moments of the replicated
  parameters through `param_slice_mappings`.

Every command prints the set of (parameter, representation) pairs it found differing; the script checks
that the full-load answer for the same coverage equals check-tp-sync's. Runs are interleaved; the table
shows medians (min-max). Results go to bench/out/tp_sync_results.json.
"""

from __future__ import annotations

import argparse
import json
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
    drop_caches,  # noqa: E402
    fmt_bytes,
    machine_info,
    precompile,
    run_measured,
    summarize,
)

# The full-load reference. Replicated parameters are named by the checkpoint's own
# universal_checkpoint_info patterns (re.match, as DeepSpeed does), so both sides compare the same set.
FULL_LOAD = r"""
import glob, json, os, re, sys
import torch

tag, with_optim = sys.argv[1], sys.argv[2] == "1"
ms0 = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False, map_location="cpu")
pats = ms0["universal_checkpoint_info"]["tp_replicated_parameter_patterns"]
tp = ms0["args"].tensor_model_parallel_size
replicated = lambda name: any(re.match(p, name) for p in pats)
found = set()
layers = sorted({int(re.match(r"layer_(\d+)-", os.path.basename(f))[1]) for f in glob.glob(f"{tag}/layer_*-model_*")})
for lay in layers:
    sds = [torch.load(f"{tag}/layer_{lay:02d}-model_{t:02d}-model_states.pt", map_location="cpu", weights_only=True)
           for t in range(tp)]
    for key, ref in sds[0].items():
        name = f"{lay}.{key}"
        if replicated(name) and any(not torch.equal(sd[key], ref) for sd in sds[1:]):
            found.add((name, "bf16"))
if with_optim:
    mp = ms0["mp_world_size"]
    for stage in range(mp // tp):
        per_tp = []
        for t in range(tp):
            files = sorted(glob.glob(f"{tag}/*zero_pp_rank_*_mp_rank_{stage * tp + t:02d}_optim_states.pt"))
            assert len(files) == 1, "this reference handles DP=1"
            osd = torch.load(files[0], weights_only=False, map_location="cpu")["optimizer_state_dict"]
            vals = {}
            for g, mapping in enumerate(osd["param_slice_mappings"]):
                flats = {"fp32": osd["single_partition_of_fp32_groups"][g],
                         "exp_avg": osd["base_optimizer_state"]["state"][g]["exp_avg"],
                         "exp_avg_sq": osd["base_optimizer_state"]["state"][g]["exp_avg_sq"]}
                for name, frag in mapping.items():
                    if replicated(name):
                        for k, flat in flats.items():
                            vals[(name, k)] = flat.narrow(0, frag.start, frag.numel)
            per_tp.append(vals)
        for key, ref in per_tp[0].items():
            if any(not torch.equal(v[key], ref) for v in per_tp[1:]):
                found.add(key)
print(json.dumps(sorted(found)))
"""


def ours_found(stdout: Path) -> list:
    doc = json.loads(stdout.read_text())
    return sorted([p["name"], d["representation"]] for p in doc["params"] for d in p["diffs"] if not d["bit_exact"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, default=OUT_DIR / "pipe_400m")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    args = ap.parse_args()
    tag = args.ckpt / (args.ckpt / "latest").read_text().strip()
    ref = Path(tempfile.mkdtemp()) / "full_load.py"
    ref.write_text(FULL_LOAD)
    py = sys.executable
    precompile()
    commands = {
        "ckpt check-tp-sync --json": [*ckpt_command(), "check-tp-sync", str(args.ckpt), "--json"],
        "full load: layer files (bf16 only)": [py, str(ref), str(tag), "0"],
        "full load: layer + optimizer files": [py, str(ref), str(tag), "1"],
        "python -c pass": [py, "-c", "pass"],
    }
    modes = ["warm"] + (["cold"] if not args.no_cold and drop_caches() else [])
    outs = {k: OUT_DIR / f"tp_sync_stdout_{i}.txt" for i, k in enumerate(commands)}
    busy = cpu_busy_fraction()
    result = {
        "checkpoint": str(args.ckpt),
        "bytes": dir_bytes(args.ckpt),
        "repeat": args.repeat,
        "cpu_busy": busy,
        "machine": machine_info(),
        "modes": modes,
        "results": {},
    }
    for mode in modes:
        runs: dict[str, list] = {k: [] for k in commands}
        if mode == "warm":
            for cmd in commands.values():
                run_measured(cmd, cwd=REPO_ROOT, check=False)
        for _ in range(args.repeat):
            for name, cmd in commands.items():
                if mode == "cold" and not drop_caches():
                    raise SystemExit("drop_caches stopped working mid-run")
                # check-tp-sync exits 1 when it finds drift: that is its answer, not a failure
                runs[name].append(run_measured(cmd, cwd=REPO_ROOT, stdout_path=outs[name], check=False))
                if runs[name][-1].returncode not in (0, 1):
                    raise SystemExit(f"{name} failed ({runs[name][-1].returncode}); see {outs[name]}")
        found = {"ckpt check-tp-sync --json": ours_found(outs["ckpt check-tp-sync --json"])}
        for name in ("full load: layer files (bf16 only)", "full load: layer + optimizer files"):
            # unpickling DeepSpeed's optimizer files imports deepspeed, which prints to stdout: the answer is last
            found[name] = [list(x) for x in json.loads(outs[name].read_text().strip().splitlines()[-1])]
        agree = found["ckpt check-tp-sync --json"] == found["full load: layer + optimizer files"]
        summaries = {k: summarize(v) for k, v in runs.items()}
        base = summaries["ckpt check-tp-sync --json"]
        print(
            f"checkpoint {args.ckpt} ({fmt_bytes(dir_bytes(args.ckpt))}), {mode} page cache, median of "
            f"{args.repeat}; CPU busy before: {busy if busy is None else f'{busy:.0%}'}"
        )
        print(
            f"{'command':<38} {'wall s':>18} {'cpu s':>6} {'peak RSS':>10} {'x ckpt wall':>11} {'x ckpt RSS':>10}"
            "  found"
        )
        for name, s in summaries.items():
            f = found.get(name)
            print(
                f"{name:<38} {s.wall_s_median:>7.3f} ({s.wall_s_min:.2f}-{s.wall_s_max:.2f}) {s.cpu_s_median:>6.2f} "
                f"{fmt_bytes(s.peak_rss_bytes_median):>10} {s.wall_s_median / base.wall_s_median:>11.1f} "
                f"{s.peak_rss_bytes_median / base.peak_rss_bytes_median:>10.1f}  "
                f"{'' if f is None else f'{len(f)} differing: ' + ', '.join(f'{n} {r}' for n, r in f)}"
            )
        print(f"check-tp-sync's findings == the full load of the same coverage: {agree}\n")
        result["results"][mode] = {
            "found": found,
            "agree": agree,
            "summaries": {k: s.to_dict() for k, s in summaries.items()},
        }
        if not agree:
            raise SystemExit("check-tp-sync disagrees with the full-load comparison")
    (OUT_DIR / "tp_sync_results.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
