"""Every test can fail: a scan of the test files' syntax for tests that check nothing.

Why a test: a test with no assertion passes whatever the code does, and so does a non-strict
``xfail`` (a pass is an XPASS, a failure an XFAIL: both green). Neither shows in a run; both look
like coverage to a reader. This file reads every ``tests/**/test_*.py`` and fails on

* a ``test_*`` function with no check in its body: no ``assert``, no ``raise``, no
  ``pytest.raises`` / ``warns`` / ``fail``, no call of a checking helper (a name starting with
  ``assert``, ``check``, ``expect`` or ``verify``), no call of a standard suite's own test through
  ``super()``, and no call of a helper named in `CHECKING_HELPERS`;
* an assertion that a value is at least zero (``x >= 0``, ``x >= 0.0``, ``0 <= x``, inside
  ``all(...)`` too): on a count, a size or a time it cannot fail, and beside a real assertion it
  reads as one;
* an ``xfail`` mark that is not ``strict=True`` with a ``reason``, the bare ``@pytest.mark.xfail``
  included;
* a fake backend written from scratch instead of on `testkit.FakeBackend`, or a `wait_until` of its own.

What it cannot see: the lower end of a range, ``0 <= x <= n``. Its upper end checks, and its lower
end can too (``0 <= i < j`` on two ``str.find`` results, where -1 means "absent"); on a count it
cannot fail, and is left to reading.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CHECK_PREFIXES = ("assert", "check", "expect", "verify")
"""A call of a function whose name (less leading underscores) starts with one of these checks."""

CHECKS = {"raises", "warns", "fail", "deprecated_call"}
"""`pytest` calls that check (``pytest.raises`` and friends)."""

CHECKING_HELPERS: dict[str, set[str]] = {
    # error(r, status) asserts the status code, the JSON error shape and returns the error
    "test_serve_security.py": {"error"},
    # run_script(...) asserts that the documented script exits 0
    "test_doc_snippets.py": {"run_script"},
}
"""Helpers that check without a name saying so, by file. Each must itself hold an ``assert``
(`test_checking_helpers_assert`), so this list cannot excuse a helper that checks nothing."""


def _name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_super_test(call: ast.Call) -> bool:
    """``super().test_x(...)``: a standard suite's test, whose asserts are the suite's."""
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr.startswith("test_")
        and isinstance(f.value, ast.Call)
        and _name(f.value) == "super"
    )


def checks(fn: ast.FunctionDef | ast.AsyncFunctionDef, helpers: set[str]) -> bool:
    """Whether `fn`'s body holds anything that can make it fail."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert | ast.Raise):
            return True
        if isinstance(node, ast.Call):
            name = _name(node)
            if name in CHECKS or name in helpers or name.lstrip("_").startswith(CHECK_PREFIXES):
                return True
            if _is_super_test(node):
                return True
    return False


