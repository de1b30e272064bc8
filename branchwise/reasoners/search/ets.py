"""ETS's pruning step (Hooper et al., "ETS: Efficient Tree Search", §4 and App. B) as an ILP.

At each search step ETS decides which current leaves (candidate trajectories) to keep, trading

* the value of the kept leaves — their REBASE allocation normalised to sum 1 (``O_i``), against
* the KV the kept tree holds — the share of the tree's nodes that stay retained, and
* semantic coverage — the share of step-embedding clusters that still have a kept member.

Objective (App. B, Eq. 7; the same normalisations as the public code)::

    max  sum_i O_i x_i  -  lambda_b * (sum_j y_j + sum_i x_i) / (P + L)  +  lambda_d * sum_k z_k / K

with binary ``x_i`` per leaf (keep), ``y_j`` per non-leaf node (its KV stays), ``z_k`` per cluster
(covered); ``L`` leaves, ``P`` non-leaf nodes (every ancestor of a leaf, the root/prompt included:
the paper's P and the public code's branch list both count it; its ``y`` is forced to 1, so it only
enters the normalisation), ``K`` clusters. Constraints:

* ``y_j >= x_i`` for every leaf ``i`` under ``j`` (a kept leaf needs its ancestors' KV);
* ``y_j <= sum_{i under j} x_i`` (a node with no kept leaf under it is released — the appendix only
  states this in words; without it ``lambda_b = 0`` could report phantom retained nodes);
* ``sum_i x_i >= 1`` (never prune everything);
* ``z_k <= sum_{i in C_k} x_i`` (a cluster is covered when *any* member is kept). The appendix prints
  ``z_k <= x_i for all i in C_k``, which would count a cluster only when *every* member is kept and so
  rewards keeping redundant paraphrases — the opposite of the term's purpose; the public code uses
  the sum. ``coverage="all"`` reproduces the misprint for comparison only.

The ILP is solved with PuLP/CBC under a time limit. If CBC fails, times out without a solution, or
returns something inconsistent, a greedy marginal-gain heuristic answers instead and the result says
so (``used_fallback``, ``solver_status``): a search step must never stall or silently degrade.

After pruning, ETS re-runs REBASE over the kept leaves only to split the width (``ets_allocate``).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import pulp

from branchwise.reasoners.search.pulp_compat import binary_variable, solve_status
from branchwise.reasoners.search.rebase import (
    DEFAULT_TEMPERATURE,
    rebase_allocation,
    rebase_weights,
)

__all__ = [
    "DEFAULT_LAMBDA_B",
    "DEFAULT_LAMBDA_D",
    "DEFAULT_TIME_LIMIT_S",
    "Coverage",
    "ETSProblem",
    "ETSSelection",
    "ETSStep",
    "NodeId",
    "default_solver",
    "ets_allocate",
    "ets_select",
    "ets_step",
]

NodeId = Hashable
Coverage = Literal["any", "all"]

DEFAULT_LAMBDA_B = 1.0
"""Budget weight; the public configs use 1.0."""
DEFAULT_LAMBDA_D = 1.4
"""Coverage weight; the public configs use 1.45-1.5 (the paper's text says 1.0)."""
DEFAULT_TIME_LIMIT_S = 5.0
"""CBC's wall-clock limit per step; App. C reports the whole ETS overhead under 2 % of a step."""

_GAIN_EPS = 1e-12  # greedy stops when no leaf improves the objective by more than float noise


def default_solver(time_limit: float = DEFAULT_TIME_LIMIT_S) -> pulp.LpSolver:
    """HiGHS (the ``highspy`` dependency) with a wall-clock limit and no console output.

    HiGHS is installed with branchwise, so a fresh install always has a MILP solver. PuLP's bundled
    CBC binary (``PULP_CBC_CMD``) is the second choice: PuLP 3.3 deprecates it and moves CBC to an
    extra, and constructing it warns with nothing actionable for a branchwise user, so that warning
    is silenced. If neither is available, ``COIN_CMD`` looks for a ``cbc`` on the path; if there is
    none, solving raises and :meth:`ETSProblem.solve` falls back to greedy and reports ``"error"``.
    """
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit)
    if highs.available():
        return highs
    bundled = getattr(pulp, "PULP_CBC_CMD", None)
    if bundled is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            solver = bundled(msg=False, timeLimit=time_limit)
        if solver.available():
            return solver
    return pulp.COIN_CMD(msg=False, timeLimit=time_limit)


