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

__all__ = [
    "NODE_ID_PATTERN",
    "AggregateNode",
    "GenerateNode",
    "LoopNode",
    "Node",
    "NodeId",
    "ScoreNode",
    "SelectNode",
]

#: Ids double as YAML keys, log labels and file-name fragments, so they are kept identifier-like.
NODE_ID_PATTERN = r"^[A-Za-z_][A-Za-z0-9_\-]*$"

NodeId = Annotated[str, Field(min_length=1, pattern=NODE_ID_PATTERN)]


class _NodeBase(BaseModel):
    """Shared config: unknown keys are typos, not extensions, so they are rejected.

    Each subclass declares ``kind`` then ``id`` itself (rather than inheriting ``id``) so that
    dumps list the discriminator first, which reads better in YAML.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)


class GenerateNode(_NodeBase):
    """Sample ``n`` continuations for every current leaf branch.

    ``until="step"`` decodes only up to the next ``step_delimiter`` so that step-level search
    (generate a step, score it, prune, repeat inside a loop) can share the prefix KV cache;
    ``until="answer"`` decodes to the end of the answer (or ``max_tokens``/``stop``).
    """

    kind: Literal["generate"] = "generate"
    id: NodeId
    n: int = Field(default=1, ge=1, le=4096, description="children per input leaf")
    temperature: float = Field(default=0.7, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(default=256, ge=1, le=131072)
    stop: list[str] = Field(default_factory=list)
    until: Literal["answer", "step"] = "answer"
    step_delimiter: str = Field(default="\n\n", min_length=1)
    seed: int | None = None

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


class SelectNode(_NodeBase):
    """Prune the leaves by score: keep the ``k`` best, or those at or above ``threshold``."""

    kind: Literal["select"] = "select"
    id: NodeId
    method: Literal["top_k", "threshold"] = "top_k"
    k: int = Field(default=1, ge=1)
    threshold: float | None = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _threshold_matches_method(self) -> SelectNode:
        # Both directions are checked: a threshold that is silently ignored is as surprising as
        # a threshold method with nothing to compare against.
        if self.method == "threshold" and self.threshold is None:
            raise ValueError("select method='threshold' requires threshold (a float in [0, 1])")
        if self.method != "threshold" and self.threshold is not None:
            raise ValueError(
                f"select threshold is only used with method='threshold' (method is {self.method!r}); "
                "drop threshold or set method='threshold'"
            )
        return self


class AggregateNode(_NodeBase):
    """Reduce the surviving branches to one final answer; always the graph's unique sink."""

    kind: Literal["aggregate"] = "aggregate"
    id: NodeId
    method: Literal["majority", "weighted_majority", "best_score"] = "majority"
    extractor: str = Field(default="auto", min_length=1)


class LoopNode(_NodeBase):
    """Repeat ``body`` (node ids, executed in order) until every branch finished or the cap.

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
