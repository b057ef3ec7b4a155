"""zip_patch: torch zip files with some storage bytes replaced, CRCs fixed, nothing else touched."""

from __future__ import annotations

import struct
import zipfile
import zlib

import pytest
import torch

from ckpt_tools.errors import CorruptCheckpoint
from ckpt_tools.read.pickle_reader import load
from ckpt_tools.write.zip_patch import Patch, patch_file


def members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


def storage_member(path, key: str) -> tuple[str, int]:
    """(zip member, byte offset) of the tensor `key` of a torch.save'd dict, found by our reader."""
    ref = load(path).obj[key]
    return f"{ref.storage.source.prefix}data/{ref.storage.key}", ref.storage_offset * ref.nbytes // ref.numel


@pytest.fixture
def saved(tmp_path):
    sd = {
        "a": torch.arange(10, dtype=torch.float32),
        "b": torch.linspace(-1, 1, 8).to(torch.bfloat16),
        "c": torch.ones(3, 4),
        "step": torch.tensor(7.0),
        "note": "kept",
    }
    p = tmp_path / "f.pt"
    torch.save(sd, p)
    return p, sd


def test_patched_file_loads_with_new_values_and_correct_crcs(saved, tmp_path):
    src, sd = saved
    before = members(src)
    ma, oa = storage_member(src, "a")
    mb, ob = storage_member(src, "b")
    new_a = torch.tensor([100.0, 200.0])
    new_b = torch.tensor([0.5, 0.25, -3.0], dtype=torch.bfloat16)
    dst = tmp_path / "out.pt"
    crcs = patch_file(
        src,
        dst,
        [
            Patch(ma, oa + 2 * 4, new_a.numpy().tobytes()),
            Patch(mb, ob + 4 * 2, new_b.view(torch.int16).numpy().tobytes()),
        ],
    )
    assert dst.stat().st_size == src.stat().st_size
    with zipfile.ZipFile(dst) as zf:
        assert zf.testzip() is None  # every member's data matches its central-directory CRC
        for name in (ma, mb):
            info = zf.getinfo(name)
            assert info.CRC == crcs[name] == zlib.crc32(zf.read(name))
    got = torch.load(dst, weights_only=True)
    want_a = sd["a"].clone()
    want_a[2:4] = new_a
    want_b = sd["b"].clone()
    want_b[4:7] = new_b
    assert torch.equal(got["a"], want_a) and torch.equal(got["b"], want_b)
    assert torch.equal(got["c"], sd["c"]) and got["step"].item() == 7.0 and got["note"] == "kept"
    after = members(dst)
    assert set(after) == set(before)
    for name in before:
        if name not in (ma, mb):
            assert after[name] == before[name], name  # data.pkl and every other storage byte-identical
    # torch writes data descriptors (general-purpose bit 3): the descriptor's CRC was fixed too
    raw = dst.read_bytes()
    with zipfile.ZipFile(dst) as zf:
        info = zf.getinfo(ma)
        assert info.flag_bits & 0x08
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
        end = info.header_offset + 30 + name_len + extra_len + info.compress_size
        assert raw[end : end + 4] == b"PK\x07\x08" and struct.unpack("<I", raw[end + 4 : end + 8])[0] == crcs[ma]


def test_source_is_untouched_and_bad_patches_write_nothing(saved, tmp_path):
    src, _ = saved
    orig = src.read_bytes()
    ma, oa = storage_member(src, "a")
    dst = tmp_path / "out.pt"
    with pytest.raises(CorruptCheckpoint, match="outside member"):
        patch_file(src, dst, [Patch(ma, oa + 39, b"\0\0")])  # 40-byte member: runs past its end
    with pytest.raises(CorruptCheckpoint, match="missing"):
        patch_file(src, dst, [Patch("f/data/999", 0, b"\0")])
    assert not dst.exists()
    patch_file(src, dst, [Patch(ma, oa, b"\1\2\3\4")])
    assert src.read_bytes() == orig


