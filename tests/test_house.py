"""The house rules the code keeps (STYLE.md): no module of rlalign over 600 lines, the trainers at
most 400, and no import circle between rlalign's modules (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlalign"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The rlalign modules ``path`` imports, anywhere in the file (``from a.b import c`` counts a.b.c when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlalign"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("rlalign"))
    return found


def test_no_module_is_over_600_lines_and_the_trainers_stay_under_400():
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert not {m: n for m, n in sizes.items() if n > 600}
    assert sizes["rlalign.train.grpo"] <= 400 and sizes["rlalign.train.ppo"] <= 400 and sizes["rlalign.train.distill"] <= 400


def test_no_import_circle():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: {d for d in imports(p) if d in modules and d != m and not m.startswith(d + ".")} for m, p in modules.items()}
    graph = {m: {d for d in deps if not (modules[d].name == "__init__.py")} for m, deps in graph.items()}  # a package's __init__ is no circle
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for d in sorted(graph[m]):
            visit(d, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
