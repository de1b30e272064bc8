"""The KV tree's prefix cache, reference counts and ledgers, driven directly (no model).

Why beside test_tree.py: that file checks the tree's basic life cycle; these pin the rules the
prefix cache and the shared blocks depend on (docs/ARCHITECTURE.md §5, §6) — which node a radix
match lands on and where it splits, who keeps a node alive, which cached leaf goes first, and that
every byte is counted in exactly one ledger — with tensors whose values name their token, so a
test can see which KV went where.
"""

from __future__ import annotations

import pytest
import torch

from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.prefix_cache import PrefixCache
from branchwise.backends.hf.segment import Segment, splittable
from branchwise.backends.hf.tree import KVTree

LAYERS, HEADS, DIM = 2, 2, 3
SLOT_BYTES = 2 * LAYERS * HEADS * DIM * 4  # keys + values, float32, per token


def _kv(tokens: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer `[H_kv, n, D]` KV whose slot i holds token i's value (keys) and its negation (values)."""
    base = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1).expand(HEADS, -1, DIM)
    return [base.clone() + layer for layer in range(LAYERS)], [-base.clone() for _ in range(LAYERS)]


def _node(
    tree: KVTree, parent: Segment | None, tokens: list[int], owner: Ledger, pending: int = 0
) -> Segment:
    """A node whose tokens are computed except its last `pending` ones (a sampled, unfed token)."""
    seg = tree.add(parent, True, list(tokens), owner)
    done = tokens[: len(tokens) - pending]
    if done:
        tree.set_kv(seg, *_kv(done))
    seg.n_computed = len(done)
    return seg


def _slots(seg: Segment) -> list[int]:
    """The tokens a segment's KV slots were computed for (read back from the tensor values)."""
    assert seg.keys is not None
    return [int(v) for v in seg.keys[0][0, :, 0].tolist()]


def _cached_tree(budget: int = 1 << 20) -> tuple[KVTree, Ledger]:
    """A tree whose cache splits at any match (`min_split=1`): these tests walk a few tokens."""
    tree = KVTree(prefix=PrefixCache(budget=budget, min_split=1))
    return tree, Ledger()


# --------------------------------------------------------------------------------------------------
# insert: what a release keeps, and who pays for it
# --------------------------------------------------------------------------------------------------


def test_a_released_exact_node_moves_to_the_cache_ledger_without_its_pending_token() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2, 3, 4], run, pending=1)
    assert (run.held, tree.accounts.total.held, run.nodes) == (3 * SLOT_BYTES, 3 * SLOT_BYTES, 1)
    assert tree.release(root.id) == []  # kept, not freed
    assert root.cached and root.tokens == [1, 2, 3] and tree.prefix.roots == {root.id: root}
    assert (run.held, run.nodes, tree.accounts.total.held, tree.accounts.total.nodes) == (0, 0, 0, 0)
    assert (tree.accounts.cache.held, tree.accounts.cache.nodes) == (3 * SLOT_BYTES, 1)
    assert run.peak == 3 * SLOT_BYTES  # a run's peak survives the hand-over
    assert root.id in tree and len(tree) == 1
    with pytest.raises(KeyError):
        tree.get(root.id)  # cached means released: no run may use the handle any more


def test_what_the_cache_refuses_is_freed_at_once() -> None:
    tree, run = _cached_tree()
    inexact = _node(tree, None, [1, 2], run)
    inexact.exact = False  # an acceleration approximated or evicted its KV
    nothing = _node(tree, None, [3], run, pending=1)  # no computed KV at all
    prompt = _node(tree, None, [4, 5], run)
    copy = tree.add(prompt, False, [4, 5, 6], run)  # share="none": holds its parent's path itself
    tree.set_kv(copy, *_kv([4, 5, 6]))
    copy.n_computed = 3
    assert [s.id for s in tree.release(inexact.id)] == [inexact.id]
    assert [s.id for s in tree.release(nothing.id)] == [nothing.id]
    assert [s.id for s in tree.release(copy.id)] == [copy.id]
    assert tree.release(prompt.id) == [] and list(tree.prefix.roots) == [prompt.id]
    assert tree.accounts.cache.held == 2 * SLOT_BYTES and run.held == 0 and len(tree) == 1


