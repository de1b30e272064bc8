"""How the fixed-shape step (`step.py`) is recorded and replayed: CUDA graphs (`CudaGraphs`, a
`Recorder`), and an early exit's step as segments with one host read per candidate exit layer
(River's exits, §4: `ExitSegments`).

Why segments: whether a batch exits after layer i is known only once layer i has run, and a
captured step cannot branch on a tensor. Cut at the candidate layers, the step is a chain of
fixed-shape pieces (the layers up to the first candidate; each candidate layer with its exit test;
the rest of the stack on the river, or on the backbone, with its head), each captured once on CUDA
and replayed; between two pieces the host reads one flag. The decision is the batch's, as River's
rule is (every row passes, §4.2), so a step reads at most one flag per candidate layer it reaches
and the rows never regroup. An exit runs the rest of the stack on the river's quantized layers,
which write the skipped layers' K/V into the same tail slots (the river keeps each layer's index),
so later tokens read a complete cache, as on the layer loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Protocol, cast

import torch
from torch import nn

from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.step_inputs import Exits

Modules = Sequence[nn.Module | None] | nn.ModuleList
"""The layers a segment runs: the backbone's, or a river's (None where none was built)."""


class Recorder(Protocol):
    """Records a step once and gives back how to replay it and where its output lands."""

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaGraphs:
    """`Recorder` of CUDA graphs, as torch documents the capture of a whole network: one warm-up run
    on a side stream (the step rewrites the same K/V to the same slots), then the recording, which
    runs no kernel. Capture errors are thread-local: a server has other threads."""

    def record(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
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
    """What the segments run on: the step's layout (`step.StepGraph`)."""

    parts: DecoderParts
    recorder: Recorder | None
    fed: torch.Tensor
    """`[B]` tokens each row feeds this step (0: an ended row, which never holds back an exit)."""
    hidden: torch.Tensor | None

    def begin(self) -> torch.Tensor:
        """Embed the step's tokens, prepare its attention and rotary: the first layer's input."""
        ...

    def blocks(self, h: torch.Tensor, indices: range, modules: Modules) -> torch.Tensor:
        """`h` through `modules[i]` for each i of `indices` (steered where the batch steers)."""
        ...

    def feed_taps(self) -> None:
        """Hand the batch's taps what the piece just run read."""
        ...


class ExitSegments:
    """The segments of one layout's step under an early exit (see the module docstring): each
    keyed, run eagerly or recorded once and replayed; each piece reads its predecessor's output
    where that one's recording left it."""

    def __init__(self, host: SegmentHost, exits: Exits) -> None:
        # by weak reference: the host holds these segments, and a cycle between them would keep an
        # ended batch's tails alive (and counted against the KV budget) until the next collection
        self.host = cast(SegmentHost, weakref.proxy(host))
        self.exits = exits
        n = host.parts.n_layers
        self.first = min(max(exits.entry, 0), n - 1)
        """The first candidate exit layer (candidates: `first` .. the last but one)."""
        self._recorded: dict[Hashable, tuple[Callable[[], None], torch.Tensor]] = {}
        self._h: dict[Hashable, torch.Tensor] = {}
        """Each piece's output hidden states (a recorded piece's: where its replays write)."""
        self._normed: dict[Hashable, torch.Tensor] = {}

    def step(self, record: bool, tokens: int) -> torch.Tensor:
        """Logits `[B, V]` of one step (the host's inputs loaded); with `record`, pieces are
        recorded on first use and replayed. `tokens`: how many the rows fed (River's statistics)."""
        n = self.host.parts.n_layers
        self._run("start", self._start, record)
        prev: Hashable = "start"
        for i in range(self.first, n - 1):
            key = ("layer", i)
            passed = self._run(key, partial(self._layer, i, prev), record)
            prev = key
            if bool(passed):  # the one host read at this candidate layer
                logits = self._finish(("river", i + 1), prev, i + 1, record)
                self.exits.exited(i, tokens)
                return logits
        logits = self._finish(("backbone", n - 1), prev, max(self.first, n - 1), record)
        self.exits.exited(None, tokens)
        return logits

    def _run(self, key: Hashable, piece: Callable[[], torch.Tensor], record: bool) -> torch.Tensor:
        recorder = self.host.recorder
        piece = self._feeding(piece)
        if not record or recorder is None:
            return piece()
        if key not in self._recorded:
            self._recorded[key] = recorder.record(piece)
        replay, out = self._recorded[key]
        replay()
        return out

    def _feeding(self, piece: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """`piece`, then the taps fed what its layers read (inside what a recorder records)."""

        def fed() -> torch.Tensor:
            out = piece()
            self.host.feed_taps()
            return out

        return fed

    def _start(self) -> torch.Tensor:
        host = self.host
        h = self._h["start"] = host.blocks(host.begin(), range(self.first), host.parts.layers)
        return h

    def _layer(self, index: int, prev: Hashable) -> torch.Tensor:
        h_in = self._h[prev]
        h = self._h[("layer", index)] = self.host.blocks(
            h_in, range(index, index + 1), self.host.parts.layers
        )
        return self.exits.passes(h_in, h, self.host.fed)

    def _finish(self, key: tuple[str, int], prev: Hashable, start: int, record: bool) -> torch.Tensor:
        """The rest of the stack from layer `start` (the river's after an exit), the final norm and
        the head (the river's where it has one)."""
        parts, exited = self.host.parts, key[0] == "river"
        modules = self.exits.river if exited else parts.layers
        head = self.exits.head if exited else None

        def piece() -> torch.Tensor:
            h = self.host.blocks(self._h[prev], range(start, parts.n_layers), modules)
            normed = self._normed[key] = parts.norm(h[:, -1])
            return parts.logits(normed, head)

        logits = self._run(key, piece, record)
        self.host.hidden = self._normed[key]
        return logits
