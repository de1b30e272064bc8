"""DSPy's engine contract (DSPy >= 3.4): `BranchwiseEngine` answers one `dspy.lm15.Request` with one
`dspy.lm15.Response`, so ``dspy.LM("branchwise/<name>", engine=...)`` runs on a local backend.

Why its own module: it is the forward-compatible half of the DSPy plug-in (DSPy 3.5 keeps this
contract and drops the legacy `BaseLM.forward` that `BranchwiseLM` in `reasoners/dspy.py`
implements), and it shares nothing with that legacy LM but the backend and the scheduler.
DSPy owns the cache, retries, history and the ``n`` fan-out (it sends the ``n`` candidates as ``n``
one-sample requests); every request goes whole through the backend's shared `Scheduler`, so
concurrent threads and ``asyncio.gather`` merge into shared decode passes, and the backend's prefix
cache reuses a prompt for candidates 2..n. `branchwise_lm(...)` builds the `dspy.LM`.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import dspy

from branchwise.backends.base import Backend, DecodeParams, Generation, ShareMode
from branchwise.backends.scheduler import Job, Scheduler

__all__ = ["AsyncBranchwiseEngine", "BranchwiseEngine", "branchwise_lm", "request_messages"]

log = logging.getLogger(__name__)


_LM15_FINISH = {"eos": "stop", "stop": "stop", "delimiter": "stop", "length": "length"}


def _lm15() -> Any:
    """DSPy's canonical request/response types (DSPy >= 3.4), or a clear error on older DSPy."""
    try:
        from dspy import lm15
    except ImportError:  # DSPy 3.3: no engine contract yet
        raise ImportError(
            f"BranchwiseEngine needs DSPy >= 3.4 (installed: {dspy.__version__}); "
            "on DSPy 3.3 use BranchwiseLM"
        ) from None
    return lm15


def _part_text(part: Any, lm15: Any) -> str:
    """The text of one request part; non-text content is refused (this is a text model)."""
    if isinstance(part, lm15.TextPart | lm15.ThinkingPart):
        return part.text
    if isinstance(part, lm15.ToolResultPart):  # a tool's output, as text
        return "".join(_part_text(p, lm15) for p in part.content)
    if isinstance(part, lm15.ToolCallPart):
        import json

        return json.dumps({"tool": part.name, "input": part.input})
    raise lm15.UnsupportedFeatureError(f"branchwise serves text only; got a {part.type!r} part")


def request_messages(request: Any) -> list[dict[str, str]]:
    """Chat messages (role/content dicts for the tokenizer's template) of a `dspy.lm15.Request`."""
    lm15 = _lm15()
    msgs: list[dict[str, str]] = []
    if request.system is not None:
        system = request.system
        text = system if isinstance(system, str) else "".join(_part_text(p, lm15) for p in system)
        msgs.append({"role": "system", "content": text})
    for m in request.messages:
        role = {"developer": "system", "tool": "user"}.get(m.role, m.role)
        msgs.append({"role": role, "content": "".join(_part_text(p, lm15) for p in m.parts)})
    return msgs


