"""`ckpt resume`: load a DeepSpeed checkpoint into a real engine, train a few steps, say whether the run continued.

Resumes go wrong quietly — an Adam step that restarts, a scheduler whose state was not loaded and warms up
again, a loss jump nobody can tell from data noise — so the verdict compares what the resumed engine did
with values read from the checkpoint *without* the engine (`open_checkpoint`), and the expected LR is
computed here from the saved scheduler state, never asked of the engine's scheduler.

Order of use:

    plan = plan_resume(path, steps=2, ...)        # reads metadata only; rejects bad option combinations
    result = run_resume(plan, on_event=print)     # converts to universal if needed, launches, checks
    result.ok, result.checks, result.records      # data only: nothing here prints

The training runs in `ckpt_tools.train.resume_worker` under `python -m torch.distributed.run` (NCCL on CUDA,
gloo on CPU, the same code). Re-topology (another DP size, TP or PP) goes through a DeepSpeed universal
checkpoint made by `converter`, a single function so that `ckpt to-universal` can replace DeepSpeed's.
"""
from __future__ import annotations

import collections
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ..ds_schedules import DS_SCHEDULERS, lr_at as _ds_scheduler_lr
from ..errors import CkptError, UnsupportedCheckpoint
from ..tree import Checkpoint, GroupNode, OpaqueNode, TensorNode, ValueNode

WORKER_MODULE = "ckpt_tools.train.resume_worker"
REFERENCE_KIND = "ckpt-resume-reference"
SUPPORTED_FORMATS = ("deepspeed_zero", "deepspeed_pipeline", "deepspeed_universal")
# Keys a training script may keep in the client state for the loss at the checkpoint (Megatron logs it
# elsewhere; many custom loops save one of these).
CLIENT_LOSS_KEYS = ("loss", "lm_loss", "train_loss", "last_loss")
LR_REL_TOL = 1e-6

Converter = Callable[[Path, Path, bool], None]


# --- what the checkpoint says, read without the engine --------------------------------------------


@dataclass(frozen=True)
class SavedState:
    """Counters and scheduler state as the checkpoint records them (None: not recorded)."""

    format: str
    global_step: int | None
    optimizer_step: int | None
    skipped_steps: int | None
    param_group_lrs: tuple[float, ...]
    initial_lrs: tuple[float, ...] | None  # torch schedulers' `initial_lr` in the saved param groups
    scheduler_state: str  # "torch", "deepspeed" or "none"
    scheduler_position: int | None  # torch `last_epoch` / DeepSpeed `last_batch_iteration`
    base_lrs: tuple[float, ...] | None
    loss: float | None  # a loss found in the client state
    loss_key: str | None
    ds_config: dict[str, Any]
    has_universal_info: bool
    dp: int
    tp: int
    pp: int


def node_to_python(node: Any) -> Any:
    if isinstance(node, ValueNode):
        return node.value
    if isinstance(node, (GroupNode, OpaqueNode)):
        return {k: node_to_python(v) for k, v in node.children.items()}
    if isinstance(node, TensorNode):
        return node.value
    return node


def saved_state(ck: Checkpoint) -> SavedState:
    kids = ck.tree.children
    sched = node_to_python(kids.get("scheduler", GroupNode())) or {}
    if "last_batch_iteration" in sched:
        kind, position = "deepspeed", sched["last_batch_iteration"]
    elif "last_epoch" in sched:
        kind, position = "torch", sched["last_epoch"]
    else:
        kind, position = "none", None
    groups = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) or {}
    initial = [g.get("initial_lr") for _, g in sorted(groups.items(), key=lambda kv: int(kv[0]))]
    client = node_to_python(kids.get("client_state", GroupNode())) or {}
    loss_key = next((k for k in CLIENT_LOSS_KEYS if isinstance(client.get(k), (int, float))), None)
    topo = ck.topology
    return SavedState(
        format=ck.format, global_step=ck.counters.global_step, optimizer_step=ck.counters.optimizer_step,
        skipped_steps=ck.counters.skipped_steps, param_group_lrs=tuple(ck.lr.param_groups),
        initial_lrs=tuple(initial) if initial and all(x is not None for x in initial) else None,
        scheduler_state=kind, scheduler_position=position,
        base_lrs=tuple(ck.lr.base_lrs) if ck.lr.base_lrs else None,
        loss=float(client[loss_key]) if loss_key else None, loss_key=loss_key,
        ds_config=node_to_python(kids.get("config", GroupNode())) or {},
        has_universal_info=bool(node_to_python(kids.get("universal_checkpoint_info", GroupNode()))),
        dp=topo.dp or 1, tp=topo.tp or 1, pp=topo.pp or 1,
    )


