"""Strategy graphs and their compilation into a linear execution ``Plan``.

A ``Strategy`` is a small DAG of nodes (plus sanctioned loops) that users write by hand or in
YAML. All structural checks run in a pydantic ``model_validator`` so that a malformed strategy is
rejected *at construction* with a ``ValidationError`` that names the offending node or edge,
long before a model is loaded or a token is generated. ``compile()`` then only has to order an
already-valid graph, which keeps it pure and deterministic.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import networkx as nx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from .errors import describe_yaml_error
from .nodes import AggregateNode, GenerateNode, LoopNode, Node, ScoreNode, SelectNode, SpecModel

__all__ = ["Edge", "LoopStep", "OpStep", "Plan", "PlanStep", "Strategy", "StrategyGraphError"]


class _YamlDumper(yaml.SafeDumper):
    """Safe dumper that writes multi-line strings (``step_delimiter="\\n\\n"``) double-quoted.

    PyYAML's default turns ``"\\n\\n"`` into a folded single-quoted scalar spread over several
    lines, which is correct but unreadable and easy to break when hand-editing.
    """


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # YAML also folds NEL/LS/PS (\x85, \u2028, \u2029) as line breaks; quoting keeps them exact.
    style = '"' if any(c in value for c in "\n\r\x85\u2028\u2029") or not value.isprintable() else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_YamlDumper.add_representer(str, _represent_str)


class Edge(SpecModel):
    """A directed ``source -> target`` dependency between two node ids.

    A 2-item list/tuple ``["a", "b"]`` is accepted as input because that is the natural way to
    write edges in YAML; it is always dumped back in the explicit mapping form.
    """

    source: str = Field(min_length=1)
    target: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_pair(cls, data: Any) -> Any:
        if isinstance(data, (list, tuple)):
            if len(data) != 2:
                raise ValueError(
                    f"an edge given as a list must have exactly 2 items [source, target], got {len(data)}"
                )
            return {"source": data[0], "target": data[1]}
        return data


# --------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------


class OpStep(BaseModel):
    """Run one non-loop node once over the current set of leaves."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: Node

    @model_validator(mode="after")
    def _not_a_loop(self) -> OpStep:
        # Loops carry a body and must be executed as such; an OpStep would drop it.
        if isinstance(self.node, LoopNode):
            raise ValueError(f"loop node {self.node.id!r} must be compiled to a LoopStep, not an OpStep")
        return self


class LoopStep(BaseModel):
    """Run ``body`` repeatedly, as controlled by the loop node's ``until``/``max_iterations``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node: LoopNode
    body: list[OpStep] = Field(min_length=1)

    @model_validator(mode="after")
    def _body_matches_node(self) -> LoopStep:
        ids = [step.node.id for step in self.body]
        if ids != list(self.node.body):
            raise ValueError(
                f"LoopStep body {ids} does not match loop {self.node.id!r} body {self.node.body}"
            )
        return self


PlanStep = OpStep | LoopStep


class Plan(BaseModel):
    """The executable form of a ``Strategy``: steps in the order the reasoner runs them.

    Frozen because a plan is a compiled artefact; a reasoner may cache or share it freely.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: str
    steps: list[PlanStep]

    def nodes(self) -> Iterator[Node]:
        """Yield every node in execution order, each loop node just before its body."""
        for step in self.steps:
            yield step.node
            if isinstance(step, LoopStep):
                for inner in step.body:
                    yield inner.node


# --------------------------------------------------------------------------------------------
# Strategy
# --------------------------------------------------------------------------------------------


def _describe(index: int, node: Node) -> str:
    return f"nodes[{index}] ({node.kind} {node.id!r})"


