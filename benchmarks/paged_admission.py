"""Rows admitted and decode throughput at one KV budget, rectangular tails against a paged pool: a model.

Why: what a paged pool would buy is rows, not attention speed (`paged_attention.py` measures that
the pool can be read as fast as the tails). The decode step's tails (`backends/hf/batch.py`) give
every row of a batch the longest row's room: `B x capacity` slots, the capacity assembled as the
longest row + 1 + `TAIL_SLACK` free slots (at most the rows' `max_tokens`) and grown for every row
at once, by max(that slack, half the capacity), when the longest reaches its end
(`BatchContext.next_capacity`, called here, so the model follows the code). A pool prices each row
at ceil(tokens / block) blocks of its own. Rows whose lengths spread (self-consistency: n samples
of one prompt stop at different lengths; a beam search whose beams fork at different steps) are
where the two differ.

What is modelled, not measured: this script runs no model and times nothing. It replays a
workload step by step (every live row decodes one token per step) under one KV budget and counts,
per layout, the bytes held (each row's own KV, plus every shared node once: a prompt, a forked
beam's past; the pool rounds each to whole blocks), the rows decoding at each step, preemptions and
the tokens they threw away. Throughput is tokens per decode step, so the step's own time is not in
it: read it beside `paged_attention.py`, which measures that the attention of a step over a pool
costs no more than over the tails at equal rows (that, not this, is the measurement).

Two admission policies, the same for both layouts (only the pricing of a row differs):

* ``reserve``: a request is admitted when the worst case of everything admitted, itself included,
  fits (each row at its `max_tokens`: in the pool that many tokens in blocks, in the tails
  `max_tokens` + 1 + the slack, the capacity a batch re-assembled around a newcomer gives every
  row, as `KVPool.row_slots` prices it): nothing is ever preempted. Worst cases barely differ between layouts (a row may always reach its
  `max_tokens`), so this policy shows how little a pool buys under worst-case pricing;
* ``on_demand``: admitted when what is held now, plus what admitting it would hold now (the tails
  re-assembled around it), stays under `--watermark` of the budget; when decoding outgrows the
  budget, the newest request is preempted (its rows' tokens lost: recomputed when it comes back),
  as vLLM does. Here the pool's exact pricing is what admits more rows.

Workloads (seeded): ``self_consistency``: requests of `--samples` rows sharing a `--prompt`-token
prompt, each row stopping at a length drawn uniformly from [`--min-tokens`, `--max-tokens`];
``beam``: requests of `--beams` beams that all stop at one drawn length, where every
`--fork-every` steps each beam is, with probability 1/2, pruned and replaced by a fork of a
surviving beam (the survivor's own KV becomes a shared node; both start new own KV), so the own
lengths of rows in one batch differ by when they last forked.
"""

from __future__ import annotations

import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import BenchParser, emit, set_threads

from branchwise.backends.hf.batch import BatchContext
from branchwise.backends.hf.own_kv import Tails
from branchwise.backends.hf.pool import TAIL_SLACK

QUICK = {"requests": 6, "prompt": 64, "min_tokens": 16, "max_tokens": 128, "budget_mib": 100.0}

LAYOUTS = ("tails", "paged")
POLICIES = ("reserve", "on_demand")
WORKLOADS = ("self_consistency", "beam")


def next_capacity(capacity: int, needed: int, grow_min: int, grow_limit: int) -> int:
    """The tails' capacity once grown to hold `needed` slots per row: `BatchContext.next_capacity`
    itself, on an empty tail of that capacity."""
    empty = [torch.empty(0, 0, capacity, 0)]
    ctx = BatchContext(kv=Tails(empty, empty), lens=torch.zeros(0), grow_min=grow_min, grow_limit=grow_limit)
    return ctx.next_capacity(needed)


@dataclass
class Node:
    """A shared KV node (a prompt, a forked beam's past): held once, whatever reads it."""

    tokens: int
    refs: int = 0


@dataclass
class Row:
    own: int  # tokens in its own KV (since the prompt or its last fork)
    generated: int  # tokens decoded so far
    stop: int  # tokens it decodes in all
    nodes: list[Node]  # the shared nodes it reads (root first)


@dataclass
class Request:
    """One request of the workload: its rows' stop lengths (beam: one length for all beams)."""

    index: int
    prompt: int
    stops: list[int]
    beam: bool
    rows: list[Row] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    decoded: int = 0
    """Tokens its rows decoded since it (last) started, finished rows' included: what a preemption
    throws away (it starts again from its prompt)."""

    def start(self) -> None:
        self.decoded = 0
        root = Node(self.prompt, refs=len(self.stops))
        self.nodes = [root]
        self.rows = [Row(0, 0, stop, [root]) for stop in self.stops]

    def drop(self) -> None:
        self.rows, self.nodes = [], []


def workload(kind: str, args: Any, seed: int) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(args.requests):
        if kind == "self_consistency":
            stops = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.samples)]
        else:
            stops = [rng.randint(args.min_tokens, args.max_tokens)] * args.beams
        requests.append(Request(i, args.prompt, stops, beam=kind == "beam"))
    return requests


