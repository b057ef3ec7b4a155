"""Bad input never gives a traceback, never hangs, never writes: >= 100 broken checkpoints, every command.

Commands run in-process (`ckpt_cli.main.main`, SIGALRM time limit) for speed; a sample goes through real
`ckpt` processes with a subprocess timeout. Exit 2 must come with exactly one stderr line naming the
damaged file (or folder); exit 0/1 only where the case says why (see `hostile/bad_inputs.py`).
"""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import SAMPLES, run_cli
from hostile import bad_inputs as B
from hostile.runner import diff_snapshots, run, snapshot

TIMEOUT = 30.0


def _commands() -> set[str]:
    from ckpt_cli.main import app

    return {c.name for c in app.registered_commands}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    return root, B.build(SAMPLES, root / "cases")


def _argvs(c: B.Case, out_dir) -> list[list]:
    have = _commands()
    argvs = [["inspect", c.path], ["inspect", "--stats", c.path]]
    if c.kind == "pipe":
        argvs.append(["check-tp-sync", c.path])
    argvs.append(["to-universal", c.path, out_dir / "universal-out", "--dry-run"])
    if "diff" in have:
        # against the clean sample it was made from (diff of a path with itself may short-cut)
        argvs.append(["diff", next(SAMPLES.glob(f"*/{c.path.name}"), c.path), c.path])
    if "set-lr" in have:
        argvs.append(["set-lr", c.path, "--lr", "1e-4", "--dry-run"])
    return argvs


def _judge(c: B.Case, argv: list, r) -> list[str]:
    cmd = argv[0] + (" --stats" if "--stats" in argv else "")
    if r.hung:
        return [f"{c.name}: {cmd}: HUNG (> {TIMEOUT}s)"]
    if r.traceback:
        return [f"{c.name}: {cmd}: TRACEBACK\n{r.traceback[-1500:]}"]
    allowed = c.allowed(argv[0])
    if argv[0] == "to-universal" and c.kind not in ("ds", "pipe"):
        allowed = {2}  # not a DeepSpeed checkpoint at all: refused
    if argv[0] == "diff":
        # diff compares an unreadable file byte-level and reports it as a difference (exit 1), naming it
        allowed = allowed | {1}
    if argv[0] == "set-lr" and 0 in allowed:
        allowed = allowed | {2}  # harmless damage, but set-lr may not edit this format at all: refused
    out = []
    if r.code not in allowed:
        out.append(f"{c.name}: {cmd}: exit {r.code}, want {sorted(allowed)} {r.error_lines()[-2:]}")
    lines = r.error_lines()
    if r.code == 2:
        if len(lines) != 1 or not lines[0].startswith("ckpt: error: "):
            out.append(f"{c.name}: {cmd}: want one 'ckpt: error:' line, got {lines}")
        elif argv[0] in ("inspect", "check-tp-sync") and not any(n in lines[0] for n in c.names):
            out.append(f"{c.name}: {cmd}: the error does not name any of {c.names}: {lines[0]}")
    if argv[0] == "diff" and r.code == 1 and not any(n in r.stdout for n in c.names):
        out.append(f"{c.name}: diff: exit 1 without naming any of {c.names}")
    if r.code == 0 and c.warning and argv[0] == "inspect" and c.warning not in r.stdout:
        out.append(f"{c.name}: {cmd}: exit 0 without the {c.warning} warning")
    return out


def test_corpus_every_command(corpus, tmp_path):
    root, cases = corpus
    assert len(cases) >= 100
    problems: list[str] = []
    stats: Counter = Counter()
    for c in cases:
        snap_dir = c.path.parent if c.path.parent != root / "cases" else c.path
        pre = snapshot(snap_dir) if snap_dir.exists() else {}
        for argv in _argvs(c, tmp_path):
            r = run(*argv, timeout=TIMEOUT)
            stats["runs"] += 1
            stats["tracebacks"] += bool(r.traceback)
            stats["hangs"] += r.hung
            stats[f"exit{r.code}"] += 1
            problems += _judge(c, argv, r)
        post = snapshot(snap_dir) if snap_dir.exists() else {}
        if pre != post:
            problems.append(f"{c.name}: WROTE {diff_snapshots(pre, post)[:5]}")
        if (tmp_path / "universal-out").exists():
            problems.append(f"{c.name}: to-universal --dry-run created its output folder")
    print(
        f"\nbad inputs: {len(cases)} checkpoints, {stats['runs']} command runs, {stats['tracebacks']} tracebacks, "
        f"{stats['hangs']} hangs, exit codes {dict((k, v) for k, v in stats.items() if k.startswith('exit'))}"
    )
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:40])
    assert stats["tracebacks"] == 0 and stats["hangs"] == 0


@pytest.mark.parametrize(
    "case_name",
    [
        "trunc0",
        "zero-zero2_bf16-mp_rank_00",
        "st-offsets-past-end",
        "latest-missing-tag",
        "dcp-no-metadata",
        "unrelated-files",
        "megatron-missing-layer",
        "symlink-loop",
    ],
)
def test_subprocess_sample(corpus, case_name):
    """The same invariants through a real `ckpt` process, bounded by a subprocess timeout."""
    root, cases = corpus
    c = next(c for c in cases if c.name.startswith(case_name))
    pre = snapshot(c.path.parent)
    r = run_cli("inspect", c.path, timeout=120)
    assert "Traceback" not in r.stderr
    assert r.returncode in c.codes
    if r.returncode == 2:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("ckpt: error: "), lines
        assert any(n in lines[0] for n in c.names), (c.names, lines[0])
    assert snapshot(c.path.parent) == pre


def test_debug_variable_shows_the_traceback(corpus):
    """CKPT_DEBUG=1 is the documented way to get the traceback back (so the one-liner hides nothing)."""
    root, cases = corpus
    c = next(c for c in cases if c.name == "latest-missing-tag")
    import os
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run(
        [sys.executable, "-c", "from ckpt_cli.main import main; main()", "inspect", str(c.path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "CKPT_DEBUG": "1"},
    )
    assert r.returncode != 0 and "Traceback" in r.stderr and "MissingFile" in r.stderr
