"""LangChain / LangGraph plug-in: a local branchwise model as a langchain-core chat model, and a whole
branchwise strategy as one `Runnable` step.

* `ChatBranchwise` is a `BaseChatModel` over a local backend (the embedded SmolLM2 by default, any
  HF model, or a backend you already loaded): ``invoke``/``ainvoke``, ``batch``/``abatch``,
  ``stream``/``astream``, ``n`` samples (``generate`` returns all of them; ``invoke`` the first),
  stop sequences, ``usage_metadata`` and ``response_metadata`` (finish reason, log-probabilities).
  Every call submits its whole prompt to the backend's shared `Scheduler`, so ``batch`` (LangChain
  runs it on a thread pool) and ``abatch``/``asyncio.gather`` merge into shared decode passes, the
  ``n`` samples of one call fork one prefill, and a backend's prefix cache sees every prompt.
* `as_runnable(reasoner)` wraps a `Reasoner` (strategy + backend) as a `Runnable`: one step of an
  LCEL chain (``prompt | as_runnable(reasoner)``) or a LangGraph node, returning the answer with
  its votes, support, the chosen branch's text and the KV statistics.

Install with ``pip install 'branchwise[langchain]'``.

Streaming: the decode loop has no per-token callback, so `stream` yields the reply token by token
once its batch has decoded (the text equals the non-streamed one), as ``branchwise serve`` does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda
from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from branchwise.backends.base import DecodeParams, Generation, ShareMode
from branchwise.backends.scheduler import BatchStats, Job, Scheduler

if TYPE_CHECKING:
    from branchwise.reasoners.reasoner import Reasoner

__all__ = ["ChatBranchwise", "as_runnable"]

_FINISH = {"eos": "stop", "stop": "stop", "delimiter": "stop", "length": "length"}
"""Backend finish reasons in OpenAI's words (what LangChain users read in ``finish_reason``)."""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            raise ValueError("ChatBranchwise accepts text content only (no images, audio or files)")
    return "".join(parts)


def _chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as role/content dicts for the tokenizer's chat template."""
    out = []
    for m in messages:
        if isinstance(m, SystemMessage):
            role = "system"
        elif isinstance(m, HumanMessage):
            role = "user"
        elif isinstance(m, AIMessage):
            role = "assistant"
        elif isinstance(m, ToolMessage):  # a tool's output, read by the model as user text
            role = "user"
        elif isinstance(m, ChatMessage):
            role = {"human": "user", "ai": "assistant"}.get(m.role, m.role)
        else:
            role = "user"
        out.append({"role": role, "content": _content_text(m.content)})
    return out


def _clip(pieces: list[str], text: str) -> list[str]:
    """Token pieces whose concatenation is exactly `text` (the final reply, cut before a stop string)."""
    out: list[str] = []
    total = 0
    for p in pieces:
        if total >= len(text):
            break
        out.append(p[: len(text) - total])
        total += len(out[-1])
    if "".join(out) != text:  # decoding prefixes disagreed with the final text: one piece
        return [text] if text else []
    return [p for p in out if p]


