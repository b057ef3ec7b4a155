"""Writes on folders that are not simply yours, repeated and interrupted writes, and progress bars (issue 13).

Every test runs the real `ckpt` in a fresh process on a copy of a committed sample. The suite runs as root, and
root writes anywhere, so the read-only cases run the CLI with CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH dropped
(`setpriv`, else `capsh`), i.e. with the permission checks an ordinary user gets; the owner case drops CAP_CHOWN.
Run as an ordinary user, the same tests need no dropping. They skip only where none of this is possible.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli, run_on_terminal
from hostile.runner import snapshot

from ckpt_tools.write import io
from ckpt_tools import open_checkpoint

SAMPLE = ("deepspeed", "zero2_lambdalr")  # 3 files rewritten by set-lr; base_lrs [0.003, 0.003]
CLI = [sys.executable, "-c", "from ckpt_cli.main import main; main()"]


def ckpt(*args, prefix=(), answer: str | None = None, env=None) -> subprocess.CompletedProcess:
    """`ckpt ARGS` in a fresh process (optionally under `prefix`, e.g. setpriv); stdin is `answer`, else empty
    (/dev/null: no terminal)."""
    e = {**os.environ, **(env or {})}
    e.pop("CKPT_DEBUG", None)
    if not prefix:
        return run_cli(*args, env=e, input=answer)
    stdin = {"input": answer} if answer is not None else {"stdin": subprocess.DEVNULL}
    return subprocess.run(
        [*prefix, *CLI, *map(str, args)], cwd=ROOT, capture_output=True, text=True, env=e, timeout=300, **stdin
    )


def one_error_line(proc) -> str:
    """The stderr of a refused command: exactly one line, `ckpt: error: ...`, no traceback."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in proc.stderr and len(lines) == 1 and lines[0].startswith("ckpt: error: "), proc.stderr
    return lines[0]


@functools.lru_cache(maxsize=None)
def _drop(*caps: str) -> tuple[str, ...] | None:
    """A command prefix running its command without `caps`, checked to work here; None when impossible."""
    if os.geteuid() != 0:
        return () if "chown" not in caps else None  # an ordinary user has none of them already
    names = ",".join(f"-{c}" for c in caps)
    for prefix in (
        [shutil.which("setpriv"), f"--inh-caps={names}", f"--bounding-set={names}"],
        [shutil.which("capsh"), "--drop=" + ",".join(f"cap_{c}" for c in caps), "--"],
    ):
        if prefix[0] and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return tuple(prefix) if prefix[-1] != "--" else (*prefix[:-1], "--", "-c", '"$0" "$@"')
    return None


def unprivileged() -> tuple[str, ...]:
    """Prefix: no DAC override (read-only folders are read-only to us too)."""
    prefix = _drop("dac_override", "dac_read_search")
    if prefix is None:
        pytest.skip("running as root and neither setpriv nor capsh can drop CAP_DAC_OVERRIDE here")
    return prefix


def copy(copy_sample) -> Path:
    """The sample at tmp/p/z: `p` the parent (where .ckpt-backups goes by default), `z` the checkpoint."""
    src = copy_sample(*SAMPLE)
    ck = src.parent.parent / "p" / "z"
    ck.parent.mkdir()
    shutil.move(src, ck)
    return ck


def tree(folder: Path) -> dict[str, str]:
    """Every file, folder and link under `folder`, with contents hashed and permission bits and owner."""
    out = snapshot(folder)
    for dirpath, dirnames, filenames in os.walk(folder):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, folder) + "@"] = f"{stat.S_IMODE(st.st_mode):o} {st.st_uid}:{st.st_gid}"
    return out


def chmod_tree(folder: Path, remove: int = 0, add: int = 0) -> None:
    for p in [folder, *folder.rglob("*")]:
        p.chmod((stat.S_IMODE(p.stat().st_mode) & ~remove) | add)


@pytest.fixture
def writable_again(tmp_path):
    """Give tmp_path its write bits back at the end, so pytest can delete it."""
    yield
    chmod_tree(tmp_path, add=stat.S_IWUSR)


