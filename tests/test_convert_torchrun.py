"""`ckpt convert --to dcp | deepspeed-universal` as a torchrun job on 127.0.0.1 (two nodes: two torchrun processes
with a c10d rendezvous on loopback; `--nproc 2`): the same bytes as one process; a rank killed with SIGKILL fails
the job naming it, nothing in place, and the rerun resumes from the journal to the same bytes. The job machinery
(`write/shares.run_job`) is to-universal's: its own tests are in test_to_universal_torchrun.py."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest

from ckpt_tools.write.shares import Journal

from conftest import run_cli, sample
from test_to_universal_torchrun import _job, _launch, _rank_1_lost, _wait

#: (source, --to): a DeepSpeed run as DCP (FSDP2 layout), a DCP run as DeepSpeed universal
CASES = {
    "dcp": (("deepspeed", "zero2_lambdalr"), "dcp"),
    "universal": (("dcp", "dcp_recipe_fsdp2"), "deepspeed-universal"),
}


def _digest(root: Path) -> dict[str, str]:
    """file -> sha256; DCP's `.metadata` with its StorageMeta left out (checkpoint_id: the OUT path, and the save_id
    made from that path), since the reference is written to another path."""
    out = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        if p.name == ".metadata":
            md = pickle.loads(data)  # our own test output
            md.storage_meta = None
            data = pickle.dumps(md)
        out[str(p.relative_to(root))] = hashlib.sha256(data).hexdigest()
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each case's one-process output, converted once for the module: file -> sha256."""
    made: dict[str, dict[str, str]] = {}

    def get(key: str) -> dict[str, str]:
        if key not in made:
            src, to = CASES[key]
            out = tmp_path_factory.mktemp("ref") / key
            r = run_cli("convert", sample(*src), out, "--to", to, "--json")
            assert r.returncode == 0, r.stderr
            made[key] = _digest(out)
        return made[key]

    return get


def _args(key: str, out: Path) -> list:
    src, to = CASES[key]
    return [sample(*src), out, "--to", to]


def test_two_nodes_dcp_byte_identical_to_one_process(tmp_path, reference):
    doc, _ = _job(2, 1, _args("dcp", tmp_path / "d"), command=("convert",))
    assert _digest(tmp_path / "d") == reference("dcp")
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["resumed"] == 0 and doc["verified"] is True
    assert doc["converted"] == doc["params"] and all(r["params"] > 0 for r in doc["ranks"])
    assert not list(tmp_path.glob(".ckpt-staging-*"))


def test_nproc_universal_from_dcp_byte_identical(tmp_path, reference):
    r = run_cli("convert", *_args("universal", tmp_path / "u"), "--nproc", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["rank"] for x in json.loads(r.stdout)["ranks"]] == [0, 1]
    assert _digest(tmp_path / "u") == reference("universal")


def test_killed_rank_fails_the_job_and_the_rerun_resumes(tmp_path, reference):
    """Node 1's rank is killed (SIGKILL) after it journaled 2 parameters: rank 0 names it in one line, exit 2,
    nothing in place; the same command, here in one process (any number of ranks resumes a job), converts only
    the rest, byte-identical to one process."""
    out = tmp_path / "d"
    env = {"CKPT_TEST_KILL_AFTER": "1:2", "CKPT_DIST_LOST_S": "4"}
    done = _wait(_launch(2, 1, _args("dcp", out), env=env, command=("convert",)))
    _rank_1_lost(done, out, tmp_path / ".ckpt-staging-d-job")

    r = run_cli("convert", *_args("dcp", out), "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["resumed"] >= 2 and doc["converted"] + doc["resumed"] == doc["params"]
    assert _digest(out) == reference("dcp")
    assert not list(tmp_path.glob(".ckpt-staging-*"))


def test_one_process_rerun_with_restart_starts_over(tmp_path, reference):
    """A staging folder left by a job is resumed by the command in one process too; --restart throws it away."""
    out = tmp_path / "d"
    staging = tmp_path / ".ckpt-staging-d-job"
    (staging / ".journal").mkdir(parents=True)
    (staging / ".journal" / "plan").write_text("another plan")
    (staging / "__0_1.distcp").write_bytes(b"left by another plan")
    r = run_cli("convert", *_args("dcp", out), "--restart", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["resumed"] == 0 and doc["converted"] == doc["params"] and len(doc["ranks"]) == 1
    assert _digest(out) == reference("dcp")


def test_journal_of_files_beside_other_units(tmp_path):
    """A DCP parameter's files lie in the output's root: journaled by name, with what the record carries."""
    (tmp_path / "__0_1.distcp").write_bytes(b"PK\x03\x04abc" * 10)
    j = Journal(tmp_path, 0)
    j.record("param0", paths=["__0_1.distcp"], extra={"tensors": []})
    j.close()
    again = Journal(tmp_path, 1)
    assert again.finished("param0") and again.extra["param0"] == {"tensors": []}
    again.close()
    (tmp_path / "__0_1.distcp").write_bytes(b"PK\x03\x04abd" * 10)  # same size, other bytes
    assert not Journal(tmp_path, 1).finished("param0")


def test_a_difference_found_in_verification_puts_nothing_in_place(tmp_path):
    """`shares.run_job` in one process: the ranks' shares of the comparison with the source are gathered; one line
    of difference, whichever rank found it, removes the staging folder and puts nothing in place."""
    from ckpt_tools.errors import CkptError
    from ckpt_tools.write import shares

    out, seen = tmp_path / "o", []

    def convert(todo, journal, counted):
        for k in todo:
            (journal.root / f"f{k}").write_bytes(b"x")
            journal.record(f"u{k}", paths=[f"f{k}"])
        return len(todo)

    def verify(staging, share, first):
        seen.append((sorted(share), first))
        return ["model w: changed"]

    units = [shares.Unit("u0", 1), shares.Unit("u1", 2)]
    with pytest.raises(CkptError, match="differs from the source in 1 places: model w: changed"):
        shares.run_job(
            shares.LocalJob(),
            out,
            units,
            digest="d",
            restart=False,
            convert=convert,
            finish=lambda s, j: None,
            verify=verify,
        )
    assert seen == [([0, 1], True)]
    assert not out.exists() and not shares.job_staging(out).exists()
