"""One config object for the inference accelerations, each switchable on its own.

Why here (not in `hf/`): the config is plain pydantic, so strategies files, eval suites and the CLI
can build and validate it without torch. The local backend reads it on every op, so an acceleration
applies under every strategy without the strategy knowing. A field left `None` means "off".
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ASKSConfig(_Config):
    """RKSC §2.2: share the root KV with branches whose hidden states stay close to the root's (Eq. 2)."""

    tau: float = Field(0.82, ge=0.0, le=1.0, description="similarity threshold τ")
    alpha: float = Field(1.5, ge=0.0, le=10.0, description="layer-weight exponent α_w")


class ProbeConfig(_Config):
    """RKSC §2.2 KV probe: time recompute vs share once per 64-token prefix bucket and cache the verdict."""

    bucket_tokens: int = Field(64, ge=1, le=65536)
    repeats: int = Field(3, ge=1, le=20, description="timings per path; the minimum is used")
    override: Literal["auto", "share", "recompute"] = Field(
        "auto", description="'share'/'recompute' skip the timing (tests, users who know their regime)"
    )


class CGEEConfig(_Config):
    """RKSC §2.3: confidence-gated early exit of the verify pass.

    Level 1 skips the verify pass when generation confidence is decisive (Eq. 4); level 2 stops the
    verify forward at the first layer whose logit entropy is low and stable (Eq. 5). `theta=None`
    uses the model's saved calibration (`branchwise calibrate`) or, without one, the paper's 8.0 nats;
    `tau_conf`, `r_gap` and `l_min` left `None` likewise take the calibrated values, or the paper's
    0.70, 0.06 and 2.
    """

    level1: bool = True
    level2: bool = True
    tau_conf: float | None = Field(
        None, ge=0.0, le=1.0, description="None = calibrated, else the paper's 0.70"
    )
    r_gap: float | None = Field(None, ge=0.0, le=1.0, description="None = calibrated, else the paper's 0.06")
    theta: float | None = Field(None, gt=0.0, le=100.0, description="entropy threshold θ (nats)")
    epsilon: float = Field(3.0, gt=0.0, le=100.0, description="entropy stabilisation tolerance ε (nats)")
    min_candidate_mass: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="beyond the paper: exit only where the verdict tokens hold this much probability (0 = off)",
    )
    l_min: int | None = Field(
        None, ge=1, le=1000, description="minimum exit layer (1-based); None = calibrated, else the paper's 2"
    )
    decode_gate: bool = Field(
        False, description="App. I.1: stop decoding once one branch is decisively confident"
    )
    theta_dec: float = Field(0.72, ge=0.0, le=1.0)
    r_dec: float = Field(0.10, ge=0.0, le=1.0)
    decode_gate_min_tokens: int = Field(4, ge=1, le=100000)

    @classmethod
    def lossless(cls, **kwargs: object) -> CGEEConfig:
        """Level 2 alone: the verify pass always runs; only its depth adapts."""
        return cls(level1=False, level2=True, **kwargs)  # type: ignore[arg-type]


class RSBCMConfig(_Config):
    """RKSC §2.4: hold KV in blocks; above capacity evict the lowest ω = mass·score/(depth+1) blocks."""

    capacity_blocks: int = Field(2000, ge=1, le=10_000_000)
    block_tokens: int = Field(16, ge=1, le=65536)
    pin_prompt: bool = Field(
        True, description="never evict depth-0 segments (the prompt every branch shares)"
    )


class Accel(_Config):
    """Which accelerations are on. `Accel()` = all off (plain exact/none sharing)."""

    asks: ASKSConfig | None = None
    probe: ProbeConfig | None = None
    cgee: CGEEConfig | None = None
    rsbcm: RSBCMConfig | None = None

    @classmethod
    def rksc(cls) -> Accel:
        """The full RKSC configuration with the paper's defaults."""
        return cls(asks=ASKSConfig(), probe=ProbeConfig(), cgee=CGEEConfig(), rsbcm=RSBCMConfig())
