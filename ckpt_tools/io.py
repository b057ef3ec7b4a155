"""The one way `ckpt` writes into a checkpoint: plan -> (dry run) -> execute -> verify, or nothing.

A checkpoint is someone's month of compute, and training frameworks glob their folders (an
`optimizer.bin.tmp` or a `custom_checkpoint_0.pkl.orig` gets picked up), so every write here follows
the same transaction:

1. `WritePlan`: pure data — which files, which fields, old -> new, bytes to write. `--dry-run` shows it.
2. `execute(plan)`:
   - recover first: an earlier transaction on this checkpoint that was killed midway is rolled back;
   - a transaction folder OUTSIDE the checkpoint (default `<parent>/.ckpt-backups/<name>/<time>-<cmd>/`,
     a sibling no framework scans; `backup_dir=` moves the backups elsewhere) with a journal;
   - every new file is produced into `staging/` there and fsynced — a failure here changes nothing;
   - every original is hard-linked (or copied, across filesystems) into `files/` there: the backup;
   - each new file is renamed over its original (atomic per file) and the folder fsynced;
   - `plan.verify(root)` re-opens the checkpoint with the reader; any problem rolls everything back.
3. `restore(root)` puts the originals of the last transaction back, byte for byte.

A kill -9 at any point leaves either the original files or the complete new ones plus a journal
that the next `execute`/`restore`/`recover` call rolls back; no temporary file ever sits inside a
checkpoint folder.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import CkptError
from .tree import jsonable

JOURNAL = "journal.json"


class WriteFailed(CkptError):
    """A write could not be completed; the checkpoint was left (or put back) as it was."""


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldChange:
    """One field of one file: `field` is a dotted path inside the file's saved object."""

    file: str
    field: str
    old: Any
    new: Any
    note: str = ""  # what this field does after resume ("drives the LR", "cosmetic", ...)


@dataclass(frozen=True)
class FileWrite:
    """The new content of one file. `produce(tmp)` writes it to `tmp` (a path outside the checkpoint)."""

    path: str  # relative to the plan's root
    changes: tuple[FieldChange, ...]
    nbytes: int
    produce: Callable[[Path], None] = field(repr=False, compare=False)
    method: str = "rewrite"  # how: "pickle-only rewrite" (tensor bytes copied as they are), "full", ...


@dataclass(frozen=True)
class WritePlan:
    """What a command will write. Pure data until `execute`; `--dry-run` renders it."""

    root: Path  # the checkpoint folder (or file's folder) the paths are relative to
    command: str
    writes: tuple[FileWrite, ...]
    notes: tuple[str, ...] = ()
    verify: Callable[[Path], list[str]] | None = field(default=None, repr=False, compare=False)

    @property
    def changes(self) -> list[FieldChange]:
        return [c for w in self.writes for c in w.changes]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "command": self.command,
            "files": [{"path": w.path, "bytes": w.nbytes, "method": w.method,
                       "changes": [{"field": c.field, "old": jsonable(c.old), "new": jsonable(c.new),
                                    "note": c.note} for c in w.changes]} for w in self.writes],
            "notes": list(self.notes),
        }


# --- where transactions live ----------------------------------------------------------------------


def checkpoint_root(path: Path) -> Path:
    """The outermost checkpoint folder holding `path`: a DeepSpeed tag folder's parent when that
    parent's `latest`/`latest_universal` names it, else the folder itself (a file's folder for a file)."""
    p = Path(path).resolve()
    if p.is_file():
        p = p.parent
    for name in ("latest", "latest_universal"):
        marker = p.parent / name
        try:
            if marker.is_file() and marker.read_text().strip() == p.name:
                return p.parent
        except (OSError, UnicodeDecodeError):
            pass
    return p


def backups_root(path: Path) -> Path:
    """`<parent>/.ckpt-backups/<checkpoint name>`: beside the checkpoint, on the same filesystem (so
    backups are hard links and renames are atomic), and never inside a folder a loader reads."""
    root = checkpoint_root(path)
    return root.parent / ".ckpt-backups" / root.name


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as fh:
        os.fsync(fh.fileno())


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(json.dumps(data, indent=1, default=repr))
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        _fsync_file(dst)


