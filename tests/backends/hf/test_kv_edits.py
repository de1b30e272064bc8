"""`KVEdits`, the Host's KV edits: an edit of a branch's KV keeps the tree, a running row's tail and
a batch's shared view of a segment consistent (no model: tree and batch on a tiny model's shapes)."""

from __future__ import annotations

import torch

from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.batch import Batch
from branchwise.backends.hf.hooks import KVEdits
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.tree import KVTree


def _fill(tree: KVTree, seg: Segment, backend: HFBackend, start: float) -> None:
    """Distinct KV for every slot of `seg`, so a moved slot is recognisable."""
    parts, n = backend.parts, len(seg.tokens)
    shape = (parts.n_kv_heads, n, parts.head_dim)
    keys = [
        start + torch.arange(n, dtype=backend.dtype)[None, :, None].expand(shape).clone()
        for _ in range(parts.n_layers)
    ]
    tree.set_kv(seg, keys, [k + 0.5 for k in keys])
    seg.n_computed = n


def test_keep_evicts_in_the_tree_and_in_the_view_of_a_batch_reading_it(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    tree, run = KVTree(), Ledger()
    root = tree.add(None, False, [1, 2, 3], run)
    _fill(tree, root, backend, 0.0)
    mid = tree.add(root, True, [4, 5, 6, 7], run)
    _fill(tree, mid, backend, 10.0)
    kid = tree.add(mid, True, [8], run)
    batch = Batch.assemble([kid], 0, backend.parts, backend.dtype, backend.device)
    held = run.held
    edits = KVEdits(tree)
    edits.keep(mid, torch.tensor([0, 2]), batch)
    assert mid.kv_tokens == 2 and mid.n_computed == 4 and not mid.exact  # positions stay logical
    assert run.held < held
    (view,) = [s for s in batch.ctx.shared if s.key == mid.id]
    assert view.keys[0][0, :, 0].tolist() == [10.0, 12.0]
    edits.keep(mid, torch.tensor([], dtype=torch.long), batch)
    assert mid.kv_tokens == 0 and [s.key for s in batch.ctx.shared] == [root.id]


def test_keep_row_moves_the_tail_and_own_kv_reads_it(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    tree, run = KVTree(), Ledger()
    root = tree.add(None, False, [1, 2], run)
    _fill(tree, root, backend, 0.0)
    kid = tree.add(root, True, [3, 4, 5, 6], run)
    _fill(tree, kid, backend, 20.0)
    batch = Batch.assemble([kid], 0, backend.parts, backend.dtype, backend.device)
    (row,) = batch.rows
    KVEdits(tree).keep_row(batch, 0, row, torch.tensor([1, 3]))
    assert row.kv_len == 2 and row.computed == 4
    keys, values = batch.own_kv(0, row)
    assert keys[0][0, :, 0].tolist() == [21.0, 23.0] and values[0][0, :, 0].tolist() == [21.5, 23.5]


def test_per_head_keeps_gather_each_heads_own_slots(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    parts = backend.parts
    tree, run = KVTree(), Ledger()
    root = tree.add(None, False, [1, 2], run)
    _fill(tree, root, backend, 0.0)
    mid = tree.add(root, True, [3, 4, 5, 6], run)
    _fill(tree, mid, backend, 10.0)
    kid = tree.add(mid, True, [7, 8, 9, 10], run)
    _fill(tree, kid, backend, 20.0)
    batch = Batch.assemble([kid], 0, parts, backend.dtype, backend.device)
    (row,) = batch.rows
    heads = parts.n_kv_heads
    assert heads >= 2
    # head h keeps slots (h % 3, 3): different slots per head, the same count
    keep = torch.tensor([[h % 3, 3] for h in range(heads)])[None].expand(parts.n_layers, -1, -1)
    edits = KVEdits(tree)
    edits.keep_row_per_head(batch, 0, row, keep)
    assert row.kv_len == 2 and row.computed == 4 and int(batch.ctx.lens[0]) == row.tail_start + 2
    keys, values = batch.own_kv(0, row)
    assert keys[0].shape == (heads, 2, parts.head_dim)
    assert keys[-1][:, :, 0].tolist() == [[20.0 + h % 3, 23.0] for h in range(heads)]
    assert values[0][1, :, 0].tolist() == [21.5, 23.5]
    held = run.held
    edits.keep_per_head(mid, keep, batch)
    assert mid.kv_tokens == 2 and mid.n_computed == 4 and not mid.exact and run.held < held
    (view,) = [s for s in batch.ctx.shared if s.key == mid.id]
    assert view.keys[0][:, :, 0].tolist() == [[10.0 + h % 3, 13.0] for h in range(heads)]
