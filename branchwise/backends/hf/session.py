"""One run on the local backend: the `Backend` operations with that run's share mode, accelerations
and KV statistics.

Why a session per run: several runs (threads, a DSPy program, later a request scheduler) share one
loaded model and one KV tree, but each has its own settings and must report its own numbers. A
`Session` binds the settings (`share`, `accel` and the acceleration plug-ins built for it) and a
ledger of the bytes its nodes hold; the backend's lock serialises the operations, so sessions
never see each other half-way. Expensive builds (River's quantized layers, steering vectors,
calibrations) live in the backend's build cache, not here, so a session is cheap to make.

Data flow of `extend`: the nodes' pending tokens (and any uncomputed ancestors) are computed first
(`compute`), a `Batch` arranges each row's KV for attention, the runner pushes the batch through the
layers, and `decode.decode` samples until every row stops; rows' KV goes back into their nodes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from branchwise.backends.accel import Accel
from branchwise.backends.base import (
    Admit,
    DecodeParams,
    Generation,
    KVBudgetExceeded,
    KVStats,
    NodeId,
    ShareMode,
    StepListener,
    check_context,
    check_share,
)
from branchwise.backends.hf.arch import DecoderParts, kv_bytes_per_token
from branchwise.backends.hf.batch import Batch, Broadcast, Row
from branchwise.backends.hf.decode import DecodeRun, decode
from branchwise.backends.hf.grammar import Grammars
from branchwise.backends.hf.hooks import Acceleration, Builds, HiddenCapture, KVEdits, overrides
from branchwise.backends.hf.intake import Intake, alone_chunk
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.plugins import EntropyTrace, build_plugins, layer_trace
from branchwise.backends.hf.pool import TAIL_SLACK, KVPool
from branchwise.backends.hf.runner import Runner
from branchwise.backends.hf.segment import Segment, common_prefix, common_suffix
from branchwise.backends.hf.tree import KVTree
from branchwise.constraints import Constraint
from branchwise.toolcalls import render_messages, template_has_tools

COPY_TOKENS = 64
COPY_MIN_SEGMENTS = 8
"""In a batch reading more than `COPY_MIN_SEGMENTS` ancestors, those whose path holds at most
`COPY_TOKENS` tokens are read from copies in each row's tail instead of as shared segments (one
attention call per layer each). Measured on the 2-core CPU: 128 rows of 32 requests with ~50-token
prompts decode about 10 % faster copied. A batch of few segments keeps them shared (the copies would
only cost memory there), and a long prefix always stays shared."""
A = TypeVar("A", bound=Acceleration)


def path_length(seg: Segment) -> int:
    """Tokens on a node's path, root to its last (pending included): its context use."""
    return sum(len(a.tokens) for a in seg.kv_ancestors()) + len(seg.tokens)


BROADCASTS: tuple[Broadcast, ...] = ("cascade", "copy")


def check_broadcast(broadcast: str, plugins: Sequence[Acceleration]) -> None:
    """Refuse a broadcast mode the run's accelerations cannot work with, naming both fields, when a
    session is built or the backend's mode changes (rather than at the first batch, mid-run)."""
    if broadcast not in BROADCASTS:
        raise ValueError(f"broadcast={broadcast!r} is not one of {BROADCASTS}")
    needs = [p.name for p in plugins if p.needs_cascade]
    if needs and broadcast != "cascade":
        fields = ", ".join(f"accel.{n}" for n in needs)
        raise ValueError(
            f"{fields} cannot run with broadcast={broadcast!r}: of the broadcast modes {BROADCASTS} it "
            "allows only 'cascade' (it reads attention per shared segment, which per-row copies do "
            f"not have); use broadcast='cascade' or turn {fields} off"
        )


