"""Never silent: every decode step that leaves the fast step is counted with its reasons and said
once, on the run's result (`Accel.notes`) and on each generation of the call (`Generation.notes`,
which every front passes on).

Why a test of its own: a step that quietly falls back to the per-layer loop, or runs uncompiled,
costs a GPU several times its speed; the only defence is that the reply says so. Each acceleration
(its config's own examples) and each fallback reason is driven on a tiny random model, and the
counters must account for every step that was not the fast one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from testkit import Rerun

from branchwise.backends import DecodeParams, Generation
from branchwise.backends.accel import Accel, RiverConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.hooks import layer_loop_reasons
from branchwise.backends.step_notes import OffFast, off_fast_counts, step_notes

PROMPT = "What is 12 + 7? Think step by step."


@pytest.fixture(scope="module")
def backend(steered_backend: HFBackend) -> HFBackend:
    return steered_backend


def _said(stats: dict[str, float], gens: list[Generation], accel: Accel) -> None:
    """The step counters' note is on the run's notes and on every generation, once; none when no
    step left the fast step."""
    notes = step_notes(stats)
    assert len(notes) == (1 if stats.get("decode_steps_off_fast") else 0)
    assert all(g.notes == notes for g in gens), [g.notes for g in gens]
    said = accel.notes(stats)
    assert all(said.count(n) == 1 for n in notes) and len([n for n in said if "fast step" in n]) == len(notes)


@pytest.mark.parametrize("name", sorted(Accel.configs()))
def test_each_acceleration_says_every_step_it_kept_off_the_fast_step(backend: HFBackend, name: str) -> None:
    """An acceleration's decode steps on the layer loop are all counted off the fast step, each under
    the acceleration's own reasons; one that decodes on the fast step leaves none."""
    backend.decode_step = "auto"
    config = Accel.configs()[name]
    assert config.examples is not None
    accel = Accel(**{name: config.model_validate(dict(config.examples.acting))})
    session = backend.session(accel=accel)
    root = session.prefill(backend.encode(PROMPT))
    kids = session.fork(root, 2)
    gens = session.extend(kids, DecodeParams(max_tokens=6, min_tokens=6))
    stats = session.kv_stats().as_dict()
    session.release([root, *kids])
    loop = int(stats.get("decode_steps_layer_loop", 0))
    assert int(stats.get("decode_steps_off_fast", 0)) == loop, stats
    reasons = layer_loop_reasons(session.plugins)
    assert off_fast_counts(stats) == {why: loop for why in reasons}, stats
    assert bool(loop) == bool(reasons)
    _said(stats, gens, accel)


@dataclass
class NotReady:
    """A step compiler whose kind is still compiling: every step runs uncompiled (what a server
    meets in its first minutes), without a compile worker in the test."""

    unused: str | None = "its kind of batch is compiling in the background"

    def __call__(self, graph: object) -> None:
        return None

    def ready(self, graph: object) -> bool:
        return False


def _decode(backend: HFBackend, admit_long: bool = False) -> tuple[list[Generation], dict[str, float]]:
    """Two branches of the prompt decoded; with `admit_long`, a long prompt joins mid-decode (its
    chunks carried by the decode steps where they can be)."""
    backend.reset_stats()
    root = backend.prefill(backend.encode(PROMPT))
    kids = backend.fork(root, 2)
    backend.release([root])
    made: list[int] = []

    def admit(alive: int) -> list[int]:
        if made or not admit_long:
            return []
        late = backend.prefill(backend.encode(PROMPT + " Show every step of the work." * 8))
        made.extend(backend.fork(late, 1))
        backend.release([late])
        return made

    try:
        gens = backend.extend(kids, DecodeParams(max_tokens=12, min_tokens=12), admit=admit)
    finally:
        backend.release(kids + made)
    return gens, backend.kv_stats().as_dict()


