"""The compile worker process as the engine sees it: what it builds its model from (`ModelSpec`),
whether it fits the memory left (`worker_room`), starting it, holding it stopped while this process
computes, and its replies (`Worker`). The worker's own side is `step_worker.py`; what it is for,
`step_compiler.py`.

Why a module of its own: it is process management (a child's priority, signals, pipes, memory), a
concern apart from which kinds of batch compile and how a compiled step is trusted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
import transformers

from branchwise.backends.compute_thread import COMPUTE
from branchwise.backends.hf.pool import free_memory

WORKER_NICENESS = 10
"""How much lower the worker's scheduling priority is than the process it compiles for, from its
first instruction (its imports and model build included): the serving process's uncompiled steps
must not queue behind it for the cores. Inductor's own compile processes inherit it."""

WORKER_IDLE_S = 300.0
"""Seconds the worker process waits for another kind before it exits (its copy of the model goes
with it; the next new kind starts one again)."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the worker process needs to build a model that compiles to the same step: the model's
    config, dtype, device, and whether its linear layers were packed (`prepack.py`)."""

    config: dict[str, Any]
    dtype: str
    device: str
    prepacked: bool

    @classmethod
    def of(cls, model: torch.nn.Module, prepacked: bool) -> ModelSpec:
        param = next(model.parameters())
        config = json.loads(model.config.to_json_string(use_diff=False))  # type: ignore[union-attr,operator]
        return cls(config, str(param.dtype).removeprefix("torch."), str(param.device), prepacked)

    def weight_bytes(self) -> int:
        """Bytes of the weights the worker builds: a model of this config and dtype, built on the
        meta device (nothing allocated). Why not the engine's own parameters: packed products are
        no parameters (`prepack.py`), so the live model under-counts what the worker will hold."""
        from transformers import AutoConfig, AutoModelForCausalLM

        dtype = getattr(torch, self.dtype)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**self.config), dtype=dtype)
        return sum(p.numel() for p in model.parameters()) * dtype.itemsize

    def fingerprint(self) -> str:
        """Everything a compiled step depends on besides the kind of batch: a change of any of these
        (another torch, another CPU, an edited step) makes another folder of compiled steps."""
        here = Path(__file__).parent
        code = [hashlib.sha256((here / name).read_bytes()).hexdigest() for name in STEP_SOURCES]
        text = json.dumps(
            [self.config, self.dtype, self.device, self.prepacked, torch.__version__, transformers.__version__, code,
             sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability()],
            sort_keys=True, default=str,
        )  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:16]


STEP_SOURCES = (
    "step.py", "step_attention.py", "step_inputs.py", "step_replay.py", "attention.py", "batch.py", "block_pool.py",
    "arch.py", "prepack.py", "step_worker.py", "own_kv.py", "cpu_kernels.py",
)  # fmt: skip
"""The modules whose code a compiled step was traced from: a compiled step never outlives an edit."""


WORKER_BASE_BYTES = 1 << 30
"""Host memory a compile worker takes besides its copy of the weights: torch, transformers and
inductor imported, and a compilation's tracing (`worker_room`). Measured: a peak of 1.33 GiB for
the embedded 135M model's three first kinds in fp32, 0.50 GiB of it weights."""


def worker_room(spec: ModelSpec) -> str | None:
    """Why a compile worker for `spec` would not fit in the host memory available now (None: it
    fits). Why ask: the worker builds a copy of the model (packed as
    the engine's, so every byte of it is touched) beside the engine's own, and a model that fills
    half a machine would push both into swap or the OOM killer; its kinds run eagerly instead, and
    compiled steps an earlier process left in the cache are still loaded (that needs no worker).
    On CUDA the copy is on the device: not checked here."""
    if spec.device != "cpu":
        return None
    available = free_memory(torch.device("cpu"))
    need = spec.weight_bytes() + WORKER_BASE_BYTES
    if available >= need:
        return None
    return (
        f"a compile worker would take {need / 2**30:.1f} GiB (a copy of the weights and its "
        f"compiler) and {available / 2**30:.1f} GiB of memory is available"
    )


