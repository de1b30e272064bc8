"""CGEE (RKSC §2.3, Alg. 3, App. C, I.1): confidence-gated early exit of the verify pass.

- Level 1 (`scores.verify_skip`, shared with the remote backend): skip the verify pass when the best branch's generation confidence (mean
  top-1 probability, Eq. 3, recorded during decode at no cost) is high and clearly ahead (Eq. 4).
- Decode gate (`decode_gate`, App. I.1): stop the batched decode early once one branch is decisively
  confident (θ_dec, r_dec).
- Level 2 (`EntropyExit`): during the verify forward, project each layer's last-token state through
  the *final norm and* the LM head (the public notebook skipped the norm), take the entropy, and let
  a row exit at the first layer l ≥ l_min with H < θ and |ΔH| < ε, using that layer's distribution.
  We own the layer loop, so an exit drops the row from the batch — no exceptions out of hooks.
- Calibration (`calibrate_from`): τ_conf = 75th percentile of max confidence, r_gap = 25th percentile
  of the relative gap, θ = median entropy at the first stabilisation layer; saved per model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from branchwise.backends.accel import CGEEConfig
from branchwise.backends.base import FinishReason, KVStats
from branchwise.backends.hf.arch import DecoderParts, linear_params
from branchwise.backends.hf.batch import Row
from branchwise.backends.hf.hooks import Acceleration, Exit, Forward, Setup
from branchwise.backends.hf.model_files import model_file
from branchwise.backends.scores import gap_ratio, judge_score, verify_skip


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of softmax(logits) along the last dim."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@dataclass
class EntropyTrace:
    """Per verify row: the entropy at each inspected layer (1-based) and where it exited (None = full).

    `probs[l]` holds the candidate tokens' probabilities under layer l's distribution (the final layer
    included), so calibration can replay exits offline and count the decisions they would flip.
    """

    entropies: dict[int, float] = field(default_factory=dict)
    probs: dict[int, list[float]] = field(default_factory=dict)
    exit_layer: int | None = None

    def exit_at(
        self, theta: float, epsilon: float, l_min: int, min_candidate_mass: float = 0.0
    ) -> int | None:
        """The layer Alg. 3 would exit at under these thresholds (None = full depth)."""
        for layer in sorted(self.entropies):
            prev = self.entropies.get(layer - 1, math.inf)
            h = self.entropies[layer]
            mass_ok = min_candidate_mass <= 0 or sum(self.probs.get(layer, [])) >= min_candidate_mass
            if layer >= l_min and h < theta and abs(h - prev) < epsilon and mass_ok:
                return layer
        return None

    def first_stable(self, epsilon: float, l_min: int) -> tuple[int, float] | None:
        """First layer l ≥ l_min with |H_l − H_{l−1}| < ε, and its entropy."""
        for layer in sorted(self.entropies):
            prev = self.entropies.get(layer - 1)
            if layer >= l_min and prev is not None and abs(self.entropies[layer] - prev) < epsilon:
                return layer, self.entropies[layer]
        return None


def head_cost_layers(parts: DecoderParts) -> float:
    """The LM head's cost in decoder layers (weight FLOPs per token: vocab·hidden over one layer's
    linear weights), known from the model's shapes. SmolLM2-135M: 49,152·576 / 3.54 M ≈ 8 layers."""
    layer = parts.layers[0]
    per_layer = sum(linear_params(m) for m in layer.modules())
    return linear_params(parts.head) / max(per_layer, 1)


