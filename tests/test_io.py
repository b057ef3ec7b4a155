"""The write path: atomic per file, backed up outside the checkpoint, verified, all-or-nothing."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_tools import io


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def make_ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "run" / "ckpt"
    (root / "global_step4").mkdir(parents=True)
    (root / "latest").write_text("global_step4")
    for i in range(3):
        (root / "global_step4" / f"part{i}.pt").write_bytes(os.urandom(1000 + i))
    return root


def upper_plan(root: Path, files=("global_step4/part0.pt", "global_step4/part1.pt", "global_step4/part2.pt"),
               verify=None) -> io.WritePlan:
    def producer(rel):
        return lambda tmp: tmp.write_bytes(b"NEW" + (root / rel).read_bytes())

    writes = tuple(io.FileWrite(rel, (io.FieldChange(rel, "header", "old", "NEW"),), 1003, producer(rel))
                   for rel in files)
    return io.WritePlan(root, "test-write", writes, verify=verify)


def test_execute_writes_backs_up_outside_and_leaves_no_stray_files(tmp_path):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    t = io.execute(upper_plan(root))
    after = snapshot(root)
    assert set(after) == set(before)  # no new file inside the checkpoint
    for rel in before:
        if rel.endswith(".pt"):
            assert (root / rel).read_bytes()[:3] == b"NEW"
    assert t.dir.parent == tmp_path / "run" / ".ckpt-backups" / "ckpt"
    assert not str(t.dir.resolve()).startswith(str(root.resolve()))
    backup = t.dir / "files" / "global_step4" / "part0.pt"
    assert hashlib.sha256(backup.read_bytes()).hexdigest() == before["global_step4/part0.pt"]


def test_tag_folder_given_backs_up_beside_the_parent(tmp_path):
    root = make_ckpt(tmp_path)
    tag = root / "global_step4"
    t = io.execute(upper_plan(tag, files=("part0.pt",)))
    assert t.dir.parent == tmp_path / "run" / ".ckpt-backups" / "ckpt"


@pytest.mark.parametrize("fail_stage,nth", [("produce", 0), ("produce", 2), ("backup", 1), ("replace", 0),
                                             ("replace", 2), ("verify", 0)])
def test_failure_at_any_stage_leaves_the_checkpoint_byte_identical(tmp_path, fail_stage, nth):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    seen = {"n": 0}

    def on_stage(stage, f):
        if stage == fail_stage:
            if seen["n"] == nth:
                raise RuntimeError(f"injected failure at {stage} {f}")
            seen["n"] += 1

    with pytest.raises(io.WriteFailed):
        io.execute(upper_plan(root), on_stage=on_stage)
    assert snapshot(root) == before


def test_failed_verification_rolls_back(tmp_path):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    with pytest.raises(io.WriteFailed, match="verification"):
        io.execute(upper_plan(root, verify=lambda r: ["part1.pt: lr is not 0.5"]))
    assert snapshot(root) == before


def test_restore_brings_back_the_original_bytes(tmp_path):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    io.execute(upper_plan(root))
    assert snapshot(root) != before
    t = io.restore(root)
    assert t.status == "restored"
    assert snapshot(root) == before
    with pytest.raises(io.CkptError):
        io.restore(root)  # nothing left to undo


def test_kill_during_commit_is_rolled_back_by_the_next_call(tmp_path):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_io import upper_plan
        from ckpt_tools import io
        n = {{"k": 0}}
        def on_stage(stage, f):
            if stage == "replace":
                n["k"] += 1
                if n["k"] == 2:
                    os._exit(9)   # like kill -9 after the first file was replaced
        io.execute(upper_plan(Path({str(root)!r})), on_stage=on_stage)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent)
    assert proc.returncode == 9
    half = snapshot(root)
    assert half != before  # one file really was replaced
    rolled = io.recover(root)
    assert len(rolled) == 1
    assert snapshot(root) == before
    io.execute(upper_plan(root))  # and re-running completes the job
    assert all((root / r).read_bytes()[:3] == b"NEW" for r in before if r.endswith(".pt"))


def test_new_folder_is_atomic(tmp_path):
    out = tmp_path / "universal"
    with pytest.raises(RuntimeError):
        with io.new_folder(out) as tmp:
            (tmp / "a.pt").write_bytes(b"x")
            raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with io.new_folder(out) as tmp:
        (tmp / "a.pt").write_bytes(b"x")
    assert (out / "a.pt").read_bytes() == b"x" and sorted(p.name for p in tmp_path.iterdir()) == ["universal"]


def test_two_writes_in_the_same_second_get_their_own_transactions(tmp_path):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    t1 = io.execute(upper_plan(root, files=("global_step4/part0.pt",)))
    io.restore(root)
    t2 = io.execute(upper_plan(root, files=("global_step4/part0.pt",)))
    assert t1.dir != t2.dir
    io.restore(root)
    assert snapshot(root) == before
