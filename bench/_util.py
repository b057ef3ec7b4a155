"""What every benchmark in bench/ shares: timing a whole child process, its peak RSS, dropping the page
cache, and a record of the machine the numbers came from.

Stdlib only, on purpose: a benchmark driver that imported torch would pay for it in every number it
reports about its children (and the driver's own RSS is never measured, only the child's).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = REPO_ROOT / "bench" / "out"


@dataclass(frozen=True)
class Measurement:
    """One run of a child process: wall time from spawn to reap (interpreter start included) and the
    child's peak resident set size as the kernel accounted it (`ru_maxrss` from `wait4`)."""

    wall_s: float
    cpu_s: float  # user + system CPU time of the child: barely moved by other load on a shared machine
    peak_rss_bytes: int
    returncode: int
    stdout_bytes: int


GNU_TIME = "/usr/bin/time"


def run_measured(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    stdout_path: str | os.PathLike | None = None,
    check: bool = True,
) -> Measurement:
    """Run `cmd` to completion; return its wall time, CPU time and peak RSS.

    The peak RSS is the kernel's `ru_maxrss` of the child. Linux folds into it the high-water RSS of the
    address space the child had *before* its exec: for a child forked or vforked straight from this
    benchmark process that is the benchmark's own RSS (rich, json results: ~57 MiB), so even `python -c
    pass` read 56.6 MiB. So the child is started through GNU time (`/usr/bin/time`, ~2 MiB, which forks and
    execs it and reports `%M`, its ru_maxrss); without GNU time, `os.wait4`'s rusage of the direct child is
    used (it may include this process's RSS). Stdout goes to a file
    (a shell redirect costs the child the same); stderr is kept and shown if the command fails.
    """
    out = open(stdout_path, "wb") if stdout_path else open(os.devnull, "wb")
    use_time = os.access(GNU_TIME, os.X_OK)
    with out, tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r", suffix=".time") as tfile:
        argv = ([GNU_TIME, "-q", "-f", "%M %U %S", "-o", tfile.name] if use_time else []) + list(cmd)
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env, cwd=cwd)
        _, status, ru = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)  # already reaped: keep Popen from waiting again
        if check and proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-4000:]
            raise RuntimeError(f"{' '.join(map(str, cmd))} exited with {proc.returncode}:\n{tail}")
        size = out.tell() if stdout_path else 0
        fields = tfile.read().split() if use_time else []
    if len(fields) >= 3:
        rss, cpu = int(fields[-3]) * 1024, float(fields[-2]) + float(fields[-1])
    else:  # Linux reports ru_maxrss in KiB (macOS in bytes)
        rss = ru.ru_maxrss if sys.platform == "darwin" else ru.ru_maxrss * 1024
        cpu = ru.ru_utime + ru.ru_stime
    return Measurement(wall_s=wall, cpu_s=cpu, peak_rss_bytes=rss, returncode=proc.returncode, stdout_bytes=size)


def ckpt_command() -> list[str]:
    """The installed `ckpt` console script beside this interpreter, as a user runs it (not a version
    manager's shell shim found first on PATH, which adds its own ~50 ms); else the same entry point."""
    exe = Path(sys.executable).with_name("ckpt")
    return [str(exe)] if exe.is_file() else [sys.executable, "-c", "from ckpt_cli.main import main; main()"]


def precompile(root: str | os.PathLike | None = None) -> None:
    """Write the project's bytecode, as installing a wheel does. These machines set PYTHONDONTWRITEBYTECODE=1,
    so an editable install would otherwise compile every ckpt module again in every timed process (~40 ms
    that no installed tool pays; torch and the other references come from wheels with their bytecode). `root`:
    another source tree to compile (a benchmark's `--before DIR`), else this one."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "ckpt_tools", "cli"],
        cwd=root or REPO_ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def drop_caches() -> bool:
    """Empty the page cache so the next read comes from disk. True if it worked (needs root and a
    writable /proc/sys, which containers often mount read-only)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Summary:
    """The median of N runs (what tables report) plus the spread, so a noisy number is visible as one."""

    n: int
    wall_s_median: float
    wall_s_min: float
    wall_s_max: float
    cpu_s_median: float
    peak_rss_bytes_median: int
    runs: list[Measurement]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["runs"] = [asdict(m) for m in self.runs]
        return d


