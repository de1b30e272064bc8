"""LangChain plug-in: `ChatBranchwise` behaves as a langchain-core chat model (invoke, batch, stream,
stop, n, usage and metadata), concurrent calls merge into shared decode passes, and `as_runnable`
makes a whole strategy one LCEL step.

Skipped when langchain-core is not installed (the ``langchain`` extra). langchain-tests' standard
suites run in `test_langchain_standard.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool
from pydantic import BaseModel, Field
from testkit import FakeBackend
from typing_extensions import TypedDict

from branchwise.backends.base import DecodeParams, DecodeStep, Generation
from branchwise.integrations.langchain import ChatBranchwise, as_runnable
from branchwise.integrations.langchain_convert import ResponseTagFilter, chat_messages, strip_tool_responses
from branchwise.toolcalls import ToolCallStream, parse_tool_calls, split_calls

QUESTIONS = [
    "What is 12 + 7?",
    "If Tom has 5 apples and eats 2, how many are left?",
    "What is 6 times 7?",
    "How many days are in a week?",
    "What is 100 - 37?",
    "Is 19 a prime number?",
    "What is 8 * 9?",
    "How many months are in a year?",
]


def _chat(backend: Any, **kwargs: Any) -> ChatBranchwise:
    kwargs.setdefault("max_tokens", 16)
    return ChatBranchwise(backend=backend, **kwargs)


def test_invoke_returns_an_ai_message_with_usage_and_metadata(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend, logprobs=True)
    msg = chat.invoke([SystemMessage("Be brief."), HumanMessage("What is 12 + 7?")])
    assert isinstance(msg, AIMessage) and isinstance(msg.content, str)
    usage = msg.usage_metadata
    assert usage is not None and usage["input_tokens"] > 0 and 1 <= usage["output_tokens"] <= 16
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = msg.response_metadata
    assert meta["finish_reason"] in ("stop", "length") and meta["model_provider"] == "branchwise"
    assert len(meta["logprobs"]["content"]) == usage["output_tokens"]
    assert chat.invoke("What is 12 + 7?").content == chat.invoke("What is 12 + 7?").content  # greedy


def test_n_samples_share_one_call(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend, n=3, temperature=0.8, seed=1)
    before = chat.batch_stats.extend_calls
    result = chat.generate([[HumanMessage("What is 12 + 7?")]])
    gens = result.generations[0]
    assert len(gens) == 3 and all(isinstance(g.message, AIMessage) for g in gens)
    assert chat.batch_stats.extend_calls - before == 1  # one prefill forked 3 times, one decode
    usage = result.llm_output["token_usage"]
    out = sum(g.message.usage_metadata["output_tokens"] for g in gens)
    assert usage["completion_tokens"] == out
    assert usage["prompt_tokens"] == gens[0].message.usage_metadata["input_tokens"]  # counted once
    # call-time override of a field
    assert len(chat.generate([[HumanMessage("hi")]], n=2).generations[0]) == 2


def test_stop_sequences_cut_the_reply(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend, max_tokens=24)
    full = chat.invoke("What is 6 times 7?").content
    assert len(full) >= 6
    stop = full[3:5]
    cut = chat.invoke("What is 6 times 7?", stop=[stop]).content
    assert cut == full[: full.index(stop)]
    assert chat.bind(stop=[stop]).invoke("What is 6 times 7?").content == cut


def test_stream_equals_invoke_and_ends_with_usage(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend, max_tokens=20)
    full = chat.invoke("What is 100 - 37?")
    chunks = list(chat.stream("What is 100 - 37?"))
    assert len(chunks) >= 2
    assert "".join(c.content for c in chunks) == full.content
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.usage_metadata == full.usage_metadata
    assert total.response_metadata["finish_reason"] == full.response_metadata["finish_reason"]

    async def astream() -> str:
        return "".join([c.content async for c in chat.astream("What is 100 - 37?")])

    assert asyncio.run(astream()) == full.content
    stop = full.content[2:4]
    streamed = "".join(c.content for c in chat.stream("What is 100 - 37?", stop=[stop]))
    assert streamed == full.content[: full.content.index(stop)]


def test_batch_from_threads_merges_and_equals_serial(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend)
    serial = [chat.invoke(q).content for q in QUESTIONS]
    stats = chat.batch_stats
    before = stats.extend_calls, stats.requests
    batched = [m.content for m in chat.batch(QUESTIONS, config={"max_concurrency": len(QUESTIONS)})]
    assert batched == serial
    calls, requests = stats.extend_calls - before[0], stats.requests - before[1]
    assert requests == len(QUESTIONS) and calls < requests  # shared decode passes


def test_abatch_and_gather_merge_and_equal_serial(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend)
    serial = [chat.invoke(q).content for q in QUESTIONS[:6]]
    stats = chat.batch_stats
    before = stats.extend_calls

    async def main() -> tuple[list[str], list[str]]:
        a = [m.content for m in await chat.abatch(QUESTIONS[:6])]
        b = [m.content for m in await asyncio.gather(*(chat.ainvoke(q) for q in QUESTIONS[:6]))]
        return a, b

    a, b = asyncio.run(main())
    assert a == serial and b == serial
    assert stats.extend_calls - before < 12


def test_stream_yields_while_decoding_and_a_reader_that_stops_cancels(tiny_backend: Any) -> None:
    chat = _chat(tiny_backend, max_tokens=400)
    stats = chat.batch_stats
    before = stats.cancelled, stats.extend_calls
    stream = chat.stream("What is 12 + 7?")
    first = next(stream)  # arrives after the first decode step, not after 400
    assert first.content and first.chunk_position is None
    stream.close()
    assert stats.cancelled == before[0] + 1
    # the cancelled row is stopped at its next step; the next call then decodes normally
    assert _chat(tiny_backend).invoke("What is 12 + 7?").content
    assert stats.extend_calls > before[1]


def test_as_runnable_is_one_lcel_step(tiny_backend: Any) -> None:
    from branchwise.reasoners.reasoner import Reasoner
    from branchwise.strategies import self_consistency

    step = as_runnable(Reasoner(self_consistency(n=3, max_tokens=12, seed=0), backend=tiny_backend))
    out = step.invoke("What is 12 + 7?")
    assert set(out) >= {"answer", "votes", "support", "text", "kv_stats", "result"}
    assert out["strategy"] == out["result"].strategy and isinstance(out["votes"], dict)
    chain = ChatPromptTemplate.from_messages([("human", "Question: {q}")]) | step
    assert chain.invoke({"q": "What is 12 + 7?"})["result"].question.startswith("Question: ")
    assert step.invoke({"question": "What is 12 + 7?"})["answer"] == out["answer"]
    assert asyncio.run(step.ainvoke("What is 12 + 7?"))["answer"] == out["answer"]
    with pytest.raises(KeyError, match="question"):
        step.invoke({"q": "x"})


def test_integrations_langgraph_snippet_runs(tiny_llama_dir: Any, tmp_path: Any) -> None:
    """The LangGraph snippet in docs/INTEGRATIONS.md runs as written (on a tiny model instead of
    the embedded one, with fewer branches) and prints an answer line."""
    pytest.importorskip("langgraph")
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "INTEGRATIONS.md").read_text()
    section = doc.split("## LangGraph", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "docs/INTEGRATIONS.md lost its LangGraph snippet"
    snippet = code.group(1)
    assert "HFBackend()" in snippet and "self_consistency(n=4, max_tokens=64)" in snippet
    snippet = snippet.replace("HFBackend()", f"HFBackend({str(tiny_llama_dir)!r})")
    snippet = snippet.replace("self_consistency(n=4, max_tokens=64)", "self_consistency(n=2, max_tokens=8)")
    script = tmp_path / "langgraph_snippet.py"
    script.write_text(snippet)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the snippet printed nothing"


# --------------------------------------------------------------------------------------------------
# tool calling and structured output
# --------------------------------------------------------------------------------------------------


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * 7'."""
    return str(eval(expression, {"__builtins__": {}}))  # a test tool: digits and operators only


