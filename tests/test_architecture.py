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


def _functions(path: Path):
    """(qualified name, first line, last line) of every function in `path`, nested ones too."""
    tree = ast.parse(path.read_text())
    out = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((f"{prefix}{child.name}", child.lineno, child.end_lineno))
                walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return out


def test_functions_read_in_one_screen_and_modules_stay_under_a_thousand_lines():
    long_functions, long_modules = [], []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        lines = path.read_text().count("\n")
        if lines > 1000:
            long_modules.append(f"{rel}: {lines}")
        long_functions += [
            f"{rel}:{name} {end - start + 1}" for name, start, end in _functions(path) if end - start >= 80
        ]
    assert long_functions == []
    assert long_modules == []


def _says_why(lines: list[str], i: int) -> bool:
    """Line i (0-based) carries a `# lazy:` comment, or sits in a block of imports the line above opens with one."""
    if "# lazy:" in lines[i]:
        return True
    while i > 0 and lines[i - 1].strip().startswith(("import ", "from ")):
        i -= 1
    return i > 0 and lines[i - 1].strip().startswith("# lazy:")


def test_imports_sit_at_the_top_unless_a_comment_says_why_not():
    """An import inside a function is either a torch (or other optional, heavy) dependency kept out of the
    torch-free core, with a `# lazy:` comment on its line or the line above saying so, or it moves to the top."""
    unexplained = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    if not _says_why(lines, sub.lineno - 1):
                        unexplained.append(f"{rel}:{sub.lineno}: {lines[sub.lineno - 1].strip()}")
    assert unexplained == []


def test_operations_hold_no_branch_per_format():
    """ops/ work on the tree, the state map and the logical view: a format's particulars come from its module (a
    hook or a fact it puts on the tree), never from an `if ck.format == ...` in an operation, nor from the name of
    the module that read it (`detect(path).__name__`)."""
    branches = []
    pattern = re.compile(
        r"\.format\s*(==|!=)\s*[\"']|\.format\s+(not\s+)?in\b|\.format\.startswith|(?<![)\w])\w*\.__name__"
    )
    for path in sorted((PKG / "ops").glob("*.py")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#")[0]):
                branches.append(f"ops/{path.name}:{i}: {line.strip()}")
    assert branches == []
