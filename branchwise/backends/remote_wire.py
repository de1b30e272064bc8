"""`RemoteBackend`'s wire format: the ``/v1/completions`` bodies it sends, the replies (whole or
streamed) it reads back into `Generation`s and candidate probabilities, and where a vLLM reply
means something other than branchwise's rules (a blank step).

Why a module of its own: the format has two dialects, a branchwise server's (``branchwise``
extensions: exact token ids, finish reasons, candidate log-probabilities) and vLLM's (``logprobs``
with ``return_tokens_as_token_ids``, ``stop_reason``, ``structured_outputs``), and what each field
means is the part most likely to change with a server release. Here it is functions of their
arguments only, with no connection (`remote_http`) and no branch tree (`remote`), so a
server's new field is one edit here and can be checked without a server.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from branchwise.backends.base import DecodeParams, FinishReason, Generation
from branchwise.backends.remote_http import RemoteCapabilityError, RemoteError
from branchwise.backends.remote_stream import Choices, Emit, Stopped, sse_events
from branchwise.constraints import Constraint

if TYPE_CHECKING:
    import httpx

__all__ = [
    "blank_step_rest",
    "candidate_body",
    "candidate_probs",
    "completion_body",
    "generations",
    "joined",
    "read_stream",
    "structured_outputs",
    "to_copies",
]


def completion_body(
    model: str, prompt: list[int], n: int, params: DecodeParams, *, branchwise: bool
) -> dict[str, Any]:
    """A request for `n` continuations of `prompt` to a branchwise server (`branchwise`) or to a
    vLLM-like one (unstreamed: the caller adds ``stream``)."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "n": n,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if params.min_tokens:
        body["min_tokens"] = params.min_tokens
    if branchwise:
        body["stop"] = list(params.stop) or None
        body["branchwise"] = {"details": True, "step_delimiter": params.step_delimiter}
        if params.constraint is not None:
            body["branchwise"]["constraint"] = params.constraint.model_dump(mode="json")
    else:
        if params.constraint is not None:
            body["structured_outputs"] = structured_outputs(params.constraint)
        stops = [*params.stop, *([params.step_delimiter] if params.step_delimiter else [])]
        body.update(stop=stops or None, logprobs=1, return_tokens_as_token_ids=True)
        if params.step_delimiter:
            body["include_stop_str_in_output"] = True  # vLLM: the delimiter stays in the step
    return body


def generations(
    reply: dict[str, Any], url: str, n: int, params: DecodeParams, encode: Callable[[str], list[int]]
) -> list[Generation]:
    """A completion reply's `n` choices as generations, in index order (node -1: the caller's to
    set). `encode` re-tokenizes the text of a server that named no token ids."""
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    if len(choices) != n:
        raise RemoteError(f"{url} returned {len(choices)} choices for n={n}")
    return [_generation(c, params, encode) for c in choices]


def _generation(
    choice: dict[str, Any], params: DecodeParams, encode: Callable[[str], list[int]]
) -> Generation:
    details = choice.get("branchwise")
    if details is not None:
        return Generation(
            node=-1,
            token_ids=list(details["token_ids"]),
            text=choice["text"],
            top1_probs=list(details["top1_probs"]),
            logprobs=list(details["logprobs"]),
            finish_reason=details["finish_reason"],
        )
    text: str = choice["text"]
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
    else:  # the server gave token strings only: re-tokenize the text (may differ at the edges)
        ids = encode(text)
    top = lp.get("top_logprobs") or []
    top1 = [math.exp(max(row.values())) if row else 0.0 for row in top]
    chosen = [x if x is not None else 0.0 for x in (lp.get("token_logprobs") or [])]
    stop_reason = choice.get("stop_reason")
    finish: FinishReason = "length" if choice.get("finish_reason") == "length" else "eos"
    if isinstance(stop_reason, str):
        if stop_reason == params.step_delimiter:
            finish = "delimiter"
        else:
            finish = "stop"
            text = text.removesuffix(stop_reason)  # vLLM kept it (include_stop_str_in_output)
    return Generation(
        node=-1, token_ids=ids, text=text, top1_probs=top1, logprobs=chosen, finish_reason=finish
    )


