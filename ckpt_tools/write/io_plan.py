"""The plan of a write (`write.io`): pure data — which files, which fields, old -> new, how many bytes, how
each file is produced (whole, or in place). `--dry-run` renders it; `write.io.execute` carries it out."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError
from ..read.tree import jsonable


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
class ByteEdit:
    """`data` written at byte `offset` of a file, in place."""

    offset: int
    data: bytes


@dataclass(frozen=True)
class InPlace:
    """A change made inside an existing file: sorted, non-overlapping `edits`, then the file's length set to
    `size` (longer: the last edit ends there; shorter: the tail is cut)."""

    edits: tuple[ByteEdit, ...]
    size: int

    @property
    def nbytes(self) -> int:
        return sum(len(e.data) for e in self.edits)


@dataclass(frozen=True)
class FileWrite:
    """The new content of one file. `produce(tmp)` writes it whole to `tmp` (a path outside the checkpoint).
    `edit(path)`, when given, says how to make the same change in place instead (`InPlace`, computed from the
    file as it is when the write starts); `execute` uses it unless the file cannot safely be changed in place
    (see `in_place_refusal`) or the caller asks for copies."""

    path: str  # relative to the plan's root
    changes: tuple[FieldChange, ...]
    nbytes: int
    produce: Callable[[Path], None] = field(repr=False, compare=False)
    method: str = "rewrite"  # how: "pickle-only rewrite" (tensor bytes copied as they are), "full", ...
    edit: Callable[[Path], InPlace] | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class WritePlan:
    """What a command will write. Pure data until `execute`; `--dry-run` renders it."""

    root: Path  # the checkpoint folder (or file's folder) the paths are relative to
    command: str
    writes: tuple[FileWrite, ...]
    notes: tuple[str, ...] = ()
    verify: Callable[[Path], list[str]] | None = field(default=None, repr=False, compare=False)
    #: `--trust-pickles`: the files written may carry the source's globals outside the allowlist
    trust_pickles: bool = False

    @property
    def changes(self) -> list[FieldChange]:
        return [c for w in self.writes for c in w.changes]

    def to_json(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "command": self.command,
            "files": [
                {
                    "path": w.path,
                    "bytes": w.nbytes,
                    "method": w.method,
                    "changes": [
                        {"field": c.field, "old": jsonable(c.old), "new": jsonable(c.new), "note": c.note}
                        for c in w.changes
                    ],
                }
                for w in self.writes
            ],
            "notes": list(self.notes),
        }