# --- the plan -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResumePlan:
    """Everything decided before any process starts; `worker_plan()` is what the worker reads."""

    path: str
    saved: SavedState
    steps: int
    device: str
    nproc: int
    dp: int
    tp: int
    pp: int
    model: str
    ds_config: dict[str, Any]
    micro_batch: int
    gas: int
    orig_gas: int
    universal: bool  # load with {"checkpoint": {"load_universal": true}}
    convert_from: str | None  # a tag folder to convert to universal first (None: load `load_dir` as is)
    inject_missing_state: bool
    load_dir: str | None  # None until the conversion has made it
    tag: str | None
    load_lr_scheduler_states: bool
    data: str | None
    lambda_epochs: tuple[int, ...]
    notes: tuple[str, ...] = ()

    def worker_plan(self) -> dict[str, Any]:
        return {
            "device": self.device, "ds_config": self.ds_config, "dp": self.dp, "tp": self.tp, "pp": self.pp,
            "model": self.model, "lambda_epochs": list(self.lambda_epochs), "load_dir": self.load_dir,
            "tag": self.tag, "load_lr_scheduler_states": self.load_lr_scheduler_states,
            "micro_batch": self.micro_batch, "orig_gas": self.orig_gas, "gas": self.gas, "steps": self.steps,
            "data": self.data,
        }


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _auto_model(ck: Checkpoint) -> str:
    if ck.format == "deepspeed_pipeline":
        return "megatron-gpt"
    # A universal checkpoint of a pipeline run keeps DeepSpeed's '<layer>.<local name>' parameter names.
    names = list(ck.model.children) or list(ck.optimizer.children.get("state", GroupNode()).children)
    if names and all(n.split(".", 1)[0].isdigit() for n in names):
        return "megatron-gpt"
    return "tiny-gpt"


def _load_location(path: Path, tag: str | None) -> tuple[Path, str | None]:
    """(load_dir, tag) for `engine.load_checkpoint`: the folder holding `latest`/`latest_universal`, or the
    tag folder's parent plus its name."""
    if (path / "latest").is_file() or (path / "latest_universal").is_file():
        return path, None
    if tag and path.name == tag:
        return path.parent, tag
    return path, tag


def untrusted_globals(ck: Checkpoint) -> dict[str, list[str]]:
    """file -> unknown pickle globals, over EVERY file of the checkpoint: opening it parses only some
    (one ZeRO-3 model-states file of many), but DeepSpeed's loader unpickles them all."""
    from .. import pickle_reader

    found = {w.path or "?": [w.message.split(":")[0].removeprefix("pickle names ")]
             for w in ck.warnings if w.code == "unknown-global"}
    base = Path(ck.path)
    base = base if base.is_dir() else base.parent
    out: dict[str, list[str]] = {}
    for f in ck.files:
        try:
            loaded = pickle_reader.load(base / f.path)
        except CkptError:
            continue  # not a pickle (safetensors, text); a broken one fails the load anyway
        if loaded.source is not None:
            loaded.source.close()
        if loaded.unknown_globals:
            out[f.path] = loaded.unknown_globals
    return out or found


