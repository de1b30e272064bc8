"""Node models: the vocabulary a strategy graph is written in.

Each node is a small, frozen pydantic model that only *describes* an operation; executing it is
the reasoner's job. Keeping them declarative (and free of torch/transformers imports) means a
strategy can be written in YAML, validated, diffed and shipped without loading a model.

Every numeric parameter carries a pydantic ``Field(ge=..., le=...)`` constraint rather than a
hand-written check, so a bad value fails with a ``ValidationError`` whose ``loc`` names the field
(``nodes.0.generate.n``) and whose message names the violated bound. Nodes are frozen because a
``Strategy`` validates its graph once, at construction; mutating a node afterwards would silently
bypass that validation (use ``node.model_copy(update=...)`` and rebuild the strategy instead).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from branchwise.constraints import Constraint

__all__ = [
    "ALLOCATING_METHODS",
    "MAX_SEED",
    "NODE_ID_PATTERN",
    "AggregateNode",
    "GenerateNode",
    "LoopNode",
    "Node",
    "NodeId",
    "ScoreNode",
    "SelectMethod",
    "SelectNode",
    "SpecModel",
]

#: Ids double as YAML keys, log labels and file-name fragments, so they are kept identifier-like.
NODE_ID_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*$"

NodeId = Annotated[str, Field(min_length=1, pattern=NODE_ID_PATTERN)]

#: Largest seed a sampler accepts (torch generators take an unsigned 64-bit seed).
MAX_SEED = 2**64 - 1


def _encodable(value: object) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"text must be valid UTF-8; character {value[err.start]!r} at index {err.start} "
                "(a lone surrogate) cannot be written to JSON or YAML"
            ) from None
    elif isinstance(value, (list, tuple)):
        for item in value:
            _encodable(item)


class SpecModel(BaseModel):
    """Base of every model a strategy file is made of.

    Unknown keys are typos, not extensions, so they are rejected; models are frozen because a
    strategy is validated once, at construction. Every string must be encodable as UTF-8: a lone
    surrogate (``"\\ud800"`` in JSON or YAML) parses, but would make ``to_json()`` fail later,
    far from the file that carried it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="after")
    @classmethod
    def _utf8_only(cls, value: object) -> object:
        _encodable(value)
        return value


class _NodeBase(SpecModel):
    """Each node subclass declares ``kind`` then ``id`` itself (rather than inheriting ``id``) so
    that dumps list the discriminator first, which reads better in YAML."""


class GenerateNode(_NodeBase):
    """Sample ``n`` continuations for every current leaf branch.

    ``until="step"`` decodes only up to the next ``step_delimiter`` so that step-level search
    (generate a step, score it, prune, repeat inside a loop) can share the prefix KV cache;
    ``until="answer"`` decodes to the end of the answer (or ``max_tokens``/``stop``).

    ``n`` is the default number of children per unfinished leaf. When the select that ran just
    before this node *allocated* children per leaf (methods ``beam``, ``rebase``, ``ets``, ``dfs``),
    that allocation replaces ``n``: tree search decides per leaf how many continuations it gets
    (REBASE's reward-weighted split), which one number on the generate node cannot express.
    Finished leaves are never expanded.
    """

    kind: Literal["generate"] = "generate"
    id: NodeId
    n: int = Field(default=1, ge=1, le=4096, description="children per input leaf")
    temperature: float = Field(default=0.7, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=131072)
    min_tokens: int = Field(
        default=0,
        ge=0,
        le=131072,
        description="end of sequence is masked until a branch has this many tokens (vLLM's min_tokens): "
        "branches of one length, as a benchmark of decoding speed wants",
    )
    stop: list[str] = Field(default_factory=list)
    until: Literal["answer", "step"] = "answer"
    step_delimiter: str = Field(default="\n\n", min_length=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="sampling seed of this node")
    response_format: Constraint | None = Field(
        default=None,
        description="what each continuation must look like: a Constraint, or OpenAI's response_format "
        "object ({type: json_object} / {type: json_schema, json_schema: {schema: ...}}); the backend "
        "decodes under its grammar",
    )

    @model_validator(mode="after")
    def _min_within_max(self) -> GenerateNode:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be within 0..max_tokens={self.max_tokens}")
        return self

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        # An empty stop string matches at position 0 and would end every branch immediately.
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty (an empty string would stop decoding at once)")
        return value


