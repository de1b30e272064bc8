"""`RemoteBackend` against a real vLLM server (the ``vllm`` marker; CI's vLLM stage runs it).

Why a real server: the unit tests in test_remote.py drive `branchwise serve`, which is lenient
where vLLM is strict (vLLM refuses ``n`` > 1 under greedy sampling, reads constraints from its own
``structured_outputs`` field, counts prefix-cache hits in whole KV blocks). Only a real vLLM shows
that every strategy runs, reproducibly, and that a branch tree's requests hit the server's prefix
cache.

Set ``BRANCHWISE_VLLM_URL`` to the server's root (``http://127.0.0.1:8000``); a comma-separated
second URL, a second vLLM server of the same model, enables the two-endpoint tests (prefix
affinity against round-robin). Without the variable every test here is skipped, so the plain
``python -m pytest`` needs no vLLM. ``.ci/vllm_server.sh`` starts a server as CI does. Hit rates are
printed and, when ``BRANCHWISE_VLLM_REPORT`` names a file, appended to it as JSON lines.

The served model is expected to be the embedded SmolLM2-135M-Instruct (its tokenizer is read from
the local `embedded_model_dir()`, never from the hub); other models work except where a test says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")

from branchwise.backends.base import DecodeParams  # noqa: E402
from branchwise.backends.remote import RemoteBackend  # noqa: E402
from branchwise.reasoners import Reasoner  # noqa: E402
from branchwise.strategies import beam_search, best_of_n, ets, rebase, self_consistency  # noqa: E402

URLS = [u.strip() for u in os.environ.get("BRANCHWISE_VLLM_URL", "").split(",") if u.strip()]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not URLS,
        reason="needs a vLLM server: set BRANCHWISE_VLLM_URL=http://host:port[,http://host2:port2] "
        "(.ci/vllm_server.sh starts one; CI's vLLM stage does)",
    ),
]

QUESTION = "What is 12 + 7?"


@pytest.fixture(scope="module")
def url() -> str:
    return URLS[0]


@pytest.fixture(scope="module")
def two_urls() -> list[str]:
    """Two distinct vLLM servers (their prefix caches are separate, which affinity is about)."""
    distinct = list(dict.fromkeys(URLS))
    if len(distinct) < 2:
        pytest.skip("needs two vLLM servers: BRANCHWISE_VLLM_URL=http://a:port,http://b:port")
    return distinct[:2]


@pytest.fixture(scope="module")
def backend(url: str) -> Iterator[RemoteBackend]:
    remote = RemoteBackend(url, timeout_s=300)
    yield remote
    remote.close()


def _report(record: dict[str, Any]) -> None:
    """Print a measurement and append it to $BRANCHWISE_VLLM_REPORT (CI shows that file)."""
    line = json.dumps(record, sort_keys=True)
    print(line)
    path = os.environ.get("BRANCHWISE_VLLM_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _prefix_counters(urls: list[str]) -> list[tuple[float, float]]:
    """(queried tokens, hit tokens) of each server's prefix cache so far."""
    remote = RemoteBackend(urls)
    counters = remote.prefix_cache_counters()
    remote.close()
    assert all(c is not None for c in counters.values()), f"no prefix-cache counters in /metrics: {counters}"
    return [c for c in counters.values() if c is not None]


def _cache_delta(urls: list[str], before: list[tuple[float, float]]) -> tuple[float, float]:
    after = _prefix_counters(urls)
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return queries, hits


def _long_question(tag: str, i: int = 0) -> str:
    """A question with a few hundred tokens of context, unique per call (`tag`), so the shared
    prompt spans several of vLLM's KV blocks (128 tokens on CPU; only whole blocks are cached) and
    starts cold in the server's prefix cache."""
    facts = " ".join(
        f"Shelf {k} of store {tag} holds {3 * k + i} red boxes and {2 * k + 1} blue boxes." for k in range(24)
    )
    return f"Inventory note {tag}: {facts}\nQuestion: how many red boxes are on shelf {i + 2}?"


# --------------------------------------------------------------------------------------------------
# Every strategy runs on vLLM, and a seeded run repeats exactly
# --------------------------------------------------------------------------------------------------

