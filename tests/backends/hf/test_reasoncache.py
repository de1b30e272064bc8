"""ReasonCache: ref-counted shared blocks in the tree, attention through the block table, the
filter's formulas on hand-made inputs, lossless forced reuse, and composition."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from branchwise.backends.accel import Accel, ReasonCacheConfig, RSBCMConfig, SkipKVConfig
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.attention import SharedSegment, fused_attention, fused_cascade
from branchwise.backends.hf.block_pool import BlockPool
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.reasoncache import ReasonCache, StepBoundaries
from branchwise.backends.hf.reasoncache_filter import (
    BlockNorms,
    PercentileThreshold,
    block_distance,
    dynamic_tau,
    formal_trees,
    lexical_similarity,
    structurally_equal,
    tree_edit_distance,
)
from branchwise.backends.hf.tree import KVTree

# ---------------------------------------------------------------------------------------------- tree


def _kv(layers: int = 2, tokens: int = 4, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return (
        [torch.randn(2, tokens, 8, generator=g) for _ in range(layers)],
        [torch.randn(2, tokens, 8, generator=g) for _ in range(layers)],
    )


def test_block_is_freed_exactly_when_its_last_reference_goes() -> None:
    tree = KVTree()
    run = Ledger()
    a = tree.add(None, False, [1, 2, 3, 4], run)
    b = tree.add(None, False, [1, 2, 3, 4], run)
    block = tree.blocks.seal(*_kv(), run)
    nbytes = block.nbytes
    assert run.held == nbytes and tree.accounts.total.held == nbytes and tree.blocks.live == 1
    tree.blocks.ref(a, 0, block)
    tree.blocks.ref(b, 0, block)
    assert block.refs == 2 and not a.exact
    tree.release(a.id)
    assert block.refs == 1 and block.keys and run.held == nbytes and tree.blocks.live == 1
    tree.release(b.id)
    assert block.refs == 0 and not block.keys and run.held == 0 and tree.accounts.total.held == 0
    assert tree.blocks.live == 0


def test_ref_count_never_goes_negative() -> None:
    tree = KVTree()
    run = Ledger()
    a = tree.add(None, False, [1], run)
    block = tree.blocks.seal(*_kv(), run)
    tree.blocks.ref(a, 0, block)
    a.blocks.append((4, block))  # a corrupt table: the block is listed twice but counted once
    with pytest.raises(AssertionError, match="lost more references"):
        tree.release(a.id)


def test_seal_own_moves_a_nodes_slots_into_a_block_it_references() -> None:
    tree = KVTree()
    run = Ledger()
    seg = tree.add(None, False, list(range(6)), run)
    keys, values = _kv(tokens=6)
    tree.set_kv(seg, keys, values)
    seg.n_computed = 6
    held = run.held
    block = tree.seal_own(seg, 2, 2, 3)
    assert run.held == held and tree.accounts.total.held == held  # moved, not copied
    assert seg.kv_tokens == 3 and seg.blocks == [(2, block)] and block.refs == 1
    assert torch.equal(block.keys[1], keys[1][:, 2:5]) and torch.equal(seg.values[0][:, 2:], values[0][:, 5:])
    tree.release(seg.id)
    assert run.held == 0 and tree.blocks.live == 0


def test_a_node_with_shared_blocks_is_never_split() -> None:
    tree = KVTree()
    run = Ledger()
    seg = tree.add(None, False, list(range(8)), run)
    keys, values = _kv(tokens=4)
    tree.set_kv(seg, keys, values)
    seg.n_computed = 8
    tree.blocks.ref(seg, 4, tree.blocks.seal(*_kv(seed=1), run))
    with pytest.raises(RuntimeError, match="shared by blocks"):
        tree.prefix_node(seg, 2)


# ---------------------------------------------------------------------------------------------- attention


def test_attention_through_the_block_table_equals_attention_over_the_concatenated_blocks() -> None:
    torch.manual_seed(0)
    b, h, h_kv, d, own = 3, 4, 2, 8, 5
    blocks_kv = [_kv(layers=1, tokens=4, seed=s) for s in range(3)]

    class _Block:
        def __init__(self, i: int) -> None:
            self.id, self.keys, self.values = i, blocks_kv[i][0], blocks_kv[i][1]
            self.tokens = 4

    blocks = [_Block(i) for i in range(3)]
    table = {0: [0, 2], 1: [], 2: [1, 2, 0]}  # row 1 reads no block at all
    pool = BlockPool.empty(torch.zeros(b, h_kv, 1, d), n_layers=1, batch=b)
    for row, ids in table.items():
        for i in ids:
            pool.point(row, blocks[i])
    query = torch.randn(b, h, 1, d)
    k_own, v_own = torch.randn(b, h_kv, own, d), torch.randn(b, h_kv, own, d)
    mask = torch.ones(b, 1, (h // h_kv), own, dtype=torch.bool)
    segment = pool.segment()
    assert segment is not None and segment.rows.tolist() == [0, 2]
    got = fused_cascade(query, k_own, v_own, mask, [segment], 0, d**-0.5)  # [B, 1, H, D]
    for row, ids in table.items():
        keys = torch.cat([k_own[row], *[blocks[i].keys[0] for i in ids]], dim=1)
        values = torch.cat([v_own[row], *[blocks[i].values[0] for i in ids]], dim=1)
        ref, _ = fused_attention(
            query[row : row + 1],
            keys.repeat_interleave(h // h_kv, 0)[None],
            values.repeat_interleave(h // h_kv, 0)[None],
            d**-0.5,
        )
        torch.testing.assert_close(got[row, 0], ref[0, :, 0], atol=1e-5, rtol=1e-5)


def test_pool_lays_out_a_block_once_however_many_rows_read_it() -> None:
    kv = _kv(layers=1, tokens=4)

    class _Block:
        id, keys, values, tokens = 7, kv[0], kv[1], 4

    pool = BlockPool.empty(torch.zeros(2, 2, 1, 8), n_layers=1, batch=2)
    pool.point(0, _Block())
    pool.point(1, _Block())
    assert pool.used == 4 and pool.table[:, :4].all()
    seg = pool.segment()
    assert isinstance(seg, SharedSegment) and seg.keys[0].shape[1] == 4


# ---------------------------------------------------------------------------------------------- filter


def test_lexical_similarity_is_cosine_times_length_penalty() -> None:
    a, b = Counter({1: 2, 2: 1}), Counter({1: 1, 3: 1})
    cos = 2 / ((5**0.5) * (2**0.5))
    assert lexical_similarity(a, b, 10, 20) == pytest.approx(cos * 0.5)
    assert lexical_similarity(a, a, 7, 7) == pytest.approx(1.0)
    assert lexical_similarity(a, Counter(), 7, 0) == 0.0


def test_dynamic_tau_moves_from_strict_to_soft_with_the_mean_history() -> None:
    assert dynamic_tau([], 0.9, 0.7) == 0.9
    assert dynamic_tau([0.2, 0.6], 0.9, 0.7) == pytest.approx(0.9 - 0.2 * 0.4)
    assert dynamic_tau([1.0, 1.0], 0.9, 0.7) == pytest.approx(0.7)


def test_percentile_threshold_warms_up_then_admits_at_or_below_the_percentile() -> None:
    pat = PercentileThreshold(percentile=80, warmup=5)
    assert [pat.admit(d) for d in (1.0, 2.0, 3.0, 4.0, 5.0)] == [False] * 5  # warm-up: no reuse
    assert pat.threshold() == pytest.approx(4.2)  # numpy's linear 80th percentile of 1..5
    assert pat.admit(4.2) and not pat.admit(4.9)


def test_structural_check_rejects_a_flipped_operator_and_skips_prose() -> None:
    plus, minus = formal_trees("So 2x+5=10, then x = 2.5."), formal_trees("So 2x-5=10, then x = 2.5.")
    assert len(plus) == 2 and tree_edit_distance(plus, minus) == 1
    assert not structurally_equal(plus, minus)
    assert structurally_equal(plus, formal_trees("Thus 2x + 5 = 10 and x=2.5"))
    assert formal_trees("The answer is nine.") == []
    assert structurally_equal([], [])  # prose: the check is bypassed
    assert not structurally_equal(plus, [])  # formal against prose never matches
    code = formal_trees("```\ndef f(x):\n    return x + 1\n```")
    assert code and not structurally_equal(code, formal_trees("```\ndef f(x):\n    return x - 1\n```"))


def test_block_distance_follows_the_normalised_euclidean_formula() -> None:
    g = torch.Generator().manual_seed(3)
    ka, va, kb, vb = (torch.randn(3, 2, 4, 8, generator=g) for _ in range(4))
    got = block_distance((ka, va), (kb, vb), BlockNorms.of(ka, va), BlockNorms.of(kb, vb))
    per_layer = [((ka[i] - kb[i]).norm() + (va[i] - vb[i]).norm()) / (2 * 4 * 2) for i in range(3)]
    assert got == pytest.approx(float(sum(per_layer) / 3), rel=1e-4)
    assert block_distance((ka, va), (ka, va), BlockNorms.of(ka, va), BlockNorms.of(ka, va)) == 0.0


# ---------------------------------------------------------------------------------------------- backend


@pytest.fixture(scope="module")
def backend(tiny_backend: HFBackend) -> HFBackend:
    return tiny_backend


def _every_token_ends_a_step(session, backend: HFBackend) -> ReasonCache:
    plugin = session.plugin(ReasonCache)
    assert plugin is not None
    vocab = frozenset(range(len(backend.tokenizer)))
    plugin.boundaries = StepBoundaries(closes=vocab, sentence_end=frozenset(), space_start=frozenset())
    return plugin


@pytest.fixture(params=["pages", "tails"])
def layout(request: pytest.FixtureRequest, backend: HFBackend) -> Iterator[str]:
    """The backend with its rows' own KV in pages (an ended row is captured at once and its last
    step closed in its node: `KVEdits.point_at`) or in tails (captured at compaction)."""
    before = backend.kv_layout
    backend.kv_layout = request.param
    try:
        yield request.param
    finally:
        backend.kv_layout = before


@pytest.mark.usefixtures("layout")
def test_forced_reuse_of_identical_blocks_keeps_greedy_logits(backend: HFBackend) -> None:
    """Two greedy siblings hold identical KV; with p=0 only distance-0 blocks are admitted, so the
    second sibling reads the first one's blocks: its tokens and logits stay the dense ones."""
    prompt = backend.encode("Compute 12 + 7 step by step.")
    params = DecodeParams(max_tokens=150, temperature=0.0)  # past 128: the tails grow mid-decode
    dense = backend.session(share="exact")
    d_root = dense.prefill(prompt)
    d_kids = dense.fork(d_root, 2)
    d_gen = dense.extend(d_kids, params)
    cfg = ReasonCacheConfig(block_tokens=4, percentile=0.0, warmup_blocks=1, structural=False)
    session = backend.session(share="exact", accel=Accel(reasoncache=cfg))
    _every_token_ends_a_step(session, backend)
    root = session.prefill(prompt)
    kids = session.fork(root, 2)
    gen = session.extend(kids, params)
    stats = session.kv_stats().extra
    assert stats["reasoncache_blocks_reused"] > 0, stats
    assert [g.token_ids for g in gen] == [g.token_ids for g in d_gen]
    probe = backend.encode(" so")
    d_next = dense.score_next(d_kids, probe, [1, 2, 3])
    got_next = session.score_next(kids, probe, [1, 2, 3])
    torch.testing.assert_close(torch.tensor(got_next), torch.tensor(d_next), atol=1e-5, rtol=1e-5)
    assert 0 < stats["reasoncache_amsr"] < 1
    dense.release([*d_kids, d_root])
    session.release([*kids, root])
    assert backend.kv_stats().bytes_held == 0 and backend.tree.blocks.live == 0


