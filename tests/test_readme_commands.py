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


def test_the_formats_table_is_what_each_commands_help_lists():
    """README's "Formats" table: one row per format id the registry reads, and each command column's "yes" rows are
    the formats that command's `--help` lists (both generated from ckpt_tools.formats: cli.output.works_on)."""
    from ckpt_cli.output import works_on
    from ckpt_tools.formats import format_ids

    section = (ROOT / "README.md").read_text().split("## Formats", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines() if ln.startswith("| ")]
    header, body = rows[0], rows[1:]
    ids = [re.fullmatch(r"`([a-z_0-9]+)`", r[0])[1] for r in body]
    assert sorted(ids) == sorted(format_ids())
    columns = {i: re.findall(r"`([a-z-]+)`", h) for i, h in enumerate(header) if i > 1}
    assert {c for cs in columns.values() for c in cs} == {
        "set-lr",
        "set-step",
        "to-universal",
        "check-tp-sync",
        "sync-tp",
        "resume",
    }
    for i, commands in columns.items():
        yes = {f for f, r in zip(ids, body) if r[i] == "yes"}
        for command in commands:
            assert yes == set(works_on(command)), (command, sorted(yes ^ set(works_on(command))))
            assert ", ".join(works_on(command)) in " ".join(run_cli(command, "--help").stdout.split())
    for command in ("inspect", "diff", "export", "convert"):  # "read every format below"
        assert set(works_on(command)) == set(format_ids())
