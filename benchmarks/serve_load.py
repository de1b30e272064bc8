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

Prints one JSON object (last line): errors, p50/p99 latency, throughput of both phases and their
ratio (goal >= 4x), the scheduler's batching histogram, the overload outcome and ``rss_mb``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from _common import BenchParser, machine, set_threads

from branchwise.backends.hf.backend import resolve_device, resolve_dtype

ROOT = Path(__file__).resolve().parent.parent


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


def _start(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "branchwise", "serve", "--port", str(port)]
    cmd += ["--max-queued-rows", str(args.max_queued_rows), "--max-batch-rows", str(args.max_batch_rows)]
    cmd += ["--continuous" if args.continuous else "--no-continuous"]
    cmd += ["--device", args.device, "--dtype", args.dtype]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(3000):  # bounded: up to ~5 minutes for a model load on a busy machine
        if proc.poll() is not None:
            raise SystemExit(
                f"branchwise serve exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("branchwise serve did not come up")


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


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, {"clients": 8, "requests": 2, "serial": 4, "rounds": 2})
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
    args = parser.parse_args(argv)
    args.max_queued_rows = args.max_queued_rows or args.clients * args.n
    args.burst = args.burst or 4 * args.max_queued_rows // args.n
    set_threads(args.threads)  # the server gets the same through OMP_NUM_THREADS

    started = time.perf_counter()
    # a SIGTERM (`timeout`, a CI cancel) unwinds through `finally`, so the server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = _free_port()
    proc = _start(args, port)
    rss = RssWatch(proc.pid).start()
    try:
        out = asyncio.run(_phases(args, f"http://127.0.0.1:{port}", rss))
    finally:
        out_rss = rss.stop()
        proc.terminate()
        proc.wait(120)
    out["rss_mb"] = out_rss
    # `_common.Bench.emit`'s envelope; the model runs in the server process, which resolves
    # --device / --dtype the same way a backend does
    device = resolve_device(args.device)
    envelope = {
        "benchmark": "serve_load",
        "model": args.model or "embedded",
        "device": device.type,
        "dtype": str(resolve_dtype(args.dtype, device)).removeprefix("torch."),
        "config": {k: v for k, v in vars(args).items() if k != "model"},
        **out,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }
    print(json.dumps(envelope))


if __name__ == "__main__":
    main()
