"""Tests for the declarative strategy layer (``branchwise.strategies``).

The layer's promise is that a malformed strategy never reaches the reasoner: every bad graph or
parameter fails at construction with a ``ValidationError`` naming the culprit, and every valid
one compiles deterministically and survives JSON/YAML round trips. Property-based tests cover
the space of chain-shaped strategies rather than a handful of hand-picked ones.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from branchwise.strategies import (
    MAX_SEED,
    AggregateNode,
    Edge,
    GenerateNode,
    LoopNode,
    LoopStep,
    OpStep,
    Plan,
    ScoreNode,
    SelectNode,
    Strategy,
    best_of_n,
    self_consistency,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
STRATEGIES_DIR = REPO_ROOT / "branchwise" / "strategies"

FAST = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def TEXT(**kwargs: int) -> st.SearchStrategy[str]:
    """Any text a strategy file can hold: every code point but lone surrogates (not UTF-8)."""
    return st.text(st.characters(exclude_categories=["Cs"]), **kwargs)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def gen(id: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "generate", "id": id, **kw}


def score(id: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "score", "id": id, **kw}


def select(id: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "select", "id": id, **kw}


def agg(id: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "aggregate", "id": id, **kw}


def loop(id: str, body: list[str], max_iterations: int = 8, **kw: Any) -> dict[str, Any]:
    return {"kind": "loop", "id": id, "body": body, "max_iterations": max_iterations, **kw}


def chain_edges(*ids: str) -> list[list[str]]:
    return [[a, b] for a, b in pairwise(ids)]


def build(nodes: list[dict[str, Any]], edges: list[Any], name: str = "t") -> Strategy:
    return Strategy.model_validate({"name": name, "nodes": nodes, "edges": edges})


def step_search() -> Strategy:
    """A step-level beam search: the canonical valid loop graph."""
    return build(
        [
            gen("first", n=4, until="step"),
            loop("beam", ["expand", "judge_step", "prune"], max_iterations=12),
            gen("expand", n=2, until="step"),
            score("judge_step", target="step"),
            select("prune", method="top_k", k=4),
            agg("vote", method="weighted_majority"),
        ],
        [
            ["first", "beam"],
            ["beam", "expand"],
            ["expand", "judge_step"],
            ["judge_step", "prune"],
            ["prune", "beam"],
            ["beam", "vote"],
        ],
        name="step_search",
    )


def plan_ids(plan: Plan) -> list[str]:
    return [node.id for node in plan.nodes()]


# ----------------------------------------------------------------------------------------------
# node models
# ----------------------------------------------------------------------------------------------


def test_node_defaults_match_spec() -> None:
    g = GenerateNode(id="g")
    assert (g.n, g.temperature, g.top_p, g.max_tokens, g.stop, g.until, g.step_delimiter, g.seed) == (
        1,
        0.7,
        1.0,
        256,
        [],
        "answer",
        "\n\n",
        None,
    )
    assert (ScoreNode(id="s").verifier, ScoreNode(id="s").target) == ("judge", "answer")
    sel = SelectNode(id="x")
    assert (sel.method, sel.k, sel.threshold) == ("top_k", 1, None)
    a = AggregateNode(id="a")
    assert (a.method, a.extractor) == ("majority", "auto")
    lp = LoopNode(id="l", body=["g"], max_iterations=3)
    assert lp.until == "all_finished"


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("n", 0, "greater than or equal to 1"),
        ("n", 4097, "less than or equal to 4096"),
        ("temperature", -0.1, "greater than or equal to 0"),
        ("temperature", 5.5, "less than or equal to 5"),
        ("top_p", 0, "greater than 0"),
        ("top_p", 1.01, "less than or equal to 1"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", 131073, "less than or equal to 131072"),
        ("step_delimiter", "", "at least 1 character"),
        ("until", "sentence", "'answer' or 'step'"),
    ],
)
def test_generate_parameter_ranges_name_field_and_bound(field: str, value: Any, fragment: str) -> None:
    nodes = [gen("g", **{field: value}), agg("a")]
    with pytest.raises(ValidationError) as excinfo:
        build(nodes, [["g", "a"]])
    errors = excinfo.value.errors()
    assert len(errors) == 1
    assert errors[0]["loc"] == ("nodes", 0, "generate", field)
    assert fragment in errors[0]["msg"]
    assert f"nodes.0.generate.{field}" in str(excinfo.value)


def test_min_tokens_past_max_tokens_names_both() -> None:
    with pytest.raises(ValidationError, match=r"min_tokens=9 must be within 0\.\.max_tokens=8"):
        GenerateNode(id="g", max_tokens=8, min_tokens=9)


def test_empty_stop_string_rejected() -> None:
    with pytest.raises(ValidationError, match="stop strings must be non-empty"):
        GenerateNode(id="g", stop=["ok", ""])


@pytest.mark.parametrize("bad_id", ["", "1abc", "has space", "dot.ted", "slash/"])
def test_node_id_pattern(bad_id: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        GenerateNode(id=bad_id)
    assert excinfo.value.errors()[0]["loc"] == ("id",)


def test_select_threshold_method_requires_threshold() -> None:
    with pytest.raises(ValidationError, match=r"method='threshold' requires threshold"):
        SelectNode(id="s", method="threshold")
    with pytest.raises(ValidationError, match="only used with method='threshold'"):
        SelectNode(id="s", threshold=0.5)
    with pytest.raises(ValidationError) as excinfo:
        SelectNode(id="s", method="threshold", threshold=1.5)
    assert excinfo.value.errors()[0]["loc"] == ("threshold",)
    assert SelectNode(id="s", method="threshold", threshold=0.5).threshold == 0.5


def test_loop_node_body_checks() -> None:
    with pytest.raises(ValidationError) as excinfo:
        LoopNode(id="l", body=[], max_iterations=1)
    assert excinfo.value.errors()[0]["loc"] == ("body",)
    with pytest.raises(ValidationError, match="lists itself in body"):
        LoopNode(id="l", body=["l"], max_iterations=1)
    with pytest.raises(ValidationError, match=r"body\[1\] 'g' appears twice"):
        LoopNode(id="l", body=["g", "g"], max_iterations=1)
    with pytest.raises(ValidationError) as excinfo:
        LoopNode(id="l", body=["g"], max_iterations=0)
    assert excinfo.value.errors()[0]["loc"] == ("max_iterations",)


def test_unknown_fields_and_kinds_rejected() -> None:
    with pytest.raises(ValidationError) as excinfo:
        build([gen("g", temprature=0.5), agg("a")], [["g", "a"]])
    assert excinfo.value.errors()[0]["loc"] == ("nodes", 0, "generate", "temprature")
    with pytest.raises(ValidationError) as excinfo:
        build([{"kind": "beam", "id": "b"}, agg("a")], [["b", "a"]])
    assert "'generate', 'score', 'select', 'aggregate', 'loop'" in str(excinfo.value)


def test_nodes_are_frozen() -> None:
    g = GenerateNode(id="g")
    with pytest.raises(ValidationError):
        g.n = 3  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# edges
# ----------------------------------------------------------------------------------------------


def test_edge_accepts_pairs_and_dumps_mappings() -> None:
    s = build([gen("g"), agg("a")], [("g", "a")])
    assert s.edges == [Edge(source="g", target="a")]
    assert s.model_dump()["edges"] == [{"source": "g", "target": "a"}]
    with pytest.raises(ValidationError, match="exactly 2 items"):
        build([gen("g"), agg("a")], [["g", "a", "x"]])


# ----------------------------------------------------------------------------------------------
# graph validation: each invalid case names what is wrong
# ----------------------------------------------------------------------------------------------

INVALID_GRAPHS: list[tuple[str, list[dict[str, Any]], list[Any], str]] = [
    (
        "duplicate id",
        [gen("g"), gen("g"), agg("a")],
        [["g", "a"]],
        "nodes[1].id 'g' duplicates nodes[0].id",
    ),
    (
        "dangling target",
        [gen("g"), score("s"), agg("a")],
        [["g", "s"], ["s", "a"], ["a", "x"]],
        "edges[2].target 'x' is not a node id",
    ),
    (
        "dangling source",
        [gen("g"), agg("a")],
        [["g", "a"], ["nope", "a"]],
        "edges[1].source 'nope' is not a node id",
    ),
    (
        "duplicate edge",
        [gen("g"), agg("a")],
        [["g", "a"], ["g", "a"]],
        "edges[1] 'g' -> 'a' duplicates edges[0]",
    ),
    (
        "loop body refers to unknown id",
        [gen("g"), loop("l", ["ghost"]), agg("a")],
        [["g", "l"], ["l", "a"]],
        "nodes[1].body[0] 'ghost' is not a node id",
    ),
    (
        "two sources",
        [gen("g1"), gen("g2"), agg("a")],
        [["g1", "a"], ["g2", "a"]],
        "exactly one source node is allowed, found 2",
    ),
    (
        "no source (loop without an entry)",
        [loop("l", ["g"]), gen("g"), agg("a")],
        [["l", "g"], ["g", "l"], ["l", "a"]],
        "no source node",
    ),
    (
        "source is not a generate",
        [score("s"), agg("a")],
        [["s", "a"]],
        "source node nodes[0] (score 's') must be a generate node",
    ),
    (
        "score without generate upstream",
        [score("s"), agg("a")],
        [["s", "a"]],
        "nodes[0] (score 's') needs a generate node before it",
    ),
    (
        "no aggregate",
        [gen("g"), score("s")],
        [["g", "s"]],
        "exactly one aggregate node is required, found 0",
    ),
    (
        "two aggregates",
        [gen("g"), agg("a1"), agg("a2")],
        [["g", "a1"], ["g", "a2"]],
        "exactly one aggregate node is required, found 2",
    ),
    (
        "aggregate not the sink",
        [gen("g"), agg("a"), score("s")],
        [["g", "a"], ["a", "s"]],
        "nodes[1] (aggregate 'a') must be the sink but has an edge to 's'",
    ),
    (
        "non-aggregate sink",
        [gen("g"), score("s"), agg("a")],
        [["g", "s"], ["g", "a"]],
        "nodes[1] (score 's') has no outgoing edge; only the aggregate node may be a sink",
    ),
    (
        "select before score",
        [gen("g"), select("x"), score("s"), agg("a")],
        [["g", "x"], ["x", "s"], ["s", "a"]],
        "nodes[1] (select 'x') needs a score node before it",
    ),
    (
        "threshold select with nothing scored",
        [gen("g"), select("x", method="threshold", threshold=0.3), agg("a")],
        [["g", "x"], ["x", "a"]],
        "nodes[1] (select 'x') needs a score node before it",
    ),
    (
        "cycle without loop node",
        [gen("g"), score("s"), select("x"), agg("a")],
        [["g", "s"], ["s", "x"], ["x", "s"], ["x", "a"]],
        "cycle that does not go through a loop node: 's' -> 'x' -> 's'",
    ),
    (
        "self loop",
        [gen("g"), score("s"), agg("a")],
        [["g", "s"], ["s", "s"], ["s", "a"]],
        "cycle that does not go through a loop node: 's' -> 's'",
    ),
    (
        "unreachable nodes",
        [gen("g"), loop("l", ["g2"]), gen("g2"), agg("a")],
        [["g", "a"], ["l", "g2"], ["g2", "l"], ["l", "a"]],
        "nodes[1] (loop 'l') is unreachable from the source 'g'",
    ),
    (
        "loop missing back edge",
        [gen("g"), loop("l", ["g2", "s"]), gen("g2"), score("s"), agg("a")],
        [["g", "l"], ["l", "g2"], ["g2", "s"], ["l", "a"]],
        "missing back edge 's' -> 'l'",
    ),
    (
        "loop missing entry edge",
        [gen("g"), loop("l", ["g2"]), gen("g2"), agg("a")],
        [["g", "l"], ["g", "g2"], ["g2", "l"], ["l", "a"]],
        "missing edge 'l' -> 'g2'",
    ),
    (
        "loop with two exits",
        [gen("g"), loop("l", ["g2"]), gen("g2"), score("s"), agg("a")],
        [["g", "l"], ["l", "g2"], ["g2", "l"], ["l", "s"], ["l", "a"], ["s", "a"]],
        "needs exactly one exit edge to a node outside its body, found 2 ('a', 's')",
    ),
    (
        "loop with no exit",
        [gen("g"), loop("l", ["g2"]), gen("g2"), agg("a")],
        [["g", "l"], ["l", "g2"], ["g2", "l"], ["g", "a"]],
        "needs exactly one exit edge to a node outside its body, found 0",
    ),
    (
        "edge leaving the loop body",
        [gen("g"), loop("l", ["g2", "s"]), gen("g2"), score("s"), agg("a")],
        [["g", "l"], ["l", "g2"], ["g2", "s"], ["s", "l"], ["g2", "a"], ["l", "a"]],
        "edge 'g2' -> 'a' leaves the loop body",
    ),
    (
        "edge entering the loop body from outside",
        [gen("g"), loop("l", ["g2", "s"]), gen("g2"), score("s"), agg("a")],
        [["g", "l"], ["g", "s"], ["l", "g2"], ["g2", "s"], ["s", "l"], ["l", "a"]],
        "edge 'g' -> 's' enters the loop body from outside",
    ),
    (
        "nested loops",
        [gen("g"), loop("outer", ["inner"]), loop("inner", ["g2"]), gen("g2"), agg("a")],
        [
            ["g", "outer"],
            ["outer", "inner"],
            ["inner", "g2"],
            ["g2", "inner"],
            ["inner", "outer"],
            ["outer", "a"],
        ],
        "nested loops are not supported",
    ),
    (
        "loop body without a generate",
        [gen("g"), loop("l", ["s"]), score("s"), agg("a")],
        [["g", "l"], ["l", "s"], ["s", "l"], ["l", "a"]],
        "body has no generate node",
    ),
    (
        "node in two loop bodies",
        [gen("g"), loop("l1", ["g2"]), loop("l2", ["g2"]), gen("g2"), agg("a")],
        [["g", "l1"], ["l1", "g2"], ["g2", "l1"], ["l1", "l2"], ["l2", "g2"], ["g2", "l2"], ["l2", "a"]],
        "'g2' is already in the body of loop 'l1'",
    ),
    (
        "select in loop body scored only by a later body node",
        [gen("g"), loop("l", ["x", "g2", "s"]), select("x"), gen("g2"), score("s"), agg("a")],
        [["g", "l"], ["l", "x"], ["x", "g2"], ["g2", "s"], ["s", "l"], ["l", "a"]],
        "nodes[2] (select 'x') needs a score node before it",
    ),
]


@pytest.mark.parametrize(
    ("nodes", "edges", "fragment"),
    [case[1:] for case in INVALID_GRAPHS],
    ids=[case[0] for case in INVALID_GRAPHS],
)
def test_invalid_graphs_raise_naming_the_problem(
    nodes: list[dict[str, Any]], edges: list[Any], fragment: str
) -> None:
    with pytest.raises(ValidationError) as excinfo:
        build(nodes, edges)
    assert fragment in str(excinfo.value)


def test_all_flow_problems_reported_together() -> None:
    with pytest.raises(ValidationError) as excinfo:
        build([score("s"), select("x"), gen("g")], [["s", "x"], ["x", "g"]])
    message = str(excinfo.value)
    assert "must be a generate node" in message
    assert "exactly one aggregate node is required, found 0" in message
    assert "(score 's') needs a generate node" in message


# ----------------------------------------------------------------------------------------------
# compilation
# ----------------------------------------------------------------------------------------------


def test_loop_graph_compiles_to_loop_step() -> None:
    plan = step_search().compile()
    assert plan.strategy == "step_search"
    assert [type(s) for s in plan.steps] == [OpStep, LoopStep, OpStep]
    loop_step = plan.steps[1]
    assert isinstance(loop_step, LoopStep)
    assert loop_step.node.id == "beam"
    assert loop_step.node.max_iterations == 12
    assert [s.node.id for s in loop_step.body] == ["expand", "judge_step", "prune"]
    assert [type(s.node) for s in loop_step.body] == [GenerateNode, ScoreNode, SelectNode]
    assert plan_ids(plan) == ["first", "beam", "expand", "judge_step", "prune", "vote"]


def test_compile_is_deterministic_and_pure() -> None:
    strategy = step_search()
    before = strategy.model_dump()
    assert strategy.compile() == strategy.compile()
    assert strategy.model_dump() == before


def test_compile_breaks_ties_by_listing_order() -> None:
    # Two independent scorers between generate and aggregate: either order is topological, the
    # plan must follow the order in which the author listed them.
    nodes = [gen("g"), score("s2", verifier="b"), score("s1", verifier="a"), agg("a")]
    edges = [["g", "s1"], ["g", "s2"], ["s1", "a"], ["s2", "a"]]
    assert plan_ids(build(nodes, edges).compile()) == ["g", "s2", "s1", "a"]


def test_plan_is_frozen_and_round_trips() -> None:
    plan = step_search().compile()
    with pytest.raises(ValidationError):
        plan.strategy = "other"  # type: ignore[misc]
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_plan_step_invariants() -> None:
    with pytest.raises(ValidationError, match="must be compiled to a LoopStep"):
        OpStep(node=LoopNode(id="l", body=["g"], max_iterations=2))
    with pytest.raises(ValidationError, match="does not match loop"):
        LoopStep(
            node=LoopNode(id="l", body=["g"], max_iterations=2), body=[OpStep(node=GenerateNode(id="h"))]
        )


# ----------------------------------------------------------------------------------------------
# serialisation
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [self_consistency, best_of_n, step_search])
def test_json_and_yaml_round_trips(make: Any) -> None:
    strategy = make()
    assert Strategy.from_json(strategy.to_json()) == strategy
    assert Strategy.from_yaml(strategy.to_yaml()) == strategy
    assert json.loads(strategy.to_json())["nodes"][0]["kind"] == "generate"
    assert yaml.safe_load(strategy.to_yaml())["name"] == strategy.name


def test_yaml_written_by_hand() -> None:
    text = """
