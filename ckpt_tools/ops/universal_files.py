"""The files of a DeepSpeed universal checkpoint (`ops.to_universal`'s module docstring says what DeepSpeed's loaders
read): the plan's types (one `ParamJob` per parameter folder, the `UniversalPlan`), how each file is written the way
torch.save would (a parameter's state tensors copied range by range or merged in memory, step.pt and
optimizer_state.pt from the optimizer file's own records, the model-states files), and the structural re-read
(`verify_written`)."""

from __future__ import annotations

import math
import os
import pickletools
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import CkptError, CorruptCheckpoint, UnsupportedCheckpoint
from ..formats import _common as C
from ..read import allowlist
from ..read.pickle_reader import FdCache, TensorRef, load
from ..read.tensor_read import read_tensor, source_ranges
from ..read.tp_layout import Rule, merge_shards
from ..read.tree import TensorNode
from ..write.pickle_writer import _pickle_tree
from ..write.shares import JobFigures
from ..write.torch_zip import archive_name, copy_file, save, tensor_record

STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what DeepSpeed's ZeRO-3 universal loader reads (and only that)
ADAM_STATE = frozenset(("exp_avg", "exp_avg_sq"))
OPTIM_SHARDED_KEYS = (
    "base_optimizer_state",
    "single_partition_of_fp32_groups",
    "param_slice_mappings",
    "fp32_flat_groups",
    "optimizer_state_dict",
)
VOCAB_TENSOR = "vocab_tensor"  # deepspeed.checkpoint.constants.VOCAB_TENSOR
PARAM_N_SUB_PARAMS = "param_n_sub_params"


# --- the plan -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamJob:
    """One parameter's output: where each state's elements are, and how its TP shards merge."""

    name: str
    shape: tuple[int, ...]  # the logical (merged, vocabulary padding stripped) shape
    param_group: int
    states: dict[str, TensorNode] = field(repr=False)  # state -> node (with pieces, or with TP shards)
    merge: str = "whole"  # "whole" (TP=1), "replicated", "average", "cat:<d>", "cat_sub:<d>"
    rule: Rule | None = field(default=None, repr=False)
    how: str = ""  # why this merge (rule source + pattern), for --dry-run
    extra: dict[str, Any] = field(default_factory=dict)  # cat_dim, vocab_tensor, param_n_sub_params
    module_only: bool = False  # a module tensor with no optimizer state (DeepSpeed writes fp32.pt for it too)
    has_step: bool = True  # the optimizer keeps a step (Adam, Adagrad: step.pt is written; SGD: none)

    @property
    def nbytes(self) -> int:
        return sum(4 * math.prod(self.shape) for _ in self.states)


@dataclass(frozen=True)
class UniversalPlan:
    """Everything `execute` will write, decided (and every refusal raised) before any byte is written."""

    source: Path
    source_format: str
    tag_dir: Path
    tag: str
    out: Path
    topology: dict[str, Any]
    params: tuple[ParamJob, ...]
    model_files: tuple[Path, ...]  # model-states files copied into the tag folder
    z3_aliases: tuple[tuple[str, str], ...]  # (name to write, copied file it duplicates) for ZeRO-3 loaders
    optim_file: Path  # pp0/tp0/dp0 optimizer file: param groups, loss scaler, step
    ds_version: Any
    layout: str
    notes: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    state_keys: tuple[str, ...] = STATES[1:]  # the per-parameter optimizer state carried (besides fp32)
    warnings: tuple[str, ...] = ()  # what DeepSpeed will do wrong with the output (see zero3_group_warnings)
    stages: tuple[int, ...] = (1, 2, 3)  # the ZeRO stages whose universal loader the output is written for
    #: `--trust-pickles` let the source's globals outside the allowlist through: the output may carry them
    trust_pickles: bool = False

    @property
    def out_tag(self) -> str:
        return f"{self.tag}_universal"

    @property
    def nbytes(self) -> int:
        return sum(j.nbytes for j in self.params) + sum(p.stat().st_size for p in self.model_files)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": str(self.source),
            "format": self.source_format,
            "tag": self.tag,
            "out": str(self.out),
            "out_tag": self.out_tag,
            "topology": self.topology,
            "tp_layout": self.layout,
            "bytes": self.nbytes,
            "files": 2
            + len(self.model_files)
            + len(self.z3_aliases)
            + sum(len(j.states) + (0 if j.module_only or not j.has_step else 1) for j in self.params),
            "model_files": [p.name for p in self.model_files] + [a for a, _ in self.z3_aliases],
            "params": [
                {
                    "name": j.name,
                    "shape": list(j.shape),
                    "merge": j.merge,
                    "how": j.how,
                    "states": list(j.states),
                    "bytes": j.nbytes,
                }
                for j in self.params
            ],
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "optimizer_state": list(self.state_keys),
            "loads_at_zero_stages": list(self.stages),
        }


