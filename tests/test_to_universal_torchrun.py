"""`ckpt to-universal` as a torchrun job on 127.0.0.1: two nodes (two torchrun processes, --node-rank 0 / 1) and
one node of two processes, byte-identical to one process; a rank killed with SIGKILL fails the job in bounded
time naming it, with nothing in place; the rerun resumes from the journal (`--restart` starts over)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_tools.samples import free_port
from ckpt_tools.write.shares import Journal, balanced_shares

from conftest import ROOT, run_cli, sample

SAMPLES = {"zero2": ("deepspeed", "zero2_bf16"), "pipeline": ("megatron", "gpt_tp2_pp2")}


def _digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each sample's one-process output, converted once for the module: file -> sha256."""
    made: dict[str, dict[str, str]] = {}

    def get(key: str) -> dict[str, str]:
        if key not in made:
            out = tmp_path_factory.mktemp("ref") / key
            r = run_cli("to-universal", sample(*SAMPLES[key]), out, "--json")
            assert r.returncode == 0, r.stderr
            made[key] = _digest(out)
        return made[key]

    return get


def _program() -> list[str]:
    exe = shutil.which("ckpt")  # the installed command, as users run it
    return ["--no-python", exe] if exe else ["-m", "ckpt_cli.main"]  # else: torchrun's own python


def _launch(
    nnodes: int,
    nproc: int,
    args: list,
    *,
    env: dict | None = None,
    port: int | None = None,
    command: tuple[str, ...] = ("to-universal", "--workers", "1"),
):
    """Start the torchrun processes of one job (one per node); returns them (stdout / stderr piped)."""
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(nnodes),
            "--nproc-per-node",
            str(nproc),
            "--node-rank",
            str(node),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            *_program(),
            command[0],
            *map(str, args),
            "--yes",
            "--json",
            *command[1:],
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    return procs


def _wait(procs, timeout: float = 120) -> list[tuple[int, str, str]]:
    outs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *o) for p, o in zip(procs, outs)]


def _rank_1_lost(done: list[tuple[int, str, str]], out: Path, staging: Path) -> None:
    """What a job whose node-1 rank was killed leaves: every torchrun failed, rank 0's one error line names rank 1
    and its host, rank 0 exited 2, OUT is absent and the staging folder keeps its journal for the rerun."""
    assert all(rc != 0 for rc, _, _ in done)
    errors = [line for line in done[0][2].splitlines() if line.startswith("ckpt: error:")]
    assert len(errors) == 1 and "rank 1 (host " in errors[0] and "was lost" in errors[0], done[0][2][-3000:]
    assert "exitcode: 2" in done[0][2]  # torchrun's report of rank 0
    assert not out.exists() and (staging / ".journal").is_dir()


def _job(nnodes: int, nproc: int, args: list, **kw) -> tuple[dict, list]:
    done = _wait(_launch(nnodes, nproc, args, **kw))
    for rc, _, err in done:
        assert rc == 0, err[-3000:]
    return json.loads(done[0][1]), done  # rank 0 (on node 0) alone prints


def test_balanced_shares_by_bytes():
    shares = balanced_shares([100, 1, 1, 50, 50, 1], 2)
    assert shares == [[0, 1, 5], [2, 3, 4]]  # 102 and 101 bytes
    assert balanced_shares([3, 3], 4) == [[0], [1], [], []]


def test_journal_redoes_a_changed_file(tmp_path):
    (tmp_path / "t" / "p").mkdir(parents=True)
    (tmp_path / "t" / "p" / "fp32.pt").write_bytes(b"abcd")
    j = Journal(tmp_path, 0)
    j.record("t/p")
    j.close()
    assert Journal(tmp_path, 1).finished("t/p")
    (tmp_path / "t" / "p" / "fp32.pt").write_bytes(b"abce")  # same size, other bytes
    assert not Journal(tmp_path, 1).finished("t/p")


