"""Tool calls as text: OpenAI tool definitions, the prompt that shows them to a model, the
``<tool_call>`` blocks a model writes, and the canonical form votes compare.

Why one module (no torch): the server, the LangChain and DSPy adapters and the reasoner's votes
over actions all turn OpenAI-shaped tools and messages into a prompt and a reply back into calls;
doing it once keeps the text a model is shown and the text that is parsed in one format.

The format is the Hermes one that Qwen2/2.5/3 and many fine-tunes are trained on::

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

A chat template that renders ``tools`` itself (it mentions ``<tool_call>``) is used as it is; for
any other template the tools are described in a system message (`tool_prompt`) and earlier calls
and tool results are written into the conversation as the same blocks (`render_messages`), so
every model is asked the same way and the grammar (`Constraint.of_tools`) forces the same format.
"""

from __future__ import annotations

import inspect
import json
import re
import typing
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jsonschema
from pydantic import BaseModel, Field, create_model

from branchwise.pattern_limits import PatternSize
from branchwise.schema_limits import SchemaSize, check_tool_count

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ToolCall",
    "ToolCallStream",
    "canonical_arguments",
    "canonical_json",
    "check_json_schema",
    "function_tool",
    "normalize_tool_choice",
    "normalize_tools",
    "parse_tool_calls",
    "render_messages",
    "repeats_a_call",
    "split_calls",
    "template_has_tools",
    "tool_names",
    "tool_prompt",
    "valid_arguments",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _canon(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canon(v) for v in value]
    return value


