"""SkipKV (the SkipKV paper, §4.1-4.2) as a plug-in: sentence-aware eviction of each branch's own
generated KV during decode, and steering away from non-execution thoughts.

The policy is pure logic in three modules, one concern each: the sentences and their slots across
evictions (`skipkv_sentences.py`), the Eq. 3-6 scores and which slots to keep (`skipkv_policy.py`),
the steering vector and its strength (`skipkv_steering.py`); this module applies it through the
hooks:

- `after_pending` / `after_step`: every token a branch feeds goes to its `SentenceTracker` (with its
  final-norm hidden state during decode, for the sentence means of Eq. 2);
- `on_batch`: a `QueryWindow` tap records each layer's last α post-RoPE decode queries per row (the
  observation window of Eq. 4), carried with the row across batches (`on_capture`);
- `after_step`: every `interval` generated tokens of a branch (counted along its path, across
  `extend` calls and tree steps, not by the decode loop's step which restarts on every `extend`), a
  branch above budget keeps its best slots (`KVEdits.keep_row`); positions stay logical, so later
  tokens simply stop seeing what was evicted;
- `before_step`: steering adds α_t·v at one layer's input at delimiter tokens, as inputs of the
  step (`batch.Steer` on the batch: a slot of a persistent table and a scale per row).

None of it needs the layer loop: the query window is fed by the fixed-shape step itself (an
`in_step` tap, written in place) and the step returns the hidden states the tracker reads, so
SkipKV's decode steps run on the fast step (`step.py`).

A branch's budget covers its own generated KV *and* the generated KV of its exclusive ancestors:
earlier tree steps that no live sibling reads (each has one live child, the branch's path). Those
are evicted in place in their segments (`KVEdits.keep`) with the same Eq. 6 scores. The prompt
and every ancestor shared with a live sibling are never evicted. State per branch lives here
(`states`), keyed by node and dropped when the node is freed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from branchwise.backends.accel import SkipKVConfig, SteeringConfig
from branchwise.backends.base import KVStats
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import AttentionTap, Batch, Row
from branchwise.backends.hf.hooks import Acceleration, KVEdits, Setup
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.skipkv_policy import (
    eviction_scores,
    key_redundancy,
    newest_mask,
    select_keep,
    select_keep_per_head,
    sentence_redundancy,
    token_importance,
)
from branchwise.backends.hf.skipkv_sentences import SentenceTracker, delimiter_token_ids
from branchwise.backends.hf.skipkv_steering import SteeringVector, steering_path, steering_strength
from branchwise.backends.hf.step_inputs import Steer, StepKeys


@dataclass
class SteeringBuild:
    """A steering vector loaded, checked against the model and placed on its device (built once)."""

    vector: SteeringVector
    layer: int
    table: torch.Tensor
    """`[2, d]` on the model's device and in its dtype: row 0 zeros (no steering), row 1 the vector
    (`batch.Steer`: the step reads it in place, at the same address for every step)."""

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
        on_device = vector.vector.to(device=weight.device, dtype=weight.dtype)
        return cls(vector=vector, layer=layer, table=torch.stack([torch.zeros_like(on_device), on_device]))


@dataclass
class SkipState:
    """SkipKV bookkeeping of one branch segment, kept across `extend` calls.

    `gen_start` is where the generated (evictable) part starts in the segment's own KV; everything
    before it (the prompt, appended text) is never evicted. The tracker holds the sentences, the
    gs index of every kept slot and the running sentence means of the final-norm hidden states.
    """

    tracker: SentenceTracker
    gen_start: int
    generated: int = 0
    """Tokens generated along the branch's path (inherited from the nearest SkipKV ancestor)."""
    checked: int = 0
    """`generated` at the branch's last compression check: the interval counts from there."""
    window: list[torch.Tensor] | None = None
    """The branch's query window when its last batch let it go (`QueryWindow.save`)."""


@dataclass
class _Candidates:
    """One row's eviction candidates (`SkipKV._candidates`), gathered before any row is scored:
    the row's pieces in path order (its exclusive ancestors' generated KV, then its own), each as
    (first evictable slot, tracker) with its size; the ancestors' segments; every piece's keys
    `[L, H_kv, N, D]`; which slots may go and which the recent window keeps (`[N]` each); each
    slot's sentence penalty λ (`[N]`, or `[L, H_kv, N]` per head; None without sentence scoring)."""

    pos: int
    row: Row
    pieces: list[tuple[int, SentenceTracker]]
    sizes: list[int]
    ancestors: list[Segment]
    keys: torch.Tensor
    evictable: torch.Tensor
    protected: torch.Tensor
    penalty: torch.Tensor | None


