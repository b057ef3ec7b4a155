"""`ckpt set-lr`, `ckpt set-step`, `ckpt restore` (`ckpt diff`: cli/diff.py): LR and counter surgery, planned and
undoable.

Every write goes through `ckpt_tools.write.io.execute` (staged outside the checkpoint, originals hard-linked
into `<parent>/.ckpt-backups/<name>/<time>-<cmd>/files/` or `--backup-dir`, atomic renames, re-verified,
rolled back on any failure); `ckpt restore` puts the last write's originals back byte for byte.
Exit codes (cli/main.py): 0 done (diff: same), 1 diff: they differ, 2 unusable input (a folder the write needs
is not writable, no terminal to confirm on, ...), 3 declined at the prompt, 130 interrupted (one line says
what was put back).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from . import output
from .output import escape

_BACKUP_HELP = (
    "where the backups and the journal go, and the new files are staged when it is on the "
    "checkpoint's filesystem (default: <parent>/.ckpt-backups/<name>/, never inside the checkpoint)"
)
_COPY_HELP = (
    "write every changed file as a whole new copy renamed into place (the original kept as a hard-link "
    "backup), instead of changing it in place in O(changed bytes) under a rollback journal"
)
_PATH_HELP = (
    "checkpoint: a DeepSpeed, Megatron-LM (run or iter_N folder), torchtune output, Accelerate, HF Trainer "
    "or DCP folder (torchtitan's too), a torch or Lightning file"
)
DECLINED = 3  # exit code: the user answered no at the prompt (1 means "a check found problems")


def _bar(total: int, json_out: bool, desc: str):
    """One progress bar on stderr for a rewrite (minutes at TB scale); off with --json and when stderr is not
    a terminal (tqdm's disable=None)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=True if json_out else None, leave=False)


def _confirm(question: str, root) -> bool:
    """Ask; a closed or empty stdin (`</dev/null`, cron) is unusable input, not an interrupt."""
    from ckpt_tools.write import io
    from ckpt_tools.errors import CkptError

    try:
        return typer.confirm(question, default=False)
    except typer.Abort:
        if not sys.stdin.isatty():
            raise CkptError(
                "no terminal to ask for confirmation on",
                path=root,
                hint="add --yes to go ahead without asking; nothing was written",
            ) from None
        raise io.Interrupted(f"{root} is unchanged: stopped at the prompt") from None


def _describe(t) -> str:
    """An earlier write in one line: when, which command, and the values it set (the LR then)."""
    from .output import fmt_value

    shown = [c for c in t.changes if "DRIVES" in c.note] or list(t.changes)
    values = "; ".join(f"{c.field} {fmt_value(c.old)} -> {fmt_value(c.new)}" for c in shown[:2])
    more = len(t.changes) - len(shown[:2])
    more = f", and {more} more field{'s' if more > 1 else ''}" if more else ""
    return f"`{t.command}` on {t.started} UTC ({values}{more})"


def _tx_json(t) -> dict | None:
    from ckpt_tools.read.tree import jsonable

    if t is None:
        return None
    return {
        "transaction": str(t.dir),
        "command": t.command,
        "started": t.started,
        "files": list(t.files),
        "changes": [
            {"file": c.file, "field": c.field, "old": jsonable(c.old), "new": jsonable(c.new)} for c in t.changes
        ],
    }


def confirm_and_write(
    con, plan, *, dry_run: bool, yes: bool, json_out: bool, backup_dir: Optional[Path], verb: str, copy: bool = False
):
    """The tail every rewriting command shares (set-lr, set-step, sync-tp), after the plan was shown: check that
    every place the write touches is writable (exit 2 naming the place, a dry run included: it would fail);
    say what an earlier run of the same command already did (running `set-lr --scale 0.5` twice compounds);
    stop for --dry-run; confirm unless --yes (declined: exit 3); execute through `io.execute` under a
    progress bar. Returns the transaction (None for a dry run)."""
    from rich.markup import escape

    from ckpt_tools.write import io

    places = io.check_places(plan, backup_dir, copy=copy)
    before = io.last_write(plan.root, plan.command, backup_dir)
    if not json_out:
        for n in places.notes:
            con.print(f"  note: {escape(n)}", soft_wrap=True)
        if before is not None:
            said = (
                f"this checkpoint was already changed by {_describe(before)}; this run applies on top of it "
                f"(undo that one with `ckpt restore {plan.root}`)"
            )
            con.print(f"[yellow]note[/]: {escape(said)}", soft_wrap=True)
    if dry_run:
        if not json_out:
            con.print("[dim]dry run: nothing written[/]")
        return None
    if not yes:
        again = " again" if before is not None else ""
        if not _confirm(f"{verb} {len(plan.writes)} files in {plan.root}{again}?", plan.root):
            con.print("nothing written")
            raise typer.Exit(DECLINED)
    with _bar(sum(w.nbytes for w in plan.writes), json_out, io.command_verb(plan.command)) as bar:
        return io.execute(plan, backup_dir=backup_dir, progress=bar.update, copy=copy)


def _undo_hint(root, backup_dir: Optional[Path], tx) -> str:
    """`ckpt restore ROOT`, with --backup-dir when no link to the transaction was left in the default place."""
    from ckpt_tools.write import io

    linked = any(t.dir.resolve() == tx.dir.resolve() for t in io.transactions(root))
    return f"ckpt restore {root}" + ("" if linked or not backup_dir else f" --backup-dir {backup_dir}")


def written_line(tx) -> str:
    """How the files were written: in place (bytes written) and/or as new copies, and where the undo lives."""
    n_in = len(tx.in_place)
    parts = []
    if n_in:
        parts.append(f"{output.plural(n_in, 'file')} changed in place ({tx.written:,} bytes written)")
    if len(tx.files) > n_in:
        parts.append(f"{output.plural(len(tx.files) - n_in, 'file')} rewritten as new copies")
    return "; ".join(parts) + f"; journal and backups: {tx.dir}"


def _run(lp, *, dry_run: bool, yes: bool, json_out: bool, backup_dir: Optional[Path], copy: bool = False) -> int:
    """Show the plan (table or JSON), check, confirm or --yes, execute through io, report. A Ctrl-C says
    whether anything was written (io.execute's own Interrupted says what it put back)."""
    from ckpt_tools.write import io

    plan = lp.plan
    if json_out and not (yes or dry_run):
        raise typer.BadParameter("--json cannot prompt: add --yes or --dry-run", param_hint="--json")
    con = output.console()
    tx = None
    try:
        if json_out and dry_run:
            output.print_json(
                {
                    "dry_run": True,
                    "plan": lp.to_json(),
                    "previous_write": _tx_json(io.last_write(plan.root, plan.command, backup_dir)),
                }
            )
            if plan.writes:
                io.check_places(
                    plan, backup_dir, copy=copy
                )  # a dry run of a write that cannot happen ends in its error
            return 0
        if not json_out:
            output.print_write_plan(con, plan)
        before = io.last_write(plan.root, plan.command, backup_dir)
        tx = confirm_and_write(
            con, plan, dry_run=dry_run, yes=yes, json_out=json_out, backup_dir=backup_dir, verb="rewrite", copy=copy
        )
        if tx is None:
            return 0
        if json_out:
            output.print_json(
                {
                    "dry_run": False,
                    "plan": lp.to_json(),
                    "transaction": str(tx.dir),
                    "previous_write": _tx_json(before),
                    "bytes_written": tx.written,
                    "in_place": list(tx.in_place),
                }
            )
        else:
            con.print(
                f"[green]changed {output.plural(len(tx.files), 'file')}, verified[/]; {escape(written_line(tx))}",
                soft_wrap=True,
            )
            con.print(f"undo: {escape(_undo_hint(plan.root, backup_dir, tx))}", soft_wrap=True)
            job = (getattr(lp, "config_change", None) or {}).get("job_config")
            if job:  # torchtitan: the checkpoint edit alone changes only the first resumed update
                con.print(
                    "[bold yellow]NOT DONE YET[/]: relaunch with "
                    + escape(" ".join(f"{k} {v:.6g}" for k, v in job.items()))
                    + " (the job config's LR drives every resumed step after the first)",
                    soft_wrap=True,
                )
        return 0
    except KeyboardInterrupt as e:
        if isinstance(e, io.Interrupted):
            raise
        raise io.Interrupted(
            f"the write to {plan.root} had finished and was verified (backups and journal: "
            f"{tx.dir}; undo: {_undo_hint(plan.root, backup_dir, tx)})"
            if tx is not None
            else f"{plan.root} is unchanged: nothing had been written"
        ) from e


def set_lr_cmd(
    path: str = typer.Argument(..., help=_PATH_HELP),
    scale: Optional[float] = typer.Option(None, "--scale", help="multiply the LR trajectory (every LR field) by this"),
    lr: Optional[float] = typer.Option(
        None,
        "--lr",
        help="set the base LR (base_lrs / the config's peak); every other LR field scaled by the same factor",
    ),
    group: Optional[int] = typer.Option(None, "--group", help="only this param group (default: all)"),
    optimizer: Optional[int] = typer.Option(
        None,
        "--optimizer",
        help="only this optimizer and its scheduler, when "
        "the checkpoint holds several (Accelerate optimizer_1.bin = 1, Lightning's "
        "list position); default: all",
    ),
    last_lr: Optional[float] = typer.Option(None, "--last-lr", help="the LR in effect now (_last_lr and optimizer lr)"),
    last_epoch: Optional[int] = typer.Option(
        None, "--last-epoch", help="scheduler position (DeepSpeed: last_batch_iteration)"
    ),
    step_count: Optional[int] = typer.Option(None, "--step-count", help="scheduler _step_count"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, write nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable plan / result"),
    backup_dir: Optional[Path] = typer.Option(None, "--backup-dir", help=_BACKUP_HELP),
    copy: bool = typer.Option(False, "--copy", help=_COPY_HELP),
    allow_unread: bool = typer.Option(False, "--allow-unread", help=output.ALLOW_UNREAD_HELP),
    trust_pickles: bool = typer.Option(False, "--trust-pickles", help=output.TRUST_PICKLES_HELP),
) -> int:
    """Change the LR trajectory in every file that holds it, knowing which field drives the LR after resume
    (the plan says so per field): DeepSpeed, Megatron-LM (legacy and torch_dist; the plan names the relaunch flag),
    torchtune output folders (initial_lr drives the rebuilt scheduler), torchtitan and other DCP folders, HF
    Trainer, Accelerate, Lightning and torch.save files. DeepSpeed's own schedulers: prints the launch-config change
    too."""
    from ckpt_tools import open_checkpoint
    from ckpt_tools.ops import lr as ops

    if scale is not None and lr is not None:
        raise typer.BadParameter("give --scale or --lr, not both", param_hint="--lr")
    lp = ops.plan_set_lr(
        open_checkpoint(path),
        scale=scale,
        lr=lr,
        group=group,
        last_lr=last_lr,
        last_epoch=last_epoch,
        step_count=step_count,
        optimizer=optimizer,
        allow_unread=allow_unread,
        trust_pickles=trust_pickles,
    )
    return _run(lp, dry_run=dry_run, yes=yes, json_out=json_out, backup_dir=backup_dir, copy=copy)


def set_step_cmd(
    path: str = typer.Argument(..., help=_PATH_HELP),
    step: Optional[int] = typer.Option(
        None,
        "--step",
        help="all counters for N optimizer updates, coherently (Accelerate: last_epoch = world_size x N)",
    ),
    optimizer_step: Optional[int] = typer.Option(None, "--optimizer-step", help="Adam `step` in every rank and group"),
    global_step: Optional[int] = typer.Option(None, "--global-step", help="DeepSpeed global_steps / the loop's step"),
    last_epoch: Optional[int] = typer.Option(
        None, "--last-epoch", help="scheduler last_epoch (DeepSpeed: last_batch_iteration)"
    ),
    step_count: Optional[int] = typer.Option(None, "--step-count", help="scheduler _step_count"),
    optimizer: Optional[int] = typer.Option(
        None,
        "--optimizer",
        help="only this optimizer and its scheduler, when "
        "the checkpoint holds several (Accelerate optimizer_1.bin = 1, Lightning's "
        "list position); default: all",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the plan, write nothing"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable plan / result"),
    backup_dir: Optional[Path] = typer.Option(None, "--backup-dir", help=_BACKUP_HELP),
    copy: bool = typer.Option(False, "--copy", help=_COPY_HELP),
    allow_unread: bool = typer.Option(False, "--allow-unread", help=output.ALLOW_UNREAD_HELP),
    trust_pickles: bool = typer.Option(False, "--trust-pickles", help=output.TRUST_PICKLES_HELP),
) -> int:
    """Set step counters (e.g. repair a reset Adam step) in every rank file and param group."""
    from ckpt_tools import open_checkpoint
    from ckpt_tools.ops import lr as ops

    lp = ops.plan_set_step(
        open_checkpoint(path),
        step=step,
        optimizer_step=optimizer_step,
        global_step=global_step,
        last_epoch=last_epoch,
        step_count=step_count,
        optimizer=optimizer,
        allow_unread=allow_unread,
        trust_pickles=trust_pickles,
    )
    return _run(lp, dry_run=dry_run, yes=yes, json_out=json_out, backup_dir=backup_dir, copy=copy)


def restore_cmd(
    path: Path = typer.Argument(..., help="the checkpoint a ckpt write changed"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask for confirmation"),
    list_: bool = typer.Option(
        False,
        "--list",
        help="show every recorded write, newest first, and which one `restore` undoes next; change nothing",
    ),
    json_out: bool = typer.Option(False, "--json", help="machine-readable result"),
    backup_dir: Optional[Path] = typer.Option(
        None,
        "--backup-dir",
        help="the --backup-dir the write was made with (found without it when a link was left beside the checkpoint)",
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="show which write would be undone and the files that "
        "would be put back (checked as restore checks them), write nothing",
    ),
) -> int:
    """Undo the last ckpt write on this checkpoint: a write that was interrupted is rolled back, else the last
    finished write's originals go back, byte for byte. Run it again to walk further back, one write at a time
    (newest first)."""
    from ckpt_tools.write import io

    if list_:
        return _list_writes(path, json_out, backup_dir)
    if json_out and not yes and not dry_run:
        raise typer.BadParameter("--json cannot prompt: add --yes", param_hint="--json")
    history = io.transactions(path, backup_dir)
    active = [t for t in history if t.status in io.ACTIVE]
    done = [t for t in history if t.status == "done"]
    if not active and not done:
        io.restore(path, backup_dir=backup_dir)  # raises the one-line error: nothing to undo, and where it looked
    last = (active or done)[-1]
    io.check_restore(last)
    con = output.console()
    if not json_out:
        if active:
            back = io.replaced_files(last)
            con.print(
                "[bold]restore[/]: "
                + escape(
                    f"roll back the interrupted write `{last.command}` (started {last.started} UTC, "
                    f"{last.dir.name}): put "
                    f"back the originals of the {len(back)} of {len(last.files)} files it had replaced"
                ),
                soft_wrap=True,
            )
            for f in back:
                con.print(f"  {escape(str(f))}", soft_wrap=True)
        else:
            con.print(
                "[bold]restore[/] "
                + escape(f"{output.plural(len(last.files), 'file')} written by `{last.command}` ({last.dir.name})"),
                soft_wrap=True,
            )
            for f in last.files:
                con.print(f"  {escape(str(f))}", soft_wrap=True)
    if dry_run:
        if json_out:
            output.print_json(
                {
                    "dry_run": True,
                    "command": last.command,
                    "transaction": str(last.dir),
                    "interrupted": bool(active),
                    "files": [str(f) for f in (io.replaced_files(last) if active else last.files)],
                }
            )
        else:
            con.print("[dim]dry run: nothing restored[/]")
        return 0
    if not yes and not _confirm("put the originals back?", path):
        con.print("nothing restored")
        return DECLINED
    with _bar(last.nbytes, json_out, "restore") as bar:
        t = io.restore(path, last.dir, backup_dir=backup_dir, progress=bar.update)
    if json_out:
        output.print_json(
            {"restored": list(t.files), "command": t.command, "transaction": str(t.dir), "interrupted": bool(active)}
        )
    elif active:
        con.print(f"[green]rolled back the interrupted write[/]; its journal: {escape(str(t.dir))}", soft_wrap=True)
    else:
        con.print(f"[green]restored {output.plural(len(t.files), 'file')}[/] from {escape(str(t.dir))}", soft_wrap=True)
    return 0


def register(app: typer.Typer) -> None:
    app.command("set-lr")(set_lr_cmd)
    app.command("set-step")(set_step_cmd)
    app.command("restore")(restore_cmd)


def _list_writes(path: Path, json_out: bool, backup_dir: Optional[Path] = None) -> int:
    """Report only (the help says it changes nothing): an interrupted write is shown as such, and as the one
    the next `ckpt restore` rolls back — it is not rolled back here."""
    from ckpt_tools.write import io

    history = list(reversed(io.transactions(path, backup_dir)))
    nxt = next((t for t in history if t.status in io.ACTIVE), None) or next(
        (t for t in history if t.status == "done"), None
    )
    rows = [
        {
            "transaction": str(t.dir),
            "command": t.command,
            "status": t.status,
            "files": list(t.files),
            "started": t.started,
            "interrupted": t.status in io.ACTIVE,
            "next_to_undo": t is nxt,
        }
        for t in history
    ]
    where = io.backups_root(path, backup_dir)
    if json_out:
        output.print_json(
            {
                "checkpoint": str(path),
                "backups": str(where),
                "writes": rows,
                "interrupted_write": io.interrupted_write(path, backup_dir),
            }
        )
        return 0
    con = output.console()
    if not rows:
        con.print(escape(f"no ckpt writes recorded for {path} (backups would live in {where})"), soft_wrap=True)
        return 0
    from rich.table import Table

    t = Table(show_edge=False, title=escape(f"ckpt writes on {path}, newest first ({where})"))
    for col in ("when (UTC)", "command", "status", "files", ""):
        t.add_column(col)
    for r in rows:
        status = f"interrupted ({r['status']})" if r["interrupted"] else r["status"]
        nxt_note = "rolls it back" if r["interrupted"] else ""
        t.add_row(
            escape(r["started"]),
            escape(r["command"]),
            escape(status),
            str(len(r["files"])),
            f"[bold]<- next `ckpt restore` {nxt_note}[/]" if r["next_to_undo"] else "",
        )
    con.print(t)
    return 0
