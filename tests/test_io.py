"""The write path: atomic per file, backed up outside the checkpoint, verified, all-or-nothing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_tools.write import io


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def make_ckpt(tmp_path: Path) -> Path:
    root = tmp_path / "run" / "ckpt"
    (root / "global_step4").mkdir(parents=True)
    (root / "latest").write_text("global_step4")
    for i in range(3):
        (root / "global_step4" / f"part{i}.pt").write_bytes(os.urandom(1000 + i))
    return root


def upper_plan(
    root: Path, files=("global_step4/part0.pt", "global_step4/part1.pt", "global_step4/part2.pt"), verify=None
) -> io.WritePlan:
    def producer(rel):
        return lambda tmp: tmp.write_bytes(b"NEW" + (root / rel).read_bytes())

    writes = tuple(
        io.FileWrite(rel, (io.FieldChange(rel, "header", "old", "NEW"),), 1003, producer(rel)) for rel in files
    )
    return io.WritePlan(root, "test-write", writes, verify=verify)


def fail_at(fail_stage: str, nth: int):
    """An `on_stage` hook that raises at the nth (0-based) call for `fail_stage`."""
    seen = {"n": 0}

    def on_stage(stage, f):
        if stage == fail_stage:
            if seen["n"] == nth:
                raise RuntimeError(f"injected failure at {stage} {f}")
            seen["n"] += 1

    return on_stage


def run_killed(root: Path, plan: str, stage: str, at: int, plan_args: str = "") -> subprocess.CompletedProcess:
    """Runs `io.execute(<plan>(root<plan_args>))` in a child process that dies (like kill -9, exit 9) at the
    `at`-th (1-based) call of `on_stage` for `stage`."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_io import {plan}
        from ckpt_tools.write import io
        n = {{"k": 0}}
        def on_stage(stage, f):
            if stage == {stage!r}:
                n["k"] += 1
                if n["k"] == {at}:
                    os._exit(9)
        io.execute({plan}(Path({str(root)!r}){plan_args}), on_stage=on_stage)
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent)


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


@pytest.mark.parametrize(
    "fail_stage,nth", [("produce", 0), ("produce", 2), ("backup", 1), ("replace", 0), ("replace", 2), ("verify", 0)]
)
def test_failure_at_any_stage_leaves_the_checkpoint_byte_identical(tmp_path, fail_stage, nth):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    with pytest.raises(io.WriteFailed):
        io.execute(upper_plan(root), on_stage=fail_at(fail_stage, nth))
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
    proc = run_killed(root, "upper_plan", "replace", 2)  # like kill -9 after the first file was replaced
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


# --- in place: the rollback journal (issue 14) ---------------------------------------------------------------


def edit_plan(
    root: Path,
    files=("global_step4/part0.pt", "global_step4/part1.pt", "global_step4/part2.pt"),
    grow: int = 40,
    verify=None,
) -> io.WritePlan:
    """Each file: bytes 10..14 overwritten, 8 bytes before the end overwritten, then `grow` bytes appended
    (negative: the file cut by that much). The whole-file form writes the same result."""

    def change(path: Path) -> io.InPlace:
        size = path.stat().st_size
        edits = [io.ByteEdit(10, b"EDIT!"), io.ByteEdit(size + min(grow, 0) - 8, b"TAIL" * 2 + b"+" * max(grow, 0))]
        return io.InPlace(tuple(edits), size + grow)

    def result(path: Path) -> bytes:
        data = bytearray(path.read_bytes())
        c = change(path)
        for e in c.edits:
            data[e.offset : e.offset + len(e.data)] = e.data
        return bytes(data[: c.size])

    writes = tuple(
        io.FileWrite(
            rel,
            (io.FieldChange(rel, "bytes", "old", "new"),),
            (root / rel).stat().st_size,
            lambda tmp, rel=rel: tmp.write_bytes(result(root / rel)),
            "test",
            lambda path: change(path),
        )
        for rel in files
    )
    return io.WritePlan(root, "test-edit", writes, verify=verify)


@pytest.mark.parametrize("grow", [40, 0, -100])
def test_in_place_write_journals_only_changed_bytes_and_restore_undoes_it(tmp_path, grow):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    want_copy = make_ckpt(tmp_path / "other")
    for rel in before:
        (want_copy / rel).write_bytes((root / rel).read_bytes())
    t_copy = io.execute(edit_plan(want_copy, grow=grow), copy=True)  # the same change, as whole new files
    assert t_copy.in_place == ()
    inodes = {rel: (root / rel).stat().st_ino for rel in before}
    t = io.execute(edit_plan(root, grow=grow))
    assert sorted(t.in_place) == sorted(r for r in before if r.endswith(".pt"))
    assert snapshot(root) == snapshot(want_copy)  # same bytes as the whole-file path
    assert {rel: (root / rel).stat().st_ino for rel in before} == inodes  # same files: changed in place
    journal = json.loads((t.dir / io.JOURNAL).read_text())
    assert journal["status"] == "done" and not list((t.dir / "files").rglob("*.pt"))  # no whole copies
    for e in journal["files"]:
        assert e["mode"] == "in-place" and e["size"] == 1000 + int(e["path"][-4])
        undo = (t.dir / e["undo"]).read_bytes()
        assert len(undo) == e["undo_bytes"] == 5 + 8 + max(-grow, 0)  # the changed ranges (and a cut tail) only
        assert e["written_bytes"] == 5 + 8 + max(grow, 0) and e["new_size"] == e["size"] + grow
    assert t.written == 3 * (13 + max(grow, 0)) and t.nbytes == 3 * (13 + max(-grow, 0))
    t = io.restore(root)
    assert t.status == "restored" and snapshot(root) == before


