"""The tests' `ckpt` runner (`forkserver`): a command forked from the pre-imported server prints, writes and exits as
the same command in a fresh interpreter does, with the caller's working folder, environment and stdin."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

import forkserver
import pytest
from conftest import ROOT, sample


def both(argv, monkeypatch, **kw):
    """(forked, fresh): the same command run both ways."""
    monkeypatch.delenv("CKPT_TEST_FRESH_PROCESS", raising=False)
    forked = forkserver.run([str(a) for a in argv], cwd=kw.pop("cwd", ROOT), **kw)
    monkeypatch.setenv("CKPT_TEST_FRESH_PROCESS", "1")
    fresh = forkserver.run([str(a) for a in argv], cwd=kw.pop("cwd", ROOT), **kw)
    return forked, fresh


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", sample("deepspeed", "zero2_bf16"), "--json"],
        ["inspect", sample("megatron", "gpt_tp2_pp2")],
        ["check-tp-sync", sample("megatron", "gpt_tp2_pp2_drifted")],  # exit 1: a check that finds problems
        ["inspect", "/nonexistent/checkpoint"],  # exit 2: one error line
        ["inspect", "--no-such-option"],  # click's usage error
    ],
)
def test_a_forked_command_prints_and_exits_as_a_fresh_one(argv, monkeypatch):
    forked, fresh = both(argv, monkeypatch)
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)


def test_the_callers_folder_environment_and_stdin_reach_the_command(copy_sample, monkeypatch, tmp_path):
    """A relative path from the caller's folder, a confirmation answered on stdin and TMPDIR from the environment
    given: a forked `set-lr` refuses on "n" and edits on "y" as a fresh one does, printing the same, and leaves
    the same (nothing) in its TMPDIR."""
    results = []
    for mode in ("forked", "fresh"):
        ck = copy_sample("deepspeed", "zero2_lambdalr")
        ck = ck.rename(ck.with_name(f"{mode}_zero2"))
        tmp = tmp_path / f"tmp_{mode}"
        tmp.mkdir()
        if mode == "fresh":
            monkeypatch.setenv("CKPT_TEST_FRESH_PROCESS", "1")
        else:
            monkeypatch.delenv("CKPT_TEST_FRESH_PROCESS", raising=False)
        env = {**os.environ, "TMPDIR": str(tmp)}
        no = forkserver.run(["set-lr", ck.name, "--scale", "0.5"], cwd=ck.parent, env=env, input="n\n")
        yes = forkserver.run(["set-lr", ck.name, "--scale", "0.5"], cwd=ck.parent, env=env, input="y\n")
        out = re.sub(r"\d{8}T\d{6}-\d+-", "TIME-PID-", yes.stdout.replace(mode, "MODE"))  # the backup's name
        results.append((no.returncode, yes.returncode, out, sorted(os.listdir(tmp))))
    assert results[0] == results[1]
    assert results[0][0] != 0 and results[0][1] == 0  # "no" wrote nothing, "yes" wrote the edit


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(monkeypatch):
    """As subprocess.run's timeout: a command that does not end in time is killed and TimeoutExpired raised; the
    next command runs (in a new server: the old one's socket timed out). The command waits on an S3 endpoint that
    accepts the connection and never answers."""
    monkeypatch.delenv("CKPT_TEST_FRESH_PROCESS", raising=False)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        env = {
            **os.environ,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            forkserver.run(["inspect", "s3://bucket/run/global_step4"], cwd=ROOT, env=env, timeout=3)
        assert time.monotonic() - started < 30
    after = forkserver.run(["inspect", str(sample("deepspeed", "zero2_bf16")), "-q"], cwd=ROOT)
    assert after.returncode == 0, after.stderr
