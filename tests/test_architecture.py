"""The package layout ARCHITECTURE.md describes, held by the code itself: every import of `ckpt_tools` (at module
level and inside functions, read with `ast`) goes to its own package or one below it, no module imports itself
back through others, the root holds only the public API and the errors, and the wheel lists every package (the
command line installs as `ckpt_cli`, not as a top-level `cli` another distribution could also install)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from conftest import ROOT

PKG = ROOT / "ckpt_tools"
#: bottom to top: a module may import its own package and those on earlier rows, never a later row
LAYERS = [
    ("errors", "schedules"),
    ("read",),
    ("formats",),
    ("view",),
    ("write",),
    ("train",),
    ("ops",),
    ("samples",),
    ("resume",),
    ("",),
]
LEVEL = {pkg: i for i, row in enumerate(LAYERS) for pkg in row}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """{module: the ckpt_tools modules it imports} (`from pkg import mod` counts as importing mod)."""
    edges: dict[str, set[str]] = {}
    for mod, path in mods.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        out = edges[mod] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                src = node.module or ""
                if node.level:
                    src = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{src}.{alias.name}"
                    if target in mods:
                        out.add(target)
                    elif src in mods:
                        out.add(src)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in mods)
    return edges


def _layer(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_import_goes_to_its_own_package_or_below():
    mods = _modules()
    assert {_layer(m) for m in mods} <= set(LEVEL), (
        f"packages not in LAYERS: {sorted({_layer(m) for m in mods} - set(LEVEL))}"
    )
    upward = [
        f"{m} -> {t}"
        for m, targets in _imports(mods).items()
        for t in sorted(targets)
        if LEVEL[_layer(t)] > LEVEL[_layer(m)]
    ]
    assert upward == []
    assert len(mods) > 90 and len(LAYERS) == 10  # the scan saw the package (not an empty glob)


def test_no_import_circle():
    edges = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert circles == []
    assert sum(map(len, edges.values())) > 300  # the scan found the imports


def test_the_root_holds_only_the_api_and_the_errors():
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert loose == ["__init__.py", "errors.py"]
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    assert packages == sorted(pkg for row in LAYERS for pkg in row if pkg not in ("", "errors"))


def test_the_wheel_lists_every_package_and_installs_the_cli_as_ckpt_cli():
    text = (ROOT / "pyproject.toml").read_text()
    listed = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M).group(1)
    listed = sorted(re.findall(r'"([^"]+)"', listed))
    on_disk = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in PKG.rglob("__init__.py"))
    assert listed == sorted(on_disk + ["ckpt_cli"])
    assert re.search(r'^package-dir = \{ "ckpt_cli" = "cli" \}', text, re.M)
    assert re.search(r'^ckpt = "ckpt_cli\.main:main"', text, re.M)
    # the CLI imports itself relatively: under the name it is installed as, `import cli` would not resolve
    for path in (ROOT / "cli").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert node.module.split(".")[0] != "cli", f"{path.name}: from {node.module} import ..."
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "cli" for a in node.names), path.name
