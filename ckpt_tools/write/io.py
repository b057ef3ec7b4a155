"""The one way `ckpt` writes into a checkpoint: plan -> (dry run) -> execute -> verify, or nothing.

A checkpoint is someone's month of compute, and training frameworks glob their folders (an
`optimizer.bin.tmp` or a `custom_checkpoint_0.pkl.orig` gets picked up), so every write here follows
the same transaction:

1. `WritePlan`: pure data — which files, which fields, old -> new, bytes to write. `--dry-run` shows it.
2. `execute(plan)`:
   - `check_places` first, before any work: every folder the write touches must be writable (the
     checkpoint folders, where new files are renamed into place, and the transaction folder), and each new
     file must be able to keep its original's owner and group; otherwise one CkptError names each place and
     the option that moves it (`--backup-dir`), and nothing is written;
   - recover: an earlier transaction on this checkpoint that was killed midway is rolled back;
   - a transaction folder OUTSIDE the checkpoint (default `<parent>/.ckpt-backups/<name>/<time>-<cmd>/`,
     a sibling no framework scans; `backup_dir=` moves it — journal, backups and staging — to
     `<backup_dir>/<name>/`, and leaves a link to it in the default place when it can, so a plain
     `ckpt restore` finds it) with a journal (`journal.json`);
   - each file is changed one of two ways:
     * IN PLACE, in O(changed bytes), when the write can say how (`FileWrite.edit`: a torch zip's tensor
       bytes and CRCs, a new data.pkl member and central directory appended — see zip_patch.py) and the file
       allows it (`in_place_refusal`: a regular, writable file with no other hard link, and no `copy=True`).
       The original bytes of every range about to change, and the original length, go to `undo/` in the
       transaction folder (the rollback journal, SQLite's model), fsynced with the folder and recorded in
       journal.json before the first byte of the checkpoint changes; then the ranges are written and the
       file fsynced. The journal is the backup: a finished write keeps it, and `restore` undoes it from it.
     * as a WHOLE NEW FILE otherwise: produced into `staging/` there, fsynced, and given the owner, group and
       mode of the file it replaces — a failure here changes nothing (staging always lies on the
       checkpoint's filesystem: a `backup_dir` on another one keeps only the backups and journal); the
       original is hard-linked (or copied, across filesystems) into `files/` there: the backup; the new file
       is renamed over the original (atomic per file) and the folder fsynced;
   - `plan.verify(root)` re-opens the checkpoint with the reader; any problem rolls everything back;
   - Ctrl-C anywhere rolls everything back too, then raises `Interrupted` saying what was put back, and where.
3. `restore(root)` undoes the last write: a killed one is rolled back, else the last finished one's
   originals go back, byte for byte (in place: after checking the file still holds what the write wrote).
   `interrupted_write(root)` only reports a killed write (for `inspect`).

A kill -9 at any point leaves either the original files, the complete new ones, or — while files are being
changed in place — a mix plus a journal in state "committing"/"verifying" that the next
`execute`/`restore`/`recover` call rolls back byte for byte (truncate to the original length, write the
original ranges back; idempotent, so a kill during the rollback is finished by the next one). No temporary
file ever sits inside a checkpoint folder.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Iterator, NoReturn, Sequence

from ..errors import CkptError
from ..read import gate

# The plan and the checks of where it writes live in sibling modules; callers import them from here
# (`write.io.WritePlan`, `write.io.check_places`, ...), so they are re-exported.
from .io_places import (  # noqa: F401
    Places,
    _can_write,
    _folder_problems,
    _refuse,
    backups_root,
    check_places,
    checkpoint_root,
    in_place_refusal,
)
from .io_plan import ByteEdit, FieldChange, FileWrite, InPlace, WriteFailed, WritePlan  # noqa: F401

JOURNAL = "journal.json"
UNDO = "undo"  # the in-place undo records, in the transaction folder
IN_PLACE = "in-place"


# journal states of a write that never finished ("restoring": a `restore` of it was cut short; finishing the
# undo is what comes next)
ACTIVE = ("preparing", "committing", "verifying", "restoring")


# --- fsync, owner and mode ---------------------------------------------------------------------------
# (every file `io` fsyncs goes through `_fsync_file`: tests count and interrupt writes there)


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


def _keep_owner_and_mode(p: Path, st: os.stat_result) -> None:
    """Give `p` the owner, group and permission bits of `st` (the file it replaces): a checkpoint in a shared
    project folder must stay readable to the group, a read-only (0444) one read-only. chown first: it clears
    set-id bits, which chmod then puts back."""
    now = p.stat()
    uid = st.st_uid if st.st_uid != now.st_uid else -1
    gid = st.st_gid if st.st_gid != now.st_gid else -1
    if uid != -1 or gid != -1:
        os.chown(p, uid, gid)
    os.chmod(p, stat.S_IMODE(st.st_mode))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
        with contextlib.suppress(OSError):  # a copy is ours; a link kept the owner by itself
            _keep_owner_and_mode(dst, src.stat())
        _fsync_file(dst)


# --- the record of past writes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Transaction:
    """A write recorded for a checkpoint: where its journal and the backups of the originals are, its state
    (`done`, `rolled-back`, `restored`, or one of ACTIVE for a write that was killed), when it started
    (UTC, "YYYY-MM-DD HH:MM:SS") and the fields it changed."""

    dir: Path
    status: str
    command: str
    files: tuple[str, ...]
    started: str = ""
    changes: tuple[FieldChange, ...] = field(default=(), repr=False, compare=False)
    nbytes: int = 0  # what a restore puts back: the originals' size (in place: the journaled ranges)
    written: int = 0  # bytes the write put into the checkpoint (in place: the changed ranges only)
    in_place: tuple[str, ...] = ()  # the files changed in place (journaled), not replaced by a new copy


def _when(stamp: str) -> str:
    s = stamp.split("-", 1)[0]  # 20261121T142952
    if len(s) == 15 and s[8] == "T":
        return f"{s[:4]}-{s[4:6]}-{s[6:8]} {s[9:11]}:{s[11:13]}:{s[13:15]}"
    return s


def _journals(path: Path, backup_dir: Path | None = None) -> list[Path]:
    """The journals of this checkpoint's writes, oldest first: in the default place (where writes made with
    --backup-dir leave a link when they can) and in `backup_dir`."""
    ck = checkpoint_root(path)
    seen, out = set(), []
    for broot in dict.fromkeys([backups_root(path), backups_root(path, backup_dir)]):
        if not broot.is_dir():
            continue
        for d in broot.iterdir():
            j = d / JOURNAL
            if not j.is_file() or j.resolve() in seen:
                continue
            try:
                root = Path(json.loads(j.read_text()).get("root", ""))
            except (OSError, ValueError):
                continue
            if root == ck or ck in root.parents:  # a shared --backup-dir holds other checkpoints of this name
                seen.add(j.resolve())
                out.append(j)
    return sorted(out, key=lambda j: j.parent.name)


def _transaction(j: Path, d: dict) -> Transaction:
    changes = tuple(
        FieldChange(f["path"], c["field"], c["old"], c["new"], c.get("note", ""))
        for f in d.get("plan", {}).get("files", [])
        for c in f.get("changes", [])
    )
    files = d.get("files", [])
    return Transaction(
        j.parent,
        d.get("status", "?"),
        d.get("command", "?"),
        tuple(e["path"] for e in files),
        _when(d.get("started", "")),
        changes,
        sum((e.get("undo_bytes") if e.get("mode") == IN_PLACE else e.get("size")) or 0 for e in files),
        sum((e.get("written_bytes") if e.get("mode") == IN_PLACE else e.get("written")) or 0 for e in files),
        tuple(e["path"] for e in files if e.get("mode") == IN_PLACE),
    )


def transactions(path: Path, backup_dir: Path | None = None) -> list[Transaction]:
    """Every transaction recorded for this checkpoint, oldest first."""
    out = []
    for j in _journals(path, backup_dir):
        try:
            out.append(_transaction(j, json.loads(j.read_text())))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def last_write(path: Path, command: str, backup_dir: Path | None = None) -> Transaction | None:
    """The newest finished, not undone, write by `command` ("set-lr") on this checkpoint. Surgery such as
    `set-lr --scale 0.5` compounds when run twice, so the CLI says what was done before and asks again."""
    verb = command.split()[:1] if command else []  # checked before it is read: "" or blanks name no command
    if not verb:
        return None
    done = [
        t
        for t in transactions(path, backup_dir)
        if t.status == "done" and isinstance(t.command, str) and t.command.split()[:1] == verb
    ]
    return done[-1] if done else None


def _replaced(journal: dict) -> list[str]:
    """The files of a killed transaction that were already changed (replaced, created, or changed in place):
    what a rollback puts back."""
    root, files_dir = Path(journal["root"]), Path(journal["backups"])
    tdir = files_dir.parent
    out = []
    for e in journal["files"]:
        target, backup = root / e["path"], files_dir / e["path"]
        if e.get("mode") == IN_PLACE:
            if journal.get("status") != "preparing" and "ranges" in e and _in_place_differs(root, tdir, e):
                out.append(e["path"])
        elif e["existed"]:
            if backup.exists() and not (target.exists() and os.path.samestat(target.stat(), backup.stat())):
                out.append(e["path"])
        elif target.exists():
            out.append(e["path"])
    return out


def replaced_files(t: Transaction) -> list[str]:
    """The files a killed transaction had already replaced: the ones rolling it back puts back."""
    return _replaced(json.loads((t.dir / JOURNAL).read_text()))


def interrupted_write(path: Path, backup_dir: Path | None = None) -> str | None:
    """If a ckpt write on this checkpoint was killed before it finished, one sentence saying so and what
    `ckpt restore` will do about it; else None. Reads only: nothing is rolled back here (`ckpt inspect`
    calls it, and a checkpoint being inspected must not change)."""
    ck = checkpoint_root(path)
    own = _journals(ck, backup_dir)
    # an HF output_dir is planned as a whole: its journals sit beside the output_dir, not beside checkpoint-N
    for j in reversed(own + [j for j in _journals(ck.parent) if j not in own]):
        try:
            journal = json.loads(j.read_text())
        except (OSError, ValueError):
            continue
        root = Path(journal.get("root", ""))
        if journal.get("status") not in ACTIVE:
            continue
        if root in ck.parents and not any(ck in (root / e["path"]).parents for e in journal["files"]):
            continue  # a write on the output_dir that touched another checkpoint-N
        done, n = _replaced(journal), len(journal["files"])
        what = (
            f"a ckpt write (`{journal['command']}`, started {_when(journal.get('started', ''))} UTC) was "
            f"interrupted" + (" while `ckpt restore` was undoing it" if journal["status"] == "restoring" else "")
        )
        if not done:
            return (
                f"{what} before it replaced any file: the checkpoint is unchanged; `ckpt restore {root}` "
                f"(or the next ckpt write) only clears its leftovers in {j.parent}"
            )
        return (
            f"{what} after replacing {len(done)} of {n} files, so the values shown may mix old and new; "
            f"`ckpt restore {root}` (or the next ckpt write) puts back the original{'s' if len(done) > 1 else ''}"
            f" of {', '.join(done[:3])}{' …' if len(done) > 3 else ''} from {j.parent}"
        )
    return None


# --- execute / rollback / restore ------------------------------------------------------------------


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a write, raised once the checkpoint is consistent again: `str(e)` says what was rolled
    back or left, and where. A KeyboardInterrupt, so code that stops on Ctrl-C still stops."""


