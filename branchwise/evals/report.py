"""Eval report: accuracy and cost per cell, speedup against the baseline cell, markdown and PNG plots.

Each cell (model, dataset, strategy, acceleration) is compared with its *baseline cell*: same model,
dataset and strategy, run with the suite's baseline acceleration (the first one unless ``baseline``
is set). Comparisons are **paired** over the problems both cells finished without error:

* speedup = Σ baseline latency / Σ cell latency over those problems, with a bootstrap 95 % CI that
  resamples problems (the pairing keeps the per-problem difficulty out of the interval);
* agreement = share of those problems where the cell's final answer equals the baseline's (the
  measure that matters for a lossy acceleration on a model too small to be accurate);
* accuracy has its own bootstrap 95 % CI over the cell's problems.

A CI needs at least ``MIN_PROBLEMS`` (five) problems, paired ones for a speedup (fewer have too few
distinct resamples for a percentile interval to mean anything, see ``branchwise.evals.stats``): a
cell with fewer has none, its table entry is the value alone, and the plots and the report's caption
say why.

Cost columns: mean latency, mean generated tokens, mean and max KV peak bytes. Columns for the CGEE
work (verify-skip rate from ``verify_skipped``/``verify_calls``, decision flips from ``cgee_flip``)
appear only when rows carry those keys with data. Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
import math
import textwrap
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from branchwise.evals.harness import CONFIG_FILE, ROWS_FILE, read_rows
from branchwise.evals.stats import MIN_PROBLEMS, N_RESAMPLES, bootstrap_ci

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CellSummary", "format_markdown", "summarize", "write_report"]


@dataclass
class CellSummary:
    """One row of the report."""

    cell: str
    model: str
    dataset: str
    strategy: str
    accel: str
    is_baseline: bool
    n: int
    errors: int
    accuracy: float
    accuracy_ci: tuple[float, float]
    mean_score: float
    latency_mean_s: float
    latency_median_s: float
    tokens_generated_mean: float
    kv_peak_mean_bytes: float
    kv_peak_max_bytes: float
    paired: int = 0
    speedup: float | None = None
    speedup_ci: tuple[float, float] | None = None
    agreement: float | None = None
    verify_skip_rate: float | None = None
    cgee_flips: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


def _dedupe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keep the first row per (cell, problem): the harness never writes two, but hand-merged files may."""
    seen: set[tuple[Any, Any]] = set()
    out = []
    for r in rows:
        key = (r.get("cell"), r.get("problem_id"))
        if key in seen:
            continue
        seen.add(key)
        out.append(r)
    return out