def plan_resume(path: str | os.PathLike, *, steps: int, nproc: int | None = None, device: str = "auto",
                universal: bool = False, tp: int | None = None, pp: int | None = None,
                model: str = "auto", config: dict[str, Any] | None = None, data: str | None = None,
                trust_pickles: bool = False) -> ResumePlan:
    """Decide how to resume the checkpoint at `path`: world size, topology, launch config, model, data.

    Bad combinations are rejected here, naming the option, before anything is converted or launched.
    DeepSpeed's `load_checkpoint` unpickles with torch's full (not weights-only) loader, which runs whatever
    a pickle names; so a checkpoint whose pickles name globals outside the frameworks' own classes is
    refused unless `trust_pickles`.
    """
    from .. import open_checkpoint

    if steps < 1:
        raise CkptError("--steps must be at least 1")
    p = Path(path)
    ck = open_checkpoint(p)
    if not trust_pickles:
        unknown = untrusted_globals(ck)
        if unknown:
            rel, names = next(iter(unknown.items()))
            more = f" ({len(unknown) - 1} more files like this)" if len(unknown) > 1 else ""
            raise UnsupportedCheckpoint(
                f"{rel}: pickle names {', '.join(names)}; resuming runs DeepSpeed's torch.load, which would "
                f"execute it{more}", path=p,
                hint="inspect it with `ckpt inspect`; pass --trust-pickles only if you trust where it came from")
    if ck.format not in SUPPORTED_FORMATS:
        raise UnsupportedCheckpoint(f"`ckpt resume` trains DeepSpeed checkpoints; this is {ck.format}", path=p,
                                    hint=f"supported: {', '.join(SUPPORTED_FORMATS)}")
    saved = saved_state(ck)
    notes: list[str] = []

    if device == "auto":
        device = "cuda" if _visible_gpus() else "cpu"
    if device not in ("cpu", "cuda"):
        raise CkptError(f"--device {device!r}: use cpu, cuda or auto")
    if device == "cuda" and not _visible_gpus():
        raise CkptError("--device cuda: no CUDA device is visible", hint="use --device cpu")

    new_tp, new_pp = tp or saved.tp, pp or saved.pp
    is_universal = ck.format == "deepspeed_universal"
    retopo = (new_tp, new_pp) != (saved.tp, saved.pp)
    if retopo and not is_universal:
        universal = True
        notes.append(f"TP x PP {saved.tp}x{saved.pp} -> {new_tp}x{new_pp} goes through a universal checkpoint")
    universal = universal or is_universal
    mp = new_tp * new_pp
    if nproc is None:
        if device == "cuda" and universal:
            nproc = (_visible_gpus() // mp) * mp  # re-topology: use every visible GPU
        else:
            nproc = saved.dp * mp
        if device == "cuda" and nproc > _visible_gpus():
            raise CkptError(f"the checkpoint needs {nproc} ranks but {_visible_gpus()} GPUs are visible",
                            hint="resume through a universal checkpoint: add --universal (and --nproc)")
    if nproc < 1 or nproc % mp:
        raise CkptError(f"--nproc {nproc} is not a multiple of TP x PP = {mp}")
    new_dp = nproc // mp
    if new_dp != saved.dp and not universal:
        raise CkptError(f"the checkpoint was saved at DP={saved.dp}; DP={new_dp} needs a universal checkpoint "
                        "(ZeRO refuses to repartition)", hint="add --universal")

    cfg = json.loads(json.dumps(saved.ds_config))
    if not cfg:
        raise CkptError("the checkpoint holds no ds_config", path=p, hint="pass the run's config with --config")
    micro = int(cfg.get("train_micro_batch_size_per_gpu", 1))
    orig_gas = int(cfg.get("gradient_accumulation_steps", 1))
    # Keep the uninterrupted run's global batch: fewer DP ranks accumulate more micro-batches.
    if (saved.dp * orig_gas) % new_dp:
        raise CkptError(f"the global batch of {saved.dp * orig_gas} micro-batches cannot be shared by DP={new_dp}",
                        hint="pick --nproc so that the DP size divides the original DP x accumulation steps")
    cfg["gradient_accumulation_steps"] = saved.dp * orig_gas // new_dp
    cfg["train_batch_size"] = micro * saved.dp * orig_gas
    if config:
        cfg = _deep_merge(cfg, config)
        micro = int(cfg.get("train_micro_batch_size_per_gpu", micro))
    if universal:
        cfg = _deep_merge(cfg, {"checkpoint": {"load_universal": True}})
    gas = int(cfg.get("gradient_accumulation_steps", 1))

    convert_from = None
    inject = False
    load_dir: Path | None
    tag = ck.details.get("tag")
    if universal and not is_universal:
        if not saved.has_universal_info and saved.tp > 1:
            raise UnsupportedCheckpoint(
                "TP>1 checkpoint without universal_checkpoint_info: DeepSpeed's converter would concatenate "
                "replicated and row-parallel tensors on dim 0", path=p,
                hint="resume at the saved TP (drop --tp/--universal) or add the info to the model states")
        inject = not saved.has_universal_info
        base, t = _load_location(p, tag)
        tag_name = t or (base / "latest").read_text().strip()
        convert_from = str(base / tag_name)
        load_dir = None
    else:
        base, t = _load_location(p, tag)
        load_dir, tag = base, t

    if model == "auto":
        model = _auto_model(ck)

    # The scheduler epochs whose lambda the worker evaluates for the expected LR of a torch LambdaLR:
    # the saved last_epoch onwards, or the global step when the state is missing (what it should have been).
    start = saved.scheduler_position if saved.scheduler_state == "torch" else (saved.global_step or 0)
    lambda_epochs = tuple(start + k for k in range(steps))
    load_sched = saved.scheduler_state != "none"
    if not load_sched and (cfg.get("scheduler") or saved.base_lrs is not None):
        notes.append("the checkpoint holds no scheduler state: the scheduler starts fresh, as a training "
                     "script that tolerates a missing state would")
    return ResumePlan(
        path=str(p), saved=saved, steps=steps, device=device, nproc=nproc, dp=new_dp, tp=new_tp, pp=new_pp,
        model=model, ds_config=cfg, micro_batch=micro, gas=gas, orig_gas=orig_gas, universal=universal,
        convert_from=convert_from, inject_missing_state=inject, load_dir=str(load_dir) if load_dir else None,
        tag=tag if load_dir is not None else None, load_lr_scheduler_states=load_sched, data=data,
        lambda_epochs=lambda_epochs, notes=tuple(notes),
    )


# --- universal conversion (swappable) ---------------------------------------------------------------


def ckpt_to_universal(tag_dir: Path, out_dir: Path, inject_missing_state: bool) -> None:
    """`ckpt to-universal` (the default converter): `tag_dir` -> `out_dir/<tag>_universal` +
    `out_dir/latest_universal`. Plain ZeRO (TP=1) needs no injected state; TP merges follow the
    checkpoint's universal_checkpoint_info, and disagreeing TP replicas stop the conversion."""
    from .to_universal import execute, plan_to_universal

    execute(plan_to_universal(tag_dir, out_dir))


def deepspeed_to_universal(tag_dir: Path, out_dir: Path, inject_missing_state: bool) -> None:
    """DeepSpeed's own `ds_to_universal`, kept to compare against: same output layout as `ckpt_to_universal`.

    `inject_missing_state` adds an empty universal_checkpoint_info: right at TP=1, wrong at TP>1
    (`plan_resume` refuses that case).
    """
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(out_dir / f"{tag_dir.name}_universal"), "--num_extract_workers", "2",
           "--num_merge_workers", "1"]
    if inject_missing_state:
        cmd.append("--inject_missing_state")
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_cpu_env())
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise CkptError(f"ds_to_universal failed (exit {proc.returncode}):\n{tail}", path=tag_dir)


