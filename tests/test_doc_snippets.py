"""Every Python snippet of README.md and docs/*.md is run, or is listed here (`SERVING_NOT_RUN`) with
why not; so is every shell snippet of those documents (`SHELL_RUN`, `SHELL_NOT_RUN`).

Why: a snippet that fails as written is the first thing a newcomer meets (the DSPy one once raised
`AdapterParseError` on the embedded model). The fast tests only check that each snippet is
accounted for, so a new one cannot slip in untested; the slow tests run them on the embedded
model, each document's Python snippets in order as one script (later snippets use names earlier
ones define, as a reader would), after a preamble defining what the text leaves to the reader, and
each runnable shell snippet with bash as written.
"""

from __future__ import annotations

import os
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
import yaml

ROOT = Path(__file__).resolve().parent.parent


def snippets(doc: str, lang: str = "python") -> list[str]:
    """The ```python (or other `lang`) blocks of `doc` (a path under the repo), dedented (some sit in
    bullets)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    pattern = rf"^( *)```{re.escape(lang)}\n(.*?)^\1```"
    return [textwrap.dedent(m.group(2)) for m in re.finditer(pattern, text, re.M | re.S)]


# Python snippets run in tests/test_readme.py (with checks of what they print), not in this file's
# script of their document: README.md's strategy, agent and openai-client snippets, and
# docs/STRATEGIES.md's strategy over actions.
README_ELSEWHERE = {0, 1, 3}
STRATEGIES_ELSEWHERE = {1}

# Names a snippet uses that its document leaves to the reader, defined just before it runs.
PREAMBLES: dict[tuple[str, int], str] = {
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

# Where a snippet is shrunk for the test only (ACCELERATIONS.md's snippet runs 8 branches of the
# default 256 tokens twice over: its point is the settings, not the run).
EDITS: dict[tuple[str, int], tuple[str, str]] = {
    ("docs/ACCELERATIONS.md", 0): ("best_of_n(n=8)", "best_of_n(n=2, max_tokens=16)"),
}

SERVING = "docs/SERVING.md"
README = "README.md"
STRATEGIES = "docs/STRATEGIES.md"
ACCELERATIONS = "docs/ACCELERATIONS.md"
PERFORMANCE = "docs/PERFORMANCE.md"

# docs/SERVING.md: its first shell line starts `branchwise serve` on the embedded model (on a free
# port for 8000) and its client snippets run against that server as written, but for the URL's port
# (`SERVING_RUN`). What cannot run on a CPU-only machine without a network, each with why:
SERVING_NOT_RUN: dict[tuple[str, int], str] = {
    ("python", 5): "a vLLM server on a GPU machine (gpu-box) and the Qwen2.5-7B tokenizer from the hub",
    ("python", 2): "DSPy over LiteLLM: the embedded 135M model does not write DSPy's output fields "
    "(AdapterParseError), and DSPy sends no response_format to a model name its catalog does not "
    "know, so nothing constrains it; the in-process DSPy snippets of INTEGRATIONS.md do run",
    ("python", 6): "two vLLM servers on two machines (gpu-a, gpu-b)",
}
SERVING_RUN: dict[tuple[str, int], str] = {
    ("python", 0): "test_serving_openai_snippets_run",
    ("python", 1): "test_serving_openai_snippets_run",
    ("python", 3): "test_serving_langchain_snippet_runs (skips without langchain-openai)",
    ("python", 4): "test_serving_remote_backend_snippet_runs",
}

# Every document's snippet count (a new snippet fails the fast test until
# it is counted here, which is when someone looks at whether it runs). README.md and
# INTEGRATIONS.md, STRATEGIES.md and ACCELERATIONS.md run all of theirs.
COUNTS = {
    "README.md": 4,
    "docs/INTEGRATIONS.md": 10,
    "docs/SERVING.md": 7,
    "docs/ARCHITECTURE.md": 0,
    STRATEGIES: 2,
    ACCELERATIONS: 1,
    PERFORMANCE: 0,
    "docs/CONTRIBUTING.md": 0,
}


DOCS = sorted({README, *(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))})


def test_every_snippet_is_accounted_for() -> None:
    assert {d: len(snippets(d)) for d in DOCS} == dict(sorted(COUNTS.items()))
    # SERVING.md: each Python snippet is run or listed with why not, never both
    assert {("python", i) for i in range(len(snippets(SERVING)))} == set(SERVING_RUN) | set(SERVING_NOT_RUN)
    assert not set(SERVING_RUN) & set(SERVING_NOT_RUN)


# --------------------------------------------------------------------------------------------------
# Shell snippets: each is run (`SHELL_RUN`: by what) or listed with why not (`SHELL_NOT_RUN`)
# --------------------------------------------------------------------------------------------------

# The fence languages of a shell snippet, and those of the docs' other blocks (bare ones are trees
# of files). A block under any other language fails the fast test until it is sorted into one.
SHELL_LANGS = ("bash", "sh", "shell", "console", "zsh")
OTHER_LANGS = ("python", "yaml", "")


def shell_snippets(doc: str) -> list[str]:
    """`doc`'s shell blocks in order, whatever their language among `SHELL_LANGS`."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    langs = "|".join(SHELL_LANGS)
    pattern = rf"^( *)```(?:{langs})\n(.*?)^\1```"
    return [textwrap.dedent(m.group(2)) for m in re.finditer(pattern, text, re.M | re.S)]


