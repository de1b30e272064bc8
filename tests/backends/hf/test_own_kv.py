"""The two layouts of a batch's own KV (`own_kv.py`) answer alike, and pages hold what rows use.

Why: the engine never asks which layout a batch has, so every answer (a write, a read, a row's
slots, an eviction's move, rows leaving) must be the same for the same calls; what differs is the
storage, which for pages follows each row's own length and goes back to the free list at once.
"""

from __future__ import annotations

import pytest
import torch

from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend, cpu_kernels
from branchwise.backends.hf.kv_pages import Pages
from branchwise.backends.hf.own_kv import BLOCK, GROW_SLOTS, OwnKV, Tails, check_layout
from branchwise.backends.step_notes import OFF_FAST_BY, OffFast

L, H, D = 2, 2, 4


def _pair(lens: list[int], q: int, capacity: int) -> tuple[Tails, Pages]:
    b = len(lens)
    tails = Tails.zeros((b, H, capacity, D), L, torch.float32, torch.device("cpu"))
    pages = Pages(L, H, D, b, torch.float32, torch.device("cpu"))
    pages.fit(lens, q, capacity)
    return tails, pages


def _fill(kv: OwnKV, lens: list[int], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for pos, n in enumerate(lens):
        keys = [torch.randn(H, n, D, generator=gen) for _ in range(L)]
        values = [torch.randn(H, n, D, generator=gen) for _ in range(L)]
        kv.load(pos, 0, keys, values)


def _rows(kv: OwnKV, lens: list[int]) -> list[list[torch.Tensor]]:
    return [[*kv.row(pos, 0, n)[0], *kv.row(pos, 0, n)[1]] for pos, n in enumerate(lens)]


def _same(a: OwnKV, b: OwnKV, lens: list[int]) -> None:
    for ra, rb in zip(_rows(a, lens), _rows(b, lens), strict=True):
        for x, y in zip(ra, rb, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.fixture(params=["one call", "per layer"])
def copies(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Pages copy a row's slots over every layer in one kernel call where it is built, else layer by
    layer in torch: both must answer alike (the tests taking this run with each)."""
    if request.param == "one call":
        if (reason := cpu_kernels.build()) is not None:
            pytest.skip(f"the CPU kernels cannot be built here: {reason}")
    else:
        monkeypatch.setattr(Pages, "_in_one_call", lambda self: False)
    return request.param


def test_pages_hold_each_rows_own_length() -> None:
    """Rows of 3, 400 and 17 tokens taking one more each, in a batch whose rows may address 128
    slots past the longest: a page per started 16 tokens of each row and no more (what admission
    priced them at), not the longest row's room for every row; the table is as wide as the
    capacity asks. Growth past it is amortised (`test_growth_is_amortised_up_to_the_budgets_limit`)."""
    lens = [3, 400, 17]
    cap = max(lens) + 1 + GROW_SLOTS
    tails, pages = _pair(lens, 1, cap)
    assert [len(h) for h in pages.held] == [1, 26, 2]
    assert pages.capacity >= cap and pages.table.shape == (3, -(-cap // BLOCK))
    assert len({p for h in pages.held for p in h}) == 29  # no page held twice
    assert pages.pages == 29 and not pages.free
    assert pages.nbytes < 0.3 * tails.nbytes


def test_growth_is_amortised_up_to_the_budgets_limit() -> None:
    """Two rows whose pages are full each start a page: without a limit the storage grows by
    `GROW_SLOTS` per row ahead (as the tails grow), with one (a KV budget's room) by no more than it
    allows, and by what the rows need even past it (the budget's pressure preempts, not the storage)."""
    lens = [BLOCK, 2 * BLOCK]
    cap = 4 * GROW_SLOTS
    grown = {}
    for limit in (None, 5, 2):
        _, pages = _pair(lens, 0, cap)
        assert pages.pages == 3
        pages.limit = None if limit is None else limit * pages.page_bytes
        predicted = pages.growth(lens, 1, cap)
        pages.fit(lens, 1, cap)
        assert predicted == (pages.pages - 3) * pages.page_bytes
        grown[limit] = pages.pages
    assert grown == {None: 3 + 2 + 2 * GROW_SLOTS // BLOCK, 5: 5, 2: 5}


def test_writes_reads_and_rows_agree(copies: str) -> None:
    lens = [5, 33, 16]
    tails, pages = _pair(lens, 2, 48)
    for kv in (tails, pages):
        _fill(kv, lens)
    _same(tails, pages, lens)
    gen = torch.Generator().manual_seed(1)
    key, value = torch.randn(3, H, 2, D, generator=gen), torch.randn(3, H, 2, D, generator=gen)
    at = torch.tensor(lens)[:, None] + torch.arange(2)
    for kv in (tails, pages):
        kv.write(1, key, value, kv.locate(at))
    grown = [n + 2 for n in lens]
    _same(tails, pages, grown)
    kt, vt = tails.read(1, max(grown))
    kp, vp = pages.read(1, max(grown))
    for pos, n in enumerate(grown):  # slots past a row's length are never read unmasked
        torch.testing.assert_close(kt[pos, :, :n], kp[pos, :, :n], rtol=0, atol=0)
        torch.testing.assert_close(vt[pos, :, :n], vp[pos, :, :n], rtol=0, atol=0)


def test_an_ended_rows_pages_go_back_at_once_and_leaving_rows_shrink_the_storage() -> None:
    """A row that ended gives its pages back before the batch compacts (the rows still decoding
    take them: no new storage) and writes only into a sink page after; once most of the storage
    is free, and at compaction, it shrinks to the pages the rows hold, as the tails shrink."""
    lens = [40, 20, 9]
    tails, pages = _pair(lens, 1, 41)  # no free slots ahead: no free pages beside the rows' own
    for kv in (tails, pages):
        _fill(kv, lens)
    gone = list(pages.held[1])
    pages.release(1)
    assert set(gone) <= set(pages.free) and not pages.held[1]
    storage = pages.pages
    pages.fit([40, 20, 9], 20, 64)  # rows 0 and 2 grow into the freed pages
    tails.fit([40, 20, 9], 20, 64)
    assert pages.pages == storage
    pad = torch.ones(3, H, 1, D)
    pages.write(
        0, pad, pad, pages.locate(torch.tensor([[40], [20], [9]]))
    )  # the ended row's pad goes to the sink
    _same(tails, pages, [40, 0, 9])
    for kv in (tails, pages):
        kv.select_rows(torch.tensor([0, 2]))
    _same(tails, pages, [40, 9])
    assert pages.pages == sum(map(len, pages.held)) and pages.sink is None  # no ended row left: no sink
    lens = [40, 100]
    tails, pages = _pair(lens, 1, 101)
    for kv in (tails, pages):
        _fill(kv, lens)
    pages.release(1)  # most of the storage free now: packed to what row 0 holds, and the sink
    assert pages.pages == 1 + len(pages.held[0]) and not pages.free
    _same(tails, pages, [40])


@pytest.mark.parametrize("per_head", [False, True])
def test_an_eviction_moves_alike_and_frees_whole_pages(per_head: bool, copies: str) -> None:
    lens = [45, 12]
    tails, pages = _pair(lens, 1, 64)
    for kv in (tails, pages):
        _fill(kv, lens)
    kept = torch.tensor([0, 1, 2, 3, 30, 31, 40, 44])  # row 0 keeps 8 of its 45 slots, from slot 0
    index = kept.expand(L, H, -1).contiguous() if per_head else kept
    if per_head:  # each head its own slots
        index = index.clone()
        index[1, 1] = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    before = len(pages.free)
    for kv in (tails, pages):
        kv.move(0, 0, index, 8)
    _same(tails, pages, [8, 12])
    assert len(pages.held[0]) == 1 and len(pages.free) == before + 2


def test_bad_layout_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"kv_layout='heap' is not one of 'tails', 'pages'"):
        check_layout("heap")


def test_the_default_is_pages_on_a_cpu_that_can_build_their_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages on a CPU with a compiler; tails where the kernel cannot be built (steps would read a
    copy of the pages, slower than the tails) and on CUDA (no paged kernel wired there yet);
    `$BRANCHWISE_KV_LAYOUT` wins over both, and a bad value there names the field."""
    from branchwise.backends.hf import cpu_kernels, own_kv

    monkeypatch.delenv(own_kv.LAYOUT_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "missing", lambda: None)
    assert own_kv.default_layout(torch.device("cpu")) == "pages"
    assert own_kv.default_layout(torch.device("cuda")) == "tails"
    monkeypatch.setattr(cpu_kernels, "missing", lambda: "no C++ compiler")
    assert own_kv.default_layout(torch.device("cpu")) == "tails"
    monkeypatch.setenv(own_kv.LAYOUT_ENV, "pages")
    assert own_kv.default_layout(torch.device("cuda")) == "pages"
    monkeypatch.setenv(own_kv.LAYOUT_ENV, "heap")
    with pytest.raises(ValueError, match="kv_layout='heap'"):
        own_kv.default_layout(torch.device("cpu"))


@pytest.fixture(scope="module")
def backend(tiny_model_dir) -> HFBackend:
    return HFBackend(tiny_model_dir("llama"))


def _decode(backend: HFBackend, layout: str, mode: str = "eager") -> list[list[int]]:
    backend.kv_layout = layout  # type: ignore[assignment]
    backend.decode_step = mode  # type: ignore[assignment]
    backend.reset_stats()
    root = backend.prefill(backend.encode("A shared prompt that every branch reads once per step. " * 3))
    kids = backend.fork(root, 4)
    backend.release([root])
    backend.append(kids, [backend.encode(h) for h in ["", " a", " b c d", " e" * 20]])
    params = [DecodeParams(max_tokens=m, min_tokens=m) for m in (5, 60, 30, 9)]
    gens = backend.extend(kids, params[0], row_params=params)
    backend.release(kids)
    return [g.token_ids for g in gens]


def test_pages_give_the_tails_tokens_and_are_read_in_place(backend: HFBackend) -> None:
    """Greedy, fp32: a shared prompt, rows of unequal lengths ending apart and growing past their
    first pages: the tokens of the tails and of the layer loop; each step read the pages in place
    (no step counted as reading a copy, once the kernel is built: `build_ahead` starts it at the
    layout's choice, and this waits for it)."""
    from branchwise.backends.hf import cpu_kernels

    assert cpu_kernels.build() is None
    layers = _decode(backend, "tails", "layers")
    tails = _decode(backend, "tails")
    pages = _decode(backend, "pages")
    stats = backend.kv_stats().as_dict()
    assert pages == tails == layers
    assert stats.get("decode_steps_fixed", 0) >= 59
    assert not [k for k in stats if k.startswith(OFF_FAST_BY)]


def test_a_paged_step_that_reads_a_copy_says_why(tiny_model_dir) -> None:
    """float16 on a CPU: the kernel reads float32 and bfloat16, so each step reads a gathered copy
    of the pages, and the statistics name the reason (same tokens)."""
    backend = HFBackend(tiny_model_dir("llama"), dtype="float16", kv_layout="pages")
    root = backend.prefill(backend.encode("Half precision on a CPU."))
    gen = backend.extend([root], DecodeParams(max_tokens=6, min_tokens=6))[0]
    stats = backend.kv_stats().as_dict()
    key = f"{OFF_FAST_BY}{OffFast.PAGES_COPIED.value}: the paged decode kernel reads float32 and bfloat16, not torch.float16"
    assert stats.get(key, 0) >= 5
    backend.kv_layout = "tails"
    root2 = backend.prefill(backend.encode("Half precision on a CPU."))
    assert backend.extend([root2], DecodeParams(max_tokens=6, min_tokens=6))[0].token_ids == gen.token_ids


def test_no_step_waits_for_the_cpu_kernels_build(backend: HFBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the paged kernel is still being built (the first time on a machine, in the background
    from the backend's load), the steps read a copy of their pages instead of waiting for the
    compiler, say so, and give the same tokens."""
    from branchwise.backends.hf import cpu_kernels

    tails = _decode(backend, "tails")
    started: list[bool] = []
    monkeypatch.setattr(cpu_kernels, "_done", False)  # as while the build thread runs
    monkeypatch.setattr(cpu_kernels, "build_ahead", lambda: started.append(True))
    pages = _decode(backend, "pages")
    stats = backend.kv_stats().as_dict()
    assert pages == tails and started
    assert stats.get(f"{OFF_FAST_BY}{OffFast.PAGES_COPIED.value}: {cpu_kernels.BUILDING}", 0) >= 59