def base_lrs(ck: Path) -> list[float]:
    return list(open_checkpoint(ck).lr.base_lrs)


# --- writes on folders that are not simply yours ---------------------------------------------------------------


def test_read_only_parent_and_checkpoint_refused_before_any_work(copy_sample, writable_again):
    """`chmod -R a-w p; ckpt set-lr p/z --scale 0.5 --yes` was a PermissionError traceback with exit 1: now exit 2,
    one line naming both places (the checkpoint's folder: chmod; the parent: --backup-dir), and nothing written —
    not even a .ckpt-backups folder."""
    ck = copy(copy_sample)
    parent = ck.parent
    chmod_tree(parent, remove=0o222)
    before = tree(parent)
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", prefix=unprivileged())
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert f"{ck}/global_step4: not writable" in line and "chmod u+w" in line
    assert f"{parent}: cannot hold the backups and journal ({parent}/.ckpt-backups/z)" in line
    assert "--backup-dir" in line and "nothing was written" in line
    assert tree(parent) == before


def test_read_only_parent_backup_dir_moves_journal_staging_and_backups(copy_sample, tmp_path, writable_again):
    """Only the parent is read-only: without --backup-dir exit 2 naming `<parent>/.ckpt-backups` and the option;
    with --backup-dir the write succeeds (it used to fail the same way: staging and journal stayed in the parent),
    the parent gains nothing, the journal and backups are in --backup-dir, and restore finds them there."""
    ck = copy(copy_sample)
    parent = ck.parent
    original = tree(ck)
    parent.chmod(0o555)
    listing = sorted(os.listdir(parent))
    drop = unprivileged()

    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", prefix=drop)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert f"{parent}/.ckpt-backups/z" in line and "pass --backup-dir DIR" in line
    assert tree(ck) == original and sorted(os.listdir(parent)) == listing

    bk = tmp_path / "bk"
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", "--backup-dir", bk, prefix=drop)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert base_lrs(ck) == [0.0015, 0.0015]
    assert sorted(os.listdir(parent)) == listing  # no .ckpt-backups, no staging, no link: nothing in the parent
    (tx,) = [p for p in (bk / "z").iterdir()]
    assert (tx / "journal.json").is_file() and not (tx / "staging").exists()
    # changed in place: the journal's undo records (original bytes of the changed ranges) are the backup
    entries = json.loads((tx / "journal.json").read_text())["files"]
    assert sorted(e["path"] for e in entries if e["mode"] == "in-place") == sorted(
        f"global_step4/{p.name}" for p in (ck / "global_step4").iterdir()
    )
    assert all((tx / e["undo"]).is_file() for e in entries)
    assert f"undo: ckpt restore {ck} --backup-dir {bk}" in proc.stdout

    proc = ckpt("restore", ck, "--yes", prefix=drop)
    assert proc.returncode == 2 and "pass the same --backup-dir" in one_error_line(proc)
    proc = ckpt("restore", ck, "--yes", "--backup-dir", bk, prefix=drop)
    assert proc.returncode == 0, proc.stderr
    assert tree(ck) == original


def test_read_only_checkpoint_folder_refused_before_staging(copy_sample, writable_again):
    """The checkpoint's folders are read-only, the parent writable: it used to rewrite every file into staging,
    then exit 2 with no fix and leave a rolled-back transaction folder. Now exit 2 at once, naming the folder and
    the fix, and no .ckpt-backups folder is even created (staging lives there)."""
    ck = copy(copy_sample)
    chmod_tree(ck, remove=0o222)
    before = tree(ck.parent)
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", prefix=unprivileged())
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert line.startswith(f"ckpt: error: {ck}/global_step4: not writable") and "chmod u+w" in line
    assert tree(ck.parent) == before and not (ck.parent / ".ckpt-backups").exists()


