"""One output folder written by many processes (torchrun, one or many nodes): balanced shares, a journal that
lets a rerun resume, and waits that end in bounded time naming the rank that was lost.

Why waits go through torchrun's key-value store and not gloo collectives: a gloo collective with a dead peer
either fails with a socket error that does not say which rank died, or blocks until its timeout. Here every
rank bumps a heartbeat counter in the store once a second (its own client, its own thread), and a rank waiting
for the others (`Job.exchange`) watches the counters of the ranks it still waits for: one that stops moving for
`CKPT_DIST_LOST_S` seconds (default 60) is named, with its host, in a `RankLost` error (exit 2). A rank that
beats is working (a share of a 10 TB checkpoint may take hours), so the waits have no other limit unless
`CKPT_DIST_TIMEOUT_S` is set; it is also the timeout of every store operation and gloo collective (default
600 s). Counters, not timestamps: node clocks may disagree.

The journal (`<staging>/.journal/rank<r>.jsonl`, one file per writing rank, so no two processes append to one
file) holds one line per finished, verified parameter: its folder (or the files it wrote beside others', e.g. a
DCP parameter's `.distcp` files, with what the last rank needs of it: its `.metadata` part) and each file's size
and checksum (`file_crc`), or the byte spans it wrote inside files other units write too (an exported tensor's
bytes in a safetensors file every rank writes into) with each span's CRC-32. A rerun (any number of ranks) skips a
parameter whose files (spans) are all still there with those sizes and checksums, their bytes read again and matched
against their CRC-32s.

`run_job` is the job itself, the same for every command that writes one output this way (to-universal,
`convert` to every target, `export`): the command gives it its units (journal name, bytes), what
converts a share of them, what rank 0 finishes with, and (export's files in an existing folder) how rank 0 puts the
output in place.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time
import zipfile
import zlib
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError
from ..read import gate
from .io import put_in_place

JOURNAL = ".journal"


@dataclass(frozen=True, kw_only=True)
class JobFigures:
    """What a converter's result adds for a many-process job: the pieces converted by this run and those found
    finished in the journal, and each rank's figures ({rank, host, params, resumed, bytes, seconds}). -1
    converted: not a job."""

    converted: int = -1
    resumed: int = 0
    ranks: tuple[dict, ...] = ()


def job_figures(figs: Any) -> dict[str, Any]:
    """`JobFigures`' fields from every rank's figures (`Journal.figures`)."""
    return {"converted": sum(f["params"] for f in figs), "resumed": sum(f["resumed"] for f in figs), "ranks": figs}


class RankLost(CkptError):
    """A rank of the job died or stopped answering; nothing was put in place."""


def _seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def balanced_shares(sizes: list[int], world: int) -> list[list[int]]:
    """Indices of `sizes` split into `world` shares of nearly equal total bytes (largest first, each to the
    lightest share so far; ties to the lower rank): the same answer on every rank for the same plan."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += sizes[i]
    return [sorted(s) for s in shares]


def _store_client():
    # lazy: torch.distributed only in a torchrun job; write/ stays torch-free at import
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=_seconds("CKPT_DIST_TIMEOUT_S", 600))
    return dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)


