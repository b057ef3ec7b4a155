"""Where a write (`write.io`) puts things, checked before any work: the checkpoint's root, the folder of its
transactions (journal, backups, staging), whether each file can be changed in place, and whether every folder
the write touches can be written and every new file keep its original's owner and group."""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import CkptError
from .io_plan import FileWrite, WritePlan

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


def backups_root(path: Path, backup_dir: Path | None = None) -> Path:
    """Where the transactions (journal, backups, staging) of this checkpoint live: `<backup_dir>/<name>`, by
    default `<parent>/.ckpt-backups/<name>` — beside the checkpoint, on the same filesystem (so backups are
    hard links and renames are atomic), and never inside a folder a loader reads."""
    root = checkpoint_root(path)
    return (Path(backup_dir).resolve() if backup_dir else root.parent / ".ckpt-backups") / root.name


# --- before any work: can every place the write touches be written? ----------------------------------


@dataclass(frozen=True)
class Places:
    """Where a write puts things, checked by `check_places` before any work.

    `transactions`: one folder per write there, holding its journal and the backups (`files/`).
    `staging`: where the new files are produced; always on the checkpoint's filesystem, because only a rename
    within one filesystem is atomic. `link`: with `backup_dir`, the default place, where a link to each
    transaction is left when it can be, so that a plain `ckpt restore` (and the next write's recovery) finds it."""

    transactions: Path
    staging: Path
    link: Path | None = None
    notes: tuple[str, ...] = ()


def _can_write(d: Path) -> tuple[bool, Path]:
    """Whether folder `d` can be written, or created: the answer for its nearest existing ancestor, asked with
    the effective ids and capabilities (root without CAP_DAC_OVERRIDE is refused like anyone else)."""
    p = Path(d)
    while not p.exists() and p != p.parent:
        p = p.parent
    kw = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    return p.is_dir() and os.access(p, os.W_OK | os.X_OK, **kw), p


def _may_chown() -> bool:
    """Whether this process may give a file to another owner or group (CAP_CHOWN: root, unless dropped)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & 1)  # CAP_CHOWN is capability 0
    return os.geteuid() == 0


def _refuse(problems: list[tuple[Path, str, str]], root: Path) -> None:
    """One CkptError (exit 2) naming every place that cannot be written and what to do about each."""
    if len(problems) == 1:
        where, what, fix = problems[0]
        raise CkptError(what, path=where, hint=f"{fix}; nothing was written")
    raise CkptError(
        "; ".join(f"{where}: {what} ({fix})" for where, what, fix in problems), path=root, hint="nothing was written"
    )


def _folder_problems(folders, who: str) -> list[tuple[Path, str, str]]:
    out = []
    for d in sorted(set(folders)):
        ok, at = _can_write(d)
        if not ok:
            out.append(
                (
                    at,
                    f"not writable by {who}: rewritten files are renamed into place in their own folder",
                    "make it writable (chmod u+w) or run as a user who may write it",
                )
            )
    return out


def in_place_refusal(target: Path, w: FileWrite, copy: bool = False) -> str | None:
    """Why `w` is written as a whole new file renamed over `target` rather than changed in place (None: it is
    changed in place, journaled). In place only when the write can say how (`w.edit`), the caller did not ask
    for copies (`copy`, `--copy`), and the file is a regular file, writable, and has no other hard link (an
    in-place change would change that other path too: copy-on-write then)."""
    if w.edit is None:
        return "this change needs a new file"
    if copy:
        return "full copies asked for (--copy)"
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return "a new file"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_nlink > 1:
        return f"it has {st.st_nlink} hard links: changing it in place would change the other paths too"
    kw = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    if not st.st_mode & 0o222 or not os.access(target, os.W_OK, **kw):
        return f"the file is read-only (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_places(plan: WritePlan, backup_dir: Path | None = None, *, copy: bool = False) -> Places:
    """Check, before any work, that everything the write touches can be written: the checkpoint folders the
    new files are renamed into (files changed in place need no folder write), the transaction folder (journal
    and backups: `backup_dir` moves it), the staging folder (on the checkpoint's filesystem), and that the new
    files can keep the owner and group of the ones they replace. Raises CkptError naming each place and the
    fix; returns where things will go."""
    root = Path(plan.root).resolve()
    euid = os.geteuid()
    who = f"uid {euid}"
    whole = [w for w in plan.writes if in_place_refusal(root / w.path, w, copy) is not None]
    problems = _folder_problems([(root / w.path).parent for w in whole], who)
    groups = set(os.getgroups()) | {os.getegid()}
    may_chown = _may_chown()
    for w in whole:
        try:
            st = (root / w.path).stat()
        except FileNotFoundError:
            continue
        if not may_chown and (st.st_uid != euid or st.st_gid not in groups):
            problems.append(
                (
                    root / w.path,
                    f"owned by uid {st.st_uid} gid {st.st_gid}: a rewrite by {who} could not keep that owner and group",
                    "run as its owner, or as root",
                )
            )
    default = backups_root(root)
    tx = backups_root(root, backup_dir)
    ok, at = _can_write(tx)
    if not ok:
        fix = (
            "choose a writable --backup-dir on the checkpoint's filesystem"
            if backup_dir
            else "pass --backup-dir DIR, a writable folder on the checkpoint's filesystem"
        )
        problems.append((at, f"cannot hold the backups and journal ({tx}): not writable by {who}", fix))
    staging, link, notes = tx, None, []
    if ok and os.stat(at).st_dev != os.stat(root).st_dev:
        staging = default
        ok2, at2 = _can_write(default)
        if not whole:  # everything changes in place: nothing is staged, the journal may live anywhere
            staging = default if ok2 else tx
        elif not ok2:
            problems.append(
                (
                    at2,
                    f"not writable by {who}, and the new files must be staged on the checkpoint's "
                    f"filesystem to be renamed into place atomically (--backup-dir {backup_dir} is on "
                    "another one)",
                    "pass a --backup-dir on the checkpoint's filesystem",
                )
            )
        else:
            notes.append(
                f"the new files are staged in {default}, not in --backup-dir {backup_dir}: it is on "
                "another filesystem, and only a rename within the checkpoint's filesystem is atomic "
                "(the backups there are copies, not hard links)"
            )
    if backup_dir and tx != default and _can_write(default)[0]:
        link = default
    if problems:
        _refuse(problems, root)
    return Places(tx, staging, link, tuple(notes))