def command_verb(command: str | None) -> str:
    """A plan's command's first word ("set-lr"), or "write" for a plan without one (None, "" or blanks); a command
    that is no string fails here, before anything changed."""
    words = command.split() if command else []
    return words[0] if words else "write"


def _slug(command: str) -> str:
    """The transaction folder's last word: the command's verb (`command_verb`; letters, digits and dashes). Read
    before any work (`check_places`, `recover`)."""
    return "".join(ch if ch.isalnum() else "-" for ch in command_verb(command))


@dataclass
class _Tx:
    """One write under way: its transaction folder, where its new files are staged, where the originals are
    backed up, its journal (as written to journal.json) and how many files it has replaced so far."""

    dir: Path
    staging: Path
    files_dir: Path
    journal: dict
    replaced: int = 0

    @property
    def entries(self) -> list[dict]:
        return self.journal["files"]


def _new_transaction_dir(places: Places, stamp: str, slug: str) -> tuple[Path, Path, Path]:
    """Make this write's transaction folder (two writes in one second by one process get their own), its
    staging folder and its backup and undo folders. Returns (transaction folder, staging, backups)."""
    places.transactions.mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        tdir = places.transactions / f"{stamp}-{n:04d}-{slug}"
        try:
            tdir.mkdir()
            break
        except FileExistsError:
            continue
    staging = tdir / "staging" if places.staging == places.transactions else places.staging / f"{tdir.name}.staging"
    files_dir = tdir / "files"
    staging.mkdir(parents=True)
    files_dir.mkdir()
    (tdir / UNDO).mkdir()
    return tdir, staging, files_dir


