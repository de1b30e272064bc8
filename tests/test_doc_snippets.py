"""Every Python snippet of README.md and docs/*.md is run, or is listed here (`SERVING_NOT_RUN`) with
why not; so is every shell snippet of docs/SERVING.md.

Why: a snippet that fails as written is the first thing a newcomer meets (the DSPy one once raised
`AdapterParseError` on the embedded model). The fast test only checks that each snippet is
accounted for, so a new one cannot slip in untested; the slow tests run them on the embedded
model, each document's snippets in order as one script (later snippets use names earlier ones
define, as a reader would), after a preamble defining what the text leaves to the reader.
"""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def snippets(doc: str, lang: str = "python") -> list[str]:
    """The ```python (or other `lang`) blocks of `doc` (a path under the repo), dedented (some sit in
    bullets)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    pattern = rf"^( *)```{re.escape(lang)}\n(.*?)^\1```"
    return [textwrap.dedent(m.group(2)) for m in re.finditer(pattern, text, re.M | re.S)]


# README.md's snippets 0-3 run in tests/test_readme.py (with checks of what they print).
README_ELSEWHERE = {0, 1, 2, 3}

# Names a snippet uses that its document leaves to the reader, defined just before it runs.
PREAMBLES: dict[tuple[str, int], str] = {
    ("README.md", 5): """
from branchwise import HFBackend, Reasoner
from branchwise.strategies import best_of_n

backend = HFBackend()
""",
    ("docs/INTEGRATIONS.md", 2): '''
from typing import Literal

import pydantic


def search(query: str) -> str:
    """Search the web for `query`."""
    return "no results"
''',
    ("docs/INTEGRATIONS.md", 9): '''
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as '12 * 7'."""
    return str(eval(expression, {"__builtins__": {}}))


def lookup(title: str) -> str:
    """The first sentence of the corpus entry `title`."""
    return ""
