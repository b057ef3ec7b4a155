"""Run a DeepSpeed resume and judge it: convert to universal if the plan says so, launch DeepSpeed's engine
(`resume.workers.deepspeed`) under torchrun, and give the verdict — the counters continue, the LR is what the
saved schedule prescribes (`expected_lrs`, computed here from the saved state), (model-free) the optimizer state
continues (`optimizer_state_check`), the loss continues. Also the reference a later resume is compared with
(`reference_doc`, `load_reference`)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError
from ..ops.to_universal import execute, plan_to_universal
from ..read.tree import Checkpoint, GroupNode, TensorNode, ValueNode
from ..schedules.deepspeed import DS_SCHEDULERS, lr_at as _ds_scheduler_lr
from ..train.processes import launch as _launch, scratch_folder
from ..train.replica_layout import LAMBDA_SCHEDULERS, infer_torch_scheduler
from ..view.checkpoint import open_checkpoint
from .deepspeed import ResumePlan
from .verdict import Check, CheckRow, ResumeResult, StepRecord, judged, lrs_close

#: the process each rank runs: DeepSpeed's engine loads the checkpoint and trains
WORKER_MODULE = "ckpt_tools.resume.workers.deepspeed"

REFERENCE_KIND = "ckpt-resume-reference"

Converter = Callable[[Path, Path, bool], None]


def ckpt_to_universal(tag_dir: Path, out_dir: Path, inject_missing_state: bool) -> None:
    """`ckpt to-universal` (the default converter): `tag_dir` -> `out_dir/<tag>_universal` +
    `out_dir/latest_universal`. Plain ZeRO (TP=1) needs no injected state; TP merges follow the
    checkpoint's universal_checkpoint_info, and disagreeing TP replicas stop the conversion."""
    execute(plan_to_universal(tag_dir, out_dir))


def run_deepspeed(
    plan: ResumePlan,
    *,
    on_event: Callable[[dict], None] | None = None,
    converter: Converter = ckpt_to_universal,
    reference: dict[int, float] | None = None,
    loss_tol: float = 1e-3,
    jump_tol: float = 0.1,
    work_dir: str | os.PathLike | None = None,
    timeout: float = 3600,
) -> ResumeResult:
    """Convert (if the plan says so), launch the training processes, and judge the records.

    Scratch files (the worker plan, a universal conversion, the processes' temp files) go to `work_dir` — never
    into the checkpoint folder — and a temporary `work_dir` is removed afterwards, also on Ctrl-C / SIGTERM
    (`scratch_folder`), after the training processes were stopped (`_launch`).
    """
    with scratch_folder(work_dir) as scratch:
        if plan.convert_from is not None:
            out = scratch / "universal"
            if on_event:
                on_event({"event": "converting", "source": plan.convert_from, "target": str(out)})
            converter(Path(plan.convert_from), out, plan.inject_missing_state)
            plan = replace(plan, load_dir=str(out), tag=None)
        plan_file = scratch / "worker_plan.json"
        state_dir = scratch / "state"
        state_dir.mkdir(exist_ok=True)
        doc = plan.worker_plan()
        doc["state_dir"] = str(state_dir)
        plan_file.write_text(json.dumps(doc, indent=1))
        events = _launch(plan, plan_file, on_event, timeout, module=WORKER_MODULE)
        setup = next((e for e in events if e["event"] == "setup"), {})
        loaded = next((e for e in events if e["event"] == "loaded"), {})
        records = [_record(e) for e in events if e["event"] == "step"]
        checks = verdict_deepspeed(
            plan, setup, loaded, records, reference=reference, loss_tol=loss_tol, jump_tol=jump_tol, state_dir=state_dir
        )
    return ResumeResult(plan=plan, setup=setup, loaded=loaded, records=tuple(records), checks=tuple(checks))