def _journal_entries(plan: WritePlan, root: Path, copy: bool) -> tuple[list[dict], list[os.stat_result | None]]:
    """One journal entry per file of the plan (whether it existed, its size and mtime, in place or replaced,
    and why not in place), with each file's stat before the write (None: a new file)."""
    entries, stats = [], []
    for i, w in enumerate(plan.writes):
        target = root / w.path
        st = target.stat() if target.exists() else None
        stats.append(st)
        why = in_place_refusal(target, w, copy)
        e = {
            "path": w.path,
            "existed": st is not None,
            "size": st.st_size if st else None,
            "mtime_ns": st.st_mtime_ns if st else None,
            "mode": "replace" if why else IN_PLACE,
        }
        if why and w.edit is not None:
            e["why_not_in_place"] = why
        if not why:
            e["undo"] = f"{UNDO}/{i:06d}.bin"
        entries.append(e)
    return entries, stats


def _start(plan: WritePlan, root: Path, places: Places, slug: str, copy: bool) -> tuple[_Tx, list]:
    """Open the transaction: its folders and its journal in state "preparing" (and, with --backup-dir, the link
    to it in the default place). Returns it with each file's stat before the write."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    tdir, staging, files_dir = _new_transaction_dir(places, stamp, slug)
    entries, stats = _journal_entries(plan, root, copy)
    journal = {
        "status": "preparing",
        "root": str(root),
        "command": plan.command,
        "backups": str(files_dir),
        "staging": str(staging),
        "files": entries,
        "started": stamp,
        "plan": plan.to_json(),
    }
    _write_json(tdir / JOURNAL, journal)
    if places.link:
        places.link.mkdir(parents=True, exist_ok=True)
        os.symlink(tdir, places.link / tdir.name)
    return _Tx(tdir, staging, files_dir, journal), stats


def _produce(plan: WritePlan, root: Path, tx: _Tx, stats: list, stage, progress) -> dict[int, InPlace]:
    """Produce every file: its in-place change (computed from the file as it is now), or the whole new file in
    staging, fsynced and given the owner and mode of the file it replaces. Returns the in-place changes."""
    changes: dict[int, InPlace] = {}
    for i, (w, st, e) in enumerate(zip(plan.writes, stats, tx.entries)):
        stage("produce", w.path)
        if e["mode"] == IN_PLACE:
            changes[i] = w.edit(root / w.path)
        else:
            tmp = tx.staging / f"{i:06d}.new"
            w.produce(tmp)
            _fsync_file(tmp)
            if st is not None:
                _keep_owner_and_mode(tmp, st)
        if progress:
            progress(w.nbytes)
    return changes


def _back_up(plan: WritePlan, root: Path, tx: _Tx, changes: dict[int, InPlace], stage) -> None:
    """Back up every existing file (in place: the undo record of the ranges about to change; else a hard link
    or copy of the original), fsync the backups, then mark the journal "committing"."""
    for i, (w, e) in enumerate(zip(plan.writes, tx.entries)):
        if e["existed"]:
            stage("backup", w.path)
            if e["mode"] == IN_PLACE:
                _save_undo(root / w.path, changes[i], tx.dir / e["undo"], e)
            else:
                _link_or_copy(root / w.path, tx.files_dir / w.path)
                e["written"] = None
    _fsync_dir(tx.files_dir)
    _fsync_dir(tx.dir / UNDO)
    tx.journal["status"] = "committing"  # from here on a kill is rolled back from the undo records
    _write_json(tx.dir / JOURNAL, tx.journal)


def _commit(plan: WritePlan, root: Path, tx: _Tx, changes: dict[int, InPlace], stage) -> None:
    """Change every file: write its ranges in place, or rename its new file over it; count what was replaced."""
    for i, (w, e) in enumerate(zip(plan.writes, tx.entries)):
        stage("replace", w.path)
        target = root / w.path
        if e["mode"] == IN_PLACE:
            _apply_in_place(target, changes[i], lambda: stage("write", w.path))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tx.staging / f"{i:06d}.new", target)
            _fsync_dir(target.parent)
            e["written"] = target.stat().st_size
        tx.replaced += 1


def _verify(plan: WritePlan, root: Path, tx: _Tx, stage) -> None:
    """Mark the journal "verifying", pass the written files through the output gate and the plan's own check;
    WriteFailed on any problem."""
    tx.journal["status"] = "verifying"
    _write_json(tx.dir / JOURNAL, tx.journal)
    stage("verify", None)
    gate.check_output(root, [w.path for w in plan.writes], trust_pickles=plan.trust_pickles)
    problems = plan.verify(root) if plan.verify else []
    if problems:
        raise WriteFailed(
            "verification after writing failed: " + "; ".join(problems[:5]),
            path=root,
            hint="nothing was changed: the originals were put back",
        )


def _roll_back_failed(plan: WritePlan, root: Path, tx: _Tx, e: BaseException) -> NoReturn:
    """After any failure or Ctrl-C: put the originals back, then raise what says so (Interrupted on Ctrl-C, the
    CkptError itself, or WriteFailed wrapping anything else)."""
    try:
        _rollback(tx.dir, tx.journal)
    except KeyboardInterrupt:
        raise Interrupted(
            f"interrupted again while putting the originals of {root} back: the next ckpt "
            f"write or `ckpt restore {root}` finishes that (journal: {tx.dir})"
        ) from e
    if isinstance(e, KeyboardInterrupt):
        replaced = tx.replaced
        back = (
            f"the {replaced} file{'s' if replaced > 1 else ''} (of {len(plan.writes)}) it had replaced "
            f"{'were' if replaced > 1 else 'was'} put back"
            if replaced
            else "no file had been replaced yet"
        )
        raise Interrupted(f"{root} is unchanged: {back} (the abandoned write's journal: {tx.dir})") from e
    if isinstance(e, CkptError):
        raise e
    raise WriteFailed(
        f"write failed ({type(e).__name__}: {e})",
        path=root,
        hint="nothing was changed: the originals were put back",
    ) from e


def execute(
    plan: WritePlan,
    *,
    backup_dir: Path | None = None,
    on_stage: Callable[[str, str | None], None] | None = None,
    progress: Callable[[int], None] | None = None,
    copy: bool = False,
) -> Transaction:
    """Carry out `plan` as one transaction (see the module docstring). Raises CkptError naming the place when
    a folder it needs cannot be written (before any work), WriteFailed after putting the checkpoint back as it
    was, Interrupted on Ctrl-C (after putting it back). `on_stage(stage, file)` is called at every step (tests
    inject failures there; "write" after each range written in place); `progress(nbytes)` after each file is
    produced (progress bars). `copy`: every file as a whole new copy, nothing in place (`--copy`)."""
    stage = on_stage or (lambda s, f: None)
    slug = _slug(plan.command)
    root = Path(plan.root).resolve()
    places = check_places(plan, backup_dir, copy=copy)
    recover(root, backup_dir)
    tx, stats = _start(plan, root, places, slug, copy)
    try:
        changes = _produce(plan, root, tx, stats, stage, progress)
        _back_up(plan, root, tx, changes, stage)
        _commit(plan, root, tx, changes, stage)
        _verify(plan, root, tx, stage)
    except BaseException as e:
        _roll_back_failed(plan, root, tx, e)
    tx.journal["status"] = "done"
    _write_json(tx.dir / JOURNAL, tx.journal)
    shutil.rmtree(tx.staging, ignore_errors=True)
    stage("done", None)
    return _transaction(tx.dir / JOURNAL, tx.journal)


# --- in place: the rollback journal ------------------------------------------------------------------
#
# For a file changed in place, the journal entry (journal.json, `files[i]`, "mode": "in-place") holds:
#   size      the file's original length
#   undo      "undo/NNNNNN.bin" in the transaction folder: the original bytes of every range about to change,
#             one after another
#   ranges    [[offset, length, position in the undo file, crc32 of those original bytes], ...]
#   new_size  the length after the write; written: [[offset, length, crc32 of the new bytes], ...]
#   undo_bytes, written_bytes
# The undo file and the folder are fsynced, then journal.json says "committing" (written to a new name,
# fsynced, renamed, folder fsynced) before the first byte of the checkpoint changes. Undo = truncate (or
# extend) the file to `size`, write every range back, fsync: idempotent, so a kill during a rollback is
# finished by the next one. A finished write ("done") keeps its journal: `restore` undoes it the same way,
# after checking that the file still holds what the write wrote.


def _save_undo(target: Path, change: InPlace, undo: Path, e: dict) -> None:
    """Record the original bytes of every range `change` overwrites (and of a tail it cuts) in `undo`, fsynced,
    and describe them in the journal entry `e`."""
    ranges, chunks, pos = [], [], 0
    if any(x.offset < 0 or x.offset + len(x.data) > change.size for x in change.edits):
        raise ValueError(f"an in-place change of {target} writes outside its new length {change.size}")
    with open(target, "rb") as fh:
        fd = fh.fileno()
        orig = os.fstat(fd).st_size
        spans = [(x.offset, min(x.offset + len(x.data), orig)) for x in change.edits if x.offset < orig]
        if change.size < orig:
            spans.append((change.size, orig))
        for a, b in spans:
            old = _pread(fd, b - a, a)
            ranges.append([a, len(old), pos, zlib.crc32(old)])
            chunks.append(old)
            pos += len(old)
    with open(undo, "wb") as out:
        for c in chunks:
            out.write(c)
    _fsync_file(undo)
    e.update(
        size=orig,
        new_size=change.size,
        ranges=ranges,
        undo_bytes=pos,
        written=[[x.offset, len(x.data), zlib.crc32(x.data)] for x in change.edits],
        written_bytes=change.nbytes,
    )


def _pread(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _pwrite(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _apply_in_place(target: Path, change: InPlace, after_each: Callable[[], None] | None = None) -> None:
    fd = os.open(target, os.O_WRONLY)
    try:
        for x in change.edits:
            _pwrite(fd, x.data, x.offset)
            if after_each:
                after_each()
        if os.fstat(fd).st_size != change.size:
            os.ftruncate(fd, change.size)
    finally:
        os.close(fd)
    _fsync_file(target)


def _undo_record(tdir: Path, e: dict) -> list[tuple[int, bytes]]:
    """The original ranges of an in-place entry, checked against their CRCs (a damaged undo file is refused)."""
    undo = (tdir / e["undo"]).read_bytes()
    out = []
    for off, n, pos, crc in e["ranges"]:
        data = undo[pos : pos + n]
        if len(data) != n or zlib.crc32(data) != crc:
            raise WriteFailed(
                f"the undo record of {e['path']} is damaged ({tdir / e['undo']})",
                path=tdir,
                hint="the file cannot be put back from this journal",
            )
        out.append((off, data))
    return out


def _undo_in_place(root: Path, tdir: Path, e: dict, staging: Path) -> None:
    """Put an in-place entry's file back byte for byte: length, then every original range; fsync. A file with
    other hard links (a restore of an older whole-file write links its backup back) is copied first, the copy
    put back and renamed over it, so the other paths keep their bytes."""
    target = root / e["path"]
    ranges = _undo_record(tdir, e)
    st = os.stat(target)
    where = target
    if st.st_nlink > 1:
        staging.mkdir(parents=True, exist_ok=True)
        where = staging / "restore.tmp"
        with contextlib.suppress(FileNotFoundError):
            where.unlink()
        copy_file(target, where)
        _keep_owner_and_mode(where, st)
    fd = os.open(where, os.O_WRONLY)
    try:
        os.ftruncate(fd, e["size"])
        for off, data in ranges:
            _pwrite(fd, data, off)
    finally:
        os.close(fd)
    _fsync_file(where)
    if where != target:
        os.replace(where, target)
        _fsync_dir(target.parent)


def _in_place_differs(root: Path, tdir: Path, e: dict) -> bool:
    """Whether an in-place entry's file differs from its original (what a rollback would put back)."""
    target = root / e["path"]
    try:
        ranges = _undo_record(tdir, e)
        with open(target, "rb") as fh:
            if os.fstat(fh.fileno()).st_size != e["size"]:
                return True
            return any(_pread(fh.fileno(), len(d), off) != d for off, d in ranges)
    except (OSError, CkptError):
        return True


