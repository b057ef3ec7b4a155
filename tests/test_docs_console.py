"""Every ```console block of README.md and docs/*.md is run, and what `ckpt` prints now is compared with the block
(issue 44): a changed output fails here until the doc is updated.

A block is a list of `$ ckpt ...` commands, each followed by the output it prints (stdout, then stderr). Each block
runs on a fresh copy of the samples it names (`sample_ckpts/GROUP/NAME`), in a temporary folder that is the
working directory, so `sample_ckpts/...` and relative output paths resolve inside the copy; the commands of one
block share that copy (a write, then its `restore`). Commands run in this process (tests/hostile/runner.py), with
rich's width fixed (COLUMNS=120) and stdout not a terminal (no colour, no wrapping of the tree, no progress bar).

A command ends with `# exit N` when it is meant to exit N (default 0).

Conventions of the expected text:
  * a line that is `...` (after any tree-drawing prefix) stands for one or more lines left out;
  * a line ending in `...` matches any line that starts with the text before it.
Normalised on both sides before comparing, and nothing else: trailing spaces; the temporary folder's path
(printed where a command resolves a path: shown as the relative path); timestamps (`2026-11-28 12:00:00`, `2026-11-28
12:00`,
`20261128T120000-PID-N`, as `<time>`), because a write's journal is named by the clock and the process id, and a
folder listing shows the files' times, which a clone sets; progress-bar
redraws on stderr (a line holding `|` and `it/s` or `%|`).

A block that cannot run here is marked by an HTML comment on the line before it, `<!-- not run: REASON -->`
(a GPU, a Megatron-LM checkout, a network store): the reason is required, and the marked blocks are counted.

`python tests/test_docs_console.py --update` rewrites the blocks without `...` lines with what `ckpt` prints now
(review the diff), and prints the output of the others.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->")


@dataclass
class Command:
    argv: list[str]
    exit: int
    expected: list[str] = field(default_factory=list)


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the ```console fence
    end: int  # 1-based line of the closing fence
    commands: list[Command]
    skip: str | None  # the reason, for a block marked not run

    @property
    def id(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```console":
                i += 1
                continue
            start = i
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            m = NOT_RUN.search(prev)
            out.append(Block(doc, start + 1, j + 1, parse(lines[start + 1 : j]), m.group(1) if m else None))
            i = j + 1
    return out


def parse(body: list[str]) -> list[Command]:
    commands: list[Command] = []
    for ln in body:
        if ln.startswith("$ "):
            text, _, comment = ln[2:].partition(" #")
            m = re.search(r"\bexit (\d+)", comment)
            commands.append(Command(shlex.split(text), int(m.group(1)) if m else 0))
        else:
            assert commands, f"output before any `$ ` command: {ln!r}"
            commands[-1].expected.append(ln)
    return commands


TIME = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?|\d{8}T\d{6}(\.\d+)?Z?(-\d+-\d+)?")
BAR = re.compile(r"%\||it/s|s/it|B/s")


def normalise(text: str, tmp: Path | None = None) -> list[str]:
    if tmp is not None:
        text = text.replace(str(tmp.resolve()) + "/", "").replace(str(tmp) + "/", "")
    text = TIME.sub("<time>", text)
    lines = [ln.rstrip() for ln in re.split(r"\r?\n|\r", text)]
    while lines and not lines[-1]:
        lines.pop()
    while lines and not lines[0]:
        lines.pop(0)
    return lines


def elided(line: str) -> bool:
    return re.sub(r"[│├└─\s]", "", line) == "..."


def matches(expected: list[str], actual: list[str]) -> bool:
    """`expected` (with `...` lines and `...` line ends) against `actual`, both normalised."""
    if not expected:
        return not actual
    head, rest = expected[0], expected[1:]
    if elided(head):
        return any(matches(rest, actual[k:]) for k in range(1, len(actual) + 1)) if rest else len(actual) >= 1
    if not actual:
        return False
    if head.endswith("...") and not elided(head):
        ok = actual[0].startswith(head[:-3].rstrip()) if head[:-3].strip() else True
    else:
        ok = head == actual[0]
    return ok and matches(rest, actual[1:])


def copy_samples(block: Block, tmp: Path) -> None:
    for c in block.commands:
        for a in c.argv:
            m = re.match(r"(sample_ckpts/[^/]+/[^/]+|sample_ckpts/[^/]+$)", a)
            if m and not (tmp / m.group(1)).exists():
                src = ROOT / m.group(1)
                assert src.exists(), f"{block.id}: {m.group(1)} is not a bundled sample"
                (tmp / m.group(1)).parent.mkdir(parents=True, exist_ok=True)
                (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp / m.group(1))


def run_block(block: Block, tmp: Path, monkeypatch) -> list[tuple[Command, int | None, list[str], str | None]]:
    from hostile.runner import run

    copy_samples(block, tmp)
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("NO_COLOR", "1")
    got = []
    for c in block.commands:
        assert c.argv[0] == "ckpt", f"{block.id}: only `ckpt` commands run here, not {c.argv[0]!r}"
        r = run(*c.argv[1:], timeout=900)
        err = [ln for ln in re.split(r"\r?\n|\r", r.stderr) if ln.strip() and not BAR.search(ln)]
        got.append((c, r.code, normalise(r.stdout + "\n" + "\n".join(err), tmp), r.traceback))
    return got


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b.skip is None]


def test_blocks_are_found_and_marked_ones_say_why():
    assert len(RUN) >= 10, [b.id for b in RUN]
    skipped = [b for b in BLOCKS if b.skip is not None]
    for b in skipped:
        assert b.skip.strip(), f"{b.id}: `not run:` needs a reason"
    for b in BLOCKS:
        assert b.commands, f"{b.id}: a console block with no `$ ` command"
    print(f"{len(RUN)} console blocks run, {len(skipped)} not run: " + "; ".join(f"{b.id} ({b.skip})" for b in skipped))


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_console_block_prints_what_the_doc_shows(block, tmp_path, monkeypatch):
    for c, code, actual, tb in run_block(block, tmp_path, monkeypatch):
        cmd = shlex.join(c.argv)
        assert tb is None, f"{block.id}: `{cmd}` raised:\n{tb}"
        assert code == c.exit, f"{block.id}: `{cmd}` exited {code}, the doc says {c.exit}:\n" + "\n".join(actual)
        expected = normalise("\n".join(c.expected))
        assert matches(expected, actual), (
            f"{block.id}: `{cmd}` prints something else now; update the doc "
            f"(python tests/test_docs_console.py --update).\n--- doc\n"
            + "\n".join(expected)
            + "\n--- ckpt\n"
            + "\n".join(actual)
        )


def test_the_matcher():
    assert matches(["a", "...", "d"], ["a", "b", "c", "d"])
    assert not matches(["a", "...", "d"], ["a", "d"])
    assert matches(["│   ├── x...", "└── y"], ["│   ├── x: 1", "└── y"])
    assert not matches(["a"], ["a", "b"]) and not matches(["a", "b"], ["a"])
    assert normalise("journal .ckpt-backups/x/20261128T120102-4242-0000-set-lr at 2026-11-28 12:01:02") == [
        "journal .ckpt-backups/x/<time>-set-lr at <time>"
    ]


def _update() -> None:
    """Rewrite plain blocks with the current output; print the elided ones' output for a person to edit."""
    import tempfile

    class Patch:  # the bits of pytest's monkeypatch run_block uses
        def __init__(self):
            self.cwd, self.env = os.getcwd(), dict(os.environ)

        def chdir(self, p):
            os.chdir(p)

        def setenv(self, k, v):
            os.environ[k] = v

        def undo(self):
            os.chdir(self.cwd)
            os.environ.clear()
            os.environ.update(self.env)

    edits: dict[Path, list[tuple[Block, list[str]]]] = {}
    for b in RUN:
        mp = Patch()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                got = run_block(b, Path(tmp), mp)
            finally:
                mp.undo()
        body = []
        for c, code, actual, tb in got:
            body.append("$ " + shlex.join(c.argv) + (f"     # exit {code}" if code else ""))
            body.extend(actual if tb is None else [tb])
        if any(elided(ln) or ln.rstrip().endswith("...") for c in b.commands for ln in c.expected):
            print(f"== {b.id} (has `...`: edit by hand)\n" + "\n".join(body))
            continue
        edits.setdefault(b.doc, []).append((b, body))
    for doc, items in edits.items():
        lines = doc.read_text().splitlines()
        for b, body in sorted(items, key=lambda x: -x[0].line):
            lines[b.line : b.end - 1] = body
        doc.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    if "--update" in sys.argv:
        _update()
