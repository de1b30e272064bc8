"""SkipKV inside the backend: per-row eviction with correct positions, steering only at delimiters,
composition with prefix sharing and the strategies, clear errors."""

from __future__ import annotations

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, RSBCMConfig, SkipKVConfig, SteeringConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.skipkv import QueryWindow, SkipKV
from branchwise.backends.hf.skipkv_steering import SteeringVector
from branchwise.backends.hf.step_inputs import Steer
from branchwise.reasoners import Reasoner
from branchwise.strategies import beam_search, self_consistency

PROMPT = "Count: one two three four five six seven."
SMALL = SkipKVConfig(budget=6, interval=4, window=2, query_window=4)


def _extend(backend: HFBackend, n: int, tokens: int, temperature: float = 0.0) -> tuple[int, list[int]]:
    root = backend.prefill(backend.encode(PROMPT))
    kids = backend.fork(root, n)
    backend.extend(kids, DecodeParams(temperature=temperature, max_tokens=tokens, min_tokens=tokens, seed=0))
    return root, kids


def test_under_budget_is_exactly_full_kv(tiny_arch_dir) -> None:
    backend = HFBackend(tiny_arch_dir)
    outs = []
    for accel in (Accel(), Accel(skipkv=SkipKVConfig(budget=64, interval=4))):
        backend.accel = accel
        backend.reset_stats()
        root, kids = _extend(backend, 2, 12)
        outs.append([backend.tokens(k) for k in kids])
        backend.release([root, *kids])
    assert outs[0] == outs[1]
    assert (
        "skipkv_evicted_tokens" not in backend.kv_stats().extra
        or not backend.kv_stats().extra["skipkv_evicted_tokens"]
    )


def test_budget_holds_per_row_and_frees_memory(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)  # share="exact": each branch's own segment holds only its tokens
    backend.accel = Accel(skipkv=SMALL)
    root, kids = _extend(backend, 3, 21, temperature=1.0)
    stats = backend.kv_stats()
    assert stats.extra["skipkv_compressions"] >= 3 * 4  # steps 4, 8, 12, 16, 20 for each row
    kept_sets = []
    skip = backend.acceleration(SkipKV)
    assert isinstance(skip, SkipKV)
    for k in kids:
        seg = backend.tree.get(k)
        state = skip.state(k)
        assert state is not None
        # generated KV: at most budget after the last compression (step 20) + the token fed since
        assert state.tracker.cache_len <= SMALL.budget + 1
        assert seg.kv_tokens == state.gen_start + state.tracker.cache_len
        kept_sets.append(tuple(state.tracker.slot_positions.flatten().tolist()))
    assert len(set(kept_sets)) > 1  # each row chose its own tokens (not row 0's choice for all)
    prompt_tokens = len(backend.encode(PROMPT))
    assert backend.tree.get(root).kv_tokens == prompt_tokens  # the shared prompt is never evicted
    own = sum(backend.tree.get(k).kv_tokens for k in kids)
    assert stats.bytes_held == (prompt_tokens + own) * backend.kv_token_bytes
    backend.release([root, *kids])
    assert backend.kv_stats().bytes_held == 0


@pytest.mark.parametrize("per_head", [False, True])
def test_rows_due_together_evict_as_each_scored_alone(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, per_head: bool
) -> None:
    """The rows due at one step are scored in one product per term: each row must keep exactly the
    slots it keeps when scored on its own (its scores are its own, never another row's)."""
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(skipkv=SMALL.model_copy(update={"per_head": per_head}))
    scored = SkipKV._scored
    together: list[int] = []

    def batched(self: SkipKV, batch: Batch, rows: list) -> list:  # type: ignore[type-arg]
        together.append(len(rows))
        return scored(self, batch, rows)

    def alone(self: SkipKV, batch: Batch, rows: list) -> list:  # type: ignore[type-arg]
        return [x for c in rows for x in scored(self, batch, [c])]

    kept = []
    for how in (batched, alone):
        monkeypatch.setattr(SkipKV, "_scored", how)
        root, kids = _extend(backend, 3, 13, temperature=1.0)
        skip = backend.acceleration(SkipKV)
        assert isinstance(skip, SkipKV)
        kept.append([skip.state(k).tracker.slot_positions.tolist() for k in kids])  # type: ignore[union-attr]
        backend.release([root, *kids])
    assert together and max(together) == 3  # the three rows were due at the same steps
    assert kept[0] == kept[1]
    assert len({str(k) for k in kept[0]}) > 1  # and chose differently


