"""hybridmem's folders are its layers, and a lower layer never imports a higher one.

:data:`LAYERS` is the one list of the layers (docs/architecture.md shows the same list, checked below).
A unit is a package ``hybridmem.<name>`` or a module directly in ``hybridmem/``; a unit may import the units
of lower layers only. Read from the source with ``ast``: every ``import`` counts, at module level and inside
functions (lazy imports), except those under ``if TYPE_CHECKING:``, which carry annotations only (the
training contract names the offloader type its side builds, a layer up).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridmem

ROOT = Path(hybridmem.__file__).parent
DOCS = ROOT.parent / "docs" / "architecture.md"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("accel", "models", "config"),
    ("contract",),
    ("offload", "kv", "reshard"),
    ("weight_sync",),
    ("switch",),
    ("adapters", "engines", "planner"),
    ("parts",),
    ("manager",),
    ("hybridmem",),
    ("integrations", "testing"),
    ("examples",),
    ("cli",),
    ("__main__",),
)
"""Lowest first. ``parts``, ``manager`` and ``hybridmem`` (the package's ``__init__``) are the facade."""

TOP_LEVEL_MODULES = {"__init__", "__main__", "cli", "errors", "manager", "parts"}
"""The only modules directly in ``hybridmem/``: the facade, the CLI, the errors and the package files."""


def _layer_of() -> dict[str, int]:
    return {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "hybridmem":
        return None
    return parts[1] if len(parts) > 1 else "hybridmem"


def _module_parts(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports_of(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """``(module, line)`` of every runtime import in ``path`` (relative imports resolved), read from
    ``source`` where given (a module that would lie at ``path``), else from the file."""
    parts = _module_parts(path)
    package = parts if path.name == "__init__.py" else parts[:-1]
    tree = ast.parse(path.read_text() if source is None else source)
    typing_only = _type_checking_lines(tree)
    found = []
    for node in ast.walk(tree):
        if node.lineno in typing_only if hasattr(node, "lineno") else False:
            continue
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, node.lineno))
            if base == "hybridmem":  # ``from hybridmem import errors`` imports the unit ``errors``
                found.extend((f"hybridmem.{alias.name}", node.lineno) for alias in node.names
                             if (ROOT / alias.name).is_dir() or (ROOT / f"{alias.name}.py").is_file())
    return found


def back_doors(extra: dict[Path, str] | None = None) -> list[str]:
    """Every runtime import of a unit in the same or a higher layer, as ``file:line: unit -> unit``, in the
    package's files and in ``extra`` (modules as they would lie at a path of the package, by their source:
    the package's tree is shared by tests running at once, so nothing is written into it)."""
    layer = _layer_of()
    extra = extra or {}
    found = []
    sources = {path: None for path in ROOT.rglob("*.py")} | dict(extra)
    for path in sorted(sources):
        unit = _unit(".".join(_module_parts(path)))
        for module, line in imports_of(path, sources[path]):
            target = _unit(module)
            if target is None or target == unit:
                continue
            if layer[target] >= layer[unit]:
                found.append(f"{path.relative_to(ROOT.parent)}:{line}: {unit} (layer {layer[unit]}) imports "
                             f"{target} (layer {layer[target]})")
    return found


def test_every_unit_has_a_layer():
    units = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    units |= {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    units.add("hybridmem")
    assert units == set(_layer_of()), f"units without a layer: {sorted(units - set(_layer_of()))}"


def test_only_the_facade_lies_loose():
    loose = {p.stem for p in ROOT.glob("*.py")}
    assert loose == TOP_LEVEL_MODULES, f"modules directly in hybridmem/: {sorted(loose - TOP_LEVEL_MODULES)}"
    assert len(loose) <= 8


def test_no_layer_imports_a_higher_one():
    doors = back_doors()
    assert not doors, "imports against the layers:\n" + "\n".join(doors)


def test_a_back_door_is_found():
    # The check itself: the core importing an adapter, as hybridmem.parts once did from the switch core.
    probe = ROOT / "switch" / "_probe_back_door.py"
    doors = back_doors({probe: "from hybridmem.adapters.torch import TorchTrainingState\n"})
    assert not probe.exists()
    assert any("switch (layer 5) imports adapters (layer 6)" in d for d in doors), doors


def test_type_checking_imports_are_not_counted(tmp_path):
    path = ROOT / "contract" / "training.py"
    assert "hybridmem.offload" not in {m for m, _ in imports_of(path)}
    assert "hybridmem.offload" in path.read_text()


def test_the_docs_show_these_layers():
    # docs/architecture.md's table under <!-- layers -->: one row per layer, highest first, units in
    # backticks.
    text = DOCS.read_text()
    table = re.search(r"<!-- layers -->\n(.*?)\n\n", text, re.S)
    assert table, "docs/architecture.md has no <!-- layers --> table"
    rows = [r for r in table.group(1).splitlines()[2:] if r.startswith("|")]
    shown = {int(r.split("|")[1]): set(re.findall(r"`([a-z_]+)/?`", r.split("|")[2])) for r in rows}
    assert shown == {i: set(layer) for i, layer in enumerate(LAYERS)}


def test_import_hybridmem_imports_no_framework():
    import subprocess
    import sys

    frameworks = ["vllm", "megatron", "transformers", "ray", "trl"]
    code = ("import sys, hybridmem, hybridmem.engines, hybridmem.adapters.vllm; "
            f"print([m for m in {frameworks!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"
