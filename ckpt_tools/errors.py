"""Typed errors. Each carries the file (and key or rank where known) and says how to fix the problem.

The CLI turns any `CkptError` into one line on stderr and exit code 2; a traceback only with
`CKPT_DEBUG=1`.
"""

from __future__ import annotations

import os


class CkptError(Exception):
    """Base class: `path` is the file or folder at fault, `hint` the next thing to try."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None, hint: str | None = None):
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.hint = hint
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = f"{self.path}: " if self.path else ""
        fix = f" ({self.hint})" if self.hint else ""
        return f"{where}{self.message}{fix}"


class NotACheckpoint(CkptError):
    """The path exists but matches no supported checkpoint format."""


class CorruptCheckpoint(CkptError):
    """A file is truncated, not a valid zip/pickle/safetensors file, or disagrees with its metadata."""


class MissingFile(CkptError):
    """A file the checkpoint's own metadata requires (a rank file, the tag named by `latest`) is absent."""


class UnsupportedCheckpoint(CkptError):
    """A recognised format in a variant this version cannot handle."""
