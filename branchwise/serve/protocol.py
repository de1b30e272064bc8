"""Request bodies of the OpenAI-compatible server, as pydantic models.

Why pydantic: every bad field becomes an HTTP 400 that names the field and what is allowed (the
server's validation handler turns pydantic's error list into OpenAI's error shape), instead of a
500 from deep inside the backend. Ranges follow the OpenAI API where it has one (temperature 0-2,
top_logprobs 0-20) and the backend's `DecodeParams` otherwise.

Fields the server cannot honour are refused with a 400 naming them, never dropped silently (a
client that asked for a penalty or an audio reply must not get a plain reply back as if it had been
honoured); a field's no-op value (``frequency_penalty: 0``, ``logit_bias: {}``,
``modalities: ["text"]``) is accepted. Only fields that change nothing in the reply are ignored
(`IGNORED`: ``user``, ``metadata``, ``store``, ...); docs/SERVING.md lists them and why.

``tools`` / ``tool_choice`` / ``parallel_tool_calls`` and ``response_format`` become the request's
`Constraint` (`_Request.constraint`), checked here: an invalid JSON Schema, an unknown tool in
``tool_choice`` or history tool arguments that are not JSON are 400s before any model is touched.

Extensions beyond OpenAI, all optional: vLLM's ``min_tokens`` and ``return_tokens_as_token_ids``
(so clients written for vLLM work unchanged), and the ``branchwise`` object (`BranchwiseOptions`,
sent as ``extra_body``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from branchwise.backends.base import DecodeParams, ShareMode
from branchwise.constraints import Constraint

__all__ = [
    "IGNORED",
    "BranchwiseOptions",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "MessageToolCall",
]

TokenId = Annotated[int, Field(ge=0, strict=True)]
"""A token id: strict, so that JSON's ``true`` is refused rather than read as token 1."""
MAX_N = 128
MAX_TOKENS = 131072

IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring; this server monitors nothing",
    "safety_identifier": "an end-user id for abuse monitoring; this server monitors nothing",
    "metadata": "tags for stored completions; this server stores nothing",
    "store": "this server stores no completions",
    "service_tier": "this server has one tier",
    "prompt_cache_key": "a cache-routing hint; the prefix cache matches prompts by their tokens",
    "prediction": "a predicted output only speeds a reply up; the reply is the same without it",
}
"""Request fields accepted and ignored, with why: none of them changes a reply."""

_NO_OP: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((None, 0), "penalties are not implemented"),
    "presence_penalty": ((None, 0), "penalties are not implemented"),
    "repetition_penalty": ((None, 1), "penalties are not implemented"),
    "logit_bias": ((None, {}), "token biases are not implemented"),
    "modalities": ((None, ["text"]), "this server replies with text only"),
    "audio": ((None,), "this server replies with text only"),
    "functions": ((None,), "the legacy functions API is not supported; send tools"),
    "function_call": ((None,), "the legacy functions API is not supported; send tool_choice"),
    "reasoning_effort": ((None,), "not supported; a served model reasons as it was trained to"),
    "verbosity": ((None,), "not supported; set max_tokens"),
    "web_search_options": ((None,), "this server has no web search"),
    "top_k": ((None, 0, -1), "top-k sampling is not implemented; use top_p"),
    "min_p": ((None, 0), "min-p sampling is not implemented; use top_p"),
    "best_of": ((None, 1), "not supported; send n and pick, or run a strategy (branchwise.strategy)"),
    "suffix": ((None, ""), "insertion (a suffix after the completion) is not supported"),
    "include_stop_str_in_output": ((None, False), "a stop string is always cut from the text"),
    "skip_special_tokens": ((None, True), "special tokens are always skipped in the text"),
    "ignore_eos": ((None, False), "not supported; set min_tokens"),
}
"""Fields refused with a 400 unless they hold a value that changes nothing (the tuple), with why."""


