"""An opcode walk independent of ckpt's reader: the globals a pickle names (GLOBAL, INST, STACK_GLOBAL resolved
through a simulated stack and memo), and the torch.save zips inside a file, for checking what ckpt wrote."""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

_MARK = object()


def pickle_globals(data: bytes) -> list[tuple[str, str]]:
    """(module, name) of every global the pickle stream names; a STACK_GLOBAL of non-strings gives ('?', '?')."""
    stack: list = []
    memo: dict = {}
    out: list[tuple[str, str]] = []
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            out.append((module, attr))
        if name == "STACK_GLOBAL":
            attr, module = (stack.pop() if stack else None), (stack.pop() if stack else None)
            out.append((module, attr) if isinstance(module, str) and isinstance(attr, str) else ("?", "?"))
            stack.append(None)
            continue
        if name in (
            "SHORT_BINUNICODE",
            "BINUNICODE",
            "BINUNICODE8",
            "UNICODE",
            "STRING",
            "BINSTRING",
            "SHORT_BINSTRING",
        ):
            stack.append(arg if isinstance(arg, str) else None)
            continue
        if name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg))
            continue
        if name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1] if stack else None
            continue
        if name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
            continue
        if name == "MARK":
            stack.append(_MARK)
            continue
        if name == "DUP":
            stack.append(stack[-1] if stack else None)
            continue
        if name == "STOP":
            break
        if pickletools.markobject in op.stack_before:
            while stack and stack.pop() is not _MARK:
                pass
            for _ in range(op.stack_before.index(pickletools.markobject)):
                if stack:
                    stack.pop()
        else:
            for _ in op.stack_before:
                if stack:
                    stack.pop()
        stack.extend([None] * len(op.stack_after))
    return out


def zip_pickles(path: Path) -> list[tuple[list[str], bytes]]:
    """(member names, data.pkl bytes) of every torch.save zip in `path`: itself, or each one concatenated in a
    DCP `.distcp` file (found by its end-of-central-directory records)."""
    raw = path.read_bytes()
    out = []
    end = len(raw)
    while end > 0:
        eocd = raw.rfind(b"PK\x05\x06", 0, end)
        if eocd < 0:
            break
        cd_size = int.from_bytes(raw[eocd + 12 : eocd + 16], "little")
        cd_off = int.from_bytes(raw[eocd + 16 : eocd + 20], "little")
        if raw[eocd - 20 : eocd - 16] == b"PK\x06\x07":  # zip64: its end record sits before the locator
            loc = raw.rfind(b"PK\x06\x06", 0, eocd - 20)
            cd_size = int.from_bytes(raw[loc + 40 : loc + 48], "little")
            cd_off = int.from_bytes(raw[loc + 48 : loc + 56], "little")
            cd_start = loc - cd_size
        else:
            cd_start = eocd - cd_size
        start = cd_start - cd_off
        import io

        try:
            with zipfile.ZipFile(io.BytesIO(raw[start : eocd + 22])) as zf:
                names = zf.namelist()
                pkl = [n for n in names if n.endswith("data.pkl")]
                out.append((names, zf.read(pkl[-1]) if pkl else b""))
        except (zipfile.BadZipFile, ValueError):
            pass
        end = max(start, 0) if start < eocd else 0
        if start <= 0:
            break
    return out


def file_globals(path: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(globals named, member names) over every pickle in the file `path`."""
    head = path.read_bytes()[:4]
    if head[:2] == b"PK":
        gl, names = [], []
        for members, pkl in zip_pickles(path):
            names += members
            if pkl:
                gl += pickle_globals(pkl)
        return gl, names
    if head[:1] == b"\x80":
        data = path.read_bytes()
        gl = []
        pos = 0
        for _ in range(5):  # a legacy torch file: several pickles, then raw bytes
            try:
                for op, _, p in pickletools.genops(data[pos:]):
                    if op.name == "STOP":
                        gl += pickle_globals(data[pos : pos + p + 1])
                        pos += p + 1
                        break
            except Exception:  # noqa: BLE001  raw tensor bytes follow
                break
        return gl, []
    return [], []
