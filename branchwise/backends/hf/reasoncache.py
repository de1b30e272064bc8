"""ReasonCache (the ReasonCache paper) as a plug-in: reuse near-identical KV blocks across reasoning
steps and branches instead of holding a copy of each.

Branches of one question (self-consistency, beam, ETS siblings) and the steps inside one trace
repeat themselves. Each row's generated KV is cut into fixed blocks of `block_tokens` slots, aligned
where its decoding started; a block is *sealed* once all its tokens are computed. When a reasoning
step ends (a newline or sentence end, decided on token ids), the filter (`reasoncache_filter.py`)
looks for an earlier step of the same question (this branch's, its earlier tree steps', or a
sibling's, live or finished) that the new step repeats (stage 1), then for each block sealed during the new step the nearest sealed block of those
candidate steps by KV distance (stage 2, PAT threshold). An admitted block is *shared*:

- the source block becomes a physical `segment.Block` unless it already is one: copied once out of its
  row's tail (the slots leave the tail, the row points at it: `KVEdits.seal_row`), or, for a node
  outside the decode, moved out of the node's KV (`KVEdits.seal`), so it is held once either way;
- the new block's slots leave the current row's tail and the row points at the same block
  (`KVEdits.point_row_at`): from the next forward on its attention reads the block through the batch's
  block pool, in the one product all rows of the pool share. No copy per reader.

The tree ref-counts blocks and frees one exactly when its last node goes. Positions stay logical:
the reused keys keep the rotary positions they were computed at (as in the paper's vLLM build), and
every later token's position comes from the node's token count, not from its KV length.

Off the hot path: the filter runs only between decode steps, only when a step closes and only on
sealed blocks; its time is counted (`reasoncache_filter_s`) so a benchmark can set it against
decode time. Sources are the generated KV of branches decoded in this run while their nodes live;
what a node's readers attend to never changes (a source's KV only moves into a block), and prompts
and other KV decoded before the run are never touched. `mode="lexical"` (stage 1 without stage 2, the paper's "only Cos" ablation) and
`mode="random"` (the paper's random-sharing baseline) run in the same code path.
"""

from __future__ import annotations

import ast
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from branchwise.backends.accel import ReasonCacheConfig
from branchwise.backends.base import KVStats
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.hooks import Acceleration, KVEdits, Setup
from branchwise.backends.hf.reasoncache_filter import (
    BlockNorms,
    PercentileThreshold,
    block_distance,
    dynamic_tau,
    formal_trees,
    lexical_similarity,
    structurally_equal,
)
from branchwise.backends.hf.segment import Block, Segment
from branchwise.backends.hf.vocab import token_texts


@dataclass(frozen=True)
class StepBoundaries:
    """Token ids that end a reasoning step (built once per tokenizer, from decoded text).

    A step ends after a token holding a newline (or sentence punctuation then whitespace, `.Ċ`), or
    after a sentence-ending token (`.`, `!`, `?`) when the next token starts with whitespace, so a
    decimal point (`2.5`) never splits a step."""

    closes: frozenset[int]
    sentence_end: frozenset[int]
    space_start: frozenset[int]

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> StepBoundaries:
        closes, end, space = set(), set(), set()
        for i, text in token_texts(tokenizer):
            stripped = text.rstrip()
            if "\n" in text or (stripped != text and stripped[-1:] in {".", "!", "?"}):
                closes.add(i)
            elif stripped[-1:] in {".", "!", "?"}:
                end.add(i)
            if text[:1].isspace():
                space.add(i)
        return cls(frozenset(closes), frozenset(end), frozenset(space))

    def step_end(self, tokens: Sequence[int], last: int, step_start: int) -> int | None:
        """Where the step open since `step_start` ends (exclusive) now that token `last` was
        computed, or None while it goes on. After "... 5." then " So" it ends before " So"."""
        if tokens[last] in self.closes:
            return last + 1
        if (
            last - 1 > step_start
            and tokens[last - 1] in self.sentence_end
            and tokens[last] in self.space_start
        ):
            return last
        return None


@dataclass
class Step:
    """A closed reasoning step of one branch: its tokens' bag, its length, its syntax trees and the
    blocks sealed while it was decoded (logical starts in the branch's own tokens)."""

    node: int
    start: int
    end: int
    bag: Counter[int]
    chars: int
    trees: list[ast.AST]
    blocks: list[int]


