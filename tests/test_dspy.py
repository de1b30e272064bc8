"""DSPy plug-in: `BranchwiseLM` follows DSPy's BaseLM contract, batches concurrent calls exactly,
and `Reason` runs branchwise strategies as a DSPy module.

Fast tests use the tiny random models (their replies are gibberish, so programs run with
`LenientChatAdapter`, which fills fields from free text); the slow ones use the embedded SmolLM2.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

dspy = pytest.importorskip("dspy")

import testkit  # noqa: E402

from branchwise.backends.base import DecodeParams, Generation  # noqa: E402
from branchwise.integrations.dspy import BranchwiseLM, LenientChatAdapter, Reason  # noqa: E402
from branchwise.strategies import best_of_n, self_consistency  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:Implementing custom LMs:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Passing OpenAI-style message:DeprecationWarning"),
]

QUESTIONS = [
    "What is 12 + 7?",
    "If Tom has 5 apples and eats 2, how many are left?",
    "What is 6 times 7?",
    "How many days are in a week?",
    "What is 100 - 37?",
    "The train leaves at 10:30. When does it arrive?",
    "What is 0.5 + 0.25?",
    "Is 19 a prime number?",
    "What is 8 * 9?",
    "How many months are in a year?",
    "What is 1,000 + 2,500?",
    "Let's think step by step: 3 + 4 + 5?",
]


def _lm(backend: Any, **kwargs: Any) -> BranchwiseLM:
    kwargs.setdefault("cache", False)
    kwargs.setdefault("max_tokens", 16)
    return BranchwiseLM(backend=backend, **kwargs)


def _msgs(q: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": q}]


# --------------------------------------------------------------------------------------------------
# The BaseLM contract
# --------------------------------------------------------------------------------------------------


def test_forward_returns_openai_shape_with_n_choices(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend)
    resp = lm.forward(messages=_msgs("What is 12 + 7?"), n=3, temperature=0.8, seed=1, logprobs=True)
    assert len(resp.choices) == 3
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        assert isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")
        assert len(c.logprobs.content) >= 1 and "logprob" in c.logprobs.content[0]
    usage = resp.usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert resp["model"] == lm.model  # plain-dict access works too (DSPy reads either way)
    # through DSPy's public call: a list of n outputs (dicts, since logprobs were asked for)
    outs = lm("What is 12 + 7?", n=2, temperature=0.7)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)


def test_n_samples_share_one_prompt_prefill(tiny_backend: Any) -> None:
    """share='exact': the prompt is computed once and read by all n branches; 'none' recomputes."""
    tiny_backend.cache_bytes = 0  # no prefix cache across requests: earlier tests sent this prompt
    prompt_len = len(tiny_backend.chat_prompt(_msgs("What is 6 times 7?")))
    stats = {}
    for share in ("exact", "none"):
        lm = _lm(tiny_backend, share=share)
        tiny_backend.reset_stats()
        resp = lm.forward(
            messages=_msgs("What is 6 times 7?"), n=4, temperature=0.7, max_tokens=4, min_tokens=4
        )
        assert len(resp.choices) == 4
        stats[share] = tiny_backend.kv_stats()
    assert stats["exact"].tokens_reused == 4 * prompt_len
    assert stats["none"].tokens_reused == 0
    # the prompt is computed once vs. four times (plus the same decode tokens in both)
    assert stats["none"].tokens_computed - stats["exact"].tokens_computed == 3 * prompt_len


def test_cache_key_uses_rollout_id_and_drops_cache_kwargs(tiny_backend: Any, monkeypatch: Any) -> None:
    from dspy.clients.cache import Cache

    monkeypatch.setattr(
        dspy, "cache", Cache(enable_disk_cache=False, enable_memory_cache=True, disk_cache_dir=None)
    )
    lm = _lm(tiny_backend, cache=True)
    first = lm("What is 12 + 7?", temperature=0.9)
    served = lm.batch_stats.requests
    assert lm("What is 12 + 7?", temperature=0.9) == first  # memory cache hit: no decode
    assert lm.batch_stats.requests == served
    lm("What is 12 + 7?", temperature=0.9, rollout_id=1)  # a new rollout is a new request
    assert lm.batch_stats.requests == served + 1
    lm.copy(rollout_id=2)("What is 12 + 7?", temperature=0.9)
    assert lm.batch_stats.requests == served + 2
    lm("What is 12 + 7?", temperature=0.9, cache=False)  # per-call opt-out
    assert lm.batch_stats.requests == served + 3


def test_copy_and_deepcopy_share_the_model(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend, temperature=0.0)
    other = lm.copy(temperature=1.0, rollout_id=3)
    assert other.backend is lm.backend and other.batch_stats is lm.batch_stats
    assert other.kwargs["temperature"] == 1.0 and other.kwargs["rollout_id"] == 3
    assert lm.kwargs["temperature"] == 0.0 and "rollout_id" not in lm.kwargs
    assert other.history is not lm.history
    assert copy.deepcopy(lm).backend is lm.backend
    program = dspy.ChainOfThought("question -> answer")
    program.set_lm(lm)
    clone = program.deepcopy()
    assert clone.predict.lm.backend is lm.backend


def test_dump_and_load_state_round_trip(tiny_llama_dir: Path) -> None:
    lm = BranchwiseLM(
        str(tiny_llama_dir), share="none", temperature=0.3, max_tokens=9, cache=False, top_p=0.9
    )
    state = lm.dump_state()
    assert state["share"] == "none" and state["model"] == str(tiny_llama_dir)
    loaded = dspy.BaseLM.load_state(state, allow_custom_lm_class=True)
    assert isinstance(loaded, BranchwiseLM)
    assert loaded.share == "none" and loaded.cache is False
    assert loaded.kwargs == lm.kwargs
    greedy = {"temperature": 0.0}
    assert loaded("What is 12 + 7?", **greedy) == lm("What is 12 + 7?", **greedy)


def test_bad_requests_fail_in_the_caller(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend)
    with pytest.raises(ValueError, match="n=0"):
        lm.forward(prompt="hi", n=0)
    with pytest.raises(ValueError, match="temperature"):
        lm.forward(prompt="hi", temperature=99.0)
    with pytest.raises(ValueError, match="text content only"):
        lm.forward(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------


class FakeBackend(testkit.FakeBackend):
    """Records `extend` calls; each branch 'generates' its prompt length and a per-call counter."""

    def __init__(self, fail_on: int | None = None) -> None:
        super().__init__()
        self.fail_on = fail_on

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return [ord(c) % 50 for c in messages[-1]["content"]]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(str, ids))

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        with self.lock:
            self.extends.append(len(nodes))
            self.params.append(params)
            if self.fail_on is not None and len(self.extends) == self.fail_on:
                raise RuntimeError("boom")
        return [
            Generation(n, [len(self.prompts[n])], f"len={len(self.prompts[n])}", [0.9], [-0.1], "eos")
            for n in nodes
        ]


def test_concurrent_calls_are_batched_and_grouped_by_params() -> None:
    backend = FakeBackend()
    lm = BranchwiseLM(backend=backend, cache=False, batch_window_s=0.05)
    barrier = threading.Barrier(8)

    def call(i: int) -> str:
        barrier.wait()
        temp = 0.0 if i % 2 == 0 else 0.5
        return lm.forward(messages=_msgs("x" * (i + 1)), temperature=temp, n=2).choices[1].message.content

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(call, range(8)))
    assert texts == [f"len={i + 1}" for i in range(8)]  # every caller gets its own answer
    assert backend.live == set()  # every node released
    # 8 calls with two distinct decoding settings -> (at least) one extend per setting, not 8
    assert len(backend.extends) < 8
    temps = {p.temperature for p in backend.params}
    assert temps == {0.0, 0.5}
    assert all(rows % 2 == 0 for rows in backend.extends)
    assert lm.batch_stats.requests == 8 and lm.batch_stats.max_requests_per_call >= 2


def test_seeded_sampling_calls_are_not_co_batched() -> None:
    backend = FakeBackend()
    lm = BranchwiseLM(backend=backend, cache=False, batch_window_s=0.05)
    barrier = threading.Barrier(4)

    def call(i: int) -> None:
        barrier.wait()
        lm.forward(prompt="same", temperature=0.7, seed=5, n=3)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(call, range(4)))
    assert backend.extends == [3, 3, 3, 3]


def test_worker_errors_reach_every_caller_and_the_worker_survives() -> None:
    backend = FakeBackend(fail_on=1)
    lm = BranchwiseLM(backend=backend, cache=False)
    with pytest.raises(RuntimeError, match="boom"):
        lm.forward(prompt="a")
    assert backend.live == set()
    assert lm.forward(prompt="abc").choices[0].message.content == "len=3"


def test_threaded_calls_equal_serial_greedy(tiny_backend: Any) -> None:
    """Batched greedy decoding is token-exact: 12 threads give the serial texts, in fewer decodes."""
    lm = _lm(tiny_backend, max_tokens=24, temperature=0.0)
    serial = [lm.forward(messages=_msgs(q)).choices[0].message.content for q in QUESTIONS]
    assert lm.batch_stats.max_requests_per_call == 1
    lm.reset_batch_stats()
    barrier = threading.Barrier(len(QUESTIONS))

    def call(q: str) -> str:
        barrier.wait()
        return lm.forward(messages=_msgs(q)).choices[0].message.content

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        threaded = list(pool.map(call, QUESTIONS))
    assert threaded == serial
    stats = lm.batch_stats
    assert stats.requests == len(QUESTIONS)
    assert stats.extend_calls < len(QUESTIONS) and stats.max_requests_per_call > 1


def test_async_calls_batch_too(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend, temperature=0.0)
    serial = [lm.forward(messages=_msgs(q)).choices[0].message.content for q in QUESTIONS[:6]]
    lm.reset_batch_stats()

    async def main() -> list[str]:
        outs = await asyncio.gather(*(lm.acall(messages=_msgs(q)) for q in QUESTIONS[:6]))
        return [o[0] for o in outs]

    assert asyncio.run(main()) == serial
    assert lm.batch_stats.extend_calls < 6


# --------------------------------------------------------------------------------------------------
# Unchanged DSPy programs
# --------------------------------------------------------------------------------------------------


def _devset(n: int) -> list[Any]:
    return [dspy.Example(question=q, answer="19").with_inputs("question") for q in QUESTIONS[:n]]


def _metric(example: Any, pred: Any, trace: Any = None) -> float:
    return float(str(pred.answer).strip() == example.answer)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_chain_of_thought_and_evaluate_threaded_equals_serial(tiny_model_dir: Any, arch: str) -> None:
    from branchwise.backends.hf import HFBackend

    lm = _lm(HFBackend(tiny_model_dir(arch)), max_tokens=20, temperature=0.0)
    program = dspy.ChainOfThought("question -> answer")  # unchanged DSPy program
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = program(question="What is 12 + 7?")
        assert isinstance(pred.reasoning, str) and isinstance(pred.answer, str)
        devset = _devset(10)
        serial = dspy.Evaluate(devset=devset, metric=_metric, num_threads=1, display_progress=False)(program)
        lm.reset_batch_stats()
        threaded = dspy.Evaluate(devset=devset, metric=_metric, num_threads=16, display_progress=False)(
            program
        )
    assert [(p.reasoning, p.answer) for _, p, _ in threaded.results] == [
        (p.reasoning, p.answer) for _, p, _ in serial.results
    ]
    assert threaded.score == serial.score
    assert lm.batch_stats.max_requests_per_call > 1


def test_predict_with_n_uses_one_shared_prefill(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.Predict("question -> answer", n=4)(question="What is 12 + 7?")
    assert len(pred.completions) == 4
    assert lm.batch_stats.extend_calls == 1 and lm.batch_stats.rows == 4


def test_best_of_n_and_refine_run(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend)
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        best = dspy.BestOfN(
            dspy.Predict("question -> answer"), N=3, reward_fn=lambda args, pred: 0.0, threshold=1.0
        )
        assert isinstance(best(question="What is 12 + 7?").answer, str)
        # a passing first attempt: Refine's feedback step would feed the tiny model a 12k-token
        # prompt (its byte-level tokenizer), which is slow and adds nothing to what is tested here
        refine = dspy.Refine(
            dspy.Predict("question -> answer"), N=2, reward_fn=lambda args, pred: 1.0, threshold=1.0
        )
        assert isinstance(refine(question="What is 12 + 7?").answer, str)
    assert lm.batch_stats.requests == 4  # 3 BestOfN rollouts (distinct rollout_ids) + 1 Refine attempt


def test_lenient_adapter_keeps_what_parses_and_salvages_the_rest() -> None:
    sig = dspy.ensure_signature("question -> reasoning, answer")
    adapter = LenientChatAdapter()
    good = "[[ ## reasoning ## ]]\nadd\n\n[[ ## answer ## ]]\n19\n\n[[ ## completed ## ]]"
    assert adapter.parse(sig, good) == {"reasoning": "add", "answer": "19"}
    assert adapter.parse(sig, "12 + 7 = 19") == {"reasoning": "12 + 7 = 19", "answer": "19"}
    assert adapter.parse(sig, "[[ ## reasoning ## ]]\nso the answer is 8")["answer"] == "8"
    typed = dspy.ensure_signature("question -> answer: int")
    with pytest.raises(dspy.utils.exceptions.AdapterParseError):
        adapter.parse(typed, "no number here")


# --------------------------------------------------------------------------------------------------
# Reason: strategies as a DSPy module
# --------------------------------------------------------------------------------------------------


def test_reason_module_returns_prediction_with_completions_and_trace(tiny_backend: Any) -> None:
    lm = _lm(tiny_backend)
    reason = Reason("question -> answer", strategy=self_consistency(n=3, max_tokens=12, seed=0))
    with dspy.context(lm=lm):
        pred = reason(question="What is 12 + 7?")
    assert len(pred.completions) == 3
    assert set(pred.completions[0]) == {"reasoning", "answer"}
    result = pred.reasoning_result
    assert len(result.branches) == 3 and result.strategy == "self_consistency"
    if result.answer is not None:
        from branchwise.reasoners.answers import normalize_answer

        assert normalize_answer(pred.answer.splitlines()[0]) == result.answer
    assert sum(pred.votes.values()) <= 3


def test_reason_inside_a_larger_program_with_best_of_n(tiny_backend: Any) -> None:
    class Pipeline(dspy.Module):
        def __init__(self) -> None:
            super().__init__()
            self.solve = Reason(
                "question -> answer",
                strategy=best_of_n(n=2, verifier="confidence", max_tokens=10, seed=0),
                backend=tiny_backend,
            )
            self.explain = dspy.Predict("question, answer -> explanation")

        def forward(self, question: str) -> Any:
            answer = self.solve(question=question).answer
            return self.explain(question=question, answer=answer)

    lm = _lm(tiny_backend)
    program = Pipeline()
    assert program.deepcopy().solve._backend.obj is tiny_backend  # copies share the model
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        out = program(question="What is 12 + 7?")
    assert isinstance(out.explanation, str)


def test_reason_needs_a_branchwise_lm() -> None:
    with dspy.context(lm=None), pytest.raises(ValueError, match="BranchwiseLM"):
        Reason("question -> answer")(question="hi")


# --------------------------------------------------------------------------------------------------
# Embedded model (slow)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_chain_of_thought_evaluate_threaded_equals_serial(embedded_dir: Path) -> None:
    from branchwise.backends.hf import HFBackend

    lm = BranchwiseLM(backend=HFBackend(embedded_dir), cache=False, max_tokens=24, temperature=0.0)
    program = dspy.ChainOfThought("question -> answer")
    devset = [
        dspy.Example(question=q, answer=a).with_inputs("question")
        for q, a in [
            ("What is 12 + 7?", "19"),
            ("What is 6 times 7?", "42"),
            ("What is 100 - 37?", "63"),
            ("How many days are in a week?", "7"),
        ]
    ]
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        serial = dspy.Evaluate(devset=devset, metric=_metric, num_threads=1, display_progress=False)(program)
        lm.reset_batch_stats()
        threaded = dspy.Evaluate(devset=devset, metric=_metric, num_threads=4, display_progress=False)(
            program
        )
    assert [p.answer for _, p, _ in threaded.results] == [p.answer for _, p, _ in serial.results]
    assert [p.reasoning for _, p, _ in threaded.results] == [p.reasoning for _, p, _ in serial.results]
    assert lm.batch_stats.max_requests_per_call > 1


@pytest.mark.slow
def test_embedded_reason_self_consistency(embedded_dir: Path) -> None:
    from branchwise.backends.hf import HFBackend

    lm = BranchwiseLM(backend=HFBackend(embedded_dir), cache=False)
    with dspy.context(lm=lm):
        pred = Reason("question -> answer", strategy=self_consistency(n=4, max_tokens=40, seed=0))(
            question="What is 12 + 7?"
        )
    assert len(pred.completions) == 4
    assert pred.reasoning_result.kv_stats["tokens_reused"] > 0


# --------------------------------------------------------------------------------------------------
# The engine path (DSPy >= 3.4): dspy.LM(..., engine=BranchwiseEngine(...))
# --------------------------------------------------------------------------------------------------

_needs_engines = pytest.mark.skipif(
    not hasattr(dspy, "lm15"), reason="DSPy < 3.4 has no engine contract (BranchwiseLM covers it)"
)


def _elm(backend: Any, **kwargs: Any) -> Any:
    from branchwise.integrations.dspy import branchwise_lm

    kwargs.setdefault("cache", False)
    kwargs.setdefault("max_tokens", 16)
    return branchwise_lm(backend=backend, **kwargs)


def _sched(lm: Any) -> Any:
    return lm.engine.scheduler


def test_oldest_supported_dspy_version_is_declared_and_met() -> None:
    """The `dspy` extra's floor is 3.3 (BranchwiseLM); the engine needs 3.4 and says so on 3.3."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (spec,) = extras["dspy"]
    floor = re.search(r">=\s*([\d.]+)", spec)
    assert floor is not None and floor.group(1) == "3.3", spec
    assert "<3.5" not in spec  # the newest DSPy installs
    version = tuple(int(p) for p in dspy.__version__.split(".")[:2])
    assert version >= (3, 3)
    if version < (3, 4):
        from branchwise.integrations.dspy import BranchwiseEngine

        with pytest.raises(ImportError, match=r"DSPy >= 3\.4"):
            BranchwiseEngine(backend=FakeBackend())