# --- launching ------------------------------------------------------------------------------------


def _cpu_env() -> dict[str, str]:
    from ..samples import worker_env

    return worker_env()


def _env(device: str) -> dict[str, str]:
    if device == "cpu":
        return _cpu_env()
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cuda", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONHASHSEED="0")
    return env


class WorkerFailed(CkptError):
    """The training processes exited with an error; the message carries the log tail."""


def _launch(plan: ResumePlan, plan_file: Path, on_event: Callable[[dict], None] | None,
            timeout: float) -> list[dict[str, Any]]:
    from ..samples import free_port
    from ..train.resume_worker import RECORD_PREFIX

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(plan.nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", WORKER_MODULE,
           "--plan", str(plan_file)]
    events: list[dict[str, Any]] = []
    tail: collections.deque[str] = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, env=_env(plan.device), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    timer = None
    try:
        import threading

        timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(RECORD_PREFIX):
                ev = json.loads(line[len(RECORD_PREFIX):])
                events.append(ev)
                if on_event:
                    on_event(ev)
            else:
                tail.append(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        if timer:
            timer.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if rc != 0:
        log = "\n".join(line for line in tail if line.strip())
        raise WorkerFailed(f"training processes failed (exit {rc}); last output:\n{log}",
                           hint="rerun with CKPT_DEBUG=1, or check --model/--config")
    if not events or events[-1].get("event") != "done":
        raise WorkerFailed("training processes ended without finishing")
    return events


# --- the verdict ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    step: int
    loss: float
    loss_mean: float
    lr: tuple[float, ...]
    grad_norm: float | None
    optimizer_step: int | None
    tokens_per_s: float | None
    seconds: float
    skipped_steps: int


@dataclass(frozen=True)
class CheckRow:
    step: int
    expected: Any
    actual: Any
    ok: bool


@dataclass(frozen=True)
class Check:
    """One line of the verdict: status is "pass", "fail" or "n/a" (not available, with the reason)."""

    name: str
    status: str
    detail: str
    rows: tuple[CheckRow, ...] = ()


@dataclass(frozen=True)
class ResumeResult:
    plan: ResumePlan
    setup: dict[str, Any]
    loaded: dict[str, Any]
    records: tuple[StepRecord, ...]
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        plan = asdict(self.plan)
        return {"ok": self.ok, "plan": plan, "setup": self.setup, "loaded": self.loaded,
                "records": [asdict(r) for r in self.records], "checks": [asdict(c) for c in self.checks]}


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
        return ([_ds_scheduler_lr(sched_cfg, start + i, group_lrs) for i in k],
                f"{sched_cfg['type']} from the launch config at {src}")
    if s.scheduler_state == "deepspeed":
        return None, "the checkpoint has a DeepSpeed scheduler state but the launch config names no scheduler"
    if live is not None or s.scheduler_state == "torch":
        values = setup.get("lambda_values")
        if live != "LambdaLR" or not values:
            return None, (f"the resumed run's scheduler is {live}; the expected LR is computed for LambdaLR "
                          "(give the factory's TrainSetup an lr_lambda)")
        if s.scheduler_state == "torch" and s.base_lrs:
            base, src = list(s.base_lrs), f"saved base_lrs x lambda(last_epoch={s.scheduler_position} + k)"
        else:
            base = list(s.initial_lrs or s.param_group_lrs)
            src = (f"NO saved scheduler state; initial_lr x lambda(global_step={s.global_step} + k), what a "
                   "scheduler stepped once per optimizer step would be at")
        return [[b * f for b, f in zip(base, values[i])] for i in k], src
    return [list(s.param_group_lrs) for _ in k], "no scheduler: the saved param_groups lr"


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_REL_TOL, abs_tol=1e-12)


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
        raise CkptError("not a reference: expected a list of {step, loss} under 'records' or 'history'", path=p,
                        hint="make one with `ckpt resume EARLIER_CKPT --steps N --record-reference REF.json`")
    return {int(r["step"]): float(r["loss"]) for r in doc}


