"""Resume a Megatron-LM checkpoint (legacy `torch` or `torch_dist`) in Megatron-LM's own `pretrain` (pretrain_gpt.py's
dataset provider, forward step and GPT builder, imported from the checkout `MEGATRON_LM_DIR` names), with the model
and the run rebuilt from the checkpoint's own `args`: Megatron's parser options whose saved value differs from
the default are passed back (`workers.megatron_lm_args.relaunch_argv`), the parallel sizes from the plan, `--load` the
checkpoint, the run's length from the plan (the saved train_iters and `--exit-interval` after the plan's steps),
no save.

On a CPU the run gets the run-time changes the Megatron samples are made with (`workers.megatron_lm`: CUDA
redirected to the CPU, gloo, no compiled kernels) and `CPU_FLAGS` (the local transformer implementation, fusions
off: the same maths in eager PyTorch). On CUDA none of those: one GPU per process, NCCL and the saved flags as they
are (`import_megatron(cpu=False)` keeps only its changes that are not about the device).

Events (see `_common`): `loaded` after Megatron's own `load_checkpoint` (the iteration, the Adam step, the
scheduler's num_steps), one `step` per iteration (the iteration, each group's LR the iteration used, the LM loss
from the last pipeline stage, the Adam step after it, every rank's LRs, and for a legacy checkpoint resumed at its
saved TP / PP the closed-form AdamW check of the update from the state each rank file saved), `done`.
"""

from __future__ import annotations

import builtins
import json
import multiprocessing
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ckpt_tools.read import pickle_reader as pr
from ckpt_tools.resume.workers import _common as c
from ckpt_tools.samples.workers import megatron_lm as W
from ckpt_tools.samples.workers.megatron_lm_args import CPU_FLAGS, RELAUNCH_SKIP, parallel_argv, relaunch_argv
from ckpt_tools.train.procgroup import join


#: what a resume changes by design: counters and run state Megatron sets itself, and the CPU run-time flags
RUN_STATE = frozenset(
    (
        "iteration",
        "consumed_train_samples",
        "consumed_valid_samples",
        "skipped_train_samples",
        "curr_iteration",
        "do_train",
        "do_valid",
        "do_test",
        "model_type",
        "num_floating_point_operations_so_far",
        "exit_interval",
        "use_checkpoint_opt_param_scheduler",
    )
)
CPU_DESTS = frozenset(
    (
        "transformer_impl",
        "masked_softmax_fusion",
        "bias_gelu_fusion",
        "bias_dropout_fusion",
        "gradient_accumulation_fusion",
        "persist_layer_norm",
        "bias_swiglu_fusion",
        "apply_rope_fusion",
        "distributed_backend",
    )
)


def args_differ(saved: dict[str, Any], live: Any, skip: frozenset) -> list[list[Any]]:
    """[name, saved, live] for every saved arg the relaunched run holds with another value (`skip` aside)."""

    def plain(x: Any) -> Any:  # as the plan holds the saved args: tuples as lists, enums as their value, else str
        x = x.value if hasattr(x, "value") and not isinstance(x, (int, float, str)) else x
        return json.loads(json.dumps(x, default=str))

    out = []
    for k, v in saved.items():
        if k in skip or not hasattr(live, k):
            continue
        lv = plain(getattr(live, k))
        if plain(v) != lv:
            out.append([k, v, lv])
    return out


def inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside Megatron's: one, or each inner optimizer of a ChainedOptimizer (a
    Mixture-of-Experts run at EP > 1: dense, expert), each out of its mixed-precision wrapper."""
    return [c.innermost_optimizer(o) for o in (getattr(optimizer, "chained_optimizers", None) or [optimizer])]


def saved_legacy_state(plan: dict[str, Any], inner: Any, index: int = 0) -> list[dict[str, torch.Tensor]] | None:
    """This rank's saved Adam state of inner optimizer `index` in the live torch optimizer's parameter order, read
    (inert, ckpt's reader) from its own legacy rank file `iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`: the
    torch state dict Megatron saved (a ChainedOptimizer saves a list of them, one per inner optimizer), its param
    groups' ids in order. None where the run is not at the saved TP / PP / EP (another rank layout)."""
    from megatron.core import parallel_state as ps  # lazy: Megatron is importable only after import_megatron

    saved = plan["saved_args"]
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    ep = ps.get_expert_model_parallel_world_size()
    if (tp, pp, ep) != (
        saved.get("tensor_model_parallel_size") or 1,
        saved.get("pipeline_model_parallel_size") or 1,
        saved.get("expert_model_parallel_size") or 1,
    ):
        return None
    folder = (
        f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
        + (f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else "")
        + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else "")
    )
    f = Path(plan["load_dir"]) / f"iter_{int(plan['iteration']):07d}" / folder / "model_optim_rng.pt"
    saved_opt = pr.load(f).obj.get("optimizer")  # read inert: the file pickles Megatron's args Namespace
    if isinstance(saved_opt, list):  # a ChainedOptimizer: one state dict per inner optimizer
        saved_opt = saved_opt[index] if index < len(saved_opt) else None
    elif index:
        return None
    osd = c.find_osd(saved_opt)
    if osd is None:
        return None
    state = {
        i: {k: v.read_torch() if isinstance(v, pr.TensorRef) else v for k, v in st.items()}
        for i, st in (osd.get("state") or {}).items()
        if isinstance(st, dict)
    }
    out = c.saved_states_by_position({**osd, "state": state})
    return out if out and len(out) == sum(len(g["params"]) for g in inner.param_groups) else None


def optimizer_checks(plan: dict[str, Any], optimizer: Any) -> list[Any]:
    """One closed-form check (`_common.OptimizerCheck`) per inner torch optimizer, each with the LRs of its own
    param groups (a ChainedOptimizer's groups are the inner ones' in order, as the plan's expected LRs list them)."""
    checks, first = [], 0
    rows = plan.get("expected_lrs")
    for i, inner in enumerate(inner_optimizers(optimizer)):
        n = len(inner.param_groups)
        mine = None if rows is None else [r[first : first + n] if r else r for r in rows]
        checks.append(c.OptimizerCheck(inner, saved_legacy_state(plan, inner, i), mine))
        first += n
    return checks


