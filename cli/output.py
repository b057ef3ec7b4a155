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
    sys.stdout.write(json.dumps(doc, indent=1, default=repr) + "\n")


def console(stderr: bool = False):
    import os

    from rich.console import Console

    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        # piped into grep/less: long lines stay whole instead of wrapping at 80 columns
        con = Console(stderr=stderr, highlight=False, width=200)
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


def fmt_tensor(t: TensorNode) -> str:
    shape = "×".join(map(str, t.shape)) if t.shape else "scalar"
    s = f"[cyan]{t.dtype}[/] [{shape}]"
    if t.value is not None:
        s += f" = [bold]{fmt_value(t.value)}[/]"
    if t.shards:
        s += f" [dim]({len(t.shards)} TP shards, {t.merge or 'merge unknown'})[/]"
    elif len(t.pieces) > 1:
        s += f" [dim]({len(t.pieces)} pieces)[/]"
    return s


def _is_leaf(n: Node) -> bool:
    return isinstance(n, (TensorNode, ValueNode))


def _leaf_text(n: Node) -> str:
    if isinstance(n, TensorNode):
        return fmt_tensor(n)
    from rich.markup import escape

    return f"[bold]{escape(fmt_value(n.value))}[/]"


def render_tree(node: Node, label: str, extra=None):
    """A rich Tree. Groups whose children are all leaves (an optimizer entry: exp_avg, exp_avg_sq, fp32,
    step) fit on one line when short, so a parameter's whole optimizer state reads at a glance."""
    from rich.markup import escape
    from rich.tree import Tree

    root = Tree(f"[bold]{escape(label)}[/]")

    def add(parent, name: str, n: Node):
        if isinstance(n, (GroupNode, OpaqueNode)):
            kids = n.children
            head = escape(str(name)) + (f" [magenta]<{escape(n.cls)}>[/]" if isinstance(n, OpaqueNode) else "")
            if kids and len(kids) <= 5 and all(_is_leaf(c) for c in kids.values()):
                parts = "  ".join(f"{escape(str(k))}: {_leaf_text(c)}{extra(c) if extra else ''}"
                                  for k, c in kids.items())
                parent.add(f"{head}  {parts}")
                return
            branch = parent.add(head + (f" [dim]({len(kids)})[/]" if len(kids) > 5 else ""))
            for k, c in kids.items():
                add(branch, k, c)
        else:
            line = f"{escape(str(name))}: {_leaf_text(n)}"
            if extra:
                line += extra(n)
            parent.add(line)

    if isinstance(node, (GroupNode, OpaqueNode)):
        for k, c in node.children.items():
            add(root, k, c)
    return root
