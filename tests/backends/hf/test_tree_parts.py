"""The parts the KV tree composes, each on its own: the accounts, the prefix cache's index and LRU
order, and the shared-block store.

Why apart from tests/backends/hf/test_kvtree.py (which checks them through the tree): each part
keeps one rule that the tree relies on, and a broken rule is easier to read here than as a wrong
byte count three operations later.
"""

from __future__ import annotations

import torch

from branchwise.backends.hf.ledger import Accounts, Ledger
from branchwise.backends.hf.prefix_cache import PrefixCache
from branchwise.backends.hf.segment import BlockStore, Segment


def _seg(sid: int, tokens: list[int], parent: Segment | None = None, owner: Ledger | None = None) -> Segment:
    seg = Segment(
        id=sid, parent=parent, shares_parent=parent is not None, tokens=tokens, owner=owner or Ledger()
    )
    seg.n_computed = len(tokens)
    seg.keys = [torch.zeros(1, len(tokens), 2)]
    seg.values = [torch.zeros(1, len(tokens), 2)]
    return seg


def test_a_run_charges_itself_and_the_total_and_a_move_to_the_cache_leaves_the_total() -> None:
    accounts = Accounts()
    run = Ledger()
    accounts.charge(run, 100)
    accounts.count(run, 1)
    assert (run.held, accounts.total.held, accounts.cache.held) == (100, 100, 0)
    accounts.move(100, run, accounts.cache)
    assert (run.held, run.nodes, accounts.total.held, accounts.total.nodes) == (0, 0, 0, 0)
    assert (accounts.cache.held, accounts.cache.nodes) == (100, 1)
    assert run.peak == accounts.total.peak == 100


def test_a_transient_buffer_raises_peaks_but_holds_nothing() -> None:
    accounts = Accounts()
    run = Ledger()
    accounts.charge(run, 10)
    accounts.note_transient(run, 50)
    assert (run.held, run.peak, accounts.total.peak) == (10, 60, 60)


def test_lookup_says_how_far_into_a_node_the_match_ends() -> None:
    cache = PrefixCache(budget=1 << 20, min_split=1)
    root = _seg(0, [1, 2, 3, 4])
    kid = _seg(1, [5, 6, 7], parent=root)
    cache.insert(root)
    cache.insert(kid)
    assert cache.lookup([1, 2, 3, 4, 5, 6, 9, 9]) == (kid, 6, 2)
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == (kid, 7, 0)  # takes the node whole
    assert cache.lookup([1, 2, 3, 4]) == (root, 3, 3)  # never the last token: it needs logits
    assert cache.lookup([9, 1]) == (None, 0, 0)


def test_a_match_too_short_to_pay_for_a_split_ends_at_the_node_above() -> None:
    """A match ending inside a node splits it only when it takes `min_split` of its tokens; a
    whole node is always taken, however short."""
    cache = PrefixCache(budget=1 << 20, min_split=3)
    root = _seg(0, [1, 2])
    kid = _seg(1, [5, 6, 7, 8], parent=root)
    cache.insert(root)
    cache.insert(kid)
    assert cache.lookup([1, 2, 5, 6, 9]) == (root, 2, 0)  # 2 of kid's tokens: no split
    assert cache.lookup([1, 2, 5, 6, 7, 9]) == (kid, 5, 3)  # 3: split
    assert cache.lookup([1, 9, 9]) == (None, 0, 0)  # 1 of root's: nothing
    assert cache.lookup([1, 2, 9]) == (root, 2, 0)  # the whole (short) root


def test_an_inexact_node_is_neither_admitted_nor_matched() -> None:
    cache = PrefixCache(budget=1 << 20)
    seg = _seg(0, [1, 2, 3])
    seg.exact = False
    assert not cache.admits(seg)
    cache.insert(seg)  # even if it were indexed, a lookup skips it
    assert cache.lookup([1, 2, 3, 4]) == (None, 0, 0)


def test_a_cache_without_budget_admits_and_matches_nothing() -> None:
    cache = PrefixCache(budget=0)
    seg = _seg(0, [1, 2, 3])
    assert not cache.admits(seg)
    cache.roots[seg.id] = seg
    assert cache.lookup([1, 2, 3, 4]) == (None, 0, 0)


def test_the_victim_is_the_least_recently_used_unpinned_leaf_and_none_within_budget() -> None:
    cache = PrefixCache(budget=100)
    old, new = _seg(0, [1]), _seg(1, [2])
    cache.insert(old)
    cache.insert(new)
    assert cache.victim(held=100) is None
    assert cache.victim(held=101) is old
    cache.touch(old)
    assert cache.victim(held=101) is new
    assert cache.victim(held=50, limit=10) is new  # the pool asks for less than the budget
    new.live_children = old.live_children = 1  # pinned by live requests
    assert cache.victim(held=101) is None


def test_replace_puts_the_split_head_in_the_node_s_place_and_the_node_under_it() -> None:
    cache = PrefixCache(budget=1 << 20)
    seg = _seg(0, [1, 2, 3, 4])
    cache.insert(seg)
    head = _seg(1, [1, 2])
    cache.replace(seg, head)
    assert cache.roots == {1: head} and head.cache_kids == {0: seg} and head.cached


def test_a_block_is_freed_with_its_last_reference_and_its_bytes_return_once() -> None:
    accounts = Accounts()
    run = Ledger()
    store = BlockStore(accounts)
    block = store.seal([torch.zeros(1, 4, 2)], [torch.zeros(1, 4, 2)], run)
    assert run.held == block.nbytes and store.live == 1
    a, b = _seg(0, [1, 2, 3, 4]), _seg(1, [1, 2, 3, 4])
    store.ref(a, 0, block)
    store.ref(b, 0, block)
    assert not a.exact and not b.exact  # a node reading a block is lossy: never cached or split
    store.unref_all(a)
    assert store.live == 1 and run.held == block.nbytes and a.blocks == []
    store.unref_all(b)
    assert store.live == 0 and run.held == 0 and accounts.total.held == 0
