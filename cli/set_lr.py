"""`ckpt set-lr`, `ckpt set-step`, `ckpt diff`, `ckpt restore`: LR and counter surgery, planned and undoable.

Every write goes through `ckpt_tools.io.execute` (staged outside the checkpoint, originals hard-linked
into `<parent>/.ckpt-backups/<name>/<time>-<cmd>/files/` or `--backup-dir`, atomic renames, re-verified,
rolled back on any failure); `ckpt restore` puts the last write's originals back byte for byte.
Exit codes: 0 done (diff: same), 1 declined / verification left problems (diff: they differ), 2 unusable input.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import output

_BACKUP_HELP = "where the originals go (default: <parent>/.ckpt-backups/<name>/, never inside the checkpoint)"


def _run(lp, *, dry_run: bool, yes: bool, json_out: bool, backup_dir: Optional[Path]) -> int:
    """Show the plan (table or JSON), confirm or --yes, execute through io, report."""
    plan = lp.plan
    if json_out and not (yes or dry_run):
        raise typer.BadParameter("--json cannot prompt: add --yes or --dry-run", param_hint="--json")
    con = output.console()
    if json_out and dry_run:
        output.print_json({"dry_run": True, "plan": lp.to_json()})
        return 0
    if not json_out:
        output.print_write_plan(con, plan)
    if not plan.writes:
        if json_out:
            output.print_json({"dry_run": dry_run, "plan": lp.to_json(), "transaction": None})
        else:
            con.print("[green]nothing to do[/]")
        return 0
    tx = output.confirm_and_execute(con, plan, dry_run=dry_run, yes=yes, backup_dir=backup_dir, verb="rewrite")
    if tx is None:
        return 0
    if json_out:
        output.print_json({"dry_run": False, "plan": lp.to_json(), "transaction": str(tx.dir)})
    else:
        con.print(f"[green]rewrote {len(tx.files)} files, verified[/]; backups and journal: {tx.dir}", soft_wrap=True)
        con.print(f"undo: ckpt restore {plan.root}", soft_wrap=True)
    return 0


def set_lr_cmd(
    path: str = typer.Argument(..., help="checkpoint: DeepSpeed / Accelerate / HF Trainer folder, DCP folder, torch or Lightning file"),
    scale: Optional[float] = typer.Option(None, "--scale", help="multiply the LR trajectory (every LR field) by this"),
    lr: Optional[float] = typer.Option(None, "--lr", help="set the base LR (base_lrs / the config's peak); every "
                                       "other LR field scaled by the same factor"),
    group: Optional[int] = typer.Option(None, "--group", help="only this param group (default: all)"),
    optimizer: Optional[int] = typer.Option(None, "--optimizer", help="only this optimizer and its scheduler, when "
                                            "the checkpoint holds several (Accelerate optimizer_1.bin = 1, Lightning's "
                                            "list position); default: all"),
    last_lr: Optional[float] = typer.Option(None, "--last-lr", help="the LR in effect now (_last_lr and optimizer lr)"),
    last_epoch: Optional[int] = typer.Option(None, "--last-epoch", help="scheduler position (DeepSpeed: "
                                             "last_batch_iteration)"),
    step_count: Optional[int] = typer.Option(None, "--step-count", help="scheduler _step_count"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, write nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable plan / result"),
    backup_dir: Optional[Path] = typer.Option(None, "--backup-dir", help=_BACKUP_HELP),
) -> int:
    """Change the LR trajectory in every file that holds it, knowing which field drives the LR after resume
    (the plan says so per field). DeepSpeed's own schedulers: prints the launch-config change too."""
    from ckpt_tools import open_checkpoint
    from ckpt_tools.ops import lr as ops

    if scale is not None and lr is not None:
        raise typer.BadParameter("give --scale or --lr, not both", param_hint="--lr")
    lp = ops.plan_set_lr(open_checkpoint(path), scale=scale, lr=lr, group=group, last_lr=last_lr,
                         last_epoch=last_epoch, step_count=step_count, optimizer=optimizer)
    return _run(lp, dry_run=dry_run, yes=yes, json_out=json_out, backup_dir=backup_dir)