def _changed_since(root: Path, e: dict) -> str | None:
    """For a finished in-place write: why the file no longer holds what the write wrote (None: it does)."""
    target = root / e["path"]
    try:
        with open(target, "rb") as fh:
            fd = fh.fileno()
            size = os.fstat(fd).st_size
            if size != e["new_size"]:
                return f"it is {size} bytes, the write left {e['new_size']}"
            for off, n, crc in e["written"]:
                if zlib.crc32(_pread(fd, n, off)) != crc:
                    return f"its bytes at {off}..{off + n} changed after the write"
    except OSError as ex:
        return f"cannot read it ({ex.strerror})"
    return None


def _rollback(tdir: Path, journal: dict, progress: Callable[[int], None] | None = None) -> None:
    """Put every original back and remove files the transaction created. Whole-file entries: the backup's own
    inode (byte for byte, owner and mode too), linked through the staging folder, which lies on the
    checkpoint's filesystem (the backups may not). In-place entries: truncate and write back the journaled
    ranges — unless the journal never got to "committing" (nothing was written in place then)."""
    root = Path(journal["root"])
    files_dir = Path(journal["backups"])
    staging = Path(journal.get("staging") or tdir / "staging")
    staging.mkdir(parents=True, exist_ok=True)
    written = journal.get("status") != "preparing"
    for e in journal["files"]:
        target = root / e["path"]
        if e.get("mode") == IN_PLACE:
            if written and "ranges" in e and target.exists():
                _undo_in_place(root, tdir, e, staging)
                if progress:
                    progress(e.get("undo_bytes") or 0)
            continue
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
            if progress:
                progress(backup.stat().st_size)
        elif target.exists():
            target.unlink()
            _fsync_dir(target.parent)
    journal["status"] = "restored" if journal.get("status") == "restoring" else "rolled-back"
    _write_json(tdir / JOURNAL, journal)
    shutil.rmtree(staging, ignore_errors=True)
    # The originals are back in place, and a restored or rolled-back write is never undone again: the backup
    # folder's second name for each original inode only keeps the file's link count above 1, which would make
    # every later write rewrite it whole (an in-place change would change the backup too).
    for e in journal["files"]:
        backup = files_dir / e["path"]
        target = root / e["path"]
        if (
            e.get("mode") != IN_PLACE
            and e.get("existed")
            and backup.exists()
            and target.exists()
            and os.path.samestat(target.stat(), backup.stat())
        ):
            backup.unlink()


