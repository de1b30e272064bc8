"""`branchwise serve` under ``response_format``: a reply is whole JSON at any ``max_tokens`` (the
closure is forced within the budget, `grammar_close`), from the openai client as a user sends it.

The tiny random model takes whatever token its grammar allows, so at 32, 48 and 64 tokens (the schema's shortest reply takes 28 in its vocabulary) it is
inside a string or an array when the budget comes: every reply must still parse (and validate)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "steps": {"type": "array", "items": {"type": "integer"}},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "steps", "sure"],
    "additionalProperties": False,
}
FORMATS = {
    "json_object": {"type": "json_object"},
    "json_schema": {
        "type": "json_schema",
        "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True},
    },
}


@pytest.mark.parametrize("max_tokens", [32, 48, 64])
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_replies_are_whole_json_at_any_budget(served: str, kind: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Reply in JSON."}],
        response_format=FORMATS[kind],  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=1.0,
        seed=max_tokens,
        n=3,
    )
    assert r.usage is not None and r.usage.completion_tokens <= 3 * max_tokens
    for choice in r.choices:
        assert choice.finish_reason in ("stop", "length")
        value = json.loads(choice.message.content or "")
        if kind == "json_schema":
            jsonschema.validate(value, SCHEMA)
        else:
            assert isinstance(value, dict)