class Worker:
    """The compile worker process (`python -m branchwise.backends.hf.step_worker`): kinds go to it
    one at a time through its stdin, replies come back on its stdout to a reader thread. It exits
    by itself after `WORKER_IDLE_S` idle; this process stops it at exit."""

    def __init__(self, spec: ModelSpec, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        spec_path = folder / "model.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        env = dict(os.environ)  # inductor's cache folder too: the kernels it builds are found here
        # one compile process at a time, so that on a small machine the serving process keeps the
        # other cores (its OpenMP threads slow down sharply when a busy process takes one from them)
        env.update(TORCHINDUCTOR_COMPILE_THREADS="1")
        self._log: IO[bytes] = (folder / "worker.log").open("ab")
        command = [
            sys.executable,
            "-m",
            "branchwise.backends.hf.step_worker",
            str(spec_path),
            str(WORKER_IDLE_S),
        ]
        nice = shutil.which("nice")  # POSIX; elsewhere the worker runs at the usual priority
        self._proc = spawn([nice, "-n", str(WORKER_NICENESS), *command] if nice else command, self._log, env)
        self._jobs: dict[str, Callable[[str, dict[str, Any]], None]] = {}
        self._lock = threading.Lock()
        self.paused_s = 0.0
        """Seconds the worker was held stopped while this process computed."""
        self._paused_at: float | None = None
        self._closed = False
        threading.Thread(target=self._read, name="step-worker-replies", daemon=True).start()
        _LIVE.add(self)
        # On a CPU the worker shares the cores with the steps it compiles for: a compiling process
        # beside them made the first requests 3-15x slower (each of OpenMP's thousands of barriers
        # a step waits for a thread the compile has descheduled). So it compiles only while this
        # process has nothing to compute: stopped (SIGSTOP) when computing starts, continued once it
        # has been idle a moment. A server that never idles runs uncompiled steps at their own speed.
        pausable = spec.device == "cpu" and hasattr(signal, "SIGSTOP")
        self._unwatch = COMPUTE.watch(self._pace) if pausable else None

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def _pace(self, busy: bool) -> None:
        """Stop the worker while this process computes, continue it when idle (`COMPUTE.watch`)."""
        if not self.alive() or busy == self.paused:
            return
        try:
            os.kill(self._proc.pid, signal.SIGSTOP if busy else signal.SIGCONT)
        except ProcessLookupError:  # it just exited
            return
        now = time.monotonic()
        if busy:
            self._paused_at = now
        else:
            assert self._paused_at is not None
            self.paused_s += now - self._paused_at
            self._paused_at = None

    def alive(self) -> bool:
        return self._proc.poll() is None

    def submit(
        self, kind: str, batch: dict[str, Any], path: Path, done: Callable[[str, dict[str, Any]], None]
    ) -> None:
        job = path.with_suffix(".batch")  # kept: the step is warmed on it where it is loaded
        torch.save(batch, job)
        with self._lock:
            self._jobs[kind] = done
        assert self._proc.stdin is not None
        # torch's thread count is part of a compiled step's guards: the worker compiles at this
        # process's (it computes nothing itself meanwhile)
        order = {"kind": kind, "batch": str(job), "path": str(path), "threads": torch.get_num_threads()}
        self._proc.stdin.write((json.dumps(order) + "\n").encode())
        self._proc.stdin.flush()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                reply = json.loads(line)
            except ValueError:
                continue
            with self._lock:
                done = self._jobs.pop(reply.get("kind", ""), None)
            if done is not None:
                done(reply["kind"], reply)
        self._proc.wait()
        with self._lock:  # the worker ended: whatever it had not answered failed
            left, self._jobs = self._jobs, {}
        if self._closed:  # stopped by this process (its exit, its engine gone): nothing failed
            return
        for kind, done in left.items():
            done(
                kind,
                {
                    "ok": False,
                    "error": f"the compile worker exited ({self._proc.returncode}); see worker.log",
                },
            )

    def close(self) -> None:
        self._closed = True
        if self._unwatch is not None:
            self._unwatch()
        if self.alive():
            self._proc.kill()  # (SIGKILL ends a stopped process too)
            self._proc.wait()
        self._log.close()
        _LIVE.discard(self)


def spawn(command: list[str], log: IO[bytes], env: dict[str, str]) -> subprocess.Popen[bytes]:
    """Start the compile worker: piped stdin and stdout, stderr to `log`, in a process group of its
    own within this process's session.

    Why its own group: a Ctrl-C at the terminal (SIGINT to the foreground group) is this process's
    to handle, not the worker's. Why not a session of its own: the worker is held stopped (SIGSTOP)
    while this process computes, and a stopped process reads no end of its stdin, so if this
    process died then (SIGKILL, a crash) a worker in its own session stayed stopped for good,
    holding its memory. In this session its group is orphaned when this process dies, and the
    kernel sends a stopped orphaned group SIGHUP, then SIGCONT (POSIX): the worker ends, or, where
    SIGHUP is ignored, runs on to find its stdin closed and exits."""
    return subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, process_group=0
    )


_LIVE: weakref.WeakSet[Worker] = weakref.WeakSet()


def stop_workers() -> None:
    """Stop every worker of this process (at its exit: none outlives it)."""
    for worker in list(_LIVE):
        worker.close()