class ScriptedBackend(FakeBackend):
    """A backend that answers each call with the next scripted reply (token = character) and keeps
    what it was asked: the messages and tools of each prompt and each call's `DecodeParams`."""

    model_name = "scripted"

    def __init__(self, *replies: str) -> None:
        super().__init__()
        self.replies = list(replies)
        self.messages: list[list[dict[str, Any]]] = []
        self.tools: list[list[dict[str, Any]] | None] = []

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        self.messages.append([dict(m) for m in messages])
        self.tools.append(None if tools is None else [dict(t) for t in tools])
        return [1, 2, 3]

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        """Each reply, one character per decode step to `on_step` (as the local backend does)."""
        self.params.append(params)
        out = []
        for node in nodes:
            text = self.replies.pop(0) if len(self.replies) > 1 else self.replies[0]
            ids = [ord(c) for c in text]
            out.append(Generation(node, ids, text, [0.9] * len(ids), [-0.1] * len(ids), "eos"))
        if on_step is not None:
            for i in range(max(len(g.token_ids) for g in out)):
                on_step(
                    DecodeStep(
                        {r: g.token_ids[i : i + 1] for r, g in enumerate(out) if i < len(g.token_ids)}, {}
                    )
                )
            on_step(DecodeStep({}, dict(enumerate(out))))
        return out


