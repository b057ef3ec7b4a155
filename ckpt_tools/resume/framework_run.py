"""Run a framework's resume worker (every framework but DeepSpeed) and judge what it reports: `run_framework`
launches `resume.workers.<framework>` under torchrun and `verdict_framework` gives the rows — global step,
optimizer step, learning rate, the framework's own rows (scheduler state, custom state, run rebuilt), optimizer
state, loss."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from ..train.processes import launch, scratch_folder
from .common import FrameworkPlan
from .verdict import Check, CheckRow, ResumeResult, StepRecord, judged, lrs_close

#: the process each rank runs, by framework
WORKERS = {
    "hf_trainer": "ckpt_tools.resume.workers.hf_trainer",
    "accelerate": "ckpt_tools.resume.workers.accelerate",
    "dcp": "ckpt_tools.resume.workers.dcp",
    "lightning": "ckpt_tools.resume.workers.lightning",
    "megatron": "ckpt_tools.resume.workers.megatron",
}
LOSS_TOL = 1e-3  # absolute, vs a logged loss (the Trainer logs float32 losses rounded by json)


def run_framework(
    plan: FrameworkPlan,
    *,
    on_event: Callable[[dict], None] | None = None,
    keep: str | os.PathLike | bool | None = None,
    reference: dict[int, float] | None = None,
    loss_tol: float = LOSS_TOL,
    timeout: float = 3600,
) -> ResumeResult:
    """Launch the framework's worker, collect its events, judge them.

    `keep`: a folder for the scratch files (the worker plan), kept afterwards (`ckpt resume --work-dir`); True
    keeps a temporary one; None/False: a temporary folder, removed. Never the checkpoint folder.
    `reference`: step -> loss of the uninterrupted run (`--reference`), compared with the resumed losses."""
    with scratch_folder(keep if isinstance(keep, (str, os.PathLike)) else None, keep=keep is True) as scratch:
        plan_file = scratch / "worker_plan.json"
        plan_file.write_text(json.dumps(plan.worker_plan(), indent=1))
        events = _launch(plan, plan_file, on_event, timeout)
    loaded = next((e for e in events if e["event"] == "loaded"), {})
    records = [_record(e) for e in events if e["event"] == "step"]
    if reference is not None:
        plan = replace(plan, loss_reference=dict(reference), loss_reference_source="--reference")
    checks = verdict_framework(plan, loaded, events, records, loss_tol=loss_tol)
    setup = {"framework": plan.framework, "model": plan.model}
    return ResumeResult(plan=plan, setup=setup, loaded=loaded, records=tuple(records), checks=tuple(checks))


def _record(e: dict[str, Any]) -> StepRecord:
    """One `step` event of a framework worker (which may leave out what its framework does not report)."""
    return StepRecord(
        step=e["step"],
        loss=float(e["loss"]) if e.get("loss") is not None else float("nan"),
        loss_mean=float(e.get("loss_mean", e.get("loss") or float("nan"))),
        lr=tuple(e["lr"]),
        grad_norm=e.get("grad_norm"),
        optimizer_step=e.get("optimizer_step"),
        tokens_per_s=e.get("tokens_per_s"),
        seconds=float(e.get("seconds", 0.0)),
        skipped_steps=int(e.get("skipped_steps", 0)),
    )


def _launch(
    plan: FrameworkPlan, plan_file: Path, on_event: Callable[[dict], None] | None, timeout: float
) -> list[dict[str, Any]]:
    """The framework's worker under torchrun, launched, logged and reported as the DeepSpeed resume's is (one
    launcher for every framework)."""
    return launch(plan, plan_file, on_event, timeout, module=WORKERS[plan.framework])


# --- the verdict ----------------------------------------------------------------------------------


def verdict_framework(
    plan: FrameworkPlan,
    loaded: dict[str, Any],
    events: list[dict[str, Any]],
    records: list[StepRecord],
    *,
    loss_tol: float = LOSS_TOL,
) -> list[Check]:
    """The rows, in order: the counters, the LR, the framework's own rows (`FRAMEWORK_CHECKS`), the optimizer
    state, the loss."""
    checks = [_global_step(plan, records), _optimizer_step(plan, records), _learning_rate(plan, records)]
    checks += FRAMEWORK_CHECKS.get(plan.framework, _no_rows)(plan, loaded)
    checks.append(_optimizer_check(plan, events))
    checks.append(_loss(plan, records, loss_tol))
    return checks


def _global_step(plan: FrameworkPlan, records: list[StepRecord]) -> Check:
    s = plan.saved
    if s.global_step is None:
        return Check("global step", "n/a", "the checkpoint records no global step")
    rows = tuple(
        CheckRow(r.step, s.global_step + i + 1, r.step, r.step == s.global_step + i + 1) for i, r in enumerate(records)
    )
    saved = f"the saved global step {s.global_step}"
    return judged("global step", rows, f"continues from {saved}", f"does not continue from {saved}", need_rows=True)


def _optimizer_step(plan: FrameworkPlan, records: list[StepRecord]) -> Check:
    """The Adam step continues from the saved one (or from the global step where none is saved)."""
    s = plan.saved
    base, src = s.optimizer_step, f"the saved Adam step {s.optimizer_step}"
    if base is None and s.global_step is not None:
        base, src = (
            s.global_step,
            (f"global step {s.global_step} (the checkpoint holds no Adam step; one update per step)"),
        )
    if base is None:
        return Check("optimizer step", "n/a", "the checkpoint records no Adam step")
    rows = tuple(
        CheckRow(r.step, base + i + 1, r.optimizer_step, r.optimizer_step == base + i + 1)
        for i, r in enumerate(records)
    )
    failed = f"Adam step does not continue from {src} (optimizer state not loaded?)"
    return judged("optimizer step", rows, f"Adam step continues from {src}", failed, need_rows=True)


def _learning_rate(plan: FrameworkPlan, records: list[StepRecord]) -> Check:
    """Each resumed update's LR against the plan's expected one (computed from the saved schedule)."""
    if plan.lr_missing:
        return Check("learning rate", "fail", plan.lr_missing)
    if plan.expected_lrs is None:
        return Check("learning rate", "n/a", plan.lr_source)
    rows = tuple(
        CheckRow(r.step, list(w), list(r.lr), len(w) == len(r.lr) and all(lrs_close(a, b) for a, b in zip(w, r.lr)))
        for w, r in zip(plan.expected_lrs, records)
        if w is not None
    )
    ok = all(r.ok for r in rows) and bool(rows)
    bad = next((r for r in rows if not r.ok), None)
    unchecked = sum(1 for w in plan.expected_lrs[: len(records)] if w is None)
    more = f"; {unchecked} later update(s) not determined by the checkpoint" if unchecked else ""
    detail = (
        f"expected: {plan.lr_source}"
        if ok
        else f"step {bad.step}: expected {bad.expected}, the resumed run used {bad.actual} (expected: {plan.lr_source})"
        if bad
        else "no resumed update to compare"
    )
    return Check("learning rate", "pass" if ok else "fail", detail + more, rows)


def _no_rows(plan: FrameworkPlan, loaded: dict[str, Any]) -> list[Check]:
    return []


def _scheduler_rows(plan: FrameworkPlan, loaded: dict[str, Any]) -> list[Check]:
    return [_scheduler_loaded(plan, loaded)]


def _accelerate_rows(plan: FrameworkPlan, loaded: dict[str, Any]) -> list[Check]:
    """The scheduler state, and the custom state where objects were registered (or a stray file lies there)."""
    checks = [_scheduler_loaded(plan, loaded)]
    if plan.worker.get("custom_objects") or plan.worker.get("stray_custom"):
        checks.append(_custom_state(plan, loaded))
    return checks


def _megatron_rows(plan: FrameworkPlan, loaded: dict[str, Any]) -> list[Check]:
    """The relaunched run holds the saved args ("run rebuilt"); OptimizerParamScheduler loaded where saved."""
    s = plan.saved
    live, want = loaded.get("scheduler_position"), s.scheduler_position
    ok = live is not None and live == want
    return [
        _run_rebuilt(plan, loaded),
        Check(
            "scheduler state",
            "pass" if ok else "fail",
            f"OptimizerParamScheduler loaded at num_steps={live}, saved {want}"
            + ("" if ok else " (the saved scheduler was not loaded)"),
            (CheckRow(s.global_step or 0, want, live, ok),),
        ),
    ]


def _run_rebuilt(plan: FrameworkPlan, loaded: dict[str, Any]) -> Check:
    """Every saved arg came back in the relaunched run, but those the user changed (`--megatron-args`, the number
    of ranks)."""
    differ = loaded.get("args_differ")
    if differ is None:
        return Check("run rebuilt", "n/a", "the worker did not report the relaunched args")
    asked = {
        f.split("=", 1)[0][2:].replace("-", "_")
        for f in shlex.split(str(plan.worker.get("extra_args") or ""))
        if f.startswith("--")
    }
    if plan.nproc != (plan.worker.get("saved_args") or {}).get("world_size"):
        asked |= {"world_size", "data_parallel_size"}  # resumed on another number of ranks, as asked
    bad = [d for d in differ if d[0] not in asked]
    if bad:
        detail = f"{len(bad)} saved arg(s) came back with another value: " + "; ".join(
            f"{k}: saved {a!r}, now {b!r}" for k, a, b in bad[:4]
        )
    else:
        detail = (
            f"the relaunched run holds every saved arg ({len(plan.worker.get('saved_args') or {})}), "
            f"counters, paths and the CPU run-time flags aside"
            + (f"; {len(differ)} changed as asked" if differ else "")
        )
    return Check(
        "run rebuilt",
        "fail" if bad else "pass",
        detail,
        tuple(CheckRow(plan.saved.global_step or 0, a, b, False) for _, a, b in bad[:8]),
    )


#: the rows of each framework between the learning rate and the optimizer state
FRAMEWORK_CHECKS: dict[str, Callable[[FrameworkPlan, dict[str, Any]], list[Check]]] = {
    "accelerate": _accelerate_rows,
    "lightning": _scheduler_rows,
    "dcp": _scheduler_rows,
    "megatron": _megatron_rows,
}

#: the loss row where no reference has the resumed steps, by framework (default: a model-free resume)
NO_LOSS_REFERENCE = {
    "hf_trainer": "no trainer_state.json log_history entry for the resumed steps "
    "(resume an earlier checkpoint-N of the output_dir to compare)",
    "megatron": "Megatron saves no loss: pass --reference FILE (the losses of the uninterrupted run) to check it",
}


def _loss(plan: FrameworkPlan, records: list[StepRecord], loss_tol: float) -> Check:
    """The resumed losses against the reference (`--reference`, or the Trainer's log_history)."""
    if not plan.loss_reference:
        why = NO_LOSS_REFERENCE.get(plan.framework, "model-free resume (synthetic loss): loss continuity needs --model")
        return Check("loss", "n/a", why)
    # the Trainer logs the loss averaged over processes: compare the resumed run's mean
    rows = tuple(
        CheckRow(
            r.step,
            plan.loss_reference[r.step],
            r.loss_mean,
            abs(plan.loss_reference[r.step] - r.loss_mean) <= loss_tol,
        )
        for r in records
        if r.step in plan.loss_reference
    )
    if not rows:
        return Check("loss", "n/a", "log_history has none of the resumed steps")
    ok = all(r.ok for r in rows)
    diff = max(abs(r.expected - r.actual) for r in rows)
    # The run's data are not in the checkpoint: the resumed steps train on ckpt's synthetic rows. Equal
    # losses prove the run continued; different ones prove nothing unless the reference was made on the
    # same rows (`--reference`, e.g. an uninterrupted run recorded by ckpt) — so a log_history mismatch
    # is "n/a" with the numbers, never a failed check on a healthy checkpoint of a user's own data.
    strict = plan.loss_reference_source == "--reference"
    status = "pass" if ok else "fail" if strict else "n/a"
    why = (
        ""
        if ok
        else (
            ": a resume that did not continue"
            if strict
            else ": not a verdict — the run's data are not in the checkpoint and the resumed steps "
            "trained on ckpt's synthetic rows; pass --reference FILE (losses of an "
            "uninterrupted run on the same rows) to check the loss"
        )
    )
    return Check(
        "loss",
        status,
        f"{len(rows)} steps vs {'' if strict else 'log_history of '}{plan.loss_reference_source}: "
        f"max |diff| "
        f"{diff:.3g} (tolerance {loss_tol:g}){why}",
        rows,
    )


def _scheduler_loaded(plan: FrameworkPlan, loaded: dict[str, Any]) -> Check:
    """The scheduler position right after the load equals the saved one (the state was loaded at all)."""
    s = plan.saved
    live = loaded.get("scheduler_position")
    live0 = live[0] if isinstance(live, list) and live else live
    if s.scheduler_state != "torch":
        return Check("scheduler state", "n/a", "the checkpoint holds no torch scheduler state")
    ok = live0 == s.scheduler_position
    return Check(
        "scheduler state",
        "pass" if ok else "fail",
        f"loaded at last_epoch={live0}, saved {s.scheduler_position}"
        + ("" if ok else " (the saved state was ignored)"),
        (CheckRow(s.global_step or 0, s.scheduler_position, live0, ok),),
    )


def _custom_state(plan: FrameworkPlan, loaded: dict[str, Any]) -> Check:
    saved = plan.worker.get("custom_saved") or {}
    live = loaded.get("custom_states") or []
    want = [
        saved[k]
        for k in sorted(saved, key=lambda k: int(k.rsplit("_", 1)[-1]) if k.rsplit("_", 1)[-1].isdigit() else 0)
    ]
    rows = tuple(CheckRow(i, w, got, w == got) for i, (w, got) in enumerate(zip(want, live)))
    ok = bool(rows) and all(r.ok for r in rows) and len(live) == len(want)
    stray = plan.worker.get("stray_custom") or []
    effect = plan.worker.get("stray_effect")
    if stray and effect == "fail":
        return Check(
            "custom state",
            "fail",
            f"stray {', '.join(stray)}: the installed Accelerate counts it, so "
            "load_state does not restore the registered objects",
            rows,
        )
    note = (
        f"; WARNING stray {', '.join(stray)} in the folder: ignored by this Accelerate, but older versions "
        "count it and skip the custom state"
        if stray
        else ""
    )
    if ok:
        return Check("custom state", "pass", f"{len(rows)} registered object(s) restored as saved{note}", rows)
    return Check(
        "custom state", "fail", f"registered objects not restored as saved (saved {want}, loaded {live}){note}", rows
    )


def _optimizer_check(plan: FrameworkPlan, events: list[dict[str, Any]]) -> Check:
    steps = [e for e in events if e["event"] == "step"]
    results = [(e["step"], e.get("opt_check")) for e in steps]
    if not results or any(r is None for _, r in results):
        return Check(
            "optimizer state", "n/a", plan.worker.get("no_opt_check") or "the worker reported no optimizer check"
        )
    problem = next((r["problem"] for _, r in results if r.get("problem")), None)
    if problem and "no optimizer state" not in problem and "parameters" not in problem:
        return Check("optimizer state", "n/a", problem)
    rows = []
    worst: dict[str, float] = {}
    for step, r in results:
        errs = {k: v for k, v in r["errors"].items() if v}
        for k, v in r["errors"].items():
            worst[k] = max(worst.get(k, 0.0), v)
        ok = (
            not r.get("problem")
            and not r["any_step_bad"]
            and r["checked"] > 0
            and all(v <= r["tol"] for v in r["errors"].values())
        )
        rows.append(
            CheckRow(step, f"rel err <= {r['tol']:g}", {k: float(f"{v:.3g}") for k, v in errs.items()} or "exact", ok)
        )
    ok = all(r.ok for r in rows)
    kinds = "/".join(sorted({k for _, r in results for k in r.get("kinds", [])})) or "?"
    lr_note = "" if all(r.get("lr_from_plan") for _, r in results) else " (with the LR the run used: no expected LR)"
    where = plan.worker.get("opt_state_source") or "the checkpoint"
    worst_s = ", ".join(f"{k} {v:.2g}" for k, v in worst.items() if k != "momentum_buffer" or v)
    if ok:
        detail = (
            f"{kinds} closed form from the state saved in {where} with each update's gradient{lr_note}: "
            f"max rel err {worst_s}"
        )
    elif problem:
        detail = f"{problem}: the resumed optimizer cannot have continued it"
    else:
        bad_step = any(r["any_step_bad"] for _, r in results)
        detail = (
            f"the resumed optimizer state is not the closed-form update of the state saved in {where} "
            f"({'Adam step differs; ' if bad_step else ''}max rel err {worst_s}): its state was not "
            "loaded, or not the saved one"
        )
    return Check("optimizer state", "pass" if ok else "fail", detail, tuple(rows))
