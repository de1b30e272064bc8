"""What ETS needs from PuLP, on both of PuLP's solve APIs.

PuLP <= 3 (any Python) records a solve on the problem: ``LpProblem.status`` (why the solver
stopped) and ``LpProblem.sol_status`` (what kind of solution came back), and ``solve`` returns the
status code. PuLP 4 (Python >= 3.12 only, so a 3.10/3.11 install never sees it) keeps no solve state
on the problem: ``solve`` returns an ``LpSolveStats`` whose ``status`` is an ``LpSolveStatus`` and
whose ``has_solution`` says whether a feasible solution came back, and ``LpStatus`` /
``LpSolution*`` are gone. :func:`solve_status` reads either shape into the one vocabulary
``ETSProblem.solve`` reports, so the choice it makes is the same on both:

* ``"optimal"`` — a proven optimum came back;
* ``"feasible"`` — an integer solution came back but the solver stopped before proving it optimal
  (the time limit, typically): ETS compares it with greedy;
* anything else — no solution to use (``"not solved"``, ``"infeasible"``, ``"time limit"``, …, or
  ``"no solution"`` where the status claims success without one): ETS answers with greedy.

The decision reads only the objects it is given (no PuLP constant), so both shapes are testable
whichever PuLP is installed.
"""

from __future__ import annotations

import re
from typing import Any

import pulp

__all__ = ["binary_variable", "solve_status"]

# PuLP <= 3's codes (unchanged since PuLP 1.x; PuLP 4 dropped the names): ``LpSolution*`` ...
SOLUTION_OPTIMAL = 1  # LpSolutionOptimal
SOLUTION_INTEGER_FEASIBLE = 2  # LpSolutionIntegerFeasible
# ... and ``LpStatus``, lower-cased. PuLP 4's ``LpSolveStatus`` keeps these values (and adds more).
PULP3_STATUS = {0: "not solved", 1: "optimal", -1: "infeasible", -2: "unbounded", -3: "undefined"}
_OPTIMAL = 1  # LpStatusOptimal (PuLP <= 3) == LpSolveStatus.Optimal (PuLP 4)


def binary_variable(lp: pulp.LpProblem, name: str) -> pulp.LpVariable:
    """A binary variable owned by ``lp``: PuLP >= 3.3 wants ``add_variable`` (a bare ``LpVariable``
    warns that it goes away in 4.0); older PuLP (the dependency allows 2.8) only has ``LpVariable``."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, cat=pulp.LpBinary)
    return pulp.LpVariable(name, cat=pulp.LpBinary)


def _words(name: str) -> str:
    """``"TimeLimit"`` -> ``"time limit"``: PuLP 4's enum names in PuLP 3's ``LpStatus`` wording."""
    return re.sub(r"(?<=[a-z])(?=[A-Z])", " ", name).lower()


def solve_status(lp: Any, result: Any) -> str:
    """The outcome of ``result = lp.solve(...)``, on PuLP 4 (``result`` an ``LpSolveStats``) or PuLP
    <= 3 (``result`` a status code; the outcome is on ``lp``). See the module docstring."""
    has_solution = getattr(result, "has_solution", None)
    if isinstance(has_solution, bool):  # PuLP >= 4
        stopped = int(result.status)
        if has_solution:
            return "optimal" if stopped == _OPTIMAL else "feasible"
        if stopped == _OPTIMAL:  # status claims success but no solution was found
            return "no solution"
        name = getattr(result, "status_str", None)
        return _words(name) if isinstance(name, str) else PULP3_STATUS.get(stopped, "undefined")
    solution = lp.sol_status  # PuLP <= 3
    if solution == SOLUTION_OPTIMAL:
        return "optimal"
    if solution == SOLUTION_INTEGER_FEASIBLE:
        return "feasible"
    status = PULP3_STATUS.get(lp.status, "undefined")
    return "no solution" if status == "optimal" else status
