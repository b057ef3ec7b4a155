"""One module per checkpoint format. Each has `FORMAT`, `sniff(path) -> bool`, `open(path) -> Checkpoint` and,
where it holds optimizer state, `training_state(ck) -> StateMap`: the `FormatModule` / `EditableFormatModule`
Protocols (formats/_protocol.py) say the contract of each.

`detect` asks them in order; the order matters where layouts nest (an Accelerate folder can hold a
DeepSpeed tag folder, a universal checkpoint holds DeepSpeed model-states files).
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import cast

from ..errors import CkptError, NotACheckpoint, UnsupportedCheckpoint
from ..read.state import StateMap
from ..read.tree import Checkpoint
from ._protocol import EditableFormatModule, FormatModule

#: detection order: the most specific layouts first
FORMAT_MODULES = (
    "hf_trainer",
    "torchtune",
    "megatron_lm",
    "megatron_dist",
    "safetensors_file",
    "dcp",
    "universal",
    "accelerate",
    "megatron_pipeline",
    "deepspeed_moe",
    "deepspeed",
    "fsdp_sharded",
    "lightning",
    "torch_file",
)


class UnknownFormat(CkptError, KeyError):
    """A format module name that FORMAT_MODULES does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.one_line()


def format_module(name: str) -> FormatModule:
    """The format module `name` of FORMAT_MODULES (e.g. "deepspeed", "dcp"). A name not there raises
    UnknownFormat (a CkptError and a KeyError) naming the known ones; a listed name without a module is an
    import error, never skipped."""
    if name not in FORMAT_MODULES:
        raise UnknownFormat(
            f"no format module named {name!r}",
            hint=f"the format modules are: {', '.join(FORMAT_MODULES)}",
        )
    return cast(FormatModule, importlib.import_module(f"{__name__}.{name}"))


def module_of_format(fmt: str) -> FormatModule | None:
    """The format module whose FORMAT id is `fmt` (what `Checkpoint.format` carries), or None."""
    for name in FORMAT_MODULES:
        mod = format_module(name)
        if getattr(mod, "FORMAT", None) == fmt:
            return mod
    return None


def format_ids() -> tuple[str, ...]:
    """Every format id the registry reads (what `ckpt inspect` prints as `format`), in detection order."""
    return tuple(m.FORMAT for m in map(format_module, FORMAT_MODULES))


def editable_format_ids() -> tuple[str, ...]:
    """The format ids whose module says where the LR, step and optimizer state live (`training_state`): the ones
    `set-lr` / `set-step` edit."""
    return tuple(m.FORMAT for m in map(format_module, FORMAT_MODULES) if hasattr(m, "training_state"))


def training_state(ck: Checkpoint) -> StateMap:
    """Where `ck`'s training state lives (`ckpt_tools.read.state.StateMap`), as its format module says; a format
    without a `training_state` is read-only for the writing commands."""
    mod = module_of_format(ck.format)
    if isinstance(mod, EditableFormatModule):
        return mod.training_state(ck)
    return StateMap(
        Path(ck.path),
        (),
        read_only=f"set-lr/set-step do not edit {ck.format} checkpoints: they hold no optimizer or scheduler state",
        hint="edit the training checkpoint the run resumes from",
    )


def detect(path: Path) -> FormatModule:
    """The format module that reads `path`; raises NotACheckpoint naming what was looked for, and when the
    path is the wrong one, the right one: the checkpoints a parent folder holds, or the checkpoint a file
    or folder sits inside."""
    if not path.exists():
        raise NotACheckpoint("no such file or folder", path=path, hint="check the path")
    mod = claim(path)
    if mod is not None:
        return mod
    what = "folder" if path.is_dir() else "file"
    inside = checkpoints_inside(path) if path.is_dir() else []
    if inside:
        names = ", ".join(p.name for p, _ in inside[:5]) + (f", … {len(inside) - 5} more" if len(inside) > 5 else "")
        n = len(inside)
        raise NotACheckpoint(
            f"this folder holds {n} checkpoints, newest first: {names}"
            if n > 1
            else f"this folder holds one checkpoint: {names}",
            path=path,
            hint=f"pass one of them, e.g. ckpt inspect {inside[0][0]}",
        )
    whole = holder(path)
    if whole is not None:
        up, fmt = whole
        raise NotACheckpoint(
            f"this {what} is part of the {fmt} checkpoint {up}", path=path, hint=f"pass that folder: ckpt inspect {up}"
        )
    megatron = megatron_lm_layout(path)
    if megatron:
        raise UnsupportedCheckpoint(
            f"a Megatron-LM layout ({megatron}) that does not open as a whole checkpoint "
            "here (an iteration folder without its rank folders, or a latest file naming an "
            "iteration that is not here)",
            path=path,
            hint="pass the run folder or an iter_N folder that holds every mp_rank_* folder "
            "(legacy) or .metadata + common.pt + metadata.json (torch_dist)",
        )
    raise NotACheckpoint(
        f"this {what} is not a supported checkpoint (looked for DeepSpeed mp_rank_*/zero_pp_rank_* files, "
        "layer_*-model_* files, a DCP .metadata, Accelerate state files, torch.save files, safetensors)",
        path=path,
        hint="pass the checkpoint folder, its tag folder, or a checkpoint file",
    )


