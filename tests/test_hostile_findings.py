"""Findings of the hostile-input review, each proven on a copy of a committed sample:

- issue 39: `ckpt diff` of two byte-identical DCP folders said every `storage_data` entry was removed and added
  (its MetadataIndex keys, inert records, were paired by identity); a real change there is still reported.
- finding 5a: torchtitan's data-loader state is an inner pickle (a bytes item inside the DCP checkpoint); a global
  named inside it is reported as `unknown-global` on the `.distcp` file that holds it, and the resume gate refuses it.
- finding 6: a Megatron torch_dist `rng_state/*` item that is not the list Megatron saves (a bare pickled int, a
  string, ...) is a one-line exit-2 error of `convert --to megatron --ckpt-format torch`, nothing written.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import SAMPLES
from hostile import pickles as H
from hostile.runner import diff_snapshots, run, snapshot


def _copy(group: str, name: str, dst: Path) -> Path:
    shutil.copytree(SAMPLES / group / name, dst)
    return dst


def _metadata(folder: Path):
    """The real torch `Metadata` of a DCP folder (our own committed sample: a trusted pickle)."""
    import torch.distributed.checkpoint  # noqa: F401  (the classes the pickle names)

    return pickle.loads((folder / ".metadata").read_bytes())


def _index(md, key: str):
    return next(i for i in md.storage_data if i.fqn == key)


def _replace_item(folder: Path, key: str, blob: bytes) -> str:
    """Make the DCP item `key` hold `blob` (a torch.save zip, as DCP writes a bytes item): appended to its
    .distcp file, `.metadata`'s _StorageInfo pointed at it. Returns the .distcp file's name."""
    md = _metadata(folder)
    idx = _index(md, key)
    info = md.storage_data[idx]
    f = folder / info.relative_path
    off = f.stat().st_size
    with open(f, "ab") as fh:
        fh.write(blob)
    md.storage_data[idx] = dataclasses.replace(info, offset=off, length=len(blob))
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return info.relative_path


def _torch_save(obj) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --- issue 39: diff of identical DCP folders ----------------------------------------------------------------

DCP_SAMPLES = [
    ("dcp", "torchtitan_real/step-3"),
    ("fsdp", "fsdp2_dcp"),
    ("megatron_lm", "megatron_tp2_torch_dist/iter_0000010"),
]


@pytest.mark.parametrize("group,name", DCP_SAMPLES, ids=[n.split("/")[0] for _, n in DCP_SAMPLES])
def test_diff_of_two_identical_dcp_copies_is_same(tmp_path, group, name):
    a, b = _copy(group, name, tmp_path / "a"), _copy(group, name, tmp_path / "b")
    r = run("diff", a, b, "--json", timeout=120)
    assert r.traceback is None, r.traceback
    report = json.loads(r.stdout)
    assert report["differences"] == [] and report["same"], report["differences"][:3]
    assert r.code == 0, r.stderr


def test_diff_still_reports_a_changed_storage_data_entry(tmp_path):
    a = _copy("fsdp", "fsdp2_dcp", tmp_path / "a")
    b = _copy("fsdp", "fsdp2_dcp", tmp_path / "b")
    md = _metadata(b)
    idx = next(iter(md.storage_data))
    info = md.storage_data[idx]
    md.storage_data[idx] = dataclasses.replace(info, offset=info.offset + 8)  # a moved item
    (b / ".metadata").write_bytes(pickle.dumps(md))
    r = run("diff", a, b, "--files", "--json", timeout=120)
    assert r.traceback is None, r.traceback
    assert r.code == 1, r.stderr
    diffs = json.loads(r.stdout)["differences"]
    assert [(d["kind"], d["old"], d["new"]) for d in diffs] == [("changed", info.offset, info.offset + 8)], diffs
    assert diffs[0]["file"] == ".metadata"
    assert diffs[0]["field"].startswith("storage_data.") and diffs[0]["field"].endswith(".offset")
    assert repr(idx.fqn) in diffs[0]["field"]  # named by the item's fqn, not by an object address

    # a changed key (the chunk offset of the MetadataIndex) is one entry removed and one added
    md = _metadata(a)
    idx = next(i for i in md.storage_data if i.offset is not None and len(i.offset))
    info = md.storage_data.pop(idx)
    md.storage_data[dataclasses.replace(idx, offset=type(idx.offset)([idx.offset[0] + 1, *idx.offset[1:]]))] = info
    (b / ".metadata").write_bytes(pickle.dumps(md))
    r = run("diff", a, b, "--files", "--json", timeout=120)
    assert r.traceback is None, r.traceback
    diffs = json.loads(r.stdout)["differences"]
    assert sorted(d["kind"] for d in diffs) == ["added", "removed"], diffs
    assert all(repr(idx.fqn) in d["field"] for d in diffs)


# --- finding 5a: globals inside torchtitan's data-loader inner pickle ------------------------------------------


def _hostile_loader(tmp_path: Path) -> tuple[Path, Path, str]:
    """torchtitan_real's full save with dp_rank_0's data-loader state (an inner pickle held as a bytes item)
    carrying a `posix.system` REDUCE. Returns (folder, marker, the .distcp file holding it)."""
    from ckpt_tools.formats.dcp import DcpItems

    folder = _copy("dcp", "torchtitan_real/step-3", tmp_path / "step-3")
    inner = DcpItems(folder).value("dataloader.dp_rank_0")
    assert isinstance(inner, bytes) and inner[:1] == b"\x80"
    marker = tmp_path / "marker"
    payload, names = H.payloads(marker)["posix_system"]
    assert names == ["posix.system"]
    hostile = H.inject(inner, payload, "prefix")  # before protocol 4's frames
    rel = _replace_item(folder, "dataloader.dp_rank_0", _torch_save(hostile))
    return folder, marker, rel


def test_a_global_inside_the_dataloader_inner_pickle_is_reported_and_refused(tmp_path):
    from ckpt_tools import open_checkpoint
    from ckpt_tools.errors import UnsupportedCheckpoint
    from ckpt_tools.read.safe_load import untrusted_globals
    from ckpt_tools.resume.frameworks import plan_resume

    folder, marker, rel = _hostile_loader(tmp_path)
    r = run("inspect", folder, "--json", timeout=120)
    assert r.traceback is None, r.traceback
    assert r.code == 0, r.stderr
    found = [w for w in json.loads(r.stdout)["warnings"] if w["code"] == "unknown-global"]
    assert [(w["path"], "posix.system" in w["message"]) for w in found] == [(rel, True)], found

    ck = open_checkpoint(folder)
    assert "posix.system" in " ".join(untrusted_globals(ck).get(rel, [])), untrusted_globals(ck)
    with pytest.raises(UnsupportedCheckpoint, match=r"posix\.system"):
        plan_resume(ck, folder, steps=1)
    assert not marker.exists()


def test_an_untouched_dataloader_state_names_no_global():
    from ckpt_tools import open_checkpoint

    ck = open_checkpoint(SAMPLES / "dcp" / "torchtitan_real" / "step-3")
    assert "dataloader" in ck.details
    assert not [w for w in ck.warnings if w.code == "unknown-global"]


# --- finding 6: a torch_dist RNG item of the wrong shape ---------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [7, "not an rng state", {"random_rng_state": 1}, [[{"random_rng_state": 1}]]],
    ids=["int", "str", "dict", "dict-missing-fields"],
)
def test_convert_refuses_an_rng_item_of_the_wrong_shape(tmp_path, value):
    src = _copy("megatron_lm", "megatron_tp2_torch_dist", tmp_path / "src")
    key = "rng_state/shard_0.0_1.2"
    rel = _replace_item(src / "iter_0000010", key, _torch_save(value))
    before = snapshot(src)
    out = tmp_path / "out"
    r = run("convert", src, out, "--to", "megatron", "--ckpt-format", "torch", "--yes", timeout=240)
    assert r.traceback is None, r.traceback
    assert r.code == 2, (r.stdout, r.stderr)
    lines = r.error_lines()
    err = " ".join(lines)
    assert key in err and rel in err, lines
    assert "--no-load-rng" in err or "re-copy" in err, lines  # the fix
    assert len([ln for ln in lines if "error:" in ln]) == 1, lines
    assert not out.exists()
    assert diff_snapshots(before, snapshot(src)) == []


def test_convert_refuses_a_legacy_rank_file_rng_state_of_the_wrong_shape(tmp_path):
    """The same check on the legacy source (legacy -> legacy at another TP): a rank file's `rng_state`."""
    src = _copy("megatron_lm", "megatron_tp2_legacy", tmp_path / "src")
    f = src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    H.poison_file(f, b"K\x07", "setitem", key="rng_state")  # the top dict's rng_state set again, to a bare int 7
    before = snapshot(src)
    out = tmp_path / "out"
    r = run("convert", src, out, "--to", "megatron", "--ckpt-format", "torch", "--tp", "1", "--yes", timeout=240)
    assert r.traceback is None, r.traceback
    assert r.code == 2, (r.stdout, r.stderr)
    err = " ".join(r.error_lines())
    assert "rng_state" in err and "mp_rank_01/model_optim_rng.pt" in err, err
    assert not out.exists()
    assert diff_snapshots(before, snapshot(src)) == []
