"""`Reason`: a branchwise strategy (self-consistency, best-of-n, ...) as a `dspy.Module` with a
signature, so a strategy can sit inside a larger DSPy program.

Why its own module: it runs the other way round from the LMs. They serve DSPy's requests one
generation at a time; `Reason` takes over a whole DSPy step and runs a branchwise `Reasoner` on the
backend (one shared prompt prefill, many branches, a vote), using DSPy only to format the prompt and
parse each branch. It needs from the LMs nothing but their backend (`BranchwiseLM`, `dspy_lm.py`,
or a `dspy.LM` over `BranchwiseEngine`, `dspy_engine.py`), so it depends on them and never the
reverse. Users import it from `branchwise.integrations.dspy`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import dspy
from dspy.utils.exceptions import AdapterParseError

from branchwise.backends.base import Backend, ShareMode
from branchwise.integrations.dspy_adapter import LenientChatAdapter
from branchwise.integrations.dspy_engine import BranchwiseEngine
from branchwise.integrations.dspy_lm import BranchwiseLM
from branchwise.reasoners.answers import extract_answer, normalize_answer, register_extractor

if TYPE_CHECKING:
    from branchwise.reasoners.result import ReasoningResult
    from branchwise.strategies import Strategy

__all__ = ["Reason"]


def _engine_backend(lm: Any) -> tuple[Backend, ShareMode] | None:
    """The backend and share mode of a `BranchwiseLM` or of a `dspy.LM` over a `BranchwiseEngine`."""
    if isinstance(lm, BranchwiseLM):
        return lm.backend, lm.share
    engine = getattr(lm, "_engine_spec", None)
    if isinstance(engine, BranchwiseEngine):
        return engine.backend, engine.share
    return None


class _Shared:
    """Holds an object that `copy.deepcopy` must not clone (a loaded backend)."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


def _section(text: str, field_name: str) -> str | None:
    """Content of the ``[[ ## field_name ## ]]`` section of a ChatAdapter-formatted reply."""
    import re

    m = re.search(rf"\[\[ ## {re.escape(field_name)} ## \]\]", text)
    if not m:
        return None
    rest = text[m.end() :]
    nxt = re.search(r"\[\[ ## \w+ ## \]\]", rest)
    return (rest[: nxt.start()] if nxt else rest).strip()


def _answer_key(value: str) -> str | None:
    """What the vote compares for a parsed answer field: its first non-empty line, normalised."""
    lines = [ln for ln in str(value).splitlines() if ln.strip()]
    return normalize_answer(lines[0]) if lines else None


def _field_extractor_name(field_name: str) -> str:
    """Register (idempotently) and name an extractor that votes on one output field's value."""
    name = f"dspy_field:{field_name}"

    def extract(text: str) -> str | None:
        value = _section(text, field_name)
        return (_answer_key(value) if value else None) or extract_answer(text)

    register_extractor(name, extract, replace=True)
    return name


def _adapter_extractor_name(adapter: Any, signature: Any, field_name: str, owner: object) -> str:
    """Register and name an extractor that votes on one output field as `adapter` parses it (for a
    custom adapter, whose replies need not carry ChatAdapter's section markers)."""
    name = f"dspy_adapter_field:{field_name}:{id(owner):x}"

    def extract(text: str) -> str | None:
        try:
            value = adapter.parse(signature, text).get(field_name)
        except (AdapterParseError, ValueError):
            return None
        return None if value is None else _answer_key(str(value))

    register_extractor(name, extract, replace=True)
    return name


