"""`as_runnable(reasoner)`: a whole branchwise strategy as one LangChain `Runnable`, a step of an LCEL
chain or a LangGraph node.

Why its own module: it runs a `Reasoner` (a strategy with its branches and vote), not a chat model,
so it shares nothing with `ChatBranchwise` but reading a question out of LangChain's messages
(`content_text`); keeping it apart keeps the chat model's module about the chat model. Users import
it from `branchwise.integrations.langchain`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.runnables import Runnable, RunnableLambda

from branchwise.integrations.langchain_convert import content_text

if TYPE_CHECKING:
    from branchwise.reasoners.reasoner import Reasoner

__all__ = ["as_runnable"]


def _question(value: Any, input_key: str) -> str:
    """The question in what an LCEL step receives: a string, a dict (``input_key``), a prompt value,
    a message or a list of messages (the last human message)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        if input_key not in value:
            raise KeyError(f"the input dict has no {input_key!r} key (keys: {sorted(value)})")
        return _question(value[input_key], input_key)
    to_messages = getattr(value, "to_messages", None)  # ChatPromptValue / StringPromptValue
    if callable(to_messages):
        value = to_messages()
    if isinstance(value, BaseMessage):
        return content_text(value.content)
    if isinstance(value, Sequence):
        humans = [m for m in value if isinstance(m, HumanMessage)]
        if humans:
            return content_text(humans[-1].content)
    raise TypeError(f"cannot read a question from {type(value).__name__}")


def _output(result: Any) -> dict[str, Any]:
    chosen = next((b for b in result.branches if b.selected), result.branches[0] if result.branches else None)
    return {
        "answer": result.answer,
        "votes": dict(result.votes),
        "support": result.support,
        "text": chosen.text if chosen is not None else "",
        "strategy": result.strategy,
        "kv_stats": dict(result.kv_stats),
        "result": result,
    }


def as_runnable(
    reasoner: Reasoner, *, input_key: str = "question", name: str | None = None
) -> Runnable[Any, dict[str, Any]]:
    """A whole branchwise strategy as one LangChain `Runnable` (an LCEL step or a LangGraph node).

    Input: a question string, a dict holding it under `input_key`, a prompt value or messages (the
    last human message is the question). Output: a dict with ``answer``, ``votes``, ``support``,
    ``text`` (the chosen branch), ``strategy``, ``kv_stats`` and ``result`` (the full
    `ReasoningResult`). ``ainvoke`` awaits `Reasoner.arun` (the strategy in a worker thread), so
    concurrent async runs do not block the event loop.

    (This is the ``Reasoner.as_runnable()`` of the integration: a function here, so `Reasoner`
    itself does not depend on langchain-core.)
    """

    def run(value: Any) -> dict[str, Any]:
        return _output(reasoner.run(_question(value, input_key)))

    async def arun(value: Any) -> dict[str, Any]:
        return _output(await reasoner.arun(_question(value, input_key)))

    return RunnableLambda(run, afunc=arun, name=name or f"branchwise-{reasoner.strategy.name}")
