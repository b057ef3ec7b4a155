"""The files `ckpt convert` writes for its own targets (`--to megatron`: `write.megatron_target`'s writers): a DCP
folder one parameter's files at a time (`write_dcp`, `write_dcp_param` + `finish_dcp` for a job), the
`--to torch` file and its layout for a job (`torch_training_dict`, `torch_save_layout`, `torch_job_parts`), and
DeepSpeed's universal checkpoint (`write_universal`).
"""

from __future__ import annotations

import collections
import json
import os
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from ..errors import CkptError, UnsupportedCheckpoint
from ..read import qkv
from ..view.logical import torch_dtype
from ..write import shares
from ..write.dcp_write import (
    DcpStreamWriter,
    flatten_paths,
    part_from_json,
    part_to_json,
    plan_save_id,
    write_metadata,
)
from ..write.torch_zip import own_storage, plan_save, start_writeback, write_frame
from .convert_plan import DCP_SHARDS, ConvertPlan, step_tensor


def _dcp_values(plan: ConvertPlan) -> tuple[tuple, dict[str, Any], dict[str, Any]]:
    """(prefix of everything, the optim dict's small values, the rest of the top level) for the layout."""
    groups = []
    for g in plan.groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])})
    rest: dict[str, Any] = {}
    if plan.layout == "torchtitan":
        optim: dict[str, Any] = {}
        into = {q: name for name, (q, _, _) in plan.fused}  # a fused wqkv: one entry, under its own name
        gone = {n for _, (_, k, v) in plan.fused for n in (k, v)}
        for g in groups:
            for n in (into.get(n, n) for n in g["params"] if n not in gone):
                for k, v in g.items():
                    if k != "params":
                        optim[f"param_groups.{n}.{k}"] = v
        if plan.scheduler is not None and "last_epoch" in plan.scheduler:
            # torchtitan's LRSchedulersContainer saves and restores only the position
            rest["lr_scheduler"] = {"last_epoch": plan.scheduler["last_epoch"]}
        if plan.step is not None:
            rest["train_state"] = {"step": plan.step, "ntokens_seen": 0}
        return (), optim, rest
    optim = {"param_groups": groups}
    if plan.scheduler is not None:
        rest["scheduler"] = plan.scheduler
    if plan.step is not None:
        rest["step"] = plan.step
    return (("app",) if plan.layout == "recipe" else ()), optim, rest


def dcp_unit_files(i: int) -> list[str]:
    """The `.distcp` files that parameter `i` of the plan may write (`DcpStreamWriter(unit=i + 1)`); unit 0,
    `__0_0.distcp`, holds the values (param groups, scheduler, step)."""
    return [f"__{r}_{i + 1}.distcp" for r in range(DCP_SHARDS)]


def write_dcp_param(
    plan: ConvertPlan, folder: Path, i: int, progress: Callable[[int], None] | None
) -> tuple[int, list[str], dict]:
    """Parameter `i`'s DCP items (its weight, then its optimizer state) into its own files (`dcp_unit_files`).
    Returns (bytes written, the files written, its `.metadata` part as JSON: `dcp_write.part_to_json`). The files
    depend on this parameter alone, so any number of processes writing any split of the parameters writes the
    same bytes."""
    w = DcpStreamWriter(folder, checkpoint_id=str(plan.out), shards=DCP_SHARDS, unit=i + 1)
    prefix, _, _ = _dcp_values(plan)
    titan = plan.layout == "torchtitan"
    opt_key = "optimizer" if titan else "optim"
    p = plan.params[i]
    fused = {q: (name, (q, k, v)) for name, (q, k, v) in plan.fused}
    members = {n for _, parts in plan.fused for n in parts}
    by = {x.name: x for x in plan.params} if plan.fused else {}
    try:
        # torchtitan saves the model's keys flat at the top level, beside optimizer / lr_scheduler / train_state
        w.tensor(prefix + ((p.name,) if titan else ("model", p.name)), p.weight.read())
        if progress:
            progress(p.nbytes - sum(t.numel * 4 for t in p.states.values()))
        if p.name in fused:  # the fused wqkv's state, from its three split parameters (`qkv.fuse`)
            name, parts = fused[p.name]
            for k in p.states:
                w.tensor(
                    prefix + (opt_key, f"state.{name}.{k}"),
                    qkv.fuse(*(by[n].states[k].read() for n in parts), plan.n_kv_heads),
                )
                if progress:
                    progress(p.states[k].numel * 4)
            if p.step is not None:
                w.tensor(prefix + (opt_key, f"state.{name}.step"), step_tensor(p.step))
        elif p.name not in members:
            for k, t in p.states.items():
                path = (opt_key, f"state.{p.name}.{k}") if titan else (opt_key, "state", p.name, k)
                w.tensor(prefix + path, t.read())
                if progress:
                    progress(t.numel * 4)
            if p.step is not None and (p.states or p.kind == "param"):
                path = (opt_key, f"state.{p.name}.step") if titan else (opt_key, "state", p.name, "step")
                w.tensor(prefix + path, step_tensor(p.step))
        elif progress:
            progress(sum(t.numel * 4 for t in p.states.values()))
    except BaseException:
        w.abort()
        raise
    part = w.finish()
    return w.bytes_written, w.files(), part_to_json(part)


