"""The KV segment tree: which tokens each branch node holds, whose KV it reads, and what that costs.

Why a tree: B branches forked from one prompt must hold the prompt's KV once, not B times. Each
node (a `Segment`) owns only the KV of its own tokens and reads its ancestors' KV through the
`parent` chain, so a prefix is stored once however many descendants read it. A node with live
children is frozen (growing it would change what they read); a released node is freed as soon as
no child needs it any more, and then its parent is checked in turn.

This module knows nothing about the model: it stores the tensors it is given, counts their bytes
per owner (a run) and in total, and answers structural questions. The runner computes the tensors,
the session decides when.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Ledger:
    """Byte and node accounting of one owner of segments (a run), or of the whole tree."""

    held: int = 0
    peak: int = 0
    nodes: int = 0

    def add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def note_transient(self, nbytes: int) -> None:
        """Count `nbytes` of short-lived buffers (a batch's KV tails) on top of what is held."""
        self.peak = max(self.peak, self.held + nbytes)


@dataclass(eq=False)
class Segment:
    """A node of the branch tree and the KV of its own tokens.

    `tokens[:n_computed]` have KV in `keys`/`values` (per layer `[H_kv, kv_tokens, D]`); the rest
    are pending and computed on first use. A segment that shares its parent attends to the parent's
    KV chain; one that does not holds its whole token path itself (the No-KV baseline). After an
    eviction `kv_tokens` (physical) is below `n_computed` (logical): positions stay logical.
    """

    id: int
    parent: Segment | None
    shares_parent: bool
    tokens: list[int]
    owner: Ledger
    n_computed: int = 0
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    last_logits: torch.Tensor | None = None
    """Logits after the last computed token, while the node has nothing pending (its children's start)."""
    live_children: int = 0
    released: bool = False
    kv_bytes: int = 0
    logical_parent: Segment | None = None
    """The node a child was forked from when its KV parent is elsewhere (a split prefix, or none)."""

    def kv_ancestors(self) -> list[Segment]:
        """Ancestors whose KV this segment attends to, nearest first."""
        out = []
        seg = self
        while seg.shares_parent and seg.parent is not None:
            seg = seg.parent
            out.append(seg)
        return out

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.n_computed :]

    @property
    def kv_tokens(self) -> int:
        """Tokens physically held in KV (fewer than `n_computed` once an acceleration evicted some)."""
        return int(self.keys[0].shape[1]) if self.keys else 0

    @property
    def is_prompt(self) -> bool:
        """A root that holds its own tokens: the prompt every branch below it shares."""
        return self.parent is None

    @property
    def position(self) -> int:
        """Logical position of this segment's next computed token (ancestors' tokens + own computed)."""
        return sum(len(a.tokens) for a in self.kv_ancestors()) + self.n_computed


