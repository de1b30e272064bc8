"""The linear layers of a decode step on their own: how fast each CPU kernel streams the model's
weights, against the memory roofline and against vLLM's own call.

Why: on a CPU a decode step is mostly its linear layers (every weight read once per step), so the
step cannot beat the time those products take, and a faster loop around them cannot close a gap
that lies in the kernel. This script times only that part: one pass over every 2-D projection
weight of the model's checkpoint, in layer order (so the weights stream from memory as in a real
step, not from cache), at M input rows (`--rows`: 1 = one request, 8 = eight branches), for

* ``packed``: oneDNN over a weight reordered once for it, one product per weight;
* ``packed_fused``: the same, with sibling weights that read the same input (q/k/v, gate/up:
  `prepack.SIBLINGS`) concatenated into one product, what the local backend runs
  (`branchwise.backends.hf.prepack`);
* ``dense``: `torch.nn.functional.linear` over the row-major weight (MKL's GEMM);
* ``read``: a plain sum over the same bytes, the memory roofline no product can beat;
* ``vllm`` (with `--vllm-python`): vLLM's CPU matmul over a oneDNN handle it builds once per
  weight (`create_onednn_mm` / `onednn_mm`), what vLLM's server runs for these layers;
* ``int8_torch`` and ``int8_ours`` (float32, not in vLLM's Python): the same fused weights as int8
  codes with one scale per row, what River's quantized layers read: torch's weight-only kernel
  (`_weight_int8pack_mm`, bf16 activations, the casts included as a layer pays them) and
  branchwise's (`cpu_kernels.int8_linear`, float32 activations). Their GB/s count their own bytes
  (a quarter of the float32 weights'); ``vs_packed`` is still time against time.

The kernels are interleaved repeat by repeat in ONE process (with `--vllm-python` that process is
vLLM's Python, which has the same torch build), so their ratios compare like with like. Prints
milliseconds per pass, GB/s and each kernel's speed relative to ``packed`` (> 1: faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

QUICK = {"rows": [1], "repeats": 2}


def checkpoint_weights(model_dir: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every 2-D projection weight of the checkpoint in layer order, plus the LM head (the tied
    input embedding when the model has no separate head), by name: what a decode step multiplies by."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    if not tensors:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")

    def order(name: str) -> tuple[int, str]:
        parts = name.split(".")
        layer = next((int(p) for p in parts if p.isdigit()), -1)
        return (layer, name)

    names = sorted((n for n, t in tensors.items() if t.ndim == 2 and "layers." in n), key=order)
    head = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
    return {n: tensors[n].to(dtype).contiguous() for n in [*names, head]}


def fused(named: dict[str, torch.Tensor], siblings: Sequence[Sequence[str]]) -> list[torch.Tensor]:
    """The same weights in the same order, each complete group of `siblings` (`prepack.SIBLINGS`,
    handed over: vLLM's Python has no branchwise) under one parent concatenated into one weight,
    as `prepack` packs them."""
    out: list[torch.Tensor] = []
    done: set[str] = set()
    for name, weight in named.items():
        if name in done:
            continue
        parent, _, leaf = name.removesuffix(".weight").rpartition(".")
        group = next((g for g in siblings if leaf in g), None)
        members = [f"{parent}.{sib}.weight" for sib in group] if group else []
        if members and all(m in named for m in members):
            out.append(torch.cat([named[m] for m in members]))
            done.update(members)
        else:
            out.append(weight)
    return out


Pass = Callable[[dict[int, torch.Tensor]], object]
"""One pass over every weight, given an input row block per input width."""


def kernels(
    named: dict[str, torch.Tensor], siblings: Sequence[Sequence[str]], with_vllm: bool
) -> dict[str, Pass]:
    """name → one pass over the weights given an input row block per input width (packed once here)."""
    weights = list(named.values())

    def packed_pass(ws: list[torch.Tensor]) -> Pass:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        return lambda xs: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
            for w, p in zip(ws, packed, strict=True)
        ]

    found: dict[str, Pass] = {
        "packed": packed_pass(weights),
        "packed_fused": packed_pass(fused(named, siblings)),
        "dense": lambda xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
        "read": lambda xs: [w.sum() for w in weights],
    }
    if not with_vllm and weights[0].dtype == torch.float32:
        found.update(int8_kernels(fused(named, siblings)))
    if with_vllm:
        from vllm import _custom_ops as ops  # only in vLLM's Python

        handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        found["vllm"] = lambda xs: [
            ops.onednn_mm(h, xs[w.shape[1]], None) for w, h in zip(weights, handles, strict=True)
        ]
    return found


def int8_kernels(weights: list[torch.Tensor]) -> dict[str, Pass]:
    """River's int8 layers over `weights`: torch's kernel, and branchwise's where it is built here."""
    from branchwise.backends.hf import cpu_kernels

    scales = [w.abs().amax(1).clamp_min(1e-12) / 127 for w in weights]
    codes = [
        (w / s[:, None]).round().clamp(-127, 127).to(torch.int8) for w, s in zip(weights, scales, strict=True)
    ]
    bf16 = [s.bfloat16() for s in scales]
    found: dict[str, Pass] = {
        "int8_torch": lambda xs: [
            torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]].bfloat16(), q, s).float()
            for q, s in zip(codes, bf16, strict=True)
        ]
    }
    if cpu_kernels.build() is None and cpu_kernels.int8_linear_ready():
        found["int8_ours"] = lambda xs: [
            cpu_kernels.int8_linear(xs[q.shape[1]], q, s) for q, s in zip(codes, scales, strict=True)
        ]
    return found