def _block(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


CALL_REPLY = "Let me compute that.\n" + _block("calculator", {"expression": "12 * 7"})


def test_bind_tools_returns_calls_with_ids_and_the_prose_as_content() -> None:
    backend = ScriptedBackend(CALL_REPLY)
    msg = ChatBranchwise(backend=backend).bind_tools([calculator]).invoke("What is 12 * 7?")
    assert msg.content == "Let me compute that."
    (call,) = msg.tool_calls
    assert call["name"] == "calculator" and call["args"] == {"expression": "12 * 7"}
    assert call["id"].startswith("call_") and call["type"] == "tool_call"
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    constraint = backend.params[-1].constraint
    assert constraint is not None and constraint.kind == "tool_calls" and constraint.tool_choice == "auto"
    assert [t["function"]["name"] for t in backend.tools[-1]] == ["calculator"]  # shown to the model
    assert backend.tools[-1][0]["function"]["parameters"]["properties"] == {"expression": {"type": "string"}}


def test_usage_counts_every_token_decoded_a_dropped_cut_call_included() -> None:
    """A reply's usage is what was decoded: a call the model began again after its first one and
    never closed is dropped from the reply (one call comes back) but its tokens were decoded and
    are counted (a ~20-token call reported as 64 of 64 was this: a repeat cut by max_tokens)."""
    reply_text = CALL_REPLY + "\n<tool_call>\n" + '{"name": "calculator", "arguments": {"expr'
    msg = ChatBranchwise(backend=ScriptedBackend(reply_text)).bind_tools([calculator]).invoke("12 * 7?")
    assert len(msg.tool_calls) == 1
    assert msg.usage_metadata is not None
    assert msg.usage_metadata["output_tokens"] == len(reply_text)  # one token per character here
    assert msg.usage_metadata["input_tokens"] == 3


def test_a_repeated_call_ends_the_agent_loop_with_its_result() -> None:
    """A call identical (name and arguments) to one already answered in the conversation is not
    handed back to the agent, which would run it again and loop: the reply is its result instead,
    said in the metadata. A call with other arguments is a call as usual."""
    history = [
        HumanMessage("What is 12 * 7?"),
        AIMessage("", tool_calls=[{"name": "calculator", "args": {"expression": "12 * 7"}, "id": "c1"}]),
        ToolMessage("84", tool_call_id="c1"),
    ]
    backend = ScriptedBackend(CALL_REPLY)
    reply = ChatBranchwise(backend=backend).bind_tools([calculator]).invoke(history)
    assert reply.tool_calls == [] and reply.content == "84"
    assert reply.response_metadata["finish_reason"] == "stop"
    assert reply.response_metadata["branchwise"]["repeated_calls"] == ['calculator({"expression":"12 * 7"})']
    other = ScriptedBackend(_block("calculator", {"expression": "84 + 1"}))
    reply = ChatBranchwise(backend=other).bind_tools([calculator]).invoke(history)
    assert [c["args"] for c in reply.tool_calls] == [{"expression": "84 + 1"}]
    assert "repeated_calls" not in reply.response_metadata["branchwise"]


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        (None, "auto"),
        ("auto", "auto"),
        ("any", "required"),
        ("required", "required"),
        (True, "required"),
        ("calculator", "calculator"),
        ({"type": "function", "function": {"name": "calculator"}}, "calculator"),
        ("none", None),
    ],
)
def test_tool_choice_reaches_the_constraint(choice: Any, expected: str | None) -> None:
    backend = ScriptedBackend("12 * 7 is 84.")
    chat = ChatBranchwise(backend=backend)
    msg = chat.bind_tools([calculator, json.dumps], tool_choice=choice).invoke("What is 12 * 7?")
    constraint = backend.params[-1].constraint
    if expected is None:  # "none": no calls, and the tools are not shown
        assert constraint is None and backend.tools[-1] is None
    else:
        assert constraint is not None and constraint.tool_choice == expected
    assert msg.content == "12 * 7 is 84." and msg.tool_calls == []
    with pytest.raises(ValueError, match="tool_choice"):
        chat.bind_tools([calculator], tool_choice="search")


