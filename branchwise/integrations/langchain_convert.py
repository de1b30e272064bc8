"""LangChain's shapes <-> branchwise's, for `ChatBranchwise`: messages in, a call's tools / response
format / constraint as one decode constraint, and a streamed reply out as prose and tool calls.

Why its own module: these are pure translations between langchain-core's types and the OpenAI-shaped
dicts, `Constraint` and `ToolCall` the backends take; none of it runs the model or the scheduler.
Apart from the chat model they can be read and tested on their own (what an assistant's tool calls
and a ``ToolMessage`` become in the prompt), and `as_runnable` reads questions with `content_text`
without depending on the chat model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool

from branchwise.backends.base import DecodeParams
from branchwise.backends.text import TextStream
from branchwise.constraints import Constraint
from branchwise.toolcalls import ToolCall, ToolCallStream, normalize_tool_choice, normalize_tools

__all__ = [
    "ChatRequest",
    "ResponseTagFilter",
    "StreamPieces",
    "chat_messages",
    "content_text",
    "lc_tool_call",
    "strip_tool_responses",
]


def content_text(content: Any, *, assistant: bool = False) -> str:
    """The text of a message's content. An assistant's non-text blocks (``tool_use``, reasoning, ...)
    are dropped: its calls travel in ``tool_calls``. Other roles accept text (and JSON) only."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") == "json":
            parts.append(json.dumps(part.get("json"), ensure_ascii=False))
        elif assistant:
            continue
        else:
            raise ValueError("ChatBranchwise accepts text content only (no images, audio or files)")
    return "".join(parts)


def _call_id(call: Mapping[str, Any], i: int, j: int) -> str:
    return str(call.get("id") or f"call_{i}_{j}")


def answered_calls(chat: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The calls an OpenAI-shaped conversation (`chat_messages`) made and got a result for: each
    call's canonical form (`ToolCall.canonical`: name and arguments) -> the text of its last result."""
    made: dict[str, str] = {}  # call id -> canonical call
    answered: dict[str, str] = {}
    for m in chat:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") or {}
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                continue
            if isinstance(arguments, dict) and isinstance(fn.get("name"), str):
                made[str(call.get("id"))] = ToolCall(name=fn["name"], arguments=arguments).canonical()
        if m.get("role") == "tool" and m.get("tool_call_id") in made:
            answered[made[m["tool_call_id"]]] = str(m.get("content", ""))
    return answered


def chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as OpenAI-shaped dicts for `Backend.chat_prompt`: an assistant's tool calls
    as ``tool_calls`` (arguments as JSON text), a tool's result as role ``tool`` with its
    ``tool_call_id`` (and the tool's name where known)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # tool_call_id -> tool name, to name results that do not say
    for i, m in enumerate(messages):
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": content_text(m.content)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": content_text(m.content)})
        elif isinstance(m, AIMessage):
            entry: dict[str, Any] = {"role": "assistant", "content": content_text(m.content, assistant=True)}
            if m.tool_calls:
                entry["tool_calls"] = []
                for j, call in enumerate(m.tool_calls):
                    cid = _call_id(call, i, j)
                    names[cid] = call["name"]
                    entry["tool_calls"].append(
                        {
                            "id": cid,
                            "type": "function",
                            "function": {
                                "name": call["name"],
                                "arguments": json.dumps(call.get("args") or {}, ensure_ascii=False),
                            },
                        }
                    )
            out.append(entry)
        elif isinstance(m, ToolMessage):
            entry = {"role": "tool", "content": content_text(m.content), "tool_call_id": m.tool_call_id}
            name = m.name or names.get(m.tool_call_id)
            if name:
                entry["name"] = name
            out.append(entry)
        elif isinstance(m, FunctionMessage):  # the legacy function-calling result
            out.append({"role": "tool", "content": content_text(m.content), "name": m.name})
        elif isinstance(m, ChatMessage):
            role = {"human": "user", "ai": "assistant"}.get(m.role, m.role)
            out.append({"role": role, "content": content_text(m.content, assistant=role == "assistant")})
        else:
            out.append({"role": "user", "content": content_text(m.content)})
    return out


def lc_tool_call(call: ToolCall) -> dict[str, Any]:
    return {"name": call.name, "args": call.arguments, "id": call.id, "type": "tool_call"}


# A tool's result reaches the model inside <tool_response> tags (the Hermes format of chat templates
# with tools, and `render_messages`' fallback); a small model answering after one often copies the
# tags around its answer. The tags (each with the newline inside its block) are dropped from the
# reply's prose.
_RESPONSE_TAG = re.compile(r"<tool_response>\n?|\n?</tool_response>")
_TAG_FORMS = ("<tool_response>\n", "\n</tool_response>")


def strip_tool_responses(text: str) -> str:
    """`text` without echoed ``<tool_response>`` tags (their content stays), stripped: the answer a
    model gave by copying the tool's result block is the result itself."""
    return _RESPONSE_TAG.sub("", text).strip()