class StrategyGraphError(ValueError):
    """One or more structural problems; a ValueError so pydantic wraps it in a ValidationError."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            message = f"invalid strategy graph: {problems[0]}"
        else:
            message = "invalid strategy graph:\n" + "\n".join(f"  - {p}" for p in problems)
        super().__init__(message)


class Strategy(SpecModel):
    """A named, validated graph of nodes.

    Invariants (checked at construction; every violation is reported, not just the first):

    * node ids are unique and every edge endpoint is a node id; edges are not repeated;
    * exactly one source, and it is a generate node; every node is reachable from it;
    * exactly one aggregate node, and it is the unique sink;
    * a score node has a generate node upstream, a select node has a score node upstream
      ("upstream" ignores loop back edges, so a select must come after a score in run order);
    * the only cycles are loops of the shape ``L -> body[0] -> ... -> body[-1] -> L`` with exactly
      one exit edge ``L -> x``; loops may not be nested and their body must contain a generate.
    """

    name: str = Field(min_length=1)
    description: str = ""
    nodes: list[Node] = Field(min_length=1)
    edges: list[Edge] = Field(default_factory=list)

    # ---- validation ------------------------------------------------------------------------

    @model_validator(mode="after")
    def _validate_graph(self) -> Strategy:
        # Stage 1: references. Later stages build a graph, which is meaningless with bad ids.
        problems = self._check_references()
        if problems:
            raise StrategyGraphError(problems)
        graph = self._graph()
        # Stage 2: loop shapes and stray cycles. Ancestry is undefined until the graph minus loop
        # back edges is known to be acyclic, so stop here on failure.
        problems = self._check_loops(graph)
        problems += self._check_acyclic(graph)
        if problems:
            raise StrategyGraphError(problems)
        # Stage 3: sources, sinks, reachability and node order.
        problems = self._check_flow(graph)
        if problems:
            raise StrategyGraphError(problems)
        return self

    def _index(self) -> dict[str, int]:
        return {node.id: i for i, node in enumerate(self.nodes)}

    def _loops(self) -> list[LoopNode]:
        return [node for node in self.nodes if isinstance(node, LoopNode)]

    def _graph(self) -> nx.DiGraph:
        graph: nx.DiGraph = nx.DiGraph()
        for node in self.nodes:
            graph.add_node(node.id)
        for edge in self.edges:
            graph.add_edge(edge.source, edge.target)
        return graph

    def _back_edges(self) -> set[tuple[str, str]]:
        return {(loop.body[-1], loop.id) for loop in self._loops()}

    def _dag(self, graph: nx.DiGraph) -> nx.DiGraph:
        dag = graph.copy()
        dag.remove_edges_from(self._back_edges() & set(dag.edges))
        return dag

    def _check_references(self) -> list[str]:
        problems: list[str] = []
        first_seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.id in first_seen:
                problems.append(f"nodes[{i}].id {node.id!r} duplicates nodes[{first_seen[node.id]}].id")
            else:
                first_seen[node.id] = i
        for i, edge in enumerate(self.edges):
            for end in ("source", "target"):
                value = getattr(edge, end)
                if value not in first_seen:
                    problems.append(f"edges[{i}].{end} {value!r} is not a node id")
        seen_edges: dict[tuple[str, str], int] = {}
        for i, edge in enumerate(self.edges):
            key = (edge.source, edge.target)
            if key in seen_edges:
                problems.append(
                    f"edges[{i}] {edge.source!r} -> {edge.target!r} duplicates edges[{seen_edges[key]}]"
                )
            else:
                seen_edges[key] = i
        for i, node in enumerate(self.nodes):
            if isinstance(node, LoopNode):
                for j, member in enumerate(node.body):
                    if member not in first_seen:
                        problems.append(f"nodes[{i}].body[{j}] {member!r} is not a node id")
        return problems

    def _check_loops(self, graph: nx.DiGraph) -> list[str]:
        problems: list[str] = []
        index = self._index()
        by_id = {node.id: node for node in self.nodes}
        owner: dict[str, str] = {}
        for loop in self._loops():
            where = f"nodes[{index[loop.id]}].body"
            for j, member in enumerate(loop.body):
                if member in owner:
                    problems.append(
                        f"{where}[{j}] {member!r} is already in the body of loop {owner[member]!r}; "
                        "a node may belong to one loop only"
                    )
                owner.setdefault(member, loop.id)
        for loop in self._loops():
            i = index[loop.id]
            where = f"nodes[{i}] (loop {loop.id!r})"
            body = loop.body
            members = set(body)
            nested = [m for m in body if isinstance(by_id[m], LoopNode)]
            if nested:
                problems.append(f"{where}: nested loops are not supported (body contains loop {nested[0]!r})")
                continue
            if not any(isinstance(by_id[m], GenerateNode) for m in body):
                problems.append(
                    f"{where}: body has no generate node, so every iteration would redo the same work"
                )
            # The chain itself: L -> body[0] -> ... -> body[-1] -> L.
            chain = [loop.id, *body, loop.id]
            for a, b in pairwise(chain):
                if not graph.has_edge(a, b):
                    kind = "back edge" if b == loop.id else "edge"
                    problems.append(f"{where}: missing {kind} {a!r} -> {b!r} required by body {body}")
            # Exactly one exit edge, and no other edges from L into the body.
            exits = sorted(t for t in graph.successors(loop.id) if t not in members)
            if len(exits) != 1:
                problems.append(
                    f"{where}: needs exactly one exit edge to a node outside its body, found {len(exits)}"
                    + (f" ({', '.join(repr(t) for t in exits)})" if exits else "")
                )
            for t in sorted(graph.successors(loop.id)):
                if t in members and t != body[0]:
                    problems.append(f"{where}: edge {loop.id!r} -> {t!r} enters the body after body[0]")
            # Body nodes talk only to their chain neighbours, so the body runs as a straight line.
            for j, member in enumerate(body):
                allowed_out = body[j + 1] if j + 1 < len(body) else loop.id
                for t in sorted(graph.successors(member)):
                    if t != allowed_out:
                        problems.append(
                            f"{where}: edge {member!r} -> {t!r} leaves the loop body; only "
                            f"{member!r} -> {allowed_out!r} is allowed"
                        )
                allowed_in = body[j - 1] if j > 0 else loop.id
                for s in sorted(graph.predecessors(member)):
                    if s != allowed_in and s not in members:
                        problems.append(
                            f"{where}: edge {s!r} -> {member!r} enters the loop body from outside; only "
                            f"{allowed_in!r} -> {member!r} is allowed"
                        )
        return problems

    def _check_acyclic(self, graph: nx.DiGraph) -> list[str]:
        dag = self._dag(graph)
        try:
            cycle = nx.find_cycle(dag)
        except nx.NetworkXNoCycle:
            return []
        path = " -> ".join([*(repr(u) for u, _ in cycle), repr(cycle[0][0])])
        return [f"edges form a cycle that does not go through a loop node: {path}"]

    def _check_flow(self, graph: nx.DiGraph) -> list[str]:
        problems: list[str] = []
        index = self._index()
        by_id = {node.id: node for node in self.nodes}

        sources = [n for n in graph.nodes if graph.in_degree(n) == 0]
        if not sources:
            problems.append(
                "no source node (every node has an incoming edge); the first node must be a generate"
            )
        elif len(sources) > 1:
            listed = ", ".join(_describe(index[s], by_id[s]) for s in sources)
            problems.append(f"exactly one source node is allowed, found {len(sources)}: {listed}")
        elif not isinstance(by_id[sources[0]], GenerateNode):
            problems.append(
                f"the source node {_describe(index[sources[0]], by_id[sources[0]])} must be a generate node"
            )

        aggregates = [n.id for n in self.nodes if isinstance(n, AggregateNode)]
        if len(aggregates) != 1:
            listed = ", ".join(_describe(index[a], by_id[a]) for a in aggregates)
            problems.append(
                f"exactly one aggregate node is required, found {len(aggregates)}"
                + (f": {listed}" if listed else "")
            )
        for a in aggregates:
            for t in sorted(graph.successors(a)):
                problems.append(f"{_describe(index[a], by_id[a])} must be the sink but has an edge to {t!r}")
        sinks = [n for n in graph.nodes if graph.out_degree(n) == 0]
        for s in sinks:
            if not isinstance(by_id[s], AggregateNode):
                problems.append(
                    f"{_describe(index[s], by_id[s])} has no outgoing edge; only the aggregate node may be a sink"
                )

        if len(sources) == 1:
            reachable = nx.descendants(graph, sources[0]) | {sources[0]}
            for node in self.nodes:
                if node.id not in reachable:
                    problems.append(
                        f"{_describe(index[node.id], node)} is unreachable from the source {sources[0]!r}"
                    )

        dag = self._dag(graph)
        for i, node in enumerate(self.nodes):
            if isinstance(node, (ScoreNode, SelectNode)):
                ancestors = nx.ancestors(dag, node.id)
                needed: type[GenerateNode | ScoreNode]
                if isinstance(node, ScoreNode):
                    needed, what = GenerateNode, "generate"
                else:
                    needed, what = ScoreNode, "score"
                if not any(isinstance(by_id[a], needed) for a in ancestors):
                    problems.append(
                        f"{_describe(i, node)} needs a {what} node before it (among its ancestors); "
                        f"check the node order"
                    )
        return problems

    # ---- compilation -----------------------------------------------------------------------

    def compile(self) -> Plan:
        """Order the (already validated) graph into a ``Plan``.

        Loop back edges are dropped, each loop body is collapsed into its loop node, and the
        result is topologically sorted with ties broken by position in ``nodes`` — so the plan
        is deterministic and follows the author's listing wherever the graph leaves freedom.
        """
        index = self._index()
        by_id = {node.id: node for node in self.nodes}
        owner = {member: loop.id for loop in self._loops() for member in loop.body}
        dag = self._dag(self._graph())
        collapsed: nx.DiGraph = nx.DiGraph()
        collapsed.add_nodes_from(n.id for n in self.nodes if n.id not in owner)
        for u, v in dag.edges:
            cu, cv = owner.get(u, u), owner.get(v, v)
            if cu != cv:
                collapsed.add_edge(cu, cv)
        steps: list[PlanStep] = []
        for node_id in nx.lexicographical_topological_sort(collapsed, key=lambda n: index[n]):
            node = by_id[node_id]
            if isinstance(node, LoopNode):
                steps.append(LoopStep(node=node, body=[OpStep(node=by_id[m]) for m in node.body]))
            else:
                steps.append(OpStep(node=node))
        return Plan(strategy=self.name, steps=steps)

    # ---- serialisation ---------------------------------------------------------------------

    def to_json(self, *, indent: int | None = 2) -> str:
        """Serialise to JSON; ``from_json`` re-validates, so a round trip is an equality."""
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Strategy:
        return cls.model_validate_json(text)

    def to_yaml(self) -> str:
        """Serialise to YAML (safe dumper, keys in declaration order for readable diffs)."""
        return yaml.dump(
            self.model_dump(mode="json"), Dumper=_YamlDumper, sort_keys=False, allow_unicode=True
        )

    @classmethod
    def from_yaml(cls, text: str | bytes) -> Strategy:
        """Parse YAML with the safe loader (strategies may come from untrusted files).

        Every failure is a ``ValidationError``, as it is for ``from_json``: a YAML syntax error
        carries the line and column the parser stopped at, and a document that holds no mapping
        (empty, a bare scalar, a list) says what a strategy file must contain.
        """
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise _document_error("yaml_invalid", describe_yaml_error(err), text) from None
        if not isinstance(data, dict):
            found = "an empty document" if data is None else f"a {type(data).__name__}"
            raise _document_error(
                "yaml_not_mapping",
                f"a strategy file must hold a mapping with keys name, nodes and edges; found {found}",
                text,
            )
        return cls.model_validate(data)


def _document_error(kind: str, message: str, text: str | bytes) -> ValidationError:
    """A ``ValidationError`` about the document as a whole (empty ``loc``), like pydantic's own
    ``json_invalid``, so callers catch one exception type whatever the format."""
    detail = InitErrorDetails(type=PydanticCustomError(kind, message), loc=(), input=text)
    return ValidationError.from_exception_data(Strategy.__name__, [detail])
