"""Checkpoints in object storage (s3://, gs://, az://, hf://, file://: any fsspec URL), read with ranged requests.

The byte-source abstraction, and why it looks like this: every reader in `ckpt_tools` takes a local path, finds
its format from a folder listing (names, sizes) and reads through `pickle_reader.Source` (mmap / preadv). Rather
than give each format a second, remote code path, a URL is *mounted*: its prefix is listed once (one LIST call)
and mirrored as a temporary local folder of sparse files of the listed sizes and times, holding no bytes yet.
The unchanged readers then run on that folder. Bytes arrive in two ways:

1. `Mount.prime` (once, before any reader runs) fetches what any reader reads first, by file signature, with no
   per-format code: small objects whole (JSON, `latest`, a DCP `.metadata`, `common.pt`), the head and tail of
   big ones, then a zip's central directory and its members other than `data/<key>` (`data.pkl`, `version`,
   `byteorder`), a safetensors header, a whole pickle stream. Each round is one batch of independent ranged
   GETs issued in parallel, nearby ranges merged.
2. `ensure(path, start, length)` fetches what is missing of a byte range just before a reader touches it; the
   readers' byte entry points call it (`Source.read_storage`, `ZipSource.member_offset`, `TensorRef.read_into`,
   `load_embedded`, the raw copy in `torch_zip`, whole-file compares). It is a no-op costing one falsy check
   when nothing is mounted, so local runs are unchanged.

Every byte is fetched at most once per command (the sparse file is the cache; fetched ranges are recorded).
The mirror is removed when the command ends (`unmount_all`: also on an exception, Ctrl-C, SIGTERM and at exit);
its folder is named after the process that owns it, so one left by a killed process is removed by the next
mount. `stats()` gives bytes fetched and requests made.

One command reads one version of each object. On S3 every ranged GET carries `If-Match` with the ETag the
listing gave (and the version id, where the bucket is versioned): an object replaced after the listing fails
the next read of it (412), whatever its new size. Other stores are listed once more at the end of the command
(`Mount.check_unchanged`): an object read from whose size, ETag or time changed fails the command before its
output is shown. A read past an object's new end fails at once on every store.

The remote client (fsspec + s3fs, gcsfs, adlfs, huggingface_hub) is imported only when a URL is given: the
core install stays light (`pip install 'ckpt-tools[remote]'`).
"""

from __future__ import annotations

import atexit
import bisect
import errno
import json
import os
import re
import shutil
import signal
import stat
import struct
import tempfile
import threading
import zipfile
from dataclasses import dataclass, field
from datetime import datetime

from ..errors import CkptError, CorruptCheckpoint, NotACheckpoint

#: mounted mirrors: local root (no trailing separator) -> Mount. Empty in a local run.
_MOUNTS: dict[str, "Mount"] = {}

#: objects up to this size are fetched whole when mounted
WHOLE_BYTES = 256 << 10
#: of bigger objects, this much of the head and of the tail (zip directory, safetensors header, signatures)
EDGE_BYTES = 64 << 10
#: a missing range is widened to this alignment, and two missing ranges this close are fetched as one
ALIGN = 64 << 10
#: the most bytes one ranged GET asks for, and the most held in memory by one batch
MAX_RANGE = 16 << 20
MAX_BATCH = 64 << 20
#: small reads planned up front (`plan(..., exact=True)`): far-apart ranges are merged, closest first, down to this
#: many GETs while the bytes fetched stay under this multiple of the bytes needed (`Mount.ensure_small`)
SMALL_GETS = 32
SMALL_BYTES_FACTOR = 4
#: of the optional small ranges (`Mount.ensure_small`: values shown when read, such as every Adam `step`), at most
#: this many bytes are fetched by one plan, in at most `SMALL_GETS` requests
OPTIONAL_BYTES = 16 << 20

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
#: commands that write into the checkpoint they are given, or train from it in place
WRITING_COMMANDS = {
    "set-lr": "edits",
    "set-step": "edits",
    "sync-tp": "edits",
    "restore": "restores",
    "resume": "resumes training from",
}


def is_url(arg: str) -> bool:
    """A `scheme://` argument (not a local path). Windows drive letters never reach here (`C:\\` has no //)."""
    return bool(_URL.match(arg))


@dataclass
class TransferCounters:
    """What one command cost against the store."""

    bytes_fetched: int = 0
    get_requests: int = 0
    list_requests: int = 0
    objects: int = 0
    objects_bytes: int = 0
    #: the small reads a reader planned up front (`plan(..., exact=True)`: a DCP folder's small items): how many
    #: ranges, the bytes they hold (missing ones), and the GETs and bytes that fetched them
    planned_ranges: int = 0
    planned_bytes: int = 0
    planned_gets: int = 0
    planned_fetched: int = 0
    #: optional ranges left unfetched: past the requests and bytes one plan may spend on them
    planned_not_read: int = 0

    def as_dict(self) -> dict:
        out = {
            "bytes_fetched": self.bytes_fetched,
            "requests": self.get_requests + self.list_requests,
            "get_requests": self.get_requests,
            "list_requests": self.list_requests,
            "objects": self.objects,
            "objects_bytes": self.objects_bytes,
        }
        if self.planned_ranges:
            out["small_reads"] = {
                "ranges": self.planned_ranges,
                "bytes_needed": self.planned_bytes,
                "get_requests": self.planned_gets,
                "bytes_fetched": self.planned_fetched,
            }
            if self.planned_not_read:
                out["small_reads"]["not_read"] = self.planned_not_read
        return out