def _record(e: dict[str, Any]) -> StepRecord:
    """One `step` event of the DeepSpeed worker."""
    return StepRecord(
        step=e["step"],
        loss=e["loss"],
        loss_mean=e["loss_mean"],
        lr=tuple(e["lr"]),
        grad_norm=e["grad_norm"],
        optimizer_step=e["optimizer_step"],
        tokens_per_s=e["tokens_per_s"],
        seconds=e["seconds"],
        skipped_steps=e["skipped_steps"],
    )


# --- the expected LR --------------------------------------------------------------------------------


def expected_lrs(plan: ResumePlan, setup: dict[str, Any]) -> tuple[list[list[float]] | None, str]:
    """(LR per param group for each resumed update, how it was derived) — or (None, why not)."""
    s = plan.saved
    sched_cfg = plan.ds_config.get("scheduler")
    live = setup.get("scheduler")
    k = range(plan.steps)
    if sched_cfg:
        if sched_cfg.get("type") not in DS_SCHEDULERS:
            return None, f"no formula here for DeepSpeed's {sched_cfg.get('type')}"
        if s.scheduler_state == "deepspeed":
            start, src = s.scheduler_position, f"saved last_batch_iteration={s.scheduler_position}"
        else:
            start = (s.global_step or 0) - 1
            src = f"NO saved scheduler state; last_batch_iteration should be global_step - 1 = {start}"
        # WarmupCosineLR scales the optimizer's LR at construction: the config's optimizer lr.
        opt_lr = plan.ds_config.get("optimizer", {}).get("params", {}).get("lr")
        group_lrs = [float(opt_lr)] * len(s.param_group_lrs) if opt_lr is not None else list(s.param_group_lrs)
        return (
            [_ds_scheduler_lr(sched_cfg, start + i, group_lrs) for i in k],
            f"{sched_cfg['type']} from the launch config at {src}",
        )
    if s.scheduler_state == "deepspeed":
        return None, "the checkpoint has a DeepSpeed scheduler state but the launch config names no scheduler"
    values = setup.get("lambda_values")
    cls = infer_torch_scheduler(s.scheduler_saved) if s.scheduler_saved else None
    if s.scheduler_state == "torch" and cls and cls not in LAMBDA_SCHEDULERS:
        from ..train.replica import expected_torch_lrs  # lazy: torch replays the saved torch scheduler

        try:
            want = expected_torch_lrs(
                s.scheduler_saved, list(s.param_group_lrs), plan.steps, saved_groups=list(s.group_options)
            )
        except (ValueError, TypeError, KeyError) as e:
            return None, f"cannot rebuild the saved {cls} from its state: {e}"
        return want, f"torch {cls} rebuilt from its saved state (last_epoch={s.scheduler_position})"
    if s.scheduler_state == "torch" and cls in LAMBDA_SCHEDULERS and not values:
        # the function is not in the checkpoint: the first resumed update runs at the saved LR, the rest is unknown
        return (
            [list(s.param_group_lrs)] + [None] * (plan.steps - 1),  # type: ignore[list-item]
            f"{cls}: the first resumed step at the saved param_groups lr; later steps NOT checked (the "
            f"{cls}'s function is not in the checkpoint: pass --scheduler module:function)",
        )
    if live is not None or s.scheduler_state == "torch":
        if live != "LambdaLR" or not values:
            return None, (
                f"the resumed run's scheduler is {live}; the expected LR is computed for LambdaLR "
                "(give the factory's TrainSetup an lr_lambda)"
            )
        if s.scheduler_state == "torch" and s.base_lrs:
            base, src = list(s.base_lrs), f"saved base_lrs x lambda(last_epoch={s.scheduler_position} + k)"
        else:
            base = list(s.initial_lrs or s.param_group_lrs)
            src = (
                f"NO saved scheduler state; initial_lr x lambda(global_step={s.global_step} + k), what a "
                "scheduler stepped once per optimizer step would be at"
            )
        return [[b * f for b, f in zip(base, values[i])] for i in k], src
    return [list(s.param_group_lrs) for _ in k], "no scheduler: the saved param_groups lr"