@pytest.mark.parametrize(
    "fail_stage,nth", [("produce", 1), ("backup", 2), ("replace", 1), ("write", 0), ("write", 3), ("verify", 0)]
)
def test_in_place_failure_at_any_stage_puts_the_bytes_back(tmp_path, fail_stage, nth):
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    with pytest.raises(io.WriteFailed):
        io.execute(edit_plan(root, grow=-100), on_stage=fail_at(fail_stage, nth))
    assert snapshot(root) == before
    assert [t.status for t in io.transactions(root)] == ["rolled-back"]


@pytest.mark.parametrize("kill_at", [1, 2, 4, 5])
def test_kill_in_the_middle_of_in_place_writes_is_rolled_back_byte_for_byte(tmp_path, kill_at):
    """A process killed between two ranges written in place leaves a torn file; the journal (state "committing")
    says so, and the next call puts the original length and bytes back."""
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    proc = run_killed(root, "edit_plan", "write", kill_at, ", grow=-100")  # kill -9 between two in-place writes
    assert proc.returncode == 9
    assert snapshot(root) != before  # torn: some ranges written, some not
    assert "interrupted" in (io.interrupted_write(root) or "")
    (t,) = io.transactions(root)
    assert t.status == "committing" and io.replaced_files(t)
    assert io.recover(root) == [t.dir]
    assert snapshot(root) == before and io.interrupted_write(root) is None
    assert io.recover(root) == []  # nothing left: rolling back twice changes nothing
    io.execute(edit_plan(root, grow=-100))
    assert snapshot(root) != before


def test_hard_linked_and_read_only_files_are_copied_not_changed_in_place(tmp_path):
    """An in-place write to a file with another hard link would change that other path too; a read-only file
    is not written into: both go through the whole-file path, and the other link keeps the old bytes."""
    root = make_ckpt(tmp_path)
    elsewhere = tmp_path / "elsewhere.pt"
    os.link(root / "global_step4" / "part0.pt", elsewhere)
    kept = elsewhere.read_bytes()
    (root / "global_step4" / "part1.pt").chmod(0o444)
    before = snapshot(root)
    t = io.execute(edit_plan(root))
    assert t.in_place == ("global_step4/part2.pt",)
    journal = json.loads((t.dir / io.JOURNAL).read_text())
    why = {e["path"]: e.get("why_not_in_place", "") for e in journal["files"]}
    assert "hard links" in why["global_step4/part0.pt"] and "read-only" in why["global_step4/part1.pt"]
    assert elsewhere.read_bytes() == kept
    assert (root / "global_step4" / "part1.pt").stat().st_mode & 0o777 == 0o444
    io.restore(root)
    assert snapshot(root) == before


def test_restore_refuses_a_file_changed_after_the_write(tmp_path):
    root = make_ckpt(tmp_path)
    io.execute(edit_plan(root))
    f = root / "global_step4" / "part1.pt"
    data = bytearray(f.read_bytes())
    data[12] ^= 0xFF  # inside a range the write wrote
    f.write_bytes(bytes(data))
    changed = snapshot(root)
    with pytest.raises(io.CkptError, match="changed since `test-edit` wrote it"):
        io.restore(root)
    assert snapshot(root) == changed  # nothing restored


def test_restored_whole_file_write_leaves_one_link_and_undo_copies_on_write(tmp_path):
    """Write 1 in place, write 2 as copies (--copy), restored: the file is its original inode again and the
    backup folder's second name for it is dropped (1 link), so later writes can still change it in place.
    A file that does have another name (a user's hard link) is undone copy-on-write: the other name keeps its
    bytes."""
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    target = root / "global_step4" / "part0.pt"
    t1 = io.execute(edit_plan(root, files=("global_step4/part0.pt",)))
    t2 = io.execute(upper_plan(root, files=("global_step4/part0.pt",)), copy=True)
    io.restore(root)
    assert target.stat().st_nlink == 1
    assert not (t2.dir / "files" / "global_step4" / "part0.pt").exists()
    other = tmp_path / "users-own-link.pt"
    os.link(target, other)
    kept = other.read_bytes()
    io.restore(root)
    assert snapshot(root) == before and other.read_bytes() == kept != target.read_bytes()
    assert t1.dir.exists()


@pytest.mark.parametrize("copy", [False, True], ids=["in-place", "copy"])
def test_kill_during_restore_is_finished_by_the_next_restore_or_write(tmp_path, copy):
    """`ckpt restore` killed after putting back one file of three: the journal says "restoring", so the next
    restore (or any write's recovery) finishes the undo instead of refusing the half-restored files."""
    root = make_ckpt(tmp_path)
    before = snapshot(root)
    io.execute(edit_plan(root), copy=copy)
    after = snapshot(root)
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from ckpt_tools.write import io
        io.restore(Path({str(root)!r}), progress=lambda n: os._exit(9))  # killed after the first file
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent)
    assert proc.returncode == 9
    half = snapshot(root)
    assert half not in (before, after)
    (t,) = io.transactions(root)
    assert t.status == "restoring" and "while `ckpt restore` was undoing it" in io.interrupted_write(root)
    assert io.restore(root).status == "restored"
    assert snapshot(root) == before and io.interrupted_write(root) is None