def finish_dcp(plan: ConvertPlan, folder: Path, parts: list[dict]) -> int:
    """The values (`__0_0.distcp`) and `.metadata` from every parameter's part (JSON, in the plan's order), its
    save_id derived from the plan: the same bytes whatever wrote the parameters. Returns the values' bytes."""
    w = DcpStreamWriter(folder, checkpoint_id=str(plan.out), shards=1, unit=0)
    prefix, optim_values, rest = _dcp_values(plan)
    opt_key = "optimizer" if plan.layout == "torchtitan" else "optim"
    try:
        for path, v in flatten_paths(optim_values, prefix + (opt_key,)):
            w.value(path, v)
        for path, v in flatten_paths(rest, prefix):
            w.value(path, v)
    except BaseException:
        w.abort()
        raise
    values = w.finish()
    write_metadata(folder, [part_from_json(d) for d in parts] + [values], str(plan.out), plan_save_id(plan))
    return w.bytes_written


def write_dcp(plan: ConvertPlan, folder: Path, progress: Callable[[int], None] | None) -> int:
    """The whole DCP folder in one process: every parameter's files, then the values and `.metadata`, by the
    same functions as the ranks of a job (`_execute_job`), so the bytes are the same."""
    total, parts = 0, []
    for i in range(len(plan.params)):
        n, _, part = write_dcp_param(plan, folder, i, progress)
        total += n
        parts.append(json.loads(json.dumps(part)))  # as a job reads it back from its journal: the same pickle
    return total + finish_dcp(plan, folder, parts)


def torch_training_dict(plan: ConvertPlan) -> dict[str, Any]:
    """The {model, optimizer, scheduler, step} dict `--to torch` saves (every tensor read: small runs), each
    tensor contiguous with a storage of its own (`torch_zip.own_storage`), so that `torch_save_layout` can plan
    its file."""
    return _torch_dict(plan, lambda i, read, dtype, shape: own_storage(read()))


def _torch_dict(plan: ConvertPlan, leaf: Callable[[int, Callable[[], Any], str, tuple[int, ...]], Any]) -> dict:
    """`torch_training_dict`'s structure with `leaf(i, read, dtype, shape)` at each tensor: parameter `i`'s tensor
    that `read()` gives, of that dtype and shape. Called in the order torch.save's pickler meets the tensors."""
    model = {p.name: leaf(i, p.weight.read, p.weight.dtype, tuple(p.shape)) for i, p in enumerate(plan.params)}
    index: dict[str, int] = {}
    groups = []
    for g in plan.groups:
        ids = []
        for n in g["params"]:
            index.setdefault(n, len(index))
            ids.append(index[n])
        groups.append(
            {**{k: v for k, v in g.items() if k != "params"}, "params": ids, "param_names": list(g["params"])}
        )
    state: dict[int, dict[str, Any]] = {}
    at = {p.name: i for i, p in enumerate(plan.params)}
    for n, i in index.items():
        p = plan.params[at[n]]
        entry: dict[str, Any] = {}
        if p.step is not None:
            entry["step"] = leaf(at[n], lambda p=p: step_tensor(p.step), "float32", ())
        for k, t in p.states.items():
            entry[k] = leaf(at[n], t.read, t.dtype, tuple(t.shape))
        if entry:
            state[i] = entry
    out: dict[str, Any] = {"model": model, "optimizer": {"state": state, "param_groups": groups}}
    if plan.scheduler is not None:
        out["scheduler"] = plan.scheduler
    if plan.step is not None:
        out["step"] = plan.step
    return out


