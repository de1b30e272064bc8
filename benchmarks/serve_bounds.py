"""Probe of `branchwise serve`'s bounds under abuse: the KV budget, and work left by clients that go.

Starts `branchwise serve` (the embedded model, or `--model`) as a subprocess at `--kv-budget`, then
fires `--requests` concurrent completions of `--prompt-tokens` token ids each (the same prompt for
all, or with `--distinct` one of its own per request), all at once. Every `--disconnect-every`-th
client gives up after `--disconnect-after` seconds (its connection closes mid-request: queued,
prefilling or decoding, wherever the server has it then). Meanwhile `/health` is sampled every
`--sample-ms` milliseconds.

Reported (one JSON line): the peak of `used_bytes` (every byte of KV the server counts) and its
ratio to the budget (the bound says <= 1); how the requests ended: ``answered`` (200),
``refused`` (429 or 503: retry later, never an error), ``too_big`` (a 4xx saying the request alone
can never fit the budget), ``disconnected`` (the clients that left on purpose) and ``lost``
(anything else: a timeout at `--timeout`, a 5xx, a broken connection); the server's own counts
(preemptions, overruns and their peak bytes, cancelled requests); and, once every client has left,
the seconds until `/health` says ``busy`` false (``idle_after_s``) and until no live KV is held
(``kv_released_after_s``: ``bytes_held`` 0; the prefix cache may keep prompts, within the budget).

Why a subprocess: the server is probed as a client meets it (its own process, its own memory), and
a server that keeps computing after its clients left shows in ``idle_after_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from _common import BenchParser, emit, set_threads
from serve_load import _free_port, _stop, wait_healthy

ROOT = Path(__file__).resolve().parent.parent

QUICK = {
    "requests": 8,
    "prompt_tokens": 600,
    "max_tokens": 16,
    "kv_budget": "64MiB",
    "decode_step": "eager",
    "timeout": 300.0,
}


def _start(args: argparse.Namespace, port: int) -> subprocess.Popen[bytes]:
    """`branchwise serve` on `port` at the probe's budget; its stderr goes to a file (read back if
    it exits early)."""
    cmd = [sys.executable, "-m", "branchwise", "serve", "--port", str(port), "--kv-budget", args.kv_budget]
    cmd += ["--device", args.device, "--dtype", args.dtype, "--decode-step", args.decode_step]
    cmd += ["--max-queued-rows", str(max(args.requests, 1))]
    if args.model:
        cmd += ["--model", args.model]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed with its server (`serve_load._stop`)
    env = None if not args.threads else {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=env)
    proc.log = log  # type: ignore[attr-defined]
    return proc


class Sampler:
    """`/health` read every `every_s` seconds: the peak of its KV figures and the last reading."""

    def __init__(self, url: str, every_s: float) -> None:
        self.url, self.every_s = url, every_s
        self.peak_used = 0
        self.samples = 0
        self.last: dict[str, Any] = {}
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while not self.stop.is_set():
                await self.read(client)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), self.every_s)

    async def read(self, client: httpx.AsyncClient) -> dict[str, Any]:
        health = (await client.get(f"{self.url}/health")).json()
        self.peak_used = max(self.peak_used, int(health["kv"]["used_bytes"]))
        self.samples += 1
        self.last = health
        return health


def _prompts(args: argparse.Namespace) -> list[list[int]]:
    """Token-id prompts: one for every request, or (`--distinct`) one each."""
    rng = random.Random(args.seed)
    low, high = args.id_range
    one = [rng.randrange(low, high) for _ in range(args.prompt_tokens)]
    if not args.distinct:
        return [one] * args.requests
    return [[rng.randrange(low, high) for _ in range(args.prompt_tokens)] for _ in range(args.requests)]


async def _client(url: str, prompt: list[int], args: argparse.Namespace, leaves: bool) -> str:
    """One request; how it ended (see the module docstring)."""
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        post = client.post(f"{url}/v1/completions", json=body)
        try:
            r = await (asyncio.wait_for(post, args.disconnect_after) if leaves else post)
        except TimeoutError:
            return "disconnected" if leaves else "lost"
        except httpx.TimeoutException:
            return "lost"
        except httpx.HTTPError:
            return "lost"
    if r.status_code == 200:
        return "answered"
    if r.status_code in (429, 503):
        return "refused"
    if r.status_code in (400, 413) and "kv_budget" in r.text:
        return "too_big"
    return "lost"


async def _settle(sampler: Sampler, limit_s: float) -> tuple[float | None, float | None]:
    """Seconds until /health says not busy, and until no live KV is held (None: not within `limit_s`)."""
    start = time.monotonic()
    idle = released = None
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - start < limit_s and (idle is None or released is None):
            health = await sampler.read(client)
            now = round(time.monotonic() - start, 2)
            if idle is None and not health["busy"]:
                idle = now
            if released is None and not health["kv"]["bytes_held"]:
                released = now
            await asyncio.sleep(0.05)
    return idle, released


async def probe(args: argparse.Namespace, url: str) -> dict[str, Any]:
    sampler = Sampler(url, args.sample_ms / 1000)
    sampling = asyncio.create_task(sampler.run())
    prompts = _prompts(args)
    every = args.disconnect_every
    started = time.monotonic()
    ends = await asyncio.gather(
        *(_client(url, p, args, bool(every) and i % every == every - 1) for i, p in enumerate(prompts))
    )
    took = round(time.monotonic() - started, 1)
    sampler.stop.set()
    await sampling
    idle, released = await _settle(sampler, args.settle_timeout)
    kv = sampler.last["kv"]
    budget = int(kv["budget_bytes"])
    counts = {k: ends.count(k) for k in ("answered", "refused", "too_big", "disconnected", "lost")}
    return {
        **counts,
        "requests": len(ends),
        "clients_s": took,
        "budget_bytes": budget,
        "peak_used_bytes": sampler.peak_used,
        "peak_over_budget": round(sampler.peak_used / budget, 3),
        "within_budget": sampler.peak_used <= budget,
        "health_samples": sampler.samples,
        "preemptions": kv.get("preemptions"),
        "overruns": kv.get("overruns"),
        "overrun_bytes": kv.get("overrun_bytes"),
        "cancelled": sampler.last["batching"]["cancelled"],
        "idle_after_s": idle,
        "kv_released_after_s": released,
    }


def main() -> None:
    parser = BenchParser(__doc__, QUICK, threads=None)
    parser.add_argument("--kv-budget", default="256MiB", help="the server's --kv-budget")
    parser.add_argument("--requests", type=int, default=32, help="concurrent requests")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="token ids per prompt")
    parser.add_argument("--distinct", action="store_true", help="a prompt of its own per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument(
        "--disconnect-every", type=int, default=4, help="every k-th client leaves midway (0: none)"
    )
    parser.add_argument("--disconnect-after", type=float, default=5.0, help="seconds before it leaves")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a client waits at most")
    parser.add_argument("--settle-timeout", type=float, default=120.0, help="seconds to wait for idle")
    parser.add_argument("--sample-ms", type=float, default=50.0, help="/health sampling period")
    parser.add_argument(
        "--decode-step", default="auto", help="the server's --decode-step (eager: no background compile)"
    )
    parser.add_argument(
        "--id-range", type=int, nargs=2, default=(1000, 2000), help="token ids are drawn from [low, high)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in ("requests", "prompt_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    set_threads(args.threads)
    started = time.perf_counter()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(args, port)
    try:
        wait_healthy(proc, url, 600.0, "branchwise serve")  # a starting server answers 503
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        results = asyncio.run(probe(args, url))
    finally:
        _stop(proc)
    config = {k: v for k, v in vars(args).items() if k != "model"}
    emit(
        "serve_bounds",
        model=model,
        device=args.device,
        dtype=args.dtype,
        config=config,
        results=results,
        started=started,
    )


if __name__ == "__main__":
    main()
