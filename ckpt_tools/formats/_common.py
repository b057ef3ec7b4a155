"""Helpers every format module shares: loading files safely, stray-file warnings, `latest` tags."""

from __future__ import annotations

import bisect
import itertools
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Iterable

from ..read import pickle_reader
from ..read.state import COUNTER_KEYS
from ..schedules import deepspeed as ds_schedule
from ..errors import MissingFile, NotACheckpoint
from ..read.tree import (
    Checkpoint,
    Counters,
    FileInfo,
    GroupNode,
    LearningRates,
    Node,
    Topology,
    Warning_,
    as_int,
    floats,
    scalar,
)

#: names that a loader globbing the folder could pick up by mistake, or that show a hand edit
_STRAY_RE = re.compile(r"(\.orig|\.bak|\.backup|\.old|\.tmp|\.swp|~)$|^\.#|\.pt\.\d+$")


class LoadCache:
    """Parses each file once per `open_checkpoint` call and remembers unknown pickle globals."""

    def __init__(self, root: Path):
        self.root = root
        self._loaded: dict[Path, pickle_reader.Loaded] = {}
        self._outer: dict[Path, pickle_reader.Source] = {}
        self._rel: dict[Any, str] = {}
        self.unknown_globals: dict[str, list[str]] = {}
        self._known: set[frozenset[str]] = set()  # sets of globals seen that name no unknown one

    def load(self, path: Path) -> pickle_reader.Loaded:
        hit = self._loaded.get(path)  # a Path hits without building another; anything else becomes one
        if hit is None:
            path = Path(path)
            hit = self._loaded.get(path)
            if hit is None:
                hit = pickle_reader.load(path)
                self._loaded[path] = hit
                self._note_unknown(path, hit)
        return hit

    def load_embedded(self, path: Path, offset: int, length: int) -> pickle_reader.Loaded:
        """One torch.save zip stored inside `path` (a DCP `.distcp` item); all items of a file share one mmap."""
        path = Path(path)
        hit = pickle_reader.load_embedded(self.outer(path), offset, length)
        self._note_unknown(path, hit)
        return hit

    def load_embedded_head(
        self, path: Path, offset: int, length: int, head_bytes: int = pickle_reader.ITEM_HEAD_BYTES
    ) -> pickle_reader.Loaded:
        """`load_embedded` read from the item's first `head_bytes` (`pickle_reader.load_embedded_head`)."""
        path = path if isinstance(path, Path) else Path(path)
        hit = pickle_reader.load_embedded_head(self.outer(path), offset, length, head_bytes)
        if hit.globals_seen not in self._known:  # items parsed alike share their set of globals: judged once
            self._note_unknown(path, hit)
            if not hit.unknown_globals:
                self._known.add(hit.globals_seen)
        return hit

    def outer(self, path: Path) -> pickle_reader.Source:
        """The one Source (one mmap) every item of the file `path` reads through."""
        outer = self._outer.get(path)
        if outer is None:
            outer = self._outer[path] = pickle_reader.Source(path)
        return outer

    def _note_unknown(self, path: Path, loaded: pickle_reader.Loaded) -> None:
        unknown = loaded.unknown_globals
        if unknown:
            rel = self.rel(path)
            self.unknown_globals[rel] = sorted(set(self.unknown_globals.get(rel, [])) | set(unknown))

    def rel(self, path: Path) -> str:
        hit = self._rel.get(path)
        if hit is None:
            try:
                hit = str(Path(path).relative_to(self.root))
            except ValueError:
                hit = str(path)
            self._rel[path] = hit
        return hit

    def warnings(self) -> list[Warning_]:
        return [
            Warning_(
                "unknown-global",
                f"pickle names {', '.join(names)}: shown as opaque records, not executed "
                "(a plain torch.load would import and run it)",
                rel,
            )
            for rel, names in sorted(self.unknown_globals.items())
        ]