@dataclass(frozen=True)
class ETSSelection:
    """Outcome of one ETS pruning step.

    Everything except ``solver_status``/``used_fallback``/``solve_time_s`` is *derived from the kept
    leaves* (not read back from the solver's y/z), so it is consistent by construction: retained
    nodes are exactly the ancestors of kept leaves, covered clusters exactly those with a kept
    member, and ``objective`` is the objective of that selection.
    """

    kept: tuple[NodeId, ...]
    """Kept leaves, in the order the leaves were given."""
    pruned: tuple[NodeId, ...]
    """Pruned leaves, in the order the leaves were given."""
    retained_nodes: tuple[NodeId, ...]
    """Non-leaf nodes whose KV stays (ancestors of kept leaves, root included), in first-seen order."""
    covered_clusters: tuple[Hashable, ...]
    """Cluster labels covered by the kept leaves (empty when no clusters were given)."""
    objective: float
    solver_status: str
    """``"optimal"``, ``"feasible"`` (solver stopped early with an integer solution), ``"trivial"``
    (one leaf, nothing to solve), or why the solver gave no usable answer (``"not solved"``,
    ``"infeasible"``, ``"undefined"``, ``"no solution"``, ``"invalid solution"``, ``"error"``)."""
    used_fallback: bool
    """True when the greedy heuristic, not the solver, chose ``kept``."""
    solve_time_s: float
    """Wall-clock seconds spent in the solver (0 when it was not called)."""
    n_nodes: int
    """P + L: the budget term's denominator."""
    n_clusters: int
    """K: the coverage term's denominator (0 when no clusters were given)."""
    solver_message: str | None = None
    """The solver's exception text when ``solver_status == "error"``."""


