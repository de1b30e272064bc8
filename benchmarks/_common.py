"""What every benchmark script shares: its command line, its problems, GPU synchronisation and the
JSON envelope of the one object it prints as the last line of stdout.

Why one envelope: every result carries the same provenance (model, device, dtype, the whole
configuration, wall time, machine), so outputs of different scripts and machines can be read the
same way. Medians and ratios are measured within one run, after warm-up: these machines are noisy,
so compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.step import STEP_MODES

THREADS_HELP = (
    "torch CPU threads (default: torch's choice). On a shared CPU, 1 keeps timings stable: with as "
    "many OpenMP threads as cores, a busy neighbour makes single solves swing by an order of magnitude"
)


class BenchParser(argparse.ArgumentParser):
    """The command line of a benchmark: `--model`, `--device`, `--dtype`, `--threads` and `--quick`
    first, then its own.

    `--quick` makes the script's `quick` settings the defaults (options given on the command line
    still win: `--quick --budget-fraction 0.75` is the smoke run at another budget), and its help
    lists them, so what a smoke run does is stated once.
    """

    def __init__(self, doc: str | None, quick: dict[str, Any], *, threads: int | None = None) -> None:
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.quick = quick
        self.add_argument(
            "--model", default=None, help="hub id or local path; default: embedded SmolLM2-135M"
        )
        self.add_argument("--device", default="auto", help="auto (cuda when present), cpu, cuda or cuda:N")
        self.add_argument(
            "--dtype",
            default="auto",
            help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16",
        )
        self.add_argument(
            "--threads",
            type=int,
            default=threads,
            help=THREADS_HELP + ("" if threads is None else f" (default here: {threads})"),
        )
        settings = ", ".join(f"--{k.replace('_', '-')} {_shown(v)}" for k, v in quick.items())
        self.add_argument("--quick", action="store_true", help=f"a smoke run: {settings}")

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> argparse.Namespace:  # type: ignore[override]
        unknown = sorted(set(self.quick) - {action.dest for action in self._actions})
        if unknown:
            raise TypeError(f"--quick sets options this script does not have: {unknown}")
        parsed = super().parse_args(args, namespace)
        if parsed.quick:  # parse again with the quick settings as defaults, so given options win
            defaults = {a.dest: a.default for a in self._actions if a.dest in self.quick}
            self.set_defaults(**self.quick)
            try:
                parsed = super().parse_args(args, namespace)
            finally:
                self.set_defaults(**defaults)
        return parsed

    def at_least_one(self, args: argparse.Namespace, *names: str) -> None:
        """A usage error naming the first of the options `names` (counts, sizes, rounds) below 1."""
        for name in names:
            if getattr(args, name) < 1:
                self.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def set_threads(n: int | None) -> None:
    """Pin torch's intra-op threads; `None` leaves torch's default (recorded by `machine()`)."""
    if n is not None:
        torch.set_num_threads(n)


def load_problems(task: str, n: int, seed: int, **settings: Any) -> list[tuple[str, Any, Any]]:
    """(question, entry, dataset) triples from a seeded reasoning-gym generator (`settings`: its options)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **settings)
    return [(entry["question"], entry, dataset) for entry in dataset]


def sync(backend: HFBackend) -> None:
    """Wait for queued GPU work so wall-clock timings cover it (RKSC §3.1 synchronises likewise)."""
    if backend.device.type == "cuda":
        torch.cuda.synchronize(backend.device)


def machine() -> dict[str, Any]:
    """Where the figures come from: library versions, CPU threads and the GPU (name, memory, CUDA)."""
    import transformers

    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "cuda": gpu,
        "python": platform.python_version(),
    }


