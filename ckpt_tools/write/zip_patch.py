"""Change a torch zip file in place, in O(changed bytes), or write a patched copy of it.

`torch.save` writes a zip of stored (uncompressed) members: `<archive>/data.pkl` plus one member per
storage (`<archive>/data/<key>`), then the central directory and the end records. Every reader (torch's
miniz, Python's zipfile) finds the members through the central directory, located from the end of the file.
So a change never needs the whole file rewritten:

- new tensor VALUES (same shapes and dtypes: sync-tp, a 0-d Adam `step`) are written over the old bytes
  inside the member's data, and the member's CRC-32 is updated from the changed range alone: CRC-32 is
  linear, so crc(new member) = crc(old member) ^ shift(crc(old range) ^ crc(new range), bytes after the
  range), where `shift` multiplies by x^(8n) modulo the CRC polynomial (zlib's crc32_combine maths,
  `crc32_combine` below: zlib does not expose it to Python). The CRC is stored where the zip keeps it: the
  data descriptor after the data (torch/miniz set general-purpose bit 3 and leave the local header's CRC 0),
  or the local header, and always the central directory entry;
- a new pickle (set-lr, set-step on plain counters) becomes a NEW `<archive>/data.pkl` member written after
  the last member's data (over the old central directory), followed by a new central directory and ZIP64 end
  records. The old pickle stays as dead bytes no reader visits. When data.pkl already is the last member (a
  file this module changed before), the new one is written over it, so repeated edits do not grow the file.

`plan_in_place(path, patches, pickle_bytes)` computes those writes — `io.InPlace`: byte ranges and the new
length — without writing; `io.execute` journals the original bytes of every range outside the checkpoint,
fsyncs the journal, then writes (see io.py). `patch_file(src, dst, patches)` writes a patched COPY instead:
the whole-file path (hard-linked files, read-only files, `--copy`).

ZIP64 archives (files > 4 GiB) keep the CRC at the same places: ZIP64 only widens sizes and offsets.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import CorruptCheckpoint, UnsupportedCheckpoint
from .io import ByteEdit, InPlace, copy_file
from .pickle_writer import _central_entry, _data_descriptor, _end_records, _local_header, _pickle_member

_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_CHUNK = 16 << 20


@dataclass(frozen=True)
class Patch:
    """Replace `data` at byte `offset` of member `member`'s (uncompressed, stored) data."""

    member: str
    offset: int
    data: bytes


@dataclass(frozen=True)
class _Member:
    info: zipfile.ZipInfo
    data_offset: int  # where its data starts in the file
    central_offset: int  # where its central directory entry starts in the file


def _members(path: Path, fh) -> dict[str, _Member]:
    """Every member's data offset and central-directory entry offset."""
    try:
        zf = zipfile.ZipFile(fh)
    except zipfile.BadZipFile as e:
        raise CorruptCheckpoint(f"not a zip file ({e})", path=path, hint="only torch.save zip files can be patched")
    out: dict[str, _Member] = {}
    for info, central, _ in _walk_central(path, fh, zf):
        fh.seek(info.header_offset)
        local = fh.read(30)
        if local[:4] != _LOCAL_SIG:
            raise CorruptCheckpoint(
                f"bad local header for {info.filename}", path=path, hint="the file is corrupt; re-copy it"
            )
        lname, lextra = struct.unpack("<HH", local[26:30])
        out[info.filename] = _Member(info, info.header_offset + 30 + lname + lextra, central)
    return out


def _walk_central(path: Path, fh, zf: zipfile.ZipFile) -> Iterator[tuple[zipfile.ZipInfo, int, int]]:
    """(info, offset, length) of every central directory entry, one at a time: the entries follow one another
    in infolist() order from the directory's start."""
    pos = _central_start(zf)
    for info in zf.infolist():
        fh.seek(pos)
        head = fh.read(46)
        if head[:4] != _CENTRAL_SIG:
            raise CorruptCheckpoint(
                f"bad central directory entry for {info.filename}", path=path, hint="the file is corrupt; re-copy it"
            )
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        size = 46 + name_len + extra_len + comment_len
        yield info, pos, size
        pos += size


def _central_start(zf: zipfile.ZipFile) -> int:
    """Where the central directory starts. `zipfile` computes it while reading the end records (ZIP64
    included) and keeps it, plus any bytes prepended to the archive, as `start_dir`."""
    start = getattr(zf, "start_dir", None)
    if start is None:
        raise CorruptCheckpoint("cannot locate the zip central directory", hint="unsupported zip layout")
    return start


