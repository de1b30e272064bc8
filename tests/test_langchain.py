"""LangChain plug-in: `ChatBranchwise` behaves as a langchain-core chat model (invoke, batch, stream,
stop, n, usage and metadata), concurrent calls merge into shared decode passes, and `as_runnable`
makes a whole strategy one LCEL step.

Skipped when langchain-core is not installed (the ``langchain`` extra). langchain-tests' standard
suites run in `test_langchain_standard.py`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("langchain_core")

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate

from branchwise.integrations.langchain import ChatBranchwise, as_runnable

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
    assert "HFBackend()" in snippet and "self_consistency(n=8)" in snippet
    snippet = snippet.replace("HFBackend()", f"HFBackend({str(tiny_llama_dir)!r})")
    snippet = snippet.replace("self_consistency(n=8)", "self_consistency(n=2, max_tokens=8)")
    script = tmp_path / "langgraph_snippet.py"
    script.write_text(snippet)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip(), "the snippet printed nothing"