def _test_files() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(TESTS.rglob("test_*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def _functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def test_every_test_function_checks_something() -> None:
    empty = [
        f"{path.relative_to(TESTS)}:{fn.lineno} {fn.name}"
        for path, tree in _test_files()
        for fn in _functions(tree)
        if fn.name.startswith("test_") and not checks(fn, CHECKING_HELPERS.get(path.name, set()))
    ]
    assert not empty, "tests that check nothing (pass whatever the code does):\n" + "\n".join(empty)


def test_checking_helpers_assert() -> None:
    for file, names in CHECKING_HELPERS.items():
        tree = ast.parse((TESTS / file).read_text(encoding="utf-8"))
        defs = {fn.name: fn for fn in _functions(tree)}
        for name in names:
            assert name in defs, f"{file}: no helper {name} (drop it from CHECKING_HELPERS)"
            assert any(isinstance(n, ast.Assert) for n in ast.walk(defs[name])), (
                f"{file}: {name} asserts nothing"
            )


def loose_xfails(tree: ast.Module) -> list[int]:
    """Lines of ``xfail`` marks that are not ``strict=True`` with a ``reason`` (a bare
    ``@pytest.mark.xfail``, an attribute never called, has neither)."""
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    loose = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and ast.unparse(node).endswith("mark.xfail")
            and id(node) not in called
        ):
            loose.append(node.lineno)
        if not (isinstance(node, ast.Call) and ast.unparse(node.func).endswith("mark.xfail")):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        strict = keywords.get("strict")
        reason = "reason" in keywords  # (a positional argument is a condition)
        if not (isinstance(strict, ast.Constant) and strict.value is True and reason):
            loose.append(node.lineno)
    return loose


def test_every_xfail_is_strict() -> None:
    loose = [
        f"{path.relative_to(TESTS)}:{line}" for path, tree in _test_files() for line in loose_xfails(tree)
    ]
    assert not loose, (
        "xfail marks without strict=True and a reason (green whether the test passes or fails):\n"
        + "\n".join(loose)
    )


def _zero(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 0


def at_least_zero(tree: ast.Module) -> list[int]:
    """Lines of assertions that a value is at least zero (see the module docstring): ``x >= 0``
    anywhere in a comparison, ``0 <= x`` as a whole one (a range's lower end is not flagged)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for compare in ast.walk(node.test):
            if not isinstance(compare, ast.Compare):
                continue
            operands = [compare.left, *compare.comparators]
            pairs = zip(operands, compare.ops, operands[1:], strict=False)
            if any(isinstance(op, ast.GtE) and _zero(right) for _, op, right in pairs) or (
                len(compare.ops) == 1 and isinstance(compare.ops[0], ast.LtE) and _zero(compare.left)
            ):
                lines.append(compare.lineno)
    return lines


def test_no_assertion_that_a_value_is_at_least_zero() -> None:
    found = [
        f"{path.relative_to(TESTS)}:{line}" for path, tree in _test_files() for line in at_least_zero(tree)
    ]
    assert not found, (
        "assertions that a value is at least zero (on a count, a size or a time they cannot fail: "
        "assert what the value should be):\n" + "\n".join(found)
    )


def test_the_scan_sees_vacuous_bounds_and_loose_xfails() -> None:
    """The two scans above can fail: each form they are for is flagged, its real neighbours are not."""
    flagged = [
        "assert n >= 0",
        "assert s >= 0.0 and t == 1",
        "assert all(p >= 0 for p in xs)",
        "assert 0 <= n",
        "assert a >= b >= 0",
    ]
    kept = ["assert n >= 1", "assert 0.0 <= r <= 1.0", "assert 0 <= i < j", "x = n >= 0", "assert n > 0"]
    assert [bool(at_least_zero(ast.parse(code))) for code in flagged] == [True] * len(flagged)
    assert [bool(at_least_zero(ast.parse(code))) for code in kept] == [False] * len(kept)
    marks = {
        "@pytest.mark.xfail\ndef test_x(): pass": True,
        "@pytest.mark.xfail(strict=True)\ndef test_x(): pass": True,
        "@pytest.mark.xfail(reason='r')\ndef test_x(): pass": True,
        "pytest.param(1, marks=pytest.mark.xfail)": True,
        "@pytest.mark.xfail(reason='r', strict=True)\ndef test_x(): pass": False,
        "@pytest.mark.xfail(sys.platform == 'win32', reason='r', strict=True)\ndef test_x(): pass": False,
    }
    assert {code: bool(loose_xfails(ast.parse(code))) for code in marks} == marks


def test_the_scan_sees_a_test_without_a_check() -> None:
    """The scan itself can fail: a body with only a call is flagged; one with an assert is not."""
    (empty,) = _functions(ast.parse("def test_x():\n    run()\n"))
    (full,) = _functions(ast.parse("def test_x():\n    assert run()\n"))
    (helper,) = _functions(ast.parse("def test_x():\n    error(run(), 400)\n"))
    assert not checks(empty, set()) and checks(full, set())
    assert not checks(helper, set()) and checks(helper, {"error"})


def test_fake_backends_build_on_the_shared_one() -> None:
    """A test's fake backend subclasses `testkit.FakeBackend` (or a class that does), overriding only
    what its tests are about: a class of its own with ``prefill`` is a copy of the node bookkeeping."""
    own = [
        f"{path.relative_to(TESTS)}:{node.lineno} {node.name}"
        for path, tree in _test_files()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and not node.bases
        and any(isinstance(f, ast.FunctionDef) and f.name == "prefill" for f in node.body)
    ]
    assert not own, "fake backends written from scratch (subclass testkit.FakeBackend):\n" + "\n".join(own)


def test_one_wait_until() -> None:
    """Polling helpers live once, in `testkit.wait_until`."""
    copies = [
        f"{path.relative_to(TESTS)}:{fn.lineno}"
        for path, tree in _test_files()
        for fn in _functions(tree)
        if fn.name.lstrip("_") == "wait_until"
    ]
    assert not copies, "wait_until defined again (use testkit.wait_until):\n" + "\n".join(copies)
