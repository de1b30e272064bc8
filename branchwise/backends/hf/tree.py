"""The KV segment tree: which tokens each branch node holds, whose KV it reads, and what that costs.

Why a tree: B branches forked from one prompt must hold the prompt's KV once, not B times. Each
node (a `Segment`) owns only the KV of its own tokens and reads its ancestors' KV through the
`parent` chain, so a prefix is stored once however many descendants read it. A node with live
children is frozen (growing it would change what they read); a released node is freed as soon as
no child needs it any more, and then its parent is checked in turn.

This module knows nothing about the model: it stores the tensors it is given, counts their bytes
per owner (a run) and in total, and answers structural questions. The runner computes the tensors,
the session decides when.

The prefix cache across requests (RadixAttention's idea) is the same tree with finished requests'
nodes left in it. With a byte budget (`KVTree.cache_budget` > 0):

- **Insert.** A released node that nothing live reads any more is *kept* instead of freed when its
  KV is exact (`Segment.exact`: computed by a session without KV-altering accelerations, never
  evicted, `kv_tokens == n_computed`) and its KV chain is exact too. Its pending tokens (the last
  sampled token, never computed) are dropped, so a cached node holds computed KV only. Ownership
  moves from the run's ledger to the tree's `cache` ledger: the run's `held` and the tree's `total`
  (live KV) drop by the node's bytes and `cache.held` rises by them; `total + cache` is all the KV
  the tree holds. A kept node is indexed under its parent (`Segment.cache_kids`) or, as a root, in
  `KVTree.cache_roots` - that index is the radix tree: each level is keyed by segment id, and a
  match scans a node's cached children by their tokens (siblings may start with the same tokens).
- **Match.** `match(ids)` walks the index for the longest cached prefix of `ids` (at most
  `len(ids) - 1` tokens, so the new node always computes at least its last token and has logits),
  splitting a cached node when the match ends inside it. The new request's node becomes a live child
  of the match: that **pins** the whole matched path (a node with live children is never evicted).
- **Evict.** `trim()` frees least recently used cached *leaves* (cached, no children at all) until
  `cache.held <= cache_budget`; a parent becomes a leaf in turn. It looks among the cached nodes
  only (`_cached`), not every live one, so a busy server's many live branches cost it nothing. Pinned bytes can keep the cache
  above its budget until the pins are released.
- A cached node under a *live* parent does not freeze it: growing that parent (`growable`) drops
  its cached children first, since their KV assumed the parent's old end.

Shared blocks (ReasonCache's zero-copy reuse) are the other way two nodes hold one copy of KV: a
`Block` is a sealed, immutable run of `block_tokens` KV slots that several nodes reference
(`Segment.blocks`, each entry the logical start of the block in the node's own tokens). A block
carries a reference count; it is freed exactly when the last node referencing it is freed. Its
bytes count once, in the ledger of the run that sealed it. A node with blocks holds fewer physical
KV tokens than it computed (like an eviction), so it is neither cached nor split: a fork that shares
a prefix ending inside such a lossy node shares only up to the node's start (`shareable_prefix`).
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
    """Bytes and nodes of live KV (every run's nodes); cached nodes count in `cache` instead."""
    cache: Ledger = field(default_factory=Ledger)
    """Bytes and nodes kept by the prefix cache."""
    cache_budget: int = 0
    """Byte budget of the prefix cache; 0 = off (released nodes are freed at once)."""
    cache_roots: dict[int, Segment] = field(default_factory=dict)
    evictions: int = 0
    """Cached nodes freed to stay within the budget (or dropped because their parent grew), ever."""
    blocks_live: int = 0
    """Physical shared blocks held (each counted once however many nodes reference it)."""
    _segments: dict[int, Segment] = field(default_factory=dict)
    _cached: dict[int, Segment] = field(default_factory=dict)
    """The cached segments (eviction looks among these, not every live segment)."""
    _next_id: int = 0
    _next_block: int = 0
    _clock: int = 0

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
        if seg.cache_kids and seg.live_children == len(seg.cache_kids):
            for kid in list(seg.cache_kids.values()):  # their KV assumed this node's old end
                self.evictions += len(self._drop(kid))
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

    def shareable_prefix(
        self, root: Segment, k: int, on_split: Callable[[Segment, Segment, int], None] | None = None
    ) -> tuple[Segment | None, int]:
        """The deepest segment of `root`'s KV chain that a fork may share up to path position k, and
        where its chain ends (at most k); (None, 0) when nothing can be shared.

        Like `prefix_node`, but a position inside a *lossy* segment (evicted slots, or shared blocks)
        is not split: its physical slots no longer map to its logical tokens, so its first tokens'
        KV cannot be cut out, and reusing a guess as exact KV would be silently wrong. The answer
        stops at that segment's start instead, and the caller computes the tokens from there on. A
        position at a lossy segment's end shares it whole, as `fork` does.
        """
        chain = list(reversed([root, *root.kv_ancestors()]))
        start = 0
        prev: Segment | None = None
        for seg in chain:
            end = start + len(seg.tokens)
            if k == end:
                return seg, k
            if start < k < end:
                if not splittable(seg):
                    return prev, start
                return self.prefix_node(root, k, on_split), k
            prev, start = seg, end
        raise ValueError(f"position {k} is beyond the path of node {root.id}")

    def release(self, node: int) -> list[Segment]:
        """Mark a node released; returns the segments that this freed (it and unneeded ancestors)."""
        seg = self._segments.get(node)
        if seg is None or seg.released:
            raise KeyError(f"node {node} is not live")
        seg.released = True
        return self.free_unused(seg)

    def free_unused(self, seg: Segment) -> list[Segment]:
        """Free (or keep in the cache) released segments without live children, then look upstream.

        A segment counts as a child of its KV parent and, when forked elsewhere (a split prefix), of
        its logical parent too; a worklist visits both without freeing anything twice. Cached
        children do not hold a released node back: it is kept with them, or freed with them.
        """
        freed: list[Segment] = []
        work = [seg]
        while work:
            seg = work.pop()
            if seg.id not in self._segments or not seg.released or seg.cached:
                continue
            if seg.live_children > len(seg.cache_kids):
                continue
            if self._keepable(seg):
                work.extend(self._keep(seg))
                continue
            for kid in list(seg.cache_kids.values()):
                freed += self._drop(kid)
            self._free(seg)
            freed.append(seg)
            for up in (seg.parent, seg.logical_parent):
                if up is not None:
                    up.live_children -= 1
                    work.append(up)
        return freed

    # ------------------------------------------------------------------ prefix cache
    def match(self, ids: Sequence[int]) -> tuple[Segment | None, int]:
        """The cached node whose path is the longest prefix of `ids` (at most len(ids) - 1 tokens),
        and that length; splits a cached node when the match ends inside it. (None, 0): no match."""
        node: Segment | None = None
        pos, limit = 0, len(ids) - 1
        kids = self.cache_roots
        while pos < limit and self.cache_budget > 0:
            best, best_k = None, 0
            for kid in kids.values():
                k = common_prefix(kid.tokens, ids[pos:limit])
                if k > best_k and kid.exact:
                    best, best_k = kid, k
            if best is None:
                break
            if best_k < len(best.tokens):
                best = self._split(best, best_k)
            node, pos, kids = best, pos + best_k, best.cache_kids
        self._clock += 1
        seg = node
        while seg is not None:
            seg.last_used = self._clock
            seg = seg.parent
        return node, pos

    def trim(self, limit: int | None = None) -> int:
        """Evict least recently used cached leaves until the cache fits its budget (and `limit`
        bytes, when given: the memory pool asks the cache to yield); returns how many."""
        n = 0
        target = self.cache_budget if limit is None else min(limit, self.cache_budget)
        while self.cache.held > target:
            leaves = [s for s in self._cached.values() if not s.live_children]
            if not leaves:
                break  # the rest is pinned by live requests
            n += len(self._drop(min(leaves, key=lambda s: (s.last_used, s.id))))
        self.evictions += n
        return n

    def _keepable(self, seg: Segment) -> bool:
        if self.cache_budget <= 0 or seg.n_computed == 0 or seg.kv_tokens != seg.n_computed:
            return False
        if seg.parent is not None and not seg.shares_parent:
            return False  # a No-KV copy of its parent's path: the cache would hold it twice
        if seg.pending and seg.cache_kids:
            return False
        return seg.exact and all(a.exact for a in seg.kv_ancestors())

    def _keep(self, seg: Segment) -> list[Segment]:
        """Move a released segment into the cache; returns the nodes to look at again."""
        seg.tokens = seg.tokens[: seg.n_computed]  # the last sampled token was never computed
        seg.last_logits = None
        self._move(seg, self.cache)
        seg.cached = True
        self._cached[seg.id] = seg
        self._clock += 1
        seg.last_used = self._clock
        self._index(seg)[seg.id] = seg
        again = [] if seg.parent is None else [seg.parent]
        if seg.logical_parent is not None:  # the fork origin needs no freezing by a finished node
            seg.logical_parent.live_children -= 1
            again.append(seg.logical_parent)
            seg.logical_parent = None
        return again

    def _index(self, seg: Segment) -> dict[int, Segment]:
        return self.cache_roots if seg.parent is None else seg.parent.cache_kids

    def _drop(self, seg: Segment) -> list[Segment]:
        """Free a cached node and its cached subtree (nothing live reads them); returns them."""
        out: list[Segment] = []
        for kid in list(seg.cache_kids.values()):
            out += self._drop(kid)
        assert seg.cached and not seg.live_children, "a pinned cache node cannot be dropped"
        del self._index(seg)[seg.id]
        del self._cached[seg.id]
        self._free(seg)
        out.append(seg)
        if seg.parent is not None:
            seg.parent.live_children -= 1
        return out

    def _free(self, seg: Segment) -> None:
        self.set_kv(seg, None, None)
        self._unref_blocks(seg)
        seg.last_logits = None
        del self._segments[seg.id]
        for ledger in self._ledgers(seg.owner):
            ledger.nodes -= 1

    def _move(self, seg: Segment, owner: Ledger) -> None:
        """Hand a segment (its bytes and its node count) to another owner."""
        for ledger in self._ledgers(seg.owner):
            ledger.held -= seg.kv_bytes
            ledger.nodes -= 1
        seg.owner = owner
        for ledger in self._ledgers(owner):
            ledger.add(seg.kv_bytes)
            ledger.nodes += 1

    def set_kv(
        self, seg: Segment, keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None
    ) -> None:
        """Replace a segment's KV tensors, keeping the byte accounting exact."""
        delta = -seg.kv_bytes
        seg.keys, seg.values = keys, values
        if keys:
            assert values is not None  # a segment's keys and values come together
            seg.kv_bytes = sum(t.nbytes for t in keys) + sum(t.nbytes for t in values)
        else:
            seg.kv_bytes = 0
        delta += seg.kv_bytes
        for ledger in self._ledgers(seg.owner):
            ledger.add(delta)

    def keep_kv(self, seg: Segment, keep: torch.Tensor) -> None:
        """Evict the physical KV positions where `keep` is False (their tensors are really freed)."""
        assert seg.keys is not None and seg.values is not None
        seg.exact = False
        self.set_kv(seg, [k[:, keep] for k in seg.keys], [v[:, keep] for v in seg.values])

    # ------------------------------------------------------------------ shared blocks
    def seal_block(self, keys: list[torch.Tensor], values: list[torch.Tensor], owner: Ledger) -> Block:
        """A new physical block holding `keys`/`values` (no references yet); `owner` pays its bytes."""
        block = Block(id=self._next_block, keys=keys, values=values, owner=owner)
        self._next_block += 1
        self.blocks_live += 1
        for ledger in self._ledgers(owner):
            ledger.add(block.nbytes)
        return block

    def ref_block(self, seg: Segment, start: int, block: Block) -> None:
        """Let `seg` read `block` as its own tokens `start .. start + block.tokens` (no copy)."""
        block.refs += 1
        seg.blocks.append((start, block))
        seg.exact = False

    def seal_own(self, seg: Segment, slot: int, logical: int, n: int) -> Block:
        """Move a held node's own KV slots `slot .. slot + n` into a new block that it references.

        How a node outside the running batch (an earlier tree step, a branch that finished) becomes
        a sharing source: its bytes move from the node to the block, under the same owner, so
        nothing is held twice; what its readers attend to is unchanged, now read through the block.
        """
        assert seg.keys is not None and seg.values is not None
        keys = [t[:, slot : slot + n].clone() for t in seg.keys]
        values = [t[:, slot : slot + n].clone() for t in seg.values]
        rest_k = [torch.cat([t[:, :slot], t[:, slot + n :]], dim=1) for t in seg.keys]
        rest_v = [torch.cat([t[:, :slot], t[:, slot + n :]], dim=1) for t in seg.values]
        self.set_kv(seg, rest_k, rest_v)
        block = self.seal_block(keys, values, seg.owner)
        self.ref_block(seg, logical, block)
        return block

    def _unref_blocks(self, seg: Segment) -> None:
        for _, block in seg.blocks:
            block.refs -= 1
            assert block.refs >= 0, f"block {block.id} lost more references than it had"
            if block.refs == 0:
                for ledger in self._ledgers(block.owner):
                    ledger.held -= block.nbytes
                block.keys, block.values = [], []
                self.blocks_live -= 1
        seg.blocks = []

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
        """The owner's ledger and the tree's total (once, when the owner is the total itself; the
        cache ledger alone for cached nodes, which are not live KV)."""
        return (owner,) if owner is self.total or owner is self.cache else (owner, self.total)

    def _split(self, seg: Segment, k: int) -> Segment:
        """Move seg's first k tokens (and their KV) into a new parent segment; returns the parent."""
        if seg.n_computed < k:
            raise RuntimeError("cannot split a segment inside its uncomputed tokens")
        if not splittable(seg):
            raise RuntimeError(
                "cannot split a segment whose KV was partly evicted or shared by blocks "
                "(use shareable_prefix, which stops before it)"
            )
        assert seg.keys is not None and seg.values is not None
        head = self.add(seg.parent, seg.shares_parent, seg.tokens[:k], seg.owner)
        if seg.parent is not None:
            seg.parent.live_children -= 1  # `seg` hands its place under the parent to `head`
        head.n_computed, head.live_children, head.released = k, 1, True
        head.exact, head.last_used = seg.exact, seg.last_used
        if seg.cached:  # the head takes the node's place in the radix index
            del self._index(seg)[seg.id]
            head.cached = True
            self._cached[head.id] = head
            self._index(head)[head.id] = head
            head.cache_kids[seg.id] = seg
        keys = [t[:, :k].clone() for t in seg.keys]
        values = [t[:, :k].clone() for t in seg.values]
        rest_k = [t[:, k:].clone() for t in seg.keys]
        rest_v = [t[:, k:].clone() for t in seg.values]
        self.set_kv(head, keys, values)
        self.set_kv(seg, rest_k, rest_v)
        seg.tokens, seg.n_computed = seg.tokens[k:], seg.n_computed - k
        seg.parent, seg.shares_parent = head, True
        return head


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
