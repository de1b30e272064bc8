"""CGEE calibration (RKSC §2.3): fit τ_conf, r_gap, θ (and a decision-safe l_min) per model.

Why in `reasoners`: calibration runs the same decode + judge pass a reasoner runs (prompt → B
branches → LM-as-judge), on held-out questions, with level 2 off so every layer's entropy is seen.
The percentile rules themselves live with the mechanism in `backends/hf/cgee.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from branchwise.backends.accel import Accel, CGEEConfig
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.cgee import Calibration, EntropyTrace, calibrate_from
from branchwise.reasoners.verifiers import JudgeVerifier


def calibrate_cgee(
    backend: HFBackend,
    questions: Sequence[str],
    *,
    n: int = 8,
    max_tokens: int = 32,
    temperature: float = 0.7,
    seed: int = 0,
    epsilon: float = CGEEConfig.PAPER_EPSILON,
    l_min: int = CGEEConfig.PAPER_L_MIN,
    judge: JudgeVerifier | None = None,
    save: bool = True,
    progress: bool = True,
) -> Calibration:
    """Decode `n` branches per question, judge them at every layer, and fit the thresholds."""
    if not questions:
        raise ValueError("questions is empty: calibrate on at least 1 held-out question")
    judge = judge or JudgeVerifier()
    suffix, tokens, n_yes = judge.probe(backend)
    confidences: list[list[float]] = []
    traces: list[list[EntropyTrace]] = []
    run = backend.session(accel=Accel())  # record every layer; no exits while calibrating
    for i, question in enumerate(tqdm(questions, desc="calibrating", disable=not progress)):
        root = run.prefill(run.chat_prompt([{"role": "user", "content": question}]))
        kids = run.fork(root, n)
        run.release([root])
        try:
            params = DecodeParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
            gens = run.extend(kids, params)
            confidences.append([g.confidence for g in gens])
            trace: list[EntropyTrace] = []
            run.score_next(kids, suffix, tokens, trace=trace)
            traces.append(trace)
        finally:
            run.release(kids)
    calibration = calibrate_from(
        backend.model_name, confidences, traces, epsilon, l_min, backend.parts.n_layers, n_yes
    )
    if save:
        calibration.save()
    return calibration