class ETSProblem:
    """One ETS pruning instance: a tree of candidate leaves with weights and cluster labels.

    Build it with :meth:`from_tree`; :meth:`solve` runs the ILP (with fallback), :meth:`greedy` the
    heuristic alone, :meth:`objective` scores any selection. Keeping these separate lets tests
    compare the solver against brute force and the misprinted coverage against the correct one.
    """

    def __init__(
        self,
        leaves: tuple[NodeId, ...],
        weights: tuple[float, ...],
        internal: tuple[NodeId, ...],
        leaf_ancestors: tuple[tuple[int, ...], ...],
        cluster_labels: tuple[Hashable, ...],
        cluster_members: tuple[tuple[int, ...], ...],
        leaf_cluster: tuple[int, ...] | None,
        lambda_b: float,
        lambda_d: float,
        coverage: Coverage,
    ) -> None:
        self.leaves = leaves
        self.weights = weights
        self.internal = internal
        self.leaf_ancestors = leaf_ancestors
        self.cluster_labels = cluster_labels
        self.cluster_members = cluster_members
        self.leaf_cluster = leaf_cluster
        self.lambda_b = lambda_b
        self.lambda_d = lambda_d
        self.coverage: Coverage = coverage
        # leaves under each internal node, for the y constraints
        under: list[list[int]] = [[] for _ in internal]
        for i, anc in enumerate(leaf_ancestors):
            for j in anc:
                under[j].append(i)
        self.leaves_under: tuple[tuple[int, ...], ...] = tuple(tuple(u) for u in under)

    # ---------------------------------------------------------------------------------------------
    # construction
    # ---------------------------------------------------------------------------------------------

    @classmethod
    def from_tree(
        cls,
        parents: Mapping[NodeId, NodeId | None],
        leaves: Sequence[NodeId],
        weights: Sequence[float],
        clusters: Sequence[Hashable] | None = None,
        *,
        lambda_b: float = DEFAULT_LAMBDA_B,
        lambda_d: float = DEFAULT_LAMBDA_D,
        coverage: Coverage = "any",
    ) -> ETSProblem:
        """Validate and index a tree given by parent pointers (``None`` marks the root/prompt).

        ``parents`` must map every leaf and every ancestor of a leaf to its parent; nodes that are not
        on a leaf's path (finished or already pruned branches) may be present and are ignored.
        ``weights`` align with ``leaves`` and are normalised to sum 1 (the paper's
        ``sum W_i x_i / sum W_i``), so raw REBASE counts and :func:`rebase_weights` give the same
        problem. ``clusters`` (aligned with ``leaves``) are any hashable labels; ``None`` drops the
        coverage term.
        """
        leaves_t = tuple(leaves)
        if not leaves_t:
            raise ValueError("ETS needs at least one leaf")
        if len(set(leaves_t)) != len(leaves_t):
            raise ValueError("leaves must be distinct")
        if len(weights) != len(leaves_t):
            raise ValueError(f"got {len(weights)} weights for {len(leaves_t)} leaves")
        w = [float(v) for v in weights]
        if any(not math.isfinite(v) or v < 0 for v in w):
            raise ValueError("weights must be finite and >= 0")
        total = sum(w)
        norm = tuple(v / total for v in w) if total > 0 else tuple(w)
        for name, lam in (("lambda_b", lambda_b), ("lambda_d", lambda_d)):
            if not math.isfinite(lam) or lam < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {lam!r}")
        if coverage not in ("any", "all"):
            raise ValueError(f"coverage must be 'any' or 'all', got {coverage!r}")

        leaf_set = set(leaves_t)
        internal: list[NodeId] = []
        index: dict[NodeId, int] = {}
        leaf_ancestors: list[tuple[int, ...]] = []
        for leaf in leaves_t:
            if leaf not in parents:
                raise ValueError(f"leaf {leaf!r} has no entry in parents")
            anc: list[int] = []
            seen = {leaf}
            node = parents[leaf]
            while node is not None:
                if node in seen:
                    raise ValueError(f"parent pointers form a cycle through {node!r}")
                if node in leaf_set:
                    raise ValueError(f"leaf {node!r} is an ancestor of leaf {leaf!r}; leaves must be leaves")
                if node not in parents:
                    raise ValueError(f"node {node!r} (an ancestor of {leaf!r}) has no entry in parents")
                seen.add(node)
                if node not in index:
                    index[node] = len(internal)
                    internal.append(node)
                anc.append(index[node])
                node = parents[node]
            leaf_ancestors.append(tuple(anc))

        labels: list[Hashable] = []
        members: list[list[int]] = []
        leaf_cluster: tuple[int, ...] | None = None
        if clusters is not None:
            if len(clusters) != len(leaves_t):
                raise ValueError(f"got {len(clusters)} cluster labels for {len(leaves_t)} leaves")
            cidx: dict[Hashable, int] = {}
            lc: list[int] = []
            for i, c in enumerate(clusters):
                if c not in cidx:
                    cidx[c] = len(labels)
                    labels.append(c)
                    members.append([])
                members[cidx[c]].append(i)
                lc.append(cidx[c])
            leaf_cluster = tuple(lc)

        return cls(
            leaves=leaves_t,
            weights=norm,
            internal=tuple(internal),
            leaf_ancestors=tuple(leaf_ancestors),
            cluster_labels=tuple(labels),
            cluster_members=tuple(tuple(m) for m in members),
            leaf_cluster=leaf_cluster,
            lambda_b=float(lambda_b),
            lambda_d=float(lambda_d),
            coverage=coverage,
        )

    # ---------------------------------------------------------------------------------------------
    # scoring
    # ---------------------------------------------------------------------------------------------

    @property
    def n_nodes(self) -> int:
        """P + L, the budget term's denominator."""
        return len(self.internal) + len(self.leaves)

    @property
    def n_clusters(self) -> int:
        """K, the coverage term's denominator (0 without clusters)."""
        return len(self.cluster_labels)

    def _mask(self, kept: Sequence[NodeId] | set[NodeId]) -> list[bool]:
        pos = {leaf: i for i, leaf in enumerate(self.leaves)}
        mask = [False] * len(self.leaves)
        for leaf in kept:
            if leaf not in pos:
                raise ValueError(f"{leaf!r} is not one of the leaves")
            mask[pos[leaf]] = True
        return mask

    def _retained(self, mask: Sequence[bool]) -> list[int]:
        seen: dict[int, None] = {}
        for i, keep in enumerate(mask):
            if keep:
                for j in self.leaf_ancestors[i]:
                    seen.setdefault(j, None)
        return list(seen)

    def _covered(self, mask: Sequence[bool]) -> list[int]:
        test = any if self.coverage == "any" else all
        return [k for k, mem in enumerate(self.cluster_members) if test(mask[i] for i in mem)]

    def _objective_mask(self, mask: Sequence[bool]) -> float:
        value = sum(w for w, keep in zip(self.weights, mask, strict=True) if keep)
        n_kept_nodes = len(self._retained(mask)) + sum(mask)
        value -= self.lambda_b * n_kept_nodes / self.n_nodes
        if self.n_clusters:
            value += self.lambda_d * len(self._covered(mask)) / self.n_clusters
        return value

    def objective(self, kept: Sequence[NodeId] | set[NodeId]) -> float:
        """The ETS objective of keeping exactly the leaves ``kept`` (ids from ``leaves``)."""
        return self._objective_mask(self._mask(kept))

    def selection(
        self,
        mask: Sequence[bool],
        *,
        solver_status: str,
        used_fallback: bool,
        solve_time_s: float,
        solver_message: str | None = None,
    ) -> ETSSelection:
        """Package a keep-mask as an :class:`ETSSelection`, deriving everything else from it."""
        if not any(mask):
            raise ValueError("a selection must keep at least one leaf")
        return ETSSelection(
            kept=tuple(leaf for leaf, keep in zip(self.leaves, mask, strict=True) if keep),
            pruned=tuple(leaf for leaf, keep in zip(self.leaves, mask, strict=True) if not keep),
            retained_nodes=tuple(self.internal[j] for j in self._retained(mask)),
            covered_clusters=tuple(self.cluster_labels[k] for k in self._covered(mask)),
            objective=self._objective_mask(mask),
            solver_status=solver_status,
            used_fallback=used_fallback,
            solve_time_s=solve_time_s,
            n_nodes=self.n_nodes,
            n_clusters=self.n_clusters,
            solver_message=solver_message,
        )

    # ---------------------------------------------------------------------------------------------
    # greedy fallback
    # ---------------------------------------------------------------------------------------------

    def greedy_mask(self) -> list[bool]:
        """Greedy keep-mask: best single leaf, then add the leaf with the largest gain while positive.

        Each gain is computed incrementally — the leaf's weight, minus ``lambda_b/(P+L)`` for the
        leaf and each ancestor not yet retained (walking up stops at the first retained one, since
        the retained set is closed upwards), plus ``lambda_d/K`` when it newly covers its cluster —
        so a step costs O(L * depth) and the whole heuristic O(L^2 * depth), fine at L = 256.
        """
        n = len(self.leaves)
        mask = [False] * n
        retained: set[int] = set()
        n_kept_in_cluster = [0] * self.n_clusters
        unit_b = self.lambda_b / self.n_nodes
        unit_d = self.lambda_d / self.n_clusters if self.n_clusters else 0.0

        def gain(i: int) -> float:
            g = self.weights[i] - unit_b
            for j in self.leaf_ancestors[i]:
                if j in retained:
                    break
                g -= unit_b
            if self.leaf_cluster is not None:
                k = self.leaf_cluster[i]
                if self.coverage == "any":
                    newly = n_kept_in_cluster[k] == 0
                else:
                    newly = n_kept_in_cluster[k] == len(self.cluster_members[k]) - 1
                if newly:
                    g += unit_d
            return g

        first = True
        while True:
            best_i, best_g = -1, -math.inf
            for i in range(n):
                if not mask[i]:
                    g = gain(i)
                    if g > best_g:
                        best_i, best_g = i, g
            if best_i < 0 or (not first and best_g <= _GAIN_EPS):
                break
            mask[best_i] = True
            retained.update(self.leaf_ancestors[best_i])
            if self.leaf_cluster is not None:
                n_kept_in_cluster[self.leaf_cluster[best_i]] += 1
            first = False
        return mask

    def greedy(self) -> ETSSelection:
        """The greedy heuristic alone (reported as a fallback with ``solver_status="not run"``)."""
        return self.selection(
            self.greedy_mask(), solver_status="not run", used_fallback=True, solve_time_s=0.0
        )

    # ---------------------------------------------------------------------------------------------
    # ILP
    # ---------------------------------------------------------------------------------------------

    def build_lp(self) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
        """The PuLP model of App. B (with the corrected coverage constraint unless ``coverage="all"``)."""
        lp = pulp.LpProblem("ets_prune", pulp.LpMaximize)
        x = [binary_variable(lp, f"x_{i}") for i in range(len(self.leaves))]
        y = [binary_variable(lp, f"y_{j}") for j in range(len(self.internal))]
        z = [binary_variable(lp, f"z_{k}") for k in range(self.n_clusters)]
        objective = pulp.lpSum(w * xi for w, xi in zip(self.weights, x, strict=True))
        objective -= (self.lambda_b / self.n_nodes) * (pulp.lpSum(y) + pulp.lpSum(x))
        if z:
            objective += (self.lambda_d / self.n_clusters) * pulp.lpSum(z)
        lp += objective, "ets_objective"
        for j, under in enumerate(self.leaves_under):
            for i in under:
                lp += y[j] >= x[i], f"keep_{j}_for_{i}"
            lp += y[j] <= pulp.lpSum(x[i] for i in under), f"release_{j}"
        lp += pulp.lpSum(x) >= 1, "keep_one"
        for k, mem in enumerate(self.cluster_members):
            if self.coverage == "any":
                lp += z[k] <= pulp.lpSum(x[i] for i in mem), f"cover_{k}"
            else:  # the appendix's misprint, for comparison only
                for i in mem:
                    lp += z[k] <= x[i], f"cover_{k}_all_{i}"
        return lp, x

    def solve(
        self,
        *,
        time_limit: float = DEFAULT_TIME_LIMIT_S,
        solver: pulp.LpSolver | None = None,
    ) -> ETSSelection:
        """Solve the ILP with CBC (or ``solver``), falling back to :meth:`greedy_mask` when needed.

        ``time_limit`` (seconds) applies to the default CBC solver; a ``solver`` passed in carries its
        own settings (tests pass failing solvers here to exercise the fallback).

        * one leaf: kept without calling the solver (``"trivial"``);
        * optimal: the solver's selection;
        * stopped early with an integer solution (``"feasible"``, e.g. the time limit): the better of
          that and the greedy selection (``used_fallback`` says which);
        * anything else (no solution, solver error, a solution that keeps nothing): greedy.
        """
        if not (math.isfinite(time_limit) and time_limit > 0):
            raise ValueError(f"time_limit must be a finite number > 0, got {time_limit!r}")
        if len(self.leaves) == 1:
            return self.selection([True], solver_status="trivial", used_fallback=False, solve_time_s=0.0)

        lp, x = self.build_lp()
        cmd = solver if solver is not None else default_solver(time_limit)
        start = time.perf_counter()
        try:
            result = lp.solve(cmd)
        except Exception as exc:  # CBC missing/crashed, or an injected solver failing: fall back, say why
            elapsed = time.perf_counter() - start
            return self.selection(
                self.greedy_mask(),
                solver_status="error",
                used_fallback=True,
                solve_time_s=elapsed,
                solver_message=f"{type(exc).__name__}: {exc}",
            )
        elapsed = time.perf_counter() - start

        status = solve_status(lp, result)  # PuLP 3 and 4 report a solve differently
        if status not in ("optimal", "feasible"):
            return self.selection(
                self.greedy_mask(), solver_status=status, used_fallback=True, solve_time_s=elapsed
            )

        values = [v.value() for v in x]
        mask = [v is not None and v > 0.5 for v in values]
        if not any(mask):
            return self.selection(
                self.greedy_mask(), solver_status="invalid solution", used_fallback=True, solve_time_s=elapsed
            )
        if status == "feasible":
            greedy = self.greedy_mask()
            if self._objective_mask(greedy) > self._objective_mask(mask) + _GAIN_EPS:
                return self.selection(greedy, solver_status=status, used_fallback=True, solve_time_s=elapsed)
        return self.selection(mask, solver_status=status, used_fallback=False, solve_time_s=elapsed)


