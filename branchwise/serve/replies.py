"""What the server sends back: OpenAI's reply shapes, and tool calls read out of a reply's text.

Tool calls are read by a stream (`toolcalls.ToolCallStream`) even for a whole reply: a streamed
reply and a non-streamed one must say the same thing, so the streamed content deltas, concatenated,
equal the non-streamed ``content``, and the streamed calls are the non-streamed ``tool_calls`` (ids
aside: each reply draws its own). A call is released when its block closes, its arguments whole
(OpenAI's clients accept them in one delta).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from branchwise.backends.base import OPENAI_FINISH, Backend, Generation
from branchwise.constraints import Constraint
from branchwise.toolcalls import ToolCall, ToolCallStream, split_calls

__all__ = [
    "CHAT",
    "FINISH",
    "TEXT",
    "ChatChunks",
    "ChatDeltas",
    "Chunks",
    "Kind",
    "TextChunks",
    "chat_choice_message",
    "chat_logprobs",
    "details",
    "finish_reason",
    "reply_notes",
    "split_reply",
    "strategy_message",
    "strategy_reply",
    "text_logprobs",
    "tools_of",
    "usage",
]

FINISH = OPENAI_FINISH
"""Backend finish reasons mapped onto OpenAI's (`backends.base.OPENAI_FINISH`)."""


@dataclass(frozen=True)
class Kind:
    """What differs between a chat and a text completion's reply: names and choice shapes."""

    object: str
    chunk_object: str
    id_prefix: str


CHAT = Kind("chat.completion", "chat.completion.chunk", "chatcmpl")
TEXT = Kind("text_completion", "text_completion", "cmpl")


def tools_of(constraint: Constraint | None) -> Sequence[dict[str, Any]] | None:
    """The tools a reply may call (None: the reply is plain content)."""
    return constraint.tools if constraint is not None and constraint.kind == "tool_calls" else None


def split_reply(
    text: str, tools: Sequence[dict[str, Any]], cut: bool = False
) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when it is only calls: OpenAI's shape) and calls, as a stream
    would read them (`toolcalls.split_calls`; `cut`: the reply was cut by ``max_tokens``)."""
    content, calls = split_calls(text, tools, cut=cut)
    return (content or None) if calls else content, calls


def finish_reason(g: Generation, has_calls: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the reply holds at least one whole call, even when
    ``max_tokens`` cut a later one (that partial call is dropped, never shown as content: the
    calls returned are whole and can be run); otherwise the backend's reason in OpenAI's words."""
    return "tool_calls" if has_calls else FINISH[g.finish_reason]


def chat_choice_message(g: Generation, constraint: Constraint | None) -> tuple[dict[str, Any], str]:
    """A chat choice's ``message`` and ``finish_reason``."""
    tools = tools_of(constraint)
    if tools is None:
        return {"role": "assistant", "content": g.text}, FINISH[g.finish_reason]
    content, calls = split_reply(g.text, tools, g.finish_reason == "length")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
    return message, finish_reason(g, bool(calls))


class ChatDeltas:
    """One streamed chat choice's deltas: its text as decoded or, with tools, its content and calls
    (each call whole, in one delta, as the openai client assembles it)."""

    def __init__(self, tools: Sequence[dict[str, Any]] | None) -> None:
        self.reader = ToolCallStream(tools) if tools is not None else None
        self.sent = 0  # calls streamed so far: the next call's index

    def push(self, text: str, *, end: bool = False, cut: bool = False) -> list[dict[str, Any]]:
        """The deltas `text` (the choice's next text, the last when `end`; `cut`: by ``max_tokens``)
        releases."""
        if self.reader is None:
            return [{"content": text}] if text else []
        out: list[dict[str, Any]] = []
        for part in self.reader.push(text) + (self.reader.finish(cut) if end else []):
            if isinstance(part, str):
                out.append({"content": part})
            else:
                out.append({"tool_calls": [{"index": self.sent, **part.openai()}]})
                self.sent += 1
        return out

    def finish_reason(self, g: Generation) -> str:
        return finish_reason(g, self.sent > 0)


class Chunks(Protocol):
    """One streamed choice's chunk payloads (what follows its ``index``): chat or text."""

    def start(self) -> list[dict[str, Any]]:
        """Payloads sent before any token (chat: the assistant role)."""
        ...

    def push(self, text: str, *, end: bool = False, cut: bool = False) -> list[dict[str, Any]]:
        """Payloads for the choice's next text (the last when `end`; `cut`: by ``max_tokens``)."""
        ...

    def finish(self, g: Generation) -> dict[str, Any]:
        """The payload that closes the choice with its finish reason."""
        ...


