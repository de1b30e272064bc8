"""The one interface through which accelerations act on the backend: optional hooks.

Why hooks: each acceleration (ASKS, the KV probe, CGEE, RSBCM, River, SkipKV and its steering)
needs to act at a few well-defined moments — when a node is forked, between layers, after a decode
step, when a node is freed — and nowhere else. The core (tree, batch, runner, decode loop) calls
these hooks and never names an acceleration; an acceleration subclasses `Acceleration`, overrides
the hooks it needs and keeps its own state. Every hook is a no-op here, so the runner only calls
the hooks a plug-in actually overrides (`overrides`), keeping the layer loop free of dead calls.

The moments, in the order one `extend` meets them:

| hook | when | used by |
|---|---|---|
| `on_fork` / `on_fork_prompts` | a node is forked (may veto sharing, or place divergent prompts) | probe, ASKS |
| `on_batch` | a batch of rows was assembled | RSBCM (attention-mass tap) |
| `begin_forward` | a forward of the batch starts | River |
| `before_layer` | before decoder layer i (may change the residual stream) | SkipKV steering |
| `after_layer` | after decoder layer i (may exit rows or switch layers) | River, CGEE level 2 |
| `after_forward` | the forward produced logits | River accounting |
| `after_pending` | a batch computed its pending (prompt/appended) tokens | SkipKV |
| `begin_decode` / `before_step` / `stop_reason` / `after_step` | the decode loop | SkipKV, CGEE decode gate, ReasonCache |
| `end_decode` | the loop ended, the last rows are not yet copied back | ReasonCache |
| `on_capture` / `after_batch` | a row's KV went back to its node / the batch ended | RSBCM |
| `on_split` / `on_release` / `on_scores` | tree events | RSBCM, SkipKV |
| `verify_observer` / `skip_verify` | the verify pass | CGEE |

A hook that needs more of the backend gets it through `Host`, the session's public API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from branchwise.backends.base import FinishReason, KVStats, ShareMode
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.tree import KVTree, Ledger, Segment

if TYPE_CHECKING:
    from torch import nn


@dataclass
class Exit:
    """Rows that leave the forward after this layer (`rows` bool over the active rows) with their logits."""

    rows: torch.Tensor
    logits: torch.Tensor


@dataclass
class Forward:
    """One forward of a batch through the decoder: what hooks may read while the layers run.

    `rows` maps each active position to its original batch row (rows leave on an `Exit`); `ids`
    [B, q] are the fed tokens (padded), `counts` how many each row really fed, `last` the position
    of each active row's last fed token. `layers` is the module run at each index: a hook may
    replace the entries after the current one (River switches the rest of the stack).
    """

    ids: torch.Tensor
    counts: list[int]
    n_fed: torch.Tensor
    pos: torch.Tensor
    last: torch.Tensor
    rows: torch.Tensor
    layers: list[nn.Module]
    parts: DecoderParts
    run_layer: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    """Run one decoder layer on the active rows (positions, rotary and batch context bound)."""
    observed: bool = False
    """True when a per-call observer (a verify or capture pass) watches this forward."""
    state: dict[str, object] = field(default_factory=dict)
    head: nn.Module | None = None
    """The LM head for this forward's logits (None: the model's); River swaps in its quantized one."""

    @property
    def q_len(self) -> int:
        return int(self.ids.shape[1])

    @property
    def decode_step(self) -> bool:
        """One token per row: a decode step (token-level decisions), not a prefill."""
        return self.q_len == 1

    def last_states(self, h: torch.Tensor) -> torch.Tensor:
        """`h` [b, q, d] at each active row's last fed token → [b, d]."""
        return h[torch.arange(len(self.rows), device=h.device), self.last]


class Host(Protocol):
    """What an acceleration may use of the session it runs in (its public API)."""

    tree: KVTree
    parts: DecoderParts
    device: torch.device
    stats: KVStats
    ledger: Ledger

    @property
    def max_context(self) -> int | None:
        """The model's context window in tokens (None: unknown)."""
        ...

    def compute(self, segs: Sequence[Segment], observers: Sequence[Acceleration] = ()) -> None:
        """Compute the pending tokens of `segs` (and their ancestors), watched by `observers`."""
        ...

    def prefix_node(self, root: Segment, k: int) -> tuple[Segment | None, int]:
        """The segment whose KV chain ends at path position j <= k of `root` (split if needed), and j:
        below k where k falls inside a lossy (evicted, block-shared) segment; (None, 0) for none."""
        ...

    def share_child(self, root: Segment, own: list[int], reused: int) -> int:
        """A child that reads all of `root`'s KV and holds `own` tokens of its own."""
        ...

    def free(self, seg: Segment) -> None:
        """Release a segment made by the hook (it is freed with whatever it alone kept alive)."""
        ...

    def fork(self, node: int, n: int, share: ShareMode | None = None) -> list[int]: ...

    def append(self, nodes: Sequence[int], token_ids: Sequence[Sequence[int]]) -> None: ...

    def release(self, nodes: Sequence[int]) -> None: ...

    def plain(self) -> Host:
        """A session over the same tree without accelerations and with its own throwaway stats."""
        ...