def reference_doc(result: ResumeResult) -> dict[str, Any]:
    """What `--record-reference` writes: the per-step records of this run, to compare a later resume with."""
    return {"kind": REFERENCE_KIND, "version": 1, "checkpoint": result.plan.path,
            "topology": {"dp": result.plan.dp, "tp": result.plan.tp, "pp": result.plan.pp},
            "device": result.plan.device, "records": [asdict(r) for r in result.records]}


def verdict(plan: ResumePlan, setup: dict[str, Any], loaded: dict[str, Any], records: list[StepRecord], *,
            reference: dict[int, float] | None = None, loss_tol: float = 1e-3,
            jump_tol: float = 0.1) -> list[Check]:
    """The three checks: counters continue, the LR is what the saved schedule prescribes, the loss continues."""
    s = plan.saved
    checks: list[Check] = []

    # (1) counters
    rows = []
    if s.global_step is None:
        checks.append(Check("global step", "n/a", "the checkpoint records no global step"))
    else:
        rows = [CheckRow(r.step, s.global_step + i + 1, r.step, r.step == s.global_step + i + 1)
                for i, r in enumerate(records)]
        ok = all(r.ok for r in rows)
        checks.append(Check("global step", "pass" if ok else "fail",
                            f"continues from the saved global_steps={s.global_step}" if ok else
                            f"does not continue from the saved global_steps={s.global_step}", tuple(rows)))
    if s.optimizer_step is None:
        checks.append(Check("optimizer step", "n/a", "the checkpoint records no Adam step"))
    else:
        rows = []
        for i, r in enumerate(records):
            # a skipped step (fp16 overflow) does not advance Adam
            want = s.optimizer_step + i + 1 - (r.skipped_steps - (s.skipped_steps or 0))
            rows.append(CheckRow(r.step, want, r.optimizer_step, r.optimizer_step == want))
        ok = all(r.ok for r in rows)
        checks.append(Check("optimizer step", "pass" if ok else "fail",
                            f"Adam step continues from the saved {s.optimizer_step}" if ok else
                            f"Adam step does not continue from the saved {s.optimizer_step} (reset?)", tuple(rows)))

    # (2) LR
    want, how = expected_lrs(plan, setup)
    if want is None:
        checks.append(Check("learning rate", "n/a", how))
    else:
        rows = [CheckRow(r.step, w, list(r.lr), len(w) == len(r.lr) and all(_close(a, b) for a, b in zip(w, r.lr)))
                for w, r in zip(want, records)]
        ok = all(r.ok for r in rows)
        bad = next((r for r in rows if not r.ok), None)
        detail = f"expected: {how}" if ok else (f"step {bad.step}: expected {bad.expected}, the engine used "
                                                f"{bad.actual} (expected: {how})")
        checks.append(Check("learning rate", "pass" if ok else "fail", detail, tuple(rows)))

    # (3) loss
    if reference is not None:
        rows = [CheckRow(r.step, reference[r.step], r.loss, abs(reference[r.step] - r.loss) <= loss_tol)
                for r in records if r.step in reference]
        if not rows:
            checks.append(Check("loss", "fail", f"the reference has none of the resumed steps "
                                                f"{records[0].step}..{records[-1].step}"))
        else:
            diff = max(abs(r.expected - r.actual) for r in rows)
            ok = all(r.ok for r in rows)
            exact = all(r.expected == r.actual for r in rows)
            checks.append(Check("loss", "pass" if ok else "fail",
                                f"{len(rows)} steps vs the reference: max |diff| {diff:.3g} "
                                f"({'bitwise equal' if exact else f'tolerance {loss_tol:g}'})", tuple(rows)))
    elif s.loss is not None and records:
        first = records[0]
        ok = first.loss <= s.loss * (1 + jump_tol)
        checks.append(Check("loss", "pass" if ok else "fail",
                            f"first resumed loss {first.loss:.6g} vs client state {s.loss_key}={s.loss:.6g} "
                            f"(allowed jump {jump_tol:.0%})", (CheckRow(first.step, s.loss, first.loss, ok),)))
    else:
        checks.append(Check("loss", "n/a", "no --reference and no loss saved in the checkpoint's client state"))
    return checks


