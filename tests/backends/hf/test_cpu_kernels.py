"""The paged decode kernel (`cpu_kernels.py`, `csrc/paged_decode.cpp`) against its plain-torch
reference: output and log-sum-exp over pools whose blocks are shuffled, grouped heads, lengths that
are not multiples of the block (one token, one block, none), rows split across threads and merged,
shared segments read in the same softmax by the rows under them, bfloat16; the op inside `torch.compile(fullgraph=True)`; and a missing compiler reported as a
reason instead of an exception.

Tests that need the built extension skip, saying why, where it cannot be built (no compiler); the
build is cached under `$BRANCHWISE_CACHE_DIR/extensions`, so only a machine's first run compiles.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.cpu_kernels import (
    PagedKernelUnavailable,
    Segments,
    paged_decode,
    paged_decode_mass,
    paged_decode_reference,
)


@pytest.fixture(scope="module")
def kernel() -> None:
    """Skip unless the extension builds (or is in the cache) here."""
    reason = cpu_kernels.build()
    if reason is not None:
        pytest.skip(f"the paged decode kernel cannot be built here: {reason}")


Case = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_case(
    lens: list[int],
    heads: int = 9,
    kv_heads: int = 3,
    dim: int = 64,
    block: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Case:
    """(q, k_pool, v_pool, block_table, lens): each row's blocks drawn at random from a pool with
    spare blocks, so no row's blocks are adjacent or in order; unused table entries hold garbage
    block ids past the pool, which the kernel must never read."""
    gen = torch.Generator().manual_seed(seed)
    owned = [-(-n // block) for n in lens]
    n_blocks = sum(owned) + 5
    k_pool = torch.randn(n_blocks, kv_heads, block, dim, generator=gen).to(dtype)
    v_pool = torch.randn(n_blocks, kv_heads, block, dim, generator=gen).to(dtype)
    order = torch.randperm(n_blocks, generator=gen)
    table = torch.full((len(lens), max([*owned, 1]) + 2), 10**6, dtype=torch.int32)
    at = 0
    for row, n in enumerate(owned):
        table[row, :n] = order[at : at + n]
        at += n
    q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)
    return q, k_pool, v_pool, table, torch.tensor(lens, dtype=torch.int32)


def check(case: Case, atol: float = 1e-5, chunk_blocks: int = 0) -> None:
    """The kernel's output and LSE equal the float64 reference over the same blocks."""
    q, k_pool, v_pool, table, lens = case
    scale = q.shape[-1] ** -0.5
    out, lse = paged_decode(q, k_pool, v_pool, table, lens, scale, chunk_blocks)
    want_out, want_lse = paged_decode_reference(
        q.double(), k_pool.double(), v_pool.double(), table, lens, scale
    )
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "dim", "block"),
    [
        ([1024], 9, 3, 64, 16),  # one long row: split across threads, merged by LSE
        ([1, 5, 16, 17, 100, 333, 1000, 1024], 9, 3, 64, 16),  # ragged, GQA
        ([1], 9, 3, 64, 16),  # one token
        ([16, 7], 4, 4, 64, 16),  # exactly one block; less than one; no grouping
        ([70, 1, 300, 64], 8, 2, 128, 32),  # a larger head
        ([70, 1, 300, 64], 6, 3, 80, 8),  # a head size the kernel does not specialise
        ([130, 45], 2, 1, 64, 128),  # blocks longer than the kernel's tile
    ],
)
def test_equals_the_reference(lens: list[int], heads: int, kv_heads: int, dim: int, block: int) -> None:
    check(make_case(lens, heads, kv_heads, dim, block))


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("chunk_blocks", [1, 3, 1000])
def test_rows_split_into_chunks_merge_to_the_same_result(chunk_blocks: int) -> None:
    check(make_case([1, 40, 257, 600], seed=1), chunk_blocks=chunk_blocks)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize(
    ("chunk_blocks", "dtype"), [(0, torch.float32), (1, torch.float32), (0, torch.bfloat16)]
)
def test_mass_is_each_slots_attention_summed_over_heads_against_all_read(
    chunk_blocks: int, dtype: torch.dtype
) -> None:
    """`paged_decode_mass`: `paged_decode`'s output and LSE, split or not, and per own slot (block
    j // BS, offset j % BS of the row's table) `exp(scale * q.k - lse)` summed over the query heads,
    where the LSE covers the shared segments too, 0 past each row's length: a row under no segment
    gives its own slots all the mass (one per query head), a row under one less."""
    lens = [0, 5, 16, 37, 300]
    q, k_pool, v_pool, table, lens_t = make_case(lens, heads=6, kv_heads=3, dim=64, block=16)
    q, k_pool, v_pool = q.to(dtype), k_pool.to(dtype), v_pool.to(dtype)
    segments = make_segments([[1, 3], [4]], [40, 7], dtype=dtype)
    scale = 0.125
    out, lse, mass = paged_decode_mass(q, k_pool, v_pool, table, lens_t, scale, chunk_blocks, segments)
    want_out, want_lse = paged_decode(q, k_pool, v_pool, table, lens_t, scale, chunk_blocks, segments)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    assert mass.shape == (5, table.shape[1] * 16) and mass.dtype == torch.float32
    _, ref_lse = paged_decode_reference(q, k_pool, v_pool, table, lens_t, scale, segments)
    for row, n in enumerate(lens):
        assert not mass[row, n:].any()
        blocks = table[row, : -(-n // 16)].long()
        keys = k_pool[blocks].float().transpose(0, 1).reshape(3, -1, 64)[:, :n]  # [H_kv, n, D]
        scores = (q[row].float().view(3, 2, 64) @ keys.transpose(1, 2) * scale).reshape(6, n)
        want = torch.exp(scores - ref_lse[row][:, None]).sum(0)
        torch.testing.assert_close(mass[row, :n], want, rtol=1e-4, atol=1e-5)
    assert mass[2].sum().item() == pytest.approx(6.0, abs=1e-3)
    assert mass[0].sum().item() == 0.0 and mass[1].sum().item() < 6.0 - 1e-3


@pytest.mark.usefixtures("kernel")
def test_an_empty_row_gives_zeros_and_minus_infinity() -> None:
    q, k_pool, v_pool, table, lens = make_case([0, 20])
    out, lse = paged_decode(q, k_pool, v_pool, table, lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()


@pytest.mark.usefixtures("kernel")
def test_bfloat16_within_its_rounding() -> None:
    """bf16 K/V/q accumulate in fp32: the output differs from the fp64 reference over the same bf16
    values by about one bf16 rounding of the output."""
    check(make_case([3, 77, 500], dtype=torch.bfloat16, seed=2), atol=2e-2)


@pytest.mark.usefixtures("kernel")
def test_reads_a_token_major_pool_through_its_strides() -> None:
    """A pool kept `[N, block, H_kv, D]` (vLLM's and FlashInfer's NHD) is read through a permuted
    view, without a copy."""
    q, k_pool, v_pool, table, lens = make_case([33, 200])
    nhd_k, nhd_v = k_pool.transpose(1, 2).contiguous(), v_pool.transpose(1, 2).contiguous()
    got, got_lse = paged_decode(q, nhd_k.transpose(1, 2), nhd_v.transpose(1, 2), table, lens, 0.125)
    want, want_lse = paged_decode(q, k_pool, v_pool, table, lens, 0.125)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-6)


@pytest.mark.usefixtures("kernel")
def test_partial_results_merge_by_lse_into_attention_over_both() -> None:
    """What the cascade does with the LSE: a row's attention over a shared prefix and over its own
    blocks, computed apart and merged, equals attention over the concatenated KV."""
    q, k_pool, v_pool, table, _ = make_case([50, 130], seed=3)
    prefix = torch.tensor([[int(table[0, i]) for i in range(4)]] * 2, dtype=torch.int32)
    own_table = table[:, 4:].contiguous()
    own_table[1, :5] = table[1, :5]
    own_lens = torch.tensor([0, 70], dtype=torch.int32)
    pre_lens = torch.tensor([64, 64], dtype=torch.int32)
    o1, l1 = paged_decode(q, k_pool, v_pool, prefix, pre_lens, 0.125)
    o2, l2 = paged_decode(q, k_pool, v_pool, own_table, own_lens, 0.125)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - lse)[..., None] + o2 * torch.exp(l2 - lse)[..., None]
    both = torch.cat([prefix, own_table], 1)
    # row 0: the prefix alone (no own blocks); row 1: the prefix's 4 blocks, then its own
    both_lens = torch.tensor([64, 64 + 70], dtype=torch.int32)
    want, want_lse = paged_decode_reference(q, k_pool, v_pool, both, both_lens, 0.125)
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)