@dataclass
class Engine:
    """What every session of one backend shares: the model, the KV tree, the runner, the lock and
    the build cache."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    parts: DecoderParts
    device: torch.device
    dtype: torch.dtype
    eos_ids: set[int]
    pad_id: int
    broadcast: Broadcast = "cascade"
    tree: KVTree = field(default_factory=KVTree)
    lock: threading.RLock = field(default_factory=threading.RLock)
    builds: Builds = field(default_factory=Builds)
    runner: Runner = field(init=False)
    grammars: Grammars = field(init=False)
    max_context: int | None = field(init=False)
    """The model's context window in tokens (None where its config does not say)."""
    pool: KVPool = field(init=False)
    """Every byte of KV and its budget (`pool.py`)."""
    prefill_chunk: int = 128
    """Prompt tokens computed per decode step while other rows decode (0: whole prompts); alone,
    `intake.ALONE_CHUNK` per forward (`intake.py`)."""

    def __post_init__(self) -> None:
        self.runner = Runner(self.parts, self.pad_id, self.device)
        vocab = (
            int(cast(int, self.parts.head.out_features))
            if hasattr(self.parts.head, "out_features")
            else len(self.tokenizer)
        )
        self.grammars = Grammars(self.tokenizer, vocab, self.eos_ids)
        self.pool = KVPool(self.tree, kv_bytes_per_token(self.parts, self.dtype), copy_tokens=COPY_TOKENS)
        config = self.model.config
        self.max_context = next(
            (
                int(v)
                for v in (getattr(config, k, None) for k in ("max_position_embeddings", "n_positions"))
                if isinstance(v, int) and v > 0
            ),
            None,
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        return cast(str, text)  # one sequence of ids decodes to one str

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        native = template_has_tools(template)
        rendered = render_messages(messages, tools, native=native)
        if not template:
            return self.encode("\n".join(m["content"] for m in rendered) + "\n")
        extra: dict[str, Any] = {"tools": list(tools)} if tools and native else {}
        text = self.tokenizer.apply_chat_template(
            rendered, add_generation_prompt=True, tokenize=False, **extra
        )
        return self.encode(cast(str, text))  # tokenize=False: the rendered text

    def check_ids(self, ids: Sequence[int], name: str) -> list[int]:
        vocab = self.parts.embed.num_embeddings
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} holds ids outside [0, {vocab}): {bad[:5]}")
        return out