class ScoreNode(_NodeBase):
    """Attach a score to every leaf using a verifier the reasoner resolves by name.

    The verifier is referenced by name (not by object) so the strategy stays serialisable.
    """

    kind: Literal["score"] = "score"
    id: NodeId
    verifier: str = Field(default="judge", min_length=1)
    target: Literal["answer", "step"] = "answer"


SelectMethod = Literal["top_k", "threshold", "beam", "rebase", "ets", "dfs"]
#: Methods that allocate children per kept leaf for the next generate (and retire finished leaves).
ALLOCATING_METHODS: frozenset[str] = frozenset({"beam", "rebase", "ets", "dfs"})
_WIDTH_METHODS = frozenset({"beam", "rebase", "ets"})
_THRESHOLD_METHODS = ("threshold", "dfs")


class SelectNode(_NodeBase):
    """Prune the leaves by score, and for tree search also decide how many children each kept leaf gets.

    Methods:

    * ``top_k`` — keep the ``k`` best leaves (finished or not); the next generate uses its ``n``.
    * ``threshold`` — keep the leaves scoring at least ``threshold`` (the best one if none does).
    * ``beam`` — PRM-guided beam search over a search ``width`` N: keep the best ``k`` unfinished
      leaves (``keep="sqrt"``: round(sqrt(N))) and split the width evenly over them (N/M children
      each). ``group_by="subtree"`` is DVTS: the first select splits the leaves into ``k`` (or
      sqrt(N)) subtrees, each with its own share of the width, and every subtree keeps its one best
      leaf per step, so the subtrees search independently.
    * ``rebase`` — REBASE: no hard cut; the width is split over the unfinished leaves by
      ``ceil(W_rem * exp(R_i/T) / sum_rest)`` from best to worst; leaves given 0 children are pruned.
    * ``ets`` — ETS: REBASE weights, then the ILP that trades kept weight against retained tree
      nodes (``lambda_b``) and semantic coverage (``lambda_d``, clusters of the leaves' last steps
      embedded by ``embedder`` and cut at ``cluster_distance``), then REBASE over the kept leaves.
    * ``dfs`` — Tree-of-Thoughts DFS: prune leaves below ``threshold``, expand only the deepest
      best unfinished leaf and park the rest as the frontier to backtrack to; stops once a
      finished leaf passes the threshold or the frontier is empty.

    For the search methods (``beam``, ``rebase``, ``ets``) the width shrinks by one per finished
    leaf (REBASE's and ETS's rule; applied to beam and DVTS too so that every method produces the
    same number of trajectories). Finished leaves are set aside: kept for the final vote, never
    expanded, and their KV is released at once since nothing reads it again.

    A parameter set to a non-default value on a method that ignores it is an error rather than
    silently unused (values are compared with the defaults, so JSON/YAML round trips stay valid).
    """

    kind: Literal["select"] = "select"
    id: NodeId
    method: SelectMethod = "top_k"
    k: int = Field(default=1, ge=1, description="top_k: leaves kept; beam: kept per step (subtrees for DVTS)")
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)
    width: int | None = Field(
        default=None, ge=1, le=65536, description="beam/rebase/ets: search width N (children per step)"
    )
    keep: Literal["fixed", "sqrt"] = Field(default="fixed", description="beam: keep k, or round(sqrt(width))")
    group_by: Literal["none", "subtree"] = Field(default="none", description="beam: 'subtree' is DVTS")
    temperature: float = Field(
        default=0.2, gt=0.0, le=100.0, description="rebase/ets: softmax temperature T_R"
    )
    lambda_b: float = Field(
        default=1.0, ge=0.0, le=100.0, description="ets: weight of the retained-node budget"
    )
    lambda_d: float = Field(default=1.4, ge=0.0, le=100.0, description="ets: weight of semantic coverage")
    cluster_distance: float = Field(
        default=0.05, ge=0.0, le=2.0, description="ets: cosine-distance cut of the step clusters"
    )
    embedder: Literal["minilm", "hidden"] = Field(
        default="minilm", description="ets: all-MiniLM-L6-v2, or the backend's own hidden states"
    )
    time_limit: float = Field(default=5.0, gt=0.0, le=3600.0, description="ets: ILP solver seconds per step")

    @model_validator(mode="after")
    def _parameters_match_method(self) -> SelectNode:
        # Both directions are checked: a parameter that is silently ignored is as surprising as a
        # method with nothing to compare against.
        method = self.method
        if method in _THRESHOLD_METHODS and self.threshold is None:
            raise ValueError(f"select method={method!r} requires threshold (a float in [0, 1])")
        if method not in _THRESHOLD_METHODS and self.threshold is not None:
            raise ValueError(
                f"select threshold is only used with method='threshold' or 'dfs' (method is {method!r}); "
                "drop threshold or change the method"
            )
        if method in _WIDTH_METHODS and self.width is None:
            raise ValueError(f"select method={method!r} requires width (the search width N, an int >= 1)")
        if method not in _WIDTH_METHODS and self.width is not None:
            raise ValueError(
                f"select width is only used with method 'beam', 'rebase' or 'ets' (method is {method!r})"
            )
        users = {
            "k": ("top_k", "beam"),
            "keep": ("beam",),
            "group_by": ("beam",),
            "temperature": ("rebase", "ets"),
            "lambda_b": ("ets",),
            "lambda_d": ("ets",),
            "cluster_distance": ("ets",),
            "embedder": ("ets",),
            "time_limit": ("ets",),
        }
        if self.keep == "sqrt" and self.k != 1:
            raise ValueError("select keep='sqrt' keeps round(sqrt(width)) leaves; drop k or use keep='fixed'")
        for name, methods in users.items():
            if method not in methods and getattr(self, name) != type(self).model_fields[name].default:
                allowed = " or ".join(repr(m) for m in methods)
                raise ValueError(
                    f"select {name} is only used with method {allowed} (method is {method!r}); "
                    f"drop {name} or change the method"
                )
        return self


