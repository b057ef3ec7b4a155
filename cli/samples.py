"""`ckpt samples make DIR`: regenerate the sample checkpoints with the real frameworks (CPU, gloo)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from . import output

samples_app = typer.Typer(help="The bundled sample checkpoints.", no_args_is_help=True)


@samples_app.command("make", cls=output.Command)
def make_cmd(
    out_dir: Path = typer.Argument(Path("sample_ckpts"), metavar="DIR", help="where to write the samples"),
    only: Optional[List[str]] = typer.Option(
        None, "--only", metavar="NAME", help="a sample name from `ckpt samples list` (repeatable); default: all"
    ),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir", metavar="DIR", help="keep each worker's log here"),
) -> None:
    """Train tiny models with DeepSpeed / FSDP / Accelerate on CPU and save every sample checkpoint."""
    from ckpt_tools.errors import CkptError
    from ckpt_tools.samples import SAMPLES, make_sample

    known = [s.name for s in SAMPLES]
    unknown = [n for n in only or () if n not in known]
    if unknown:
        raise CkptError(f"--only {', '.join(unknown)}: no such sample", hint="`ckpt samples list` shows the names")
    output.require(
        "torch",
        "deepspeed",
        "accelerate",
        "transformers",
        "lightning",
        "safetensors",
        extra="train",
        what="ckpt samples make",
    )
    from tqdm import tqdm

    names = only or known
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    for name in tqdm(names, desc="samples", unit="sample"):
        path = make_sample(out_dir, name, log_dir=log_dir)
        tqdm.write(f"{name}: {path}")


@samples_app.command("list", cls=output.Command)
def list_cmd() -> None:
    """List the samples and the worker that makes each."""
    from ckpt_tools.samples import SAMPLES

    for s in SAMPLES:
        typer.echo(f"{s.name:24s} {s.group}/{s.path:28s} {s.module} x{s.nproc}")


def register(app: typer.Typer) -> None:
    app.add_typer(samples_app, name="samples")