def lost_scheduler(plan: ResumePlan, setup: dict[str, Any]) -> str | None:
    """Why the LR of this resume cannot be the saved run's, or None. A torch scheduler writes `initial_lr` into
    every param group it drives; groups that carry it while the checkpoint holds no scheduler state (DeepSpeed
    saved `lr_scheduler` None: the scheduler was not handed to `deepspeed.initialize`, or its state was dropped),
    no launch config names one and the resumed run builds none, mean the real run would restart its schedule
    (or lose it) while this resume trains at the saved LR: a pass there would be a false one. The user's
    --no-scheduler (the run had none) makes it a constant LR."""
    s = plan.saved
    if (
        plan.no_scheduler
        or s.scheduler_state != "none"
        or plan.ds_config.get("scheduler")
        or setup.get("scheduler") is not None
        or not s.initial_lrs
    ):
        return None
    return (
        f"the saved param groups carry initial_lr={list(s.initial_lrs)}, so an LR scheduler drove this run, but "
        "the checkpoint holds no scheduler state: the real run restarts its schedule from its first step (or "
        "runs without it), so the LR it will train at is not the saved run's. Save the scheduler (pass it to "
        "deepspeed.initialize as lr_scheduler), or pass --no-scheduler if the run really had none"
    )


def load_reference(path: str | os.PathLike) -> dict[int, float]:
    """step -> loss from a reference JSON: what `--record-reference` writes ({"records": [...]}), a sample
    manifest ({"extra": {"history": [...]}}), {"history": [...]} or a bare list of {step, loss}."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CkptError(f"cannot read the reference: {e}", path=p) from None
    if isinstance(doc, dict):
        doc = doc.get("records") or doc.get("history") or (doc.get("extra") or {}).get("history")
    if not isinstance(doc, list) or not all(isinstance(r, dict) and "step" in r and "loss" in r for r in doc):
        raise CkptError(
            "not a reference: expected a list of {step, loss} under 'records' or 'history'",
            path=p,
            hint="make one with `ckpt resume EARLIER_CKPT --steps N --record-reference REF.json`",
        )
    return {int(r["step"]): float(r["loss"]) for r in doc}


def reference_doc(result: ResumeResult) -> dict[str, Any]:
    """What `--record-reference` writes: the per-step records of this run, to compare a later resume with."""
    return {
        "kind": REFERENCE_KIND,
        "version": 1,
        "checkpoint": result.plan.path,
        "topology": {"dp": result.plan.dp, "tp": result.plan.tp, "pp": result.plan.pp},
        "device": result.plan.device,
        "records": [asdict(r) for r in result.records],
    }


# --- the verdict ----------------------------------------------------------------------------------


def verdict_deepspeed(
    plan: ResumePlan,
    setup: dict[str, Any],
    loaded: dict[str, Any],
    records: list[StepRecord],
    *,
    reference: dict[int, float] | None = None,
    loss_tol: float = 1e-3,
    jump_tol: float = 0.1,
    state_dir: Path | None = None,
) -> list[Check]:
    """The checks: counters continue, the LR is what the saved schedule prescribes, (model-free) the optimizer
    state continues, the loss continues."""
    s = plan.saved
    checks = [_global_step(s, records), _optimizer_step(s, records)]
    want, how = expected_lrs(plan, setup)
    checks.append(_learning_rate(plan, setup, loaded, records, want, how))
    checks.append(_loss(plan, records, reference, loss_tol, jump_tol))
    if plan.model == "replica":
        checks.insert(-1, optimizer_state_check(plan, records, want, state_dir))
    return checks


def _global_step(s: Any, records: list[StepRecord]) -> Check:
    if s.global_step is None:
        return Check("global step", "n/a", "the checkpoint records no global step")
    rows = [
        CheckRow(r.step, s.global_step + i + 1, r.step, r.step == s.global_step + i + 1) for i, r in enumerate(records)
    ]
    saved = f"the saved global_steps={s.global_step}"
    return judged("global step", rows, f"continues from {saved}", f"does not continue from {saved}")


def _optimizer_step(s: Any, records: list[StepRecord]) -> Check:
    if s.optimizer_step is None:
        return Check("optimizer step", "n/a", "the checkpoint records no Adam step")
    rows = []
    for i, r in enumerate(records):
        # a skipped step (fp16 overflow) does not advance Adam
        want = s.optimizer_step + i + 1 - (r.skipped_steps - (s.skipped_steps or 0))
        rows.append(CheckRow(r.step, want, r.optimizer_step, r.optimizer_step == want))
    saved = f"the saved {s.optimizer_step}"
    return judged(
        "optimizer step",
        rows,
        f"Adam step continues from {saved}",
        f"Adam step does not continue from {saved} (reset?)",
    )


def _learning_rate(
    plan: ResumePlan,
    setup: dict[str, Any],
    loaded: dict[str, Any],
    records: list[StepRecord],
    want: list[list[float] | None] | None,
    how: str,
) -> Check:
    """Each resumed step's LR against the expected one; a lost scheduler fails, an undetermined one is n/a."""
    s = plan.saved
    lost = lost_scheduler(plan, setup)
    if lost:
        return Check("learning rate", "fail", lost, tuple(CheckRow(r.step, None, list(r.lr), False) for r in records))
    if want is None:
        return Check("learning rate", "n/a", how)
    rows = [
        CheckRow(r.step, w, list(r.lr), len(w) == len(r.lr) and all(lrs_close(a, b) for a, b in zip(w, r.lr)))
        for w, r in zip(want, records)
        if w is not None
    ]
    if s.scheduler_state == "torch" and any(w is None for w in want):
        row, loaded_how = _scheduler_state_loaded(s, loaded)
        rows.append(row)
        how += loaded_how
    ok = all(r.ok for r in rows)
    bad = next((r for r in rows if not r.ok), None)
    detail = (
        f"expected: {how}"
        if ok
        else (f"step {bad.step}: expected {bad.expected}, the engine used {bad.actual} (expected: {how})")
    )
    return Check("learning rate", "pass" if ok else "fail", detail, tuple(rows))