def recover(path: Path, backup_dir: Path | None = None) -> list[Path]:
    """Roll back transactions on this checkpoint that were interrupted (killed) before they finished.
    Returns their folders. Called by every `execute` and `restore`."""
    rolled = []
    for j in _journals(path, backup_dir):
        try:
            journal = json.loads(j.read_text())
        except (OSError, ValueError):
            continue
        if journal.get("status") in ACTIVE:
            _rollback(j.parent, journal)
            rolled.append(j.parent)
    return rolled


def check_restore(t: Transaction) -> None:
    """Before `restore` touches anything: the folders its originals go back into (files changed in place: the
    files themselves) and its journal's folder must be writable; a finished in-place write's undo record must
    be there and its files must still hold what it wrote (a later change, by training or by hand, would be
    mixed with the undo). CkptError naming each problem otherwise."""
    journal = json.loads((t.dir / JOURNAL).read_text())
    root = Path(journal["root"])
    who = f"uid {os.geteuid()}"
    kw = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    folders = [t.dir.resolve(), Path(journal.get("staging") or t.dir / "staging").parent]
    problems = []
    for e in journal["files"]:
        target = root / e["path"]
        if e.get("mode") != IN_PLACE:
            folders.append(target.parent)
            backup = Path(journal["backups"]) / e["path"]
            if e["existed"] and not backup.exists() and t.status == "done":
                problems.append(
                    (
                        backup,
                        f"the backup of {e['path']} is missing",
                        "it was deleted; nothing can be restored from this write",
                    )
                )
            continue
        if "ranges" not in e or (t.status not in ACTIVE and t.status != "done"):
            continue
        if journal.get("status") == "preparing":
            continue
        if not (t.dir / e["undo"]).is_file():
            problems.append(
                (
                    t.dir / e["undo"],
                    f"the undo record of {e['path']} is missing",
                    "it was deleted; nothing can be restored from this write",
                )
            )
        elif not target.is_file():
            problems.append((target, "the file is gone", "copy it back first; nothing was restored"))
        elif not os.access(target, os.W_OK, **kw) and not _can_write(target.parent)[0]:
            problems.append((target, f"not writable by {who}", "make it writable (chmod u+w)"))
        elif t.status == "done":
            why = _changed_since(root, e)
            if why:
                problems.append(
                    (
                        target,
                        f"changed since `{journal['command']}` wrote it: {why}",
                        "restoring would mix the undo with that later change; nothing was restored",
                    )
                )
    problems = _folder_problems(folders, who) + problems
    if problems:
        _refuse(problems, root)


