"""What a framework's full unpickler would run: every pickle global outside the allowlist and every zip member
torch.save does not write, over EVERY file of a checkpoint folder.

Opening a checkpoint parses only what it shows (one ZeRO-3 model-states file of many, no DCP chunk), but a
framework's resume unpickles them all, and a writer that carries a file's pickle or zip members into its output
hands them on. So the resume planners, every writer's source check and every writer's check of its own output
call `scan` here: each torch.save zip (its members by name, its `data.pkl` parsed inert by `pickle_reader`), each
legacy torch file and plain pickle, each item of a `.distcp` file (placed by the folder's `.metadata`), the pickles
stored as bytes inside those items (torchtitan's data-loader state), and any other file a `torch.load` would try
as a pickle. `allowlist` judges every global; `pickle_reader` flags every getattr or call beyond them.
"""

from __future__ import annotations

import os
import pickletools
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from . import allowlist, pickle_reader
from ..errors import CkptError, UnsupportedCheckpoint

#: the members torch.save writes under its archive folder (`<name>/...`): anything else is foreign
_MEMBER_RE = re.compile(
    r"^[^/\\]+/(data\.pkl|byteorder|version|\.data/version|\.data/serialization_id|"
    r"\.format_version|\.storage_alignment|data/\d+)$"
)
#: file names a framework may hand to torch.load / pickle.load even when they do not look like a pickle
_LOADABLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt", ".distcp", ".metadata", ".pickle")


@dataclass(frozen=True)
class Finding:
    """One thing a full unpickler would run, or a member torch.save never writes, in `file` (relative to the
    scanned folder), with where in the file's object tree it sits when that is known."""

    file: str
    what: str  # a global as `module.name`, a flagged call, or "zip member '<name>'"
    place: str | None = None

    def line(self) -> str:
        return f"{self.file}: {self.what}" + (f" (at {self.place})" if self.place else "")


def foreign_members(names: Iterable[str]) -> list[str]:
    """Members of a torch.save zip that torch.save does not write (a path-traversal name among them)."""
    return [n for n in names if not _MEMBER_RE.match(n) or ".." in n.split("/")]


def _places(obj: Any, names: set[str], limit: int = 200_000) -> dict[str, str]:
    """Where in `obj` each unknown global first occurs (`args.lr_scheduler`, `optimizer.param_groups.0.fn`):
    an iterative walk, bounded in nodes (the structure's depth was bounded when it was parsed)."""
    found: dict[str, str] = {}
    by_cls = {n.replace(":", "."): n for n in names}  # a placeholder's cls joins a dotted name's parts with "."
    stack: list[tuple[Any, str]] = [(obj, "")]
    seen = 0
    while stack and len(found) < len(names) and seen < limit:
        node, at = stack.pop()
        seen += 1
        key = by_cls.get(getattr(node, "cls", None)) if isinstance(getattr(node, "cls", None), str) else None
        if key is not None and key not in found:
            found[key] = at or "(top)"
        if isinstance(node, dict):
            stack.extend((v, f"{at}.{k}" if at else str(k)) for k, v in node.items())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, f"{at}.{i}" if at else str(i)) for i, v in enumerate(node))
        elif isinstance(node, pickle_reader.Opaque):
            for part in ("args", "state", "items", "list"):
                sub = node.__dict__.get(part)
                if sub is not None:
                    stack.append((sub, at))
    return found


def _from_loaded(rel: str, loaded: pickle_reader.Loaded) -> list[Finding]:
    unknown = loaded.unknown_globals
    if not unknown:
        return []
    where = _places(loaded.obj, set(unknown))
    return [Finding(rel, g, where.get(g)) for g in unknown]


def _inner_pickles(rel: str, obj: Any, depth: int = 0) -> list[Finding]:
    """Pickles stored as bytes inside a value (torchtitan's data-loader state): the framework unpickles them."""
    out: list[Finding] = []
    if isinstance(obj, (bytes, bytearray)) and obj[:1] == b"\x80":
        try:
            inner = pickle_reader.loads(bytes(obj), rel)
        except CkptError:
            return [Finding(rel, "an inner pickle that does not parse")]
        out += [
            Finding(rel, f.what, f"inner pickle{' at ' + f.place if f.place else ''}") for f in _from_loaded(rel, inner)
        ]
    elif isinstance(obj, dict) and depth < 8:
        for v in obj.values():
            out += _inner_pickles(rel, v, depth + 1)
    elif isinstance(obj, (list, tuple)) and depth < 8:
        for v in obj:
            out += _inner_pickles(rel, v, depth + 1)
    return out