@dataclass(frozen=True)
class Transaction:
    """A finished (or rolled-back) write: where its journal and the backups of the originals are."""

    dir: Path
    status: str
    command: str
    files: tuple[str, ...]


def _journals(path: Path) -> list[Path]:
    broot = backups_root(path)
    if not broot.is_dir():
        return []
    return sorted(broot.glob(f"*/{JOURNAL}"))


# --- execute / rollback / restore ------------------------------------------------------------------


def execute(plan: WritePlan, *, backup_dir: Path | None = None,
            on_stage: Callable[[str, str | None], None] | None = None) -> Transaction:
    """Carry out `plan` as one transaction (see the module docstring). Raises WriteFailed after putting
    the checkpoint back as it was. `on_stage(stage, file)` is called at every step (progress bars;
    tests inject failures there)."""
    stage = on_stage or (lambda s, f: None)
    root = Path(plan.root).resolve()
    recover(root)
    broot = backups_root(root)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    slug = "".join(ch if ch.isalnum() else "-" for ch in plan.command.split()[0] if plan.command) or "write"
    broot.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):  # two writes in one second by one process get their own folders
        tdir = broot / f"{stamp}-{n:04d}-{slug}"
        try:
            tdir.mkdir()
            break
        except FileExistsError:
            continue
    staging = tdir / "staging"
    files_dir = Path(backup_dir).resolve() / tdir.name if backup_dir else tdir / "files"
    staging.mkdir()
    files_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for w in plan.writes:
        target = root / w.path
        st = target.stat() if target.exists() else None
        entries.append({"path": w.path, "existed": st is not None, "size": st.st_size if st else None,
                        "mtime_ns": st.st_mtime_ns if st else None})
    journal = {"status": "preparing", "root": str(root), "command": plan.command, "backups": str(files_dir),
               "files": entries, "started": stamp, "plan": plan.to_json()}
    _write_json(tdir / JOURNAL, journal)
    try:
        for i, w in enumerate(plan.writes):
            stage("produce", w.path)
            tmp = staging / f"{i:06d}.new"
            w.produce(tmp)
            _fsync_file(tmp)
        for w, e in zip(plan.writes, entries):
            if e["existed"]:
                stage("backup", w.path)
                _link_or_copy(root / w.path, files_dir / w.path)
        _fsync_dir(files_dir)
        journal["status"] = "committing"
        _write_json(tdir / JOURNAL, journal)
        for i, w in enumerate(plan.writes):
            stage("replace", w.path)
            target = root / w.path
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staging / f"{i:06d}.new", target)
            _fsync_dir(target.parent)
        journal["status"] = "verifying"
        _write_json(tdir / JOURNAL, journal)
        stage("verify", None)
        problems = plan.verify(root) if plan.verify else []
        if problems:
            raise WriteFailed("verification after writing failed: " + "; ".join(problems[:5]), path=root,
                              hint="nothing was changed: the originals were put back")
    except BaseException as e:
        _rollback(tdir, journal)
        if isinstance(e, (WriteFailed, KeyboardInterrupt)):
            raise
        if isinstance(e, CkptError):
            raise
        raise WriteFailed(f"write failed ({type(e).__name__}: {e})", path=root,
                          hint="nothing was changed: the originals were put back") from e
    journal["status"] = "done"
    _write_json(tdir / JOURNAL, journal)
    shutil.rmtree(staging, ignore_errors=True)
    stage("done", None)
    return Transaction(tdir, "done", plan.command, tuple(w.path for w in plan.writes))


def _rollback(tdir: Path, journal: dict) -> None:
    """Put every original back (byte for byte) and remove files the transaction created."""
    root = Path(journal["root"])
    files_dir = Path(journal["backups"])
    staging = tdir / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    for e in journal["files"]:
        target = root / e["path"]
        backup = files_dir / e["path"]
        if e["existed"]:
            if not backup.exists():
                continue  # never got as far as backing it up, so it was never replaced either
            if target.exists() and os.path.samestat(target.stat(), backup.stat()):
                continue  # still the original inode
            tmp = staging / "restore.tmp"
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            _link_or_copy(backup, tmp)
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        elif target.exists():
            target.unlink()
            _fsync_dir(target.parent)
    journal["status"] = "rolled-back"
    _write_json(tdir / JOURNAL, journal)
    shutil.rmtree(staging, ignore_errors=True)