@pytest.mark.usefixtures("layout")
def test_branches_that_ended_share_their_last_step_in_their_nodes(backend: HFBackend) -> None:
    """Three greedy siblings, two ending at 16 tokens while the third goes on: their one step each
    (nothing closes a step before a branch ends) closes after they ended, when pages have already
    captured them into their nodes. The second reads the first's blocks there (sealed out of a
    node, pointed at in a node: `KVEdits.seal`, `KVEdits.point_at`); every branch's next-token
    logits stay the dense ones."""
    prompt = backend.encode("Compute 12 + 7 step by step.")
    params = DecodeParams(max_tokens=24, min_tokens=24, temperature=0.0)
    short = DecodeParams(max_tokens=16, min_tokens=16, temperature=0.0)
    probe = backend.encode(" so")
    dense = backend.session(share="exact")
    d_root = dense.prefill(prompt)
    d_kids = dense.fork(d_root, 3)
    dense.extend(d_kids, params, row_params=[short, short, None])
    cfg = ReasonCacheConfig(block_tokens=4, percentile=0.0, warmup_blocks=1, structural=False)
    session = backend.session(share="exact", accel=Accel(reasoncache=cfg))
    plugin = session.plugin(ReasonCache)
    assert plugin is not None
    plugin.boundaries = StepBoundaries(closes=frozenset(), sentence_end=frozenset(), space_start=frozenset())
    root = session.prefill(prompt)
    kids = session.fork(root, 3)
    session.extend(kids, params, row_params=[short, short, None])
    assert session.kv_stats().extra["reasoncache_blocks_reused"] >= 3
    second = backend.tree.find(kids[1])  # every whole block of its 15 computed tokens, read from the first's
    assert second is not None and len(second.blocks) == 3
    assert second.kv_tokens + 4 * len(second.blocks) == second.n_computed == 15
    got = session.score_next(kids, probe, [1, 2, 3])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(dense.score_next(d_kids, probe, [1, 2, 3])))
    dense.release([*d_kids, d_root])
    session.release([*kids, root])
    assert backend.kv_stats().bytes_held == 0 and backend.tree.blocks.live == 0


