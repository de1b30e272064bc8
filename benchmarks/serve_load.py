"""Load test of `branchwise serve`: concurrent clients vs. the same requests one at a time.

Starts `branchwise serve` (the embedded model, or `--model`) as a subprocess on 127.0.0.1, then:
1. serial: a sample of the requests sent one at a time (the no-batching baseline, measured first so
   the model is warm for both phases);
2. concurrent: `--clients` clients each send `--requests` chat requests (n samples, short answers)
   back to back; the scheduler batches whatever is queued into shared decode passes, and with
   continuous batching (the server's default; `--no-continuous` for the batch-at-a-time baseline)
   a request arriving mid-batch joins the running decode at its next step;
3. overload: a burst of `--burst` simultaneous requests against a queue bounded at
   `--max-queued-rows` branches: the excess must get 429 (never an error or unbounded memory).
The concurrent phase runs `--rounds` times (the same requests again), so memory can be watched for
growth once the server has seen its workload.

Server memory (``rss_mb``): the server process's resident set, read at start (model loaded, no
request yet), after the warm-up request, after the serial phase, after each concurrent round and at
the end, plus the peak of readings every 50 ms. The jump at warm-up is mostly the weights: they are
memory-mapped, so their pages count only once the first forward has read them. Growth after
warm-up is expected up to the prefix cache's byte budget (prompts and answers kept for reuse, 1 GiB
by default) and the allocator's high water mark of the biggest batch; rounds that keep adding
memory beyond that would be a leak.

Then, each on a server of its own (each started with the options it tests):

4. long request in the middle (``long_request``; `--long-prompt 0` skips it): `--long-clients`
   clients send `--long-requests` short requests each, back to back, while one completion with a
   prompt of `--long-prompt` token ids (at most the model's context less its 16 answer tokens)
   arrives halfway through the phase. The short requests' p99 latency is measured with no long
   request, with the long one under chunked prefill (a prompt joining a running decode is
   prefilled one chunk per decode step, each chunk sized to take about one decode step's time and
   at most `--prefill-chunk` tokens), under fixed chunks of `--prefill-chunk` tokens
   (`--prefill-share 0`, the policy before) and with it prefilled whole (chunk 0: every running
   row waits for the whole prompt). Goal: p99 with the long request, chunked, at
   most 2x the p99 without it. Why it matters: without chunking one long prompt stalls every
   decoding client for the whole prefill;
5. burst past the KV budget (``kv_burst``; `--kv-burst 0` skips it): a server whose KV budget is
   `--kv-budget` (and a queue that holds the whole burst) gets `--kv-burst` simultaneous requests
   whose worst-case KV together is many times the budget, plus one request that alone can never
   fit. The scheduler admits what fits and queues the rest, so every request must be answered 200
   (or 429 were the queue full): anything else is counted in ``errors_other_than_429``; the
   oversized request's status and body are reported apart (it should be refused with a 4xx that
   says why, not time out or crash). Its memory: the peak RSS against what the budget allows
   (RSS after warm-up, which holds the weights, + the budget + `--rss-overhead-mb` stated for
   activations and allocator slack), and the RSS once the burst is over;
6. SIGTERM during a burst (``sigterm``; `--no-sigterm` skips it): `--sigterm-burst` long-ish requests
   are sent, SIGTERM arrives `--sigterm-after` seconds later, and a few requests more after it. Every
   request must end as a 200 or a JSON 503 (the drain); the process's exit code and the seconds from
   SIGTERM to its exit are reported (the drain timeout is `--drain-timeout`).

The KV budget and the prefill chunk are server options: where `branchwise serve --help` lists
``--kv-budget`` / ``--prefill-chunk`` they are passed as such; where it does not (yet), the server is
started through `LAUNCHER`, which runs the same `branchwise serve` command with the loaded backend's
``kv_budget`` / ``prefill_chunk`` set before the app is built (``server_options`` says which).

Prints one JSON object (last line): errors, p50/p99 latency, throughput of both phases and their
ratio (goal >= 4x), the scheduler's batching histogram, the overload outcome, ``rss_mb`` and the
three sections above.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from _common import BenchParser, emit, set_threads

from branchwise.backends.hf.backend import resolve_device, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent

LAUNCHER = """
import sys
import branchwise.cli as cli
import branchwise.cli_backend as cli_backend

