"""Benchmark: the whole `ckpt inspect` process against what people run today, side by side, in one run.

    python bench/make_big_zero.py --out bench/out/zero2_200m --params 14e6    # once
    python bench/make_big_zero.py --out bench/out/zero2_2g --params 150e6     # once
    python bench/bench_inspect.py                                              # table + bench/out/inspect_results.json

The tensor-count series (the same ~0.27 GB of bytes in ever more tensors) and a many-file pipeline:

    for L in 192 768 1536; do python bench/make_big_zero.py --out bench/out/L$L --params 20e6 --layers $L; done
    python -m torch.distributed.run --standalone --nproc_per_node 8 bench/make_big_pipeline.py \
        --out bench/out/pipe_dp2_l96 --hidden 64 --layers 96 --dp 2          # TP=2 x PP=2 x DP=2, 400+ files
    python bench/bench_inspect.py --ckpt bench/out/L192 --ckpt bench/out/L768 --ckpt bench/out/L1536 \
        --ckpt bench/out/pipe_dp2_l96

`--before DIR` also runs `ckpt inspect --json` from another source tree (DIR holding `ckpt_tools/` and `ckpt_cli`, e.g.
`git archive HEAD ckpt_tools cli | tar -x -C DIR && ln -s cli DIR/ckpt_cli`), interleaved with the rest, and fails
unless its output is byte-identical to this tree's.

With checkpoints of several tensor counts the script fits the cost per tensor (least squares of the median
wall time on the tensor count, over the `--series` checkpoints: by default those whose names start with L).

For each checkpoint, every command runs as its own process and is timed from spawn to exit (interpreter
start and imports included: that is what a user waits for), with the child's peak RSS from `wait4`:

- `ckpt inspect PATH --json` and `ckpt inspect PATH` (the rich header and tree, written to a file);
- the reference: Megatron-DeepSpeed's `tools/inspect_checkpoint.py` (`torch.load(f, map_location="cpu")`,
  then a recursive walk that prints every key, each tensor's shape and every other value), applied to every
  `*.pt` file of the tag folder in one process, one file at a time. `weights_only=False` is spelled out
  because torch >= 2.6 defaults to True, which rejects DeepSpeed's optimizer files; unpickling them imports
  deepspeed, as it does for the real tool;
- `python -c pass`, the floor any Python CLI pays.

Runs are interleaved (run 1 of every command, then run 2, ...) so that drift on a shared machine hits all
commands alike; tables report the median of N (min-max beside it). Cold runs drop the page cache before
each run (needs root and a writable /proc/sys/vm/drop_caches; the script says when it cannot and reports
warm only). Cold means everything is cold: the checkpoint files *and* Python's own modules (torch,
typer, rich), which is what the first command after a reboot or on a fresh node sees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._util import (
    OUT_DIR,
    REPO_ROOT,
    cpu_busy_fraction,
    dir_bytes,
    drop_caches,  # noqa: E402
    fmt_bytes,
    machine_info,
    precompile,
    run_measured,
    summarize,
    wait_for_idle,
    ckpt_command,
)

DEFAULT_CKPTS = ("zero2_200m", "zero2_2g")
TARGET_S = 0.4  # the target for the whole `ckpt inspect` process at 18.4k tensors
PER_TENSOR_TARGET_US = 15.0

# Megatron-DeepSpeed tools/inspect_checkpoint.py, looped over the tag folder's files. Kept verbatim in
# spirit: type() checks, not isinstance (so OrderedDict/argparse etc. fall to "[other]" and get str()'d).
REFERENCE = r"""
import os, sys
from collections import OrderedDict
import torch

def dump_data(datum, name_list=[]):
    if type(datum) in (dict, OrderedDict):
        for k, v in datum.items():
            dump_data(v, name_list + [str(k)])
    elif type(datum) in (list, tuple):
        for v in datum:
            dump_data(v, name_list)
    elif torch.is_tensor(datum):
        prefix = '.'.join(name_list)
        print(f'[tensor] {prefix} = {datum.shape}')
    else:
        prefix = '.'.join(name_list)
        print(f'[other] {prefix} = {datum}')

