"""How one run's nodes are computed: pending tokens pushed through the layers in batches, and decoded.

Why apart from the session: the session is the `Backend` API of a run (tree operations, text,
budgets, statistics); this is the machinery under `extend`, `score_next` and a plug-in's
`Host.compute`: materialize a node's uncomputed ancestors, assemble the batch (`Batch`), run the
forward with the run's hooks (`Runner`), decode (`decode.decode`, with `Intake` letting rows join
and leave at step boundaries) and capture the rows' KV back into their nodes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

import torch

from branchwise.backends.base import (
    Admit,
    DecodeParams,
    DecodeStep,
    Generation,
    KVBudgetExceeded,
    KVStats,
    StepListener,
)
from branchwise.backends.compute_thread import COMPUTE
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.decode import DecodeRun, decode
from branchwise.backends.hf.engine import COPY_MIN_SEGMENTS, COPY_TOKENS, Engine
from branchwise.backends.hf.hooks import Acceleration, overrides
from branchwise.backends.hf.intake import Intake, alone_chunk, policy_of
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.pool import BatchRefused
from branchwise.backends.hf.segment import Segment
from branchwise.backends.hf.step import is_decode_step
from branchwise.backends.hf.step_attention import Chunk
from branchwise.backends.step_notes import OFF_FAST, OFF_FAST_BY, off_fast_delta, step_notes
from branchwise.constraints import Constraint


class Computation:
    """The computing half of one run: its engine, its plug-ins (the hooks every forward calls), and
    the statistics and ledger its forwards count into."""

    def __init__(self, engine: Engine, plugins: list[Acceleration], stats: KVStats, ledger: Ledger) -> None:
        self.engine = engine
        self.tree = engine.tree
        self.parts = engine.parts
        self.device = engine.device
        self.plugins = plugins
        self.stats = stats
        self.ledger = ledger
        self._carried: Batch | None = None
        """A chunk of prefill the next decode step computes beside its rows (`carry_part`)."""
        self.exact_kv = not plugins
        """Whether this run's KV is what exact recompute gives. Conservative: any acceleration may
        approximate or evict KV (River, SkipKV, RSBCM, ASKS), so a run with one neither inserts its
        nodes into the prefix cache nor matches from it."""

    def row_kv_tokens(self, max_tokens: int) -> int:
        """Own KV tokens a row of this run holds at most while decoding `max_tokens` (the tightest
        cap of its accelerations; `KVPool` reserves this much per row)."""
        return min((p.row_kv_tokens(max_tokens) for p in self.plugins), default=max_tokens)

    def compute(self, segs: Sequence[Segment], observers: Sequence[Acceleration] = ()) -> None:
        """Compute the pending tokens of `segs` (ancestors first), watched by `observers`."""
        self.run(segs, None, observers)

    def compute_part(self, seg: Segment, limit: int) -> None:
        """Compute the next `limit` pending tokens of `seg` (its ancestors are computed) in a forward
        of their own: one chunk of a chunked prefill. Only for runs without accelerations (their
        hooks see whole prompts)."""
        part = self._part(seg, limit)
        self._end_part(part, self.forward(part, part.feeds)[0])

    def carry_part(self, seg: Segment, limit: int) -> bool:
        """Let the next decode step compute the next `limit` pending tokens of `seg` in its own
        forward (`step.Chunk`: every weight read once for both, where a chunk in a forward of its
        own reads them all again). False where a step cannot carry it (steps through the layer
        loop): the caller computes it now (`compute_part`). A chunk no step took is computed by the
        next forward of another batch, or by `flush_part`."""
        if self.engine.stepper.runs == "layers" or self.plugins:
            return False
        self.flush_part()
        self._carried = self._part(seg, limit)
        return True

    def flush_part(self) -> None:
        """Compute the chunk handed to a decode step that did not take it (none: nothing to do)."""
        part, self._carried = self._carried, None
        if part is not None:
            self._end_part(part, self.forward(part, part.feeds)[0])

    def _part(self, seg: Segment, limit: int) -> Batch:
        """The batch of one chunk of `seg`'s pending tokens (ancestors computed first). Its tail
        holds a copy of what `seg` computed before, so the node lends it (`KVTree.lend`) until the
        chunk is captured back: held twice, a long prompt's earlier chunks took the budget's room a
        second time (the KV a waiting row was priced at, `Intake._join_cost`, counts them once)."""
        self.materialize_ancestors([seg])
        engine = self.engine
        batch = Batch.assemble(
            [seg],
            0,
            self.parts,
            engine.dtype,
            self.device,
            engine.broadcast,
            limit=limit,
            reserve=functools.partial(engine.pool.reserve_tails, moving=seg.kv_bytes),
        )
        if seg.keys is not None:
            self.tree.lend(seg)
        engine.pool.track(batch.ctx)
        return batch

    def _end_part(self, part: Batch, logits: torch.Tensor) -> None:
        """A chunk's tokens are computed: its KV goes back into its node, with the logits after its
        last token where that was the prompt's last."""
        part.advance([0], part.feeds)
        if not part.hand_over(self.tree, part.rows[0]):
            part.capture(self.tree, 0, part.rows[0])
        seg = part.rows[0].seg
        seg.last_logits = None if seg.pending else logits.detach().clone()
        self.stats.bump("prefill_chunks")

    def materialize_ancestors(self, segs: Sequence[Segment]) -> None:
        """Compute pending tokens of shared ancestors, top-down, batching those at the same depth."""
        while True:
            todo: dict[int, Segment] = {}
            for seg in segs:
                for anc in seg.kv_ancestors():
                    if anc.pending:
                        todo[anc.id] = anc
            if not todo:
                return
            ready = [a for a in todo.values() if not any(x.id in todo for x in a.kv_ancestors())]
            self.run(ready, None)

    def assemble(
        self,
        segs: Sequence[Segment],
        extra: int,
        lend: bool = False,
        refuse: bool = False,
        caps: Sequence[int] | None = None,
    ) -> Batch:
        """The batch of `segs` with `extra` free slots per row; with `lend`, the rows' nodes lend
        their own KV to its tails once copied (`KVTree.lend`: a decode batch, which captures every
        row back), so the tails' reservation counts those bytes as moving, not added. Storage
        that does not fit the budget is refused (`BatchRefused`) when it has free slots ahead,
        or with `refuse`; else let through and counted (`KVPool.reserve_tails`). `caps` (a decode
        batch's: the most KV each row may hold) bound how its tails grow, set before the plug-ins
        see the batch (`on_batch`), so they know what it may come to."""
        engine = self.engine
        # many short ancestors (many requests' prompts) are copied into the rows' tails
        # (`Batch.assemble`); with an acceleration on, every ancestor stays a shared segment, the
        # layout its hooks observe
        copy_tokens = 0
        if not self.plugins and len({a.id for s in segs for a in s.kv_ancestors()}) > COPY_MIN_SEGMENTS:
            copy_tokens = COPY_TOKENS
        batch = Batch.assemble(
            segs,
            extra,
            self.parts,
            engine.dtype,
            self.device,
            engine.broadcast,
            copy_tokens,
            layout=engine.kv_layout,
            # free slots ahead are refused where they would not fit (`KVPool.reserve_tails`)
            reserve=functools.partial(
                engine.pool.reserve_tails,
                refusable=extra > 0 or refuse,
                moving=sum(s.kv_bytes for s in segs) if lend else 0,
            ),
        )
        if lend:  # rows with nothing computed yet too: their KV will live in the batch alone
            for seg in segs:
                if seg.keys is not None or not seg.n_computed:
                    self.tree.lend(seg)
        engine.pool.track(batch.ctx)
        if caps is not None:
            # the tails grow for every row at once: by no more than a row may hold at once, and not
            # past what the longest may need (128 slots for each of 166 SkipKV rows capped at 16
            # once asked 1 GB of a 0.75 GB budget)
            batch.caps = list(caps)
            batch.ctx.grow_min = max(extra, 1)
            batch.ctx.grow_limit = max(
                r.tail_start + r.kv_len + len(f) + cap + 1
                for r, f, cap in zip(batch.rows, batch.feeds, caps, strict=True)
            )
        try:
            for plugin in overrides(self.plugins, "on_batch"):
                plugin.on_batch(batch)
        except BaseException:
            self.abandon(batch)
            raise
        return batch

    def abandon(self, batch: Batch) -> None:
        """A batch ended abnormally (its call raised): its tails go now (the error's traceback must
        not keep them allocated and counted), and the rows it did not capture, whose KV went with
        them, compute their tokens again on next use (`KVTree.reclaim`)."""
        self.engine.pool.end(batch.ctx)
        for r in batch.rows:
            self.tree.reclaim(r.seg)

    def forward(
        self, batch: Batch, feeds: Sequence[Sequence[int]], observers: Sequence[Acceleration] = ()
    ) -> torch.Tensor:
        stepper = self.engine.stepper
        transient = batch.ctx.nbytes
        if stepper.applies(batch.ctx, feeds, self.plugins, observers):
            part, self._carried = self._carried, None
            chunk = None if part is None else Chunk(part.ctx, part.feeds[0])
            try:
                logits = stepper.forward(batch.ctx, feeds, chunk)
            except BaseException:
                if part is not None:  # its tokens stay pending; its tails go now
                    self.abandon(part)
                raise
            self.stats.bump("decode_steps_captured" if stepper.replayed else "decode_steps_fixed")
            self._count_compiled_step(chunk is not None)
            self._count_off_fast(stepper.shortfall(chunk is not None))
            if part is not None:
                assert chunk is not None and chunk.logits is not None  # the step computed it
                self._end_part(part, chunk.logits)
                self.stats.bump("decode_steps_carrying_prefill")
                self.stats.tokens_computed += len(chunk.ids)
                transient += part.ctx.nbytes
        else:
            self.flush_part()  # a chunk handed to this step goes first, in its own forward
            logits = self.engine.runner.forward(batch.ctx, feeds, self.plugins, observers)
            if is_decode_step(feeds):
                self._count_layer_loop_step(batch, observers)
                self._count_off_fast(stepper.loop_reasons(batch.ctx, self.plugins, observers))
        self.stats.tokens_computed += sum(len(f) for f in feeds)
        self.stats.forward_calls += 1
        self.tree.accounts.note_transient(self.ledger, transient)
        return logits

    def _count_off_fast(self, reasons: Sequence[str]) -> None:
        """A decode step left the fast step for `reasons` (none: it did not): counted once, and
        under each reason, so every front's notes say so (`step_notes`)."""
        if not reasons:
            return
        self.stats.bump(OFF_FAST)
        for why in reasons:
            self.stats.bump(f"{OFF_FAST_BY}{why}")

    def _count_compiled_step(self, carried: bool) -> None:
        """Where steps are compiled (`decode_step="compiled"`): whether this one was, and why not
        where it was not (its kind compiling in the background, a compilation that failed):
        `Accel.notes` says so. A step carrying a prefill chunk runs uncompiled by design (its
        length varies) and is counted as carrying one, not here."""
        compiler = self.engine.stepper.compiler
        if compiler is None or carried:
            return
        if self.engine.stepper.compiled:
            self.stats.bump("decode_steps_compiled")
        else:
            self.stats.bump("decode_steps_uncompiled")
            why = self.engine.stepper.unused
            self.stats.extra[f"uncompiled_by {why}"] = 1.0

    def _count_layer_loop_step(self, batch: Batch, observers: Sequence[Acceleration]) -> None:
        """A decode step ran through the layer loop. Where steps are captured as CUDA graphs and a
        plug-in kept this one off them, the run's notes say so and name it (`Accel.notes`)."""
        self.stats.bump("decode_steps_layer_loop")
        stepper = self.engine.stepper
        if stepper.captures_graphs:
            self.stats.bump("decode_steps_uncaptured")
            for name in stepper.blockers(batch.ctx, self.plugins, observers):
                self.stats.extra[f"uncaptured_by {name}"] = 1.0

    def _capture(self, batch: Batch) -> Callable[[int, Row], None]:
        capturers = overrides(self.plugins, "on_capture")

        def capture(pos: int, row: Row) -> None:
            if row.seg.id not in self.tree or row.seg.cached:
                return  # released mid-call by its ended request: freed (its KV would be held by nobody) or cached
            batch.capture(self.tree, pos, row)
            for plugin in capturers:
                plugin.on_capture(batch, pos, row)

        return capture

    def run(
        self,
        segs: Sequence[Segment],
        params: DecodeParams | None,
        observers: Sequence[Acceleration] = (),
        on_step: StepListener | None = None,
        admit: Admit | None = None,
        constraints: Sequence[Constraint | None] | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]:
        """Compute pending tokens of `segs` and, with `params`, decode them as one batch.

        `observers` watch the pending-token forward (they must not exit rows: their KV is kept);
        `on_step` is told each decode step's tokens (`Backend.extend`). With `admit`, nodes it hands
        in between steps join the decode: the batch is re-assembled from the rows still decoding
        and the new ones (`decode.DecodeRun` keeps each row's state across batches).
        """
        if params is None:
            self._batch(segs, None, observers)
            return []
        before = dict(self.stats.extra)
        if on_step is not None:
            on_step = self._noting(on_step, before)
        gens, waits = self._decode(segs, params, observers, on_step, admit, constraints, row_params)
        notes = step_notes(off_fast_delta(before, self.stats.extra)) + waits
        for g in gens:  # said once per reply, on every front (`Generation.notes`)
            g.notes = list(notes)
        return gens

    def _noting(self, on_step: StepListener, before: dict[str, float]) -> StepListener:
        """`on_step`, with each row that ends given the notes of the steps so far (the call's
        whole notes replace them when it returns): a streamed reply ends before its decode call
        does, and its last chunk says what a whole reply would."""

        def told(step: DecodeStep) -> Collection[int] | None:
            if step.finished:
                notes = step_notes(off_fast_delta(before, self.stats.extra))
                for g in step.finished.values():
                    g.notes = list(notes)
            return on_step(step)

        return told

    def _decode(
        self,
        segs: Sequence[Segment],
        params: DecodeParams,
        observers: Sequence[Acceleration],
        on_step: StepListener | None,
        admit: Admit | None,
        constraints: Sequence[Constraint | None] | None,
        row_params: Sequence[DecodeParams | None] | None,
    ) -> tuple[list[Generation], list[str]]:
        """`run`'s decode: `segs` as one batch, joined by what `admit` hands in between steps; with
        its generations, what its constrained rows waited for (`RowGrammars.notes`)."""
        run = DecodeRun.start(
            params,
            segs,
            eos_ids=self.engine.eos_ids,
            detokenize=self.engine.decode,
            device=self.device,
            on_step=on_step,
            grammars=self.engine.grammars,
            constraints=constraints,
            row_params=row_params,
        )
        # A run with accelerations computes prompts whole (their hooks observe a prompt's prefill in
        # one forward); its preempted rows are swapped where an acceleration changes KV (`intake.py`).
        accelerated = bool(self.plugins)
        intake = Intake(
            self,
            run,
            admit,
            pool=self.engine.pool,
            chunk=0 if accelerated else self.engine.prefill_chunk,
            policy=policy_of(self.plugins),
            pace=self.engine.pace,
        )
        run.boundary = intake
        segs = intake.start(segs)
        try:
            while True:
                if not segs:
                    segs = intake.next_ready()
                    if not segs:
                        break
                # under pages, rows are admitted by what they hold (`KVPool.row_slots`): a batch
                # that does not fit is refused while rows join it, and they wait (`hold_back`)
                refuse = self.engine.pool.page is not None and intake.joins(segs)
                try:
                    batch, start = self._batch(segs, params, observers, run, refuse)
                except BatchRefused:  # the youngest joining row waits until the batch fits
                    segs = intake.hold_back(segs)
                    continue
                capture = self._capture(batch)
                intake.batch, intake.capture = batch, capture
                admitted = decode(
                    batch,
                    torch.stack(start),
                    run,
                    forward=functools.partial(self.forward, batch),
                    capture=capture,
                    hooks=self.plugins,
                    device=self.device,
                )
                for plugin in overrides(self.plugins, "after_batch"):
                    plugin.after_batch(batch, True)
                segs = [r.seg for r in batch.rows if r.finish is None and not r.preempted]
                segs += [self.tree.get(n) for n in admitted]
                self.engine.stepper.forget(batch.ctx)
                intake.batch = intake.capture = None  # the old tails go before the next batch's are reserved
                del batch, capture
                observers = ()
        finally:
            if intake.batch is not None:  # the call raised mid-batch
                self.abandon(intake.batch)
            if self._carried is not None:  # a chunk no step took: its tokens stay pending
                self.abandon(self._carried)
                self._carried = None
            self.engine.stepper.forget()
            intake.finish()
        return run.generations(), [] if run.grammar is None else run.grammar.notes

    def _batch(
        self,
        segs: Sequence[Segment],
        params: DecodeParams | None,
        observers: Sequence[Acceleration],
        run: DecodeRun | None = None,
        refuse: bool = False,
    ) -> tuple[Batch, list[torch.Tensor]]:
        """Compute the pending tokens of `segs` (ancestors first) and assemble their batch; returns it
        with each row's next-token logits. Without `params` the rows' KV goes back into their nodes
        at once (a prefill), each with its logits. With `refuse`, a batch over the KV budget is
        refused (`BatchRefused`), not let through (`assemble`)."""
        self.materialize_ancestors(segs)
        chunk = 0 if self.plugins else alone_chunk(self.engine.prefill_chunk)
        for seg in segs if chunk else ():
            while len(seg.pending) > chunk:  # a long prompt: its attention's memory stays bounded
                COMPUTE.check()
                self.compute_part(seg, chunk)
        if not self.exact_kv:
            for seg in segs:
                seg.exact = False
        # Rows with a prompt to compute beside rows with at most one token (decoding rows, or rows
        # that reuse a computed prompt): prefill those first, on their own. One mixed forward would
        # pad every row's feed to the longest prompt, computing that many dummy tokens per row and
        # giving every row's tail room for its length plus that prompt's (a newcomer's prompt of
        # 139 tokens beside four decoding rows once asked for twice the KV the rows held). E.g.
        # continuous batching with whole prompts, ASKS's rejected branches beside reused ones.
        prompts = [s for s in segs if len(s.pending) > 1]
        if params is not None and prompts and len(prompts) < len(segs):
            self._batch(prompts, None, observers)
        extra, caps = 0, []
        if params is not None:
            # the most KV each row may hold (its max_tokens, or an eviction policy's cap); no more
            # free slots than the largest, nor than admission prices (`KVPool.slack`): a capped row
            # never fills more
            caps = [
                self.row_kv_tokens(run.params_of(s).max_tokens if run is not None else params.max_tokens)
                for s in segs
            ]
            extra = self.engine.pool.slack(caps)
        # every row is captured back: a decode batch's when it leaves, a prefill's at once. Lent, a
        # row's computed KV is held once while its tail holds the copy (a long prompt's last chunk
        # once held the prompt twice, over the budget its admission priced); a prefill with
        # accelerations keeps it in the node, where their hooks may read it
        lend = params is not None or not self.plugins
        try:
            batch = self.assemble(segs, extra, lend, refuse, caps if params is not None else None)
        except KVBudgetExceeded:
            if refuse or not extra:
                raise
            # no free slots ahead: the tails grow as rows do
            batch = self.assemble(segs, 0, lend, caps=caps if params is not None else None)
        try:
            return self._first_forward(batch, params, observers)
        except BaseException:
            self.abandon(batch)
            raise

    def _first_forward(
        self,
        batch: Batch,
        params: DecodeParams | None,
        observers: Sequence[Acceleration],
    ) -> tuple[Batch, list[torch.Tensor]]:
        """`_batch`'s second half: compute the rows' pending tokens in the assembled batch (a
        prefill batch's rows are captured back at once, each with its logits)."""
        segs = [r.seg for r in batch.rows]
        feeds = batch.feeds
        logits = None
        if any(feeds):
            logits = self.forward(batch, feeds, observers)
        batch.advance(range(len(segs)), feeds)
        for plugin in overrides(self.plugins, "after_pending"):
            plugin.after_pending(batch, feeds)
        start = []
        for i, (r, f) in enumerate(zip(batch.rows, feeds, strict=True)):
            if f:
                assert logits is not None
                start.append(logits[i])
            else:
                source = r.seg if r.seg.n_computed else r.seg.parent
                assert source is not None and source.last_logits is not None
                start.append(source.last_logits)
        if params is None:
            capture = self._capture(batch)
            for i, r in enumerate(batch.rows):
                if self.plugins or len(batch.rows) > 1 or not batch.hand_over(self.tree, r):
                    capture(i, r)
                r.seg.last_logits = start[i].detach().clone()
            for plugin in overrides(self.plugins, "after_batch"):
                plugin.after_batch(batch, False)
        return batch, start