# --- reading --------------------------------------------------------------------------------------------


def _merged_state(job: ParamJob, key: str, fds: FdCache):
    import torch  # lazy: torch only where a state is merged or converted in memory; the direct copy is torch-free

    node = job.states[key]
    if not node.shards:
        t = read_tensor(node, fds)
    else:
        parts = [read_tensor(s, fds) for s in node.shards]
        if job.merge == "replicated":
            t = parts[0]
        elif job.merge == "average":
            t = sum(parts) / len(parts)
        else:
            t = merge_shards(job.rule, parts)
        del parts
    if job.extra.get(VOCAB_TENSOR):
        t = t[: job.shape[0]]
    if t.dtype != torch.float32 and job.module_only:
        t = t.float()
    return t.contiguous()


# --- writing --------------------------------------------------------------------------------------------


def _check_globals(pickle_bytes: bytes, source: Path) -> None:
    """Refuse to copy a pickled global outside the allowlist (`read.allowlist`) into the output: DeepSpeed loads
    these files with a full unpickler, so a global copied here would run there."""
    for op, arg, _ in pickletools.genops(pickle_bytes):
        if op.name != "GLOBAL":
            continue
        module, _, name = str(arg).partition(" ")
        if not allowlist.is_allowed(module, name):
            raise UnsupportedCheckpoint(
                f"refusing to load: the pickle names a class outside the allowlist ({allowlist.dotted(module, name)})",
                path=source,
                hint="inspect it with `ckpt inspect` to see the unknown global",
            )


@dataclass(frozen=True)
class _Prepared:
    """A small tree of records from the optimizer file, pickled and checked once, written to many files."""

    obj: Any
    pickle_bytes: bytes
    storages: dict
    data: dict


def _prepare(obj: Any, source: Path) -> _Prepared:
    pickle_bytes, storages = _pickle_tree(obj, str(source))
    _check_globals(pickle_bytes, source)
    # the storages' bytes now (a step is 4 bytes; optimizer_state.pt holds nothing big)
    data = {k: bytes(s.source.read_storage(s, 0, s.nbytes)) for k, s in storages.items() if s.source is not None}
    return _Prepared(obj, pickle_bytes, storages, data)


def _save_record(obj: Any, path: Path, source: Path) -> None:
    """`torch.save(obj, path)` for a tree of records read from `source` (their storages copied from it)."""
    p = obj if isinstance(obj, _Prepared) else _prepare(obj, source)
    path.parent.mkdir(parents=True, exist_ok=True)
    save(p.obj, path, p.data, pickle_bytes=p.pickle_bytes, storages=p.storages)


def _steps_and_globals(plan: UniversalPlan) -> tuple[dict[int, Any], dict[str, Any]]:
    """(step per param group, optimizer_state.pt) from the pp0/tp0/dp0 optimizer file, as `pickle_reader`
    records: nothing in the pickle runs, the flat partitions are never read, and `_save_record` writes the
    small fields back as torch.save would have (refusing any global outside the DeepSpeed allowlist)."""
    sd = load(plan.optim_file).obj
    if plan.topology.get("zero_stage") == 0:
        return _torch_optimizer_globals(sd, plan)
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict):
        raise CorruptCheckpoint(
            "the optimizer file has no optimizer_state_dict",
            path=plan.optim_file,
            hint="the optimizer files are incomplete; re-copy them",
        )
    inner = osd.get("optimizer_state_dict") if "fp32_flat_groups" in osd else osd.get("base_optimizer_state")
    inner = inner if isinstance(inner, dict) else {}
    groups = inner.get("param_groups") or []
    steps = {}
    for g, st in (inner.get("state") or {}).items():
        if isinstance(st, dict) and "step" in st:
            steps[int(g)] = st["step"]
    out = {k: v for k, v in osd.items() if k not in OPTIM_SHARDED_KEYS}
    out["param_groups"] = _without_ep_names(groups)
    if 3 in plan.stages:
        # the ZeRO-3 loader reads optimizer_state_dict.state[0].step and .param_groups[0]
        out["optimizer_state_dict"] = {"state": {g: {"step": s} for g, s in steps.items()}, "param_groups": groups}
    if plan.ds_version and "ds_version" not in out:
        out["ds_version"] = plan.ds_version  # ZeRO-3 files lack it; ZeRO-1/2 fp16/fp32 loaders assert it
    return steps, out


