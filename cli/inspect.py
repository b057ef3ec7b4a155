"""`ckpt inspect PATH`: what is inside a checkpoint, instantly, without loading tensor bytes."""
from __future__ import annotations

import re
from typing import Optional

import typer

from ckpt_tools import open_checkpoint
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
    path: str = typer.Argument(..., help="checkpoint file or folder (a tag folder or its parent with `latest`)"),
    grep: Optional[str] = typer.Option(None, "--grep", "-g", help="only tree entries whose path matches this regex"),
    depth: Optional[int] = typer.Option(None, "--depth", "-d", help="cut the tree at this many levels"),
    rank: Optional[str] = typer.Option(None, "--rank", help="only pieces on this rank: N (dp) or dp=N,tp=N,pp=N"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output (see ckpt_tools.ops.inspect)"),
    stats: bool = typer.Option(False, "--stats", help="read tensor data: min/max/mean/std, NaN/Inf (slow)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="header only, no tree"),
) -> None:
    """Show format, topology, counters, learning rates, parameter count, warnings and the state tree."""
    ck = open_checkpoint(path)
    rank_d = parse_rank(rank)
    try:
        tree = ops.filter_tree(ck.tree, grep=grep, depth=depth, rank=rank_d)
    except re.error as e:
        raise typer.BadParameter(f"{grep!r} is not a valid regex ({e})", param_hint="--grep")
    stat_rows = []
    if stats:
        from tqdm import tqdm

        total = sum(1 for _ in ops.iter_tensors(ck.tree))
        stat_rows = list(tqdm(ops.tensor_stats(ck, grep), total=total, desc="reading tensors", unit="tensor",
                              disable=json_out or quiet, leave=False))
    warnings = list(ck.warnings) + ops.stats_warnings(stat_rows)
    if json_out:
        doc = ops.summary(ck, tree if tree is not None else ops.GroupNode(), rank_d)
        doc["warnings"] = [w.__dict__ for w in warnings]
        if stats:
            doc["stats"] = [s.__dict__ for s in stat_rows]
        output.print_json(doc)
        return
    con = output.console()
    _print_header(con, ck, warnings)
    if stats:
        _print_stats(con, stat_rows)
    elif not quiet and tree is not None:
        extra = None
        if rank_d:
            def extra(n):
                ps = ops.rank_pieces(n, rank_d) if isinstance(n, ops.TensorNode) else []
                return "".join("  " + output.style(f"{p.file}[{p.src_offset}:{p.src_offset + p.numel}]", "dim")
                               for p in ps)
        output.print_tree(tree, "tree", extra)


def _print_header(con, ck, warnings) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    topo = ck.topology
    tag = ck.details.get("tag")
    t.add_row("format", f"[green]{ck.format}[/]  {escape(ck.path)}" + (f"  (tag {escape(str(tag))})" if tag else ""))
    t.add_row("topology", f"dp={output.fmt_value(topo.dp)} tp={output.fmt_value(topo.tp)} "
                          f"pp={output.fmt_value(topo.pp)} zero_stage={output.fmt_value(topo.zero_stage)}")
    t.add_row("parameters", f"{ck.parameter_count:,} in {ck.parameter_tensors:,} tensors"
                            + (f"   dtypes {', '.join(ck.dtypes)}" if ck.dtypes else ""))
    nbytes = sum(f.bytes for f in ck.files)
    t.add_row("files", f"{len(ck.files)} files, {nbytes:,} bytes")
    c = ck.counters
    t.add_row("counters", "  ".join(f"{k}={output.fmt_value(getattr(c, k))}" for k in
                                    ("global_step", "optimizer_step", "scheduler_last_epoch",
                                     "scheduler_step_count", "skipped_steps")))
    t.add_row("lr", f"param_groups={output.fmt_value(list(ck.lr.param_groups))}  "
                    f"base_lrs={output.fmt_value(ck.lr.base_lrs)}  last_lr={output.fmt_value(ck.lr.last_lr)}")
    for k, v in ck.details.items():
        if v is not None and k != "tag":
            t.add_row(k, escape(output.fmt_value(v)))
    if warnings:
        t.add_row("[yellow]warnings[/]", f"[yellow]{len(warnings)}[/]")
    con.print(t)
    for w in warnings:
        where = f" [dim]({escape(w.path)})[/]" if w.path else ""
        con.print(f"  [yellow]⚠ {w.code}[/]: {escape(w.message)}{where}")


def _print_stats(con, rows) -> None:
    from rich.table import Table

    t = Table(show_edge=False)
    for col in ("tensor", "shape", "dtype", "min", "max", "mean", "std", "NaN", "Inf"):
        t.add_column(col, justify="right" if col not in ("tensor", "dtype") else "left")
    for s in rows:
        f = output.fmt_value
        t.add_row(s.path, "×".join(map(str, s.shape)) or "scalar", s.dtype, f(s.min), f(s.max), f(s.mean), f(s.std),
                  f"[red]{s.nan}[/]" if s.nan else "0", f"[red]{s.inf}[/]" if s.inf else "0")
    con.print(t)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