class Layout:
    """What one layout holds for the running requests, in tokens' worth of KV slots."""

    def __init__(self, kind: str, args: Any) -> None:
        self.kind, self.block, self.fork_every = kind, args.block, args.fork_every
        self.max_tokens = args.max_tokens
        self.slack = min(args.max_tokens, TAIL_SLACK)  # `Computation.assemble`'s `extra`
        self.limit = args.max_tokens + 2  # the most slots a row's own KV may need (its tail's grow_limit)
        self.capacity = 0

    def blocks(self, tokens: int) -> int:
        return math.ceil(tokens / self.block) * self.block

    def assembled(self, rows: list[Row]) -> int:
        """The tails' capacity of a batch assembled for these rows (a newcomer joined, or beams
        forked): the longest row's KV, its next token and the free slots."""
        return max((r.own + 1 for r in rows), default=0) + (self.slack if rows else 0)

    def grow(self, rows: list[Row]) -> None:
        """The tails grow for every row at once when the longest reaches their end."""
        needed = max((r.own + 1 for r in rows), default=0)
        if needed > self.capacity:
            self.capacity = next_capacity(self.capacity, needed, max(self.slack, 1), self.limit)

    def held(self, running: list[Request], capacity: int | None = None) -> int:
        rows = [r for q in running for r in q.rows]
        nodes = [n for q in running for n in q.nodes]
        if self.kind == "tails":
            cap = self.capacity if capacity is None else capacity
            return len(rows) * cap + sum(n.tokens for n in nodes)
        return sum(self.blocks(r.own + 1) for r in rows) + sum(self.blocks(n.tokens) for n in nodes)

    def worst(self, requests: list[Request]) -> int:
        """Everything these requests may hold at once: every row's own KV at its longest, each
        prompt, and a beam search's forked pasts (at most its rows' tokens, plus, in the pool, a
        partly filled block per fork)."""
        total = 0
        for q in requests:
            rows = len(q.stops)
            if self.kind == "tails":
                # a batch re-assembled around a newcomer sizes every row's tail to the longest
                # row's KV + 1 + the slack, past the growth limit (KVPool prices rows the same way)
                total += (
                    q.prompt
                    + rows * (self.max_tokens + 1 + self.slack)
                    + (rows * self.max_tokens if q.beam else 0)
                )
            else:
                forks = rows * math.ceil(self.max_tokens / self.fork_every)
                pasts = rows * self.max_tokens + forks * self.block if q.beam else 0
                total += self.blocks(q.prompt) + rows * self.blocks(self.limit - 1) + pasts
        return total


def simulate(kind: str, layout_kind: str, policy: str, args: Any, budget: int) -> dict[str, Any]:
    """Replay the workload under one layout and policy; budget in tokens' worth of slots."""
    waiting = workload(kind, args, args.seed)
    layout = Layout(layout_kind, args)
    running: list[Request] = []
    rng = random.Random(args.seed + 1)
    steps = tokens = wasted = preemptions = peak = 0
    most_rows = most_requests = 0
    fill: list[float] = []
    while waiting or running:
        admitted = False
        while waiting:  # first come, first served: the head of the queue or nobody
            head = waiting[0]
            if policy == "reserve":
                fits = layout.worst([*running, head]) <= budget
            else:
                head.start()
                together = [*running, head]
                capacity = layout.assembled([r for q in together for r in q.rows])
                fits = layout.held(together, capacity) <= args.watermark * budget
                head.drop()
            if not fits and running:
                break
            if not fits:  # alone and still too big: it can never run under this budget
                return {"error": f"request {head.index} alone does not fit the budget"}
            head.start()
            running.append(waiting.pop(0))
            admitted = True
        rows = [r for q in running for r in q.rows]
        if admitted:
            layout.capacity = layout.assembled(rows)
        # one decode step: every live row gains a token
        for r in rows:
            r.own += 1
            r.generated += 1
        for q in running:
            q.decoded += len(q.rows)
        steps += 1
        tokens += len(rows)
        most_rows, most_requests = max(most_rows, len(rows)), max(most_requests, len(running))
        forked = False
        for q in running:
            if q.beam and steps % args.fork_every == 0 and q.rows:
                forked |= fork(q, rng)
            for r in [r for r in q.rows if r.generated >= r.stop]:
                release(q, r)
        running = [q for q in running if q.rows]
        rows = [r for q in running for r in q.rows]
        if forked:
            layout.capacity = layout.assembled(rows)
        layout.grow(rows)
        while policy == "on_demand" and layout.held(running) > budget and len(running) > 1:
            victim = running.pop()  # the newest: its tokens are thrown away and computed again
            wasted += victim.decoded
            victim.drop()
            waiting.insert(0, victim)
            preemptions += 1
            layout.capacity = layout.assembled([r for q in running for r in q.rows])
        held = layout.held(running)
        peak = max(peak, held)
        if held:
            live = sum(r.own + 1 for q in running for r in q.rows) + sum(
                n.tokens for q in running for n in q.nodes
            )
            fill.append(live / held)
    useful = tokens - wasted
    return {
        "steps": steps,
        "tokens": tokens,
        "useful_tokens": useful,
        "tokens_per_step": round(useful / steps, 3),
        "max_rows_at_once": most_rows,
        "max_requests_at_once": most_requests,
        "preemptions": preemptions,
        "recomputed_tokens": wasted,
        "peak_fraction_of_budget": round(peak / budget, 3),
        "mean_fill": round(sum(fill) / len(fill), 3) if fill else None,
    }