class Job:
    """This process's place in the job: `rank`, `world`, each rank's `hosts`, waits with a lost-rank watch.
    Needs the environment torchrun sets (MASTER_ADDR / MASTER_PORT of the job's store). `done` (bytes this
    rank converted) is published with each heartbeat; on rank 0, `on_others(n)` hears of the other ranks' new
    bytes (the progress bar of the whole job)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.lost_after = _seconds("CKPT_DIST_LOST_S", 60)
        self.timeout = _seconds("CKPT_DIST_TIMEOUT_S", 0) or None  # no limit but the heartbeats unless set
        self._store = _store_client()
        self._stop = threading.Event()
        self.done = 0
        self.on_others: Callable[[int], None] | None = None
        self._beat = threading.Thread(target=self._heartbeat, name="ckpt-heartbeat", daemon=True)
        self._beat.start()
        self.hosts = [h for h, _ in self.exchange("hosts", (socket.gethostname(), os.getpid()))]

    def _key(self, *parts: Any) -> str:
        # torchrun --max-restarts keeps its store across restarts: each attempt has its own keys
        return f"ckpt/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/" + "/".join(map(str, parts))

    def _heartbeat(self) -> None:
        try:
            store = _store_client()
            others, told = [self._key("bytes", r) for r in range(self.world) if r != self.rank], 0
            while not self._stop.wait(1.0):
                store.add(self._key("hb", self.rank), 1)
                store.set(self._key("bytes", self.rank), str(self.done))
                if self.on_others is not None:
                    now = sum(int(store.get(k)) for k in others if store.check([k]))
                    if now > told:
                        self.on_others(now - told)
                        told = now
        except Exception:  # noqa: BLE001  the store is gone: the waits of this rank say so
            return

    def who(self, r: int) -> str:
        host = self.hosts[r] if getattr(self, "hosts", None) else "?"
        return f"rank {r} (host {host})"

    def exchange(self, stage: str, obj: Any) -> list[Any]:
        """Publish `obj` (JSON: tuples come back as lists) as this rank's answer at `stage` and return every
        rank's, in rank order. Raises
        `RankLost` naming a rank whose heartbeat stopped, or the store's host when the store is gone."""
        try:
            self._store.set(self._key(stage, self.rank), json.dumps(obj))
            keys = [self._key(stage, r) for r in range(self.world)]
            seen: dict[int, tuple[int, float]] = {}
            start = time.monotonic()
            while not self._store.check(keys):
                now = time.monotonic()
                for r in range(self.world):
                    if r == self.rank or self._store.check([keys[r]]):
                        continue
                    beat = self._store.add(self._key("hb", r), 0)
                    last = seen.get(r)
                    if last is None or last[0] != beat:
                        seen[r] = (beat, now)
                    elif now - last[1] > self.lost_after:
                        raise RankLost(
                            f"{self.who(r)} was lost: no heartbeat for {self.lost_after:.0f} s while "
                            f"the job waited at '{stage}'; nothing was put in place",
                            hint="rerun the same command to resume from the journal (--restart starts over)",
                        )
                if self.timeout is not None and now - start > self.timeout:
                    raise RankLost(
                        f"the job waited {self.timeout:.0f} s at '{stage}' (CKPT_DIST_TIMEOUT_S); "
                        "nothing was put in place",
                        hint="rerun the same command to resume",
                    )
                time.sleep(0.2)
            return [json.loads(self._store.get(k)) for k in keys]
        except RankLost:
            raise
        except Exception as e:  # noqa: BLE001  the store's process (node 0's torchrun) went away
            raise RankLost(
                f"node 0 was lost ({self.who(0)}): the job's store at {os.environ.get('MASTER_ADDR')} "
                f"is gone ({e}); nothing was put in place",
                hint="rerun the same command to resume",
            ) from None

    def close(self) -> None:
        self._stop.set()


class LocalJob:
    """A job of one process without torchrun (the rerun of an interrupted job on one machine): `Job`'s
    interface, nothing to wait for."""

    rank, world = 0, 1

    def __init__(self) -> None:
        self.hosts = [socket.gethostname()]
        self.done = 0
        self.on_others: Callable[[int], None] | None = None

    def who(self, r: int) -> str:
        return f"rank {r} (host {self.hosts[0]})"

    def exchange(self, stage: str, obj: Any) -> list[Any]:
        return [obj]

    def close(self) -> None:
        pass