def make_segments(
    rows: list[list[int]],
    tokens: list[int],
    kv_heads: int = 3,
    dim: int = 64,
    dtype: torch.dtype = torch.float32,
) -> Segments:
    """Shared segments of `tokens[i]` keys read by `rows[i]`, each a strided view (one layer of a
    `[layers, H_kv, T, D]` buffer, as a node keeps its KV), not a fresh contiguous tensor."""
    gen = torch.Generator().manual_seed(7)
    keys, values = [], []
    for n in tokens:
        keys.append(torch.randn(2, kv_heads, n + 3, dim, generator=gen).to(dtype)[1, :, 3:])
        values.append(torch.randn(2, kv_heads, n + 3, dim, generator=gen).to(dtype)[1, :, 3:])
    return Segments(keys, values, [torch.tensor(r, dtype=torch.int32) for r in rows])


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("chunk_blocks", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_segments_read_in_the_same_softmax_as_each_rows_blocks(
    chunk_blocks: int, dtype: torch.dtype
) -> None:
    """A tree's ancestors handed to the kernel: each row's output and LSE are attention over its own
    blocks and every segment it reads, as if concatenated. Rows under no segment, a row with no
    own tokens, segments of one token and of several tiles, and many rows under one segment."""
    lens = [50, 0, 17, 130, 1, 9, 40, 3, 64, 65, 2, 31]
    q, k_pool, v_pool, table, lens_t = make_case(lens, dtype=dtype, seed=5)
    # row 2 reads no segment; the first segment's 33 queries a KV head are read by one matrix
    # product, the others' by the kernel's tiles
    under_first = [row for row in range(12) if row != 2]
    segments = make_segments([under_first, [0, 3], [1], [3]], [100, 33, 1, 200], dtype=dtype)
    scale = 0.125
    out, lse = paged_decode(q, k_pool, v_pool, table, lens_t, scale, chunk_blocks, segments)
    want_out, want_lse = paged_decode_reference(
        q.double(),
        k_pool.double(),
        v_pool.double(),
        table,
        lens_t,
        scale,
        Segments([k.double() for k in segments.keys], [v.double() for v in segments.values], segments.rows),
    )
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=atol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-4)