def fork(q: Request, rng: random.Random) -> bool:
    """Each beam pruned with probability 1/2 and replaced by a fork of a surviving one: the
    survivor's own KV becomes a shared node (read by it and its new sibling), and both start new
    own KV. A node's `refs` is the number of live rows whose chain holds it."""
    keep = [r for r in q.rows if rng.random() >= 0.5] or [q.rows[0]]
    pruned = [r for r in q.rows if all(r is not k for k in keep)]
    if not pruned:
        return False
    for r in pruned:
        release(q, r, keep_row=True)
    split: set[int] = set()
    children = []
    for i in range(len(pruned)):
        parent = keep[i % len(keep)]
        if id(parent) not in split:  # its own KV so far becomes a node of its chain
            node = Node(parent.own, refs=1)
            q.nodes.append(node)
            parent.nodes = [*parent.nodes, node]
            parent.own = 0
            split.add(id(parent))
        for n in parent.nodes:
            n.refs += 1
        children.append(Row(0, parent.generated, parent.stop, list(parent.nodes)))
    q.rows = [*keep, *children]
    return True


def release(q: Request, row: Row, keep_row: bool = False) -> None:
    """A row leaves (stopped, or pruned): its own KV is freed, and every node no row reads."""
    for n in row.nodes:
        n.refs -= 1
    q.nodes = [n for n in q.nodes if n.refs > 0]
    if not keep_row:
        q.rows = [r for r in q.rows if r is not row]


def main(argv: list[str] | None = None) -> None:
    parser = BenchParser(__doc__, QUICK)
    parser.add_argument("--requests", type=int, default=32, help="requests, all waiting at the start")
    parser.add_argument(
        "--prompt", type=int, default=512, help="prompt tokens per request (shared by its rows)"
    )
    parser.add_argument("--samples", type=int, default=8, help="self-consistency rows per request")
    parser.add_argument("--beams", type=int, default=4, help="beams per beam-search request")
    parser.add_argument(
        "--fork-every", type=int, default=32, help="steps between a beam search's prunes and forks"
    )
    parser.add_argument("--min-tokens", type=int, default=64, help="fewest tokens a row decodes")
    parser.add_argument(
        "--max-tokens", type=int, default=1024, help="most tokens a row decodes (its max_tokens)"
    )
    parser.add_argument("--block", type=int, default=16, help="tokens per block of the pool")
    parser.add_argument("--budget-mib", type=float, default=1024.0, help="the KV budget")
    parser.add_argument(
        "--watermark",
        type=float,
        default=0.9,
        help="on_demand admits while held KV stays under this share of the budget",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("requests", "prompt", "samples", "beams", "fork_every", "min_tokens", "block"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_tokens < args.min_tokens:
        parser.error("--max-tokens must be at least --min-tokens")
    set_threads(args.threads)  # (nothing here uses them: recorded like every benchmark's)
    started = time.perf_counter()
    from transformers import AutoConfig

    from branchwise.backends.hf.embedded import embedded_model_dir

    model = args.model or str(embedded_model_dir())
    config = AutoConfig.from_pretrained(model)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    dtype = torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    per_token = 2 * int(config.num_hidden_layers) * kv_heads * head_dim * itemsize
    budget = int(args.budget_mib * 2**20) // per_token  # in tokens' worth of slots
    results: dict[str, Any] = {}
    for kind in WORKLOADS:
        results[kind] = {}
        for policy in POLICIES:
            got = {layout: simulate(kind, layout, policy, args, budget) for layout in LAYOUTS}
            if all("error" not in g for g in got.values()):
                got["paged_vs_tails"] = {
                    "tokens_per_step": round(
                        got["paged"]["tokens_per_step"] / got["tails"]["tokens_per_step"], 3
                    ),
                    "max_rows_at_once": round(
                        got["paged"]["max_rows_at_once"] / got["tails"]["max_rows_at_once"], 3
                    ),
                }
            results[kind][policy] = got
            print(f"[paged_admission] {kind} {policy}: {got}", file=sys.stderr, flush=True)
    emit(
        "paged_admission",
        model=model,
        device="cpu",  # the replay's own; no model runs
        dtype=str(dtype).removeprefix("torch."),
        config={k: v for k, v in vars(args).items() if k != "model"}
        | {"kv_bytes_per_token": per_token, "budget_tokens": budget, "tail_slack": TAIL_SLACK},
        results={
            "workloads": results,
            "modelled": "bytes, admission, preemption and tokens per step are counted by a replay; no "
            "step is timed (paged_attention.py measures the attention over each layout)",
            "load_average": [round(x, 2) for x in os.getloadavg()],
        },
        started=started,
        digits=2,
    )


if __name__ == "__main__":
    main()