def file_crc(path: Path, *, check: bool = False, raw: bool = False) -> int:
    """A file's checksum. A zip (every torch.save file) is summed by its central directory, the CRC-32 of each
    member the writer computed while writing, so that journaling a finished file does not read it again;
    `check=True` (a rerun) also reads every member and compares it with its CRC-32. Any other file, or any file
    with `raw` (a DCP `.distcp`: zips one after another, of which `zipfile` would see only the last): the CRC-32
    of its bytes."""
    try:
        if raw:
            raise zipfile.BadZipFile
        with zipfile.ZipFile(path) as zf:
            if check and zf.testzip() is not None:
                return -1
            return zlib.crc32(repr([(i.filename, i.CRC, i.file_size) for i in zf.infolist()]).encode())
    except zipfile.BadZipFile:
        pass
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _span_crc(path: Path, offset: int, length: int) -> int:
    """The CRC-32 of `length` bytes of `path` from `offset`; OSError where the file is shorter."""
    crc = 0
    with open(path, "rb") as f:
        f.seek(offset)
        while length > 0:
            chunk = f.read(min(length, 8 << 20))
            if not chunk:
                raise OSError(f"{path}: shorter than the journal says")
            crc = zlib.crc32(chunk, crc)
            length -= len(chunk)
    return crc


def _fingerprint(folder: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, file_crc(p)] for p in sorted(folder.iterdir()) if p.is_file()}


