"""One config object for the inference accelerations, each switchable on its own.

Why here (not in `hf/`): the config is plain pydantic, so strategies files, eval suites, the CLI and
the remote backend can build, validate and inspect it without torch. The local backend turns it into
plug-ins for each run (`hf/plugins.py`), so an acceleration applies under every strategy without the
strategy knowing. A field of `Accel` left `None` means "off".

The fields of `Accel` are the registry of accelerations; everything that differs between them and
is needed without torch is declared on each config class, beside the settings it depends on:
`internals` / `needs_model()` (what the remote backend must refuse), `excludes` (what it cannot run
with) and `notes(stats)` (what a result says when it never acted). `EXCLUSIVE`, `Accel.notes` and
`Accel.needs_model` only collect those declarations. The command line generates its options from
the fields (descriptions and ranges: help and checks; `cli_names`: shorter names) and the composition
tests run every allowed combination from each config's `examples`: a new acceleration needs neither.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from branchwise.backends.step_notes import step_notes


@dataclass(frozen=True)
class Examples:
    """Settings an acceleration declares so the composition tests build every allowed combination
    from them alone (no per-acceleration table a new one must join); they double as worked examples."""

    acting: Mapping[str, Any]
    """Settings under which it acts even on a tiny random model (lossy where it must be)."""
    acted: tuple[str, ...]
    """Run statistics (`kv_stats` keys) any of which above 0 shows that it acted."""
    lossless: Mapping[str, Any] | None = None
    """Settings under which it is exact by design (greedy tokens equal share="none"'s), if any."""
    changed: tuple[str, ...] = field(default=())
    """Run statistics that count what it approximated: all 0 under `lossless`."""


class AccelConfig(BaseModel):
    """The base of every acceleration's config: frozen, strict, and what the backends need to know
    about the acceleration without running it (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    internals: ClassVar[str | None] = None
    """What this acceleration reads or changes inside the model, as a refusal names it (e.g.
    "ASKS (hidden states)"); None when it needs nothing a remote server does not expose."""
    excludes: ClassVar[Mapping[str, str]] = {}
    """Other accelerations (fields of `Accel`) this one cannot run with, each with why. A pair is
    declared once, on either side; `Accel` rejects it at construction, naming both."""
    examples: ClassVar[Examples | None] = None
    """Settings the composition tests run it with; every registered acceleration declares them."""
    cli_names: ClassVar[Mapping[str, str]] = {}
    """Shorter command-line names of fields than the generated `--<accel>-<field>` (kept flags)."""

    def needs_model(self) -> list[str]:
        """What of these settings needs the model's internals (so a remote backend refuses them),
        each as `internals` names it; empty when they can run against a server."""
        return [] if self.internals is None else [self.internals]

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        """What a run's result should say about this acceleration, given the run's statistics
        (`kv_stats`, extras included): chiefly that it was on but never acted, so a result never
        implies a speed-up it did not get. The wording lives here, beside the settings it names,
        and each plug-in's counters feed it; `Accel.notes` collects them."""
        return []


class ASKSConfig(AccelConfig):
    """RKSC §2.2: share the root KV with branches whose hidden states stay close to the root's (Eq. 2)."""

    internals: ClassVar[str | None] = "ASKS (hidden states)"
    examples: ClassVar[Examples | None] = Examples(  # probe_recompute: no shared prompt was left to gate
        acting={"tau": 0.0},
        acted=("asks_reused", "asks_rejected", "probe_recompute"),
        lossless={"tau": 1.0},
        changed=("asks_reused",),
    )

    tau: float = Field(0.82, ge=0.0, le=1.0, description="similarity threshold τ")
    alpha: float = Field(1.5, ge=0.0, le=10.0, description="layer-weight exponent α_w")

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        rejected, reused = stats.get("asks_rejected", 0), stats.get("asks_reused", 0)
        if reused:
            return []
        if not rejected:
            return ["asks: no fork met a differently phrased prompt; the gate never ran"]
        mean = stats.get("asks_sigma_sum", 0.0) / rejected
        return [
            f"asks: the gate rejected all {rejected:g} differently phrased prompt(s) (mean similarity "
            f"{mean:.3f} < tau {self.tau}); each computed its own KV"
        ]


class ProbeConfig(AccelConfig):
    """RKSC §2.2 KV probe: time recompute vs share once per 64-token prefix bucket and cache the verdict."""

    internals: ClassVar[str | None] = "the KV probe (timing KV reuse)"
    examples: ClassVar[Examples | None] = Examples(
        acting={"repeats": 1}, acted=("probe_share", "probe_recompute"), lossless={"repeats": 1}
    )

    bucket_tokens: int = Field(64, ge=1, le=65536, description="prefix tokens per timed bucket")
    repeats: int = Field(3, ge=1, le=20, description="timings per path; the minimum is used")
    suffix_tokens: int = Field(
        16,
        ge=1,
        le=4096,
        description="the suffix s each timed branch computes after the prefix (the paper's s = 16): "
        "sharing pays per suffix token read over the prefix, so a 1-token suffix understates its cost",
    )
    override: Literal["auto", "share", "recompute"] = Field(
        "auto", description="'share'/'recompute' skip the timing (tests, users who know their regime)"
    )

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        if not stats.get("probe_recompute"):
            return []
        return [
            f"probe: {int(stats['probe_recompute'])} fork(s) recomputed the prefix instead of sharing it "
            "(timed faster on this machine)"
        ]


class CGEEConfig(AccelConfig):
    """RKSC §2.3: confidence-gated early exit of the verify pass.

    Level 1 skips the verify pass when generation confidence is decisive (Eq. 4); level 2 stops the
    verify forward at the first layer whose logit entropy is low and stable (Eq. 5). `theta`,
    `tau_conf`, `r_gap` and `l_min` left `None` take the model's saved calibration (`branchwise
    calibrate`) or, without one, the paper's values (the `PAPER_*` constants: 8.0 nats, 0.70, 0.06
    and 2). Level 1 alone runs against a remote server; level 2 and the decode gate need the layers.
    """

    # The paper's values (RKSC Table 4, §2.3, App. I.1), stated once: the defaults below, the
    # fallbacks of unset thresholds (`hf/cgee.Thresholds`, the remote backend's level 1) and the
    # starting points of calibration all read them here.
    PAPER_THETA: ClassVar[float] = 8.0
    PAPER_EPSILON: ClassVar[float] = 3.0
    PAPER_TAU_CONF: ClassVar[float] = 0.70
    PAPER_R_GAP: ClassVar[float] = 0.06
    PAPER_L_MIN: ClassVar[int] = 2
    PAPER_THETA_DEC: ClassVar[float] = 0.72
    PAPER_R_DEC: ClassVar[float] = 0.10
    examples: ClassVar[Examples | None] = Examples(
        # level 1 rarely skips (so level 2 exits run); the decode gate fires after the 9th token
        acting={
            "level2": True,
            "cost_aware": False,
            "tau_conf": 0.99,
            "theta": 99.0,
            "epsilon": 99.0,
            "l_min": 1,
            "decode_gate": True,
            "theta_dec": 0.0,
            "r_dec": 0.0,
            "decode_gate_min_tokens": 9,
        },
        acted=("verify_rows", "decode_gate_stops"),
        lossless={"level1": False, "level2": True, "theta": 1e-9},  # `lossless()`, never low enough to exit
        changed=("verify_exits", "cgee_verify_skips", "decode_gate_stops"),
    )

    level1: bool = Field(True, description="skip the verify pass when generation confidence is decisive")
    level2: bool = Field(
        False,
        description="off by default: on the embedded model the verify pass does not get faster "
        "without flipping decisions (docs/ACCELERATIONS.md, CGEE level 2); `lossless()` turns it on",
    )
    tau_conf: float | None = Field(
        None, ge=0.0, le=1.0, description="None = calibrated, else the paper's (PAPER_TAU_CONF)"
    )
    r_gap: float | None = Field(
        None, ge=0.0, le=1.0, description="None = calibrated, else the paper's (PAPER_R_GAP)"
    )
    theta: float | None = Field(
        None, gt=0.0, le=100.0, description="entropy threshold θ (nats); None = calibrated, else PAPER_THETA"
    )
    epsilon: float = Field(
        PAPER_EPSILON, gt=0.0, le=100.0, description="entropy stabilisation tolerance ε (nats)"
    )
    check_every: int | None = Field(
        None,
        ge=1,
        le=1000,
        description="level 2 inspects every k-th layer from l_min (None = every layer the cost model allows)",
    )
    cost_aware: bool = Field(
        True,
        description="level 2 inspects only layers where an exit saves more than the check costs "
        "(False = every layer from l_min, the paper's Alg. 3)",
    )
    verdict_gate: bool = Field(
        True,
        description="level 2 runs the full-vocabulary check only where the verdict tokens' distribution is stable",
    )
    min_candidate_mass: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="beyond the paper: exit only where the verdict tokens hold this much probability (0 = off)",
    )
    l_min: int | None = Field(
        None, ge=1, le=1000, description="minimum exit layer (1-based); None = calibrated, else PAPER_L_MIN"
    )
    decode_gate: bool = Field(
        False, description="App. I.1: stop decoding once one branch is decisively confident"
    )
    theta_dec: float = Field(
        PAPER_THETA_DEC, ge=0.0, le=1.0, description="decode gate: the leading branch's confidence θ_dec"
    )
    r_dec: float = Field(
        PAPER_R_DEC, ge=0.0, le=1.0, description="decode gate: its margin over the next r_dec"
    )
    decode_gate_min_tokens: int = Field(
        4, ge=1, le=100000, description="decode gate: tokens every branch decodes before it may stop"
    )

    def needs_model(self) -> list[str]:
        out = []
        if self.level2:
            out.append("CGEE level 2 (per-layer entropy exit)")
        if self.decode_gate:
            out.append("the CGEE decode gate (stopping inside the decode loop)")
        return out

    def level1_thresholds(self) -> tuple[float, float]:
        """(τ_conf, r_gap) of level 1 without a calibration: the ones set here, else the paper's
        (what a backend that cannot read the model's calibration uses)."""
        tau = self.tau_conf if self.tau_conf is not None else self.PAPER_TAU_CONF
        gap = self.r_gap if self.r_gap is not None else self.PAPER_R_GAP
        return tau, gap

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        out = []
        checks, rows = stats.get("cgee_skip_checks", 0), stats.get("verify_rows", 0)
        if self.level1 and checks and not stats.get("cgee_verify_skips"):
            out.append(
                f"cgee: level 1 skipped none of {checks:g} verify pass(es) (the branches' confidence was "
                "never decisive); every one ran"
            )
        if self.level2 and rows and not stats.get("verify_exits"):
            out.append(f"cgee: level 2 let none of {rows:g} verify row(s) exit early; each ran every layer")
        if self.decode_gate and not stats.get("decode_gate_stops"):
            out.append(
                "cgee: the decode gate never found one branch decisively confident; no decode stopped early"
            )
        if (self.level1 or self.level2) and not checks and not rows:
            out.append("cgee: the run had no verify pass to skip or shorten")
        return out

    @classmethod
    def lossless(cls, **kwargs: object) -> CGEEConfig:
        """Level 2 alone: the verify pass always runs; only its depth adapts."""
        return cls(level1=False, level2=True, **kwargs)