def _without_ep_names(groups: list) -> list:
    """An MoE group's `name` is its expert group at the SAVED expert-parallel size (ep_size_N); DeepSpeed's
    loader copies every key of a saved group onto the live one, and the live group must keep the name of the
    size it runs at (its optimizer looks the expert process group up by it): left out."""
    return [{k: v for k, v in g.items() if k != "name"} if isinstance(g, dict) and g.get("moe") else g for g in groups]


def _torch_optimizer_globals(sd: Any, plan: UniversalPlan) -> tuple[dict[int, Any], dict[str, Any]]:
    """No ZeRO (`expp_rank_0_…_optim_states.pt`: `{'optimizer': torch state_dict}`): each group's step is its
    first parameter's (torch's Adam keeps one per parameter, all equal), and optimizer_state.pt holds what the
    ZeRO-1/2 universal loader reads from it: the param groups and `ds_version` (it asserts one)."""
    osd = sd.get("optimizer") if isinstance(sd, dict) else None
    if not isinstance(osd, dict) or not isinstance(osd.get("param_groups"), list):
        raise CorruptCheckpoint(
            "the optimizer file holds no torch optimizer state", path=plan.optim_file, hint="re-copy it"
        )
    state = osd.get("state") if isinstance(osd.get("state"), dict) else {}
    steps = {}
    for gi, g in enumerate(osd["param_groups"]):
        first = next((state[i] for i in g.get("params") or [] if isinstance(state.get(i), dict)), None)
        if first is not None and "step" in first:
            steps[gi] = first["step"]
    return steps, {"param_groups": _without_ep_names(osd["param_groups"]), "ds_version": plan.ds_version}


#: (extra items, dtype, shape) -> (pickle, storages) of a `{**extra, "param": tensor}` file: 581 parameters
#: have a few dozen distinct shapes, and pickling is the per-file cost that remains
_PICKLES: dict[tuple, tuple[bytes, dict]] = {}


def _state_pickle(extra: dict[str, Any], dtype: str, shape: tuple[int, ...]) -> tuple[dict, bytes, dict]:
    obj = {**extra, "param": tensor_record(dtype, shape)}
    key = (repr(list(extra.items())), dtype, shape)
    hit = _PICKLES.get(key)
    if hit is None:
        hit = _PICKLES[key] = _pickle_tree(obj, None)
    return obj, *hit


def _write_state(job: ParamJob, key: str, path: Path, fds: FdCache) -> int:
    """Write `{**job.extra, "param": <state key's tensor>}` as torch.save would; returns its tensor bytes."""
    node = job.states[key]
    direct = (
        job.merge == "whole" and not job.extra.get(VOCAB_TENSOR) and (not job.module_only or node.dtype == "float32")
    )
    ranges = source_ranges(node, fds) if direct else None
    if ranges is not None:
        obj, pickle_bytes, storages = _state_pickle(job.extra, node.dtype, tuple(node.shape))
        return save(obj, path, {"0": ranges}, pickle_bytes=pickle_bytes, storages=storages)
    t = _merged_state(job, key, fds)  # merged / converted in memory (imports torch)
    obj, pickle_bytes, storages = _state_pickle(job.extra, str(t.dtype).removeprefix("torch."), tuple(t.shape))
    raw = t.reshape(-1).view(_torch_uint8()).numpy() if t.numel() else b""
    return save(obj, path, {"0": raw}, pickle_bytes=pickle_bytes, storages=storages)


def _torch_uint8():
    import torch  # lazy: torch only where a state is merged or converted in memory; the direct copy is torch-free

    return torch.uint8


def _convert_one(job: ParamJob, zero_dir: Path, steps: dict[int, _Prepared], fds: FdCache, source: Path) -> int:
    pdir = zero_dir / job.name
    pdir.mkdir(parents=True, exist_ok=True)
    written = 0
    for key in job.states:
        written += _write_state(job, key, pdir / f"{key}.pt", fds)
    if not job.module_only and job.param_group in steps:
        _save_record(steps[job.param_group], pdir / "step.pt", source)
    return written


@dataclass(frozen=True)
class UniversalResult(JobFigures):
    """What `execute` did."""

    out: Path
    tag: str
    params: int
    bytes_written: int
    files: int
    problems: tuple[str, ...] = ()


