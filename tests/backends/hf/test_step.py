"""The fixed-shape decode step (`step.py`) against the layer loop it replaces for plain decodes.

Why: the fixed-shape step is what a GPU captures as a CUDA graph, so on the CPU it must give the
layer loop's tokens (fp32 greedy: token for token) in every layout a decode meets — a shared
prompt read by many rows, rows of unequal lengths, rows ending and leaving the batch, tails growing
past their first capacity, prompts copied into tails — and say which step each decode ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from testkit import Rerun

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, SkipKVConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.hooks import Acceleration
from branchwise.backends.hf.step import WARMUP
from branchwise.backends.step_notes import off_fast_counts

PROMPT = "What is 12 + 7? Think step by step."


@pytest.fixture(params=["llama", "qwen2"])
def backend(request: pytest.FixtureRequest, tiny_model_dir) -> HFBackend:
    return HFBackend(tiny_model_dir(request.param))


def _branches(
    backend: HFBackend,
    mode: str,
    params_list: list[DecodeParams],
    hints: list[str],
    recorder: Rerun | None = None,
) -> list[list[int]]:
    """Fork the prompt into one branch per hint, decode each with its own parameters in one call
    (steps recorded by `recorder` where given)."""
    backend.decode_step = mode
    if recorder is not None:
        backend.engine.stepper.recorder = recorder
    backend.reset_stats()
    root = backend.prefill(backend.encode(PROMPT))
    kids = backend.fork(root, len(hints))
    backend.release([root])
    backend.append(kids, [backend.encode(h) for h in hints])
    row_params = params_list if len(params_list) > 1 else None
    gens = backend.extend(kids, params_list[0], row_params=row_params)
    backend.release(kids)
    return [g.token_ids for g in gens]


@pytest.mark.parametrize("n", [1, 5])
def test_fixed_step_gives_the_layer_loops_tokens(backend: HFBackend, n: int) -> None:
    """Greedy, fp32: the same tokens whichever step decodes, for one row and for a shared prompt
    read by rows of unequal lengths; the statistics say which step ran."""
    params = DecodeParams(max_tokens=24, min_tokens=24)
    hints = [" hint" * (i % 3) for i in range(n)]
    layers = _branches(backend, "layers", [params], hints)
    assert backend.kv_stats().as_dict().get("decode_steps_layer_loop", 0) > 0
    fixed = _branches(backend, "eager", [params], hints)
    stats = backend.kv_stats().as_dict()
    assert stats.get("decode_steps_fixed", 0) >= params.max_tokens - 1
    assert "decode_steps_layer_loop" not in stats
    assert fixed == layers


def test_rows_ending_early_and_tails_growing(backend: HFBackend) -> None:
    """Rows of one call with their own max_tokens (they end at different steps and leave the
    batch), one of them past the tails' first capacity (they grow): tokens unchanged."""
    lengths = [3, 150, 40, 7]
    params = [DecodeParams(max_tokens=m, min_tokens=m) for m in lengths]
    hints = ["", " a", " b c", " d"]
    layers = _branches(backend, "layers", params, hints)
    fixed = _branches(backend, "eager", params, hints)
    assert [len(t) for t in fixed] == lengths
    assert fixed == layers


def test_copied_prompts_and_separate_requests(tiny_llama_dir) -> None:
    """Many short prompts decoded together (their prompts copied into the rows' tails) and two
    unrelated requests: the same tokens through both steps."""
    backend = HFBackend(tiny_llama_dir)
    params = DecodeParams(max_tokens=12, min_tokens=12)
    prompts = [backend.encode(f"Question {i}: what is {i} + {i}?") for i in range(12)]

    def run(mode: str) -> list[list[int]]:
        backend.decode_step = mode
        roots = [backend.prefill(p) for p in prompts]
        gens = backend.extend(roots, params)
        backend.release(roots)
        return [g.token_ids for g in gens]

    assert run("eager") == run("layers")


def test_sampled_decode_is_the_same_draw(tiny_llama_dir) -> None:
    """Seeded sampling draws from the same logits in the same order through both steps. (No top-p:
    the steps' logits agree to ~1e-5, not bit for bit, and a random model's near-uniform
    distribution puts many tokens at a nucleus's edge, where that much decides membership.)"""
    backend = HFBackend(tiny_llama_dir)
    params = DecodeParams(max_tokens=16, temperature=0.9, seed=7)
    assert _branches(backend, "eager", [params], ["", " x", " y"]) == _branches(
        backend, "layers", [params], ["", " x", " y"]
    )


class _BetweenLayers(Acceleration):
    """A plug-in of a user's, reading every layer's output inside the forward (`after_layer`): the
    fixed-shape step has no place between its layers."""

    name = "between_layers"

    def after_layer(self, fwd: Any, index: int, h_in: torch.Tensor, h: torch.Tensor) -> None:
        return None