class EntropyExit(Acceleration):
    """Level-2 observer of one verify forward (Alg. 3). With `exit=False` it only records entropies
    (calibration). After the forward it counts `verify_rows`, `verify_layers`, `verify_exits`,
    `verify_checks` (rows × layers whose full-vocabulary lens was computed) and, given a `trace` list,
    fills each row's final-layer candidate probabilities and appends its trace.

    With `cost_aware` the exit check is cost-aware (off: every layer from `l_min`, the paper's Alg. 3;
    the calibration trace always inspects every layer). One full check (final norm + LM head over the whole vocabulary)
    costs `head_cost_layers` decoder layers, so with `exit=True`:
    - a layer is inspected only if an exit there can save more layers than the check costs
      (L − l > head cost), from `l_min` on, every `check_every`-th layer;
    - with `verdict_gate` and candidate tokens, each inspected layer first computes only the
      candidates' logits (a handful of LM-head rows over the same normed state: ~free) and the
      distribution over the candidate set; the full-vocabulary check (Eq. 5's entropy over the whole
      distribution, and the candidate-mass test) runs only for rows whose candidate distribution
      moved by less than `gate_delta` since the previously inspected layer. With the gate, Eq. 5's
      two conditions are split by cost: the *level* test H < θ stays on the full distribution (one
      LM head, at the exit layer only), the *stability* test |ΔH| < ε is replaced by the verdict
      distribution's stability (a stricter test for what the verify pass decides, and free: Eq. 5's
      ΔH would need a second full head at the layer before). Without the gate, Eq. 5 as written,
      with |ΔH| between consecutive *inspected* layers (none yet = +inf: the first never exits).
    """

    name = "cgee-exit"

    def __init__(
        self,
        parts: DecoderParts,
        n_rows: int,
        theta: float,
        epsilon: float,
        l_min: int,
        exit: bool = True,
        candidates: Sequence[int] = (),
        min_candidate_mass: float = 0.0,
        stats: KVStats | None = None,
        trace: list[EntropyTrace] | None = None,
        check_every: int | None = None,
        verdict_gate: bool = False,
        cost_aware: bool = False,
        gate_delta: float = 0.02,
    ) -> None:
        self.parts = parts
        self.candidates = list(candidates)
        self.min_candidate_mass = min_candidate_mass
        self.theta, self.epsilon, self.l_min, self.exit = theta, epsilon, l_min, exit
        self.check_every = check_every or 1
        self.verdict_gate = verdict_gate and bool(self.candidates)
        self.gate_delta = gate_delta
        self.head_cost = head_cost_layers(parts) if cost_aware else 0.0
        self.traces = [EntropyTrace() for _ in range(n_rows)]
        self._prev = torch.full((n_rows,), math.inf)
        self._prev_cand: torch.Tensor | None = None  # [n_rows, C] candidate-set distribution
        self._checks = 0
        self._stats = stats
        self._trace = trace
        self._cand_w: torch.Tensor | None = None

    def inspects(self, depth: int) -> bool:
        """Whether layer `depth` (1-based) gets an exit check at all."""
        n = self.parts.n_layers
        if depth >= n:
            return False  # the final layer's distribution comes from the normal path
        if not self.exit:
            return True
        # from l_min − 1: the layer before l_min gives the previous entropy (or candidate distribution)
        return (
            depth >= self.l_min - 1
            and (depth < self.l_min or (depth - self.l_min) % self.check_every == 0)
            and n - depth > self.head_cost
        )

    def after_layer(self, fwd: Forward, index: int, h_in: torch.Tensor, h: torch.Tensor) -> Exit | None:
        depth = index + 1
        if not self.inspects(depth):
            return None
        normed = self.parts.norm(fwd.last_states(h))
        rows_cpu = fwd.rows.cpu()
        check = torch.ones(len(rows_cpu), dtype=torch.bool)
        if self.exit and self.verdict_gate:
            if self._cand_w is None:
                self._cand_w = cast(torch.Tensor, self.parts.head.weight)[self.candidates]
            cand_dist = torch.softmax(self.parts.finish(normed @ self._cand_w.T).float(), -1).cpu()
            if self._prev_cand is None:
                self._prev_cand = torch.full((len(self.traces), len(self.candidates)), math.inf)
            moved = (cand_dist - self._prev_cand[rows_cpu]).abs().amax(-1)
            self._prev_cand[rows_cpu] = cand_dist
            check = (moved < self.gate_delta) & (depth >= self.l_min)
            if not bool(check.any()):
                return None
        idx = check.nonzero().squeeze(-1)
        sub = normed if bool(check.all()) else normed[idx.to(normed.device)]
        logits = self.parts.logits(sub)
        self._checks += len(idx)
        ent = entropy(logits).cpu()
        sub_rows = rows_cpu[idx]
        cand = (
            torch.softmax(logits.float(), -1)[:, self.candidates].cpu().tolist() if self.candidates else None
        )
        for i, (r, e) in enumerate(zip(sub_rows.tolist(), ent.tolist(), strict=True)):
            self.traces[r].entropies[depth] = e
            if cand is not None:
                self.traces[r].probs[depth] = cand[i]
        prev = self._prev[sub_rows]
        self._prev[sub_rows] = ent
        if not self.exit:
            return None
        if self.verdict_gate:  # stability was tested on the verdict distribution (the gate)
            exited = (depth >= self.l_min) & (ent < self.theta)
        else:
            exited = (depth >= self.l_min) & (ent < self.theta) & ((ent - prev).abs() < self.epsilon)
        if self.min_candidate_mass > 0 and cand is not None:
            # a low entropy that sits on other tokens says nothing about the verdict (seen on SmolLM2)
            exited &= torch.tensor([sum(c) >= self.min_candidate_mass for c in cand])
        if not bool(exited.any()):
            return None
        for r in sub_rows[exited].tolist():
            self.traces[r].exit_layer = depth
        full_exit = torch.zeros(len(rows_cpu), dtype=torch.bool)
        full_exit[idx[exited]] = True
        if len(idx) == len(rows_cpu):
            full_logits = logits
        else:
            full_logits = logits.new_zeros(len(rows_cpu), logits.shape[-1])
            full_logits[idx.to(logits.device)] = logits
        return Exit(full_exit.to(normed.device), full_logits)

    def after_forward(self, fwd: Forward, logits: torch.Tensor | None) -> None:
        n_layers = self.parts.n_layers
        layers = [t.exit_layer or n_layers for t in self.traces]
        if self._stats is not None:
            self._stats.bump("verify_rows", len(layers))
            self._stats.bump("verify_layers", sum(layers))
            self._stats.bump("verify_exits", sum(t.exit_layer is not None for t in self.traces))
            self._stats.bump("verify_checks", self._checks)
        if self._trace is None:
            return
        assert logits is not None
        probs = torch.softmax(logits.float(), dim=-1)[:, self.candidates]
        for row, t in enumerate(self.traces):
            if t.exit_layer is None:
                t.probs[n_layers] = probs[row].tolist()
        self._trace.extend(self.traces)


