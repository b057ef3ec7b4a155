"""`ckpt convert CKPT OUT --to dcp|torch|deepspeed-universal|megatron`: a thin wrapper over `ckpt_tools.ops.convert`
(plan -> dry-run table or execute -> summary with what could not move). `--to megatron --ckpt-format torch
[--tp N] [--pp N]` writes Megatron-LM's legacy rank files from a torch_dist run. `--to deepspeed-universal` from a
DeepSpeed checkpoint is `ckpt to-universal`."""

from __future__ import annotations

import os
from typing import Optional

import typer

from ckpt_tools.errors import CkptError

from . import output
from .output import escape


def convert_cmd(
    ckpt: str = typer.Argument(
        ...,
        metavar="PATH",
        help="the checkpoint to convert: DeepSpeed ZeRO 1/2/3, "
        "Megatron-DeepSpeed pipeline (TP merged), universal, or any format `ckpt inspect` "
        "reads",
    ),
    out: str = typer.Argument(
        ...,
        metavar="OUT",
        help="new folder (file for --to torch) outside PATH; "
        "universal: OUT/latest_universal + OUT/global_stepN_universal/, loaded with "
        '{"checkpoint": {"load_universal": true}}',
    ),
    to: str = typer.Option(
        ...,
        "--to",
        metavar="TARGET",
        help="dcp (FSDP2 / torchtitan / DCP recipe), torch "
        "(one training dict), deepspeed-universal (from DCP and other non-DeepSpeed formats; "
        "a DeepSpeed source runs `ckpt to-universal`), megatron (between Megatron-LM's two formats, "
        "with the optimizer state: a legacy run as a torch_dist run folder, or with --ckpt-format "
        "torch a torch_dist run as legacy rank files; the way in from a Megatron-DeepSpeed "
        "pipeline, or from a torchtitan Llama with --hf-config)",
    ),
    layout: Optional[str] = typer.Option(
        None,
        "--layout",
        metavar="LAYOUT",
        help="--to dcp: fsdp2 (default: "
        "{model, optim, scheduler, step}), torchtitan ({model, optimizer "
        "(flattened), lr_scheduler, train_state}) or recipe ({app: ...})",
    ),
    ckpt_format: Optional[str] = typer.Option(
        None,
        "--ckpt-format",
        metavar="FORMAT",
        help="--to megatron: "
        "the format to write, as Megatron's own --ckpt-format flag names it: "
        "torch_dist (default; from a legacy run) or torch (the legacy "
        "iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt rank files; from a "
        "torch_dist run)",
    ),
    tp: Optional[int] = typer.Option(
        None,
        "--tp",
        metavar="N",
        help="--to megatron --ckpt-format torch: the "
        "tensor-parallel size of the rank files (default: the saved one); each tensor "
        "split by Megatron's TP rules; N must divide the heads, query groups, FFN size "
        "and padded vocabulary",
    ),
    pp: Optional[int] = typer.Option(
        None,
        "--pp",
        metavar="N",
        help="--to megatron --ckpt-format torch: the "
        "pipeline-parallel size of the rank files (default: the saved one); the layers "
        "cut into N equal stages, each numbered from 0; N must divide the layers (no "
        "virtual pipeline)",
    ),
    ep: Optional[int] = typer.Option(
        None,
        "--ep",
        metavar="N",
        help="--to megatron of a Mixture-of-Experts run (plain Adam, TP 1 x PP 1): the "
        "expert-parallel size written (default: the saved one): legacy rank files per EP rank, "
        "global expert g on EP rank g // (experts / N), or torch_dist's param groups as "
        "Megatron builds them at N; N must divide the experts and the world size",
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="show what would be written and what cannot move"),
    no_verify: bool = typer.Option(
        False, "--no-verify", help="skip the logical comparison with the source before the output is renamed into place"
    ),
    yes: bool = typer.Option(
        False, "--yes", "-y", help="do not ask (convert only writes a new path, atomically, so it never asks)"
    ),
    distributed: bool = typer.Option(
        False,
        "--distributed",
        help="under torchrun (detected from its environment without this flag; every --to): each rank writes a "
        "share of the output balanced by bytes (one shared filesystem), the same bytes as one process; a rerun "
        "resumes",
    ),
    nproc: Optional[int] = typer.Option(
        None,
        "--nproc",
        metavar="M",
        min=1,
        help="run as M processes on this machine (every --to; launches torchrun --standalone itself)",
    ),
    restart: bool = typer.Option(False, "--restart", help=output.RESTART_HELP),
    json_out: bool = typer.Option(False, "--json", help="machine-readable output"),
    allow_unread: bool = typer.Option(False, "--allow-unread", help=output.ALLOW_UNREAD_HELP),
    trust_pickles: bool = typer.Option(False, "--trust-pickles", help=output.TRUST_PICKLES_HELP),
    n_kv_heads: Optional[int] = typer.Option(
        None,
        "--n-kv-heads",
        metavar="N",
        help="the model's KV heads: "
        "splits the Adam state of a fused wqkv torchtitan saved (its rows "
        "are grouped per KV head); with --layout torchtitan, writes wq/wk/wv "
        "state fused as torchtitan's llama3 (fuse_qkv=True) loads it",
    ),
    hf_config: Optional[str] = typer.Option(
        None,
        "--hf-config",
        metavar="CONFIG.json",
        help="--to megatron "
        "from a torchtitan Llama: the model's Hugging Face config.json (or its "
        "folder): head counts, RoPE base and scaling, norm eps, which the "
        "checkpoint does not hold; checked against every tensor's shape",
    ),
    seq_length: Optional[int] = typer.Option(
        None,
        "--seq-length",
        metavar="N",
        min=1,
        help="--to megatron from a "
        "torchtitan Llama: the sequence length the Megatron run trains with "
        "(default: the config's max_position_embeddings)",
    ),
    lr_scheduler: Optional[str] = typer.Option(
        None,
        "--lr-scheduler",
        metavar="SETTINGS",
        help="--to megatron "
        "from a torchtitan run: its LR schedule, which torchtitan rebuilds from "
        "its job config and does not save, in torchtitan's own names: "
        "warmup_steps=N,decay_ratio=R,decay_type=linear|sqrt|cosine,"
        "min_lr_factor=F,training_steps=N; checked against every param group's "
        "saved LR and written as Megatron's WSD schedule (default: a constant "
        "schedule at the saved LRs)",
    ),
    drop_norm_decay: bool = typer.Option(
        False,
        "--drop-norm-decay",
        help="--to megatron from a torchtitan run "
        "whose norms decay (its stock default_adamw: one param group, weight decay "
        "on every parameter): write the norms (1-D tensors) in a group without "
        "weight decay, as Megatron-core trains them; a change to the run, listed in "
        "the plan (without it, such a run is refused)",
    ),
) -> None:
    """Move a run to another framework with its whole training state.

    Weights (the fp32 master), every per-parameter optimizer state under torch's names, param groups (by
    FQN), the scheduler (DeepSpeed's WarmupLR as torch LinearLR) and the step counter; the plan lists what
    cannot move (RNG states, a data-loader position, the DeepSpeed config). The output is written under a
    staging name, compared with the source by logical parameter (`ckpt diff`), then renamed into place."""
    try:
        from ckpt_tools.ops.convert import refuse_job, runs_as_job

        job = output.under_torchrun()
        many = nproc is not None or distributed or (job and int(os.environ.get("WORLD_SIZE", "1")) > 1)
        if many and not dry_run:
            refuse_job(to)  # before any work: a target one process writes
        if nproc is not None and not job:
            code = output.launch_nproc(nproc)  # the job's rank 0 printed the result
            if code:
                raise typer.Exit(code)
            return None
        # a rank of a torchrun job writes its share without --distributed
        distributed = distributed or (job and runs_as_job(to))
        return _convert(
            ckpt,
            out,
            to,
            layout,
            dry_run,
            not no_verify,
            json_out,
            distributed,
            allow_unread,
            n_kv_heads,
            ckpt_format,
            tp,
            pp,
            hf_config,
            seq_length,
            lr_scheduler,
            drop_norm_decay,
            trust_pickles=trust_pickles,
            restart=restart,
            ep=ep,
        )
    except CkptError as e:
        if e.message.startswith(("ckpt convert:", "ckpt convert needs")):
            raise
        named = type(e).__new__(type(e))
        CkptError.__init__(named, f"ckpt convert: {e.message}", path=e.path, hint=e.hint)
        raise named from e


