"""The compiled decode step (`step_compiler.py`, `step_worker.py`): compiled ahead in a worker
process, never inside a request, and the layer loop's tokens once it runs.

Why: a compilation costs minutes of a small CPU's time, and it used to run inside whichever request
first met a new kind of batch. Now a kind not yet compiled runs eagerly while a worker process
compiles it; these tests hold that no step waits for it, that the compiled step gives the layer
loop's greedy tokens once it is there, that what was compiled is reused by the next process from
the cache folder, and that every step that did not run compiled says why.

Compilations are slow even on the tiny model (~20-40 s a kind on 2 cores), so the tests of this
module share one cache folder (`shared_cache`): a kind compiled by one test loads from disk in the
next, as it would in a second server. Tests that need nothing cached use a folder of their own.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit import Rerun
from torch._inductor.utils import run_and_get_code

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel
from branchwise.backends.hf import HFBackend, step_attention, step_compiler
from branchwise.backends.hf.reasoncache import ReasonCache, StepBoundaries
from branchwise.backends.hf.skipkv_steering import SteeringVector, steering_path
from branchwise.backends.hf.step import COMPILED_SPAN, SPAN, StepGraph, from_skeleton
from branchwise.backends.hf.step_compiler import SEGMENTS, StepCompiler, skeleton
from branchwise.backends.hf.step_worker import aot_step, compile_kind

sys.path.insert(0, str(Path(__file__).parent))
from test_step import PROMPT, _branches

pytestmark = pytest.mark.slow

WAIT_S = 900.0
"""How long a test waits for the worker (a bound on a hung worker, not a speed claim)."""


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("branchwise-cache")


@pytest.fixture(autouse=True)
def _cache_dir(shared_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(shared_cache))


def _compiler(backend: HFBackend) -> StepCompiler:
    backend.decode_step = "compiled"
    compiler = backend.engine.stepper.compiler
    assert compiler is not None
    return compiler


def _settled(backend: HFBackend, params: list[DecodeParams], hints: list[str]) -> list[list[int]]:
    """`_branches` compiled, once its kinds are ready: a first call (eager where a kind is not),
    then a wait for the worker, then the call whose steps and tokens the test checks."""
    _branches(backend, "compiled", params, hints)
    assert _compiler(backend).wait(WAIT_S), "the compile worker did not finish"
    return _branches(backend, "compiled", params, hints)


def test_no_request_waits_for_a_compilation(
    tiny_llama_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing compiled yet, a request's steps run eagerly with the layer loop's tokens, and it
    returns while its kind is still compiling in the worker (it did not wait: the compilation takes
    tens of seconds, the request a fraction of one); its notes say why its steps ran uncompiled.
    Once compiled, the same request runs compiled. A second engine (as a second process would)
    loads the compiled step from the cache folder and compiles nothing."""
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path))
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    params = [DecodeParams(max_tokens=8, min_tokens=8)]
    hints = ["", " a b"]
    layers = _branches(backend, "layers", params, hints)
    compiler = _compiler(backend)
    assert _branches(backend, "compiled", params, hints) == layers
    assert compiler.pending >= 1 and compiler.compiles == 0  # returned before its kind compiled
    stats = backend.kv_stats().as_dict()
    assert stats.get("decode_steps_uncompiled", 0) >= params[0].max_tokens - 1
    assert "decode_steps_compiled" not in stats
    (note,) = Accel().notes(stats)
    assert "its kind of batch is compiling in the background" in note

    assert compiler.wait(WAIT_S) and compiler.compiles >= 1 and compiler.seconds > 0
    assert _branches(backend, "compiled", params, hints) == layers
    stats = backend.kv_stats().as_dict()
    assert stats.get("decode_steps_compiled", 0) >= params[0].max_tokens - 1
    assert "decode_steps_uncompiled" not in stats

    again = HFBackend(tiny_llama_dir, cache_bytes=0)
    second = _compiler(again)
    assert _branches(again, "compiled", params, hints) == layers
    assert second.wait(WAIT_S) and second.loaded >= 1 and second.compiles == 0
    assert _branches(again, "compiled", params, hints) == layers
    assert again.kv_stats().as_dict().get("decode_steps_compiled", 0) >= params[0].max_tokens - 1


