"""The backend protocol: the small set of operations a strategy executor needs.

Why a protocol and not a base class: `reasoners` drives any backend through these few ops
(`prefill`, `fork`, `append`, `extend`, `score_next`, `release`, `kv_stats`), and a remote backend
(an OpenAI-compatible server) implements the same ops without inheriting torch code. Backends never
import `branchwise.strategies`: the executor translates plan nodes into these calls.

What only some backends can do is a small protocol of its own, checked with `isinstance`:
`SupportsSessions` (per-run settings and statistics), `SupportsPromptFork`, `SupportsNodeEmbedding`,
`SupportsBranchScores`, `SupportsVerifySkip`, `SupportsKVBudget`, `Accelerated`.

Nodes are opaque integer handles to states of a *branch tree*: `prefill` makes a root, `fork` makes
children that share everything their parent holds, `append`/`extend` grow a node's own tokens. A node
that has live children is frozen (its KV is shared), so growing it raises.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from branchwise.constraints import Constraint

if TYPE_CHECKING:
    from branchwise.backends.accel import Accel

NodeId = int
FinishReason = Literal["eos", "stop", "delimiter", "length", "confident", "cancelled", "grammar"]
"""Why a branch ended; "cancelled": an `extend` listener stopped it (its consumer went away);
"grammar": its constraint admitted no further token (the text so far is kept, its KV released as
any other row's)."""
OPENAI_FINISH: dict[str, str] = {
    "eos": "stop",
    "stop": "stop",
    "delimiter": "stop",
    "confident": "stop",
    "grammar": "stop",
    "length": "length",
}
"""Finish reasons in OpenAI's terms, for every front end that speaks them (the server, the DSPy and
LangChain plug-ins): a step delimiter or a confident stop ends the text as a stop would, and
"grammar" (the constraint allowed no more tokens) leaves the reply as complete as it can be."""
ShareMode = Literal["none", "exact"]
SHARE_MODES: tuple[ShareMode, ...] = ("none", "exact")
"""`"exact"`: children read their parent's KV; `"none"`: each recomputes its whole path (the
No-KV baseline)."""


def check_share(share: object, field: str = "share") -> ShareMode:
    """`share` as a `ShareMode`, or a ValueError naming `field` and the allowed values.

    The one check of a share mode, so every front end (the reasoner, the server's CLI, the
    integrations, the local backend) refuses a bad value with the same message."""
    for mode in SHARE_MODES:
        if share == mode:
            return mode
    allowed = ", ".join(repr(m) for m in SHARE_MODES)
    raise ValueError(f"{field}={share!r} is not one of {allowed}")


class ContextTooLong(ValueError):
    """A prompt (plus the tokens asked for) does not fit the model's context window.

    Raised before any KV is computed, so nothing is left behind; the message names both numbers."""


class Cancelled(RuntimeError):
    """The work was cancelled (its caller went away or its deadline passed) before it ended; the
    KV it held has been released."""


class KVBudgetExceeded(MemoryError):
    """The KV memory budget cannot hold even one row of the work asked for (after the prefix cache
    yielded and every other row was preempted); raise the budget or shorten the request."""


def check_context(prompt_tokens: int, max_tokens: int, context: int | None, what: str = "prompt") -> None:
    """Raise `ContextTooLong` unless `prompt_tokens + max_tokens` fits `context` (None: unknown)."""
    if context is None or prompt_tokens + max_tokens <= context:
        return
    if not max_tokens:
        raise ContextTooLong(f"{what} holds {prompt_tokens} tokens; the model's context holds {context}")
    raise ContextTooLong(
        f"{what} ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
        f"exceeds the model's context of {context} tokens"
    )


class DecodeParams(BaseModel):
    """How to decode one `extend` call; validated so bad values name the field and its range."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(256, ge=1, le=131072)
    min_tokens: int = Field(0, ge=0, le=131072, description="EOS is masked until this many tokens")
    stop: tuple[str, ...] = Field((), description="stop strings; the text is cut before them")
    step_delimiter: str | None = Field(
        None, description="end of one reasoning step; kept in the text, finish_reason='delimiter'"
    )
    seed: int | None = Field(None, ge=0, description="seed of the sampler for this call")
    constraint: Constraint | None = Field(
        None, description="what every row's output must look like (JSON Schema, regex, tool calls, ...)"
    )


@dataclass
class Generation:
    """What one branch produced in one `extend` call."""

    node: NodeId
    token_ids: list[int]
    text: str
    top1_probs: list[float]
    """Per generated token: the model's top-1 probability (temperature 1), CGEE's confidence signal."""
    logprobs: list[float]
    """Per generated token: log-probability of the chosen token (temperature 1)."""
    finish_reason: FinishReason
    notes: list[str] = field(default_factory=list)
    """What the call that decoded it says about its speed: decode steps that left the local
    backend's fast step, with their reasons (`step_notes`); every front passes them on."""

    @property
    def confidence(self) -> float:
        """Mean top-1 probability (RKSC Eq. 3); 0 for an empty generation."""
        return sum(self.top1_probs) / len(self.top1_probs) if self.top1_probs else 0.0


@dataclass(frozen=True)
class DecodeStep:
    """What one step of an `extend` produced, for its optional ``on_step`` listener.

    Rows are positions in the ``nodes`` given to `extend` (a `Scheduler` job's listener gets its
    own branch indices instead). ``tokens`` holds each row's tokens since the previous step: one per
    step on the local backend; a whole generation at once where the backend cannot do better (a
    remote server). ``finished`` holds the rows that ended now, with their final `Generation` (the
    same object `extend` returns; its text is cut by the stop rules). Every row that ends is
    reported once, after its last tokens, except rows the listener itself stopped.
    """

    tokens: dict[int, list[int]]
    finished: dict[int, Generation]


StepListener = Callable[[DecodeStep], Collection[int] | None]
"""`extend`'s ``on_step``: called on the decoding thread after each step, so it must return at once
(hand the step to another thread or an event loop; never wait on a network). It returns the rows
nobody wants any more, which the backend stops as soon as it can (finish reason "cancelled"), or
None. Without a listener a backend does no per-step work for one. A step may be empty (no tokens,
nothing finished): asked between the prefill chunks of a call where nothing decodes yet, so that
rows waiting to join can be stopped too."""

Admitted = NodeId | tuple[NodeId, DecodeParams]
"""A node `admit` hands in: alone (it decodes with the call's parameters) or with its own."""

Admit = Callable[[int], Sequence[Admitted]]
"""The optional ``admit`` argument of an `extend` that takes new rows while it decodes (continuous
batching; the local backend's does, `Scheduler` checks the signature): called on the decoding thread at
each step boundary with the number of rows still decoding; returns nodes to decode from the next
step on in the same call, or nothing. Admitted rows are numbered after the rows before them (in
`DecodeStep`s and in the list `extend` returns) and decode with the call's parameters, or with their
own where the node comes with them (``(node, params)``: a backend whose `extend` takes
``row_params`` decodes requests with different parameters side by side). Like a listener it must
return at once; it may make the nodes it returns (prefill and fork on this thread), and must not
hand in a node twice."""


@dataclass
class KVStats:
    """KV-cache accounting of a backend since its last `reset_stats()`.

    `bytes_held` counts the tensors actually allocated right now (shared storage once), `peak_bytes`
    the maximum of that over time. `tokens_computed` counts token positions pushed through the model;
    `tokens_reused` counts ancestor tokens that a branch read from shared KV instead of recomputing.
    The prefix cache across requests (local backend): `cache_hit_tokens` / `cache_miss_tokens` are
    prompt tokens a `prefill` found cached / had to compute, `cache_evictions` cached nodes freed to
    keep the byte budget, `cache_bytes` what the cache holds now (engine-wide; not in `bytes_held`).
    """

    bytes_held: int = 0
    peak_bytes: int = 0
    tokens_computed: int = 0
    tokens_reused: int = 0
    forward_calls: int = 0
    live_nodes: int = 0
    cache_hit_tokens: int = 0
    cache_miss_tokens: int = 0
    cache_evictions: int = 0
    cache_bytes: int = 0
    budget_bytes: int | None = None
    """The KV memory budget (engine-wide; None: unbounded)."""
    used_bytes: int = 0
    """Every byte of KV the engine holds now: live nodes, batch tails, shared blocks and the prefix
    cache (engine-wide; what the budget bounds)."""
    preemptions: int = 0
    """Rows that left a decode to stay within the budget, their KV recomputed or swapped back in
    when they rejoined (engine-wide; `extra["swapped_rows"]` counts the swapped ones of a run)."""
    extra: dict[str, float] = field(default_factory=dict)

    def bump(self, key: str, value: float = 1.0) -> None:
        """Add `value` to the counter `key` of `extra` (an acceleration's statistic)."""
        self.extra[key] = self.extra.get(key, 0.0) + value

    def reset(self) -> None:
        """Zero every counter in place (holders of this object keep counting into it)."""
        self.bytes_held = self.peak_bytes = self.tokens_computed = self.tokens_reused = 0
        self.forward_calls = self.live_nodes = 0
        self.cache_hit_tokens = self.cache_miss_tokens = self.cache_evictions = self.cache_bytes = 0
        self.used_bytes = self.preemptions = 0
        self.extra.clear()

    def as_dict(self) -> dict[str, float]:
        return {
            "bytes_held": self.bytes_held,
            "peak_bytes": self.peak_bytes,
            "tokens_computed": self.tokens_computed,
            "tokens_reused": self.tokens_reused,
            "forward_calls": self.forward_calls,
            "live_nodes": self.live_nodes,
            "cache_hit_tokens": self.cache_hit_tokens,
            "cache_miss_tokens": self.cache_miss_tokens,
            "cache_evictions": self.cache_evictions,
            "cache_bytes": self.cache_bytes,
            **({} if self.budget_bytes is None else {"budget_bytes": self.budget_bytes}),
            "used_bytes": self.used_bytes,
            "preemptions": self.preemptions,
            **self.extra,
        }


@runtime_checkable
class Backend(Protocol):
    """Operations over a branch tree of KV states. See the module docstring for the semantics."""

    name: str

    def encode(self, text: str) -> list[int]:
        """Tokenize plain text (no special tokens added)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Detokenize."""
        ...

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of a chat conversation with the generation prompt appended.

        Messages are OpenAI-shaped (assistant ``tool_calls`` and ``tool`` results allowed); `tools`
        (normalized OpenAI function tools) are shown to the model in its own template's tool format
        where it has one, else in the documented fallback prompt (`branchwise.toolcalls`).
        """
        ...

    def prefill(self, token_ids: Sequence[int]) -> NodeId:
        """Make a root node holding `token_ids` (computed lazily, on first use)."""
        ...

    def fork(self, node: NodeId, n: int, share: ShareMode | None = None) -> list[NodeId]:
        """Make `n` children of `node` that start where it ends; `node` becomes frozen.

        `share` picks how the children hold `node`'s KV ("exact": once, shared; "none": each its own
        copy); None keeps the backend's default. A backend without that choice ignores it.
        """
        ...

    def append(self, nodes: Sequence[NodeId], token_ids: Sequence[Sequence[int]]) -> None:
        """Add fixed tokens (a hint, a judge question) to each node; computed lazily."""
        ...

    def extend(
        self, nodes: Sequence[NodeId], params: DecodeParams, on_step: StepListener | None = None
    ) -> list[Generation]:
        """Decode every node in one batch until EOS, a stop string, the step delimiter or max_tokens.

        `on_step` (optional) sees each step's tokens and finished rows as they are produced (see
        `StepListener`); a caller that streams text reads them, a caller that does not passes none.
        """
        ...

    def score_next(
        self, nodes: Sequence[NodeId], suffix: Sequence[int], candidates: Sequence[int]
    ) -> list[list[float]]:
        """Probability of each candidate token right after `node + suffix`, for each node.

        The suffix is evaluated in a temporary child and released, so scoring never grows a node.
        """
        ...

    def release(self, nodes: Sequence[NodeId]) -> None:
        """Free the nodes (and any ancestor no longer needed); their KV tensors are dropped."""
        ...

    def tokens(self, node: NodeId) -> list[int]:
        """All tokens from the root to `node`."""
        ...

    def kv_stats(self) -> KVStats:
        """Current KV accounting."""
        ...

    def reset_stats(self) -> None:
        """Zero the counters and set the peak to what is held now."""
        ...


@runtime_checkable
class SupportsSessions(Protocol):
    """A backend that runs several callers with their own settings and statistics.

    `session(share=..., accel=...)` returns a view with every `Backend` operation bound to those
    settings and counting into its own `kv_stats()`; the backend itself stays unchanged, so
    concurrent runs neither see nor reset each other's settings or numbers.
    """

    def session(self, *, share: ShareMode | None = None, accel: Accel | None = None) -> Backend: ...


@runtime_checkable
class SupportsPromptFork(Protocol):
    """Children that each stand for a whole different prompt, sharing what they have in common."""

    def fork_prompts(
        self, node: NodeId, prompts: Sequence[Sequence[int]], share: ShareMode | None = None
    ) -> list[NodeId]: ...


@runtime_checkable
class SupportsNodeEmbedding(Protocol):
    """The model's own embedding of each node (e.g. for ETS's clustering without a text embedder)."""

    def embed_nodes(self, nodes: Sequence[NodeId], probe: Sequence[int]) -> Any:
        """Rows [len(nodes), hidden] (a float CPU tensor on the local backend)."""
        ...


@runtime_checkable
class SupportsBranchScores(Protocol):
    """A backend that uses verifier scores (e.g. to keep the KV of better branches longer)."""

    def set_scores(self, nodes: Sequence[NodeId], scores: Sequence[float]) -> None: ...


@runtime_checkable
class SupportsVerifySkip(Protocol):
    """A backend that can say a verify pass is not needed (CGEE level 1)."""

    def skip_verify(self, confidences: Sequence[float]) -> bool: ...


@runtime_checkable
class SupportsAdmission(Protocol):
    """A backend whose decode takes rows in while it runs (continuous batching): its `extend` also
    takes `admit` (called between steps; the nodes it returns join the batch) and `row_params`
    (each row's own decoding parameters, so requests that asked for different ones share a decode).

    Declared, not read from a signature: `admits_rows` is True on a backend that does this (a
    wrapper that forwards attributes but not these arguments says False), and a `Scheduler` batches
    continuously only over one that says so."""

    admits_rows: bool

    def extend(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: StepListener | None = None,
        admit: Admit | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]: ...


@runtime_checkable
class SupportsKVBudget(Protocol):
    """A backend whose KV memory has a budget that a scheduler admits requests within."""

    kv_budget: int | None
    kv_limit: int | None

    def kv_room(self) -> int | None:
        """Bytes of KV that new requests may still be promised now (None: unbounded)."""
        ...

    def kv_cost(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        """KV bytes admission prices ``n`` samples of a prompt, each decoding up to ``max_tokens``,
        at: their worst case, or what they start with where the backend preempts rows that outgrow
        its budget."""
        ...

    def kv_floor(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        """The least KV bytes under which such a request can finish at all (a request above the
        budget's share is refused at once)."""
        ...


@runtime_checkable
class Accelerated(Protocol):
    """A backend (or session) that applies an acceleration config."""

    accel: Accel
