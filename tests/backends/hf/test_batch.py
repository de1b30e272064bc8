"""`Batch`: rows assembled from tree segments, attention over tails + shared ancestors, capture back.

Why direct tensor tests: the backend tests check tokens end to end, which says little when a
single slot lands in the wrong place (a wrong row reading a shared segment, a tail offset after a
copied ancestor, a slot kept after an eviction). Here every configuration is checked against the
definition: each row's attention equals plain attention over its whole path's KV (ancestors, own
tokens, this forward's new ones), and what `capture` writes back is exactly the row's own KV. No
model: `DecoderParts` only supplies the geometry.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import AttentionTap, Batch, Broadcast
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.tree import KVTree

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 8
SCALE = DIM**-0.5
CPU = torch.device("cpu")
PARTS = DecoderParts(
    embed=nn.Identity(), layers=nn.ModuleList([nn.Identity() for _ in range(LAYERS)]),
    rotary=nn.Identity(), norm=nn.Identity(), head=nn.Identity(),
    n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=DIM,
)  # fmt: skip


class Recorder(AttentionTap):
    """A tap that asks for the explicit-softmax path and records what the batch tells taps."""

    def __init__(self, wants_weights: bool = False) -> None:
        self.wants_weights = wants_weights
        self.events: list[tuple[str, object]] = []

    def on_weights(self, layer: int, weights: object) -> None:
        self.events.append(("weights", layer))

    def select_rows(self, keep: torch.Tensor) -> None:
        self.events.append(("select", keep.tolist()))

    def grow(self, capacity: int) -> None:
        self.events.append(("grow", capacity))

    def move_slots(self, pos: int, start: int, index: torch.Tensor) -> None:
        self.events.append(("move", (pos, start, index.tolist())))


def _node(
    tree: KVTree, parent: Segment | None, tokens: list[int], run: Ledger, computed: int, gen: torch.Generator
) -> Segment:
    """A node with random KV for its first `computed` tokens (the rest pending)."""
    seg = tree.add(parent, parent is not None, tokens, run)
    if computed:
        shape = (KV_HEADS, computed, DIM)
        tree.set_kv(
            seg,
            [torch.randn(shape, generator=gen) for _ in range(LAYERS)],
            [torch.randn(shape, generator=gen) for _ in range(LAYERS)],
        )
    seg.n_computed = computed
    return seg


def _forest(seed: int = 0) -> tuple[KVTree, Ledger, dict[str, Segment]]:
    """A prompt (6 tokens) with a mid node (3) and three branches, plus an unrelated request:

    prompt ─┬─ a   (2 computed + 1 pending)
            ├─ b   (1 pending)
            └─ mid ── c (1 computed + 1 pending)
    other: a root of its own (2 computed + 1 pending)
    """
    gen = torch.Generator().manual_seed(seed)
    tree, run = KVTree(), Ledger()
    prompt = _node(tree, None, list(range(6)), run, 6, gen)
    nodes = {
        "prompt": prompt,
        "a": _node(tree, prompt, [10, 11, 12], run, 2, gen),
        "b": _node(tree, prompt, [20], run, 0, gen),
        "mid": _node(tree, prompt, [7, 8, 9], run, 3, gen),
        "other": _node(tree, None, [30, 31, 32], run, 2, gen),
    }
    nodes["c"] = _node(tree, nodes["mid"], [40, 41], run, 1, gen)
    return tree, run, nodes


def _path_kv(seg: Segment, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`[H_kv, n, D]` KV of the segment's whole path (root first), as the tree holds it."""
    chain = [*reversed(seg.kv_ancestors()), seg]
    held = [s for s in chain if s.kv_tokens]
    if not held:
        return torch.zeros(KV_HEADS, 0, DIM), torch.zeros(KV_HEADS, 0, DIM)
    return (
        torch.cat([s.keys[layer] for s in held], dim=1),
        torch.cat([s.values[layer] for s in held], dim=1),
    )