def test_a_child_under_an_inexact_chain_is_not_kept() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2], run)
    root.exact = False
    kid = _node(tree, root, [3], run)
    tree.release(root.id)
    assert {s.id for s in tree.release(kid.id)} == {kid.id, root.id}
    assert tree.accounts.cache.held == 0 and len(tree) == 0 and tree.accounts.total.held == 0


def test_cache_off_frees_released_nodes_as_before() -> None:
    tree, run = _cached_tree(budget=0)
    root = _node(tree, None, [1, 2, 3], run)
    assert [s.id for s in tree.release(root.id)] == [root.id]
    assert tree.match([1, 2, 3, 4]) == (None, 0)
    assert len(tree) == 0 and tree.accounts.cache.held == 0


def test_cached_children_keep_their_released_parent_in_the_cache_with_them() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2], run)
    kid = _node(tree, root, [3, 4], run, pending=1)
    assert tree.release(root.id) == []  # read by its child
    assert not root.cached
    assert tree.release(kid.id) == []
    assert root.cached and kid.cached and root.cache_kids == {kid.id: kid}
    assert tree.prefix.roots == {root.id: root} and kid.tokens == [3]
    assert (tree.accounts.cache.nodes, tree.accounts.cache.held, tree.accounts.total.held, run.held) == (
        2,
        3 * SLOT_BYTES,
        0,
        0,
    )


# --------------------------------------------------------------------------------------------------
# match: the radix walk, its limit and its splits
# --------------------------------------------------------------------------------------------------


def _conversation(tree: KVTree, run: Ledger) -> tuple[Segment, Segment, Segment]:
    """A cached prompt [1, 2] with two cached branches that start alike: [3, 4] and [3, 5, 6]."""
    root = _node(tree, None, [1, 2], run)
    a = _node(tree, root, [3, 4], run)
    b = _node(tree, root, [3, 5, 6], run)
    tree.release(root.id)
    tree.release(a.id)
    tree.release(b.id)
    assert root.cached and a.cached and b.cached
    return root, a, b


def test_match_follows_the_sibling_with_the_longest_common_prefix() -> None:
    tree, run = _cached_tree()
    root, a, b = _conversation(tree, run)
    assert tree.match([1, 2, 3, 5, 6, 7]) == (b, 5)
    assert tree.match([1, 2, 3, 4, 9]) == (a, 4)
    assert tree.match([1, 2, 7, 7]) == (root, 2)
    assert tree.match([9, 1, 2]) == (None, 0)
    assert len(tree) == 3  # whole-node matches split nothing


def test_match_leaves_the_last_token_to_compute() -> None:
    """A prompt equal to a cached path matches all but its last token, so the new node has logits."""
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2, 3, 4], run)
    tree.release(root.id)
    head, k = tree.match([1, 2, 3, 4])
    assert k == 3 and head.tokens == [1, 2, 3] and _slots(head) == [1, 2, 3]
    assert root.parent is head and root.tokens == [4] and _slots(root) == [4]
    assert tree.match([1]) == (None, 0)  # one token: nothing may be reused


def test_a_match_inside_a_cached_node_splits_it_and_the_head_takes_its_index_place() -> None:
    tree, run = _cached_tree()
    root, a, b = _conversation(tree, run)
    bytes_before = tree.accounts.cache.held
    head, k = tree.match([1, 2, 3, 5, 8, 8])
    assert k == 4 and head.tokens == [3, 5] and _slots(head) == [3, 5]
    assert head.cached and head.parent is root and root.cache_kids == {a.id: a, head.id: head}
    assert b.parent is head and head.cache_kids == {b.id: b} and b.tokens == [6] and _slots(b) == [6]
    assert tree.path_tokens(b) == [1, 2, 3, 5, 6]
    assert (
        tree.accounts.cache.held == bytes_before and tree.accounts.cache.nodes == 4
    )  # same bytes, one more node
    assert root.live_children == 2 and head.live_children == 1
    assert tree.match([1, 2, 3, 5, 6, 0]) == (b, 5)  # the split path still matches whole