def _scheduler_state_loaded(s: Any, loaded: dict[str, Any]) -> tuple[CheckRow, str]:
    """What can be checked of a scheduler whose function is missing: the state was loaded (last_epoch and
    base_lrs as saved). Returns the row and what to add to the row's "how"."""
    pos, base = loaded.get("scheduler_position"), loaded.get("base_lrs")
    ok_pos = pos == s.scheduler_position
    ok_base = (
        base is not None
        and s.base_lrs is not None
        and len(base) == len(s.base_lrs)
        and all(lrs_close(a, b) for a, b in zip(base, s.base_lrs))
    )
    row = CheckRow(
        s.global_step or 0,
        {"last_epoch": s.scheduler_position, "base_lrs": s.base_lrs},
        {"last_epoch": pos, "base_lrs": base},
        ok_pos and ok_base,
    )
    how = (
        "; the scheduler state was loaded (last_epoch and base_lrs as saved)"
        if ok_pos and ok_base
        else f"; the scheduler state was NOT loaded: last_epoch {pos}, base_lrs {base} after the load"
    )
    return row, how


def _loss(
    plan: ResumePlan, records: list[StepRecord], reference: dict[int, float] | None, loss_tol: float, jump_tol: float
) -> Check:
    """Against `--reference`; n/a for the model-free replica; else the first loss against one saved in the client
    state."""
    s = plan.saved
    if reference is not None:
        rows = [
            CheckRow(r.step, reference[r.step], r.loss, abs(reference[r.step] - r.loss) <= loss_tol)
            for r in records
            if r.step in reference
        ]
        if not rows:
            return Check(
                "loss", "fail", f"the reference has none of the resumed steps {records[0].step}..{records[-1].step}"
            )
        diff = max(abs(r.expected - r.actual) for r in rows)
        ok = all(r.ok for r in rows)
        exact = all(r.expected == r.actual for r in rows)
        return Check(
            "loss",
            "pass" if ok else "fail",
            f"{len(rows)} steps vs the reference: max |diff| {diff:.3g} "
            f"({'bitwise equal' if exact else f'tolerance {loss_tol:g}'})",
            tuple(rows),
        )
    if plan.model == "replica":
        return Check(
            "loss",
            "n/a",
            "the model-free check trains a stand-in with a synthetic loss: loss "
            "continuity needs --model module:function",
        )
    if s.loss is not None and records:
        first = records[0]
        ok = first.loss <= s.loss * (1 + jump_tol)
        return Check(
            "loss",
            "pass" if ok else "fail",
            f"first resumed loss {first.loss:.6g} vs client state {s.loss_key}={s.loss:.6g} "
            f"(allowed jump {jump_tol:.0%})",
            (CheckRow(first.step, s.loss, first.loss, ok),),
        )
    return Check("loss", "n/a", "no --reference and no loss saved in the checkpoint's client state")