class Session:
    """The `Backend` operations for one run (see the module docstring).

    Made by `HFBackend.session(share=..., accel=...)`; the backend's own operations go through a
    default session whose ledger is the whole tree's (so `backend.kv_stats()` reports everything).
    """

    name = "hf"

    def __init__(
        self,
        engine: Engine,
        share: ShareMode,
        accel: Accel,
        ledger: Ledger | None = None,
        stats: KVStats | None = None,
    ) -> None:
        self.engine = engine
        self.share: ShareMode = check_share(share)
        self.tree = engine.tree
        self.kv = KVEdits(self.tree)
        self.parts = engine.parts
        self.device = engine.device
        self.ledger = Ledger() if ledger is None else ledger
        self.stats = KVStats() if stats is None else stats
        self.accel = accel
        with engine.lock:  # builds are cached per backend: never two of the same at once
            self.plugins: list[Acceleration] = build_plugins(
                accel, self, tokenizer=engine.tokenizer, model_name=engine.model_name, builds=engine.builds
            )
        check_broadcast(engine.broadcast, self.plugins)
        self.exact_kv = not self.plugins
        """Whether this run's KV is what exact recompute gives. Conservative: any acceleration may
        approximate or evict KV (River, SkipKV, RSBCM, ASKS), so a run with one neither inserts its
        nodes into the prefix cache nor matches from it."""

    # ------------------------------------------------------------------ settings
    def plugin(self, kind: type[A]) -> A | None:
        """This run's instance of an acceleration (None when it is off), e.g. to read its state."""
        return next((p for p in self.plugins if isinstance(p, kind)), None)

    def plain(self) -> Session:
        """A session over the same tree without accelerations and with its own throwaway stats."""
        return Session(self.engine, self.share, Accel())

    @property
    def max_context(self) -> int | None:
        """The model's context window in tokens (None where its config does not say)."""
        return self.engine.max_context

    # ------------------------------------------------------------------ the KV budget (`pool.py`)
    @property
    def kv_budget(self) -> int | None:
        """The engine's KV budget in bytes (None: unbounded); set it on the backend."""
        return self.engine.pool.budget

    @property
    def kv_limit(self) -> int | None:
        """The most KV one request may need to be admitted at all: the budget less its watermark."""
        pool = self.engine.pool
        return None if pool.budget is None else int(pool.budget * (1.0 - pool.watermark))

    def kv_room(self) -> int | None:
        """Bytes a scheduler may still promise to new requests (None: unbounded; `KVPool.room`)."""
        with self.engine.lock:
            return self.engine.pool.room()

    def kv_cost(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        """Worst-case KV bytes of ``n`` samples of a prompt decoding up to ``max_tokens`` each, under
        this run's accelerations (SkipKV's budget caps what a row keeps)."""
        mode = self.share if share is None else share
        kept = self.row_kv_tokens(max_tokens)
        return self.engine.pool.job_cost(prompt_tokens, n, kept, mode == "exact")

    def row_kv_tokens(self, max_tokens: int) -> int:
        """Own KV tokens a row of this run holds at most while decoding `max_tokens` (the tightest
        cap of its accelerations; `KVPool` reserves this much per row)."""
        return min((p.row_kv_tokens(max_tokens) for p in self.plugins), default=max_tokens)

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.engine.decode(token_ids)

    def chat_prompt(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return self.engine.chat_prompt(messages, tools)

    # ------------------------------------------------------------------ tree ops
    def prefill(self, token_ids: Sequence[int]) -> NodeId:
        ids = self.engine.check_ids(token_ids, "token_ids")
        if not ids:
            raise ValueError("token_ids must hold at least 1 token")
        check_context(len(ids), 0, self.engine.max_context, "token_ids")
        with self.engine.lock:
            tree = self.tree
            if tree.prefix.budget > 0 and self.share == "exact" and self.exact_kv:
                node, hit = tree.match(ids)
                self.stats.cache_hit_tokens += hit
                self.stats.cache_miss_tokens += len(ids) - hit
                if node is not None:  # a live child pins the matched path
                    return tree.add(node, True, ids[hit:], self.ledger).id
            return tree.add(None, False, ids, self.ledger).id

    def fork(self, node: NodeId, n: int, share: ShareMode | None = None) -> list[NodeId]:
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        mode = check_share(self.share if share is None else share)
        with self.engine.lock:
            parent = self.tree.get(node)
            path = self.tree.path_tokens(parent)
            if mode == "exact" and not self._sharing_pays(path, n, parent):
                mode = "none"
            children = []
            for _ in range(n):
                if mode == "exact":
                    child = self.tree.add(parent, True, [], self.ledger)
                    self.stats.tokens_reused += len(path)
                else:
                    child = self.tree.add(parent, False, list(path), self.ledger)
                children.append(child.id)
            return children

    def fork_prompts(
        self, node: NodeId, prompts: Sequence[Sequence[int]], share: ShareMode | None = None
    ) -> list[NodeId]:
        """One child per prompt, each standing for that whole token sequence (not appended to `node`).

        `share="exact"` reuses the longest common token prefix with `node`'s path (splitting the
        segment that holds it); an acceleration may place prompts that diverge from the path
        (ASKS reuses the root's whole KV when hidden states stay similar). `share="none"`
        recomputes every prompt.
        """
        mode = check_share(self.share if share is None else share)
        ids = [self.engine.check_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        if any(not p for p in ids):
            raise ValueError("every prompt must hold at least 1 token")
        for i, p in enumerate(ids):
            check_context(len(p), 0, self.engine.max_context, f"prompts[{i}]")
        with self.engine.lock:
            root = self.tree.get(node)
            path = self.tree.path_tokens(root)
            if mode == "exact" and not self._sharing_pays(path, len(ids), root):
                mode = "none"
            if mode == "none":
                return [self.tree.add(root, False, list(p), self.ledger).id for p in ids]
            if root.pending or root.last_logits is None:
                self.compute([root])
            placers = overrides(self.plugins, "on_fork_prompts")
            out: list[int | None] = [None] * len(ids)
            divergent: list[tuple[int, int, int]] = []  # (prompt index, common prefix k, common suffix m)
            for i, p in enumerate(ids):
                k = common_prefix(path, p)
                if k == len(path):
                    out[i] = self.share_child(root, p[k:], len(path))
                    continue
                k = min(k, len(p) - 1)
                m = min(common_suffix(path, p), len(p) - k - 1, len(path) - k - 1)
                if not placers or m < 0:
                    out[i] = self._exact_child(root, k, p)
                else:
                    divergent.append((i, k, m))
            for plugin in placers:
                placed = plugin.on_fork_prompts(self, root, path, ids, divergent)
                for i, child in placed.items():
                    out[i] = child
                divergent = [d for d in divergent if d[0] not in placed]
            for i, k, _ in divergent:
                out[i] = self._exact_child(root, k, ids[i])
            children = []
            for placed_id in out:
                assert placed_id is not None  # every prompt was placed above
                children.append(placed_id)
            return children

    def share_child(self, root: Segment, own: list[int], reused: int) -> int:
        """A child that reads all of `root`'s KV and holds `own` tokens of its own."""
        child = self.tree.add(root, True, list(own), self.ledger)
        self.stats.tokens_reused += reused
        return child.id

    def prefix_node(self, root: Segment, k: int) -> tuple[Segment | None, int]:
        """The segment whose KV chain ends at path position j <= k of `root`, and j (split if needed;
        j < k where k falls inside a segment whose KV was evicted or block-shared: that part is not
        exact and cannot be cut, so the caller computes `path[j:k]` itself; (None, 0): share nothing).

        Counts the recomputed tokens as `lossy_prefix_recomputed_tokens`."""
        splits = overrides(self.plugins, "on_split")

        def on_split(head: Segment, rest: Segment, at: int) -> None:
            for plugin in splits:
                plugin.on_split(head, rest, at)

        base, j = self.tree.shareable_prefix(root, k, on_split)
        if j < k:
            self.stats.bump("lossy_prefix_recomputed_tokens", k - j)
        return base, j

    def _exact_child(self, root: Segment, k: int, prompt: list[int]) -> int:
        """A child sharing the first k tokens of root's path, or fewer where they end inside a lossy
        segment (k = 0: nothing shared)."""
        base, k = self.prefix_node(root, k) if k else (None, 0)
        if base is None:
            return self.tree.add(root, False, list(prompt), self.ledger).id
        child = self.tree.add(base, True, list(prompt[k:]), self.ledger)
        self.stats.tokens_reused += k
        self.tree.adopt(root, child)
        return child.id

    def _sharing_pays(self, path: list[int], n: int, parent: Segment) -> bool:
        return all(plugin.on_fork(self, path, n, parent) for plugin in overrides(self.plugins, "on_fork"))

    def append(self, nodes: Sequence[NodeId], token_ids: Sequence[Sequence[int]]) -> None:
        if len(nodes) != len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(nodes)} nodes")
        with self.engine.lock:
            evictions = self.tree.prefix.evictions
            for node, ids in zip(nodes, token_ids, strict=True):
                seg = self.tree.growable(node)
                checked = self.engine.check_ids(ids, "token_ids")
                check_context(path_length(seg) + len(checked), 0, self.engine.max_context, "node + token_ids")
                seg.tokens.extend(checked)
            self.stats.cache_evictions += self.tree.prefix.evictions - evictions

    def extend(
        self,
        nodes: Sequence[NodeId],
        params: DecodeParams,
        on_step: StepListener | None = None,
        admit: Admit | None = None,
        constraints: Sequence[Constraint | None] | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]:
        """`Backend.extend`; `constraints` (one per node, optional) constrain rows one by one in place
        of `params.constraint`, so one batch may mix constrained and free rows; `row_params` (one per
        node, optional) give rows their own decoding parameters (a server's requests in one decode;
        seeded sampling still draws from the call's one generator)."""
        own = [p for p in row_params or () if p is not None]
        for c in {params.constraint, *(constraints or ()), *(p.constraint for p in own)} - {None}:
            self.engine.grammars.compile(c)  # type: ignore[arg-type]  # refuse a bad one before any work
        with self.engine.lock:
            evictions = self.tree.prefix.evictions
            segs = [self.tree.growable(n) for n in nodes]
            self.stats.cache_evictions += self.tree.prefix.evictions - evictions
            if len({s.id for s in segs}) != len(segs):
                raise ValueError("nodes must be distinct; fork a node to decode it several times")
            if not segs:
                return []
            wants = [
                params.max_tokens if p is None else p.max_tokens for p in row_params or [None] * len(segs)
            ]
            i = max(range(len(segs)), key=lambda k: path_length(segs[k]) + wants[k])
            check_context(path_length(segs[i]), wants[i], self.engine.max_context, f"node {segs[i].id}")
            return self._run(
                segs, params, on_step=on_step, admit=admit, constraints=constraints, row_params=row_params
            )

    def score_next(
        self,
        nodes: Sequence[NodeId],
        suffix: Sequence[int],
        candidates: Sequence[int],
        trace: list[EntropyTrace] | None = None,
    ) -> list[list[float]]:
        """See `Backend.score_next`. An acceleration may let rows stop at an earlier layer (CGEE).

        Pass a list as `trace` to receive each row's per-layer entropies and exit layer (with early
        exits off, every layer is recorded: that is what calibration needs).
        """
        cand = self.engine.check_ids(candidates, "candidates")
        suffix_ids = self.engine.check_ids(suffix, "suffix")
        if not suffix_ids:
            raise ValueError("suffix must hold at least 1 token")
        with self.engine.lock:
            longest = max((path_length(self.tree.get(n)) for n in nodes), default=0)
            check_context(longest + len(suffix_ids), 0, self.engine.max_context, "node + suffix")
            probes = [self.fork(n, 1)[0] for n in nodes]
            try:
                segs = [self.tree.get(p) for p in probes]
                for seg in segs:
                    seg.tokens.extend(suffix_ids)
                observer = next(
                    (
                        o
                        for o in (p.verify_observer(len(segs), cand, trace) for p in self.plugins)
                        if o is not None
                    ),
                    None,
                )
                if observer is None and trace is not None:
                    observer = layer_trace(self.parts, len(segs), cand, self.stats, trace)
                self._materialize_ancestors(segs)
                batch = self._assemble(segs, 0)
                logits = self._forward(batch, batch.feeds, [] if observer is None else [observer])
                probs = torch.softmax(logits.float(), dim=-1)[:, cand]
                return probs.tolist()
            finally:
                self.release(probes)

    def embed_nodes(self, nodes: Sequence[NodeId], probe: Sequence[int]) -> torch.Tensor:
        """The model's own embedding of each node: its final-norm hidden state after `node + probe`.

        Why a probe token: a node's last token is often computed already (a judge read it), and its
        hidden state is not kept, so a short fixed `probe` (say one newline token) is pushed through
        in a temporary child, reading the node's whole path from the shared KV — one batched forward
        of len(probe) tokens per node, released at once. ETS clusters these to find redundant steps
        without loading a sentence-embedding model. Returns a float32 CPU tensor [len(nodes), hidden].
        """
        probe_ids = self.engine.check_ids(probe, "probe")
        if not probe_ids:
            raise ValueError("probe must hold at least 1 token")
        if not nodes:
            return torch.zeros(0, self.parts.embed.embedding_dim)
        with self.engine.lock:
            kids = [self.fork(n, 1)[0] for n in nodes]
            try:
                segs = [self.tree.get(k) for k in kids]
                for seg in segs:
                    seg.tokens.extend(probe_ids)
                self._materialize_ancestors(segs)
                batch = self._assemble(segs, 0)
                capture = HiddenCapture()
                self._forward(batch, batch.feeds, [capture])
                with torch.inference_mode():
                    return self.parts.norm(capture.states[-1]).float().cpu()
            finally:
                self.release(kids)

    def release(self, nodes: Sequence[NodeId]) -> None:
        with self.engine.lock:
            releasers = overrides(self.plugins, "on_release")
            evictions = self.tree.prefix.evictions
            for node in nodes:
                for seg in self.tree.release(node):
                    for plugin in releasers:
                        plugin.on_release(seg)
            self.tree.trim()
            self.stats.cache_evictions += self.tree.prefix.evictions - evictions

    def free(self, seg: Segment) -> None:
        """Release a segment an acceleration made for its own use."""
        self.release([seg.id])

    def tokens(self, node: NodeId) -> list[int]:
        with self.engine.lock:
            return self.tree.path_tokens(self.tree.get(node))

    def set_scores(self, nodes: Sequence[NodeId], scores: Sequence[float]) -> None:
        """Tell the accelerations how good each branch is (a verifier's score; RSBCM keeps the
        blocks of better branches longer)."""
        with self.engine.lock:
            segs = [self.tree.get(n) for n in nodes]
            for plugin in overrides(self.plugins, "on_scores"):
                plugin.on_scores(segs, [float(s) for s in scores])

    def skip_verify(self, confidences: Sequence[float]) -> bool:
        """Whether an acceleration (CGEE level 1) says the verify pass is not needed."""
        return any(p.skip_verify(confidences) for p in self.plugins)

    # ------------------------------------------------------------------ statistics
    def kv_stats(self) -> KVStats:
        with self.engine.lock:
            s = self.stats
            return KVStats(
                bytes_held=self.ledger.held,
                peak_bytes=self.ledger.peak,
                tokens_computed=s.tokens_computed,
                tokens_reused=s.tokens_reused,
                forward_calls=s.forward_calls,
                live_nodes=self.ledger.nodes,
                cache_hit_tokens=s.cache_hit_tokens,
                cache_miss_tokens=s.cache_miss_tokens,
                cache_evictions=s.cache_evictions,
                cache_bytes=self.tree.accounts.cache.held,
                budget_bytes=self.engine.pool.budget,
                used_bytes=self.engine.pool.used(),
                preemptions=self.engine.pool.preemptions,
                extra=dict(s.extra),
            )

    def reset_stats(self) -> None:
        with self.engine.lock:
            self.stats.reset()
            self.ledger.peak = self.ledger.held

    # ------------------------------------------------------------------ computation
    def compute(self, segs: Sequence[Segment], observers: Sequence[Acceleration] = ()) -> None:
        """Compute the pending tokens of `segs` (ancestors first), watched by `observers`."""
        self._run(segs, None, observers)

    def compute_part(self, seg: Segment, limit: int) -> None:
        """Compute the next `limit` pending tokens of `seg` (its ancestors are computed): one chunk
        of a chunked prefill. Only for runs without accelerations (their hooks see whole prompts)."""
        self._materialize_ancestors([seg])
        engine = self.engine
        batch = Batch.assemble(
            [seg],
            0,
            self.parts,
            engine.dtype,
            self.device,
            engine.broadcast,
            limit=limit,
            reserve=engine.pool.reserve_tails,
        )
        engine.pool.track(batch.ctx)
        logits = self._forward(batch, batch.feeds)
        batch.advance([0], batch.feeds)
        batch.capture(self.tree, 0, batch.rows[0])
        seg.last_logits = None if seg.pending else logits[0].detach().clone()
        self.stats.bump("prefill_chunks")

    def _materialize_ancestors(self, segs: Sequence[Segment]) -> None:
        """Compute pending tokens of shared ancestors, top-down, batching those at the same depth."""
        while True:
            todo: dict[int, Segment] = {}
            for seg in segs:
                for anc in seg.kv_ancestors():
                    if anc.pending:
                        todo[anc.id] = anc
            if not todo:
                return
            ready = [a for a in todo.values() if not any(x.id in todo for x in a.kv_ancestors())]
            self._run(ready, None)

    def _assemble(self, segs: Sequence[Segment], extra: int) -> Batch:
        engine = self.engine
        # many short ancestors (many requests' prompts) are copied into the rows' tails
        # (`Batch.assemble`); with an acceleration on, every ancestor stays a shared segment, the
        # layout its hooks observe
        copy_tokens = 0
        if not self.plugins and len({a.id for s in segs for a in s.kv_ancestors()}) > COPY_MIN_SEGMENTS:
            copy_tokens = COPY_TOKENS
        batch = Batch.assemble(
            segs,
            extra,
            self.parts,
            engine.dtype,
            self.device,
            engine.broadcast,
            copy_tokens,
            reserve=engine.pool.reserve_tails,
        )
        engine.pool.track(batch.ctx)
        for plugin in overrides(self.plugins, "on_batch"):
            plugin.on_batch(batch)
        return batch

    def _forward(
        self, batch: Batch, feeds: Sequence[Sequence[int]], observers: Sequence[Acceleration] = ()
    ) -> torch.Tensor:
        logits = self.engine.runner.forward(batch.ctx, feeds, self.plugins, observers)
        self.stats.tokens_computed += sum(len(f) for f in feeds)
        self.stats.forward_calls += 1
        self.tree.accounts.note_transient(self.ledger, batch.ctx.nbytes)
        return logits

    def _capture(self, batch: Batch) -> Callable[[int, Row], None]:
        capturers = overrides(self.plugins, "on_capture")

        def capture(pos: int, row: Row) -> None:
            batch.capture(self.tree, pos, row)
            for plugin in capturers:
                plugin.on_capture(batch, pos, row)

        return capture

    def _run(
        self,
        segs: Sequence[Segment],
        params: DecodeParams | None,
        observers: Sequence[Acceleration] = (),
        on_step: StepListener | None = None,
        admit: Admit | None = None,
        constraints: Sequence[Constraint | None] | None = None,
        row_params: Sequence[DecodeParams | None] | None = None,
    ) -> list[Generation]:
        """Compute pending tokens of `segs` and, with `params`, decode them as one batch.

        `observers` watch the pending-token forward (they must not exit rows: their KV is kept);
        `on_step` is told each decode step's tokens (`Backend.extend`). With `admit`, nodes it hands
        in between steps join the decode: the batch is re-assembled from the rows still decoding
        and the new ones (`decode.DecodeRun` keeps each row's state across batches).
        """
        if params is None:
            self._batch(segs, None, observers)
            return []
        run = DecodeRun.start(
            params,
            segs,
            eos_ids=self.engine.eos_ids,
            detokenize=self.engine.decode,
            device=self.device,
            on_step=on_step,
            grammars=self.engine.grammars,
            constraints=constraints,
            row_params=row_params,
        )
        intake = Intake(self, run, admit)
        run.admit, run.pressure = intake.admit, intake.pressure
        segs = intake.start(segs)
        try:
            while True:
                if not segs:
                    segs = intake.next_ready()
                    if not segs:
                        break
                batch, start = self._batch(segs, params, observers, run)
                intake.batch = batch
                admitted = decode(
                    batch,
                    torch.stack(start),
                    run,
                    forward=functools.partial(self._forward, batch),
                    capture=self._capture(batch),
                    hooks=self.plugins,
                    device=self.device,
                )
                for plugin in overrides(self.plugins, "after_batch"):
                    plugin.after_batch(batch, True)
                intake.dropped([r for r in batch.rows if r.preempted])
                segs = [r.seg for r in batch.rows if r.finish is None and not r.preempted]
                segs += [self.tree.get(n) for n in admitted]
                observers = ()
        finally:
            intake.finish()
        return run.generations()

    def _batch(
        self,
        segs: Sequence[Segment],
        params: DecodeParams | None,
        observers: Sequence[Acceleration],
        run: DecodeRun | None = None,
    ) -> tuple[Batch, list[torch.Tensor]]:
        """Compute the pending tokens of `segs` (ancestors first) and assemble their batch; returns it
        with each row's next-token logits. Without `params` the rows' KV goes back into their nodes
        at once (a prefill), each with its logits."""
        self._materialize_ancestors(segs)
        chunk = 0 if self.plugins else alone_chunk(self.engine.prefill_chunk)
        for seg in segs if chunk else ():
            while len(seg.pending) > chunk:  # a long prompt: its attention's memory stays bounded
                self.compute_part(seg, chunk)
        if not self.exact_kv:
            for seg in segs:
                seg.exact = False
        pending = [s for s in segs if s.pending]
        if (
            params is not None
            and pending
            and len(pending) < len(segs)
            and max(len(s.pending) for s in pending) > 1
        ):
            # a mixed batch would push dummy tokens through every row for the longest pending run
            # (e.g. ASKS: reused branches have nothing to prefill, rejected ones a whole prompt)
            self._batch(pending, None, observers)
        extra = 0
        if params is not None:
            longest = max(run.params_of(s).max_tokens for s in segs) if run is not None else params.max_tokens
            extra = min(longest, TAIL_SLACK)
        try:
            batch = self._assemble(segs, extra)
        except KVBudgetExceeded:
            if not extra:
                raise
            batch = self._assemble(segs, 0)  # no free slots ahead: the tails grow as rows do
        feeds = batch.feeds
        logits = None
        if any(feeds):
            logits = self._forward(batch, feeds, observers)
        batch.advance(range(len(segs)), feeds)
        for plugin in overrides(self.plugins, "after_pending"):
            plugin.after_pending(batch, feeds)
        start = []
        for i, (r, f) in enumerate(zip(batch.rows, feeds, strict=True)):
            if f:
                assert logits is not None
                start.append(logits[i])
            else:
                source = r.seg if r.seg.n_computed else r.seg.parent
                assert source is not None and source.last_logits is not None
                start.append(source.last_logits)
        if params is None:
            capture = self._capture(batch)
            for i, r in enumerate(batch.rows):
                capture(i, r)
                r.seg.last_logits = start[i].detach().clone()
            for plugin in overrides(self.plugins, "after_batch"):
                plugin.after_batch(batch, False)
        return batch, start
