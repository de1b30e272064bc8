"""Requests translated into what the server computes: an OpenAI chat or text completion becomes a
`Completion` (the parsed request, its prompt's token ids, the messages a strategy run reads, the
echo), and the tokenizer endpoints' bodies become token ids or text.

Why its own module: parsing and prompt building are the same whatever happens next (a strategy
run, a stream, whole choices: `completions.py`), and they are where a malformed request is refused
with a 400 naming its field, before anything is queued.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from branchwise.backends.base import Backend
from branchwise.serve.errors import RequestError, json_object, parse
from branchwise.serve.protocol import ChatMessage, ChatRequest, CompletionRequest
from branchwise.serve.replies import CHAT, TEXT, Kind
from branchwise.serve.server import Server

__all__ = ["Completion", "chat_completion", "detokenized", "text_completion", "tokenized"]


@dataclass(frozen=True)
class Completion:
    """One completion request, ready to answer."""

    kind: Kind
    req: ChatRequest | CompletionRequest
    prompt: list[int]
    field: str
    """The request field the prompt came from (errors about it name it)."""
    messages: list[dict[str, Any]]
    """The conversation a strategy run answers (a text prompt: one user message)."""
    echo: str = ""
    """Prompt text a text completion echoes before its choices (``echo``)."""


def chat_completion(server: Server, body: bytes) -> Completion:
    """``/v1/chat/completions``: the messages, and the tools shown to the model, as its prompt."""
    req: ChatRequest = parse(ChatRequest, body)
    if req.stream and req.logprobs:
        raise RequestError(400, "logprobs: not supported together with stream", "logprobs")
    messages = _messages(req.messages)
    prompt = _chat_prompt(server.backend, messages, req.shown_tools)
    return Completion(CHAT, req, prompt, "messages", messages)


def text_completion(server: Server, body: bytes) -> Completion:
    """``/v1/completions``: a text prompt, or token ids (checked against the vocabulary)."""
    backend = server.backend
    req: CompletionRequest = parse(CompletionRequest, body)
    if req.stream and req.logprobs is not None:
        raise RequestError(400, "logprobs: not supported together with stream", "logprobs")
    if isinstance(req.prompt, str):
        prompt_text, prompt = req.prompt, backend.encode(req.prompt)
    else:
        # ids (`CompletionRequest` unwraps a list of one prompt); the text is decoded only if echo
        # or a strategy asks
        prompt, prompt_text = list(cast(list[int], req.prompt)), None
        server.check_ids(prompt, "prompt")
    wants_text = req.echo or (req.branchwise is not None and req.branchwise.strategy is not None)
    text = (prompt_text if prompt_text is not None else backend.decode(prompt)) if wants_text else ""
    messages = [{"role": "user", "content": text}]
    return Completion(TEXT, req, prompt, "prompt", messages, text if req.echo else "")


def tokenized(backend: Backend, body: bytes) -> list[int]:
    """``/tokenize`` (vLLM's): text, or chat messages and tools with the generation prompt appended."""
    data = json_object(body)
    if "messages" in data:
        fields = {k: data[k] for k in ("messages", "tools", "tool_choice") if k in data}
        req = parse(ChatRequest, json.dumps(fields).encode())
        return _chat_prompt(backend, _messages(req.messages), req.shown_tools)
    if isinstance(data.get("prompt"), str):
        return backend.encode(data["prompt"])
    raise RequestError(400, "prompt: give a string prompt or messages", "prompt")


def detokenized(server: Server, body: bytes) -> str:
    """``/detokenize``: token ids (integers inside the vocabulary; JSON's booleans are not ids)."""
    tokens = json_object(body).get("tokens")
    if not isinstance(tokens, list):
        raise RequestError(400, "tokens: give a list of token ids (integers >= 0)", "tokens")
    for i, t in enumerate(tokens):  # `type`, not isinstance: JSON's true is no token id
        if type(t) is not int or t < 0:
            raise RequestError(
                400,
                f"tokens[{i}]: a token id is an integer >= 0 (got {json.dumps(t)[:40]})",
                "tokens",
            )
    server.check_ids(tokens, "tokens")
    return server.backend.decode(tokens)


def _messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as `Backend.chat_prompt` takes them (OpenAI-shaped dicts)."""
    try:
        return [m.as_dict() for m in messages]
    except ValueError as err:
        raise RequestError(400, str(err), "messages") from None


def _chat_prompt(
    backend: Backend, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    """The prompt's token ids; the tools shown in the model's template or the fallback prompt."""
    if not tools:
        return backend.chat_prompt(messages)
    if "tools" not in inspect.signature(backend.chat_prompt).parameters:  # e.g. RemoteBackend's
        raise RequestError(400, f"tools: the {backend.name} backend cannot show tools to its model", "tools")
    return backend.chat_prompt(messages, tools)