def _scan_zip(path: Path, rel: str) -> list[Finding]:
    loaded = pickle_reader.load(path)  # one parse: its zip source keeps the member names
    names = loaded.source.member_names() if isinstance(loaded.source, pickle_reader.ZipSource) else []
    try:
        return (
            [Finding(rel, f"zip member {name!r}") for name in foreign_members(names)]
            + _from_loaded(rel, loaded)
            + _inner_pickles(rel, loaded.obj)
        )
    finally:
        if loaded.source is not None:
            loaded.source.close()


def _distcp_items(folder: Path) -> dict[str, list[tuple[int, int]]]:
    """file name -> (offset, length) of each item the folder's `.metadata` places in it."""
    meta = folder / ".metadata"
    if not meta.is_file():
        return {}
    md = pickle_reader.load(meta).obj
    storage = md.field("storage_data") if isinstance(md, pickle_reader.Opaque) else None
    out: dict[str, list[tuple[int, int]]] = {}
    for info in (storage or {}).values():
        if isinstance(info, pickle_reader.Opaque):
            rel, off, n = info.field("relative_path"), info.field("offset"), info.field("length")
            if isinstance(rel, str) and isinstance(off, int) and isinstance(n, int):
                out.setdefault(rel, []).append((off, n))
    return out


def _scan_distcp(path: Path, rel: str, items: list[tuple[int, int]]) -> list[Finding]:
    out: list[Finding] = []
    outer = pickle_reader.Source(path)
    try:
        for off, n in sorted(set(items)):
            loaded = pickle_reader.load_embedded(outer, off, n)
            out += _from_loaded(rel, loaded) + _inner_pickles(rel, loaded.obj)
            out += [
                Finding(rel, f"zip member {m!r} (item at byte {off})")
                for m in foreign_members(pickle_reader.embedded_names(outer, off, n))
            ]
    finally:
        outer.close()
    return out


def _scan_other(path: Path, rel: str) -> list[Finding]:
    """A file that is neither a zip nor a protocol-2+ pickle but that a loader may still unpickle (a protocol-0
    pickle runs its globals before torch.load's magic-number check fails), or whose pickle does not parse (a
    full unpickler runs what comes before the break): the globals its opcodes name. A zip: its data.pkl."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zf:
                pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
                head = zf.read(min(pkl, key=len))[: 1 << 20] if pkl else b""
        else:
            with open(path, "rb") as fh:
                head = fh.read(1 << 20)
    except (OSError, zipfile.BadZipFile, ValueError, NotImplementedError, EOFError):
        return []
    try:  # a protocol-0 hash bomb or deep structure crashes a full unpickler before its parse error
        pickle_reader.check_expansion(head, str(path))
    except CkptError as e:
        if "cannot parse" not in e.message:
            return [Finding(rel, f"a pickle the reader refuses ({e.message})")]
    found: list[str] = []
    try:
        for op, arg, _ in pickletools.genops(head):
            if op.name in ("GLOBAL", "INST"):
                module, _, name = str(arg).partition(" ")
                if not allowlist.is_allowed(module, name):
                    found.append(allowlist.dotted(module, name))
            if op.name == "STOP":
                break
    except Exception:  # noqa: BLE001  not a pickle past this point: what it named before is what would run
        pass
    return [Finding(rel, g) for g in dict.fromkeys(found)]


def scan_file(path: Path, rel: str, distcp: dict[str, list[tuple[int, int]]] | None = None) -> list[Finding]:
    """Findings for one file (see the module docstring); `distcp`: its folder's `.distcp` items."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(9)
    except OSError:
        return []
    if path.suffix == ".safetensors" or head[8:9] == b"{":  # safetensors: a length, then a JSON header
        return []
    if path.suffix == ".distcp" and distcp is not None and path.name in distcp:
        return _scan_distcp(path, rel, distcp[path.name])
    if head[:2] == b"PK":
        try:
            return _scan_zip(path, rel)
        except CkptError as e:  # not readable as torch.save writes it: the globals its opcodes name, at least
            if "cannot parse" not in e.message and "not a readable zip" not in e.message:
                raise
            return _scan_other(path, rel)
    if head[:1] == b"\x80":
        try:
            loaded = pickle_reader.load(path)
        except CkptError as e:  # a stream that does not parse: a full unpickler still runs what comes before
            if "cannot parse" not in e.message:
                raise
            return _scan_other(path, rel)
        try:
            return _from_loaded(rel, loaded) + _inner_pickles(rel, loaded.obj)
        finally:
            if loaded.source is not None:
                loaded.source.close()
    if path.suffix in _LOADABLE_SUFFIXES or path.name == ".metadata":
        return _scan_other(path, rel)
    return []


