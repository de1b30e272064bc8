"""langchain-tests' standard suites against `ChatBranchwise`: the unit suite and the integration suite,
tool calling and structured output included.

Where each part runs, and why:

* `TestChatBranchwiseUnit` (``ChatModelUnitTests``): an instant echo backend; these tests build
  models and bind tools and schemas, nothing is decoded that matters.
* `TestChatBranchwiseTiny` (``ChatModelIntegrationTests``): a random tiny Llama (fast). Everything
  that holds for any model runs here: invoke/stream/batch and their async twins, v3 events,
  conversations, usage, stop, tool-message histories, a forced call of a tool without arguments,
  few-shot tool examples. The grammar makes every forced call valid; what it cannot make is sense.
* `TestChatBranchwiseEmbedded` (``slow``): the embedded SmolLM2-135M for the tests whose assertions
  need a sensible answer — exact arguments (``magic_function(3)`` → ``{"input": 3}``), a string
  argument or a JSON string field (a random model never writes the closing quote, so its reply is cut
  by ``max_tokens``), Unicode copied from the prompt, a tool chosen under ``tool_choice="auto"``.
  Those tests are skipped in the tiny class with that reason and only they run here, with small
  ``max_tokens`` and one torch thread (on a shared 2-core machine the 135M model decodes several
  times faster on one thread than on two contended ones).

Two embedded tests are expected failures of the 135M model itself: `test_agent_loop` (it answers
in prose instead of choosing a call under ``tool_choice="auto"``) and `test_json_mode` (it does not
write the asked keys). The suite requires an override of a standard test to be marked ``xfail``;
ours are strict and name the one exception the model's failure raises, so a better model (an
unexpected pass) or a different failure (a crash) fails the run. Beside each, a test of ours checks
what the model does do, and what `ChatBranchwise` promises whatever the model: the JSON-object
grammar holds and a reply cut by ``max_tokens`` says ``finish_reason="length"``, a prose answer comes
back as text with no call. `test_unicode_tool_call_integration` passes as the suite wrote it: the
model used to loop in the free-text description until ``max_tokens``; the grammar fitted to the
budget now bounds that string, so the call closes (and a call that cannot fit is cut, dropped and
says so: `test_forced_call_below_its_shortest_length_is_cut_and_says_length`).

Tests that cannot apply are skipped through the suite's own flags: images, audio, PDF, Anthropic
inputs (text-only model), model override (a `ChatBranchwise` is bound to the model it loaded), VCR
timing (no HTTP to record).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_tests")

from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.integration_tests.chat_models import unicode_customer
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel, Field
from testkit import FakeBackend

from branchwise.backends.base import DecodeParams, Generation
from branchwise.integrations.langchain import ChatBranchwise

EMBEDDED_ONLY = {
    "test_tool_calling": "asserts the exact arguments {'input': 3} read from the question",
    "test_tool_calling_async": "asserts the exact arguments {'input': 3} read from the question",
    "test_bind_runnables_as_tools": "needs a non-empty string argument the model closes",
    "test_tool_choice": "forces a call that may pick get_weather, whose string argument must close",
    "test_unicode_tool_call_integration": "asserts Unicode copied from the prompt into an argument",
    "test_agent_loop": "asserts the model chooses a call under tool_choice='auto'",  # xfail
    "test_structured_output": "a Joke's string fields must close within max_tokens",
    "test_structured_output_async": "a Joke's string fields must close within max_tokens",
    "test_structured_output_pydantic_2_v1": "a Joke's string fields must close within max_tokens",
    "test_structured_output_optional_param": "a Joke's string fields must close within max_tokens",
    "test_json_mode": "asserts the JSON object's keys are exactly setup and punchline",  # xfail
    # ours, beside the xfails: what the model does there, and a call too long for its budget
    "test_json_mode_nests_setup_keys_until_max_tokens": "the 135M model's JSON-mode reply",
    "test_agent_loop_prose_answer_is_text_without_a_call": "the 135M model's prose answer",
    "test_forced_call_below_its_shortest_length_is_cut_and_says_length": "a forced call, cut",
}
"""Integration tests that need a sensible answer, with what they assert that a random model cannot."""


def _mark_async_tests(suite: type) -> None:
    """Mark the suite's async tests (only those) for pytest-asyncio, so no global ``asyncio_mode``
    is needed. The suite's own functions get the mark: a copy would count as an override, which
    the suite's ``test_no_overrides_DO_NOT_OVERRIDE`` forbids."""
    for name in dir(suite):
        fn = getattr(suite, name)
        marked = any(m.name == "asyncio" for m in getattr(fn, "pytestmark", []))
        if name.startswith("test_") and inspect.iscoroutinefunction(fn) and not marked:
            pytest.mark.asyncio(fn)


_mark_async_tests(ChatModelIntegrationTests)


# --------------------------------------------------------------------------------------------------
# unit suite: an instant backend
# --------------------------------------------------------------------------------------------------


class EchoBackend(FakeBackend):
    """A backend that answers instantly by echoing the last message (the unit suite builds many
    models and binds tools and schemas; it never judges a reply)."""

    model_name = "echo"

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return [ord(c) for c in messages[-1]["content"]][:32] or [32]

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        return [self.generation(n, self.decode(self.prompts[n][: params.max_tokens])) for n in nodes]


_ECHO = EchoBackend()


