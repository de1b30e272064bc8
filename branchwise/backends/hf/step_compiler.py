"""The fixed-shape decode step through `torch.compile` (inductor): one compiler per engine.

Why: the eager step is ~40 kernels a layer (norms, rotary, residual adds one elementwise kernel
each); on a GPU that sets the length of the replayed CUDA graph, and on an H100 the uncompiled
captured step ran at 0.6x transformers' compiled static-cache `generate` at one row. Inductor
fuses each run of elementwise work into one kernel; compiled, then captured, the same step ran at
1.5-1.6x the uncompiled one (benchmarks/RESULTS.md). It compiles `StepGraph.computed` (`step.py`,
which hands it over: this module does not import it), reading the step's inputs from the graph it
is called with; the sizes that vary between batch layouts are marked symbolic first.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

RECOMPILE_LIMIT = 64
"""Compiled versions of the step a process keeps (torch's default, 8 per function, is for code
whose shapes should not vary). Every engine of the process compiles the same function, and each
model, dtype, one-row batch and count of shared segments is a version of its own: a process
holding a few models meets tens, never hundreds."""


SEGMENTS = 2
"""Shared segments a compiled step reads at most. Each count of segments (and each pattern of the
rows that read them) is a kind of batch of its own, compiled anew: a tree search whose rows descend
from ever more ancestors, or a prefix cache that splits prompts at every common lead-in, would
compile at every new depth (tens of seconds each). One or two segments are the shapes that recur
(a prompt shared by its branches, under a cached lead-in); deeper batches run uncompiled and say so."""


class StepCompiler:
    """The fixed-shape step through `torch.compile` (inductor), for one engine (see the module
    docstring). The sizes that vary between layouts are symbolic from the first compilation
    (`_mark_sizes`); a change that a compiled version's guards reject (a batch of one row, another
    count of shared segments) compiles once more, up to `RECOMPILE_LIMIT` versions in the
    process: a kind past it runs uncompiled, the kinds compiled before keep their code, and a batch
    reading more than `SEGMENTS` shared segments is not compiled at all. Any other
    failure, at compilation or in a compiled step, switches compilation off for good (`failed` says
    why, once, as a warning too). Either way the caller runs the step uncompiled (`unused` says
    why), which rewrites the same K/V slots, so a step that failed half way is simply run again."""

    def __init__(self, step: Callable[[Any], torch.Tensor]) -> None:
        self.compiles = 0
        """Graphs inductor compiled (one per kind of layout: see the module docstring)."""
        self.seconds = 0.0
        """Wall time of the steps that compiled something (tracing and code generation included)."""
        self.last_seconds = 0.0
        """What the last call spent compiling (0.0 when it ran compiled code as it was)."""
        self.failed: str | None = None
        """Why compilation is off (None while it works)."""
        self.unused: str | None = None
        """Why the last call ran no compiled code (None when it did)."""
        self._fn = torch.compile(step, fullgraph=True, backend=self._inductor)

    @staticmethod
    def _mark_sizes(graph: Any) -> None:
        """Mark the sizes that vary between layouts of one kind as symbolic before they are first
        seen (batch rows, tail capacity, span, shared lengths and readers), so the first compilation
        serves them all; every other size (heads, widths, vocabulary) stays a constant, which the
        generated kernels need to be fast (all sizes symbolic made the CPU's step 40 % slower)."""
        mark = torch._dynamo.maybe_mark_dynamic
        for t in (graph.ids, graph.pos, graph.lens, graph.attention.slots):
            mark(t, 0)
        ctx = graph.ctx
        for t in (*ctx.tail_k, *ctx.tail_v):
            mark(t, 0)
            mark(t, 2)
        for seg in ctx.shared:
            for t in (*seg.keys, *seg.values):
                mark(t, 1)
            for extra in (seg.rows, seg.mask):
                if extra is not None:
                    mark(extra, 0)

    def _inductor(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.compiles += 1
        return compile_fx(gm, example_inputs)

    def __call__(self, graph: Any) -> torch.Tensor | None:
        """The step's logits, compiled; None where it ran no compiled code (`unused` says why: run
        it uncompiled)."""
        self.last_seconds = 0.0
        self.unused = self.failed
        if self.failed is not None:
            return None
        if len(graph.ctx.shared) > SEGMENTS:
            self.unused = f"more than {SEGMENTS} shared segments (each count would compile anew)"
            return None
        before, start = self.compiles, time.perf_counter()
        try:
            self._mark_sizes(graph)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                logits: torch.Tensor = self._fn(graph)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            self.unused = f"a new kind of batch past the recompile limit ({RECOMPILE_LIMIT} kinds compiled)"
            return None
        except Exception as exc:  # a missing C++ compiler, an operation inductor cannot lower, ...
            root: BaseException = exc
            while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
                root = inner  # torch wraps the compiler's error: name the cause
            first = (str(root).strip().splitlines() or [""])[0]
            self.failed = self.unused = f"{type(root).__name__}: {first}"[:300]
            warnings.warn(
                f"the compiled decode step failed; steps run uncompiled from now on: {self.failed}",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        if self.compiles != before:
            self.last_seconds = time.perf_counter() - start
            self.seconds += self.last_seconds
        return logits
