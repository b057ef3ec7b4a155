"""The files a `set-lr` / `set-step` edit touches (`ops.lr`): each one's inert tree, the edits made to it and what
verify reads back, the state found in it by shape (`state.locate`), and how it is written: a torch zip file in place
(`zip_patch.plan_in_place`, else rewritten whole by `pickle_writer.rewrite_torch_zip`), a DCP folder's items as new
blobs appended to their `.distcp` files, a JSON file rewritten."""

from __future__ import annotations

import json
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import CkptError, UnsupportedCheckpoint
from ..formats import training_state
from ..read import pickle_reader
from ..read.pickle_reader import TensorRef
from ..read.state import Found, StateSource, locate
from ..read.tree import Checkpoint
from ..view.checkpoint import open_checkpoint
from ..write import io
from ..write.dcp_write import DcpFolder, tensor_blob, value_blob
from ..write.pickle_writer import _pickle_tree, rewrite_torch_zip
from ..write.zip_patch import Patch, plan_in_place


@dataclass
class _File:
    """One file being edited: its inert tree (edited in place), the changes, and what verify re-reads."""

    rel: str
    path: Path
    obj: Any
    found: Found = field(default_factory=Found)  # where the scheduler / optimizer / counter state lies in `obj`
    changes: list[io.FieldChange] = field(default_factory=list)
    checks: list[tuple[tuple, Any]] = field(default_factory=list)
    storage_bytes: dict[str, bytes] = field(default_factory=dict)
    matched: int = 0  # fields the request applied to, changed or already at the value
    pickle_changed: bool = False  # a field of the pickle itself changed (not only tensor values)

    def set(self, owner: dict, path: tuple, key: Any, new: Any, note: str) -> None:
        self.matched += 1
        old = owner.get(key)
        if _same(old, new):
            return
        owner[key] = new  # replace, never mutate: a list may be shared (memoized) with another field
        self.pickle_changed = True
        self.changes.append(
            io.FieldChange(self.rel, _dotted(path + (key,)), _tuple_as_list(old), _tuple_as_list(new), note)
        )
        self.checks.append((path + (key,), new))

    def set_tensor_value(self, owner: dict, path: tuple, key: Any, value: float, note: str) -> None:
        self.matched += 1
        ref = owner[key]
        fmt = pickle_reader._STRUCT.get(ref.dtype)
        if ref.storage is None or ref.numel != 1 or fmt is None or ref.storage.numel != 1:
            raise UnsupportedCheckpoint(
                f"{_dotted(path + (key,))} is a {ref.dtype} tensor of shape {ref.shape} "
                "in a shared storage; cannot set its value",
                path=self.path,
            )
        new = struct.pack("<" + fmt, value if fmt in "fde" else int(value))
        if ref.dtype.startswith("float") and struct.unpack("<" + fmt, new)[0] != value:
            raise CkptError(
                f"{value} is not exactly representable as {ref.dtype} ({_dotted(path + (key,))})", path=self.path
            )
        old = ref.item()
        if old == value:
            return
        self.storage_bytes[ref.storage.key] = new
        self.changes.append(io.FieldChange(self.rel, _dotted(path + (key,)), old, value, note))
        self.checks.append((path + (key,), value))


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _readback_problem(label: str, got: Any, want: Any) -> str | None:
    """Why a field read back after the write is not what the plan wrote (None when it is)."""
    if isinstance(got, TensorRef):
        got = got.item()
    if _same(got, want) or (isinstance(want, float) and got == want):
        return None
    return f"{label} reads back {got!r}, planned {want!r}"


def _tuple_as_list(v: Any) -> Any:
    """A field's value as a FieldChange records it (old / new): a tuple as a list, anything else as it is."""
    if isinstance(v, tuple):
        return list(v)
    return v


def _dotted(path: tuple) -> str:
    return ".".join(str(k) for k in path)


def _dig(obj: Any, path: tuple) -> Any:
    for k in path:
        obj = obj[k]
    return obj


# --- the files the format names, and the state found in them by shape ------------------------------------


def _load(path: Path, rel: str) -> _File:
    loaded = pickle_reader.load(path)
    if loaded.kind != "torch_zip":
        raise UnsupportedCheckpoint(
            f"{rel} is a {loaded.kind.replace('_', ' ')} file; only torch zip files "
            "(torch.save since 1.6) are rewritten",
            path=path,
            hint="re-save it once with torch.save (zip format), then run this again",
        )
    return _File(rel, path, loaded.obj)