class RSBCMConfig(AccelConfig):
    """RKSC §2.4: hold KV in blocks; above capacity evict the lowest ω = mass·score/(depth+1) blocks."""

    internals: ClassVar[str | None] = "RSBCM (KV block eviction)"
    examples: ClassVar[Examples | None] = Examples(
        acting={"capacity_blocks": 3, "block_tokens": 4},
        acted=("rsbcm_evictions",),
        lossless={"capacity_blocks": 10_000},
        changed=("rsbcm_evictions",),
    )
    cli_names: ClassVar[Mapping[str, str]] = {"capacity_blocks": "--rsbcm-capacity"}

    capacity_blocks: int = Field(2000, ge=1, le=10_000_000, description="KV blocks held before eviction")
    block_tokens: int = Field(16, ge=1, le=65536, description="KV tokens per block")
    pin_prompt: bool = Field(True, description="never evict depth-0 segments (the prompt all branches share)")
    track_from: float = Field(0.5, ge=0.0, le=1.0, description="share of capacity that starts mass tracking")

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        if stats.get("rsbcm_evictions"):
            return []
        dormant = "" if stats.get("rsbcm_tracked_batches") else " (attention mass was never tracked)"
        return [
            f"rsbcm: the run never held more than {self.capacity_blocks} evictable blocks of "
            f"{self.block_tokens} tokens after a decode; nothing was evicted{dormant}"
        ]