def test_positions_after_eviction_match_masked_reference(tiny_llama_dir, masked_reference) -> None:
    """New tokens keep their logical positions and only stop seeing the evicted keys."""
    backend = HFBackend(tiny_llama_dir)
    # one compression, after the 12th fed token: every earlier query saw the full cache; one slot
    # set for all heads, so the reference masks the same keys in every head
    backend.accel = Accel(
        skipkv=SkipKVConfig(budget=6, interval=12, window=2, query_window=4, per_head=False)
    )
    root, (kid,) = _extend(backend, 1, 13)
    skip = backend.acceleration(SkipKV)
    assert isinstance(skip, SkipKV)
    state = skip.state(kid)
    assert state is not None
    kept_generated = list(state.tracker.positions)
    assert len(kept_generated) == 6  # 12 generated tokens were fed, 6 evicted
    backend.accel = Accel()
    path = backend.tokens(kid)
    suffix = backend.encode(" next?")
    got = backend.score_next([kid], suffix, list(range(8)))[0]
    prompt_tokens = len(backend.encode(PROMPT))
    evicted = [prompt_tokens + j for j in range(12) if j not in kept_generated]
    # the last generated token was pending: it is fed with the suffix, after the eviction
    ref = masked_reference(backend, path + suffix, len(path) - 1, evicted, list(range(8)))
    torch.testing.assert_close(torch.tensor(got), ref, atol=1e-5, rtol=1e-4)
    backend.release([root, kid])