def test_old_import_path_forwards_with_a_deprecation_warning() -> None:
    """`branchwise.reasoners.dspy` was the documented path: it still resolves, and says where to go."""
    import branchwise.integrations.dspy as moved

    with pytest.warns(DeprecationWarning, match=r"import Reason from branchwise\.integrations\.dspy"):
        from branchwise.reasoners.dspy import Reason as old_reason
    assert old_reason is moved.Reason
    with pytest.raises(ImportError):
        from branchwise.reasoners.dspy import NoSuchName  # noqa: F401


@_needs_engines
def test_engine_answers_canonical_requests_without_deprecation_warnings(tiny_backend: Any) -> None:
    import warnings

    from dspy.lm15 import Config, Message, Request

    lm = _elm(tiny_backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DeprecationWarning (or any other) on the engine path
        texts = lm("What is 12 + 7?")
        assert len(texts) == 1 and isinstance(texts[0], str)
        with dspy.context(lm=lm, adapter=LenientChatAdapter()):
            pred = dspy.Predict("question -> answer")(question="What is 12 + 7?")
        assert isinstance(pred.answer, str)
        req = Request(
            model=lm.model,
            system="Be brief.",
            messages=(Message.user("What is 12 + 7?"),),
            config=Config(max_tokens=8, temperature=0.0, stop=("\n\n",), logprobs=0),
        )
        resp = lm(request=req)
    assert resp.finish_reason in ("stop", "length")
    assert resp.usage.input_tokens > 0 and 1 <= resp.usage.output_tokens <= 8
    assert resp.logprobs is not None and len(resp.logprobs) == resp.usage.output_tokens
    assert resp.provider_data["branchwise"]["batch_requests"] >= 1


@_needs_engines
def test_engine_refuses_what_it_cannot_serve(tiny_backend: Any) -> None:
    from dspy.lm15 import ImagePart, Message, Request, TextPart

    lm = _elm(tiny_backend)
    bad = Request(model=lm.model, messages=(Message.user((TextPart("hi"), ImagePart(url="http://x/y.png"))),))
    with pytest.raises(Exception, match="text only"):
        lm(request=bad)


@_needs_engines
def test_engine_predict_n_threaded_equals_serial(tiny_backend: Any) -> None:
    """Predict(n=4): DSPy sends 4 one-sample requests; seeded, threads give the serial result."""
    lm = _elm(tiny_backend, seed=3)
    program = dspy.Predict("question -> answer", n=4)
    qs = QUESTIONS[:4]

    def run(q: str) -> list[str]:
        with dspy.context(lm=lm, adapter=LenientChatAdapter()):  # dspy.context is per thread
            return [c.answer for c in program(question=q).completions]

    serial = [run(q) for q in qs]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(run, qs))
    assert all(len(c) == 4 for c in serial)
    assert threaded == serial


