"""River-LLM (§4): token-level early exit onto a KV-shared "exit river" of weight-quantized layers.

Why a river instead of skipping layers: in a decoder-only model a token that skips layers leaves no
K/V in them, and every later token attends to that gap (River-LLM §3.2, "KV cache absence"). The
river keeps a quantized copy of every layer a token may skip; an exited token still runs those
copies, and because each copy keeps its backbone layer's `self_attn.layer_idx`, the registered
attention function writes its K/V into the backbone's own cache slot. The cache stays complete and
close to what the backbone would have written (the paper measures value cosine > 0.97), while the
exited token pays only for the cheaper quantized layers.

The exit test (§4.2) is the state-transition similarity cos(layer input, layer output): a layer that
barely changes the residual stream says the token is "easy". It is checked for the whole batch, so a
batched forward leaves the backbone only when every row passes; prefill averages it over each row's
fed tokens (sequence level), decode sees one token per row (token level).

The `River` plug-in tests the exit after each backbone layer (`after_layer`) and, once the batch
exits, switches the rest of the forward's layer stack to the river, and the LM head to its
quantized copy (where a fused kernel runs it: the fp32 head is the largest single read per step),
by default refined: the quantized head's top candidates get their logits from the backbone's head
(`RiverConfig.head`).
The quantized layer copies and their kernels are `river_quant.py`.
"""

from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from branchwise.backends.accel import RiverConfig
from branchwise.backends.base import KVStats
from branchwise.backends.hf.arch import DecoderParts
from branchwise.backends.hf.batch import Batch
from branchwise.backends.hf.hooks import Acceleration, Exit, Forward, Setup
from branchwise.backends.hf.river_quant import (
    WeightOnlyLinear,
    build_river,
    quantize_head,
    resolve_kernel,
    river_bytes,
)


def transition_similarity(h_in: Tensor, h_out: Tensor, counts: Tensor) -> Tensor:
    """Per row: mean over its first `counts[b]` tokens of cos(h_in, h_out), in float32; [B].

    `h_in`/`h_out` [B, q, d]. Positions at or past `counts[b]` are padding and ignored. A row with
    no fed tokens gets +1.0, so it never holds back the batch's exit (it has nothing to compute).
    """
    cos = F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)  # [B, q]
    q = cos.shape[1]
    counts = counts.to(cos.device)
    mask = torch.arange(q, device=cos.device)[None, :] < counts[:, None]
    total = (cos * mask).sum(-1)
    mean = total / counts.clamp_min(1).to(cos.dtype)
    return torch.where(counts > 0, mean, torch.ones_like(mean))