class Journal:
    """Finished parameters of a staging folder: read from every rank's file, appended to this rank's own.

    A unit is recorded only once its files are fsynced and have passed the output gate (`read.gate`; not under
    `trust_pickles`), by the rank that wrote them: on a shared file system only the node that wrote a file can
    make it durable, and the work is split like the conversion. Its line says so (`synced`, `scanned`), so the
    rank that puts the output in place does not do it again (`settled`), nor does a rerun that resumes it. A
    DCP `.distcp` is fsynced but scanned at the end: its items are named by the `.metadata` rank 0 writes last."""

    def __init__(self, staging: Path, rank: int, *, trust_pickles: bool = False):
        self.root = staging
        self.trust_pickles = trust_pickles
        self.fsynced = 0  # files this process fsynced / scanned (the ranks' figures)
        self.scanned = 0
        self._synced: set[str] = set()  # files (from the staging root) a record says were fsynced / scanned
        self._scanned: set[str] = set()
        jdir = staging / JOURNAL
        jdir.mkdir(exist_ok=True)
        self.done: dict[str, dict[str, list[int]]] = {}
        self.extra: dict[str, Any] = {}  # what each record carries besides its files (`record(extra=...)`)
        self._at: dict[str, bool] = {}  # records of files named from the staging root (`record(paths=...)`)
        self._spans: dict[str, list] = {}  # records of byte spans: [file, offset, length, CRC-32] (`record(spans=...)`)
        for f in sorted(jdir.glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.done[rec["dir"]] = rec["files"]
                    self.extra[rec["dir"]] = rec.get("extra")
                    self._at[rec["dir"]] = bool(rec.get("paths"))
                    if rec.get("spans") is not None:
                        self._spans[rec["dir"]] = [(str(n), int(o), int(k), int(c)) for n, o, k, c in rec["spans"]]
                    names = [n if rec.get("paths") else f"{rec['dir']}/{n}" for n in rec["files"]]
                    if rec.get("synced"):
                        self._synced.update(names)
                    if rec.get("scanned"):
                        self._scanned.update(n for n in names if not n.endswith(".distcp"))
                except (ValueError, KeyError, TypeError):  # a line cut by a kill: that parameter is redone
                    continue
        self._f = open(jdir / f"rank{rank}.jsonl", "a")
        self._rank = rank
        self._count = 0
        self._kill = os.environ.get("CKPT_TEST_KILL_AFTER", "")  # "RANK:N": SIGKILL that rank after N records

    def finished(self, rel: str) -> bool:
        """Whether the unit `rel` was journaled and its files are still all there, with the journaled sizes and
        checksums: the parameter folder `rel` (relative to the staging folder), the files its record names, or
        the byte spans it names (each span's bytes read again against its CRC-32)."""
        want = self.done.get(rel)
        try:
            if rel in self._spans:
                return all(_span_crc(self.root / n, o, k) == c for n, o, k, c in self._spans[rel])
            if not want:
                return False
            if self._at.get(rel):
                root = self.root
                return all(
                    (root / n).stat().st_size == s and file_crc(root / n, raw=True) == c for n, (s, c) in want.items()
                )
            folder = self.root / rel
            if not folder.is_dir():
                return False
            have = sorted(p.name for p in folder.iterdir() if p.is_file())
            if have != sorted(want):
                return False
            return all(
                (folder / n).stat().st_size == s and file_crc(folder / n, check=True) == c for n, (s, c) in want.items()
            )
        except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile):
            return False

    def record(
        self,
        rel: str,
        *,
        paths: list[str] | None = None,
        spans: list[tuple[str, int, int]] | None = None,
        extra: Any = None,
    ) -> None:
        """Journal the unit `rel` as finished and verified: the files of the folder `rel`, or, with `paths`, those
        files (relative to the staging folder: a unit whose files lie beside other units'), or, with `spans`, those
        (file, offset, length) byte ranges (a unit written into files other units write too); `extra` (JSON) is
        kept with it for the rank that finishes the job (`Journal.extra`)."""
        if spans is not None:
            rec: dict[str, Any] = {
                "dir": rel,
                "files": {},
                "spans": [[n, o, k, _span_crc(self.root / n, o, k)] for n, o, k in spans],
            }
        elif paths is None:
            rec = {"dir": rel, "files": _fingerprint(self.root / rel)}
        else:
            files = {n: [(self.root / n).stat().st_size, file_crc(self.root / n, raw=True)] for n in paths}
            rec = {"dir": rel, "paths": True, "files": files}
        if rec["files"]:
            names = [n if paths is not None else f"{rel}/{n}" for n in rec["files"]]
            self._settle(names)
            rec["synced"], rec["scanned"] = True, not self.trust_pickles
        if extra is not None:
            rec["extra"] = extra
        self._f.write(json.dumps(rec) + "\n")
        # flushed, not fsynced: a killed process loses nothing the kernel holds, and after a machine crash a line
        # whose files did not reach the disk fails the rerun's size / CRC-32 check (the parameter is redone)
        self._f.flush()
        self._count += 1
        r, _, n = self._kill.partition(":")
        if r.isdigit() and int(r) == self._rank and n.isdigit() and self._count >= int(n):
            os.kill(os.getpid(), signal.SIGKILL)

    def _settle(self, names: list[str]) -> None:
        """fsync the files `names` (from the staging root) and their folders, and pass them through the output
        gate (a refusal: `UnsupportedCheckpoint` naming the file, which fails this rank)."""
        gate.check_output(self.root, [n for n in names if not n.endswith(".distcp")], trust_pickles=self.trust_pickles)
        if not self.trust_pickles:
            self.scanned += sum(not n.endswith(".distcp") for n in names)
        for n in names:
            with open(self.root / n, "rb") as fh:
                os.fsync(fh.fileno())
        self.fsynced += len(names)
        for d in {(self.root / n).parent for n in names}:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def spans(self, rel: str) -> list[tuple[str, int, int, int]]:
        """The byte spans the record of `rel` names, each (file, offset, length, CRC-32) as it was journaled."""
        return list(self._spans.get(rel, ()))

    def settled(self) -> tuple[set[str], set[str]]:
        """The files (from the staging root) that the records read when this journal was opened say were fsynced,
        and those that passed the output gate."""
        return self._synced, self._scanned

    def close(self) -> None:
        self._f.close()


# --- one job: plan on rank 0, a share on every rank, the output in place on rank 0 ------------------------------


def job_staging(out: Path) -> Path:
    """The staging folder of a many-process conversion into `out`: a fixed name, so that a rerun finds it."""
    out = Path(out).resolve()
    return out.parent / f".ckpt-staging-{out.name}-job"