@dataclass(frozen=True)
class TorchLayout:
    """Where the `--to torch` file's storages lie (`torch_zip.SaveLayout`) and what fills each: (parameter index,
    read, dtype) per storage key, in key order."""

    save: Any  # torch_zip.SaveLayout
    leaves: tuple[tuple[int, Callable[[], Any], str], ...]


def torch_save_layout(plan: ConvertPlan) -> TorchLayout:
    """The layout of `torch.save(torch_training_dict(plan), OUT)`, planned without reading a tensor: the same dict
    with every tensor `torch.empty` (address space, no page touched) through torch's own pickler
    (`torch_zip.plan_save`). Every process of a job plans the same."""
    import torch  # lazy: torch only when a file is planned or written; planning stays torch-free

    leaves: list[tuple[int, Callable[[], Any], str]] = []

    def leaf(i: int, read: Callable[[], Any], dtype: str, shape: tuple[int, ...]):
        leaves.append((i, read, dtype))
        return torch.empty(shape, dtype=torch_dtype(dtype))

    save = plan_save(_torch_dict(plan, leaf), plan.out.resolve())
    if len(save.sizes) != len(leaves):  # a tensor outside the model and optimizer state (in the scheduler?)
        raise UnsupportedCheckpoint(
            f"--to torch as a job: the training dict holds {len(save.sizes)} tensors, {len(leaves)} planned",
            path=plan.source,
            hint=f"run `ckpt convert {plan.source} {plan.out} --to torch` in one process",
        )
    return TorchLayout(save, tuple(leaves))