def test_a_request_under_a_match_pins_its_path_until_released() -> None:
    tree, run = _cached_tree()
    root, a, b = _conversation(tree, run)
    node, k = tree.match([1, 2, 3, 5, 6, 7])
    assert (node, k) == (b, 5)
    req = _node(tree, node, [7], Ledger(), pending=1)  # the new request's node: a live child
    tree.prefix.budget = 0
    assert tree.trim() == 1  # only `a`, the one leaf nothing reads
    assert a.id not in tree and {root.id, b.id} <= {s.id for s in tree.segments()}
    assert tree.accounts.cache.held == 5 * SLOT_BYTES  # the pinned path stays, over the budget
    tree.release(req.id)  # nothing computed: freed, the pins go, and the cache trims later
    assert (
        tree.trim() == 2
        and len(tree) == 0
        and tree.accounts.cache.held == 0
        and tree.accounts.cache.nodes == 0
    )


def test_match_ignores_inexact_cached_nodes() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2, 3], run)
    tree.release(root.id)
    root.exact = False  # as if something had touched it after it was kept
    assert tree.match([1, 2, 3, 4]) == (None, 0)


# --------------------------------------------------------------------------------------------------
# evict: least recently used leaves first
# --------------------------------------------------------------------------------------------------


def test_trim_evicts_least_recently_used_leaves_first() -> None:
    tree, run = _cached_tree()
    a, b, c = (_node(tree, None, [t, t], run) for t in (1, 2, 3))
    for seg in (a, b, c):
        tree.release(seg.id)  # cached in this order: a is the oldest
    assert tree.match([1, 1, 9]) == (a, 2)  # reading a makes it the most recent
    tree.prefix.budget = 2 * SLOT_BYTES  # room for one node
    assert tree.trim() == 2
    assert list(tree.prefix.roots) == [a.id] and tree.prefix.evictions == 2
    assert tree.accounts.cache.held == 2 * SLOT_BYTES and tree.accounts.cache.nodes == 1


def test_eviction_passes_over_live_nodes_and_its_index_follows_splits_and_drops() -> None:
    """Live (uncached) nodes never enter eviction's candidates, however many; the index of cached
    nodes it scans stays equal to the cached set through inserts, splits and drops."""
    tree, run = _cached_tree()
    live = [_node(tree, None, [50 + t, 7], run) for t in range(20)]
    a = _node(tree, None, [1, 2, 3], run)
    tree.release(a.id)
    head, _ = tree.match([1, 2, 9, 9])  # splits a: the head is cached too
    assert head is not None and head.cached

    def cached() -> set[int]:
        return {s.id for s in tree.segments() if s.cached}

    assert set(tree.prefix._cached) == cached() == {head.id, a.id}
    tree.prefix.budget = 0
    assert tree.trim() == 2 and tree.prefix._cached == {} and cached() == set()
    assert all(seg.id in tree and not seg.cached for seg in live)


def test_a_parent_is_evicted_only_once_it_became_a_leaf() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2], run)
    kid = _node(tree, root, [3], run)
    tree.release(kid.id)
    tree.release(root.id)
    tree.match([1, 2, 9])  # the parent is more recent than its child, yet the child goes first
    assert root.last_used > kid.last_used
    tree.prefix.budget = 2 * SLOT_BYTES
    assert tree.trim() == 1 and kid.id not in tree and root.cache_kids == {} and root.live_children == 0
    assert tree.trim(limit=0) == 1 and len(tree) == 0 and tree.accounts.cache.held == 0
    assert tree.prefix.evictions == 2


