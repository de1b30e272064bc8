"""The agent examples (`examples/agents/`): the ReAct agent's tools and text format without a model,
then both examples end to end on the embedded model (slow): the agent calls its tools and leaves a
complete trace, and the solver -> critic -> reviser pipeline runs its three stages on one backend."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("dspy")

ROOT = Path(__file__).resolve().parent.parent


def _example(name: str) -> ModuleType:
    """Import `examples/agents/<name>.py` as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(
        f"agents_{name}", ROOT / "examples" / "agents" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


react_tools = _example("react_tools")
solver_critic = _example("solver_critic")


def test_tools_compute_look_up_and_record_every_call() -> None:
    tools = react_tools.Tools()
    assert tools.calculator("2500000 + 8000000") == "10500000"
    assert tools.calculator("what is 6 x 7") == "42"
    assert tools.calculator("import os").startswith("cannot evaluate")
    assert "700000" in tools.lookup("Oslo") and "700000" in tools.lookup("Olso")  # fuzzy on names
    assert tools.lookup("xyzzy").startswith("No note")
    assert [c["tool"] for c in tools.calls] == ["calculator"] * 3 + ["lookup"] * 3


def test_text_adapter_round_trips_an_action_and_shares_the_prompt_prefix() -> None:
    import dspy

    agent = dspy.ReAct("question -> answer", tools=[react_tools.Tools().lookup], max_iters=2)
    adapter = react_tools.ReActTextAdapter(agent.tools)
    action_sig = agent.react.signature
    parsed = adapter.parse(action_sig, "Thought: I should look up Oslo.\nAction: lookup[Oslo]\nmore")
    assert parsed == {
        "next_thought": "I should look up Oslo.",
        "next_tool_name": "lookup",
        "next_tool_args": {"query": "Oslo"},
    }
    assert adapter.parse(action_sig, "Action: finish[]")["next_tool_args"] == {}
    assert adapter.parse(action_sig, "I will call LOOKUP[Lima] now")["next_tool_name"] == "lookup"
    with pytest.raises(Exception, match="Action"):
        adapter.parse(action_sig, "no action here")

    answer_sig = agent.extract.predict.signature.delete("reasoning")
    assert adapter.parse(answer_sig, "Answer: 700000")["answer"] == "700000"
    demos = [
        dspy.Example(
            question="q", trajectory="", next_thought="t", next_tool_name="finish", next_tool_args={}
        ),
        dspy.Example(question="q", trajectory="Thought: t", answer="1"),
    ]
    inputs = {"question": "How many?", "trajectory": "Thought: t\nAction: finish[]\nObservation: Completed."}
    action_msgs = adapter.format(action_sig, demos, inputs)
    answer_msgs = adapter.format(answer_sig, demos, inputs)
    assert action_msgs[:-1] == answer_msgs[:-1]  # one system text and one demo list for both steps
    assert answer_msgs[-1]["content"] == action_msgs[-1]["content"] + "\n" + react_tools.ANSWER_REQUEST


@pytest.fixture(scope="module")
def embedded_backend(embedded_dir: Path) -> Any:
    from branchwise.backends.hf import HFBackend

    return HFBackend(embedded_dir)


@pytest.mark.slow
def test_react_agent_calls_its_tools_and_leaves_a_complete_trace(embedded_backend: Any) -> None:
    out = react_tools.main(["--n", "3", "--max-iters", "2", "--max-tokens", "32"], backend=embedded_backend)
    trajectory = out["trajectory"]
    actions = [s for s in out["steps"] if s["step"] == "action"]
    assert 1 <= len(actions) <= 2
    for i in range(len(actions)):  # every step has its thought, action, arguments and observation
        assert all(f"{key}_{i}" in trajectory for key in ("thought", "tool_name", "tool_args", "observation"))
    assert f"thought_{len(actions)}" not in trajectory
    assert out["steps"][-1]["step"] == "answer" and len(out["steps"]) == len(actions) + 1
    assert out["tool_calls"], f"no tool was called: {trajectory}"
    tool_steps = [trajectory[f"tool_name_{i}"] for i in range(len(actions))]
    assert [c["tool"] for c in out["tool_calls"]] == [t for t in tool_steps if t in ("calculator", "lookup")]
    for call, i in zip(
        out["tool_calls"], [i for i, t in enumerate(tool_steps) if t != "finish"], strict=False
    ):
        assert trajectory[f"observation_{i}"] == call["observation"]
    for step in out["steps"]:
        assert sum(step["votes"].values()) >= 1 and step["tokens_computed"] > 0
    cost = out["cost"]
    assert cost["strategy_runs"] == len(out["steps"]) and cost["seconds"] > 0
    assert cost["cache_hit_tokens"] > 0  # later steps reuse the earlier prompts' KV


@pytest.mark.slow
def test_solver_critic_reviser_runs_three_strategies_on_one_backend(embedded_backend: Any) -> None:
    out = solver_critic.main(["--n", "2", "--max-tokens", "24"], backend=embedded_backend)
    stages = out["stages"]
    assert [s["stage"] for s in stages] == ["solver", "critic", "reviser"]
    assert [s["strategy"] for s in stages] == ["self_consistency", "best_of_n", "beam_search"]
    for s in stages:
        assert s["branches"] >= 1 and s["tokens_computed"] > 0 and s["seconds"] > 0
    assert all(s["cache_hit_tokens"] > 0 for s in stages[1:])  # the shared system text and question
    assert out["cost"]["tokens_computed"] == sum(s["tokens_computed"] for s in stages)