def remove_stale_staging(out: Path) -> None:
    """Remove the one-process staging folders of this OUT left by killed runs (their process is gone)."""
    out = Path(out).resolve()
    for d in out.parent.glob(f".ckpt-staging-{out.name}-*"):
        pid = d.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(d, ignore_errors=True)


def prepare_staging(
    out: Path,
    staging: Path,
    digest: str,
    restart: bool,
    *,
    empty_out_ok: bool = False,
    targets: list[Path] | None = None,
) -> None:
    """(rank 0) Refuse an existing OUT (with `empty_out_ok`, an empty folder is kept: the output replaces it when
    it is put in place, so a job that fails leaves it as it was), or with `targets` (an output of files put beside
    others, not OUT itself: a sharded export's files and index) any of those paths that exists; keep a staging
    folder of the same plan (`digest`: its journal is resumed), throw away one of another plan or with `restart`."""
    out = Path(out).resolve()
    if targets is not None:
        for f in targets:
            if Path(f).exists():
                raise CkptError("output file already exists", path=f, hint="choose a new path or remove it first")
    elif out.exists() and not (empty_out_ok and out.is_dir() and not any(out.iterdir())):
        raise CkptError("output folder already exists", path=out, hint="choose a new path or remove it first")
    remove_stale_staging(out)
    mark = staging / JOURNAL / "plan"
    if staging.exists() and (restart or not mark.is_file() or mark.read_text() != digest):
        shutil.rmtree(staging)
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(digest)


@dataclass(frozen=True)
class Unit:
    """One piece of the output a rank converts, journals and a rerun skips: its journal name, its bytes (what
    the shares balance) and what the ranks' figures call it (`name`: the parameter or tensor; `rel` if not
    given)."""

    rel: str
    nbytes: int
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.rel


def _share(units: list[Unit], indices: list[int], job) -> list[int]:
    return [indices[k] for k in balanced_shares([units[i].nbytes for i in indices], job.world)[job.rank]]


def _stage(job, out: Path, staging: Path, digest: str, restart: bool, empty_out_ok: bool, targets) -> None:
    """Step 1: rank 0 prepares the staging folder; every rank hears whether it could (an error on every rank
    otherwise)."""
    err = None
    if job.rank == 0:
        try:
            prepare_staging(out, staging, digest, restart, empty_out_ok=empty_out_ok, targets=targets)
        except (CkptError, OSError) as e:
            err = e
    said = job.exchange(
        "staged", "" if err is None else (err.one_line() if isinstance(err, CkptError) else f"{staging}: {err}")
    )[0]
    if said:
        raise err or CkptError(f"rank 0 could not start: {said}")


def _convert_shares(
    job, staging: Path, units: list[Unit], convert, progress, trust_pickles: bool, start: float
) -> tuple[dict, tuple[dict, ...]]:
    """Steps 2-3: check this rank's share of the units the journal names as finished, then convert its share
    of the others; every rank reports its figures and whether it failed. Returns (this rank's figures, every
    rank's); raises on every rank when any failed."""

    def counted(n: int) -> None:
        job.done += n
        if progress is not None:
            progress(n)

    journal = Journal(staging, job.rank, trust_pickles=trust_pickles)
    n, line, failure, todo, resumed = 0, "", None, [], []
    try:
        every = list(range(len(units)))
        resumed = [
            i
            for i in _share(units, [i for i in every if units[i].rel in journal.done], job)
            if journal.finished(units[i].rel)
        ]
        finished = {i for part in job.exchange("checked", resumed) for i in part}
        todo = _share(units, [i for i in every if i not in finished], job)
        if resumed:
            counted(sum(units[i].nbytes for i in resumed))
        n = convert(todo, journal, counted)
    except CkptError as e:
        failure, line = e, f"{job.who(job.rank)}: {e.one_line()}"
    except (OSError, ValueError, RuntimeError) as e:
        failure = CkptError(f"{job.who(job.rank)}: {e}", path=staging)
        line = failure.one_line()
    finally:
        journal.close()
    fig = {
        "rank": job.rank,
        "host": job.hosts[job.rank],
        "params": len(todo),
        "resumed": len(resumed),
        "bytes": n,
        "seconds": round(time.monotonic() - start, 3),
        "fsynced_files": journal.fsynced,  # its own share: fsynced and scanned before it reported success
        "scanned_files": journal.scanned,
    }
    reports = job.exchange("converted", (line, fig))
    figs = tuple(f for _, f in reports)
    bad = [line for line, _ in reports if line]
    if bad:
        raise failure or CkptError(
            f"{len(bad)} rank(s) failed, nothing was put in place: {bad[0]}",
            hint="fix the cause, then rerun the same command to resume",
        )
    return fig, figs


