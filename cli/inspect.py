"""`ckpt inspect PATH`: what is inside a checkpoint, instantly, without loading tensor bytes."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Optional

import typer

from ckpt_tools.read import remote
from ckpt_tools.errors import CkptError, NotACheckpoint
from ckpt_tools.ops import inspect as ops

from . import output


def parse_rank(spec: str | None) -> dict[str, int] | None:
    """`1` -> {"dp": 1}; `tp=1` -> {"tp": 1}; `dp=0,tp=1` -> both."""
    if spec is None:
        return None
    if spec.isdigit():
        return {"dp": int(spec)}
    out = {}
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(dp|tp|pp)\s*=\s*(\d+)\s*", part)
        if not m:
            raise typer.BadParameter(f"{spec!r}: use N (a DP rank) or dp=N,tp=N,pp=N", param_hint="--rank")
        out[m[1]] = int(m[2])
    return out


def inspect_cmd(
    path: str = typer.Argument(
        ...,
        metavar="PATH",
        help="checkpoint file or folder (a tag folder or its parent "
        "with `latest`); a folder of checkpoints lists them; or a URL (s3://, gs://, "
        "file://, any fsspec URL; --storage-options JSON for the client)",
    ),
    grep: Optional[str] = typer.Option(
        None, "--grep", "-g", metavar="REGEX", help="only tree entries whose path matches this regex"
    ),
    depth: Optional[int] = typer.Option(None, "--depth", "-d", metavar="N", help="cut the tree at this many levels"),
    rank: Optional[str] = typer.Option(
        None, "--rank", metavar="RANK", help="only pieces on this rank: N (dp) or dp=N,tp=N,pp=N"
    ),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output (see ckpt_tools.ops.inspect)"),
    stats: bool = typer.Option(False, "--stats", help="read tensor data: min/max/mean/std, NaN/Inf (slow)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="header only, no tree"),
    full: bool = typer.Option(
        False,
        "--full",
        help="every numbered layer on its own line and every value of "
        "long lists (default: layers that read the same as one line, `blocks.{0..47}.…  ×48`; "
        "lists as type, length and first values)",
    ),
) -> None:
    """Show format, topology, counters, learning rates, parameter count, warnings and the state tree.

    Exit 2 when PATH is not one checkpoint; for a folder of checkpoints (a run's save folder) the error comes
    after a listing of them (format, step, size, newest first), so the next command is one copy away."""
    if depth is not None and depth < 0:
        raise CkptError(f"--depth {depth}: give 0 or more levels (0 shows only the header and the tree's size)")
    try:
        ck = ops.open_for_inspect(path)
    except NotACheckpoint:
        if Path(path).is_dir():
            _list_checkpoints(path, json_out)
        raise
    rank_d = parse_rank(rank)
    _check_rank(ck, rank, rank_d)
    try:
        tree = ops.filter_tree(ck.tree, grep=grep, depth=depth, rank=rank_d)
    except re.error as e:
        raise typer.BadParameter(f"{grep!r} is not a valid regex ({e})", param_hint="--grep")
    stat_rows = []
    if stats:
        from tqdm import tqdm

        total = sum(1 for _ in ops.iter_tensors(ck.tree))
        stat_rows = list(
            tqdm(
                ops.tensor_stats(ck, grep),
                total=total,
                desc="reading tensors",
                unit="tensor",
                disable=json_out or quiet,
                leave=False,
            )
        )
    warnings = list(ck.warnings) + ops.stats_warnings(stat_rows)
    if json_out:
        doc = ops.summary(ck, tree if tree is not None else ops.GroupNode(), rank_d)
        doc["warnings"] = [w.__dict__ for w in warnings]
        if stats:
            doc["stats"] = [s.__dict__ for s in stat_rows]
        if remote.stats() is not None:  # a URL: what reading it cost
            doc["remote"] = remote.stats()
        output.print_json(doc)
        return
    _print_header(ck, warnings)
    if stats:
        _print_stats(stat_rows)
    elif not quiet and tree is not None:
        extra = None
        if rank_d:

            def extra(n):
                ps = ops.rank_pieces(n, rank_d) if isinstance(n, ops.TensorNode) else []
                return "".join(
                    "  " + output.style(f"{p.file}[{p.src_offset}:{p.src_offset + p.numel}]", "dim") for p in ps
                )

        output.print_tree(tree, "tree", extra, full=full)


def _check_rank(ck, spec: str | None, rank: dict[str, int] | None) -> None:
    """A --rank outside the checkpoint's topology is a typo, not an empty answer."""
    for dim, r in (rank or {}).items():
        size = getattr(ck.topology, dim)
        if size is not None and r >= size:
            raise CkptError(
                f"--rank {spec}: this checkpoint has {dim}={size} ({dim} ranks 0 to {size - 1})",
                path=ck.path,
                hint=f"pass --rank {dim}=N with N below {size}",
            )


def _list_checkpoints(path: str, json_out: bool) -> None:
    """What a folder that is not one checkpoint holds (the error line follows on stderr, exit 2): a run's
    save folder, `sample_ckpts/deepspeed`. Nothing when it holds none."""
    rows = ops.list_checkpoints(path)
    if not rows:
        return
    if json_out:
        output.print_json({"path": path, "format": None, "checkpoints": rows})
        return
    cells = [
        (
            Path(r["path"]).name,
            r["format"] or "—",
            f"step {output.fmt_value(r['step'])}",
            output.fmt_bytes(r["bytes"]),
            r["modified"].replace("T", " ")[:16],
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = [f"{path}: {output.plural(len(rows), 'checkpoint')}, newest first"]
    for r, c in zip(rows, cells):
        line = f"  {c[0]:<{widths[0]}}  {c[1]:<{widths[1]}}  {c[2]:<{widths[2]}}  {c[3]:>{widths[3]}}  {c[4]}"
        if r["error"]:
            line += f"  cannot open: {r['error']}"
        lines += output.wrap(line, output.columns(), "", "    ")
    sys.stdout.write("\n".join(lines) + "\n")


def _print_header(ck, warnings) -> None:
    """The summary lines above the tree: a two-column plain-text table (like the tree, no rich: importing
    and laying out rich costs more than the whole read of a 2 GB checkpoint's metadata)."""
    style, f = output.style, output.fmt_value
    output._COLOR[0] = output.use_color()
    topo, c = ck.topology, ck.counters
    tag = ck.details.get("tag")
    unread = len((ck.details.get("accounting") or {}).get("unread", ()))
    rows = [
        ("format", style(ck.format, "green") + f"  {ck.path}" + (f"  (tag {tag})" if tag else "")),
        (
            "topology",
            f"dp={f(topo.dp)} tp={f(topo.tp)} pp={f(topo.pp)} zero_stage={f(topo.zero_stage)}"
            + (f" ep={topo.ep}" if topo.ep is not None else "")
            + (f" vpp={topo.vpp}" if topo.vpp else ""),
        ),
        (
            "parameters",
            f"{ck.parameter_count:,} in {output.plural(ck.parameter_tensors, 'tensor')}"
            + (f" (of the files read; {output.plural(unread, 'file')} unread)" if unread else "")
            + (f"   dtypes {', '.join(ck.dtypes)}" if ck.dtypes else ""),
        ),
        ("files", _files_line(ck)),
        (
            "counters",
            "  ".join(
                f"{k}={f(getattr(c, k))}"
                for k in (
                    "global_step",
                    "optimizer_step",
                    "scheduler_last_epoch",
                    "scheduler_step_count",
                    "skipped_steps",
                )
            ),
        ),
        (
            "lr",
            f"param_groups={f(list(ck.lr.param_groups) or None)}  base_lrs={f(ck.lr.base_lrs)}  "
            f"last_lr={f(ck.lr.last_lr)}",
        ),
    ]
    rows += [(k, f(v)) for k, v in ck.details.items() if v is not None and k not in ("tag", "accounting")]
    if remote.stats() is not None:
        from .remote import report_line

        rows.append(("remote", report_line()))
    if warnings:
        rows.append(("warnings", style(str(len(warnings)), "yellow")))
    width = max(len(k) for k, _ in rows)
    cols = output.columns()  # on a terminal, values break between words under their own column
    lines = [
        line
        for k, v in rows
        for line in output.wrap(
            v, cols, style(k.ljust(width), "yellow" if k == "warnings" else "bold") + "  ", sep="  "
        )
    ]
    for w in warnings:
        where = " " + style(f"({w.path})", "dim") if w.path and w.path not in w.message else ""
        lines += output.wrap(w.message + where, cols, "  " + style(f"⚠ {w.code}", "yellow") + ": ", "    ")
    sys.stdout.write("\n".join(lines) + "\n")


def _files_line(ck) -> str:
    """`3 files (3 read), 440,367 bytes`; files the checkpoint holds that no reader took are counted, not
    read (the `unread-files` warning names them)."""
    unread = len((ck.details.get("accounting") or {}).get("unread", ()))
    n = len(ck.files)
    return f"{output.plural(n + unread, 'file')} ({n:,} read), {sum(x.bytes for x in ck.files):,} bytes" + (
        " read" if unread else ""
    )


def _print_stats(rows) -> None:
    """One aligned plain-text line per tensor (like the tree: a rich Table took ~1 s for 5,000 rows)."""
    f, style = output.fmt_value, output.style
    head = ("tensor", "shape", "dtype", "min", "max", "mean", "std", "NaN", "Inf")
    cells = [
        (
            s.path,
            "×".join(map(str, s.shape)) or "scalar",
            s.dtype,
            f(s.min),
            f(s.max),
            f(s.mean),
            f(s.std),
            str(s.nan),
            str(s.inf),
        )
        for s in rows
    ]
    width = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head))]

    def line(c, bad=(False, False)):
        left = [c[i].ljust(width[i]) for i in range(3)]
        right = [c[i].rjust(width[i]) for i in range(3, 7)]
        counts = [style(c[i].rjust(width[i]), "red") if flag else c[i].rjust(width[i]) for i, flag in zip((7, 8), bad)]
        return "  ".join(left + right + counts).rstrip()

    out = [style(line(head), "bold")] + [line(c, (s.nan > 0, s.inf > 0)) for c, s in zip(cells, rows)]
    sys.stdout.write("\n".join(out) + "\n")


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
