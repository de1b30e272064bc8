"""The compiled decode step compiled ahead, as a server meets it: cold start, warm start, no wait.

Why: a compilation costs minutes per kind of batch on a small CPU, and it used to run inside the
request that first met the kind (374 s for one request, 368 s before `serve --decode-step compiled`
listened). Now a worker process compiles each kind while the steps run uncompiled
(`backends/hf/step_compiler.py`), and the compiled steps stay in the cache folder for the next
process. This script measures that path end to end, in two fresh processes sharing one empty cache
folder (nothing else of branchwise's cache is used: the model is passed as a path):

* ``cold``: the first process. `load_s` (the model ready: what a server needs before it listens;
  then `kernel_build_s`, the paged kernel built into the fresh folder, and `preload_s`, loading
  what an earlier process compiled, none here),
  then (after one untimed uncompiled request of each kind, the process's own first-call costs)
  requests at once while its kinds compile: a lone decode of `--tokens` tokens and a
  self-consistency request (`--samples` rows over a shared prompt), each timed, with how many of
  their steps ran compiled; `ready_s`, the seconds until every kind met is compiled and loaded;
  then the same requests, compiled and uncompiled (eager), interleaved `--repeats` times;
* ``warm``: a second process on the same folder: the same, its kinds preloaded instead of compiled
  (`load_s` + `preload_s` is a warm server's start).

Ratios, each within one process: `first_vs_eager` (the first request, run while its kind compiled,
against the median uncompiled one: at most about 1 where no request waits for the compiler;
above 1 only by the worker's share of the cores), `compiled_vs_eager` (tokens/s). A process's
`compiles` and `loaded` say where its compiled steps came from.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BenchParser, emit, resolve_for_children

QUICK = {"layers": 2, "tokens": 8, "samples": 4, "repeats": 2}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def child(args: Any) -> dict[str, Any]:
    """One process's run (see the module docstring), as a dict."""
    import torch

    from branchwise.backends import DecodeParams
    from branchwise.backends.hf import HFBackend, cpu_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    backend = HFBackend(
        args.model, device=args.device, dtype=args.dtype, cache_bytes=0, decode_step="compiled"
    )
    load_s = time.perf_counter() - start
    # the paged kernel, built once per machine (this folder is fresh: the cold process builds it,
    # the warm one loads it): until it is there a paged batch reads a copy, which never compiles
    # (`step_compiler.not_compiled`), so the requests below would time that passing state instead
    t = time.perf_counter()
    kernel = cpu_kernels.build()
    kernel_s = time.perf_counter() - t
    compiler = backend.engine.stepper.compiler
    assert compiler is not None
    t = time.perf_counter()
    preloaded = backend.preload_steps()  # as `branchwise serve` does before it listens (`warm_up`)
    preload_s = time.perf_counter() - t
    params = DecodeParams(max_tokens=args.tokens, min_tokens=args.tokens)
    prompt = backend.encode(PROMPT)

    def request(kind: str, mode: str) -> tuple[float, float]:
        """Seconds of one request and the share of its steps that ran compiled."""
        backend.decode_step = mode  # type: ignore[assignment]
        session = backend.session()
        t = time.perf_counter()
        root = session.prefill(prompt)
        nodes = [root] if kind == "lone" else session.fork(root, args.samples)
        session.extend(nodes, params)
        took = time.perf_counter() - t
        session.release([root, *nodes] if kind != "lone" else [root])
        stats = session.kv_stats().as_dict()
        steps = stats.get("decode_steps_compiled", 0) + stats.get("decode_steps_uncompiled", 0)
        return took, (stats.get("decode_steps_compiled", 0) / steps) if steps else 0.0

    for kind in ("lone", "samples"):  # a process's first decode of each kind, uncompiled, untimed:
        request(kind, "eager")  # what `first_s` is compared with is the compiler running beside it
    first = {kind: request(kind, "compiled") for kind in ("lone", "samples")}
    t = time.perf_counter()
    compiler.wait(args.wait)
    ready_s = time.perf_counter() - t + sum(took for took, _ in first.values())
    timed: dict[str, dict[str, list[float]]] = {k: {"compiled": [], "eager": []} for k in first}
    for r in range(args.repeats):
        for kind in first:
            for mode in ("compiled", "eager") if r % 2 == 0 else ("eager", "compiled"):
                timed[kind][mode].append(request(kind, mode)[0])
    rows = {}
    for kind, (took, share) in first.items():
        compiled, eager = (round(statistics.median(timed[kind][m]), 3) for m in ("compiled", "eager"))
        took = round(took, 3)  # every ratio below is the quotient of the figures shown
        tokens = args.tokens * (1 if kind == "lone" else args.samples)
        rows[kind] = {
            "first_s": round(took, 3),
            "first_compiled_share": round(share, 3),
            "compiled_s": round(compiled, 3),
            "eager_s": round(eager, 3),
            "compiled_tok_s": round(tokens / compiled, 1),
            "eager_tok_s": round(tokens / eager, 1),
            "first_vs_eager": round(took / eager, 3),
            "compiled_vs_eager": round(eager / compiled, 3),
        }
    status = compiler.status()
    return {
        "load_s": round(load_s, 2),
        "kernel_build_s": round(kernel_s, 2),
        "kernel_unavailable": kernel,
        "preloaded": preloaded,
        "preload_s": round(preload_s, 2),
        "ready_s": round(ready_s, 1),
        "rows": rows,
        "status": status,
    }


