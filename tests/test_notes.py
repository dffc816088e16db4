"""Notes: every invariant explained once, every reference to it resolving.

A Note is defined by a line holding only ``[Note: name]`` in the module docstring of the module that owns
the invariant, followed by its text. A reference names the defining module, except inside that module:
``[Note: name] in :mod:`hybridmem.<module>``` in Python files, ```[Note: name]` in `hybridmem/<path>.py```
in Markdown. The scan reads the text of ``hybridmem/``, ``tests/``, ``benchmarks/``, ``docs/`` and README.md
(``ast`` for the module docstrings, nothing imported) and names file:line for each of:

- a reference to a Note defined nowhere;
- a reference whose ``in ...`` names a module that does not define it, or is written another way;
- a reference outside the defining module that does not say where the Note is;
- a Note defined twice;
- a definition in any other form (a ``# [Note: ...]`` comment, a Markdown heading, a line of a function's
  docstring), and a reference without its closing bracket.

A name may run over a line break (indentation, a comment's ``#`` and adjacent string literals are skipped).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("hybridmem", "tests", "benchmarks", "docs", "README.md")
"""The folders (every ``.py`` and ``.md`` below them) and files scanned, relative to the repository root."""
SELF = Path(__file__).resolve()
"""This file: its examples of each problem are not scanned."""

_OPEN = "[Note:"
_REF = re.compile(re.escape(_OPEN) + r"[ \t]*(?P<name>[^\]\[]{1,160}?)\]")
_JOIN = re.compile(r"""["']?[ \t]*\n[ \t]*(?:#[ \t]*|[rbfu]*["'])?""", re.IGNORECASE)
"""A line break inside a name, with the indentation, ``#`` or string quotes around it."""
_SPACE = r"(?:[ \t]+|[ \t]*\n[ \t]*(?:#[ \t]*)?)"
_WHERE = re.compile(r"`?" + _SPACE + "in" + _SPACE
                    + r"(?P<target>:mod:`~?[\w.]+`|`[\w./]+\.py`|hybridmem[\w./]*\w)")
"""What may follow a reference: ``in`` and a module, in the canonical form or another one."""
_DEFINITION = re.compile(r"[ \t]*" + re.escape(_OPEN) + r" (?P<name>[^\]\[]+)\][ \t]*")
_OTHER_DEFINITION = re.compile(r"[ \t]*(?:#+|>)?[ \t]*`?" + re.escape(_OPEN) + r"[^\]\[]+\]`?:?[ \t]*")
"""A line holding a Note's name alone (in a comment, a heading, a quote): a definition's shape."""


@dataclass(frozen=True)
class Ref:
    """One reference to a Note."""

    where: str
    """``file:line`` of its opening bracket."""
    name: str
    target: str | None
    """What its ``in ...`` names, as written; ``None``: it names no module."""
    canonical: bool
    """Whether it is written the canonical way for its file's kind (False also without ``in``)."""


def scanned_files(root: Path = ROOT) -> list[Path]:
    """The ``.py`` and ``.md`` files of :data:`SCANNED` under ``root``, this file left out."""
    files: list[Path] = []
    for entry in SCANNED:
        path = root / entry
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md") and p.is_file())
    return [f for f in files if f.resolve() != SELF]


def module_of(path: Path, root: Path = ROOT) -> str:
    """The dotted name of a Python file (``hybridmem/kv/__init__.py`` -> ``hybridmem.kv``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_of_target(target: str) -> str | None:
    if target.startswith(":mod:`"):
        return target[len(":mod:`"):-1].lstrip("~")
    target = target.strip("`")
    if target.endswith(".py"):
        if "/" not in target:
            return None  # a file name alone: no module
        parts = target[:-3].split("/")
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return target.replace("/", ".")


def _canonical(target: str, markdown: bool) -> bool:
    if markdown:
        return re.fullmatch(r"`hybridmem/[\w/]+\.py`", target) is not None
    return re.fullmatch(r":mod:`hybridmem(?:\.\w+)*`", target) is not None


def _docstring_lines(text: str, where: str) -> range:
    """The lines (1-based) of the module docstring of ``text``; empty when it has none."""
    try:
        body = ast.parse(text, filename=where).body
    except SyntaxError as e:
        raise AssertionError(f"{where}: cannot parse: {e}") from e
    first = body[0] if body else None
    if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            and isinstance(first.value.value, str)):
        return range(first.lineno, first.end_lineno + 1)
    return range(0)


def scan(path: Path, root: Path = ROOT) -> tuple[dict[str, str], list[Ref], list[str]]:
    """One file's definitions (name -> ``file:line``), references and malformed entries (definitions in
    another form, references without their closing bracket)."""
    text = path.read_text(encoding="utf-8")
    rel = str(path.relative_to(root))
    markdown = path.suffix == ".md"
    docstring = range(0) if markdown else _docstring_lines(text, rel)
    lines = text.split("\n")
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line) + 1)

    definitions: dict[str, str] = {}
    not_refs: set[int] = set()
    malformed: list[str] = []
    for number, line in enumerate(lines, 1):
        if _OPEN not in line:
            continue
        m = _DEFINITION.fullmatch(line)
        if m and number in docstring and number != docstring.start:
            if m["name"] in definitions:
                malformed.append(f"{rel}:{number}: [Note: {m['name']}] is defined twice in this file")
            definitions[m["name"]] = f"{rel}:{number}"
            not_refs.add(starts[number - 1] + line.index(_OPEN))
        elif _OTHER_DEFINITION.fullmatch(line):
            not_refs.add(starts[number - 1] + line.index(_OPEN))
            malformed.append(f"{rel}:{number}: a Note defined outside a module docstring ({line.strip()!r}); "
                             "define it by a line of the docstring of the module that owns it")

    refs: list[Ref] = []
    for m in _REF.finditer(text):
        if m.start() in not_refs:
            continue
        name = " ".join(_JOIN.sub(" ", m["name"]).split())
        after = _WHERE.match(text, m.end())
        target = after["target"] if after else None
        quoted = text[m.start() - 1:m.start()] == "`" and text[m.end():m.end() + 1] == "`"
        canonical = target is not None and _canonical(target, markdown) and (quoted or not markdown)
        refs.append(Ref(f"{rel}:{text.count(chr(10), 0, m.start()) + 1}", name, target, canonical))
    for number, line in enumerate(lines, 1):
        for column in (i for i in range(len(line)) if line.startswith(_OPEN, i)):
            if not _REF.match(text, starts[number - 1] + column):
                malformed.append(f"{rel}:{number}: a Note reference without its closing bracket")
    return definitions, refs, malformed


def problems(root: Path = ROOT) -> list[str]:
    """Every broken definition or reference under ``root``, one line each, starting with file:line."""
    definitions: dict[str, list[tuple[str, str]]] = {}
    """Name -> (``file:line``, module) of each definition."""
    refs: list[tuple[Ref, str | None, bool]] = []
    found: list[str] = []
    for path in scanned_files(root):
        markdown = path.suffix == ".md"
        module = None if markdown else module_of(path, root)
        defs, file_refs, malformed = scan(path, root)
        found += malformed
        for name, where in defs.items():
            definitions.setdefault(name, []).append((where, module))
        refs += [(r, module, markdown) for r in file_refs]

    for name, places in sorted(definitions.items()):
        for where, _ in places[1:]:
            found.append(f"{where}: [Note: {name}] is defined twice (first at {places[0][0]})")
    for ref, module, markdown in refs:
        places = definitions.get(ref.name)
        if not places:
            found.append(f"{ref.where}: [Note: {ref.name}] is defined nowhere")
            continue
        first, home = places[0]
        path = first.rsplit(":", 1)[0]
        expected = f"`[Note: {ref.name}]` in `{path}`" if markdown else f"in :mod:`{home}`"
        if ref.target is not None and _module_of_target(ref.target) != home:
            found.append(f"{ref.where}: [Note: {ref.name}] says in {ref.target}, but it is defined in {home} "
                         f"({first}): write {expected}")
        elif ref.target is not None and not ref.canonical:
            found.append(f"{ref.where}: [Note: {ref.name}] in {ref.target}: write {expected}")
        elif ref.target is None and (markdown or module != home):
            found.append(f"{ref.where}: [Note: {ref.name}] is defined in {home}: write {expected}")
    return found


def test_notes_defined_once_and_every_reference_resolves() -> None:
    found = problems()
    assert not found, f"{len(found)} Note problem(s):\n" + "\n".join(found)


# The checker itself, on a tree of its own -------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


OWNER = '"""Owner.\n\n[Note: lazy frees]\nWhy it holds.\n"""\n\nX = 1  # see [Note: lazy frees]\n'


def test_checker_accepts_the_format(tmp_path):
    root = _tree(tmp_path, {
        "hybridmem/a.py": OWNER,
        "hybridmem/b/__init__.py": '"""User ([Note: lazy\n    frees] in :mod:`hybridmem.a`)."""\n',
        "tests/test_b.py": ("# Checks [Note:\n# lazy frees] in\n# :mod:`hybridmem.a`.\n"
                            "Y = (f'([Note: lazy '\n     'frees] in :mod:`hybridmem.a`)')\n"),
        "docs/x.md": "See `[Note: lazy frees]` in `hybridmem/a.py`.\n",
    })
    assert problems(root) == []


@pytest.mark.parametrize("rel, text, expected", [
    ("hybridmem/b.py", '"""B ([Note: missing])."""\n',
     "hybridmem/b.py:1: [Note: missing] is defined nowhere"),
    ("hybridmem/b.py", '"""B.\n\n[Note: lazy frees]\n"""\n',
     "hybridmem/b.py:3: [Note: lazy frees] is defined twice (first at hybridmem/a.py:3)"),
    ("hybridmem/b.py", "X = 1\n\n# [Note: comment form]\n# Why.\n",
     "hybridmem/b.py:3: a Note defined outside a module docstring"),
    ("hybridmem/b.py", 'def f():\n    """F.\n\n    [Note: function form]\n    """\n',
     "hybridmem/b.py:4: a Note defined outside a module docstring"),
    ("docs/x.md", "## [Note: heading form]\n", "docs/x.md:1: a Note defined outside a module docstring"),
    ("hybridmem/b.py", '"""B ([Note: lazy frees] in :mod:`hybridmem.b`)."""\n',
     "hybridmem/b.py:1: [Note: lazy frees] says in :mod:`hybridmem.b`, but it is defined in hybridmem.a"),
    ("hybridmem/b.py", '"""B ([Note: lazy frees])."""\n',
     "hybridmem/b.py:1: [Note: lazy frees] is defined in hybridmem.a: write in :mod:`hybridmem.a`"),
    ("hybridmem/b.py", '"""B ([Note: lazy frees] in hybridmem.a)."""\n',
     "hybridmem/b.py:1: [Note: lazy frees] in hybridmem.a: write in :mod:`hybridmem.a`"),
    ("docs/x.md", "See [Note: lazy frees] in `a.py`.\n",
     "docs/x.md:1: [Note: lazy frees] says in `a.py`, but it is defined in hybridmem.a"),
    ("docs/x.md", "See [Note: lazy frees] in `hybridmem/a.py`.\n",
     "docs/x.md:1: [Note: lazy frees] in `hybridmem/a.py`: write `[Note: lazy frees]` in `hybridmem/a.py`"),
    ("docs/x.md", "See `[Note: lazy frees]`.\n",
     "docs/x.md:1: [Note: lazy frees] is defined in hybridmem.a: write `[Note: lazy frees]` in"),
    ("hybridmem/b.py", '"""B ([Note: lazy frees."""\n',
     "hybridmem/b.py:1: a Note reference without its closing bracket"),
])
def test_checker_names_each_problem(tmp_path, rel, text, expected):
    found = problems(_tree(tmp_path, {"hybridmem/a.py": OWNER, rel: text}))
    assert len(found) == 1 and found[0].startswith(expected), found
