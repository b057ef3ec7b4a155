"""`ckpt export` as a torchrun job on 127.0.0.1 (`--nproc 2`; two nodes: two torchrun processes with a c10d
rendezvous on loopback): each rank writes a share of the tensors at their offsets in the staging files, rank 0 the
headers, index and config files; the same bytes as one process, for one .safetensors file and a sharded `--hf`
folder. A rank killed with SIGKILL fails the job naming it, nothing in place, and the rerun resumes from the journal
(each tensor's byte span and CRC-32) to the same bytes. The job machinery is `write/shares.run_job`, to-universal's
and convert's: its own tests are in test_to_universal_torchrun.py and test_convert_torchrun.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_tools.write.shares import Journal

from conftest import run_cli, sample
from test_to_universal_torchrun import _digest, _job, _launch, _rank_1_lost, _wait  # _digest: file -> sha256

#: (source, OUT's name, options): a ZeRO-2 run as one file; an HF Trainer + ZeRO-2 run as a sharded --hf folder
CASES = {
    "file": (("deepspeed", "zero2_bf16"), "m.safetensors", []),
    "hf": (("hf_trainer", "hf_trainer_zero2"), "hf", ["--hf", "--max-shard-size", "40KB"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each case's one-process export, made once for the module: file -> sha256."""
    made: dict[str, dict[str, str]] = {}

    def get(key: str) -> dict[str, str]:
        if key not in made:
            src, name, opts = CASES[key]
            folder = tmp_path_factory.mktemp("ref")
            r = run_cli("export", sample(*src), folder / name, *opts, "--json")
            assert r.returncode == 0, r.stderr
            made[key] = _digest(folder)
        return made[key]

    return get


def _args(key: str, folder: Path) -> list:
    src, name, opts = CASES[key]
    return [sample(*src), folder / name, *opts]