# --- the model-free optimizer-state check ------------------------------------------------------------


def _saved_optimizer_state(ck: Checkpoint, names: list[str]) -> dict[str, dict[str, Any]]:
    import torch  # lazy: the saved moments are read as torch tensors

    state = ck.optimizer.children.get("state", GroupNode()).children
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        node = state.get(n)
        if not isinstance(node, GroupNode):
            raise KeyError(n)
        entry: dict[str, Any] = {}
        for key in ("fp32", "exp_avg", "exp_avg_sq", "momentum_buffer", "max_exp_avg_sq"):
            t = node.children.get(key)
            if isinstance(t, TensorNode):
                entry[key] = t.read_torch().to(torch.float64)
        st = node.children.get("step")
        v = st.value if isinstance(st, ValueNode) else (st.read_torch() if isinstance(st, TensorNode) else None)
        entry["step"] = None if v is None else int(float(v if not hasattr(v, "item") else v.item()))
        out[n] = entry
    return out


def _decoupled(opts: dict[str, Any], cfg: dict[str, Any], kind: str) -> bool:
    if "decoupled_weight_decay" in opts:
        return bool(opts["decoupled_weight_decay"])
    ds_opt = cfg.get("optimizer") or {}
    t = str(ds_opt.get("type", kind)).lower()
    if t == "adamw":
        return True
    if t == "adam":  # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false
        return bool((ds_opt.get("params") or {}).get("adam_w_mode", True)) if ds_opt else False
    return kind == "AdamW"


def optimizer_state_check(
    plan: ResumePlan, records: list[StepRecord], lrs: list[list[float] | None] | None, state_dir: Path | None
) -> Check:
    """The model-free "optimizer state" row: after each resumed step, the engine's fp32 master, exp_avg,
    exp_avg_sq (or SGD momentum) and step equal the closed-form update applied — step after step — to the
    state saved in the checkpoint the user named (read here, never through the engine), with the known
    gradient r (times DeepSpeed's clip factor) and the expected LR of each group."""
    from ..train import replica as R  # lazy: the replica module imports torch

    name = "optimizer state"
    lay = plan.replica or {}
    if state_dir is None or not records:
        return Check(name, "n/a", "no resumed step to compare")
    specs = [R.ParamSpec(p["name"], tuple(p["shape"]), p["dtype"], p["requires_grad"]) for p in lay["specs"]]
    directions = R.synthetic_directions(specs, lay.get("seed", 0), max_norm=lay.get("max_norm"))
    factor = R.clip_factor(directions, lay.get("max_norm"))
    names = [s.name for s in specs if s.requires_grad]
    try:
        saved = _saved_optimizer_state(open_checkpoint(plan.against or plan.path), names)
    except KeyError as e:
        return Check(name, "n/a", f"the checkpoint holds no optimizer state for {e}")
    kind = lay.get("optimizer") or "AdamW"
    adam = all("exp_avg" in saved[n] and "exp_avg_sq" in saved[n] for n in names)
    sgd = not adam and all("momentum_buffer" in saved[n] for n in names)
    if not (adam or sgd):
        return Check(
            name,
            "n/a",
            "the saved optimizer state is neither Adam (exp_avg, exp_avg_sq) nor SGD momentum: no closed form here",
        )
    replay = _Replay(plan, lay, names, directions, factor, adam, kind)
    rows, first_bad, used_engine_lr = replay.run(records, lrs, state_dir, saved)
    formula = ("Adam" if adam else "SGD") if kind not in ("AdamW", "Adam", "SGD") else kind
    what = "fp32 master, exp_avg, exp_avg_sq and step" if adam else "fp32 master and momentum buffer"
    tol = (
        f"fp32 tolerance: moments {R.MOMENT_RTOL:g} x max|value|, parameters {R.PARAM_ULPS} ulp + "
        f"{R.UPDATE_RTOL:g} x the update"
    )
    note = f"; LR of steps {used_engine_lr} taken from the engine (not checked)" if used_engine_lr else ""
    clip = f"; gradient clipped by {factor:.6g}" if factor != 1.0 else ""
    src = f" saved in {plan.against}" if plan.against else ""
    if first_bad:
        return Check(name, "fail", f"{first_bad}{src}: the optimizer state did not continue ({tol}{note})", tuple(rows))
    return Check(
        name,
        "pass",
        f"{what} of {len(names)} parameters follow {formula} applied to the state{src} with "
        f"the known gradient ({tol}{clip}{note})",
        tuple(rows),
    )