def set_step_cmd(
    path: str = typer.Argument(..., help="checkpoint: DeepSpeed / Accelerate / HF Trainer folder, DCP folder, torch or Lightning file"),
    step: Optional[int] = typer.Option(None, "--step", help="all counters for N optimizer updates, coherently "
                                       "(Accelerate: last_epoch = world_size x N)"),
    optimizer_step: Optional[int] = typer.Option(None, "--optimizer-step", help="Adam `step` in every rank and group"),
    global_step: Optional[int] = typer.Option(None, "--global-step", help="DeepSpeed global_steps / the loop's step"),
    last_epoch: Optional[int] = typer.Option(None, "--last-epoch", help="scheduler last_epoch (DeepSpeed: "
                                             "last_batch_iteration)"),
    step_count: Optional[int] = typer.Option(None, "--step-count", help="scheduler _step_count"),
    optimizer: Optional[int] = typer.Option(None, "--optimizer", help="only this optimizer and its scheduler, when "
                                            "the checkpoint holds several (Accelerate optimizer_1.bin = 1, Lightning's "
                                            "list position); default: all"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, write nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable plan / result"),
    backup_dir: Optional[Path] = typer.Option(None, "--backup-dir", help=_BACKUP_HELP),
) -> int:
    """Set step counters (e.g. repair a reset Adam step) in every rank file and param group."""
    from ckpt_tools import open_checkpoint
    from ckpt_tools.ops import lr as ops

    lp = ops.plan_set_step(open_checkpoint(path), step=step, optimizer_step=optimizer_step, global_step=global_step,
                           last_epoch=last_epoch, step_count=step_count, optimizer=optimizer)
    return _run(lp, dry_run=dry_run, yes=yes, json_out=json_out, backup_dir=backup_dir)


def diff_cmd(
    before: Path = typer.Argument(..., help="checkpoint (file or folder) before"),
    after: Path = typer.Argument(..., help="checkpoint (file or folder) after"),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="absolute tolerance (default 0: bit-exact)"),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="relative tolerance (torch.allclose semantics)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable report"),
) -> int:
    """What changed between two checkpoints, field by field and tensor by tensor. Exit 1 when they differ."""
    from rich.markup import escape

    from ckpt_tools.ops import diff as ops

    report = ops.diff(before, after, atol, rtol)
    if json_out:
        output.print_json(report.to_json())
        return 0 if report.same else 1
    con = output.console()
    tol = f"atol={atol:g} rtol={rtol:g}" + ("  (bit-exact)" if not atol and not rtol else "")
    con.print(f"[bold]diff[/]  {escape(str(before))} -> {escape(str(after))}  {tol}", soft_wrap=True)
    last = None
    for file, fieldname, what in ops.iter_lines(report):
        if file != last:
            con.print(f"  [cyan]{escape(file)}[/]", soft_wrap=True)
            last = file
        con.print(f"      {escape(fieldname) or '(file)'}  {escape(what)}", soft_wrap=True)
    summary = (f"{report.files_compared} files, {report.tensors_compared} tensors compared "
               f"({report.tensors_read} read)" + (f", {report.within_tolerance} within tolerance" if report.within_tolerance else ""))
    if report.same:
        con.print(f"[green]same[/]: {summary}")
    else:
        con.print(f"[red]{len(report.differences)} differences[/]: {summary}")
    return 0 if report.same else 1


def restore_cmd(
    path: Path = typer.Argument(..., help="the checkpoint a ckpt write changed"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    list_: bool = typer.Option(False, "--list", help="show every recorded write, newest first, and which one "
                                                    "`restore` undoes next; change nothing"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable result"),
) -> int:
    """Undo the last finished ckpt write on this checkpoint: its originals back, byte for byte. Run it again
    to walk further back, one write at a time (newest first)."""
    from ckpt_tools import io
    from ckpt_tools.errors import CkptError

    if list_:
        return _list_writes(path, json_out)
    if json_out and not yes:
        raise typer.BadParameter("--json cannot prompt: add --yes", param_hint="--json")
    done = [t for t in io.transactions(path) if t.status == "done"]
    if not done:
        raise CkptError("no finished ckpt write to undo for this checkpoint", path=path,
                        hint=f"backups live in {io.backups_root(path)}")
    last = done[-1]
    con = output.console()
    if not json_out:
        con.print(f"[bold]restore[/] {len(last.files)} files written by `{last.command}` ({last.dir.name})",
                  soft_wrap=True)
        for f in last.files:
            con.print(f"  {f}", soft_wrap=True)
    if not yes and not typer.confirm("put the originals back?", default=False):
        con.print("nothing restored")
        return 1
    t = io.restore(path, last.dir)
    if json_out:
        output.print_json({"restored": list(t.files), "command": t.command, "transaction": str(t.dir)})
    else:
        con.print(f"[green]restored {len(t.files)} files[/] from {t.dir}", soft_wrap=True)
    return 0


def register(app: typer.Typer) -> None:
    app.command("set-lr")(set_lr_cmd)
    app.command("set-step")(set_step_cmd)
    app.command("diff")(diff_cmd)
    app.command("restore")(restore_cmd)


def _list_writes(path: Path, json_out: bool) -> int:
    from ckpt_tools import io

    io.recover(path)  # a killed write is rolled back first, as every write and restore does
    history = list(reversed(io.transactions(path)))
    nxt = next((t for t in history if t.status == "done"), None)
    rows = [{"transaction": str(t.dir), "command": t.command, "status": t.status, "files": list(t.files),
             "next_to_undo": t is nxt} for t in history]
    if json_out:
        output.print_json({"checkpoint": str(path), "backups": str(io.backups_root(path)), "writes": rows})
        return 0
    con = output.console()
    if not rows:
        con.print(f"no ckpt writes recorded for {path} (backups would live in {io.backups_root(path)})",
                  soft_wrap=True)
        return 0
    from rich.table import Table

    t = Table(show_edge=False, title=f"ckpt writes on {path}, newest first ({io.backups_root(path)})")
    for col in ("when", "command", "status", "files", ""):
        t.add_column(col)
    for r, tr in zip(rows, history):
        stamp = tr.dir.name.split("-", 1)[0]  # 20261121T142952
        when = f"{stamp[:4]}-{stamp[4:6]}-{stamp[6:8]} {stamp[9:11]}:{stamp[11:13]}:{stamp[13:15]}" \
            if len(stamp) == 15 and stamp[8] == "T" else stamp
        t.add_row(when, r["command"], r["status"], str(len(r["files"])),
                  "[bold]<- next `ckpt restore`[/]" if r["next_to_undo"] else "")
    con.print(t)
    return 0