tag_dir = sys.argv[1]
for name in sorted(os.listdir(tag_dir)):
    if name.endswith('.pt'):
        ckpt_file = os.path.join(tag_dir, name)
        print(f'loading checkpoint file: {ckpt_file}')
        sd = torch.load(ckpt_file, map_location=torch.device('cpu'), weights_only=False)
        dump_data(sd)
        del sd
"""


def tag_dir(ckpt: Path) -> Path:
    """The folder holding the .pt files: `<ckpt>/<contents of latest>`, or `ckpt` itself."""
    latest = ckpt / "latest"
    return ckpt / latest.read_text().strip() if latest.is_file() else ckpt


BEFORE = "before: ckpt inspect --json"


def commands(ckpt: Path, before: Path | None = None) -> dict[str, list[str]]:
    cmds = {
        "ckpt inspect --json": [*ckpt_command(), "inspect", str(ckpt), "--json"],
        "ckpt inspect": [*ckpt_command(), "inspect", str(ckpt)],
        "reference (torch.load + walk)": [sys.executable, "-c", REFERENCE, str(tag_dir(ckpt))],
        "python -c pass": [sys.executable, "-c", "pass"],
    }
    if before is not None:  # the same `ckpt inspect --json`, run from the source tree `before` (PYTHONPATH)
        cmds[BEFORE] = cmds["ckpt inspect --json"]
    return cmds


def check_json(out_file: Path, ckpt: Path) -> dict:
    """`ckpt inspect --json` must have said something true, or its speed means nothing: compare with the
    manifest the training run wrote beside the checkpoint."""
    doc = json.loads(out_file.read_text())
    manifest = ckpt.with_name(ckpt.name + ".manifest.json")
    if manifest.is_file():
        m = json.loads(manifest.read_text())
        got = (doc["parameters"]["count"], doc["parameters"]["tensors"], doc["counters"]["global_step"])
        want = (m["parameters"]["count"], m["parameters"]["tensors"], m["counters"]["global_step"])
        if got != want:
            raise RuntimeError(
                f"ckpt inspect --json on {ckpt}: (params, tensors, global_step) {got} != manifest {want}"
            )
    return doc


def run(
    ckpts: list[Path], *, repeat: int, modes: list[str], wait_idle_s: float, before: Path | None = None
) -> list[dict]:
    rows = []
    env_before = dict(os.environ, PYTHONPATH=str(before)) if before is not None else None
    for mode in modes:
        plan = [(ck, name, cmd) for ck in ckpts for name, cmd in commands(ck, before).items()]
        if mode == "warm":  # one untimed run each: the files and modules are in the page cache after it
            for ck, name, cmd in plan:
                run_measured(cmd, cwd=REPO_ROOT, env=env_before if name == BEFORE else None)
        runs: dict[tuple[Path, str], list] = {(ck, name): [] for ck, name, _ in plan}
        shape: dict[Path, tuple[int, int]] = {}
        busy: dict[tuple[Path, str], list] = {(ck, name): [] for ck, name, _ in plan}
        for i in range(repeat):
            for ck, name, cmd in plan:
                # Other jobs on a shared machine stretch wall times: wait a little for a quiet moment and
                # record how busy the CPUs were just before each run.
                b = wait_for_idle(max_wait_s=wait_idle_s) if wait_idle_s > 0 else cpu_busy_fraction(0.2)
                busy[(ck, name)].append(b)
                if mode == "cold" and not drop_caches():
                    raise RuntimeError("drop_caches stopped working mid-run")
                out = OUT_DIR / f"inspect_stdout_{ck.name}{'_before' if name == BEFORE else ''}.txt"
                m = run_measured(cmd, cwd=REPO_ROOT, stdout_path=out, env=env_before if name == BEFORE else None)
                if name == "ckpt inspect --json" and i == 0:
                    doc = check_json(out, ck)
                    shape[ck] = (doc["parameters"]["tensors"], len(doc["files"]))
                    shutil.copyfile(out, OUT_DIR / f"inspect_json_{ck.name}.txt")
                if (
                    name == BEFORE
                    and i == 0
                    and out.read_bytes() != (OUT_DIR / f"inspect_json_{ck.name}.txt").read_bytes()
                ):
                    raise RuntimeError(
                        f"{ck}: `ckpt inspect --json` from {before} is not byte-identical to this tree's"
                    )
                runs[(ck, name)].append(m)
                print(
                    f"  {mode} run {i + 1}/{repeat} {ck.name:<12} {name:<30} {m.wall_s:7.3f} s wall "
                    f"{m.cpu_s:7.3f} s cpu {fmt_bytes(m.peak_rss_bytes):>10}  (CPUs {_pct(b)} busy before)",
                    file=sys.stderr,
                )
        for (ck, name), ms in runs.items():
            rows.append(
                {
                    "checkpoint": ck.name,
                    "path": str(ck),
                    "bytes": dir_bytes(tag_dir(ck)),
                    "cache": mode,
                    "tensors": shape[ck][0],
                    "files": shape[ck][1],
                    "tool": name,
                    "cmd": commands(ck, before)[name],
                    "cpu_busy_before": busy[(ck, name)],
                    **summarize(ms).to_dict(),
                }
            )
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """reference / `ckpt inspect --json` (wall and RSS) per checkpoint and cache state, and how flat the
    ckpt numbers are across sizes (largest / smallest checkpoint)."""
    by = {(r["checkpoint"], r["cache"], r["tool"]): r for r in rows}
    out = []
    for (ck, mode, tool), r in by.items():
        if tool != "reference (torch.load + walk)":
            continue
        for mine in ("ckpt inspect --json", "ckpt inspect", BEFORE):
            c = by.get((ck, mode, mine))
            if c is None:
                continue
            out.append(
                {
                    "checkpoint": ck,
                    "cache": mode,
                    "vs": mine,
                    "wall_ratio": r["wall_s_median"] / c["wall_s_median"],
                    "rss_ratio": r["peak_rss_bytes_median"] / c["peak_rss_bytes_median"],
                }
            )
    return out


def flatness(rows: list[dict]) -> list[dict]:
    out = []
    for mode in sorted({r["cache"] for r in rows}):
        for tool in ("ckpt inspect --json", "ckpt inspect", "reference (torch.load + walk)"):
            rs = sorted((r for r in rows if r["cache"] == mode and r["tool"] == tool), key=lambda r: r["bytes"])
            if len(rs) >= 2:
                lo, hi = rs[0], rs[-1]
                out.append(
                    {
                        "cache": mode,
                        "tool": tool,
                        "bytes_ratio": hi["bytes"] / lo["bytes"],
                        "wall_ratio": hi["wall_s_median"] / lo["wall_s_median"],
                        "rss_ratio": hi["peak_rss_bytes_median"] / lo["peak_rss_bytes_median"],
                    }
                )
    return out


def per_tensor(rows: list[dict], series: str) -> list[dict]:
    """Cost per tensor: the least-squares slope of the median wall (and CPU) time on the tensor count, over the
    checkpoints whose names start with `series` (the same bytes in more and more tensors), per tool."""
    out = []
    for mode in sorted({r["cache"] for r in rows}):
        for tool in ("ckpt inspect --json", "ckpt inspect", "reference (torch.load + walk)", BEFORE):
            rs = [r for r in rows if r["cache"] == mode and r["tool"] == tool and r["checkpoint"].startswith(series)]
            if len({r["tensors"] for r in rs}) < 2:
                continue
            xs = [r["tensors"] for r in rs]
            fit = {}
            for key in ("wall_s_median", "cpu_s_median"):
                ys = [r[key] for r in rs]
                mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
                slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
                fit[key] = (slope * 1e6, my - slope * mx)
            out.append(
                {
                    "cache": mode,
                    "tool": tool,
                    "checkpoints": [r["checkpoint"] for r in rs],
                    "tensors": xs,
                    "us_per_tensor_wall": fit["wall_s_median"][0],
                    "intercept_s_wall": fit["wall_s_median"][1],
                    "us_per_tensor_cpu": fit["cpu_s_median"][0],
                    "intercept_s_cpu": fit["cpu_s_median"][1],
                }
            )
    return out


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{x:.0%}"


def print_table(rows: list[dict], rat: list[dict], flat: list[dict], repeat: int, fits: list[dict] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False, width=max(150, shutil.get_terminal_size().columns))
    t = Table(title=f"whole process, spawn to exit: median of {repeat} runs", show_edge=False)
    for col in (
        "checkpoint",
        "tensors",
        "files",
        "cache",
        "command",
        "wall s",
        "min-max",
        "cpu s",
        "peak RSS",
        "ref/this wall",
        "busy",
    ):
        t.add_column(col, justify="left" if col in ("checkpoint", "cache", "command") else "right")
    ref = {(r["checkpoint"], r["cache"]): r for r in rows if r["tool"] == "reference (torch.load + walk)"}
    for r in rows:
        rr = ref[(r["checkpoint"], r["cache"])]
        wall = f"{r['wall_s_median']:.3f}"
        if r["tool"].startswith("ckpt"):
            wall = f"[{'green' if r['wall_s_median'] <= TARGET_S else 'red'}]{wall}[/]"
        busy = [b for b in r["cpu_busy_before"] if b is not None]
        t.add_row(
            f"{r['checkpoint']} ({fmt_bytes(r['bytes'])})",
            f"{r['tensors']:,}",
            str(r["files"]),
            r["cache"],
            r["tool"],
            wall,
            f"{r['wall_s_min']:.3f}-{r['wall_s_max']:.3f}",
            f"{r['cpu_s_median']:.3f}",
            fmt_bytes(r["peak_rss_bytes_median"]),
            "" if r is rr else f"{rr['wall_s_median'] / r['wall_s_median']:.1f}x",
            _pct(max(busy)) if busy else "?",
        )
    con.print(t)
    con.print(
        "[dim]busy: the highest CPU load seen just before a run (other jobs on the machine); "
        f"green/red: within/over the {TARGET_S} s target[/]"
    )
    for f in flat:
        con.print(
            f"{f['cache']:>4} {f['tool']:<30} largest/smallest checkpoint: bytes x{f['bytes_ratio']:.1f} -> "
            f"wall x{f['wall_ratio']:.2f}, RSS x{f['rss_ratio']:.2f}"
        )
    for r in rat:
        con.print(
            f"{r['cache']:>4} {r['checkpoint']:<12} reference / {r['vs']:<20} wall {r['wall_ratio']:6.1f}x  "
            f"RSS {r['rss_ratio']:6.1f}x"
        )
    for f in fits:
        ok = f["us_per_tensor_wall"] <= PER_TENSOR_TARGET_US
        con.print(
            f"{f['cache']:>4} {f['tool']:<30} per tensor ({', '.join(f['checkpoints'])}): "
            f"[{'green' if ok or not f['tool'].startswith('ckpt') else 'red'}]{f['us_per_tensor_wall']:.1f} us[/] "
            f"wall, {f['us_per_tensor_cpu']:.1f} us CPU (intercept {f['intercept_s_wall']:.3f} s)"
        )


# Where the time of `ckpt inspect --json` goes, phase by phase, inside one process (the interpreter's own
# start is `python -c pass` in the main table). Each phase is timed once, in the order the CLI runs them.
PHASES = r"""
import io, json, sys, time
t = [time.perf_counter()]
def lap(): t.append(time.perf_counter())
import ckpt_cli.main; ckpt_cli.main.tune_gc(); lap()               # typer, the CLI modules, ckpt_tools (no torch)
a = ckpt_cli.main._fast_parse(["inspect", sys.argv[1], "--json"]); lap()  # option parsing (argparse fast path)
from ckpt_tools import open_checkpoint
from ckpt_tools.ops import inspect as ops
ck = open_checkpoint(sys.argv[1]); lap()                 # format modules + reading the pickles
doc = ops.summary(ck, ops.filter_tree(ck.tree), None); lap()
s1 = json.dumps(doc, default=repr); lap()                # what ckpt_cli.output.print_json does when piped
from ckpt_cli import output
con = output.console(); con.file = io.StringIO(); lap()  # rich import (the human header)
lines = output.tree_lines(ck.tree, "tree"); lap()        # the human tree
names = ["import ckpt_cli.main", "parse options", "open_checkpoint", "summary + filter_tree", "json.dumps",
         "import rich Console", "render human tree"]
