"""Megatron-LM's torch_dist run folder from a source `view.megatron_core` presents under Megatron-core names (a
Megatron-DeepSpeed pipeline, a torchtitan Llama: `ckpt convert SRC OUT --to megatron`): the checks that refuse what
the conversion does not carry (`check`), the plan's lines (`plan_lines`), and the writer (`write`, `plan_dist` for a
torchrun job). What is written, and why, is `view.megatron_core`'s docstring. One of the `write.megatron_target`
writers (`MegatronTarget`).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Callable

from ..errors import UnsupportedCheckpoint
from ..read.tree import saved_config
from ..view import logical as L
from ..view.megatron_core import (
    EXTRA_STATE_LINEARS,
    LAYER_ORDER,
    MEGATRON_GROUP_KEYS,
    TOP_ORDER,
    architecture,
    core_names,
    megatron_args,
    megatron_groups,
    schedule,
    scheduler_state,
    tp_pp,
)
from ..view.torchtitan import WSD_STYLE, hf_cfg, is_titan_view, refuse as _refuse, source_view, titan_schedule
from .dcp_write import DcpStreamWriter, PlannedDcpWriter, lazy_part, plan_save_id
from .megatron_write import CONTENT_METADATA, DIST_META, LATEST, dist_key

#: names the TP-replicated parameters that differ across TP ranks (`ops.tp_sync`'s check, which the conversion
#: passes in): the TP merge would take rank 0's copy of them silently
TpDrift = Callable[[Any], list[str]]


def check(
    ck,
    src: Path,
    ckpt_format: str = "torch_dist",
    tp: int | None = None,
    pp: int | None = None,
    ep: int | None = None,
    *,
    tp_drift: TpDrift | None = None,
) -> tuple[None, None]:
    """Refuse, in one line naming it, what this conversion does not carry into a loadable Megatron run; returns
    (None, None): torch_dist holds whole tensors, Megatron reshards them at load (`megatron_write.check`'s shape).
    `ep` is never given (a dense GPT: `--ep` is refused before); `tp_drift` names the TP replicas that differ (a
    DeepSpeed source saved at TP > 1; None: not checked)."""
    if ckpt_format != "torch_dist":
        raise UnsupportedCheckpoint(
            f"--to megatron --ckpt-format {ckpt_format} needs a Megatron-LM torch_dist checkpoint; this is {ck.format}",
            path=src,
            hint="convert it with --ckpt-format torch_dist first, then that run with --ckpt-format torch",
        )
    if is_titan_view(ck):
        _titan_check(ck)
    else:
        _check_deepspeed(ck, tp_drift)
    megatron_groups(ck)
    steps = {float(v["step"]) for v in L.optimizer_scalars(ck).values() if v.get("step") is not None}
    if len(steps) != 1:
        _refuse(f"Adam steps {sorted(steps)} across parameters: torch_dist keeps one common step", ck)
    return None, None


def _check_deepspeed(ck, tp_drift: TpDrift | None) -> None:
    """`check` of a Megatron-DeepSpeed pipeline: a bf16 Adam(W) run at ZeRO-1/2 without skipped steps, its GPT
    the one mapped (`architecture`), its TP replicas in sync."""
    cfg = saved_config(ck)
    if not (isinstance(cfg.get("bf16"), dict) and cfg["bf16"].get("enabled")):
        _refuse(
            "--to megatron from DeepSpeed is proven for bf16 runs (Megatron's bf16 params with an fp32 master); "
            "this run is not bf16 (ds_config.bf16.enabled)",
            ck,
        )
    opt = str((cfg.get("optimizer") or {}).get("type", "")).lower()
    if opt not in ("adam", "adamw"):
        _refuse(f"optimizer {opt or '(not in ds_config)'}: Megatron's plain optimizer here is Adam(W)", ck)
    if (ck.topology.zero_stage or 0) > 2:
        _refuse("ZeRO-3 pipeline checkpoint: not handled (DeepSpeed pipelines run ZeRO-1/2)", ck)
    if ck.counters.skipped_steps:
        _refuse(
            f"{ck.counters.skipped_steps} skipped steps: the Adam step and the iteration differ, which "
            "Megatron's checkpoint cannot say",
            ck,
        )
    architecture(ck)
    if (ck.topology.tp or 1) > 1 and tp_drift is not None:
        drifted = tp_drift(ck)
        if drifted:  # the merge would take TP rank 0's copy silently: Megatron saves a replica once
            _refuse(
                f"{len(drifted)} TP-replicated parameters differ across TP ranks ({', '.join(drifted[:4])}"
                f"{', ...' if len(drifted) > 4 else ''}): torch_dist keeps one copy",
                ck,
                hint=f"repair them first with `ckpt sync-tp {ck.path}` (average or one rank's value)",
            )


def plan_lines(
    ck, ckpt_format: str = "torch_dist", tp: int | None = None, pp: int | None = None, ep: int | None = None
) -> tuple[list[str], list[str]]:
    """(notes, not moved) for the conversion."""
    if is_titan_view(ck):
        return _titan_lines(ck)
    tp, pp, dp = tp_pp(ck)
    arch = architecture(ck)
    groups, _ = megatron_groups(ck)
    _, snote, sgone = schedule(ck, groups)
    notes = [
        f"Megatron-LM torch_dist (plain Adam) from a Megatron-DeepSpeed pipeline (TP {tp} x PP {pp} x DP {dp}): "
        f"global tensors under Megatron-core names, {arch['num_layers']} layers stacked on a leading axis; "
        "Megatron reshards them at load, so it resumes at any TP / PP",
        "weights: the layer files' module weights (bf16, Megatron's param dtype) and the ZeRO fp32 master as "
        "optimizer.state.fp32_param; Adam's exp_avg / exp_avg_sq; the common Adam step; param groups in "
        "Megatron-core's order (decaying weights; biases and 1-D tensors with wd_mult 0) with its fields "
        "(max_lr, min_lr, wd_mult, lr_mult, ...)",
        "query_key_value rows carried as they are: Megatron-DeepSpeed's [heads][q|k|v][head_dim] is "
        "Megatron-core's linear_qkv order with one head per query group",
        "args: built for this architecture (LayerNorm, GeLU, learned positions, untied output, no dropout, "
        "the local transformer implementation), the parallel sizes, batch sizes, Adam hyper-parameters, "
        "train_iters and schedule of the DeepSpeed run; tokenizer NullTokenizer sized to the saved vocabulary "
        "rows and mock_data (relaunch with your own tokenizer and data flags)",
        snote,
    ]
    not_moved = [
        "RNG states: DeepSpeed's / the client's generators are not Megatron's (args.no_save_rng=True: "
        "Megatron seeds afresh from args.seed)",
        "data position: the DeepSpeed run's data loader is not Megatron's; consumed_train_samples = "
        "iteration x global batch is recorded",
        "num_floating_point_operations_so_far: DeepSpeed does not count it (written 0)",
        "ds_config and universal_checkpoint_info: DeepSpeed's launch configuration and TP merge metadata "
        "(used to read the source)",
    ]
    if sgone:
        not_moved.append(sgone)
    return notes, not_moved


def built_scheduler(ck) -> dict[str, Any]:
    """The OptimizerParamScheduler state the plan records: the one Megatron builds from the args built for this
    source (`megatron_args`), which has no Megatron scheduler of its own."""
    return scheduler_state(ck, megatron_args(ck))


def added() -> tuple[str, ...]:
    """The param-group fields Megatron keeps that the source's torch groups lack (the logical diff's 'added')."""
    return tuple(f"param_groups {i}.{k}" for i in (0, 1) for k in MEGATRON_GROUP_KEYS)


def _order(core: str) -> tuple:
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", core)
    if m:
        return (TOP_ORDER.index("decoder.layers"), LAYER_ORDER.index(m[2]), int(m[1]))
    return (TOP_ORDER.index(core), 0, 0)


def write(plan, root: Path, progress: Callable[[int], None] | None) -> int:
    """Write the run folder for `plan` (to="megatron" from a DeepSpeed pipeline or a torchtitan source, read as
    `source_view`) into the empty staging folder `root`; returns the bytes written. One parameter's tensors in
    memory at a time (a fused one: its parts)."""
    w, tail = _dist_items(plan, root, DcpStreamWriter, progress)
    w.close()
    return w.bytes_written + tail(root)


def plan_dist(plan, root: Path):
    """(a `write.dcp_write.PlannedDcpWriter` holding the items `write` writes, in its order, each parameter's
    tensor chunks of unit `param<i>` (the plan's index); what writes the rest of the run folder into `root`): a
    torchrun job's plan."""
    return _dist_items(plan, root, PlannedDcpWriter, None)


def _dist_items(plan, root: Path, writer, progress: Callable[[int], None] | None):
    """The DCP items of the run folder, written (or planned) through `writer(folder, checkpoint_id, shards,
    save_id)`; returns (the writer, not closed; tail(root) -> bytes: common.pt, metadata.json, the iteration)."""
    import torch  # lazy: tensors are cast and saved only when the folder is written

    ck = source_view(L.open_any(plan.source), plan.hf_config, plan.seq_length, plan.lr_scheduler, plan.drop_norm_decay)
    names = core_names(ck)
    args = megatron_args(ck)
    layers = args["num_layers"]
    iteration = args["iteration"]
    it = root / f"iter_{iteration:07d}"
    module = {t.name: t for t in L.model_tensors(ck, weights="module")}
    for p in plan.params:
        if p.kind != "param" or not p.states:
            raise UnsupportedCheckpoint(
                f"{p.name}: a {p.kind} tensor without Adam state: ckpt writes trained parameters only", path=plan.source
            )
    unit = {p.name: f"param{i}" for i, p in enumerate(plan.params)}
    # {torch_dist key: [(layer or None, param)]} in Megatron's module order; the groups' keys in that order too
    keys: dict[str, list] = {}
    for p in sorted(plan.params, key=lambda p: _order(names[p.name])):
        key, layer = dist_key(names[p.name], layers)
        keys.setdefault(key, []).append((layer, p))
    _, members = megatron_groups(ck)
    grouped = [k for g in members for k in keys if names[keys[k][0][1].name] in g]  # a key's layers: one group
    w = writer(it, checkpoint_id=str(plan.out / it.name), shards=2, save_id=plan_save_id(plan))

    def put(key: str, layer: int | None, p, t, dtype=None) -> None:
        part = lazy_part(t, dtype, unit=unit[p.name], layer=layer is not None)
        if layer is None:
            w.tensor_part((key,), tuple(t.shape), (0,) * len(t.shape), part)
        else:
            w.tensor_part((key,), (layers, *t.shape), (layer,) + (0,) * len(t.shape), part)

    # each linear's extra state after its last tensor (its bias; its weight where it has none)
    extra = {
        next(k for k in (f"decoder.layers.{x}.bias", f"decoder.layers.{x}.weight") if k in keys): x
        for x in EXTRA_STATE_LINEARS
    }
    try:
        for key, items in keys.items():  # the module's weights (bf16), each linear's extra state after them
            for layer, p in items:
                put(key, layer, p, module[p.name], torch.bfloat16)
            if key in extra:
                w.value((f"decoder.layers.{extra[key]}._extra_state/shard_0_{layers}",), [None])
            if extra.get(key) == "mlp.linear_fc2":  # the other layers' extra states, as Megatron lists them
                for i in range(1, layers):
                    for x in EXTRA_STATE_LINEARS:
                        w.value((f"decoder.layers.{x}._extra_state/shard_{i}_{layers}",), [None])
        for key in grouped:  # Adam's moments, param group after param group, then the fp32 master
            for k in ("exp_avg", "exp_avg_sq"):
                for layer, p in keys[key]:
                    put(f"optimizer.state.{k}.{key}", layer, p, p.states[k])
        for key in grouped:
            for layer, p in keys[key]:
                put(f"optimizer.state.fp32_param.{key}", layer, p, p.weight)
                if progress:
                    progress(p.nbytes)
    except BaseException:
        w.abort()
        raise

    def tail(root: Path) -> int:
        return _write_tail(plan, ck, args, root / f"iter_{iteration:07d}", root)

    return w, tail


def _write_tail(plan, ck, args: dict[str, Any], it: Path, root: Path) -> int:
    """common.pt, metadata.json and the iteration file; returns common.pt's bytes."""
    import torch  # lazy: tensors are cast and saved only when the folder is written

    iteration = args["iteration"]
    groups, _ = megatron_groups(ck)
    titan_sched = titan_schedule(ck) if is_titan_view(ck) else None  # parsed and checked once, not per group
    pgroups = []
    for g, wd_mult in zip(groups, (1.0, 0.0)):
        hp = {k: v for k, v in g.items() if k != "params"}
        if not is_titan_view(ck):
            top, low = args["lr"], args["min_lr"]
        elif titan_sched is not None:  # each group's own base LR and floor under the one WSD schedule
            top = float(g["initial_lr"])
            low = top * titan_sched["mf"]
        else:
            top = low = float(g["lr"])
        pgroups.append(
            {
                "is_expert_parallel": False,
                "default_config": True,
                "wd_mult": wd_mult,
                "lr_mult": 1.0,
                "is_decoupled_lr": False,
                "max_lr": top,
                "min_lr": low,
                **hp,
            }
        )
    step = next(float(v["step"]) for v in L.optimizer_scalars(ck).values() if v.get("step") is not None)
    common = {
        "args": argparse.Namespace(**args),
        "checkpoint_version": 3.0,
        "iteration": iteration,
        "optimizer": {
            "optimizer": {"state": {"common_step": torch.tensor(step, dtype=torch.float32)}, "param_groups": pgroups}
        },
        "opt_param_scheduler": scheduler_state(ck, args),
        "num_floating_point_operations_so_far": 0.0,
        "content_metadata": dict(CONTENT_METADATA),
    }
    torch.save(common, it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(DIST_META))
    (root / LATEST).write_text(str(iteration))
    return (it / "common.pt").stat().st_size


def _titan_check(ck) -> None:
    if not L.optimizer_states(ck):
        _refuse(
            "no optimizer state: a model-only save (torchtitan's last save is model-only by default, "
            "--checkpoint.last-save-model-only); --to megatron carries a run with its Adam state",
            ck,
            hint="convert an intermediate step-N folder, or export the weights with `ckpt export`",
        )
    moments = sorted({t.dtype for st in L.optimizer_states(ck).values() for k, t in st.items() if k != "step"})
    if moments != ["float32"]:
        _refuse(f"Adam moments saved as {', '.join(moments)}: Megatron's optimizer keeps them in float32", ck)
    dtypes = sorted({t.dtype for t in L.model_tensors(ck, weights="module")})
    if dtypes != ["float32"]:
        _refuse(
            f"weights saved as {', '.join(dtypes)}: the fp32 master Megatron's bf16 run keeps would be "
            "rounded; torchtitan's FSDP2 saves float32",
            ck,
        )
    for g in L.param_groups(ck):
        odd = [k for k in ("amsgrad", "maximize", "nesterov") if g.get(k)]
        if odd or g.get("decoupled_weight_decay") is False or "betas" not in g:
            why = ", ".join(odd) or "no betas / coupled weight decay"
            _refuse(
                f"param group of {', '.join(g.get('params', [])[:2])}, ...: not AdamW ({why}): Megatron's "
                "optimizer here is AdamW",
                ck,
            )
    architecture(ck)


def _titan_lines(ck) -> tuple[list[str], list[str]]:
    """`plan_lines` of a torchtitan source: (notes, not moved)."""
    _, path = hf_cfg(ck)
    arch = architecture(ck)
    groups, _ = megatron_groups(ck)
    lrs = ", ".join(f"{float(g['lr']):g}" for g in groups)
    dp = ck.topology.dp or 1
    sched = titan_schedule(ck)
    return _titan_notes(ck, arch, path, lrs, dp, sched), _titan_not_moved(ck, lrs, dp, sched)


def _titan_notes(ck, arch: dict[str, Any], path: str, lrs: str, dp: int, sched: dict[str, Any] | None) -> list[str]:
    """What the plan carries from a torchtitan source, and how (`arch`: its args; `sched`: `titan_schedule`)."""
    return [
        f"Megatron-LM torch_dist (plain Adam) from a torchtitan Llama (FSDP2, DP {dp}): global tensors under "
        f"Megatron-core names, {arch['num_layers']} layers stacked on a leading axis; Megatron reshards them at "
        "load, so it resumes at any TP / PP",
        f"attention: wq / wk / wv fused per query group into linear_qkv ({arch['num_attention_heads']} heads, "
        f"{arch['num_query_groups']} KV groups from {path}); q / k rows permuted per head from torchtitan's "
        "interleaved RoPE pairs to Megatron's rotate-half order (the permutation torchtitan's own Hugging Face "
        "converter applies); SwiGLU w1 / w3 as linear_fc1 (gate rows, then up rows); Adam's moments moved with "
        "their rows",
        "weights: the saved float32 weights as optimizer.state.fp32_param, the module's bf16 copy rounded from "
        "them (Megatron's --bf16, as torchtitan's default bf16 FSDP compute); Adam's exp_avg / exp_avg_sq; the "
        "common Adam step; param groups in Megatron-core's order (decaying weights; 1-D tensors with wd_mult 0)",
        f"args: from {path} (its head counts checked against the q / k shapes; the RoPE base and scaling and the "
        "norm eps cannot be checked against a checkpoint and are taken as given): RMSNorm (eps "
        f"{arch['layernorm_epsilon']:g}), SwiGLU, RoPE base "
        f"{arch['rotary_base']}"
        + (f" with llama3 scaling (factor {arch['rope_scaling_factor']:g})" if arch["use_rope_scaling"] else "")
        + f", no biases, untied output; seq_length {arch['seq_length']}"
        f"{'' if ck.details.get('seq_length') else ' (max_position_embeddings; --seq-length sets it)'}; "
        "no dropout, the local transformer implementation; tokenizer NullTokenizer sized to the saved "
        "vocabulary rows and mock_data (relaunch with your own tokenizer and data flags)",
        (
            f"scheduler: Megatron's constant schedule at each param group's saved LR ({lrs}: the LR torchtitan's "
            "next step uses), each group's own max_lr / min_lr"
            if sched is None
            else f"scheduler: torchtitan's warm-up {sched['W']} / stable {sched['S']} / {sched['type']} decay "
            f"{sched['D']} "
            f"over {sched['T']} steps (min_lr_factor {sched['mf']:g}; --lr-scheduler, checked against every group's "
            f"saved LR at last_epoch {sched['last_epoch']}) as Megatron's WSD schedule (lr_decay_iters {sched['T']}, "
            f"lr_wsd_decay_iters {sched['D']}, {WSD_STYLE[sched['type']]}), each group's initial_lr as its max_lr: "
            "the same LR at every later step"
        ),
    ]


def _titan_not_moved(ck, lrs: str, dp: int, sched: dict[str, Any] | None) -> list[str]:
    """What a torchtitan source holds or its job config set that the Megatron run does not carry."""
    not_moved = (
        [
            f"LR schedule: torchtitan rebuilds its warmup / decay from its job config (the checkpoint's "
            f"lr_scheduler holds only last_epoch {ck.counters.scheduler_last_epoch}): written as a constant "
            f"schedule at the current LRs ({lrs}); pass --lr-scheduler with the run's settings to carry it"
        ]
        if sched is None
        else []
    )
    if sched is not None and sched["mid_warmup"]:
        not_moved.append(
            f"the rest of the warm-up (to step {sched['W']}): Megatron has one lr_warmup_init for all "
            "groups, so only the first group's warm-up LRs are torchtitan's"
        )
    if sched is not None:
        not_moved.append(
            "beyond torchtitan's last step its factor leaves min_lr_factor (its formula is not clamped); "
            "Megatron's stays at min_lr (the two agree up to the last step)"
        )
    not_moved += [
        "RNG states: torchtitan's generators are not Megatron's (args.no_save_rng=True: Megatron seeds "
        "afresh from args.seed)",
        "data position: torchtitan's dataloader state and ntokens_seen "
        f"({ck.details.get('train_state', 'not recorded')}); consumed_train_samples = iteration x global "
        "batch is recorded",
        f"batch sizes and gradient clipping live in torchtitan's job config: args record micro batch 1, "
        f"global batch {dp} (one sequence per DP rank) and clip_grad 1.0 (torchtitan's and Megatron's default "
        "max_norm): relaunch with yours; Megatron counts its schedule in samples of the saved global "
        "batch, so another --global-batch-size needs --override-opt_param-scheduler and moves the "
        "schedule's position",
    ]
    for decay, n in ck.details.get("norm_decay_dropped") or ():
        not_moved.append(
            f"weight decay {decay:g} on {n} norm weights (1-D tensors; --drop-norm-decay): torchtitan "
            "decayed them, Megatron-core never decays 1-D tensors (wd_mult 0): written in a group of "
            "their own with weight_decay 0, with their LR, Adam state and step as saved"
        )
    if L.optimizer_scalars(ck) and ck.counters.global_step is None:
        not_moved.append("the step: torchtitan's train_state is missing")
    return not_moved