name: hand_written
nodes:
  - {kind: generate, id: g, n: 4, step_delimiter: "\\n"}
  - {kind: score, id: s, verifier: math_judge}
  - {kind: select, id: keep, method: threshold, threshold: 0.5}
  - {kind: aggregate, id: vote, method: weighted_majority}
edges:
  - [g, s]
  - [s, keep]
  - {source: keep, target: vote}
"""
    strategy = Strategy.from_yaml(text)
    assert strategy.nodes[0] == GenerateNode(id="g", n=4, step_delimiter="\n")
    assert plan_ids(strategy.compile()) == ["g", "s", "keep", "vote"]
    assert Strategy.from_yaml(strategy.to_yaml()) == strategy


def test_yaml_errors_are_validation_errors() -> None:
    with pytest.raises(ValidationError) as excinfo:
        Strategy.from_yaml(
            "name: x\nnodes:\n  - {kind: generate, id: g, n: 0}\n  - {kind: aggregate, id: a}\n"
        )
    assert excinfo.value.errors()[0]["loc"] == ("nodes", 0, "generate", "n")


# ----------------------------------------------------------------------------------------------
# prebuilt strategies
# ----------------------------------------------------------------------------------------------


def test_self_consistency_shape() -> None:
    s = self_consistency(n=5, temperature=0.9, stop=["\nQ:"], aggregate="weighted_majority", seed=3)
    plan = s.compile()
    assert [type(n) for n in plan.nodes()] == [GenerateNode, AggregateNode]
    g, a = list(plan.nodes())
    assert isinstance(g, GenerateNode) and isinstance(a, AggregateNode)
    assert (g.n, g.temperature, g.top_p, g.stop, g.seed) == (5, 0.9, 0.95, ["\nQ:"], 3)
    assert a.method == "weighted_majority"


def test_best_of_n_shape() -> None:
    s = best_of_n(n=6, verifier="math_judge", extractor="boxed")
    nodes = list(s.compile().nodes())
    assert [type(n) for n in nodes] == [GenerateNode, ScoreNode, SelectNode, AggregateNode]
    _, sc, sel, a = nodes
    assert isinstance(sc, ScoreNode) and (sc.verifier, sc.target) == ("math_judge", "answer")
    assert isinstance(sel, SelectNode) and (sel.method, sel.k) == ("top_k", 1)
    assert isinstance(a, AggregateNode) and (a.method, a.extractor) == ("best_score", "boxed")


@pytest.mark.parametrize("make", [self_consistency, best_of_n])
@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"n": 0}, "n", "greater than or equal to 1"),
        ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
        ({"top_p": 0.0}, "top_p", "greater than 0"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ],
)
def test_prebuilt_invalid_arguments(make: Any, kwargs: dict[str, Any], field: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as excinfo:
        make(**kwargs)
    errors = excinfo.value.errors()
    assert errors[0]["loc"] == (field,)
    assert fragment in errors[0]["msg"]


# ----------------------------------------------------------------------------------------------
# property-based tests
# ----------------------------------------------------------------------------------------------

ids_st = st.from_regex(r"[A-Za-z_][A-Za-z0-9_\-]{0,12}", fullmatch=True)

generate_params = st.fixed_dictionaries(
    {},
    optional={
        "n": st.integers(1, 4096),
        "temperature": st.floats(0, 5),
        "top_p": st.floats(0, 1, exclude_min=True),
        "max_tokens": st.integers(1, 131072),
        "stop": st.lists(TEXT(min_size=1, max_size=5), max_size=3),
        "until": st.sampled_from(["answer", "step"]),
        "step_delimiter": TEXT(min_size=1, max_size=4),
        "seed": st.none() | st.integers(0, MAX_SEED),
    },
)
score_params = st.fixed_dictionaries(
    {}, optional={"verifier": TEXT(min_size=1, max_size=10), "target": st.sampled_from(["answer", "step"])}
)
select_params = st.one_of(
    st.fixed_dictionaries({"method": st.just("top_k"), "k": st.integers(1, 64)}),
    st.fixed_dictionaries({"method": st.just("threshold"), "threshold": st.floats(0, 1)}),
)
aggregate_params = st.fixed_dictionaries(
    {},
    optional={
        "method": st.sampled_from(["majority", "weighted_majority", "best_score"]),
        "extractor": TEXT(min_size=1, max_size=10),
    },
)
loop_params = st.fixed_dictionaries(
    {"max_iterations": st.integers(1, 10000)},
    optional={"until": st.sampled_from(["all_finished", "max_iterations"])},
)

# Segments that may follow the initial generate; a segment is a list of node kinds in run order.
SEGMENTS: list[list[str]] = [["generate"], ["score"], ["score", "select"], ["loop"]]
# Loop bodies that are valid wherever they appear (a select is always preceded by a score).
LOOP_BODIES: list[list[str]] = [["generate"], ["generate", "score"], ["generate", "score", "select"]]


@st.composite
def chain_strategies(draw: st.DrawFn) -> tuple[dict[str, Any], list[str], list[str]]:
    """Draw a valid chain strategy as raw data.

    Returns ``(data, run_order, top_level)``: the dict to validate, the expected flattened
    plan order (loop node before its body) and the ids not inside any loop body.
    """
    layout: list[tuple[str, list[str] | None]] = [("generate", None)]
    for segment in draw(st.lists(st.sampled_from(SEGMENTS), max_size=5)):
        for kind in segment:
            layout.append((kind, draw(st.sampled_from(LOOP_BODIES)) if kind == "loop" else None))
    layout.append(("aggregate", None))
    total = len(layout) + sum(len(body) for _, body in layout if body)
    ids = iter(draw(st.lists(ids_st, min_size=total, max_size=total, unique=True)))

    params = {
        "generate": generate_params,
        "score": score_params,
        "select": select_params,
        "aggregate": aggregate_params,
    }
    nodes: list[dict[str, Any]] = []
    edges: list[tuple[str, str]] = []
    run_order: list[str] = []
    top_level: list[str] = []
    prev: str | None = None
    for kind, body_kinds in layout:
        node_id = next(ids)
        if prev is not None:
            edges.append((prev, node_id))
        run_order.append(node_id)
        top_level.append(node_id)
        if body_kinds is None:
            nodes.append({"kind": kind, "id": node_id, **draw(params[kind])})
        else:
            body_ids = [next(ids) for _ in body_kinds]
            nodes.append({"kind": "loop", "id": node_id, "body": body_ids, **draw(loop_params)})
            for body_kind, body_id in zip(body_kinds, body_ids, strict=True):
                nodes.append({"kind": body_kind, "id": body_id, **draw(params[body_kind])})
            cycle = [node_id, *body_ids, node_id]
            edges.extend(pairwise(cycle))
            run_order.extend(body_ids)
        prev = node_id

    # Listing order of nodes and edges is irrelevant to validity; shuffle both, and write some
    # edges in the YAML-friendly list form.
    nodes = draw(st.permutations(nodes))
    edge_data: list[Any] = [
        list(e) if draw(st.booleans()) else {"source": e[0], "target": e[1]}
        for e in draw(st.permutations(edges))
    ]
    data = {"name": draw(TEXT(min_size=1, max_size=10)), "nodes": nodes, "edges": edge_data}
    return data, run_order, top_level


@FAST
@given(chain_strategies())
def test_random_valid_chains_compile_and_round_trip(
    drawn: tuple[dict[str, Any], list[str], list[str]],
) -> None:
    data, run_order, _ = drawn
    strategy = Strategy.model_validate(data)
    plan = strategy.compile()
    # A chain is a total order, so the plan order is forced.
    assert plan_ids(plan) == run_order
    assert sorted(plan_ids(plan)) == sorted(n.id for n in strategy.nodes)
    assert strategy.compile() == plan
    assert Strategy.from_json(strategy.to_json()) == strategy
    assert Strategy.from_yaml(strategy.to_yaml()) == strategy
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


OUT_OF_RANGE: dict[tuple[str, str], st.SearchStrategy[Any]] = {
    ("generate", "n"): st.integers(max_value=0) | st.integers(min_value=4097),
    ("generate", "temperature"): st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=5, exclude_min=True),
    ("generate", "top_p"): st.floats(max_value=0) | st.floats(min_value=1, exclude_min=True),
    ("generate", "max_tokens"): st.integers(max_value=0) | st.integers(min_value=131073),
    ("select", "k"): st.integers(max_value=0),
    ("select", "threshold"): st.floats(max_value=0, exclude_max=True)
    | st.floats(min_value=1, exclude_min=True),
    ("loop", "max_iterations"): st.integers(max_value=0) | st.integers(min_value=10001),
}


@FAST
@given(chain_strategies(), st.sampled_from(sorted(OUT_OF_RANGE)), st.data())
def test_random_out_of_range_parameters_fail_naming_field(
    drawn: tuple[dict[str, Any], list[str], list[str]], target: tuple[str, str], data: st.DataObject
) -> None:
    strategy_data, _, _ = drawn
    kind, field = target
    # Field constraints fail before a node's own model validator runs, so any node of the right
    # kind works (e.g. a bad threshold on a top_k select still reports only the range).
    candidates = [i for i, n in enumerate(strategy_data["nodes"]) if n["kind"] == kind]
    if not candidates:
        # The drawn chain has no such node: put one in a fresh minimal graph instead.
        base = {"generate": gen("g"), "select": select("x", method="threshold", threshold=0.5)}.get(kind)
        if kind == "loop":
            strategy_data = {
                "name": "t",
                "nodes": [gen("g"), loop("l", ["g2"]), gen("g2"), agg("a")],
                "edges": [["g", "l"], ["l", "g2"], ["g2", "l"], ["l", "a"]],
            }
            candidates = [1]
        else:
            assert base is not None
            strategy_data = {
                "name": "t",
                "nodes": [gen("g0"), score("s"), base, agg("a")],
                "edges": chain_edges("g0", "s", base["id"], "a"),
            }
            candidates = [2]
    index = data.draw(st.sampled_from(candidates))
    bad = data.draw(OUT_OF_RANGE[target])
    strategy_data["nodes"][index] = {**strategy_data["nodes"][index], field: bad}

    with pytest.raises(ValidationError) as excinfo:
        Strategy.model_validate(strategy_data)
    errors = excinfo.value.errors()
    assert len(errors) == 1
    assert errors[0]["loc"] == ("nodes", index, kind, field)
    assert any(word in errors[0]["msg"] for word in ("greater than", "less than"))
    assert f"nodes.{index}.{kind}.{field}" in str(excinfo.value)


@FAST
@given(chain_strategies(), st.data())
def test_random_cycles_without_loop_node_fail(
    drawn: tuple[dict[str, Any], list[str], list[str]], data: st.DataObject
) -> None:
    strategy_data, _, top_level = drawn
    # Any edge from a node back to itself or to an earlier top-level node closes a cycle that
    # does not pass through a loop node's body chain.
    j = data.draw(st.integers(0, len(top_level) - 1))
    i = data.draw(st.integers(0, j))
    source, target = top_level[j], top_level[i]
    strategy_data["edges"].insert(data.draw(st.integers(0, len(strategy_data["edges"]))), [source, target])

    with pytest.raises(ValidationError) as excinfo:
        Strategy.model_validate(strategy_data)
    message = str(excinfo.value)
    assert "cycle that does not go through a loop node" in message
    assert repr(source) in message and repr(target) in message


# ----------------------------------------------------------------------------------------------
# dependency hygiene
# ----------------------------------------------------------------------------------------------


def test_import_does_not_pull_in_torch() -> None:
    code = (
        "import sys, branchwise.strategies as s; s.best_of_n().compile(); "
        "bad = sorted(m for m in ('torch', 'transformers') if m in sys.modules); "
        "print(','.join(bad))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_strategies_only_import_light_dependencies() -> None:
    # Static check so the guarantee does not depend on what branchwise/__init__.py happens to do:
    # the layer may import the stdlib, pydantic (and its core), networkx, yaml, itself, and the
    # neutral description of typed output (branchwise.constraints, which needs only jsonschema,
    # branchwise.toolcalls and the stdlib-only schema measures schema_limits, schema_budget and pattern_limits),
    # nothing else.
    allowed = {"pydantic", "pydantic_core", "networkx", "yaml", *sys.stdlib_module_names}
    neutral = {
        "branchwise.constraints",
        "branchwise.toolcalls",
        "branchwise.schema_limits",
        "branchwise.schema_budget",
        "branchwise.pattern_limits",
    }
    files = sorted(STRATEGIES_DIR.glob("*.py"))
    files += [REPO_ROOT / "branchwise" / f"{m.split('.')[1]}.py" for m in sorted(neutral)]
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    continue  # relative: within branchwise.strategies
                names = [node.module or ""]
            else:
                continue
            for name in names:
                ok = (
                    name.split(".")[0] in allowed
                    or name in neutral
                    or name.startswith("branchwise.strategies")
                )
                ok = ok or (path.stem in ("constraints", "toolcalls") and name == "jsonschema")
                assert ok, f"{path.name} imports {name!r}"
