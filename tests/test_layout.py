"""The package's shape: its import graph has no cycle and no module grows past a reading size.

Why a test: docs/ARCHITECTURE.md promises layers that depend one way and modules small enough to
read at once. Both drift one harmless-looking import or one more helper at a time, and a doc is
not checked by anything; this file is. Imports inside functions count (a lazy import still ties
two modules: moving one breaks the other) but `if TYPE_CHECKING:` blocks do not (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "branchwise"
MAX_LINES = 600

# Import edges tolerated for now, each a known cycle to remove (not a place to add new ones).
KNOWN_EDGES: frozenset[tuple[str, str]] = frozenset()

# The rooms below each room (docs/ARCHITECTURE.md §1): a module of a room never imports one of these.
# The front ends (integrations, serve, evals, cli) sit on top and may import any room.
NEVER_IMPORTS: dict[str, tuple[str, ...]] = {
    "branchwise.strategies": ("backends", "reasoners", "integrations", "serve", "evals"),
    "branchwise.backends": ("strategies", "reasoners", "integrations", "serve", "evals"),
    "branchwise.reasoners": ("integrations", "serve", "evals"),
}

# Deprecated import paths kept for one release: each forwards to where its module moved, upward.
FORWARDERS: frozenset[str] = frozenset({"branchwise.reasoners.dspy"})


def module_name(path: Path) -> str:
    """`branchwise/a/b.py` -> `branchwise.a.b`; a package's `__init__.py` is the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _import_nodes(body: list[ast.stmt], typing: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Import statements anywhere in `body` (functions included); those under `if TYPE_CHECKING:`
    only when `typing` asks for them."""
    for stmt in body:
        if not typing and isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            yield from _import_nodes(stmt.orelse)
            continue
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            yield stmt
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(stmt, field, ()):
                if isinstance(child, ast.stmt):
                    yield from _import_nodes([child], typing)
                else:  # an except handler or a match case holds statements in its own body
                    yield from _import_nodes(child.body, typing)


def imports(name: str, path: Path, known: dict[str, Path], typing: bool = False) -> set[str]:
    """The package modules `name` imports (with `typing`, its `if TYPE_CHECKING:` imports too).
    `from pkg import x` points at `pkg.x` when that is a module, else at `pkg` (its `__init__`);
    parent packages loaded on the way are not counted."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8")).body, typing):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_import_graph_has_no_cycle() -> None:
    known = modules()
    graph = {
        name: {m for m in imports(name, path, known) if (name, m) not in KNOWN_EDGES}
        for name, path in known.items()
    }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_cycle_through_type_only_imports_either() -> None:
    """A cycle closed only by an `if TYPE_CHECKING:` import still ties two modules (neither can be
    read, moved or typed without the other): a module names what it needs of its caller with a
    protocol of its own instead."""
    known = modules()
    graph = {name: imports(name, path, known, typing=True) for name, path in known.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle through type-only imports: " + " -> ".join(cycle or [])


def test_rooms_import_downward_only() -> None:
    known = modules()
    upward = sorted(
        f"{name} -> {target}"
        for name, path in known.items()
        if name not in FORWARDERS
        for room, above in NEVER_IMPORTS.items()
        if name == room or name.startswith(room + ".")
        for target in imports(name, path, known)
        if any(target == f"branchwise.{up}" or target.startswith(f"branchwise.{up}.") for up in above)
    )
    assert not upward, f"imports against the layers: {upward}"


def test_find_cycle_sees_one() -> None:
    """The checker itself: a graph with a loop is caught, one without is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_modules_stay_small() -> None:
    sizes = {name: len(path.read_text(encoding="utf-8").splitlines()) for name, path in modules().items()}
    too_big = {n: s for n, s in sizes.items() if s > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines (split them): {too_big}"
