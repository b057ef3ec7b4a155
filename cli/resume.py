"""`ckpt resume CKPT --steps N`: train a few real steps from a checkpoint and say whether the run continued.

Exit codes: 0 every check passed (or was not available), 1 a check failed, 2 unusable input.
"""

from __future__ import annotations

import importlib.util
import json
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer

from ckpt_tools.errors import CkptError

from . import output
from .output import escape

if TYPE_CHECKING:
    from ckpt_tools.resume.frameworks import ResumeResult


def _ops():
    """`ckpt_tools.resume.frameworks`, imported when `ckpt resume` runs."""
    # lazy: the resume planners and runners import most of ckpt_tools; every other command and `ckpt --help` start
    # without them
    from ckpt_tools.resume import frameworks

    return frameworks


_PATH = typer.Argument(
    ...,
    metavar="PATH",
    help="checkpoint: DeepSpeed (folder with `latest`, tag "
    "folder, universal), HF Trainer checkpoint-N or output_dir, Accelerate folder, DCP "
    "folder, Lightning .ckpt, Megatron-LM run or iter_N folder",
)
_STEPS = typer.Option(10, "--steps", "-n", metavar="N", help="optimizer steps to train after loading")
_NPROC = typer.Option(
    None,
    "--nproc",
    metavar="N",
    help="processes (default: the checkpoint's DP x TP x PP; with --universal on CUDA, every visible GPU)",
)
_DEVICE = typer.Option(
    "auto", "--device", metavar="DEVICE", help="auto (CUDA/NCCL if a GPU is visible, else CPU/gloo), cuda or cpu"
)
_UNIVERSAL = typer.Option(
    False,
    "--universal",
    help="load through a DeepSpeed universal checkpoint "
    "(converted into a scratch folder first unless CKPT already is one)",
)
_TP = typer.Option(None, "--tp", metavar="N", help="tensor-parallel size to resume at (implies --universal)")
_PP = typer.Option(None, "--pp", metavar="N", help="pipeline-parallel size to resume at (implies --universal)")
_MODEL = typer.Option(
    "auto",
    "--model",
    metavar="MODEL",
    help="auto (a bundled model when the checkpoint "
    "is one, else the model-free check), replica (model-free: a replica of the "
    "checkpoint's parameters, synthetic loss, optimizer state checked), tiny-gpt, "
    "megatron-gpt or module:function (a factory returning "
    "ckpt_tools.resume.workers.deepspeed.TrainSetup)",
)
_DATA = typer.Option(
    None,
    "--data",
    metavar="FILE",
    help="token file (.bin uint16 or .npy) instead of the deterministic synthetic batches",
)
_CONFIG = typer.Option(
    None,
    "--config",
    metavar="JSON",
    help="JSON file merged over the "
    "checkpoint's ds_config (the whole config where it holds none: a "
    "universal converted from another framework)",
)
_REFERENCE = typer.Option(
    None,
    "--reference",
    metavar="JSON",
    help="JSON of the uninterrupted run (--record-reference output or a sample manifest)",
)
_RECORD_REFERENCE = typer.Option(
    None, "--record-reference", metavar="JSON", help="write this run's per-step records as a reference JSON"
)
_LOSS_TOL = typer.Option(1e-3, "--loss-tol", metavar="X", help="max |loss - reference loss| per step")
_JUMP_TOL = typer.Option(
    0.1,
    "--jump-tol",
    metavar="X",
    help="without --reference: allowed relative rise of the first loss over a loss saved in the client state",
)
_WORK_DIR = typer.Option(
    None,
    "--work-dir",
    metavar="DIR",
    help="keep scratch files (universal conversion, worker plan) here instead of a temporary folder",
)
_PLOT = typer.Option(None, "--plot", metavar="PNG", help="PNG of loss and LR per step (needs matplotlib)")
_JSON_OUT = typer.Option(False, "--json", help="machine-readable result")
_QUIET = typer.Option(False, "--quiet", "-q", help="verdict only")
_TRUST_PICKLES = typer.Option(
    False,
    "--trust-pickles",
    help="resume even when a pickle names globals outside the frameworks' classes (DeepSpeed's loader runs them)",
)
_SCHEDULER = typer.Option(
    None,
    "--scheduler",
    metavar="MODULE:FUNCTION",
    help="the function of a LambdaLR (step -> factor, or a list per param group): the checkpoint does not hold it",
)
_NO_SCHEDULER = typer.Option(
    False,
    "--no-scheduler",
    help="the run had no LR scheduler: param groups "
    "that carry initial_lr with no scheduler state saved then train at the "
    "saved LR, constant; without it the learning-rate check fails on them (the "
    "real run would restart its schedule)",
)
_AGAINST = typer.Option(
    None,
    "--against",
    metavar="CKPT",
    help="model-free check: take the "
    "saved optimizer state from CKPT (e.g. the ZeRO checkpoint a universal "
    "one was converted from) instead of PATH",
)
_N_KV_HEADS = typer.Option(
    None,
    "--n-kv-heads",
    metavar="N",
    help="the model's KV heads: "
    "orders the Adam state of a fused wqkv torchtitan saved with its "
    "weights split (wq/wk/wv)",
)
_MEGATRON_ARGS = typer.Option(
    None,
    "--megatron-args",
    metavar="FLAGS",
    help="Megatron-LM: "
    "your relaunch flags, one string, added after the ones rebuilt "
    "from the checkpoint's args (e.g. '--use-checkpoint-opt_param-"
    "scheduler'); the expected LR takes them into account",
)