class _DcpFile(_File):
    """A DCP folder seen as one state dict: `obj` is assembled from its items (scheduler, optimizer
    param_groups and 0-d Adam steps, the loop step); each edit is recorded against the flat DCP key it came
    from (`FieldChange.file` is the `.distcp` file holding it) with the item's new blob."""

    def __init__(self, folder, obj: Any, index: dict[tuple, str], prefix: str = ""):
        super().__init__(prefix + ".metadata", folder.root / ".metadata", obj)
        self.folder = folder
        self.index = index
        self.blobs: dict[str, bytes] = {}
        self.prefix = prefix  # the DCP folder relative to the plan's root ("" when it is the root)

    def _record(self, path: tuple, old: Any, new: Any, note: str, blob: bytes) -> None:
        key = self.index.get(path)
        if key is None:
            raise UnsupportedCheckpoint(
                f"{_dotted(path)} is not one item of this DCP checkpoint; cannot edit it", path=self.folder.root
            )
        self.blobs[key] = blob
        self.changes.append(
            io.FieldChange(self.prefix + self.folder.item(key).rel, key, _tuple_as_list(old), _tuple_as_list(new), note)
        )
        self.checks.append((key, new))

    def set(self, owner: dict, path: tuple, key: Any, new: Any, note: str) -> None:
        self.matched += 1
        old = owner.get(key)
        if _same(old, new):
            return
        owner[key] = new
        item = self._item_path(path + (key,))
        if item is not None and item != path + (key,):
            # a field inside one pickled item (Megatron's distributed-optimizer param groups, a sharded object):
            # the whole item is written again, with every edit made to it so far
            whole = _dig(self.obj, item)
            dkey = self.index[item]
            self.blobs[dkey] = value_blob(whole)
            self.changes.append(
                io.FieldChange(
                    self.prefix + self.folder.item(dkey).rel,
                    f"{dkey}:{_dotted(path[len(item) :] + (key,))}",
                    _tuple_as_list(old),
                    _tuple_as_list(new),
                    note,
                )
            )
            self.checks = [c for c in self.checks if c[0] != dkey] + [(dkey, whole)]
            return
        self._record(path + (key,), old, new, note, value_blob(new))

    def _item_path(self, path: tuple) -> tuple | None:
        """The key path of the DCP item that holds `path` (itself, or the pickled object it lies inside)."""
        for n in range(len(path), 0, -1):
            if path[:n] in self.index:
                return path[:n]
        return None

    def set_tensor_value(self, owner: dict, path: tuple, key: Any, value: float, note: str) -> None:
        self.matched += 1
        ref = owner[key]
        if ref.shape != () or pickle_reader._STRUCT.get(ref.dtype) is None:
            raise UnsupportedCheckpoint(
                f"{_dotted(path + (key,))} is a {ref.dtype} tensor of shape {ref.shape}; cannot set its value",
                path=self.folder.root,
            )
        fmt = pickle_reader._STRUCT[ref.dtype]
        if ref.dtype.startswith("float") and struct.unpack("<" + fmt, struct.pack("<" + fmt, value))[0] != value:
            raise CkptError(
                f"{value} is not exactly representable as {ref.dtype} ({_dotted(path + (key,))})", path=self.folder.root
            )
        old = ref.item()
        if old == value:
            return
        self._record(path + (key,), old, value, note, tensor_blob(ref.dtype, value))

    def writes(self) -> list[io.FileWrite]:
        by_file: dict[str, list[io.FieldChange]] = {}
        for c in self.changes:
            by_file.setdefault(c.file, []).append(c)
        out = []
        for rel, nbytes, produce, edit in self.folder.append(self.blobs):
            rel = self.prefix + rel
            method = (
                "re-pickled with the appended items' offsets/lengths, replaced whole"
                if rel.endswith(".metadata")
                else f"in place: {_n(len(by_file.get(rel, [])), 'new item blob')} (torch.save of the new "
                "value) appended after the last byte; the old ones left unreferenced"
            )
            out.append(io.FileWrite(rel, tuple(by_file.get(rel, ())), nbytes, produce, method, edit))
        return out

    def verify(self, written_root: Path) -> list[str]:
        folder = DcpFolder(written_root / self.prefix if self.prefix else written_root)
        problems = []
        for key, want in self.checks:
            try:
                got = folder._load(folder.item(key))
            except CkptError as e:
                problems.append(f"{key}: unreadable after the write ({e})")
                continue
            problem = _readback_problem(key, got, want)
            if problem:
                problems.append(problem)
        return problems