def test_journal_records_what_it_fsynced_and_scanned(tmp_path):
    (tmp_path / "t" / "p").mkdir(parents=True)
    (tmp_path / "t" / "p" / "fp32.pt").write_bytes(b"abcd")
    (tmp_path / "x.distcp").write_bytes(b"ef")
    j = Journal(tmp_path, 0)
    j.record("t/p")
    j.record("q", paths=["x.distcp"])  # fsynced, but scanned at the end, with the .metadata rank 0 writes
    j.close()
    assert (j.fsynced, j.scanned) == (2, 1)
    assert Journal(tmp_path, 1).settled() == ({"t/p/fp32.pt", "x.distcp"}, {"t/p/fp32.pt"})
    trusted = Journal(tmp_path / "t", 0, trust_pickles=True)
    trusted.record("p")
    trusted.close()
    assert Journal(tmp_path / "t", 0).settled() == ({"p/fp32.pt"}, set())  # not scanned under --trust-pickles


def test_journal_reads_a_zip_again_on_resume(tmp_path):
    """A torch.save file is journaled by its members' CRC-32s; a rerun reads the bytes back against them."""
    import torch

    f = tmp_path / "t" / "p" / "fp32.pt"
    f.parent.mkdir(parents=True)
    torch.save(torch.ones(4096, dtype=torch.uint8), f)  # a real one: recording it also passes it through the gate
    j = Journal(tmp_path, 0)
    j.record("t/p")
    j.close()
    assert Journal(tmp_path, 0).finished("t/p")
    raw = bytearray(f.read_bytes())
    raw[raw.index(b"\x01" * 16) + 100] = 2  # one byte of the member's data, same size
    f.write_bytes(bytes(raw))
    assert not Journal(tmp_path, 0).finished("t/p")


@pytest.mark.parametrize("key", ["zero2", "pipeline"])
def test_two_nodes_byte_identical_to_one_process(tmp_path, reference, key):
    doc, _ = _job(2, 1, [sample(*SAMPLES[key]), tmp_path / "u"])
    assert _digest(tmp_path / "u") == reference(key)
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and doc["resumed"] == 0
    assert doc["converted"] == doc["params"] and all(r["params"] > 0 for r in doc["ranks"])
    assert sum(r["bytes"] for r in doc["ranks"]) == doc["bytes_written"]
    assert not list(tmp_path.glob(".ckpt-staging-*"))


