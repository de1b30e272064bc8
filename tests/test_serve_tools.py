"""`branchwise serve`: tool calling and structured output through the official `openai` client.

The tiny random model writes gibberish, but under the grammar (`DecodeParams.constraint`) its reply
is a valid call of the tools or JSON valid under the schema: these tests check that the server
passes the constraint down, reads the calls back out of the text in OpenAI's shapes (whole and
streamed, the same either way) and renders a tool conversation's history into the next prompt. The
400 tests need no decoding. `ToolCallStream` is tested on text, without a model.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import BaseModel

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402
from testkit import FakeBackend  # noqa: E402

from branchwise.serve import create_app  # noqa: E402
from branchwise.serve.replies import split_reply  # noqa: E402
from branchwise.serve.runner import serve_in_thread  # noqa: E402
from branchwise.toolcalls import ToolCallStream, normalize_tools  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def client(served: str) -> Any:
    return openai.OpenAI(base_url=f"{served}/v1", api_key="unused", max_retries=0, timeout=120)


def _tool(name: str) -> dict[str, Any]:
    return next(t for t in (WEATHER, TIME) if t["function"]["name"] == name)


def _check_call(call: Any, name: str) -> dict[str, Any]:
    """The call names `name`, has an id, and its arguments are JSON valid under the tool's schema."""
    assert call.type == "function" and call.id
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, _tool(name)["function"]["parameters"])
    return args


def _create(client: Any, stream: bool, **kw: Any) -> Any:
    """A chat completion, streamed or not; a stream is assembled by the openai client's own
    accumulator (what ``client.chat.completions.stream`` uses), checking the deltas' shape."""
    if not stream:
        return client.chat.completions.create(model="tiny", **kw)
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model="tiny", stream=True, **kw):
        state.handle_chunk(chunk)
    try:
        return state.get_final_completion()
    except openai.LengthFinishReasonError as err:  # the accumulator's parse step refuses a cut reply
        return err.completion