class Acceleration:
    """Base class of an acceleration plug-in: override the hooks you need (see the module docstring)."""

    name: str = "acceleration"
    """The plug-in's field of `Accel` (errors and notes name it as `accel.<name>`)."""
    needs_cascade: bool = False
    """Whether the plug-in needs `broadcast="cascade"`: it reads attention per shared segment, which
    the per-row copies of `broadcast="copy"` do not have. Checked when a session is built
    (`session.check_broadcast`), so the combination fails at construction, not mid-run."""

    # -- fork time
    def row_kv_tokens(self, max_tokens: int) -> int:
        """The most own KV tokens a row decoding `max_tokens` holds at once under this acceleration
        (an eviction policy caps it): what the KV budget's admission reserves per row."""
        return max_tokens

    def on_fork(self, host: Host, path: list[int], n: int, parent: Segment) -> bool:
        """Whether sharing `parent` (whose path is `path`) with `n` children pays; False makes the
        fork recompute."""
        return True

    def on_fork_prompts(
        self,
        host: Host,
        root: Segment,
        path: list[int],
        prompts: list[list[int]],
        divergent: list[tuple[int, int, int]],
    ) -> dict[int, int]:
        """Place prompts that diverge from `root`'s path: (index, common prefix, common suffix) → node."""
        return {}

    # -- batch
    def on_batch(self, batch: Batch) -> None:
        """A batch was assembled (taps may be installed on `batch.ctx`)."""

    def on_capture(self, batch: Batch, pos: int, row: Row) -> None:
        """Row `row` at batch position `pos` was copied back into its segment."""

    def after_batch(self, batch: Batch, decoded: bool) -> None:
        """The batch is done (`decoded`: it was a decode, not only a prefill)."""

    # -- forward (the runner's layer loop)
    def begin_forward(self, fwd: Forward) -> None:
        """A forward starts."""

    def before_layer(self, fwd: Forward, index: int, h: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer `index` (return it, changed or not)."""
        return h

    def after_layer(self, fwd: Forward, index: int, h_in: torch.Tensor, h: torch.Tensor) -> Exit | None:
        """Layer `index` turned `h_in` into `h`; return an `Exit` to let rows leave with logits."""
        return None

    def after_forward(self, fwd: Forward, logits: torch.Tensor | None) -> None:
        """The forward ended with `logits` (one row per original batch row)."""

    # -- decode loop
    def after_pending(self, batch: Batch, feeds: Sequence[Sequence[int]]) -> None:
        """The batch computed each row's pending tokens `feeds` (before any decode step)."""

    def begin_decode(self, batch: Batch) -> None:
        """Decoding of `batch` starts."""

    def before_step(self, batch: Batch, rows: Sequence[Row]) -> None:
        """A decode step is about to feed the last sampled token of `rows` (the present rows)."""

    def stop_reason(self, rows: Sequence[Row], step: int) -> FinishReason | None:
        """Stop every unfinished row now, for this reason (None = go on)."""
        return None

    def after_step(
        self, batch: Batch, rows: Sequence[Row], feeds: Sequence[Sequence[int]], step: int
    ) -> None:
        """A decode step fed `feeds` for the present `rows`."""

    def end_decode(self, batch: Batch, rows: Sequence[Row]) -> None:
        """The decode loop ended; `rows` (the present rows) are about to be copied into their nodes."""

    # -- verify pass
    def verify_observer(
        self, n_rows: int, candidates: Sequence[int], trace: list[Any] | None
    ) -> Acceleration | None:
        """A per-call observer for a verify forward (may exit rows early; fills `trace`), or None."""
        return None

    def skip_verify(self, confidences: Sequence[float]) -> bool:
        """Whether the verify pass may be skipped given the branches' confidences."""
        return False

    # -- tree events
    def on_split(self, head: Segment, rest: Segment, k: int) -> None:
        """`rest`'s first k tokens moved into the new parent `head`."""

    def on_release(self, seg: Segment) -> None:
        """`seg` was freed."""

    def on_scores(self, segs: Sequence[Segment], scores: Sequence[float]) -> None:
        """A verifier scored these branches."""


class HiddenCapture(Acceleration):
    """Per-call observer that keeps every layer's output at each row's last token (never exits)."""

    name = "capture"

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def after_layer(self, fwd: Forward, index: int, h_in: torch.Tensor, h: torch.Tensor) -> Exit | None:
        self.states.append(fwd.last_states(h).detach().clone())
        return None

    def stacked(self) -> torch.Tensor:
        """[L, B, H]."""
        return torch.stack(self.states)


def overrides(plugins: Sequence[Acceleration], hook: str) -> list[Acceleration]:
    """The plug-ins that override `hook` (so the core calls no no-op in its loops)."""
    base = getattr(Acceleration, hook)
    return [p for p in plugins if getattr(type(p), hook) is not base]