def layer_trace(
    parts: DecoderParts, n_rows: int, candidates: Sequence[int], stats: KVStats, trace: list[EntropyTrace]
) -> EntropyExit:
    """An observer that records every layer's entropy and exits nowhere (what calibration reads):
    the thresholds only decide where a trace marks stability, never where a row leaves."""
    return EntropyExit(
        parts,
        n_rows,
        CGEEConfig.PAPER_THETA,
        CGEEConfig.PAPER_EPSILON,
        1,
        exit=False,
        candidates=candidates,
        stats=stats,
        trace=trace,
    )


@dataclass(frozen=True)
class Thresholds:
    """The CGEE thresholds one config resolves to on one model."""

    theta: float
    l_min: int
    tau_conf: float
    r_gap: float

    @classmethod
    def resolve(cls, cfg: CGEEConfig, model: str) -> Thresholds:
        """Explicit values win; otherwise the model's saved calibration; otherwise the paper's defaults."""
        cal = Calibration.load(model)

        def pick(explicit: float | None, calibrated: float | None, paper: float) -> float:
            return explicit if explicit is not None else calibrated if calibrated is not None else paper

        return cls(
            theta=pick(cfg.theta, cal.theta if cal else None, cfg.PAPER_THETA),
            l_min=int(pick(cfg.l_min, cal.l_min if cal else None, cfg.PAPER_L_MIN)),
            tau_conf=pick(cfg.tau_conf, cal.tau_conf if cal else None, cfg.PAPER_TAU_CONF),
            r_gap=pick(cfg.r_gap, cal.r_gap if cal else None, cfg.PAPER_R_GAP),
        )


class CGEE(Acceleration):
    """Level 1 (`skip_verify`), the decode gate (`stop_reason`) and level 2 (`verify_observer`).

    Statistics: `cgee_skip_checks` / `cgee_verify_skips` (level 1 asked / skipped the verify pass),
    `verify_rows` / `verify_exits` (level 2), `decode_gate_stops`."""

    name = "cgee"
    config = CGEEConfig

    def __init__(self, cfg: CGEEConfig, thresholds: Thresholds, parts: DecoderParts, stats: KVStats) -> None:
        self.cfg = cfg
        self.thresholds = thresholds
        self.parts = parts
        self.stats = stats
        # level 1 and the decode gate change no KV (a preempted row is recomputed from its tokens);
        # level 2's exits may leave a verify pass's KV without its last layers: swapped
        self.kv_from_tokens = not cfg.level2

    @classmethod
    def build(cls, cfg: CGEEConfig, setup: Setup) -> CGEE:
        """Thresholds resolve once per config and calibration file (a new calibration is picked up)."""
        name = setup.model_name
        thresholds = setup.cached(
            "cgee", ("cgee", cfg, calibration_stamp(name)), lambda: Thresholds.resolve(cfg, name)
        )
        return cls(cfg, thresholds, setup.host.parts, setup.host.stats)

    def skip_verify(self, confidences: Sequence[float]) -> bool:
        """RKSC Eq. 4 with this model's thresholds; False when level 1 is off."""
        if not self.cfg.level1:
            return False
        t = self.thresholds
        skip = verify_skip(confidences, t.tau_conf, t.r_gap)
        # counted so a run whose level 1 never skipped says so (`CGEEConfig.notes`)
        self.stats.bump("cgee_skip_checks")
        if skip:
            self.stats.bump("cgee_verify_skips")
        return skip

    def stop_reason(self, rows: Sequence[Row], step: int) -> FinishReason | None:
        """App. I.1 decode-level gate: one branch's running confidence is decisive (θ_dec, r_dec)."""
        cfg = self.cfg
        if not cfg.decode_gate or len(rows) < 2 or step + 1 < cfg.decode_gate_min_tokens:
            return None
        running = [sum(r.top1) / len(r.top1) for r in rows if r.top1]
        if not verify_skip(running, cfg.theta_dec, cfg.r_dec):
            return None
        self.stats.bump("decode_gate_stops")
        return "confident"

    def verify_observer(
        self, n_rows: int, candidates: Sequence[int], trace: list[Any] | None
    ) -> EntropyExit | None:
        if not self.cfg.level2:
            return None
        t = self.thresholds
        return EntropyExit(
            self.parts,
            n_rows,
            t.theta,
            self.cfg.epsilon,
            t.l_min,
            candidates=candidates,
            min_candidate_mass=self.cfg.min_candidate_mass,
            stats=self.stats,
            trace=trace,
            check_every=self.cfg.check_every,
            verdict_gate=self.cfg.verdict_gate,
            cost_aware=self.cfg.cost_aware,
        )