def run_resume(plan: ResumePlan, *, on_event: Callable[[dict], None] | None = None,
               converter: Converter = ckpt_to_universal, reference: dict[int, float] | None = None,
               loss_tol: float = 1e-3, jump_tol: float = 0.1, work_dir: str | os.PathLike | None = None,
               timeout: float = 3600) -> ResumeResult:
    """Convert (if the plan says so), launch the training processes, and judge the records.

    Scratch files (the worker plan, a universal conversion) go to `work_dir` — never into the checkpoint
    folder — and a temporary `work_dir` is removed afterwards.
    """
    scratch = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="ckpt-resume-"))
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        if plan.convert_from is not None:
            out = scratch / "universal"
            if on_event:
                on_event({"event": "converting", "source": plan.convert_from, "target": str(out)})
            converter(Path(plan.convert_from), out, plan.inject_missing_state)
            plan = replace(plan, load_dir=str(out), tag=None)
        plan_file = scratch / "worker_plan.json"
        plan_file.write_text(json.dumps(plan.worker_plan(), indent=1))
        events = _launch(plan, plan_file, on_event, timeout)
    finally:
        if work_dir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    setup = next((e for e in events if e["event"] == "setup"), {})
    loaded = next((e for e in events if e["event"] == "loaded"), {})
    records = [StepRecord(step=e["step"], loss=e["loss"], loss_mean=e["loss_mean"], lr=tuple(e["lr"]),
                          grad_norm=e["grad_norm"], optimizer_step=e["optimizer_step"],
                          tokens_per_s=e["tokens_per_s"], seconds=e["seconds"], skipped_steps=e["skipped_steps"])
               for e in events if e["event"] == "step"]
    checks = verdict(plan, setup, loaded, records, reference=reference, loss_tol=loss_tol, jump_tol=jump_tol)
    return ResumeResult(plan=plan, setup=setup, loaded=loaded, records=tuple(records), checks=tuple(checks))


__all__ = ["plan_resume", "run_resume", "deepspeed_to_universal", "expected_lrs", "verdict", "load_reference",
           "reference_doc", "ResumePlan", "ResumeResult", "StepRecord", "Check", "CheckRow", "SavedState",
           "saved_state"]
