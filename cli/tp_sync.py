"""`ckpt check-tp-sync` and `ckpt sync-tp`: TP replicas that drifted apart, found and repaired."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_tools.write import io
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the ops module (and what it imports) loads only when the command runs
    from ckpt_tools.ops import tp_sync as ops

from ckpt_tools.errors import CkptError

from . import output
from .output import escape
from .set_lr import _BACKUP_HELP, _COPY_HELP, _undo_hint, confirm_and_write, written_line

_PATTERN_HELP = "REGEX (replicated) or REGEX=MERGE naming TP-replicated parameters the checkpoint does not declare"


def _fmt(v) -> str:
    return "—" if v is None else f"{v:.3g}"


def check_tp_sync_cmd(
    path: str = typer.Argument(..., help="pipeline checkpoint folder (tag folder or its parent with `latest`)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable report"),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="absolute tolerance (default 0: bit-exact)"),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="relative tolerance (torch.allclose semantics)"),
    pattern: List[str] = typer.Option([], "--pattern", help=_PATTERN_HELP),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="list in-sync parameters too"),
) -> int:
    """Compare TP-replicated parameters across TP ranks in every representation (module weights, fp32
    master, exp_avg, exp_avg_sq). Exit 1 when any is out of tolerance."""
    report = _check(path, atol, rtol, pattern)
    if json_out:
        output.print_json(report.to_json())
    else:
        _print_report(output.console(), report, verbose)
    return 0 if report.ok else 1


def _check(path: str, atol: float, rtol: float, pattern: List[str]) -> ops.TPSyncReport:
    from ckpt_tools.ops import tp_sync as ops

    try:
        return ops.check_tp_sync(ops.open_for_tp_sync(path, pattern), atol, rtol, pattern)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--pattern")


def _print_report(con, report: ops.TPSyncReport, verbose: bool) -> None:
    from rich.markup import escape

    con.print(
        f"[bold]format[/]  {escape(str(report.format))}  {escape(report.path)}  tp={report.tp} pp={report.pp} "
        f"dp={report.dp}",
        soft_wrap=True,
    )
    con.print(
        f"[bold]replicas from[/]  {escape(report.layout_source)}   [bold]compared[/]  "
        f"{escape(', '.join(report.representations))}   [bold]tolerance[/]  atol={report.atol:g} rtol={report.rtol:g}"
        + ("  (bit-exact)" if not report.atol and not report.rtol else ""),
        soft_wrap=True,
    )
    con.print("[bold]per parameter family[/]")
    for f in report.families:
        con.print(f"  [{'green' if f.in_sync == f.total else 'red'}]{escape(f.line())}[/]")
    rows = report.params if verbose else report.out_of_sync
    if rows:
        # plain aligned lines, soft-wrapped: a long parameter name never gets folded into the next cell
        width = max(len(p.name) for p in rows)
        con.print(
            f"[bold]{'parameters' if verbose else 'out of sync'}[/] (TP ranks vs TP rank 0; "
            "rel = |diff| / max(|a|, |b|))",
            soft_wrap=True,
        )
        con.print(
            f"  {'parameter':<{width}}  pp  {'representation':<14}  {'max |diff|':>10}  {'max rel':>9}  "
            "bit-exact  in tol",
            soft_wrap=True,
        )
        for p in rows:
            for k, d in enumerate(p.diffs):
                label = escape(p.name) if k == 0 else ""
                pp = str(p.pp_stage) if k == 0 and p.pp_stage is not None else ""
                exact = f"{'yes':>9}" if d.bit_exact else f"[red]{'no':>9}[/]"
                tol = f"{'yes':>6}" if d.in_tolerance else f"[red]{'no':>6}[/]"
                con.print(
                    f"  {label:<{width}}  {pp:>2}  {d.representation:<14}  {_fmt(d.max_abs_diff):>10}  "
                    f"{_fmt(d.max_rel_diff):>9}  {exact}  {tol}",
                    soft_wrap=True,
                )
    if report.undecided:
        con.print(
            f"[yellow]not compared[/] (no rule, the data cannot tell): {escape(', '.join(report.undecided))} "
            "— pass --pattern REGEX if they are replicas"
        )
    for w in report.warnings:
        con.print(f"[yellow]⚠ {escape(w.code)}[/]: {escape(w.message)}", soft_wrap=True)
    n, bad = len(report.params), len(report.out_of_sync)
    if bad:
        con.print(
            f"[red]{bad} of {n} replicated parameters out of sync ({report.percent_in_sync:.0f}% in sync)[/]; "
            f"repair: ckpt sync-tp {escape(report.path)} --method average --dry-run",
            soft_wrap=True,
        )
    else:
        con.print(f"[green]all {n} replicated parameters in sync (100%)[/]")


def sync_tp_cmd(
    path: str = typer.Argument(..., help="pipeline checkpoint folder (tag folder or its parent with `latest`)"),
    method: Optional[str] = typer.Option(None, "--method", help="average (BLOOM's remedy, default) or rank0"),
    from_rank: Optional[int] = typer.Option(None, "--from-rank", help="with --method rank0: the TP rank to copy"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, write nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable plan / result"),
    backup_dir: Optional[Path] = typer.Option(None, "--backup-dir", help=_BACKUP_HELP),
    pattern: List[str] = typer.Option([], "--pattern", help=_PATTERN_HELP),
    copy: bool = typer.Option(False, "--copy", help=_COPY_HELP),
    allow_unread: bool = typer.Option(False, "--allow-unread", help=output.ALLOW_UNREAD_HELP),
    trust_pickles: bool = typer.Option(False, "--trust-pickles", help=output.TRUST_PICKLES_HELP),
) -> int:
    """Make every out-of-sync TP replica identical: fp32 master and Adam moments on every TP rank and DP
    shard, module weights as the cast of the synced master. Backed up, atomic, verified."""
    from ckpt_tools.ops import tp_sync as ops

    if method is None:
        method = "rank0" if from_rank is not None else "average"
    if method not in ops.METHODS:
        raise typer.BadParameter(f"{method!r}: use average or rank0", param_hint="--method")
    if method == "average" and from_rank is not None:
        raise typer.BadParameter("--from-rank needs --method rank0", param_hint="--from-rank")
    if json_out and not (yes or dry_run):
        raise typer.BadParameter("--json cannot prompt: add --yes or --dry-run", param_hint="--json")
    ck = ops.open_for_tp_sync(path, pattern)
    try:
        plan, report = ops.plan_sync_tp(
            ck,
            method,
            from_rank=from_rank or 0,
            patterns=pattern,
            allow_unread=allow_unread,
            trust_pickles=trust_pickles,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--from-rank" if "rank" in str(e) else "--pattern")
    con = output.console()
    if json_out and dry_run:
        output.print_json({"dry_run": True, "plan": plan.to_json(), "before": report.to_json()})
        return 0
    if not plan.writes:  # a repair that finds nothing to repair is an error, not a success (exit 2)
        raise CkptError(
            f"nothing to repair: all {len(report.params)} replicated parameters are in sync; nothing was written",
            path=str(path),
            hint=f"ckpt check-tp-sync {path} shows the comparison",
        )
    if not json_out:
        _print_plan(con, plan)
    tx = confirm_and_write(
        con, plan, dry_run=dry_run, yes=yes, json_out=json_out, backup_dir=backup_dir, verb="patch", copy=copy
    )
    if tx is None:
        return 0
    try:
        after = ops.check_tp_sync(ops.open_for_tp_sync(path, pattern), patterns=pattern)
    except KeyboardInterrupt as e:
        raise io.Interrupted(
            f"the write to {plan.root} had finished and was verified (backups and journal: "
            f"{tx.dir}; undo: {_undo_hint(plan.root, backup_dir, tx)}); only the report after "
            "it was cut short"
        ) from e
    if json_out:
        output.print_json(
            {
                "dry_run": False,
                "plan": plan.to_json(),
                "transaction": str(tx.dir),
                "after": after.to_json(),
                "bytes_written": tx.written,
                "in_place": list(tx.in_place),
            }
        )
    else:
        con.print(
            f"[green]patched {output.plural(len(tx.files), 'file')}; check-tp-sync now: "
            f"{after.percent_in_sync:.0f}% of "
            f"{len(after.params)} replicated parameters in sync[/]"
        )
        con.print(escape(f"{written_line(tx)}  (undo: {_undo_hint(plan.root, backup_dir, tx)})"), soft_wrap=True)
    return 0 if after.ok else 1


def _print_plan(con, plan: io.WritePlan) -> None:
    """One heading per file (its rank and how it is written), then one line per parameter and
    representation: old max |diff| across TP ranks -> 0, and where the new value comes from."""
    from ckpt_tools.ops import tp_sync as ops

    from rich.markup import escape

    con.print(
        f"[bold]plan: {escape(plan.command)}[/]  ({len(plan.writes)} files under {escape(str(plan.root))})",
        soft_wrap=True,
    )
    last = None
    rows = list(ops.iter_rows(plan))
    width = max((len(r[1]) for r in rows), default=0)
    for file, name, rep, where, old, note in rows:
        if file != last:
            con.print(f"  [cyan]{escape(file)}[/]  [dim]{escape(where)}[/]", soft_wrap=True)
            last = file
        con.print(
            f"      {escape(name):<{width}}  {rep:<10}  max |diff| {_fmt(old):>9} -> 0  [dim]{escape(note)}[/]",
            soft_wrap=True,
        )
    for n in plan.notes:
        con.print(f"  {escape(n)}", soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("check-tp-sync")(check_tp_sync_cmd)
    app.command("sync-tp")(sync_tp_cmd)