def _convert(
    ckpt,
    out,
    to,
    layout,
    dry_run,
    verify,
    json_out,
    distributed=False,
    allow_unread=False,
    n_kv_heads=None,
    ckpt_format=None,
    tp=None,
    pp=None,
    hf_config=None,
    seq_length=None,
    lr_scheduler=None,
    drop_norm_decay=False,
    trust_pickles=False,
    restart=False,
    ep=None,
) -> None:
    output.require("torch", extra="convert", what="ckpt convert")
    if to == "deepspeed-universal" and layout is None:
        from ckpt_tools.ops.to_universal import handles

        if handles(ckpt):  # a DeepSpeed source: `to-universal`'s own path
            from . import to_universal as tu

            return tu.to_universal_cmd(
                ckpt,
                out,
                workers=min(8, os.cpu_count() or 1),
                dry_run=dry_run,
                tp_layout=None,
                pattern=None,
                tp_replicated=None,
                target_stage=None,
                verify=verify,
                yes=True,
                distributed=distributed,
                nproc=None,
                restart=restart,
                json_out=json_out,
                allow_unread=allow_unread,
                trust_pickles=trust_pickles,
            )
    return _convert_ops(
        ckpt,
        out,
        to,
        layout,
        dry_run,
        verify,
        json_out,
        distributed,
        allow_unread,
        n_kv_heads,
        ckpt_format,
        tp,
        pp,
        hf_config,
        seq_length,
        lr_scheduler,
        drop_norm_decay,
        trust_pickles=trust_pickles,
        restart=restart,
        ep=ep,
    )