def test_growing_a_live_node_drops_the_cached_children_it_invalidates() -> None:
    tree, run = _cached_tree()
    parent = _node(tree, None, [1, 2], run)
    kid = _node(tree, parent, [3, 4], run)
    tree.release(kid.id)
    assert kid.cached and parent.cache_kids == {kid.id: kid} and parent.live_children == 1
    assert tree.growable(parent.id) is parent  # no ValueError: a cached child does not freeze it
    assert kid.id not in tree and parent.live_children == 0 and tree.prefix.evictions == 1
    assert tree.accounts.cache.held == 0 and run.held == 2 * SLOT_BYTES


def test_a_live_child_still_freezes_a_node_with_cached_children() -> None:
    tree, run = _cached_tree()
    parent = _node(tree, None, [1, 2], run)
    kid = _node(tree, parent, [3], run)
    live = _node(tree, parent, [4], run)
    tree.release(kid.id)
    with pytest.raises(ValueError, match="frozen"):
        tree.growable(parent.id)
    assert kid.cached and tree.prefix.evictions == 0 and live.live_children == 0


# --------------------------------------------------------------------------------------------------
# reference counts: splits, logical children, shared blocks
# --------------------------------------------------------------------------------------------------


def test_a_split_head_lives_exactly_as_long_as_something_below_it() -> None:
    tree, run = _cached_tree(budget=0)
    root = _node(tree, None, [1, 2, 3, 4], run)
    old_child = _node(tree, root, [5], run)
    head = tree.prefix_node(root, 2)
    assert head.released and head.live_children == 1 and root.parent is head
    assert (run.nodes, run.held) == (3, 5 * SLOT_BYTES)
    fork = _node(tree, head, [9], run)  # a fork at the split point reads the head only
    assert head.live_children == 2 and tree.path_tokens(fork) == [1, 2, 9]
    tree.release(root.id)
    assert root.id in tree  # its child still reads it
    assert {s.id for s in tree.release(old_child.id)} == {old_child.id, root.id}
    assert head.id in tree and head.live_children == 1
    assert {s.id for s in tree.release(fork.id)} == {fork.id, head.id}
    assert len(tree) == 0 and (run.held, run.nodes, tree.accounts.total.held, tree.accounts.total.nodes) == (
        0,
        0,
        0,
        0,
    )


def test_an_adopted_child_keeps_its_logical_parent_frozen_and_alive() -> None:
    tree, run = _cached_tree(budget=0)
    origin = _node(tree, None, [1, 2, 3], run)
    elsewhere = _node(tree, None, [1, 2], run)  # its KV parent is another prompt
    child = _node(tree, elsewhere, [3, 7], run)
    tree.adopt(origin, child)
    assert origin.live_children == 1 and child.logical_parent is origin
    with pytest.raises(ValueError, match="frozen"):
        tree.growable(origin.id)
    assert tree.release(origin.id) == [] and origin.id in tree
    tree.release(elsewhere.id)
    freed = {s.id for s in tree.release(child.id)}
    assert freed == {child.id, elsewhere.id, origin.id} and len(tree) == 0 and run.held == 0


def test_a_cached_adopted_child_lets_its_logical_parent_go() -> None:
    tree, run = _cached_tree()
    origin = _node(tree, None, [1, 2, 3], run)
    origin.exact = False  # so the origin itself is not kept: only the child's release frees it
    child = _node(tree, None, [1, 2, 3, 4], run)
    tree.adopt(origin, child)
    tree.release(origin.id)
    assert tree.release(child.id) == [origin]
    assert child.cached and child.logical_parent is None and origin.id not in tree


