"""A ReAct agent with two tools on the embedded model: DSPy's `dspy.ReAct` loop, each action chosen by a
branchwise strategy.

- The loop is DSPy's `dspy.ReAct`, unchanged: it keeps the trajectory, calls the tools, appends their
  observations and stops at `finish` or after `--max-iters` steps.
- Its two LM steps are branchwise `Reason` modules on one backend: the **next action** is chosen by
  self-consistency over `--n` sampled candidates (the vote is on the tool name; the arguments come
  from a candidate that chose the winning tool), and the **final answer** likewise.
- Tools: `calculator` (arithmetic) and `lookup` (keyword search over the notes embedded below);
  every call is recorded and printed.
- `ReActTextAdapter` renders the signature in the classic text format (``Thought: ...`` /
  ``Action: tool[argument]`` / ``Observation: ...``) with few-shot demos as real chat turns: a
  135M model cannot follow DSPy's ``[[ ## field ## ]]`` format. With a real checkpoint
  (``--model``), ``--adapter chat`` runs DSPy's own format instead. (A plain ``dspy.ReAct`` on
  ``branchwise_lm()`` needs no adapter of its own: `LenientChatAdapter` decodes each step under a
  schema of the tools' calls. `Reason` formats and parses every branch itself, so the vote here
  still needs a format the model follows unconstrained.)

The embedded SmolLM2-135M is far too small to be a good agent: it calls the tools and the trace is
complete, but the answer may be wrong. What this shows is the mechanics and the cost: every step
re-sends the whole prompt (system text, demos, the trajectory so far), and the backend's prefix
cache computes only what is new. The printout ends with the tokens computed vs reused (summed over
the agent's strategy runs), the prefix-cache hits and the latency.

    python examples/agents/react_tools.py
    python examples/agents/react_tools.py "How many people live in Quito?" --n 3 --max-iters 3
"""

from __future__ import annotations

import ast
import json
import operator
import re
import sys
import time
from difflib import SequenceMatcher
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # examples/: the shared options

import dspy
from _cli import example_parser, load_backend
from dspy.utils.exceptions import AdapterParseError

from branchwise.backends.base import Backend
from branchwise.integrations.dspy import LenientChatAdapter, Reason
from branchwise.reasoners.result import ReasoningResult
from branchwise.strategies import self_consistency

QUESTION = "How many people live in Oslo?"

NOTES = [
    "Oslo is the capital of Norway. About 700000 people live in Oslo.",
    "Lima is the capital of Peru. About 10000000 people live in Lima.",
    "Quito is the capital of Ecuador. About 2800000 people live in Quito.",
    "Accra is the capital of Ghana. About 2500000 people live in Accra.",
    "Hanoi is the capital of Vietnam. About 8000000 people live in Hanoi.",
    "The Nile river is about 6650 km long.",
    "The Amazon river is about 6400 km long.",
    "Mount Everest is 8849 m high.",
]
"""The lookup tool's corpus (small and local, so the example runs offline)."""

_STOPWORDS = {
    "the",
    "is",
    "of",
    "a",
    "about",
    "in",
    "live",
    "people",
    "how",
    "many",
    "what",
    "and",
    "m",
    "km",
}


# --------------------------------------------------------------------------------------------------
# Tools
# --------------------------------------------------------------------------------------------------

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers and + - * / ** are allowed")


