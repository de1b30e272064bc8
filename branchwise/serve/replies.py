"""What the server sends back: OpenAI's reply shapes, and tool calls read out of a reply's text.

Why tool calls are read by a stream (`ToolCallStream`) even for a whole reply: a streamed reply and
a non-streamed one must say the same thing. Both feed the text through the same reader, so the
streamed content deltas, concatenated, equal the non-streamed ``content``, and the streamed calls
are the non-streamed ``tool_calls`` (ids aside: each reply draws its own).

The reader follows the Hermes format (`branchwise.toolcalls`): content is text outside
``<tool_call>...</tool_call>`` blocks; a block whose body is a call of one of the request's tools
becomes a call, any other block stays content as written. Whitespace next to a call block (the
newlines around it) is not content. While decoding, text that might be the start of ``<tool_call>``
and whitespace that might precede one are held back until the next characters decide; a call is
released when its block closes (its arguments whole: OpenAI's clients accept them in one delta).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from branchwise.backends.base import Backend, Generation
from branchwise.constraints import Constraint
from branchwise.toolcalls import TOOL_CALL_OPEN, ToolCall, parse_tool_calls

__all__ = [
    "FINISH",
    "ChatDeltas",
    "ToolCallStream",
    "chat_choice_message",
    "chat_logprobs",
    "details",
    "finish_reason",
    "split_reply",
    "strategy_message",
    "strategy_reply",
    "text_logprobs",
    "tools_of",
    "usage",
]

FINISH = {
    "eos": "stop",
    "stop": "stop",
    "delimiter": "stop",
    "confident": "stop",
    "grammar": "stop",
    "length": "length",
}
"""Backend finish reasons mapped onto OpenAI's ("grammar": the constraint allowed no more tokens, so
the reply is as complete as it can be)."""

OPEN, CLOSE = TOOL_CALL_OPEN, "</tool_call>"

Event = tuple[str, Any]
"""``("content", str)`` or ``("call", ToolCall)``."""


class ToolCallStream:
    """One reply's text in, content deltas and tool calls out (see the module docstring)."""

    def __init__(self, tools: Sequence[dict[str, Any]]) -> None:
        self.tools = tools
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_block = False
        self._after_call = False  # whitespace right after a call is not content
        self._space = ""  # trailing whitespace held: a call block may follow it

    def push(self, text: str) -> list[Event]:
        """Take more of the reply's text; what is now decided."""
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_block:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(CLOSE) :]
                self._in_block = False
                block = OPEN + body + CLOSE
                rest, calls = parse_tool_calls(block, self.tools)
                if len(calls) == 1 and not rest:
                    self._space = ""
                    self._after_call = True
                    self.calls.append(calls[0])
                    out.append(("call", calls[0]))
                else:  # not a call of these tools: the block is content, as written
                    self._content(out, self._space + block)
                    self._space = ""
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._after_call = False
            start = self._buf.find(OPEN)
            if start >= 0:
                self._prose(out, self._buf[:start])
                self._buf = self._buf[start + len(OPEN) :]
                self._in_block = True
                continue
            keep = _partial_open(self._buf)
            self._prose(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self) -> list[Event]:
        """The end of the reply: what was held back is content after all (an unclosed block too)."""
        out: list[Event] = []
        rest = (OPEN if self._in_block else "") + self._buf
        if self._after_call:
            rest = rest.lstrip()
        self._content(out, self._space + rest)
        self._buf, self._space, self._in_block = "", "", False
        return out

    def _prose(self, out: list[Event], text: str) -> None:
        """Text outside blocks: its trailing whitespace waits (a call may follow)."""
        text = self._space + text
        head = text.rstrip()
        self._space = text[len(head) :]
        self._content(out, head)

    @staticmethod
    def _content(out: list[Event], text: str) -> None:
        if text:
            out.append(("content", text))


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that ``<tool_call>`` starts with."""
    for k in range(min(len(text), len(OPEN) - 1), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0


def tools_of(constraint: Constraint | None) -> Sequence[dict[str, Any]] | None:
    """The tools a reply may call (None: the reply is plain content)."""
    return constraint.tools if constraint is not None and constraint.kind == "tool_calls" else None


def split_reply(text: str, tools: Sequence[dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """A whole reply's content (None when it is only calls) and calls, as a stream would read them."""
    reader = ToolCallStream(tools)
    events = reader.push(text) + reader.finish()
    content = "".join(v for kind, v in events if kind == "content")
    return (content or None) if reader.calls else content, reader.calls


def finish_reason(g: Generation, has_calls: bool) -> str:
    """OpenAI's finish reason: ``tool_calls`` when the reply holds calls, unless it was cut by
    ``max_tokens`` (``length``: whatever followed the last whole call, even a call, is lost)."""
    reason = FINISH[g.finish_reason]
    return "tool_calls" if has_calls and reason != "length" else reason


def chat_choice_message(g: Generation, constraint: Constraint | None) -> tuple[dict[str, Any], str]:
    """A chat choice's ``message`` and ``finish_reason``."""
    tools = tools_of(constraint)
    if tools is None:
        return {"role": "assistant", "content": g.text}, FINISH[g.finish_reason]
    content, calls = split_reply(g.text, tools)
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

    def push(self, text: str, *, end: bool = False) -> list[dict[str, Any]]:
        """The deltas `text` (the choice's next text, the last when `end`) releases."""
        if self.reader is None:
            return [{"content": text}] if text else []
        out = []
        for kind, value in self.reader.push(text) + (self.reader.finish() if end else []):
            if kind == "content":
                out.append({"content": value})
            else:
                out.append({"tool_calls": [{"index": self.sent, **value.openai()}]})
                self.sent += 1
        return out

    def finish_reason(self, g: Generation) -> str:
        return finish_reason(g, self.sent > 0)


# ---------------------------------------------------------------------- response shapes


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    # like OpenAI with n > 1: the prompt is counted once
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


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
        if finish != "length":
            finish = "tool_calls"
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
