"""`ckpt inspect PATH`: what is inside a checkpoint, instantly, without loading tensor bytes."""
from __future__ import annotations

import re
import sys
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
    _print_header(ck, warnings)
    if stats:
        _print_stats(output.console(), stat_rows)
    elif not quiet and tree is not None:
        extra = None
        if rank_d:
            def extra(n):
                ps = ops.rank_pieces(n, rank_d) if isinstance(n, ops.TensorNode) else []
                return "".join("  " + output.style(f"{p.file}[{p.src_offset}:{p.src_offset + p.numel}]", "dim")
                               for p in ps)
        output.print_tree(tree, "tree", extra)


def _print_header(ck, warnings) -> None:
    """The summary lines above the tree: a two-column plain-text table (like the tree, no rich: importing
    and laying out rich costs more than the whole read of a 2 GB checkpoint's metadata)."""
    style, f = output.style, output.fmt_value
    output._COLOR[0] = output.use_color()
    topo, c = ck.topology, ck.counters
    tag = ck.details.get("tag")
    rows = [
        ("format", style(ck.format, "green") + f"  {ck.path}" + (f"  (tag {tag})" if tag else "")),
        ("topology", f"dp={f(topo.dp)} tp={f(topo.tp)} pp={f(topo.pp)} zero_stage={f(topo.zero_stage)}"),
        ("parameters", f"{ck.parameter_count:,} in {ck.parameter_tensors:,} tensors"
                       + (f"   dtypes {', '.join(ck.dtypes)}" if ck.dtypes else "")),
        ("files", f"{len(ck.files)} files, {sum(x.bytes for x in ck.files):,} bytes"),
        ("counters", "  ".join(f"{k}={f(getattr(c, k))}" for k in ("global_step", "optimizer_step",
                                                                   "scheduler_last_epoch", "scheduler_step_count",
                                                                   "skipped_steps"))),
        ("lr", f"param_groups={f(list(ck.lr.param_groups))}  base_lrs={f(ck.lr.base_lrs)}  "
               f"last_lr={f(ck.lr.last_lr)}"),
    ]
    rows += [(k, f(v)) for k, v in ck.details.items() if v is not None and k != "tag"]
    if warnings:
        rows.append(("warnings", style(str(len(warnings)), "yellow")))
    width = max(len(k) for k, _ in rows)
    lines = [style(k.ljust(width), "yellow" if k == "warnings" else "bold") + "  " + v for k, v in rows]
    for w in warnings:
        lines.append("  " + style(f"⚠ {w.code}", "yellow") + f": {w.message}"
                     + (" " + style(f"({w.path})", "dim") if w.path else ""))
    sys.stdout.write("\n".join(lines) + "\n")


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