def resume_cmd(
    path: str = _PATH,
    steps: int = _STEPS,
    nproc: Optional[int] = _NPROC,
    device: str = _DEVICE,
    universal: bool = _UNIVERSAL,
    tp: Optional[int] = _TP,
    pp: Optional[int] = _PP,
    model: str = _MODEL,
    data: Optional[str] = _DATA,
    config: Optional[Path] = _CONFIG,
    reference: Optional[Path] = _REFERENCE,
    record_reference: Optional[Path] = _RECORD_REFERENCE,
    loss_tol: float = _LOSS_TOL,
    jump_tol: float = _JUMP_TOL,
    work_dir: Optional[Path] = _WORK_DIR,
    plot: Optional[Path] = _PLOT,
    json_out: bool = _JSON_OUT,
    quiet: bool = _QUIET,
    trust_pickles: bool = _TRUST_PICKLES,
    scheduler: Optional[str] = _SCHEDULER,
    no_scheduler: bool = _NO_SCHEDULER,
    against: Optional[Path] = _AGAINST,
    n_kv_heads: Optional[int] = _N_KV_HEADS,
    megatron_args: Optional[str] = _MEGATRON_ARGS,
) -> None:
    """Load PATH into the framework that wrote it, train N steps, and check that counters, LR, optimizer state
    (model-free) and loss (with a model) continue."""
    output.require("torch", extra="train", what="ckpt resume")
    if plot is not None:
        output.require("matplotlib", extra="all", what="--plot")
    override = _read_config(config)
    ref = _ops().load_reference(reference) if reference else None
    plan = _ops().plan_resume(
        path,
        steps=steps,
        nproc=nproc,
        device=device,
        universal=universal,
        tp=tp,
        pp=pp,
        model=model,
        config=override,
        data=data,
        trust_pickles=trust_pickles,
        scheduler=scheduler,
        against=against,
        n_kv_heads=n_kv_heads,
        framework_args=megatron_args,
        no_scheduler=no_scheduler,
    )
    _require_framework(plan)
    result = _run(
        plan, steps, json_out or quiet, reference=ref, loss_tol=loss_tol, jump_tol=jump_tol, work_dir=work_dir
    )
    if record_reference is not None:
        record_reference.write_text(json.dumps(_ops().reference_doc(result), indent=1) + "\n")
    if plot is not None:
        _plot(result, plot, ref)
    if json_out:
        output.print_json(result.to_dict())
    else:
        _render(result, quiet)
    if not result.ok:
        raise typer.Exit(1)


def _read_config(config: Path | None) -> dict[str, Any] | None:
    """--config: the JSON merged over the checkpoint's ds_config (None without it)."""
    if config is None:
        return None
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"cannot read the config: {e}", path=config) from None


def _require_framework(plan: Any) -> None:
    """The framework the plan runs is installed: megatron-core for Megatron-LM's own training code (no DeepSpeed),
    DeepSpeed for every other resume."""
    if getattr(plan, "framework", None) == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            raise CkptError(
                "resuming a Megatron-LM checkpoint needs megatron-core",
                hint="pip install megatron-core (the release that wrote the checkpoint: 0.16.1 for "
                "Megatron-LM core_v0.16.1)",
            )
    else:
        output.require("deepspeed", extra="train", what="ckpt resume")


