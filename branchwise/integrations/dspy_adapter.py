"""`LenientChatAdapter`: DSPy's `ChatAdapter` made to work with small models, whatever the program.

Why its own module: it works with any DSPy LM, not only the plug-in's (a model behind `dspy.LM` that
misses the ``[[ ## field ## ]]`` markers gains from it too), and `Reason` uses it as its default
parser; it depends on neither LM, so it sits beside them rather than inside one. Users import it
from `branchwise.integrations.dspy`.

Two ways it keeps a small model's reply parseable:

* **Typed signatures are decoded under their JSON Schema.** When any output field is not plain
  ``str`` (``answer: int``, a pydantic model, ``Literal``, ``dict`` — `dspy.ReAct`'s step signature
  is one) and the LM takes a ``response_format`` with a schema (both branchwise LMs do), the call
  goes through `dspy.JSONAdapter`'s prompt and parser with a schema built here from the signature's
  output fields: every field required, in order, no other key. The backend's grammar forces the
  reply into that shape, so it cannot fail to parse (short of ``max_tokens`` cutting it; the local
  backend fits free-text fields to the budget where the schema allows). `dspy.ReAct`'s step is further
  narrowed to one alternative per tool: ``next_tool_name`` is that tool's name and
  ``next_tool_args`` must be valid arguments of it — the model cannot call an unknown tool or call a
  known one with a wrong shape. Signatures with a `dspy.ToolCalls` output use native function
  calling (the tools go to the LM as ``tools``; the calls are forced to be valid).
* **Text signatures are salvaged.** All-``str`` outputs keep `ChatAdapter`'s text format (a small
  model writes better prose unconstrained); a reply without the markers is not an error: the last
  field (the answer) is taken from `extract_answer` or the last line, other fields from the text.

And one way it keeps an agent from looping: a `dspy.ReAct` step that repeats a call its trajectory
already holds (same tool, same arguments) finishes instead (`_end_repeated_calls`).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Literal, get_args, get_origin

import dspy
import pydantic
from dspy.utils.exceptions import AdapterParseError

from branchwise.reasoners.answers import extract_answer
from branchwise.toolcalls import canonical_json

__all__ = ["LenientChatAdapter", "signature_schema"]

ConstrainMode = Literal["typed", "always", "never"]

# DSPy's ReAct step signature: next_thought, then the tool's name (a Literal of the tools), then
# its arguments; the tools are listed in the instructions as "(i) <Tool.__str__>".
_REACT_FIELDS = ("next_thought", "next_tool_name", "next_tool_args")
_TOOL_LINE = re.compile(
    r"^\(\d+\) (?P<name>.+?)(?:, whose description is <desc>.*</desc>\.|\.) It takes arguments (?P<args>\{.*\})\.$"
)


def _free_text(completion: str) -> str:
    """The completion without ChatAdapter section headers."""
    return re.sub(r"\[\[ ## \w+ ## \]\]", "", completion).strip()


def _is_tool_calls(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, dspy.ToolCalls)


def _typed(signature: Any) -> bool:
    return any(field.annotation is not str for field in signature.output_fields.values())


# ---------------------------------------------------------------------------------------- schemas
def _close_objects(node: Any) -> None:
    """Every object with named properties requires all of them and takes no other key (OpenAI's
    strict shape), so the grammar cannot skip a field DSPy's parser needs."""
    if isinstance(node, dict):
        if isinstance(node.get("properties"), dict):
            node["required"] = list(node["properties"])
            node.setdefault("additionalProperties", False)
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_objects(value)


def _react_alternatives(signature: Any, thought: dict[str, Any]) -> list[dict[str, Any]] | None:
    """One object schema per tool of a `dspy.ReAct` step, read back from the tool lines ReAct writes
    into its instructions (``Tool.__str__``); None when the instructions do not list every tool."""
    names = get_args(signature.output_fields["next_tool_name"].annotation)
    if not names or not all(isinstance(n, str) for n in names):
        return None
    found: dict[str, dict[str, Any]] = {}
    for line in (signature.instructions or "").splitlines():
        match = _TOOL_LINE.match(line.strip())
        if match is None or match["name"] not in names:
            continue
        try:
            args = ast.literal_eval(match["args"])
        except (ValueError, SyntaxError):
            return None
        if not isinstance(args, dict):
            return None
        found[match["name"]] = {
            "type": "object",
            "properties": args,
            "required": [k for k, v in args.items() if not (isinstance(v, dict) and "default" in v)],
            "additionalProperties": False,
        }
    if set(found) != set(names):
        return None
    return [
        {
            "type": "object",
            "properties": {
                "next_thought": dict(thought),
                "next_tool_name": {"type": "string", "enum": [name]},
                "next_tool_args": found[name],
            },
            "required": list(_REACT_FIELDS),
            "additionalProperties": False,
        }
        for name in names
    ]


