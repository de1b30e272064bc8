"""How the fixed-shape step (`step.py`) is recorded and replayed: CUDA graphs (`CudaGraphs`, a
`Recorder`), and an early exit's step as pieces with one host read per candidate exit layer
(River's exits, §4: `ExitSegments`).

Why pieces: whether a batch exits after layer i is known only once layer i has run, and neither a
captured step nor a compiled one can branch on a tensor (`torch.cond` could, but its branches may
not write the KV). Cut at the candidate layers, the step is a chain of fixed-shape pieces (the
layers up to the first candidate with its exit score; each later candidate layer with its score;
the rest of the stack on the river, or on the backbone, with its head); between two pieces the host
reads one flag. Each piece is a function of the step's inputs and its predecessor's output
(`step.StepGraph._piece`), so it is compiled ahead as a kind of batch of its own (the kind names
the piece and the river: `step_compiler.kind_of`) and, on CUDA, recorded once and replayed. The
decision is the batch's, as River's rule is (every row passes, §4.2), so a step reads at most one
flag per candidate layer it reaches and the rows never regroup; where most tokens exit at the first
candidate, two pieces make a step. An exit runs the rest of the stack on the river's quantized
layers, which write the skipped layers' K/V into the same KV slots (the river keeps each layer's
index), so later tokens read a complete cache, as on the layer loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar, cast

import torch
from torch import nn

from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.step_inputs import Exits

Modules = Sequence[nn.Module | None] | nn.ModuleList
"""The layers a piece runs: the backbone's, or a river's (None where none was built)."""


Piece = tuple[str, int]
"""A piece of a step under an early exit and the layer it starts or tests at (`step.StepGraph._piece`)."""
T = TypeVar("T")
RIVER_CHUNK = 8
"""The river's rest of the stack runs in pieces that end at multiples of this many layers
(`river_end`). Why: a piece that ran from its exit layer to the last would be a kind of its own per
exit layer, each as long as the rest of the stack (about 8x the compilation of one whole step for
every kind of batch, on a 30-layer model); cut at fixed boundaries, the pieces after the first are
shared by every exit before them, for two or three more calls a step."""


def river_end(start: int, layers: int) -> int:
    """Where the river's piece that starts at layer `start` ends (exclusive): the next multiple of
    `RIVER_CHUNK`, or the last layer (that piece also runs the final norm and the head)."""
    return min(layers, (start // RIVER_CHUNK + 1) * RIVER_CHUNK)


class Recorder(Protocol):
    """Records a step once and gives back how to replay it and where its outputs land."""

    def record(self, step: Callable[[], T]) -> tuple[Callable[[], None], T]: ...


class CudaGraphs:
    """`Recorder` of CUDA graphs, as torch documents the capture of a whole network: one warm-up run
    on a side stream (the step rewrites the same K/V to the same slots), then the recording, which
    runs no kernel. Capture errors are thread-local: a server has other threads."""

    def record(self, step: Callable[[], T]) -> tuple[Callable[[], None], T]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = step()
        return graph.replay, out


def signature(ctx: BatchContext) -> tuple[object, ...]:
    """What a captured step depends on: rows, tail capacity, and the storage every layer's tails and
    shared segments live in (a grown, compacted or re-read batch has new storage)."""
    shared = tuple(
        (
            s.key,
            s.keys[0].data_ptr() if len(s.keys) else 0,
            tuple(s.keys[0].shape) if len(s.keys) else (),
            None if s.rows is None else s.rows.data_ptr(),
            None if s.mask is None else s.mask.data_ptr(),
        )
        for s in ctx.read_segments()
    )
    steer = None if ctx.steer is None else (ctx.steer.layer, ctx.steer.table.data_ptr())
    inputs = (steer, tuple(id(tap) for tap in ctx.taps if tap.in_step), id(ctx.exits))
    return (ctx.batch, ctx.kv.signature(), shared, inputs)


class SegmentHost(Protocol):
    """What the pieces run on: the step of one layout (`step.StepGraph`)."""

    parts: DecoderParts
    recorder: Recorder | None
    piece: Piece | None
    carry: torch.Tensor | None
    hidden: torch.Tensor | None
    unused: str | None
    fed: torch.Tensor
    """`[B]` tokens each row feeds this step (0: an ended row)."""

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute `piece` from `carry` (compiled where its kind is; `unused` says why not), the
        taps fed what it read: its two outputs (`StepGraph._piece`)."""
        ...

    def ready(self) -> bool:
        """Whether the compiled step of `piece`'s kind is loaded."""
        ...


