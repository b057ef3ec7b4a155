"""Writes survive kill -9: `sync-tp`, `to-universal`, `set-lr` and `set-step` are SIGKILLed at
seeded points of their write path, then the checkpoint must be the original bytes or the complete new
ones, with no stray file inside any checkpoint folder, and re-running the command must finish the job.

Kill points come from the CLI's test hook `CKPT_TEST_KILL_AT=STAGE:N` (cli/main.py: the Nth `io.execute`
stage or the Nth file fsync) plus a few kills at seeded times after start. The killed run is a real
`ckpt` process; the checks and re-runs run in this process (fast).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES
from hostile.runner import run, snapshot

from ckpt_tools import io

SEED = 7


def _killed_run(argv: list, kill_at: str | None = None, after_s: float | None = None) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CKPT_DEBUG", None)
    if kill_at:
        env["CKPT_TEST_KILL_AT"] = kill_at
    p = subprocess.Popen([sys.executable, "-c", "from cli.main import main; main()", *map(str, argv)], cwd=ROOT,
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if after_s is not None:
        try:
            p.wait(after_s)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
    try:
        _, err = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        raise AssertionError(f"{argv[0]} hung")
    assert b"Traceback" not in err, err.decode()[-2000:]
    return p.returncode


def _files(folder: Path) -> dict[str, str]:
    return snapshot(folder)


@pytest.mark.slow
def test_sync_tp_kill9(tmp_path):
    ck = tmp_path / "ckpts" / "gpt_tp2_pp2_drifted"
    shutil.copytree(SAMPLES / "megatron" / "gpt_tp2_pp2_drifted", ck)
    ref = tmp_path / "ref" / "gpt_tp2_pp2_drifted"
    shutil.copytree(ck, ref)
    before = _files(ck)
    r = run("sync-tp", ref, "--yes")
    assert r.code == 0, r.stderr
    after = _files(ref)
    changed = sorted(k for k in before if before[k] != after[k])
    assert set(after) == set(before) and len(changed) == 8
    # every kill point of the write path: 8 files produced, backed up, replaced; verify; done; each fsync
    points = ([f"produce:{i}" for i in range(1, 9)] + [f"backup:{i}" for i in range(1, 9)]
              + [f"replace:{i}" for i in range(1, 9)] + ["verify:1", "done:1"])
    rng = random.Random(SEED)
    points += [f"fsync:{i}" for i in rng.sample(range(1, 16), 6)]
    timed = [rng.uniform(0.8, 2.5) for _ in range(4)]
    trials, outcomes, problems = 0, {"original": 0, "updated": 0, "finished": 0}, []
    for kill_at, after_s in [(p, None) for p in points] + [(None, t) for t in timed]:
        trials += 1
        rc = _killed_run(["sync-tp", ck, "--yes"], kill_at, after_s)
        label = kill_at or f"t={after_s:.2f}s"
        if rc == 0:
            outcomes["finished"] += 1
        elif rc != -signal.SIGKILL:
            problems.append(f"{label}: exit {rc}")
        now = _files(ck)
        # right after the kill: no stray file, every file whole (old or new bytes, never torn)
        if set(now) != set(before):
            problems.append(f"{label}: stray/missing files {sorted(set(now) ^ set(before))}")
        torn = [k for k in now if now[k] not in (before.get(k), after.get(k))]
        if torn:
            problems.append(f"{label}: torn files {torn}")
        # what the next ckpt write (or restore) does first: roll back an unfinished transaction
        io.recover(ck)
        now = _files(ck)
        if now == before:
            outcomes["original"] += 1
        elif now == after:
            outcomes["updated"] += 1
            c = run("check-tp-sync", ck)
            if c.code != 0:
                problems.append(f"{label}: updated but check-tp-sync exits {c.code}")
        else:
            problems.append(f"{label}: after recovery neither original nor updated: "
                            f"{[k for k in now if now[k] != before.get(k)]}")
        # re-running completes the job
        r = run("sync-tp", ck, "--yes")
        if r.code != 0 or _files(ck) != after:
            problems.append(f"{label}: re-run exit {r.code}, complete={_files(ck) == after}: {r.error_lines()}")
        # back to the original for the next trial, through the product's own undo
        io.restore(ck)
        if _files(ck) != before:
            problems.append(f"{label}: restore did not give the original bytes back")
        if list(ck.parent.glob(".ckpt-staging-*")) or [p for p in ck.rglob("*") if p.name.endswith((".new", ".tmp"))]:
            problems.append(f"{label}: staging litter")
    print(f"\nsync-tp kill -9: {trials} trials, outcomes {outcomes}, {len(problems)} problems")
    assert trials >= 30 and outcomes["original"] + outcomes["updated"] == trials
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_to_universal_kill9(tmp_path):
    src = tmp_path / "ckpts" / "zero2_bf16"
    shutil.copytree(SAMPLES / "deepspeed" / "zero2_bf16", src)
    src_before = _files(src)
    ref = tmp_path / "ref-universal"
    r = run("to-universal", src, ref, "--workers", "1")
    assert r.code == 0, r.stderr
    want = _files(ref)
    nfiles = sum(1 for v in want.values() if v != "dir")
    assert nfiles >= 20
    rng = random.Random(SEED)
    points = [f"fsync:{i}" for i in sorted(rng.sample(range(1, nfiles + 1), 16))] + [f"fsync:{nfiles + 5}"]
    timed = [rng.uniform(1.0, 3.0) for _ in range(4)]
    trials, outcomes, problems = 0, {"absent": 0, "complete": 0}, []
    outs = tmp_path / "outs"
    outs.mkdir()
    for k, (kill_at, after_s) in enumerate([(p, None) for p in points] + [(None, t) for t in timed]):
        trials += 1
        out = outs / f"u{k}"
        label = kill_at or f"t={after_s:.2f}s"
        rc = _killed_run(["to-universal", src, out, "--workers", "1"], kill_at, after_s)
        if rc not in (0, -signal.SIGKILL):
            problems.append(f"{label}: exit {rc}")
        if out.exists():
            outcomes["complete"] += 1
            if _files(out) != want:
                problems.append(f"{label}: {out.name} exists but differs from an uninterrupted conversion")
            r = run("to-universal", src, out)
            if r.code != 2 or "already exists" not in r.stderr:
                problems.append(f"{label}: re-run over a complete output: exit {r.code}")
        else:
            outcomes["absent"] += 1
            r = run("to-universal", src, out, "--workers", "1")
            if r.code != 0 or _files(out) != want:
                problems.append(f"{label}: re-run exit {r.code}: {r.error_lines()}")
        litter = [p.name for p in outs.iterdir() if p.name.startswith(".ckpt-staging-")]
        if litter:
            problems.append(f"{label}: staging folders left after the re-run: {litter}")
        if _files(src) != src_before:
            problems.append(f"{label}: the source checkpoint changed")
        shutil.rmtree(out, ignore_errors=True)
    print(f"\nto-universal kill -9: {trials} trials, outcomes {outcomes}, {len(problems)} problems")
    assert trials >= 20
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["set-lr", "--lr", "1e-4"], ["set-step", "--optimizer-step", "1497"]],
                         ids=["set-lr", "set-step"])
def test_counter_surgery_kill9(tmp_path, argv):
    command, options = argv[0], [*argv[1:], "--yes"]
    ck = tmp_path / "zero2_lambdalr"
    shutil.copytree(SAMPLES / "deepspeed" / "zero2_lambdalr", ck)
    before = _files(ck)
    ref = tmp_path / "ref" / "zero2_lambdalr"
    shutil.copytree(ck, ref)
    r = run(command, ref, *options)
    assert r.code == 0, r.stderr
    after = _files(ref)
    problems = []
    n = sum(1 for k in before if before[k] != after.get(k))
    points = [f"{s}:{i}" for s in ("produce", "backup", "replace") for i in range(1, n + 1)] + ["verify:1", "done:1"]
    for kill_at in points:
        _killed_run([command, ck, *options], kill_at)
        now = _files(ck)
        if set(now) != set(before) or any(now[k] not in (before[k], after[k]) for k in now):
            problems.append(f"{kill_at}: stray or torn files")
        io.recover(ck)
        if _files(ck) not in (before, after):
            problems.append(f"{kill_at}: neither original nor updated after recovery")
        r = run(command, ck, *options)
        if r.code != 0 or _files(ck) != after:
            problems.append(f"{kill_at}: re-run exit {r.code} {r.error_lines()[-1:]}")
        # undo every finished write (the killed run's, if it got to "done", and the re-run's)
        while _files(ck) != before and any(t.status == "done" for t in io.transactions(ck)):
            io.restore(ck)
        if _files(ck) != before:
            problems.append(f"{kill_at}: restore did not give the original bytes back")
    print(f"\n{command} kill -9: {len(points)} trials, {len(problems)} problems")
    assert len(points) >= 5
    assert not problems, "\n".join(problems)