def test_bind_tools_takes_every_tool_shape_langchain_takes() -> None:
    class Weather(BaseModel):
        """Weather at a place."""

        city: str = Field(description="the city")

    class Add(TypedDict):
        """Add two integers."""

        a: int
        b: int

    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    openai_tool = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}
    backend = ScriptedBackend("ok")
    chat = ChatBranchwise(backend=backend).bind_tools(
        [calculator, Weather, Add, multiply, openai_tool], parallel_tool_calls=False
    )
    chat.invoke("hi")
    assert [t["function"]["name"] for t in backend.tools[-1]] == [
        "calculator",
        "Weather",
        "Add",
        "multiply",
        "noop",
    ]
    assert backend.params[-1].constraint.parallel_tool_calls is False
    with pytest.raises(ValueError, match="one constraint"):
        chat.invoke("hi", response_format={"type": "json_object"})


def _aggregate(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    return total


def test_stream_yields_prose_then_one_tool_call_chunk_per_call() -> None:
    reply = (
        "First this.\n"
        + _block("calculator", {"expression": "1+1"})
        + "\n"
        + _block("calculator", {"expression": "2*3"})
    )
    backend = ScriptedBackend(reply)
    chat = ChatBranchwise(backend=backend).bind_tools([calculator])
    whole = chat.invoke("go")
    chunks = list(chat.stream("go"))
    assert len(chunks) > 10  # streamed as decoded (a character per step here)
    assert not any("<" in c.content for c in chunks)  # no tag, whole or partial, leaks as prose
    with_calls = [c for c in chunks if c.tool_call_chunks]
    assert [len(c.tool_call_chunks) for c in with_calls] == [1, 1]
    assert [c.tool_call_chunks[0]["index"] for c in with_calls] == [0, 1]
    total = _aggregate(chunks)
    assert total.content == whole.content == "First this."
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls
    ]
    assert total.response_metadata["finish_reason"] == "tool_calls"


SPLIT_CASES = [
    "just prose, no calls",
    CALL_REPLY,
    "  before " + _block("calculator", {"expression": "1"}) + "  after  ",
    _block("calculator", {"expression": "1"}) + _block("calculator", {"expression": "2"}),
    "a < b and <tool_c is not a tag",
    "broken <tool_call>\n{not json}\n</tool_call> block stays prose",
    "unknown " + _block("search", {"q": "x"}) + " tool stays prose",
    "cut off " + '<tool_call>\n{"name": "calculator", "argu',
    "ends with a partial tag <tool_ca",
]


@pytest.mark.parametrize("text", SPLIT_CASES)
def test_stream_fed_in_any_pieces_equals_the_whole_reply(text: str) -> None:
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    prose, calls = split_calls(text, tools)
    assert [c.canonical() for c in calls] == [c.canonical() for c in parse_tool_calls(text, tools)[1]]
    expected = (prose, [(c.name, c.arguments) for c in calls])
    for cuts in [[], list(range(1, len(text)))] + [[i] for i in range(1, len(text))]:
        splitter = ToolCallStream(tools)
        parts = []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            parts += splitter.push(text[a:b])
        parts += splitter.finish()
        got_prose = "".join(p for p in parts if isinstance(p, str))
        got_calls = [(p.name, p.arguments) for p in parts if not isinstance(p, str)]
        assert (got_prose, got_calls) == expected, cuts