def _convert_ops(
    ckpt,
    out,
    to,
    layout,
    dry_run,
    verify,
    json_out,
    distributed=False,
    allow_unread=False,
    n_kv_heads=None,
    ckpt_format=None,
    tp=None,
    pp=None,
    hf_config=None,
    seq_length=None,
    lr_scheduler=None,
    drop_norm_decay=False,
    trust_pickles=False,
    restart=False,
    ep=None,
) -> None:
    from ckpt_tools.ops import convert as ops

    try:
        plan = ops.plan_convert(
            ckpt,
            out,
            to=to,
            layout=layout,
            allow_unread=allow_unread,
            n_kv_heads=n_kv_heads,
            ckpt_format=ckpt_format,
            tp=tp,
            pp=pp,
            hf_config=hf_config,
            seq_length=seq_length,
            lr_scheduler=lr_scheduler,
            drop_norm_decay=drop_norm_decay,
            ep=ep,
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
    from tqdm import tqdm

    with tqdm(
        total=plan.nbytes, unit="B", unit_scale=True, desc="convert", disable=json_out or rank != 0, leave=False
    ) as bar:
        res = ops.execute(plan, progress=bar.update, verify=verify, distributed=distributed, restart=restart)
    if rank != 0:
        return
    if json_out:
        doc = plan.to_json()
        doc.pop("params")
        output.print_json(
            {
                **doc,
                "out": str(res.out),
                "params": res.params,
                "bytes_written": res.bytes_written,
                "verified": res.verified,
                **({"converted": res.converted, "resumed": res.resumed, "ranks": list(res.ranks)} if res.ranks else {}),
            }
        )
        return
    con = output.console()
    what = f"{plan.to}" + (f" ({plan.layout} layout)" if plan.layout else "")
    doc = plan.to_json()
    con.print(
        f"[green]wrote[/] {escape(str(res.out))}  ({escape(what)}: {output.plural(res.params, 'tensor')}, "
        f"{res.bytes_written:,} bytes; optimizer state: {escape(', '.join(doc['optimizer_state']) or 'none')}; "
        f"scheduler: {escape(str(plan.scheduler_class or ('kept as saved' if plan.scheduler else 'none')))}; "
        f"step: {escape(str(plan.step))})"
    )
    for line in output.job_lines(res.resumed, res.converted, res.ranks):
        con.print(escape(line))
    if res.verified:
        con.print(
            "  verified: equal to the source by logical parameter (weights, optimizer state, param groups, counters)"
        )
    for n in plan.notes:
        con.print(f"  note: {escape(n)}")
    for n in plan.not_moved:
        con.print(f"  [yellow]not moved:[/] {escape(n)}")


def _show_plan(plan, json_out: bool) -> None:
    doc = plan.to_json()
    if json_out:
        output.print_json(doc)
        return
    from rich.table import Table

    con = output.console()
    target = f"[{plan.to}{' / ' + plan.layout if plan.layout else ''}]"
    con.print(
        f"[bold]convert (dry run)[/] {escape(str(plan.source))} ({escape(str(plan.source_format))}) -> "
        f"{escape(str(plan.out))}  {escape(target)}  {doc['bytes']:,} bytes"
    )
    t = Table(show_edge=False)
    for col in ("tensor", "shape", "dtype", "kind", "optimizer state", "bytes"):
        t.add_column(col, justify="right" if col == "bytes" else "left")
    for p in doc["params"]:
        t.add_row(
            escape(p["name"]),
            "×".join(map(str, p["shape"])),
            escape(str(p["dtype"])),
            escape(str(p["kind"])),
            escape(", ".join(p["states"])),
            f"{p['bytes']:,}",
        )
    con.print(t)
    for i, g in enumerate(doc["param_groups"]):
        hp = ", ".join(f"{k}={v}" for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay", "initial_lr"))
        con.print(escape(f"param group {i}: {g['params']} params; {hp}"))
    con.print(
        escape(
            f"scheduler: {plan.scheduler_class or ('kept as saved' if plan.scheduler else 'none')}; step: {plan.step}"
        )
    )
    for n in plan.notes:
        con.print(f"note: {escape(n)}")
    for n in plan.not_moved:
        con.print(f"[yellow]not moved:[/] {escape(n)}")


def register(app: typer.Typer) -> None:
    app.command("convert")(convert_cmd)