# --------------------------------------------------------------------------------------------------
# Tool calls end to end
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_two_turn_tool_conversation(client: Any, tiny_backend: Any, stream: bool) -> None:
    """call (tool_choice=required) -> the tool's result -> an answer; the history reaches the prompt."""
    first = _create(
        client,
        stream,
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=128,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_call(call, call.function.name)
    assert not choice.message.content  # only the call

    history = [
        *QUESTION,
        choice.message,  # sent back as the SDK returned it (refusal/annotations fields and all)
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    second = _create(
        client, stream, messages=history, tools=[WEATHER, TIME], tool_choice="none", max_tokens=5
    )
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str)
    # the server's prompt is the backend's rendering of the whole history (tools not shown: "none")
    rendered = [
        QUESTION[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        history[2],
    ]
    prompt = tiny_backend.chat_prompt(rendered)
    if not stream:
        assert second.usage.prompt_tokens == len(prompt)
    text = tiny_backend.decode(prompt)
    assert call.function.name in text and '{"temperature": 21}' in text


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_replies_equal_whole_ones(client: Any, served: str, tool_choice: str) -> None:
    """Greedy: the streamed reply, assembled, says what the whole reply says (call ids aside). With
    "auto" the tiny model writes prose: its deltas, concatenated, are the whole content."""
    kw: dict[str, Any] = {"messages": QUESTION, "tools": [WEATHER, TIME], "tool_choice": tool_choice}
    kw["parallel_tool_calls"] = False  # one call, then the grammar ends the reply (no max_tokens cut)
    kw.update(temperature=0, max_tokens=128 if tool_choice == "required" else 24, n=2)
    whole = _create(client, False, **kw)
    chunks = httpx.post(
        f"{served}/v1/chat/completions", json={**kw, "stream": True, "model": "tiny"}, timeout=120
    ).text
    deltas = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")]
    for choice in whole.choices:
        mine = [c for d in deltas for c in d["choices"] if c["index"] == choice.index]
        calls = [tc for c in mine for tc in c["delta"].get("tool_calls", ())]
        assert [tc["index"] for tc in calls] == list(range(len(calls)))
        assert [(tc["function"]["name"], tc["function"]["arguments"]) for tc in calls] == [
            (tc.function.name, tc.function.arguments) for tc in choice.message.tool_calls or ()
        ]
        content = "".join(c["delta"].get("content") or "" for c in mine)
        assert content == (choice.message.content or "")
        assert mine[-1]["finish_reason"] == choice.finish_reason
        if tool_choice == "required":
            assert choice.finish_reason == "tool_calls" and len(calls) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_model_that_goes_on_calling_returns_its_call_once(client: Any, stream: bool) -> None:
    """``parallel_tool_calls`` left at its default (true, as OpenAI's clients send it) and the end of
    the reply masked (``min_tokens``): the tiny model must write a second call after its first, and
    with a tool of no arguments it can only repeat it. The repeat ends the reply at once (not at
    ``max_tokens``) and the client gets the call once."""
    ping = {
        "type": "function",
        "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}},
    }
    r = _create(
        client,
        stream,
        messages=QUESTION,
        tools=[ping],
        tool_choice="required",
        temperature=0,
        max_tokens=400,
        extra_body={"min_tokens": 400},
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [c.function.name for c in choice.message.tool_calls] == ["ping"]
    assert r.usage is None or r.usage.completion_tokens < 400


class Verdict(BaseModel):
    verdict: str
    ok: bool


@pytest.mark.parametrize("max_tokens", [48, 64])
def test_parse_fits_a_two_field_model_in_a_small_budget(client: Any, max_tokens: int) -> None:
    """The openai client's ``parse`` refuses a reply cut by ``max_tokens`` (LengthFinishReasonError);
    the free string is bounded from the budget, so the random model's object closes in time."""
    r = client.chat.completions.parse(
        model="tiny", messages=QUESTION, response_format=Verdict, max_tokens=max_tokens, temperature=0
    )
    assert isinstance(r.choices[0].message.parsed, Verdict)
    assert r.usage.completion_tokens <= max_tokens


def test_named_tool_choice_calls_that_tool(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=128,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert isinstance(_check_call(call, "get_time")["utc"], bool)


def test_a_strategy_votes_on_tool_calls(client: Any) -> None:
    """branchwise.strategy with tools: every branch decodes under the tools' grammar and the reply
    carries the winning call, the vote over canonical calls beside it."""
    r = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.8,
        seed=0,
        max_tokens=128,
        extra_body={"branchwise": {"strategy": "self-consistency", "branches": 3}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = _check_call(call, call.function.name)
    extra = r.model_extra["branchwise"]
    assert extra["answer"] in extra["votes"] and call.function.name in extra["answer"]
    assert sum(len(b["text"]) > 0 for b in extra["branches"]) == 3 and args is not None


# --------------------------------------------------------------------------------------------------
# Structured output
# --------------------------------------------------------------------------------------------------

PERSON = {
    "type": "object",
    # bounded, so a reply ends within max_tokens whatever the random model samples
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_validates(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        temperature=0,
        max_tokens=128,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_strategy_votes_on_json_values(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=0.8,
        seed=0,
        max_tokens=128,
        extra_body={"branchwise": {"strategy": "self-consistency", "branches": 2}},
    )
    value = r.model_extra["branchwise"]["value"]
    jsonschema.validate(value, PERSON)
    assert json.loads(r.choices[0].message.content) == value


def test_completions_take_response_format(client: Any) -> None:
    r = client.completions.create(
        model="tiny",
        prompt="A person:",
        temperature=0,
        max_tokens=128,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        },
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_branchwise_constraint_takes_any_constraint(served: str) -> None:
    """The extension field carries what response_format cannot say (here: one of some strings)."""
    body = {"messages": QUESTION, "n": 2, "max_tokens": 16, "seed": 1}
    body["branchwise"] = {"constraint": {"kind": "choice", "choices": ["yes", "no"]}}
    r = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert {c["message"]["content"] for c in r.json()["choices"]} <= {"yes", "no"}


def test_a_constraint_the_grammar_engine_refuses_is_a_400(served: str) -> None:
    """Valid for Python's re, but the grammar engine has no lookahead: refused by name, not a 500."""
    body = {
        "messages": QUESTION,
        "max_tokens": 4,
        "branchwise": {"constraint": {"kind": "regex", "pattern": "(?=a)a"}},
    }
    r = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "branchwise" and err["message"].startswith("branchwise.constraint: pattern"), err
    assert "Lookahead" in err["message"] and ".cc:" not in err["message"], err


# --------------------------------------------------------------------------------------------------
# Bad requests: a 400 naming the field, before any decoding
# --------------------------------------------------------------------------------------------------

_CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
}


def _history(arguments: str, answers: str = "c1") -> list[dict[str, Any]]:
    called = json.loads(json.dumps(_CALLED))
    called["tool_calls"][0]["function"]["arguments"] = arguments
    return [*QUESTION, called, {"role": "tool", "tool_call_id": answers, "content": "21"}]


_BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("chat/completions", {"tools": [_BAD_TOOL]}, "tools", "not a valid JSON Schema"),
        ("chat/completions", {"tools": [{"type": "web_search"}]}, "tools", "function"),
        (
            "chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format",
            "not a valid JSON Schema",
        ),
        ("chat/completions", {"response_format": {"type": "yaml"}}, "response_format", "json_schema"),
        (
            "chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "no tool named 'nope'",
        ),
        ("chat/completions", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "expected"),
        ("chat/completions", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ("chat/completions", {"messages": _history("{not json")}, "messages", "not valid JSON"),
        ("chat/completions", {"messages": _history("[1]")}, "messages", "JSON object"),
        ("chat/completions", {"messages": _history("{}", answers="c9")}, "messages", "answers no tool call"),
        (
            "chat/completions",
            {"messages": [*QUESTION, {"role": "tool", "content": "21"}]},
            "messages",
            "tool_call_id",
        ),
        (
            "chat/completions",
            {"messages": _history("{}"), "branchwise": {"strategy": "self-consistency"}},
            "messages",
            "not supported yet",
        ),
        (
            "chat/completions",
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            "tools",
            "one constraint",
        ),
        ("chat/completions", {"presence_penalty": 0.5}, "presence_penalty", "not implemented"),
        ("chat/completions", {"logit_bias": {"5": 10}}, "logit_bias", "not implemented"),
        ("chat/completions", {"functions": [WEATHER["function"]]}, "functions", "send tools"),
        ("chat/completions", {"modalities": ["text", "audio"]}, "modalities", "text only"),
        ("chat/completions", {"frobnicate": 1}, "frobnicate", "not supported"),
        ("completions", {"prompt": "x", "tools": [WEATHER]}, "tools", "not supported"),
        ("completions", {"prompt": "x", "suffix": "!"}, "suffix", "suffix"),
        ("completions", {"prompt": "x", "best_of": 3}, "best_of", "branchwise.strategy"),
    ],
)
def test_bad_tool_and_format_requests_get_400_naming_the_field(
    served: str, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    if path == "chat/completions":
        body = {"messages": QUESTION, **body}
    r = httpx.post(f"{served}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    assert err["message"].startswith(param)
    assert "Traceback" not in err["message"]


def test_harmless_fields_and_no_op_values_are_accepted(client: Any) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        frequency_penalty=0,
        presence_penalty=0.0,
        logit_bias={},
        modalities=["text"],
        extra_body={"parallel_tool_calls": None},
    )
    assert r.choices[0].message.content is not None


# --------------------------------------------------------------------------------------------------
# Parallel calls, streamed at once (a fake backend that replies with a fixed text)
# --------------------------------------------------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
TWO_CALLS = f"Checking.\n{CALL}\n{CALL.replace('Rome', 'Paris')}\n"


class ScriptedBackend(FakeBackend):
    """Replies `text` (`TWO_CALLS` unless told) to every prompt, ending for `finish`; `extend` takes
    no ``on_step``, so a stream gets each choice whole (both calls in one piece of text) and records
    the params it was given."""

    name = model_name = "scripted"

    def __init__(self, text: str = TWO_CALLS, finish: str = "eos") -> None:
        super().__init__()
        self.text, self.finish = text, finish
        self.tools: list[Any] = []

    def chat_prompt(self, messages: Any, tools: Any = None) -> list[int]:
        self.tools.append(tools)
        return super().chat_prompt(messages)

    def reply(self, prompt: list[int]) -> str:
        return self.text

    def generation(self, node: int, text: str, reason: str = "eos") -> Any:
        return super().generation(node, text, self.finish)


@pytest.fixture
def scripted() -> Iterator[tuple[str, ScriptedBackend]]:
    backend = ScriptedBackend()
    with serve_in_thread(create_app(backend, window_s=0.0)) as url:
        yield url, backend


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_calls_get_their_own_indices(scripted: tuple[str, ScriptedBackend], stream: bool) -> None:
    url, backend = scripted
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    r = _create(client, stream, messages=QUESTION, tools=[WEATHER, TIME], n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        calls = choice.message.tool_calls
        assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Rome", "Paris"]
        assert len({c.id for c in calls}) == 2
    (params,) = backend.params
    assert params.constraint.kind == "tool_calls" and params.constraint.tool_choice == "auto"
    assert [t["function"]["name"] for t in backend.tools[0]] == ["get_weather", "get_time"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("reply", "finish"),
    [
        (f"Checking.\n{CALL}\n{CALL}\n{CALL}", "stop"),  # a repeat ends the reply (the backend stopped)
        (f'Checking.\n{CALL}\n{CALL}\n<tool_call>\n{{"', "length"),  # a repeat, then cut: the same
        (f'Checking.\n{CALL}\n<tool_call>\n{{"name": "get_we', "length"),  # cut in a second call
    ],
    ids=["repeated", "repeated-then-cut", "cut"],
)
def test_each_call_once_and_no_cut_call(reply: str, finish: str, stream: bool) -> None:
    """A call repeating an earlier one is never returned, a call ``max_tokens`` cut never reaches
    ``content``, and a reply with a whole call says ``tool_calls`` even when it was cut."""
    backend = ScriptedBackend(reply, finish)
    with serve_in_thread(create_app(backend, window_s=0.0)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        r = _create(client, stream, messages=QUESTION, tools=[WEATHER], tool_choice="required")
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Rome"}]


def test_tool_choice_none_shows_no_tools_and_puts_no_constraint(
    scripted: tuple[str, ScriptedBackend],
) -> None:
    url, backend = scripted
    body = {"messages": QUESTION, "tools": [WEATHER], "tool_choice": "none"}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).json()
    assert r["choices"][0]["message"] == {"role": "assistant", "content": TWO_CALLS}  # text, as written
    assert r["choices"][0]["finish_reason"] == "stop"
    assert backend.params[0].constraint is None and backend.tools == [None]


def test_tokenize_shows_the_tools(scripted: tuple[str, ScriptedBackend]) -> None:
    """vLLM's /tokenize takes tools too (RemoteBackend's own fields beside them are not checked)."""
    url, backend = scripted
    body = {"model": "x", "messages": QUESTION, "tools": [TIME], "add_generation_prompt": True}
    r = httpx.post(f"{url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert [t["function"]["name"] for t in backend.tools[0]] == ["get_time"]
    bad = httpx.post(f"{url}/tokenize", json={**body, "tool_choice": "nope"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"


# --------------------------------------------------------------------------------------------------
# Reading calls out of text (no model)
# --------------------------------------------------------------------------------------------------

TOOLS = normalize_tools([WEATHER, TIME])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("plain text", "plain text", []),
        (TWO_CALLS, "Checking.", ["get_weather", "get_weather"]),
        (f"Let me look.\n{CALL}\n{CALL}\n more", "Let me look.", ["get_weather"]),  # a repeat ends it
        (CALL, None, ["get_weather"]),
        (f"{CALL}  and then some ", "and then some ", ["get_weather"]),
        (
            'a <tool_call>{"name": "nope", "arguments": {}}</tool_call> b',
            'a <tool_call>{"name": "nope", "arguments": {}}</tool_call> b',
            [],
        ),
        ('cut <tool_call>\n{"name": ', "cut", []),  # a call cut by max_tokens is dropped
        (f"{CALL}\n<tool_call>\n{{", None, ["get_weather"]),
        ("< <tool <tool_c x", "< <tool <tool_c x", []),  # tag-like prose stays as written
        ("< <tool <tool_c", "< <tool <tool_c", []),  # even at the end of a reply the model ended
        ("cut: < <tool <tool_c", "cut: < <tool", []),  # but one cut by max_tokens there began a call
    ],
)
def test_tool_call_stream_reads_any_chunking_as_the_whole(
    text: str, content: str | None, calls: list[str]
) -> None:
    cut = text.startswith("cut")  # (the case cut by max_tokens: the readers are told so)
    whole = split_reply(text, TOOLS, cut)
    assert whole[0] == content
    assert [c.name for c in whole[1]] == calls
    rng = random.Random(0)
    for _ in range(30):
        reader, events, i = ToolCallStream(TOOLS), [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            events += reader.push(text[i : i + k])
            i += k
        events += reader.finish(cut)
        streamed = "".join(v for v in events if isinstance(v, str))
        assert (streamed or None if calls else streamed) == whole[0]
        assert [v.canonical() for v in events if not isinstance(v, str)] == [c.canonical() for c in whole[1]]