def canonical_json(value: Any) -> str:
    """A JSON value as canonical text: sorted keys, no spaces, 2.0 written as 2 (votes compare these)."""
    return json.dumps(_canon(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical_arguments(arguments: Mapping[str, Any]) -> str:
    return canonical_json(dict(arguments))


class ToolCall(BaseModel):
    """One call a model asked for: the tool's name and its arguments (already parsed JSON)."""

    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str
    arguments: dict[str, Any]

    def canonical(self) -> str:
        """What two calls must share to count as the same action: name + canonical arguments."""
        return f"{self.name}({canonical_arguments(self.arguments)})"

    def openai(self) -> dict[str, Any]:
        """The call in OpenAI's chat-completion shape (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)},
        }


def check_json_schema(
    schema: Any, field: str, size: SchemaSize | None = None, patterns: PatternSize | None = None
) -> dict[str, Any]:
    """`schema` as a dict, or a ValueError naming `field` when it is not a valid JSON Schema or passes
    a limit of `branchwise.schema_limits` (measured first, iteratively: jsonschema's check recurses)
    or of `branchwise.pattern_limits` (its patterns and length bounds, once jsonschema has checked
    that each pattern is a regex); `size` and `patterns` add it to the totals of a constraint's other
    schemas (a tool call constraint's tools)."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        schema = schema.model_json_schema()
    if not isinstance(schema, Mapping):
        raise ValueError(f"{field}: a JSON Schema is an object, got {type(schema).__name__}")
    (size or SchemaSize()).add(schema, field)
    schema = dict(schema)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.path)
        raise ValueError(
            f"{field}: not a valid JSON Schema ({err.message}{' at ' + where if where else ''})"
        ) from None
    # a ``pattern`` the check compiles with Python's `re`, whose parser raises these two past its
    # limits (a repetition count over 2**32 - 1; groups nested past the recursion limit)
    except OverflowError as err:
        raise ValueError(f"{field}: not a valid JSON Schema (a pattern: {err})") from None
    except RecursionError:
        raise ValueError(
            f"{field}: not a valid JSON Schema (a pattern nests its groups too deep for the "
            "regular expression parser)"
        ) from None
    (patterns or PatternSize()).add_schema(schema, field)
    return schema


def function_tool(fn: Any) -> dict[str, Any]:
    """An OpenAI function tool from a Python function (its name, the first paragraph of its
    docstring, a JSON Schema of its parameters from their type hints) or from a pydantic model class
    (the arguments are its fields)."""
    schema: dict[str, Any]
    if isinstance(fn, type) and issubclass(fn, BaseModel):
        name, doc, schema = fn.__name__, fn.__doc__, fn.model_json_schema()
    else:
        name, doc = getattr(fn, "__name__", ""), inspect.getdoc(fn)
        hints = typing.get_type_hints(fn)
        fields: dict[str, Any] = {}
        for pname, p in inspect.signature(fn).parameters.items():
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise ValueError(f"tools: {name} takes *{pname}; a tool's arguments must each be named")
            default = ... if p.default is p.empty else p.default
            fields[pname] = (hints.get(pname, Any), default)
        # two statements: pydantic's mypy plugin names a class after the variable create_model's result
        # is assigned to, so `schema = create_model(...).model_json_schema()` would read as a class
        arguments = create_model(f"{name}_arguments", **fields)
        schema = arguments.model_json_schema()
    schema.pop("title", None)
    entry: dict[str, Any] = {"name": name, "parameters": schema}
    if doc:
        entry["description"] = doc.split("\n\n")[0].strip()
    return {"type": "function", "function": entry}


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI function tools (``{"type": "function", "function": {...}}``, or the bare function
    object) in one shape, each checked: a name of 1-64 letters, digits, ``_.-``, unique, and
    parameters that are a valid JSON Schema object. Errors name ``tools[i]...``."""
    if isinstance(tools, Mapping) or not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ValueError("tools: expected a list of tools")
    check_tool_count(tools)
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    size, patterns = SchemaSize(), PatternSize()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if isinstance(tool, BaseModel):
            tool = tool.model_dump(exclude_none=True)
        if not isinstance(tool, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(tool).__name__}")
        if "function" in tool:
            if tool.get("type", "function") != "function":
                raise ValueError(
                    f"{where}.type: only 'function' tools are supported, got {tool.get('type')!r}"
                )
            fn, where = tool["function"], f"{where}.function"
            if not isinstance(fn, Mapping):
                raise ValueError(f"{where}: expected an object")
        else:
            fn = tool
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{where}.name: 1-64 characters of letters, digits, '_', '.', '-'; got {name!r}")
        if name in seen:
            raise ValueError(f"{where}.name: {name!r} is defined twice")
        seen.add(name)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        params = check_json_schema(params, f"{where}.parameters", size, patterns)
        if params.get("type", "object") != "object":
            raise ValueError(
                f"{where}.parameters.type: a tool's arguments are an object, got {params.get('type')!r}"
            )
        entry: dict[str, Any] = {"name": name, "parameters": params}
        if fn.get("description"):
            entry["description"] = str(fn["description"])
        if fn.get("strict") is not None:
            entry["strict"] = bool(fn["strict"])
        out.append({"type": "function", "function": entry})
    if not out:
        raise ValueError("tools: must not be empty (leave the field out for no tools)")
    return out


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def normalize_tool_choice(choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """``auto`` / ``none`` / ``required`` / a tool's name, from OpenAI's string or
    ``{"type": "function", "function": {"name": ...}}`` (LangChain's ``"any"`` means required)."""
    if choice is None:
        return "auto"
    if isinstance(choice, bool):
        return "required" if choice else "auto"
    names = tool_names(tools)
    if isinstance(choice, Mapping):
        inner = choice.get("function")
        fn = inner if isinstance(inner, Mapping) else choice
        choice = fn.get("name")
        if not isinstance(choice, str):
            raise ValueError("tool_choice: expected {'type': 'function', 'function': {'name': ...}}")
        if choice not in names:
            raise ValueError(f"tool_choice: no tool named {choice!r}; tools are {names}")
        return choice
    if not isinstance(choice, str):
        raise ValueError(f"tool_choice: expected a string or an object, got {type(choice).__name__}")
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required") or choice in names:
        return choice
    raise ValueError(
        f"tool_choice: expected 'auto', 'none', 'required' or a tool's name {names}, got {choice!r}"
    )


def _read_block(body: str, names: set[str] | None) -> ToolCall | None:
    """The call a block's body holds, or None (not JSON, no name, a tool not in `names`, ...)."""
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    name, args = parsed.get("name"), parsed.get("arguments", parsed.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(name, str) or not isinstance(args, dict) or (names is not None and name not in names):
        return None
    return ToolCall(name=name, arguments=args)


def _cut_open_block(text: str, cut: bool, after_call: bool) -> str:
    """`text` (the end of a reply) without a last ``<tool_call>`` block that never closes (a call
    cut by ``max_tokens``), nor an end that is the start of the opening tag itself (``<tool_``)
    where that can only be a call cut before its tag was whole: in a reply `cut` by ``max_tokens``,
    or right after a call (only another call may follow one). Anywhere else such an end is the
    reply's own text (``"a < b and x <t"``, ended by the model)."""
    start = text.rfind(TOOL_CALL_OPEN)
    if start >= 0 and TOOL_CALL_CLOSE not in text[start:]:
        return text[:start]
    partial = _partial_open(text)
    if partial and (cut or (after_call and not text[: len(text) - partial].strip())):
        return text[: len(text) - partial]
    return text


def parse_tool_calls(
    text: str, tools: Sequence[Mapping[str, Any]] = (), *, cut: bool = False
) -> tuple[str, list[ToolCall]]:
    """Split a reply into its prose and its ``<tool_call>`` blocks (`cut`: the reply was cut by
    ``max_tokens``, so an end that starts the opening tag is a call begun, not text).

    A block counts as a call when its body is a JSON object with a ``name`` (of one of `tools`, when
    given) and object ``arguments`` (or ``parameters``); any other closed block stays in the prose,
    as the model wrote it. Two rules end a reply early, so no front end returns (or runs) a call
    twice or shows half a call: a call identical to an earlier one of the same reply (same name,
    same canonical arguments: a small model repeating itself) ends the reply there, and it and all
    after it are dropped; a last block that never closes (cut by ``max_tokens``) is dropped, not
    kept as prose, and so is a last opening tag cut before it was whole (`_cut_open_block` says
    when an end such as ``<t`` is that). The prose is stripped.
    """
    names = set(tool_names(tools)) if tools else None
    calls: list[ToolCall] = []
    seen: set[str] = set()
    kept: list[str] = []
    last = 0
    for m in _BLOCK.finditer(text):
        call = _read_block(m.group(1), names)
        if call is None:
            continue
        kept.append(text[last : m.start()])
        if call.canonical() in seen:  # a repeat ends the reply
            return "".join(kept).strip(), calls
        seen.add(call.canonical())
        last = m.end()
        calls.append(call)
    kept.append(_cut_open_block(text[last:], cut, after_call=bool(calls)))
    return "".join(kept).strip(), calls


def repeats_a_call(text: str, tools: Sequence[Mapping[str, Any]] = ()) -> bool:
    """Whether `text` holds a call identical to an earlier call of it (where `parse_tool_calls`
    ends the reply): the decode loop stops a row there instead of letting it repeat the call until
    ``max_tokens``."""
    if text.count(TOOL_CALL_CLOSE) < 2:
        return False
    names = set(tool_names(tools)) if tools else None
    seen: set[str] = set()
    for m in _BLOCK.finditer(text):
        call = _read_block(m.group(1), names)
        if call is not None:
            if call.canonical() in seen:
                return True
            seen.add(call.canonical())
    return False


class ToolCallStream:
    """A reply's text in, piece by piece; its content (strings) and tool calls out, in order.

    Content is the text outside ``<tool_call>...</tool_call>`` blocks; a block whose body is a call
    of one of `tools` becomes a `ToolCall`, any other closed block stays content as written.
    Whitespace next to a call block (the newlines around it) is not content. Text that might be the
    start of ``<tool_call>`` and whitespace that might precede one are held back until the next
    characters decide, so however the text is cut, the pieces add up to `split_calls` of the whole:
    what a streamed reply releases is what the finished one says.

    `parse_tool_calls`' two rules hold here too: a call identical to an earlier one ends the reply
    (it and all after it are dropped: `repeated`), and a block still open at the end (cut by
    ``max_tokens``) is dropped, not released as content (`cut`), as is an end that starts the
    opening tag where that can only be a call begun (see `finish`).
    """

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.tools = tools
        self.calls: list[ToolCall] = []
        self.repeated = False
        """A call repeated an earlier one: the reply ended there (the repeat was not returned)."""
        self.cut = False
        """The reply ended inside a block (cut by ``max_tokens``): that partial call was dropped."""
        self._seen: set[str] = set()
        self._buf = ""
        self._in_block = False
        self._after_call = False  # whitespace right after a call is not content
        self._space = ""  # trailing whitespace held: a call block may follow it
        self._text_since_call = False  # content released since the last call (or since the start)

    def push(self, text: str) -> list[str | ToolCall]:
        """Take more of the reply's text; what is now decided."""
        if self.repeated:  # the reply has ended
            return []
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if self._in_block:
                end = self._buf.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(TOOL_CALL_CLOSE) :]
                self._in_block = False
                block = TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE
                rest, calls = parse_tool_calls(block, self.tools)
                if len(calls) == 1 and not rest and calls[0].canonical() in self._seen:
                    self.repeated = True  # the reply ends before the repeat
                    self._buf = self._space = ""
                    return out
                if len(calls) == 1 and not rest:
                    self._seen.add(calls[0].canonical())
                    self._space = ""
                    self._after_call = True
                    self.calls.append(calls[0])
                    self._text_since_call = False
                    out.append(calls[0])
                else:  # not a call of these tools: the block is content, as written
                    self._content(out, self._space + block)
                    self._space = ""
                continue
            if self._after_call:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._after_call = False
            start = self._buf.find(TOOL_CALL_OPEN)
            if start >= 0:
                self._prose(out, self._buf[:start])
                self._buf = self._buf[start + len(TOOL_CALL_OPEN) :]
                self._in_block = True
                continue
            keep = _partial_open(self._buf)
            self._prose(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return out

    def finish(self, cut: bool = False) -> list[str | ToolCall]:
        """The end of the reply (`cut`: by ``max_tokens``): what was held back is content after all,
        except a block still open, or an opening tag still incomplete where that can only be a call
        begun (in a reply `cut`, or right after a call), which are dropped with the whitespace
        before them. An incomplete tag anywhere else (``"x <t"``, ended by the model) is text."""
        out: list[str | ToolCall] = []
        tag = bool(self._buf) and _partial_open(self._buf) == len(self._buf)
        if self._in_block or (tag and (cut or (self.calls and not self._text_since_call))):
            self.cut = True  # (held back: the start of ``<tool_call>``, cut before the tag was whole)
        elif not self.repeated:
            rest = self._buf.lstrip() if self._after_call else self._buf
            self._content(out, self._space + rest)
        self._buf, self._space, self._in_block = "", "", False
        return out

    def _prose(self, out: list[str | ToolCall], text: str) -> None:
        """Text outside blocks: its trailing whitespace waits (a call may follow)."""
        text = self._space + text
        head = text.rstrip()
        self._space = text[len(head) :]
        self._content(out, head)

    def _content(self, out: list[str | ToolCall], text: str) -> None:
        if text:
            out.append(text)
            self._text_since_call = True


def _partial_open(text: str) -> int:
    """Length of the longest end of `text` that ``<tool_call>`` starts with."""
    for k in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return k
    return 0


def split_calls(
    text: str, tools: Sequence[Mapping[str, Any]], *, cut: bool = False
) -> tuple[str, list[ToolCall]]:
    """A whole reply's content and calls, exactly as a `ToolCallStream` reads them piece by piece
    (`cut`: the reply was cut by ``max_tokens``, `ToolCallStream.finish`)."""
    reader = ToolCallStream(tools)
    parts = reader.push(text) + reader.finish(cut)
    return "".join(p for p in parts if isinstance(p, str)), reader.calls


def valid_arguments(call: ToolCall, tools: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `call` names one of `tools` and its arguments follow that tool's schema."""
    for tool in tools:
        fn = tool["function"]
        if fn["name"] == call.name:
            return jsonschema.validators.validator_for(fn["parameters"])(fn["parameters"]).is_valid(
                call.arguments
            )
    return False


def tool_prompt(tools: Sequence[Mapping[str, Any]], tool_choice: str = "auto") -> str:
    """The system text that shows `tools` to a model whose chat template has no tool format."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    if tool_choice == "auto":
        when = "When a function helps answer, call it; otherwise answer directly."
    elif tool_choice == "required":
        when = "You must call one of the functions."
    else:
        when = f"You must call the function {tool_choice}."
    return (
        "You can call functions. Their signatures, as JSON Schema, are inside <tools></tools>:\n"
        f"<tools>\n{listing}\n</tools>\n{when} To call a function, write:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>\n'
        "Function results come back inside <tool_response></tool_response>."
    )


def _arguments(call: Mapping[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    fn = call.get("function", call)
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name: a tool call needs a name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}.function.arguments: not valid JSON ({err.msg} at char {err.pos})"
            ) from None
    if not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments: must be a JSON object")
    return fn["name"], dict(args)


def template_has_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself in the Hermes ``<tool_call>`` format."""
    return bool(template and "tools" in template and "<tool_call>" in template)


def render_messages(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    native: bool,
    tool_choice: str = "auto",
) -> list[dict[str, Any]]:
    """OpenAI-shaped chat messages (assistant ``tool_calls``, ``tool`` results) as a chat template
    takes them.

    `native`: the template renders tools and tool messages itself; arguments become objects (what
    such templates expect). Otherwise the tools go into the system message (`tool_prompt`), calls
    into the assistant's text as ``<tool_call>`` blocks and results into user turns as
    ``<tool_response>`` blocks. Arguments that are not valid JSON raise a ValueError naming
    ``messages[i].tool_calls[j].function.arguments``.
    """
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content") or ""
        calls = m.get("tool_calls") or []
        parsed = [_arguments(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
        if native:
            entry: dict[str, Any] = {"role": role, "content": content}
            if parsed:
                entry["tool_calls"] = [
                    {"type": "function", "function": {"name": n, "arguments": a}} for n, a in parsed
                ]
            if role == "tool" and m.get("name"):
                entry["name"] = m["name"]
            out.append(entry)
        elif role == "tool":
            text = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1]["content"] += "\n" + text  # several results of one turn read as one message
            else:
                out.append({"role": "user", "content": text})
        else:
            blocks = [
                "<tool_call>\n"
                + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)
                + "\n</tool_call>"
                for n, a in parsed
            ]
            out.append(
                {"role": role, "content": "\n".join([content, *blocks]).strip() if blocks else content}
            )
    if tools and not native:
        prompt = tool_prompt(tools, tool_choice)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