class _Flags:
    """Capabilities `ChatBranchwise` has and has not (shared by all three classes)."""

    @property
    def chat_model_class(self) -> type[ChatBranchwise]:
        return ChatBranchwise

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False  # text-only models

    @property
    def supports_image_tool_message(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False  # Anthropic-shaped tool definitions and images are not a claim of this model

    @property
    def supports_model_override(self) -> bool:
        return False  # a ChatBranchwise decodes with the model it loaded; `model` only names it


class TestChatBranchwiseUnit(_Flags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"backend": _ECHO, "model": "echo"}


# --------------------------------------------------------------------------------------------------
# integration suite: a tiny random model, and the embedded model where sense is needed
# --------------------------------------------------------------------------------------------------


class TestChatBranchwiseTiny(_Flags, ChatModelIntegrationTests):
    backend: Any = None

    @pytest.fixture(autouse=True)
    def _tiny(self, request: pytest.FixtureRequest, tiny_backend: Any) -> None:
        why = EMBEDDED_ONLY.get(request.node.originalname)
        if why is not None:
            pytest.skip(f"needs a sensible model ({why}): runs in TestChatBranchwiseEmbedded (slow)")
        type(self).backend = tiny_backend

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"backend": self.backend, "max_tokens": 128}


@pytest.fixture(scope="module")
def embedded_backend(embedded_dir: Any) -> Iterator[Any]:
    """The embedded model, decoding on one torch thread for this module's tests."""
    import torch

    from branchwise.backends.hf import HFBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield HFBackend(embedded_dir)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
class TestChatBranchwiseEmbedded(_Flags, ChatModelIntegrationTests):
    backend: Any = None

    @pytest.fixture(autouse=True)
    def _embedded(self, request: pytest.FixtureRequest) -> None:
        name = request.node.originalname
        if name not in EMBEDDED_ONLY and name != "test_no_overrides_DO_NOT_OVERRIDE":
            pytest.skip("runs on the tiny model in TestChatBranchwiseTiny")
        type(self).backend = request.getfixturevalue("embedded_backend")

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"backend": self.backend, "max_tokens": 64}

    # The three tests the 135M model fails on its own merits: strict, with the one exception each
    # failure raises (a better model passes them, which fails the run until the mark goes)
    @pytest.mark.xfail(
        reason="SmolLM2-135M does not write the asked keys: unconstrained it answers 'A JSON with "
        '"setup" and "punchline" keys.\', under the JSON-object grammar it nests {"setup": {"setup": ...}}',
        strict=True,
        raises=OutputParserException,
    )
    def test_json_mode(self, model: Any) -> None:
        super().test_json_mode(model)

    @pytest.mark.xfail(
        reason="SmolLM2-135M does not choose a call under tool_choice='auto': it answers the weather "
        "question in prose (a required call is tested in test_tool_calling and the LangGraph agent)",
        strict=True,
        raises=AssertionError,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model: Any) -> None:
        super().test_agent_loop(model)

    # What the model does in those two, and what ChatBranchwise promises whatever the model

    def test_json_mode_nests_setup_keys_until_max_tokens(self, model: Any) -> None:
        """Under the JSON-object grammar the 135M model opens ``{"setup": {"setup": ...`` and never
        writes a punchline: the reply is cut by ``max_tokens`` (and says so), holds no other key, and
        comes back as the parsing error, not as a Joke."""

        class Joke(BaseModel):  # the suite's own
            """Joke to tell user."""

            setup: str = Field(description="question to set up a joke")
            punchline: str = Field(description="answer to resolve the joke")

        chat = model.with_structured_output(Joke, method="json_mode", include_raw=True)
        out = chat.invoke(
            "Tell me a joke about cats. Return the result as a JSON with 'setup' and 'punchline' keys. "
            "Return nothing other than JSON."
        )
        raw = out["raw"]
        assert raw.response_metadata["finish_reason"] == "length"
        assert raw.content.startswith('{"setup":{"setup":')
        assert set(re.findall(r'"(\w+)"\s*:', raw.content)) == {"setup"}
        assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)

    def test_agent_loop_prose_answer_is_text_without_a_call(self, model: Any) -> None:
        """Under ``tool_choice="auto"`` the 135M model answers in prose: that comes back as the
        message's text, with no call and no half-parsed call markup."""

        @tool
        def get_weather(location: str) -> str:
            """Get the weather at a location."""
            return "It's sunny."

        reply = model.bind_tools([get_weather]).invoke("What is the weather in San Francisco, CA?")
        assert isinstance(reply, AIMessage)
        assert reply.tool_calls == [] and reply.invalid_tool_calls == []
        assert isinstance(reply.content, str) and reply.content.strip()
        assert "<tool_call>" not in reply.content

    def test_forced_call_below_its_shortest_length_is_cut_and_says_length(self, model: Any) -> None:
        """A forced call given fewer tokens than its shortest valid form cannot close: it is reported
        as cut (``finish_reason="length"``), no call is parsed from it, and none of its text reaches
        ``content``."""
        reply = model.bind_tools([unicode_customer], tool_choice="any").invoke(
            "Create a customer named '你好啊集团' (Hello Group) - a Chinese technology company", max_tokens=6
        )
        assert reply.response_metadata["finish_reason"] == "length"
        assert reply.tool_calls == []
        assert "<tool_call>" not in reply.content and "customer_name" not in reply.content
