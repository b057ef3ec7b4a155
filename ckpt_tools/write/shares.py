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
file) holds one line per finished, verified parameter: its folder and each file's size and checksum
(`file_crc`). A rerun (any number of ranks) skips a parameter whose files are all still there with those sizes
and checksums, their bytes read again and matched against their CRC-32s.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import zipfile
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError

JOURNAL = ".journal"


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


def file_crc(path: Path, *, check: bool = False) -> int:
    """A file's checksum. A zip (every torch.save file) is summed by its central directory, the CRC-32 of each
    member the writer computed while writing, so that journaling a finished file does not read it again;
    `check=True` (a rerun) also reads every member and compares it with its CRC-32. Any other file: the CRC-32
    of its bytes."""
    try:
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


def _fingerprint(folder: Path) -> dict[str, list[int]]:
    return {p.name: [p.stat().st_size, file_crc(p)] for p in sorted(folder.iterdir()) if p.is_file()}


class Journal:
    """Finished parameters of a staging folder: read from every rank's file, appended to this rank's own."""

    def __init__(self, staging: Path, rank: int):
        self.root = staging
        jdir = staging / JOURNAL
        jdir.mkdir(exist_ok=True)
        self.done: dict[str, dict[str, list[int]]] = {}
        for f in sorted(jdir.glob("rank*.jsonl")):
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                    self.done[rec["dir"]] = rec["files"]
                except (ValueError, KeyError, TypeError):  # a line cut by a kill: that parameter is redone
                    continue
        self._f = open(jdir / f"rank{rank}.jsonl", "a")
        self._rank = rank
        self._count = 0
        self._kill = os.environ.get("CKPT_TEST_KILL_AFTER", "")  # "RANK:N": SIGKILL that rank after N records

    def finished(self, rel: str) -> bool:
        """Whether the parameter folder `rel` (relative to the staging folder) was journaled and its files are
        still all there, with the journaled sizes and checksums."""
        want = self.done.get(rel)
        folder = self.root / rel
        if not want or not folder.is_dir():
            return False
        try:
            have = sorted(p.name for p in folder.iterdir() if p.is_file())
            if have != sorted(want):
                return False
            return all(
                (folder / n).stat().st_size == s and file_crc(folder / n, check=True) == c for n, (s, c) in want.items()
            )
        except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile):
            return False

    def record(self, rel: str) -> None:
        self._f.write(json.dumps({"dir": rel, "files": _fingerprint(self.root / rel)}) + "\n")
        # flushed, not fsynced: a killed process loses nothing the kernel holds, and after a machine crash a line
        # whose files did not reach the disk fails the rerun's size / CRC-32 check (the parameter is redone)
        self._f.flush()
        self._count += 1
        r, _, n = self._kill.partition(":")
        if r.isdigit() and int(r) == self._rank and n.isdigit() and self._count >= int(n):
            os.kill(os.getpid(), signal.SIGKILL)

    def close(self) -> None:
        self._f.close()
