"""An unchanged DSPy program against `branchwise serve`, as a user points DSPy at any OpenAI-compatible
endpoint: ``dspy.LM("openai/<model>", api_base=<serve>/v1, max_tokens=256)``.

Why it is a test of its own: DSPy's ChatAdapter asks for ``[[ ## field ## ]]`` markers a small model
often misses, and for ``openai/<a served name>`` DSPy sends no ``response_format`` (its catalogue
does not know the model), so nothing but the prompt held the embedded model to the format and the
program stopped with `AdapterParseError`. The server now reads the fields DSPy asks for in its own
words and decodes the reply under their JSON Schema, closed within ``max_tokens``, written back in
the markers (`serve/field_format.py`): the program runs to the end, whatever the model writes."""

from __future__ import annotations

from pathlib import Path

import pytest

dspy = pytest.importorskip("dspy")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

QUESTIONS = [
    "What is 12 + 7?",
    "What is the capital of France?",
    "How many days are in a week?",
    "What colour is the sky on a clear day?",
    "What is 3 times 4?",
]


@pytest.mark.slow
@pytest.mark.parametrize("module", ["ChainOfThought", "Predict"])
def test_unchanged_programs_parse_over_serve(embedded_dir: Path, module: str) -> None:
    from branchwise.backends.hf import HFBackend
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    app = create_app(HFBackend(embedded_dir), model_name="smollm2")
    with serve_in_thread(app) as url:
        lm = dspy.LM("openai/smollm2", api_base=f"{url}/v1", api_key="unused", max_tokens=256, cache=False)
        program = getattr(dspy, module)("question -> answer")
        with dspy.context(lm=lm):
            for question in QUESTIONS[:RUNS]:
                prediction = program(question=question)
                assert isinstance(prediction.answer, str)
                if module == "ChainOfThought":
                    assert isinstance(prediction.reasoning, str)


RUNS = 1
"""Programs run per module in the suite (each takes minutes on CPU)."""