def test_nproc_shorthand_one_node_two_processes(tmp_path, reference):
    r = run_cli("to-universal", sample(*SAMPLES["pipeline"]), tmp_path / "u", "--nproc", "2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["rank"] for x in json.loads(r.stdout)["ranks"]] == [0, 1]
    assert _digest(tmp_path / "u") == reference("pipeline")


def test_lost_rank_fails_in_bounded_time_and_the_rerun_resumes(tmp_path, reference):
    """Node 1's rank is killed (SIGKILL) after it journaled 3 parameters: rank 0 names it and exits 2 within
    the lost-rank window, OUT is absent; the same command then converts only the rest, byte-identical."""
    src, out = sample(*SAMPLES["zero2"]), tmp_path / "u"
    t0 = time.monotonic()
    done = _wait(_launch(2, 1, [src, out], env={"CKPT_TEST_KILL_AFTER": "1:3", "CKPT_DIST_LOST_S": "4"}))
    assert time.monotonic() - t0 < 60
    _rank_1_lost(done, out, tmp_path / ".ckpt-staging-u-job")

    doc, _ = _job(2, 1, [src, out])
    assert doc["resumed"] >= 3 and doc["converted"] + doc["resumed"] == doc["params"]
    assert doc["converted"] < doc["params"]
    # the resumed parameters' files were fsynced and scanned by the killed run (their journal lines say so): not
    # again; every other file once
    per_param = {len(list(p.iterdir())) for p in (out / doc["tag"] / "zero").iterdir() if p.is_dir()}
    assert len(per_param) == 1
    left = len(_digest(out)) - per_param.pop() * doc["resumed"]
    assert sum(r["fsynced_files"] for r in doc["ranks"]) == sum(r["scanned_files"] for r in doc["ranks"]) == left
    assert _digest(out) == reference("zero2")
    assert not list(tmp_path.glob(".ckpt-staging-*"))


def test_lost_node_0_fails_the_other_node(tmp_path):
    """Rank 0 killed: node 0's torchrun (the job's store) goes with it; node 1's rank says so and exits 2."""
    out = tmp_path / "u"
    done = _wait(
        _launch(2, 1, [sample(*SAMPLES["zero2"]), out], env={"CKPT_TEST_KILL_AFTER": "0:3", "CKPT_DIST_LOST_S": "4"})
    )
    errors = [line for line in done[1][2].splitlines() if line.startswith("ckpt: error:")]
    assert len(errors) == 1 and "node 0 was lost (rank 0 (host " in errors[0], done[1][2][-3000:]
    assert "exitcode: 2" in done[1][2] and not out.exists()


def test_restart_throws_the_staging_away(tmp_path, reference):
    """One node, two processes: rank 1 killed (torchrun stops rank 0), nothing in place; the same command in one
    process without torchrun, with `--restart`, converts everything again."""
    src, out = sample(*SAMPLES["zero2"]), tmp_path / "u"
    done = _wait(_launch(1, 2, [src, out], env={"CKPT_TEST_KILL_AFTER": "1:2"}))
    assert done[0][0] != 0 and not out.exists()
    assert len((tmp_path / ".ckpt-staging-u-job" / ".journal" / "rank1.jsonl").read_text().splitlines()) == 2
    r = run_cli("to-universal", src, out, "--restart", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout)
    assert doc["resumed"] == 0 and doc["converted"] == doc["params"] and len(doc["ranks"]) == 1
    assert _digest(out) == reference("zero2")
    # one process: every file fsynced and scanned before it was put in place, each once
    assert doc["ranks"][0]["fsynced_files"] == doc["ranks"][0]["scanned_files"] == len(_digest(out))


def test_convert_under_torchrun_needs_no_flag(tmp_path, reference):
    """`ckpt convert --to deepspeed-universal` as a 1 x 2 job without --distributed: the ranks share the work."""
    doc, _ = _job(
        1, 2, [sample(*SAMPLES["zero2"]), tmp_path / "u", "--to", "deepspeed-universal"], command=("convert",)
    )
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert _digest(tmp_path / "u") == reference("zero2")


@pytest.mark.skipif(not importlib.util.find_spec("s3fs"), reason="needs the remote extra (s3fs)")
def test_url_source_read_by_every_rank(tmp_path, reference):
    """SRC an s3:// URL (a moto server on 127.0.0.1): both ranks of a one-node, two-process job read it themselves;
    the output is the same bytes as the one-process conversion of the local folder."""
    from test_remote_s3 import _env, _fs, moto_server

    with moto_server(tmp_path / "moto.log") as endpoint:
        fs = _fs(endpoint)
        fs.mkdir("job")
        fs.put(str(sample(*SAMPLES["zero2"])), "job/zero2_bf16", recursive=True)
        doc, _ = _job(1, 2, ["s3://job/zero2_bf16", tmp_path / "u"], env=_env(endpoint, TMPDIR=str(tmp_path)))
    assert _digest(tmp_path / "u") == reference("zero2")
    assert [r["rank"] for r in doc["ranks"]] == [0, 1] and all(r["params"] > 0 for r in doc["ranks"])
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-remote-")]  # the ranks' mirrors gone


def test_verify_split_between_the_ranks(tmp_path, reference):
    """--verify in a two-node job: each rank compares its own share of the parameters with the source, and --json
    says which: two disjoint shares that together hold every parameter folder written."""
    out = tmp_path / "u"
    doc, _ = _job(2, 1, [sample(*SAMPLES["zero2"]), out, "--verify"])
    assert doc["verified"] is True and _digest(out) == reference("zero2")
    shares = [set(r["verified"]) for r in doc["ranks"]]
    assert all(shares) and not shares[0] & shares[1]
    written = {p.name for p in (out / doc["tag"] / "zero").iterdir() if p.is_dir()}
    assert shares[0] | shares[1] == written and len(written) == doc["params"]
    assert sum(r["verified_bytes"] for r in doc["ranks"]) == doc["bytes_written"]


def test_each_rank_fsyncs_and_scans_its_own_share(tmp_path, reference):
    """Two nodes: each rank fsyncs and scans (the output gate) the files of the parameters it converted before it
    reports success; rank 0 then does only its own share and the common files, so no file is done twice."""
    out = tmp_path / "u"
    doc, _ = _job(2, 1, [sample(*SAMPLES["zero2"]), out, "--verify"])
    assert _digest(out) == reference("zero2") and doc["resumed"] == 0
    zero = out / doc["tag"] / "zero"
    files = [sum(1 for n in r["verified"] for _ in (zero / n).iterdir()) for r in doc["ranks"]]  # its share's files
    common = len(_digest(out)) - sum(files)
    r0, r1 = doc["ranks"]
    assert files[1] > 0 and common > 0
    assert r1["fsynced_files"] == r1["scanned_files"] == files[1]
    assert r0["fsynced_files"] == r0["scanned_files"] == files[0] + common


def test_a_file_the_gate_refuses_fails_its_rank(tmp_path):
    """A parameter file rank 1 wrote that carries a global outside the allowlist: rank 1's journal refuses it
    before recording it, and the line rank 1 reports (the one rank 0 fails the job with) names rank 1 and the
    file. (Real input cannot reach this: the source check refuses such a checkpoint first.)"""
    import pickle

    from ckpt_tools.write import shares

    class Rank1:
        rank, world, hosts, done, on_others = 1, 2, ["h0", "h1"], 0, None
        said: dict = {}

        def who(self, r):
            return f"rank {r} (host {self.hosts[r]})"

        def exchange(self, stage, obj):
            self.said[stage] = obj
            return [{"staged": "", "checked": []}.get(stage, ["rank 0 stopped", {}]), obj]

        def close(self):
            pass

    out = tmp_path / "u"
    staging = shares.job_staging(out)
    (staging / shares.JOURNAL).mkdir(parents=True)
    (staging / shares.JOURNAL / "plan").write_text("d")

    def convert(todo, journal, counted):
        (staging / "p").mkdir()
        (staging / "p" / "fp32.pt").write_bytes(pickle.dumps(os.system, protocol=2))
        journal.record("p")
        return 1

    job = Rank1()
    with pytest.raises(Exception) as e:
        shares.run_job(job, out, [shares.Unit("p", 1)], digest="d", restart=False, convert=convert, finish=None)
    line, fig = job.said["converted"]
    assert line.startswith("rank 1 (host h1): ") and "p/fp32.pt" in line and "system" in line, line
    assert "p/fp32.pt" in str(e.value) and fig["fsynced_files"] == fig["scanned_files"] == 0
    assert (staging / shares.JOURNAL / "rank1.jsonl").read_text() == ""  # not recorded: a rerun redoes it
    assert not out.exists()


def test_a_corrupt_file_in_rank_1s_share_fails_its_verification(tmp_path):
    """A job interrupted after rank 1 journaled two parameters; one of its files is then rewritten with a changed
    value and journaled again (a writer's silent error: the journal cannot tell). The rerun with --verify resumes
    that parameter, and rank 1, whose share of the comparison holds it (the same balanced share it converted),
    finds it: one line naming rank 1 and its host, exit 2, nothing in place and the staging folder removed."""
    import torch

    src, out = sample(*SAMPLES["zero2"]), tmp_path / "u"
    done = _wait(_launch(1, 2, [src, out], env={"CKPT_TEST_KILL_AFTER": "1:2"}))
    assert done[0][0] != 0 and not out.exists()
    staging = tmp_path / ".ckpt-staging-u-job"
    rel = json.loads((staging / ".journal" / "rank1.jsonl").read_text().splitlines()[0])["dir"]
    f = staging / rel / "fp32.pt"
    state = torch.load(f, weights_only=False)
    state["param"].view(-1)[0] += 1.0
    torch.save(state, f)
    journal = Journal(staging, 1)
    journal.record(rel)  # the changed file's sizes and checksums: the rerun finds the parameter finished
    journal.close()

    done = _wait(_launch(2, 1, [src, out, "--verify"]))
    assert all(rc != 0 for rc, _, _ in done)
    errors = [line for line in done[0][2].splitlines() if line.startswith("ckpt: error:")]
    assert len(errors) == 1, done[0][2][-3000:]
    name = rel.rsplit("/", 1)[-1]
    assert "verification by rank 1 (host " in errors[0] and "rank 0" not in errors[0] and name in errors[0]
    assert "exitcode: 2" in done[0][2]
    assert not out.exists() and not staging.exists()
