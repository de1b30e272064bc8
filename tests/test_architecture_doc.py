"""docs/ARCHITECTURE.md's claims about imports and files, checked against the code.

Why a test: the architecture page is the map a new reader trusts, and each of its claims drifts by
one harmless-looking import. What can be checked mechanically is:

* §1's tree names every module of the rooms it lists file by file (the package's top, `backends/`,
  `reasoners/`, `integrations/`, `serve/`), and no file that does not exist;
* the `hf/` table's "knows about" column names exactly the `hf/` modules a row's modules import
  (type-only imports included, imports between modules of one row aside), its rows are in import
  order (a module imports only rows above it, or its own), and every `hf/` module has a row;
* the acceleration modules are imported by `plugins.py` and, outside `hf/`, only by the builders the
  page names (`reasoners/calibrate.py`, `reasoners/steering.py`).

The import graph is read with `ast`, as `tests/test_layout.py` reads it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_layout import imports, modules

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
HF = "branchwise.backends.hf."
ENUMERATED_ROOMS = ("", "backends", "reasoners", "integrations", "serve")
"""Rooms whose files §1's tree lists one by one ("" = the package's top)."""

ACCELERATION_ROW = "one acceleration each"
"""Words of the "holds" cell of the acceleration modules' row."""


def _section_1() -> str:
    text = DOC.read_text(encoding="utf-8")
    return text[text.index("## 1. Layers") : text.index("## 2. ")]


def _tree_files() -> dict[str, set[str]]:
    """The `.py` names §1's tree lists, by room (its top-level folder; "" for the package's top)."""
    block = _section_1().split("```")[1]
    rooms: dict[str, set[str]] = {}
    room = ""
    for line in block.splitlines()[2:]:  # after "branchwise/"
        top = re.match(r"^  (\w+)/", line)
        if top:
            room = top.group(1)
        elif re.match(r"^  \S", line):
            room = ""
        rooms.setdefault(room, set()).update(re.findall(r"(?<![/\w])\w+\.py\b", line))
    return rooms


def test_the_tree_lists_every_module_of_its_enumerated_rooms() -> None:
    listed = _tree_files()
    package = ROOT / "branchwise"
    for room in ENUMERATED_ROOMS:
        on_disk = {p.name for p in (package / room).glob("*.py") if p.name != "__init__.py"}
        missing = on_disk - listed.get(room, set())
        assert not missing, f"§1's tree omits {sorted(missing)} of branchwise/{room}"
    for room, names in listed.items():
        stale = {n for n in names if not (package / room / n).exists()}
        # a name may be a file of a subfolder the room's line describes (e.g. integrations' _shared.py)
        stale = {n for n in stale if not list((package / room).rglob(n))}
        assert not stale, f"§1's tree names {sorted(stale)} in branchwise/{room}, which do not exist"


def _table() -> list[tuple[list[str], str, str]]:
    """The `hf/` table's rows: (module stems, holds, knows about)."""
    rows = []
    for line in _section_1().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        stems = [name.removesuffix(".py") for name in re.findall(r"`(\w+)\.py`", cells[0])]
        rows.append((stems, cells[1], cells[2]))
    return rows


def _imports_with_types(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """`imports` plus what `if TYPE_CHECKING:` blocks import (a type-level dependency is known too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set(imports(name, path, known))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m in known and m != name}


def test_every_hf_module_has_a_row() -> None:
    stems = {s for row, _, _ in _table() for s in row}
    on_disk = {n.removeprefix(HF) for n in modules() if n.startswith(HF)}
    assert on_disk - stems == set(), f"hf/ modules without a row in §1's table: {sorted(on_disk - stems)}"
    assert stems - on_disk == set(), (
        f"§1's table names hf/ modules that do not exist: {sorted(stems - on_disk)}"
    )


@pytest.mark.parametrize("row", range(len(_table())), ids=lambda i: "+".join(_table()[i][0]))
def test_knows_about_names_exactly_what_the_row_imports(row: int) -> None:
    known = modules()
    table = _table()
    stems, _, cell = table[row]
    all_stems = {s for r, _, _ in table for s in r}
    named = {w for w in re.findall(r"\b[a-z_]+\b", cell) if w in all_stems} - set(stems)
    runtime: set[str] = set()
    typed: set[str] = set()
    for stem in stems:
        name = HF + stem
        runtime |= {m.removeprefix(HF) for m in imports(name, known[name], known) if m.startswith(HF)}
        typed |= {
            m.removeprefix(HF) for m in _imports_with_types(name, known[name], known) if m.startswith(HF)
        }
    runtime -= set(stems)
    typed -= set(stems)
    assert runtime <= named, f"{stems}: imports {sorted(runtime - named)}, which 'knows about' does not name"
    assert named <= typed, (
        f"{stems}: 'knows about' names {sorted(named - typed)}, which no module of the row imports"
    )
    above = {s for r, _, _ in table[:row] for s in r}
    assert runtime <= above, f"{stems}: imports {sorted(runtime - above)}, a row below it"


def test_only_plugins_and_the_named_builders_import_an_acceleration() -> None:
    known = modules()
    (accelerations,) = [stems for stems, holds, _ in _table() if ACCELERATION_ROW in holds]
    acc = {HF + s for s in accelerations}
    importers = {name for name, path in known.items() if name not in acc and imports(name, path, known) & acc}
    builders = {"branchwise.reasoners.calibrate", "branchwise.reasoners.steering"}
    assert importers == {HF + "plugins"} | builders, sorted(importers)
    text = _section_1()
    for b in builders:
        assert f"`{b.removeprefix('branchwise.').replace('.', '/')}.py`" in text, b