def scan(root: Path, files: Iterable[str] | None = None) -> list[Finding]:
    """Findings over `files` (relative to `root`; default: every file under it, or `root` itself if a file)."""
    root = Path(root)
    if root.is_file():
        return scan_file(root, root.name)
    if files is None:
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    items: dict[Path, dict[str, list[tuple[int, int]]]] = {}
    out: list[Finding] = []
    for rel in files:
        p = root / rel
        if not p.is_file():
            continue
        distcp = None
        if p.suffix == ".distcp":
            if p.parent not in items:
                items[p.parent] = _distcp_items(p.parent)
            distcp = items[p.parent]
        out += scan_file(p, rel, distcp)
    return out


def scan_checkpoint(ck: Any) -> list[Finding]:
    """Findings over every file the opened checkpoint `ck` accounts for."""
    base = Path(ck.path)
    if base.is_file():
        return scan_file(base, base.name)
    return scan(base, [f.path for f in ck.files])


def by_file(findings: Iterable[Finding]) -> dict[str, list[str]]:
    """file -> what was found in it, in order."""
    out: dict[str, list[str]] = {}
    for f in findings:
        out.setdefault(f.file, [])
        if f.what not in out[f.file]:
            out[f.file].append(f.what)
    return out


def refuse(findings: list[Finding], path: str | os.PathLike, *, action: str, flag: str = "--trust-pickles") -> None:
    """Raise one line naming the first finding (file, place, global) and how many more, if there are any.
    `action` says what would run them ("resuming runs DeepSpeed's torch.load, which would execute it")."""
    if not findings:
        return
    first = findings[0]
    here = [f for f in findings if f.file == first.file]
    shown = "; ".join((f.what + (f" (at {f.place})" if f.place else "")) for f in here[:3])
    rest = len(findings) - min(3, len(here))
    files = {f.file for f in findings}
    more = f" ({rest} more in {len(files)} file{'s' if len(files) > 1 else ''})" if rest else ""
    raise UnsupportedCheckpoint(
        f"{first.file}: {shown}: not a class real checkpoints carry; {action}{more}",
        path=path,
        hint=f"inspect it with `ckpt inspect`; pass {flag} only if you trust where it came from",
    )


def carried_warning(findings: list[Finding]) -> str:
    """The warning a trusted write prints: what it carried into its output."""
    names = sorted({f.what for f in findings})
    return (
        f"warning untrusted-pickle: carried under --trust-pickles: {', '.join(names[:6])}"
        f"{' …' if len(names) > 6 else ''} (in {', '.join(sorted({f.file for f in findings})[:3])})"
    )


def check_source(ck: Any, path: str | os.PathLike, *, trust_pickles: bool, command: str) -> list[str]:
    """A writer's source check: refuse (exit 2, naming file, place and global) a checkpoint whose files hold a
    global outside the allowlist or a foreign zip member — whatever `command` writes from it would carry it to
    the framework that loads the output — unless `trust_pickles`; then the warning line its plan shows."""
    findings = scan_checkpoint(ck)
    if not findings:
        return []
    if not trust_pickles:
        refuse(
            findings,
            path,
            action=f"`ckpt {command}` would carry it into what it writes, where the framework's loader would run it",
        )
    return [carried_warning(findings)]


def check_output(root: Path, files: Iterable[str] | None = None, *, trust_pickles: bool) -> None:
    """A writer's check of its own output, before it is put in place: no global outside the allowlist, no zip
    member torch.save does not write (the source check passed, so a finding here is ckpt's own fault: refused
    all the same). Under `--trust-pickles` the carried globals are allowed."""
    if trust_pickles:
        return
    findings = scan(root, files)
    if findings:
        refuse(
            findings,
            root,
            action="the output would carry it; nothing was put in place",
            flag="--trust-pickles (to carry what the source holds)",
        )