@_needs_engines
def test_engine_candidates_reuse_the_prompt_through_the_prefix_cache(tiny_llama_dir: Path) -> None:
    from branchwise.backends.hf import HFBackend

    backend = HFBackend(tiny_llama_dir)
    lm = _elm(backend, temperature=0.7)
    backend.reset_stats()
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        pred = dspy.Predict("question -> answer", n=4)(question="What is 12 + 7?")
    assert len(pred.completions) == 4
    stats = backend.kv_stats()
    # candidate 1 computes the prompt; candidates 2..4 each match all of it but the last token
    assert stats.cache_hit_tokens > 0
    assert stats.cache_hit_tokens >= stats.cache_miss_tokens


@_needs_engines
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_chain_of_thought_evaluate_8_threads_equals_serial(tiny_model_dir: Any, arch: str) -> None:
    from branchwise.backends.hf import HFBackend

    lm = _elm(HFBackend(tiny_model_dir(arch)), max_tokens=20, temperature=0.0)
    program = dspy.ChainOfThought("question -> answer")  # unchanged DSPy program
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        devset = _devset(10)
        serial = dspy.Evaluate(devset=devset, metric=_metric, num_threads=1, display_progress=False)(program)
        stats = _sched(lm).stats
        before = (stats.extend_calls, stats.requests)
        threaded = dspy.Evaluate(devset=devset, metric=_metric, num_threads=8, display_progress=False)(
            program
        )
    assert [(p.reasoning, p.answer) for _, p, _ in threaded.results] == [
        (p.reasoning, p.answer) for _, p, _ in serial.results
    ]
    assert threaded.score == serial.score
    calls, requests = stats.extend_calls - before[0], stats.requests - before[1]
    assert requests == 10 and calls < requests  # threads merged into shared decode passes


