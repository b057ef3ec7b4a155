"""`ckpt samples make DIR`: regenerate the sample checkpoints with the real frameworks (CPU, gloo)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

samples_app = typer.Typer(help="The bundled sample checkpoints.", no_args_is_help=True)


@samples_app.command("make")
def make_cmd(
    out_dir: Path = typer.Argument(Path("sample_ckpts"), help="where to write the samples"),
    only: Optional[List[str]] = typer.Option(None, "--only", help="sample names (repeatable); default: all"),
    log_dir: Optional[Path] = typer.Option(None, "--log-dir", help="keep each worker's log here"),
) -> None:
    """Train tiny models with DeepSpeed / FSDP / Accelerate on CPU and save every sample checkpoint."""
    from tqdm import tqdm

    from ckpt_tools.samples import SAMPLES, make_sample

    names = only or [s.name for s in SAMPLES]
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    for name in tqdm(names, desc="samples", unit="sample"):
        path = make_sample(out_dir, name, log_dir=log_dir)
        tqdm.write(f"{name}: {path}")


@samples_app.command("list")
def list_cmd() -> None:
    """List the samples and the worker that makes each."""
    from ckpt_tools.samples import SAMPLES

    for s in SAMPLES:
        typer.echo(f"{s.name:24s} {s.group}/{s.path:28s} {s.module} x{s.nproc}")


def register(app: typer.Typer) -> None:
    app.add_typer(samples_app, name="samples")