def restore(
    path: Path,
    transaction: Path | None = None,
    *,
    backup_dir: Path | None = None,
    progress: Callable[[int], None] | None = None,
) -> Transaction:
    """Undo the last write on this checkpoint (or `transaction`): a write that was killed midway is rolled
    back — and that is all, the finished write before it stays; otherwise the last finished write's
    originals go back, byte for byte. Raises Interrupted on Ctrl-C, saying how far it got."""
    history = transactions(path, backup_dir)
    if transaction is not None:
        history = [t for t in history if t.dir.resolve() == Path(transaction).resolve()]
    active = [t for t in history if t.status in ACTIVE]
    done = [t for t in history if t.status == "done"]
    if not active and not done:
        where = backups_root(path, backup_dir)
        raise CkptError(
            "no ckpt write to undo for this checkpoint",
            path=path,
            hint=f"writes are recorded in {where}"
            + ("" if backup_dir else "; for a write made with --backup-dir DIR, pass the same --backup-dir"),
        )
    t = (active or done)[-1]
    check_restore(t)
    journal = json.loads((t.dir / JOURNAL).read_text())
    n = len(_replaced(journal)) if active else len(journal["files"])
    put_back = [0]

    def step(nbytes: int) -> None:
        put_back[0] += 1
        if progress:
            progress(nbytes)

    if not active:
        # from here on a kill leaves a half-undone write: the journal says so, and the next restore or write
        # finishes the undo (idempotent) instead of refusing a file that no longer holds what the write wrote
        journal["status"] = "restoring"
        _write_json(t.dir / JOURNAL, journal)
    try:
        _rollback(t.dir, journal, step)
    except KeyboardInterrupt as e:
        raise Interrupted(
            f"restore stopped after putting back {put_back[0]} of {n} files of `{t.command}` in "
            f"{journal['root']}; run `ckpt restore` again to finish (journal: {t.dir})"
        ) from e
    return _transaction(t.dir / JOURNAL, journal)


