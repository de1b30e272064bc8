"""The prefill pace (`pace.py`): a chunk carried by a decode step is sized by time, within bounds.

Why: the short requests' latency under a long prompt is bounded by what each step's chunk costs,
not by its token count; these tests pin the sizing rule on given measurements (no clock reading in
the assertions), and that a long prompt amid decoding rows is still computed exactly.
"""

from __future__ import annotations

import pytest
import torch

from branchwise.backends.hf.pace import PrefillPace

CPU = torch.device("cpu")


def test_first_chunk_is_the_floor_then_the_share_of_a_step() -> None:
    pace = PrefillPace(share=1.0, floor=8)
    assert pace.size(128) == 8  # nothing measured yet: a small chunk measures a token's cost
    pace.step_s, pace.token_s = 0.060, 0.004  # a 60 ms step; 4 ms per prefilled token
    assert pace.size(128) == 15  # 60 ms of prefill
    pace.share = 2.0
    assert pace.size(128) == 30
    assert pace.size(20) == 20  # never above the configured chunk
    pace.token_s = 0.5  # a token costs more than a step: the floor keeps the prompt moving
    assert pace.size(128) == 8
    assert pace.size(4) == 4  # ...within a configured chunk smaller than the floor


def test_gpu_like_costs_give_the_whole_chunk() -> None:
    pace = PrefillPace(step_s=0.003, token_s=0.000002)
    assert pace.size(512) == 512


def test_measurements_follow_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """`boundary` times a decode step from the last boundary or chunk; `timed_chunk` a chunk's cost
    per token; `idle` forgets the clock (a new decode is not timed from an old one)."""
    clock = iter([10.0, 10.05, 10.25, 10.30, 99.0])
    monkeypatch.setattr("branchwise.backends.hf.pace.time.perf_counter", lambda: next(clock))
    pace = PrefillPace(smoothing=1.0)
    pace.boundary()  # 10.0: the first boundary starts the clock
    assert pace.step_s is None
    pace.boundary()  # 10.05: a 50 ms step
    assert pace.step_s == pytest.approx(0.05)
    pace.timed_chunk(40, started=10.05, device=CPU)  # 10.25: 200 ms for 40 tokens
    assert pace.token_s == pytest.approx(0.005)
    pace.boundary()  # 10.30: the step after the chunk, 50 ms
    assert pace.step_s == pytest.approx(0.05)
    pace.idle()
    pace.boundary()  # 99.0: no step measured across an idle gap
    assert pace.step_s == pytest.approx(0.05)


def test_share_zero_is_fixed_chunks() -> None:
    pace = PrefillPace(share=0.0, step_s=0.060, token_s=0.004)
    assert pace.size(128) == 128
    assert pace.idle_size(128, 512) == 128


def test_a_chunk_while_nothing_decodes_takes_about_idle_s() -> None:
    """With no decoding row to wait, a chunk is bounded by the wait it imposes on a request that
    arrives meanwhile: `idle_s` of prefill at the measured cost per token, never below the configured
    chunk (a long context's chunk keeps its size however slow its tokens are) nor above what bounds
    a forward's attention memory."""
    pace = PrefillPace(idle_s=0.25)
    assert pace.idle_size(128, 512) == 128  # nothing measured yet
    pace.token_s = 0.001  # 1 ms per prompt token (a 2-core CPU, a short context)
    assert pace.idle_size(128, 512) == 250
    pace.token_s = 0.000002  # a GPU
    assert pace.idle_size(128, 512) == 512
    pace.token_s = 0.01  # attention over a long context: 10 ms per token
    assert pace.idle_size(128, 512) == 128


@pytest.mark.parametrize(
    ("field", "value"), [("share", -1.0), ("share", True), ("floor", 0), ("idle_s", -0.1)]
)
def test_bad_pace_names_the_field(field: str, value: float) -> None:
    name = {"share": "prefill_share", "floor": "prefill floor", "idle_s": "prefill idle_s"}[field]
    with pytest.raises(ValueError, match=f"{name}={value!r} must be"):
        PrefillPace(**{field: value})


def test_backend_prefill_share(tiny_llama_dir) -> None:
    from branchwise.backends.hf import HFBackend

    backend = HFBackend(tiny_llama_dir)
    assert backend.prefill_share == 1.0
    backend.prefill_share = 0
    assert backend.engine.pace.size(128) == 128
    with pytest.raises(ValueError, match=r"prefill_share=-0.5 must be a number in \[0, 100\]"):
        backend.prefill_share = -0.5
    assert backend.prefill_share == 0.0


def test_a_carried_chunk_costs_what_its_step_took_beyond_a_plain_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk computed by the decode step itself (`carries`) is timed by the next boundary: what
    that step took beyond a plain step, per token; the plain step's own average is left as it was.
    A step no slower than a plain one makes the next chunk the whole configured chunk."""
    clock = iter([10.0, 10.05, 10.20, 10.25, 10.30])
    monkeypatch.setattr("branchwise.backends.hf.pace.time.perf_counter", lambda: next(clock))
    pace = PrefillPace(smoothing=1.0)
    pace.boundary()  # 10.0
    pace.boundary()  # 10.05: a plain 50 ms step
    pace.carries(20)
    pace.boundary()  # 10.20: 150 ms with 20 prompt tokens: 100 ms for the chunk
    assert pace.step_s == pytest.approx(0.05) and pace.token_s == pytest.approx(0.005)
    assert pace.size(128) == 10  # 50 ms of prefill
    pace.boundary()  # 10.25: plain again
    assert pace.step_s == pytest.approx(0.05)
    pace.carries(20)
    pace.boundary()  # 10.30: no slower than a plain step
    assert pace.size(128) == 128
