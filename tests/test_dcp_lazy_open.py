"""Opening a DCP checkpoint reads `.metadata` and the small items only (issue 40): a tensor chunk's record (the
head of its embedded torch.save zip) is read when its bytes are, and checked against `.metadata` then. Proven on
copies of the FSDP2 sample (torch's own `dcp.save`) whose other chunks are garbage, by counting the items parsed,
over a moto S3 server by the bytes fetched, and with hostile `.metadata` files: each still one exit-2 line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import SAMPLES
from hostile import pickles as H
from hostile.runner import run
from test_hostile_pickles import HASH_BOMBS


def _copy(tmp_path: Path, name: str) -> Path:
    return shutil.copytree(SAMPLES / "fsdp" / "fsdp2_dcp", tmp_path / name)


def _metadata(folder: Path):
    """torch's own `Metadata` of a DCP folder (our committed sample or a copy of it: a trusted pickle)."""
    import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)

    return pickle.loads((folder / ".metadata").read_bytes())


def _save_metadata(folder: Path, md) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def _big(md) -> list:
    """The `_StorageInfo` of every chunk of a tensor of more than 16 elements (whose values inspect does not show)."""
    out = []
    for idx, info in md.storage_data.items():
        meta = md.state_dict_metadata[idx.fqn]
        if hasattr(meta, "size") and math.prod(meta.size) > 16:
            out.append(info)
    return out


def _json(r) -> dict:
    doc = json.loads(r.stdout)
    doc.pop("path")
    return doc


def _one_error(r, *words: str) -> str:
    assert r.traceback is None and not r.hung, r.traceback
    lines = r.error_lines()
    assert r.code == 2 and len(lines) == 1, (r.code, lines, r.stdout[-500:])
    assert all(w in lines[0] for w in words), lines
    return lines[0]


# --- what opening reads --------------------------------------------------------------------------------------


def test_inspect_answers_without_reading_any_big_chunk(tmp_path):
    """Every item of every tensor of more than 16 elements overwritten with garbage, its zip headers included:
    `inspect --json` answers exactly as on the intact copy, so it read none of them; export (which reads them)
    fails with one line naming the file, and writes nothing."""
    good, bad = _copy(tmp_path, "good"), _copy(tmp_path, "bad")
    infos = _big(_metadata(bad))
    assert len(infos) > 80
    for info in infos:
        with open(bad / info.relative_path, "r+b") as fh:
            fh.seek(info.offset)
            fh.write(b"\xab" * info.length)
    a, b = run("inspect", good, "--json", timeout=120), run("inspect", bad, "--json", timeout=120)
    assert a.code == b.code == 0, b.stderr
    assert _json(a) == _json(b)
    assert any(t.get("value") is not None for t in _tiny_tensors(json.loads(b.stdout)["tree"]))  # steps still read
    out = tmp_path / "out.safetensors"
    _one_error(run("export", bad, out, timeout=120), ".distcp")
    assert not out.exists()


def _tiny_tensors(tree) -> list[dict]:
    if isinstance(tree, dict) and "shape" in tree and "dtype" in tree:
        return [tree] if math.prod(tree["shape"]) <= 16 else []
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tiny_tensors(v)]
    return []