class RiverConfig(AccelConfig):
    """River-LLM §4: token-level early exit onto a KV-shared river of weight-quantized layer copies.

    After each backbone layer from `entry_layer` on, the state-transition similarity cos(block input,
    block output) is taken at every row's newest token (decode) or averaged over each row's fed tokens
    (prefill, sequence level). When it reaches `threshold` for every row of the batch, the remaining
    layers run on their quantized copies, which write K/V into the backbone's own cache slots.

    The LM head (`head`) is the largest single matrix, and its error goes straight into the logits.
    Measured on the embedded model with `benchmarks/river.py`'s audit (greedy decodes, every exited
    token against the backbone's own logits): with the per-row 8-bit head, next-token match 0.984,
    KL 1.7e-3; 'refined' (k = 16) 0.9915, KL 6.8e-4; 'backbone' 0.9915, KL 6.1e-4, the same tokens
    as 'refined'. On the backbone's exact hidden states the 8-bit head alone flips 1.6 % of next
    tokens, half from its weights and half from its kernel's bf16 output (logits near 30 are rounded
    to steps of 0.125, so close top-2 pairs tie or swap); refining from k = 2 on flips none. A 4-bit
    head alone flips 7-9 %. 'refined' recomputes only k rows of the head, so it keeps the quantized
    head's saving; 'backbone' is exact given the hidden state but reads the full-precision head
    (4x the bytes of the 8-bit copy) on every exited token, which costs much of the exit's gain on a
    model whose head is a large share of its weights. What the river loses after that comes from its
    layers (`bits`, `group_size`), not from how early tokens exit: thresholds 0.95 and 0.97 and exits
    after the entry layer alone measure the same match there. Read group-size results on the embedded
    model with care: its checkpoint was dequantized from low-bit groups of 32 (each layer weight
    holds at most 16 values per 32, the embedding is exactly an int8 grid per 32), so grids aligned
    with those groups (4 bits at `group_size=32`, an 8-bit head in groups of 32) measure near-lossless
    there, which says nothing about other models; the defaults are not tuned to it.
    """

    internals: ClassVar[str | None] = "River (layer-level early exit)"
    examples: ClassVar[Examples | None] = Examples(
        acting={"threshold": -1.0, "entry_layer": 0, "prefill": True},
        acted=("river_exits",),
        lossless={"threshold": 1.0, "entry_layer": 0},
        changed=("river_exits",),
    )

    threshold: float = Field(
        0.95,
        ge=-1.0,
        le=1.0,
        description="exit when cos(input, output) >= this for the whole batch (the paper uses 0.5-0.9 on "
        "Llama 3; SmolLM2's middle layers sit at 0.92-0.97, so 0.95 lets most B=1 tokens exit after ~3 layers)",
    )
    entry_layer: int = Field(
        2,
        ge=0,
        le=1000,
        description="first backbone layer (0-based) whose similarity is tested (the first layers rotate the "
        "state almost completely, so testing them gains nothing)",
    )
    bits: Literal[4, 8] = Field(8, description="weight bits of the river layers")
    head: Literal["refined", "quantized", "backbone"] = Field(
        "refined",
        description="the LM head of exited tokens: 'quantized' = a `bits`-bit weight-only copy of the "
        "backbone's head; 'refined' = that copy picks `head_top_k` candidates per row and their logits are "
        "recomputed from the backbone's head; 'backbone' = the backbone's head itself (see the class "
        "docstring for the trade-off)",
    )
    head_top_k: int = Field(
        16,
        ge=1,
        le=4096,
        description="with head='refined': the candidates per row whose logits are recomputed in full precision",
    )
    group_size: int = Field(
        64, ge=8, le=8192, description="weights per quantization group of the 4-bit kernel (8-bit is per row)"
    )
    kernel: Literal["auto", "dynamic_int8", "weight_only"] = Field(
        "auto",
        description="'weight_only' = int weights with per-row (8-bit) or per-group (4-bit) scales, fused "
        "kernels where torch has them; 'dynamic_int8' = torch's dynamic int8 Linear (CPU fp32 only, fastest at "
        "large batch, but it quantizes activations too and is lossy); 'auto' = weight_only",
    )
    prefill: bool = Field(
        False,
        description="let prefill forwards exit too (sequence level); off by default because the fused "
        "low-bit CPU kernels are built for a few rows and run long prefills slower than the fp32 layers",
    )
    audit: bool = Field(
        False,
        description="also run the backbone's rest for exited tokens (one more piece of the step) to report "
        "next-token match and KL (slow)",
    )

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        out = []
        if stats.get("river_forwards") and not stats.get("river_exits"):
            out.append(
                f"river: no forward passed threshold {self.threshold} after layer {self.entry_layer}; "
                "every token ran the whole backbone"
            )
        if stats.get("river_dequantize_exits"):
            out.append(
                f"river: {stats['river_dequantize_exits']:g} exited forward(s) ran the river's weight-only "
                "layers by dequantizing each weight per call, with no fused kernel (on CUDA: install "
                "torchao, pip install 'branchwise[gpu]'; on CPU: layer shapes or a dtype torch's "
                "int4/int8 kernels do not take); memory was saved, time was not"
            )
        return out


