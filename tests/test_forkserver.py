"""The tests' `ckpt` runner (`forkserver`): a command forked from the pre-imported server prints, writes and exits as
the same command in a fresh interpreter does, with the caller's working folder, environment and stdin."""

from __future__ import annotations

import os
import re

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
