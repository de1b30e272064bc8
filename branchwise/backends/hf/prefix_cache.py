"""The prefix cache across requests: which finished nodes are kept, the radix index that finds them,
and the least-recently-used order that evicts them (RadixAttention's idea).

Why apart from the tree: the tree owns nodes and their KV; this decides which released nodes are
worth keeping and which to give up first, and finds a new prompt's longest cached prefix. It never
frees or splits a node itself (the tree does, and keeps the bytes exact); it only keeps the index
and the clock, and answers.

- **Insert.** A released node that nothing live reads any more is kept (`admits`) when its KV is
  exact (`Segment.exact`: computed by a session without KV-altering accelerations, never evicted,
  `kv_tokens == n_computed`) and its KV chain is exact too. A kept node is indexed under its parent
  (`Segment.cache_kids`) or, as a root, in `roots`: that index is the radix tree. Each level is
  keyed by segment id, and a lookup scans a node's cached children by their tokens (siblings may
  start with the same tokens).
- **Lookup.** `lookup(ids)` walks the index for the longest cached prefix of `ids` (at most
  `len(ids) - 1` tokens, so the new node always computes at least its last token and has logits).
  When the match ends inside a node it says where, and the tree splits the node there, if at
  least `min_split` of that node's tokens matched: a shorter match (a chat template's first
  tokens, a common first word) is not taken. Why: a split costs every later batch that reads
  the node one more shared segment, one more attention call and log-sum-exp merge per layer for
  every step it decodes (2-4 ms of a ~45 ms step of 8 rows on a 2-core CPU), and a segment more
  towards the compiled step's `step_compiler.SEGMENTS`; a few tokens of prefill saved do not pay
  for that. vLLM caches whole 16-token blocks only, for its own reasons, with the same effect.
- **Evict.** `victim()` names the least recently used cached *leaf* (cached, no children at all)
  while the cache is over its budget; a parent becomes a leaf in turn. It looks among the cached
  nodes only, not every live one, so a busy server's many live branches cost it nothing. Pinned
  bytes (cached nodes with live children) can keep the cache above its budget until released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from branchwise.backends.hf.segment import Segment, common_prefix


@dataclass
class PrefixCache:
    """The radix index and LRU clock of the cached nodes of one tree, and its byte budget."""

    budget: int = 0
    """Byte budget of the prefix cache; 0 = off (released nodes are freed at once)."""
    roots: dict[int, Segment] = field(default_factory=dict)
    """Cached root nodes by id: the first level of the radix index."""
    min_split: int = 16
    """The fewest of a cached node's tokens a match must take to split the node (see the module
    docstring); whole-node matches split nothing and always count. 1: any match splits."""
    evictions: int = 0
    """Cached nodes freed to stay within the budget (or dropped because their parent grew), ever."""
    _cached: dict[int, Segment] = field(default_factory=dict)
    """Every cached node (eviction looks among these, not every live segment)."""
    _clock: int = 0

    def admits(self, seg: Segment) -> bool:
        """Whether a released node without live children may be kept rather than freed."""
        if self.budget <= 0 or seg.n_computed == 0 or seg.kv_tokens != seg.n_computed:
            return False
        if seg.parent is not None and not seg.shares_parent:
            return False  # a No-KV copy of its parent's path: the cache would hold it twice
        if seg.pending and seg.cache_kids:
            return False
        return seg.exact and all(a.exact for a in seg.kv_ancestors())

    def insert(self, seg: Segment) -> None:
        """Index a node the tree has just handed to the cache, as the most recently used."""
        seg.cached = True
        self._cached[seg.id] = seg
        self._clock += 1
        seg.last_used = self._clock
        self._level(seg)[seg.id] = seg

    def remove(self, seg: Segment) -> None:
        """Take a node out of the index (the tree is about to free it)."""
        del self._level(seg)[seg.id]
        del self._cached[seg.id]

    def replace(self, seg: Segment, head: Segment) -> None:
        """`head` (seg's first tokens, split off by the tree) takes seg's place; seg goes under it.

        Called before seg is re-parented: both still name seg's old parent.
        """
        del self._level(seg)[seg.id]
        head.cached = True
        self._cached[head.id] = head
        self._level(head)[head.id] = head
        head.cache_kids[seg.id] = seg

    def lookup(self, ids: Sequence[int]) -> tuple[Segment | None, int, int]:
        """The deepest cached node on the longest cached prefix of `ids` (at most len(ids) - 1
        tokens), the prefix's length, and how many of that node's own tokens it matched when the
        match ends inside the node (0 when it takes the node whole). (None, 0, 0): no match."""
        node: Segment | None = None
        pos, limit = 0, len(ids) - 1
        kids = self.roots
        while pos < limit and self.budget > 0:
            best, best_k = None, 0
            for kid in kids.values():
                k = common_prefix(kid.tokens, ids[pos:limit])
                if k > best_k and kid.exact:
                    best, best_k = kid, k
            if best is None:
                break
            if best_k < len(best.tokens):
                if best_k < self.min_split:
                    break  # too short to pay for a split: the match ends at `node`
                return best, pos + best_k, best_k
            node, pos = best, pos + best_k
            kids = best.cache_kids
        return node, pos, 0

    def touch(self, seg: Segment | None) -> None:
        """Mark `seg` and its ancestors as just used (a match through them)."""
        self._clock += 1
        while seg is not None:
            seg.last_used = self._clock
            seg = seg.parent

    def victim(self, held: int, limit: int | None = None) -> Segment | None:
        """The next node to evict while `held` cache bytes exceed the budget (and `limit`, when
        given: the memory pool asks the cache to yield); None when within it or all is pinned."""
        target = self.budget if limit is None else min(limit, self.budget)
        if held <= target:
            return None
        leaves = [s for s in self._cached.values() if not s.live_children]
        return min(leaves, key=lambda s: (s.last_used, s.id)) if leaves else None

    def _level(self, seg: Segment) -> dict[int, Segment]:
        """The index level a cached node sits in: its parent's cached children, or the roots."""
        return self.roots if seg.parent is None else seg.parent.cache_kids