def signature_schema(signature: Any) -> dict[str, Any] | None:
    """The JSON Schema a reply to `signature` must follow: one object with every output field, in
    order, required, and no other key; None when a field has no JSON Schema (DSPy's special types).

    Unlike `dspy.JSONAdapter`'s own schema this keeps open mappings (``dict[str, Any]`` is any JSON
    object, not a refusal that falls back to unconstrained JSON) and turns `dspy.ReAct`'s step into one alternative per tool with that tool's argument schema.
    `dspy.ToolCalls` fields are left out (they go as native tool calls).
    """
    fields: dict[str, Any] = {}
    for name, field in signature.output_fields.items():
        if _is_tool_calls(field.annotation):
            continue
        fields[name] = (field.annotation, ...)
    if not fields:
        return None
    try:
        model = pydantic.create_model(
            "DSPyProgramOutputs", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
        schema: dict[str, Any] = model.model_json_schema()
    except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticInvalidForJsonSchema, TypeError):
        return None
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        if isinstance(prop, dict):
            prop.pop("title", None)
    _close_objects(schema)
    if (
        tuple(signature.output_fields) == _REACT_FIELDS
        and get_origin(signature.output_fields["next_tool_name"].annotation) is Literal
    ):
        alternatives = _react_alternatives(signature, schema["properties"]["next_thought"])
        if alternatives is not None:
            schema = {"anyOf": alternatives, **({"$defs": schema["$defs"]} if "$defs" in schema else {})}
    return schema


_TRAJECTORY_CALL = re.compile(
    r"\[\[ ## tool_name_(\d+) ## \]\]\n(?P<name>.*?)\n\n\[\[ ## tool_args_\1 ## \]\]\n(?P<args>.*?)(?:\n\n\[\[ ## |\Z)",
    re.S,
)


def _canonical(args: Any) -> str:
    """Tool arguments as one comparable string (a dict, or its JSON or Python text), as the
    project compares calls everywhere (`canonical_json`: sorted keys, 2.0 written as 2); a value
    JSON cannot write (a Python set read from the text) by its repr."""
    if isinstance(args, str):
        for read in (json.loads, ast.literal_eval):
            try:
                args = read(args)
                break
            except (ValueError, SyntaxError):
                continue
    try:
        return canonical_json(args)
    except TypeError:
        return repr(args)


def _end_repeated_calls(signature: Any, inputs: dict[str, Any], outputs: list[dict[str, Any]]) -> None:
    """A `dspy.ReAct` step that calls a tool with arguments it was already called with (its
    trajectory, as DSPy formats it, holds the call) finishes instead, in place.

    Why: a small model repeats a call it has made (``add(44, 44)``, then again) until the loop's 20
    iterations run out, each a full step. The repeat cannot tell it anything new, so the loop ends
    with what was gathered, and the thought says why (LangChain's agents are ended the same way,
    `ChatBranchwise`'s ``repeated_calls``)."""
    if tuple(signature.output_fields) != _REACT_FIELDS or not isinstance(inputs.get("trajectory"), str):
        return
    made = {
        (m.group("name").strip(), _canonical(m.group("args").strip()))
        for m in _TRAJECTORY_CALL.finditer(inputs["trajectory"])
    }
    for out in outputs:
        name, args = out.get("next_tool_name"), out.get("next_tool_args")
        if name == "finish" or (name, _canonical(args)) not in made:
            continue
        shown = json.dumps(args, default=str)
        out["next_thought"] = (
            f"{out.get('next_thought', '')} [{name} was called with {shown} before; the loop finishes "
            "with what was gathered]"
        ).strip()
        out["next_tool_name"], out["next_tool_args"] = "finish", {}


