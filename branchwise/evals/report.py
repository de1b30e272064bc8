"""Eval report: accuracy and cost per cell, speedup against the baseline cell, markdown and PNG plots.

Each cell (model, dataset, strategy, acceleration) is compared with its *baseline cell*: same model,
dataset and strategy, run with the suite's baseline acceleration (the first one unless ``baseline``
is set). Comparisons are **paired** over the problems both cells finished without error:

* speedup = Σ baseline latency / Σ cell latency over those problems, with a bootstrap 95 % CI that
  resamples problems (the pairing keeps the per-problem difficulty out of the interval);
* agreement = share of those problems where the cell's final answer equals the baseline's (the
  measure that matters for a lossy acceleration on a model too small to be accurate);
* accuracy has its own bootstrap 95 % CI over the cell's problems.

Cost columns: mean latency, mean generated tokens, mean and max KV peak bytes. Columns for the CGEE
work (verify-skip rate from ``verify_skipped``/``verify_calls``, decision flips from ``cgee_flip``)
appear only when rows carry those keys with data. Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from branchwise.evals.harness import CONFIG_FILE, ROWS_FILE, read_rows
from branchwise.evals.stats import N_RESAMPLES, bootstrap_ci

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


def _plot_accuracy_vs_cost(summaries: list[CellSummary], path: Path) -> None:
    """One panel per dataset: accuracy (bootstrap CI) against mean latency; colour = strategy (and
    model), marker = acceleration, a thin line joins one strategy's accelerations. Legends instead
    of point labels, which overlap as soon as cells cost about the same."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    datasets = list(dict.fromkeys(s.dataset for s in summaries))
    accels = list(dict.fromkeys(s.accel for s in summaries))
    models = list(dict.fromkeys(s.model for s in summaries))
    series = list(dict.fromkeys((s.model, s.strategy) for s in summaries))
    colors = plt.get_cmap("tab10")

    def series_label(model: str, strategy: str) -> str:
        return strategy if len(models) == 1 else f"{model} / {strategy}"

    cols = min(3, len(datasets))
    rows = math.ceil(len(datasets) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 4.2 * rows), squeeze=False)
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
            yerr = None if math.isnan(lo) else [[max(s.accuracy - lo, 0)], [max(hi - s.accuracy, 0)]]
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
    marker_handles = [
        Line2D([], [], marker=_MARKERS[i % len(_MARKERS)], ls="", color="gray", label=a)
        for i, a in enumerate(accels)
    ]
    color_handles = [
        Line2D([], [], marker="o", ls="-", lw=0.8, color=colors(i % 10), label=series_label(*key))
        for i, key in enumerate(series)
    ]
    first = fig.legend(
        handles=marker_handles, title="acceleration", loc="upper left", bbox_to_anchor=(0.86, 0.93)
    )
    fig.add_artist(first)
    fig.legend(handles=color_handles, title="strategy", loc="upper left", bbox_to_anchor=(0.86, 0.55))
    fig.suptitle("Accuracy vs cost (error bars: bootstrap 95% CI)")
    fig.tight_layout(rect=(0, 0, 0.85, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_bars(
    path: Path,
    *,
    title: str,
    xlabel: str,
    values: list[tuple[str, float, Any]],
    reference: float | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.45 * max(len(values), 2) + 1.6))
    labels = [v[0] for v in values]
    heights = [v[1] for v in values]
    y = np.arange(len(values))
    xerr = None
    if any(v[2] is not None for v in values):
        lo = [max(h - v[2][0], 0) if v[2] else 0 for h, v in zip(heights, values, strict=True)]
        hi = [max(v[2][1] - h, 0) if v[2] else 0 for h, v in zip(heights, values, strict=True)]
        xerr = [lo, hi]
    bars = ax.barh(y, heights, xerr=xerr, capsize=4, color="tab:blue", alpha=0.8)
    if reference is not None:
        ax.axvline(reference, color="black", ls="--", lw=1)
    ax.bar_label(bars, labels=[f"{h:.2f}" for h in heights], padding=4, fontsize=8)
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    plots = [out / "accuracy_vs_cost.png", out / "speedup.png", out / "kv_peak.png"]
    _plot_accuracy_vs_cost(summaries, plots[0])
    speed = [
        (
            f"{s.dataset}/{s.strategy}/{s.accel}"
            + ("" if len({x.model for x in summaries}) == 1 else f" ({s.model})"),
            s.speedup,
            s.speedup_ci,
        )
        for s in summaries
        if s.speedup is not None
    ]
    if speed:
        _plot_bars(
            plots[1],
            title=f"Speedup vs baseline '{baseline}' (bootstrap 95% CI)",
            xlabel="speedup (×, higher is faster)",
            values=speed,
            reference=1.0,
        )
    else:
        plots.remove(plots[1])
    one_model = len({x.model for x in summaries}) == 1
    kv = [
        (s.cell.split("/", 1)[1] if one_model else s.cell, s.kv_peak_mean_bytes / 2**20, None)
        for s in summaries
        if not math.isnan(s.kv_peak_mean_bytes)
    ]
    if kv:
        _plot_bars(
            plots[-1],
            title="KV cache peak per problem (mean)" + (f", {summaries[0].model}" if one_model else ""),
            xlabel="MiB",
            values=kv,
        )
    else:
        plots.remove(plots[-1])
    done = f"{len(_dedupe(rows))} rows" + (f" of {expected}" if expected else "")
    md = [
        f"# Eval report: {suite_name}",
        "",
        f"{done}; baseline acceleration: `{baseline}`. Speedup = Σ baseline latency / Σ latency over "
        "problems both cells finished (paired); CIs are percentile bootstraps over problems "
        f"({N_RESAMPLES} resamples). Agreement = same final answer as the baseline on those problems.",
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
