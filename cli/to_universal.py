"""`ckpt to-universal CKPT OUT`: a thin wrapper over `ckpt_tools.ops.to_universal` (plan -> dry-run table or
execute -> summary). `ckpt export` lives in `cli/export.py`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from ckpt_tools.errors import CkptError

from . import output
from .output import escape


def _bar(total: int, disable: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=disable, leave=False)


def to_universal_cmd(
    ckpt: str = typer.Argument(
        ...,
        metavar="PATH",
        help="DeepSpeed ZeRO, Megatron-DeepSpeed pipeline, "
        "Accelerate+DeepSpeed checkpoint (tag folder or its parent with `latest`) or an HF "
        "Trainer+DeepSpeed checkpoint-N folder",
    ),
    out: str = typer.Argument(
        ...,
        metavar="OUT",
        help="new folder outside PATH: OUT/latest_universal + "
        'OUT/<tag>_universal/ (load it with "checkpoint": {"load_universal": true})',
    ),
    workers: int = typer.Option(
        min(8, os.cpu_count() or 1), "--workers", "-w", metavar="N", help="parallel writer threads"
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be written and how TP shards merge"),
    tp_layout: Optional[str] = typer.Option(
        None,
        "--tp-layout",
        metavar="NAME",
        help="named TP merge preset when the checkpoint has no universal_checkpoint_info: megatron",
    ),
    pattern: Optional[List[str]] = typer.Option(
        None,
        "--pattern",
        metavar="REGEX=MERGE",
        help="MERGE: replicated, average, cat:0, cat:1; asked before any other rule (repeatable)",
    ),
    tp_replicated: Optional[str] = typer.Option(
        None, "--tp-replicated", metavar="METHOD", help="when TP replicas differ: average or rank0 (default: stop)"
    ),
    target_stage: Optional[int] = typer.Option(
        None,
        "--target-stage",
        metavar="N",
        help="the ZeRO stage the "
        "output will be loaded at: write only what that stage's loader "
        "reads, refuse what it cannot load (non-Adam state at 3), and warn "
        "about what it will change (group 0's LR/weight decay copied onto "
        "every group at 3). Default: 1, 2 and 3 where the state allows",
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="before finishing, compare the output with the source "
        "by logical parameter (`ckpt diff --logical`): every fp32 master, optimizer "
        "state, param group and counter equal, else nothing is written",
    ),
    yes: bool = typer.Option(
        False, "--yes", "-y", help="do not ask (to-universal writes only a new folder, atomically, so it never asks)"
    ),
    distributed: bool = typer.Option(
        False,
        "--distributed",
        help="under torchrun (detected from its environment "
        "without this flag): each rank converts a share of the parameters (one "
        "shared filesystem); a rerun resumes",
    ),
    nproc: Optional[int] = typer.Option(
        None,
        "--nproc",
        metavar="M",
        min=1,
        help="run as M processes on this machine (launches torchrun --standalone itself)",
    ),
    restart: bool = typer.Option(False, "--restart", help=output.RESTART_HELP),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
    allow_unread: bool = typer.Option(False, "--allow-unread", help=output.ALLOW_UNREAD_HELP),
    trust_pickles: bool = typer.Option(False, "--trust-pickles", help=output.TRUST_PICKLES_HELP),
) -> None:
    """Convert to DeepSpeed's universal checkpoint: loads at any DP/TP/PP size and ZeRO stage.

    Carries every per-parameter optimizer state (Adam's exp_avg/exp_avg_sq, SGD's momentum_buffer, Adagrad's
    sum, ...). DeepSpeed's ZeRO-3 universal loader reads Adam state only, and gives every param group group 0's
    hyper-parameters: the plan says so (a note, a warning, or a refusal with --target-stage 3)."""
    try:
        if nproc is not None and not output.under_torchrun():
            code = output.launch_nproc(nproc)  # the job's rank 0 printed the result
            if code:
                raise typer.Exit(code)
            return None
        return _to_universal(
            ckpt,
            out,
            workers,
            dry_run,
            tp_layout,
            pattern,
            tp_replicated,
            target_stage,
            verify,
            yes,
            distributed or output.under_torchrun(),
            json_out,
            allow_unread,
            trust_pickles,
            restart,
        )
    except CkptError as e:  # the same error (class, path, hint), its message naming the command
        if e.message.startswith(("ckpt to-universal:", "ckpt to-universal needs")):
            raise
        named = type(e).__new__(type(e))
        CkptError.__init__(named, f"ckpt to-universal: {e.message}", path=e.path, hint=e.hint)
        raise named from e


def _to_universal(
    ckpt,
    out,
    workers,
    dry_run,
    tp_layout,
    pattern,
    tp_replicated,
    target_stage,
    verify,
    yes,
    distributed,
    json_out,
    allow_unread=False,
    trust_pickles=False,
    restart=False,
) -> None:
    _refuse_out_inside(ckpt, out)
    output.require("torch", "deepspeed", extra="convert", what="ckpt to-universal")
    from ckpt_tools.ops import to_universal as ops

    try:
        plan = ops.plan_to_universal(
            ckpt,
            out,
            tp_layout=tp_layout,
            patterns=pattern or (),
            tp_replicated=tp_replicated,
            target_stage=target_stage,
            allow_unread=allow_unread,
            trust_pickles=trust_pickles,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e))
    if dry_run:
        if os.environ.get("RANK", "0") == "0" or not output.under_torchrun():  # one plan for the whole job
            _show_plan(plan, json_out)
        return
    rank = 0
    if distributed:  # ckpt_cli.main.main leaves the group (ckpt_tools.train.procgroup.leave) once the command returns
        from ckpt_tools.train import procgroup

        rank = procgroup.join("gloo")
    # no deepspeed import around the conversion: it reads its records with pickle_reader and writes them with
    # torch_zip, and importing DeepSpeed alone (to route its log lines above the bar) costs ~2 s and ~220 MiB
    with _bar(sum(j.nbytes for j in plan.params), json_out or rank != 0, "to-universal") as bar:
        res = ops.execute(
            plan, workers=workers, progress=bar.update, distributed=distributed, restart=restart, verify=verify
        )
    if rank != 0:
        return
    if json_out:
        output.print_json(
            {
                "out": str(res.out),
                "tag": res.tag,
                "params": res.params,
                "bytes_written": res.bytes_written,
                "files": res.files,
                "notes": list(plan.notes),
                "warnings": list(plan.warnings),
                "optimizer_state": list(plan.state_keys),
                "loads_at_zero_stages": list(plan.stages),
                "verified": bool(verify),
                **({"converted": res.converted, "resumed": res.resumed, "ranks": list(res.ranks)} if res.ranks else {}),
            }
        )
        return
    con = output.console()
    con.print(
        "[green]wrote[/] "
        + escape(
            f"{res.out}  (tag {res.tag}: {output.plural(res.params, 'parameter')}, {output.plural(res.files, 'file')}, "
            f"{res.bytes_written:,} tensor bytes; optimizer state: {', '.join(plan.state_keys) or 'none'})"
        )
    )
    for line in output.job_lines(res.resumed, res.converted, res.ranks):
        con.print(escape(line))
    if verify:
        con.print(
            "  verified: equal to the source by logical parameter (fp32 masters, optimizer state, "
            "param groups, counters)"
        )
    for n in plan.notes:
        con.print(f"  note: {escape(n)}")
    for w in plan.warnings:
        con.print(f"  [yellow]warning:[/] {escape(w)}")
    con.print(
        escape(f'  load it with {{"checkpoint": {{"load_universal": true}}}} and engine.load_checkpoint("{res.out}")')
    )


def _show_plan(plan, json_out: bool) -> None:
    doc = plan.to_json()
    if json_out:
        output.print_json(doc)
        return
    from rich.table import Table

    con = output.console()
    con.print(
        "[bold]to-universal (dry run)[/] "
        + escape(
            f"{plan.source} -> {plan.out}/{plan.out_tag}  ({doc['files']} files, {doc['bytes']:,} bytes; "
            f"TP layout: {plan.layout})"
        )
    )
    t = Table(show_edge=False)
    for col in ("parameter", "shape", "merge", "why", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for p in doc["params"]:
        t.add_row(*map(escape, (p["name"], "×".join(map(str, p["shape"])), p["merge"], p["how"])), f"{p['bytes']:,}")
    con.print(t)
    con.print("copied: " + escape(", ".join(doc["model_files"])))
    con.print(
        escape(
            f"optimizer state: {', '.join(plan.state_keys) or 'none'}; written for ZeRO stage "
            f"{'/'.join(map(str, plan.stages))} loaders"
        )
    )
    for n in plan.notes:
        con.print(f"note: {escape(n)}")
    for w in plan.warnings:
        con.print(f"[yellow]warning:[/] {escape(w)}")


def _refuse_out_inside(ckpt: str, out: str) -> None:
    """OUT inside the source checkpoint would change the checkpoint being read (and the next `ckpt inspect`
    of it would find a universal checkpoint among its files). An OUT that exists (a parent of the source
    among them) is refused by `ops.to_universal`."""
    src, dst = Path(ckpt).resolve(), Path(out).resolve()
    if dst == src or src in dst.parents:
        raise CkptError(
            f"OUT {out} is inside the checkpoint {ckpt}",
            path=out,
            hint="write the universal checkpoint to a new folder outside it",
        )


def register(app: typer.Typer) -> None:
    app.command("to-universal")(to_universal_cmd)
