"""The DCP `.metadata` reader in C (`read.native_dcp`) against the inert unpickler it stands in for: on every DCP /
torch_dist sample it reads what the unpickler's records say (same entries, same order, same globals) and `inspect`
answers byte for byte alike with and without it; on hostile `.metadata` (a REDUCE of a global, a memo bomb, a
10^12-element declared shape, an item past the end of its file) and on seeded mutations of a real one, it either
reads exactly what the unpickler reads or hands the file to the unpickler. Skipped where no C compiler is found."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import shutil
from pathlib import Path

import pytest

from conftest import SAMPLES
from hostile import pickles as H
from hostile.runner import run
from test_dcp_lazy_open import _Call, declare_a_trillion_elements  # _Call: an object pickled as a call of a global
from test_hostile_pickles import HASH_BOMBS
from ckpt_tools.errors import CorruptCheckpoint
from ckpt_tools.formats import dcp
from ckpt_tools.read import native_dcp, native_walk, pickle_reader as P

METADATA = sorted(SAMPLES.rglob(".metadata"))


@pytest.fixture(autouse=True)
def c_reader(request):
    if not native_dcp.available() and request.function is not test_the_c_reader_builds_where_a_compiler_is_found:
        pytest.skip("no C reader here (no C compiler, or CKPT_NATIVE=0)")


def test_the_c_reader_builds_where_a_compiler_is_found(tmp_path):
    """A working C compiler and CKPT_NATIVE not 0: the reader must build (an error in its source would otherwise only
    show as every other test here skipped, and every open on the slower path)."""
    import subprocess

    cc = os.environ.get("CC", "cc")
    (tmp_path / "t.c").write_text("int f(void) { return 0; }\n")
    try:
        works = subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "t.so"), str(tmp_path / "t.c")]).returncode
    except OSError:
        works = 1
    if os.environ.get("CKPT_NATIVE", "1") == "0" or works != 0:
        pytest.skip("no working C compiler here, or CKPT_NATIVE=0")
    assert native_dcp.available()


def _python_view(path: Path) -> native_dcp.Metadata:
    """What the inert unpickler's records of `path` say, in `native_dcp.Metadata`'s terms (raises where it does)."""
    loaded = P.load(path)
    md = loaded.obj
    sdm = {}
    for key, meta in md.field("state_dict_metadata").items():
        if P.is_opaque(meta, "BytesStorageMetadata"):
            sdm[key] = None
            continue
        st = meta.state
        chunks = [(tuple(c.state["offsets"]), tuple(c.state["sizes"])) for c in st["chunks"]]
        sdm[key] = (dcp._props_dtype(st["properties"]), tuple(st["size"]), chunks)
    where, files = {}, {}
    for i, s in md.field("storage_data").items():
        rel = s.field("relative_path")
        files.setdefault(rel, i.field("fqn"))
        where[(i.field("fqn"), dcp._offsets(i.field("offset")))] = (rel, s.field("offset"), s.field("length"))
    try:
        assert where == dcp._storage_index(md.field("storage_data"), path)
    except CorruptCheckpoint as e:  # a bad file name: the same refusal from `files`
        with pytest.raises(CorruptCheckpoint) as got:
            dcp._check_files(files, path)
        assert str(got.value) == str(e)
    planner = md.field("planner_data")
    return native_dcp.Metadata(
        sdm, where, files, planner if isinstance(planner, dict) else {}, md.field("version"), loaded.globals_seen
    )


def _same(a: native_dcp.Metadata, b: native_dcp.Metadata) -> bool:
    return (
        a == b
        and list(a.state_dict_metadata) == list(b.state_dict_metadata)
        and list(a.planner_data) == list(b.planner_data)
    )


@pytest.mark.parametrize("path", METADATA, ids=lambda p: str(p.parent.relative_to(SAMPLES)))
def test_every_sample_metadata_reads_as_the_unpickler_reads_it(path):
    got = native_dcp.read(path)
    assert got is not None, "the C reader hands a sample written by torch's own dcp.save to Python"
    assert _same(got, _python_view(path))


def _folders() -> list[Path]:
    out = []
    for meta in METADATA:
        out.append(meta.parent)
        if meta.parent.name.startswith("iter_"):
            out.append(meta.parent.parent)  # a Megatron-LM run folder
    return out


def _both(*argv, timeout: float = 120):
    """`ckpt ARGV` with the C reader, then with the unpickler (the C reader switched off): (with, without)."""
    first = run(*argv, timeout=timeout)
    saved = native_walk._bound.get("dcp")
    native_walk._bound["dcp"] = None  # as where it cannot be built
    try:
        second = run(*argv, timeout=timeout)
    finally:
        native_walk._bound["dcp"] = saved
    return first, second


def _assert_alike(a, b) -> None:
    assert a.traceback is None and b.traceback is None, (a.traceback, b.traceback)
    assert (a.code, a.stdout, a.stderr) == (b.code, b.stdout, b.stderr)


@pytest.mark.parametrize("folder", _folders(), ids=lambda p: str(p.relative_to(SAMPLES)))
def test_inspect_answers_alike_with_and_without_the_c_reader(folder):
    _assert_alike(*_both("inspect", folder, "--json"))


def test_inspect_stats_alike_with_and_without_the_c_reader():
    _assert_alike(*_both("inspect", SAMPLES / "fsdp" / "fsdp2_dcp", "--json", "--stats"))


# --- hostile .metadata ------------------------------------------------------------------------------------------


def _copy(tmp_path: Path) -> Path:
    return shutil.copytree(SAMPLES / "fsdp" / "fsdp2_dcp", tmp_path / "ck")


def _metadata(folder: Path):
    import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)

    return pickle.loads((folder / ".metadata").read_bytes())


def test_a_reduce_of_a_global_runs_nothing_and_answers_alike(tmp_path):
    """os.system named where a record is expected (an item's `_StorageInfo`): the C reader hands the file to the
    unpickler, which refuses it; named in a field neither reads (`storage_meta`): both read it, run nothing, and
    warn of the same unknown global."""
    folder = _copy(tmp_path)
    marker = tmp_path / "marker"
    md = _metadata(folder)
    idx = next(iter(md.storage_data))
    bad = dict(md.storage_data)
    bad[idx] = _Call(os.system, f"touch {marker}")
    (folder / ".metadata").write_bytes(pickle.dumps(dataclasses.replace(md, storage_data=bad)))
    assert native_dcp.read(folder / ".metadata") is None
    a, b = _both("inspect", folder, "--json")
    _assert_alike(a, b)
    assert a.code == 2
    (folder / ".metadata").write_bytes(
        pickle.dumps(dataclasses.replace(md, storage_meta=_Call(os.system, f"touch {marker}")))
    )
    got = native_dcp.read(folder / ".metadata")
    assert got is not None and _same(got, _python_view(folder / ".metadata"))
    assert any("system" in g for g in got.globals_seen)
    a, b = _both("inspect", folder, "--json")
    _assert_alike(a, b)
    assert "system" in a.stdout and a.code == 0
    assert not marker.exists()


def test_a_memo_bomb_is_refused_alike(tmp_path):
    folder = _copy(tmp_path)
    H.poison_file(folder / ".metadata", HASH_BOMBS["dict_key_memo"], "prefix")
    assert native_dcp.read(folder / ".metadata") is None
    a, b = _both("inspect", folder, "--json", timeout=60)
    _assert_alike(a, b)
    assert a.code == 2 and "hash bomb" in a.stderr


def test_a_trillion_element_shape_and_an_item_past_its_file_answer_alike(tmp_path):
    folder = _copy(tmp_path)
    md = _metadata(folder)
    key = declare_a_trillion_elements(md)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    got = native_dcp.read(folder / ".metadata")
    assert got is not None and got.state_dict_metadata[key][1] == (10**6, 10**6)
    a, b = _both("inspect", folder, "--json", timeout=60)
    _assert_alike(a, b)
    assert a.code == 2 and key in a.stderr

    md = _metadata(_copy(tmp_path / "2"))
    folder = tmp_path / "2" / "ck"
    idx, info = next((i, s) for i, s in md.storage_data.items() if i.offset is not None and len(i.offset) == 2)
    md.storage_data[idx] = dataclasses.replace(info, offset=(folder / info.relative_path).stat().st_size + 100)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    assert native_dcp.read(folder / ".metadata") is not None
    a, b = _both("inspect", folder, "--json", timeout=60)
    _assert_alike(a, b)
    assert a.code == 2 and "lies outside the file" in a.stderr


def test_mutated_metadata_reads_as_the_unpickler_reads_it_or_goes_to_it(tmp_path):
    """Seeded mutations of a real `.metadata` (bytes flipped, set to opcodes, cut, doubled): whatever the C reader
    accepts, the unpickler reads the same; everything else it hands over."""
    raw = (SAMPLES / "fsdp" / "fsdp2_dcp" / ".metadata").read_bytes()
    rng = random.Random(40)
    path = tmp_path / ".metadata"
    accepted = handed = 0
    for case in range(300):
        data = bytearray(raw)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            how = rng.randrange(4)
            if how == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif how == 1:
                data[at] = rng.choice(b"()tu\x85\x86\x87\x94qhjbsaeR\x81\x93N}].KMJ\x8a")
            elif how == 2:
                del data[at:]
                data += b"."
            else:
                data[at:at] = data[at : at + rng.randint(1, 16)]
        path.write_bytes(bytes(data))
        got = native_dcp.read(path)
        if got is None:
            handed += 1
            continue
        accepted += 1
        assert _same(got, _python_view(path)), case
    assert accepted and handed, (accepted, handed)


def test_off_with_ckpt_native_0(monkeypatch):
    monkeypatch.setenv("CKPT_NATIVE", "0")
    monkeypatch.setattr(native_walk, "_bound", {})  # not loaded yet in this process
    assert native_dcp.read(METADATA[0]) is None


def test_records_sharing_one_long_chunk_list_go_to_the_unpickler(tmp_path):
    """2,000 tensors whose `.metadata` entries all reference one list of 2,000 chunks (a few KB, each chunk pickled
    once): read out in full that is 4 million chunks. The C reader stops at its output bound (one int per two bytes
    of the pickle) and hands the file to the unpickler, which answers as it does without the C reader."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    folder = _copy(tmp_path)
    md = _metadata(folder)
    key, meta = next((k, m) for k, m in md.state_dict_metadata.items() if hasattr(m, "size") and len(m.size) == 2)
    shared = [ChunkStorageMetadata(offsets=torch.Size([i, 0]), sizes=torch.Size([1, 1])) for i in range(2000)]
    sdm = dict(md.state_dict_metadata)
    for i in range(2000):
        sdm[f"{key}.copy{i}"] = dataclasses.replace(meta, chunks=shared)
    raw = pickle.dumps(dataclasses.replace(md, state_dict_metadata=sdm))
    assert len(raw) < 4 << 20
    (folder / ".metadata").write_bytes(raw)
    assert native_dcp.read(folder / ".metadata") is None
    a, b = _both("inspect", folder, "--json", timeout=120)
    _assert_alike(a, b)
