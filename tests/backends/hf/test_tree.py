"""The KV segment tree on its own: ref counts, splits, freeing and byte ledgers (no model)."""

from __future__ import annotations

import pytest
import torch

from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.segment import common_prefix, common_suffix
from branchwise.backends.hf.tree import KVTree


def _kv(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    keys = [torch.arange(2 * n * 4, dtype=torch.float32).view(2, n, 4) for _ in range(3)]
    return keys, [k + 0.5 for k in keys]


def test_children_freeze_and_free_their_parent() -> None:
    tree = KVTree()
    run = Ledger()
    root = tree.add(None, False, [1, 2, 3], run)
    tree.set_kv(root, *_kv(3))
    root.n_computed = 3
    a = tree.add(root, True, [4], run)
    b = tree.add(root, True, [5, 6], run)
    assert root.live_children == 2 and tree.path_tokens(b) == [1, 2, 3, 5, 6]
    with pytest.raises(ValueError, match="frozen"):
        tree.growable(root.id)
    assert tree.release(root.id) == []  # still read by its children
    assert [s.id for s in tree.release(a.id)] == [a.id]
    assert {s.id for s in tree.release(b.id)} == {b.id, root.id}
    assert len(tree) == 0 and run.held == 0 and run.nodes == 0 and tree.accounts.total.held == 0
    with pytest.raises(KeyError):
        tree.release(root.id)


def test_split_moves_kv_into_a_new_parent() -> None:
    tree = KVTree()
    run = Ledger()
    root = tree.add(None, False, [1, 2, 3, 4], run)
    keys, values = _kv(4)
    tree.set_kv(root, keys, values)
    root.n_computed = 4
    held = run.held
    seen = []
    head = tree.prefix_node(root, 2, lambda h, rest, k: seen.append((h.id, rest.id, k)))
    assert seen == [(head.id, root.id, 2)]
    assert head.tokens == [1, 2] and root.tokens == [3, 4] and root.parent is head and root.shares_parent
    assert tree.path_tokens(root) == [1, 2, 3, 4]
    torch.testing.assert_close(torch.cat([head.keys[0], root.keys[0]], dim=1), keys[0])
    assert run.held == held  # the same bytes, in two segments
    assert tree.prefix_node(root, 2) is head and tree.prefix_node(root, 4) is root


def test_ledgers_count_per_owner_and_in_total() -> None:
    tree = KVTree()
    a, b = Ledger(), Ledger()
    x = tree.add(None, False, [1], a)
    y = tree.add(None, False, [1, 2], b)
    tree.set_kv(x, *_kv(1))
    tree.set_kv(y, *_kv(2))
    assert a.held * 2 == b.held and tree.accounts.total.held == a.held + b.held
    assert (a.nodes, b.nodes, tree.accounts.total.nodes) == (1, 1, 2)
    tree.accounts.note_transient(a, 100)
    assert a.peak == a.held + 100 and b.peak == b.held
    tree.keep_kv(y, torch.tensor([True, False]))
    assert b.held == a.held and b.peak == 2 * a.held


def test_common_prefix_and_suffix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_suffix([1, 2, 3], [0, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_ended_rows_and_then_their_unread_prompt_free_their_kv_for_a_recompute() -> None:
    """`free_idle` frees a node's KV only where recomputing gives it back (exact, nothing evicted)
    and no other node holds KV computed after it: an ended row first, its prompt once no row
    that holds KV reads it. The nodes keep their tokens, all pending again."""
    tree, run = KVTree(), Ledger()
    root = tree.add(None, False, [1, 2, 3], run)
    tree.set_kv(root, *_kv(3))
    root.n_computed = 3
    rows = [tree.add(root, True, [4 + i, 9], run) for i in range(3)]
    for row in rows:
        tree.set_kv(row, *_kv(1))  # an ended row: its last token sampled, not fed
        row.n_computed = 1
    rows[1].exact = False  # an acceleration touched it: a recompute would not give it back
    rows[2].lent = True  # decoding in a batch
    per_row, prompt = rows[0].kv_bytes, root.kv_bytes
    assert tree.free_idle([r.id for r in rows], 10**9) == [per_row]  # the others are read or lent
    assert rows[0].kv_bytes == 0 and rows[0].pending == [4, 9] and root.kv_bytes == prompt
    rows[1].exact, rows[2].lent = True, False
    assert tree.free_idle([rows[1].id], 1) == [per_row]  # enough: the rest stays
    assert tree.free_idle([rows[2].id], 10**9) == [per_row, prompt]  # its last reader went
    assert root.pending == [1, 2, 3] and tree.accounts.total.held == 0
    assert len(tree) == 4  # every node stays, for its tokens