def merged_check(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The inner optimizers' checks of one update as one: the worst error, every parameter checked, the first
    problem named."""
    if not results:
        return None
    out = dict(results[0])
    out["errors"] = {k: max(r["errors"][k] for r in results) for k in results[0]["errors"]}
    out["any_step_bad"] = any(r["any_step_bad"] for r in results)
    out["steps_bad"] = [s for r in results for s in r["steps_bad"]][:3]
    out["checked"] = sum(r["checked"] for r in results)
    out["kinds"] = sorted({k for r in results for k in r["kinds"]})
    out["lr_from_plan"] = all(r["lr_from_plan"] for r in results)
    out["problem"] = next((r["problem"] for r in results if r["problem"]), None)
    return out


def resume_argv(plan: dict[str, Any], cpu: bool, work: Path) -> list[str]:
    """The resumed run's command line: the saved args passed back, the plan's parallel sizes, on a CPU `CPU_FLAGS`,
    `--load` the checkpoint, the plan's run length, no evaluation, a log line per iteration, the data cache in
    `work`, then the user's extra args."""
    saved = plan["saved_args"]
    return [
        *relaunch_argv(saved),
        *parallel_argv(saved, plan.get("tp"), plan.get("pp")),
        *(CPU_FLAGS if cpu else []),
        "--distributed-backend",
        "gloo" if cpu else "nccl",
        "--load",
        plan["load_dir"],
        "--exit-on-missing-checkpoint",
        *plan["run_argv"],
        "--eval-iters",
        "0",
        "--eval-interval",
        str(10**9),
        "--log-interval",
        "1",
        "--data-cache-path",
        str(work / "data_cache"),
        *shlex.split(plan.get("extra_args") or ""),
    ]


def load_or_say_why(load_checkpoint: Any, *a: Any, **k: Any) -> Any:
    """Megatron's own `load_checkpoint`; where it calls sys.exit() (after printing why), a RuntimeError naming the
    last line it printed (rank 0 has the reason: a rank without one waits so that rank 0's error comes first)."""
    printed: list[str] = []
    show = builtins.print

    def keep(*words: Any, **kw: Any) -> None:  # Megatron says why before a sys.exit() in its load
        printed.append(" ".join(map(str, words)))
        show(*words, **kw)

    builtins.print = keep
    try:
        return load_checkpoint(*a, **k)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
        if not printed:  # print_rank_0: rank 0 has the reason; let its error reach the parent first
            time.sleep(5)
        raise RuntimeError(
            "Megatron-LM exited while loading the checkpoint" + (f": {printed[-1].strip()}" if printed else "")
        ) from None
    finally:
        builtins.print = show


class Hooks:
    """Stand-ins for Megatron's `load_checkpoint` and `train_step` (as `megatron.training.training` calls them):
    each calls Megatron's own and emits the `loaded` / `step` event from the live state."""

    def __init__(self, plan: dict[str, Any], argv: list[str], cpu: bool) -> None:
        import megatron.training.training as training  # lazy: Megatron is importable only after import_megatron

        self.plan, self.argv, self.cpu = plan, argv, cpu
        self.load_checkpoint, self.train_step = training.load_checkpoint, training.train_step
        self.rank = torch.distributed.get_rank()
        self.check: list[Any] = []
        self.done_loading = False

    def install(self) -> None:
        import megatron.training.training as training  # lazy: as in __init__

        training.load_checkpoint, training.train_step = self.loaded, self.step

    def loaded(self, model, optimizer, opt_param_scheduler, *a: Any, **k: Any):
        from megatron.training import get_args  # lazy: as in __init__

        out = load_or_say_why(self.load_checkpoint, model, optimizer, opt_param_scheduler, *a, **k)
        self.done_loading = True
        steps = sorted(set(W._adam_steps(optimizer)))
        if self.plan.get("legacy"):
            # the closed-form check of every update from the state this rank's file saved (`_common.OptimizerCheck`),
            # one per inner optimizer of a ChainedOptimizer
            self.check.extend(optimizer_checks(self.plan, optimizer))
        if self.rank == 0:
            skip = RUN_STATE | RELAUNCH_SKIP | (CPU_DESTS if self.cpu else frozenset())
            c.emit(
                "loaded",
                global_step=int(out[0]),
                optimizer_step=steps[-1] if steps else None,
                optimizer_steps=steps,
                scheduler_position=int(opt_param_scheduler.num_steps),
                argv=self.argv,
                args_differ=args_differ(self.plan["saved_args"], get_args(), skip),
            )
        return out

    def step(self, forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *a: Any, **k: Any):
        from megatron.training import get_args  # lazy: as in __init__

        lrs = [float(g["lr"]) for g in W._groups(optimizer)]
        out = self.train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, *a, **k)
        loss = out[0].get("lm loss") if isinstance(out[0], dict) else None
        opt_check = merged_check([x.reduced() for x in self.check])  # a collective: every rank closes the update
        mine = (lrs, None if loss is None else float(loss), sorted(set(W._adam_steps(optimizer))), bool(out[1]))
        every: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, mine)
        if self.rank == 0:
            losses = [x[1] for x in every if x[1] is not None]
            adam = sorted({s for x in every for s in x[2]})
            c.emit(
                "step",
                step=int(get_args().curr_iteration) + 1,
                loss=losses[0] if losses else None,
                lr=lrs,
                lr_by_rank=[x[0] for x in every],
                optimizer_step=adam[-1] if len(adam) == 1 else None,
                optimizer_steps=adam,
                skipped_steps=int(any(x[3] for x in every)),
                opt_check=opt_check,
            )
        return out


def run_pretrain(argv: list[str], hooks: Hooks) -> None:
    """Megatron's own `pretrain` (pretrain_gpt.py's entry) on `argv`, to its `--exit-interval` exit."""
    try:
        W.pretrain_gpt(argv)
    except SystemExit as e:  # --exit-interval: Megatron's train loop ends with sys.exit(0)
        if e.code not in (0, None):
            raise
        if not hooks.done_loading:
            raise RuntimeError("Megatron-LM exited before it had loaded the checkpoint") from None


def main(plan: dict[str, Any]) -> None:
    cpu = plan["device"] == "cpu"
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # what Megatron's TP setup asserts (users export it)
    if not cpu:  # one GPU per process, as torchrun's LOCAL_RANK says (Megatron sets it too, after the group exists)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    W.import_megatron(cpu=cpu)
    join("gloo" if cpu else "nccl")
    work = W._shared_tempdir("ckpt_resume_megatron_")
    argv = resume_argv(plan, cpu, work)
    hooks = Hooks(plan, argv, cpu)
    hooks.install()
    try:
        run_pretrain(argv, hooks)
        torch.distributed.barrier()
    finally:
        if hooks.rank == 0:
            shutil.rmtree(work, ignore_errors=True)
        for child in multiprocessing.active_children():  # Megatron's persistent data-loader workers
            child.terminate()
    if hooks.rank == 0:
        c.emit("done")


if __name__ == "__main__":
    c.run_main(main)