STEP = {"depth": 3, "max_step_tokens": 12, "temperature": 0.7, "seed": 11}
STRATEGIES = {
    "self-consistency (sampled)": lambda: self_consistency(n=6, temperature=0.8, max_tokens=24, seed=5),
    "self-consistency (greedy)": lambda: self_consistency(n=4, temperature=0.0, max_tokens=16),
    "best-of-n (judge)": lambda: best_of_n(n=4, verifier="judge", temperature=0.8, max_tokens=20, seed=5),
    "beam-search": lambda: beam_search(width=4, **STEP),
    "rebase": lambda: rebase(width=4, **STEP),
    "ets": lambda: ets(width=4, **STEP),  # its sentence embedder runs here, locally
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_strategy_runs_and_repeats_exactly(backend: RemoteBackend, name: str) -> None:
    """vLLM on CPU in fp32 is reproducible: a seeded run (vLLM seeds sample i of a request with
    ``seed + i``) and a greedy one give the same branches twice."""
    first = Reasoner(STRATEGIES[name](), backend=backend).run(QUESTION)
    second = Reasoner(STRATEGIES[name](), backend=backend).run(QUESTION)
    assert first.branches and all(b.n_tokens > 0 for b in first.branches)
    assert [b.text for b in second.branches] == [b.text for b in first.branches]
    assert [b.n_tokens for b in second.branches] == [b.n_tokens for b in first.branches]
    assert second.answer == first.answer and second.votes == pytest.approx(first.votes)
    if name == "self-consistency (greedy)":  # one request with n=1 (vLLM refuses n>1), copied to 4
        assert len({b.text for b in first.branches}) == 1 and len(first.branches) == 4
    if name == "best-of-n (judge)":
        assert any(b.scores for b in first.branches)  # the judge read vLLM's top log-probabilities
    _report({"test": "strategy", "name": name, "answer": first.answer, "branches": len(first.branches)})


def test_greedy_tokens_equal_the_local_backends(url: str, backend: RemoteBackend) -> None:
    """vLLM in fp32 decodes greedily the tokens the local HFBackend decodes, with the same
    log-probabilities, so a greedy step search picks the same branches on either. (Kept small: the
    local model shares the CPU with the servers.)"""
    from branchwise.backends.hf import HFBackend
    from branchwise.backends.hf.embedded import embedded_model_dir

    if Path(backend.model_name).name != embedded_model_dir().name:
        pytest.skip(f"the server serves {backend.model_name}, not the embedded model")
    local = HFBackend(dtype="float32")
    prompt = local.chat_prompt([{"role": "user", "content": QUESTION}])
    params = DecodeParams(max_tokens=48, temperature=0.0)
    (on_vllm,) = backend.extend([backend.prefill(prompt)], params)
    (here,) = local.extend([local.prefill(prompt)], params)
    assert on_vllm.token_ids == here.token_ids and on_vllm.text == here.text
    assert on_vllm.finish_reason == here.finish_reason
    assert on_vllm.logprobs == pytest.approx(here.logprobs, abs=1e-3)
    search = beam_search(width=2, depth=2, max_step_tokens=8, temperature=0.0, verifier="confidence")
    remote_run = Reasoner(search, backend=backend).run(QUESTION)
    local_run = Reasoner(search, backend=local).run(QUESTION)
    assert [b.text for b in remote_run.branches] == [b.text for b in local_run.branches]
    assert remote_run.answer == local_run.answer


def test_server_and_local_tokenizers_agree(url: str) -> None:
    """vLLM's /tokenize (chat template rendered by the server) gives the local tokenizer's ids."""
    from transformers import AutoTokenizer

    from branchwise.backends.hf.embedded import embedded_model_dir

    server = RemoteBackend(url)
    if Path(server.model_name).name != embedded_model_dir().name:
        pytest.skip(f"the server serves {server.model_name}, not the embedded model")
    local = RemoteBackend(url, tokenizer=AutoTokenizer.from_pretrained(embedded_model_dir()))
    msgs = [{"role": "user", "content": QUESTION}]
    assert server.chat_prompt(msgs) == local.chat_prompt(msgs)
    assert server.encode(QUESTION) == local.encode(QUESTION)
    assert server.decode(server.encode(QUESTION)) == QUESTION


# --------------------------------------------------------------------------------------------------
# Typed answers and tool calls through vLLM's structured outputs
# --------------------------------------------------------------------------------------------------


def test_typed_answers_through_structured_outputs(backend: RemoteBackend) -> None:
    from pydantic import BaseModel

    class Sum(BaseModel):
        total: int

    result = Reasoner(
        self_consistency(n=3, max_tokens=24, temperature=0.8, seed=2), backend=backend, response_format=Sum
    ).run(QUESTION + " Reply in JSON.")
    assert isinstance(result.value, Sum)
    for branch in result.branches:  # every branch was forced into the schema
        Sum.model_validate_json(branch.text)


def test_tool_calls_through_structured_outputs(backend: RemoteBackend) -> None:
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    result = Reasoner(
        self_consistency(n=3, max_tokens=64, temperature=0.8, seed=2),
        backend=backend,
        tools=[add],
        tool_choice="required",
        parallel_tool_calls=False,
    ).run(QUESTION + " Use the add tool.")
    assert result.tool_calls and result.tool_calls[0].name == "add"
    assert set(result.tool_calls[0].arguments) == {"a", "b"}


# --------------------------------------------------------------------------------------------------
# vLLM's prefix cache: a tree's requests share its prompt
# --------------------------------------------------------------------------------------------------


def test_n_branches_on_a_shared_prompt_hit_the_prefix_cache(url: str, backend: RemoteBackend) -> None:
    """One self-consistency run of n branches on a long prompt: vLLM computes the prompt once and
    the other branches read it from the prefix cache (``vllm:prefix_cache_hits_total`` grows)."""
    before = _prefix_counters([url])
    result = Reasoner(self_consistency(n=8, temperature=0.8, max_tokens=16, seed=1), backend=backend).run(
        _long_question(uuid.uuid4().hex[:8])
    )
    queries, hits = _cache_delta([url], before)
    _report(
        {
            "test": "prefix_cache_self_consistency",
            "n": len(result.branches),
            "queried_tokens": queries,
            "hit_tokens": hits,
            "hit_rate": hits / queries if queries else 0.0,
        }
    )
    assert queries > 0 and hits > 0


def _step_search_hit_rate(urls: list[str], affinity: bool, tag: str) -> dict[str, Any]:
    remote = RemoteBackend(urls, affinity=affinity, timeout_s=300)
    strategy = beam_search(
        width=4, depth=2, max_step_tokens=8, temperature=0.7, seed=3, verifier="confidence"
    )
    before = _prefix_counters(urls)
    for i in range(3):
        Reasoner(strategy, backend=remote).run(_long_question(tag, i))
    queries, hits = _cache_delta(urls, before)
    remote.close()
    return {"affinity": affinity, "queried_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries}


def test_affinity_hits_the_prefix_cache_more_than_round_robin(two_urls: list[str]) -> None:
    """Three beam searches over two servers: with affinity each tree's requests meet its prompt in
    one server's cache; round-robin makes both servers compute every prompt. (Both runs use fresh
    prompts, so neither starts warm.)"""
    round_robin = _step_search_hit_rate(two_urls, False, uuid.uuid4().hex[:8])
    affinity = _step_search_hit_rate(two_urls, True, uuid.uuid4().hex[:8])
    _report({"test": "prefix_affinity", "round_robin": round_robin, "affinity": affinity})
    assert affinity["hit_rate"] > round_robin["hit_rate"]


# --------------------------------------------------------------------------------------------------
# The command line on vLLM: `run` and `eval` over two endpoints
# --------------------------------------------------------------------------------------------------


def _endpoint_args() -> list[str]:
    """Two --endpoint options: the two servers, or the one server twice."""
    pair = (URLS * 2)[:2]
    return [arg for u in pair for arg in ("--endpoint", u)]


def test_cli_run_on_vllm_with_a_dead_endpoint_beside_it(url: str) -> None:
    """`branchwise run --endpoint DEAD --endpoint VLLM`: the dead one is passed over."""
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    args = [
        "run",
        QUESTION,
        "--n",
        "4",
        "--max-tokens",
        "12",
        "--json",
        "--endpoint",
        dead,
        "--endpoint",
        url,
    ]
    done = subprocess.run(
        [sys.executable, "-m", "branchwise", *args], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(result["branches"]) == 4 and result["answer"] is not None


def test_eval_cli_over_two_endpoints_writes_every_row_once(tmp_path: Path, url: str) -> None:
    data = tmp_path / "arith.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(6))
    )
    suite = {
        "name": "vllm",
        "models": [RemoteBackend(url).model_name],
        "datasets": [{"kind": "jsonl", "path": str(data), "label": "arith"}],
        "strategies": [
            {"label": "sc3", "prebuilt": "self_consistency", "params": {"n": 3, "max_tokens": 12, "seed": 0}}
        ],
        "accelerations": [{"label": "exact", "reasoner": {"share": "exact"}}],
    }
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    out = tmp_path / "run"
    args = ["eval", str(path), "--out", str(out), "--no-progress", "--no-report", *_endpoint_args()]
    done = subprocess.run(
        [sys.executable, "-m", "branchwise", *args, "--endpoint-workers", "2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    keys = [(r["cell"], r["problem_id"]) for r in rows]
    assert len(rows) == 6 == len(set(keys)) and all(r["error"] is None for r in rows)


@pytest.fixture(scope="module")
def fronted(backend: RemoteBackend) -> Iterator[str]:
    """`branchwise serve` in front of the vLLM server (``serve --endpoint``), on loopback."""
    pytest.importorskip("fastapi")
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    with serve_in_thread(create_app(backend)) as front:
        yield front


def _sse(response: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def test_serve_streams_vllms_tokens_as_they_come(fronted: str, backend: RemoteBackend) -> None:
    """serve → RemoteBackend → vLLM: a streamed chat reply arrives in several chunks whose text
    joins to the unstreamed reply's (greedy), with the usage of its tokens."""
    body = {
        "model": backend.model_name,
        "messages": [{"role": "user", "content": "Count from one to ten in words."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    whole = httpx.post(f"{fronted}/v1/chat/completions", json=body, timeout=300).json()
    text = whole["choices"][0]["message"]["content"]
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{fronted}/v1/chat/completions", json=stream, timeout=300) as response:
        assert response.status_code == 200
        events = _sse(response)
    deltas = [c["delta"].get("content") or "" for e in events for c in e["choices"]]
    assert sum(1 for d in deltas if d) > 3, f"the reply came in {sum(1 for d in deltas if d)} piece(s)"
    assert "".join(deltas) == text
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_serve_streams_concurrent_requests_side_by_side_on_vllm(fronted: str, backend: RemoteBackend) -> None:
    """Concurrent streamed requests through serve (continuous batching: each joins while others
    stream) all end with every token they asked for. (No seeds: vLLM 0.32's CPU build fails a
    batch of seeded sampled requests, "CPU Generator does not use offset".)"""
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> tuple[int, str]:
        body = {
            "model": backend.model_name,
            "prompt": f"Tell a fact about the number {i}.",
            "max_tokens": 8 + 4 * i,
            "min_tokens": 8 + 4 * i,
            "temperature": 0.8,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{fronted}/v1/completions", json=body, timeout=300) as response:
            events = _sse(response)
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
        assert finishes == ["length", "length"], finishes
        return events[-1]["usage"]["completion_tokens"], "".join(
            c["text"] for e in events for c in e["choices"]
        )

    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(ask, range(4)))
    assert [used for used, _ in replies] == [2 * (8 + 4 * i) for i in range(4)]
    assert all(text.strip() for _, text in replies)


def test_linear_kernels_benchmark_times_vllms_own_matmul_beside_torchs() -> None:
    """`benchmarks/linear_kernels.py --vllm-python` runs its measurement inside vLLM's Python and
    times vLLM's oneDNN matmul beside the local backend's packed kernel, on the same weights."""
    python = os.environ.get("BRANCHWISE_VLLM_PYTHON")
    if not python:
        pytest.fail("set BRANCHWISE_VLLM_PYTHON to the Python of vLLM's virtualenv (CI's vLLM stage does)")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "linear_kernels.py", "--quick", "--threads", "1", "--vllm-python", python],
        cwd=root / "benchmarks",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["measured_in"] == python
    row = out["m1"]
    assert set(row) == {"packed", "packed_fused", "dense", "read", "vllm"}
    assert row["vllm"]["ms"] > 0 and row["vllm"]["vs_packed"] == round(
        row["packed"]["ms"] / row["vllm"]["ms"], 3
    )