class BranchwiseEngine:
    """A DSPy engine (DSPy >= 3.4) over a local branchwise backend.

    ``lm = dspy.LM("branchwise/smollm2", engine=engine, async_engine=engine.async_engine())`` (or
    `branchwise_lm`) runs unchanged DSPy programs on the in-process model with no deprecation
    warning. DSPy's LM layer owns caching, retries, callbacks, history and the ``n`` candidates;
    this engine answers one request with one response.

    Every request's whole prompt is submitted to the backend's shared `Scheduler`
    (`branchwise.integrations.shared_scheduler`), so requests from many threads (`dspy.Evaluate`,
    `Module.batch`) or asyncio tasks are decoded in shared passes, and a backend with a prefix
    cache reuses the prompt of DSPy's candidates 2..n (DSPy sends them one request at a time).

    Args:
        model: HF hub id or local path to load; None = the embedded SmolLM2-135M-Instruct. Ignored
            when `backend` is given.
        backend: an already loaded backend to share (with other engines, `ChatBranchwise`, ...).
        share: KV sharing of a request's samples (``"exact"`` or ``"none"``).
        temperature, max_tokens: defaults for requests that leave them unset (DSPy's `dspy.LM`
            leaves temperature unset unless it is given one).
        scheduler: a `Scheduler` of your own (e.g. other batching limits); default: the backend's
            shared one.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        backend: Backend | None = None,
        share: ShareMode = "exact",
        temperature: float = 0.0,
        max_tokens: int = 512,
        scheduler: Scheduler | None = None,
        dtype: str = "auto",
        device: str = "auto",
    ) -> None:
        _lm15()
        if share not in ("none", "exact"):
            raise ValueError(f"share={share!r} is not one of 'none', 'exact'")
        if backend is None:
            from branchwise.backends.hf import HFBackend

            backend = HFBackend(model, dtype=dtype, device=device, share=share)
        from branchwise.integrations._shared import shared_scheduler

        self.backend = backend
        self.model = model
        self.share: ShareMode = share
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.scheduler = scheduler if scheduler is not None else shared_scheduler(backend)
        self._dtype, self._device = dtype, device
        self._closed = False

    @property
    def model_name(self) -> str:
        """The name DSPy's `dspy.LM` uses for this engine: ``branchwise/<model>``."""
        name = self.model or getattr(self.backend, "model_name", None) or "embedded"
        return f"branchwise/{name}"

    # ------------------------------------------------------------------ the Engine contract
    def complete(self, request: Any) -> Any:
        """Answer one canonical request (blocking until its batch has decoded)."""
        prompt_ids, job, want_logprobs = self._job(request)
        gens = self.scheduler.submit(job)
        return self._response(request, prompt_ids, gens[0], job, want_logprobs)

    def stream(self, request: Any) -> Any:
        """The response as stream events (cut at the end: the decode loop has no token callback)."""
        return _lm15().response_to_events(self.complete(request))

    def close(self) -> None:
        """Refuse further requests here; the shared scheduler and the model stay (they are borrowed)."""
        self._closed = True

    def async_engine(self) -> AsyncBranchwiseEngine:
        """The async counterpart for ``dspy.LM(..., async_engine=...)`` (same backend and queue)."""
        return AsyncBranchwiseEngine(self)

    # ------------------------------------------------------------------ saving (dspy.LM.dump_state)
    def dump_state(self) -> dict[str, Any]:
        """Configuration to rebuild this engine (the model is reloaded by name, never pickled)."""
        return {
            "model": self.model,
            "share": self.share,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "dtype": self._dtype,
            "device": self._device,
        }

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> BranchwiseEngine:
        return cls(**state)

    def __deepcopy__(self, memo: dict[int, Any]) -> BranchwiseEngine:
        return self  # `dspy.Module.deepcopy()` must not clone the model

    # ------------------------------------------------------------------ helpers
    def _job(self, request: Any) -> tuple[list[int], Job, bool]:
        lm15 = _lm15()
        try:  # DSPy's own check that execution controls stayed out of the request (3.4)
            from dspy.clients.engines.base import validate_request
        except ImportError:  # pragma: no cover - moved in a later DSPy: the LM layer still checks
            pass
        else:
            validate_request(request)
        if self._closed:
            raise RuntimeError("the engine is closed")
        if request.tools:
            raise lm15.UnsupportedFeatureError(
                "branchwise does not call tools natively; DSPy's ChatAdapter describes tools in the prompt "
                "(use_native_function_calling=False, its default)"
            )
        cfg = request.config
        ignored = [
            name
            for name in ("top_k", "response_format", "frequency_penalty", "presence_penalty", "reasoning")
            if getattr(cfg, name) is not None
        ]
        if ignored:
            log.info("BranchwiseEngine ignores request settings it cannot honour: %s", ignored)
        try:
            params = DecodeParams(
                temperature=self.temperature if cfg.temperature is None else float(cfg.temperature),
                top_p=1.0 if cfg.top_p is None else float(cfg.top_p),
                max_tokens=self.max_tokens if cfg.max_tokens is None else int(cfg.max_tokens),
                stop=tuple(cfg.stop),
                seed=cfg.seed,
            )
        except ValueError as exc:
            raise lm15.InvalidRequestError(str(exc)) from None
        prompt_ids = self.backend.chat_prompt(request_messages(request))
        job = Job(prompt=prompt_ids, n=1, params=params, share=self.share)
        return prompt_ids, job, cfg.logprobs is not None

    def _response(
        self, request: Any, prompt_ids: list[int], gen: Generation, job: Job, want_logprobs: bool
    ) -> Any:
        lm15 = _lm15()
        logprobs = None
        if want_logprobs:
            logprobs = tuple(
                lm15.TokenLogprob(token=self.backend.decode([t]), logprob=float(lp), token_id=int(t))
                for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
            )
        return lm15.Response(
            id=f"branchwise-{uuid.uuid4().hex[:16]}",
            model=request.model,
            message=lm15.Message.assistant(gen.text),
            finish_reason=_LM15_FINISH.get(gen.finish_reason, "stop"),
            usage=lm15.Usage(input_tokens=len(prompt_ids), output_tokens=len(gen.token_ids)),
            logprobs=logprobs,
            provider_data={
                "branchwise": {
                    "finish_reason": gen.finish_reason,
                    "share": self.share,
                    "batch_requests": job.batch_requests,
                    "batch_rows": job.batch_rows,
                }
            },
        )