def convert_params(
    plan: UniversalPlan,
    tag_out: Path,
    indices: Iterable[int],
    *,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
    steps: dict[int, Any] | None = None,
    on_done: Callable[[ParamJob], None] | None = None,
) -> int:
    """Write `zero/<param>/` for the jobs at `indices` into `tag_out`; returns the bytes written. `on_done(job)`
    runs in the calling thread after each parameter is written (the resumable job verifies and journals it)."""
    if steps is None:
        steps, _ = _steps_and_globals(plan)
    steps = {g: _prepare(s, plan.optim_file) for g, s in steps.items()}  # one pickle per group's step.pt
    zero_dir = tag_out / "zero"
    zero_dir.mkdir(parents=True, exist_ok=True)
    fds = FdCache()
    jobs = [plan.params[i] for i in indices]
    # biggest first: the pool finishes together instead of waiting on one huge tensor at the end
    jobs.sort(key=lambda j: -math.prod(j.shape))
    total = 0
    try:
        if workers <= 1:
            for j in jobs:
                n = _convert_one(j, zero_dir, steps, fds, plan.optim_file)
                total += n
                if on_done:
                    on_done(j)
                if progress:
                    progress(n)
        else:
            pool = ThreadPoolExecutor(max_workers=workers)
            try:
                for j, n in zip(jobs, pool.map(lambda j: _convert_one(j, zero_dir, steps, fds, plan.optim_file), jobs)):
                    total += n
                    if on_done:
                        on_done(j)
                    if progress:
                        progress(n)
            except BaseException:
                # Ctrl-C / SIGTERM: the tensors being written finish, the queued ones never start (a `with` block
                # would wait for the whole conversion before the interruption could act)
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            pool.shutdown()
    finally:
        fds.close()
    return total


def _write_common(plan: UniversalPlan, root: Path, optimizer_state: dict[str, Any]) -> None:
    """Everything but the per-parameter folders: model-states files, optimizer_state.pt, latest_universal."""
    tag_out = root / plan.out_tag
    tag_out.mkdir(parents=True, exist_ok=True)
    for p in plan.model_files:
        copy_file(p, tag_out / p.name)
    for alias, target in plan.z3_aliases:
        try:
            os.link(tag_out / target, tag_out / alias)
        except OSError:
            copy_file(tag_out / target, tag_out / alias)
    _save_record(optimizer_state, tag_out / "zero" / "optimizer_state.pt", plan.optim_file)
    (root / "latest_universal").write_text(plan.out_tag)


def verify_written(
    plan: UniversalPlan,
    root: Path,
    indices: Iterable[int] | None = None,
    *,
    common: bool = True,
    parsed: dict | None = None,
) -> list[str]:
    """Re-read what was written (pickles only, no tensor bytes): every planned file is there, holds a
    `param` of the planned shape, and the common files exist. `indices`: only those parameters (a rank's
    share); `common=False`: not the common files; `parsed`: a cache kept across calls."""
    tag_out = root / plan.out_tag
    cache = C.LoadCache(tag_out)
    problems = []
    # data.pkl bytes -> (param shape, storage member, its size): equal pickles parse alike, so each distinct
    # pickle (a few dozen among thousands of files) is parsed once; every file's own zip directory is read
    parsed = {} if parsed is None else parsed
    for j in plan.params if indices is None else [plan.params[i] for i in indices]:
        files = [*j.states] + ([] if j.module_only or j.param_group < 0 or not j.has_step else ["step"])
        for key in files:
            f = tag_out / "zero" / j.name / f"{key}.pt"
            if not f.is_file():
                problems.append(f"{j.name}/{key}.pt: missing")
                continue
            if key == "step":
                continue
            try:
                with zipfile.ZipFile(f) as zf:
                    prefix = f"{archive_name(f)}/"
                    pkl = zf.read(prefix + "data.pkl")
                    got = parsed.get(pkl)
                    if got is None:
                        obj = cache.load(f).obj
                        ref = obj.get("param") if isinstance(obj, dict) else None
                        got = parsed[pkl] = (
                            (tuple(ref.shape), f"data/{ref.storage.key}", ref.storage.nbytes)
                            if isinstance(ref, TensorRef) and ref.storage is not None
                            else (getattr(ref, "shape", None), "", 0)
                        )
                    if got[1] and zf.getinfo(prefix + got[1]).file_size != got[2]:
                        problems.append(f"{j.name}/{key}.pt: {got[1]} does not hold {got[2]} bytes")
            except (zipfile.BadZipFile, KeyError, OSError, CkptError) as e:
                problems.append(f"{j.name}/{key}.pt: unreadable ({e})")
                continue
            if got[0] != tuple(j.shape):
                problems.append(f"{j.name}/{key}.pt: expected shape {j.shape}, found {got[0]}")
    if not common:
        return problems
    for rel in ["zero/optimizer_state.pt", *(p.name for p in plan.model_files), *(a for a, _ in plan.z3_aliases)]:
        if not (tag_out / rel).is_file():
            problems.append(f"{rel}: missing")
    if (root / "latest_universal").read_text() != plan.out_tag:
        problems.append("latest_universal does not name the tag folder")
    return problems