class QueryWindow(AttentionTap):
    """Per layer, each row's last `size` post-RoPE decode queries `[B, H, size, D]`; `filled[b]` of
    them are real (Eq. 4's observation window).

    A ring: every row of a batch steps together, so one write slot (`slot`, a tensor the step
    reads, advanced on the host between steps) serves them all, and a step writes one query per
    layer where shifting the whole window cost a cat and a copy of it in every layer of every step.
    Why per row and fixed: a row's window is its own history, carried across the batches it joins
    (a batch re-assembled for a newcomer or after a preemption, `SkipKV.on_capture`), so where a
    batch starts does not change which tokens the row evicts."""

    def __init__(self, like: torch.Tensor, shape: tuple[int, int, int, int], n_layers: int) -> None:
        self.windows = [like.new_zeros(shape) for _ in range(n_layers)]
        self.size = shape[2]
        self.filled = [0] * shape[0]
        self.head = 0
        """The slot the next step writes (host copy of `slot`)."""
        self.slot = torch.zeros(1, dtype=torch.long, device=like.device)

    in_step = True

    def on_query(self, layer: int, query: torch.Tensor, q_len: int) -> None:
        if q_len == 1:  # decode steps only
            self._record(layer, query)
            if layer == len(self.windows) - 1:
                self.count_step()

    reads_keys = False

    def on_step(self, layer: int, query: torch.Tensor, keys: StepKeys | None) -> None:
        self._record(layer, query)

    def _record(self, layer: int, query: torch.Tensor) -> None:
        """Write the step's query into the ring's slot, in place: the buffer keeps its address and
        the slot is a tensor (a captured step replays the write); the buffers may be inference
        tensors (made inside a forward)."""
        with torch.inference_mode():
            self.windows[layer].index_copy_(2, self.slot, query)

    def count_step(self) -> None:
        self.filled = [min(f + 1, self.size) for f in self.filled]
        self.head = (self.head + 1) % self.size
        with torch.inference_mode():
            self.slot.fill_(self.head)

    def select_rows(self, keep: torch.Tensor) -> None:
        self.windows = [w.index_select(0, keep) for w in self.windows]
        self.filled = [self.filled[i] for i in keep.tolist()]

    def _slots(self, n: int) -> torch.Tensor:
        """The ring's last `n` written slots, oldest first."""
        return (torch.arange(self.head - n, self.head) % self.size).to(self.slot.device)

    def of_row(self, layer: int, pos: int) -> torch.Tensor:
        """Row `pos`'s real queries at `layer`, `[H, filled, D]`, oldest first."""
        return self.windows[layer][pos].index_select(1, self._slots(self.filled[pos]))

    def of_rows(self, rows: Sequence[int]) -> torch.Tensor:
        """Rows' real queries at every layer, `[R, L, H, filled, D]`, oldest first (the rows must
        have as many: `filled`)."""
        n = {self.filled[pos] for pos in rows}
        assert len(n) == 1, "of_rows: the rows hold different numbers of queries"
        index, slots = torch.tensor(list(rows), device=self.slot.device), self._slots(n.pop())
        return torch.stack([w.index_select(0, index).index_select(2, slots) for w in self.windows], dim=1)

    def save(self, pos: int) -> list[torch.Tensor]:
        """Row `pos`'s window, per layer (to carry it into the row's next batch)."""
        return [self.of_row(layer, pos) for layer in range(len(self.windows))]

    def restore(self, pos: int, saved: list[torch.Tensor]) -> None:
        """Start row `pos` from a window `save` returned."""
        n = min(int(saved[0].shape[1]), self.size)
        slots = self._slots(n)
        with torch.inference_mode():  # the buffers may have been made inside a forward
            for w, s in zip(self.windows, saved, strict=True):
                w[pos].index_copy_(1, slots, s[:, s.shape[1] - n :])
        self.filled[pos] = n


