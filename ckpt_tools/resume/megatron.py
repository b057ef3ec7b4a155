"""`ckpt resume` of a Megatron-LM checkpoint (legacy or torch_dist): Megatron-LM's own pretrain_gpt.py rebuilt
from the checkpoint's `args` (`resume.workers.megatron`), at the saved TP and PP or, for torch_dist, at others
(DP: `--nproc` / (TP x PP)); the LR each resumed iteration must use from Megatron's schedule formula
(`schedules.megatron`) on the saved scheduler state, param groups and args."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import CkptError, UnsupportedCheckpoint
from ..formats.dcp import DcpItems
from ..read import pickle_reader as pr
from ..read.tree import Checkpoint, GroupNode, node_to_python
from ..schedules.megatron import expected_lrs
from ..write.megatron_write import _dist_iter, rank_files
from .common import FrameworkPlan, plan_header, _expected_lrs, _gpus, inert_to_json
from .verdict import SavedState


#: Megatron flags that reshape the LR schedule (with --override-opt_param-scheduler they replace the saved one)
SCHEDULE_FLAGS = frozenset(
    (
        "--lr",
        "--min-lr",
        "--lr-decay-style",
        "--lr-decay-iters",
        "--lr-decay-samples",
        "--lr-warmup-iters",
        "--lr-warmup-samples",
        "--lr-warmup-fraction",
        "--lr-warmup-init",
        "--train-iters",
        "--train-samples",
        "--lr-wsd-decay-style",
        "--lr-wsd-decay-iters",
        "--lr-wsd-decay-samples",
        "--global-batch-size",
    )
)


class _Sizes(NamedTuple):
    """The saved and the resumed sizes: TP, PP, the number of processes, the saved DP."""

    saved_tp: int
    saved_pp: int
    dp: int
    tp: int
    pp: int
    n: int


def plan_megatron(
    ck: Checkpoint,
    path: Path,
    *,
    steps: int,
    nproc: int | None,
    device: str,
    model: str,
    extra_args: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
) -> FrameworkPlan:
    """Validate (the saved args, what this resume cannot relaunch, the Megatron-LM checkout), choose the sizes,
    derive the expected LRs and the run's length, build the plan."""
    if model not in ("auto", "real"):
        raise CkptError(
            f"--model {model!r}: a Megatron-LM checkpoint resumes with the model its args describe", hint="drop --model"
        )
    args = inert_to_json(node_to_python(ck.tree.children.get("args", GroupNode())) or {})
    sched = inert_to_json(node_to_python(ck.tree.children.get("scheduler", GroupNode())) or {})
    raw = node_to_python(ck.optimizer.children.get("param_groups", GroupNode())) if ck.optimizer else None
    groups = [raw[k] for k in sorted(raw, key=int)] if isinstance(raw, dict) else list(raw or [])
    root = _refuse(ck, path, args, tp, pp)
    sizes = _sizes(ck, path, nproc, device, tp, pp)
    iteration = ck.counters.global_step
    if iteration is None:
        raise CkptError("the checkpoint records no iteration", path=path)
    user = shlex.split(extra_args or "")
    rows, how = _expected(user, sched, groups, args, steps)
    run, length = _run_length(args, iteration, steps, user, path)
    notes = _notes(ck, root, args, sizes, device, length, run, user)
    saved = SavedState(
        format=ck.format,
        global_step=iteration,
        optimizer_step=ck.counters.optimizer_step,
        skipped_steps=None,
        param_group_lrs=tuple(ck.lr.param_groups),
        initial_lrs=None,
        scheduler_state="megatron",
        scheduler_position=sched.get("num_steps"),
        base_lrs=None,
        loss=None,
        loss_key=None,
        ds_config={},
        has_universal_info=False,
        dp=sizes.dp,
        tp=sizes.saved_tp,
        pp=sizes.saved_pp,
    )
    tp, pp, n = sizes.tp, sizes.pp, sizes.n
    return FrameworkPlan(
        **plan_header("megatron", path, saved, steps, device, n, dp=n // (tp * pp)),
        model="real (Megatron-LM GPT from the saved args)",
        load_dir=str(Path(ck.path).resolve()),
        expected_lrs=_expected_lrs(rows) if rows else None,
        lr_source=how,
        notes=tuple(notes),
        tp=tp,
        pp=pp,
        worker={
            "saved_args": args,
            "iteration": iteration,
            "tp": tp,
            "pp": pp,
            "run_argv": run,
            "extra_args": extra_args or "",
            "legacy": ck.format == "megatron_legacy",
            "opt_state_source": "each rank's model_optim_rng.pt (ckpt's reader)",
            "no_opt_check": "loaded by Megatron's own load_checkpoint; checked in closed form for "
            "a legacy checkpoint resumed at its saved TP / PP only (the Adam step "
            "continuing is checked above)",
        },
    )


def _refuse(ck: Checkpoint, path: Path, args: dict[str, Any], tp: int | None, pp: int | None) -> str:
    """What this resume cannot relaunch, refused in one line: no saved args, a Mixture-of-Experts run at other
    sizes, the distributed optimizer, no Megatron-LM checkout. Returns the checkout (MEGATRON_LM_DIR)."""
    if not args:
        raise CkptError(
            "the checkpoint holds no Megatron `args`: the model and the run cannot be rebuilt from it", path=path
        )
    saved_sizes = (ck.topology.tp or 1, ck.topology.pp or 1)
    if args.get("num_experts") and (tp or saved_sizes[0], pp or saved_sizes[1]) != saved_sizes:
        # not run yet: the experts would be re-cut over another expert-TP / pipeline layout at load
        raise UnsupportedCheckpoint(
            f"a Megatron Mixture-of-Experts checkpoint resumed at another TP / PP (saved TP {saved_sizes[0]} x PP "
            f"{saved_sizes[1]}; asked --tp {tp}, --pp {pp}): `ckpt resume` relaunches MoE runs at their saved sizes "
            "only",
            path=path,
            hint="drop --tp / --pp",
        )
    if args.get("use_distributed_optimizer"):
        # measured with core_v0.16.1: without Apex / TransformerEngine (none on a CPU) the distributed optimizer's
        # load reads an Adam `step` the fresh torch optimizer does not have yet (legacy: KeyError 'step' in
        # _set_main_param_and_optimizer_states; torch_dist: `assert len(steps) == 1` in state_dict)
        raise UnsupportedCheckpoint(
            "a Megatron-LM checkpoint of the distributed optimizer: Megatron-LM's loader "
            "without Apex or TransformerEngine reads an Adam step the fresh optimizer does "
            "not hold yet, and ckpt's resume has not been run with either",
            path=path,
            hint="inspect / diff / export / convert it with ckpt; resume it with "
            "Megatron-LM's own launch where Apex or TransformerEngine is "
            "installed",
        )
    root = os.environ.get("MEGATRON_LM_DIR")
    if not root or not (Path(root) / "pretrain_gpt.py").is_file():
        raise CkptError(
            "resuming a Megatron-LM checkpoint runs Megatron-LM's own pretrain_gpt.py, which is not in "
            "the megatron-core wheel",
            path=path,
            hint="set MEGATRON_LM_DIR to a checkout of the Megatron-LM release that wrote it "
            "(e.g. git clone -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM)",
        )
    return root


def _sizes(ck: Checkpoint, path: Path, nproc: int | None, device: str, tp: int | None, pp: int | None) -> _Sizes:
    """TP / PP as asked or saved, the processes (`--nproc` or TP x PP x the saved DP), one GPU each on CUDA."""
    saved_tp, saved_pp, dp = ck.topology.tp or 1, ck.topology.pp or 1, ck.topology.dp or 1
    tp, pp = tp or saved_tp, pp or saved_pp
    n = nproc or tp * pp * dp
    if n % (tp * pp):
        raise CkptError(f"--nproc {n} is not a multiple of TP x PP = {tp * pp}", path=path)
    if device == "cuda" and n > _gpus():
        raise CkptError(
            f"{n} processes (TP {tp} x PP {pp} x DP {n // (tp * pp)}) need {n} GPUs; {_gpus()} "
            "visible (NCCL takes one GPU per process)",
            path=path,
            hint="resume at a smaller size (--tp / --pp / --nproc) or on the CPU (--device cpu)",
        )
    return _Sizes(saved_tp, saved_pp, dp, tp, pp, n)


def _expected(
    user: list[str], sched: dict[str, Any], groups: list, args: dict[str, Any], steps: int
) -> tuple[list | None, str]:
    """The LR of each resumed iteration from Megatron's formula on the saved state, or (None, why)."""
    reshaped = sorted(f for f in user if f.split("=", 1)[0] in SCHEDULE_FLAGS)
    if "--override-opt_param-scheduler" in user and reshaped:
        return None, (
            f"your --override-opt_param-scheduler with {', '.join(reshaped)}: the command line's "
            "schedule replaces the saved one, which ckpt does not model"
        )
    try:
        return expected_lrs(sched, groups, args, steps)
    except ValueError as e:
        return None, str(e)


def _run_length(args: dict[str, Any], iteration: int, steps: int, user: list[str], path: Path) -> tuple[list[str], str]:
    """The flags that make the relaunch run `steps` iterations, and how (a note).

    Megatron asserts that the launch's schedule (train_iters / train_samples enter the weight decay schedule)
    equals the saved one, so the saved length is kept and --exit-interval stops the run after `steps`
    iterations; a run that had reached its end is extended, with the saved schedule taken as saved."""
    end = iteration + steps
    gbs = args.get("global_batch_size") or 0
    if args.get("train_samples"):
        if (args.get("consumed_train_samples") or 0) + steps * gbs > args["train_samples"]:
            raise CkptError(
                f"the run's train_samples {args['train_samples']} end before {steps} more iterations",
                path=path,
                hint="pass fewer --steps",
            )
        run = ["--train-samples", str(args["train_samples"]), "--exit-interval", str(end)]
        return run, f"the saved train_samples {args['train_samples']}, stopped by --exit-interval {end}"
    if args.get("train_iters") and end <= args["train_iters"]:
        run = ["--train-iters", str(args["train_iters"]), "--exit-interval", str(end)]
        return run, f"the saved train_iters {args['train_iters']}, stopped by --exit-interval {end}"
    if "--use-checkpoint-opt_param-scheduler" in user or "--override-opt_param-scheduler" in user:
        return [
            "--train-iters",
            str(end),
        ], f"the run had reached its train_iters {args.get('train_iters')}: extended to {end}"
    return ["--train-iters", str(end), "--use-checkpoint-opt_param-scheduler"], (
        f"the run had reached its train_iters {args.get('train_iters')}: extended to {end} with "
        "--use-checkpoint-opt_param-scheduler (the schedule as saved)"
    )


def _notes(
    ck: Checkpoint,
    root: str,
    args: dict[str, Any],
    sizes: _Sizes,
    device: str,
    length: str,
    run: list[str],
    user: list[str],
) -> list[str]:
    """What the relaunch changes and why, in the plan's notes; appends --no-load-rng to `run` where the saved RNG
    state cannot be loaded."""
    tp, pp, n = sizes.tp, sizes.pp, sizes.n
    notes = [
        f"Megatron-LM from {root}, rebuilt from the checkpoint's {len(args)} saved args (the parser's "
        f"options whose saved value is not the default), at TP {tp}, PP {pp}, DP {n // (tp * pp)}",
        "CPU run-time changes: CUDA redirected to the CPU, gloo, the local transformer implementation and no "
        "fused kernels (the same maths in eager PyTorch)"
        if device == "cpu"
        else "on CUDA: NCCL, one GPU per process, the saved flags as they are",
    ]
    notes.append(f"length: {length}")
    if (tp, pp) != (sizes.saved_tp, sizes.saved_pp):
        notes.append(
            f"saved at TP {sizes.saved_tp} x PP {sizes.saved_pp}, resumed at TP {tp} x PP {pp}: Megatron's "
            "dist-checkpointing reshards the torch_dist checkpoint at load"
        )
    if n // (tp * pp) != sizes.dp:
        notes.append(f"saved at DP {sizes.dp}, resumed at DP {n // (tp * pp)}")
    if ck.format == "megatron_legacy" and not {"--no-load-rng", "--finetune"} & set(user) and not _legacy_has_rng(ck):
        # Megatron's legacy load asks for the RNG state unless told not to, and calls sys.exit() without it
        run.append("--no-load-rng")
        notes.append(
            "RNG: the rank files hold no rng_state: relaunched with --no-load-rng (Megatron's legacy "
            "load exits without it), so the generators are seeded afresh"
        )
    if device == "cuda" and not {"--no-load-rng", "--finetune"} & set(run + user) and _rng_not_cuda(ck):
        # measured on an H100: Megatron's load hands the saved `cuda_rng_state` to torch.cuda.set_rng_state
        run.append("--no-load-rng")
        notes.append(
            "RNG: the saved CUDA generator states are not CUDA's (saved by a run on the CPU, whose "
            "generator state is 5056 bytes; CUDA's is 16): relaunched with --no-load-rng, so the "
            "generators are seeded afresh"
        )
    if args.get("mock_data"):
        notes.append("the run's data: Megatron's mock dataset, as saved")
    elif args.get("data_path"):
        notes.append(f"the run's data from the saved data_path {args['data_path']}")
    return notes


def _rng_not_cuda(ck: Checkpoint) -> bool:
    """Whether a saved `cuda_rng_state` (a legacy rank file's `rng_state`, a torch_dist `rng_state/*` item, the RNG
    tracker's states included) is not a CUDA generator state (16 bytes: seed and offset), read without unpickling."""

    def odd(x: Any, cuda: bool = False) -> bool:  # cuda: under `cuda_rng_state` or the tracker's states
        if isinstance(x, pr.TensorRef):
            return cuda and tuple(x.shape) != (16,)
        if isinstance(x, dict):
            return any(odd(v, cuda or k in ("cuda_rng_state", "rng_tracker_states")) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return any(odd(v, cuda) for v in x)
        return False

    if ck.format == "megatron_legacy":
        return any(odd(pr.load(f).obj.get("rng_state")) for f in rank_files(ck).values())
    items = DcpItems(_dist_iter(ck))
    return any(
        odd(items.value(key)) for key in items.sdm if key.split("/", 1)[0] == "rng_state" and (key, None) in items.items
    )


def _legacy_has_rng(ck: Checkpoint) -> bool:
    """Whether every rank file of a Megatron legacy checkpoint holds an `rng_state` (read without unpickling)."""
    return all(pr.load(f).obj.get("rng_state") is not None for f in rank_files(ck).values())
