"""What a reasoning run returns: the answer, every branch, the executed tree, timings and KV stats.

Pydantic models so a result serialises to JSON as-is (eval rows, the CLI's `--json`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from branchwise.toolcalls import ToolCall


class Branch(BaseModel):
    """A leaf that reached aggregation: its whole text from the root and what it was judged."""

    node: int
    text: str
    answer: str | None
    n_tokens: int
    confidence: float = Field(description="mean top-1 probability over the branch's generated tokens")
    mean_logprob: float
    finish_reason: str
    scores: dict[str, float] = Field(default_factory=dict)
    selected: bool = Field(False, description="chosen by the aggregation (winner of the vote or best score)")


class TreeNode(BaseModel):
    """One node of the executed branch tree (root = the prompt)."""

    node: int
    parent: int | None
    depth: int
    text: str
    token_ids: list[int] = Field(default_factory=list)
    top1_probs: list[float] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    finish_reason: str | None = None
    scores: dict[str, float] = Field(default_factory=dict)
    pruned: bool = False


class SearchStep(BaseModel):
    """What one tree-search select did (methods beam, rebase, ets, dfs): the search's audit trail."""

    select: str = Field(description="id of the select node")
    method: str
    width: int | None = Field(None, description="remaining width this step (None for dfs)")
    active: int = Field(description="unfinished leaves considered")
    finished: int = Field(description="finished leaves set aside (each shrank the width by one)")
    kept: int = Field(description="unfinished leaves kept")
    pruned: int = Field(description="leaves pruned (their KV released)")
    children: int = Field(
        description="children allocated to the next generate (dfs: leaves to expand, each by the generate's n)"
    )
    clusters: int | None = Field(None, description="ets: semantic clusters of the leaves' last steps")
    embedder: str | None = Field(
        None,
        description='ets: the embedder that clustered the steps ("minilm", "hidden"; None: coverage off)',
    )
    solver_status: str | None = Field(
        None, description="ets: optimal, feasible, trivial, or why it fell back"
    )
    used_fallback: bool = Field(False, description="ets: the greedy heuristic chose the kept leaves")
    objective: float | None = None
    ilp_s: float = Field(0.0, description="ets: seconds in the ILP (build + solve + REBASE split)")
    cluster_s: float = Field(0.0, description="ets: seconds embedding and clustering the last steps")
    kv_bytes_before: int | None = Field(None, description="KV bytes held by the backend before this select")
    kv_bytes_after: int | None = Field(None, description="... and after it pruned and retired leaves")


class ReasoningResult(BaseModel):
    """The outcome of `Reasoner.run`."""

    question: str
    answer: str | None
    strategy: str
    share: str
    votes: dict[str, float] = Field(default_factory=dict, description="answer -> weight behind it")
    support: float = Field(0.0, description="share of the vote weight behind the answer")
    runner_up: str | None = Field(None, description="the answer with the next most weight behind it")
    value: Any = Field(
        None,
        description="typed output (a reasoner with response_format or tools): the winner's value, a "
        "validated pydantic object, a JSON value, or its list of tool calls",
    )
    tool_calls: list[ToolCall] = Field(
        default_factory=list, description="the winning branch's tool calls (a reasoner with tools)"
    )
    branches: list[Branch]
    tree: list[TreeNode]
    timings: dict[str, float] = Field(description="seconds per plan op kind, plus 'total'")
    kv_stats: dict[str, float]
    verify_calls: int = Field(0, description="score steps reached")
    verify_skipped: int = Field(0, description="score steps CGEE level 1 answered from confidence alone")
    notes: list[str] = Field(default_factory=list, description="what did not apply or fell back, in words")
    kv_metric_tokens: int = Field(
        0,
        description="ETS's KV metric: per generate step, the tokens of all new candidates plus their "
        "unique ancestors (the prompt included), summed over steps",
    )
    kv_per_step: list[int] = Field(default_factory=list, description="the KV metric's per-step terms")
    search_steps: list[SearchStep] = Field(default_factory=list, description="one entry per search select")


def kv_budget_notes(stats: dict[str, float]) -> list[str]:
    """What a result says of what the KV budget cost its run: steps run over it (the budget could
    not bound the run: never a silent overrun), ended branches' KV freed (a cost the caller may pay
    later, computing it again), and branches swapped out and back (their KV, an ended branch's
    too, and a request's prompt with its last one, moved to host memory or a file while the budget
    was short: time the run waited on that copy)."""
    notes = []
    if stats.get("kv_overruns"):
        notes.append(
            f"kv_budget: {stats['kv_overruns']:g} decode step(s) ran over the KV budget: what the run "
            "held (its live branches, and the one row a decode always goes on with) did not fit it"
        )
    if stats.get("freed_ended_kv_nodes"):
        notes.append(
            f"kv_budget: the KV of {stats['freed_ended_kv_nodes']:g} ended branch(es) or their prompts "
            "was freed to stay within the KV budget; their tokens are kept, and extending one "
            "computes its KV again"
        )
    moved = [
        f"{stats[key]:g} {what}"
        for key, what in (
            ("swapped_rows", "decoding branch(es)"),
            ("swapped_ended_rows", "ended branch(es)"),
            ("swapped_prompts", "prompt(s)"),
        )
        if stats.get(key)
    ]
    if moved:
        notes.append(
            f"kv_budget: {', '.join(moved)} were swapped out of the KV budget "
            f"({stats.get('swapped_bytes', 0.0) / 2**20:.1f} MiB to host memory or a file) and back when "
            "read again, their KV kept exact; the run waited on those copies"
        )
    return notes
