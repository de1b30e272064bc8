"""Notes on decode steps that left the fast step, each with its reason.

Why: a result must never imply a speed it did not get. The local backend's fast step is the
fixed-shape decode step (`hf/step.py`), compiled where `decode_step` asks for it and captured as
CUDA graphs where it records them. Every decode step that did not run that way, for whatever
reason, is counted (`decode_steps_off_fast`) with its reasons (`off_fast_by <reason>`: how many
steps each reason kept off it), and this turns those counters into one note, in one place for every
front end: a strategy's result (`Accel.notes` adds it to the accelerations' own), and the replies of
plain decodes (`Generation.notes`, which the server, LangChain and DSPy fronts pass on).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

OFF_FAST = "decode_steps_off_fast"
"""The statistic that counts decode steps that left the fast step (each once, whatever its reasons)."""
OFF_FAST_BY = "off_fast_by "
"""The prefix of the per-reason statistics: `off_fast_by <reason>` counts the steps it kept off."""


class OffFast(str, Enum):
    """Why a decode step left the fast step. A plug-in that needs the layer loop gives reasons of
    its own (`hf/hooks.py`, `Acceleration.layer_loop_reasons`: its name by default); a compiled step
    that could not run compiled adds why (`uncompiled: <why>`)."""

    LAYERS_MODE = "decode_step_layers"
    """`decode_step="layers"` asked for the layer loop (the benchmarks' baseline)."""
    OBSERVER = "observer"
    """A per-call observer (a verify or capture pass) watches the forward between layers."""
    ATTENTION_TAP = "attention_tap"
    """An attention tap that no plug-in declared."""
    PREFILL_CHUNK = "prefill_chunk"
    """The step carried a prompt's chunk (its length varies): run uncompiled and uncaptured."""
    PAGES_COPIED = "pages_copied"
    """The batch keeps its rows' KV in pages, and this step read a gathered copy of them instead of
    reading them in place (`pages_copied: <why>`: no paged kernel here, a tap, a soft-capped or
    windowed layer)."""
    UNCOMPILED = "uncompiled"
    """A compiled step was asked for and did not run (`uncompiled: <why>`: its kind compiling in the
    background, a failed compilation, a batch its guards refused)."""


def off_fast_counts(stats: Mapping[str, float]) -> dict[str, int]:
    """Each reason's count of decode steps it kept off the fast step."""
    return {k.removeprefix(OFF_FAST_BY): int(v) for k, v in stats.items() if k.startswith(OFF_FAST_BY)}


def off_fast_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """The off-fast statistics one call added (`after` less `before`), for its own replies' notes."""
    out = {}
    for key, value in after.items():
        if (key == OFF_FAST or key.startswith(OFF_FAST_BY)) and (grown := value - before.get(key, 0.0)):
            out[key] = grown
    return out


def step_notes(stats: Mapping[str, float]) -> list[str]:
    """What a run's result says about decode steps that left the fast step: one note, with each
    reason and how many steps it kept off (a step may have several reasons)."""
    count = int(stats.get(OFF_FAST, 0))
    if not count:
        return []
    reasons = ", ".join(f"{why} ({n})" for why, n in sorted(off_fast_counts(stats).items()))
    return [f"{count} decode steps left the fast step (fixed-shape, compiled where asked): {reasons}"]