def test_zip64_archive(tmp_path, monkeypatch):
    """ZIP64 records (zip64 extra fields, sizes 0xFFFFFFFF, the ZIP64 end of central directory), as torch
    writes for files over 4 GiB; made small by lowering zipfile's limit while writing."""
    p = tmp_path / "z64.zip"
    payload = {f"arch/data/{i}": bytes(range(256)) * 4 for i in range(3)}
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in payload.items():
            zf.writestr(name, data)
    monkeypatch.undo()
    raw = p.read_bytes()
    assert b"PK\x06\x06" in raw and b"\xff\xff\xff\xff" in raw  # really ZIP64
    dst = tmp_path / "out.zip"
    patch_file(p, dst, [Patch("arch/data/1", 1000, b"XYZ")])
    got = members(dst)
    want = dict(payload)
    want["arch/data/1"] = payload["arch/data/1"][:1000] + b"XYZ" + payload["arch/data/1"][1003:]
    assert got == want
    with zipfile.ZipFile(dst) as zf:
        assert zf.testzip() is None
        info = zf.getinfo("arch/data/1")
        assert not info.flag_bits & 0x08  # this writer keeps the CRC in the local header
    assert struct.unpack("<I", dst.read_bytes()[info.header_offset + 14 : info.header_offset + 18])[0] == zlib.crc32(
        want["arch/data/1"]
    )


# --- in place (issue 14): CRC-32 from the changed range alone, a new data.pkl appended ----------------------

import os  # noqa: E402
import random  # noqa: E402

from ckpt_tools.write import pickle_writer  # noqa: E402
from ckpt_tools.write.zip_patch import apply_in_place, crc32_combine, crc32_update, plan_in_place  # noqa: E402


def test_crc32_combine_and_update_match_zlib():
    rng = random.Random(3)
    for n1, n2 in [(0, 0), (1, 0), (0, 7), (13, 1), (1000, 4097), (65536, 3)]:
        a, b = rng.randbytes(n1), rng.randbytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b)
    data = bytearray(rng.randbytes(10_000))
    crc = zlib.crc32(data)
    for off, n in [(0, 10), (5000, 1), (9990, 10), (17, 4000)]:
        new = rng.randbytes(n)
        crc = crc32_update(crc, bytes(data[off : off + n]), new, len(data) - off - n)
        data[off : off + n] = new
        assert crc == zlib.crc32(data)
    # shifting by lengths too large to materialise composes: (A+B)+C == A+(B+C) with |B|, |C| of GiBs
    c1, c2, c3 = 0x12345678, 0x9ABCDEF0, 0x0F1E2D3C
    big, bigger = 5 << 30, 3 << 32
    assert crc32_combine(crc32_combine(c1, c2, big), c3, bigger) == crc32_combine(
        c1, crc32_combine(c2, c3, bigger), big + bigger
    )


def _applied_copy(src, tmp_path, change, name="inplace.pt"):
    dst = tmp_path / name
    dst.write_bytes(src.read_bytes())
    apply_in_place(dst, change)
    return dst