def test_shared_prefix_blocks_are_never_rewritten(backend: HFBackend) -> None:
    cfg = ReasonCacheConfig(block_tokens=2, mode="random", random_rate=1.0)
    session = backend.session(share="exact", accel=Accel(reasoncache=cfg))
    _every_token_ends_a_step(session, backend)
    root = session.prefill(backend.encode("A shared question prompt."))
    kids = session.fork(root, 3)
    session.extend(kids, DecodeParams(max_tokens=1, temperature=0.0))  # computes the shared prompt
    root_seg = backend.tree.get(root)
    before = [k.clone() for k in root_seg.keys]
    session.extend(kids, DecodeParams(max_tokens=16, temperature=1.0, seed=0))
    assert session.kv_stats().extra["reasoncache_blocks_reused"] > 0
    assert not root_seg.blocks and all(torch.equal(a, b) for a, b in zip(before, root_seg.keys, strict=True))
    # children and grandchildren read their ancestors' blocks through the pool
    grand = session.fork(kids[0], 2)
    session.extend(grand, DecodeParams(max_tokens=4, temperature=0.0))
    session.release(grand + kids + [root])
    assert backend.kv_stats().bytes_held == 0 and backend.tree.blocks.live == 0


def test_an_earlier_tree_step_is_a_source_and_its_readers_see_the_same_kv(backend: HFBackend) -> None:
    """Grandchildren may share blocks of their parent step (a node outside their decode): its KV
    moves into blocks, and what a reader of that step attends to stays the same."""
    cfg = ReasonCacheConfig(block_tokens=2, mode="random", random_rate=0.0, seed=3)
    session = backend.session(share="exact", accel=Accel(reasoncache=cfg))
    plugin = _every_token_ends_a_step(session, backend)
    root = session.prefill(backend.encode("A question with two steps."))
    kids = session.fork(root, 2)
    session.extend(kids, DecodeParams(max_tokens=12, temperature=1.0, seed=0))
    parent = backend.tree.get(kids[0])
    assert not parent.blocks
    plugin.cfg = cfg.model_copy(update={"random_rate": 1.0})  # share from the second step on
    probe = backend.encode(" then")
    before = session.score_next([kids[0]], probe, [1, 2, 3])
    grand = session.fork(kids[0], 2)
    session.extend(grand, DecodeParams(max_tokens=12, temperature=1.0, seed=1))
    assert parent.blocks, "no block of the parent step became a source"
    after = session.score_next([kids[0]], probe, [1, 2, 3])
    torch.testing.assert_close(torch.tensor(after), torch.tensor(before), atol=1e-5, rtol=1e-5)
    session.release(grand + kids + [root])
    assert backend.kv_stats().bytes_held == 0 and backend.tree.blocks.live == 0