@dataclass
class Branch:
    """ReasonCache's bookkeeping of one branch node, kept across `extend` calls."""

    node: int
    question: int
    origin: int
    """Logical own-token index where block 0 starts (the node's KV before decoding is never shared)."""
    step_start: int
    steps: list[Step] = field(default_factory=list)
    shared: dict[int, Block] = field(default_factory=dict)
    """Logical block start → the block it now reads (its slots left the tail)."""
    sealed_tokens: int = 0
    """Tokens of the blocks this branch sealed as a source (they are still held, once)."""
    counted: tuple[int, int] = (0, 0)
    """(dense, saved) tokens already added to the run's statistics."""

    @property
    def saved(self) -> int:
        """Own KV tokens not held: shared blocks read in place of own copies, less those it holds."""
        return sum(b.tokens for b in self.shared.values()) - self.sealed_tokens

    def slot(self, logical: int) -> int:
        """Where own token `logical` sits in the row's own KV: shared blocks before it left the tail."""
        return logical - sum(b.tokens for s, b in self.shared.items() if s < logical)


@dataclass
class StepEnd:
    """Where a step closed: the batch, its rows whose KV it holds by node (`present`), and the row
    whose step it was (captured, its KV back in its node, when it closes its last step: `on_capture`)."""

    batch: Batch
    present: dict[int, tuple[int, Row]]
    pos: int
    row: Row
    branch: Branch


