"""The fixed-shape decode step compiled by inductor, without a request ever waiting for it.

Why compiled: the eager step is ~40 kernels a layer (norms, rotary, residual adds one elementwise
kernel each); on a GPU that sets the length of the replayed CUDA graph (the uncompiled captured step
ran at 0.6x transformers' compiled static-cache `generate` on an H100) and on a CPU its
per-operation overhead. Inductor fuses each run of elementwise work into one kernel: compiled, then
captured, the step ran at 1.5-1.6x the uncompiled one (benchmarks/RESULTS.md).

Why ahead, in another process: a compilation costs tens of seconds a kind of batch on a GPU's host
and minutes on a small CPU (510 s for the three first kinds of the embedded model on 2 busy cores),
and it used to run inside whichever request first met a new kind (a 374 s request). Compiled in a
thread of this process it would still stall every step: tracing is Python, and the decode thread
waited for the interpreter lock after each of its ~1,200 operations (a 32-token decode took 4-5x as
long while a thread traced beside it, on 2 cores). So a kind not yet compiled runs eagerly, a worker
process (`step_worker.py`) compiles it with `torch.compile(...).aot_compile` on a copy of the model
built from its config (weights do not matter to a compilation, only shapes and types) and a small
batch of the same kind (`skeleton`), and writes the compiled step to the cache
(`<cache>/steps/<fingerprint>/`); this process loads it in a background thread and switches the
kind's next steps to it. The file outlives the process: a second server or eval on the same model,
dtype, device and torch compiles nothing it compiled before.

A compiled step is trusted only after its guards accept the batch it is given (once per batch
layout and span, `StepGraph.ahead`): a kind whose compiled step refuses the real batch, a kind the
worker could not compile, or compilation turned off (no C++ toolchain, a worker that died) keeps
running eagerly, and `unused` says why, so each run's notes can.
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from branchwise.backends.compute_thread import COMPUTE, ProcessExiting
from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.compile_worker import ModelSpec, Worker, stop_workers, worker_room
from branchwise.backends.hf.embedded import branchwise_cache_dir
from branchwise.backends.hf.own_kv import Tails

log = logging.getLogger(__name__)

SEGMENTS = 2
"""Shared segments a compiled step reads at most where the rows' own KV is not read in place by the
paged kernel (tails, or pages read as a copy): there each count of segments (and each pattern of
the rows that read them) is a kind of batch of its own, compiled anew, so a tree search would
compile at every new depth. One or two segments are the shapes that recur (a prompt shared by its
branches, under a cached lead-in); deeper batches run uncompiled and say so. Where the kernel reads
the pages in place it takes the segments too, padded to a power of two
(`step_attention.KernelSegments`): up to `HANDED_MOST` of them compile, one kind per padded count."""
HANDED_MOST = 32
"""The most shared segments a compiled step hands the paged kernel (`step_attention.KernelSegments`,
padded to a power of two: one kind per padded count); a batch reading more runs uncompiled and says
so (`not_compiled`)."""

SKELETON_CAPACITY, SKELETON_SPAN, SKELETON_SEGMENT, SKELETON_PAGES, SKELETON_VECTORS = 48, 32, 24, 5, 3
"""Sizes of the small batch a kind is compiled on (tail capacity, span read, shared segment length,
pages, steering vectors).
Each of these sizes is symbolic in the compiled step (`mark_sizes`), so any value serves, as long
as it is above 1 (0 and 1 are specialised) and the span stays below the capacity (`step.Stepper.span`
keeps it there for real batches too)."""


def mark_sizes(graph: Any) -> None:
    """Mark the sizes that vary between layouts of one kind as symbolic (batch rows, tail capacity,
    span, shared lengths and readers), so one compilation serves them all; every other size
    (heads, widths, vocabulary) stays a constant, which the generated kernels need to be fast (all
    sizes symbolic made the CPU's step 40 % slower)."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in (graph.ids, graph.pos, graph.lens, graph.attention.slots):
        mark(t, 0)
    ctx = graph.ctx
    if isinstance(ctx.kv, Tails):  # rows and capacity
        for t in ctx.kv.tensors():
            mark(t, 0)
            mark(t, 2)
    else:  # pages of storage, and the table's rows and width
        for t in ctx.kv.tensors():
            mark(t, 0)
        mark(ctx.kv.table, 0)
        mark(ctx.kv.table, 1)
    for seg in graph.attention.shared:  # a block pool's masked segment too
        for t in (*seg.keys, *seg.values):
            mark(t, 1)
        for extra in (seg.rows, seg.mask):
            if extra is not None:
                mark(extra, 0)
        if seg.mask is not None:
            mark(seg.mask, 1)
    if (steer := graph.steer) is not None:  # its rows, and the table's count of vectors
        for t in (steer.table, steer.idx, steer.scale):
            mark(t, 0)
    for t in (graph.fed, graph.carry):  # an early exit's piece: its rows
        if t is not None:
            mark(t, 0)
    handed = graph.attention.handed  # as the paged kernel takes them: the padding segments too
    for t in (*itertools.chain(*handed.keys), *itertools.chain(*handed.values)):
        mark(t, 1)
    for readers in handed.rows:
        mark(readers, 0)


def kind_of(graph: Any) -> str:
    """A kind of batch: what the compiler specialises on besides the symbolic sizes: one row or
    several, the layout, the shared segments, and what accelerations hand the step. Read in place
    by the paged kernel, the segments are the padded count it is handed, which of them hold one
    token (`step_attention.KernelSegments`) and how many masked ones are merged after (a block
    pool); otherwise, per segment, whether it is read by all rows, by one, and through a mask. The
    accelerations' part: the layer steering enters (None: none), whether the taps are fed the
    step's queries, and the paged kernel's scores; under an early exit, the piece and the exit's
    description (what builds its river: `step_inputs.Exits.describe`)."""
    attention = graph.attention
    steer = None if graph.steer is None else graph.steer.layer
    accel: tuple[Any, ...] = (steer, attention.feeds, attention.scored)
    if (exits := graph.ctx.exits) is not None:
        accel = (*accel, graph.piece, sorted(exits.describe()["config"].items()))
    if attention.in_place:
        segs: list[Any] = [
            len(attention.handed.rows),
            [keys[0].shape[1] == 1 for keys in attention.handed.keys],
            len(attention.merged),
        ]
    else:
        segs = [
            (
                s.rows is None,
                s.rows is not None and s.rows.numel() == 1,
                s.mask is not None,
                s.keys[0].shape[1] == 1,
            )
            for s in attention.shared
        ]
    layout = type(graph.ctx.kv).__name__
    return hashlib.sha256(
        repr((graph.ctx.batch == 1, graph.ctx.n_groups, segs, layout, accel)).encode()
    ).hexdigest()[:16]


def not_compiled(graph: Any) -> str | None:
    """Why `graph`'s batch runs uncompiled whatever is compiled (None: its kind may compile): it
    reads more shared segments than a compiled step takes, its pages are read as a copy, or an early
    exit's river would trace another int8 kernel than it runs later (`cpu_kernels.int8_linear_pending`). Why not
    compile the copy: it is what a batch reads while the paged kernel is still being built (or
    where it cannot be), a passing state whose kinds no later step would use (a second process
    compiled again every kind the first had met only while its kernel was building)."""
    attention = graph.attention
    river = graph.ctx.exits is not None and graph.ctx.lens.device.type == "cpu"
    if river and (pending := cpu_kernels.int8_linear_pending()) is not None:
        return f"the river's int8 kernel is not ready ({pending})"
    if attention.in_place:
        if attention.handed.real > HANDED_MOST:
            return (
                f"more than {HANDED_MOST} shared segments (the most one compiled step hands the paged kernel)"
            )
        return None
    if attention.copied is not None:
        return f"its pages are read as a copy ({attention.copied})"
    if len(attention.shared) > SEGMENTS:
        return f"more than {SEGMENTS} shared segments (each count would compile anew)"
    return None


def skeleton(graph: Any) -> dict[str, Any]:
    """A small batch of `graph`'s kind, on the CPU, for the worker to compile on: the same rows, the
    same tensors' types and inference flags (a compiled step's guards check both), zeroed, with
    every symbolic size cut to a skeleton size. A block pool comes as the masked segment the step
    reads it as; steering as its layer and a table; taps as the flags of what the step keeps for
    them (the taps themselves run after the step, in the engine); an early exit as its description
    (`step_inputs.Exits.describe`), with the piece to compile and the hidden states it starts from."""
    ctx = graph.ctx

    def cut(t: torch.Tensor, dim: int, n: int) -> dict[str, Any]:
        shape = list(t.shape)
        shape[dim] = n if shape[dim] > 1 else shape[dim]  # 0 and 1 are kinds of their own
        return {"data": torch.zeros(shape, dtype=t.dtype), "inference": t.is_inference()}

    def keep(t: torch.Tensor | None) -> dict[str, Any] | None:
        return None if t is None else {"data": t.detach().cpu().clone(), "inference": t.is_inference()}

    kv = ctx.kv
    if isinstance(kv, Tails):
        own: dict[str, Any] = {
            "keys": [cut(t, 2, SKELETON_CAPACITY) for t in kv.keys],
            "values": [cut(t, 2, SKELETON_CAPACITY) for t in kv.values],
        }
    else:  # every table entry page 0 (zeros), which each row reads under its length
        own = {
            "keys": [cut(t, 0, SKELETON_PAGES) for t in kv.keys],
            "values": [cut(t, 0, SKELETON_PAGES) for t in kv.values],
            "table": cut(kv.table, 1, SKELETON_CAPACITY // kv.block),
        }
    return {
        "own": own,
        "lens": cut(ctx.lens, 0, ctx.batch),
        "pos_next": None if ctx.pos_next is None else cut(ctx.pos_next, 0, ctx.batch),
        "n_groups": ctx.n_groups,
        "span": SKELETON_SPAN,
        "shared": [
            {
                "keys": [cut(k, 1, SKELETON_SEGMENT) for k in s.keys],
                "values": [cut(v, 1, SKELETON_SEGMENT) for v in s.values],
                "rows": keep(s.rows),
                "mask": None if s.mask is None else cut(s.mask, 1, SKELETON_SEGMENT),
            }
            for s in graph.attention.shared
        ],
        "steer": None
        if (steer := graph.steer) is None
        else {
            "layer": steer.layer,
            "table": cut(steer.table, 0, SKELETON_VECTORS),
            "idx": cut(steer.idx, 0, ctx.batch),
            "scale": cut(steer.scale, 0, ctx.batch),
        },
        "feeds": graph.attention.feeds,
        "scored": graph.attention.scored,
        "exits": None if (exits := ctx.exits) is None else exits.describe(),
        "piece": graph.piece,
        "carry": None if graph.carry is None else cut(graph.carry, 0, ctx.batch),
    }


class StepCompiler:
    """The compiled steps of one engine, compiled ahead by a worker process (module docstring).

    `__call__(graph)` runs the compiled step of the graph's kind where one is loaded and accepts the
    batch, else returns None at once (the caller runs the step eagerly) and, the first time a kind
    is met, has it compiled or loaded in the background. Nothing here ever makes a step wait.
    """

    def __init__(
        self,
        spec: ModelSpec | None,
        cache: Path | None = None,
        warm: Callable[[Any, dict[str, Any]], None] | None = None,
    ) -> None:
        self.spec = spec
        self.warm = warm
        """Runs a loaded step once on its kind's skeleton batch (`step.warm_step`), on the compute
        thread between calls, before the step is used: a compiled step's first call loads its
        kernels, or builds them where this machine's compiler cache lacks them (25-40 s of a busy
        2-core machine, measured inside a request before this existed)."""
        self.folder = (cache or branchwise_cache_dir() / "steps") / (spec.fingerprint() if spec else "none")
        self.compiles = 0
        """Kinds the worker compiled for this engine."""
        self.loaded = 0
        """Kinds whose compiled step came from the cache folder, compiled by an earlier process."""
        self.seconds = 0.0
        """The worker's seconds compiling them (spent in another process: no step waited)."""
        self.failed: str | None = None if spec is not None else "the model's config could not be read"
        """Why nothing compiles for this engine (None while it works)."""
        self.unused: str | None = None
        """Why the last call ran no compiled code (None when it did)."""
        cpu = spec is not None and spec.device == "cpu"  # there the worker runs while this process idles
        self._compiling = "its kind of batch is compiling in the background" + (
            " (on a CPU, while this process idles)" if cpu else ""
        )
        self._loading = "its kind of batch, compiled earlier, loads from the cache while this process idles"
        self._steps: dict[str, Any] = {}  # kind -> its loaded compiled step
        self._trouble: dict[str, str] = {}  # kind -> why it runs eagerly for good
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._worker: Worker | None = None

    @property
    def pending(self) -> int:
        """Kinds being compiled or loaded in the background now."""
        with self._lock:
            return len(self._pending)

    def ready(self, graph: Any) -> bool:
        """Whether a compiled step of `graph`'s kind is loaded (its guards not yet checked)."""
        kind = kind_of(graph)
        with self._lock:
            return kind in self._steps

    def status(self) -> dict[str, Any]:
        """What a server's `/health` shows: kinds compiled, loaded from the cache, compiling now,
        running uncompiled for good (and why), the worker's seconds, and whether it is held while
        requests compute (with the seconds it was held)."""
        worker = self._worker
        with self._lock:
            return {
                "compiled": self.compiles,
                "loaded": self.loaded,
                "compiling": len(self._pending),
                "uncompiled": sorted(set(self._trouble.values())) + ([self.failed] if self.failed else []),
                "compile_s": round(self.seconds, 1),
                "compile_held": bool(worker is not None and worker.paused and self._pending),
                "compile_held_s": round(worker.paused_s, 1) if worker is not None else 0.0,
            }

    @staticmethod
    def idle_status() -> dict[str, Any]:
        """`status` where nothing compiles (steps not compiled at all)."""
        return {"compiled": 0, "loaded": 0, "compiling": 0, "uncompiled": [], "compile_s": 0.0,
                "compile_held": False, "compile_held_s": 0.0}  # fmt: skip

    def preload(self) -> int:
        """Load every compiled step an earlier process left in the cache folder, now, in this thread
        (seconds of Python, where loading a kind when a batch first meets it would take them from
        the steps running meanwhile): what a server does as it starts. Returns the kinds loaded."""
        if self.failed is not None or not self.folder.is_dir():
            return 0
        before = self.loaded
        for path in sorted(self.folder.glob("*.step")):
            kind = path.stem
            with self._lock:
                if kind in self._steps or kind in self._pending:
                    continue
                self._pending.add(kind)
            self._load(kind, path, 0.0, True)
        return self.loaded - before

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no kind is pending (a benchmark's or a test's choice, never a step's): True
        when none is left within `timeout` seconds."""
        with self._ready:
            return self._ready.wait_for(lambda: not self._pending, timeout)

    def __call__(self, graph: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's logits and hidden states, compiled (`StepGraph.computed`); None where no
        compiled code ran (`unused` says why: run it uncompiled)."""
        self.unused = self.failed
        if self.failed is not None:
            return None
        if (why := not_compiled(graph)) is not None:
            self.unused = why
            return None
        span, piece = graph.attention.span, graph.piece
        accepted = graph.accepted.get(piece)
        if accepted is None or accepted[1] != span:
            step = self._accepting(graph)
            if step is None:
                return None
            accepted = graph.accepted[piece] = (step, span)
        out: tuple[torch.Tensor, torch.Tensor] = accepted[0](graph)
        return out

    def _accepting(self, graph: Any) -> Any:
        """The loaded compiled step whose guards accept `graph`; None (with `unused`) where there is
        none yet: the kind's compilation or loading is started, or it failed for good."""
        kind = kind_of(graph)
        with self._lock:
            step, trouble, pending = self._steps.get(kind), self._trouble.get(kind), kind in self._pending
        if trouble is not None:
            self.unused = trouble
            return None
        if step is not None:
            if step.guard_check(graph):
                return step
            reason = str(step._artifacts.guard_manager.check_verbose(step.prepare_f_locals(graph)))
            with self._lock:
                self._trouble[kind] = f"the step compiled ahead refused this batch ({reason[:200]})"
            self.unused = self._trouble[kind]
            return None
        self.unused = self._loading if (self.folder / f"{kind}.step").exists() else self._compiling
        if not pending:
            self._start(kind, graph)
        return None

    def _start(self, kind: str, graph: Any) -> None:
        """Load the kind's compiled step from the cache folder, or have the worker compile it, in
        the background either way (loading one is seconds of Python)."""
        with self._lock:
            self._pending.add(kind)
        path = self.folder / f"{kind}.step"
        if path.exists():
            _loader(self._load, (kind, path, 0.0, True, True))
            return
        try:
            if self._worker is None or not self._worker.alive():
                assert self.spec is not None
                if (short := worker_room(self.spec)) is not None:
                    self._give_up(kind, short)
                    return
                self._worker = Worker(self.spec, self.folder)
            self._worker.submit(kind, skeleton(graph), path, self._compiled)
        except Exception as exc:  # no interpreter to start, a full disk, ...
            self._give_up(kind, f"the compile worker could not start: {type(exc).__name__}: {exc}")

    def _compiled(self, kind: str, reply: dict[str, Any]) -> None:
        """The worker's reply for a kind (on the worker's reader thread)."""
        if not reply.get("ok"):
            self._give_up(kind, f"compiling it failed: {reply.get('error', 'the worker ended')}")
            return
        # a thread of its own, ended after: loading is seconds of Python, then a wait for the
        # compute thread to warm the step (`_load`), while the reader goes on reading replies
        args = (kind, Path(reply["path"]), float(reply.get("seconds", 0.0)), False, True)
        _loader(self._load, args)

    def _load(self, kind: str, path: Path, seconds: float, cached: bool, when_idle: bool = False) -> None:
        """Load a kind's compiled step and warm it; with `when_idle` (a background loader), only once
        the compute thread is idle: loading is seconds of Python, and beside a decode it slowed the
        decode more than the compiled step then saved (a one-off run with its kinds in the cache:
        11-13 s against 7-8.5 s uncompiled); so a short run never loads, and a server loads between
        its requests, as the worker compiles."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        if when_idle:
            _when_idle()
        try:
            with torch.inference_mode():  # a step's inputs are inference tensors (guards check it)
                step = AOTCompiledFunction.deserialize(path.read_bytes())
            step.disable_guard_check()  # checked once per batch layout instead (`_accepting`)
            batch, warm = path.with_suffix(".batch"), self.warm
            if warm is not None and batch.exists():
                sample = torch.load(batch, weights_only=False)
                # on the compute thread, once it is free: a thread that ever computed keeps OpenMP
                # workers that slow every later step of the process (a one-off run whose kinds
                # loaded and warmed on this thread decoded 1.3-1.5x slower than without them)
                COMPUTE.run(lambda: warm(step, sample))
        except ProcessExiting:  # the process ends: nothing to load it for
            with self._ready:
                self._pending.discard(kind)
                self._ready.notify_all()
            return
        except Exception as exc:  # a file from an incompatible build, a truncated write, ...
            if cached:  # an old file: compile the kind anew
                path.unlink(missing_ok=True)
                log.info("recompiling a kind of batch whose cached step could not load: %s", exc)
                with self._lock:
                    self._pending.discard(kind)
                return
            self._give_up(kind, f"its compiled step could not load: {type(exc).__name__}: {exc}")
            return
        with self._ready:
            self._steps[kind] = step
            self._pending.discard(kind)
            if cached:
                self.loaded += 1
            else:
                self.compiles += 1
                self.seconds += seconds
            self._ready.notify_all()
        log.info(
            "decode step ready for a new kind of batch (%s)",
            "from the cache" if cached else f"compiled in {seconds:.1f} s",
        )

    def _give_up(self, kind: str, why: str) -> None:
        log.warning("a kind of batch keeps running uncompiled: %s", why)
        with self._ready:
            self._trouble[kind] = why
            self._pending.discard(kind)
            self._ready.notify_all()

    def close(self) -> None:
        """Stop the worker process (at exit, or when the engine goes)."""
        if self._worker is not None:
            self._worker.close()


_LOADERS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
"""Threads loading and warming a compiled step now: they run torch, so exit waits for them."""

LOADER_EXIT_WAIT_S = 60.0
"""Longest wait at exit for the steps being loaded and warmed (seconds of Python, and one step)."""


def _when_idle() -> None:
    """Return once the compute thread is idle (`COMPUTE.watch`; at once where it is)."""
    idle = threading.Event()
    unwatch = COMPUTE.watch(lambda busy: idle.clear() if busy else idle.set())
    try:
        idle.wait()
    finally:
        unwatch()


def _loader(load: Callable[..., None], args: tuple[Any, ...]) -> None:
    """Run `load(*args)` on a daemon thread of its own, joined at exit (`_stop_workers`)."""
    thread = threading.Thread(target=load, args=args, name="step-loader", daemon=True)
    _LOADERS.add(thread)
    thread.start()


@atexit.register
def _stop_workers() -> None:
    """No worker outlives this process, and no step is being loaded as the interpreter finalises: a
    daemon thread still inside torch then aborts the process (see `compute_thread`)."""
    stop_workers()
    until = time.monotonic() + LOADER_EXIT_WAIT_S
    for thread in list(_LOADERS):
        thread.join(max(0.0, until - time.monotonic()))