def measure(
    model_dir: Path,
    dtype: torch.dtype,
    rows: Sequence[int],
    repeats: int,
    siblings: Sequence[Sequence[str]],
    with_vllm: bool,
) -> dict[str, Any]:
    """Median ms per pass and GB/s per kernel and row count, kernels interleaved repeat by repeat."""
    named = checkpoint_weights(model_dir, dtype)
    weights = list(named.values())
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    runs = kernels(named, siblings, with_vllm)
    widths = sorted({w.shape[1] for w in weights})
    out: dict[str, Any] = {"weights": len(weights), "weight_mb": round(nbytes / 1e6, 1)}
    with torch.inference_mode():
        for m in rows:
            xs = {k: torch.randn(m, k, dtype=dtype) for k in widths}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for run in runs.values():  # warm-up: first calls build oneDNN primitives
                run(xs)
            for r in range(repeats):
                for name, run in runs.items() if r % 2 == 0 else reversed(runs.items()):
                    start = time.perf_counter()
                    run(xs)
                    times[name].append(time.perf_counter() - start)
            row: dict[str, Any] = {}
            for name, got in times.items():
                t = statistics.median(got)
                read = nbytes // weights[0].element_size() if name.startswith("int8") else nbytes
                row[name] = {"ms": round(t * 1e3, 2), "gb_per_s": round(read / t / 1e9, 2)}
            for name in row:
                row[name]["vs_packed"] = round(row["packed"]["ms"] / row[name]["ms"], 3)
            out[f"m{m}"] = row
    return out


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="model folder with *.safetensors; default: the embedded model"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="input rows per product (M)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per kernel (median reported)")
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="the Python of a virtualenv with vLLM's CPU build: the measurement runs there, with vLLM's kernel",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: --rows 1 --repeats 2")
    # the run inside vLLM's Python, and the sibling names it is handed (it has no branchwise)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--siblings", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.worker:  # inside vLLM's Python: no branchwise there, just the numbers
        siblings = [group.split(",") for group in args.siblings]
        print(json.dumps(measure(Path(args.model), dtype, args.rows, args.repeats, siblings, with_vllm=True)))
        return
    from _common import emit

    from branchwise.backends.hf.embedded import embedded_model_dir
    from branchwise.backends.hf.prepack import SIBLINGS

    started = time.perf_counter()
    model_dir = Path(args.model) if args.model else embedded_model_dir()
    if args.vllm_python:
        argv_child = [
            args.vllm_python,
            __file__,
            "--worker",
            "--model",
            str(model_dir),
            "--dtype",
            args.dtype,
        ]
        argv_child += ["--rows", *map(str, args.rows), "--repeats", str(args.repeats)]
        argv_child += ["--siblings", *(",".join(group) for group in SIBLINGS)]
        if args.threads is not None:
            argv_child += ["--threads", str(args.threads)]
        child = subprocess.run(argv_child, capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(f"the measurement in {args.vllm_python} failed:\n{child.stderr[-3000:]}")
        results = json.loads(child.stdout.strip().splitlines()[-1])
        where = args.vllm_python
    else:
        results = measure(model_dir, dtype, args.rows, args.repeats, SIBLINGS, with_vllm=False)
        where = sys.executable
    emit(
        "linear_kernels",
        model=str(model_dir),
        device="cpu",
        dtype=args.dtype,
        config={k: v for k, v in vars(args).items() if k not in ("model", "worker", "siblings")},
        results={**results, "measured_in": where},
        started=started,
    )


if __name__ == "__main__":
    main()
