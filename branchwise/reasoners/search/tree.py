"""Tree-search selects on the shared KV tree: beam/DVTS, REBASE, ETS and ToT's DFS.

Why apart from the executor: these are the allocation rules of the search strategies — which leaves
to keep and how many children each gets next — and they read like the papers' algorithms; the
executor (`reasoners/reasoner.py`) only calls `search_select` for a select node whose method
allocates. A select retires finished leaves (their text and score stay for the vote, their KV goes)
and releases pruned ones at once, so the backend frees every ancestor no kept leaf still reads.

This is the one module of `search/` that knows about a run (`RunState`, the backend's nodes); the
package's `__init__` does not re-export it, so `import branchwise.reasoners.search` stays the pure,
torch-free core that this module wires to the tree.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from branchwise.backends.base import SupportsNodeEmbedding
from branchwise.reasoners.result import SearchStep
from branchwise.reasoners.search.cluster import MiniLMEmbedder, cluster_embeddings
from branchwise.reasoners.search.ets import ets_step
from branchwise.reasoners.search.rebase import rebase_allocation
from branchwise.reasoners.state import Leaf, RunState
from branchwise.strategies import SelectNode

if TYPE_CHECKING:
    import numpy as np

    from branchwise.reasoners.search.cluster import Embedder

_MINILM: MiniLMEmbedder | None = None
"""One all-MiniLM-L6-v2 per process: every reasoner running ETS shares it (loading costs seconds)."""


def _minilm() -> MiniLMEmbedder:
    global _MINILM
    if _MINILM is None:
        _MINILM = MiniLMEmbedder()
    return _MINILM


def search_select(node: SelectNode, run: RunState, embedder: Embedder | None = None) -> None:
    """Beam/DVTS, REBASE, ETS or DFS: prune, retire finished leaves, allocate the next children.

    Pruned leaves are released at once, so the backend frees every ancestor segment no kept
    leaf still reads (the KV of a pruned subtree is gone before the next step decodes).
    """
    before = run.backend.kv_stats().bytes_held
    finished = [leaf for leaf in run.leaves if leaf.finished]
    active = [leaf for leaf in run.leaves if not leaf.finished]
    to_retire = [leaf for leaf in finished if not leaf.retired]
    if to_retire:
        run.backend.release([leaf.node for leaf in to_retire])
        for leaf in to_retire:
            leaf.retired = True
    info: dict[str, Any] = {}
    width: int | None = None
    if node.method == "dfs":
        allocation, pruned = _dfs(node, run, finished, active)
    else:
        assert node.width is not None  # SelectNode validates it for these methods
        if node.method == "beam" and node.group_by == "subtree":
            allocation, width = _dvts(node, run)
        else:
            width = max(0, node.width - len(finished))
            if width == 0 or not active:
                allocation = {}
            elif node.method == "beam":
                allocation = _beam(node, active, width)
            elif node.method == "rebase":
                counts = rebase_allocation([leaf.score or 0.0 for leaf in active], width, node.temperature)
                allocation = {leaf.node: c for leaf, c in zip(active, counts, strict=True)}
            else:
                allocation, info = _ets(node, run, active, width, embedder)
        pruned = [leaf for leaf in active if not allocation.get(leaf.node)]
    gone = {leaf.node for leaf in pruned}
    for leaf in pruned:
        leaf.record.pruned = True
    if pruned:
        run.backend.release([leaf.node for leaf in pruned if not leaf.retired])
    run.leaves = [leaf for leaf in run.leaves if leaf.node not in gone]
    allocation = {k: v for k, v in allocation.items() if k not in gone and v != 0}
    run.allocation = allocation
    run.exhausted = not allocation
    children = sum(1 if v is None else v for v in allocation.values())  # dfs: None = one leaf to expand
    run.search.append(
        SearchStep(
            select=node.id,
            method=node.method + ("/subtree" if node.group_by == "subtree" else ""),
            width=width,
            active=len(active),
            finished=len(finished),
            kept=len([leaf for leaf in active if leaf.node not in gone]),
            pruned=len(pruned),
            children=children,
            kv_bytes_before=before,
            kv_bytes_after=run.backend.kv_stats().bytes_held,
            **info,
        )
    )


def _split(width: int, ranked: Sequence[Leaf]) -> dict[int, int | None]:
    """`width` children over `ranked` leaves as evenly as possible, the better ones rounding up."""
    base, extra = divmod(width, len(ranked))
    return {leaf.node: base + (1 if i < extra else 0) for i, leaf in enumerate(ranked)}


def _ranked(leaves: Sequence[Leaf]) -> list[Leaf]:
    return sorted(leaves, key=lambda leaf: -(leaf.score or 0.0))  # stable: ties keep their order


def _beam(node: SelectNode, active: Sequence[Leaf], width: int) -> dict[int, int | None]:
    """Keep M = k (or round(sqrt(N))) best unfinished leaves; split the remaining width over them."""
    assert node.width is not None
    m = max(1, round(math.sqrt(node.width))) if node.keep == "sqrt" else node.k
    kept = _ranked(active)[: min(m, width, len(active))]
    return _split(width, kept)


def _dvts(node: SelectNode, run: RunState) -> tuple[dict[int, int | None], int]:
    """DVTS: each subtree owns width/S of the width and keeps its single best unfinished leaf.

    Returns the allocation and the remaining width summed over the subtrees.
    """
    assert node.width is not None
    s = max(1, round(math.sqrt(node.width))) if node.keep == "sqrt" else node.k
    fresh = sorted((leaf for leaf in run.leaves if leaf.group is None), key=lambda leaf: leaf.node)
    for i, leaf in enumerate(fresh):  # the first select splits the first steps into S subtrees
        leaf.group = i * s // len(fresh)
    allocation: dict[int, int | None] = {}
    total = 0
    for g in range(s):
        members = [leaf for leaf in run.leaves if leaf.group == g]
        share = node.width // s + (1 if g < node.width % s else 0)
        width = max(0, share - sum(leaf.finished for leaf in members))
        active = [leaf for leaf in members if not leaf.finished]
        if width and active:
            allocation[_ranked(active)[0].node] = width
            total += width
    return allocation, total


def _dfs(
    node: SelectNode, run: RunState, finished: Sequence[Leaf], active: Sequence[Leaf]
) -> tuple[dict[int, int | None], list[Leaf]]:
    """ToT DFS: prune below the threshold; stop at a finished survivor; else expand the deepest best."""
    threshold = node.threshold or 0.0
    pruned = [leaf for leaf in run.leaves if (leaf.score or 0.0) < threshold]
    if any((leaf.score or 0.0) >= threshold for leaf in finished):
        return {}, pruned  # a solution passed the threshold
    frontier = [leaf for leaf in active if (leaf.score or 0.0) >= threshold]
    if not frontier:
        return {}, pruned
    best = max(frontier, key=lambda leaf: (leaf.record.depth, leaf.score or 0.0, -leaf.node))
    return {best.node: None}, pruned  # None: the next generate's own n


def _ets(
    node: SelectNode, run: RunState, active: Sequence[Leaf], width: int, embedder: Embedder | None
) -> tuple[dict[int, int | None], dict[str, Any]]:
    """ETS: cluster the last steps, solve the KV/coverage ILP, REBASE over the kept leaves."""
    t0 = time.perf_counter()
    clusters, used = _clusters(node, run, active, embedder) if len(active) > 1 else (None, None)
    t1 = time.perf_counter()
    parents: dict[int, int | None] = {}
    for leaf in active:
        at: int | None = leaf.node
        while at is not None and at not in parents:
            parents[at] = run.tree[at].parent
            at = parents[at]
    step = ets_step(
        cast(Mapping[Hashable, Hashable | None], parents),  # read only: node ids are its hashables
        [leaf.node for leaf in active],
        [leaf.score or 0.0 for leaf in active],
        width,
        None if clusters is None else [int(c) for c in clusters],
        temperature=node.temperature,
        lambda_b=node.lambda_b,
        lambda_d=node.lambda_d,
        time_limit=node.time_limit,
    )
    t2 = time.perf_counter()
    run.timings["ets_cluster"] = run.timings.get("ets_cluster", 0.0) + (t1 - t0)
    run.timings["ets_ilp"] = run.timings.get("ets_ilp", 0.0) + (t2 - t1)
    sel = step.selection
    if sel.used_fallback:
        run.notes.append(
            f"select {node.id!r}: ILP {sel.solver_status}"
            + (f" ({sel.solver_message})" if sel.solver_message else "")
            + "; kept the greedy selection"
        )
    info = {
        "clusters": sel.n_clusters or None,
        "embedder": used,
        "solver_status": sel.solver_status,
        "used_fallback": sel.used_fallback,
        "objective": sel.objective,
        "ilp_s": t2 - t1,
        "cluster_s": t1 - t0,
    }
    return dict(zip((leaf.node for leaf in active), step.allocation, strict=True)), info


def _clusters(
    node: SelectNode, run: RunState, active: Sequence[Leaf], embedder: Embedder | None
) -> tuple[np.ndarray | None, str | None]:
    """Cluster labels of the leaves' last steps and the embedder actually used ("minilm" or
    "hidden"), or (None, None) (coverage term off) when no embedder works. A fallback is noted."""
    embeddings = None
    if node.embedder == "minilm":
        try:
            embedder = embedder or _minilm()
            embeddings = embedder.embed([leaf.record.text for leaf in active])
        except ImportError as exc:
            note = f"select {node.id!r}: MiniLM unavailable ({exc}); clustered hidden states instead"
            if note not in run.notes:
                run.notes.append(note)
    if embeddings is None:
        backend = run.backend
        if not isinstance(backend, SupportsNodeEmbedding):
            note = f"select {node.id!r}: backend has no hidden-state embedder; coverage term off"
            if note not in run.notes:
                run.notes.append(note)
            return None, None
        states = backend.embed_nodes([leaf.node for leaf in active], backend.encode("\n"))
        # A causal LM's states share one dominant direction (here also the common question), so
        # raw cosines sit near 1 and a 0.05 cut merges unrelated steps; centring over the
        # candidates keeps only what tells them apart (identical steps still coincide). Measured
        # on SmolLM2-135M chain_sum steps, centred states cut at 0.05 group like MiniLM does.
        embeddings = (states - states.mean(dim=0, keepdim=True)).numpy()
        return cluster_embeddings(embeddings, node.cluster_distance), "hidden"
    return cluster_embeddings(embeddings, node.cluster_distance), "minilm"
