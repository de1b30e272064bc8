"""Constrained decoding in the decode loop: a random tiny model writes only what its grammar allows,
free rows of the same batch are untouched, and a grammar that admits nothing ends its row cleanly."""

from __future__ import annotations

import json

import jsonschema
import pytest

from branchwise.backends.base import DecodeParams
from branchwise.constraints import Constraint, ConstraintError
from branchwise.toolcalls import normalize_tools, parse_tool_calls, valid_arguments

SCHEMA = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["x", "ok"],
    "additionalProperties": False,
}
TOOLS = normalize_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        },
        {"type": "function", "function": {"name": "noop"}},
    ]
)


def _decode(backend, constraint, n=4, *, constraints=None, share="exact", **params):
    root = backend.prefill(backend.chat_prompt([{"role": "user", "content": "hello there"}]))
    kids = backend.fork(root, n, share=share)
    defaults = {"temperature": 1.0, "seed": 3, "max_tokens": 96}
    gens = backend.extend(
        kids, DecodeParams(**{**defaults, **params}, constraint=constraint), constraints=constraints
    )
    backend.release([*kids, root])
    return gens


def test_json_schema_rows_validate(tiny_backend) -> None:
    c = Constraint.of_json_schema(SCHEMA)
    for g in _decode(tiny_backend, c):
        assert g.finish_reason == "eos", g.text
        jsonschema.validate(json.loads(g.text), SCHEMA)
        assert c.parse(g.text) == json.loads(g.text)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint.of_json_object(), lambda t: isinstance(json.loads(t), dict)),
        (Constraint.of_regex(r"[0-9]{3}-[a-c]+"), None),
        (
            Constraint.of_choice(["alpha", "beta", "gamma delta"]),
            lambda t: t in ("alpha", "beta", "gamma delta"),
        ),
    ],
)
def test_each_kind_holds_under_sampling(tiny_backend, constraint, check) -> None:
    for g in _decode(tiny_backend, constraint, max_tokens=200):
        if constraint.kind == "json_object" and g.finish_reason == "length":
            continue  # a random model may nest JSON past max_tokens; what it wrote is still a JSON prefix
        assert g.finish_reason == "eos", g.text
        constraint.parse(g.text)  # raises OutputError when the text is not what was asked
        if check is not None:
            assert check(g.text)


@pytest.mark.parametrize("choice", ["required", "add"])
def test_tool_calls_are_forced_and_valid(tiny_backend, choice) -> None:
    c = Constraint.of_tools(TOOLS, choice, parallel_tool_calls=False)
    # a random model pads JSON with whitespace the grammar allows (as vLLM's does): room for it
    for g in _decode(tiny_backend, c, max_tokens=400):
        assert g.finish_reason == "eos", g.text
        prose, calls = parse_tool_calls(g.text, TOOLS)
        assert prose == "" and len(calls) == 1
        assert valid_arguments(calls[0], TOOLS)
        if choice == "add":
            assert calls[0].name == "add"
        assert c.parse(g.text)[0].name == calls[0].name


def test_free_rows_of_a_mixed_batch_are_untouched(tiny_backend) -> None:
    """Greedy: a batch of [constrained, free, constrained] gives the free row exactly the tokens it
    gets in a batch with no constraint at all (the mask touches only its own rows)."""
    free = _decode(tiny_backend, None, n=3, temperature=0.0, max_tokens=24)
    c = Constraint.of_choice(["yes", "no"])
    mixed = _decode(tiny_backend, None, n=3, constraints=[c, None, c], temperature=0.0, max_tokens=24)
    assert mixed[1].token_ids == free[1].token_ids
    assert mixed[0].text in ("yes", "no") and mixed[2].text in ("yes", "no")
    assert mixed[0].finish_reason == "eos"


def test_constrained_greedy_is_the_same_shared_or_not(tiny_backend) -> None:
    c = Constraint.of_json_schema(SCHEMA)
    exact = _decode(tiny_backend, c, temperature=0.0, share="exact")
    none = _decode(tiny_backend, c, temperature=0.0, share="none")
    assert [g.token_ids for g in exact] == [g.token_ids for g in none]


def test_statistics_are_the_models_own_distribution(tiny_backend) -> None:
    """A mask changes which token is taken, not the reported confidence: logprobs are those of the
    unconstrained model (what CGEE and the server's logprobs read), so they are at most log(top1)."""
    for g in _decode(tiny_backend, Constraint.of_choice(["yes", "no"])):
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert all(0.0 < p <= 1.0 for p in g.top1_probs)


def test_a_grammar_with_no_token_left_ends_its_row(tiny_backend) -> None:
    """After "a" the grammar allows only EOS, which min_tokens masks: nothing is allowed, so the row
    ends with finish_reason "grammar", keeping its text; the free row goes on; no KV is left."""
    before = tiny_backend.kv_stats().bytes_held
    c = Constraint.of_choice(["a"])
    gens = _decode(
        tiny_backend, None, n=2, constraints=[c, None], temperature=0.0, max_tokens=12, min_tokens=5
    )
    assert gens[0].finish_reason == "grammar" and gens[0].text == "a"
    assert gens[1].finish_reason == "length" and len(gens[1].token_ids) == 12
    assert tiny_backend.kv_stats().bytes_held == before


def test_a_grammar_compiles_once_per_backend(tiny_backend) -> None:
    grammars = tiny_backend.engine.grammars
    c = Constraint.of_regex(r"(yes|no) [0-9]")
    _decode(tiny_backend, c, n=2)
    compiled = grammars.stats.compiled
    _decode(tiny_backend, Constraint.of_regex(r"(yes|no) [0-9]"), n=2)
    assert grammars.stats.compiled == compiled
    assert grammars.stats.cache_hits > 0


def test_an_uncompilable_schema_fails_before_any_work(tiny_backend) -> None:
    """jsonschema accepts a lookbehind pattern; the grammar engine cannot compile it: a ValueError
    naming the field, raised before a row is decoded (nothing held, nothing computed)."""
    c = Constraint.of_json_schema({"type": "string", "pattern": "(?<=a)b"})
    root = tiny_backend.prefill(tiny_backend.chat_prompt([{"role": "user", "content": "hi"}]))
    (kid,) = tiny_backend.fork(root, 1)
    computed = tiny_backend.kv_stats().tokens_computed
    with pytest.raises(ConstraintError, match="json_schema"):
        tiny_backend.extend([kid], DecodeParams(max_tokens=4, constraint=c))
    assert tiny_backend.kv_stats().tokens_computed == computed
    tiny_backend.release([kid, root])


def test_streaming_reports_each_constrained_token_once(tiny_backend) -> None:
    root = tiny_backend.prefill(tiny_backend.chat_prompt([{"role": "user", "content": "hi"}]))
    kids = tiny_backend.fork(root, 2)
    seen: dict[int, list[int]] = {0: [], 1: []}

    def listen(step):
        for row, toks in step.tokens.items():
            seen[row].extend(toks)

    c = Constraint.of_choice(["a"])
    gens = tiny_backend.extend(
        kids, DecodeParams(max_tokens=8, min_tokens=3, temperature=0.0), on_step=listen, constraints=[c, None]
    )
    tiny_backend.release([*kids, root])
    assert seen[0] == gens[0].token_ids and seen[1] == gens[1].token_ids