def test_a_plug_in_with_forward_hooks_uses_the_layer_loop_and_says_so(tiny_llama_dir) -> None:
    """A run with a plug-in that overrides a forward hook (none of the shipped accelerations does
    for decode steps: their work reaches the step as inputs): its decode steps go to the layer
    loop, each counted off the fast step under the plug-in's name, so its result says so."""
    backend = HFBackend(tiny_llama_dir)
    session = backend.session()
    session.plugins.append(_BetweenLayers())
    root = session.prefill(backend.encode(PROMPT))
    kids = session.fork(root, 2)
    session.extend(kids, DecodeParams(max_tokens=6, min_tokens=6))
    extra = session.kv_stats().as_dict()
    assert extra.get("decode_steps_layer_loop", 0) >= 5
    assert "decode_steps_fixed" not in extra
    assert off_fast_counts(extra) == {"between_layers": extra["decode_steps_layer_loop"]}
    session.release([root, *kids])


def test_bad_decode_step_names_the_field(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"decode_step='warp' is not one of 'auto', 'compiled', 'graphs'"):
        backend.decode_step = "warp"  # type: ignore[assignment]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"decode_step='graphs' needs a CUDA device"):
            HFBackend(tiny_llama_dir, decode_step="graphs")
    assert backend.decode_step == "auto"