def torch_job_parts(plan: ConvertPlan):
    """`--to torch` in a job: (units, convert, finish, the file verified) for `shares.run_job`. A unit is one
    parameter: the storages of its weight and optimizer state, written by the rank that has it at the offsets
    torch.save gives them in the staging file (`torch_save_layout`; holes until every share is in) and journaled
    as spans with their CRC-32s; rank 0 then writes the records, headers and central directory around them
    (`torch_zip.write_frame`): the bytes of the one-process `torch.save`."""
    import torch  # lazy: torch only when a file is planned or written; planning stays torch-free

    layout = torch_save_layout(plan)
    save, name = layout.save, plan.out.name
    keys: list[list[int]] = [[] for _ in plan.params]
    for key, (i, _, _) in enumerate(layout.leaves):
        keys[i].append(key)
    units = [shares.Unit(f"param{i}", sum(save.sizes[k] for k in keys[i]), p.name) for i, p in enumerate(plan.params)]

    def convert(todo: list[int], journal, counted: Callable[[int], None]) -> int:
        n = 0
        fd = os.open(journal.root / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < save.size:  # only grows: the other ranks' bytes stay
                os.ftruncate(fd, save.size)
            for i in todo:
                spans = []
                for k in keys[i]:
                    _, read, dtype = layout.leaves[k]
                    t = own_storage(read())
                    if t.dtype != torch_dtype(dtype) or t.numel() * t.element_size() != save.sizes[k]:
                        raise CkptError(
                            f"{plan.params[i].name}: read as {t.dtype} {tuple(t.shape)}, planned as {dtype} of "
                            f"{save.sizes[k]} bytes",
                            path=plan.source,
                        )
                    view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    done = 0
                    while done < view.nbytes:
                        done += os.pwrite(fd, view[done:], save.offsets[k] + done)
                    spans.append((name, save.offsets[k], save.sizes[k]))
                    n += save.sizes[k]
                start_writeback(fd)
                journal.record(units[i].rel, spans=spans)
                counted(plan.params[i].nbytes)
            os.fsync(fd)
            journal.fsynced += 1
        finally:
            os.close(fd)
        return n

    def finish(staging: Path, journal) -> None:
        crcs = [0] * len(save.sizes)
        for i, unit in enumerate(units):
            for k, (_, _, _, crc) in zip(keys[i], journal.spans(unit.rel)):
                crcs[k] = crc
        fd = os.open(staging / name, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, write_frame(fd, save, crcs))
        finally:
            os.close(fd)

    return units, convert, finish, name


# --- DeepSpeed universal ----------------------------------------------------------------------------------


def universal_tag(plan: ConvertPlan) -> str:
    return f"global_step{plan.step if plan.step is not None else 0}_universal"


def write_universal(
    plan: ConvertPlan,
    root: Path,
    progress: Callable[[int], None] | None,
    *,
    indices: list[int] | None = None,
    common: bool = True,
) -> int:
    """What DeepSpeed 0.19's `load_universal` reads (see `ops.to_universal`'s module docstring), synthesized from
    the logical view: `zero/<param>/{fp32,<state>}.pt` ({"param": tensor, "cat_dim": 0}) and `step.pt` per
    trained parameter; `zero/optimizer_state.pt` (param groups, ds_version; the ZeRO-3 loader's
    optimizer_state_dict.state[0].step); the model-states file the engine globs for counters and the
    scheduler (`mp_rank_00_model_states.pt`, and `zero_pp_rank_0_mp_rank_00_model_states.pt` for ZeRO-3
    loaders), with `module` (the fp32 weights) and `param_shapes` (group membership, in group order);
    `latest_universal`."""
    import torch  # lazy: torch only when the folder is written; planning stays torch-free

    try:  # the version string DeepSpeed's loaders assert is present (importing deepspeed itself logs to stdout)
        ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds_version = "0.19.8"
    tag = universal_tag(plan)
    tag_dir = root / tag
    zero = tag_dir / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    share = [plan.params[i] for i in indices] if indices is not None else list(plan.params)
    written = _write_zero_params([p for p in share if p.kind == "param" and p.states], zero, progress)
    if not common:
        return written
    by_name = {p.name: p for p in plan.params}
    torch.save(_universal_optimizer_state(plan, by_name, ds_version), zero / "optimizer_state.pt")
    torch.save(_universal_model_states(plan, by_name, ds_version), tag_dir / "mp_rank_00_model_states.pt")
    try:
        os.link(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    except OSError:
        shutil.copyfile(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    (root / "latest_universal").write_text(tag)
    return written


def _write_zero_params(trained: list, zero: Path, progress: Callable[[int], None] | None) -> int:
    """Each trained parameter's `zero/<param>/` folder: `fp32.pt`, one file per optimizer state, `step.pt`;
    returns the bytes of the tensors written."""
    import torch  # lazy: torch only when the folder is written; planning stays torch-free

    written = 0
    for p in trained:
        d = zero / p.name
        d.mkdir(parents=True, exist_ok=True)
        t = p.weight.read(torch.float32)
        torch.save({"param": t, "cat_dim": 0}, d / "fp32.pt")
        written += t.numel() * 4
        for k, st in p.states.items():
            v = st.read()
            torch.save({"param": v, "cat_dim": 0}, d / f"{k}.pt")
            written += v.numel() * v.element_size()
        if p.step is not None:
            torch.save(step_tensor(p.step), d / "step.pt")
        if progress:
            progress(p.nbytes)
    return written


def _universal_optimizer_state(plan: ConvertPlan, by_name: dict, ds_version: str) -> dict[str, Any]:
    """`zero/optimizer_state.pt`: the param groups (each naming its index) and each group's step."""
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]} for i, g in enumerate(plan.groups)]
    steps = {}
    for i, g in enumerate(plan.groups):
        s = [by_name[n].step for n in g["params"] if n in by_name and by_name[n].step is not None]
        if s:
            steps[i] = step_tensor(s[0])
    return {
        "ds_version": ds_version,
        "param_groups": groups,
        "optimizer_state_dict": {"state": {i: {"step": s} for i, s in steps.items()}, "param_groups": groups},
    }


def _universal_model_states(plan: ConvertPlan, by_name: dict, ds_version: str) -> dict[str, Any]:
    """The model-states file: `module` (the weights), the groups' parameter shapes, the counters and scheduler."""
    import torch  # lazy: torch only when the folder is written; planning stays torch-free

    module = collections.OrderedDict((p.name, p.weight.read()) for p in plan.params if p.kind != "tied")
    shapes = [
        collections.OrderedDict((n, torch.Size(by_name[n].shape)) for n in g["params"] if n in by_name)
        for g in plan.groups
    ]
    frozen = collections.OrderedDict((p.name, torch.Size(p.shape)) for p in plan.params if p.kind == "frozen")
    return {
        "module": module,
        "buffer_names": [p.name for p in plan.params if p.kind == "buffer"],
        "optimizer": None,
        "param_shapes": shapes,
        "frozen_param_shapes": frozen or None,
        "shared_params": {p.name: p.weight.tied_to for p in plan.params if p.kind == "tied"},
        "frozen_param_fragments": None,
        "lr_scheduler": plan.scheduler,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": plan.step or 0,
        "dp_world_size": plan.dp or 1,
        "mp_world_size": 1,
        "ds_config": {},
        "ds_version": ds_version,
    }
