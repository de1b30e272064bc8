"""The local backend: a HuggingFace causal LM driven by our own decode and layer loops.

Why own the loops: RKSC App. I.1 measured 8-12 % lost to `generate()` overhead, and every
acceleration in this project needs to act between layers or between tokens. The branch tree of KV
segments (see `attention.py`) keeps a prefix shared by B branches once, not B times.

Sharing modes (baselines in the same code path, DESIGN §4):
- `share="exact"`: children of a node read its KV (token-exact prefix reuse).
- `share="none"`: the No-KV baseline; each child recomputes the full token path, batched,
  right-padded, with logits read at each row's last real token (not at a pad position).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from branchwise.backends.accel import Accel
from branchwise.backends.base import DecodeParams, FinishReason, Generation, KVStats, NodeId, ShareMode
from branchwise.backends.hf import attention
from branchwise.backends.hf.arch import DecoderParts, decoder_parts, kv_bytes_per_token
from branchwise.backends.hf.asks import HiddenCapture, KVProbe, layer_weights, similarity
from branchwise.backends.hf.attention import BatchContext, SharedSegment
from branchwise.backends.hf.cgee import DEFAULT_THETA, Calibration, EntropyExit, EntropyTrace, verify_skip
from branchwise.backends.hf.embedded import EMBEDDED_MODEL, embedded_model_dir
from branchwise.backends.hf.river import RiverPath, exit_fidelity
from branchwise.backends.hf.rsbcm import Block, blocks_of, keep_mask, plan_evictions
from branchwise.backends.hf.sampling import pick_tokens
from branchwise.backends.hf.skipkv import SkipKV, SkipState, Steering, delimiter_token_ids

if TYPE_CHECKING:
    from branchwise.backends.hf.cgee import LayerObserver

log = logging.getLogger(__name__)

SHARE_MODES: tuple[ShareMode, ...] = ("none", "exact")
Broadcast = Literal["cascade", "copy"]
"""How rows read shared ancestors: one batched product per segment, or per-row copies (baseline)."""


@dataclass(eq=False)
class _Segment:
    """A node of the branch tree and the KV of its own tokens.

    `tokens[:n_computed]` have KV in `keys`/`values` (per layer `[H_kv, n_computed, D]`); the rest
    are pending and computed on first use. A segment that shares its parent attends to the parent's
    KV chain; one that does not holds its whole token path itself (the No-KV baseline).
    """

    id: int
    parent: _Segment | None
    shares_parent: bool
    tokens: list[int]
    n_computed: int = 0
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    last_logits: torch.Tensor | None = None
    live_children: int = 0
    released: bool = False
    kv_bytes: int = 0
    logical_parent: _Segment | None = None
    """The node a child was forked from when its KV parent is elsewhere (a split prefix, or none)."""
    mass: torch.Tensor | None = None
    """Attention mass each physical KV token received (RSBCM), when tracking is on."""
    score: float = 1.0
    """Branch score used by RSBCM: generation confidence after decoding, or a verifier's score."""
    skip: SkipState | None = None
    """SkipKV: the sentences of this segment's generated tokens and where they sit in its KV."""

    def kv_ancestors(self) -> list[_Segment]:
        """Ancestors whose KV this segment attends to, nearest first."""
        out = []
        seg = self
        while seg.shares_parent and seg.parent is not None:
            seg = seg.parent
            out.append(seg)
        return out

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.n_computed :]

    @property
    def kv_tokens(self) -> int:
        """Tokens physically held in KV (fewer than `n_computed` once RSBCM evicted blocks)."""
        return int(self.keys[0].shape[1]) if self.keys else 0


@dataclass
class _Row:
    """Decode bookkeeping for one batch row during `extend`."""

    seg: _Segment
    kv_len: int  # valid KV tokens in the tail buffer for this row (physical)
    computed: int  # tokens of the segment whose KV was computed (logical; > kv_len after eviction)
    tail_start: int = 0  # where the row's own KV starts in the tail (after copied ancestors)
    out: list[int] = field(default_factory=list)
    top1: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: FinishReason | None = None
    captured: bool = False


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> int:
    return _common_prefix(a[::-1], b[::-1])


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when present, else CPU; anything else is passed to torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' = bf16 on CUDA, fp32 on CPU (bf16 matmuls are slow on most CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in table:
        raise ValueError(f"dtype={dtype!r} is not one of 'auto', {', '.join(map(repr, table))}")
    return table[dtype]