# ---------------------------------------------------------------------------------------------- calibration
@dataclass
class Calibration:
    """Per-model CGEE thresholds fit on held-out problems (RKSC §2.3)."""

    model: str
    tau_conf: float
    r_gap: float
    theta: float
    l_min: int
    n_problems: int
    n_verify_rows: int
    flips_at_l_min: int

    def save(self, path: Path | None = None) -> Path:
        path = path or calibration_path(self.model)
        path.parent.mkdir(parents=True, exist_ok=True)
        # written aside, then moved into place: a process loading it meanwhile (two benchmarks of
        # one machine, an eval beside a server) reads the old file or the new one, never half of one
        temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temp.write_text(json.dumps(self.__dict__, indent=2))
        os.replace(temp, path)
        return path

    @classmethod
    def load(cls, model: str, path: Path | None = None) -> Calibration | None:
        path = path or calibration_path(model)
        if not path.is_file():
            return None
        return cls(**json.loads(path.read_text()))


def calibration_path(model: str) -> Path:
    """Where a model's calibration lives: `<cache>/calibration/<model>.json`."""
    return model_file("calibration", model, "json")


def calibration_stamp(model: str) -> tuple[int, int] | None:
    """When and how big the saved calibration is, so a new calibration is picked up (None: none)."""
    path = calibration_path(model)
    if not path.is_file():
        return None
    stat = path.stat()
    return stat.st_mtime_ns, stat.st_size


def calibrate_from(
    model: str,
    confidences_per_problem: Sequence[Sequence[float]],
    traces_per_problem: Sequence[Sequence[EntropyTrace]],
    epsilon: float,
    l_min: int,
    n_layers: int,
    n_yes: int = 1,
) -> Calibration:
    """Percentile rules of §2.3 applied to observed confidences and verify entropy traces.

    Beyond the paper, `l_min` is raised to the smallest exit layer whose replayed exits flip no
    held-out decision (the best-scored branch of each problem), when such a layer exists: on small
    models the logit lens is sharply peaked in early layers, and the paper's l_min = 2 exits there.
    """
    if not confidences_per_problem:
        raise ValueError("confidences_per_problem is empty: calibrate on at least 1 problem")
    maxima = [max(c) for c in confidences_per_problem if c]
    gaps = [gap_ratio(c) for c in confidences_per_problem if len(c) > 1]
    traces = [t for group in traces_per_problem for t in group]
    stable = [s[1] for s in (t.first_stable(epsilon, l_min) for t in traces) if s is not None]
    theta = float(np.median(stable)) if stable else CGEEConfig.PAPER_THETA
    best_l_min, flips = l_min, count_flips(traces_per_problem, theta, epsilon, l_min, n_layers, n_yes)
    for candidate in range(l_min, n_layers + 1):
        f = count_flips(traces_per_problem, theta, epsilon, candidate, n_layers, n_yes)
        if f == 0:
            best_l_min, flips = candidate, 0
            break
    return Calibration(
        model=model,
        tau_conf=float(np.percentile(maxima, 75)),
        r_gap=float(np.percentile(gaps, 25)) if gaps else 0.0,
        theta=theta,
        l_min=best_l_min,
        n_problems=len(confidences_per_problem),
        n_verify_rows=len(traces),
        flips_at_l_min=flips,
    )


def count_flips(
    traces_per_problem: Sequence[Sequence[EntropyTrace]],
    theta: float,
    epsilon: float,
    l_min: int,
    n_layers: int,
    n_yes: int = 1,
) -> int:
    """How many problems' chosen branch (argmax judge score) would change under these exit thresholds."""
    flips = 0
    for group in traces_per_problem:
        if not group or any(n_layers not in t.probs for t in group):
            continue
        full = [judge_score(t.probs[n_layers], n_yes) for t in group]
        early = []
        for t in group:
            layer = t.exit_at(theta, epsilon, l_min) or n_layers
            early.append(judge_score(t.probs.get(layer, t.probs[n_layers]), n_yes))
        flips += int(np.argmax(full) != np.argmax(early))
    return flips