# ---------------------------------------------------------------------------------------- adapters
class _SchemaAdapter(dspy.JSONAdapter):
    """`dspy.JSONAdapter` whose ``response_format`` is `signature_schema` (strict), so the backend's
    grammar forces the reply into the signature's fields."""

    def _prepare_response_format(self, lm: Any, lm_kwargs: dict[str, Any], signature: Any) -> None:
        schema = signature_schema(signature)
        if schema is None:
            super()._prepare_response_format(lm, lm_kwargs, signature)
            return
        lm_kwargs["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "DSPyProgramOutputs", "schema": schema, "strict": True},
        }


class LenientChatAdapter(dspy.ChatAdapter):
    """`dspy.ChatAdapter` that a small model's reply cannot defeat.

    Typed signatures (any output field other than ``str``; `dspy.ReAct`'s steps) are decoded under
    their JSON Schema on an LM that takes one (`signature_schema`; see the module docstring), so the
    reply parses by construction. All-``str`` signatures keep the ``[[ ## field ## ]]`` text format
    and salvage replies that ignore it: missing fields are filled from the free text (the last
    output field from `extract_answer` or the last line, other text fields from the whole reply).
    Programs stay unchanged; only ``dspy.configure(adapter=LenientChatAdapter())`` differs.

    Args:
        constrain: ``"typed"`` (default) decodes typed signatures under their schema;
            ``"always"`` does so for every signature; ``"never"`` keeps the text format throughout
            (a typed field that cannot be salvaged then raises `AdapterParseError`).
    """

    def __init__(self, *, constrain: ConstrainMode = "typed", **kwargs: Any) -> None:
        if constrain not in ("typed", "always", "never"):
            raise ValueError(f"constrain: expected 'typed', 'always' or 'never', got {constrain!r}")
        kwargs.setdefault("use_json_adapter_fallback", False)
        super().__init__(**kwargs)
        self.constrain: ConstrainMode = constrain
        self._schema_adapter = _SchemaAdapter(callbacks=kwargs.get("callbacks"))

    def _constrained(self, lm: Any, signature: Any) -> bool:
        """Whether this call goes through the schema path (see the class docstring)."""
        if self.constrain == "never" or (self.constrain == "typed" and not _typed(signature)):
            return False
        if "response_format" not in getattr(lm, "supported_params", ()):
            return False
        return bool(getattr(lm, "supports_response_schema", False))

    def __call__(
        self, lm: Any, lm_kwargs: dict[str, Any], signature: Any, demos: list[Any], inputs: dict[str, Any]
    ) -> list[dict[str, Any]]:
        if self._constrained(lm, signature):
            outputs = self._schema_adapter(lm, lm_kwargs, signature, demos, inputs)
        else:
            outputs = super().__call__(lm, lm_kwargs, signature, demos, inputs)
        _end_repeated_calls(signature, inputs, outputs)
        return outputs

    async def acall(
        self, lm: Any, lm_kwargs: dict[str, Any], signature: Any, demos: list[Any], inputs: dict[str, Any]
    ) -> list[dict[str, Any]]:
        if self._constrained(lm, signature):
            outputs = await self._schema_adapter.acall(lm, lm_kwargs, signature, demos, inputs)
        else:
            outputs = await super().acall(lm, lm_kwargs, signature, demos, inputs)
        _end_repeated_calls(signature, inputs, outputs)
        return outputs

    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        stripped = completion.strip()
        if stripped.startswith("{") and _typed(signature):  # a schema-constrained reply (or a JSON one)
            try:
                return self._schema_adapter.parse(signature, stripped)
            except AdapterParseError:
                pass
        try:
            return super().parse(signature, completion)
        except AdapterParseError as err:
            from dspy.adapters.utils import parse_value

            fields = dict(err.parsed_result or {})
            text = _free_text(completion)
            names = list(signature.output_fields)
            for name in names:
                if name in fields:
                    continue
                info = signature.output_fields[name]
                if name == names[-1]:
                    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
                    raw = extract_answer(text) or (lines[-1] if lines else "")
                else:
                    raw = text
                try:
                    fields[name] = parse_value(raw, info.annotation)
                except (ValueError, TypeError):
                    raise err from None
            return fields