def _refuse_unsupported(cls: type[BaseModel], data: Any) -> Any:
    """A 400 naming each field the server cannot honour; drop the harmless ones (`IGNORED`)."""
    if not isinstance(data, Mapping):
        return data
    problems = []
    for key, value in data.items():
        if key in cls.model_fields or key in IGNORED:
            continue
        if key in _NO_OP:
            allowed, why = _NO_OP[key]
            if any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed):
                continue
            problems.append(f"{key}: {why} (got {value!r})")
        else:
            problems.append(f"{key}: not supported by this server")
    if problems:
        raise ValueError("; ".join(problems))
    return {k: v for k, v in data.items() if k not in IGNORED and k not in _NO_OP}


def _one_line(err: ValidationError) -> str:
    return "; ".join(e["msg"].removeprefix("Value error, ") for e in err.errors())


class BranchwiseOptions(BaseModel):
    """The ``branchwise`` extension field.

    ``strategy`` runs a whole strategy server-side (a prebuilt name, whose knobs are ``branches``,
    ``tokens`` and ``verifier`` plus the request's ``temperature`` and ``seed``, or a full strategy
    spec as JSON); the reply then carries the answer, the votes and the KV stats. Without it, the
    remaining fields tune a plain completion: ``share`` the KV sharing of its ``n`` samples,
    ``details`` adds each choice's token ids, top-1 probabilities and backend finish reason,
    ``step_delimiter`` ends a reasoning step (kept in the text), ``score_candidates`` returns the
    log-probability of each candidate token at the first generated position (what `RemoteBackend`'s
    `score_next` needs, exactly and in one forward), ``constraint`` any `Constraint` (regex, choice,
    tool calls, ... as `Constraint.model_dump` writes it: what a `RemoteBackend` can forward from
    its `DecodeParams`), instead of ``response_format`` / ``tools``.
    """

    model_config = ConfigDict(extra="forbid")

    strategy: str | dict[str, Any] | None = None
    branches: int | None = Field(None, ge=1, le=4096)
    tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    verifier: str | None = None
    share: ShareMode | None = None
    details: bool = False
    step_delimiter: str | None = Field(None, min_length=1)
    score_candidates: list[TokenId] | None = Field(None, min_length=1, max_length=4096)
    constraint: Constraint | None = None

    @model_validator(mode="after")
    def _knobs_need_a_strategy(self) -> BranchwiseOptions:
        if self.strategy is None:
            for name in ("branches", "tokens", "verifier"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} sets a prebuilt strategy's parameter; give strategy too")
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1, as OpenAI's")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    response_format: dict[str, Any] | None = None
    branchwise: BranchwiseOptions | None = None

    _constraint: Constraint | None = PrivateAttr(None)
    _source: str = PrivateAttr("")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        return _refuse_unsupported(cls, data)

    @model_validator(mode="after")
    def _strategy_replies_once(self) -> _Request:
        if self.branchwise is not None and self.branchwise.strategy is not None:
            if self.n != 1:
                raise ValueError("n: a strategy request returns one choice; set branchwise.branches")
            if self.stream:
                raise ValueError("stream: a strategy request is answered whole, not streamed")
        return self

    @model_validator(mode="after")
    def _response_format(self) -> _Request:
        if self.response_format is not None:
            try:
                self._set_constraint(Constraint.from_response_format(self.response_format), "response_format")
            except ValidationError as err:
                raise ValueError(f"response_format: {_one_line(err)}") from None
        if self.branchwise is not None and self.branchwise.constraint is not None:
            self._set_constraint(self.branchwise.constraint, "branchwise.constraint")
        return self

    def constrain(self, constraint: Constraint, field: str) -> None:
        """Decode the reply under `constraint`, which the server read from `field` (a request that
        has a constraint of its own keeps it: one grammar per reply)."""
        self._set_constraint(constraint, field)

    def _set_constraint(self, constraint: Constraint | None, field: str) -> None:
        """Take the request's one constraint; a second one is refused (one grammar per reply)."""
        if constraint is None:
            return
        if self._constraint is not None:
            raise ValueError(
                f"{field}: one constraint per request; it cannot be combined with {self._source}"
            )
        self._constraint, self._source = constraint, field

    @property
    def constraint(self) -> Constraint | None:
        """What the reply must look like (from tools, response_format or branchwise.constraint)."""
        return self._constraint

    @property
    def constraint_field(self) -> str:
        """The request field the constraint came from (what an error about it names)."""
        return self._source or "constraint"

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def decode_params(self, max_tokens: int) -> DecodeParams:
        """The backend's decoding parameters; stop strings and the step delimiter are handled by the
        backend (text cut before a stop string, the delimiter kept)."""
        opts = self.branchwise or BranchwiseOptions()
        return DecodeParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=self.stops(),
            step_delimiter=opts.step_delimiter,
            seed=self.seed,
            constraint=self._constraint,
        )


