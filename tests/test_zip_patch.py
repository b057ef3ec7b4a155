"""zip_patch: torch zip files with some storage bytes replaced, CRCs fixed, nothing else touched."""
from __future__ import annotations

import struct
import zipfile
import zlib

import pytest
import torch

from ckpt_tools.errors import CorruptCheckpoint
from ckpt_tools.pickle_reader import load
from ckpt_tools.zip_patch import Patch, patch_file


def members(path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {i.filename: zf.read(i) for i in zf.infolist()}


def storage_member(path, key: str) -> tuple[str, int]:
    """(zip member, byte offset) of the tensor `key` of a torch.save'd dict, found by our reader."""
    ref = load(path).obj[key]
    return f"{ref.storage.source.prefix}data/{ref.storage.key}", ref.storage_offset * ref.nbytes // ref.numel


@pytest.fixture
def saved(tmp_path):
    sd = {"a": torch.arange(10, dtype=torch.float32), "b": torch.linspace(-1, 1, 8).to(torch.bfloat16),
          "c": torch.ones(3, 4), "step": torch.tensor(7.0), "note": "kept"}
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
    crcs = patch_file(src, dst, [Patch(ma, oa + 2 * 4, new_a.numpy().tobytes()),
                                 Patch(mb, ob + 4 * 2, new_b.view(torch.int16).numpy().tobytes())])
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
        name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26: info.header_offset + 30])
        end = info.header_offset + 30 + name_len + extra_len + info.compress_size
        assert raw[end: end + 4] == b"PK\x07\x08" and struct.unpack("<I", raw[end + 4: end + 8])[0] == crcs[ma]


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
    assert struct.unpack("<I", dst.read_bytes()[info.header_offset + 14: info.header_offset + 18])[0] == \
        zlib.crc32(want["arch/data/1"])