class AggregateNode(_NodeBase):
    """Reduce the surviving branches to one final answer; always the graph's unique sink."""

    kind: Literal["aggregate"] = "aggregate"
    id: NodeId
    method: Literal["majority", "weighted_majority", "best_score"] = "majority"
    extractor: str = Field(default="auto", min_length=1)
    finished_only: bool = Field(
        default=False,
        description="vote over finished branches only (tree search: a leaf cut off by the depth "
        "cap holds a partial solution); falls back to all branches when none finished",
    )


class LoopNode(_NodeBase):
    """Repeat ``body`` (node ids, executed in order) until every branch finished or the cap.

    A search select that leaves nothing to expand (every branch finished or pruned, or a DFS that
    found its solution) also ends the loop, so ``max_iterations`` is a depth cap, not a promise.

    Loops are the only sanctioned cycle: the graph must contain ``loop -> body[0] -> ... ->
    body[-1] -> loop`` plus exactly one exit edge ``loop -> x``; ``Strategy`` checks that shape.
    """

    kind: Literal["loop"] = "loop"
    id: NodeId
    body: list[NodeId] = Field(min_length=1)
    max_iterations: int = Field(ge=1, le=10000)
    until: Literal["all_finished", "max_iterations"] = "all_finished"

    @model_validator(mode="after")
    def _body_is_simple(self) -> LoopNode:
        if self.id in self.body:
            raise ValueError(f"loop {self.id!r} lists itself in body; a loop cannot contain itself")
        seen: set[str] = set()
        for i, node_id in enumerate(self.body):
            if node_id in seen:
                raise ValueError(f"body[{i}] {node_id!r} appears twice in loop {self.id!r}")
            seen.add(node_id)
        return self


Node = Annotated[
    GenerateNode | ScoreNode | SelectNode | AggregateNode | LoopNode,
    Field(discriminator="kind"),
]