def test_history_of_calls_and_results_is_openai_shaped(tiny_backend: Any) -> None:
    history = [
        SystemMessage("Use tools."),
        HumanMessage("What is 12 * 7?"),
        AIMessage(
            [{"type": "text", "text": "Computing."}, {"type": "tool_use", "id": "c1", "name": "calculator"}],
            tool_calls=[
                {"name": "calculator", "args": {"expression": "12 * 7"}, "id": "c1", "type": "tool_call"}
            ],
        ),
        ToolMessage("84", tool_call_id="c1"),
    ]
    assert chat_messages(history) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "What is 12 * 7?"},
        {
            "role": "assistant",
            "content": "Computing.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "12 * 7"}'},
                }
            ],
        },
        {"role": "tool", "content": "84", "tool_call_id": "c1", "name": "calculator"},
    ]
    # the tiny model's ChatML template has no tool format: the fallback prompt shows both as blocks
    chat = _chat(tiny_backend)
    prompt = tiny_backend.decode(tiny_backend.chat_prompt(chat_messages(history)))
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 7"}}' in prompt
    assert "<tool_response>\n84\n</tool_response>" in prompt
    assert isinstance(chat.bind_tools([calculator]).invoke(history), AIMessage)


class Joke(BaseModel):
    """A joke."""

    setup: str
    punchline: str


class JokeDict(TypedDict):
    """A joke."""

    setup: str
    punchline: str


JOKE = '{"setup": "Why?", "punchline": "Because."}'


@pytest.mark.parametrize(
    "schema", [Joke, JokeDict, Joke.model_json_schema()], ids=["pydantic", "typeddict", "json"]
)
def test_with_structured_output_json_schema_decodes_under_the_schema(schema: Any) -> None:
    backend = ScriptedBackend(JOKE)
    structured = ChatBranchwise(backend=backend).with_structured_output(schema)
    value = structured.invoke("Tell me a joke.")
    if schema is Joke:
        assert value == Joke(setup="Why?", punchline="Because.")
    else:
        assert value == {"setup": "Why?", "punchline": "Because."}
    constraint = backend.params[-1].constraint
    assert constraint is not None and constraint.kind == "json_schema"
    assert set(constraint.json_schema["properties"]) == {"setup", "punchline"}
    assert backend.tools[-1] is None  # nothing added to the prompt
    assert list(structured.stream("Tell me a joke."))[-1] == value
    if isinstance(schema, type):  # response_format takes the class too (as ChatOpenAI's does)
        ChatBranchwise(backend=backend).invoke("Tell me a joke.", response_format=schema)
        assert backend.params[-1].constraint == constraint


def test_with_structured_output_function_calling_and_json_mode() -> None:
    backend = ScriptedBackend(_block("Joke", json.loads(JOKE)))
    chat = ChatBranchwise(backend=backend)
    assert chat.with_structured_output(Joke, method="function_calling").invoke("joke") == Joke(
        setup="Why?", punchline="Because."
    )
    constraint = backend.params[-1].constraint
    assert constraint.kind == "tool_calls" and constraint.tool_choice == "Joke"
    assert constraint.parallel_tool_calls is False
    backend.replies = [_block("JokeDict", json.loads(JOKE))]
    assert chat.with_structured_output(JokeDict, method="function_calling").invoke("joke") == json.loads(JOKE)

    backend.replies = [JOKE]
    assert chat.with_structured_output(None, method="json_mode").invoke("joke") == json.loads(JOKE)
    assert backend.params[-1].constraint.kind == "json_object"


def test_with_structured_output_include_raw_keeps_a_reply_that_does_not_parse() -> None:
    backend = ScriptedBackend('{"setup": "Why?"')  # cut by max_tokens
    out = ChatBranchwise(backend=backend).with_structured_output(Joke, include_raw=True).invoke("joke")
    assert isinstance(out["raw"], AIMessage) and out["raw"].content == '{"setup": "Why?"'
    assert out["parsed"] is None and out["parsing_error"] is not None
    backend.replies = [JOKE]
    out = ChatBranchwise(backend=backend).with_structured_output(Joke, include_raw=True).invoke("joke")
    assert out["parsed"] == Joke(setup="Why?", punchline="Because.") and out["parsing_error"] is None