def test_each_fallback_reason_is_counted_and_said(backend: HFBackend) -> None:
    """The baseline's layer loop, a compiled step not ready (plain, and River's pieces), a step
    carrying a prefill chunk where steps are captured: each counted under its reason, on every step
    it concerns, and said; River's audit, on the fast step too, says nothing."""
    backend.decode_step = "layers"
    gens, stats = _decode(backend)
    assert off_fast_counts(stats) == {OffFast.LAYERS_MODE.value: int(stats["decode_steps_layer_loop"])}
    _said(stats, gens, Accel())

    backend.decode_step = "eager"
    stepper = backend.engine.stepper
    stepper.compiler = NotReady()  # type: ignore[assignment]
    try:
        gens, stats = _decode(backend)
    finally:
        backend.decode_step = "eager"  # a fresh stepper state: no compiler
    fixed = int(stats["decode_steps_fixed"])
    assert off_fast_counts(stats) == {f"{OffFast.UNCOMPILED.value}: {NotReady.unused}": fixed} and fixed >= 10
    _said(stats, gens, Accel())

    # River's exits run as pieces, each a kind of its own: while they compile, every step says so
    river = Accel(river=RiverConfig(threshold=-1.0, entry_layer=0))
    backend.accel = river
    stepper.compiler = NotReady()  # type: ignore[assignment]
    try:
        gens, stats = _decode(backend)
    finally:
        backend.decode_step = "eager"
        backend.accel = Accel()
    fixed = int(stats["decode_steps_fixed"])
    assert off_fast_counts(stats) == {f"{OffFast.UNCOMPILED.value}: {NotReady.unused}": fixed}
    assert fixed >= 10 and stats["river_exits"] >= 10
    _said(stats, gens, river)

    backend.prefill_chunk = 16
    stepper.recorder = Rerun()
    try:
        gens, stats = _decode(backend, admit_long=True)
    finally:
        backend.decode_step = "auto"
    carried = int(stats["decode_steps_carrying_prefill"])
    assert carried >= 2 and off_fast_counts(stats) == {OffFast.PREFILL_CHUNK.value: carried}
    _said(stats, gens, Accel())

    backend.accel = Accel(river=RiverConfig(threshold=-1.0, entry_layer=0, audit=True))
    try:
        gens, stats = _decode(backend)
    finally:
        backend.accel = Accel()
    # River's audit runs on the fast step too (the backbone's rest one more piece): nothing to say
    assert "decode_steps_off_fast" not in stats and stats["river_audit_rows"] >= 10
    _said(stats, gens, Accel(river=RiverConfig(threshold=-1.0, entry_layer=0, audit=True)))

    gens, stats = _decode(backend)  # the fast step: nothing to say
    assert "decode_steps_off_fast" not in stats and stats["decode_steps_fixed"] >= 10
    _said(stats, gens, Accel())


def _streamed_notes(events: str) -> dict[str, Any]:
    """The one chunk of a streamed reply that carries ``branchwise`` (an empty dict if none does),
    after checking that no other chunk does."""
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    said = [c for c in chunks if "branchwise" in c]
    assert len(said) <= 1 and all("error" not in c for c in chunks), chunks
    if said:
        assert said[0]["choices"][0]["finish_reason"] is not None, said  # on the last choice's end
    return said[0] if said else {}


def test_every_front_says_it_once(backend: HFBackend) -> None:
    """Plain `/v1/chat/completions` and `/v1/completions` replies, whole and streamed (`branchwise.notes`;
    streamed, on the chunk that ends the last choice), LangChain's (invoked and streamed)
    response metadata and DSPy's history carry the note of steps that left the fast step (here:
    the layer loop's baseline), once; a reply whose steps were all fast carries none."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from branchwise.integrations.dspy import BranchwiseLM
    from branchwise.integrations.langchain import ChatBranchwise
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    def said(notes: list[str]) -> bool:
        return len(notes) == 1 and notes[0].endswith(f"{OffFast.LAYERS_MODE.value} ({notes[0].split()[0]})")

    msgs = [{"role": "user", "content": "What is 12 + 7?"}]
    try:
        with serve_in_thread(create_app(backend, model_name="tiny")) as url:
            for mode in ("layers", "eager"):
                backend.decode_step = mode
                chat = httpx.post(
                    f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "n": 2}
                )
                text = httpx.post(f"{url}/v1/completions", json={"prompt": "12 + 7 =", "max_tokens": 6})
                streamed = [
                    httpx.post(f"{url}{route}", json={**body, "max_tokens": 6, "n": 2, "stream": True})
                    for route, body in (
                        ("/v1/chat/completions", {"messages": msgs}),
                        ("/v1/completions", {"prompt": "12 + 7 ="}),
                    )
                ]
                for reply in (chat.json(), text.json(), *(_streamed_notes(r.text) for r in streamed)):
                    notes = reply.get("branchwise", {}).get("notes", [])
                    assert said(notes) if mode == "layers" else notes == [], reply
        backend.decode_step = "layers"
        chat = ChatBranchwise(backend=backend, max_tokens=6)
        meta = chat.invoke("What is 12 + 7?").response_metadata
        assert said(meta["branchwise"]["notes"]), meta
        last = list(chat.stream("What is 12 + 7?"))[-1].response_metadata  # the closing chunk's
        assert said(last["branchwise"]["notes"]), last
        lm = BranchwiseLM(backend=backend, cache=False, max_tokens=6)
        lm(messages=msgs)
        assert said(lm.history[-1]["response"]["branchwise"]["notes"])
    finally:
        backend.decode_step = "auto"
