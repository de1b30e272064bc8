"""The KV segment tree: which tokens each branch node holds, whose KV it reads, and what that costs.

Why a tree: B branches forked from one prompt must hold the prompt's KV once, not B times. Each
node (a `Segment`) owns only the KV of its own tokens and reads its ancestors' KV through the
`parent` chain, so a prefix is stored once however many descendants read it. A node with live
children is frozen (growing it would change what they read); a released node is freed as soon as
no child needs it any more, and then its parent is checked in turn.

This module knows nothing about the model: it stores the tensors it is given and answers
structural questions. The runner computes the tensors, the run's `Computation` (`compute.py`) decides when. The tree is the
one place that changes nodes; three parts it composes keep their own rules:

- `Accounts` (`ledger.py`): the bytes and nodes of each owner (a run), of all live KV and of the
  cache, exact however a node moves.
- `PrefixCache` (`prefix_cache.py`): which released nodes are kept across requests, the radix index
  that finds a prompt's cached prefix and the LRU order that evicts them. A kept node drops its
  pending token (the last sampled one, never computed), so it holds computed KV only, and moves
  from its run's ledger to the `cache` ledger. A new request's node becomes a live child of its
  match, which **pins** the matched path (a node with live children is never evicted). A cached
  node under a *live* parent does not freeze it: growing that parent (`growable`) drops its cached
  children first, since their KV assumed the parent's old end.
- `BlockStore` (`segment.py`): shared blocks (ReasonCache's zero-copy reuse). A node with blocks
  holds fewer physical KV tokens than it computed (like an eviction), so it is neither cached nor
  split: a fork that shares a prefix ending inside such a lossy node shares only up to the node's
  start (`shareable_prefix`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from branchwise.backends.hf.ledger import Accounts, Ledger
from branchwise.backends.hf.prefix_cache import PrefixCache
from branchwise.backends.hf.segment import Block, BlockStore, Segment, splittable


@dataclass
class KVTree:
    """All live segments of one backend, with the accounts, the prefix cache and the shared blocks.

    Not thread-safe on its own: the backend serialises every call under its lock.
    """

    accounts: Accounts = field(default_factory=Accounts)
    prefix: PrefixCache = field(default_factory=PrefixCache)
    blocks: BlockStore = field(init=False)
    ceiling: Callable[[], int | None] | None = None
    """The most bytes the prefix cache may hold now besides its own budget (None: no bound): set by
    the memory pool (`KVPool.cache_ceiling`), so the cache never keeps more than the KV budget leaves
    free of live KV, however much its own `cache_bytes` would allow."""
    _segments: dict[int, Segment] = field(default_factory=dict)
    _next_id: int = 0

    def __post_init__(self) -> None:
        self.blocks = BlockStore(self.accounts)

    # ------------------------------------------------------------------ nodes
    def add(self, parent: Segment | None, shares: bool, tokens: list[int], owner: Ledger) -> Segment:
        """A new node under `parent` (which gains a live child and so becomes frozen)."""
        seg = Segment(id=self._next_id, parent=parent, shares_parent=shares, tokens=tokens, owner=owner)
        self._next_id += 1
        self._segments[seg.id] = seg
        self.accounts.count(owner, 1)
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
                self.prefix.evictions += len(self._drop(kid))
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
            if self.prefix.admits(seg):
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

    def segments(self, owner: Ledger | None = None) -> Iterator[Segment]:
        """Every segment still held (released ones that children keep alive included)."""
        for seg in list(self._segments.values()):
            if owner is None or seg.owner is owner:
                yield seg

    def __contains__(self, node: int) -> bool:
        return node in self._segments

    def __len__(self) -> int:
        return len(self._segments)

    # ------------------------------------------------------------------ prefix cache
    def match(self, ids: Sequence[int]) -> tuple[Segment | None, int]:
        """The cached node whose path is the longest prefix of `ids` (at most len(ids) - 1 tokens),
        and that length; splits a cached node when the match ends inside it. (None, 0): no match."""
        node, pos, cut = self.prefix.lookup(ids)
        if node is not None and cut:
            node = self._split(node, cut)
        self.prefix.touch(node)
        return node, pos

    def trim(self, limit: int | None = None) -> int:
        """Evict least recently used cached leaves until the cache fits its budget, the pool's
        `ceiling` and `limit` bytes, when given (the memory pool asks the cache to yield); returns
        how many.

        Why the ceiling here, on every trim: a release that hands a burst's finished nodes to the
        cache keeps them all (up to `cache_bytes`), and nothing asks the cache to yield until the
        next decode needs room; bounding it at each trim keeps what is counted within the KV budget
        after every release, not only while a decode runs."""
        ceiling = None if self.ceiling is None else self.ceiling()
        if ceiling is not None:
            limit = ceiling if limit is None else min(limit, ceiling)
        n = 0
        while (leaf := self.prefix.victim(self.accounts.cache.held, limit)) is not None:
            n += len(self._drop(leaf))
        self.prefix.evictions += n
        return n

    def _keep(self, seg: Segment) -> list[Segment]:
        """Move a released segment into the cache; returns the nodes to look at again."""
        seg.tokens = seg.tokens[: seg.n_computed]  # the last sampled token was never computed
        seg.last_logits = None
        self.accounts.move(seg.kv_bytes, seg.owner, self.accounts.cache)
        seg.owner = self.accounts.cache
        self.prefix.insert(seg)
        again = [] if seg.parent is None else [seg.parent]
        if seg.logical_parent is not None:  # the fork origin needs no freezing by a finished node
            seg.logical_parent.live_children -= 1
            again.append(seg.logical_parent)
            seg.logical_parent = None
        return again

    def _drop(self, seg: Segment) -> list[Segment]:
        """Free a cached node and its cached subtree (nothing live reads them); returns them."""
        out: list[Segment] = []
        for kid in list(seg.cache_kids.values()):
            out += self._drop(kid)
        assert seg.cached and not seg.live_children, "a pinned cache node cannot be dropped"
        self.prefix.remove(seg)
        self._free(seg)
        out.append(seg)
        if seg.parent is not None:
            seg.parent.live_children -= 1
        return out

    # ------------------------------------------------------------------ KV
    def set_kv(
        self, seg: Segment, keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None
    ) -> None:
        """Replace a segment's KV tensors, keeping the byte accounting exact (a lent node's KV is
        back: it holds what it is given)."""
        delta = -seg.kv_bytes
        seg.keys, seg.values = keys, values
        seg.lent = False
        if keys:
            assert values is not None  # a segment's keys and values come together
            seg.kv_bytes = sum(t.nbytes for t in keys) + sum(t.nbytes for t in values)
        else:
            seg.kv_bytes = 0
        delta += seg.kv_bytes
        self.accounts.charge(seg.owner, delta)

    def lend(self, seg: Segment) -> None:
        """`seg`'s own KV was just copied into a decoding batch's tail: its tensors go, so the KV is
        held once while the row decodes (the tail is the only copy), and the batch's capture puts it
        back (`set_kv`). Holding it in both, as every re-assembled row did, cost admission a second
        copy of every row's own KV. A row with nothing computed yet is lent too: its KV will be in
        the batch, and a node it reads must not look unread (`recomputable`)."""
        self.set_kv(seg, None, None)
        seg.lent = True

    def reclaim(self, seg: Segment) -> None:
        """A lent node whose batch ended without capturing it (its call raised): what it had
        computed is lost with the tail, so all its tokens are pending again (computed on next use)
        and it reads no shared block."""
        if not seg.lent:
            return
        self.blocks.unref_all(seg)
        self.drop_kv(seg)

    def drop_kv(self, seg: Segment) -> None:
        """Free `seg`'s KV: all its tokens are pending again, computed on next use."""
        self.set_kv(seg, None, None)
        seg.n_computed = 0
        seg.last_logits = None

    def drop_row(self, seg: Segment) -> int:
        """`drop_kv` a preempted row's node, and its ancestors that are `unread_ancestors` then;
        how many ancestors went."""
        return len(self._drop_up(seg, self.readers(), set())) - 1

    def _drop_up(self, seg: Segment, readers: dict[int, list[Segment]], leaving: set[int]) -> list[int]:
        """`drop_kv` `seg` and its `unread_ancestors` then; the bytes each held."""
        gone = [seg, *self.unread_ancestors(seg, readers, leaving)]
        freed = [node.kv_bytes for node in gone]
        for node in gone:
            self.drop_kv(node)
        return freed

    def readers(self) -> dict[int, list[Segment]]:
        """Each node's readers by its id: the nodes whose KV chain holds it (`kv_ancestors`)."""
        out: dict[int, list[Segment]] = {}
        for seg in self._segments.values():
            for anc in seg.kv_ancestors():
                out.setdefault(anc.id, []).append(seg)
        return out

    def recomputable(self, seg: Segment, readers: dict[int, list[Segment]], leaving: set[int]) -> bool:
        """Whether `seg`'s KV may be freed now and computed again on next use, once the nodes in
        `leaving` have freed theirs: recomputing gives it back as it is (exact, none evicted, no
        shared block, neither cached nor lent; an ended row's unfed last token may be pending), and
        no other reader (`readers`) holds KV computed after it (a child's KV would then read its
        parent recomputed under it)."""
        whole = seg.exact and seg.kv_bytes and seg.kv_tokens == seg.n_computed
        if not whole or seg.lent or seg.cached or seg.blocks:
            return False
        return not any(r.id not in leaving and (r.n_computed or r.lent) for r in readers.get(seg.id, ()))

    def unread_ancestors(
        self, seg: Segment, readers: dict[int, list[Segment]], leaving: set[int]
    ) -> list[Segment]:
        """The ancestors of `seg`, nearest first, that are `recomputable` once `seg` and the nodes
        in `leaving` have freed their KV (all are added to `leaving`).

        Why: a request that leaves the batch must take its prompt with it. Rows preempted one by
        one left their shared prompt held, and at a tight budget the held prompts of waiting
        requests took the room the running rows needed (the oldest row alone then grew past the
        budget, for dozens of steps)."""
        return self._leaving_with(seg, leaving, lambda anc: self.recomputable(anc, readers, leaving))

    def idle_ancestors(
        self, seg: Segment, readers: dict[int, list[Segment]], leaving: set[int]
    ) -> list[Segment]:
        """The ancestors of `seg`, nearest first, that hold KV no node outside `leaving` reads (and
        that are neither lent, cached nor a source of shared blocks), once `seg` left (all are
        added to `leaving`): what a request's swapped rows take out of the budget with them.

        Why: under the swap policy (`intake.SWAP`) a preempted row's prompt stayed in memory, so at a
        budget that binds, the prompts of the requests waiting to come back took the room of the
        rows still decoding, until one row was left decoding past the budget (`kv_overruns`: 286
        steps of a run of `benchmarks/kv_budget.py` on pages). Unlike `unread_ancestors` a reader
        not yet computed counts: swapped out, an ancestor is back only when its own rows return."""

        return self._leaving_with(seg, leaving, lambda anc: self.idle(anc, readers, leaving))

    @staticmethod
    def idle(seg: Segment, readers: dict[int, list[Segment]], leaving: set[int]) -> bool:
        """Whether `seg` holds KV that may leave the budget whole (neither lent to a batch, cached
        nor a source of shared blocks) and that no node outside `leaving` reads."""
        held = seg.kv_bytes and not (seg.lent or seg.cached or seg.blocks)
        return bool(held) and all(r.id in leaving for r in readers.get(seg.id, ()))

    @staticmethod
    def _leaving_with(seg: Segment, leaving: set[int], goes: Callable[[Segment], bool]) -> list[Segment]:
        """`seg`'s ancestors, nearest first, up to the first for which `goes` is false, each added to
        `leaving` (with `seg`) before the next is asked: one going may let its parent go."""
        leaving.add(seg.id)
        out = []
        for anc in seg.kv_ancestors():
            if not goes(anc):
                break
            leaving.add(anc.id)
            out.append(anc)
        return out

    def free_idle(self, nodes: list[int], over: int) -> list[int]:
        """Free up to `over` bytes of the KV of `nodes` (in order) that are `recomputable`, with the
        ancestors no other node reads then (`unread_ancestors`); the bytes of each node freed.

        The decode frees its ended rows' KV so before it preempts a running row: their nodes keep
        their tokens, computed again only if ever extended (a server's request never is: it only
        releases them once its last row ends). A preemption costs a running row's recompute for
        sure, this one only if the caller comes back (vLLM frees a finished sequence's blocks at
        once). Only for KV that is a function of the tokens (what is recomputed is what was held)."""
        readers, leaving, freed = self.readers(), set[int](), list[int]()
        for node in nodes:
            if sum(freed) >= over:
                break
            seg = self._segments.get(node)
            if seg is not None and self.recomputable(seg, readers, leaving):
                freed += self._drop_up(seg, readers, leaving)
        return freed

    def keep_kv(self, seg: Segment, keep: torch.Tensor) -> None:
        """Evict the physical KV positions where `keep` is False (their tensors are really freed)."""
        assert seg.keys is not None and seg.values is not None
        seg.exact = False
        self.set_kv(seg, [k[:, keep] for k in seg.keys], [v[:, keep] for v in seg.values])

    def seal_own(self, seg: Segment, slot: int, logical: int, n: int) -> Block:
        """Move a held node's own KV slots `slot .. slot + n` into a new block that it references.

        How a node outside the running batch (an earlier tree step, a branch that finished) becomes
        a sharing source: its bytes move from the node to the block, under the same owner, so
        nothing is held twice; what its readers attend to is unchanged, now read through the block.
        """
        keys, values = self._cut_own(seg, slot, n)
        block = self.blocks.seal(keys, values, seg.owner)
        self.blocks.ref(seg, logical, block)
        return block

    def point_own(self, seg: Segment, slot: int, logical: int, block: Block) -> None:
        """Replace a held node's own KV slots `slot .. slot + block.tokens` by a reference to
        `block` (its tokens `logical ..`): how a branch that ended, its KV back in its node, reads
        a similar block instead of its own copy. Its readers would read the block from their next
        assembly on; a branch that ended has none."""
        self._cut_own(seg, slot, block.tokens)
        self.blocks.ref(seg, logical, block)

    def _cut_own(self, seg: Segment, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Take a held node's own KV slots `slot .. slot + n` out of it; returns them (copies)."""
        assert seg.keys is not None and seg.values is not None
        keys = [t[:, slot : slot + n].clone() for t in seg.keys]
        values = [t[:, slot : slot + n].clone() for t in seg.values]
        rest_k = [torch.cat([t[:, :slot], t[:, slot + n :]], dim=1) for t in seg.keys]
        rest_v = [torch.cat([t[:, :slot], t[:, slot + n :]], dim=1) for t in seg.values]
        self.set_kv(seg, rest_k, rest_v)
        return keys, values

    # ------------------------------------------------------------------ internals
    def _free(self, seg: Segment) -> None:
        self.set_kv(seg, None, None)
        self.blocks.unref_all(seg)
        seg.last_logits = None
        del self._segments[seg.id]
        self.accounts.count(seg.owner, -1)

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
            self.prefix.replace(seg, head)
        keys = [t[:, :k].clone() for t in seg.keys]
        values = [t[:, :k].clone() for t in seg.values]
        rest_k = [t[:, k:].clone() for t in seg.keys]
        rest_v = [t[:, k:].clone() for t in seg.values]
        self.set_kv(head, keys, values)
        self.set_kv(seg, rest_k, rest_v)
        seg.tokens, seg.n_computed = seg.tokens[k:], seg.n_computed - k
        seg.parent, seg.shares_parent = head, True
        return head