@pytest.mark.usefixtures("kernel")
def test_padding_readers_and_unread_segments_change_nothing() -> None:
    """What a compiled step pads with (`step_attention.KernelSegments`): -1 among a segment's
    readers names no row, and a segment that only -1 reads is skipped, whatever its keys hold; the
    output and LSE are exactly those of the real segments alone."""
    q, k_pool, v_pool, table, lens = make_case([40, 70, 5], seed=8)
    real = make_segments([[0, 1, 2], [1]], [64, 20])
    noise = make_segments([[-1, -1], [-1, -1]], [2, 7])
    padded = Segments(
        [*real.keys, *noise.keys],
        [*real.values, *noise.values],
        [
            torch.tensor([0, 1, 2, -1], dtype=torch.int32),
            torch.tensor([1, -1], dtype=torch.int32),
            *noise.rows,
        ],
    )
    for run in (paged_decode, paged_decode_mass):
        want = run(q, k_pool, v_pool, table, lens, 0.125, 0, real)
        got = run(q, k_pool, v_pool, table, lens, 0.125, 0, padded)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.usefixtures("kernel")
def test_bad_inputs_are_refused() -> None:
    q, k_pool, v_pool, table, lens = make_case([20, 40])
    with pytest.raises(RuntimeError, match="outside the pool"):
        paged_decode(q, k_pool, v_pool, table.fill_(10**6), lens, 0.125)
    q, k_pool, v_pool, table, lens = make_case([20, 40])
    with pytest.raises(RuntimeError, match="outside 0"):
        paged_decode(q, k_pool, v_pool, table[:, :1], lens, 0.125)
    with pytest.raises(RuntimeError, match="not a multiple"):
        paged_decode(q[:, :8], k_pool, v_pool, table, lens, 0.125)
    with pytest.raises(RuntimeError, match="int32"):
        paged_decode(q, k_pool, v_pool, table.long(), lens, 0.125)
    with pytest.raises(RuntimeError, match=r"names row 2, outside 0\.\.1"):
        paged_decode(q, k_pool, v_pool, table, lens, 0.125, 0, make_segments([[2]], [8]))
    with pytest.raises(RuntimeError, match=r"segment 0 keys and values must be \[H_kv=3"):
        paged_decode(q, k_pool, v_pool, table, lens, 0.125, 0, make_segments([[0]], [8], kv_heads=1))
    with pytest.raises(RuntimeError, match="segment 0 must have the pool's dtype"):
        paged_decode(
            q, k_pool, v_pool, table, lens, 0.125, 0, make_segments([[0]], [8], dtype=torch.bfloat16)
        )


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("mass", [False, True])
def test_inside_torch_compile_fullgraph(mass: bool) -> None:
    """The fake kernels give inductor the ops' shapes: a compiled function around either is one
    graph, and computes what the eager op computes."""
    q, k_pool, v_pool, table, lens = make_case([9, 64, 100], seed=4)
    segments = make_segments([[0, 2]], [30])

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if mass:
            out, lse, got = paged_decode_mass(q * 2.0, k, v, table, lens, 0.125, 0, segments)
            return out.sum(-1) + 1.0, lse.exp(), got * 2.0
        out, lse = paged_decode(q * 2.0, k, v, table, lens, 0.125, 0, segments)
        return out.sum(-1) + 1.0, lse.exp()

    compiled = torch.compile(attend, fullgraph=True)
    got = compiled(q, k_pool, v_pool)
    want = attend(q, k_pool, v_pool)
    assert len(got) == len(want) == 2 + mass
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The module as if no build had been tried in this process (restored after the test)."""
    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_reason", None)
    monkeypatch.setattr(cpu_kernels, "_info", None)
    return monkeypatch


def test_no_compiler_gives_a_reason(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("CXX", "no-such-compiler-here")
    reason = cpu_kernels.build()
    assert reason is not None and "no C++ compiler" in reason and "no-such-compiler-here" in reason
    assert cpu_kernels.unavailable_reason() == reason and cpu_kernels.build_info() is None
    q, k_pool, v_pool, table, lens = make_case([4])
    with pytest.raises(PagedKernelUnavailable, match="no C\\+\\+ compiler"):
        paged_decode(q, k_pool, v_pool, table, lens, 0.125)


def test_the_build_outlives_a_daemon_starter_and_says_so_at_exit(
    fresh: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The builder is started from the (daemon) compute thread, and a thread inherits its starter's
    flag: it must be no daemon all the same, or exit cuts the build short every time (each short
    run on a fresh machine built anew and read a copy). While it runs at exit, the wait is said."""
    release = threading.Event()
    fresh.setattr(cpu_kernels, "_builder", None)
    fresh.setattr(cpu_kernels, "build", lambda: release.wait(30))
    starter = threading.Thread(target=cpu_kernels.build_ahead, daemon=True)
    starter.start()
    starter.join(10)
    builder = cpu_kernels._builder
    assert builder is not None and builder.is_alive() and not builder.daemon
    with caplog.at_level("WARNING", logger=cpu_kernels.__name__):
        cpu_kernels._say_exit_wait()
    assert "finishing the paged decode kernel's build before exiting" in caplog.text
    release.set()
    builder.join(10)
    caplog.clear()
    cpu_kernels._say_exit_wait()
    assert not caplog.text  # once built, exit says nothing