@_needs_engines
def test_engine_async_gather_merges_and_equals_serial(tiny_backend: Any) -> None:
    lm = _elm(tiny_backend, temperature=0.0)
    serial = [lm(q)[0] for q in QUESTIONS[:6]]
    stats = _sched(lm).stats
    before = stats.extend_calls

    async def main() -> list[str]:
        outs = await asyncio.gather(*(lm.acall(q) for q in QUESTIONS[:6]))
        return [o[0] for o in outs]

    assert asyncio.run(main()) == serial
    assert stats.extend_calls - before < 6


class ScriptedBackend(FakeBackend):
    """Answers ChatAdapter prompts with well-formed replies: a ReAct that calls `add` then finishes."""

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = "\n".join(m["content"] for m in messages)
        with self.lock:
            self.next += 1
            self.texts = getattr(self, "texts", {})
            self.texts[self.next] = text
            return [self.next]

    def fork(self, node: int, n: int, share: str | None = None) -> list[int]:
        key = self.prompts[node][0]
        kids = [self.prefill([key]) for _ in range(n)]
        return kids

    def extend(self, nodes: Sequence[int], params: DecodeParams, on_step: Any = None) -> list[Generation]:
        with self.lock:
            self.extends.append(len(nodes))
            self.params.append(params)
        out = []
        for n in nodes:
            prompt = self.texts[self.prompts[n][0]]
            last = prompt.rsplit("[[ ## question ## ]]", 1)[-1]
            if "next_tool_name" in prompt and "observation_0" not in last:
                reply = (
                    "[[ ## next_thought ## ]]\nAdd them.\n\n[[ ## next_tool_name ## ]]\nadd\n\n"
                    '[[ ## next_tool_args ## ]]\n{"a": 12, "b": 7}\n\n[[ ## completed ## ]]'
                )
            elif "next_tool_name" in prompt:
                reply = (
                    "[[ ## next_thought ## ]]\nDone.\n\n[[ ## next_tool_name ## ]]\nfinish\n\n"
                    "[[ ## next_tool_args ## ]]\n{}\n\n[[ ## completed ## ]]"
                )
            else:
                obs = "19" if "19" in last else "?"
                reply = f"[[ ## reasoning ## ]]\nThe tool said {obs}.\n\n[[ ## answer ## ]]\n{obs}\n\n[[ ## completed ## ]]"
            out.append(Generation(n, [1, 2, 3], reply, [0.9] * 3, [-0.1] * 3, "eos"))
        return out