@dataclass
class KVTree:
    """All live segments of one backend, with byte accounting per owner and in total.

    Not thread-safe on its own: the backend serialises every call under its lock.
    """

    total: Ledger = field(default_factory=Ledger)
    _segments: dict[int, Segment] = field(default_factory=dict)
    _next_id: int = 0

    # ------------------------------------------------------------------ public API
    def add(self, parent: Segment | None, shares: bool, tokens: list[int], owner: Ledger) -> Segment:
        """A new node under `parent` (which gains a live child and so becomes frozen)."""
        seg = Segment(id=self._next_id, parent=parent, shares_parent=shares, tokens=tokens, owner=owner)
        self._next_id += 1
        self._segments[seg.id] = seg
        for ledger in self._ledgers(owner):
            ledger.nodes += 1
        if parent is not None:
            parent.live_children += 1
        return seg

    def adopt(self, root: Segment, child: Segment) -> None:
        """Count `child` as a logical child of `root` too, so `root` stays frozen while it lives."""
        child.logical_parent = root
        root.live_children += 1

    def get(self, node: int) -> Segment:
        """The live segment of a node handle; KeyError when it is unknown or released."""
        seg = self._segments.get(node)
        if seg is None or seg.released:
            raise KeyError(f"node {node} is not live")
        return seg

    def find(self, node: int) -> Segment | None:
        """The segment of a node handle while it is held at all (released ones children keep alive too)."""
        return self._segments.get(node)

    def growable(self, node: int) -> Segment:
        """The live segment of a node that may take new tokens (no live children)."""
        seg = self.get(node)
        if seg.live_children:
            raise ValueError(
                f"node {node} has {seg.live_children} live children and is frozen; fork it instead"
            )
        return seg

    def path_tokens(self, seg: Segment) -> list[int]:
        """All tokens from the root of `seg`'s KV chain to its end."""
        chain = [seg, *seg.kv_ancestors()]
        return [t for s in reversed(chain) for t in s.tokens]

    def prefix_node(
        self, root: Segment, k: int, on_split: Callable[[Segment, Segment, int], None] | None = None
    ) -> Segment:
        """The segment whose KV chain ends exactly at path position k of `root` (splitting one if needed).

        `on_split(head, rest, k)` is told about a split, so per-token state kept elsewhere can follow.
        """
        chain = list(reversed([root, *root.kv_ancestors()]))
        start = 0
        for seg in chain:
            end = start + len(seg.tokens)
            if k == end:
                return seg
            if start < k < end:
                head = self._split(seg, k - start)
                if on_split is not None:
                    on_split(head, seg, k - start)
                return head
            start = end
        raise ValueError(f"position {k} is beyond the path of node {root.id}")

    def release(self, node: int) -> list[Segment]:
        """Mark a node released; returns the segments that this freed (it and unneeded ancestors)."""
        seg = self._segments.get(node)
        if seg is None or seg.released:
            raise KeyError(f"node {node} is not live")
        seg.released = True
        return self.free_unused(seg)

    def free_unused(self, seg: Segment) -> list[Segment]:
        """Free released segments without live children, then whatever that frees upstream.

        A segment counts as a child of its KV parent and, when forked elsewhere (a split prefix), of
        its logical parent too; a worklist visits both without freeing anything twice.
        """
        freed = []
        work = [seg]
        while work:
            seg = work.pop()
            if seg.id not in self._segments or not seg.released or seg.live_children:
                continue
            self.set_kv(seg, None, None)
            seg.last_logits = None
            del self._segments[seg.id]
            for ledger in self._ledgers(seg.owner):
                ledger.nodes -= 1
            freed.append(seg)
            for up in (seg.parent, seg.logical_parent):
                if up is not None:
                    up.live_children -= 1
                    work.append(up)
        return freed

    def set_kv(
        self, seg: Segment, keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None
    ) -> None:
        """Replace a segment's KV tensors, keeping the byte accounting exact."""
        delta = -seg.kv_bytes
        seg.keys, seg.values = keys, values
        seg.kv_bytes = sum(t.nbytes for t in keys) + sum(t.nbytes for t in values) if keys else 0
        delta += seg.kv_bytes
        for ledger in self._ledgers(seg.owner):
            ledger.add(delta)

    def keep_kv(self, seg: Segment, keep: torch.Tensor) -> None:
        """Evict the physical KV positions where `keep` is False (their tensors are really freed)."""
        assert seg.keys is not None and seg.values is not None
        self.set_kv(seg, [k[:, keep] for k in seg.keys], [v[:, keep] for v in seg.values])

    def note_transient(self, owner: Ledger, nbytes: int) -> None:
        """Count a batch's temporary buffers in the owner's and the tree's peaks."""
        for ledger in self._ledgers(owner):
            ledger.note_transient(nbytes)

    def segments(self, owner: Ledger | None = None) -> Iterator[Segment]:
        """Every segment still held (released ones that children keep alive included)."""
        for seg in list(self._segments.values()):
            if owner is None or seg.owner is owner:
                yield seg

    def __contains__(self, node: int) -> bool:
        return node in self._segments

    def __len__(self) -> int:
        return len(self._segments)

    # ------------------------------------------------------------------ internals
    def _ledgers(self, owner: Ledger) -> tuple[Ledger, ...]:
        """The owner's ledger and the tree's total (once, when the owner is the total itself)."""
        return (owner,) if owner is self.total else (owner, self.total)

    def _split(self, seg: Segment, k: int) -> Segment:
        """Move seg's first k tokens (and their KV) into a new parent segment; returns the parent."""
        if seg.n_computed < k:
            raise RuntimeError("cannot split a segment inside its uncomputed tokens")
        if seg.kv_tokens != seg.n_computed:
            raise RuntimeError("cannot split a segment whose KV was partly evicted")
        assert seg.keys is not None and seg.values is not None
        head = self.add(seg.parent, seg.shares_parent, seg.tokens[:k], seg.owner)
        if seg.parent is not None:
            seg.parent.live_children -= 1  # `seg` hands its place under the parent to `head`
        head.n_computed, head.live_children, head.released = k, 1, True
        keys = [t[:, :k].clone() for t in seg.keys]
        values = [t[:, :k].clone() for t in seg.values]
        rest_k = [t[:, k:].clone() for t in seg.keys]
        rest_v = [t[:, k:].clone() for t in seg.values]
        self.set_kv(head, keys, values)
        self.set_kv(seg, rest_k, rest_v)
        seg.tokens, seg.n_computed = seg.tokens[k:], seg.n_computed - k
        seg.parent, seg.shares_parent = head, True
        return head


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common suffix of two token lists."""
    return common_prefix(a[::-1], b[::-1])
