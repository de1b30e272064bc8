"""One run on the local backend: the `Backend` operations with that run's share mode, accelerations
and KV statistics.

Why a session per run: several runs (threads, a DSPy program, later a request scheduler) share one
loaded model and one KV tree, but each has its own settings and must report its own numbers. A
`Session` binds the settings (`share`, `accel` and the acceleration plug-ins built for it) and a
ledger of the bytes its nodes hold; the backend's lock serialises the operations, so sessions
never see each other half-way. Expensive builds (River's quantized layers, steering vectors,
calibrations) live in the backend's build cache, not here, so a session is cheap to make.

Data flow of `extend`: the session checks the call (distinct growable nodes, the context window,
each constraint compiles) and hands the nodes to its `Computation` (`compute.py`): their pending
tokens (and any uncomputed ancestors) are computed first, a `Batch` arranges each row's KV for
attention, the runner pushes the batch through the layers, and `decode.decode` samples until every
row stops; rows' KV goes back into their nodes. What all sessions share is the `Engine`
(`engine.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch

from branchwise.backends.accel import Accel
from branchwise.backends.base import (
    Admit,
    DecodeParams,
    Generation,
    KVStats,
    NodeId,
    ShareMode,
    StepListener,
    check_context,
    check_share,
)
from branchwise.backends.compute_thread import on_compute_thread
from branchwise.backends.hf.compute import Computation
from branchwise.backends.hf.engine import Engine, check_broadcast
from branchwise.backends.hf.hooks import Acceleration, HiddenCapture, KVEdits, overrides
from branchwise.backends.hf.ledger import Ledger
from branchwise.backends.hf.plugins import EntropyTrace, build_plugins, layer_trace
from branchwise.backends.hf.segment import Segment, common_prefix, common_suffix
from branchwise.constraints import Constraint

A = TypeVar("A", bound=Acceleration)


def path_length(seg: Segment) -> int:
    """Tokens on a node's path, root to its last (pending included): its context use."""
    return sum(len(a.tokens) for a in seg.kv_ancestors()) + len(seg.tokens)


class Session:
    """The `Backend` operations for one run (see the module docstring).

    Made by `HFBackend.session(share=..., accel=...)`; the backend's own operations go through a
    default session whose ledger is the whole tree's (so `backend.kv_stats()` reports everything).
    """

    name = "hf"
    admits_rows = True  # `SupportsAdmission`: rows join a running decode

    @on_compute_thread  # the plug-ins' builds run torch (River's quantized layers, ...)
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
        self.computation = Computation(engine, self.plugins, self.stats, self.ledger)
        self.exact_kv = self.computation.exact_kv

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

    @on_compute_thread
    def kv_room(self) -> int | None:
        """Bytes a scheduler may still promise to new requests (None: unbounded; `KVPool.room`)."""
        with self.engine.lock:
            return self.engine.pool.room()

    def kv_cost(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        """KV bytes admission prices ``n`` samples of a prompt decoding up to ``max_tokens`` each at
        (`KVPool.job_cost`: the worst case under tails, what they start with under pages), under
        this run's accelerations (SkipKV's budget caps what a row keeps)."""
        mode = self.share if share is None else share
        kept = self.computation.row_kv_tokens(max_tokens)
        return self.engine.pool.job_cost(prompt_tokens, n, kept, mode == "exact")

    def kv_floor(self, prompt_tokens: int, n: int, max_tokens: int, share: ShareMode | None = None) -> int:
        """The least KV bytes under which such a request can finish at all (`KVPool.job_floor`)."""
        mode = self.share if share is None else share
        kept = self.computation.row_kv_tokens(max_tokens)
        return self.engine.pool.job_floor(prompt_tokens, n, kept, mode == "exact")

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
    @on_compute_thread
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

    @on_compute_thread
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

    @on_compute_thread
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

    @on_compute_thread
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

    @on_compute_thread
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
            return self.computation.run(
                segs, params, on_step=on_step, admit=admit, constraints=constraints, row_params=row_params
            )

    @on_compute_thread
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
                self.computation.materialize_ancestors(segs)
                batch = self.computation.assemble(segs, 0)
                logits = self.computation.forward(batch, batch.feeds, [] if observer is None else [observer])
                probs = torch.softmax(logits.float(), dim=-1)[:, cand]
                return probs.tolist()
            finally:
                self.release(probes)

    @on_compute_thread
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
                self.computation.materialize_ancestors(segs)
                batch = self.computation.assemble(segs, 0)
                capture = HiddenCapture()
                self.computation.forward(batch, batch.feeds, [capture])
                with torch.inference_mode():
                    return self.parts.norm(capture.states[-1]).float().cpu()
            finally:
                self.release(kids)

    @on_compute_thread
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

    @on_compute_thread
    def tokens(self, node: NodeId) -> list[int]:
        with self.engine.lock:
            return self.tree.path_tokens(self.tree.get(node))

    @on_compute_thread
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

    @on_compute_thread
    def compute(self, segs: Sequence[Segment], observers: Sequence[Acceleration] = ()) -> None:
        """Compute the pending tokens of `segs` (ancestors first), watched by `observers` (`Host`)."""
        self.computation.compute(segs, observers)

    # ------------------------------------------------------------------ statistics
    @on_compute_thread
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

    @on_compute_thread
    def reset_stats(self) -> None:
        with self.engine.lock:
            self.stats.reset()
            self.ledger.peak = self.ledger.held