budget, chunk = sys.argv[1], int(sys.argv[2])
load = cli_backend.load_backend


def load_with_options(*args, **kwargs):
    backend = load(*args, **kwargs)
    if budget != "-":
        backend.kv_budget = budget
    if chunk >= 0:
        backend.prefill_chunk = chunk
    return backend


cli_backend.load_backend = load_with_options
cli.app(args=sys.argv[3:], prog_name="branchwise")
"""
"""`branchwise serve` with the backend's ``kv_budget`` / ``prefill_chunk`` set: for a `branchwise`
whose serve command does not take them as options. argv: budget ('-' = the default), chunk (-1 =
the default), then the serve command line."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float | None:
    """Resident memory of the server process: psutil where installed, else Linux's /proc."""
    try:
        import psutil

        return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    except ImportError:
        pass
    except Exception:  # the process is gone
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


class RssWatch:
    """Named readings of a process's resident memory, plus the peak of readings every `every_s`."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid = pid
        self.marks: dict[str, Any] = {}
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(every_s,), daemon=True)

    def _read(self) -> float | None:
        mb = _rss_mb(self.pid)
        if mb is not None and (self.peak is None or mb > self.peak):
            self.peak = mb
        return mb

    def _poll(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self._read()

    def start(self) -> RssWatch:
        self.mark("start")
        self._thread.start()
        return self

    def mark(self, name: str) -> None:
        mb = self._read()
        if isinstance(self.marks.get(name), list):
            self.marks[name].append(mb)
        else:
            self.marks[name] = mb

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        return {**self.marks, "peak": self.peak}


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def serve_options(args: argparse.Namespace) -> set[str]:
    """The options of `branchwise serve` this checkout has (its --help, read once)."""
    proc = subprocess.run(
        [sys.executable, "-m", "branchwise", "serve", "--help"],
        cwd=ROOT,
        env={**_env(args), "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    options = ("--kv-budget", "--prefill-chunk", "--prefill-share", "--drain-timeout")
    return {opt for opt in options if opt in proc.stdout}


def _start(
    args: argparse.Namespace,
    port: int,
    *,
    kv_budget: str | None = None,
    prefill_chunk: int | None = None,
    extra: list[str] | None = None,
    queued_rows: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start `branchwise serve` on `port` and wait for /health. `kv_budget` / `prefill_chunk` are
    passed as options where the command has them, else through `LAUNCHER`. The server's stderr goes
    to a file (a pipe nobody reads would block a chatty server once full)."""
    cmd = ["serve", "--port", str(port)]
    queued = args.max_queued_rows if queued_rows is None else queued_rows
    cmd += ["--max-queued-rows", str(queued), "--max-batch-rows", str(args.max_batch_rows)]
    cmd += ["--continuous" if args.continuous else "--no-continuous"]
    cmd += ["--device", args.device, "--dtype", args.dtype, *(extra or [])]
    if args.model:
        cmd += ["--model", args.model]
    launch: dict[str, Any] = {}
    if kv_budget is not None and "--kv-budget" in args.serve_options:
        cmd += ["--kv-budget", kv_budget]
        kv_budget = None
    if prefill_chunk is not None and "--prefill-chunk" in args.serve_options:
        cmd += ["--prefill-chunk", str(prefill_chunk)]
        prefill_chunk = None
    if kv_budget is None and prefill_chunk is None:
        argv = [sys.executable, "-m", "branchwise", *cmd]
    else:
        chunk = -1 if prefill_chunk is None else prefill_chunk
        argv = [sys.executable, "-c", LAUNCHER, kv_budget or "-", str(chunk), *cmd]
        launch = {"kv_budget": kv_budget, "prefill_chunk": prefill_chunk}
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by `_stop` with its server
    proc = subprocess.Popen(argv, cwd=ROOT, env=_env(args), stdout=subprocess.DEVNULL, stderr=log)
    proc.launched_with = launch  # type: ignore[attr-defined]
    proc.log = log  # type: ignore[attr-defined]
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", 300.0, "branchwise serve")
    except RuntimeError as err:
        raise SystemExit(str(err)) from None
    return proc


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float, what: str) -> None:
    """Wait until the server `proc` started answers ``url/health`` with 200; a `RuntimeError` with
    the tail of its log (`proc.log`, a file) if it exits first, and after stopping it if `timeout_s`
    passes (a model load on a busy machine takes minutes, vLLM's first start compiles)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = proc.log  # type: ignore[attr-defined]
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{what} exited ({proc.returncode}): {tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    _stop(proc)
    raise RuntimeError(f"{what} did not answer /health within {timeout_s:.0f} s")


def wait_compiled(url: str, timeout_s: float) -> float:
    """Wait until `branchwise serve` at `url` compiles no kind of batch in the background (its
    /health `decode_compile.compiling` is 0, or absent where steps do not compile): what a benchmark
    of the compiled step's speed waits for before it times anything (requests never wait for it).
    Returns the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        state = httpx.get(f"{url}/health", timeout=10).json().get("decode_compile") or {}
        if not state.get("compiling"):
            break
        time.sleep(1.0)
    return round(time.monotonic() - start, 1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    proc.log.close()  # type: ignore[attr-defined]


def _body(i: int, args: argparse.Namespace) -> dict[str, Any]:
    q = f"What is {i % 97} + {(i * 7) % 89}? Answer with the number only."
    return {
        "model": "served",
        "messages": [{"role": "user", "content": q}],
        "n": args.n,
        "max_tokens": args.max_tokens,
        "temperature": 0.7,
    }


async def _send(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=body)
    return r.status_code, time.perf_counter() - t0


async def _phases(args: argparse.Namespace, base: str, rss: RssWatch) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.burst + args.clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await _send(client, _body(0, args))  # warm-up
        rss.mark("after_warmup")
        t0 = time.perf_counter()
        serial = [await _send(client, _body(i, args)) for i in range(args.serial)]
        serial_s = time.perf_counter() - t0
        rss.mark("after_serial")

        async def one_client(c: int) -> list[tuple[int, float]]:
            return [await _send(client, _body(c * args.requests + k, args)) for k in range(args.requests)]

        rss.marks["after_concurrent"] = []
        per_client: list[list[tuple[int, float]]] = []
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            per_client += await asyncio.gather(*(one_client(c) for c in range(args.clients)))
            rss.mark("after_concurrent")
        concurrent_s = time.perf_counter() - t0
        batching = (await client.get("/health")).json()["batching"]
        burst = await asyncio.gather(*(_send(client, _body(i, args)) for i in range(args.burst)))
        rss.mark("end")
    results = [r for rows in per_client for r in rows]
    latencies = sorted(lat for _, lat in results)
    total = len(results)
    serial_rps = len(serial) / serial_s
    concurrent_rps = total / concurrent_s
    statuses = [s for s, _ in burst]
    return {
        "errors": sum(s != 200 for s, _ in results) + sum(s != 200 for s, _ in serial),
        "requests": total,
        "latency_ms": {
            "p50": round(1000 * statistics.median(latencies), 1),
            "p99": round(1000 * latencies[min(total - 1, round(0.99 * (total - 1)))], 1),
            "serial_mean": round(1000 * statistics.mean(lat for _, lat in serial), 1),
        },
        "throughput_rps": {"concurrent": round(concurrent_rps, 3), "serial": round(serial_rps, 3)},
        "speedup_concurrent_vs_serial": round(concurrent_rps / serial_rps, 3),
        "batching": batching,
        "overload": {
            "sent": len(statuses),
            "ok": statuses.count(200),
            "rejected_429": statuses.count(429),
            "other": len(statuses) - statuses.count(200) - statuses.count(429),
        },
    }


def _p99(latencies: list[float]) -> float | None:
    if not latencies:
        return None
    ordered = sorted(latencies)
    return round(1000 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))], 1)


