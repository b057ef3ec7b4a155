"""Rendering shared by every command: JSON for scripts, rich tables/trees for people, one-line errors.

Progress bars go to stderr and are turned off when output is machine-readable (`--json`) or quiet.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import typer.core  # loaded with typer by every command module anyway

from ckpt_tools import formats
from ckpt_tools.errors import CkptError
from ckpt_tools.read.safe_load import import_deepspeed
from ckpt_tools.read.tree import GroupNode, Node, OpaqueNode, TensorNode, ValueNode
from ckpt_tools.train.procgroup import under_torchrun as job_rank


def print_json(doc: Any) -> None:
    # indented for a person at a terminal; compact (C encoder, ~4x faster) for pipes and scripts
    indent = 1 if sys.stdout.isatty() else None
    sys.stdout.write(json.dumps(doc, indent=indent, default=repr) + "\n")


def escape(text: str) -> str:
    """rich's markup escape (`[` in a path or a message is not a style)."""
    from rich.markup import escape as rich_escape  # lazy: rich only where a person reads the output

    return rich_escape(text)


def console(stderr: bool = False):
    from rich.console import Console  # lazy: rich only where a person reads the output (startup of --json runs)

    class _Console(Console):
        def on_broken_pipe(self) -> None:  # rich exits 1 (our "problems found"); ckpt_cli.main ends with 141
            self.quiet = True
            raise BrokenPipeError

    con = _Console(stderr=stderr, highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        # piped into grep/less: long lines stay whole instead of wrapping at 80 columns
        con = _Console(stderr=stderr, highlight=False, width=200)
    return con


def fmt_value(v: Any, full: bool = False) -> str:
    if isinstance(v, float):
        # 10 significant digits: 0.0019200000000000005 reads as 0.00192; --json keeps every bit
        return f"{v:.10g}" if math.isfinite(v) else repr(v)
    if isinstance(v, (list, tuple)):
        shown = v if full else v[:8]
        inner = ", ".join(fmt_value(x) for x in shown)
        more = f", … {len(v) - len(shown)} more" if len(v) > len(shown) else ""
        return f"[{inner}{more}]"
    if v is None:
        return "—"
    if isinstance(v, dict) and len(v) > ARRAY_MIN and not full:
        return _fmt_runs(v) or str(v)
    return str(v)


def _fmt_runs(d: dict) -> str | None:
    """A long mapping of numbered keys onto a few values (a pipeline's layer -> stage) as key ranges:
    `01..49 → 0, 50..99 → 1`. None when the keys are not numbers or the values are many."""
    try:
        keys = [(int(k), k) for k in d]
        by: dict[Any, list[int]] = {}
        for n, k in sorted(keys):
            by.setdefault(d[k], []).append(n)
    except (TypeError, ValueError):
        return None
    if len(by) > ARRAY_MIN:
        return None
    lengths = {len(str(k)) for k in d}
    width = lengths.pop() if len(lengths) == 1 else 0  # zero-padded keys ("01") stay padded
    return ", ".join(_ranges(nums, width, braces=False) + f" → {value}" for value, nums in by.items())


#: a list longer than this is an array (an RNG state's 625 integers): shown as type, length and first values
ARRAY_MIN = 9


def fmt_array(v: list | tuple, full: bool = False) -> str:
    """A long list of plain values the way a tensor reads: `int [625] = [3, 2147483648, … 622 more]`; every
    value with `full` (`ckpt inspect --full`)."""
    kinds = {type(x).__name__ for x in v}
    kind = kinds.pop() if len(kinds) == 1 else "mixed"
    shown = v if full else v[:3]
    more = f", … {len(v) - len(shown)} more" if len(v) > len(shown) else ""
    return f"{style(kind, 'cyan')} [{len(v)}] = [{', '.join(fmt_value(x) for x in shown)}{more}]"


def short_numbers(text: str) -> str:
    """Floats inside a message (a JSON snippet, a note) with at most 10 significant digits, as `fmt_value`
    shows them: 0.00015000000000000001 reads 0.00015. Version strings (0.19.8) and integers stay as they are."""
    return _LONG_FLOAT.sub(lambda m: fmt_value(float(m[0])), text)


_LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{11,}(?:e[-+]?\d+)?(?![\w.])")


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 file`, `3 files`, `1 process`, `2 processes` (pass `many` where `s` is not the plural)."""
    return f"{n:,} {word if n == 1 else (many or word + 's')}"


def fmt_bytes(n: int | None) -> str:
    """A size for people, in powers of 1000 like the sizes frameworks print: 440.4 kB, 2.2 GB."""
    if n is None:
        return "—"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def columns() -> int | None:
    """The width to wrap people's text at: a terminal's ($COLUMNS first, as `shutil` reads it); None when
    stdout is a pipe or a file, so long lines stay whole for grep and scripts. (Not $COLUMNS alone: GNU
    readline exports it into every child of a process that loaded it, pytest's included.)"""
    if not sys.stdout.isatty():
        return None
    return max(20, shutil.get_terminal_size().columns)


def visible_len(text: str) -> int:
    return len(_ANSI_RE.sub("", text))


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")


def wrap(text: str, width: int | None, first: str = "", rest: str | None = None, sep: str | None = None) -> list[str]:
    """`first + text` as lines of at most `width` columns, broken between words only (a path longer than a
    line stays whole), continuation lines starting with `rest` (default: spaces as wide as `first`). With
    `sep` ("  " between the `key=value` items of a header row) lines break at `sep` first, so an item
    (`base_lrs=[0.003, 0.003]`) stays on one line when it fits one."""
    rest = " " * visible_len(first) if rest is None else rest
    if width is None or visible_len(first + text) <= width:
        return [first + text]
    room = max(10, width - max(visible_len(first), visible_len(rest)))
    parts: list[str] = []
    for item in text.split(sep) if sep else [text]:
        if parts and visible_len(parts[-1] + sep + item) <= room:
            parts[-1] += sep + item
        elif visible_len(item) <= room:
            parts.append(item)
        else:
            parts += textwrap.wrap(item, room, break_long_words=False, break_on_hyphens=False) or [""]
    return [first + parts[0]] + [rest + t for t in parts[1:]]


_ANSI = {"cyan": "36", "bold": "1", "dim": "2", "magenta": "35", "yellow": "33", "red": "31", "green": "32"}


def use_color() -> bool:
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


def _leaf_text(n: Node, full: bool = False) -> str:
    if isinstance(n, TensorNode):
        return fmt_tensor(n)
    if isinstance(n.value, (list, tuple)) and len(n.value) >= ARRAY_MIN:
        return fmt_array(n.value, full)
    return style(fmt_value(n.value), "bold")


#: numbered siblings (layers, experts) that read the same are shown as one line from this many on
COLLAPSE_MIN = 3
_NUM = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole dotted component that is a number: "blocks.12.attn"


def collapse_numbered(names: list[str], texts: list[str | None]) -> list[tuple[str, str | None, list[int]]]:
    """Siblings whose names differ only in numbered components (`blocks.0.attn_qkv.weight` ...
    `blocks.1535.attn_qkv.weight`) and whose rendered texts are identical, as one row each:
    (label, text, member indices), the label with each varying number as ranges (`blocks.{0..1535}.…`),
    in first-appearance order. A sibling whose text differs (another shape, dtype or value) stays its own
    row, so an odd layer stands out. Texts of None never collapse. Only when the varying numbers form a
    full grid (every combination present) is a pattern collapsed; otherwise its names stay one per row."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (name, text) in enumerate(zip(names, texts)):
        pattern = _NUM.sub("#", name) if text is not None else name
        if pattern != name:
            groups.setdefault((pattern, text), []).append(i)
    collapsed: dict[int, tuple[str, list[int]]] = {}  # first member -> (label, members)
    hidden: set[int] = set()
    for (pattern, _), members in groups.items():
        label = _numbered_label(pattern, [names[i] for i in members]) if len(members) >= COLLAPSE_MIN else None
        if label is not None:
            collapsed[members[0]] = (label, members)
            hidden.update(members[1:])
    rows: list[tuple[str, str | None, list[int]]] = []
    for i, (name, text) in enumerate(zip(names, texts)):
        if i in collapsed:
            rows.append((collapsed[i][0], text, collapsed[i][1]))
        elif i not in hidden:
            rows.append((name, text, [i]))
    return rows


def _numbered_label(pattern: str, names: list[str]) -> str | None:
    values = [[int(m) for m in _NUM.findall(n)] for n in names]
    per_slot = [sorted(set(col)) for col in zip(*values)]
    if math.prod(len(v) for v in per_slot) != len(names) or len(set(map(tuple, values))) != len(names):
        return None
    parts = iter(_ranges(v) for v in per_slot)
    return _NUM.sub(lambda m: next(parts), pattern.replace("#", "0"))


def _ranges(values: list[int], width: int = 0, braces: bool = True) -> str:
    """Sorted [0, 1, 2, 5, 7, 8, 9] -> "{0..2,5,7..9}" ([0, 1, 3] -> "{0,1,3}"); one value stays bare.
    `width` zero-pads every number (layer "01"); without `braces` the runs are joined bare."""
    if len(values) == 1:
        return f"{values[0]:0{width}d}"
    runs, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            lo, hi = f"{start:0{width}d}", f"{a:0{width}d}"
            runs.append(lo if start == a else f"{lo},{hi}" if a == start + 1 else f"{lo}..{hi}")
            start = b
    return "{" + ",".join(runs) + "}" if braces else ",".join(runs)


def _leaf_key(c: Node):
    """`_line_key` of a leaf (a tensor or a value)."""
    v = c.value
    if isinstance(c, TensorNode):
        # fmt_tensor shows "(N pieces)"
        return (c.dtype, c.shape, tuple(v) if isinstance(v, list) else v, len(c.shards), c.merge, len(c.pieces))
    return ("v", type(v).__name__, repr(v) if isinstance(v, (list, tuple, dict)) else v)


def _line_key(n: Node):
    """What a child's tree line says, as a hashable key (cheaper than the text): two children with equal keys
    render the same line. None for a child that spans several lines (never collapsed)."""
    try:
        if _is_leaf(n):
            return _leaf_key(n)
        kids = n.children
        if kids and len(kids) <= 5 and all(_is_leaf(c) for c in kids.values()):
            return (getattr(n, "cls", None), *[(k, _leaf_key(c)) for k, c in kids.items()])
        return None
    except TypeError:  # an unhashable value: that child keeps its own line
        return None


def tree_lines(node: Node, label: str, extra=None, *, full: bool = False, width: int | None = None) -> list[str]:
    """The tree as text lines (box-drawing like `tree`). Plain string building: a checkpoint with
    thousands of tensors renders in milliseconds, where a rich Tree takes a noticeable fraction of a second.

    Groups whose children are all leaves (an optimizer entry: exp_avg, exp_avg_sq, fp32, step) fit on one
    line when short, so a parameter's whole optimizer state reads at a glance. Numbered siblings that read
    the same (a model's layers, an MoE's experts) are one line, `blocks.{0..1535}.mlp_fc.weight: bfloat16
    [128×32]  ×1536`, unless `full` (torch prints `(0-11): 12 x Block` the same way). Long lists of plain
    values (RNG states) show their type, length and first values unless `full`. With a `width` (a
    terminal's), lines break between words, continued under their own branch."""
    _COLOR[0] = use_color()
    lines = [style(label, "bold")]

    def leaf(n: Node) -> str:
        return _leaf_text(n, full) + (extra(n) if extra else "")

    def one_line(n: Node) -> str | None:
        """What follows a child's name when it fits on one line: a leaf, or a short group of leaves."""
        if _is_leaf(n):
            return ": " + leaf(n)
        kids = n.children
        if kids and len(kids) <= 5 and all(_is_leaf(c) for c in kids.values()):
            cls = " " + style(f"<{n.cls}>", "magenta") if isinstance(n, OpaqueNode) else ""
            return cls + "  " + "  ".join(f"{k}: {leaf(c)}" for k, c in kids.items())
        return None

    def add(prefix: str, last: bool, name: str, n: Node, text: str | None, count: int = 1) -> None:
        branch = "└── " if last else "├── "
        below = prefix + ("    " if last else "│   ")
        times = "  " + style(f"×{count}", "dim") if count > 1 else ""
        if text is not None and _is_leaf(n):
            lines.extend(wrap(f"{name}{text}{times}", width, prefix + branch, below + "    "))
            return
        if text is not None:  # a group's count follows its name, as when it is shown expanded
            one = prefix + branch + str(name) + times + text
            if width is None or visible_len(one) <= width:
                lines.append(one)
                return
        kids = n.children
        head = str(name) + (" " + style(f"<{n.cls}>", "magenta") if isinstance(n, OpaqueNode) else "") + times
        lines.extend(
            wrap(
                head + (" " + style(f"({len(kids)})", "dim") if len(kids) > 5 else ""),
                width,
                prefix + branch,
                below + ("│   " if kids else "    "),
            )
        )
        children(below, n)

    def children(prefix: str, n: Node) -> None:
        items = list(n.children.items())
        if full or extra or len(items) < COLLAPSE_MIN:
            rows = [(str(k), [i]) for i, (k, _) in enumerate(items)]
        else:  # compared by what the line would say, rendered only for the lines shown
            rows = [
                (label, members)
                for label, _, members in collapse_numbered([str(k) for k, _ in items], [_line_key(c) for _, c in items])
            ]
        for r, (name, members) in enumerate(rows):
            child = items[members[0]][1]
            add(prefix, r == len(rows) - 1, name, child, one_line(child), len(members))

    if isinstance(node, (GroupNode, OpaqueNode)):
        children("", node)
    return lines


def print_tree(node: Node, label: str, extra=None, *, full: bool = False) -> None:
    sys.stdout.write("\n".join(tree_lines(node, label, extra, full=full, width=columns())) + "\n")


def print_write_plan(con, plan) -> None:
    """An `io.WritePlan` as the dry-run table every field-level write shows: one heading per file (how it is
    written), then one line per field: `field  old -> new  what the field does`, then the plan's notes.
    On a terminal (or with $COLUMNS) a field line too long for it puts `old -> new  note` on the lines below,
    broken between words."""
    from rich.markup import escape  # lazy: rich only where a person reads the output (startup of --json runs)

    width = columns()

    def say(text, st=None):
        return con.print(
            f"[{st}]{escape(text)}[/]" if st else escape(text),
            soft_wrap=True,
        )

    con.print(
        f"[bold]plan: {escape(plan.command)}[/]  ({plural(len(plan.writes), 'file')} under {escape(str(plan.root))})",
        soft_wrap=True,
    )
    fw = max((len(c.field) for c in plan.changes), default=0)
    for w in plan.writes:
        for i, line in enumerate(wrap(f"{w.path}  {w.method}", width, "  ", "      ")):
            say(line, "cyan" if i == 0 else "dim")
        for c in w.changes:
            change = f"{fmt_value(c.old)} -> {fmt_value(c.new)}"
            note = short_numbers(c.note)
            if width is None or 6 + fw + 2 + len(change) + 2 + len(note) <= width:
                con.print(f"      {escape(c.field):<{fw}}  {escape(change)}  [dim]{escape(note)}[/]", soft_wrap=True)
                continue
            for line in wrap(c.field, width, "      "):
                say(line)
            for line in wrap(f"{change}  {note}", width, "          "):
                say(line)
    for n in plan.notes:
        for line in wrap(short_numbers(n), width, "  ", "    "):
            say(line)


def deepspeed_logs_above_bars():
    """A context in which DeepSpeed's own log lines (its logger writes straight to the terminal: "Setting
    accelerator to CPU", ...) are printed above the progress bars instead of into them. DeepSpeed is
    imported first (its logger exists only then; `safe_load.import_deepspeed` binds it to stderr), so a
    command calls this only where it is about to import DeepSpeed anyway."""
    from tqdm.contrib.logging import logging_redirect_tqdm  # lazy: tqdm's logging bridge only beside DeepSpeed

    import_deepspeed()
    return logging_redirect_tqdm(loggers=[logging.getLogger("DeepSpeed")])


# --- optional dependencies --------------------------------------------------------------------------------

#: the heavy packages some commands need, and the extra of ckpt-tools that installs each (pyproject.toml):
#: the core install (inspect, diff, set-lr/set-step of torch-zip formats) needs neither torch nor deepspeed
EXTRAS = {
    "torch": "convert",
    "deepspeed": "convert",
    "safetensors": "convert",
    "accelerate": "train",
    "transformers": "train",
    "lightning": "train",
    "matplotlib": "all",
}


def need_extra(module: str, extra: str | None = None, what: str = "this command") -> str:
    """The one-line message for a missing optional package: what needs it and the pip line that adds it."""
    return f"{what} needs {module}: pip install 'ckpt-tools[{extra or EXTRAS.get(module, 'all')}]'"


def require(*modules: str, extra: str | None = None, what: str = "this command") -> None:
    """Stop with a one-line error (exit 2) when one of `modules` is not installed, before any work starts.
    Looks the package up without importing it (importing deepspeed alone takes seconds)."""
    for m in modules:
        try:
            missing = importlib.util.find_spec(m) is None
        except (ImportError, ValueError):
            missing = True
        if missing:
            raise CkptError(need_extra(m, extra, what))


# --- help that reads well -----------------------------------------------------------------------------------

_TYPE_METAVAR = {"int": "N", "float": "FLOAT", "str": "TEXT", "path": "PATH", "bool": "BOOL"}


def _metavar(p, ctx) -> str:
    if p.metavar:
        return p.metavar
    if p.param_type_name == "argument":
        return p.name.upper()
    label = p.display_type(ctx).strip("<>")  # typer's "<int>", "<list[str]>", "<float range>"
    label = re.sub(r"^list\[(.*)\]$", r"\1", label).split()[0]
    return _TYPE_METAVAR.get(label, label.upper())


def _first_sentence(text: str) -> str:
    """The help's first sentence: up to a full stop that ends a sentence (not the one in "e.g." or "i.e.")."""
    text = " ".join(text.split())
    for m in re.finditer(r"\.(\s|$)", text):
        if not re.search(r"\b(e\.g|i\.e|etc|vs)$", text[: m.start()]):
            return text[: m.start() + 1]
    return text


#: the formats each command works on: "all" (every format id the registry reads), "training_state" (the formats
#: whose module says where the training state lives), "resume" (the formats a resume planner takes), or ids
WORKS_ON = {
    "inspect": "all",
    "diff": "all",
    "export": "all",
    "convert": "all",
    "restore": "all",
    "set-lr": "training_state",
    "set-step": "training_state",
    "resume": "resume",
    "check-tp-sync": ("deepspeed_pipeline", "megatron_legacy"),
    "sync-tp": ("deepspeed_pipeline", "megatron_legacy"),
    "to-universal": ("deepspeed_zero", "deepspeed_pipeline", "deepspeed_moe", "accelerate", "hf_trainer"),
}
#: said under a command's format list where it takes only part of a format
WORKS_ON_NOTE = {
    "to-universal": "accelerate and hf_trainer with DeepSpeed inside (a checkpoint-N folder)",
    "check-tp-sync": "at TP > 1",
    "sync-tp": "at TP > 1",
    "resume": "torchtune: says which `tune run` resumes it",
}


def works_on(command: str) -> tuple[str, ...]:
    """The format ids `command` works on, from the format registry (ckpt_tools.formats) and the resume planners."""
    kind = WORKS_ON.get(command, ())
    if kind == "all":
        return formats.format_ids()
    if kind == "training_state":
        return formats.editable_format_ids()
    if kind == "resume":
        # lazy: the resume planners import most of ckpt_tools; only this hint needs their table
        from ckpt_tools.resume.frameworks import FRAMEWORK_OF_FORMAT

        ids = set(FRAMEWORK_OF_FORMAT)
        return tuple(f for f in formats.format_ids() if f in ids)
    return tuple(f for f in formats.format_ids() if f in kind)


class Command(typer.core.TyperCommand):
    """The click command class of every `ckpt` command (`ckpt_cli.main` sets it): help in the usual man-page
    style (`ckpt inspect [OPTIONS] PATH`, `--depth N`, not typer's `{path}` / `<int>`), a command list
    that shows each command's whole first sentence, and a missing optional package (torch, deepspeed)
    as a one-line error naming the extra that installs it, instead of an ImportError traceback."""

    def collect_usage_pieces(self, ctx):
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if p.param_type_name == "argument":
                name = _metavar(p, ctx) if p.required else f"[{_metavar(p, ctx)}]"
                pieces.append(name + ("..." if p.nargs != 1 else ""))
        return pieces

    def format_options(self, ctx, formatter):
        args, opts = [], []
        for p in self.get_params(ctx):
            record = p.get_help_record(ctx)
            if record is None:
                continue
            if p.param_type_name == "argument":
                args.append((_metavar(p, ctx), record[1]))
            else:
                names = ", ".join(sorted(p.opts + p.secondary_opts, key=lambda o: (o.startswith("--"), o)))
                opts.append((names if p.is_flag or p.count else f"{names} {_metavar(p, ctx)}", record[1]))
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
        name = ctx.command_path.split(" ", 1)[-1]
        if name in WORKS_ON:
            with formatter.section("Formats"):
                formatter.write_text(
                    ", ".join(works_on(name)) + (f" ({WORKS_ON_NOTE[name]})" if name in WORKS_ON_NOTE else "")
                )

    def get_short_help_str(self, limit: int = 45) -> str:
        text = self.short_help or _first_sentence(self.help or "")
        if len(text) <= limit:
            return text
        return text[: limit - 1].rsplit(" ", 1)[0].rstrip(",;:(") + "…"

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as e:
            root = (e.name or "").partition(".")[0]
            if root not in EXTRAS:
                raise
            raise CkptError(need_extra(root, what=f"ckpt {ctx.info_name}")) from e


TRUST_PICKLES_HELP = (
    "write even though the source's pickles name globals outside ckpt's allowlist (or its zips hold "
    "members torch.save does not write): without it such a source is refused (exit 2, naming "
    "file, place and global), since the framework loading the output would run them; with it "
    "they are carried and the result says so"
)
RESTART_HELP = "throw away what an interrupted many-process run left to resume and start over"
ALLOW_UNREAD_HELP = (
    "go on although the checkpoint folder holds files that may hold model or training state which "
    "no reader took (the `unread-files` warning of `ckpt inspect`): they are left behind, "
    "unchanged and not carried, and the plan lists them"
)


def under_torchrun() -> bool:
    """Whether this process is a rank of a torchrun job (`ckpt_tools.train.procgroup.under_torchrun`)."""
    return job_rank()


#: the folder where each rank of a `--nproc M` job leaves its exit code (`main._exit`)
NPROC_EXIT_DIR = "CKPT_NPROC_EXIT_DIR"


def launch_nproc(nproc: int) -> int:
    """`--nproc M`: this command line, less `--nproc`, as a one-node torchrun job of M processes; returns its exit
    code (the job's rank 0 printed the result): 2 where a rank exited 2 (unusable input or a failed job, as one
    process does), since torchrun exits 1 whatever its processes' codes were; else torchrun's."""
    argv, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            argv.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    with tempfile.TemporaryDirectory(prefix="ckpt-nproc-") as told:
        code = subprocess.call([*cmd, "-m", "ckpt_cli.main", *argv], env={**os.environ, NPROC_EXIT_DIR: told})
        said = {p.read_text() for p in Path(told).glob("rank*")}
    return 2 if code and "2" in said else code  # else torchrun's (a rank killed, say, writes nothing)


def job_lines(resumed: int, converted: int, ranks: tuple | list, unit: str = "parameter") -> list[str]:
    """What a many-process conversion (`to-universal`, `convert`, `export` as a torchrun job) adds to its summary:
    what the journal spared (in `unit`s: the job's pieces), and the spread of the ranks' bytes and seconds."""
    lines = []
    if resumed:
        lines.append(
            f"  resumed: {plural(resumed, unit)} found finished and verified in the journal, "
            f"{converted} converted by this run"
        )
    if len(ranks) > 1:
        b, t = [r["bytes"] for r in ranks], [r["seconds"] for r in ranks]
        lines.append(
            f"  {len(ranks)} ranks on {len({r['host'] for r in ranks})} host(s): {min(b):,}-{max(b):,} bytes and "
            f"{min(t):.1f}-{max(t):.1f} s each (--json: per rank)"
        )
    return lines