class ExitSegments:
    """The pieces of one layout's step under an early exit (see the module docstring), each run
    through its host (compiled where its kind is, eagerly otherwise), or recorded once and replayed;
    each piece reads its predecessor's output where that one's run or recording left it."""

    def __init__(self, host: SegmentHost, exits: Exits) -> None:
        # by weak reference: the host holds these pieces, and a cycle between them would keep an
        # ended batch's KV alive (and counted against the KV budget) until the next collection
        self.host = cast(SegmentHost, weakref.proxy(host))
        self.exits = exits
        n = host.parts.n_layers
        assert n >= 2, "an early exit needs a layer after its first candidate"
        self.first = min(max(exits.entry, 0), n - 2)
        """The first candidate exit layer (candidates: `first` .. the last but one)."""
        self._recorded: dict[
            Piece,
            tuple[Callable[[], None], tuple[torch.Tensor, torch.Tensor], str | None, torch.Tensor | None],
        ] = {}
        """Per piece recorded: its replay, where its outputs land, why it was recorded uncompiled,
        and the buffer it reads its input from."""

    def step(self, record: bool, tokens: int) -> torch.Tensor:
        """Logits `[B, V]` of one step (the host's inputs loaded); with `record`, pieces are
        recorded on first use and replayed. `tokens`: how many the rows fed (River's statistics)."""
        last = self.host.parts.n_layers - 1
        at = self.first
        h, score = self._run(("start", at), None, record)
        while True:  # `at`: the layer just run, a candidate (`first` <= at < last)
            if bool((score >= self.exits.threshold).all()):  # the one host read at this layer
                if not self.exits.audit:
                    logits = self._river(at + 1, h, record)
                    self.exits.exited(at, tokens)
                    return logits
                # the backbone's rest first: the river's K/V then overwrite its slots, as unaudited
                audit, _ = self._run(("backbone", at + 1), h, record)
                logits = self._river(at + 1, h, record)
                live = self.host.fed > 0
                self.exits.exited(at, tokens, logits[live], audit[live])
                return logits
            if at + 1 == last:
                logits, self.host.hidden = self._run(("backbone", last), h, record)
                self.exits.exited(None, tokens)
                return logits
            at += 1
            h, score = self._run(("layer", at), h, record)

    def _river(self, start: int, h: torch.Tensor, record: bool) -> torch.Tensor:
        """The rest of the stack from layer `start` on the river, piece by piece (`river_end`), the
        last with the final norm and the river's head: the logits."""
        layers = self.host.parts.n_layers
        while (end := river_end(start, layers)) < layers:
            h, _ = self._run(("river", start), h, record)
            start = end
        logits, self.host.hidden = self._run(("river", start), h, record)
        return logits

    def _run(
        self, piece: Piece, carry: torch.Tensor | None, record: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`piece` from `carry`: run, or replayed where recorded (recorded again once its kind is
        compiled where it was recorded uncompiled)."""
        host = self.host
        host.piece, host.carry = piece, carry
        if not record or host.recorder is None:
            return host.run()
        got = self._recorded.get(piece)
        if got is not None and got[2] is not None and host.ready():
            got = None  # its kind compiled since it was recorded: record it anew
        if got is None:
            # the recording reads its input from a buffer of its own, loaded before each replay: a
            # predecessor recorded anew (its kind compiled) writes its output somewhere else
            inp = None if carry is None else carry.clone()
            before, host.unused, host.carry = host.unused, None, inp
            replay, out = host.recorder.record(host.run)
            got = self._recorded[piece] = (replay, out, host.unused, inp)
            host.unused, host.carry = before, carry
        replay, out, why, inp = got
        if inp is not None and carry is not None:
            inp.copy_(carry)
        host.unused = host.unused or why
        replay()
        return out