def blank_step_rest(gen: Generation, params: DecodeParams) -> DecodeParams | None:
    """vLLM ends a step at the first delimiter, even one the step opens with (the model wrote
    the blank line first); branchwise's rule (`backends.text.finish_text`, which the local
    backend and branchwise serve apply) skips leading whitespace, since a blank line is not a
    step. Without this, a step cut by ``max_tokens`` just before its delimiter is followed by a
    step of nothing but the delimiter. So a blank step is decoded on, within the same token
    budget, as the local backend would: the parameters to decode on with, or None where `gen` is
    no blank step or spent the budget (its finish reason becomes "length"). (Not under a
    constraint, which the caller checks: a second request would restart the grammar.)"""
    if gen.finish_reason != "delimiter" or gen.text.strip():
        return None
    left = params.max_tokens - len(gen.token_ids)
    if left <= 0:
        gen.finish_reason = "length"
        return None
    return params.model_copy(
        update={"max_tokens": left, "min_tokens": max(0, params.min_tokens - len(gen.token_ids))}
    )


def joined(gen: Generation, more: Generation) -> Generation:
    """`gen` continued by `more`, the reply to the request `blank_step_rest` asked for (node -1)."""
    return Generation(
        node=-1,
        token_ids=gen.token_ids + more.token_ids,
        text=gen.text + more.text,
        top1_probs=gen.top1_probs + more.top1_probs,
        logprobs=gen.logprobs + more.logprobs,
        finish_reason=more.finish_reason,
    )


def candidate_body(
    model: str, prompt: list[int], candidates: list[int], *, branchwise: bool, max_logprobs: int
) -> dict[str, Any]:
    """A one-token request whose reply scores `candidates` after `prompt`: exactly on a branchwise
    server, else through the top `max_logprobs` log-probabilities."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
    }
    if branchwise:
        body["branchwise"] = {"score_candidates": candidates}
    else:
        body.update(logprobs=max_logprobs, return_tokens_as_token_ids=True)
    return body


def candidate_probs(
    reply: dict[str, Any], url: str, candidates: list[int], *, branchwise: bool, max_logprobs: int
) -> list[float]:
    """The probabilities of `candidates` in the reply to `candidate_body` (0 for a candidate outside
    the top `max_logprobs`)."""
    if branchwise:
        return [math.exp(x) for x in reply["branchwise"]["candidate_logprobs"]]
    lp = reply["choices"][0].get("logprobs") or {}
    rows = lp.get("top_logprobs") or []
    if not rows or not rows[0]:
        raise RemoteCapabilityError(
            f"{url} returned no top log-probabilities for logprobs={max_logprobs}; "
            "score_next needs them (vLLM: start it with --max-logprobs >= max_logprobs)"
        )
    first = rows[0]
    if not all(k.startswith("token_id:") for k in first):
        raise RemoteCapabilityError(
            f"{url} names top log-probabilities by token text, not id "
            "(it ignores return_tokens_as_token_ids); score_next cannot map them to candidates"
        )
    by_id = {int(k.removeprefix("token_id:")): v for k, v in first.items()}
    return [math.exp(by_id[c]) if c in by_id else 0.0 for c in candidates]


def to_copies(emit: Emit, copies: int, _: int, ids: list[int]) -> None:
    """A greedy request's one choice, reported for each of the `copies` rows it stands for."""
    for k in range(copies):
        emit(k, ids)


def read_stream(
    response: httpx.Response, *, n: int, emit: Emit, stopped: Callable[[], bool] | None
) -> dict[str, Any]:
    """A streamed completion read into the shape of a whole reply (``{"choices": [...]}``), each
    chunk's token ids handed to `emit` on the way; `Stopped` once `stopped()` (leaving closes the
    stream). A dropped connection after the first chunk is an error, not a retry
    (`remote_http.Endpoints.request`)."""
    import httpx

    choices = Choices(n)
    emitted = False
    try:
        for event in sse_events(response.iter_lines()):
            for i, ids in choices.add(event):
                emit(i, ids)
                emitted = True
            if stopped is not None and stopped():
                raise Stopped
    except ValueError as err:
        raise RemoteError(f"{response.url} failed while streaming: {err}") from None
    except httpx.TransportError as err:
        if not emitted:
            raise
        raise RemoteError(
            f"{response.url} dropped a streamed reply midway: {type(err).__name__}: {err}"
        ) from err
    return {"choices": choices.whole}


def structured_outputs(c: Constraint) -> dict[str, Any]:
    """A constraint in vLLM's ``structured_outputs`` request field (vLLM's xgrammar backend runs the
    same grammar this package's local backend does). SGLang reads other field names and would
    decode unconstrained: point RemoteBackend at vLLM or branchwise serve for constrained decoding."""
    if c.kind == "json_schema":
        return {"json": c.json_schema}
    if c.kind == "json_object":
        return {"json_object": True}
    if c.kind == "regex":
        return {"regex": c.pattern}
    if c.kind == "choice":
        return {"choice": list(c.choices)}
    return {"structural_tag": json.dumps(c.structural_tag())}
