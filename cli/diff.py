"""`ckpt diff A B`: a thin wrapper over `ckpt_tools.ops.diff` (exit 0 same, 1 they differ, 2 unusable input)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from . import output
from .output import escape


def diff_cmd(
    before: Path = typer.Argument(..., help="checkpoint (file or folder) before"),
    after: Path = typer.Argument(..., help="checkpoint (file or folder) after"),
    atol: float = typer.Option(0.0, "--atol", min=0.0, help="absolute tolerance (default 0: bit-exact)"),
    rtol: float = typer.Option(0.0, "--rtol", min=0.0, help="relative tolerance (torch.allclose semantics)"),
    logical: bool = typer.Option(
        False,
        "--logical",
        help="compare by logical parameter and optimizer state (the default when A and B differ in format or topology)",
    ),
    files: bool = typer.Option(
        False, "--files", help="compare file by file (the default for two checkpoints of the same format and topology)"
    ),
    json_out: bool = typer.Option(False, "--json", help="machine-readable report"),
    n_kv_heads: Optional[int] = typer.Option(
        None,
        "--n-kv-heads",
        metavar="N",
        help="logical: compare a "
        "torchtitan fused wqkv's Adam state split into wq/wk/wv (the "
        "model's KV heads order its rows), as convert carries it",
    ),
) -> int:
    """What changed between two checkpoints, field by field and tensor by tensor. Exit 1 when they differ.

    Across formats or topologies (a ZeRO checkpoint and its universal output, its export, a DCP copy) the
    comparison is by logical parameter: model tensors, optimizer state, param groups and counters."""

    from ckpt_tools.ops import diff as ops

    if logical and files:
        raise typer.BadParameter("give --logical or --files, not both", param_hint="--logical")
    mode = "logical" if logical else "files" if files else "auto"
    with _bar(json_out) as bar:
        report = ops.diff(before, after, atol, rtol, mode=mode, progress=bar.update, n_kv_heads=n_kv_heads)
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
        con.print(f"      {escape(fieldname) or '(file)'}  {escape(output.short_numbers(what))}", soft_wrap=True)
    for n in report.notes:
        con.print(f"  note: {escape(n)}", soft_wrap=True)
    counted = f"{output.plural(report.files_compared, 'file')}, " if report.mode == "files" else "by logical name: "
    summary = f"{counted}{output.plural(report.tensors_compared, 'tensor')} compared ({report.tensors_read} read)" + (
        f", {report.within_tolerance} within tolerance" if report.within_tolerance else ""
    )
    if report.same:
        con.print(f"[green]same[/]: {escape(summary)}")
    else:
        con.print(f"[red]{len(report.differences)} differences[/]: {escape(summary)}")
    return 0 if report.same else 1


def _bar(disable: bool):
    from tqdm import tqdm

    return tqdm(unit="tensor", desc="diff", disable=disable or None, leave=False)


def register(app: typer.Typer) -> None:
    app.command("diff")(diff_cmd)