def test_shared_blocks_are_counted_once_and_freed_with_their_last_reader() -> None:
    tree, run = _cached_tree(budget=0)
    src = _node(tree, None, [1, 2, 3, 4, 5], run)
    held = run.held
    block = tree.seal_own(src, slot=1, logical=1, n=3)
    assert run.held == held and tree.accounts.total.held == held  # bytes moved into the block, not copied
    assert src.kv_tokens == 2 and _slots(src) == [1, 5] and block.tokens == 3
    assert [int(v) for v in block.keys[0][0, :, 0].tolist()] == [2, 3, 4]
    assert block.refs == 1 and tree.blocks.live == 1 and not src.exact and not splittable(src)
    other = Ledger()
    reader = _node(tree, None, [7, 2, 3, 4], other)
    tree.blocks.ref(reader, 1, block)
    assert block.refs == 2 and other.held == 4 * SLOT_BYTES  # the reader pays nothing for the block
    tree.release(src.id)
    assert block.refs == 1 and tree.blocks.live == 1 and block.keys  # still read
    assert run.held == 3 * SLOT_BYTES  # its sealer keeps paying while anyone reads it
    tree.release(reader.id)
    assert block.refs == 0 and tree.blocks.live == 0 and block.keys == []
    assert run.held == 0 and other.held == 0 and tree.accounts.total.held == 0


def test_a_node_with_blocks_is_neither_cached_nor_split() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2], run)
    kid = _node(tree, root, [3, 4, 5, 6], run)
    tree.seal_own(kid, slot=0, logical=0, n=2)
    assert tree.shareable_prefix(kid, 4) == (root, 2)  # stops at the lossy node's start
    assert tree.shareable_prefix(kid, 6) == (kid, 6)  # its end is shared whole
    with pytest.raises(RuntimeError, match="shared by blocks"):
        tree.prefix_node(kid, 4)
    assert [s.id for s in tree.release(kid.id)] == [kid.id]
    assert list(tree.prefix.roots) == [] and tree.blocks.live == 0


def test_an_evicted_node_shares_only_up_to_its_start() -> None:
    tree, run = _cached_tree()
    root = _node(tree, None, [1, 2, 3], run)
    kid = _node(tree, root, [4, 5, 6], run)
    tree.keep_kv(kid, torch.tensor([True, False, True]))
    assert kid.kv_tokens == 2 and kid.n_computed == 3 and _slots(kid) == [4, 6]
    assert kid.position == 6  # positions stay logical
    assert tree.shareable_prefix(kid, 5) == (root, 3)
    assert tree.shareable_prefix(kid, 2)[1] == 2  # inside an exact node: split as usual
    assert run.held == 5 * SLOT_BYTES


# --------------------------------------------------------------------------------------------------
# ledgers
# --------------------------------------------------------------------------------------------------


def test_every_byte_is_in_exactly_one_of_a_run_and_the_cache() -> None:
    tree, _ = _cached_tree()
    runs = [Ledger(), Ledger()]
    prompt = _node(tree, None, [1, 2, 3], runs[0])
    kids = [_node(tree, prompt, [4 + i, 9], runs[i], pending=1) for i in range(2)]

    def check() -> None:
        live = sum(s.kv_bytes for s in tree.segments() if not s.cached)
        cached = sum(s.kv_bytes for s in tree.segments() if s.cached)
        assert tree.accounts.total.held == live == sum(r.held for r in runs)
        assert tree.accounts.cache.held == cached
        assert tree.accounts.total.nodes + tree.accounts.cache.nodes == len(tree)

    check()
    tree.release(prompt.id)
    check()
    tree.release(kids[0].id)
    check()
    tree.match([1, 2, 3, 4, 0])
    check()
    tree.release(kids[1].id)
    check()
    assert tree.accounts.total.held == 0 and tree.accounts.cache.held == 5 * SLOT_BYTES
    tree.prefix.budget = 0
    tree.trim()
    check()
    assert len(tree) == 0 and tree.accounts.cache.nodes == 0 and tree.accounts.total.nodes == 0
    assert runs[0].peak == 4 * SLOT_BYTES and runs[1].peak == SLOT_BYTES