def tiny_model(layers: int, out: Path) -> str:
    """The embedded model's config and tokenizer with `layers` layers and random weights (a quick
    run compiles in seconds what the whole model compiles in minutes)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from branchwise.backends.hf.embedded import embedded_model_dir

    src = embedded_model_dir()
    config = AutoConfig.from_pretrained(src)
    config.num_hidden_layers = layers
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def main() -> None:
    parser = BenchParser(__doc__, QUICK)
    parser.add_argument(
        "--layers", type=int, default=0, help="a random model of this many layers (0: the model itself)"
    )
    parser.add_argument("--tokens", type=int, default=32, help="tokens per row of each request")
    parser.add_argument("--samples", type=int, default=8, help="rows of the self-consistency request")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per mode (median)")
    parser.add_argument(
        "--wait", type=float, default=3600.0, help="the most seconds to wait for the compiler"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    started = time.perf_counter()
    resolve_for_children(args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.layers:
            args.model = tiny_model(args.layers, Path(tmp) / "model")
        elif args.model is None:
            from branchwise.backends.hf.embedded import embedded_model_dir

            args.model = str(embedded_model_dir())
        env = {**os.environ, "BRANCHWISE_CACHE_DIR": str(Path(tmp) / "cache")}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the worker's goes under the empty cache folder
        command = [sys.executable, __file__, "--child", "--model", args.model, "--device", args.device,
                   "--dtype", args.dtype, "--tokens", str(args.tokens), "--samples", str(args.samples),
                   "--repeats", str(args.repeats), "--wait", str(args.wait)]  # fmt: skip
        if args.threads:
            command += ["--threads", str(args.threads)]
        runs = {}
        for phase in ("cold", "warm"):
            t = time.perf_counter()
            out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
            if out.returncode:
                raise SystemExit(f"the {phase} process failed:\n{out.stderr[-3000:]}")
            runs[phase] = {
                **json.loads(out.stdout.strip().splitlines()[-1]),
                "process_s": round(time.perf_counter() - t, 1),
            }
    config = {k: v for k, v in vars(args).items() if k not in ("model", "child")}
    emit("compile_ahead", model=args.model, device=args.device, dtype=args.dtype, config=config,
         results=runs, started=started)  # fmt: skip


if __name__ == "__main__":
    main()
