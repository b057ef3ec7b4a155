"""Benchmark: `ckpt inspect s3://…` (ranged reads) against downloading the checkpoint and inspecting the copy.

    python bench/make_big_zero.py --out bench/out/zero2_200m --params 14e6     # once
    python bench/bench_remote.py --ckpt bench/out/zero2_200m --repeat 3       # table + bench/out/remote_results.json
    python bench/bench_remote.py --ckpt bench/out/zero2_200m --stats          # every tensor byte: --stats

A real S3-compatible server (moto's server mode, its own process on 127.0.0.1) holds the checkpoint, uploaded
with s3fs before timing. Each command runs as its own process, timed from spawn to exit, runs interleaved:

- `ckpt inspect s3://bench/<name> --json`: the bytes and requests it reports in `remote`;
- the usual way: `s3fs.get(recursive=True)` of the prefix into a temporary folder (what `aws s3 sync` does: one
  listing, one GET per object), then `ckpt inspect <folder> --json`; wall times summed.

Requests are also counted on the server side, from its access log (one line per HTTP request), for both.
The server is on the same machine: no network latency; over a real network each request costs a round trip
(PERFORMANCE.md: 20 ms makes 50 sequential small reads a second) and the bytes cost bandwidth, so the gap in
bytes and requests is the figure to carry over, not the wall times.

`--latency-ms N` puts a delaying TCP proxy (`DelayProxy`, threads in this process, on 127.0.0.1) between both
clients and the server: every chunk a client sends (an HTTP request's head arrives as one) is held N ms before it
is passed on, so each request costs N ms more — what a store across a network adds, with loopback bandwidth.
The upload before timing goes to the server directly.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import REPO_ROOT, dir_bytes, fmt_bytes, machine_info, precompile, run_measured  # noqa: E402

KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
CKPT = [sys.executable, "-c", "from ckpt_cli.main import main; main()"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DelayProxy:
    """127.0.0.1:<port> -> 127.0.0.1:<target>, each chunk from the client held `delay_s` before it is sent on."""

    def __init__(self, target: int, delay_s: float) -> None:
        import threading

        self.target, self.delay_s = target, delay_s
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._pipe, args=(client, upstream, self.delay_s), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(1 << 16):
                if delay_s:
                    time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def _requests_logged(log: Path) -> int:
    return sum(
        1 for line in log.read_text(errors="replace").splitlines() if '" 20' in line or '" 4' in line or '" 5' in line
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", type=Path, default=REPO_ROOT / "bench/out/zero2_200m")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--stats", action="store_true", help="time `inspect --stats` (every tensor byte) instead")
    p.add_argument(
        "--latency-ms", type=float, default=0.0, help="add this much to every request (a delaying proxy on loopback)"
    )
    args = p.parse_args()
    extra = ["--stats"] if args.stats else []
    src = args.ckpt.resolve()
    if not src.is_dir():
        sys.exit(f"{src}: not there; make it with bench/make_big_zero.py (see this file's docstring)")
    precompile()
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    log = work / "moto.log"
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = dict(os.environ, **KEYS, AWS_ENDPOINT_URL=endpoint, PYTHONPATH=str(REPO_ROOT))
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        import s3fs

        fs = s3fs.S3FileSystem(
            key="bench", secret="bench", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
        )
        fs.mkdir("bench")
        fs.put(str(src), f"bench/{src.name}", recursive=True)
        if args.latency_ms:  # the timed clients go through the delaying proxy
            proxy = DelayProxy(port, args.latency_ms / 1000)
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{proxy.port}"
        url = f"s3://bench/{src.name}"
        total = dir_bytes(src)
        get_script = (
            "import s3fs,sys; fs=s3fs.S3FileSystem(skip_instance_cache=True); "
            "fs.get(sys.argv[1], sys.argv[2], recursive=True)"
        )
        rows = {"remote": [], "download": [], "local_inspect": []}
        remote_doc = None
        for i in range(args.repeat):
            before = _requests_logged(log)
            out_json = work / "remote.json"
            m = run_measured([*CKPT, "inspect", url, "--json", *extra], env=env, cwd=REPO_ROOT, stdout_path=out_json)
            remote_doc = json.loads(out_json.read_text())
            rows["remote"].append((m, _requests_logged(log) - before, remote_doc["remote"]))
            dest = work / "copy"
            shutil.rmtree(dest, ignore_errors=True)
            before = _requests_logged(log)
            m = run_measured([sys.executable, "-c", get_script, f"bench/{src.name}", str(dest)], env=env)
            rows["download"].append((m, _requests_logged(log) - before, dir_bytes(dest)))
            m = run_measured(
                [*CKPT, "inspect", str(dest), "--json", *extra], env=env, cwd=REPO_ROOT, stdout_path=work / "local.json"
            )
            rows["local_inspect"].append((m, 0, None))
        local_doc = json.loads((work / "local.json").read_text())
        remote_doc.pop("remote"), remote_doc.pop("path"), local_doc.pop("path")
        same = remote_doc == local_doc
    finally:
        server.terminate()
        server.wait(timeout=10)

    med = lambda k: statistics.median(m.wall_s for m, _, _ in rows[k])  # noqa: E731
    rss = lambda k: statistics.median(m.peak_rss_bytes for m, _, _ in rows[k])  # noqa: E731
    r_cost = rows["remote"][-1][2]
    result = {
        "machine": machine_info(),
        "ckpt": str(src),
        "bytes": total,
        "repeat": args.repeat,
        "stats": args.stats,
        "latency_ms": args.latency_ms,
        "same_json_as_local": same,
        "remote": {
            "wall_s_median": med("remote"),
            "wall_s": [m.wall_s for m, _, _ in rows["remote"]],
            "peak_rss_bytes": rss("remote"),
            "reported": r_cost,
            "server_requests": [n for _, n, _ in rows["remote"]],
        },
        "download_then_inspect": {
            "wall_s_median": med("download") + med("local_inspect"),
            "download_wall_s": [m.wall_s for m, _, _ in rows["download"]],
            "inspect_wall_s": [m.wall_s for m, _, _ in rows["local_inspect"]],
            "bytes": rows["download"][-1][2],
            "server_requests": [n for _, n, _ in rows["download"]],
        },
    }
    out_dir = REPO_ROOT / "bench/out"
    out_dir.mkdir(exist_ok=True)
    tag = ("_stats" if args.stats else "") + (f"_latency{args.latency_ms:g}ms" if args.latency_ms else "")
    (out_dir / f"remote{tag}_results.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"{src.name}: {fmt_bytes(total)}, {args.repeat} runs each, medians; same --json as local: {same}"
        + (f"; +{args.latency_ms:g} ms per request" if args.latency_ms else "")
    )
    print(
        f"  ckpt inspect {' '.join(extra)} s3://   {med('remote'):7.3f} s  {r_cost['bytes_fetched']:>14,} bytes  "
        f"{r_cost['requests']:>4} requests (server log: {rows['remote'][-1][1]})  RSS {fmt_bytes(rss('remote'))}"
    )
    print(
        f"  download + inspect   {med('download') + med('local_inspect'):7.3f} s  "
        f"{rows['download'][-1][2]:>14,} bytes  {'':>4}          (server log: {rows['download'][-1][1]})  "
        f"(download {med('download'):.3f} s + inspect {med('local_inspect'):.3f} s)"
    )


if __name__ == "__main__":
    main()
