"""The package imports downward only: every import of every module (read with `ast`, nothing executed) is
checked against the table in docs/architecture.md, and no import cycle exists among the modules.

Every `import` counts: at the top, inside functions, and under `if TYPE_CHECKING:` (a cycle through a type
annotation is still two modules that each need the other)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "server" / "llmserve"
DOC = ROOT / "docs" / "architecture.md"


def allowed_table() -> dict[str, set[str] | None]:
    """package -> the packages it may import (None: any), from the doc's table of the layers."""
    text = DOC.read_text()
    table = text[text.index("<!-- layers -->") : text.index("<!-- /layers -->")]
    out: dict[str, set[str] | None] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        names = re.findall(r"`([a-z_]+)`", cells[0])
        may = cells[2]
        targets = None if may == "anything" else set(re.findall(r"`([a-z_]+)`", may))
        for n in names:
            out[n] = targets
    return out


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ours that `name` imports (a `from X import y` names X.y where that is a module)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            if t.split(".")[0] != "llmserve":
                continue
            while t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t != name:
                found.add(t)
    return found


def layer_of(module: str) -> str:
    """The table's name for a module: its top package, or "llmserve" for the package's own __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "llmserve"


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_table_covers_every_package():
    table = allowed_table()
    layers = {layer_of(m) for m in modules()}
    assert layers - set(table) == set(), "packages missing from docs/architecture.md's table"
    assert set(table) - layers == set(), "the table names packages that do not exist"


def test_imports_follow_the_table():
    table = allowed_table()
    wrong = []
    for src, targets in sorted(graph().items()):
        may = table[layer_of(src)]
        for dst in sorted(targets):
            a, b = layer_of(src), layer_of(dst)
            if a != b and may is not None and b not in may:
                wrong.append(f"{src} -> {dst} ({a} may import only {sorted(may)})")
    assert not wrong, "imports against docs/architecture.md's table:\n" + "\n".join(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles among modules:\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize(
    "edges,expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(edges, expected):
    """The checker itself finds a cycle where there is one (it could not fail otherwise)."""
    assert cycles(edges) == expected


def test_checker_sees_a_wrong_import(tmp_path):
    """An upward import written into a module is found (relative and absolute, in a function too)."""
    known = {"llmserve.engine.x": tmp_path / "x.py", "llmserve.serving.y": tmp_path / "y.py"}
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from llmserve.serving import y\n")
    assert imports_of("llmserve.engine.x", src, known) == {"llmserve.serving.y"}
    src.write_text("from ..serving.y import thing\n")
    assert imports_of("llmserve.engine.x", src, known) == {"llmserve.serving.y"}
    table = allowed_table()
    assert "serving" not in table["engine"]
