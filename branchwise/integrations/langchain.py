"""LangChain / LangGraph plug-in: a local branchwise model as a langchain-core chat model, and a whole
branchwise strategy as one `Runnable` step.

* `ChatBranchwise` is a `BaseChatModel` over a local backend (the embedded SmolLM2 by default, any
  HF model, or a backend you already loaded): ``invoke``/``ainvoke``, ``batch``/``abatch``,
  ``stream``/``astream``, ``n`` samples (``generate`` returns all of them; ``invoke`` the first),
  stop sequences, ``usage_metadata`` and ``response_metadata`` (finish reason, log-probabilities).
  Every call submits its whole prompt to the backend's shared `Scheduler`, so ``batch`` (LangChain
  runs it on a thread pool) and ``abatch``/``asyncio.gather`` merge into shared decode passes, the
  ``n`` samples of one call fork one prefill, and a backend's prefix cache sees every prompt.
* Tool calling: ``bind_tools`` (anything LangChain converts to an OpenAI tool) with ``tool_choice``
  (``"auto"``, ``"none"``, ``"required"``/``"any"``, a tool's name or OpenAI's dict) shows the tools
  to the model (its own template's tool format, else branchwise's fallback prompt) and decodes
  under `Constraint.of_tools`: a ``<tool_call>`` block the model opens is forced to be a valid call
  of a bound tool, and ``"required"``/a name force one from the first token. The reply's blocks
  become ``AIMessage.tool_calls`` (the content is the prose around them); ``stream`` yields each
  call as a ``tool_call_chunk`` once its block closes. Earlier calls (``AIMessage.tool_calls``) and
  their results (``ToolMessage``) go back to the model as OpenAI-shaped assistant/``tool`` turns.
  A reply whose calls were all made and answered before in the conversation (same name, same
  arguments) ends an agent's loop: ``invoke`` returns their results as its content, with no tool
  calls, and ``response_metadata["branchwise"]["repeated_calls"]`` naming them (a small model
  otherwise repeats a call until the agent's step limit; ``stream`` yields calls as decoded).
* Structured output: ``with_structured_output(schema, method=...)`` for a pydantic class, a
  TypedDict or a JSON Schema: ``"json_schema"`` (default) decodes under the schema's grammar,
  ``"function_calling"`` forces a call of the schema as a tool, ``"json_mode"`` forces any JSON
  object; ``include_raw=True`` returns the message and the parsing error too. A bound
  ``response_format`` (OpenAI's object) or ``constraint`` (a `Constraint`) does the same by hand.
* `as_runnable(reasoner)` wraps a `Reasoner` (strategy + backend) as a `Runnable`: one step of an
  LCEL chain (``prompt | as_runnable(reasoner)``) or a LangGraph node, returning the answer with
  its votes, support, the chosen branch's text and the KV statistics.

Install with ``pip install 'branchwise[langchain]'``.

Streaming: `stream`/`astream` yield the reply as it is decoded (each decode step of the call's
row, on a backend whose `extend` takes a step listener; a whole reply at once on one that does not).
Text is held back where a stop string may begin (the server's rule, `TextStream`), and with tools
bound from where a ``<tool_call>`` tag may begin until it is known to be prose or a call; each
call is one ``tool_call_chunk`` when its block closes. The chunks add up to the ``invoke`` reply.
A consumer that stops reading cancels the rest of the decoding.

This module holds the chat model, the plug-in's documented import path (`as_runnable` included).
What the chat model only translates lives in `langchain_convert.py` (LangChain's messages, tools and
streamed parts to and from branchwise's shapes, with no model in sight), and `as_runnable` in
`langchain_runnable.py` (it runs a `Reasoner`, not this model).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from branchwise.backends.base import (
    OPENAI_FINISH,
    DecodeParams,
    DecodeStep,
    Generation,
    ShareMode,
    check_share,
)
from branchwise.backends.scheduler import BatchStats, Job
from branchwise.integrations._shared import ModelUse, Released, use_model
from branchwise.integrations.langchain_convert import (
    ChatRequest,
    StreamPieces,
    answered_calls,
    chat_messages,
    lc_tool_call,
    strip_tool_responses,
)
from branchwise.integrations.langchain_runnable import as_runnable
from branchwise.toolcalls import ToolCall, normalize_tool_choice, normalize_tools, split_calls

__all__ = ["ChatBranchwise", "as_runnable"]


class ChatBranchwise(BaseChatModel):
    """A langchain-core chat model over a local branchwise backend.

    ``ChatBranchwise()`` runs on the embedded SmolLM2-135M-Instruct; ``ChatBranchwise(model="...")``
    on any supported HF model or path; ``ChatBranchwise(backend=backend)`` on a loaded backend.
    A model given by name is loaded once per process and (device, dtype): every chat model, DSPy
    engine or command of that name shares it, and all of them batch together. Dropping a chat model
    frees its share; ``close()`` or ``with ChatBranchwise(...) as chat:`` releases it at once (the
    model itself goes when its last user does).

    Call-time keyword arguments (``model.invoke(x, temperature=0.7, n=3)`` or ``.bind(...)``)
    override the fields of the same name; ``tools``/``tool_choice``/``parallel_tool_calls``
    (what `bind_tools` binds), ``response_format`` (OpenAI's ``json_object``/``json_schema``
    object, or a pydantic class or TypedDict) and ``constraint`` (a `Constraint`) constrain the
    decoding.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    model_name: str | None = Field(None, alias="model")
    """HF hub id or local path; None = the embedded model. Only names the model with `backend`."""
    backend: Any = Field(None, exclude=True)
    """An already loaded `Backend` to share; None = load `model_name`."""
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    n: int = 1
    """samples per call: ``generate`` returns all, ``invoke`` the first"""
    stop: list[str] | None = Field(None, alias="stop_sequences")
    seed: int | None = None
    logprobs: bool = False
    """put each token's log-probability into ``response_metadata["logprobs"]``"""
    share: ShareMode = "exact"
    """KV sharing of the ``n`` samples: ``"exact"`` (prompt KV held once) or ``"none"``"""
    dtype: str = "auto"
    device: str = "auto"
    first_tool_choice: str | dict[str, Any] | bool | None = None
    """``tool_choice`` for an agent's first turn: a call with tools bound, no ``tool_choice`` given,
    and no tool result after the last user message. ``"required"`` makes a model that seldom calls
    tools on its own (the embedded 135M) act before it answers, while LangChain's agents (which bind
    tools without a ``tool_choice``) stay unchanged; later turns are ``"auto"``. None: always auto."""

    _scheduler: ModelUse = PrivateAttr()

    @model_validator(mode="after")
    def _load(self) -> ChatBranchwise:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        check_share(self.share)
        self._scheduler = use_model(
            self.model_name, self.backend, owner="this ChatBranchwise", dtype=self.dtype, device=self.device
        )
        self.backend = self._scheduler.backend
        return self

    def close(self) -> None:
        """Release this chat model's share of the model now (idempotent): its scheduler's worker
        thread stops if no other user is left, and the model is freed once nothing else holds it.
        Calling the chat model afterwards raises `RuntimeError`."""
        if not self._scheduler.closed:
            self.model_name = self._name()  # still named once the backend is gone
            self._scheduler.close()
            self.backend = Released("this ChatBranchwise")

    def __enter__(self) -> ChatBranchwise:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ LangChain metadata
    @property
    def _llm_type(self) -> str:
        return "branchwise"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self._name(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "n": self.n,
            "share": self.share,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "branchwise"
        params["ls_model_name"] = kwargs.get("model") or self._name()
        return params

    @property
    def batch_stats(self) -> BatchStats:
        """Batching achieved so far on this model's backend (shared with its other front ends)."""
        return self._scheduler.stats

    def _name(self) -> str:
        return self.model_name or str(getattr(self.backend, "model_name", None) or "embedded")

    # ------------------------------------------------------------------ tools and structured output
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: str | dict[str, Any] | bool | None = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind `tools` (anything `convert_to_openai_tool` takes) for the model to call.

        `tool_choice`: ``"auto"`` (default: the model decides; a call it opens is forced to be
        valid), ``"none"`` (no calls; the tools are not shown), ``"required"`` or ``"any"`` (at least
        one call), a tool's name or ``{"type": "function", "function": {"name": ...}}`` (a call of
        that tool), ``True`` (required). `parallel_tool_calls=False` allows one call per reply.
        `strict` is passed to `convert_to_openai_tool`; arguments always follow the tool's schema.
        """
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        # each tool is checked here (a bad name or schema fails at bind time, not at invoke);
        # two tools of one name fail when the model is called with them, as with OpenAI
        normalized = [normalize_tools([t])[0] for t in formatted]
        if tool_choice is not None:
            normalize_tool_choice(tool_choice, normalized)
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """A runnable that returns `schema`'s value (a pydantic instance, or a dict for a TypedDict or
        a JSON Schema) instead of a message.

        `method`: ``"json_schema"`` decodes the reply under the schema's grammar (nothing is added
        to the prompt: say what you want, as with OpenAI); ``"function_calling"`` shows `schema` as
        the one tool and forces a call of it (its name and field descriptions are in the prompt);
        ``"json_mode"`` forces some JSON object (describe the keys in the prompt) and parses it.
        `include_raw=True` returns ``{"raw": AIMessage, "parsed": value or None, "parsing_error":
        exception or None}`` instead of raising when the reply does not parse. `strict=False` lets
        ``json_schema`` objects take properties the schema does not name where it allows them.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        output_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        parser: Runnable[Any, Any]
        if method == "function_calling":
            tool_name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools(
                [schema],
                tool_choice=tool_name,
                parallel_tool_calls=False,
                strict=strict,
                ls_structured_output_format=output_format,
            )
            parser = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=tool_name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                json_schema = convert_to_json_schema(schema)
                response_format: dict[str, Any] = {
                    "type": "json_schema",
                    "json_schema": {
                        "name": json_schema.get("title", "output"),
                        "schema": json_schema,
                        "strict": strict is not False,
                    },
                }
            else:
                response_format = {"type": "json_object"}
                if schema is None:
                    output_format = {"kwargs": {"method": method}, "schema": None}
            llm = self.bind(response_format=response_format, ls_structured_output_format=output_format)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
        else:
            raise ValueError(
                f"method: expected 'json_schema', 'function_calling' or 'json_mode', got {method!r}"
            )
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks([fallback], exception_key="parsing_error")

    # ------------------------------------------------------------------ generation
    def _job(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[list[int], Job, bool, ChatRequest]:
        def opt(name: str) -> Any:
            value = kwargs.get(name)
            return getattr(self, name) if value is None else value

        n = opt("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive integer")
        stops = stop if stop is not None else kwargs.get("stop", self.stop)
        if isinstance(stops, str):
            stops = [stops]
        chat = chat_messages(messages)
        request = self._request(chat, kwargs)
        params = DecodeParams(
            temperature=float(opt("temperature")),
            top_p=float(opt("top_p")),
            max_tokens=int(opt("max_tokens")),
            stop=tuple(stops or ()),
            seed=opt("seed"),
            constraint=request.constraint,
        )
        if request.prompt_tools:
            prompt_ids = self.backend.chat_prompt(chat, tools=request.prompt_tools)
        else:
            prompt_ids = self.backend.chat_prompt(chat)
        job = Job(prompt=prompt_ids, n=n, params=params, share=self.share)
        return prompt_ids, job, bool(opt("logprobs")), request

    def _request(self, chat: list[dict[str, Any]], kwargs: dict[str, Any]) -> ChatRequest:
        """The call's `ChatRequest`, with `first_tool_choice` applied on an agent's first turn."""
        last_user = max((i for i, m in enumerate(chat) if m["role"] == "user"), default=-1)
        answered = any(m["role"] == "tool" for m in chat[last_user + 1 :])
        first = self.first_tool_choice
        if first is not None and kwargs.get("tools") and kwargs.get("tool_choice") is None and not answered:
            try:
                request = ChatRequest({**kwargs, "tool_choice": first})
            except ValueError as err:
                raise ValueError(f"first_tool_choice: {err}") from None
        else:
            request = ChatRequest(kwargs)
        request.after_tool_results = any(m["role"] == "tool" for m in chat)
        request.answered = answered_calls(chat)
        return request

    def _message(
        self, prompt_ids: list[int], gen: Generation, job: Job, want_logprobs: bool, request: ChatRequest
    ) -> dict[str, Any]:
        """Content, tool calls, usage and metadata of one sample's reply (AIMessage keyword arguments)."""
        content = gen.text
        calls: list[ToolCall] = []
        if request.calls_tools:
            content, calls = split_calls(gen.text, request.tools, cut=gen.finish_reason == "length")
        if request.after_tool_results:
            content = strip_tool_responses(content)
        repeated = [c.canonical() for c in calls if c.canonical() in request.answered]
        if calls and len(repeated) == len(calls):
            # every call was made and answered before: an agent would go round again with the same
            # results; the reply ends the loop with them instead (said in ["branchwise"])
            content = "\n".join(dict.fromkeys(request.answered[c] for c in repeated))
            calls = []
        metadata: dict[str, Any] = {
            # OpenAI's words (the backend's own reason is in ["branchwise"]["finish_reason"]):
            # "tool_calls" whenever a whole call came back, even if max_tokens cut a later one (the
            # cut call is dropped: `toolcalls.parse_tool_calls`)
            "finish_reason": "tool_calls"
            if calls
            else "stop"
            if repeated
            else OPENAI_FINISH.get(gen.finish_reason, "stop"),
            "model_name": self._name(),
            "model_provider": "branchwise",
            "branchwise": {
                "finish_reason": gen.finish_reason,
                "share": self.share,
                "batch_requests": job.batch_requests,
                "batch_rows": job.batch_rows,
                **({"repeated_calls": repeated} if repeated and not calls else {}),
                # decode steps that left the fast step, with their reasons (`Generation.notes`)
                "notes": list(gen.notes),
            },
        }
        if want_logprobs:
            metadata["logprobs"] = {
                "content": [
                    {"token": self.backend.decode([t]), "logprob": float(lp), "top_logprobs": []}
                    for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
                ]
            }
        usage = UsageMetadata(
            input_tokens=len(prompt_ids),
            output_tokens=len(gen.token_ids),
            total_tokens=len(prompt_ids) + len(gen.token_ids),
        )
        return {
            "content": content,
            "tool_calls": [lc_tool_call(c) for c in calls],
            "usage_metadata": usage,
            "response_metadata": metadata,
        }

    def _result(
        self,
        prompt_ids: list[int],
        gens: list[Generation],
        job: Job,
        want_logprobs: bool,
        request: ChatRequest,
    ) -> ChatResult:
        generations = []
        for g in gens:
            fields = self._message(prompt_ids, g, job, want_logprobs, request)
            info = {"finish_reason": fields["response_metadata"]["finish_reason"]}
            if want_logprobs:
                info["logprobs"] = fields["response_metadata"]["logprobs"]
            generations.append(ChatGeneration(message=AIMessage(**fields), generation_info=info))
        completion = sum(len(g.token_ids) for g in gens)
        # like OpenAI with n > 1: the prompt is counted once for the whole call
        token_usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        }
        return ChatResult(
            generations=generations, llm_output={"token_usage": token_usage, "model_name": self._name()}
        )

    def _combine_llm_outputs(self, llm_outputs: list[dict[str, Any] | None]) -> dict[str, Any]:
        """``generate``'s ``llm_output``: token usage summed over its prompts."""
        total: dict[str, int] = {}
        for out in llm_outputs:
            for key, value in ((out or {}).get("token_usage") or {}).items():
                total[key] = total.get(key, 0) + int(value)
        return {"token_usage": total, "model_name": self._name()}

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt_ids, job, want_logprobs, request = self._job(messages, stop, kwargs)
        gens = self._scheduler.submit(job)
        return self._result(prompt_ids, gens, job, want_logprobs, request)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt_ids, job, want_logprobs, request = self._job(messages, stop, kwargs)
        gens = await self._scheduler.submit_async(job)
        return self._result(prompt_ids, gens, job, want_logprobs, request)

    def _pieces(self, request: ChatRequest, params: DecodeParams) -> StreamPieces:
        return StreamPieces(
            self.backend.decode,
            params,
            request.tools if request.calls_tools else None,
            strip_responses=request.after_tool_results,
        )

    def _chunk(self, part: str | ToolCall, index: int) -> ChatGenerationChunk:
        if isinstance(part, str):
            return ChatGenerationChunk(message=AIMessageChunk(content=part))
        call = tool_call_chunk(
            name=part.name, args=json.dumps(part.arguments, ensure_ascii=False), id=part.id, index=index
        )
        return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[call]))

    def _last_chunk(
        self, prompt_ids: list[int], job: Job, want_logprobs: bool, request: ChatRequest
    ) -> ChatGenerationChunk:
        """The closing chunk: usage and metadata of the whole reply."""
        (gen,) = job.result()
        fields = self._message(prompt_ids, gen, job, want_logprobs, request)
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="",
                usage_metadata=fields["usage_metadata"],
                response_metadata=fields["response_metadata"],
                chunk_position="last",
            ),
            generation_info={"finish_reason": fields["response_metadata"]["finish_reason"]},
        )

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        kwargs["n"] = 1
        prompt_ids, job, want_logprobs, request = self._job(messages, stop, kwargs)
        events: queue.SimpleQueue[DecodeStep | None] = queue.SimpleQueue()
        job.on_step = events.put  # from the worker thread, after each decode step of this job
        job.on_done = lambda _: events.put(None)  # after its last step
        self._scheduler.enqueue(job)
        pieces = self._pieces(request, job.params)
        try:
            while (step := events.get()) is not None:
                for part, index in pieces.push(step.tokens.get(0, ())):
                    chunk = self._chunk(part, index)
                    if run_manager is not None and chunk.text:
                        run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
            (gen,) = job.result()
            for part, index in pieces.finish(gen.text, gen.finish_reason == "length"):
                chunk = self._chunk(part, index)
                if run_manager is not None and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            yield self._last_chunk(prompt_ids, job, want_logprobs, request)
        finally:
            if not job.done.is_set():  # the consumer stopped reading: stop decoding for it
                self._scheduler.cancel(job)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        kwargs["n"] = 1
        prompt_ids, job, want_logprobs, request = self._job(messages, stop, kwargs)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[DecodeStep | None] = asyncio.Queue()

        def put(event: DecodeStep | None) -> None:  # on the worker thread
            with contextlib.suppress(RuntimeError):  # the reader's loop has closed: nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        job.on_step = put
        job.on_done = lambda _: put(None)
        self._scheduler.enqueue(job)
        pieces = self._pieces(request, job.params)
        try:
            while (step := await events.get()) is not None:
                for part, index in pieces.push(step.tokens.get(0, ())):
                    chunk = self._chunk(part, index)
                    if run_manager is not None and chunk.text:
                        await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                    yield chunk
            (gen,) = job.result()
            for part, index in pieces.finish(gen.text, gen.finish_reason == "length"):
                chunk = self._chunk(part, index)
                if run_manager is not None and chunk.text:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
            yield self._last_chunk(prompt_ids, job, want_logprobs, request)
        finally:
            if not job.done.is_set():  # the consumer stopped reading (or was cancelled)
                self._scheduler.cancel(job)