def commands(code: str) -> list[str]:
    """A shell snippet's command lines, less comments and blank lines."""
    return [c for line in code.splitlines() if (c := line.split("#")[0].strip())]


# README's and SERVING.md's `serve` line: the `serving_url` fixture runs it (on a free port).
SERVE_LINE = "branchwise serve --host 127.0.0.1 --port 8000"
# STRATEGIES.md's eval lines: tests/test_evals.py's quick-suite test runs the same `eval` and `report`.
QUICK_SUITE = ["branchwise eval examples/suites/quick.yaml --out runs/quick", "branchwise report runs/quick"]

# What runs each snippet: a test or fixture, `file.py::name` when not in this file, then a note.
SHELL_RUN: dict[tuple[str, int], str] = {
    (STRATEGIES, 0): "test_strategy_file_commands_run: the first two lines as written, the third on "
    "the file they wrote shrunk by SHRINK (as written: 8 branches of up to 96 tokens a step, up to 8 "
    "steps, each scored by a judge; minutes of CPU)",
    (STRATEGIES, 1): "tests/test_evals.py::test_quick_suite_end_to_end: the same eval (with "
    "--no-progress) and report, through the CLI's app (QUICK_SUITE)",
    (README, 3): "serving_url: SERVE_LINE, as SERVING.md's first",
    (SERVING, 0): "serving_url: its first line, SERVE_LINE (the second, serving Qwen2.5-1.5B, is not "
    "run: it downloads the model)",
}
# Two of README's snippets are its quick start, which CI runs as written (`.ci/run`).
CI_RUN = "`.ci/run` runs it verbatim in a brand-new virtualenv with empty caches, as CI"
SHELL_NOT_RUN: dict[tuple[str, int], str] = {
    (README, 0): f"the quick start's main command, installs from PyPI: {CI_RUN}",
    (README, 1): f"the quick start's install and whole test suite (this file included): {CI_RUN}",
    (README, 2): "downloads Qwen2.5-1.5B-Instruct (about 3 GB) from the hub, and Qwen2.5-Coder-0.5B "
    "(about 500 MB) from the package index (`tests/backends/hf/test_packaged.py` tests the build "
    "with pip and the conversion stood in for)",
    (PERFORMANCE, 0): "installs torch's CUDA build and the extras from PyPI (a network, minutes)",
    ("docs/INTEGRATIONS.md", 0): "installs from PyPI (a network); the suite's environment has the "
    "extra, `.[all]`",
    ("docs/INTEGRATIONS.md", 1): "installs from PyPI (a network); the suite's environment has the "
    "extra, `.[all]`",
    (SERVING, 1): "binds every interface on port 8000, which a test cannot assume free; the key and "
    "Host checks it shows are tested in tests/test_serve_security.py",
    (SERVING, 2): "vLLM on a GPU, a 7B model from the hub",
    (SERVING, 3): "vLLM on four to sixteen GPUs, a 72B model from the hub",
    (SERVING, 4): "installs vLLM's CPU build into a new virtualenv from PyPI (a network, minutes)",
    (SERVING, 5): "`serve --endpoint` in front of two vLLM servers on two machines (gpu-a, gpu-b) of a "
    "7B model",
    (SERVING, 6): "eval against two servers on two machines (gpu-a, gpu-b)",
}