def test_auto_compiles_unless_the_environment_names_another_mode(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`auto` runs the compiled step on every device (no step waits for its compiler: a kind not
    compiled yet runs eagerly); `$BRANCHWISE_DECODE_STEP` names what it runs as instead (this
    suite's CPU session sets eager), a bad value names the variable and the choices, and the
    backend still says `auto` (what was asked)."""
    from branchwise.backends.hf.step import AUTO_ENV

    monkeypatch.delenv(AUTO_ENV, raising=False)
    backend = HFBackend(tiny_llama_dir)
    stepper = backend.engine.stepper
    assert backend.decode_step == "auto" and stepper.runs == "compiled" and stepper.compiler is not None
    monkeypatch.setenv(AUTO_ENV, "eager")
    backend.decode_step = "auto"
    assert stepper.runs == "eager" and stepper.compiler is None
    monkeypatch.setenv(AUTO_ENV, "fast")
    with pytest.raises(
        ValueError, match=r"\$BRANCHWISE_DECODE_STEP='fast' is not one of 'compiled', 'graphs'"
    ):
        backend.decode_step = "auto"
    if not torch.cuda.is_available():
        monkeypatch.setenv(AUTO_ENV, "graphs")
        with pytest.raises(ValueError, match=r"\$BRANCHWISE_DECODE_STEP='graphs' needs a CUDA device"):
            backend.decode_step = "auto"


def test_a_worker_that_would_not_fit_the_memory_left_is_not_started(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where a compile worker's copy of the weights would not fit the host memory available, a new
    kind of batch runs eagerly for good and says why (no worker process is started); the spec
    counts the weights of the model the worker would build."""
    from branchwise.backends.hf import compile_worker

    backend = HFBackend(tiny_llama_dir, decode_step="compiled")
    compiler = backend.engine.stepper.compiler
    assert compiler is not None and compiler.spec is not None
    plain = HFBackend(tiny_llama_dir, prepack=False).model  # a packed product is no parameter
    assert compiler.spec.weight_bytes() == sum(p.numel() * p.element_size() for p in plain.parameters()) > 0
    monkeypatch.setattr(compile_worker, "free_memory", lambda device: 1 << 20)
    started: list[object] = []
    monkeypatch.setattr(compile_worker.Worker, "__init__", lambda *a: started.append(a))
    compiler.folder = tmp_path  # nothing cached to load
    root = backend.prefill(backend.encode(PROMPT))
    backend.extend([root], DecodeParams(max_tokens=6, min_tokens=6))
    extra = backend.kv_stats().as_dict()
    assert started == [] and extra["decode_steps_uncompiled"] >= 5
    (why,) = compiler.status()["uncompiled"]
    assert why.startswith("a compile worker would take") and "GiB of memory is available" in why
    backend.release([root])


def _as_the_layer_loop(backend: HFBackend, mode: str, params: DecodeParams) -> dict[str, float]:
    """Branches over a shared prompt, of unequal lengths, decoded by the layer loop and then in
    `mode`: the same tokens (asserted); the statistics of the run in `mode`."""
    hints = ["", " hint", " hint hint"]
    layers = _branches(backend, "layers", [params], hints)
    assert _branches(backend, mode, [params], hints) == layers
    return backend.kv_stats().as_dict()


@pytest.mark.gpu
def test_captured_step_gives_the_layer_loops_tokens(tiny_llama_dir) -> None:
    """On CUDA, fp32: the step captured as CUDA graphs decodes the layer loop's tokens, captures
    once per batch layout (not per step), and replays otherwise."""
    backend = HFBackend(tiny_llama_dir, device="cuda", dtype="float32")
    params = DecodeParams(max_tokens=40, min_tokens=40)
    stats = _as_the_layer_loop(backend, "graphs", params)
    assert stats.get("decode_steps_captured", 0) >= params.max_tokens - 1 - WARMUP
    assert 1 <= backend.engine.stepper.captures < params.max_tokens // 4


def test_steps_off_the_fast_step_are_noted_once_with_their_reasons() -> None:
    """A run whose steps left the fast step says so in one note, with the count and each reason's
    steps; a run with none says nothing about it."""
    accel = Accel(skipkv=SkipKVConfig(budget=64, interval=4))
    stats = {"decode_steps_off_fast": 12, "off_fast_by skipkv_reads": 12, "off_fast_by prefill_chunk": 2}
    assert [n for n in accel.notes({**stats, "skipkv_evictions": 3}) if "fast step" in n] == [
        "12 decode steps left the fast step (fixed-shape, compiled where asked): prefill_chunk (2), "
        "skipkv_reads (12)"
    ]
    assert not [n for n in accel.notes({"decode_steps_fixed": 12}) if "fast step" in n]


def test_recorded_steps_replay_the_layer_loops_tokens(backend: HFBackend) -> None:
    """One recording per batch layout (after one eager step), replays for the other steps; rows
    ending (compaction; with pages also the storage packed once ended rows freed most of it) and
    the storage growing are new layouts; the tokens are the layer loop's."""
    lengths = [3, 150, 40, 7]
    params = [DecodeParams(max_tokens=m, min_tokens=m) for m in lengths]
    hints = ["", " a", " b c", " d"]
    layers = _branches(backend, "layers", params, hints)
    rerun = Rerun()
    got = _branches(backend, "eager", params, hints, recorder=rerun)
    stats = backend.kv_stats().as_dict()
    assert got == layers
    assert 3 <= rerun.records <= 10  # the first layout, compactions as rows end, grown storage
    assert rerun.records == backend.engine.stepper.captures
    assert rerun.replays == stats["decode_steps_captured"] >= 140  # most steps replay
    assert rerun.records * WARMUP <= stats["decode_steps_fixed"] <= 10 * WARMUP  # each layout's first


@pytest.mark.parametrize("cached", [False, True])
def test_a_decode_step_carries_a_waiting_prompts_chunk(backend: HFBackend, cached: bool) -> None:
    """A long prompt handed in mid-decode is prefilled a chunk per step, each chunk computed by the
    decode step itself (one forward for the rows and the chunk): every row's greedy tokens equal
    those of the same call whose chunks run in forwards of their own (the layer loop's steps cannot
    carry one), and the statistics count the steps that carried a chunk. With the prefix cache on,
    the long prompt starts with the running rows' prompt, so its chunks read that node as a shared
    ancestor."""
    backend.prefill_chunk = 16
    long_prompt = PROMPT + " Show every step of the work, then the answer." * 6

    def run(mode: str) -> tuple[list[list[int]], dict[str, float]]:
        backend.decode_step = mode
        backend.cache_bytes = 0  # each run computes the long prompt again
        backend.cache_bytes = 2**30 if cached else 0
        backend.reset_stats()
        root = backend.prefill(backend.encode(PROMPT))
        kids = backend.fork(root, 2)
        backend.release([root])
        made: list[int] = []
        asked: list[int] = []

        def admit(alive: int) -> list[int]:
            asked.append(alive)
            if len(asked) != 2:
                return []
            late = backend.prefill(backend.encode(long_prompt))
            made.extend(backend.fork(late, 2))
            backend.release([late])
            return made

        try:
            gens = backend.extend(kids, DecodeParams(max_tokens=24, min_tokens=24), admit=admit)
        finally:
            backend.release(kids + made)
        assert len(gens) == 4
        return [g.token_ids for g in gens], backend.kv_stats().as_dict()

    prompt_tokens = len(backend.encode(long_prompt))
    assert prompt_tokens > 4 * 16
    layers, plain = run("layers")
    assert "decode_steps_carrying_prefill" not in plain and plain["prefill_chunks"] >= 3
    carried, stats = run("eager")
    assert carried == layers
    assert stats["decode_steps_carrying_prefill"] >= 3
    assert stats["prefill_chunks"] >= stats["decode_steps_carrying_prefill"]
    assert backend.kv_stats().bytes_held == 0