@dataclass
class Bench:
    """One benchmark run: its name (the JSON's "benchmark" and the log prefix), options and backend."""

    name: str
    args: argparse.Namespace
    backend: HFBackend
    started: float = field(default_factory=time.perf_counter)

    def log(self, msg: str) -> None:
        """Progress goes to stderr, so stdout holds only the JSON object."""
        print(f"[{self.name}] {msg}", file=sys.stderr, flush=True)

    def emit(self, results: dict[str, Any], *, config: dict[str, Any] | None = None) -> None:
        """Print the envelope around `results` as one JSON line (`emit`): the run's model, device,
        dtype, `config` (every option but --model, updated with `config`: values derived from the
        options), the results, seconds since the run started (model load included), the machine."""
        backend = self.backend
        emit(
            self.name,
            model=backend.model_name,
            device=backend.device.type,
            dtype=str(backend.dtype).removeprefix("torch."),
            config={k: v for k, v in vars(self.args).items() if k != "model"} | (config or {}),
            results=results,
            started=self.started,
        )


def emit(
    name: str,
    *,
    model: str,
    device: str,
    dtype: str,
    config: dict[str, Any],
    results: dict[str, Any],
    started: float,
    digits: int = 1,
) -> None:
    """Print one benchmark's JSON envelope as one line: its name, model, device, dtype and
    configuration, its results, the seconds since `started` (`time.perf_counter()`, rounded to
    `digits`) and the machine; for a script without a backend of its own too (`Bench.emit`)."""
    envelope = {
        "benchmark": name,
        "model": model,
        "device": device,
        "dtype": dtype,
        "config": config,
        **results,
        "seconds": round(time.perf_counter() - started, digits),
        "machine": machine(),
    }
    print(json.dumps(envelope))


HF_STATIC_HELP = (
    "transformers' generate with cache_implementation='static', the baseline a user picks for speed: "
    "auto (default) as transformers runs it, compiled (torch.compile, CUDA graphs) on CUDA and "
    "uncompiled on the CPU, where transformers does not compile; compiled: compile on every device "
    "(on the CPU only where the backend did not pack the weights for oneDNN, else the arm is skipped "
    "and the JSON says why; ~1 minute per batch shape on 2 cores); off: leave the arm out"
)


def step_description(backend: HFBackend) -> str:
    """How the backend's decode steps ran, for the JSON: `compiled+graphs`, `compiled`, `graphs`
    or `eager` (the fixed-shape step, `step.py`), and why compilation stopped if it did."""
    stepper = backend.engine.stepper
    kind = "+".join(
        [*(["compiled"] if stepper.compiler is not None else []), *(["graphs"] if stepper.recorder else [])]
    )
    compiler = stepper.compiler
    if compiler is None:
        return kind or "eager"
    status = compiler.status()
    left = "; ".join(status["uncompiled"])
    return f"{kind} ({status['compiled']} kinds compiled, {status['loaded']} loaded" + (
        f"; uncompiled: {left})" if left else ")"
    )


def resolve_for_children(args: argparse.Namespace) -> None:
    """Pin the threads and resolve `--device`/`--dtype` to what they mean here, in place: a script
    that times child processes (`compile_ahead.py`, `first_constrained.py`) hands them these, so
    every child runs on the same device and dtype whatever `auto` would pick there."""
    from branchwise.backends.hf.backend import resolve_device, resolve_dtype

    set_threads(args.threads)
    device = resolve_device(args.device)
    args.device, args.dtype = str(device), str(resolve_dtype(args.dtype, device)).removeprefix("torch.")


def settle(backend: HFBackend, timeout_s: float = 3600.0) -> None:
    """Wait until no kind of batch is compiling in the background (`StepCompiler.wait`): a benchmark
    of the compiled step calls it after its warm-up, so that it times compiled steps; requests
    never wait for it."""
    compiler = backend.engine.stepper.compiler
    if compiler is not None:
        compiler.wait(timeout_s)


def add_decode_step_option(parser: argparse.ArgumentParser, default: str = "auto", why: str = "") -> None:
    """`--decode-step`: HFBackend's `decode_step` (`step.py`), for the benchmarks that time it."""
    parser.add_argument(
        "--decode-step",
        choices=STEP_MODES,
        default=default,
        help="HFBackend's decode_step ('auto': compiled, and captured as CUDA graphs on CUDA; kinds of "
        f"batch not compiled yet run eagerly while a worker compiles them){why}",
    )


