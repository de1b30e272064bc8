"""The compile worker: a process that compiles the decode step for kinds of batch it is sent.

Why a process (`step_compiler.py` says it at length): compiling is minutes of Python on a small CPU,
and in the serving process it would hold the interpreter lock against every decode step. This
process builds a model of the same config, dtype and device with uninitialised weights (a
compilation reads shapes and types, never values), packs it as the engine packed its own, and for
each kind it is sent (a JSON line on stdin naming a small batch of that kind, `skeleton`) compiles
`StepGraph.computed` with `torch.compile(...).aot_compile` and writes the compiled step where it was
asked, then answers on stdout. It exits when stdin closes or after an idle period.

Run by `compile_worker.Worker` as ``python -m branchwise.backends.hf.step_worker SPEC IDLE_S``.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from branchwise.backends.hf.arch import DecoderParts, decoder_parts
from branchwise.backends.hf.attention import ATTN_NAME, register
from branchwise.backends.hf.prepack import prepack
from branchwise.backends.hf.step import StepGraph, from_skeleton
from branchwise.backends.hf.step_compiler import mark_sizes


def build_parts(spec: dict[str, Any]) -> DecoderParts:
    """A model of the spec's config, dtype and device, weights uninitialised, packed like the
    engine's: what the compiled step reads of a model (its modules, shapes and types)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.for_model(**spec["config"])
    dtype = getattr(torch, spec["dtype"])
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to(torch.device(spec["device"])).eval()
    register()
    model.set_attn_implementation(ATTN_NAME)
    if spec["prepacked"]:
        prepack(model, decoder_parts(model).layers)
    return decoder_parts(model)


def compile_kind(step: Any, graph: StepGraph, path: Path) -> None:
    """Compile the step for `graph`'s kind and write it to `path`. Its guards keep what a later
    process can check (no identity of this process's objects; the packed weights' own tensors are
    read, not guarded: they are opaque to the compiler)."""
    import torch.fx.experimental._config as fx_config

    mark_sizes(graph)
    # sizes that happen to be equal in the skeleton must not be assumed equal in real batches
    with torch.inference_mode(), fx_config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
        compiled = step.aot_compile(((graph,), {}))
    compiled.save_compiled_function(str(path))


def serializable(entries: list[Any]) -> list[bool]:
    """The guards a compiled step keeps on disk: not the global ones, not those torch cannot
    serialise, not those on packed weights (oneDNN's opaque tensors cannot be pickled)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        not (
            e.is_global
            or e.guard_type in unsupported
            or (isinstance(e.value, torch.Tensor) and e.value.layout == torch._mkldnn)  # type: ignore[attr-defined]
        )
        for e in entries
    ]


def aot_step() -> Any:
    """`StepGraph.computed` through inductor, whole (one graph), its guards those that serialise."""
    return torch.compile(
        StepGraph.computed, fullgraph=True, backend="inductor", options={"guard_filter_fn": serializable}
    )


def _lines(fd: int, idle_s: float) -> Iterator[bytes]:
    """The lines written to `fd` until it closes or stays silent for `idle_s` seconds. Read from the
    descriptor itself: a buffered reader may hold a second line that `select` no longer sees."""
    buf = b""
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line
        if not select.select([fd], [], [], idle_s)[0]:
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buf += chunk


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    idle_s = float(argv[1])
    parts = build_parts(spec)
    device = torch.device(spec["device"])
    step = aot_step()
    for line in _lines(sys.stdin.fileno(), idle_s):
        job = json.loads(line)
        start = time.perf_counter()
        reply: dict[str, Any] = {"kind": job["kind"], "path": job["path"]}
        try:
            torch.set_num_threads(int(job["threads"]))  # a guard of the compiled step
            batch = torch.load(job["batch"], weights_only=False)
            compile_kind(step, from_skeleton(batch, parts, device), Path(job["path"]))
            reply.update(ok=True, seconds=round(time.perf_counter() - start, 3))
        except Exception as exc:  # the engine runs this kind eagerly and says why
            traceback.print_exc()
            root: BaseException = exc
            while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
                root = inner  # torch wraps the compiler's error: name the cause
            first = (str(root).strip().splitlines() or [""])[0]
            reply.update(ok=False, error=f"{type(root).__name__}: {first}"[:300])
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
