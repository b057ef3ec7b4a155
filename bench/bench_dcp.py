"""Benchmark: `ckpt inspect` of DCP checkpoints at real item counts vs torch's own `FileSystemReader.read_metadata()`.

    python bench/bench_dcp.py --make                       # once: the checkpoints (bench/make_big_dcp.py)
    python bench/bench_dcp.py --repeat 3                   # table + bench/out/dcp_results.json
    python bench/bench_dcp.py --repeat 3 --s3              # the same read from a moto S3 server on 127.0.0.1

Checkpoints (`--make`, torch's own `dcp.save`, `make_big_dcp.py`): N parameters of 16 x 8 fp32 plus their Adam state
(4 items per parameter) from one process, at 10,013 / 100,013 / 120,013 items (`--params 2500,25000,30000`; and
`dcp_1m`, 1,000,013 items, when named: `--only dcp_1m`); one
from two gloo processes (each parameter an FSDP2-style DTensor sharded on dim 0: 7 chunks per parameter); and
`dcp_wide`, 500 parameters of 64 x 512 (128 KiB chunks: the Adam `step` items far apart, as in a real model).

Each command is a whole process, timed from spawn to exit with its peak RSS (`_util.run_measured`: GNU time's %M),
runs interleaved, medians of `--repeat`:

- `ckpt inspect CKPT --json` (its `details.items` checked against torch's count of `.metadata` keys);
- torch: `FileSystemReader(CKPT).read_metadata()` in a process that imports torch for it: the whole process, and
  the call alone as that process times it (`read_s`: what a process that has imported torch already pays);
- `--before DIR`: the same `ckpt inspect --json` from another source tree (DIR holding `ckpt_tools/` and the CLI as
  `ckpt_cli/`, e.g. `git archive` of an earlier commit; run with PYTHONPATH=DIR), its `--json` checked byte for byte
  against this tree's (over S3: all but the `remote` costs), interleaved with the rest;
- `--to-torch-save`: torch's `dcp_to_torch_save(CKPT, tmp)` (every item loaded and `torch.save`d: what a user
  without `ckpt` runs to look inside), its output removed each run;
- per-item cost: the least-squares slope of the medians over the one-process checkpoints (wall and CPU);
- `--s3`: `ckpt inspect s3://… --json` against a moto server (its own process; uploaded with s3fs first): wall
  time, and the bytes and GET requests `ckpt` reports fetching. moto serves ranged GETs one at a time and reads
  the whole object for each: its wall times are not a network's; bytes and requests are the figures to carry over.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import (
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

#: name -> (parameters, processes, each parameter's shape); the per-item fit takes the one-process 16 x 8 ones
CHECKPOINTS = {
    "dcp_10k": (2500, 1, (16, 8)),
    "dcp_100k": (25000, 1, (16, 8)),
    "dcp_120k": (30000, 1, (16, 8)),
    "dcp_1m": (250000, 1, (16, 8)),  # 1,000,013 items, 2.2 GB; made only when named (`--only dcp_1m --make`)
    "dcp_10k_2p": (1430, 2, (16, 8)),
    "dcp_wide": (500, 1, (64, 512)),
}

TORCH_READ = r"""
import json, sys, time
t0 = time.perf_counter()
from torch.distributed.checkpoint import FileSystemReader
t1 = time.perf_counter()
md = FileSystemReader(sys.argv[1]).read_metadata()
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "read_s": t2 - t1, "keys": len(md.state_dict_metadata),
                  "items": len(md.storage_data)}))
"""
#: torch's own way to see a DCP checkpoint's contents without a process group: load every item, `torch.save` one file
TORCH_TO_SAVE = r"""
import os, sys, tempfile
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
out = os.path.join(tempfile.mkdtemp(prefix="bench-dcp-ts-"), "all.pt")
dcp_to_torch_save(sys.argv[1], out)
os.remove(out)
os.rmdir(os.path.dirname(out))
"""
S3_KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def _row(label: str, m, note: str) -> None:
    """One indented row of the table: a command's median wall, CPU and peak RSS, and a note."""
    print(
        f"{'':12s} {'':8s} {label:28s} {m.wall_s_median:8.3f} {m.cpu_s_median:7.2f} "
        f"{fmt_bytes(m.peak_rss_bytes_median):>10s}  {note}"
    )


def _same_but_unread(mine: dict, other: dict) -> tuple[str, str, int]:
    """(mine, other, n) as JSON text to compare: mine without its `values-not-read` warning, other without the
    `value` of each tensor that shows none in mine (n of them)."""
    n = 0

    def strip(a, b):
        nonlocal n
        if isinstance(a, dict) and isinstance(b, dict):
            if "dtype" in a and "numel" in a and "value" not in a and "value" in b:
                b = {k: v for k, v in b.items() if k != "value"}
                n += 1
            return {k: strip(a[k], b[k]) if k in a else b[k] for k in b}
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [strip(x, y) for x, y in zip(a, b)]
        return b

    mine = dict(mine, warnings=[w for w in mine["warnings"] if w["code"] != "values-not-read"])
    return json.dumps(mine), json.dumps(strip(mine, other)), n


