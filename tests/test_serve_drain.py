"""`branchwise serve` as a process: SIGTERM under load, and the command line failing fast.

The drain test runs the real command on the tiny model (a subprocess on a free loopback port): every
request of a burst is answered 200 or with a JSON 503, the process exits 0 and its log holds no
traceback. The command-line tests stop before a model is loaded (its loader is replaced by one that
fails the test if it is called, where the point is that it is not).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from testkit import wait_until  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import branchwise.cli_backend  # noqa: E402
from branchwise.cli import app  # noqa: E402

MSGS = [{"role": "user", "content": "What is 12 + 7?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_mid_burst_answers_200_or_json_503_and_exits_0(tiny_llama_dir: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    cmd = [sys.executable, "-m", "branchwise", "serve", "--model", str(tiny_llama_dir), "--port", str(port)]
    cmd += ["--drain-timeout", "2", "--batch-window-ms", "0"]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # died: stop waiting, the assert below says so

        wait_until(up, "the server answers /health", limit_s=120, every_s=0.05)
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        out: dict[int, Any] = {}
        body = {"messages": MSGS, "max_tokens": 1900, "min_tokens": 1900, "temperature": 0}

        def ask(i: int) -> None:
            try:
                if i == 0:  # one streamed: its status went out; the drop is said in the stream
                    with httpx.stream(
                        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}
                    ) as r:
                        out[i] = (r, [line for line in r.iter_lines() if line])
                else:
                    out[i] = (httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120), [])
            except httpx.HTTPError as err:
                out[i] = (err, [])

        def arrived() -> int:
            health = httpx.get(f"{url}/health", timeout=10).json()
            return int(health["batching"]["requests"] + health["queued_rows"])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        wait_until(lambda: arrived() == 6, "the burst has arrived", limit_s=120, every_s=0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        code = proc.wait(120)
        stderr = proc.communicate()[1]
        assert sorted(out) == list(range(6))
        for i, (r, lines) in sorted(out.items()):
            assert isinstance(r, httpx.Response), (i, r)
            if i == 0:
                assert r.status_code == 200 and lines[-1] == "data: [DONE]"
                assert json.loads(lines[-2].removeprefix("data: "))["error"]["type"] == "server_unavailable"
            else:
                assert r.status_code in (200, 503), r.text
                if r.status_code == 503:
                    assert r.json()["error"]["type"] == "server_unavailable"
        assert code == 0, stderr[-4000:]
        assert "Traceback" not in stderr and "Exception in ASGI" not in stderr, stderr[-4000:]
        assert "answered 503 (shutting down)" in stderr
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ------------------------------------------------------------------ the command line


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command gets as far as loading a model."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the model was loaded before the command line was checked")

    monkeypatch.setattr(branchwise.cli_backend, "load_backend", refuse)


def test_a_busy_port_fails_before_the_model_loads(no_load: None, tiny_llama_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--model", str(tiny_llama_dir), "--port", str(port)])
    assert result.exit_code == 2, result.output
    assert "--port" in result.output and f"cannot listen on 127.0.0.1:{port}" in result.output


def test_a_missing_model_folder_fails_at_once(no_load: None, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "no" / "such"), "--port", "0"])
    assert result.exit_code == 2 and "no such folder" in result.output


def test_a_folder_without_a_model_fails_at_once(no_load: None, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--port", "0"])
    assert result.exit_code == 2 and "no config.json" in result.output


class _Budgeted:
    """A backend whose KV budget refuses every value (as a bad --kv-budget is refused)."""

    @property
    def kv_budget(self) -> int:
        return 0

    @kv_budget.setter
    def kv_budget(self, value: Any) -> None:
        raise ValueError(f"kv_budget: {value!r} is neither bytes nor a fraction")


def test_a_bad_kv_budget_names_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(branchwise.cli_backend, "load_backend", lambda *_: _Budgeted())
    result = CliRunner().invoke(app, ["serve", "--port", "0", "--kv-budget", "lots"])
    assert result.exit_code == 2 and "--kv-budget" in result.output and "'lots'" in result.output


def test_a_public_address_without_a_key_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    def stop(*_: Any) -> Any:
        raise typer.Exit(3)

    monkeypatch.setattr(branchwise.cli_backend, "load_backend", stop)
    monkeypatch.delenv("BRANCHWISE_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 3 and "without an API key" in result.output
    quiet = CliRunner().invoke(
        app, ["serve", "--host", "0.0.0.0", "--port", "0"], env={"BRANCHWISE_API_KEY": "k"}
    )
    assert quiet.exit_code == 3 and "without an API key" not in quiet.output


def test_serve_help_lists_the_limits_and_security_options() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    for option in (
        "--api-key",
        "--allow-host",
        "--cors-origin",
        "--docs",
        "--max-body-bytes",
        "--body-timeout",
        "--max-strategy-branches",
        "--max-strategy-tokens",
        "--strategy-timeout",
        "--kv-budget",
    ):
        assert option in result.output, option


def test_bad_limits_are_refused_in_one_line() -> None:
    result = CliRunner().invoke(app, ["serve", "--max-strategy-branches", "0"])
    assert result.exit_code == 2
    assert "Invalid value for '--max-strategy-branches': 0 is not in the range 1<=x<=4096" in result.output


# ------------------------------------------------------------------ the process ends with the drain


@pytest.mark.parametrize("started", [True, False])
def test_serve_ends_the_process_right_after_the_drain(monkeypatch: pytest.MonkeyPatch, started: bool) -> None:
    """After a drain `serve` exits 0 at once, skipping the interpreter's teardown (a full garbage
    collection of the model's objects took 6-9 s, past the one decode step SERVING.md promises);
    a server that never started returns to its caller instead."""
    from branchwise.serve import runner

    def run(self: Any, sockets: Any = None) -> None:
        self.started = started

    exits: list[int] = []
    monkeypatch.setattr(runner.DrainingServer, "run", run)
    monkeypatch.setattr(runner.os, "_exit", exits.append)
    monkeypatch.setattr(runner.logging, "shutdown", lambda *_: None)  # keep this process's handlers open
    with socket.socket() as sock:
        runner.serve(object(), sock, drain_timeout_s=1.0)
    assert exits == ([0] if started else [])


def test_a_bad_decode_step_names_the_option(tiny_llama_dir: Path) -> None:
    result = CliRunner().invoke(
        app, ["serve", "--model", str(tiny_llama_dir), "--port", "0", "--decode-step", "warp"]
    )
    assert result.exit_code == 2, result.output
    assert "--decode-step" in result.output and "'warp' is not one of 'auto', 'compiled'" in result.output