def summarize(runs: Sequence[Measurement]) -> Summary:
    walls = [m.wall_s for m in runs]
    return Summary(
        n=len(runs),
        wall_s_median=statistics.median(walls),
        wall_s_min=min(walls),
        wall_s_max=max(walls),
        cpu_s_median=statistics.median(m.cpu_s for m in runs),
        peak_rss_bytes_median=int(statistics.median(m.peak_rss_bytes for m in runs)),
        runs=list(runs),
    )


def measure(cmd: Sequence[str], *, repeat: int, cold: bool, **kwargs) -> Summary:
    """Run `cmd` `repeat` times, each after dropping the page cache when `cold`, and summarise.
    (To compare several commands fairly, interleave their runs and `summarize` each one's list.)"""
    runs = []
    for _ in range(repeat):
        if cold and not drop_caches():
            raise RuntimeError("cannot drop the page cache here; measure warm only")
        runs.append(run_measured(cmd, **kwargs))
    return summarize(runs)


def _cpu_times() -> tuple[int, int]:
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(x) for x in f]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def cpu_busy_fraction(interval_s: float = 0.5) -> float | None:
    """How busy all CPUs are (0..1) over `interval_s`, from /proc/stat: other jobs on a shared machine
    inflate wall times, so the benchmarks record this beside their numbers. None where unavailable."""
    try:
        b0, t0 = _cpu_times()
        time.sleep(interval_s)
        b1, t1 = _cpu_times()
    except (OSError, ValueError, IndexError):
        return None
    return (b1 - b0) / max(t1 - t0, 1)


def wait_for_idle(threshold: float = 0.2, max_wait_s: float = 120.0) -> float | None:
    """Wait (up to `max_wait_s`) until the machine is at most `threshold` busy; returns the last reading."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = cpu_busy_fraction()
        if busy is None or busy <= threshold or time.monotonic() >= deadline:
            return busy
        time.sleep(1.0)


def dir_bytes(path: str | os.PathLike) -> int:
    """Total size of the regular files under `path` (or of `path` itself)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def machine_info() -> dict:
    """Where and when the numbers were taken: date, CPU, cores, RAM, and the versions that matter.
    Versions come from package metadata so that recording them imports nothing heavy."""

    def ver(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = None
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_bytes": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {d: ver(d) for d in ("ckpt-tools", "torch", "deepspeed", "typer", "click", "rich")},
    }


def report(runs: dict, out_name: str, result: dict, notes: dict[str, str] | None = None) -> None:
    """Summarize each command's runs into `result["results"]`, print one line per command (median wall, range,
    peak RSS, and a note such as its exit status), and write `result` to OUT_DIR/out_name."""
    import json

    result.setdefault("results", {})
    width = max(len(n) for n in runs) + 2
    for name, ms in runs.items():
        s = summarize(ms)
        result["results"][name] = s.to_dict()
        print(
            f"{name:{width}s} {s.wall_s_median:7.3f} s  (min {s.wall_s_min:.3f}, max {s.wall_s_max:.3f})  "
            f"{s.peak_rss_bytes_median / 2**20:7.1f} MiB" + (f"  {notes[name]}" if notes and name in notes else "")
        )
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / out_name).write_text(json.dumps(result, indent=1, default=str))


def report_against(runs: dict, reference: str, label: str, out_name: str, result: dict, busy: list) -> None:
    """`report` with each command's speed-up over the `reference` command ("<label> / this 2.3x"), then how busy
    the CPUs were before each run and every command's median CPU seconds."""
    ref_wall = summarize(runs[reference]).wall_s_median
    notes = {
        name: f"{label} / this {ref_wall / summarize(ms).wall_s_median:.1f}x"
        for name, ms in runs.items()
        if name != reference
    }
    result["cpu_busy_before_runs"] = busy
    report(runs, out_name, result, notes)
    print("CPU busy before the runs: " + " ".join("-" if b is None else f"{100 * b:.0f}%" for b in busy))
    for name, ms in runs.items():
        print(f"{name}: CPU s median {summarize(ms).cpu_s_median:.2f}")
