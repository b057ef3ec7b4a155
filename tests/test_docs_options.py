"""The docs against the commands (issue 44): every option of every command is documented and every option the
docs give a command exists; every option has help text; the format ids and warning codes the docs list are the
ones the code has; which writing command takes which option is what docs/writing.md and README say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GLOBAL = {"--storage-options", "--version", "--help"}  # taken anywhere on the command line (cli/main.py, cli/remote.py)
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def commands() -> dict:
    """'inspect', 'samples make', ... -> the click command typer builds."""
    from ckpt_cli.main import app

    out = {}

    def walk(cmd, path):
        if hasattr(cmd, "commands"):  # a group (typer >= 0.29 vendors click: no isinstance on click's classes)
            for name, sub in cmd.commands.items():
                walk(sub, path + [name])
        else:
            out[" ".join(path)] = cmd

    walk(typer.main.get_command(app), [])
    return out


COMMANDS = commands()


def options(name: str) -> set[str]:
    return {o for p in COMMANDS[name].params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} - {"--help"}


def command_of(words: list[str]) -> str | None:
    """The command a `ckpt ...` line names: the longest registered prefix of its words."""
    for n in (2, 1):
        if " ".join(words[:n]) in COMMANDS:
            return " ".join(words[:n])
    return None


def uses() -> list[tuple[str, str, str]]:
    """(where, command, the text after `ckpt`) for every `ckpt COMMAND ...` in an inline code span or a code block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"`(ckpt [^`\n]+)`", text):
            found.append((f"{doc.name}: {m.group(1)}", m.group(1)))
        for m in re.finditer(r"^(?:\$ )?(ckpt [^\n]+)$", text, re.M):
            found.append((f"{doc.name}: {m.group(1)}", m.group(1).split(" #")[0]))
    out = []
    for where, line in found:
        name = command_of(line.split()[1:])
        if name is not None:
            out.append((where, name, line))
    return out


def test_every_option_has_help_text():
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            assert (getattr(p, "help", None) or "").strip(), f"ckpt {name}: {p.name} has no help text"


def test_every_option_a_doc_gives_a_command_exists():
    found = uses()
    assert len(found) > 50
    for where, name, line in found:
        named = set(OPTION.findall(line)) - GLOBAL
        assert named <= options(name), f"{where}: `ckpt {name}` has no {sorted(named - options(name))}"


def sections() -> list[tuple[list[str], str]]:
    """docs/commands.md: (the commands a `## `ckpt ...`` heading names, the section's text)."""
    text = (ROOT / "docs" / "commands.md").read_text()
    out = []
    for part in text.split("\n## ")[1:]:
        heading, _, body = part.partition("\n")
        names = [command_of(m.split()[1:]) for m in re.findall(r"`(ckpt [^`]+)`", heading)]
        assert names and None not in names, heading
        out.append((names, body))
    return out


def test_commands_md_documents_every_option_of_every_command():
    """Each command's section in docs/commands.md names exactly the options its --help offers."""
    seen = set()
    for names, body in sections():
        offered = set().union(*(options(n) for n in names))
        named = set(OPTION.findall(body)) - GLOBAL
        assert offered <= named, f"docs/commands.md, {names}: not documented: {sorted(offered - named)}"
        assert named <= offered, f"docs/commands.md, {names}: no such option: {sorted(named - offered)}"
        seen |= set(names)
    assert seen == set(COMMANDS), f"commands without a section: {sorted(set(COMMANDS) - seen)}"
    everything = " ".join(d.read_text() for d in DOCS)
    for name in COMMANDS:
        for o in options(name):
            assert o in everything


def test_the_json_format_list_is_every_format_id():
    from ckpt_tools.formats import format_ids

    text = (ROOT / "docs" / "formats.md").read_text()
    listed = text.split("`format` is one of:", 1)[1].split("\n\n", 1)[0]
    assert sorted(re.findall(r"`([a-z_0-9]+)`", listed)) == sorted(format_ids())


def warning_codes() -> set[str]:
    """Every warning code the code raises: `Warning_("code", ...)` and the pipeline reader's `self.warn("code",
    ...)`."""
    codes = set()
    for p in (ROOT / "ckpt_tools").rglob("*.py"):
        codes |= set(re.findall(r"(?:\bWarning_|\.warn)\(\s*\"([a-z][a-z0-9-]+)\"", p.read_text()))
    return codes


def test_the_warnings_list_is_every_code_the_code_raises():
    codes = warning_codes()
    assert {"unknown-global", "scheduler-state-missing", "unread-files", "tp-rng-mismatch"} <= codes
    text = (ROOT / "docs" / "formats.md").read_text().split("## Warnings", 1)[1]
    listed = set(re.findall(r"`([a-z][a-z0-9]*(?:-[a-z0-9]+)+)`", text))
    assert codes <= listed, f"docs/formats.md leaves out {sorted(codes - listed)}"
    assert listed <= codes, f"docs/formats.md lists codes nothing raises: {sorted(listed - codes)}"


IN_PLACE = ("set-lr", "set-step", "sync-tp")
NEW_OUTPUT = ("to-universal", "convert", "export")


@pytest.mark.parametrize("name", [*IN_PLACE, "restore", *NEW_OUTPUT])
def test_writing_commands_take_the_options_the_docs_say(name):
    """docs/writing.md's table: every writer takes --dry-run, --yes and --json; those that change a checkpoint in
    place (and restore, which finds their journal) --backup-dir; those that only create OUT have nothing to back up."""
    have = options(name)
    assert {"--dry-run", "--yes", "--json"} <= have
    assert ("--backup-dir" in have) == (name not in NEW_OUTPUT)
    assert ("--copy" in have) == (name in IN_PLACE)
    row = next(
        ln
        for ln in (ROOT / "docs" / "writing.md").read_text().splitlines()
        if ln.startswith("| ") and f"`{name}`" in ln
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = [
        c.strip()
        for c in next(
            ln for ln in (ROOT / "docs" / "writing.md").read_text().splitlines() if ln.startswith("| command")
        )
        .strip("|")
        .split("|")
    ]
    for col, cell in zip(header[2:], cells[2:]):
        option = col.strip("`")
        assert cell.startswith("yes") == (option in have), (name, option, cell)


def test_the_root_help_and_set_lr_help_say_what_they_do():
    from conftest import run_cli

    root = " ".join(run_cli("--help").stdout.split())
    assert "read-only" not in root and "which write their output to a local path" in root
    set_lr = " ".join(run_cli("set-lr", "--help").stdout.split())
    assert "Megatron-LM" in set_lr and "torchtune" in set_lr
