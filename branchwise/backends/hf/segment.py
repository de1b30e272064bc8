"""A node of the KV tree (`Segment`) and the shared KV blocks nodes may read (`Block`, `BlockStore`).

Why apart from the tree: these are the data the tree, the prefix cache, the batch and the
accelerations all handle, while only the tree changes their structure. A segment holds the KV of
its own tokens and reads its ancestors' through its `parent` chain. A block (ReasonCache's
zero-copy reuse) is the other way two nodes hold one copy of KV: a sealed, immutable run of KV
slots that several nodes reference (`Segment.blocks`), freed exactly when the last node referencing
it is freed, its bytes counted once, in the ledger of the run that sealed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from branchwise.backends.hf.ledger import Accounts, Ledger


@dataclass(eq=False)
class Block:
    """A sealed physical KV block that nodes reference instead of holding their own copy.

    `keys`/`values` are per layer `[H_kv, block_tokens, D]` and never change; `refs` counts the
    nodes whose `blocks` list it. Rotary positions are baked into the keys where it was computed.
    """

    id: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    owner: Ledger
    refs: int = 0

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)


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
    exact: bool = True
    """Whether this node's KV is what an exact recompute gives (False once an acceleration that
    approximates or evicts KV touched it); only exact nodes enter or are matched from the cache."""
    cached: bool = False
    """Held by the prefix cache (released, owned by the tree's `cache` ledger) rather than by a run."""
    cache_kids: dict[int, Segment] = field(default_factory=dict)
    """Cached children by id: the radix index below this node."""
    last_used: int = 0
    """Cache clock tick of the last insert or match through this node (LRU order)."""
    blocks: list[tuple[int, Block]] = field(default_factory=list)
    """Shared blocks read in place of own KV: (logical start in this node's own tokens, block)."""
    lent: bool = False
    """Its own KV lives in a decoding batch's tail, not here (`KVTree.lend`), until the batch
    captures it back (`KVTree.set_kv`); `kv_tokens` is then 0 while `n_computed` is not."""

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
class BlockStore:
    """The shared blocks of one tree: sealing, references, and freeing with the last reference."""

    accounts: Accounts
    live: int = 0
    """Physical shared blocks held (each counted once however many nodes reference it)."""
    _next: int = 0

    def seal(self, keys: list[torch.Tensor], values: list[torch.Tensor], owner: Ledger) -> Block:
        """A new physical block holding `keys`/`values` (no references yet); `owner` pays its bytes."""
        block = Block(id=self._next, keys=keys, values=values, owner=owner)
        self._next += 1
        self.live += 1
        self.accounts.charge(owner, block.nbytes)
        return block

    def ref(self, seg: Segment, start: int, block: Block) -> None:
        """Let `seg` read `block` as its own tokens `start .. start + block.tokens` (no copy)."""
        block.refs += 1
        seg.blocks.append((start, block))
        seg.exact = False

    def unref_all(self, seg: Segment) -> None:
        """Drop `seg`'s references; a block whose last reference this was is freed."""
        for _, block in seg.blocks:
            block.refs -= 1
            assert block.refs >= 0, f"block {block.id} lost more references than it had"
            if block.refs == 0:
                self.accounts.charge(block.owner, -block.nbytes)
                block.keys, block.values = [], []
                self.live -= 1
        seg.blocks = []


def splittable(seg: Segment) -> bool:
    """Whether a segment's own KV is still one slot per computed token (nothing evicted, no shared
    blocks), so it can be cut at any computed position."""
    return seg.kv_tokens == seg.n_computed and not seg.blocks


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
