"""Writes survive kill -9: `set-lr`, `set-step`, `sync-tp` (changed in place, journaled: issue 14) and
`to-universal` (a new folder) are SIGKILLed at seeded points of their write path. For the in-place surgery a file
may be torn right after the kill, but only while a journal says the write is unfinished; after what runs next
(`ckpt restore`, or any ckpt write's recovery) the checkpoint must be the original bytes or the complete new ones,
with no stray file inside any checkpoint folder; re-running the command finishes the job, `ckpt restore` undoes
it byte for byte, and real torch loads every patched file (plainly and with mmap=True) to the same objects as the
whole-file path (`--copy`) writes.

Kill points come from the CLI's test hook `CKPT_TEST_KILL_AT=STAGE:N` (cli/main.py: the Nth `io.execute`
stage — produce, backup, replace, write (after each range written in place), verify, done — or the Nth file
fsync) plus a few kills at seeded times after start. The killed run is a real `ckpt` process; the checks and
re-runs run in this process (fast).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT, SAMPLES
from hostile.runner import run, snapshot

from ckpt_tools.write import io
from ckpt_tools.ops import lr as lr_ops
from ckpt_tools.ops import tp_sync as tp_ops

SEED = 7


def _killed_run(argv: list, kill_at: str | None = None, after_s: float | None = None) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("CKPT_DEBUG", None)
    if kill_at:
        env["CKPT_TEST_KILL_AT"] = kill_at
    p = subprocess.Popen(
        [sys.executable, "-c", "from ckpt_cli.main import main; main()", *map(str, argv)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
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


# --- surgery in place (set-lr, set-step, sync-tp) -----------------------------------------------------------
#
# These commands change files IN PLACE (issue 14): a torch zip takes a new data.pkl member and central directory
# after its last member, tensor bytes and CRC-32s are overwritten; the original bytes of every range go to a
# rollback journal outside the checkpoint first (fsynced). So right after a kill -9 a file MAY be torn — but only
# while a journal says the write is unfinished (`io.interrupted_write`), and whatever runs next (`ckpt restore`, or
# any ckpt write: `io.recover`) must leave the original bytes or the complete new ones.

SURGERY = {
    "set-lr": (("deepspeed", "zero2_lambdalr"), ["--lr", "1e-4"], lambda ck, **kw: lr_ops.set_lr(ck, lr=1e-4, **kw)),
    "set-step": (
        ("deepspeed", "zero2_lambdalr"),
        ["--optimizer-step", "1497"],
        lambda ck, **kw: lr_ops.set_step(ck, optimizer_step=1497, **kw),
    ),
    "sync-tp": (("megatron", "gpt_tp2_pp2_drifted"), [], lambda ck, **kw: tp_ops.sync_tp(ck, **kw)),
    # DCP: new item blobs appended to the .distcp file in place, .metadata replaced whole, in one transaction
    "set-lr-dcp": (("fsdp", "fsdp2_dcp"), ["--lr", "1e-4"], lambda ck, **kw: lr_ops.set_lr(ck, lr=1e-4, **kw)),
}
# (kill points per stage kind, fsync points, timed kills) per command: >= 50 trials in all
BUDGET = {"set-lr": (3, 3, 2), "set-step": (4, 3, 2), "sync-tp": (3, 4, 3), "set-lr-dcp": (2, 2, 1)}


def _count_stages(fn, ck: Path) -> tuple[dict[str, int], int]:
    """Run the write once in this process on `ck`, counting each io.execute stage and each fsync of a file."""
    from collections import Counter

    seen, fsyncs = Counter(), [0]
    real = io._fsync_file

    def counting(p):
        real(p)
        fsyncs[0] += 1

    io._fsync_file = counting
    try:
        fn(ck, on_stage=lambda stage, f: seen.update([stage]))
    finally:
        io._fsync_file = real
    return dict(seen), fsyncs[0]


def _same_loaded(a, b, where="") -> list[str]:
    """Differences between two objects torch.load gave (tensors bitwise, containers item by item)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.view(torch.uint8) if a.dtype.is_floating_point and a.numel() and a.is_contiguous() and a.dim() else a,
                b.view(torch.uint8) if b.dtype.is_floating_point and b.numel() and b.is_contiguous() and b.dim() else b,
            )
        )
        return [] if ok else [where or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys"]
        return [d for k in a for d in _same_loaded(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: length/type"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same_loaded(x, y, f"{where}.{i}")]
    if hasattr(a, "__dict__") and not isinstance(a, type) and type(a) is type(b):
        return _same_loaded(vars(a), vars(b), where)
    try:
        return [] if (a == b) is True or (a != a and b != b) else [where]
    except Exception:
        return [] if type(a) is type(b) else [where]


def _torch_loads(folder: Path, files: list[str]) -> dict[str, object]:
    """Every file loaded by real torch, plain (weights_only=False: our own samples) and mmap=True; equal both ways."""
    import torch

    out = {}
    for rel in files:
        plain = torch.load(folder / rel, weights_only=False, map_location="cpu")
        mapped = torch.load(folder / rel, weights_only=False, map_location="cpu", mmap=True)
        assert not _same_loaded(plain, mapped), f"{rel}: mmap load differs from a plain load"
        out[rel] = plain
    return out


def _kill_points(counts: dict[str, int], fsyncs: int, budget: tuple[int, int, int], rng) -> list:
    per_stage, n_fsync, n_timed = budget
    points = []
    for stage in ("produce", "backup", "replace", "write"):
        n = counts.get(stage, 0)
        picks = sorted(rng.sample(range(1, n + 1), min(per_stage, n)))
        if n and n not in picks:
            picks[-1] = n  # always the last one too
        points += [(f"{stage}:{i}", None) for i in picks]
    points += [("verify:1", None), ("done:1", None)]
    points += [(f"fsync:{i}", None) for i in sorted(rng.sample(range(1, fsyncs + 1), min(n_fsync, fsyncs)))]
    points += [(None, rng.uniform(1.0, 3.0)) for _ in range(n_timed)]
    return points


@pytest.mark.slow
@pytest.mark.parametrize("command", list(SURGERY))
def test_surgery_in_place_kill9(tmp_path, command):
    (group, name), options, fn = SURGERY[command]
    argv = [command.removesuffix("-dcp")]
    ck = tmp_path / "ckpts" / name
    shutil.copytree(SAMPLES / group / name, ck)
    before = _files(ck)
    # the complete new state: in place (counting the stages), and the same surgery as whole copies (--copy)
    ref = tmp_path / "ref" / name
    shutil.copytree(ck, ref)
    counts, fsyncs = _count_stages(fn, ref)
    after = _files(ref)
    changed = sorted(k for k in before if before[k] != after[k])
    assert set(after) == set(before) and changed and counts.get("write", 0) >= 1
    (tx,) = [t for t in io.transactions(ref) if t.status == "done"]
    zips = [k for k in changed if not k.endswith((".distcp", ".metadata"))]
    assert sorted(tx.in_place) == [k for k in changed if k != ".metadata"]
    assert tx.written < sum((ref / k).stat().st_size for k in tx.in_place)
    full = tmp_path / "full" / name
    shutil.copytree(ck, full)
    fn(full, copy=True)
    if len(zips) < len(changed):  # DCP: the same bytes either way (appended blobs, same .metadata)
        assert _files(full) == after
    # real torch loads every patched file (plain and mmap), to the same objects as the whole-file rewrite's
    got, want = _torch_loads(ref, zips), _torch_loads(full, zips)
    for rel in zips:
        assert not _same_loaded(got[rel], want[rel]), f"{rel}: in place and --copy load differently"
        with zipfile.ZipFile(ref / rel) as zf:
            assert zf.testzip() is None  # every member's CRC-32 matches its bytes

    rng = random.Random(f"{SEED}-{command}")
    points = _kill_points(counts, fsyncs, BUDGET[command], rng)
    outcomes = {"original": 0, "updated": 0, "finished": 0, "torn-then-rolled-back": 0, "mixed-then-rolled-back": 0}
    problems = []
    for k, (kill_at, after_s) in enumerate(points):
        label = kill_at or f"t={after_s:.2f}s"
        rc = _killed_run([*argv, ck, *options, "--yes"], kill_at, after_s)
        if rc == 0:
            outcomes["finished"] += 1
        elif rc != -signal.SIGKILL:
            problems.append(f"{label}: exit {rc}")
        now = _files(ck)
        if set(now) != set(before):
            problems.append(f"{label}: stray/missing files {sorted(set(now) ^ set(before))}")
        torn = [f for f in now if now[f] not in (before.get(f), after.get(f))]
        mixed = now != before and now != after
        pending = io.interrupted_write(ck)
        if (torn or mixed) and pending is None:
            problems.append(f"{label}: torn {torn} / mixed state without an unfinished journal")
        if torn:
            outcomes["torn-then-rolled-back"] += 1
        elif mixed:
            outcomes["mixed-then-rolled-back"] += 1
        # what runs next rolls an unfinished write back: `ckpt restore` (every other trial) or any ckpt write
        if pending is not None and k % 2 == 0:
            r = run("restore", ck, "--yes")
            if r.code != 0:
                problems.append(f"{label}: restore exit {r.code} {r.error_lines()[-1:]}")
        else:
            io.recover(ck)
        now = _files(ck)
        if now == before:
            outcomes["original"] += 1
        elif now == after:
            outcomes["updated"] += 1
        else:
            problems.append(
                f"{label}: after recovery neither original nor updated: {[f for f in now if now[f] != before.get(f)]}"
            )
        if io.interrupted_write(ck) is not None:
            problems.append(f"{label}: still an unfinished write after recovery")
        # re-running completes the job; over a finished one it changes nothing and says so (a no-op is exit 2)
        done_already = _files(ck) == after
        r = run(*argv, ck, *options, "--yes")
        noop = done_already and r.code == 2 and any("nothing to" in line for line in r.error_lines())
        if (r.code not in (0, 1) and not noop) or _files(ck) != after:
            problems.append(f"{label}: re-run exit {r.code}, complete={_files(ck) == after}: {r.error_lines()[-1:]}")
        # back to the original through the product's own undo (the killed run's write too, if it finished)
        while _files(ck) != before and any(t.status == "done" for t in io.transactions(ck)):
            r = run("restore", ck, "--yes")
            if r.code != 0:
                problems.append(f"{label}: restore exit {r.code} {r.error_lines()[-1:]}")
                break
        if _files(ck) != before:
            problems.append(f"{label}: restore did not give the original bytes back")
        if list(ck.parent.glob(".ckpt-staging-*")) or [p for p in ck.rglob("*") if p.name.endswith((".new", ".tmp"))]:
            problems.append(f"{label}: staging litter")
    # `ckpt restore` killed midway (after its journal says "restoring", after the first file put back): the next
    # restore finishes the undo, byte for byte
    for i in (1, 2):
        r = run(*argv, ck, *options, "--yes")
        if r.code not in (0, 1):
            problems.append(f"restore trial {i}: write exit {r.code}")
        rc = _killed_run(["restore", ck, "--yes"], f"fsync:{i}")
        if rc != -signal.SIGKILL:
            problems.append(f"restore killed at fsync:{i}: exit {rc}")
        if _files(ck) not in (before, after) and io.interrupted_write(ck) is None:
            problems.append(f"restore killed at fsync:{i}: half-restored without an unfinished journal")
        r = run("restore", ck, "--yes")
        if r.code != 0 or _files(ck) != before:
            problems.append(
                f"restore killed at fsync:{i}: the next restore exit {r.code}, original={_files(ck) == before}"
            )
        outcomes["restore-killed-then-finished"] = outcomes.get("restore-killed-then-finished", 0) + 1
    print(f"\n{command} kill -9 (in place): {len(points) + 2} trials, outcomes {outcomes}, {len(problems)} problems")
    assert len(points) >= 10 and outcomes["original"] + outcomes["updated"] == len(points)
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
