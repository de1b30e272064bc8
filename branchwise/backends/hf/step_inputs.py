"""What accelerations hand the fixed-shape decode step (`step.py`) as inputs, and what it hands them.

Why a module of its own: the step is a function of tensors at fixed addresses (captured once,
replayed many times), so an acceleration that acts inside a decode step cannot be a hook called
between layers; it sets inputs on the batch (`batch.BatchContext.steer`, `.exits`) that both the
step and the layer loop read, and its attention taps are fed what the step's attention reads
(`StepKeys`). Each is a small, plain record, so the batch, the step and the plug-ins share them
without importing one another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from branchwise.backends.hf.attention import SharedSegment

if TYPE_CHECKING:
    from torch import nn


@dataclass
class Steer:
    """Vectors added to the residual stream entering layer `layer`, one per row, as inputs of a
    decode step: row b adds `scale[b] * table[idx[b]]`. `table` `[S, d]` is persistent (built once,
    row 0 all zeros: no steering), `idx` `[B]` long and `scale` `[B]` change every step. Why this
    shape: the fixed-shape step (`step.py`) reads it as tensors at fixed addresses, so a steered
    step is the same step, captured once, whichever rows steer (SkipKV's steering, §4.2)."""

    layer: int
    table: torch.Tensor
    idx: torch.Tensor
    scale: torch.Tensor

    def add(self, h: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`h` `[b, q, d]` (of batch rows `rows`; None: all) with each row's vector added."""
        idx, scale = (self.idx, self.scale) if rows is None else (self.idx[rows], self.scale[rows])
        return h + (self.table[idx] * scale[:, None].to(h.dtype))[:, None, :]


class Exits(Protocol):
    """An early exit the fixed-shape step runs as pieces (River's, §4: `step_replay.ExitSegments`):
    after each candidate layer (`entry` .. the last but one) a piece returns each row's
    `similarity` `[B]`, and one host read decides whether every row reaches `threshold`; on an exit
    the rest of the stack runs on `river` (whose layers write the skipped layers' K/V into the same
    KV slots) and the logits come from `head` (None: the backbone's). Why the threshold is compared
    on the host, not in the piece: a compiled piece then serves every threshold. `exited` is told
    each step's exit layer (None: none) and how many tokens it fed. `describe` is what another
    process (the compile worker) builds the same exit from (`build`, a `module:function` taking it,
    the decoder parts and the device), and what a compiled piece's kind names."""

    @property
    def entry(self) -> int: ...

    @property
    def threshold(self) -> float: ...

    @property
    def river(self) -> Sequence[nn.Module | None]: ...

    @property
    def head(self) -> nn.Module | None: ...

    @property
    def audit(self) -> bool:
        """Whether an exited step also runs the backbone's rest (first, so the river's K/V are what
        its slots keep) for the logits the exit replaced (River's audit)."""
        ...

    def similarity(self, h_in: torch.Tensor, h_out: torch.Tensor, fed: torch.Tensor) -> torch.Tensor:
        """`[B]` float32: each row's exit score (`fed` [B] tokens each; a row fed none scores 1)."""
        ...

    def exited(
        self,
        at: int | None,
        tokens: int,
        logits: torch.Tensor | None = None,
        audit: torch.Tensor | None = None,
    ) -> None:
        """Told each step's exit layer (None: none) and the tokens it fed; under `audit`, an exited
        step's logits and the backbone's for the rows that fed a token."""
        ...

    def describe(self) -> dict[str, Any]: ...


@dataclass
class StepKeys:
    """What a decode step's attention reads at one layer, for taps the fixed-shape step feeds:
    `own` `[B, H_kv, span, D]` each row's tail keys (this step's written), `visible` `[B, span]`
    which of them each row sees, and the batch's shared segments. Where the step reads pages in
    place, `own` is None, `mass` `[B, slots]` holds the attention each of a row's own slots got,
    summed over the query heads (`AttentionTap.reads_mass`, 0 past the row's length) and `lse`
    `[B, H_kv, G]` the log-sum-exp of everything each query read (own and shared)."""

    own: torch.Tensor | None
    visible: torch.Tensor
    shared: Sequence[SharedSegment]
    scaling: float
    mass: torch.Tensor | None = None
    lse: torch.Tensor | None = None
