"""`ckpt export CKPT OUT`: a thin wrapper over `ckpt_tools.ops.export` (plan -> dry-run table or execute -> summary;
under torchrun every rank runs it and rank 0 alone prints)."""

from __future__ import annotations

import json

import os
from pathlib import Path
from typing import List, Optional

import typer

from ckpt_tools.errors import CkptError

from . import output
from .output import escape
from .to_universal import _bar


def _named(e: CkptError) -> CkptError:
    """The same error, its message naming the command."""
    if e.message.startswith("ckpt export"):
        return e
    new = type(e).__new__(type(e))
    CkptError.__init__(new, f"ckpt export: {e.message}", path=e.path, hint=e.hint)
    return new


def export_cmd(
    ckpt: str = typer.Argument(..., metavar="PATH", help="checkpoint to export (any format ckpt reads)"),
    out: str = typer.Argument(
        ...,
        metavar="OUT",
        help="OUT.safetensors in an existing folder (sharded: "
        "OUT-0000i-of-0000N.safetensors + index json); with --hf a new folder",
    ),
    hf: bool = typer.Option(
        False,
        "--hf",
        help="write a folder from_pretrained loads: model[-0000i-of-0000N]"
        ".safetensors + index, config.json / generation_config.json copied, tied aliases "
        "left out as save_pretrained does",
    ),
    hf_config: Optional[Path] = typer.Option(
        None,
        "--hf-config",
        metavar="CONFIG.json",
        help="with --hf: the "
        "model's Hugging Face config.json (or its folder) to copy; needed for "
        "a torchtitan Llama, whose names and q/k layout are mapped with it",
    ),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", metavar="DTYPE", help="bf16, fp16 or fp32 (default: as stored)"
    ),
    max_shard_size: Optional[str] = typer.Option(
        None, "--max-shard-size", metavar="SIZE", help="with a unit: 5GB, 500MB, 2GiB; default one file"
    ),
    source: str = typer.Option(
        "fp32", "--source", metavar="WEIGHTS", help="fp32 (the fp32 master where saved, like zero_to_fp32) or module"
    ),
    dedupe_tied: bool = typer.Option(
        False, "--dedupe-tied", help="write a tied parameter once (default: under every name, as zero_to_fp32 does)"
    ),
    exclude_frozen: bool = typer.Option(False, "--exclude-frozen", help="leave out parameters that do not train"),
    include: Optional[List[str]] = typer.Option(
        None, "--include", metavar="REGEX", help="only names matching (repeatable)"
    ),
    exclude: Optional[List[str]] = typer.Option(
        None, "--exclude", metavar="REGEX", help="leave out names matching (repeatable)"
    ),
    tp_layout: Optional[str] = typer.Option(
        None, "--tp-layout", metavar="NAME", help="megatron (TP checkpoints without info)"
    ),
    pattern: Optional[List[str]] = typer.Option(
        None, "--pattern", metavar="REGEX=MERGE", help="TP merge overrides (repeatable)"
    ),
    model: int = typer.Option(
        0,
        "--model",
        metavar="N",
        min=0,
        help="which model of a checkpoint with several "
        "(Accelerate's model_1.safetensors ...: --model 1); default the first",
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="re-read the written files and compare them with the "
        "checkpoint tensor for tensor before putting them in place",
    ),
    nproc: Optional[int] = typer.Option(
        None,
        "--nproc",
        metavar="M",
        min=1,
        help="run as M processes on this machine (launches torchrun --standalone itself); under torchrun each "
        "rank writes a share of the tensors, the same bytes as one process, and a rerun resumes",
    ),
    restart: bool = typer.Option(False, "--restart", help=output.RESTART_HELP),
    dry_run: bool = typer.Option(False, "--dry-run", help="show the files that would be written"),
    yes: bool = typer.Option(False, "--yes", "-y", help="do not ask (export writes only new files, so it never asks)"),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
    allow_unread: bool = typer.Option(False, "--allow-unread", help=output.ALLOW_UNREAD_HELP),
    trust_pickles: bool = typer.Option(False, "--trust-pickles", help=output.TRUST_PICKLES_HELP),
) -> None:
    """Write consolidated model weights as safetensors (loadable by safetensors.torch.load_file; with --hf by
    transformers' from_pretrained). Under torchrun (or with --nproc M) every rank writes a share of the tensors."""
    job = output.under_torchrun()
    folder = Path(out).parent
    if not folder.is_dir():
        raise CkptError(
            f"ckpt export: the folder {folder} does not exist", path=out, hint=f"create it first: mkdir -p {folder}"
        )
    if max_shard_size is not None and max_shard_size.strip().isdigit():
        n = int(max_shard_size)
        raise CkptError(
            f"--max-shard-size {max_shard_size}: give a unit, e.g. {n}GB or {n}MB (a bare number would "
            f"be {output.plural(n, 'byte')} per file)",
            hint=f"for bytes say so: {n}B",
        )
    output.require("torch", extra="convert", what="ckpt export")
    if nproc is not None and not job:
        code = output.launch_nproc(nproc)  # the job's rank 0 printed the result
        if code:
            raise typer.Exit(code)
        return
    from ckpt_tools.ops import export as ops

    try:
        try:
            size = ops.parse_size(max_shard_size) if max_shard_size else None
            plan = ops.plan_export(
                ckpt,
                out,
                dtype=dtype,
                max_shard_size=size,
                source_weights=source,
                tp_layout=tp_layout,
                patterns=pattern or (),
                hf=hf,
                tied="dedupe" if dedupe_tied else ("all" if not hf else "dedupe"),
                include_frozen=not exclude_frozen,
                include=include or None,
                exclude=exclude or None,
                model=model,
                allow_unread=allow_unread,
                hf_config=hf_config,
                trust_pickles=trust_pickles,
            )
        except ValueError as e:
            raise typer.BadParameter(str(e))
        doc = plan.to_json()
        if dry_run:
            if job and os.environ.get("RANK", "0") != "0":  # one plan for the whole job
                return
            if json_out:
                output.print_json({**doc, "dry_run": True})
            else:
                con = output.console()
                for f in doc["files"]:
                    con.print(
                        escape(
                            f"{f['path']}: {output.plural(f['tensors'], 'tensor')}, {f['bytes']:,} bytes "
                            f"({plan.weights_from})"
                        )
                    )
                if doc["index"]:
                    con.print(escape(f"{doc['index']}: index"))
                for c in doc["copies"]:
                    con.print(escape(f"{c}: copied"))
                for why, names in doc["left_out"].items():
                    con.print(escape(f"left out ({why}): {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"))
                con.print("dry run: nothing written")
            return
        rank = 0
        if job:  # ckpt_cli.main.main leaves the group (ckpt_tools.train.procgroup.leave) once the command returns
            from ckpt_tools.train import procgroup

            rank = procgroup.join("gloo")
        with _bar(plan.nbytes, json_out or rank != 0, "export") as bar:
            res = ops.execute(plan, progress=bar.update, verify=verify, distributed=job, restart=restart)
    except CkptError as e:
        raise _named(e) from None
    if rank != 0:
        return
    files = [str(plan.out / f.name) if plan.hf else str(f) for f in res.files]
    index = (str(plan.out / res.index.name) if plan.hf else str(res.index)) if res.index else None
    result = {
        "out": str(plan.out),
        "hf": plan.hf,
        "files": files,
        "index": index,
        "copies": [str(c) for c in res.copies],
        "tensors": res.tensors,
        "bytes": res.bytes,
        "kinds": doc["kinds"],
        "left_out": doc["left_out"],
        "weights_from": plan.weights_from,
        **({"hf_architecture": _architecture(plan)} if plan.hf else {}),
        "verified": res.verified,
        **({"converted": res.converted, "resumed": res.resumed, "ranks": list(res.ranks)} if res.ranks else {}),
    }
    if json_out:
        output.print_json(result)
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in doc["kinds"].items())
        output.console().print(
            "[green]wrote[/] "
            + escape(
                f"{plan.out if plan.hf else ', '.join(files)}"
                + (f" + {index}" if index and not plan.hf else "")
                + (f" as {_architecture(plan)}" if plan.hf and _architecture(plan) else "")
                + f"  ({output.plural(res.tensors, 'tensor')}: {kinds}; {res.bytes:,} bytes, {plan.weights_from})"
                + (f"; verified {res.verified} tensors" if res.verified is not None else "")
            )
        )
        for line in output.job_lines(res.resumed, res.converted, res.ranks, "tensor"):
            output.console().print(escape(line))


def _architecture(plan) -> str | None:
    """The transformers class of an `--hf` export: from the config.json written from the checkpoint's own args (a
    Megatron GPT: GPT-2, Llama, Mixtral or Qwen2-MoE), else from the one copied; None when neither names it."""
    config = plan.config
    if config is None:
        copied = next((c for c in plan.copies if c.name == "config.json"), None)
        try:
            config = json.loads(copied.read_text()) if copied is not None else {}
        except (OSError, ValueError):
            config = {}
    names = config.get("architectures") if isinstance(config, dict) else None
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def register(app: typer.Typer) -> None:
    app.command("export")(export_cmd)