class Tools:
    """The agent's tools; every call is appended to `calls` (tool, argument, observation)."""

    def __init__(self, notes: list[str] = NOTES) -> None:
        self.notes = notes
        self.calls: list[dict[str, str]] = []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression such as 3 + 4 * 2."""
        text = str(expression).replace("x", "*").replace(",", "")
        found = re.findall(r"[\d.\s+\-*/()]+", text)
        candidate = max(found, key=len).strip() if found else ""
        try:
            value = _eval(ast.parse(candidate, mode="eval").body)
            out = str(int(value)) if float(value).is_integer() else f"{value:.6g}"
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as exc:
            out = f"cannot evaluate {expression!r}: {exc}"
        self.calls.append({"tool": "calculator", "argument": str(expression), "observation": out})
        return out

    def lookup(self, query: str) -> str:
        """Look up a city, river or mountain in the local notes."""
        words = [w for w in re.findall(r"\w+", str(query).lower()) if w not in _STOPWORDS]

        def score(note: str) -> float:  # fuzzy: a misspelt name still finds its note
            vocab = set(re.findall(r"\w+", note.lower())) - _STOPWORDS
            return sum(max((SequenceMatcher(None, w, v).ratio() for v in vocab), default=0.0) for w in words)

        best, note = max((score(note), note) for note in self.notes)
        out = note if best >= 0.5 else f"No note mentions {query!r}."
        self.calls.append({"tool": "lookup", "argument": str(query), "observation": out})
        return out


# --------------------------------------------------------------------------------------------------
# The text format a small model can follow
# --------------------------------------------------------------------------------------------------

_ACTION = re.compile(r"Action:\s*(\w+)\s*\[([^\]\n]*)\]?", re.I)


def _is_trajectory(signature: Any) -> bool:
    """`dspy.ReAct` renders its trajectory through the adapter with fields thought_0, tool_name_0, ..."""
    return all(
        re.fullmatch(r"(thought|tool_name|tool_args|observation)_\d+", k) for k in signature.input_fields
    )


def _argument_text(args: Any) -> str:
    if not isinstance(args, dict) or not args:
        return "" if not args else str(args)
    values = list(args.values())
    return str(values[0]) if len(values) == 1 else json.dumps(args)


ANSWER_REQUEST = "What is the final answer?"


class ReActTextAdapter(LenientChatAdapter):
    """`dspy.ReAct`'s signatures in the classic ReAct text format, with demos as chat turns.

    The action step reads ``Question: ...`` and the trajectory (``Thought:`` / ``Action: tool[arg]`` /
    ``Observation:`` lines) and replies with one ``Thought:`` and one ``Action:`` line, parsed back
    into ``next_thought``, ``next_tool_name`` and ``next_tool_args`` (the bracket text fills the
    tool's single argument). The answer step reads the same plus ``What is the final answer?`` and
    replies ``Answer: ...``.

    Both steps get one system text and one demo list (action demos and answer demos, each rendered
    by its fields), so their prompts differ only in the last user turn: the prefix cache then
    serves the answer step from the action steps' KV. Other signatures fall back to
    `LenientChatAdapter`'s format.
    """

    def __init__(self, tools: dict[str, Any]) -> None:
        super().__init__()
        self.tools = tools

    # ---------------------------------------------------------------- formatting
    def format(self, signature: Any, demos: list[Any], inputs: dict[str, Any]) -> list[dict[str, Any]]:
        if "trajectory" not in signature.input_fields:
            return super().format(signature, demos, inputs)
        messages = [{"role": "system", "content": self._system()}]
        for demo in demos:  # action demos and answer demos alike, each by its own fields
            is_action = "next_tool_name" in demo
            messages.append({"role": "user", "content": self._request(demo, answer=not is_action)})
            reply = self._action(demo) if is_action else f"Answer: {demo['answer']}"
            messages.append({"role": "assistant", "content": reply})
        answer = "next_tool_name" not in signature.output_fields
        messages.append({"role": "user", "content": self._request(inputs, answer=answer)})
        return messages

    def _system(self) -> str:
        lines = ["You answer the question with tools. Tools:"]
        for i, (name, tool) in enumerate(self.tools.items(), 1):
            arg = next(iter(tool.args), "")
            lines.append(f"({i}) {name}[{arg}]: {tool.desc}")
        lines.append("Reply with one line 'Thought: ...' and one line 'Action: tool[argument]'.")
        lines.append(f"When asked '{ANSWER_REQUEST}', reply with one line 'Answer: ...'.")
        return "\n".join(lines)

    @staticmethod
    def _request(inputs: dict[str, Any], *, answer: bool) -> str:
        lines = [f"Question: {inputs['question']}"]
        if inputs.get("trajectory"):
            lines.append(str(inputs["trajectory"]))
        if answer:
            lines.append(ANSWER_REQUEST)
        return "\n".join(lines)

    @staticmethod
    def _action(outputs: dict[str, Any]) -> str:
        action = f"{outputs['next_tool_name']}[{_argument_text(outputs.get('next_tool_args'))}]"
        return f"Thought: {outputs['next_thought']}\nAction: {action}"

    def format_user_message_content(
        self,
        signature: Any,
        inputs: dict[str, Any],
        prefix: str = "",
        suffix: str = "",
        main_request: bool = False,
    ) -> str:
        if _is_trajectory(signature):  # how dspy.ReAct renders its trajectory for the prompt
            return self._trajectory(inputs)
        return super().format_user_message_content(signature, inputs, prefix, suffix, main_request)

    def _trajectory(self, trajectory: dict[str, Any]) -> str:
        lines = []
        for i in range(len(trajectory) // 4 + 1):
            if f"thought_{i}" not in trajectory:
                break
            lines.append(f"Thought: {trajectory[f'thought_{i}']}")
            lines.append(
                f"Action: {trajectory.get(f'tool_name_{i}')}[{_argument_text(trajectory.get(f'tool_args_{i}'))}]"
            )
            if f"observation_{i}" in trajectory:
                lines.append(f"Observation: {trajectory[f'observation_{i}']}")
        return "\n".join(lines)

    # ---------------------------------------------------------------- parsing
    def parse(self, signature: Any, completion: str) -> dict[str, Any]:
        if "next_tool_name" in signature.output_fields:
            return self._parse_action(signature, completion)
        if "trajectory" in signature.input_fields:
            m = re.search(r"Answer:\s*(.+)", completion)
            if m:
                names = list(signature.output_fields)
                return {**{n: completion.strip() for n in names[:-1]}, names[-1]: m.group(1).strip()}
        return super().parse(signature, completion)

    def _parse_action(self, signature: Any, completion: str) -> dict[str, Any]:
        m = _ACTION.search(completion)
        if m is None or m.group(1).lower() not in self.tools:
            names = "|".join(re.escape(n) for n in self.tools)
            m = re.search(rf"\b({names})\s*\[([^\]\n]*)\]?", completion, re.I)
        if m is None:
            raise AdapterParseError(
                "ReActTextAdapter", signature, completion, "no 'Action: tool[argument]' line"
            )
        name, argument = m.group(1).lower(), m.group(2).strip()
        params = list(self.tools[name].args)
        if not params:
            args: dict[str, Any] = {}
        else:
            try:
                args = json.loads(argument)
                if not isinstance(args, dict) or not set(args) <= set(params):
                    raise ValueError
            except ValueError:
                args = {params[0]: argument.strip("'\" ")}
        thought = re.search(r"Thought:\s*(.+)", completion)
        first = completion.strip().splitlines()[0] if completion.strip() else ""
        return {
            "next_thought": (thought.group(1) if thought else first).strip(),
            "next_tool_name": name,
            "next_tool_args": args,
        }


# --------------------------------------------------------------------------------------------------
# The agent
# --------------------------------------------------------------------------------------------------

# (question, [(thought, tool, argument), ...], answer): demonstrated episodes, one demo turn per step
EPISODES = [
    (
        "How many people live in Lima?",
        [("I should look up Lima.", "lookup", "Lima"), ("The notes say 10000000 people.", "finish", "")],
        "10000000",
    ),
    (
        "What is 6 times 7?",
        [("I should compute 6 * 7.", "calculator", "6 * 7"), ("The result is 42.", "finish", "")],
        "42",
    ),
    (
        "How many people live in Accra and Hanoi together?",
        [
            ("I should look up Accra.", "lookup", "Accra"),
            ("Now I should look up Hanoi.", "lookup", "Hanoi"),
            ("I should add the two numbers.", "calculator", "2500000 + 8000000"),
            ("The total is 10500000.", "finish", ""),
        ],
        "10500000",
    ),
]


class RecordedReason(Reason):
    """`Reason` that keeps every run's `ReasoningResult` (per-step votes, timings, KV statistics)."""

    def __init__(
        self, *args: Any, runs: list[tuple[str, ReasoningResult]], label: str, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.runs = runs
        self.label = label

    def forward(self, **inputs: Any) -> dspy.Prediction:
        pred = super().forward(**inputs)
        self.runs.append((self.label, pred.reasoning_result))
        return pred


class Agent:
    """`dspy.ReAct` over `Tools`, its action and answer steps run as branchwise strategies."""

    def __init__(
        self,
        backend: Backend,
        *,
        n: int = 4,
        max_tokens: int = 40,
        temperature: float = 0.7,
        seed: int = 0,
        max_iters: int = 4,
        adapter: str = "text",
    ) -> None:
        self.tools = Tools()
        self.react = dspy.ReAct(
            "question -> answer", tools=[self.tools.calculator, self.tools.lookup], max_iters=max_iters
        )
        self.adapter = ReActTextAdapter(self.react.tools) if adapter == "text" else LenientChatAdapter()
        self.runs: list[tuple[str, ReasoningResult]] = []
        common = {"backend": backend, "chain_of_thought": False, "adapter": self.adapter, "runs": self.runs}
        action = RecordedReason(
            self.react.react.signature,
            self_consistency(
                n=n, temperature=temperature, max_tokens=max_tokens, stop=["Observation"], seed=seed
            ),
            answer_field="next_tool_name",
            label="action",
            **common,
        )
        answer_sig = self.react.extract.predict.signature.delete("reasoning")
        answer = RecordedReason(
            answer_sig,
            self_consistency(n=n, temperature=temperature, max_tokens=16, stop=["\n"], seed=seed),
            label="answer",
            **common,
        )
        action.demos = answer.demos = self._demos()  # one list: both prompts share it
        self.react.react, self.react.extract = action, answer

    def _demos(self) -> list[dspy.Example]:
        """Few-shot demos, trajectories rendered by the agent's own adapter: each episode's action
        steps, then its answer (an adapter formats a demo only where the signature has its fields)."""
        demos = []
        tools = Tools()
        for question, steps, final in EPISODES:
            trajectory: dict[str, Any] = {}
            for i, (thought, tool, argument) in enumerate(steps):
                params = list(self.react.tools[tool].args)
                args = {params[0]: argument} if params else {}
                demos.append(
                    dspy.Example(
                        question=question,
                        trajectory=_render(self.adapter, trajectory),
                        next_thought=thought,
                        next_tool_name=tool,
                        next_tool_args=args,
                    )
                )
                observation = getattr(tools, tool)(**args) if tool != "finish" else "Completed."
                trajectory.update(
                    {
                        f"thought_{i}": thought,
                        f"tool_name_{i}": tool,
                        f"tool_args_{i}": args,
                        f"observation_{i}": observation,
                    }
                )
            demos.append(
                dspy.Example(question=question, trajectory=_render(self.adapter, trajectory), answer=final)
            )
        return demos

    def __call__(self, question: str) -> dict[str, Any]:
        """Run one episode; returns the answer, the trajectory, the tool calls, the steps and the cost."""
        self.tools.calls.clear()
        self.runs.clear()
        start = time.perf_counter()
        with dspy.context(adapter=self.adapter):
            pred = self.react(question=question)
        seconds = time.perf_counter() - start
        return {
            "question": question,
            "answer": pred.answer,
            "trajectory": dict(pred.trajectory),
            "tool_calls": list(self.tools.calls),
            "steps": [step_summary(label, r) for label, r in self.runs],
            "cost": cost(self.runs, seconds),
        }


def _render(adapter: Any, trajectory: dict[str, Any]) -> str:
    """A trajectory as `dspy.ReAct` renders it for the model (through the adapter)."""
    signature = dspy.Signature(f"{', '.join(trajectory)} -> x") if trajectory else None
    return "" if signature is None else adapter.format_user_message_content(signature, trajectory)


def step_summary(label: str, result: ReasoningResult) -> dict[str, Any]:
    kv = result.kv_stats
    return {
        "step": label,
        "choice": result.answer,
        "votes": dict(result.votes),
        "seconds": round(result.timings["total"], 3),
        "tokens_computed": int(kv.get("tokens_computed", 0)),
        "tokens_reused": int(kv.get("tokens_reused", 0)),
        "cache_hit_tokens": int(kv.get("cache_hit_tokens", 0)),
    }


def cost(runs: list[tuple[str, ReasoningResult]], seconds: float) -> dict[str, Any]:
    """Tokens computed vs reused and prefix-cache hits, summed over the runs; wall-clock latency."""

    def total(key: str) -> int:
        return int(sum(r.kv_stats.get(key, 0) for _, r in runs))

    return {
        "strategy_runs": len(runs),
        "tokens_computed": total("tokens_computed"),
        "tokens_reused": total("tokens_reused"),
        "cache_hit_tokens": total("cache_hit_tokens"),
        "cache_miss_tokens": total("cache_miss_tokens"),
        "seconds": round(seconds, 3),
    }


def show(out: dict[str, Any]) -> None:
    print(f"\nQuestion: {out['question']}")
    print(_render(ReActTextAdapter({}), out["trajectory"]))
    print("\ntool calls:")
    for call in out["tool_calls"]:
        print(f"  {call['tool']}({call['argument']!r}) -> {call['observation']}")
    if not out["tool_calls"]:
        print("  (none)")
    print("\nsteps (each a self-consistency vote):")
    for s in out["steps"]:
        print(
            f"  {s['step']:<7} {s['choice']!s:<12} votes={s['votes']} {s['seconds']:.2f}s "
            f"computed={s['tokens_computed']} reused={s['tokens_reused']} cache_hits={s['cache_hit_tokens']}"
        )
    c = out["cost"]
    print(
        f"\nanswer: {out['answer']}   | {c['seconds']:.1f} s, tokens computed {c['tokens_computed']}, "
        f"reused {c['tokens_reused']} (prefix cache: {c['cache_hit_tokens']} hit, {c['cache_miss_tokens']} missed) "
        f"over {c['strategy_runs']} strategy runs"
    )


def main(argv: list[str] | None = None, backend: Backend | None = None) -> dict[str, Any]:
    parser = example_parser(__doc__)
    parser.add_argument("question", nargs="?", default=QUESTION)
    parser.add_argument("--n", type=int, default=4, help="candidates sampled per action (self-consistency)")
    parser.add_argument("--max-tokens", type=int, default=40, help="tokens per candidate action")
    parser.add_argument("--max-iters", type=int, default=4, help="at most this many actions")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--adapter",
        choices=["text", "chat"],
        default="text",
        help="text: Thought/Action lines (small models); chat: DSPy's [[ ## field ## ]] format",
    )
    args = parser.parse_args(argv)
    backend = backend if backend is not None else load_backend(args)
    agent = Agent(
        backend,
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        max_iters=args.max_iters,
        adapter=args.adapter,
    )
    out = agent(args.question)
    show(out)
    return out


if __name__ == "__main__":
    main()