@pytest.mark.parametrize("layout", ["tails", "pages"])
def test_compiled_step_gives_the_layer_loops_tokens(tiny_llama_dir, layout: str) -> None:
    """The compiled step gives the layer loop's greedy tokens in fp32, for one row and for a shared
    prompt read by rows of unequal lengths, every step counted as compiled, with the CPU's
    prepacked weights kept (the compiled step calls the same oneDNN products on them), whichever
    layout holds the rows' own KV (pages: read in place by the kernel inside the compiled step)."""
    backend = HFBackend(tiny_llama_dir, kv_layout=layout)  # type: ignore[arg-type]
    assert backend.prepacked.active
    params = [DecodeParams(max_tokens=12, min_tokens=12)]
    for hints in (["", " hint", " hint hint"], [""]):
        layers = _branches(backend, "layers", params, hints)
        assert _settled(backend, params, hints) == layers
        stats = backend.kv_stats().as_dict()
        assert stats.get("decode_steps_compiled", 0) >= params[0].max_tokens - 1, str(stats)
        assert "decode_steps_uncompiled" not in stats
    assert _compiler(backend).status()["uncompiled"] == []


def test_each_kind_of_batch_compiles_once(tiny_llama_dir) -> None:
    """Fresh prompts of other lengths, other numbers of rows, batches that grow past their tails'
    capacity: once the two kinds (several rows, one row) are compiled, none is compiled again and
    every step runs compiled (the compiled step's guards accept every layout of its kind; the
    span read stays below the capacity and above one slot). No prefix cache: a cached prompt is
    one more segment."""
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    compiler = _compiler(backend)
    for hints in (["", " a b"], [" x"]):
        _settled(backend, [DecodeParams(max_tokens=6, min_tokens=6)], hints)
    made = compiler.compiles + compiler.loaded
    for tokens in (6, 150):  # 150: past the first tail capacity, so the tails grow
        for hints in (["", " a b"], [" x"], [" hint", "", " hint hint hint"], ["", " a", " b", " c", " d"]):
            _branches(backend, "compiled", [DecodeParams(max_tokens=tokens, min_tokens=tokens)], hints)
            stats = backend.kv_stats().as_dict()
            assert "decode_steps_uncompiled" not in stats, stats
    assert compiler.compiles + compiler.loaded == made and compiler.pending == 0