def _moto(work: Path):
    """(endpoint, server process, log) of a moto S3 server on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = work / "moto.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, **S3_KEYS),
        )
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    return f"http://127.0.0.1:{port}", server, log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make", action="store_true", help="make the missing checkpoints first")
    ap.add_argument(
        "--only",
        default=",".join(n for n in CHECKPOINTS if n != "dcp_1m"),
        help="checkpoints to run (comma-separated names; dcp_1m only when named)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--s3", action="store_true", help="also inspect each from a moto S3 server")
    ap.add_argument(
        "--to-torch-save", action="store_true", help="also time torch's dcp_to_torch_save (loads every tensor)"
    )
    ap.add_argument("--before", metavar="DIR", help="also run `ckpt inspect` from this source tree (see the docstring)")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n]
    if a.make:
        from make_big_dcp import make

        for name in names:
            params, procs, shape = CHECKPOINTS[name]
            make(OUT_DIR / name, params, procs, shape=shape)
    missing = [n for n in names if not (OUT_DIR / n / ".metadata").is_file()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run with --make (see this file's docstring)")
    precompile()
    ck = ckpt_command()
    work = Path(tempfile.mkdtemp(prefix="bench-dcp-"))
    env = dict(os.environ)
    endpoint = server = None
    if a.s3:
        endpoint, server, _ = _moto(work)
        env.update(S3_KEYS, AWS_ENDPOINT_URL=endpoint)
        import s3fs

        fs = s3fs.S3FileSystem(
            key="bench", secret="bench", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
        )
        fs.mkdir("bench")
        for name in names:
            fs.put(str(OUT_DIR / name), f"bench/{name}", recursive=True)
    cmds: dict[str, list[str]] = {}
    envs: dict[str, dict[str, str]] = {}
    # the earlier tree's CLI: `python -P` keeps the working folder (this repository) off sys.path
    old_ck = [sys.executable, "-P", "-c", "from ckpt_cli.main import main; main()"]
    for name in names:
        path = str(OUT_DIR / name)
        cmds[f"{name}: ckpt inspect --json"] = ck + ["inspect", path, "--json"]
        if a.before:
            cmds[f"{name}: before: ckpt inspect --json"] = old_ck + ["inspect", path, "--json"]
        cmds[f"{name}: torch read_metadata"] = [sys.executable, "-c", TORCH_READ, path]
        if a.to_torch_save:
            cmds[f"{name}: torch dcp_to_torch_save"] = [sys.executable, "-c", TORCH_TO_SAVE, path]
        if a.s3:
            cmds[f"{name}: ckpt inspect s3:// --json"] = ck + ["inspect", f"s3://bench/{name}", "--json"]
            if a.before:
                cmds[f"{name}: before: ckpt inspect s3:// --json"] = old_ck + [
                    "inspect",
                    f"s3://bench/{name}",
                    "--json",
                ]
    if a.before:
        before_env = dict(env, PYTHONPATH=str(Path(a.before).resolve()))
        envs = {k: before_env for k in cmds if ": before: " in k}
    runs: dict[str, list] = {k: [] for k in cmds}
    outputs: dict[str, list] = {k: [] for k in cmds}
    docs: dict[str, str] = {}  # label -> its `--json` (the last run's; without the remote costs)
    busy = []
    try:
        for _ in range(a.repeat):
            for label, cmd in cmds.items():
                busy.append(cpu_busy_fraction())
                out = work / "out.json"
                runs[label].append(run_measured(cmd, env=envs.get(label, env), cwd=REPO_ROOT, stdout_path=out))
                text = out.read_text()
                if "dcp_to_torch_save" in label:
                    continue
                if "torch" in label:
                    outputs[label].append(json.loads(text))
                    continue
                doc = json.loads(text)
                outputs[label].append({"items": doc["details"]["items"], "remote": doc.get("remote")})
                doc.pop("remote", None)
                docs[label] = text if "s3://" not in label else json.dumps(doc)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)

    result: dict = {"machine": machine_info(), "repeat": a.repeat, "cpu_busy_before_runs": busy, "checkpoints": {}}
    points: dict[str, list[tuple[int, float]]] = {"ckpt": [], "torch": [], "torch_read": [], "ckpt_cpu": []}
    print(f"{'checkpoint':12s} {'items':>8s} {'command':28s} {'wall s':>8s} {'cpu s':>7s} {'peak RSS':>10s}  notes")
    for label, text in docs.items():
        if ": before: " not in label:
            continue
        mine = docs[label.replace("before: ", "")]
        if "s3://" in label:  # values a remote open left unread (said so): compared with those of the tree before
            mine, text, unread = _same_but_unread(json.loads(mine), json.loads(text))
            told = (outputs[label.replace("before: ", "")][-1]["remote"].get("small_reads") or {}).get("not_read", 0)
            if unread != told:
                raise SystemExit(f"{label}: {unread} values missing, the remote costs say {told} not read")
        if text != mine:
            raise SystemExit(f"{label}: its --json differs from this tree's")
    points["before"], points["before_cpu"] = [], []
    for name in names:
        mine, torch_ = summarize(runs[f"{name}: ckpt inspect --json"]), summarize(runs[f"{name}: torch read_metadata"])
        told = outputs[f"{name}: torch read_metadata"]
        keys, items = told[0]["keys"], told[0]["items"]
        shown = outputs[f"{name}: ckpt inspect --json"][0]["items"]
        if shown != keys:
            raise SystemExit(f"{name}: ckpt inspect reports {shown} items, torch's .metadata holds {keys} keys")
        read_s = statistics.median(o["read_s"] for o in told)
        entry = {
            "path": str(OUT_DIR / name),
            "bytes": dir_bytes(OUT_DIR / name),
            "keys": keys,
            "items": items,
            "processes": CHECKPOINTS[name][1],
            "shape": CHECKPOINTS[name][2],
            "ckpt_inspect": mine.to_dict(),
            "torch_read_metadata": torch_.to_dict(),
            "torch_read_metadata_in_process_s": read_s,
            "torch_import_s": statistics.median(o["import_s"] for o in told),
        }
        print(
            f"{name:12s} {items:8,d} {'ckpt inspect --json':28s} {mine.wall_s_median:8.3f} {mine.cpu_s_median:7.2f} "
            f"{fmt_bytes(mine.peak_rss_bytes_median):>10s}  torch whole / this "
            f"{torch_.wall_s_median / mine.wall_s_median:.2f}x"
        )
        print(
            f"{'':12s} {'':8s} {'torch read_metadata process':28s} {torch_.wall_s_median:8.3f} "
            f"{torch_.cpu_s_median:7.2f} {fmt_bytes(torch_.peak_rss_bytes_median):>10s}  the call alone "
            f"{read_s:.3f} s (import {entry['torch_import_s']:.2f} s)"
        )
        if a.to_torch_save:
            ts = summarize(runs[f"{name}: torch dcp_to_torch_save"])
            entry["torch_dcp_to_torch_save"] = ts.to_dict()
            _row("torch dcp_to_torch_save", ts, f"/ ckpt inspect {ts.wall_s_median / mine.wall_s_median:.1f}x")
        if a.before:
            old = summarize(runs[f"{name}: before: ckpt inspect --json"])
            entry["before_ckpt_inspect"] = old.to_dict()
            _row("before: ckpt inspect --json", old, "the same --json")
        s3_tags = ([""] + (["before: "] if a.before else [])) if a.s3 else []
        for tag in s3_tags:
            label = f"{name}: {tag}ckpt inspect s3:// --json"
            s3 = summarize(runs[label])
            cost = outputs[label][-1]["remote"]
            entry["before_ckpt_inspect_s3" if tag else "ckpt_inspect_s3"] = {**s3.to_dict(), "remote": cost}
            print(
                f"{'':12s} {'':8s} {tag + 'ckpt inspect s3:// --json':28s} {s3.wall_s_median:8.3f} "
                f"{s3.cpu_s_median:7.2f} {fmt_bytes(s3.peak_rss_bytes_median):>10s}  fetched "
                f"{cost['bytes_fetched']:,} of {entry['bytes']:,} bytes "
                f"({100 * cost['bytes_fetched'] / entry['bytes']:.1f} %), "
                f"{cost['get_requests']} GET + {cost['list_requests']} LIST requests"
                + (
                    f", {cost['small_reads']['not_read']} small values not read"
                    if (cost.get("small_reads") or {}).get("not_read")
                    else ""
                )
            )
        result["checkpoints"][name] = entry
        if entry["processes"] == 1 and entry["shape"] == (16, 8):
            points["ckpt"].append((items, mine.wall_s_median))
            points["ckpt_cpu"].append((items, mine.cpu_s_median))
            points["torch"].append((items, torch_.wall_s_median))
            points["torch_read"].append((items, read_s))
            if a.before:
                points["before"].append((items, old.wall_s_median))
                points["before_cpu"].append((items, old.cpu_s_median))
    if len(points["ckpt"]) >= 2:
        fit = {k: _slope(v) * 1e6 for k, v in points.items() if len(v) >= 2}
        result["per_item_us"] = fit
        print(
            f"per item (least squares over the one-process checkpoints): ckpt inspect {fit['ckpt']:.1f} us wall "
            f"({fit['ckpt_cpu']:.1f} us CPU), torch read_metadata {fit['torch']:.1f} us whole process / "
            f"{fit['torch_read']:.1f} us the call alone"
            + (f"; before: {fit['before']:.1f} us wall ({fit['before_cpu']:.1f} us CPU)" if "before" in fit else "")
        )
    print("CPU busy before the runs: " + " ".join("-" if b is None else f"{100 * b:.0f}%" for b in busy))
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "dcp_results.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
