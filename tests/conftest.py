"""Shared fixtures: the committed sample checkpoints and their manifests (what the real run did)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_ckpts"


def sample(group: str, name: str) -> Path:
    """Path of a committed sample checkpoint (skips nothing: a missing sample is a failure)."""
    p = SAMPLES / group / name
    assert p.exists(), f"sample {p} is missing; regenerate with `ckpt samples make sample_ckpts --only {name}`"
    return p


def manifest(group: str, name: str) -> dict:
    return json.loads((SAMPLES / group / f"{name}.manifest.json").read_text())


@pytest.fixture
def copy_sample(tmp_path):
    """Copy a sample into tmp_path (for tests that write or break files); returns the copied path."""
    import shutil

    def _copy(group: str, name: str) -> Path:
        src = sample(group, name)
        dst = tmp_path / group / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
        return dst

    return _copy


def run_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `ckpt ARGS...` the way a user does (a fresh process), capturing output; never raises on exit codes."""
    return subprocess.run([sys.executable, "-c", "from cli.main import main; main()", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def fail_at(stage: str, nth: int = 1):
    """An `io.execute` on_stage callback that raises at the `nth` (1-based) time it reaches `stage`."""
    seen = []

    def on_stage(s, f):
        if s == stage:
            seen.append(f)
            if len(seen) == nth:
                raise RuntimeError(f"injected failure at {s} {f}")

    return on_stage
