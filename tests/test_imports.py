"""The application's modules import one another without a circle: every module, script and
benchmark, imports inside functions included, so a module can be read knowing only those below it.

Run alone: ``python -m pytest tests/test_imports.py``; on a failure it prints the circle."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("scripts", "benchmarks", "source_readers")


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts)


def project_imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports anywhere in its body (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from scripts import evaluate` imports the module scripts.evaluate.
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found


def import_graph() -> dict[str, set[str]]:
    files = [*REPO.glob("*.py"), *(p for d in PACKAGES for p in (REPO / d).glob("*.py"))]
    files = [p for p in files if p.name != "__init__.py"]
    known = {module_name(p) for p in files}
    return {module_name(p): project_imports(p, known) - {module_name(p)} for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None. Depth-first search with colours."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_circle_through_three_modules():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_inside_functions():
    assert "checkpoints" in import_graph()["train"]


def test_no_module_imports_one_that_imports_it_back():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