def _run(plan: Any, steps: int, quiet_bar: bool, **run: Any) -> ResumeResult:
    """`run_resume` under a progress bar (none with --json / --quiet): converting, starting, one tick per step."""
    # a conversion runs in this process and imports DeepSpeed, which logs to the terminal: its lines go above
    # the bar, not into it (imported before the bar is drawn, so its import-time line comes first)
    converting = getattr(plan, "convert_from", None) is not None
    logs = output.deepspeed_logs_above_bars() if converting and not quiet_bar else nullcontext()
    from tqdm import tqdm  # lazy: the bar only when a resume runs

    bar = tqdm(
        total=steps,
        desc=f"starting {output.plural(plan.nproc, 'process', 'processes')}",
        unit="step",
        disable=quiet_bar,
        leave=False,
    )

    def on_event(ev: dict) -> None:
        if ev["event"] == "converting":
            bar.set_description("converting to universal")
        elif ev["event"] == "loaded":
            # the clock starts here: conversion, process start-up and the engine's load are not step time
            bar.reset(total=steps)
            bar.set_description(f"resume from step {ev.get('global_step', '?')}")
        elif ev["event"] == "step":
            bar.update(1)
            lr = ev.get("lr") or [float("nan")]
            bar.set_postfix(step=ev.get("step"), loss=f"{ev.get('loss', float('nan')):.4f}", lr=f"{lr[0]:.3g}")

    try:
        with logs:
            return _ops().run_resume(plan, on_event=on_event, **run)
    finally:
        bar.close()


def _render(result: ResumeResult, quiet: bool) -> None:
    from rich.table import Table  # lazy: rich's tables only for the verdict a person reads

    con = output.console()
    p = result.plan
    s = getattr(p, "saved", None)
    f = output.fmt_value

    def topo(obj) -> str:  # other frameworks' plans may not carry a DP x TP x PP layout
        return " ".join(f"{k}={getattr(obj, k)}" for k in ("dp", "tp", "pp") if getattr(obj, k, None) is not None)

    if not quiet:
        fmt = getattr(s, "format", None) or getattr(p, "framework", "")
        con.print(
            f"[bold]{escape(str(p.path))}[/]  "
            + escape(
                f"{fmt}  saved at global_step={f(getattr(s, 'global_step', None))} "
                f"adam_step={f(getattr(s, 'optimizer_step', None))}  {topo(s)}"
            )
        )
        extras = "".join(f"  {k}={getattr(p, k)}" for k in ("micro_batch",) if getattr(p, k, None) is not None)
        if getattr(p, "gas", None) is not None:
            extras += f" accumulation={p.gas}"
        con.print(
            escape(
                f"resumed on {p.nproc} {p.device} {'process' if p.nproc == 1 else 'processes'}: "
                f"{topo(p)}  model={p.model}{'  universal' if getattr(p, 'universal', False) else ''}{extras}"
            )
        )
        for note in getattr(p, "notes", ()):
            con.print(f"  [yellow]note[/]: {escape(note)}")
        t = Table(show_edge=False)
        for col in ("step", "loss", "lr", "grad norm", "adam step", "tokens/s"):
            t.add_column(col, justify="right")
        for r in result.records:
            t.add_row(
                str(r.step),
                f"{r.loss:.6f}",
                escape(f(list(r.lr))),
                f"{r.grad_norm:.4g}" if r.grad_norm else "—",
                f(r.optimizer_step),
                f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "—",
            )
        con.print(t)
    v = Table(show_edge=False, title="verdict")
    v.add_column("check")
    v.add_column("result")
    v.add_column("detail")
    style = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "n/a": "[dim]n/a[/]"}
    for c in result.checks:
        v.add_row(escape(c.name), style[c.status], escape(c.detail))
    con.print(v)


def _plot(result: ResumeResult, path: Path, ref: dict[int, float] | None) -> None:
    import matplotlib  # lazy: matplotlib only for --plot (an optional extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen

    steps = [r.step for r in result.records]
    fig, (a, b) = plt.subplots(2, 1, sharex=True, figsize=(6, 5))
    a.plot(steps, [r.loss for r in result.records], "o-", label="resumed")
    if ref:
        rs = sorted(ref)
        a.plot(rs, [ref[k] for k in rs], "x--", label="reference")
    a.axvline(getattr(getattr(result.plan, "saved", None), "global_step", None) or 0, color="grey", lw=0.8)
    a.set_ylabel("loss")
    a.legend()
    b.plot(steps, [r.lr[0] for r in result.records], "o-")
    b.set_ylabel("lr (group 0)")
    b.set_xlabel("global step")
    fig.savefig(path, dpi=100)


def register(app: typer.Typer) -> None:
    app.command("resume")(resume_cmd)