''',
}

# Where a snippet is shrunk for the test only (the README's accel snippet runs 8 branches of the
# default 256 tokens twice over: its point is the settings, not the run).
EDITS: dict[tuple[str, int], tuple[str, str]] = {
    ("README.md", 5): ("best_of_n(n=8)", "best_of_n(n=2, max_tokens=16)"),
}

SERVING = "docs/SERVING.md"

# docs/SERVING.md: its first shell line starts `branchwise serve` on the embedded model (on a free
# port for 8000) and its client snippets run against that server as written, but for the URL's port
# (`SERVING_RUN`). What cannot run on a CPU-only machine without a network, each with why:
SERVING_NOT_RUN: dict[tuple[str, int], str] = {
    ("python", 5): "a vLLM server on a GPU machine (gpu-box) and the Qwen2.5-7B tokenizer from the hub",
    ("python", 2): "DSPy over LiteLLM: the embedded 135M model does not write DSPy's output fields "
    "(AdapterParseError), and DSPy sends no response_format to a model name its catalog does not "
    "know, so nothing constrains it; the in-process DSPy snippets of INTEGRATIONS.md do run",
    ("python", 6): "two vLLM servers on two machines (gpu-a, gpu-b)",
    ("bash", 1): "binds every interface on port 8000, which a test cannot assume free; the key and "
    "Host checks it shows are tested in tests/test_serve_security.py",
    ("bash", 2): "vLLM on a GPU, a 7B model from the hub",
    ("bash", 3): "vLLM on four to sixteen GPUs, a 72B model from the hub",
    ("bash", 4): "installs vLLM's CPU build into a new virtualenv from PyPI (a network, minutes)",
    ("bash", 5): "`serve --endpoint` in front of two vLLM servers on two machines (gpu-a, gpu-b) of a "
    "7B model",
    ("bash", 6): "eval against two servers on two machines (gpu-a, gpu-b)",
}
# Snippet 0's second line (serve Qwen2.5-1.5B) is not run either: it downloads the model.
SERVE_LINE = "branchwise serve --host 127.0.0.1 --port 8000"
SERVING_RUN: dict[tuple[str, int], str] = {
    ("bash", 0): "the `serving_url` fixture, its first line",
    ("python", 0): "test_serving_openai_snippets_run",
    ("python", 1): "test_serving_openai_snippets_run",
    ("python", 3): "test_serving_langchain_snippet_runs (skips without langchain-openai)",
    ("python", 4): "test_serving_remote_backend_snippet_runs",
}

# Every document's snippet count (a new snippet fails the fast test until
# it is counted here, which is when someone looks at whether it runs). README.md and
# INTEGRATIONS.md run all of theirs.
COUNTS = {"README.md": 6, "docs/INTEGRATIONS.md": 10, "docs/SERVING.md": 7, "docs/ARCHITECTURE.md": 0}


def test_every_snippet_is_accounted_for() -> None:
    docs = {"README.md", *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))}
    assert {d: len(snippets(d)) for d in sorted(docs)} == dict(sorted(COUNTS.items()))
    # SERVING.md: each Python and shell snippet is run or listed with why not, never both
    found = {("python", i) for i in range(len(snippets(SERVING)))}
    found |= {("bash", i) for i in range(len(snippets(SERVING, "bash")))}
    assert found == set(SERVING_RUN) | set(SERVING_NOT_RUN)
    assert not set(SERVING_RUN) & set(SERVING_NOT_RUN)
    assert snippets(SERVING, "bash")[0].splitlines()[0].split("#")[0].strip() == SERVE_LINE


def script(doc: str, skip: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    """One script of `doc`'s snippets in order (less `skip`), with preambles and edits applied."""
    parts = []
    for i, code in enumerate(snippets(doc)):
        if i in skip:
            continue
        old, new = EDITS.get((doc, i), ("", ""))
        if old:
            assert old in code, f"{doc} snippet {i} no longer holds {old!r}"
            code = code.replace(old, new)
        parts.append(f"# --- {doc} snippet {i}\n{textwrap.dedent(PREAMBLES.get((doc, i), ''))}\n{code}")
    return "\n".join(parts)


def run_script(code: str, tmp_path: Path) -> str:
    """Run `code` as a script in a fresh interpreter; its stdout, after asserting it succeeded."""
    path = tmp_path / "snippets.py"
    path.write_text(code)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=1800, cwd=tmp_path
    )
    print(f"{time.perf_counter() - start:.0f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_readme_rest_runs(embedded_dir: Path, tmp_path: Path) -> None:
    run_script(script("README.md", README_ELSEWHERE), tmp_path)


@pytest.mark.slow
def test_integrations_snippets_run(embedded_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("dspy")
    pytest.importorskip("langgraph")
    out = run_script(script("docs/INTEGRATIONS.md"), tmp_path)
    assert out.strip(), out


# --------------------------------------------------------------------------------------------------
# docs/SERVING.md against `branchwise serve` on the embedded model
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def serving_url(embedded_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """SERVING.md's first shell line, `branchwise serve --host 127.0.0.1 --port 8000`, run as a
    command on a free port in place of 8000; its base URL once `/health` answers.

    Module-scoped: the model loads once for all of SERVING.md's client snippets. A subprocess rather
    than `serve_in_thread`, so the documented command line itself is what is tested.
    """
    port = _free_port()
    command = shlex.split(SERVE_LINE.replace("--port 8000", f"--port {port}"))
    # this interpreter's `branchwise` script: the suite may run without its environment on PATH
    script = Path(sys.executable).parent / command[0]
    command[:1] = [str(script)] if script.exists() else [sys.executable, "-m", "branchwise.cli"]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, f"`{shlex.join(command)}` exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no /health after 300 s: {log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)  # drains: nothing is in flight once the module's tests end
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def serving_script(indices: list[int], url: str) -> str:
    """SERVING.md's Python snippets `indices` in order as one script, pointed at `url`."""
    code = "\n".join(f"# --- {SERVING} snippet {i}\n{snippets(SERVING)[i]}" for i in indices)
    assert "http://127.0.0.1:8000" in code
    return code.replace("http://127.0.0.1:8000", url)


@pytest.mark.slow
def test_serving_openai_snippets_run(serving_url: str, tmp_path: Path) -> None:
    """The server-side strategy request, then the tool-call round trip on the same `client`."""
    out = run_script(serving_script([0, 1], serving_url), tmp_path).splitlines()
    answer_votes = out[0]
    assert re.search(r"\{.*\}$", answer_votes), out  # print(answer, votes): votes is a dict
    assert len(out) >= 2, out  # the reply to the tool result (its content, or None)


@pytest.mark.slow
def test_serving_langchain_snippet_runs(serving_url: str, tmp_path: Path) -> None:
    pytest.importorskip("langchain_openai", reason="langchain-openai is not a branchwise dependency")
    out = run_script(serving_script([3], serving_url), tmp_path)
    assert out.strip(), out


@pytest.mark.slow
def test_serving_remote_backend_snippet_runs(serving_url: str, tmp_path: Path) -> None:
    """`RemoteBackend` against the server: the snippet's URL has no /v1 (the backend adds it)."""
    code = snippets(SERVING)[4]
    assert "http://127.0.0.1:8000" in code
    out = run_script(code.replace("http://127.0.0.1:8000", serving_url), tmp_path)
    assert out.strip(), out
