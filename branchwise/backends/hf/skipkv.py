"""SkipKV (the SkipKV paper, §4.1-4.2) as a plug-in: sentence-aware eviction of each branch's own
generated KV during decode, and steering away from non-execution thoughts.

The policy (sentences, Eq. 3-6 scores, which slots to keep, the steering vector) is pure logic in
`skipkv_policy.py`; this module applies it through the hooks:

- `after_pending` / `after_step`: every token a branch feeds goes to its `SentenceTracker` (with its
  final-norm hidden state during decode, for the sentence means of Eq. 2);
- `begin_decode`: a `QueryWindow` tap records each layer's last α post-RoPE decode queries (the
  observation window of Eq. 4);
- `after_step`: every `interval` steps a branch above budget keeps its best slots (`Batch.keep_own`);
  positions stay logical, so later tokens simply stop seeing what was evicted;
- `before_step` / `before_layer`: steering adds α_t·v at one layer's input at delimiter tokens.

Prompt and ancestor KV (shared with other branches) is never evicted. State per branch lives here
(`states`), keyed by node and dropped when the node is freed.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from branchwise.backends.accel import SkipKVConfig, SteeringConfig
from branchwise.backends.base import KVStats
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import AttentionTap, Batch, Row
from branchwise.backends.hf.hooks import Acceleration, Forward
from branchwise.backends.hf.skipkv_policy import (
    SentenceTracker,
    SteeringVector,
    eviction_scores,
    key_redundancy,
    newest_mask,
    select_keep,
    sentence_redundancy,
    steering_path,
    steering_strength,
    token_importance,
)
from branchwise.backends.hf.tree import Segment


@dataclass
class Steering(Acceleration):
    """One decode step's steering (§4.2): add `strengths[row]·vector` at layer `layer`'s residual
    input, at the positions whose fed token is a newline delimiter, and nowhere else."""

    layer: int
    vector: torch.Tensor  # [d], model dtype and device
    delimiters: torch.Tensor  # [vocab] bool
    strengths: torch.Tensor  # [B] per batch row

    def apply(self, h: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """`h` [b, q, d] of the active rows, `ids` [b, q] their fed tokens, `rows` their batch rows."""
        gate = self.delimiters[ids].to(h.dtype) * self.strengths[rows, None].to(h.dtype)
        return h + gate[..., None] * self.vector

    def before_layer(self, fwd: Forward, index: int, h: torch.Tensor) -> torch.Tensor:
        return self.apply(h, fwd.ids[fwd.rows], fwd.rows) if index == self.layer else h


@dataclass
class SteeringBuild:
    """A steering vector loaded, checked against the model and placed on its device (built once)."""

    vector: SteeringVector
    layer: int
    on_device: torch.Tensor
    delimiters: torch.Tensor  # [vocab] bool on the model's device

    @classmethod
    def load(
        cls, cfg: SteeringConfig, parts: DecoderParts, model_name: str, delimiters: frozenset[int]
    ) -> SteeringBuild:
        path = Path(cfg.vector_path) if cfg.vector_path else steering_path(model_name)
        if not path.exists():
            raise FileNotFoundError(
                f"skipkv.steering needs a steering vector and there is none at {path}; "
                "build one with `branchwise steering build` or set steering.vector_path"
            )
        vector = SteeringVector.load(path)
        layer = cfg.layer if cfg.layer is not None else vector.layer
        if not 0 <= layer < parts.n_layers:
            raise ValueError(f"skipkv.steering.layer={layer} is outside 0..{parts.n_layers - 1}")
        hidden = parts.embed.embedding_dim
        if vector.vector.numel() != hidden:
            raise ValueError(
                f"steering vector at {path} has {vector.vector.numel()} dims; this model has {hidden}"
            )
        weight = parts.embed.weight
        mask = torch.zeros(parts.embed.num_embeddings, dtype=torch.bool)
        mask[[i for i in delimiters if i < mask.numel()]] = True
        return cls(
            vector=vector,
            layer=layer,
            on_device=vector.vector.to(device=weight.device, dtype=weight.dtype),
            delimiters=mask.to(weight.device),
        )


@dataclass
class SkipState:
    """SkipKV bookkeeping of one branch segment, kept across `extend` calls.

    `gen_start` is where the generated (evictable) part starts in the segment's own KV; everything
    before it (the prompt, appended text) is never evicted. The tracker holds the sentences, the
    gs index of every kept slot and the running sentence means of the final-norm hidden states.
    """

    tracker: SentenceTracker
    gen_start: int


class QueryWindow(AttentionTap):
    """Per layer, the last `size` post-RoPE decode queries `[B, H, α', D]` (Eq. 4's observation window)."""

    def __init__(
        self, like: torch.Tensor, shape: tuple[int, int, int, int], n_layers: int, size: int
    ) -> None:
        self.windows = [like.new_zeros(shape) for _ in range(n_layers)]
        self.size = size

    def on_query(self, layer: int, query: torch.Tensor, q_len: int) -> None:
        if q_len == 1:  # decode steps only
            self.windows[layer] = torch.cat([self.windows[layer], query], dim=2)[:, :, -self.size :]

    def select_rows(self, keep: torch.Tensor) -> None:
        self.windows = [w.index_select(0, keep) for w in self.windows]


class SkipKV(Acceleration):
    """The SkipKV plug-in of one run (see the module docstring). Statistics: `skipkv_compressions`,
    `skipkv_evicted_tokens` (counted at every compression step)."""

    name = "skipkv"

    def __init__(
        self,
        cfg: SkipKVConfig,
        parts: DecoderParts,
        tokenizer: PreTrainedTokenizerBase,
        delimiters: frozenset[int],
        steering: SteeringBuild | None,
        stats: KVStats,
    ) -> None:
        self.cfg = cfg
        self.parts = parts
        self.delimiters = delimiters
        self.steer_build = steering
        self.stats = stats
        self.states: dict[int, SkipState] = {}
        self._decode = functools.partial(tokenizer.decode, skip_special_tokens=True)
        self._window: QueryWindow | None = None
        self._steer: Steering | None = None

    def state(self, node: int) -> SkipState | None:
        """The SkipKV state of a node (None before it decoded under SkipKV)."""
        return self.states.get(node)

    def after_pending(self, batch: Batch, feeds: Sequence[Sequence[int]]) -> None:
        for r, fed in zip(batch.rows, feeds, strict=True):
            state = self.states.get(r.seg.id)
            if state is not None and fed:  # e.g. the last sampled token of an earlier extend
                state.tracker.append(fed)

    def begin_decode(self, batch: Batch) -> None:
        """Start tracking each row's generated tokens and record the decode queries."""
        for r in batch.rows:
            if r.seg.id not in self.states:
                tracker = SentenceTracker(self.delimiters, self.cfg.keywords, self._decode)
                self.states[r.seg.id] = SkipState(tracker=tracker, gen_start=r.kv_len)
        ctx = batch.ctx
        shape = (ctx.batch, self.parts.n_heads, 0, self.parts.head_dim)
        self._window = QueryWindow(ctx.tail_k[0], shape, self.parts.n_layers, self.cfg.query_window)
        ctx.taps.append(self._window)
        self._steer = None

    def steering(self, rows: Sequence[Row]) -> Steering | None:
        """This step's steering, with α_t = α0 + γ·N_nonexec per row (None when steering is off)."""
        build, steer = self.steer_build, self.cfg.steering
        if build is None or steer is None:
            return None
        strengths = [
            steering_strength(steer.alpha0, steer.gamma, self.states[r.seg.id].tracker.n_nonexec)
            for r in rows
        ]
        return Steering(
            layer=build.layer,
            vector=build.on_device,
            delimiters=build.delimiters,
            strengths=torch.tensor(strengths, device=build.on_device.device),
        )

    def before_step(self, batch: Batch, rows: Sequence[Row]) -> None:
        self._steer = self.steering(rows)

    def before_layer(self, fwd: Forward, index: int, h: torch.Tensor) -> torch.Tensor:
        return h if self._steer is None else self._steer.before_layer(fwd, index, h)

    def after_step(
        self, batch: Batch, rows: Sequence[Row], feeds: Sequence[Sequence[int]], step: int
    ) -> None:
        """Track the tokens just fed; every `interval` steps compress the rows above budget."""
        self._steer = None
        hidden = batch.ctx.last_hidden
        assert hidden is not None
        for pos, (r, fed) in enumerate(zip(rows, feeds, strict=True)):
            if fed:
                self.states[r.seg.id].tracker.append(fed, hidden=hidden[pos : pos + 1])
        if (step + 1) % self.cfg.interval:
            return
        compressions, evicted = 0, 0
        for pos, r in enumerate(rows):
            if r.finish is None and self.states[r.seg.id].tracker.cache_len > self.cfg.budget:
                compressions += 1
                evicted += self._compress(batch, pos, r)
        self.stats.bump("skipkv_compressions", compressions)
        self.stats.bump("skipkv_evicted_tokens", evicted)

    def _compress(self, batch: Batch, pos: int, row: Row) -> int:
        """Evict one row's lowest Eq. 6 tokens down to the budget, in place; returns how many."""
        cfg, state, window = self.cfg, self.states[row.seg.id], self._window
        assert window is not None
        ctx = batch.ctx
        at, n, g0 = row.tail_start, row.kv_len, state.gen_start
        keys = [t[pos, :, at : at + n] for t in ctx.tail_k]
        scale = self.parts.head_dim**-0.5
        importance = torch.stack(
            [
                token_importance(w[pos], k, scale, cfg.pool_kernel)
                for w, k in zip(window.windows, keys, strict=True)
            ]
        )
        redundancy = torch.stack([key_redundancy(k) for k in keys]) if cfg.redundancy else None
        penalty = None
        if cfg.sentence_scoring:
            lam = sentence_redundancy(state.tracker.sentence_vectors(), cfg.tau)
            penalty = torch.zeros(n, device=lam.device)
            penalty[g0:] = state.tracker.sentence_penalty(lam)
        scores = eviction_scores(importance, redundancy, penalty, cfg.sigma)
        evictable = torch.arange(n, device=scores.device) >= g0
        keep = select_keep(
            scores, cfg.budget, evictable=evictable, protected=newest_mask(evictable, cfg.window)
        )
        batch.keep_own(pos, row, keep.to(ctx.tail_k[0].device))
        state.tracker.evict((keep[keep >= g0] - g0).tolist())
        return n - int(keep.numel())

    def on_release(self, seg: Segment) -> None:
        self.states.pop(seg.id, None)