def stray_file_warnings(folder: Path, root: Path) -> list[Warning_]:
    """Files beside state files that a loader globbing this folder could pick up."""
    out = []
    if not folder.is_dir():
        return out
    names = sorted(os.listdir(folder))
    for name in names:
        rel = str((folder / name).relative_to(root)) if folder != root else name
        if _STRAY_RE.search(name):
            out.append(
                Warning_(
                    "stray-file",
                    f"{name} sits beside state files; a loader that globs this folder "
                    f"may pick it up. Move it out of the checkpoint folder",
                    rel,
                )
            )
        elif "custom_checkpoint" in name and not re.fullmatch(r"custom_checkpoint_\d+\.pkl", name):
            out.append(
                Warning_(
                    "stray-file",
                    f"{name} looks like a copy of custom_checkpoint_N.pkl; "
                    "Accelerate < 1.x counts every file containing 'custom_checkpoint' and then "
                    "silently skips loading custom state. Move it out of the folder",
                    rel,
                )
            )
    return out


def read_latest(folder: Path, name: str = "latest") -> str | None:
    p = folder / name
    if not p.is_file():
        return None
    try:
        return p.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def resolve_tag(path: Path, marker_glob: str, latest_name: str = "latest") -> tuple[Path, Path, str | None]:
    """(root given by the user, tag folder holding the state files, tag name). Accepts the tag folder or
    its parent with `latest`; with no `latest` and exactly one tag folder, that one."""
    if any(path.glob(marker_glob)):
        return path, path, path.name
    tag = read_latest(path, latest_name)
    if tag is not None:
        tag_dir = path / tag
        if not tag_dir.is_dir():
            raise MissingFile(
                f"'{latest_name}' names tag '{tag}' but {tag_dir} does not exist",
                path=path / latest_name,
                hint=f"point {latest_name} at an existing tag folder or pass the tag folder itself",
            )
        return path, tag_dir, tag
    cands = [d for d in sorted(path.iterdir()) if d.is_dir() and any(d.glob(marker_glob))]
    if len(cands) == 1:
        return path, cands[0], cands[0].name
    if cands:
        raise NotACheckpoint(
            f"several tag folders ({', '.join(c.name for c in cands)}) and no '{latest_name}' file",
            path=path,
            hint="pass one tag folder",
        )
    raise NotACheckpoint("no checkpoint files found", path=path)


def file_info(path: Path, root: Path, role: str, rank: dict | None = None) -> FileInfo:
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    rel = str(path.relative_to(root)) if path != root else path.name
    return FileInfo(rel, size, role, dict(rank or {}))


def zip_damage(path: Path) -> str | None:
    """Why the torch zip `path` cannot be loaded (truncated, not a zip), or None: its central directory only,
    for rank files a reader lists without loading (ZeRO-3's per-rank model states)."""
    try:
        with zipfile.ZipFile(path) as zf:
            size = path.stat().st_size
            for info in zf.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"member {info.filename} runs past the end of the file"
    except (OSError, zipfile.BadZipFile) as e:
        return f"not a readable torch zip ({e})"
    return None


def scheduler_fields(node: Node | None) -> dict[str, Any]:
    """The scalar fields of a torch scheduler state dict (or DeepSpeed's {last_batch_iteration})."""
    if not isinstance(node, GroupNode):
        return {}
    return {k: scalar(v) for k, v in node.children.items()}


def lr_from_scheduler(fields: dict[str, Any]) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    return floats(fields.get("base_lrs")), floats(fields.get("_last_lr"))


def ds_last_lr(fields: dict[str, Any], ds_config: Any, group_lrs: tuple[float, ...]) -> tuple[float, ...] | None:
    """`last_lr` of a DeepSpeed scheduler, which saves only `last_batch_iteration`: computed from the saved
    ds_config's scheduler (the launch config of the run that saved it)."""
    if "last_batch_iteration" not in fields:
        return None
    return ds_schedule.last_lr(ds_config, fields["last_batch_iteration"], list(group_lrs))


def scheduler_counters(fields: dict[str, Any]) -> tuple[int | None, int | None]:
    """(last_epoch, _step_count); DeepSpeed's own schedulers save `last_batch_iteration` instead."""
    last = fields.get("last_epoch", fields.get("last_batch_iteration"))
    return as_int(last), as_int(fields.get("_step_count"))


