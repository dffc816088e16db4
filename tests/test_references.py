"""Every file path and every ``hybridmem`` name the prose mentions exists.

The prose is docs/*.md and README.md, and the docstrings and comments of ``hybridmem/``, ``tests/`` and
``benchmarks/*.py``. In it:

- a path written ``hybridmem/<path>.py``, ``tests/<path>.py``, ``benchmarks/<path>.py`` or
  ``docs/<name>.md`` (from the repository root, or ``../`` from a doc) must be a file. Only those suffixes
  make a path: a metric such as ``hybridmem/synced_nbytes`` is none;
- a dotted name ``hybridmem.<module>.<attribute>`` must resolve: its longest prefix that is a module of
  ``hybridmem/`` (a ``.py`` file or a package), then each attribute in the source of that module (what it
  defines or imports at top level; a class's members, fields and ``self.`` attributes), following imports
  into other ``hybridmem`` modules. A name imported from another package, or an attribute of a class with
  a base from another package, is taken as it is.

Read with ``ast`` and ``tokenize`` only, nothing imported, so the check takes no heavy import (vLLM,
megatron-core) and finds a stale name in a module that cannot be imported here.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PATH = re.compile(r"(?<![\w/.-])(?:\.\./)?(?P<path>(?:hybridmem|tests|benchmarks|docs)(?:/[\w.-]+)+)")
_NAME = re.compile(r"(?<![\w/.-])hybridmem(?:\.[A-Za-z_]\w*)+")
_MODULE_ATTRIBUTES = frozenset({"__file__", "__name__", "__path__", "__doc__", "__spec__", "__all__"})
"""What every module has without defining it."""


def prose_files(root: Path = ROOT) -> list[Path]:
    """The files whose prose is checked: docs, README.md, and the Python files of the package, the tests
    and the benchmarks."""
    files = [*sorted((root / "docs").glob("*.md")), root / "README.md",
             *sorted((root / "hybridmem").rglob("*.py")), *sorted((root / "tests").rglob("*.py")),
             *sorted((root / "benchmarks").glob("*.py"))]
    return [f for f in files if f.is_file()]


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """``(first line, text)`` of each piece of prose of ``path``: the whole of a Markdown file; the docstrings
    (a string standing as a statement: module, class, function and attribute docstrings) and the comments
    of a Python file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".md":
        yield 1, text
        return
    lines = text.split("\n")
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            yield node.lineno, "\n".join(lines[node.lineno - 1:node.end_lineno])
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string


