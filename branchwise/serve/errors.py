"""Errors the server answers with, in OpenAI's shape, and the parsing that raises them.

Why one module: the routes, the ASGI guard (which answers before FastAPI sees a request) and the
strategy runner all refuse requests; a client must get the same JSON body from each (``error`` with
``message``, ``type``, ``param``, ``code``), never a plain-text 500 or starlette's ``{"detail"}``.
"""

from __future__ import annotations

import re
from typing import Any

import pydantic_core
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from branchwise.schema_limits import MAX_SCHEMA_DEPTH

__all__ = [
    "MAX_BODY_DEPTH",
    "ClientGone",
    "RequestError",
    "draining",
    "error_body",
    "json_object",
    "parse",
    "too_deep",
    "validation_error",
]

KINDS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_unavailable",
    504: "timeout",
}
"""OpenAI's error ``type`` per status (anything else: ``server_error``)."""

MAX_BODY_DEPTH = 201
"""How deep a request body's JSON may nest (the body's own object is level 1): the limit of the JSON
parser that reads it, pydantic-core's, fixed in that library (its recursion limit of 200 counts the
levels below the first). A deeper body is valid JSON all the same, so it is refused naming this
depth and the schema depth limit (`branchwise.schema_limits.MAX_SCHEMA_DEPTH`), not as malformed."""


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for `status` (what its clients parse into their exception types)."""
    kind = KINDS.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestError(Exception):
    """A request the server refuses: becomes an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers, self.code = status, message, param, headers, code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client closed its connection before its answer was ready: its work was cancelled and
    nothing is sent (a normal event, logged in one line, not an error with a traceback)."""


def draining() -> RequestError:
    """What a request refused or dropped by a shutdown gets (OpenAI's clients retry a 503)."""
    return RequestError(503, "the server is shutting down; retry on another server or later")


def too_deep() -> RequestError:
    """The 400 of a body nested deeper than `MAX_BODY_DEPTH`."""
    return RequestError(
        400,
        f"body: JSON nested more than {MAX_BODY_DEPTH} levels deep, the limit of this server "
        f"(a JSON Schema in it may nest at most {MAX_SCHEMA_DEPTH} levels)",
        "body",
    )


def validation_error(err: ValidationError) -> RequestError:
    """One 400 naming each bad field, what is allowed and the value sent."""
    parts, params = [], []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "json_invalid":
            if "recursion limit" in str(e["ctx"].get("error", "")):
                return too_deep()
            loc, msg = "body", f"malformed JSON ({e['ctx'].get('error', 'invalid')})"
        elif not loc and ": " in msg:  # a model-level check names its field itself: "n: ..."
            loc, msg = msg.split(": ", 1)
        shown = loc and not isinstance(e.get("input"), dict | list) and e["type"] != "missing"
        got = repr(e.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."  # a long input (a huge regex) is not echoed
        parts.append(f"{loc or 'body'}: {msg}" + (f" (got {got})" if shown else ""))
        params.append(re.split(r"[.\[]", loc)[0] if loc else "body")
    return RequestError(400, "; ".join(parts), param=params[0] if params else None)


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The body as `model`, or a 400 naming the bad fields."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise validation_error(err) from None


def json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object (the small vLLM endpoints take no pydantic model)."""
    try:  # the parser `parse` uses: the same depth limit, the same error
        data = pydantic_core.from_json(body or b"{}")
    except ValueError as err:
        if "recursion limit" in str(err):
            raise too_deep() from None
        raise RequestError(400, f"body: malformed JSON ({err})", "body") from None
    if not isinstance(data, dict):
        raise RequestError(400, "body: must be a JSON object", "body")
    return data