@_needs_engines
def test_engine_react_with_a_tool_threaded_equals_serial() -> None:
    calls: list[tuple[int, int]] = []

    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    lm = _elm(ScriptedBackend())
    react = dspy.ReAct("question -> answer", tools=[add], max_iters=3)

    def run(q: str) -> str:
        with dspy.context(lm=lm, adapter=dspy.ChatAdapter()):
            return react(question=q).answer

    serial = [run(q) for q in QUESTIONS[:4]]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(run, QUESTIONS[:4]))
    assert serial == ["19"] * 4 and threaded == serial
    assert calls == [(12, 7)] * 8


@_needs_engines
def test_reason_takes_an_explicit_backend_whatever_the_global_lm(tiny_backend: Any) -> None:
    from dspy.utils.dummies import DummyLM

    with dspy.context(lm=DummyLM([{"answer": "unused"}])):
        pred = Reason("question -> answer", self_consistency(n=2), backend=tiny_backend)(question="1 + 1?")
    assert len(pred.completions) >= 1 and "reasoning_result" in pred
    lm = _elm(tiny_backend)
    with dspy.context(lm=lm):  # a dspy.LM over BranchwiseEngine is a branchwise LM too
        pred = Reason("question -> answer", self_consistency(n=2))(question="1 + 1?")
    assert pred.reasoning_result.strategy is not None