def recover(path: Path) -> list[Path]:
    """Roll back transactions on this checkpoint that were interrupted (killed) before they finished.
    Returns their folders. Called by every `execute` and `restore`."""
    rolled = []
    for j in _journals(path):
        try:
            journal = json.loads(j.read_text())
        except (OSError, ValueError):
            continue
        if journal.get("status") in ("preparing", "committing", "verifying"):
            _rollback(j.parent, journal)
            rolled.append(j.parent)
    return rolled


def transactions(path: Path) -> list[Transaction]:
    """Every transaction recorded for this checkpoint, oldest first."""
    out = []
    for j in _journals(path):
        try:
            d = json.loads(j.read_text())
        except (OSError, ValueError):
            continue
        out.append(Transaction(j.parent, d.get("status", "?"), d.get("command", "?"),
                               tuple(e["path"] for e in d.get("files", []))))
    return out


def restore(path: Path, transaction: Path | None = None) -> Transaction:
    """Undo the last finished write on this checkpoint (or `transaction`): originals back, byte for byte."""
    recover(path)
    done = [t for t in transactions(path) if t.status == "done"]
    if transaction is not None:
        done = [t for t in done if t.dir.resolve() == Path(transaction).resolve()]
    if not done:
        raise CkptError("no finished ckpt write to undo for this checkpoint", path=path,
                        hint=f"backups live in {backups_root(path)}")
    t = done[-1]
    journal = json.loads((t.dir / JOURNAL).read_text())
    for e in journal["files"]:
        backup = Path(journal["backups"]) / e["path"]
        if e["existed"] and not backup.exists():
            raise CkptError(f"the backup of {e['path']} is missing", path=backup,
                            hint="it was deleted; nothing was restored")
    _rollback(t.dir, journal)
    journal["status"] = "restored"
    _write_json(t.dir / JOURNAL, journal)
    return Transaction(t.dir, "restored", t.command, t.files)


# --- copying bytes -----------------------------------------------------------------------------------

_COPY_CHUNK = 64 << 20


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, length: int) -> None:
    """Copy `length` bytes between open files in the kernel where it can (copy_file_range: no user-space
    buffer, reflinks on XFS/btrfs), else in 64 MiB chunks through pread/pwrite. Never the whole file in memory."""
    import errno

    done = 0
    while done < length:
        n = 0
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(length - done, _COPY_CHUNK << 4),
                                   src_off + done, dst_off + done)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                raise
        if n <= 0:  # unsupported here, or a short copy: move this chunk through user space
            chunk = os.pread(src_fd, min(length - done, _COPY_CHUNK), src_off + done)
            if not chunk:
                raise OSError(errno.EIO, "source file ended early while copying")
            os.pwrite(dst_fd, chunk, dst_off + done)
            n = len(chunk)
        done += n


def copy_file(src: Path, dst: Path) -> None:
    """Copy `src` to a new file `dst` with `copy_range`."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        copy_range(fin.fileno(), fout.fileno(), 0, 0, os.fstat(fin.fileno()).st_size)


# --- a new output folder ----------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """Build a new folder (e.g. a universal checkpoint) under a staging name beside it, then rename it
    into place in one step. A failure or a kill leaves no half-written `out` a loader could pick up;
    the staging folder's name starts with `.ckpt-staging-` and is removed on failure."""
    out = Path(out).resolve()
    if out.exists():
        raise CkptError("output folder already exists", path=out, hint="choose a new path or remove it first")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".ckpt-staging-{out.name}-*"):
        # left by a run that was killed (kill -9 skips the cleanup below); a live run's folder is kept
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".ckpt-staging-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        for dirpath, _, filenames in os.walk(tmp):
            for f in filenames:
                _fsync_file(Path(dirpath) / f)
            _fsync_dir(Path(dirpath))
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