def test_opening_parses_the_small_items_only_and_a_chunk_when_read(monkeypatch):
    """Counted: opening parses the bytes items and the chunks of the tensors of up to 16 elements (Adam's `step`);
    a big tensor's chunks are parsed when its bytes are read, once each, and match torch's own load."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: F401  (torch's reader exists)

    import ckpt_tools
    from ckpt_tools.read import pickle_reader as P

    folder = SAMPLES / "fsdp" / "fsdp2_dcp"
    md = _metadata(folder)
    small = {
        (info.relative_path, info.offset): (folder / info.relative_path).read_bytes()[
            info.offset : info.offset + info.length
        ]
        for idx, info in md.storage_data.items()
        if not hasattr(md.state_dict_metadata[idx.fqn], "size") or math.prod(md.state_dict_metadata[idx.fqn].size) <= 16
    }
    parsed: list[tuple[str, int]] = []
    real = P.load_embedded_head
    monkeypatch.setattr(
        P,
        "load_embedded_head",
        lambda outer, off, n, *a: parsed.append((Path(outer.path).name, off)) or real(outer, off, n, *a),
    )
    monkeypatch.setattr(P, "load_embedded", lambda *a: pytest.fail("the zipfile path was taken"))
    ck = ckpt_tools.open_checkpoint(folder)
    # each small item parsed once, except one whose bytes equal an item's parsed before (every Adam `step`: its
    # node is that item's); none of the big tensors' chunks
    assert len(set(parsed)) == len(parsed) and set(parsed) <= set(small)
    seen = {small[at] for at in parsed}
    assert all(blob in seen for at, blob in small.items() if at not in parsed)
    assert len(parsed) < len(small)
    node = ck.get("model.wte.weight")
    assert [type(p.ref).__name__ for p in node.pieces] == ["LazyTensorRef"] * 2
    before = len(parsed)
    got = node.read_torch()
    assert len(parsed) == before + 2
    import torch.distributed.checkpoint as dcp

    want = {"model": {"wte.weight": torch.empty(node.shape)}}
    dcp.load(want, checkpoint_id=str(folder))
    assert torch.equal(got, want["model"]["wte.weight"])


def test_a_chunk_whose_record_disagrees_fails_when_read(tmp_path):
    """What moved: a chunk pointed at another tensor's item that is long enough (a [16, 32] record where .metadata
    declares [8, 32]) is shown as .metadata declares it; the record is checked when the bytes are read (export,
    --stats, diff of values): one exit-2 line naming the file, the key and both shapes."""
    folder = _copy(tmp_path, "ck")
    md = _metadata(folder)
    by_shape = {}
    for idx, info in md.storage_data.items():
        meta = md.state_dict_metadata[idx.fqn]
        if hasattr(meta, "size") and idx.offset is not None and not any(idx.offset):
            by_shape.setdefault(tuple(meta.size), (idx, info))
    victim, _ = by_shape[(16, 32)]
    _, other = by_shape[(32, 32)]
    md.storage_data[victim] = other
    _save_metadata(folder, md)
    r = run("inspect", folder, "--json", timeout=120)
    assert r.code == 0, r.stderr
    out = tmp_path / "out.safetensors"
    line = _one_error(run("export", folder, out, timeout=120), victim.fqn, other.relative_path, "[16, 32]", "[8, 32]")
    assert "another run" in line or "metadata" in line
    assert not out.exists()


# --- hostile .metadata ---------------------------------------------------------------------------------------


class _Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_a_reduce_of_a_global_in_metadata_runs_nothing(tmp_path):
    folder = _copy(tmp_path, "ck")
    marker = tmp_path / "marker"
    md = _metadata(folder)
    idx = next(iter(md.storage_data))
    md.storage_data[idx] = _Call(os.system, f"touch {marker}")
    _save_metadata(folder, md)
    _one_error(run("inspect", folder, "--json", timeout=120), ".metadata")
    assert not marker.exists()


def test_a_memo_bomb_in_metadata_is_refused(tmp_path):
    folder = _copy(tmp_path, "ck")
    H.poison_file(folder / ".metadata", HASH_BOMBS["dict_key_memo"], "prefix")
    _one_error(run("inspect", folder, "--json", timeout=60), ".metadata", "hash bomb")


def test_a_declared_shape_of_a_trillion_elements_is_refused(tmp_path):
    """A tensor declared 10^6 x 10^6 (its chunks too) whose items hold a few KB: the item is too short for the
    chunk, so its record is read when opening and disagrees: one exit-2 line, nothing allocated."""
    folder = _copy(tmp_path, "ck")
    md = _metadata(folder)
    key = declare_a_trillion_elements(md)
    _save_metadata(folder, md)
    _one_error(run("inspect", folder, "--json", timeout=60), key)


def declare_a_trillion_elements(md) -> str:
    """Declare the first 2-d tensor of a DCP `Metadata` (and its chunks) 10^6 x 10^6; returns its key."""
    import torch

    key = next(k for k, m in md.state_dict_metadata.items() if hasattr(m, "size") and len(m.size) == 2)
    meta = md.state_dict_metadata[key]
    huge = torch.Size([10**6, 10**6])
    md.state_dict_metadata[key] = dataclasses.replace(
        meta, size=huge, chunks=[dataclasses.replace(c, sizes=huge) for c in meta.chunks]
    )
    return key


def test_an_item_past_the_end_of_its_file_is_refused(tmp_path):
    folder = _copy(tmp_path, "ck")
    md = _metadata(folder)
    idx, info = next((i, s) for i, s in md.storage_data.items() if i.offset is not None and len(i.offset) == 2)
    size = (folder / info.relative_path).stat().st_size
    md.storage_data[idx] = dataclasses.replace(info, offset=size + 100)
    _save_metadata(folder, md)
    _one_error(run("inspect", folder, "--json", timeout=60), info.relative_path, "lies outside the file")


# --- over S3 ---------------------------------------------------------------------------------------------------

_S3 = all(importlib.util.find_spec(m) is not None for m in ("moto", "s3fs", "flask", "boto3"))


@pytest.mark.skipif(not _S3, reason="needs moto[server] and s3fs (pip install -e '.[dev]')")
def test_inspect_over_s3_fetches_metadata_and_small_items_only(tmp_path_factory, tmp_path):
    """A DCP checkpoint torch's `dcp.save` writes (12 parameters of 64 x 512 fp32 and their Adam state: 8.5 MB),
    on a moto S3 server: `inspect s3://` answers as locally and fetches `.metadata`, the small items and the
    fixed first reads of each object, not the chunks."""
    import subprocess
    import sys

    import test_remote_s3 as S

    folder = tmp_path / "ck"
    _dcp_save(folder, 12)
    total = sum(p.stat().st_size for p in folder.iterdir())
    with S.moto_server(tmp_path_factory.mktemp("moto") / "server.log") as endpoint:
        fs = S._fs(endpoint)
        fs.mkdir(S.BUCKET)
        fs.put(str(folder), f"{S.BUCKET}/lazy/ck", recursive=True)
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "from ckpt_cli.main import main; main()",
                "inspect",
                f"s3://{S.BUCKET}/lazy/ck",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=S._env(endpoint),
            cwd=S.ROOT,
        )
    assert r.returncode == 0, r.stderr
    remote = json.loads(r.stdout)
    cost = remote.pop("remote", None) or {}
    local = run("inspect", folder, "--json", timeout=120)
    want = json.loads(local.stdout)
    for doc in (remote, want):
        doc.pop("path")
    assert remote == want
    # .metadata whole, a head and a tail of 64 KiB per .distcp file, the 12 step items and the param groups' items
    assert cost["bytes_fetched"] < (folder / ".metadata").stat().st_size + 2 * (64 << 10) + 40 * 2048 + (64 << 10)
    assert cost["bytes_fetched"] < total / 10, (cost, total)


@pytest.mark.skipif(not _S3, reason="needs moto[server] and s3fs (pip install -e '.[dev]')")
def test_inspect_over_s3_requests_do_not_grow_with_far_apart_step_items(tmp_path_factory, tmp_path):
    """120 parameters of 32 x 320 fp32 (40 KiB: each Adam `step` item lies ~120 KiB from the next, between the
    tensors' bytes, as in a real model): `inspect s3://` costs a bounded number of GETs (counted in the server's
    log too), not one per `step` item. The values it did not read are said to be unread (a warning, no `value`),
    never guessed; everything else answers as the local folder does."""
    import test_remote_s3 as S

    from ckpt_tools.read import remote as R

    folder = tmp_path / "ck"
    _dcp_save(folder, 120, (32, 320))
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with S.moto_server(log) as endpoint:
        fs = S._fs(endpoint)
        fs.mkdir(S.BUCKET)
        fs.put(str(folder), f"{S.BUCKET}/wide/ck", recursive=True)
        before = log.read_text().count('"GET /')
        r = S.ckpt("inspect", f"s3://{S.BUCKET}/wide/ck", "--json", env=S._env(endpoint))
        logged = log.read_text().count('"GET /') - before
        # a command that needs the values reads them: `diff --logical` finds every step equal to the local one's
        same = S.ckpt("diff", f"s3://{S.BUCKET}/wide/ck", folder, "--logical", env=S._env(endpoint))
    assert same.returncode == 0 and "same: by logical name: " in same.stdout, same.stdout + same.stderr
    assert r.returncode == 0, r.stderr
    remote = json.loads(r.stdout)
    cost = remote.pop("remote")
    # .metadata, a head and a tail of each object, the param groups' items, and at most SMALL_GETS for the steps
    bound = R.SMALL_GETS + 8
    assert cost["get_requests"] <= bound, cost
    assert logged - cost["list_requests"] <= bound, (logged, cost)
    total = sum(p.stat().st_size for p in folder.iterdir())
    assert cost["bytes_fetched"] < total / 4, (cost, total)

    local = json.loads(run("inspect", folder, "--json", timeout=120).stdout)
    steps = remote["tree"]["optimizer"]["state"]
    unread = [k for k, v in steps.items() if "value" not in v["step"]]
    read = [k for k, v in steps.items() if "value" in v["step"]]
    assert unread and read and len(unread) + len(read) == 120
    assert all(steps[k]["step"]["value"] == 1.0 for k in read)
    assert cost["small_reads"]["not_read"] == len(unread)
    (w,) = [w for w in remote["warnings"] if w["code"] == "values-not-read"]
    assert w["message"].startswith(f"{len(unread)} of 120 tiny tensors")
    # the rest is the local answer: the same values where read, the same shape and dtype where not
    for k in unread:
        del local["tree"]["optimizer"]["state"][k]["step"]["value"]
    remote["warnings"].remove(w)
    for doc in (remote, local):
        doc.pop("path")
    assert remote == local


def _dcp_save(folder: Path, n: int, shape: tuple[int, int] = (64, 512)) -> None:
    """torch's own dcp.save of n parameters of `shape` and their Adam state after one real step."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.ParameterDict({f"p{i}": torch.nn.Parameter(torch.randn(*shape)) for i in range(n)})
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sum((p * p).sum() for p in model.values()).backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=str(folder))