def ets_select(
    parents: Mapping[NodeId, NodeId | None],
    leaves: Sequence[NodeId],
    weights: Sequence[float],
    clusters: Sequence[Hashable] | None = None,
    *,
    lambda_b: float = DEFAULT_LAMBDA_B,
    lambda_d: float = DEFAULT_LAMBDA_D,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
    solver: pulp.LpSolver | None = None,
    coverage: Coverage = "any",
) -> ETSSelection:
    """ETS pruning: which leaves to keep. See :class:`ETSProblem` and the module docstring."""
    problem = ETSProblem.from_tree(
        parents, leaves, weights, clusters, lambda_b=lambda_b, lambda_d=lambda_d, coverage=coverage
    )
    return problem.solve(time_limit=time_limit, solver=solver)


def ets_allocate(
    leaves: Sequence[NodeId],
    rewards: Sequence[float],
    kept: Sequence[NodeId] | set[NodeId],
    width: int,
    temperature: float = DEFAULT_TEMPERATURE,
) -> list[int]:
    """ETS's last step: REBASE over the kept leaves only; children per leaf, aligned with ``leaves``.

    Pruned leaves get 0. The counts sum to ``width`` whenever at least one leaf is kept (REBASE's
    contract); a kept leaf can still get 0 when the width is smaller than the number kept.
    """
    if len(rewards) != len(leaves):
        raise ValueError(f"got {len(rewards)} rewards for {len(leaves)} leaves")
    kept_set = set(kept)
    unknown = kept_set - set(leaves)
    if unknown:
        raise ValueError(f"kept leaves not among leaves: {sorted(map(repr, unknown))}")
    idx = [i for i, leaf in enumerate(leaves) if leaf in kept_set]
    sub = rebase_allocation([rewards[i] for i in idx], width, temperature)
    out = [0] * len(leaves)
    for i, n in zip(idx, sub, strict=True):
        out[i] = n
    return out


