"""The fixed-shape decode step (`step.py`) against the layer loop it replaces for plain decodes.

Why: the fixed-shape step is what a GPU captures as a CUDA graph, so on the CPU it must give the
layer loop's tokens (fp32 greedy: token for token) in every layout a decode meets — a shared
prompt read by many rows, rows of unequal lengths, rows ending and leaving the batch, tails growing
past their first capacity, prompts copied into tails — and say which step each decode ran.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, SkipKVConfig
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.step import COMPILED_SPAN, SPAN, WARMUP
from branchwise.backends.hf.step_compiler import SEGMENTS, StepCompiler

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
    """Seeded sampling draws from the same logits in the same order through both steps."""
    backend = HFBackend(tiny_llama_dir)
    params = DecodeParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    assert _branches(backend, "eager", [params], ["", " x", " y"]) == _branches(
        backend, "layers", [params], ["", " x", " y"]
    )


def test_accelerated_runs_use_the_layer_loop_and_count_it(tiny_llama_dir) -> None:
    """A run with an acceleration plug-in needs the layer loop's hook points: its decode steps go
    there, counted, so its result can say it ran uncaptured."""
    backend = HFBackend(tiny_llama_dir)
    session = backend.session(accel=Accel(skipkv=SkipKVConfig(budget=64, interval=4)))
    root = session.prefill(backend.encode(PROMPT))
    kids = session.fork(root, 2)
    session.extend(kids, DecodeParams(max_tokens=6, min_tokens=6))
    extra = session.kv_stats().as_dict()
    assert extra.get("decode_steps_layer_loop", 0) >= 5
    assert "decode_steps_fixed" not in extra
    session.release([root, *kids])


def test_bad_decode_step_names_the_field(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"decode_step='warp' is not one of 'auto', 'compiled', 'graphs'"):
        backend.decode_step = "warp"  # type: ignore[assignment]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"decode_step='graphs' needs a CUDA device"):
            HFBackend(tiny_llama_dir, decode_step="graphs")
    assert backend.decode_step == "auto"


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


def test_compiled_step_gives_the_layer_loops_tokens(tiny_llama_dir) -> None:
    """`decode_step="compiled"` (inductor; what CUDA then captures): the layer loop's greedy tokens
    in fp32 for one row and for a shared prompt read by rows of unequal lengths, every step counted
    as compiled, the time spent compiling reported, and the CPU's prepacked weights kept: the compiled
    step calls the same oneDNN products on them (one opaque operation each), as the layer loop does."""
    backend = HFBackend(tiny_llama_dir)
    assert backend.prepacked.active
    params = DecodeParams(max_tokens=12, min_tokens=12)
    stats = _as_the_layer_loop(backend, "compiled", params)
    assert stats.get("decode_steps_compiled", 0) >= params.max_tokens - 1
    assert "decode_steps_uncompiled" not in stats and stats.get("decode_step_compile_s", 0) > 0
    assert backend.prepacked.active
    compiler = backend.engine.stepper.compiler
    assert compiler is not None and compiler.failed is None and compiler.compiles >= 1
    assert _branches(backend, "compiled", [params], [""]) == _branches(backend, "layers", [params], [""])


def test_the_compiled_step_writes_the_tails_in_place(tiny_llama_dir) -> None:
    """The compiled step writes each row's new K/V into its tail where it lies: the code inductor
    generates allocates no buffer of a tail's shape `[B, H_kv, capacity, D]`. (A step that wrote
    with a scatter was compiled into a copy of every layer's whole tails at every step, a cost
    that grows with rows x capacity; what a scatter or a whole-tail clone would allocate is what
    this looks for.) Its cascade over the shared prompt is the plain products on a CPU, which inductor
    fuses (`attention.fused_attention`), not the flash kernel with its additive bias."""
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    parts = backend.engine.stepper.parts
    h_kv, d = parts.n_kv_heads, parts.head_dim
    params = DecodeParams(max_tokens=6, min_tokens=6)
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, sources = run_and_get_code(_branches, backend, "compiled", [params], ["", " a b"])
    assert sources, "nothing was compiled"
    shapes = [
        [part.strip() for part in shape.split(",")]
        for code in sources
        for shape in re.findall(r"empty_strided_\w+\(\(([^()]*)\)", code)
    ]
    tails = [s for s in shapes if len(s) == 4 and s[1] == str(h_kv) and s[3] == str(d) and s[2] != "1"]
    assert shapes and not tails, tails
    flash = [code for code in sources if "_scaled_dot_product_flash_attention_for_cpu" in code]
    assert not flash or backend.engine.stepper.device.type != "cpu"


def test_each_kind_of_batch_compiles_once(tiny_llama_dir) -> None:
    """Fresh prompts of other lengths, other numbers of rows, batches that grow past their tails'
    capacity, a first step with one slot in use: none compiles a kind of batch again (the span
    read stays below the capacity and above one slot, never a size the compiler would specialise
    on; tails grown inside a step
    are the same kind of tensor as those a batch is assembled with). No prefix cache: a cached
    prompt is one more segment."""
    backend = HFBackend(tiny_llama_dir, decode_step="compiled", cache_bytes=0)
    compiler = backend.engine.stepper.compiler
    assert compiler is not None
    for hints in (["", " a b"], [" x"]):  # the two kinds: several rows, and one
        _branches(backend, "compiled", [DecodeParams(max_tokens=6, min_tokens=6)], hints)
    first = compiler.compiles
    for tokens in (6, 150):  # 150: past the first tail capacity, so the tails grow
        for hints in (["", " a b"], [" x"], [" hint", "", " hint hint hint"], ["", " a", " b", " c", " d"]):
            _branches(backend, "compiled", [DecodeParams(max_tokens=tokens, min_tokens=tokens)], hints)
    assert compiler.compiles == first and compiler.failed is None


def test_the_compiled_step_reads_the_slots_in_use_not_the_capacity(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled, a step reads its rows' tails up to the longest row rounded to `COMPILED_SPAN`
    slots, always below the capacity (one program for every span), not the whole capacity: the
    tails grow by 128 slots at least, which a step read in full (masked) before. Same tokens."""
    backend = HFBackend(tiny_llama_dir, decode_step="compiled", cache_bytes=0)
    seen: list[tuple[int, int, int]] = []
    call = StepCompiler.__call__

    def spy(self: StepCompiler, graph: Any) -> Any:
        ctx = graph.ctx
        seen.append((graph.attention.span, int(ctx.lens.max()) + 1, ctx.capacity))
        return call(self, graph)

    monkeypatch.setattr(StepCompiler, "__call__", spy)
    params = DecodeParams(max_tokens=150, min_tokens=150)  # past the first capacity: the tails grow
    compiled = _branches(backend, "compiled", [params], ["", " a b"])
    assert seen and backend.engine.stepper.compiler.failed is None
    for span, needed, capacity in seen:
        assert span == min(capacity - 1, -(-needed // COMPILED_SPAN) * COMPILED_SPAN) >= needed
    assert len({capacity for _, _, capacity in seen}) > 1  # it grew, and the span followed the rows
    assert compiled == _branches(backend, "layers", [params], ["", " a b"])


def test_deeper_batches_run_uncompiled_and_say_so(tiny_llama_dir) -> None:
    """Rows reading more than `SEGMENTS` shared ancestors (a tree three forks deep) are not compiled
    (each count of segments would be a compilation of its own): those steps run uncompiled with the
    layer loop's tokens, and the statistics and notes say why."""
    backend = HFBackend(tiny_llama_dir, decode_step="compiled")
    params = DecodeParams(max_tokens=6, min_tokens=6)

    def tree(mode: str) -> list[list[int]]:
        backend.decode_step = mode
        backend.reset_stats()
        nodes = [backend.prefill(backend.encode(PROMPT))]
        made = list(nodes)
        for depth in range(SEGMENTS + 1):
            nodes = [kid for node in nodes for kid in backend.fork(node, 2)]
            backend.append(nodes, [backend.encode(f" {depth} {i}") for i in range(len(nodes))])
            made += nodes
        tokens = [g.token_ids for g in backend.extend(nodes, params)]
        backend.release(made)
        return tokens

    layers = tree("layers")
    assert tree("compiled") == layers
    stats = backend.kv_stats().as_dict()
    # the first step's batch holds the leaves' ancestors in their tails (copied while they are
    # computed); every later one reads them as shared segments
    assert stats.get("decode_steps_uncompiled", 0) >= params.max_tokens - 2
    reason = f"uncompiled_by more than {SEGMENTS} shared segments (each count would compile anew)"
    assert reason in stats
    (note,) = Accel().notes(stats)
    assert f"more than {SEGMENTS} shared segments" in note


def test_warm_up_compiles_the_first_kinds_of_batch(tiny_llama_dir) -> None:
    """`warm_up` (what `branchwise serve` calls before it listens) compiles the step for one row,
    several rows and rows over a shared prompt, in a session of its own (the backend's statistics
    stay clean); where steps are not compiled it does nothing."""
    assert HFBackend(tiny_llama_dir).warm_up() == {"compiles": 0, "seconds": 0.0}  # eager on the CPU
    backend = HFBackend(tiny_llama_dir, decode_step="compiled")
    warmed = backend.warm_up()
    assert warmed["compiles"] >= 1 and warmed["seconds"] > 0
    assert "decode_steps_compiled" not in backend.kv_stats().as_dict() and backend.kv_stats().live_nodes == 0
    params = DecodeParams(max_tokens=6, min_tokens=6)
    _branches(backend, "compiled", [params], ["", " x"])
    stats = backend.kv_stats().as_dict()
    assert (
        stats.get("decode_steps_compiled", 0) >= params.max_tokens - 1
        and "decode_step_compile_s" not in stats
    )


def test_a_failed_compilation_is_noted_and_the_step_runs_uncompiled(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compilation that fails (here: as where no C++ compiler is installed) warns once, switches
    compilation off for the engine, and the steps run uncompiled with the same tokens; the run's
    statistics count them and its notes say why."""

    def broken(self, gm, example_inputs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(StepCompiler, "_inductor", broken)
    backend = HFBackend(tiny_llama_dir, decode_step="compiled")
    params = DecodeParams(max_tokens=8, min_tokens=8)
    with pytest.warns(RuntimeWarning, match="the compiled decode step failed.*no C.. compiler found"):
        tokens = _branches(backend, "compiled", [params], ["", " x"])
    stats = backend.kv_stats().as_dict()
    assert tokens == _branches(backend, "layers", [params], ["", " x"])
    assert (
        stats.get("decode_steps_uncompiled", 0) >= params.max_tokens - 1
        and "decode_steps_compiled" not in stats
    )
    (note,) = Accel().notes(stats)
    assert note.startswith(f"{int(stats['decode_steps_uncompiled'])} decode steps ran uncompiled")
    assert "no C++ compiler found" in note


def test_a_kind_of_batch_past_the_recompile_limit_runs_uncompiled(tiny_llama_dir) -> None:
    """Torch refuses to compile a new kind of batch once the recompile limit is reached (simulated
    here for batches without a shared segment): such a batch runs uncompiled with a note naming
    the limit, compilation stays on, and the kinds compiled before run their compiled code again.
    Tokens: the layer loop's."""
    backend = HFBackend(tiny_llama_dir, decode_step="compiled", cache_bytes=0)  # the lone row shares nothing
    compiler = backend.engine.stepper.compiler
    assert compiler is not None
    compiled = compiler._fn

    def limited(graph):
        if not graph.ctx.shared:
            raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached with fullgraph=True")
        return compiled(graph)

    compiler._fn = limited
    params = DecodeParams(max_tokens=6, min_tokens=6)

    def lone(mode: str) -> list[int]:
        backend.decode_step = mode
        root = backend.prefill(backend.encode(PROMPT))
        (gen,) = backend.extend([root], params)
        backend.release([root])
        return gen.token_ids

    branches = _branches(backend, "compiled", [params], ["", " x"])
    assert backend.kv_stats().as_dict().get("decode_steps_compiled", 0) >= params.max_tokens - 1
    backend.reset_stats()
    assert lone("compiled") == lone("layers")
    stats = backend.kv_stats().as_dict()
    assert stats.get("decode_steps_uncompiled", 0) >= params.max_tokens - 1
    (note,) = Accel().notes(stats)
    assert "a new kind of batch past the recompile limit" in note
    assert (
        _branches(backend, "compiled", [params], ["", " x"])
        == branches
        == _branches(backend, "layers", [params], ["", " x"])
    )
    assert compiler.failed is None


def test_uncaptured_steps_are_noted() -> None:
    """Where steps are captured, a run whose accelerations kept some on the layer loop says so, with
    the count and the plug-ins that kept them; a run with none says nothing about it."""
    accel = Accel(skipkv=SkipKVConfig(budget=64, interval=4))
    stats = {"decode_steps_uncaptured": 12, "uncaptured_by skipkv": 1, "skipkv_evictions": 3}
    assert [n for n in accel.notes(stats) if "uncaptured" in n] == [
        "12 decode steps ran uncaptured through the layer loop, not as CUDA graphs: skipkv need its hook "
        "points (they act between layers or watch attention)"
    ]
    assert not [n for n in accel.notes({"decode_steps_layer_loop": 12}) if "uncaptured" in n]


class Rerun:
    """A `step.Recorder` for the CPU: "replaying" runs the recorded step again into the recorded
    output, so the capture-and-replay flow (when a layout is recorded, how often, what a replay
    returns) is checked where there is no CUDA."""

    def __init__(self) -> None:
        self.records = 0
        self.replays = 0

    def record(self, step):
        self.records += 1
        out = step()

        def replay() -> None:
            self.replays += 1
            out.copy_(step())

        return replay, out


def test_recorded_steps_replay_the_layer_loops_tokens(backend: HFBackend) -> None:
    """One recording per batch layout (after one eager step), replays for the other steps; rows
    ending (compaction) and tails growing are new layouts; the tokens are the layer loop's."""
    lengths = [3, 150, 40, 7]
    params = [DecodeParams(max_tokens=m, min_tokens=m) for m in lengths]
    hints = ["", " a", " b c", " d"]
    layers = _branches(backend, "layers", params, hints)
    rerun = Rerun()
    got = _branches(backend, "eager", params, hints, recorder=rerun)
    stats = backend.kv_stats().as_dict()
    assert got == layers
    assert 3 <= rerun.records <= 8  # the first layout, compactions as rows end, grown tails
    assert rerun.records == backend.engine.stepper.captures
    assert rerun.replays == stats["decode_steps_captured"] >= 140  # most steps replay
    assert rerun.records * WARMUP <= stats["decode_steps_fixed"] <= 8 * WARMUP  # each layout's first


def test_the_compiled_step_recorded_as_cuda_does(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a GPU takes by default, compiled and then recorded, run here with a CPU recorder:
    the layer loop's tokens; each recording reads the rows rounded up to `SPAN` slots and stays below
    the tails' capacity (a recording serves `SPAN` steps of growth, and a span at the capacity would
    be a program of its own); recordings, not compilations, follow the span, so recording adds no
    compilation to the run compiled without a recorder."""
    backend = HFBackend(tiny_llama_dir, decode_step="compiled", cache_bytes=0)
    params = DecodeParams(max_tokens=150, min_tokens=150)  # past the first capacity: the tails grow
    hints = ["", " a b"]
    layers = _branches(backend, "layers", [params], hints)
    assert _branches(backend, "compiled", [params], hints) == layers  # the kinds compile here
    compiler = backend.engine.stepper.compiler
    assert compiler is not None and compiler.failed is None
    compiles = compiler.compiles
    recorded: list[tuple[int, int, int]] = []
    rerun = Rerun()
    record = rerun.record

    def spy(step: Any) -> Any:
        graph = backend.engine.stepper._graph
        recorded.append((graph.attention.span, int(graph.lens.max()) + 1, graph.ctx.capacity))
        return record(step)

    monkeypatch.setattr(rerun, "record", spy)
    got = _branches(backend, "compiled", [params], hints, recorder=rerun)
    stats = backend.kv_stats().as_dict()
    assert got == layers
    assert compiler.compiles == compiles and compiler.failed is None
    assert len(recorded) == rerun.records >= 2  # a new span after 128 slots of growth
    for span, needed, capacity in recorded:
        assert span == min(capacity - 1, -(-needed // SPAN) * SPAN) >= needed
    assert rerun.replays == stats["decode_steps_captured"] >= params.max_tokens - 1 - 2 * rerun.records
    assert stats.get("decode_steps_compiled", 0) >= params.max_tokens - 1


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
