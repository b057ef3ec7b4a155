"""Run `ckpt` commands in this process (fast: no interpreter start, no torch import per call) with a
time limit, and snapshot folders to prove a command wrote nothing."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path


class Hang(Exception):
    """Raised inside the command by the alarm: it ran past its time limit."""


@dataclass
class Result:
    code: int | None  # exit code; None when the command raised (traceback) or hung
    stdout: str
    stderr: str
    traceback: str | None = None
    hung: bool = False

    def error_lines(self) -> list[str]:
        """stderr lines, without progress-bar redraws (tqdm writes to stderr when it is not a tty)."""
        lines = [ln.strip() for ln in re.split(r"[\r\n]+", self.stderr)]
        return [ln for ln in lines if ln and not re.match(r"^(reading tensors|to-universal|export)\b.*\|", ln)]


def _on_alarm(signum, frame):
    raise Hang()


def run(*argv, timeout: float = 30.0) -> Result:
    """`ckpt ARGV...` in-process: exit code, stdout, stderr; a traceback or hang is recorded, not raised."""
    from ckpt_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    env_debug = os.environ.pop("CKPT_DEBUG", None)
    code, tb, hung = None, None, False
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main([str(a) for a in argv])
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Hang:
        hung = True
    except BaseException:  # what a user would see as a traceback
        tb = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if env_debug is not None:
            os.environ["CKPT_DEBUG"] = env_debug
    return Result(code, out.getvalue(), err.getvalue(), tb, hung)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and link under `folder` (hidden ones included) -> content hash; folders listed too."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for d in dirnames:
            snap[os.path.relpath(os.path.join(dirpath, d), folder) + "/"] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, folder)
            if os.path.islink(p):
                snap[rel] = "link:" + os.readlink(p)
            else:
                with open(p, "rb") as fh:
                    snap[rel] = hashlib.sha256(fh.read()).hexdigest()
    return snap


def diff_snapshots(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted({k for k in before.keys() | after.keys() if before.get(k) != after.get(k)})
