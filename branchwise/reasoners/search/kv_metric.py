"""ETS's KV-cache-size proxy metric (ETS §3), with the prompt counted.

ETS argues that tree-search cost tracks KV size, not FLOPs or model calls: at each search step the
KV that must be held (and read) is every token of the current candidates *plus their unique
ancestors* — a node shared by many candidates is held once. The metric sums that over the steps.

The public ETS code meant to include the prompt (the root) but measured its length as the length of
a tokenizer's output *dict* (its number of keys), so the prompt contributed about 2 tokens per step.
Here the root counts its real token count; ``include_prompt=False`` reproduces "prompt excluded"
for comparison with the paper's numbers.

Pure functions over plain tuples: no tree object, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

__all__ = ["KVNode", "KVStep", "kv_cache_size", "kv_size_per_step"]

KVNode = tuple[Hashable, Hashable | None, int]
"""``(node_id, parent_id or None for the root/prompt, n_tokens of this node alone)``."""
KVStep = Sequence[KVNode]
"""The live tree at one search step: the candidates and (at least) all their ancestors."""


def _step_size(step: KVStep, candidates: Sequence[Hashable] | None, include_prompt: bool) -> int:
    parent: dict[Hashable, Hashable | None] = {}
    tokens: dict[Hashable, int] = {}
    node: Hashable | None
    for entry in step:
        if len(entry) != 3:
            raise ValueError(f"each node must be (node, parent, n_tokens), got {entry!r}")
        node, par, n = entry
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n_tokens of {node!r} must be an int >= 0, got {n!r}")
        if node in parent and (parent[node], tokens[node]) != (par, n):
            raise ValueError(f"node {node!r} listed twice with different parent or size")
        parent[node] = par
        tokens[node] = n

    if candidates is None:
        has_child = {p for p in parent.values() if p is not None}
        cands: list[Hashable] = [node for node in parent if node not in has_child]
    else:
        cands = list(candidates)

    counted: set[Hashable] = set()
    for cand in cands:
        node = cand
        path: set[Hashable] = set()
        while node is not None and node not in counted:
            if node not in parent:
                raise ValueError(
                    f"node {node!r} (on the path of candidate {cand!r}) is not in the step's tree"
                )
            if node in path:
                raise ValueError(f"parent pointers form a cycle through {node!r}")
            path.add(node)
            counted.add(node)
            node = parent[node]
    return sum(tokens[n] for n in counted if include_prompt or parent[n] is not None)


def kv_size_per_step(
    steps: Sequence[KVStep],
    candidates: Sequence[Sequence[Hashable] | None] | None = None,
    *,
    include_prompt: bool = True,
) -> list[int]:
    """Tokens held at each step: candidates plus their unique ancestors, the prompt included.

    ``steps[s]`` lists the step's tree as ``(node, parent, n_tokens)``; nodes may come in any order.
    ``candidates[s]`` names the step's candidates; by default (or when it is ``None``) they are the
    listed nodes with no listed child. Listed nodes that are on no candidate's path (a pruned branch
    still in the listing) are not counted. ``include_prompt=False`` drops roots (``parent is None``).
    """
    if candidates is not None and len(candidates) != len(steps):
        raise ValueError(f"got {len(candidates)} candidate lists for {len(steps)} steps")
    return [
        _step_size(step, None if candidates is None else candidates[s], include_prompt)
        for s, step in enumerate(steps)
    ]


def kv_cache_size(
    steps: Sequence[KVStep],
    candidates: Sequence[Sequence[Hashable] | None] | None = None,
    *,
    include_prompt: bool = True,
) -> int:
    """ETS's KV metric: :func:`kv_size_per_step` summed over the search steps."""
    return sum(kv_size_per_step(steps, candidates, include_prompt=include_prompt))