class SkipKV(Acceleration):
    """The SkipKV plug-in of one run (see the module docstring). Statistics: `skipkv_compressions`,
    `skipkv_evicted_tokens` (counted at every compression step), `skipkv_ancestor_evicted_tokens`
    (of those, the ones in exclusive ancestor steps), `skipkv_branch_kv_max` (the most generated KV a
    branch held right after a compression: at most `budget`) and `skipkv_branch_kv_peak` (the most it
    held after any step: at most `budget + interval + 1`, also when a pruned sibling leaves a shared
    step to this branch alone)."""

    name = "skipkv"
    config = SkipKVConfig

    def __init__(
        self,
        cfg: SkipKVConfig,
        parts: DecoderParts,
        tokenizer: PreTrainedTokenizerBase,
        delimiters: frozenset[int],
        steering: SteeringBuild | None,
        stats: KVStats,
        kv: KVEdits,
    ) -> None:
        self.cfg = cfg
        self.parts = parts
        self.delimiters = delimiters
        self.steer_build = steering
        self.stats = stats
        self.kv = kv
        self.states: dict[int, SkipState] = {}
        # one sequence of ids decodes to one str
        self._decode = cast(
            Callable[[Sequence[int]], str], functools.partial(tokenizer.decode, skip_special_tokens=True)
        )
        self._windows: dict[int, QueryWindow] = {}
        """Each live batch's query window, by `id(batch)`."""
        self._saved: dict[int, list[torch.Tensor]] = {}
        """Windows of rows captured from the batch now decoding (committed by `after_batch`)."""
        self._fed: set[int] = set()
        """Rows whose tokens `after_pending` tracked, to check in `begin_decode`."""

    @classmethod
    def build(cls, cfg: SkipKVConfig, setup: Setup) -> SkipKV:
        """The delimiter ids (a pass over the vocabulary) and the steering vector are built once."""
        host = setup.host
        delimiters = setup.cached("skipkv", ("delimiters",), lambda: delimiter_token_ids(setup.tokenizer))
        steering = None
        if cfg.steering is not None:
            steer = cfg.steering
            steering = setup.cached(
                "skipkv",
                ("steering", steer),
                lambda: SteeringBuild.load(steer, host.parts, setup.model_name, delimiters),
            )
        return cls(cfg, host.parts, setup.tokenizer, delimiters, steering, host.stats, host.kv)

    def state(self, node: int) -> SkipState | None:
        """The SkipKV state of a node (None before it decoded under SkipKV)."""
        return self.states.get(node)

    def after_pending(self, batch: Batch, feeds: Sequence[Sequence[int]]) -> None:
        """Track tokens a branch fed before decoding: e.g. the last sampled token of an earlier
        batch or `extend`, which a decode step would have fed; its hidden state goes into its
        sentence's mean as that step's would (only a one-token feed has its own state here), and
        `begin_decode` checks the branch as that step's `after_step` would have."""
        hidden = batch.ctx.last_hidden
        whole = hidden is not None and hidden.shape[0] == len(batch.rows)
        for pos, (r, fed) in enumerate(zip(batch.rows, feeds, strict=True)):
            state = self.states.get(r.seg.id)
            if state is not None and fed:
                own = hidden[pos : pos + 1] if whole and len(fed) == 1 and hidden is not None else None
                state.tracker.append(fed, hidden=own)
                state.generated += len(fed)
                self._fed.add(r.seg.id)

    def row_kv_tokens(self, max_tokens: int) -> int:
        """A branch keeps at most `budget` tokens after each compression and grows by at most
        `interval` between two."""
        return min(max_tokens, self.cfg.budget + self.cfg.interval)

    def on_batch(self, batch: Batch) -> None:
        """Record each row's decode queries from the batch's first forward on (a row that rejoins
        feeds its last sampled token there, one decode query), starting from its carried window."""
        ctx = batch.ctx
        shape = (ctx.batch, self.parts.n_heads, self.cfg.query_window, self.parts.head_dim)
        window = QueryWindow(ctx.kv.like(), shape, self.parts.n_layers)
        for pos, r in enumerate(batch.rows):
            state = self.states.get(r.seg.id)
            if state is not None and state.window is not None:
                window.restore(pos, state.window)
        ctx.taps.append(window)
        self._windows[id(batch)] = window

    def begin_decode(self, batch: Batch) -> None:
        """Start tracking each row's generated tokens; check the rows that fed tokens before the
        loop (`after_pending`: a batch re-assembled mid-decode feeds each row's last sampled token
        there, where one batch would have fed it in a decode step and checked it)."""
        for r in batch.rows:
            if r.seg.id not in self.states:
                tracker = SentenceTracker(self.delimiters, self.cfg.keywords, self._decode)
                up = self._inherited(r.seg)
                self.states[r.seg.id] = SkipState(
                    tracker=tracker,
                    gen_start=r.kv_len,
                    generated=0 if up is None else up.generated,
                    checked=0 if up is None else up.checked,
                )
        fed, self._fed = self._fed, set()
        if fed:
            self._check(batch, batch.rows, fed)
        batch.ctx.steer = None

    def on_capture(self, batch: Batch, pos: int, row: Row) -> None:
        """Keep the row's query window for its next batch (a decode's rows are captured when the
        batch ends, is re-assembled, or preempts them)."""
        window = self._windows.get(id(batch))
        if window is not None and row.seg.id in self.states:
            self._saved[row.seg.id] = window.save(pos)

    def after_batch(self, batch: Batch, decoded: bool) -> None:
        """A decode's windows go with their rows; a prefill's recorded no decode."""
        self._windows.pop(id(batch), None)
        self._fed.clear()
        saved, self._saved = self._saved, {}
        if decoded:
            for node, window in saved.items():
                state = self.states.get(node)
                if state is not None:
                    state.window = window

    def steering(self, rows: Sequence[Row]) -> Steer | None:
        """This step's steering (§4.2, None when it is off): the vector (the table's row 1) where a
        row feeds a newline delimiter (its last sampled token), no row (row 0, zeros) elsewhere,
        at α_t = α0 + γ·N_nonexec per row. Inputs of the step, not a hook inside it: the fixed-shape
        step reads them at fixed addresses (`batch.Steer`)."""
        build, steer = self.steer_build, self.cfg.steering
        if build is None or steer is None:
            return None
        idx = [int(r.finish is None and bool(r.out) and r.out[-1] in self.delimiters) for r in rows]
        strengths = [
            steering_strength(steer.alpha0, steer.gamma, self.states[r.seg.id].tracker.n_nonexec)
            for r in rows
        ]
        device = build.table.device
        return Steer(
            layer=build.layer,
            table=build.table,
            idx=torch.tensor(idx, dtype=torch.long).to(device, non_blocking=True),
            scale=torch.tensor(strengths, dtype=torch.float32).to(device, non_blocking=True),
        )

    def before_step(self, batch: Batch, rows: Sequence[Row]) -> None:
        batch.ctx.steer = self.steering(rows)

    def after_step(
        self, batch: Batch, rows: Sequence[Row], feeds: Sequence[Sequence[int]], step: int
    ) -> None:
        """Track the tokens just fed, then `_check` every row."""
        batch.ctx.steer = None
        hidden = batch.ctx.last_hidden
        assert hidden is not None
        for pos, (r, fed) in enumerate(zip(rows, feeds, strict=True)):
            state = self.states[r.seg.id]
            if fed:
                state.tracker.append(fed, hidden=hidden[pos : pos + 1])
                state.generated += len(fed)
        self._check(batch, rows)

    def _check(self, batch: Batch, rows: Sequence[Row], only: set[int] | None = None) -> None:
        """Compress each row (of the present `rows`; with `only`, those of these nodes) above budget
        once `interval` more tokens were generated on its path since its last check (the count
        survives `extend` calls), or at once when it holds more than `budget + interval`. The rows
        due at one step are scored together (`_scored`): branches of one batch generate in step, so
        most compressions fall on the same steps, and one product per term for all of them costs
        what one row's did."""
        compressions, evicted, held_max = 0, 0, 0
        due_rows: list[tuple[int, Row]] = []
        for pos, r in enumerate(rows):
            if only is not None and r.seg.id not in only:
                continue
            state = self.states[r.seg.id]
            held = self._held(batch, r)
            due = state.generated - state.checked >= self.cfg.interval
            # a step only this branch reads now (its sibling released) joins what it holds at once:
            # compress then, not at the next interval, so the bound below holds for every tree
            over = held > self.cfg.budget + self.cfg.interval
            if r.finish is None and (due or over):
                state.checked = state.generated
                if held > self.cfg.budget:
                    due_rows.append((pos, r))
                    continue
            held_max = max(held_max, held)
        candidates = [self._candidates(batch, pos, r) for pos, r in due_rows]
        for cands, (scores, shared) in self._scored(batch, candidates):
            compressions += 1
            evicted += self._evict(batch, cands, scores, shared)
            held = self._held(batch, cands.row)
            self.stats.extra["skipkv_branch_kv_max"] = max(
                self.stats.extra.get("skipkv_branch_kv_max", 0), held
            )
            held_max = max(held_max, held)
        if held_max > self.stats.extra.get("skipkv_branch_kv_peak", 0):
            self.stats.extra["skipkv_branch_kv_peak"] = held_max
        self.stats.bump("skipkv_compressions", compressions)
        self.stats.bump("skipkv_evicted_tokens", evicted)

    def _inherited(self, seg: Segment) -> SkipState | None:
        """The state of the nearest ancestor (KV or logical) that decoded under SkipKV."""
        up = seg.parent if seg.shares_parent else seg.logical_parent or seg.parent
        while up is not None:
            state = self.states.get(up.id)
            if state is not None:
                return state
            up = up.parent if up.shares_parent else up.logical_parent or up.parent
        return None

    def exclusive_ancestors(self, batch: Batch, row: Row) -> list[tuple[Segment, SkipState]]:
        """The row's ancestor steps whose generated KV only this branch reads, farthest first.

        Nearest first, an ancestor qualifies while it decoded under SkipKV, is not the prompt, and has
        exactly one live child (the branch's path); the first shared one ends the walk (everything
        above it is shared too). Under `broadcast="copy"` ancestors are copies, so none qualify.
        """
        if batch.broadcast != "cascade":
            return []
        out = []
        for anc in row.seg.kv_ancestors():
            state = self.states.get(anc.id)
            if state is None or anc.is_prompt or anc.live_children != 1 or not anc.keys:
                break
            out.append((anc, state))
        return out[::-1]

    def _held(self, batch: Batch, row: Row) -> int:
        """Generated KV tokens the branch holds in its own segment and its exclusive ancestors."""
        own = self.states[row.seg.id].tracker.cache_len
        return own + sum(s.tracker.cache_len for _, s in self.exclusive_ancestors(batch, row))

    def _candidates(self, batch: Batch, pos: int, row: Row) -> _Candidates:
        """The row's eviction candidates: its own generated slots and those of its exclusive
        ancestors, in path order (importance from the row's recent queries, redundancy over all of
        them, each segment's own sentence penalty)."""
        cfg, state = self.cfg, self.states[row.seg.id]
        ancestors = self.exclusive_ancestors(batch, row)
        # pieces in path order: (keys per layer, first evictable slot, tracker)
        pieces: list[tuple[list[torch.Tensor], int, SentenceTracker]] = []
        for anc, anc_state in ancestors:
            assert anc.keys is not None
            pieces.append((list(anc.keys), anc_state.gen_start, anc_state.tracker))
        pieces.append((batch.own_kv(pos, row)[0], state.gen_start, state.tracker))
        layers = range(self.parts.n_layers)
        if len(pieces) == 1:  # its own slots only: no concatenation per layer
            keys = torch.stack(pieces[0][0])
        else:
            keys = torch.stack([torch.cat([p[0][layer] for p in pieces], dim=1) for layer in layers])
        sizes = [int(p[0][0].shape[1]) for p in pieces]
        total = sum(sizes)
        device = keys.device
        grid = (self.parts.n_layers, int(keys.shape[1]))  # (L, H_kv)
        evictable = torch.zeros(total, dtype=torch.bool, device=device)
        # λ per slot ([N]), or per (layer, head) slot when heads may hold different slots
        penalty = (
            torch.zeros((*grid, total) if cfg.per_head else (total,), device=device)
            if cfg.sentence_scoring
            else None
        )
        offset = 0
        for (_, start, tracker), size in zip(pieces, sizes, strict=True):
            evictable[offset + start : offset + size] = True
            if penalty is not None and size > start:
                lam = sentence_redundancy(tracker.sentence_vectors(), cfg.tau)
                penalty[..., offset + start : offset + size] = tracker.sentence_penalty(lam).to(device)
            offset += size
        return _Candidates(
            pos,
            row,
            [(start, tracker) for _, start, tracker in pieces],
            sizes,
            [anc for anc, _ in ancestors],
            keys,
            evictable,
            newest_mask(evictable, cfg.window),
            penalty,
        )

    def _scored(
        self, batch: Batch, rows: list[_Candidates]
    ) -> list[tuple[_Candidates, tuple[torch.Tensor, torch.Tensor]]]:
        """Eq. 6 for each row's candidates: per (layer, head) `[L, H, N]` and head-averaged `[N]`.
        Rows with as many candidates and queries are scored in one product per term, stacked along
        a leading dim (each term is computed per row, so each row's scores are its own)."""
        cfg, window = self.cfg, self._windows.get(id(batch))
        assert window is not None
        groups: dict[tuple[int, int], list[_Candidates]] = {}
        for c in rows:
            groups.setdefault((int(c.keys.shape[2]), window.filled[c.pos]), []).append(c)
        out = []
        for group in groups.values():
            keys = torch.stack([c.keys for c in group])  # [R, L, H, N, D]
            if cfg.recency_only:  # the window is the whole budget: no score decides anything
                scores = keys.new_zeros(keys.shape[:-1], dtype=torch.float32)
                out += [(c, (scores[r], scores[r, 0, 0])) for r, c in enumerate(group)]
                continue
            queries = window.of_rows([c.pos for c in group])  # [R, L, H_q, α, D]
            importance = token_importance(queries, keys, self.parts.head_dim**-0.5, cfg.pool_kernel)
            redundancy = key_redundancy(keys) if cfg.redundancy else None
            penalty = None
            if cfg.sentence_scoring:
                penalty = torch.stack([c.penalty for c in group if c.penalty is not None])
                if penalty.dim() == 2:  # [R, N]: every head's alike
                    penalty = penalty[:, None, None].expand_as(importance)
            scores = eviction_scores(importance, redundancy, penalty, cfg.sigma, per_head=True)
            shared = scores.mean(dim=(1, 2))  # Eq. 6 is linear: the head-averaged score, [R, N]
            out += [(c, (scores[r], shared[r])) for r, c in enumerate(group)]
        return out

    def _evict(self, batch: Batch, c: _Candidates, scores: torch.Tensor, shared: torch.Tensor) -> int:
        """Evict the row's lowest Eq. 6 slots down to the budget, in place; returns how many. With
        `per_head`, each (layer, KV head) keeps its own best slots; how many each segment keeps comes
        from the head-averaged selection, so every head keeps as many slots of a segment and its KV
        stays rectangular."""
        cfg = self.cfg
        keep = select_keep(shared, cfg.budget, evictable=c.evictable, protected=c.protected)
        offset = 0
        for i, ((start, tracker), size) in enumerate(zip(c.pieces, c.sizes, strict=True)):
            local = keep[(keep >= offset) & (keep < offset + size)] - offset
            n_kept = int(local.numel())
            heads = None
            part = slice(offset, offset + size)
            if n_kept < size and cfg.per_head:
                heads = select_keep_per_head(
                    scores[..., part],
                    n_kept - start,
                    evictable=c.evictable[part],
                    protected=c.protected[part],
                )
                if bool((heads == heads[:1, :1]).all()):  # every head chose alike (e.g. recency only)
                    local, heads = heads[0, 0], None
            ancestor = c.ancestors[i] if i < len(c.ancestors) else None
            if heads is not None:
                if ancestor is not None:
                    self.kv.keep_per_head(ancestor, heads, batch)
                else:
                    self.kv.keep_row_per_head(batch, c.pos, c.row, heads)
                tracker.evict_per_head(heads[..., start:] - start)
            elif n_kept < size:
                if ancestor is not None:
                    self.kv.keep(ancestor, local, batch)
                else:
                    self.kv.keep_row(batch, c.pos, c.row, local)
                tracker.evict((local[local >= start] - start).tolist())
            if n_kept < size and ancestor is not None:
                self.stats.bump("skipkv_ancestor_evicted_tokens", size - n_kept)
            offset += size
        return sum(c.sizes) - int(keep.numel())

    def on_release(self, seg: Segment) -> None:
        self.states.pop(seg.id, None)