def test_in_place_patches_give_exactly_the_patched_copy(saved, tmp_path):
    """Tensor bytes overwritten in place, CRC-32s updated from the changed ranges alone: byte for byte the file
    `patch_file` writes (which recomputes the CRC over the whole member), loaded by torch plainly and with mmap."""
    src, sd = saved
    ma, oa = storage_member(src, "a")
    mb, ob = storage_member(src, "b")
    patches = [
        Patch(ma, oa + 2 * 4, torch.tensor([100.0, 200.0]).numpy().tobytes()),
        Patch(ma, oa + 7 * 4, torch.tensor([-1.0]).numpy().tobytes()),
        Patch(mb, ob + 4 * 2, torch.tensor([0.5], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()),
    ]
    copy = tmp_path / "copy.pt"
    patch_file(src, copy, patches)
    change = plan_in_place(src, patches)
    assert change.size == src.stat().st_size and change.nbytes < 100  # data + 2 x (descriptor, central) CRCs
    dst = _applied_copy(src, tmp_path, change)
    assert dst.read_bytes() == copy.read_bytes()
    for mmap in (False, True):
        got = torch.load(dst, weights_only=False, mmap=mmap)
        assert got["a"].tolist() == [0, 1, 100, 200, 4, 5, 6, -1, 8, 9] and got["note"] == "kept"


def test_new_pickle_is_appended_and_the_old_one_left_dead(saved, tmp_path):
    """A new data.pkl member after the last member, a new central directory and end records: torch (plain and
    mmap) loads the edited tree with every tensor as it was; zipfile finds every CRC right. A second edit writes
    over the first's pickle (the last member), so repeated edits do not grow the file."""
    src, sd = saved
    orig = src.read_bytes()
    tree = load(src).obj
    tree["note"] = "edited in place"
    tree["lr"] = 0.5
    pkl = pickle_writer.dumps(tree)
    change = plan_in_place(src, (), pkl)
    assert change.size > len(orig) and change.nbytes < len(pkl) + 2000  # the pickle and the directory only
    assert change.edits[0].offset >= len(orig) - 1000  # written where the old central directory was
    dst = _applied_copy(src, tmp_path, change)
    assert dst.read_bytes()[: change.edits[0].offset] == orig[: change.edits[0].offset]  # nothing before it moved
    with zipfile.ZipFile(dst) as zf:
        assert zf.testzip() is None
        infos = {i.filename: i for i in zf.infolist()}
        assert max(infos.values(), key=lambda i: i.header_offset).filename.endswith("/data.pkl")
        assert zf.read(next(n for n in infos if n.endswith("/data.pkl"))) == pkl
    for mmap in (False, True):
        got = torch.load(dst, weights_only=False, mmap=mmap)
        assert got["note"] == "edited in place" and got["lr"] == 0.5
        for k in ("a", "b", "c", "step"):
            assert torch.equal(got[k], sd[k])
    # again, with the step tensor's bytes too: the new pickle goes over the last one
    tree2 = load(dst).obj
    tree2["note"] = "twice"
    ms, os_ = storage_member(dst, "step")
    change2 = plan_in_place(dst, [Patch(ms, os_, torch.tensor(9.0).numpy().tobytes())], pickle_writer.dumps(tree2))
    assert change2.size <= dst.stat().st_size + 16
    dst2 = _applied_copy(dst, tmp_path, change2, "twice.pt")
    with zipfile.ZipFile(dst2) as zf:
        assert zf.testzip() is None
    got = torch.load(dst2, weights_only=True, mmap=True)
    assert got["note"] == "twice" and got["step"].item() == 9.0 and torch.equal(got["c"], sd["c"])


def test_in_place_on_a_zip64_archive(tmp_path, monkeypatch):
    p = tmp_path / "z64.zip"
    payload = {f"arch/data/{i}": bytes(range(256)) * 4 for i in range(3)}
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 100)
    with zipfile.ZipFile(p, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        zf.writestr("arch/data.pkl", b"old pickle")
        for name, data in payload.items():
            zf.writestr(name, data)
    monkeypatch.undo()
    copy = tmp_path / "copy.zip"
    patch_file(p, copy, [Patch("arch/data/1", 1000, b"XYZ")])
    assert (
        _applied_copy(p, tmp_path, plan_in_place(p, [Patch("arch/data/1", 1000, b"XYZ")])).read_bytes()
        == copy.read_bytes()
    )
    dst = _applied_copy(p, tmp_path, plan_in_place(p, [Patch("arch/data/2", 0, b"Q")], b"new pickle"), "n.zip")
    got = members(dst)
    assert got["arch/data.pkl"] == b"new pickle" and got["arch/data/2"] == b"Q" + payload["arch/data/2"][1:]
    assert got["arch/data/0"] == payload["arch/data/0"]
    with zipfile.ZipFile(dst) as zf:
        assert zf.testzip() is None


def test_bad_in_place_patches_are_refused_before_any_write(saved):
    src, _ = saved
    orig = src.read_bytes()
    ma, oa = storage_member(src, "a")
    with pytest.raises(CorruptCheckpoint, match="outside member"):
        plan_in_place(src, [Patch(ma, oa + 39, b"\0\0")])
    with pytest.raises(CorruptCheckpoint, match="overlapping"):
        plan_in_place(src, [Patch(ma, 0, b"\0\0\0\0"), Patch(ma, 2, b"\1\1")])
    assert src.read_bytes() == orig and os.path.getsize(src) == len(orig)