@dataclass(frozen=True)
class ETSStep:
    """One full ETS step: REBASE weights, the ILP selection, and the width split over kept leaves."""

    weights: tuple[float, ...]
    """O_i per leaf (REBASE allocation at this width, normalised), aligned with the leaves."""
    selection: ETSSelection
    allocation: tuple[int, ...]
    """Children to sample per leaf (0 for pruned leaves), aligned with the leaves; sums to the width."""


def ets_step(
    parents: Mapping[NodeId, NodeId | None],
    leaves: Sequence[NodeId],
    rewards: Sequence[float],
    width: int,
    clusters: Sequence[Hashable] | None = None,
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    lambda_b: float = DEFAULT_LAMBDA_B,
    lambda_d: float = DEFAULT_LAMBDA_D,
    time_limit: float = DEFAULT_TIME_LIMIT_S,
    solver: pulp.LpSolver | None = None,
) -> ETSStep:
    """REBASE weights at ``width`` -> ETS ILP -> REBASE allocation of ``width`` over the kept leaves.

    ``width`` is the remaining width of this step (see :func:`next_width`); it must be >= 1.
    """
    weights = rebase_weights(rewards, temperature, width)
    selection = ets_select(
        parents,
        leaves,
        weights,
        clusters,
        lambda_b=lambda_b,
        lambda_d=lambda_d,
        time_limit=time_limit,
        solver=solver,
    )
    allocation = ets_allocate(leaves, rewards, selection.kept, width, temperature)
    return ETSStep(weights=tuple(weights), selection=selection, allocation=tuple(allocation))