def test_every_shell_snippet_is_accounted_for() -> None:
    """Each shell block of README.md and docs/*.md is run or listed with why not, never both; a
    block whose fence language is neither a shell's nor one of `OTHER_LANGS` fails here."""
    fences = {
        (doc, m.group(1))
        for doc in DOCS
        for m in re.finditer(r"^ *```(\S*)\n", (ROOT / doc).read_text(encoding="utf-8"), re.M)
    }
    unsorted = {f for f in fences if f[1] not in SHELL_LANGS + OTHER_LANGS}
    assert not unsorted, f"fences neither shell nor known otherwise: {sorted(unsorted)}"
    found = {(doc, i) for doc in DOCS for i in range(len(shell_snippets(doc)))}
    assert found == set(SHELL_RUN) | set(SHELL_NOT_RUN), (
        f"not accounted for: {sorted(found - set(SHELL_RUN) - set(SHELL_NOT_RUN))}; "
        f"listed but absent: {sorted((set(SHELL_RUN) | set(SHELL_NOT_RUN)) - found)}"
    )
    assert not set(SHELL_RUN) & set(SHELL_NOT_RUN)
    for key, where in SHELL_RUN.items():  # the test or fixture named exists
        file, _, name = where.split(": ", 1)[0].rpartition("::")
        assert f"def {name}(" in (ROOT / (file or "tests/test_doc_snippets.py")).read_text(), (key, where)


def test_shell_snippets_run_elsewhere_are_what_is_run() -> None:
    """A snippet run by another test, or by CI, is the command that one runs."""
    ci_run = (ROOT / ".ci" / "run").read_text()
    for key in [(README, 0), (README, 1)]:
        code = shell_snippets(key[0])[key[1]].strip()
        assert "\n" not in code and f"'{code}'" in ci_run, (key, code)
    assert commands(shell_snippets(STRATEGIES)[1]) == QUICK_SUITE
    assert commands(shell_snippets(README)[3]) == [SERVE_LINE]
    assert commands(shell_snippets(SERVING)[0])[0] == SERVE_LINE


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
    out = run_script(script("README.md", README_ELSEWHERE), tmp_path)
    assert out.strip(), out  # the DSPy program's answer


@pytest.mark.slow
def test_strategies_snippets_run(embedded_dir: Path, tmp_path: Path) -> None:
    """The graph composed from nodes compiles to the plan the text describes and answers."""
    out = run_script(script(STRATEGIES, STRATEGIES_ELSEWHERE), tmp_path)
    assert "plan: first -> search -> score -> keep -> next -> vote" in out, out
    assert re.search(r"^answer: .+ votes: \{", out, re.M), out


@pytest.mark.slow
def test_accelerations_snippets_run(embedded_dir: Path, tmp_path: Path) -> None:
    run_script(script(ACCELERATIONS), tmp_path)


@pytest.mark.slow
def test_integrations_snippets_run(embedded_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("dspy")
    pytest.importorskip("langgraph")
    out = run_script(script("docs/INTEGRATIONS.md"), tmp_path)
    assert out.strip(), out


def run_shell(code: str, cwd: Path) -> str:
    """Run shell `code` as written with bash (stopping at the first failing command) in `cwd`, this
    interpreter's `branchwise` first on PATH; its stdout and stderr, after asserting it succeeded."""
    bin_dir = Path(sys.executable).parent
    if not (bin_dir / "branchwise").exists():  # the suite may run without its environment's scripts
        bin_dir = cwd / ".bin"
        bin_dir.mkdir(exist_ok=True)
        shim = bin_dir / "branchwise"
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m branchwise "$@"\n')
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env=env,
    )
    assert proc.returncode == 0, f"{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


# What STRATEGIES.md's strategy-file run is shrunk to (each key must be in the file `show` wrote).
SHRINK = {"generate": {"n": 2, "max_tokens": 8}, "loop": {"max_iterations": 1}, "select": {"width": 2}}


@pytest.mark.slow
def test_strategy_file_commands_run(embedded_dir: Path, tmp_path: Path) -> None:
    """STRATEGIES.md's strategy-file lines: `show` writes beam.yaml, `validate` passes it, and the
    No-KV `run --strategy beam.yaml` answers, on the file shrunk by `SHRINK` (see `SHELL_RUN`)."""
    show_validate, run_line = shell_snippets(STRATEGIES)[0].rstrip("\n").rsplit("\n", 1)
    assert commands(run_line)[0].startswith("branchwise run ") and "beam.yaml" in run_line
    out = run_shell(show_validate, tmp_path)
    assert "ok beam_search" in out, out
    strategy = yaml.safe_load((tmp_path / "beam.yaml").read_text())
    shrunk = 0
    for node in strategy["nodes"]:
        for key, value in SHRINK.get(node["kind"], {}).items():
            assert key in node, (node, key)
            node[key], shrunk = value, shrunk + 1
    assert shrunk >= len(SHRINK), strategy
    (tmp_path / "beam.yaml").write_text(yaml.safe_dump(strategy, sort_keys=False))
    out = run_shell(run_line, tmp_path)
    assert "answer:" in out, out


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