# --- copying bytes -----------------------------------------------------------------------------------

_COPY_CHUNK = 64 << 20


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, length: int) -> None:
    """Copy `length` bytes between open files in the kernel where it can (copy_file_range: no user-space
    buffer, reflinks on XFS/btrfs), else in 64 MiB chunks through pread/pwrite. Never the whole file in memory."""
    done = 0
    while done < length:
        n = 0
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(length - done, _COPY_CHUNK << 4), src_off + done, dst_off + done)
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


def put_in_place(
    tmp: Path,
    out: Path,
    *,
    trust_pickles: bool = False,
    synced: Collection[str] = (),
    scanned: Collection[str] = (),
) -> dict[str, int]:
    """The end of `new_folder` for a staging folder built elsewhere (a resumable, many-process conversion):
    the output gate (`read.gate.check_output`), fsync of every file and folder, then one rename to `out`.
    `synced` / `scanned`: files (relative to `tmp`) the process that wrote them already fsynced / passed through
    the gate (a job's ranks, each its own share, `shares.Journal.record`): not done again. Returns how many
    files this call fsynced and scanned ({fsynced_files, scanned_files})."""
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    scan = [f for f in files if f not in scanned] if scanned else files
    gate.check_output(tmp, scan, trust_pickles=trust_pickles)
    n = 0
    for dirpath, _, filenames in os.walk(tmp):
        for f in filenames:
            p = Path(dirpath) / f
            if not synced or str(p.relative_to(tmp)) not in synced:
                _fsync_file(p)
                n += 1
        _fsync_dir(Path(dirpath))
    os.rename(tmp, out)
    _fsync_dir(out.parent)
    return {"fsynced_files": n, "scanned_files": 0 if trust_pickles else len(scan)}


