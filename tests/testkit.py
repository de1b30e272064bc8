"""What many test files share: one fake `Backend`, one `wait_until` and one failing forward of the
local backend (imported by conftest.py, so every test module can ``from testkit import ...``).

Why one fake: the scheduler, the server, the DSPy and LangChain plug-ins all drive a backend through
the same few calls (``chat_prompt``, ``prefill``, ``fork``, ``extend``, ``release``). A fake per
test file kept those calls in eight slightly different copies; here they are written once, and a
test's own fake overrides only what it is about (what ``extend`` answers, a gate it waits on, what
it records).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from branchwise.backends.base import DecodeParams, Generation

__all__ = ["FakeBackend", "GatedBackend", "Lines", "Rerun", "fail_forward", "wait_until"]


class Lines(logging.Handler):
    """Every record logged while installed, at any level (the server logs from its own threads,
    where pytest's caplog fixture does not always reach)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def wait_until(cond: Callable[[], Any], what: str, limit_s: float = 30.0, every_s: float = 0.02) -> None:
    """Poll `cond` every `every_s` seconds, at most `limit_s`; fail naming `what` if it never holds."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting until {what}")


def fail_forward(monkeypatch: Any, at: int, message: str = "device lost") -> Callable[[], None]:
    """Make the `at`-th forward of the local backend from now on raise ``RuntimeError(message)``
    (a device lost mid-decode); returns what puts the real forward back before the test ends."""
    from branchwise.backends.hf.compute import Computation

    forward = Computation.forward
    calls = [0]

    def failing(self: Computation, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at:
            raise RuntimeError(message)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(Computation, "forward", failing)
    return lambda: monkeypatch.setattr(Computation, "forward", forward)


class FakeBackend:
    """A `Backend` with characters for tokens (``ord`` / ``chr``) and node bookkeeping, no model.

    `prefill` and `fork` hand out increasing node ids and remember each node's prompt (`prompts`),
    every prompt prefilled (`prefilled`) and the nodes not yet released (`live`); `extend` records
    each call's row count and params (`extends`, `params`) and answers every row with `reply`'s text
    for the row's prompt ids, finishing with ``"eos"``. All of it under one lock: the scheduler and
    the plug-ins call from several threads."""

    name = "fake"
    model_name = "fake"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.next = 0
        self.prompts: dict[int, list[int]] = {}
        self.prefilled: list[list[int]] = []
        self.live: set[int] = set()
        self.extends: list[int] = []
        self.params: list[DecodeParams] = []

    # ---------------------------------------------------------------- text
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return self.encode(messages[-1]["content"] or "?")

    # ---------------------------------------------------------------- nodes
    def prefill(self, ids: Sequence[int]) -> int:
        with self.lock:
            self.next += 1
            self.prompts[self.next] = list(ids)
            self.prefilled.append(list(ids))
            self.live.add(self.next)
            return self.next

    def fork(self, node: int, n: int, share: str | None = None) -> list[int]:
        with self.lock:
            kids = []
            for _ in range(n):
                self.next += 1
                self.prompts[self.next] = list(self.prompts[node])
                self.live.add(self.next)
                kids.append(self.next)
            return kids

    def release(self, nodes: Sequence[int]) -> None:
        with self.lock:
            for n in nodes:
                self.prompts.pop(n, None)
                self.live.discard(n)

    # ---------------------------------------------------------------- decoding
    def reply(self, prompt: list[int]) -> str:
        """The text a row whose prompt is `prompt` decodes (default: the prompt, echoed)."""
        return self.decode(prompt)

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        with self.lock:
            self.extends.append(len(nodes))
            self.params.append(params)
            texts = [self.reply(self.prompts[n]) for n in nodes]
        return [self.generation(n, text) for n, text in zip(nodes, texts, strict=True)]

    def generation(self, node: int, text: str, reason: str = "eos") -> Generation:
        """A row's `Generation` of `text` (one token per character)."""
        ids = self.encode(text)
        return Generation(node, ids, text, [0.5] * len(ids), [-0.7] * len(ids), reason)  # type: ignore[arg-type]


class GatedBackend(FakeBackend):
    """Decodes ``"A"`` per row, but `extend` first waits until the test opens `gate` (and says it is
    waiting through `in_extend`): a worker held busy while the test queues, cancels or disconnects."""

    name = "gated"
    model_name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.in_extend = threading.Event()

    def reply(self, prompt: list[int]) -> str:
        return "A"

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        self.in_extend.set()
        assert self.gate.wait(30), "the test never opened the gate"
        return super().extend(nodes, params)


class Rerun:
    """A `step.Recorder` for the CPU: "replaying" runs the recorded step again into the recorded
    outputs (a tensor, or a tuple of them: an early exit's pieces), so the capture-and-replay flow
    (when a layout or a piece is recorded, how often, what a replay returns) is checked where there
    is no CUDA."""

    def __init__(self) -> None:
        self.records = 0
        self.replays = 0

    def record(self, step: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        self.records += 1
        out = step()

        def replay() -> None:
            self.replays += 1
            again = step()
            pairs = zip(out, again, strict=True) if isinstance(out, tuple) else [(out, again)]
            for kept, new in pairs:
                kept.copy_(new)

        return replay, out