def exit_fidelity(backbone_logits: Tensor, river_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: (next-token match, KL(backbone ‖ river)) — the paper's Fig. 7 measures.

    KL is taken in float32 with the backbone as the reference distribution, i.e. how much the river's
    distribution loses relative to the one it replaces; clamped at 0 against rounding.
    """
    match = backbone_logits.argmax(-1) == river_logits.argmax(-1)
    log_p = torch.log_softmax(backbone_logits.float(), dim=-1)
    log_q = torch.log_softmax(river_logits.float(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp_min(0.0)
    return match, kl


def weights_key(cfg: RiverConfig, parts: DecoderParts, device: torch.device) -> tuple[object, ...]:
    """The fields of `cfg` that shape the river's weights: configs with equal keys share one build."""
    dtype = next(parts.layers.parameters()).dtype
    kernel = resolve_kernel(cfg.kernel, cfg.bits, device, dtype)
    # the group size only shapes the 4-bit weight-only kernel; 8 bits (either kernel) is per row
    group = cfg.group_size if cfg.bits == 4 else None
    return (cfg.entry_layer, cfg.bits, kernel, group, cfg.head, head_top_k(cfg))


def head_top_k(cfg: RiverConfig) -> int | None:
    """How many top logits the river's head recomputes from the backbone's (None: not refined)."""
    return cfg.head_top_k if cfg.head == "refined" else None


@dataclass
class RiverPath:
    """The river built for one backend and the weight fields of a config (built once, cached).

    Runs whose configs differ only in threshold, prefill or audit (`same_weights`) share it.
    """

    parts: DecoderParts
    cfg: RiverConfig
    device: torch.device
    layers: list[nn.Module | None] = field(init=False)
    head: nn.Module | None = field(init=False)
    """The LM head exited tokens use: quantized, or quantized and refined (`RiverConfig.head`);
    None: the backbone's (asked for, or no fused kernel for a quantized one)."""
    kernel: str = field(init=False)
    nbytes: int = field(init=False)
    build_s: float = field(init=False)

    def __post_init__(self) -> None:
        dtype = next(self.parts.layers.parameters()).dtype
        self.kernel = resolve_kernel(self.cfg.kernel, self.cfg.bits, self.device, dtype)
        start = time.perf_counter()
        self.layers = build_river(
            self.parts.layers,
            self.cfg.entry_layer,
            self.cfg.bits,
            self.cfg.group_size,
            self.kernel,
            self.device,
        )
        self.head = (
            None
            if self.cfg.head == "backbone"
            else quantize_head(
                self.parts.head,
                self.cfg.bits,
                self.cfg.group_size,
                self.kernel,
                self.device,
                refine_top_k=head_top_k(self.cfg),
            )
        )
        self.build_s = time.perf_counter() - start
        self.nbytes = river_bytes([*self.layers, self.head])
        if self.execution == "dequantize" and self.device.type == "cuda":
            warnings.warn(
                "river on CUDA without torchao: weight-only layers dequantize on every call (memory "
                "saved, no speed-up); pip install 'branchwise[gpu]' (torchao) for its fused int4/int8 "
                "kernels",
                stacklevel=2,
            )

    @property
    def execution(self) -> str:
        """How the river's Linears run: "fused" (torch's CPU int4/int8 kernels), "torchao",
        "dynamic_int8", or "dequantize" (weight-only without a fused kernel: dequantized per call)."""
        if self.kernel in ("torchao", "dynamic_int8"):
            return self.kernel
        mods = [m for layer in self.layers if layer is not None for m in layer.modules()]
        linears = [m for m in mods if isinstance(m, WeightOnlyLinear)]
        return "fused" if linears and all(m.fused for m in linears) else "dequantize"

    def same_weights(self, cfg: RiverConfig) -> bool:
        """Whether `cfg` would build the same river (so switching to it needs no rebuild)."""
        return weights_key(cfg, self.parts, self.device) == weights_key(self.cfg, self.parts, self.device)

    def may_exit(self, index: int) -> bool:
        """Whether the batch may leave the backbone after layer `index` (a river follows it)."""
        return self.cfg.entry_layer <= index < len(self.layers) - 1

    def passes(self, h_in: Tensor, h_out: Tensor, counts: Tensor, threshold: float | None = None) -> bool:
        """The exit rule (§4.2): every row's transition similarity reaches the threshold (the
        config's unless given: runs that share this river may differ in threshold)."""
        limit = self.cfg.threshold if threshold is None else threshold
        return bool((transition_similarity(h_in, h_out, counts) >= limit).all())


class River(Acceleration):
    """River as a plug-in: after each backbone layer test the exit; once the whole batch passes, the
    rest of the forward runs on the river. Decode forwards always; prefill forwards when
    `cfg.prefill`. Statistics per forward: `river_forwards`, `river_tokens`, `river_backbone_layers`
    (and their `river_decode_*` counterparts), `river_exits`, `river_exit_tokens`, and with `audit`
    `river_audit_rows`, `river_audit_matches`, `river_audit_kl_sum`. `river_dequantize_exits` counts
    exits onto a river without fused kernels (`RiverPath.execution == "dequantize"`: each weight is
    dequantized per call, so the exit saves memory but not time), which the result's notes report
    (`RiverConfig.notes`) instead of only a warning at build time.
    """

    name = "river"
    config = RiverConfig
    step_inputs = True  # its exits (and its audit) run on the fixed-shape step, as pieces (`RiverExits`)

    @classmethod
    def build(cls, cfg: RiverConfig, setup: Setup) -> River:
        """The quantized layers are built once per backend and weight settings (`weights_key`)."""
        host = setup.host
        path = setup.cached(
            "river",
            ("river", weights_key(cfg, host.parts, host.device)),
            lambda: river_path(host.parts, cfg, host.device),
        )
        return cls(cfg, path, host.stats)

    def __init__(self, cfg: RiverConfig, path: RiverPath, stats: KVStats) -> None:
        self.cfg = cfg
        self.path = path
        self.stats = stats
        self._active = False
        self._exited_at: int | None = None  # the backbone layer after which the batch left
        self._audit: Tensor | None = None  # the backbone's own logits for exited tokens
        self._dequantize = path.execution == "dequantize"  # fixed once the river is built

    def on_batch(self, batch: Batch) -> None:
        """The batch's decode steps exit on the fixed-shape step (the layer loop ignores this and
        exits through the forward hooks below)."""
        batch.ctx.exits = RiverExits(self.path, self.cfg.threshold, self)

    def begin_forward(self, fwd: Forward) -> None:
        self._active = fwd.decode_step or self.cfg.prefill
        self._exited_at, self._audit = None, None

    def after_layer(self, fwd: Forward, index: int, h_in: Tensor, h: Tensor) -> Exit | None:
        if not self._active or self._exited_at is not None or not self.path.may_exit(index):
            return None
        if self.path.passes(h_in, h, fwd.n_fed[fwd.rows], self.cfg.threshold):
            self._exited_at = index
            for j in range(index + 1, len(fwd.layers)):
                layer = self.path.layers[j]
                assert layer is not None  # built for every layer after the entry layer
                fwd.layers[j] = layer
            if self.path.head is not None:
                fwd.head = self.path.head  # exited tokens' logits come from the quantized head too
            if self.cfg.audit and not fwd.observed:
                self._audit = self._audit_backbone(fwd, h, index)
        return None

    def after_forward(self, fwd: Forward, logits: Tensor | None) -> None:
        if self._active:
            self._account(self._exited_at, sum(fwd.counts), fwd.decode_step, logits, self._audit)

    def _audit_backbone(self, fwd: Forward, h: Tensor, index: int) -> Tensor:
        """River audit: finish the forward on the backbone too, for the logits it would have given.

        The backbone layers write their K/V first and the river layers then overwrite the same slots,
        so the cache ends up exactly as in an unaudited run; only the time (and RSBCM's attention mass,
        counted twice) differ, which is why audit runs are for fidelity numbers, not timings.
        """
        parts = fwd.parts
        for j in range(index + 1, parts.n_layers):
            h = fwd.run_layer(parts.layers[j], h)
        return parts.logits(parts.norm(fwd.last_states(h)))

    def account(
        self, exited_at: int | None, n_tokens: int, decode: bool, logits: Tensor | None, audit: Tensor | None
    ) -> None:
        """`_account`, for the fixed-shape step's exits (`RiverExits.exited`)."""
        self._account(exited_at, n_tokens, decode, logits, audit)

    def _account(
        self, exited_at: int | None, n_tokens: int, decode: bool, logits: Tensor | None, audit: Tensor | None
    ) -> None:
        """Per-forward statistics: backbone depth per token (all, and decode steps alone, which the
        paper's mean exit layer counts), exits, and audited fidelity."""
        bump = self.stats.bump
        depth = self.path.parts.n_layers if exited_at is None else exited_at + 1
        bump("river_forwards")
        bump("river_tokens", n_tokens)
        bump("river_backbone_layers", depth * n_tokens)
        if decode:
            bump("river_decode_tokens", n_tokens)
            bump("river_decode_backbone_layers", depth * n_tokens)
        if exited_at is not None:
            bump("river_exits")
            bump("river_exit_tokens", n_tokens)
            if self._dequantize:
                bump("river_dequantize_exits")
        if audit is not None and logits is not None:
            match, kl = exit_fidelity(audit, logits)
            bump("river_audit_rows", match.numel())
            bump("river_audit_matches", int(match.sum()))
            bump("river_audit_kl_sum", float(kl.sum()))


WEIGHT_FIELDS = ("entry_layer", "bits", "group_size", "kernel", "head", "head_top_k")
"""The `RiverConfig` fields a river's modules depend on (`weights_key` reads them resolved): what
another process needs to build the same river (`RiverExits.describe`)."""

_PATHS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], RiverPath]] = (
    weakref.WeakKeyDictionary()
)
"""Rivers built in this process, per backbone (its layer list, held weakly) and weights key."""