@_needs_engines
def test_engine_state_round_trips_through_dspy_lm(tiny_llama_dir: Path) -> None:
    from branchwise.integrations.dspy import BranchwiseEngine

    engine = BranchwiseEngine(str(tiny_llama_dir), max_tokens=8)
    lm = dspy.LM(engine.model_name, engine=engine, async_engine=engine.async_engine(), cache=False)
    state = lm.dump_state()
    again = dspy.LM.load_state(state, allow_custom_lm_class=True)
    assert isinstance(again.engine, BranchwiseEngine) and again.engine.max_tokens == 8
    assert isinstance(again("hi")[0], str)


@pytest.mark.slow
@_needs_engines
def test_embedded_engine_chain_of_thought_evaluate_threaded_equals_serial(embedded_dir: Path) -> None:
    from branchwise.backends.hf import HFBackend

    lm = _elm(HFBackend(embedded_dir), max_tokens=24, temperature=0.0)
    program = dspy.ChainOfThought("question -> answer")
    devset = [
        dspy.Example(question=q, answer=a).with_inputs("question")
        for q, a in [("What is 12 + 7?", "19"), ("What is 6 times 7?", "42"), ("What is 100 - 37?", "63")]
    ]
    with dspy.context(lm=lm, adapter=LenientChatAdapter()):
        serial = dspy.Evaluate(devset=devset, metric=_metric, num_threads=1, display_progress=False)(program)
        before = _sched(lm).stats.max_requests_per_call
        threaded = dspy.Evaluate(devset=devset, metric=_metric, num_threads=8, display_progress=False)(
            program
        )
    assert [(p.reasoning, p.answer) for _, p, _ in threaded.results] == [
        (p.reasoning, p.answer) for _, p, _ in serial.results
    ]
    assert before == 1 and _sched(lm).stats.max_requests_per_call > 1


