"""`LenientChatAdapter` decodes typed signatures under their JSON Schema, so unchanged `dspy.ReAct`
and typed `dspy.Predict` programs parse whatever a small model would write.

The fast tests run on the tiny random model: its replies are gibberish, so a program that parses
there parses because the grammar forced the shape, not because the model behaved. The slow ones run
the programs as the docs write them on the embedded SmolLM2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest

dspy = pytest.importorskip("dspy")

from branchwise.integrations.dspy import LenientChatAdapter, branchwise_lm  # noqa: E402
from branchwise.integrations.dspy_adapter import signature_schema  # noqa: E402

_needs_engines = pytest.mark.skipif(not hasattr(dspy, "lm15"), reason="DSPy < 3.4 has no engine contract")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Verdict(pydantic.BaseModel):
    ok: bool
    level: Literal["low", "high"]


class Judge(dspy.Signature):  # type: ignore[misc]
    """Judge the claim."""

    claim: str = dspy.InputField()
    verdict: Verdict = dspy.OutputField()


def _react_step(tools: list[Any]) -> Any:
    return dspy.ReAct("question -> answer", tools=tools).react.signature


# ------------------------------------------------------------------------------- schema (no model)
def test_typed_field_schema_is_closed_and_required() -> None:
    schema = signature_schema(dspy.ensure_signature("question -> reasoning, answer: int"))
    assert schema is not None
    assert schema["required"] == ["reasoning", "answer"] and schema["additionalProperties"] is False
    assert schema["properties"] == {"reasoning": {"type": "string"}, "answer": {"type": "integer"}}


def test_pydantic_output_field_is_closed_all_the_way_down() -> None:
    schema = signature_schema(Judge)
    assert schema is not None
    inner = schema["$defs"]["Verdict"]
    assert inner["required"] == ["ok", "level"] and inner["additionalProperties"] is False
    assert inner["properties"]["level"]["enum"] == ["low", "high"]


def test_react_step_becomes_one_alternative_per_tool_with_its_argument_schema() -> None:
    schema = signature_schema(_react_step([add]))
    assert schema is not None
    by_name = {alt["properties"]["next_tool_name"]["enum"][0]: alt for alt in schema["anyOf"]}
    assert set(by_name) == {"add", "finish"}
    assert by_name["add"]["properties"]["next_tool_args"] == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    assert by_name["finish"]["properties"]["next_tool_args"]["properties"] == {}
    assert by_name["add"]["required"] == ["next_thought", "next_tool_name", "next_tool_args"]
    assert by_name["add"]["properties"]["next_thought"] == {"type": "string"}


def test_react_step_with_unlisted_tools_keeps_an_open_argument_object() -> None:
    sig = _react_step([add]).with_instructions("no tool lines here")
    schema = signature_schema(sig)
    assert schema is not None and "anyOf" not in schema
    assert schema["properties"]["next_tool_name"]["enum"] == ["add", "finish"]
    assert schema["properties"]["next_tool_args"]["additionalProperties"] is True


def test_tool_calls_fields_are_left_to_native_function_calling() -> None:
    sig = dspy.ensure_signature("question, tools: list[dspy.Tool] -> calls: dspy.ToolCalls")
    assert signature_schema(sig) is None


def test_constrain_mode_is_validated_and_chooses_the_path() -> None:
    with pytest.raises(ValueError, match="constrain"):
        LenientChatAdapter(constrain="sometimes")  # type: ignore[arg-type]
    typed = dspy.ensure_signature("question -> answer: int")
    text = dspy.ensure_signature("question -> answer")

    class Capable:
        supported_params = ("response_format",)
        supports_response_schema = True

    assert LenientChatAdapter()._constrained(Capable(), typed)
    assert not LenientChatAdapter()._constrained(Capable(), text)
    assert LenientChatAdapter(constrain="always")._constrained(Capable(), text)
    assert not LenientChatAdapter(constrain="never")._constrained(Capable(), typed)
    assert not LenientChatAdapter()._constrained(object(), typed)  # an LM without schemas: text path


def test_parse_reads_a_json_reply_for_typed_signatures() -> None:
    typed = dspy.ensure_signature("question -> answer: int")
    assert LenientChatAdapter().parse(typed, '{"answer": 19}') == {"answer": 19}


# --------------------------------------------------------------------- tiny random model (grammar)
@_needs_engines
def test_typed_predict_parses_gibberish_model_under_the_schema(tiny_backend: Any) -> None:
    lm = branchwise_lm(backend=tiny_backend, cache=False, max_tokens=256)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.Predict("question -> answer: int")(question="What is 12 + 7?")
        assert isinstance(pred.answer, int)
        got = dspy.Predict(Judge)(claim="The sky is green.").verdict
    assert isinstance(got, Verdict)
    sent = lm.history[-1]["kwargs"]["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["strict"] is True


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the legacy BaseLM contract on DSPy 3.4
def test_typed_predict_parses_under_the_legacy_lm_too(tiny_backend: Any) -> None:
    from branchwise.integrations.dspy import BranchwiseLM

    lm = BranchwiseLM(backend=tiny_backend, cache=False, max_tokens=128)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        assert isinstance(dspy.Predict("question -> answer: int")(question="1 + 1?").answer, int)
        assert isinstance(dspy.Predict(Judge)(claim="The sky is green.").verdict, Verdict)


@_needs_engines
def test_react_runs_on_a_gibberish_model(tiny_backend: Any) -> None:
    calls: list[tuple[int, int]] = []

    def tracked_add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    # the tiny model's byte-level tokenizer makes ReAct's prompt ~1,700 of its 2,048 positions
    lm = branchwise_lm(backend=tiny_backend, cache=False, max_tokens=200)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.ReAct("question -> answer", tools=[tracked_add], max_iters=1)(question="12 + 7?")
    assert isinstance(pred.answer, str)
    names = [v for k, v in pred.trajectory.items() if k.startswith("tool_name_")]
    assert names and set(names) <= {"tracked_add", "finish"}
    for key, value in pred.trajectory.items():  # every call the model made had valid arguments
        if key.startswith("observation_"):
            assert "Execution error" not in str(value)
    assert len(calls) == names.count("tracked_add")


@_needs_engines
def test_tool_calls_output_goes_as_native_function_calling(tiny_backend: Any) -> None:
    class Pick(dspy.Signature):  # type: ignore[misc]
        """Pick a tool call."""

        question: str = dspy.InputField()
        tools: list[dspy.Tool] = dspy.InputField()
        calls: dspy.ToolCalls = dspy.OutputField()

    def operate(op: Literal["add", "sub"]) -> str:
        """Choose the operation."""
        return op

    # a bounded argument: the random model's call always closes within the budget (an integer
    # argument may run to max_tokens digit by digit, and a cut call is rightly dropped)
    lm = branchwise_lm(backend=tiny_backend, cache=False, max_tokens=96)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.Predict(Pick, tool_choice="required")(question="12 + 7?", tools=[dspy.Tool(operate)])
    assert [c.name for c in pred.calls.tool_calls][:1] == ["operate"]
    args = pred.calls.tool_calls[0].args
    assert set(args) == {"op"} and args["op"] in ("add", "sub")
    assert [t["function"]["name"] for t in lm.history[-1]["kwargs"]["tools"]] == ["operate"]


# ------------------------------------------------------------------------- embedded model (slow)
@pytest.mark.slow
@_needs_engines
def test_embedded_react_and_typed_predict_run_as_the_docs_write_them(embedded_dir: Path) -> None:
    from branchwise.backends.hf import HFBackend

    lm = branchwise_lm(backend=HFBackend(embedded_dir), max_tokens=128, cache=False)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        react = dspy.ReAct("question -> answer", tools=[add], max_iters=2)
        pred = react(question="What is 40 + 44?")
        assert isinstance(pred.answer, str) and pred.answer
        assert pred.trajectory["tool_name_0"] in ("add", "finish")
        assert isinstance(dspy.Predict("question -> answer: int")(question="What is 40 + 44?").answer, int)
        verdict = dspy.Predict(Judge)(claim="2 + 2 = 5")
        assert isinstance(verdict.verdict, Verdict)


def test_a_repeated_tool_call_ends_react_with_what_was_gathered() -> None:
    """A step that calls a tool with arguments it was already called with finishes instead: the
    tool runs once, the loop ends at the repeat (not after 20 iterations), the thought says why,
    and the answer is extracted from what was gathered."""
    from dspy.utils.dummies import DummyLM

    calls: list[tuple[int, int]] = []

    def tracked_add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    step = {
        "next_thought": "Add them.",
        "next_tool_name": "tracked_add",
        "next_tool_args": {"a": 44, "b": 44},
    }
    lm = DummyLM([step, step, {"reasoning": "The tool said 88.", "answer": "88"}])
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.ReAct("question -> answer", tools=[tracked_add])(question="What is 44 + 44?")
    assert calls == [(44, 44)]
    trajectory = pred.trajectory
    assert (trajectory["tool_name_0"], trajectory["tool_name_1"]) == ("tracked_add", "finish")
    assert "was called with" in trajectory["thought_1"] and "tool_name_2" not in trajectory
    assert pred.answer == "88"


def test_a_new_call_of_the_same_tool_goes_on() -> None:
    """Other arguments are a new call: the loop goes on as DSPy runs it."""
    from dspy.utils.dummies import DummyLM

    first = {"next_thought": "Add.", "next_tool_name": "add", "next_tool_args": {"a": 1, "b": 2}}
    second = {"next_thought": "Add more.", "next_tool_name": "add", "next_tool_args": {"a": 3, "b": 4}}
    done = {"next_thought": "Done.", "next_tool_name": "finish", "next_tool_args": {}}
    lm = DummyLM([first, second, done, {"reasoning": "r", "answer": "7"}])
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.ReAct("question -> answer", tools=[add])(question="?")
    names = [pred.trajectory[f"tool_name_{i}"] for i in range(3)]
    assert names == ["add", "add", "finish"] and pred.trajectory["observation_1"] == 7