@dataclass
class _File:
    key: str  # the object's path as the filesystem names it
    size: int
    tag: tuple = ()  # what the listing said identifies this version: (ETag, version id, time), what it gave
    have: list[int] = field(default_factory=list)  # sorted, disjoint [start, end) pairs flattened
    #: read streams through this file, most recent last: [where the last read ended, reads in a row, window]
    streams: list[list[int]] = field(default_factory=list)


def storage_options_from(text: str | None) -> dict:
    """`--storage-options` / `CKPT_STORAGE_OPTIONS`: a JSON object passed to the fsspec filesystem
    (`{"anon": true}`, `{"client_kwargs": {"endpoint_url": "http://..."}}`, `{"profile": "x"}`)."""
    text = text if text is not None else os.environ.get("CKPT_STORAGE_OPTIONS")
    if not text:
        return {}
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise CkptError(
            f"--storage-options is not JSON ({e})",
            hint='pass an object, e.g. \'{"client_kwargs": {"endpoint_url": "http://host:9000"}}\'',
        )
    if not isinstance(opts, dict):
        raise CkptError("--storage-options must be a JSON object", hint="e.g. '{\"anon\": true}'")
    return opts


class Mount:
    """A URL's prefix mirrored as a local folder of sparse files; bytes fetched on demand, once."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.counters = TransferCounters()
        self._lock = threading.Lock()
        self._files: dict[str, _File] = {}  # local absolute path -> _File
        self.fs, self._key = _filesystem(self.url, storage_options or {})
        entries = self._list()
        name = self._key.rstrip("/").rsplit("/", 1)[-1] or "root"
        _remove_orphans()
        # the owner's pid in the name: a mirror left by a process that died (SIGKILL, a crash) is removed by the
        # next mount, and never one whose process is alive
        self._tmp = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")
        # two empty levels above the mirror: readers look up to two folders up for the checkpoint that holds
        # a path (formats.enclosing), and must find nothing else there
        self.root = os.path.join(self._tmp, "url", name)
        try:
            self._build(entries)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        if not _MOUNTS:  # a library caller that never closes its mounts still leaves no mirror behind
            atexit.register(unmount_all)
            _catch_sigterm()
        _MOUNTS[self.root] = self

    # --- listing and mirror -------------------------------------------------------------------------

    def _list(self) -> dict[str, dict]:
        self.counters.list_requests += 1
        try:
            found = self.fs.find(self._key, detail=True, withdirs=False)
        except Exception as e:  # noqa: BLE001  every client raises its own types
            raise translate(e, self.url) from e
        if not found:
            # an empty listing: a missing prefix, or a missing bucket (s3fs lists nothing for either)
            self.counters.list_requests += 1
            try:
                info = self.fs.info(self._key)
            except Exception as e:  # noqa: BLE001
                raise translate(e, self.url) from e
            if info.get("type") == "file":
                found = {self._key: info}
        if not found:
            raise NotACheckpoint(
                "no objects under this prefix",
                path=self.url,
                hint="check the URL (list it with your storage client, e.g. aws s3 ls)",
            )
        return found

    def _build(self, entries: dict[str, dict]) -> None:
        base = self._key.rstrip("/")
        self._check_nesting(base, entries)
        for key, info in sorted(entries.items()):
            key = key.rstrip("/")
            if key == base:  # the URL names one object
                rel = ""
            elif key.startswith(base + "/"):
                rel = key[len(base) + 1 :]
            else:
                continue
            if any(part in ("", ".", "..") for part in rel.split("/")) and rel:
                raise CorruptCheckpoint(
                    f"object name {key!r} cannot be mirrored as a path", path=self.url, hint="rename the object"
                )
            local = os.path.join(self.root, *rel.split("/")) if rel else self.root
            os.makedirs(os.path.dirname(local), exist_ok=True)
            size = int(info.get("size") or 0)
            with open(local, "wb") as fh:
                fh.truncate(size)  # sparse: no bytes written, none fetched
            mtime = _mtime(info)
            if mtime is not None:
                os.utime(local, (mtime, mtime))
            self._files[local] = _File(key, size, _version_tag(info))
            self.counters.objects += 1
            self.counters.objects_bytes += size

    def _check_nesting(self, base: str, entries: dict[str, dict]) -> None:
        """Refuse a listing in which one object's name is a "folder" of another's (`p/.metadata` and
        `p/.metadata/evil`): a store holds both, a local mirror cannot (a file and a folder of one name)."""
        rels = {}
        for key in entries:
            key = key.rstrip("/")
            if key == base or key.startswith(base + "/"):
                rels[key[len(base) + 1 :] if key != base else ""] = key
        for rel in sorted(rels):
            parts = rel.split("/") if rel else []
            for n in range(len(parts)):
                outer = "/".join(parts[:n])
                if outer in rels:
                    shown = [self.url + ("/" + r if r else "") for r in (outer, rel)]
                    raise CorruptCheckpoint(
                        f"object {shown[0]} and object {shown[1]} cannot both be mirrored: "
                        "the second lies inside the first as if it were a folder",
                        path=self.url,
                        hint="remove or rename one of the two objects",
                    )

    # --- what is held -------------------------------------------------------------------------------

    def _missing(self, f: _File, start: int, end: int) -> list[tuple[int, int]]:
        end = min(end, f.size)
        out, have = [], f.have
        i = bisect.bisect_right(have, start)
        pos = start
        if i % 2 == 1:  # start lies inside a held range
            pos = max(pos, have[i])
            i += 1
        while pos < end:
            if i < len(have) and have[i] < end:
                if have[i] > pos:
                    out.append((pos, have[i]))
                pos = max(pos, have[i + 1])
                i += 2
            else:
                out.append((pos, end))
                break
        return out

    @staticmethod
    def _add(f: _File, start: int, end: int) -> None:
        pairs = [(f.have[j], f.have[j + 1]) for j in range(0, len(f.have), 2)] + [(start, end)]
        pairs.sort()
        merged: list[list[int]] = []
        for s, e in pairs:
            if merged and s <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], e)
            else:
                merged.append([s, e])
        f.have = [x for pair in merged for x in pair]

    # --- fetching -----------------------------------------------------------------------------------

    def ensure_many(self, wants: list[tuple[str, int, int]], progress=None, align: int | None = None) -> None:
        """Make bytes [start, start+length) of each local mirror path present: the missing parts, widened to
        `align` (ALIGN when None) and merged when close, fetched as one parallel batch of ranged GETs."""
        align = ALIGN if align is None else align
        with self._lock:
            plan: dict[str, list[tuple[int, int]]] = {}
            for path, start, length in wants:
                f = self._files.get(path)
                if f is None or length <= 0:
                    continue
                lo = max(0, start - start % align)
                hi = min(f.size, -(-(start + length) // align) * align)
                for s, e in self._missing(f, lo, hi):
                    plan.setdefault(path, []).append((s, e))
            ranges: list[tuple[str, int, int]] = []
            for path, spans in plan.items():
                spans.sort()
                merged: list[list[int]] = []
                f = self._files[path]
                for s, e in spans:
                    # two ranges a short gap apart are one request, unless bytes held lie between them:
                    # nothing is fetched twice
                    if merged and s <= merged[-1][1]:
                        merged[-1][1] = max(merged[-1][1], e)
                    elif (
                        merged
                        and s - merged[-1][1] <= ALIGN
                        and self._missing(f, merged[-1][1], s) == [(merged[-1][1], s)]
                    ):
                        merged[-1][1] = max(merged[-1][1], e)
                    else:
                        merged.append([s, e])
                for s, e in merged:
                    for cs in range(s, e, MAX_RANGE):
                        ranges.append((path, cs, min(e, cs + MAX_RANGE)))
            batch, held = [], 0
            for r in ranges:
                batch.append(r)
                held += r[2] - r[1]
                if held >= MAX_BATCH:
                    self._fetch(batch, progress)
                    batch, held = [], 0
            if batch:
                self._fetch(batch, progress)

    def ensure_small(self, wants: list[tuple[str, int, int]], optional: list[tuple[str, int, int]] = ()) -> None:
        """Make many small ranges present (one DCP item per tensor, far apart) in few GETs, for few extra bytes:
        the missing parts, merged where they touch; then the closest two runs (in one file, with nothing held
        between them) merged, closest first, while that saves a request worth more than the gap (`ALIGN`: about
        what a round trip costs in transfer), or while there are more than `SMALL_GETS` requests and the bytes
        fetched stay under `SMALL_BYTES_FACTOR` times those needed (plus `ALIGN`). Far-apart `wants` beyond that
        cost one GET each, issued as parallel batches: merging them would fetch the tensor bytes between.

        `optional` ranges (values a reader shows when it has them: one Adam `step` per parameter) are planned the
        same way, but only as many as fit in `SMALL_GETS` requests and `OPTIONAL_BYTES` bytes beside the `wants`,
        the runs that hold the most of them first (a dense run cut at the end of the last range that
        fits): the rest stay unfetched, `held()` says which, and the counters count them (`not_read`). So what
        they cost does not grow with their number, however far apart they lie."""
        with self._lock:
            runs, needed, spans_of = self._missing_runs(wants, optional)
            if not runs:
                return
            merged = self._join_small_gaps(runs, needed)
            if optional:
                merged = self._within_budget(merged, spans_of)
            ranges = [(p, cs, min(e, cs + MAX_RANGE)) for p, s, e, _ in merged for cs in range(s, e, MAX_RANGE)]
            gets, got = self.counters.get_requests, self.counters.bytes_fetched
            self._fetch_batched(ranges)
            c = self.counters
            c.planned_ranges += len(wants) + len(optional)
            c.planned_bytes += needed
            c.planned_gets += c.get_requests - gets
            c.planned_fetched += c.bytes_fetched - got
            c.planned_not_read += sum(
                1
                for path, start, length in optional
                if path in self._files and self._missing(self._files[path], start, start + length)
            )

    def _missing_runs(self, wants: list, optional: list) -> tuple[list[list], int, dict[str, list[tuple[int, int]]]]:
        """`ensure_small`'s first step, for its (path, start, length) ranges: the byte runs not fetched yet (a file's
        overlapping ones joined) as [path, start, end, required]; the bytes they hold; each file's optional spans."""
        runs: list[list] = []  # [path, start, end, required]
        needed = 0
        by_path: dict[str, list[tuple[int, int, bool]]] = {}
        for group, required in ((wants, True), (optional, False)):
            for path, start, length in group:
                f = self._files.get(path)
                if f is None or length <= 0:
                    continue
                by_path.setdefault(path, []).extend(
                    (s, e, required) for s, e in self._missing(f, start, start + length)
                )
        spans_of: dict[str, list[tuple[int, int]]] = {}  # the optional spans of each file, sorted
        for path, spans in by_path.items():
            spans.sort()
            spans_of[path] = [(s, e) for s, e, r in spans if not r]
            first = len(runs)
            for s, e, r in spans:
                if len(runs) > first and s <= runs[-1][2]:
                    if e > runs[-1][2]:
                        needed += e - runs[-1][2]
                        runs[-1][2] = e
                    runs[-1][3] = runs[-1][3] or r
                else:
                    runs.append([path, s, e, r])
                    needed += e - s
        return runs, needed, spans_of

    def _join_small_gaps(self, runs: list[list], needed: int) -> list[list]:
        """`runs` with the gaps between neighbouring runs of one file that hold no fetched byte bridged, smallest
        first: every gap up to `ALIGN`, then more while there are over `SMALL_GETS` runs and the bytes fetched stay
        within `SMALL_BYTES_FACTOR` times those needed."""
        gaps = sorted(  # (size, index of the run before)
            (runs[i + 1][1] - runs[i][2], i)
            for i in range(len(runs) - 1)
            if runs[i][0] == runs[i + 1][0]
            and self._missing(self._files[runs[i][0]], runs[i][2], runs[i + 1][1]) == [(runs[i][2], runs[i + 1][1])]
        )
        joined, fetched, count = set(), needed, len(runs)
        budget = SMALL_BYTES_FACTOR * needed + ALIGN
        for gap, i in gaps:
            if gap > ALIGN and (count <= SMALL_GETS or fetched + gap > budget):
                break
            joined.add(i)
            fetched += gap
            count -= 1
        merged: list[list] = []
        cur = list(runs[0])
        for i in range(1, len(runs)):
            if i - 1 in joined:
                cur[2] = runs[i][2]
                cur[3] = cur[3] or runs[i][3]
            else:
                merged.append(cur)
                cur = list(runs[i])
        merged.append(cur)
        return merged

    def _fetch_batched(self, ranges: list[tuple[str, int, int]]) -> None:
        """Fetch `ranges` in parallel batches of up to `MAX_BATCH` bytes."""
        batch, held = [], 0
        for r in ranges:
            batch.append(r)
            held += r[2] - r[1]
            if held >= MAX_BATCH:
                self._fetch(batch)
                batch, held = [], 0
        if batch:
            self._fetch(batch)

    @staticmethod
    def _within_budget(merged: list[list], spans_of: dict[str, list[tuple[int, int]]]) -> list[list]:
        """The merged runs `ensure_small` fetches: every run that holds a required range, then runs of optional
        ranges alone, most ranges per request first, while they fit in `SMALL_GETS` requests and `OPTIONAL_BYTES`
        (the last one cut at the end of the last optional range that fits)."""
        keep = [r for r in merged if r[3]]
        gets_left = SMALL_GETS - sum(-(-(e - s) // MAX_RANGE) for _, s, e, _ in keep)
        bytes_left = OPTIONAL_BYTES
        scored = []
        for r in merged:
            if not r[3]:
                spans = spans_of[r[0]]
                n = bisect.bisect_left(spans, (r[2], -1)) - bisect.bisect_left(spans, (r[1], -1))
                scored.append((-n, r[1], r))
        scored.sort(key=lambda t: (t[0], t[1]))
        for _, _, r in scored:
            if gets_left <= 0 or bytes_left <= 0:
                break
            path, s, e, _ = r
            if e - s > bytes_left:  # cut at the end of the last optional range that fits
                spans = spans_of[path]
                ends = [se for ss, se in spans[bisect.bisect_left(spans, (s, -1)) : bisect.bisect_left(spans, (e, -1))]]
                fit = [x for x in ends if x - s <= bytes_left]
                if not fit:
                    continue
                e = max(fit)
            keep.append([path, s, e, False])
            gets_left -= -(-(e - s) // MAX_RANGE)
            bytes_left -= e - s
        keep.sort(key=lambda r: (r[0], r[1]))
        return keep

    def _fetch(self, ranges: list[tuple[str, int, int]], progress=None) -> None:
        try:
            if self.pinned:  # each GET pinned to the listed version
                blobs = _s3_get_pinned(self.fs, [(self._files[p], s, e) for p, s, e in ranges])
            else:
                blobs = self.fs.cat_ranges(
                    [self._files[p].key for p, _, _ in ranges],
                    [s for _, s, _ in ranges],
                    [e for _, _, e in ranges],
                    on_error="raise",
                )
        except Exception as e:  # noqa: BLE001
            raise translate(e, self.url) from e
        self.counters.get_requests += len(ranges)
        for (path, s, e), blob in zip(ranges, blobs):
            if isinstance(blob, BaseException):
                raise translate(blob, self._url_of(path)) from blob
            self.counters.bytes_fetched += len(blob)
            if len(blob) != e - s:
                raise CorruptCheckpoint(
                    f"the object changed or was truncated while being read (asked for bytes {s}..{e} of "
                    f"{self._files[path].size} listed, got {len(blob)})",
                    path=self._url_of(path),
                    hint="wait until the upload has finished, then run the command again",
                )
            fd = os.open(path, os.O_WRONLY)
            try:
                done = 0
                view = memoryview(blob)
                while done < len(view):
                    done += os.pwrite(fd, view[done:], s + done)
            finally:
                os.close(fd)
            self._add(self._files[path], s, e)
            if progress is not None:
                progress(e - s)

    @property
    def pinned(self) -> bool:
        """Every read is pinned to the listed version (S3's If-Match): no check at the end is needed."""
        return _is_s3(self.fs)

    def check_unchanged(self) -> None:
        """Raise CorruptCheckpoint naming the first object read from that changed since the listing (another
        size, ETag or time). On S3 every GET was pinned to the listed ETag already: nothing to do. Elsewhere
        this lists the prefix once more (one request)."""
        if self.pinned:
            return
        read = {f.key.rstrip("/"): (p, f) for p, f in self._files.items() if f.have}
        if not read:
            return
        self.fs.invalidate_cache(self._key)  # gcsfs / adlfs keep listings: ask the store again
        try:
            now = {k.rstrip("/"): v for k, v in self._list().items()}  # the same listing as the mount's
        except NotACheckpoint:  # every object gone
            now = {}
        for key, (path, f) in sorted(read.items()):
            info = now.get(key)
            if info is None or int(info.get("size") or 0) != f.size or _version_tag(info) != f.tag:
                raise CorruptCheckpoint(
                    "the object changed while being read (it was replaced or removed after "
                    "the listing: what was read may mix two versions)",
                    path=self._url_of(path),
                    hint="wait until the upload has finished, then run the command again",
                )

    def _url_of(self, path: str) -> str:
        rel = os.path.relpath(path, self.root)
        return self.url if rel == "." else self.url + "/" + rel.replace(os.sep, "/")

    # --- the first reads, by file signature ---------------------------------------------------------

    def prime(self) -> None:
        """Fetch what the readers read before any tensor bytes, for every object, in three parallel rounds
        (see the module docstring)."""
        first = []
        for path, f in self._files.items():
            if f.size <= WHOLE_BYTES:
                first.append((path, 0, f.size))
            else:
                first += [(path, 0, EDGE_BYTES), (path, f.size - EDGE_BYTES, EDGE_BYTES)]
        self.ensure_many(first)
        second, zips = [], []
        for path, f in self._files.items():
            if f.size <= WHOLE_BYTES:
                continue
            with open(path, "rb") as fh:
                head = fh.read(16)
                if head[:4] == b"PK\x03\x04":
                    fh.seek(f.size - EDGE_BYTES)
                    tail = fh.read(EDGE_BYTES)
                    span = _zip_directory(tail, f.size)
                    if span is not None:
                        second.append((path, span[0], span[1] - span[0]))
                        zips.append(path)
                elif head[:1] == b"\x80":  # a pickle stream (legacy torch.save, plain pickle): read whole
                    second.append((path, 0, f.size))
                elif len(head) >= 9 and head[8:9] == b"{":  # safetensors: u64 header length, JSON header
                    (n,) = struct.unpack("<Q", head[:8])
                    if 8 + n <= f.size:
                        second.append((path, 0, 8 + n))
        self.ensure_many(second)
        third = []
        for path in zips:
            try:
                with zipfile.ZipFile(path) as zf:  # reads the EOCD and central directory fetched above
                    infos = zf.infolist()
            except (zipfile.BadZipFile, OSError, ValueError, NotImplementedError, EOFError):
                continue  # the reader gives the error, naming the file
            for info in infos:
                if re.search(r"(^|/)data/\d+$", info.filename):
                    continue  # tensor bytes: fetched when read
                # local header (30 bytes + name + extra, which torch pads up to 64-byte alignment) and data
                third.append((path, info.header_offset, 30 + len(info.filename.encode()) + 256 + info.compress_size))
        self.ensure_many(third)

    def missing_bytes(self) -> int:
        """Bytes not fetched yet, over every object."""
        return sum(e - s for p, f in self._files.items() for s, e in self._missing(f, 0, f.size))

    def fetch_all(self, progress=None) -> None:
        """Every byte of every object (commands whose readers go through torch.load, which this module
        cannot see). `progress(n)` is called with each range's byte count as it lands."""
        self.ensure_many([(p, 0, f.size) for p, f in self._files.items()], progress)

    def close(self) -> None:
        _MOUNTS.pop(self.root, None)
        shutil.rmtree(self._tmp, ignore_errors=True)
        if not _MOUNTS:
            _release_sigterm()


#: the mirror folders' name in the temp folder: `ckpt-remote-<owner pid>-<random>`
_PREFIX = "ckpt-remote-"
_ORPHAN = re.compile(r"^ckpt-remote-(\d+)-")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid this module wrote: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, another user's
        return True
    return True


def _remove_orphans() -> None:
    """Remove the mirror folders of processes that are gone (killed before they could clean up): only folders
    named by this module, owned by this user, whose pid is not running."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        m = _ORPHAN.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(tmp, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)


#: the SIGTERM handler in place before the first mount, while this module's own is installed (else empty)
_SIGTERM_BEFORE: list = []


def _on_sigterm(signum, frame) -> None:
    # a library caller's process ends on SIGTERM without atexit: remove the mirrors, then end as it would have
    unmount_all()
    signal.signal(signum, _SIGTERM_BEFORE.pop() if _SIGTERM_BEFORE else signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _catch_sigterm() -> None:
    """While a mirror exists, SIGTERM removes it before the process ends. Only where SIGTERM would end the
    process at once (the default handler, on the main thread): a handler someone else set (the CLI's, which
    raises and cleans up through `finally`) is left alone."""
    if threading.current_thread() is not threading.main_thread() or _SIGTERM_BEFORE:
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        _SIGTERM_BEFORE.append(signal.signal(signal.SIGTERM, _on_sigterm))
    except (ValueError, OSError):
        pass


def _release_sigterm() -> None:
    if not _SIGTERM_BEFORE or threading.current_thread() is not threading.main_thread():
        return
    before = _SIGTERM_BEFORE.pop()
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:  # else someone set another since: theirs stays
            signal.signal(signal.SIGTERM, before)
    except (ValueError, OSError):
        pass


def _version_tag(info: dict) -> tuple:
    """What a listing entry says identifies this version of the object: ETag (S3, Azure, HF), generation or
    version id (GCS, versioned S3), checksum, and time, as far as the store gives them."""
    tag = []
    for k in ("ETag", "etag", "VersionId", "generation", "md5Hash", "crc32c", "blob_id"):
        v = info.get(k)
        if v is not None:
            tag.append((k, str(v).strip('"')))
    tag.append(("time", _mtime(info)))
    return tuple(tag)


def _is_s3(fs) -> bool:
    return hasattr(fs, "_call_s3") and hasattr(fs, "split_path")


def _s3_get_pinned(fs, ranges: list[tuple["_File", int, int]]) -> list:
    """Ranged GETs, in parallel on s3fs's own event loop and client (its retries, credentials, endpoint), each
    with `If-Match: <listed ETag>` (and the listed version id where there is one): S3 answers 412 for an object
    replaced since the listing instead of bytes of another version. A failed range comes back as its
    exception."""
    import asyncio  # lazy: only on the optional fsspec/s3fs path; its 28 ms import stays off every other command

    from fsspec.asyn import sync  # lazy: fsspec is an optional dependency (the `remote` extra)

    async def one(limit, f: _File, start: int, end: int) -> bytes:
        bucket, key, version = fs.split_path(f.key)
        tag = dict(f.tag)
        kw = {}
        if tag.get("ETag"):
            kw["IfMatch"] = '"' + tag["ETag"] + '"'
        if version or tag.get("VersionId"):
            kw["VersionId"] = version or tag["VersionId"]
        async with limit:
            resp = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **kw)
            try:
                return await resp["Body"].read()
            finally:
                resp["Body"].close()

    async def every():
        limit = asyncio.Semaphore(max(1, min(64, int(getattr(fs, "batch_size", None) or 32))))
        return await asyncio.gather(*(one(limit, *r) for r in ranges), return_exceptions=True)

    return sync(fs.loop, every)  # an exception in place of a range's bytes: the caller names its object


def _zip_directory(tail: bytes, size: int) -> tuple[int, int] | None:
    """[start, end) of a zip's central directory and end records, from the file's last bytes."""
    at = tail.rfind(b"PK\x05\x06")
    if at < 0 or at + 22 > len(tail):
        return None
    tail_start = size - len(tail)
    cd_size, cd_offset = struct.unpack("<II", tail[at + 12 : at + 20])
    end = tail_start + at + 22
    cd_end = tail_start + at  # the central directory ends where the end records begin
    if at >= 20 and tail[at - 20 : at - 16] == b"PK\x06\x07":  # zip64 end records (torch always writes them)
        (z64,) = struct.unpack("<Q", tail[at - 12 : at - 4])
        rec = z64 - tail_start
        if not (0 <= rec and rec + 56 <= len(tail) and tail[rec : rec + 4] == b"PK\x06\x06"):
            return None  # the zip64 record lies before the tail: left to the on-demand reads
        cd_size, cd_offset = struct.unpack("<QQ", tail[rec + 40 : rec + 56])
        cd_end = z64
    if cd_offset + cd_size != cd_end:
        # not one archive from byte 0 (a DCP .distcp: torch.save zips end to end, offsets relative to each)
        return None
    return (cd_offset, end)


def _mtime(info: dict) -> float | None:
    for k in ("LastModified", "last_modified", "mtime", "updated", "created"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        try:
            return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
    return None


def _filesystem(url: str, options: dict):
    try:
        import fsspec  # lazy: fsspec is an optional dependency (the `remote` extra)
    except ImportError:
        raise CkptError(f"reading {url.split('://')[0]}:// URLs needs fsspec", hint="pip install 'ckpt-tools[remote]'")
    try:
        fs, key = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        scheme = url.split("://")[0]
        package = {
            "s3": "'ckpt-tools[remote]'",
            "s3a": "'ckpt-tools[remote]'",
            "gs": "gcsfs",
            "gcs": "gcsfs",
            "az": "adlfs",
            "abfs": "adlfs",
            "hf": "huggingface_hub",
        }.get(scheme)
        raise CkptError(
            f"reading {scheme}:// URLs needs a storage client that is not installed: {e}",
            path=url,
            hint=f"pip install {package}" if package else "install the fsspec implementation it names",
        )
    except (ValueError, TypeError) as e:
        raise CkptError(f"cannot open this URL ({e})", path=url, hint="check the scheme and --storage-options")
    return fs, key


def translate(e: BaseException, url: str) -> CkptError:
    """One line for a storage client's error: what happened to which URL, and what to do."""
    if isinstance(e, CkptError):
        return e
    name = type(e).__name__
    text = str(e)
    low = f"{name} {text}".lower()
    if "nocredentials" in low or "unable to locate credentials" in low or "partialcredentials" in low:
        return CkptError(
            "no credentials found for this store",
            path=url,
            hint="set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
            "--storage-options '{\"anon\": true}' for a public bucket",
        )
    if "nosuchbucket" in low or "bucket does not exist" in low or "specified bucket does not exist" in low:
        return NotACheckpoint("no such bucket", path=url, hint="check the bucket name and the endpoint")
    if isinstance(e, PermissionError) or "accessdenied" in low or "access denied" in low or "forbidden" in low:
        return CkptError(
            "access denied",
            path=url,
            hint="check the credentials in use (AWS_PROFILE, the bucket policy) or pass another "
            "profile with --storage-options",
        )
    if getattr(e, "errno", None) == errno.EBUSY or any(
        w in low
        for w in ("slowdown", "throttl", "toomanyrequests", "too many requests", "503", "reduce your request rate")
    ):  # s3fs: SlowDown -> OSError(EBUSY)
        return CkptError(
            "the store kept throttling the requests after retries",
            path=url,
            hint="run the command again later, or raise the client's retries in --storage-options",
        )
    if isinstance(e, FileNotFoundError) or "nosuchkey" in low or "not found" in low or "404" in low:
        return NotACheckpoint("no such object or prefix", path=url, hint="check the URL")
    if any(
        w in low
        for w in (
            "preconditionfailed",
            "precondition failed",
            "pre-conditions you specified",
            "conditionnotmet",
            "(412)",
        )
    ):
        return CorruptCheckpoint(
            "the object changed while being read (its ETag is no longer the one listed: "
            "it was replaced after the listing)",
            path=url,
            hint="wait until the upload has finished, then run the command again",
        )
    if "invalidrange" in low or "416" in low or "not satisfiable" in low:
        return CorruptCheckpoint(
            "the object changed or was truncated while being read",
            path=url,
            hint="wait until the upload has finished, then run the command again",
        )
    if "endpointconnection" in low or "could not connect" in low or "connection refused" in low:
        return CkptError(
            f"cannot reach the store ({text.splitlines()[0] if text else name})",
            path=url,
            hint="check the endpoint URL (AWS_ENDPOINT_URL or --storage-options) and the network",
        )
    first = text.splitlines()[0] if text else ""
    return CkptError(f"storage error ({name}: {first})", path=url, hint="check the URL, credentials and endpoint")


# --- the hooks the readers call ---------------------------------------------------------------------


def mount_of(path: str) -> Mount | None:
    """The mount that holds local `path`, or None (always None in a local run)."""
    if not _MOUNTS:
        return None
    for root, m in _MOUNTS.items():
        if path == root or path.startswith(root + os.sep):
            return m
    return None


def _held_by(path) -> tuple[Mount, str, _File] | None:
    """(mount, local absolute path, object record) for a mirrored path; None for a local file."""
    p = os.path.abspath(os.fspath(path))
    m = mount_of(p)
    f = m._files.get(p) if m is not None else None
    return None if f is None else (m, p, f)


def ensure(path, start: int, length: int) -> None:
    """Make bytes [start, start+length) of `path` present before a reader touches them: a no-op for a local
    file; for a mirrored object, the missing part is fetched (once)."""
    if not _MOUNTS or length <= 0:
        return
    held = _held_by(path)
    if held is None:
        return
    m, p, f = held
    with m._lock:  # readers on several threads (to-universal's workers) share the streams
        ahead = _read_ahead(f, start, length)
    if not m._missing(f, start, start + length):
        return  # held already (fetched ahead): the next fetch starts where the held bytes end
    m.ensure_many([(p, start, max(length, ahead))])


def _read_ahead(f: _File, start: int, length: int) -> int:
    """How far to fetch for a read at `start`. Reads that follow each other through a file (--stats, export:
    one tensor after the next; un-flattening ZeRO's fp32, exp_avg and exp_avg_sq side by side is three such
    streams) fetch ahead from their third read in a row, in a window that doubles with each read up to
    MAX_RANGE, as the kernel's readahead does: a thousand small tensors cost a few dozen requests, not a
    thousand. A read that follows no stream starts one (at most 8 per file, the oldest dropped)."""
    for i, st in enumerate(f.streams):
        if abs(start - st[0]) <= ALIGN:  # (a zip member's data starts inside the read of its header)
            st[0], st[1] = max(st[0], start + length), st[1] + 1
            if st[1] >= 3:
                st[2] = min(max(2 * st[2], 4 * ALIGN), MAX_RANGE)
            f.streams.append(f.streams.pop(i))
            return st[2]
    f.streams.append([start + length, 1, 0])
    del f.streams[:-8]
    return 0


def ensure_file(path) -> None:
    """The whole of `path` (a whole-file hash or compare)."""
    held = _held_by(path) if _MOUNTS else None
    if held is not None:
        held[0].ensure_many([(held[1], 0, held[2].size)])


def plan(wants, exact: bool = False, optional=()) -> None:
    """Fetch these (path, start, length) ranges now, as one parallel batch per mount: what a reader is about to
    read, planned up front so that its many small reads cost one round of requests. A no-op for local paths.
    `exact`: fetch just these ranges (merged when close, `Mount.ensure_small`), not widened to ALIGN each: many small
    reads far apart (one DCP item per tensor) would each cost ALIGN bytes; what they cost shows in `stats()`'s
    `small_reads`. `optional` (with `exact`): ranges fetched only within a fixed budget of requests and bytes
    (`Mount.ensure_small`); `held()` says afterwards which were."""
    if not _MOUNTS:
        return
    by_mount: dict[Mount, tuple[list, list]] = {}
    for group, ws in ((0, wants), (1, optional)):
        for path, start, length in ws:
            held = _held_by(path)
            if held is not None:
                by_mount.setdefault(held[0], ([], []))[group].append((held[1], start, length))
    for m, (ws, opt) in by_mount.items():
        if exact:
            m.ensure_small(ws, opt)
        else:
            m.ensure_many(ws + opt)


def held(path, start: int, length: int) -> bool:
    """Whether bytes [start, start+length) of `path` can be read without a request: always for a local file; for
    a mirrored object, when they were fetched."""
    h = _held_by(path) if _MOUNTS else None
    if h is None:
        return True
    m, _, f = h
    with m._lock:
        return not m._missing(f, start, start + length)


def mount(url: str, storage_options: dict | None = None, prime: bool = True) -> Mount:
    """List `url` once, mirror it, fetch the first reads; the local path to hand the readers is `.root`."""
    m = Mount(url, storage_options)
    try:
        if prime:
            m.prime()
    except BaseException:
        m.close()
        raise
    return m


def active() -> list[Mount]:
    return list(_MOUNTS.values())


def stats() -> dict | None:
    """Bytes and requests of every mount of this command, summed; None when nothing is mounted."""
    if not _MOUNTS:
        return None
    total = TransferCounters()
    for m in _MOUNTS.values():
        for k, v in m.counters.__dict__.items():
            setattr(total, k, getattr(total, k) + v)
    return total.as_dict()


def to_url(text: str) -> str:
    """`text` with every mirror path spelled as the URL it stands for (output, error lines)."""
    for root, m in _MOUNTS.items():
        if root in text:
            text = text.replace(root, m.url)
    return text


def check_unchanged() -> None:
    """Every mount's `check_unchanged` (the end of a command, before its output is shown)."""
    for m in list(_MOUNTS.values()):
        m.check_unchanged()


def unmount_all() -> None:
    for m in list(_MOUNTS.values()):
        m.close()