def _finish(job, staging: Path, finish) -> tuple[set[str], set[str]]:
    """Step 4: rank 0 writes the common files (`finish`); a failure there is an error on every rank (and removes
    the staging folder, unless it was an interruption). Returns what the journals say was already fsynced and
    scanned (rank 0; empty sets elsewhere)."""
    failure, said, settled = None, "", (set(), set())
    if job.rank == 0:
        try:
            done = Journal(staging, 0)
            done.close()
            settled = done.settled()
            finish(staging, done)
        except BaseException as e:
            failure, said = e, (e.one_line() if isinstance(e, CkptError) else repr(e))
    said = job.exchange("finished", said)[0]
    if said:
        if not isinstance(failure, BaseException) or isinstance(failure, Exception):  # an interruption keeps it
            _discard(job, staging)
        raise failure or CkptError(f"rank 0 could not finish: {said}")
    return settled


def _verify_shares(job, out: Path, staging: Path, units: list[Unit], verify, figs: tuple[dict, ...]) -> dict:
    """Step 5: every rank compares its balanced share of the output with the source; what each compared goes
    into every rank's figures. Any difference removes the staging folder and is an error naming the ranks that
    found one. Returns this rank's figures."""
    share = _share(units, list(range(len(units))), job)
    compared = ([units[i].label for i in share], sum(units[i].nbytes for i in share))
    try:
        problems = verify(staging, share, job.rank == 0)
        if isinstance(problems, tuple):  # (problems, what it compared instead of its share of the units)
            problems, *rest = problems
            compared = tuple(rest)
    except (CkptError, OSError, ValueError, RuntimeError) as e:
        problems = [e.one_line() if isinstance(e, CkptError) else str(e)]
    verdicts = job.exchange("verified", (problems, *compared))
    for f, (_, names, nbytes) in zip(figs, verdicts):  # what each rank compared with the source
        f["verified"], f["verified_bytes"] = names, nbytes
    problems = [x for part, _, _ in verdicts for x in part]
    if problems:
        _discard(job, staging)
        found = ", ".join(job.who(r) for r, (part, _, _) in enumerate(verdicts) if part)
        raise CkptError(
            f"verification by {found}: the output differs from the source in {len(problems)} places: "
            + "; ".join(problems[:5])
            + ("; ..." if len(problems) > 5 else ""),
            path=out,
            hint="nothing was put in place; please report this with `ckpt diff` of the two",
        )
    return figs[job.rank]


def _place(
    job, out: Path, staging: Path, settled, place, trust_pickles: bool, fig: dict, figs: tuple[dict, ...]
) -> None:
    """Step 6: rank 0 puts the folder in place (`put_in_place`, counting what it fsynced and scanned into its
    figures, or `place(staging)`); a failure removes the staging folder (an interruption keeps it) and is an
    error on every rank."""
    failure, said = None, ""
    if job.rank == 0:
        try:
            try:
                shutil.rmtree(staging / JOURNAL)
                if place is None:
                    synced, scanned = settled
                    counts = put_in_place(
                        staging, Path(out).resolve(), trust_pickles=trust_pickles, synced=synced, scanned=scanned
                    )
                    for f in {id(d): d for d in (fig, figs[0])}.values():  # rank 0: what it did at the end
                        f["fsynced_files"] += counts["fsynced_files"]
                        f["scanned_files"] += counts["scanned_files"]
                else:
                    place(staging)
            except Exception:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        except BaseException as e:
            failure, said = e, (e.one_line() if isinstance(e, CkptError) else repr(e))
    said = job.exchange("placed", said)[0]
    if said:
        raise failure or CkptError(f"rank 0 could not finish: {said}")