def holder(path: Path) -> tuple[Path, str] | None:
    """(folder, format) of the checkpoint above `path` that opens and holds it (a file it read or one beside
    them, such as `latest`; a folder with a file it read inside), farthest first; None when none does. A folder a
    format merely claims is not enough: a stale
    `latest_universal` left in a parent by ds_to_universal claims every folder below it and opens nothing."""
    mine = os.path.abspath(path.resolve())
    for up, mod in reversed(enclosing(path)):
        try:
            whole = mod.open(up)
        except (CkptError, OSError):
            continue
        held = [os.path.abspath((Path(whole.path) / f.path).resolve()) for f in whole.files]
        beside = {os.path.dirname(h) for h in held} | {os.path.abspath(Path(whole.path).resolve())}
        if any(h == mine or h.startswith(mine + os.sep) for h in held) or os.path.dirname(mine) in beside:
            return up, getattr(mod, "FORMAT", mod.__name__)
    return None


def megatron_lm_layout(path: Path) -> str | None:
    """What marks `path` as Megatron-LM's own save layout (a run folder, an `iter_N` folder, a `mp_rank_XX`
    folder), or None."""
    if not path.is_dir():
        return None
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return "latest_checkpointed_iteration.txt"
    for sub in (path, *[d for d in path.iterdir() if d.is_dir() and re.fullmatch(r"mp_rank_\d+(_\d+)?", d.name)][:1]):
        for name in ("model_optim_rng.pt", "distrib_optim.pt"):
            if (sub / name).is_file():
                return str((sub / name).relative_to(path)) if sub != path else name
    if (path / "common.pt").is_file() and (path / "metadata.json").is_file():
        return "torch_dist: common.pt + metadata.json"
    return None


def claim(path: Path) -> FormatModule | None:
    """The first format module whose `sniff` claims `path`, or None."""
    for name in FORMAT_MODULES:
        mod = format_module(name)
        if mod.sniff(path):
            return mod
    return None


#: files that are pieces of a sharded checkpoint, never one by themselves: a folder of them is a damaged
#: checkpoint (its metadata file missing), not a folder of checkpoints
_PART_NAME = re.compile(
    r"(zero_pp_rank_\d+|mp_rank_\d+|layer_\d+-model_\d+|^__\d+_\d+\.distcp$|^rank\d+\.|"
    r"^model_optim_rng\.pt$|^distrib_optim\.pt$|^expp_rank_\d+)"
)
_CKPT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".safetensors")


def checkpoints_inside(folder: Path) -> list[tuple[Path, FormatModule]]:
    """The checkpoints directly inside `folder` (sub-folders and checkpoint files a format claims), newest
    first: what a user who passed the parent of their checkpoints meant to choose from. One level only, so
    that a wrong path (a home folder) costs one directory listing, not a walk."""
    found = []
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return []
    for child in children:
        if child.name.startswith(".") or (
            child.is_file() and (child.suffix not in _CKPT_SUFFIXES or _PART_NAME.search(child.name))
        ):
            continue
        try:
            mod = claim(child)
        except (CkptError, OSError):
            continue
        if mod is not None:
            found.append((child, mod))
    return sorted(found, key=lambda pm: newest_mtime(pm[0]), reverse=True)


def newest_mtime(path: Path) -> float:
    """When a checkpoint was last written: the newest file in it and in its sub-folders, two levels down
    (a tag folder, HF's checkpoint-N/global_stepN)."""
    newest = 0.0
    stack = [(path, 0)]
    while stack:
        p, depth = stack.pop()
        try:
            st = p.stat()
        except OSError:
            continue
        newest = max(newest, st.st_mtime)
        if p.is_dir() and depth < 3:
            try:
                stack += [(c, depth + 1) for c in p.iterdir()]
            except OSError:
                pass
    return newest


def enclosing(path: Path, levels: int = 2) -> list[tuple[Path, FormatModule]]:
    """The folders above `path`, nearest first and at most `levels` up, that a format claims: the checkpoint
    a file or folder inside a checkpoint belongs to (a ZeRO rank file's tag folder, a DCP .distcp's folder).
    Two levels reach every layout's tag folder and its parent; a claim there is cheap to test."""
    out = []
    for up in list(path.resolve().parents)[:levels] if path.exists() else []:
        try:
            mod = claim(up)
        except (CkptError, OSError):
            continue
        if mod is not None:
            out.append((_as_given(path, up), mod))
    return out


def _as_given(path: Path, up: Path) -> Path:
    """`up` (a resolved ancestor of `path`) spelled as the user spelled `path`, relative when they were."""
    for given in path.parents:
        try:
            if given.resolve() == up:
                return given
        except OSError:
            break
    return up
