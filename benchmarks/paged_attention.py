"""The decode step's attention over rectangular tails against the same KV in a paged pool read in place.

Why: a paged KV pool (fixed-size blocks, a block table per row, the layout of vLLM, SGLang and
FlashInfer) holds each row's KV in its own blocks, so rows of unequal length waste at most one
block each, where the decode step's rectangular tails (`backends/hf/batch.py`: one `[B, H_kv,
capacity, D]` buffer per layer, every row padded to the longest) hold `B x capacity` slots. What
the pool costs is the read: a row's blocks lie anywhere in the pool. This script measures that
read as a pool would really be read, on the model's attention shapes, with no weights:

* ``tails``: the fixed-shape step's own attention (`step.StaticAttention`, what every decode step
  runs today): write each row's new K/V at its length, SDPA over the tails under a length mask;
* ``paged_inplace``: the same KV in a pool of `--block`-token blocks (`[N, H_kv, block, D]`), each
  row's blocks shuffled through the pool as after a long run of allocations and frees; the new K/V
  written into each row's last block, then `cpu_kernels.paged_decode` (a C++ kernel of ours)
  reads every row's blocks where they lie through its block table;
* ``paged_flex`` (`--flex on`): PyTorch's FlexAttention, compiled, over the same blocks in its own
  paged layout (`torch.nn.attention.experimental._paged_attention`: a `[1, H_kv, N x block, D]`
  cache and a block mask converted to physical blocks). It cannot give the log-sum-exp under
  compilation on a CPU, which the cascade needs, so it is measured on the own KV only;
* ``paged_gather``, a baseline only: the pool's blocks gathered into a padded copy per layer and
  read by SDPA (what a pool costs without a reader of its own: one copy of every KV byte);
* ``flashinfer`` (CUDA, with `flashinfer-python` installed): FlashInfer's
  `BatchDecodeWithPagedKVCacheWrapper` over the pool (HND layout), planned once per step.

With `--shared N` (0: off) a second group, ``cascade``, gives every row a shared N-token prefix
read once per step for all rows (`SharedSegment`), its output merged with the row's own by
log-sum-exp (with `--levels L` > 1 the prefix is a tree as a beam search leaves it: L levels of
N / L tokens, level l split into 2^l segments each read by its own group of rows): ``tails`` as the step runs it (`attention.fused_cascade`), ``paged_inplace`` with the
own KV read by the kernel (output and LSE) and the prefix by the same SDPA call as the tails',
each segment merged after (`attention.merge_shared`, how the step read them before), and
``paged_fused`` with the segments handed to the kernel beside the pages (one call per layer: each
segment read once for all its rows, their queries stacked on its KV heads, and each row's own
blocks in the same softmax, as the decode step reads a tree's ancestors).

Each arm runs every layer of one decode step (`--layers` of the model's by default); the arms are
interleaved repeat by repeat in alternating order, medians reported. Per batch size: milliseconds
per step, each arm's speed relative to ``tails`` (> 1: faster), its largest difference from a
float64 reference over the same KV (`max_abs_err`; `same_output` when within `tolerance`), and the
KV bytes each layout holds for the same rows (`--ragged on` spreads them evenly between a quarter
of `--context` and all of it). The load average before and after goes in the JSON: the machine
may be shared, so read ratios, not times.
"""

from __future__ import annotations

import os
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

from branchwise.backends.hf import cpu_kernels
from branchwise.backends.hf.attention import SharedSegment, merge_shared
from branchwise.backends.hf.backend import resolve_device, resolve_dtype
from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.own_kv import Tails
from branchwise.backends.hf.step import SPAN
from branchwise.backends.hf.step_attention import KernelSegments, StaticAttention

QUICK = {"batches": [1, 4], "context": 96, "layers": 2, "repeats": 2, "shared": 64, "flex": "off"}


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