def _reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q: int) -> torch.Tensor:
    """Plain attention of one row: query `[H, q, D]` over `[H_kv, T, D]` whose last q are new
    (causal among them). Returns `[q, H, D]`."""
    k = keys.repeat_interleave(HEADS // KV_HEADS, 0)
    v = values.repeat_interleave(HEADS // KV_HEADS, 0)
    t = k.shape[1]
    mask = torch.ones(q, t, dtype=torch.bool)
    mask[:, t - q :] = torch.tril(torch.ones(q, q, dtype=torch.bool))
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=SCALE)
    return out.transpose(0, 1)


def _forward(batch: Batch, q: int, seed: int = 1) -> list[tuple[torch.Tensor, ...]]:
    """One forward of `q` random tokens per row through every layer: per layer (out, query, key,
    value), out `[B, q, H, D]`."""
    gen = torch.Generator().manual_seed(seed)
    b = batch.ctx.batch
    batch.ctx.begin(q)
    steps = []
    for layer in range(LAYERS):
        query = torch.randn(b, HEADS, q, DIM, generator=gen)
        key = torch.randn(b, KV_HEADS, q, DIM, generator=gen)
        value = torch.randn(b, KV_HEADS, q, DIM, generator=gen)
        steps.append((batch.ctx.attend(layer, query, key, value, SCALE), query, key, value))
    batch.ctx.lens = batch.ctx.lens + q  # what the runner does after every forward
    batch.ctx.pos_next = batch.ctx.pos_next + q
    return steps


def _check_against_paths(batch: Batch, q: int, seed: int = 1, segs: list[Segment] | None = None) -> None:
    """Each row's attention equals plain attention over its path's KV as the tree holds it."""
    segs = segs if segs is not None else [r.seg for r in batch.rows]
    for layer, (out, query, key, value) in enumerate(_forward(batch, q, seed)):
        for i, seg in enumerate(segs):
            k, v = _path_kv(seg, layer)
            ref = _reference(query[i], torch.cat([k, key[i]], 1), torch.cat([v, value[i]], 1), q)
            torch.testing.assert_close(out[i], ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# assembly
# --------------------------------------------------------------------------------------------------


def test_cascade_puts_own_kv_in_the_tails_and_reads_ancestors_once() -> None:
    _, _, n = _forest()
    segs = [n["a"], n["b"], n["c"], n["other"]]
    batch = Batch.assemble(segs, extra=3, parts=PARTS, dtype=torch.float32, device=CPU)
    ctx = batch.ctx
    assert [r.tail_start for r in batch.rows] == [0, 0, 0, 0]
    assert ctx.lens.tolist() == [2, 0, 1, 2] and [r.kv_len for r in batch.rows] == [2, 0, 1, 2]
    assert batch.feeds == [[12], [20], [41], [32]]
    assert ctx.pos_next.tolist() == [8, 6, 10, 2]  # logical: ancestors' tokens + own computed
    assert ctx.capacity == 2 + 1 + 3 and ctx.n_groups == HEADS // KV_HEADS
    torch.testing.assert_close(ctx.kv.keys[1][0, :, :2], n["a"].keys[1])
    torch.testing.assert_close(ctx.kv.values[0][3, :, :2], n["other"].values[0])
    assert not ctx.kv.keys[0][1].any()  # b holds nothing yet: zeros, never garbage
    readers = {s.key: (None if s.rows is None else s.rows.tolist()) for s in ctx.shared}
    assert readers == {n["prompt"].id: [0, 1, 2], n["mid"].id: [2]}
    assert ctx.shared[0].keys[0] is n["prompt"].keys[0]  # read in place, not copied
    _check_against_paths(batch, 1)


def test_an_ancestor_every_row_reads_is_shared_with_all_rows() -> None:
    _, _, n = _forest()
    batch = Batch.assemble([n["a"], n["b"]], extra=0, parts=PARTS, dtype=torch.float32, device=CPU)
    assert [(s.key, s.rows) for s in batch.ctx.shared] == [(n["prompt"].id, None)]
    _check_against_paths(batch, 1)


@pytest.mark.parametrize("q", [1, 3])
def test_copy_broadcast_lays_each_rows_path_in_its_tail(q: int) -> None:
    _, _, n = _forest()
    segs = [n["a"], n["b"], n["c"], n["other"]]
    batch = Batch.assemble(segs, extra=0, parts=PARTS, dtype=torch.float32, device=CPU, broadcast="copy")
    ctx = batch.ctx
    assert ctx.shared == []
    assert [r.tail_start for r in batch.rows] == [6, 6, 9, 0]
    assert ctx.lens.tolist() == [8, 6, 10, 2]
    for i, seg in enumerate(segs):
        k, _ = _path_kv(seg, 1)
        torch.testing.assert_close(ctx.kv.keys[1][i, :, : k.shape[1]], k)
    _check_against_paths(batch, q)


def test_short_paths_are_copied_and_the_bound_is_on_the_whole_path() -> None:
    """copy_tokens=6: the 6-token prompt is copied into c's tail; mid (path 9) stays shared."""
    _, _, n = _forest()
    batch = Batch.assemble(
        [n["c"], n["a"]], extra=0, parts=PARTS, dtype=torch.float32, device=CPU, copy_tokens=6
    )
    assert [r.tail_start for r in batch.rows] == [6, 6]
    assert [(s.key, s.rows.tolist()) for s in batch.ctx.shared] == [(n["mid"].id, [0])]
    _check_against_paths(batch, 2)


def test_limit_feeds_one_chunk_and_reserve_is_told_the_tail_bytes_first() -> None:
    tree, run = KVTree(), Ledger()
    prompt = tree.add(None, False, list(range(10)), run)  # nothing computed: a prompt to prefill
    told: list[int] = []
    batch = Batch.assemble(
        [prompt], extra=0, parts=PARTS, dtype=torch.float32, device=CPU, limit=4, reserve=told.append
    )
    assert batch.feeds == [[0, 1, 2, 3]] and batch.ctx.capacity == 4
    assert told == [batch.ctx.nbytes] == [2 * LAYERS * KV_HEADS * 4 * DIM * 4]

    def refuse(nbytes: int) -> None:
        raise MemoryError(f"{nbytes} bytes over the budget")

    with pytest.raises(MemoryError):
        Batch.assemble([prompt], extra=0, parts=PARTS, dtype=torch.float32, device=CPU, reserve=refuse)


# --------------------------------------------------------------------------------------------------
# attention paths agree
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("broadcast", ["cascade", "copy"])
def test_the_explicit_softmax_path_gives_the_same_attention(broadcast: Broadcast) -> None:
    _, _, n = _forest()
    segs = [n["a"], n["b"], n["c"]]
    tap = Recorder(wants_weights=True)
    batch = Batch.assemble(segs, extra=0, parts=PARTS, dtype=torch.float32, device=CPU, broadcast=broadcast)
    batch.ctx.taps.append(tap)
    _check_against_paths(batch, 2)
    assert [e for e in tap.events if e[0] == "weights"] == [("weights", 0), ("weights", 1)]


def test_fresh_tails_take_the_plain_causal_path() -> None:
    """Every row starts empty (uniform length 0): a prompt's first chunk under shared ancestors."""
    tree, _, n = _forest()
    gen = torch.Generator().manual_seed(3)
    fresh = [_node(tree, n["prompt"], [50, 51, 52], Ledger(), 0, gen) for _ in range(2)]
    batch = Batch.assemble(fresh, extra=0, parts=PARTS, dtype=torch.float32, device=CPU)
    assert batch.ctx.lens.tolist() == [0, 0]
    _check_against_paths(batch, 3)


# --------------------------------------------------------------------------------------------------
# decoding: growth, rows leaving, eviction, capture
# --------------------------------------------------------------------------------------------------


def test_tails_grow_when_full_and_keep_what_they_hold() -> None:
    _, _, n = _forest()
    batch = Batch.assemble([n["a"]], extra=0, parts=PARTS, dtype=torch.float32, device=CPU)
    tap = Recorder()
    batch.ctx.taps.append(tap)
    before = batch.ctx.kv.keys[0][0, :, :2].clone()
    assert batch.ctx.capacity == 3
    batch.ctx.lens = torch.tensor([3])  # the row filled its tail
    batch.ctx.begin(2)
    assert batch.ctx.capacity == 3 + 128 and tap.events == [("grow", 131)]
    torch.testing.assert_close(batch.ctx.kv.keys[0][0, :, :2], before)


def test_rows_leaving_keep_the_rest_reading_the_right_ancestors() -> None:
    _, _, n = _forest()
    segs = [n["a"], n["c"], n["other"], n["b"]]
    batch = Batch.assemble(segs, extra=2, parts=PARTS, dtype=torch.float32, device=CPU)
    tap = Recorder()
    batch.ctx.taps.append(tap)
    keep = torch.tensor([1, 2])  # c and other stay; a and b leave
    batch.ctx.select_rows(keep, {1: 0, 2: 1})
    kept = [segs[1], segs[2]]
    assert batch.ctx.lens.tolist() == [1, 2] and batch.ctx.pos_next.tolist() == [10, 2]
    readers = {s.key: s.rows.tolist() for s in batch.ctx.shared}
    assert readers == {n["prompt"].id: [0], n["mid"].id: [0]}
    assert tap.events == [("select", [1, 2])]
    _check_against_paths(batch, 1, segs=kept)
    batch.ctx.select_rows(torch.tensor([1]), {1: 0})  # only `other`: no shared segment is left
    assert batch.ctx.shared == [] and batch.ctx.lens.tolist() == [3]


def test_capture_writes_back_exactly_the_rows_own_kv() -> None:
    tree, run, n = _forest()
    segs = [n["a"], n["c"]]
    old_a = [k.clone() for k in n["a"].keys]
    batch = Batch.assemble(segs, extra=4, parts=PARTS, dtype=torch.float32, device=CPU, broadcast="copy")
    steps = _forward(batch, 1)
    batch.advance([0, 1], batch.feeds)
    assert [(r.kv_len, r.computed) for r in batch.rows] == [(3, 3), (2, 2)]
    held = run.held
    for pos, row in enumerate(batch.rows):
        batch.capture(tree, pos, row)
    a, c = n["a"], n["c"]
    assert a.n_computed == 3 and a.pending == [] and a.kv_tokens == 3 and c.kv_tokens == 2
    assert all(r.captured for r in batch.rows)
    for layer in range(LAYERS):
        torch.testing.assert_close(a.keys[layer], torch.cat([old_a[layer], steps[layer][2][0]], 1))
        torch.testing.assert_close(c.values[layer][:, 1:], steps[layer][3][1])
    slot = 2 * LAYERS * KV_HEADS * DIM * 4
    assert run.held == held + 2 * slot and tree.accounts.total.held == run.held
    batch.ctx.kv.keys[0].zero_()
    assert a.keys[0].abs().sum() > 0  # independent tensors: the batch's buffers may go


def test_an_eviction_mid_decode_moves_slots_and_positions_stay_logical() -> None:
    tree, _, n = _forest()
    batch = Batch.assemble([n["a"], n["other"]], extra=2, parts=PARTS, dtype=torch.float32, device=CPU)
    tap = Recorder()
    batch.ctx.taps.append(tap)
    _forward(batch, 1)
    batch.advance([0, 1], batch.feeds)
    row = batch.rows[0]
    own = batch.ctx.kv.keys[0][0, :, :3].clone()
    batch.keep_own(0, row, torch.tensor([0, 2]))  # evict the row's second slot
    assert row.kv_len == 2 and row.computed == 3 and batch.ctx.lens.tolist() == [2, 3]
    assert tap.events == [("move", (0, 0, [0, 2]))]
    torch.testing.assert_close(batch.ctx.kv.keys[0][0, :, :2], own[:, [0, 2]])
    batch.capture(tree, 0, row)
    assert n["a"].kv_tokens == 2 and n["a"].n_computed == 3 and n["a"].position == 9


def test_evicting_under_copy_broadcast_leaves_the_copied_ancestors_alone() -> None:
    _, _, n = _forest()
    batch = Batch.assemble([n["a"]], extra=0, parts=PARTS, dtype=torch.float32, device=CPU, broadcast="copy")
    prompt_copy = batch.ctx.kv.keys[0][0, :, :6].clone()
    row = batch.rows[0]
    batch.keep_own(0, row, torch.tensor([1]))
    assert row.kv_len == 1 and batch.ctx.lens.tolist() == [7]
    torch.testing.assert_close(batch.ctx.kv.keys[0][0, :, :6], prompt_copy)
    torch.testing.assert_close(batch.ctx.kv.keys[0][0, :, 6], n["a"].keys[0][:, 1])


# --------------------------------------------------------------------------------------------------
# shared blocks: one layout per batch, read through each row's table
# --------------------------------------------------------------------------------------------------


def test_pointing_a_row_at_a_sealed_block_changes_nothing_it_attends_to() -> None:
    tree, run, n = _forest()
    batch = Batch.assemble([n["a"], n["b"]], extra=4, parts=PARTS, dtype=torch.float32, device=CPU)
    _forward(batch, 1, seed=5)
    batch.advance([0, 1], batch.feeds)
    row = batch.rows[0]
    full = [batch.ctx.kv.keys[layer][0, :, :3].clone() for layer in range(LAYERS)]
    block = batch.seal(tree, 0, row, slot=0, n=2)
    assert block.refs == 0 and block.owner is run and tree.blocks.live == 1
    torch.testing.assert_close(block.keys[1], full[1][:, :2])
    batch.point_at(tree, 0, row, slot=0, logical=0, block=block)
    assert block.refs == 1 and row.kv_len == 1 and row.computed == 3 and batch.ctx.lens.tolist() == [1, 1]
    pool = batch.ctx.pool
    assert pool is not None and pool.slots == {block.id: 0} and pool.used == 2
    assert pool.table[:, :2].tolist() == [[True, True], [False, False]]
    shared = pool.segment()
    assert shared is not None and shared.rows.tolist() == [0] and shared.key < 0
    # the next forward reads the block through the pool: as if its slots were still in the tail
    gen = torch.Generator().manual_seed(7)
    batch.ctx.begin(1)
    query = torch.randn(2, HEADS, 1, DIM, generator=gen)
    key = torch.randn(2, KV_HEADS, 1, DIM, generator=gen)
    value = torch.randn(2, KV_HEADS, 1, DIM, generator=gen)
    tail_v = batch.ctx.kv.values[0][0, :, :1].clone()
    out = batch.ctx.attend(0, query, key, value, SCALE)
    pk, pv = _path_kv(n["prompt"], 0)
    keys = torch.cat([pk, block.keys[0], full[0][:, 2:], key[0]], 1)
    values = torch.cat([pv, block.values[0], tail_v, value[0]], 1)
    torch.testing.assert_close(out[0], _reference(query[0], keys, values, 1), atol=1e-5, rtol=1e-5)


def test_a_block_is_laid_out_once_however_many_rows_read_it() -> None:
    tree, run, n = _forest()
    block = tree.seal_own(n["a"], slot=0, logical=0, n=2)  # a holds nothing of its own any more
    gen = torch.Generator().manual_seed(9)
    reader = _node(tree, n["prompt"], [10, 11, 13], run, 0, gen)
    reader.n_computed = 2
    tree.blocks.ref(reader, 0, block)
    batch = Batch.assemble([n["a"], n["b"], reader], extra=1, parts=PARTS, dtype=torch.float32, device=CPU)
    pool = batch.ctx.pool
    assert pool is not None and pool.used == block.tokens == 2 and list(pool.slots) == [block.id]
    assert pool.table[:, :2].tolist() == [[True, True], [False, False], [True, True]]
    assert batch.ctx.lens.tolist() == [0, 0, 0] and batch.ctx.pos_next.tolist() == [8, 6, 8]
    torch.testing.assert_close(pool.keys[1][:, :2], block.keys[1])
    batch.ctx.select_rows(torch.tensor([1, 2]), {1: 0, 2: 1})
    assert pool.table[:, :2].tolist() == [[False, False], [True, True]]
    assert pool.segment() is not None and pool.segment().rows.tolist() == [1]