def _mean(values: list[float | None]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return float(np.mean(vals)) if vals else math.nan


def summarize(rows: list[dict[str, Any]], baseline: str | None = None) -> list[CellSummary]:
    """Per-cell summaries in first-seen order; `baseline` is an acceleration label (default: the
    acceleration of the first row)."""
    rows = _dedupe(rows)
    if not rows:
        return []
    baseline = baseline or rows[0]["accel"]
    cells: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        cells[r["cell"]].append(r)
    groups = {cid: (rs[0]["model"], rs[0]["dataset"], rs[0]["strategy"]) for cid, rs in cells.items()}
    base_of = {group: cid for cid, group in groups.items() if cells[cid][0]["accel"] == baseline}
    any_verify = any((r.get("verify_calls") or 0) > 0 or r.get("verify_skipped") for r in rows)
    any_flip = any(r.get("cgee_flip") is not None for r in rows)

    out = []
    for cid, rs in cells.items():
        first = rs[0]
        ok = [r for r in rs if not r.get("error")]
        correct = np.array([1.0 if r.get("correct") else 0.0 for r in rs])
        lat = [r["latency_s"] for r in ok if r.get("latency_s") is not None]
        peaks = [r["kv_peak_bytes"] for r in ok if r.get("kv_peak_bytes") is not None]
        s = CellSummary(
            cell=cid,
            model=first["model"],
            dataset=first["dataset"],
            strategy=first["strategy"],
            accel=first["accel"],
            is_baseline=first["accel"] == baseline,
            n=len(rs),
            errors=len(rs) - len(ok),
            accuracy=float(correct.mean()) if len(correct) else math.nan,
            accuracy_ci=bootstrap_ci([correct], np.mean),
            mean_score=_mean([r.get("score") for r in rs]),
            latency_mean_s=_mean(lat),
            latency_median_s=float(np.median(lat)) if lat else math.nan,
            tokens_generated_mean=_mean([r.get("tokens_generated") for r in ok]),
            kv_peak_mean_bytes=_mean(peaks),
            kv_peak_max_bytes=float(max(peaks)) if peaks else math.nan,
        )
        if any_verify:
            calls = sum(r.get("verify_calls") or 0 for r in ok)
            skipped = sum(float(r.get("verify_skipped") or 0) for r in ok)
            s.verify_skip_rate = skipped / calls if calls else None  # no verify step in this cell
        if any_flip:
            s.cgee_flips = sum(1 for r in ok if r.get("cgee_flip"))
        base_id = base_of.get(groups[cid])
        if base_id is not None and base_id != cid:
            base = {r["problem_id"]: r for r in cells[base_id] if not r.get("error")}
            pairs = [
                (base[r["problem_id"]], r)
                for r in ok
                if r["problem_id"] in base
                and r.get("latency_s") is not None
                and base[r["problem_id"]].get("latency_s") is not None
            ]
            s.paired = len(pairs)
            if pairs:
                base_s = np.array([b["latency_s"] for b, _ in pairs], dtype=float)
                cell_s = np.array([c["latency_s"] for _, c in pairs], dtype=float)

                def ratio(base: np.ndarray, cell: np.ndarray) -> float:
                    denom = cell.sum()
                    return float(base.sum() / denom) if denom > 0 else math.nan

                s.speedup = ratio(base_s, cell_s)
                s.speedup_ci = bootstrap_ci([base_s, cell_s], ratio)
                s.agreement = float(np.mean([b.get("answer") == c.get("answer") for b, c in pairs]))
        out.append(s)
    return out


# --------------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def _ci(ci: tuple[float, float] | None, fmt: str = "{:.2f}") -> str:
    if ci is None or any(math.isnan(v) for v in ci):
        return ""
    return f" [{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def format_markdown(summaries: list[CellSummary]) -> str:
    """The summary table as GitHub markdown."""
    show_verify = any(s.verify_skip_rate is not None for s in summaries)
    show_flips = any(s.cgee_flips is not None for s in summaries)
    header = [
        "model",
        "dataset",
        "strategy",
        "accel",
        "n",
        "accuracy [95% CI]",
        "agree w/ base",
        "latency mean (s)",
        "speedup [95% CI]",
        "tokens gen (mean)",
        "KV peak mean / max (MiB)",
        "errors",
    ]
    if show_verify:
        header.append("verify-skip rate")
    if show_flips:
        header.append("CGEE flips")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for s in summaries:
        speed = (
            "baseline" if s.is_baseline else (_f(s.speedup) + "×" + _ci(s.speedup_ci) if s.speedup else "–")
        )
        cells = [
            s.model,
            s.dataset,
            s.strategy,
            s.accel,
            str(s.n),
            _f(s.accuracy, "{:.1%}") + _ci(s.accuracy_ci, "{:.0%}"),
            "–" if s.is_baseline else _f(s.agreement, "{:.0%}"),
            _f(s.latency_mean_s),
            speed,
            _f(s.tokens_generated_mean, "{:.0f}"),
            f"{_f(s.kv_peak_mean_bytes / 2**20, '{:.1f}')} / {_f(s.kv_peak_max_bytes / 2**20, '{:.1f}')}",
            str(s.errors),
        ]
        if show_verify:
            cells.append(_f(s.verify_skip_rate, "{:.0%}"))
        if show_flips:
            cells.append("–" if s.cgee_flips is None else str(s.cgee_flips))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

_MARKERS = "osD^v<>Pp*hX"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: reports are written on servers without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _has_ci(ci: tuple[float, float] | None) -> bool:
    return ci is not None and all(math.isfinite(v) for v in ci)


def accuracy_vs_cost_figure(summaries: list[CellSummary]) -> Figure:
    """One panel per dataset: accuracy (bootstrap CI) against mean latency; colour = strategy (and
    model), marker = acceleration, a thin line joins one strategy's accelerations. A legend instead
    of point labels, which overlap as soon as cells cost about the same.

    The figure uses constrained layout with its one legend placed *outside* the panels on the right,
    so the layout engine reserves room for it: a legend anchored at a fixed fraction of the figure
    ran off the right edge as soon as a label was longer than a few characters.
    """
    from matplotlib.lines import Line2D

    plt = _pyplot()
    datasets = list(dict.fromkeys(s.dataset for s in summaries))
    accels = list(dict.fromkeys(s.accel for s in summaries))
    models = list(dict.fromkeys(s.model for s in summaries))
    series = list(dict.fromkeys((s.model, s.strategy) for s in summaries))
    colors = plt.get_cmap("tab10")

    def series_label(model: str, strategy: str) -> str:
        return strategy if len(models) == 1 else f"{model} / {strategy}"

    cols = min(3, len(datasets))
    rows = math.ceil(len(datasets) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.2 * cols + 2.0, 4.2 * rows + 0.6), squeeze=False, layout="constrained"
    )
    for ax, ds in zip(axes.flat, datasets, strict=False):
        cells = [s for s in summaries if s.dataset == ds and not math.isnan(s.latency_mean_s)]
        for i, key in enumerate(series):
            line = [s for s in cells if (s.model, s.strategy) == key]
            if len(line) > 1:
                ax.plot(
                    [s.latency_mean_s for s in line],
                    [s.accuracy for s in line],
                    color=colors(i % 10),
                    lw=0.8,
                    alpha=0.5,
                )
        for s in cells:
            lo, hi = s.accuracy_ci
            yerr = [[max(s.accuracy - lo, 0)], [max(hi - s.accuracy, 0)]] if _has_ci(s.accuracy_ci) else None
            ax.errorbar(
                s.latency_mean_s,
                s.accuracy,
                yerr=yerr,
                fmt=_MARKERS[accels.index(s.accel) % len(_MARKERS)],
                color=colors(series.index((s.model, s.strategy)) % 10),
                ms=8,
                capsize=3,
                alpha=0.85,
            )
        ax.set_title(ds)
        ax.set_xlabel("mean latency per problem (s)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlim(0, max((s.latency_mean_s for s in cells), default=1.0) * 1.15 or 1.0)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(datasets) :]:
        ax.axis("off")

    # One legend, two groups under their own headings: two legends stacked at guessed heights
    # overlap each other once either has a few entries.
    def heading(text: str) -> Line2D:
        return Line2D([], [], ls="", marker="", label=text)

    handles = [
        heading("acceleration (marker)"),
        *(
            Line2D([], [], marker=_MARKERS[i % len(_MARKERS)], ls="", color="gray", label=a)
            for i, a in enumerate(accels)
        ),
        heading("strategy (colour)" if len(models) == 1 else "model / strategy (colour)"),
        *(
            Line2D([], [], marker="o", ls="-", lw=0.8, color=colors(i % 10), label=series_label(*key))
            for i, key in enumerate(series)
        ),
    ]
    legend = fig.legend(handles=handles, loc="outside right upper", handlelength=1.6)
    for text, handle in zip(legend.get_texts(), handles, strict=True):
        if handle.get_marker() in ("", "None", None):
            text.set_fontweight("bold")
    # The caption goes under the panels (constrained layout reserves room for a supxlabel): as a
    # long suptitle it ran under the legend, which takes the top right corner.
    too_few = any(s.n < MIN_PROBLEMS for s in summaries)
    fig.suptitle("Accuracy vs cost")
    fig.supxlabel(
        "error bars: bootstrap 95% CI of accuracy over problems"
        + (f"; none for a cell of fewer than {MIN_PROBLEMS} problems" if too_few else ""),
        fontsize=9,
    )
    return fig


@dataclass
class Bar:
    """One bar of a horizontal bar chart: its label, value, CI (drawn when finite) and value text."""

    label: str
    value: float
    ci: tuple[float, float] | None = None
    text: str = ""


def bars_figure(
    bars: list[Bar], *, title: str, xlabel: str, reference: float | None = None, note: str = ""
) -> Figure:
    """Horizontal bars with their CIs where finite, and each bar's value written on a right-hand
    axis.

    Why the values sit on their own axis: written at the end of a bar they ran into its error bar
    (the text started at the bar's end, the CI reaches past it) and past the plot's right edge for
    the longest bar. As tick labels of a secondary axis, constrained layout makes room for them
    and they never cover a bar or a CI. Each CI is its own errorbar container, labelled
    ``ci:<bar label>``, so what is drawn can be checked without reading pixels.
    """
    plt = _pyplot()
    # Labels are never shrunk by the layout, so the figure is as wide as its longest labels need
    # (about 0.065 in per character at 8 pt) plus 4 in for the bars; the note wraps to that width.
    values = [b.text or f"{b.value:.2f}" for b in bars]
    width = 4.0 + 0.065 * (max(len(b.label) for b in bars) + max(len(v) for v in values))
    note_lines = textwrap.wrap(note, width=int(width * 12)) if note else []
    fig, ax = plt.subplots(
        figsize=(width, 0.45 * max(len(bars), 2) + 1.9 + 0.2 * len(note_lines)), layout="constrained"
    )
    y = np.arange(len(bars))
    ax.barh(y, [b.value for b in bars], color="tab:blue", alpha=0.8)
    for yi, b in zip(y, bars, strict=True):
        if b.ci is not None and _has_ci(b.ci):
            lo, hi = b.ci
            ax.errorbar(
                b.value,
                yi,
                xerr=[[max(b.value - lo, 0)], [max(hi - b.value, 0)]],
                fmt="none",
                ecolor="black",
                capsize=4,
                label=f"ci:{b.label}",
            )
    if reference is not None:
        ax.axvline(reference, color="black", ls="--", lw=1)
    ax.set_yticks(y, [b.label for b in bars], fontsize=8)
    ax.set_ylim(len(bars) - 0.5, -0.5)  # first bar on top
    ax.set_xlim(0, None)
    right = ax.secondary_yaxis("right")
    right.set_yticks(y, values, fontsize=8)
    right.tick_params(length=0)
    ax.set_xlabel(xlabel)
    # On the figure, not the axes: an axes title is centred over the bars, which sit right of the
    # long labels, so a long note ran off the right edge.
    fig.suptitle("\n".join([title, *note_lines]), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    return fig


def speedup_bars(summaries: list[CellSummary]) -> list[Bar]:
    """The speedup bars of the non-baseline cells; each names its paired problem count, and one
    without a CI (as a rule: fewer than ``MIN_PROBLEMS`` paired problems) says it has none."""
    one_model = len({x.model for x in summaries}) == 1
    out = []
    for s in summaries:
        if s.speedup is None:
            continue
        label = f"{s.dataset}/{s.strategy}/{s.accel}" + ("" if one_model else f" ({s.model})")
        if s.speedup_ci is not None and _has_ci(s.speedup_ci):
            text = f"{s.speedup:.2f}× [{s.speedup_ci[0]:.2f}, {s.speedup_ci[1]:.2f}]  n={s.paired}"
        else:
            text = f"{s.speedup:.2f}×  n={s.paired}, no CI"
        out.append(Bar(label, s.speedup, s.speedup_ci, text))
    return out


def speedup_figure(summaries: list[CellSummary], baseline: str | None) -> Figure | None:
    """Speedup of each cell over its baseline cell, or None when no cell was paired with one."""
    bars = speedup_bars(summaries)
    if not bars:
        return None
    no_ci = [s for s in summaries if s.speedup is not None and not _has_ci(s.speedup_ci)]
    few = sum(1 for s in no_ci if s.paired < MIN_PROBLEMS)
    other = len(no_ci) - few
    note = "error bars: bootstrap 95% CI over paired problems (n)"
    if few:
        note += f"; no CI for {few} cell{'s' if few > 1 else ''} of fewer than {MIN_PROBLEMS} paired problems"
    if other:
        note += f"; no CI for {other} cell{'s' if other > 1 else ''} whose resampled speedup was not finite"
    return bars_figure(
        bars,
        title=f"Speedup vs baseline '{baseline}'",
        xlabel="speedup (×, higher is faster; dashed: baseline)",
        reference=1.0,
        note=note,
    )


def kv_peak_figure(summaries: list[CellSummary]) -> Figure | None:
    """Mean KV peak per problem of each cell, or None when no row reported one."""
    one_model = len({x.model for x in summaries}) == 1
    bars = [
        Bar(
            s.cell.split("/", 1)[1] if one_model else s.cell,
            s.kv_peak_mean_bytes / 2**20,
            text=f"{s.kv_peak_mean_bytes / 2**20:.2f} MiB",
        )
        for s in summaries
        if not math.isnan(s.kv_peak_mean_bytes)
    ]
    if not bars:
        return None
    return bars_figure(
        bars,
        title="KV cache peak per problem (mean)" + (f", {summaries[0].model}" if one_model else ""),
        xlabel="MiB",
    )


def _save(fig: Figure, path: Path) -> None:
    """Write `fig` as a PNG. ``bbox_inches="tight"`` on top of the layout: should a label still
    stick out (an unusual font, a very long name), the image grows to hold it rather than crop it."""
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.1)
    _pyplot().close(fig)


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


@dataclass
class ReportPaths:
    markdown: Path
    summary_json: Path
    plots: list[Path]


def write_report(run_dir: str | Path, baseline: str | None = None) -> ReportPaths:
    """(Re)generate ``report.md``, ``summary.json`` and the PNG plots of a run directory."""
    out = Path(run_dir)
    rows = read_rows(out / ROWS_FILE)
    if not rows:
        raise ValueError(f"{out / ROWS_FILE} holds no rows yet")
    suite_name, expected = out.name, None
    config = out / CONFIG_FILE
    if config.exists():
        record = json.loads(config.read_text())
        suite = record.get("suite", {})
        suite_name = suite.get("name", suite_name)
        if baseline is None:
            accels = suite.get("accelerations") or []
            baseline = suite.get("baseline") or (accels[0]["label"] if accels else None)
        expected = record.get("expected_rows")
    summaries = summarize(rows, baseline)
    table = format_markdown(summaries)
    figures = {
        "accuracy_vs_cost.png": accuracy_vs_cost_figure(summaries),
        "speedup.png": speedup_figure(summaries, baseline),
        "kv_peak.png": kv_peak_figure(summaries),
    }
    plots = []
    for name, fig in figures.items():
        if fig is not None:
            _save(fig, out / name)
            plots.append(out / name)
    done = f"{len(_dedupe(rows))} rows" + (f" of {expected}" if expected else "")
    md = [
        f"# Eval report: {suite_name}",
        "",
        f"{done}; baseline acceleration: `{baseline}`. Speedup = Σ baseline latency / Σ latency over "
        "problems both cells finished (paired); CIs are percentile bootstraps over problems "
        f"({N_RESAMPLES} resamples), given only for a cell of at least {MIN_PROBLEMS} problems (paired "
        "ones for a speedup): fewer have too few distinct resamples for the interval to mean anything. "
        "Agreement = same final answer as the baseline on those problems.",
        "",
        table,
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
    ]
    md_path = out / "report.md"
    md_path.write_text("\n".join(md))
    summary_path = out / "summary.json"
    summary_path.write_text(json.dumps([s.as_dict() for s in summaries], indent=2, default=str))
    return ReportPaths(markdown=md_path, summary_json=summary_path, plots=plots)
