"""`LenientChatAdapter`: DSPy's `ChatAdapter` made forgiving of replies that ignore its format.

Why its own module: it works with any DSPy LM, not only the plug-in's (a model behind `dspy.LM` that
misses the ``[[ ## field ## ]]`` markers gains from it too), and `Reason` uses it as its default
parser; it depends on neither LM, so it sits beside them rather than inside one. Users import it
from `branchwise.integrations.dspy`.
"""

from __future__ import annotations

from typing import Any

import dspy
from dspy.utils.exceptions import AdapterParseError

from branchwise.reasoners.answers import extract_answer

__all__ = ["LenientChatAdapter"]


def _free_text(completion: str) -> str:
    """The completion without ChatAdapter section headers."""
    import re

    return re.sub(r"\[\[ ## \w+ ## \]\]", "", completion).strip()


class LenientChatAdapter(dspy.ChatAdapter):
    """`dspy.ChatAdapter` that salvages replies which ignore its ``[[ ## field ## ]]`` format.

    Why: small local models (135M-1.5B) rarely reproduce the section markers, so the stock adapter
    raises `AdapterParseError`, retries through the JSON adapter (a second full generation) and fails
    again. This adapter keeps the fields it can parse and fills the missing ones from the free text:
    the last output field (the answer) from `extract_answer` (boxed / "the answer is" / last number)
    or else the last non-empty line, any other text field (e.g. ``reasoning``) from the whole reply.
    Non-text fields that cannot be parsed still raise. Programs stay unchanged; only
    ``dspy.configure(adapter=LenientChatAdapter())`` differs.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("use_json_adapter_fallback", False)
        super().__init__(**kwargs)

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        try:
            return super().parse(signature, completion)
        except AdapterParseError as err:
            from dspy.adapters.utils import parse_value

            fields = dict(err.parsed_result or {})
            text = _free_text(completion)
            names = list(signature.output_fields)
            for name in names:
                if name in fields:
                    continue
                info = signature.output_fields[name]
                if name == names[-1]:
                    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
                    raw = extract_answer(text) or (lines[-1] if lines else "")
                else:
                    raw = text
                try:
                    fields[name] = parse_value(raw, info.annotation)
                except (ValueError, TypeError):
                    raise err from None
            return fields