def add_hf_static_option(parser: argparse.ArgumentParser) -> None:
    """`--hf-static auto|compiled|off` (`HF_STATIC_HELP`)."""
    parser.add_argument(
        "--hf-static", choices=["auto", "compiled", "off"], default="auto", help=HF_STATIC_HELP
    )


class StaticGenerate:
    """`model.generate(..., cache_implementation="static")`, greedy, on a left-padded batch: the
    baseline a user would pick for speed, since transformers compiles the decode step of a static
    cache (torch.compile, mode reduce-overhead: CUDA graphs) by itself on a GPU.

    Why its own arm beside `HFBackend.hf_generate` (dynamic cache, eager): on a GPU the two differ
    by ~5x, and a claim against the eager one only would flatter branchwise. `report()` says whether
    the forward was compiled in this run, so a CPU figure (uncompiled unless `mode="compiled"`) is
    never read as the compiled baseline. `skipped` says why the arm does not run, if it does not.
    """

    def __init__(self, backend: HFBackend, mode: str) -> None:
        if mode not in ("auto", "compiled", "off"):
            raise ValueError(f"--hf-static {mode!r} is not one of 'auto', 'compiled', 'off'")
        self.backend, self.mode = backend, mode
        self.compile_config: Any = None
        self.skipped: str | None = None
        if mode == "off":
            self.skipped = "--hf-static off"
        elif mode == "compiled" and backend.prepacked.active:
            self.skipped = (
                "--hf-static compiled: torch.compile cannot lower the linear layers this backend packed "
                "for the CPU's oneDNN kernels (prepack.py); the compiled static cache is a GPU baseline"
            )
        elif mode == "compiled":
            from transformers import CompileConfig

            self.compile_config = CompileConfig()
            # transformers' own switch to compile off accelerators ("useful for testing purposes")
            self.compile_config._compile_all_devices = True

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        tokens = self.backend.hf_generate(
            prompts,
            max_new_tokens,
            exact_length=True,
            cache_implementation="static",
            compile_config=self.compile_config,
        )
        assert isinstance(tokens, list)  # (no cache bytes asked for)
        return tokens

    def report(self) -> dict[str, Any]:
        """How the arm ran: `compiled` is whether transformers built its compiled forward (it keeps
        it as `_compiled_call` on the model), with a note wherever that is not the GPU baseline."""
        if self.skipped is not None:
            return {"mode": self.mode, "skipped": self.skipped}
        compiled = hasattr(self.backend.model, "_compiled_call")
        note = None
        if not compiled and self.backend.device.type == "cpu" and self.mode == "auto":
            note = (
                "uncompiled: transformers compiles the static-cache step only on accelerators, so on "
                "the CPU this arm is the static cache run eagerly"
            )
        elif not compiled:
            note = "transformers did not compile the static-cache step here: not the compiled baseline"
        return {"mode": self.mode, "compiled": compiled, "note": note}


def start(name: str, args: argparse.Namespace, **backend_options: Any) -> Bench:
    """Pin the threads, then load the backend (`--model`, `--device`, `--dtype`, plus
    `backend_options`) and start the clock.

    The prefix cache across requests is off unless a benchmark asks for it (`cache_bytes=...`): a
    benchmark times the same prompt several times, and with the cache on every repeat after the
    first would skip its prompt in the exact-sharing arms only (a session with an acceleration, or
    with `share="none"`, never reads the cache), so their ratios would measure the cache."""
    backend_options.setdefault("cache_bytes", 0)
    backend_options.setdefault("device", args.device)
    backend_options.setdefault("dtype", args.dtype)
    set_threads(args.threads)
    started = time.perf_counter()
    return Bench(name, args, HFBackend(args.model, **backend_options), started)