def put_files_in_place(tmp: Path, targets: Sequence[Path], *, trust_pickles: bool = False) -> None:
    """The end of a staging folder whose files go into an existing folder (an export's OUT.safetensors, or its
    shards and index, written by a many-process job): the output gate, fsync, then each target renamed from the
    staged file of its name and the staging folder removed. A failure takes back the files already renamed."""
    gate.check_output(tmp, trust_pickles=trust_pickles)
    for t in targets:
        _fsync_file(tmp / t.name)  # every rank fsynced the bytes it wrote; this is for rank 0's headers
    placed: list[Path] = []
    try:
        for t in targets:
            os.replace(tmp / t.name, t)
            placed.append(t)
    except BaseException:
        for t in placed:
            t.unlink(missing_ok=True)
        raise
    for d in {t.parent for t in targets}:
        _fsync_dir(d)
    shutil.rmtree(tmp)


@contextlib.contextmanager
def new_folder(out: Path, *, trust_pickles: bool = False) -> Iterator[Path]:
    """Build a new folder (e.g. a universal checkpoint) under a staging name beside it, then rename it
    into place in one step. A failure or a kill leaves no half-written `out` a loader could pick up;
    the staging folder's name starts with `.ckpt-staging-` and is removed on failure. Before the rename every
    file is checked for globals outside the allowlist and foreign zip members (`read.gate.check_output`)."""
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
        put_in_place(tmp, out, trust_pickles=trust_pickles)  # gate.check_output, fsync, rename
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
            raise Interrupted(f"{out} was not created: its partial staging folder {tmp} was removed") from e
        raise