def test_backup_dir_on_another_filesystem_keeps_staging_beside_the_checkpoint(copy_sample, writable_again):
    """An atomic rename needs the new file on the checkpoint's filesystem: a --backup-dir elsewhere holds the
    journal and the backups, staging stays in `<parent>/.ckpt-backups`, and the output says so. When that place is
    not writable either, exit 2 says why staging cannot follow --backup-dir."""
    ck = copy(copy_sample)
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(ck).st_dev:
        pytest.skip("no second filesystem (/dev/shm) to put --backup-dir on")
    bk = shm / f"ckpt-test-{os.getpid()}-{time.time_ns()}"
    try:
        original = tree(ck)
        # whole-file copies (--copy) are staged; changed in place, nothing is
        proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", "--backup-dir", bk, "--copy")
        assert proc.returncode == 0, proc.stderr
        assert f"the new files are staged in {ck.parent}/.ckpt-backups/z, not in --backup-dir {bk}" in proc.stdout
        assert "only a rename within the checkpoint's filesystem is atomic" in proc.stdout
        (tx,) = list((bk / "z").iterdir())
        assert (tx / "journal.json").is_file() and (tx / "files" / "global_step4").is_dir()
        # the default place keeps only the (now removed) staging and a link, so a plain restore finds the write
        assert [p.is_symlink() for p in (ck.parent / ".ckpt-backups" / "z").iterdir()] == [True]
        assert ckpt("restore", ck, "--yes").returncode == 0 and tree(ck) == original

        shutil.rmtree(ck.parent / ".ckpt-backups")
        ck.parent.chmod(0o555)
        proc = ckpt(
            "set-lr", ck, "--scale", "0.5", "--yes", "--backup-dir", bk / "again", "--copy", prefix=unprivileged()
        )
        assert proc.returncode == 2, proc.stderr
        line = one_error_line(proc)
        assert "must be staged on the checkpoint's filesystem to be renamed into place atomically" in line
        assert "pass a --backup-dir on the checkpoint's filesystem" in line and tree(ck) == original
        # in place needs no staging: the same write without --copy goes through, journal on the other filesystem
        proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", "--backup-dir", bk / "again", prefix=unprivileged())
        assert proc.returncode == 0, proc.stderr
        assert base_lrs(ck) == [0.0015, 0.0015]
        assert ckpt("restore", ck, "--yes", "--backup-dir", bk / "again", prefix=unprivileged()).returncode == 0
        assert tree(ck) == original
    finally:
        shutil.rmtree(bk, ignore_errors=True)


def test_owner_group_and_mode_of_rewritten_files_are_kept(copy_sample):
    """A folder of 0444 files came back as 0644 after set-lr. Now each rewritten file keeps its mode, owner and
    group (as root: files of another user and group, as in a shared project folder), and restore keeps them too."""
    ck = copy(copy_sample)
    files = sorted((ck / "global_step4").iterdir())
    modes = [0o444, 0o640, 0o604]
    for f, mode in zip(files, modes):
        if os.geteuid() == 0:
            os.chown(f, 65534 if f.name.startswith("mp_rank") else 0, 65534)
        f.chmod(mode)
    before = tree(ck)
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes")
    assert proc.returncode == 0, proc.stderr
    after = tree(ck)
    assert all(after[k] != before[k] for k in before if k.endswith(".pt"))  # all 3 rewritten
    assert {k: v for k, v in after.items() if k.endswith("@")} == {k: v for k, v in before.items() if k.endswith("@")}
    assert base_lrs(ck) == [0.0015, 0.0015]
    assert ckpt("restore", ck, "--yes").returncode == 0 and tree(ck) == before