class SteeringConfig(AccelConfig):
    """SkipKV §4.2: add α_t·v at layer k's residual input at delimiter tokens, α_t = α0 + γ·N_nonexec."""

    alpha0: float = Field(1.0, ge=0.0, le=100.0, description="initial strength α0")
    gamma: float = Field(0.02, ge=0.0, le=10.0, description="strength added per non-execution thought γ")
    layer: int | None = Field(None, ge=0, le=1000, description="None = the layer saved with the vector")
    vector_path: str | None = Field(
        None, description="a vector saved by `branchwise steering build`; None = the model's saved one"
    )


class SkipKVConfig(AccelConfig):
    """SkipKV §4: keep each branch's own generated KV under `budget` tokens by sentence-aware eviction.

    Every `interval` decode steps a branch above budget drops the tokens with the lowest Eq. 6 score
    (σ·attention importance − (1−σ)·key redundancy − sentence redundancy λ). Prompt and ancestor KV
    (shared with other branches) is never evicted. `sigma=1, redundancy=False, sentence_scoring=False`
    is the attention-only (H2O/SnapKV-style) baseline; `sentence_scoring=False` alone is R-KV;
    `window == budget` keeps the newest tokens only (StreamingLLM: the prompt, never evicted, plays
    its attention sinks).
    """

    internals: ClassVar[str | None] = "SkipKV (KV eviction and steering)"
    excludes: ClassVar[Mapping[str, str]] = {
        "rsbcm": "both evict a branch's KV and would each keep its own, diverging, slot map",
    }
    examples: ClassVar[Examples | None] = Examples(
        # steering with the model's saved vector (the tests save one)
        acting={"budget": 6, "interval": 4, "window": 2, "query_window": 4, "steering": {}},
        acted=("skipkv_compressions",),
        lossless={"budget": 64, "interval": 4},
        changed=("skipkv_evicted_tokens",),
    )
    cli_names: ClassVar[Mapping[str, str]] = {"steering": "--steer"}

    budget: int = Field(..., ge=2, le=10_000_000, description="KV tokens a branch's generated part may keep")
    interval: int = Field(128, ge=1, le=100_000, description="decode steps between compressions Δt")
    window: int = Field(8, ge=0, le=100_000, description="newest tokens always kept")
    query_window: int = Field(8, ge=1, le=1024, description="recent queries α scoring token importance")
    pool_kernel: int = Field(7, ge=1, le=255, description="max-pool kernel over token importance (odd)")
    sigma: float = Field(0.1, ge=0.0, le=1.0, description="importance vs redundancy trade-off σ")
    tau: float = Field(0.95, ge=0.0, le=1.0, description="sentence similarity threshold τ (paper 0.95-0.99)")
    redundancy: bool = Field(True, description="R-KV key-redundancy term")
    sentence_scoring: bool = Field(True, description="Eq. 3 sentence redundancy term")
    keywords: tuple[str, ...] = Field(("Wait", "Alternatively", "again"), description="non-execution markers")
    per_head: bool = Field(
        True,
        description="each (layer, KV head) keeps its own best slots, as the paper's Eq. 4-6 selection "
        "(the same count per head); False: one slot set for all layers and heads (scores averaged)",
    )
    steering: SteeringConfig | None = Field(
        None, description="adaptive steering (needs `branchwise steering build` first)"
    )

    @model_validator(mode="after")
    def _check(self) -> SkipKVConfig:
        if self.window > self.budget:
            raise ValueError(f"window={self.window} must not exceed budget={self.budget}")
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel={self.pool_kernel} must be odd (1-255)")
        return self

    @classmethod
    def attention_only(cls, budget: int, **kwargs: object) -> SkipKVConfig:
        """H2O/SnapKV-style baseline: evict by windowed attention importance alone."""
        return cls(budget=budget, sigma=1.0, redundancy=False, sentence_scoring=False, **kwargs)

    @classmethod
    def streaming(cls, budget: int, **kwargs: object) -> SkipKVConfig:
        """StreamingLLM-style baseline: keep the newest `budget` generated tokens, score nothing."""
        return cls(
            budget=budget, window=budget, sigma=1.0, redundancy=False, sentence_scoring=False, **kwargs
        )

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        if stats.get("skipkv_compressions"):
            return []
        return [
            f"skipkv: no branch held more than {self.budget} generated tokens at a compression step "
            f"(every {self.interval}); nothing was evicted"
        ]

    @property
    def recency_only(self) -> bool:
        """Whether the window fills the budget, so no token is ever chosen by its score."""
        return self.window >= self.budget

    @classmethod
    def rkv(cls, budget: int, **kwargs: object) -> SkipKVConfig:
        """R-KV baseline: importance and key redundancy, no sentences, no steering."""
        return cls(budget=budget, sentence_scoring=False, **kwargs)


