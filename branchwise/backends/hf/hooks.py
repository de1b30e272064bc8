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
| `on_capture` / `after_batch` | a row's KV went back to its node / the batch ended | RSBCM, SkipKV, ReasonCache |
| `on_split` / `on_release` / `on_scores` | tree events | RSBCM, SkipKV |
| `verify_observer` / `skip_verify` | the verify pass | CGEE |

A hook that needs more of the backend gets it through `Host`, the session's public API.

Preemption under the KV budget needs no hook: a preempted row of a run whose plug-ins change KV
is captured (`on_capture`, as at any batch boundary) and swapped out, and comes back through a new
batch (`on_batch`, `after_pending`, `begin_decode`) with the same KV, so the per-row state a
plug-in keeps by node stays true; per-batch state (attention taps) must be carried per row across
batches (SkipKV's query window is, through `on_capture`). `kv_from_tokens` says which policy a
plug-in allows (`intake.py`).

An acceleration also says how it is made: `config` (its config type, a field of `Accel`) and
`build(cfg, setup)`, which takes its expensive parts from the backend's build cache through
`Setup`. `plugins.PLUGINS` registers the class; nothing else names it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from branchwise.backends.accel import AccelConfig
from branchwise.backends.base import FinishReason, KVStats, ShareMode
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.segment import Block, Segment
from branchwise.backends.hf.tree import KVTree

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")


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


class KVEdits:
    """The edits an acceleration may make to a branch's own KV: evict slots, move slots into a
    shared block, read a block instead of its own slots.

    Why one place: a branch's KV lives in up to three places at once - its segment in the tree, its
    row's tail in a running batch (buffers, length, attention taps) and the batch's shared view of a
    segment its rows read - and the tree counts its bytes. Each edit here keeps all of them
    consistent, so SkipKV, RSBCM and ReasonCache never touch buffers, views or byte accounting.
    Positions stay logical throughout: later tokens simply stop seeing what was evicted.

    A running row is named by its batch, its position among the batch's present rows (`pos`, as the
    decode hooks number them) and its `Row`; slot indices are relative to the row's or segment's own
    KV.
    """

    def __init__(self, tree: KVTree) -> None:
        self.tree = tree

    def keep_row(self, batch: Batch, pos: int, row: Row, keep: torch.Tensor) -> None:
        """Keep only the slots `keep` (increasing) of a running row's own KV."""
        batch.keep_own(pos, row, keep.to(batch.ctx.lens.device))

    def keep(self, seg: Segment, keep: torch.Tensor, batch: Batch | None = None) -> None:
        """Keep only the slots `keep` (increasing) of a segment held in the tree, freeing the rest;
        `batch`, when it reads the segment as a shared ancestor, reads what is left from its next
        forward on."""
        assert seg.keys is not None, f"segment {seg.id} holds no KV"
        mask = torch.zeros(seg.kv_tokens, dtype=torch.bool, device=seg.keys[0].device)
        mask[keep.to(mask.device)] = True
        self.tree.keep_kv(seg, mask)
        if batch is not None:
            batch.reread(seg)

    def keep_row_per_head(self, batch: Batch, pos: int, row: Row, keep: torch.Tensor) -> None:
        """`keep_row` with each (layer, KV head) keeping its own slots: `keep` [L, H_kv, k]."""
        batch.keep_own_per_head(pos, row, keep.to(batch.ctx.lens.device))

    def keep_per_head(self, seg: Segment, keep: torch.Tensor, batch: Batch | None = None) -> None:
        """`keep` with each (layer, KV head) keeping its own slots: `keep` [L, H_kv, k]."""
        assert seg.keys is not None and seg.values is not None, f"segment {seg.id} holds no KV"

        def pick(ts: list[torch.Tensor]) -> list[torch.Tensor]:
            return [
                t.gather(1, i.to(t.device)[..., None].expand(-1, -1, t.shape[-1]))
                for t, i in zip(ts, keep, strict=True)
            ]

        seg.exact = False
        self.tree.set_kv(seg, pick(seg.keys), pick(seg.values))
        if batch is not None:
            batch.reread(seg)

    def seal_row(self, batch: Batch, pos: int, row: Row, slot: int, logical: int, n: int) -> Block:
        """Move `n` of a running row's own slots (from `slot`; `logical` is where they sit in its
        tokens) into a new shared block that the row reads from then on: a source others may point at."""
        block = batch.seal(self.tree, pos, row, slot, n)
        batch.point_at(self.tree, pos, row, slot, logical, block)
        return block

    def seal(self, seg: Segment, slot: int, logical: int, n: int) -> Block:
        """`seal_row` for a segment held in the tree (outside the decode): its bytes move to the
        block, so nothing is held twice, and its readers see the same KV through the block."""
        return self.tree.seal_own(seg, slot, logical, n)

    def point_row_at(self, batch: Batch, pos: int, row: Row, slot: int, logical: int, block: Block) -> None:
        """Replace a running row's own slots `slot .. slot + block.tokens` by a reference to `block`."""
        batch.point_at(self.tree, pos, row, slot, logical, block)

    def point_at(self, seg: Segment, slot: int, logical: int, block: Block) -> None:
        """`point_row_at` for a segment held in the tree: a branch that ended, whose KV its node
        holds again (a batch in pages captures an ended row at once, for its pages to go back)."""
        self.tree.point_own(seg, slot, logical, block)


class Host(Protocol):
    """What an acceleration may use of the session it runs in (its public API)."""

    tree: KVTree
    kv: KVEdits
    """The only way a plug-in changes KV it holds (see `KVEdits`)."""
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


class Builds:
    """Artefacts built once per backend and key (see `plugins`); callers hold the backend's lock,
    so two runs never build the same thing twice."""

    def __init__(self) -> None:
        self._items: dict[Hashable, tuple[Any, float]] = {}

    def get(self, key: Hashable, make: Callable[[], T]) -> tuple[T, float, bool]:
        """`(artefact, seconds its build took, built just now)`."""
        if key in self._items:
            value, seconds = self._items[key]
            return value, seconds, False
        start = time.perf_counter()
        value = make()
        seconds = time.perf_counter() - start
        self._items[key] = (value, seconds)
        return value, seconds, True

    def __len__(self) -> int:
        return len(self._items)


class Setup:
    """What an acceleration's `build` may use for one run: the run's `host`, the backend's tokenizer
    and model name, and the backend's build cache.

    Why one object: each plug-in takes what it needs from it, so registering a new plug-in changes
    no signature. `report` puts the builds' cost into the run's statistics once all are made.
    """

    def __init__(
        self, host: Host, tokenizer: PreTrainedTokenizerBase, model_name: str, builds: Builds
    ) -> None:
        self.host = host
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._builds = builds
        self._seconds: dict[str, float] = {}
        self._fresh = 0

    def cached(self, name: str, key: Hashable, make: Callable[[], T]) -> T:
        """An expensive artefact of acceleration `name`, built once per backend and `key`; its cost
        is reported as `<name>_build_s` (and `accel_builds` counts the ones built for this run)."""
        value, seconds, built = self._builds.get(key, make)
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        self._fresh += built
        return value

    def shared(self, key: Hashable, make: Callable[[], T]) -> T:
        """State that every run of the backend shares under `key` and whose making costs nothing
        worth reporting (the probe's verdicts)."""
        return self._builds.get(key, make)[0]

    def report(self) -> None:
        """Count the builds this run used into its statistics."""
        for name, seconds in self._seconds.items():
            self.host.stats.bump(f"{name}_build_s", seconds)
        if self._seconds:
            self.host.stats.bump("accel_builds", self._fresh)


class Acceleration:
    """Base class of an acceleration plug-in: override the hooks you need (see the module docstring)."""

    name: str = "acceleration"
    """The plug-in's field of `Accel` (errors and notes name it as `accel.<name>`)."""
    config: ClassVar[type[AccelConfig] | None] = None
    """The config type that turns the plug-in on (the type of its field of `Accel`), which declares
    what the backends need without torch (needs the model, exclusions, notes); None for per-call
    observers, which no config turns on."""
    needs_cascade: bool = False
    """Whether the plug-in needs `broadcast="cascade"`: it reads attention per shared segment, which
    the per-row copies of `broadcast="copy"` do not have. Checked when a session is built
    (`engine.check_broadcast`), so the combination fails at construction, not mid-run."""
    step_inputs: bool = False
    """Whether its decode steps' work reaches the fixed-shape step as inputs it sets on the batch
    (`step_inputs.py`: River's exits): its forward hooks then serve only the forwards the layer loop
    runs (prefills, the `decode_step="layers"` baseline) and keep no decode step there."""
    kv_from_tokens: bool = False
    """Whether the KV a run holds under this plug-in is what computing its tokens again gives (it
    changes no KV: it only reads, stops or skips). It decides how a row preempted under the KV
    budget keeps its KV (`intake.policy_of`): recomputed from its tokens when every plug-in of the
    run says so, else swapped out and back, which keeps KV and per-row state exact. False, the safe
    default, costs a copy; True on a plug-in that does change KV would change a preempted row's
    tokens."""

    def layer_loop_reasons(self) -> list[str]:
        """Why this plug-in's decode steps need the layer loop (empty: they need not): the reasons
        those steps are counted under, off the fast step (`step_notes`): its name, unless it
        names the parts that need it. No shipped acceleration needs it for a decode step."""
        return [self.name] if needs_layer_loop([self]) else []

    @classmethod
    def build(cls, cfg: Any, setup: Setup) -> Acceleration:
        """The plug-in of one run for `cfg` (an instance of `config`): fresh state, its expensive
        parts from `setup.cached`."""
        raise NotImplementedError(f"{cls.__name__} is not built from a config")

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


FORWARD_HOOKS = ("begin_forward", "before_layer", "after_layer", "after_forward")
"""The hooks called inside a forward, between layers: what the fixed-shape step has no place for."""


def needs_layer_loop(plugins: Sequence[Acceleration]) -> list[str]:
    """The names of the plug-ins whose decode steps need the layer loop (`runner.py`) rather than
    the fixed-shape step (`step.py`): those that override a forward-level hook (`FORWARD_HOOKS`)
    without handing their work to the step as inputs (`Acceleration.step_inputs`)."""
    return [
        p.name for p in plugins if not p.step_inputs and any(overrides([p], hook) for hook in FORWARD_HOOKS)
    ]


def layer_loop_reasons(plugins: Sequence[Acceleration]) -> list[str]:
    """Why these plug-ins' decode steps need the layer loop, each plug-in's reasons in turn."""
    return [why for p in plugins if p.name in needs_layer_loop([p]) for why in p.layer_loop_reasons()]


def overrides(plugins: Sequence[Acceleration], hook: str) -> list[Acceleration]:
    """The plug-ins that override `hook` (so the core calls no no-op in its loops)."""
    base = getattr(Acceleration, hook)
    return [p for p in plugins if getattr(type(p), hook) is not base]
