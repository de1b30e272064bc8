"""Integrations with agent frameworks: branchwise as a model (and a whole strategy as one step) in
programs written for DSPy, LangChain and LangGraph.

* `branchwise.integrations.dspy`: `BranchwiseEngine` (DSPy 3.4+ engine contract, ``dspy.LM(...,
  engine=...)``), `BranchwiseLM` (the legacy `BaseLM.forward` contract, DSPy 3.3) and `Reason`;
* `branchwise.integrations.langchain`: `ChatBranchwise` (a langchain-core chat model) and
  `as_runnable(reasoner)` (a strategy as a `Runnable`), with the ``langchain`` extra.

Every integration submits whole prompts to one `Scheduler` per backend (`shared_scheduler`), so
calls from DSPy threads, LangChain's `batch` and asyncio tasks on the same backend are merged into
shared decode passes together, and a backend's prefix cache sees every prompt.
"""

from branchwise.integrations._shared import shared_scheduler

__all__ = ["shared_scheduler"]