def run_job(
    job,
    out: Path,
    units: list[Unit],
    *,
    digest: str,
    restart: bool,
    convert: Callable[[list[int], Journal, Callable[[int], None]], int],
    finish: Callable[[Path, Journal], None],
    verify: Callable[[Path, list[int], bool], list[str]] | None = None,
    progress: Callable[[int], None] | None = None,
    trust_pickles: bool = False,
    place: Callable[[Path], None] | None = None,
    empty_out_ok: bool = False,
    targets: list[Path] | None = None,
) -> tuple[dict, tuple[dict, ...]]:
    """One output written by every rank of `job` (`Job`, or `LocalJob` for a one-process rerun), the same for any
    number of ranks:

    1. rank 0 prepares the staging folder (`job_staging`, `prepare_staging`; `empty_out_ok`: an empty OUT folder
       is written over, as a one-process export does; `targets`: the files `place` puts in place are refused where
       they exist, not OUT); the others wait for it;
    2. the units the journal names as finished are checked again (sizes, checksums), a balanced share per rank;
    3. the units not finished are converted, a share per rank balanced by bytes (`balanced_shares`):
       `convert(indices, journal, progress)` converts those units, verifies each one and journals it
       (`journal.record`: the unit's files fsynced and passed through the output gate by the rank that wrote
       them), and returns the bytes it wrote;
    4. when every rank reported success, rank 0 runs `finish(staging, journal)` (the common files;
       `journal.extra` holds what each unit journaled with it);
    5. `verify(staging, indices, first)` on every rank compares its share of the whole output (a balanced share
       of the units, not the share it converted; `first`: rank 0, which also checks what belongs to no unit) and
       returns one line per difference (or (those lines, the names it compared, their bytes) where it compares
       another share than the units', e.g. parameters whose bytes lie in units of rank files); the error names
       the ranks that found one;
    6. when no rank found one, rank 0 puts the folder in place (`io.put_in_place`, which fsyncs and scans only
       what no journal line says was: the common files, the folders; or `place(staging)`, e.g. an
       export's files into an existing folder, `io.put_files_in_place`). A failure in 4-6 removes the staging
       folder (what it holds did not verify); an interruption keeps it.

    A failure of any rank is an error on every rank, one line naming the rank and its host; a lost rank is a
    `RankLost` in bounded time. Returns (this rank's figures, every rank's): {rank, host, params (units
    converted), resumed, bytes, seconds, fsynced_files, scanned_files (rank 0: with those it put in place)},
    with `verify` also `verified` (the `Unit.label`s of the units the rank compared) and `verified_bytes`."""
    start = time.monotonic()
    staging = job_staging(out)
    try:
        _stage(job, out, staging, digest, restart, empty_out_ok, targets)
        if progress is not None and job.rank == 0:
            job.on_others = progress  # rank 0's bar counts every rank's bytes
        fig, figs = _convert_shares(job, staging, units, convert, progress, trust_pickles, start)
        settled = _finish(job, staging, finish)
        if verify is not None:
            fig = _verify_shares(job, out, staging, units, verify, figs)
        _place(job, out, staging, settled, place, trust_pickles, fig, figs)
    finally:
        job.close()
    return fig, figs


def _discard(job, staging: Path) -> None:
    """(rank 0, once every rank has stopped reading it) Remove a staging folder whose output did not verify."""
    if job.rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
