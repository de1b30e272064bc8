"""Hostile strategy files: whatever the bytes, parsing and compiling fails only with a validation error.

Each case takes a prebuilt strategy, mutates its document (drops keys, swaps in values of the wrong
type or range, lone surrogates, huge integers), serialises it as JSON or YAML, and optionally
corrupts the text itself (truncation, stray YAML syntax, NUL bytes, undefined aliases). The only
acceptable failure is a ``pydantic.ValidationError``: a raw parser exception or a crash in
``compile()``/``to_json()`` is a bug a user would meet as a traceback.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from branchwise.strategies import PREBUILT, Strategy

BASES = [json.loads(p().to_json()) for p in PREBUILT.values()]
VALUES: list[Any] = [
    None, 0, -1, 1, 2**70, -(2**70), 1.5, float("nan"), float("inf"), "", "x", "\ud800", "\n", True,
    [], {}, [1, 2], {"a": 1}, "generate", "loop", "a b", "é", 10**30,
]  # fmt: skip
TEXT_NOISE = [":", "-", "[", "{", "}", "\t", "'", '"', "\\", "&a", "*a", "!!python/object", "\x00", "\ud800", "%", "\n  ", "? "]  # fmt: skip


def _mutate(obj: Any, r: random.Random) -> None:
    if isinstance(obj, dict) and obj:
        key, op = r.choice(list(obj)), r.random()
        if op < 0.25:
            del obj[key]
        elif op < 0.6:
            obj[key] = copy.deepcopy(r.choice(VALUES))
        elif op < 0.7:
            obj[r.choice(["extra", "kind", "id", "n", "body", "seed", "stop"])] = copy.deepcopy(
                r.choice(VALUES)
            )
        else:
            _mutate(obj[key], r)
    elif isinstance(obj, list) and obj:
        i, op = r.randrange(len(obj)), r.random()
        if op < 0.3:
            del obj[i]
        elif op < 0.5:
            obj[i] = copy.deepcopy(r.choice(VALUES))
        elif op < 0.6:
            obj.append(copy.deepcopy(r.choice(obj)))
        else:
            _mutate(obj[i], r)


def _corrupt(text: str, r: random.Random) -> str:
    for _ in range(r.randint(1, 3)):
        i, op = r.randrange(len(text) + 1), r.random()
        if op < 0.3:
            text = text[:i] + text[i + r.randint(1, 20) :]
        elif op < 0.6:
            text = text[:i] + r.choice(TEXT_NOISE) + text[i:]
        else:
            text = text[:i]
    return text


@seed(20261123)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.randoms(use_true_random=False), st.sampled_from(["json", "yaml"]), st.booleans())
def test_mutated_specs_fail_only_with_validation_errors(r: random.Random, fmt: str, corrupt: bool) -> None:
    doc = copy.deepcopy(r.choice(BASES))
    for _ in range(r.randint(1, 4)):
        _mutate(doc, r)
    text = json.dumps(doc) if fmt == "json" else yaml.safe_dump(doc, allow_unicode=True)
    if corrupt:
        text = _corrupt(text, r)
    try:
        strategy = Strategy.from_json(text) if fmt == "json" else Strategy.from_yaml(text)
        strategy.compile()
    except ValidationError:
        return
    # Whatever was accepted must serialise and load back to the same strategy.
    assert Strategy.from_json(strategy.to_json()) == strategy
    assert Strategy.from_yaml(strategy.to_yaml()) == strategy


def test_yaml_errors_name_the_position() -> None:
    for text, expected in [
        ("name: x\nnodes: [\n", "invalid YAML at line 3"),
        ("", "found an empty document"),
        ("- a\n- b\n", "found a list"),
        ("name: *missing\n", "invalid YAML at line 1, column 7"),
    ]:
        try:
            Strategy.from_yaml(text)
        except ValidationError as err:
            assert expected in str(err), str(err)
        else:
            raise AssertionError(f"{text!r} was accepted")


def test_lone_surrogate_is_rejected_with_its_field() -> None:
    doc = json.loads(PREBUILT["self-consistency"]().to_json())
    doc["nodes"][0]["stop"] = ["ok", "\ud800"]
    try:
        Strategy.model_validate(doc)
    except ValidationError as err:
        assert err.errors()[0]["loc"] == ("nodes", 0, "generate", "stop")
        assert "surrogate" in str(err)
    else:
        raise AssertionError("a lone surrogate in a stop string was accepted")
