"""Token-exact prefix reuse into a segment whose KV is lossy (evicted by SkipKV/RSBCM, or read
through ReasonCache's shared blocks).

Such a segment cannot be split: its physical KV slots no longer map to its logical tokens, so the
first k tokens' KV cannot be told apart from the rest. A fork that shares a prefix ending inside it
must neither crash nor reuse the lossy KV as if it were exact: it shares up to the segment's start
and computes the rest of its prompt itself.
"""

from __future__ import annotations

import pytest
import torch

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, ASKSConfig, RSBCMConfig, SkipKVConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.session import Session
from branchwise.backends.hf.tree import KVTree

PROMPT = "Count: one two three four five six seven."
OTHER = " Then eight nine ten, and what comes next?"
SUFFIX = " Answer:"
CANDIDATES = list(range(16))


def _reference(backend: HFBackend, ids: list[int]) -> torch.Tensor:
    """Next-token probabilities of `ids` from a plain forward of the model (exact KV)."""
    with torch.inference_mode():
        logits = backend.model(torch.tensor([ids], device=backend.device)).logits[0, -1]
    return torch.softmax(logits.float(), dim=-1)[CANDIDATES].cpu()


def _check_exact(backend: HFBackend, session: Session, child: int, prompt: list[int]) -> None:
    """The child stands for `prompt` and scores exactly like a plain forward of it."""
    assert session.tokens(child) == prompt
    suffix = backend.encode(SUFFIX)
    got = torch.tensor(session.score_next([child], suffix, CANDIDATES)[0])
    torch.testing.assert_close(got, _reference(backend, prompt + suffix), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("asks", [False, True], ids=["exact", "asks"])
def test_rsbcm_evicted_prompt_is_not_split_but_recomputed(tiny_llama_dir, asks: bool) -> None:
    """RSBCM (prompt not pinned) evicts blocks of the prompt; a prompt sharing only its first tokens
    is computed whole instead of splitting the evicted prompt (with ASKS too: its gate pass runs over
    the exact prefix, and a rejected prompt keeps that exact KV)."""
    backend = HFBackend(tiny_llama_dir)
    rsbcm = RSBCMConfig(capacity_blocks=1, block_tokens=4, pin_prompt=False)
    accel = Accel(rsbcm=rsbcm, asks=ASKSConfig(tau=1.0) if asks else None)
    session = backend.session(accel=accel)
    prompt = backend.encode(PROMPT)
    root = session.prefill(prompt)
    (kid,) = session.fork(root, 1)
    session.extend([kid], DecodeParams(max_tokens=6, min_tokens=6))
    seg = backend.tree.get(root)
    assert session.kv_stats().extra["rsbcm_evictions"] > 0 and seg.kv_tokens < seg.n_computed
    new = prompt[:6] + backend.encode(OTHER)
    (child,) = session.fork_prompts(root, [new])
    assert backend.tree.get(root).tokens == prompt  # the evicted prompt was not split
    _check_exact(backend, session, child, new)
    assert session.kv_stats().extra["lossy_prefix_recomputed_tokens"] == 6
    session.release([root, kid, child])
    assert session.kv_stats().live_nodes == 0


def test_skipkv_evicted_branch_shares_only_up_to_its_start(tiny_llama_dir) -> None:
    """SkipKV evicts a branch's own generated KV; a prompt that shares the prompt and part of that
    branch reads the (exact) prompt and computes its own tokens from the branch's start on."""
    backend = HFBackend(tiny_llama_dir)
    session = backend.session(
        accel=Accel(skipkv=SkipKVConfig(budget=6, interval=4, window=2, query_window=4))
    )
    prompt = backend.encode(PROMPT)
    root = session.prefill(prompt)
    (kid,) = session.fork(root, 1)
    session.extend([kid], DecodeParams(max_tokens=14, min_tokens=14))
    session.compute([backend.tree.get(kid)])
    seg = backend.tree.get(kid)
    assert seg.kv_tokens < seg.n_computed  # evicted
    path = session.tokens(kid)
    new = path[: len(prompt) + 5] + backend.encode(OTHER)
    (child,) = session.fork_prompts(kid, [new])
    child_seg = backend.tree.get(child)
    assert child_seg.parent is backend.tree.get(root) and child_seg.shares_parent
    assert child_seg.tokens == new[len(prompt) :]
    _check_exact(backend, session, child, new)
    assert session.kv_stats().extra["lossy_prefix_recomputed_tokens"] == 5
    session.release([root, kid, child])
    assert session.kv_stats().live_nodes == 0


def test_shareable_prefix_stops_before_a_lossy_segment() -> None:
    """The tree answer: split an intact segment, stop at the start of an evicted or block-shared one."""
    tree, run = KVTree(), Ledger()

    def node(parent: Segment | None, tokens: list[int]) -> Segment:
        seg = tree.add(parent, parent is not None, tokens, run)
        kv = [torch.randn(1, len(tokens), 2)]
        tree.set_kv(seg, kv, [t.clone() for t in kv])
        seg.n_computed = len(tokens)
        return seg

    root = node(None, [1, 2, 3, 4])
    mid = node(root, [5, 6, 7, 8])
    leaf = node(mid, [9, 10])
    tree.keep_kv(mid, torch.tensor([True, False, True, True]))  # evicted
    assert tree.shareable_prefix(leaf, 6) == (root, 4)  # inside the evicted segment: its start
    assert tree.shareable_prefix(leaf, 8) == (mid, 8)  # its end: the whole node, as a fork shares it
    head, k = tree.shareable_prefix(leaf, 2)  # inside an intact segment: split as before
    assert k == 2 and head.tokens == [1, 2] and root.parent is head
    assert tree.shareable_prefix(mid, 5) == (root, 4)  # root now holds [3, 4] under the head
    lossy_root = node(None, [1, 2, 3])
    tree.blocks.ref(lossy_root, 0, tree.blocks.seal([torch.zeros(1, 2, 2)], [torch.zeros(1, 2, 2)], run))
    assert tree.shareable_prefix(lossy_root, 2) == (None, 0)