def test_ninja_from_the_package_when_none_is_on_path(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process whose PATH has a compiler but no ninja (an environment run without activating it)
    finds the ninja the `ninja` dependency installed, so its KV can still live in pages."""
    ninja = pytest.importorskip("ninja")
    compiler = shutil.which(cpu_kernels._compiler())
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    (tmp_path / "c++").symlink_to(compiler)
    fresh.setenv("CXX", "c++")
    fresh.setenv("PATH", str(tmp_path))
    assert shutil.which("ninja") is None
    assert cpu_kernels.missing() is None
    assert shutil.which("ninja") == str(Path(ninja.BIN_DIR) / "ninja")


def test_a_failed_build_gives_its_error_as_the_reason(fresh: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from torch.utils import cpp_extension

    def broken(**_: object) -> None:
        raise RuntimeError("Error building extension 'branchwise_paged_decode': error: expected ';'")

    fresh.setattr(cpp_extension, "is_ninja_available", lambda: True)
    fresh.setattr(cpp_extension, "load", broken)
    fresh.setattr(cpu_kernels, "build_dir", lambda: tmp_path)
    reason = cpu_kernels.build()
    assert reason is not None and "Error building extension" in reason
    assert cpu_kernels.build() == reason  # tried once per process, the answer kept


@pytest.mark.usefixtures("kernel")
def test_a_lock_left_by_a_builder_that_died_is_taken_over() -> None:
    """torch's build guard is a file only its holder removes: a process killed while it built left
    it, and every later process waited on it forever. A new process builds (or loads) through it."""
    import subprocess
    import sys

    info = cpu_kernels.build_info()
    assert info is not None
    stale = info.path.parent / "lock"
    stale.touch()  # what a builder killed mid-build leaves
    try:
        done = subprocess.run(
            [sys.executable, "-c", "from branchwise.backends.hf import cpu_kernels as p; print(p.build())"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stale.unlink(missing_ok=True)
    assert done.returncode == 0 and done.stdout.strip() == "None", done.stderr[-2000:]
    assert "removed the build lock a process left" in done.stderr


def _pools(
    layers: int = 3, pages: int = 6, heads: int = 2, block: int = 4, dim: int = 5
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(pages, heads, block, dim, generator=gen) for _ in range(layers)]


@pytest.mark.usefixtures("kernel")
def test_pages_gather_reads_every_layers_slots_in_one_call() -> None:
    pools = _pools()
    page, off = torch.tensor([4, 4, 1, 0, 5]), torch.tensor([3, 0, 2, 2, 1])
    got = cpu_kernels.pages_gather(pools, page, off)
    want = torch.stack([p.transpose(0, 1)[:, page, off] for p in pools])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("per_head", [False, True])
def test_pages_move_packs_kept_slots_reading_all_before_writing(per_head: bool) -> None:
    """A row over pages [2, 5, 0] keeps some of its 12 slots, packed from its slot 1: sources and
    destinations overlap, so every slot must be read before any is written (as torch's gather then
    scatter does)."""
    pools = _pools()
    held = torch.tensor([2, 5, 0])
    slots = torch.arange(12)
    page, off = held[slots // 4], slots % 4
    index = torch.tensor([1, 2, 6, 9, 11])
    if per_head:
        index = index.expand(3, 2, -1).clone()
        index[1, 0] = torch.tensor([3, 4, 5, 6, 7])
    dst = torch.arange(1, 6)
    want = [p.clone() for p in pools]
    for layer, p in enumerate(want):
        for h in range(2):
            idx = index[layer, h] if per_head else index
            moved = p[page[idx], h, off[idx]].clone()
            p[held[dst // 4], h, dst % 4] = moved
    cpu_kernels.pages_move(pools, page, off, index, held[dst // 4], dst % 4)
    for got, expected in zip(pools, want, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.usefixtures("kernel")
def test_pages_copies_refuse_slots_outside_the_pool() -> None:
    pools = _pools()
    with pytest.raises(RuntimeError, match=r"page\[1\] = 6 is outside 0\.\.5"):
        cpu_kernels.pages_gather(pools, torch.tensor([0, 6]), torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match=r"off\[0\] = 4 is outside 0\.\.3"):
        cpu_kernels.pages_gather(pools, torch.tensor([0]), torch.tensor([4]))
    page, off = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="index 2 outside the row's 2 slots"):
        cpu_kernels.pages_move(pools, page, off, torch.tensor([2]), torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"index must be \[K\] or \[L, H, K\]"):
        cpu_kernels.pages_move(pools, page, off, torch.zeros(2, 2, 1, dtype=torch.long), page[:1], off[:1])