class ChatChunks:
    """A streamed chat choice: deltas (content, or content and tool calls: `ChatDeltas`)."""

    def __init__(self, tools: Sequence[dict[str, Any]] | None) -> None:
        self.deltas = ChatDeltas(tools)

    def start(self) -> list[dict[str, Any]]:
        return [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]

    def push(self, text: str, *, end: bool = False, cut: bool = False) -> list[dict[str, Any]]:
        return [{"delta": d, "finish_reason": None} for d in self.deltas.push(text, end=end, cut=cut)]

    def finish(self, g: Generation) -> dict[str, Any]:
        return {"delta": {}, "finish_reason": self.deltas.finish_reason(g)}


class TextChunks:
    """A streamed text choice: its text, led by the echoed prompt (``echo``) in its first chunk."""

    def __init__(self, echo: str) -> None:
        self.echo = echo

    def start(self) -> list[dict[str, Any]]:
        return []

    def push(self, text: str, *, end: bool = False, cut: bool = False) -> list[dict[str, Any]]:
        text, self.echo = self.echo + text, ""
        return [{"text": text, "finish_reason": None}] if text else []

    def finish(self, g: Generation) -> dict[str, Any]:
        return {"text": "", "finish_reason": FINISH[g.finish_reason]}


# ---------------------------------------------------------------------- response shapes


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    # like OpenAI with n > 1: the prompt is counted once
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def reply_notes(gens: Sequence[Generation]) -> list[str]:
    """The notes of a reply's generations, each once (the choices of one decode call share them)."""
    return list(dict.fromkeys(note for g in gens for note in g.notes))


def details(g: Generation) -> dict[str, Any]:
    return {
        "token_ids": g.token_ids,
        "top1_probs": g.top1_probs,
        "logprobs": g.logprobs,
        "finish_reason": g.finish_reason,
    }


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value


def strategy_reply(result: Any) -> tuple[str, str, dict[str, Any], int]:
    """(text, finish_reason, branchwise field, completion tokens) of a strategy run."""
    chosen = next((b for b in result.branches if b.selected), result.branches[0] if result.branches else None)
    text = chosen.text if chosen is not None else ""
    finish = FINISH.get(chosen.finish_reason, "stop") if chosen is not None else "stop"
    extra = {
        "answer": result.answer,
        "votes": result.votes,
        "support": result.support,
        "strategy": result.strategy,
        "value": None if result.tool_calls else _jsonable(result.value),
        "kv_stats": result.kv_stats,
        "timings": result.timings,
        # what did not apply or fell back (an acceleration that never acted): said over HTTP too
        "notes": list(result.notes),
        "branches": [
            {"text": b.text, "answer": b.answer, "scores": b.scores, "selected": b.selected}
            for b in result.branches
        ],
    }
    return text, finish, extra, sum(b.n_tokens for b in result.branches)


def strategy_message(
    result: Any, text: str, finish: str, constraint: Constraint | None
) -> tuple[dict[str, Any], str]:
    """A strategy run's chat ``message`` and ``finish_reason``: with tools, the winning calls (the
    vote's, `ReasoningResult.tool_calls`) and the chosen branch's prose."""
    tools = tools_of(constraint)
    if tools is None:
        return {"role": "assistant", "content": text}, finish
    content, _ = split_reply(text, tools)
    calls = list(result.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
        finish = "tool_calls"  # as `finish_reason`: whole calls are returned, a cut one is not
    return message, finish


def chat_logprobs(
    backend: Backend, g: Generation, top: list[list[tuple[int, float]]] | None
) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = backend.decode([token_id])
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [
        {**entry(t, lp), "top_logprobs": [entry(c, clp) for c, clp in top[i]] if top else []}
        for i, (t, lp) in enumerate(zip(g.token_ids, g.logprobs, strict=True))
    ]


def text_logprobs(
    backend: Backend, g: Generation, top: list[list[tuple[int, float]]] | None, as_ids: bool, offset: int
) -> dict[str, Any]:
    def name(token_id: int) -> str:
        return f"token_id:{token_id}" if as_ids else backend.decode([token_id])

    tokens = [name(t) for t in g.token_ids]
    offsets = []
    for t in g.token_ids:
        offsets.append(offset)
        offset += len(backend.decode([t]))
    return {
        "tokens": tokens,
        "token_logprobs": g.logprobs,
        "top_logprobs": [{name(c): lp for c, lp in row} for row in top] if top else None,
        "text_offset": offsets,
    }
