"""Load test of `branchwise serve`: concurrent clients vs. the same requests one at a time.

Starts `branchwise serve` (the embedded model, or `--model`) as a subprocess on 127.0.0.1, then:
1. serial: a sample of the requests sent one at a time (the no-batching baseline, measured first so
   the model is warm for both phases);
2. concurrent: `--clients` clients each send `--requests` chat requests (n samples, short answers)
   back to back; the scheduler batches whatever is queued into shared decode passes;
3. overload: a burst of `--burst` simultaneous requests against a queue bounded at
   `--max-queued-rows` branches: the excess must get 429 (never an error or unbounded memory),
   and the server's resident memory is read before and after.
Prints one JSON object (last line): errors, p50/p99 latency, throughput of both phases and their
ratio (goal >= 4x), the scheduler's batching histogram, and the overload outcome.
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
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import torch
from _common import BenchParser, machine, set_threads

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float | None:
    """Resident memory of the server process (Linux /proc); None elsewhere."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _start(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "branchwise", "serve", "--port", str(port)]
    cmd += ["--max-queued-rows", str(args.max_queued_rows), "--max-batch-rows", str(args.max_batch_rows)]
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


async def _phases(args: argparse.Namespace, base: str) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=args.burst + args.clients + 8)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        await _send(client, _body(0, args))  # warm-up
        t0 = time.perf_counter()
        serial = [await _send(client, _body(i, args)) for i in range(args.serial)]
        serial_s = time.perf_counter() - t0

        async def one_client(c: int) -> list[tuple[int, float]]:
            return [await _send(client, _body(c * args.requests + k, args)) for k in range(args.requests)]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(args.clients)))
        concurrent_s = time.perf_counter() - t0
        batching = (await client.get("/health")).json()["batching"]
        burst = await asyncio.gather(*(_send(client, _body(i, args)) for i in range(args.burst)))
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
    parser = BenchParser(__doc__, {"clients": 8, "requests": 2, "serial": 4})
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=20, help="requests per client, back to back")
    parser.add_argument("--serial", type=int, default=32, help="requests of the one-at-a-time baseline")
    parser.add_argument("--n", type=int, default=4, help="samples per request")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (short answers)")
    parser.add_argument("--max-batch-rows", type=int, default=256, help="branches per decode pass")
    parser.add_argument("--max-queued-rows", type=int, default=None, help="queue bound (default clients*n)")
    parser.add_argument("--burst", type=int, default=None, help="overload burst (default 4x the queue)")
    args = parser.parse_args(argv)
    args.max_queued_rows = args.max_queued_rows or args.clients * args.n
    args.burst = args.burst or 4 * args.max_queued_rows // args.n
    set_threads(args.threads)  # the server gets the same through OMP_NUM_THREADS

    started = time.perf_counter()
    # a SIGTERM (`timeout`, a CI cancel) unwinds through `finally`, so the server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    port = _free_port()
    proc = _start(args, port)
    try:
        rss_before = _rss_mb(proc.pid)
        out = asyncio.run(_phases(args, f"http://127.0.0.1:{port}"))
        rss_after = _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(120)
    out["overload"].update(rss_mb_before=rss_before, rss_mb_after=rss_after)
    # `_common.Bench.emit`'s envelope; the model runs in the server process, so its device is the
    # one this machine offers and its dtype the server's "auto"
    envelope = {
        "benchmark": "serve_load",
        "model": args.model or "embedded",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "dtype": "auto",
        "config": {k: v for k, v in vars(args).items() if k != "model"},
        **out,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine(),
    }
    print(json.dumps(envelope))


if __name__ == "__main__":
    main()
