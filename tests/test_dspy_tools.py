"""DSPy native function calling and structured outputs on the local paths (`BranchwiseLM` and
`BranchwiseEngine`): ``tools`` / ``tool_choice`` / ``response_format`` become the decode constraint,
tool calls come back in OpenAI's / lm15's shape and DSPy parses them into `dspy.ToolCalls`.

A scripted backend checks the plumbing exactly (what reaches ``chat_prompt`` and `DecodeParams`);
the tiny random models check the whole path under constrained decoding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pytest

dspy = pytest.importorskip("dspy")

import jsonschema  # noqa: E402
import pydantic  # noqa: E402
from testkit import FakeBackend  # noqa: E402

from branchwise.backends.base import DecodeParams, Generation  # noqa: E402
from branchwise.integrations.dspy import BranchwiseLM, branchwise_lm  # noqa: E402
from branchwise.integrations.dspy_engine import request_messages, structured  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Implementing custom LMs:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Passing OpenAI-style message:DeprecationWarning"),
]

_needs_engines = pytest.mark.skipif(
    not hasattr(dspy, "lm15"), reason="DSPy < 3.4 has no engine contract (BranchwiseLM covers it)"
)


def pick(color: Literal["red", "blue"], urgent: bool) -> str:
    """Pick a color."""
    return color


class PickCall(dspy.Signature):
    """Call the pick tool."""

    question: str = dspy.InputField()
    tools: list[dspy.Tool] = dspy.InputField()
    calls: dspy.ToolCalls = dspy.OutputField()


class Verdict(pydantic.BaseModel):
    ok: bool
    level: Literal["low", "high"]


class Judge(dspy.Signature):
    """Judge the claim."""

    claim: str = dspy.InputField()
    verdict: Verdict = dspy.OutputField()


def _legacy(backend: Any, **kwargs: Any) -> BranchwiseLM:
    kwargs.setdefault("cache", False)
    kwargs.setdefault("max_tokens", 16)
    return BranchwiseLM(backend=backend, **kwargs)


def _engine(backend: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("cache", False)
    kwargs.setdefault("max_tokens", 16)
    return branchwise_lm(backend=backend, **kwargs)


LMS = [pytest.param(_legacy, id="legacy"), pytest.param(_engine, id="engine", marks=_needs_engines)]


# --------------------------------------------------------------------------------------------------
# Plumbing, on a scripted backend
# --------------------------------------------------------------------------------------------------


class ScriptedBackend(FakeBackend):
    """Answers every prompt with `text`; records the tools each prompt showed and each `DecodeParams`."""

    name = model_name = "scripted"

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.seen: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]], tools: Any = None) -> list[int]:
        with self.lock:
            self.seen.append(([dict(m) for m in messages], tools))
        return [1, 2, 3]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        with self.lock:
            self.params.append(params)
        return [Generation(n, [7, 8], self.text, [0.9] * 2, [-0.1] * 2, "eos") for n in nodes]


CALL_REPLY = 'Let me pick.\n<tool_call>\n{"name": "pick", "arguments": {"color": "blue", "urgent": true}}\n</tool_call>'


@pytest.mark.parametrize("make", LMS)
@pytest.mark.parametrize("adapter", ["chat", "json"])
def test_native_function_calling_reaches_the_prompt_and_the_constraint(make: Any, adapter: str) -> None:
    backend = ScriptedBackend(CALL_REPLY)
    lm = make(backend)
    assert lm.supports_function_calling and lm.supports_response_schema
    assert {"tools", "tool_choice", "response_format"} <= set(lm.supported_params)
    ad = dspy.ChatAdapter(use_native_function_calling=True) if adapter == "chat" else dspy.JSONAdapter()
    with dspy.context(lm=lm, adapter=ad):
        pred = dspy.Predict(PickCall)(question="Which color?", tools=[dspy.Tool(pick)])
    (call,) = pred.calls.tool_calls
    assert (call.name, call.args) == ("pick", {"color": "blue", "urgent": True})
    messages, tools = backend.seen[-1]
    assert [t["function"]["name"] for t in tools] == ["pick"]
    constraint = backend.params[-1].constraint
    assert constraint is not None and constraint.kind == "tool_calls" and constraint.tool_choice == "auto"
    assert [t["function"]["name"] for t in constraint.tools] == ["pick"]
    # the tool-call field and the tools input are DSPy's to strip: the prompt only asks the question
    assert "Which color?" in messages[-1]["content"]


def test_legacy_response_is_openai_shaped_with_tool_calls() -> None:
    lm = _legacy(ScriptedBackend(CALL_REPLY))
    tools = [dspy.Tool(pick).format_as_litellm_function_call()]
    resp = lm.forward(prompt="Which color?", tools=tools, tool_choice="required", n=2)
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Let me pick."
        (call,) = choice.message.tool_calls
        assert call["type"] == "function" and call["function"]["name"] == "pick"
        assert json.loads(call["function"]["arguments"]) == {"color": "blue", "urgent": True}
    assert resp.branchwise["constraint"] == "tool_calls"


@_needs_engines
def test_engine_response_carries_tool_call_parts() -> None:
    from dspy.lm15 import Config, FunctionTool, Message, Request, ToolChoice

    lm = _engine(ScriptedBackend(CALL_REPLY))
    fn = dspy.Tool(pick).format_as_litellm_function_call()["function"]
    req = Request(
        model=lm.model,
        messages=(Message.user("Which color?"),),
        tools=(FunctionTool(fn["name"], fn["description"], fn["parameters"]),),
        config=Config(tool_choice=ToolChoice(mode="required", allowed=("pick",))),
    )
    resp = lm(request=req)
    assert resp.finish_reason == "tool_call"
    kinds = [p.type for p in resp.message.parts]
    assert kinds == ["text", "tool_call"]
    assert resp.message.parts[1].name == "pick" and resp.message.parts[1].input["color"] == "blue"
    assert resp.provider_data["branchwise"]["constraint"] == "tool_calls"
    assert lm.engine.backend.params[-1].constraint.tool_choice == "pick"


_BLOCK = CALL_REPLY.removeprefix("Let me pick.\n")
REPEATED_REPLY = "\n".join([CALL_REPLY, _BLOCK, _BLOCK, '<tool_call>\n{"name": "pi'])
"""A small model under parallel_tool_calls: its call three times, then a fourth cut by max_tokens."""


@pytest.mark.parametrize("make", LMS)
def test_a_repeated_call_comes_back_once_and_a_cut_one_not_at_all(make: Any) -> None:
    lm = make(ScriptedBackend(REPEATED_REPLY))
    with dspy.context(lm=lm, adapter=dspy.ChatAdapter(use_native_function_calling=True)):
        pred = dspy.Predict(PickCall, tool_choice="required")(
            question="Which color?", tools=[dspy.Tool(pick)]
        )
    assert [(c.name, c.args) for c in pred.calls.tool_calls] == [("pick", {"color": "blue", "urgent": True})]
    out = lm.history[-1]["outputs"][0]
    assert out["text"] == "Let me pick." and len(out["tool_calls"]) == 1


@pytest.mark.parametrize("make", LMS)
def test_json_adapter_sends_the_schema_and_returns_the_typed_value(make: Any) -> None:
    backend = ScriptedBackend('{"verdict": {"ok": true, "level": "high"}}')
    with dspy.context(lm=make(backend), adapter=dspy.JSONAdapter()):
        pred = dspy.Predict(Judge)(claim="The sky is green.")
    assert pred.verdict == Verdict(ok=True, level="high")
    constraint = backend.params[-1].constraint
    assert constraint is not None and constraint.kind == "json_schema"
    assert constraint.json_schema["required"] == ["verdict"]
    assert backend.seen[-1][1] is None  # no tools in the prompt


def test_response_format_shapes_and_combinations() -> None:
    tools = [dspy.Tool(pick).format_as_litellm_function_call()]
    assert structured().constraint is None
    assert structured(response_format={"type": "text"}).constraint is None
    assert structured(response_format={"type": "json_object"}).constraint.kind == "json_object"
    flat = {"type": "json_schema", "name": "V", "schema": Verdict.model_json_schema(), "strict": True}
    assert structured(response_format=flat).constraint.json_schema["properties"].keys() == {"ok", "level"}
    assert structured(response_format=Verdict).constraint.kind == "json_schema"
    # tool_choice none: nothing to call, the tools stay out of the prompt, the format applies
    plan = structured(tools=tools, tool_choice="none", response_format={"type": "json_object"})
    assert plan.tools is None and plan.constraint.kind == "json_object"
    # tools + a format that asks for nothing (JSONAdapter when the calls are the only output)
    empty = {"type": "object", "properties": {}, "required": [], "additionalProperties": False}
    plan = structured(tools=tools, response_format={"type": "json_schema", "json_schema": {"schema": empty}})
    assert plan.constraint.kind == "tool_calls" and plan.unenforced == ()
    # tools (auto) + a real format: the calls are enforced and the format is reported, not dropped
    plan = structured(tools=tools, response_format=Verdict)
    assert plan.constraint.kind == "tool_calls" and plan.unenforced == ("response_format",)
    plan = structured(tools=tools, tool_choice="required", response_format=Verdict, parallel_tool_calls=False)
    assert plan.unenforced == () and not plan.constraint.parallel_tool_calls


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
            r"response_format\.json_schema\.schema: not a valid JSON Schema",
        ),
        ({"response_format": {"type": "yaml"}}, r"response_format\.type"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}]},
            r"tools\[0\]\.function\.parameters: not a valid JSON Schema",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, r"tools\[0\]\.function\.name"),
        ({"tools": [{"name": "f"}], "tool_choice": "g"}, r"tool_choice: .*'g'"),
        ({"tool_choice": "required"}, r"tool_choice: .*no tools"),
        ({"functions": [{"name": "f"}]}, r"functions: use tools="),
    ],
)
def test_bad_tools_and_formats_raise_naming_the_field(kwargs: dict[str, Any], match: str) -> None:
    backend = ScriptedBackend("")
    with pytest.raises(ValueError, match=match):
        _legacy(backend).forward(prompt="hi", **kwargs)
    assert backend.params == []  # refused before decoding


@_needs_engines
def test_engine_refuses_bad_schemas_and_builtin_tools() -> None:
    from dspy.lm15 import BuiltinTool, FunctionTool, Message, Request

    backend = ScriptedBackend("")
    lm = _engine(backend)
    bad = Request(
        model=lm.model, messages=(Message.user("hi"),), tools=(FunctionTool("f", None, BAD_SCHEMA),)
    )
    with pytest.raises(Exception, match=r"tools\[0\]\.function\.parameters: not a valid JSON Schema"):
        lm(request=bad)
    builtin = Request(model=lm.model, messages=(Message.user("hi"),), tools=(BuiltinTool("web_search"),))
    with pytest.raises(Exception, match=r"tools\[0\]: .*function tools only"):
        lm(request=builtin)
    with pytest.raises(Exception, match=r"response_format\.json_schema\.schema: not a valid JSON Schema"):
        lm("hi", response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMA}})
    assert backend.params == []


@_needs_engines
def test_engine_history_with_tool_calls_and_results_reads_as_openai_messages() -> None:
    from dspy.lm15 import Message, Request, TextPart, ToolCallPart, ToolResultPart

    req = Request(
        model="m",
        messages=(
            Message.user("Which color?"),
            Message(role="assistant", parts=(ToolCallPart(id="c1", name="pick", input={"color": "red"}),)),
            Message(role="tool", parts=(ToolResultPart(id="c1", content=(TextPart("red"),), name="pick"),)),
        ),
    )
    msgs = request_messages(req)
    assert msgs[1]["role"] == "assistant" and msgs[1]["content"] == ""
    assert msgs[1]["tool_calls"][0]["function"] == {"name": "pick", "arguments": '{"color": "red"}'}
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "name": "pick", "content": "red"}


# --------------------------------------------------------------------------------------------------
# End to end on a tiny random model (the grammar makes a random model's output parse)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", LMS)
def test_tiny_model_calls_the_tool_with_valid_arguments(tiny_backend: Any, make: Any) -> None:
    """A random model asked for one call (``required``, no parallel calls) writes exactly one valid
    call: the grammar forces the block and its arguments, then ends the reply."""
    lm = make(tiny_backend, max_tokens=256)
    tool = dspy.Tool(pick)
    adapter = dspy.ChatAdapter(use_native_function_calling=True, parallel_tool_calls=False)
    with dspy.context(lm=lm, adapter=adapter):
        pred = dspy.Predict(PickCall, tool_choice="required")(question="Which color?", tools=[tool])
    assert isinstance(pred.calls, dspy.ToolCalls)
    (call,) = pred.calls.tool_calls
    assert call.name == "pick"
    jsonschema.validate(call.args, tool.format_as_litellm_function_call()["function"]["parameters"])
    assert lm.history[-1]["outputs"][0]["tool_calls"]


@pytest.mark.parametrize("make", LMS)
def test_tiny_model_json_adapter_returns_the_typed_value(tiny_backend: Any, make: Any) -> None:
    lm = make(tiny_backend, max_tokens=192)
    with dspy.context(lm=lm, adapter=dspy.JSONAdapter()):
        pred = dspy.Predict(Judge)(claim="The sky is green.")
    assert isinstance(pred.verdict, Verdict)


@pytest.mark.parametrize("make", LMS)
@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("auto", "auto"),
        ("required", "required"),
        ({"type": "function", "function": {"name": "pick"}}, "pick"),
        ("none", None),
    ],
)
def test_tool_choice_reaches_the_constraint(make: Any, tool_choice: Any, expected: str | None) -> None:
    backend = ScriptedBackend(CALL_REPLY)
    tools = [dspy.Tool(pick).format_as_litellm_function_call()]
    parallel = {} if tool_choice == "none" else {"parallel_tool_calls": False}  # lm15 refuses the pair
    make(backend)("Which color?", tools=tools, tool_choice=tool_choice, **parallel)
    constraint = backend.params[-1].constraint
    if expected is None:  # no calls: no constraint, and the tools stay out of the prompt
        assert constraint is None and backend.seen[-1][1] is None
    else:
        assert constraint.tool_choice == expected and not constraint.parallel_tool_calls


TOOL_HISTORY = [
    {"role": "user", "content": "Which color?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "pick", "arguments": '{"color": "red"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "name": "pick", "content": "red it is"},
]


@pytest.mark.parametrize("make", LMS)
def test_a_history_with_tool_calls_and_results_reaches_the_prompt(make: Any) -> None:
    backend = ScriptedBackend("Red.")
    tools = [dspy.Tool(pick).format_as_litellm_function_call()]
    (text,) = make(backend)(messages=TOOL_HISTORY, tools=tools)
    assert text == "Red."  # no call in the reply: plain text, as DSPy expects
    messages, _ = backend.seen[-1]
    assert messages[1]["role"] == "assistant" and messages[1]["tool_calls"][0]["function"]["name"] == "pick"
    assert json.loads(messages[1]["tool_calls"][0]["function"]["arguments"]) == {"color": "red"}
    assert {k: messages[2][k] for k in ("role", "tool_call_id", "content")} == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "red it is",
    }


def test_tiny_model_prompt_shows_the_tools_and_the_history(tiny_backend: Any) -> None:
    tools = [dspy.Tool(pick).format_as_litellm_function_call()]
    lm = _legacy(tiny_backend, max_tokens=1)
    resp = lm.forward(messages=TOOL_HISTORY, tools=tools, tool_choice="none")
    assert resp.usage.prompt_tokens > 0
    ids = tiny_backend.chat_prompt(BranchwiseLM._messages(None, TOOL_HISTORY), structured(tools=tools).tools)
    prompt = tiny_backend.decode(ids)
    assert '"name": "pick"' in prompt and "<tool_response>\nred it is\n</tool_response>" in prompt


def test_tiny_model_n_sampled_choices_each_follow_the_schema(tiny_backend: Any) -> None:
    """BranchwiseLM's n samples fork one prefill: every fork decodes under its own copy of the grammar."""
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}
    lm = _legacy(tiny_backend, max_tokens=64)
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    resp = lm.forward(prompt="Pick a color.", response_format=rf, n=3, temperature=1.0, seed=1)
    assert len(resp.choices) == 3 and resp.branchwise["constraint"] == "json_schema"
    for choice in resp.choices:
        assert choice.finish_reason == "stop" and choice.message.tool_calls is None
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_reason_chooses_an_action_by_voting_over_tool_calls(tiny_backend: Any) -> None:
    """`Reason(..., tools=...)`: self-consistency over actions as a DSPy module; the answer field is
    the voted action as `dspy.ToolCalls`, valid under the tool's schema, and every branch's action is
    counted. The arguments are enums so that each call ends within the token budget whatever the
    random model samples (a free string or integer can run on, and then the test would rest on
    which seed the sampler happens to draw)."""
    from branchwise.integrations.dspy import Reason
    from branchwise.strategies import self_consistency

    def lookup(city: Literal["Paris", "Rome", "Oslo"], days: Literal[1, 2, 3, 4, 5, 6, 7]) -> str:
        """Weather forecast for a city."""
        return "sunny"

    class Act(dspy.Signature):
        """Pick the tool call that answers the question."""

        question: str = dspy.InputField()
        calls: dspy.ToolCalls = dspy.OutputField()

    strategy = self_consistency(n=3, temperature=1.0, max_tokens=300, seed=0)
    pred = Reason(Act, strategy, backend=tiny_backend, tools=[dspy.Tool(lookup)], chain_of_thought=False)(
        question="Weather in Paris for 2 days?"
    )
    # the voted action: one call, or several in parallel (the random model may write either)
    assert isinstance(pred.calls, dspy.ToolCalls) and pred.calls.tool_calls
    for call in pred.calls.tool_calls:
        assert call.name == "lookup" and set(call.args) == {"city", "days"}
        assert call.args["city"] in {"Paris", "Rome", "Oslo"} and call.args["days"] in range(1, 8)
    assert sum(pred.votes.values()) == 3 and pred.reasoning_result.tool_calls[0].name == "lookup"