class Pick(BaseModel):
    """A bounded choice (a random model closes it: no free strings)."""

    color: str = Field(json_schema_extra={"enum": ["red", "green", "blue"]})
    sure: bool


def test_grammar_forces_valid_calls_and_json_on_a_random_model(tiny_backend: Any) -> None:
    """A random model follows no format by itself: every call and value here is the grammar's."""
    chat = _chat(tiny_backend, max_tokens=160)
    msg = chat.bind_tools([Pick], tool_choice="any").invoke("Pick a color.")
    assert msg.tool_calls and all(c["name"] == "Pick" for c in msg.tool_calls)
    Pick.model_validate(msg.tool_calls[0]["args"])
    streamed = _aggregate(list(chat.bind_tools([Pick], tool_choice="any").stream("Pick a color.")))
    assert [c["args"] for c in streamed.tool_calls] == [c["args"] for c in msg.tool_calls]
    assert streamed.content == msg.content
    assert isinstance(chat.with_structured_output(Pick).invoke("Pick a color."), Pick)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # create_react_agent moved to langchain.agents
def test_langgraph_react_agent_loop_sends_calls_and_results_back() -> None:
    """The prebuilt agent binds the tools itself; the second turn's prompt holds the call and its
    result as OpenAI-shaped assistant and tool messages."""
    pytest.importorskip("langgraph")
    from langgraph.prebuilt import create_react_agent

    backend = ScriptedBackend(_block("calculator", {"expression": "12 * 7"}), "12 * 7 = 84.")
    agent = create_react_agent(ChatBranchwise(backend=backend), [calculator])
    out = agent.invoke({"messages": [("user", "What is 12 * 7?")]}, {"recursion_limit": 6})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert out["messages"][2].content == "84" and out["messages"][-1].content == "12 * 7 = 84."
    second = backend.messages[-1]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    call = second[1]["tool_calls"][0]
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "12 * 7"}'}
    assert second[2] == {"role": "tool", "content": "84", "tool_call_id": call["id"], "name": "calculator"}
    assert [t["function"]["name"] for t in backend.tools[-1]] == ["calculator"]


# --------------------------------------------------------------------------------------------------
# agents: langchain.agents.create_agent, the first turn's tool choice, echoed tool results
# --------------------------------------------------------------------------------------------------

ECHO = "<tool_response>\n84\n</tool_response>"


@pytest.mark.parametrize(
    ("text", "clean"),
    [
        (ECHO, "84"),
        ("The answer is " + ECHO + ".", "The answer is 84."),
        (ECHO + "\n" + ECHO, "84\n84"),
        ("no tags at all \n", "no tags at all"),
        ("<tool_response>84", "84"),
    ],
)
def test_echoed_tool_response_tags_are_dropped_whole_and_streamed(text: str, clean: str) -> None:
    assert strip_tool_responses(text) == clean
    for size in (1, 2, 3, 5, 7):  # any split of the stream adds up to the whole reply's cleaning
        tags = ResponseTagFilter()
        pieces = [tags.push(text[i : i + size]) for i in range(0, len(text), size)]
        assert "".join(pieces) + tags.finish() == clean
        assert "tool_response" not in "".join(pieces)


def _history(answered: bool) -> list[Any]:
    msgs: list[Any] = [HumanMessage("What is 12 * 7?")]
    if answered:
        call = {"name": "calculator", "args": {"expression": "12 * 7"}, "id": "call_1", "type": "tool_call"}
        msgs += [AIMessage("", tool_calls=[call]), ToolMessage("84", tool_call_id="call_1")]
    return msgs