def _crc_of(fh, offset: int, size: int) -> int:
    crc = 0
    fh.seek(offset)
    left = size
    while left:
        chunk = fh.read(min(_CHUNK, left))
        if not chunk:
            raise CorruptCheckpoint("zip member runs past the end of the file")
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def patch_file(src: str | os.PathLike, dst: str | os.PathLike, patches: Iterable[Patch]) -> dict[str, int]:
    """Write to `dst` a copy of the torch zip `src` with `patches` applied and CRCs fixed.

    Returns the new CRC-32 of every patched member. Raises before writing anything when a patch
    names a missing or compressed member or runs past a member's end.
    """
    src, dst = Path(src), Path(dst)
    by_member: dict[str, list[Patch]] = {}
    for p in patches:
        by_member.setdefault(p.member, []).append(p)
    with open(src, "rb") as fh:
        members = _members(src, fh)
    _check(src, members, by_member, overlap_ok=True)
    copy_file(src, dst)
    crcs: dict[str, int] = {}
    with open(dst, "r+b") as fh:
        for name, plist in by_member.items():
            m = members[name]
            for p in plist:
                fh.seek(m.data_offset + p.offset)
                fh.write(p.data)
            fh.flush()
            crc = _crc_of(fh, m.data_offset, m.info.file_size)
            crcs[name] = crc
            packed = struct.pack("<I", crc)
            # bit 3: the local header's CRC is 0 and the real one is in the data descriptor after the data
            if m.info.flag_bits & 0x08:
                end = m.data_offset + m.info.compress_size
                fh.seek(end)
                sig = fh.read(4)
                fh.seek(end + 4 if sig == _DESCRIPTOR_SIG else end)
                fh.write(packed)
                fh.seek(m.info.header_offset + 14)
                if fh.read(4) != b"\0\0\0\0":  # a writer that filled both: keep them equal
                    fh.seek(m.info.header_offset + 14)
                    fh.write(packed)
            else:
                fh.seek(m.info.header_offset + 14)
                fh.write(packed)
            fh.seek(m.central_offset + 16)
            fh.write(packed)
    return crcs


# --- CRC-32 arithmetic: zlib's crc32_combine, in Python -------------------------------------------------

_POLY = 0xEDB88320  # CRC-32 (IEEE 802.3), reflected