class AsyncBranchwiseEngine:
    """The async engine (``dspy.LM(..., async_engine=...)``): awaits the shared scheduler without
    blocking the event loop, so ``asyncio.gather`` of DSPy's ``acall``s merges into shared passes."""

    def __init__(self, sync: BranchwiseEngine) -> None:
        self.sync = sync

    async def complete(self, request: Any) -> Any:
        prompt_ids, job, want_logprobs = self.sync._job(request)
        gens = await self.sync.scheduler.submit_async(job)
        return self.sync._response(request, prompt_ids, gens[0], job, want_logprobs)

    async def stream(self, request: Any) -> Any:
        for event in _lm15().response_to_events(await self.complete(request)):
            yield event

    async def aclose(self) -> None:
        self.sync.close()

    def dump_state(self) -> dict[str, Any]:
        return self.sync.dump_state()

    @classmethod
    def load_state(cls, state: dict[str, Any]) -> AsyncBranchwiseEngine:
        return cls(BranchwiseEngine.load_state(state))

    def __deepcopy__(self, memo: dict[int, Any]) -> AsyncBranchwiseEngine:
        return self


def branchwise_lm(
    model: str | None = None,
    *,
    backend: Backend | None = None,
    share: ShareMode = "exact",
    temperature: float = 0.0,
    max_tokens: int = 512,
    **lm_kwargs: Any,
) -> Any:
    """A `dspy.LM` over a `BranchwiseEngine` (DSPy >= 3.4): ``dspy.configure(lm=branchwise_lm())``.

    `lm_kwargs` go to `dspy.LM` (``cache``, ``num_retries``, ``callbacks``, default request
    parameters such as ``n`` or ``stop``).
    """
    engine = BranchwiseEngine(
        model, backend=backend, share=share, temperature=temperature, max_tokens=max_tokens
    )
    lm_kwargs.setdefault("num_retries", 0)  # a local model has no transient failures worth retrying
    return dspy.LM(
        engine.model_name,
        engine=engine,
        async_engine=engine.async_engine(),
        temperature=temperature,
        max_tokens=max_tokens,
        **lm_kwargs,
    )
