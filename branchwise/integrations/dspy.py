"""DSPy plug-in: run unchanged DSPy programs on a local branchwise backend, and branchwise
strategies as DSPy modules.

Why this exists: DSPy's own answer for local models is "start an inference server" (SGLang, vLLM,
Ollama) and point `dspy.LM` at it; plain HF transformers behind a `BaseLM` serialises every thread of
`dspy.Evaluate` and recomputes the prompt for each of the `n` samples. The plug-in instead keeps the
model in-process and does what a server would do: the ``n`` samples of a prompt share its KV, and
concurrent calls from DSPy threads and asyncio tasks are batched into shared decode passes.

`Reason` goes the other way: it wraps any branchwise strategy (self-consistency, best-of-n, ...) as a
`dspy.Module` with a signature, so a strategy can sit inside a larger DSPy program.

Two ways to plug the model into DSPy:

* **`BranchwiseEngine`** (DSPy >= 3.4, the contract DSPy 3.5 keeps): ``dspy.LM("branchwise/<name>",
  engine=engine, async_engine=engine.async_engine())`` or simply `branchwise_lm(...)`. DSPy owns the
  cache, retries, history and the ``n`` fan-out (it sends the ``n`` candidates as ``n`` one-sample
  requests); the engine answers one canonical `dspy.lm15.Request` with one `dspy.lm15.Response`.
  Requests go whole (the full prompt) through the backend's shared `Scheduler`, so concurrent
  threads and ``asyncio.gather`` merge into shared decode passes, and a backend that keeps a prefix
  cache reuses the prompt for candidates 2..n.
* **`BranchwiseLM`** (DSPy 3.3 and 3.4; the legacy `BaseLM.forward` contract), which does the ``n``
  samples itself as one prefill forked ``n`` times.

This module is the plug-in's one documented import path; each part lives in a module of its own,
so that the legacy LM can go when DSPy 3.5 drops its contract without touching the rest:

* `dspy_engine.py`: `BranchwiseEngine`, `AsyncBranchwiseEngine`, `branchwise_lm`, and `structured`
  (tools and response formats as the decode constraint, shared by both LMs);
* `dspy_lm.py`: `BranchwiseLM` (its contract, batching and seeded sampling are described there);
* `dspy_adapter.py`: `LenientChatAdapter`, which salvages small models' replies for any DSPy LM;
* `dspy_reason.py`: `Reason`.
"""

from __future__ import annotations

from branchwise.backends.scheduler import BatchStats
from branchwise.integrations.dspy_adapter import LenientChatAdapter
from branchwise.integrations.dspy_engine import AsyncBranchwiseEngine, BranchwiseEngine, branchwise_lm
from branchwise.integrations.dspy_lm import BranchwiseLM
from branchwise.integrations.dspy_reason import Reason

__all__ = [
    "AsyncBranchwiseEngine",
    "BatchStats",
    "BranchwiseEngine",
    "BranchwiseLM",
    "LenientChatAdapter",
    "Reason",
    "branchwise_lm",
]