def river_path(parts: DecoderParts, cfg: RiverConfig, device: torch.device) -> RiverPath:
    """The river of `parts` for `cfg`'s weight fields: built once per process, so the plug-in and
    a compiled piece warmed on a skeleton batch (`exits_of`) use the same modules."""
    built = _PATHS.setdefault(parts.layers, {})
    key = weights_key(cfg, parts, device)
    if key not in built:
        built[key] = RiverPath(parts, cfg, device)
    return built[key]


class RiverExits:
    """River's exit as the fixed-shape step runs it (`step_inputs.Exits`, `step_replay.ExitSegments`):
    the same candidate layers, score and river as the forward hooks, with the run's threshold; the
    exits are counted by `plugin` (None: a batch built to compile or warm a piece)."""

    def __init__(self, path: RiverPath, threshold: float, plugin: River | None = None) -> None:
        self.path = path
        self.plugin = plugin
        self.threshold = threshold
        self.audit = plugin is not None and plugin.cfg.audit
        self.entry = path.cfg.entry_layer
        self.river = path.layers
        self.head = path.head

    def similarity(self, h_in: Tensor, h_out: Tensor, fed: Tensor) -> Tensor:
        return transition_similarity(h_in, h_out, fed)

    def exited(
        self, at: int | None, tokens: int, logits: Tensor | None = None, audit: Tensor | None = None
    ) -> None:
        if self.plugin is not None:
            self.plugin.account(at, tokens, True, logits, audit)

    def describe(self) -> dict[str, Any]:
        fields = self.path.cfg.model_dump(include=set(WEIGHT_FIELDS), mode="json")
        return {"build": f"{__name__}:exits_of", "config": fields}


def exits_of(config: dict[str, Any], parts: DecoderParts, device: torch.device) -> RiverExits:
    """The exit a `RiverExits.describe` names, on `parts` (the compile worker's model, or this
    process's when a loaded piece is warmed): its river shared with any plug-in of the same weights."""
    cfg = RiverConfig.model_validate(config)
    return RiverExits(river_path(parts, cfg, device), cfg.threshold)
