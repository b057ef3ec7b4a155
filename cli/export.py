"""`ckpt export CKPT OUT`: a thin wrapper over `ckpt_tools.ops.export` (plan -> dry-run table or execute -> summary)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ckpt_tools.errors import CkptError

from . import output
from .to_universal import _bar


def export_cmd(
    ckpt: str = typer.Argument(..., metavar="PATH", help="checkpoint to export"),
    out: str = typer.Argument(..., metavar="OUT", help="OUT.safetensors in an existing folder (sharded: "
                              "OUT-0000i-of-0000N.safetensors + index json)"),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="DTYPE", help="bf16, fp16 or fp32 (default: as "
                                        "stored)"),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", metavar="SIZE", help="with a unit: "
                                                 "5GB, 500MB, 2GiB; default one file"),
    source: str = typer.Option("fp32", "--source", metavar="WEIGHTS", help="fp32 (the fp32 master, like "
                               "zero_to_fp32) or module"),
    tp_layout: Optional[str] = typer.Option(None, "--tp-layout", metavar="NAME", help="megatron (TP checkpoints "
                                            "without info)"),
    pattern: Optional[List[str]] = typer.Option(None, "--pattern", metavar="REGEX=MERGE", help="TP merge "
                                                "overrides (repeatable)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the files that would be written"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Write consolidated model weights as safetensors (loadable by safetensors.torch.load_file)."""
    folder = Path(out).parent
    if not folder.is_dir():
        raise CkptError(f"the folder {folder} does not exist", path=out, hint=f"create it first: mkdir -p {folder}")
    if max_shard_size is not None and max_shard_size.strip().isdigit():
        n = int(max_shard_size)
        raise CkptError(f"--max-shard-size {max_shard_size}: give a unit, e.g. {n}GB or {n}MB (a bare number would "
                        f"be {output.plural(n, 'byte')} per file)", hint=f"for bytes say so: {n}B")
    output.require("torch", extra="convert", what="ckpt export")
    from ckpt_tools.ops import export as ops

    try:
        size = ops.parse_size(max_shard_size) if max_shard_size else None
        plan = ops.plan_export(ckpt, out, dtype=dtype, max_shard_size=size, source_weights=source,
                               tp_layout=tp_layout, patterns=pattern or ())
    except ValueError as e:
        raise typer.BadParameter(str(e))
    if dry_run:
        if json_out:
            output.print_json(plan.to_json())
        else:
            con = output.console()
            for f in plan.to_json()["files"]:
                con.print(f"{f['path']}: {output.plural(f['tensors'], 'tensor')}, {f['bytes']:,} bytes "
                          f"({plan.weights_from})")
        return
    with _bar(plan.nbytes, json_out, "export") as bar:
        res = ops.execute(plan, progress=bar.update)
    doc = {"files": [str(f) for f in res.files], "index": str(res.index) if res.index else None,
           "tensors": res.tensors, "bytes": res.bytes, "weights_from": plan.weights_from}
    if json_out:
        output.print_json(doc)
    else:
        output.console().print(f"[green]wrote[/] {', '.join(doc['files'])}"
                               + (f" + {doc['index']}" if doc["index"] else "")
                               + f"  ({output.plural(res.tensors, 'tensor')}, {res.bytes:,} bytes, "
                                 f"{plan.weights_from})")


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