def test_the_compiled_step_reads_the_slots_in_use_not_the_capacity(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Compiled, a step reads its rows' tails up to the longest row rounded to `COMPILED_SPAN`
    slots, always below the capacity (one program for every span), not the whole capacity: the
    tails grow by 128 slots at least, which a step read in full (masked) before. Same tokens."""
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    params = [DecodeParams(max_tokens=150, min_tokens=150)]  # past the first capacity: the tails grow
    hints = ["", " a b"]
    layers = _branches(backend, "layers", params, hints)
    _settled(backend, [DecodeParams(max_tokens=4, min_tokens=4)], hints)
    seen: list[tuple[int, int, int]] = []
    call = StepCompiler.__call__

    def spy(self: StepCompiler, graph: Any) -> Any:
        ctx = graph.ctx
        seen.append((graph.attention.span, int(ctx.lens.max()) + 1, ctx.capacity))
        return call(self, graph)

    monkeypatch.setattr(StepCompiler, "__call__", spy)
    assert _branches(backend, "compiled", params, hints) == layers
    assert backend.kv_stats().as_dict().get("decode_steps_compiled", 0) >= params[0].max_tokens - 1
    for span, needed, capacity in seen:
        assert span == min(capacity - 1, -(-needed // COMPILED_SPAN) * COMPILED_SPAN) >= needed
    assert len({capacity for _, _, capacity in seen}) > 1  # it grew, and the span followed the rows


def _graph_of(backend: HFBackend, hints: list[str]) -> StepGraph:
    """A real batch's step (the last layout of an eager decode of `hints`)."""
    seen: list[StepGraph] = []
    call = StepGraph.__call__

    def spy(self: StepGraph, *args: Any) -> torch.Tensor:
        seen.append(self)
        return call(self, *args)

    StepGraph.__call__ = spy  # type: ignore[method-assign]
    try:
        _branches(backend, "eager", [DecodeParams(max_tokens=4, min_tokens=4)], hints)
    finally:
        StepGraph.__call__ = call  # type: ignore[method-assign]
    return seen[-1]


def test_the_compiled_step_writes_the_tails_in_place(tiny_llama_dir, tmp_path: Path) -> None:
    """What the worker compiles (`compile_kind`, run here in this process to read its code) writes
    each row's new K/V into its tail where it lies: the generated code allocates no buffer of a
    tail's shape `[B, H_kv, capacity, D]` (a step that wrote with a scatter was compiled into a copy
    of every layer's whole tails at every step). Its cascade over the shared prompt is the plain
    products on a CPU, which inductor fuses (`attention.fused_attention`), not the flash kernel."""
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    parts = backend.engine.stepper.parts
    graph = from_skeleton(skeleton(_graph_of(backend, ["", " a b"])), parts, backend.device)
    assert graph.ctx.shared
    step = aot_step()
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, sources = run_and_get_code(compile_kind, step, graph, tmp_path / "kind.step")
    assert sources, "nothing was compiled"
    h_kv, d = parts.n_kv_heads, parts.head_dim
    shapes = [
        [part.strip() for part in shape.split(",")]
        for code in sources
        for shape in re.findall(r"empty_strided_\w+\(\(([^()]*)\)", code)
    ]
    tails = [s for s in shapes if len(s) == 4 and s[1] == str(h_kv) and s[3] == str(d) and s[2] != "1"]
    assert shapes and not tails, tails
    assert not [code for code in sources if "_scaled_dot_product_flash_attention_for_cpu" in code]


def _tree(backend: HFBackend, mode: str, fans: tuple[int, ...], params: DecodeParams) -> list[list[int]]:
    """Greedy tokens of the leaves of a tree forked `len(fans)` times (`fans[i]` children a node at
    level i, each with a few tokens of its own), decoded by `mode`; the tree released after. Its
    batch reads every node above the leaves as a shared segment."""
    backend.decode_step = mode  # type: ignore[assignment]
    backend.reset_stats()
    nodes = [backend.prefill(backend.encode(PROMPT))]
    made = list(nodes)
    for level, fan in enumerate(fans):
        nodes = [kid for node in nodes for kid in backend.fork(node, fan)]
        backend.append(nodes, [backend.encode(f" {level} {i}") for i in range(len(nodes))])
        made += nodes
    tokens = [g.token_ids for g in backend.extend(nodes, params)]
    backend.release(made)
    return tokens


def test_deeper_batches_on_tails_run_uncompiled_and_say_so(tiny_llama_dir) -> None:
    """Rows in tails reading more than `SEGMENTS` shared ancestors (a tree three forks deep) are not
    compiled (each count of segments would be a compilation of its own): those steps run uncompiled
    with the layer loop's tokens, and the statistics and notes say why."""
    backend = HFBackend(tiny_llama_dir, kv_layout="tails")
    params = DecodeParams(max_tokens=6, min_tokens=6)
    fans = (2,) * (SEGMENTS + 1)
    layers = _tree(backend, "layers", fans, params)
    assert _tree(backend, "compiled", fans, params) == layers
    stats = backend.kv_stats().as_dict()
    # the first step's batch holds the leaves' ancestors in their tails (copied while they are
    # computed); every later one reads them as shared segments
    assert stats.get("decode_steps_uncompiled", 0) >= params.max_tokens - 2
    assert f"uncompiled_by more than {SEGMENTS} shared segments (each count would compile anew)" in stats
    assert any(f"more than {SEGMENTS} shared segments" in note for note in Accel().notes(stats))


def test_trees_on_pages_compile_one_kind_per_padded_count(tiny_llama_dir) -> None:
    """Read in place, a tree's ancestors go to the paged kernel padded to a power of two
    (`KernelSegments`): trees whose batches read three and four shared segments (their roots
    forked two and three ways, each child twice) are one kind of batch, compiled once; every later
    step of both runs compiled with the layer loop's tokens."""
    backend = HFBackend(tiny_llama_dir, kv_layout="pages", cache_bytes=0)
    params = DecodeParams(max_tokens=6, min_tokens=6)
    shapes = ((2, 2), (3, 2))
    layers = {fans: _tree(backend, "layers", fans, params) for fans in shapes}
    compiler = _compiler(backend)
    _tree(backend, "compiled", shapes[0], params)
    assert compiler.wait(WAIT_S), "the compile worker did not finish"
    assert compiler.status()["uncompiled"] == []
    made = compiler.compiles + compiler.loaded
    for fans in shapes:
        assert _tree(backend, "compiled", fans, params) == layers[fans]
        stats = backend.kv_stats().as_dict()
        assert stats.get("decode_steps_compiled", 0) >= params.max_tokens - 2, stats
    assert compiler.compiles + compiler.loaded == made and compiler.pending == 0


@pytest.mark.parametrize(
    ("name", "example"),
    [
        ("skipkv", "acting"),
        ("rsbcm", "acting"),
        ("reasoncache", "acting"),
        ("river", "acting"),
        ("river", "lossless"),
    ],
)
def test_accelerated_steps_compile_and_give_the_uncompiled_steps_tokens(
    tiny_llama_dir, name: str, example: str
) -> None:
    """An acceleration that acts inside a step compiles with it: SkipKV's steering is an input of
    the compiled step and its query window is fed after it, RSBCM's attention-mass tap is fed the
    paged kernel's scores the compiled step kept, ReasonCache's block pool is one more (masked)
    segment (every token ends a step here, so rows point at blocks from the first steps on), River's
    exits are pieces compiled each as a kind (acting: every step exits onto the river at the first
    candidate; lossless: none does, each candidate layer is a piece, then the backbone's rest). Each,
    on the tiny model with its declared settings, gives the uncompiled step's greedy tokens and the
    same decisions (its statistics), and once its kinds are compiled every step runs compiled."""
    backend = HFBackend(tiny_llama_dir, kv_layout="pages", cache_bytes=0)
    if name == "skipkv":  # its declared settings steer with the model's saved vector
        d = backend.parts.embed.embedding_dim
        vector = SteeringVector(layer=1, vector=torch.full((d,), 0.05), n_exec=2, n_nonexec=1, model="tiny")
        vector.save(steering_path(backend.model_name))
    config = Accel.configs()[name]
    assert config.examples is not None
    accel = Accel(**{name: config.model_validate(dict(getattr(config.examples, example)))})
    params = DecodeParams(max_tokens=12, min_tokens=12)

    def run(mode: str, recorder: Rerun | None = None) -> tuple[list[list[int]], dict[str, Any]]:
        backend.decode_step = mode
        backend.engine.stepper.recorder = recorder
        session = backend.session(accel=accel)
        if (plugin := session.plugin(ReasonCache)) is not None:
            vocab = frozenset(range(len(backend.tokenizer)))
            plugin.boundaries = StepBoundaries(
                closes=vocab, sentence_end=frozenset(), space_start=frozenset()
            )
        root = session.prefill(backend.encode(PROMPT))
        kids = session.fork(root, 3)
        session.append(kids, [backend.encode(h) for h in ("", " a b", " hint")])
        gens = session.extend(kids, params)
        stats = session.kv_stats().as_dict()
        session.release([*kids, root])
        return [g.token_ids for g in gens], stats

    def acted(stats: dict[str, Any]) -> dict[str, Any]:
        assert config.examples is not None
        return {key: stats.get(key) for key in config.examples.acted}

    eager, eager_stats = run("eager")
    assert any(acted(eager_stats).values()) == (example == "acting"), f"{name}: {eager_stats}"
    run("compiled")
    compiler = _compiler(backend)
    assert compiler.wait(WAIT_S), "the compile worker did not finish"
    tokens, stats = run("compiled")
    assert tokens == eager and acted(stats) == acted(eager_stats)
    assert stats.get("decode_steps_compiled", 0) >= params.max_tokens - 1, stats
    assert "decode_steps_uncompiled" not in stats and "decode_steps_layer_loop" not in stats, stats
    assert compiler.status()["uncompiled"] == []
    if name == "river":  # the path a GPU takes: each compiled piece recorded once, then replayed
        rerun = Rerun()
        recorded, stats = run("compiled", rerun)
        assert recorded == eager and acted(stats) == acted(eager_stats)
        assert (
            rerun.replays > rerun.records > 0
            and stats.get("decode_steps_compiled", 0) >= params.max_tokens - 1
        )


def test_pages_read_as_a_copy_are_never_compiled_and_say_so(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the paged kernel is not there (still building, or unbuildable) a paged batch reads a
    copy of its pages: its steps run uncompiled with the layer loop's tokens, no kind is started for
    that passing state (`step_compiler.not_compiled`), and the statistics and notes say why."""
    why = "the paged decode kernel is still being built"
    monkeypatch.setattr(step_attention, "pages_copied", lambda ctx, taps: why)
    backend = HFBackend(tiny_llama_dir, kv_layout="pages", cache_bytes=0)
    params = [DecodeParams(max_tokens=6, min_tokens=6)]
    hints = ["", " a b"]
    layers = _branches(backend, "layers", params, hints)
    compiler = _compiler(backend)
    assert _branches(backend, "compiled", params, hints) == layers
    stats = backend.kv_stats().as_dict()
    assert compiler.pending == 0 and compiler.compiles == 0
    assert stats.get("decode_steps_uncompiled", 0) >= params[0].max_tokens - 1
    assert f"uncompiled_by its pages are read as a copy ({why})" in stats
    assert any("its pages are read as a copy" in note for note in Accel().notes(stats))


def test_warm_up_starts_the_first_kinds_and_can_wait(tiny_llama_dir) -> None:
    """`warm_up` (what `branchwise serve` calls as it starts) decodes a few tokens of one row,
    several rows and rows over shared prompts in a session of its own (the backend's statistics
    stay clean), which starts their compilation; with `wait` it blocks until they are ready, and
    the next steps run compiled. Where steps are not compiled it does nothing."""
    assert HFBackend(tiny_llama_dir).warm_up()["compiled"] == 0  # eager on the CPU
    backend = HFBackend(tiny_llama_dir, decode_step="compiled")
    warmed = backend.warm_up(wait=WAIT_S)
    assert warmed["compiled"] + warmed["loaded"] >= 2 and warmed["compiling"] == 0, warmed
    assert "decode_steps_compiled" not in backend.kv_stats().as_dict() and backend.kv_stats().live_nodes == 0
    params = DecodeParams(max_tokens=6, min_tokens=6)
    _branches(backend, "compiled", [params], ["", " x"])
    stats = backend.kv_stats().as_dict()
    assert (
        stats.get("decode_steps_compiled", 0) >= params.max_tokens - 1
        and "decode_steps_uncompiled" not in stats
    )


def test_a_failed_compilation_is_noted_and_the_step_runs_uncompiled(
    tiny_llama_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compilation that fails (here: the C++ compiler is missing, as on a machine without a
    toolchain) leaves its kind running uncompiled with the same tokens, for good (it is not tried
    at every step); the run's statistics count those steps and its notes say why."""
    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing compiled before
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    params = [DecodeParams(max_tokens=8, min_tokens=8)]
    layers = _branches(backend, "layers", params, ["", " x"])
    assert _settled(backend, params, ["", " x"]) == layers
    stats = backend.kv_stats().as_dict()
    assert (
        stats.get("decode_steps_uncompiled", 0) >= params[0].max_tokens - 1
        and "decode_steps_compiled" not in stats
    )
    (note,) = Accel().notes(stats)
    assert "decode steps left the fast step" in note and "uncompiled: " in note
    assert "compiling it failed" in note
    assert _compiler(backend).compiles == 0 and _compiler(backend).status()["uncompiled"]


def test_a_compiled_step_that_refuses_a_batch_leaves_it_uncompiled(
    tiny_llama_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiled step is trusted only once its guards accept the batch: a kind whose step refuses
    it (here every batch is made one kind, so a lone row meets the step compiled for several rows,
    which is specialised on more than one) runs uncompiled with the layer loop's tokens and a note
    that says the compiled step refused it."""
    monkeypatch.setattr(step_compiler, "kind_of", lambda graph: "one kind for all")
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    params = DecodeParams(max_tokens=6, min_tokens=6)
    _settled(backend, [params], ["", " x"])

    def lone(mode: str) -> list[int]:
        backend.decode_step = mode  # type: ignore[assignment]
        backend.reset_stats()
        root = backend.prefill(backend.encode(PROMPT))
        (gen,) = backend.extend([root], params)
        backend.release([root])
        return gen.token_ids

    compiled = lone("compiled")
    stats = backend.kv_stats().as_dict()
    assert compiled == lone("layers")
    assert stats.get("decode_steps_uncompiled", 0) >= params.max_tokens - 1
    assert any("the step compiled ahead refused this batch" in note for note in Accel().notes(stats))


def test_the_compiled_step_recorded_as_cuda_does(tiny_llama_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a GPU takes by default, compiled and then recorded, run here with a CPU recorder:
    the layer loop's tokens; each recording reads the rows rounded up to `SPAN` slots and stays below
    the tails' capacity (a recording serves `SPAN` steps of growth, and a span at the capacity would
    be a program of its own); recordings, not compilations, follow the span."""
    backend = HFBackend(tiny_llama_dir, cache_bytes=0)
    params = [DecodeParams(max_tokens=150, min_tokens=150)]  # past the first capacity: the tails grow
    hints = ["", " a b"]
    layers = _branches(backend, "layers", params, hints)
    compiler = _compiler(backend)
    _settled(backend, [DecodeParams(max_tokens=4, min_tokens=4)], hints)
    made = compiler.compiles + compiler.loaded
    recorded: list[tuple[int, int, int]] = []
    rerun = Rerun()
    record = rerun.record

    def spy(step: Any) -> Any:
        graph = backend.engine.stepper._graph
        assert graph is not None
        recorded.append((graph.attention.span, int(graph.lens.max()) + 1, graph.ctx.capacity))
        return record(step)

    monkeypatch.setattr(rerun, "record", spy)
    got = _branches(backend, "compiled", params, hints, recorder=rerun)
    stats = backend.kv_stats().as_dict()
    assert got == layers
    assert compiler.compiles + compiler.loaded == made and compiler.pending == 0
    assert len(recorded) == rerun.records >= 2  # a new span after 128 slots of growth
    for span, needed, capacity in recorded:
        assert span == min(capacity - 1, -(-needed // SPAN) * SPAN) >= needed
    assert rerun.replays == stats["decode_steps_captured"] >= params[0].max_tokens - 1 - 2 * rerun.records
    assert stats.get("decode_steps_compiled", 0) >= params[0].max_tokens - 1


@pytest.mark.skipif(sys.platform != "linux", reason="process groups and SIGSTOP are POSIX; checked on Linux")
def test_a_stopped_worker_ends_when_its_process_is_killed(tmp_path: Path) -> None:
    """The worker is held stopped while its process computes; that process killed then (SIGKILL)
    must not leave it stopped for good. A child process spawns a worker-like process as the engine
    does (`compile_worker.spawn`), stops it, and is killed: the worker ends within seconds."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, signal, sys\n"
        "from branchwise.backends.hf.compile_worker import spawn\n"
        f"log = open({str(tmp_path / 'worker.log')!r}, 'ab')\n"
        "worker = spawn([sys.executable, '-c', 'import sys; sys.stdin.read()'], log, dict(os.environ))\n"
        "os.kill(worker.pid, signal.SIGSTOP)\n"
        "print(worker.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    parent = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert parent.returncode == -signal.SIGKILL, parent.stderr[-2000:]
    pid = int(parent.stdout.split()[0])

    def ended() -> bool:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        return "\nState:\tZ" in state  # a zombie has ended; its reaper may be slow to reap it

    deadline = time.monotonic() + 20
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not ended():
        os.kill(pid, signal.SIGKILL)  # leave nothing behind, then fail
        pytest.fail("the worker was left stopped after its process was killed")


@pytest.mark.parametrize("closed", [False, True], ids=["died", "closed"])
def test_a_worker_that_dies_fails_its_kinds_and_one_closed_fails_none(closed: bool) -> None:
    """A worker that ends by itself (a crash, the OOM killer) fails every kind it had not answered,
    so they run eagerly and say why; one this process stops (its exit, its engine gone) fails none:
    a one-off run used to end with a warning per kind that its compilation had failed."""
    import io
    import subprocess
    import threading

    from branchwise.backends.hf.compile_worker import Worker

    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    worker = object.__new__(Worker)  # its replies and its end alone, around a stand-in process
    worker._proc, worker._closed, worker._unwatch = proc, False, None
    worker._lock, worker._log = threading.Lock(), io.BytesIO()
    failed: list[tuple[str, str]] = []
    worker._jobs = {"a-kind": lambda kind, reply: failed.append((kind, reply["error"]))}
    reader = threading.Thread(target=worker._read)
    reader.start()
    if closed:
        worker.close()
    else:
        proc.kill()
    reader.join(30)
    assert not reader.is_alive()
    if closed:
        assert failed == []
    else:
        assert failed == [("a-kind", "the compile worker exited (-9); see worker.log")]
    proc.wait()


def test_models_compile_compiles_the_first_kinds_for_later_runs(
    tiny_llama_dir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short `branchwise run` ends before its kinds compile, and says how to compile them ahead;
    `branchwise models compile` then compiles the kinds runs meet first, printing its status, and
    the next run on the same engine decodes compiled; a new engine on the same model (a server as
    it starts, `HFBackend.preload_steps`) loads every kind from the cache."""
    from typer.testing import CliRunner

    from branchwise.backends.hf.step import AUTO_ENV
    from branchwise.cli import app

    monkeypatch.setenv("BRANCHWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(AUTO_ENV, "compiled")
    runner = CliRunner()
    run = ["run", "What is 12 + 7?", "--n", "3", "--max-tokens", "8", "--model", str(tiny_llama_dir)]
    first = runner.invoke(app, run)
    assert first.exit_code == 0, first.output
    assert "branchwise models compile" in " ".join(first.output.split())
    made = runner.invoke(app, ["models", "compile", "--model", str(tiny_llama_dir)])
    assert made.exit_code == 0, made.output
    status = json.loads(made.stdout[made.stdout.index("{") :])
    assert status["compiled"] + status["loaded"] >= 6 and status["uncompiled"] == [], status
    again = runner.invoke(app, [*run, "--json"])
    assert again.exit_code == 0, again.output
    stats = json.loads(again.stdout.strip().splitlines()[-1])["kv_stats"]
    # its prompt cached but for its last token: the kinds of a repeated prompt, compiled too
    assert stats.get("decode_steps_compiled", 0) > 0 and "decode_steps_uncompiled" not in stats, stats
    fresh = HFBackend(tiny_llama_dir)
    fresh.decode_step = "compiled"
    assert fresh.preload_steps() >= 6