class ReasonCacheConfig(AccelConfig):
    """ReasonCache (§IV): share near-identical sealed KV blocks across steps and branches.

    Each branch's generated KV is cut into blocks of `block_tokens`; when a reasoning step ends, its
    sealed blocks may point at a block of an earlier, similar step (this branch or a live sibling)
    instead of holding their own copy. Stage 1 keeps earlier steps whose bag-of-token-id cosine ×
    length penalty passes τ = τ_strict − (τ_strict − τ_soft)·mean(similarities) and, for formal
    steps, whose syntax trees are equal; stage 2 keeps blocks whose KV distance is at or below the
    `percentile`-th percentile of the distances seen, after `warmup_blocks` with no reuse.
    `mode="lexical"` skips stage 2 (the paper's "only Cos" ablation); `mode="random"` shares each
    block with probability `random_rate` with a random earlier block (the paper's baseline).
    """

    internals: ClassVar[str | None] = "ReasonCache (KV block sharing)"
    excludes: ClassVar[Mapping[str, str]] = {
        "skipkv": "both move a branch's own KV slots mid-decode (sharing vs eviction) and would each keep "
        "its own slot map",
        "rsbcm": "would both rewrite a branch's KV (RSBCM evicts blocks that ReasonCache may have shared)",
    }
    examples: ClassVar[Examples | None] = Examples(
        acting={"block_tokens": 2, "mode": "random", "random_rate": 1.0},
        acted=("reasoncache_blocks_reused",),
        lossless={"tau_strict": 1.0, "tau_soft": 1.0},  # no step is ever similar enough
        changed=("reasoncache_blocks_reused",),
    )

    block_tokens: int = Field(16, ge=1, le=4096, description="KV slots per block (vLLM's default 16)")
    tau_strict: float = Field(0.9, ge=0.0, le=1.0, description="τ_strict, the threshold with no history")
    tau_soft: float = Field(0.7, ge=0.0, le=1.0, description="τ_soft, the threshold in a repetitive state")
    structural: bool = Field(True, description="require equal syntax trees for formal (math, code) steps")
    percentile: float = Field(80.0, ge=0.0, le=100.0, description="PAT percentile p")
    warmup_blocks: int = Field(
        16, ge=0, le=1_000_000, description="stage-2 distances collected before any reuse"
    )
    mode: Literal["filter", "lexical", "random"] = Field(
        "filter", description="'filter' = both stages; 'lexical' = stage 1 only; 'random' = random sharing"
    )
    random_rate: float = Field(0.2, ge=0.0, le=1.0, description="share probability of mode='random'")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="random generator seed of mode='random'")

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        if stats.get("reasoncache_blocks_reused"):
            return []
        return [
            f"reasoncache: no block was shared ({stats.get('reasoncache_blocks_sealed', 0):g} sealed, "
            f"{stats.get('reasoncache_stage1_blocks', 0):g} with a similar earlier step, "
            f"{stats.get('reasoncache_stage2_blocks', 0):g} within the distance threshold after "
            f"{self.warmup_blocks} warm-up blocks); every branch held its own KV"
        ]

    @model_validator(mode="after")
    def _check(self) -> ReasonCacheConfig:
        if self.tau_soft > self.tau_strict:
            raise ValueError(f"tau_soft={self.tau_soft} must not exceed tau_strict={self.tau_strict}")
        return self


