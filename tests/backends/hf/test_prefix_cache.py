"""The prefix cache across requests: finished requests leave their exact KV in the tree, a new
`prefill` computes only what no cached path holds, live requests pin what they read, and unpinned
leaves are evicted least recently used first under the byte budget."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from branchwise.backends.accel import Accel, RSBCMConfig
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.prefix_cache import PrefixCache
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.tree import KVTree

GREEDY = DecodeParams(max_tokens=6, min_tokens=6)
BASE = "Question: How many apples are left? Let's think step by step about the problem. " * 2


def request(
    backend: HFBackend, ids: list[int], n: int = 1, **session: object
) -> tuple[list[list[int]], dict]:
    """What the request scheduler does per request: prefill, fork, extend, release."""
    run = backend.session(**session)  # type: ignore[arg-type]
    root = run.prefill(ids)
    kids = run.fork(root, n)
    gens = run.extend(kids, GREEDY)
    run.release([*kids, root])
    return [g.token_ids for g in gens], run.kv_stats().as_dict()


def cached_segments(backend: HFBackend) -> list[Segment]:
    return [s for s in backend.tree.segments() if s.cached]


def check_ledgers(backend: HFBackend) -> None:
    tree = backend.tree
    assert tree.accounts.cache.held == sum(s.kv_bytes for s in cached_segments(backend))
    assert tree.accounts.total.held == sum(s.kv_bytes for s in tree.segments() if not s.cached)


def test_greedy_tokens_equal_with_and_without_the_cache(tiny_arch_dir: Path) -> None:
    """A sequence of requests that share and diverge at various points, decoded with and without
    the cache: the same greedy tokens, and the cache really served the shared prefixes."""
    cached, plain = HFBackend(tiny_arch_dir), HFBackend(tiny_arch_dir, cache_bytes=0)
    base = cached.encode(BASE)
    other = cached.encode(" 1 2 3 4 5 6 7 8 9 10 11 12. The answer is 42.")
    first, stats = request(cached, base)
    assert first == request(plain, base)[0] and stats["cache_hit_tokens"] == 0
    cut = PrefixCache().min_split
    assert len(base) > 2 * cut and len(other) > cut
    requests = [
        base,  # an exact repeat: all but the last token hit
        base + other,  # extends a cached path
        base[: cut + 2] + other,  # diverges inside a cached segment: split
        base[: cut + 2] + other[:cut] + base,  # shares the split head, then splits its child
        base + first[0][:-1] + other,  # a conversation's next turn: prompt + answer + more
        base[:4],  # a short prefix of everything: too short to split a node for
        other + base,  # nothing in common at the root
    ]
    hits = []
    for ids in requests:
        out, stats = request(cached, ids, n=2)
        ref, ref_stats = request(plain, ids, n=2)
        assert out == ref, ids
        assert stats["cache_hit_tokens"] + stats["cache_miss_tokens"] == len(ids)
        assert stats["tokens_computed"] == ref_stats["tokens_computed"] - stats["cache_hit_tokens"]
        hits.append(stats["cache_hit_tokens"])
        check_ledgers(cached)
    assert hits[0] == len(base) - 1 and hits[1] >= len(base)
    assert hits[2] == cut + 2 and hits[3] == cut + 2 + cut
    assert hits[4] >= len(base) + len(first[0]) - 1
    assert hits[5] == 0 and hits[6] == 0
    assert cached.kv_stats().bytes_held == 0 and cached.kv_stats().cache_bytes > 0
    assert len(plain.tree) == 0


def test_cache_off_behaves_as_today(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    ids = backend.encode(BASE)
    for _ in range(2):
        _, stats = request(backend, ids)
        assert stats["tokens_computed"] == len(ids) + GREEDY.max_tokens - 1
        assert stats["cache_hit_tokens"] == stats["cache_miss_tokens"] == stats["cache_evictions"] == 0
        assert len(backend.tree) == 0 and backend.tree.accounts.cache.held == 0


def test_a_live_branch_pins_what_it_reads(tiny_llama_dir: Path) -> None:
    backend, plain = HFBackend(tiny_llama_dir), HFBackend(tiny_llama_dir, cache_bytes=0)
    base = backend.encode(BASE)
    request(backend, base)
    request(backend, backend.encode("The quick brown fox jumps over the lazy dog."))
    run = backend.session()
    root = run.prefill([*base, 5, 6, 7])
    assert run.kv_stats().cache_hit_tokens == len(base)
    pinned = [s for s in backend.tree.get(root).kv_ancestors()]
    backend.cache_bytes = 1  # everything unpinned must go; the matched path must stay
    assert all(s.id in backend.tree for s in pinned) and all(s.cached for s in pinned)
    assert backend.tree.accounts.cache.held == sum(s.kv_bytes for s in pinned) > 1
    kids = run.fork(root, 2)
    assert [g.token_ids for g in run.extend(kids, GREEDY)] == request(plain, [*base, 5, 6, 7], n=2)[0]
    run.release([*kids, root])
    assert run.kv_stats().cache_evictions > 0  # the pins went; the cache came back to its budget
    assert backend.tree.accounts.cache.held <= 1 and len(backend.tree) == 0
    check_ledgers(backend)


def test_lru_evicts_least_recently_used_leaves_first(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)

    def prompt_only(ids: list[int]) -> None:  # decode on the root itself: only the prompt is kept
        root = backend.prefill(ids)
        backend.extend([root], DecodeParams(max_tokens=1))
        backend.release([root])

    a, b, c = (backend.encode(t) for t in ("Yes. No. Maybe.", "To be or not to be", "1 2 3 4 5 6"))
    tail = backend.encode(" Therefore, so")
    for ids in (a, b, c, a + tail):  # the last one touches a and leaves its tail below a
        prompt_only(ids)
    roots = backend.tree.prefix.roots
    assert sorted(s.tokens for s in roots.values()) == sorted([a, b, c])
    order = []
    while backend.tree.accounts.cache.held:
        before = {s.id: s for s in cached_segments(backend)}
        backend.cache_bytes = backend.tree.accounts.cache.held - 1
        gone = [s for i, s in before.items() if i not in backend.tree]
        assert len(gone) == 1 and backend.tree.accounts.cache.held <= backend.cache_bytes
        check_ledgers(backend)
        order.append(gone[0].tokens)
    assert order == [b, c, tail, a]  # b and c were used before a; a's tail is a leaf before a
    assert backend.tree.prefix.evictions == 4 and len(backend.tree) == 0


def test_stats_report_hits_misses_and_evictions(tiny_llama_dir: Path) -> None:
    backend = HFBackend(tiny_llama_dir)
    ids = backend.encode(BASE)
    _, first = request(backend, ids)
    _, again = request(backend, ids)
    assert (first["cache_hit_tokens"], first["cache_miss_tokens"]) == (0, len(ids))
    assert (again["cache_hit_tokens"], again["cache_miss_tokens"]) == (len(ids) - 1, 1)
    assert again["tokens_computed"] == 1 + GREEDY.max_tokens - 1
    backend.cache_bytes = backend.tree.accounts.cache.held  # full: the next request must evict
    _, third = request(backend, backend.encode("The quick brown fox"))
    assert third["cache_evictions"] > 0 and third["cache_bytes"] <= backend.cache_bytes


def test_inexact_kv_never_enters_the_cache(tiny_llama_dir: Path) -> None:
    """Runs with an acceleration that may alter KV neither insert nor match; evicted KV is not kept."""
    backend, plain = HFBackend(tiny_llama_dir), HFBackend(tiny_llama_dir, cache_bytes=0)
    ids = backend.encode(BASE)
    accel = Accel(rsbcm=RSBCMConfig(capacity_blocks=2, block_tokens=4))
    _, stats = request(backend, ids, accel=accel)
    assert backend.tree.accounts.cache.held == 0 and stats["cache_hit_tokens"] == 0
    request(backend, ids)  # a plain run fills the cache ...
    _, stats = request(backend, ids, accel=accel)
    assert stats["cache_hit_tokens"] == 0  # ... which an inexact run does not read
    assert request(backend, ids)[0] == request(plain, ids)[0]
    tree = KVTree(prefix=PrefixCache(budget=1 << 20))
    seg = tree.add(None, False, [1, 2, 3], Ledger())
    tree.set_kv(seg, [torch.zeros(1, 3, 2)], [torch.zeros(1, 3, 2)])
    seg.n_computed = 3
    tree.keep_kv(seg, torch.tensor([True, False, True]))
    assert tree.release(seg.id) == [seg] and tree.accounts.cache.held == 0


def test_growing_a_node_drops_its_cached_children(tiny_llama_dir: Path) -> None:
    """A child released under a live node is cached, but the node may still grow."""
    backend, plain = HFBackend(tiny_llama_dir), HFBackend(tiny_llama_dir, cache_bytes=0)
    ids = backend.encode(BASE)
    outs = []
    for be in (backend, plain):
        root = be.prefill(ids)
        first = be.extend([root], GREEDY)[0].token_ids
        child = be.fork(root, 1)
        second = be.extend(child, GREEDY)[0].token_ids
        be.release(child)
        outs.append((first, second, be.extend([root], GREEDY)[0].token_ids))
        be.release([root])
    assert outs[0] == outs[1]
    assert backend.kv_stats().cache_evictions == 1


def test_concurrent_sessions_share_the_cache_safely(tiny_llama_dir: Path) -> None:
    backend, plain = HFBackend(tiny_llama_dir), HFBackend(tiny_llama_dir, cache_bytes=0)
    base = backend.encode(BASE)
    prompts = [base + backend.encode(f" What is {i} + {i}?") for i in range(6)]

    def conversation(be: HFBackend, ids: list[int]) -> list[list[int]]:
        out = []
        for turn in range(3):
            tokens, _ = request(be, ids)
            out.append(tokens[0])
            ids = ids + tokens[0][:-1] + backend.encode(f" Turn {turn}.")
        return out

    serial = [conversation(plain, p) for p in prompts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = list(pool.map(lambda p: conversation(backend, p), prompts))
    assert concurrent == serial
    assert backend.kv_stats().bytes_held == 0 and backend.tree.accounts.cache.held > 0
    check_ledgers(backend)


@pytest.mark.parametrize("budget", [0, 1 << 20])
def test_cache_bytes_is_validated_and_settable(tiny_llama_dir: Path, budget: int) -> None:
    backend = HFBackend(tiny_llama_dir, cache_bytes=budget)
    assert backend.cache_bytes == budget
    with pytest.raises(ValueError, match="cache_bytes"):
        backend.cache_bytes = -1
