"""The decode loop: sample a token per row, check stops, feed the tokens back, drop finished rows.

Why its own module: this is where a token gets sampled (`sampling.pick_tokens`) and where a branch
ends (EOS, a stop string, the step delimiter, max_tokens, a tool call repeating one the row made
already, or an acceleration's `stop_reason`). It owns no KV: `forward` (the runner, bound to the
run's `Computation`) and `capture` (copy a row's KV back into its node) are passed in, so this loop
reads as what it is. A step is five named parts, in order: `_pick` (sampling, with the grammar's
mask and each row's own parameters), `_append` (each row takes its token and is checked for its
stops), `_ask_stoppers` (accelerations that may end the batch), `_at_boundary` (the intake's
preemptions and admissions) and `_compact` (ended rows leave the batch); then the forward.

Stop checks are incremental: each row keeps a running detokenization (`TextTail`) that decodes only
the last few tokens per step, instead of re-decoding the row's whole output every step (quadratic
in the output length). A row's final text is one full decode, cut by the same rules as always.

Streaming: an optional `on_step` listener is handed each step's new tokens and the rows that ended
(their final `Generation`), and may name rows to stop (their consumer left). It is one `if` per
step when absent; the listener does the detokenizing for its own consumers, off this thread.

At each step boundary the loop asks the call's `Boundary` (the session's intake, `intake.Intake`),
one object with three questions, the same each step.

Continuous batching: `Boundary.admit` is asked for new nodes to decode in the same call. When it
hands some in, this loop stops there as if the batch had ended for now (rows' KV captured into their
nodes, their sampled-but-unfed token left pending) and the run's `Computation` assembles one batch
of the rows still decoding and the new ones; `DecodeRun` carries each row's tokens, stop state and
index across those batches, so a row's result does not depend on when others joined (beyond the
batch composition every batched decode already has).

The KV budget: `Boundary.pressure` names rows to preempt at a step boundary (`Boundary.preempt` is
told each one while its KV is still in the batch); they leave the batch at once, uncaptured (their
KV is dropped by the `Computation` and recomputed when they rejoin, through the same re-assembly as
admitted rows), and keep their tokens in `DecodeRun.carried`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from branchwise.backends.base import (
    DecodeParams,
    DecodeStep,
    FinishReason,
    Generation,
    NodeId,
    StepListener,
)
from branchwise.backends.compute_thread import COMPUTE
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.grammar import Grammars
from branchwise.backends.hf.grammar_rows import RowGrammars
from branchwise.backends.hf.hooks import Acceleration, overrides
from branchwise.backends.hf.sampling import pick_tokens
from branchwise.backends.hf.segment import Segment
from branchwise.backends.text import Detokenize, TextTail, finish_text
from branchwise.constraints import Constraint
from branchwise.toolcalls import TOOL_CALL_CLOSE, repeats_a_call

__all__ = ["DecodeRun", "StopCheck", "TextTail", "decode", "finish_text"]

ForwardFn = Callable[[Sequence[Sequence[int]]], torch.Tensor]
CaptureFn = Callable[[int, Row], None]


class Boundary(Protocol):
    """What the decode loop asks at each step boundary; `intake.Intake` answers (the KV budget,
    chunked prefill, the scheduler's newcomers), so the loop knows nothing of either."""

    def pressure(self, alive: list[Row]) -> list[Row]:
        """Of the rows still decoding, those to preempt now (they leave the batch; the loop does
        not capture their KV)."""
        ...

    def preempt(self, pos: int, row: Row) -> None:
        """A preempted row at batch position `pos`, while its KV is still in the batch."""
        ...

    def admit(self, alive: int) -> Sequence[NodeId]:
        """Given how many rows still decode, the nodes that join now (the loop then stops at this
        boundary so the batch is re-assembled with them)."""
        ...


class StopCheck:
    """Per-row stop detection for one `extend` call (see the module docstring); rows are known by
    their segment, so a row keeps its running text when continuous batching re-assembles the batch."""

    def __init__(self, params: DecodeParams, eos_ids: set[int], detokenize: Detokenize) -> None:
        self.params = params
        self.eos_ids = eos_ids
        self._detokenize = detokenize
        self._tails: dict[int, TextTail] = {}
        self.own: dict[int, DecodeParams] = {}
        """Rows (by segment) that decode with their own parameters instead of the call's."""
        self.calls: dict[int, tuple[dict[str, Any], ...]] = {}
        """Rows (by segment) decoding tool calls that may be several (``parallel_tool_calls``): the
        tools. A call identical to an earlier one of the row ends it (`toolcalls.repeats_a_call`)."""

    def watch_calls(self, seg_id: int, constraint: Constraint | None) -> None:
        """Stop the row of `seg_id` at a repeated call when `constraint` allows several calls."""
        if constraint is not None and constraint.kind == "tool_calls" and constraint.parallel_tool_calls:
            self.calls[seg_id] = constraint.tools

    def of(self, row: Row) -> DecodeParams:
        """The decoding parameters of `row`."""
        return self.own.get(row.seg.id, self.params)

    def check(self, row: Row) -> FinishReason | None:
        """The row just appended a token: say whether (and why) it is done, and set its text then."""
        if row.out[-1] in self.eos_ids:
            row.text = self._detokenize(row.out)
            return "eos"
        params = self.of(row)
        tools = self.calls.get(row.seg.id)
        if params.stop or params.step_delimiter or tools is not None:
            tail = self._tails.get(row.seg.id)
            if tail is None:
                tail = self._tails[row.seg.id] = TextTail(self._detokenize)
            seen = len(tail.text)
            tail.push(row.out[-1])
            if finish_text(tail.text, params)[1] is not None:
                # confirm on the full text, exactly the rule the final text is cut by
                text, reason = finish_text(self._detokenize(row.out), params)
                if reason is not None:
                    row.text = text
                    return reason
            if (
                tools is not None
                and TOOL_CALL_CLOSE in tail.text[max(0, seen - len(TOOL_CALL_CLOSE)) :]
                and repeats_a_call(text := self._detokenize(row.out), tools)
            ):
                # a block just closed on a call the row made already: a small model under
                # parallel_tool_calls repeats its call until max_tokens. The row ends here; the
                # text keeps the repeat (what was decoded, what a stream has seen) and every
                # reader of calls drops it (`toolcalls.parse_tool_calls`).
                row.text = text
                return "stop"
        if len(row.out) >= params.max_tokens:
            row.text = self._detokenize(row.out)
            return "length"
        return None

    def settle(self, row: Row) -> None:
        """Text of a row stopped from outside (an acceleration's stop, or the loop ending)."""
        row.text = self._detokenize(row.out)


@dataclass(eq=False)
class DecodeRun:
    """One `extend` call's decoding state, kept across the batches continuous batching assembles.

    `rows` maps a row's segment to its index in the call (the nodes given to `extend` first, then
    admitted ones in the order they joined): the index its `DecodeStep`s and its `Generation` use.
    A row still decoding when the batch is re-assembled leaves its `Row` (tokens, log-probs) in
    `carried`; the next batch's row for the same segment takes it over.
    """

    params: DecodeParams
    stops: StopCheck
    generator: torch.Generator | None
    on_step: StepListener | None = None
    boundary: Boundary | None = None
    """Asked at each step boundary (the session's intake, set once it is built; None when the call
    has ended)."""
    rows: dict[int, int] = field(default_factory=dict)
    carried: dict[int, Row] = field(default_factory=dict)
    results: dict[int, Generation] = field(default_factory=dict)
    step: int = 0
    """Decode steps so far, over every batch of the call (what step hooks are told)."""
    grammar: RowGrammars | None = None
    """The constrained rows' matchers (`grammar.py`); None when the call has no constraint at all."""
    stopped: set[int] = field(default_factory=set)
    """Segments of preempted rows that `on_step` stopped while they waited outside the batch (a
    cancelled request): they ended as cancelled, and the intake lets them go instead of back in."""
    dropped: set[int] = field(default_factory=set)
    """Indices of rows `on_step` stopped that were neither in the batch nor preempted: rows waiting
    in the intake to join (prefilling, or ready). The intake lets them go (`end_waiting`)."""

    @classmethod
    def start(
        cls,
        params: DecodeParams,
        segs: Sequence[Segment],
        *,
        eos_ids: set[int],
        detokenize: Detokenize,
        device: torch.device,
        on_step: StepListener | None = None,
        grammars: Grammars | None = None,
        constraints: Sequence[Constraint | None] | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> DecodeRun:
        """`constraints` (one per node of `segs`) override `params.constraint` row by row; rows
        admitted later follow their own parameters' constraint (`join`). `grammars` compiles them
        (needed when any is set)."""
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device).manual_seed(params.seed)
        run = cls(params, StopCheck(params, eos_ids, detokenize), gen, on_step)
        if grammars is not None:
            run.grammar = RowGrammars(grammars)
        elif params.constraint is not None or (constraints and any(c is not None for c in constraints)):
            raise ValueError("constraint: this backend was built without a grammar engine")
        run.join(segs, constraints, row_params)
        return run

    def join(
        self,
        segs: Sequence[Segment],
        constraints: Sequence[Constraint | None] | None = None,
        params: Sequence[DecodeParams | None] | None = None,
    ) -> None:
        """Number `segs` after the rows already in the call. `params` (one per node, optional) lets
        rows decode with their own parameters (their own max_tokens, stops, temperature, top-p and
        constraint: requests of a server that share one decode); `constraints` overrides only the
        constraint (see `start`)."""
        for name, given in (("constraints", constraints), ("params", params)):
            if given is not None and len(given) != len(segs):
                raise ValueError(f"{name} has {len(given)} entries for {len(segs)} nodes")
        for i, seg in enumerate(segs):
            self.rows[seg.id] = len(self.rows)
            own = None if params is None else params[i]
            if own is not None and own != self.params:
                self.stops.own[seg.id] = own
            row_params = own or self.params
            constraint = row_params.constraint if constraints is None else constraints[i]
            self.stops.watch_calls(seg.id, constraint)
            if self.grammar is not None:
                self.grammar.attach(seg.id, constraint, row_params.max_tokens)

    def hold(self, seg: Segment) -> None:
        """The row of `seg` waits outside the batch before its first step (`Intake.start`): carried
        as a preempted row, so a listener stops it as it stops any waiting row."""
        self.carried[seg.id] = Row(seg=seg, kv_len=seg.kv_tokens, computed=seg.n_computed, preempted=True)

    @property
    def mixed(self) -> bool:
        """Whether some rows decode with their own parameters."""
        return bool(self.stops.own)

    def params_of(self, seg: Segment) -> DecodeParams:
        return self.stops.own.get(seg.id, self.params)

    def poll(self) -> None:
        """Ask `on_step` which rows to stop while no decode step runs (an empty step: between the
        prefill chunks of an idle batch), so a request cancelled then stops before its next chunk."""
        if self.on_step is not None:
            drop = self.on_step(DecodeStep({}, {}))
            if drop:
                _stop(self, [], [], drop)

    def end_waiting(self, seg: Segment) -> None:
        """The row of `seg` was stopped before it decoded a token: it ends cancelled, empty."""
        index = self.rows[seg.id]
        self.results.setdefault(
            index,
            Generation(
                node=seg.id, token_ids=[], text="", top1_probs=[], logprobs=[], finish_reason="cancelled"
            ),
        )

    def generations(self) -> list[Generation]:
        """Every row's `Generation`, in row order."""
        return [self.results[i] for i in range(len(self.rows))]


def decode(
    batch: Batch,
    logits: torch.Tensor,
    run: DecodeRun,
    *,
    forward: ForwardFn,
    capture: CaptureFn,
    hooks: Sequence[Acceleration],
    device: torch.device,
) -> list[NodeId]:
    """Decode the rows of `batch` from `logits` (the distribution after each row's last token).

    Returns the nodes `run.boundary` admitted (continuous batching): the loop then stops at that step
    boundary with every row's KV captured, rows still decoding in `run.carried`, and the caller
    assembles a new batch of those rows and the new nodes. Returns [] once every row has ended
    (each row's `Generation` is in `run.results`).

    `run.on_step` (see `StepListener`) is told each step's tokens and finished rows; rows it returns
    stop at once. Without it, the loop does no per-step work for it.
    """
    rows = batch.rows
    for r in rows:
        old = run.carried.pop(r.seg.id, None)
        if old is not None:
            r.out, r.top1, r.logprobs = old.out, old.top1, old.logprobs
    stoppers = overrides(hooks, "stop_reason")
    before_step = overrides(hooks, "before_step")
    after_step = overrides(hooks, "after_step")
    for hook in overrides(hooks, "begin_decode"):
        hook.begin_decode(batch)
    eos = torch.tensor(sorted(run.stops.eos_ids), device=device, dtype=torch.long)
    present = list(range(len(rows)))  # batch position -> row index
    stepping = present  # rows that append a token this step
    admitted: list[NodeId] = []
    while True:
        COMPUTE.check()  # a caller interrupted while it waits stops the decode here
        picked = _pick(logits, run, rows, present, eos)
        _append(run, rows, present, picked)
        alive = _ask_stoppers(run, rows, present, stoppers)
        if run.on_step is not None:
            if picked.stuck:  # a row that ended without a token reports none this step
                ended = {present[pos] for pos in picked.stuck}
                stepping = [ri for ri in stepping if ri not in ended]
            alive = _report(run, rows, stepping, alive)
        step = run.step
        run.step += 1
        if not alive:
            break
        alive, evict, admitted = _at_boundary(run, batch, present, alive, capture)
        if admitted:
            break
        dead = len(present) - len(alive)
        if evict or (dead and dead * 4 >= len(present)):  # compact: ended rows leave the batch
            present = _compact(batch, present, alive, capture, device)
        feeds = [[rows[ri].out[-1]] if rows[ri].finish is None else [] for ri in present]
        for hook in before_step:
            hook.before_step(batch, [rows[ri] for ri in present])
        logits = forward(feeds)
        batch.advance(present, feeds)
        for hook in after_step:
            hook.after_step(batch, [rows[ri] for ri in present], feeds, step)
        stepping = alive
    for pos, ri in enumerate(present):
        if not rows[ri].captured and not rows[ri].preempted:
            capture(pos, rows[ri])
    for r in rows:
        # the last sampled token was not fed; its KV is computed on the node's next use
        r.seg.last_logits = None
        if r.finish is None:
            run.carried[r.seg.id] = r
        else:
            run.results.setdefault(run.rows[r.seg.id], _generation(r))
    return admitted


@dataclass(frozen=True)
class _Picked:
    """One step's sampled tokens by batch position, and the positions whose grammar admits none."""

    logits: torch.Tensor
    """What they were sampled from (end of sequence held back for rows below `min_tokens`)."""
    tokens: list[int]
    top1: list[float]
    logprobs: list[float]
    stuck: set[int]


def _pick(
    logits: torch.Tensor, run: DecodeRun, rows: Sequence[Row], present: list[int], eos: torch.Tensor
) -> _Picked:
    """Sample a token per row: end of sequence held back below a row's `min_tokens`, the grammar's
    mask at the sampling stage (the statistics stay the model's own distribution), each row's own
    temperature and top-p where rows have their own parameters."""
    stops = run.stops
    early = [pos for pos, ri in enumerate(present) if len(rows[ri].out) < stops.of(rows[ri]).min_tokens]
    if early and eos.numel():
        logits = logits.clone()
        logits[torch.tensor(early, device=logits.device).unsqueeze(1), eos] = float("-inf")
    allowed, stuck = logits, set[int]()
    if run.grammar:
        allowed, stuck = run.grammar.mask(logits, [rows[ri].seg.id for ri in present])
    temperature: float | torch.Tensor = run.params.temperature
    top_p: float | torch.Tensor = run.params.top_p
    if run.mixed:  # rows with their own sampling parameters
        own = [stops.of(rows[ri]) for ri in present]
        temperature = torch.tensor([p.temperature for p in own], device=logits.device)
        top_p = torch.tensor([p.top_p for p in own], device=logits.device)
    tokens, top1, chosen = pick_tokens(logits, temperature, top_p, run.generator, allowed)
    return _Picked(logits, tokens.tolist(), top1.tolist(), chosen.tolist(), stuck)


def _append(run: DecodeRun, rows: Sequence[Row], present: list[int], picked: _Picked) -> None:
    """Each decoding row takes its token and is checked for its stops (the grammar's among them:
    its budget closing a constrained output, a token it rejects, an output only EOS may follow)."""
    stops, grammar = run.stops, run.grammar
    for pos, ri in enumerate(present):
        r = rows[ri]
        if r.finish is not None:
            continue
        if pos in picked.stuck:  # its grammar admits no token: it ends without one
            r.finish = "grammar"
            stops.settle(r)
            continue
        tok, logprob = picked.tokens[pos], picked.logprobs[pos]
        if grammar and tok != (
            kept := grammar.within_budget(r.seg.id, tok, stops.of(r).max_tokens - len(r.out))
        ):
            # the budget closes the constrained output instead (`grammar_close`)
            tok, logprob = kept, float(torch.log_softmax(picked.logits[pos].float(), -1)[kept])
        r.out.append(tok)
        r.seg.tokens.append(tok)
        r.top1.append(picked.top1[pos])
        r.logprobs.append(logprob)
        r.finish = stops.check(r)
        if grammar and not grammar.accept(r.seg.id, tok) and r.finish is None:
            r.finish = "grammar"
            stops.settle(r)
        if r.finish == "length" and grammar and grammar.ends_here(r.seg.id):
            # the last token completed a constrained output that only the end of sequence may
            # follow: it ended as the model's next token would have ended it (not cut)
            r.finish = "eos"
        elif r.finish == "eos" and grammar and grammar.forced(r.seg.id):
            r.finish = "length"  # the budget closed it: cut short, and said so


def _ask_stoppers(
    run: DecodeRun, rows: Sequence[Row], present: list[int], stoppers: Sequence[Acceleration]
) -> list[int]:
    """The rows still decoding after this step, once the accelerations that may end a batch
    (`stop_reason`) were asked; ended rows' grammars are let go."""
    alive = [ri for ri in present if rows[ri].finish is None]
    grammar = run.grammar
    if grammar:
        for ri in present:
            if rows[ri].finish is not None:
                grammar.drop(rows[ri].seg.id)
    if alive and (not grammar or grammar.complete([rows[ri].seg.id for ri in alive])):
        for hook in stoppers:
            reason = hook.stop_reason(rows, run.step)
            if reason is not None:
                for ri in alive:
                    rows[ri].finish = reason
                    run.stops.settle(rows[ri])
                return []
    return alive


def _at_boundary(
    run: DecodeRun, batch: Batch, present: list[int], alive: list[int], capture: CaptureFn
) -> tuple[list[int], bool, list[NodeId]]:
    """The step boundary: ended rows' pages go back, then the intake (`run.boundary`) names rows to
    preempt (told each while its KV is in the batch) and nodes that join now. Returns the rows that
    go on decoding, whether any was preempted, and the nodes admitted."""
    rows, kv = batch.rows, batch.ctx.kv
    if kv.frees_rows:  # an ended row's pages go back now, for the rows still decoding
        # (before the budget is asked: its capture adds bytes)
        _capture_ended(rows, present, capture, then=kv.release)
    boundary = run.boundary
    if boundary is None:
        return alive, False, []
    evict = False
    for r in boundary.pressure([rows[ri] for ri in alive]):
        r.preempted = evict = True
    if evict:
        for pos, ri in enumerate(present):
            if rows[ri].preempted:
                boundary.preempt(pos, rows[ri])
        alive = [ri for ri in alive if not rows[ri].preempted]
    return alive, evict, list(boundary.admit(len(alive)))


def _compact(
    batch: Batch, present: list[int], alive: list[int], capture: CaptureFn, device: torch.device
) -> list[int]:
    """Ended and preempted rows leave the batch (an ended row's KV captured into its node first);
    returns the new batch positions' rows."""
    rows = batch.rows
    _capture_ended(rows, present, capture)
    keep = [pos for pos, ri in enumerate(present) if rows[ri].finish is None and not rows[ri].preempted]
    batch.ctx.select_rows(torch.tensor(keep, device=device), {old: new for new, old in enumerate(keep)})
    return alive


def _capture_ended(
    rows: Sequence[Row], present: list[int], capture: CaptureFn, then: Callable[[int], None] | None = None
) -> None:
    """Copy each ended row's KV not yet captured into its node (and hand its batch position to
    `then` before the next row's copy)."""
    for pos, ri in enumerate(present):
        if rows[ri].finish is not None and not rows[ri].captured:
            capture(pos, rows[ri])
            if then is not None:
                then(pos)


def _generation(r: Row) -> Generation:
    return Generation(
        node=r.seg.id,
        token_ids=r.out,
        text=r.text,
        top1_probs=r.top1,
        logprobs=r.logprobs,
        finish_reason=r.finish or "length",
    )


def _report(run: DecodeRun, rows: Sequence[Row], stepping: Sequence[int], alive: list[int]) -> list[int]:
    """Tell `run.on_step` what this step's rows appended and which ended; stop the rows it gives back.

    Returns the rows still alive. A finished row's `Generation` is made once, here, and is the one
    `extend` returns (its token list no longer grows).
    """
    assert run.on_step is not None
    finished = {}
    for ri in stepping:
        r = rows[ri]
        if r.finish is not None:
            index = run.rows[r.seg.id]
            finished[index] = run.results[index] = _generation(r)
    step = DecodeStep(
        tokens={run.rows[rows[ri].seg.id]: rows[ri].out[-1:] for ri in stepping}, finished=finished
    )
    drop = run.on_step(step)
    if not drop:
        return alive
    return _stop(run, rows, alive, drop)


def _stop(run: DecodeRun, rows: Sequence[Row], alive: list[int], drop: Collection[int]) -> list[int]:
    """Stop the rows `drop` names wherever they are: decoding (in `alive`), preempted, or waiting in
    the intake to join (`DecodeRun.dropped`). Returns the rows still alive."""
    by_index = {run.rows[rows[ri].seg.id]: ri for ri in alive}
    waiting = {run.rows[r.seg.id]: r for r in (*run.carried.values(), *rows) if r.preempted}
    for index in drop:
        found = by_index.get(index)
        if found is not None:
            r = rows[found]
            r.finish = "cancelled"
            run.stops.settle(r)
        elif index in waiting and waiting[index].finish is None:  # preempted: it ends where it waits
            r = waiting[index]
            r.finish = "cancelled"
            run.stops.settle(r)
            run.stopped.add(r.seg.id)
            if run.carried.pop(r.seg.id, None) is not None:  # from an earlier batch: answered now
                run.results.setdefault(index, _generation(r))
        elif index not in waiting and index not in run.results:
            run.dropped.add(index)
    return [ri for ri in alive if rows[ri].finish is None]
