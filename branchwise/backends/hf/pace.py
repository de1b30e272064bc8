"""How many prompt tokens a decode step may carry beside its decoding rows: a budget in time.

Why: a long prompt that arrives while other rows decode is prefilled a chunk per decode step
(`intake.py`), and every decoding row waits for that chunk's forward at every step. A fixed chunk
costs very different times: on a 2-core CPU a 128-token forward is compute-bound and takes many
decode steps' time, and later chunks cost more than earlier ones (each attends over every token
before it), while on a GPU the same chunk is nearly free. The short requests' latency is what the
chunk should bound, so the chunk is sized by time: at most `share` of a decode step's own time,
measured as the call runs (moving averages of the decode step and of a prefilled token's cost,
which follow the prompt's growing attention), between `floor` tokens (progress for the long
prompt) and the configured chunk (`HFBackend.prefill_chunk`, the most a step carries). With
`share=1.0` a step with a chunk takes about twice a plain one, which is the bound the serving
benchmark checks (the short requests' p99 at most 2x their p99 without the long prompt).

While nothing decodes (the batch emptied, a long prompt alone), chunks run back to back and a
request arriving meanwhile is let in between two of them, so there a chunk is sized by the wait it
may impose: as many tokens as take about `idle_s`, never fewer than the configured chunk nor more
than a prompt alone takes per forward (`idle_size`). Fixed chunks there cost every lone prompt a
forward's fixed costs per chunk: on a 2-core CPU a 1,024-token prompt took ~10 % longer in
128-token chunks than in 256-token ones.

A chunk's cost is measured where it is computed: carried by the decode step in the same forward
(`step.Chunk`: every weight read once for both), it is what that step took beyond a plain one
(`carries`, then `boundary`); in a forward of its own before the step (the layer loop's steps,
which cannot carry one), its own time (`timed_chunk`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

MIN_TOKEN_S = 1e-7
"""The least a carried prompt token is taken to cost (seconds): a step that carried a chunk and
measured no slower than a plain one (noise, or a device where it is nearly free) makes the next
chunk as large as the configured chunk allows, not unbounded."""


@dataclass
class PrefillPace:
    """The chunk size of the next step's prefill (see the module docstring). One per engine, so what
    one call measured sizes the next call's first chunk."""

    share: float = 1.0
    """A chunk's forward may take at most this fraction of a decode step's time (0: every chunk is
    the configured chunk, whatever it costs)."""
    floor: int = 8
    """The fewest prompt tokens a step carries (the long prompt's progress)."""
    idle_s: float = 0.25
    """While nothing decodes, a chunk may take about this long (seconds): the most a request
    arriving meanwhile waits to be let in (`idle_size`)."""
    smoothing: float = 0.3
    """Weight of the newest measurement in the moving averages."""
    step_s: float | None = None
    """Seconds of a decode step without prefill (moving average)."""
    token_s: float | None = None
    """Seconds per prefilled token of the last chunks (moving average)."""
    _since: float | None = None
    _carried: int = 0
    """Prompt tokens the step now running carries (`carries`): its time is not a plain step's."""

    def __post_init__(self) -> None:
        self.check_share(self.share)
        if self.floor < 1:
            raise ValueError(f"prefill floor={self.floor!r} must be an int >= 1 (tokens per step)")
        if not self.idle_s >= 0:
            raise ValueError(f"prefill idle_s={self.idle_s!r} must be >= 0 (seconds a chunk may take alone)")

    @staticmethod
    def check_share(share: float) -> None:
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 100:
            raise ValueError(
                f"prefill_share={share!r} must be a number in [0, 100]: the fraction of a decode step's "
                "time a prefill chunk beside it may take (0: fixed chunks of prefill_chunk tokens)"
            )

    def size(self, limit: int) -> int:
        """Prompt tokens for the next chunk, at most `limit` (the configured chunk). Before anything
        was measured, the floor: a small first chunk measures what a token costs."""
        if not self.share:
            return limit
        if self.step_s is None or self.token_s is None or self.token_s <= 0:
            return min(limit, self.floor)
        fits = int(self.share * self.step_s / self.token_s)
        return max(min(self.floor, limit), min(limit, fits))

    def idle_size(self, limit: int, most: int) -> int:
        """Prompt tokens for the next chunk while nothing decodes: what takes about `idle_s` at the
        measured cost per token, between `limit` (the configured chunk: all of it before a token's
        cost was measured, and always with `share=0`, fixed chunks) and `most` (what bounds a
        forward's attention memory)."""
        if not self.share or self.token_s is None or self.token_s <= 0:
            return limit
        return max(limit, min(most, int(self.idle_s / self.token_s)))

    def boundary(self) -> None:
        """A decode step just ended (a step boundary, before any chunk): the time since the last
        boundary's end is one decode step; if that step carried a chunk (`carries`), what it took
        beyond a plain step is the chunk's cost (where no plain step was measured yet, all of it)."""
        now = time.perf_counter()
        if self._since is not None:
            took = now - self._since
            if self._carried:
                extra = took if self.step_s is None else max(took - self.step_s, MIN_TOKEN_S * self._carried)
                self.token_s = self._average(self.token_s, extra / self._carried)
            else:
                self.step_s = self._average(self.step_s, took)
        self._since, self._carried = now, 0

    def carries(self, tokens: int) -> None:
        """The next decode step carries a chunk of `tokens` prompt tokens in its own forward
        (`step.Chunk`): its next `boundary` measures the chunk's cost, not a plain step's."""
        self._carried = tokens

    def timed_chunk(self, tokens: int, started: float, device: torch.device) -> None:
        """A chunk of `tokens` prompt tokens, started at `started` (`time.perf_counter()`), has been
        queued: wait for the device (its kernels run asynchronously on a GPU), record its cost per
        token, and start the next decode step's clock after it."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        if tokens > 0:
            self.token_s = self._average(self.token_s, (now - started) / tokens)
        self._since, self._carried = now, 0

    def idle(self) -> None:
        """No decode step runs now (the batch emptied): the next boundary starts a new clock."""
        self._since, self._carried = None, 0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.smoothing) * old + self.smoothing * new
