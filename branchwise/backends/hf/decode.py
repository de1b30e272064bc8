"""The decode loop: sample a token per row, check stops, feed the tokens back, drop finished rows.

Why its own module: this is where a token gets sampled (`sampling.pick_tokens`) and where a branch
ends (EOS, a stop string, the step delimiter, max_tokens, or an acceleration's `stop_reason`). It
owns no KV: `forward` (the runner, bound to the session) and `capture` (copy a row's KV back into
its node) are passed in, so this loop reads as what it is.

Stop checks are incremental: each row keeps a running detokenization (`TextTail`) that decodes only
the last few tokens per step, instead of re-decoding the row's whole output every step (quadratic
in the output length). A row's final text is one full decode, cut by the same rules as always.

Streaming: an optional `on_step` listener is handed each step's new tokens and the rows that ended
(their final `Generation`), and may name rows to stop (their consumer left). It is one `if` per
step when absent; the listener does the detokenizing for its own consumers, off this thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from branchwise.backends.base import DecodeParams, DecodeStep, FinishReason, Generation, StepListener
from branchwise.backends.hf.batch import Batch, Row
from branchwise.backends.hf.hooks import Acceleration, overrides
from branchwise.backends.hf.sampling import pick_tokens
from branchwise.backends.text import Detokenize, TextTail, finish_text

__all__ = ["StopCheck", "TextTail", "decode", "finish_text"]

ForwardFn = Callable[[Sequence[Sequence[int]]], torch.Tensor]
CaptureFn = Callable[[int, Row], None]


class StopCheck:
    """Per-row stop detection for one `extend` call (see the module docstring)."""

    def __init__(self, params: DecodeParams, eos_ids: set[int], detokenize: Detokenize, n_rows: int) -> None:
        self.params = params
        self.eos_ids = eos_ids
        self._detokenize = detokenize
        self._tails = [TextTail(detokenize) for _ in range(n_rows)]
        self._watch = bool(params.stop or params.step_delimiter)

    def check(self, ri: int, row: Row, last_step: bool) -> FinishReason | None:
        """Row `ri` just appended a token: say whether (and why) it is done, and set its text then."""
        if row.out[-1] in self.eos_ids:
            row.text = self._detokenize(row.out)
            return "eos"
        if self._watch:
            tail = self._tails[ri]
            tail.push(row.out[-1])
            if finish_text(tail.text, self.params)[1] is not None:
                # confirm on the full text, exactly the rule the final text is cut by
                text, reason = finish_text(self._detokenize(row.out), self.params)
                if reason is not None:
                    row.text = text
                    return reason
        if last_step:
            row.text = self._detokenize(row.out)
            return "length"
        return None

    def settle(self, row: Row) -> None:
        """Text of a row stopped from outside (an acceleration's stop, or the loop ending)."""
        row.text = self._detokenize(row.out)


def decode(
    batch: Batch,
    logits: torch.Tensor,
    params: DecodeParams,
    *,
    forward: ForwardFn,
    capture: CaptureFn,
    hooks: Sequence[Acceleration],
    eos_ids: set[int],
    detokenize: Detokenize,
    device: torch.device,
    on_step: StepListener | None = None,
) -> list[Generation]:
    """Decode every row of `batch` from `logits` (the distribution after each row's last token).

    `on_step` (see `StepListener`) is told each step's tokens and finished rows; rows it returns
    stop at once. Without it, the loop does no per-step work for it.
    """
    rows = batch.rows
    ctx = batch.ctx
    gen = None
    if params.seed is not None:
        gen = torch.Generator(device=device).manual_seed(params.seed)
    stops = StopCheck(params, eos_ids, detokenize, len(rows))
    stoppers = overrides(hooks, "stop_reason")
    before_step = overrides(hooks, "before_step")
    after_step = overrides(hooks, "after_step")
    for hook in overrides(hooks, "begin_decode"):
        hook.begin_decode(batch)
    present = list(range(len(rows)))  # batch position -> row index
    stepping = present  # rows that append a token this step
    ended: dict[int, Generation] = {}  # rows already reported to `on_step`
    for step in range(params.max_tokens):
        if step < params.min_tokens and eos_ids:
            logits = logits.clone()
            logits[:, list(eos_ids)] = float("-inf")
        tokens, top1, chosen = pick_tokens(logits, params.temperature, params.top_p, gen)
        tok_list, top1_list, lp_list = tokens.tolist(), top1.tolist(), chosen.tolist()
        for pos, ri in enumerate(present):
            r = rows[ri]
            if r.finish is not None:
                continue
            r.out.append(tok_list[pos])
            r.seg.tokens.append(tok_list[pos])
            r.top1.append(top1_list[pos])
            r.logprobs.append(lp_list[pos])
            r.finish = stops.check(ri, r, last_step=step == params.max_tokens - 1)
        alive = [ri for ri in present if rows[ri].finish is None]
        if alive:
            for hook in stoppers:
                reason = hook.stop_reason(rows, step)
                if reason is not None:
                    for ri in alive:
                        rows[ri].finish = reason
                        stops.settle(rows[ri])
                    alive = []
                    break
        if on_step is not None:
            alive = _report(on_step, rows, stepping, alive, ended, stops)
        if not alive:
            break
        dead = len(present) - len(alive)
        if dead and dead * 4 >= len(present):  # compact: finished rows leave the batch
            for pos, ri in enumerate(present):
                if rows[ri].finish is not None:
                    capture(pos, rows[ri])
            keep = [pos for pos, ri in enumerate(present) if rows[ri].finish is None]
            ctx.select_rows(torch.tensor(keep, device=device), {old: new for new, old in enumerate(keep)})
            present = alive
        feeds = [[rows[ri].out[-1]] if rows[ri].finish is None else [] for ri in present]
        for hook in before_step:
            hook.before_step(batch, [rows[ri] for ri in present])
        logits = forward(feeds)
        batch.advance(present, feeds)
        for hook in after_step:
            hook.after_step(batch, [rows[ri] for ri in present], feeds, step)
        stepping = alive
    for hook in overrides(hooks, "end_decode"):
        hook.end_decode(batch, [rows[ri] for ri in present])
    for pos, ri in enumerate(present):
        if not rows[ri].captured:
            capture(pos, rows[ri])
    results = []
    for ri, r in enumerate(rows):
        # the last sampled token was not fed; its KV is computed on the node's next use
        r.seg.last_logits = None
        results.append(ended.get(ri) or _generation(r))
    return results


def _generation(r: Row) -> Generation:
    return Generation(
        node=r.seg.id,
        token_ids=r.out,
        text=r.text,
        top1_probs=r.top1,
        logprobs=r.logprobs,
        finish_reason=r.finish or "length",
    )


def _report(
    on_step: StepListener,
    rows: Sequence[Row],
    stepping: Sequence[int],
    alive: list[int],
    ended: dict[int, Generation],
    stops: StopCheck,
) -> list[int]:
    """Tell `on_step` what this step's rows appended and which ended; stop the rows it gives back.

    Returns the rows still alive. A finished row's `Generation` is made once, here, and is the one
    `decode` returns (its token list no longer grows).
    """
    finished = {}
    for ri in stepping:
        if rows[ri].finish is not None:
            finished[ri] = ended[ri] = _generation(rows[ri])
    drop = on_step(DecodeStep(tokens={ri: rows[ri].out[-1:] for ri in stepping}, finished=finished))
    if not drop:
        return alive
    for ri in drop:
        r = rows[ri]
        if r.finish is None:
            r.finish = "cancelled"
            stops.settle(r)
    return [ri for ri in alive if rows[ri].finish is None]