def test_an_owner_that_cannot_be_kept_is_refused(copy_sample):
    """Without CAP_CHOWN (an ordinary user, or root with it dropped) a rewrite of another user's file would hand it
    to us: a whole-file rewrite (--copy) is refused before any work, naming the file and who owns it. Changed in
    place (the default) the file keeps its inode, so its owner and group, and the write goes through."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a file of another owner")
    prefix = _drop("chown")
    if prefix is None:
        pytest.skip("neither setpriv nor capsh can drop CAP_CHOWN here")
    ck = copy(copy_sample)
    f = ck / "global_step4" / "mp_rank_00_model_states.pt"
    os.chown(f, 65534, 65534)
    before = tree(ck.parent)
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", "--copy", prefix=prefix)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc)
    assert f"{f}: owned by uid 65534 gid 65534" in line and "could not keep that owner and group" in line
    assert tree(ck.parent) == before
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", prefix=prefix)
    assert proc.returncode == 0, proc.stderr
    assert (f.stat().st_uid, f.stat().st_gid) == (65534, 65534) and base_lrs(ck) == [0.0015, 0.0015]


# --- repeated and interrupted writes --------------------------------------------------------------------------


def test_running_the_same_surgery_twice_says_what_was_done_before(copy_sample):
    """`set-lr --scale 0.5 --yes` twice used to give 0.25x with no word. The second run now names the first (when,
    which command, the LR it set) and still proceeds with --yes; without --yes it asks again, and `n` exits 3."""
    ck = copy(copy_sample)
    first = ckpt("set-lr", ck, "--scale", "0.5", "--yes")
    assert first.returncode == 0 and "already changed" not in first.stdout
    second = ckpt("set-lr", ck, "--scale", "0.5", "--yes")
    assert second.returncode == 0, second.stderr
    m = re.search(
        r"note: this checkpoint was already changed by `set-lr` on (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC "
        r"\(lr_scheduler\.base_lrs \[0\.003, 0\.003\] -> \[0\.0015, 0\.0015\]",
        second.stdout,
    )
    assert m, second.stdout
    assert f"applies on top of it (undo that one with `ckpt restore {ck}`)" in second.stdout
    assert base_lrs(ck) == [0.00075, 0.00075]

    doc = json.loads(ckpt("set-lr", ck, "--scale", "0.5", "--dry-run", "--json").stdout)
    prev = doc["previous_write"]
    assert prev["command"] == "set-lr" and prev["started"] >= m.group(1)
    assert {
        "file": "global_step4/mp_rank_00_model_states.pt",
        "field": "lr_scheduler.base_lrs",
        "old": [0.0015, 0.0015],
        "new": [0.00075, 0.00075],
    } in prev["changes"]

    before = tree(ck)
    proc = ckpt("set-lr", ck, "--scale", "0.5", answer="n\n")
    assert proc.returncode == 3, proc.stderr
    assert "already changed by `set-lr`" in proc.stdout and f"rewrite 3 files in {ck} again? [y/N]" in proc.stdout
    assert "nothing written" in proc.stdout and tree(ck) == before


def test_no_terminal_to_confirm_on_is_exit_2_and_declining_is_exit_3(copy_sample):
    """`ckpt restore X </dev/null` (and set-lr) say that --yes is needed (exit 2); answering no exits 3, not 1
    (1 means "a check found problems")."""
    ck = copy(copy_sample)
    before = tree(ck)
    for argv in (["set-lr", ck, "--scale", "0.5"], ["set-step", ck, "--optimizer-step", "9"]):
        proc = ckpt(*argv)
        assert proc.returncode == 2
        assert one_error_line(proc) == (
            f"ckpt: error: {ck}: no terminal to ask for confirmation on (add --yes to "
            "go ahead without asking; nothing was written)"
        )
    assert tree(ck) == before
    assert ckpt("set-lr", ck, "--scale", "0.5", "--yes").returncode == 0
    after = tree(ck)
    proc = ckpt("restore", ck)
    assert proc.returncode == 2 and "add --yes" in one_error_line(proc)
    proc = ckpt("restore", ck, answer="n\n")
    assert proc.returncode == 3 and "nothing restored" in proc.stdout
    assert tree(ck) == after


def test_interrupted_write_is_reported_by_inspect_and_list_and_undone_only_by_restore(copy_sample):
    """After a kill -9 midway, `inspect` showed the half-applied LR with only an lr-mismatch warning and
    `restore --list` (documented to change nothing) silently rolled it back. Now inspect warns and says what
    `ckpt restore` will do, --list reports it without touching anything, and restore rolls back just that write
    (the finished set-step before it stays)."""
    ck = copy(copy_sample)
    assert ckpt("set-step", ck, "--optimizer-step", "9", "--yes").returncode == 0
    after_step = tree(ck)
    killed = ckpt("set-lr", ck, "--scale", "0.5", "--yes", env={"CKPT_TEST_KILL_AT": "replace:2"})
    assert killed.returncode == -signal.SIGKILL
    half = tree(ck)
    changed = [k for k in half if half[k] != after_step[k]]
    assert changed == ["global_step4/mp_rank_00_model_states.pt"]  # one of three files replaced

    said = io.interrupted_write(ck)
    assert said.startswith("a ckpt write (`set-lr`, started ") and "interrupted after replacing 1 of 3 files" in said
    assert (
        f"`ckpt restore {ck}` (or the next ckpt write) puts back the original of "
        "global_step4/mp_rank_00_model_states.pt" in said
    )
    doc = json.loads(ckpt("inspect", ck, "--json").stdout)
    assert {"code": "interrupted-write", "message": said, "path": str(ck)} in doc["warnings"]
    human = ckpt("inspect", ck, "-q").stdout
    assert "interrupted-write" in human and "values shown may mix old and new" in human
    assert tree(ck) == half

    listed = json.loads(ckpt("restore", ck, "--list", "--json").stdout)
    assert [(w["command"], w["interrupted"], w["next_to_undo"]) for w in listed["writes"]] == [
        ("set-lr", True, True),
        ("set-step", False, False),
    ]
    assert "rolls it back" in ckpt("restore", ck, "--list", env={"COLUMNS": "200"}).stdout
    assert tree(ck) == half  # --list changed nothing

    proc = ckpt("restore", ck, "--yes")
    assert proc.returncode == 0, proc.stderr
    assert "roll back the interrupted write `set-lr`" in proc.stdout and "1 of 3 files" in proc.stdout
    assert tree(ck) == after_step  # the interrupted write is gone, the finished set-step is not
    assert io.interrupted_write(ck) is None
    assert not [
        w for w in json.loads(ckpt("inspect", ck, "--json").stdout)["warnings"] if w["code"] == "interrupted-write"
    ]


@pytest.mark.parametrize(
    "at,put_back",
    [
        ("produce:2:INT", "no file had been replaced yet"),
        ("replace:2:INT", "the 1 file (of 3) it had replaced was put back"),
        ("verify:1:INT", "the 3 files (of 3) it had replaced were put back"),
    ],
)
def test_ctrl_c_during_a_write_rolls_back_and_says_so(copy_sample, at, put_back):
    """Ctrl-C (a real SIGINT, at a chosen step of the write) exited 130 printing nothing. Now: 130, one line saying
    the checkpoint is unchanged, what was put back, and where the abandoned journal is; bytes identical."""
    ck = copy(copy_sample)
    before = tree(ck)
    proc = ckpt("set-lr", ck, "--scale", "0.5", "--yes", env={"CKPT_TEST_KILL_AT": at})
    assert proc.returncode == 130, proc.stderr
    (tx,) = [t for t in io.transactions(ck)]
    assert proc.stderr.splitlines() == [
        f"ckpt: interrupted: {ck} is unchanged: {put_back} (the abandoned write's journal: {tx.dir})"
    ]
    assert tree(ck) == before and tx.status == "rolled-back"


def test_ctrl_c_during_to_universal_removes_the_partial_output_and_says_so(copy_sample, tmp_path):
    ck = copy(copy_sample)
    out = tmp_path / "universal"
    proc = ckpt("to-universal", ck, out, "--workers", "1", env={"CKPT_TEST_KILL_AT": "fsync:3:INT"})
    assert proc.returncode == 130
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf".*ckpt: interrupted: {out} was not created: its partial staging folder "
        rf"{tmp_path}/\.ckpt-staging-universal-\d+ was removed",
        last,
    ), proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".ckpt-staging-*"))


@pytest.mark.slow
def test_ctrl_c_during_resume_says_what_it_left(copy_sample, tmp_path):
    """Ctrl-C while `ckpt resume` trains: exit 130 and one line; the training processes are gone and the temporary
    scratch folder removed, as the line says."""
    ck = copy(copy_sample)
    scratch_root = tmp_path / "tmp"
    scratch_root.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch_root)}
    env.pop("CKPT_DEBUG", None)
    p = subprocess.Popen(
        [*CLI, "resume", str(ck), "--steps", "200"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not list(scratch_root.glob("ckpt-resume-*/worker_plan.json")) and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(3)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.strip().splitlines()[-1] == (
        "ckpt: interrupted: resume stopped: the checkpoint was only read, the training processes were stopped and "
        "the temporary scratch folder removed (a --work-dir keeps its files)"
    )
    assert not list(scratch_root.glob("ckpt-resume-*"))  # torchrun's own torchelastic_* may remain (SIGKILLed)

    def alive() -> list[str]:
        """Processes started with the scratch folder on their command line that are not yet dead (zombies,
        waiting for their parent to reap them, count as gone)."""
        out = []
        for proc in Path("/proc").iterdir():
            try:
                if (
                    str(scratch_root) in (proc / "cmdline").read_bytes().decode(errors="replace")
                    and (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                ):
                    out.append(proc.name)
            except (OSError, IndexError):
                continue
        return out

    # SIGKILLed processes need a moment to be torn down by the kernel on a busy machine
    deadline = time.time() + 20
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    assert alive() == []  # torchrun and its workers (started with --plan <scratch>/worker_plan.json) are gone


# --- progress bars --------------------------------------------------------------------------------------------


def on_a_terminal(*args) -> tuple[int, str]:
    """Run `ckpt ARGS` with stderr on a pseudo-terminal (120 columns), as a person does; returns exit code and
    everything written to that terminal."""
    code, term, _ = run_on_terminal(*args, stream="stderr", columns=120)
    return code, term


@pytest.mark.parametrize(
    "argv,desc", [(["set-lr", "--scale", "0.5"], "set-lr"), (["set-step", "--optimizer-step", "9"], "set-step")]
)
def test_rewrites_and_restore_show_a_progress_bar_on_a_terminal_only(copy_sample, argv, desc):
    """A TB-scale rewrite was minutes of silence. A bar over the bytes written (set-lr, set-step) and restored
    (restore) now runs on stderr when it is a terminal; not with --json, not into a pipe or a log file."""
    ck = copy(copy_sample)
    code, term = on_a_terminal(argv[0], ck, *argv[1:], "--yes")
    assert code == 0
    assert re.search(rf"{desc}:\s+0%\|.*\| 0\.00/\d+k \[", term), term
    code, term = on_a_terminal("restore", ck, "--yes")
    # changed in place, a restore puts back only the journaled ranges: bytes, not kilobytes
    assert code == 0 and re.search(r"restore:\s+0%\|.*\| 0\.00/[\d.]+k? \[", term), term
    code, term = on_a_terminal(argv[0], ck, *argv[1:], "--yes", "--json")
    assert code == 0 and "%|" not in term
    assert (
        ckpt("restore", ck, "--yes").returncode == 0
    )  # so that the request changes something again (a no-op is exit 2)
    proc = ckpt(argv[0], ck, *argv[1:], "--yes")
    assert proc.returncode == 0 and "%|" not in proc.stderr


def test_sync_tp_shows_a_progress_bar_on_a_terminal(copy_sample):
    ck = copy_sample("megatron", "gpt_tp2_pp2_drifted")
    code, term = on_a_terminal("sync-tp", ck, "--yes")
    assert code == 0 and re.search(r"sync-tp:\s+0%\|.*\| 0\.00/", term), term