class ReasonCache(Acceleration):
    """The ReasonCache plug-in of one run (see the module docstring). Statistics (in `kv_stats`):
    `reasoncache_steps`, `reasoncache_blocks_sealed`, `reasoncache_stage1_steps` /
    `reasoncache_stage1_blocks` (candidate steps, and the new blocks that had a candidate block),
    `reasoncache_stage2_blocks` (admitted by the threshold), `reasoncache_blocks_reused`,
    `reasoncache_filter_s` (and `_ms_per_step`), `reasoncache_threshold` (the PAT distance threshold now; 0 in warm-up)
    and `reasoncache_amsr` (generated KV tokens not held thanks to sharing,
    over the generated KV a dense cache would hold, at the end of each batch)."""

    name = "reasoncache"
    config = ReasonCacheConfig

    def __init__(
        self,
        cfg: ReasonCacheConfig,
        tokenizer: PreTrainedTokenizerBase,
        boundaries: StepBoundaries,
        pat: PercentileThreshold,
        kv: KVEdits,
        stats: KVStats,
    ) -> None:
        self.cfg = cfg
        self.boundaries = boundaries
        self.kv = kv
        self.tree = kv.tree
        self.stats = stats
        self.branches: dict[int, Branch] = {}
        self.history: dict[int, list[Step]] = {}
        """Closed steps per question (root node id), in closing order."""
        self.pat = pat
        """The backend's PAT (shared by its runs): KV distances are a property of the model, so the
        warm-up is paid once per backend, as in the paper's serving system, not once per question."""
        self._norms: dict[int, dict[int, BlockNorms]] = {}
        """Squared norms per node and block start, computed once per block (the paper's cache)."""
        self._decode = cast(Callable[..., str], tokenizer.decode)  # one sequence of ids: one str
        self._rng = random.Random(cfg.seed)

    @classmethod
    def build(cls, cfg: ReasonCacheConfig, setup: Setup) -> ReasonCache:
        """Step boundaries (a pass over the vocabulary) and the PAT distances are per backend."""
        boundaries = setup.cached(
            "reasoncache", ("step_boundaries",), lambda: StepBoundaries.of(setup.tokenizer)
        )
        pat = setup.cached(
            "reasoncache",
            ("pat", cfg.block_tokens, cfg.percentile, cfg.warmup_blocks),
            lambda: PercentileThreshold(cfg.percentile, cfg.warmup_blocks),
        )
        return cls(cfg, setup.tokenizer, boundaries, pat, setup.host.kv, setup.host.stats)

    # ------------------------------------------------------------------ hooks
    def begin_decode(self, batch: Batch) -> None:
        for r in batch.rows:
            if r.seg.id not in self.branches:
                self.branches[r.seg.id] = Branch(
                    node=r.seg.id, question=_question(r.seg), origin=r.computed, step_start=r.computed
                )

    def after_step(
        self, batch: Batch, rows: Sequence[Row], feeds: Sequence[Sequence[int]], step: int
    ) -> None:
        """Close the steps the rows' new tokens ended. `rows` are the batch's, in batch order; one
        that ended may have been captured already (pages give an ended row's slots back at once),
        its node holding its KV, as a node outside the decode does."""
        present = {r.seg.id: (pos, r) for pos, r in enumerate(rows) if not r.captured}
        closing = []
        for pos, (r, fed) in enumerate(zip(rows, feeds, strict=True)):
            branch = self.branches.get(r.seg.id)
            if branch is not None and fed:
                end = self.boundaries.step_end(r.seg.tokens, r.computed - 1, branch.step_start)
                if end is not None:
                    closing.append((pos, r, end))
        self._close_steps(batch, present, closing)

    def on_capture(self, batch: Batch, pos: int, row: Row) -> None:
        """A branch that ended closes its last, open step when its KV goes back to its node, whenever
        that is (at once under pages, at a compaction or the batch's end under tails), so no branch
        leaves a step unclosed. The KV it shares from there is its node's, and it shares what
        nodes outside the batch and shared blocks hold (a row still decoding lends its node its
        KV only at its own capture). A branch still decoding (its batch re-assembled around a
        newcomer or a row back from a preemption) keeps its step open into its next batch."""
        if row.finish is not None:
            self._close_steps(batch, {}, [(pos, row, row.computed)])

    def _close_steps(
        self, batch: Batch, present: dict[int, tuple[int, Row]], closing: Sequence[tuple[int, Row, int]]
    ) -> None:
        """Close each step (batch position, row, end), timed; `present`: the rows whose KV the batch
        holds, by node."""
        ends = [
            (StepEnd(batch, present, pos, r, branch), end)
            for pos, r, end in closing
            if (branch := self.branches.get(r.seg.id)) is not None and end > branch.step_start
        ]
        if not ends:
            return
        start = time.perf_counter()
        for at, end in ends:
            self._close_step(at, end)
        self.stats.bump("reasoncache_filter_s", time.perf_counter() - start)

    def after_batch(self, batch: Batch, decoded: bool) -> None:
        """Add the batch's generated KV to the run's totals: dense tokens, and tokens not held."""
        for r in batch.rows:
            branch = self.branches.get(r.seg.id)
            if branch is None:
                continue
            dense, saved = r.computed - branch.origin, branch.saved
            self.stats.bump("reasoncache_dense_tokens", dense - branch.counted[0])
            self.stats.bump("reasoncache_saved_tokens", saved - branch.counted[1])
            branch.counted = (dense, saved)
        steps = self.stats.extra.get("reasoncache_steps", 0.0)
        if steps:
            filter_s = self.stats.extra.get("reasoncache_filter_s", 0.0)
            self.stats.extra["reasoncache_filter_ms_per_step"] = 1000 * filter_s / steps
        total = self.stats.extra.get("reasoncache_dense_tokens", 0.0)
        if total:
            self.stats.extra["reasoncache_amsr"] = self.stats.extra["reasoncache_saved_tokens"] / total

    def on_release(self, seg: Segment) -> None:
        self.branches.pop(seg.id, None)
        self._norms.pop(seg.id, None)

    # ------------------------------------------------------------------ steps
    def _close_step(self, at: StepEnd, end: int) -> None:
        """Record the step `branch.step_start .. end` and share the blocks sealed during it."""
        bs = self.cfg.block_tokens
        row, branch = at.row, at.branch
        start, branch.step_start = branch.step_start, end
        ids = row.seg.tokens[start:end]
        b = branch.origin + ((start - branch.origin) // bs) * bs
        blocks = []
        while b + bs <= end:
            if b + bs > start:  # sealed during this step
                blocks.append(b)
            b += bs
        text = self._decode(ids, skip_special_tokens=True)
        step = Step(
            node=branch.node,
            start=start,
            end=end,
            bag=Counter(ids),
            chars=len(text),
            trees=formal_trees(text) if self.cfg.structural else [],
            blocks=blocks,
        )
        self.stats.bump("reasoncache_steps")
        self.stats.bump("reasoncache_blocks_sealed", len(blocks))
        history = self.history.setdefault(branch.question, [])
        if blocks and history:
            if self.cfg.mode == "random":
                self._share_random(at, step, history)
            else:
                self._share_similar(at, step, history)
        history.append(step)

    def _candidates(self, step: Step, history: list[Step]) -> list[tuple[float, Step]]:
        """Stage 1: earlier steps whose similarity passes the dynamic τ (and, for formal steps,
        whose syntax trees match), most similar first."""
        sims = [lexical_similarity(step.bag, h.bag, step.chars, h.chars) for h in history]
        tau = dynamic_tau(sims, self.cfg.tau_strict, self.cfg.tau_soft)
        out = [
            (sim, h)
            for sim, h in zip(sims, history, strict=True)
            if sim > tau and h.blocks and (not self.cfg.structural or structurally_equal(step.trees, h.trees))
        ]
        return sorted(out, key=lambda x: -x[0])

    def _share_similar(self, at: StepEnd, step: Step, history: list[Step]) -> None:
        candidates = self._candidates(step, history)
        if not candidates:
            return
        self.stats.bump("reasoncache_stage1_steps", len(candidates))
        for i, block_start in enumerate(step.blocks):
            sources = [
                (cand.node, src)
                for _, cand in candidates
                for src in cand.blocks
                if self._available(at.present, cand.node, src)
            ]
            if not sources:
                continue
            self.stats.bump("reasoncache_stage1_blocks")
            if self.cfg.mode == "lexical":
                # the "only Cos" ablation: the block at the same place in the most similar step
                same_place = [(c.node, c.blocks[min(i, len(c.blocks) - 1)]) for _, c in candidates]
                usable = [(n, b) for n, b in same_place if self._available(at.present, n, b)]
                if usable:
                    self._share(at, block_start, *usable[0])
                continue
            mine = self._block_kv(at, at.branch.node, block_start)
            mine_norms = self._norms_of(at.branch.node, block_start, mine)
            best, best_d = sources[0], float("inf")
            for node, src in sources:
                theirs = self._block_kv(at, node, src)
                d = block_distance(mine, theirs, mine_norms, self._norms_of(node, src, theirs))
                if d < best_d:
                    best, best_d = (node, src), d
            admitted = self.pat.admit(best_d)
            self.stats.extra["reasoncache_threshold"] = self.pat.threshold() or 0.0
            if not admitted:
                continue
            self.stats.bump("reasoncache_stage2_blocks")
            self._share(at, block_start, *best)

    def _share_random(self, at: StepEnd, step: Step, history: list[Step]) -> None:
        """The paper's baseline: share each new block, with probability `random_rate`, with a
        uniformly chosen earlier sealed block of the same question."""
        pool = [(h.node, b) for h in history for b in h.blocks if self._available(at.present, h.node, b)]
        for block_start in step.blocks:
            if pool and self._rng.random() < self.cfg.random_rate:
                self._share(at, block_start, *self._rng.choice(pool))

    # ------------------------------------------------------------------ blocks
    def _available(self, present: dict[int, tuple[int, Row]], node: int, start: int) -> bool:
        """Whether a block can be a source: already a shared block, in a present row's tail, or in
        the KV of a node outside the decode (an earlier tree step, a finished branch)."""
        branch = self.branches.get(node)
        if branch is None:
            return False
        if start in branch.shared or node in present:
            return True
        seg = self.tree.find(node)
        return seg is not None and branch.slot(start) + self.cfg.block_tokens <= seg.kv_tokens

    def _block_kv(self, at: StepEnd, node: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys and values `[L, H, d, D]` (a transient stack of per-layer views)."""
        branch = self.branches[node]
        block = branch.shared.get(start)
        if block is not None:
            return torch.stack(block.keys), torch.stack(block.values)
        if node not in at.present:  # held in its node, outside the decode
            seg = self.tree.find(node)
            assert seg is not None and seg.keys is not None and seg.values is not None
            first = branch.slot(start)
            last = first + self.cfg.block_tokens
            return (
                torch.stack([t[:, first:last] for t in seg.keys]),
                torch.stack([t[:, first:last] for t in seg.values]),
            )
        pos, row = at.present[node]
        first = branch.slot(start)
        keys, values = at.batch.own_kv(pos, row, first, first + self.cfg.block_tokens)
        return torch.stack(keys), torch.stack(values)

    def _norms_of(self, node: int, start: int, kv: tuple[torch.Tensor, torch.Tensor]) -> BlockNorms:
        per_node = self._norms.setdefault(node, {})
        norms = per_node.get(start)
        if norms is None:
            norms = per_node[start] = BlockNorms.of(*kv)
        return norms

    def _share(self, at: StepEnd, block_start: int, src_node: int, src_start: int) -> None:
        """Make the closing row's block at `block_start` read the source block (sealed on first use)."""
        batch, branch = at.batch, at.branch
        if block_start in branch.shared:
            return
        source = self.branches[src_node]
        block = source.shared.get(src_start)
        if block is None:
            slot = source.slot(src_start)
            if src_node in at.present:
                src_pos, src_row = at.present[src_node]
                block = self.kv.seal_row(batch, src_pos, src_row, slot, src_start, self.cfg.block_tokens)
            else:  # its readers (if any) see the same KV, now through the block
                seg = self.tree.find(src_node)
                assert seg is not None
                block = self.kv.seal(seg, slot, src_start, self.cfg.block_tokens)
            source.shared[src_start] = block
            source.sealed_tokens += block.tokens
        if at.row.captured:  # it ended and its node holds its KV again (`on_capture`)
            self.kv.point_at(at.row.seg, branch.slot(block_start), block_start, block)
        else:
            self.kv.point_row_at(batch, at.pos, at.row, branch.slot(block_start), block_start, block)
        branch.shared[block_start] = block
        self._norms.get(branch.node, {}).pop(block_start, None)  # it reads the source's KV now
        self.stats.bump("reasoncache_blocks_reused")


def _question(seg: Segment) -> int:
    """The root node a branch descends from (KV or logical parents): branches of one question."""
    while True:
        up = seg.parent if seg.parent is not None else seg.logical_parent
        if up is None:
            return seg.id
        seg = up