class _Function(BaseModel):
    model_config = ConfigDict(extra="ignore")  # the SDK's stream accumulator adds parsed_arguments

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = ""

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str | dict[str, Any]) -> str:
        """Arguments as a JSON string holding an object (an object is accepted and written as one)."""
        if isinstance(value, dict):
            return json.dumps(value, ensure_ascii=False)
        if value.strip():
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"not valid JSON ({err.msg} at char {err.pos})") from None
            if not isinstance(parsed, dict):
                raise ValueError("must be a JSON object")
        return value


class MessageToolCall(BaseModel):
    """A call of an earlier assistant turn, as OpenAI's replies carry it and clients send it back
    (with what the SDK adds to it, e.g. a streamed call's ``index``: ignored)."""

    model_config = ConfigDict(extra="ignore")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: _Function


class ChatMessage(BaseModel):
    """One message. Fields an SDK echoes back from a reply (``refusal``, ``annotations``, ``audio``)
    are ignored: they describe the reply, not the conversation."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: a tool message names the call it answers")
        return self

    def text(self) -> str:
        """The message text; content parts must all be text (this server reads no images)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("messages: only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The message as `Backend.chat_prompt` takes it (OpenAI's shape, content as text)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    _tools: list[dict[str, Any]] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _tool_history(self) -> ChatRequest:
        """Each tool result answers a call an earlier assistant message made."""
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            calls.update(c.id for c in m.tool_calls or ())
            if m.role == "tool" and m.tool_call_id not in calls:
                raise ValueError(
                    f"messages[{i}].tool_call_id: {m.tool_call_id!r} answers no tool call of an "
                    "earlier assistant message"
                )
        return self

    @model_validator(mode="after")
    def _tools_constraint(self) -> ChatRequest:
        if self.tools is None:
            if self.tool_choice is not None:
                raise ValueError("tool_choice: needs tools")
            return self
        for i, tool in enumerate(self.tools):
            if isinstance(tool, dict) and tool.get("type", "function") != "function":
                raise ValueError(
                    f"tools[{i}].type: only 'function' tools are supported, got {tool['type']!r}"
                )
        try:
            constraint = Constraint.of_tools(
                self.tools,
                "auto" if self.tool_choice is None else self.tool_choice,
                parallel_tool_calls=self.parallel_tool_calls is not False,
            )
        except ValidationError as err:
            raise ValueError(f"tools: {_one_line(err)}") from None
        if constraint is not None:  # tool_choice "none": the tools are neither shown nor called
            self._tools = list(constraint.tools)
            self._set_constraint(constraint, "tools")
        return self

    @property
    def shown_tools(self) -> list[dict[str, Any]] | None:
        """The normalized tools the prompt shows (None without tools or with tool_choice "none")."""
        return self._tools

    def token_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 512

    def budget_set(self) -> bool:
        """Whether the client chose the budget (a default one is clamped to the context instead)."""
        return self.max_completion_tokens is not None or self.max_tokens is not None


class CompletionRequest(_Request):
    """``POST /v1/completions``: one prompt, as text or token ids (a list of one prompt is accepted)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    max_tokens: int = Field(16, ge=1, le=MAX_TOKENS)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    return_tokens_as_token_ids: bool = False

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ValueError("prompt: this server takes one prompt per request (send several requests)")
            self.prompt = p[0]
        if not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo: prompt log-probabilities are not supported; drop echo or logprobs")
        return self

    def token_budget(self) -> int:
        return self.max_tokens

    def budget_set(self) -> bool:
        """Whether the client chose the budget (a default one is clamped to the context instead)."""
        return "max_tokens" in self.model_fields_set
