"""`ckpt to-universal CKPT OUT`: a thin wrapper over `ckpt_tools.ops.to_universal` (plan -> dry-run table or
execute -> summary). `ckpt export` lives in `cli/export.py`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from ckpt_tools.errors import CkptError

from . import output


def _bar(total: int, disable: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=disable, leave=False)


def to_universal_cmd(
    ckpt: str = typer.Argument(..., metavar="PATH", help="DeepSpeed ZeRO, Megatron-DeepSpeed pipeline or "
                               "Accelerate+DeepSpeed checkpoint (tag folder or its parent with `latest`)"),
    out: str = typer.Argument(..., metavar="OUT", help="new folder outside PATH: OUT/latest_universal + "
                              "OUT/<tag>_universal/ (load it with \"checkpoint\": {\"load_universal\": true})"),
    workers: int = typer.Option(min(8, os.cpu_count() or 1), "--workers", "-w", metavar="N",
                                help="parallel writer threads"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be written and how TP shards merge"),
    tp_layout: Optional[str] = typer.Option(None, "--tp-layout", metavar="NAME", help="named TP merge preset when "
                                            "the checkpoint has no universal_checkpoint_info: megatron"),
    pattern: Optional[List[str]] = typer.Option(None, "--pattern", metavar="REGEX=MERGE", help="MERGE: replicated, "
                                                "average, cat:0, cat:1; asked before any other rule (repeatable)"),
    tp_replicated: Optional[str] = typer.Option(None, "--tp-replicated", metavar="METHOD", help="when TP replicas "
                                                "differ: average or rank0 (default: stop)"),
    target_stage: Optional[int] = typer.Option(None, "--target-stage", metavar="N", help="write only what this "
                                               "ZeRO stage's loader reads (default: 1, 2 and 3)"),
    distributed: bool = typer.Option(False, "--distributed", help="under torchrun: each rank converts a share "
                                                                  "of the parameters (one shared filesystem)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Convert to DeepSpeed's universal checkpoint: loads at any DP/TP/PP size and ZeRO stage."""
    _refuse_out_inside(ckpt, out)
    output.require("torch", "deepspeed", extra="convert", what="ckpt to-universal")
    from ckpt_tools.ops import to_universal as ops

    try:
        plan = ops.plan_to_universal(ckpt, out, tp_layout=tp_layout, patterns=pattern or (),
                                     tp_replicated=tp_replicated, target_stage=target_stage)
    except ValueError as e:
        raise typer.BadParameter(str(e))
    if dry_run:
        _show_plan(plan, json_out)
        return
    rank = 0
    if distributed:  # cli.main.main leaves the group (ckpt_tools.procgroup.leave) once the command returns
        from ckpt_tools import procgroup

        rank = procgroup.join("gloo")
    with output.deepspeed_logs_above_bars(), \
            _bar(sum(j.nbytes for j in plan.params), json_out or rank != 0, "to-universal") as bar:
        res = ops.execute(plan, workers=workers, progress=bar.update, distributed=distributed)
    if rank != 0:
        return
    if json_out:
        output.print_json({"out": str(res.out), "tag": res.tag, "params": res.params,
                           "bytes_written": res.bytes_written, "files": res.files, "notes": list(plan.notes)})
        return
    con = output.console()
    con.print(f"[green]wrote[/] {res.out}  (tag {res.tag}: {output.plural(res.params, 'parameter')}, "
              f"{output.plural(res.files, 'file')}, {res.bytes_written:,} tensor bytes)")
    for n in plan.notes:
        con.print(f"  note: {n}")
    con.print(f"  load it with {{\"checkpoint\": {{\"load_universal\": true}}}} and engine.load_checkpoint(\"{res.out}\")")


def _show_plan(plan, json_out: bool) -> None:
    doc = plan.to_json()
    if json_out:
        output.print_json(doc)
        return
    from rich.table import Table

    con = output.console()
    con.print(f"[bold]to-universal (dry run)[/] {plan.source} -> {plan.out}/{plan.out_tag}  "
              f"({doc['files']} files, {doc['bytes']:,} bytes; TP layout: {plan.layout})")
    t = Table(show_edge=False)
    for col in ("parameter", "shape", "merge", "why", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for p in doc["params"]:
        t.add_row(p["name"], "×".join(map(str, p["shape"])), p["merge"], p["how"], f"{p['bytes']:,}")
    con.print(t)
    con.print("copied: " + ", ".join(doc["model_files"]))
    for n in plan.notes:
        con.print(f"note: {n}")


def _refuse_out_inside(ckpt: str, out: str) -> None:
    """OUT inside the source checkpoint would change the checkpoint being read (and the next `ckpt inspect`
    of it would find a universal checkpoint among its files). An OUT that exists (a parent of the source
    among them) is refused by `ops.to_universal`."""
    src, dst = Path(ckpt).resolve(), Path(out).resolve()
    if dst == src or src in dst.parents:
        raise CkptError(f"OUT {out} is inside the checkpoint {ckpt}", path=out,
                        hint="write the universal checkpoint to a new folder outside it")


def register(app: typer.Typer) -> None:
    app.command("to-universal")(to_universal_cmd)