class ChatBranchwise(BaseChatModel):
    """A langchain-core chat model over a local branchwise backend.

    ``ChatBranchwise()`` loads the embedded SmolLM2-135M-Instruct; ``ChatBranchwise(model="...")``
    any supported HF model or path; ``ChatBranchwise(backend=backend)`` shares a loaded backend
    (with DSPy's `BranchwiseEngine`, other chat models, ...): all of them then batch together.

    Call-time keyword arguments (``model.invoke(x, temperature=0.7, n=3)`` or ``.bind(...)``)
    override the fields of the same name.
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

    _scheduler: Scheduler = PrivateAttr()

    @model_validator(mode="after")
    def _load(self) -> ChatBranchwise:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
        if self.share not in ("none", "exact"):
            raise ValueError(f"share={self.share!r} is not one of 'none', 'exact'")
        if self.backend is None:
            from branchwise.backends.hf import HFBackend

            self.backend = HFBackend(self.model_name, dtype=self.dtype, device=self.device)
        from branchwise.integrations._shared import shared_scheduler

        self._scheduler = shared_scheduler(self.backend)
        return self

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

    # ------------------------------------------------------------------ generation
    def _job(
        self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> tuple[list[int], Job, bool]:
        def opt(name: str) -> Any:
            value = kwargs.get(name)
            return getattr(self, name) if value is None else value

        n = opt("n")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive integer")
        stops = stop if stop is not None else kwargs.get("stop", self.stop)
        if isinstance(stops, str):
            stops = [stops]
        params = DecodeParams(
            temperature=float(opt("temperature")),
            top_p=float(opt("top_p")),
            max_tokens=int(opt("max_tokens")),
            stop=tuple(stops or ()),
            seed=opt("seed"),
        )
        prompt_ids = self.backend.chat_prompt(_chat_messages(messages))
        return prompt_ids, Job(prompt=prompt_ids, n=n, params=params, share=self.share), bool(opt("logprobs"))

    def _message(
        self, prompt_ids: list[int], gen: Generation, job: Job, want_logprobs: bool, chunk: bool = False
    ) -> dict[str, Any]:
        """Content, usage and metadata of one sample's reply (as AIMessage keyword arguments)."""
        metadata: dict[str, Any] = {
            "finish_reason": _FINISH.get(gen.finish_reason, "stop"),
            "model_name": self._name(),
            "model_provider": "branchwise",
            "branchwise": {
                "finish_reason": gen.finish_reason,
                "share": self.share,
                "batch_requests": job.batch_requests,
                "batch_rows": job.batch_rows,
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
        return {"content": gen.text, "usage_metadata": usage, "response_metadata": metadata}

    def _result(
        self, prompt_ids: list[int], gens: list[Generation], job: Job, want_logprobs: bool
    ) -> ChatResult:
        generations = []
        for g in gens:
            fields = self._message(prompt_ids, g, job, want_logprobs)
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
        prompt_ids, job, want_logprobs = self._job(messages, stop, kwargs)
        gens = self._scheduler.submit(job)
        return self._result(prompt_ids, gens, job, want_logprobs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        prompt_ids, job, want_logprobs = self._job(messages, stop, kwargs)
        gens = await self._scheduler.submit_async(job)
        return self._result(prompt_ids, gens, job, want_logprobs)

    def _chunks(
        self, prompt_ids: list[int], gen: Generation, job: Job, want_logprobs: bool
    ) -> Iterator[ChatGenerationChunk]:
        """The reply cut at token boundaries (each piece's text is what the token adds)."""
        fields = self._message(prompt_ids, gen, job, want_logprobs)
        pieces: list[str] = []
        shown = ""
        for i in range(1, len(gen.token_ids) + 1):
            text = self.backend.decode(gen.token_ids[:i])
            # a token that ends inside a multi-byte character decodes to a replacement char: wait
            if not text.endswith("\ufffd") and text.startswith(shown) and len(text) > len(shown):
                pieces.append(text[len(shown) :])
                shown = text
        pieces = _clip(pieces, gen.text)
        for piece in pieces:
            yield ChatGenerationChunk(message=AIMessageChunk(content=piece))
        yield ChatGenerationChunk(
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
        prompt_ids, job, want_logprobs = self._job(messages, stop, kwargs)
        (gen,) = self._scheduler.submit(job)
        for chunk in self._chunks(prompt_ids, gen, job, want_logprobs):
            if run_manager is not None and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        kwargs["n"] = 1
        prompt_ids, job, want_logprobs = self._job(messages, stop, kwargs)
        (gen,) = await self._scheduler.submit_async(job)
        for chunk in self._chunks(prompt_ids, gen, job, want_logprobs):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk


# --------------------------------------------------------------------------------------------------
# A whole strategy as one Runnable
# --------------------------------------------------------------------------------------------------


def _question(value: Any, input_key: str) -> str:
    """The question in what an LCEL step receives: a string, a dict (``input_key``), a prompt value,
    a message or a list of messages (the last human message)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if input_key not in value:
            raise KeyError(f"the input dict has no {input_key!r} key (keys: {sorted(value)})")
        return _question(value[input_key], input_key)
    to_messages = getattr(value, "to_messages", None)  # ChatPromptValue / StringPromptValue
    if callable(to_messages):
        value = to_messages()
    if isinstance(value, BaseMessage):
        return _content_text(value.content)
    if isinstance(value, Sequence):
        humans = [m for m in value if isinstance(m, HumanMessage)]
        if humans:
            return _content_text(humans[-1].content)
    raise TypeError(f"cannot read a question from {type(value).__name__}")


def _output(result: Any) -> dict[str, Any]:
    chosen = next((b for b in result.branches if b.selected), result.branches[0] if result.branches else None)
    return {
        "answer": result.answer,
        "votes": dict(result.votes),
        "support": result.support,
        "text": chosen.text if chosen is not None else "",
        "strategy": result.strategy,
        "kv_stats": dict(result.kv_stats),
        "result": result,
    }


def as_runnable(reasoner: Reasoner, *, input_key: str = "question", name: str | None = None) -> Runnable:
    """A whole branchwise strategy as one LangChain `Runnable` (an LCEL step or a LangGraph node).

    Input: a question string, a dict holding it under `input_key`, a prompt value or messages (the
    last human message is the question). Output: a dict with ``answer``, ``votes``, ``support``,
    ``text`` (the chosen branch), ``strategy``, ``kv_stats`` and ``result`` (the full
    `ReasoningResult`). ``ainvoke`` awaits `Reasoner.arun` (the strategy in a worker thread), so
    concurrent async runs do not block the event loop.

    (This is the ``Reasoner.as_runnable()`` of the integration: a function here, so `Reasoner`
    itself does not depend on langchain-core.)
    """

    def run(value: Any) -> dict[str, Any]:
        return _output(reasoner.run(_question(value, input_key)))

    async def arun(value: Any) -> dict[str, Any]:
        return _output(await reasoner.arun(_question(value, input_key)))

    return RunnableLambda(run, afunc=arun, name=name or f"branchwise-{reasoner.strategy.name}")