def test_reason_with_a_custom_adapter_votes_on_its_parse_and_sends_demos_as_turns(tiny_backend: Any) -> None:
    class Plain(dspy.ChatAdapter):
        def format(self, signature: Any, demos: list[Any], inputs: dict[str, Any]) -> list[dict[str, Any]]:
            msgs = [{"role": "system", "content": "Answer briefly."}]
            for d in demos:
                msgs += [
                    {"role": "user", "content": d["question"]},
                    {"role": "assistant", "content": f"Answer: {d['answer']}"},
                ]
            return [*msgs, {"role": "user", "content": inputs["question"]}]

        def parse(self, signature: Any, completion: str) -> dict[str, Any]:
            return {"answer": "forty-two"}

    reason = Reason(
        "question -> answer",
        self_consistency(n=3, max_tokens=4, seed=0),
        chain_of_thought=False,
        backend=tiny_backend,
        adapter=Plain(),
    )
    reason.demos = [dspy.Example(question="2 + 2?", answer="4")]
    pred = reason(question="1 + 1?")
    assert pred.answer == "forty-two" and pred.support == 1.0 and len(pred.votes) == 1
    prompt = tiny_backend.decode(pred.reasoning_result.tree[0].token_ids)
    demo_q, demo_a, asked = prompt.find("2 + 2?"), prompt.find("Answer: 4"), prompt.find("1 + 1?")
    assert 0 <= demo_q < demo_a < asked, (
        prompt
    )  # the demo as a user turn and an assistant turn, then the question