def model_context(args: argparse.Namespace) -> int | None:
    """The served model's context window, from its config (the server refuses longer prompts)."""
    from transformers import AutoConfig

    from branchwise.backends.hf.embedded import embedded_model_dir

    config = AutoConfig.from_pretrained(args.model or embedded_model_dir())
    return getattr(config, "max_position_embeddings", None)


async def _short_phase(
    args: argparse.Namespace, base: str, long_prompt: list[int] | None, delay: float = 0.0
) -> dict[str, Any]:
    """`--long-clients` clients x `--long-requests` short requests; with `long_prompt`, one long
    completion is sent `delay` seconds in (halfway through the phase without it, by default)."""
    limits = httpx.Limits(max_connections=args.long_clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as client:
        await _send(client, _body(0, args))  # warm-up of this server
        t_start = time.perf_counter()
        spans: list[tuple[float, float, int]] = []

        async def one_client(c: int) -> None:
            for k in range(args.long_requests):
                t0 = time.perf_counter()
                status, _ = await _send(client, _body(c * args.long_requests + k, args))
                spans.append((t0, time.perf_counter(), status))

        long_out: dict[str, Any] = {}

        async def long_one() -> None:
            await asyncio.sleep(delay)
            body = {"model": "served", "prompt": long_prompt, "max_tokens": 16, "temperature": 0.0}
            t0 = time.perf_counter()
            r = await client.post("/v1/completions", json=body)
            t1 = time.perf_counter()
            long_out.update(
                status=r.status_code,
                prompt_tokens=len(long_prompt or []),
                latency_ms=round(1000 * (t1 - t0), 1),
                window=(t0, t1),
            )

        tasks = [one_client(c) for c in range(args.long_clients)]
        if long_prompt is not None:
            tasks.append(long_one())
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_start
    latencies = [b - a for a, b, _ in spans]
    out: dict[str, Any] = {
        "requests": len(spans),
        "errors": sum(st != 200 for _, _, st in spans),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": _p99(latencies),
        "max_ms": round(1000 * max(latencies), 1),
        "wall_s": round(wall, 2),
    }
    if long_out:
        a, b = long_out.pop("window")
        overlapping = [e - s for s, e, _ in spans if s < b and e > a]
        out["long"] = long_out
        out["overlapping_requests"] = len(overlapping)
        out["overlapping_p99_ms"] = _p99(overlapping)
    return out


async def _long_prompt(base: str, tokens: int) -> list[int]:
    """`tokens` token ids of plain prose (the server's own tokenizer), repeated as needed."""
    text = (
        "The committee met on Tuesday to review the quarterly figures, the hiring plan and the "
        "schedule of the new warehouse. Each item was discussed in turn and the minutes were kept. "
    )
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
    return (ids * (tokens // len(ids) + 1))[:tokens]


def long_request(args: argparse.Namespace) -> dict[str, Any]:
    """Phase 4 (see the module docstring): chunked server (no long request, then with it), then
    a whole-prompt server (chunk 0) with it."""
    context = model_context(args)
    tokens = args.long_prompt if context is None else min(args.long_prompt, context - 16 - 1)
    out: dict[str, Any] = {"prompt_tokens": tokens, "context": context, "prefill_chunk": args.prefill_chunk}
    # "chunked": chunks sized by time (at most --prefill-chunk); "chunked_fixed": every chunk
    # --prefill-chunk tokens (--prefill-share 0, the policy before); "whole": chunk 0
    servers = [("chunked", args.prefill_chunk, []), ("whole", 0, [])]
    if "--prefill-share" in args.serve_options:
        servers.insert(1, ("chunked_fixed", args.prefill_chunk, ["--prefill-share", "0"]))
    for name, chunk, extra in servers:
        port = _free_port()
        proc = _start(args, port, prefill_chunk=chunk, extra=extra)
        out[f"{name}_server"] = proc.launched_with or "cli options"  # type: ignore[attr-defined]
        base = f"http://127.0.0.1:{port}"
        try:
            prompt = asyncio.run(_long_prompt(base, tokens))
            if name == "chunked":
                print("[serve_load] long request: no long request", file=sys.stderr, flush=True)
                out["no_long"] = asyncio.run(_short_phase(args, base, None))
            print(f"[serve_load] long request: {name} prefill", file=sys.stderr, flush=True)
            if args.long_delay is None:
                args.long_delay = round(out["no_long"]["wall_s"] / 2, 2)
            out["long_delay_s"] = args.long_delay
            out[f"with_long_{name}"] = asyncio.run(_short_phase(args, base, prompt, args.long_delay))
        finally:
            _stop(proc)
    base_p99 = out["no_long"]["p99_ms"]
    for name, _, _ in servers:
        p99 = out[f"with_long_{name}"]["p99_ms"]
        out[f"p99_ratio_{name}_vs_no_long"] = round(p99 / base_p99, 3) if base_p99 and p99 else None
    ratio = out["p99_ratio_chunked_vs_no_long"]
    out["goal"] = {"p99_ratio_chunked_vs_no_long": "<= 2", "met": ratio is not None and ratio <= 2.0}
    return out


async def _burst(args: argparse.Namespace, base: str, rss: RssWatch) -> dict[str, Any]:
    """The budget burst: `--kv-burst` requests at once, plus one that can never fit the budget."""
    body = {
        "model": "served",
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
        "n": args.kv_burst_n,
        "max_tokens": args.kv_burst_tokens,
        "temperature": 0.7,
    }
    huge = {**body, "n": 128, "max_tokens": 4096}
    limits = httpx.Limits(max_connections=args.kv_burst + 8)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as client:
        await _send(client, _body(0, args))
        rss.mark("after_warmup")
        t0 = time.perf_counter()

        async def send(b: dict[str, Any]) -> tuple[int, str]:
            r = await client.post("/v1/chat/completions", json=b)
            return r.status_code, r.text[:300]

        results = await asyncio.gather(*(send(body) for _ in range(args.kv_burst)), send(huge))
        seconds = time.perf_counter() - t0
        rss.mark("after_burst")
        health = (await client.get("/health")).json()
        await asyncio.sleep(2.0)
        rss.mark("after_burst_idle_2s")
    statuses = [st for st, _ in results[:-1]]
    huge_status, huge_text = results[-1]
    other = {st: statuses.count(st) for st in set(statuses) if st not in (200, 429)}
    return {
        "sent": len(statuses),
        "ok": statuses.count(200),
        "rejected_429": statuses.count(429),
        "errors_other_than_429": sum(other.values()),
        "other_statuses": {str(k): v for k, v in sorted(other.items())},
        "oversized_request": {"status": huge_status, "body": huge_text},
        "seconds": round(seconds, 2),
        "server_kv": health.get("kv"),
        "batching": health.get("batching"),
    }


def kv_burst(args: argparse.Namespace) -> dict[str, Any]:
    """Phase 5 (see the module docstring) on a server started with `--kv-budget`."""
    port = _free_port()
    # a queue that holds the whole burst: what limits it is the budget, not the 429 of a full queue
    proc = _start(args, port, kv_budget=args.kv_budget, queued_rows=(args.kv_burst + 1) * 128)
    rss = RssWatch(proc.pid).start()
    try:
        out = asyncio.run(_burst(args, f"http://127.0.0.1:{port}", rss))
    finally:
        marks = rss.stop()
        launched = proc.launched_with or "cli options"  # type: ignore[attr-defined]
        _stop(proc)
    budget_mb = (out.get("server_kv") or {}).get("budget_bytes")
    budget_mb = None if budget_mb is None else round(budget_mb / 2**20, 1)
    warm = marks.get("after_warmup")
    bound = None if budget_mb is None or warm is None else round(warm + budget_mb + args.rss_overhead_mb, 1)
    out["server"] = launched
    out["rss_mb"] = {
        **marks,
        "budget_mb": budget_mb,
        "overhead_mb_stated": args.rss_overhead_mb,
        "bound": bound,
        "peak_within_bound": None if bound is None or marks["peak"] is None else marks["peak"] <= bound,
    }
    return out


async def _sigterm(args: argparse.Namespace, base: str, proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    body = {
        "model": "served",
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "n": args.n,
        "max_tokens": args.sigterm_tokens,
        "temperature": 0.7,
    }
    limits = httpx.Limits(max_connections=args.sigterm_burst + 16)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as client:
        await _send(client, _body(0, args))

        async def send() -> dict[str, Any]:
            try:
                r = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as err:
                return {"status": None, "error": type(err).__name__}
            try:
                is_json = isinstance(r.json(), dict)
            except ValueError:
                is_json = False
            return {"status": r.status_code, "json": is_json}

        first = [asyncio.create_task(send()) for _ in range(args.sigterm_burst)]
        await asyncio.sleep(args.sigterm_after)
        t_term = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        later = [asyncio.create_task(send()) for _ in range(4)]
        results = await asyncio.gather(*first)
        after = await asyncio.gather(*later)
        code = await asyncio.to_thread(proc.wait, args.drain_timeout + 120)
        exit_s = time.perf_counter() - t_term

    def tally(rows: list[dict[str, Any]]) -> dict[str, int]:
        out = {"completed_200": 0, "json_503": 0, "connection_error": 0, "other": 0}
        for r in rows:
            if r["status"] == 200:
                out["completed_200"] += 1
            elif r["status"] == 503 and r.get("json"):
                out["json_503"] += 1
            elif r["status"] is None:
                out["connection_error"] += 1
            else:
                out["other"] += 1
        return out

    in_flight = tally(results)
    return {
        "in_flight": {"sent": len(results), **in_flight},
        "after_sigterm": {"sent": len(after), **tally(after)},
        "all_in_flight_answered": in_flight["completed_200"] + in_flight["json_503"] == len(results),
        "exit_code": code,
        "seconds_to_exit": round(exit_s, 2),
        "drain_timeout_s": args.drain_timeout,
    }


def sigterm(args: argparse.Namespace) -> dict[str, Any]:
    """Phase 6 (see the module docstring)."""
    port = _free_port()
    extra = ["--drain-timeout", str(args.drain_timeout)] if "--drain-timeout" in args.serve_options else []
    proc = _start(args, port, extra=extra)
    try:
        return asyncio.run(_sigterm(args, f"http://127.0.0.1:{port}", proc))
    finally:
        _stop(proc)


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {
            "clients": 8,
            "requests": 2,
            "serial": 4,
            "rounds": 2,
            "long_prompt": 0,
            "kv_burst": 8,
            "sigterm_burst": 4,
        },
    )
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=20, help="requests per client, back to back")
    parser.add_argument("--rounds", type=int, default=1, help="times the concurrent phase runs")
    parser.add_argument("--serial", type=int, default=32, help="requests of the one-at-a-time baseline")
    parser.add_argument("--n", type=int, default=4, help="samples per request")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (short answers)")
    parser.add_argument("--max-batch-rows", type=int, default=256, help="branches per decode pass")
    parser.add_argument("--max-queued-rows", type=int, default=None, help="queue bound (default clients*n)")
    parser.add_argument("--burst", type=int, default=None, help="overload burst (default 4x the queue)")
    parser.add_argument(
        "--continuous",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the server's continuous batching (--no-continuous: a request waits for the running batch)",
    )
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=9000,
        help="prompt tokens of the long request (capped at the context less 17); 0 skips phase 4",
    )
    parser.add_argument(
        "--long-clients", type=int, default=None, help="short clients of phase 4 (default --clients)"
    )
    parser.add_argument("--long-requests", type=int, default=4, help="short requests per client in phase 4")
    parser.add_argument(
        "--long-delay", type=float, default=None, help="seconds before the long request arrives"
    )
    parser.add_argument("--prefill-chunk", type=int, default=512, help="the chunked server's prefill chunk")
    parser.add_argument(
        "--kv-burst", type=int, default=64, help="requests of the budget burst; 0 skips phase 5"
    )
    parser.add_argument("--kv-burst-n", type=int, default=8, help="samples per burst request")
    parser.add_argument("--kv-burst-tokens", type=int, default=64, help="max_tokens per burst request")
    parser.add_argument("--kv-budget", default="256MiB", help="the KV budget of the burst's server")
    parser.add_argument(
        "--rss-overhead-mb",
        type=float,
        default=512.0,
        help="stated allowance over warm-up RSS + budget (activations of the largest batch, allocator slack)",
    )
    parser.add_argument(
        "--sigterm", action=argparse.BooleanOptionalAction, default=True, help="phase 6: SIGTERM mid-burst"
    )
    parser.add_argument("--sigterm-burst", type=int, default=16, help="requests in flight at SIGTERM")
    parser.add_argument("--sigterm-tokens", type=int, default=64, help="max_tokens of those requests")
    parser.add_argument("--sigterm-after", type=float, default=2.0, help="seconds from the burst to SIGTERM")
    parser.add_argument("--drain-timeout", type=float, default=10.0, help="the server's --drain-timeout")
    parser.add_argument(
        "--phases",
        nargs="+",
        default=["load", "long", "burst", "sigterm"],
        choices=["load", "long", "burst", "sigterm"],
        help="which parts to run (load = phases 1-3)",
    )
    args = parser.parse_args(argv)
    args.long_clients = args.long_clients or args.clients
    args.max_queued_rows = args.max_queued_rows or max(args.clients, args.long_clients) * args.n
    args.burst = args.burst or 4 * args.max_queued_rows // args.n
    set_threads(args.threads)  # the server gets the same through OMP_NUM_THREADS

    started = time.perf_counter()
    # a SIGTERM (`timeout`, a CI cancel) unwinds through `finally`, so the server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.serve_options = sorted(serve_options(args))
    out: dict[str, Any] = {}
    if "load" in args.phases:
        port = _free_port()
        proc = _start(args, port)
        rss = RssWatch(proc.pid).start()
        try:
            out = asyncio.run(_phases(args, f"http://127.0.0.1:{port}", rss))
        finally:
            out_rss = rss.stop()
            _stop(proc)
        out["rss_mb"] = out_rss
    if "long" in args.phases and args.long_prompt > 0:
        out["long_request"] = long_request(args)
    if "burst" in args.phases and args.kv_burst > 0:
        print("[serve_load] burst past the KV budget", file=sys.stderr, flush=True)
        out["kv_burst"] = kv_burst(args)
    if "sigterm" in args.phases and args.sigterm:
        print("[serve_load] SIGTERM during a burst", file=sys.stderr, flush=True)
        out["sigterm"] = sigterm(args)
    out["server_options"] = {
        "cli_has": args.serve_options,
        "launcher_used_for": [
            opt for opt in ("--kv-budget", "--prefill-chunk") if opt not in args.serve_options
        ],
    }
    # `_common.Bench.emit`'s envelope; the model runs in the server process, which resolves
    # --device / --dtype the same way a backend does
    device = resolve_device(args.device)
    emit(
        "serve_load",
        model=args.model or "embedded",
        device=device.type,
        dtype=str(resolve_dtype(args.dtype, device)).removeprefix("torch."),
        config={k: v for k, v in vars(args).items() if k != "model"},
        results=out,
        started=started,
    )


if __name__ == "__main__":
    main()