class _Replay:
    """The closed-form optimizer applied step after step to the saved state, compared with what the engine wrote
    after each resumed step (`state_dir/step_N.pt`)."""

    def __init__(
        self,
        plan: ResumePlan,
        lay: dict[str, Any],
        names: list[str],
        directions: dict[str, Any],
        factor: float,
        adam: bool,
        kind: str,
    ) -> None:
        self.plan, self.lay, self.names, self.adam, self.kind = plan, lay, names, adam, kind
        self.directions, self.factor = directions, factor  # the known gradient: direction x DeepSpeed's clip factor
        self.group_of = {n: gi for gi, g in enumerate(lay["groups"]) for n in g["names"]}

    def run(
        self,
        records: list[StepRecord],
        lrs: list[list[float] | None] | None,
        state_dir: Path,
        saved: dict[str, dict[str, Any]],
    ) -> tuple[list[CheckRow], str | None, list[int]]:
        """(a row per resumed step, the first failure or None, the steps whose LR was taken from the engine)."""
        import torch  # lazy: the engine's state files are torch files

        cur = {
            n: {
                "param": saved[n]["fp32"],
                "exp_avg": saved[n].get("exp_avg"),
                "exp_avg_sq": saved[n].get("exp_avg_sq"),
                "max_exp_avg_sq": saved[n].get("max_exp_avg_sq"),
                "momentum_buffer": saved[n].get("momentum_buffer"),
                "step": saved[n]["step"],
            }
            for n in self.names
        }
        rows: list[CheckRow] = []
        first_bad = None
        used_engine_lr = []
        skipped_before = self.plan.saved.skipped_steps or 0
        for i, rec in enumerate(records):
            f = state_dir / f"step_{rec.step}.pt"
            if not f.is_file():
                rows.append(CheckRow(rec.step, "state file", "missing", False))
                first_bad = first_bad or f"step {rec.step}: the worker wrote no state"
                continue
            live = torch.load(f, map_location="cpu", weights_only=True)
            step_lrs = lrs[i] if lrs is not None and i < len(lrs) and lrs[i] is not None else None
            if step_lrs is None:
                step_lrs = list(rec.lr)
                used_engine_lr.append(rec.step)
            skipped = rec.skipped_steps > skipped_before
            skipped_before = rec.skipped_steps
            row, bad = self._step(rec, live, step_lrs, skipped, cur)
            rows.append(row)
            if bad and first_bad is None:
                first_bad = bad
        return rows, first_bad, used_engine_lr

    def _step(
        self, rec: StepRecord, live: dict[str, Any], step_lrs: list[float], skipped: bool, cur: dict[str, Any]
    ) -> tuple[CheckRow, str | None]:
        """One resumed step: every parameter's expected update (`cur` advances) against the engine's state."""
        worst: tuple[float, str, str, float] = (0.0, "", "", 0.0)  # (ratio, param, field, diff)
        ok = True
        for n in self.names:
            new = dict(cur[n]) if skipped else self._update(n, cur[n], step_lrs)
            ok, worst = self._compare(n, live["params"].get(n, {}), new, cur[n], ok, worst)
            cur[n] = new
        first = cur[self.names[0]]["step"]
        want_step = None if not self.adam or first is None else first
        step_ok = want_step is None or live.get("step") == want_step
        ok = ok and step_ok
        row = CheckRow(
            rec.step,
            {"step": want_step, "tolerance": "fp32"},
            {
                "step": live.get("step"),
                "worst": worst[1],
                "field": worst[2],
                "max_abs_diff": worst[3],
                "diff_over_tolerance": worst[0],
            },
            ok,
        )
        if ok:
            return row, None
        return row, (
            f"step {rec.step}: Adam step {live.get('step')} instead of {want_step}"
            if not step_ok
            else f"step {rec.step}: {worst[2]} of {worst[1]} is {worst[3]:.3g} off the formula applied to the "
            f"saved state ({worst[0]:.3g}x the tolerance)"
        )

    def _update(self, n: str, prev: dict[str, Any], step_lrs: list[float]) -> dict[str, Any]:
        """The closed-form Adam / AdamW / SGD update of parameter `n` with its group's options and LR."""
        from ..train import replica as R  # lazy: the replica module imports torch

        gi = self.group_of.get(n, 0)
        opts = self.lay["groups"][gi]["options"] if gi < len(self.lay["groups"]) else {}
        lr = float(step_lrs[gi] if gi < len(step_lrs) else step_lrs[0])
        if self.adam:
            return R.expected_adam(
                prev["param"],
                self.directions[n] * self.factor,
                prev.get("exp_avg"),
                prev.get("exp_avg_sq"),
                prev.get("step"),
                lr=lr,
                betas=opts.get("betas", (0.9, 0.999)),
                eps=float(opts.get("eps", 1e-8)),
                weight_decay=float(opts.get("weight_decay", 0)),
                decoupled=_decoupled(opts, self.plan.ds_config, self.kind),
                amsgrad=bool(opts.get("amsgrad", False)),
                max_exp_avg_sq=prev.get("max_exp_avg_sq"),
            )
        new = R.expected_sgd(
            prev["param"],
            self.directions[n] * self.factor,
            prev.get("momentum_buffer"),
            lr=lr,
            momentum=float(opts.get("momentum", 0)),
            dampening=float(opts.get("dampening", 0)),
            weight_decay=float(opts.get("weight_decay", 0)),
            nesterov=bool(opts.get("nesterov", False)),
        )
        new["step"] = None
        return new

    def _compare(
        self,
        n: str,
        got: dict[str, Any],
        new: dict[str, Any],
        prev: dict[str, Any],
        ok: bool,
        worst: tuple[float, str, str, float],
    ) -> tuple[bool, tuple[float, str, str, float]]:
        """The engine's fields of parameter `n` against the expected ones: (still ok, the worst ratio so far)."""
        from ..train import replica as R  # lazy: the replica module imports torch

        fields = [("fp32", "param")] + (
            [("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")]
            if self.adam
            else [("momentum_buffer", "momentum_buffer")]
        )
        for live_key, want_key in fields:
            if new.get(want_key) is None:
                continue
            if live_key not in got:
                ok, worst = False, (math.inf, n, live_key, math.inf)
                continue
            good, diff, tol = R.state_close(
                got[live_key],
                new[want_key],
                "param" if live_key == "fp32" else "m",
                saved=prev["param"] if live_key == "fp32" else None,
            )
            ratio = diff / tol if tol > 0 else (0.0 if diff == 0 else math.inf)
            if ratio > worst[0]:
                worst = (ratio, n, live_key, diff)
            ok = ok and good
        return ok, worst