print(json.dumps({"phases": dict(zip(names, (b - a for a, b in zip(t, t[1:])))), "json_bytes": len(s1),
                  "tree_lines": len(lines)}))
"""


def phases(ckpts: list[Path], repeat: int) -> dict:
    """Median per phase over `repeat` fresh processes, per checkpoint."""
    import statistics

    out = {}
    for ck in ckpts:
        docs = []
        for _ in range(repeat):
            f = OUT_DIR / "inspect_phases.txt"
            run_measured([sys.executable, "-c", PHASES, str(ck)], cwd=REPO_ROOT, stdout_path=f)
            docs.append(json.loads(f.read_text()))
        out[ck.name] = {
            "phases_s": {k: statistics.median(d["phases"][k] for d in docs) for k in docs[0]["phases"]},
            "json_bytes": docs[0]["json_bytes"],
            "tree_lines": docs[0]["tree_lines"],
        }
    return out


def print_phases(ph: dict) -> None:
    names = list(next(iter(ph.values()))["phases_s"])
    print("\nphases inside one process (median), seconds")
    print(f"{'phase':<36}" + "".join(f"{ck:>14}" for ck in ph))
    for n in names:
        print(f"{n:<36}" + "".join(f"{ph[ck]['phases_s'][n]:14.3f}" for ck in ph))
    print(f"{'--json output bytes':<36}" + "".join(f"{ph[ck]['json_bytes']:14,}" for ck in ph))
    print(f"{'human tree lines':<36}" + "".join(f"{ph[ck]['tree_lines']:14,}" for ck in ph))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="ckpt inspect vs torch.load-and-walk, whole processes, one run.")
    p.add_argument(
        "--ckpt",
        type=Path,
        action="append",
        help=f"checkpoint folder (repeatable; default: bench/out/{{{','.join(DEFAULT_CKPTS)}}})",
    )
    p.add_argument("--repeat", "-n", type=int, default=3, help="runs per command and cache state (median)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs even if caches can be dropped")
    p.add_argument(
        "--wait-idle",
        type=float,
        default=20.0,
        metavar="S",
        help="before each run, wait up to S seconds for the CPUs to be < 20%% busy (0: don't)",
    )
    p.add_argument("--no-phases", action="store_true", help="skip the in-process phase breakdown")
    p.add_argument("--results", type=Path, default=OUT_DIR / "inspect_results.json")
    p.add_argument("--series", default="L", help="name prefix of the tensor-count series checkpoints (default L)")
    p.add_argument(
        "--before",
        type=Path,
        metavar="DIR",
        help="also run `ckpt inspect --json` from this source tree (DIR holding ckpt_tools/ and ckpt_cli), "
        "interleaved; fails unless its output is byte-identical to this tree's",
    )
    args = p.parse_args(argv)

    ckpts = [c.resolve() for c in (args.ckpt or [OUT_DIR / n for n in DEFAULT_CKPTS])]
    missing = [c for c in ckpts if not tag_dir(c).is_dir()]
    if missing:
        p.error(
            f"no checkpoint at {', '.join(map(str, missing))}: make it with bench/make_big_zero.py "
            "(see bench/README.md)"
        )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    can_drop = drop_caches()
    modes = ["warm"] + (["cold"] if can_drop and not args.no_cold else [])
    if not can_drop:
        print(
            "cannot drop the page cache here (needs root and a writable /proc/sys/vm/drop_caches): warm only",
            file=sys.stderr,
        )
    precompile()
    before = args.before.resolve() if args.before else None
    if before is not None:
        precompile(before)
    busy_start = cpu_busy_fraction(1.0)
    rows = run(ckpts, repeat=args.repeat, modes=modes, wait_idle_s=args.wait_idle, before=before)
    ph = {} if args.no_phases else phases(ckpts, args.repeat)
    rat, flat, fits = ratios(rows), flatness(rows), per_tensor(rows, args.series)
    args.results.write_text(
        json.dumps(
            {
                "benchmark": "inspect",
                "machine": machine_info(),
                "repeat": args.repeat,
                "target_s": TARGET_S,
                "drop_caches_works": can_drop,
                "modes": modes,
                "cpu_busy_at_start": busy_start,
                "cpu_busy_at_end": cpu_busy_fraction(1.0),
                "results": rows,
                "ratios": rat,
                "flatness": flat,
                "per_tensor": fits,
                "phases_warm": ph,
            },
            indent=1,
        )
        + "\n"
    )
    print_table(rows, rat, flat, args.repeat, fits)
    if ph:
        print_phases(ph)
    print(f"results: {args.results}")


if __name__ == "__main__":
    main()