def shuffled_tables(owned: list[int], gen: torch.Generator) -> tuple[list[list[int]], int]:
    """Each row's blocks, drawn in a random order from a pool of exactly the blocks the rows own (as
    after many allocations and frees: no row's blocks adjacent); and the pool's size."""
    order = torch.randperm(sum(owned), generator=gen).tolist()
    starts = [sum(owned[:i]) for i in range(len(owned))]
    return [order[s : s + n] for s, n in zip(starts, owned, strict=True)], sum(owned)


class Rows:
    """The same rows' KV (random, seeded) in both layouts, one step's queries and new K/V, and
    (with `shared` > 0) a shared prefix, held both as a segment and as blocks of the pool."""

    def __init__(
        self,
        shapes: Shapes,
        lens: list[int],
        block: int,
        shared: int,
        dtype: torch.dtype,
        device: torch.device,
        levels: int = 1,
    ) -> None:
        gen = torch.Generator().manual_seed(0)
        b, h, d, layers = len(lens), shapes.kv_heads, shapes.head_dim, shapes.layers
        self.shapes, self.block, self.lens_list, self.shared = shapes, block, lens, shared
        self.lens = torch.tensor(lens, device=device)
        # the rectangular tails, as the step keeps them: capacity for every row's next token, read
        # in SPAN-slot multiples as a recorded step reads them
        self.capacity = -(-(max(lens) + 1) // SPAN) * SPAN
        # the pool: a row owns ceil((len + 1) / block) blocks (room for this step's token); the
        # prefix's blocks after the rows'
        owned = [-(-(n + 1) // block) for n in lens]
        used, n_blocks = shuffled_tables(owned, gen)
        self.width = max(owned)
        table = torch.zeros(b, self.width, dtype=torch.int32)
        for i, blocks in enumerate(used):
            table[i, : len(blocks)] = torch.tensor(blocks)
            table[i, len(blocks) :] = blocks[-1]  # unused entries: past the length, never read
        self.table = table.to(device)
        self.owned = owned
        self.indices = torch.tensor([x for blocks in used for x in blocks], dtype=torch.int32, device=device)
        self.indptr = torch.tensor(
            [0, *torch.tensor(owned).cumsum(0).tolist()], dtype=torch.int32, device=device
        )
        self.last_len = torch.tensor(
            [(n + 1) - (k - 1) * block for n, k in zip(lens, owned, strict=True)],
            dtype=torch.int32,
            device=device,
        )
        self.kv_lens = (self.lens + 1).to(torch.int32)  # what each row reads once its token is written
        self.at_block = self.table.long().gather(1, (self.lens // block)[:, None])[:, 0]
        self.at_slot = self.lens % block
        shape_tail = (b, h, self.capacity, d)
        self.tail_k = [torch.zeros(shape_tail, dtype=dtype, device=device) for _ in range(layers)]
        self.tail_v = [torch.zeros(shape_tail, dtype=dtype, device=device) for _ in range(layers)]
        self.pool_k = [torch.zeros(n_blocks, h, block, d, dtype=dtype, device=device) for _ in range(layers)]
        self.pool_v = [torch.zeros(n_blocks, h, block, d, dtype=dtype, device=device) for _ in range(layers)]
        # the prefix's segments: who reads each (None: every row), then its keys and values per layer
        tree = tree_readers(b, levels, device) if shared else []
        spans = [
            shared // levels + (shared % levels if level == levels - 1 else 0) for level in range(levels)
        ]
        self.readers = [rows for _, rows in tree]
        self.seg_tokens = [spans[level] for level, _ in tree]
        self.seg_k: list[list[torch.Tensor]] = [[] for _ in self.seg_tokens]
        self.seg_v: list[list[torch.Tensor]] = [[] for _ in self.seg_tokens]
        for layer in range(layers):
            pieces = [(used[i], n) for i, n in enumerate(lens)]
            kvs = [(torch.randn(h, n, d, generator=gen), torch.randn(h, n, d, generator=gen)) for n in lens]
            for i, (k, v) in enumerate(kvs):
                self.tail_k[layer][i, :, : lens[i]] = k.to(dtype)
                self.tail_v[layer][i, :, : lens[i]] = v.to(dtype)
            for i, n in enumerate(self.seg_tokens):
                pk = torch.randn(h, n, d, generator=gen)
                pv = torch.randn(h, n, d, generator=gen)
                self.seg_k[i].append(pk.to(dtype=dtype, device=device))
                self.seg_v[i].append(pv.to(dtype=dtype, device=device))
            for (blocks, n), (k, v) in zip(pieces, kvs, strict=True):
                where = torch.tensor(blocks, device=device)
                for pool, kv in ((self.pool_k[layer], k), (self.pool_v[layer], v)):
                    padded = kv.new_zeros(h, len(blocks) * block, d)
                    padded[:, :n] = kv
                    pool[where] = (
                        padded.view(h, len(blocks), block, d).transpose(0, 1).to(dtype=dtype, device=device)
                    )
        self.query = torch.randn(b, shapes.heads, 1, d, generator=gen).to(dtype=dtype, device=device)
        self.new_k = torch.randn(b, h, 1, d, generator=gen).to(dtype=dtype, device=device)
        self.new_v = torch.randn(b, h, 1, d, generator=gen).to(dtype=dtype, device=device)
        self.scaling = d**-0.5

    def write_paged(self, layer: int) -> None:
        """This step's K/V into each row's last block, at its length (what the tails' write is)."""
        self.pool_k[layer][self.at_block, :, self.at_slot] = self.new_k[:, :, 0]
        self.pool_v[layer][self.at_block, :, self.at_slot] = self.new_v[:, :, 0]

    def bytes_held(self) -> dict[str, int]:
        """KV bytes each layout holds for these rows' own KV (all layers, K and V)."""
        itemsize = self.tail_k[0].element_size()
        per_slot = 2 * self.shapes.layers * self.shapes.kv_heads * self.shapes.head_dim * itemsize
        return {
            "tails": len(self.lens_list) * self.capacity * per_slot,
            "paged": sum(self.owned) * self.block * per_slot,
            "tokens": (sum(self.lens_list) + len(self.lens_list)) * per_slot,
        }

    def segments(self) -> list[SharedSegment]:
        """The prefix's segments as the step reads them."""
        return [SharedSegment(self.seg_k[j], self.seg_v[j], rows) for j, rows in enumerate(self.readers)]

    def reference(self, layer: int, cascade: bool) -> torch.Tensor:
        """The layer's attention in float64 from the tails (and the prefix): `[B, Hq, D]`, after the
        step's token is written (an arm run first writes it)."""
        h, d = self.shapes.kv_heads, self.shapes.head_dim
        g = self.shapes.heads // h
        out = []
        for i, n in enumerate(self.lens_list):
            k = self.tail_k[layer][i, :, : n + 1].double()
            v = self.tail_v[layer][i, :, : n + 1].double()
            if cascade:
                mine = [j for j, rows in enumerate(self.readers) if rows is None or i in rows.tolist()]
                k = torch.cat([*(self.seg_k[j][layer].double() for j in mine), k], 1)
                v = torch.cat([*(self.seg_v[j][layer].double() for j in mine), v], 1)
            q = self.query[i, :, 0].double().view(h, g, d)
            p = torch.softmax(q @ k.transpose(1, 2) * self.scaling, -1)
            out.append((p @ v).reshape(h * g, d))
        return torch.stack(out)


def tree_readers(b: int, levels: int, device: torch.device) -> list[tuple[int, torch.Tensor | None]]:
    """Each segment of a `levels`-deep tree over `b` rows, as (its level, who reads it): level 0
    every row (None), level l up to 2^l segments, segment j read by the rows i with
    i * 2^l // b == j (a segment no row would read is left out)."""
    readers: list[tuple[int, torch.Tensor | None]] = [(0, None)]
    for level in range(1, levels):
        for j in range(2**level):
            rows = [i for i in range(b) if i * 2**level // b == j]
            if rows:
                readers.append((level, torch.tensor(rows, dtype=torch.long, device=device)))
    return readers


Step = Callable[[], torch.Tensor]
"""One decode step's attention through every layer; returns the last layer's output `[B, Hq, D]`."""


def tails_step(rows: Rows, cascade: bool) -> Step:
    shared = rows.segments() if cascade else []
    ctx = BatchContext(
        kv=Tails(rows.tail_k, rows.tail_v),
        lens=rows.lens,
        shared=shared,
        n_groups=rows.shapes.heads // rows.shapes.kv_heads,
    )
    attention = StaticAttention(ctx, rows.lens, rows.lens[:, None])  # positions: only a window reads them
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


def require_kernel(rows: Rows) -> None:
    """Raise, saying why, where the paged kernel cannot run (the arm is then reported skipped)."""
    if rows.lens.device.type != "cpu":
        raise RuntimeError("cpu_kernels.paged_decode is a CPU kernel")
    reason = cpu_kernels.build()
    if reason is not None:
        raise RuntimeError(f"the paged kernel is unavailable: {reason}")


def inplace_step(rows: Rows) -> Step:
    """The pool read in place by the kernel."""
    require_kernel(rows)
    query = rows.query[:, :, 0].contiguous()

    def step() -> torch.Tensor:
        out = query
        for layer in range(rows.shapes.layers):
            rows.write_paged(layer)
            out, _ = cpu_kernels.paged_decode(
                query, rows.pool_k[layer], rows.pool_v[layer], rows.table, rows.kv_lens, rows.scaling
            )
        return out

    return step


def cascade_inplace_step(rows: Rows, fused: bool) -> Step:
    """Own KV by the kernel; each segment once for all its rows, by SDPA merged after (as the step
    read them before, `attention.merge_shared`) or, `fused`, handed to the kernel in the same call."""
    require_kernel(rows)
    b, hq, d = rows.query.shape[0], rows.shapes.heads, rows.shapes.head_dim
    h = rows.shapes.kv_heads
    g = hq // h
    query = rows.query[:, :, 0].contiguous()
    segments = rows.segments()
    handed = KernelSegments(segments, b, query.device)

    def step() -> torch.Tensor:
        out = query
        for layer in range(rows.shapes.layers):
            rows.write_paged(layer)
            args = (query, rows.pool_k[layer], rows.pool_v[layer], rows.table, rows.kv_lens, rows.scaling)
            if fused:
                out, _ = cpu_kernels.paged_decode(*args, 0, handed.at(layer))
                continue
            o, lse = cpu_kernels.paged_decode(*args)
            merged, _ = merge_shared(
                query.view(b, h, g, d), o.view(b, h, g, d), lse.view(b, h, g), segments, layer, rows.scaling
            )
            out = merged.reshape(b, hq, d)
        return out

    return step


def gather_step(rows: Rows) -> Step:
    """Baseline: each row's blocks copied out of the pool into a padded run per layer, then SDPA."""
    b, h, d, block = len(rows.lens_list), rows.shapes.kv_heads, rows.shapes.head_dim, rows.block
    slots = rows.width * block
    flat = rows.table.flatten().long()

    def step() -> torch.Tensor:
        visible = torch.arange(slots, device=rows.lens.device)[None, :] <= rows.lens[:, None]
        mask = visible[:, None, None, :]
        out = rows.query
        for layer in range(rows.shapes.layers):
            rows.write_paged(layer)
            # one copy: [H, B*M, block, D] out of the head-major view, read as [B, H, M*block, D]
            k = rows.pool_k[layer].transpose(0, 1).index_select(1, flat).view(h, b, slots, d).transpose(0, 1)
            v = rows.pool_v[layer].transpose(0, 1).index_select(1, flat).view(h, b, slots, d).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                rows.query, k, v, attn_mask=mask, scale=rows.scaling, enable_gqa=h != rows.shapes.heads
            )
        return out[:, :, 0]

    return step


def flex_step(rows: Rows) -> Step:
    """FlexAttention over a paged cache of its own layout, compiled (raises where it cannot run)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, d, block = len(rows.lens_list), rows.shapes.kv_heads, rows.shapes.head_dim, rows.block
    n_blocks = rows.pool_k[0].shape[0]
    device = rows.lens.device
    paged = PagedAttention(n_blocks, block, b, device=str(device))
    paged.empty_pages = []
    for i, n in enumerate(rows.owned):
        blocks = rows.table[i, :n].long()
        paged.page_table[i, :n] = blocks
        paged.physical_to_logical[i, blocks] = torch.arange(n, device=device)
        paged.capacity[i] = n * block
    # its cache: [1, H_kv, N x block, D], physical block j at slots j*block ..; copied from the pool
    cache_k = [p.transpose(0, 1).reshape(1, h, n_blocks * block, d).clone() for p in rows.pool_k]
    cache_v = [p.transpose(0, 1).reshape(1, h, n_blocks * block, d).clone() for p in rows.pool_v]
    kv_len = rows.kv_lens.long()

    def visible(b_: torch.Tensor, h_: torch.Tensor, q_: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return kv < kv_len[b_]

    logical = create_block_mask(
        visible, b, None, 1, rows.width * block, device=str(device), BLOCK_SIZE=(1, block)
    )
    mask = paged.convert_logical_block_mask(logical, kv_len=kv_len)
    attend = torch.compile(flex_attention, fullgraph=True)
    addr = (rows.at_block * block + rows.at_slot).long()

    def step() -> torch.Tensor:
        out = rows.query
        for layer in range(rows.shapes.layers):
            cache_k[layer][0, :, addr] = rows.new_k[:, :, 0].transpose(0, 1)
            cache_v[layer][0, :, addr] = rows.new_v[:, :, 0].transpose(0, 1)
            out = attend(
                rows.query,
                cache_k[layer],
                cache_v[layer],
                block_mask=mask,
                scale=rows.scaling,
                enable_gqa=True,
            )
        assert isinstance(out, torch.Tensor)
        return out[:, :, 0]

    return step


def flashinfer_step(rows: Rows) -> Step:
    """FlashInfer's paged decode over the pool; raises where it cannot run (the caller says why)."""
    if rows.lens.device.type != "cuda":
        raise RuntimeError("FlashInfer's kernels run on CUDA only")
    import flashinfer  # type: ignore[import-not-found]

    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=rows.lens.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
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
            rows.write_paged(layer)
            out = wrapper.run(query, (rows.pool_k[layer], rows.pool_v[layer]))
        return out

    return step


def measure(
    arms: dict[str, Callable[[], Step]], reference: Callable[[], torch.Tensor], repeats: int, tolerance: float
) -> dict[str, Any]:
    """Median ms per step of each arm (interleaved, alternating order), ratios to `tails` and each
    arm's largest difference from the float64 `reference` (computed after the arms' first run has
    written the step's token). An arm that cannot be set up or fails its first run is reported as
    skipped, with why."""
    steps: dict[str, Step] = {}
    result: dict[str, Any] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, make in arms.items():
        try:
            steps[name] = make()
            started = time.perf_counter()
            outputs[name] = steps[name]()  # warm-up (a compiled arm compiles here), and the output compared
            if name == "paged_flex":
                result.setdefault("first_call_s", {})[name] = round(time.perf_counter() - started, 1)
        except Exception as exc:  # a missing library or kernel is reported, not fatal
            steps.pop(name, None)
            result[name] = {"skipped": f"{type(exc).__name__}: {exc}"[:300]}
    device = next(iter(outputs.values())).device
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(repeats):
        for name, step in steps.items() if r % 2 == 0 else reversed(steps.items()):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times[name].append(time.perf_counter() - start)
    expected = reference()
    ms = {name: round(statistics.median(got) * 1e3, 3) for name, got in times.items()}
    for name in arms:
        if name not in steps:
            result[name] = result.pop(name)  # skipped: in the arms' order
            continue
        err = float((outputs[name].double() - expected).abs().max())
        result[name] = {
            "ms": ms[name],
            "vs_tails": round(ms["tails"] / ms[name], 3),
            "max_abs_err": err,
            "same_output": err <= tolerance,
        }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, QUICK)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="rows decoded together")
    parser.add_argument("--context", type=int, default=1024, help="KV tokens of the longest row")
    parser.add_argument("--block", type=int, default=16, help="tokens per block of the pool")
    parser.add_argument("--ragged", choices=["on", "off"], default="on", help="rows of unequal length")
    parser.add_argument(
        "--shared",
        type=int,
        default=1024,
        help="tokens of a prefix every row shares (the cascade group; 0: off)",
    )
    parser.add_argument(
        "--levels",
        type=int,
        default=1,
        help="the prefix as a tree of this many levels (level l: 2^l segments, each its group of rows)",
    )
    parser.add_argument(
        "--flex",
        choices=["on", "off"],
        default="on",
        help="the FlexAttention arm (compiled once per batch size: ~20 s each on 2 cores)",
    )
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
    if args.shared < 0:
        parser.error(f"--shared must be at least 0 (got {args.shared})")
    if not 1 <= args.levels <= 8 or args.levels > max(args.shared, 1):
        parser.error(f"--levels must be 1..8 and at most --shared tokens (got {args.levels})")
    set_threads(args.threads)
    started = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
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
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    build: dict[str, Any] = {
        "reason_unavailable": cpu_kernels.build()
        if device.type == "cpu"
        else "a CPU kernel: not built for a CUDA run"
    }
    info = cpu_kernels.build_info()
    if info is not None:
        build |= {"seconds": round(info.seconds, 2), "cached": info.cached}
    results = []
    with torch.inference_mode():
        for b in args.batches:
            rows = Rows(
                shapes,
                row_lengths(b, args.context, args.ragged == "on"),
                args.block,
                args.shared,
                dtype,
                device,
                args.levels,
            )
            held = rows.bytes_held()
            entry: dict[str, Any] = {"batch": b, "lens": [min(rows.lens_list), max(rows.lens_list)]}
            own: dict[str, Callable[[], Step]] = {
                "tails": lambda rows=rows: tails_step(rows, cascade=False),
                "paged_inplace": lambda rows=rows: inplace_step(rows),
            }
            if args.flex == "on":
                own["paged_flex"] = lambda rows=rows: flex_step(rows)
            own["paged_gather"] = lambda rows=rows: gather_step(rows)
            own["flashinfer"] = lambda rows=rows: flashinfer_step(rows)
            entry.update(
                measure(
                    own, lambda rows=rows: rows.reference(shapes.layers - 1, False), args.repeats, tolerance
                )
            )
            if args.shared:
                cascade: dict[str, Callable[[], Step]] = {
                    "tails": lambda rows=rows: tails_step(rows, cascade=True),
                    "paged_inplace": lambda rows=rows: cascade_inplace_step(rows, fused=False),
                    "paged_fused": lambda rows=rows: cascade_inplace_step(rows, fused=True),
                }
                entry["cascade"] = measure(
                    cascade,
                    lambda rows=rows: rows.reference(shapes.layers - 1, True),
                    args.repeats,
                    tolerance,
                )
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
            # PyTorch's switch for huge pages under its CPU allocations: a pool's blocks are
            # scattered 4 KB runs, so its reads depend on it more than the tails' (see RESULTS)
            "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        },
        results={
            "batches": results,
            "kernel_build": build,
            "load_average": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]},
        },
        started=started,
        digits=2,
    )


if __name__ == "__main__":
    main()