def _multmodp(a: int, b: int) -> int:
    """a x b modulo the CRC polynomial, in the reflected bit order zlib uses (x^0 is bit 31)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    t, p = [], 1 << 30  # x^1
    for _ in range(32):
        t.append(p)
        p = _multmodp(p, p)
    return t


_X2N = _x2n_table()  # x^(2^k) mod p


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the CRC polynomial."""
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len(B), without reading A or B
    (zlib's crc32_combine)."""
    return _multmodp(_x2nmodp(len2, 3), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


def crc32_update(crc: int, old: bytes, new: bytes, after: int) -> int:
    """The CRC-32 of a member whose bytes `old` (followed by `after` more bytes) became `new` (same length),
    from the member's old CRC `crc` and the changed range alone: CRC-32 is affine, so the change of the CRC is
    crc(old) ^ crc(new) carried through the `after` bytes that follow."""
    if len(old) != len(new):
        raise ValueError("a range changed in place keeps its length")
    return (crc ^ crc32_combine(zlib.crc32(old) ^ zlib.crc32(new), 0, after)) & 0xFFFFFFFF


# --- in place --------------------------------------------------------------------------------------------


def _central_entries(path: Path, fh, zf: zipfile.ZipFile) -> list[tuple[zipfile.ZipInfo, bytes]]:
    """Every central directory entry, in order, with its raw bytes."""
    out = []
    for info, pos, size in _walk_central(path, fh, zf):
        fh.seek(pos)
        out.append((info, fh.read(size)))
    return out


def _descriptor_crc_at(fh, m: _Member) -> int:
    """Where the data descriptor after member `m` keeps its CRC-32 (the signature is optional)."""
    end = m.data_offset + m.info.compress_size
    fh.seek(end)
    return end + 4 if fh.read(4) == _DESCRIPTOR_SIG else end


def plan_in_place(path: str | os.PathLike, patches: Iterable[Patch] = (), pickle_bytes: bytes | None = None) -> InPlace:
    """The byte ranges that change the torch zip `path` in place (nothing is written here): `patches` over
    members' data with each patched member's CRC-32 updated from the changed ranges alone, and, with
    `pickle_bytes`, a new data.pkl member plus a new central directory and end records (see the module
    docstring). Reads only the central directory, the patched ranges and a few header bytes. Raises
    (CorruptCheckpoint / UnsupportedCheckpoint) before anything is written when a patch names a missing or
    compressed member or runs past a member's end, or the file is not a torch zip."""
    path = Path(path)
    by_member: dict[str, list[Patch]] = {}
    for p in patches:
        if p.data:
            by_member.setdefault(p.member, []).append(p)
    edits: dict[int, bytes] = {}
    with open(path, "rb") as fh:
        if fh.read(2) != b"PK":
            raise UnsupportedCheckpoint("not a torch zip file; only those are changed in place", path=path)
        fh.seek(0)
        size = os.fstat(fh.fileno()).st_size
        members = _members(path, fh)
        _check(path, members, by_member)
        try:
            zf = zipfile.ZipFile(fh)
        except zipfile.BadZipFile as e:
            raise CorruptCheckpoint(f"not a zip file ({e})", path=path) from None
        entries = _central_entries(path, fh, zf)
        cd_start = _central_start(zf)
        crcs: dict[str, int] = {}
        for name, plist in by_member.items():
            m = members[name]
            crc = m.info.CRC
            for p in sorted(plist, key=lambda q: q.offset):
                fh.seek(m.data_offset + p.offset)
                old = fh.read(len(p.data))
                crc = crc32_update(crc, old, p.data, m.info.file_size - p.offset - len(p.data))
                edits[m.data_offset + p.offset] = bytes(p.data)
            crcs[name] = crc
            packed = struct.pack("<I", crc)
            if m.info.flag_bits & 0x08:
                edits[_descriptor_crc_at(fh, m)] = packed
                fh.seek(m.info.header_offset + 14)
                if fh.read(4) != b"\0\0\0\0":  # a writer that filled both: keep them equal
                    edits[m.info.header_offset + 14] = packed
            else:
                edits[m.info.header_offset + 14] = packed
        if pickle_bytes is None:
            for (info, raw), pos in zip(entries, _positions(cd_start, entries)):
                if info.filename in crcs:
                    edits[pos + 16] = struct.pack("<I", crcs[info.filename])
            return _in_place(edits, size)
        pkl_name, prefix, alignment = _pickle_member(zf, members, path)
        last = max(members.values(), key=lambda m: m.info.header_offset)
        start = last.info.header_offset if last.info.filename == pkl_name else cd_start
    name = pkl_name.encode("utf-8")
    header = _local_header(name, start, len(pickle_bytes), alignment)
    crc = zlib.crc32(pickle_bytes)
    tail = [header, pickle_bytes, _data_descriptor(crc, len(pickle_bytes), start)]
    directory = []
    for info, raw in entries:
        if info.filename == pkl_name:
            directory.append(_central_entry(name, start, len(pickle_bytes), crc))
        elif info.filename in crcs:
            directory.append(raw[:16] + struct.pack("<I", crcs[info.filename]) + raw[20:])
        else:
            directory.append(raw)
    cd = b"".join(directory)
    cd_at = start + sum(map(len, tail))
    tail += [cd, _end_records(len(directory), cd_at, len(cd))]
    blob = b"".join(tail)
    edits[start] = blob
    return _in_place(edits, start + len(blob))


def _positions(cd_start: int, entries) -> list[int]:
    out, pos = [], cd_start
    for _, raw in entries:
        out.append(pos)
        pos += len(raw)
    return out


def _in_place(edits: dict[int, bytes], size: int) -> InPlace:
    ranges = sorted(edits.items())
    for (a, da), (b, _) in zip(ranges, ranges[1:]):
        if a + len(da) > b:
            raise CorruptCheckpoint("overlapping changes in one zip file", hint="patch each range once")
    return InPlace(tuple(ByteEdit(off, data) for off, data in ranges), size)


def _check(
    path: Path, members: dict[str, _Member], by_member: dict[str, list[Patch]], overlap_ok: bool = False
) -> None:
    """Raises unless every patch lies inside a stored (uncompressed) member that exists; with
    `overlap_ok` False, also when two patches of one member overlap."""
    for name, plist in by_member.items():
        m = members.get(name)
        if m is None:
            raise CorruptCheckpoint(
                f"zip member {name} is missing",
                path=path,
                hint="the checkpoint changed since it was read; run the command again",
            )
        if m.info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpoint(
                f"zip member {name} is compressed",
                path=path,
                hint="only stored members (what torch.save writes) can be patched in place",
            )
        spans = sorted((p.offset, p.offset + len(p.data)) for p in plist)
        for p in plist:
            if p.offset < 0 or p.offset + len(p.data) > m.info.file_size:
                raise CorruptCheckpoint(
                    f"patch [{p.offset}, {p.offset + len(p.data)}) lies outside member {name} "
                    f"({m.info.file_size} bytes)",
                    path=path,
                    hint="the checkpoint changed since it was read; run the command again",
                )
        if not overlap_ok and any(a_end > b for (_, a_end), (b, _) in zip(spans, spans[1:])):
            raise CorruptCheckpoint(f"overlapping patches in member {name}", path=path)


def apply_in_place(path: str | os.PathLike, change: InPlace) -> None:
    """Write `change` into `path` (no journal: io.execute journals first; tests and copies use this)."""
    with open(path, "r+b") as fh:
        for e in change.edits:
            os.pwrite(fh.fileno(), e.data, e.offset)
        os.ftruncate(fh.fileno(), change.size)