def test_nproc_one_file_byte_identical_to_one_process(tmp_path, reference):
    r = run_cli("export", *_args("file", tmp_path), "--nproc", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert [x["rank"] for x in doc["ranks"]] == [0, 1] and all(x["params"] > 0 for x in doc["ranks"])
    assert doc["resumed"] == 0 and sum(x["bytes"] for x in doc["ranks"]) == doc["bytes"]
    assert _digest(tmp_path) == reference("file")  # only m.safetensors: no staging left
    assert len(reference("file")) == 1


def test_two_nodes_hf_sharded_byte_identical_and_verified(tmp_path, reference):
    """Sharded --hf: the safetensors shards, the index and the config files, every byte as one process writes
    them; --verify split between the ranks."""
    doc, _ = _job(2, 1, [*_args("hf", tmp_path), "--verify"], command=("export",))
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["verified"] == doc["tensors"]
    assert len(doc["files"]) > 1 and doc["index"]
    ref = reference("hf")
    assert {"hf/config.json", "hf/model.safetensors.index.json"} <= set(ref)
    assert _digest(tmp_path) == ref


def test_killed_rank_fails_the_job_and_the_rerun_resumes(tmp_path, reference):
    """Node 1's rank is killed (SIGKILL) after it journaled 2 tensors: rank 0 names it in one line, exit 2, nothing
    in place; the same command in one process writes only the rest, byte-identical to one process."""
    out = tmp_path / "m.safetensors"
    env = {"CKPT_TEST_KILL_AFTER": "1:2", "CKPT_DIST_LOST_S": "4"}
    done = _wait(_launch(2, 1, _args("file", tmp_path), env=env, command=("export",)))
    _rank_1_lost(done, out, tmp_path / ".ckpt-staging-m.safetensors-job")

    r = run_cli("export", *_args("file", tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["resumed"] >= 2 and doc["converted"] > 0 and len(doc["ranks"]) == 1
    assert _digest(tmp_path) == reference("file")


def test_hf_into_an_empty_folder_keeps_it_when_the_job_fails(tmp_path, reference):
    """--hf into an existing empty folder (one process writes over it): a job whose rank is killed leaves the empty
    folder as it was; the rerun puts the output in it, the same bytes as one process."""
    (tmp_path / "hf").mkdir()
    env = {"CKPT_TEST_KILL_AFTER": "1:2", "CKPT_DIST_LOST_S": "4"}
    done = _wait(_launch(1, 2, _args("hf", tmp_path), env=env, command=("export",)))
    assert all(rc != 0 for rc, _, _ in done)
    assert (tmp_path / "hf").is_dir() and not any((tmp_path / "hf").iterdir())
    r = run_cli("export", *_args("hf", tmp_path), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _digest(tmp_path) == reference("hf")


def test_restart_throws_a_job_staging_away(tmp_path, reference):
    """A staging folder left by a job of another plan, rerun in one process with --restart: written again whole."""
    staging = tmp_path / ".ckpt-staging-m.safetensors-job"
    (staging / ".journal").mkdir(parents=True)
    (staging / ".journal" / "plan").write_text("another plan")
    (staging / "m.safetensors").write_bytes(b"left by another plan")
    r = run_cli("export", *_args("file", tmp_path), "--restart", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["resumed"] == 0 and doc["converted"] > 0
    assert _digest(tmp_path) == reference("file")


def test_journal_of_byte_spans(tmp_path):
    """A tensor's bytes inside a file every rank writes into: journaled as a span; a change inside it (not outside)
    or a file cut short makes the rerun write it again."""
    f = tmp_path / "m.safetensors"
    f.write_bytes(bytes(range(64)))
    j = Journal(tmp_path, 0)
    j.record("m.safetensors/w", spans=[("m.safetensors", 8, 16)])
    j.close()
    assert Journal(tmp_path, 1).finished("m.safetensors/w")
    raw = bytearray(f.read_bytes())
    raw[40] ^= 1  # outside the span
    f.write_bytes(bytes(raw))
    assert Journal(tmp_path, 1).finished("m.safetensors/w")
    raw[10] ^= 1  # inside it
    f.write_bytes(bytes(raw))
    assert not Journal(tmp_path, 1).finished("m.safetensors/w")
    f.write_bytes(bytes(range(20)))  # shorter than the span's end
    assert not Journal(tmp_path, 1).finished("m.safetensors/w")


def test_sharded_job_beside_a_file_at_outs_own_name_as_one_process(tmp_path):
    """A sharded export (not --hf) writes `m-0000i-of-0000N.safetensors` and `m.safetensors.index.json`: a file at
    the literal OUT name `m.safetensors` is none of them, and one process writes beside it, leaving it alone. The
    job does the same, to the same bytes; and where one of the planned files exists, both refuse it in the same
    one line, exit 2, writing nothing."""
    src, opts = sample("deepspeed", "zero2_bf16"), ["--max-shard-size", "100KB", "--json"]
    runs = {}
    for how, extra in (("one", []), ("job", ["--nproc", "2"])):
        folder = tmp_path / how
        folder.mkdir()
        (folder / "m.safetensors").write_bytes(b"not an output of the export")
        r = run_cli("export", src, folder / "m.safetensors", *opts, *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(json.loads(r.stdout)["files"]) == 2
        assert (folder / "m.safetensors").read_bytes() == b"not an output of the export"
        runs[how] = _digest(folder)
    assert runs["job"] == runs["one"] and len(runs["one"]) == 4  # the file left alone, two shards, the index

    lines = {}
    for how, extra in (("one", []), ("job", ["--nproc", "2"])):
        folder = tmp_path / f"{how}_taken"
        folder.mkdir()
        (folder / "m-00002-of-00002.safetensors").write_bytes(b"taken")
        r = run_cli("export", src, folder / "m.safetensors", *opts, *extra)
        assert r.returncode == 2, r.stderr[-3000:]
        lines[how] = {x.replace(str(folder), "F") for x in r.stderr.splitlines() if x.startswith("ckpt: error:")}
        assert [p.name for p in folder.iterdir()] == ["m-00002-of-00002.safetensors"]
    assert lines["job"] == lines["one"] and len(lines["one"]) == 1
    assert "output file already exists" in next(iter(lines["one"]))
