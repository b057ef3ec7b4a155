"""The README's command table against the real commands: every command it lists exists, every option it
names is one that command's `--help` offers, and every command has a row (a new command gets documented)."""
from __future__ import annotations

import re

import pytest

from conftest import ROOT, run_cli


def table_rows() -> list[tuple[list[str], set[str]]]:
    """(command words, options named) for each row of the README's "The commands" table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## The commands", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `ckpt "):
            continue
        cell = re.split(r"(?<!\\)\|", line)[1]
        words = re.match(r"\s*`ckpt ((?:[a-z][a-z-]* ?)+)", cell)[1].split()
        rows.append((words, set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", cell))))
    return rows


ROWS = table_rows()


def test_the_table_has_every_command():
    from ckpt_cli.main import app

    assert len(ROWS) >= 10
    listed = {words[0] for words, _ in ROWS}
    registered = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert registered <= listed, f"commands without a README row: {sorted(registered - listed)}"


@pytest.mark.parametrize("words,options", ROWS, ids=[" ".join(w) for w, _ in ROWS])
def test_each_row_matches_the_command_help(words, options):
    proc = run_cli(*words, "--help")
    assert proc.returncode == 0, f"`ckpt {' '.join(words)}` does not exist: {proc.stderr}"
    offered = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", proc.stdout))
    assert options <= offered, f"`ckpt {' '.join(words)}` has no {sorted(options - offered)}"