class Reason(dspy.Module):
    """Run a branchwise strategy for a DSPy signature and return a `dspy.Prediction`.

    The signature is formatted into chat messages by DSPy's `ChatAdapter` (so instructions, field
    descriptions and few-shot demos read as they would for `dspy.Predict`); the strategy runs on the
    backend (one shared prompt prefill, B branches); every branch's reply is parsed into the output
    fields (with `LenientChatAdapter`'s salvage for small models); the answer field is set from the
    strategy's vote (its aggregate node votes on the parsed answer field, not on the last number in
    the text). The prediction carries ``completions`` (one per surviving branch), ``votes``,
    ``support`` and ``reasoning_result`` (the full `ReasoningResult`: tree, timings, KV stats).

    Args:
        signature: a DSPy signature or its string form ("question -> answer").
        strategy: any branchwise `Strategy`; default self-consistency with 5 samples.
        chain_of_thought: prepend a ``reasoning`` output field, as `dspy.ChainOfThought` does.
        lm: a branchwise LM (`branchwise_lm(...)` or `BranchwiseLM`) whose backend to use; default:
            ``dspy.settings.lm`` at call time.
        backend: a backend to use directly: then the global LM may be anything (or none).
        share: KV sharing mode of the strategy's branches; default: the LM's.
        answer_field: the output field set from the vote; default: the last output field.
        adapter: the DSPy adapter that formats the prompt and parses every branch (and so decides
            what the vote compares); default: `LenientChatAdapter`. Few-shot demos (``demos``) are
            sent as real user/assistant turns, as `dspy.Predict` sends them.
        tools: choose an action instead of writing the output fields: `dspy.Tool`s (or OpenAI
            function tools, Python functions) shown to the model; every branch writes tool calls
            under the grammar (``tool_choice``: required by default, or auto / a tool's name), the
            branches vote on the canonical call, and the answer field holds the winner as
            `dspy.ToolCalls` (self-consistency over actions, in one shared-prefix batch).
    """

    def __init__(
        self,
        signature: Any,
        strategy: Strategy | None = None,
        *,
        chain_of_thought: bool = True,
        lm: Any = None,
        backend: Backend | None = None,
        share: ShareMode | None = None,
        answer_field: str | None = None,
        adapter: dspy.Adapter | None = None,
        tools: Sequence[Any] | None = None,
        tool_choice: Any = "required",
    ) -> None:
        super().__init__()
        from branchwise.strategies import self_consistency

        sig = dspy.ensure_signature(signature)
        if chain_of_thought and "reasoning" not in sig.output_fields:
            sig = sig.prepend(name="reasoning", field=dspy.OutputField(desc="${reasoning}"), type_=str)
        self.signature = sig
        self.answer_field = answer_field or list(sig.output_fields)[-1]
        if self.answer_field not in sig.output_fields:
            raise ValueError(f"answer_field={self.answer_field!r} is not an output field of {sig.signature}")
        self.strategy = strategy if strategy is not None else self_consistency(n=5)
        self.demos: list[Any] = []
        self._lm = lm
        self._backend = _Shared(backend) if backend is not None else None
        self.share = share
        self.adapter = adapter
        self.tools = [
            t.format_as_litellm_function_call() if isinstance(t, dspy.Tool) else t for t in tools or []
        ]
        self.tool_choice = tool_choice

    def _resolve(self) -> tuple[Backend, ShareMode]:
        if self._backend is not None:
            return self._backend.obj, self.share or "exact"
        lm = self._lm or dspy.settings.lm
        found = _engine_backend(lm)
        if found is None:
            raise ValueError(
                "Reason needs a backend: Reason(signature, strategy, backend=...) (any global LM), or a "
                "branchwise LM as lm=... or dspy.settings.lm (branchwise_lm(...) / BranchwiseLM(...)); "
                f"got {type(lm).__name__ if lm is not None else None}"
            )
        backend, share = found
        return backend, self.share or share

    def _adapted_strategy(self) -> Strategy:
        """The strategy with the vote on the answer field and ChatAdapter's end marker as a stop."""
        from branchwise.strategies import AggregateNode, GenerateNode, Strategy

        if self.adapter is None:
            extractor = _field_extractor_name(self.answer_field)
        else:
            extractor = _adapter_extractor_name(self.adapter, self.signature, self.answer_field, self)
        nodes = []
        for node in self.strategy.nodes:
            if isinstance(node, AggregateNode) and node.extractor == "auto":
                node = node.model_copy(update={"extractor": extractor})
            elif isinstance(node, GenerateNode) and node.until == "answer":
                node = node.model_copy(update={"stop": [*node.stop, "[[ ## completed ## ]]"]})
            nodes.append(node)
        return Strategy(
            name=self.strategy.name,
            description=self.strategy.description,
            nodes=nodes,
            edges=list(self.strategy.edges),
        )

    def forward(self, **inputs: Any) -> dspy.Prediction:
        from branchwise.reasoners.reasoner import Reasoner

        backend, share = self._resolve()
        adapter = self.adapter if self.adapter is not None else LenientChatAdapter()
        messages = adapter.format(self.signature, self.demos, inputs)
        system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
        turns = [{"role": m["role"], "content": str(m["content"])} for m in messages if m["role"] != "system"]
        # the last turn is the question; earlier ones (few-shot demos) go as real chat turns
        if self.tools:  # an action: every branch writes calls under the grammar; the vote picks one
            reasoner = Reasoner(
                self.strategy,
                backend=backend,
                share=share,
                system_prompt=system,
                history=turns[:-1],
                tools=self.tools,
                tool_choice=self.tool_choice,
            )
            result = reasoner.run(turns[-1]["content"])
            calls = dspy.ToolCalls.from_dict_list(
                [{"name": c.name, "args": c.arguments} for c in result.tool_calls]
            )
            pred = dspy.Prediction(**{self.answer_field: calls})
            pred.votes, pred.support, pred.reasoning_result = dict(result.votes), result.support, result
            return pred
        reasoner = Reasoner(
            self._adapted_strategy(), backend=backend, share=share, system_prompt=system, history=turns[:-1]
        )
        result = reasoner.run(turns[-1]["content"])
        return self._prediction(adapter, result)

    def _prediction(self, adapter: dspy.Adapter, result: ReasoningResult) -> dspy.Prediction:
        completions, winners = [], []
        for branch in result.branches:
            try:
                parsed = adapter.parse(self.signature, branch.text)
            except (AdapterParseError, ValueError):
                parsed = {name: None for name in self.signature.output_fields}
            completions.append(parsed)
            value = parsed.get(self.answer_field)
            if result.answer is not None and value is not None and _answer_key(str(value)) == result.answer:
                winners.append(len(completions) - 1)
        if not completions:
            completions = [{name: None for name in self.signature.output_fields}]
        best = winners[0] if winners else next((i for i, b in enumerate(result.branches) if b.selected), 0)
        # the chosen completion first, so `pred.<field>` reads the voted branch
        ordered = [completions[best]] + [c for i, c in enumerate(completions) if i != best]
        pred = dspy.Prediction.from_completions(ordered, signature=self.signature)
        if result.answer is not None and not winners:
            pred[self.answer_field] = result.answer
        pred.votes = dict(result.votes)
        pred.support = result.support
        pred.reasoning_result = result
        return pred