class _JsonFile(_File):
    """A JSON file holding loop counters (HF Trainer's trainer_state.json): rewritten the way its writer
    writes it (indent 2, sorted keys)."""

    def produce(self, tmp: Path) -> None:
        tmp.write_text(json.dumps(self.obj, indent=2, sort_keys=True) + "\n")

    def read_back(self, path: Path) -> Any:
        return json.loads(path.read_text())


def _open_source(src: StateSource) -> _File:
    if src.kind == "json":
        try:
            obj = json.loads(src.path.read_text())
        except (OSError, ValueError) as e:
            raise CkptError(f"cannot read {src.rel} ({e})", path=src.path) from None
        f = _JsonFile(src.rel, src.path, obj)
        f.found = locate(obj, counters=src.counters)
        f.found.optimizers, f.found.schedulers = [], []  # JSON holds logs of LRs, not state that drives them
        return f
    if src.kind == "dcp":
        folder = DcpFolder(src.path)
        obj, index = folder.state_tree(None)
        prefix = src.rel[: -len(".metadata")] if src.rel.endswith("/.metadata") else ""
        f: _File = _DcpFile(folder, obj, index, prefix)
    else:
        f = _load(src.path, src.rel)
    f.found = locate(f.obj, index=src.index, counters=src.counters, counter_paths=src.counter_paths)
    return f


def _collect(ck: Checkpoint) -> tuple[Path, list[_File], int]:
    """(plan root, the files holding scheduler / optimizer / counter state, scheduler steps per update), from
    the map the checkpoint's format module gives (`formats.training_state`)."""
    m = training_state(ck)
    if m.read_only:
        raise UnsupportedCheckpoint(m.read_only, path=ck.path, hint=m.hint)
    files = [_open_source(src) for src in m.sources]
    if not any(f.found for f in files):
        searched = ", ".join(src.rel for src in m.sources) or "no file"
        raise CkptError(
            "no learning-rate or counter state found: no optimizer param_groups, no scheduler state "
            f"and no loop counter in {searched}",
            path=ck.path,
            hint="nothing was changed; pass the checkpoint folder that holds the optimizer/scheduler "
            "state (`ckpt inspect` shows what it holds)",
        )
    return m.root, files, m.scheduler_steps_per_update


def _groups(f: _File, index: int | None = None) -> Iterator[tuple[tuple, list[tuple[Any, dict]], int]]:
    """(path to param_groups, [(key, group dict)], optimizer index) for each optimizer state in `f`;
    flattened state (torchtitan) has one group per parameter, keyed by FQN."""
    for path, osd, idx in f.found.optimizers:
        if index is not None and idx != index:
            continue
        groups = osd.get("param_groups")
        items = list(groups.items()) if isinstance(groups, dict) else list(enumerate(groups))
        yield path + ("param_groups",), [(k, g) for k, g in items if isinstance(g, dict)], idx


def check_steps_shared(files: list[_File]) -> None:
    """A storage whose bytes we replace must belong to the step tensors alone."""
    for f in files:
        if not f.storage_bytes:
            continue
        steps = {id(_dig(f.obj, path)) for path, _ in f.checks if path[-1] in ("step", "common_step")}
        for ref in _tensors(f.obj):
            if ref.storage is not None and ref.storage.key in f.storage_bytes and id(ref) not in steps:
                raise UnsupportedCheckpoint(
                    f"storage {ref.storage.key} holds a step counter AND another tensor",
                    path=f.path,
                    hint="cannot set one without the other",
                )


def _tensors(obj: Any, depth: int = 0) -> Iterator[TensorRef]:
    if depth > 64:
        return
    if isinstance(obj, TensorRef):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif isinstance(obj, pickle_reader.Opaque):
        for attr in ("state", "args", "items", "list"):
            if attr in obj.__dict__:
                yield from _tensors(obj.__dict__[attr], depth + 1)


