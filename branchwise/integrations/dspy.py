"""DSPy plug-in: run unchanged DSPy programs on a local branchwise backend, and branchwise
strategies as DSPy modules.

Why this exists: DSPy's own answer for local models is "start an inference server" (SGLang, vLLM,
Ollama) and point `dspy.LM` at it; plain HF transformers behind a `BaseLM` serialises every thread of
`dspy.Evaluate` and recomputes the prompt for each of the `n` samples. `BranchwiseLM` instead keeps
the model in-process and does what a server would do:

* **n samples share the prompt KV**: one `prefill`, `fork(n)`, one batched `extend`, so the prompt
  is computed (and, with ``share="exact"``, held and read) once for all samples;
* **concurrent calls are batched**: DSPy threads (``Evaluate(num_threads=16)``, ``Module.batch``,
  ``Parallel``) enqueue requests; a single worker drains the queue and decodes every queued request
  with the same decoding parameters in ONE `extend` over all their branches. With greedy decoding the
  batched tokens equal the serial ones (the backend's batched decode is exact), so threaded and
  serial evaluations agree.

`Reason` goes the other way: it wraps any branchwise strategy (self-consistency, best-of-n, ...) as a
`dspy.Module` with a signature, so a strategy can sit inside a larger DSPy program.

Two ways to plug the model into DSPy:

* **`BranchwiseEngine`** (DSPy >= 3.4, the contract DSPy 3.5 keeps): ``dspy.LM("branchwise/<name>",
  engine=engine, async_engine=engine.async_engine())`` or simply `branchwise_lm(...)`. DSPy owns the
  cache, retries, history and the ``n`` fan-out (it sends the ``n`` candidates as ``n`` one-sample
  requests); the engine answers one canonical `dspy.lm15.Request` with one `dspy.lm15.Response`.
  Requests go whole (the full prompt) through the backend's shared `Scheduler`, so concurrent
  threads and ``asyncio.gather`` merge into shared decode passes, and a backend that keeps a prefix
  cache reuses the prompt for candidates 2..n.
* **`BranchwiseLM`** (DSPy 3.3 and 3.4; the legacy contract below), which does the ``n`` samples
  itself as one prefill forked ``n`` times.

DSPy contract followed by `BranchwiseLM` (DSPy 3.3/3.4, legacy `forward` contract): `forward(prompt=None,
messages=None, **kwargs)` returns an OpenAI-shaped chat completion (`choices` of length ``n``,
`usage`, `finish_reason`, `model`); `cache` and `rollout_id` never reach the generation parameters,
but `rollout_id` is part of the cache key (so ``lm.copy(rollout_id=i)`` draws fresh samples, as in
`dspy.BestOfN`/`Refine`); `copy()` and `deepcopy` share the loaded model; `dump_state`/`load_state`
round-trip the configuration (not the weights). DSPy 3.4 marks this legacy contract deprecated
(a `DeprecationWarning` per call) and plans its removal in 3.5: use `BranchwiseEngine` there.

Seeded sampling and batching: the backend seeds one generator per `extend` call, so two seeded
requests decoded in one batch would share a random stream and differ from their serial results. By
default a request that samples (temperature > 0) with a seed is therefore decoded in its own batch
(``batch_seeded=False``), which keeps every seeded call reproducible whatever the threading; set
``batch_seeded=True`` to co-batch them anyway (faster, but the streams then depend on the batch).
Unseeded sampling is batched freely (it is not reproducible in either case).
"""

from __future__ import annotations

import asyncio
import copy as copy_module
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dspy
from dspy.utils.exceptions import AdapterParseError

from branchwise.backends.base import OPENAI_FINISH, Backend, DecodeParams, Generation, ShareMode, check_share
from branchwise.backends.scheduler import BatchStats, Job, Scheduler
from branchwise.integrations.dspy_engine import (
    SUPPORTED_PARAMS,
    AsyncBranchwiseEngine,
    BranchwiseEngine,
    Structured,
    branchwise_lm,
    structured,
)
from branchwise.reasoners.answers import extract_answer, normalize_answer, register_extractor

if TYPE_CHECKING:
    from branchwise.reasoners.result import ReasoningResult
    from branchwise.strategies import Strategy