class Resolver:
    """Dotted ``hybridmem`` names resolved in the source under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, dict[str, object]] = {}

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def _top_level(self, module: str) -> dict[str, object]:
        if module not in self._trees:
            path = self.module_file(module)
            assert path is not None, module
            self._trees[module] = _top_level(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        return self._trees[module]

    def resolves(self, name: str) -> bool:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            if self.module_file(".".join(parts[:cut])) is not None:
                return self._in_module(".".join(parts[:cut]), parts[cut:], depth=0)
        return False

    def _in_module(self, module: str, attrs: list[str], depth: int) -> bool:
        if not attrs or attrs[0] in _MODULE_ATTRIBUTES:
            return True
        if depth > 8:
            return True  # an import cycle: taken as it is
        first, rest = attrs[0], attrs[1:]
        if self.module_file(f"{module}.{first}") is not None:  # a submodule
            return self._in_module(f"{module}.{first}", rest, depth)
        found = self._top_level(module).get(first)
        if found is None:
            return False
        if isinstance(found, tuple):  # imported: (module, name or None)
            source, imported = found
            if not source.startswith("hybridmem") or self.module_file(source) is None:
                return True  # another package's
            return self._in_module(source, ([imported] if imported else []) + rest, depth + 1)
        if isinstance(found, ast.ClassDef):
            return not rest or self._in_class(module, found, rest, depth)
        return True  # a function or a value: its attributes are not followed

    def _in_class(self, module: str, cls: ast.ClassDef, attrs: list[str], depth: int) -> bool:
        if attrs[0] in _members(cls):
            inner = _members(cls)[attrs[0]]
            if isinstance(inner, ast.ClassDef) and attrs[1:]:
                return self._in_class(module, inner, attrs[1:], depth)
            return True
        for base in cls.bases:  # inherited, from a base this source knows
            name = base.id if isinstance(base, ast.Name) else None
            if name is None:
                return True
            found = self._top_level(module).get(name)
            if isinstance(found, ast.ClassDef):
                if self._in_class(module, found, attrs, depth + 1):
                    return True
            elif isinstance(found, tuple):
                source, imported = found
                if not source.startswith("hybridmem") or self.module_file(source) is None:
                    return True  # a base from another package (Enum, Exception, ...)
                if self._in_module(source, [imported or name, *attrs], depth + 1):
                    return True
            else:
                return True
        return False


def _top_level(tree: ast.Module) -> dict[str, object]:
    """What a module defines at top level (in ``if``/``try`` blocks too): name -> its node, or
    ``(module, name)`` for an import (``name`` ``None`` for a module imported whole)."""
    out: dict[str, object] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            out.setdefault(n.id, node)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    out[alias.asname or alias.name.split(".")[0]] = (
                        alias.name if alias.asname else alias.name.split(".")[0], None)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    out[alias.asname or alias.name] = (node.module or "", alias.name)
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(tree.body)
    return out


def _members(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """A class's methods, nested classes, class attributes and fields, and the ``self.`` attributes its
    methods assign."""
    out: dict[str, ast.AST] = {}
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        out[n.id] = node
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self"):
                    out.setdefault(target.attr, node)
    return out


def stale(root: Path = ROOT) -> list[str]:
    """Each path that is no file and each name that does not resolve, as ``file:line: what``."""
    resolver = Resolver(root)
    found: list[str] = []
    for path in prose_files(root):
        rel = path.relative_to(root)
        for first, text in prose(path):
            for m in _PATH.finditer(text):
                target = m["path"].rstrip(".")
                if target.endswith((".py", ".md")) and not (root / target).is_file():
                    line = first + text.count("\n", 0, m.start())
                    found.append(f"{rel}:{line}: no file {target}")
            for m in _NAME.finditer(text):
                if not resolver.resolves(m.group(0)):
                    line = first + text.count("\n", 0, m.start())
                    found.append(f"{rel}:{line}: {m.group(0)} does not resolve")
    return found


def test_every_path_and_name_in_the_prose_exists() -> None:
    found = stale()
    assert not found, f"{len(found)} stale reference(s):\n" + "\n".join(found)


# The checker itself, on a tree of its own -------------------------------------------------------------

_PACKAGE = {
    "hybridmem/__init__.py": "from hybridmem.kv.base import Pool\nfrom torch import nn\n",
    "hybridmem/kv/__init__.py": "from hybridmem.kv.base import Pool as KVPool\n",
    "hybridmem/kv/base.py": (
        "import enum\nfrom dataclasses import dataclass\n\n\n"
        "class State(enum.Enum):\n    FREE = 1\n\n\n"
        "@dataclass\nclass Pool:\n    nbytes: int = 0\n    LIMIT = 4\n\n"
        "    def view(self):\n        self.views = []\n\n    class Inner:\n        depth = 1\n\n\n"
        "class Sub(Pool):\n    pass\n\n\nif True:\n    FLAG = 1\n"
    ),
    "docs/kv.md": "",
}


@pytest.mark.parametrize("name", [
    "hybridmem.kv", "hybridmem.kv.base", "hybridmem.kv.base.Pool", "hybridmem.kv.base.Pool.nbytes",
    "hybridmem.kv.base.Pool.LIMIT", "hybridmem.kv.base.Pool.view", "hybridmem.kv.base.Pool.views",
    "hybridmem.kv.base.Pool.Inner.depth", "hybridmem.kv.base.Sub.view", "hybridmem.kv.base.State.FREE",
    "hybridmem.kv.base.State.value", "hybridmem.kv.base.FLAG", "hybridmem.kv.KVPool.view",
    "hybridmem.Pool.nbytes", "hybridmem.nn.Linear", "hybridmem.kv.__file__",
])
def test_checker_resolves(tmp_path, name):
    for rel, text in _PACKAGE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert Resolver(tmp_path).resolves(name)


@pytest.mark.parametrize("name", [
    "hybridmem.kv.txn", "hybridmem.kv.base.Pol", "hybridmem.kv.base.Pool.size", "hybridmem.kv.base.Sub.size",
    "hybridmem.kv.Pool", "hybridmem.kv.KVPool.size", "hybridmem.kv.base.Pool.Inner.width",
])
def test_checker_refuses(tmp_path, name):
    for rel, text in _PACKAGE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert not Resolver(tmp_path).resolves(name)


def test_checker_names_stale_paths_and_names(tmp_path):
    for rel, text in _PACKAGE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "README.md").write_text("See docs/kv.md, docs/gone.md and [x](../tests/test_gone.py).\n"
                                        "Metrics: hybridmem/synced_nbytes.\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        '"""Checks hybridmem.kv.base.Pool.view and hybridmem.kv.txn.\n\nSee hybridmem/txn.py."""\n\n'
        'X = "hybridmem/code_is_not_prose.py"  # but a comment is: hybridmem.kv.base.Gone\n')
    assert sorted(stale(tmp_path)) == [
        "README.md:1: no file docs/gone.md",
        "README.md:1: no file tests/test_gone.py",
        "tests/test_x.py:1: hybridmem.kv.txn does not resolve",
        "tests/test_x.py:3: no file hybridmem/txn.py",
        "tests/test_x.py:5: hybridmem.kv.base.Gone does not resolve",
    ]
