"""Rewrite a torch zip file with some bytes of some members replaced, without unpickling anything.

`torch.save` writes a zip of stored (uncompressed) members: `<archive>/data.pkl` plus one member per
storage (`<archive>/data/<key>`). When only tensor VALUES change (same shapes, same dtypes), the pickle
is untouched and the new file differs from the old one only inside those members' data, and in the
CRC-32 of each changed member. So instead of `torch.load` + `torch.save` (the whole file in memory, the
pickle re-emitted, objects of classes that must be importable) we:

1. copy the file to `dst` (outside the checkpoint: the caller's staging path) with
   `os.copy_file_range` (in-kernel, reflinked on filesystems that can) or chunked reads;
2. write the new bytes at their offsets inside the member data;
3. recompute each patched member's CRC-32 (reading that member only) and store it where the zip keeps
   it: the local header, or — torch/miniz set general-purpose bit 3 and leave the local header's CRC 0 —
   the data descriptor after the data; and always the central directory entry.

ZIP64 archives (files > 4 GiB, torch writes them for big optimizer states) keep the CRC at the same
places: ZIP64 only widens sizes and offsets, which `zipfile` decodes for us and which never change here.
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from .errors import CorruptCheckpoint
from .io import copy_file

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
    infos = zf.infolist()
    # the central directory: its entries follow one another in infolist() order
    out: dict[str, _Member] = {}
    pos = _central_start(zf)
    for info in infos:
        fh.seek(pos)
        head = fh.read(46)
        if head[:4] != _CENTRAL_SIG:
            raise CorruptCheckpoint(f"bad central directory entry for {info.filename}", path=path,
                                    hint="the file is corrupt; re-copy it")
        name_len, extra_len, comment_len = struct.unpack("<HHH", head[28:34])
        central = pos
        pos += 46 + name_len + extra_len + comment_len
        fh.seek(info.header_offset)
        local = fh.read(30)
        if local[:4] != _LOCAL_SIG:
            raise CorruptCheckpoint(f"bad local header for {info.filename}", path=path,
                                    hint="the file is corrupt; re-copy it")
        lname, lextra = struct.unpack("<HH", local[26:30])
        out[info.filename] = _Member(info, info.header_offset + 30 + lname + lextra, central)
    return out


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
    for name, plist in by_member.items():
        m = members.get(name)
        if m is None:
            raise CorruptCheckpoint(f"zip member {name} is missing", path=src,
                                    hint="the checkpoint changed since it was read; run the command again")
        if m.info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpoint(f"zip member {name} is compressed", path=src,
                                    hint="only stored members (what torch.save writes) can be patched in place")
        for p in plist:
            if p.offset < 0 or p.offset + len(p.data) > m.info.file_size:
                raise CorruptCheckpoint(f"patch [{p.offset}, {p.offset + len(p.data)}) lies outside member {name} "
                                        f"({m.info.file_size} bytes)", path=src,
                                        hint="the checkpoint changed since it was read; run the command again")
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