# --- an item's record from its head ----------------------------------------------------------------------------


def _same_record(a, b) -> bool:
    from ckpt_tools.read.pickle_reader import TensorRef

    if isinstance(a, TensorRef):
        return (
            isinstance(b, TensorRef)
            and (
                a.dtype,
                a.shape,
                a.stride,
                a.storage_offset,
                a.requires_grad,
                a.is_parameter,
                a.subclass,
                a.pickled[0],
            )
            == (b.dtype, b.shape, b.stride, b.storage_offset, b.requires_grad, b.is_parameter, b.subclass, b.pickled[0])
            and a.storage.key == b.storage.key
            and a.storage.numel == b.storage.numel
            and a.storage.source.storage_offset(a.storage) == b.storage.source.storage_offset(b.storage)
        )
    return type(a) is type(b) and repr(a) == repr(b)


@pytest.mark.parametrize(
    "folder",
    [
        "fsdp/fsdp2_dcp",
        "dcp/torchtitan_real/step-3",
        "dcp/dcp_recipe_fsdp2",
        "megatron_lm/megatron_dp2_distopt_torch_dist/iter_0000010",
        "megatron_lm/megatron_moe_ep2_torch_dist/iter_0000010",
    ],
)
def test_every_item_reads_the_same_from_its_head_as_through_zipfile(folder):
    """Each item of the DCP samples (torch's dcp.save, torchtitan, Megatron-LM's torch_dist), parsed from one read of
    its head and through zipfile's central directory: the same record, the same storage offset, the same globals."""
    from ckpt_tools.formats.dcp import DcpItems
    from ckpt_tools.read import pickle_reader as P

    items = DcpItems(SAMPLES / folder)
    sources: dict[str, P.Source] = {}
    for it in items.items.values():
        src = sources.setdefault(it.rel, P.Source(SAMPLES / folder / it.rel))
        a = P.load_embedded(src, it.offset, it.length)
        b = P.load_embedded_head(src, it.offset, it.length, P.ITEM_HEAD_BYTES if it.is_tensor else it.length)
        assert _same_record(a.obj, b.obj) and a.globals_seen == b.globals_seen, (it.key, a.obj, b.obj)


