"""Request bodies of the OpenAI-compatible server, as pydantic models.

Why pydantic: every bad field becomes an HTTP 400 that names the field and what is allowed (the
server's validation handler turns pydantic's error list into OpenAI's error shape), instead of a
500 from deep inside the backend. Ranges follow the OpenAI API where it has one (temperature 0-2,
top_logprobs 0-20) and the backend's `DecodeParams` otherwise. Fields the server cannot honour
are ignored, as OpenAI-compatible servers do, so clients that always send them keep working.

Extensions beyond OpenAI, all optional: vLLM's ``min_tokens`` and ``return_tokens_as_token_ids``
(so clients written for vLLM work unchanged), and the ``branchwise`` object (`BranchwiseOptions`,
sent as ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from branchwise.backends.base import DecodeParams, ShareMode

__all__ = ["BranchwiseOptions", "ChatMessage", "ChatRequest", "CompletionRequest"]

TokenId = Annotated[int, Field(ge=0)]
MAX_N = 128
MAX_TOKENS = 131072


class BranchwiseOptions(BaseModel):
    """The ``branchwise`` extension field.

    ``strategy`` runs a whole strategy server-side (a prebuilt name, whose knobs are ``branches``,
    ``tokens`` and ``verifier`` plus the request's ``temperature`` and ``seed``, or a full strategy
    spec as JSON); the reply then carries the answer, the votes and the KV stats. Without it, the
    remaining fields tune a plain completion: ``share`` the KV sharing of its ``n`` samples,
    ``details`` adds each choice's token ids, top-1 probabilities and backend finish reason,
    ``step_delimiter`` ends a reasoning step (kept in the text), ``score_candidates`` returns the
    log-probability of each candidate token at the first generated position (what `RemoteBackend`'s
    `score_next` needs, exactly and in one forward).
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

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="default 1, as OpenAI's")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(None, max_length=16)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    branchwise: BranchwiseOptions | None = None

    @model_validator(mode="after")
    def _strategy_replies_once(self) -> _Request:
        if self.branchwise is not None and self.branchwise.strategy is not None:
            if self.n != 1:
                raise ValueError("n: a strategy request returns one choice; set branchwise.branches")
            if self.stream:
                raise ValueError("stream: a strategy request is answered whole, not streamed")
        return self

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
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

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


class ChatRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs=true")
        return self

    def token_budget(self) -> int:
        return self.max_completion_tokens or self.max_tokens or 512


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
