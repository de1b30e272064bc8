"""Notes on decode steps that did not run as their mode asked.

Why: a result must never imply a speed it did not get. The local backend's fixed-shape step
(`hf/step.py`) counts the steps a plug-in kept on the layer loop where steps are captured, and the
steps that ran uncompiled (a compilation failed, or a kind of batch came past torch's recompile
limit); this turns those counters into the result's
notes (`Accel.notes` adds them to the accelerations' own), in one place for every front end.
"""

from __future__ import annotations

from collections.abc import Mapping

STEP_NOTES = (
    (
        "uncaptured",
        ", ",
        "{count} decode steps ran uncaptured through the layer loop, not as CUDA graphs: "
        "{why} need its hook points (they act between layers or watch attention)",
    ),
    ("uncompiled", "; ", "{count} decode steps ran uncompiled: {why}"),
)
"""Notes on decode steps that did not run as their mode asked: the statistic's kind, how its
reasons join, the wording."""


def step_notes(stats: Mapping[str, float]) -> list[str]:
    """What a run's result says about decode steps that did not run as their mode asked (the local
    backend's fixed-shape step, `hf/step.py`): kept on the layer loop where steps are captured, or
    run uncompiled after a compilation failed; the reasons come from the `<kind>_by <reason>` keys."""
    notes = []
    for kind, sep, text in STEP_NOTES:
        if count := int(stats.get(f"decode_steps_{kind}", 0)):
            why = sep.join(k.removeprefix(f"{kind}_by ") for k in stats if k.startswith(f"{kind}_by "))
            notes.append(text.format(count=count, why=why))
    return notes