class HFBackend:
    """Local backend over a HuggingFace causal LM (Llama family). See the module docstring.

    `HFBackend()` loads the embedded SmolLM2-135M-Instruct; `HFBackend("Qwen/Qwen2.5-1.5B-Instruct")`
    or a local path loads any supported model. Operations are serialised by a lock, so the backend
    can be shared by threads (concurrent callers wait; batching across callers is the caller's job).
    """

    name = "hf"

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        share: ShareMode = "exact",
        accel: Accel | None = None,
        broadcast: Broadcast = "cascade",
    ) -> None:
        dev = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, dev)
        name = EMBEDDED_MODEL if model is None else str(model)
        path: str | Path = embedded_model_dir() if name == EMBEDDED_MODEL else name
        log.info("loading %s (%s, %s)", name, torch_dtype, dev)
        attention.register()
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        if broadcast not in ("cascade", "copy"):
            raise ValueError(f"broadcast={broadcast!r} is not one of 'cascade', 'copy'")
        self._setup(loaded.to(dev), tokenizer, share=share, model_name=name, accel=accel)
        self.broadcast = broadcast

    @classmethod
    def from_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        share: ShareMode = "exact",
        accel: Accel | None = None,
    ) -> HFBackend:
        """Wrap an already loaded model (tests, notebooks) without reloading it."""
        self = cls.__new__(cls)
        attention.register()
        name = getattr(model.config, "_name_or_path", "model")
        self._setup(model, tokenizer, share=share, model_name=name, accel=accel)
        return self

    def _setup(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        share: ShareMode,
        model_name: str,
        accel: Accel | None,
    ) -> None:
        if share not in SHARE_MODES:
            raise ValueError(f"share={share!r} is not one of {SHARE_MODES}")
        model.eval()
        model.set_attn_implementation(attention.ATTN_NAME)
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.share: ShareMode = share
        self.parts: DecoderParts = decoder_parts(model)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_token_bytes = kv_bytes_per_token(self.parts, self.dtype)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_ids = eos_ids
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids), 0)
        self._segments: dict[int, _Segment] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._stats = KVStats()
        self._held = 0
        self._probe: KVProbe | None = None
        self._delimiters: frozenset[int] | None = None  # SkipKV's newline delimiter ids, scanned on first use
        self.accel = accel or Accel()
        self.broadcast: Broadcast = "cascade"

    @property
    def accel(self) -> Accel:
        """The accelerations applied to every op (see `branchwise.backends.accel.Accel`)."""
        return self._accel

    @accel.setter
    def accel(self, value: Accel) -> None:
        if value.skipkv is not None and value.rsbcm is not None:
            raise ValueError("accel.skipkv and accel.rsbcm both evict a branch's KV; enable one of them")
        self._accel = value
        river: RiverPath | None = getattr(self, "_river", None)
        if value.river is None:
            self._river = None
        elif river is None or not river.same_weights(value.river):
            self._river = RiverPath(self.parts, value.river, self.device)
        else:
            river.cfg = value.river  # threshold/prefill/audit change without rebuilding the river
        self._skip = None
        if value.skipkv is not None:
            if self._delimiters is None:  # a vocabulary scan: once per backend, not per accel change
                self._delimiters = delimiter_token_ids(self.tokenizer)
            self._skip = SkipKV(value.skipkv, self.tokenizer, self.parts, self.model_name, self._delimiters)
        self.cgee_theta, self.cgee_l_min, self.cgee_tau_conf, self.cgee_r_gap = DEFAULT_THETA, 2, 0.70, 0.06
        cgee = value.cgee
        if cgee is not None:
            # explicit values win; otherwise the model's saved calibration; otherwise the paper's defaults
            cal = Calibration.load(self.model_name)

            def pick(explicit: float | None, calibrated: float | None, paper: float) -> float:
                return explicit if explicit is not None else calibrated if calibrated is not None else paper

            self.cgee_theta = pick(cgee.theta, cal.theta if cal else None, DEFAULT_THETA)
            self.cgee_l_min = int(pick(cgee.l_min, cal.l_min if cal else None, 2))
            self.cgee_tau_conf = pick(cgee.tau_conf, cal.tau_conf if cal else None, 0.70)
            self.cgee_r_gap = pick(cgee.r_gap, cal.r_gap if cal else None, 0.06)

    def skip_verify(self, confidences: Sequence[float]) -> bool:
        """CGEE level 1 (RKSC Eq. 4) with this model's thresholds; False when level 1 is off."""
        cgee = self.accel.cgee
        return (
            cgee is not None and cgee.level1 and verify_skip(confidences, self.cgee_tau_conf, self.cgee_r_gap)
        )

    def _bump(self, key: str, value: float = 1.0) -> None:
        self._stats.extra[key] = self._stats.extra.get(key, 0.0) + value

    # ------------------------------------------------------------------ text
    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            return self.encode("\n".join(m["content"] for m in messages) + "\n")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    # ------------------------------------------------------------------ tree ops
    def prefill(self, token_ids: Sequence[int]) -> NodeId:
        ids = self._check_ids(token_ids, "token_ids")
        if not ids:
            raise ValueError("token_ids must hold at least 1 token")
        with self._lock:
            return self._new_segment(None, False, ids).id

    def fork(self, node: NodeId, n: int, share: ShareMode | None = None) -> list[NodeId]:
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        mode = self.share if share is None else share
        if mode not in SHARE_MODES:
            raise ValueError(f"share={mode!r} is not one of {SHARE_MODES}")
        with self._lock:
            parent = self._get(node)
            path = self._path_tokens(parent)
            if mode == "exact" and not self._sharing_pays(path, n):
                mode = "none"
            children = []
            for _ in range(n):
                if mode == "exact":
                    child = self._new_segment(parent, True, [])
                    self._stats.tokens_reused += len(path)
                else:
                    child = self._new_segment(parent, False, list(path))
                children.append(child.id)
            parent.live_children += n
            return children

    def fork_prompts(
        self, node: NodeId, prompts: Sequence[Sequence[int]], share: ShareMode | None = None
    ) -> list[NodeId]:
        """One child per prompt, each standing for that whole token sequence (not appended to `node`).

        `share="exact"` reuses the longest common token prefix with `node`'s path (splitting the
        segment that holds it); with ASKS on, a prompt that diverges from the root may instead reuse
        the root's whole KV when the Eq. 2 similarity passes τ (see `asks.py`). `share="none"`
        recomputes every prompt. Stats: `asks_exact`, `asks_reused`, `asks_rejected`, `asks_sigma_sum`.
        """
        mode = self.share if share is None else share
        if mode not in SHARE_MODES:
            raise ValueError(f"share={mode!r} is not one of {SHARE_MODES}")
        ids = [self._check_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        if any(not p for p in ids):
            raise ValueError("every prompt must hold at least 1 token")
        with self._lock:
            root = self._get(node)
            path = self._path_tokens(root)
            if mode == "exact" and not self._sharing_pays(path, len(ids)):
                mode = "none"
            if mode == "none":
                root.live_children += len(ids)
                return [self._new_segment(root, False, list(p)).id for p in ids]
            if root.pending or root.last_logits is None:
                self._run([root], None)
            out: list[int | None] = [None] * len(ids)
            gate: list[tuple[int, int, int]] = []  # (prompt index, common prefix k, common suffix m)
            for i, p in enumerate(ids):
                k = _common_prefix(path, p)
                if k == len(path):
                    out[i] = self._share_child(root, p[k:], len(path))
                    self._bump("asks_exact")
                    continue
                k = min(k, len(p) - 1)
                m = min(_common_suffix(path, p), len(p) - k - 1, len(path) - k - 1)
                if self.accel.asks is None or m < 0:
                    out[i] = self._exact_child(root, k, p)
                else:
                    gate.append((i, k, m))
            if gate:
                self._asks_gate(root, path, ids, gate, out)
            return [int(c) for c in out]

    def _share_child(self, root: _Segment, own: list[int], reused: int) -> int:
        child = self._new_segment(root, True, list(own))
        root.live_children += 1
        self._stats.tokens_reused += reused
        return child.id

    def _exact_child(self, root: _Segment, k: int, prompt: list[int]) -> int:
        """A child sharing the first k tokens of root's path (k = 0: nothing shared)."""
        if k == 0:
            root.live_children += 1
            return self._new_segment(root, False, list(prompt)).id
        base = self._prefix_node(root, k)
        child = self._new_segment(base, True, list(prompt[k:]))
        base.live_children += 1
        self._stats.tokens_reused += k
        self._adopt(root, child)
        return child.id

    def _adopt(self, root: _Segment, child: _Segment) -> None:
        """Count `child` as a logical child of `root` too, so `root` stays frozen while it lives."""
        child.logical_parent = root
        root.live_children += 1

    def _prefix_node(self, root: _Segment, k: int) -> _Segment:
        """The segment whose KV chain ends exactly at path position k (splitting one if needed)."""
        chain = list(reversed([root, *root.kv_ancestors()]))
        start = 0
        for seg in chain:
            end = start + len(seg.tokens)
            if k == end:
                return seg
            if start < k < end:
                return self._split(seg, k - start)
            start = end
        raise ValueError(f"position {k} is beyond the path of node {root.id}")

    def _split(self, seg: _Segment, k: int) -> _Segment:
        """Move seg's first k tokens (and their KV) into a new parent segment; returns the parent."""
        if seg.n_computed < k:
            raise RuntimeError("cannot split a segment inside its uncomputed tokens")
        if seg.kv_tokens != seg.n_computed:
            raise RuntimeError("cannot split a segment RSBCM has evicted blocks from")
        head = _Segment(
            id=self._next_id,
            parent=seg.parent,
            shares_parent=seg.shares_parent,
            tokens=seg.tokens[:k],
            n_computed=k,
            live_children=1,
            released=True,
        )
        self._next_id += 1
        self._segments[head.id] = head
        keys = [t[:, :k].clone() for t in seg.keys]
        values = [t[:, :k].clone() for t in seg.values]
        rest_k = [t[:, k:].clone() for t in seg.keys]
        rest_v = [t[:, k:].clone() for t in seg.values]
        self._set_kv(head, keys, values)
        self._set_kv(seg, rest_k, rest_v)
        if seg.mass is not None:
            head.mass, seg.mass = seg.mass[:k].clone(), seg.mass[k:].clone()
        seg.tokens, seg.n_computed = seg.tokens[k:], seg.n_computed - k
        seg.parent, seg.shares_parent = head, True
        return head

    def _asks_gate(
        self,
        root: _Segment,
        path: list[int],
        ids: list[list[int]],
        gate: list[tuple[int, int, int]],
        out: list[int | None],
    ) -> None:
        """Alg. 2 in one batched pass: branch divergent parts and the root's, over the exact common prefix."""
        cfg = self.accel.asks
        probes: list[_Segment] = []
        refs: dict[tuple[int, int], _Segment] = {}
        for i, k, m in gate:
            base = self._prefix_node(root, k) if k else None
            seg = self._new_segment(base, base is not None, list(ids[i][k : len(ids[i]) - m]))
            if base is not None:
                base.live_children += 1
            probes.append(seg)
            if (k, m) not in refs:
                ref = self._new_segment(base, base is not None, list(path[k : len(path) - m]))
                if base is not None:
                    base.live_children += 1
                refs[(k, m)] = ref
        batch = probes + list(refs.values())
        capture = HiddenCapture()
        self._run(batch, None, observer=capture)
        states = capture.stacked()  # [L, rows, H]
        weights = layer_weights(self.parts.n_layers, cfg.alpha).to(states.device)
        ref_index = {key: len(probes) + j for j, key in enumerate(refs)}
        for (i, k, m), seg in zip(gate, probes, strict=True):
            root_state = torch.nn.functional.normalize(states[:, ref_index[(k, m)]].double(), dim=-1)
            sigma = float(similarity(states[:, probes.index(seg)][:, None], root_state, weights)[0])
            self._bump("asks_sigma_sum", sigma)
            if sigma >= cfg.tau:
                out[i] = self._share_child(root, [], len(path))
                seg.released = True
                self._maybe_free(seg)
                self._bump("asks_reused")
            else:
                seg.tokens.extend(ids[i][len(ids[i]) - m :] if m else [])
                self._adopt(root, seg)
                out[i] = seg.id
                self._bump("asks_rejected")
        for ref in refs.values():
            ref.released = True
            self._maybe_free(ref)

    def _sharing_pays(self, path: list[int], n: int) -> bool:
        """The KV probe's verdict for this prefix length and branch count (True when the probe is off)."""
        cfg = self.accel.probe
        if cfg is None or cfg.override == "share":
            return True
        if cfg.override == "recompute":
            return False
        if self._probe is None or (self._probe.bucket_tokens, self._probe.repeats) != (
            cfg.bucket_tokens,
            cfg.repeats,
        ):
            self._probe = KVProbe(cfg.bucket_tokens, cfg.repeats)
        key = self._probe.key(len(path), n)
        if key in self._probe.verdicts:
            return self._probe.verdicts[key]
        saved_stats, saved_accel = copy.deepcopy(self._stats), self._accel
        self._accel = Accel()
        suffix = path[-1:]

        def paths(share: ShareMode, prefix_only: bool = False) -> None:
            root = self._new_segment(None, False, list(path))
            if prefix_only:
                self._run([root], None)
            else:
                if share == "exact":
                    self._run([root], None)
                kids = self.fork(root.id, n, share=share)
                self.append(kids, [suffix] * n)
                self._run([self._segments[k] for k in kids], None)
                self.release(kids)
            self.release([root.id])

        try:
            verdict = self._probe.decide(
                len(path),
                n,
                lambda: paths("none"),
                lambda: paths("exact", prefix_only=True),
                lambda: paths("exact"),
            )
        finally:
            self._stats, self._accel = saved_stats, saved_accel
        self._bump("probe_share" if verdict else "probe_recompute")
        return verdict

    def append(self, nodes: Sequence[NodeId], token_ids: Sequence[Sequence[int]]) -> None:
        if len(nodes) != len(token_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(nodes)} nodes")
        with self._lock:
            for node, ids in zip(nodes, token_ids, strict=True):
                seg = self._growable(node)
                seg.tokens.extend(self._check_ids(ids, "token_ids"))

    def extend(self, nodes: Sequence[NodeId], params: DecodeParams) -> list[Generation]:
        with self._lock:
            segs = [self._growable(n) for n in nodes]
            if len({s.id for s in segs}) != len(segs):
                raise ValueError("nodes must be distinct; fork a node to decode it several times")
            if not segs:
                return []
            return self._run(segs, params)

    def score_next(
        self,
        nodes: Sequence[NodeId],
        suffix: Sequence[int],
        candidates: Sequence[int],
        trace: list[EntropyTrace] | None = None,
    ) -> list[list[float]]:
        """See `Backend.score_next`. With CGEE level 2 on, each row may stop at an earlier layer.

        Pass a list as `trace` to receive each row's per-layer entropies and exit layer (with level 2
        off, every layer is recorded: that is what calibration needs).
        """
        cand = self._check_ids(candidates, "candidates")
        suffix_ids = self._check_ids(suffix, "suffix")
        if not suffix_ids:
            raise ValueError("suffix must hold at least 1 token")
        with self._lock:
            probes = [self.fork(n, 1)[0] for n in nodes]
            try:
                segs = [self._segments[p] for p in probes]
                for seg in segs:
                    seg.tokens.extend(suffix_ids)
                cgee = self.accel.cgee
                observer = None
                if cgee is not None and cgee.level2:
                    observer = EntropyExit(
                        self.parts,
                        len(segs),
                        self.cgee_theta,
                        cgee.epsilon,
                        self.cgee_l_min,
                        candidates=cand,
                        min_candidate_mass=cgee.min_candidate_mass,
                    )
                elif trace is not None:
                    observer = EntropyExit(
                        self.parts, len(segs), DEFAULT_THETA, 3.0, 1, exit=False, candidates=cand
                    )
                self._materialize_ancestors(segs)
                _, ctx, feeds = self._prepare(segs, 0)
                logits = self._forward(ctx, feeds, observer)
                probs = torch.softmax(logits.float(), dim=-1)[:, cand]
                if observer is not None:
                    layers = [t.exit_layer or self.parts.n_layers for t in observer.traces]
                    self._bump("verify_rows", len(layers))
                    self._bump("verify_layers", sum(layers))
                    self._bump("verify_exits", sum(t.exit_layer is not None for t in observer.traces))
                    if trace is not None:
                        for row, t in enumerate(observer.traces):
                            if t.exit_layer is None:
                                t.probs[self.parts.n_layers] = probs[row].tolist()
                        trace.extend(observer.traces)
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
        probe_ids = self._check_ids(probe, "probe")
        if not probe_ids:
            raise ValueError("probe must hold at least 1 token")
        if not nodes:
            return torch.zeros(0, self.parts.embed.embedding_dim)
        with self._lock:
            kids = [self.fork(n, 1)[0] for n in nodes]
            try:
                segs = [self._segments[k] for k in kids]
                for seg in segs:
                    seg.tokens.extend(probe_ids)
                self._materialize_ancestors(segs)
                _, ctx, feeds = self._prepare(segs, 0)
                capture = HiddenCapture()
                self._forward(ctx, feeds, capture)
                with torch.inference_mode():
                    return self.parts.norm(capture.states[-1]).float().cpu()
            finally:
                self.release(kids)

    def release(self, nodes: Sequence[NodeId]) -> None:
        with self._lock:
            for node in nodes:
                seg = self._segments.get(node)
                if seg is None or seg.released:
                    raise KeyError(f"node {node} is not live")
                seg.released = True
                self._maybe_free(seg)

    def tokens(self, node: NodeId) -> list[int]:
        with self._lock:
            return self._path_tokens(self._get(node))

    def kv_stats(self) -> KVStats:
        with self._lock:
            s = self._stats
            return KVStats(
                bytes_held=self._held,
                peak_bytes=s.peak_bytes,
                tokens_computed=s.tokens_computed,
                tokens_reused=s.tokens_reused,
                forward_calls=s.forward_calls,
                live_nodes=len(self._segments),
                extra=dict(s.extra),
            )

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = KVStats(peak_bytes=self._held)

    # ------------------------------------------------------------------ baseline
    def hf_generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        exact_length: bool = False,
        return_cache_bytes: bool = False,
    ) -> list[list[int]] | tuple[list[list[int]], int]:
        """What users do today: `model.generate` (greedy) on a left-padded batch. A baseline only.

        With `return_cache_bytes`, also returns the bytes of the KV cache `generate` ended with.
        """
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(list(p))
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens if exact_length else None,
                pad_token_id=self.pad_id,
                temperature=None,
                top_p=None,
                top_k=None,
                return_dict_in_generate=return_cache_bytes,
            )
        sequences = out.sequences if return_cache_bytes else out
        tokens = [row[width:].tolist() for row in sequences.cpu()]
        if not return_cache_bytes:
            return tokens
        cache = out.past_key_values
        nbytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return tokens, nbytes

    # ------------------------------------------------------------------ internals
    def _check_ids(self, ids: Sequence[int], name: str) -> list[int]:
        vocab = self.parts.embed.num_embeddings
        out = [int(t) for t in ids]
        bad = [t for t in out if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} holds ids outside [0, {vocab}): {bad[:5]}")
        return out

    def _new_segment(self, parent: _Segment | None, shares: bool, tokens: list[int]) -> _Segment:
        seg = _Segment(id=self._next_id, parent=parent, shares_parent=shares, tokens=tokens)
        self._next_id += 1
        self._segments[seg.id] = seg
        return seg

    def _get(self, node: NodeId) -> _Segment:
        seg = self._segments.get(node)
        if seg is None or seg.released:
            raise KeyError(f"node {node} is not live")
        return seg

    def _growable(self, node: NodeId) -> _Segment:
        seg = self._get(node)
        if seg.live_children:
            raise ValueError(
                f"node {node} has {seg.live_children} live children and is frozen; fork it instead"
            )
        return seg

    def _path_tokens(self, seg: _Segment) -> list[int]:
        chain = [seg, *seg.kv_ancestors()]
        return [t for s in reversed(chain) for t in s.tokens]

    def _maybe_free(self, seg: _Segment) -> None:
        """Free released segments without live children, then whatever that frees upstream.

        A segment counts as a child of its KV parent and, when forked elsewhere (a split prefix), of
        its logical parent too; a worklist visits both without freeing anything twice.
        """
        work = [seg]
        while work:
            seg = work.pop()
            if seg.id not in self._segments or not seg.released or seg.live_children:
                continue
            self._set_kv(seg, None, None)
            seg.last_logits = seg.mass = None
            del self._segments[seg.id]
            for up in (seg.parent, seg.logical_parent):
                if up is not None:
                    up.live_children -= 1
                    work.append(up)

    def _set_kv(
        self, seg: _Segment, keys: list[torch.Tensor] | None, values: list[torch.Tensor] | None
    ) -> None:
        self._held -= seg.kv_bytes
        seg.keys, seg.values = keys, values
        seg.kv_bytes = sum(t.nbytes for t in keys) + sum(t.nbytes for t in values) if keys else 0
        self._held += seg.kv_bytes
        self._stats.peak_bytes = max(self._stats.peak_bytes, self._held)

    def _materialize_ancestors(self, segs: Sequence[_Segment]) -> None:
        """Compute pending tokens of shared ancestors, top-down, batching those at the same depth."""
        while True:
            todo: dict[int, _Segment] = {}
            for seg in segs:
                for anc in seg.kv_ancestors():
                    if anc.pending:
                        todo[anc.id] = anc
            if not todo:
                return
            ready = [a for a in todo.values() if not any(x.id in todo for x in a.kv_ancestors())]
            self._run(ready, None)

    def _start_context(self, rows: Sequence[_Row], extra: int) -> BatchContext:
        """Batch buffers for `rows`: each row's own KV in its tail; ancestors shared (or copied).

        With `broadcast="copy"` (the RKSC notebook's `repeat_interleave(...).clone()`, kept as a
        baseline) every row gets its own copy of its ancestors' KV in front of its tail instead.
        """
        parts = self.parts
        b = len(rows)
        copy_mode = self.broadcast == "copy"
        if copy_mode and self.accel.rsbcm is not None:
            raise ValueError("RSBCM needs broadcast='cascade' (block masses are kept per shared segment)")
        for r in rows:
            chain = list(reversed(r.seg.kv_ancestors())) if copy_mode else []
            r.tail_start = sum(a.kv_tokens for a in chain)
        lens = [r.tail_start + r.kv_len for r in rows]
        cap = max(n + len(r.seg.pending) for n, r in zip(lens, rows, strict=True)) + extra
        shape = (b, parts.n_kv_heads, max(cap, 1), parts.head_dim)
        # zeros, not empty: masked slots still enter the products (0 * NaN garbage would be NaN)
        tail_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(parts.n_layers)]
        tail_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(parts.n_layers)]
        for i, r in enumerate(rows):
            pieces = (list(reversed(r.seg.kv_ancestors())) if copy_mode else []) + [r.seg]
            at = 0
            for piece in pieces:
                n = r.kv_len if piece is r.seg else piece.kv_tokens
                if n:
                    for layer in range(parts.n_layers):
                        tail_k[layer][i, :, at : at + n] = piece.keys[layer]
                        tail_v[layer][i, :, at : at + n] = piece.values[layer]
                at += n
        groups: dict[int, tuple[_Segment, list[int]]] = {}
        for i, r in enumerate(rows):
            for anc in [] if copy_mode else r.seg.kv_ancestors():
                groups.setdefault(anc.id, (anc, []))[1].append(i)
        rsbcm = self.accel.rsbcm

        def evictable(seg: _Segment) -> bool:
            return rsbcm is not None and not (
                rsbcm.pin_prompt and seg.parent is None and not seg.kv_ancestors()
            )

        shared = [
            SharedSegment(
                anc.keys,
                anc.values,
                None if len(idx) == b else torch.tensor(idx, device=self.device),
                anc.id,
                evictable(anc),
            )
            for anc, idx in groups.values()
            if anc.kv_tokens  # a segment RSBCM emptied has nothing left to attend to
        ]
        ctx = BatchContext(
            tail_k=tail_k,
            tail_v=tail_v,
            lens=torch.tensor(lens, device=self.device),
            shared=shared,
            n_groups=parts.n_heads // parts.n_kv_heads,
            # only when something here can be evicted: tracking forces the explicit-softmax path
            track_mass=any(evictable(r.seg) for r in rows) or any(seg.track for seg in shared),
        )
        if ctx.track_mass:
            ctx.own_mass = torch.zeros(b, shape[2], device=self.device)
            for i, r in enumerate(rows):
                if r.kv_len and r.seg.mass is not None:
                    ctx.own_mass[i, r.tail_start : r.tail_start + r.kv_len] = r.seg.mass
        return ctx

    def _ctx_bytes(self, ctx: BatchContext) -> int:
        return sum(t.nbytes for t in ctx.tail_k) * 2

    @torch.inference_mode()
    def _forward(
        self,
        ctx: BatchContext,
        feeds: Sequence[Sequence[int]],
        observer: LayerObserver | None = None,
        steer: Steering | None = None,
    ) -> torch.Tensor:
        """Push `feeds[b]` (0+ tokens) through the model for every row; logits after each row's last one.

        `steer` (SkipKV §4.2) adds its vector to one layer's residual input at delimiter tokens. With
        River on, the batch leaves the backbone for the quantized river once every row's state
        transition is similar enough (decode: token level; prefill: sequence level).

        `observer.after_layer` sees each layer's output at every row's last fed token and may let rows
        exit early with their own logits (CGEE level 2); exited rows are dropped from the batch for the
        remaining layers, so `ctx` must not be captured afterwards.
        """
        parts = self.parts
        b = len(feeds)
        counts = [len(f) for f in feeds]
        q = max(max(counts), 1)
        ids = torch.full((b, q), self.pad_id, dtype=torch.long)
        for i, f in enumerate(feeds):
            if f:
                ids[i, : len(f)] = torch.tensor(list(f), dtype=torch.long)
        ids = ids.to(self.device)
        ctx.begin(q)
        # logical positions: evicted KV (RSBCM) leaves the tail shorter than the token path
        pos = ctx.pos_next[:, None] + torch.arange(q, device=self.device)[None, :]
        h = parts.embed(ids)
        cos, sin = parts.rotary(h, pos)
        last = torch.tensor([max(c, 1) - 1 for c in counts], device=self.device)
        rows = torch.arange(b, device=self.device)  # original row of each active batch position
        logits: torch.Tensor | None = None
        river = self._river if self._river is not None and (q == 1 or self.accel.river.prefill) else None
        exited_at: int | None = None  # River: the backbone layer after which the batch left for the river
        audit: torch.Tensor | None = None  # River audit: the backbone's own logits for exited tokens
        n_fed = torch.tensor(counts, device=self.device)

        def run(block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            return block(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin), bw_ctx=ctx)

        for index, layer in enumerate(parts.layers):
            if steer is not None and index == steer.layer:
                h = steer.apply(h, ids[rows], rows)
            if exited_at is not None:
                h = run(river.layers[index], h)
            else:
                h_in = h
                h = run(layer, h)
                if river is not None and river.may_exit(index) and river.passes(h_in, h, n_fed[rows]):
                    exited_at = index
                    if river.cfg.audit and observer is None:
                        audit = self._audit_backbone(h, index, last, run)
            if observer is None:
                continue
            exits = observer.after_layer(index, h[torch.arange(len(rows), device=self.device), last], rows)
            if exits is None:
                continue
            exited, exit_logits = exits
            if logits is None:
                logits = exit_logits.new_zeros(b, exit_logits.shape[-1])
            logits[rows[exited]] = exit_logits[exited]
            keep = (~exited).nonzero().squeeze(-1)
            ctx.select_rows(keep, {int(old): new for new, old in enumerate(keep.tolist())})
            h, pos, cos, sin, last, rows = h[keep], pos[keep], cos[keep], sin[keep], last[keep], rows[keep]
            if keep.numel() == 0:
                break
        if len(rows):
            h_last = parts.norm(h[torch.arange(len(rows), device=self.device), last])
            ctx.last_hidden = h_last
            final = parts.head(h_last)
            if logits is None:
                logits = final
            else:
                logits[rows] = final.to(logits.dtype)
        if river is not None:
            self._river_account(exited_at, sum(counts), q == 1, logits, audit)
        advance = torch.tensor(counts, device=self.device)[rows]
        ctx.lens = ctx.lens + advance
        ctx.pos_next = ctx.pos_next + advance
        self._stats.tokens_computed += sum(counts)
        self._stats.forward_calls += 1
        self._stats.peak_bytes = max(self._stats.peak_bytes, self._held + self._ctx_bytes(ctx))
        return logits

    def _audit_backbone(
        self,
        h: torch.Tensor,
        index: int,
        last: torch.Tensor,
        run: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """River audit: finish the forward on the backbone too, for the logits it would have given.

        The backbone layers write their K/V first and the river layers then overwrite the same slots,
        so the cache ends up exactly as in an unaudited run; only the time (and RSBCM's attention mass,
        counted twice) differ, which is why audit runs are for fidelity numbers, not timings.
        """
        for j in range(index + 1, self.parts.n_layers):
            h = run(self.parts.layers[j], h)
        return self.parts.head(self.parts.norm(h[torch.arange(h.shape[0], device=self.device), last]))

    def _river_account(
        self,
        exited_at: int | None,
        n_tokens: int,
        decode: bool,
        logits: torch.Tensor | None,
        audit: torch.Tensor | None,
    ) -> None:
        """Per-forward River statistics: backbone depth per token (all, and decode steps alone, which
        the paper's mean exit layer counts), exits, and audited fidelity."""
        depth = self.parts.n_layers if exited_at is None else exited_at + 1
        self._bump("river_forwards")
        self._bump("river_tokens", n_tokens)
        self._bump("river_backbone_layers", depth * n_tokens)
        if decode:
            self._bump("river_decode_tokens", n_tokens)
            self._bump("river_decode_backbone_layers", depth * n_tokens)
        if exited_at is not None:
            self._bump("river_exits")
            self._bump("river_exit_tokens", n_tokens)
        if audit is not None and logits is not None:
            match, kl = exit_fidelity(audit, logits)
            self._bump("river_audit_rows", match.numel())
            self._bump("river_audit_matches", int(match.sum()))
            self._bump("river_audit_kl_sum", float(kl.sum()))

    def _capture(self, ctx: BatchContext, pos: int, row: _Row) -> None:
        """Copy a row's KV out of the batch buffers into its segment (independent tensors, so
        releasing the node frees exactly its memory)."""
        n, at = row.kv_len, row.tail_start
        keys = [t[pos, :, at : at + n].clone() for t in ctx.tail_k]
        values = [t[pos, :, at : at + n].clone() for t in ctx.tail_v]
        self._set_kv(row.seg, keys, values)
        row.seg.n_computed = row.computed
        if ctx.own_mass is not None:
            row.seg.mass = ctx.own_mass[pos, at : at + n].clone()
        row.captured = True

    def _prepare(
        self, segs: Sequence[_Segment], extra: int
    ) -> tuple[list[_Row], BatchContext, list[list[int]]]:
        """Batch rows, their KV context (with `extra` free slots each) and pending feeds."""
        rows = [_Row(seg=s, kv_len=s.kv_tokens, computed=s.n_computed) for s in segs]
        ctx = self._start_context(rows, extra)
        offsets = [sum(len(a.tokens) for a in s.kv_ancestors()) + s.n_computed for s in segs]
        ctx.pos_next = torch.tensor(offsets, device=self.device)
        return rows, ctx, [s.pending for s in segs]

    def _run(
        self, segs: Sequence[_Segment], params: DecodeParams | None, observer: LayerObserver | None = None
    ) -> list[Generation]:
        """Compute pending tokens of `segs` and, with `params`, decode them as one batch.

        `observer` watches the pending-token forward (it must not exit rows: their KV is kept).
        """
        self._materialize_ancestors(segs)
        pending = [s for s in segs if s.pending]
        if (
            params is not None
            and pending
            and len(pending) < len(segs)
            and max(len(s.pending) for s in pending) > 1
        ):
            # a mixed batch would push dummy tokens through every row for the longest pending run
            # (e.g. ASKS: reused branches have nothing to prefill, rejected ones a whole prompt)
            self._run(pending, None, observer)
        rows, ctx, feeds = self._prepare(segs, 0 if params is None else min(params.max_tokens, 128))
        logits = None
        if any(feeds):
            logits = self._forward(ctx, feeds, observer)
        start = []
        for i, (r, f) in enumerate(zip(rows, feeds, strict=True)):
            r.kv_len += len(f)
            r.computed += len(f)
            if r.seg.skip is not None and f:  # e.g. the last sampled token of an earlier extend
                r.seg.skip.tracker.append(f)
            if f:
                start.append(logits[i])
            else:
                source = r.seg if r.seg.n_computed else r.seg.parent
                start.append(source.last_logits)
        if params is None:
            for i, r in enumerate(rows):
                self._capture(ctx, i, r)
                r.seg.last_logits = start[i].detach().clone()
            generations: list[Generation] = []
        else:
            generations = self._decode(ctx, rows, torch.stack(start), params)
        if ctx.track_mass:
            self._fold_mass(ctx)
            if params is not None:  # capacity is checked once per decode batch, as in RKSC's solve
                self._enforce_capacity()
        return generations

    def _fold_mass(self, ctx: BatchContext) -> None:
        """Add the attention mass shared segments received in this batch to their running totals."""
        for key, mass in ctx.seg_mass.items():
            seg = self._segments.get(key)
            if seg is not None and seg.kv_tokens == mass.shape[0]:
                seg.mass = mass if seg.mass is None else seg.mass + mass

    def _enforce_capacity(self) -> None:
        """RSBCM: evict the lowest-ω blocks above capacity, freeing their tensors (Alg. 4)."""
        cfg = self.accel.rsbcm
        table = []
        for seg in self._segments.values():
            depth = len(seg.kv_ancestors())
            if seg.kv_tokens and not (cfg.pin_prompt and depth == 0 and seg.parent is None):
                table += blocks_of(seg.id, seg.mass, seg.kv_tokens, cfg.block_tokens, seg.score, depth)
        evictions = plan_evictions(table, cfg.capacity_blocks)
        by_segment: dict[int, list[Block]] = {}
        for block in evictions:
            by_segment.setdefault(block.segment, []).append(block)
        for key, blocks in by_segment.items():
            seg = self._segments[key]
            keep = keep_mask(seg.kv_tokens, blocks, self.device)
            self._set_kv(seg, [k[:, keep] for k in seg.keys], [v[:, keep] for v in seg.values])
            seg.mass = seg.mass[keep] if seg.mass is not None else None
            self._bump("rsbcm_evicted_tokens", int((~keep).sum()))
        self._bump("rsbcm_evictions", len(evictions))

    def set_scores(self, nodes: Sequence[NodeId], scores: Sequence[float]) -> None:
        """Tell RSBCM how good each branch is (a verifier's score); higher keeps its blocks longer."""
        with self._lock:
            for node, score in zip(nodes, scores, strict=True):
                self._get(node).score = float(score)

    def _decode(
        self,
        ctx: BatchContext,
        rows: list[_Row],
        logits: torch.Tensor,
        params: DecodeParams,
    ) -> list[Generation]:
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed)
        present = list(range(len(rows)))  # batch position -> row index
        skip = self._skip
        if skip is not None:
            skip.begin(ctx, rows)
        for step in range(params.max_tokens):
            if step < params.min_tokens and self.eos_ids:
                logits = logits.clone()
                logits[:, list(self.eos_ids)] = float("-inf")
            tokens, top1, chosen = pick_tokens(logits, params.temperature, params.top_p, gen)
            tok_list, top1_list, lp_list = tokens.tolist(), top1.tolist(), chosen.tolist()
            for pos, ri in enumerate(present):
                r = rows[ri]
                if r.finish is not None:
                    continue
                r.out.append(tok_list[pos])
                r.seg.tokens.append(tok_list[pos])
                r.top1.append(top1_list[pos])
                r.logprobs.append(lp_list[pos])
                r.finish = self._finished(r, params, last_step=step == params.max_tokens - 1)
            alive = [ri for ri in present if rows[ri].finish is None]
            if alive and self._decode_gate_fires(rows, step):
                for ri in alive:
                    rows[ri].finish = "confident"
                self._bump("decode_gate_stops")
                alive = []
            if not alive:
                break
            dead = len(present) - len(alive)
            if dead and dead * 4 >= len(present):
                for pos, ri in enumerate(present):
                    if rows[ri].finish is not None:
                        self._capture(ctx, pos, rows[ri])
                keep = [pos for pos, ri in enumerate(present) if rows[ri].finish is None]
                ctx.select_rows(
                    torch.tensor(keep, device=self.device), {old: new for new, old in enumerate(keep)}
                )
                present = alive
            feeds = [[rows[ri].out[-1]] if rows[ri].finish is None else [] for ri in present]
            steer = None if skip is None else skip.steering([rows[ri] for ri in present])
            logits = self._forward(ctx, feeds, steer=steer)
            for ri, f in zip(present, feeds, strict=True):
                rows[ri].kv_len += len(f)
                rows[ri].computed += len(f)
            if skip is not None:
                for key, value in skip.after_step(ctx, [rows[ri] for ri in present], feeds, step).items():
                    self._bump(key, value)
        for pos, ri in enumerate(present):
            if not rows[ri].captured:
                self._capture(ctx, pos, rows[ri])
        results = []
        for r in rows:
            # the last sampled token was not fed; its KV is computed on the node's next use
            r.seg.last_logits = None
            if r.top1:
                r.seg.score = sum(r.top1) / len(r.top1)
            results.append(
                Generation(
                    node=r.seg.id,
                    token_ids=r.out,
                    text=r.text,
                    top1_probs=r.top1,
                    logprobs=r.logprobs,
                    finish_reason=r.finish or "length",
                )
            )
        return results

    def _decode_gate_fires(self, rows: Sequence[_Row], step: int) -> bool:
        """App. I.1 decode-level gate: one branch's running confidence is decisive (θ_dec, r_dec)."""
        cgee = self.accel.cgee
        if cgee is None or not cgee.decode_gate or len(rows) < 2 or step + 1 < cgee.decode_gate_min_tokens:
            return False
        running = [sum(r.top1) / len(r.top1) for r in rows if r.top1]
        return verify_skip(running, cgee.theta_dec, cgee.r_dec)

    def _finished(self, row: _Row, params: DecodeParams, last_step: bool) -> FinishReason | None:
        """Update the row's text and say whether (and why) it is done."""
        if row.out[-1] in self.eos_ids:
            row.text = self.decode(row.out)
            return "eos"
        text = self.decode(row.out)
        for stop in params.stop:
            cut = text.find(stop)
            if cut >= 0:
                row.text = text[:cut]
                return "stop"
        delim = params.step_delimiter
        if delim:
            body = len(text) - len(text.lstrip())
            at = text.find(delim, body + 1) if body < len(text) else -1
            if at >= 0:
                row.text = text[: at + len(delim)]
                return "delimiter"
        row.text = text
        return "length" if last_step else None
