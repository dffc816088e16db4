"""hybridmem's top-level units (``hybridmem.X``, a package or a module) import each other one way only.

Read from the source with ``ast``: every ``import`` counts, at module level, inside functions (lazy
imports) and under ``TYPE_CHECKING``, since a lazy import that closes a loop is still a loop in the
design. ``graphlib`` finds any cycle.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import hybridmem

ROOT = Path(hybridmem.__file__).parent


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and parts[0] == "hybridmem" else None


def _imports(path: Path) -> set[str]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = parts if is_package else parts[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            found.add(base)
    return found


def unit_graph() -> dict[str, set[str]]:
    """``{unit: units it imports}`` over every file of the package."""
    graph: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        unit = _unit(".".join(p for p in parts if p != "__init__"))
        if unit is None:
            continue
        deps = graph.setdefault(unit, set())
        deps.update(u for u in map(_unit, _imports(path)) if u is not None and u != unit)
    return graph


def test_units_import_one_way():
    graph = unit_graph()
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        raise AssertionError(f"import cycle between hybridmem units: {' -> '.join(exc.args[1])}") from None


def test_named_layers():
    graph = unit_graph()
    assert "hybridmem.weight_sync" not in graph["hybridmem.reshard"]
    assert "hybridmem.reshard" in graph["hybridmem.weight_sync"]
    assert "hybridmem.sync" not in graph  # one weight_sync package
    assert "hybridmem.engines" not in graph["hybridmem.kv"]
    assert "hybridmem.kv" in graph["hybridmem.engines"]