class ResponseTagFilter:
    """`strip_tool_responses` for streamed prose: the pieces it returns add up to
    ``strip_tool_responses(whole)``. It holds back a tail that may still grow into a tag (or be the
    newline a tag swallows) and whitespace that may turn out to end the reply."""

    def __init__(self) -> None:
        self.raw = ""
        self.sent = 0

    def _held(self) -> int:
        for k in range(min(len(self.raw), max(map(len, _TAG_FORMS))), 0, -1):
            tail = self.raw[-k:]
            if any(form.startswith(tail) for form in _TAG_FORMS):
                return k
        return 0

    def _emit(self, cleaned: str) -> str:
        new = cleaned[self.sent :]
        self.sent = max(self.sent, len(cleaned))
        return new

    def push(self, delta: str) -> str:
        self.raw += delta
        held = self._held()
        safe = self.raw[: len(self.raw) - held] if held else self.raw
        return self._emit(_RESPONSE_TAG.sub("", safe).lstrip().rstrip())

    def finish(self) -> str:
        return self._emit(strip_tool_responses(self.raw))


class StreamPieces:
    """One streamed reply's parts as it is decoded: text released where no stop string can begin
    any more (`TextStream`, the server's rule), then split into prose and calls when tools are
    bound. Together the parts are what `ChatBranchwise._message` makes of the finished reply. Each part comes with
    its call index (the position among the reply's calls; 0 for prose)."""

    def __init__(
        self,
        detokenize: Callable[[Sequence[int]], str],
        params: DecodeParams,
        tools: Any,
        *,
        strip_responses: bool = False,
    ) -> None:
        self.text = TextStream(detokenize, params)
        self.splitter = ToolCallStream(tools) if tools else None
        self.calls = 0
        self.tags = ResponseTagFilter() if strip_responses else None

    def _cleaned(self, parts: list[str | ToolCall], final: bool) -> list[str | ToolCall]:
        """Prose through the tag filter (when the history holds tool results); calls as they are."""
        if self.tags is None:
            return parts
        out: list[str | ToolCall] = []
        for part in parts:
            if isinstance(part, str):
                part = self.tags.push(part)
            elif rest := self.tags.finish():  # prose ends where the calls begin
                out.append(rest)
            if part:
                out.append(part)
        if final and (rest := self.tags.finish()):
            out.append(rest)
        return out

    def _indexed(self, parts: list[str | ToolCall]) -> list[tuple[str | ToolCall, int]]:
        out = []
        for part in parts:
            out.append((part, self.calls if isinstance(part, ToolCall) else 0))
            self.calls += isinstance(part, ToolCall)
        return out

    def _parts(self, delta: str) -> list[str | ToolCall]:
        if self.splitter is None:
            return [delta] if delta else []
        return self.splitter.push(delta) if delta else []

    def push(self, tokens: Sequence[int]) -> list[tuple[str | ToolCall, int]]:
        return self._indexed(self._cleaned(self._parts(self.text.push(tokens)), final=False))

    def finish(self, text: str, cut: bool = False) -> list[tuple[str | ToolCall, int]]:
        """The rest, given the finished reply's text (as the backend cut it; `cut`: by
        ``max_tokens``)."""
        parts = self._parts(self.text.finish(text))
        if self.splitter is not None:
            parts += self.splitter.finish(cut)
        return self._indexed(self._cleaned(parts, final=True))


def _tools_of(tools: Any) -> list[dict[str, Any]]:
    """Any tools LangChain accepts (BaseTool, functions, pydantic/TypedDict classes, OpenAI or
    Anthropic dicts) as normalized OpenAI function tools."""
    if not isinstance(tools, Sequence) or isinstance(tools, str):  # one tool
        tools = [tools]
    return normalize_tools([convert_to_openai_tool(t) for t in tools])


class ChatRequest:
    """What one call asks for: the prompt's messages and tools, and the decode constraint."""

    def __init__(self, kwargs: Mapping[str, Any]) -> None:
        tools = kwargs.get("tools")
        self.tools: list[dict[str, Any]] = _tools_of(tools) if tools else []
        choice = kwargs.get("tool_choice")
        if choice is not None and not self.tools:
            raise ValueError("tool_choice: no tools are bound (use bind_tools)")
        self.tool_choice = normalize_tool_choice(choice, self.tools) if self.tools else "none"
        constraints = []
        if self.tools and self.tool_choice != "none":
            parallel = kwargs.get("parallel_tool_calls")
            constraints.append(
                Constraint.of_tools(
                    self.tools,
                    self.tool_choice,
                    parallel_tool_calls=True if parallel is None else bool(parallel),
                )
            )
        response_format = kwargs.get("response_format")
        if isinstance(response_format, type):  # a pydantic class or a TypedDict, as ChatOpenAI takes
            constraints.append(Constraint.of_json_schema(convert_to_json_schema(response_format)))
        elif response_format is not None:
            made = Constraint.from_response_format(response_format)
            if made is not None:
                constraints.append(made)
        if kwargs.get("constraint") is not None:
            constraints.append(Constraint.model_validate(kwargs["constraint"]))
        if len(constraints) > 1:
            raise ValueError(
                "ChatBranchwise decodes under one constraint per call: bind tools (with a tool_choice "
                "other than 'none'), a response_format or a constraint, not several"
            )
        self.constraint: Constraint | None = constraints[0] if constraints else None
        self.prompt_tools = self.tools if self.tools and self.tool_choice != "none" else []
        # set by the chat model from the history: whether the reply's prose is cleaned of echoed
        # <tool_response> tags (`strip_tool_responses`), and the calls already answered there
        self.after_tool_results = False
        self.answered: dict[str, str] = {}

    @property
    def calls_tools(self) -> bool:
        return self.constraint is not None and self.constraint.kind == "tool_calls"