@pytest.mark.parametrize("other", [{"rsbcm": RSBCMConfig()}, {"skipkv": SkipKVConfig(budget=64)}])
def test_eviction_accelerations_are_rejected_with_a_clear_error(other: dict) -> None:
    with pytest.raises(ValueError, match="reasoncache"):
        Accel(reasoncache=ReasonCacheConfig(), **other)


def test_config_rejects_soft_above_strict() -> None:
    with pytest.raises(ValueError, match="tau_soft"):
        ReasonCacheConfig(tau_strict=0.5, tau_soft=0.8)


def test_a_run_that_shared_nothing_says_so(backend: HFBackend) -> None:
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import self_consistency

    never = Accel(reasoncache=ReasonCacheConfig(tau_strict=1.0, tau_soft=1.0))
    result = Reasoner(self_consistency(n=3, max_tokens=20, seed=0), backend=backend, accel=never).run(
        "What is 12 + 7?"
    )
    assert result.kv_stats["reasoncache_blocks_sealed"] > 0
    assert any(note.startswith("reasoncache: no block was shared") for note in result.notes), result.notes


@pytest.mark.usefixtures("layout")
def test_block_reads_on_the_fast_step_match_the_layer_loop(backend: HFBackend) -> None:
    """ReasonCache's rows read their blocks on the fixed-shape step (the pool as one more shared
    segment, masked per row; a changed pool is a new layout): every block reused (random mode,
    lossy), the same greedy tokens and reuse as on the layer loop, no step on the layer loop."""
    cfg = ReasonCacheConfig(block_tokens=2, mode="random", random_rate=1.0, seed=1)
    runs = {}
    try:
        for mode in ("layers", "eager"):
            backend.decode_step = mode
            session = backend.session(share="exact", accel=Accel(reasoncache=cfg))
            _every_token_ends_a_step(session, backend)
            root = session.prefill(backend.encode("A shared question prompt."))
            kids = session.fork(root, 3)
            gens = session.extend(kids, DecodeParams(max_tokens=16, temperature=0.0))
            runs[mode] = ([g.token_ids for g in gens], session.kv_stats().as_dict())
            session.release([*kids, root])
    finally:
        backend.decode_step = "auto"
    (loop_tokens, loop), (tokens, stats) = runs["layers"], runs["eager"]
    assert tokens == loop_tokens
    assert stats["reasoncache_blocks_reused"] == loop["reasoncache_blocks_reused"] > 0
    assert "decode_steps_layer_loop" not in stats and stats["decode_steps_fixed"] >= 15
