"""DSPy's engine contract (DSPy >= 3.4): `BranchwiseEngine` answers one `dspy.lm15.Request` with one
`dspy.lm15.Response`, so ``dspy.LM("branchwise/<name>", engine=...)`` runs on a local backend.

Why its own module: it is the forward-compatible half of the DSPy plug-in (DSPy 3.5 keeps this
contract and drops the legacy `BaseLM.forward` that `BranchwiseLM` in `integrations/dspy_lm.py`
implements), and it shares nothing with that legacy LM but the backend and the scheduler.
DSPy owns the cache, retries, history and the ``n`` fan-out (it sends the ``n`` candidates as ``n``
one-sample requests); every request goes whole through the backend's shared `Scheduler`, so
concurrent threads and ``asyncio.gather`` merge into shared decode passes, and the backend's prefix
cache reuses a prompt for candidates 2..n. `branchwise_lm(...)` builds the `dspy.LM`.

`structured` is shared with `BranchwiseLM`: it turns DSPy's ``tools`` / ``tool_choice`` /
``response_format`` (native function calling, `JSONAdapter`'s structured outputs) into the decode
`Constraint` and the tools shown in the prompt, so both plug-ins enforce and report them alike.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import dspy
from pydantic import BaseModel

from branchwise.backends.base import OPENAI_FINISH, Backend, DecodeParams, Generation, ShareMode, check_share
from branchwise.backends.scheduler import Job, Scheduler
from branchwise.constraints import Constraint, tool_calls_of
from branchwise.integrations._shared import Released, use_model
from branchwise.toolcalls import ToolCall, normalize_tools, tool_names

__all__ = [
    "AsyncBranchwiseEngine",
    "BranchwiseEngine",
    "Structured",
    "branchwise_lm",
    "request_messages",
    "structured",
]

log = logging.getLogger(__name__)


SUPPORTED_PARAMS = frozenset(
    {
        "temperature",
        "max_tokens",
        "max_completion_tokens",
        "top_p",
        "stop",
        "seed",
        "n",
        "logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
    }
)
"""OpenAI request parameters both DSPy plug-ins honour (DSPy's adapters read this through
``lm.supported_params``: `JSONAdapter` sends ``response_format`` only to an LM that lists it)."""


# --------------------------------------------------------------------------------------------------
# Tools and response formats -> one decode constraint
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Structured:
    """What a request's ``tools`` / ``tool_choice`` / ``response_format`` ask of one generation.

    `constraint` goes into `DecodeParams`; `tools` (normalized OpenAI function tools, or None) go to
    ``backend.chat_prompt(messages, tools)``; `unenforced` names request fields the constraint could
    not also enforce (reported in the response and logged, never dropped silently).
    """

    constraint: Constraint | None = None
    tools: list[dict[str, Any]] | None = None
    unenforced: tuple[str, ...] = field(default=())

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """The prose and the tool calls of a reply decoded under `constraint`."""
        return tool_calls_of(text, self.constraint)


def _with_field(err: Exception, name: str) -> ValueError:
    msg = str(err)
    return ValueError(msg if msg.startswith(name) else f"{name}: {msg}")


def response_format_constraint(response_format: Any) -> Constraint | None:
    """A `Constraint` from any ``response_format`` DSPy sends: a pydantic model class (JSONAdapter's
    structured outputs on the legacy path), OpenAI's ``{"type": "json_schema", "json_schema":
    {...}}`` / ``{"type": "json_object"}`` / ``{"type": "text"}`` (None), or lm15's flat
    ``{"type": "json_schema", "schema": ..., "name": ..., "strict": ...}`` (the engine path).
    A bad one raises a ValueError that starts with ``response_format``."""
    if response_format is None:
        return None
    try:
        if isinstance(response_format, type) and issubclass(response_format, BaseModel):
            return Constraint.of_json_schema(response_format)
        if (
            isinstance(response_format, Mapping)
            and response_format.get("type") == "json_schema"
            and "json_schema" not in response_format
            and "schema" in response_format
        ):  # lm15's Config.response_format: the OpenAI object, flattened
            spec = {k: v for k, v in response_format.items() if k != "type"}
            response_format = {"type": "json_schema", "json_schema": spec}
        return Constraint.from_response_format(response_format)
    except ValueError as err:
        raise _with_field(err, "response_format") from None


def _trivial(constraint: Constraint) -> bool:
    """A JSON Schema constraint that asks for nothing: an object schema without properties (what
    JSONAdapter sends next to ``tools`` when the tool calls are the signature's only output)."""
    schema = constraint.json_schema or {}
    return (
        constraint.kind == "json_schema" and schema.get("type") == "object" and not schema.get("properties")
    )


def structured(
    *,
    tools: Any = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    response_format: Any = None,
    allowed: Sequence[str] = (),
) -> Structured:
    """Turn a request's tool and output-format fields into one `Structured` plan.

    ``tools`` (OpenAI function tools; ``tool_choice`` ``auto`` / ``required`` / ``none`` / a name /
    ``{"type": "function", "function": {"name": ...}}``) decode under `Constraint.of_tools`: the
    model writes prose or ``<tool_call>`` blocks whose bodies are forced to valid calls. `allowed`
    narrows which tools may be called (lm15's ``ToolChoice.allowed``) while all stay in the prompt.
    ``response_format`` decodes under its JSON Schema / JSON object constraint. Both at once: one
    decode carries one constraint, so the tool calls are enforced and ``response_format`` is
    reported in `Structured.unenforced` (unless it asks for nothing, or ``tool_choice`` forces a call
    and so leaves no content to format). Invalid input raises a ValueError naming the field
    (``tools[0].function.parameters: not a valid JSON Schema ...``, ``tool_choice: ...``,
    ``response_format...``).
    """
    format_constraint = response_format_constraint(response_format)
    if not tools:
        if tool_choice not in (None, "auto", "none"):
            raise ValueError(
                f"tool_choice: {tool_choice!r} asks for a tool call but the request has no tools"
            )
        return Structured(constraint=format_constraint)
    normalized = normalize_tools(tools)
    callable_tools = normalized
    if allowed:
        unknown = sorted(set(allowed) - set(tool_names(normalized)))
        if unknown:
            raise ValueError(
                f"tool_choice.allowed: no tools named {unknown}; tools are {tool_names(normalized)}"
            )
        callable_tools = [t for t in normalized if t["function"]["name"] in allowed]
    try:
        tool_constraint = Constraint.of_tools(
            callable_tools,
            tool_choice,
            parallel_tool_calls=True if parallel_tool_calls is None else bool(parallel_tool_calls),
        )
    except ValueError as err:
        raise _with_field(err, "tool_choice") from None
    if tool_constraint is None:  # tool_choice "none": no calls, the tools stay out of the prompt
        return Structured(constraint=format_constraint)
    unenforced: tuple[str, ...] = ()
    if (
        format_constraint is not None
        and tool_constraint.tool_choice == "auto"
        and not _trivial(format_constraint)
    ):
        unenforced = ("response_format",)
        log.warning(
            "tools with tool_choice='auto' and a response_format in one request: the tool calls are "
            "enforced, the response_format is not (one decode carries one constraint)"
        )
    return Structured(constraint=tool_constraint, tools=normalized, unenforced=unenforced)


def _engine_structured(request: Any, lm15: Any) -> Structured:
    """`structured` for a canonical `dspy.lm15.Request` (FunctionTool, ToolChoice, flat format)."""
    tools = []
    for i, tool in enumerate(request.tools):
        if not isinstance(tool, lm15.FunctionTool):
            raise lm15.UnsupportedFeatureError(
                f"tools[{i}]: branchwise calls function tools only; got the built-in tool {tool.name!r}"
            )
        fn: dict[str, Any] = {"name": tool.name, "parameters": dict(tool.parameters)}
        if tool.description:
            fn["description"] = tool.description
        tools.append({"type": "function", "function": fn})
    cfg = request.config
    choice, allowed, parallel = None, (), None
    if cfg.tool_choice is not None:
        mode, allowed, parallel = (
            cfg.tool_choice.mode,
            tuple(cfg.tool_choice.allowed),
            cfg.tool_choice.parallel,
        )
        choice = allowed[0] if mode == "required" and len(allowed) == 1 else mode
    return structured(
        tools=tools or None,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=cfg.response_format,
        allowed=allowed,
    )


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
    raise lm15.UnsupportedFeatureError(f"branchwise serves text only; got a {part.type!r} part")


def request_messages(request: Any) -> list[dict[str, Any]]:
    """OpenAI-shaped chat messages of a `dspy.lm15.Request` (what ``backend.chat_prompt`` takes):
    text turns as role/content, an assistant's `ToolCallPart`s as its ``tool_calls``, each
    `ToolResultPart` as a ``tool`` message answering its call's id."""
    lm15 = _lm15()
    msgs: list[dict[str, Any]] = []
    if request.system is not None:
        system = request.system
        text = system if isinstance(system, str) else "".join(_part_text(p, lm15) for p in system)
        msgs.append({"role": "system", "content": text})
    for m in request.messages:
        role = {"developer": "system"}.get(m.role, m.role)
        calls = [p for p in m.parts if isinstance(p, lm15.ToolCallPart)]
        results = [p for p in m.parts if isinstance(p, lm15.ToolResultPart)]
        text = "".join(
            _part_text(p, lm15) for p in m.parts if not isinstance(p, lm15.ToolCallPart | lm15.ToolResultPart)
        )
        for r in results:
            msg = {"role": "tool", "tool_call_id": r.id, "content": _part_text(r, lm15)}
            msgs.append({**msg, "name": r.name} if r.name else msg)
        if results and not text:
            continue
        entry: dict[str, Any] = {"role": "user" if role == "tool" else role, "content": text}
        if calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.input, ensure_ascii=False)},
                }
                for c in calls
            ]
        msgs.append(entry)
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

    Native function calling and structured outputs: the engine declares both to DSPy
    (`supports_function_calling`, `supports_response_schema`, `supported_params`), so
    ``dspy.ChatAdapter(use_native_function_calling=True)`` and `dspy.JSONAdapter` send ``tools``,
    ``tool_choice`` and ``response_format``; the tools are shown through the backend's chat template
    (``chat_prompt(messages, tools)``), the reply is decoded under the matching `Constraint`, and
    calls come back as `ToolCallPart`s (``finish_reason="tool_call"``) that DSPy turns into
    `dspy.ToolCalls`. See `structured` for what a request may combine.
    """

    supports_function_calling = True
    supports_response_schema = True
    supports_reasoning = False
    supported_params = SUPPORTED_PARAMS

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
        share = check_share(share)
        # a model given by name is the process's loaded one (shared, see `integrations._shared`)
        self._use = use_model(
            model, backend, owner="this BranchwiseEngine", dtype=dtype, device=device, scheduler=scheduler
        )
        self.backend: Backend = self._use.backend
        self.model = model
        self.share: ShareMode = share
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.scheduler: Scheduler = self._use.scheduler
        self._dtype, self._device = dtype, device
        self._closed = False

    @property
    def model_name(self) -> str:
        """The name DSPy's `dspy.LM` uses for this engine: ``branchwise/<model>``."""
        if self._closed:
            return self._name
        name = self.model or getattr(self.backend, "model_name", None) or "embedded"
        return f"branchwise/{name}"

    # ------------------------------------------------------------------ the Engine contract
    def complete(self, request: Any) -> Any:
        """Answer one canonical request (blocking until its batch has decoded)."""
        prompt_ids, job, want_logprobs, plan = self._job(request)
        gens = self.scheduler.submit(job)
        return self._response(request, prompt_ids, gens[0], job, want_logprobs, plan)

    def stream(self, request: Any) -> Any:
        """The response as stream events (cut at the end: the decode loop has no token callback)."""
        return _lm15().response_to_events(self.complete(request))

    def close(self) -> None:
        """Refuse further requests here and release this engine's share of the model now: the shared
        scheduler's worker stops if no other user is left, and the model is freed once nothing else
        holds it (other engines, chat models and DSPy LMs on it keep working). DSPy never calls this
        (it borrows engines); ``with BranchwiseEngine(...) as engine:`` does."""
        if self._closed:
            return
        self._name = self.model_name  # still named once the backend is gone
        self._closed = True
        self._use.close()
        released = Released("this BranchwiseEngine")
        self.backend, self.scheduler = released, released  # type: ignore[assignment]

    def __enter__(self) -> BranchwiseEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
    def _job(self, request: Any) -> tuple[list[int], Job, bool, Structured]:
        lm15 = _lm15()
        try:  # DSPy's own check that execution controls stayed out of the request (3.4)
            from dspy.clients.engines.base import validate_request
        except ImportError:  # pragma: no cover - moved in a later DSPy: the LM layer still checks
            pass
        else:
            validate_request(request)
        if self._closed:
            raise RuntimeError("the engine is closed")
        try:
            plan = _engine_structured(request, lm15)
        except ValueError as exc:
            raise lm15.InvalidRequestError(str(exc)) from None
        cfg = request.config
        ignored = [
            name
            for name in ("top_k", "frequency_penalty", "presence_penalty", "reasoning")
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
                constraint=plan.constraint,
            )
        except ValueError as exc:
            raise lm15.InvalidRequestError(str(exc)) from None
        msgs = request_messages(request)
        try:
            prompt_ids = (
                self.backend.chat_prompt(msgs, plan.tools) if plan.tools else self.backend.chat_prompt(msgs)
            )
        except ValueError as exc:  # e.g. a tool call in the history whose arguments are not JSON
            raise lm15.InvalidRequestError(str(exc)) from None
        job = Job(prompt=prompt_ids, n=1, params=params, share=self.share)
        return prompt_ids, job, cfg.logprobs is not None, plan

    def _response(
        self,
        request: Any,
        prompt_ids: list[int],
        gen: Generation,
        job: Job,
        want_logprobs: bool,
        plan: Structured | None = None,
    ) -> Any:
        lm15 = _lm15()
        logprobs = None
        if want_logprobs:
            logprobs = tuple(
                lm15.TokenLogprob(token=self.backend.decode([t]), logprob=float(lp), token_id=int(t))
                for t, lp in zip(gen.token_ids, gen.logprobs, strict=True)
            )
        plan = plan or Structured()
        content, calls = plan.split(gen.text)
        if calls:
            parts: list[Any] = [lm15.TextPart(content)] if content else []
            parts += [lm15.ToolCallPart(id=c.id, name=c.name, input=c.arguments) for c in calls]
            message = lm15.Message(role="assistant", parts=tuple(parts))
        else:
            message = lm15.Message.assistant(content)  # a call cut by max_tokens is not content
        info: dict[str, Any] = {
            "finish_reason": gen.finish_reason,
            "share": self.share,
            "batch_requests": job.batch_requests,
            "batch_rows": job.batch_rows,
        }
        if plan.constraint is not None:
            info["constraint"] = plan.constraint.kind
        if plan.unenforced:
            info["unenforced"] = list(plan.unenforced)
        if gen.notes:  # decode steps that left the fast step, with their reasons
            info["notes"] = list(gen.notes)
        return lm15.Response(
            id=f"branchwise-{uuid.uuid4().hex[:16]}",
            model=request.model,
            message=message,
            finish_reason="tool_call" if calls else OPENAI_FINISH.get(gen.finish_reason, "stop"),
            usage=lm15.Usage(input_tokens=len(prompt_ids), output_tokens=len(gen.token_ids)),
            logprobs=logprobs,
            provider_data={"branchwise": info},
        )


class AsyncBranchwiseEngine:
    """The async engine (``dspy.LM(..., async_engine=...)``): awaits the shared scheduler without
    blocking the event loop, so ``asyncio.gather`` of DSPy's ``acall``s merges into shared passes."""

    def __init__(self, sync: BranchwiseEngine) -> None:
        self.sync = sync

    async def complete(self, request: Any) -> Any:
        prompt_ids, job, want_logprobs, plan = self.sync._job(request)
        gens = await self.sync.scheduler.submit_async(job)
        return self.sync._response(request, prompt_ids, gens[0], job, want_logprobs, plan)

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
