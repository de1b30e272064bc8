"""Preemption under every acceleration: a preempted greedy row ends with the tokens it would have
produced without the preemption, its KV is swapped (an acceleration that changes KV) or recomputed
(one that does not, or none), and the pool's books balance afterwards.

Preemption is forced two ways: by the mechanism itself (the youngest rows named at fixed steps,
whatever the budget), and by a KV budget too small for every row's growth."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from branchwise.backends.accel import Accel
from branchwise.backends.base import DecodeParams, DecodeStep, KVStats
from branchwise.backends.hf import HFBackend, intake
from branchwise.backends.hf.batch import Row
from branchwise.backends.hf.hooks import Acceleration
from branchwise.backends.hf.kv_swap import KVSwap
from branchwise.reasoners.result import kv_budget_notes

TEXT = "Question: How many apples are left? Let's think step by step about the problem.\n"
ROWS, TOKENS = 4, 24

SETS = [(), ("skipkv",), ("river",), ("reasoncache",), ("rsbcm",), ("cgee",), ("skipkv", "river", "cgee")]
"""None, each acceleration that acts during a decode, and a composed run."""
STEPS = (3, 6)
"""Where `forced` preempts (CGEE's acting decode gate stops every row after the 9th token)."""


def ids(names: tuple[str, ...]) -> str:
    return "+".join(names) or "none"


def acting(names: tuple[str, ...]) -> Accel:
    """Each acceleration's declared acting settings, less what acts outside a decode: SkipKV's
    steering (no vector is saved here) and CGEE's level 2 (a verify pass; without it CGEE changes
    no KV, so its preempted rows are recomputed)."""
    configs = Accel.configs()
    settings = {}
    for name in names:
        examples = configs[name].examples
        assert examples is not None
        given = {k: v for k, v in examples.acting.items() if k not in ("steering", "level2")}
        settings[name] = configs[name].model_validate(given)
    return Accel(**settings)


def greedy(backend: HFBackend, accel: Accel, rows: int = ROWS) -> tuple[list[list[int]], KVStats]:
    """`rows` greedy branches of one prompt under `accel`; their tokens and the run's statistics."""
    backend.accel = accel  # a fresh session: the accelerations' state starts empty
    backend.reset_stats()
    root = backend.prefill(backend.encode(TEXT))
    kids = backend.fork(root, rows)
    gens = backend.extend(kids, DecodeParams(max_tokens=TOKENS, min_tokens=TOKENS))
    stats = backend.kv_stats()
    backend.release([*kids, root])
    return [g.token_ids for g in gens], stats


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Preempt, whatever the budget, the youngest row at the first of `STEPS` and a middle one at
    the second; yields the steps at which a row was preempted."""
    original = intake.Intake.pressure
    at: list[int] = []

    def pressure(self: intake.Intake, alive: list[Row]) -> list[Row]:
        victims = original(self, alive)
        if not victims and self.run.step in STEPS and len(alive) > 1:
            order = sorted(alive, key=lambda r: self.run.rows[r.seg.id])
            victims = [order[-1] if self.run.step == STEPS[0] else order[len(order) // 2]]
            at.append(self.run.step)
        return victims

    monkeypatch.setattr(intake.Intake, "pressure", pressure)
    yield at


@pytest.fixture(scope="module")
def backend(tiny_llama_dir: Path) -> HFBackend:
    return HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0)


@pytest.mark.parametrize("names", SETS, ids=ids)
def test_a_forced_preemption_keeps_greedy_tokens(
    backend: HFBackend, names: tuple[str, ...], request: pytest.FixtureRequest
) -> None:
    accel = acting(names)
    want, _ = greedy(backend, accel)
    before = backend.engine.pool.preemptions
    at = request.getfixturevalue("forced")
    got, stats = greedy(backend, accel)
    assert at == list(STEPS) and backend.engine.pool.preemptions - before == 2
    assert stats.extra["preempted_rows"] == 2
    if "cgee" in names:
        # the decode gate stops the whole batch at one step: a row that waited k steps while
        # preempted ends k tokens earlier, its tokens the unpreempted row's up to there
        assert [w[: len(g)] for g, w in zip(got, want, strict=True)] == got
        assert sum(len(w) - len(g) for g, w in zip(got, want, strict=True)) == len(at)
        assert sum(g == w for g, w in zip(got, want, strict=True)) == ROWS - len(at)
    else:
        assert got == want
    acted = Accel.configs()
    for name in names:  # each acceleration acted in the preempted run as in the plain one
        examples = acted[name].examples
        assert examples is not None
        assert any(stats.extra.get(k, 0) > 0 for k in examples.acted if k != "verify_rows"), name
    # a run whose accelerations change KV swaps; the decode gate alone recomputes
    policy = intake.policy_of(backend.session(accel=accel).plugins)
    assert policy == ("recompute" if names in ((), ("cgee",)) else "swap")
    assert stats.extra.get("swapped_rows", 0) == (0 if policy == "recompute" else 2)
    assert backend.kv_stats().bytes_held == 0


@pytest.mark.parametrize("layout", ["tails", "pages"])
@pytest.mark.parametrize("names", [("skipkv",), ("reasoncache",), ("river",)], ids=ids)
def test_rows_beyond_a_tight_budget_wait_under_each_acceleration(
    tiny_llama_dir: Path, names: tuple[str, ...], layout: str
) -> None:
    """Eight accelerated rows of which about three fit the budget at once (each priced at its
    acceleration's cap, `row_kv_tokens`), none runs over the budget, and all end with the unbounded
    run's tokens. Tails price rows at their worst case: the others wait outside the batch and join
    as rows end, none preempted. Pages price what rows hold: all start, and any that outgrow the
    budget are preempted (their KV swapped out and back: these accelerations change KV); where the
    budget holds every row's real KV (ReasonCache's and River's rows keep all their tokens, so
    eight fit what three of their worst cases would), none waits at all."""
    accel = acting(names)
    free = HFBackend(tiny_llama_dir, kv_budget=None, cache_bytes=0)
    want, _ = greedy(free, accel, rows=8)
    tb = free.engine.pool.token_bytes
    prompt = len(free.encode(TEXT))
    kept = free.session(accel=accel).computation.row_kv_tokens(TOKENS)  # SkipKV's cap per row
    # the eight rows' final KV, and one row's price (its KV twice and its free slots) to spare
    budget = math.ceil((prompt + 11 * kept) * tb / 0.98)
    tight = HFBackend(tiny_llama_dir, kv_budget=budget, cache_bytes=0, kv_layout=layout)
    got, stats = greedy(tight, accel, rows=8)
    assert got == want
    if layout == "tails":
        assert stats.extra["deferred_rows"] > 0 and stats.preemptions == 0
    assert tight.engine.pool.overruns == 0 and "kv_overruns" not in stats.extra
    after = tight.kv_stats()
    assert after.bytes_held == 0 and after.used_bytes == 0


class Changes(Acceleration):
    """An acceleration that says nothing of its KV: the safe default is a swap."""


class Reads(Acceleration):
    kv_from_tokens = True


def test_the_policy_is_recompute_only_where_every_acceleration_keeps_kv_exact() -> None:
    assert intake.policy_of([]) == intake.RECOMPUTE
    assert intake.policy_of([Reads()]) == intake.RECOMPUTE
    assert intake.policy_of([Reads(), Changes()]) == intake.SWAP


def test_a_call_cut_while_a_row_is_swapped_out_leaves_the_books_balanced(
    backend: HFBackend, forced: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer fails while a preempted row's KV is swapped out: the KV goes back into its node,
    the swap file is gone, and releasing the nodes returns the pool to zero."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    backend.accel = acting(("skipkv",))
    backend.reset_stats()
    root = backend.prefill(backend.encode(TEXT))
    kids = backend.fork(root, ROWS)
    seen: list[DecodeStep] = []

    def listener(step: DecodeStep) -> None:
        seen.append(step)
        if len(seen) == STEPS[0] + 1:  # after the preemption, before the row could rejoin
            raise RuntimeError("the consumer left")

    left = False
    try:
        backend.extend(kids, DecodeParams(max_tokens=TOKENS, min_tokens=TOKENS), on_step=listener)
    except RuntimeError as err:  # caught here, not kept: its traceback would keep the batch alive
        left = str(err) == "the consumer left"
    assert left
    assert forced == [STEPS[0]] and backend.kv_stats().extra["swapped_rows"] == 1
    victim = backend.tree.get(kids[-1])  # the youngest row
    assert victim.keys is not None and victim.kv_tokens == victim.n_computed > 0
    assert list(tmp_path.iterdir()) == []
    backend.release([*kids, root])
    stats = backend.kv_stats()
    assert stats.bytes_held == 0 and stats.used_bytes == 0


@pytest.mark.parametrize("to_file", [True, False], ids=["file", "host"])
def test_a_swap_takes_a_nodes_kv_out_of_the_budget_and_back_unchanged(
    backend: HFBackend, to_file: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both places a swap puts KV (a file, the CPU's case; host memory, an accelerator's): the
    node's bytes leave the tree's count, and come back bit for bit; nothing is left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    backend.accel = Accel()
    root = backend.prefill(backend.encode(TEXT))
    backend.extend([root], DecodeParams(max_tokens=1))  # its prompt's KV is computed into the node
    seg = backend.tree.get(root)
    assert seg.keys is not None and seg.values is not None
    keys, values = [k.clone() for k in seg.keys], [v.clone() for v in seg.values]
    held, tokens = backend.kv_stats().bytes_held, seg.kv_tokens
    swap = KVSwap(seg.keys[0].device, to_file=to_file)
    nbytes = swap.out(seg, backend.tree)
    assert nbytes == held - backend.kv_stats().bytes_held > 0 and swap.nbytes == nbytes
    assert seg.keys is None and swap.tokens == {root: tokens}
    assert len(list(tmp_path.rglob("*.pt"))) == (1 if to_file else 0)
    swap.back(seg, backend.tree)
    swap.close()
    assert backend.kv_stats().bytes_held == held and swap.nbytes == 0 and swap.tokens == {}
    assert all(torch.equal(a, b) for a, b in zip([*seg.keys, *seg.values], [*keys, *values], strict=True))
    assert list(tmp_path.iterdir()) == []
    backend.release([root])


def test_a_request_preempted_whole_takes_its_prompt_with_it(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two prompts of two rows each decode in one batch; at the third step every row of the second
    prompt is preempted. That prompt's KV is freed with its last row (no running row reads it),
    recomputed when the rows rejoin, and every row ends with the tokens of the unpreempted run. The
    first prompt, read by rows that stay, keeps its KV."""
    second = "Question: What is seven times six? Answer:"

    def run() -> tuple[list[list[int]], KVStats, list[int]]:
        backend.accel = Accel()
        backend.reset_stats()
        roots = [backend.prefill(backend.encode(t)) for t in (TEXT, second)]
        kids = [k for r in roots for k in backend.fork(r, 2)]
        gens = backend.extend(kids, DecodeParams(max_tokens=TOKENS, min_tokens=TOKENS))
        stats = backend.kv_stats()
        held = [backend.engine.tree.get(r).kv_tokens for r in roots]
        backend.release([*kids, *roots])
        return [g.token_ids for g in gens], stats, held

    want, _, _ = run()
    original = intake.Intake.pressure
    dropped: list[int] = []

    def pressure(self: intake.Intake, alive: list[Row]) -> list[Row]:
        victims = original(self, alive)
        if not victims and self.run.step == 3:
            younger = max(r.seg.kv_ancestors()[-1].id for r in alive)  # the second prompt's node
            victims = [r for r in alive if r.seg.kv_ancestors()[-1].id == younger]
            dropped.append(len(victims))
        return victims

    monkeypatch.setattr(intake.Intake, "pressure", pressure)
    got, stats, held = run()
    assert dropped == [2] and stats.extra["preempted_rows"] == 2
    assert stats.extra["preempted_prompts"] == 1
    assert got == want
    assert held == [len(backend.encode(t)) for t in (TEXT, second)]  # the second computed again
    assert backend.kv_stats().bytes_held == 0


def test_a_request_swapped_whole_takes_its_prompt_with_it(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above under an acceleration that changes KV (River: its rows are swapped, not
    recomputed): once the second prompt's last row is swapped out, the prompt is swapped out with
    it (its bytes leave the budget while its rows wait), comes back before they rejoin, and every
    row ends with the tokens of the unpreempted run; the first prompt stays. Before this a swapped
    request's prompt stayed, and at a binding budget the waiting requests' prompts left one row
    decoding past the budget (`KVTree.idle_ancestors`)."""
    second = "Question: What is seven times six? Answer:"
    accel = acting(("river",))

    def run() -> tuple[list[list[int]], KVStats]:
        backend.accel = accel
        backend.reset_stats()
        roots = [backend.prefill(backend.encode(t)) for t in (TEXT, second)]
        kids = [k for r in roots for k in backend.fork(r, 2)]
        gens = backend.extend(kids, DecodeParams(max_tokens=TOKENS, min_tokens=TOKENS))
        stats = backend.kv_stats()
        backend.release([*kids, *roots])
        return [g.token_ids for g in gens], stats

    want, _ = run()
    original = intake.Intake.pressure
    out_at: list[tuple[bool, bool]] = []  # after the preemption: (first prompt held, second held)

    def pressure(self: intake.Intake, alive: list[Row]) -> list[Row]:
        if self.run.step == 4:
            prompts = sorted({r.seg.kv_ancestors()[-1].id for r in alive} | set(self.swap.segs))
            tree = self.host.tree
            out_at.append(tuple(tree.get(p).keys is not None for p in prompts[:2]))  # type: ignore[arg-type]
        victims = original(self, alive)
        if not victims and self.run.step == 3:
            younger = max(r.seg.kv_ancestors()[-1].id for r in alive)
            victims = [r for r in alive if r.seg.kv_ancestors()[-1].id == younger]
        return victims

    monkeypatch.setattr(intake.Intake, "pressure", pressure)
    got, stats = run()
    assert intake.policy_of(backend.session(accel=accel).plugins) == intake.SWAP
    assert stats.extra["swapped_rows"] == 2 and stats.extra["swapped_prompts"] == 1
    # a result says so: the run waited on those copies
    (note,) = kv_budget_notes(stats.as_dict())
    assert note.startswith("kv_budget: 2 decoding branch(es), 1 prompt(s) were swapped out of the KV budget")
    assert f"({stats.extra['swapped_bytes'] / 2**20:.1f} MiB to host memory or a file)" in note
    assert out_at == [(True, False)]
    assert got == want
    assert backend.kv_stats().bytes_held == 0


def test_ended_rows_are_swapped_out_before_a_running_row_under_the_swap_policy(
    backend: HFBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under an acceleration that changes KV (River: swap policy) the KV of a call's ended rows
    leaves the budget before any running row is preempted, as the recompute policy frees it: two
    rows end after 6 tokens (told to a listener, as a server's rows are), and when the budget is short their KV is swapped out (the running
    rows' tokens unchanged). The call's end brings back an ended row whose node is still held (a
    strategy may extend it), and forgets one released meanwhile (a server's finished request).
    Before this an ended row's KV stayed in memory under the swap policy, and the last row of a
    request left decoding ran past the budget (`kv_budget_notes`' overruns)."""
    accel = acting(("river",))
    short = DecodeParams(max_tokens=6, min_tokens=6)

    def run(squeeze: bool) -> tuple[list[list[int]], KVStats, list[int]]:
        backend.accel = accel
        backend.reset_stats()
        root = backend.prefill(backend.encode(TEXT))
        kids = backend.fork(root, ROWS)
        rows: list[DecodeParams | None] = [None, None, short, short]
        params = DecodeParams(max_tokens=TOKENS, min_tokens=TOKENS)
        gens = backend.extend(kids, params, on_step=lambda step: (), row_params=rows)  # a listener: as served
        stats = backend.kv_stats()
        held = [backend.engine.tree.get(k).kv_tokens for k in kids[:3]]
        backend.release([*kids[:3], root] if squeeze else [*kids, root])
        return [g.token_ids for g in gens], stats, held

    want, _, whole = run(squeeze=False)
    original = intake.Intake.pressure
    seen: list[tuple[int, bool]] = []

    def pressure(self: intake.Intake, alive: list[Row]) -> list[Row]:
        if self.run.step == 10:  # both short rows ended: swap them out, release the last one's node
            moved = self._free_ended(1 << 40)
            ended = [s for s, i in self.run.rows.items() if i in self.run.results]
            seen.append((moved, all(s in self.swap.segs for s in ended)))
            self.host.tree.release(max(ended))
        return original(self, alive)

    monkeypatch.setattr(intake.Intake, "pressure", pressure)
    got, stats, held = run(squeeze=True)
    assert intake.policy_of(backend.session(accel=accel).plugins) == intake.SWAP
    ((moved, swapped),) = seen
    assert moved > 0 and swapped
    assert stats.extra["swapped_ended_rows"] == 2 and not stats.extra.get("swapped_rows")
    assert got == want
    assert held == whole  # the ended row still held came back whole at the call's end
    (note,) = kv_budget_notes(stats.as_dict())
    assert note.startswith("kv_budget: 2 ended branch(es) were swapped out of the KV budget")
    assert backend.kv_stats().bytes_held == 0