class Accel(AccelConfig):
    """Which accelerations are on. `Accel()` = all off (plain exact/none sharing).

    Any combination composes except the pairs in `EXCLUSIVE`, which are rejected here, at
    construction, naming both.
    """

    asks: ASKSConfig | None = None
    probe: ProbeConfig | None = None
    cgee: CGEEConfig | None = None
    rsbcm: RSBCMConfig | None = None
    river: RiverConfig | None = None
    skipkv: SkipKVConfig | None = None
    reasoncache: ReasonCacheConfig | None = None

    @classmethod
    def configs(cls) -> dict[str, type[AccelConfig]]:
        """Each acceleration's field and config type, in field order: the one registry of
        accelerations (the local backend registers a plug-in class against each config type)."""
        out: dict[str, type[AccelConfig]] = {}
        for name, info in cls.model_fields.items():
            (config,) = [t for t in typing.get_args(info.annotation) if t is not type(None)]
            out[name] = config
        return out

    def enabled(self) -> dict[str, AccelConfig]:
        """The configs of the accelerations that are on, by field, in field order."""
        return {name: cfg for name in type(self).model_fields if (cfg := getattr(self, name)) is not None}

    @model_validator(mode="after")
    def _compatible(self) -> Accel:
        on = self.enabled()
        for a, b, why in EXCLUSIVE:
            if a in on and b in on:
                raise ValueError(
                    f"accel.{a} and accel.{b} cannot be combined: they {why}; enable one of them"
                )
        return self

    def notes(self, stats: Mapping[str, float]) -> list[str]:
        """Every enabled acceleration's notes on a run with these statistics (see `AccelConfig.notes`)."""
        notes = [note for cfg in self.enabled().values() for note in cfg.notes(stats)]
        return notes + step_notes(stats)

    def needs_model(self) -> list[str]:
        """What of the enabled accelerations needs the model's internals (`AccelConfig.needs_model`):
        what a backend that only sees text and token probabilities must refuse."""
        return [part for cfg in self.enabled().values() for part in cfg.needs_model()]

    @classmethod
    def rksc(cls) -> Accel:
        """The full RKSC configuration with the paper's defaults."""
        return cls(asks=ASKSConfig(), probe=ProbeConfig(), cgee=CGEEConfig(), rsbcm=RSBCMConfig())


EXCLUSIVE: tuple[tuple[str, str, str], ...] = tuple(
    (name, other, why) for name, config in Accel.configs().items() for other, why in config.excludes.items()
)
"""Pairs of accelerations that cannot run together, and why (collected from each config's
`excludes`); every other combination composes."""