def test_streaming_preset_keeps_exactly_the_newest_tokens(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(skipkv=SkipKVConfig.streaming(6, interval=12, query_window=4))
    root, (kid,) = _extend(backend, 1, 13)
    skip = backend.acceleration(SkipKV)
    assert isinstance(skip, SkipKV)
    state = skip.state(kid)
    assert state is not None
    assert list(state.tracker.positions) == list(range(6, 12))  # 12 fed, the oldest 6 evicted
    backend.release([root, kid])


def test_window_above_budget_is_rejected_naming_both() -> None:
    with pytest.raises(ValueError, match=r"window=9 must not exceed budget=8"):
        SkipKVConfig(budget=8, window=9)


def test_steering_changes_the_residual_of_the_rows_it_steers_only(tiny_llama_dir) -> None:
    """A `Steer` on the batch adds `scale * table[idx]` at its layer's input, per row: the row at
    slot 1 moves by 1.5 v, the row at slot 0 (the zero row) not at all."""
    backend = HFBackend(tiny_llama_dir)
    parts = backend.parts
    layer = 1
    d = parts.embed.embedding_dim
    vector = torch.randn(d, dtype=backend.dtype, device=backend.device)
    table = torch.stack([torch.zeros_like(vector), vector])
    ids = backend.encode("One.\nTwo")
    captured: list[torch.Tensor] = []
    hook = parts.layers[layer].register_forward_pre_hook(lambda _m, args: captured.append(args[0].clone()))
    try:
        for steered in (False, True):
            segs = [backend.tree.add(None, False, list(ids), backend.tree.accounts.total) for _ in range(2)]
            batch = Batch.assemble(segs, 0, parts, backend.dtype, backend.device)
            if steered:
                idx, scale = torch.tensor([1, 0]), torch.tensor([1.5, 1.5])
                batch.ctx.steer = Steer(layer, table, idx.to(backend.device), scale.to(backend.device))
            backend.engine.runner.forward(batch.ctx, [ids, ids], [])
            for seg in segs:
                backend.tree.release(seg.id)
    finally:
        hook.remove()
    diff = captured[1] - captured[0]  # [2, q, d]
    torch.testing.assert_close(diff[0], (1.5 * vector).expand_as(diff[0]), atol=1e-5, rtol=1e-5)
    assert diff[1].abs().max() == 0


def test_adaptive_strength_counts_nonexec_sentences(tiny_llama_dir, tmp_path) -> None:
    backend = HFBackend(tiny_llama_dir)
    d = backend.parts.embed.embedding_dim
    path = tmp_path / "v.pt"
    SteeringVector(layer=1, vector=torch.ones(d), n_exec=3, n_nonexec=2, model="tiny").save(path)
    steer = SteeringConfig(alpha0=1.0, gamma=0.5, vector_path=str(path))
    backend.accel = Accel(skipkv=SkipKVConfig(budget=64, interval=4, steering=steer))
    root, kids = _extend(backend, 2, 8)
    skip = backend.acceleration(SkipKV)
    assert isinstance(skip, SkipKV)
    rows = [Row(seg=backend.tree.get(k), kv_len=0, computed=0) for k in kids]
    trackers = [skip.states[k].tracker for k in kids]
    for tracker in trackers:
        tracker.append(backend.encode("\nWait, that is wrong.\n"))  # closes any open one first
    got = skip.steering(rows)
    assert got is not None
    expected = [1.0 + 0.5 * t.n_nonexec for t in trackers]
    assert all(t.n_nonexec >= 1 for t in trackers)
    torch.testing.assert_close(got.scale, torch.tensor(expected, device=got.scale.device))
    backend.release([root, *kids])


def test_missing_steering_vector_says_how_to_build_one(tiny_llama_dir, tmp_path) -> None:
    backend = HFBackend(tiny_llama_dir)
    cfg = SkipKVConfig(budget=16, steering=SteeringConfig(vector_path=str(tmp_path / "none.pt")))
    with pytest.raises(FileNotFoundError, match="branchwise steering build"):
        backend.accel = Accel(skipkv=cfg)


def test_skipkv_and_rsbcm_are_exclusive(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    with pytest.raises(ValueError, match="skipkv"):
        backend.accel = Accel(skipkv=SMALL, rsbcm=RSBCMConfig())


@pytest.mark.parametrize("share", ["exact", "none"])
def test_shared_prompt_is_never_evicted_under_strategies(tiny_llama_dir, share: str) -> None:
    backend = HFBackend(tiny_llama_dir)
    accel = Accel(skipkv=SMALL)
    sc = Reasoner(self_consistency(n=3, max_tokens=20, seed=0), backend=backend, share=share, accel=accel)
    result = sc.run("What is 1 + 2?")
    assert result.kv_stats["skipkv_evicted_tokens"] > 0
    assert not any(note.startswith("skipkv") for note in result.notes)
    tree = beam_search(
        width=4, depth=2, verifier="chain_sum", max_step_tokens=12, step_delimiter="\n", seed=0
    )
    result = Reasoner(tree, backend=backend, share=share, accel=accel).run("What is 1 + 2?")
    assert len(result.branches) > 0
    loose = Reasoner(self_consistency(n=2, max_tokens=4, seed=0), backend=backend, accel=accel).run("1 + 2?")
    assert any(note.startswith("skipkv: no branch") for note in loose.notes)


def test_delimiter_states_split_execution_from_reflection(tiny_llama_dir) -> None:
    """The steering builder reads layer k's input at each closing delimiter, labelled by its sentence."""
    from branchwise.reasoners.steering import delimiter_states

    backend = HFBackend(tiny_llama_dir)
    prompt = backend.encode("Question: 2 + 3?\n")
    response = backend.encode("Add 2 and 3.\nWait, check again.\n\nThe answer is 5.\n")
    execution, other = delimiter_states(backend, prompt, response, 1, ("Wait",))
    assert (len(execution), len(other)) == (2, 1)
    with torch.inference_mode():
        states = backend.model(
            torch.tensor([prompt + response], device=backend.device), output_hidden_states=True
        ).hidden_states[1][0]
    last = len(prompt) + len(response) - 1  # the final "\n" closes "The answer is 5."
    # the builder hands back CPU tensors (what a saved vector is built from), whatever the device
    torch.testing.assert_close(execution[-1], states[last].float().cpu())


@pytest.mark.parametrize("strategy", ["beam_search", "ets"])
def test_budget_holds_across_tree_steps(tiny_llama_dir, strategy: str) -> None:
    """Steps shorter than the interval: the count runs along each branch's path across `extend`
    calls, so compressions happen, and they reach the branch's earlier steps no sibling reads."""
    from branchwise.strategies import ets

    backend = HFBackend(tiny_llama_dir)
    cfg = SkipKVConfig(budget=12, interval=10, window=2, query_window=4)
    step = {"max_step_tokens": 8, "step_delimiter": "\n", "seed": 0, "temperature": 1.0}
    if strategy == "beam_search":
        # one child per kept beam: with more, a beam's last step is shared by its live children
        # and only their own (unshared) steps are the branch's to evict
        tree = beam_search(width=4, keep="fixed", k=4, depth=6, verifier="chain_sum", **step)
    else:
        tree = ets(width=4, depth=6, verifier="chain_sum", embedder="hidden", **step)
    result = Reasoner(tree, backend=backend, accel=Accel(skipkv=cfg)).run("What is 1 + 2?")
    stats = result.kv_stats
    assert stats["skipkv_compressions"] > 0
    assert stats["skipkv_evicted_tokens"] > 0
    assert stats["skipkv_ancestor_evicted_tokens"] > 0  # earlier steps of a branch, not only its own
    assert stats["skipkv_branch_kv_max"] <= cfg.budget  # right after every compression
    assert stats["skipkv_branch_kv_peak"] <= cfg.budget + cfg.interval + 1
    assert not any(note.startswith("skipkv") for note in result.notes)


def test_a_step_left_to_one_branch_is_compressed_at_once(tiny_llama_dir) -> None:
    """A shared step is no branch's own; when its other child is released, it joins what the last
    child holds. That child is compressed at its next step, not `interval` tokens later, so the
    branch never holds more than `budget + interval + 1` generated tokens."""
    backend = HFBackend(tiny_llama_dir)
    cfg = SkipKVConfig(budget=4, interval=10, window=2, query_window=4)
    backend.accel = Accel(skipkv=cfg)
    nine = DecodeParams(max_tokens=9, min_tokens=9)
    root = backend.prefill(backend.encode(PROMPT))
    (step,) = backend.fork(root, 1)
    backend.extend([step], nine)  # 9 < interval: no check yet, the step keeps all 9
    kids = backend.fork(step, 2)
    backend.extend(kids, nine)  # each child checks at 10 generated (holding 1 of its own), then not
    assert backend.kv_stats().extra.get("skipkv_compressions", 0) == 0
    backend.release([kids[1]])
    backend.extend([kids[0]], DecodeParams(max_tokens=2, min_tokens=2))
    stats = backend.kv_stats().extra
    assert stats["skipkv_compressions"] == 1 and stats["skipkv_ancestor_evicted_tokens"] > 0
    assert stats["skipkv_branch_kv_peak"] <= cfg.budget + cfg.interval + 1
    backend.release([root, step, kids[0]])


def test_per_head_selection_decodes_end_to_end_within_budget(tiny_llama_dir) -> None:
    """Greedy decode with per-head selection: heads keep different slots, the same count, the
    budget holds, and KV stays consistent between tracker, segment and bytes."""
    backend = HFBackend(tiny_llama_dir)
    cfg = SkipKVConfig(budget=6, interval=4, window=2, query_window=4, per_head=True)
    backend.accel = Accel(skipkv=cfg)
    root, kids = _extend(backend, 2, 21)
    skip = backend.acceleration(SkipKV)
    assert isinstance(skip, SkipKV)
    parts = backend.parts
    for k in kids:
        seg, state = backend.tree.get(k), skip.state(k)
        assert state is not None and state.tracker.per_head
        table = state.tracker.slot_positions  # [L, H_kv, kept]
        assert table.shape == (parts.n_layers, parts.n_kv_heads, state.tracker.cache_len)
        assert state.tracker.cache_len <= cfg.budget + 1
        assert len({tuple(h) for h in table.flatten(0, 1).tolist()}) > 1  # heads differ
        assert seg.keys is not None and all(t.shape[1] == seg.kv_tokens for t in seg.keys)
        assert seg.kv_tokens == state.gen_start + state.tracker.cache_len
        assert len(backend.tokens(k)) == len(backend.encode(PROMPT)) + 21
    assert backend.kv_stats().extra["skipkv_branch_kv_max"] <= cfg.budget
    backend.release([root, *kids])
    assert backend.kv_stats().bytes_held == 0


def _steered_step(backend: HFBackend, fixed: bool) -> torch.Tensor:
    """One decode step of two rows over their computed prompts, the first steered (slot 1, 2.5 v)
    and the second not, through the fixed-shape step or the layer loop: its logits."""
    parts = backend.parts
    ids = backend.encode("One.\nTwo")
    vector = torch.linspace(-1.0, 1.0, parts.embed.embedding_dim, dtype=backend.dtype, device=backend.device)
    table = torch.stack([torch.zeros_like(vector), vector])
    segs = [backend.tree.add(None, False, list(ids), backend.tree.accounts.total) for _ in range(2)]
    try:
        batch = Batch.assemble(segs, 4, parts, backend.dtype, backend.device)
        backend.engine.runner.forward(batch.ctx, [ids, ids], [])
        idx, scale = torch.tensor([1, 0]), torch.tensor([2.5, 2.5])
        batch.ctx.steer = Steer(1, table, idx.to(backend.device), scale.to(backend.device))
        feeds = [[ids[-1]], [ids[-1]]]
        if fixed:
            return backend.engine.stepper.forward(batch.ctx, feeds)
        return backend.engine.runner.forward(batch.ctx, feeds, [])
    finally:
        backend.engine.stepper.forget()
        for seg in segs:
            backend.tree.release(seg.id)


def test_the_fixed_step_steers_as_the_layer_loop(tiny_llama_dir) -> None:
    """Steering as step inputs (`batch.Steer`): the fixed-shape step's logits equal the layer
    loop's in fp32, and the steered row's differ from the unsteered one's (it acted)."""
    backend = HFBackend(tiny_llama_dir)
    backend.decode_step = "eager"
    fixed, loop = _steered_step(backend, True), _steered_step(backend, False)
    torch.testing.assert_close(fixed, loop, atol=1e-5, rtol=1e-5)
    assert (fixed[0] - fixed[1]).abs().max() > 1e-3


def test_skipkv_decodes_on_the_fast_step_with_the_layer_loops_tokens(tiny_llama_dir, tmp_path) -> None:
    """SkipKV's eviction, query window and steering on the fixed-shape step: the same greedy tokens
    as the layer loop (fp32), no step on the layer loop and none off the fast step."""
    backend = HFBackend(tiny_llama_dir)
    d = backend.parts.embed.embedding_dim
    path = tmp_path / "v.pt"
    SteeringVector(layer=1, vector=torch.linspace(-1, 1, d), n_exec=3, n_nonexec=2, model="tiny").save(path)
    steer = SteeringConfig(alpha0=4.0, gamma=1.0, vector_path=str(path))
    backend.accel = Accel(skipkv=SkipKVConfig(budget=6, interval=4, window=2, query_window=4, steering=steer))
    runs = {}
    for mode in ("layers", "eager"):
        backend.decode_step = mode
        backend.reset_stats()
        root, kids = _extend(backend, 3, 24)
        runs[mode] = ([backend.tokens(k) for k in kids], backend.kv_stats().as_dict())
        backend.release([root, *kids])
    (loop_tokens, loop_stats), (fast_tokens, stats) = runs["layers"], runs["eager"]
    assert fast_tokens == loop_tokens
    assert stats["skipkv_compressions"] >= 3 and stats["decode_steps_fixed"] >= 20
    assert "decode_steps_layer_loop" not in stats and "decode_steps_off_fast" not in stats
    assert loop_stats["decode_steps_layer_loop"] >= 20


def test_query_window_ring_keeps_each_rows_newest_queries_in_order() -> None:
    """The ring writes one slot per step; a row read back (or carried into a batch whose ring
    starts elsewhere) gets its newest queries oldest first, as a shifted window would."""
    layers, size = 2, 3
    ring = QueryWindow(torch.zeros(1), (2, 1, size, 1), layers)
    seen: list[float] = []
    for step in range(5):
        seen.append(float(step))
        for layer in range(layers):
            ring.on_step(layer, torch.full((2, 1, 1, 1), step + 10.0 * layer), None)
        ring.count_step()
        assert ring.of_row(1, 0).flatten().tolist() == [v + 10.0 for v in seen[-size:]]
    assert ring.filled == [size, size]
    carried = ring.save(1)
    fresh = QueryWindow(torch.zeros(1), (1, 1, size, 1), layers)
    fresh.on_step(0, torch.full((1, 1, 1, 1), -1.0), None)  # its ring starts one slot on
    fresh.on_step(1, torch.full((1, 1, 1, 1), -1.0), None)
    fresh.count_step()
    fresh.restore(0, [c[:, 1:] for c in carried])  # two of the three
    assert fresh.filled == [2]
    assert fresh.of_row(0, 0).flatten().tolist() == [3.0, 4.0]
    fresh.on_step(0, torch.full((1, 1, 1, 1), 5.0), None)
    fresh.on_step(1, torch.full((1, 1, 1, 1), 15.0), None)
    fresh.count_step()
    assert fresh.of_row(0, 0).flatten().tolist() == [3.0, 4.0, 5.0]
    ring.select_rows(torch.tensor([1]))
    assert ring.filled == [size] and ring.of_row(0, 0).flatten().tolist() == [2.0, 3.0, 4.0]