__all__ = [
    "AsyncBranchwiseEngine",
    "BatchStats",
    "BranchwiseEngine",
    "BranchwiseLM",
    "LenientChatAdapter",
    "Reason",
    "branchwise_lm",
]

log = logging.getLogger(__name__)


_NOT_GENERATION = {"cache", "rollout_id", "num_retries", "api_key", "api_base", "base_url"}
"""Keys DSPy may pass that are bookkeeping, never decoding parameters."""

_IGNORED_QUIETLY = {"top_logprobs", "num_generations", "model", "stream", "user", "timeout"}

_STRUCTURED = {"tools", "tool_choice", "parallel_tool_calls", "response_format"}
"""Request fields that become the decode constraint (`structured`), never dropped."""

_REFUSED = {
    "functions": "use tools= (OpenAI's deprecated functions field is not served)",
    "function_call": "use tool_choice= (OpenAI's deprecated function_call field is not served)",
}
"""Request fields refused with an error: ignoring them would change what the caller asked for."""


class _AttrDict(dict[str, Any]):
    """A dict whose keys also read as attributes: the OpenAI SDK shape (``resp.choices[0].message``)
    for callers that use attributes, and a plain mapping for DSPy, which reads either way."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def _attr(obj: Any) -> Any:
    """Recursively wrap dicts in `_AttrDict`."""
    if isinstance(obj, dict):
        return _AttrDict({k: _attr(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return [_attr(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------------
# The LM
# --------------------------------------------------------------------------------------------------


class BranchwiseLM(dspy.BaseLM):
    """A `dspy.BaseLM` over a branchwise backend: ``dspy.configure(lm=BranchwiseLM())``.

    Args:
        model: HF hub id or local path of the model to load; None = the embedded SmolLM2-135M-Instruct.
            Ignored for loading when `backend` is given (then it only names the LM).
        backend: an already loaded backend (e.g. ``HFBackend.from_model(model, tokenizer)``) to share.
        share: KV sharing of the ``n`` samples of one call: ``"exact"`` (prompt KV held once) or
            ``"none"`` (No-KV baseline: each sample recomputes the prompt, batched).
        temperature, max_tokens: defaults of every call (DSPy's `Predict` raises temperature to 0.7
            itself when it asks for n > 1 at temperature <= 0.15).
        cache: use DSPy's request cache (`dspy.cache`) like `dspy.LM` does; off for benchmarks.
        max_batch_rows: at most this many branches (sum of ``n``) are decoded in one batch.
        max_batch_requests: at most this many calls per batch; 1 turns cross-call batching off.
        batch_window_s: how long the worker waits for more calls before starting a batch.
        batch_seeded: co-batch seeded sampling calls (see the module docstring).
        **kwargs: further default request parameters (``top_p``, ``stop``, ``seed``, ``n``...).

    Native function calling and structured outputs: the LM declares both to DSPy
    (`supports_function_calling`, `supports_response_schema`, `supported_params`), so
    ``dspy.ChatAdapter(use_native_function_calling=True)`` and `dspy.JSONAdapter` pass ``tools``,
    ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` (a pydantic model class or an
    OpenAI ``response_format`` object). The tools are shown through the backend's chat template,
    every choice is decoded under the matching `Constraint`, and the calls come back as the
    choice's ``message.tool_calls`` with ``finish_reason="tool_calls"`` (DSPy parses them into
    `dspy.ToolCalls`). Invalid tools or schemas raise a ValueError naming the field.
    """

    supports_function_calling = True
    supports_response_schema = True
    supports_reasoning = False

    @property
    def supported_params(self) -> set[str]:
        return set(SUPPORTED_PARAMS)

    def __init__(
        self,
        model: str | None = None,
        *,
        backend: Backend | None = None,
        share: ShareMode = "exact",
        model_type: str = "chat",
        temperature: float = 0.0,
        max_tokens: int = 512,
        cache: bool = True,
        num_retries: int = 0,
        max_batch_rows: int = 64,
        max_batch_requests: int = 64,
        batch_window_s: float = 0.01,
        batch_seeded: bool = False,
        dtype: str = "auto",
        device: str = "auto",
        **kwargs: Any,
    ) -> None:
        share = check_share(share)
        if model_type != "chat":
            raise ValueError(f"model_type={model_type!r}: BranchwiseLM serves chat completions only")
        if max_batch_rows < 1 or max_batch_requests < 1:
            raise ValueError("max_batch_rows and max_batch_requests must be >= 1")
        if backend is None:
            from branchwise.backends.hf import HFBackend

            backend = HFBackend(model, dtype=dtype, device=device, share=share)
        name = model if model is not None else getattr(backend, "model_name", type(backend).__name__)
        super().__init__(
            model=str(name),
            model_type="chat",
            temperature=temperature,
            max_tokens=max_tokens,
            cache=cache,
            num_retries=num_retries,
            **kwargs,
        )
        self.backend = backend
        self.share: ShareMode = share
        self._dtype, self._device = dtype, device
        self._batcher = Scheduler(
            backend,
            max_rows=max_batch_rows,
            max_requests=max_batch_requests,
            window_s=batch_window_s,
            batch_seeded=batch_seeded,
            name="branchwise-dspy-batcher",
        )

    # ------------------------------------------------------------------ DSPy contract
    def forward(
        self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> Any:
        """Answer one chat request with ``n`` choices (OpenAI chat-completion shape)."""
        merged = {**self.kwargs, **kwargs}
        use_cache = bool(merged.get("cache", True)) and bool(self.cache)
        rollout_id = merged.get("rollout_id")
        msgs = self._messages(prompt, messages)
        plan = self._structured(merged)
        n, params, want_logprobs = self._decode_params(merged, plan)
        key = None
        cache = getattr(dspy, "cache", None)
        if use_cache and cache is not None:
            key = {
                "_fn_identifier": f"{type(self).__module__}.{type(self).__qualname__}.forward",
                "model": self.model,
                "messages": msgs,
                "n": n,
                "params": params.model_dump(mode="json"),
                "logprobs": want_logprobs,
                "rollout_id": rollout_id,
                "tools": plan.tools,
            }
            hit = cache.get(key)
            if hit is not None:
                return hit
        prompt_ids = (
            self.backend.chat_prompt(msgs, plan.tools) if plan.tools else self.backend.chat_prompt(msgs)
        )
        job = Job(prompt=prompt_ids, n=n, params=params, share=self.share)
        gens = self._batcher.submit(job)
        response = self._response(prompt_ids, gens, want_logprobs, job, plan)
        if key is not None and cache is not None:
            cache.put(key, response)
        return response

    async def aforward(
        self, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, **kwargs: Any
    ) -> Any:
        """Async `forward`: waits in a thread, so concurrent tasks batch exactly like threads do."""
        return await asyncio.to_thread(self.forward, prompt, messages, **kwargs)

    def copy(self, **kwargs: Any) -> BranchwiseLM:
        """A copy with updated parameters that shares the loaded model and the request queue.

        DSPy 3.0-3.2 deep-copied LMs here; for a local model that would duplicate the weights, so the
        copy is always shallow in what is expensive and isolated in what DSPy owns (history,
        callbacks, kwargs).
        """
        new = copy_module.copy(self)
        new.history = []
        new.callbacks = list(self.callbacks)
        new.kwargs = dict(self.kwargs)
        for key, value in kwargs.items():
            if key in ("backend", "_batcher"):
                raise ValueError(f"copy() cannot replace {key!r}; build a new BranchwiseLM instead")
            if hasattr(new, key) and key not in new.kwargs:
                setattr(new, key, value)
            elif value is None:
                new.kwargs.pop(key, None)
            else:
                new.kwargs[key] = value
        return new

    def __deepcopy__(self, memo: dict[int, Any]) -> BranchwiseLM:
        # `dspy.Module.deepcopy()` deep-copies attributes, which would otherwise clone the model
        return self.copy()

    def dump_state(self) -> dict[str, Any]:
        """Configuration to rebuild this LM (the model is reloaded by name, never pickled)."""
        state = super().dump_state()
        state.update(
            share=self.share,
            max_batch_rows=self._batcher.max_rows,
            max_batch_requests=self._batcher.max_requests,
            batch_window_s=self._batcher.window_s,
            batch_seeded=self._batcher.batch_seeded,
            dtype=self._dtype,
            device=self._device,
        )
        return state

    @classmethod
    def load_state(cls, state: dict[str, Any], **_: Any) -> BranchwiseLM:
        """Rebuild from `dump_state` (loads the model named in ``state["model"]``)."""
        state = {k: v for k, v in state.items() if k != "_dspy_lm_class"}
        return cls(**state)

    # ------------------------------------------------------------------ extras
    @property
    def batch_stats(self) -> BatchStats:
        """Batching achieved so far by this LM and its copies."""
        return self._batcher.stats

    def reset_batch_stats(self) -> None:
        self._batcher.stats = BatchStats()

    def close(self) -> None:
        """Stop the worker thread (queued calls still finish)."""
        self._batcher.close()

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _messages(prompt: str | None, messages: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """OpenAI-shaped messages as ``chat_prompt`` takes them: text content, plus an assistant's
        ``tool_calls`` and a tool result's ``tool_call_id`` / ``name`` (DSPy sends them for
        `dspy.ToolCalls` in a conversation history under native function calling)."""
        if messages is None:
            if prompt is None:
                raise ValueError("pass prompt= or messages=")
            return [{"role": "user", "content": prompt}]
        out: list[dict[str, Any]] = []
        for m in messages:
            content = m.get("content")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                parts = [
                    p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
                ]
                if len(parts) != len(content):
                    raise ValueError("BranchwiseLM accepts text content only (no images, audio or files)")
                content = "".join(parts)
            entry: dict[str, Any] = {
                "role": str(m.get("role", "user")),
                "content": "" if content is None else str(content),
            }
            for extra in ("tool_calls", "tool_call_id", "name"):
                if m.get(extra):
                    entry[extra] = m[extra]
            out.append(entry)
        return out

    @staticmethod
    def _structured(merged: dict[str, Any]) -> Structured:
        refused = sorted(k for k in _REFUSED if merged.get(k) is not None)
        if refused:
            raise ValueError(f"{refused[0]}: {_REFUSED[refused[0]]}")
        return structured(
            tools=merged.get("tools"),
            tool_choice=merged.get("tool_choice"),
            parallel_tool_calls=merged.get("parallel_tool_calls"),
            response_format=merged.get("response_format"),
        )

    def _decode_params(
        self, merged: dict[str, Any], plan: Structured | None = None
    ) -> tuple[int, DecodeParams, bool]:
        n = merged.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n={n!r} must be a positive integer")
        stop = merged.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        max_tokens = merged.get("max_completion_tokens") or merged.get("max_tokens") or 512
        params = DecodeParams(
            temperature=float(merged.get("temperature") or 0.0),
            top_p=float(merged.get("top_p") or 1.0),
            max_tokens=int(max_tokens),
            min_tokens=int(merged.get("min_tokens") or 0),
            stop=tuple(stop),
            seed=merged.get("seed"),
            constraint=plan.constraint if plan is not None else None,
        )
        known = {"n", "stop", "max_tokens", "max_completion_tokens", "temperature", "top_p", "min_tokens"}
        known |= {"seed", "logprobs"} | _NOT_GENERATION | _IGNORED_QUIETLY | _STRUCTURED
        unknown = sorted(k for k, v in merged.items() if k not in known and v is not None)
        if unknown:
            log.info("BranchwiseLM ignores request parameters it does not support: %s", unknown)
        return n, params, bool(merged.get("logprobs"))

    def _response(
        self,
        prompt_ids: list[int],
        gens: Sequence[Generation],
        want_logprobs: bool,
        job: Job,
        plan: Structured | None = None,
    ) -> Any:
        plan = plan or Structured()
        choices = []
        for i, g in enumerate(gens):
            content, calls = plan.split(g.text)
            message: dict[str, Any] = {"role": "assistant", "content": g.text, "tool_calls": None}
            if calls:  # OpenAI's shape: the prose (None when there is none) and the calls
                message = {
                    "role": "assistant",
                    "content": content or None,
                    "tool_calls": [c.openai() for c in calls],
                }
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "finish_reason": "tool_calls" if calls else OPENAI_FINISH.get(g.finish_reason, "stop"),
                "logprobs": None,
            }
            if want_logprobs:
                choice["logprobs"] = {
                    "content": [
                        {"token": self.backend.decode([t]), "logprob": lp, "top_logprobs": []}
                        for t, lp in zip(g.token_ids, g.logprobs, strict=True)
                    ]
                }
            choices.append(choice)
        completion = sum(len(g.token_ids) for g in gens)
        return _attr(
            {
                "id": f"branchwise-{uuid.uuid4().hex[:16]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": choices,
                # like OpenAI with n > 1: the prompt is counted once
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": completion,
                    "total_tokens": len(prompt_ids) + completion,
                },
                "branchwise": {
                    "share": self.share,
                    "batch_requests": job.batch_requests,
                    "batch_rows": job.batch_rows,
                    "constraint": plan.constraint.kind if plan.constraint is not None else None,
                    "unenforced": list(plan.unenforced),
                },
            }
        )


def _engine_backend(lm: Any) -> tuple[Backend, ShareMode] | None:
    """The backend and share mode of a `BranchwiseLM` or of a `dspy.LM` over a `BranchwiseEngine`."""
    if isinstance(lm, BranchwiseLM):
        return lm.backend, lm.share
    engine = getattr(lm, "_engine_spec", None)
    if isinstance(engine, BranchwiseEngine):
        return engine.backend, engine.share
    return None


# --------------------------------------------------------------------------------------------------
# A forgiving adapter for small models
# --------------------------------------------------------------------------------------------------


def _free_text(completion: str) -> str:
    """The completion without ChatAdapter section headers."""
    import re

    return re.sub(r"\[\[ ## \w+ ## \]\]", "", completion).strip()


class LenientChatAdapter(dspy.ChatAdapter):
    """`dspy.ChatAdapter` that salvages replies which ignore its ``[[ ## field ## ]]`` format.

    Why: small local models (135M-1.5B) rarely reproduce the section markers, so the stock adapter
    raises `AdapterParseError`, retries through the JSON adapter (a second full generation) and fails
    again. This adapter keeps the fields it can parse and fills the missing ones from the free text:
    the last output field (the answer) from `extract_answer` (boxed / "the answer is" / last number)
    or else the last non-empty line, any other text field (e.g. ``reasoning``) from the whole reply.
    Non-text fields that cannot be parsed still raise. Programs stay unchanged; only
    ``dspy.configure(adapter=LenientChatAdapter())`` differs.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("use_json_adapter_fallback", False)
        super().__init__(**kwargs)

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        try:
            return super().parse(signature, completion)
        except AdapterParseError as err:
            from dspy.adapters.utils import parse_value

            fields = dict(err.parsed_result or {})
            text = _free_text(completion)
            names = list(signature.output_fields)
            for name in names:
                if name in fields:
                    continue
                info = signature.output_fields[name]
                if name == names[-1]:
                    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
                    raw = extract_answer(text) or (lines[-1] if lines else "")
                else:
                    raw = text
                try:
                    fields[name] = parse_value(raw, info.annotation)
                except (ValueError, TypeError):
                    raise err from None
            return fields


# --------------------------------------------------------------------------------------------------
# Strategies as a DSPy module
# --------------------------------------------------------------------------------------------------


class _Shared:
    """Holds an object that `copy.deepcopy` must not clone (a loaded backend)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


def _section(text: str, field_name: str) -> str | None:
    """Content of the ``[[ ## field_name ## ]]`` section of a ChatAdapter-formatted reply."""
    import re

    m = re.search(rf"\[\[ ## {re.escape(field_name)} ## \]\]", text)
    if not m:
        return None
    rest = text[m.end() :]
    nxt = re.search(r"\[\[ ## \w+ ## \]\]", rest)
    return (rest[: nxt.start()] if nxt else rest).strip()


def _answer_key(value: str) -> str | None:
    """What the vote compares for a parsed answer field: its first non-empty line, normalised."""
    lines = [ln for ln in str(value).splitlines() if ln.strip()]
    return normalize_answer(lines[0]) if lines else None


def _field_extractor_name(field_name: str) -> str:
    """Register (idempotently) and name an extractor that votes on one output field's value."""
    name = f"dspy_field:{field_name}"

    def extract(text: str) -> str | None:
        value = _section(text, field_name)
        return (_answer_key(value) if value else None) or extract_answer(text)

    register_extractor(name, extract, replace=True)
    return name


def _adapter_extractor_name(adapter: Any, signature: Any, field_name: str, owner: object) -> str:
    """Register and name an extractor that votes on one output field as `adapter` parses it (for a
    custom adapter, whose replies need not carry ChatAdapter's section markers)."""
    name = f"dspy_adapter_field:{field_name}:{id(owner):x}"

    def extract(text: str) -> str | None:
        try:
            value = adapter.parse(signature, text).get(field_name)
        except (AdapterParseError, ValueError):
            return None
        return None if value is None else _answer_key(str(value))

    register_extractor(name, extract, replace=True)
    return name


class Reason(dspy.Module):
    """Run a branchwise strategy for a DSPy signature and return a `dspy.Prediction`.

    The signature is formatted into chat messages by DSPy's `ChatAdapter` (so instructions, field
    descriptions and few-shot demos read as they would for `dspy.Predict`); the strategy runs on the
    backend (one shared prompt prefill, B branches); every branch's reply is parsed into the output
    fields (with `LenientChatAdapter`'s salvage for small models); the answer field is set from the
    strategy's vote (its aggregate node votes on the parsed answer field, not on the last number in
    the text). The prediction carries ``completions`` (one per surviving branch), ``votes``,
    ``support`` and ``reasoning_result`` (the full `ReasoningResult`: tree, timings, KV stats).

    Args:
        signature: a DSPy signature or its string form ("question -> answer").
        strategy: any branchwise `Strategy`; default self-consistency with 5 samples.
        chain_of_thought: prepend a ``reasoning`` output field, as `dspy.ChainOfThought` does.
        lm: a branchwise LM (`branchwise_lm(...)` or `BranchwiseLM`) whose backend to use; default:
            ``dspy.settings.lm`` at call time.
        backend: a backend to use directly: then the global LM may be anything (or none).
        share: KV sharing mode of the strategy's branches; default: the LM's.
        answer_field: the output field set from the vote; default: the last output field.
        adapter: the DSPy adapter that formats the prompt and parses every branch (and so decides
            what the vote compares); default: `LenientChatAdapter`. Few-shot demos (``demos``) are
            sent as real user/assistant turns, as `dspy.Predict` sends them.
        tools: choose an action instead of writing the output fields: `dspy.Tool`s (or OpenAI
            function tools, Python functions) shown to the model; every branch writes tool calls
            under the grammar (``tool_choice``: required by default, or auto / a tool's name), the
            branches vote on the canonical call, and the answer field holds the winner as
            `dspy.ToolCalls` (self-consistency over actions, in one shared-prefix batch).
    """

    def __init__(
        self,
        signature: Any,
        strategy: Strategy | None = None,
        *,
        chain_of_thought: bool = True,
        lm: Any = None,
        backend: Backend | None = None,
        share: ShareMode | None = None,
        answer_field: str | None = None,
        adapter: dspy.Adapter | None = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = "required",
    ) -> None:
        super().__init__()
        from branchwise.strategies import self_consistency

        sig = dspy.ensure_signature(signature)
        if chain_of_thought and "reasoning" not in sig.output_fields:
            sig = sig.prepend(name="reasoning", field=dspy.OutputField(desc="${reasoning}"), type_=str)
        self.signature = sig
        self.answer_field = answer_field or list(sig.output_fields)[-1]
        if self.answer_field not in sig.output_fields:
            raise ValueError(f"answer_field={self.answer_field!r} is not an output field of {sig.signature}")
        self.strategy = strategy if strategy is not None else self_consistency(n=5)
        self.demos: list[Any] = []
        self._lm = lm
        self._backend = _Shared(backend) if backend is not None else None
        self.share = share
        self.adapter = adapter
        self.tools = [
            t.format_as_litellm_function_call() if isinstance(t, dspy.Tool) else t for t in tools or []
        ]
        self.tool_choice = tool_choice

    def _resolve(self) -> tuple[Backend, ShareMode]:
        if self._backend is not None:
            return self._backend.obj, self.share or "exact"
        lm = self._lm or dspy.settings.lm
        found = _engine_backend(lm)
        if found is None:
            raise ValueError(
                "Reason needs a backend: Reason(signature, strategy, backend=...) (any global LM), or a "
                "branchwise LM as lm=... or dspy.settings.lm (branchwise_lm(...) / BranchwiseLM(...)); "
                f"got {type(lm).__name__ if lm is not None else None}"
            )
        backend, share = found
        return backend, self.share or share

    def _adapted_strategy(self) -> Strategy:
        """The strategy with the vote on the answer field and ChatAdapter's end marker as a stop."""
        from branchwise.strategies import AggregateNode, GenerateNode, Strategy

        if self.adapter is None:
            extractor = _field_extractor_name(self.answer_field)
        else:
            extractor = _adapter_extractor_name(self.adapter, self.signature, self.answer_field, self)
        nodes = []
        for node in self.strategy.nodes:
            if isinstance(node, AggregateNode) and node.extractor == "auto":
                node = node.model_copy(update={"extractor": extractor})
            elif isinstance(node, GenerateNode) and node.until == "answer":
                node = node.model_copy(update={"stop": [*node.stop, "[[ ## completed ## ]]"]})
            nodes.append(node)
        return Strategy(
            name=self.strategy.name,
            description=self.strategy.description,
            nodes=nodes,
            edges=list(self.strategy.edges),
        )

    def forward(self, **inputs: Any) -> dspy.Prediction:
        from branchwise.reasoners.reasoner import Reasoner

        backend, share = self._resolve()
        adapter = self.adapter if self.adapter is not None else LenientChatAdapter()
        messages = adapter.format(self.signature, self.demos, inputs)
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
        turns = [{"role": m["role"], "content": str(m["content"])} for m in messages if m["role"] != "system"]
        # the last turn is the question; earlier ones (few-shot demos) go as real chat turns
        if self.tools:  # an action: every branch writes calls under the grammar; the vote picks one
            reasoner = Reasoner(
                self.strategy,
                backend=backend,
                share=share,
                system_prompt=system,
                history=turns[:-1],
                tools=self.tools,
                tool_choice=self.tool_choice,
            )
            result = reasoner.run(turns[-1]["content"])
            calls = dspy.ToolCalls.from_dict_list(
                [{"name": c.name, "args": c.arguments} for c in result.tool_calls]
            )
            pred = dspy.Prediction(**{self.answer_field: calls})
            pred.votes, pred.support, pred.reasoning_result = dict(result.votes), result.support, result
            return pred
        reasoner = Reasoner(
            self._adapted_strategy(), backend=backend, share=share, system_prompt=system, history=turns[:-1]
        )
        result = reasoner.run(turns[-1]["content"])
        return self._prediction(adapter, result)

    def _prediction(self, adapter: dspy.Adapter, result: ReasoningResult) -> dspy.Prediction:
        completions, winners = [], []
        for branch in result.branches:
            try:
                parsed = adapter.parse(self.signature, branch.text)
            except (AdapterParseError, ValueError):
                parsed = {name: None for name in self.signature.output_fields}
            completions.append(parsed)
            value = parsed.get(self.answer_field)
            if result.answer is not None and value is not None and _answer_key(str(value)) == result.answer:
                winners.append(len(completions) - 1)
        if not completions:
            completions = [{name: None for name in self.signature.output_fields}]
        best = winners[0] if winners else next((i for i, b in enumerate(result.branches) if b.selected), 0)
        # the chosen completion first, so `pred.<field>` reads the voted branch
        ordered = [completions[best]] + [c for i, c in enumerate(completions) if i != best]
        pred = dspy.Prediction.from_completions(ordered, signature=self.signature)
        if result.answer is not None and not winners:
            pred[self.answer_field] = result.answer
        pred.votes = dict(result.votes)
        pred.support = result.support
        pred.reasoning_result = result
        return pred
