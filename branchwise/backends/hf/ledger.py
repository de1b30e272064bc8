"""Byte and node accounting of KV: one `Ledger` per owner (a run), and the tree's `Accounts`.

Why its own module: the memory pool, the sessions' statistics and the prefix cache all read the
same numbers, and every byte must be counted exactly once however it moves (a run's node kept by
the cache, a node's slots sealed into a shared block). Keeping the rules of that bookkeeping in
one place, apart from the tree's structure, is what keeps `held` exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class Accounts:
    """The tree's two ledgers and the rule that charges an owner's bytes to them.

    A run's bytes count in its own ledger and in `total` (all live KV); the prefix cache's count in
    `cache` alone, since cached KV is not live: `total + cache` is all the KV the tree holds.
    """

    total: Ledger = field(default_factory=Ledger)
    """Bytes and nodes of live KV (every run's nodes); cached nodes count in `cache` instead."""
    cache: Ledger = field(default_factory=Ledger)
    """Bytes and nodes kept by the prefix cache."""

    def of(self, owner: Ledger) -> tuple[Ledger, ...]:
        """The owner's ledger and the tree's total (once, when the owner is the total itself; the
        cache ledger alone for cached nodes, which are not live KV)."""
        return (owner,) if owner is self.total or owner is self.cache else (owner, self.total)

    def charge(self, owner: Ledger, nbytes: int) -> None:
        """Add `nbytes` (negative: release them) to the owner and the ledgers above it."""
        for ledger in self.of(owner):
            ledger.add(nbytes)

    def count(self, owner: Ledger, nodes: int) -> None:
        """Add `nodes` nodes (negative: remove them) to the owner and the ledgers above it."""
        for ledger in self.of(owner):
            ledger.nodes += nodes

    def move(self, nbytes: int, src: Ledger, dst: Ledger) -> None:
        """Hand one node and its `nbytes` from one owner to another."""
        for ledger in self.of(src):
            ledger.held -= nbytes
            ledger.nodes -= 1
        for ledger in self.of(dst):
            ledger.add(nbytes)
            ledger.nodes += 1

    def note_transient(self, owner: Ledger, nbytes: int) -> None:
        """Count a batch's temporary buffers in the owner's and the tree's peaks."""
        for ledger in self.of(owner):
            ledger.note_transient(nbytes)
