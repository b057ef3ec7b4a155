"""Rendering shared by every command: JSON for scripts, rich tables/trees for people, one-line errors.

Progress bars go to stderr and are turned off when output is machine-readable (`--json`) or quiet.
"""
from __future__ import annotations

import json
import math
import sys
from typing import Any

from ckpt_tools.tree import GroupNode, Node, OpaqueNode, TensorNode, ValueNode


def print_json(doc: Any) -> None:
    # indented for a person at a terminal; compact (C encoder, ~4x faster) for pipes and scripts
    indent = 1 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(doc, indent=indent, default=repr) + "\n")


def console(stderr: bool = False):
    import os

    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich exits 1 (our "problems found"); cli.main ends with 141
            self.quiet = True
            raise BrokenPipeError

    con = _Console(stderr=stderr, highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        # piped into grep/less: long lines stay whole instead of wrapping at 80 columns
        con = _Console(stderr=stderr, highlight=False, width=200)
    return con


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        # 10 significant digits: 0.0019200000000000005 reads as 0.00192; --json keeps every bit
        return f"{v:.10g}" if math.isfinite(v) else repr(v)
    if isinstance(v, (list, tuple)):
        inner = ", ".join(fmt_value(x) for x in v[:8])
        more = f", … {len(v) - 8} more" if len(v) > 8 else ""
        return f"[{inner}{more}]"
    if v is None:
        return "—"
    return str(v)


_ANSI = {"cyan": "36", "bold": "1", "dim": "2", "magenta": "35", "yellow": "33", "red": "31", "green": "32"}


def use_color() -> bool:
    import os

    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def style(text: str, name: str) -> str:
    """`text` in an ANSI style when stdout is a terminal, plain otherwise (pipes, files, tests)."""
    return f"\033[{_ANSI[name]}m{text}\033[0m" if _COLOR[0] else text


_COLOR = [False]


def fmt_tensor(t: TensorNode) -> str:
    shape = "×".join(map(str, t.shape)) if t.shape else "scalar"
    s = f"{style(t.dtype, 'cyan')} [{shape}]"
    if t.value is not None:
        s += " = " + style(fmt_value(t.value), "bold")
    if t.shards:
        s += " " + style(f"({len(t.shards)} TP shards, {t.merge or 'merge unknown'})", "dim")
    elif len(t.pieces) > 1:
        s += " " + style(f"({len(t.pieces)} pieces)", "dim")
    return s


def _is_leaf(n: Node) -> bool:
    return isinstance(n, (TensorNode, ValueNode))


def _leaf_text(n: Node) -> str:
    if isinstance(n, TensorNode):
        return fmt_tensor(n)
    return style(fmt_value(n.value), "bold")


def tree_lines(node: Node, label: str, extra=None) -> list[str]:
    """The tree as text lines (box-drawing like `tree`). Plain string building: a checkpoint with
    thousands of tensors renders in milliseconds, where a rich Tree takes a noticeable fraction of a second.

    Groups whose children are all leaves (an optimizer entry: exp_avg, exp_avg_sq, fp32, step) fit on one
    line when short, so a parameter's whole optimizer state reads at a glance."""
    _COLOR[0] = use_color()
    lines = [style(label, "bold")]

    def leaf(n: Node) -> str:
        return _leaf_text(n) + (extra(n) if extra else "")

    def add(prefix: str, last: bool, name: str, n: Node) -> None:
        branch = "└── " if last else "├── "
        if isinstance(n, (GroupNode, OpaqueNode)):
            kids = n.children
            head = str(name) + (" " + style(f"<{n.cls}>", "magenta") if isinstance(n, OpaqueNode) else "")
            if kids and len(kids) <= 5 and all(_is_leaf(c) for c in kids.values()):
                lines.append(prefix + branch + head + "  " + "  ".join(f"{k}: {leaf(c)}" for k, c in kids.items()))
                return
            lines.append(prefix + branch + head + (" " + style(f"({len(kids)})", "dim") if len(kids) > 5 else ""))
            child_prefix = prefix + ("    " if last else "│   ")
            items = list(kids.items())
            for i, (k, c) in enumerate(items):
                add(child_prefix, i == len(items) - 1, k, c)
        else:
            lines.append(prefix + branch + f"{name}: {leaf(n)}")

    if isinstance(node, (GroupNode, OpaqueNode)):
        items = list(node.children.items())
        for i, (k, c) in enumerate(items):
            add("", i == len(items) - 1, k, c)
    return lines


def print_tree(node: Node, label: str, extra=None) -> None:
    sys.stdout.write("\n".join(tree_lines(node, label, extra)) + "\n")


def print_write_plan(con, plan) -> None:
    """An `io.WritePlan` as the dry-run table every field-level write shows: one heading per file (how it is
    written), then one line per field: `field  old -> new  what the field does`, then the plan's notes."""
    from rich.markup import escape

    con.print(f"[bold]plan: {escape(plan.command)}[/]  ({len(plan.writes)} files under {escape(str(plan.root))})",
              soft_wrap=True)
    width = max((len(c.field) for c in plan.changes), default=0)
    for w in plan.writes:
        con.print(f"  [cyan]{escape(w.path)}[/]  [dim]{escape(w.method)}[/]", soft_wrap=True)
        for c in w.changes:
            change = f"{fmt_value(c.old)} -> {fmt_value(c.new)}"
            con.print(f"      {escape(c.field):<{width}}  {escape(change)}  [dim]{escape(c.note)}[/]", soft_wrap=True)
    for n in plan.notes:
        con.print(f"  {escape(n)}", soft_wrap=True)


def confirm_and_execute(con, plan, *, dry_run: bool, yes: bool, backup_dir, verb: str):
    """The tail every writing command shares: --dry-run stops here; otherwise confirm (unless --yes) and
    carry the plan out through `ckpt_tools.io.execute`. Returns the transaction, or None for a dry run."""
    import typer

    from ckpt_tools import io

    if dry_run:
        con.print("[dim]dry run: nothing written[/]")
        return None
    if not yes and not typer.confirm(f"{verb} {len(plan.writes)} files in {plan.root}?", default=False):
        con.print("nothing written")
        raise typer.Exit(1)
    return io.execute(plan, backup_dir=backup_dir)