@pytest.mark.parametrize(
    ("first", "given", "answered", "expected"),
    [
        ("required", None, False, "required"),  # an agent's first turn
        ("required", None, True, "auto"),  # a tool result is in: the model decides
        ("required", "auto", False, "auto"),  # a tool_choice the caller gave wins
        ("calculator", None, False, "calculator"),
        (None, None, False, "auto"),  # the default: OpenAI's auto
    ],
)
def test_first_tool_choice_applies_until_a_tool_result_is_in(
    first: Any, given: Any, answered: bool, expected: str
) -> None:
    backend = ScriptedBackend("84")
    chat = ChatBranchwise(backend=backend, first_tool_choice=first)
    chat.bind_tools([calculator], tool_choice=given).invoke(_history(answered))
    constraint = backend.params[-1].constraint
    assert constraint is not None and constraint.tool_choice == expected


def test_first_tool_choice_counts_results_after_the_last_question_only() -> None:
    backend = ScriptedBackend("84")
    chat = ChatBranchwise(backend=backend, first_tool_choice="required")
    chat.bind_tools([calculator]).invoke([*_history(True), AIMessage("84"), HumanMessage("And 6 * 7?")])
    assert (
        backend.params[-1].constraint is not None and backend.params[-1].constraint.tool_choice == "required"
    )
    chat.invoke("No tools bound here.")  # without tools the setting asks for nothing
    assert backend.params[-1].constraint is None


def test_a_bad_first_tool_choice_names_the_field() -> None:
    chat = ChatBranchwise(backend=ScriptedBackend("x"), first_tool_choice="no_such_tool")
    with pytest.raises(ValueError, match="first_tool_choice"):
        chat.bind_tools([calculator]).invoke("What is 12 * 7?")


def test_a_reply_after_a_tool_result_drops_echoed_tags_in_invoke_and_stream() -> None:
    chat = ChatBranchwise(backend=ScriptedBackend(ECHO))
    msg = chat.bind_tools([calculator]).invoke(_history(True))
    assert msg.content == "84" and msg.tool_calls == []
    streamed = _aggregate(list(chat.bind_tools([calculator]).stream(_history(True))))
    assert streamed.content == "84"
    # a first turn has no tool result to echo: its text is the model's own
    assert ChatBranchwise(backend=ScriptedBackend(ECHO)).invoke("Hi").content == ECHO


def test_create_agent_calls_the_tool_first_and_answers_without_tags() -> None:
    """`langchain.agents.create_agent` binds the tools itself (no tool_choice): `first_tool_choice`
    makes its first turn a call; the answer after the result is cleaned of echoed tags."""
    agents = pytest.importorskip("langchain.agents")
    backend = ScriptedBackend(_block("calculator", {"expression": "12 * 7"}), ECHO)
    llm = ChatBranchwise(backend=backend, first_tool_choice="required")
    agent = agents.create_agent(model=llm, tools=[calculator])
    out = agent.invoke({"messages": [("user", "What is 12 * 7?")]}, {"recursion_limit": 6})
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert out["messages"][2].content == "84" and out["messages"][-1].content == "84"
    assert [p.constraint.tool_choice for p in backend.params if p.constraint] == ["required", "auto"]


@pytest.mark.slow
def test_embedded_create_agent_calls_the_tool_then_answers(embedded_dir: Any) -> None:
    """`create_agent(model=ChatBranchwise(first_tool_choice="required"), tools=[...])` as the docs
    write it, on the embedded model: the first turn calls the calculator, the tool runs, and the
    final answer carries no ``<tool_response>`` tag. Which expression the 135M model writes, and what
    it answers, is its own (greedy, so the same each run)."""
    agents = pytest.importorskip("langchain.agents")
    from branchwise.backends.hf import HFBackend

    llm = ChatBranchwise(backend=HFBackend(embedded_dir), first_tool_choice="required")
    agent = agents.create_agent(model=llm, tools=[calculator])
    out = agent.invoke(
        {"messages": [("user", "What is 12 * 7? Use the calculator.")]}, {"recursion_limit": 8}
    )
    messages = out["messages"]
    first = messages[1]
    assert isinstance(first, AIMessage) and [c["name"] for c in first.tool_calls] == ["calculator"]
    result = messages[2]
    assert isinstance(result, ToolMessage) and result.tool_call_id == first.tool_calls[0]["id"]
    assert result.status == "success", result.content  # the model's expression evaluated
    final = messages[-1]
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert "tool_response" not in final.content
    assert result.content in final.content