def test_an_item_not_laid_out_as_torch_writes_it_reads_through_zipfile(tmp_path):
    """A tensor item rewritten by Python's zipfile (sizes in the local headers, no data descriptors) reads from its
    head too; one with a compressed member goes through zipfile, whose refusal names the file."""
    import io
    import zipfile

    import torch

    from ckpt_tools.errors import CorruptCheckpoint
    from ckpt_tools.read import pickle_reader as P

    buf = io.BytesIO()
    torch.save(torch.arange(32, dtype=torch.float32).reshape(4, 8), buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        members = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    for method, name in ((zipfile.ZIP_STORED, "stored"), (zipfile.ZIP_DEFLATED, "deflated")):
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", compression=method) as z:
            for n, data in members:
                z.writestr(n, data)
        f = tmp_path / f"{name}.distcp"
        f.write_bytes(b"\0" * 100 + out.getvalue() + b"\0" * 50)
        loaded = P.load_embedded_head(P.Source(f), 100, len(out.getvalue()))
        assert loaded.obj.shape == (4, 8)
        if method == zipfile.ZIP_STORED:
            assert isinstance(loaded.source, P.HeadZipSource)
            assert loaded.obj.read_values() == list(range(32))
        else:
            assert not isinstance(loaded.source, P.HeadZipSource)
            with pytest.raises(CorruptCheckpoint, match="compressed"):
                loaded.obj.read_values()
