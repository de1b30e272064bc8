"""`BranchwiseLM`: the DSPy plug-in's LM under DSPy's legacy `BaseLM.forward` contract (DSPy 3.3 and
3.4), answering each call with an OpenAI-shaped chat completion of ``n`` choices.

Why its own module: it is the half of the plug-in that DSPy 3.5 drops (3.4 already warns on each
call), so it lives apart from what stays: the engine contract (`dspy_engine.py`), the adapter
(`dspy_adapter.py`) and `Reason` (`dspy_reason.py`, which only asks an LM for its backend); when
the contract goes, this module goes whole. From the engine's module it takes only `structured` and
`SUPPORTED_PARAMS`, so both LMs read tools and response formats alike. Users import it from
`branchwise.integrations.dspy`.

Unlike the engine, it does the ``n`` samples itself, as a server would:

* **n samples share the prompt KV**: one `prefill`, `fork(n)`, one batched `extend`, so the prompt
  is computed (and, with ``share="exact"``, held and read) once for all samples;
* **concurrent calls are batched**: DSPy threads (``Evaluate(num_threads=16)``, ``Module.batch``,
  ``Parallel``) enqueue requests; a single worker drains the queue and decodes every queued request
  with the same decoding parameters in ONE `extend` over all their branches. With greedy decoding the
  batched tokens equal the serial ones (the backend's batched decode is exact), so threaded and
  serial evaluations agree.

DSPy contract followed (legacy `forward` contract): `forward(prompt=None, messages=None, **kwargs)`
returns an OpenAI-shaped chat completion (`choices` of length ``n``, `usage`, `finish_reason`,
`model`); `cache` and `rollout_id` never reach the generation parameters, but `rollout_id` is part
of the cache key (so ``lm.copy(rollout_id=i)`` draws fresh samples, as in `dspy.BestOfN`/`Refine`);
`copy()` and `deepcopy` share the loaded model; `dump_state`/`load_state` round-trip the
configuration (not the weights). DSPy 3.4 marks this legacy contract deprecated (a
`DeprecationWarning` per call) and plans its removal in 3.5: use `BranchwiseEngine` there.

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
from typing import Any

import dspy

from branchwise.backends.base import OPENAI_FINISH, Backend, DecodeParams, Generation, ShareMode, check_share
from branchwise.backends.scheduler import BatchStats, Job, Scheduler
from branchwise.integrations._shared import CLOSE_WAIT_S
from branchwise.integrations.dspy_engine import SUPPORTED_PARAMS, Structured, structured

__all__ = ["BranchwiseLM"]

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
        if backend is None:  # the process's loaded model of that name, if any (see `backends.hf.registry`)
            from branchwise.backends.hf.registry import shared_backend

            backend = shared_backend(model, dtype=dtype, device=device)
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
        """Stop the worker thread now (queued calls still finish; later calls raise). The model is
        freed with the last LM, copy or other front end that holds it."""
        self._batcher.close(timeout=CLOSE_WAIT_S)

    def __enter__(self) -> BranchwiseLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
            message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": None}
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
                    # decode steps that left the fast step, with their reasons (`Generation.notes`)
                    "notes": list(dict.fromkeys(n for g in gens for n in g.notes)),
                },
            }
        )