def in_order(children: dict[str, Any], order: tuple[str, ...]) -> dict[str, Any]:
    """A tree's top-level children in the order a framework's pieces read (`order`), the others after them."""
    return dict(sorted(children.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


def tensor_totals(tensors: list[Any]) -> tuple[int, int, tuple[str, ...]]:
    """(elements, tensors, dtypes) of a model's TensorNodes: a Checkpoint's parameter_count, parameter_tensors and
    dtypes."""
    return sum(t.numel for t in tensors), len(tensors), tuple(sorted({t.dtype for t in tensors}))


def checkpoint_of(
    fmt: str,
    path: Path,
    topology: Topology,
    tree: dict[str, Any],
    counters: Counters,
    lrs: LearningRates,
    totals: tuple[int, int, tuple[str, ...]],
    files: list[FileInfo],
    warnings: list[Warning_],
    details: dict[str, Any],
) -> Checkpoint:
    """The Checkpoint a reader returns, from the pieces every reader collects: `tree` its top-level children,
    `totals` the model's (elements, tensors, dtypes) as `tensor_totals` gives them."""
    count, ntensors, dtypes = totals
    return Checkpoint(
        format=fmt,
        path=str(path),
        topology=topology,
        tree=GroupNode(tree),
        counters=counters,
        lr=lrs,
        parameter_count=count,
        parameter_tensors=ntensors,
        files=tuple(files),
        warnings=tuple(warnings),
        dtypes=tuple(dtypes),
        details=details,
    )


def deepspeed_counters(ms: dict[str, Any], sched: dict[str, Any], optimizer_steps: list[int]) -> Counters:
    """A DeepSpeed engine's counters: global and skipped steps from its model states `ms`, the scheduler's from
    its fields, and the Adam step most of the optimizer's parameters (`optimizer_steps`, one each) hold."""
    last_epoch, step_count = scheduler_counters(sched)
    return Counters(
        global_step=as_int(ms.get("global_steps")),
        optimizer_step=max(set(optimizer_steps), key=optimizer_steps.count) if optimizer_steps else None,
        scheduler_last_epoch=last_epoch,
        scheduler_step_count=step_count,
        skipped_steps=as_int(ms.get("skipped_steps")),
    )


def param_group_lrs(groups: Node | None) -> tuple[float, ...]:
    if not isinstance(groups, GroupNode):
        return ()
    out = []
    for g in groups.children.values():
        lr = scalar(g.children.get("lr")) if isinstance(g, GroupNode) else None
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            out.append(float(lr))
    return tuple(out)


def _numbered(stem: str, i: int) -> str:
    return stem if i == 0 else f"{stem}_{i}"


def training_header(tree: dict[str, Node]) -> tuple[Counters, LearningRates, list[int]]:
    """Counters and LRs of a training state tree with `optimizer`, `optimizer_1`, ..., `scheduler`,
    `scheduler_1`, ... and loop counters in `client_state` (top level or one dict down: torchtitan's
    `train_state.step`). Several optimizers' groups are listed one after the other. Returns the Adam
    steps seen too (for the counter warnings)."""
    steps: list[int] = []
    lrs: list[float] = []
    base: list[float] = []
    last: list[float] = []
    sched0: dict[str, Any] = {}
    for i in itertools.count():
        opt, sch = tree.get(_numbered("optimizer", i)), tree.get(_numbered("scheduler", i))
        if opt is None and sch is None:
            break
        if isinstance(opt, GroupNode):
            steps += optimizer_steps(opt.children.get("state"))
            lrs += param_group_lrs(opt.children.get("param_groups"))
        fields = scheduler_fields(sch)
        sched0 = sched0 or fields
        b, l_ = lr_from_scheduler(fields)
        base += b or ()
        last += l_ or ()
    last_epoch, step_count = scheduler_counters(sched0)
    counters = Counters(
        global_step=loop_step(tree.get("client_state")),
        optimizer_step=max(set(steps), key=steps.count) if steps else None,
        scheduler_last_epoch=last_epoch,
        scheduler_step_count=step_count,
    )
    return counters, LearningRates(tuple(lrs), tuple(base) or None, tuple(last) or None), steps


def loop_step(client: Node | None) -> int | None:
    """The training loop's step counter among saved client state (top level, then one dict down)."""
    if not isinstance(client, GroupNode):
        return None
    levels = [client.children] + [c.children for c in client.children.values() if isinstance(c, GroupNode)]
    for kids in levels:
        for k in COUNTER_KEYS:
            v = as_int(scalar(kids.get(k)))
            if v is not None and not isinstance(scalar(kids.get(k)), bool):
                return v
    return None


def optimizer_steps(state: Node | None) -> list[int]:
    """Every `step` value found under an optimizer `state` subtree (per param or per flat group)."""
    out = []
    if not isinstance(state, GroupNode):
        return out
    for entry in state.children.values():
        if isinstance(entry, GroupNode) and "step" in entry.children:
            v = as_int(scalar(entry.children["step"]))
            if v is not None:
                out.append(v)
    return out


def counter_warnings(
    ckpt_counters, *, accelerate_world_size: int | None = None, optimizer_steps_seen: Iterable[int] = ()
) -> list[Warning_]:
    """Counters that do not fit each other. Knows that Accelerate steps the scheduler once per process
    per optimizer step, and that DeepSpeed counts skipped (overflow) steps in global_steps only."""
    out = []
    steps = sorted(set(optimizer_steps_seen))
    if len(steps) > 1:
        out.append(Warning_("step-mismatch", f"optimizer step counters disagree across ranks/param groups: {steps}"))
    c = ckpt_counters
    if c.global_step is not None and c.optimizer_step is not None:
        expect = c.global_step - (c.skipped_steps or 0)
        if c.optimizer_step != expect:
            out.append(
                Warning_(
                    "step-mismatch",
                    f"optimizer step {c.optimizer_step} != global step {c.global_step}"
                    + (f" - skipped {c.skipped_steps}" if c.skipped_steps else "")
                    + " (an Adam step counter that was reset restarts bias correction)",
                )
            )
    if c.optimizer_step is not None and c.scheduler_last_epoch is not None:
        per_step = accelerate_world_size or 1
        lo, hi = (c.optimizer_step - 1) * per_step, (c.optimizer_step + 1) * per_step
        if not (lo <= c.scheduler_last_epoch <= hi):
            hint = f" (Accelerate steps the scheduler {per_step}x per optimizer step)" if per_step > 1 else ""
            out.append(
                Warning_(
                    "scheduler-mismatch",
                    f"scheduler last_epoch {c.scheduler_last_epoch} does not fit optimizer step "
                    f"{c.optimizer_step}{hint}; the LR schedule may restart or jump on resume",
                )
            )
    return out


def empty_checkpoint_error(path: Path, what: str) -> NotACheckpoint:
    return NotACheckpoint(f"no {what} found", path=path)


def read_range(node, start: int, count: int, starts: list[int] | None = None):
    """Elements [start, start+count) of a TensorNode flattened (numpy; bfloat16 as uint16 bit patterns), read from
    the pieces that hold them. `starts`: the pieces' dst offsets, sorted, to find the first piece by bisection (a
    flat optimizer bucket holds thousands of pieces). ValueError when the pieces leave part of the range uncovered."""
    import numpy as np  # lazy: numpy only where tensor bytes are compared; importing formats stays numpy-free

    pieces = node.pieces if starts is not None else sorted(node.pieces, key=lambda p: p.dst_offset)
    first = max(bisect.bisect_right(starts, start) - 1, 0) if starts is not None else 0
    parts, want = [], start
    for p in pieces[first:]:
        if p.dst_offset + p.numel <= want or p.dst_offset > want:
            continue
        take = min(p.dst_offset + p.numel, start + count) - want
        parts.append(np.asarray(p.ref.read_numpy(p.src_offset + want - p.dst_offset, take)))
        want += take
        if want >= start + count:
            break
    if want < start + count:
        raise ValueError("range not covered by the pieces")
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def rounded_bits(master, dtype: str):
    """fp32 `master` rounded to `dtype` as the reader stores that dtype (bfloat16: uint16 bit patterns, round to
    nearest even, as torch rounds; others: numpy's cast)."""
    import numpy as np  # lazy: numpy only where tensor bytes are compared; importing formats stays numpy-free

    m = np.asarray(master, dtype=np.float32)
    if dtype == "bfloat16":
        bits = m.view(np.uint32).astype(np.uint64)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return m.astype(np.dtype(dtype))


def rounds_to(master, weights, dtype: str) -> bool:
    """Whether fp32 `master` rounded to `dtype` equals `weights` (as read: bfloat16 as uint16 bit patterns): the
    check that an fp32 master belongs to the low-precision weight it was copied into after each step."""
    import numpy as np  # lazy: numpy only where tensor bytes are compared; importing formats stays numpy-free

    rounded = rounded_bits(master, dtype)
    return bool(np.array_equal(rounded, np.asarray(weights, dtype=rounded.dtype)))
