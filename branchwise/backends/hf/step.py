"""The decode step at fixed shapes: one token per row through every layer, replayable as a CUDA graph.

Why: a decode step of the layer loop (`runner.py`) launches hundreds of small kernels from Python
and builds its masks from host-side lengths; on a GPU that launch cost, not memory, sets the step
time (15-16 ms whatever the batch on an H200, against 3.3 ms for transformers' static-cache
generate). Here a step is a function of tensors alone: the tokens, each row's logical position and
its KV length are inputs, the tails are written at that length with a scatter and read over the
slots in use (`Stepper.span`) under a mask built from the lengths on the device, the shared
segments are the batch's. Nothing in it reads a tensor back to the host, so its shapes and kernels
are the same for every step of a batch while the batch keeps its rows, its tail storage, its span
and its shared segments: on CUDA it is recorded once into a `torch.cuda.CUDAGraph` and replayed;
elsewhere the same function runs eagerly (what the CPU tests exercise, and what a GPU captures).

When it applies (`Stepper.applies`): every row feeds at most one token, and no plug-in of the run
needs the layer loop's hook points (`hooks.needs_layer_loop`). Accelerations that act inside a step
hand it inputs instead (`step_inputs.py`): SkipKV's steering (a table of vectors, a slot and a
scale per row), taps fed what each layer read once the step has run (SkipKV's query window,
RSBCM's attention mass: `StaticAttention.feed_taps`),
River's exits (the step as pieces, `step_replay.ExitSegments`) and ReasonCache's block pool (one
more shared segment). Otherwise the step runs through the layer loop, and the run's statistics
count it with its reasons (`decode_steps_layer_loop`, `decode_steps_off_fast`, `step_notes`), so
the result's notes say so. A batch whose tails grow, whose rows leave or
whose shared segments change is a new layout and a new `StepGraph` (a new recording on CUDA),
which is rare: the tails grow by at least 128 slots, a recorded span by 128 (a compiled step's
span is a symbolic size: one program for every span), and rows leave a batch only once a quarter
of it has ended.

Compiled (`decode_step="compiled"`): the same step function through `torch.compile` (inductor),
with batch size, tail capacity (pages: their count and the table's width) and span symbolic, so one
compilation serves every layout of the same kind (a batch of one row, each own-KV layout, and each
count of shared segments are kinds of their own: in tails up to `step_compiler.SEGMENTS`, deeper
batches running uncompiled; read in place by the paged kernel, each power of two up to
`step_compiler.HANDED_MOST`, the segments padded to it; so is each set of acceleration inputs:
a steered layer, fed taps, a block pool, and each piece of a step under River's exits). What it buys is fusion: the eager step is
~40 kernels a layer (norms, rotary, residual adds one elementwise kernel each), which on a GPU sets the replayed graph's length and on a CPU its
per-operation overhead; inductor fuses each run of elementwise work into one kernel. On CUDA the
compiled step is then recorded as CUDA graphs like the eager one. A compilation costs tens of
seconds per kind (minutes on a small CPU); it runs in a worker process, never inside a step: a
kind not yet compiled runs uncompiled until its compiled step is loaded. A step that could not run
compiled is never hidden: it runs uncompiled (its kind compiling, its compilation failed, its
compiled step refused the batch), the run's statistics count the uncompiled steps and the notes
say why (`step_compiler.py`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.attention import (
    AttentionContext,
    SharedSegment,
)
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.compile_worker import ModelSpec
from branchwise.backends.hf.hooks import Acceleration, layer_loop_reasons, needs_layer_loop
from branchwise.backends.hf.kv_pages import Pages
from branchwise.backends.hf.own_kv import OwnKV, Tails
from branchwise.backends.hf.step_attention import Chunk, MixedAttention, StaticAttention
from branchwise.backends.hf.step_compiler import StepCompiler
from branchwise.backends.hf.step_inputs import Steer
from branchwise.backends.hf.step_replay import (
    CudaGraphs,
    ExitSegments,
    Modules,
    Piece,
    Recorder,
    river_end,
    signature,
)
from branchwise.backends.step_notes import OffFast

StepMode = Literal["auto", "compiled", "graphs", "eager", "layers"]
"""How decode steps run: `compiled` runs the fixed-shape step compiled by inductor (and captures it
as CUDA graphs on CUDA), `graphs` captures the uncompiled step as CUDA graphs (CUDA only), `eager`
runs the uncompiled step without capture, `layers` runs every step through the layer loop (the
baseline), `auto` is `compiled` (`auto_mode`: `$BRANCHWISE_DECODE_STEP` may name another)."""
STEP_MODES: tuple[StepMode, ...] = ("auto", "compiled", "graphs", "eager", "layers")
AUTO_ENV = "BRANCHWISE_DECODE_STEP"
"""Environment variable naming the mode `auto` resolves to (`auto_mode`)."""


def auto_mode() -> StepMode:
    """What `auto` runs as: `$BRANCHWISE_DECODE_STEP` where set, else `compiled`, on every device.

    Why compiled on a CPU too: no step waits for its compiler (kinds run eagerly until a worker
    process has compiled them, and on a CPU the worker is held stopped while this process computes:
    `compile_worker.Worker`), and compiled steps persist across processes, so a one-off run loses
    nothing to it and every later run, or the rest of a long one, decodes at the compiled speed
    (1.37x one row, 1.28x eight, over the eager step on 2 cores: `benchmarks/compile_ahead.py`).
    Where a worker's copy of the weights would not fit the memory left, kinds not compiled before
    run eagerly and say why (`compile_worker.worker_room`). A test session names `eager` (a worker
    per test backend would compile in the suite's idle moments)."""
    chosen = os.environ.get(AUTO_ENV)
    if not chosen:
        return "compiled"
    if chosen not in STEP_MODES or chosen == "auto":
        modes = ", ".join(repr(m) for m in STEP_MODES if m != "auto")
        raise ValueError(f"${AUTO_ENV}={chosen!r} is not one of {modes}")
    return cast("StepMode", chosen)


SPAN = 128
"""Recorded steps read the tails in multiples of this many slots (a new recording per multiple)."""
COMPILED_SPAN = 16
"""Compiled steps that are not recorded read the tails in multiples of this many slots: the span is
a symbolic size there, so a finer multiple costs no compilation and saves reading masked slots."""
At = tuple[Any, AttentionContext]
"""Where a step's layers run: the rotary tables at the tokens' positions (`arch.Rope`), and attention."""
WARMUP = 1
"""Steps a new batch layout runs eagerly before its step is captured: real steps (their logits are
used) that do the first-call work on the current stream (allocator growth, library handles)."""


@dataclass(eq=False)
class StepGraph:
    """The fixed-shape step of one batch layout: its input buffers, and its recording once taken.

    `signature` is what the shapes and the addresses a recording bakes in depend on (rows,
    capacity, the tails' and shared segments' storage); a batch whose signature changed needs a new
    `StepGraph`. Without a `recorder` every step runs eagerly.
    """

    parts: DecoderParts
    ctx: BatchContext
    signature: tuple[object, ...]
    recorder: Recorder | None
    compiler: StepCompiler | None = None
    ids: torch.Tensor = field(init=False)
    pos: torch.Tensor = field(init=False)
    lens: torch.Tensor = field(init=False)
    replay: Callable[[], None] | None = None
    logits: torch.Tensor | None = None
    runs: int = 0
    accepted: dict[Piece | None, tuple[Callable[[StepGraph], tuple[torch.Tensor, torch.Tensor]], int]] = (
        field(default_factory=dict)
    )
    """Per piece (None: the whole step), the compiled step that accepted this layout and the span it
    was checked at (`StepCompiler`: its guards checked once per layout and span)."""
    unused: str | None = None
    """Why the last step (any piece of it) ran uncompiled where steps are compiled; None: it ran
    compiled, or nothing compiles (`StepCompiler.unused`)."""
    recorded_unused: str | None = None
    """`unused` when the recording was taken (a layout recorded before its kind was compiled is
    recorded again once it is)."""
    piece: Piece | None = None
    """The piece of the step `computed` computes under an early exit (`step_replay.ExitSegments`);
    None: the whole step."""
    carry: torch.Tensor | None = None
    """The hidden states `[B, 1, d]` a piece after the first starts from (its predecessor's)."""
    steer: Steer | None = None
    """The batch's steering (`batch.Steer`) read at fixed addresses: the plug-in's persistent table,
    and this graph's own slot and scale buffers, loaded at every step."""
    hidden: torch.Tensor | None = None
    """The final-norm hidden state at each row's token `[B, d]` from the last step (accelerated
    steps only; a recording's own output, overwritten by each replay)."""
    fed: torch.Tensor = field(init=False)
    """`[B]` tokens each row feeds this step (an early exit's test skips rows that feed none)."""
    segments: ExitSegments | None = None
    """The step as pieces under the batch's early exit (`step_replay.ExitSegments`; None: one)."""

    def __post_init__(self) -> None:
        b, device = self.ctx.batch, self.ctx.lens.device
        self.ids = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(b, 1, dtype=torch.long, device=device)
        self.lens = torch.zeros(b, dtype=torch.long, device=device)
        self.fed = torch.zeros(b, dtype=torch.long, device=device)
        self.attention = StaticAttention(self.ctx, self.lens, self.pos)
        if self.ctx.exits is not None:
            self.segments = ExitSegments(self, self.ctx.exits)
        if (steer := self.ctx.steer) is not None:
            self.steer = Steer(
                steer.layer, steer.table, torch.zeros_like(steer.idx), torch.zeros_like(steer.scale)
            )

    @property
    def accelerated(self) -> bool:
        """Whether an acceleration reads or feeds this step (steering, query taps, a block pool,
        exits): the step then keeps the hidden states its plug-ins read (`ctx.last_hidden`)."""
        taps, pool = bool(self.attention.taps), self.ctx.pool is not None
        return self.steer is not None or taps or pool or self.segments is not None

    def blocks(self, h: torch.Tensor, indices: range, modules: Modules, at: At) -> torch.Tensor:
        """`h` through `modules[i]` for each i of `indices`, steered where the batch steers, at
        `at` (the rotary tables at the tokens' positions, the attention)."""
        rope, attention = at
        for index in indices:
            block = modules[index]
            assert block is not None, f"no module for layer {index}"
            if self.steer is not None and index == self.steer.layer:
                h = self.steer.add(h)
            h = self.parts.run_layer(block, h, rope, attention)
        return h

    def _layers(self, ids: torch.Tensor, pos: torch.Tensor, attention: AttentionContext) -> torch.Tensor:
        """The hidden states after every layer for tokens `ids` at positions `pos`, attended by
        `attention` (the step's own mask is prepared first: both attentions read it)."""
        parts = self.parts
        h = parts.embed(ids)
        self.attention.prepare(h.dtype)
        return self.blocks(h, range(parts.n_layers), parts.layers, (parts.rotary(h, pos), attention))

    def computed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step itself, uncompiled: logits `[B, V]` and the final-norm hidden states `[B, d]`
        from the loaded inputs, or under an early exit the `piece` asked for (`_piece`): what the
        compiler compiles, and what runs where it is off or failed; what the taps are fed is left
        in `attention.fed`."""
        if self.piece is not None:
            return self._piece(*self.piece)
        hidden = self._hidden()
        return self.parts.logits(hidden), hidden

    def _piece(self, name: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One piece of the step under an early exit (`step_replay.ExitSegments`). "start" embeds
        the tokens and runs layers 0 .. `index`, "layer" runs layer `index` from `carry`: each
        returns the hidden states and each row's exit score at that layer (`Exits.similarity`).
        "river" runs the river's layers from `index` to `river_end` (its hidden states, twice),
        and from the last such start the rest with the final norm and the river's head, as
        "backbone" does on the backbone's from layer `index`: logits and final-norm hidden
        states. Each piece prepares the step's attention and rotary again (a few
        small operations on the lengths and positions), so each is a function of the step's
        inputs and `carry` alone, compiled as a kind of its own."""
        exits, parts = self.ctx.exits, self.parts
        assert exits is not None, "a piece of a step without an early exit"
        h = parts.embed(self.ids) if name == "start" else self.carry
        assert h is not None, f"the {name} piece has no hidden states to start from"
        self.attention.prepare(h.dtype)
        at = (parts.rotary(h, self.pos), self.attention)
        if name in ("start", "layer"):
            h_in = self.blocks(h, range(index), parts.layers, at) if name == "start" else h
            h = self.blocks(h_in, range(index, index + 1), parts.layers, at)
            return h, exits.similarity(h_in, h, self.fed)
        river, end = name == "river", parts.n_layers
        if river and (end := river_end(index, end)) < parts.n_layers:
            h = self.blocks(h, range(index, end), exits.river, at)
            return h, h
        h = self.blocks(h, range(index, end), exits.river if river else parts.layers, at)
        normed = parts.norm(h[:, -1])
        return parts.logits(normed, exits.head if river else None), normed

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`computed`, compiled where its kind is (the whole step, or the `piece` asked for), then
        the taps fed; where it ran uncompiled though steps compile, `unused` says why (the first
        reason a step meets)."""
        compiler = self.compiler
        ran = None if compiler is None else compiler(self)
        if ran is None and compiler is not None and self.unused is None:
            self.unused = compiler.unused
        out = ran if ran is not None else self.computed()
        self.feed_taps()
        return out

    def ready(self) -> bool:
        """Whether the compiled step of this layout's kind (of its `piece`) is loaded."""
        return self.compiler is not None and self.compiler.ready(self)

    def feed_taps(self) -> None:
        """Hand the batch's taps what the step (or the piece) just run read (`step_attention`)."""
        self.attention.feed_taps()

    def _hidden(self) -> torch.Tensor:
        """The final-norm hidden state at each row's token `[B, d]`."""
        return self.parts.norm(self._layers(self.ids, self.pos, self.attention)[:, -1])

    def _step(self) -> torch.Tensor:
        logits, hidden = self.run()
        if self.accelerated:  # its hidden states kept for the plug-ins
            self.hidden = hidden
        return logits

    def _load(self, ids: torch.Tensor, fed: torch.Tensor | None = None) -> None:
        """The step's inputs: each row's token `ids` `[B]` (and how many it feeds, `fed`), and the
        batch's positions and lengths."""
        ctx = self.ctx
        assert ctx.pos_next is not None
        self.ids[:, 0].copy_(ids)
        if fed is not None:
            self.fed.copy_(fed)
        self.pos[:, 0].copy_(ctx.pos_next)
        self.lens.copy_(ctx.lens)
        if self.steer is not None:
            assert ctx.steer is not None, "a steered layout stepped without its steering"
            self.steer.idx.copy_(ctx.steer.idx)
            self.steer.scale.copy_(ctx.steer.scale)

    def mixed(self, ids: torch.Tensor, chunk: Chunk) -> torch.Tensor:
        """One step of the rows' `ids` that also computes `chunk`, eagerly (its length varies from
        step to step, so it is never recorded): the rows' logits `[B, V]`; the chunk's batch
        advances past its tokens and its last token's logits go into `chunk.logits`."""
        b, c = self.ctx.batch, chunk.ctx
        assert c.pos_next is not None
        self._load(ids)
        n = len(chunk.ids)
        c.begin(n)
        fed = torch.tensor(list(chunk.ids), dtype=torch.long).to(self.ids.device, non_blocking=True)
        ids_all = torch.cat([self.ids.view(1, -1), fed.view(1, -1)], dim=1)
        pos = torch.cat(
            [self.pos.view(1, -1), c.pos_next[:, None] + torch.arange(n, device=c.pos_next.device)], dim=1
        )
        h = self._layers(ids_all, pos, MixedAttention(self.attention, c))
        self.feed_taps()
        logits = self.parts.logits(self.parts.norm(torch.cat([h[0, :b], h[0, -1:]])))
        c.lens = c.lens + n
        c.pos_next = c.pos_next + n
        chunk.logits = logits[b]
        return logits[:b]

    def __call__(self, ids: torch.Tensor, fed: torch.Tensor, tokens: int) -> torch.Tensor:
        """Logits `[B, V]` after each row's token `ids` `[B]` (`fed` `[B]` of them real, `tokens`
        in all) at the batch's positions and lengths. A recorder records the step on the layout's
        first step after `WARMUP` eager ones, and replays it from then on (under an early exit,
        each of its pieces on first use)."""
        self._load(ids, fed)
        self.runs += 1
        self.unused = None
        if self.segments is not None:
            record = self.recorder is not None and self.runs > WARMUP
            logits = self.segments.step(record, tokens)
            assert self.hidden is not None
            self.ctx.last_hidden = self.hidden.clone() if record else self.hidden
            return logits.clone() if record else logits
        if self.recorder is None or self.runs <= WARMUP:
            logits = self._step()
            self.ctx.last_hidden = self.hidden
            return logits
        if self.replay is not None and self.recorded_unused is not None and self.ready():
            self.replay = None  # its kind compiled since it was recorded: record it anew
        if self.replay is None:
            self.replay, self.logits = self.recorder.record(self._step)
            self.recorded_unused = self.unused
        assert self.logits is not None
        self.unused = self.recorded_unused
        self.replay()
        if self.hidden is not None:
            self.ctx.last_hidden = self.hidden.clone()
        return self.logits.clone()  # the next replay overwrites it


def from_skeleton(batch: dict[str, Any], parts: DecoderParts, device: torch.device) -> StepGraph:
    """The skeleton batch as the engine would hold it: its tensors on the device, inference tensors
    where the engine's were (a compiled step's guards check it)."""

    def made(entry: dict[str, Any] | None) -> torch.Tensor | None:
        if entry is None:
            return None
        with torch.inference_mode(entry["inference"]):
            return entry["data"].to(device).clone()

    def tensors(entries: list[dict[str, Any]]) -> list[torch.Tensor]:
        return [t for t in map(made, entries) if t is not None]

    lens = made(batch["lens"])
    assert lens is not None
    own = batch["own"]
    table = made(own.get("table"))
    if device.type == "cpu" and (table is not None or batch.get("exits") is not None):
        cpu_kernels.build()  # a compiler's or a warm-up's batch, never a request's: it may wait for it
    kv: OwnKV = (
        Tails(tensors(own["keys"]), tensors(own["values"]))
        if table is None
        else Pages.of(tensors(own["keys"]), tensors(own["values"]), table)
    )
    ctx = BatchContext(
        kv=kv,
        lens=lens,
        shared=[
            SharedSegment(tensors(s["keys"]), tensors(s["values"]), made(s["rows"]), mask=made(s["mask"]))
            for s in batch["shared"]
        ],
        pos_next=made(batch["pos_next"]),
        n_groups=batch["n_groups"],
    )
    if (steer := batch["steer"]) is not None:
        table, idx, scale = made(steer["table"]), made(steer["idx"]), made(steer["scale"])
        assert table is not None and idx is not None and scale is not None
        ctx.steer = Steer(steer["layer"], table, idx, scale)
    if (exits := batch.get("exits")) is not None:  # built by what its description names
        module, name = exits["build"].split(":")
        ctx.exits = getattr(importlib.import_module(module), name)(exits["config"], parts, device)
    with torch.inference_mode():  # as `Stepper.forward` makes its graphs
        graph = StepGraph(parts, ctx, (), None)
        graph.attention.span = batch["span"]
    graph.piece = None if batch.get("piece") is None else tuple(batch["piece"])
    graph.carry = made(batch.get("carry"))
    graph.attention.feeds = batch["feeds"]  # the taps run in the engine, after the step
    graph.attention.scored = batch["scored"]
    return graph


def warm_step(
    step: Callable[[StepGraph], tuple[torch.Tensor, torch.Tensor]],
    batch: dict[str, Any],
    parts: DecoderParts,
    device: torch.device,
) -> None:
    """Run a compiled step once on its kind's skeleton batch: its first call loads (or builds) the
    compiled kernels, which must happen where no request waits (`StepCompiler._load`)."""
    graph = from_skeleton(batch, parts, device)
    with torch.inference_mode():
        step(graph)


def is_decode_step(feeds: Sequence[Sequence[int]]) -> bool:
    """Whether a forward of `feeds` is a decode step: one token or none per row, some row fed."""
    return any(feeds) and all(len(f) <= 1 for f in feeds)


class Stepper:
    """Runs a batch's decode steps at fixed shapes, capturing them on CUDA (see the module docstring).

    One per engine; it keeps the graph of the batch decoding now (the engine's lock serialises
    decodes), so a capture's memory lives as long as its batch layout does.
    """

    def __init__(
        self,
        parts: DecoderParts,
        pad_id: int,
        device: torch.device,
        mode: StepMode = "auto",
        spec: ModelSpec | None = None,
    ) -> None:
        self.parts = parts
        self.spec = spec
        """What the step compiler's worker builds its copy of the model from."""
        self.pad_id = pad_id
        self.device = device
        self.recorder: Recorder | None = None
        """What records steps (`CudaGraphs` where they are captured; set with `mode`)."""
        self.compiler: StepCompiler | None = None
        """What compiles the step (`decode_step="compiled"`; set with `mode`)."""
        self._compiler: StepCompiler | None = None  # kept across mode changes: its compilations stay
        self.runs: StepMode = "eager"
        """What `mode` runs as (`auto` resolved: `auto_mode`)."""
        self.mode = mode
        self._graph: StepGraph | None = None
        self.captures = 0
        """Steps recorded so far (one per batch layout that stepped more than `WARMUP` times)."""
        self.replayed = False
        """Whether the last step was a replay of a recording (else it ran eagerly)."""
        self.compiled = False
        """Whether the last step ran compiled code (replayed or not)."""
        self.unused: str | None = None
        """Why the last step ran uncompiled where steps are compiled (`StepGraph.unused`)."""
        self.copied: str | None = None
        """Why the last step read a gathered copy of its batch's pages (`step_attention.pages_copied`)."""

    @property
    def mode(self) -> StepMode:
        return self._mode

    @mode.setter
    def mode(self, mode: StepMode) -> None:
        if mode not in STEP_MODES:
            raise ValueError(f"decode_step={mode!r} is not one of {', '.join(map(repr, STEP_MODES))}")
        runs = auto_mode() if mode == "auto" else mode
        if runs == "graphs" and self.device.type != "cuda":
            named = "decode_step" if mode == "graphs" else f"${AUTO_ENV}"
            raise ValueError(f"{named}='graphs' needs a CUDA device; this backend runs on {self.device}")
        self._mode, self.runs = mode, runs
        self._graph = None
        cuda = self.device.type == "cuda"
        compiled = runs == "compiled"
        self.recorder = CudaGraphs() if runs == "graphs" or (compiled and cuda) else None
        if compiled and self._compiler is None:
            self._compiler = StepCompiler(
                self.spec, warm=lambda step, batch: warm_step(step, batch, self.parts, self.device)
            )
        self.compiler = self._compiler if compiled else None

    @property
    def captures_graphs(self) -> bool:
        """Whether fixed-shape steps are recorded and replayed (CUDA graphs), else run eagerly."""
        return self.recorder is not None

    def forget(self, ctx: BatchContext | None = None) -> None:
        """The batch of `ctx` ended (None: whichever it was): its step (and, through it, the batch's
        tails) goes now, not when the next batch first steps; the KV budget counts the tails while
        anything holds them."""
        if self._graph is not None and (ctx is None or self._graph.ctx is ctx):
            self._graph = None

    def blockers(
        self, ctx: BatchContext, hooks: Sequence[Acceleration], observers: Sequence[Acceleration]
    ) -> list[str]:
        """What keeps this batch's decode steps on the layer loop: the plug-ins and observers that
        need its hook points (`hooks.needs_layer_loop`), an attention tap the step cannot feed;
        empty when the fixed-shape step can take them."""
        found = needs_layer_loop([*hooks, *observers])
        if not found and (taps := [tap for tap in ctx.taps if not tap.in_step]):
            found = [f"an attention tap ({type(tap).__name__})" for tap in taps]
        return found

    def loop_reasons(
        self, ctx: BatchContext, hooks: Sequence[Acceleration], observers: Sequence[Acceleration]
    ) -> list[str]:
        """Why a decode step of this batch runs on the layer loop (`step_notes.OffFast`): the mode,
        or the plug-ins' reasons (`hooks.layer_loop_reasons`), observers, taps the step cannot feed."""
        if self.runs == "layers":
            return [OffFast.LAYERS_MODE.value]
        found = layer_loop_reasons(hooks) + [f"{OffFast.OBSERVER.value} {o.name}" for o in observers]
        if not found and any(not tap.in_step for tap in ctx.taps):
            found = [OffFast.ATTENTION_TAP.value]
        return found

    def shortfall(self, carried: bool) -> list[str]:
        """Why the fixed-shape step just run was not the fast step its mode asks for: it carried a
        prefill chunk (run eagerly) where steps are compiled or captured, or a compiled step was
        asked for and did not run (`step_compiler.StepCompiler.unused` says why). Empty when it was."""
        copied = [] if self.copied is None else [f"{OffFast.PAGES_COPIED.value}: {self.copied}"]
        if carried and (self.compiler is not None or self.recorder is not None):
            return [OffFast.PREFILL_CHUNK.value, *copied]
        if self.compiler is not None and not self.compiled:
            why = self.unused
            return [f"{OffFast.UNCOMPILED.value}: {why}", *copied]
        return copied

    def applies(
        self,
        ctx: BatchContext,
        feeds: Sequence[Sequence[int]],
        hooks: Sequence[Acceleration],
        observers: Sequence[Acceleration],
    ) -> bool:
        """Whether this forward can be the fixed-shape step: a decode step (one token or none per
        row) that nothing keeps on the layer loop (`blockers`)."""
        return self.runs != "layers" and is_decode_step(feeds) and not self.blockers(ctx, hooks, observers)

    @torch.inference_mode()
    def forward(
        self, ctx: BatchContext, feeds: Sequence[Sequence[int]], chunk: Chunk | None = None
    ) -> torch.Tensor:
        """One decode step of `feeds` (one token or none per row): logits `[B, V]`. A row that feeds
        nothing (it ended) runs a pad token whose K/V lands in a slot its length does not cover, and
        neither its length nor its position advances. With a `chunk`, the same forward computes
        it (`StepGraph.mixed`, eagerly; its last token's logits land in `chunk.logits`)."""
        fed = [len(f) for f in feeds]
        # compiled, one slot to spare: the span read then always stays below the capacity (`span`)
        spare = int(self.compiler is not None)
        span = self.span(ctx.make_room(1 + spare) - spare, ctx.capacity)
        graph = self._graph
        window = self.parts.sliding_window
        assert ctx.pos_next is not None
        windowed = window is not None and int(ctx.pos_next.max()) + 1 > window
        sig = (*signature(ctx), span if self.recorder is not None else None, windowed)
        if graph is None or graph.ctx is not ctx or graph.signature != sig:
            graph = self._graph = StepGraph(self.parts, ctx, sig, self.recorder, self.compiler)
        graph.attention.span = span
        graph.attention.windowed = windowed
        self.copied = graph.attention.copied
        ids = torch.tensor([f[0] if f else self.pad_id for f in feeds], dtype=torch.long)
        recorded = graph.replay is not None
        advance = torch.tensor(fed, dtype=torch.long).to(self.device, non_blocking=True)
        if chunk is not None:
            logits = graph.mixed(ids.to(self.device, non_blocking=True), chunk)
            self.replayed = self.compiled = False
            self.unused = None
        else:
            logits = graph(ids.to(self.device, non_blocking=True), advance, sum(fed))
            self.replayed = graph.replay is not None or (
                graph.segments is not None and graph.recorder is not None and graph.runs > WARMUP
            )
            self.captures += int(self.replayed and not recorded)
            self.unused = graph.unused
            self.compiled = self.compiler is not None and self.unused is None
            for tap in graph.attention.taps:
                tap.count_step()
        ctx.lens = ctx.lens + advance
        assert ctx.pos_next is not None
        ctx.pos_next = ctx.pos_next + advance
        return logits

    def span(self, needed: int, capacity: int) -> int:
        """Tail slots a step reads, `needed` being the longest row's length + 1. Run eagerly, exactly
        that (the layer loop reads no more); recorded, rounded up to `SPAN` slots, so a recording
        serves `SPAN` steps of a growing batch instead of one (reading the tails' whole capacity
        instead cost the CPU up to 8 % a step with 32 rows). Compiled, rounded up to
        `COMPILED_SPAN` (`SPAN` where also recorded) and always below the capacity (`forward`
        keeps a slot to spare): a span equal to the capacity, or of one slot, is a program of its
        own to the compiler (slicing to the end, a size-1 dimension), and any span in between is
        the same program. Reading the whole capacity instead (the tails grow by at least `SPAN`)
        read ~64 masked slots a row more on average: 2.2 ms a step at 8 rows over 128 more slots
        on a 2-core CPU (benchmarks/RESULTS.md)."""
        if self.compiler is not None:
            grain = SPAN if self.recorder is not None else COMPILED_SPAN
            return min(capacity - 1, -(-needed // grain) * grain)
        if self.recorder is None:
            return needed
        return min(capacity, -(-needed // SPAN) * SPAN)
