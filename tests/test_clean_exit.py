"""A script that used branchwise exits with status 0, whatever it left running.

Why a subprocess: what is checked is the interpreter's own end. A daemon thread still inside torch
(or xgrammar) as the interpreter finalises is ended by Python through C++ frames, and the process
aborts: "terminate called without an active exception", exit status 134 (seen after a script that
built, invoked and dropped chat models). Each script here ends as a user's would: chat models
dropped, a reasoner's backend still held, a DSPy LM, and one whose decode still runs at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHAT_MODELS = """
from langchain_core.tools import tool
from pydantic import BaseModel

from branchwise.integrations.langchain import ChatBranchwise


@tool
def add(a: int, b: int) -> int:
    '''Add two numbers.'''
    return a + b


class Answer(BaseModel):
    value: int


for _ in range(2):  # built, invoked plain, with a tool and with a structured output, dropped
    chat = ChatBranchwise(model=MODEL, max_tokens=8)
    chat.invoke("hi")
    chat.bind_tools([add], tool_choice="required").invoke("add 2 and 3")
    chat.with_structured_output(Answer, include_raw=True).invoke("value?")
    del chat
chat = ChatBranchwise(model=MODEL, max_tokens=4)  # and one still held at the end
chat.invoke("bye")
"""

STRATEGY = """
from branchwise.backends.hf import HFBackend
from branchwise.reasoners import Reasoner
from branchwise.strategies import self_consistency

backend = HFBackend(MODEL)
Reasoner(self_consistency(n=3, max_tokens=6), backend=backend).run("What is 1 + 2?")
"""

DSPY = """
from branchwise.integrations.dspy import BranchwiseLM

lm = BranchwiseLM(MODEL, max_tokens=6, cache=False)
lm("What is 1 + 2?")  # the LM as DSPy's modules call it (a random model's reply would not parse)
del lm
lm = BranchwiseLM(MODEL, max_tokens=6, cache=False)
lm(messages=[{"role": "user", "content": "And 2 + 3?"}])
"""

DECODING_AT_EXIT = """
import threading
import time

from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend

backend = HFBackend(MODEL)
started = threading.Event()


def decode() -> None:
    root = backend.prefill(backend.encode("hello there"))
    kids = backend.fork(root, 4)
    started.set()
    backend.extend(kids, DecodeParams(temperature=1.0, max_tokens=100_000))


threading.Thread(target=decode, daemon=True).start()
started.wait(600)
time.sleep(0.5)  # the decode is under way as the script ends
"""


def _run(script: str, model: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "true"}
    code = f"MODEL = {str(model)!r}\n" + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(CHAT_MODELS, id="chat-models"),
        pytest.param(STRATEGY, id="strategy"),
        pytest.param(DSPY, id="dspy"),
        pytest.param(DECODING_AT_EXIT, id="decoding-at-exit"),
    ],
)
def test_a_script_exits_cleanly(script: str, tiny_llama_dir: Path) -> None:
    if "langchain" in script:
        pytest.importorskip("langchain_core")
    if "dspy" in script:
        pytest.importorskip("dspy")
    done = _run(script, tiny_llama_dir)
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
