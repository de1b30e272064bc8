"""The decode step's attention over rectangular tails against the same KV in a paged pool.

Why: a paged KV pool (fixed-size blocks, a block table per row, the layout of vLLM, SGLang and
FlashInfer) holds each row's KV in its own blocks, so rows of unequal length waste at most one
block each, where the decode step's rectangular tails (`backends/hf/batch.py`: one `[B, H_kv,
capacity, D]` buffer per layer, every row padded to the longest) hold `B x capacity` slots. What
the pool costs is the read: a row's blocks lie anywhere in the pool, so attention must either
gather them into a contiguous run first (the plain SDPA path: one copy of every KV byte per layer
per step) or run a kernel that reads the block table itself (FlashInfer's paged decode, CUDA only).
This script measures both sides of that trade on the model's attention shapes, with no weights:

* ``tails``: the fixed-shape step's own attention (`step.StaticAttention`, what every decode step
  runs today): write each row's new K/V at its length, SDPA over the tails under a length mask;
* ``paged_gather``: the same KV in a pool of `--block`-token blocks, each row's blocks shuffled
  through the pool as after a long run of allocations and frees, gathered per layer and read by the
  same SDPA under the same mask: what a pool gives a machine without a paged kernel;
* ``flashinfer`` (CUDA, with `flashinfer-python` installed): FlashInfer's
  `BatchDecodeWithPagedKVCacheWrapper` over that pool (NHD layout), planned once per step. Where it
  is missing or fails, the JSON says why instead of a time.

Each arm runs every layer of one decode step (`--layers` of the model's by default); the arms are
interleaved repeat by repeat, medians reported. Per batch size: milliseconds per step, each arm's
speed relative to ``tails`` (> 1: faster), whether its output equals the tails' (up to `tolerance`),
and the KV bytes each layout holds for the same rows (rows of unequal length: `--ragged` spreads
them evenly between a quarter of `--context` and all of it).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.nn.functional as F
from _common import BenchParser, emit, set_threads
from random_checkpoint import RANDOM_CONFIGS

from branchwise.backends.hf.backend import resolve_device, resolve_dtype
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.step import SPAN, StaticAttention

QUICK = {"batches": [1, 4], "context": 96, "layers": 2, "repeats": 2}


class Shapes:
    """The attention shapes of a model: layers, query and KV heads, head size (its config only)."""

    def __init__(self, config: Any) -> None:
        self.layers = int(config.num_hidden_layers)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)


def row_lengths(batch: int, context: int, ragged: bool) -> list[int]:
    """Each row's KV length before the step: all `context`, or spread evenly from a quarter of it."""
    if not ragged or batch == 1:
        return [context] * batch
    low = max(1, context // 4)
    return [low + (context - low) * i // (batch - 1) for i in range(batch)]


class Rows:
    """The same rows' KV (random, seeded) in both layouts, and one step's queries and new K/V."""

    def __init__(self, shapes: Shapes, lens: list[int], block: int, dtype: torch.dtype, device: torch.device):
        gen = torch.Generator().manual_seed(0)
        b, h, d, layers = len(lens), shapes.kv_heads, shapes.head_dim, shapes.layers
        self.shapes, self.block, self.lens_list = shapes, block, lens
        self.lens = torch.tensor(lens, device=device)
        # the rectangular tails, as the step keeps them: capacity for every row's next token, read
        # in SPAN-slot multiples as a recorded step reads them
        self.capacity = -(-(max(lens) + 1) // SPAN) * SPAN
        # the pool: a row owns ceil((len + 1) / block) blocks (room for this step's token)
        owned = [-(-(n + 1) // block) for n in lens]
        self.width = max(owned)
        order = torch.randperm(sum(owned), generator=gen).tolist()  # blocks anywhere in the pool
        table = torch.zeros(b, self.width, dtype=torch.long)
        used = [order[sum(owned[:i]) : sum(owned[: i + 1])] for i in range(b)]
        for i, blocks in enumerate(used):
            table[i, : len(blocks)] = torch.tensor(blocks)
            table[i, len(blocks) :] = blocks[-1]  # unused entries: masked, any valid block
        self.table = table.to(device)
        self.indices = torch.tensor([x for blocks in used for x in blocks], dtype=torch.int32, device=device)
        self.indptr = torch.tensor(
            [0, *torch.tensor(owned).cumsum(0).tolist()], dtype=torch.int32, device=device
        )
        self.last_len = torch.tensor(
            [(n + 1) - (k - 1) * block for n, k in zip(lens, owned, strict=True)],
            dtype=torch.int32,
            device=device,
        )
        shape_tail = (b, h, self.capacity, d)
        self.tail_k = [torch.zeros(shape_tail, dtype=dtype, device=device) for _ in range(layers)]
        self.tail_v = [torch.zeros(shape_tail, dtype=dtype, device=device) for _ in range(layers)]
        n_blocks = sum(owned)
        self.pool_k = [torch.zeros(n_blocks, block, h, d, dtype=dtype, device=device) for _ in range(layers)]
        self.pool_v = [torch.zeros(n_blocks, block, h, d, dtype=dtype, device=device) for _ in range(layers)]
        for layer in range(layers):
            for i, n in enumerate(lens):
                k = torch.randn(h, n, d, generator=gen).to(dtype=dtype, device=device)
                v = torch.randn(h, n, d, generator=gen).to(dtype=dtype, device=device)
                self.tail_k[layer][i, :, :n] = k
                self.tail_v[layer][i, :, :n] = v
                where = torch.tensor(used[i], device=device)
                for pool, kv in ((self.pool_k[layer], k), (self.pool_v[layer], v)):
                    padded = kv.new_zeros(h, len(used[i]) * block, d)
                    padded[:, :n] = kv
                    pool[where] = padded.view(h, len(used[i]), block, d).permute(1, 2, 0, 3)
        self.query = torch.randn(b, shapes.heads, 1, d, generator=gen).to(dtype=dtype, device=device)
        self.new_k = torch.randn(b, h, 1, d, generator=gen).to(dtype=dtype, device=device)
        self.new_v = torch.randn(b, h, 1, d, generator=gen).to(dtype=dtype, device=device)
        self.scaling = d**-0.5

    def bytes_held(self) -> dict[str, int]:
        """KV bytes each layout holds for these rows (all layers, K and V)."""
        itemsize = self.tail_k[0].element_size()
        per_slot = 2 * self.shapes.layers * self.shapes.kv_heads * self.shapes.head_dim * itemsize
        return {
            "tails": len(self.lens_list) * self.capacity * per_slot,
            "paged": int(self.indices.numel()) * self.block * per_slot,
            "tokens": (sum(self.lens_list) + len(self.lens_list)) * per_slot,
        }


Step = Callable[[], torch.Tensor]
"""One decode step's attention through every layer; returns the last layer's output `[B, H, D]`."""


def tails_step(rows: Rows) -> Step:
    ctx = BatchContext(
        tail_k=rows.tail_k,
        tail_v=rows.tail_v,
        lens=rows.lens,
        n_groups=rows.shapes.heads // rows.shapes.kv_heads,
    )
    attention = StaticAttention(ctx, rows.lens)
    # what `Stepper.span` reads: the slots in use when run eagerly, whole SPAN multiples when recorded
    in_use = max(rows.lens_list) + 1
    attention.span = rows.capacity if rows.lens.device.type == "cuda" else in_use

    def step() -> torch.Tensor:
        attention.prepare(rows.query.dtype)
        out = rows.query
        for layer in range(rows.shapes.layers):
            out = attention.attend(layer, rows.query, rows.new_k, rows.new_v, rows.scaling)
        return out[:, 0]

    return step


def gather_step(rows: Rows) -> Step:
    b, h, d, block = len(rows.lens_list), rows.shapes.kv_heads, rows.shapes.head_dim, rows.block
    slots = rows.width * block
    at_block = rows.table.gather(1, (rows.lens // block)[:, None])[:, 0]
    at_slot = rows.lens % block
    flat = rows.table.flatten()

    def step() -> torch.Tensor:
        visible = torch.arange(slots, device=rows.lens.device)[None, :] <= rows.lens[:, None]
        mask = visible[:, None, None, :]
        out = rows.query
        for layer in range(rows.shapes.layers):
            pk, pv = rows.pool_k[layer], rows.pool_v[layer]
            pk[at_block, at_slot] = rows.new_k[:, :, 0]
            pv[at_block, at_slot] = rows.new_v[:, :, 0]
            k = pk.index_select(0, flat).view(b, slots, h, d).transpose(1, 2)
            v = pv.index_select(0, flat).view(b, slots, h, d).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                rows.query, k, v, attn_mask=mask, scale=rows.scaling, enable_gqa=h != rows.shapes.heads
            ).transpose(1, 2)
        return out[:, 0]

    return step


def flashinfer_step(rows: Rows) -> Step:
    """FlashInfer's paged decode over the pool; raises where it cannot run (the caller says why)."""
    if rows.lens.device.type != "cuda":
        raise RuntimeError("FlashInfer's kernels run on CUDA only")
    import flashinfer  # type: ignore[import-not-found]

    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=rows.lens.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    at_block = rows.table.gather(1, (rows.lens // rows.block)[:, None])[:, 0]
    at_slot = rows.lens % rows.block
    shapes, dtype = rows.shapes, rows.query.dtype
    query = rows.query[:, :, 0].contiguous()

    def step() -> torch.Tensor:
        wrapper.plan(
            rows.indptr,
            rows.indices,
            rows.last_len,
            shapes.heads,
            shapes.kv_heads,
            shapes.head_dim,
            rows.block,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        out = query
        for layer in range(shapes.layers):
            pk, pv = rows.pool_k[layer], rows.pool_v[layer]
            pk[at_block, at_slot] = rows.new_k[:, :, 0]
            pv[at_block, at_slot] = rows.new_v[:, :, 0]
            out = wrapper.run(query, (pk, pv))
        return out

    return step


def measure(rows: Rows, repeats: int, tolerance: float) -> dict[str, Any]:
    """Median ms per step of each arm (interleaved, alternating order), ratios and output checks."""
    device = rows.lens.device
    arms: dict[str, Step] = {"tails": tails_step(rows), "paged_gather": gather_step(rows)}
    skipped: dict[str, str] = {}
    try:
        arms["flashinfer"] = flashinfer_step(rows)
        arms["flashinfer"]()  # first call: FlashInfer compiles or loads its kernels
    except Exception as exc:  # a missing or failing library is reported, not fatal
        arms.pop("flashinfer", None)
        skipped["flashinfer"] = f"{type(exc).__name__}: {exc}"[:300]
    outputs = {name: step() for name, step in arms.items()}  # warm-up, and the outputs compared
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(repeats):
        for name, step in arms.items() if r % 2 == 0 else reversed(arms.items()):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    result: dict[str, Any] = {}
    ms = {name: round(statistics.median(got) * 1e3, 3) for name, got in times.items()}
    for name in arms:
        diff = float((outputs[name].float() - outputs["tails"].float()).abs().max())
        result[name] = {
            "ms": ms[name],
            "vs_tails": round(ms["tails"] / ms[name], 3),
            "max_abs_diff": diff,
            "same_output": diff <= tolerance,
        }
    for name, why in skipped.items():
        result[name] = {"skipped": why}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, QUICK)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32], help="rows decoded together")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens of the longest row")
    parser.add_argument("--block", type=int, default=16, help="tokens per block of the pool")
    parser.add_argument("--ragged", choices=["on", "off"], default="on", help="rows of unequal length")
    parser.add_argument("--layers", type=int, default=None, help="layers per step (default: the model's)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per arm (median)")
    parser.add_argument(
        "--random-config",
        choices=sorted(RANDOM_CONFIGS),
        default=None,
        help="the shapes of a random-weight model instead of --model's",
    )
    args = parser.parse_args(argv)
    for name in ("context", "block", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1 (got {args.layers})")
    set_threads(args.threads)
    started = time.perf_counter()
    from transformers import AutoConfig, LlamaConfig

    from branchwise.backends.hf.embedded import embedded_model_dir

    if args.random_config:
        config: Any = LlamaConfig(**RANDOM_CONFIGS[args.random_config])
        model = f"random-llama-{args.random_config}"
    else:
        model = args.model or str(embedded_model_dir())
        config = AutoConfig.from_pretrained(model)
    shapes = Shapes(config)
    if args.layers is not None:
        shapes.layers = min(args.layers, shapes.layers)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    results = []
    with torch.inference_mode():
        for b in args.batches:
            rows = Rows(shapes, row_lengths(b, args.context, args.ragged == "on"), args.block, dtype, device)
            held = rows.bytes_held()
            entry: dict[str, Any] = {"batch": b, "lens": [min(rows.lens_list), max(rows.lens_list)]}
            entry.update(measure(rows, args.repeats, tolerance))
            entry["kv_mb"] = {k: round(v / 1e6, 2) for k, v in held.items()}
            entry["paged_vs_tails_bytes"] = round(held["paged"] / held["tails"], 3)
            print(f"[paged_attention] B={b}: {entry}", file=sys.stderr, flush=True)
            results.append(entry)
            del rows
    emit(
        "paged_attention",
        model=model,
        device=device.type,
        dtype=str(dtype).removeprefix("torch."),
        config={k: v for k, v in vars(args).items() if k != "model"}
        | {
            "layers": shapes.layers,
            "heads": shapes.heads,
            "kv_heads": shapes.kv_heads,
            "head_dim": shapes.head_dim,
            "tolerance": tolerance,
        },
        results={"batches": results},
        started=started,
        digits=2,  # a smoke run takes under 0.05 s
    )


if __name__ == "__main__":
    main()