def _in_place(f: _File, target: Path) -> io.InPlace:
    """The in-place form of a torch zip file's edit: each replaced storage's bytes overwritten (CRC-32 updated
    from them alone) and, when a pickled field changed, a new data.pkl member (the edited tree, re-pickled by
    `pickle_writer`) appended with a new central directory (zip_patch.plan_in_place). The same checks as the
    whole-file rewrite: the tree refers only to storages this file holds, new step bytes replace a storage of
    the same size."""
    with zipfile.ZipFile(target) as zf:
        infos = zf.infolist()
    pkl = [i.filename for i in infos if i.filename.endswith("data.pkl") and i.filename.count("/") <= 1]
    if not pkl:
        raise UnsupportedCheckpoint("zip archive without data.pkl (not written by torch.save)", path=target)
    prefix = min(pkl, key=len)[: -len("data.pkl")]
    sizes = {i.filename[len(prefix) + 5 :]: i.file_size for i in infos if i.filename.startswith(prefix + "data/")}
    pickle_bytes = None
    if f.pickle_changed:
        pickle_bytes, storages = _pickle_tree(f.obj, str(target))
        for key, st in storages.items():
            if sizes.get(key, -1) < st.nbytes:
                raise UnsupportedCheckpoint(
                    f"the new tree refers to storage {key} ({st.nbytes} bytes), which {target.name} does not hold",
                    path=target,
                    hint="tensors can only be kept, not added or moved between files",
                )
    for key, data in f.storage_bytes.items():
        if sizes.get(key) != len(data):
            raise UnsupportedCheckpoint(
                f"new bytes for storage {key} ({len(data)} bytes) do not replace a storage of the same size",
                path=target,
                hint="only the values of existing storages can be replaced",
            )
    patches = [Patch(f"{prefix}data/{key}", 0, bytes(data)) for key, data in f.storage_bytes.items()]
    return plan_in_place(target, patches, pickle_bytes)


# --- the writes and their read-back ---------------------------------------------------------------------


def file_writes(files: list[_File]) -> list[io.FileWrite]:
    """One FileWrite per changed file (a DCP folder: one per `.distcp` file it appends to, and its `.metadata`)."""
    writes = []
    for f in files:
        if not f.changes:
            continue
        if isinstance(f, _DcpFile):
            writes += f.writes()
            continue
        writes.append(_file_write(f))
    return writes


def _file_write(f: _File) -> io.FileWrite:
    """A JSON file rewritten; a torch zip file edited in place (`_in_place`), else rewritten whole."""
    method = "pickle rewrite (tensor bytes copied as they are)"
    if f.storage_bytes:
        method += f"; {_n(len(f.storage_bytes), 'step storage')} rewritten"
    if isinstance(f, _JsonFile):
        method, produce, edit = "JSON rewritten (indent 2, sorted keys)", f.produce, None
    else:

        def produce(tmp: Path, f: _File = f) -> None:
            rewrite_torch_zip(f.path, tmp, f.obj, storage_bytes=f.storage_bytes)

        def edit(target: Path, f: _File = f) -> io.InPlace:
            return _in_place(f, target)

        method = (
            "in place: "
            + ("new data.pkl member appended" if f.pickle_changed else "pickle untouched")
            + (f"; {_n(len(f.storage_bytes), 'step storage')} overwritten, CRC-32 updated" if f.storage_bytes else "")
            + " (else "
            + method
            + ")"
        )
    return io.FileWrite(f.rel, tuple(f.changes), f.path.stat().st_size, produce, method, edit)


def read_back_check(ck_path: Path, files: list[_File]) -> Callable[[Path], list[str]]:
    """The plan's verify: every changed field read back from the written files (as planned now), and the
    checkpoint at `ck_path` opened again."""
    checks = {f.rel: (f, list(f.checks)) for f in files if f.changes and not isinstance(f, _DcpFile)}
    dcp_checks = [f.verify for f in files if f.changes and isinstance(f, _DcpFile)]

    def verify(written_root: Path) -> list[str]:
        problems = [p for check in dcp_checks for p in check(Path(written_root))]
        for rel, (f, items) in checks.items():
            where = Path(written_root) / rel
            obj = f.read_back(where) if isinstance(f, _JsonFile) else pickle_reader.load(where).obj
            for path, want in items:
                try:
                    got = _dig(obj, path)
                except (KeyError, IndexError, TypeError):
                    problems.append(f"{rel}: {_dotted(path)} is missing after the write")
                    continue
                problem = _readback_problem(f"{rel}: {_dotted(path)}", got, want)
                if problem:
                    problems.append(problem)
        try:
            open_checkpoint(ck_path)
        except CkptError as e:
            problems.append(f"the checkpoint no longer opens: {e}")
        return problems

    return verify
